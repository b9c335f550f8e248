"""Canaries: records only the auditor knows, added to a federation's training data.

Canary ``i`` owns one new input feature (column ``d + i`` after the data's ``d`` flattened
features); every real record, and every other canary, is 0 there. Its records are 0 on every
other feature, carry ``amplitude`` on their own and a label drawn uniformly. In a linear model
only canary ``i``'s records move the weight column of feature ``d + i`` (apart from the noise),
so its clipped gradient is a direction no real record touches: a crafted gradient canary that
reaches the model through the data, clipping, noise and aggregation of the unmodified code.

The unit decides the canary's shape:

* ``record``: one record in one silo, a subject of its own;
* ``subject``: a new subject whose records sit in several silos exactly as a real subject's do
  (the per-silo record counts of a real subject drawn at random), so the canary fits the
  data's bounds (records per silo, span, records per subject) like the subjects it copies.

Each canary is included with probability ½ from the auditor's own coins; the inclusion bits are
kept from the attack until its guesses are scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from silodp._validation import check_choice, check_int, check_positive
from silodp.data import FederatedData, FederatedDataset, TestSplit
from silodp.errors import InvalidValueError

__all__ = ["CANARY_UNITS", "Canaries", "add_canaries", "draw_canaries"]

CANARY_UNITS = ("subject", "record")


@dataclass(frozen=True)
class Canaries:
    """The canaries of one audit run.

    Attributes:
      unit: ``record`` or ``subject``.
      first_feature: the flattened feature index of canary 0's own feature (``d``).
      labels: each canary's label.
      silo_counts: ``(m, num_silos)`` records each canary has in each silo.
      included: whether each canary is in the training data.
      amplitude: the value of a canary record's own feature.
    """

    unit: str
    first_feature: int
    labels: np.ndarray
    silo_counts: np.ndarray
    included: np.ndarray
    amplitude: float

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def records_per_canary(self) -> np.ndarray:
        return self.silo_counts.sum(axis=1)


def draw_canaries(
    train: FederatedDataset,
    count: int,
    unit: str,
    rng: np.random.Generator,
    *,
    amplitude: float,
) -> Canaries:
    """``count`` canaries at ``unit`` shaped after ``train``'s records or subjects, each
    included with probability ½ (from ``rng``, the auditor's coins).

    Raises:
      InvalidValueError: token-id features (no feature a canary could own), a bad count or
        unit."""
    check_int("canaries", count, 1)
    check_choice("unit", unit, CANARY_UNITS)
    check_positive("amplitude", amplitude)
    if train.x.dtype.kind in "iu":
        raise InvalidValueError(
            "Expected real-valued features to audit; token-id data (e.g. Shakespeare) has no "
            "feature a canary could own."
        )
    num_silos = train.num_silos
    counts = np.zeros((count, num_silos), dtype=np.int64)
    if unit == "record":
        counts[np.arange(count), rng.integers(0, num_silos, size=count)] = 1
    else:
        profiles = train.histogram().T  # (subjects, silos): a real subject's records per silo
        profiles = profiles[profiles.sum(axis=1) > 0]
        counts[:] = profiles[rng.integers(0, len(profiles), size=count)]
    return Canaries(
        unit=unit,
        first_feature=int(np.prod(train.feature_shape)),
        labels=rng.integers(0, train.num_classes, size=count).astype(np.int64),
        silo_counts=counts,
        included=rng.random(count) < 0.5,
        amplitude=float(amplitude),
    )


def add_canaries(data: FederatedData, canaries: Canaries) -> FederatedData:
    """``data`` with flattened features widened by one column per canary (0 for every real
    record, train and test) and the included canaries' records appended to training. Every
    canary is a new listed subject, in or out, so the public |U| does not depend on which are
    in."""
    train, m = data.train, len(canaries)
    d = canaries.first_feature
    if int(np.prod(train.feature_shape)) != d:
        raise InvalidValueError(
            f"Expected data with {d} features per record (as the canaries were drawn for), got "
            f"{int(np.prod(train.feature_shape))}."
        )
    real_x = np.zeros((len(train), d + m), dtype=np.float32)
    real_x[:, :d] = train.x.reshape(len(train), d)
    test_x = np.zeros((len(data.test), d + m), dtype=np.float32)
    test_x[:, :d] = data.test.x.reshape(len(data.test), d)

    rows_x, rows_y, rows_silo, rows_subject = [], [], [], []
    next_subject = train.num_subjects
    # every canary is a listed subject (|U| counts it whether its records are in or out); only
    # the included ones get records
    for i in range(m):
        if not canaries.included[i]:
            next_subject += 1
            continue
        for s, n in enumerate(canaries.silo_counts[i]):
            if n == 0:
                continue
            rows = np.zeros((int(n), d + m), dtype=np.float32)
            rows[:, d + i] = canaries.amplitude
            rows_x.append(rows)
            rows_y.append(np.full(int(n), canaries.labels[i]))
            rows_silo.append(np.full(int(n), s))
            rows_subject.append(np.full(int(n), next_subject))
        next_subject += 1
    names = None
    if train.subject_names is not None:
        added = next_subject - train.num_subjects
        names = [*train.subject_names, *(f"canary-{k}" for k in range(added))]
    if rows_x:
        x = np.concatenate([real_x, *rows_x])
        y = np.concatenate([train.y, *rows_y])
        silo = np.concatenate([train.silo, *rows_silo])
        subject = np.concatenate([train.subject, *rows_subject])
    else:
        x, y, silo, subject = real_x, train.y, train.silo, train.subject
    widened = FederatedDataset(
        x=x,
        y=y,
        silo=silo,
        subject=subject,
        num_classes=train.num_classes,
        num_silos=train.num_silos,
        subject_names=names,
        subject_count=next_subject,
        dropped_records=train.dropped_records,
    )
    test = TestSplit(x=test_x, y=data.test.y, silo=data.test.silo)
    return FederatedData(
        train=widened,
        test=test,
        name=f"{data.name}+canaries",
        split=data.split,
        subjects_from=data.subjects_from,
        subjects_note=data.subjects_note,
        scaling=data.scaling,
    )
