"""End-to-end runs: outputs, reproducibility, privacy numbers matching `silodp account`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from silodp.algorithms import ALGORITHMS
from silodp.config import parse_config
from silodp.experiment import OutputExistsError, run_experiment

TINY = {
    "name": "tiny",
    "algorithms": ["fedavg", "local_item_dp", "higradavg_dp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 60, "max_records": 600},
    "model": {"name": "mlp"},
    "training": {"rounds": 3, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "epsilon": None, "group_size": 4, "noise": "seeded"},
}


def _tiny(**privacy: object) -> dict:
    raw = json.loads(json.dumps({k: v for k, v in TINY.items()}))
    raw["privacy"] = {k: v for k, v in {**raw["privacy"], **privacy}.items() if v is not None}
    return raw


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_every_output(tmp_path: Path) -> None:
    summary = run_experiment(parse_config(_tiny()), tmp_path)
    assert [r["algorithm"] for r in summary["runs"]] == TINY["algorithms"]
    assert (tmp_path / "comparison.png").stat().st_size > 0
    # exact counts are silo-private, not a released output
    assert not (tmp_path / "data.json").exists()
    assert json.loads((tmp_path / "silo_private" / "data.json").read_text())["num_silos"] == 3
    for name in TINY["algorithms"]:
        run_dir = tmp_path / name
        for f in (
            "config.toml",
            "metrics.jsonl",
            "summary.json",
            "model.pt",
            "accuracy_loss.png",
        ):
            assert (run_dir / f).is_file(), f
        # an ε figure only where there is an ε (fedavg's was an empty "not private" axis)
        assert (run_dir / "epsilon.png").is_file() == (name != "fedavg")
        rows = _metrics(run_dir / "metrics.jsonl")
        private = _metrics(run_dir / "silo_private" / "diagnostics.jsonl")
        assert (run_dir / "silo_private" / "batch_histograms.png").is_file()
        assert not (run_dir / "batch_histograms.png").exists()
        # the checkpoint holds the silos' states and the private rows: under silo_private/
        assert (run_dir / "silo_private" / "checkpoint.pt").is_file()
        beside = {p.name for p in run_dir.iterdir() if p.is_file()}
        public = {"config.toml", "metrics.jsonl", "summary.json", "model.pt", "accuracy_loss.png"}
        ledger = {"epsilon.png", "ledger.sqlite", "ledger_run.json"}  # a run with an ε
        assert beside == (public if name == "fedavg" else public | ledger)
        assert [r["round"] for r in rows] == [1, 2, 3] == [r["round"] for r in private]
        for row, diag in zip(rows, private, strict=True):
            assert {"round", "test_accuracy", "test_loss", "epsilon"} <= set(row)
            assert 0.0 <= row["test_accuracy"] <= 1.0
            # un-noised, data-dependent diagnostics are not in the released metrics
            # nor is the round's wall time (it grows with the sampled records and subjects)
            assert not {"largest_group_per_batch", "subjects_per_batch", "wall_time_s"} & set(row)
            assert diag["wall_time_s"] > 0
            assert len(diag["largest_group_per_batch"]) == 3 * 2  # silos x local steps
        done = json.loads((run_dir / "summary.json").read_text())
        assert "dropped_records" not in done and "wall_time_s" not in done
        assert done["outputs"]["covered_by_epsilon"][0] == "model.pt"
        assert "silo_private/" in done["outputs"]["silo_private"][0]
        assert done["noise"]["mode"] == "seeded"
        if done["units"]:
            assert any("not for production" in note for note in done["notes"])
            assert set(done["epsilon_by_adversary"]) == {"released", "server", "silos"}
        done = json.loads((run_dir / "summary.json").read_text())
        assert done["status"] == "complete" and done["rounds_completed"] == 3
    item = _metrics(tmp_path / "local_item_dp" / "metrics.jsonl")
    assert set(item[-1]["epsilon"]) == {"record", "subject"}
    # item-level DP leaves subjects with k records far less protected
    assert item[-1]["epsilon"]["subject"] > item[-1]["epsilon"]["record"]
    assert item[0]["epsilon"]["record"] < item[-1]["epsilon"]["record"]
    assert _metrics(tmp_path / "fedavg" / "metrics.jsonl")[-1]["epsilon"] == {}


def test_seeded_runs_are_reproducible(tmp_path: Path) -> None:
    cfg = parse_config({**_tiny(), "algorithms": ["local_item_dp"]})
    run_experiment(cfg, tmp_path / "a")
    run_experiment(cfg, tmp_path / "b")
    a = _metrics(tmp_path / "a" / "local_item_dp" / "metrics.jsonl")
    b = _metrics(tmp_path / "b" / "local_item_dp" / "metrics.jsonl")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]  # noqa: E731
    assert strip(a) == strip(b)


def test_existing_results_are_not_overwritten(tmp_path: Path) -> None:
    cfg = parse_config({**_tiny(), "algorithms": ["fedavg"]})
    run_experiment(cfg, tmp_path)
    before = (tmp_path / "fedavg" / "metrics.jsonl").read_text()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        run_experiment(cfg, tmp_path)
    assert (tmp_path / "fedavg" / "metrics.jsonl").read_text() == before
    run_experiment(cfg, tmp_path, overwrite=True)


def test_overwriting_a_calibrated_run_keeps_the_replaced_ledger(tmp_path: Path) -> None:
    """A calibrated run's budget is its target ε: run again with --overwrite, it used to stop
    with BudgetExceededError on the replaced run's ledger. That ledger is now kept beside the
    new one, verifiable, and the shared ledger of a budget across runs is never moved."""
    from silodp.ledger.report import ledger_report, verify_ledger
    from silodp.ledger.run import BudgetExceededError

    raw = _tiny(noise_multiplier=None, epsilon=4.0)
    raw["algorithms"] = ["user_ldp"]
    raw["training"]["rounds"] = 2
    cfg = parse_config(raw)
    run_experiment(cfg, tmp_path)
    first = (tmp_path / "user_ldp" / "ledger.sqlite").read_bytes()
    run_experiment(cfg, tmp_path, overwrite=True)
    kept = sorted((tmp_path / "user_ldp").glob("ledger.replaced-*.sqlite"))
    assert len(kept) == 1 and kept[0].read_bytes() == first
    assert (
        verify_ledger(kept[0]) == []
        and verify_ledger(tmp_path / "user_ldp" / "ledger.sqlite") == []
    )
    assert len(ledger_report(tmp_path / "user_ldp" / "ledger.sqlite")["runs"]) == 1
    # a shared ledger counts every run: the same plan twice exceeds a declared budget there
    # (a target ε alone caps what its own run spends, not what others spent on the ledger)
    unit = ALGORITHMS["user_ldp"].calibration_unit
    free = {**raw["privacy"], "ledger": str(tmp_path / "d.sqlite")}
    run_experiment(parse_config({**raw, "privacy": free}), tmp_path / "free")
    run_experiment(parse_config({**raw, "privacy": free}), tmp_path / "free", overwrite=True)
    shared = parse_config(
        {**raw, "privacy": {**free, "ledger": str(tmp_path / "e.sqlite"), "budget": {unit: 4.0}}}
    )
    run_experiment(shared, tmp_path / "s")
    with pytest.raises(
        BudgetExceededError, match="budget 4.0 \\(declared on the ledger .* by an earlier run\\)"
    ):
        run_experiment(shared, tmp_path / "s", overwrite=True)
    assert not list((tmp_path / "s" / "user_ldp").glob("ledger.replaced-*"))


def _one_round(*algorithms: str, **privacy: object) -> dict:
    raw = _tiny(**privacy)
    raw["algorithms"] = list(algorithms)
    raw["training"]["rounds"] = 1
    return raw


def test_overwrite_replaces_the_whole_previous_experiment(tmp_path: Path) -> None:
    """--overwrite used to leave the directories of the earlier experiment's other algorithms
    (their summary.json, model) beside the new runs. Now the whole experiment is replaced;
    every replaced run's ledger stays on record, and nothing silodp did not write is touched."""
    from silodp.experiment.run import kept_runs
    from silodp.ledger.report import verify_ledger

    out = tmp_path / "out"
    run_experiment(parse_config(_one_round("local_item_dp", "uldp_naive")), out)
    (out / "notes.txt").write_text("mine")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.txt").write_text("outside")
    (out / "local_item_dp" / "link").symlink_to(tmp_path / "elsewhere")
    old_ledger = (out / "local_item_dp" / "ledger.sqlite").read_bytes()
    summary = run_experiment(parse_config(_one_round("uldp_naive")), out, overwrite=True)
    assert [r["algorithm"] for r in summary["runs"]] == ["uldp_naive"]
    assert [r["run"] for r in kept_runs(out)] == ["uldp_naive"]
    # of the replaced local_item_dp run, only its ledger (set aside, with any -wal/-shm of
    # a writer still open in this process, and still verifiable)
    left = list((out / "local_item_dp").iterdir())
    assert all(p.name.startswith("ledger.replaced-") for p in left), left
    (kept,) = [p for p in left if p.suffix == ".sqlite"]
    assert kept.read_bytes() == old_ledger
    assert verify_ledger(kept) == []
    assert len(list((out / "uldp_naive").glob("ledger.replaced-*.sqlite"))) == 1
    assert (out / "notes.txt").read_text() == "mine"
    assert (tmp_path / "elsewhere" / "data.txt").read_text() == "outside"


