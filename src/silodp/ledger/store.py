"""The privacy ledger: every DP mechanism a run executes, recorded durably in SQLite.

One row per silo per round (and per release before training) holds the events that silo's
mechanism ran, serialised exactly (:mod:`silodp.ledger.serialize`), written in its own
transaction before the silo's output is handed on. ε is never stored as the truth: it is
recomputed from these rows by the same accountant code calibration uses (:meth:`Ledger.replay`).
The database runs in WAL mode with ``synchronous=FULL``, so a committed row survives a crash or
a power loss.

``Ledger(path, read_only=True)`` (what ``ledger show`` and ``ledger verify`` use) never writes:
it copies the ledger's last committed state into memory through a read-only SQLite connection
and reads that copy, so the file, its directory and any writer still running are left alone.
An older ledger is migrated in that copy only; the file keeps its version until a run writes
to it.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silodp import locking
from silodp.accounting import FederatedAccountant, SiloPrivacy
from silodp.accounting.fdp import FdpAccountant
from silodp.accounting.interface import Accountant, accountant_from_spec
from silodp.errors import SilodpError
from silodp.ledger.serialize import privacy_from_json, privacy_to_json

__all__ = [
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerError",
    "RunRecord",
    "check_free",
    "is_blank_ledger",
    "ledger_file_problem",
    "merge_declared",
]

#: the schema this code writes; an older ledger opened for writing is migrated, a newer refused
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


#: the tables and columns of the current schema (what a ledger read is checked against)
COLUMNS = {
    "meta": {"key", "value"},
    "runs": {"id", "name", "algorithm", "accountant", "started", "status", "noise", "config_hash"},
    "events": {"id", "run_id", "round", "party", "kind", "privacy", "recorded", "attempt"},
    "rounds": {"run_id", "round", "attempt", "status", "participants", "written"},
}

#: how every SQLite database file starts (its header is 100 bytes long)
SQLITE_HEADER = b"SQLite format 3\x00"


def _lock(path: Path) -> str:
    """Takes the write lock of the ledger at ``path`` (``<path>-lock``, see
    :mod:`silodp.locking`; one lock for every name of the file, a symbolic link too).

    Runs that share a ledger run one after another: each checks its budget against what the
    others spent, which two runs writing at once could not see.

    Raises:
      LedgerError: another process holds it.
    """
    try:
        return locking.acquire(_lock_name(path))
    except locking.Held as held:
        raise _held(path, held.holder) from None


def _lock_name(path: Path) -> str:
    real = path.resolve()
    return str(real.with_name(real.name + "-lock"))


def _held(path: Path, holder: str) -> LedgerError:
    return LedgerError(
        f"Expected the ledger {str(path)!r} to be free; another run (process {holder}) "
        "is writing to it. Runs that share a ledger run one after another, so that "
        "each checks its budget against everything the others spent."
    )


def check_free(path: str | Path) -> None:
    """Refuses, without taking it, a ledger another process is writing to (so that a run
    is refused before it loads data or writes anything, not when it registers).

    Raises:
      LedgerError: another process holds the ledger's write lock.
    """
    holder = locking.holder(_lock_name(Path(path)))
    if holder is not None:
        raise _held(Path(path), holder)


def merge_declared(
    stored: Mapping[str, Mapping[str, Any]],
    budget: Mapping[str, float],
    delta: float,
    adversary: str,
    *,
    where: str,
) -> dict[str, dict[str, Any]]:
    """A ledger's declared budget with ``budget`` (ε per unit at ``delta``, against
    ``adversary``) added: per unit the smaller ε, held against the stronger adversary (the
    same one, or ``strongest`` where they differ).

    Raises:
      LedgerError: ``delta`` differs from a budgeted unit's δ (``where``: the ledger's name).
    """
    merged = {unit: dict(value) for unit, value in stored.items()}
    for unit, epsilon in budget.items():
        old = merged.get(unit)
        if old is None:
            merged[unit] = {
                "epsilon": float(epsilon),
                "delta": float(delta),
                "adversary": adversary,
            }
            continue
        if old["delta"] != delta:
            raise LedgerError(
                f"Expected δ={old['delta']!r} for unit {unit!r}: the budget of {where} is at that "
                f"δ, got δ={delta!r}."
            )
        old["epsilon"] = min(float(old["epsilon"]), float(epsilon))
        if old.get("adversary", "strongest") != adversary:
            old["adversary"] = "strongest"
    return merged


def _header(path: Path) -> bytes:
    with path.open("rb") as handle:
        return handle.read(100)


def ledger_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a ledger to read, found from its first bytes without SQLite (for
    example ``"it is empty"``); None if it is a readable SQLite database."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if not path.is_file():
        return "it is a directory" if path.is_dir() else "it is not a regular file"
    try:
        header = _header(path)
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    if not header:
        return "it is empty"
    if len(header) < 100 or not header.startswith(SQLITE_HEADER):
        return "it is not an SQLite database"
    return None


def is_blank_ledger(path: str | Path) -> bool:
    """Whether ``path`` is an SQLite database with no tables: a ledger whose creation stopped
    before its schema was committed (it holds no spending; opening it creates the schema)."""
    path = Path(path)
    if ledger_file_problem(path) is not None:
        return False
    try:
        db = _snapshot(path.resolve())
    except (sqlite3.DatabaseError, OSError, LedgerError):
        return False
    try:
        return db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    except sqlite3.DatabaseError:
        return False
    finally:
        db.close()


def _file_state(path: Path) -> tuple[object, ...]:
    """What changes when a writer touches the ledger's committed state on disk."""
    states: list[tuple[int, int, int] | None] = []
    for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            stat = file.stat()
        except FileNotFoundError:
            states.append(None)
        else:
            states.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return (*states, _header(path))


