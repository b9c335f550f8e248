"""One run's view of a ledger: what the engine records through, and the budget it enforces.

The engine calls :meth:`RunLedger.check_round` before a round (refusing it if the ledger's
total would exceed the budget), :meth:`RunLedger.record` for every mechanism execution before
its output is handed on, :meth:`RunLedger.round_events` for the events to compose (read back
from the ledger, so the reported ε is the ledger's), and :meth:`RunLedger.complete_round`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from silodp import display
from silodp.accounting import SiloPrivacy
from silodp.accounting.interface import Accountant, accountant_from_spec
from silodp.errors import SilodpError
from silodp.ledger.store import Ledger, LedgerError

__all__ = [
    "BudgetExceededError",
    "RunLedger",
    "accounted_units",
    "check_accounted",
    "check_budget",
    "check_one_kind",
    "held_to",
    "ledger_budget",
    "total_before",
]


class BudgetExceededError(SilodpError):
    """A round (or a plan) would take the ledger's total ε above its budget."""

    def __init__(
        self,
        unit: str,
        spent: float,
        would_be: float,
        budget: float,
        what: str = "next round",
        source: str = "",
    ) -> None:
        super().__init__(
            f"Privacy budget for unit {unit!r} would be exceeded: spent ε="
            f"{display.upper(spent, 4)}, the {what} would make it {display.upper(would_be, 4)}, "
            f"budget {budget!r}" + (f" ({source})" if source else "") + "."
        )
        self.unit, self.spent, self.would_be, self.budget = unit, spent, would_be, budget


def _epsilons(accountant: Accountant) -> dict[str, float]:
    return {unit: est.epsilon for unit, est in accountant.estimates().items()}


def total_before(ledger: Ledger, accountant: Accountant) -> tuple[Accountant, bool]:
    """(the ledger's total before a run with ``accountant``: a replay of every earlier run of
    the same accounting kind, else ``accountant`` itself; whether there was one)."""
    spec = accountant.spec()
    earlier = [r.id for r in ledger.runs() if r.accountant.get("kind") == spec["kind"]]
    if not earlier:
        return accountant, False
    return ledger.replay(earlier, accountant_from_spec(spec)), True


def held_to(
    budget: Mapping[str, float],
    declared: Mapping[str, Mapping[str, Any]],
    accountant: Accountant,
    *,
    where: str,
) -> dict[str, float]:
    """The budget a run with ``accountant`` and its own ``budget`` is held to under the
    ``declared`` budget of the ledger ``where``: per unit, the smaller ε.

    Raises:
      LedgerError: a declared unit the run does not account (its spending there would go
        unchecked), another δ (a total is checked at one δ), or another adversary than the
        declared one or ``strongest`` (a total against a weaker one reads smaller).
    """
    spec = accountant.spec()
    delta, adversary = spec.get("delta"), spec.get("target", "strongest")
    merged = dict(budget)
    for unit, limit in declared.items():
        if unit not in accountant.units:
            raise LedgerError(
                f"Expected this run to account unit {unit!r}: {where} has a budget on it "
                f"(ε={limit['epsilon']!r}) that binds every run there, and this run accounts "
                f"{list(accountant.units)} only, so what it spends at {unit!r} would go "
                "unchecked. Use another ledger."
            )
        if limit["delta"] != delta:
            raise LedgerError(
                f"Expected δ={limit['delta']!r}: the budget of {where} for unit {unit!r} is "
                f"ε={limit['epsilon']!r} at that δ, and a run on it is checked at the same δ; "
                f"this run's δ is {delta!r}."
            )
        against = limit.get("adversary", "strongest")
        if adversary not in (against, "strongest"):
            raise LedgerError(
                f"Expected privacy.adversary={against!r}"
                + ("" if against == "strongest" else " (or 'strongest')")
                + ": the budget of "
                f"{where} for unit {unit!r} holds against that adversary, and a total against "
                f"{adversary!r} could read smaller."
            )
        merged[unit] = min(merged.get(unit, math.inf), float(limit["epsilon"]))
    return merged


def check_declarable(budget: Mapping[str, float], accountant: Accountant, *, where: str) -> None:
    """Raises:
    LedgerError: a unit of the ``budget`` a run declares on the ledger ``where`` is one it
      does not account: its spending there would count as nothing toward the total that
      budget holds every run to."""
    missing = [unit for unit in budget if unit not in accountant.units]
    if missing:
        raise LedgerError(
            f"Expected this run to account every unit of the privacy.budget it declares on "
            f"{where}; it accounts {list(accountant.units)} only, not {missing}, so its "
            "spending there would count as nothing in the total. Leave those units out of "
            "privacy.budget, or give this run another ledger."
        )


