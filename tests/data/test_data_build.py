"""DataConfig validation and build_federated_data end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from silodp.data.bounds import check_records_per_subject
from silodp.data.build import DataConfig, build_federated_data, stratified_split
from silodp.data.dataset import FederatedData
from silodp.data.describe import describe, format_description
from silodp.data.loaders import DataFileNotFoundError
from silodp.errors import InvalidValueError, SilodpError

FASHION_ROOT = Path("/usr/share/datasets/fashion-mnist")


def test_digits_default() -> None:
    data = build_federated_data(DataConfig())
    assert isinstance(data, FederatedData)
    train, test = data.train, data.test
    assert len(train) + len(test) == 1797
    assert abs(len(test) - 0.2 * 1797) < 10
    assert train.num_silos == 5 and train.num_subjects == 100 and train.num_classes == 10
    assert train.x.shape[1:] == (1, 8, 8)
    assert data.name == "digits-uniform-5silos"
    # stratified: each label's test share is ~20%
    share = np.bincount(test.y, minlength=10) / np.bincount(np.r_[train.y, test.y])
    assert np.all(np.abs(share - 0.2) < 0.02)


def test_digits_is_seeded() -> None:
    a = build_federated_data(DataConfig(allocation="power", alpha=4.0, seed=3))
    b = build_federated_data(DataConfig(allocation="power", alpha=4.0, seed=3))
    c = build_federated_data(DataConfig(allocation="power", alpha=4.0, seed=4))
    np.testing.assert_array_equal(a.train.silo, b.train.silo)
    np.testing.assert_array_equal(a.train.subject, b.train.subject)
    np.testing.assert_array_equal(a.test.y, b.test.y)
    assert not np.array_equal(a.train.silo, c.train.silo)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"allocation": "uldp_uniform"},
        {"allocation": "zipf", "num_subjects": 50},
        {"allocation": "fixed_silo", "num_subjects": 30},
        {"allocation": "dirichlet", "dirichlet_beta": 0.5},
        {"allocation": "shards", "shards_per_client": 2},
        {"allocation": "uniform", "labels_per_subject": 2},
    ],
)
def test_digits_allocations(kwargs: dict) -> None:
    train = build_federated_data(DataConfig(**kwargs)).train
    assert train.num_silos == 5
    assert np.all(train.silo_sizes() > 0)
    if kwargs["allocation"] == "shards":
        # 2 shards of ~144 label-sorted records each: a few labels per silo, not all 10
        assert all(len(np.unique(train.y[train.silo == s])) <= 6 for s in range(5))
    if kwargs.get("labels_per_subject"):
        assert max(len(np.unique(train.y[train.subject == a])) for a in range(100)) <= 2


def test_synthetic_caps_and_first_subjects() -> None:
    base = {
        "source": "synthetic",
        "max_records": 1000,
        "num_subjects": 20,
        "num_features": 6,
        "num_classes": 3,
    }
    raw = build_federated_data(DataConfig(**base))
    assert len(raw.train) + len(raw.test) == 1000
    assert raw.train.x.shape[1:] == (6,) and raw.train.num_classes == 3
    data = build_federated_data(
        DataConfig(
            **base, first_subjects=15, records_per_subject_per_silo=3, records_per_subject=10
        )
    )
    train = data.train
    assert train.num_subjects == 15
    assert train.max_records_per_subject_per_silo() <= 3
    assert train.max_records_per_subject() <= 10
    # the allocation does not depend on later steps: first_subjects then caps account for all
    kept_subjects = int((raw.train.subject < 15).sum())
    assert train.dropped_records > 0
    assert len(train) + train.dropped_records == kept_subjects
    np.testing.assert_array_equal(data.test.y, raw.test.y)


@pytest.mark.parametrize("allocation", ["uldp_uniform", "zipf", "uniform"])
def test_drawn_subjects_count_as_the_config_says_whichever_got_records(allocation) -> None:
    # Zipf's tail and ULDP's uniform draws leave some of the 300 subjects without a record; |U|
    # (the ULDP methods' divisor q·|U|, the weights' width) is still 300, not the largest id +
    # 1, which would change when the subject with the largest id leaves
    cfg = DataConfig(source="digits", num_subjects=300, max_records=400, allocation=allocation)
    train = build_federated_data(cfg).train
    if allocation != "uniform":  # (uniform hands every subject a record first)
        assert len(np.unique(train.subject)) < 300
    assert train.num_subjects == 300 and train.histogram().shape == (5, 300)
    last = int(train.subject.max())
    without = train.subset(np.flatnonzero(train.subject != last))
    assert without.num_subjects == 300


def test_max_records_subsamples_train() -> None:
    train = build_federated_data(DataConfig(max_records=300, num_subjects=30)).train
    assert len(train) == 300


def test_leaf_femnist_power_small(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    users = {f"w{i:02d}": rng.integers(5, 15) for i in range(12)}
    blob = {
        "users": list(users),
        "num_samples": [int(c) for c in users.values()],
        "user_data": {
            u: {"x": rng.random((c, 784)).round(2).tolist(), "y": rng.integers(0, 62, c).tolist()}
            for u, c in users.items()
        },
    }
    (tmp_path / "train.json").write_text(json.dumps(blob))
    cfg = DataConfig(
        source="leaf_femnist",
        path=str(tmp_path / "train.json"),
        num_silos=3,
        allocation="power",
        alpha=2.0,
        first_subjects=10,
    )
    data = build_federated_data(cfg)
    train = data.train
    assert train.num_subjects == 10 and train.num_classes == 62
    assert list(train.subject_names) == [f"w{i:02d}" for i in range(10)]
    total = sum(int(c) for c in users.values())
    assert len(data.test) == pytest.approx(0.2 * total, abs=62)
    # with a test file, the test split is that file
    (tmp_path / "test.json").write_text(json.dumps(blob))
    with_test = build_federated_data(
        DataConfig(
            source="leaf_femnist",
            path=str(tmp_path / "train.json"),
            test_path=str(tmp_path / "test.json"),
            num_silos=3,
        )
    )
    assert len(with_test.test) == total and len(with_test.train) == total


def test_leaf_shakespeare_uniform(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    text = "abcdefghij ABCDEFGHIJ.,;:!?"
    users = {name: int(rng.integers(10, 20)) for name in ("ROMEO", "JULIET", "NURSE", "FRIAR")}
    blob = {
        "users": list(users),
        "num_samples": list(users.values()),
        "user_data": {
            u: {
                "x": ["".join(rng.choice(list(text), 80)) for _ in range(c)],
                "y": [str(rng.choice(list(text))) for _ in range(c)],
            }
            for u, c in users.items()
        },
    }
    (tmp_path / "s.json").write_text(json.dumps(blob))
    data = build_federated_data(
        DataConfig(source="leaf_shakespeare", path=str(tmp_path / "s.json"), num_silos=2)
    )
    assert data.train.x.dtype == np.int64 and data.train.x.shape[1] == 80
    assert data.train.num_classes == 80 and data.train.num_subjects == 4
    assert len(data.train) + len(data.test) == sum(users.values())
    assert set(data.train.subject_names) == set(users)


def test_leaf_shakespeare_rejects_drawn_subjects(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allocation='zipf' draws its own subjects"):
        DataConfig(source="leaf_shakespeare", path=str(tmp_path), allocation="zipf")


def test_table_column_allocation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 120
    frame = pd.DataFrame(
        {
            "f1": rng.normal(size=n),
            "f2": rng.normal(size=n),
            "label": rng.choice(["a", "b"], size=n),
            "site": rng.choice(["s1", "s2", "s3"], size=n),
            "pid": rng.integers(0, 25, size=n),
        }
    )
    frame.to_parquet(tmp_path / "train.parquet")
    frame.iloc[:30].drop(columns=["site", "pid"]).to_csv(tmp_path / "test.csv", index=False)
    cfg = DataConfig(
        source="table",
        path=str(tmp_path / "train.parquet"),
        test_path=str(tmp_path / "test.csv"),
        allocation="column",
        silo_column="site",
        subject_column="pid",
        records_per_subject=3,
    )
    data = build_federated_data(cfg)
    train = data.train
    assert train.num_silos == 3 and data.name == "table-column-3silos"
    expected_silo = pd.Series(frame["site"]).map({"s1": 0, "s2": 1, "s3": 2}).to_numpy()
    assert train.max_records_per_subject() <= 3
    assert len(train) + train.dropped_records == n
    assert set(zip(train.silo.tolist(), train.x[:, 0].tolist(), strict=True)) <= set(
        zip(expected_silo.tolist(), frame["f1"].astype(np.float32).tolist(), strict=True)
    )
    assert len(data.test) == 30 and data.test.x.shape == (30, 2)
    # the table's own subjects: |U| from its ids (its roster), no count fixed beforehand
    assert train.subject_count is None and train.num_subjects == int(train.subject.max()) + 1


def test_a_tables_test_file_with_the_subject_column_counts_and_keeps_its_subjects(
    tmp_path: Path,
) -> None:
    """A table's test file was read without its subject column: with first_subjects, every
    test row was kept (mostly people outside the training population) and the subjects on
    both sides were never counted."""
    train = pd.DataFrame(
        {"f": np.arange(40.0), "label": np.arange(40) % 2, "pid": [f"p{i % 10}" for i in range(40)]}
    )
    test = pd.DataFrame(
        {"f": np.arange(12.0), "label": np.arange(12) % 2, "pid": [f"p{i}" for i in range(12)]}
    )
    train.to_csv(tmp_path / "train.csv", index=False)
    test.to_csv(tmp_path / "test.csv", index=False)
    base = {
        "source": "table",
        "path": str(tmp_path / "train.csv"),
        "test_path": str(tmp_path / "test.csv"),
        "subject_column": "pid",
        "label_values": (0, 1),
    }
    data = build_federated_data(DataConfig(**base))  # type: ignore[arg-type]
    assert len(data.test) == 12
    split = describe(data)["split"]
    assert split["test_subjects"] == 12 and split["shared_subjects"] == 10
    kept = build_federated_data(DataConfig(**base, first_subjects=3))  # type: ignore[arg-type]
    assert len(kept.test) == 3 and describe(kept)["split"]["shared_subjects"] == 3
    with pytest.raises(InvalidValueError, match="holds none of them"):
        pd.DataFrame({"f": [1.0], "label": [0], "pid": ["zz"]}).to_csv(
            tmp_path / "other.csv", index=False
        )
        build_federated_data(
            DataConfig(**{**base, "test_path": str(tmp_path / "other.csv")}, first_subjects=3)  # type: ignore[arg-type]
        )


def _train_and_test(train: Path, test: Path) -> DataConfig:
    """A table config of a training and a test file with subject ids in ``pid``."""
    return DataConfig(
        source="table",
        path=str(train),
        test_path=str(test),
        subject_column="pid",
        label_values=(0, 1),
    )


def test_one_subject_id_written_two_ways_across_train_and_test_files_is_refused(
    tmp_path: Path,
) -> None:
    """ "7" in the training file and "07" in the test file were two people: the subjects on
    both sides were undercounted, and with first_subjects the person's test rows dropped."""
    pd.DataFrame({"f": np.arange(8.0), "label": np.arange(8) % 2, "pid": ["7", "8"] * 4}).to_csv(
        tmp_path / "train.csv", index=False
    )
    pd.DataFrame({"f": [1.0, 2.0], "label": [0, 1], "pid": ["07", "8"]}).to_csv(
        tmp_path / "test.csv", index=False
    )
    cfg = _train_and_test(tmp_path / "train.csv", tmp_path / "test.csv")
    with pytest.raises(InvalidValueError, match=r"\['07', '7'\] are one number"):
        build_federated_data(cfg)


