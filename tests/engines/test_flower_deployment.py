"""A real Flower deployment on 127.0.0.1 (SuperLink with TLS and SuperNode authentication, one
SuperNode per silo), driven through the CLI as a user would: the same numbers as in process,
a SuperNode killed mid-run under both failure policies, and a ServerApp killed and resumed.

Every process the tests start is stopped by PID (with its descendants), and the tests check
that none is left and that the SuperLink's port is free again."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
import torch

from silodp.engines.flower.deployment import descendants
from silodp.ledger.report import verify_ledger

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CONFIG = {
    "name": "deploy",
    # clear aggregation (higradavg_dp) is checked against in-process by the killed-ServerApp
    # test: this file's runs each pay a ClientApp process per silo and message
    "algorithms": ["uldp_avg", "uldp_avg_w"],
    "data": {
        "source": "digits",
        "num_silos": 3,
        "num_subjects": 30,
        "max_records": 300,
        "test_fraction": 0.2,
    },
    # the linear model and 2048-bit keys, the protocol's minimum: the weighting protocol's
    # cost is per parameter and per key bit, and neither changes what is checked here
    "model": {"name": "linear"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.5},
    "privacy": {
        "noise_multiplier": 1.5,
        "group_size": 4,
        "noise": "seeded",
        "n_max": 60,
        "key_bits": 2048,
    },
}
#: long enough for a message round trip on a loaded machine, short enough to wait out twice
#: each wait's limit where every node is alive (a round is far shorter; the margin is for a
#: loaded machine, where each message starts a ClientApp process that imports torch)
TIMEOUT = "180"
#: where a node is killed, each round without it waits this long
DEAD_NODE_TIMEOUT = "45"


def _write(path: Path, **changes) -> Path:
    raw = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        table, _, field = key.partition("__")
        if field:
            raw[table][field] = value
        else:
            raw[table] = value
    path.write_text(tomli_w.dumps(raw))
    return path


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silodp.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _start(log: Path, *args: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "silodp.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(log: Path, text: str, proc: subprocess.Popen, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while text not in log.read_text():
        assert proc.poll() is None, f"ended before {text!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {limit} s"
        time.sleep(0.3)


def _finish(proc: subprocess.Popen, log: Path, limit: float = 900) -> str:
    try:
        proc.wait(timeout=limit)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log.read_text()


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


class Federation:
    def __init__(self, config: Path, directory: Path) -> None:
        self.directory = directory
        up = _cli(
            "federation",
            "up",
            str(config),
            "--silos",
            "3",
            "--directory",
            str(directory),
            timeout=300,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        self.state = json.loads((directory / "federation.json").read_text())

    def pid(self, name: str) -> int:
        return int(self.state["processes"][name])

    def kill(self, pid: int) -> None:
        for p in [pid, *descendants([pid])]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def down(self) -> None:
        started = list(self.state["processes"].values())
        every = started + descendants(started)
        done = _cli("federation", "down", "--directory", str(self.directory), timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _alive(every) == [], f"left running: {_alive(every)}"
        with socket.socket() as s:  # the SuperLink's port is free again
            s.bind(("127.0.0.1", self.state["port"]))


def _on(fed: Federation, timeout: str | None = None) -> list[str]:
    """``silodp run``'s options for the federation ``fed`` (and a ``--timeout``)."""
    timed = ["--timeout", timeout] if timeout is not None else []
    return ["--engine", "flower-deploy", "--federation", str(fed.directory), *timed]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    fed = Federation(_write(root / "c.toml"), root / "federation")
    yield fed
    fed.down()


