"""The ULDP-FL family: weights, subject sub-sampling, local messages, sensitivity, server step.

Sensitivity is checked on the algorithms' own ``local_update`` with σ = 0: removing every record
of one subject from every silo moves the sum of the silos' messages (what secure aggregation
reveals) by at most ``Σ_s w_{s,a}·C <= C`` for ULDP-AVG/SGD, and by at most ``2·S·C`` for
ULDP-NAIVE (each silo's clipped delta can flip direction, so S·C is not a bound).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.func import functional_call
from torch.nn import functional as F

from silodp.accounting.events import gaussian_steps, poisson_gaussian_steps
from silodp.algorithms import AlgorithmConfig, SiloData, SiloUpdate, make_algorithm
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
from silodp.crypto.errors import InsecureKeyError, SiloDropoutError, SubjectBoundError
from silodp.crypto.prg import ChaCha20Prg
from silodp.data import FederatedDataset
from silodp.federated.simulator import silo_tensors
from silodp.models import MLP
from silodp.privacy.gradients import batch_gradient, tree_norm
from silodp.privacy.per_subject import per_subject_deltas_loop, subject_batches

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


def _float64(silo: SiloData) -> SiloData:
    return SiloData(silo.silo, silo.x.double(), silo.y, silo.subject)


def _without(silo: SiloData, subject: int) -> SiloData:
    keep = silo.subject != subject
    return SiloData(silo.silo, silo.x[keep], silo.y[keep], silo.subject[keep])


def _sum_messages(algo, params, silos, instructions, seed: int = 0) -> dict[str, torch.Tensor]:
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for silo in silos:
        gen = torch.Generator().manual_seed(seed * 1000 + silo.silo)
        update = algo.local_update(_MODEL, params, silo, gen, instructions)
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
        UldpAvg(AlgorithmConfig(), weights=w)


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
    avg_w = make_algorithm("uldp_avg_w", AlgorithmConfig(weighting="clear"), train)
    np.testing.assert_allclose(avg_w.weights.numpy(), [[0.5, 0, 1 / 3], [0.5, 0, 2 / 3]])
    np.testing.assert_allclose(avg_w.weights.numpy(), record_weights(train.histogram()), rtol=1e-15)
    for name in ("uldp_avg", "uldp_sgd"):
        algo = make_algorithm(name, AlgorithmConfig(), train)
        np.testing.assert_array_equal(algo.weights.numpy(), uniform_weights(2, 3))
    assert make_algorithm("uldp_naive", AlgorithmConfig(), train).num_silos == 2


# --- subject sub-sampling (server) --------------------------------------------------------


def _sampler(q: float, silos: int = 3, subjects: int = 500) -> UldpAvg:
    rng = np.random.default_rng(1)
    raw = rng.uniform(size=(silos, subjects))
    return UldpAvg(AlgorithmConfig(subject_rate=q), weights=raw / raw.sum(axis=0))


def test_configure_round_zeroes_exactly_the_non_sampled_subjects() -> None:
    algo = _sampler(0.3)
    instr = algo.configure_round(1, torch.Generator().manual_seed(5))
    assert isinstance(instr, RoundWeights)
    assert instr.sampled.dtype == torch.bool and instr.sampled.shape == (500,)
    assert torch.equal(instr.weights, algo.weights * instr.sampled.to(torch.float64))
    assert (instr.weights[:, ~instr.sampled] == 0).all()
    assert (instr.weights[:, instr.sampled] > 0).all()  # every base weight here is positive
    assert 0 < int(instr.sampled.sum()) < 500
    assert torch.equal(algo.weights, torch.from_numpy(check_weights(algo.weights.numpy())))


def test_configure_round_is_seeded() -> None:
    algo = _sampler(0.5)
    a = algo.configure_round(1, torch.Generator().manual_seed(11))
    b = algo.configure_round(1, torch.Generator().manual_seed(11))
    c = algo.configure_round(1, torch.Generator().manual_seed(12))
    assert torch.equal(a.sampled, b.sampled) and torch.equal(a.weights, b.weights)
    assert not torch.equal(a.sampled, c.sampled)


def test_subject_rate_one_samples_everyone() -> None:
    algo = _sampler(1.0)
    instr = algo.configure_round(1, torch.Generator().manual_seed(0))
    assert bool(instr.sampled.all())
    assert torch.equal(instr.weights, algo.weights)


def test_sampling_frequency_matches_q() -> None:
    q, subjects, rounds = 0.3, 2000, 20
    algo = _sampler(q, subjects=subjects)
    gen = torch.Generator().manual_seed(0)
    draws = [algo.configure_round(r, gen).sampled for r in range(rounds)]
    hits, trials = int(sum(int(d.sum()) for d in draws)), subjects * rounds
    assert stats.binomtest(hits, trials, q).pvalue > ALPHA
    assert stats.binomtest(hits, trials, q * 0.8).pvalue < ALPHA
    assert stats.binomtest(hits, trials, q * 1.2).pvalue < ALPHA
    # a new draw every round, and every subject on its own (no subject always in or out)
    assert not torch.equal(draws[0], draws[1])
    per_subject = torch.stack(draws).sum(dim=0)
    assert stats.binomtest(int(per_subject[:50].sum()), 50 * rounds, q).pvalue > ALPHA


def test_non_sampled_subjects_do_not_touch_the_message() -> None:
    train = _federation()
    algo = make_algorithm(
        "uldp_avg",
        AlgorithmConfig(noise_multiplier=0.0, subject_rate=0.5, batch_size=1000, clip=0.5),
        train,
    )
    instr = algo.configure_round(1, torch.Generator().manual_seed(3))
    dropped = torch.nonzero(~instr.sampled).flatten().tolist()
    assert dropped and int(instr.sampled.sum()) > 0
    params = _params()
    for silo in map(_float64, silo_tensors(train)):
        scrambled = silo.x.clone()
        out = torch.isin(silo.subject, torch.tensor(dropped))
        scrambled[out] = scrambled[out] * -7.0 + 3.0
        other = SiloData(silo.silo, scrambled, (silo.y + out.long()) % 3, silo.subject)
        gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        a = algo.local_update(_MODEL, params, silo, gen_a, instr)
        b = algo.local_update(_MODEL, params, other, gen_b, instr)
        assert _distance(a.params, b.params) < 1e-12
        present = set(silo.subject.tolist()) - set(dropped)
        assert a.subjects_per_batch == [len(present)]


# --- local update ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_local_update_contract(name) -> None:
    train = _federation(dtype=np.float32)
    cfg = AlgorithmConfig(
        noise_multiplier=1.1, clip=0.3, subject_rate=0.6, local_epochs=2, weighting="clear"
    )
    algo = make_algorithm(name, cfg, train)
    model = MLP(5, 3, hidden=8)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = {k: v.clone() for k, v in params.items()}
    silo = silo_tensors(train)[1]
    with pytest.raises(ValueError, match="RoundWeights"):
        algo.local_update(model, params, silo, torch.Generator())
    instr = algo.configure_round(1, torch.Generator().manual_seed(0))
    a = algo.local_update(model, params, silo, torch.Generator().manual_seed(4), instr)
    b = algo.local_update(model, params, silo, torch.Generator().manual_seed(4), instr)
    c = algo.local_update(model, params, silo, torch.Generator().manual_seed(5), instr)
    assert isinstance(a, SiloUpdate) and a.silo == 1 and a.num_records == silo.num_records
    for k in params:
        assert a.params[k].shape == params[k].shape and a.params[k].dtype == params[k].dtype
        assert torch.isfinite(a.params[k]).all()
        assert torch.equal(a.params[k], b.params[k])
        assert torch.equal(params[k], before[k])
    assert any(not torch.equal(a.params[k], c.params[k]) for k in params)
    assert a.privacy == algo.silo_privacy(sampling_rate=0.6)
    assert a.privacy.scope == "aggregate"
    assert a.privacy.events == {"subject": poisson_gaussian_steps(0.6, 1.1, 1)}
    full = make_algorithm(name, replace(cfg, subject_rate=1.0), train)
    assert full.silo_privacy(sampling_rate=1.0).events == {"subject": gaussian_steps(1.1, 1)}


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
    cfg = AlgorithmConfig(noise_multiplier=0.0, lr=0.4, local_epochs=3, batch_size=2)
    single = name == "uldp_sgd"
    present = torch.unique(silo.subject)
    order = present[torch.from_numpy(weights[0])[present] > 0]
    plan = subject_batches(
        silo.subject,
        order,
        epochs=1 if single else 3,
        batch_size=None if single else 2,
        generator=torch.Generator().manual_seed(9),
    )
    params = _params(1)
    deltas = per_subject_deltas_loop(_MODEL, params, silo.x, silo.y, plan, lr=0.4)
    norms = [float(tree_norm(d)) for d in deltas]
    clip = float(np.median(norms))  # some deltas clipped, some not
    algo = (UldpSgd if single else UldpAvg)(replace(cfg, clip=clip), weights=weights)
    instr = algo.configure_round(1, torch.Generator())
    got = algo.local_update(_MODEL, params, silo, torch.Generator().manual_seed(9), instr)
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for a, d, norm in zip(order.tolist(), deltas, norms, strict=True):
        factor = min(1.0, clip / norm)
        for k in expected:
            expected[k] += weights[0, a] * factor * d[k]
    assert _distance(got.params, expected) < 1e-9
    assert got.subjects_per_batch == [len(order)]


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
    cfg = AlgorithmConfig(noise_multiplier=0.0, clip=1e6, lr=lr)
    algo = make_algorithm("uldp_sgd", cfg, train)
    silo = _float64(silo_tensors(train)[0])
    params = _params(2)
    instr = algo.configure_round(1, torch.Generator().manual_seed(0))
    update = algo.local_update(_MODEL, params, silo, torch.Generator().manual_seed(0), instr)
    new = algo.aggregate(params, [update])
    grads = batch_gradient(_MODEL, params, silo.x, silo.y)
    for k in params:
        torch.testing.assert_close(new[k] - params[k], -lr * grads[k], rtol=1e-9, atol=1e-12)
    before, after = _loss(_MODEL, params, silo.x, silo.y), _loss(_MODEL, new, silo.x, silo.y)
    assert after < before - 1e-4


@pytest.mark.parametrize("name", ["uldp_avg", "uldp_avg_w"])
def test_rounds_of_noiseless_uldp_avg_lower_the_training_loss(name) -> None:
    train = _federation(n=60, silos=3, subjects=5, seed=2)
    cfg = AlgorithmConfig(
        noise_multiplier=0.0, clip=10.0, lr=0.1, local_epochs=2, batch_size=4, weighting="clear"
    )
    algo = make_algorithm(name, cfg, train)
    silos = [_float64(s) for s in silo_tensors(train)]
    x, y = torch.from_numpy(train.x).double(), torch.from_numpy(train.y)
    params = _params(3)
    start = _loss(_MODEL, params, x, y)
    for r in range(5):
        instr = algo.configure_round(r, torch.Generator().manual_seed(r))
        updates = [
            algo.local_update(_MODEL, params, s, torch.Generator().manual_seed(r), instr)
            for s in silos
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
    cfg = AlgorithmConfig(noise_multiplier=sigma, clip=clip, batch_size=100)
    avg = UldpAvg(cfg, weights=np.zeros((silos, 6)))  # nobody trains: the message is noise
    instr = avg.configure_round(1, torch.Generator())
    msg = avg.local_update(big, params, silo, torch.Generator().manual_seed(0), instr).params
    std = sigma * clip / np.sqrt(silos)
    assert _noise_pvalue(msg, std) > ALPHA
    assert _noise_pvalue(msg, std * 1.1) < ALPHA and _noise_pvalue(msg, std / 1.1) < ALPHA
    naive = UldpNaive(replace(cfg, lr=1e-12), num_silos=silos)  # delta ~ 0: message is noise
    msg = naive.local_update(big, params, silo, torch.Generator().manual_seed(1)).params
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
    data=st.data(),
)
def test_removing_a_subject_moves_the_sum_by_at_most_c(
    fed, clip, name, epochs, lr, q, data
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
    cfg = AlgorithmConfig(
        noise_multiplier=0.0,
        clip=clip,
        lr=lr,
        local_epochs=epochs,
        batch_size=64,
        subject_rate=q,
    )
    algo = {"uldp_avg": UldpAvg, "uldp_sgd": UldpSgd, "uldp_avg_w": UldpAvg}[name](
        cfg, weights=weights
    )
    instr = algo.configure_round(1, torch.Generator().manual_seed(seed))
    removed = data.draw(st.integers(0, num_subjects - 1))
    params = _params(seed % 7)
    full = _sum_messages(algo, params, silos, instr, seed)
    reduced = _sum_messages(algo, params, [_without(s, removed) for s in silos], instr, seed)
    bound = clip * float(instr.weights[:, removed].sum())
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
    algo = UldpAvg(AlgorithmConfig(noise_multiplier=0.0, clip=clip, lr=1.0), weights=weights)
    instr = algo.configure_round(1, torch.Generator())
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
    cfg = AlgorithmConfig(
        noise_multiplier=0.0, clip=clip, lr=lr, local_epochs=epochs, batch_size=64
    )
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
    algo = UldpNaive(
        AlgorithmConfig(noise_multiplier=0.0, clip=clip, lr=0.5, batch_size=100), num_silos=2
    )
    params = _params()
    full = _sum_messages(algo, params, silos, None)
    reduced = _sum_messages(algo, params, [_without(s, 0) for s in silos], None)
    assert _distance(full, reduced) > 1.9 * 2 * clip  # > S·C = 2C; close to 2·S·C = 4C
    accounted = UldpNaive(AlgorithmConfig(noise_multiplier=1.0), num_silos=2)
    assert accounted.silo_privacy(sampling_rate=1.0).events == {"subject": gaussian_steps(0.5, 1)}


# --- server step -------------------------------------------------------------------------


def _updates(values: list[float]) -> list[SiloUpdate]:
    return [
        SiloUpdate(s, {"w": torch.full((2, 3), v), "b": torch.tensor([v, -v])}, 10, None)
        for s, v in enumerate(values)
    ]


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_aggregate_divides_by_expected_sampled_subjects(name) -> None:
    cfg = AlgorithmConfig(subject_rate=0.25, server_lr=2.0)
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


def test_uldp_naive_aggregate_divides_by_the_number_of_silos() -> None:
    algo = UldpNaive(AlgorithmConfig(server_lr=0.5), num_silos=4)
    params = {"w": torch.ones(2, 3), "b": torch.zeros(2)}
    new = algo.aggregate(params, _updates([1.0, 2.0, 3.0, 6.0]))
    torch.testing.assert_close(new["w"], torch.full((2, 3), 1.0 + 0.5 * 12.0 / 4))
    torch.testing.assert_close(new["b"], torch.tensor([1.5, -1.5]))


# --- uldp_avg_w through the private weighting protocol -------------------------------------

TEST_KEY_BITS = 512  # insecure, for speed; production refuses < 2048 bits


def _protocol(cfg: AlgorithmConfig, train: FederatedDataset, seed: int = 0) -> UldpAvgW:
    algo = UldpAvgW.for_data(
        cfg, train, insecure_test_key_bits=TEST_KEY_BITS, source=ChaCha20Prg(bytes([seed]) * 32)
    )
    assert isinstance(algo, UldpAvgW)
    return algo


def _train_rounds(algo, silos, params, rounds: int):
    sampled = []
    for r in range(1, rounds + 1):
        instr = algo.configure_round(r, torch.Generator().manual_seed(r))
        if isinstance(instr, RoundWeights):
            sampled.append(frozenset(int(a) for a in torch.nonzero(instr.sampled).flatten()))
        updates = [
            algo.local_update(
                _MODEL, params, s, torch.Generator().manual_seed(100 * r + s.silo), instr
            )
            for s in silos
        ]
        params = algo.aggregate(params, updates)
    return params, sampled


@pytest.mark.parametrize("q", [1.0, 0.5])
def test_protocol_trained_model_equals_the_clear_weighted_model(q) -> None:
    train = _federation(n=60, silos=3, subjects=7, seed=2)
    cfg = AlgorithmConfig(
        noise_multiplier=0.7,
        clip=1.0,
        lr=0.2,
        local_epochs=2,
        batch_size=4,
        subject_rate=q,
        n_max=60,
    )
    protocol = _protocol(cfg, train)
    clear = UldpAvgW.for_data(replace(cfg, weighting="clear"), train)
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


def test_protocol_round_hides_the_sample_and_zeroes_non_sampled_subjects() -> None:
    train = _federation(n=40, silos=2, subjects=5, seed=4)
    cfg = AlgorithmConfig(noise_multiplier=0.0, clip=1.0, subject_rate=0.5, n_max=40)
    algo = _protocol(cfg, train, seed=1)
    instr = algo.configure_round(1, torch.Generator().manual_seed(7))
    assert isinstance(instr, ProtocolRound)
    assert len(instr.message.ciphertexts) == 5  # one per public subject, sampled or not
    sampled = torch.rand(5, generator=torch.Generator().manual_seed(7)) < 0.5
    silos = [_float64(s) for s in silo_tensors(train)]
    params = _params(1)
    updates = [
        algo.local_update(_MODEL, params, s, torch.Generator().manual_seed(s.silo), instr)
        for s in silos
    ]
    new = algo.aggregate(params, updates)
    # the same round with explicit clear weights zeroed for the non-sampled subjects
    weights = record_weights(train.histogram()) * sampled.numpy()
    clear = UldpAvgW(replace(cfg, weighting="clear"), weights=record_weights(train.histogram()))
    round_weights = RoundWeights(torch.from_numpy(weights), sampled)
    ref = clear.aggregate(
        params,
        [
            clear.local_update(
                _MODEL, params, s, torch.Generator().manual_seed(s.silo), round_weights
            )
            for s in silos
        ],
    )
    for k in params:
        torch.testing.assert_close(new[k], ref[k], rtol=0, atol=1e-8)
    assert any(not torch.equal(new[k], params[k]) for k in params)


def test_protocol_run_says_weights_are_private() -> None:
    train = _federation(n=30, silos=2, subjects=4, seed=5)
    protocol = _protocol(AlgorithmConfig(n_max=30), train)
    clear = make_algorithm("uldp_avg_w", AlgorithmConfig(weighting="clear"), train)
    assert protocol.weights_private is True and clear.weights_private is False
    assert not any("weights not private" in n for n in protocol.run_notes())
    assert any("private weighting protocol run in-process" in n for n in protocol.run_notes())
    assert any("weights not private" in n for n in clear.run_notes())


def test_protocol_set_up_refuses_small_keys_and_subjects_above_n_max() -> None:
    train = _federation(n=30, silos=2, subjects=3, seed=6)
    with pytest.raises(InsecureKeyError, match="1024"):
        UldpAvgW.for_data(AlgorithmConfig(key_bits=1024, n_max=30), train)
    largest = int(train.histogram().sum(axis=0).max())
    with pytest.raises(SubjectBoundError, match=f"n_max={largest - 1}"):
        _protocol(AlgorithmConfig(n_max=largest - 1), train)


def test_protocol_round_aborts_when_a_silo_drops_out() -> None:
    train = _federation(n=30, silos=3, subjects=4, seed=7)
    algo = _protocol(AlgorithmConfig(noise_multiplier=1.0, n_max=30), train)
    silos = [_float64(s) for s in silo_tensors(train)]
    params = _params(2)
    instr = algo.configure_round(1, torch.Generator())
    updates = [algo.local_update(_MODEL, params, s, torch.Generator(), instr) for s in silos[:2]]
    with pytest.raises(SiloDropoutError, match=r"\[2\]"):
        algo.aggregate(params, updates)
