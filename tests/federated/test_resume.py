"""Real ``silodp run`` processes killed with SIGKILL and resumed with ``--resume``.

A seeded run killed at a named point (``SILODP_KILL_AT``) or at a random time and then resumed
ends with the same model, bitwise, as the same run uninterrupted; killed between rounds it
reports the same ε, killed inside a round at least that ε (the cut round's recorded events
count); the ledger verifies; a finished run resumes as a no-op.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
import torch

from silodp.experiment import resume_experiment
from silodp.ledger import Ledger, LedgerError
from silodp.ledger.report import ledger_report, verify_ledger

BASE = {
    "data": {
        "source": "digits",
        "num_silos": 3,
        "num_subjects": 40,
        "max_records": 450,
        "test_fraction": 0.2,
    },
    "model": {"name": "mlp"},
    "training": {"rounds": 3, "local_steps": 2, "batch_size": 16, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "group_size": 4, "noise": "seeded"},
}
EXTRA = {
    "local_item_dp": {},
    "higradavg_dp": {},
    "uldp_avg_w": {  # the linear model, 2 rounds, 20 subjects: the protocol's cost is per
        # parameter and per (silo, subject) pair
        "algorithm": {"uldp_avg_w": {"weighting": "protocol", "key_bits": 2048, "n_max": 60}},
        "data": {"num_subjects": 20},
        "model": {"name": "linear"},
        "training": {"rounds": 2},
    },
    "prifedsync": {"training": {"client_rate": 0.7}},
}


def _config(tmp: Path, name: str, extra: dict | None = None) -> Path:
    raw = json.loads(json.dumps(BASE))
    raw["name"] = f"resume-{name}"
    raw["algorithms"] = [name]
    for key, table in (extra if extra is not None else EXTRA[name]).items():
        raw.setdefault(key, {}).update(table)
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _silodp(
    *args: str, kill_at: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    env.pop("SILODP_KILL_AT", None)
    if kill_at is not None:
        env["SILODP_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "silodp.cli", *args, "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt")


def _same_model(a: Path, b: Path) -> bool:
    x, y = _model(a), _model(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _check_resumed(full: Path, cut: Path, name: str, *, same_epsilon: bool) -> None:
    assert _same_model(full / name, cut / name)
    done, ref = _summary(cut / name), _summary(full / name)
    assert done["status"] == "complete" and done["rounds_completed"] == ref["rounds_completed"]
    released = ref.get("epsilon_by_adversary", {}).get("released", {})
    for unit, value in ref["epsilon"].items():
        got = done["epsilon"][unit]
        if value is None:  # no guarantee against some adversary (uldp_avg_w: the server)
            assert got is None
            value = released[unit]  # then the released model's ε is compared
            got = done["epsilon_by_adversary"]["released"][unit]
        if same_epsilon:
            assert got == pytest.approx(value, rel=1e-12)
        else:
            assert got >= value * (1 - 1e-12)
    rows = [json.loads(line) for line in (cut / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ref["rounds_completed"] + 1))
    ledger = cut / name / "ledger.sqlite"
    assert verify_ledger(ledger) == []
    (run,) = ledger_report(ledger)["runs"]
    assert run["epsilon"].keys() == done["epsilon"].keys()
    for unit, value in done["epsilon"].items():  # None: inf against some adversary
        assert run["epsilon"][unit] == (None if value is None else pytest.approx(value, rel=1e-12))
    assert bool(run["interrupted_rounds"]) == (not same_epsilon)
    assert not set(run["interrupted_rounds"]) & set(run["rounds_run_again"])  # one or other


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXTRA))
def test_killed_runs_resume_to_the_uninterrupted_result(name: str, tmp_path: Path) -> None:
    config = _config(tmp_path, name)
    full = tmp_path / "full"
    assert _silodp("run", str(config), "--out", str(full)).returncode == 0
    last = _summary(full / name)["rounds_completed"]
    for point, at, same in [
        ("silo_recorded", last - 1, False),
        ("checkpoint_written", last, True),  # nothing left to train: only outputs to write
        ("round_written", last - 1, True),
    ]:
        cut = tmp_path / point
        killed = _silodp("run", str(config), "--out", str(cut), kill_at=f"{point}:{at}")
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-500:])
        assert _summary(cut / name)["status"] == "running"
        resumed = _silodp("run", "--resume", str(cut))
        assert resumed.returncode == 0, (point, resumed.stderr[-2000:])
        _check_resumed(full, cut, name, same_epsilon=same)
    if name == "local_item_dp":  # a finished experiment: the same for every algorithm
        again = _silodp("run", "--resume", str(tmp_path / "round_written"))
        assert again.returncode == 0 and "nothing to resume" in again.stdout


@pytest.mark.slow
def test_a_run_killed_in_its_last_round_at_any_point_resumes_to_the_whole_result(
    tmp_path: Path,
) -> None:
    """Killed after its last round's checkpoint and before that round's row, a resumed run
    ended "complete" with that row missing from metrics.jsonl: it had no round left to run,
    and only a run round wrote the rows. That point on the last round is in
    :func:`test_killed_runs_resume_to_the_uninterrupted_result` (every algorithm); here are
    the others."""
    name = "local_item_dp"
    config = _config(tmp_path, name, {"model": {"name": "linear"}, "training": {"rounds": 2}})
    full = tmp_path / "full"
    assert _silodp("run", str(config), "--out", str(full)).returncode == 0
    for point, run_again in [
        ("silo_recorded", [2]),
        ("round_completed", [2]),
        ("round_written", []),
    ]:
        cut = tmp_path / point
        killed = _silodp("run", str(config), "--out", str(cut), kill_at=f"{point}:2")
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-500:])
        resumed = _silodp("run", "--resume", str(cut))
        assert resumed.returncode == 0, (point, resumed.stderr[-2000:])
        assert _same_model(full / name, cut / name), point
        done, ref = _summary(cut / name), _summary(full / name)
        assert done["status"] == "complete" and done["rounds_completed"] == 2, point
        rows = (cut / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["round"] for r in rows] == [1, 2], point
        assert (cut / name / "accuracy_loss.png").is_file(), point
        (run,) = ledger_report(cut / name / "ledger.sqlite")["runs"]
        assert sorted(run["interrupted_rounds"] + run["rounds_run_again"]) == run_again, point
        for unit, value in ref["epsilon"].items():  # a round run again counts twice
            assert done["epsilon"][unit] == pytest.approx(value, rel=1e-12) or (
                run_again and done["epsilon"][unit] > value
            ), (point, unit)


@pytest.mark.slow
def test_random_time_kills_resume_to_the_same_model(tmp_path: Path) -> None:
    config = _config(tmp_path, "local_item_dp")
    full = tmp_path / "full"
    assert _silodp("run", str(config), "--out", str(full)).returncode == 0
    rng = random.Random(7)
    cut = tmp_path / "cut"
    env = {**os.environ}
    env.pop("SILODP_KILL_AT", None)
    args = [sys.executable, "-m", "silodp.cli", "run", str(config), "--out", str(cut), "--quiet"]
    for attempt in range(3):
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(3.0, 9.0))
        proc.send_signal(signal.SIGKILL)  # this process, by its PID
        proc.wait(timeout=60)
        if attempt == 0 and not (cut / "experiment.toml").is_file():
            continue  # killed before anything was written: start again
        args = [sys.executable, "-m", "silodp.cli", "run", "--resume", str(cut), "--quiet"]
    if not (cut / "experiment.toml").is_file():
        args = [
            sys.executable,
            "-m",
            "silodp.cli",
            "run",
            str(config),
            "--out",
            str(cut),
            "--quiet",
        ]
    finished = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert _same_model(full / "local_item_dp", cut / "local_item_dp")
    assert verify_ledger(cut / "local_item_dp" / "ledger.sqlite") == []


def test_resume_refuses_a_changed_config_and_a_missing_experiment(tmp_path: Path) -> None:
    from silodp.config import load_config
    from silodp.errors import InvalidValueError
    from silodp.experiment import resume_experiment, run_experiment

    config = _config(tmp_path, "local_item_dp")
    out = tmp_path / "out"
    run_experiment(load_config(config), out)
    summary = out / "local_item_dp" / "summary.json"
    summary.write_text(summary.read_text().replace('"complete"', '"running"'))
    top = out / "summary.json"
    top.write_text(top.read_text().replace('"complete"', '"running"'))
    text = (out / "experiment.toml").read_text()
    (out / "experiment.toml").write_text(text.replace("rounds = 3", "rounds = 5"))
    with pytest.raises(InvalidValueError, match="changed"):
        resume_experiment(out)
    with pytest.raises(InvalidValueError, match="no experiment.toml"):
        resume_experiment(tmp_path / "nothing")


def test_a_checkpoint_of_other_code_is_refused(tmp_path: Path) -> None:
    from silodp.errors import InvalidValueError
    from silodp.experiment.checkpoint import CHECKPOINT, code_version, load_checkpoint

    state = {
        "round": 1,
        "engine": {},
        "rows": ([], []),
        "config_hash": "abc",
        "version": "0.0.1+000000000000",
    }
    # where earlier versions wrote it: read, and refused (not silently restarted)
    torch.save(state, tmp_path / "checkpoint.pt")
    with pytest.raises(InvalidValueError, match="written by silodp"):
        load_checkpoint(tmp_path, "abc")
    (tmp_path / "checkpoint.pt").unlink()
    (tmp_path / CHECKPOINT).parent.mkdir()
    torch.save(state, tmp_path / CHECKPOINT)
    with pytest.raises(InvalidValueError, match="written by silodp"):
        load_checkpoint(tmp_path, "abc")
    torch.save({**state, "version": code_version()}, tmp_path / CHECKPOINT)
    assert load_checkpoint(tmp_path, "abc")["round"] == 1
    with pytest.raises(InvalidValueError, match="config changed"):
        load_checkpoint(tmp_path, "other")


# --- a ledger that holds less than the checkpoint ---------------------------------------

INTEGRITY = "local_item_dp"


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a run of 3 rounds left alone, the same run killed after round 2's checkpoint)."""
    tmp = tmp_path_factory.mktemp("cut")
    config = _config(tmp, INTEGRITY)
    full = tmp / "full"
    assert _silodp("run", str(config), "--out", str(full)).returncode == 0
    killed = tmp / "killed"
    proc = _silodp("run", str(config), "--out", str(killed), kill_at="checkpoint_written:2")
    assert proc.returncode < 0, proc.stderr[-500:]
    return full, killed


