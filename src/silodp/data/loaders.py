"""Offline loaders that return plain numpy arrays.

Nothing here downloads: each loader reads files already on disk (or bundled with
scikit-learn) and validates them, raising ``ValueError``/``FileNotFoundError`` with a message
that names the bad file, column or value.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from silodp._validation import check_choice, check_int

__all__ = [
    "FASHION_MNIST_ENV",
    "FASHION_MNIST_DEFAULT_ROOT",
    "LEAF_ALL_LETTERS",
    "LeafArrays",
    "TableArrays",
    "find_fashion_mnist",
    "load_digits_arrays",
    "load_fashion_mnist",
    "load_leaf_json",
    "load_table",
    "make_synthetic",
]

FASHION_MNIST_ENV = "SILODP_FASHION_MNIST"
FASHION_MNIST_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"

#: LEAF's Shakespeare alphabet; a character's token id is its index here.
LEAF_ALL_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
if len(LEAF_ALL_LETTERS) != 80 or len(set(LEAF_ALL_LETTERS)) != 80:  # pragma: no cover
    raise RuntimeError("LEAF_ALL_LETTERS must hold 80 distinct characters.")
_LETTER_ID = {c: i for i, c in enumerate(LEAF_ALL_LETTERS)}

_FEMNIST_CLASSES = 62
_FEMNIST_PIXELS = 28 * 28

# --- scikit-learn digits ----------------------------------------------------------------


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digit images bundled with scikit-learn.

    Returns:
      ``x`` float32 of shape ``(n, 1, 8, 8)`` scaled to [0, 1] and ``y`` int64 in [0, 9].
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    return x, y


# --- Fashion-MNIST (IDX files) ----------------------------------------------------------

_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _idx_file(root: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def find_fashion_mnist(root: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding the four Fashion-MNIST IDX files (gzipped or not).

    The directory is ``root`` if given, else the ``SILODP_FASHION_MNIST`` environment
    variable, else ``/usr/share/datasets/fashion-mnist`` (Debian package
    ``dataset-fashion-mnist``).
    """
    if root is None:
        root = os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DEFAULT_ROOT
    path = Path(root)
    hint = (
        f"Install it with `apt-get install dataset-fashion-mnist` or set {FASHION_MNIST_ENV} "
        "to a directory holding the IDX files."
    )
    if not path.is_dir():
        raise FileNotFoundError(f"Fashion-MNIST directory {str(path)!r} does not exist. {hint}")
    missing = [stem + "[.gz]" for stem in _IDX_FILES.values() if _idx_file(path, stem) is None]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST directory {str(path)!r} lacks {', '.join(missing)}. {hint}"
        )
    return path


def _read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """Reads an unsigned-byte IDX file with ``ndim`` dimensions."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4:
        raise ValueError(f"IDX file {str(path)!r} is too short ({len(data)} bytes).")
    magic = int.from_bytes(data[:4], "big")
    expected = 0x0800 | ndim
    if magic != expected:
        raise ValueError(
            f"IDX file {str(path)!r} has magic number {magic:#010x}; expected {expected:#010x} "
            f"(unsigned bytes, {ndim} dimension(s))."
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"IDX file {str(path)!r} is truncated inside its header.")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(shape))
    if len(data) - header != size:
        raise ValueError(
            f"IDX file {str(path)!r} declares shape {shape} ({size} bytes) but holds "
            f"{len(data) - header} data bytes."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _read_idx_pair(root: Path, images: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    img_path = _idx_file(root, _IDX_FILES[images])
    lab_path = _idx_file(root, _IDX_FILES[labels])
    if img_path is None or lab_path is None:
        raise FileNotFoundError(f"Fashion-MNIST {images}/{labels} IDX files vanished from {root}.")
    x = _read_idx(img_path, ndim=3)
    y = _read_idx(lab_path, ndim=1)
    if x.shape[1:] != (28, 28):
        raise ValueError(f"Expected 28x28 images in {str(img_path)!r}, got {x.shape[1:]}.")
    if len(x) != len(y):
        raise ValueError(
            f"{str(img_path)!r} holds {len(x)} images but {str(lab_path)!r} holds {len(y)} labels."
        )
    if len(y) and y.max() > 9:
        raise ValueError(f"Expected labels in [0, 9] in {str(lab_path)!r}, got {int(y.max())}.")
    x = (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    return x, y.astype(np.int64)


def load_fashion_mnist(
    root: str | os.PathLike[str] | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Fashion-MNIST train and t10k test sets from IDX files (see :func:`find_fashion_mnist`).

    Returns:
      ``((x_train, y_train), (x_test, y_test))``; x float32 ``(n, 1, 28, 28)`` in [0, 1],
      y int64 in [0, 9].
    """
    path = find_fashion_mnist(root)
    train = _read_idx_pair(path, "train_images", "train_labels")
    test = _read_idx_pair(path, "test_images", "test_labels")
    return train, test


