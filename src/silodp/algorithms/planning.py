"""An algorithm's privacy before it runs: the ε of a plan and the σ that meets a target.

This is where algorithms meet the event-only accounting: an algorithm turns a
:class:`~silodp.accounting.PrivacyPlan` into DP events (:meth:`Algorithm.plan_events`) and names
its accountant (:meth:`Algorithm.make_accountant`); :mod:`silodp.accounting` composes and
calibrates without knowing which algorithm it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from silodp.accounting import (
    Estimate,
    PrivacyPlan,
    account_events,
    account_events_by_adversary,
)
from silodp.accounting import (
    calibrate_noise as calibrate_events,
)
from silodp.accounting.calibrate import MAX_NOISE_MULTIPLIER
from silodp.accounting.interface import Accountant
from silodp.algorithms.base import Algorithm
from silodp.errors import CalibrationError

__all__ = ["account_plan", "account_plan_by_adversary", "calibrate", "plan_mu"]


def _accountant(algorithm: Algorithm, plan: PrivacyPlan, **kwargs: Any) -> Accountant:
    routes = kwargs.pop("routes", None)
    discretization = kwargs.pop("discretization", None)
    units = kwargs.pop("units", None)
    if kwargs:
        raise TypeError(f"Unexpected accountant options {sorted(kwargs)}.")
    accountant = algorithm.make_accountant(
        span=plan.span, delta=plan.delta, target=plan.adversary, units=units
    )
    if routes is not None or discretization is not None:
        from silodp.accounting import FederatedAccountant

        accountant = FederatedAccountant(
            units=units or algorithm.units,
            span=plan.span,
            delta=plan.delta,
            target=plan.adversary,
            **({"routes": routes} if routes is not None else {}),
            **({"discretization": discretization} if discretization is not None else {}),
        )
    return accountant


def account_plan(
    algorithm: Algorithm,
    plan: PrivacyPlan,
    *,
    per_round: bool = False,
    accountant_factory: Callable[..., Accountant] | None = None,
    **accountant_kwargs: Any,
) -> list[dict[str, Estimate]]:
    """ε per unit after each round (``per_round``) or only after the last one.

    ``accountant_factory(algorithm, plan, **accountant_kwargs)`` replaces the algorithm's own
    accountant (e.g. to inspect it); ``accountant_kwargs`` may also set ``routes``,
    ``discretization`` and ``units`` of the default one."""
    factory = accountant_factory or _accountant
    accountant = factory(algorithm, plan, **accountant_kwargs)
    return account_events(accountant, algorithm.plan_events(plan), plan, per_round=per_round)


def account_plan_by_adversary(
    algorithm: Algorithm, plan: PrivacyPlan, **accountant_kwargs: Any
) -> dict[str, dict[str, Estimate]]:
    """ε per unit after the last round against each adversary (released, server, silos)."""
    accountant = _accountant(algorithm, plan, **accountant_kwargs)
    return account_events_by_adversary(accountant, algorithm.plan_events(plan), plan)


def plan_mu(algorithm: Algorithm, plan: PrivacyPlan) -> dict[str, float]:
    """μ (Gaussian DP) per unit of the plan where every event has one (RDP route only)."""
    accountant = _accountant(algorithm, plan, routes=("rdp",))
    account_events(accountant, algorithm.plan_events(plan), plan)
    return accountant.mu()


def calibrate(
    algorithm: Algorithm,
    plan: PrivacyPlan,
    *,
    target_epsilon: float,
    unit: str | None = None,
    rel_tol: float = 1e-2,
) -> float:
    """Smallest σ (within ``rel_tol``) whose ε at ``unit`` (default: the algorithm's
    calibration unit) after ``plan`` is at most ``target_epsilon``.

    Raises:
      CalibrationError: the algorithm is not private, does not protect ``unit``, or the
        target is unreachable.
    """
    unit = unit or algorithm.calibration_unit
    if unit is None:
        raise CalibrationError(
            f"Algorithm {algorithm.name!r} is not private; nothing to calibrate."
        )
    if unit not in algorithm.units:
        raise CalibrationError(
            f"Expected unit={unit!r} to be one of the units {algorithm.name!r} protects: "
            f"{', '.join(algorithm.units)}."
        )

    _refuse_without_guarantee(algorithm, plan, unit)

    def accountant_for(stage: str, units: Sequence[str]) -> Accountant:
        return algorithm.make_accountant(
            span=plan.span, delta=plan.delta, target=plan.adversary, stage=stage, units=units
        )

    return calibrate_events(
        lambda sigma: algorithm.with_noise(sigma).plan_events(plan),
        accountant_for,
        plan,
        target_epsilon=target_epsilon,
        unit=unit,
        rel_tol=rel_tol,
        what=repr(algorithm.name),
    )


def _refuse_without_guarantee(algorithm: Algorithm, plan: PrivacyPlan, unit: str) -> None:
    """Refuses a target against an adversary the algorithm gives no guarantee at all (ε = ∞
    at any σ, e.g. a party that sees data-dependent weights), naming it and why.

    Raises:
      CalibrationError: the plan's adversary (or, for ``strongest``, one of them) has none.
    """
    notes = algorithm.accounting_notes()
    if not notes:
        return
    one_round = dataclasses.replace(plan, rounds=1)
    by = account_plan_by_adversary(algorithm.with_noise(MAX_NOISE_MULTIPLIER), one_round)
    infinite = [who for who, estimates in by.items() if math.isinf(estimates[unit].epsilon)]
    none = [who for who in infinite if plan.adversary in ("strongest", who)]
    if none:
        covered = [who for who in by if who not in infinite]
        raise CalibrationError(
            f"Expected a {unit}-level guarantee against the {' and the '.join(none)} to "
            f"calibrate {algorithm.name!r} against privacy.adversary={plan.adversary!r}; it "
            f"has none at any noise multiplier: {' '.join(notes)}. Calibrate against "
            f"{' or '.join(repr(w) for w in covered)} instead (privacy.adversary, or "
            "--adversary)."
        )
