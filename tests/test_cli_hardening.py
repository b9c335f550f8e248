"""The command line as a new user meets it: unwritable --out, Ctrl-C, a fast --help, progress
and warnings in log files, and options that are refused instead of clamped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from silodp.cli import LAZY_COMMANDS, app
from silodp.errors import InvalidValueError

runner = CliRunner()

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


def _config(
    path: Path, *, algorithms: tuple[str, ...], rounds: int, privacy: str, extra: str = ""
) -> Path:
    path.write_text(
        f'name = "t"\nalgorithms = {json.dumps(list(algorithms))}\n'
        '[data]\nsource = "digits"\nnum_silos = 3\nnum_subjects = 40\nallocation = "uniform"\n'
        'seed = 0\n[model]\nname = "mlp"\n'
        f"[training]\nrounds = {rounds}\nlocal_steps = 2\nbatch_size = 64\nlr = 0.5\nseed = 0\n"
        f"[privacy]\n{privacy}\n{extra}"
    )
    return path


def _no_traceback(result: Any) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output


def _forbid_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes loading a config (the first slow step of a run) fail the test."""

    def slow(*args: object, **kwargs: object) -> None:
        raise AssertionError("the config was loaded before --out was checked")

    monkeypatch.setattr("silodp.config.load_config", slow)


# --- 1. --out that cannot be written: refused before anything slow, nothing written ---------


def test_out_under_a_regular_file_is_refused_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _forbid_loading(monkeypatch)
    result = runner.invoke(app, ["run", str(SMOKE), "--out", str(blocker / "results")])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    line = next(ln for ln in result.output.splitlines() if ln.startswith("error: "))
    assert str(blocker / "results") in line and "regular file" in line
    assert blocker.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_out_that_is_a_regular_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "results"
    blocker.write_text("x")
    _forbid_loading(monkeypatch)
    result = runner.invoke(app, ["run", str(SMOKE), "--out", str(blocker)])
    assert result.exit_code == 2
    _no_traceback(result)
    assert f"error: Expected --out {str(blocker)!r} to be a directory; it is a regular file" in (
        result.output
    )


def test_out_in_a_directory_without_write_permission_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        try:
            (locked / "probe").touch()
        except PermissionError:
            pass
        else:  # root writes anyway; the regular-file cases above cover root
            pytest.skip("this user can write in a mode-0o500 directory (root)")
        _forbid_loading(monkeypatch)
        result = runner.invoke(app, ["run", str(SMOKE), "--out", str(locked / "results")])
        assert result.exit_code == 2
        _no_traceback(result)
        assert "error: Expected --out" in result.output and "writable" in result.output
        assert not (locked / "results").exists() and not list(locked.iterdir())
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_out_where_even_root_cannot_create_files_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_loading(monkeypatch)
    result = runner.invoke(app, ["run", str(SMOKE), "--out", "/proc/silodp-results/run"])
    assert result.exit_code == 2
    _no_traceback(result)
    assert "error: Expected --out '/proc/silodp-results/run' to be a writable directory" in (
        result.output
    )


def test_run_experiment_checks_out_dir_before_loading_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from silodp.config import load_config
    from silodp.experiment import run_experiment

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("data loaded before out_dir was checked")

    monkeypatch.setattr("silodp.experiment.run.build_federated_data", no_data)
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(InvalidValueError, match="regular file"):
        run_experiment(load_config(SMOKE), blocker / "out")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume", "{tmp}/missing"], "Expected --resume '{tmp}/missing' to be the results"),
        (["--ledger", "{tmp}/f/ledger.sqlite"], "Expected --ledger's directory '{tmp}/f'"),
        (["{tmp}", "--out", "{tmp}/o"], "Expected CONFIG '{tmp}' to be an experiment TOML file"),
    ],
)
def test_run_paths_are_checked_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    (tmp_path / "f").write_text("")
    _forbid_loading(monkeypatch)
    result = runner.invoke(app, ["run", *(a.format(tmp=tmp_path) for a in args)])
    assert result.exit_code == 2
    _no_traceback(result)
    assert "error: " + message.format(tmp=tmp_path) in result.output
    assert not (tmp_path / "o").exists()


# --- 2. Ctrl-C: what was kept, and the command that continues ------------------------------


