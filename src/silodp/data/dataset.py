"""The federated dataset: every record has features, a label, a silo and a subject.

Silos are federation members (organisations); subjects are people whose records may sit in
several silos. Ids are dense non-negative integers; ``subject_names`` keeps the original ids
(e.g. LEAF writer ids, a table's subject column) and ``silo_names`` the original silo ids
where a loader had them; errors and summaries name subjects and silos by them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from silodp._validation import check_int
from silodp.errors import InvalidValueError

__all__ = ["FederatedDataset", "TestSplit", "FederatedData", "SplitSummary", "SUBJECT_ORIGINS"]


#: the largest silo x subject histogram a dataset may need (2 GiB of int64 counts); subject
#: ids are dense, so a larger one means ids that were not densified
MAX_HISTOGRAM_CELLS = 2**28
#: the most label classes a dataset may declare (the model has one output per class)
MAX_CLASSES = 10**6


def _as_int_array(name: str, values: Any, n: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise InvalidValueError(f"Expected {name} to have shape ({n},), got {arr.shape}.")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
        if bad.any():
            raise InvalidValueError(
                f"Expected every {name} to be set; {int(bad.sum())} record(s) have a missing "
                f"{name} (first at index {int(np.flatnonzero(bad)[0])})."
            )
        fractional = (arr != np.round(arr)) | (np.abs(arr) >= 2**63)
        if fractional.any():
            first = int(np.flatnonzero(fractional)[0])
            raise InvalidValueError(
                f"Expected integer {name} ids; got {name}={arr[first].item()!r} at index {first}."
            )
    elif arr.dtype.kind == "u" and len(arr) and int(arr.max()) >= 2**63:
        first = int(np.argmax(arr))
        raise InvalidValueError(
            f"Expected {name} ids below 2**63; got {name}={int(arr[first])} at index {first}."
        )
    elif arr.dtype.kind not in "iuf":
        raise InvalidValueError(f"Expected integer {name} ids, got dtype {arr.dtype}.")
    arr = arr.astype(np.int64)
    negative = arr < 0
    if negative.any():
        first = int(np.flatnonzero(negative)[0])
        raise InvalidValueError(
            f"Expected non-negative {name} ids; {int(negative.sum())} record(s) have a negative "
            f"{name} (first: {name}={int(arr[first])} at index {first})."
        )
    return arr


def _check_features(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim == 0:
        raise InvalidValueError(f"Expected features of shape (n, ...), got a scalar {x!r}.")
    if x.dtype.kind in "iu":
        return x  # token ids (e.g. Shakespeare characters)
    if x.dtype.kind not in "bf":
        raise InvalidValueError(f"Expected numeric (real) features, got dtype {x.dtype}.")
    with np.errstate(over="ignore"):
        x = x.astype(np.float32, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        rows = np.unique(np.nonzero(bad.reshape(len(x), -1))[0])
        raise InvalidValueError(
            f"Expected finite features; {int(bad.sum())} NaN/inf value(s) in {len(rows)} "
            f"record(s) (first at index {int(rows[0])}; values beyond float32's range count "
            "as inf)."
        )
    return x


def _check_labels(y: Any, n: int, num_classes: int) -> np.ndarray:
    labels = _as_int_array("label", y, n)
    out = labels >= num_classes
    if out.any():
        first = int(np.flatnonzero(out)[0])
        raise InvalidValueError(
            f"Expected labels in [0, {num_classes - 1}]; {int(out.sum())} record(s) out of range "
            f"(first: label={int(labels[first])} at index {first})."
        )
    return labels


def _check_names(name: str, names: Any, count: int, *, exact: bool) -> list[str] | None:
    """``names`` as a list of distinct strings, ``count`` of them (at least, unless
    ``exact``)."""
    if names is None:
        return None
    if isinstance(names, str | bytes) or not isinstance(names, Sequence | np.ndarray):
        raise InvalidValueError(f"Expected {name} to be a list of ids, got {names!r:.80}.")
    out = list(names)
    if (len(out) != count) if exact else (len(out) < count):
        want = f"{count}" if exact else f"at least {count}"
        raise InvalidValueError(
            f"Expected {want} {name} (one per dense id), got {len(out)}: {out[:5]!r}."
        )
    bad = next((v for v in out if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise InvalidValueError(f"Expected {name} to be non-empty strings, got {bad!r}.")
    if len(set(out)) != len(out):
        seen: set[str] = set()
        twice = ""
        for v in out:
            if v in seen:
                twice = v
                break
            seen.add(v)
        raise InvalidValueError(
            f"Expected distinct {name}, got {twice!r} for two dense ids; two ids would be one "
            "silo or subject."
        )
    return out


def hash_arrays(h: Any, parts: Mapping[str, np.ndarray | None]) -> None:
    """Feeds ``parts`` to the hash ``h``: each array's name, dtype and shape, then its bytes
    (``None``: its name only)."""
    for name, array in parts.items():
        if array is None:
            h.update(f"{name}:none;".encode())
            continue
        a = np.ascontiguousarray(array)
        h.update(f"{name}:{a.dtype.str}{a.shape};".encode())
        h.update(a.data)  # the contiguous buffer itself: no copy


@dataclass(frozen=True, eq=False)
class FederatedDataset:
    """Training records of a cross-silo federation.

    Attributes:
      x: features, shape ``(n, ...)``; float32, or int64 token ids.
      y: labels in ``[0, num_classes)``, shape ``(n,)``.
      silo: silo id of each record in ``[0, num_silos)``; every silo must hold a record.
      subject: subject id of each record in ``[0, num_subjects)``.
      num_classes: number of label classes.
      num_silos: number of silos (defaults to ``silo.max() + 1``).
      subject_names: optional original subject ids (e.g. a table's ``p0042``), indexed by
        dense subject id; messages and summaries name a subject by it.
      dropped_records: records the public caps dropped before this dataset (reported).
      silo_names: optional original silo ids (e.g. a table's silo column), one per silo.
      subject_count: the public number of subjects |U| where it is fixed before the data
        (subjects drawn for ``num_subjects``, audit canaries), so that it does not depend on
        which of them got records; default: the largest subject id + 1.
      loaded_x: the features as loaded, where ``x`` was transformed since (scaling); the
        public caps' record priorities hash them, so that a cap keeps the same records
        before and after the transform (:func:`silodp.data.bounds.record_priorities`).

    Raises:
      InvalidValueError: empty data, non-finite features, labels out of range, ids that are
        negative, fractional or not dense, an empty silo, or names that do not fit the ids.
    """

    x: np.ndarray
    y: np.ndarray
    silo: np.ndarray
    subject: np.ndarray
    num_classes: int
    num_silos: int = -1
    subject_names: Sequence[str] | None = None
    dropped_records: int = 0
    silo_names: Sequence[str] | None = None
    subject_count: int | None = None
    loaded_x: np.ndarray | None = field(default=None, repr=False, compare=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        x = np.asarray(self.x)
        if x.ndim == 0 or len(x) == 0:
            raise InvalidValueError("Expected at least one record, got an empty dataset.")
        n = len(x)
        num_classes = check_int("num_classes", self.num_classes, 2, MAX_CLASSES)
        check_int("dropped_records", self.dropped_records, 0)
        object.__setattr__(self, "num_classes", num_classes)
        object.__setattr__(self, "x", _check_features(x))
        if self.loaded_x is not None and len(self.loaded_x) != n:
            raise InvalidValueError(
                f"Expected {n} rows of loaded features, got {len(self.loaded_x)}."
            )
        object.__setattr__(self, "y", _check_labels(self.y, n, num_classes))
        silo = _as_int_array("silo", self.silo, n)
        subject = _as_int_array("subject", self.subject, n)
        object.__setattr__(self, "silo", silo)
        object.__setattr__(self, "subject", subject)
        if self.num_silos == -1:
            num_silos = int(silo.max()) + 1
        else:
            num_silos = check_int("num_silos", self.num_silos, 1)
        if silo.max() >= num_silos:
            raise InvalidValueError(
                f"Expected silo ids in [0, {num_silos - 1}], got silo={int(silo.max())}."
            )
        if num_silos > n:  # ids beyond the records: some silo must be empty
            raise InvalidValueError(
                f"Expected every silo to hold at least one record, but {num_silos} silos share "
                f"{n} record(s) (silo ids up to {num_silos - 1}); are the silo ids dense?"
            )
        cells = num_silos * (int(subject.max()) + 1)
        if cells > MAX_HISTOGRAM_CELLS:
            raise InvalidValueError(
                f"Expected dense subject ids in [0, number of subjects); got subject ids up to "
                f"{int(subject.max())} over {num_silos} silos ({cells} silo x subject cells, "
                f"at most {MAX_HISTOGRAM_CELLS})."
            )
        object.__setattr__(self, "num_silos", num_silos)
        if self.subject_count is not None:
            count = check_int("subject_count", self.subject_count, int(subject.max()) + 1)
            object.__setattr__(self, "subject_count", count)
        names = _check_names("subject_names", self.subject_names, self.num_subjects, exact=False)
        object.__setattr__(self, "subject_names", names)
        silo_names = _check_names("silo_names", self.silo_names, num_silos, exact=True)
        object.__setattr__(self, "silo_names", silo_names)
        counts = np.bincount(silo, minlength=num_silos)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            raise InvalidValueError(
                f"Expected every silo to hold at least one record; {len(empty)} silo(s) are "
                f"empty (silo ids: {self.silo_list(empty)})."
            )

    # --- names -------------------------------------------------------------------------
    def subject_name(self, a: int) -> str:
        """Subject ``a``'s original id (its dense id as text where there is none)."""
        return str(self.subject_names[a]) if self.subject_names is not None else str(int(a))

    def silo_name(self, s: int) -> str:
        """Silo ``s``'s original id (its dense id as text where there is none)."""
        return str(self.silo_names[s]) if self.silo_names is not None else str(int(s))

    def silo_list(self, silos: Any, limit: int = 10) -> str:
        """``silos`` as a message names them: dense ids, with original ids where known."""
        ids = [int(s) for s in np.asarray(silos).reshape(-1)[:limit]]
        if self.silo_names is None:
            return str(ids)
        return "[" + ", ".join(f"{s} ({self.silo_names[s]!r})" for s in ids) + "]"

    # --- sizes -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.y)

    @property
    def num_subjects(self) -> int:
        """|U|: :attr:`subject_count` where it is public, else the largest subject id + 1."""
        if self.subject_count is not None:
            return self.subject_count
        return int(self.subject.max()) + 1

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def silo_indices(self, s: int) -> np.ndarray:
        """Record indices of silo ``s`` (cached)."""
        key = f"silo{s}"
        if key not in self._cache:
            self._cache[key] = np.flatnonzero(self.silo == s)
        return self._cache[key]

    def silo_sizes(self) -> np.ndarray:
        return np.bincount(self.silo, minlength=self.num_silos)

    def histogram(self) -> np.ndarray:
        """``n[s, a]``: records of subject ``a`` in silo ``s``, shape (num_silos, num_subjects)."""
        if "hist" not in self._cache:
            hist = np.zeros((self.num_silos, self.num_subjects), dtype=np.int64)
            np.add.at(hist, (self.silo, self.subject), 1)
            self._cache["hist"] = hist
        return self._cache["hist"]

    def digest(self) -> str:
        """SHA-256 of the records: features, labels, silos and subjects, each with its dtype
        and shape, and the numbers of classes and silos (computed once)."""
        if "digest" not in self._cache:
            h = hashlib.sha256(b"silodp-records-v1")
            h.update(f"classes={self.num_classes};silos={self.num_silos};".encode())
            hash_arrays(h, {name: getattr(self, name) for name in ("x", "y", "silo", "subject")})
            self._cache["digest"] = h.hexdigest()
        return str(self._cache["digest"])

    def max_records_per_subject_per_silo(self) -> int:
        """Largest ``n_{s,a}``: records of one subject inside one silo."""
        return int(self.histogram().max())

    def max_records_per_subject(self) -> int:
        """Largest ``n_a``: records of one subject in the whole federation."""
        return int(self.histogram().sum(axis=0).max())

    def max_span(self) -> int:
        """Largest number of silos one subject's records occupy."""
        return int((self.histogram() > 0).sum(axis=0).max())

    @property
    def features_as_loaded(self) -> np.ndarray:
        """The features before any transform (:attr:`loaded_x`, else :attr:`x`)."""
        return self.x if self.loaded_x is None else self.loaded_x

    def with_features(self, x: np.ndarray) -> FederatedDataset:
        """The same records (silos, subjects, labels) with features ``x`` instead; the
        features as loaded are kept for the caps' priorities."""
        if len(x) != len(self):
            raise InvalidValueError(f"Expected {len(self)} feature rows, got {len(x)}.")
        return FederatedDataset(
            x=x,
            y=self.y,
            silo=self.silo,
            subject=self.subject,
            num_classes=self.num_classes,
            num_silos=self.num_silos,
            subject_names=self.subject_names,
            dropped_records=self.dropped_records,
            silo_names=self.silo_names,
            subject_count=self.subject_count,
            loaded_x=self.features_as_loaded,
        )

    def subset(self, index: np.ndarray, *, dropped: int = 0) -> FederatedDataset:
        """Records at ``index`` with ids and class count kept."""
        return FederatedDataset(
            x=self.x[index],
            y=self.y[index],
            silo=self.silo[index],
            subject=self.subject[index],
            num_classes=self.num_classes,
            num_silos=self.num_silos,
            subject_names=self.subject_names,
            dropped_records=self.dropped_records + dropped,
            silo_names=self.silo_names,
            subject_count=self.subject_count,
            loaded_x=None if self.loaded_x is None else self.loaded_x[index],
        )


@dataclass(frozen=True, eq=False)
class TestSplit:
    """Held-out records used for evaluation; ``silo`` is set where a split is per silo."""

    __test__ = False  # not a pytest test class despite its name

    x: np.ndarray
    y: np.ndarray
    silo: np.ndarray | None = None

    def __post_init__(self) -> None:
        x = _check_features(np.asarray(self.x))
        object.__setattr__(self, "x", x)
        y = np.asarray(self.y)
        if y.ndim != 1 or len(y) != len(x):
            raise InvalidValueError(
                f"Expected as many test labels as records, got {len(y) if y.ndim else y!r} vs "
                f"{len(x)}."
            )
        object.__setattr__(self, "y", _as_int_array("test label", y, len(x)))
        if self.silo is not None:
            object.__setattr__(self, "silo", _as_int_array("test silo", self.silo, len(x)))

    def __len__(self) -> int:
        return len(self.y)

    def silo_indices(self, s: int) -> np.ndarray:
        """Indices of silo ``s``'s own test records (every record when the split is shared)."""
        if self.silo is None:
            return np.arange(len(self.y))
        return np.flatnonzero(self.silo == s)


#: Where a dataset's subjects come from: a table's subject column, LEAF users, the records
#: themselves (a table without a subject column: each record is its own subject), or drawn
#: by an allocation (simulated people).
SUBJECT_ORIGINS = ("column", "leaf_users", "records", "simulated", "given")

#: How the test records were chosen: records held out (stratified by label), whole subjects
#: held out, or a separate test file / the source's own test set.
SPLIT_KINDS = ("record", "subject", "file")


@dataclass(frozen=True)
class SplitSummary:
    """How the test split was made, in numbers (``describe`` reports it).

    Attributes:
      kind: ``"record"``, ``"subject"`` or ``"file"`` (a separate test file or the source's
        own test set).
      fraction: the configured ``test_fraction`` (``None`` for ``"file"``).
      test_subjects: distinct subjects among the test records; ``None`` where test records
        carry no subject (subjects drawn for training records only, or a test file).
      shared_subjects: subjects with records on both sides (0 for a subject split);
        ``None`` where it cannot be known (as ``test_subjects``).
      distinct_test_records: with ``data.test_per_client``, the distinct records of the
        test pool the clients' test sets hold (clients may share records); else ``None``.
      repeated_test_records: with ``data.test_per_client``, the draws that repeat a record
        already in the same client's test set (a label's pool smaller than the client's
        draw of it); else ``None``.
    """

    kind: str
    fraction: float | None
    test_subjects: int | None = None
    shared_subjects: int | None = None
    distinct_test_records: int | None = None
    repeated_test_records: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPLIT_KINDS:
            raise InvalidValueError(f"Expected kind={self.kind!r} to be one of {SPLIT_KINDS}.")


@dataclass(frozen=True, eq=False)
class FederatedData:
    """A federation's training records and its test split.

    Attributes:
      name: a short label of the source and allocation.
      split: how the test records were chosen (``None`` when built by hand).
      subjects_from: one of :data:`SUBJECT_ORIGINS`.
      subjects_note: one line saying what a subject is here (``describe`` prints it).
      scaling: the feature scaling already applied to ``train.x`` and ``test.x``
        (``"none"``, ``"bounds"``, ``"standard"`` or ``"dp"``).
      feature_names: a table's feature columns, in the order the model reads them (empty for
        the other sources).
    """

    train: FederatedDataset
    test: TestSplit
    name: str = "data"
    split: SplitSummary | None = None
    subjects_from: str = "given"
    subjects_note: str = ""
    scaling: str = "none"
    feature_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.subjects_from not in SUBJECT_ORIGINS:
            raise InvalidValueError(
                f"Expected subjects_from={self.subjects_from!r} to be one of {SUBJECT_ORIGINS}."
            )
        train, test = self.train, self.test
        if len(test) == 0:
            raise InvalidValueError("Expected at least one test record, got an empty test split.")
        if test.x.shape[1:] != train.x.shape[1:]:
            raise InvalidValueError(
                f"Expected test records of the training records' shape "
                f"{tuple(train.x.shape[1:])}, got {tuple(test.x.shape[1:])}."
            )
        if int(test.y.min()) < 0 or int(test.y.max()) >= train.num_classes:
            bad = int(test.y.max()) if int(test.y.max()) >= train.num_classes else int(test.y.min())
            raise InvalidValueError(
                f"Expected test labels in [0, {train.num_classes}) (the training data's "
                f"num_classes), got {bad}."
            )
        if test.silo is not None and (
            int(test.silo.min()) < 0 or int(test.silo.max()) >= train.num_silos
        ):
            raise InvalidValueError(
                f"Expected test silos in [0, {train.num_silos}), got ids "
                f"{int(test.silo.min())}..{int(test.silo.max())}."
            )
