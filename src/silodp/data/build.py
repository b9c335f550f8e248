"""The builder turning a :class:`~silodp.data.config.DataConfig` into a :class:`FederatedData`.

Pipeline of :func:`build_federated_data`: load the source and its test split
(``test_split``) → optional seeded subsample (``max_records``) → place records on subjects
and silos (``allocation``) → ``first_subjects`` → caps (``records_per_subject_per_silo``,
``records_per_subject``) → public feature scaling (``scaling = "bounds"`` or ``"standard"``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from silodp.data import loaders
from silodp.data import partition as part
from silodp.data import scaling as sc
from silodp.data.config import (
    ALLOCATIONS,
    DEFAULT_NUM_SUBJECTS,
    SOURCES,
    SYNTHETIC_RECORDS,
    TEST_SPLITS,
    DataConfig,
)
from silodp.data.dataset import FederatedData, FederatedDataset, SplitSummary, TestSplit
from silodp.data.split import _Raw, _split, stratified_split, subject_split
from silodp.errors import InvalidValueError

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_NUM_SUBJECTS",
    "SOURCES",
    "TEST_SPLITS",
    "DataConfig",
    "build_federated_data",
    "stratified_split",
    "subject_split",
]

logger = logging.getLogger(__name__)


def _check_separate_test(path: str, test_path: str) -> None:
    """Refuses a test file that is also read as training data: the same file, or a LEAF file
    in both the training and the test directory's ``*.json``.

    Raises:
      InvalidValueError: they overlap.
    """

    def files(item: str) -> set[Path]:
        p = Path(item)
        if p.is_dir():
            return {f.resolve() for f in p.glob("*.json") if f.is_file()}
        return {p.resolve()}

    both = sorted(files(path) & files(test_path))
    train_file, test_file = Path(path), Path(test_path)
    if not both and train_file.is_file() and test_file.is_file():
        if os.path.samefile(train_file, test_file):  # a hard link
            both = [test_file.resolve()]
    if both:
        raise InvalidValueError(
            f"Expected data.test_path={test_path!r} to be separate from data.path={path!r}; "
            f"both read {str(both[0])!r}, so its records would be test and training records."
        )


def _first_subjects(cfg: DataConfig, raw: _Raw) -> _Raw:
    """The records of the first ``first_subjects`` subjects of the data (LEAF users, a
    table's subject ids in order), kept before the test split: the split's fraction then
    holds, and the test records come from the same people."""
    if cfg.first_subjects is None or raw.subject is None:
        return raw
    keep = np.flatnonzero(raw.subject < cfg.first_subjects)
    if len(keep) == 0:  # pragma: no cover - subject ids are dense from 0
        raise InvalidValueError(f"No records belong to the first {cfg.first_subjects} subjects.")
    present = int(raw.subject.max()) + 1 if len(raw.subject) else 0
    if present < cfg.first_subjects:
        logger.warning(
            "first_subjects = %d, but the data holds %d subjects: all of them are kept",
            cfg.first_subjects,
            present,
        )
    return raw.take(keep)


def _load(cfg: DataConfig, split_rng: np.random.Generator, data_rng: np.random.Generator) -> _Raw:
    file_split = SplitSummary(kind="file", fraction=None)
    if cfg.test_path is not None and cfg.path is not None:
        _check_separate_test(cfg.path, cfg.test_path)
    if cfg.source == "fashion_mnist":
        (x, y), (xt, yt) = loaders.load_fashion_mnist(cfg.path)
        return _Raw(x=x, y=y, num_classes=10, test=TestSplit(x=xt, y=yt), split=file_split)
    if cfg.source in ("digits", "synthetic"):
        if cfg.source == "digits":
            x, y = loaders.load_digits_arrays()
            num_classes = 10
        else:
            assert cfg.num_features is not None and cfg.num_classes is not None
            x, y = loaders.make_synthetic(
                num_records=cfg.max_records or SYNTHETIC_RECORDS,
                num_features=cfg.num_features,
                num_classes=cfg.num_classes,
                rng=data_rng,
            )
            num_classes = cfg.num_classes
        return _split(_Raw(x=x, y=y, num_classes=num_classes, test=None), cfg, split_rng)
    if cfg.source.startswith("leaf_"):
        kind = cfg.source.removeprefix("leaf_")
        leaf = loaders.load_leaf_json(str(cfg.path), kind=kind)
        raw = _Raw(
            x=leaf.x,
            y=leaf.y,
            num_classes=leaf.num_classes,
            test=None,
            subject=leaf.subject,
            subject_names=leaf.subject_names,
        )
        raw = _first_subjects(cfg, raw)
        if cfg.test_path is not None:
            test_leaf = loaders.load_leaf_json(cfg.test_path, kind=kind)
            if test_leaf.x.shape[1:] != leaf.x.shape[1:]:
                raise InvalidValueError(
                    f"Expected the records of data.test_path={cfg.test_path!r} to have the shape "
                    f"of data.path's, {leaf.x.shape[1:]}; got {test_leaf.x.shape[1:]}."
                )
            users = [test_leaf.subject_names[s] for s in test_leaf.subject]
            return _with_test_file(raw, cfg, test_leaf.x, test_leaf.y, users, "users")
    else:
        table = loaders.load_table(
            str(cfg.path),
            feature_columns=cfg.feature_columns,
            label_column=cfg.label_column,
            silo_column=cfg.silo_column,
            subject_column=cfg.subject_column,
            label_values=cfg.label_values,
        )
        subject = table.subject
        if cfg.subjects_from == "records":
            subject = np.arange(len(table.y), dtype=np.int64)
        raw = _Raw(
            x=table.x,
            y=table.y,
            num_classes=table.num_classes,
            test=None,
            subject=subject,
            subject_names=table.subject_names,
            silo=table.silo,
            num_table_silos=len(table.silo_names or ()),
            silo_names=table.silo_names,
            feature_names=table.feature_columns,
            label_values=tuple(table.label_values),
        )
        if cfg.subjects_from in ("column", "records"):  # records: each its own subject
            raw = _first_subjects(cfg, raw)
        if cfg.test_path is not None:
            # a test file with the subject column: its subjects are known
            by_subject = cfg.subjects_from == "column" and cfg.subject_column in (
                loaders.table_columns(cfg.test_path)
            )
            test_table = loaders.load_table(
                cfg.test_path,
                feature_columns=table.feature_columns,
                label_column=cfg.label_column,
                subject_column=cfg.subject_column if by_subject else None,
                label_values=table.label_values,
            )
            if not by_subject or test_table.subject is None or test_table.subject_names is None:
                test = TestSplit(x=test_table.x, y=test_table.y)
                return replace(raw, test=test, split=file_split)
            # the test file's subjects, by id as written: counted on both sides, and with
            # first_subjects only those kept for training are tested
            people = [test_table.subject_names[s] for s in test_table.subject]
            # one person written one way in both files ("7" and "07" would be two people)
            loaders.check_one_spelling(
                sorted(set(raw.subject_names or ()) | set(people)),
                str(cfg.subject_column),
                f"{cfg.path} and {cfg.test_path}",
            )
            what = f"subjects (column {cfg.subject_column!r})"
            return _with_test_file(raw, cfg, test_table.x, test_table.y, people, what)
    return _split(raw, cfg, split_rng)


def _with_test_file(
    raw: _Raw, cfg: DataConfig, x: np.ndarray, y: np.ndarray, people: list[str], what: str
) -> _Raw:
    """``raw`` with the test file's records (``people``: each record's subject as written):
    with ``first_subjects``, only those of the subjects kept for training; their names count
    the subjects on both sides."""
    keep = np.arange(len(people))
    if cfg.first_subjects is not None:
        kept = set(raw.subject_names or ())
        keep = np.asarray([i for i, u in enumerate(people) if u in kept], dtype=np.int64)
        if len(keep) == 0:
            raise InvalidValueError(
                f"Expected data.test_path={cfg.test_path!r} to hold records of the "
                f"first_subjects={cfg.first_subjects} {what} kept for training; it holds none "
                "of them."
            )
    test = TestSplit(x=x[keep], y=y[keep])
    names = frozenset(people[i] for i in keep)
    split = SplitSummary(kind="file", fraction=None)
    return replace(raw, test=test, split=split, test_subject_names=names)


def _check_sizes(cfg: DataConfig, raw: _Raw) -> None:
    """Refuses more drawn silos or subjects than training records before anything is drawn
    (every silo must hold a record, and a drawn subject without one is only padding; a huge
    count would otherwise exhaust memory inside the allocation)."""
    n = len(raw.y)
    draws_silos = raw.silo is None and cfg.allocation != "column"
    if draws_silos and cfg.num_silos > n:
        raise InvalidValueError(
            f"Expected data.num_silos={cfg.num_silos} <= {n}, the training records to spread "
            "over them (every silo must hold a record)."
        )
    num_subjects = cfg.num_subjects or DEFAULT_NUM_SUBJECTS
    if cfg.subjects_from == "simulated" and num_subjects > n:
        default = "" if cfg.num_subjects else " (the default)"
        raise InvalidValueError(
            f"Expected data.num_subjects={num_subjects}{default} <= {n}, the training records "
            "drawn subjects share (a subject without records is only padding)."
        )
    if cfg.allocation == "shards" and cfg.num_silos * cfg.shards_per_client > n:
        raise InvalidValueError(
            f"Expected data.num_silos x data.shards_per_client <= {n} training records (a "
            f"shard holds at least one), got {cfg.num_silos} x {cfg.shards_per_client}."
        )


def _check_table_silos(cfg: DataConfig, silo: np.ndarray, names: list[str]) -> None:
    """Refuses a silo of the table's silo column left without training records (the test
    split took them all), naming it by its id in the table."""
    empty = np.flatnonzero(np.bincount(silo, minlength=len(names)) == 0)
    if len(empty) == 0:
        return
    steps = [
        f"test_path={cfg.test_path!r}"
        if cfg.test_path
        else f"test_split={cfg.test_split!r}, test_fraction={cfg.test_fraction}"
    ]
    advice = [] if cfg.test_path else ["lower test_fraction"]
    if cfg.test_split == "record":
        advice.append("use test_split='subject'")
    for key in ("max_records", "first_subjects"):
        if getattr(cfg, key) is not None:
            steps.append(f"{key}={getattr(cfg, key)}")
            advice.append(f"raise {key}")
    advice.append("give those silos more records")
    raise InvalidValueError(
        f"Silo(s) {[names[s] for s in empty[:10]]} of column {cfg.silo_column!r} in "
        f"{cfg.path!r} hold no training records once the data is subsampled and the test "
        f"records are held out ({', '.join(steps)}); every silo needs one. "
        + "; ".join(advice).capitalize()
        + "."
    )


def _allocate(
    cfg: DataConfig, raw: _Raw, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns ``(silo, subject, num_silos)``."""
    _check_sizes(cfg, raw)
    n, alloc, num_silos = len(raw.y), cfg.allocation, cfg.num_silos
    num_subjects = cfg.num_subjects or DEFAULT_NUM_SUBJECTS
    if alloc == "uldp_uniform":
        subject, silo = part.uldp_uniform(
            n, num_subjects=num_subjects, num_silos=num_silos, rng=rng
        )
        return silo, subject, num_silos
    if alloc == "zipf":
        subject, silo = part.uldp_zipf(
            n,
            num_subjects=num_subjects,
            num_silos=num_silos,
            alpha1=cfg.zipf_alpha1,
            alpha2=cfg.zipf_alpha2,
            rng=rng,
        )
        return silo, subject, num_silos
    if alloc == "fixed_silo":
        if raw.silo is not None:
            silo, num_silos = raw.silo, raw.num_table_silos
        else:
            silo = part.spread_uniform(np.zeros(n, dtype=np.int64), num_silos=num_silos, rng=rng)
        subject = part.uldp_fixed_silo(
            silo, num_subjects=num_subjects, alpha=cfg.zipf_alpha1, rng=rng
        )
        return silo, subject, num_silos
    if raw.subject is not None:
        subject = raw.subject
    else:
        subject = part.assign_subjects(
            raw.y,
            num_subjects=num_subjects,
            rng=rng,
            labels_per_subject=cfg.labels_per_subject,
        )
    if alloc == "uniform":
        silo = part.spread_uniform(subject, num_silos=num_silos, rng=rng)
    elif alloc == "power":
        silo = part.spread_power(subject, num_silos=num_silos, alpha=cfg.alpha, rng=rng)
    elif alloc == "dirichlet" and raw.silo is not None:  # fixed-size clients, drawn already
        silo = raw.silo
    elif alloc == "dirichlet":
        silo = part.dirichlet_label_skew(
            raw.y, num_silos=num_silos, beta=cfg.dirichlet_beta, rng=rng
        )
    elif alloc == "shards":
        silo = part.shards(
            raw.y, num_clients=num_silos, shards_per_client=cfg.shards_per_client, rng=rng
        )
    else:  # column
        if raw.silo is None:  # pragma: no cover - excluded by DataConfig validation
            raise InvalidValueError("allocation='column' needs a table silo_column.")
        silo, num_silos = raw.silo, raw.num_table_silos
    return silo, subject, num_silos