def _stop_after_rounds(
    config: Path,
    out: Path,
    rounds: int,
    stop: signal.Signals,
    meanwhile: Callable[[int], None] | None = None,
    args: Sequence[str] = (),
) -> tuple[subprocess.Popen[str], str]:
    """Starts ``silodp run`` (with ``args``), sends it ``stop`` (by its PID) once fedavg wrote
    ``rounds`` rounds (after calling ``meanwhile`` with its PID); the process and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "silodp.cli", "run", str(config), "--out", str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background job may inherit SIGINT ignored; a user's terminal delivers it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = out / "fedavg" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= rounds):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run wrote no rounds"
        time.sleep(0.02)
    try:
        if meanwhile is not None:
            meanwhile(proc.pid)
    finally:
        proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr
    return proc, stderr


def _rounds_kept(stderr: str) -> int:
    kept = next(ln for ln in stderr.splitlines() if ln.startswith("  fedavg: "))
    return int(kept.split("interrupted, ")[1].split(" of 40 rounds checkpointed")[0])


#: σ = 0: the private algorithm runs as a baseline (no accounting)
NO_NOISE = "noise_multiplier = 0.0\ndelta = 1e-5\nclip = 1.0\ngroup_size = 3"


def test_sigint_during_a_run_says_what_was_kept_and_resume_completes(tmp_path: Path) -> None:
    config = _config(
        tmp_path / "c.toml",
        algorithms=("fedavg", "local_item_dp"),
        rounds=40,
        privacy=NO_NOISE,
        extra="[algorithm.local_item_dp]\nrounds = 2\n",
    )
    out = tmp_path / "out"
    proc, stderr = _stop_after_rounds(config, out, 3, signal.SIGINT)
    assert proc.returncode == 130, stderr[-2000:]
    assert f"interrupted: stopped by Ctrl-C; kept in {out}/" in stderr
    assert 3 <= _rounds_kept(stderr) < 40
    assert "  local_item_dp: not started" in stderr
    assert stderr.rstrip().endswith(f"continue with: silodp run --resume {out}")
    # started again without --resume: refused, and told how to continue
    again = runner.invoke(app, ["run", str(config), "--out", str(out), "--quiet"])
    assert again.exit_code == 2 and f"silodp run --resume {out}" in again.output

    resumed = runner.invoke(app, ["run", "--resume", str(out), "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    for name, planned in (("fedavg", 40), ("local_item_dp", 2)):
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["rounds_completed"] == planned
        rows = [json.loads(r) for r in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == list(range(1, planned + 1))


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path: Path) -> None:
    config = _config(tmp_path / "c.toml", algorithms=("fedavg",), rounds=40, privacy=NO_NOISE)
    out = tmp_path / "out"
    proc, stderr = _stop_after_rounds(config, out, 2, signal.SIGTERM)
    assert proc.returncode == 143, stderr[-2000:]
    assert f"interrupted: stopped by SIGTERM; kept in {out}/" in stderr
    rounds = _rounds_kept(stderr)
    assert 2 <= rounds < 40
    assert stderr.rstrip().endswith(f"continue with: silodp run --resume {out}")
    summary = json.loads((out / "fedavg" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == rounds


def test_a_second_run_on_a_live_run_s_out_is_refused_and_removes_nothing(tmp_path: Path) -> None:
    """--overwrite on the --out of a run still training used to remove that run's files (and
    set its ledger aside) under it: the results directory is locked while a run writes it."""
    first = _config(tmp_path / "a.toml", algorithms=("fedavg",), rounds=2, privacy=NO_NOISE)
    live = _config(tmp_path / "b.toml", algorithms=("fedavg",), rounds=40, privacy=NO_NOISE)
    out = tmp_path / "out"
    assert runner.invoke(app, ["run", str(first), "--out", str(out), "--quiet"]).exit_code == 0
    refusals: list[str] = []

    def others(pid: int) -> None:
        for cmd in (
            ["run", str(first), "--out", str(out), "--quiet", "--overwrite"],
            ["run", "--resume", str(out), "--quiet"],
        ):
            result = runner.invoke(app, cmd)
            assert result.exit_code == 2, result.output
            assert f"another silodp run (process {pid}) is writing there" in result.output
            refusals.append(result.output)

    # the live run replaces the finished one (3 rounds: more than the first one wrote)
    proc, stderr = _stop_after_rounds(live, out, 3, signal.SIGINT, others, ["--overwrite"])
    assert proc.returncode == 130, stderr[-2000:]
    assert len(refusals) == 2
    summary = json.loads((out / "fedavg" / "summary.json").read_text())
    # stopped while training, or (fedavg is fast) while writing its figures after its rounds
    assert summary["status"] == "interrupted" and summary["rounds_completed"] >= 3
    rows = [json.loads(r) for r in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, summary["rounds_completed"] + 1))
    assert not (out / ".silodp-run.lock").exists()  # released when it stopped
    resumed = runner.invoke(app, ["run", "--resume", str(out), "--quiet"])
    assert resumed.exit_code == 0, resumed.output


def test_ctrl_c_before_any_round_says_to_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("silodp.experiment.run_experiment", interrupted)
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(SMOKE), "--out", str(out)])
    assert result.exit_code == 130
    _no_traceback(result)
    assert "before any round completed" in result.output
    assert f"start again with: silodp run {SMOKE} --out {out}" in result.output


# --- 3. --help imports nothing heavy ---------------------------------------------------------

HEAVY = ("torch", "dp_accounting", "flwr", "matplotlib", "pandas", "silodp.experiment")


@pytest.mark.parametrize("argv", [None, ["--help"], ["run", "--help"], ["ledger", "--help"]])
def test_the_cli_and_its_help_import_no_heavy_module(argv: list[str] | None) -> None:
    code = "import sys\nimport silodp.cli\n"
    if argv is not None:
        code += (
            f"try:\n    silodp.cli.app({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
        )
    code += f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]
    if argv == ["--help"]:
        assert "account" in done.stdout and "bench" in done.stdout


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_help_lists_lazy_commands_by_their_own_help(name: str) -> None:
    from silodp.cli import _load

    command = _load(name)
    first = (command.help or "").split("\n\n")[0]
    assert " ".join(first.split()) == LAZY_COMMANDS[name][2]
    result = runner.invoke(app, [name, "--help"], prog_name="silodp")
    assert result.exit_code == 0 and "Usage: silodp " + name in " ".join(result.output.split())


# --- 4. progress in a log file: plain lines, no redraws --------------------------------------


def test_progress_is_one_plain_line_per_round_when_stderr_is_not_a_terminal(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path / "c.toml",
        algorithms=("fedavg",),
        rounds=3,
        privacy="noise_multiplier = 0.0\ndelta = 1e-5\nclip = 1.0",
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "\r" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("fedavg: round ")]
    assert [ln.split(",")[0] for ln in lines] == [f"fedavg: round {r}/3" for r in (1, 2, 3)]
    assert all("acc=" in ln for ln in lines)


def test_plain_progress_of_a_long_run_prints_every_few_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from silodp.cli.common import progress

    update = progress("fedavg", 1000)
    for r in range(1, 1001):
        update({"round": r, "test_accuracy": 0.5, "epsilon": {}})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "fedavg: round 1/1000, acc=0.500"
    assert lines[-1] == "fedavg: round 1000/1000, acc=0.500"
    assert 100 <= len(lines) <= 102


# --- 5. warnings: one format, each once ------------------------------------------------------


def test_warnings_print_once_as_warning_lines(tmp_path: Path) -> None:
    # no group_size: every algorithm warns that the bound comes from the data (σ = 0 keeps
    # the runs quick: the bound is resolved all the same)
    config = _config(
        tmp_path / "c.toml",
        algorithms=("local_item_dp", "local_group_dp"),
        rounds=1,
        privacy="noise_multiplier = 0.0\ndelta = 1e-5\nclip = 1.0",
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    warned = [ln for ln in result.stderr.splitlines() if "group_size is not set" in ln]
    assert len(warned) == 1 and warned[0].startswith("warning: privacy.group_size is not set")
    assert "WARNING:" not in result.stderr and "silodp.experiment" not in result.stderr


def test_a_group_size_taken_from_the_data_by_name_is_warned_of(tmp_path: Path) -> None:
    config = _config(
        tmp_path / "c.toml",
        algorithms=("uldp_group",),
        rounds=1,
        privacy='noise_multiplier = 0.0\ndelta = 1e-5\nclip = 1.0\ngroup_size = "median"',
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 0, result.output
    warned = [ln for ln in result.stderr.splitlines() if "is computed from the data" in ln]
    assert len(warned) == 1, result.stderr
    assert warned[0].startswith("warning: privacy.group_size = 'median' is computed from the data")


def test_a_span_above_the_silos_is_refused_before_training(tmp_path: Path) -> None:
    config = _config(
        tmp_path / "c.toml",
        algorithms=("local_group_dp",),
        rounds=1,
        privacy="noise_multiplier = 1.0\ndelta = 1e-5\nclip = 1.0\ngroup_size = 4\nspan = 5",
    )
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(config), "--out", str(out), "--quiet"])
    _no_traceback(result)
    assert result.exit_code == 2
    assert "error: Expected privacy.span=5 to be at most the data's 3 silos" in result.stderr
    assert not list(out.rglob("metrics.jsonl")) and not list(out.rglob("ledger.sqlite"))


def test_a_root_handler_added_mid_command_does_not_print_warnings_twice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """absl's logging.warning (called by dp-accounting) runs logging.basicConfig mid-run."""
    import logging

    from silodp.cli.common import cli_messages

    root = logging.getLogger()
    before = list(root.handlers)
    try:
        with cli_messages():
            logging.basicConfig(force=False)
            root.addHandler(logging.StreamHandler(sys.stderr))
            logging.getLogger("silodp.experiment.ledger").warning("kept as %s", "x.sqlite")
    finally:
        root.handlers[:] = before
    assert capsys.readouterr().err == "warning: kept as x.sqlite\n"
    assert logging.getLogger("silodp").propagate


