"""Reading a ledger never writes: ``ledger show``/``ledger verify`` and the functions behind
them leave every file byte for byte as it was (and create none), refuse what is not a ledger,
read an older ledger without migrating it, and read a ledger whose writer is still open or
stopped without closing, also from a read-only directory."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from silodp.accounting import FederatedAccountant, SiloPrivacy
from silodp.accounting.events import gaussian_steps
from silodp.cli import app
from silodp.errors import SilodpError
from silodp.ledger import SCHEMA_VERSION, Ledger, LedgerError, store
from silodp.ledger.report import ledger_report, verify_ledger
from silodp.ledger.serialize import privacy_to_json
from silodp.ledger.store import _SCHEMA_V1

runner = CliRunner()

SPEC = FederatedAccountant(units=("subject",), span=2, delta=1e-5).spec()
EVENT = SiloPrivacy({"subject": gaussian_steps(4.0, 3)})

#: the unprivileged user root reads as, so that a read-only directory is read-only to it
NOBODY = 65534


def _files(directory: Path) -> dict[str, str]:
    """Every file of ``directory`` and the SHA-256 of its bytes."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _write_ledger(path: Path, rounds: int = 2) -> Ledger:
    """A real ledger written through the store API: one run of two silos, each completed round
    with the ε its events give written beside it (still open: the caller closes it)."""
    ledger = Ledger(path)
    run = ledger.open_run(
        name="tiny", algorithm="user_ldp", accountant=SPEC, noise={"mode": "seeded"}
    )
    for index in range(1, rounds + 1):
        ledger.record_many(run, index, [("silo:0", EVENT), ("silo:1", EVENT)])
        written = {u: e.epsilon for u, e in ledger.replay([run]).estimates().items()}
        ledger.complete_round(run, index, written=written)
    return ledger


