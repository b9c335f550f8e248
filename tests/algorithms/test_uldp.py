"""The ULDP-FL family: weights, subject sub-sampling (by the silos or the server) and who learns
the sample, local messages, sensitivity, server step, the weighting protocol.

Sensitivity is checked on the algorithms' own ``local_update`` with σ = 0: removing every record
of one subject from every silo moves the sum of the silos' messages (what secure aggregation
reveals) by at most ``Σ_s w_{s,a}·C <= C`` for ULDP-AVG/SGD, and by at most ``2·S·C`` for
ULDP-NAIVE (each silo's clipped delta can flip direction, so S·C is not a bound).
"""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.func import functional_call
from torch.nn import functional as F

from silodp.accounting.events import (
    gaussian_steps,
    known_sample_gaussian_steps,
    poisson_gaussian_steps,
)
from silodp.algorithms import SiloData, SiloUpdate, make_algorithm
from silodp.algorithms.uldp import (
    ProtocolRound,
    RoundWeights,
    UldpAvg,
    UldpAvgW,
    UldpNaive,
    UldpSgd,
    check_weights,
    record_weights,
    uniform_weights,
)
from silodp.crypto.errors import InsecureKeyError, SiloDropoutError
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset
from silodp.errors import InvalidValueError
from silodp.models import MLP
from silodp.privacy.gradients import CLIP_MARGIN, batch_gradient, tree_norm
from silodp.privacy.per_subject import per_subject_deltas_loop, subject_batches
from silodp.privacy.randomness import Coins


def _with(settings: dict, **values: object) -> dict:
    """``settings`` with some hyperparameters changed."""
    return {**settings, **values}


ALPHA = 1e-6
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ULDP_WEIGHTED = ("uldp_avg", "uldp_sgd", "uldp_avg_w")

_MODEL = MLP(5, 3, hidden=8).double()


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * 0.5
        for k, v in _MODEL.named_parameters()
    }


def _federation(
    n: int = 60, silos: int = 3, subjects: int = 8, seed: int = 0, dtype=np.float64
) -> FederatedDataset:
    rng = np.random.default_rng(seed)
    silo = np.concatenate([np.arange(silos), rng.integers(0, silos, n - silos)])
    return FederatedDataset(
        x=rng.normal(size=(n, 5)).astype(dtype),
        y=rng.integers(0, 3, n),
        silo=silo,
        subject=rng.integers(0, subjects, n),
        num_classes=3,
    )


def silo_tensors(train: FederatedDataset) -> list[SiloData]:
    return [
        SiloData(
            s,
            torch.from_numpy(np.ascontiguousarray(train.x[train.silo_indices(s)])),
            torch.from_numpy(train.y[train.silo_indices(s)]),
            torch.from_numpy(train.subject[train.silo_indices(s)]),
        )
        for s in range(train.num_silos)
    ]


def _float64(silo: SiloData) -> SiloData:
    return SiloData(silo.silo, silo.x.double(), silo.y, silo.subject)


def _without(silo: SiloData, subject: int) -> SiloData:
    keep = silo.subject != subject
    return SiloData(silo.silo, silo.x[keep], silo.y[keep], silo.subject[keep])


def _sum_messages(algo, params, silos, instructions, seed: int = 0) -> dict[str, torch.Tensor]:
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for silo in silos:
        update = algo.local_update(
            _MODEL, params, silo, Coins.seeded(seed, silo.silo), instructions
        )
        for k in total:
            total[k] = total[k] + update.params[k]
    return total


def _distance(a, b) -> float:
    return float(tree_norm({k: a[k] - b[k] for k in a}))


def _loss(model, params, x, y) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(functional_call(model, params, (x,)), y))


# --- weights -----------------------------------------------------------------------------


def test_check_weights_rejects_negative_weights_naming_the_entry() -> None:
    w = uniform_weights(3, 4)
    w[1, 2] = -0.125
    with pytest.raises(ValueError, match=r"weights >= 0.*w\[1, 2\]=-0\.125"):
        check_weights(w)
    with pytest.raises(ValueError, match=r"w\[1, 2\]=-0\.125"):
        UldpAvg(dict(), weights=w)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_check_weights_rejects_non_finite(bad) -> None:
    w = uniform_weights(2, 3)
    w[0, 1] = bad
    with pytest.raises(ValueError, match="finite weights; found NaN or inf"):
        check_weights(w)


def test_check_weights_rejects_a_subject_over_one_naming_it() -> None:
    w = uniform_weights(3, 5)
    w[:, 3] = [0.5, 0.4, 0.2]
    w[:, 4] = [0.9, 0.9, 0.0]
    with pytest.raises(ValueError, match=r"subject 3 sums to 1\.1 \(2 subject\(s\) over\)"):
        check_weights(w)
    with pytest.raises(ValueError, match="shape"):
        check_weights(np.ones(3) / 3)


def test_check_weights_accepts_valid_and_rounding_noise() -> None:
    w = np.array([[0.1, 0.0, 1 / 3], [0.2, 1.0, 1 / 3], [0.7, 0.0, 1 / 3 + 1e-12]])
    np.testing.assert_array_equal(check_weights(w), w)
    assert check_weights(np.zeros((2, 2))).sum() == 0  # all-zero (nobody trained) is valid


@pytest.mark.parametrize(("silos", "subjects"), [(1, 1), (3, 7), (16, 50)])
def test_uniform_weights(silos, subjects) -> None:
    w = uniform_weights(silos, subjects)
    assert w.shape == (silos, subjects)
    np.testing.assert_allclose(w, 1.0 / silos, rtol=0)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=1e-12)


def test_record_weights() -> None:
    hist = np.array([[2, 0, 0, 5], [1, 0, 3, 0]])
    w = record_weights(hist)
    np.testing.assert_allclose(w, [[2 / 3, 0, 0, 1], [1 / 3, 0, 1, 0]], rtol=1e-15)
    assert (w[:, 1] == 0).all()  # a subject without records gets a zero column
    check_weights(w)


def test_algorithms_set_up_their_weights_from_the_data() -> None:
    # subject 1 has no records: ids 0 and 2 only
    train = FederatedDataset(
        x=np.zeros((5, 5), dtype=np.float32),
        y=[0, 1, 0, 1, 0],
        silo=[0, 0, 1, 1, 1],
        subject=[0, 2, 0, 2, 2],
        num_classes=3,
    )
    avg_w = make_algorithm("uldp_avg_w", dict(weighting="clear"), train)
    np.testing.assert_allclose(avg_w.weights.numpy(), [[0.5, 0, 1 / 3], [0.5, 0, 2 / 3]])
    np.testing.assert_allclose(avg_w.weights.numpy(), record_weights(train.histogram()), rtol=1e-15)
    for name in ("uldp_avg", "uldp_sgd"):
        algo = make_algorithm(name, dict(), train)
        np.testing.assert_array_equal(algo.weights.numpy(), uniform_weights(2, 3))
    assert make_algorithm("uldp_naive", dict(), train).num_silos == 2


