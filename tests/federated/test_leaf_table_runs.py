"""Runs from the file formats users bring: LEAF JSON (FEMNIST, Shakespeare) and CSV tables."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from silodp.config import parse_config
from silodp.data.build import DataConfig
from silodp.data.loaders import LEAF_ALL_LETTERS
from silodp.errors import InvalidValueError
from silodp.experiment import run_experiment

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write_leaf(path: Path, users: dict[str, tuple[list, list]]) -> None:
    blob = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(blob))


def _femnist_users(rng: np.random.Generator, n_users: int, per_user: int) -> dict:
    return {
        f"f{u:04d}": (
            rng.random((per_user, 784)).round(3).tolist(),
            rng.integers(0, 62, per_user).tolist(),
        )
        for u in range(n_users)
    }


def _shakespeare_users(rng: np.random.Generator, n_users: int, per_user: int) -> dict:
    letters = np.array(list(LEAF_ALL_LETTERS))
    return {
        f"CHAR_{u}": (
            ["".join(rng.choice(letters, 80)) for _ in range(per_user)],
            [str(c) for c in rng.choice(letters, per_user)],
        )
        for u in range(n_users)
    }


def _config_from_file(name: str, **data: object) -> dict:
    raw = tomllib.loads((CONFIGS / name).read_text())
    raw["data"].update(data)
    raw["algorithms"] = ["local_item_dp", "higradavg_dp"]
    raw["training"].update({"rounds": 1, "local_steps": 1, "batch_size": 4})
    return raw


@pytest.mark.slow
def test_small_femnist_config_runs_on_leaf_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "train").mkdir()
    _write_leaf(tmp_path / "train" / "a.json", _femnist_users(rng, 20, 6))
    _write_leaf(tmp_path / "test.json", _femnist_users(rng, 4, 3))
    raw = _config_from_file(
        "femnist_small.toml",
        path=str(tmp_path / "train"),
        test_path=str(tmp_path / "test.json"),
        num_silos=4,
        first_subjects=15,
    )
    summary = run_experiment(parse_config(raw), tmp_path / "out")
    data = json.loads((tmp_path / "out" / "silo_private" / "data.json").read_text())
    assert data["num_subjects"] == 15 and data["num_silos"] == 4
    for item in summary["runs"]:
        assert item["status"] == "complete"
        assert (
            3.5
            < item["epsilon"]["subject" if item["algorithm"] != "local_item_dp" else "record"]
            <= 4.0
        )


@pytest.mark.slow
def test_shakespeare_config_runs_on_leaf_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    _write_leaf(tmp_path / "train.json", _shakespeare_users(rng, 12, 5))
    _write_leaf(tmp_path / "test.json", _shakespeare_users(rng, 3, 2))
    raw = _config_from_file(
        "shakespeare.toml",
        path=str(tmp_path / "train.json"),
        test_path=str(tmp_path / "test.json"),
        num_silos=3,
    )
    summary = run_experiment(parse_config(raw), tmp_path / "out")
    assert all(item["status"] == "complete" for item in summary["runs"])


def test_csv_table_with_subject_and_silo_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    n = 400
    x = rng.normal(size=(n, 5))
    label = (x[:, 0] + 0.3 * rng.normal(size=n) > 0).astype(int)
    lines = ["f0,f1,f2,f3,f4,label,patient,hospital"]
    for i in range(n):
        lines.append(
            ",".join(f"{v:.5f}" for v in x[i])
            + f",{label[i]},p{rng.integers(0, 50)},h{rng.integers(0, 3)}"
        )
    (tmp_path / "t.csv").write_text("\n".join(lines))
    raw = {
        "algorithms": ["higradavg_dp"],
        "data": {
            "source": "table",
            "path": str(tmp_path / "t.csv"),
            "feature_columns": ["f0", "f1", "f2", "f3", "f4"],
            "label_column": "label",
            "label_values": [0, 1],
            "subject_column": "patient",
            "silo_column": "hospital",
            "allocation": "column",
        },
        "training": {"rounds": 4, "local_steps": 5, "batch_size": 40, "lr": 0.5},
        "privacy": {"epsilon": 8.0},
    }
    summary = run_experiment(parse_config(raw), tmp_path / "out")
    item = summary["runs"][0]
    assert item["status"] == "complete" and item["epsilon"]["subject"] <= 8.0
    data = json.loads((tmp_path / "out" / "silo_private" / "data.json").read_text())
    # 10 of the 50 patients are held out whole: nobody is in both train and test
    assert data["num_silos"] == 3 and data["num_subjects"] == 40
    assert data["split"]["kind"] == "subject" and data["split"]["shared_subjects"] == 0


def test_uldp_tabular_config_runs_every_method_on_a_generated_csv(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    n = 600
    x = rng.normal(size=(n, 8))
    label = (x[:, 0] - x[:, 1] + 0.3 * rng.normal(size=n) > 0).astype(int)
    customer = rng.zipf(2.0, n) % 60
    bank = rng.integers(0, 4, n)
    header = ",".join([f"f{i}" for i in range(8)] + ["label", "customer", "bank"])
    rows = [
        ",".join(f"{v:.5f}" for v in x[i]) + f",{label[i]},c{customer[i]},b{bank[i]}"
        for i in range(n)
    ]
    (tmp_path / "table.csv").write_text("\n".join([header, *rows]))
    raw = tomllib.loads((CONFIGS / "uldp_tabular.toml").read_text())
    raw["data"]["path"] = str(tmp_path / "table.csv")
    # one round: its 3072-bit keys carry one parameter per ciphertext (n_max = 2000), so each
    # round of uldp_avg_w costs about 70 s
    raw["training"]["rounds"] = 1
    summary = run_experiment(parse_config(raw), tmp_path / "out")
    assert [r["algorithm"] for r in summary["runs"]] == raw["algorithms"]
    for item in summary["runs"]:
        assert item["status"] == "complete" and item["rounds_completed"] == 1
        if item["algorithm"] != "fedavg":
            assert 3.0 < item["epsilon"]["subject"] <= 4.0
    assert (tmp_path / "out" / "comparison.png").is_file()


def test_a_private_run_needs_the_table_s_classes_declared(tmp_path: Path) -> None:
    """The model has one output per class: read from the labels, one record with a label
    nobody else has adds an output to the released model (no ε covers that), so a private
    run refuses such a table; declared classes give every table the same model."""
    rng = np.random.default_rng(3)
    n = 120
    frame = pd.DataFrame(
        {"a": rng.normal(size=n), "b": rng.normal(size=n), "label": rng.integers(0, 2, size=n)}
    )
    rare = pd.concat([frame, pd.DataFrame({"a": [0.1], "b": [0.2], "label": [2]})])
    frame.to_csv(tmp_path / "t.csv", index=False)
    rare.to_csv(tmp_path / "rare.csv", index=False)

    def raw(path: str, algorithms: list[str], **data: object) -> dict:
        return {
            "algorithms": algorithms,
            "data": {"source": "table", "path": str(tmp_path / path), **data},
            "training": {"rounds": 1, "local_steps": 1, "batch_size": 16, "lr": 0.1},
            "privacy": {"noise_multiplier": 1.0, "group_size": 1},
        }

    with pytest.raises(InvalidValueError, match="Expected \\[data\\] label_values"):
        run_experiment(parse_config(raw("t.csv", ["local_item_dp"])), tmp_path / "a")
    assert not (tmp_path / "a").exists()
    # without privacy the classes may come from the data
    run_experiment(parse_config(raw("t.csv", ["fedavg"])), tmp_path / "b")
    shapes = {}
    for path in ("t.csv", "rare.csv"):
        out = tmp_path / f"c_{path}"
        config = raw(path, ["local_item_dp"], label_values=[0, 1, 2])
        run_experiment(parse_config(config), out)
        state = torch.load(out / "local_item_dp" / "model.pt", weights_only=True)
        shapes[path] = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["t.csv"] == shapes["rare.csv"]  # the rare record no longer shows
    assert max(s[0] for s in shapes["t.csv"].values()) >= 3
    with pytest.raises(InvalidValueError, match="not in the given label_values"):
        run_experiment(
            parse_config(raw("rare.csv", ["local_item_dp"], label_values=[0, 1])), tmp_path / "d"
        )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0], "at least 2 class labels"),
        ([0, "1"], "all integers, all strings"),
        ([0, 1, 0], "\\[0\\] repeated"),
        ("01", "a list of class labels"),
    ],
)
def test_label_values_are_checked(values: object, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        DataConfig(source="table", path="t.csv", label_values=values)
    with pytest.raises(InvalidValueError, match="tables only"):
        DataConfig(source="digits", label_values=[0, 1])