def check_accounted(
    budget: Mapping[str, float],
    accounted: Mapping[str, Sequence[str] | None],
    *,
    where: str,
) -> None:
    """``accounted``: the units each run on the ledger ``where`` accounts, by name (``None``:
    an accountant that reports the same units for every run).

    Raises:
      LedgerError: a unit of ``budget`` that one of those runs does not account: it spent
        something there that adds nothing to the total, so no total at that unit is a bound.
    """
    for unit, limit in budget.items():
        lacking = [
            name for name, units in accounted.items() if units is not None and unit not in units
        ]
        if lacking:
            raise LedgerError(
                f"Expected every run on {where} to account unit {unit!r} while a budget of "
                f"ε={limit!r} applies to it; {', '.join(lacking)} do(es) not, so what they "
                f"spent at {unit!r} has no bound and the total there cannot be held to the "
                "budget. Use another ledger."
            )


def accounted_units(ledger: Ledger) -> dict[str, Sequence[str] | None]:
    """The units each run that spent something on ``ledger`` accounts (for
    :func:`check_accounted`)."""
    return {
        f"run {r.id} ({r.name})": r.accountant.get("units")
        for r in ledger.runs()
        if ledger.rounds(r.id) or ledger.count_events(r.id)
    }


def ledger_budget(
    ledger: Ledger, budget: Mapping[str, float], accountant: Accountant
) -> dict[str, float]:
    """The budget a run with ``accountant`` and its own ``budget`` is held to on ``ledger``
    (:func:`held_to` its declared budget, :meth:`Ledger.budget`).

    Raises:
      LedgerError: as :func:`held_to`, or the ledger holds runs of another accounting kind,
        whose spending cannot be composed with this run's, while a budget applies.
    """
    where = repr(str(ledger.path))
    merged = held_to(budget, ledger.budget(), accountant, where=where)
    kinds = {r.accountant.get("kind", "?") for r in ledger.runs()}
    check_one_kind(kinds, accountant.spec().get("kind"), merged, where=where)
    check_accounted(merged, accounted_units(ledger), where=where)
    return merged


def check_one_kind(
    kinds: Iterable[str], kind: str | None, budget: Mapping[str, float], *, where: str
) -> None:
    """Raises:
    LedgerError: ``budget`` applies and the ledger ``where`` holds (or will hold) runs of
      accounting ``kinds`` other than this run's ``kind``: their spending cannot be composed
      into one total."""
    others = sorted(set(kinds) - {kind})
    if budget and others:
        raise LedgerError(
            f"Expected the runs on {where} to share one accounting kind while a budget applies; "
            f"it holds runs accounted as {others}, this run as {kind!r}, and their spending "
            "cannot be composed into one total. Use another ledger."
        )


def check_budget(
    budget: Mapping[str, float],
    spent: Mapping[str, float],
    would_be: Mapping[str, float],
    what: str = "next round",
    sources: Mapping[str, str] | None = None,
) -> None:
    """``sources``: where each unit's budget comes from, for the message.

    Raises:
      BudgetExceededError: a unit's ``would_be`` ε exceeds its ``budget`` (float slack only).
    """
    for unit, limit in budget.items():
        value = would_be.get(unit, 0.0)
        if not value <= limit * (1 + 1e-9):
            source = (sources or {}).get(unit, "")
            raise BudgetExceededError(unit, spent.get(unit, 0.0), value, limit, what, source)