@pytest.fixture
def where(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory an unprivileged user can reach (root's pytest directory is private)."""
    if os.geteuid() != 0:
        yield tmp_path
        return
    directory = Path(tempfile.mkdtemp(prefix="silodp-readonly-"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        directory.chmod(0o755)
        shutil.rmtree(directory)


@contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` made read-only to this process; root, whom permissions do not stop,
    reads as an unprivileged user meanwhile. Checks that nothing can be created in it."""
    for file in directory.iterdir():
        file.chmod(0o644)
    directory.chmod(0o555)
    as_root = os.geteuid() == 0
    try:
        if as_root:
            os.seteuid(NOBODY)
        try:
            with pytest.raises(PermissionError):
                (directory / "probe").touch()
            yield
        finally:
            if as_root:
                os.seteuid(0)
    finally:
        directory.chmod(0o755)


def _error_line(result: Result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# --- what is not a ledger ---------------------------------------------------------------------
def _foreign(path: Path, *statements: str, wal: bool = False) -> None:
    with sqlite3.connect(path) as db:
        if wal:
            db.execute("PRAGMA journal_mode=WAL")
        for statement in statements:
            db.execute(statement)
    db.close()


NOT_LEDGERS = {
    "empty": (lambda p: p.touch(), "it is empty"),
    "random bytes": (
        lambda p: p.write_bytes(random.Random(0).randbytes(4096)),
        "it is not an SQLite database",
    ),
    "SQLite header, then random bytes": (
        lambda p: p.write_bytes(b"SQLite format 3\x00" + random.Random(1).randbytes(4096)),
        "Expected",
    ),
    "foreign SQLite database": (
        lambda p: _foreign(p, "CREATE TABLE x (a)", "INSERT INTO x VALUES (1)"),
        "it holds other tables (x)",
    ),
    "foreign SQLite database in WAL mode": (
        lambda p: _foreign(p, "CREATE TABLE y (a)", wal=True),
        "it holds other tables (y)",
    ),
    "SQLite database with no tables": (
        lambda p: _foreign(p, "PRAGMA user_version = 7"),
        "an SQLite database with no tables",
    ),
    "meta table without a version": (
        lambda p: _foreign(p, "CREATE TABLE meta (key TEXT, value TEXT)"),
        "a schema version of 1 to",
    ),
    "ledger tables missing": (
        lambda p: _foreign(
            p,
            "CREATE TABLE meta (key TEXT, value TEXT)",
            f"INSERT INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}')",
        ),
        "it has no table 'runs'",
    ),
    "newer ledger": (
        lambda p: _foreign(
            p,
            "CREATE TABLE meta (key TEXT, value TEXT)",
            "INSERT INTO meta VALUES ('schema_version', '99')",
        ),
        "schema version 99",
    ),
}


@pytest.mark.parametrize("kind", sorted(NOT_LEDGERS))
def test_what_is_not_a_ledger_is_refused_and_left_unchanged(tmp_path: Path, kind: str) -> None:
    make, message = NOT_LEDGERS[kind]
    path = tmp_path / "ledger.sqlite"
    make(path)
    before = _files(tmp_path)
    for read in (ledger_report, verify_ledger):
        with pytest.raises(LedgerError, match="Expected|schema version") as caught:
            read(path)
        assert isinstance(caught.value, SilodpError)
        assert str(path) in str(caught.value) and message in str(caught.value)
        assert "\n" not in str(caught.value)
    for command in (["show"], ["show", "--json"], ["verify"]):
        result = runner.invoke(app, ["ledger", *command, str(path)])
        assert result.exit_code == 2, result.output
        line = _error_line(result)
        assert str(path) in line and message in line
    assert _files(tmp_path) == before  # nothing written, nothing created beside it


def test_a_missing_file_or_a_directory_is_refused_without_creating_anything(
    tmp_path: Path,
) -> None:
    with pytest.raises(LedgerError, match="it does not exist"):
        ledger_report(tmp_path / "none.sqlite")
    with pytest.raises(LedgerError, match="it is a directory"):
        verify_ledger(tmp_path)
    assert list(tmp_path.iterdir()) == []
    result = runner.invoke(app, ["ledger", "verify", str(tmp_path / "deep" / "none.sqlite")])
    assert result.exit_code == 2 and "it does not exist" in _error_line(result)
    assert list(tmp_path.iterdir()) == []


# --- a real ledger ----------------------------------------------------------------------------
def test_reading_a_ledger_leaves_every_file_byte_for_byte_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    _write_ledger(path, rounds=3).close()
    before = _files(tmp_path)
    assert list(before) == ["ledger.sqlite"]  # a closed WAL ledger: no -wal, -shm or -lock
    report = ledger_report(path)
    (run,) = report["runs"]
    assert report["schema_version"] == SCHEMA_VERSION
    assert (run["rounds"], run["events"], run["status"]) == (3, 6, "running")
    assert verify_ledger(path) == []
    for command in (["show"], ["show", "--json"], ["verify"]):
        result = runner.invoke(app, ["ledger", *command, str(path)])
        assert result.exit_code == 0, result.output
    assert _files(tmp_path) == before
    # the reading really is of this file: a tampered written ε is found, still without writing
    with sqlite3.connect(path) as db:
        db.execute("UPDATE rounds SET written = ? WHERE round = 2", (json.dumps({"subject": 1}),))
    db.close()
    before = _files(tmp_path)
    (problem,) = verify_ledger(path)
    assert "round 2: subject" in problem
    assert _files(tmp_path) == before


def test_a_read_only_ledger_refuses_to_write(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    _write_ledger(path).close()
    before = _files(tmp_path)
    with Ledger(path, read_only=True) as ledger:
        assert ledger.read_only and len(ledger.runs()) == 1
        with pytest.raises(LedgerError, match="opened read-only"):
            ledger.open_run(name="x", algorithm="user_ldp", accountant=SPEC, noise={})
        with pytest.raises(LedgerError, match="opened read-only"):
            ledger.record(1, 3, "silo:0", EVENT)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ledger.db.execute("DELETE FROM events")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("journal", ["delete", "wal"])
def test_an_older_ledger_is_read_without_migrating_it(tmp_path: Path, journal: str) -> None:
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA journal_mode={journal}")
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute(
        "INSERT INTO runs (id, name, algorithm, accountant, started, status) "
        "VALUES (1, 'old', 'user_ldp', ?, 0, 'complete')",
        (json.dumps(SPEC),),
    )
    for silo in range(2):
        db.execute(
            "INSERT INTO events (run_id, round, party, kind, privacy, recorded) "
            "VALUES (1, 1, ?, 'round', ?, 0)",
            (f"silo:{silo}", privacy_to_json(EVENT)),
        )
    db.execute("INSERT INTO rounds VALUES (1, 1, 'complete', NULL, NULL)")
    db.commit()
    db.close()
    before = _files(tmp_path)
    report = ledger_report(path)
    assert report["schema_version"] == 1
    (run,) = report["runs"]
    assert (run["rounds"], run["events"], run["noise"]) == (1, 2, {})
    assert run["epsilon"]["subject"] > 0
    assert verify_ledger(path) == []
    result = runner.invoke(app, ["ledger", "show", str(path)])
    assert result.exit_code == 0
    assert f"schema v1, read as v{SCHEMA_VERSION} without migrating" in result.output
    assert _files(tmp_path) == before
    with Ledger(path) as writer:  # what migrates it: opening it for writing, as a run does
        assert writer.schema_version == SCHEMA_VERSION
    assert ledger_report(path)["schema_version"] == SCHEMA_VERSION


# --- a writer still open, or stopped without closing; a read-only directory -------------------
#: a second process that adds a run to the ledger and keeps its connection open (``wait``) or
#: stops without closing it (the committed run is then only in the -wal file)
WRITER = """
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute(
    "INSERT INTO runs (name, algorithm, accountant, started, status, noise, config_hash) "
    "SELECT 'late', algorithm, accountant, started, 'running', noise, '' FROM runs"
)
print("ready", flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()
    db.close()
else:
    os._exit(0)
"""


@pytest.mark.parametrize("directory", ["writable", "read-only"])
@pytest.mark.parametrize(
    "state", ["closed", "writer open", "writer stopped", "writer stopped, -shm lost"]
)
def test_a_ledger_is_read_as_committed_whatever_its_writer_left(
    where: Path, state: str, directory: str
) -> None:
    path = where / "ledger.sqlite"
    _write_ledger(path).close()
    main = hashlib.sha256(path.read_bytes()).hexdigest()
    writer = None
    if state != "closed":
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), "wait" if state == "writer open" else "x"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        if state != "writer open":
            assert writer.wait(timeout=10) == 0
    if state == "writer stopped, -shm lost":
        Path(f"{path}-shm").unlink()
    expected = {
        "closed": ["ledger.sqlite"],
        "writer stopped, -shm lost": ["ledger.sqlite", "ledger.sqlite-wal"],
    }.get(state, ["ledger.sqlite", "ledger.sqlite-shm", "ledger.sqlite-wal"])
    try:
        before = _files(where)
        assert sorted(before) == expected
        assert before["ledger.sqlite"] == main  # the late run is only in the -wal file
        reading = _read_only(where) if directory == "read-only" else _noop()
        with reading:
            report = ledger_report(path)
            problems = verify_ledger(path)
            result = runner.invoke(app, ["ledger", "show", "--json", str(path)])
        after = _files(where)
    finally:
        if writer is not None and writer.poll() is None:
            writer.communicate("", timeout=10)
    names = [run["name"] for run in report["runs"]]
    assert names == (["tiny"] if state == "closed" else ["tiny", "late"])
    assert report["runs"][0]["rounds"] == 2 and problems == []
    assert result.exit_code == 0 and json.loads(result.output)["runs"] == report["runs"]
    assert sorted(after) == expected  # nothing created, nothing removed
    # every file as it was; the one exception is SQLite's shared-memory index (-shm) of a
    # writable directory, where a reader of a WAL database takes its read locks
    shm_may_change = directory == "writable" and "ledger.sqlite-shm" in expected
    assert {k: v for k, v in after.items() if not (shm_may_change and k.endswith("-shm"))} == {
        k: v for k, v in before.items() if not (shm_may_change and k.endswith("-shm"))
    }


@contextmanager
def _noop() -> Iterator[None]:
    yield


def test_a_writer_open_in_this_process_is_read_live_without_being_touched(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite"
    with _write_ledger(path, rounds=1) as writer:
        wal_before = hashlib.sha256(Path(f"{path}-wal").read_bytes()).hexdigest()
        main_before = hashlib.sha256(path.read_bytes()).hexdigest()
        assert ledger_report(path)["runs"][0]["rounds"] == 1
        assert verify_ledger(path) == []
        assert hashlib.sha256(Path(f"{path}-wal").read_bytes()).hexdigest() == wal_before
        assert hashlib.sha256(path.read_bytes()).hexdigest() == main_before
        # the writer goes on: the next read sees its new committed round
        writer.record_many(1, 2, [("silo:0", EVENT), ("silo:1", EVENT)])
        writer.complete_round(
            1, 2, written={u: e.epsilon for u, e in writer.replay([1]).estimates().items()}
        )
        assert ledger_report(path)["runs"][0]["rounds"] == 2
        assert verify_ledger(path) == []
        writer.record(1, 3, "silo:0", EVENT)  # an open round: counted as interrupted
        assert ledger_report(path)["runs"][0]["interrupted_rounds"] == [3]


def test_a_ledger_changed_while_it_is_copied_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ledger.sqlite"
    _write_ledger(path).close()
    copy_into = store._copy_into
    calls: list[bool] = []
    writer: list[Ledger] = []

    def copy_then_write(memory: sqlite3.Connection, where: Path) -> bool:
        consistent = copy_into(memory, where)
        calls.append(consistent)
        if len(calls) == 1:  # a run starts writing while the first copy is made
            writer.append(Ledger(where))
            writer[0].open_run(name="new", algorithm="user_ldp", accountant=SPEC, noise={})
        return consistent

    monkeypatch.setattr(store, "_copy_into", copy_then_write)
    try:
        names = [run["name"] for run in ledger_report(path)["runs"]]
    finally:
        writer[0].close()
    # the first copy (of the file alone) was not consistent with the file after it; the
    # second read the running writer's committed state through SQLite's locks
    assert calls == [False, True] and names == ["tiny", "new"]

    def always_changing(memory: sqlite3.Connection, where: Path) -> bool:
        copy_into(memory, where)
        os.utime(where, ns=(0, len(calls) * 10**9))
        calls.append(False)
        return False

    monkeypatch.setattr(store, "_copy_into", always_changing)
    with pytest.raises(LedgerError, match="hold still"):
        ledger_report(path)
