"""Accounting of the ULDP-FL family against independent computations (SPEC §3).

* ULDP-AVG/SGD/AVG-w: the secure sum over silos has sensitivity C and noise σC, so a round is
  one Gaussian (σ), or one Poisson-subsampled Gaussian (q, σ) with subject sampling, whatever
  the number of silos or the span (no horizontal composition).
* ULDP-NAIVE: sensitivity 2·S·C against noise σ·C·S: one Gaussian (σ/2) per round.
* ULDP-GROUP-k: DP-SGD per silo; the record-level guarantee of all silos jointly converted to
  groups of k once (``group_scope="federation"``), for any k (not only powers of two).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from opacus.accountants import PRVAccountant, RDPAccountant

from silodp.accounting import PrivacyPlan
from silodp.accounting import conversions as cv
from silodp.accounting.accountant import FederatedAccountant, SiloPrivacy
from silodp.algorithms import make_algorithm
from silodp.algorithms.planning import account_plan, calibrate
from silodp.data import FederatedDataset, TestSplit
from silodp.federated.simulator import Simulator
from silodp.models import build_model


def _with(settings: dict, **values: object) -> dict:
    """``settings`` with some hyperparameters changed."""
    return {**settings, **values}


DELTA = 1e-5
ULDP_WEIGHTED = ("uldp_avg", "uldp_sgd", "uldp_avg_w")


def _plan(silos: int, rounds: int, rate: float = 1.0, span: int | None = None) -> PrivacyPlan:
    return PrivacyPlan(
        sampling_rates=(rate,) * silos,
        rounds=rounds,
        silos_per_round=silos,
        span=silos if span is None else span,
        delta=DELTA,
        adversary="released",  # the aggregate Gaussian these closed forms describe
    )


def _account(name: str, config: dict, plan: PrivacyPlan, **kwargs):
    """(final estimates, the accountant that produced them)."""
    captured: dict[str, FederatedAccountant] = {}

    def factory(algorithm, plan, **kw):
        # the released model's view: the aggregate Gaussian these closed forms describe
        captured["acc"] = FederatedAccountant(
            units=algorithm.units, span=plan.span, delta=plan.delta, target="released", **kw
        )
        return captured["acc"]

    result = account_plan(make_algorithm(name, config), plan, accountant_factory=factory, **kwargs)
    return result[-1], captured["acc"]


# --- unsampled: exactly μ-GDP -------------------------------------------------------------


@pytest.mark.parametrize("name", [*ULDP_WEIGHTED, "uldp_naive"])
@pytest.mark.parametrize("sigma", [0.8, 3.0])
@pytest.mark.parametrize("rounds", [1, 10, 200])
def test_unsampled_rounds_compose_to_gdp(name, sigma, rounds) -> None:
    # ULDP-NAIVE's sum has sensitivity 2·S·C for noise σ·C·S: noise multiplier σ/2
    effective = sigma / 2 if name == "uldp_naive" else sigma
    mu = math.sqrt(rounds) / effective
    closed = cv.gdp_epsilon(mu, DELTA)
    cfg = dict(noise_multiplier=sigma)
    for silos in (1, 3, 10):
        est, acc = _account(name, cfg, _plan(silos, rounds))
        subject = est["subject"]
        assert acc.mu()["subject"] == pytest.approx(mu, rel=1e-12)
        assert subject.route == "pld"
        assert closed * (1 - 1e-9) <= subject.epsilon <= closed * 1.01
        assert subject.routes["rdp"] >= closed * (1 - 1e-9)  # a looser valid bound


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
def test_epsilon_does_not_grow_with_silos_or_span(name) -> None:
    cfg = dict(noise_multiplier=1.2, subject_rate=0.2)
    base, _ = _account(name, cfg, _plan(1, 30, rate=0.2))
    for silos, span in [(2, 2), (8, 8), (8, 3), (16, 16)]:
        est, acc = _account(name, cfg, _plan(silos, 30, rate=0.2, span=span))
        assert est["subject"].epsilon == base["subject"].epsilon
        assert est["subject"].routes == base["subject"].routes
        assert "subject" not in acc.mu()  # sampled: not exactly GDP
    # contrast: horizontally composing the same event over 8 silos would cost much more
    single = make_algorithm(name, _with(cfg, num_silos=8)).silo_privacy(sampling_rate=0.2)
    assert single.scope == "aggregate"
    composed = FederatedAccountant(units=("subject",), span=8, delta=DELTA, routes=("pld",))
    composed.compose_round([replace(single, scope="silo")] * 8, count=30)
    assert composed.epsilons()["subject"] > 2 * base["subject"].epsilon


def test_uldp_naive_does_not_grow_with_silos() -> None:
    cfg = dict(noise_multiplier=4.0)
    eps = {s: _account("uldp_naive", cfg, _plan(s, 5))[0]["subject"].epsilon for s in (1, 4, 16)}
    assert eps[1] == eps[4] == eps[16]


# --- sub-sampled: the Poisson-subsampled Gaussian composed R times ---------------------------

SAMPLED = [(0.01, 1.0, 100), (0.05, 1.0, 100), (0.1, 2.0, 200), (0.01, 2.0, 1000), (0.5, 1.0, 10)]


@pytest.mark.parametrize("name", ULDP_WEIGHTED)
@pytest.mark.parametrize(("q", "sigma", "rounds"), SAMPLED)
def test_sampled_rdp_route_vs_opacus_rdp(name, q, sigma, rounds) -> None:
    cfg = dict(noise_multiplier=sigma, subject_rate=q)
    est, _ = _account(name, cfg, _plan(4, rounds, rate=q), routes=("rdp",))
    ours = est["subject"].routes["rdp"]
    opacus = RDPAccountant()
    opacus.history = [(sigma, q, rounds)]
    theirs = opacus.get_epsilon(delta=DELTA)
    assert theirs * (1 - 1e-6) - 1e-9 <= ours <= theirs * 1.1


@pytest.mark.parametrize(("q", "sigma", "rounds"), SAMPLED)
def test_sampled_pld_route_vs_opacus_prv(q, sigma, rounds) -> None:
    cfg = dict(noise_multiplier=sigma, subject_rate=q)
    est, _ = _account("uldp_avg", cfg, _plan(4, rounds, rate=q))
    subject = est["subject"]
    prv = PRVAccountant()
    prv.history = [(sigma, q, rounds)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = prv.get_epsilon(delta=DELTA, eps_error=0.01)
    assert subject.route == "pld"
    assert subject.epsilon == pytest.approx(theirs, rel=0.03)
    assert subject.epsilon <= subject.routes["rdp"]


def test_sampling_lowers_epsilon_and_matches_the_single_event() -> None:
    """q·|U| subjects per round in expectation: ε below the unsampled one, and equal to the
    PLD of the one Poisson-subsampled Gaussian event composed R times."""
    full, _ = _account("uldp_avg", dict(noise_multiplier=1.0), _plan(3, 50))
    cfg = dict(noise_multiplier=1.0, subject_rate=0.1)
    sampled, _ = _account("uldp_avg", cfg, _plan(3, 50, rate=0.1))
    assert sampled["subject"].epsilon < full["subject"].epsilon / 3
    reference = FederatedAccountant(units=("subject",), span=1, delta=DELTA)
    event = dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0))
    reference.compose_round([SiloPrivacy({"subject": event})], count=50)
    assert sampled["subject"].epsilon == pytest.approx(reference.epsilons()["subject"], rel=1e-9)


# --- ULDP-GROUP-k --------------------------------------------------------------------------

GROUP_RATES = (0.01, 0.02, 0.015)


def _group(
    k: int,
    *,
    sigma: float = 2.0,
    steps: int = 5,
    rounds: int = 4,
    silos: int = 3,
    routes=None,
    per_round: bool = False,
):
    cfg = dict(noise_multiplier=sigma, local_steps=steps, group_size=k)
    plan = PrivacyPlan(
        # three silos of different rates, or any number at the worst of them
        sampling_rates=GROUP_RATES if silos == 3 else (max(GROUP_RATES),) * silos,
        rounds=rounds,
        silos_per_round=silos,
        span=silos,
        delta=DELTA,
    )
    kwargs = {} if routes is None else {"routes": routes}
    return account_plan(make_algorithm("uldp_group", cfg), plan, per_round=per_round, **kwargs)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_uldp_group_epsilon_positive_and_finite_from_round_one(k) -> None:
    results = _group(k, per_round=True)
    eps = [r["subject"].epsilon for r in results]
    assert all(math.isfinite(e) and e > 0 for e in eps)
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    assert all(r["record"].epsilon > 0 for r in results)


def _hand_rdp_group(k: int, q: float, sigma: float, steps: int) -> float:
    """Mironov 2017 Prop. 2 for groups of 2^c >= k: orders α/2^c, 3^c·RDP(α), α >= 2^{c+1}."""
    c = 0
    while 2**c < k:
        c += 1
    orders = [float(a) for a in cv.RDP_ORDERS]
    acc = rdp_lib.RdpAccountant(orders=orders)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    rdp = np.array(acc._rdp)
    keep = np.array(orders) >= 2 ** (c + 1)
    eps, _ = rdp_lib.compute_epsilon(
        list(np.array(orders)[keep] / 2**c), list(rdp[keep] * 3**c), DELTA
    )
    return float(eps)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 100])
def test_uldp_group_rdp_route_is_mironovs_conversion(k) -> None:
    sigma, steps, rounds = 2.0, 5, 4
    est = _group(k, sigma=sigma, steps=steps, rounds=rounds, routes=("rdp-group",))[-1]
    route = est["subject"].routes["rdp-group"]
    # the worst silo (q = 0.02), its T·R steps; NOT multiplied by the number of silos
    hand = _hand_rdp_group(k, max(GROUP_RATES), sigma, steps * rounds)
    assert math.isfinite(route) and route > 0
    assert route == pytest.approx(hand, rel=1e-9)
    nine = _group(k, sigma=sigma, steps=steps, rounds=rounds, silos=9, routes=("rdp-group",))
    assert nine[-1]["subject"].routes["rdp-group"] == pytest.approx(route, rel=1e-12)


def test_uldp_group_k_not_power_of_two_rounds_up() -> None:
    eps = {
        k: _group(k, routes=("rdp-group",))[-1]["subject"].routes["rdp-group"]
        for k in (2, 3, 4, 5, 8, 62, 64, 100)
    }
    assert 0 < eps[2] < eps[3] == eps[4] < eps[5] == eps[8] < eps[62] == eps[64] < eps[100]


def test_uldp_group_dp_route_large_k_not_capped() -> None:
    """The (ε, δ) route for k = 100 is finite and larger than for k = 62 (no silent cap)."""
    eps = {
        k: _group(k, sigma=5.0, steps=1, rounds=1, routes=("dp-group",))[-1]["subject"]
        for k in (2, 3, 5, 62, 100)
    }
    values = [eps[k].routes["dp-group"] for k in (2, 3, 5, 62, 100)]
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert all(a < b for a, b in zip(values, values[1:], strict=False))
    assert eps[100].epsilon == values[-1]
    # and it does not compose over silos either (federation-wide bound)
    one = _group(100, sigma=5.0, steps=1, rounds=1, silos=1, routes=("dp-group",))[-1]
    assert one["subject"].routes["dp-group"] == pytest.approx(values[-1], rel=1e-9)


def test_uldp_group_reports_epsilon_in_the_first_simulated_round() -> None:
    rng = np.random.default_rng(0)
    n = 60
    train = FederatedDataset(
        x=rng.normal(size=(n, 4)).astype(np.float32),
        y=rng.integers(0, 3, n),
        silo=np.arange(n) % 3,
        subject=np.arange(n) // 2,  # 2 records per subject
        num_classes=3,
    )
    test = TestSplit(x=rng.normal(size=(10, 4)).astype(np.float32), y=rng.integers(0, 3, 10))
    cfg = dict(noise_multiplier=1.5, local_steps=2, batch_size=5, group_size=2)
    algo = make_algorithm("uldp_group", cfg, train)
    sim = Simulator(
        algorithm=algo,
        model=build_model("mlp", (4,), 3),
        train=train,
        test=test,
        accountant=FederatedAccountant(units=algo.units, span=3, delta=DELTA),
        silos_per_round=3,
        seed=0,
    )
    results = sim.run(2)
    for result in results:
        assert math.isfinite(result.epsilon["subject"]) and result.epsilon["subject"] > 0
        # the strongest adversary: the silos, who see what the federation-wide cap kept
        assert result.epsilon["record"] == math.inf
    released = sim.accountant.estimates_by_adversary()["released"]["record"].epsilon
    assert math.isfinite(released) and released > 0
    # the threat model a run's summary states says so (it said the ε holds against the silos)
    assert "record ε not against the silos" in algo.threat_model
    assert results[0].epsilon["subject"] < results[1].epsilon["subject"]
    assert all(torch.isfinite(v).all() for v in sim.params.values())


# --- calibration ---------------------------------------------------------------------------


@pytest.mark.parametrize(("q", "rounds", "target"), [(1.0, 20, 2.0), (0.1, 100, 1.0)])
def test_calibrate_uldp_avg_meets_target_within_one_percent(q, rounds, target) -> None:
    cfg = dict(subject_rate=q)
    plan = _plan(3, rounds, rate=q)
    sigma = calibrate(make_algorithm("uldp_avg", cfg), plan, target_epsilon=target)
    eps = _account("uldp_avg", _with(cfg, noise_multiplier=sigma), plan)[0]["subject"].epsilon
    assert target * 0.99 <= eps <= target
    looser = _account("uldp_avg", _with(cfg, noise_multiplier=sigma * 0.98), plan)[0]
    assert looser["subject"].epsilon > target


@pytest.mark.parametrize("silos", [2, 3, 10])
def test_calibrating_against_every_adversary_covers_a_curious_silo(silos) -> None:
    # one silo knows its 1/S share of the noise: to meet the target against it σ must be
    # √(S/(S-1)) times what the released model alone needs (q = 1: exactly Gaussian)
    released = calibrate(make_algorithm("uldp_avg", dict()), _plan(silos, 20), target_epsilon=2.0)
    strongest = replace(_plan(silos, 20), adversary="strongest")
    sigma = calibrate(make_algorithm("uldp_avg", dict()), strongest, target_epsilon=2.0)
    assert sigma == pytest.approx(released * math.sqrt(silos / (silos - 1)), rel=0.02)
    closed = cv.gdp_epsilon(math.sqrt(20) / (sigma * math.sqrt((silos - 1) / silos)), DELTA)
    assert closed <= 2.0 * (1 + 1e-6)


def test_calibrated_uldp_naive_needs_twice_the_noise() -> None:
    plan = _plan(4, 20)
    avg = calibrate(make_algorithm("uldp_avg", dict()), plan, target_epsilon=2.0)
    naive = calibrate(make_algorithm("uldp_naive", dict()), plan, target_epsilon=2.0)
    assert naive == pytest.approx(2 * avg, rel=0.03)
