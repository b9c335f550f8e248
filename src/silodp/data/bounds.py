"""Public bounds on each subject's contribution, applied before training.

:func:`cap_records` keeps at most ``k_s`` records of a subject in each silo and ``k`` in the
federation; :func:`cap_span` keeps a subject's records in at most ``span`` silos. Which records
survive depends on a keyed hash of each record alone (:func:`record_priorities`), so a cap drops
the same records of everyone else in neighbouring datasets. :func:`check_records_per_subject`
refuses, instead of capping, data above a bound that must hold as is (the weighting protocol's
``n_max``).
"""

from __future__ import annotations

import hashlib

import numpy as np

from silodp._validation import check_int
from silodp.data.dataset import FederatedDataset
from silodp.errors import InvalidValueError

__all__ = ["cap_records", "cap_span", "check_records_per_subject", "record_priorities"]


def _rank_in_group(keys: list[np.ndarray], priority: np.ndarray) -> np.ndarray:
    """Rank (0-based, by ``priority``) of each record among records with equal ``keys``."""
    order = np.lexsort([priority, *reversed(keys)])
    sorted_keys = np.stack([k[order] for k in keys])
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (sorted_keys[:, 1:] != sorted_keys[:, :-1]).any(axis=0)
    starts = np.flatnonzero(new_group)
    group_start = starts[np.cumsum(new_group) - 1]
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - group_start
    return rank


def record_priorities(dataset: FederatedDataset, seed: int) -> np.ndarray:
    """A fixed priority per record that depends only on that record and ``seed``.

    Each record's priority is a keyed hash (BLAKE2b, key = ``seed``) of its silo, label and
    features, so adding or removing any other record or subject leaves it unchanged: a cap
    built on it drops the same records of everyone else in neighbouring datasets, as the
    privacy unit's add/remove adjacency needs (a positional random permutation would not).
    Identical records of one subject in one silo are interchangeable, so ties do not matter.
    The features hashed are those as loaded (:attr:`FederatedDataset.features_as_loaded`):
    a scaling in between does not change which records a cap keeps, so the DP feature
    statistics and training see the same capped records.
    """
    seed = check_int("seed", seed, 0)
    key = seed.to_bytes(16, "little")
    x = np.ascontiguousarray(dataset.features_as_loaded).reshape(len(dataset), -1)
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        h = hashlib.blake2b(digest_size=8, key=key)
        h.update(int(dataset.silo[i]).to_bytes(8, "little", signed=True))
        h.update(int(dataset.y[i]).to_bytes(8, "little", signed=True))
        h.update(x[i].tobytes())
        out[i] = int.from_bytes(h.digest(), "little") >> 1  # non-negative int64
    return out


def cap_records(
    dataset: FederatedDataset,
    *,
    per_silo: int | None = None,
    total: int | None = None,
    seed: int,
) -> FederatedDataset:
    """Keeps at most ``per_silo`` records of each subject in each silo (``k_s``) and at most
    ``total`` records of each subject in the federation (``k``).

    Each record gets a fixed priority from ``seed`` and its own content
    (:func:`record_priorities`; ULDP-GROUP-k's flags); the ``per_silo`` cap keeps the
    lowest-priority-value records of each (silo, subject) cell, then the ``total`` cap keeps
    the first survivors of each subject. The same seed always keeps the same records, and which
    records of a subject are kept depends on that subject's records only. The result's
    ``dropped_records`` grows by the number dropped; a silo left empty is an error.
    """
    seed = check_int("seed", seed, 0)
    if per_silo is not None:
        per_silo = check_int("per_silo", per_silo, 1)
    if total is not None:
        total = check_int("total", total, 1)
    priority = record_priorities(dataset, seed)
    keep = np.ones(len(dataset), dtype=bool)
    if per_silo is not None:
        keep &= _rank_in_group([dataset.silo, dataset.subject], priority) < per_silo
    if total is not None:
        idx = np.flatnonzero(keep)
        rank = _rank_in_group([dataset.subject[idx]], priority[idx])
        keep[idx[rank >= total]] = False
    dropped = int(len(dataset) - keep.sum())
    if dropped == 0:
        return dataset
    idx = np.flatnonzero(keep)
    emptied = np.flatnonzero(np.bincount(dataset.silo[idx], minlength=dataset.num_silos) == 0)
    if len(emptied):
        raise InvalidValueError(
            f"Capping records (per_silo={per_silo}, total={total}) leaves silo(s) "
            f"{dataset.silo_list(emptied)} empty; raise the caps."
        )
    return dataset.subset(idx, dropped=dropped)


def cap_span(dataset: FederatedDataset, *, span: int, seed: int) -> FederatedDataset:
    """Keeps each subject's records in at most ``span`` silos.

    For each subject the silos it occupies get a fixed priority: the smallest
    :func:`record_priorities` value of its records there, a function of ``seed`` and that
    subject's own records only; its records outside its ``span`` first silos are dropped
    (counted in ``dropped_records``). A silo left empty is an error.
    """
    span = check_int("span", span, 1)
    seed = check_int("seed", seed, 0)
    occupied = dataset.histogram() > 0
    if int(occupied.sum(axis=0).max()) <= span:
        return dataset
    cell = np.full(occupied.shape, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(cell, (dataset.silo, dataset.subject), record_priorities(dataset, seed))
    # rank 0 = first silo of each subject (column); unoccupied cells sort last
    rank = np.argsort(np.argsort(cell, axis=0, kind="stable"), axis=0, kind="stable")
    allowed = occupied & (rank < span)
    keep = allowed[dataset.silo, dataset.subject]
    idx = np.flatnonzero(keep)
    emptied = np.flatnonzero(np.bincount(dataset.silo[idx], minlength=dataset.num_silos) == 0)
    if len(emptied):
        raise InvalidValueError(
            f"Capping the span at {span} silos per subject leaves silo(s) "
            f"{dataset.silo_list(emptied)} empty; raise span."
        )
    return dataset.subset(idx, dropped=int(len(dataset) - len(idx)))


def check_records_per_subject(dataset: FederatedDataset, bound: int, *, name: str) -> None:
    """Refuses ``dataset`` if a subject holds more than ``bound`` records in the federation.

    For bounds that may not drop records silently (the weighting protocol's public ``n_max``,
    whose weights ``n_{s,a}/n_a`` would not decode): the error names the subjects above it by
    their original ids (``subject_names``), their counts and the key to raise.

    Raises:
      InvalidValueError: a subject holds more than ``bound`` records.
    """
    bound = check_int(name, bound, 1)
    totals = dataset.histogram().sum(axis=0)
    over = np.flatnonzero(totals > bound)
    if len(over) == 0:
        return
    worst = over[np.argsort(-totals[over], kind="stable")][:5]
    listed = ", ".join(f"{dataset.subject_name(int(a))!r} ({int(totals[a])})" for a in worst)
    raise InvalidValueError(
        f"Expected {name}={bound} to bound every subject's records in the federation; "
        f"{len(over)} subject(s) hold more (largest: {listed}). Raise {name} to at least "
        f"{int(totals.max())} or drop records with data.records_per_subject."
    )
