"""The bounded composed PLD stays an upper bound, close to the full-support composition.

The federated accountant keeps a composed PLD at most ``pld_points`` grid points wide by
splitting it onto coarser grids (:mod:`silodp.accounting.coarsen`). These tests compare its ε,
composed one round at a time, with dp-accounting's own PLDs of the same mechanism composed in
one call on the accountant's grid without any coarsening: the library's pessimistic PLD (our ε
must be at least its ε, and within a stated tolerance) and the library's *optimistic* PLD, a
lower bound on the true ε (our ε must be above it), at 10, 100 and 1000 rounds.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp.accounting import FederatedAccountant, SiloPrivacy, conversions
from silodp.accounting.accountant import _dominating_by_rate
from silodp.accounting.coarsen import coarsen_pld, coarsen_pmf, pld_points
from silodp.accounting.events import poisson_gaussian_steps, subject_mixture_steps
from silodp.accounting.hockey import EpsilonForDelta
from silodp.accounting.interface import accountant_from_spec

DELTA = 1e-5
STEP = 1e-3  # the accountant's discretisation in these tests
ROUNDS = (10, 100, 1000)
EPSILONS = np.linspace(-2.0, 12.0, 57)

# Poisson-subsampled Gaussian: 2 DP-SGD steps per round
Q, SIGMA, STEPS = 0.05, 1.0, 2
# a subject with K records under record sampling (mixture of Gaussians), seen by SPAN silos
MIX_Q, MIX_SIGMA, K, SPAN = 0.02, 2.0, 3, 2

#: Relative tolerances of the bounded composition against the library's full-support ε, for
#: the default budget (2^14 points) and one forced small (2^12 points). Measured gaps at 1000
#: rounds: 1e-4 and 1.8e-3 (sampled Gaussian), 6e-5 and 1.7e-3 (mixture); the error of the
#: split grows like rounds / budget², so longer plans need a larger budget.
FORCED = 2**12
TOLERANCE = {None: 5e-4, FORCED: 5e-3}


def _sampled_gaussian(pessimistic: bool) -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_gaussian_mechanism(
        SIGMA,
        sampling_prob=Q,
        value_discretization_interval=STEP,
        pessimistic_estimate=pessimistic,
    )


@cache
def _mixture(pessimistic: bool) -> pld_lib.PrivacyLossDistribution:
    event = subject_mixture_steps(MIX_Q, MIX_SIGMA, K, 1).event
    assert isinstance(event, dp_event.MixtureOfGaussiansDpEvent)
    return pld_lib.from_mixture_gaussian_mechanism(
        standard_deviation=event.standard_deviation,
        sensitivities=list(event.sensitivities),
        sampling_probs=list(event.sampling_probs),
        value_discretization_interval=STEP,
        pessimistic_estimate=pessimistic,
    )


@cache
def _composed(route: str, points: int | None) -> dict[int, tuple[float, dict[str, float]]]:
    """ε and routes after each of ROUNDS rounds, composed one round at a time."""
    if route == "sampled":
        silos = [SiloPrivacy(events={"record": poisson_gaussian_steps(Q, SIGMA, STEPS)})]
        accountant = FederatedAccountant(
            units=("record",), span=1, delta=DELTA, routes=("pld",), **_budget(points)
        )
        unit = "record"
    else:
        record = poisson_gaussian_steps(MIX_Q, MIX_SIGMA, 1)
        silo = SiloPrivacy(
            events={"subject": subject_mixture_steps(MIX_Q, MIX_SIGMA, K, 1)},
            record_event=record,
            group_size=K,
        )
        silos = [silo] * SPAN
        accountant = FederatedAccountant(
            units=("subject",),
            span=SPAN,
            delta=DELTA,
            routes=("pld", "dp-group"),
            **_budget(points),
        )
        unit = "subject"
    out = {}
    for n in range(1, max(ROUNDS) + 1):
        accountant.compose_round(silos)
        if n in ROUNDS:
            est = accountant.estimates()[unit]
            out[n] = (est.epsilon, dict(est.routes))
    return out


def _budget(points: int | None) -> dict[str, int]:
    return {} if points is None else {"pld_points": points}


def _library_epsilon(route: str, rounds: int, pessimistic: bool) -> float:
    if route == "sampled":
        return (
            _sampled_gaussian(pessimistic).self_compose(rounds * STEPS).get_epsilon_for_delta(DELTA)
        )
    return _mixture(pessimistic).self_compose(rounds * SPAN).get_epsilon_for_delta(DELTA)


@pytest.mark.parametrize("points", [None, FORCED])
@pytest.mark.parametrize("route", ["sampled", "mixture"])
@pytest.mark.parametrize("rounds", ROUNDS)
def test_bounded_composition_is_an_upper_bound_close_to_the_full_one(
    route: str, points: int | None, rounds: int
) -> None:
    ours, _ = _composed(route, points)[rounds]
    pessimistic = _library_epsilon(route, rounds, pessimistic=True)
    optimistic = _library_epsilon(route, rounds, pessimistic=False)
    assert ours >= optimistic  # above a lower bound on the true ε
    assert ours >= pessimistic  # never below the full-support composition
    assert ours <= pessimistic * (1 + TOLERANCE[points])


def test_the_forced_budget_did_coarsen() -> None:
    """The forced budget is below the supports composed here from 10 rounds on, so the checks
    above test the coarsening (the default budget starts coarsening later)."""
    assert pld_points(_sampled_gaussian(True).self_compose(10 * STEPS)) > FORCED
    assert pld_points(_mixture(True).self_compose(10 * SPAN)) > FORCED


@pytest.mark.parametrize("rounds", ROUNDS)
def test_dp_group_route_on_a_bounded_record_pld_is_an_upper_bound(rounds: int) -> None:
    """The (ε, δ) group conversion reads the record-level PLD, which is bounded too; the
    same conversion of the library's full-support record PLD is a lower value."""
    _, routes = _composed("mixture", FORCED)[rounds]
    record = pld_lib.from_gaussian_mechanism(
        MIX_SIGMA, sampling_prob=MIX_Q, value_discretization_interval=STEP
    ).self_compose(rounds)
    reference = conversions.group_epsilon_dp(
        EpsilonForDelta(record), group_size=K, delta=DELTA, compositions=SPAN
    )
    assert routes["dp-group"] >= reference
    assert routes["dp-group"] <= reference * (1 + TOLERANCE[FORCED])