def test_long_integer_subject_ids_of_a_train_and_a_test_file_are_compared_exactly(
    tmp_path: Path,
) -> None:
    """Distinct 19-digit subject ids across the training and the test file were refused as
    one number written two ways (compared as floats, they rounded to one)."""
    ids = [1234567890123456789 + i for i in range(4)]
    pd.DataFrame({"f": np.arange(8.0), "label": np.arange(8) % 2, "pid": ids * 2}).to_parquet(
        tmp_path / "train.parquet"
    )
    pd.DataFrame({"f": [1.0, 2.0], "label": [0, 1], "pid": ids[1:3]}).to_parquet(
        tmp_path / "test.parquet"
    )
    cfg = _train_and_test(tmp_path / "train.parquet", tmp_path / "test.parquet")
    data = build_federated_data(cfg)
    assert data.train.subject_names == [str(i) for i in ids]
    assert len(data.test) == 2 and describe(data)["split"]["shared_subjects"] == 2


def test_a_test_file_of_numeric_labels_matches_training_labels_read_as_text(
    tmp_path: Path,
) -> None:
    """Training labels "1", "0", "x" (text) refused the test file's labels 1 and 0 (read as
    numbers) as "label(s) [0, 1] not in the given label_values ['0', '1', 'x']"."""
    (tmp_path / "train.csv").write_text(
        "f,label\n" + "".join(f"{i},{'10x'[i % 3]}\n" for i in range(12))
    )
    (tmp_path / "test.csv").write_text("f,label\n1,1\n2,0\n3,1\n")
    cfg = DataConfig(
        source="table", path=str(tmp_path / "train.csv"), test_path=str(tmp_path / "test.csv")
    )
    data = build_federated_data(cfg)
    assert data.train.num_classes == 3
    assert data.test.y.tolist() == [1, 0, 1]  # classes "0", "1", "x"


