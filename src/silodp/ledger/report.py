"""What a ledger says, recomputed from its events: the history and totals (``ledger show``) and
the check that every ε a run wrote is what its recorded events give (``ledger verify``).

Both only read: the ledger is opened read-only (:class:`~silodp.ledger.store.Ledger` with
``read_only=True``), so the file stays byte for byte as it was, an older one is not migrated,
and a file that is not a ledger is refused rather than turned into one."""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from silodp import display
from silodp.accounting.interface import accountant_from_spec
from silodp.errors import SilodpError
from silodp.io import json_number
from silodp.ledger.store import Ledger, LedgerError, RunRecord

__all__ = ["ledger_report", "same_epsilon", "verify_ledger"]

#: relative difference above which a written ε and the recomputed one disagree
TOLERANCE = 1e-9


def same_epsilon(written: float | None, value: float | None) -> bool:
    """Whether an ε as written (``None``: unbounded) is the ε recomputed from the events
    (``None`` or a non-finite value: unbounded), to :data:`TOLERANCE`."""
    bounded = value is not None and math.isfinite(value)
    if written is None or not bounded:
        return written is None and not bounded
    assert value is not None
    return abs(value - written) <= TOLERANCE * max(abs(value), abs(written))


@contextmanager
def _reading(path: str | Path) -> Iterator[Ledger]:
    """The ledger at ``path`` opened read-only; what cannot be read in it is a LedgerError."""
    with Ledger(path, read_only=True) as ledger:
        try:
            yield ledger
        except SilodpError:
            raise
        except (sqlite3.DatabaseError, json.JSONDecodeError) as err:
            raise LedgerError(
                f"Expected a readable silodp ledger at {str(path)!r}: {err}."
            ) from err
        except (KeyError, TypeError, AttributeError) as err:
            # a row edited by hand into a shape silodp never writes
            raise LedgerError(
                f"Expected a readable silodp ledger at {str(path)!r}: a row does not have the "
                f"form silodp writes ({type(err).__name__}: {err})."
            ) from err


def ledger_report(path: str | Path) -> dict[str, Any]:
    """Runs, rounds (complete or interrupted), events, and ε per unit and route recomputed
    from the events: per run, and for every group of runs of one accounting kind composed
    together (what a shared ledger has spent on its data: at the declared budget's δ, else
    the smallest of the runs', against their adversary, or the strongest where runs and
    budget differ), and the budget declared on it.

    ``schema_version`` is the version of the file; an older one is read as the current one
    without migrating the file.

    Raises:
      LedgerError: no ledger at ``path``, or one this code cannot read.
    """
    with _reading(path) as ledger:
        runs = []
        for record in ledger.runs():
            rounds = ledger.rounds(record.id)
            spent = bool(rounds) or ledger.count_events(record.id) > 0  # a release alone too
            problem = None
            try:
                totals = ledger.replay([record.id]).estimates() if spent else {}
            except (ValueError, TypeError) as err:  # events its accountant cannot compose
                totals, problem = {}, str(err)
            runs.append(
                {
                    "id": record.id,
                    "name": record.name,
                    "algorithm": record.algorithm,
                    "status": record.status,
                    "noise": record.noise,
                    "delta": record.accountant.get("delta"),
                    # whom ε holds against: the run's privacy.adversary
                    "adversary": record.accountant.get("target", "strongest"),
                    "events": ledger.count_events(record.id),
                    "rounds": len(rounds),
                    "interrupted_rounds": [r["round"] for r in rounds if r["status"] != "complete"],
                    # rounds with more than one attempt (a resume ran them again): each counted
                    # (one whose earlier attempt was cut short is listed as interrupted)
                    "rounds_run_again": sorted(
                        r
                        for r, n in Counter(r["round"] for r in rounds).items()
                        if n > 1
                        and all(o["status"] == "complete" for o in rounds if o["round"] == r)
                    ),
                    "epsilon": {u: json_number(e.epsilon) for u, e in totals.items()},
                    "routes": {u: e.route for u, e in totals.items()},
                    **({"error": problem} if problem is not None else {}),
                }
            )
        kinds: dict[str, list[int]] = {}
        for record in ledger.runs():
            if ledger.rounds(record.id) or ledger.count_events(record.id):
                kinds.setdefault(record.accountant.get("kind", "?"), []).append(record.id)
        # a model released without noise leaves no guarantee on the data, whatever the kind
        no_noise = [r.id for r in ledger.runs() if r.noise.get("mode") == "none"]
        total: dict[str, dict[str, Any]] = {}
        records = {r.id: r for r in ledger.runs()}
        declared = ledger.budget()
        for kind, ids in kinds.items():
            first = dict(records[ids[0]].accountant)
            against = {records[i].accountant.get("target", "strongest") for i in ids}
            if declared:  # the total the declared budget is checked against
                limit = next(iter(declared.values()))
                first["delta"] = limit["delta"]
                against |= {b.get("adversary", "strongest") for b in declared.values()}
            else:  # at the smallest δ of the runs: a total never reads below one of them
                deltas = [records[i].accountant.get("delta") for i in ids]
                first["delta"] = min((d for d in deltas if d is not None), default=None)
            if "target" in first:  # the runs' and budgets' adversary; where they differ, the
                # strongest, against which the total reads below no run's own ε
                first["target"] = against.pop() if len(against) == 1 else "strongest"
            try:
                replayed = ledger.replay(ids, accountant_from_spec(first))
            except (ValueError, TypeError) as err:  # e.g. a round whose clients ran different σ
                total[kind] = {"runs": ids, "delta": None, "epsilon": {}, "error": str(err)}
                continue
            # a run that does not account a unit adds nothing to its total there, yet it
            # spent something there: the total at that unit has no bound
            # (an accountant that names no units reports the same ones for every run)
            named = {i: records[i].accountant.get("units") for i in ids}
            estimates = replayed.estimates()
            every = list(estimates)
            every += sorted({u for us in named.values() for u in us or ()} - set(every))
            units: dict[int, list[str]] = {
                i: list(us) if us is not None else every for i, us in named.items()
            }
            unaccounted = {u: [i for i in ids if u not in units[i]] for u in every}
            unaccounted = {u: found for u, found in unaccounted.items() if found}
            total[kind] = {
                "runs": ids,
                "delta": replayed.spec().get("delta"),
                # whom the total holds against: the runs' and the declared budget's
                # adversary, or the strongest where they differ
                "adversary": replayed.spec().get("target", "strongest"),
                "epsilon": {
                    u: None
                    if no_noise or u in unaccounted or u not in estimates
                    else json_number(estimates[u].epsilon)
                    for u in every
                },
                **({"without_noise": no_noise} if no_noise else {}),
                **({"unaccounted": unaccounted} if unaccounted else {}),
            }
        return {
            "path": str(path),
            "schema_version": ledger.file_schema_version,
            "runs": runs,
            "total": total,
            "budget": ledger.budget(),
        }