def test_python_warnings_print_once_as_warning_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from silodp.cli.common import cli_messages

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with cli_messages():
            for _ in range(3):
                warnings.warn("overflow encountered", RuntimeWarning, stacklevel=1)
    assert capsys.readouterr().err == "warning: overflow encountered\n"


def test_progress_of_long_steps_prints_as_plain_lines_while_a_command_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging

    from silodp.cli.common import cli_messages

    progress = logging.getLogger("silodp.progress")
    level = progress.level
    with cli_messages():
        progress.info("fixed-point weights: prime %d/%d done", 1, 3)
        progress.debug("not shown")
        progress.warning("shown once, as a warning")
    progress.info("after the command: not printed")
    assert capsys.readouterr().err == (
        "fixed-point weights: prime 1/3 done\nwarning: shown once, as a warning\n"
    )
    assert progress.level == level and not progress.handlers


# --- numeric options: refused, never clamped or replaced --------------------------------------

ACCOUNT = ["account", "--algorithm", "local_item_dp", "--noise-multiplier", "1", "--silos", "3"]
ACCOUNT += ["--group-size", "2"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--silos-per-round", "0"], "Expected --silos-per-round=0 to be an integer in [1, 3]"),
        (["--span", "0"], "Expected --span=0 to be an integer in [1, 3]"),
        (["--span", "7"], "Expected --span=7 to be an integer in [1, 3]"),
        (["--steps", "10000001"], "Expected --steps=10000001 to be an integer in [1, 1000000]"),
        (["--noise-multiplier", "1e200"], "Expected --noise-multiplier=1e+200 in (0.0, 1000000.0]"),
        (["--noise-multiplier", "0"], "Expected --noise-multiplier=0.0 in (0.0, 1000000.0]"),
    ],
)
def test_account_refuses_what_it_used_to_clamp_or_crash_on(extra: list[str], message: str) -> None:
    result = runner.invoke(app, [*ACCOUNT, *extra])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    assert f"error: {message}" in result.output


