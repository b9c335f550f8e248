"""Calibration: the smallest noise multiplier σ whose ε meets a target, for any mechanism.

As in dp-accounting's ``calibrate_dp_mechanism``, calibration knows two functions only: one that
builds the DP events of a plan's round for a given σ, and one that makes a fresh accountant.
:func:`calibrate_noise` composes the plan's rounds of those events and searches σ with
:func:`find_sigma`, the one root finder every path uses (algorithms, the DP feature
statistics, PriFedSync's f-DP accounting); every failure is a :class:`CalibrationError`.

The accountant factory is called with a *stage*: ``fast`` (a valid but looser bound, e.g. RDP
only, used to bracket σ), ``calibrate`` (every route on a coarse grid: still an upper bound)
and ``report`` (what a run reports). The σ returned is checked at the ``report`` stage and
raised until the reported ε meets the target; where the reported ε is well below the target
(the coarse grid's error multiplied by a group conversion), a last search at the ``report``
stage lowers σ to the smallest that still meets it. A run composes its rounds one at a time
and its ε can lie slightly above the plan's (about 1.5e-4 relative after 1,000 rounds); where
the plan's ε is within ``RUN_MARGIN`` (per 1,000 rounds) of the target, σ is confirmed on that
composition too (``_as_run``).

Every search is bounded: a target above ``MAX_TARGET_EPSILON`` is refused before any
accounting, σ is searched in ``[MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]`` (tiny σ make the
PLD routes slow and mean no privacy anyway), and one :func:`find_sigma` evaluates ε at most
``MAX_EVALUATIONS`` times, so :func:`calibrate_noise` builds at most
``4·MAX_EVALUATIONS + 2·REPORT_CHECKS + 1`` accountants (a fast bracket, a calibrating one
where that fails, the search, the last search at the ``report`` stage, the run's composition).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from functools import partial

from silodp import display
from silodp._validation import check_in_range
from silodp.accounting.accountant import SiloPrivacy
from silodp.accounting.interface import AccountantFactory
from silodp.accounting.plan import PrivacyPlan, account_events
from silodp.errors import CalibrationError

__all__ = [
    "MAX_EVALUATIONS",
    "MAX_NOISE_MULTIPLIER",
    "MAX_TARGET_EPSILON",
    "MIN_NOISE_MULTIPLIER",
    "REPORT_CHECKS",
    "RUN_MARGIN",
    "CalibrationError",
    "calibrate_noise",
    "check_target_epsilon",
    "find_sigma",
]

MAX_NOISE_MULTIPLIER = 1e4
#: the smallest σ calibration considers: far below any σ a target ε <= MAX_TARGET_EPSILON needs
MIN_NOISE_MULTIPLIER = 1e-2
#: the largest target ε calibration accepts: e^100 > 10^43 bounds no attacker's odds
MAX_TARGET_EPSILON = 100.0
#: ε evaluations one :func:`find_sigma` may make (it needs about 10-25)
MAX_EVALUATIONS = 60
#: ε evaluations at the ``report`` stage that confirm a calibrated σ
REPORT_CHECKS = 8
#: how far below its target (relative) a calibrated σ's ε must lie for the run's own
#: composition, round by round, not to be checked, per 1,000 rounds (at least 1e-3): seven
#: times the most seen between the two after 1,000 rounds, 1.4e-4 (``_as_run``)
RUN_MARGIN = 1e-3
#: relative precision of σ on the ``fast`` stage, which only brackets the search on the
#: tighter routes (that search then narrows σ to the caller's tolerance)
FAST_REL_TOL = 0.2


def check_target_epsilon(target_epsilon: float, what: str = "target_epsilon") -> float:
    """``target_epsilon`` if it is a number in ``(0, MAX_TARGET_EPSILON]``.

    Raises:
      CalibrationError: otherwise (the message names the value and the range).
    """
    value = float(target_epsilon)
    if not 0.0 < value <= MAX_TARGET_EPSILON:  # also refuses NaN
        why = (
            f": an ε above {MAX_TARGET_EPSILON:g} lets an attacker's odds grow by a factor "
            f"above e^{MAX_TARGET_EPSILON:g} > 10^43 (no meaningful privacy) and needs a σ "
            "too small to account; to see the ε of a given σ, give the noise multiplier instead"
            if value > MAX_TARGET_EPSILON
            else ""
        )
        raise CalibrationError(
            f"Expected {what}={target_epsilon!r} to be in (0, {MAX_TARGET_EPSILON:g}]{why}."
        )
    return value


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
      CalibrationError: the target is not in ``(0, MAX_TARGET_EPSILON]``, or is unreachable
        with σ at most ``MAX_NOISE_MULTIPLIER`` (the message names the target, the unit and
        ``what``).
    """
    target = check_target_epsilon(target_epsilon)

    def epsilon(sigma: float, stage: str, as_run: bool = False) -> float:
        accountant = accountant_for(stage, (unit,))
        return account_events(accountant, events_at(sigma), plan, as_run=as_run)[-1][unit].epsilon

    try:
        # the fast bound only brackets σ for the search below: to FAST_REL_TOL
        hi = find_sigma(lambda s: epsilon(s, "fast"), target, rel_tol=max(rel_tol, FAST_REL_TOL))
    except _UnreachableError:
        hi = None
    if hi is None:
        # the fast routes may not cover the events (e.g. a mixture in a record-level event):
        # then the calibrating accountant brackets σ itself
        try:
            hi = find_sigma(
                lambda s: epsilon(s, "calibrate"), target, rel_tol=max(rel_tol, FAST_REL_TOL)
            )
        except _UnreachableError:
            hi = None
    if hi is None:
        raise CalibrationError(
            f"Expected target_epsilon={target_epsilon!r} at unit {unit!r} to be reachable; "
            f"it is unreachable for {what} with this plan (needs noise_multiplier > "
            f"{MAX_NOISE_MULTIPLIER:g}, the largest calibration searches; a larger σ given as "
            "the noise multiplier is accounted); raise epsilon or delta, or use fewer "
            "rounds/steps."
        )
    # the tighter routes can only lower ε, so the answer lies at or below ``hi``
    sigma = find_sigma(lambda s: epsilon(s, "calibrate"), target, hi=hi, rel_tol=rel_tol)
    step = rel_tol / 10.0
    for _ in range(REPORT_CHECKS):  # what a run reports must meet the target too
        reported = epsilon(sigma, "report")
        if reported <= target:
            if reported < target * (1.0 - 2.0 * rel_tol):
                # the calibrating grid was coarse where an ε is multiplied (a group conversion
                # scales its error by m·k: 3x the needed σ was seen): the reporting accountant
                # finds the smallest σ at or below this one (where that search fails, the σ
                # in hand still meets the target)
                with contextlib.suppress(CalibrationError):
                    sigma = find_sigma(
                        lambda s: epsilon(s, "report"), target, hi=sigma, rel_tol=rel_tol
                    )
                    reported = epsilon(sigma, "report")
            margin = RUN_MARGIN * max(1.0, plan.rounds / 1000)
            as_run = partial(epsilon, stage="report", as_run=True)
            return _as_run(sigma, reported, as_run, target, margin)
        sigma *= 1.0 + step
        step *= 2.0
    raise CalibrationError(
        f"Expected target epsilon={target_epsilon} at unit {unit!r} to be met by {what} "
        f"near noise_multiplier={sigma:.6g}; the reporting accountant does not confirm it."
    )


