"""A record or subject whose gradient or delta is not finite contributes nothing: clipping
gives it factor 0 and drops it, so the others' clipped sum is unchanged and finite (with
``0·inf = NaN`` it would otherwise turn the whole message into NaN, or have it refused — an
output that depends on that one record or subject)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from silodp.algorithms import SiloData, make_algorithm
from silodp.algorithms.dp_sgd import clipped_sum
from silodp.data import FederatedDataset
from silodp.models import MLP, MnistCNN
from silodp.privacy import ghost
from silodp.privacy.gradients import CLIP_MARGIN, clip_factors, drop_non_finite
from silodp.privacy.randomness import Coins

BAD = (math.inf, -math.inf, math.nan)


def _finite_close(a: dict, b: dict, tol: float = 1e-9) -> None:
    for k in b:
        assert torch.isfinite(a[k]).all(), k
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), (k, float((a[k] - b[k]).abs().max()))


def test_clip_factors_are_zero_for_non_finite_norms_and_those_rows_are_dropped() -> None:
    norms = torch.tensor([0.5, 4.0, math.inf, math.nan], dtype=torch.float64)
    factors = clip_factors(norms, 1.0)
    assert factors[0] == 1.0 and abs(float(factors[1]) - 0.25 * (1 - CLIP_MARGIN)) < 1e-12
    assert factors[2:].tolist() == [0.0, 0.0]
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [math.inf, 0.0], [math.nan, 1.0]])
    assert drop_non_finite(rows, norms).tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]
    assert torch.equal(drop_non_finite(rows[:2], norms[:2]), rows[:2])


def _silo(model_kind: str, n: int = 18, subjects: int = 6, seed: int = 0) -> SiloData:
    gen = torch.Generator().manual_seed(seed)
    shape = (5,) if model_kind == "mlp" else (1, 8, 8)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=gen)
    subject = torch.arange(n) % subjects
    return SiloData(0, x, y, subject)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(5, 3, hidden=8).double()
    return MnistCNN(num_classes=3, in_channels=1, side=8).double()


def _poisoned(silo: SiloData, rows: torch.Tensor, value: float) -> SiloData:
    x = silo.x.clone()
    x[rows, ..., 0] = value
    return SiloData(silo.silo, x, silo.y, silo.subject)


def _drop(silo: SiloData, rows: torch.Tensor) -> SiloData:
    keep = torch.ones(len(silo.y), dtype=torch.bool)
    keep[rows] = False
    return SiloData(silo.silo, silo.x[keep], silo.y[keep], silo.subject[keep])


def _dp_sgd_case(kind: str, grad_method: str):
    """A model, its parameters, an 18-record silo and local_item_dp's config (clip 0.5)."""
    model = _model(kind)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    config = make_algorithm(
        "local_item_dp", dict(clip=0.5, grad_method=grad_method, noise_multiplier=1.0)
    ).config
    return model, params, _silo(kind), config


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("grad_method", ["auto", "vmap"])
@pytest.mark.parametrize("value", BAD)
def test_dp_sgd_clipped_sum_skips_a_non_finite_record(kind, grad_method, value) -> None:
    model, params, silo, config = _dp_sgd_case(kind, grad_method)
    bad = torch.tensor([4])
    got = clipped_sum(model, params, _poisoned(silo, bad, value), torch.arange(18), config=config)
    clean = _drop(silo, bad)
    want = clipped_sum(model, params, clean, torch.arange(17), config=config)
    _finite_close(got, want)