def test_a_shared_ledger_that_is_not_a_ledger_is_refused_before_the_data_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be found once the data was loaded and σ calibrated, after experiment.toml
    and silo_private/data.json were written (and after fedavg, which has no ledger, trained)."""
    import sqlite3
    from contextlib import closing

    from silodp.ledger import LedgerError

    other = tmp_path / "empty.sqlite"
    with closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE foo (x)")
        db.commit()
    before = other.read_bytes()

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was loaded before the shared ledger was checked")

    monkeypatch.setattr("silodp.experiment.run.build_federated_data", no_data)
    cfg = parse_config(_one_round("local_item_dp", ledger=str(other)))
    with pytest.raises(LedgerError, match=r"holds other tables \(foo\)"):
        run_experiment(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert other.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.sqlite"]


def test_a_budget_refusal_writes_nothing_and_overwrite_loses_nothing(tmp_path: Path) -> None:
    """A shared ledger's budget refusing a run (exit 3) used to leave experiment.toml and
    silo_private/data.json; with --overwrite, the earlier experiment was already replaced."""
    from silodp.ledger.run import BudgetExceededError

    shared = str(tmp_path / "shared.sqlite")
    first = run_experiment(parse_config(_one_round("local_item_dp", ledger=shared)), tmp_path / "a")
    spent = first["runs"][0]["epsilon"]["record"]
    # the plan alone fits; composed onto the first run's spending, it does not
    cfg = parse_config(_one_round("local_item_dp", ledger=shared, budget={"record": 1.05 * spent}))
    ledger_before = Path(shared).read_bytes()
    with pytest.raises(BudgetExceededError, match="whole plan of local_item_dp .* budget .*"):
        run_experiment(cfg, tmp_path / "b")
    with pytest.raises(BudgetExceededError) as refused:
        run_experiment(cfg, tmp_path / "b")
    assert str(refused.value).endswith("(privacy.budget).")  # where the budget comes from
    assert not (tmp_path / "b").exists()
    files = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    with pytest.raises(BudgetExceededError, match="whole plan"):
        run_experiment(cfg, tmp_path / "a", overwrite=True)
    assert {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()} == files
    assert Path(shared).read_bytes() == ledger_before


def test_unreachable_target_fails_before_writing_anything(tmp_path: Path) -> None:
    raw = _tiny(noise_multiplier=None, epsilon=1e-6)
    raw["algorithms"] = ["user_ldp"]
    raw["training"]["rounds"] = 50
    with pytest.raises(ValueError, match="unreachable"):
        run_experiment(parse_config(raw), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_run_keeps_privacy_spent(tmp_path: Path) -> None:
    cfg = parse_config({**_tiny(), "algorithms": ["local_item_dp"]})
    calls = []

    def stop_after_two(name: str, rounds: int):
        def cb(row) -> None:
            calls.append(row["round"])
            if row["round"] == 2:
                raise KeyboardInterrupt

        return cb

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, tmp_path, progress=stop_after_two)
    rows = _metrics(tmp_path / "local_item_dp" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[-1]["epsilon"]["record"] > 0
    summary = json.loads((tmp_path / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 2


def test_metrics_epsilon_matches_account_command(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from silodp.cli import app

    cfg = parse_config({**_tiny(), "algorithms": ["local_item_dp", "higradavg_dp"]})
    summary = run_experiment(cfg, tmp_path)
    for item in summary["runs"]:
        args = shlex.split(item["account_command"])[1:] + ["--per-round", "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        account = json.loads(result.output)
        rows = _metrics(tmp_path / item["algorithm"] / "metrics.jsonl")
        assert len(account["per_round"]) == len(rows)
        for row, expected in zip(rows, account["per_round"], strict=True):
            for unit, value in expected["epsilon"].items():
                assert row["epsilon"][unit] == pytest.approx(value, rel=1e-9)


#: (algorithm, [privacy] and [training] settings): every accounting option a command carries
ACCOUNTED = [
    *[(name, {}) for name in ALGORITHMS if name not in ("fedavg", "prifedsync")],
    ("uldp_avg_w", {"weighting": "clear"}),
    ("uldp_avg_w", {"weighting": "clear", "subject_rate": 0.5}),
    ("uldp_avg_w", {"scheme": "bfv"}),
    ("uldp_avg_w", {"scheme": "bfv", "weight_encoding": "fixed_point"}),
    ("uldp_avg", {"subject_rate": 0.5, "subject_sampler": "server"}),
    ("higradavg_dp", {"sampling": "subject"}),
    ("local_item_dp", {"span": 2}),
    ("local_item_dp", {"silos_per_round": 2}),
    ("prifedsync", {"client_rate": 0.5}),
]


@pytest.mark.parametrize(("name", "settings"), ACCOUNTED, ids=lambda v: str(v))
def test_account_command_reproduces_the_plans_epsilon_against_every_adversary(
    name: str, settings: dict
) -> None:
    """The ``account_command`` a run writes, run as it is, gives the ε of the run's own plan
    against each adversary (clear weights used to be accounted as the protocol's, a finite
    ε against the silos where none holds; PriFedSync's command did not run)."""
    import math

    from typer.testing import CliRunner

    from silodp.algorithms.planning import account_plan_by_adversary
    from silodp.cli import app
    from silodp.data.build import build_federated_data
    from silodp.experiment import prepare_run

    raw = _tiny()
    raw["algorithms"] = [name]
    if name == "prifedsync":
        raw["data"] |= {"allocation": "shards", "shards_per_client": 2, "test_per_client": 10}
        del raw["data"]["num_subjects"]
    for key, value in settings.items():
        raw["training" if key in ("silos_per_round", "client_rate") else "privacy"][key] = value
    config = parse_config(raw)
    run = prepare_run(name, config, build_federated_data(config.data))
    expected = account_plan_by_adversary(run.algorithm, run.plan)
    command = run.account_command()
    assert command is not None
    result = CliRunner().invoke(app, [*shlex.split(command)[1:], "--json"])
    assert result.exit_code == 0, (command, result.output)
    got = json.loads(result.output)["epsilon_by_adversary"]
    for adversary, units in expected.items():
        for unit, estimate in units.items():
            value = got[adversary][unit]
            shown = math.inf if value is None else value
            assert shown == pytest.approx(estimate.epsilon, rel=1e-9), (adversary, unit, command)


@pytest.mark.parametrize("algorithm", ["local_group_dp", "uldp_group"])
@pytest.mark.parametrize("span", [None, 2])
def test_account_command_includes_the_dp_feature_statistics(
    dp_scaled_table: dict, span, algorithm: str
) -> None:
    """With [data] scaling = "dp" the statistics are released before round 1 and every ε
    includes them; the command left them out (subject 1.87 against the run's 1.99). For
    uldp_group, which caps no span itself, the statistics are still computed on span-capped
    data: the command charged them on fewer silos than the run (record 0.254 against 0.296)."""
    import math

    from typer.testing import CliRunner

    from silodp.algorithms.planning import account_plan_by_adversary
    from silodp.cli import app
    from silodp.data.build import build_federated_data
    from silodp.experiment import prepare_run
    from silodp.experiment.prepare import dp_scaling

    raw = _tiny(noise_multiplier=None, epsilon=2.0, span=span)
    raw["algorithms"] = [algorithm]
    raw["data"] = dp_scaled_table
    config = parse_config(raw)
    data, releases, _ = dp_scaling(config, build_federated_data(config.data))
    run = prepare_run(algorithm, config, data, releases=releases)
    assert run.plan is not None and run.plan.releases
    command = run.account_command()
    assert command is not None and "--scaling-noise-multiplier" in command
    result = CliRunner().invoke(app, [*shlex.split(command)[1:], "--json"])
    assert result.exit_code == 0, (command, result.output)
    got = json.loads(result.output)["epsilon_by_adversary"]
    for adversary, units in account_plan_by_adversary(run.algorithm, run.plan).items():
        for unit, estimate in units.items():
            value = got[adversary][unit]
            shown = math.inf if value is None else value
            assert shown == pytest.approx(estimate.epsilon, rel=1e-9), (adversary, unit)


def test_silo_sampling_runs_a_subset_each_round_and_accounts_it(tmp_path: Path) -> None:
    raw = _tiny()
    raw["algorithms"] = ["local_item_dp"]
    raw["data"]["num_silos"] = 4
    raw["training"]["silos_per_round"] = 2
    raw["training"]["rounds"] = 4
    summary = run_experiment(parse_config(raw), tmp_path)
    rows = _metrics(tmp_path / "local_item_dp" / "metrics.jsonl")
    assert all(len(r["silos"]) == 2 for r in rows)
    assert len({tuple(r["silos"]) for r in rows}) > 1  # different silos over rounds
    # the planned worst case (every silo each round) bounds what was spent
    from typer.testing import CliRunner

    from silodp.cli import app

    args = shlex.split(summary["runs"][0]["account_command"])[1:] + ["--json"]
    planned = json.loads(CliRunner().invoke(app, args).output)
    for unit, value in rows[-1]["epsilon"].items():
        # up to the PLD grid: the run composes round by round (coarsened), the plan at once
        assert value <= planned["epsilon"][unit] * (1 + 1e-4)


def test_uldp_needs_every_silo_each_round(tmp_path: Path) -> None:
    raw = _tiny()
    raw["algorithms"] = ["uldp_avg"]
    raw["training"]["silos_per_round"] = 2
    with pytest.raises(ValueError, match="splits its noise over all 3 silos"):
        run_experiment(parse_config(raw), tmp_path)


def test_uldp_avg_w_outputs_say_whether_weights_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from silodp.algorithms.uldp import UldpAvgW
    from silodp.algorithms.uldp_common import ZERO_TOTALS_NOTE

    set_up = UldpAvgW.for_data.__func__  # type: ignore[attr-defined]

    def small_keys(cls, config, train, **kwargs):  # insecure 512-bit test keys keep the run fast
        return set_up(cls, config, train, insecure_test_key_bits=512, **kwargs)

    monkeypatch.setattr(UldpAvgW, "for_data", classmethod(small_keys))
    raw = _tiny(n_max=60)
    raw["algorithms"] = ["uldp_avg", "uldp_avg_w"]
    raw["training"]["rounds"] = 2
    summary = run_experiment(parse_config(raw), tmp_path)
    avg, avg_w = summary["runs"]
    assert avg_w["weights_private"] is True  # the private weighting protocol ran
    assert not any("weights not private" in n for n in avg_w["notes"])
    assert any("private weighting protocol run in-process" in n for n in avg_w["notes"])
    assert avg_w["status"] == "complete"
    # the server sees which listed subjects have no record (blinded totals of 0): no guarantee
    # against it, so none against the strongest adversary; the released model's ε stands
    by = avg_w["epsilon_by_adversary"]
    assert avg_w["epsilon"]["subject"] is None and by["server"]["subject"] is None
    assert by["released"]["subject"] > 0 and by["silos"]["subject"] > 0
    assert ZERO_TOTALS_NOTE in avg_w["notes"] and ZERO_TOTALS_NOTE not in avg["notes"]
    clear = _tiny(weighting="clear")
    clear["algorithms"] = ["uldp_avg_w"]
    clear["training"]["rounds"] = 1
    (clear_w,) = run_experiment(parse_config(clear), tmp_path / "clear")["runs"]
    assert clear_w["weights_private"] is False
    assert any("weights not private" in n for n in clear_w["notes"])
    by = clear_w["epsilon_by_adversary"]
    assert by["server"]["subject"] is None and by["silos"]["subject"] is None
    assert by["released"]["subject"] > 0
    assert not any("weights not private" in n for n in avg["notes"])
    assert any("secure aggregation" in n for n in avg["notes"])
    rows = _metrics(tmp_path / "uldp_avg" / "metrics.jsonl")
    assert all(r["epsilon"]["subject"] > 0 for r in rows)


@pytest.mark.parametrize("name", ["local_item_dp", "uldp_avg"])
def test_zero_noise_multiplier_runs_a_non_private_baseline(tmp_path: Path, name: str) -> None:
    raw = _tiny(noise_multiplier=0.0)
    raw["algorithms"] = [name]
    raw["training"]["rounds"] = 2
    (item,) = run_experiment(parse_config(raw), tmp_path)["runs"]
    assert item["status"] == "complete"
    assert item["epsilon"] == {} and item["epsilon_by_adversary"] == {} and item["units"] == []
    assert item["calibration"]["method"] == "not private (noise_multiplier = 0)"
    assert any("not private" in note for note in item["notes"])
    assert item["account_command"] is None
    rows = _metrics(tmp_path / name / "metrics.jsonl")
    assert [r["epsilon"] for r in rows] == [{}, {}]


def test_delta_not_below_one_over_n_is_flagged(tmp_path: Path, caplog) -> None:
    raw = _tiny(delta=0.5)
    raw["algorithms"] = ["local_item_dp"]
    raw["training"]["rounds"] = 1
    summary = run_experiment(parse_config(raw), tmp_path)
    notes = summary["runs"][0]["notes"]
    assert any("delta=0.5 is not below 1/n" in n and "records" in n for n in notes)
    assert any("subjects" in n for n in notes)
    assert "is not below 1/n" in caplog.text


def _known_sample_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """Σ_n Bin(n; R, q)·δ_Gauss(ε; √n/σ) = δ, solved for ε (closed form, not silodp's)."""
    import math

    import numpy as np
    from scipy import optimize, stats

    n = np.arange(1, rounds + 1)
    w = stats.binom.pmf(n, rounds, q)
    mu = np.sqrt(n) / sigma

    def excess(eps: float) -> float:
        tail = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )
        return float((w * tail).sum()) - delta

    return optimize.brentq(excess, 1e-9, 200.0)


