"""silodp sweep: grid expansion with a non-private baseline, resumable runs, the tables."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from silodp import display
from silodp.cli import app
from silodp.errors import ConfigError, OutputExistsError
from silodp.experiment import grid as grid_module
from silodp.experiment.grid import cell_config, expand, grid_rows, load_grid, run_grid

BASE = """
name = "tiny"
algorithms = ["local_item_dp"]
[data]
source = "digits"
num_silos = 3
num_subjects = 30
max_records = 300
seed = 0
[model]
name = "mlp"
[training]
rounds = 1
local_steps = 2
batch_size = 32
lr = 0.5
[privacy]
noise_multiplier = 1.0
group_size = 3
"""

SWEEP = """
name = "grid-test"
base = "base.toml"
seeds = [0, 1]
[grid]
algorithms = ["local_item_dp", "higradavg_dp"]
"privacy.noise_multiplier" = [1.0, 2.0]
"data.num_silos" = [3]
"""


def _two_sigmas(name: str) -> str:
    """A sweep of two cells, σ = 1 and 2, one seed, no baseline."""
    return (
        f'name = "{name}"\nbase = "base.toml"\nseeds = [0]\nbaseline = false\n'
        '[grid]\n"privacy.noise_multiplier" = [1.0, 2.0]\n'
    )


def _files(tmp_path: Path, sweep: str = SWEEP) -> Path:
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "sweep.toml"
    path.write_text(sweep)
    return path


def test_expansion_puts_a_baseline_first_and_sets_every_value(tmp_path: Path) -> None:
    spec = load_grid(_files(tmp_path))
    cells = expand(spec)
    baseline = [c for c in cells if c.baseline]
    # one baseline per non-privacy grid point (num_silos) and seed; 2 x 2 x 1 x 2 others
    assert len(baseline) == 2 and cells[:2] == baseline
    assert len(cells) == 2 + 8
    assert all("privacy.noise_multiplier" not in c.values for c in baseline)
    assert len({c.id for c in cells}) == len(cells)
    config = cell_config(spec, cells[-1])
    assert config.algorithms == ("higradavg_dp",)
    assert config.privacy.noise_multiplier == 2.0 and config.training.seed == 1
    assert config.data.num_silos == 3
    assert cell_config(spec, baseline[0]).algorithms == ("fedavg",)


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ('base = "base.toml"\n[grid]\n"privacy.noise_multiplier" = [-1.0]', "noise_multiplier"),
        ('base = "base.toml"\n[grid]\n"training.nonsense" = [1]', "nonsense"),
        ('base = "base.toml"\n[grid]\n"privacy.epsilon" = []', "grid.privacy.epsilon"),
        ('base = "missing.toml"', "missing.toml"),
        ('base = "base.toml"\nseeds = [0, 0]', "distinct"),
        ('base = "base.toml"\n[grid]\n"privacy.epsilon" = [2.0, 2.0]', "distinct values.*2.0"),
        ('base = "base.toml"\nrepeat = 3', "repeat"),
        ('algorithms = ["fedavg"]\n[data]\nsource = "digits"', "run it with `silodp run`"),
        # a section no cell runs was dropped: cells identical but for their name
        ('base = "base.toml"\n[grid]\n"algorithm.nope.x" = [1]', "grid.algorithm.nope.x"),
        (
            'base = "base.toml"\n[grid]\n"algorithm.uldp_sgd.subject_rate" = [0.5, 1.0]',
            "NAME one of local_item_dp",
        ),
    ],
)
def test_a_bad_sweep_file_is_refused_naming_the_value(
    tmp_path: Path, sweep: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_grid(_files(tmp_path, sweep))


def test_sweep_runs_resumes_and_tabulates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_grid(_files(tmp_path))
    out = tmp_path / "out"
    real = grid_module.run_experiment
    calls: list[str] = []

    def stop_in_the_fourth(config, out_dir, **kwargs):
        calls.append(Path(out_dir).name)
        if len(calls) == 4:  # Ctrl-C once the cell's first round is checkpointed

            def progress(name, rounds):
                def update(row):
                    raise KeyboardInterrupt

                return update

            kwargs["progress"] = progress
        return real(config, out_dir, **kwargs)

    monkeypatch.setattr(grid_module, "run_experiment", stop_in_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_grid(spec, out, log=lambda m: None)
    monkeypatch.setattr(grid_module, "run_experiment", real)
    fourth = out / "cells" / calls[3]
    assert (fourth / "experiment.toml").is_file() and not grid_module._cell_done(fourth)
    resumed: list[str] = []
    real_resume = grid_module.resume_experiment

    def resume(out_dir, **kwargs):
        resumed.append(Path(out_dir).name)
        return real_resume(out_dir, **kwargs)

    monkeypatch.setattr(grid_module, "resume_experiment", resume)
    logged: list[str] = []
    summary = run_grid(spec, out, log=logged.append)
    assert sum(m.endswith(": done, kept") for m in logged) == 3  # the first three cells
    assert resumed == [calls[3]]  # the interrupted one continued from its checkpoint
    assert summary["cells"] == 10
    rows = summary["rows"]
    assert rows[0]["algorithm"] == "fedavg" and rows[0]["baseline"] is True
    assert [r["algorithm"] for r in rows[1:]] == ["local_item_dp"] * 2 + ["higradavg_dp"] * 2
    # mean and std over the two seeds, from the cells' own summaries
    cells = [
        c
        for c in expand(spec)
        if c.values.get("algorithms") == "higradavg_dp"
        and c.values["privacy.noise_multiplier"] == 2.0
    ]
    accs = [
        json.loads((out / "cells" / c.id / "summary.json").read_text())["runs"][0]["test_accuracy"]
        for c in cells
    ]
    row = rows[-1]
    assert row["seeds"] == 2 and row["privacy.noise_multiplier"] == 2.0
    assert row["accuracy_mean"] == pytest.approx(statistics.mean(accs))
    assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
    assert row["epsilon_subject_mean"] > 0 and "epsilon_record_mean" not in row
    eps = [
        json.loads((out / "cells" / c.id / "summary.json").read_text())["runs"][0]["epsilon"]
        for c in cells
    ]
    assert row["epsilon_subject_max"] == max(e["subject"] for e in eps)
    assert row["delta"] == 1e-5 and row["adversary"] == "strongest"
    assert grid_rows(out) == rows
    table = (out / "results.md").read_text()
    assert "| fedavg (non-private baseline) |" in table.splitlines()[4]
    assert (out / "results.csv").read_text().splitlines()[0].startswith("algorithm,baseline,")
    # another grid in the same directory is refused
    other = load_grid(_files(tmp_path, SWEEP.replace("[1.0, 2.0]", "[1.0, 3.0]")))
    with pytest.raises(OutputExistsError, match="another sweep"):
        run_grid(other, out, log=lambda m: None)


def test_a_base_config_edited_since_the_cells_ran_is_another_sweep(tmp_path: Path) -> None:
    """The manifest names the grid and seeds only: an edited base config kept the old cells
    ("done, kept") and tabulated the old config's numbers under the new one."""
    sweep = """
name = "grid-base"
base = "base.toml"
seeds = [0]
baseline = false
[grid]
"privacy.noise_multiplier" = [1.0]
"""
    path = _files(tmp_path, sweep)
    out = tmp_path / "out"
    run_grid(load_grid(path), out, log=lambda m: None)
    logged: list[str] = []
    run_grid(load_grid(path), out, log=logged.append)  # unchanged: its cell is kept
    assert [m.endswith(": done, kept") for m in logged] == [True]
    (tmp_path / "base.toml").write_text(BASE.replace("group_size = 3", "group_size = 1"))
    with pytest.raises(OutputExistsError, match="base config changed"):
        run_grid(load_grid(path), out, log=lambda m: None)
    summary = run_grid(load_grid(path), out, overwrite=True, log=lambda m: None)
    (cell,) = (out / "cells").iterdir()
    assert "group_size = 1" in (cell / "experiment.toml").read_text()
    assert summary["cells"] == 1


