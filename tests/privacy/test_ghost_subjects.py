"""Per-subject norms of one-position linear layers (pairs for small subjects, chunked
gradients for big ones; or one masked Gram matrix of a small batch; or the compiled path of a
plain MLP) equal those of materialised per-subject gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from silodp.models import build_model
from silodp.privacy import dense_kernel, ghost
from silodp.privacy.ghost import GhostClipper
from silodp.privacy.gradients import (
    clip_factors,
    per_example_gradients,
    per_example_norms,
    weighted_sum,
)

TOL = 1e-10  # float64


def _zipf(batch: int, pool: int, seed: int) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, pool + 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights, batch, replacement=True, generator=gen)


def _small(model: nn.Module) -> int:
    """The model's largest "small" subject (pairs route)."""
    layers = [
        (torch.zeros(1, m.in_features), torch.zeros(1, m.out_features), m.bias is not None)
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    return ghost._small_limit(layers)


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} was used")

    return refuse


@pytest.fixture(params=["lists", "dense", "compiled"])
def route(request, monkeypatch) -> str:
    """The routes for the linear layers: pairs and chunks (the dense Gram route off), the
    dense Gram route for any batch (pairs and chunks refused), or the compiled path (the
    torch routes refused; the models of these tests are then plain ReLU MLPs)."""
    if request.param == "lists":
        monkeypatch.setattr(ghost, "DENSE_GRAM_MACS", 0)
    elif request.param == "dense":
        monkeypatch.setattr(ghost, "DENSE_GRAM_MACS", 2**62)
        monkeypatch.setattr(ghost, "_linear_subject_sq", _refuse("pairs and chunks"))
    else:
        monkeypatch.setattr(ghost, "_model_subject_sq", _refuse("a torch route"))
    return request.param


def _clipper(model: nn.Module, route: str) -> GhostClipper:
    return GhostClipper(model, compiled=route == "compiled")


def _layouts(batch: int, small: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    big = ghost.SUBJECT_CHUNK * 2 + 5  # three chunks
    return {
        "uniform": torch.randint(0, 7 * batch, (batch,), generator=gen),
        "skewed": _zipf(batch, 12, seed=2),
        "all_single": torch.randperm(batch, generator=gen) * 3,
        "one_subject": torch.full((batch,), 4),
        # the class edges: ``small`` records (pairs), one more (chunks), a single record
        "edges": torch.tensor(
            [0] * small + [1] * (small + 1) + [2] + [3] * big + [5, 5], dtype=torch.long
        )[torch.randperm(2 * small + big + 4, generator=gen)][:batch],
    }


def _mlp(bias: bool, route: str = "lists") -> nn.Module:
    """The library's MLP (biases), or one without biases: with a Tanh (the hooks' path), or
    a ReLU where the compiled path is tested."""
    torch.manual_seed(0)
    if bias:
        return build_model("mlp", (12,), 5).double()
    act = nn.ReLU() if route == "compiled" else nn.Tanh()
    return nn.Sequential(nn.Linear(12, 9, bias=False), act, nn.Linear(9, 5, bias=False)).double()


def _materialised(model, params, x, y, subjects):
    """Norms of per-subject mean gradients and the per-subject means themselves."""
    ids, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
    grads = per_example_gradients(model, params, x, y)
    mean = {
        k: torch.zeros(len(ids), *g.shape[1:], dtype=g.dtype).index_add_(0, inverse, g)
        / counts.to(g.dtype).reshape(-1, *[1] * (g.dim() - 1))
        for k, g in grads.items()
    }
    return per_example_norms(mean), mean


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["uniform", "skewed", "all_single", "one_subject", "edges"])
def test_subject_norms_and_sum_equal_materialised_per_subject_gradients(
    bias, layout, route
) -> None:
    model = _mlp(bias, route)
    small = _small(model)
    subjects = _layouts(2 * small + ghost.SUBJECT_CHUNK * 2 + 9, small)[layout]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(subjects.numel(), 12, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 5, (subjects.numel(),), generator=gen)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    norms, mean = _materialised(model, params, x, y, subjects)
    coeff = torch.linspace(-1.0, 2.0, norms.numel(), dtype=torch.float64)
    expected = weighted_sum(mean, coeff / (1.0 + norms))

    got_norms, got = _clipper(model, route).subject_norms_and_sum(
        params, x, y, subjects, weigh=lambda n: coeff / (1.0 + n)
    )

    err = float((got_norms - norms).abs().max() / norms.abs().max())
    assert err <= TOL, (layout, err)
    for key in expected:
        scale = float(expected[key].abs().max()) + 1e-30
        err = float((got[key] - expected[key]).abs().max()) / scale
        assert err <= TOL, (layout, key, err)


