"""Experiment tracking: each run also logged to MLflow and/or TensorBoard.

Off unless the config's ``[tracking]`` table names a store (:class:`~silodp.config.TrackingConfig`).
A run opens one :class:`Tracker` (:func:`open_run`), which logs the run's parameters, then
each round's released row as it is written (:meth:`Tracker.log_round`, the round number as
step), and at the end (:meth:`Tracker.close`) the run directory's public files and its status.

What goes out is only what the run releases anyway: the resolved config, the rows of
``metrics.jsonl`` and the public files beside them (``summary.json``, ``config.toml``,
``metrics.jsonl``, the PNG figures). Nothing under the run's silo-private directory, its
ledger or its checkpoint is ever logged: only the named top-level files of the run directory
are read.

MLflow: one MLflow experiment per experiment name (its part before the first ``/``, so that
the cells of a ``silodp sweep`` share one), one MLflow run per algorithm run, tagged with the
full experiment name, the run's name and directory. A resumed run continues its MLflow run.
MLflow's usage telemetry is turned off (``MLFLOW_DISABLE_TELEMETRY``) unless the environment
already says otherwise; local stores need no network.

TensorBoard: one subdirectory ``<experiment name>/<run name>`` of the log directory per run.
A run started afresh sets the logs of an earlier run of the same name aside (renamed
``<run name>.replaced-<UTC time>``); a resumed run appends to its own, found by the run
directory it logs (named in the file :data:`TB_RUN_KEY`), also where a later run of the same
name set it aside.

An interrupted run whose ledger was charged a round that did not complete (its summary's
``rounds_charged_not_completed``) logs that charge, at the last such round, as
``charged_epsilon/<unit>`` (and ``charged_epsilon_by_adversary/...``): the dashboard's ε is
not below the ledger's. These metrics are not rounds, so a resume still logs the round that
runs again.

The packages are imported only when a store is configured; :func:`check_installed` says
before anything trains which are missing, and :func:`check_writable` whether each store can be
created or written (both before the run writes anything).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from silodp.config import TrackingConfig
from silodp.errors import ConfigError, InvalidValueError, SilodpError
from silodp.io import check_writable_dir

__all__ = [
    "INSTALL",
    "PUBLIC_FILES",
    "TrackedRun",
    "Tracker",
    "Writer",
    "check_installed",
    "check_writable",
    "flatten",
    "mlflow_store",
    "open_run",
    "public_files",
    "round_metrics",
    "tensorboard_dir",
]

logger = logging.getLogger(__name__)

#: what installs every tracking package
INSTALL = "pip install 'silodp[tracking]'"
#: the modules each ``[tracking]`` key imports (an SQLite store needs SQLAlchemy and Alembic)
REQUIRES: dict[str, tuple[str, ...]] = {
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "tensorboard": ("tensorboard",),
}
#: the run directory's released files that are logged (with every ``*.png`` beside them)
PUBLIC_FILES = ("summary.json", "config.toml", "metrics.jsonl")
#: the database and the artifact directory of an MLflow store given as a directory
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
#: the prefix of the metrics of a charge beyond the completed rounds (not a round's row)
CHARGED = "charged_"
#: the file in a run's TensorBoard directory naming the run directory it logs (hashed)
TB_RUN_KEY = "silodp_run_key"
#: the longest parameter value MLflow stores
MAX_PARAM_LENGTH = 6000
#: MLflow's status of a run ending with each silodp status
MLFLOW_STATUS = {
    "complete": "FINISHED",
    "budget_exhausted": "FINISHED",
    "interrupted": "KILLED",
    "failed": "FAILED",
}

Row = Mapping[str, Any]


def _missing(key: str) -> list[str]:
    return [name for name in REQUIRES[key] if importlib.util.find_spec(name) is None]


def _missing_error(key: str, missing: Sequence[str], cause: str = "") -> ConfigError:
    return ConfigError(
        f"tracking.{key} needs the Python package(s) {', '.join(missing)}, which could not be "
        f"imported{cause}; install them with: {INSTALL}"
    )


def check_installed(settings: TrackingConfig | None) -> None:
    """Raises:
    ConfigError: a store is configured whose packages are not installed (the message names
      them and the command that installs them)."""
    if settings is None:
        return
    for key in REQUIRES:
        if getattr(settings, key) is not None:
            missing = _missing(key)
            if missing:
                raise _missing_error(key, missing)


#: how every SQLite database file starts
SQLITE_HEADER = b"SQLite format 3\x00"


def check_writable(settings: TrackingConfig | None) -> None:
    """Checks that every configured store can be created or written where it is, before the
    run writes anything: MLflow's database directory and artifact directory, TensorBoard's
    log directory; an existing MLflow database must be an SQLite file. Nothing is created.

    Raises:
      InvalidValueError: a store's path runs through a regular file, cannot be written, or
        names something that is not a store (the message names the ``[tracking]`` key).
    """
    if settings is None:
        return
    if settings.mlflow is not None:
        value = settings.mlflow
        uri, artifacts = mlflow_store(value)
        database = Path(uri.removeprefix("sqlite:///"))
        if value.lower().startswith("sqlite:///"):
            check_writable_dir(database.parent, name="the directory of tracking.mlflow's database")
        else:
            check_writable_dir(database.parent, name="tracking.mlflow")
        _check_database(value, database)
        check_writable_dir(artifacts, name="the artifact directory of tracking.mlflow")
    if settings.tensorboard is not None:
        logdir = Path(settings.tensorboard).expanduser().resolve()
        check_writable_dir(logdir, name="tracking.tensorboard")


def _check_database(value: str, database: Path) -> None:
    """An existing MLflow database is a regular file, readable and writable, and SQLite."""
    if not database.exists():
        return
    shown = f"Expected tracking.mlflow={value!r} to be an MLflow store silodp can write; "
    if not database.is_file():
        raise InvalidValueError(f"{shown}{str(database)!r} is not a regular file.")
    if not os.access(database, os.R_OK | os.W_OK):
        raise InvalidValueError(f"{shown}{str(database)!r} cannot be read and written.")
    with database.open("rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER:
        raise InvalidValueError(f"{shown}{str(database)!r} is not an SQLite database.")


def _require(key: str) -> None:
    """Imports the modules of ``key``, raising the same error as :func:`check_installed`."""
    if key == "mlflow":
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in REQUIRES[key]:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise _missing_error(key, [name], f" ({err})") from err


@dataclass(frozen=True)
class TrackedRun:
    """What the trackers know of one run: ``experiment`` is the config's name, ``name`` the
    run's (an algorithm, or algorithm/cell in a sweep), ``config`` its resolved config (a TOML
    mapping) and ``params`` the values worth a column of their own (``None``: not logged)."""

    experiment: str
    name: str
    run_dir: Path
    config: Mapping[str, Any]
    params: Mapping[str, Any] = field(default_factory=dict)

    def all_params(self) -> dict[str, str]:
        """``params`` and the config flattened to dotted keys, as text."""
        values = {**flatten(self.config), **self.params}
        return {k: _text(v) for k, v in values.items() if v is not None}


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - 3] + "..."


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (lists are kept as values)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def round_metrics(row: Row) -> dict[str, float]:
    """A released round row's numbers: every top-level number (``test_accuracy``,
    ``test_loss``, ...), ``epsilon/<unit>`` for each unit and
    ``epsilon_by_adversary/<adversary>/<unit>``. An ε without a finite bound (``None`` in the
    row: no guarantee) cannot be a metric's value: it is logged as
    ``epsilon_unbounded/<unit>`` (or ``epsilon_by_adversary_unbounded/...``) = 1, never left
    out; other ``None`` values are."""
    out: dict[str, float] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                out[key] = float(value)

    def epsilon(prefix: str, key: str, value: Any) -> None:
        if value is None or (isinstance(value, float) and math.isinf(value)):
            out[f"{prefix}_unbounded/{key}"] = 1.0
        else:
            add(f"{prefix}/{key}", value)

    for key, value in row.items():
        if key == "round":
            continue
        if key == "epsilon" and isinstance(value, Mapping):
            for unit, eps in value.items():
                epsilon("epsilon", unit, eps)
        elif key == "epsilon_by_adversary" and isinstance(value, Mapping):
            for who, units in value.items():
                for unit, eps in (units or {}).items():
                    epsilon("epsilon_by_adversary", f"{who}/{unit}", eps)
        else:
            add(key, value)
    return out


def float32_up(value: float) -> float:
    """The smallest float32 at or above ``value`` (TensorBoard stores scalars as float32, which
    rounds to nearest and could show an ε below the one computed)."""
    import numpy as np

    single = np.float32(value)
    if float(single) < value:
        single = np.nextafter(single, np.float32(np.inf))
    return float(single)


def public_files(run_dir: Path) -> list[Path]:
    """The run directory's released files: :data:`PUBLIC_FILES` and the PNG figures at its
    top level (never a subdirectory, so never the silo-private one)."""
    if not run_dir.is_dir():
        return []
    return sorted(
        p
        for p in run_dir.iterdir()
        if p.is_file() and (p.name in PUBLIC_FILES or p.suffix.lower() == ".png")
    )


def _status_of(err: BaseException) -> str:
    """``interrupted`` (Ctrl-C, SIGTERM, exit) or ``failed`` (an error)."""
    return "failed" if isinstance(err, Exception) else "interrupted"


class Writer(Protocol):
    """One tracking backend, open for one run."""

    #: the ``[tracking]`` key that configures it
    name: str

    def log_round(self, row: Row) -> None:
        """Logs a round's released row (skipping a round it logged before a resume)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Logs ``metrics`` at ``step``, not as a round (a resume does not skip that round)."""

    def close(self, status: str, run_dir: Path | None = None) -> None:
        """Ends the run with a silodp ``status``; with ``run_dir``, logs its public files."""