# --- subject sub-sampling: by the server, or by the silos from a key the server never sees --


def _sampler(q: float, silos: int = 3, subjects: int = 500, *, sampler: str = "server") -> UldpAvg:
    rng = np.random.default_rng(1)
    raw = rng.uniform(size=(silos, subjects))
    key = SharedSampleKey(bytes(32)) if sampler == "silos" else None
    cfg = dict(subject_rate=q, subject_sampler=sampler)
    return UldpAvg(cfg, weights=raw / raw.sum(axis=0), sample_key=key)


def test_server_sampler_zeroes_exactly_the_non_sampled_subjects() -> None:
    algo = _sampler(0.3)
    instr = algo.configure_round(1, Coins.seeded(5))
    assert isinstance(instr, RoundWeights) and instr.round_index == 1
    assert instr.sampled.dtype == torch.bool and instr.sampled.shape == (500,)
    assert torch.equal(instr.weights, algo.weights * instr.sampled.to(torch.float64))
    assert (instr.weights[:, ~instr.sampled] == 0).all()
    assert (instr.weights[:, instr.sampled] > 0).all()  # every base weight here is positive
    assert 0 < int(instr.sampled.sum()) < 500
    assert torch.equal(algo.weights, torch.from_numpy(check_weights(algo.weights.numpy())))


def test_server_sample_comes_from_its_coins() -> None:
    algo = _sampler(0.5)
    a = algo.configure_round(1, Coins.seeded(11))
    b = algo.configure_round(1, Coins.seeded(11))
    c = algo.configure_round(1, Coins.seeded(12))
    assert torch.equal(a.sampled, b.sampled) and torch.equal(a.weights, b.weights)
    assert not torch.equal(a.sampled, c.sampled)
    d, e = algo.configure_round(1, Coins.secure()), algo.configure_round(1, Coins.secure())
    assert not torch.equal(d.sampled, e.sampled)


def test_subject_rate_one_samples_everyone() -> None:
    algo = _sampler(1.0)
    instr = algo.configure_round(1, Coins.seeded(0))
    assert bool(instr.sampled.all())
    assert torch.equal(instr.weights, algo.weights)
    silos = _sampler(1.0, sampler="silos")
    assert bool(silos.silo_sample(4).all())


@pytest.mark.parametrize("sampler", ["server", "silos"])
def test_sampling_frequency_matches_q(sampler) -> None:
    q, subjects, rounds = 0.3, 2000, 20
    algo = _sampler(q, subjects=subjects, sampler=sampler)
    coins = Coins.seeded(0)
    if sampler == "server":
        draws = [algo.configure_round(r, coins.spawn(r)).sampled for r in range(rounds)]
    else:
        draws = [algo.silo_sample(r) for r in range(rounds)]
    hits, trials = int(sum(int(d.sum()) for d in draws)), subjects * rounds
    assert stats.binomtest(hits, trials, q).pvalue > ALPHA
    assert stats.binomtest(hits, trials, q * 0.8).pvalue < ALPHA
    assert stats.binomtest(hits, trials, q * 1.5).pvalue < ALPHA
    # a new draw every round, and every subject on its own (no subject always in or out)
    assert not torch.equal(draws[0], draws[1])
    per_subject = torch.stack(draws).sum(dim=0)
    assert stats.binomtest(int(per_subject[:50].sum()), 50 * rounds, q).pvalue > ALPHA


def test_silo_sampler_server_message_does_not_depend_on_the_sample() -> None:
    """With the silos sampling, what the server sends is the base weights whatever the key,
    i.e. whatever the sample; the silos zero the others themselves."""
    a, b = _sampler(0.3, sampler="silos"), _sampler(0.3, sampler="silos")
    b.silo_side = type(b.silo_side)(SharedSampleKey(bytes([1]) * 32))
    assert not torch.equal(a.silo_sample(1), b.silo_sample(1))  # two keys, two samples
    for r in range(3):
        ia, ib = a.configure_round(r, Coins.seeded(r)), b.configure_round(r, Coins.seeded(9))
        assert ia.sampled is None and ib.sampled is None
        assert torch.equal(ia.weights, a.weights) and torch.equal(ib.weights, ia.weights)
        assert ia.round_index == r
    # the key sits with the silos, not in anything the server sends; it is never printed
    assert {f.name for f in fields(ia)} == {"weights", "sampled", "round_index"}
    assert "secret" in repr(a.silo_side)
    keyless = UldpAvg(dict(subject_rate=0.3), weights=uniform_weights(2, 3))
    with pytest.raises(ValueError, match="shared sample key"):
        keyless.silo_sample(0)


def test_for_data_draws_the_silos_key_from_its_coins() -> None:
    train = _federation(subjects=400)
    cfg = dict(subject_rate=0.5)
    same = [make_algorithm("uldp_avg", cfg, train, coins=Coins.seeded(3)) for _ in range(2)]
    other = make_algorithm("uldp_avg", cfg, train, coins=Coins.seeded(4))
    secure = [make_algorithm("uldp_avg", cfg, train) for _ in range(2)]
    assert torch.equal(same[0].silo_sample(2), same[1].silo_sample(2))
    assert not torch.equal(same[0].silo_sample(2), other.silo_sample(2))
    assert not torch.equal(secure[0].silo_sample(2), secure[1].silo_sample(2))
    server = make_algorithm("uldp_avg", _with(cfg, subject_sampler="server"), train)
    assert server.silo_side is None


@pytest.mark.parametrize("sampler", ["server", "silos"])
def test_non_sampled_subjects_do_not_touch_the_message(sampler) -> None:
    train = _federation()
    cfg = dict(
        noise_multiplier=0.0,
        subject_rate=0.5,
        batch_size=1000,
        clip=0.5,
        subject_sampler=sampler,
    )
    algo = make_algorithm("uldp_avg", cfg, train, coins=Coins.seeded(2))
    instr = algo.configure_round(1, Coins.seeded(3))
    sampled = instr.sampled if sampler == "server" else algo.silo_sample(1)
    dropped = torch.nonzero(~sampled).flatten().tolist()
    assert dropped and int(sampled.sum()) > 0
    params = _params()
    for silo in map(_float64, silo_tensors(train)):
        scrambled = silo.x.clone()
        out = torch.isin(silo.subject, torch.tensor(dropped))
        scrambled[out] = scrambled[out] * -7.0 + 3.0
        other = SiloData(silo.silo, scrambled, (silo.y + out.long()) % 3, silo.subject)
        a = algo.local_update(_MODEL, params, silo, Coins.seeded(1), instr)
        b = algo.local_update(_MODEL, params, other, Coins.seeded(1), instr)
        assert _distance(a.params, b.params) < 1e-12
        present = set(silo.subject.tolist()) - set(dropped)
        # the number of sampled subjects is reported only when the server knows the sample
        assert a.subjects_per_batch == ([len(present)] if sampler == "server" else [])


