"""The privacy ledger: exact event records, schema and migrations, totals recomputed from events,
verification, and budgets that stop runs."""

from __future__ import annotations

import json
import math
import sqlite3
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from silodp.accounting import FederatedAccountant, SiloPrivacy
from silodp.accounting.conversions import gdp_epsilon
from silodp.accounting.events import gaussian_steps
from silodp.algorithms import ALGORITHMS, make_algorithm
from silodp.cli import app
from silodp.config import parse_config
from silodp.experiment import run_experiment
from silodp.ledger import SCHEMA_VERSION, BudgetExceededError, Ledger, LedgerError, RunLedger
from silodp.ledger.report import ledger_report, same_epsilon, verify_ledger
from silodp.ledger.serialize import privacy_from_json, privacy_to_json
from silodp.ledger.store import _SCHEMA_V1

runner = CliRunner()

RAW = {
    "name": "ledger",
    "algorithms": ["user_ldp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 60, "max_records": 600},
    "model": {"name": "mlp"},
    "training": {"rounds": 3, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"noise_multiplier": 20.0, "epsilon": None, "noise": "seeded"},
}


def _raw(**privacy: object) -> dict:
    raw = json.loads(json.dumps(RAW))
    raw["privacy"] = {k: v for k, v in {**raw["privacy"], **privacy}.items() if v is not None}
    return raw


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"subject_rate": 0.3, "subject_sampler": "server", "weighting": "clear"},
        {"sampling": "subject"},
    ],
)
def test_every_algorithms_events_round_trip_exactly(name: str, extra: dict) -> None:
    algorithm = make_algorithm(
        name, {"num_silos": 3, "group_size": 3, "noise_multiplier": 1.3, **extra}
    )
    privacy = algorithm.silo_privacy(sampling_rate=0.1 if "subject_rate" not in extra else 0.3)
    if privacy is None:
        return
    again = privacy_from_json(privacy_to_json(privacy))
    assert again == privacy
    # the same accountant gives the same ε from the rebuilt events
    a = algorithm.make_accountant(span=3, delta=1e-5)
    b = algorithm.make_accountant(span=3, delta=1e-5)
    a.compose_round([privacy] * 3, count=4)
    b.compose_round([again] * 3, count=4)
    assert a.estimates_by_adversary() == b.estimates_by_adversary()