def build_federated_data(cfg: DataConfig) -> FederatedData:
    """Loads ``cfg.source``, holds out its test split and places its training records on
    subjects and silos.

    All randomness derives from ``cfg.seed`` (independent streams for the test split, the
    subsample, the allocation and synthetic data), so equal configs give equal data.
    ``scaling = "bounds"`` and ``"standard"`` are applied here, to training and test
    records alike; with ``scaling = "dp"`` the data comes back **unscaled** (``scaling`` of
    the result is ``"none"``): the runner estimates the statistics with
    :func:`silodp.data.scaling.dp_feature_stats` once it has calibrated their noise, and
    applies them with :meth:`~silodp.data.scaling.FeatureStats.apply`. With ``scaling =
    "none"``, a table whose feature scales differ a hundredfold or more gets a logged
    warning (computed here, on the loaded training records; nothing leaves the loader).
    """
    if not isinstance(cfg, DataConfig):
        raise InvalidValueError(f"Expected a DataConfig, got {type(cfg).__name__}.")
    _check_paths(cfg)
    try:
        return _build(cfg)
    except InvalidValueError as err:
        where = _source(cfg)
        if type(err) is InvalidValueError and where and str(cfg.path) not in str(err):
            raise InvalidValueError(f"{err} (data: {where})") from err
        raise


