"""Flower's simulation engine (Ray) runs a 10-silo experiment with the in-process numbers."""

from __future__ import annotations

import functools
import json
import sqlite3
import subprocess
import sys
import warnings

import pytest
import tomli_w
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: brings the loopback interface of a fresh network namespace up, then runs argv[1:]
_LOOPBACK_UP = """
import fcntl, os, socket, struct, sys
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    ifreq = fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))  # SIOCGIFFLAGS
    flags = struct.unpack("16sH", ifreq[:18])[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS: IFF_UP
os.execvp(sys.argv[1], sys.argv[1:])
"""


@functools.cache
def _namespace_prefix() -> list[str] | None:
    """How to run a command in a network namespace of its own (only loopback), or ``None``
    where this machine allows none: as root, or as a user mapped to root in a user namespace."""
    import shutil

    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        command = [*prefix, sys.executable, "-c", _LOOPBACK_UP, "true"]
        if subprocess.run(command, capture_output=True, timeout=60).returncode == 0:
            return [*prefix, sys.executable, "-c", _LOOPBACK_UP]
    return None


def _isolated(command: list[str]) -> list[str]:
    """``command`` in a network namespace with only loopback: Ray (the simulation engine)
    listens on every interface (docs/federation.md), so the tests keep its ports unreachable
    from outside. Where no namespace can be made, the command runs as it is, with a warning."""
    prefix = _namespace_prefix()
    if prefix is None:
        warnings.warn(
            "no network namespace on this machine: the Ray simulation's ports listen on every "
            "interface during this test",
            stacklevel=2,
        )
        return command
    return [*prefix, *command]


def test_ten_silo_simulation_matches_in_process(tmp_path):
    raw = {
        "name": "sim10",
        "algorithms": ["uldp_avg"],
        "data": {
            "source": "digits",
            "num_silos": 10,
            "num_subjects": 60,
            "max_records": 600,
            "test_fraction": 0.2,
        },
        "model": {"name": "mlp"},
        "training": {"rounds": 2, "local_steps": 1, "batch_size": 16, "lr": 0.5},
        "privacy": {"noise_multiplier": 1.5, "noise": "seeded", "subject_rate": 0.5},
    }
    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps(raw))
    runs = {}
    for engine in ("inprocess", "flower-sim"):
        out = tmp_path / engine
        command = [
            sys.executable,
            "-m",
            "silodp.cli",
            "run",
            str(config),
            "--out",
            str(out),
            "--engine",
            engine,
            "--ledger",
            str(tmp_path / f"{engine}.sqlite"),
            "--quiet",
        ]
        done = subprocess.run(
            _isolated(command) if engine == "flower-sim" else command,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[engine] = out
    a = torch.load(runs["inprocess"] / "uldp_avg" / "model.pt")
    b = torch.load(runs["flower-sim"] / "uldp_avg" / "model.pt")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    sa, sb = (json.loads((runs[e] / "uldp_avg" / "summary.json").read_text()) for e in runs)
    assert sa["epsilon"] == sb["epsilon"]
    assert sb["aggregation"].startswith("masked sum")
    # the silos' raw records and secrets stay out of --out (they sat in --out/.federation/)
    files = {e: {p.relative_to(runs[e]) for p in runs[e].rglob("*") if p.is_file()} for e in runs}
    assert files["flower-sim"] == files["inprocess"]
    # --ledger reaches the flower-sim run: both ledgers hold the same spending
    totals = {}
    for engine in runs:
        with sqlite3.connect(tmp_path / f"{engine}.sqlite") as db:
            totals[engine] = db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT round) FROM events WHERE kind = 'round'"
            ).fetchone()
    assert totals["flower-sim"] == totals["inprocess"] and totals["inprocess"][1] == 2


def test_sigterm_stops_a_simulation_after_the_round_in_progress(tmp_path):
    """Ray replaced silodp's SIGTERM handler (the process aborted, the run left "running"),
    and Ctrl-C left the ServerApp's thread waiting for replies until --timeout, then charged
    the cut round in full. Now both stop once the round in progress is recorded."""
    import os
    import signal
    import time

    raw = {
        "name": "simstop",
        "algorithms": ["local_item_dp"],
        "data": {"source": "digits", "num_silos": 3, "num_subjects": 30, "max_records": 600},
        "model": {"name": "mlp"},
        "training": {"rounds": 6, "local_steps": 60, "batch_size": 64, "lr": 0.5},
        "privacy": {"noise_multiplier": 1.5, "group_size": 3, "noise": "seeded"},
    }
    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps(raw))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "silodp.cli", "run", str(config), "--out", str(out)]
    command += ["--engine", "flower-sim", "--timeout", "300", "--quiet"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    log = (tmp_path / "run.log").open("w")  # a pipe nobody reads could fill and block it
    proc = subprocess.Popen(_isolated(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics = out / "local_item_dp" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    output = (tmp_path / "run.log").read_text()
    assert proc.returncode == 143, output[-3000:]
    assert time.monotonic() - sent < 200  # not the 300 s exchange timeout
    assert "stopped by SIGTERM" in output and "SIGTERM received" not in output
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    done = len(metrics.read_text().splitlines())
    assert 2 <= done < 6
    with sqlite3.connect(out / "local_item_dp" / "ledger.sqlite") as db:
        rounds = db.execute("SELECT round, status FROM rounds ORDER BY round").fetchall()
    # the round in progress ran to its end and was recorded: nothing open, nothing twice
    assert rounds == [(r, "complete") for r in range(1, done + 1)]
    again = subprocess.run(
        _isolated(
            [sys.executable, "-m", "silodp.cli", "run", "--resume", str(out)]
            + ["--engine", "flower-sim", "--quiet"]
        ),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert json.loads((out / "local_item_dp" / "summary.json").read_text())["status"] == "complete"


def test_the_simulations_run_where_only_loopback_is_reachable() -> None:
    """The commands above run in a namespace whose only interface is loopback, up."""
    if _namespace_prefix() is None:
        pytest.fail("no network namespace could be made on this machine (unshare --net)")
    script = "import socket; print(sorted(name for _, name in socket.if_nameindex()))"
    listed = subprocess.run(
        _isolated([sys.executable, "-c", script]), capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["['lo']"]
    # loopback is up: a connection to a server on it is accepted (down, connect fails)
    probe = (
        "import socket; s = socket.create_server(('127.0.0.1', 0)); "
        "c = socket.create_connection(s.getsockname(), timeout=5); print('ok')"
    )
    bound = subprocess.run(
        _isolated([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60
    )
    assert bound.stdout.split() == ["ok"], bound.stderr
