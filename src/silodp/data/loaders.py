"""Offline loaders that return plain numpy arrays.

Nothing here downloads: each loader reads files already on disk (or bundled with
scikit-learn) and validates them: a file that is missing raises
:class:`DataFileNotFoundError`, one that is not what the loader reads raises
:class:`~silodp.errors.InvalidValueError`, each with a message naming the file, column, row or
value and what was expected (never an error from inside pandas, numpy or json).
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import math
import os
import re
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

from silodp._validation import check_choice, check_int
from silodp.errors import InvalidValueError, SilodpError

__all__ = [
    "DataFileNotFoundError",
    "FASHION_MNIST_ENV",
    "FASHION_MNIST_DEFAULT_ROOT",
    "LEAF_ALL_LETTERS",
    "LeafArrays",
    "TableArrays",
    "check_label_columns",
    "check_one_spelling",
    "find_fashion_mnist",
    "load_digits_arrays",
    "load_fashion_mnist",
    "load_leaf_json",
    "load_table",
    "make_synthetic",
    "table_columns",
]

logger = logging.getLogger(__name__)

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


class DataFileNotFoundError(SilodpError, FileNotFoundError):
    """A data file or directory a config names does not exist (a ``FileNotFoundError``)."""


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
        raise DataFileNotFoundError(f"Fashion-MNIST directory {str(path)!r} does not exist. {hint}")
    missing = [stem + "[.gz]" for stem in _IDX_FILES.values() if _idx_file(path, stem) is None]
    if missing:
        raise DataFileNotFoundError(
            f"Fashion-MNIST directory {str(path)!r} lacks {', '.join(missing)}. {hint}"
        )
    return path


#: the largest IDX data section read (Fashion-MNIST's training images take 47 MB)
MAX_IDX_BYTES = 2**31


def _idx_error(path: Path, what: str) -> InvalidValueError:
    return InvalidValueError(f"IDX file {str(path)!r} {what}.")


def _read_exactly(fh: Any, size: int, path: Path, where: str) -> bytes:
    try:
        data: bytes = fh.read(size)
    except (OSError, EOFError, zlib.error) as err:  # a garbled or cut gzip stream
        raise _idx_error(
            path,
            f"cannot be read ({type(err).__name__}: {err}); expected an IDX file, raw or gzipped",
        ) from None
    if len(data) < size:
        raise _idx_error(path, f"is truncated {where} ({len(data)} of {size} bytes)")
    return data


def _read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """Reads an unsigned-byte IDX file with ``ndim`` dimensions.

    Reads the header first and then no more than the shape it declares, so a garbled or
    hostile header is refused before anything large is read.
    """
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        head = _read_exactly(fh, 4, path, "before its magic number")
        magic = int.from_bytes(head, "big")
        expected = 0x0800 | ndim
        if magic != expected:
            raise _idx_error(
                path,
                f"has magic number {magic:#010x}; expected {expected:#010x} "
                f"(unsigned bytes, {ndim} dimension(s))",
            )
        dims = _read_exactly(fh, 4 * ndim, path, "inside its header")
        shape = tuple(int.from_bytes(dims[4 * i : 4 * i + 4], "big") for i in range(ndim))
        size = math.prod(shape)
        if size > MAX_IDX_BYTES:
            raise _idx_error(
                path, f"declares shape {shape} ({size} bytes); expected at most {MAX_IDX_BYTES}"
            )
        try:
            data = fh.read(size + 1)
        except (OSError, EOFError, zlib.error) as err:
            raise _idx_error(
                path, f"cannot be read ({type(err).__name__}: {err}); expected an IDX file"
            ) from None
    if len(data) != size:
        held = f"{len(data)}" if len(data) <= size else "more"
        raise _idx_error(path, f"declares shape {shape} ({size} bytes) but holds {held} data bytes")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _read_idx_pair(root: Path, images: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    img_path = _idx_file(root, _IDX_FILES[images])
    lab_path = _idx_file(root, _IDX_FILES[labels])
    if img_path is None or lab_path is None:
        raise DataFileNotFoundError(
            f"Fashion-MNIST {images}/{labels} IDX files vanished from {str(root)!r}."
        )
    x = _read_idx(img_path, ndim=3)
    y = _read_idx(lab_path, ndim=1)
    if x.shape[1:] != (28, 28):
        raise _idx_error(img_path, f"holds images of shape {x.shape[1:]}; expected 28x28")
    if len(x) == 0:
        raise _idx_error(img_path, "holds no images; expected at least one")
    if len(x) != len(y):
        raise InvalidValueError(
            f"{str(img_path)!r} holds {len(x)} images but {str(lab_path)!r} holds {len(y)} labels."
        )
    if y.max() > 9:
        first = int(np.flatnonzero(y > 9)[0])
        raise _idx_error(
            lab_path, f"holds label {int(y[first])} at index {first}; expected labels in [0, 9]"
        )
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
        raise InvalidValueError("Expected at least one LEAF JSON file or directory, got none.")
    files: list[Path] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not str(item):
            raise InvalidValueError(f"Expected a LEAF file or directory path, got {item!r}.")
        p = Path(item)
        if p.is_dir():
            matches = sorted(p.glob("*.json"), key=_natural_key)  # all_data_2 before _10
            found = [f for f in matches if f.is_file()]
            skipped = [f.name for f in matches if not f.is_file()]
            if skipped:  # a subdirectory, or a link to nothing, is no LEAF file
                logger.warning(
                    "LEAF directory %r: skipping %s, named *.json but not a file",
                    str(p),
                    skipped[:5],
                )
            if not found:
                raise DataFileNotFoundError(f"LEAF directory {str(p)!r} holds no .json files.")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataFileNotFoundError(f"LEAF path {str(p)!r} does not exist.")
    return files


def _natural_key(path: Path) -> list[Any]:
    """Sort key of a file name with its digit runs compared as numbers."""
    return [
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"(\d+)", path.name)
    ]


def _overflows(row: Any) -> bool:
    try:
        np.asarray(row, dtype=np.float64)
    except OverflowError:
        return True
    return False


def _encode_text(text: Any, where: str) -> list[int]:
    if not isinstance(text, str):
        raise InvalidValueError(f"Expected a string in {where}, got {type(text).__name__}.")
    try:
        return [_LETTER_ID[c] for c in text]
    except KeyError as err:
        raise InvalidValueError(
            f"Unknown character {err.args[0]!r} in {where}; expected one of LEAF's 80 "
            "Shakespeare characters (LEAF_ALL_LETTERS)."
        ) from None


def _femnist_records(xs: list[Any], ys: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    for i, row in enumerate(xs):
        if not isinstance(row, list) or len(row) != _FEMNIST_PIXELS:
            got = f"{len(row)} values" if isinstance(row, list) else type(row).__name__
            raise InvalidValueError(
                f"Expected {_FEMNIST_PIXELS} pixels per FEMNIST record in {where}, got {got} "
                f"at x[{i}]."
            )
        bad = next((v for v in row if isinstance(v, bool) or not isinstance(v, int | float)), None)
        if bad is not None:
            raise InvalidValueError(
                f"Expected numeric FEMNIST pixels in {where}, got {bad!r} at x[{i}]."
            )
    try:
        x = np.asarray(xs, dtype=np.float64)
    except OverflowError:  # an integer beyond any float (e.g. 400 digits)
        first = next(i for i, row in enumerate(xs) if _overflows(row))
        raise InvalidValueError(
            f"Expected finite FEMNIST pixels in {where}; x[{first}] holds an integer too "
            "large for float32."
        ) from None
    finite = np.isfinite(x) & (np.abs(x) <= np.finfo(np.float32).max)
    if not finite.all():
        row, col = (int(v[0]) for v in np.nonzero(~finite))
        raise InvalidValueError(
            f"Expected finite FEMNIST pixels in {where}; {int((~finite).sum())} are NaN, "
            f"infinite or too large for float32 (first: {x[row, col].item()!r} at x[{row}][{col}])."
        )
    for i, label in enumerate(ys):
        if (
            isinstance(label, bool)
            or not isinstance(label, int)
            or not 0 <= label < _FEMNIST_CLASSES
        ):
            raise InvalidValueError(
                f"Expected integer FEMNIST labels in [0, {_FEMNIST_CLASSES - 1}] in {where}, "
                f"got {label!r} at y[{i}]."
            )
    return x.astype(np.float32).reshape(-1, 1, 28, 28), np.asarray(ys, dtype=np.int64)


def _shakespeare_records(xs: list[Any], ys: list[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    tokens = [_encode_text(s, f"{where} x[{i}]") for i, s in enumerate(xs)]
    lengths = {len(t) for t in tokens}
    if len(lengths) > 1:
        raise InvalidValueError(
            f"Expected equal-length Shakespeare strings in {where}, got lengths {sorted(lengths)}."
        )
    if lengths == {0}:
        raise InvalidValueError(f"Expected non-empty Shakespeare strings in {where}, got ''.")
    labels = []
    for i, c in enumerate(ys):
        ids = _encode_text(c, f"{where} y[{i}]")
        if len(ids) != 1:
            raise InvalidValueError(f"Expected one character in {where} y[{i}], got {c!r}.")
        labels.append(ids[0])
    x = np.asarray(tokens, dtype=np.int64).reshape(len(tokens), -1)
    return x, np.asarray(labels, dtype=np.int64)


class _RepeatedKeys(dict[str, Any]):
    """A JSON object that named a key more than once (``repeated``, in order); ``json``
    would keep only the last value."""

    repeated: list[str]


def _object_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for LEAF files: the object as ``json`` builds it (no value is
    copied), marked as :class:`_RepeatedKeys` when a key occurs more than once."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for key, _ in pairs:
        if key in seen:
            repeated[key] = None
        seen.add(key)
    marked = _RepeatedKeys(obj)
    marked.repeated = list(repeated)
    return marked


def _refuse_repeated(obj: Any, file: Path, where: str) -> None:
    if isinstance(obj, _RepeatedKeys):
        raise InvalidValueError(
            f"Expected each key once in {where} of LEAF file {str(file)!r}, got "
            f"{obj.repeated[:5]} more than once; JSON keeps only the last, which would "
            "silently drop the others."
        )


def _read_leaf_blob(file: Path) -> dict[str, Any]:
    """The JSON object of a LEAF file, with its three keys checked for shape (and no key,
    user in ``user_data`` included, given twice)."""
    try:
        with open(file, encoding="utf-8") as fh:
            blob = json.load(fh, object_pairs_hook=_object_once)
    except json.JSONDecodeError as err:
        raise InvalidValueError(f"LEAF file {str(file)!r} is not valid JSON: {err}.") from None
    except UnicodeDecodeError as err:
        raise InvalidValueError(f"LEAF file {str(file)!r} is not UTF-8 text: {err}.") from None
    except RecursionError:
        raise InvalidValueError(f"LEAF file {str(file)!r} is nested too deeply.") from None
    except OSError as err:
        raise InvalidValueError(
            f"LEAF file {str(file)!r} cannot be read ({type(err).__name__}: {err}); expected "
            "a readable LEAF JSON file."
        ) from None
    if not isinstance(blob, dict):
        raise InvalidValueError(
            f"Expected LEAF file {str(file)!r} to hold a JSON object with keys users, "
            f"num_samples and user_data, got a JSON {type(blob).__name__}."
        )
    _refuse_repeated(blob, file, "the top-level object")
    missing = [k for k in ("users", "num_samples", "user_data") if k not in blob]
    if missing:
        raise InvalidValueError(f"LEAF file {str(file)!r} lacks key(s) {missing}.")
    users, counts, data = blob["users"], blob["num_samples"], blob["user_data"]
    if isinstance(data, _RepeatedKeys):
        more = f" (users given twice: {data.repeated[:5]})" if len(data.repeated) > 1 else ""
        raise InvalidValueError(
            f"Expected each user once in user_data of LEAF file {str(file)!r}, got user "
            f"{data.repeated[0]!r} more than once{more}; JSON keeps only the last, which would "
            "silently drop the other records."
        )
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(data, dict):
        raise InvalidValueError(
            f"Expected lists users and num_samples and an object user_data in LEAF file "
            f"{str(file)!r}, got {type(users).__name__}, {type(counts).__name__} and "
            f"{type(data).__name__}."
        )
    if len(users) != len(counts):
        raise InvalidValueError(
            f"LEAF file {str(file)!r} lists {len(users)} users but {len(counts)} num_samples."
        )
    seen: set[str] = set()
    for i, (user, count) in enumerate(zip(users, counts, strict=True)):
        if not isinstance(user, str) or not user.strip() or user != user.strip():
            raise InvalidValueError(
                f"Expected a non-empty user id string without surrounding spaces (which would "
                f"make ' u' and 'u' two people) in LEAF file {str(file)!r}, got {user!r} at "
                f"users[{i}]."
            )
        if user in seen:
            raise InvalidValueError(
                f"LEAF file {str(file)!r} lists user {user!r} twice (users[{i}]); expected "
                "each user once per file."
            )
        seen.add(user)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidValueError(
                f"Expected num_samples[{i}] (user {user!r}) in LEAF file {str(file)!r} to be a "
                f"count >= 0, got {count!r}."
            )
    unlisted = sorted(set(data) - seen)
    if unlisted:
        raise InvalidValueError(
            f"LEAF file {str(file)!r} has user_data for {len(unlisted)} user(s) not listed in "
            f"users (first: {unlisted[0]!r}); expected users to list every user whose records "
            "it holds."
        )
    return blob


def load_leaf_json(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, kind: str
) -> LeafArrays:
    """Reads LEAF JSON files (keys ``users``, ``num_samples``, ``user_data``).

    Args:
      paths: a JSON file, a directory (all ``*.json`` in name order) or a list of them.
      kind: ``"femnist"`` (784 floats -> ``(1, 28, 28)``, 62 classes) or ``"shakespeare"``
        (strings over LEAF's 80-character alphabet -> token ids, 80 classes).

    Users become subjects, numbered in order of first appearance; a user present in several
    files has its records concatenated (a user listed twice in one file is an error).

    Raises:
      DataFileNotFoundError: a path does not exist.
      InvalidValueError: a file is not LEAF JSON, or a user id, count, pixel, string or label
        is not what LEAF writes (the message names the file, user and entry).
    """
    check_choice("kind", kind, ("femnist", "shakespeare"))
    parse = _femnist_records if kind == "femnist" else _shakespeare_records
    names: dict[str, int] = {}
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    subjects: list[np.ndarray] = []
    for file in _leaf_files(paths):
        blob = _read_leaf_blob(file)
        users, counts, data = blob["users"], blob["num_samples"], blob["user_data"]
        for user, count in zip(users, counts, strict=True):
            where = f"{str(file)!r} user {user!r}"
            if user not in data:
                raise InvalidValueError(
                    f"LEAF file {str(file)!r} has no user_data for user {user!r}."
                )
            record = data[user]
            _refuse_repeated(record, file, f"user_data for user {user!r}")
            if not isinstance(record, dict):
                raise InvalidValueError(
                    f"Expected an object with lists x and y in {where}, got "
                    f"{type(record).__name__}."
                )
            ux, uy = record.get("x", []), record.get("y", [])
            if not isinstance(ux, list) or not isinstance(uy, list):
                raise InvalidValueError(
                    f"Expected lists x and y in {where}, got {type(ux).__name__} and "
                    f"{type(uy).__name__}."
                )
            if len(ux) != len(uy) or len(ux) != count:
                raise InvalidValueError(
                    f"{where}: num_samples={count} but {len(ux)} x and {len(uy)} y entries."
                )
            if count == 0:
                continue
            x, y = parse(ux, uy, where)
            if xs and x.shape[1:] != xs[0].shape[1:]:
                raise InvalidValueError(
                    f"Expected every record to have the shape of the first user's, "
                    f"{xs[0].shape[1:]}; {where} has {x.shape[1:]}."
                )
            sid = names.setdefault(user, len(names))
            xs.append(x)
            ys.append(y)
            subjects.append(np.full(len(y), sid, dtype=np.int64))
    if not ys:
        raise InvalidValueError(f"LEAF input {paths!r} holds no records.")
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


def _row(index: int) -> str:
    """A record's position as users count it: data rows from 1, after the header."""
    return f"row {index + 1}"


def _csv_header(path: Path) -> list[str]:
    """The CSV's header line as written (pandas renames repeated names to ``a.1``)."""
    opener: Any = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as fh:
            return next(csv.reader(fh), [])
    except (OSError, EOFError, ValueError, csv.Error, zlib.error):
        return []  # pandas has read it already; nothing more to learn here


def table_columns(path: str | Path) -> list[str]:
    """The column names of the CSV or Parquet table at ``path`` (its header or schema; empty
    if it cannot be read: loading it then says why)."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(".parquet") or name.endswith(".pq"):
        try:
            import pyarrow.parquet as pq

            return [str(c) for c in pq.read_schema(path).names]
        except (ImportError, OSError, ValueError):
            return []
    return _csv_header(path)


def _read_frame(path: Path) -> Any:
    import pandas as pd

    if path.is_dir():
        raise DataFileNotFoundError(
            f"Expected data.path={str(path)!r} to be a CSV or Parquet file; it is a directory."
        )
    if not path.is_file():
        raise DataFileNotFoundError(f"Table file {str(path)!r} does not exist.")
    name = path.name.lower()
    if name.endswith(".parquet") or name.endswith(".pq"):
        try:
            return pd.read_parquet(path)
        except (ValueError, OSError, TypeError) as err:
            raise InvalidValueError(
                f"Table {str(path)!r} cannot be read as Parquet ({type(err).__name__}: {err})."
            ) from None
    if not (name.endswith(".csv") or name.endswith(".csv.gz")):
        raise InvalidValueError(f"Expected a .csv or .parquet table, got {str(path)!r}.")
    try:
        with warnings.catch_warnings():
            # a row with more fields than the header: refused, not read as an index column
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frame = pd.read_csv(path, index_col=False)
    except pd.errors.ParserWarning:
        raise InvalidValueError(
            f"Table {str(path)!r} has rows with more fields than its header names; expected "
            "one value per column in every row."
        ) from None
    except pd.errors.EmptyDataError:
        raise InvalidValueError(
            f"Table {str(path)!r} is empty; expected a header line naming the columns, then "
            "one row per record."
        ) from None
    except UnicodeDecodeError as err:
        raise InvalidValueError(f"Table {str(path)!r} is not UTF-8 text ({err}).") from None
    except (ValueError, OSError, EOFError, zlib.error) as err:
        raise InvalidValueError(
            f"Table {str(path)!r} cannot be parsed as CSV ({type(err).__name__}: {err})."
        ) from None
    header = _csv_header(path)
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise InvalidValueError(
            f"Table {str(path)!r} names column(s) {repeated} more than once; expected distinct "
            "column names."
        )
    return frame


def _as_written(frame: Any, path: Path, columns: list[str]) -> None:
    """Replaces a CSV's ``columns`` (ids, and labels checked against string label_values) by
    their text as written: read as numbers, "007" and "7" (or "1" and "1.0", " 3" and "3")
    were one id, and "NA" a missing one. Only an empty field is missing."""
    import pandas as pd

    if not columns or path.name.lower().endswith((".parquet", ".pq")):
        return
    present = [c for c in columns if c in frame.columns]
    if not present:
        return
    text = pd.read_csv(path, index_col=False, usecols=present, dtype=str, keep_default_na=False)
    for column in present:
        frame[column] = text[column].where(text[column] != "", None)


def _to_python(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _dense_ids(values: Any) -> tuple[np.ndarray, list[Any]]:
    """Maps values to dense ids in sorted order of the distinct values."""
    uniques, ids = np.unique(np.asarray(values), return_inverse=True)
    return ids.astype(np.int64).reshape(-1), [_to_python(v) for v in uniques]


#: the name pandas gives a blank CSV header (the index ``df.to_csv()`` writes): ``Unnamed: 0``
_UNNAMED = re.compile(r"Unnamed: [0-9]+(\.[0-9]+)?")

#: what a table's id columns hold, as :func:`check_label_columns` names them
_ID_ROLES = {
    "subject_column": "the subject ids (whose record it is)",
    "silo_column": "the silo ids (where it is held)",
}


def check_label_columns(
    label_column: str, silo_column: str | None, subject_column: str | None
) -> None:
    """Refuses a label column that is also the silo or subject column: its classes would
    silently become silos or subjects (and the test split would follow them)."""
    for key, column in (("subject_column", subject_column), ("silo_column", silo_column)):
        if column is not None and column == label_column:
            raise InvalidValueError(
                f"Expected label_column and {key} to name different columns, got "
                f"{column!r} for both: one column cannot hold both the class labels and "
                f"{_ID_ROLES[key]}."
            )


def _is_unnamed(column: Any) -> bool:
    """A blank header, or the name pandas gives one (``Unnamed: 0``)."""
    name = str(column)
    return not name.strip() or _UNNAMED.fullmatch(name) is not None


def _select_features(
    frame: Any, path: Path, feature_columns: Sequence[str], id_columns: list[str]
) -> list[str]:
    """The feature columns asked for, or every column other than the id columns (refusing an
    unnamed one: usually the index ``df.to_csv()`` writes, which is no feature)."""
    features = list(feature_columns) or [c for c in frame.columns if c not in id_columns]
    if not features:
        raise InvalidValueError(f"Table {str(path)!r} has no feature columns besides {id_columns}.")
    unnamed = [] if feature_columns else [c for c in features if _is_unnamed(c)]
    if unnamed:
        raise InvalidValueError(
            f"Expected named feature columns in {str(path)!r} (feature_columns is not set, so "
            f"every column but the label, silo and subject columns is a feature), got the "
            f"unnamed column(s) {unnamed}: a blank header, such as the index df.to_csv() writes "
            "by default. List the features in feature_columns, or write the file without its "
            "index (df.to_csv(path, index=False))."
        )
    both = [c for c in features if c in id_columns]
    if both:
        raise InvalidValueError(
            f"Expected feature columns other than the label, silo and subject columns; "
            f"{both} of {str(path)!r} is both."
        )
    return features


def _check_columns(
    frame: Any, path: Path, wanted: list[str], label_column: str | None = None
) -> None:
    """Refuses a table lacking one of the ``wanted`` columns or a value in one of them."""
    absent = [c for c in wanted if c not in frame.columns]
    if absent:
        raise InvalidValueError(
            f"Table {str(path)!r} lacks column(s) {absent}; it has {list(frame.columns)}."
        )
    for column in wanted:
        missing = frame[column].isna().to_numpy()
        if missing.any():
            hint = ""
            if column == label_column and path.suffix.lower() != ".parquet":
                hint = (
                    " A CSV cell reading NA, N/A, null or None counts as missing: for such "
                    "text labels, list the classes in data.label_values, which reads labels "
                    "as written."
                )
            raise InvalidValueError(
                f"Column {column!r} of table {str(path)!r} has {int(missing.sum())} missing "
                f"value(s) (first in {_row(int(np.flatnonzero(missing)[0]))}); expected "
                f"a value in every row.{hint}"
            )


def _python_numbers(values: np.ndarray, path: Path, column: str) -> np.ndarray:
    """Python numbers (decimals, integers of any size) as float64."""
    try:
        return np.asarray([float(v) for v in values], dtype=np.float64)
    except OverflowError:  # an integer beyond any float (e.g. 400 digits)
        first = next(i for i, v in enumerate(values) if _overflows(v))
        raise InvalidValueError(
            f"Table {str(path)!r} has an integer too large for float32 in column {column!r}, "
            f"{_row(first)}; expected finite numbers."
        ) from None


def _feature_matrix(frame: Any, path: Path, features: list[str]) -> np.ndarray:
    """The ``features`` as float32 ``(n, len(features))``; refuses non-numeric columns and
    values that are infinite or too large for float32. A column of Python numbers (Parquet
    decimals, integers beyond 64 bits) is converted like the others."""
    import pandas as pd

    converted: dict[str, np.ndarray] = {}
    for c in features:
        if frame[c].dtype.kind in "biuf":
            continue
        if frame[c].dtype.kind not in "OSU":  # dates, durations, complex numbers
            raise InvalidValueError(
                f"Expected numeric feature columns in {str(path)!r}; column {c!r} holds "
                f"values of dtype {frame[c].dtype}."
            )
        values = frame[c].to_numpy()
        if all(isinstance(v, int | float | Decimal) and not isinstance(v, bool) for v in values):
            converted[c] = _python_numbers(values, path, c)
            continue
        try:
            numbers = pd.to_numeric(frame[c], errors="coerce").to_numpy()
        except OverflowError:  # an integer beyond any float (e.g. 400 digits)
            raise InvalidValueError(
                f"Table {str(path)!r} has an integer too large for float32 in column {c!r}; "
                "expected finite numbers."
            ) from None
        text = np.flatnonzero(np.isnan(numbers.astype(np.float64)))
        what = (
            f"{_to_python(values[text[0]])!r} in {_row(int(text[0]))}"
            if len(text)
            else "numbers stored as text"
        )
        raise InvalidValueError(
            f"Expected numeric feature columns in {str(path)!r}; column {c!r} is not numeric "
            f"(it holds {what})."
        )
    if converted:
        x = np.column_stack(
            [converted[c] if c in converted else frame[c].to_numpy(np.float64) for c in features]
        )
    else:
        x = frame[features].to_numpy(dtype=np.float64)
    bad = ~np.isfinite(x) | (np.abs(x) > np.finfo(np.float32).max)
    if bad.any():
        row, col = (int(v[0]) for v in np.nonzero(bad))
        raise InvalidValueError(
            f"Table {str(path)!r} has {int(bad.sum())} infinite feature value(s) or value(s) "
            f"too large for float32 (first: {x[row, col].item()!r} in column {features[col]!r}, "
            f"{_row(row)}); expected finite numbers."
        )
    return x.astype(np.float32)


#: what a table cell holds when it is not one value: a Parquet list or struct, or raw bytes
_NOT_ONE_VALUE = (list, tuple, dict, set, frozenset, bytes, bytearray, memoryview, np.ndarray)


def _check_one_value(values: np.ndarray, path: Path, column: str, what: str) -> None:
    """Refuses a cell of ``column`` holding a list, array, struct or bytes: it is no single
    label or id (and numpy cannot order arrays)."""
    first = next((i for i, v in enumerate(values) if isinstance(v, _NOT_ONE_VALUE)), None)
    if first is not None:
        value = values[first]
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidValueError(
            f"Expected one {what} (a number or a string) in each cell of column {column!r} of "
            f"{str(path)!r}; got {shown} (of type {type(value).__name__}) in {_row(first)}."
        )


def _label_array(frame: Any, path: Path, label_column: str) -> np.ndarray:
    """The label column's values: integers, booleans or strings. A fractional or infinite
    number is not a class, one column holds one kind of label, and a string label is not
    blank nor written with other spaces around it than another (``" yes"`` beside ``"yes"``
    would be a third class)."""
    column = frame[label_column]
    values = column.to_numpy()
    kind = column.dtype.kind
    if kind in "biu":
        return values
    if kind == "f":
        bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) >= 2.0**63)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise InvalidValueError(
                f"Expected class labels (integers or strings) in column {label_column!r} of "
                f"{str(path)!r}; got {_to_python(values[first])!r} in {_row(first)}."
            )
        return values.astype(np.int64)
    _check_one_value(values, path, label_column, "class label")
    kinds = {type(_to_python(v)).__name__ for v in values}
    if len(kinds) > 1:
        raise InvalidValueError(
            f"Expected one kind of class label in column {label_column!r} of {str(path)!r}, "
            f"got values of types {sorted(kinds)}."
        )
    if kinds == {"str"}:
        blank = next((i for i, v in enumerate(values) if not v.strip()), None)
        if blank is not None:
            raise InvalidValueError(
                f"Expected non-blank class labels in column {label_column!r} of "
                f"{str(path)!r}; got {str(values[blank])!r} in {_row(blank)}."
            )
        # spaces written alike (a CSV with ", " separators) are harmless; two spellings of one
        # label (" yes" beside "yes") would be two classes
        spelled: dict[str, str] = {}
        for i, v in enumerate(values):
            other = spelled.setdefault(v.strip(), v)
            if other != v:
                raise InvalidValueError(
                    f"Expected each class label of column {label_column!r} of {str(path)!r} "
                    f"written one way; {other!r} and {str(v)!r} (in {_row(i)}) differ only in "
                    "the spaces around them, and would be two classes."
                )
    return values


def _encode_labels(
    raw_labels: np.ndarray, path: Path, label_column: str, label_values: Sequence[Any] | None
) -> tuple[np.ndarray, list[Any]]:
    """Dense labels and the original value of each: the sorted distinct values, or the given
    ``label_values`` (a label outside them is an error). A label of the other kind than
    ``label_values`` (a number checked against strings, or a string against numbers) matches
    by its text."""
    if label_values is None:
        y, values = _dense_ids(raw_labels)
        if len(values) < 2:
            raise InvalidValueError(
                f"Column {label_column!r} of {str(path)!r} holds the single label "
                f"{values[0]!r} in all {len(y)} row(s); expected at least 2 classes."
            )
        return y, values
    values = list(label_values)
    text = isinstance(values[0], str)
    lookup: dict[Any, int] = {v: i for i, v in enumerate(values)}
    if not text:  # a label read as text matches a number by its text: "1" is the class 1
        lookup.update({str(v): i for i, v in enumerate(values)})

    def key(label: Any) -> Any:  # a number matches a string class by its text: 1 is "1"
        label = _to_python(label)
        return str(label) if text and not isinstance(label, str) else label

    labels = [key(v) for v in raw_labels]
    unknown = sorted({v for v in labels if v not in lookup}, key=str)
    if unknown:
        raise InvalidValueError(
            f"Column {label_column!r} of {str(path)!r} has label(s) {unknown[:10]} not in "
            f"the given label_values {values[:10]}."
        )
    return np.asarray([lookup[v] for v in labels], dtype=np.int64), values


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _id_name(value: Any) -> str:
    value = _to_python(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def check_one_spelling(names: list[str], column: str, path: str | Path) -> None:
    """Refuses ids written as different text for one number ("7", "07", "7.0"): as text they
    are different people, as numbers one, and splitting one person in two would understate
    what a subject-level ε must cover.

    Numbers are compared exactly: distinct 19-digit ids are distinct people, though as floats
    they would round to one."""
    by_number: dict[Decimal, list[str]] = {}
    for name in names:
        try:
            value = Decimal(name)
        except InvalidOperation:
            continue
        if value.is_finite():
            by_number.setdefault(value, []).append(name)
    clash = next((ids for ids in by_number.values() if len(ids) > 1), None)
    if clash is not None:
        raise InvalidValueError(
            f"Expected each id in column {column!r} of {str(path)!r} written one way; "
            f"{clash[:5]} are one number written differently (as text, different people; as "
            "numbers, one). Write each id one way."
        )


def _id_column(
    frame: Any, path: Path, column: str | None
) -> tuple[np.ndarray | None, list[str] | None]:
    """Dense ids of ``column``'s values and the original values as strings; ``None`` without
    a column.

    Ids follow the values' order: numerically for numbers and for text that is all integers
    (silo "2" before "10"), else as text. A blank id, or one with spaces around it (which would
    make ``" p1"`` and ``"p1"`` two subjects), is an error naming the row."""
    if column is None:
        return None, None
    series = frame[column]
    values = series.to_numpy()
    if series.dtype.kind == "f":
        bad = ~np.isfinite(values)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise InvalidValueError(
                f"Expected finite ids in column {column!r} of {str(path)!r}; got "
                f"{_to_python(values[first])!r} in {_row(first)}."
            )
        # a measurement read as ids would make every record its own subject (or silo)
        fractional = values != np.round(values)
        if fractional.any():
            first = int(np.flatnonzero(fractional)[0])
            raise InvalidValueError(
                f"Expected whole-number ids in column {column!r} of {str(path)!r} (or text "
                f"ids); got {_to_python(values[first])!r} in {_row(first)}: is {column!r} a "
                "feature rather than an id column?"
            )
    if series.dtype.kind not in "biuf":
        if len(values) and all(isinstance(v, bytes) for v in values):  # binary (hashed) ids
            values = np.asarray([v.hex() for v in values], dtype=object)
        _check_one_value(values, path, column, "id")
        values = np.asarray([str(v) for v in values], dtype=object)
    uniques, inverse = np.unique(values, return_inverse=True)
    inverse = inverse.reshape(-1)
    names = [_id_name(v) for v in uniques]
    if series.dtype.kind not in "biuf":
        for j, name in enumerate(names):
            if not name.strip() or name != name.strip():
                first = int(np.flatnonzero(inverse == j)[0])
                what = "a blank id" if not name.strip() else "an id with spaces around it"
                raise InvalidValueError(
                    f"Expected non-blank ids without surrounding spaces in column {column!r} "
                    f"of {str(path)!r}; got {what}, {name!r}, in {_row(first)}."
                )
        check_one_spelling(names, column, path)
        numeric = all(_INTEGER.fullmatch(n) for n in names)
        keys: list[Any] = [(int(n), n) for n in names] if numeric else names
        order = sorted(range(len(names)), key=keys.__getitem__)
    else:
        order = list(range(len(names)))  # np.unique sorted the numbers already
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[inverse], [names[i] for i in order]


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
        label, silo and subject columns (then a blank header, or pandas' ``Unnamed: 0`` for
        one, such as the index ``df.to_csv()`` writes, is an error).
      label_column: the label (integers, booleans or strings; a fractional number is not a
        class); its distinct values (sorted) become labels ``0..C-1``, ``C >= 2``. It must
        not be the silo or subject column (:func:`check_label_columns`).
      silo_column, subject_column: optional id columns, mapped to dense ids in the order of
        their values (numerically where every value is an integer).
      label_values: a fixed label mapping (e.g. the training table's ``label_values`` when
        reading its test table); labels outside it are an error. Against strings, a CSV's
        labels are their text as written and numbers their text (the label 1 is ``"1"``);
        against numbers, a text label is matched by its text.

    Raises:
      DataFileNotFoundError: ``path`` does not exist.
      InvalidValueError: the file cannot be read as a table, or a column, value or id is
        missing or malformed (the message names the file, column and row; rows count from 1
        after the header).
    """
    check_label_columns(label_column, silo_column, subject_column)
    path = Path(path)
    frame = _read_frame(path)
    written = [c for c in (silo_column, subject_column) if c is not None]
    if label_values is not None and all(isinstance(v, str) for v in label_values):
        written.append(label_column)  # string classes: "01" is not the class "1"
    _as_written(frame, path, written)
    if len(frame) == 0:
        raise InvalidValueError(
            f"Table {str(path)!r} has no rows; expected one row per record after the header."
        )
    id_columns = [c for c in (label_column, silo_column, subject_column) if c is not None]
    features = _select_features(frame, path, feature_columns, id_columns)
    _check_columns(frame, path, features + id_columns, label_column)
    x = _feature_matrix(frame, path, features)
    raw_labels = _label_array(frame, path, label_column)
    y, values = _encode_labels(raw_labels, path, label_column, label_values)
    silo, silo_names = _id_column(frame, path, silo_column)
    subject, subject_names = _id_column(frame, path, subject_column)
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