def test_a_seed_stopped_by_its_budget_is_counted_in_its_row(tmp_path: Path) -> None:
    sweep = """
name = "grid-budget"
base = "base.toml"
seeds = [0, 1]
baseline = false
[grid]
algorithms = ["local_item_dp", "fedavg"]
"""
    path = _files(tmp_path, sweep)
    out = tmp_path / "out"
    run_grid(load_grid(path), out, log=lambda m: None)
    cells = expand(load_grid(path))
    cell = next(c for c in cells if c.seed == 1 and c.values["algorithms"] == "local_item_dp")
    written = out / "cells" / cell.id / "summary.json"
    summary = json.loads(written.read_text())
    summary["runs"][0]["status"] = "budget_exhausted"
    written.write_text(json.dumps(summary))
    rows = run_grid(load_grid(path), out, log=lambda m: None)["rows"]
    by_name = {r["algorithm"]: r for r in rows}
    assert by_name["local_item_dp"]["budget_stopped"] == 1
    assert by_name["local_item_dp"]["seeds"] == 2 and by_name["fedavg"]["budget_stopped"] == 0
    table = (out / "results.md").read_text()
    assert "| local_item_dp | 2 (1 stopped by the budget) |" in table
    assert "| fedavg (non-private) | 2 |" in table and "pooled with the other seeds'" in table


