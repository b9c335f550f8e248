"""Flower's simulation engine (Ray): virtual silos in worker processes of this machine."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from silodp.config import ExperimentConfig
from silodp.data.build import build_federated_data
from silodp.engines.factory import check_engine_config, remote_engine_factory, write_silo_files
from silodp.engines.flower.client import SILO_DIR_ENV, client_app
from silodp.engines.flower.transport import GridTransport
from silodp.errors import SilodpError

__all__ = ["simulate"]

logger = logging.getLogger(__name__)

#: the prefix of the private temporary directory (mode 0700) that holds the virtual silos'
#: data files and secrets while a simulation runs; removed when it ends
SILO_DIR_PREFIX = "silodp-silos-"


def simulate(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    resume: bool = False,
    timeout: float = 600.0,
    on_failure: str = "abort",
    num_cpus: int | None = None,
    log: Callable[[str], None] = logger.info,
) -> dict[str, Any]:
    """Runs ``config`` on Flower's simulation engine: one virtual SuperNode per silo, each a
    :class:`~silodp.engines.silo.SiloRuntime` reading its own data file; the ServerApp runs
    the experiment (:func:`~silodp.experiment.run.run_experiment`) in this process.

    Returns the experiment summary (``out_dir/summary.json``).
    """
    from silodp.experiment.run import holding_results

    check_engine_config(config)
    out = Path(out_dir)
    with holding_results(out):  # no other run may write into --out meanwhile
        data = build_federated_data(config.data)
        with _private_silo_files(data.train):
            return _simulate(
                config, data, out, overwrite, resume, timeout, on_failure, num_cpus, log
            )


@contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """Within the block, the SIGINT and SIGTERM handlers this process had survive ``ray.init``
    (which installs its own: SIGTERM then aborted the process, leaving the run "running"
    with nothing said), so a stop reaches silodp's handler and ends the run cleanly."""
    import ray

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    init = ray.init

    def init_keeping_handlers(*args: Any, **kwargs: Any) -> Any:
        out = init(*args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in kept.items():
                if handler is not None:
                    signal.signal(sig, handler)
        return out

    ray.init = init_keeping_handlers
    try:
        yield
    finally:
        ray.init = init


@contextmanager
def _private_silo_files(train: Any) -> Iterator[Path]:
    """Each silo's raw records (and, once its runtime starts, its secret) in a temporary
    directory readable by this user only, outside ``--out`` (whose files may be released),
    removed when the simulation ends."""
    silo_dir = Path(tempfile.mkdtemp(prefix=SILO_DIR_PREFIX))
    try:
        write_silo_files(train, silo_dir)
        os.environ[SILO_DIR_ENV] = str(silo_dir.resolve())
        yield silo_dir
    finally:
        os.environ.pop(SILO_DIR_ENV, None)
        shutil.rmtree(silo_dir, ignore_errors=True)


def _simulate(
    config: ExperimentConfig,
    data: Any,
    out: Path,
    overwrite: bool,
    resume: bool,
    timeout: float,
    on_failure: str,
    num_cpus: int | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from silodp.experiment.run import resume_experiment, run_experiment

    failures: list[BaseException] = []
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        factory = remote_engine_factory(
            GridTransport(grid), timeout=timeout, on_failure=on_failure, stops_in_process=True
        )
        try:
            if resume:
                resume_experiment(out, log=log, engine_factory=factory)
            else:
                run_experiment(config, out, overwrite=overwrite, log=log, engine_factory=factory)
        except KeyboardInterrupt as err:  # a stop (deferred to a round's end): raised below,
            failures.append(err)  # in the main thread, once the simulation has ended
        except BaseException as err:
            failures.append(err)
            raise

    cpus = num_cpus or os.cpu_count() or 1
    import threadpoolctl

    # numpy's OpenBLAS threads were seen to spin forever in the server's thread beside Ray's;
    # silodp's numpy products are small (torch keeps its own threads)
    with _keeping_signal_handlers(), threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        run_simulation(
            server_app=app,
            client_app=client_app,
            num_supernodes=data.train.num_silos,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {
                    "num_cpus": cpus,
                    "num_gpus": 0,
                    "include_dashboard": False,
                },
            },
        )
    if failures:
        raise failures[0]
    summary_path = out / "summary.json"
    if not summary_path.is_file():
        raise SilodpError(f"The Flower simulation ended without writing {summary_path}.")
    result: dict[str, Any] = json.loads(summary_path.read_text(encoding="utf-8"))
    return result
