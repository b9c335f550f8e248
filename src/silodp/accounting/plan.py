"""Accounting a training plan before running it, and calibrating σ to a target ε.

A plan is what the accountant needs and nothing private: the sampling rate of each silo, the
number of rounds, how many silos take part per round, the span bound and δ. The ε of a plan is
computed by feeding the accountant exactly the events the algorithm's ``silo_privacy`` returns,
so a plan's numbers and a run's per-round numbers come from one code path. The plan assumes the
worst case for participation: the most privacy-losing silo takes part in every round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from silodp._validation import check_in_range, check_int, check_positive, check_probability
from silodp.accounting.accountant import Estimate, FederatedAccountant
from silodp.algorithms import Algorithm, make_algorithm
from silodp.algorithms.base import AlgorithmConfig

__all__ = ["CalibrationError", "PrivacyPlan", "account_plan", "calibrate_noise"]

CALIBRATION_DISCRETIZATION = 5e-3
MAX_NOISE_MULTIPLIER = 1e4


class CalibrationError(ValueError):
    """The target ε cannot be met by any noise multiplier silodp will consider."""


@dataclass(frozen=True, kw_only=True)
class PrivacyPlan:
    """The public facts of a training run that its privacy depends on.

    Attributes:
      sampling_rates: the batch sampling rate of each silo (as the algorithm defines it).
      rounds: R.
      silos_per_round: silos taking part in each round.
      span: bound on the silos one subject's records occupy.
      delta: δ at which ε is reported.
    """

    sampling_rates: tuple[float, ...]
    rounds: int
    silos_per_round: int
    span: int
    delta: float

    def __post_init__(self) -> None:
        if not self.sampling_rates:
            raise ValueError("Expected at least one silo sampling rate, got none.")
        for i, rate in enumerate(self.sampling_rates):
            check_probability(f"sampling_rates[{i}]", rate, allow_zero=True)
        check_int("rounds", self.rounds, 1)
        check_int("silos_per_round", self.silos_per_round, 1, len(self.sampling_rates))
        check_int("span", self.span, 1)
        check_in_range("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)


def _accountant(
    algorithm: Algorithm,
    plan: PrivacyPlan,
    units: Sequence[str] | None = None,
    **kwargs: Any,
) -> FederatedAccountant:
    return FederatedAccountant(
        units=units or algorithm.units,
        span=plan.span,
        delta=plan.delta,
        **kwargs,
    )


def _silo_events(algorithm: Algorithm, plan: PrivacyPlan) -> list:
    events = [algorithm.silo_privacy(sampling_rate=rate) for rate in plan.sampling_rates]
    return [e for e in events if e is not None]


def account_plan(
    algorithm: Algorithm,
    plan: PrivacyPlan,
    *,
    per_round: bool = False,
    accountant_factory: Callable[..., FederatedAccountant] | None = None,
    **accountant_kwargs: Any,
) -> list[dict[str, Estimate]]:
    """ε per unit after each round (``per_round``) or only after the last one."""
    factory = accountant_factory or _accountant
    accountant = factory(algorithm, plan, **accountant_kwargs)
    silos = _silo_events(algorithm, plan)
    if not silos:
        return [{}] * (plan.rounds if per_round else 1)
    if not per_round:
        accountant.compose_round(silos, count=plan.rounds, participants=plan.silos_per_round)
        return [accountant.estimates()]
    out = []
    for _ in range(plan.rounds):
        accountant.compose_round(silos, participants=plan.silos_per_round)
        out.append(accountant.estimates())
    return out


def calibrate_noise(
    algorithm_name: str,
    config: AlgorithmConfig,
    plan: PrivacyPlan,
    *,
    target_epsilon: float,
    unit: str | None = None,
    rel_tol: float = 1e-2,
) -> float:
    """Smallest σ (within ``rel_tol``) whose ε at ``unit`` is at most ``target_epsilon``.

    Bisection first on the fast RDP routes (a valid but looser bound, giving an upper end σ),
    then on every route at a coarse PLD discretisation (still an upper bound). Raises
    :class:`CalibrationError` when the target is unreachable.
    """
    check_positive("target_epsilon", target_epsilon)
    probe = make_algorithm(algorithm_name, config)
    unit = unit or probe.calibration_unit
    if unit is None:
        raise CalibrationError(
            f"Algorithm {algorithm_name!r} is not private; nothing to calibrate."
        )
    if unit not in probe.units:
        raise CalibrationError(
            f"Expected unit={unit!r} to be one of the units {algorithm_name!r} protects: "
            f"{', '.join(probe.units)}."
        )

    def epsilon(sigma: float, routes: Sequence[str], discretization: float) -> float:
        algorithm = make_algorithm(algorithm_name, replace(config, noise_multiplier=sigma))
        result = account_plan(
            algorithm, plan, units=(unit,), routes=routes, discretization=discretization
        )
        return result[-1][unit].epsilon

    fast = ("rdp", "rdp-group")
    full = ("pld", "rdp", "rdp-group", "dp-group")
    hi = 1.0
    while epsilon(hi, fast, CALIBRATION_DISCRETIZATION) > target_epsilon:
        hi *= 2.0
        if hi > MAX_NOISE_MULTIPLIER:
            raise CalibrationError(
                f"Target epsilon={target_epsilon} at unit {unit!r} is unreachable for "
                f"{algorithm_name!r} with this plan (needs noise_multiplier > "
                f"{MAX_NOISE_MULTIPLIER:g}); raise epsilon or delta, or use fewer rounds/steps."
            )
    lo = hi / 2.0 if hi > 1.0 else 0.0
    hi = _bisect(
        lambda s: epsilon(s, fast, CALIBRATION_DISCRETIZATION), lo, hi, target_epsilon, rel_tol
    )
    # The tighter routes can only lower ε, so the answer lies at or below ``hi``.
    if epsilon(hi / 4.0, full, CALIBRATION_DISCRETIZATION) <= target_epsilon:
        lo = 0.0
    else:
        lo = hi / 4.0
    return _bisect(
        lambda s: epsilon(s, full, CALIBRATION_DISCRETIZATION), lo, hi, target_epsilon, rel_tol
    )


def _bisect(
    epsilon_at: Callable[[float], float], lo: float, hi: float, target: float, rel_tol: float
) -> float:
    """Shrinks ``[lo, hi]`` keeping ``epsilon_at(hi) <= target``; returns ``hi``."""
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        value = epsilon_at(mid)
        if math.isfinite(value) and value <= target:
            hi = mid
        else:
            lo = mid
    return hi
