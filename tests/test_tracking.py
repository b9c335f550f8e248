"""[tracking]: each run also logged to MLflow and TensorBoard, read back with their own readers
(MlflowClient, EventAccumulator) and compared with the rows silodp wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from silodp import tracking
from silodp.config import TrackingConfig, parse_config, to_toml_dict
from silodp.errors import ConfigError, InvalidValueError
from silodp.experiment import resume_experiment, run_experiment

# MLflow's own store code, with SQLAlchemy 2.1
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

mlflow_tracking = pytest.importorskip("mlflow.tracking")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

TINY: dict[str, Any] = {
    "name": "tiny-tracking",
    "algorithms": ["uldp_sgd"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 30, "max_records": 300},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"epsilon": 3.0, "group_size": 3},
}


def _config(tracking_table: dict[str, str] | None = None, **changes: Any) -> Any:
    raw = {**TINY, **changes}
    if tracking_table is not None:
        raw["tracking"] = tracking_table
    return parse_config(raw)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _client(store: Path) -> Any:
    uri, _ = tracking.mlflow_store(str(store))
    return mlflow_tracking.MlflowClient(uri)


def _runs(store: Path, experiment: str) -> list[Any]:
    client = _client(store)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, experiment
    return list(client.search_runs([found.experiment_id]))


def _history(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(store).get_metric_history(run_id, key)]


def _scalars(directory: Path, key: str) -> list[tuple[int, float]]:
    events = event_accumulator.EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def _expected(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    if key.startswith("epsilon/"):
        values = [(r["round"], r["epsilon"].get(key.split("/", 1)[1])) for r in rows]
    else:
        values = [(r["round"], r.get(key)) for r in rows]
    return [(step, value) for step, value in values if value is not None]


def _run_cut_at(
    config: Any, out: Path, monkeypatch: pytest.MonkeyPatch, point: str, round_index: int | None
) -> None:
    """Runs ``config`` into ``out``, stopped (as Ctrl-C) when it reaches the fault point
    ``point`` (in ``round_index``; ``None``: any)."""
    from silodp import faults

    real = faults.reached

    def cut(reached: str, index: int) -> None:
        if reached == point and round_index in (None, index):
            raise KeyboardInterrupt
        real(reached, index)

    with monkeypatch.context() as patch:
        patch.setattr(faults, "reached", cut)
        run_experiment(config, out, log=lambda m: None)


def _stop_in_round_two(name: str, rounds: int) -> Any:
    """A progress callback that stops the run (as Ctrl-C) once round 2 is recorded."""

    def update(row: dict[str, Any]) -> None:
        if row["round"] == 2:
            raise KeyboardInterrupt

    return update


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store for the module (creating its database takes seconds)."""
    return tmp_path_factory.mktemp("tracking") / "mlflow"


