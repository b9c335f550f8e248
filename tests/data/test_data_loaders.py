"""Loaders on small fixture files written by the tests."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from silodp.data import loaders
from silodp.data.loaders import (
    LEAF_ALL_LETTERS,
    find_fashion_mnist,
    load_digits_arrays,
    load_fashion_mnist,
    load_leaf_json,
    load_table,
    make_synthetic,
)
from silodp.errors import InvalidValueError

# --- digits -----------------------------------------------------------------------------


def test_digits_arrays() -> None:
    x, y = load_digits_arrays()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


# --- Fashion-MNIST IDX ------------------------------------------------------------------


def _idx_bytes(arr: np.ndarray, magic: int | None = None) -> bytes:
    magic = 0x0800 | arr.ndim if magic is None else magic
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def _write_fmnist(root: Path, *, gz: bool = True, n_train: int = 5, n_test: int = 3) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    parts = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) + 3) % 10,
    }
    for name, arr in parts.items():
        data = _idx_bytes(arr)
        if gz:
            (root / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (root / name).write_bytes(data)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_idx(tmp_path: Path, gz: bool) -> None:
    _write_fmnist(tmp_path, gz=gz)
    (x, y), (xt, yt) = load_fashion_mnist(tmp_path)
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(y, [0, 1, 2, 3, 4])
    assert xt.shape == (3, 1, 28, 28)
    np.testing.assert_array_equal(yt, [3, 4, 5])
    assert y.dtype == np.int64


def test_fashion_mnist_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_fmnist(tmp_path / "fm")
    monkeypatch.setenv(loaders.FASHION_MNIST_ENV, str(tmp_path / "fm"))
    assert find_fashion_mnist() == tmp_path / "fm"


def test_fashion_mnist_missing_dir_hint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        find_fashion_mnist(tmp_path / "nowhere")


def test_fashion_mnist_missing_file(tmp_path: Path) -> None:
    _write_fmnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_bad_magic_and_size(tmp_path: Path) -> None:
    _write_fmnist(tmp_path)
    bad = _idx_bytes(np.zeros(5), magic=0x0D01)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bad))
    with pytest.raises(ValueError, match="magic number 0x00000d01; expected 0x00000801"):
        load_fashion_mnist(tmp_path)
    truncated = _idx_bytes(np.zeros(5))[:-2]
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(truncated))
    with pytest.raises(ValueError, match=r"declares shape \(5,\)"):
        load_fashion_mnist(tmp_path)
    four = _idx_bytes(np.zeros(4))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(four))
    with pytest.raises(ValueError, match="5 images but .* 4 labels"):
        load_fashion_mnist(tmp_path)


# --- LEAF -------------------------------------------------------------------------------


def _leaf_blob(users: dict[str, tuple[list, list]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(v[0]) for v in users.values()],
        "user_data": {u: {"x": v[0], "y": v[1]} for u, v in users.items()},
    }


def _write_json(path: Path, blob: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(blob))
    return path


def test_leaf_alphabet_has_80_chars() -> None:
    assert len(LEAF_ALL_LETTERS) == 80 == len(set(LEAF_ALL_LETTERS))


def test_leaf_femnist(tmp_path: Path) -> None:
    px = [0.5] * 784
    _write_json(
        tmp_path / "d" / "a.json", _leaf_blob({"f0": ([px, px], [3, 61]), "f1": ([px], [0])})
    )
    _write_json(tmp_path / "d" / "b.json", _leaf_blob({"f2": ([px] * 3, [1, 2, 3])}))
    leaf = load_leaf_json(tmp_path / "d", kind="femnist")
    assert leaf.x.shape == (6, 1, 28, 28) and leaf.x.dtype == np.float32
    np.testing.assert_array_equal(leaf.y, [3, 61, 0, 1, 2, 3])
    np.testing.assert_array_equal(leaf.subject, [0, 0, 1, 2, 2, 2])
    assert leaf.subject_names == ["f0", "f1", "f2"]
    assert leaf.num_classes == 62
    # a list of files gives the same result; a single file only its users
    both = load_leaf_json([tmp_path / "d" / "a.json", tmp_path / "d" / "b.json"], kind="femnist")
    np.testing.assert_array_equal(both.subject, leaf.subject)
    assert len(load_leaf_json(tmp_path / "d" / "b.json", kind="femnist").y) == 3


def test_leaf_femnist_bad_pixels_and_counts(tmp_path: Path) -> None:
    f = _write_json(tmp_path / "a.json", _leaf_blob({"f0": ([[0.1] * 783], [1])}))
    with pytest.raises(ValueError, match="784 pixels"):
        load_leaf_json(f, kind="femnist")
    blob = _leaf_blob({"f0": ([[0.1] * 784] * 2, [1, 2])})
    blob["num_samples"] = [3]
    f = _write_json(tmp_path / "b.json", blob)
    with pytest.raises(ValueError, match=r"user 'f0'.*num_samples=3 but 2 x and 2 y"):
        load_leaf_json(f, kind="femnist")


def test_leaf_shakespeare(tmp_path: Path) -> None:
    s1 = "To be, or not to be" + " " * 61
    s2 = "ALL: Hark!\n" + "z" * 69
    f = _write_json(
        tmp_path / "s.json", _leaf_blob({"HAMLET": ([s1, s2], ["t", "}"]), "KING": ([s1], ["A"])})
    )
    leaf = load_leaf_json(f, kind="shakespeare")
    assert leaf.x.shape == (3, 80) and leaf.x.dtype == np.int64
    assert leaf.num_classes == 80
    assert "".join(LEAF_ALL_LETTERS[i] for i in leaf.x[1]) == s2
    np.testing.assert_array_equal(leaf.y, [LEAF_ALL_LETTERS.index(c) for c in "t}A"])
    np.testing.assert_array_equal(leaf.subject, [0, 0, 1])
    assert leaf.subject_names == ["HAMLET", "KING"]


def test_leaf_shakespeare_unknown_char(tmp_path: Path) -> None:
    f = _write_json(tmp_path / "s.json", _leaf_blob({"X": (["ab\u00e9"], ["a"])}))
    with pytest.raises(ValueError, match=r"Unknown character 'é' in .*user 'X' x\[0\]"):
        load_leaf_json(f, kind="shakespeare")


def test_a_leaf_directory_reads_only_its_json_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A subdirectory or a link to nothing named *.json raised a bare IsADirectoryError or
    FileNotFoundError, and a file that could not be read a bare OSError."""
    px = [0.5] * 784
    _write_json(tmp_path / "d" / "a.json", _leaf_blob({"f0": ([px, px], [3, 61])}))
    (tmp_path / "d" / "sub.json").mkdir()
    (tmp_path / "d" / "gone.json").symlink_to(tmp_path / "nowhere.json")
    leaf = load_leaf_json(tmp_path / "d", kind="femnist")
    assert leaf.subject_names == ["f0"] and len(leaf.y) == 2
    assert "skipping ['gone.json', 'sub.json']" in caplog.text

    def unreadable(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(loaders, "open", unreadable, raising=False)
    with pytest.raises(InvalidValueError, match=r"a\.json' cannot be read \(PermissionError"):
        load_leaf_json(tmp_path / "d", kind="femnist")


def test_leaf_missing_path_and_kind(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_leaf_json(tmp_path / "nope.json", kind="femnist")
    with pytest.raises(ValueError, match="kind='cifar'"):
        load_leaf_json(tmp_path, kind="cifar")


# --- tables -----------------------------------------------------------------------------


def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "a": [0.1, 0.2, 0.3, 0.4, 0.5],
            "b": [1, 2, 3, 4, 5],
            "label": ["yes", "no", "yes", "maybe", "no"],
            "hospital": ["h2", "h1", "h2", "h3", "h1"],
            "patient": [10, 11, 10, 12, 13],
        }
    )


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_load_table(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / ("t" + suffix)
    frame = _frame()
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    t = load_table(
        path,
        feature_columns=["a", "b"],
        label_column="label",
        silo_column="hospital",
        subject_column="patient",
    )
    assert t.x.shape == (5, 2) and t.x.dtype == np.float32
    assert t.label_values == ["maybe", "no", "yes"]
    np.testing.assert_array_equal(t.y, [2, 1, 2, 0, 1])
    assert t.num_classes == 3
    np.testing.assert_array_equal(t.silo, [1, 0, 1, 2, 0])
    assert t.silo_names == ["h1", "h2", "h3"]
    np.testing.assert_array_equal(t.subject, [0, 1, 0, 2, 3])
    assert t.subject_names == ["10", "11", "12", "13"]


def test_table_default_features_and_fixed_labels(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    _frame().drop(columns=["hospital"]).to_csv(path, index=False)
    t = load_table(path, feature_columns=(), label_column="label", subject_column="patient")
    assert t.feature_columns == ("a", "b")
    fixed = load_table(
        path, feature_columns=["a"], label_column="label", label_values=["no", "yes", "maybe"]
    )
    np.testing.assert_array_equal(fixed.y, [1, 0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"label\(s\) \['maybe'\] not in"):
        load_table(path, feature_columns=["a"], label_column="label", label_values=["no", "yes"])


def test_table_errors(tmp_path: Path) -> None:
    frame = _frame()
    frame.loc[[1, 3], "b"] = np.nan
    path = tmp_path / "t.csv"
    frame.to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"Column 'b' .* has 2 missing value\(s\)"):
        load_table(path, feature_columns=["a", "b"], label_column="label")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['c', 'site'\]"):
        load_table(path, feature_columns=["a", "c"], label_column="label", silo_column="site")
    with pytest.raises(
        ValueError, match=r"column 'hospital' is not numeric \(it holds 'h2' in row 1\)"
    ):
        load_table(path, feature_columns=["a", "hospital"], label_column="label")
    with pytest.raises(ValueError, match=r"\.csv or \.parquet"):
        (tmp_path / "t.txt").write_text("a\n1\n")
        load_table(tmp_path / "t.txt", feature_columns=["a"], label_column="a")
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(FileNotFoundError, match="to be a CSV or Parquet file; it is a directory"):
        load_table(tmp_path / "dir.csv", feature_columns=["a"], label_column="a")


# --- synthetic --------------------------------------------------------------------------


def test_synthetic_is_seeded_and_learnable() -> None:
    x, y = make_synthetic(
        num_records=600, num_features=5, num_classes=3, rng=np.random.default_rng(1)
    )
    x2, y2 = make_synthetic(
        num_records=600, num_features=5, num_classes=3, rng=np.random.default_rng(1)
    )
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert x.dtype == np.float32 and x.shape == (600, 5) and set(np.unique(y)) == {0, 1, 2}
    # nearest class mean (fitted on half, scored on the other half) beats chance by far
    means = np.stack([x[:300][y[:300] == c].mean(axis=0) for c in range(3)])
    pred = np.argmin(((x[300:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == y[300:]).mean() > 0.8
    with pytest.raises(ValueError, match="num_classes=1"):
        make_synthetic(num_records=5, num_features=2, num_classes=1, rng=np.random.default_rng())


def test_feature_columns_of_dates_or_text_numbers_are_named(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {"d": pd.to_datetime(["2020-01-01", "2020-01-02"]), "t": ["1", "2"], "label": [0, 1]}
    )
    path = tmp_path / "t.parquet"
    frame.to_parquet(path)
    with pytest.raises(ValueError, match=r"column 'd' holds values of dtype datetime64"):
        load_table(path, feature_columns=["d"], label_column="label")
    with pytest.raises(ValueError, match=r"column 't' is not numeric \(it holds numbers stored"):
        load_table(path, feature_columns=["t"], label_column="label")


def test_csv_ids_are_read_as_written(tmp_path: Path) -> None:
    """Read as numbers, "007" and "7" (or "1.0" and "1") were silently one customer and the
    country code "NA" a missing value; now ids are text as written, the number written two
    ways is refused (as text two people, as numbers one), and " 3" is refused for its spaces."""
    path = tmp_path / "t.csv"
    path.write_text("f,label,cust,bank\n1,0,p7,NA\n2,1,007,NA\n3,0,1.5,10\n4,1,a,9\n5,0,p7,9\n")
    table = loaders.load_table(
        path,
        feature_columns=["f"],
        label_column="label",
        subject_column="cust",
        silo_column="bank",
    )
    assert table.subject_names == ["007", "1.5", "a", "p7"]
    assert table.subject.tolist() == [3, 0, 1, 2, 3]
    assert table.silo_names == ["10", "9", "NA"]  # not all integers: ordered as text
    for one, other in (("007", "7"), ("1", "1.0")):
        path.write_text(f"f,label,cust\n1,0,{one}\n2,1,{other}\n")
        with pytest.raises(InvalidValueError, match="one number written differently"):
            loaders.load_table(
                path, feature_columns=["f"], label_column="label", subject_column="cust"
            )
    path.write_text("f,label,cust\n1,0, 3\n2,1,3\n")
    with pytest.raises(InvalidValueError, match="an id with spaces around it, ' 3', in row 1"):
        loaders.load_table(path, feature_columns=["f"], label_column="label", subject_column="cust")
    path.write_text("f,label,cust\n1,0,\n2,1,3\n")
    with pytest.raises(InvalidValueError, match="'cust' .* 1 missing value"):
        loaders.load_table(path, feature_columns=["f"], label_column="label", subject_column="cust")


def test_a_text_label_pandas_reads_as_missing_names_label_values(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("f,label\n1,yes\n2,NA\n3,no\n")
    with pytest.raises(InvalidValueError, match=r"in row 2.*NA, N/A, null or None.*label_values"):
        loaders.load_table(path, feature_columns=["f"], label_column="label")
    table = loaders.load_table(
        path, feature_columns=["f"], label_column="label", label_values=("NA", "no", "yes")
    )
    assert table.y.tolist() == [2, 0, 1]
    # a feature's empty cell gets no such hint
    path.write_text("f,label\n1,yes\n,no\n")
    with pytest.raises(InvalidValueError, match="expected a value in every row.$"):
        loaders.load_table(path, feature_columns=["f"], label_column="label")


def test_fractional_numeric_ids_are_refused(tmp_path: Path) -> None:
    """A float column of measurements named as the subject column made each record its own
    subject, so the subject-level ε silently became the record-level one."""
    path = tmp_path / "t.parquet"
    frame = pd.DataFrame({"f": [1.0, 2.0, 3.0], "label": [0, 1, 0], "cust": [1.0, 2.5, 1.0]})
    frame.to_parquet(path)
    with pytest.raises(
        InvalidValueError, match=r"whole-number ids in column 'cust'.*2\.5 in row 2"
    ):
        loaders.load_table(path, feature_columns=["f"], label_column="label", subject_column="cust")
    frame["cust"] = [1.0, 2.0, 1.0]  # whole numbers stored as floats are ids
    frame.to_parquet(path)
    table = loaders.load_table(
        path, feature_columns=["f"], label_column="label", subject_column="cust"
    )
    assert table.subject.tolist() == [0, 1, 0]


def test_long_integer_ids_are_compared_exactly(tmp_path: Path) -> None:
    """Distinct 19-digit ids were refused as one number written differently: compared as
    floats, they rounded to one."""
    path = tmp_path / "t.csv"
    path.write_text(
        "f,label,cust\n1,0,1234567890123456789\n2,1,1234567890123456790\n3,0,1234567890123456789\n"
    )
    table = loaders.load_table(
        path, feature_columns=["f"], label_column="label", subject_column="cust"
    )
    assert table.subject_names == ["1234567890123456789", "1234567890123456790"]
    assert table.subject.tolist() == [0, 1, 0]
    path.write_text("f,label,cust\n1,0,1234567890123456789\n2,1,1234567890123456789.0\n")
    with pytest.raises(InvalidValueError, match="one number written differently"):
        loaders.load_table(path, feature_columns=["f"], label_column="label", subject_column="cust")


@pytest.mark.parametrize(
    "column, cells",
    [
        ("label", [[0], [1, 2], [1]]),
        ("label", [[0, 1], [1, 0], [0, 1]]),
        ("label", [{"a": 0}, {"a": 1}, {"a": 0}]),
        ("label", [b"no", b"yes", b"no"]),
        ("cust", [[1], [2], [1]]),
    ],
)
def test_a_label_or_id_cell_holding_a_list_struct_or_bytes_is_refused(
    tmp_path: Path, column: str, cells: list
) -> None:
    """A Parquet column of lists as labels raised numpy's "truth value of an array is
    ambiguous" or became the classes [array([0]), array([1])]; as ids, lists became subjects
    named "[1]" (binary ids are read as their hex: test_binary_ids_are_read_as_their_hex)."""
    frame = pd.DataFrame({"f": [1.0, 2.0, 3.0], "label": [0, 1, 0], "cust": ["a", "b", "a"]})
    frame[column] = cells
    frame.to_parquet(tmp_path / "t.parquet")
    with pytest.raises(
        InvalidValueError, match=rf"Expected one .* in each cell of column '{column}' .* in row 1"
    ):
        loaders.load_table(
            tmp_path / "t.parquet",
            feature_columns=["f"],
            label_column="label",
            subject_column="cust",
        )


def test_binary_ids_are_read_as_their_hex(tmp_path: Path) -> None:
    """A Parquet column of binary (hashed) subject ids: one subject per distinct value."""
    frame = pd.DataFrame(
        {"f": [1.0, 2.0, 3.0], "label": [0, 1, 0], "cust": [b"\x01\xff", b"\x02", b"\x01\xff"]}
    )
    frame.to_parquet(tmp_path / "t.parquet")
    table = loaders.load_table(
        tmp_path / "t.parquet", feature_columns=["f"], label_column="label", subject_column="cust"
    )
    assert table.subject_names == ["01ff", "02"] and table.subject.tolist() == [0, 1, 0]


def test_a_text_label_with_spaces_around_it_is_refused(tmp_path: Path) -> None:
    """ " yes" beside "yes" silently became a third class; spaces written alike (a CSV with
    ", " separators) still load."""
    path = tmp_path / "t.csv"
    path.write_text("f,label\n1,yes\n2,no\n3, yes\n4,yes\n")
    with pytest.raises(
        InvalidValueError, match=r"'yes' and ' yes' \(in row 3\) differ only in the spaces"
    ):
        loaders.load_table(path, feature_columns=["f"], label_column="label")
    path.write_text("f, label\n1, yes\n2, no\n3, yes\n")
    table = loaders.load_table(path, feature_columns=["f"], label_column=" label")
    assert table.y.tolist() == [1, 0, 1]
    pd.DataFrame({"f": [1.0, 2.0, 3.0], "label": ["yes", "no", " "]}).to_parquet(
        tmp_path / "t.parquet"
    )
    with pytest.raises(InvalidValueError, match="got ' ' in row 3"):
        loaders.load_table(tmp_path / "t.parquet", feature_columns=["f"], label_column="label")


def test_labels_read_as_numbers_match_string_label_values_by_their_text(tmp_path: Path) -> None:
    """label_values = ["0", "1"] on a column of 0s and 1s was refused with "label(s) [0, 1]
    not in the given label_values ['0', '1']"; so were string labels against numbers."""
    path = tmp_path / "t.csv"
    path.write_text("f,label\n1,1\n2,0\n3,1\n")
    table = loaders.load_table(
        path, feature_columns=["f"], label_column="label", label_values=["0", "1"]
    )
    assert table.y.tolist() == [1, 0, 1] and table.label_values == ["0", "1"]
    for label, shown in (("01", "'01'"), ("2", "'2'")):  # as written: "01" is not "1"
        path.write_text(f"f,label\n1,1\n2,0\n3,{label}\n")
        with pytest.raises(InvalidValueError, match=rf"label\(s\) \[{shown}\] not in"):
            loaders.load_table(
                path, feature_columns=["f"], label_column="label", label_values=["0", "1"]
            )
    pd.DataFrame({"f": [1.0, 2.0, 3.0], "label": [1, 0, 1]}).to_parquet(tmp_path / "i.parquet")
    table = loaders.load_table(
        tmp_path / "i.parquet", feature_columns=["f"], label_column="label", label_values=["0", "1"]
    )
    assert table.y.tolist() == [1, 0, 1]
    text = pd.DataFrame({"f": [1.0, 2.0, 3.0], "label": ["1", "0", "1"]})
    text.to_parquet(tmp_path / "s.parquet")
    table = loaders.load_table(
        tmp_path / "s.parquet", feature_columns=["f"], label_column="label", label_values=[0, 1]
    )
    assert table.y.tolist() == [1, 0, 1] and table.label_values == [0, 1]
    text.assign(label=["1", "0", "x"]).to_parquet(tmp_path / "s.parquet")
    with pytest.raises(InvalidValueError, match=r"label\(s\) \['x'\] not in .* \[0, 1\]"):
        loaders.load_table(
            tmp_path / "s.parquet", feature_columns=["f"], label_column="label", label_values=[0, 1]
        )


def test_integers_beyond_any_float_are_a_clear_error(tmp_path: Path) -> None:
    """A 400-digit integer raised OverflowError (a traceback) from a CSV feature and a LEAF
    pixel."""
    path = tmp_path / "t.csv"
    path.write_text("f,label\n" + "1" * 400 + ",0\n2,1\n")
    with pytest.raises(InvalidValueError, match="integer too large for float32 in column 'f'"):
        loaders.load_table(path, feature_columns=["f"], label_column="label")
    blob = {
        "users": ["u"],
        "num_samples": [2],
        "user_data": {"u": {"x": [[0] * 784, [10**400] + [0] * 783], "y": [1, 2]}},
    }
    leaf = tmp_path / "l.json"
    leaf.write_text(json.dumps(blob))
    with pytest.raises(InvalidValueError, match="x\\[1\\] holds an integer too large"):
        loaders.load_leaf_json(str(leaf), kind="femnist")


def test_decimal_and_long_integer_features_are_numbers(tmp_path: Path) -> None:
    """A Parquet decimal column, and a CSV integer beyond 64 bits, were refused as "numbers
    stored as text"."""
    frame = pd.DataFrame({"f": [Decimal("1.5"), Decimal("-2.25")], "label": [0, 1]})
    frame.to_parquet(tmp_path / "t.parquet")
    table = loaders.load_table(tmp_path / "t.parquet", feature_columns=["f"], label_column="label")
    assert table.x.ravel().tolist() == [1.5, -2.25]
    path = tmp_path / "t.csv"
    path.write_text(f"f,label\n2,0\n{2**64 + 1},1\n")
    table = loaders.load_table(path, feature_columns=["f"], label_column="label")
    assert table.x.ravel().tolist() == [2.0, np.float32(2**64)]
    path.write_text("f,label\n2,0\n" + "9" * 50 + ",1\n")
    with pytest.raises(
        InvalidValueError, match=r"too large for float32 \(first: 1e\+50 in column 'f', row 2"
    ):
        loaders.load_table(path, feature_columns=["f"], label_column="label")


def test_a_float_label_beyond_int64_is_refused(tmp_path: Path) -> None:
    """2**70 as a float label became -9223372036854775808 silently."""
    frame = pd.DataFrame({"f": [1.0, 2.0], "label": [2.0**70, 1.0]})
    frame.to_parquet(tmp_path / "t.parquet")
    with pytest.raises(InvalidValueError, match="Expected class labels"):
        loaders.load_table(tmp_path / "t.parquet", feature_columns=["f"], label_column="label")


def test_leaf_users_are_read_as_listed_and_in_natural_file_order(tmp_path: Path) -> None:
    """all_data_10 was read before all_data_2 (which changed the first writers kept), a user
    id with spaces around it was accepted, and user_data of unlisted users was dropped."""

    def blob(users: list[str], extra: dict | None = None) -> dict:
        data = {u: {"x": [[0.0] * 784], "y": [1]} for u in users}
        return {
            "users": users,
            "num_samples": [1] * len(users),
            "user_data": {**data, **(extra or {})},
        }

    for n in (10, 2, 1):
        (tmp_path / f"all_data_{n}_niid.json").write_text(json.dumps(blob([f"w{n}"])))
    leaf = loaders.load_leaf_json(str(tmp_path), kind="femnist")
    assert leaf.subject_names == ["w1", "w2", "w10"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.json").write_text(json.dumps(blob([" w1"])))
    with pytest.raises(InvalidValueError, match="without surrounding spaces"):
        loaders.load_leaf_json(str(bad / "a.json"), kind="femnist")
    (bad / "a.json").write_text(json.dumps(blob(["w1"], {"w9": {"x": [[0.0] * 784], "y": [2]}})))
    with pytest.raises(InvalidValueError, match="user_data for 1 user\\(s\\) not listed .* 'w9'"):
        loaders.load_leaf_json(str(bad / "a.json"), kind="femnist")


def _leaf_text(user_data: str, users: str = '["u1", "u2"]', counts: str = "[1, 1]") -> str:
    """A FEMNIST file written by hand, so that a key can appear twice (json.dumps cannot)."""
    return f'{{"users": {users}, "num_samples": {counts}, "user_data": {{{user_data}}}}}'


def _femnist_user(user: str, label: int) -> str:
    return f'"{user}": {{"x": [{json.dumps([0.5] * 784)}], "y": [{label}]}}'


def test_a_leaf_user_given_twice_in_user_data_is_refused(tmp_path: Path) -> None:
    """json.load kept the last of two "u1" entries: u1's first record was silently dropped
    (and num_samples still matched, since both held one record)."""
    path = tmp_path / "all_data_0.json"
    path.write_text(
        _leaf_text(
            ", ".join([_femnist_user("u1", 3), _femnist_user("u2", 4), _femnist_user("u1", 5)])
        )
    )
    with pytest.raises(
        InvalidValueError,
        match=r"Expected each user once in user_data of LEAF file '.*all_data_0\.json', got "
        r"user 'u1' more than once",
    ):
        load_leaf_json(path, kind="femnist")
    # the same user in two files is one subject whose records are joined, as before
    (tmp_path / "all_data_0.json").write_text(_leaf_text(_femnist_user("u1", 3), '["u1"]', "[1]"))
    (tmp_path / "all_data_1.json").write_text(_leaf_text(_femnist_user("u1", 5), '["u1"]', "[1]"))
    leaf = load_leaf_json(tmp_path, kind="femnist")
    np.testing.assert_array_equal(leaf.y, [3, 5])
    assert leaf.subject_names == ["u1"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # a top-level key twice: the first user list was dropped
        (
            '{"users": ["u1"], "users": ["u2"], "num_samples": [1], "user_data": {'
            + _femnist_user("u2", 1)
            + "}}",
            r"each key once in the top-level object .* \['users'\] more than once",
        ),
        # a user's "y" twice: the first labels were dropped
        (
            _leaf_text(
                '"u1": {"x": [[0.5, 0.5]], "y": [1], "y": [2]}', users='["u1"]', counts="[1]"
            ),
            r"each key once in user_data for user 'u1' .* \['y'\] more than once",
        ),
    ],
)
def test_any_leaf_key_given_twice_is_refused(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(InvalidValueError, match=named):
        load_leaf_json(path, kind="femnist")


def test_the_leaf_duplicate_check_does_not_copy_values() -> None:
    """The hook runs on every JSON object of files that can be large: it keeps the values
    json built (no copy) and marks an object only when a key repeats."""
    x = [[0.5] * 784]
    obj = loaders._object_once([("x", x), ("y", [1])])
    assert type(obj) is dict and obj["x"] is x
    marked = loaders._object_once([("u", x), ("v", [1]), ("u", [2]), ("v", [3])])
    assert isinstance(marked, loaders._RepeatedKeys) and marked == {"u": [2], "v": [3]}
    assert marked.repeated == ["u", "v"]


@pytest.mark.parametrize(
    ("key", "suffix"), [("subject_column", ".csv"), ("silo_column", ".parquet")]
)
def test_a_label_column_that_is_also_an_id_column_is_refused(
    tmp_path: Path, key: str, suffix: str
) -> None:
    """subject_column = "label" turned the classes into subjects: 3 subjects (one per class)
    instead of an error."""
    path = tmp_path / ("t" + suffix)
    frame = _frame()
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    role = "subject ids" if key == "subject_column" else "silo ids"
    with pytest.raises(
        InvalidValueError,
        match=rf"Expected label_column and {key} to name different columns, got 'label' for "
        rf"both: .*class labels and the {role}",
    ):
        load_table(path, feature_columns=["a", "b"], label_column="label", **{key: "label"})
    # refused before the file is read
    with pytest.raises(InvalidValueError, match=f"label_column and {key}"):
        load_table(tmp_path / "nope.csv", feature_columns=(), label_column="y", **{key: "y"})


def test_an_unnamed_csv_column_is_not_a_default_feature(tmp_path: Path) -> None:
    """df.to_csv(path) writes the index under a blank header, which pandas names
    'Unnamed: 0': with feature_columns unset it became a feature (the row number)."""
    frame = _frame().drop(columns=["hospital", "patient"])
    path = tmp_path / "t.csv"
    frame.to_csv(path)  # with its index
    with pytest.raises(
        InvalidValueError,
        match=r"Expected named feature columns in '.*t\.csv' .*got the unnamed column\(s\) "
        r"\['Unnamed: 0'\].*feature_columns.*without its index",
    ):
        load_table(path, feature_columns=(), label_column="label")
    # listed features are read as before, the index column included if asked for
    assert load_table(path, feature_columns=["a", "b"], label_column="label").x.shape == (5, 2)
    t = load_table(path, feature_columns=["Unnamed: 0", "a"], label_column="label")
    np.testing.assert_array_equal(t.x[:, 0], np.arange(5))
    # any blank header: empty or spaces (CSV), an empty name (Parquet)
    (tmp_path / "b.csv").write_text("a, ,,label\n1,2,3,x\n4,5,6,y\n")
    with pytest.raises(InvalidValueError, match=r"unnamed column\(s\) \[' ', 'Unnamed: 2'\]"):
        load_table(tmp_path / "b.csv", feature_columns=(), label_column="label")
    frame.rename(columns={"b": ""}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(InvalidValueError, match=r"unnamed column\(s\) \[''\]"):
        load_table(tmp_path / "t.parquet", feature_columns=(), label_column="label")
    frame.to_csv(path, index=False)
    assert load_table(path, feature_columns=(), label_column="label").feature_columns == (
        "a",
        "b",
    )