# --- local update ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_local_update_contract(name) -> None:
    train = _federation(dtype=np.float32)
    cfg = dict(noise_multiplier=1.1, clip=0.3, subject_rate=0.6, local_epochs=2, weighting="clear")
    algo = make_algorithm(name, cfg, train, coins=Coins.seeded(1))
    model = MLP(5, 3, hidden=8)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = {k: v.clone() for k, v in params.items()}
    silo = silo_tensors(train)[1]
    with pytest.raises(ValueError, match="RoundWeights"):
        algo.local_update(model, params, silo, Coins.seeded(0))
    instr = algo.configure_round(1, Coins.seeded(0))
    # seeded coins reproduce a message bit for bit; other or secure coins do not
    a = algo.local_update(model, params, silo, Coins.seeded(4), instr)
    b = algo.local_update(model, params, silo, Coins.seeded(4), instr)
    c = algo.local_update(model, params, silo, Coins.seeded(5), instr)
    d = algo.local_update(model, params, silo, Coins.secure(), instr)
    e = algo.local_update(model, params, silo, Coins.secure(), instr)
    assert isinstance(a, SiloUpdate) and a.silo == 1 and a.num_records == silo.num_records
    for k in params:
        assert a.params[k].shape == params[k].shape
        assert torch.isfinite(a.params[k]).all()
        assert torch.equal(a.params[k], b.params[k])
        assert torch.equal(params[k], before[k])
    for other in (c, d):
        assert any(not torch.equal(a.params[k], other.params[k]) for k in params)
    assert any(not torch.equal(d.params[k], e.params[k]) for k in params)
    assert a.privacy == algo.silo_privacy(sampling_rate=0.6)
    assert a.privacy.scope == "aggregate"
    assert a.privacy.events == {"subject": poisson_gaussian_steps(0.6, 1.1, 1)}
    # the silos derive the sample: no amplification against them, and one silo knows its
    # own noise share (S = 3 silos: the others' noise has multiplier 1.1·√(2/3))
    assert train.num_silos == 3
    peers = 1.1 * math.sqrt(2 / 3)
    if name == "uldp_avg_w":  # clear weights n_{s,a}/n_a: the server and the silos see them
        blind = {"subject": dp_event.NonPrivateDpEvent()}
        assert a.privacy.views == {"server": blind, "silos": blind}
    else:
        views = {"silos": {"subject": known_sample_gaussian_steps(0.6, peers, 1)}}
        assert a.privacy.views == views
    full = make_algorithm(name, _with(cfg, subject_rate=1.0), train)
    assert full.silo_privacy(sampling_rate=1.0).events == {"subject": gaussian_steps(1.1, 1)}


#: Global torch samplers that no privacy-relevant draw may use (the coins are the only source).
TORCH_SAMPLERS = ("rand", "randn", "randperm", "randint", "bernoulli", "normal", "multinomial")


@pytest.mark.parametrize(
    ("name", "sampler"),
    [
        ("uldp_naive", "server"),
        *[(n, s) for n in ("uldp_avg", "uldp_sgd", "uldp_avg_w") for s in ("server", "silos")],
    ],
)
def test_no_draw_bypasses_the_coins(name, sampler, monkeypatch) -> None:
    """The server's subject sample, the silos' sample and every noise draw of the ULDP family
    come from the injected coins: with torch's global samplers refused, the same coins give
    the same messages."""
    train = _federation(dtype=np.float32)
    cfg = dict(noise_multiplier=1.1, clip=0.3, local_epochs=2, weighting="clear")
    if name != "uldp_naive":
        cfg.update(subject_rate=0.6, subject_sampler=sampler)
    algo = make_algorithm(name, cfg, train, coins=Coins.seeded(1))
    model = MLP(5, 3, hidden=8)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def refuse(*args, **kwargs):
        raise AssertionError("a privacy-relevant draw went through torch's samplers")

    for name_ in TORCH_SAMPLERS:
        monkeypatch.setattr(torch, name_, refuse)
    runs = []
    for _ in range(2):
        instr = algo.configure_round(1, Coins.seeded(0))
        runs.append(
            [
                algo.local_update(model, params, s, Coins.seeded(4), instr)
                for s in silo_tensors(train)
            ]
        )
    monkeypatch.undo()
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(a.params[k], b.params[k]) for k in params)


@pytest.mark.parametrize("name", ["uldp_avg", "uldp_sgd"])
def test_message_is_weighted_sum_of_clipped_per_subject_deltas(name) -> None:
    """σ = 0: the message is Σ_a w_{s,a} min(1, C/‖Δ_a‖) Δ_a, with Δ_a from the naive loop on
    the same batches (epochs/batches as the algorithm plans them)."""
    train = _federation(n=50, silos=2, subjects=6, seed=3)
    silo = _float64(silo_tensors(train)[0])
    rng = np.random.default_rng(0)
    raw = rng.uniform(size=(2, train.num_subjects))
    weights = raw / raw.sum(axis=0) * rng.uniform(0.2, 1.0, size=train.num_subjects)
    weights[0, 2] = 0.0  # subject 2 does not train in silo 0
    cfg = dict(noise_multiplier=0.0, lr=0.4, local_epochs=3, batch_size=2)
    single = name == "uldp_sgd"
    present = torch.unique(silo.subject)
    order = present[torch.from_numpy(weights[0])[present] > 0]
    plan = subject_batches(
        silo.subject,
        order,
        epochs=1 if single else 3,
        batch_size=None if single else 2,
        coins=Coins.seeded(9),
    )
    params = _params(1)
    deltas = per_subject_deltas_loop(_MODEL, params, silo.x, silo.y, plan, lr=0.4)
    norms = [float(tree_norm(d)) for d in deltas]
    clip = float(np.median(norms))  # some deltas clipped, some not
    algo = (UldpSgd if single else UldpAvg)(_with(cfg, clip=clip), weights=weights)
    instr = algo.configure_round(1, Coins.seeded(0))
    got = algo.local_update(_MODEL, params, silo, Coins.seeded(9), instr)
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for a, d, norm in zip(order.tolist(), deltas, norms, strict=True):
        factor = min(1.0, clip * (1 - CLIP_MARGIN) / norm)
        for k in expected:
            expected[k] += weights[0, a] * factor * d[k]
    assert _distance(got.params, expected) < 1e-9
    assert got.subjects_per_batch == [len(order)]