class RunLedger:
    """Records one run in ``ledger`` and enforces ``budget`` (ε per unit at the run's δ) on
    the ledger's total: every earlier run in it of the same accounting kind, plus this one.

    Args:
      ledger: the open ledger.
      name, algorithm: what the run is.
      accountant: the run's accountant, before anything is composed (its spec is stored).
        When the ledger holds no earlier run of its kind it is also the ledger's total (the
        engine composes it); otherwise the total is a replay of the earlier runs that this
        run's rounds are composed onto.
      noise: where the coins came from (mode and an id of the seed material; never a secret).
      budget: ``{unit: ε}`` the total may not exceed (empty: no budget); the ledger's own
        declared budget applies too (:func:`ledger_budget`).
      declared: the config's ``privacy.budget``, declared on the ledger (at the run's δ and
        adversary) so that it binds every later run there.
      config_hash: an id of the run's resolved config.
      plan_check: ``plan_check(total)`` is the ε per unit the ledger's total would reach with
        the run's whole plan composed on; checked against the budget before the run is
        registered.

    Raises:
      BudgetExceededError: the plan does not fit the budget.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        name: str,
        algorithm: str,
        accountant: Accountant,
        noise: Mapping[str, Any],
        budget: Mapping[str, float] | None = None,
        declared: Mapping[str, float] | None = None,
        config_hash: str = "",
        plan_check: Callable[[Accountant], Mapping[str, float]] | None = None,
    ) -> None:
        self.ledger = ledger
        spec = accountant.spec()
        self.budget = ledger_budget(ledger, budget or {}, accountant)
        #: the ledger's total so far (earlier runs), composed with this run's rounds as they end
        self.total, self.shared = total_before(ledger, accountant)
        if plan_check is not None and self.budget:  # the whole plan, before anything runs
            self.check(plan_check(self.total), "run's whole plan")
        if declared:  # the config's own budget binds every later run on this ledger too
            ledger.declare_budget(
                declared, float(spec["delta"]), str(spec.get("target", "strongest"))
            )
        self.run_id = ledger.open_run(
            name=name, algorithm=algorithm, accountant=spec, noise=noise, config_hash=config_hash
        )
        #: the attempt number every round of this process records under (above 0 after a
        #: resume, so that a round cut short and run again counts twice)
        self.attempt = 0

    @classmethod
    def resume(
        cls,
        ledger: Ledger,
        *,
        name: str,
        config_hash: str,
        accountant: Accountant,
        budget: Mapping[str, float] | None = None,
        completed: int = 0,
        run_id: int | None = None,
    ) -> RunLedger | None:
        """The run ``name`` of this config in ``ledger`` left unfinished, reopened:
        ``accountant`` composes everything it recorded (rounds cut short included, in full)
        and its next rounds record under a new attempt. A run the ledger marks complete is
        reopened when its checkpoint holds all its rounds (it was stopped while writing its
        outputs). ``completed``: the rounds the run's checkpoint holds, which the ledger must
        hold complete too. ``None``: the ledger holds no such run and the checkpoint no round
        (the run never registered, e.g. it was stopped while calibrating). ``run_id``: the
        id the run registered under, where it is known (a shared ledger may hold the same
        config run elsewhere): only that run is reopened.

        Raises:
          LedgerError: the checkpoint holds rounds the ledger has no complete record of (a
            ledger lost, replaced or edited: resuming would count less than was spent).
        """

        def done(registered: int) -> set[int]:
            """The rounds of run ``registered`` that completed."""
            rows = ledger.rounds(registered)
            return {r["round"] for r in rows if r["status"] == "complete"}

        found = [
            r
            for r in ledger.runs()
            if r.name == name
            and r.config_hash == config_hash
            and (run_id is None or r.id == run_id)
            and (
                r.status != "complete"
                or (completed > 0 and max(done(r.id), default=0) == completed)
            )
        ]
        if not found:
            same = [
                r
                for r in ledger.runs()
                if r.id == run_id and r.name == name and r.config_hash == config_hash
            ]
            if run_id is not None and not same:
                raise LedgerError(
                    f"Expected {str(ledger.path)!r} to record run {run_id} ({name!r}), under "
                    "which the run registered; it has none of that name and config under that "
                    "id (another run, or none), so what the run spent would go uncounted. "
                    "Restore the ledger the run wrote (with its -wal file), or start the run "
                    "afresh (--overwrite)."
                )
            if completed:
                raise LedgerError(
                    f"Expected {str(ledger.path)!r} to record run {name!r}, whose checkpoint "
                    f"holds {completed} round(s); it has no record of it, so what those rounds "
                    "spent would go uncounted. Restore the ledger the run wrote (with its "
                    "-wal file), or start the run afresh (--overwrite)."
                )
            return None
        record = found[-1]
        closed = done(record.id)
        if completed == 0 and len(closed) > 1:
            # only the first round can be closed in the ledger before any checkpoint is written
            raise LedgerError(
                f"Expected a checkpoint of run {name!r}: {str(ledger.path)!r} holds "
                f"{len(closed)} of its rounds complete (up to round {max(closed)}) and the run "
                "has none, so resuming would train those rounds again and spend on them twice. "
                "Restore the run's checkpoint (silo_private/checkpoint.pt), or start the run "
                "afresh (--overwrite; that spends again too)."
            )
        missing = sorted(set(range(1, completed + 1)) - closed)
        if missing:
            raise LedgerError(
                f"Expected {str(ledger.path)!r} to hold rounds 1-{completed} of run {name!r} "
                f"complete, as its checkpoint does; round(s) {missing[:10]} are not, so "
                "resuming would count less than was spent. Restore the ledger the run wrote, "
                "or start the run afresh (--overwrite)."
            )
        self = cls.__new__(cls)
        self.ledger = ledger
        self.budget = ledger_budget(ledger, budget or {}, accountant)
        self.run_id = record.id
        earlier = [
            r.id
            for r in ledger.runs()
            if r.id != record.id and r.accountant.get("kind") == record.accountant.get("kind")
        ]
        ledger.replay([record.id], accountant)
        self.total = accountant
        self.shared = bool(earlier)
        if self.shared:
            self.total = ledger.replay(
                [*earlier, record.id], accountant_from_spec(record.accountant)
            )
        self.attempt = ledger.next_attempt(record.id)
        self._has_release = any(kind == "release" for _, _, _, kind, _ in ledger.events(record.id))
        ledger.finish_run(record.id, "running")
        return self

    def spent(self) -> dict[str, float]:
        """The ledger's total ε per unit (earlier runs and this one's completed rounds)."""
        return _epsilons(self.total) if self.total.rounds or self._has_release else {}

    _has_release = False

    @property
    def has_release(self) -> bool:
        """Whether this run recorded a release (before training) on the ledger."""
        return self._has_release

    def check(self, would_be: Mapping[str, float], what: str = "next round") -> None:
        """Raises:
        BudgetExceededError: a unit's ``would_be`` ε exceeds its budget."""
        check_budget(self.budget, self.spent(), would_be, what)

    def check_round(self, planned: Sequence[SiloPrivacy], participants: int | None = None) -> None:
        """Refuses the next round if, with every silo that may take part running ``planned``,
        the ledger's total would exceed the budget."""
        if not self.budget or not planned:
            return
        trial = copy.deepcopy(self.total)
        trial.compose_round(planned, participants=participants)
        self.check(_epsilons(trial))

    def record_release(self, releases: Sequence[SiloPrivacy]) -> None:
        """Records releases before training (one event per silo) and composes them."""
        for silo, privacy in enumerate(releases):
            self.ledger.record(self.run_id, 0, f"silo:{silo}", privacy, kind="release")
        if self.shared:
            self.total.compose_release(list(releases))
        self._has_release = True

    def record(self, round_index: int, party: str, privacy: SiloPrivacy) -> None:
        """Records one mechanism execution; durable when this returns."""
        self.ledger.record(self.run_id, round_index, party, privacy, attempt=self.attempt)

    def record_planned(self, round_index: int, planned: Sequence[SiloPrivacy]) -> None:
        """Records the events of every silo of a round accounted from its plan (whoever takes
        part), together: a round is never recorded with part of its plan."""
        executions = [(f"silo:{silo}", privacy) for silo, privacy in enumerate(planned)]
        self.ledger.record_many(self.run_id, round_index, executions, attempt=self.attempt)

    def repeated_attempts(self) -> int:
        """Round attempts this run recorded beyond one per round (a round cut short and run
        again): each composes in full, so the run's ε exceeds its plan's by them. Still
        answered once the ledger is closed (as it was then)."""
        closed = getattr(self, "_repeated_at_close", None)
        if closed is not None:
            return int(closed)
        groups = self.ledger.round_groups(self.run_id)
        rounds = {row["round"] for row, _, _ in groups if row is not None}
        return sum(1 for row, _, _ in groups if row is not None) - len(rounds)

    def recorded_rounds(self) -> set[int]:
        """The rounds of this run with events in the ledger (in any attempt, complete or
        cut short: a resumed run's accountant holds every one of them, in full); answered
        once the ledger is closed (as it was then)."""
        closed = getattr(self, "_recorded_at_close", None)
        if closed is not None:
            return set(closed)
        return {r for r, _, _, kind, _ in self.ledger.events(self.run_id) if kind == "round"}

    def charged(self) -> Accountant:
        """This run's spending as the ledger records it: every event composed, the rounds
        cut short (in full) and a round still open included."""
        return self.ledger.replay([self.run_id])

    def round_events(self, round_index: int) -> list[SiloPrivacy]:
        """The events recorded for ``round_index``, read back from the ledger."""
        events = self.ledger.events(self.run_id, round_index, self.attempt)
        return [p for _, _, _, kind, p in events if kind == "round"]

    def complete_round(
        self,
        round_index: int,
        events: Sequence[SiloPrivacy],
        written: Mapping[str, float],
        participants: int | None = None,
    ) -> None:
        """Marks the round complete with the ε the run reports for it (the engine composed
        ``events`` into the run's accountant; a shared ledger's total gets them too)."""
        if events and self.shared:
            self.total.compose_round(events, participants=participants)
        finite = {u: (v if math.isfinite(v) else None) for u, v in written.items()}
        self.ledger.complete_round(
            self.run_id,
            round_index,
            participants=participants,
            written=finite,
            attempt=self.attempt,
        )

    def finish(self, status: str) -> None:
        self.ledger.finish_run(self.run_id, status)

    def close(self) -> None:
        """Closes the ledger (and releases its write lock); the run records nothing more."""
        try:
            self._repeated_at_close = self.repeated_attempts()
        except Exception:  # closing after an error: the note is left out, the error stands
            self._repeated_at_close = 0
        recorded: set[int] | None = None
        try:  # a stop while the outputs are written asks which rounds were charged
            recorded = self.recorded_rounds()
        except Exception:  # closing after an error: asked later, it raises (and is noted)
            pass
        self._recorded_at_close = recorded
        self.ledger.close()
