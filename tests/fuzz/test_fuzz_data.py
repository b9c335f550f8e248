"""Property tests of the data loaders and the build step on bad input.

Each test starts from a small valid file (CSV table, LEAF JSON, IDX) or array, damages it the
way a file gets damaged (a bad cell, a cut, garbage bytes, a wrong type) and checks that the
loader either reads it or refuses it with a :class:`~silodp.errors.SilodpError` whose message
names the file — never an error from inside pandas, numpy or json, never a silent repair.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silodp.data.bounds import check_records_per_subject
from silodp.data.build import DataConfig, build_federated_data
from silodp.data.dataset import FederatedDataset
from silodp.data.describe import describe, format_description
from silodp.data.loaders import load_fashion_mnist, load_leaf_json, load_table
from silodp.errors import InvalidValueError, SilodpError

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# --- tables -----------------------------------------------------------------------------

HEADER = ["f0", "f1", "label", "person", "site"]


def _rows() -> list[list[str]]:
    """12 valid records: 6 people over sites 1, 2 and 10 (numeric ids), labels 0/1."""
    rows = []
    for i in range(12):
        rows.append(
            [f"{i * 0.5:g}", f"{(i % 5) - 2}", str(i % 2), f"p{i % 6:02d}", "1 2 10".split()[i % 3]]
        )
    return rows


def _csv(rows: list[list[str]], header: list[str] = HEADER) -> str:
    return "\n".join(",".join(r) for r in [header, *rows]) + "\n"


def _config(path: Path) -> DataConfig:
    return DataConfig(
        source="table",
        path=str(path),
        feature_columns=("f0", "f1"),
        label_column="label",
        subject_column="person",
        silo_column="site",
        allocation="column",
        test_split="record",
        test_fraction=0.25,
    )


#: (column, bad cell, what the error must name)
BAD_CELLS = [
    ("f0", "", "missing"),
    ("f1", "nan", "missing"),
    ("f0", "inf", "infinite"),
    ("f1", "-inf", "infinite"),
    ("f0", "1e400", "infinite"),
    ("f1", "3e38x", "not numeric"),
    ("f0", "abc", "not numeric"),
    ("label", "", "missing"),
    ("label", "0.5", "0.5"),
    ("label", "inf", "inf"),
    ("person", "", "missing"),
    ("person", " p01", "' p01'"),
    ("person", "p01 ", "'p01 '"),
    ("site", "", "missing"),
    ("site", " x", "' x'"),
]


@SETTINGS
@given(bad=st.sampled_from(BAD_CELLS), row=st.integers(0, 11))
def test_a_bad_cell_is_refused_naming_the_file_column_and_row(
    tmp_path: Path, bad: tuple[str, str, str], row: int
) -> None:
    column, cell, named = bad
    rows = _rows()
    rows[row][HEADER.index(column)] = cell
    path = tmp_path / "bad.csv"
    path.write_text(_csv(rows))
    with pytest.raises(InvalidValueError) as err:
        build_federated_data(_config(path))
    message = str(err.value)
    assert str(path) in message and named in message, message
    assert column in message, message
    assert f"row {row + 1}" in message or column == "label" and "single" in message, message


@SETTINGS
@given(cut=st.integers(0, 400), garbage=st.binary(max_size=8), where=st.integers(0, 400))
def test_a_cut_or_garbled_table_is_read_or_refused_naming_the_file(
    tmp_path: Path, cut: int, garbage: bytes, where: int
) -> None:
    data = _csv(_rows()).encode()
    data = data[: min(cut, len(data))] if cut < len(data) else data
    where = min(where, len(data))
    data = data[:where] + garbage + data[where:]
    path = tmp_path / "t.csv"
    path.write_bytes(data)
    try:
        built = build_federated_data(_config(path))
    except SilodpError as err:
        assert str(path) in str(err), str(err)
    else:
        assert np.isfinite(built.train.x).all() and len(built.test) >= 1


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "is empty"),
        (",".join(HEADER) + "\n", "has no rows"),
        (_csv(_rows()[:1]), "single label"),
        (_csv(_rows()[:2]), "leaves no test records"),
        (_csv(_rows(), header=["f0", "f0", "label", "person", "site"]), "['f0'] more than once"),
        ("f0,f1\n1,2,3,4\n5,6\n", "more fields than its header"),
        ("f0,f1\n1,2\n5,6,7\n", "cannot be parsed as CSV"),
    ],
)
def test_empty_one_row_and_malformed_tables_name_the_file(
    tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(InvalidValueError) as err:
        build_federated_data(_config(path))
    assert str(path) in str(err.value) and named in str(err.value), str(err.value)


def test_a_table_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(_csv(_rows()).encode().replace(b"p01", b"p\xff1"))
    with pytest.raises(InvalidValueError, match="not UTF-8"):
        load_table(path, feature_columns=["f0"], label_column="label", subject_column="person")


@SETTINGS
@given(ids=st.lists(st.integers(0, 10**6), min_size=2, max_size=12, unique=True))
def test_numeric_silo_ids_are_ordered_numerically(tmp_path: Path, ids: list[int]) -> None:
    rows = _rows()[:0]
    for i, silo in enumerate(ids):
        rows.append([str(i), "1", str(i % 2), f"p{i}", str(silo)])
        rows.append([str(i), "2", str((i + 1) % 2), f"p{i}", str(silo)])
    path = tmp_path / "t.csv"
    path.write_text(_csv(rows))
    table = load_table(path, feature_columns=["f0"], label_column="label", silo_column="site")
    assert table.silo_names == [str(v) for v in sorted(ids)]
    assert table.silo is not None
    for row, silo in zip(table.silo, (s for s in ids for _ in range(2)), strict=True):
        assert table.silo_names[row] == str(silo)


# --- LEAF JSON --------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def _leaf_blob() -> dict[str, Any]:
    px = [0.25] * 784
    return {
        "users": ["w1", "w2"],
        "num_samples": [2, 1],
        "user_data": {"w1": {"x": [px, px], "y": [3, 61]}, "w2": {"x": [px], "y": [0]}},
    }


def _paths(blob: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON value, skipping inside the 784-pixel lists (one stands for all)."""
    out = [prefix]
    if isinstance(blob, dict):
        for k, v in blob.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(blob, list):
        for i, v in enumerate(blob[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _replace(blob: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    blob[path[0]] = _replace(blob[path[0]], path[1:], value)
    return blob


@SETTINGS
@given(data=st.data(), value=JSON_VALUES)
def test_a_wrong_typed_leaf_entry_is_refused_naming_the_file(
    tmp_path: Path, data: st.DataObject, value: Any
) -> None:
    blob = _leaf_blob()
    path = data.draw(st.sampled_from(_paths(blob)))
    blob = _replace(blob, path, value)
    file = tmp_path / "leaf.json"
    file.write_text(json.dumps(blob))
    try:
        leaf = load_leaf_json(file, kind="femnist")
    except SilodpError as err:
        assert str(file) in str(err), str(err)
    else:
        assert np.isfinite(leaf.x).all() and leaf.y.min() >= 0 and leaf.y.max() < 62
        assert len(set(leaf.subject_names)) == len(leaf.subject_names)


@SETTINGS
@given(cut=st.integers(0, 20000), kind=st.sampled_from(["femnist", "shakespeare"]))
def test_a_truncated_leaf_file_is_refused_naming_the_file(
    tmp_path: Path, cut: int, kind: str
) -> None:
    text = json.dumps(_leaf_blob())
    file = tmp_path / "leaf.json"
    file.write_text(text[: cut % len(text)])
    with pytest.raises(InvalidValueError) as err:
        load_leaf_json(file, kind=kind)
    assert str(file) in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda b: b.update(users=["w1", "w1"], num_samples=[2, 2]), "twice"),
        (lambda b: b.update(users=["", "w2"]), "users[0]"),
        (lambda b: b["user_data"]["w1"].update(y=[3, True]), "y[1]"),
        (lambda b: b["user_data"]["w1"].update(y=[3, 62]), "got 62 at y[1]"),
        (lambda b: b["user_data"]["w1"].update(y=[3, 1.0]), "got 1.0 at y[1]"),
        (lambda b: b["user_data"]["w2"]["x"][0].__setitem__(5, math.nan), "x[0][5]"),
        (lambda b: b["user_data"]["w2"]["x"][0].__setitem__(7, 1e39), "x[0][7]"),
        (lambda b: b["user_data"]["w2"]["x"][0].__setitem__(7, "a"), "'a' at x[0]"),
        (lambda b: b.update(num_samples=[2, True]), "num_samples[1]"),
        (lambda b: b.update(users="w1"), "users"),
    ],
)
def test_bad_leaf_values_are_named(tmp_path: Path, mutate: Any, named: str) -> None:
    blob = _leaf_blob()
    mutate(blob)
    file = tmp_path / "leaf.json"
    file.write_text(json.dumps(blob))
    with pytest.raises(InvalidValueError) as err:
        load_leaf_json(file, kind="femnist")
    assert str(file) in str(err.value) and named in str(err.value), str(err.value)


