"""Calibration answers in a bounded number of accountant evaluations, whatever the target.

Evaluations are counted (never timed): each call of ``account_events`` inside
:func:`~silodp.accounting.calibrate.calibrate_noise` builds one accountant and composes the
plan once, which is what costs time.
"""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from silodp.accounting import PrivacyPlan
from silodp.accounting import calibrate as calibrate_mod
from silodp.accounting.calibrate import (
    MAX_EVALUATIONS,
    MAX_TARGET_EPSILON,
    MIN_NOISE_MULTIPLIER,
    REPORT_CHECKS,
    find_sigma,
)
from silodp.accounting.conversions import gdp_epsilon
from silodp.algorithms import make_algorithm
from silodp.algorithms.planning import calibrate
from silodp.cli.account import account_report
from silodp.errors import CalibrationError, SilodpError

#: what calibrate_noise may ever spend: a fast bracket, a calibrating one where that fails,
#: the search, the report-stage confirmations and the last search at the report stage
HARD_BOUND = 4 * MAX_EVALUATIONS + REPORT_CHECKS
#: what it spends in practice (10-16 measured on these plans); far below the hard bound, so a
#: regression to a long search fails here before it reaches the hard bound
TYPICAL_BOUND = 30


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """ε of every accountant evaluation calibration makes, in order."""
    seen: list[float] = []
    original = calibrate_mod.account_events

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(max(e.epsilon for e in out[-1].values()))
        return out

    monkeypatch.setattr(calibrate_mod, "account_events", counted)
    return seen


PLAN = {"sample_rate": 0.05, "steps": 10, "rounds": 3, "silos": 2}


@pytest.mark.parametrize("target", [1e6, 1e3, math.inf, float("nan"), 0.0, -1.0])
def test_absurd_target_fails_before_any_accounting(evaluations, target) -> None:
    with pytest.raises(CalibrationError, match=r"target_epsilon=.* to be in \(0, 100\]") as err:
        account_report("local_item_dp", target_epsilon=target, **PLAN)
    assert repr(target) in str(err.value)
    if target > MAX_TARGET_EPSILON:
        assert "no meaningful privacy" in str(err.value)
    assert evaluations == []


def test_cli_names_the_absurd_target_and_the_range() -> None:
    from silodp.cli import app

    result = CliRunner().invoke(
        app,
        ["account", "--algorithm", "local_item_dp", "--target-epsilon", "1e6", "--group-size", "1"]
        + ["--silos", "1"],
    )
    assert result.exit_code == 2
    assert "--target-epsilon=1000000.0" in result.output  # the option, as the user typed it
    assert "(0, 100]" in result.output


@pytest.mark.parametrize(
    ("algorithm", "target", "kwargs"),
    [
        ("user_ldp", 1e-9, {"steps": 100, "rounds": 100}),
        ("local_group_dp", 1e-6, {**PLAN, "settings": {"group_size": 4}}),
        ("uldp_avg", 1e-7, {"sample_rate": 0.5, "rounds": 20, "silos": 3}),
    ],
)
def test_hopeless_target_fails_fast(evaluations, algorithm, target, kwargs) -> None:
    """σ would have to exceed 10^4: the bracketing search jumps at least 2x (up to 64x) from
    σ = 1, so it gives up after about ten fast-route evaluations."""
    with pytest.raises(CalibrationError, match="unreachable") as err:
        account_report(algorithm, target_epsilon=target, **kwargs)
    assert f"target_epsilon={target!r}" in str(err.value)
    assert len(evaluations) >= 1
    assert len(evaluations) <= 15


SMALL = PrivacyPlan(sampling_rates=(0.05, 0.05), rounds=2, silos_per_round=2, span=2, delta=1e-5)


@pytest.mark.parametrize(
    ("algorithm", "target", "settings"),
    [
        ("local_item_dp", MAX_TARGET_EPSILON, {}),  # the largest accepted target: small σ
        ("local_group_dp", 20.0, {"group_size": 3}),
        ("higradavg_dp", 3.0, {"group_size": 3}),
        ("prifedsync", 2.0, {}),  # the f-DP accountant, calibrated to 1e-3
    ],
)
def test_reachable_target_in_few_evaluations(evaluations, algorithm, target, settings) -> None:
    """The σ ``silodp account --target-epsilon`` reports, in at most TYPICAL_BOUND accountant
    evaluations; the last one is the reporting accountant confirming the target."""
    algo = make_algorithm(algorithm, {"local_steps": 5, "num_silos": 2, **settings})
    calibrate(algo, SMALL, target_epsilon=target, rel_tol=algo.calibration_tolerance)
    assert len(evaluations) <= TYPICAL_BOUND <= HARD_BOUND
    assert evaluations[-1] <= target


