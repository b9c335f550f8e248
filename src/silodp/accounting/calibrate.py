"""Calibration: the smallest noise multiplier σ whose ε meets a target, for any mechanism.

As in dp-accounting's ``calibrate_dp_mechanism``, calibration knows two functions only: one that
builds the DP events of a plan's round for a given σ, and one that makes a fresh accountant.
:func:`calibrate_noise` composes the plan's rounds of those events and searches σ with
:func:`find_sigma`, the one root finder every path uses (algorithms, the DP feature
statistics, PriFedSync's f-DP accounting); every failure is a :class:`CalibrationError`.

The accountant factory is called with a *stage*: ``fast`` (a valid but looser bound, e.g. RDP
only, used to bracket σ), ``calibrate`` (every route on a coarse grid: still an upper bound)
and ``report`` (what a run reports). The σ returned is checked at the ``report`` stage and
raised until the reported ε meets the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from silodp._validation import check_positive
from silodp.accounting.accountant import SiloPrivacy
from silodp.accounting.interface import AccountantFactory
from silodp.accounting.plan import PrivacyPlan, account_events
from silodp.errors import CalibrationError

__all__ = [
    "CalibrationError",
    "calibrate_noise",
    "find_sigma",
]

MAX_NOISE_MULTIPLIER = 1e4


def calibrate_noise(
    events_at: Callable[[float], Sequence[SiloPrivacy]],
    accountant_for: AccountantFactory,
    plan: PrivacyPlan,
    *,
    target_epsilon: float,
    unit: str,
    rel_tol: float = 1e-2,
    what: str = "this mechanism",
) -> float:
    """Smallest σ (within ``rel_tol``) whose ε at ``unit`` after ``plan`` is at most
    ``target_epsilon``, with ``events_at(σ)`` the per-silo events of one round.

    Raises:
      CalibrationError: the target is not positive, or is unreachable with σ at most
        ``MAX_NOISE_MULTIPLIER`` (the message names the target, the unit and ``what``).
    """
    try:
        target = check_positive("target_epsilon", target_epsilon)
    except ValueError as err:
        raise CalibrationError(str(err)) from None

    def epsilon(sigma: float, stage: str) -> float:
        return account_events(accountant_for(stage, (unit,)), events_at(sigma), plan)[-1][
            unit
        ].epsilon

    try:
        hi = find_sigma(lambda s: epsilon(s, "fast"), target, rel_tol=rel_tol)
    except CalibrationError:
        raise CalibrationError(
            f"Expected target_epsilon={target_epsilon!r} at unit {unit!r} to be reachable; "
            f"it is unreachable for {what} with this plan (needs noise_multiplier > "
            f"{MAX_NOISE_MULTIPLIER:g}); raise epsilon or delta, or use fewer rounds/steps."
        ) from None
    # the tighter routes can only lower ε, so the answer lies at or below ``hi``
    sigma = find_sigma(lambda s: epsilon(s, "calibrate"), target, hi=hi, rel_tol=rel_tol)
    for _ in range(100):  # what a run reports must meet the target too
        if epsilon(sigma, "report") <= target:
            return sigma
        sigma *= 1.0 + rel_tol / 10.0
    raise CalibrationError(
        f"Expected target epsilon={target_epsilon} at unit {unit!r} to be met by {what} "
        f"near noise_multiplier={sigma:.6g}; the reporting accountant does not confirm it."
    )


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