def test_shakespeare_users_with_different_lengths_are_refused(tmp_path: Path) -> None:
    blob = {
        "users": ["A", "B"],
        "num_samples": [1, 1],
        "user_data": {"A": {"x": ["abcd"], "y": ["e"]}, "B": {"x": ["abc"], "y": ["d"]}},
    }
    file = tmp_path / "s.json"
    file.write_text(json.dumps(blob))
    with pytest.raises(InvalidValueError, match=r"user 'B' has \(3,\)"):
        load_leaf_json(file, kind="shakespeare")


# --- IDX (Fashion-MNIST) ----------------------------------------------------------------


def _idx(arr: np.ndarray) -> bytes:
    header = (0x0800 | arr.ndim).to_bytes(4, "big")
    return header + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.tobytes()


def _write_idx(root: Path, n: int = 3) -> dict[str, bytes]:
    parts = {
        "train-images-idx3-ubyte": _idx(np.full((n, 28, 28), 7, dtype=np.uint8)),
        "train-labels-idx1-ubyte": _idx(np.arange(n, dtype=np.uint8)),
        "t10k-images-idx3-ubyte": _idx(np.full((2, 28, 28), 9, dtype=np.uint8)),
        "t10k-labels-idx1-ubyte": _idx(np.array([1, 2], dtype=np.uint8)),
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, data in parts.items():
        (root / (name + ".gz")).write_bytes(gzip.compress(data))
    return parts


@SETTINGS
@given(
    name=st.sampled_from(["train-images-idx3-ubyte", "train-labels-idx1-ubyte"]),
    cut=st.integers(0, 3000),
    flip=st.integers(0, 40),
    byte=st.integers(0, 255),
    gz=st.booleans(),
)
def test_a_cut_or_garbled_idx_file_is_refused_or_read_naming_the_file(
    tmp_path: Path, name: str, cut: int, flip: int, byte: int, gz: bool
) -> None:
    root = tmp_path / "fm"
    parts = _write_idx(root)
    data = bytearray(parts[name])
    data[flip % len(data)] = byte
    data = data[: cut % (len(data) + 1)]
    blob = gzip.compress(bytes(data)) if gz else bytes(data)
    if gz and cut % 3 == 0:  # garble the gzip stream itself
        blob = blob[: max(len(blob) // 2, 1)]
    (root / (name + ".gz")).write_bytes(blob) if gz else (root / name).write_bytes(blob)
    if not gz:
        (root / (name + ".gz")).unlink()
    try:
        (x, y), _ = load_fashion_mnist(root)
    except SilodpError as err:
        assert name in str(err), str(err)
    else:
        assert x.shape == (len(y), 1, 28, 28) and y.max() <= 9


def test_an_idx_header_declaring_a_huge_shape_is_refused_before_reading(tmp_path: Path) -> None:
    root = tmp_path / "fm"
    _write_idx(root)
    huge = (
        (0x0803).to_bytes(4, "big") + (2**32 - 1).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    )
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(huge))
    with pytest.raises(InvalidValueError, match="train-images-idx3-ubyte.gz' declares shape"):
        load_fashion_mnist(root)


# --- the dataset itself -----------------------------------------------------------------

ARRAY_VALUES = st.sampled_from(
    [math.nan, math.inf, -math.inf, -1, -1.5, 0.5, 2**63, 1e300, 10**30, "a", None, True]
)


@SETTINGS
@given(
    field=st.sampled_from(["x", "y", "silo", "subject", "num_classes", "num_silos"]),
    value=ARRAY_VALUES,
    index=st.integers(0, 5),
)
def test_a_bad_dataset_value_is_an_invalid_value_error(field: str, value: Any, index: int) -> None:
    parts: dict[str, Any] = {
        "x": np.zeros((6, 2), dtype=np.float64),
        "y": np.array([0, 1, 0, 1, 0, 1]),
        "silo": np.array([0, 0, 1, 1, 2, 2]),
        "subject": np.array([0, 1, 2, 0, 1, 2]),
        "num_classes": 2,
        "num_silos": 3,
    }
    if field in ("num_classes", "num_silos"):
        parts[field] = -2 if value == -1 else value  # num_silos=-1 means "from the ids"
    else:
        arr = parts[field].astype(object)
        if field == "x":
            arr[index, 1] = value
        else:
            arr[index] = value
        parts[field] = arr
    with pytest.raises(InvalidValueError):
        FederatedDataset(**parts)


def test_dataset_names_must_fit_the_ids() -> None:
    parts: dict[str, Any] = {
        "x": np.zeros((4, 2)),
        "y": [0, 1, 0, 1],
        "silo": [0, 1, 0, 1],
        "subject": [0, 1, 2, 0],
        "num_classes": 2,
    }
    with pytest.raises(InvalidValueError, match="at least 3 subject_names"):
        FederatedDataset(**parts, subject_names=["a", "b"])
    with pytest.raises(InvalidValueError, match="distinct subject_names, got 'a'"):
        FederatedDataset(**parts, subject_names=["a", "b", "a"])
    with pytest.raises(InvalidValueError, match="2 silo_names"):
        FederatedDataset(**parts, silo_names=["h1"])
    with pytest.raises(InvalidValueError, match="dense"):
        FederatedDataset(**{**parts, "subject": [0, 1, 2, 2**40]})


# --- n_max: refused, naming the subject by its own id ----------------------------------


@SETTINGS
@given(counts=st.lists(st.integers(1, 9), min_size=2, max_size=8), bound=st.integers(1, 9))
def test_a_subject_above_n_max_is_refused_by_its_original_id(counts: list[int], bound: int) -> None:
    subject = np.repeat(np.arange(len(counts)), counts)
    n = len(subject)
    names = [f"p{1000 + a}" for a in range(len(counts))]
    dataset = FederatedDataset(
        x=np.zeros((n, 1)),
        y=np.arange(n) % 2 if n > 1 else [0],
        silo=np.arange(n) % 2,
        subject=subject,
        num_classes=2,
        subject_names=names,
    )
    over = [names[a] for a, c in enumerate(counts) if c > bound]
    if not over:
        check_records_per_subject(dataset, bound, name="n_max")
        return
    with pytest.raises(InvalidValueError) as err:
        check_records_per_subject(dataset, bound, name="n_max")
    message = str(err.value)
    assert f"n_max={bound}" in message and f"{len(over)} subject(s)" in message
    worst = max(range(len(counts)), key=lambda a: (counts[a], -a))
    assert f"'{names[worst]}' ({counts[worst]})" in message
    assert f"at least {max(counts)}" in message


def test_describe_shows_silo_ids_and_the_largest_subject_by_id(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(_csv(_rows()))
    data = build_federated_data(_config(path))
    info = describe(data)
    assert info["silo_ids"] == ["1", "2", "10"]
    assert info["max_records_subject_id"].startswith("p0")
    assert json.loads(json.dumps(info)) == info
    text = format_description(info)
    assert "0='1' 1='2' 2='10'" in text
    assert f"(subject {info['max_records_subject_id']})" in text