@pytest.mark.parametrize("kind", ["mlp", "mlp_torch", "cnn"])
@pytest.mark.parametrize("value", BAD)
def test_subject_norms_and_sum_skips_a_non_finite_subject(kind, value) -> None:
    """``mlp``: the compiled path; ``mlp_torch``: the same model through torch."""
    model = _model(kind.removesuffix("_torch"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    silo = _silo(kind.removesuffix("_torch"))
    clipper = ghost.GhostClipper(model, compiled=not kind.endswith("_torch"))
    weights = torch.linspace(0.5, 1.0, 6, dtype=torch.float64)

    def weigh(norms: torch.Tensor) -> torch.Tensor:
        return weights[: norms.numel()] * clip_factors(norms, 0.3)

    rows = torch.nonzero(silo.subject == 5).flatten()  # the last subject: weights line up
    poisoned = _poisoned(silo, rows[:1], value)
    norms, got = clipper.subject_norms_and_sum(
        params, poisoned.x, poisoned.y, silo.subject, weigh=weigh
    )
    assert not math.isfinite(float(norms[5])) and torch.isfinite(norms[:5]).all()
    clean = _drop(silo, rows)
    _, want = clipper.subject_norms_and_sum(params, clean.x, clean.y, clean.subject, weigh=weigh)
    _finite_close(got, want)


def _federation(kind: str, records: int) -> FederatedDataset:
    rng = np.random.default_rng(1)
    subjects = np.concatenate([np.repeat(np.arange(5), records), [0]])
    n = len(subjects)
    shape = (5,) if kind == "mlp" else (1, 8, 8)
    return FederatedDataset(  # silo 1 holds one more record of subject 0
        x=rng.normal(size=(n, *shape)),
        y=rng.integers(0, 3, n),
        silo=np.concatenate([np.zeros(n - 1, dtype=int), [1]]),
        subject=subjects,
        num_classes=3,
    )


#: σ = 0 and one batch per epoch: the message is a deterministic sum over the subjects
ULDP_CONFIG = dict(noise_multiplier=0.0, lr=0.3, clip=0.2, local_epochs=2, batch_size=100)


def _first_silo(train: FederatedDataset) -> SiloData:
    own = train.silo_indices(0)
    return SiloData(
        0,
        torch.from_numpy(np.ascontiguousarray(train.x[own])).double(),
        torch.from_numpy(train.y[own]),
        torch.from_numpy(train.subject[own]),
    )


@pytest.mark.parametrize(
    ("name", "kind", "records"),
    [
        ("uldp_avg", "mlp", 3),  # vmap over subjects
        ("uldp_sgd", "mlp", 3),  # per-subject norms (ghost)
        ("uldp_avg", "cnn", 4),  # stacked copies
        ("uldp_sgd", "cnn", 1),  # per-subject norms (ghost) on a CNN
    ],
)
@pytest.mark.parametrize("value", BAD)
def test_uldp_message_skips_a_subject_with_a_non_finite_delta(name, kind, records, value) -> None:
    """σ = 0, one batch per epoch: the silo's message with subject 4's records poisoned
    equals the message of the silo without subject 4."""
    train = _federation(kind, records)
    model = _model(kind)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = dict(ULDP_CONFIG)
    algo = make_algorithm(name, cfg, train)
    instr = algo.configure_round(1, Coins.seeded(0))
    silo = _first_silo(train)
    rows = torch.nonzero(silo.subject == 4).flatten()
    got = algo.local_update(model, params, _poisoned(silo, rows[:1], value), Coins.seeded(2), instr)
    want = algo.local_update(model, params, _drop(silo, rows), Coins.seeded(2), instr)
    _finite_close(got.params, want.params)
    moved = sum(float(v.abs().sum()) for v in want.params.values())
    assert moved > 1e-3  # the other subjects do contribute


@pytest.mark.parametrize("value", BAD)
def test_protocol_silo_sends_a_zero_vector_for_a_subject_with_a_non_finite_delta(value) -> None:
    """uldp_avg_w through the weighting protocol: the clipped vectors a silo weighs are the
    clean silo's, and a zero vector for the poisoned subject."""
    from silodp.algorithms.uldp import UldpAvgW

    train = _federation("mlp", 3)
    model = _model("mlp")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = dict(ULDP_CONFIG)
    silo = _first_silo(train)
    rows = torch.nonzero(silo.subject == 4).flatten()
    sent = []
    for data in (_poisoned(silo, rows[:1], value), _drop(silo, rows)):
        algo = UldpAvgW.for_data(
            dict(cfg, n_max=8),
            train,
            insecure_test_key_bits=512,
            coins=Coins.seeded(0),
        )
        party = algo.protocol.silos[0]
        party.weighted_sum = lambda message, vectors, **kw: sent.append(vectors)
        algo.local_update(
            model, params, data, Coins.seeded(2), algo.configure_round(1, Coins.seeded(1))
        )
    poisoned, clean = sent
    assert set(poisoned) == set(clean) | {4}
    assert not poisoned[4].any()
    for a in clean:
        assert np.isfinite(poisoned[a]).all()
        assert np.allclose(poisoned[a], clean[a], atol=1e-12, rtol=0)
    assert any(np.abs(v).sum() > 1e-3 for v in clean.values())


@pytest.mark.parametrize("name", ["uldp_naive", "user_ldp"])
@pytest.mark.parametrize("value", BAD)
def test_whole_vector_clipping_sends_zeros_for_a_non_finite_vector(name, value) -> None:
    """uldp_naive clips the silo's delta, user_ldp each step's mean gradient, as one vector:
    a non-finite one becomes zeros (σ = 0 here), not a NaN message or an error."""
    from silodp.privacy.gradients import clip_tree

    vector = {"w": torch.tensor([1.0, value]), "b": torch.tensor([3.0])}
    assert all(not v.any() for v in clip_tree(vector, 1.0).values())
    finite = clip_tree({"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}, 1.0)
    assert torch.allclose(finite["w"], torch.tensor([0.6, 0.0]))
    train = _federation("mlp", 3)
    model = _model("mlp")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    cfg = dict(noise_multiplier=0.0, lr=0.3, clip=0.2, local_epochs=1, batch_size=100)
    algo = make_algorithm(name, cfg, train)
    silo = _first_silo(train)
    poisoned = _poisoned(silo, torch.tensor([0]), value)  # in every (full) batch
    update = algo.local_update(model, params, poisoned, Coins.seeded(2))
    for k, v in update.params.items():
        assert torch.isfinite(v).all()
        baseline = torch.zeros_like(v) if name == "uldp_naive" else params[k]
        assert torch.equal(v.to(baseline.dtype), baseline), k


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("grad_method", ["auto", "vmap"])
def test_a_batch_of_only_non_finite_records_sums_to_zero(kind, grad_method) -> None:
    model, params, silo, config = _dp_sgd_case(kind, grad_method)
    bad = _poisoned(silo, torch.arange(18), math.nan)
    for idx in (torch.arange(18), torch.tensor([3])):
        got = clipped_sum(model, params, bad, idx, config=config)
        assert all(torch.equal(v, torch.zeros_like(v)) for v in got.values())


class _ScalesItsInput(torch.nn.Module):
    """Multiplies its input by 10 in place, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mul_(10.0))


def test_dropping_a_record_does_not_run_the_model_again() -> None:
    """The kept records' clip factors and gradients come from one pass: a model writing to
    its input still gets every kept contribution clipped to C."""
    torch.manual_seed(0)
    model = _ScalesItsInput().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    clipper = ghost.clipper_for(model)
    x = torch.randn(3, 5, dtype=torch.float64)
    x[0, 0] = math.inf
    y = torch.tensor([0, 1, 2])
    _, summed = clipper.norms_and_sum(params, x.clone(), y, clip=0.1)
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in summed.values()))
    assert norm <= 2 * 0.1 + 1e-12  # two kept records, each clipped to 0.1
    subjects = torch.tensor([0, 1, 1])
    _, summed = clipper.subject_norms_and_sum(
        params, x.clone(), y, subjects, weigh=lambda n: clip_factors(n, 0.1)
    )
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in summed.values()))
    assert norm <= 0.1 + 1e-12  # one kept subject