@pytest.mark.parametrize(("records", "stacked"), [(4, True), (1, False)])
def test_uldp_sgd_on_a_cnn_takes_the_cheaper_path_with_the_same_message(
    records: int, stacked: bool
) -> None:
    """A CNN's subjects with STACKED_MIN_RECORDS or more records on average train as stacked
    copies, fewer from per-example norms at the shared weights; σ = 0, either way the
    message is Σ_a w_a clip(-η G_a) with G_a from the naive loop."""
    from silodp.algorithms.uldp_avg import STACKED_MIN_RECORDS
    from silodp.models import MnistCNN

    torch.manual_seed(0)
    model = MnistCNN(num_classes=3, in_channels=1, side=8).double()
    rng = np.random.default_rng(5)
    subjects = np.repeat(np.arange(6), records)
    n = len(subjects)
    train = FederatedDataset(
        x=rng.normal(size=(n, 1, 8, 8)),
        y=rng.integers(0, 3, n),
        silo=np.zeros(n, dtype=int),
        subject=subjects,
        num_classes=3,
    )
    silo = _float64(silo_tensors(train)[0])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    order = torch.unique(silo.subject)
    plan = subject_batches(silo.subject, order, epochs=1, batch_size=None, coins=Coins.seeded(1))
    deltas = per_subject_deltas_loop(model, params, silo.x, silo.y, plan, lr=0.4)
    norms = [float(tree_norm(d)) for d in deltas]
    clip = float(np.median(norms))
    algo = make_algorithm("uldp_sgd", dict(noise_multiplier=0.0, lr=0.4, clip=clip), train)
    assert (records >= STACKED_MIN_RECORDS) == stacked
    assert algo._fast(model, silo.subject, order) is not stacked
    instr = algo.configure_round(1, Coins.seeded(0))
    got = algo.local_update(model, params, silo, Coins.seeded(2), instr)
    weight = 1.0 / train.num_silos  # uniform weights: one silo holds every subject
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for d, norm in zip(deltas, norms, strict=True):
        for k in expected:
            expected[k] += weight * min(1.0, clip * (1 - CLIP_MARGIN) / norm) * d[k]
    assert _distance(got.params, expected) < 1e-9
    assert _distance(expected, {k: torch.zeros_like(v) for k, v in expected.items()}) > 1e-3


def test_uldp_sgd_step_is_gradient_descent_on_the_subjects_loss() -> None:
    """One subject, σ = 0, C large: the round moves the model by -lr·∇(mean loss) and lowers
    the subject's training loss (a public implementation did gradient ascent here)."""
    rng = np.random.default_rng(4)
    n = 12
    train = FederatedDataset(
        x=rng.normal(size=(n, 5)),
        y=rng.integers(0, 3, n),
        silo=np.zeros(n, dtype=int),
        subject=np.zeros(n, dtype=int),
        num_classes=3,
    )
    lr = 0.2
    cfg = dict(noise_multiplier=0.0, clip=1e6, lr=lr)
    algo = make_algorithm("uldp_sgd", cfg, train)
    silo = _float64(silo_tensors(train)[0])
    params = _params(2)
    instr = algo.configure_round(1, Coins.seeded(0))
    update = algo.local_update(_MODEL, params, silo, Coins.seeded(0), instr)
    new = algo.aggregate(params, [update])
    grads = batch_gradient(_MODEL, params, silo.x, silo.y)
    for k in params:
        torch.testing.assert_close(new[k] - params[k], -lr * grads[k], rtol=1e-9, atol=1e-12)
    before, after = _loss(_MODEL, params, silo.x, silo.y), _loss(_MODEL, new, silo.x, silo.y)
    assert after < before - 1e-4


@pytest.mark.parametrize("name", ["uldp_avg", "uldp_avg_w"])
def test_rounds_of_noiseless_uldp_avg_lower_the_training_loss(name) -> None:
    train = _federation(n=60, silos=3, subjects=5, seed=2)
    cfg = dict(
        noise_multiplier=0.0, clip=10.0, lr=0.1, local_epochs=2, batch_size=4, weighting="clear"
    )
    algo = make_algorithm(name, cfg, train)
    silos = [_float64(s) for s in silo_tensors(train)]
    x, y = torch.from_numpy(train.x).double(), torch.from_numpy(train.y)
    params = _params(3)
    start = _loss(_MODEL, params, x, y)
    for r in range(5):
        instr = algo.configure_round(r, Coins.seeded(r))
        updates = [
            algo.local_update(_MODEL, params, s, Coins.seeded(r, s.silo), instr) for s in silos
        ]
        params = algo.aggregate(params, updates)
    assert _loss(_MODEL, params, x, y) < start - 0.05


def _noise_pvalue(message: dict[str, torch.Tensor], std: float) -> float:
    values = torch.cat([v.flatten() for v in message.values()]).double()
    statistic = float((values / std).pow(2).sum())
    dist = stats.chi2(values.numel())
    return 2 * min(dist.cdf(statistic), dist.sf(statistic))


def test_noise_std_per_silo() -> None:
    """ULDP-AVG adds N(0, σ²C²/S) per silo (σC summed); ULDP-NAIVE N(0, σ²C²S) (σCS summed)."""
    big = MLP(5, 3, hidden=512).double()
    params = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in big.named_parameters()}
    silo = SiloData(
        0, torch.randn(6, 5, dtype=torch.float64), torch.zeros(6).long(), torch.arange(6)
    )
    sigma, clip, silos = 1.7, 0.3, 4
    cfg = dict(noise_multiplier=sigma, clip=clip, batch_size=100)
    avg = UldpAvg(cfg, weights=np.zeros((silos, 6)))  # nobody trains: the message is noise
    instr = avg.configure_round(1, Coins.seeded(0))
    msg = avg.local_update(big, params, silo, Coins.seeded(0), instr).params
    std = sigma * clip / np.sqrt(silos)
    assert _noise_pvalue(msg, std) > ALPHA
    assert _noise_pvalue(msg, std * 1.1) < ALPHA and _noise_pvalue(msg, std / 1.1) < ALPHA
    naive = UldpNaive(_with(cfg, lr=1e-12), num_silos=silos)  # delta ~ 0: message is noise
    msg = naive.local_update(big, params, silo, Coins.seeded(1)).params
    std = sigma * clip * np.sqrt(silos)
    assert _noise_pvalue(msg, std) > ALPHA
    assert _noise_pvalue(msg, std * 1.1) < ALPHA and _noise_pvalue(msg, std / 1.1) < ALPHA


# --- sensitivity (hypothesis) -----------------------------------------------------------


