"""PriFedSync f-DP accounting: CLT μ, trade-off functions, rigorous PLD ε, calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from opacus.accountants.analysis import gdp as opacus_gdp

from silodp.accounting.conversions import gdp_delta, gdp_epsilon
from silodp.accounting.fdp import (
    PriFedSyncPlan,
    account_prifedsync,
    calibrate_prifedsync,
    client_sampled_epsilon,
    client_sampled_tradeoff,
    clt_mu,
    composed_client_sampled_tradeoff,
    subsampled_tradeoff,
    tradeoff_gaussian,
    tradeoff_pld,
)

ALPHAS = np.linspace(0.0, 1.0, 201)


def _plan(**kwargs: object) -> PriFedSyncPlan:
    base: dict[str, object] = {
        "noise_multiplier": 1.0,
        "sample_rates": (0.01,) * 10,
        "local_steps": 10,
        "rounds": 20,
    }
    base.update(kwargs)
    return PriFedSyncPlan(**base)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- μ


def test_clt_mu_closed_form_uniform() -> None:
    # σ = 1: √2·c·sqrt(e·Φ(1.5) + 3Φ(-0.5) - 2), c = 0.01·√1000
    c = 0.01 * math.sqrt(1000)
    inner = math.e * 0.9331927987311419 + 3 * 0.3085375387259869 - 2
    assert clt_mu(1.0, 0.01, 1000) == pytest.approx(math.sqrt(2) * c * math.sqrt(inner), rel=1e-12)
    assert clt_mu(1.0, 0.01, 1000, batch_sampling="poisson") == pytest.approx(
        c * math.sqrt(math.e - 1), rel=1e-12
    )


@pytest.mark.parametrize("sigma, q, steps", [(1.0, 0.01, 1000), (0.7, 0.05, 200), (2.5, 0.2, 37)])
def test_clt_mu_matches_opacus(sigma: float, q: float, steps: int) -> None:
    ours = clt_mu(sigma, q, steps)
    assert ours == pytest.approx(
        opacus_gdp.compute_mu_uniform(steps=steps, noise_multiplier=sigma, sample_rate=q), rel=1e-12
    )
    poisson = clt_mu(sigma, q, steps, batch_sampling="poisson")
    assert poisson == pytest.approx(
        opacus_gdp.compute_mu_poisson(steps=steps, noise_multiplier=sigma, sample_rate=q), rel=1e-12
    )
    # a wrong σ gives a different μ (the check can fail)
    assert clt_mu(1.1 * sigma, q, steps) < 0.95 * ours


def test_a_tiny_sigma_gives_an_unbounded_estimate_not_an_error() -> None:
    """Below σ ≈ 0.0375, e^{σ^-2} overflows a float: the CLT μ (an estimate, never the
    guarantee) raised OverflowError, which stopped the rigorous accounting and calibration
    (the σ search probes small σ) of plans whose target is reachable."""
    assert clt_mu(0.03, 0.01, 1) == math.inf
    assert clt_mu(0.03, 0.01, 1, batch_sampling="poisson") == math.inf
    assert clt_mu(0.03, 0.0, 1) == 0.0  # nothing sampled: nothing to estimate
    assert math.isfinite(clt_mu(0.04, 0.01, 1))
    plan = _plan(noise_multiplier=0.03, sample_rates=(0.01,) * 5, local_steps=1, rounds=1)
    report = account_prifedsync(plan)[-1]
    assert report.mu["client_max"] == math.inf
    assert report.epsilon["record"] > 0  # the rigorous route still answers (inf is a bound)
    sigma = calibrate_prifedsync(plan, target_epsilon=10.0)
    reached = account_prifedsync(
        _plan(noise_multiplier=sigma, sample_rates=(0.01,) * 5, local_steps=1, rounds=1)
    )[-1]
    assert 0.1 < sigma < 1.0 and reached.epsilon["record"] <= 10.0


def test_report_mu_weak_strong_and_linear_in_sqrt_steps_rounds() -> None:
    plan = _plan(sample_rates=(0.01, 0.02, 0.005), rounds=50)
    report = account_prifedsync(plan)[-1]
    mu_max = clt_mu(1.0, 0.02, 10 * 50)
    assert report.mu["client_max"] == pytest.approx(mu_max)
    assert report.mu["weak"] == pytest.approx(mu_max)
    assert report.mu["strong"] == pytest.approx(math.sqrt(2) * mu_max)  # √(m-1), m = 3
    assert clt_mu(1.0, 0.02, 4 * 500) == pytest.approx(2 * mu_max)


@pytest.mark.parametrize("mu", [0.3, 1.0, 3.0])
def test_gdp_conversion_round_trips(mu: float) -> None:
    eps = gdp_epsilon(mu, 1e-5)
    assert gdp_delta(mu, eps) == pytest.approx(1e-5, rel=1e-6)
    assert opacus_gdp.delta_eps_mu(eps=eps, mu=mu) == pytest.approx(1e-5, rel=1e-6)


# ----------------------------------------------------------------------------- trade-off functions


def _assert_tradeoff(values: np.ndarray) -> None:
    assert np.all(values >= -1e-12)
    assert np.all(values <= 1.0 - ALPHAS + 1e-12)
    assert np.all(np.diff(values) <= 1e-12)  # non-increasing
    assert np.all(np.diff(values, 2) >= -1e-9)  # convex on the uniform grid


def _assert_symmetric(func: object) -> None:
    values = func(ALPHAS)  # type: ignore[operator]
    # f symmetric ⇔ f(f(α)) = α on the part where f is strictly decreasing
    twice = func(values)  # type: ignore[operator]
    mask = values > 1e-9
    np.testing.assert_allclose(twice[mask], ALPHAS[mask], atol=1e-7)


@pytest.mark.parametrize("mu", [0.2, 1.0, 3.0])
def test_gaussian_tradeoff_properties(mu: float) -> None:
    values = tradeoff_gaussian(mu, ALPHAS)
    _assert_tradeoff(values)
    _assert_symmetric(lambda a: tradeoff_gaussian(mu, a))
    assert tradeoff_gaussian(0.0, ALPHAS) == pytest.approx(1.0 - ALPHAS)


@pytest.mark.parametrize("mu, p", [(1.0, 0.5), (3.0, 0.3), (0.5, 1.0)])
def test_client_sampled_tradeoff_properties(mu: float, p: float) -> None:
    values = client_sampled_tradeoff(mu, p, ALPHAS)
    _assert_tradeoff(values)
    _assert_symmetric(lambda a: client_sampled_tradeoff(mu, p, a))
    assert np.all(values >= tradeoff_gaussian(mu, ALPHAS))
    assert np.all(values >= 1.0 - ALPHAS - p * p - 1e-15)


@pytest.mark.parametrize("sigma, q", [(1.0, 0.3), (0.7, 0.05)])
def test_subsampled_tradeoff_properties(sigma: float, q: float) -> None:
    values = subsampled_tradeoff(sigma, q, ALPHAS)
    _assert_tradeoff(values)
    _assert_symmetric(lambda a: subsampled_tradeoff(sigma, q, a))
    # between no privacy loss and the unsampled Gaussian step
    assert np.all(values >= tradeoff_gaussian(1.0 / sigma, ALPHAS) - 1e-12)


def test_tradeoff_pld_is_pessimistic_and_tight_for_gaussian() -> None:
    for mu in (0.5, 1.0, 2.0):
        eps = tradeoff_pld(mu).get_epsilon_for_delta(1e-5)
        assert gdp_epsilon(mu, 1e-5) <= eps <= gdp_epsilon(mu, 1e-5) + 2e-3
    composed = client_sampled_epsilon(0.1, 1.0, 100, 1e-5, discretization=1e-4)
    assert gdp_epsilon(1.0, 1e-5) <= composed <= gdp_epsilon(1.0, 1e-5) + 1e-3


def test_subsampled_step_pld_matches_dp_accounting_on_both_directions() -> None:
    # C_q(G_{1/σ}) has δ(ε) = max(δ_remove, δ_add) of the Poisson pair (dp-accounting)
    from silodp.accounting.fdp import _step_pld

    ours = _step_pld(0.8, 0.1, "uniform", 1e-3)
    ref = pld_lib.from_gaussian_mechanism(
        standard_deviation=0.8, sampling_prob=0.1, value_discretization_interval=1e-4
    )
    for eps in (0.0, 0.05, 0.3, 1.0):
        assert ours.get_delta_for_epsilon(eps) >= ref.get_delta_for_epsilon(eps)
        assert ours.get_delta_for_epsilon(eps) == pytest.approx(
            ref.get_delta_for_epsilon(eps), rel=1e-6
        )


def test_client_sampled_composition_between_obvious_bounds() -> None:
    mu, rounds = 0.3, 30
    composed = client_sampled_epsilon(mu, 0.3, rounds, 1e-3, discretization=1e-4)
    no_sampling = client_sampled_epsilon(mu, 1.0, rounds, 1e-3, discretization=1e-4)
    single = client_sampled_epsilon(mu, 0.3, 1, 1e-3, discretization=1e-4)
    assert single <= composed <= no_sampling
    curve = composed_client_sampled_tradeoff(mu, 0.3, rounds, ALPHAS, discretization=1e-4)
    assert np.all(curve >= tradeoff_gaussian(mu * math.sqrt(rounds), ALPHAS) - 1e-3)
    assert np.all(curve <= client_sampled_tradeoff(mu, 0.3, ALPHAS) + 1e-12)
    # sampling helps the trade-off (total variation) even where ε at small δ is unchanged
    assert curve[100] > tradeoff_gaussian(mu * math.sqrt(rounds), ALPHAS)[100] + 1e-3


# ----------------------------------------------------------------------------- rigorous ε


def test_guarantee_is_rigorous_pld_not_clt() -> None:
    plan = _plan(noise_multiplier=1.0, sample_rates=(0.01,), local_steps=10, rounds=100)
    report = account_prifedsync(plan)[-1]
    assert report.epsilon_route["record"] == "pld"
    # independent: compose the same per-step PLD by hand
    from silodp.accounting.fdp import _step_pld

    direct = _step_pld(1.0, 0.01, "uniform", 1e-3).self_compose(1000).get_epsilon_for_delta(1e-5)
    assert report.epsilon["record"] == pytest.approx(direct, rel=1e-6)
    # the CLT value here is below the rigorous bound; it must not be the guarantee
    assert report.estimates["record_clt_weak"] < report.epsilon["record"]
    # and the rigorous bound is above the (smaller) Poisson add/remove PLD of the same steps
    poisson = pld_lib.from_gaussian_mechanism(
        standard_deviation=1.0, sampling_prob=0.01, value_discretization_interval=1e-3
    ).self_compose(1000)
    assert report.epsilon["record"] >= poisson.get_epsilon_for_delta(1e-5)


def test_rigorous_routes_agree_with_rdp_bound() -> None:
    plan = _plan(noise_multiplier=1.0, sample_rates=(0.05,), local_steps=5, rounds=10)
    report = account_prifedsync(plan)[-1]
    from silodp.accounting.conversions import RDP_ORDERS, rdp_epsilon
    from silodp.accounting.fdp import _step_rdp

    rdp = _step_rdp(1.0, 0.05, "uniform")
    assert rdp is not None
    rdp_eps = rdp_epsilon(RDP_ORDERS, rdp * 50, 1e-5)
    assert report.epsilon["record_every_round"] <= rdp_eps
    assert report.epsilon["record_every_round"] > 0.4 * rdp_eps


@pytest.mark.parametrize("q", [4e-7, 2.5e-6])
def test_a_tiny_batch_rate_is_never_rounded_down(q: float) -> None:
    """The RDP route represents q on a grid rounded *up*: rounded to nearest (as before),
    q = 4e-7 became 0, the route gave ε = 0, and the smaller-of-routes reported 0. Its curve
    must match dp-accounting's at the exact rate (10 of 10/q records) and the ε stay > 0."""
    from dp_accounting import dp_event

    from silodp.accounting.conversions import rdp_curve
    from silodp.accounting.fdp import _step_rdp

    sigma = 0.3
    rdp = _step_rdp(sigma, q, "uniform")
    exact = dp_event.SampledWithoutReplacementDpEvent(
        round(10 / q), 10, dp_event.GaussianDpEvent(sigma)
    )
    reference = rdp_curve(exact, replace_one=True)
    assert rdp is not None and np.all(reference > 0)
    assert np.all(rdp >= reference)
    np.testing.assert_allclose(rdp, reference, rtol=1e-5)
    plan = _plan(noise_multiplier=sigma, sample_rates=(q,) * 2, local_steps=100, rounds=100)
    assert account_prifedsync(plan)[-1].epsilon["record_every_round"] > 0.1


