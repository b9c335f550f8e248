"""End-to-end PriFedSync runs: sweep tables and plots whose privacy comes from the accountant."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from silodp.accounting.fdp import PriFedSyncPlan, account_prifedsync
from silodp.config import ConfigError, parse_config
from silodp.experiment import run_experiment

TINY = {
    "name": "tiny-prifedsync",
    "algorithms": ["prifedsync"],
    "data": {
        "source": "digits",
        "num_silos": 4,
        "allocation": "shards",
        "shards_per_client": 2,
        "test_per_client": 20,
    },
    "model": {"name": "mlp"},
    "training": {
        "rounds": 4,
        "local_steps": 3,
        "batch_size": 8,
        "lr": 0.01,
        "optimizer": "adam",
        "helper": "interpolate",
        "alpha": 0.1,
    },
    "privacy": {"noise_multiplier": 1.0},
    "sweep": {
        "client_rate": [1.0, 0.5],
        "noise_multiplier": [1.0],
        "batch_size": [8, 4],
        "local_steps": [3, 6],
        "target_accuracy": 0.3,
    },
}


def _raw(**changes: object) -> dict:
    raw = json.loads(json.dumps(TINY))
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if value is None:
            raw[section].pop(name, None)
        else:
            raw[section][name] = value
    return raw


def _account(command: str) -> tuple[float, float]:
    """μ_max of the accountant for the plan a summary's ``account_command`` describes."""
    args = shlex.split(command)
    opt = {args[i]: args[i + 1] for i in range(2, len(args), 2)}
    assert opt["--algorithm"] == "prifedsync"
    plan = PriFedSyncPlan(
        noise_multiplier=float(opt["--noise-multiplier"]),
        sample_rates=(float(opt["--sample-rate"]),) * int(opt["--clients"]),
        local_steps=int(opt["--steps"]),
        rounds=int(opt["--rounds"]),
        client_rate=float(opt["--client-rate"]),
        delta=float(opt["--delta"]),
    )
    report = account_prifedsync(plan)[-1]
    return report.mu["client_max"], report.epsilon["record"]