def _source(cfg: DataConfig) -> str:
    """What the records come from, as an error message names it."""
    if cfg.path is None:
        return ""
    kind = {"table": "table", "fashion_mnist": "Fashion-MNIST directory"}.get(cfg.source, "LEAF")
    return f"{kind} {cfg.path!r}"


def _check_paths(cfg: DataConfig) -> None:
    """Refuses a ``data.path`` or ``data.test_path`` that does not exist, naming the key."""
    for key in ("path", "test_path"):
        value = getattr(cfg, key)
        if value is None or Path(value).exists():
            continue
        relative = "" if Path(value).is_absolute() else f" (relative to {os.getcwd()!r})"
        raise loaders.DataFileNotFoundError(
            f"Expected data.{key}={value!r} to be an existing file or directory for "
            f"source={cfg.source!r}; it does not exist{relative}."
        )


def _build(cfg: DataConfig) -> FederatedData:
    streams = np.random.SeedSequence(cfg.seed).spawn(5)
    split_rng, sub_rng, alloc_rng, data_rng, test_rng = (np.random.default_rng(s) for s in streams)
    raw = _load(cfg, split_rng, data_rng)
    if cfg.max_records is not None and cfg.max_records < len(raw.y):
        raw = raw.take(np.sort(sub_rng.choice(len(raw.y), cfg.max_records, replace=False)))
    if cfg.train_per_client is not None and cfg.num_silos * cfg.train_per_client > len(raw.y):
        raise InvalidValueError(
            f"Expected data.num_silos x data.train_per_client <= {len(raw.y)} training records "
            f"(no record is in two clients), got {cfg.num_silos} x {cfg.train_per_client}."
        )
    if cfg.train_per_client is not None:
        index, client = part.dirichlet_clients(
            raw.y,
            num_clients=cfg.num_silos,
            beta=cfg.dirichlet_beta,
            records_per_client=cfg.train_per_client,
            rng=alloc_rng,
        )
        raw = replace(raw.take(index), silo=client, num_table_silos=cfg.num_silos)
    silo, subject, num_silos = _allocate(cfg, raw, alloc_rng)
    table_silos = raw.silo is not None and silo is raw.silo and raw.silo_names is not None
    if table_silos and raw.silo_names is not None:
        _check_table_silos(cfg, silo, raw.silo_names)
    train: FederatedDataset = part.assemble(
        raw.x,
        raw.y,
        silo=silo,
        subject=subject,
        num_classes=raw.num_classes,
        num_silos=num_silos,
        subject_names=raw.subject_names,
        silo_names=raw.silo_names if table_silos else None,
        # drawn subjects: |U| is the config's number, whichever of them got records
        subject_count=None if subject is raw.subject else cfg.num_subjects or DEFAULT_NUM_SUBJECTS,
    )
    if cfg.first_subjects is not None and cfg.subjects_from == "simulated":
        train = part.first_subjects(train, cfg.first_subjects)  # drawn: after the drawing
    if cfg.records_per_subject_per_silo is not None or cfg.records_per_subject is not None:
        train = part.cap_records(
            train,
            per_silo=cfg.records_per_subject_per_silo,
            total=cfg.records_per_subject,
            seed=cfg.seed,
        )
    if raw.test is None:  # pragma: no cover - every loader sets a test split
        raise RuntimeError("No test split was built.")
    test = raw.test
    if cfg.test_per_client is not None and cfg.test_per_client > len(test):
        raise InvalidValueError(
            f"Expected data.test_per_client={cfg.test_per_client} <= {len(test)}, the test "
            "records each client's test set is drawn from."
        )
    if cfg.test_per_client is not None:
        index, client = part.per_client_test(
            train.y,
            train.silo,
            test.y,
            num_clients=train.num_silos,
            records_per_client=cfg.test_per_client,
            rng=test_rng,
        )
        test = TestSplit(x=test.x[index], y=test.y[index], silo=client)
        pairs = len(np.unique(client * (int(index.max()) + 1) + index))
        repeated = len(index) - pairs
        if repeated:
            logger.warning(
                "data.test_per_client=%d: %d of the %d test records repeat a record already "
                "in the same client's test set (a label's test pool is smaller than a "
                "client's draw of it), so test accuracy counts those records more than once",
                cfg.test_per_client,
                repeated,
                len(index),
            )
        distinct = len(np.unique(index))
    split = _split_summary(cfg, raw, train)
    if split is not None and cfg.test_per_client is not None:
        split = replace(split, distinct_test_records=distinct, repeated_test_records=repeated)
    data = FederatedData(
        train=train,
        test=test,
        name=_name(cfg, train.num_silos),
        split=split,
        subjects_from=cfg.subjects_from,
        subjects_note=cfg.subjects_note,
        feature_names=tuple(raw.feature_names),
    )
    return _scale(cfg, data, raw.feature_names)


