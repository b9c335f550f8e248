"""The typed data configuration, :class:`DataConfig`, and the choices it accepts.

:func:`silodp.data.build.build_federated_data` turns a :class:`DataConfig` into a
:class:`~silodp.data.dataset.FederatedData`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from silodp._validation import check_choice, check_in_range, check_int, check_positive
from silodp.data import scaling as sc
from silodp.data.loaders import check_label_columns
from silodp.errors import InvalidValueError

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_NUM_SUBJECTS",
    "SOURCES",
    "SYNTHETIC_RECORDS",
    "TEST_SPLITS",
    "DataConfig",
]

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
#: ``num_subjects`` where subjects are drawn and the config does not say.
DEFAULT_NUM_SUBJECTS = 100
#: the largest seed (what a TOML integer holds)
MAX_SEED = 2**63 - 1
#: the most values ``source="synthetic"`` generates (records x features, classes x features)
MAX_SYNTHETIC_VALUES = 10**8
TEST_SPLITS = ("record", "subject")


def _optional_int(name: str, value: int | None, lo: int) -> None:
    if value is not None:
        check_int(name, value, lo)


@dataclass(frozen=True)
class DataConfig:
    """What data to load, how to split and scale it, and how to spread it over silos and
    subjects.

    Subjects. LEAF users and a table's ``subject_column`` are the subjects. A table without
    a ``subject_column`` has no information about who a record belongs to, so each record
    is its own subject (group size 1) and ``num_subjects`` is refused: drawing subjects
    would make a subject-level ε describe people who do not exist. ``simulated_subjects =
    true`` draws ``num_subjects`` simulated subjects for such a table instead (as ULDP-FL's
    tabular experiments do with ``allocation = "fixed_silo"``); the description then says
    they are simulated. Image and synthetic sources always draw their subjects
    (``num_subjects``, default 100) for the training records.

    Silos. With ``allocation="column"`` the table's ``silo_column`` defines the silos and
    ``num_silos`` is not used. ``fixed_silo`` draws subjects (Zipf(``zipf_alpha1``), 80% in a
    main silo) over silos from ``silo_column`` if set, else over uniformly random silos. For
    ``synthetic``, ``max_records`` (default 2,000) is the number of generated records before
    the test split.

    Test split. Fashion-MNIST keeps its own test set and ``test_path`` names a test file
    (LEAF, tables); otherwise ``test_fraction`` of the data is held out before anything else:

    * ``test_split = "record"``: ``round(test_fraction · count)`` records of each label go to
      the test side (stratified). One subject's records can land on both sides.
    * ``test_split = "subject"``: ``round(test_fraction · subjects)`` whole subjects, chosen
      uniformly at random (independently of the labels), go to the test side with all
      their records; no subject is on both sides. Needs the subjects before the split (a
      table's subject column or records, LEAF users). When subjects hold very different
      numbers of records, the test share of *records* can differ from ``test_fraction``
      (``describe`` reports both counts).

    The default is ``"subject"`` for a table with a ``subject_column`` and ``"record"``
    otherwise (drawn subjects exist only for training records; a table without a subject
    column has one subject per record, so its record split already holds out whole
    subjects). The split depends only on the data and ``seed``.

    Classes. A table's model has one output per class, so the class list is part of what
    every run releases. ``label_values`` declares it (public, e.g. from a data dictionary;
    the model's outputs follow its order, and a label outside it is an error). Without it
    the classes are the distinct labels found in the table, sorted: then whether a record
    with a rare label took part shows in the released model, which no ε covers, so a
    private run refuses such a table (``fedavg`` and σ = 0 runs accept it).

    Feature scaling (tables only; the same transform for training and test records):

    * ``scaling = "none"`` (default): raw values. When the feature columns' scales (root
      mean square) differ by a factor of 100 or more, the loader logs a warning naming the
      columns (:func:`silodp.data.scaling.scale_warning`).
    * ``"bounds"``: public ``feature_bounds`` (``[lo, hi]`` for every feature or one pair
      per feature column) map each feature to [-1, 1]; values outside are clipped.
    * ``"standard"``: ``(x - feature_mean) / feature_std`` with public constants (a number or
      one per feature column).
    * ``"dp"``: mean and std estimated with DP across the silos
      (:func:`silodp.data.scaling.dp_feature_stats`); needs ``feature_bounds``.
      :func:`~silodp.data.build.build_federated_data` then returns *unscaled* data: the
      runner calibrates the estimate's noise to spend ``scaling_budget`` (a fraction in
      (0, 0.5]) of the run's ε, and applies the resulting
      :class:`~silodp.data.scaling.FeatureStats`.
    """

    source: str = "digits"
    path: str | None = None
    test_path: str | None = None
    test_fraction: float = 0.2
    test_split: str | None = None
    num_silos: int = 5
    num_subjects: int | None = None
    simulated_subjects: bool = False
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
    label_values: tuple[Any, ...] | None = None
    silo_column: str | None = None
    subject_column: str | None = None
    scaling: str = "none"
    feature_bounds: tuple[float, float] | tuple[tuple[float, float], ...] | None = None
    feature_mean: float | tuple[float, ...] | None = None
    feature_std: float | tuple[float, ...] | None = None
    scaling_budget: float = 0.1
    #: ``source = "synthetic"`` only (default 20 and 4); the other sources fix their own
    num_features: int | None = None
    num_classes: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("source", self.source, SOURCES)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        for key in ("path", "test_path"):
            value = getattr(self, key)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, key, value)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidValueError(
                    f"Expected {key}={value!r} to be a file or directory path (a string)."
                )
        is_table = self.source == "table"
        if self.source in ("leaf_femnist", "leaf_shakespeare", "table") and not self.path:
            raise InvalidValueError(
                f"Expected a path for source={self.source!r}, got {self.path!r}."
            )
        if self.source in ("digits", "synthetic") and self.path is not None:
            raise InvalidValueError(
                f"Expected path=None for source={self.source!r}, got {self.path!r}."
            )
        if self.test_path is not None and self.source not in (
            "leaf_femnist",
            "leaf_shakespeare",
            "table",
        ):
            raise InvalidValueError(
                f"Expected test_path=None for source={self.source!r} (only LEAF and table "
                f"sources read a test file), got {self.test_path!r}."
            )
        check_in_range("test_fraction", self.test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        check_int("num_silos", self.num_silos, 1)
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
            raise InvalidValueError(
                f"Expected feature_columns={self.feature_columns!r} to be a sequence of names."
            )
        object.__setattr__(self, "feature_columns", tuple(self.feature_columns))
        blank = [c for c in self.feature_columns if not c]
        repeated = sorted({c for c in self.feature_columns if self.feature_columns.count(c) > 1})
        if blank or repeated:
            raise InvalidValueError(
                f"Expected distinct, non-empty names in feature_columns="
                f"{list(self.feature_columns)!r}; got {repeated or blank!r}."
            )
        if not isinstance(self.label_column, str) or not self.label_column:
            raise InvalidValueError(
                f"Expected label_column={self.label_column!r} to be a column name."
            )
        self._check_label_values()
        for name in ("silo_column", "subject_column"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidValueError(f"Expected {name}={value!r} to be a column name or None.")
        if not is_table:
            for name in ("silo_column", "subject_column"):
                if getattr(self, name) is not None:
                    raise InvalidValueError(
                        f"Expected {name}=None for source={self.source!r} (tables only)."
                    )
            if self.feature_columns:
                raise InvalidValueError(
                    f"Expected feature_columns=() for source={self.source!r} (tables only)."
                )
        check_label_columns(self.label_column, self.silo_column, self.subject_column)
        for name, default, lo in (("num_features", 20, 1), ("num_classes", 4, 2)):
            value = getattr(self, name)
            if self.source != "synthetic":
                if value is not None:
                    hint = (
                        " (a table declares its classes with label_values)"
                        if (name == "num_classes" and is_table)
                        else ""
                    )
                    raise InvalidValueError(
                        f"Expected {name} unset for source={self.source!r}, whose data fix it; "
                        f"got {name}={value!r} (it applies to source='synthetic' only){hint}."
                    )
                continue
            object.__setattr__(self, name, default if value is None else value)
            check_int(name, getattr(self, name), lo)
        check_int("seed", self.seed, 0, MAX_SEED)
        if self.source == "synthetic":
            self._check_synthetic()
        self._check_subjects()
        self._check_split()
        self._check_scaling()
        self._check_allocation()

    def _check_label_values(self) -> None:
        """``label_values``: a table's public list of classes (one model output each, in this
        order), at least two distinct values of one kind (integers, strings or booleans)."""
        values = self.label_values
        if values is None:
            return
        if self.source != "table":
            raise InvalidValueError(
                f"Expected label_values=None for source={self.source!r} (tables only: the "
                f"other sources have their classes fixed), got {values!r}."
            )
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise InvalidValueError(
                f"Expected label_values={values!r} to be a list of class labels."
            )
        kinds = {type(v) for v in values}
        if len(values) < 2 or len(kinds) != 1 or not kinds <= {int, str, bool}:
            raise InvalidValueError(
                f"Expected label_values={list(values)!r} to list at least 2 class labels, "
                "all integers, all strings or all booleans."
            )
        repeated = sorted({v for v in values if values.count(v) > 1}, key=str)
        if repeated:
            raise InvalidValueError(
                f"Expected distinct label_values; {repeated!r} repeated in {list(values)!r}."
            )
        object.__setattr__(self, "label_values", tuple(values))

    def _check_synthetic(self) -> None:
        records = self.max_records if self.max_records is not None else SYNTHETIC_RECORDS
        assert self.num_features is not None and self.num_classes is not None
        for what, count in (
            ("max_records", records * self.num_features),
            ("num_classes", self.num_classes * self.num_features),
        ):
            if count > MAX_SYNTHETIC_VALUES:
                raise InvalidValueError(
                    f"Expected {what} x num_features <= {MAX_SYNTHETIC_VALUES} values for "
                    f"source='synthetic', got {count} ({what}="
                    f"{records if what == 'max_records' else self.num_classes}, "
                    f"num_features={self.num_features})."
                )
        if self.num_classes > records:
            raise InvalidValueError(
                f"Expected num_classes={self.num_classes} <= max_records={records} for "
                "source='synthetic' (each class needs records)."
            )

    def _check_subjects(self) -> None:
        if not isinstance(self.simulated_subjects, bool):
            raise InvalidValueError(
                f"Expected simulated_subjects={self.simulated_subjects!r} to be true or false."
            )
        if self.simulated_subjects and (self.source != "table" or self.subject_column):
            raise InvalidValueError(
                f"simulated_subjects=True applies to a table without a subject_column only, got "
                f"source={self.source!r}, subject_column={self.subject_column!r}."
            )
        if self.num_subjects is not None:
            check_int("num_subjects", self.num_subjects, 1)
        if self.num_subjects is not None and self.subjects_from in ("column", "leaf_users"):
            raise InvalidValueError(
                f"Expected num_subjects unset: the subjects come from the data "
                f"({'the subject_column' if self.subjects_from == 'column' else 'LEAF users'}), "
                f"so num_subjects={self.num_subjects} would be ignored; first_subjects keeps "
                "the first ones."
            )
        if self.subjects_from == "records" and self.num_subjects is not None:
            raise InvalidValueError(
                f"num_subjects={self.num_subjects} would invent subjects: the table has no "
                "subject_column, so each record is its own subject. Remove num_subjects, give "
                "the subject_column, or set simulated_subjects = true to draw simulated "
                "subjects (a subject-level ε then describes simulated people)."
            )
        if self.subjects_from == "simulated" and self.num_subjects is None:
            object.__setattr__(self, "num_subjects", DEFAULT_NUM_SUBJECTS)

    def _check_split(self) -> None:
        from_file = self.test_path is not None or self.source == "fashion_mnist"
        if from_file:
            if self.test_split is not None:
                where = f"test_path={self.test_path!r}" if self.test_path else "Fashion-MNIST"
                raise InvalidValueError(
                    f"Expected test_split=None with {where}: the test records come from the "
                    f"test file, got test_split={self.test_split!r}."
                )
            return
        if self.test_split is None:
            default = "subject" if self.subjects_from == "column" else "record"
            object.__setattr__(self, "test_split", default)
        check_choice("test_split", str(self.test_split), TEST_SPLITS)
        if self.test_split == "subject" and self.subjects_from == "simulated":
            raise InvalidValueError(
                f"test_split='subject' needs the subjects before the split (a table's "
                f"subject_column or its records, LEAF users), but source={self.source!r} "
                "draws simulated subjects for the training records after the split; use "
                "test_split='record'."
            )

    def _check_scaling(self) -> None:
        check_choice("scaling", self.scaling, sc.SCALINGS)
        check_in_range("scaling_budget", self.scaling_budget, 0.0, 0.5, lo_open=True)
        if self.scaling != "none" and self.source != "table":
            raise InvalidValueError(
                f"Expected scaling='none' for source={self.source!r}, got "
                f"scaling={self.scaling!r} (feature scaling is for tables)."
            )
        uses = {
            "feature_bounds": ("bounds", "dp"),
            "feature_mean": ("standard",),
            "feature_std": ("standard",),
        }
        for key, scalings in uses.items():
            value = getattr(self, key)
            if value is None and self.scaling in scalings:
                raise InvalidValueError(
                    f"scaling={self.scaling!r} needs {key} (public constants), got {key}=None."
                )
            if value is not None and self.scaling not in scalings:
                raise InvalidValueError(
                    f"{key}={value!r} is only used with scaling in {scalings}, got "
                    f"scaling={self.scaling!r}."
                )
        counts: dict[str, int] = {}
        if self.feature_bounds is not None:
            bounds = sc.check_bounds("feature_bounds", self.feature_bounds)
            object.__setattr__(self, "feature_bounds", bounds)
            if isinstance(bounds[0], tuple):
                counts["feature_bounds"] = len(bounds)
        for key in ("feature_mean", "feature_std"):
            value = getattr(self, key)
            if value is not None:
                checked = sc.check_per_feature(key, value, positive=key == "feature_std")
                object.__setattr__(self, key, checked)
                if isinstance(checked, tuple):
                    counts[key] = len(checked)
        if self.feature_columns:
            for key, count in counts.items():
                if count not in (1, len(self.feature_columns)):
                    raise InvalidValueError(
                        f"Expected {key}={getattr(self, key)!r} to give one value for all "
                        f"features or {len(self.feature_columns)} (one per feature column "
                        f"{list(self.feature_columns)}), got {count}."
                    )
        if len(set(counts.values())) > 1:
            raise InvalidValueError(
                f"Expected per-feature scaling constants of equal length, got {counts}."
            )

    def _check_allocation(self) -> None:
        alloc = self.allocation
        if self.train_per_client is not None and alloc != "dirichlet":
            raise InvalidValueError(
                f"Expected train_per_client=None unless allocation='dirichlet', got "
                f"train_per_client={self.train_per_client} with allocation={alloc!r}."
            )
        if self.test_per_client is not None and alloc not in ("shards", "dirichlet"):
            raise InvalidValueError(
                f"Expected test_per_client=None unless allocation is 'shards' or 'dirichlet', "
                f"got test_per_client={self.test_per_client} with allocation={alloc!r}."
            )
        if alloc == "column" and (self.source != "table" or self.silo_column is None):
            raise InvalidValueError(
                "Expected allocation='column' only with source='table' and a silo_column, got "
                f"source={self.source!r}, silo_column={self.silo_column!r}."
            )
        if self.silo_column is not None and alloc not in ("column", "fixed_silo"):
            raise InvalidValueError(
                f"silo_column={self.silo_column!r} is only used by allocation='column' or "
                f"'fixed_silo', got allocation={alloc!r}."
            )
        if self.subjects_from == "records" and alloc in _DRAW_SUBJECTS:
            raise InvalidValueError(
                f"allocation={alloc!r} draws simulated subjects, but the table has no "
                "subject_column, so each record is its own subject. Give the subject_column, "
                f"use one of {', '.join(_KEEP_SUBJECTS)}, or set simulated_subjects = true to "
                "draw simulated subjects (a subject-level ε then describes simulated people)."
            )
        if self.has_natural_subjects and alloc not in _KEEP_SUBJECTS:
            raise InvalidValueError(
                f"allocation={alloc!r} draws its own subjects, but source={self.source!r} "
                f"already has subjects; expected one of {', '.join(_KEEP_SUBJECTS)}."
            )
        if self.labels_per_subject is not None:
            if self.has_natural_subjects or alloc in _DRAW_SUBJECTS:
                raise InvalidValueError(
                    f"labels_per_subject={self.labels_per_subject} needs subjects drawn by "
                    f"assign_subjects; it does not apply to source={self.source!r} with "
                    f"allocation={alloc!r}."
                )

    @property
    def subjects_from(self) -> str:
        """Where subjects come from: ``"column"`` (a table's subject column), ``"records"``
        (a table without one: each record is its own subject), ``"leaf_users"`` or
        ``"simulated"`` (drawn by the allocation)."""
        if self.source.startswith("leaf_"):
            return "leaf_users"
        if self.source == "table":
            if self.subject_column is not None:
                return "column"
            return "simulated" if self.simulated_subjects else "records"
        return "simulated"

    @property
    def has_natural_subjects(self) -> bool:
        """Whether subjects come from the data (LEAF users, a table's subject column or, for
        a table without one, its records)."""
        return self.subjects_from != "simulated"

    @property
    def subjects_note(self) -> str:
        """One line saying what a subject is under this config."""
        origin = self.subjects_from
        if origin == "column":
            return f"subject column {self.subject_column!r}: one subject per distinct value"
        if origin == "records":
            return "no subject column: each record is its own subject"
        if origin == "leaf_users":
            return "LEAF users"
        drawn = f"simulated: {self.num_subjects} subjects drawn for the training records"
        return drawn + ("; not people in the table" if self.source == "table" else "")
