"""Checks made when a run starts or resumes, before anything is written: the model fits the
data's records, and a resumed run continues on the data it started on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from silodp.config import parse_config
from silodp.data import FederatedData, FederatedDataset
from silodp.data.dataset import TestSplit
from silodp.errors import InvalidValueError
from silodp.experiment import resume_experiment, run_experiment
from silodp.experiment.prepare import prepare_run
from silodp.models import build_model

DATA_DIGEST_FILE = "data_digest.json"  # silodp.experiment.digest.DATA_DIGEST_FILE


def _write_table(path: Path, n: int, *, start: int = 0, subjects: str = "c") -> None:
    rng = np.random.default_rng(start)
    lines = [] if path.exists() else ["f0,f1,f2,label,customer,bank"]
    for i in range(start, start + n):
        f = rng.normal(size=3)
        lines.append(
            f"{f[0]:.4f},{f[1]:.4f},{f[2]:.4f},{int(f[0] > 0)},{subjects}{i % 30},b{i % 3}"
        )
    with path.open("a") as handle:
        handle.write("\n".join(lines) + "\n")


def _table_config(path: Path, model: str, rounds: int = 1, **extra: Any) -> Any:
    return parse_config(
        {
            "name": "start-checks",
            "algorithms": ["local_item_dp", "uldp_avg"],
            "data": {
                "source": "table",
                "path": str(path),
                "feature_columns": ["f0", "f1", "f2"],
                "label_values": [0, 1],
                "subject_column": "customer",
                "silo_column": "bank",
                "allocation": "column",
                "test_split": "subject",
            },
            "model": {"name": model},
            "training": {"rounds": rounds, "local_steps": 1, "batch_size": 8, "lr": 0.3},
            "privacy": {"noise_multiplier": 1.0, "group_size": 4, "noise": "seeded"},
            **extra,
        }
    )


# --- bug 1: a model that does not fit the data is refused before anything is written ------


@pytest.mark.parametrize(
    ("model", "expects"),
    [("shakespeare_lstm", "integer token ids"), ("mnist_cnn", "images of shape")],
)
def test_a_model_that_does_not_fit_the_table_is_refused_before_anything_is_written(
    tmp_path: Path, model: str, expects: str
) -> None:
    _write_table(tmp_path / "t.csv", 120)
    out = tmp_path / "out"
    with pytest.raises(InvalidValueError) as caught:
        run_experiment(_table_config(tmp_path / "t.csv", model), out, log=lambda m: None)
    message = str(caught.value)
    assert f"name = {model!r}" in message and expects in message
    assert "shape (3,)" in message and "dtype float32" in message
    assert not out.exists()  # no experiment.toml, silo_private/data.json or run directory


def _token_data() -> FederatedData:
    rng = np.random.default_rng(0)
    n = 60
    train = FederatedDataset(
        x=rng.integers(0, 20, size=(n, 8)).astype(np.int64),
        y=rng.integers(0, 20, size=n),
        silo=np.arange(n) % 3,
        subject=np.arange(n) % 12,
        num_classes=20,
    )
    test = TestSplit(x=rng.integers(0, 20, size=(10, 8)).astype(np.int64), y=np.zeros(10))
    return FederatedData(train=train, test=test, name="tokens")


@pytest.mark.parametrize("model", ["mlp", "linear"])
def test_a_dense_model_refuses_token_ids(model: str) -> None:
    config = parse_config(
        {
            "algorithms": ["fedavg"],
            "model": {"name": model},
            "training": {"rounds": 1, "local_steps": 1, "batch_size": 8},
        }
    )
    with pytest.raises(InvalidValueError, match=r"shape \(8,\), dtype int64.*token ids"):
        prepare_run("fedavg", config, _token_data())
    with pytest.raises(InvalidValueError, match="token ids"):
        build_model(model, (8,), 20, dtype=np.int64)


def test_the_embedding_model_refuses_real_valued_features() -> None:
    with pytest.raises(InvalidValueError, match="real-valued features"):
        build_model("shakespeare_lstm", (8,), 20, dtype=np.float32)
    model = build_model("shakespeare_lstm", (8,), 20)
    with pytest.raises(InvalidValueError, match="integer token ids.*got float32"):
        model(torch.zeros(2, 8))
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 20)


# --- bug 2: a resume refuses data that changed since the run started ------------------------


class _Stop(Exception):
    pass


def _stop_after_round(at: int) -> Any:
    def progress(name: str, rounds: int) -> Any:
        def row(r: dict[str, Any]) -> None:
            if r["round"] >= at:
                raise _Stop

        return row

    return progress


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_resume_refuses_data_changed_since_the_run_started(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    _write_table(table, 120)
    original = table.read_bytes()
    out = tmp_path / "out"
    config = _table_config(table, "mlp", rounds=3)
    with pytest.raises(_Stop):
        run_experiment(config, out, log=lambda m: None, progress=_stop_after_round(2))

    _write_table(table, 12, start=500, subjects="new")  # rows of new subjects appended
    before = _files(out)
    with pytest.raises(InvalidValueError) as caught:
        resume_experiment(out, log=lambda m: None)
    message = str(caught.value)
    assert str(table) in message and "changed since the run started" in message
    assert _files(out) == before  # the refusal wrote nothing

    table.write_bytes(original)  # the data the run started on: it continues
    resume_experiment(out, log=lambda m: None)
    for name in ("local_item_dp", "uldp_avg"):
        assert (out / name / "silo_private" / DATA_DIGEST_FILE).is_file()
    assert not list(out.glob(f"*/{DATA_DIGEST_FILE}"))  # silo-private only, never released


def test_a_run_whose_digest_was_lost_is_refused(tmp_path: Path) -> None:
    """A run records its digest before its first round, so a checkpoint without one means the
    digest was lost: the resume logged a warning and continued on whatever data was there."""
    table = tmp_path / "t.csv"
    _write_table(table, 120)
    out = tmp_path / "out"
    with pytest.raises(_Stop):
        run_experiment(
            _table_config(table, "mlp", rounds=3),
            out,
            log=lambda m: None,
            progress=_stop_after_round(1),
        )
    digest = out / "local_item_dp" / "silo_private" / DATA_DIGEST_FILE
    digest.unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(InvalidValueError, match="the digest of the data run"):
        resume_experiment(out, log=lambda m: None)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