def _copy_into(memory: sqlite3.Connection, path: Path) -> bool:
    """Copies the committed state of the SQLite database at ``path`` into ``memory`` without
    writing anything, whatever state a writer left it in; True if the copy is known to be
    consistent, False if it must be checked against ``path`` not having changed meanwhile.

    * no ``-wal`` file (every writer closed cleanly, or a rollback-journal file): the file
      alone holds every committed transaction. A WAL-mode file is read as ``immutable`` (a
      read-only connection to it would create ``-wal`` and ``-shm`` files beside it, or fail
      in a read-only directory), and the caller checks it did not change while it was read.
    * ``-wal`` and ``-shm`` (a writer is open, or one stopped without closing): read through
      SQLite's read-only WAL mode, which takes its locks in ``-shm`` as every reader of a WAL
      database does and sees exactly the committed transactions; works in a read-only
      directory too.
    * ``-wal`` but no ``-shm`` (no writer can be open): the two files are copied to a private
      directory, where SQLite recovers the committed transactions from the copy.
    """
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    wal_mode = _header(path)[18:20] == b"\x02\x02"
    if wal.exists() and not shm.exists():
        with tempfile.TemporaryDirectory(prefix="silodp-ledger-") as private:
            copy = Path(private) / "ledger.sqlite"
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, Path(f"{copy}-wal"))
            with closing(sqlite3.connect(copy)) as source:
                source.backup(memory)
        return False
    immutable = wal_mode and not wal.exists()
    uri = path.as_uri() + "?mode=ro" + ("&immutable=1" if immutable else "")
    with closing(sqlite3.connect(uri, uri=True, timeout=30.0)) as source:
        source.backup(memory)
    return not immutable