@pytest.mark.slow
def test_sweep_writes_tables_and_plots_with_the_accountants_numbers(tmp_path: Path) -> None:
    # seeded: with fresh coins whether any cell reaches the target in 4 rounds is chance
    raw = _raw(privacy__noise="seeded")
    raw["sweep"]["target_accuracy"] = 0.22  # reached by some cells before their last round
    summary = run_experiment(parse_config(raw), tmp_path)
    assert len(summary["runs"]) == 4
    for name in ("prifedsync_table.md", "prifedsync_table.csv", "personalised_vs_global.png"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "prifedsync_table.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    md = (tmp_path / "prifedsync_table.md").read_text()
    assert md.count("\n| ") == 5  # header + 4 rows
    assert "Partial" not in md and "| personalised acc at R | global acc at R | run |" in md
    assert [row["status"] for row in rows] == ["complete"] * 4
    stopped_early = 0
    for row, run in zip(rows, summary["runs"], strict=True):
        run_dir = tmp_path / run["algorithm"]
        for f in ("metrics.jsonl", "summary.json", "personalised_vs_global.png", "model.pt"):
            assert (run_dir / f).is_file()
        metrics = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        rounds = int(row["rounds"])
        at = metrics[rounds - 1]
        assert float(row["mu_max"]) == at["mu_estimates"]["client_max"]
        assert float(row["epsilon"]) == at["epsilon"]["record"]
        if row["reached"] == "True":
            assert at["personalised_accuracy"] >= 0.22
        # the table's numbers are the accountant's for R rounds of this plan
        mu, eps = _account(row["account_command"])
        assert float(row["mu_max"]) == pytest.approx(mu, rel=1e-9)
        assert float(row["epsilon"]) == pytest.approx(eps, rel=1e-6)
        # R is read from the models' accuracy: the guarantee is the plan's whole ε
        planned = row["account_command"].replace(
            f"--rounds {rounds} ", f"--rounds {run['rounds_planned']} "
        )
        assert float(row["epsilon_planned"]) == pytest.approx(_account(planned)[1], rel=1e-6)
        assert float(row["epsilon_planned"]) >= float(row["epsilon"])
        assert (planned != row["account_command"]) == (rounds < run["rounds_planned"])
        stopped_early += rounds < run["rounds_planned"]
        assert (
            int(row["total_examples"]) == int(row["batch_size"]) * int(row["local_steps"]) * rounds
        )
        done = json.loads((run_dir / "summary.json").read_text())
        assert done["status"] == "complete" and done["batch_sampling"] == "uniform"
        assert done["personalised_accuracy"] is not None and done["global_accuracy"] is not None
        assert done["empty_rounds"] == sum(1 for m in metrics if not m["silos"])
    assert stopped_early > 0  # the planned ε was computed from the plan, not read
    # batch size 4 with twice the steps: smaller sampling rate, smaller μ per round
    by_run = {r["run"]: r for r in rows}
    a, b = by_run["p1_sigma1_B8_K3"], by_run["p1_sigma1_B4_K6"]
    if a["rounds"] == b["rounds"]:
        assert float(b["mu_max"]) < float(a["mu_max"])


def test_a_cell_stopped_at_its_accuracy_target_is_charged_its_whole_plan(tmp_path: Path) -> None:
    """A cell stops at the first round whose accuracy reaches the target, a round read from
    the data: its summary's ε (the headline of `silodp run`) and its ledger are those of every
    planned round; ε after the rounds run is kept as ``epsilon_at_stop``."""
    from silodp.ledger.report import ledger_report, verify_ledger

    raw = _stopping_cell()
    raw["privacy"].pop("noise")
    summary = run_experiment(parse_config(raw), tmp_path)
    (item,) = summary["runs"]
    run_dir = tmp_path / item["algorithm"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert item["status"] == "complete" and item["stopped_at_round"] == len(metrics) == 1
    _, at_one = _account(item["account_command"].replace("--rounds 3 ", "--rounds 1 "))
    _, planned = _account(item["account_command"])
    assert "--rounds 3 " in item["account_command"] and planned > at_one * 1.2
    assert item["epsilon_at_stop"]["record"] == metrics[0]["epsilon"]["record"]
    assert item["epsilon_at_stop"]["record"] == pytest.approx(at_one, rel=1e-6)
    assert item["epsilon"]["record"] == pytest.approx(planned, rel=1e-6)
    assert item["rounds_charged"] == 3
    for adversary, units in item["epsilon_by_adversary"].items():
        assert units["record"] == pytest.approx(planned, rel=1e-6), adversary
    assert any("stopped at round 1" in note for note in item["notes"])
    assert json.loads((run_dir / "summary.json").read_text())["epsilon"] == item["epsilon"]
    # the ledger holds the plan: its total is the planned ε, and it verifies
    ledger = ledger_report(run_dir / "ledger.sqlite")
    assert ledger["runs"][0]["rounds"] == 3
    assert ledger["runs"][0]["epsilon"]["record"] == pytest.approx(planned, rel=1e-6)
    assert verify_ledger(run_dir / "ledger.sqlite") == []


def _stopping_cell() -> dict:
    """A cell that reaches its target at round 1 of 3, tested on the shared test split (with
    ``test_per_client`` the run would not stop: see the next test)."""
    raw = _raw(training__rounds=3, data__test_per_client=None)
    raw["sweep"] = {"client_rate": [0.5], "noise_multiplier": [1.0], "target_accuracy": 0.01}
    raw["privacy"]["noise"] = "seeded"
    return raw


def test_per_client_test_sets_drawn_from_the_training_labels_do_not_stop_a_run(
    tmp_path: Path,
) -> None:
    """Each client's test records follow its training labels: the round the target is
    reached depends on them outside the noise, so the run trains every planned round and
    releases the last model; the table still reads R at the round the target was reached."""
    from silodp.experiment.run import stops_early

    raw = _stopping_cell()
    raw["data"]["test_per_client"] = 20
    config = parse_config(raw)
    assert not stops_early(config, config.sweep)
    assert stops_early(parse_config(_stopping_cell()), config.sweep)
    summary = run_experiment(config, tmp_path)
    (item,) = summary["runs"]
    assert item["status"] == "complete" and item["rounds_completed"] == 3
    assert item["target_round"] == 1 and "stopped_at_round" not in item
    assert any("trained every planned round" in note for note in item["notes"])
    (row,) = summary["table"]
    assert row["rounds"] == 1 and row["rounds_run"] == 3 and row["reached"]
    assert row["epsilon_planned"] == pytest.approx(item["epsilon"]["record"], rel=1e-12)
    assert row["epsilon"] < row["epsilon_planned"]


def test_a_charged_cell_reports_the_plans_mu_and_routes(tmp_path: Path) -> None:
    summary = run_experiment(parse_config(_stopping_cell()), tmp_path)
    (item,) = summary["runs"]
    mu, eps = _account(item["account_command"])
    assert item["mu_estimates"]["client_max"] == pytest.approx(mu, rel=1e-9)
    assert item["epsilon"]["record"] == pytest.approx(eps, rel=1e-6)
    from typer.testing import CliRunner

    from silodp.cli import app

    account = CliRunner().invoke(app, [*shlex.split(item["account_command"])[1:], "--json"])
    assert item["epsilon_route"] == json.loads(account.output)["method"]


@pytest.mark.parametrize(
    "cut", ["while_writing_outputs", "while_charging", "inside_a_charged_round"]
)
def test_a_charged_cell_cut_short_resumes_without_training_or_charging_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """Stopped while writing its figures (after the charge), between two charged rounds or
    inside one (its events recorded, not marked complete), a resumed cell trains no further
    (it had reached its target), charges only the rounds its ledger lacks, and ends as the
    uninterrupted cell: same model, same ε."""
    from silodp.experiment import resume_experiment
    from silodp.experiment.run import kept_runs
    from silodp.federated import Simulator
    from silodp.ledger.report import ledger_report, verify_ledger
    from silodp.ledger.run import RunLedger

    config = parse_config(_stopping_cell())
    whole = run_experiment(config, tmp_path / "whole")["runs"][0]

    def stop(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    charge = Simulator.charge_rounds

    def charge_one_then_stop(self: Simulator, first: int, last: int) -> None:
        charge(self, first, first)
        raise KeyboardInterrupt

    complete = RunLedger.complete_round

    def cut_round_3(self: RunLedger, round_index: int, *args: object, **kwargs: object) -> None:
        if round_index == 3:
            raise KeyboardInterrupt
        complete(self, round_index, *args, **kwargs)

    out = tmp_path / "cut"
    with monkeypatch.context() as patch:
        if cut == "while_charging":
            patch.setattr(Simulator, "charge_rounds", charge_one_then_stop)
        elif cut == "inside_a_charged_round":
            patch.setattr(RunLedger, "complete_round", cut_round_3)
        else:
            patch.setattr("silodp.experiment.run.plotting.plot_training", stop)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(config, out, log=lambda m: None)
    run_dir = out / whole["algorithm"]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    (kept,) = kept_runs(out)
    assert kept["rounds_kept"] == 1  # trained; the charged rounds were not
    resumed = resume_experiment(out, log=lambda m: None)["runs"][0]
    assert resumed["status"] == "complete" and resumed["stopped_at_round"] == 1
    assert resumed["epsilon"] == whole["epsilon"]
    assert resumed["epsilon_at_stop"] == whole["epsilon_at_stop"]
    import torch

    a = torch.load(tmp_path / "whole" / whole["algorithm"] / "model.pt")
    b = torch.load(run_dir / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    (run,) = ledger_report(run_dir / "ledger.sqlite")["runs"]
    cut_rounds = [3] if cut == "inside_a_charged_round" else []
    assert run["status"] == "complete" and run["rounds"] == 3
    assert run["interrupted_rounds"] == cut_rounds  # composed in full, not charged again
    assert run["epsilon"]["record"] == pytest.approx(whole["epsilon"]["record"], rel=1e-9)
    assert verify_ledger(run_dir / "ledger.sqlite") == []


def test_a_budget_that_runs_out_while_charging_ends_the_cell_budget_exhausted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget met while charging (possible on a shared ledger another run spends on) ends
    the cell as budget_exhausted with the ε of what was charged, and says how far."""
    from silodp.federated import Simulator
    from silodp.ledger.report import ledger_report
    from silodp.ledger.run import BudgetExceededError

    charge = Simulator.charge_rounds

    def out_of_budget(self: Simulator, first: int, last: int) -> None:
        charge(self, first, first)
        raise BudgetExceededError("record", 1.0, 2.0, 1.5)

    monkeypatch.setattr(Simulator, "charge_rounds", out_of_budget)
    (item,) = run_experiment(parse_config(_stopping_cell()), tmp_path)["runs"]
    assert item["status"] == "budget_exhausted" and item["rounds_charged"] == 2
    assert any("charged through round 2 of 3" in note for note in item["notes"])
    _, two = _account(item["account_command"].replace("--rounds 3 ", "--rounds 2 "))
    assert item["epsilon"]["record"] == pytest.approx(two, rel=1e-6)
    ledger = ledger_report(tmp_path / item["algorithm"] / "ledger.sqlite")
    assert ledger["runs"][0]["status"] == "budget_exhausted" and ledger["runs"][0]["rounds"] == 2


def test_plain_prifedsync_run_reports_accountant_privacy(tmp_path: Path) -> None:
    raw = _raw(training__rounds=2)
    raw.pop("sweep")
    summary = run_experiment(parse_config(raw), tmp_path)
    (item,) = summary["runs"]
    assert item["algorithm"] == "prifedsync" and item["status"] == "complete"
    mu, eps = _account(item["account_command"])
    assert item["mu_estimates"]["client_max"] == pytest.approx(mu, rel=1e-9)
    assert item["epsilon"]["record"] == pytest.approx(eps, rel=1e-6)
    assert item["threat_model"].startswith("local noise")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"algorithms": ["prifedsync", "fedavg"]}, "prifedsync"),
        ({"sweep": {"target_accuracy": 0.5, "batch_size": [8], "local_steps": [1, 2]}}, "pair"),
        ({"sweep": {"target_accuracy": 1.5}}, "target_accuracy"),
        ({"sweep": {"target_accuracy": 0.5, "client_rate": [0.0]}}, "client_rate"),
        ({"sweep": {"target_accuracy": 0.5, "target_metric": "best"}}, "target_metric"),
        ({"sweep": {"target_accuracy": 0.5, "oops": 1}}, "oops"),
    ],
)
def test_bad_sweeps_are_config_errors(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config({**_raw(), **change})


def test_alpha_list_must_have_one_value_per_client(tmp_path: Path) -> None:
    raw = _raw(training__alpha=[0.1, 0.2])
    with pytest.raises(ValueError, match="one value per client"):
        run_experiment(parse_config(raw), tmp_path)
    assert not (tmp_path / "prifedsync_table.md").exists()


def test_a_sweep_refused_by_its_budget_writes_nothing(tmp_path: Path) -> None:
    """A [sweep] whose cells' plans exceed the budget is refused before any cell trains or
    anything is written, as a single run is."""
    from silodp.ledger import BudgetExceededError

    raw = _raw(privacy__budget={"record": 0.01})
    with pytest.raises(BudgetExceededError, match="record"):
        run_experiment(parse_config(raw), tmp_path / "out")
    assert not any((tmp_path / "out").rglob("*.json")) and not any(
        (tmp_path / "out").rglob("*.toml")
    )


def test_data_caps_are_refused_for_its_replace_one_record_unit(tmp_path: Path) -> None:
    """The record unit is one record *replaced*: a per-subject cap of the data can turn that
    into two replacements (one subject's record out, another's dropped record back in), which
    the accounting does not cover (docs/guarantees.md, C4)."""
    from silodp.errors import InvalidValueError

    raw = _raw(data__records_per_subject_per_silo=2)
    raw.pop("sweep")
    with pytest.raises(InvalidValueError, match="caps with prifedsync"):
        run_experiment(parse_config(raw), tmp_path / "out")


def test_cells_of_another_sigma_and_client_rate_on_one_shared_ledger_compose(
    tmp_path: Path,
) -> None:
    """A sweep of σ × p on one shared ledger: its total composes each cell's rounds at the
    cell's own σ and client rate. The total was computed at one rate for every run (a p = 1
    run's rounds counted as sampled at p = 0.5, below that run's own ε), and a second σ was
    refused."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from silodp.accounting.tradeoff import DISCRETIZATION, _step_pld
    from silodp.ledger.report import ledger_report, verify_ledger

    raw = _raw(training__rounds=2)
    raw["privacy"]["ledger"] = str(tmp_path / "l.sqlite")
    raw["sweep"].update(noise_multiplier=[1.0, 2.0], client_rate=[1.0, 0.5], batch_size=[8])
    raw["sweep"].update(local_steps=[3], target_accuracy=1.0)
    runs = run_experiment(parse_config(raw), tmp_path / "out")["runs"]
    assert len(runs) == 4 and verify_ledger(tmp_path / "l.sqlite") == []
    total = ledger_report(tmp_path / "l.sqlite")["total"]["fdp"]
    # independent of the accountant: each cell's rounds (one step's replace-one PLD, checked
    # against dp-accounting in tests/accounting/test_fdp.py) mixed with the identity at the
    # cell's p and composed with dp-accounting
    composed = None
    for item in runs:
        args = shlex.split(item["account_command"])
        opt = {args[i]: args[i + 1] for i in range(2, len(args), 2)}
        sigma, p = float(opt["--noise-multiplier"]), float(opt["--client-rate"])
        step = _step_pld(sigma, float(opt["--sample-rate"]), "uniform", DISCRETIZATION)
        one = step.self_compose(int(opt["--steps"]))
        if p < 1.0:
            identity = pld_lib.identity(value_discretization_interval=DISCRETIZATION)
            one = one.compute_mixture(identity, p)
        cell = one.self_compose(int(opt["--rounds"]))
        composed = cell if composed is None else composed.compose(cell)
        assert total["epsilon"]["record"] > item["epsilon"]["record"]
    assert composed is not None
    assert total["epsilon"]["record"] == pytest.approx(
        composed.get_epsilon_for_delta(1e-5), rel=1e-6
    )


def test_a_sweeps_cells_at_other_client_rates_are_checked_against_a_budget_up_front(
    tmp_path: Path,
) -> None:
    """The check before anything is written composed the earlier cells at the later cell's
    client rate: a budget between the first cell's ε and the two cells' total let the first
    cell train, then refused the second."""
    from silodp.ledger import BudgetExceededError
    from silodp.ledger.report import ledger_report

    raw = _raw(training__rounds=3)
    raw["sweep"].update(client_rate=[1.0, 0.2], noise_multiplier=[1.0], batch_size=[8])
    raw["sweep"].update(local_steps=[3], target_accuracy=1.0)
    raw["privacy"]["ledger"] = str(tmp_path / "free.sqlite")
    first = run_experiment(parse_config(raw), tmp_path / "free")["runs"][0]
    total = ledger_report(tmp_path / "free.sqlite")["total"]["fdp"]["epsilon"]["record"]
    assert first["epsilon"]["record"] < total
    raw["privacy"]["ledger"] = str(tmp_path / "l.sqlite")
    raw["privacy"]["budget"] = {"record": (first["epsilon"]["record"] + total) / 2}
    with pytest.raises(BudgetExceededError, match="p0.2"):
        run_experiment(parse_config(raw), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "l.sqlite").exists()


def test_a_cell_that_never_started_resumes_beside_the_same_cell_of_another_directory(
    tmp_path: Path,
) -> None:
    """Two result directories on one shared ledger: the first cut its p = 0.5 cell after 3
    rounds, the second was cut in its p = 1 cell before its p = 0.5 cell began. Resuming the
    second took the first's p = 0.5 run for its own (matched by name and config) and refused
    it for want of a checkpoint; a cell that never registered starts afresh."""
    from silodp.experiment import resume_experiment
    from silodp.ledger.report import ledger_report

    def stop_at(round_index: int):  # type: ignore[no-untyped-def]
        def progress(name: str, rounds: int):  # type: ignore[no-untyped-def]
            def update(row: dict) -> None:
                if row["round"] == round_index:
                    raise KeyboardInterrupt

            return update

        return progress

    raw = _raw(training__rounds=4)
    raw["privacy"]["ledger"] = str(tmp_path / "shared.sqlite")
    raw["sweep"].update(noise_multiplier=[1.0], batch_size=[8], local_steps=[3])
    raw["sweep"].update(target_accuracy=1.0, client_rate=[0.5])
    with pytest.raises(KeyboardInterrupt):
        run_experiment(parse_config(raw), tmp_path / "one", progress=stop_at(3))
    raw["sweep"]["client_rate"] = [1.0, 0.5]
    with pytest.raises(KeyboardInterrupt):
        run_experiment(parse_config(raw), tmp_path / "two", progress=stop_at(1))
    runs = resume_experiment(tmp_path / "two")["runs"]
    assert [r["status"] for r in runs] == ["complete", "complete"]
    assert [r["rounds_completed"] for r in runs] == [4, 4]
    names = [r["name"] for r in ledger_report(tmp_path / "shared.sqlite")["runs"]]
    assert len(names) == 3 and names.count(names[0]) == 2  # the first's cell kept as it was


def test_ledger_show_reports_a_total_it_cannot_compose(tmp_path: Path) -> None:
    """A ledger whose runs one accountant cannot compose (here a hand-recorded PriFedSync
    round whose clients ran different σ) made `ledger show` end in a traceback."""
    from typer.testing import CliRunner

    from silodp.accounting.fdp import FdpAccountant, step_events
    from silodp.cli import app
    from silodp.ledger import Ledger

    raw = _raw(training__rounds=1)
    raw.pop("sweep")
    raw["privacy"]["ledger"] = str(tmp_path / "l.sqlite")
    run_experiment(parse_config(raw), tmp_path / "a")
    with Ledger(tmp_path / "l.sqlite") as ledger:
        spec = FdpAccountant(clients=2, client_rate=1.0, delta=1e-5).spec()
        run = ledger.open_run(name="odd", algorithm="prifedsync", accountant=spec, noise={})
        events = [("silo:0", step_events(1.0, 0.1, 3)), ("silo:1", step_events(2.0, 0.1, 3))]
        ledger.record_many(run, 1, events)
        ledger.complete_round(run, 1, participants=2)
        ledger.finish_run(run, "complete")
    shown = CliRunner().invoke(app, ["ledger", "show", str(tmp_path / "l.sqlite")])
    assert shown.exit_code == 0, shown.output
    assert "(fdp accounting): not composed, no bound (Expected every client" in shown.output
    # the report of the first run shows the shared total as not composed, with the reason
    from silodp.html_report import write_report

    write_report(tmp_path / "a", tmp_path / "r.html")
    assert "not composed" in (tmp_path / "r.html").read_text()
    assert "Expected every client" in (tmp_path / "r.html").read_text()


def test_the_tables_planned_epsilon_counts_a_round_cut_short(tmp_path: Path) -> None:
    """A cell killed once round 1's events were recorded runs round 1 again when resumed; the
    ledger counts the cut attempt in full. The table's "all planned rounds" ε was recomputed
    from the plan and left that attempt out (below the cell's own summary ε)."""
    import os
    import subprocess
    import sys

    import tomli_w

    from silodp.experiment import resume_experiment

    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps(_stopping_cell()))
    out = tmp_path / "out"
    env = {**os.environ, "SILODP_KILL_AT": "silo_recorded:1"}
    killed = subprocess.run(
        [sys.executable, "-m", "silodp.cli", "run", str(config), "--out", str(out), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode < 0, killed.stderr[-2000:]
    summary = resume_experiment(out, log=lambda m: None)
    (item,) = summary["runs"]
    (row,) = summary["table"]
    _, plan_only = _account(item["account_command"])
    assert item["rounds_charged"] == 3 and item["epsilon"]["record"] > plan_only * 1.01
    assert float(row["epsilon_planned"]) == item["epsilon"]["record"]
    with open(out / "prifedsync_table.csv") as handle:
        (written,) = list(csv.DictReader(handle))
    assert float(written["epsilon_planned"]) == pytest.approx(item["epsilon"]["record"])


def test_a_sweep_table_says_it_is_partial_until_its_last_cell(
    tmp_path: Path, interrupt_call
) -> None:
    """The table is rewritten after each cell: stopped after two of four cells, it read as
    the final table."""
    from silodp.experiment import sweep as sweep_module

    interrupt_call(sweep_module, "train_run", 3)  # stopped as the third cell starts
    with pytest.raises(KeyboardInterrupt):
        run_experiment(parse_config(_raw(privacy__noise="seeded")), tmp_path)
    md = (tmp_path / "prifedsync_table.md").read_text()
    assert "**Partial: 2 of 4 cells so far.**" in md
    assert md.count("\n| ") == 3  # header + the 2 finished cells
