"""What every accountant answers, so that calibration, planning and engines need no other.

:class:`~silodp.accounting.FederatedAccountant` (PLD/RDP, per unit and adversary) and
:class:`~silodp.accounting.fdp.FdpAccountant` (PriFedSync's f-DP) both implement
:class:`Accountant`; an algorithm says which one accounts it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from silodp.accounting.accountant import Estimate, SiloPrivacy
from silodp.errors import InvalidValueError

__all__ = ["STAGES", "Accountant", "AccountantFactory", "accountant_from_spec"]

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