@pytest.mark.parametrize("factor", [2, 3, 16])
def test_coarsening_keeps_mass_and_dominates(factor: int) -> None:
    fine = _sampled_gaussian(True).self_compose(50)
    coarse = coarsen_pld(fine, factor)
    for pmf, original in ((coarse._pmf_remove, fine._pmf_remove), (coarse._pmf_add, fine._pmf_add)):
        dense, before = pmf.to_dense_pmf(), original.to_dense_pmf()
        losses = (dense._lower_loss + np.arange(dense.size)) * dense._discretization
        fine_losses = (before._lower_loss + np.arange(before.size)) * before._discretization
        assert dense._discretization == pytest.approx(factor * STEP, rel=1e-15)
        assert dense._probs.sum() == pytest.approx(before._probs.sum(), rel=1e-12)
        # the other distribution's mass Σ p e^{-l} is kept (to within the upward margin)
        assert np.dot(dense._probs, np.exp(-losses)) == pytest.approx(
            np.dot(before._probs, np.exp(-fine_losses)), rel=1e-9
        )
        assert dense._infinity_mass == before._infinity_mass
    deltas_fine = fine.get_delta_for_epsilon(EPSILONS)
    deltas_coarse = coarse.get_delta_for_epsilon(EPSILONS)
    assert np.all(deltas_coarse >= deltas_fine * (1 - 1e-12))
    assert coarse.get_epsilon_for_delta(DELTA) >= fine.get_epsilon_for_delta(DELTA)


def test_rounding_down_instead_would_be_caught() -> None:
    """The dominance check above can fail: a PMF moved one coarse step *down* (what a wrong
    split would do) gives smaller δ at some ε."""
    fine = _sampled_gaussian(True).self_compose(50)
    coarse = coarsen_pmf(fine._pmf_remove, 4)
    shifted = type(coarse)(
        coarse._discretization, coarse._lower_loss - 1, coarse._probs, coarse._infinity_mass, True
    )
    deltas_fine = fine._pmf_remove.get_delta_for_epsilon(EPSILONS)
    assert np.any(shifted.get_delta_for_epsilon(EPSILONS) < deltas_fine * (1 - 1e-12))


def test_composed_support_stays_bounded() -> None:
    """After many rounds the kept PLD is at most the budget plus one round's event wide."""
    points = 2**10
    accountant = FederatedAccountant(
        units=("record",), span=1, delta=DELTA, routes=("pld",), pld_points=points
    )
    silos = [SiloPrivacy(events={"record": poisson_gaussian_steps(Q, SIGMA, STEPS)})]
    accountant.compose_round(silos, count=300)
    for _ in range(20):
        accountant.compose_round(silos)
    state = accountant._views["released"]["record"]
    assert state.pld is not None
    assert pld_points(state.pld) <= 2 * points
    assert state.pld_factor > 1