@pytest.mark.parametrize("algorithm", ["uldp_avg", "uldp_naive", "uldp_avg_w"])
def test_account_refuses_a_schedule_a_run_refuses(algorithm: str) -> None:
    # each silo adds 1/S of the noise: with 2 of 3 silos the plan's σ is never reached
    args = ["account", "--algorithm", algorithm, "--noise-multiplier", "1", "--silos", "3"]
    result = runner.invoke(app, [*args, "--silos-per-round", "2"])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    assert "splits its noise over all 3 silos; expected --silos-per-round=2 to be 3" in (
        result.output
    )
    assert runner.invoke(app, [*args, "--silos-per-round", "3"]).exit_code == 0


LARGEST = ["--steps", "1000000", "--rounds", "1000000", "--silos", "1000000"]


@pytest.mark.parametrize("algorithm", ["local_item_dp", "user_ldp", "uldp_avg"])
def test_account_answers_the_largest_plan_it_accepts(algorithm: str) -> None:
    """10¹² steps over 10⁶ silos: too long for a PLD (10 GB at 10⁹ steps), so ε comes from
    RDP, in seconds and without running out of memory (it used to hang)."""
    args = ["account", "--algorithm", algorithm, "--noise-multiplier", "0.3", "--json"]
    args += ["--group-size", "2"] if algorithm == "local_item_dp" else []
    result = runner.invoke(app, [*args, "--sample-rate", "0.5", *LARGEST])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["method"].values()) <= {"rdp", "rdp-group"}
    assert all(e is not None and e > 1e6 for e in report["epsilon"].values())


