"""The privacy ledger: every DP mechanism a run executes, recorded durably in SQLite.

One row per silo per round (and per release before training) holds the events that silo's
mechanism ran, serialised exactly (:mod:`silodp.ledger.serialize`), written in its own
transaction before the silo's output is handed on. ε is never stored as the truth: it is
recomputed from these rows by the same accountant code calibration uses (:meth:`Ledger.replay`).
The database runs in WAL mode with ``synchronous=FULL``, so a committed row survives a crash or
a power loss.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silodp.accounting import SiloPrivacy
from silodp.accounting.interface import Accountant, accountant_from_spec
from silodp.errors import SilodpError
from silodp.ledger.serialize import privacy_from_json, privacy_to_json

__all__ = ["SCHEMA_VERSION", "Ledger", "LedgerError", "RunRecord"]

#: the schema this code writes; older ledgers are migrated on open, newer ones refused
SCHEMA_VERSION = 3


class LedgerError(SilodpError):
    """A ledger that cannot be used: unknown schema version, failed integrity check, or a
    request that does not fit its contents."""


_SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    algorithm TEXT NOT NULL,
    accountant TEXT NOT NULL,
    started REAL NOT NULL,
    status TEXT NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    round INTEGER NOT NULL,
    party TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('round', 'release')),
    privacy TEXT NOT NULL,
    recorded REAL NOT NULL
);
CREATE TABLE rounds (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    round INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('open', 'complete')),
    participants INTEGER,
    written TEXT,
    PRIMARY KEY (run_id, round)
);
"""


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """v2: where each run's coins came from (mode and an id of the seed material), the
    config it ran and its δ, kept beside the run."""
    db.execute("ALTER TABLE runs ADD COLUMN noise TEXT NOT NULL DEFAULT '{}'")
    db.execute("ALTER TABLE runs ADD COLUMN config_hash TEXT NOT NULL DEFAULT ''")


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    """v3: attempts. A round cut short and run again after a resume keeps both attempts'
    events, each composed as a round of its own (the cut one counts conservatively)."""
    db.execute("ALTER TABLE events ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0")
    db.execute(
        """CREATE TABLE rounds_v3 (
            run_id INTEGER NOT NULL REFERENCES runs(id),
            round INTEGER NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 0,
            status TEXT NOT NULL CHECK (status IN ('open', 'complete')),
            participants INTEGER,
            written TEXT,
            PRIMARY KEY (run_id, round, attempt)
        )"""
    )
    db.execute(
        "INSERT INTO rounds_v3 (run_id, round, attempt, status, participants, written) "
        "SELECT run_id, round, 0, status, participants, written FROM rounds"
    )
    db.execute("DROP TABLE rounds")
    db.execute("ALTER TABLE rounds_v3 RENAME TO rounds")


#: ``{from_version: migration}``; each runs in the transaction that bumps the version
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {
    1: _migrate_1_to_2,
    2: _migrate_2_to_3,
}


@dataclass(frozen=True)
class RunRecord:
    """One run as the ledger holds it."""

    id: int
    name: str
    algorithm: str
    accountant: dict[str, Any]
    started: float
    status: str
    noise: dict[str, Any]
    config_hash: str