def _copy(killed: Path, tmp: Path) -> Path:
    out = tmp / "copy"
    shutil.copytree(killed, out)
    return out


def _sql(ledger: Path, *statements: str) -> None:
    with sqlite3.connect(ledger) as db:
        for statement in statements:
            db.execute(statement)
    db.close()


def _lose_all(ledger: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)


def _empty(ledger: Path) -> None:
    _lose_all(ledger)
    ledger.write_bytes(b"")


def _lose_wal(ledger: Path) -> None:
    # a killed writer's rows sit in the -wal file: the main file alone has no tables
    for suffix in ("-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)


def _raise_sigma(ledger: Path) -> None:
    _sql(
        ledger,
        "UPDATE events SET privacy = replace(privacy, '\"noise_multiplier\": 1.5', "
        "'\"noise_multiplier\": 9.5')",
    )


def _drop_last_round(ledger: Path) -> None:
    _sql(ledger, "DELETE FROM events WHERE round = 2", "DELETE FROM rounds WHERE round = 2")


def _drop_round_row(ledger: Path) -> None:
    _sql(ledger, "DELETE FROM rounds WHERE round = 2")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_lose_all, "missing, empty or holds no tables"),
        (_empty, "missing, empty or holds no tables"),
        (_lose_wal, "no tables"),  # it registered: refused by the ledger check itself
        (_raise_sigma, "to verify"),
        (_drop_last_round, r"round\(s\) \[2\] are not"),
        (_drop_round_row, "no record of their round"),
    ],
    ids=["deleted", "emptied", "wal-lost", "sigma-raised", "last-round-deleted", "orphan-events"],
)
def test_resume_refuses_a_ledger_that_holds_less_than_the_checkpoint(
    cut: tuple[Path, Path], tmp_path: Path, damage, message: str
) -> None:
    out = _copy(cut[1], tmp_path)
    ledger = out / INTEGRITY / "ledger.sqlite"
    damage(ledger)
    with pytest.raises(LedgerError, match=message):
        resume_experiment(out, log=lambda m: None)
    assert _summary(out / INTEGRITY)["status"] == "running"  # nothing was trained or overwritten