# --- LEAF JSON (FEMNIST, Shakespeare) ---------------------------------------------------


@dataclass(frozen=True, eq=False)
class LeafArrays:
    """Records of LEAF JSON files.

    Attributes:
      x: FEMNIST: float32 ``(n, 1, 28, 28)``; Shakespeare: int64 token ids ``(n, seq_len)``.
      y: int64 labels.
      subject: dense subject id of each record, in order of first appearance.
      subject_names: LEAF user id of each dense subject id.
      num_classes: 62 (FEMNIST) or 80 (Shakespeare).
    """

    x: np.ndarray
    y: np.ndarray
    subject: np.ndarray
    subject_names: list[str]
    num_classes: int


def _leaf_files(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError("Expected at least one LEAF JSON file or directory, got none.")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise FileNotFoundError(f"LEAF directory {str(p)!r} holds no .json files.")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"LEAF path {str(p)!r} does not exist.")
    return files


def _encode_text(text: Any, where: str) -> list[int]:
    if not isinstance(text, str):
        raise ValueError(f"Expected a string in {where}, got {type(text).__name__}.")
    try:
        return [_LETTER_ID[c] for c in text]
    except KeyError as err:
        raise ValueError(
            f"Unknown character {err.args[0]!r} in {where}; expected one of LEAF's 80 "
            "Shakespeare characters (LEAF_ALL_LETTERS)."
        ) from None


