"""The federated dataset: every record has features, a label, a silo and a subject.

Silos are federation members (organisations); subjects are people whose records may sit in
several silos. Ids are dense non-negative integers; ``subject_names`` keeps the original ids
(e.g. LEAF writer ids) where a loader had them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FederatedDataset", "TestSplit", "FederatedData", "SplitSummary", "SUBJECT_ORIGINS"]


def _as_int_array(name: str, values: Any, n: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise ValueError(f"Expected {name} to have shape ({n},), got {arr.shape}.")
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
        if bad.any():
            raise ValueError(
                f"Expected every {name} to be set; {int(bad.sum())} record(s) have a missing "
                f"{name} (first at index {int(np.flatnonzero(bad)[0])})."
            )
        if np.any(arr != np.round(arr)):
            raise ValueError(f"Expected integer {name} ids, got non-integer values.")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"Expected integer {name} ids, got dtype {arr.dtype}.")
    arr = arr.astype(np.int64)
    negative = arr < 0
    if negative.any():
        first = int(np.flatnonzero(negative)[0])
        raise ValueError(
            f"Expected non-negative {name} ids; {int(negative.sum())} record(s) have a negative "
            f"{name} (first: {name}={int(arr[first])} at index {first})."
        )
    return arr


def _check_features(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind in "iu":
        return x  # token ids (e.g. Shakespeare characters)
    x = x.astype(np.float32, copy=False)
    bad = ~np.isfinite(x)
    if bad.any():
        rows = np.unique(np.nonzero(bad.reshape(len(x), -1))[0])
        raise ValueError(
            f"Expected finite features; {int(bad.sum())} NaN/inf value(s) in {len(rows)} "
            f"record(s) (first at index {int(rows[0])})."
        )
    return x


def _check_labels(y: Any, n: int, num_classes: int) -> np.ndarray:
    labels = _as_int_array("label", y, n)
    out = labels >= num_classes
    if out.any():
        first = int(np.flatnonzero(out)[0])
        raise ValueError(
            f"Expected labels in [0, {num_classes - 1}]; {int(out.sum())} record(s) out of range "
            f"(first: label={int(labels[first])} at index {first})."
        )
    return labels


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
      subject_names: optional original subject ids, indexed by dense subject id.
    """

    x: np.ndarray
    y: np.ndarray
    silo: np.ndarray
    subject: np.ndarray
    num_classes: int
    num_silos: int = -1
    subject_names: Sequence[str] | None = None
    dropped_records: int = 0
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        x = np.asarray(self.x)
        n = len(x)
        if n == 0:
            raise ValueError("Expected at least one record, got an empty dataset.")
        if isinstance(self.num_classes, bool) or int(self.num_classes) < 2:
            raise ValueError(f"Expected num_classes={self.num_classes!r} >= 2.")
        object.__setattr__(self, "x", _check_features(x))
        object.__setattr__(self, "y", _check_labels(self.y, n, int(self.num_classes)))
        silo = _as_int_array("silo", self.silo, n)
        subject = _as_int_array("subject", self.subject, n)
        object.__setattr__(self, "silo", silo)
        object.__setattr__(self, "subject", subject)
        num_silos = int(silo.max()) + 1 if self.num_silos == -1 else int(self.num_silos)
        if silo.max() >= num_silos:
            raise ValueError(
                f"Expected silo ids in [0, {num_silos - 1}], got silo={int(silo.max())}."
            )
        counts = np.bincount(silo, minlength=num_silos)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            raise ValueError(
                f"Expected every silo to hold at least one record; {len(empty)} silo(s) are "
                f"empty (silo ids: {empty[:10].tolist()})."
            )
        object.__setattr__(self, "num_silos", num_silos)

    # --- sizes -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.y)

    @property
    def num_subjects(self) -> int:
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

    def max_records_per_subject_per_silo(self) -> int:
        """Largest ``n_{s,a}``: records of one subject inside one silo."""
        return int(self.histogram().max())

    def max_records_per_subject(self) -> int:
        """Largest ``n_a``: records of one subject in the whole federation."""
        return int(self.histogram().sum(axis=0).max())

    def max_span(self) -> int:
        """Largest number of silos one subject's records occupy."""
        return int((self.histogram() > 0).sum(axis=0).max())

    def with_features(self, x: np.ndarray) -> FederatedDataset:
        """The same records (silos, subjects, labels) with features ``x`` instead."""
        if len(x) != len(self):
            raise ValueError(f"Expected {len(self)} feature rows, got {len(x)}.")
        return FederatedDataset(
            x=x,
            y=self.y,
            silo=self.silo,
            subject=self.subject,
            num_classes=self.num_classes,
            num_silos=self.num_silos,
            subject_names=self.subject_names,
            dropped_records=self.dropped_records,
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
        object.__setattr__(self, "y", np.asarray(self.y, dtype=np.int64))
        if len(self.y) != len(x):
            raise ValueError(
                f"Expected as many test labels as records, got {len(self.y)} vs {len(x)}."
            )
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
    """

    kind: str
    fraction: float | None
    test_subjects: int | None = None
    shared_subjects: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPLIT_KINDS:
            raise ValueError(f"Expected kind={self.kind!r} to be one of {SPLIT_KINDS}.")


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
    """

    train: FederatedDataset
    test: TestSplit
    name: str = "data"
    split: SplitSummary | None = None
    subjects_from: str = "given"
    subjects_note: str = ""
    scaling: str = "none"

    def __post_init__(self) -> None:
        if self.subjects_from not in SUBJECT_ORIGINS:
            raise ValueError(
                f"Expected subjects_from={self.subjects_from!r} to be one of {SUBJECT_ORIGINS}."
            )