def test_poisson_batches_use_dp_accounting_replace_one() -> None:
    plan = _plan(batch_sampling="poisson", sample_rates=(0.02,), local_steps=5, rounds=10)
    report = account_prifedsync(plan)[-1]
    ref = pld_lib.from_gaussian_mechanism(
        standard_deviation=2.0,
        sensitivity=1.0,
        sampling_prob=0.02,
        value_discretization_interval=1e-3,
        neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE,
    ).self_compose(50)
    assert report.epsilon["record"] == pytest.approx(ref.get_epsilon_for_delta(1e-5), rel=1e-9)


def test_client_sampling_lowers_the_guarantee_and_is_monotone() -> None:
    eps = [account_prifedsync(_plan(client_rate=p))[-1].epsilon["record"] for p in (1.0, 0.5, 0.1)]
    assert eps[0] > eps[1] > eps[2] > 0
    report = account_prifedsync(_plan(client_rate=0.5))[-1]
    assert report.epsilon_route["record"] == "pld-client-sampling"
    assert report.epsilon["record"] < report.epsilon["record_every_round"]
    assert "record_clt_weak_client_sampling" in report.estimates


def test_per_round_reports_match_final_and_grow() -> None:
    plan = _plan(client_rate=0.5, rounds=6)
    rounds = account_prifedsync(plan, per_round=True)
    assert [r.round for r in rounds] == list(range(1, 7))
    eps = [r.epsilon["record"] for r in rounds]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    final = account_prifedsync(plan)[-1]
    assert eps[-1] == pytest.approx(final.epsilon["record"], rel=1e-6)
    assert rounds[2].mu["weak"] == pytest.approx(clt_mu(1.0, 0.01, 30))