@pytest.mark.parametrize("sampler", ["silos", "server"])
def test_uldp_subject_sampling_reports_the_adversary_that_knows_the_sample(
    tmp_path: Path, sampler: str
) -> None:
    import math

    raw = _tiny(subject_rate=0.3, subject_sampler=sampler, group_size=None)
    raw["algorithms"] = ["uldp_avg"]
    raw["training"]["rounds"] = 4
    summary = run_experiment(parse_config(raw), tmp_path)["runs"][0]
    by = {who: eps["subject"] for who, eps in summary["epsilon_by_adversary"].items()}
    # the silos always know the sample with clear weights; the server only if it draws it.
    # One silo (of 3) also knows its own share of the noise: σ√(2/3) against it.
    silos = _known_sample_epsilon(0.3, 1.5 * math.sqrt(2 / 3), 4, 1e-5)
    assert silos <= by["silos"] <= silos * (1 + 2e-3)
    server = _known_sample_epsilon(0.3, 1.5, 4, 1e-5)
    if sampler == "server":
        assert server <= by["server"] <= server * (1 + 2e-3)
    else:
        assert by["server"] == by["released"] < 0.8 * server  # amplified: it never sees it
    assert by["released"] < 0.8 * server
    # the headline is the strongest adversary's
    assert summary["adversary"] == "strongest"
    assert summary["epsilon"]["subject"] == max(by.values()) == by["silos"]
    rows = _metrics(tmp_path / "uldp_avg" / "metrics.jsonl")
    assert rows[-1]["epsilon_by_adversary"] == summary["epsilon_by_adversary"]


