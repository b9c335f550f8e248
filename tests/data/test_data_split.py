"""Test splits by record and by subject, subjects of tables, and what describe reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from silodp.data.build import DataConfig, build_federated_data, subject_split
from silodp.data.describe import describe, format_description


def _patients_csv(path: Path, *, n: int = 600, patients: int = 80, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "f0": rng.normal(size=n),
            "f1": rng.normal(size=n),
            "label": rng.choice(["neg", "pos"], size=n, p=[0.6, 0.4]),
            "patient": [f"p{i:03d}" for i in rng.integers(0, patients, size=n)],
            "hospital": rng.choice(["h1", "h2", "h3"], size=n),
        }
    )
    frame.to_csv(path, index=False)
    return path


def _table(path: Path, **kwargs: object) -> DataConfig:
    base: dict[str, object] = {
        "source": "table",
        "path": str(path),
        "label_column": "label",
        "subject_column": "patient",
        "silo_column": "hospital",
        "allocation": "column",
    }
    return DataConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def _test_patients(path: Path, data_x_test: np.ndarray) -> set[str]:
    frame = pd.read_csv(path)
    by_row = {
        tuple(np.float32(v) for v in row): p
        for row, p in zip(frame[["f0", "f1"]].to_numpy(), frame["patient"], strict=True)
    }
    return {by_row[tuple(row)] for row in data_x_test}


def test_subject_split_is_the_default_for_a_subject_column(tmp_path: Path) -> None:
    path = _patients_csv(tmp_path / "t.csv")
    cfg = _table(path)
    assert cfg.test_split == "subject"
    data = build_federated_data(cfg)
    train_patients = set(data.train.subject_names[i] for i in np.unique(data.train.subject))
    test_patients = _test_patients(path, data.test.x)
    assert not train_patients & test_patients
    assert len(test_patients) == round(0.2 * 80)
    d = describe(data)
    assert d["split"] == {
        "kind": "subject",
        "fraction": 0.2,
        "train_records": len(data.train),
        "test_records": len(data.test),
        "train_subjects": 64,
        "test_subjects": 16,
        "shared_subjects": 0,
    }
    assert json.loads(json.dumps(d)) == d
    text = format_description(d)
    assert "whole subjects held out" in text and "subjects on both sides             0" in text


def test_record_split_leaks_subjects_and_says_so(tmp_path: Path) -> None:
    path = _patients_csv(tmp_path / "t.csv")
    data = build_federated_data(_table(path, test_split="record"))
    train_patients = set(data.train.subject_names[i] for i in np.unique(data.train.subject))
    shared = train_patients & _test_patients(path, data.test.x)
    split = describe(data)["split"]
    assert split["kind"] == "record" and split["shared_subjects"] == len(shared) > 10
    assert split["test_subjects"] == len(_test_patients(path, data.test.x))


def test_subject_split_is_seeded_and_ignores_the_label_encoding(tmp_path: Path) -> None:
    path = _patients_csv(tmp_path / "t.csv")
    frame = pd.read_csv(path)
    frame["label"] = frame["label"].map({"neg": "z_negative", "pos": "a_positive"})
    frame.to_csv(tmp_path / "relabelled.csv", index=False)
    a = build_federated_data(_table(path, seed=3))
    b = build_federated_data(_table(path, seed=3))
    c = build_federated_data(_table(tmp_path / "relabelled.csv", seed=3))
    d = build_federated_data(_table(path, seed=4))
    np.testing.assert_array_equal(a.test.x, b.test.x)
    np.testing.assert_array_equal(a.test.x, c.test.x)  # same subjects held out
    assert not np.array_equal(a.test.x, d.test.x)


def test_subject_split_function() -> None:
    subject = np.repeat(np.arange(10), 3)
    train, test = subject_split(subject, test_fraction=0.3, rng=np.random.default_rng(0))
    assert len(np.unique(subject[test])) == 3 and len(test) == 9
    assert not set(subject[train]) & set(subject[test])
    assert np.array_equal(np.sort(np.r_[train, test]), np.arange(30))
    _, tiny = subject_split(subject, test_fraction=0.01, rng=np.random.default_rng(0))
    assert len(np.unique(subject[tiny])) == 1  # at least one subject held out
    with pytest.raises(ValueError, match="at least 2 subjects"):
        subject_split(np.zeros(5, dtype=np.int64), test_fraction=0.5, rng=np.random.default_rng(0))


def test_split_config_errors() -> None:
    with pytest.raises(ValueError, match="test_split='random'"):
        DataConfig(source="table", path="t.csv", test_split="random")
    with pytest.raises(ValueError, match="test_split='subject' needs the subjects before"):
        DataConfig(test_split="subject")
    with pytest.raises(ValueError, match="test_split=None with test_path='u.csv'"):
        DataConfig(source="table", path="t.csv", test_path="u.csv", test_split="record")
    assert DataConfig().test_split == "record"
    assert DataConfig(source="table", path="t.csv", test_path="u.csv").test_split is None


def test_digits_split_has_no_test_subjects() -> None:
    data = build_federated_data(DataConfig(max_records=300))
    d = describe(data)
    assert d["split"]["kind"] == "record" and d["split"]["test_subjects"] is None
    assert d["split"]["shared_subjects"] is None
    assert d["subjects"] == {
        "from": "simulated",
        "note": "simulated: 100 subjects drawn for the training records",
    }
    assert "unknown (test records carry no subject)" in format_description(d)


# --- tables without a subject column --------------------------------------------------------


def test_a_table_without_subject_column_has_one_subject_per_record(tmp_path: Path) -> None:
    path = _patients_csv(tmp_path / "t.csv", n=100)
    cfg = DataConfig(source="table", path=str(path), feature_columns=("f0", "f1"))
    assert cfg.num_subjects is None and cfg.test_split == "record"
    data = build_federated_data(cfg)
    train = data.train
    assert train.num_subjects == len(train) == 80
    assert train.max_records_per_subject() == 1
    d = describe(data)
    assert d["subjects_with_records"] == d["num_subjects"] == 80
    assert d["subjects"]["from"] == "records"
    assert d["split"]["test_subjects"] == 20 and d["split"]["shared_subjects"] == 0
    text = format_description(d)
    assert "no subject column: each record is its own subject" in text
    assert "80 / 80" in text


def test_inventing_subjects_for_a_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_subjects=100 would invent subjects"):
        DataConfig(source="table", path="t.csv", num_subjects=100)
    with pytest.raises(ValueError, match="allocation='zipf' draws simulated subjects"):
        DataConfig(source="table", path="t.csv", allocation="zipf")
    with pytest.raises(ValueError, match="labels_per_subject=2 needs subjects drawn"):
        DataConfig(source="table", path="t.csv", labels_per_subject=2)
    with pytest.raises(ValueError, match="simulated_subjects=True applies to a table without"):
        DataConfig(source="table", path="t.csv", subject_column="p", simulated_subjects=True)
    with pytest.raises(ValueError, match="simulated_subjects=True applies"):
        DataConfig(simulated_subjects=True)


def test_simulated_subjects_are_an_explicit_choice(tmp_path: Path) -> None:
    path = _patients_csv(tmp_path / "t.csv", n=200)
    cfg = DataConfig(
        source="table",
        path=str(path),
        feature_columns=("f0", "f1"),
        simulated_subjects=True,
        allocation="zipf",
        num_subjects=12,
    )
    data = build_federated_data(cfg)
    assert data.train.num_subjects <= 12
    d = describe(data)
    assert d["subjects"]["from"] == "simulated"
    assert "not people in the table" in d["subjects"]["note"]
    assert d["split"]["shared_subjects"] is None


def test_describe_still_takes_a_training_dataset(tmp_path: Path) -> None:
    data = build_federated_data(_table(_patients_csv(tmp_path / "t.csv", n=120)))
    d = describe(data.train)
    assert "split" not in d and "subjects" not in d
    assert "Test split" not in format_description(d)


def test_leaf_users_split_by_record_by_default_or_by_subject(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    users = {f"w{i:02d}": int(rng.integers(5, 15)) for i in range(12)}
    blob = {
        "users": list(users),
        "num_samples": list(users.values()),
        "user_data": {
            u: {"x": rng.random((c, 784)).round(2).tolist(), "y": rng.integers(0, 62, c).tolist()}
            for u, c in users.items()
        },
    }
    (tmp_path / "train.json").write_text(json.dumps(blob))
    leaf = {"source": "leaf_femnist", "path": str(tmp_path / "train.json"), "num_silos": 2}
    by_record = describe(build_federated_data(DataConfig(**leaf)))  # type: ignore[arg-type]
    assert by_record["split"]["kind"] == "record" and by_record["split"]["shared_subjects"] > 0
    assert by_record["subjects"]["from"] == "leaf_users"
    by_subject = describe(
        build_federated_data(DataConfig(**leaf, test_split="subject"))  # type: ignore[arg-type]
    )
    assert by_subject["split"]["test_subjects"] == 2
    assert by_subject["split"]["shared_subjects"] == 0
    assert by_subject["subjects_with_records"] == 10
    (tmp_path / "test.json").write_text(json.dumps(blob))
    with_file = describe(
        build_federated_data(DataConfig(**leaf, test_path=str(tmp_path / "test.json")))  # type: ignore[arg-type]
    )
    assert with_file["split"]["kind"] == "file" and with_file["split"]["fraction"] is None
    # LEAF test files carry their users: counted (every writer is on both sides here)
    assert with_file["split"]["test_subjects"] == 12 == with_file["split"]["shared_subjects"]
    # first_subjects keeps the first writers before the split, and their test records only
    # (it cut the training side after the split: the test side kept everyone, and a record
    # split's fraction no longer held)
    reordered = {**blob, "users": list(users)[::-1], "num_samples": list(users.values())[::-1]}
    (tmp_path / "test.json").write_text(json.dumps(reordered))  # test users by name
    first = build_federated_data(DataConfig(**leaf, first_subjects=5))  # type: ignore[arg-type]
    info = describe(first)["split"]
    assert info["test_subjects"] <= 5 and describe(first)["subjects_with_records"] == 5
    kept = sum(list(users.values())[:5])
    assert len(first.train) + len(first.test) == kept
    assert len(first.test) == pytest.approx(0.2 * kept, abs=62)  # stratified per label
    filed = build_federated_data(
        DataConfig(**leaf, first_subjects=5, test_path=str(tmp_path / "test.json"))  # type: ignore[arg-type]
    )
    assert len(filed.test) == kept
    assert describe(filed)["split"]["test_subjects"] == 5


def test_a_subject_split_that_holds_out_a_whole_class_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Subjects are held out whatever their labels: when the held-out ones had every record of
    a class, training never saw it, and nothing said so."""
    rng = np.random.default_rng(0)
    n = 200
    patient = rng.integers(1, 10, size=n)
    label = rng.choice(["neg", "pos"], size=n).astype(object)
    patient[:5], label[:5] = 0, "rare"  # one patient holds the rare class
    frame = pd.DataFrame(
        {
            "f0": rng.normal(size=n),
            "label": label,
            "patient": [f"p{i}" for i in patient],
            "hospital": rng.choice(["h1", "h2"], size=n),
        }
    )
    path = tmp_path / "t.csv"
    frame.to_csv(path, index=False)
    seen = set()
    for seed in range(12):
        caplog.clear()
        with caplog.at_level("WARNING", logger="silodp.data.split"):
            data = build_federated_data(_table(path, seed=seed, test_fraction=0.3))
        lost = len(np.unique(data.train.y)) < 3
        warned = any(
            "held out every record of class(es) ['rare']" in r.getMessage() for r in caplog.records
        )
        assert warned == lost
        seen.add(lost)
    assert seen == {True, False}