def _replace_by_a_new_ledger(ledger: Path) -> None:
    _lose_all(ledger)
    with Ledger(ledger):
        pass


def _replace_by_another_runs_ledger(ledger: Path) -> None:
    """A ledger whose run 1 is another run (another name and config)."""
    with Ledger(ledger, read_only=True) as held:
        spec = held.runs()[0].accountant
    _lose_all(ledger)
    with Ledger(ledger) as other:
        other.open_run(
            name="another", algorithm="local_item_dp", accountant=spec, noise={}, config_hash="x"
        )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_lose_all, "registered there as run 1"),
        (_empty, "registered there as run 1"),
        (_replace_by_a_new_ledger, r"record run 1 \('local_item_dp'\)"),
        (_replace_by_another_runs_ledger, r"none of that name and config under that id"),
    ],
    ids=["deleted", "emptied", "replaced", "replaced-same-id"],
)
def test_resume_refuses_a_lost_ledger_of_a_run_killed_before_its_first_checkpoint(
    tmp_path: Path, damage, message: str
) -> None:
    """Killed once round 1's events were recorded, before any checkpoint: a lost ledger was
    replaced by a new one, and round 1's spending went uncounted."""
    config = _config(tmp_path, INTEGRITY)
    out = tmp_path / "killed"
    proc = _silodp("run", str(config), "--out", str(out), kill_at="silo_recorded:1")
    assert proc.returncode < 0, proc.stderr[-500:]
    damage(out / INTEGRITY / "ledger.sqlite")
    with pytest.raises(LedgerError, match=message):
        resume_experiment(out, log=lambda m: None)
    assert not (out / INTEGRITY / "model.pt").exists()