def _as_run(
    sigma: float,
    reported: float,
    as_run: Callable[[float], float],
    target: float,
    margin: float,
) -> float:
    """``sigma``, raised where needed so that the ε a run reports, composing its rounds one at
    a time, meets ``target`` too, not only the plan's ``reported`` ε (all rounds at once): a
    calibrated run's budget is its target, and an ε above it stops the run a round short.
    The two differ by ~1.5e-4 relative after 1,000 rounds
    (:func:`~silodp.accounting.plan.account_events`), so the run's composition is only
    checked within ``margin`` of the target, and σ raised by as much at a time."""
    if reported <= target * (1.0 - margin):
        return sigma
    for _ in range(REPORT_CHECKS):
        if as_run(sigma) <= target:
            return sigma
        sigma *= 1.0 + margin
    raise CalibrationError(
        f"Expected target epsilon={target} to be met by a run composing its rounds one at a "
        f"time near noise_multiplier={sigma:.6g}; its accountant does not confirm it."
    )


class _UnreachableError(CalibrationError):
    """ε stays above the target up to ``MAX_NOISE_MULTIPLIER``."""


def find_sigma(
    epsilon_at: Callable[[float], float],
    target: float,
    *,
    hi: float | None = None,
    rel_tol: float = 1e-2,
) -> float:
    """Smallest σ, within ``rel_tol``, with ``epsilon_at(σ) <= target`` (ε decreasing in σ).

    Without ``hi``, σ = 1 is moved up (or down) by the factor at which ε ∝ 1/σ would meet the
    target, overshooting by 1.5 (at least 2x up, 1.5x down, at most 64x either way) until the
    target lies between two evaluated σ. With ``hi`` (``ε(hi) <= target``, e.g. from a looser
    bound), the first probe is where ε ∝ 1/σ would meet the target, at least ``hi/4``. The
    bracket ``[lo, hi]`` with ``ε(hi) <= target < ε(lo)`` is then narrowed by secant steps on
    ``log ε`` against ``log σ`` (nearly linear for Gaussian mechanisms), each followed by a
    probe a hair on the other side of the estimate so the bracket usually closes in a few
    evaluations; bisection (in log σ) where the secant has no finite end points. The returned
    σ always met the target. σ stays in ``[MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]`` and
    ``epsilon_at`` is called at most ``MAX_EVALUATIONS`` times.

    Raises:
      CalibrationError: ``target`` is not in ``(0, MAX_TARGET_EPSILON]``; ε exceeds it even at
        ``MAX_NOISE_MULTIPLIER`` (unreachable) or already meets it at ``MIN_NOISE_MULTIPLIER``;
        ``ε(hi) > target``; or the search did not converge within ``MAX_EVALUATIONS``.
    """
    target = check_target_epsilon(target, "target epsilon")
    check_in_range("rel_tol", rel_tol, 1e-12, 0.5)  # coarser than float resolution
    values: dict[float, float] = {}

    def stuck() -> CalibrationError:
        return CalibrationError(
            f"Expected the noise multiplier for target epsilon={target} to be found within "
            f"{MAX_EVALUATIONS} evaluations of ε; the search stopped with σ in "
            f"[{lo:.6g}, {hi:.6g}] (is ε decreasing in σ?)."
        )

    def at(sigma: float) -> float:
        if sigma not in values:
            if len(values) >= MAX_EVALUATIONS:
                raise stuck()
            value = epsilon_at(sigma)
            values[sigma] = value if math.isfinite(value) else math.inf
        return values[sigma]

    def below(sigma: float) -> float:
        """The next σ down from ``sigma`` (``ε(sigma) <= target``) where ε ∝ 1/σ would exceed
        the target by 1.5x; never below ``MIN_NOISE_MULTIPLIER``.

        Raises CalibrationError when ``sigma`` already is that minimum."""
        if sigma <= MIN_NOISE_MULTIPLIER:
            raise CalibrationError(
                f"Expected target epsilon={target} to need noise_multiplier >= "
                f"{MIN_NOISE_MULTIPLIER:g}; ε({MIN_NOISE_MULTIPLIER:g}) = "
                f"{display.upper(at(MIN_NOISE_MULTIPLIER), 6)} already meets it: the target is "
                "too large to calibrate (such a σ gives no meaningful privacy)."
            )
        factor = min(64.0, max(1.5, 1.5 * target / at(sigma) if at(sigma) > 0 else 64.0))
        return max(sigma / factor, MIN_NOISE_MULTIPLIER)

    lo = 0.0
    if hi is None:
        hi = 1.0
        while at(hi) > target:
            lo = hi
            ratio = at(hi) / target if at(hi) < math.inf else 64.0
            hi *= min(64.0, max(2.0, 1.5 * ratio))
            if hi > MAX_NOISE_MULTIPLIER:
                if at(MAX_NOISE_MULTIPLIER) > target:
                    raise _UnreachableError(
                        f"Target epsilon={target} is unreachable with noise_multiplier <= "
                        f"{MAX_NOISE_MULTIPLIER:g}."
                    )
                hi = MAX_NOISE_MULTIPLIER
    elif at(hi) > target:
        raise CalibrationError(
            f"Expected epsilon({hi:g}) <= {target}, got {display.upper(at(hi), 6)}."
        )
    elif hi > MIN_NOISE_MULTIPLIER:
        # where ε ∝ 1/σ would meet the target, a hair below (tighter routes than the one that
        # gave ``hi`` are usually close to that); most of them save well under 4x
        guess = 0.99 * hi * at(hi) / target if at(hi) > 0 else 0.0
        probe = max(guess, hi / 4.0, MIN_NOISE_MULTIPLIER)
        if at(probe) > target:
            lo = probe
        else:
            hi = probe
    while lo == 0.0:  # no σ with ε above the target yet: step down
        probe = below(hi)
        if at(probe) > target:
            lo = probe
        else:
            hi = probe
    weight = {"lo": 1.0, "hi": 1.0}  # Illinois: damp an end point the secant keeps
    last = ""
    for _ in range(MAX_EVALUATIONS + 1):  # each pass evaluates ε at least once
        if hi - lo <= rel_tol * hi:
            return hi
        if at(lo) < math.inf and at(hi) > 0.0:
            f_lo = weight["lo"] * math.log(at(lo) / target)
            f_hi = weight["hi"] * math.log(at(hi) / target)
            frac = f_lo / (f_lo - f_hi)
            guess = math.exp(math.log(lo) + frac * (math.log(hi) - math.log(lo)))
            step = 0.5 * rel_tol * hi
            sigma = min(max(guess + 0.5 * step, lo + 0.5 * step), hi - 0.5 * step)
        else:
            sigma = math.sqrt(lo * hi)  # bisection in log σ while an end point is degenerate
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
    raise stuck()