def _femnist_records(xs: list[Any], ys: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(xs, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != _FEMNIST_PIXELS:
        raise ValueError(
            f"Expected {_FEMNIST_PIXELS} pixels per FEMNIST record in {where}, got shape {x.shape}."
        )
    y = np.asarray(ys)
    if y.dtype.kind not in "iu" or (len(y) and (y.min() < 0 or y.max() >= _FEMNIST_CLASSES)):
        raise ValueError(f"Expected integer FEMNIST labels in [0, 61] in {where}.")
    return x.reshape(-1, 1, 28, 28), y.astype(np.int64)


def _shakespeare_records(xs: list[Any], ys: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    tokens = [_encode_text(s, f"{where} x[{i}]") for i, s in enumerate(xs)]
    lengths = {len(t) for t in tokens}
    if len(lengths) > 1:
        raise ValueError(f"Expected equal-length Shakespeare strings in {where}, got {lengths}.")
    labels = []
    for i, c in enumerate(ys):
        ids = _encode_text(c, f"{where} y[{i}]")
        if len(ids) != 1:
            raise ValueError(f"Expected one character in {where} y[{i}], got {c!r}.")
        labels.append(ids[0])
    x = np.asarray(tokens, dtype=np.int64).reshape(len(tokens), -1)
    return x, np.asarray(labels, dtype=np.int64)


def load_leaf_json(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, kind: str
) -> LeafArrays:
    """Reads LEAF JSON files (keys ``users``, ``num_samples``, ``user_data``).

    Args:
      paths: a JSON file, a directory (all ``*.json`` in name order) or a list of them.
      kind: ``"femnist"`` (784 floats -> ``(1, 28, 28)``, 62 classes) or ``"shakespeare"``
        (strings over LEAF's 80-character alphabet -> token ids, 80 classes).

    Users become subjects, numbered in order of first appearance; a user present in several
    files has its records concatenated.
    """
    check_choice("kind", kind, ("femnist", "shakespeare"))
    parse = _femnist_records if kind == "femnist" else _shakespeare_records
    names: dict[str, int] = {}
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    subjects: list[np.ndarray] = []
    for file in _leaf_files(paths):
        with open(file, encoding="utf-8") as fh:
            try:
                blob = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(f"LEAF file {str(file)!r} is not valid JSON: {err}.") from None
        missing = [k for k in ("users", "num_samples", "user_data") if k not in blob]
        if missing:
            raise ValueError(f"LEAF file {str(file)!r} lacks key(s) {missing}.")
        users, counts, data = blob["users"], blob["num_samples"], blob["user_data"]
        if len(users) != len(counts):
            raise ValueError(
                f"LEAF file {str(file)!r} lists {len(users)} users but {len(counts)} num_samples."
            )
        for user, count in zip(users, counts, strict=True):
            where = f"{str(file)!r} user {user!r}"
            if user not in data:
                raise ValueError(f"LEAF file {str(file)!r} has no user_data for user {user!r}.")
            record = data[user]
            ux, uy = record.get("x", []), record.get("y", [])
            if len(ux) != len(uy) or len(ux) != count:
                raise ValueError(
                    f"{where}: num_samples={count} but {len(ux)} x and {len(uy)} y entries."
                )
            if count == 0:
                continue
            x, y = parse(ux, uy, where)
            sid = names.setdefault(str(user), len(names))
            xs.append(x)
            ys.append(y)
            subjects.append(np.full(len(y), sid, dtype=np.int64))
    if not ys:
        raise ValueError(f"LEAF input {paths!r} holds no records.")
    return LeafArrays(
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        subject=np.concatenate(subjects),
        subject_names=list(names),
        num_classes=_FEMNIST_CLASSES if kind == "femnist" else len(LEAF_ALL_LETTERS),
    )


# --- tables (CSV / Parquet) -------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TableArrays:
    """Records of a CSV or Parquet table.

    Attributes:
      x: float32 features ``(n, len(feature_columns))``.
      y: dense int64 labels; ``label_values[y]`` is the original label.
      feature_columns: the feature column names used, in order.
      label_values: original label value of each dense label id.
      silo, silo_names: dense silo ids and their original values (``None`` without a column).
      subject, subject_names: dense subject ids and their original values (likewise).
    """

    x: np.ndarray
    y: np.ndarray
    feature_columns: tuple[str, ...]
    label_values: list[Any]
    silo: np.ndarray | None = None
    silo_names: list[str] | None = None
    subject: np.ndarray | None = None
    subject_names: list[str] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.label_values)


def _read_frame(path: Path) -> Any:
    import pandas as pd

    if not path.is_file():
        raise FileNotFoundError(f"Table file {str(path)!r} does not exist.")
    suffix = path.name.lower()
    if suffix.endswith(".parquet") or suffix.endswith(".pq"):
        return pd.read_parquet(path)
    if suffix.endswith(".csv") or suffix.endswith(".csv.gz"):
        return pd.read_csv(path)
    raise ValueError(f"Expected a .csv or .parquet table, got {str(path)!r}.")


def _to_python(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _dense_ids(values: Any) -> tuple[np.ndarray, list[Any]]:
    """Maps values to dense ids in sorted order of the distinct values."""
    uniques, ids = np.unique(np.asarray(values), return_inverse=True)
    return ids.astype(np.int64).reshape(-1), [_to_python(v) for v in uniques]


def _select_features(
    frame: Any, path: Path, feature_columns: Sequence[str], id_columns: list[str]
) -> list[str]:
    """The feature columns asked for, or every column other than the id columns."""
    features = list(feature_columns) or [c for c in frame.columns if c not in id_columns]
    if not features:
        raise ValueError(f"Table {str(path)!r} has no feature columns besides {id_columns}.")
    return features


def _check_columns(frame: Any, path: Path, wanted: list[str]) -> None:
    """Refuses a table lacking one of the ``wanted`` columns or a value in one of them."""
    absent = [c for c in wanted if c not in frame.columns]
    if absent:
        raise ValueError(
            f"Table {str(path)!r} lacks column(s) {absent}; it has {list(frame.columns)}."
        )
    for column in wanted:
        missing = int(frame[column].isna().sum())
        if missing:
            raise ValueError(
                f"Column {column!r} of table {str(path)!r} has {missing} missing value(s)."
            )


def _feature_matrix(frame: Any, path: Path, features: list[str]) -> np.ndarray:
    """The ``features`` as float32 ``(n, len(features))``; refuses non-numeric columns and
    infinite values."""
    non_numeric = [c for c in features if frame[c].dtype.kind not in "biuf"]
    if non_numeric:
        raise ValueError(
            f"Expected numeric feature columns in {str(path)!r}; {non_numeric} are not numeric."
        )
    x = frame[features].to_numpy(dtype=np.float32)
    bad = ~np.isfinite(x)
    if bad.any():
        col = features[int(np.nonzero(bad)[1][0])]
        raise ValueError(
            f"Table {str(path)!r} has {int(bad.sum())} infinite feature value(s) "
            f"(first in column {col!r})."
        )
    return x


def _encode_labels(
    raw_labels: np.ndarray, path: Path, label_column: str, label_values: Sequence[Any] | None
) -> tuple[np.ndarray, list[Any]]:
    """Dense labels and the original value of each: the sorted distinct values, or the given
    ``label_values`` (a label outside them is an error)."""
    if label_values is None:
        return _dense_ids(raw_labels)
    values = list(label_values)
    lookup = {v: i for i, v in enumerate(values)}
    unknown = sorted({_to_python(v) for v in raw_labels if _to_python(v) not in lookup}, key=str)
    if unknown:
        raise ValueError(
            f"Column {label_column!r} of {str(path)!r} has label(s) {unknown[:10]} not in "
            f"the given label_values {values[:10]}."
        )
    return np.asarray([lookup[_to_python(v)] for v in raw_labels], dtype=np.int64), values


def _id_column(frame: Any, column: str | None) -> tuple[np.ndarray | None, list[str] | None]:
    """Dense ids of ``column``'s values (as strings, sorted) and the values; ``None`` without
    a column."""
    if column is None:
        return None, None
    ids, names = _dense_ids(frame[column].astype(str).to_numpy())
    return ids, [str(n) for n in names]


def load_table(
    path: str | os.PathLike[str],
    *,
    feature_columns: Sequence[str],
    label_column: str,
    silo_column: str | None = None,
    subject_column: str | None = None,
    label_values: Sequence[Any] | None = None,
) -> TableArrays:
    """Reads a ``.csv`` or ``.parquet`` table.

    Args:
      feature_columns: numeric feature columns; empty means every column other than the
        label, silo and subject columns.
      label_column: the label; its distinct values (sorted) become labels ``0..C-1``.
      silo_column, subject_column: optional id columns, mapped to dense ids (sorted).
      label_values: a fixed label mapping (e.g. the training table's ``label_values`` when
        reading its test table); labels outside it are an error.
    """
    path = Path(path)
    frame = _read_frame(path)
    if len(frame) == 0:
        raise ValueError(f"Table {str(path)!r} has no rows.")
    id_columns = [c for c in (label_column, silo_column, subject_column) if c is not None]
    features = _select_features(frame, path, feature_columns, id_columns)
    _check_columns(frame, path, features + id_columns)
    x = _feature_matrix(frame, path, features)
    y, values = _encode_labels(frame[label_column].to_numpy(), path, label_column, label_values)
    silo, silo_names = _id_column(frame, silo_column)
    subject, subject_names = _id_column(frame, subject_column)
    return TableArrays(
        x=x,
        y=y,
        feature_columns=tuple(features),
        label_values=values,
        silo=silo,
        silo_names=silo_names,
        subject=subject,
        subject_names=subject_names,
    )


# --- synthetic --------------------------------------------------------------------------


def make_synthetic(
    *, num_records: int, num_features: int, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A learnable Gaussian-mixture classification task.

    Each class ``c`` has a mean ``mu_c ~ N(0, I)``; a record of class ``c`` (classes drawn
    uniformly) is ``mu_c + N(0, 0.5^2 I)``. Returns float32 ``x`` ``(n, num_features)`` and int64
    ``y``.
    """
    n = check_int("num_records", num_records, 1)
    d = check_int("num_features", num_features, 1)
    c = check_int("num_classes", num_classes, 2)
    means = rng.normal(size=(c, d))
    y = rng.integers(0, c, size=n).astype(np.int64)
    x = means[y] + 0.5 * rng.normal(size=(n, d))
    return x.astype(np.float32), y