def total_line(kind: str, total: dict[str, Any]) -> str:
    """One composed total of :func:`ledger_report` in a line: ε per unit rounded up (inf: no
    finite bound) at its δ and adversary, or why the runs were not composed."""
    head = f"total over runs {total['runs']} ({kind} accounting)"
    if total.get("error"):
        return f"{head}: not composed, no bound ({total['error']})"
    eps = ", ".join(f"{u}={display.upper(v)}" for u, v in total["epsilon"].items())
    at = f" at δ={total['delta']:g}" if total.get("delta") is not None else ""
    return f"{head}: ε({eps}){at} against {total.get('adversary', 'strongest')}"


def verify_ledger(path: str | Path) -> list[str]:
    """Every problem found: SQLite's integrity check, then, per run, each completed round's ε
    as the run wrote it against the ε its recorded events give, recomputed round by round with
    the run's accountant. Empty: the ledger is sound and every written ε is what it says.

    Raises:
      LedgerError: no ledger at ``path``, or one of a schema version this code does not know.
    """
    with _reading(path) as ledger:
        problems = ledger.integrity_errors()
        if problems:
            return problems
        for record in ledger.runs():
            try:
                problems += _verify_run(ledger, record)
            except ValueError as err:  # events edited into a form no accountant composes
                problems.append(
                    f"run {record.id} ({record.name}): its events cannot be composed ({err})"
                )
        return problems


def _verify_run(ledger: Ledger, record: RunRecord) -> list[str]:
    """:func:`verify_ledger`'s problems with one run."""
    problems: list[str] = []
    accountant = accountant_from_spec(record.accountant)
    events = ledger.events(record.id)
    problems += [
        f"run {record.id} ({record.name}): {len(privacy)} event(s) recorded with no "
        "record of their round (composed in every total all the same)"
        for row, _, privacy in ledger.round_groups(record.id, events)
        if row is None
    ]
    releases = [p for _, _, _, kind, p in events if kind == "release"]
    if releases:
        accountant.compose_release(releases)
    for row in ledger.rounds(record.id):
        privacy = [
            p
            for r, a, _, kind, p in events
            if kind == "round" and (r, a) == (row["round"], row["attempt"])
        ]
        if privacy:
            accountant.compose_round(privacy, participants=row["participants"])
        if row["status"] != "complete":
            continue
        got = {u: e.epsilon for u, e in accountant.estimates().items()}
        for unit, written in row["written"].items():
            value = got.get(unit, math.nan)
            if not same_epsilon(written, value):
                problems.append(
                    f"run {record.id} ({record.name}) round {row['round']}: {unit} "
                    f"ε written {written!r}, recomputed from the events {value!r}"
                )
    return problems
