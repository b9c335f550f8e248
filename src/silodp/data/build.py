"""A typed data configuration and the builder turning it into a :class:`FederatedData`.

Pipeline of :func:`build_federated_data`: load the source and its test split → optional
seeded subsample (``max_records``) → place records on subjects and silos (``allocation``) →
``first_subjects`` → caps (``records_per_subject_per_silo``, ``records_per_subject``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from silodp._validation import check_choice, check_in_range, check_int, check_positive
from silodp.data import loaders
from silodp.data import partition as part
from silodp.data.dataset import FederatedData, FederatedDataset, TestSplit

__all__ = ["ALLOCATIONS", "SOURCES", "DataConfig", "build_federated_data", "stratified_split"]

SOURCES = ("digits", "fashion_mnist", "leaf_femnist", "leaf_shakespeare", "table", "synthetic")
ALLOCATIONS = (
    "uniform",
    "power",
    "uldp_uniform",
    "zipf",
    "fixed_silo",
    "dirichlet",
    "shards",
    "column",
)
#: Allocations that keep subjects given by the data (LEAF users, a table's subject column).
_KEEP_SUBJECTS = ("uniform", "power", "dirichlet", "shards", "column")
#: Allocations that draw subjects themselves (labels_per_subject does not apply).
_DRAW_SUBJECTS = ("uldp_uniform", "zipf", "fixed_silo")
#: Records generated for ``source="synthetic"`` when ``max_records`` is not set.
SYNTHETIC_RECORDS = 2000


def _optional_int(name: str, value: int | None, lo: int) -> None:
    if value is not None:
        check_int(name, value, lo)


@dataclass(frozen=True)
class DataConfig:
    """What data to load and how to spread it over silos and subjects.

    ``num_subjects`` applies to sources without natural subjects (LEAF users and a table's
    ``subject_column`` are used as subjects). With ``allocation="column"`` the table's
    ``silo_column`` defines the silos and ``num_silos`` is not used. ``fixed_silo`` draws
    subjects (Zipf(``zipf_alpha1``), 80% in a main silo) over silos from ``silo_column`` if set,
    else over uniformly random silos. For ``synthetic``, ``max_records`` (default 2,000) is
    the number of generated records before the test split.
    """

    source: str = "digits"
    path: str | None = None
    test_path: str | None = None
    test_fraction: float = 0.2
    num_silos: int = 5
    num_subjects: int = 100
    allocation: str = "uniform"
    alpha: float = 1.0
    zipf_alpha1: float = 2.0
    zipf_alpha2: float = 2.0
    dirichlet_beta: float = 0.5
    shards_per_client: int = 4
    train_per_client: int | None = None
    test_per_client: int | None = None
    labels_per_subject: int | None = None
    first_subjects: int | None = None
    max_records: int | None = None
    records_per_subject_per_silo: int | None = None
    records_per_subject: int | None = None
    feature_columns: tuple[str, ...] = ()
    label_column: str = "label"
    silo_column: str | None = None
    subject_column: str | None = None
    num_features: int = 20
    num_classes: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        is_table = self.source == "table"
        if self.source in ("leaf_femnist", "leaf_shakespeare", "table") and not self.path:
            raise ValueError(f"Expected a path for source={self.source!r}, got {self.path!r}.")
        if self.source in ("digits", "synthetic") and self.path is not None:
            raise ValueError(f"Expected path=None for source={self.source!r}, got {self.path!r}.")
        if self.test_path is not None and self.source not in (
            "leaf_femnist",
            "leaf_shakespeare",
            "table",
        ):
            raise ValueError(
                f"Expected test_path=None for source={self.source!r} (only LEAF and table "
                f"sources read a test file), got {self.test_path!r}."
            )
        check_in_range("test_fraction", self.test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        check_int("num_silos", self.num_silos, 1)
        check_int("num_subjects", self.num_subjects, 1)
        check_positive("alpha", self.alpha)
        check_positive("zipf_alpha1", self.zipf_alpha1)
        check_positive("zipf_alpha2", self.zipf_alpha2)
        check_positive("dirichlet_beta", self.dirichlet_beta)
        check_int("shards_per_client", self.shards_per_client, 1)
        _optional_int("train_per_client", self.train_per_client, 1)
        _optional_int("test_per_client", self.test_per_client, 1)
        _optional_int("labels_per_subject", self.labels_per_subject, 1)
        _optional_int("first_subjects", self.first_subjects, 1)
        _optional_int("max_records", self.max_records, 2)
        _optional_int("records_per_subject_per_silo", self.records_per_subject_per_silo, 1)
        _optional_int("records_per_subject", self.records_per_subject, 1)
        if isinstance(self.feature_columns, str) or not all(
            isinstance(c, str) for c in self.feature_columns
        ):
            raise ValueError(
                f"Expected feature_columns={self.feature_columns!r} to be a sequence of names."
            )
        object.__setattr__(self, "feature_columns", tuple(self.feature_columns))
        if not isinstance(self.label_column, str) or not self.label_column:
            raise ValueError(f"Expected label_column={self.label_column!r} to be a column name.")
        for name in ("silo_column", "subject_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"Expected {name}={value!r} to be a column name or None.")
        if not is_table:
            for name in ("silo_column", "subject_column"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"Expected {name}=None for source={self.source!r} (tables only)."
                    )
            if self.feature_columns:
                raise ValueError(
                    f"Expected feature_columns=() for source={self.source!r} (tables only)."
                )
        check_int("num_features", self.num_features, 1)
        check_int("num_classes", self.num_classes, 2)
        check_int("seed", self.seed, 0)
        self._check_allocation()

    def _check_allocation(self) -> None:
        alloc = self.allocation
        if self.train_per_client is not None and alloc != "dirichlet":
            raise ValueError(
                f"Expected train_per_client=None unless allocation='dirichlet', got "
                f"train_per_client={self.train_per_client} with allocation={alloc!r}."
            )
        if self.test_per_client is not None and alloc not in ("shards", "dirichlet"):
            raise ValueError(
                f"Expected test_per_client=None unless allocation is 'shards' or 'dirichlet', "
                f"got test_per_client={self.test_per_client} with allocation={alloc!r}."
            )
        if alloc == "column" and (self.source != "table" or self.silo_column is None):
            raise ValueError(
                "Expected allocation='column' only with source='table' and a silo_column, got "
                f"source={self.source!r}, silo_column={self.silo_column!r}."
            )
        if self.silo_column is not None and alloc not in ("column", "fixed_silo"):
            raise ValueError(
                f"silo_column={self.silo_column!r} is only used by allocation='column' or "
                f"'fixed_silo', got allocation={alloc!r}."
            )
        if self.has_natural_subjects and alloc not in _KEEP_SUBJECTS:
            raise ValueError(
                f"allocation={alloc!r} draws its own subjects, but source={self.source!r} "
                f"already has subjects; expected one of {', '.join(_KEEP_SUBJECTS)}."
            )
        if self.labels_per_subject is not None:
            if self.has_natural_subjects or alloc in _DRAW_SUBJECTS:
                raise ValueError(
                    f"labels_per_subject={self.labels_per_subject} needs subjects drawn by "
                    f"assign_subjects; it does not apply to source={self.source!r} with "
                    f"allocation={alloc!r}."
                )

    @property
    def has_natural_subjects(self) -> bool:
        """Whether subjects come from the data (LEAF users, a table's subject column)."""
        return self.source.startswith("leaf_") or self.subject_column is not None


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

    def take(self, index: np.ndarray) -> _Raw:
        subject, names = self.subject, self.subject_names
        if subject is not None:
            present, dense = np.unique(subject[index], return_inverse=True)
            subject = dense.reshape(-1).astype(np.int64)
            names = None if names is None else [names[i] for i in present]
        return _Raw(
            x=self.x[index],
            y=self.y[index],
            num_classes=self.num_classes,
            test=self.test,
            subject=subject,
            subject_names=names,
            silo=None if self.silo is None else self.silo[index],
            num_table_silos=self.num_table_silos,
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
        raise ValueError(
            f"test_fraction={test_fraction} leaves no test records among {len(y)} records."
        )
    train = np.setdiff1d(np.arange(len(y)), test)
    return train, test


def _held_out(
    x: np.ndarray, y: np.ndarray, cfg: DataConfig, rng: np.random.Generator
) -> tuple[np.ndarray, TestSplit]:
    train, test = stratified_split(y, test_fraction=cfg.test_fraction, rng=rng)
    return train, TestSplit(x=x[test], y=y[test])


def _load(cfg: DataConfig, split_rng: np.random.Generator, data_rng: np.random.Generator) -> _Raw:
    if cfg.source == "fashion_mnist":
        (x, y), (xt, yt) = loaders.load_fashion_mnist(cfg.path)
        return _Raw(x=x, y=y, num_classes=10, test=TestSplit(x=xt, y=yt))
    if cfg.source in ("digits", "synthetic"):
        if cfg.source == "digits":
            x, y = loaders.load_digits_arrays()
            num_classes = 10
        else:
            x, y = loaders.make_synthetic(
                num_records=cfg.max_records or SYNTHETIC_RECORDS,
                num_features=cfg.num_features,
                num_classes=cfg.num_classes,
                rng=data_rng,
            )
            num_classes = cfg.num_classes
        train, test = _held_out(x, y, cfg, split_rng)
        return _Raw(x=x[train], y=y[train], num_classes=num_classes, test=test)
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
        if cfg.test_path is not None:
            test_leaf = loaders.load_leaf_json(cfg.test_path, kind=kind)
            return replace(raw, test=TestSplit(x=test_leaf.x, y=test_leaf.y))
    else:
        table = loaders.load_table(
            str(cfg.path),
            feature_columns=cfg.feature_columns,
            label_column=cfg.label_column,
            silo_column=cfg.silo_column,
            subject_column=cfg.subject_column,
        )
        raw = _Raw(
            x=table.x,
            y=table.y,
            num_classes=table.num_classes,
            test=None,
            subject=table.subject,
            subject_names=table.subject_names,
            silo=table.silo,
            num_table_silos=len(table.silo_names or ()),
        )
        if cfg.test_path is not None:
            test_table = loaders.load_table(
                cfg.test_path,
                feature_columns=table.feature_columns,
                label_column=cfg.label_column,
                label_values=table.label_values,
            )
            return replace(raw, test=TestSplit(x=test_table.x, y=test_table.y))
    train, test = _held_out(raw.x, raw.y, cfg, split_rng)
    return replace(raw.take(train), test=test)


def _allocate(
    cfg: DataConfig, raw: _Raw, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns ``(silo, subject, num_silos)``."""
    n, alloc, num_silos = len(raw.y), cfg.allocation, cfg.num_silos
    if alloc == "uldp_uniform":
        subject, silo = part.uldp_uniform(
            n, num_subjects=cfg.num_subjects, num_silos=num_silos, rng=rng
        )
        return silo, subject, num_silos
    if alloc == "zipf":
        subject, silo = part.uldp_zipf(
            n,
            num_subjects=cfg.num_subjects,
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
            silo, num_subjects=cfg.num_subjects, alpha=cfg.zipf_alpha1, rng=rng
        )
        return silo, subject, num_silos
    if raw.subject is not None:
        subject = raw.subject
    else:
        subject = part.assign_subjects(
            raw.y,
            num_subjects=cfg.num_subjects,
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
            raise ValueError("allocation='column' needs a table silo_column.")
        silo, num_silos = raw.silo, raw.num_table_silos
    return silo, subject, num_silos


def build_federated_data(cfg: DataConfig) -> FederatedData:
    """Loads ``cfg.source`` and places its training records on subjects and silos.

    All randomness derives from ``cfg.seed`` (independent streams for the test split, the
    subsample, the allocation and synthetic data), so equal configs give equal data.
    """
    if not isinstance(cfg, DataConfig):
        raise ValueError(f"Expected a DataConfig, got {type(cfg).__name__}.")
    streams = np.random.SeedSequence(cfg.seed).spawn(5)
    split_rng, sub_rng, alloc_rng, data_rng, test_rng = (np.random.default_rng(s) for s in streams)
    raw = _load(cfg, split_rng, data_rng)
    if cfg.max_records is not None and cfg.max_records < len(raw.y):
        raw = raw.take(np.sort(sub_rng.choice(len(raw.y), cfg.max_records, replace=False)))
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
    train: FederatedDataset = part.assemble(
        raw.x,
        raw.y,
        silo=silo,
        subject=subject,
        num_classes=raw.num_classes,
        num_silos=num_silos,
        subject_names=raw.subject_names,
    )
    if cfg.first_subjects is not None:
        train = part.first_subjects(train, cfg.first_subjects)
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
    return FederatedData(train=train, test=test, name=_name(cfg, train.num_silos))


def _name(cfg: DataConfig, num_silos: int) -> str:
    details: dict[str, Any] = {
        "power": f"a{cfg.alpha:g}",
        "dirichlet": f"b{cfg.dirichlet_beta:g}",
        "zipf": f"a{cfg.zipf_alpha1:g},{cfg.zipf_alpha2:g}",
    }
    alloc = cfg.allocation + (f"({details[cfg.allocation]})" if cfg.allocation in details else "")
    return f"{cfg.source}-{alloc}-{num_silos}silos"