@st.composite
def federations(draw):
    silos = draw(st.integers(1, 4))
    subjects = draw(st.integers(2, 5))
    n = draw(st.integers(2, 18))
    silo = draw(st.lists(st.integers(0, silos - 1), min_size=n, max_size=n))
    subject = draw(st.lists(st.integers(0, subjects - 1), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen, dtype=torch.float64) * scale
    y = torch.randint(0, 3, (n,), generator=gen)
    silo_t, subject_t = torch.tensor(silo), torch.tensor(subject)
    data = []
    for s in range(silos):
        m = silo_t == s
        data.append(SiloData(s, x[m], y[m], subject_t[m]))
    return data, subjects, seed


@st.composite
def valid_weights(draw, silos: int, subjects: int):
    raw = np.array(
        draw(st.lists(st.floats(0.0, 1.0), min_size=silos * subjects, max_size=silos * subjects))
    ).reshape(silos, subjects)
    totals = np.array(
        draw(
            st.lists(
                st.sampled_from([0.0, 0.3, 1.0]) | st.floats(0.0, 1.0),
                min_size=subjects,
                max_size=subjects,
            )
        )
    )
    sums = raw.sum(axis=0)
    w = np.where(sums > 0, raw / np.where(sums > 0, sums, 1.0) * totals, 0.0)
    return check_weights(w)


clips = st.floats(min_value=1e-3, max_value=10.0, allow_nan=False)


@SETTINGS
@given(
    fed=federations(),
    clip=clips,
    name=st.sampled_from(["uldp_avg", "uldp_sgd", "uldp_avg_w"]),
    epochs=st.integers(1, 3),
    lr=st.sampled_from([0.05, 1.0]),
    q=st.sampled_from([1.0, 0.6]),
    sampler=st.sampled_from(["server", "silos"]),
    data=st.data(),
)
def test_removing_a_subject_moves_the_sum_by_at_most_c(
    fed, clip, name, epochs, lr, q, sampler, data
) -> None:
    """Full-batch local epochs (batch ≥ every subject's records) so the other subjects' training
    does not depend on the removed subject's presence; the removed subject's weight column
    stays in place."""
    silos, num_subjects, seed = fed
    if name == "uldp_avg_w":
        hist = np.zeros((len(silos), num_subjects))
        for s in silos:
            np.add.at(hist[s.silo], s.subject.numpy(), 1)
        weights = record_weights(hist)
    else:
        weights = data.draw(valid_weights(len(silos), num_subjects))
    cfg = dict(
        noise_multiplier=0.0,
        clip=clip,
        lr=lr,
        local_epochs=epochs,
        batch_size=64,
        subject_rate=q,
        subject_sampler=sampler,
    )
    algo = {"uldp_avg": UldpAvg, "uldp_sgd": UldpSgd, "uldp_avg_w": UldpAvg}[name](
        cfg, weights=weights, sample_key=SharedSampleKey(seed.to_bytes(32, "little"))
    )
    instr = algo.configure_round(1, Coins.seeded(seed))
    removed = data.draw(st.integers(0, num_subjects - 1))
    params = _params(seed % 7)
    full = _sum_messages(algo, params, silos, instr, seed)
    reduced = _sum_messages(algo, params, [_without(s, removed) for s in silos], instr, seed)
    weight = instr.weights[:, removed]
    if instr.sampled is None and q < 1.0:  # the silos zero it when outside their sample
        weight = weight * float(algo.silo_sample(1)[removed])
    bound = clip * float(weight.sum())
    assert _distance(full, reduced) <= bound + 1e-6
    assert bound <= clip * (1 + 1e-9)


def test_sensitivity_bound_c_is_attained() -> None:
    """A subject alone in one silo with weight 1 and a large delta moves the sum by exactly C."""
    x = torch.randn(8, 5, dtype=torch.float64) * 10
    y = torch.arange(8) % 3
    silos = [
        SiloData(0, x[:4], y[:4], torch.tensor([0, 0, 1, 1])),
        SiloData(1, x[4:], y[4:], torch.tensor([2, 2, 2, 1])),
    ]
    weights = np.array([[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]])
    clip = 1e-3
    algo = UldpAvg(dict(noise_multiplier=0.0, clip=clip, lr=1.0), weights=weights)
    instr = algo.configure_round(1, Coins.seeded(0))
    params = _params()
    full = _sum_messages(algo, params, silos, instr)
    reduced = _sum_messages(algo, params, [_without(s, 0) for s in silos], instr)
    assert _distance(full, reduced) == pytest.approx(clip, rel=1e-6)


@SETTINGS
@given(
    fed=federations(),
    clip=clips,
    epochs=st.integers(1, 2),
    lr=st.sampled_from([0.05, 1.0]),
    data=st.data(),
)
def test_uldp_naive_sensitivity_is_at_most_2sc(fed, clip, epochs, lr, data) -> None:
    silos, num_subjects, seed = fed
    cfg = dict(noise_multiplier=0.0, clip=clip, lr=lr, local_epochs=epochs, batch_size=64)
    algo = UldpNaive(cfg, num_silos=len(silos))
    removed = data.draw(st.integers(0, num_subjects - 1))
    params = _params(seed % 7)
    full = _sum_messages(algo, params, silos, None, seed)
    reduced = _sum_messages(algo, params, [_without(s, removed) for s in silos], None, seed)
    touched = sum(int((s.subject == removed).any()) for s in silos)
    assert _distance(full, reduced) <= 2 * clip * touched + 1e-6
    assert touched <= len(silos)


def test_uldp_naive_sensitivity_exceeds_sc() -> None:
    """Why ULDP-NAIVE is accounted at σ/2: removing a subject can flip a silo's clipped delta,
    moving it by 2C (the paper's S·C assumes a silo's delta vanishes, which it does not)."""
    x = torch.ones(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 0, 0, 1])
    subject = torch.tensor([0, 0, 0, 0, 0, 1])
    silos = [SiloData(0, x, y, subject), SiloData(1, x.clone(), y.clone(), subject.clone())]
    clip = 0.01
    algo = UldpNaive(dict(noise_multiplier=0.0, clip=clip, lr=0.5, batch_size=100), num_silos=2)
    params = _params()
    full = _sum_messages(algo, params, silos, None)
    reduced = _sum_messages(algo, params, [_without(s, 0) for s in silos], None)
    assert _distance(full, reduced) > 1.9 * 2 * clip  # > S·C = 2C; close to 2·S·C = 4C
    accounted = UldpNaive(dict(noise_multiplier=1.0), num_silos=2)
    assert accounted.silo_privacy(sampling_rate=1.0).events == {"subject": gaussian_steps(0.5, 1)}


# --- server step -------------------------------------------------------------------------


def _updates(values: list[float]) -> list[SiloUpdate]:
    return [
        SiloUpdate(s, {"w": torch.full((2, 3), v), "b": torch.tensor([v, -v])}, 10, None)
        for s, v in enumerate(values)
    ]


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_aggregate_divides_by_expected_sampled_subjects(name) -> None:
    cfg = dict(subject_rate=0.25, server_lr=2.0)
    algo = {"uldp_avg": UldpAvg, "uldp_sgd": UldpSgd, "uldp_avg_w": UldpAvg}[name](
        cfg, weights=uniform_weights(3, 10)
    )
    params = {"w": torch.ones(2, 3), "b": torch.zeros(2)}
    new = algo.aggregate(params, _updates([1.0, 2.0, 4.5]))
    # w + η_g · Σ messages / (q·|U|) = 1 + 2 · 7.5 / 2.5
    torch.testing.assert_close(new["w"], torch.full((2, 3), 7.0))
    torch.testing.assert_close(new["b"], torch.tensor([6.0, -6.0]))
    # the divisor is public: it does not depend on who was sampled or how many silos answered
    new2 = algo.aggregate(params, _updates([7.5]))
    torch.testing.assert_close(new2["w"], new["w"])


