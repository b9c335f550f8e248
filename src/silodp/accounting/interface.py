"""What every accountant answers, so that calibration, planning and engines need no other.

:class:`~silodp.accounting.FederatedAccountant` (PLD/RDP, per unit and adversary) and
:class:`~silodp.accounting.fdp.FdpAccountant` (PriFedSync's f-DP) both implement
:class:`Accountant`; an algorithm says which one accounts it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from silodp.accounting.accountant import Estimate, SiloPrivacy
from silodp.errors import InvalidValueError

__all__ = ["STAGES", "Accountant", "AccountantFactory", "Spent", "accountant_from_spec", "spent"]

#: What an accountant is made precise for: ``fast`` (a valid but looser bound, to bracket σ),
#: ``calibrate`` (every route on a coarse grid: still an upper bound) or ``report`` (what a
#: run reports).
STAGES = ("fast", "calibrate", "report")


class Accountant(Protocol):
    """What every accountant answers (:class:`~silodp.accounting.FederatedAccountant`, the
    f-DP :class:`~silodp.accounting.fdp.FdpAccountant`)."""

    units: tuple[str, ...]
    rounds: int

    def compose_round(
        self, silos: Sequence[SiloPrivacy], *, count: int = 1, participants: int | None = None
    ) -> None: ...

    def compose_release(self, silos: Sequence[SiloPrivacy]) -> None: ...

    def estimates(self, adversary: str | None = None) -> dict[str, Estimate]: ...

    def estimates_by_adversary(self) -> dict[str, dict[str, Estimate]]: ...

    def mu(self, adversary: str | None = None) -> dict[str, float]: ...

    def labelled_estimates(self) -> dict[str, float]: ...

    def mu_estimates(self) -> dict[str, float]: ...

    def spec(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Spent:
    """What an accountant has composed so far, as a run reports it: ε per unit against the
    accountant's target (with its route) and against each adversary, exact μ, and the labelled
    non-rigorous ε and μ estimates (never guarantees)."""

    epsilon: dict[str, Estimate]
    by_adversary: dict[str, dict[str, Estimate]]
    mu: dict[str, float]
    estimates: dict[str, float]
    mu_estimates: dict[str, float]


def spent(accountant: Accountant) -> Spent:
    """``accountant``'s :class:`Spent`, read from one composed state."""
    return Spent(
        epsilon=accountant.estimates(),
        by_adversary=accountant.estimates_by_adversary(),
        mu=accountant.mu(),
        estimates=accountant.labelled_estimates(),
        mu_estimates=accountant.mu_estimates(),
    )


def accountant_from_spec(spec: Mapping[str, Any]) -> Accountant:
    """An empty accountant of the kind and parameters ``spec`` (an accountant's
    :meth:`~Accountant.spec`) describes.

    Raises:
      InvalidValueError: an unknown kind.
    """
    from silodp.accounting.accountant import FederatedAccountant
    from silodp.accounting.fdp import FdpAccountant

    values = dict(spec)
    kind = values.pop("kind", None)
    if kind == "federated":
        # a spec written before composed PLDs were bounded: rebuild the full-support accountant
        values.setdefault("pld_points", None)
        return FederatedAccountant(**values)
    if kind == "fdp":
        return FdpAccountant(**values)
    raise InvalidValueError(f"Expected an accountant kind 'federated' or 'fdp', got {kind!r}.")


#: ``factory(stage, units)``: a fresh accountant for ``units`` at ``stage`` (one of STAGES).
AccountantFactory = Callable[[str, Sequence[str]], Accountant]
