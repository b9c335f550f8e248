"""account_plan and calibrate: calibrated σ meets the target tightly; clear errors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from silodp.accounting import CalibrationError, PrivacyPlan
from silodp.accounting.accountant import FederatedAccountant
from silodp.algorithms import make_algorithm
from silodp.algorithms.planning import account_plan, calibrate


def _with(settings: dict, **values: object) -> dict:
    """``settings`` with some hyperparameters changed."""
    return {**settings, **values}


# Equal rates keep calibration fast (no ranking of silo events per σ probed); unequal rates
# are covered by test_plan_uses_worst_silo_and_participants.
PLAN = PrivacyPlan(sampling_rates=(0.1, 0.1), rounds=8, silos_per_round=2, span=2, delta=1e-5)
CONFIG = dict(local_steps=5, batch_size=10, group_size=2)


def _epsilon(name: str, sigma: float, unit: str, plan: PrivacyPlan = PLAN) -> float:
    algo = make_algorithm(name, _with(CONFIG, noise_multiplier=sigma))
    return account_plan(algo, plan)[-1][unit].epsilon


@pytest.mark.parametrize(
    ("name", "unit", "target"),
    [
        ("local_item_dp", "record", 2.0),
        ("local_group_dp", "subject", 4.0),
        ("higradavg_dp", "subject", 3.0),
        ("user_ldp", "subject", 3.0),
        ("user_ldp", "silo", 1.0),
    ],
)
def test_calibration_is_valid_and_tight(name, unit, target) -> None:
    algo = make_algorithm(name, CONFIG)
    sigma = calibrate(
        make_algorithm(name, CONFIG),
        PLAN,
        target_epsilon=target,
        unit=None if unit == algo.calibration_unit else unit,
    )
    assert _epsilon(name, sigma, unit) <= target
    assert _epsilon(name, sigma * 0.97, unit) > target


def test_calibration_default_unit_is_the_algorithms() -> None:
    sigma_default = calibrate(make_algorithm("local_item_dp", CONFIG), PLAN, target_epsilon=2.0)
    sigma_record = calibrate(
        make_algorithm("local_item_dp", CONFIG), PLAN, target_epsilon=2.0, unit="record"
    )
    assert sigma_default == sigma_record
    # subject-level protection of the same mechanism needs more noise
    sigma_subject = calibrate(
        make_algorithm("local_item_dp", CONFIG), PLAN, target_epsilon=2.0, unit="subject"
    )
    assert sigma_subject > sigma_record


def test_calibration_more_rounds_need_more_noise() -> None:
    longer = replace(PLAN, rounds=32)
    a = calibrate(make_algorithm("user_ldp", CONFIG), PLAN, target_epsilon=2.0)
    b = calibrate(make_algorithm("user_ldp", CONFIG), longer, target_epsilon=2.0)
    assert b == pytest.approx(2 * a, rel=0.03)  # μ ∝ sqrt(R)/σ for unsampled Gaussians


def test_unreachable_target_raises() -> None:
    with pytest.raises(CalibrationError, match=r"epsilon=0\.001 .*unreachable.*'user_ldp'"):
        calibrate(make_algorithm("user_ldp", CONFIG), PLAN, target_epsilon=1e-3)


def test_unprotected_unit_raises() -> None:
    with pytest.raises(CalibrationError, match=r"unit='record'.*'higradavg_dp' protects: subject"):
        calibrate(make_algorithm("higradavg_dp", CONFIG), PLAN, target_epsilon=1.0, unit="record")
    with pytest.raises(CalibrationError, match=r"unit='silo'"):
        calibrate(make_algorithm("local_item_dp", CONFIG), PLAN, target_epsilon=1.0, unit="silo")


def test_non_private_algorithm_raises() -> None:
    with pytest.raises(CalibrationError, match="'fedavg' is not private"):
        calibrate(make_algorithm("fedavg", CONFIG), PLAN, target_epsilon=1.0)


def test_bad_target_raises() -> None:
    with pytest.raises(ValueError, match=r"target_epsilon=0"):
        calibrate(make_algorithm("user_ldp", CONFIG), PLAN, target_epsilon=0)


@pytest.mark.parametrize("name", ["local_item_dp", "higradavg_dp", "user_ldp"])
def test_per_round_is_monotone_and_ends_at_one_shot(name) -> None:
    algo = make_algorithm(name, _with(CONFIG, noise_multiplier=1.5))
    per_round = account_plan(algo, PLAN, per_round=True)
    one_shot = account_plan(algo, PLAN)
    assert len(per_round) == PLAN.rounds and len(one_shot) == 1
    for unit in algo.units:
        eps = [r[unit].epsilon for r in per_round]
        assert all(0 < e for e in eps)
        assert all(a <= b * (1 + 1e-9) for a, b in zip(eps, eps[1:], strict=False))
        assert eps[0] < eps[-1]
        assert eps[-1] == pytest.approx(one_shot[0][unit].epsilon, rel=1e-3)


def test_plan_uses_worst_silo_and_participants() -> None:
    algo = make_algorithm("higradavg_dp", _with(CONFIG, noise_multiplier=1.0))
    mixed = replace(PLAN, sampling_rates=(0.1, 0.05, 0.2))
    worst_only = replace(PLAN, sampling_rates=(0.2, 0.2, 0.2))
    assert account_plan(algo, mixed)[0]["subject"].epsilon == pytest.approx(
        account_plan(algo, worst_only)[0]["subject"].epsilon, rel=1e-12
    )
    # span 2 but only one silo per round: no horizontal composition
    one = account_plan(algo, replace(mixed, silos_per_round=1))[0]["subject"].epsilon
    two = account_plan(algo, mixed)[0]["subject"].epsilon
    assert one < two


def test_fedavg_plan_is_empty() -> None:
    algo = make_algorithm("fedavg", CONFIG)
    assert account_plan(algo, PLAN) == [{}]
    assert account_plan(algo, PLAN, per_round=True) == [{}] * PLAN.rounds


def test_accountant_factory_is_used() -> None:
    made: list[FederatedAccountant] = []

    def factory(algorithm, plan, **kw):
        acc = FederatedAccountant(units=algorithm.units, span=plan.span, delta=plan.delta, **kw)
        made.append(acc)
        return acc

    algo = make_algorithm("user_ldp", _with(CONFIG, noise_multiplier=2.0))
    account_plan(algo, PLAN, accountant_factory=factory)
    assert len(made) == 1 and made[0].rounds == PLAN.rounds
    steps, rounds, span = CONFIG["local_steps"], PLAN.rounds, PLAN.span
    assert made[0].mu()["subject"] == pytest.approx(math.sqrt(steps * rounds * span) / 1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampling_rates": ()}, "at least one silo"),
        ({"sampling_rates": (0.1, 1.5)}, r"sampling_rates\[1\]=1\.5"),
        ({"rounds": 0}, "rounds=0"),
        ({"silos_per_round": 4}, r"silos_per_round=4 to be an integer in \[1, 3\]"),
        ({"span": 0}, "span=0"),
        ({"delta": 1.0}, "delta=1.0"),
    ],
)
def test_plan_validation(kwargs, match) -> None:
    base = {
        "sampling_rates": (0.1, 0.2, 0.3),
        "rounds": 2,
        "silos_per_round": 2,
        "span": 1,
        "delta": 1e-5,
    }
    with pytest.raises(ValueError, match=match):
        PrivacyPlan(**{**base, **kwargs})


@pytest.mark.parametrize("target", [0.3, 1.0, 4.0, 50.0])
@pytest.mark.parametrize("hi", [None, 400.0])
def test_find_sigma_brackets_the_root_within_tolerance(target, hi) -> None:
    """On a closed form (μ-GDP of T Gaussian steps: μ = √T/σ) the answer meets the target and
    is within rel_tol of the exact σ, in few evaluations."""
    from silodp.accounting import find_sigma
    from silodp.accounting.conversions import gdp_epsilon

    calls = []

    def epsilon(sigma: float) -> float:
        calls.append(sigma)
        return gdp_epsilon(math.sqrt(100) / sigma, 1e-5) if sigma > 0 else math.inf

    sigma = find_sigma(epsilon, target, hi=hi, rel_tol=1e-2)
    exact = find_sigma(epsilon, target, hi=hi, rel_tol=1e-9)
    assert epsilon(sigma) <= target
    assert exact <= sigma <= exact * (1 + 1e-2)
    assert abs(epsilon(exact) - target) < 1e-6 * target
    assert len(calls) < 60


def test_find_sigma_rejects_unreachable_targets() -> None:
    from silodp.accounting import CalibrationError, find_sigma

    with pytest.raises(CalibrationError, match="unreachable"):
        find_sigma(lambda s: 1.0, 0.5)
    with pytest.raises(CalibrationError, match="Expected epsilon"):
        find_sigma(lambda s: 1.0 / s, 0.5, hi=1.0)


@pytest.mark.parametrize(
    ("adversary", "refused"),
    [("strongest", "server and the silos"), ("server", "server"), ("silos", "silos")],
)
def test_a_target_without_a_guarantee_is_refused_and_only_a_covered_adversary_suggested(
    adversary, refused
) -> None:
    """With clear weights ``uldp_avg_w`` protects subjects against the released model only
    (the server and the silos see data-dependent weights): a target against either is
    refused, and the message suggests the one adversary calibration can meet."""
    algo = make_algorithm("uldp_avg_w", {"weighting": "clear"})
    plan = PrivacyPlan(
        sampling_rates=(1.0,) * 3,
        rounds=2,
        silos_per_round=3,
        span=3,
        delta=1e-5,
        adversary=adversary,
    )
    with pytest.raises(CalibrationError) as err:
        calibrate(algo, plan, target_epsilon=4.0)
    message = str(err.value)
    assert f"against the {refused} to calibrate" in message
    assert message.endswith(
        "Calibrate against 'released' instead (privacy.adversary, or --adversary)."
    )
    sigma = calibrate(algo, replace(plan, adversary="released"), target_epsilon=4.0)
    assert (
        account_plan(algo.with_noise(sigma), replace(plan, adversary="released"))[-1][
            "subject"
        ].epsilon
        <= 4.0
    )


def test_a_calibrated_sigma_meets_the_target_as_a_run_composes_its_rounds() -> None:
    """A run composes its rounds one at a time, its PLD moved to coarser grids as it grows,
    and reports (and is budgeted at) a slightly larger ε than the plan's rounds composed at
    once. A target between the two at some σ, calibrated tightly, gave a σ whose plan met the
    target while the run's ε exceeded it: a calibrated run, whose budget is its target, would
    have been refused its last round."""
    plan = PrivacyPlan(sampling_rates=(0.05,) * 4, rounds=30, silos_per_round=4, span=4, delta=1e-5)
    algo = make_algorithm("local_item_dp", {"noise_multiplier": 1.2, "local_steps": 10})
    at_once = account_plan(algo, plan)[-1]["record"].epsilon
    as_run = account_plan(algo, plan, per_round=True)[-1]["record"].epsilon
    assert at_once < as_run  # the premise: the run's composition is the larger
    target = (at_once + as_run) / 2
    sigma = calibrate(algo, plan, target_epsilon=target, rel_tol=1e-6)
    calibrated = algo.with_noise(sigma)
    assert account_plan(calibrated, plan, per_round=True)[-1]["record"].epsilon <= target
    assert account_plan(calibrated, plan)[-1]["record"].epsilon <= target
    assert sigma < 1.2 * (1 + 2e-3)  # raised by the margin, not more