class Tracker:
    """The writers of one run. As a context manager, it ends the run as ``interrupted`` or
    ``failed`` if the block raises; :meth:`close` ends it otherwise.

    A writer that fails after opening is logged and dropped: tracking never stops a run
    (whose rounds spend privacy budget)."""

    def __init__(self, writers: Sequence[Writer] = ()) -> None:
        self._writers = list(writers)

    def add(self, writer: Writer) -> None:
        self._writers.append(writer)

    def log_round(self, row: Row) -> None:
        self._each(lambda w: w.log_round(row), "log a round")

    def log_charged(self, summary: Mapping[str, Any]) -> None:
        """Logs an interrupted run's ledger charge beyond its completed rounds (``epsilon``
        and ``epsilon_by_adversary`` of a summary with ``rounds_charged_not_completed``) as
        ``charged_epsilon...`` metrics at the last such round; nothing otherwise."""
        open_rounds = summary.get("rounds_charged_not_completed") or []
        if not open_rounds:
            return
        row = {
            "epsilon": summary.get("epsilon") or {},
            "epsilon_by_adversary": summary.get("epsilon_by_adversary") or {},
        }
        metrics = {CHARGED + k: v for k, v in round_metrics(row).items()}
        step = max(int(r) for r in open_rounds)
        self._each(lambda w: w.log_metrics(metrics, step), "log the ledger's charge")

    def chain(
        self, then: Callable[[dict[str, Any]], None] | None
    ) -> Callable[[dict[str, Any]], None] | None:
        """A round callback that logs the row, then calls ``then``."""
        if not self._writers:
            return then

        def callback(row: dict[str, Any]) -> None:
            self.log_round(row)
            if then is not None:
                then(row)

        return callback

    def close(self, status: str, run_dir: Path | None = None) -> None:
        self._each(lambda w: w.close(status, run_dir), "end the run")
        self._writers = []

    def close_stopped(self, err: BaseException, run_dir: Path) -> None:
        """Ends a run that stopped with ``err`` once it wrote its summary: logs the ledger's
        charge beyond its completed rounds (:meth:`log_charged`, from ``summary.json`` if it
        says ``interrupted``: written for this stop), then its public files, ``interrupted``
        or ``failed``."""
        if not self._writers:
            return
        try:
            summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as read:
            logger.warning("tracking: the run's summary could not be read (%s)", read)
            summary = {}
        if isinstance(summary, Mapping) and summary.get("status") == "interrupted":
            self.log_charged(summary)
        self.close(_status_of(err), run_dir)

    def _each(self, call: Callable[[Writer], None], what: str) -> None:
        for writer in list(self._writers):
            try:
                call(writer)
            except Exception as err:
                logger.warning(
                    "tracking: %s could not %s (%s); it logs nothing more for this run",
                    writer.name,
                    what,
                    err,
                )
                self._writers.remove(writer)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if err is not None:
            self.close(_status_of(err))


