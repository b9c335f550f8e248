"""Accounting a training plan before running it, and calibrating σ to a target ε.

A plan is what the accountant needs and nothing private: the sampling rate of each silo, the
number of rounds, how many silos take part per round, the span bound and δ. The ε of a plan is
computed by feeding the accountant exactly the events the algorithm's ``silo_privacy`` returns,
so a plan's numbers and a run's per-round numbers come from one code path. The plan assumes the
worst case for participation: the most privacy-losing silo takes part in every round.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_positive,
    check_probability,
)
from silodp.accounting.accountant import TARGETS, Estimate, FederatedAccountant, SiloPrivacy
from silodp.algorithms import Algorithm, make_algorithm
from silodp.algorithms.base import AlgorithmConfig

__all__ = [
    "CalibrationError",
    "PrivacyPlan",
    "account_plan",
    "account_plan_by_adversary",
    "calibrate_noise",
    "find_sigma",
]

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
      adversary: whom the plan's ε holds against: ``strongest`` (default: every adversary of
        the threat model), ``released`` (outsiders who see the model), ``server`` or ``silos``.
      releases: per-silo events of releases before round 1 (e.g. DP feature statistics),
        composed with the rounds.
    """

    sampling_rates: tuple[float, ...]
    rounds: int
    silos_per_round: int
    span: int
    delta: float
    adversary: str = "strongest"
    releases: tuple[SiloPrivacy, ...] = ()

    def __post_init__(self) -> None:
        if not self.sampling_rates:
            raise ValueError("Expected at least one silo sampling rate, got none.")
        for i, rate in enumerate(self.sampling_rates):
            check_probability(f"sampling_rates[{i}]", rate, allow_zero=True)
        check_int("rounds", self.rounds, 1)
        check_int("silos_per_round", self.silos_per_round, 1, len(self.sampling_rates))
        check_int("span", self.span, 1)
        check_in_range("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        check_choice("adversary", self.adversary, TARGETS)


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
        target=plan.adversary,
        **kwargs,
    )


def _for_plan(algorithm: Algorithm, plan: PrivacyPlan) -> Algorithm:
    """``algorithm`` with the plan's number of silos where its config leaves it unset (the
    ULDP methods need S to account a curious silo's view)."""
    if algorithm.config.num_silos is not None:
        return algorithm
    planned = copy.copy(algorithm)
    planned.config = replace(algorithm.config, num_silos=len(plan.sampling_rates))
    return planned


def _silo_events(algorithm: Algorithm, plan: PrivacyPlan) -> list:
    algorithm = _for_plan(algorithm, plan)
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
    if plan.releases:
        accountant.compose_release(plan.releases)
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


def account_plan_by_adversary(
    algorithm: Algorithm, plan: PrivacyPlan, **accountant_kwargs: Any
) -> dict[str, dict[str, Estimate]]:
    """ε per unit after the last round against each adversary (released, server, silos)."""
    accountant = _accountant(algorithm, plan, **accountant_kwargs)
    if plan.releases:
        accountant.compose_release(plan.releases)
    silos = _silo_events(algorithm, plan)
    if silos:
        accountant.compose_round(silos, count=plan.rounds, participants=plan.silos_per_round)
    return accountant.estimates_by_adversary()


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
    try:
        hi = find_sigma(lambda s: epsilon(s, fast, CALIBRATION_DISCRETIZATION), target_epsilon)
    except CalibrationError:
        raise CalibrationError(
            f"Target epsilon={target_epsilon} at unit {unit!r} is unreachable for "
            f"{algorithm_name!r} with this plan (needs noise_multiplier > "
            f"{MAX_NOISE_MULTIPLIER:g}); raise epsilon or delta, or use fewer rounds/steps."
        ) from None
    # The tighter routes can only lower ε, so the answer lies at or below ``hi``.
    return find_sigma(lambda s: epsilon(s, full, CALIBRATION_DISCRETIZATION), target_epsilon, hi=hi)


def find_sigma(
    epsilon_at: Callable[[float], float],
    target: float,
    *,
    hi: float | None = None,
    rel_tol: float = 1e-2,
) -> float:
    """Smallest σ, within ``rel_tol``, with ``epsilon_at(σ) <= target`` (ε decreasing in σ).

    Without ``hi``, σ = 1 is doubled until the target is met. The bracket ``[lo, hi]`` with
    ``ε(hi) <= target < ε(lo)`` is then narrowed by secant steps on ``log ε`` against
    ``log σ`` (nearly linear for Gaussian mechanisms), each followed by a probe a hair on the
    other side of the estimate so the bracket usually closes in a few evaluations; bisection
    (in log σ) where the secant has no finite end points. The returned σ always met the
    target.
    """
    values: dict[float, float] = {}

    def at(sigma: float) -> float:
        if sigma not in values:
            value = epsilon_at(sigma)
            values[sigma] = value if math.isfinite(value) else math.inf
        return values[sigma]

    if hi is None:
        # ε falls roughly like 1/σ: jump by (ε/target)·1.5 (at least 2x, at most 64x)
        lo, hi = 0.0, 1.0
        while at(hi) > target:
            lo = hi
            ratio = at(hi) / target if at(hi) < math.inf else 64.0
            hi *= min(64.0, max(2.0, 1.5 * ratio))
            if hi > MAX_NOISE_MULTIPLIER:
                if at(MAX_NOISE_MULTIPLIER) > target:
                    raise CalibrationError(
                        f"Target epsilon={target} is unreachable with noise_multiplier <= "
                        f"{MAX_NOISE_MULTIPLIER:g}."
                    )
                hi = MAX_NOISE_MULTIPLIER
        if lo == 0.0:
            # below σ = 1, probe where ε ∝ 1/σ would meet the target
            probe = max(at(hi) / target, 1e-3) / 1.5
            if at(probe) > target:
                lo = probe
            else:
                hi = probe
    else:
        lo = 0.0
        if at(hi) > target:
            raise CalibrationError(f"Expected epsilon({hi:g}) <= {target}, got {at(hi):g}.")
        probe = hi / 4.0  # a cheap lower end: most tighter routes save well under 4x
        if at(probe) > target:
            lo = probe
        else:
            hi = probe
    weight = {"lo": 1.0, "hi": 1.0}  # Illinois: damp an end point the secant keeps
    last = ""
    while hi - lo > rel_tol * hi:
        if lo > 0.0 and at(lo) < math.inf and at(hi) > 0.0:
            f_lo = weight["lo"] * math.log(at(lo) / target)
            f_hi = weight["hi"] * math.log(at(hi) / target)
            frac = f_lo / (f_lo - f_hi)
            guess = math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo)))
            step = 0.5 * rel_tol * hi
            sigma = min(max(guess + 0.5 * step, lo + 0.5 * step), hi - 0.5 * step)
        elif lo > 0.0:
            sigma = math.sqrt(lo * hi)  # bisection in log σ while ε(lo) is infinite
        else:
            sigma = 0.5 * (lo + hi)
        side = "hi" if at(sigma) <= target else "lo"
        if side == "hi":
            hi = sigma
        else:
            lo = sigma
        kept = "lo" if side == "hi" else "hi"
        weight[side] = 1.0
        weight[kept] = weight[kept] * 0.5 if last == side else 1.0
        last = side
        if hi - lo < 8 * rel_tol * hi:
            # close to the root: probe a hair on the other side of the new end
            other = hi - 0.99 * rel_tol * hi if side == "hi" else lo + 0.99 * rel_tol * hi
            if lo < other < hi and hi - lo > rel_tol * hi:
                if at(other) <= target:
                    hi = other
                else:
                    lo = other
    return hi