def test_cells_sharing_a_ledger_show_its_total(tmp_path: Path) -> None:
    """Each row shows its cell's ε; what the cells spent together on the data is the shared
    ledger's total, which the table did not show."""
    from silodp.ledger.report import ledger_report

    sweep = _two_sigmas("grid-ledger")
    path = _files(tmp_path, sweep)
    shared_path = tmp_path / "s.sqlite"
    (tmp_path / "base.toml").write_text(
        BASE.replace("[privacy]", f'[privacy]\nledger = "{shared_path}"')
    )
    out = tmp_path / "out"
    summary = run_grid(load_grid(path), out, log=lambda m: None)
    (ledger,) = summary["ledgers"]
    total = ledger_report(ledger["path"])["total"]
    (composed,) = total.values()  # one accounting kind: the two cells composed
    assert ledger["total"] == total and len(composed["runs"]) == 2
    shared = composed["epsilon"]["record"]
    assert shared > max(r["epsilon_record_max"] for r in summary["rows"])
    table = (out / "results.md").read_text()
    assert f"record={display.upper(shared)}" in table and "Shared ledgers" in table
    report = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    page = (tmp_path / "r.html").read_text()
    assert f"Shared ledger {shared_path}" in page


def test_cli_sweep_refuses_bad_input_and_prints_the_table(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["sweep", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2 and "none.toml" in bad.output and not (tmp_path / "o").exists()
    sweep = 'base = "base.toml"\nseeds = [0]\nbaseline = false\n'
    sweep += '[grid]\n"privacy.noise_multiplier" = [1.5]'
    path = _files(tmp_path, sweep)
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "| local_item_dp | 1.5 | 1 |" in result.output
    assert "fedavg" not in result.output
    # another grid in the same --out: refused, without claiming that running again continues
    other = _files(tmp_path, sweep.replace("[1.5]", "[2.5]"))
    again = runner.invoke(app, ["sweep", str(other), "--out", str(tmp_path / "o"), "--quiet"])
    assert again.exit_code == 2 and "holds another sweep" in again.output
    assert "run the command again" not in again.output


def test_sweep_table_rounds_epsilon_up_and_accuracy_to_nearest() -> None:
    """results.md: ε is the largest over seeds, rounded up (0.15341 reads 0.16; a mean of
    0.12341 ± 0.0301 read below one seed's ε), at the δ and against the adversary shown;
    accuracy keeps ordinary rounding."""
    spec = grid_module.GridSpec(name="s", base={}, axes={"algorithms": ("a",)}, seeds=(0, 1))
    row = {
        "algorithm": "uldp_avg",
        "baseline": False,
        "seeds": 2,
        "accuracy_mean": 0.81234,
        "accuracy_std": 0.0101,
        "epsilon_subject_mean": 0.12341,
        "epsilon_subject_std": 0.0301,
        "epsilon_subject_max": 0.15341,
        "delta": 1e-5,
        "adversary": "strongest",
    }
    line = grid_module._markdown([row], spec).splitlines()[4]
    assert line == "| uldp_avg | 2 | 0.812 ± 0.010 | 0.16 | 1e-05 | strongest |"


def test_a_base_listing_fedavg_beside_the_baseline_counts_each_seed_once(tmp_path: Path) -> None:
    """With ``baseline = true`` and fedavg in the base's algorithms, every cell trained fedavg
    again and the table pooled it with the baseline's: one seed read as 2."""
    (tmp_path / "base.toml").write_text(
        BASE.replace('algorithms = ["local_item_dp"]', 'algorithms = ["fedavg", "local_item_dp"]')
    )
    path = tmp_path / "sweep.toml"
    path.write_text('name = "dup"\nbase = "base.toml"\nseeds = [0]\n[grid]\n')
    spec = load_grid(path)
    cells = expand(spec)
    assert [c.baseline for c in cells] == [True, False]
    assert cell_config(spec, cells[1]).algorithms == ("local_item_dp",)
    run_grid(spec, tmp_path / "out", log=lambda m: None)
    rows = {r["algorithm"]: r for r in grid_rows(tmp_path / "out")}
    assert sorted(rows) == ["fedavg", "local_item_dp"]
    assert rows["fedavg"]["baseline"] and rows["fedavg"]["seeds"] == 1
    assert rows["local_item_dp"]["seeds"] == 1


@pytest.mark.parametrize("key", ['"algorithm.fedavg.lr" = [0.05, 0.5]', '"privacy.span" = [1, 3]'])
def test_a_grid_key_that_changes_fedavg_keeps_fedavg_in_its_cells(tmp_path: Path, key: str) -> None:
    """The baseline cells do not vary ``algorithm.fedavg.*`` nor the span cap of fedavg's
    data: a cell whose grid sets them keeps its fedavg (it was dropped, and those values
    trained fedavg nowhere)."""
    (tmp_path / "base.toml").write_text(
        BASE.replace('algorithms = ["local_item_dp"]', 'algorithms = ["fedavg", "local_item_dp"]')
    )
    path = tmp_path / "sweep.toml"
    path.write_text(f'name = "own"\nbase = "base.toml"\nseeds = [0]\n[grid]\n{key}\n')
    spec = load_grid(path)
    configs = [cell_config(spec, c) for c in expand(spec)]
    assert [c.algorithms for c in configs] == [("fedavg",)] + [("fedavg", "local_item_dp")] * 2


def test_a_cell_of_fedavg_alone_beside_the_baseline_counts_one_seed_once(tmp_path: Path) -> None:
    """``algorithms = ["fedavg", ...]`` in the grid: its fedavg cell is the baseline's run
    again, and the table pooled both as two seeds."""
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "sweep.toml"
    path.write_text(
        'name = "alone"\nbase = "base.toml"\nseeds = [0]\n'
        '[grid]\nalgorithms = ["fedavg", "local_item_dp"]\n'
    )
    spec = load_grid(path)
    run_grid(spec, tmp_path / "out", log=lambda m: None)
    rows = {r["algorithm"]: r for r in grid_rows(tmp_path / "out")}
    assert rows["fedavg"]["baseline"] and rows["fedavg"]["seeds"] == 1


@pytest.mark.parametrize("damage", ['{"runs": [', '{"runs": []}'])
def test_a_cell_with_a_damaged_summary_runs_again_when_the_sweep_continues(
    tmp_path: Path, damage: str
) -> None:
    """A cell's summary cut short while written (or listing no runs) counted as unfinished,
    yet continuing the sweep stopped on it (a JSONDecodeError) or left it as it was."""
    (tmp_path / "base.toml").write_text(BASE)
    path = tmp_path / "sweep.toml"
    path.write_text('name = "d"\nbase = "base.toml"\nseeds = [0]\nbaseline = false\n[grid]\n')
    spec = load_grid(path)
    run_grid(spec, tmp_path / "out", log=lambda m: None)
    (cell,) = (tmp_path / "out" / "cells").iterdir()
    (cell / "summary.json").write_text(damage)
    (cell / "local_item_dp" / "summary.json").write_text(damage)
    assert grid_module.unfinished_cells(tmp_path / "out") == [cell.name]
    run_grid(spec, tmp_path / "out", log=lambda m: None)
    assert grid_module.unfinished_cells(tmp_path / "out") == []
    (row,) = grid_rows(tmp_path / "out")
    assert row["algorithm"] == "local_item_dp" and row["seeds"] == 1


def test_run_and_sweep_refuse_each_others_results(tmp_path: Path) -> None:
    """``silodp run`` checked only its own run directories, ``silodp sweep`` only grid.json:
    each replaced the other's summary.json, and a run of other algorithms the experiment's."""
    runner = CliRunner()
    sweep = 'base = "base.toml"\nseeds = [0]\nbaseline = false\n'
    sweep += '[grid]\n"privacy.noise_multiplier" = [1.5]'
    path = _files(tmp_path, sweep)
    swept, ran = tmp_path / "swept", tmp_path / "ran"
    assert runner.invoke(app, ["sweep", str(path), "--out", str(swept), "--quiet"]).exit_code == 0
    before = (swept / "summary.json").read_bytes()
    into_sweep = runner.invoke(app, ["run", str(tmp_path / "base.toml"), "--out", str(swept)])
    assert into_sweep.exit_code == 2 and "holds a sweep's results" in into_sweep.output
    assert (swept / "summary.json").read_bytes() == before
    assert (
        runner.invoke(app, ["run", str(tmp_path / "base.toml"), "--out", str(ran)]).exit_code == 0
    )
    before = (ran / "summary.json").read_bytes()
    into_run = runner.invoke(app, ["sweep", str(path), "--out", str(ran), "--quiet"])
    assert into_run.exit_code == 2 and "holds an experiment's results" in into_run.output
    assert "local_item_dp" in into_run.output and not (ran / "grid.json").exists()
    other = tmp_path / "other.toml"
    other.write_text(BASE.replace('["local_item_dp"]', '["higradavg_dp"]'))
    again = runner.invoke(app, ["run", str(other), "--out", str(ran)])
    assert again.exit_code == 2 and "holds another experiment's results" in again.output
    assert (ran / "summary.json").read_bytes() == before
    replaced = runner.invoke(app, ["run", str(other), "--out", str(ran), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    runs = json.loads((ran / "summary.json").read_text())["runs"]
    assert [r["algorithm"] for r in runs] == ["higradavg_dp"]


def test_an_interrupted_overwrite_leaves_no_earlier_cell_or_table_to_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt_call
) -> None:
    """An --overwrite of an edited sweep stopped after its first cell left the earlier
    sweep's second cell and tables: continuing kept that cell ("done, kept") and tabulated
    the earlier config's ε under the new one's name."""
    sweep = _two_sigmas("grid-stale")
    path = _files(tmp_path, sweep)
    out = tmp_path / "out"
    run_grid(load_grid(path), out, log=lambda m: None)
    assert (out / "results.md").is_file()
    (tmp_path / "base.toml").write_text(BASE.replace("group_size = 3", "group_size = 1"))
    real = interrupt_call(grid_module, "run_experiment", 2)  # as the second cell starts
    with pytest.raises(KeyboardInterrupt):
        run_grid(load_grid(path), out, overwrite=True, log=lambda m: None)
    monkeypatch.setattr(grid_module, "run_experiment", real)
    # the earlier sweep's tables are gone; its second cell is still there, but not this one's
    assert not any((out / name).exists() for name in ("results.md", "results.csv", "summary.json"))
    assert grid_module.unfinished_cells(out) == [expand(load_grid(path))[1].id]
    logged: list[str] = []
    continued = run_grid(load_grid(path), out, log=logged.append)
    assert logged[0].endswith(": done, kept")
    assert any("holds a run of another config" in m for m in logged)
    fresh = run_grid(load_grid(path), tmp_path / "fresh", log=lambda m: None)
    strip = [{k: v for k, v in r.items() if "accuracy" not in k} for r in continued["rows"]]
    assert strip == [{k: v for k, v in r.items() if "accuracy" not in k} for r in fresh["rows"]]


def test_a_budget_refusing_a_cell_leaves_tables_marked_partial(tmp_path: Path) -> None:
    """The README said the cells before a refused one are kept and results.md gives the shared
    ledger's total; nothing was written (and `silodp report` had nothing to read)."""
    from silodp.ledger.run import BudgetExceededError

    sweep = _two_sigmas("grid-refused")
    path = _files(tmp_path, sweep)
    free = tmp_path / "free.sqlite"
    (tmp_path / "base.toml").write_text(BASE.replace("[privacy]", f'[privacy]\nledger = "{free}"'))
    unbounded = run_grid(load_grid(path), tmp_path / "free", log=lambda m: None)
    first = max(r["epsilon_record_max"] for r in unbounded["rows"])  # σ = 1, the larger ε
    both = unbounded["ledgers"][0]["total"]
    (composed,) = both.values()
    budget = (first + composed["epsilon"]["record"]) / 2  # the first cell fits, not both
    shared = tmp_path / "budget.sqlite"
    (tmp_path / "base.toml").write_text(
        BASE.replace(
            "[privacy]", f'[privacy]\nledger = "{shared}"\nbudget = {{record = {budget!r}}}'
        )
    )
    out = tmp_path / "out"
    with pytest.raises(BudgetExceededError):
        run_grid(load_grid(path), out, log=lambda m: None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"].startswith("the budget refused [2/2]")
    assert [r["epsilon_record_max"] for r in summary["rows"]] == [pytest.approx(first)]
    table = (out / "results.md").read_text()
    assert "**Partial:** the budget refused [2/2]" in table and "Shared ledgers" in table
    assert (out / "results.csv").is_file()