@pytest.mark.parametrize("name", ["uldp_naive", "uldp_avg"])
def test_aggregate_sums_the_float64_messages_before_casting(name) -> None:
    """The silos' float64 messages (grid values) are summed exactly; only the sum is cast to
    the parameters' dtype: 1 + 2^-30 and -1 give 2^-30, not the 0 of a float32 sum. A message
    off the noise grid (σ = 1, C = 1: 2^-31 with 2 silos, 2^-30 for uldp_naive) is refused."""
    tiny = 2.0**-30
    if name == "uldp_naive":
        algo = UldpNaive(dict(), num_silos=2)
    else:
        algo = UldpAvg(dict(), weights=uniform_weights(2, 2))
    params = {"w": torch.zeros(3, dtype=torch.float32)}
    updates = [
        SiloUpdate(0, {"w": torch.full((3,), 1.0 + tiny, dtype=torch.float64)}, 1, None),
        SiloUpdate(1, {"w": torch.full((3,), -1.0, dtype=torch.float64)}, 1, None),
    ]
    new = algo.aggregate(params, updates)
    assert new["w"].dtype == torch.float32
    torch.testing.assert_close(new["w"], torch.full((3,), tiny / 2), rtol=0, atol=0)
    off_grid = [updates[0], SiloUpdate(1, {"w": torch.full((3,), 2.0**-45)}, 1, None)]
    with pytest.raises(ValueError, match="on the noise grid"):
        algo.aggregate(params, off_grid)


def test_uldp_naive_aggregate_divides_by_the_number_of_silos() -> None:
    algo = UldpNaive(dict(server_lr=0.5), num_silos=4)
    params = {"w": torch.ones(2, 3), "b": torch.zeros(2)}
    new = algo.aggregate(params, _updates([1.0, 2.0, 3.0, 6.0]))
    torch.testing.assert_close(new["w"], torch.full((2, 3), 1.0 + 0.5 * 12.0 / 4))
    torch.testing.assert_close(new["b"], torch.tensor([1.5, -1.5]))


# --- uldp_avg_w through the private weighting protocol -------------------------------------

TEST_KEY_BITS = 512  # insecure, for speed; production refuses < 2048 bits


def _protocol(cfg: dict, train: FederatedDataset, seed: int = 0) -> UldpAvgW:
    algo = UldpAvgW.for_data(
        cfg, train, insecure_test_key_bits=TEST_KEY_BITS, coins=Coins.seeded(seed)
    )
    assert isinstance(algo, UldpAvgW)
    return algo


def _train_rounds(algo, silos, params, rounds: int):
    sampled = []
    for r in range(1, rounds + 1):
        instr = algo.configure_round(r, Coins.seeded(r))
        if isinstance(instr, RoundWeights):
            sampled.append(frozenset(int(a) for a in torch.nonzero(instr.sampled).flatten()))
        updates = [
            algo.local_update(_MODEL, params, s, Coins.seeded(r, s.silo), instr) for s in silos
        ]
        params = algo.aggregate(params, updates)
    return params, sampled


@pytest.mark.parametrize("q", [1.0, 0.5])
def test_protocol_trained_model_equals_the_clear_weighted_model(q) -> None:
    """σ = 0 and the server's sample from the same coins: the protocol and clear weights train
    the same model (full-batch epochs: the protocol trains every subject, the clear weights
    only the sampled ones, and only the batch order can differ)."""
    train = _federation(n=60, silos=3, subjects=7, seed=2)
    cfg = dict(
        noise_multiplier=0.0,
        clip=1.0,
        lr=0.2,
        local_epochs=2,
        batch_size=64,
        subject_rate=q,
        subject_sampler="server",
        n_max=60,
    )
    protocol = _protocol(cfg, train)
    clear = UldpAvgW.for_data(_with(cfg, weighting="clear"), train)
    silos = [_float64(s) for s in silo_tensors(train)]
    start = _params(3)
    got, _ = _train_rounds(protocol, silos, start, 3)
    want, sampled = _train_rounds(clear, silos, start, 3)
    moved = max(float((want[k] - start[k]).abs().max()) for k in start)
    assert moved > 0.1  # the rounds did something
    # fixed point: (subjects + silos) * 1e-10 / 2 per coordinate and round, / (q |U|)
    for k in start:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-8)
    if q < 1.0:  # sub-sampling really happened, with different subjects per round
        assert all(0 < len(s) < 7 for s in sampled) and len(set(sampled)) > 1


@pytest.mark.parametrize("sampler", ["server", "silos"])
def test_protocol_round_equals_the_clear_weighted_sum_over_the_sample(sampler) -> None:
    train = _federation(n=40, silos=2, subjects=6, seed=4)
    cfg = dict(noise_multiplier=0.0, clip=1.0, subject_rate=0.5, n_max=40, subject_sampler=sampler)
    algo = _protocol(cfg, train, seed=1)
    instr = algo.configure_round(1, Coins.seeded(7))
    assert isinstance(instr, ProtocolRound)
    assert len(instr.message.ciphertexts) == 6  # one per public subject, sampled or not
    if sampler == "server":
        sampled = Coins.seeded(7).bernoulli(6, 0.5)
    else:  # every silo derives the same sample from the protocol's shared seed
        samples = {algo.protocol.silos[s].subject_sample(1, 0.5) for s in (0, 1)}
        assert len(samples) == 1
        sampled = algo.silo_sample(1)
        assert {int(a) for a in torch.nonzero(sampled).flatten()} == samples.pop()
    assert 0 < int(sampled.sum()) < 6
    silos = [_float64(s) for s in silo_tensors(train)]
    params = _params(1)
    updates = [algo.local_update(_MODEL, params, s, Coins.seeded(s.silo), instr) for s in silos]
    new = algo.aggregate(params, updates)
    # the same round with explicit clear weights zeroed for the non-sampled subjects
    weights = record_weights(train.histogram()) * sampled.numpy()
    clear = UldpAvgW(
        _with(cfg, weighting="clear", subject_sampler="server"),
        weights=record_weights(train.histogram()),
    )
    round_weights = RoundWeights(torch.from_numpy(weights), sampled, 1)
    ref = clear.aggregate(
        params,
        [clear.local_update(_MODEL, params, s, Coins.seeded(s.silo), round_weights) for s in silos],
    )
    for k in params:
        torch.testing.assert_close(new[k], ref[k], rtol=0, atol=1e-8)
    assert any(not torch.equal(new[k], params[k]) for k in params)
    everyone = clear.aggregate(
        params,
        [
            clear.local_update(
                _MODEL, params, s, Coins.seeded(s.silo), RoundWeights(clear.weights, None, 1)
            )
            for s in silos
        ],
    )
    assert any(float((new[k] - everyone[k]).abs().max()) > 1e-4 for k in params)