def test_calibration_targets_the_configured_adversary(tmp_path: Path) -> None:
    raw = _tiny(noise_multiplier=None, epsilon=3.0, subject_rate=0.3, group_size=None)
    raw["algorithms"] = ["uldp_avg"]
    raw["training"]["rounds"] = 4
    strongest = run_experiment(parse_config(raw), tmp_path / "a")["runs"][0]
    raw["privacy"]["adversary"] = "released"
    released = run_experiment(parse_config(raw), tmp_path / "b")["runs"][0]
    assert max(strongest["epsilon_by_adversary"][a]["subject"] for a in ("server", "silos")) <= 3.0
    assert strongest["epsilon"]["subject"] == pytest.approx(3.0, rel=0.03)
    assert released["epsilon_by_adversary"]["released"]["subject"] <= 3.0
    assert released["epsilon_by_adversary"]["silos"]["subject"] > 3.0
    assert released["noise_multiplier"] < strongest["noise_multiplier"]


def test_default_runs_draw_secret_coins(tmp_path: Path) -> None:
    raw = _tiny()
    del raw["privacy"]["noise"]  # the default: secure
    raw["algorithms"] = ["local_item_dp"]
    raw["training"]["rounds"] = 1
    cfg = parse_config(raw)
    assert cfg.privacy.noise == "secure"
    run_experiment(cfg, tmp_path / "a")
    run_experiment(cfg, tmp_path / "b")
    a = _metrics(tmp_path / "a" / "local_item_dp" / "metrics.jsonl")
    b = _metrics(tmp_path / "b" / "local_item_dp" / "metrics.jsonl")
    # same seed, same config: a different sample and noise, so a different model
    assert a[0]["test_loss"] != b[0]["test_loss"]
    summary = json.loads((tmp_path / "a" / "local_item_dp" / "summary.json").read_text())
    assert summary["noise"]["mode"] == "secure"
    assert not any("not for production" in note for note in summary["notes"])