def test_account_answers_a_tiny_sigma_within_bounded_memory() -> None:
    """σ = 0.001 with k = 3: one mechanism's PLD alone wanted 15 GB (the process was killed);
    now a PLD that cannot fit is never built and ε comes from RDP."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    args = ["--algorithm", "local_item_dp", "--noise-multiplier", "0.001", "--sample-rate", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "silodp.cli", "account", *args, "--group-size", "3", "--silos", "1"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert all(e is not None and e > 1e5 for e in report["epsilon"].values())


def test_account_refuses_a_prifedsync_plan_too_long_for_its_pld() -> None:
    args = ["account", "--algorithm", "prifedsync", "--noise-multiplier", "0.3"]
    result = runner.invoke(app, [*args, "--sample-rate", "0.5", *LARGEST])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    assert "error: Expected a plan whose privacy loss distribution" in result.output
    assert "1000000 local steps x 1000000 rounds" in result.output


def test_account_prints_an_infinite_estimate_as_inf() -> None:
    """A PriFedSync plan whose CLT estimate is infinite printed a traceback."""
    args = ["account", "--algorithm", "prifedsync", "--noise-multiplier", "1", "--silos", "4"]
    result = runner.invoke(
        app, [*args, "--sample-rate", "0.01", "--steps", "100000", "--rounds", "100"]
    )
    assert result.exit_code == 0, result.output
    assert "ε ≈ inf  (CLT estimate, not a guarantee)" in result.output


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e9", "abc"])
def test_run_refuses_a_bad_timeout_before_anything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    _forbid_loading(monkeypatch)
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(SMOKE), "--out", str(out), "--timeout", value])
    assert result.exit_code == 2
    _no_traceback(result)
    line = next(ln for ln in result.output.splitlines() if ln.startswith("error: "))
    assert "--timeout" in line and "(0, 604800]" in line or "not a valid float" in line
    assert not out.exists()


def test_a_bad_option_type_is_one_error_line_not_a_panel() -> None:
    result = runner.invoke(app, ["account", "--algorithm", "local_item_dp", "--steps", "abc"])
    assert result.exit_code == 2
    assert "error: Invalid value for '--steps': 'abc' is not a valid integer." in result.output
    assert "╭" not in result.output


def test_ledger_show_refuses_an_empty_file_and_leaves_it_alone(tmp_path: Path) -> None:
    empty = tmp_path / "ledger.sqlite"
    empty.touch()
    result = runner.invoke(app, ["ledger", "show", str(empty)])
    assert result.exit_code == 2
    assert "error: Expected PATH" in result.output and "it is empty" in result.output
    assert empty.stat().st_size == 0


def test_interrupted_status_lines_are_kept_by_kept_runs(tmp_path: Path) -> None:
    from silodp.experiment.run import kept_runs

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(
        json.dumps({"status": "complete", "rounds_completed": 4, "rounds_planned": 4})
    )
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "summary.json").write_text(
        json.dumps({"status": "running", "rounds_completed": 2, "rounds_planned": 4})
    )
    (tmp_path / "silo_private").mkdir()
    (tmp_path / "silo_private" / "summary.json").write_text("{}")
    kept = kept_runs(tmp_path, ["a", "b", "c"])
    assert [(k["run"], k["status"], k["rounds_kept"]) for k in kept] == [
        ("a", "complete", 4),
        ("b", "interrupted", 0),  # no checkpoint: nothing to continue from
        ("c", "not started", 0),
    ]
    assert os.listdir(tmp_path / "b") == ["summary.json"]


def test_an_epsilon_beside_a_given_sigma_and_a_zero_sigma_are_warned_of(tmp_path: Path) -> None:
    """ε beside σ is no target (the run uses σ and reports what it spends): said once, as a
    warning; σ = 0 trains without privacy: warned too, and the summary's threat model says so
    instead of describing local noise."""

    def run(name: str, privacy: str) -> list[str]:
        config = _config(
            tmp_path / f"{name}.toml", algorithms=("local_item_dp",), rounds=1, privacy=privacy
        )
        result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / name), "--quiet"])
        assert result.exit_code == 0, result.output
        return [ln for ln in result.stderr.splitlines() if ln.startswith("warning:")]

    warned = run("both", "epsilon = 4.0\nnoise_multiplier = 1.0\ngroup_size = 3")
    assert any("privacy.epsilon = 4 is no target" in ln for ln in warned), warned
    assert not any("is no target" in ln for ln in run("sigma", "noise_multiplier = 1.0"))
    warned = run("zero", "noise_multiplier = 0.0\ngroup_size = 3")
    assert any(ln.startswith("warning: noise_multiplier = 0: not private") for ln in warned)
    summary = json.loads((tmp_path / "zero" / "local_item_dp" / "summary.json").read_text())
    assert summary["epsilon"] == {} and summary["threat_model"].startswith("none:")


def test_a_budget_on_a_unit_no_algorithm_reports_is_refused(tmp_path: Path) -> None:
    config = _config(
        tmp_path / "c.toml",
        algorithms=("local_item_dp",),
        rounds=1,
        privacy="epsilon = 4.0\ngroup_size = 3\nbudget = {silo = 6.0}",
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "privacy.budget units among those the listed algorithms report (record, subject)" in (
        result.output
    )
    assert not (tmp_path / "out").exists()


def test_resume_refuses_options_it_would_ignore(tmp_path: Path) -> None:
    # a resumed run continues with its own config, directory and ledger: another given beside
    # --resume is an error, not silently dropped
    for extra, named in [
        (["--out", str(tmp_path / "x")], "--out"),
        (["--overwrite"], "--overwrite"),
        (["--ledger", str(tmp_path / "l.sqlite")], "--ledger"),
        ([str(tmp_path / "c.toml")], "CONFIG"),
    ]:
        result = runner.invoke(app, ["run", "--resume", str(tmp_path), *extra])
        assert result.exit_code == 2, result.output
        _no_traceback(result)
        assert f"without {named}" in result.output
    assert not any(tmp_path.iterdir())


def test_an_empty_config_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing yet\n")
    result = runner.invoke(app, ["run", str(empty), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    assert "sets nothing" in result.output and not (tmp_path / "out").exists()


def test_account_refuses_a_unit_the_algorithm_does_not_protect() -> None:
    result = runner.invoke(app, [*ACCOUNT, "--unit", "silo"])
    assert result.exit_code == 2, result.output
    _no_traceback(result)
    assert "Expected --unit='silo' to be one of the units 'local_item_dp' protects" in (
        result.output
    )


def test_a_run_inside_or_around_a_live_run_s_out_is_refused(tmp_path: Path) -> None:
    """The lock covered one directory only: --overwrite on the parent of a live run's --out
    removed that run's files (and its lock), and a run in a live run's subdirectory replaced
    its summary."""
    config = _config(tmp_path / "a.toml", algorithms=("fedavg",), rounds=1, privacy=NO_NOISE)
    inner = tmp_path / "outer" / "inner"
    inner.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom silodp import locking\n"
            f"locking.acquire({str(inner / '.silodp-run.lock')!r})\nprint('held', flush=True)\n"
            "sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for out, where in ((tmp_path / "outer", "inside"), (inner / "fedavg", "around")):
            result = runner.invoke(app, ["run", str(config), "--out", str(out), "--overwrite"])
            assert result.exit_code == 2, result.output
            assert f"another silodp run (process {holder.pid}) is writing {where} it" in (
                result.output
            )
        assert sorted(p.name for p in inner.iterdir()) == [".silodp-run.lock"]
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=60)  # this process, by its PID
    assert runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "outer")]).exit_code == 0