def open_run(
    settings: TrackingConfig | None,
    run: TrackedRun,
    *,
    resume: bool = False,
    previous: Sequence[Row] = (),
) -> Tracker:
    """Opens ``run`` in every configured store and logs ``previous`` (the rows of the rounds
    a resumed run kept) where not logged yet.

    Raises:
      ConfigError: a configured store's packages are missing.
      InvalidValueError, OSError: a store cannot be opened (the message names it).
    """
    if settings is None:
        return Tracker()
    opened = Tracker()
    makers: list[tuple[str, str | None, Callable[[str], Writer]]] = [
        ("mlflow", settings.mlflow, lambda v: _MlflowWriter(v, run, resume=resume)),
        ("tensorboard", settings.tensorboard, lambda v: _TensorBoardWriter(v, run, resume=resume)),
    ]
    try:
        for key, value, make in makers:
            if value is not None:
                opened.add(_open(key, value, make))
    except BaseException as err:
        opened.close(_status_of(err))
        raise
    for row in previous:
        opened.log_round(row)
    return opened


def _open(key: str, value: str, make: Callable[[str], Writer]) -> Writer:
    try:
        return make(value)
    except (SilodpError, OSError):
        raise
    except Exception as err:
        raise InvalidValueError(
            f"Expected tracking.{key}={value!r} to be a store silodp can write; opening "
            f"{key} failed: {err}"
        ) from err