def test_masked_and_privately_weighted_runs_match_in_process(federation, tmp_path):
    config = _write(tmp_path / "c.toml")
    deployed = _cli(
        "run",
        str(config),
        *_on(federation),
        "--out",
        str(tmp_path / "deploy"),
        "--ledger",
        str(tmp_path / "deploy.sqlite"),
        "--quiet",
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    assert "uldp_avg_w: round 2/2" in deployed.stdout  # the ServerApp's progress, streamed
    local = _cli(
        "run",
        str(config),
        "--out",
        str(tmp_path / "local"),
        "--ledger",
        str(tmp_path / "local.sqlite"),
        "--quiet",
    )
    assert local.returncode == 0, local.stdout + local.stderr
    # --ledger reaches the ServerApp: the shared ledger holds what the in-process one does
    shown = {}
    for where in ("deploy", "local"):
        done = _cli("ledger", "show", str(tmp_path / f"{where}.sqlite"), "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        shown[where] = json.loads(done.stdout)
    assert shown["deploy"]["total"] == shown["local"]["total"]
    assert len(shown["deploy"]["runs"]) == 2
    assert not (tmp_path / "deploy" / "ledger.sqlite").exists()
    # the silos' raw records and the keys are readable by this user only
    for private in ("silos", "pki", "keys"):
        assert (federation.directory / private).stat().st_mode & 0o077 == 0, private
    aggregation = {
        "uldp_avg": "masked sum",
        "uldp_avg_w": "private weighting protocol",
    }
    for algorithm, how in aggregation.items():
        a = torch.load(tmp_path / "local" / algorithm / "model.pt")
        b = torch.load(tmp_path / "deploy" / algorithm / "model.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), algorithm
        sa, sb = (
            json.loads((tmp_path / d / algorithm / "summary.json").read_text())
            for d in ("local", "deploy")
        )
        assert sa["epsilon_by_adversary"] == sb["epsilon_by_adversary"]
        assert sa["epsilon"] == sb["epsilon"]
        assert sb["epsilon_by_adversary"]["released"]["subject"] > 0
        assert sb["aggregation"].startswith(how)


def _serverapps(federation: Federation) -> list[int]:
    found = []
    for pid in descendants([federation.pid("superlink")]):
        try:
            if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def test_killed_server_app_resumes_spending_only_the_round_it_had_begun_again(federation, tmp_path):
    config = _write(tmp_path / "c.toml", algorithms=["higradavg_dp"])
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = _start(
        log,
        "run",
        str(config),
        *_on(federation, TIMEOUT),
        "--out",
        str(out),
    )
    _wait_for(log, "higradavg_dp: round 1/2", proc)
    apps = _serverapps(federation)
    assert len(apps) == 1
    federation.kill(apps[0])
    text = _finish(proc, log)
    assert proc.returncode != 0 and "--resume" in text, text[-2000:]
    resumed = _cli(
        "run",
        "--resume",
        str(out),
        *_on(federation, TIMEOUT),
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    local = _cli("run", str(config), "--out", str(tmp_path / "local"), "--quiet")
    assert local.returncode == 0, local.stdout + local.stderr
    a = torch.load(tmp_path / "local" / "higradavg_dp" / "model.pt")
    b = torch.load(out / "higradavg_dp" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (
        json.loads((d / "higradavg_dp" / "summary.json").read_text())
        for d in (tmp_path / "local", out)
    )
    assert sb["status"] == "complete" and sb["aggregation"].startswith("clear")
    with sqlite3.connect(out / "higradavg_dp" / "ledger.sqlite") as db:
        per_round = dict(db.execute("select round, count(*) from events group by round"))
    # round 1 spent once, by each silo; round 2, if the killed ServerApp had begun it (its
    # silos are charged before its messages leave), counts in full and runs again
    assert per_round in ({1: 3, 2: 3}, {1: 3, 2: 6}), per_round
    if per_round[2] == 3:
        assert sb["epsilon_by_adversary"] == sa["epsilon_by_adversary"]
        assert sb["epsilon"] == sa["epsilon"]
    else:
        assert all(sb["epsilon"][u] > sa["epsilon"][u] for u in sa["epsilon"])
    assert verify_ledger(out / "higradavg_dp" / "ledger.sqlite") == []


def test_ctrl_c_stops_the_run_on_the_federation_too(federation, tmp_path):
    """Ctrl-C stopped only the local ``flwr run``: the ServerApp went on training and
    spending on the SuperLink while the command printed "interrupted" and a resume command
    that then failed (the results directory was still in use)."""
    config = _write(tmp_path / "c.toml", algorithms=["higradavg_dp"], training__rounds=3)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = _start(
        log,
        "run",
        str(config),
        *_on(federation, TIMEOUT),
        "--out",
        str(out),
    )
    _wait_for(log, "higradavg_dp: round 1/3", proc)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    text = _finish(proc, log, limit=300)
    assert proc.returncode == 130, text[-3000:]
    assert "stopped run" in text and "--resume" in text, text[-3000:]
    deadline = time.monotonic() + 120
    while _serverapps(federation) and time.monotonic() < deadline:
        time.sleep(1)
    assert _serverapps(federation) == []
    metrics = out / "higradavg_dp" / "metrics.jsonl"
    kept = metrics.read_text() if metrics.is_file() else ""
    time.sleep(10)  # nothing trains on after the stop
    assert (metrics.read_text() if metrics.is_file() else "") == kept
    assert len(kept.splitlines()) < 3
    ledger = out / "higradavg_dp" / "ledger.sqlite"
    assert verify_ledger(ledger) == []
    resumed = _cli(
        "run",
        "--resume",
        str(out),
        *_on(federation, TIMEOUT),
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((out / "higradavg_dp" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["rounds_completed"] == 3
    # resuming a finished experiment: nothing to do (it failed, "ended without writing")
    again = _cli(
        "run",
        "--resume",
        str(out),
        *_on(federation, TIMEOUT),
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]


def test_killed_supernode_aborts_the_run(federation, tmp_path):
    # the last test on the shared federation: it leaves silo 2's SuperNode dead
    config = _write(tmp_path / "c.toml", algorithms=["higradavg_dp"], training__rounds=3)
    log = tmp_path / "run.log"
    proc = _start(
        log,
        "run",
        str(config),
        *_on(federation, DEAD_NODE_TIMEOUT),
        "--out",
        str(tmp_path / "run"),
        "--on-failure",
        "abort",
    )
    _wait_for(log, "higradavg_dp: round 1/3", proc)
    federation.kill(federation.pid("supernode-2"))
    text = _finish(proc, log)
    assert proc.returncode != 0
    assert f"Round 2: silo 2: no answer within {DEAD_NODE_TIMEOUT} s" in text, text[-3000:]
    # what ran is kept and says so: one round, and the run was not completed
    summary = json.loads((tmp_path / "run" / "higradavg_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 1


def test_killed_supernode_is_skipped(tmp_path):
    config = _write(tmp_path / "c.toml", algorithms=["higradavg_dp"], training__rounds=3)
    fed = Federation(config, tmp_path / "federation")
    try:
        log = tmp_path / "run.log"
        out = tmp_path / "run"
        proc = _start(
            log,
            "run",
            str(config),
            *_on(fed, DEAD_NODE_TIMEOUT),
            "--out",
            str(out),
            "--on-failure",
            "skip",
        )
        _wait_for(log, "higradavg_dp: round 1/3", proc)
        fed.kill(fed.pid("supernode-2"))
        text = _finish(proc, log)
        assert proc.returncode == 0, text[-3000:]
        for r in (2, 3):  # (a slow silo may be skipped too on a loaded machine)
            lines = [x for x in text.splitlines() if f"round {r}: skipping" in x]
            assert any("silo 2: no answer" in x for x in lines), text[-3000:]
        summary = json.loads((out / "higradavg_dp" / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["rounds_completed"] == 3
        rows = (out / "higradavg_dp" / "metrics.jsonl").read_text().splitlines()
        assert [2 in json.loads(x)["silos"] for x in rows] == [True, False, False]
        with sqlite3.connect(out / "higradavg_dp" / "ledger.sqlite") as db:
            spent = sorted(db.execute("select round, party from events"))
        # the dead silo's silence cannot be told from a slow silo's late reply: it is charged
        # its planned events in the rounds it missed, once per round
        assert spent == [(r, f"silo:{s}") for r in (1, 2, 3) for s in range(3)]
    finally:
        fed.down()
