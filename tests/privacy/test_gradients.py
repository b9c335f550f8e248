"""Vectorised per-example gradients, clipping and per-subject averaging vs naive loops."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from silodp.models import MODELS, build_model
from silodp.privacy.gradients import (
    CLIP_MARGIN,
    WIDE_COLUMNS,
    batch_gradient,
    clip_factors,
    per_example_gradients,
    per_example_norms,
    row_norms,
    subject_average_weights,
    tree_norm,
    weighted_sum,
)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _naive_per_example(model, x, y) -> dict[str, torch.Tensor]:
    """A Python loop of single-example autograd gradients (the reference)."""
    names = [k for k, _ in model.named_parameters()]
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for i in range(x.shape[0]):
        model.zero_grad()
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
        for k, g in zip(names, grads, strict=True):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


# (name, feature shape, classes, batch, dtype); float64 where torch supports it under vmap.
# nn.LSTM has no float64 vmap path on CPU (its batching fallback breaks), so the LSTM is
# checked in float32 at 1e-4 relative.
MODEL_CASES = [
    ("mlp", (6,), 4, 5, torch.float64),
    ("linear", (2, 3), 4, 5, torch.float64),
    ("mnist_cnn", (1, 8, 8), 10, 4, torch.float64),
    ("mnist_cnn", (1, 28, 28), 10, 3, torch.float64),
    ("femnist_cnn", (1, 28, 28), 62, 2, torch.float64),
    ("uldp_cnn", (1, 28, 28), 10, 3, torch.float64),
    ("shakespeare_lstm", (5,), 80, 3, torch.float32),
]


def test_model_cases_cover_every_model() -> None:
    assert {c[0] for c in MODEL_CASES} == set(MODELS)


def _inputs(name, shape, classes, batch, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if name == "shakespeare_lstm":
        x = torch.randint(0, classes, (batch, *shape), generator=gen)
    else:
        x = torch.randn((batch, *shape), generator=gen, dtype=dtype)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return x, y


@pytest.mark.parametrize(("name", "shape", "classes", "batch", "dtype"), MODEL_CASES)
def test_per_example_gradients_match_naive_loop(name, shape, classes, batch, dtype) -> None:
    model = build_model(name, shape, classes, seed=1).to(dtype)
    x, y = _inputs(name, shape, classes, batch, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # functorch's LSTM batching fallback
        fast = per_example_gradients(model, _params(model), x, y)
    naive = _naive_per_example(model, x, y)
    assert fast.keys() == naive.keys()
    if dtype == torch.float64:
        rtol, atol = 1e-9, 1e-12
    else:
        rtol, atol = 1e-4, 1e-6
    for k in naive:
        assert fast[k].shape == (batch, *dict(model.named_parameters())[k].shape)
        torch.testing.assert_close(fast[k], naive[k], rtol=rtol, atol=atol)
        assert fast[k].dtype == dtype
    # the examples' gradients really differ (the check is not vacuous)
    flat = torch.cat([g.reshape(batch, -1) for g in fast.values()], dim=1)
    assert torch.linalg.matrix_rank(flat.double()) == batch


def _mlp(seed: int = 0):
    return build_model("mlp", (5,), 3, seed=seed).double()


def _data(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64) * 3.0
    y = torch.randint(0, 3, (n,), generator=gen)
    return x, y


def test_batch_gradient_is_mean_of_per_example() -> None:
    model = _mlp()
    x, y = _data(9)
    params = _params(model)
    per = per_example_gradients(model, params, x, y)
    mean = batch_gradient(model, params, x, y)
    for k in per:
        torch.testing.assert_close(mean[k], per[k].mean(0), rtol=1e-12, atol=1e-14)


def test_per_example_norms_and_tree_norm() -> None:
    model = _mlp()
    x, y = _data(6)
    per = per_example_gradients(model, _params(model), x, y)
    norms = per_example_norms(per)
    for i in range(6):
        flat = torch.cat([g[i].flatten() for g in per.values()])
        assert norms[i].item() == pytest.approx(flat.norm().item(), rel=1e-12)
        single = {k: g[i] for k, g in per.items()}
        assert tree_norm(single).item() == pytest.approx(flat.norm().item(), rel=1e-12)
    assert tree_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}).item() == 5.0


@pytest.mark.parametrize("clip", [1e-3, 0.1, 1.0, 100.0])
def test_clip_factors(clip) -> None:
    norms = torch.tensor([0.0, 1e-4, 0.05, 0.5, 2.0, 50.0], dtype=torch.float64)
    f = clip_factors(norms, clip)
    assert torch.all(f <= 1.0) and torch.all(f > 0)
    clipped = f * norms
    assert torch.all(clipped <= clip)
    # below the bound: untouched; above: brought to the bound less the margin
    limit = clip * (1 - CLIP_MARGIN)
    below = norms <= limit
    torch.testing.assert_close(f[below], torch.ones_like(f[below]))
    torch.testing.assert_close(
        clipped[~below], torch.full_like(clipped[~below], limit), rtol=1e-9, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_clip_factors_equal_the_formula(dtype) -> None:
    """``clamp(C(1 - CLIP_MARGIN) / (n + 1e-12), max=1)`` computed in float64 and returned in
    the norms' dtype (integers promoted as torch promotes them), 0 where the norm is not
    finite, 0-d tensors included."""
    gen = torch.Generator().manual_seed(0)
    norms = (torch.rand(20_000, generator=gen, dtype=torch.float64) * 10).to(dtype)
    if dtype.is_floating_point:
        norms[:3] = torch.tensor([math.inf, math.nan, 0.0], dtype=dtype)
    wide = norms.double()
    limit = torch.full_like(wide, 0.3 * (1 - CLIP_MARGIN))
    expected = torch.clamp(limit / (wide + 1e-12), max=1.0)
    expected = expected.masked_fill(~torch.isfinite(wide), 0.0)
    expected = expected.to(dtype if dtype.is_floating_point else torch.get_default_dtype())
    got = clip_factors(norms, 0.3)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    assert torch.equal(clip_factors(norms[4], 0.3), expected[4])


@pytest.mark.parametrize("columns", [5, WIDE_COLUMNS, 3 * WIDE_COLUMNS + 5])
def test_row_norms_are_float64_norms_taken_by_blocks_of_columns(columns) -> None:
    rows = torch.randn(4, columns, generator=torch.Generator().manual_seed(columns)) * 1e3
    got = row_norms(rows)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, rows.double().norm(dim=1), rtol=1e-14, atol=0)


@pytest.mark.parametrize("elements", [7, 1_000, 100_000])
def test_clipped_float32_vectors_stay_within_the_clip(elements) -> None:
    """Each clipped per-example gradient, as released in float32 (``clip_factors`` over
    ``per_example_norms``, then the weighted sum of one row), has float64 norm at most C.
    With float32 norms and the exact factor the released norm came out up to ~2e-7
    relative above C."""
    gen = torch.Generator().manual_seed(elements)
    worst = 0.0
    for _ in range(20):
        scale = 10.0 ** float(torch.empty(()).uniform_(-3, 3, generator=gen))
        rows = torch.randn(64, elements, generator=gen) * scale
        grads = {"w": rows[:, : elements // 2 + 1], "b": rows[:, elements // 2 + 1 :]}
        clip = float(torch.empty(()).uniform_(0.1, 2.0, generator=gen)) * scale
        factors = clip_factors(per_example_norms(grads), clip)
        for i in range(rows.shape[0]):
            one = torch.zeros(rows.shape[0])
            one[i] = 1.0
            released = weighted_sum(grads, one * factors)
            norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in released.values()))
            worst = max(worst, norm / clip)
    assert 0.999 < worst <= 1.0


def _naive_subject_sum(per, subjects, clip):
    """For each subject: mean of its clipped per-example gradients; summed over subjects."""
    out = {k: torch.zeros_like(g[0]) for k, g in per.items()}
    for a in sorted(set(subjects.tolist())):
        rows = [i for i in range(len(subjects)) if subjects[i].item() == a]
        for k, g in per.items():
            acc = torch.zeros_like(g[0])
            for i in rows:
                norm = math.sqrt(sum(float(h[i].pow(2).sum()) for h in per.values()))
                acc = acc + g[i] * min(1.0, clip * (1 - CLIP_MARGIN) / norm)
            out[k] = out[k] + acc / len(rows)
    return out


@pytest.mark.parametrize(
    "subjects",
    [
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [7, 7, 3, 7, 3, 9, 9, 7],
        [-5, 1000, -5, 2**40, 1000, 1000, -5, 12],
    ],
)
@pytest.mark.parametrize("clip", [0.05, 1.0, 1e3])
def test_subject_average_matches_naive_loop(subjects, clip) -> None:
    model = _mlp(2)
    x, y = _data(len(subjects), seed=3)
    per = per_example_gradients(model, _params(model), x, y)
    subj = torch.tensor(subjects, dtype=torch.int64)
    weights = subject_average_weights(clip_factors(per_example_norms(per), clip), subj)
    fast = weighted_sum(per, weights)
    naive = _naive_subject_sum(per, subj, clip)
    for k in naive:
        torch.testing.assert_close(fast[k], naive[k], rtol=1e-10, atol=1e-12)
    # each subject's weights sum to at most 1 (its average has norm <= C)
    for a in set(subjects):
        assert weights[subj == a].sum().item() <= 1.0 + 1e-12


def test_weighted_sum_matches_loop() -> None:
    model = _mlp()
    x, y = _data(4)
    per = per_example_gradients(model, _params(model), x, y)
    w = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    out = weighted_sum(per, w)
    for k, g in per.items():
        ref = sum(w[i] * g[i] for i in range(4))
        torch.testing.assert_close(out[k], ref, rtol=1e-12, atol=1e-14)


def test_clip_tree_releases_a_vector_of_norm_at_most_clip() -> None:
    """Clipped to its float32 norm, a vector came out up to 1.5e-7 above C once rounded
    (user_ldp and uldp_naive account sensitivity exactly C)."""
    from silodp.privacy.gradients import CLIP_MARGIN, clip_tree

    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    worst_before = worst = -1.0
    for _ in range(400):
        d = int(rng.integers(1, 5000))
        tree = {
            "w": torch.randn(d, generator=gen) * float(10 ** rng.uniform(-2, 4)),
            "b": torch.randn(3, generator=gen) * 0.01,
        }
        clip = float(rng.choice([1e-3, 1.0, 7.5]))
        norm = float(np.sqrt(sum(float((t.double() ** 2).sum()) for t in tree.values())))
        out = clip_tree(tree, clip)
        released = float(np.sqrt(sum(float((t.double() ** 2).sum()) for t in out.values())))
        worst = max(worst, released / clip - 1.0)
        # what clipping to the float32 norm released (the former rule), for comparison
        factor = min(1.0, clip / float(torch.sqrt(sum(t.pow(2).sum() for t in tree.values()))))
        old = {k: t * factor for k, t in tree.items()}
        before = float(np.sqrt(sum(float((t.double() ** 2).sum()) for t in old.values())))
        worst_before = max(worst_before, before / clip - 1.0)
        if norm <= clip * (1 - CLIP_MARGIN):
            assert all(torch.equal(out[k], tree[k]) for k in tree)  # left as it is
        else:
            assert released == pytest.approx(clip, rel=2 * CLIP_MARGIN)
    assert worst <= 0.0 < worst_before  # the former rule went above C on this sample
    zeros = clip_tree({"w": torch.tensor([float("nan"), 1.0])}, 1.0)
    assert torch.equal(zeros["w"], torch.zeros(2))