def test_ledger_is_wal_with_full_sync_and_refuses_unknown_files(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite") as ledger:
        assert ledger.schema_version == SCHEMA_VERSION
        assert ledger.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert ledger.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert ledger.integrity_errors() == []
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.commit()
    with pytest.raises(LedgerError, match="other tables"):
        Ledger(other)
    (tmp_path / "text.sqlite").write_text("not a database at all, just text" * 20)
    with pytest.raises(LedgerError, match="Expected a silodp ledger"):
        Ledger(tmp_path / "text.sqlite")


def test_newer_schema_is_refused_and_v1_is_migrated_keeping_its_events(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite"
    db = sqlite3.connect(path)
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    spec = FederatedAccountant(units=("subject",), span=2, delta=1e-5).spec()
    db.execute(
        "INSERT INTO runs (id, name, algorithm, accountant, started, status) "
        "VALUES (1, 'old', 'user_ldp', ?, 0, 'complete')",
        (json.dumps(spec),),
    )
    event = SiloPrivacy({"subject": gaussian_steps(4.0, 3)})
    for silo in range(2):
        db.execute(
            "INSERT INTO events (run_id, round, party, kind, privacy, recorded) "
            "VALUES (1, 1, ?, 'round', ?, 0)",
            (f"silo:{silo}", privacy_to_json(event)),
        )
    db.execute("INSERT INTO rounds VALUES (1, 1, 'complete', NULL, NULL)")
    db.commit()
    db.close()
    with Ledger(path) as ledger:
        assert ledger.schema_version == SCHEMA_VERSION
        (run,) = ledger.runs()
        assert run.noise == {} and run.config_hash == ""
        # μ of 3 Gaussian steps of multiplier 4, composed over 2 silos (span 2)
        mu = math.sqrt(3) / 4 * math.sqrt(2)
        eps = ledger.replay([1]).estimates()["subject"].epsilon
        assert gdp_epsilon(mu, 1e-5) <= eps <= gdp_epsilon(mu, 1e-5) * 1.01 + 1e-3
        ledger.db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(LedgerError, match="schema version 99"):
        Ledger(path)
    result = runner.invoke(app, ["ledger", "verify", str(path)])
    assert result.exit_code == 2 and "schema version 99" in result.output


def test_run_records_every_event_and_ledger_agrees_with_the_summary(tmp_path: Path) -> None:
    summary = run_experiment(parse_config(_raw()), tmp_path)
    run = summary["runs"][0]
    path = tmp_path / "user_ldp" / "ledger.sqlite"
    report = ledger_report(path)
    (entry,) = report["runs"]
    assert entry["events"] == 3 * 3 and entry["rounds"] == 3 and entry["status"] == "complete"
    assert entry["noise"]["mode"] == "seeded" and "20" not in json.dumps(entry["noise"])
    assert entry["epsilon"] == pytest.approx(run["epsilon"], rel=1e-12)
    # independent: 3 rounds x 2 steps of a Gaussian with multiplier 20/2 per silo, 3 silos
    mu = math.sqrt(6) / 10.0 * math.sqrt(3)
    assert gdp_epsilon(mu, 1e-5) <= entry["epsilon"]["subject"] <= gdp_epsilon(mu, 1e-5) * 1.01
    assert verify_ledger(path) == []
    result = runner.invoke(app, ["ledger", "show", str(path), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["runs"][0]["rounds"] == 3
    # a written ε that is not what the events give is found
    db = sqlite3.connect(path)
    db.execute("UPDATE rounds SET written = ? WHERE round = 2", (json.dumps({"subject": 0.1}),))
    db.commit()
    db.close()
    problems = verify_ledger(path)
    assert len(problems) == 1 and "round 2: subject" in problems[0]
    result = runner.invoke(app, ["ledger", "verify", str(path)])
    assert result.exit_code == 1 and "mismatch" in result.output


def test_events_no_accountant_composes_are_a_verify_problem_not_a_traceback(
    tmp_path: Path,
) -> None:
    run_experiment(parse_config(_raw()), tmp_path)
    path = tmp_path / "user_ldp" / "ledger.sqlite"
    db = sqlite3.connect(path)
    (privacy,) = db.execute("SELECT privacy FROM events ORDER BY id LIMIT 1").fetchone()
    edited = json.loads(privacy)
    assert edited["scope"] != "aggregate"
    edited["scope"] = "aggregate"  # one silo of round 1 now claims another scope
    db.execute("UPDATE events SET privacy = ? WHERE id = 1", (json.dumps(edited),))
    db.commit()
    db.close()
    (problem,) = verify_ledger(path)
    assert problem.startswith("run 1 (user_ldp): its events cannot be composed")
    result = runner.invoke(app, ["ledger", "verify", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot be composed" in " ".join(result.output.split())


@pytest.mark.parametrize(
    "edit",
    [
        'UPDATE events SET privacy = \'{"scope": "silo"}\'',
        'UPDATE runs SET accountant = \'{"kind": "federated"}\'',
        "UPDATE runs SET noise = '[]'",
        'UPDATE rounds SET written = \'{"subject": "x"}\'',
    ],
)
def test_rows_edited_into_shapes_silodp_never_writes_are_named_errors(
    tmp_path: Path, edit: str
) -> None:
    """Hand-edited rows were tracebacks (KeyError, TypeError, AttributeError) in
    ``ledger show`` and ``ledger verify``; a named error now says the row is not silodp's."""
    run_experiment(parse_config(_raw()), tmp_path)
    path = tmp_path / "user_ldp" / "ledger.sqlite"
    db = sqlite3.connect(path)
    db.execute(edit)
    db.commit()
    db.close()
    codes = set()
    for command in ("show", "verify"):
        result = runner.invoke(app, ["ledger", command, str(path)])
        assert result.exception is None or isinstance(result.exception, SystemExit)
        codes.add(result.exit_code)
        if result.exit_code == 2:
            assert "does not have the form silodp writes" in result.output
    assert 2 in codes


def test_same_epsilon_treats_unbounded_alike_and_finite_to_tolerance() -> None:
    assert (
        same_epsilon(None, None) and same_epsilon(None, math.inf) and same_epsilon(None, math.nan)
    )
    assert not same_epsilon(None, 1.0) and not same_epsilon(1.0, None)
    assert not same_epsilon(1.0, math.inf)
    assert same_epsilon(2.0, 2.0 * (1 + 1e-12)) and not same_epsilon(2.0, 2.0 * (1 + 1e-6))
    assert same_epsilon(0.0, 0.0)


def test_shared_ledger_composes_runs_and_its_budget_stops_the_next(tmp_path: Path) -> None:
    shared = tmp_path / "shared.sqlite"
    first = run_experiment(parse_config(_raw(ledger=str(shared))), tmp_path / "a")
    one = first["runs"][0]["epsilon"]["subject"]
    # a second run on the same data: the ledger's total composes both (μ grows by √2)
    run_experiment(parse_config(_raw(ledger=str(shared))), tmp_path / "b")
    total = ledger_report(shared)["total"]["federated"]
    mu = math.sqrt(6) / 10.0 * math.sqrt(3) * math.sqrt(2)
    assert gdp_epsilon(mu, 1e-5) <= total["epsilon"]["subject"] <= gdp_epsilon(mu, 1e-5) * 1.01
    assert total["epsilon"]["subject"] > one
    # a third with a budget the total already nearly fills: refused before it trains
    budget = {"subject": total["epsilon"]["subject"] * 1.05}
    with pytest.raises(BudgetExceededError, match="subject.*budget"):
        run_experiment(parse_config(_raw(ledger=str(shared), budget=budget)), tmp_path / "c")
    assert not (tmp_path / "c" / "user_ldp" / "model.pt").exists()
    assert len(ledger_report(shared)["runs"]) == 2  # nothing recorded for the refused run
    cfg = tmp_path / "c.toml"
    raw = _raw(budget=budget)
    cfg.write_text("\n".join(_toml_lines(raw)))
    result = runner.invoke(
        app, ["run", str(cfg), "--out", str(tmp_path / "d"), "--quiet", "--ledger", str(shared)]
    )
    assert result.exit_code == 3 and "budget" in result.output


def test_the_ledger_option_replaces_every_algorithms_own_ledger(tmp_path: Path) -> None:
    """``--ledger FILE`` overrides ``[algorithm.NAME] ledger`` too: the run used to spend on
    the algorithm's ledger while FILE's budget was the one checked."""
    shared, own = tmp_path / "shared.sqlite", tmp_path / "own.sqlite"
    run_experiment(parse_config(_raw(ledger=str(shared))), tmp_path / "a")
    spent = ledger_report(shared)["total"]["federated"]["epsilon"]["subject"]
    raw = _raw(budget={"subject": spent * 1.05})
    raw["algorithm"] = {"user_ldp": {"ledger": str(own)}}
    assert parse_config(raw).with_ledger(str(shared)).ledgers() == [str(shared)]
    cfg = tmp_path / "c.toml"
    cfg.write_text("\n".join(_toml_lines(raw)))
    result = runner.invoke(
        app, ["run", str(cfg), "--out", str(tmp_path / "b"), "--quiet", "--ledger", str(shared)]
    )
    assert result.exit_code == 3 and "budget" in result.output
    assert not own.exists() and len(ledger_report(shared)["runs"]) == 1


def test_an_algorithms_budget_at_a_unit_it_does_not_account_is_refused() -> None:
    """local_item_dp bounds no silo-level ε: ``[algorithm.local_item_dp] budget = {silo}``
    was declared on its ledger and claimed as kept while its spending there counted as
    nothing. A budget of the whole config binds each run at the units it accounts."""
    from silodp.errors import ConfigError

    raw = _raw()
    raw["algorithms"] = ["user_ldp", "local_item_dp"]
    raw["algorithm"] = {"local_item_dp": {"budget": {"silo": 0.5}}}
    with pytest.raises(ConfigError, match=r"local_item_dp\] budget units .* got silo"):
        parse_config(raw)
    raw["algorithm"] = {"local_item_dp": {"budget": {"record": 0.5}}}
    assert parse_config(raw).for_algorithm("local_item_dp")[1].budget == {"record": 0.5}


def _toml_lines(raw: dict) -> list[str]:
    import tomli_w

    text = tomli_w.dumps(raw)
    tomllib.loads(text)
    return [text]


def _user_ldp_on_three_silos() -> tuple[Any, Any]:
    """The test config's data and its ``user_ldp`` (3 silos, noise multiplier 20)."""
    from silodp.data.build import build_federated_data

    config = parse_config(_raw())
    data = build_federated_data(config.data)
    algorithm = make_algorithm(
        "user_ldp",
        config.algorithm_config("user_ldp", num_silos=3, noise_multiplier=20.0),
        data.train,
    )
    return data, algorithm


def test_a_round_the_budget_does_not_allow_stops_the_run_cleanly(tmp_path: Path) -> None:
    """The in-round check: a ledger whose budget allows two of three rounds ends the run
    with the model and results of two, status budget_exhausted."""
    from silodp.experiment.record import record_rounds
    from silodp.federated import Simulator
    from silodp.models import build_model

    data, algorithm = _user_ldp_on_three_silos()
    accountant = algorithm.make_accountant(span=3, delta=1e-5)
    mu_two = math.sqrt(4) / 10.0 * math.sqrt(3)
    budget = {"subject": gdp_epsilon(mu_two, 1e-5) * 1.02}  # two rounds fit, three do not
    ledger = RunLedger(
        Ledger(tmp_path / "l.sqlite"),
        name="x",
        algorithm="user_ldp",
        accountant=accountant,
        noise={"mode": "seeded"},
        budget=budget,
    )
    engine = Simulator(
        algorithm=algorithm,
        model=build_model("mlp", (64,), 10, seed=0),
        train=data.train,
        test=data.test,
        accountant=accountant,
        seed=0,
        noise="seeded",
        ledger=ledger,
    )
    results, rows, _, status = record_rounds(
        engine, 3, tmp_path, lambda s, r: {"status": s, "rounds": len(r)}
    )
    assert status == "budget_exhausted" and [r["round"] for r in rows] == [1, 2]
    assert (tmp_path / "model.pt").is_file()
    assert rows[-1]["epsilon"]["subject"] <= budget["subject"]
    assert verify_ledger(tmp_path / "l.sqlite") == []


def test_a_stop_while_a_checkpoint_is_written_leaves_that_round_out_of_the_summary(
    tmp_path: Path,
) -> None:
    """Ctrl-C (or SIGTERM) during round 2's checkpoint: the summary counts round 1 only, as
    the checkpoint does (round 2 runs again on resume)."""
    import json

    from silodp.experiment.record import record_rounds
    from silodp.federated import Simulator
    from silodp.models import build_model

    data, algorithm = _user_ldp_on_three_silos()
    engine = Simulator(
        algorithm=algorithm,
        model=build_model("mlp", (64,), 10, seed=0),
        train=data.train,
        test=data.test,
        accountant=algorithm.make_accountant(span=3, delta=1e-5),
        seed=0,
        noise="seeded",
    )
    saved: list[tuple[int, int]] = []

    def checkpoint(round_index: int, rows: list, private_rows: list) -> None:
        if round_index == 2:
            raise KeyboardInterrupt  # the stop arrives while round 2 is being saved
        saved.append((round_index, len(rows)))

    with pytest.raises(KeyboardInterrupt):
        record_rounds(
            engine,
            3,
            tmp_path,
            lambda s, r: {"status": s, "rounds_completed": len(r)},
            checkpoint=checkpoint,
        )
    assert saved == [(1, 1)]  # round 1's checkpoint held round 1's row
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"status": "interrupted", "rounds_completed": 1}
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in metrics] == [1]


def test_dp_feature_statistics_are_recorded_as_a_release_before_they_are_written(
    tmp_path: Path, dp_scaled_table: dict
) -> None:
    raw = _raw(noise_multiplier=None, epsilon=4.0, group_size=4)
    raw["algorithms"] = ["local_item_dp"]
    raw["data"] = dp_scaled_table
    summary = run_experiment(parse_config(raw), tmp_path / "out")
    ledger = tmp_path / "out" / "local_item_dp" / "ledger.sqlite"
    with Ledger(ledger) as opened:
        kinds = [kind for _, _, _, kind, _ in opened.events(1)]
    assert kinds[:3] == ["release"] * 3 and kinds.count("release") == 3
    assert (tmp_path / "out" / "feature_scaling.json").is_file()
    assert verify_ledger(ledger) == []
    (entry,) = ledger_report(ledger)["runs"]
    assert entry["epsilon"] == pytest.approx(summary["runs"][0]["epsilon"], rel=1e-12)
    assert summary["runs"][0]["epsilon"]["record"] <= 4.0 * (1 + 1e-9)  # the release included


def test_budget_error_prints_the_spending_rounded_up() -> None:
    """A round that would go 4e-5 over a budget of 1 says so: rounded to nearest, it would
    read "would make it 1, budget 1"."""
    error = BudgetExceededError("subject", spent=0.99981, would_be=1.00004, budget=1.0)
    assert "spent ε=0.9999, the next round would make it 1.001, budget 1.0." in str(error)


def test_a_shared_total_composes_each_run_over_its_own_span(tmp_path: Path) -> None:
    """A run's subject events compose over the span of its own data: replayed into the
    total of a later run with a smaller span, they must not shrink (each event is an unsampled
    Gaussian, so the total is a closed form: μ² adds up, span times per round)."""
    path = tmp_path / "shared.sqlite"
    sigma, steps, rounds, silos = 4.0, 2, 3, 3
    event = SiloPrivacy({"subject": gaussian_steps(sigma, steps)})

    def open_run(name: str, span: int) -> tuple[FederatedAccountant, RunLedger]:
        acc = FederatedAccountant(units=("subject",), span=span, delta=1e-5)
        run = RunLedger(
            Ledger(path), name=name, algorithm="user_ldp", accountant=acc, noise={"mode": "x"}
        )
        return acc, run

    acc, run = open_run("wide", span=silos)
    for r in range(1, rounds + 1):
        for s in range(silos):
            run.record(r, f"silo:{s}", event)
        events = run.round_events(r)
        acc.compose_round(events)
        run.complete_round(r, events, {u: e.epsilon for u, e in acc.estimates().items()})
    run.finish("complete")
    mu_wide = math.sqrt(silos * rounds * steps) / sigma
    _, later = open_run("narrow", span=1)
    spent = later.spent()["subject"]
    assert spent == pytest.approx(gdp_epsilon(mu_wide, 1e-5), rel=1e-3)
    assert spent > gdp_epsilon(math.sqrt(rounds * steps) / sigma, 1e-5) * 1.5


def test_a_shared_total_of_runs_against_different_adversaries_is_the_strongest(
    tmp_path: Path,
) -> None:
    """Two uldp_avg runs with a server-drawn subject sample, one accounted against the
    released model (amplified) and one against the strongest adversary (the server knows the
    sample): the total was composed at the first run's adversary and read below the second
    run's own ε."""
    shared = tmp_path / "shared.sqlite"
    raw = _raw(ledger=str(shared), noise_multiplier=1.0, subject_rate=0.2)
    raw.update(algorithms=["uldp_avg"])
    raw["privacy"]["subject_sampler"] = "server"
    raw["training"] = {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.5}
    # a budget declared against the released model (the total read at its adversary)
    budget = {"adversary": "released", "budget": {"subject": 1000.0}}
    first = run_experiment(
        parse_config({**raw, "privacy": {**raw["privacy"], **budget}}),
        tmp_path / "a",
    )
    second = run_experiment(parse_config(raw), tmp_path / "b")
    one, two = (r["runs"][0]["epsilon"]["subject"] for r in (first, second))
    assert one < two  # the server knows the sample: no amplification against it
    total = ledger_report(shared)["total"]["federated"]
    assert total["epsilon"]["subject"] > two


def test_a_resume_reopens_the_run_it_registered_as(tmp_path: Path) -> None:
    """Two runs of one config on a shared ledger (two results directories): each resumes its
    own registration, not the last one of that name, so its ε composes its own events."""
    path = tmp_path / "shared.sqlite"
    event = SiloPrivacy({"subject": gaussian_steps(4.0, 1)})

    def acc() -> FederatedAccountant:
        return FederatedAccountant(units=("subject",), span=1, delta=1e-5)

    runs = []
    for rounds in (2, 1):  # the first recorded one round more, then both were killed
        run = RunLedger(
            Ledger(path),
            name="x",
            algorithm="user_ldp",
            accountant=acc(),
            noise={"mode": "x"},
            config_hash="h",
        )
        for r in range(1, rounds + 1):
            run.record(r, "silo:0", event)
            run.complete_round(r, run.round_events(r), {})
        runs.append(run.run_id)
    mine = acc()
    first = RunLedger.resume(
        Ledger(path), name="x", config_hash="h", accountant=mine, completed=2, run_id=runs[0]
    )
    assert first is not None and first.run_id == runs[0]
    assert mine.rounds == 2 and first.total.rounds == 3  # its own rounds; the ledger's total
    # without the registration the last run of that name is taken, whose ledger lacks round 2
    with pytest.raises(LedgerError, match=r"round\(s\) \[2\] are not"):
        RunLedger.resume(Ledger(path), name="x", config_hash="h", accountant=acc(), completed=2)
