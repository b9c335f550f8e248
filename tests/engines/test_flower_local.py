"""What the Flower engines' commands do on this machine before (or without) a federation:
which ledger a run writes through, what is refused up front, which processes ``down`` stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from silodp.cli import app
from silodp.engines.flower import deployment, simulation
from silodp.errors import InvalidValueError

CONFIG = {
    "name": "local",
    "algorithms": ["higradavg_dp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 15, "max_records": 120},
    "model": {"name": "mlp"},
    "training": {"rounds": 1, "local_steps": 1, "batch_size": 16, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "group_size": 4},
}


def _config(tmp: Path, **data) -> Path:
    raw = json.loads(json.dumps(CONFIG))
    raw["data"].update(data)
    path = tmp / "c.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def test_ledger_option_reaches_flower_sim(tmp_path, monkeypatch):
    seen = {}

    def simulate(config, out, **kwargs):
        seen["ledger"] = config.privacy.ledger
        return {"name": config.name, "runs": []}

    monkeypatch.setattr(simulation, "simulate", simulate)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(
        app,
        ["run", str(_config(tmp_path)), "--engine", "flower-sim", "--out", "out"]
        + ["--ledger", "shared.sqlite"],
    )
    assert seen.get("ledger") == str(tmp_path / "shared.sqlite"), done.output


def _fake_flwr(monkeypatch) -> list[list[str]]:
    """Replaces `flwr run` by a stand-in that writes nothing; the argument lists it got."""
    launched: list[list[str]] = []

    class Flwr:
        def __init__(self, args, **kwargs):
            launched.append(list(args))
            self.stdout, self.returncode = iter(()), 1

        def wait(self):
            return 1

    monkeypatch.setattr(deployment.subprocess, "Popen", Flwr)
    return launched


def test_ledger_option_reaches_the_server_app(tmp_path, monkeypatch):
    # flower-deploy hands the run to `flwr run`; the ledger travels in its run config
    home = tmp_path / "federation" / "home"
    home.mkdir(parents=True)
    (home / "config.toml").write_text("")
    launched = _fake_flwr(monkeypatch)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(
        app,
        ["run", str(_config(tmp_path)), "--engine", "flower-deploy", "--out", "out"]
        + ["--federation", str(tmp_path / "federation"), "--ledger", "shared.sqlite"],
    )
    assert done.exit_code != 0  # the fake `flwr` wrote no summary
    (args,) = launched
    configs = [args[i + 1] for i, a in enumerate(args) if a == "--run-config"]
    assert f"ledger={json.dumps(str(tmp_path / 'shared.sqlite'))}" in configs
    # and without --ledger the ServerApp keeps the config's own
    launched.clear()
    CliRunner().invoke(
        app,
        ["run", str(_config(tmp_path)), "--engine", "flower-deploy", "--out", "out"]
        + ["--federation", str(tmp_path / "federation")],
    )
    assert not any(a.startswith("ledger=") for a in launched[0])


def test_flower_deploy_refuses_dp_scaling_before_sending_anything(
    tmp_path, monkeypatch, dp_scaled_table
):
    def no_flwr(*args, **kwargs):
        raise AssertionError("nothing may be sent")

    monkeypatch.setattr(deployment.subprocess, "Popen", no_flwr)
    raw = json.loads(json.dumps(CONFIG))
    raw["data"] = dp_scaled_table
    path = tmp_path / "dp.toml"
    path.write_text(tomli_w.dumps(raw))
    with pytest.raises(InvalidValueError, match="scaling other than 'dp'"):
        deployment.submit(path, tmp_path / "out", directory=tmp_path / "nowhere")


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )


def test_down_never_signals_a_process_that_reuses_a_recorded_pid(tmp_path):
    other, ours = _sleeper(), _sleeper()
    try:
        state = {
            "processes": {"superlink": other.pid, "silo-0": ours.pid},
            # `other` stands for an unrelated process that got a recorded PID after a reboot
            "started": {
                "superlink": deployment._start_time(other.pid) - 1,
                "silo-0": deployment._start_time(ours.pid),
            },
        }
        (tmp_path / "federation.json").write_text(json.dumps(state))
        said: list[str] = []
        deployment.down(directory=tmp_path, log=said.append)
        assert ours.wait(timeout=30) is not None
        assert other.poll() is None
        assert "stopped 1 processes" in said[0] and "1 recorded had already ended" in said[0]
    finally:
        for p in (other, ours):
            p.kill()
            p.wait()


def test_server_app_reads_relative_paths_from_the_submitting_directory(tmp_path, monkeypatch):
    # the ServerApp runs where the federation was started; a config's relative ledger (and
    # data) paths must still name the files in the directory `silodp run` was called from,
    # or the run would spend on (and check its budget against) a fresh ledger elsewhere
    from silodp.engines.flower import server

    home = tmp_path / "federation" / "home"
    home.mkdir(parents=True)
    (home / "config.toml").write_text("")
    user = tmp_path / "user"
    (user / "tables").mkdir(parents=True)
    raw = json.loads(json.dumps(CONFIG))
    raw["privacy"]["ledger"] = "shared.sqlite"
    raw["algorithm"] = {"higradavg_dp": {"ledger": "ledgers/own.sqlite"}}
    table = user / "tables" / "t.csv"
    table.write_text("x,label\n" + "".join(f"{i / 10},{i % 2}\n" for i in range(40)))
    raw["data"] = {"source": "table", "path": "tables/t.csv", "label_column": "label"}
    raw["tracking"] = {"mlflow": "sqlite:///runs/mlflow.db", "tensorboard": "runs/tb"}
    (user / "c.toml").write_text(tomli_w.dumps(raw))
    launched = _fake_flwr(monkeypatch)
    monkeypatch.chdir(user)
    CliRunner().invoke(
        app,
        ["run", "c.toml", "--engine", "flower-deploy", "--out", "out"]
        + ["--federation", str(tmp_path / "federation")],
    )
    (args,) = launched
    pairs = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--run-config"]
    run_config = {key: json.loads(value) for key, value in pairs}
    # Flower refuses a run config key the app does not declare ("Invalid run configuration")
    import tomllib

    app_config = tomllib.loads((deployment.APP_DIR / "pyproject.toml").read_text())
    assert set(run_config) <= set(app_config["tool"]["flwr"]["app"]["config"])
    elsewhere = tmp_path / "federation"
    monkeypatch.chdir(elsewhere)  # the ServerApp's working directory
    config = server.submitted_config(run_config)
    assert config.privacy.ledger == str(user / "shared.sqlite")
    assert config.for_algorithm("higradavg_dp")[1].ledger == str(user / "ledgers" / "own.sqlite")
    assert config.data.path == str(table)
    assert config.tracking is not None
    assert config.tracking.mlflow == f"sqlite:///{user / 'runs' / 'mlflow.db'}"
    assert config.tracking.tensorboard == str(user / "runs" / "tb")
    # without the submitting directory, the same config reads them from its own
    del run_config["workdir"]
    with pytest.raises(Exception, match="tables/t.csv"):
        server.submitted_config(run_config)


def test_a_silo_failure_on_flower_sim_names_the_resume_command(tmp_path, monkeypatch):
    # rounds ran and were charged before the failure: not "bad input (nothing trained)"
    from silodp.engines.remote import SiloFailureError

    def simulate(config, out, **kwargs):
        raise SiloFailureError("Round 3: silo 2: no answer within 600 s.")

    monkeypatch.setattr(simulation, "simulate", simulate)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(
        app, ["run", str(_config(tmp_path)), "--engine", "flower-sim", "--out", "out"]
    )
    assert done.exit_code == 4, done.output
    said = " ".join(done.output.split())
    assert "Round 3: silo 2: no answer" in said
    assert "continue with: silodp run --resume out --engine flower-sim" in said


@pytest.mark.parametrize("env", [None, "1"])
def test_telemetry_stays_off_when_flwr_was_imported_first(env):
    """flwr reads FLWR_TELEMETRY_ENABLED once, at import: a process that imported it before
    silodp kept reporting. A user who turns telemetry on keeps it on."""
    import os

    script = (
        "import flwr.supercore.telemetry as t, silodp.engines.flower; "
        "print(t.FLWR_TELEMETRY_ENABLED)"
    )
    environ = {k: v for k, v in os.environ.items() if k != "FLWR_TELEMETRY_ENABLED"}
    if env is not None:
        environ["FLWR_TELEMETRY_ENABLED"] = env
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0" if env is None else env]


@pytest.mark.parametrize("reused", [False, True])
def test_stop_kills_only_a_process_that_runs_since_the_snapshot(reused, monkeypatch):
    """A process that ignores SIGTERM is killed after the grace period; had its PID been
    reused by another process meanwhile, that one was killed instead (no start time kept)."""
    import signal as signals

    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        real = deployment._start_time
        calls: list[int] = []

        def start_time(pid: int) -> int | None:
            calls.append(pid)
            value = real(pid)
            if reused and len(calls) > 1 and value is not None:
                return value + 1  # after the snapshot, the PID names another process
            return value

        monkeypatch.setattr(deployment, "_start_time", start_time)
        deployment.stop_processes([stubborn.pid], grace=0.5)
        if reused:  # not signalled with SIGKILL: still running a while later
            with pytest.raises(subprocess.TimeoutExpired):
                stubborn.wait(timeout=3)
        else:
            assert stubborn.wait(timeout=30) == -signals.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()


def test_the_client_app_imports_nothing_of_the_servers_side():
    # a SuperNode starts one ClientApp process per message: every message pays this import
    import importlib
    import tomllib

    from flwr.serverapp import ServerApp

    components = tomllib.loads((deployment.APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"][
        "app"
    ]["components"]
    module, _, name = components["clientapp"].partition(":")
    server_side = [
        "matplotlib",
        "silodp.engines.factory",
        "silodp.engines.flower.server",
        "silodp.experiment",
        "silodp.plotting",
    ]
    probe = (
        "import importlib, json, sys; "
        f"app = getattr(importlib.import_module({module!r}), {name!r}); "
        "print(type(app).__name__, json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    kind, loaded = done.stdout.split(" ", 1)
    assert kind == "ClientApp"
    assert [m for m in server_side if m in json.loads(loaded)] == []
    module, _, name = components["serverapp"].partition(":")
    assert isinstance(getattr(importlib.import_module(module), name), ServerApp)