def test_a_test_file_that_is_also_training_data_is_refused(tmp_path: Path) -> None:
    """test_path = path was accepted and described as a separate test set (every test record
    a training record); so was a LEAF test file inside the training directory."""
    frame = pd.DataFrame({"f": np.arange(20.0), "label": np.arange(20) % 2})
    frame.to_csv(tmp_path / "t.csv", index=False)
    (tmp_path / "link.csv").symlink_to(tmp_path / "t.csv")
    for test in ("t.csv", "link.csv"):
        cfg = DataConfig(
            source="table", path=str(tmp_path / "t.csv"), test_path=str(tmp_path / test)
        )
        with pytest.raises(InvalidValueError, match="to be separate from data.path"):
            build_federated_data(cfg)
    train = tmp_path / "leaf"
    train.mkdir()
    (train / "a.json").write_text("{}")
    with pytest.raises(InvalidValueError, match="both read .*a.json"):
        build_federated_data(
            DataConfig(source="leaf_femnist", path=str(train), test_path=str(train / "a.json"))
        )


def test_table_fixed_silo(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    frame = pd.DataFrame(
        {
            "f": rng.normal(size=400),
            "label": rng.integers(0, 2, 400),
            "site": rng.integers(0, 4, 400),
        }
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    train = build_federated_data(
        DataConfig(
            source="table",
            path=str(tmp_path / "t.csv"),
            allocation="fixed_silo",
            silo_column="site",
            simulated_subjects=True,
            num_subjects=10,
            feature_columns=("f",),
        )
    ).train
    assert train.num_silos == 4 and train.num_subjects <= 10
    site_of = dict(zip(frame["f"].astype(np.float32).tolist(), frame["site"], strict=True))
    assert all(site_of[f] == s for f, s in zip(train.x[:, 0].tolist(), train.silo, strict=True))
    h = train.histogram()
    # ~80% of the largest subject in its main silo, or as much as that silo holds
    top = h[:, 0]
    main = int(top.argmax())
    assert top[main] / top.sum() > 0.6 or top[main] == h[main].sum()


@pytest.mark.skipif(not FASHION_ROOT.is_dir(), reason=f"{FASHION_ROOT} not installed")
def test_fashion_mnist_build() -> None:
    data = build_federated_data(
        DataConfig(source="fashion_mnist", num_silos=4, max_records=2000, num_subjects=50)
    )
    assert len(data.train) == 2000 and len(data.test) == 10000
    assert data.train.x.shape[1:] == (1, 28, 28)
    assert data.train.num_silos == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "mnist"}, "source='mnist'"),
        # silently ignored before: the data fix the classes, features and subjects
        ({"num_classes": 3}, "Expected num_classes unset for source='digits'"),
        ({"num_features": 5}, "Expected num_features unset for source='digits'"),
        (
            {"source": "table", "path": "t.csv", "num_classes": 10},
            "a table declares its classes with label_values",
        ),
        (
            {"source": "table", "path": "t.csv", "subject_column": "p", "num_subjects": 5},
            "Expected num_subjects unset: the subjects come from the data \\(the subject_column",
        ),
        (
            {"source": "leaf_femnist", "path": "d", "num_subjects": 3},
            "\\(LEAF users\\), so num_subjects=3 would be ignored",
        ),
        ({"allocation": "random"}, "allocation='random'"),
        ({"test_fraction": 1.0}, r"test_fraction=1.0 in \(0.0, 1.0\)"),
        ({"num_silos": 0}, "num_silos=0"),
        ({"alpha": -2.0}, "alpha=-2.0"),
        ({"dirichlet_beta": 0}, "dirichlet_beta=0"),
        ({"max_records": 1}, "max_records=1"),
        ({"records_per_subject": 0}, "records_per_subject=0"),
        ({"source": "table"}, "Expected a path for source='table'"),
        ({"path": "/x"}, "path=None for source='digits'"),
        ({"test_path": "/x"}, "test_path=None for source='digits'"),
        ({"allocation": "column"}, "allocation='column' only with source='table'"),
        ({"silo_column": "site"}, "silo_column=None for source='digits'"),
        ({"feature_columns": ("a",)}, r"feature_columns=\(\) for source='digits'"),
        ({"allocation": "zipf", "labels_per_subject": 2}, "labels_per_subject=2 needs"),
        (
            {"source": "table", "path": "t.csv", "silo_column": "s"},
            "only used by allocation='column' or 'fixed_silo'",
        ),
        ({"seed": -1}, "seed=-1"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs)