def test_an_intact_ledger_resumes_to_the_uninterrupted_run(
    cut: tuple[Path, Path], tmp_path: Path
) -> None:
    out = _copy(cut[1], tmp_path)
    resume_experiment(out, log=lambda m: None)
    full = cut[0]
    a, b = torch.load(full / INTEGRITY / "model.pt"), torch.load(out / INTEGRITY / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _summary(out / INTEGRITY)["epsilon"] == _summary(full / INTEGRITY)["epsilon"]
    assert verify_ledger(out / INTEGRITY / "ledger.sqlite") == []


def test_a_run_killed_while_writing_its_outputs_resumes(tmp_path: Path) -> None:
    # the ledger says the run finished; its plots and summary were never written
    config = _config(tmp_path, INTEGRITY)
    out = tmp_path / "out"
    proc = _silodp("run", str(config), "--out", str(out), kill_at="run_recorded:3")
    assert proc.returncode < 0, proc.stderr[-500:]
    assert _summary(out / INTEGRITY)["status"] == "running"
    assert not (out / INTEGRITY / "accuracy_loss.png").exists()
    resumed = _silodp("run", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    done = _summary(out / INTEGRITY)
    assert done["status"] == "complete" and done["rounds_completed"] == 3
    assert (out / INTEGRITY / "accuracy_loss.png").is_file()
    (run,) = ledger_report(out / INTEGRITY / "ledger.sqlite")["runs"]
    assert run["status"] == "complete" and run["rounds"] == 3 and not run["interrupted_rounds"]
    assert run["epsilon"] == pytest.approx(done["epsilon"], rel=1e-12)


def test_a_run_killed_outright_leaves_a_summary_of_the_rounds_it_completed(
    tmp_path: Path,
) -> None:
    """summary.json was written once, at the start: after a kill -9 it said 0 rounds and no
    ε while metrics.jsonl and the ledger held the rounds run."""
    config = _config(tmp_path, INTEGRITY)
    out = tmp_path / "out"
    proc = _silodp("run", str(config), "--out", str(out), kill_at="round_written:2")
    assert proc.returncode < 0, proc.stderr[-500:]
    written = _summary(out / INTEGRITY)
    rows = [json.loads(r) for r in (out / INTEGRITY / "metrics.jsonl").read_text().splitlines()]
    assert written["status"] == "running" and written["rounds_completed"] == len(rows) == 2
    assert written["epsilon"] == rows[-1]["epsilon"] and written["epsilon"]["record"] > 0


def test_a_round_the_ledger_closed_before_its_checkpoint_is_listed_as_run_again(
    tmp_path: Path,
) -> None:
    """Killed after the ledger closed round 2 and before its checkpoint: the resume runs round
    2 again and both attempts count, but `ledger show` listed no such round."""
    config = _config(tmp_path, INTEGRITY)
    out = tmp_path / "out"
    proc = _silodp("run", str(config), "--out", str(out), kill_at="round_completed:2")
    assert proc.returncode < 0, proc.stderr[-500:]
    assert _silodp("run", "--resume", str(out)).returncode == 0
    (run,) = ledger_report(out / INTEGRITY / "ledger.sqlite")["runs"]
    assert run["rounds_run_again"] == [2] and run["interrupted_rounds"] == []
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "silodp.cli",
            "ledger",
            "show",
            str(out / INTEGRITY / "ledger.sqlite"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "rounds run more than once (every attempt counted in full): [2]" in shown.stdout


def test_a_stop_before_a_rounds_row_is_written_leaves_summary_and_metrics_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after a round was counted and before metrics.jsonl was rewritten left a summary
    of 3 rounds beside 2 rows (a timing seen in CI); the stop now writes both alike."""
    from silodp.config import load_config
    from silodp.experiment import record, run_experiment

    config = load_config(_config(tmp_path, "local_item_dp"))
    out = tmp_path / "out"
    write_jsonl = record.write_jsonl
    calls: list[Path] = []

    def stop_at_round_3(path: Path, rows: object) -> Path:
        calls.append(path)
        if path.name == "metrics.jsonl" and len(rows) == 3 and len(calls) < 10:  # type: ignore[arg-type]
            calls.extend([path] * 10)  # once
            raise KeyboardInterrupt
        return write_jsonl(path, rows)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(record, "write_jsonl", stop_at_round_3)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, out, log=lambda m: None)
    cut = _summary(out / "local_item_dp")
    rows = (out / "local_item_dp" / "metrics.jsonl").read_text().splitlines()
    assert cut["status"] == "interrupted" and cut["rounds_completed"] == len(rows) == 3
    resume_experiment(out, log=lambda m: None)
    assert _summary(out / "local_item_dp")["status"] == "complete"


def test_a_stop_while_writing_the_outputs_leaves_an_interrupted_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the last round, while the figures were written, left summary.json at
    "running" with 0 rounds and no ε, although every round was kept and spent."""
    from silodp.config import load_config
    from silodp.experiment import run_experiment

    config = load_config(_config(tmp_path, "local_item_dp"))
    out = tmp_path / "out"

    def stop(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("silodp.experiment.run.plotting.plot_training", stop)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, out, log=lambda m: None)
    cut = _summary(out / "local_item_dp")
    assert cut["status"] == "interrupted" and cut["rounds_completed"] == 3
    assert cut["epsilon"]["record"] > 0
    resume_experiment(out, log=lambda m: None)
    done = _summary(out / "local_item_dp")
    assert done["status"] == "complete" and done["epsilon"] == cut["epsilon"]


def test_an_experiment_written_by_an_older_version_resumes(tmp_path: Path) -> None:
    """experiment.toml of older versions holds num_features = 20 and num_classes = 4 for every
    source (defaults then); for digits these are now refused, and resuming said so."""
    from silodp.config import load_config

    path = tmp_path / "experiment.toml"
    raw = json.loads(json.dumps(BASE))
    raw.update(name="old", algorithms=["local_item_dp"])
    raw["data"].update(num_features=20, num_classes=4)
    path.write_text(tomli_w.dumps(raw))
    with pytest.raises(Exception, match="Expected num_features unset"):
        load_config(path)
    assert load_config(path, written=True).data.num_classes is None


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_lost_or_unreadable_checkpoint_is_refused_before_anything_trains(
    tmp_path: Path, damage: str
) -> None:
    """A checkpoint removed while the ledger held rounds 1-2 complete: the resume started again
    at round 1 and spent on those rounds twice, saying nothing. A truncated one ended in a
    traceback."""
    config = _config(tmp_path, INTEGRITY)
    out = tmp_path / "out"
    proc = _silodp("run", str(config), "--out", str(out), kill_at="checkpoint_written:2")
    assert proc.returncode < 0, proc.stderr[-500:]
    checkpoint = out / INTEGRITY / "silo_private" / "checkpoint.pt"
    if damage == "removed":
        checkpoint.unlink()
    else:
        checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    ledger = out / INTEGRITY / "ledger.sqlite"
    before = ledger_report(ledger)["runs"][0]
    resumed = _silodp("run", "--resume", str(out))
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr
    if damage == "removed":
        assert "Expected a checkpoint" in resumed.stderr and "up to round 2" in resumed.stderr
    else:
        assert "cannot be read" in resumed.stderr and str(checkpoint) in resumed.stderr
    after = ledger_report(ledger)["runs"][0]
    assert after["events"] == before["events"] and after["rounds"] == before["rounds"] == 2


def test_a_relative_shared_ledger_is_the_same_file_wherever_the_run_resumes(
    tmp_path: Path,
) -> None:
    """``--ledger shared.sqlite`` is written into the experiment as an absolute path: resumed
    from another directory, the run goes on spending on the ledger it registered in (it
    used to start a new one there, outside the first one's budget). A registration in
    another file than the config names is refused."""
    config = _config(tmp_path, INTEGRITY)
    first, other = tmp_path / "w1", tmp_path / "w2"
    first.mkdir()
    other.mkdir()
    out = tmp_path / "killed"
    args = ("run", str(config), "--out", str(out), "--ledger", "shared.sqlite")
    proc = _silodp(*args, kill_at="silo_recorded:1", cwd=first)
    assert proc.returncode < 0, proc.stderr[-500:]
    written = (out / "experiment.toml").read_text()
    assert f'ledger = "{first / "shared.sqlite"}"' in written
    # as an older silodp wrote it: relative, read from the resuming directory
    tomls = {p: p.read_text() for p in out.rglob("*.toml")}
    for p, text in tomls.items():
        p.write_text(text.replace(f"{first}/", ""))
    refused = _silodp("run", "--resume", str(out), cwd=other)
    assert refused.returncode != 0 and "registered in" in refused.stdout + refused.stderr
    assert not (other / "shared.sqlite").exists()
    for p, text in tomls.items():
        p.write_text(text)
    resumed = _silodp("run", "--resume", str(out), cwd=other)
    assert resumed.returncode == 0, resumed.stdout[-500:] + resumed.stderr[-500:]
    assert not (other / "shared.sqlite").exists()
    (run,) = ledger_report(first / "shared.sqlite")["runs"]
    assert run["rounds"] == 4 and run["interrupted_rounds"] == [1]  # round 1 cut, run again


def _fedavg_killed_before_its_release(tmp_path: Path) -> tuple[dict, Path, Path]:
    """fedavg run on a shared ledger in a process killed after registering its run and
    before recording its no-noise release: (its config, the ledger, its results)."""
    raw = json.loads(json.dumps(BASE))
    raw.update(name="no-noise", algorithms=["fedavg"])
    config = tmp_path / "fedavg.toml"
    config.write_text(tomli_w.dumps(raw))
    shared, out = tmp_path / "shared.sqlite", tmp_path / "killed"
    script = (
        "import os, signal, sys\n"
        "import silodp.ledger.run as lr\n"
        "lr.RunLedger.record_release = lambda self, r: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from silodp.cli import app\n"
        f"sys.argv = ['silodp', 'run', {str(config)!r}, '--out', {str(out)!r}, "
        f"'--ledger', {str(shared)!r}, '--quiet']\n"
        "app()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-500:]
    return raw, shared, out


def test_a_run_without_noise_stopped_before_its_release_was_recorded_records_it_on_resume(
    tmp_path: Path,
) -> None:
    """fedavg on a shared ledger, killed after registering and before its no-noise release
    was recorded: the resume trained and published the model with the release never
    recorded, and a budgeted run was then let onto the ledger."""
    from silodp.config import parse_config
    from silodp.experiment import run_experiment
    from silodp.ledger import BudgetExceededError

    raw, shared, out = _fedavg_killed_before_its_release(tmp_path)
    resume_experiment(out, log=lambda m: None)
    assert (out / "fedavg" / "model.pt").is_file()
    with Ledger(shared, read_only=True) as ledger:
        (run,) = ledger.runs()
        assert [kind for _, _, _, kind, _ in ledger.events(run.id)] == ["release"]
    raw["algorithms"] = ["local_item_dp"]
    raw["privacy"] = {**raw["privacy"], "ledger": str(shared), "budget": {"record": 1000.0}}
    with pytest.raises(BudgetExceededError, match="record"):
        run_experiment(parse_config(raw), tmp_path / "next")


def test_a_run_without_noise_resumed_onto_a_ledger_budgeted_since_is_refused(
    tmp_path: Path,
) -> None:
    """fedavg on a shared ledger, killed before its no-noise release was recorded; a run then
    declared a budget there (the killed run had spent nothing yet). Resuming must not record
    the release (ε = inf) past that budget."""
    from silodp.config import parse_config
    from silodp.errors import SilodpError
    from silodp.experiment import run_experiment

    raw, shared, out = _fedavg_killed_before_its_release(tmp_path)
    budgeted = json.loads(json.dumps(raw))
    budgeted["algorithms"] = ["local_item_dp"]
    budgeted["privacy"] = {
        **raw["privacy"],
        "ledger": str(shared),
        "budget": {"record": 1000.0, "subject": 1000.0},
    }
    run_experiment(parse_config(budgeted), tmp_path / "budgeted", log=lambda m: None)
    with pytest.raises(SilodpError, match="record|subject"):
        resume_experiment(out, log=lambda m: None)
    assert not (out / "fedavg" / "model.pt").exists()
    with Ledger(shared, read_only=True) as ledger:
        fedavg = next(r for r in ledger.runs() if r.name == "fedavg")
        assert ledger.events(fedavg.id) == []


def test_a_run_stopped_while_its_ledger_was_created_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop while the ledger's schema was created left an SQLite file with no tables, and
    every resume then failed ("an SQLite database with no tables"): such a file holds no
    spending, so the run resumes from its start."""
    from silodp.config import load_config
    from silodp.experiment import run_experiment
    from silodp.ledger.store import is_blank_ledger

    out = tmp_path / "out"

    def stopped(self: Ledger) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "_migrate", stopped)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(load_config(_config(tmp_path, INTEGRITY)), out, log=lambda m: None)
    ledger = out / INTEGRITY / "ledger.sqlite"
    assert ledger.stat().st_size > 0 and is_blank_ledger(ledger)
    # a run that registered (here: in the ledger of the directory it was moved from) may have
    # recorded spending there whose rows are lost: its blank ledger is refused
    registration = out / INTEGRITY / "ledger_run.json"
    registration.write_text(json.dumps({"ledger": "/elsewhere/ledger.sqlite", "run_id": 1}))
    with pytest.raises(LedgerError, match="no tables"):
        resume_experiment(out, log=lambda m: None)
    registration.unlink()
    resume_experiment(out, log=lambda m: None)
    assert _summary(out / INTEGRITY)["status"] == "complete"
    assert verify_ledger(ledger) == []
    assert not is_blank_ledger(ledger)