@pytest.fixture(scope="module")
def tracked(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny experiment (σ calibrated to ε = 3) with both writers on: (out, TensorBoard dir)."""
    root = tmp_path_factory.mktemp("tracked")
    tb = root / "tb"
    out = root / "out"
    run_experiment(_config({"mlflow": str(store), "tensorboard": str(tb)}), out, log=lambda m: None)
    return out, tb


def test_mlflow_run_holds_the_rows_params_and_only_public_files(
    store: Path, tracked: tuple[Path, Path]
) -> None:
    out, _ = tracked
    (run,) = _runs(store, "tiny-tracking")
    assert run.info.run_name == "uldp_sgd" and run.info.status == "FINISHED"
    assert run.data.tags["silodp.status"] == "complete"
    rows = _rows(out / "uldp_sgd")
    assert [r["round"] for r in rows] == [1, 2]
    for key in ("test_accuracy", "test_loss", "epsilon/subject"):
        assert _history(store, run.info.run_id, key) == _expected(rows, key), key
    params = run.data.params
    assert params["algorithm"] == "uldp_sgd"
    assert params["privacy_unit"] == "subject"
    assert float(params["target_epsilon"]) == 3.0 and float(params["target_delta"]) == 1e-5
    summary = json.loads((out / "uldp_sgd" / "summary.json").read_text())
    assert float(params["noise_multiplier"]) == summary["noise_multiplier"]
    assert params["training.rounds"] == "2" and params["data.source"] == "digits"
    artifacts = {a.path for a in _client(store).list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.toml", "metrics.jsonl", "accuracy_loss.png"} <= artifacts
    assert "epsilon.png" in artifacts
    # the run directory holds private files; none of them left it
    assert (out / "uldp_sgd" / "silo_private" / "diagnostics.jsonl").is_file()
    assert (out / "uldp_sgd" / "ledger.sqlite").is_file()
    assert artifacts == {p.name for p in tracking.public_files(out / "uldp_sgd")}
    stored = {p.name for p in (store / "mlartifacts").rglob("*") if p.is_file()}
    assert stored == artifacts
    assert not any(a.startswith("silo_private") for a in artifacts)
    # no round's own time: how long a round took is silo-private (its sampled subjects)
    history = _client(store).get_metric_history(run.info.run_id, "test_accuracy")
    assert len(history) == 2 and len({m.timestamp for m in history}) == 1
    # nor the run's: it ends, as MLflow records it, when it started
    assert run.info.end_time == run.info.start_time
    # ε against every adversary is logged beside the headline
    for who, units in rows[-1]["epsilon_by_adversary"].items():
        got = _history(store, run.info.run_id, f"epsilon_by_adversary/{who}/subject")
        assert got[-1] == (2, pytest.approx(units["subject"])), who


def test_tensorboard_holds_the_rows(tracked: tuple[Path, Path]) -> None:
    out, tb = tracked
    directory = tb / "tiny-tracking" / "uldp_sgd"
    rows = _rows(out / "uldp_sgd")
    for key in ("test_accuracy", "test_loss", "epsilon/subject"):
        got = _scalars(directory, key)
        assert [step for step, _ in got] == [step for step, _ in _expected(rows, key)]
        assert [v for _, v in got] == pytest.approx([v for _, v in _expected(rows, key)], 1e-6)
        if key.startswith("epsilon"):  # stored as float32, rounded up: still upper bounds
            assert all(v >= e for (_, v), (_, e) in zip(got, _expected(rows, key), strict=True))
    events = event_accumulator.EventAccumulator(str(directory))
    events.Reload()
    walls = {e.wall_time for e in events.Scalars("test_accuracy")}
    assert len(walls) == 1  # not the rounds'
    # nor the run's length: the event files' modification time is the run's start
    (wall,) = walls
    files = list(directory.glob("events.out.tfevents.*"))
    assert files and all(f.stat().st_mtime == pytest.approx(wall, abs=1e-3) for f in files)


def test_an_interrupted_run_is_killed_and_resuming_continues_it(
    store: Path, tmp_path: Path
) -> None:
    tb = tmp_path / "tb"
    config = _config(
        {"mlflow": str(store), "tensorboard": str(tb)},
        name="tiny-resume",
        training={**TINY["training"], "rounds": 3},
        privacy={"noise_multiplier": 1.5, "group_size": 3},
    )

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, out, progress=_stop_in_round_two, log=lambda m: None)
    (run,) = _runs(store, "tiny-resume")
    assert run.info.status == "KILLED" and run.data.tags["silodp.status"] == "interrupted"
    assert [s for s, _ in _history(store, run.info.run_id, "test_accuracy")] == [1, 2]

    resume_experiment(out, log=lambda m: None)
    (resumed,) = _runs(store, "tiny-resume")  # the same MLflow run, continued
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    rows = _rows(out / "uldp_sgd")
    assert [r["round"] for r in rows] == [1, 2, 3]
    directory = tb / "tiny-resume" / "uldp_sgd"
    for key in ("test_accuracy", "epsilon/subject"):
        assert _history(store, run.info.run_id, key) == _expected(rows, key)
        assert [s for s, _ in _scalars(directory, key)] == [1, 2, 3]
    assert "summary.json" in {a.path for a in _client(store).list_artifacts(run.info.run_id)}


def test_resuming_logs_the_kept_rounds_not_logged_yet(store: Path, tmp_path: Path) -> None:
    settings = TrackingConfig(mlflow=str(store), tensorboard=str(tmp_path / "tb"))
    run = tracking.TrackedRun(
        experiment="grid-x/003-cell",
        name="dpsgd",
        run_dir=tmp_path / "run",
        config={"training": {"rounds": 3}},
        params={"algorithm": "dpsgd", "target_epsilon": None},
    )
    rows = [
        {"round": i, "test_accuracy": 0.25 * i, "test_loss": None, "epsilon": {"subject": e}}
        for i, e in ((1, 1.0), (2, float("inf")), (3, 3.0))
    ]
    with tracking.open_run(settings, run) as tracker:
        tracker.log_round(rows[0])
        tracker.close("interrupted")
    # the checkpoint kept rounds 1 and 2 (round 2 never reached the trackers)
    with tracking.open_run(settings, run, resume=True, previous=rows[:2]) as tracker:
        tracker.log_round(rows[2])
        tracker.close("complete", tmp_path / "run")
    (found,) = _runs(store, "grid-x")  # a sweep's cells share their sweep's experiment
    assert found.info.run_name == "003-cell/dpsgd"
    assert found.data.params["algorithm"] == "dpsgd" and "target_epsilon" not in found.data.params
    assert _history(store, found.info.run_id, "test_accuracy") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert _history(store, found.info.run_id, "epsilon/subject") == [(1, 1.0), (3, 3.0)]
    assert _history(store, found.info.run_id, "test_loss") == []
    directory = tmp_path / "tb" / "grid-x" / "003-cell" / "dpsgd"
    assert [s for s, _ in _scalars(directory, "test_accuracy")] == [1, 2, 3]


def test_a_failing_block_ends_the_run_as_failed(store: Path, tmp_path: Path) -> None:
    run = tracking.TrackedRun(
        experiment="tiny-failed", name="fedavg", run_dir=tmp_path, config={}, params={}
    )
    with pytest.raises(RuntimeError), tracking.open_run(TrackingConfig(mlflow=str(store)), run):
        raise RuntimeError("boom")
    (found,) = _runs(store, "tiny-failed")
    assert found.info.status == "FAILED" and found.data.tags["silodp.status"] == "failed"


def test_a_store_that_cannot_be_opened_is_named(store: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.db").write_bytes(b"not a database" * 100)
    run = tracking.TrackedRun(experiment="x", name="y", run_dir=tmp_path, config={})
    bad = TrackingConfig(mlflow=f"sqlite:///{tmp_path / 'bad.db'}")
    with pytest.raises(InvalidValueError, match=r"Expected tracking\.mlflow='sqlite:///.*bad\.db'"):
        tracking.open_run(bad, run)


def test_a_writer_failing_mid_run_is_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        name = "mlflow"

        def log_round(self, row: Any) -> None:
            raise RuntimeError("disk full")

        def close(self, status: str, run_dir: Path | None = None) -> None:
            raise AssertionError("a dropped writer is not closed")

    tracker = tracking.Tracker([Broken()])
    tracker.log_round({"round": 1})
    tracker.close("complete")
    assert "tracking: mlflow could not log a round (disk full)" in caplog.text


def test_off_by_default_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = _config(
        algorithms=["fedavg"],
        training={**TINY["training"], "rounds": 1},
        data={**TINY["data"], "max_records": 100},
    )
    assert config.tracking is None
    assert parse_config({**TINY, "tracking": {}}).tracking is None
    run_experiment(config, tmp_path / "out", log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not [p for p in (tmp_path / "out").rglob("*") if "tfevents" in p.name]
    assert "[tracking]" not in (tmp_path / "out" / "fedavg" / "config.toml").read_text()


@pytest.mark.parametrize(
    ("key", "package"),
    [("mlflow", "mlflow"), ("mlflow", "alembic"), ("tensorboard", "tensorboard")],
)
def test_a_missing_package_is_named_before_anything_trains(
    key: str, package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails, as if not installed
    config = _config({key: str(tmp_path / "store")})
    message = rf"tracking\.{key} needs .*{package}.*pip install 'silodp\[tracking\]'"
    with pytest.raises(ConfigError, match=message):
        run_experiment(config, tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "store").exists()
    run = tracking.TrackedRun(experiment="x", name="y", run_dir=tmp_path, config={})
    with pytest.raises(ConfigError, match=message):  # the lazy import says the same
        tracking.open_run(config.tracking, run)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mlflow": "file:./mlruns"}, r"tracking\.mlflow='file:./mlruns'.*sqlite:///PATH"),
        ({"mlflow": "http://localhost:5000"}, r"on this machine.*'http' URI"),
        ({"mlflow": "sqlite://"}, r"to name a database file"),
        ({"mlflow": ""}, r"tracking\.mlflow='' to be a path"),
        ({"tensorboard": 3}, r"tracking\.tensorboard=3 to be a path"),
        ({"wandb": "x"}, r"Unknown key\(s\) \['wandb'\] in \[tracking\]"),
    ],
)
def test_bad_tracking_values_are_refused_naming_them(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({**TINY, "tracking": table})


def test_stores_and_paths_resolve_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert tracking.mlflow_store("runs/ml") == (
        f"sqlite:///{tmp_path / 'runs/ml/mlflow.db'}",
        tmp_path / "runs/ml/mlartifacts",
    )
    assert tracking.mlflow_store("sqlite:///db/x.db") == (
        f"sqlite:///{tmp_path / 'db/x.db'}",
        tmp_path / "db/mlartifacts",
    )
    run = tracking.TrackedRun(experiment="a b/..", name="alg/p0.5", run_dir=tmp_path, config={})
    assert tracking.tensorboard_dir("tb", run) == tmp_path / "tb/a_b/__/alg/p0.5"
    config = parse_config({**TINY, "tracking": {"mlflow": "sqlite:///db/x.db"}})
    assert to_toml_dict(config)["tracking"] == {"mlflow": "sqlite:///db/x.db"}
    assert parse_config(to_toml_dict(config)) == config


def test_round_metrics_keep_the_finite_numbers() -> None:
    row = {
        "round": 4,
        "test_accuracy": 0.5,
        "test_loss": None,
        "epsilon": {"record": 1.5, "subject": float("inf"), "silo": None},
        "epsilon_route": {"record": "pld"},
        "silos": [0, 1],
        "adversary": "strongest",
        "personalised_accuracy": 0.75,
    }
    row["epsilon_by_adversary"] = {"released": {"subject": 2.0}, "silos": {"subject": None}}
    # an ε without a finite bound is logged as such, never left out (it read as no ε at all)
    assert tracking.round_metrics(row) == {
        "test_accuracy": 0.5,
        "epsilon/record": 1.5,
        "epsilon_unbounded/subject": 1.0,
        "epsilon_unbounded/silo": 1.0,
        "epsilon_by_adversary/released/subject": 2.0,
        "epsilon_by_adversary_unbounded/silos/subject": 1.0,
        "personalised_accuracy": 0.75,
    }


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mlflow": "{f}/mlruns"}, r"Expected tracking\.mlflow '.*afile/mlruns' to be a directory"),
        ({"tensorboard": "{f}/tb"}, r"Expected tracking\.tensorboard '.*afile/tb' to be a direc"),
        ({"mlflow": "sqlite:///{f}/m.db"}, r"directory of tracking\.mlflow's database '.*afile'"),
        ({"mlflow": "sqlite:///{f}"}, r"tracking\.mlflow='sqlite:///.*afile'.* not an SQLite"),
    ],
)
def test_a_store_that_cannot_be_written_is_refused_before_anything_is_written(
    table: dict[str, str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store under a regular file used to fail with "[Errno 20] Not a directory" when the
    first run opened it, leaving experiment.toml, a run's config.toml and ledger (a run
    'running', 0 rounds) and silo_private/data.json in --out."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was loaded before the tracking store was checked")

    monkeypatch.setattr("silodp.experiment.run.build_federated_data", no_data)
    config = _config({k: v.format(f=blocker) for k, v in table.items()})
    with pytest.raises(InvalidValueError, match=message):
        run_experiment(config, tmp_path / "out", log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert blocker.read_text() == "not a directory"


def test_float32_up_never_rounds_below() -> None:
    for value in (2.132053720762905, 0.1, 1.0, 3.3583535231891175, 1e-30, 7e37):
        up = tracking.float32_up(value)
        assert up >= value and up == float(np.float32(up))
        assert up - value <= abs(value) * 2**-23


def test_a_run_stopped_at_its_target_logs_the_epsilon_it_was_charged(tmp_path: Path) -> None:
    """A PriFedSync cell that stops at its accuracy target is charged its whole plan; its
    trackers' last ε was the one at the stop (smaller). TensorBoard's float32 values were
    rounded to nearest, some below the computed ε."""
    raw = {
        "name": "stops",
        "algorithms": ["prifedsync"],
        "data": {"source": "digits", "num_silos": 4, "allocation": "shards",
                 "shards_per_client": 2},
        "model": {"name": "mlp"},
        "training": {"rounds": 3, "local_steps": 3, "batch_size": 8, "lr": 0.01,
                     "optimizer": "adam", "helper": "interpolate", "alpha": 0.1},
        "privacy": {"noise_multiplier": 1.0},
        "sweep": {"client_rate": [0.5], "noise_multiplier": [1.0], "target_accuracy": 0.01},
        "tracking": {"tensorboard": str(tmp_path / "tb")},
    }  # fmt: skip
    summary = run_experiment(parse_config(raw), tmp_path / "out", log=lambda m: None)
    (item,) = summary["runs"]
    assert item["stopped_at_round"] == 1 and item["rounds_charged"] == 3
    (directory,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    got = _scalars(directory, "epsilon/record")
    assert [step for step, _ in got] == [1, 3]
    assert got[0][1] >= item["epsilon_at_stop"]["record"]
    assert got[-1][1] >= item["epsilon"]["record"] > got[0][1]
    assert got[-1][1] == tracking.float32_up(item["epsilon"]["record"])
    for who, units in item["epsilon_by_adversary"].items():
        last = _scalars(directory, f"epsilon_by_adversary/{who}/record")[-1]
        assert last[0] == 3 and last[1] >= units["record"]


def test_an_interrupted_run_logs_the_ledger_charge_of_its_cut_round(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped once a silo of round 2 was charged (its update may have been released): the
    summary's ε is the ledger's charge, and the trackers said only round 1's ε. They now
    log the charge (``charged_epsilon/...`` at round 2) and the summary; a resume still logs
    round 2 when it runs again."""

    tb = tmp_path / "tb"
    config = _config(
        {"mlflow": str(store), "tensorboard": str(tb)},
        name="tiny-charged",
        algorithms=["local_item_dp"],
        training={**TINY["training"], "rounds": 3},
        privacy={"noise_multiplier": 1.5, "group_size": 3},
    )
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run_cut_at(config, out, monkeypatch, "silo_recorded", 2)
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["rounds_charged_not_completed"] == [2]
    charged = summary["epsilon"]["record"]
    assert charged > summary["epsilon_of_completed_rounds"]["record"]
    (run,) = _runs(store, "tiny-charged")
    assert _history(store, run.info.run_id, "charged_epsilon/record") == [(2, charged)]
    assert [s for s, _ in _history(store, run.info.run_id, "epsilon/record")] == [1]
    assert "summary.json" in {a.path for a in _client(store).list_artifacts(run.info.run_id)}
    directory = tb / "tiny-charged" / "local_item_dp"
    ((step, value),) = _scalars(directory, "charged_epsilon/record")
    assert step == 2 and value >= charged  # float32, rounded up

    resume_experiment(out, log=lambda m: None)
    rows = _rows(out / "local_item_dp")
    for key in ("test_accuracy", "epsilon/record"):
        assert _history(store, run.info.run_id, key) == _expected(rows, key)
        assert [s for s, _ in _scalars(directory, key)] == [1, 2, 3]
    # the round run again is charged both attempts: not below the charge logged at the cut
    assert rows[1]["epsilon"]["record"] >= charged


def test_a_resumed_run_finds_its_tensorboard_logs_set_aside_by_a_later_run(
    tmp_path: Path,
) -> None:
    """Run A is interrupted; run B of the same config, into another directory, sets A's
    logs aside. Resuming A appended to B's logs (and skipped the rounds B had logged); it
    now continues A's own, wherever they were set aside."""
    tb = tmp_path / "tb"
    config = _config(
        {"tensorboard": str(tb)},
        name="tiny-aside",
        training={**TINY["training"], "rounds": 3},
        privacy={"noise_multiplier": 1.5, "group_size": 3},
    )

    first, second = tmp_path / "a", tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, first, progress=_stop_in_round_two, log=lambda m: None)
    run_experiment(config, second, log=lambda m: None)
    named = tb / "tiny-aside" / "uldp_sgd"
    (aside,) = named.parent.glob("uldp_sgd.replaced-*")
    files = sorted(named.glob("events.out.tfevents.*"))
    resume_experiment(first, log=lambda m: None)
    assert sorted(named.glob("events.out.tfevents.*")) == files  # B's logs untouched
    for run_dir, directory in ((first, aside), (second, named)):
        rows = _rows(run_dir / "uldp_sgd")
        for key in ("test_accuracy", "epsilon/subject"):
            got = _scalars(directory, key)
            assert [s for s, _ in got] == [1, 2, 3]
            assert [v for _, v in got] == pytest.approx([v for _, v in _expected(rows, key)])