@pytest.mark.parametrize("bias", [True, False])
def test_the_layouts_exercise_every_route(bias) -> None:
    """Guards the test above: its layouts have single records, pairs and several chunks."""
    small = _small(_mlp(bias))
    assert small < ghost.SUBJECT_CHUNK  # else the "edges" subjects are all small
    seen = {"pairs": 0, "chunks": 0, "singles": 0}
    for subjects in _layouts(2 * small + ghost.SUBJECT_CHUNK * 2 + 9, small).values():
        _, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
        layout = ghost._Subjects(inverse, counts, small)
        seen["pairs"] += int(layout.pair_i.numel())
        seen["chunks"] = max(seen["chunks"], layout.num_chunks)
        seen["singles"] += int((counts == 1).sum())
    assert seen["pairs"] > 0
    assert seen["chunks"] >= 3
    assert seen["singles"] > 0


def test_subjects_list_exactly_the_pairs_of_each_small_subject() -> None:
    subjects = _zipf(200, 60, seed=5)
    _, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
    small = 6
    layout = ghost._Subjects(inverse, counts, small)
    expected = set()
    for s in range(counts.numel()):
        rows = torch.nonzero(inverse == s).flatten().tolist()
        if 1 < len(rows) <= small:
            expected |= {(s, i, j) for i, j in itertools.combinations(rows, 2)}
    got = {
        (int(s), min(int(i), int(j)), max(int(i), int(j)))
        for s, i, j in zip(layout.pair_subject, layout.pair_i, layout.pair_j, strict=True)
    }
    assert got == expected
    assert len(got) == layout.pair_i.numel()  # no pair listed twice
    assert layout.num_chunks > layout.big_ids.numel()  # a subject in several chunks
    # every record of a big subject sits in exactly one chunk of its subject
    chunks = layout.chunks.view(layout.num_chunks, ghost.SUBJECT_CHUNK)
    for big, owner_rows in zip(layout.big_ids.tolist(), range(layout.big_ids.numel()), strict=True):
        held = chunks[layout.owner == owner_rows].flatten()
        held = sorted(held[held < subjects.numel()].tolist())
        assert held == torch.nonzero(inverse == big).flatten().tolist()


def test_passes_and_one_pass_agree(route) -> None:
    subjects = _zipf(90, 20, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(90, 12, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 5, (90,), generator=gen)
    model = _mlp(True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    norms, mean = _materialised(model, params, x, y, subjects)
    expected = weighted_sum(mean, 1.0 / (1.0 + norms))
    clipper = _clipper(model, route)
    for max_batch in (4096, 8):
        clipper._record_bytes.clear()  # the pass size is then max_batch
        got_norms, got = clipper.subject_norms_and_sum(
            params, x, y, subjects, weigh=lambda n: 1.0 / (1.0 + n), max_batch=max_batch
        )
        err = float((got_norms - norms).abs().max() / norms.abs().max())
        assert err <= TOL, (max_batch, err)
        for key in expected:
            err = float((got[key] - expected[key]).abs().max() / expected[key].abs().max())
            assert err <= TOL, (max_batch, key, err)


def _zipf_batch(records: int, pool: int, seed: int):
    """The library's MLP (float64), its parameters, and a batch with Zipf subjects."""
    model = _mlp(True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    subjects = _zipf(records, pool, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(records, 12, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 5, (records,), generator=gen)
    return model, params, x, y, subjects


def test_a_small_batch_takes_the_dense_route_and_a_non_finite_record_the_other(
    monkeypatch,
) -> None:
    model, params, x, y, subjects = _zipf_batch(20, 5, seed=9)
    listed = []
    original = ghost._linear_subject_sq

    def spy(*args, **kwargs):
        listed.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ghost, "_linear_subject_sq", spy)
    clipper = GhostClipper(model, compiled=False)
    weigh = lambda n: 1.0 / (1.0 + n)  # noqa: E731
    norms, _ = clipper.subject_norms_and_sum(params, x, y, subjects, weigh=weigh)
    assert not listed  # 20 records: one Gram matrix
    x[3] = float("inf")
    bad = subjects[3]
    norms, _ = clipper.subject_norms_and_sum(params, x, y, subjects, weigh=weigh)
    assert listed  # the NaN would reach every subject: pairs and chunks instead
    ids = torch.unique(subjects)
    assert not torch.isfinite(norms[ids == bad]).any()
    assert torch.isfinite(norms[ids != bad]).all()


def test_the_compiled_path_leaves_out_a_non_finite_subject(monkeypatch) -> None:
    """A record with an infinite input: its subject's norm is not finite and its records are
    left out of the sum, which equals the torch routes' (the other subjects only)."""
    model, params, x, y, subjects = _zipf_batch(40, 6, seed=11)
    x[5] = float("inf")
    weigh = lambda n: torch.where(torch.isfinite(n), 1.0 / (1.0 + n), 0.0)  # noqa: E731
    expected_norms, expected = GhostClipper(model, compiled=False).subject_norms_and_sum(
        params, x, y, subjects, weigh=weigh
    )
    monkeypatch.setattr(ghost, "_model_subject_sq", _refuse("a torch route"))
    norms, got = GhostClipper(model).subject_norms_and_sum(params, x, y, subjects, weigh=weigh)
    ids = torch.unique(subjects)
    assert not torch.isfinite(norms[ids == subjects[5]]).any()
    finite = ids != subjects[5]
    torch.testing.assert_close(norms[finite], expected_norms[finite], rtol=1e-10, atol=0)
    for key, value in expected.items():
        assert torch.isfinite(got[key]).all()
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-12)


def test_the_compiled_path_applies_only_to_plain_relu_chains() -> None:
    relu = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert GhostClipper(relu)._kernel(torch.float32) is not None
    assert GhostClipper(relu, compiled=False)._kernel(torch.float32) is None
    for model in (
        nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.ReLU()),  # ends in ReLU
        nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)),  # no ReLU between
        nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)),  # not a chain of stock ops
    ):
        assert GhostClipper(model)._kernel(torch.float32) is None, model
    assert dense_kernel.DenseKernel.build([], torch.float32) is None
    hooked = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    clipper = GhostClipper(hooked)
    handle = hooked[0].register_forward_hook(lambda m, i, o: o * 2)
    assert clipper._kernel(torch.float32) is None  # hooks: the torch path runs them
    handle.remove()
    assert clipper._kernel(torch.float32) is not None