def test_comparison_labels_identical_epsilon_curves_and_histograms_skip_empty_panels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from silodp import plotting

    figures = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: figures.append(fig) or path)
    same = [{"round": r, "test_accuracy": 0.5, "epsilon": {"subject": 0.5 * r}} for r in (1, 2)]
    other = [{"round": r, "test_accuracy": 0.4, "epsilon": {"subject": 0.7 * r}} for r in (1, 2)]
    near = [{**r, "epsilon": {"subject": r["epsilon"]["subject"] * 1.01}} for r in same]
    runs = {
        "a": same,
        "b": [dict(r) for r in same],
        "c": other,
        "d": near,
        "fedavg": [{"round": 1}],
    }
    plotting.plot_comparison(runs, tmp_path / "c.png", delta=1e-5)
    right = figures[-1].axes[1]
    labels = [t.get_text() for t in right.get_legend().get_texts()]
    assert labels == ["a", "b (same ε as a)", "c", "d (ε within 2% of a)"]
    assert len({line.get_marker() for line in right.lines}) == 4
    assert right.lines[1].get_linestyle() == "--" and right.lines[1].get_markerfacecolor() == "none"
    # a ULDP run reports subjects per batch only: one panel, not an empty one beside it
    plotting.plot_batch_histograms(
        [{"round": 1, "subjects_per_batch": [3, 4, 4]}], tmp_path / "h.png", "t"
    )
    assert len(figures[-1].axes) == 1
    assert figures[-1].axes[0].get_xlabel() == "distinct subjects in a mini-batch"


def test_a_clip_the_protocol_cannot_encode_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was refused in the first round, after the run's directory, config and ledger (a
    run left "running" with no rounds, also on a shared ledger) were written."""
    from silodp.algorithms.uldp import UldpAvgW

    set_up = UldpAvgW.for_data.__func__  # type: ignore[attr-defined]

    def small_keys(cls, config, train, **kwargs):
        return set_up(cls, config, train, insecure_test_key_bits=512, **kwargs)

    monkeypatch.setattr(UldpAvgW, "for_data", classmethod(small_keys))
    raw = _tiny(n_max=60, clip=1e-12)
    raw["algorithms"] = ["uldp_avg_w"]
    raw["privacy"]["ledger"] = str(tmp_path / "shared.sqlite")
    with pytest.raises(ValueError, match=r"clip=1e-12 above sqrt\(parameters\)"):
        run_experiment(parse_config(raw), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not (tmp_path / "shared.sqlite").exists()