def test_calibration_round_trips() -> None:
    plan = _plan(client_rate=0.5)
    sigma = calibrate_prifedsync(plan, target_epsilon=1.0)
    from dataclasses import replace

    at = account_prifedsync(replace(plan, noise_multiplier=sigma))[-1].epsilon["record"]
    below = account_prifedsync(replace(plan, noise_multiplier=sigma * 0.98))[-1].epsilon["record"]
    assert at <= 1.0 < below


def test_calibration_unreachable_names_the_target() -> None:
    plan = _plan(sample_rates=(1.0,), local_steps=1000, rounds=1000)
    with pytest.raises(ValueError, match="target_epsilon=1e-06"):
        calibrate_prifedsync(plan, target_epsilon=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"sample_rates": (0.1, 1.5)}, "sample_rates\\[1\\]"),
        ({"sample_rates": ()}, "sample rate"),
        ({"local_steps": 0}, "local_steps"),
        ({"rounds": 0}, "rounds"),
        ({"client_rate": 0.0}, "client_rate"),
        ({"delta": 1.0}, "delta"),
        ({"batch_sampling": "shuffle"}, "batch_sampling"),
    ],
)
def test_plan_rejects_bad_values(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        _plan(**kwargs)


def test_prifedsync_clt_mu_is_reported_as_an_estimate_not_as_gaussian_dp() -> None:
    """The paper's CLT μ was printed and stored as `mu`, beside user_ldp's exact μ; the exact
    trade-off of one subsampled step, C_q(G_{1/σ}), falls below G_μ at that μ, so it is no
    μ-GDP guarantee: `mu` is empty and the CLT values are `mu_estimates`
    (tests/test_cli_prifedsync.py checks the keys)."""
    from scipy import stats

    from silodp.accounting.tradeoff import clt_mu, subsampled_tradeoff, tradeoff_gaussian

    sigma, q = 1.0, 0.1
    mu = clt_mu(sigma, q, 1)
    alphas = np.asarray([1e-3, 1e-4, 1e-6])
    exact = subsampled_tradeoff(sigma, q, alphas)
    assert np.all(exact < tradeoff_gaussian(mu, alphas))  # the CLT μ is optimistic here
    # the smallest μ the step satisfies (on this grid; 1/σ as α → 0) is far above the CLT value
    grid = np.geomspace(1e-12, 0.999, 20000)
    smallest = np.max(stats.norm.isf(grid) - stats.norm.ppf(subsampled_tradeoff(sigma, q, grid)))
    assert smallest > 3 * mu


# ----------------------------------------------------------------------------- mixed rounds


@pytest.mark.parametrize("rigorous_only", [False, True])
@pytest.mark.parametrize("sampled_first", [False, True])
def test_rounds_of_different_runs_compose_each_at_its_own_sigma_and_client_rate(
    rigorous_only: bool, sampled_first: bool
) -> None:
    """A shared ledger replays several PriFedSync runs into one accountant: each run's rounds
    count at that run's σ and client rate p (they counted at the replaying run's p)."""
    from silodp.accounting.conversions import RDP_ORDERS, rdp_epsilon
    from silodp.accounting.fdp import FdpAccountant, _step_pld, _step_rdp, step_events

    cells = [(1.0, 1.0, 3), (2.0, 0.3, 4)]  # (σ, p, rounds); q = 0.05, 5 steps each
    if sampled_first:
        cells.reverse()
    accountant = FdpAccountant(clients=4, client_rate=0.3, delta=1e-5, rigorous_only=rigorous_only)
    for sigma, p, rounds in cells:
        accountant.compose_round([step_events(sigma, 0.05, 5)] * 4, count=rounds, client_rate=p)
    # independent: dp-accounting's composition of each cell's rounds, mixed at its own p
    sampled = every = None
    identity = pld_lib.identity(value_discretization_interval=1e-3)
    for sigma, p, rounds in cells:
        one = _step_pld(sigma, 0.05, "uniform", 1e-3).self_compose(5)
        full = one.self_compose(rounds)
        mixed = (one.compute_mixture(identity, p) if p < 1 else one).self_compose(rounds)
        every = full if every is None else every.compose(full)
        sampled = mixed if sampled is None else sampled.compose(mixed)
    assert sampled is not None and every is not None
    eps = accountant.estimates()
    truth = sampled.get_epsilon_for_delta(1e-5)
    assert eps["record"].epsilon == pytest.approx(truth, rel=1e-6)
    # at the replaying accountant's p for every round it read lower: the bug this guards
    wrong = FdpAccountant(clients=4, client_rate=0.3, delta=1e-5, rigorous_only=rigorous_only)
    for sigma, _, rounds in cells:
        wrong.compose_round([step_events(sigma, 0.05, 5)] * 4, count=rounds)
    assert wrong.estimates()["record"].epsilon < 0.8 * truth
    if rigorous_only:
        assert "record_every_round" not in eps
        return
    rdp = sum(_step_rdp(s, 0.05, "uniform") * 5 * r for s, _, r in cells)
    every_eps = min(every.get_epsilon_for_delta(1e-5), rdp_epsilon(RDP_ORDERS, rdp, 1e-5))
    assert eps["record_every_round"].epsilon == pytest.approx(every_eps, rel=1e-6)
    mu = math.sqrt(sum(clt_mu(s, 0.05, 5 * r) ** 2 for s, _, r in cells))
    assert accountant.mu_estimates()["client_max"] == pytest.approx(mu, rel=1e-12)
    # the paper's client-sampled estimate: each round at its own CLT μ and p
    from silodp.accounting.tradeoff import ESTIMATE_DISCRETIZATION

    paper = None
    for sigma, p, rounds in cells:
        one = tradeoff_pld(clt_mu(sigma, 0.05, 5), p=p, discretization=ESTIMATE_DISCRETIZATION)
        paper = (
            one.self_compose(rounds) if paper is None else paper.compose(one.self_compose(rounds))
        )
    assert paper is not None
    assert accountant.labelled_estimates()["record_clt_weak_client_sampling"] == pytest.approx(
        paper.get_epsilon_for_delta(1e-5), rel=1e-6
    )


def test_a_round_beyond_the_estimates_range_drops_the_client_sampled_estimate() -> None:
    """A round whose CLT μ is beyond the estimate's range was left out of it while the others
    stayed: the estimate read as if that round had not happened."""
    from silodp.accounting.fdp import FdpAccountant, step_events

    accountant = FdpAccountant(clients=4, client_rate=0.5, delta=1e-5)
    accountant.compose_round([step_events(1.0, 0.05, 5)] * 4, count=3)
    assert "record_clt_weak_client_sampling" in accountant.labelled_estimates()
    accountant.compose_round([step_events(0.25, 1.0, 1)] * 4)  # μ of the round ~ 4,000
    estimates = accountant.labelled_estimates()
    assert "record_clt_weak_client_sampling" not in estimates
    assert estimates["record_clt_weak"] == math.inf