def _snapshot(path: Path) -> sqlite3.Connection:
    """An in-memory copy of the ledger file's last committed state (see :func:`_copy_into`)."""
    for _ in range(5):
        before = _file_state(path)
        memory = sqlite3.connect(":memory:", isolation_level=None)
        try:
            consistent = _copy_into(memory, path)
        except (sqlite3.DatabaseError, OSError):
            memory.close()
            if _file_state(path) == before:
                raise
            continue  # a writer changed the files under the copy: read them again
        if consistent or _file_state(path) == before:
            return memory
        memory.close()
    raise LedgerError(
        f"Expected the ledger {str(path)!r} to hold still while it is read; a writer kept "
        "changing it. Read it again when the run writing to it has stopped."
    )


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

    With ``read_only=True`` the file must already be a ledger; it is read as a snapshot of its
    last committed state, never written (nor migrated, nor given ``-wal``/``-shm`` files), and
    the writing methods refuse. ``file_schema_version`` is the version the file has on disk.

    Raises:
      LedgerError: the file's schema version is newer than this code knows, or the file is not
        a ledger.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only:
            self._open_read_only()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_name: str | None = _lock(self.path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as err:
            self._release()
            raise LedgerError(f"Expected a silodp ledger at {str(self.path)!r}: {err}.") from err
        except BaseException:
            self._release()
            raise
        self.file_schema_version = self.schema_version

    def _open_read_only(self) -> None:
        where = str(self.path)
        problem = ledger_file_problem(self.path)
        if problem is not None:
            raise LedgerError(f"Expected {where!r} to be a silodp ledger; {problem}.")
        try:
            self.db = _snapshot(self.path.resolve())
        except sqlite3.DatabaseError as err:
            raise LedgerError(f"Expected {where!r} to be a readable silodp ledger: {err}.") from err
        except OSError as err:
            raise LedgerError(
                f"Expected {where!r} to be a readable silodp ledger: {err.strerror or err}."
            ) from err
        try:
            self.file_schema_version = self._check_read_only()
            try:
                # an older ledger is brought to the current schema in this copy only
                for version in range(self.file_schema_version, SCHEMA_VERSION):
                    MIGRATIONS[version](self.db)
                    self.db.execute(
                        "UPDATE meta SET value = ? WHERE key = 'schema_version'",
                        (str(version + 1),),
                    )
            except sqlite3.DatabaseError as err:
                raise LedgerError(
                    f"Expected {where!r} to be a silodp ledger of schema version "
                    f"{self.file_schema_version}: {err}."
                ) from err
            self._check_columns()
            self.db.execute("PRAGMA query_only=ON")
        except BaseException:
            self.db.close()
            raise

    def _check_read_only(self) -> int:
        """The schema version of a ledger read, after checking it is one this code reads."""
        where = str(self.path)
        query = "SELECT name FROM sqlite_master WHERE type='table'"
        tables = sorted(r[0] for r in self.db.execute(query))
        if not tables:
            raise LedgerError(
                f"Expected {where!r} to be a silodp ledger; it is an SQLite database with no "
                "tables."
            )
        if "meta" not in tables:
            raise LedgerError(
                f"Expected {where!r} to be a silodp ledger; it holds other tables "
                f"({', '.join(tables)})."
            )
        row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            version = int(row[0])
        except (TypeError, ValueError):
            version = 0
        if version < 1:
            value = "none" if row is None else repr(row[0])
            raise LedgerError(
                f"Expected {where!r} to be a silodp ledger with a schema version of 1 to "
                f"{SCHEMA_VERSION} in its meta table; it has {value}."
            )
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"Ledger {where!r} has schema version {version}; this silodp knows "
                f"versions up to {SCHEMA_VERSION}. Use a newer silodp."
            )
        return version

    def _check_columns(self) -> None:
        """Every table and column the reading methods use is there."""
        for table, columns in COLUMNS.items():
            found = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if not columns <= found:
                what = (
                    f"its table {table!r} lacks {', '.join(sorted(columns - found))}"
                    if found
                    else f"it has no table {table!r}"
                )
                raise LedgerError(
                    f"Expected {str(self.path)!r} to be a silodp ledger of schema version "
                    f"{self.file_schema_version}; {what}."
                )

    def close(self) -> None:
        self.db.close()
        self._release()

    def _release(self) -> None:
        name = getattr(self, "_lock_name", None)
        if name is not None:
            locking.release(name)
            self._lock_name = None

    def __del__(self) -> None:
        self._release()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        if self.read_only:
            raise LedgerError(
                f"Expected a ledger opened for writing; {str(self.path)!r} was opened read-only."
            )
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
        """Records several (party, events) of one round in one transaction: all or none
        (nothing at all for no executions: no round is opened)."""
        if not executions:
            return
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

    def budget(self) -> dict[str, dict[str, Any]]:
        """The budget declared on this ledger, ``{unit: {"epsilon": ε, "delta": δ,
        "adversary": whom}}`` (empty: none). Every run that writes here is held to it,
        whatever its own config says (:func:`~silodp.ledger.run.ledger_budget`)."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'budget'").fetchone()
        if row is None:
            return {}
        try:
            value = json.loads(row[0])
            return {
                str(u): {
                    "epsilon": float(b["epsilon"]),
                    "delta": float(b["delta"]),
                    "adversary": str(b.get("adversary", "strongest")),
                }
                for u, b in value.items()
            }
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise LedgerError(
                f"Expected the budget in {str(self.path)!r} as {{unit: {{epsilon, delta, "
                f"adversary}}}}, got {row[0][:80]!r}."
            ) from err

    def declare_budget(self, budget: Mapping[str, float], delta: float, adversary: str) -> None:
        """Adds ``budget`` (ε per unit at ``delta`` against ``adversary``) to the ledger's own
        (:func:`merge_declared`).

        Raises:
          LedgerError: ``delta`` differs from a budgeted unit's δ.
        """
        with self._transaction() as db:
            stored = merge_declared(
                self.budget(), budget, delta, adversary, where=repr(str(self.path))
            )
            db.execute(
                "INSERT INTO meta (key, value) VALUES ('budget', ?) ON CONFLICT (key) DO UPDATE "
                "SET value = excluded.value",
                (json.dumps(stored, sort_keys=True),),
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
        attempt counts in full). Default: a fresh accountant of the first run's kind.

        Each run's events compose with that run's own span (the silos one subject's records
        occupied in its data) and, for PriFedSync, its own client rate, whatever those of
        ``accountant``."""
        if accountant is None:
            accountant = accountant_from_spec(self.run(run_ids[0]).accountant)
        for run_id in run_ids:
            events = self.events(run_id)
            spec = self.run(run_id).accountant
            own: dict[str, Any] = {}
            if isinstance(accountant, FederatedAccountant):
                # a subject composes over the span of the run's own data
                span = spec.get("span")
                own = {"span": span} if isinstance(span, int) else {}
            elif isinstance(accountant, FdpAccountant):
                # a client is in a round's sample at the rate the run drew its samples at
                rate = spec.get("client_rate")
                if not isinstance(rate, int | float) or isinstance(rate, bool):
                    raise LedgerError(
                        f"Expected run {run_id}'s accountant to record its client rate, got "
                        f"{rate!r}: its rounds cannot be composed at the rate they ran at."
                    )
                own = {"client_rate": float(rate)}
            releases = [p for _, _, _, kind, p in events if kind == "release"]
            if releases:  # the releases before training: composed together, as one release
                accountant.compose_release(releases, **own)
            for _, participants, privacy in self.round_groups(run_id, events):
                accountant.compose_round(privacy, participants=participants, **own)
        return accountant

    def round_groups(
        self,
        run_id: int,
        events: Sequence[tuple[int, int, str, str, SiloPrivacy]] | None = None,
    ) -> list[tuple[dict[str, Any] | None, int | None, list[SiloPrivacy]]]:
        """Each round attempt of a run that recorded events, in the order it started: (its
        ``rounds`` row, or ``None`` if it has none, its participants, its silos' events).

        Taken from the events themselves, so an event whose round row is missing (a ledger
        edited by hand) is still composed: :func:`~silodp.ledger.report.verify_ledger` reports
        it."""
        if events is None:
            events = self.events(run_id)
        rows = {(r["round"], r["attempt"]): r for r in self.rounds(run_id)}
        groups: dict[tuple[int, int], list[SiloPrivacy]] = {}
        for r, a, _, kind, p in events:
            if kind == "round":
                groups.setdefault((r, a), []).append(p)
        out = []
        for key, privacy in groups.items():  # dicts keep the order of the first event
            row = rows.get(key)
            out.append((row, None if row is None else row["participants"], privacy))
        return out
