"""Defining properties of each partitioner."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from silodp.data import partition as part
from silodp.data.dataset import FederatedDataset


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _hist(silo: np.ndarray, subject: np.ndarray) -> np.ndarray:
    h = np.zeros((silo.max() + 1, subject.max() + 1), dtype=int)
    np.add.at(h, (silo, subject), 1)
    return h


# --- subjects ---------------------------------------------------------------------------


def test_assign_subjects_covers_everyone() -> None:
    y = np.arange(500) % 10
    s = part.assign_subjects(y, num_subjects=400, rng=_rng())
    assert s.dtype == np.int64 and len(s) == 500
    assert set(np.unique(s)) == set(range(400))
    # more subjects than records: every record has its own subject
    s = part.assign_subjects(y[:30], num_subjects=50, rng=_rng())
    assert len(np.unique(s)) == 30 and s.max() < 50


def test_assign_subjects_labels_per_subject() -> None:
    y = _rng(1).integers(0, 10, size=3000)
    s = part.assign_subjects(y, num_subjects=100, rng=_rng(), labels_per_subject=2)
    labels_of = [np.unique(y[s == a]) for a in range(100)]
    assert all(1 <= len(lab) <= 2 for lab in labels_of)
    assert sum(len(lab) == 2 for lab in labels_of) > 90
    assert set(np.unique(s)) == set(range(100))
    with pytest.raises(ValueError, match=r"num_subjects \* labels_per_subject >= 10"):
        part.assign_subjects(y, num_subjects=4, rng=_rng(), labels_per_subject=2)


def test_assign_subjects_is_seeded() -> None:
    y = np.arange(200) % 4
    a = part.assign_subjects(y, num_subjects=20, rng=_rng(5), labels_per_subject=1)
    b = part.assign_subjects(y, num_subjects=20, rng=_rng(5), labels_per_subject=1)
    np.testing.assert_array_equal(a, b)


# --- silos for given subjects -----------------------------------------------------------


def test_spread_uniform() -> None:
    subject = np.repeat(np.arange(100), 80)
    silo = part.spread_uniform(subject, num_silos=4, rng=_rng())
    counts = np.bincount(silo, minlength=4)
    assert silo.dtype == np.int64 and np.all(np.abs(counts / len(silo) - 0.25) < 0.02)


def _top_share(silo: np.ndarray, subject: np.ndarray) -> float:
    """Mean over subjects of the share of its records in its fullest silo."""
    h = _hist(silo, subject)
    return float((h.max(axis=0) / h.sum(axis=0)).mean())


def test_spread_power_alpha_one_is_uniform_and_alpha_16_concentrates() -> None:
    subject = np.repeat(np.arange(200), 160)
    uniform = part.spread_power(subject, num_silos=16, alpha=1.0, rng=_rng())
    peaked = part.spread_power(subject, num_silos=16, alpha=16.0, rng=_rng())
    # α=1: each silo ~1/16 of every subject; fullest silo holds little
    assert _top_share(uniform, subject) < 0.2
    assert (_hist(uniform, subject) > 0).sum(axis=0).min() == 16
    # α=16: ~1-(15/16)^16 ≈ 0.64 of a subject's records in one silo
    assert 0.58 < _top_share(peaked, subject) < 0.70
    # silo sizes stay balanced thanks to the per-subject silo order
    sizes = np.bincount(peaked, minlength=16) / len(peaked)
    assert np.all(np.abs(sizes - 1 / 16) < 0.03)
    shares = [
        _top_share(part.spread_power(subject, num_silos=16, alpha=a, rng=_rng()), subject)
        for a in (1, 2, 4, 8, 16)
    ]
    assert shares == sorted(shares)


# --- ULDP-FL allocations ----------------------------------------------------------------


def test_uldp_uniform() -> None:
    subject, silo = part.uldp_uniform(20000, num_subjects=50, num_silos=5, rng=_rng())
    assert subject.shape == silo.shape == (20000,)
    assert np.all(np.abs(np.bincount(silo) / 20000 - 0.2) < 0.02)
    assert np.all(np.abs(np.bincount(subject) / 20000 - 0.02) < 0.006)


def test_uldp_zipf_counts_decrease() -> None:
    subject, silo = part.uldp_zipf(
        50000, num_subjects=100, num_silos=5, alpha1=1.5, alpha2=2.0, rng=_rng()
    )
    counts = np.bincount(subject, minlength=100)
    assert counts.sum() == 50000
    expected = part.zipf_weights(100, 1.5) * 50000
    assert abs(counts[0] - expected[0]) < 5 * np.sqrt(expected[0])
    assert counts[0] > counts[1] > counts[4] > counts[20] > counts[90:].mean()
    # per subject, its silos follow Zipf(2): the fullest silo holds ~1/H_{5,2} ≈ 0.68
    h = _hist(silo, subject)[:, :10]
    ranked = -np.sort(-h, axis=0) / h.sum(axis=0)
    assert np.all(np.abs(ranked[0] - part.zipf_weights(5, 2.0)[0]) < 0.08)
    assert np.all(ranked[0] > ranked[1])
    # the fullest silo differs between subjects (random per-subject silo order)
    assert len(np.unique(h.argmax(axis=0))) > 1


def test_uldp_fixed_silo_keeps_silos_and_concentrates() -> None:
    silo = np.repeat(np.arange(4), 5000)
    subject = part.uldp_fixed_silo(silo, num_subjects=40, alpha=1.0, rng=_rng())
    h = _hist(silo, subject)
    assert h.sum() == 20000
    big = h[:, :10]  # the largest subjects
    share_main = big.max(axis=0) / big.sum(axis=0)
    # ~80% in the main silo; a silo that fills up (the demand on it exceeds its size) spills
    # the records drawn for it to the next silo, which moves some subjects' shares either way
    assert abs(np.median(share_main) - 0.8) < 0.1
    assert np.all(share_main > 0.5)
    # the rest is spread: no large subject sits in one silo only (silos the larger subjects
    # filled before it get none of its records)
    assert np.all((big > 0).sum(axis=0) >= 2)
    counts = h.sum(axis=0)
    assert counts[0] > counts[10] > counts[39]
    # the subjects' record counts are their Zipf shares (a multinomial draw), silos kept
    assert np.abs(counts / 20000 - part.zipf_weights(40, 1.0)).max() < 0.01
    assert h.sum(axis=1).tolist() == [5000] * 4


def test_uldp_fixed_silo_keeps_zipf_counts_when_a_main_silo_cannot_hold_80_percent() -> None:
    # α = 2 over 4 equal silos: subject 0 holds ~61% of the records, more than 80% of which
    # no silo can hold; it keeps its Zipf count and fills its main silo, the rest spills over
    silo = np.repeat(np.arange(4), 2500)
    subject = part.uldp_fixed_silo(silo, num_subjects=100, alpha=2.0, rng=_rng())
    h = _hist(silo, subject)
    counts = h.sum(axis=0)
    assert abs(counts[0] / 10000 - part.zipf_weights(100, 2.0)[0]) < 0.02
    assert h[:, 0].max() == 2500  # its main silo is full of it
    # the next subjects still hold most of their records in one silo (more than 80% once
    # the other silos are full: what was drawn for those lands where there is room)
    share = h[:, 1:6].max(axis=0) / counts[1:6]
    assert np.all(share > 0.6)
    assert h.sum(axis=1).tolist() == [2500] * 4


def test_dirichlet_beta_controls_skew() -> None:
    y = np.repeat(np.arange(10), 1000)
    flat = part.dirichlet_label_skew(y, num_silos=5, beta=1e4, rng=_rng())
    share = _hist(flat, y) / 1000  # (silo, label)
    assert np.all(np.abs(share - 0.2) < 0.05)
    sharp = part.dirichlet_label_skew(y, num_silos=5, beta=0.01, rng=_rng())
    top = (_hist(sharp, y).max(axis=0)) / 1000
    assert top.mean() > 0.9 and top.min() > 0.6


def test_shards_runs_per_client() -> None:
    y = np.repeat(np.arange(10), 600)[_rng(3).permutation(6000)]
    client = part.shards(y, num_clients=100, shards_per_client=4, rng=_rng())
    assert np.bincount(client).tolist() == [60] * 100
    for c in range(100):
        labels = np.unique(y[client == c])
        assert len(labels) <= 4
    # uneven classes: a shard may straddle labels, but each client holds at most
    # shards_per_client runs of consecutive labels
    y = np.repeat(np.arange(8), [50, 130, 70, 90, 40, 200, 60, 160])
    client = part.shards(y, num_clients=10, shards_per_client=2, rng=_rng())
    for c in range(10):
        labels = np.unique(y[client == c])
        label_runs = 1 + int((np.diff(labels) > 1).sum())
        assert label_runs <= 2
    with pytest.raises(ValueError, match="at most 10 shards"):
        part.shards(y[:10], num_clients=6, shards_per_client=2, rng=_rng())


# --- datasets ---------------------------------------------------------------------------


def _dataset(n: int = 400, seed: int = 0) -> FederatedDataset:
    rng = _rng(seed)
    subject = rng.integers(0, 20, size=n)
    silo = rng.integers(0, 4, size=n)
    return FederatedDataset(
        x=rng.normal(size=(n, 2)),
        y=rng.integers(0, 3, size=n),
        silo=silo,
        subject=subject,
        num_classes=3,
        subject_names=[f"w{i}" for i in range(20)],
    )


def test_assemble_empty_silos() -> None:
    x = np.zeros((4, 1))
    y = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"left 2 of 4 silo\(s\) empty \(silo ids: \[1, 3\]\)"):
        part.assemble(
            x, y, silo=np.array([0, 2, 2, 0]), subject=np.arange(4), num_classes=2, num_silos=4
        )
    ds = part.assemble(
        x,
        y,
        silo=np.array([0, 2, 2, 0]),
        subject=np.arange(4),
        num_classes=2,
        num_silos=4,
        drop_empty_silos=True,
    )
    assert ds.num_silos == 2
    np.testing.assert_array_equal(ds.silo, [0, 1, 1, 0])


def test_first_subjects() -> None:
    ds = _dataset()
    ds2 = part.first_subjects(ds, 5)
    assert len(ds2) == int((ds.subject < 5).sum())
    assert ds2.num_subjects == 5
    assert list(ds2.subject_names) == ["w0", "w1", "w2", "w3", "w4"]
    np.testing.assert_array_equal(ds2.y, ds.y[ds.subject < 5])
    # gaps are re-densified
    gappy = ds.subset(np.flatnonzero(ds.subject != 1))
    ds3 = part.first_subjects(gappy, 3)
    assert ds3.num_subjects == 2 and list(ds3.subject_names) == ["w0", "w2"]


def test_cap_records_bounds_determinism_and_drops() -> None:
    ds = _dataset()
    capped = part.cap_records(ds, per_silo=2, total=5, seed=7)
    assert capped.max_records_per_subject_per_silo() <= 2
    assert capped.max_records_per_subject() <= 5
    # exact drop count: per-cell min(n, 2), then per subject min(., 5)
    expected_kept = np.minimum(np.minimum(ds.histogram(), 2).sum(axis=0), 5).sum()
    assert len(capped) == expected_kept
    assert capped.dropped_records == len(ds) - expected_kept
    again = part.cap_records(ds, per_silo=2, total=5, seed=7)
    np.testing.assert_array_equal(capped.x, again.x)
    other = part.cap_records(ds, per_silo=2, total=5, seed=8)
    assert not np.array_equal(capped.x, other.x)
    # only per_silo / only total
    only_silo = part.cap_records(ds, per_silo=1, seed=0)
    assert only_silo.max_records_per_subject_per_silo() == 1
    assert len(only_silo) == int((ds.histogram() > 0).sum())
    only_total = part.cap_records(ds, total=3, seed=0)
    assert only_total.max_records_per_subject() == 3
    # no-op caps leave the dataset unchanged
    assert part.cap_records(ds, total=10**6, seed=0).dropped_records == 0


def test_cap_records_kept_records_are_original() -> None:
    ds = _dataset()
    capped = part.cap_records(ds, per_silo=1, total=2, seed=3)
    rows = {tuple(r) for r in np.column_stack([ds.x, ds.silo, ds.subject, ds.y])}
    kept = np.column_stack([capped.x, capped.silo, capped.subject, capped.y])
    assert all(tuple(r) in rows for r in kept)


def test_cap_records_empty_silo_error() -> None:
    # subject 0 spans both silos, silo 1 holds only one record of subject 0
    ds = FederatedDataset(
        x=np.zeros((4, 1)),
        y=np.array([0, 1, 0, 1]),
        silo=np.array([0, 0, 0, 1]),
        subject=np.array([0, 0, 0, 0]),
        num_classes=2,
    )
    # keeping one record of subject 0 always empties one of the two silos
    for seed in range(5):
        with pytest.raises(ValueError, match=r"total=1\) leaves silo\(s\) \[[01]\] empty"):
            part.cap_records(ds, total=1, seed=seed)


def test_input_checks() -> None:
    with pytest.raises(ValueError, match="alpha=0"):
        part.spread_power(np.arange(3), num_silos=2, alpha=0, rng=_rng())
    with pytest.raises(ValueError, match="beta=-1"):
        part.dirichlet_label_skew(np.arange(3), num_silos=2, beta=-1, rng=_rng())
    with pytest.raises(ValueError, match="num_silos=0"):
        part.spread_uniform(np.arange(3), num_silos=0, rng=_rng())
    with pytest.raises(ValueError, match="non-negative subject ids, got -1"):
        part.spread_uniform(np.array([0, -1]), num_silos=2, rng=_rng())
    with pytest.raises(ValueError, match="per_silo=0"):
        part.cap_records(_dataset(), per_silo=0, seed=0)


def _stable_fixture(seed: int = 0):
    from silodp.data.dataset import FederatedDataset

    rng = np.random.default_rng(seed)
    n = 400
    return FederatedDataset(
        x=rng.normal(size=(n, 4)).astype(np.float32),
        y=rng.integers(0, 3, n),
        silo=rng.integers(0, 4, n),
        subject=rng.integers(0, 30, n),
        num_classes=3,
        num_silos=4,
    )


def _kept(ds, subject: int) -> set[tuple]:
    idx = np.flatnonzero(ds.subject == subject)
    return {(int(ds.silo[i]), int(ds.y[i]), ds.x[i].tobytes()) for i in idx}


@pytest.mark.parametrize(
    "cap",
    [
        lambda ds: part.cap_records(ds, per_silo=2, seed=5),
        lambda ds: part.cap_records(ds, total=5, seed=5),
        lambda ds: part.cap_span(ds, span=2, seed=5),
    ],
)
def test_caps_keep_everyone_elses_records_when_a_subject_leaves(cap) -> None:
    """Neighbouring datasets (one subject removed) must be capped alike for every other
    subject; a positional random priority would reshuffle them (and break the ε)."""
    full = _stable_fixture()
    with_all = cap(full)
    for gone in (0, 7, 29):
        rest = full.subset(np.flatnonzero(full.subject != gone))
        without = cap(rest)
        assert without.dropped_records <= with_all.dropped_records
        for a in range(30):
            if a != gone:
                assert _kept(with_all, a) == _kept(without, a), (gone, a)


def _rows(ds) -> Counter:
    return Counter(
        (int(ds.silo[i]), int(ds.subject[i]), int(ds.y[i]), ds.x[i].tobytes())
        for i in range(len(ds))
    )


@pytest.mark.parametrize(
    ("cap", "scope", "span"),
    [
        (lambda ds: part.cap_records(ds, per_silo=2, seed=5), "silo", None),
        (lambda ds: part.cap_records(ds, total=5, seed=5), "federation", None),
        (
            lambda ds: part.cap_records(part.cap_span(ds, span=2, seed=5), per_silo=2, seed=5),
            "silo",
            2,
        ),
    ],
    ids=["per-silo", "federation", "span+per-silo"],
)
def test_one_added_record_changes_the_capped_data_as_the_record_unit_accounts(
    cap, scope, span
) -> None:
    """What ``silodp.algorithms.caps`` charges the record unit for, checked on the caps
    themselves: after capping, one added record changes only its subject's records, and

    * group cap alone: it comes in and at most one record leaves, in its silo (per-silo cap)
      or in any silo (federation-wide cap);
    * with a span cap (and a per-silo cap): records come in in one silo only and leave one
      silo only, at most k each. (With a federation-wide cap, a move can let records of the
      subject back in elsewhere, so ``uldp_group`` does not cap the span at all.)

    Replacements and moves do happen (each kind is seen): an add/remove record unit would be
    optimistic."""
    full = _stable_fixture()
    base = _rows(cap(full))
    rng = np.random.default_rng(11)
    seen = Counter()
    for trial in range(600):
        if trial % 2:  # a record added (any silo and subject) ...
            silo, subject = int(rng.integers(0, 4)), int(rng.integers(0, 30))
            x = rng.normal(size=(1, 4)).astype(np.float32)
            other = FederatedDataset(
                x=np.vstack([full.x, x]),
                y=np.r_[full.y, int(rng.integers(0, 3))],
                silo=np.r_[full.silo, silo],
                subject=np.r_[full.subject, subject],
                num_classes=3,
                num_silos=4,
            )
        else:  # ... or one removed: the same bounds, the other way round
            gone = int(rng.integers(len(full)))
            silo, subject = int(full.silo[gone]), int(full.subject[gone])
            other = full.subset(np.flatnonzero(np.arange(len(full)) != gone))
        after = _rows(cap(other))
        added, removed = after - base, base - after
        if not trial % 2:
            added, removed = removed, added  # seen from the smaller dataset
        assert {row[1] for row in added + removed} <= {subject}
        k = 2
        if span is None:
            assert sum(added.values()) <= 1 and sum(removed.values()) <= 1
            assert all(row[0] == silo for row in added)
            if scope == "silo":
                assert all(row[0] == silo for row in removed)
        else:
            assert len({row[0] for row in added}) <= 1 and sum(added.values()) <= k
            assert len({row[0] for row in removed}) <= 1 and sum(removed.values()) <= k
        if removed and {row[0] for row in removed} == {silo}:
            seen["replaced in its silo"] += 1
        elif removed:
            seen["left another silo"] += 1
    assert seen["replaced in its silo"] > 0
    if scope == "federation" or span is not None:
        assert seen["left another silo"] > 0