def test_stratified_split_keeps_a_train_record() -> None:
    y = np.array([0, 1, 1, 1, 1, 1])
    train, test = stratified_split(y, test_fraction=0.5, rng=np.random.default_rng(0))
    assert 0 in y[train] and len(test) == 2 and np.intersect1d(train, test).size == 0


# --- what a new user ran into --------------------------------------------------------


def _table_config(path: Path, **kwargs: object) -> DataConfig:
    values: dict = dict(
        source="table",
        path=str(path),
        label_column="label",
        subject_column="person",
        silo_column="site",
        allocation="column",
    )
    values.update(kwargs)
    return DataConfig(**values)


def test_an_empty_csv_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(
        InvalidValueError, match=r"Table '.*empty\.csv' is empty; expected a header"
    ):
        build_federated_data(_table_config(path))


def _people(n_sites: int = 11) -> pd.DataFrame:
    rows = [
        {"f": float(i), "label": i % 2, "person": f"p{i % 40:04d}", "site": 1 + i % n_sites}
        for i in range(220)
    ]
    return pd.DataFrame(rows)


def test_numeric_silo_ids_are_ordered_numerically_and_described(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    _people().to_csv(path, index=False)
    data = build_federated_data(_table_config(path))
    assert data.train.silo_names == [str(s) for s in range(1, 12)]  # "2" before "10"
    site = _people().set_index("f")["site"]
    for x, s in zip(data.train.x[:, 0].tolist(), data.train.silo.tolist(), strict=True):
        assert int(data.train.silo_names[s]) == site[x]
    info = describe(data)
    assert info["silo_ids"] == [str(s) for s in range(1, 12)]
    assert "0='1' 1='2' 2='3'" in format_description(info)


def test_subjects_above_n_max_are_named_by_their_own_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    frame = _people(n_sites=2)
    frame.loc[frame.index[:30], "person"] = "p0042"  # 30 + 5 records of p0042
    frame.to_csv(path, index=False)
    data = build_federated_data(_table_config(path, test_split="record"))
    with pytest.raises(InvalidValueError) as err:
        check_records_per_subject(data.train, 10, name="n_max")
    assert "'p0042' (" in str(err.value) and "n_max=10" in str(err.value)
    assert describe(data)["max_records_subject_id"] == "p0042"
    # uldp_avg_w refuses before the weighting protocol (which knows only indices) is set up
    from silodp.algorithms import ALGORITHMS
    from silodp.privacy.randomness import Coins

    cls = ALGORITHMS["uldp_avg_w"]
    config = {"n_max": 10, "num_silos": data.train.num_silos, "noise_multiplier": 1.0}
    with pytest.raises(InvalidValueError) as err:
        cls.for_data(config, data.train, insecure_test_key_bits=512, coins=Coins.seeded(0))
    assert "'p0042' (" in str(err.value) and "privacy.n_max=10" in str(err.value)


def test_a_silo_emptied_by_the_test_split_is_named_by_its_id(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    frame = _people(n_sites=2)
    frame.loc[0, "site"] = 10  # one record in site 10: a subject split can take it
    frame.loc[0, "person"] = "p9999"
    frame.to_csv(path, index=False)
    for seed in range(20):
        try:
            build_federated_data(_table_config(path, test_fraction=0.5, seed=seed))
        except InvalidValueError as err:
            assert "Silo(s) ['10'] of column 'site'" in str(err)
            assert "hold no training records" in str(err)
            # a subject split already: the advice does not suggest it
            assert "Lower test_fraction; give those silos more records." in str(err)
            with pytest.raises(InvalidValueError, match="max_records=30\\); .*raise max_records"):
                build_federated_data(
                    _table_config(path, test_fraction=0.5, seed=seed, max_records=30)
                )
            return
    pytest.fail("no seed held out site 10's only record")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_silos": 10**6}, r"data\.num_silos=1000000 <= 1438"),
        ({"num_subjects": 10**6}, r"data\.num_subjects=1000000 <= 1438"),
        ({"allocation": "shards", "shards_per_client": 10**6}, r"data\.shards_per_client"),
        ({"allocation": "shards", "test_per_client": 10**6}, r"data\.test_per_client=1000000"),
        ({"allocation": "dirichlet", "train_per_client": 10**6}, r"data\.train_per_client"),
    ],
)
def test_counts_beyond_the_records_are_refused_before_drawing(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        build_federated_data(DataConfig(**kwargs))


def test_a_missing_data_path_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(DataFileNotFoundError, match=r"data\.path='.*nope\.csv'"):
        build_federated_data(DataConfig(source="table", path=str(tmp_path / "nope.csv")))
    assert issubclass(DataFileNotFoundError, SilodpError)
    assert issubclass(DataFileNotFoundError, FileNotFoundError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "table", "path": 5}, "path=5"),
        ({"seed": 2**63}, "seed=9223372036854775808"),
        ({"source": "synthetic", "num_features": 10**7}, "max_records x num_features"),
        ({"source": "synthetic", "num_classes": 5000}, "num_classes=5000 <= max_records"),
    ],
)
def test_more_config_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        DataConfig(**kwargs)


