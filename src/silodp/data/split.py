"""Holding out the test records, before anything else: by record (stratified by label) or by
whole subject, and the loaded records (:class:`_Raw`) the split applies to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from silodp._validation import check_in_range
from silodp.data.config import DataConfig
from silodp.data.dataset import SplitSummary, TestSplit
from silodp.errors import InvalidValueError

logger = logging.getLogger(__name__)

__all__ = ["stratified_split", "subject_split"]


@dataclass(frozen=True, eq=False)
class _Raw:
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    test: TestSplit | None  # None until the loader has the split
    subject: np.ndarray | None = None
    subject_names: list[str] | None = None
    silo: np.ndarray | None = None
    num_table_silos: int = 0
    silo_names: list[str] | None = None  # a table's silo ids, one per dense silo id
    feature_names: tuple[str, ...] = ()
    label_values: tuple[Any, ...] | None = None  # a table's original label of each class id
    split: SplitSummary | None = None
    test_subject_names: frozenset[str] | None = None  # to count subjects on both sides

    def take(self, index: np.ndarray) -> _Raw:
        subject, names = self.subject, self.subject_names
        if subject is not None:
            present, dense = np.unique(subject[index], return_inverse=True)
            subject = dense.reshape(-1).astype(np.int64)
            names = None if names is None else [names[i] for i in present]
        return replace(
            self,
            x=self.x[index],
            y=self.y[index],
            subject=subject,
            subject_names=names,
            silo=None if self.silo is None else self.silo[index],
        )


def stratified_split(
    y: np.ndarray, *, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split: ``(train_index, test_index)``, both sorted.

    Each label sends ``round(test_fraction * count)`` of its records to the test side, but
    keeps at least one record on the training side.
    """
    check_in_range("test_fraction", test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
    y = np.asarray(y)
    test_parts = []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        take = min(int(round(test_fraction * len(idx))), len(idx) - 1)
        test_parts.append(idx[:take])
    test = np.sort(np.concatenate(test_parts))
    if len(test) == 0:
        raise InvalidValueError(
            f"test_fraction={test_fraction} leaves no test records among {len(y)} records "
            "(each label sends round(test_fraction x its records) to the test side and keeps "
            "at least one for training); raise test_fraction or give more records."
        )
    train = np.setdiff1d(np.arange(len(y)), test)
    return train, test


def subject_split(
    subject: np.ndarray, *, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split holding out whole subjects: ``(train_index, test_index)``, both sorted.

    ``round(test_fraction * A)`` of the ``A`` distinct subjects (at least one, and at least
    one left for training), chosen uniformly at random and independently of the labels, go
    to the test side with all their records.
    """
    check_in_range("test_fraction", test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
    subject = np.asarray(subject)
    ids = np.unique(subject)
    if len(ids) < 2:
        raise InvalidValueError(
            f"test_split='subject' needs at least 2 subjects to hold some out, got {len(ids)}."
        )
    take = min(max(int(round(test_fraction * len(ids))), 1), len(ids) - 1)
    held = rng.permutation(ids)[:take]
    is_test = np.isin(subject, held)
    return np.flatnonzero(~is_test), np.flatnonzero(is_test)


def _split(raw: _Raw, cfg: DataConfig, rng: np.random.Generator) -> _Raw:
    """Holds out ``test_fraction`` of ``raw`` by record or by subject (``cfg.test_split``)."""
    if cfg.test_split == "subject":
        if raw.subject is None:  # pragma: no cover - excluded by DataConfig validation
            raise InvalidValueError("test_split='subject' needs subjects before the split.")
        train, test = subject_split(raw.subject, test_fraction=cfg.test_fraction, rng=rng)
        # subjects are held out whatever their labels: a class only they held is not trained
        lost = sorted(set(np.unique(raw.y).tolist()) - set(np.unique(raw.y[train]).tolist()))
        if lost and raw.label_values is not None:
            lost = [raw.label_values[i] for i in lost]
        if lost:
            logger.warning(
                "test_split = 'subject' held out every record of class(es) %s (the held-out "
                "subjects had them all): the model cannot learn them. Change data.seed or "
                "test_fraction, or split by record (test_split = 'record').",
                lost,
            )
    else:
        train, test = stratified_split(raw.y, test_fraction=cfg.test_fraction, rng=rng)
    test_subjects = test_names = None
    if raw.subject is not None:
        held = np.unique(raw.subject[test])
        test_subjects = len(held)
        if raw.subject_names is not None:
            test_names = frozenset(raw.subject_names[i] for i in held)
    split = SplitSummary(
        kind=str(cfg.test_split), fraction=cfg.test_fraction, test_subjects=test_subjects
    )
    return replace(
        raw.take(train),
        test=TestSplit(x=raw.x[test], y=raw.y[test]),
        split=split,
        test_subject_names=test_names,
    )