def test_a_stop_while_the_outputs_are_written_logs_the_summary(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after the last round, while the plots and summary are written: the trackers
    were closed with nothing of the summary, and the summary said the ledger could not be
    read back (it was closed)."""

    config = _config(
        {"mlflow": str(store)},
        name="tiny-outputs",
        algorithms=["local_item_dp"],
        privacy={"noise_multiplier": 1.5, "group_size": 3},
    )
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run_cut_at(config, out, monkeypatch, "run_recorded", None)
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 2
    assert not any("could not be read back" in note for note in summary["notes"])
    (run,) = _runs(store, "tiny-outputs")
    assert run.info.status == "KILLED"
    assert "summary.json" in {a.path for a in _client(store).list_artifacts(run.info.run_id)}


def _tb_run(tb: Path, run_dir: Path) -> tracking.TrackedRun:
    return tracking.TrackedRun(experiment="tb-keys", name="algo", run_dir=run_dir, config={})


def _tb_log(tb: Path, run_dir: Path, rounds: list[int], *, resume: bool) -> None:
    settings = TrackingConfig(tensorboard=str(tb))
    with tracking.open_run(settings, _tb_run(tb, run_dir), resume=resume) as tracker:
        for r in rounds:
            tracker.log_round({"round": r, "test_accuracy": 0.1 * r})
        tracker.close("complete")


def test_tensorboard_directories_without_a_run_key_are_never_claimed_blindly(
    tmp_path: Path,
) -> None:
    """Logs written before directories named their run (no key file): a resumed run
    continues them while no run was set aside beside them (they can only be its own), and
    starts its own ``.run-<key>`` directory when one was (they may be the later run's); it
    never writes its key into logs it did not start. A fresh run's directory is its own,
    whatever key a leftover file holds; a resumed run finds its own logs set aside even
    where the later run's directory is gone."""
    tb = tmp_path / "tb"
    named = tb / "tb-keys" / "algo"
    a, b = tmp_path / "a", tmp_path / "b"
    _tb_log(tb, a, [1, 2], resume=False)
    (named / tracking.TB_RUN_KEY).unlink()  # as an older version left them
    _tb_log(tb, a, [3], resume=True)
    assert [s for s, _ in _scalars(named, "test_accuracy")] == [1, 2, 3]
    assert not (named / tracking.TB_RUN_KEY).exists()
    # a later run sets them aside; the key-less logs beside it could be either run's
    _tb_log(tb, b, [1], resume=False)
    (named / tracking.TB_RUN_KEY).unlink()
    _tb_log(tb, a, [4], resume=True)
    (own,) = named.parent.glob("algo.run-*")
    assert [s for s, _ in _scalars(own, "test_accuracy")] == [4]
    assert [s for s, _ in _scalars(named, "test_accuracy")] == [1]
    # a leftover key with no logs: a fresh run writes its own over it
    c = tmp_path / "c"
    for path in named.glob("events.out.tfevents.*"):
        path.unlink()
    _tb_log(tb, a, [5], resume=True)  # its own found again, not the emptied directory
    assert [s for s, _ in _scalars(own, "test_accuracy")] == [4, 5]
    assert not list(named.glob("events.out.tfevents.*"))
    (named / tracking.TB_RUN_KEY).write_text("another run's key\n")
    _tb_log(tb, c, [1], resume=False)
    assert _has_key(named, c)
    _tb_log(tb, c, [2], resume=True)
    assert [s for s, _ in _scalars(named, "test_accuracy")] == [1, 2]
    # c's logs set aside by d, d's directory then removed: c still finds its own
    d = tmp_path / "d"
    _tb_log(tb, d, [1], resume=False)
    for path in named.iterdir():
        path.unlink()
    named.rmdir()
    _tb_log(tb, c, [3], resume=True)
    (aside,) = [p for p in named.parent.glob("algo.replaced-*") if _has_key(p, c)]
    assert [s for s, _ in _scalars(aside, "test_accuracy")] == [1, 2, 3]
    assert not named.exists()


def _has_key(directory: Path, run_dir: Path) -> bool:
    marker = directory / tracking.TB_RUN_KEY
    return marker.is_file() and marker.read_text().strip() == tracking._run_key(run_dir)
