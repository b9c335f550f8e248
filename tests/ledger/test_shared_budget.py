"""A budget declared on a shared ledger binds every later run there, the algorithms of one
experiment are checked against it together before anything is written, and two runs never
write one ledger at once."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from silodp.accounting.interface import accountant_from_spec
from silodp.cli import app
from silodp.config import load_config
from silodp.errors import SilodpError
from silodp.experiment import run_experiment
from silodp.ledger import Ledger, LedgerError
from silodp.ledger.report import ledger_report
from silodp.ledger.run import BudgetExceededError

NAME = "local_item_dp"

BASE = {
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 40, "max_records": 300},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.5},
    "privacy": {"noise_multiplier": 3.0, "group_size": 4, "noise": "seeded"},
}


def _shared(tmp: Path, name: str, ledger: Path, algorithms=(NAME,), **privacy) -> Path:
    raw = json.loads(json.dumps(BASE))
    raw.update(name=name, algorithms=list(algorithms))
    raw["privacy"].update(ledger=str(ledger), **privacy)
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _run(path: Path, out: Path) -> dict:
    return run_experiment(load_config(path), out, log=lambda m: None)


def test_a_budget_declared_on_a_shared_ledger_binds_every_later_run(tmp_path: Path) -> None:
    ledger = tmp_path / "shared.sqlite"
    first = _run(_shared(tmp_path, "a", ledger, budget={"record": 1.2}), tmp_path / "a")
    spent = first["runs"][0]["epsilon"]["record"]
    assert spent < 1.2  # a second identical run (composed: 1.36) would exceed the budget
    with Ledger(ledger, read_only=True) as held:
        assert held.budget() == {
            "record": {"epsilon": 1.2, "delta": 1e-5, "adversary": "strongest"}
        }
    # leaving the budget out, or raising it, does not lift the ledger's
    for i, privacy in enumerate([{}, {"budget": {"record": 100.0}}]):
        config = _shared(tmp_path, f"b{i}", ledger, **privacy)
        with pytest.raises(BudgetExceededError, match="budget 1.2"):
            _run(config, tmp_path / f"b{i}")
        assert not (tmp_path / f"b{i}").exists() or not any((tmp_path / f"b{i}").iterdir())
    # nor does a larger δ, at which the same spending reads as a smaller ε
    with pytest.raises(LedgerError, match=r"Expected δ=1e-05"):
        _run(_shared(tmp_path, "c", ledger, delta=0.2), tmp_path / "c")
    # nor another accounting kind, whose spending cannot be composed with this one's
    other = _shared(tmp_path, "d", ledger, algorithms=("prifedsync",))
    with pytest.raises(LedgerError, match="one accounting kind"):
        _run(other, tmp_path / "d")
    # a smaller budget is declared too
    with pytest.raises(BudgetExceededError, match="budget 1.0"):
        _run(_shared(tmp_path, "e", ledger, budget={"record": 1.0}), tmp_path / "e")


def test_an_experiments_runs_are_checked_together_before_anything_is_written(
    tmp_path: Path,
) -> None:
    algorithms = (NAME, "local_group_dp")
    raw = json.loads(json.dumps(BASE))
    raw.update(name="probe", algorithms=list(algorithms))
    probe = run_experiment(
        load_config(_write(tmp_path / "probe.toml", raw)), tmp_path / "probe", log=lambda m: None
    )
    alone = max(r["epsilon"]["subject"] for r in probe["runs"])
    # each plan fits the budget alone; the two one after another on one ledger do not
    ledger = tmp_path / "shared.sqlite"
    both = _shared(
        tmp_path, "both", ledger, algorithms=algorithms, budget={"subject": alone * 1.05}
    )
    out = tmp_path / "both"
    with pytest.raises(BudgetExceededError, match="whole plan"):
        _run(both, out)
    assert not out.exists() or not any(out.iterdir())
    assert not ledger.exists()


def _write(path: Path, raw: dict) -> Path:
    path.write_text(tomli_w.dumps(raw))
    return path


def test_two_runs_cannot_write_one_ledger_at_once(tmp_path: Path) -> None:
    ledger = tmp_path / "shared.sqlite"
    Ledger(ledger).close()
    holder = _holding(ledger)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(LedgerError, match=f"another run \\(process {holder.pid}\\)"):
            Ledger(ledger)
        with Ledger(ledger, read_only=True) as reader:  # reading never waits
            assert reader.runs() == []
        # a run on it is refused before it loads its data or writes anything
        with pytest.raises(LedgerError, match=f"another run \\(process {holder.pid}\\)"):
            _run(_shared(tmp_path, "late", ledger), tmp_path / "late")
        assert not (tmp_path / "late").exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=60)  # this process, by its PID
    deadline = time.monotonic() + 10
    while True:  # its exit released the lock
        try:
            Ledger(ledger).close()
            break
        except SilodpError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    # in one process, the ledgers of one run share the lock
    a, b = Ledger(ledger), Ledger(ledger)
    a.close()
    b.close()
    assert not Path(f"{ledger}-lock").exists()


def test_overwrite_keeps_a_shared_ledger_an_earlier_config_put_in_its_directory(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    inside = out / NAME / "spend.sqlite"
    _run(_shared(tmp_path, "a", inside), out)
    assert Ledger(inside, read_only=True).runs()
    # the next config names no ledger: --overwrite replaces the experiment, not its spending
    raw = json.loads(json.dumps(BASE))
    raw.update(name="b", algorithms=[NAME])
    config = load_config(_write(tmp_path / "b.toml", raw))
    run_experiment(config, out, log=lambda m: None, overwrite=True)
    with Ledger(inside, read_only=True) as kept:
        assert len(kept.runs()) == 1 and kept.runs()[0].status == "complete"
    assert (out / NAME / "ledger.sqlite").is_file()  # the new run's own


def test_a_declared_budget_binds_units_and_adversaries_it_was_declared_for(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "shared.sqlite"
    _run(_shared(tmp_path, "a", ledger, budget={"record": 5.0}), tmp_path / "a")
    # a run that accounts no record ε would spend unchecked at the record level
    other = _shared(tmp_path, "b", ledger, algorithms=("higradavg_dp",))
    with pytest.raises(LedgerError, match="Expected this run to account unit 'record'"):
        _run(other, tmp_path / "b")
    # a total against a weaker adversary than the declared one could read smaller
    weaker = _shared(tmp_path, "c", ledger, adversary="released")
    with pytest.raises(LedgerError, match="Expected privacy.adversary='strongest'"):
        _run(weaker, tmp_path / "c")
    with Ledger(ledger, read_only=True) as held:
        assert held.budget()["record"]["adversary"] == "strongest"
        assert len(held.runs()) == 1


def test_budgets_the_runs_before_will_declare_are_checked_before_anything_is_written(
    tmp_path: Path,
) -> None:
    # the second algorithm's own budget is looser, but the first one's, declared when it
    # registers, binds it: refused up front, not after the first has trained
    raw = json.loads(json.dumps(BASE))
    raw.update(name="two", algorithms=[NAME, "local_group_dp"])
    raw["privacy"]["ledger"] = str(tmp_path / "shared.sqlite")
    raw["algorithm"] = {
        NAME: {"budget": {"subject": 5.0}},
        "local_group_dp": {"budget": {"subject": 100.0}},
    }
    out = tmp_path / "two"
    with pytest.raises(BudgetExceededError, match="budget 5.0"):
        run_experiment(load_config(_write(tmp_path / "two.toml", raw)), out, log=lambda m: None)
    assert not out.exists() or not any(out.iterdir())


def test_the_write_lock_is_one_for_every_name_of_the_ledger(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    real = tmp_path / "a" / "shared.sqlite"
    Ledger(real).close()
    (tmp_path / "b").mkdir()
    link = tmp_path / "b" / "shared.sqlite"
    link.symlink_to(real)
    holder = _holding(real)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(LedgerError, match="another run"):
            Ledger(link)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)  # this process, by its PID


def _holding(path: Path) -> subprocess.Popen:
    """Another process that holds the ledger at ``path`` open for writing until its stdin
    closes (stopped by the caller, by its PID)."""
    script = (
        "import sys\nfrom silodp.ledger import Ledger\n"
        f"held = Ledger({str(path)!r})\nprint('held', flush=True)\nsys.stdin.readline()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("algorithms", [("fedavg", NAME), (NAME,)])
def test_a_run_without_noise_on_a_shared_ledger_is_counted_as_no_guarantee(
    tmp_path: Path, algorithms: tuple[str, ...]
) -> None:
    """fedavg (or σ = 0) released its model while the shared ledger kept a finite total, and
    a budget declared there still let later runs in: now its release is recorded as ε = inf
    for every unit, so the total reads inf and a budget refuses it before anything runs."""
    ledger = tmp_path / "shared.sqlite"
    extra = {} if "fedavg" in algorithms else {"noise_multiplier": 0.0}
    name = "fedavg" if "fedavg" in algorithms else NAME
    # a budget (declared earlier on the ledger) refuses it up front
    _run(_shared(tmp_path, "first", ledger, budget={"record": 50.0}), tmp_path / "first")
    config = _shared(tmp_path, "a", ledger, algorithms=algorithms, **extra)
    with pytest.raises(
        BudgetExceededError, match=f"'record' would be exceeded.*{name}, which trains without noise"
    ):
        _run(config, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with Ledger(ledger, read_only=True) as held:
        assert [r.name for r in held.runs()] == [NAME]
    # without a budget it runs, and the ledger's total is inf from then on
    free = tmp_path / "free.sqlite"
    _run(_shared(tmp_path, "b", free, algorithms=algorithms, **extra), tmp_path / "b")
    with Ledger(free, read_only=True) as held:
        runs = {r.name: r for r in held.runs()}
        assert runs[name].status == "complete"
        total = held.replay(
            [r.id for r in held.runs()], accountant_from_spec(runs[name].accountant)
        )
        assert all(math.isinf(e.epsilon) for e in total.estimates().values())
    shown = CliRunner().invoke(app, ["ledger", "show", str(free)])
    assert shown.exit_code == 0, shown.output
    assert "inf" in shown.output.split("total over runs")[1].splitlines()[0]
    assert "released a model of this data without noise" in shown.output
    report = ledger_report(free)
    assert all(v is None for t in report["total"].values() for v in t["epsilon"].values())
    assert CliRunner().invoke(app, ["ledger", "verify", str(free)]).exit_code == 0


def test_the_shared_ledger_is_named_and_a_refused_run_leaves_no_directory(
    tmp_path: Path,
) -> None:
    """A relative privacy.ledger run from elsewhere silently started an empty ledger; now the
    run names the file it writes. A run refused by its budget left the parents of --out."""
    ledger = tmp_path / "shared.sqlite"
    lines: list[str] = []
    config = load_config(_shared(tmp_path, "a", ledger, budget={"record": 50.0}))
    run_experiment(config, tmp_path / "a", log=lines.append)
    assert f"shared ledger: {ledger} (new: nothing spent on it yet)" in lines
    lines.clear()
    tight = load_config(_shared(tmp_path, "b", ledger, budget={"record": 0.1}))
    with pytest.raises(BudgetExceededError):
        run_experiment(tight, tmp_path / "new" / "deep" / "out", log=lines.append)
    assert not (tmp_path / "new").exists()
    assert f"shared ledger: {ledger} (1 earlier run(s); declared budget record ε ≤ 50)" in lines


def test_calibrated_runs_after_fedavg_on_a_shared_ledger_without_a_budget(tmp_path: Path) -> None:
    """A calibrated run's target ε capped the shared ledger's total: after fedavg (ε = inf)
    every calibrated run was refused, so a config with fedavg first, or a sweep with its
    baseline, could not use a shared ledger. The target caps what the run itself spends."""
    ledger = tmp_path / "shared.sqlite"
    raw = json.loads(json.dumps(BASE))
    raw.update(name="cal", algorithms=["fedavg", NAME])
    raw["privacy"].pop("noise_multiplier")
    raw["privacy"].update(epsilon=4.0, ledger=str(ledger))
    summary = run_experiment(load_config(_write(tmp_path / "c.toml", raw)), tmp_path / "o")
    item = next(r for r in summary["runs"] if r["algorithm"] == NAME)
    assert item["status"] == "complete" and item["epsilon"]["record"] <= 4.0
    with Ledger(ledger, read_only=True) as held:
        assert [r.name for r in held.runs()] == ["fedavg", NAME]


@pytest.mark.parametrize("order", [("uldp_sgd", "local_item_dp"), ("local_item_dp", "uldp_sgd")])
def test_a_run_declaring_a_budget_at_a_unit_it_does_not_account_is_refused(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    """uldp_sgd accounts the subject unit only. Declaring a record budget on a shared ledger,
    it passed when it ran first (its record ε counted as 0) and was refused when second."""
    ledger = tmp_path / "shared.sqlite"
    config = _shared(tmp_path, "a", ledger, algorithms=order, budget={"record": 100.0})
    with pytest.raises(LedgerError, match=r"account.*'record'"):
        _run(config, tmp_path / "a")
    assert not ledger.exists() and not (tmp_path / "a").exists()


def test_ledger_show_names_the_adversary_of_each_epsilon(tmp_path: Path) -> None:
    """A ledger's ε is against its runs' privacy.adversary: `ledger show` printed a total
    against the released model with no word of it (the same run's ε against the silos was
    larger)."""
    ledger = tmp_path / "shared.sqlite"
    config = _shared(tmp_path, "a", ledger, algorithms=("uldp_avg",), adversary="released")
    _run(config, tmp_path / "a")
    shown = CliRunner().invoke(app, ["ledger", "show", str(ledger)])
    assert shown.exit_code == 0, shown.output
    run_line = next(line for line in shown.output.splitlines() if "ε(subject=" in line)
    assert run_line.rstrip().endswith("against released")
    total = next(line for line in shown.output.splitlines() if "total over runs" in line)
    assert total.rstrip().endswith("against released")
    report = json.loads(CliRunner().invoke(app, ["ledger", "show", str(ledger), "--json"]).output)
    assert report["runs"][0]["adversary"] == "released"
    assert report["total"]["federated"]["adversary"] == "released"


def test_a_budget_at_a_unit_an_earlier_run_does_not_account_is_refused(tmp_path: Path) -> None:
    """uldp_sgd accounts the subject unit only; a record budget declared by a later config
    was accepted, and uldp_sgd's record spending counted as 0 toward it."""
    ledger = tmp_path / "shared.sqlite"
    _run(_shared(tmp_path, "a", ledger, algorithms=("uldp_sgd",)), tmp_path / "a")
    _run(_shared(tmp_path, "b", ledger), tmp_path / "b")  # without a budget: accepted
    later = _shared(tmp_path, "c", ledger, budget={"record": 100.0})
    with pytest.raises(LedgerError, match=r"every run on .* account unit 'record'.*uldp_sgd"):
        _run(later, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with Ledger(ledger, read_only=True) as held:
        assert len(held.runs()) == 2 and held.budget() == {}


def test_ledger_show_gives_no_bound_at_a_unit_some_run_does_not_account(tmp_path: Path) -> None:
    """uldp_sgd (subject only) then local_item_dp (record and subject): the total printed a
    record ε that was local_item_dp's alone."""
    ledger = tmp_path / "shared.sqlite"
    _run(_shared(tmp_path, "a", ledger, algorithms=("uldp_sgd", NAME)), tmp_path / "a")
    report = ledger_report(ledger)
    total = report["total"]["federated"]
    alone = {r["name"]: r["epsilon"] for r in report["runs"]}
    assert alone[NAME]["record"] is not None and "record" not in alone["uldp_sgd"]
    assert total["epsilon"]["record"] is None
    assert total["unaccounted"] == {"record": [1]}
    assert total["epsilon"]["subject"] > max(a["subject"] for a in alone.values())
    shown = CliRunner().invoke(app, ["ledger", "show", str(ledger)])
    assert "inf at record: run(s) [1] do not account it" in shown.output


def test_ledger_show_totals_at_the_smallest_delta_or_the_budgets(tmp_path: Path) -> None:
    """The total was composed at the first run's δ, and read below a later run's ε alone."""
    ledger = tmp_path / "shared.sqlite"
    _run(_shared(tmp_path, "a", ledger, delta=1e-3), tmp_path / "a")
    _run(_shared(tmp_path, "b", ledger, delta=1e-7), tmp_path / "b")
    report = ledger_report(ledger)
    total = report["total"]["federated"]
    assert total["delta"] == 1e-7
    assert total["epsilon"]["record"] > max(r["epsilon"]["record"] for r in report["runs"])
    with Ledger(ledger, read_only=True) as held:
        replayed = held.replay([1, 2], accountant_from_spec({**held.run(1).accountant}))
    assert replayed.estimates()["record"].epsilon < total["epsilon"]["record"]


def test_a_budget_beside_fedavg_and_runs_of_other_units_binds_each_run_at_its_own(
    tmp_path: Path,
) -> None:
    """A budget on ``subject`` and ``silo`` with fedavg listed (a sweep's baseline too): each
    run's written config keeps the budget on the units it accounts. fedavg's kept the whole
    budget, which no algorithm of its own reports, and the run was refused after calibrating."""
    import tomllib

    raw = json.loads(json.dumps(BASE))
    raw.update(name="mixed", algorithms=["fedavg", NAME, "user_ldp"])
    raw["privacy"]["budget"] = {"subject": 100.0, "silo": 50.0}
    path = tmp_path / "mixed.toml"
    path.write_text(tomli_w.dumps(raw))
    runs = _run(path, tmp_path / "out")["runs"]
    assert [r["status"] for r in runs] == ["complete"] * 3
    written = {
        r["algorithm"]: tomllib.loads(
            (tmp_path / "out" / r["algorithm"] / "config.toml").read_text()
        )
        for r in runs
    }
    assert "budget" not in written["fedavg"]["privacy"]
    assert written[NAME]["privacy"]["budget"] == {"subject": 100.0}
    assert written["user_ldp"]["privacy"]["budget"] == {"subject": 100.0, "silo": 50.0}
    # each run still refuses a plan over its own budget
    raw["privacy"]["budget"] = {"subject": 0.01, "silo": 50.0}
    path.write_text(tomli_w.dumps(raw))
    with pytest.raises(BudgetExceededError, match="subject"):
        _run(path, tmp_path / "refused")


def test_a_budget_at_a_unit_a_run_does_not_account_is_not_declared_on_its_own_ledger(
    tmp_path: Path,
) -> None:
    """A silo budget beside local_item_dp (no silo-level ε): its own ledger declared
    ``silo ε ≤ 12`` ("binds every run that writes here") while nothing bound the run there.
    The ledger now holds the units it accounts, as its config.toml does, and its summary says
    the budget does not bind it."""
    raw = json.loads(json.dumps(BASE))
    raw.update(name="own", algorithms=["user_ldp", NAME])
    raw["privacy"]["budget"] = {"silo": 12.0}
    path = tmp_path / "own.toml"
    path.write_text(tomli_w.dumps(raw))
    runs = {r["algorithm"]: r for r in _run(path, tmp_path / "out")["runs"]}
    with Ledger(tmp_path / "out" / NAME / "ledger.sqlite", read_only=True) as held:
        assert held.budget() == {}
    with Ledger(tmp_path / "out" / "user_ldp" / "ledger.sqlite", read_only=True) as held:
        assert set(held.budget()) == {"silo"}
    assert any(
        note.startswith(f"privacy.budget at silo does not bind {NAME}")
        for note in runs[NAME]["notes"]
    )
    assert not any("does not bind" in note for note in runs["user_ldp"]["notes"])


@pytest.mark.parametrize(
    "algorithms",
    [["local_item_dp", "prifedsync"], ["fedavg", "prifedsync"], ["prifedsync", "local_item_dp"]],
)
def test_runs_of_two_accounting_kinds_on_one_shared_ledger_are_checked_each_with_its_own(
    tmp_path: Path, algorithms: list[str]
) -> None:
    """The check before anything is written composed every earlier run of the experiment
    onto a run's total, whatever its accounting kind: a KeyError or ValueError from the other
    kind's accountant (a ledger's totals are per kind)."""
    from silodp.config import parse_config
    from silodp.data.build import build_federated_data
    from silodp.experiment import prepare_run
    from silodp.experiment.ledger import check_plans_fit

    raw = {
        "name": "mix",
        "algorithms": algorithms,
        "data": {
            "source": "digits",
            "num_silos": 4,
            "allocation": "shards",
            "shards_per_client": 2,
            "test_per_client": 20,
        },
        "model": {"name": "mlp"},
        "training": {"rounds": 2, "local_steps": 2, "batch_size": 8, "lr": 0.01},
        "privacy": {
            "noise_multiplier": 1.0,
            "group_size": 4,
            "ledger": str(tmp_path / "shared.sqlite"),
        },
    }
    config = parse_config(raw)
    data = build_federated_data(config.data)
    check_plans_fit([prepare_run(name, config, data) for name in config.algorithms])