# --- the root finder alone ------------------------------------------------------------------


def _counting(fn):
    calls: list[float] = []

    def wrapped(sigma: float) -> float:
        calls.append(sigma)
        return fn(sigma)

    return wrapped, calls


def test_find_sigma_never_goes_below_the_minimum_noise() -> None:
    """ε that meets the target at every σ (e.g. ε ≡ 0): refused at σ_min, not searched to 0."""
    for fn in (lambda s: 0.0, lambda s: 1e-6 / s):
        wrapped, calls = _counting(fn)
        with pytest.raises(CalibrationError, match="too large to calibrate"):
            find_sigma(wrapped, 1.0)
        assert min(calls) >= MIN_NOISE_MULTIPLIER
        assert len(calls) <= 15


def test_find_sigma_with_an_upper_end_steps_down_geometrically() -> None:
    """A looser route's σ far above the root (1000x): the search steps down by the ε ∝ 1/σ
    factor instead of halving towards 0."""
    wrapped, calls = _counting(lambda s: gdp_epsilon(math.sqrt(10) / s, 1e-5))
    sigma = find_sigma(wrapped, 2.0, hi=4000.0)
    exact = find_sigma(lambda s: gdp_epsilon(math.sqrt(10) / s, 1e-5), 2.0, rel_tol=1e-9)
    assert exact <= sigma <= exact * 1.01
    assert len(calls) <= 15


def test_find_sigma_stops_after_max_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap holds whatever ε does: with a cap of 5, a search needing more raises after
    exactly 5 evaluations."""
    monkeypatch.setattr(calibrate_mod, "MAX_EVALUATIONS", 5)
    wrapped, calls = _counting(lambda s: gdp_epsilon(math.sqrt(10) / s, 1e-5))
    with pytest.raises(CalibrationError, match="within 5 evaluations"):
        find_sigma(wrapped, 2.0, rel_tol=1e-9)
    assert len(calls) == 5


def test_find_sigma_refuses_tolerances_below_float_resolution() -> None:
    with pytest.raises(SilodpError, match="rel_tol"):
        find_sigma(lambda s: 1.0 / s, 0.5, rel_tol=1e-16)


def _group_conversion_case():
    """A plan whose group conversion multiplies the calibrating grid's error (m·k = 200), and
    the ε at subject level its run reports for a σ."""
    from silodp.accounting.plan import account_events

    algorithm = make_algorithm(
        "local_group_dp",
        {"local_steps": 5, "batch_size": 1, "num_silos": 4, "group_size": 100, "span_cap": 2},
    )
    plan = PrivacyPlan(sampling_rates=(0.01,) * 4, rounds=10, silos_per_round=4, span=2, delta=1e-5)

    def reported(sigma: float) -> float:
        accountant = algorithm.make_accountant(
            span=2, delta=plan.delta, stage="report", units=("subject",)
        )
        events = algorithm.with_noise(sigma).plan_events(plan)
        return account_events(accountant, events, plan)[-1]["subject"].epsilon

    return algorithm, plan, reported


def test_calibration_is_the_smallest_sigma_the_reported_epsilon_allows() -> None:
    """Where the group conversion multiplies ε (by m·k), the calibrating accountant's coarser
    grid was multiplied too: σ 61.6 was chosen where 19.9 already met the target (ε 2.17
    reported against 4). The calibrated σ is now within the tolerance of the smallest σ the
    reporting accountant allows, and its reported ε meets the target."""
    algorithm, plan, reported = _group_conversion_case()
    sigma = calibrate(algorithm, plan, target_epsilon=4.0)
    smallest = find_sigma(reported, 4.0, rel_tol=1e-3)
    assert reported(sigma) <= 4.0
    assert smallest <= sigma <= smallest * 1.03


def test_a_failed_last_search_keeps_the_sigma_that_met_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last search (at the report stage) only lowers a σ that already meets the target:
    where it fails, calibration returns that σ instead of failing."""
    algorithm, plan, reported = _group_conversion_case()
    found: list[float] = []

    def searching(*args, **kwargs) -> float:
        found.append(find_sigma(*args, **kwargs))
        return found[-1]

    monkeypatch.setattr(calibrate_mod, "find_sigma", searching)
    refined = calibrate(algorithm, plan, target_epsilon=4.0)
    searches, before = len(found), found[-2]  # the last search lowered the one before it
    assert refined == found[-1] < before

    def failing_last(*args, **kwargs) -> float:
        found.append(0.0)
        if len(found) == 2 * searches:
            raise CalibrationError("the search did not converge")
        return find_sigma(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "find_sigma", failing_last)
    kept = calibrate(algorithm, plan, target_epsilon=4.0)
    assert kept == pytest.approx(before) and reported(kept) <= 4.0