def test_describe_names_the_feature_columns_and_checks_dp_scaling_bounds(tmp_path: Path) -> None:
    """describe never named the columns the model reads (an undeclared id column could be
    one), printed 'none' for scaling = 'dp', and accepted bounds a run then refused."""
    from typer.testing import CliRunner

    from silodp.cli import app

    path = tmp_path / "t.csv"
    frame = _people().assign(g=1.0)
    frame.to_csv(path, index=False)
    info = describe(build_federated_data(_table_config(path)))
    assert info["feature_columns"] == ["f", "g"]  # every column but label, subject and silo
    assert any(
        line.split() == ["feature", "columns", "f,", "g"]
        for line in format_description(info).splitlines()
    )
    with pytest.raises(InvalidValueError, match="feature columns of .* are \\['f', 'g'\\]"):
        build_federated_data(
            _table_config(path, scaling="dp", feature_bounds=[[0, 1], [0, 1], [0, 1]])
        )
    config = tmp_path / "c.toml"
    config.write_text(
        f'[data]\nsource = "table"\npath = "{path}"\nsubject_column = "person"\n'
        'silo_column = "site"\nallocation = "column"\nscaling = "dp"\nfeature_bounds = [0, 300]\n'
    )
    shown = CliRunner().invoke(app, ["describe", str(config), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["scaling"].startswith("dp (estimated with DP when a run")


def test_first_subjects_of_a_table_without_subject_column_keeps_its_first_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each record is its own subject there; first_subjects was silently ignored."""
    path = tmp_path / "t.csv"
    pd.DataFrame({"f": np.arange(40.0), "label": np.arange(40) % 2}).to_csv(path, index=False)
    cfg = DataConfig(source="table", path=str(path), first_subjects=10)
    data = build_federated_data(cfg)
    assert len(data.train) + len(data.test) == 10
    assert sorted([*data.train.x[:, 0].tolist(), *data.test.x[:, 0].tolist()]) == list(
        map(float, range(10))
    )
    # more subjects asked for than the data holds: all kept, and said
    with caplog.at_level("WARNING", logger="silodp.data.build"):
        more = build_federated_data(DataConfig(source="table", path=str(path), first_subjects=99))
    assert len(more.train) + len(more.test) == 40
    assert "first_subjects = 99, but the data holds 40 subjects" in caplog.text
    (tmp_path / "hard.csv").hardlink_to(path)  # a hard link is the same file too
    with pytest.raises(InvalidValueError, match="to be separate from data.path"):
        build_federated_data(
            DataConfig(source="table", path=str(path), test_path=str(tmp_path / "hard.csv"))
        )


@pytest.mark.parametrize(
    ("kwargs", "key", "role"),
    [
        ({"subject_column": "label"}, "subject_column", "subject ids"),
        ({"silo_column": "label", "allocation": "column"}, "silo_column", "silo ids"),
        (
            {"label_column": "site", "silo_column": "site", "allocation": "fixed_silo"},
            "silo_column",
            "silo ids",
        ),
    ],
)
def test_a_label_column_that_is_also_an_id_column_is_refused_by_the_config(
    kwargs: dict, key: str, role: str
) -> None:
    column = kwargs.get("label_column", "label")
    with pytest.raises(
        InvalidValueError,
        match=rf"Expected label_column and {key} to name different columns, got '{column}' "
        rf"for both: .*the class labels and the {role}",
    ):
        DataConfig(source="table", path="t.csv", **kwargs)


def test_a_label_used_as_subject_column_fails_before_loading(tmp_path: Path) -> None:
    """subject_column = "label" with string label_values built: 2 subjects (one per class),
    and the subject test split held out a whole class."""
    path = tmp_path / "t.csv"
    rng = np.random.default_rng(0)
    pd.DataFrame({"a": rng.normal(size=100), "label": rng.choice(["no", "yes"], size=100)}).to_csv(
        path, index=False
    )
    with pytest.raises(InvalidValueError, match="label_column and subject_column"):
        build_federated_data(
            DataConfig(
                source="table", path=str(path), subject_column="label", label_values=("no", "yes")
            )
        )
