"""silodp sweep's one progress view over every cell: plain lines off a terminal (CI logs), one
bar redrawn in place on a terminal, nothing with --quiet."""

from __future__ import annotations

import io
import re
from pathlib import Path

from typer.testing import CliRunner

from silodp.cli import app
from silodp.cli.common import SweepProgress
from silodp.experiment.grid import CellProgress, load_grid, run_grid

BASE = """
name = "tiny"
algorithms = ["local_item_dp"]
[data]
source = "digits"
num_silos = 3
num_subjects = 30
max_records = 300
[model]
name = "mlp"
[training]
rounds = 2
local_steps = 1
batch_size = 32
lr = 0.5
[privacy]
noise_multiplier = 1.0
group_size = 3
"""

#: one baseline cell and two private ones, two rounds each: 6 rounds in all
SWEEP = 'base = "base.toml"\nseeds = [0]\n[grid]\n"privacy.noise_multiplier" = [1.0, 2.0]\n'


class _Clock:
    """10 seconds pass between two readings."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _events(view: SweepProgress) -> None:
    """Cell 1 (2 rounds) kept from an earlier invocation; cell 2 (2 rounds) runs both."""
    view.cell(CellProgress(1, 2, "baseline seed 0", "kept", 2, 0, 4))
    view.cell(CellProgress(2, 2, "noise_multiplier=1.0, seed 0", "started", 2, 2, 4))
    update = view.run("local_item_dp", 2)
    update({"round": 1, "test_accuracy": 0.5, "epsilon": {"record": 1.25}})
    update({"round": 2, "test_accuracy": 0.75, "epsilon": {"record": 2.5}})
    view.cell(CellProgress(2, 2, "noise_multiplier=1.0, seed 0", "finished", 2, 2, 4))
    view.close()


def test_plain_lines_name_the_cell_rounds_across_the_sweep_and_time_left() -> None:
    stream = io.StringIO()
    _events(SweepProgress(stream=stream, clock=_Clock()))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "sweep: cell 1/2 (baseline seed 0) finished before, kept; 2/4 rounds, elapsed 0:10, ETA ?",
        "sweep: cell 2/2 (noise_multiplier=1.0, seed 0) started, 2 rounds planned; 2/4 rounds, "
        "elapsed 0:20, ETA ?",
        # one round trained in 30 s, one left: 30 s (a kept cell is not speed)
        "  local_item_dp: round 1/2, acc=0.500, ε_record=1.25 | sweep: 3/4 rounds, "
        "elapsed 0:30, ETA 0:30",
        "  local_item_dp: round 2/2, acc=0.750, ε_record=2.5 | sweep: 4/4 rounds, elapsed 0:40",
        "sweep: cell 2/2 (noise_multiplier=1.0, seed 0) finished; 4/4 rounds, elapsed 0:50",
    ]


def test_on_a_terminal_one_bar_is_redrawn_in_place() -> None:
    stream = _Terminal()
    _events(SweepProgress(stream=stream, clock=_Clock()))
    out = stream.getvalue()
    frames = [f for f in re.split(r"[\r\n]", out) if f.strip()]
    assert "\r" in out and out.count("\n") <= 1  # redrawn, not one line per event
    assert "  local_item_dp: round" not in out  # no plain lines
    assert any("cell 2/2 (noise_multiplier=1.0, seed 0)" in f and "3/4 rounds" in f for f in frames)
    assert any("ETA 0:30" in f and "local_item_dp: round 1/2" in f for f in frames)
    assert "cell 2/2" in frames[-1] and "4/4 rounds" in frames[-1]


def _files(tmp_path: Path) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "sweep.toml").write_text(SWEEP)
    return tmp_path / "sweep.toml"


def test_run_grid_reports_each_cell_with_the_rounds_it_plans(tmp_path: Path) -> None:
    path = _files(tmp_path)
    seen: list[CellProgress] = []
    run_grid(load_grid(path), tmp_path / "out", log=lambda m: None, on_cell=seen.append)
    assert [(e.index, e.status) for e in seen] == [
        (1, "started"),
        (1, "finished"),
        (2, "started"),
        (2, "finished"),
        (3, "started"),
        (3, "finished"),
    ]
    assert {(e.cells, e.rounds, e.rounds_total) for e in seen} == {(3, 2, 6)}
    assert [e.rounds_before for e in seen[::2]] == [0, 2, 4]
    again: list[CellProgress] = []
    run_grid(load_grid(path), tmp_path / "out", log=lambda m: None, on_cell=again.append)
    assert [e.status for e in again] == ["kept"] * 3


def test_cli_sweep_prints_one_view_of_every_cell_unless_quiet(tmp_path: Path) -> None:
    path = _files(tmp_path)
    result = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    cells = [ln for ln in result.stderr.splitlines() if ln.startswith("sweep: cell ")]
    assert [ln.split(" (")[0] for ln in cells] == ["sweep: cell 1/3", "sweep: cell 1/3"] + [
        "sweep: cell 2/3"
    ] * 2 + ["sweep: cell 3/3"] * 2
    assert cells[-1].endswith("finished; 6/6 rounds, elapsed " + cells[-1].rsplit(" ", 1)[1])
    rounds = [ln for ln in result.stderr.splitlines() if ln.startswith("  ")]
    assert len(rounds) == 6 and all("| sweep: " in ln for ln in rounds)
    assert "fedavg: round 1/2" in rounds[0] and "1/6 rounds" in rounds[0]
    assert "| local_item_dp |" in result.stdout  # the table
    quiet = CliRunner().invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o"), "--quiet"])
    assert quiet.exit_code == 0, quiet.output
    assert "sweep: cell" not in quiet.stderr and "round 1/2" not in quiet.stderr
    assert quiet.stdout.count(": done, kept") == 3