def _split_summary(cfg: DataConfig, raw: _Raw, train: FederatedDataset) -> SplitSummary | None:
    """``raw.split`` with the subjects on both sides counted on the final training records."""
    split = raw.split
    names = train.subject_names
    if split is not None and split.kind == "file" and raw.test_subject_names is not None:
        assert names is not None  # LEAF users
        users = {names[i] for i in np.unique(train.subject)}
        return replace(
            split,
            test_subjects=len(raw.test_subject_names),
            shared_subjects=len(users & raw.test_subject_names),
        )
    if split is None or split.kind == "file" or cfg.subjects_from == "simulated":
        # a test file's records or drawn subjects: test records carry no subject
        return None if split is None else replace(split, test_subjects=None)
    if split.kind == "subject" or cfg.subjects_from == "records":
        shared = 0
    elif raw.test_subject_names is not None and train.subject_names is not None:
        present = np.unique(train.subject)
        shared = sum(train.subject_names[i] in raw.test_subject_names for i in present)
    else:  # pragma: no cover - natural subjects always carry names
        return replace(split, shared_subjects=None)
    return replace(split, shared_subjects=int(shared))


def _scale(cfg: DataConfig, data: FederatedData, names: tuple[str, ...]) -> FederatedData:
    """Applies ``bounds``/``standard`` scaling; warns about raw scales for ``none``."""
    if cfg.source != "table":
        return data
    num_features = data.train.x.shape[1]
    if cfg.scaling == "dp":  # estimated when a run starts; its bounds are checked now
        try:
            sc.FeatureStats.from_bounds(cfg.feature_bounds, num_features)
        except ValueError as err:
            raise InvalidValueError(
                f"{err} The feature columns of {cfg.path!r} are {list(names)}."
            ) from None
        return data
    if cfg.scaling == "none":
        message = sc.scale_warning(data.train.x, names, where=f"table {cfg.path!r}")
        if message:
            logger.warning(message)
        return data
    try:
        if cfg.scaling == "bounds":
            stats = sc.FeatureStats.from_bounds(cfg.feature_bounds, num_features)
        else:
            stats = sc.FeatureStats.standard(cfg.feature_mean, cfg.feature_std, num_features)
        return stats.apply(data)
    except ValueError as err:
        raise InvalidValueError(
            f"{err} The feature columns of {cfg.path!r} are {list(names)}."
        ) from None


def _name(cfg: DataConfig, num_silos: int) -> str:
    details: dict[str, Any] = {
        "power": f"a{cfg.alpha:g}",
        "dirichlet": f"b{cfg.dirichlet_beta:g}",
        "zipf": f"a{cfg.zipf_alpha1:g},{cfg.zipf_alpha2:g}",
    }
    alloc = cfg.allocation + (f"({details[cfg.allocation]})" if cfg.allocation in details else "")
    return f"{cfg.source}-{alloc}-{num_silos}silos"