class Ledger:
    """A privacy ledger file (created with the current schema if it does not exist).

    Raises:
      LedgerError: the file's schema version is newer than this code knows, or the file is not
        a ledger.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as err:
            raise LedgerError(f"Expected a silodp ledger at {str(self.path)!r}: {err}.") from err

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- schema ---------------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(row[0])

    def _migrate(self) -> None:
        query = "SELECT name FROM sqlite_master WHERE type='table'"
        tables = {r[0] for r in self.db.execute(query)}
        with self._transaction() as db:
            if "meta" not in tables:
                if tables:
                    raise LedgerError(
                        f"Expected a silodp ledger at {str(self.path)!r}; it holds other tables."
                    )
                for statement in _SCHEMA_V1.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"Ledger {str(self.path)!r} has schema version {version}; this silodp knows "
                f"versions up to {SCHEMA_VERSION}. Use a newer silodp."
            )
        while version < SCHEMA_VERSION:
            with self._transaction() as db:
                MIGRATIONS[version](db)
                version += 1
                db.execute(
                    "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),)
                )

    def integrity_errors(self) -> list[str]:
        """SQLite's integrity check and foreign-key check (empty: the file is sound)."""
        rows = [r[0] for r in self.db.execute("PRAGMA integrity_check")]
        problems = [r for r in rows if r != "ok"]
        problems += [f"foreign key: {r}" for r in self.db.execute("PRAGMA foreign_key_check")]
        return problems

    # --- writing --------------------------------------------------------------------------
    def open_run(
        self,
        *,
        name: str,
        algorithm: str,
        accountant: Mapping[str, Any],
        noise: Mapping[str, Any],
        config_hash: str = "",
    ) -> int:
        """Registers a run; returns its id."""
        with self._transaction() as db:
            cur = db.execute(
                "INSERT INTO runs (name, algorithm, accountant, started, status, noise, "
                "config_hash) VALUES (?, ?, ?, ?, 'running', ?, ?)",
                (
                    name,
                    algorithm,
                    json.dumps(dict(accountant), sort_keys=True),
                    time.time(),
                    json.dumps(dict(noise), sort_keys=True),
                    config_hash,
                ),
            )
            return int(cur.lastrowid or 0)

    def record(
        self,
        run_id: int,
        round_index: int,
        party: str,
        privacy: SiloPrivacy,
        *,
        kind: str = "round",
        attempt: int = 0,
    ) -> None:
        """Records one mechanism execution (its own transaction; durable on return). A round
        is ``open`` from its first event until :meth:`complete_round`."""
        self.record_many(run_id, round_index, [(party, privacy)], kind=kind, attempt=attempt)

    def record_many(
        self,
        run_id: int,
        round_index: int,
        executions: Sequence[tuple[str, SiloPrivacy]],
        *,
        kind: str = "round",
        attempt: int = 0,
    ) -> None:
        """Records several (party, events) of one round in one transaction: all or none."""
        with self._transaction() as db:
            now = time.time()
            for party, privacy in executions:
                db.execute(
                    "INSERT INTO events (run_id, round, party, kind, privacy, recorded, attempt) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (run_id, round_index, party, kind, privacy_to_json(privacy), now, attempt),
                )
            if kind == "round":
                db.execute(
                    "INSERT OR IGNORE INTO rounds (run_id, round, attempt, status) "
                    "VALUES (?, ?, ?, 'open')",
                    (run_id, round_index, attempt),
                )

    def complete_round(
        self,
        run_id: int,
        round_index: int,
        *,
        participants: int | None = None,
        written: Mapping[str, Any] | None = None,
        attempt: int = 0,
    ) -> None:
        """Marks a round complete, with the ε the run wrote for it (for ``ledger verify``)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO rounds (run_id, round, attempt, status, participants, written) "
                "VALUES (?, ?, ?, 'complete', ?, ?) ON CONFLICT (run_id, round, attempt) DO "
                "UPDATE SET status = 'complete', participants = excluded.participants, "
                "written = excluded.written",
                (
                    run_id,
                    round_index,
                    attempt,
                    participants,
                    json.dumps(written or {}, sort_keys=True),
                ),
            )

    def finish_run(self, run_id: int, status: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run_id))

    # --- reading --------------------------------------------------------------------------
    def runs(self) -> list[RunRecord]:
        rows = self.db.execute(
            "SELECT id, name, algorithm, accountant, started, status, noise, config_hash "
            "FROM runs ORDER BY id"
        )
        return [
            RunRecord(r[0], r[1], r[2], json.loads(r[3]), r[4], r[5], json.loads(r[6]), r[7])
            for r in rows
        ]

    def run(self, run_id: int) -> RunRecord:
        for record in self.runs():
            if record.id == run_id:
                return record
        raise LedgerError(f"Expected a run with id {run_id} in {str(self.path)!r}.")

    def rounds(self, run_id: int) -> list[dict[str, Any]]:
        """Every round attempt of a run, in the order it started: its round, attempt, status
        (``complete``, or ``interrupted`` if it never completed) and what the run wrote."""
        rows = self.db.execute(
            "SELECT r.round, r.attempt, r.status, r.participants, r.written FROM rounds r "
            "LEFT JOIN (SELECT round, attempt, MIN(id) AS first FROM events WHERE run_id = ? "
            "GROUP BY round, attempt) e ON e.round = r.round AND e.attempt = r.attempt "
            "WHERE r.run_id = ? ORDER BY COALESCE(e.first, 9e18), r.round, r.attempt",
            (run_id, run_id),
        )
        return [
            {
                "round": r[0],
                "attempt": r[1],
                "status": "complete" if r[2] == "complete" else "interrupted",
                "participants": r[3],
                "written": json.loads(r[4]) if r[4] else {},
            }
            for r in rows
        ]

    def next_attempt(self, run_id: int) -> int:
        """The attempt number of a resumed run's next rounds (one above any recorded)."""
        row = self.db.execute(
            "SELECT MAX(attempt) FROM events WHERE run_id = ?", (run_id,)
        ).fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def events(
        self, run_id: int, round_index: int | None = None, attempt: int | None = None
    ) -> list[tuple[int, int, str, str, SiloPrivacy]]:
        """(round, attempt, party, kind, events) of a run (or of one round attempt), in the
        order they were recorded."""
        query, args = "WHERE run_id = ?", [run_id]
        if round_index is not None:
            query += " AND round = ?"
            args.append(round_index)
        if attempt is not None:
            query += " AND attempt = ?"
            args.append(attempt)
        rows = self.db.execute(
            f"SELECT round, attempt, party, kind, privacy FROM events {query} ORDER BY id", args
        )
        return [(r[0], r[1], r[2], r[3], privacy_from_json(r[4])) for r in rows]

    def count_events(self, run_id: int | None = None) -> int:
        if run_id is None:
            return int(self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        query = "SELECT COUNT(*) FROM events WHERE run_id = ?"
        return int(self.db.execute(query, (run_id,)).fetchone()[0])

    def replay(self, run_ids: Sequence[int], accountant: Accountant | None = None) -> Accountant:
        """An accountant that composed every recorded event of ``run_ids`` in order: a run's
        releases as one release, each round attempt's silos as one round (an interrupted
        attempt counts in full). Default: a fresh accountant of the first run's kind."""
        if accountant is None:
            accountant = accountant_from_spec(self.run(run_ids[0]).accountant)
        for run_id in run_ids:
            events = self.events(run_id)
            releases = [p for _, _, _, kind, p in events if kind == "release"]
            if releases:  # the releases before training: composed together, as one release
                accountant.compose_release(releases)
            for row in self.rounds(run_id):
                privacy = [
                    p
                    for r, a, _, kind, p in events
                    if kind == "round" and (r, a) == (row["round"], row["attempt"])
                ]
                if privacy:
                    accountant.compose_round(privacy, participants=row["participants"])
        return accountant
