"""Experiment configuration: parsed once from TOML into frozen dataclasses.

A config file has a top-level ``name`` and ``algorithms`` list and the tables ``[data]``
(:class:`~silodp.data.build.DataConfig`), ``[model]``, ``[training]`` and ``[privacy]``;
``[algorithm.NAME]`` tables override training/privacy keys for one algorithm. A ``[sweep]``
table (:class:`SweepConfig`, PriFedSync only) runs a grid of settings and tabulates the rounds
each needs to reach a target accuracy. A ``[tracking]`` table (:class:`TrackingConfig`) also
logs every run to MLflow and/or TensorBoard. Unknown keys are errors (a typo must not silently fall
back to a default).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_positive,
)
from silodp.accounting.accountant import TARGETS, UNITS
from silodp.accounting.calibrate import check_target_epsilon
from silodp.algorithms import ALGORITHMS, AlgorithmConfig, hyperparameter_tables
from silodp.data.build import DataConfig
from silodp.errors import ConfigError, InvalidValueError
from silodp.models import MODELS
from silodp.privacy.randomness import MODES

__all__ = [
    "ConfigError",
    "ExperimentConfig",
    "ModelConfig",
    "PrivacyConfig",
    "SweepCell",
    "SweepConfig",
    "TrackingConfig",
    "TrainingConfig",
    "default_config_path",
    "load_config",
    "parse_config",
    "to_toml_dict",
]


#: the most rounds a schedule may ask for (the accountant composes every one of them)
MAX_ROUNDS = 10**6
#: the largest seed (what a TOML integer holds)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "mlp"

    def __post_init__(self) -> None:
        check_choice("model.name", self.name, MODELS)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The federated training schedule (public), shared by every algorithm of a config.

    ``silos_per_round`` defaults to every silo. The algorithms' own training
    hyperparameters (``local_steps``, ``batch_size``, ``lr``, ...) sit in the same
    ``[training]`` table; each algorithm's ``Config`` declares and validates them.
    """

    rounds: int = 20
    silos_per_round: int | None = None
    seed: int = 0
    eval_every: int = 1

    def __post_init__(self) -> None:
        check_int("training.rounds", self.rounds, 1, MAX_ROUNDS)
        if self.silos_per_round is not None:
            check_int("training.silos_per_round", self.silos_per_round, 1)
        check_int("training.seed", self.seed, 0, MAX_SEED)
        check_int("training.eval_every", self.eval_every, 1)


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """The privacy target and the public bounds, shared by every algorithm of a config.

    The algorithms' own privacy hyperparameters (``clip``, ``subject_rate``, ``sampling``,
    ``weighting``, ...) sit in the same ``[privacy]`` table; each algorithm's ``Config``
    declares and validates them.

    Attributes:
      epsilon: target ε at each algorithm's calibration unit (``local_item_dp``: record; the
        subject-level algorithms: subject). When ``noise_multiplier`` is set it is no target
        (a run warns if both are given) and only ``[data] scaling = "dp"`` takes a share of
        it; a config file that sets only ``noise_multiplier`` has none.
      delta: δ of every reported ε.
      noise_multiplier: σ to use as is (skips calibration).
      span: public bound on silos per subject (default: number of silos, the worst case).
      group_size: public bound k on one subject's records in one silo (default: the largest
        count in the data after any cap); for ``uldp_group`` the bound on a subject's records
        in the whole federation, a number or ``"max"``/``"median"`` of the subjects' counts.
      noise: where every privacy-relevant coin and the noise come from: ``secure`` (default;
        the OS CSPRNG: nothing can be recomputed from the config) or ``seeded`` (reproducible
        from ``training.seed``; for tests and experiments only, never for production: anyone
        who knows the config can recompute the samples and subtract the noise).
      adversary: whom the calibrated (and headline) ε holds against: ``strongest`` (default;
        every party of the threat model), ``released`` (outsiders who see only the model),
        ``server`` or ``silos``. ε against each is reported either way.
      ledger: the privacy ledger file every run writes through (default: ``ledger.sqlite`` in
        each run's directory); runs that share one are accounted together.
      budget: ``{unit: ε}`` the ledger's total may not exceed (at the run's δ); default: the
        target ``epsilon`` at the calibration unit when σ is calibrated, else none.
    """

    epsilon: float | None = 4.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    span: int | None = None
    group_size: int | str | None = None
    noise: str = "secure"
    adversary: str = "strongest"
    ledger: str | None = None
    budget: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if self.budget is not None:
            if not isinstance(self.budget, Mapping) or not self.budget:
                raise ConfigError(
                    f"Expected privacy.budget to be a table of ε per unit, e.g. "
                    f"{{subject = 6.0}}, got {self.budget!r}."
                )
            for unit, value in self.budget.items():
                check_choice("privacy.budget unit", unit, UNITS)
                check_positive(f"privacy.budget.{unit}", value)
        check_choice("privacy.noise", self.noise, MODES)
        check_choice("privacy.adversary", self.adversary, TARGETS)
        if self.epsilon is not None:
            check_positive("privacy.epsilon", self.epsilon)
            try:  # the range calibration accepts, found before anything loads
                check_target_epsilon(self.epsilon, "privacy.epsilon")
            except InvalidValueError as err:
                raise ConfigError(str(err)) from None
        check_in_range("privacy.delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.noise_multiplier is not None:
            check_in_range(
                "privacy.noise_multiplier", self.noise_multiplier, 0.0, math.inf, hi_open=True
            )
        if self.epsilon is None and self.noise_multiplier is None:
            raise ConfigError("Expected privacy.epsilon or privacy.noise_multiplier, got neither.")
        if self.span is not None:
            check_int("privacy.span", self.span, 1)
        if isinstance(self.group_size, str):
            if self.group_size not in ("max", "median"):
                raise ConfigError(
                    f"Expected privacy.group_size={self.group_size!r} to be an integer >= 1 or "
                    "one of 'max', 'median'."
                )
        elif self.group_size is not None:
            check_int("privacy.group_size", self.group_size, 1)
        if self.ledger is not None and (not isinstance(self.ledger, str) or not self.ledger):
            raise ConfigError(f"Expected privacy.ledger={self.ledger!r} to be a file path.")


@dataclass(frozen=True)
class SweepCell:
    """One setting of a sweep: the values it sets (``None``: the base config's)."""

    client_rate: float | None = None
    noise_multiplier: float | None = None
    batch_size: int | None = None
    local_steps: int | None = None

    def label(self, settings: Mapping[str, Any], privacy: PrivacyConfig) -> str:
        """A directory-safe name of the cell, e.g. ``p0.5_sigma0.9_B16_K38``, from the
        algorithm's ``settings`` (its config's fields) and the privacy table."""
        p = self.client_rate if self.client_rate is not None else settings["client_rate"]
        sigma = (
            self.noise_multiplier if self.noise_multiplier is not None else privacy.noise_multiplier
        )
        b = self.batch_size or settings["batch_size"]
        k = self.local_steps or settings["local_steps"]
        noise = f"sigma{sigma:g}" if sigma is not None else f"eps{privacy.epsilon:g}"
        return f"p{p:g}_{noise}_B{b}_K{k}"

    def settings(self) -> dict[str, Any]:
        """The algorithm hyperparameters this cell sets."""
        values = {
            "client_rate": self.client_rate,
            "batch_size": self.batch_size,
            "local_steps": self.local_steps,
        }
        return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """A grid of PriFedSync runs tabulated as the paper's Tables 1–3.

    The grid is ``client_rate × noise_multiplier × batches``, where ``batches`` pairs
    ``batch_size[i]`` with ``local_steps[i]`` (so the paper's "halve B, double K" is
    ``batch_size = [16, 8]``, ``local_steps = [38, 76]``); ``local_steps`` may be left empty to
    keep ``training.local_steps``; an empty axis keeps the base value. Each run stops at the
    first round where ``target_metric`` (the mean over clients of the ``personalised`` or the
    ``global`` model's accuracy on the client's own test split) reaches ``target_accuracy``
    (``stop_at_target``), or after ``training.rounds``.
    """

    target_accuracy: float
    client_rate: tuple[float, ...] = ()
    noise_multiplier: tuple[float, ...] = ()
    batch_size: tuple[int, ...] = ()
    local_steps: tuple[int, ...] = ()
    target_metric: str = "personalised"
    stop_at_target: bool = True

    def __post_init__(self) -> None:
        check_in_range("sweep.target_accuracy", self.target_accuracy, 0.0, 1.0, lo_open=True)
        check_choice("sweep.target_metric", self.target_metric, ("personalised", "global"))
        if not isinstance(self.stop_at_target, bool):
            raise ConfigError(f"Expected sweep.stop_at_target={self.stop_at_target!r} a boolean.")
        for name in ("client_rate", "noise_multiplier", "batch_size", "local_steps"):
            values = getattr(self, name)
            if not isinstance(values, tuple):
                raise ConfigError(f"Expected sweep.{name}={values!r} to be a list.")
            if len(set(values)) != len(values) and name != "local_steps":
                raise ConfigError(f"Expected distinct values in sweep.{name}, got {list(values)}.")
        for v in self.client_rate:
            check_in_range("sweep.client_rate", v, 0.0, 1.0, lo_open=True)
        for v in self.noise_multiplier:
            check_positive("sweep.noise_multiplier", v)
        for v in self.batch_size:
            check_int("sweep.batch_size", v, 1)
        for v in self.local_steps:
            check_int("sweep.local_steps", v, 1)
        if self.local_steps and len(self.local_steps) != len(self.batch_size):
            raise ConfigError(
                f"Expected sweep.local_steps to pair with sweep.batch_size (same length), got "
                f"{len(self.local_steps)} local_steps for {len(self.batch_size)} batch sizes."
            )

    def cells(self) -> list[SweepCell]:
        """Every setting of the grid, in table order."""
        batches: list[tuple[int | None, int | None]] = (
            list(itertools.zip_longest(self.batch_size, self.local_steps))
            if self.batch_size
            else [(None, None)]
        )
        return [
            SweepCell(client_rate=p, noise_multiplier=sigma, batch_size=b, local_steps=k)
            for p, sigma, (b, k) in itertools.product(
                self.client_rate or (None,), self.noise_multiplier or (None,), batches
            )
        ]


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Where each run is also logged (see :mod:`silodp.tracking`); a key left out is off.

    Relative paths are read from the working directory (as ``data.path`` and
    ``privacy.ledger`` are).

    Attributes:
      mlflow: an MLflow store on this machine: a directory (it gets ``mlflow.db`` and the
        runs' files in ``mlartifacts/``), or ``sqlite:///PATH`` naming the database file (the
        runs' files go in ``mlartifacts/`` beside it).
      tensorboard: a TensorBoard log directory; each run writes its own subdirectory
        ``<experiment name>/<run name>``.
    """

    mlflow: str | None = None
    tensorboard: str | None = None

    def __post_init__(self) -> None:
        for key in ("mlflow", "tensorboard"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"Expected tracking.{key}={value!r} to be a path.")
        if self.mlflow is None:
            return
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", self.mlflow)
        if scheme is None:
            return
        if scheme[1].lower() == "sqlite":
            if not self.mlflow.lower().startswith("sqlite:///") or not self.mlflow[10:].strip():
                raise ConfigError(
                    f"Expected tracking.mlflow={self.mlflow!r} to name a database file, "
                    "e.g. 'sqlite:///runs/mlflow.db' (relative) or 'sqlite:////abs/mlflow.db'."
                )
            return
        if scheme[1].lower() == "file":
            raise ConfigError(
                f"Expected tracking.mlflow={self.mlflow!r} to be a directory or a "
                "'sqlite:///PATH' database: MLflow 3 refuses file stores ('file:...'); a "
                "directory path gets an SQLite store (mlflow.db) inside it."
            )
        raise ConfigError(
            f"Expected tracking.mlflow={self.mlflow!r} to be a store on this machine: a "
            f"directory or 'sqlite:///PATH', not a {scheme[1]!r} URI (silodp logs to local "
            "stores only)."
        )

    @property
    def enabled(self) -> bool:
        """Whether any run is logged anywhere."""
        return self.mlflow is not None or self.tensorboard is not None


#: keys of the [training] and [privacy] tables that the experiment (not an algorithm) reads
RUN_KEYS = {"training": {f.name for f in fields(TrainingConfig)}} | {
    "privacy": {f.name for f in fields(PrivacyConfig)}
}


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """A whole experiment: data, model, schedule, privacy, and the algorithms to compare.

    ``hyperparameters`` holds the algorithm keys of the ``[training]`` and ``[privacy]``
    tables (each algorithm takes those its ``Config`` declares); ``overrides`` the
    ``[algorithm.NAME]`` tables, which may set run keys and the algorithm's own keys.
    ``tracking``: where runs are also logged (``None``: nowhere).
    """

    name: str = "experiment"
    algorithms: tuple[str, ...] = ("fedavg",)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sweep: SweepConfig | None = None
    tracking: TrackingConfig | None = None

    def __post_init__(self) -> None:
        if self.sweep is not None and self.algorithms != ("prifedsync",):
            raise ConfigError(
                f"Expected algorithms = ['prifedsync'] with a [sweep] table, got "
                f"{list(self.algorithms)}."
            )
        if not self.algorithms:
            raise ConfigError("Expected at least one algorithm in `algorithms`, got none.")
        for name in self.algorithms:
            check_choice("algorithms", name, ALGORITHMS)
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ConfigError(f"Expected distinct algorithms, got {list(self.algorithms)}.")
        unknown = set(self.hyperparameters) - set(hyperparameter_tables())
        if unknown:
            raise ConfigError(f"Unknown hyperparameter(s) {sorted(unknown)}.")
        for name, table in self.overrides.items():
            if name not in self.algorithms:
                raise ConfigError(
                    f"Expected [algorithm.{name}] to name one of the listed algorithms "
                    f"{list(self.algorithms)}."
                )
            own = set(ALGORITHMS[name].Config.tables())
            allowed = RUN_KEYS["training"] | RUN_KEYS["privacy"] | own
            unknown = set(table) - allowed
            if unknown:
                raise ConfigError(
                    f"Unknown key(s) {sorted(unknown)} in [algorithm.{name}]; expected keys of "
                    f"[training] or [privacy] that {name} reads: {sorted(allowed)}."
                )
            units = ALGORITHMS[name].units
            unaccounted = sorted(set(table.get("budget") or {}) - set(units))
            if unaccounted:
                raise ConfigError(
                    f"Expected [algorithm.{name}] budget units among those {name} reports "
                    f"({', '.join(units) or 'none'}), got {', '.join(unaccounted)}: it bounds "
                    "no ε there, so a budget on it would never stop the run."
                )
        if self.privacy.budget:
            reported = {u for name in self.algorithms for u in ALGORITHMS[name].units}
            unreported = sorted(set(self.privacy.budget) - reported)
            if unreported:
                raise ConfigError(
                    f"Expected privacy.budget units among those the listed algorithms report "
                    f"({', '.join(sorted(reported)) or 'none'}), got {', '.join(unreported)}: "
                    "a budget on a unit no run accounts would never stop one."
                )
        if (
            self.training.silos_per_round is not None
            and self.training.silos_per_round > self.data.num_silos
            and self.data.allocation != "column"
        ):
            raise ConfigError(
                f"Expected training.silos_per_round={self.training.silos_per_round} <= "
                f"data.num_silos={self.data.num_silos}."
            )
        # validate every value now, not mid-run: the shared keys for every algorithm that
        # reads them, and each listed algorithm with its overrides
        for cls in ALGORITHMS.values():
            if set(cls.Config.tables()) & set(self.hyperparameters):
                cls.Config.from_settings(self.hyperparameters)
        for name in self.algorithms:
            self.for_algorithm(name)
            self.algorithm_config(name)
        for cell in self.sweep.cells() if self.sweep is not None else ():
            self.for_cell(cell)

    def with_ledger(self, path: str) -> ExperimentConfig:
        """This config with every run writing through the ledger at ``path`` (``--ledger``:
        it replaces ``[privacy] ledger`` and every ``[algorithm.NAME] ledger``, so no run
        spends on a ledger whose budget was not checked)."""
        overrides = {
            name: {k: v for k, v in table.items() if k != "ledger"}
            for name, table in self.overrides.items()
        }
        return dataclasses.replace(
            self, privacy=dataclasses.replace(self.privacy, ledger=path), overrides=overrides
        )

    def with_absolute_ledgers(self, base: str | Path | None = None) -> ExperimentConfig:
        """This config with its ledger paths made absolute (relative ones are read from
        ``base``, by default the working directory): the config an experiment writes then
        names the same ledgers wherever it is resumed from."""

        def absolute(path: str) -> str:
            return _absolute(path, base)

        privacy = self.privacy
        if privacy.ledger is not None:
            privacy = dataclasses.replace(privacy, ledger=absolute(privacy.ledger))
        overrides = {
            name: {k: absolute(v) if k == "ledger" and v is not None else v for k, v in t.items()}
            for name, t in self.overrides.items()
        }
        return dataclasses.replace(self, privacy=privacy, overrides=overrides)

    def ledgers(self) -> list[str]:
        """The shared ledgers the runs of this config write through (global and per
        algorithm), each once."""
        found = (self.for_algorithm(name)[1].ledger for name in self.algorithms)
        return list(dict.fromkeys(p for p in found if p is not None))

    def for_cell(self, cell: SweepCell) -> ExperimentConfig:
        """This (PriFedSync) config with a sweep cell's values applied and no sweep."""
        training, privacy = self.for_algorithm("prifedsync")
        if cell.noise_multiplier is not None:
            privacy = dataclasses.replace(
                privacy, noise_multiplier=cell.noise_multiplier, epsilon=None
            )
        return dataclasses.replace(
            self,
            training=training,
            privacy=privacy,
            hyperparameters={**self.algorithm_settings("prifedsync"), **cell.settings()},
            overrides={},
            sweep=None,
        )

    def for_algorithm(self, name: str) -> tuple[TrainingConfig, PrivacyConfig]:
        """The run settings (schedule, target, bounds) of ``name`` with its overrides."""
        table = dict(self.overrides.get(name, {}))
        training = dataclasses.replace(
            self.training, **{k: v for k, v in table.items() if k in RUN_KEYS["training"]}
        )
        privacy_table = {k: v for k, v in table.items() if k in RUN_KEYS["privacy"]}
        if "noise_multiplier" in privacy_table and "epsilon" not in privacy_table:
            privacy_table["epsilon"] = None
        privacy = dataclasses.replace(self.privacy, **privacy_table)
        return training, privacy

    def algorithm_settings(self, name: str) -> dict[str, Any]:
        """The hyperparameters ``name`` reads: the shared keys, then its overrides."""
        own = ALGORITHMS[name].Config.tables()
        merged = {k: v for k, v in self.hyperparameters.items() if k in own}
        merged.update({k: v for k, v in self.overrides.get(name, {}).items() if k in own})
        return merged

    def algorithm_config(self, name: str, **resolved: Any) -> AlgorithmConfig:
        """``name``'s ``Config`` from this file, with ``resolved`` values (σ, the group bound,
        the number of silos) that the experiment determines."""
        return ALGORITHMS[name].Config.from_settings({**self.algorithm_settings(name), **resolved})


#: keys that were replaced, with what to write instead
RENAMED = {
    "secure_noise": 'noise = "secure" (the default) or noise = "seeded" (reproducible, '
    "not for production)",
}


def _split_table(table: Any, section: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A [training] or [privacy] table split into (run keys, algorithm hyperparameters)."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"Expected [{section}] to be a table, got {type(table).__name__}.")
    algorithm_keys = {k for k, t in hyperparameter_tables().items() if t == section}
    run = {k: v for k, v in table.items() if k in RUN_KEYS[section]}
    hyper = {k: v for k, v in table.items() if k in algorithm_keys}
    unknown = set(table) - set(run) - set(hyper)
    for old, new in RENAMED.items():
        if old in unknown:
            raise ConfigError(f"[{section}] {old} is no longer a key; use {new}.")
    if unknown:
        raise ConfigError(
            f"Unknown key(s) {sorted(unknown)} in [{section}]; expected some of "
            f"{sorted(RUN_KEYS[section] | algorithm_keys)}."
        )
    return run, {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}


def _build(cls: type, table: Any, section: str) -> Any:
    if not isinstance(table, Mapping):
        raise ConfigError(f"Expected [{section}] to be a table, got {type(table).__name__}.")
    names = {f.name for f in fields(cls)}
    unknown = set(table) - names
    if unknown:
        raise ConfigError(
            f"Unknown key(s) {sorted(unknown)} in [{section}]; expected some of {sorted(names)}."
        )
    values = dict(table)
    for f in fields(cls):
        if f.name in values and isinstance(values[f.name], list):
            values[f.name] = tuple(values[f.name])
    try:
        return cls(**values)
    except TypeError as err:
        raise ConfigError(f"Bad value in [{section}]: {err}") from err
    except ConfigError:
        raise
    except InvalidValueError as err:  # a check of the table's class: say which table
        raise ConfigError(f"[{section}] {err}") from None


def _check_integers(value: Any, where: str) -> None:
    """Refuses an integer a TOML file cannot hold (beyond 64 bits), naming its key."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_integers(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list | tuple):
        for item in value:
            _check_integers(item, where)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SEED:
        raise ConfigError(
            f"Expected {where} within the 64-bit integers TOML holds, got a "
            f"{value.bit_length()}-bit integer."
        )


def parse_config(raw: Mapping[str, Any]) -> ExperimentConfig:
    """Builds an :class:`ExperimentConfig` from a parsed TOML mapping.

    Raises:
      ConfigError: an unknown key, a value of the wrong type or out of range (the message
        names the key as written in the file and the value).
    """
    top = {
        "name",
        "algorithms",
        "data",
        "model",
        "training",
        "privacy",
        "algorithm",
        "sweep",
        "tracking",
    }
    if not isinstance(raw, Mapping):
        raise ConfigError(f"Expected a config table, got {type(raw).__name__}.")
    unknown = set(raw) - top
    if unknown:
        hint = (
            " This looks like a sweep file: run it with `silodp sweep`."
            if unknown & {"base", "grid", "seeds"}
            else ""
        )
        raise ConfigError(
            f"Unknown top-level key(s) {sorted(unknown)}; expected {sorted(top)}.{hint}"
        )
    _check_integers(raw, "")
    algorithms = raw.get("algorithms", ["fedavg"])
    if isinstance(algorithms, str):
        algorithms = [algorithms]
    if not isinstance(algorithms, list) or not all(isinstance(a, str) for a in algorithms):
        raise ConfigError(f"Expected `algorithms` to be a list of names, got {algorithms!r}.")
    name = raw.get("name", "experiment")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"Expected `name` to be a non-empty string, got {name!r}.")
    overrides = raw.get("algorithm", {})
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"Expected [algorithm.NAME] tables, got algorithm = {overrides!r:.80}.")
    for key, table in overrides.items():
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"Expected [algorithm.{key}] to be a table of keys, got {table!r:.80}."
            )
    try:
        training, training_hyper = _split_table(raw.get("training", {}), "training")
        privacy, privacy_hyper = _split_table(raw.get("privacy", {}), "privacy")
        if "noise_multiplier" in privacy and "epsilon" not in privacy:
            privacy["epsilon"] = None  # σ as given: no default target ε
        tracking = _build(TrackingConfig, raw.get("tracking", {}), "tracking")
        return ExperimentConfig(
            name=name,
            algorithms=tuple(algorithms),
            data=_build(DataConfig, raw.get("data", {}), "data"),
            model=_build(ModelConfig, raw.get("model", {}), "model"),
            training=_build(TrainingConfig, training, "training"),
            privacy=_build(PrivacyConfig, privacy, "privacy"),
            hyperparameters={**training_hyper, **privacy_hyper},
            overrides={k: dict(v) for k, v in overrides.items()},
            sweep=_build(SweepConfig, raw["sweep"], "sweep") if "sweep" in raw else None,
            tracking=tracking if tracking.enabled else None,
        )
    except ConfigError:
        raise
    except (ValueError, TypeError, OverflowError) as err:
        raise ConfigError(str(err)) from err


def _absolute(path: str, base: str | Path | None) -> str:
    """``path`` made absolute: a relative one is read from ``base`` (default: the working
    directory)."""
    found = Path(path).expanduser()
    if found.is_absolute():
        return str(found)
    return str(Path(base) / found if base is not None else found.absolute())


def _with_paths_from(config: ExperimentConfig, base: str | Path) -> ExperimentConfig:
    """``config`` with its relative data and tracking paths read from ``base``."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else _absolute(path, base)

    data, tracking = config.data, config.tracking
    if tracking is not None:
        mlflow = tracking.mlflow
        if mlflow is not None and mlflow.lower().startswith("sqlite:///"):
            mlflow = "sqlite:///" + _absolute(mlflow[10:], base)  # sqlite:////abs/path
        else:
            mlflow = absolute(mlflow)
        tracking = dataclasses.replace(
            tracking, mlflow=mlflow, tensorboard=absolute(tracking.tensorboard)
        )
    return dataclasses.replace(
        config,
        data=dataclasses.replace(
            data, path=absolute(data.path), test_path=absolute(data.test_path)
        ),
        tracking=tracking,
    )


def load_config(
    path: str | Path, *, written: bool = False, base: str | Path | None = None
) -> ExperimentConfig:
    """Reads and validates a TOML experiment config; its ledger paths are made absolute
    (read from the working directory). ``written``: one an experiment wrote when it started
    (``--resume`` reads it), where an older silodp also wrote defaults it no longer accepts
    (``num_features = 20``, ``num_classes = 4`` for a source that fixes its own); those are
    left out, and its paths are kept as written. ``base``: the directory relative paths
    (ledgers, ``data.path``, ``data.test_path`` and ``tracking``) are read from, in place of
    the working directory, e.g. the user's directory where another process (a federation's
    ServerApp) runs the config; those paths are then made absolute."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Expected a config file at {str(path)!r}; it does not exist.")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"Config {str(path)!r} is not valid TOML: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"Config {str(path)!r} is not UTF-8 text: {err}") from err
    if not raw:
        raise ConfigError(
            f"Config {str(path)!r} sets nothing; expected at least `algorithms = [...]` (silodp "
            "run without a CONFIG runs the built-in demo)."
        )
    data = raw.get("data")
    if written and isinstance(data, dict) and data.get("source", "digits") != "synthetic":
        for key, default in (("num_features", 20), ("num_classes", 4)):
            if data.get(key) == default:
                del data[key]
    config = parse_config(raw)
    if not written:  # a written config keeps the ledger paths its experiment started with
        config = config.with_absolute_ledgers(base)
    if base is not None:
        config = _with_paths_from(config, base)
    _check_data_paths(config.data, path)
    return config


def _check_data_paths(data: DataConfig, config_path: Path) -> None:
    """Refuses a ``[data]`` path or test_path that does not exist (relative paths are read
    from the working directory), before any run starts."""
    for key in ("path", "test_path"):
        value = getattr(data, key)
        if value is None or Path(value).exists():
            continue
        where = "" if Path(value).is_absolute() else f" (relative to {str(Path.cwd())!r})"
        raise ConfigError(
            f"Expected data.{key}={value!r} in {str(config_path)!r} to be an existing file or "
            f"directory; it does not exist{where}."
        )


def default_config_path() -> Path:
    """The built-in demo config shipped with the package."""
    return Path(str(resources.files("silodp") / "defaults" / "demo.toml"))


def _clean(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _clean(getattr(value, f.name))
            for f in fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, tuple | list):
        return [_clean(v) for v in value]
    return value


def to_toml_dict(config: ExperimentConfig) -> dict[str, Any]:
    """A TOML-serialisable mapping that :func:`parse_config` reads back to ``config``."""
    out = _clean(config)
    hyper = out.pop("hyperparameters", {})
    tables = hyperparameter_tables()
    for key, value in hyper.items():
        out.setdefault(tables[key], {})[key] = value
    overrides = out.pop("overrides", {})
    if overrides:
        out["algorithm"] = overrides
    return out