# --- MLflow ---------------------------------------------------------------------------------


def mlflow_store(value: str) -> tuple[str, Path]:
    """The tracking URI (an absolute SQLite database) and the artifact directory of
    ``tracking.mlflow``: a directory gets ``mlflow.db`` and ``mlartifacts/`` inside it;
    ``sqlite:///PATH`` names the database, with ``mlartifacts/`` beside it."""
    if value.lower().startswith("sqlite:///"):
        database = Path(value[len("sqlite:///") :]).expanduser().resolve()
        return f"sqlite:///{database}", database.parent / MLFLOW_ARTIFACTS
    directory = Path(value).expanduser().resolve()
    return f"sqlite:///{directory / MLFLOW_DB}", directory / MLFLOW_ARTIFACTS


def _run_key(run_dir: Path) -> str:
    """The tag that finds a run's MLflow run again on resume (any path, no quoting)."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:32]


class _MlflowWriter:
    name = "mlflow"

    def __init__(self, store: str, run: TrackedRun, *, resume: bool) -> None:
        _require("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = mlflow_store(store)
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self._client = client = MlflowClient(uri)
        experiment_name, *cell = run.experiment.split("/")
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            experiment_id = client.create_experiment(
                experiment_name, artifact_location=artifacts.as_uri()
            )
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment_id)
        key = _run_key(run.run_dir)
        found = (
            client.search_runs(
                [experiment_id],
                filter_string=f"tags.`silodp.run_key` = '{key}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if resume
            else []
        )
        self._logged = 0
        #: every round's metrics carry this time, not their own: how long a round took
        #: follows the sampled records and subjects (silo-private, like wall_time_s)
        self._stamp = int(time.time() * 1000)
        if found:
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
            rounds = [k for k in found[0].data.metrics if not k.startswith(CHARGED)]
            self._logged = self._last_step(rounds)
            return
        tags = {
            "silodp.experiment": run.experiment,
            "silodp.run": run.name,
            "silodp.run_dir": str(run.run_dir.resolve()),
            "silodp.run_key": key,
            "silodp.status": "running",
        }
        created = client.create_run(experiment_id, run_name="/".join([*cell, run.name]), tags=tags)
        self._run_id = created.info.run_id
        params = [Param(k, v) for k, v in run.all_params().items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 per call
            client.log_batch(self._run_id, params=params[i : i + 100])

    def _last_step(self, keys: Iterable[str]) -> int:
        steps = [m.step for key in keys for m in self._client.get_metric_history(self._run_id, key)]
        return max(steps, default=0)

    def log_round(self, row: Row) -> None:
        step = int(row["round"])
        if step <= self._logged:
            return
        self.log_metrics(round_metrics(row), step)
        self._logged = step

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        logged = [Metric(k, v, self._stamp, step) for k, v in metrics.items()]
        if logged:
            self._client.log_batch(self._run_id, metrics=logged)

    def close(self, status: str, run_dir: Path | None = None) -> None:
        for path in public_files(run_dir) if run_dir is not None else ():
            self._client.log_artifact(self._run_id, str(path))
        self._client.set_tag(self._run_id, "silodp.status", status)
        # ended when it started: the time between follows the sampled records and subjects
        started = self._client.get_run(self._run_id).info.start_time
        self._client.set_terminated(
            self._run_id, MLFLOW_STATUS.get(status, "FAILED"), end_time=started
        )


# --- TensorBoard ----------------------------------------------------------------------------


def _safe(part: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._=+-]", "_", part)
    return cleaned if cleaned.strip(".") else cleaned.replace(".", "_") or "_"


def tensorboard_dir(logdir: str, run: TrackedRun) -> Path:
    """``<logdir>/<experiment name>/<run name>``, each ``/``-separated part made safe as a
    directory name."""
    parts = [*run.experiment.split("/"), *run.name.split("/")]
    return Path(logdir).expanduser().resolve().joinpath(*(_safe(p) for p in parts))


def _event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*")) if directory.is_dir() else []


def _last_step(directory: Path) -> int:
    """The last step with a round's summary in the event files of ``directory`` (0: none;
    ``charged_...`` values are not rounds)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last = 0
    for path in _event_files(directory):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and any(
                not v.tag.startswith(CHARGED) for v in event.summary.value
            ):
                last = max(last, int(event.step))
    return last