def test_full_support_accountant_is_the_old_composition() -> None:
    """``pld_points=None`` composes on the fine grid only: the library's ε of the same
    round-by-round composition, bit for bit."""
    event = poisson_gaussian_steps(Q, SIGMA, STEPS)
    accountant = FederatedAccountant(
        units=("record",), span=1, delta=DELTA, routes=("pld",), pld_points=None
    )
    reference = pld_lib.identity(value_discretization_interval=STEP)
    one_round = _sampled_gaussian(True).self_compose(STEPS).self_compose(1)
    for _ in range(30):
        accountant.compose_round([SiloPrivacy(events={"record": event})])
        reference = reference.compose(one_round)
    assert accountant.estimates()["record"].epsilon == reference.get_epsilon_for_delta(DELTA)


def test_spec_round_trips_the_budget_and_old_specs_keep_the_full_support() -> None:
    accountant = FederatedAccountant(units=("record",), span=1, delta=DELTA, pld_points=4096)
    rebuilt = accountant_from_spec(accountant.spec())
    assert isinstance(rebuilt, FederatedAccountant)
    assert rebuilt.pld_points == 4096
    old = {k: v for k, v in accountant.spec().items() if k != "pld_points"}
    legacy = accountant_from_spec(old)
    assert isinstance(legacy, FederatedAccountant)
    assert legacy.pld_points is None


def test_dominating_event_by_rate() -> None:
    low, high = poisson_gaussian_steps(0.01, 1.0, 5), poisson_gaussian_steps(0.02, 1.0, 5)
    assert _dominating_by_rate([low, high, low]) == 1
    # another noise or step count: not comparable by rates alone
    assert _dominating_by_rate([low, poisson_gaussian_steps(0.02, 2.0, 5)]) is None
    assert _dominating_by_rate([low, poisson_gaussian_steps(0.02, 1.0, 6)]) is None


def test_the_accountant_composes_events_that_differ_otherwise() -> None:
    """A lower rate with far less noise: neither event dominates by rate, so both are
    composed (the same ε as one silo charged both), at least the worse one's alone."""
    noisy = poisson_gaussian_steps(0.05, 5.0, 5)
    sharp = poisson_gaussian_steps(0.04, 0.8, 5)
    both = FederatedAccountant(units=("record",), span=1, delta=DELTA)
    both.compose_round(
        [SiloPrivacy(events={"record": noisy}), SiloPrivacy(events={"record": sharp})]
    )
    joint = FederatedAccountant(units=("record",), span=1, delta=DELTA)
    joint.compose_round([SiloPrivacy(events={"record": dp_event.ComposedDpEvent((noisy, sharp))})])
    alone = FederatedAccountant(units=("record",), span=1, delta=DELTA)
    alone.compose_round([SiloPrivacy(events={"record": sharp})])
    assert both.epsilons()["record"] == joint.epsilons()["record"]
    assert both.epsilons()["record"] >= alone.epsilons()["record"]
    assert math.isfinite(both.epsilons()["record"])


@pytest.mark.parametrize("factor", [1024, 16384, 262144])
def test_upper_share_is_never_below_the_exact_one_at_large_factors(factor: int) -> None:
    """A point at offset o above its lower coarse point sends (1 - e^{-o})/(1 - e^{-c}) of its
    mass up; computed in float64 it must not fall below the exact value (here from 50-digit
    decimals), however coarse the grid: less mass up would make δ optimistic."""
    from decimal import Decimal, getcontext

    from dp_accounting.pld import pld_pmf

    getcontext().prec = 50
    fine = 1e-3
    for step in (1, factor // 7, factor // 2, factor - 1):
        pmf = pld_pmf.DensePLDPmf(fine, step, np.array([1.0]), 0.0, pessimistic_estimate=True)
        out = coarsen_pmf(pmf, factor)
        probs = np.asarray(out._probs)  # noqa: SLF001
        upper = step // factor + 1 - out._lower_loss  # noqa: SLF001
        up = float(probs[upper]) if 0 <= upper < len(probs) else 0.0
        o, c = Decimal(step) * Decimal(fine), Decimal(factor) * Decimal(fine)
        exact = (1 - (-o).exp()) / (1 - (-c).exp())
        assert Decimal(up) >= exact, (factor, step, up, exact)