def test_protocol_with_silo_sampling_sends_every_weight_whatever_the_sample() -> None:
    """The server's round message is independent of the silos' sample: it encrypts the weight
    of every subject every round (no Enc(0)), while the silos' samples change."""
    train = _federation(n=40, silos=3, subjects=8, seed=8)
    algo = _protocol(dict(subject_rate=0.4, n_max=40), train, seed=2)
    server = algo.protocol.server
    key = server._keys.private_key
    samples = set()
    for r in range(1, 4):
        instr = algo.configure_round(r, Coins.seeded(r))
        assert [key.decrypt(c) for c in instr.message.ciphertexts] == server._inverses
        assert all(inv != 0 for inv in server._inverses)
        samples.add(frozenset(torch.nonzero(algo.silo_sample(r)).flatten().tolist()))
        server.abort_round()
    assert len(samples) > 1
    # the protocol's sample key comes from its shared seed: another set-up, another sample
    other = _protocol(dict(subject_rate=0.4, n_max=40), train, seed=3)
    assert not all(torch.equal(algo.silo_sample(r), other.silo_sample(r)) for r in range(4))


def test_protocol_noise_is_the_accounted_gaussian() -> None:
    """Nobody's delta reaches the aggregate (lr ≈ 0): the decrypted sum is the silos' summed
    noise, N(0, σ²C²) per coordinate (accepts σC, rejects 1.1σC and σC/1.1)."""
    big = MLP(5, 3, hidden=256).double()
    params = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in big.named_parameters()}
    train = _federation(n=12, silos=2, subjects=3, seed=9)
    sigma, clip = 1.3, 0.7
    cfg = dict(noise_multiplier=sigma, clip=clip, lr=1e-30, n_max=12)
    algo = _protocol(cfg, train, seed=4)
    silos = [_float64(s) for s in silo_tensors(train)]
    instr = algo.configure_round(1, Coins.seeded(0))
    updates = [algo.local_update(big, params, s, Coins.seeded(1, s.silo), instr) for s in silos]
    new = algo.aggregate(params, updates)
    total = {k: v * algo.config.subject_rate * train.num_subjects for k, v in new.items()}
    assert _noise_pvalue(total, sigma * clip) > ALPHA
    assert _noise_pvalue(total, sigma * clip * 1.1) < ALPHA
    assert _noise_pvalue(total, sigma * clip / 1.1) < ALPHA


def test_protocol_run_says_weights_are_private() -> None:
    train = _federation(n=30, silos=2, subjects=4, seed=5)
    protocol = _protocol(dict(n_max=30), train)
    clear = make_algorithm("uldp_avg_w", dict(weighting="clear"), train)
    assert protocol.weights_private is True and clear.weights_private is False
    assert not any("weights not private" in n for n in protocol.run_notes())
    assert any("private weighting protocol run in-process" in n for n in protocol.run_notes())
    assert any("weights not private" in n for n in clear.run_notes())


def test_protocol_set_up_refuses_small_keys_and_subjects_above_n_max() -> None:
    train = _federation(n=30, silos=2, subjects=3, seed=6)
    with pytest.raises(InsecureKeyError, match="1024"):
        UldpAvgW.for_data(dict(key_bits=1024, n_max=30), train)
    largest = int(train.histogram().sum(axis=0).max())
    # refused before the protocol (whose own check is SubjectBoundError), naming the subject
    with pytest.raises(InvalidValueError, match=rf"privacy\.n_max={largest - 1} .* \({largest}\)"):
        _protocol(dict(n_max=largest - 1), train)


def test_protocol_round_aborts_when_a_silo_drops_out() -> None:
    train = _federation(n=30, silos=3, subjects=4, seed=7)
    algo = _protocol(dict(noise_multiplier=1.0, n_max=30), train)
    silos = [_float64(s) for s in silo_tensors(train)]
    params = _params(2)
    instr = algo.configure_round(1, Coins.seeded(0))
    updates = [algo.local_update(_MODEL, params, s, Coins.seeded(1), instr) for s in silos[:2]]
    with pytest.raises(SiloDropoutError, match=r"\[2\]"):
        algo.aggregate(params, updates)


# --- who learns the sample: the per-adversary views and the run notes ---------------------


SILO_SIGMA = 0.9 * math.sqrt(2 / 3)  # σ√((S-1)/S) with S = 3: what one silo's peers add


def _silo_sigma(name: str) -> float:
    """The noise multiplier a curious silo sees: weights n_{s,a}/n_a make the sum's
    sensitivity to it 2C (its own weight moves too), uniform weights C."""
    return SILO_SIGMA / 2 if name == "uldp_avg_w" else SILO_SIGMA


BLIND = {"subject": dp_event.NonPrivateDpEvent()}


def _blind(name: str, **kw: object) -> set[str]:
    """The adversaries with no guarantee (a non-private view) at any sampling rate."""
    algo = make_algorithm(name, dict(noise_multiplier=0.9, num_silos=3, **kw))
    views = [algo.silo_privacy(sampling_rate=r).views for r in (0.2, 1.0)]
    blind = {who for who, view in views[0].items() if view == BLIND}
    assert blind == {who for who, view in views[1].items() if view == BLIND}
    return blind


def _views(name: str, **kw: object) -> dict:
    """Which adversaries know the sample (None: nobody but the released view's events),
    among those with a guarantee (:func:`_blind`)."""
    algo = make_algorithm(name, dict(noise_multiplier=0.9, num_silos=3, **kw))
    privacy = algo.silo_privacy(sampling_rate=0.2)
    assert privacy.events == {"subject": poisson_gaussian_steps(0.2, 0.9, 1)}
    assert privacy.scope == "aggregate"
    blind = _blind(name, **kw)
    # q = 1: the server and outsiders see the same Gaussian; a silo knows its own noise share
    full = algo.silo_privacy(sampling_rate=1.0).views
    assert {w: v for w, v in full.items() if w not in blind} == (
        {} if "silos" in blind else {"silos": {"subject": gaussian_steps(_silo_sigma(name), 1)}}
    )
    known = set()
    for adversary, view in privacy.views.items():
        if adversary in blind:
            continue
        sigma = _silo_sigma(name) if adversary == "silos" else 0.9
        if view == {"subject": known_sample_gaussian_steps(0.2, sigma, 1)}:
            known.add(adversary)
        else:
            assert view == {"subject": poisson_gaussian_steps(0.2, sigma, 1)}, adversary
    assert "silos" in privacy.views  # deducts the silo's own share, sample known or not
    return known