def _tb_key(directory: Path) -> str | None:
    """The run key in ``directory`` (``None``: none there)."""
    try:
        return (directory / TB_RUN_KEY).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _resumed_dir(directory: Path, key: str) -> Path:
    """Where a resumed run with ``key`` appends its TensorBoard logs: its own directory,
    also once a later run of the same name set it aside (the latest such); ``directory`` if
    it holds no logs, or logs written before runs were keyed while no run was set aside
    beside it (then they can only be this run's); else a new ``<run name>.run-<key>``
    beside it, never another run's logs."""
    found = _tb_key(directory)
    if found == key:
        return directory
    aside = (
        sorted(
            p
            for p in directory.parent.iterdir()
            if p.is_dir() and p.name.startswith(f"{directory.name}.replaced-")
        )
        if directory.parent.is_dir()
        else []
    )
    mine = [p for p in aside if _tb_key(p) == key]
    if mine:
        logger.info(
            "tracking: a later run of %s set this run's TensorBoard logs aside; they "
            "continue in %s",
            directory.name,
            mine[-1],
        )
        return mine[-1]
    own = directory.with_name(f"{directory.name}.run-{key[:12]}")
    if _tb_key(own) == key:  # started beside another run's logs on an earlier resume
        return own
    if found is None and (not _event_files(directory) or not aside):
        return directory
    return own


def _set_aside(directory: Path) -> None:
    """Renames an earlier run's logs in ``directory`` (a run started afresh replaces it)."""
    if not _event_files(directory):
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = directory.with_name(f"{directory.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = directory.with_name(f"{directory.name}.replaced-{stamp}-{n}")
    directory.rename(target)
    logger.info("tracking: the earlier TensorBoard logs of %s are kept as %s", directory, target)


class _TensorBoardWriter:
    name = "tensorboard"

    def __init__(self, logdir: str, run: TrackedRun, *, resume: bool) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        directory = tensorboard_dir(logdir, run)
        key = _run_key(run.run_dir)
        if resume:
            directory = _resumed_dir(directory, key)
            self._logged = _last_step(directory)
        else:
            _set_aside(directory)
            self._logged = 0
        first = not _event_files(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # a fresh run's directory is its own; a resumed run names one it starts, never logs
        # it did not write (an older version's, with no key, stay unnamed)
        if not resume or (first and _tb_key(directory) is None):
            (directory / TB_RUN_KEY).write_text(key + "\n", encoding="utf-8")
        self._writer = SummaryWriter(log_dir=str(directory))
        #: the wall time of every round's scalars (not their own: see the MLflow writer)
        self._walltime = time.time()
        if first:  # the run's parameters, once
            table = "\n".join(f"| {k} | {v} |" for k, v in sorted(run.all_params().items()))
            self._writer.add_text("params", "| key | value |\n|---|---|\n" + table, 0)
            self._writer.flush()

    def log_round(self, row: Row) -> None:
        step = int(row["round"])
        if step <= self._logged:
            return
        self.log_metrics(round_metrics(row), step)
        self._logged = step

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            # stored as float32: an upper bound (a round's ε or a charge) stays one
            if key.removeprefix(CHARGED).startswith("epsilon"):
                value = float32_up(value)
            self._writer.add_scalar(key, value, step, walltime=self._walltime)
        self._writer.flush()  # a round is long; what it logged survives a crash

    def close(self, status: str, run_dir: Path | None = None) -> None:
        self._writer.close()
        # the event files' times are those of the run's start, as their scalars' are (their
        # modification time would say how long the run took)
        for path in _event_files(Path(self._writer.log_dir)):
            os.utime(path, (self._walltime, self._walltime))
