"""Placing records on subjects and silos, as in the papers' experiments (SPEC §5).

Every function that draws randomness takes ``rng: numpy.random.Generator`` and returns int64
id arrays with one entry per record. Silos may come out empty for small inputs; turn arrays
into a :class:`FederatedDataset` with :func:`assemble`, which raises a clear error naming the
empty silos (or, if asked, drops and renumbers them). The caps on each subject's records
applied before training live in :mod:`silodp.data.bounds` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from silodp._validation import check_int, check_positive, check_probability
from silodp.data.bounds import cap_records, cap_span
from silodp.data.bounds import record_priorities as record_priorities
from silodp.data.dataset import FederatedDataset
from silodp.errors import InvalidValueError

__all__ = [
    "assemble",
    "assign_subjects",
    "cap_records",
    "cap_span",
    "dirichlet_clients",
    "dirichlet_label_skew",
    "first_subjects",
    "per_client_test",
    "shards",
    "spread_power",
    "spread_uniform",
    "uldp_fixed_silo",
    "uldp_uniform",
    "uldp_zipf",
    "zipf_weights",
]


def _ids(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or len(arr) == 0:
        raise InvalidValueError(
            f"Expected {name} to be a non-empty 1-D array, got shape {arr.shape}."
        )
    if arr.dtype.kind not in "iu":
        raise InvalidValueError(f"Expected integer {name} ids, got dtype {arr.dtype}.")
    if arr.min() < 0:
        raise InvalidValueError(f"Expected non-negative {name} ids, got {int(arr.min())}.")
    return arr.astype(np.int64)


def zipf_weights(count: int, alpha: float) -> np.ndarray:
    """Probabilities ``p_r ∝ r^{-alpha}`` for ranks ``r = 1..count`` (a finite Zipf law)."""
    count = check_int("count", count, 1)
    alpha = check_positive("alpha", alpha)
    w = np.arange(1, count + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def _split_counts(total: int, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return rng.multinomial(total, weights / weights.sum()).astype(np.int64)


# --- subjects ---------------------------------------------------------------------------


def assign_subjects(
    y: np.ndarray,
    *,
    num_subjects: int,
    rng: np.random.Generator,
    labels_per_subject: int | None = None,
) -> np.ndarray:
    """Gives each record a subject in ``[0, num_subjects)``.

    Without ``labels_per_subject`` every record goes to a uniformly random subject, except
    that (when there are at least ``num_subjects`` records) a random record is first handed to
    each subject so that nobody is left empty.

    With ``labels_per_subject=k`` (ULDP-FL's non-IID MNIST uses ``k=2``) every subject holds at
    most ``k`` distinct labels: under a random order of the labels present, subject ``a`` holds
    labels ``a*k .. a*k+k-1`` (cyclically), which covers every label when
    ``num_subjects * k >= #labels``; each label's records then go to random holders of that
    label, each holder first receiving one record when there are enough.
    """
    y = _ids("y", y)
    num_subjects = check_int("num_subjects", num_subjects, 1)
    n = len(y)
    subject = np.empty(n, dtype=np.int64)
    if labels_per_subject is None:
        order = rng.permutation(n)
        first = min(n, num_subjects)
        subject[order[:first]] = rng.permutation(num_subjects)[:first]
        subject[order[first:]] = rng.integers(0, num_subjects, size=n - first)
        return subject
    labels = np.unique(y)
    k = check_int("labels_per_subject", labels_per_subject, 1)
    k = min(k, len(labels))
    if num_subjects * k < len(labels):
        raise InvalidValueError(
            f"Expected num_subjects * labels_per_subject >= {len(labels)} (the labels present) "
            f"so every label has a holder, got {num_subjects} * {k}."
        )
    label_order = rng.permutation(labels)
    slots = (np.arange(num_subjects)[:, None] * k + np.arange(k)[None, :]) % len(labels)
    held = label_order[slots]  # (num_subjects, k): labels of each subject
    held = held[rng.permutation(num_subjects)]
    for label in labels:
        holders = np.flatnonzero((held == label).any(axis=1))
        idx = rng.permutation(np.flatnonzero(y == label))
        first = min(len(idx), len(holders))
        subject[idx[:first]] = rng.permutation(holders)[:first]
        subject[idx[first:]] = holders[rng.integers(0, len(holders), size=len(idx) - first)]
    return subject


# --- silos for given subjects -----------------------------------------------------------


def spread_uniform(subject: np.ndarray, *, num_silos: int, rng: np.random.Generator) -> np.ndarray:
    """Each record (of each subject) goes to a uniformly random silo."""
    subject = _ids("subject", subject)
    num_silos = check_int("num_silos", num_silos, 1)
    return rng.integers(0, num_silos, size=len(subject)).astype(np.int64)


def spread_power(
    subject: np.ndarray, *, num_silos: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    """Spreads each subject's records over silos by Marathe et al.'s power distribution.

    The papers state only that "subject data is distributed among federation users according
    to the power distribution ``P(x; α) = α x^{α-1}``, 0 <= x <= 1" (α in {1, 2, 4, 8, 16}).
    Our reading: each record of subject ``a`` draws ``x ~ P(·; α)`` (numpy's ``power``) and goes
    to silo ``π_a(floor(x * S))``, where ``π_a`` is a random order of the ``S`` silos drawn once
    per subject. So α = 1 is the uniform spread, and larger α concentrates a subject's records
    in its last-ranked silo (with α = 16 and 16 silos, ~64% of them); the per-subject order keeps
    silo sizes balanced in expectation, without which the low-ranked silos would be empty.
    """
    subject = _ids("subject", subject)
    num_silos = check_int("num_silos", num_silos, 1)
    alpha = check_positive("alpha", alpha)
    order = np.argsort(rng.random((int(subject.max()) + 1, num_silos)), axis=1)
    bins = np.minimum(
        (rng.power(alpha, size=len(subject)) * num_silos).astype(np.int64), num_silos - 1
    )
    return order[subject, bins].astype(np.int64)


# --- ULDP-FL allocations ----------------------------------------------------------------


def uldp_uniform(
    n: int, *, num_subjects: int, num_silos: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """ULDP-FL ``uniform``: each record to a uniformly random subject and silo.

    Returns ``(subject, silo)``.
    """
    n = check_int("n", n, 1)
    num_subjects = check_int("num_subjects", num_subjects, 1)
    num_silos = check_int("num_silos", num_silos, 1)
    subject = rng.integers(0, num_subjects, size=n).astype(np.int64)
    silo = rng.integers(0, num_silos, size=n).astype(np.int64)
    return subject, silo


def uldp_zipf(
    n: int,
    *,
    num_subjects: int,
    num_silos: int,
    alpha1: float,
    alpha2: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """ULDP-FL ``zipf``: records per subject ~ Zipf(α1), then each subject's records over silos
    ~ Zipf(α2).

    Subject ``a`` (rank ``a + 1``) receives a multinomial share of the ``n`` records with
    probability ``∝ (a+1)^{-α1}`` (so subject 0 has the most; heavy tails can leave high ids
    without records). Each subject then splits its records over the silos with probabilities
    ``∝ r^{-α2}`` along a random order of the silos drawn per subject. Records are matched to
    (subject, silo) slots in random order. Returns ``(subject, silo)``.
    """
    n = check_int("n", n, 1)
    num_subjects = check_int("num_subjects", num_subjects, 1)
    num_silos = check_int("num_silos", num_silos, 1)
    per_subject = _split_counts(n, zipf_weights(num_subjects, alpha1), rng)
    silo_w = zipf_weights(num_silos, alpha2)
    subject = np.repeat(np.arange(num_subjects, dtype=np.int64), per_subject)
    silo = np.empty(n, dtype=np.int64)
    start = 0
    for count in per_subject:
        if count:
            order = rng.permutation(num_silos)
            cells = rng.multinomial(count, silo_w)
            silo[start : start + count] = np.repeat(order, cells)
            start += count
    shuffle = rng.permutation(n)
    return subject[shuffle], silo[shuffle]


def uldp_fixed_silo(
    silo: np.ndarray,
    *,
    num_subjects: int,
    alpha: float,
    rng: np.random.Generator,
    main_fraction: float = 0.8,
) -> np.ndarray:
    """ULDP-FL's allocation for data already split into silos (HeartDisease, TcgaBrca).

    Subject ``a`` gets a Zipf(α) share of the records (a multinomial draw with probabilities
    ``∝ (a+1)^{-α}``, as ``zipf``) and a main silo ``m_a`` drawn with probability
    proportional to silo size (the "priority" silo). Subjects then place their records in
    turn, the largest first: each record goes to ``m_a`` with probability ``main_fraction``
    and otherwise to one of the other non-empty silos uniformly; a record drawn for a silo
    that is already full goes to the next silo (cyclically) with room. Silo sizes and the
    subjects' record counts are kept exactly; a subject's main silo holds about
    ``main_fraction`` of its records while the silos have room: a subject with more records
    than its main silo can take spills the rest, and one placed after others filled some
    silos gets the records drawn for them elsewhere, its main silo included. Returns the
    subject of each record.
    """
    silo = _ids("silo", silo)
    num_subjects = check_int("num_subjects", num_subjects, 1)
    main_fraction = check_probability("main_fraction", main_fraction)
    per_subject = _split_counts(len(silo), zipf_weights(num_subjects, alpha), rng)
    sizes = np.bincount(silo)
    num_silos = len(sizes)
    main = rng.choice(num_silos, size=num_subjects, p=sizes / sizes.sum())
    nonempty = np.flatnonzero(sizes)
    room = sizes.copy()
    cells = np.zeros((num_silos, num_subjects), dtype=np.int64)
    for a in np.argsort(-per_subject, kind="stable"):
        if per_subject[a] == 0:
            continue
        others = nonempty[nonempty != main[a]]
        p = np.zeros(num_silos)
        p[main[a]] = main_fraction if len(others) else 1.0
        if len(others):
            p[others] = (1.0 - main_fraction) / len(others)
        wanted = rng.multinomial(per_subject[a], p)
        for s in np.flatnonzero(wanted):
            left = int(wanted[s])
            for step in range(num_silos):  # the silo drawn, then the next ones with room
                t = (s + step) % num_silos
                take = min(left, int(room[t]))
                cells[t, a] += take
                room[t] -= take
                left -= take
                if left == 0:
                    break
    subject = np.empty(len(silo), dtype=np.int64)
    for s in nonempty:
        idx = np.flatnonzero(silo == s)
        subject[idx] = rng.permutation(np.repeat(np.arange(num_subjects), cells[s]))
    return subject


# --- label-skewed silos (PriFedSync) ----------------------------------------------------


def dirichlet_label_skew(
    y: np.ndarray, *, num_silos: int, beta: float, rng: np.random.Generator
) -> np.ndarray:
    """Silo of each record: each class splits over silos by proportions ~ Dirichlet(β·1).

    Large β gives near-equal label mixes; small β puts each class in few silos.
    """
    y = _ids("y", y)
    num_silos = check_int("num_silos", num_silos, 1)
    beta = check_positive("beta", beta)
    silo = np.empty(len(y), dtype=np.int64)
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        share = rng.dirichlet(np.full(num_silos, beta))
        silo[idx] = np.repeat(np.arange(num_silos), rng.multinomial(len(idx), share))
    return silo


def shards(
    y: np.ndarray, *, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> np.ndarray:
    """Client of each record by label shards (McMahan et al.; PriFedSync's MNIST split).

    Records are sorted by label (random order inside a label), cut into
    ``num_clients * shards_per_client`` contiguous shards of (nearly) equal size, and each
    client receives ``shards_per_client`` random shards.
    """
    y = _ids("y", y)
    num_clients = check_int("num_clients", num_clients, 1)
    shards_per_client = check_int("shards_per_client", shards_per_client, 1)
    num_shards = num_clients * shards_per_client
    if num_shards > len(y):
        raise InvalidValueError(
            f"Expected at most {len(y)} shards (one record each), got num_clients * "
            f"shards_per_client = {num_shards}."
        )
    shuffled = rng.permutation(len(y))
    by_label = shuffled[np.argsort(y[shuffled], kind="stable")]
    owner = rng.permutation(num_shards) // shards_per_client
    client = np.empty(len(y), dtype=np.int64)
    for shard, idx in enumerate(np.array_split(by_label, num_shards)):
        client[idx] = owner[shard]
    return client


def dirichlet_clients(
    y: np.ndarray,
    *,
    num_clients: int,
    beta: float,
    records_per_client: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """PriFedSync's CIFAR-10 split (Hsu et al. 2019): fixed-size clients with Dirichlet labels.

    Client ``i`` draws label proportions ``q_i ~ Dirichlet(β·1)`` and label counts
    ``Multinomial(records_per_client, q_i)``, then takes that many records of each label from
    the pool **without replacement across all clients** (no record is in two clients). When a
    label runs out, the client's missing records are redrawn from ``q_i`` restricted to the
    labels that still have records. Returns ``(index, client)``: the chosen records and the
    client of each; records not chosen are not used.
    """
    y = _ids("y", y)
    num_clients = check_int("num_clients", num_clients, 1)
    beta = check_positive("beta", beta)
    records_per_client = check_int("records_per_client", records_per_client, 1)
    if num_clients * records_per_client > len(y):
        raise InvalidValueError(
            f"Expected num_clients * records_per_client <= {len(y)} records, got "
            f"{num_clients} * {records_per_client}."
        )
    labels = np.unique(y)
    pools = [list(rng.permutation(np.flatnonzero(y == label))) for label in labels]
    index: list[int] = []
    client: list[int] = []
    for i in range(num_clients):
        q = rng.dirichlet(np.full(len(labels), beta))
        missing = records_per_client
        while missing:
            left = np.array([len(pool) for pool in pools], dtype=np.float64)
            weights = q * (left > 0)
            if weights.sum() <= 0:  # the client's labels are exhausted: any label left
                weights = (left > 0).astype(np.float64)
            counts = rng.multinomial(missing, weights / weights.sum())
            for c, want in enumerate(counts):
                take = min(int(want), len(pools[c]))
                index.extend(pools[c][:take])
                del pools[c][:take]
                missing -= take
            client.extend([i] * (len(index) - len(client)))
    return np.asarray(index, dtype=np.int64), np.asarray(client, dtype=np.int64)


def per_client_test(
    train_y: np.ndarray,
    train_client: np.ndarray,
    test_y: np.ndarray,
    *,
    num_clients: int,
    records_per_client: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Each client's own test set, with the label mix of its training records.

    Client ``i`` draws label counts ``Multinomial(records_per_client, p_i)`` with ``p_i`` the
    label proportions of its training records (so it is only tested on labels it has seen,
    as in PriFedSync's MNIST and CIFAR-10 splits), and takes that many test records of each
    label without replacement inside the client (with replacement only when the test pool
    holds fewer records of a label than asked for). Different clients may share test records.
    Returns ``(index, client)`` into ``test_y``.
    """
    train_y = _ids("train_y", train_y)
    train_client = _ids("train_client", train_client)
    test_y = _ids("test_y", test_y)
    num_clients = check_int("num_clients", num_clients, 1)
    records_per_client = check_int("records_per_client", records_per_client, 1)
    if len(train_y) != len(train_client):
        raise InvalidValueError(
            f"Expected one client per training record, got {len(train_client)} clients for "
            f"{len(train_y)} records."
        )
    num_labels = int(max(train_y.max(), test_y.max())) + 1
    by_label = [np.flatnonzero(test_y == c) for c in range(num_labels)]
    index: list[np.ndarray] = []
    client: list[np.ndarray] = []
    for i in range(num_clients):
        seen = np.bincount(train_y[train_client == i], minlength=num_labels).astype(np.float64)
        seen[[len(pool) == 0 for pool in by_label]] = 0.0
        if seen.sum() == 0:
            raise InvalidValueError(
                f"Client {i} has no training record with a label present in the test pool."
            )
        counts = rng.multinomial(records_per_client, seen / seen.sum())
        for c in np.flatnonzero(counts):
            pool = by_label[c]
            chosen = rng.choice(pool, size=int(counts[c]), replace=int(counts[c]) > len(pool))
            index.append(chosen)
            client.append(np.full(len(chosen), i, dtype=np.int64))
    return np.concatenate(index).astype(np.int64), np.concatenate(client)


# --- datasets ---------------------------------------------------------------------------


def assemble(
    x: np.ndarray,
    y: np.ndarray,
    *,
    silo: np.ndarray,
    subject: np.ndarray,
    num_classes: int,
    num_silos: int,
    subject_names: Sequence[str] | None = None,
    drop_empty_silos: bool = False,
    dropped_records: int = 0,
    silo_names: Sequence[str] | None = None,
    subject_count: int | None = None,
) -> FederatedDataset:
    """Builds a :class:`FederatedDataset` from partition output (``subject_count``: the
    public number of subjects where they were drawn, :class:`FederatedDataset`).

    An allocation can leave silos empty (few records, tiny Dirichlet β, heavy Zipf). By
    default that is an error naming the empty silos; with ``drop_empty_silos=True`` the empty
    silos are removed and the others renumbered densely in their original order (the
    federation then has fewer silos than asked for).
    """
    num_silos = check_int("num_silos", num_silos, 1)
    silo = _ids("silo", silo)
    if silo.max() >= num_silos:
        raise InvalidValueError(
            f"Expected silo ids in [0, {num_silos - 1}], got {int(silo.max())}."
        )
    if silo_names is not None and len(silo_names) != num_silos:
        raise InvalidValueError(
            f"Expected {num_silos} silo_names (one per silo), got {len(silo_names)}."
        )
    counts = np.bincount(silo, minlength=num_silos)
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        if not drop_empty_silos:
            named = [int(s) for s in empty[:10]]
            which = (
                ", ".join(f"{s} ({silo_names[s]!r})" for s in named)
                if silo_names is not None
                else str(named)
            )
            raise InvalidValueError(
                f"The allocation left {len(empty)} of {num_silos} silo(s) empty (silo ids: "
                f"{which}); use fewer silos, more records or another allocation."
            )
        remap = np.cumsum(counts > 0) - 1
        silo = remap[silo]
        num_silos -= len(empty)
        if silo_names is not None:
            silo_names = [silo_names[int(s)] for s in np.flatnonzero(counts > 0)]
    return FederatedDataset(
        x=x,
        y=y,
        silo=silo,
        subject=subject,
        num_classes=num_classes,
        num_silos=num_silos,
        subject_names=list(subject_names) if subject_names is not None else None,
        dropped_records=dropped_records,
        silo_names=list(silo_names) if silo_names is not None else None,
        subject_count=subject_count,
    )


def _densify(subject: np.ndarray, names: Sequence[str] | None) -> tuple[np.ndarray, Any]:
    present, dense = np.unique(subject, return_inverse=True)
    new_names = None if names is None else [names[i] for i in present]
    return dense.astype(np.int64).reshape(-1), new_names


def first_subjects(dataset: FederatedDataset, n: int) -> FederatedDataset:
    """Keeps the records of subjects ``0..n-1`` (Small-FEMNIST: the first 350 writers).

    Subject ids are re-densified (in order) and ``subject_names`` follows. Silos left without
    records are an error.
    """
    n = check_int("n", n, 1)
    keep = np.flatnonzero(dataset.subject < n)
    if len(keep) == 0:
        raise InvalidValueError(f"No records belong to the first n={n} subjects.")
    if dataset.subject_count is not None:  # a public roster: ids stay, |U| becomes n
        subject, names = dataset.subject[keep], dataset.subject_names
        count: int | None = min(n, dataset.subject_count)
    else:
        subject, names = _densify(dataset.subject[keep], dataset.subject_names)
        count = None
    return assemble(
        dataset.x[keep],
        dataset.y[keep],
        silo=dataset.silo[keep],
        subject=subject,
        num_classes=dataset.num_classes,
        num_silos=dataset.num_silos,
        subject_names=names,
        dropped_records=dataset.dropped_records,
        silo_names=dataset.silo_names,
        subject_count=count,
    )