@pytest.mark.parametrize(
    ("settings", "blind"),
    [
        ({}, {"server"}),  # Paillier: the server inverts r_a·n_a, 0 for a subject with none
        ({"scheme": "bfv"}, {"server"}),  # exact BFV weights: the same totals
        ({"scheme": "bfv", "weight_encoding": "fixed_point"}, set()),  # no totals at all
        ({"weighting": "clear"}, {"server", "silos"}),  # the matrix n_{s,a}/n_a, sent to all
        ({"weighting": "clear", "num_silos": 1}, {"server"}),  # one silo: only its own data
    ],
)
def test_views_no_guarantee_against_whoever_sees_the_weights_data(settings, blind) -> None:
    settings = {"subject_rate": 0.2, "num_silos": 3, **settings}
    algo = make_algorithm("uldp_avg_w", dict(noise_multiplier=0.9, **settings))
    assert set(algo.weights_seen_by()) == blind
    assert {w for w, v in algo.silo_privacy(sampling_rate=0.2).views.items() if v == BLIND} == (
        blind
    )
    # the released model's ε stands, and the note says why the others have none
    assert algo.silo_privacy(sampling_rate=0.2).events == {
        "subject": poisson_gaussian_steps(0.2, 0.9, 1)
    }
    assert bool(algo.accounting_notes()) == bool(blind)


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_views_silo_sampler_only_the_silos_know_the_sample(name) -> None:
    assert _views(name, subject_rate=0.2) == {"silos"}
    clear = _views(name, subject_rate=0.2, weighting="clear")
    assert clear == (set() if name == "uldp_avg_w" else {"silos"})  # blind to clear weights


@pytest.mark.parametrize("name", ["uldp_avg", "uldp_sgd"])
def test_views_server_sampler_with_clear_weights_server_and_silos_know_it(name) -> None:
    assert _views(name, subject_rate=0.2, subject_sampler="server") == {"server", "silos"}


def test_views_server_sampler_through_the_protocol_hides_it_from_the_silos() -> None:
    # (the server and, with clear weights, the silos have no guarantee anyway: the sample is
    # hidden from the silos through the protocol)
    assert _views("uldp_avg_w", subject_rate=0.2, subject_sampler="server") == set()
    assert _blind("uldp_avg_w", subject_rate=0.2, subject_sampler="server") == {"server"}
    # the same once set up (S from the protocol or the weights): the protocol object, or
    # clear weights
    train = _federation(n=30, silos=2, subjects=4, seed=5)
    cfg = dict(subject_rate=0.2, subject_sampler="server", n_max=30)
    silo_sigma = math.sqrt(1 / 2) / 2  # sensitivity 2C to a curious silo (its own weight)
    views = _protocol(cfg, train).silo_privacy(sampling_rate=0.2).views
    assert views["silos"] == {"subject": poisson_gaussian_steps(0.2, silo_sigma, 1)}
    assert views["server"] == BLIND
    with_data = make_algorithm("uldp_avg_w", _with(cfg, weighting="clear"), train)
    views = with_data.silo_privacy(sampling_rate=0.2).views
    assert views == {"server": BLIND, "silos": BLIND}


def test_one_silo_has_no_peer_to_learn_from() -> None:
    algo = make_algorithm("uldp_avg", dict(subject_rate=0.2, num_silos=1))
    assert set(algo.silo_privacy(sampling_rate=0.2).views) == set()


def test_split_noise_needs_the_number_of_silos() -> None:
    with pytest.raises(ValueError, match="needs the number of silos"):
        make_algorithm("uldp_avg", dict()).silo_privacy(sampling_rate=1.0)


@pytest.mark.parametrize("name", ["uldp_naive", "uldp_group"])
def test_no_views_without_subject_sampling(name) -> None:
    algo = make_algorithm(name, dict(subject_rate=0.2))
    privacy = algo.silo_privacy(sampling_rate=0.2)
    if name == "uldp_group":  # the subject unit: no view; its federation-wide cap, seen by
        # the silos, leaves them no record-level guarantee
        assert privacy.views == {
            "silos": {"record": dp_event.NonPrivateDpEvent(), "subject": privacy.events["subject"]}
        }
    else:
        assert privacy.views == {}


def test_run_notes_say_which_epsilon_holds_against_whom() -> None:
    train = _federation(n=30, silos=2, subjects=4, seed=5)
    silos = make_algorithm("uldp_avg", dict(subject_rate=0.3), train)
    (note,) = [n for n in silos.run_notes() if "subject sample" in n]
    assert "drawn by the silos" in note and "against the server" in note
    assert "known-sample ε" in note
    server = make_algorithm("uldp_avg", dict(subject_rate=0.3, subject_sampler="server"), train)
    (note,) = [n for n in server.run_notes() if "subject sample" in n]
    assert "for the released model only" in note
    protocol = _protocol(dict(subject_rate=0.3, n_max=30), train)
    notes = " ".join(protocol.run_notes())
    assert "learns nothing about the sample" in notes
    assert "the server learns which subjects were sampled" not in notes
    # exact weights leave the server no guarantee: no note may give it a sub-sampled ε
    (note,) = [n for n in protocol.run_notes() if "subject sample" in n]
    assert "released model only" in note and "against the server, no subject-level" in note
    assert protocol.weights_seen_by() == ("server",)
    clear = make_algorithm("uldp_avg_w", dict(subject_rate=0.3, weighting="clear"), train)
    (note,) = [n for n in clear.run_notes() if "subject sample" in n]
    assert "known-sample" not in note and "the server and the silos, no subject-level" in note
    assert not any("one curious silo" in n for n in clear.run_notes())
    assert any("one curious silo" in n for n in silos.run_notes())
    assert "rounded on the aggregate's grid" not in notes and "exactly" in notes
    full = make_algorithm("uldp_avg", dict(), train)
    assert not any("subject sample" in n for n in full.run_notes())
    for algo in (silos, server, protocol, full):
        assert any("own share" in n for n in algo.run_notes())


def test_protocol_refuses_a_clip_its_encoding_cannot_keep() -> None:
    """The encoding moves a delta by up to sqrt(P) h / 2; a clip below that would turn the
    encoding's clip negative and rescale deltas to a norm above the accounted C."""
    train = _federation(n=30, silos=2, subjects=4, seed=5)
    params = _params(3)
    dim = sum(int(v.numel()) for v in params.values())
    floor = math.sqrt(dim) * 1e-10 / 2
    algo = _protocol(dict(noise_multiplier=1.0, clip=floor / 2, n_max=30), train)
    with pytest.raises(ValueError, match=r"clip=.* above sqrt\(parameters\)"):
        algo.initial_state(params)
    with pytest.raises(ValueError, match=r"clip=.* above sqrt\(parameters\)"):
        instructions = algo.configure_round(1, Coins.seeded(1))
        algo.local_update(_MODEL, params, silo_tensors(train)[0], Coins.seeded(0), instructions)
    fine = _protocol(dict(noise_multiplier=1.0, clip=floor * 4, n_max=30), train)
    fine.initial_state(params)