def _both(model: nn.Module, params, x, y, subjects, weigh):
    """The compiled path's and the torch routes' results, or the exception each raised."""
    out = []
    for compiled in (True, False):
        try:
            out.append(
                GhostClipper(model, compiled=compiled).subject_norms_and_sum(
                    params, x, y, subjects, weigh=weigh
                )
            )
        except Exception as err:  # noqa: BLE001
            out.append(err)
    return out


def _relu_mlp() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6, bias=False), nn.ReLU(), nn.Linear(6, 3)
    )
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_the_compiled_path_applies_relu_to_minus_infinity_as_torch() -> None:
    """A pre-activation of -inf: ReLU gives 0, as ``torch.relu``; the record is kept."""
    model, params = _relu_mlp()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    x[0] = 0.0
    x[0, 0] = 3e38
    params["0.weight"][:, 0] = -10.0  # -3e39 overflows to -inf before the ReLU
    subjects = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    weigh = lambda n: clip_factors(n, 1.0)  # noqa: E731
    (norms, got), (want_norms, want) = _both(model, params, x, y, subjects, weigh)
    assert torch.isfinite(norms).all()
    torch.testing.assert_close(norms, want_norms, rtol=1e-3, atol=0)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6)


def test_the_compiled_path_refuses_parameters_that_do_not_fit_the_model() -> None:
    """Wrong shapes go to the torch path, which raises as torch does (the compiled code
    would read past its buffers); a non-contiguous bias is fine."""
    model, params = _relu_mlp()
    x, y, subjects = torch.randn(8, 5), torch.randint(0, 3, (8,)), torch.arange(8) % 3
    weigh = lambda n: torch.ones_like(n)  # noqa: E731
    for name, shape in (("2.weight", (4, 7)), ("0.bias", (3,))):
        bad = dict(params, **{name: torch.randn(shape)})
        compiled, torch_routes = _both(model, bad, x, y, subjects, weigh)
        assert isinstance(compiled, RuntimeError) and isinstance(torch_routes, RuntimeError)
    strided = dict(params, **{"0.bias": torch.randn(14)[::2]})
    (norms, got), (want_norms, want) = _both(model, strided, x, y, subjects, weigh)
    torch.testing.assert_close(norms, want_norms, rtol=1e-4, atol=0)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6)


def test_the_compiled_release_checks_its_coefficients() -> None:
    """One coefficient per subject, or a ValueError naming the shapes; a NaN coefficient
    for a kept subject spreads as in torch (the mechanism then refuses the release)."""
    model, params = _relu_mlp()
    x, y, subjects = torch.randn(6, 5), torch.randint(0, 3, (6,)), torch.arange(6) % 3
    with pytest.raises(ValueError, match=r"one coefficient per subject, shape \(3,\)"):
        GhostClipper(model).subject_norms_and_sum(
            params, x, y, subjects, weigh=lambda n: torch.ones(1, dtype=n.dtype)
        )
    nan_first = lambda n: torch.tensor([math.nan, 1.0, 1.0], dtype=n.dtype)  # noqa: E731
    (_, got), (_, want) = _both(model, params, x, y, subjects, nan_first)
    for key, value in want.items():
        assert torch.isnan(value).any() and torch.isnan(got[key]).any(), key


def test_the_compiled_path_from_several_threads_gives_the_same_sums_and_restores_blas() -> None:
    import threading

    import threadpoolctl

    model, params = _relu_mlp()
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(64, 5, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    subjects = torch.randint(0, 9, (64,), generator=gen)
    clipper = GhostClipper(model)
    weigh = lambda n: clip_factors(n, 0.5)  # noqa: E731
    want_norms, want = clipper.subject_norms_and_sum(params, x, y, subjects, weigh=weigh)
    before = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()]
    failures: list[str] = []

    def work() -> None:
        for _ in range(20):
            norms, got = clipper.subject_norms_and_sum(params, x, y, subjects, weigh=weigh)
            if not torch.equal(norms, want_norms) or any(
                not torch.equal(got[k], want[k]) for k in want
            ):
                failures.append("differs")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert [lib["num_threads"] for lib in threadpoolctl.threadpool_info()] == before
