"""Engines for :func:`~silodp.experiment.run.run_experiment` whose silos run apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from silodp.config import ExperimentConfig
from silodp.data import FederatedDataset
from silodp.engines.remote import RemoteEngine, Transport
from silodp.engines.silo import silo_file, write_silo_data
from silodp.errors import InvalidValueError
from silodp.experiment.run import EngineFactory

__all__ = [
    "check_engine_config",
    "check_weighting_scheme",
    "remote_engine_factory",
    "write_silo_files",
]


def check_weighting_scheme(algorithm: str, scheme: str) -> None:
    """Refuses a weighting-protocol scheme that only the in-process simulator runs: the
    engines whose silos run apart exchange the Paillier protocol's messages only (BFV has no
    message types yet)."""
    if scheme != "paillier":
        raise InvalidValueError(
            f"Expected {algorithm}'s privacy.scheme='paillier' with an engine whose silos run "
            f"apart (Flower), got {scheme!r}: the {scheme.upper()} weighting protocol runs in "
            "the in-process simulator only (silodp run --engine inprocess, the default)."
        )


def check_engine_config(config: ExperimentConfig) -> None:
    """Refuses what the engines whose silos run apart do not support yet."""
    if config.data.scaling == "dp":
        raise InvalidValueError(
            "Expected [data] scaling other than 'dp' with a Flower engine: the DP feature "
            "statistics are computed by the in-process engine only."
        )
    for name in config.algorithms:
        check_weighting_scheme(name, config.algorithm_settings(name).get("scheme", "paillier"))


def write_silo_files(train: FederatedDataset, directory: str | Path) -> list[Path]:
    """Every silo's records (before any run's bounds), one file per silo."""
    return [write_silo_data(train, s, silo_file(directory, s)) for s in range(train.num_silos)]


def remote_engine_factory(
    transport: Transport,
    *,
    timeout: float = 600.0,
    on_failure: str = "abort",
    connect_timeout: float = 300.0,
    stops_in_process: bool = False,
) -> EngineFactory:
    """An engine factory whose runs exchange messages with the silos through ``transport``.
    ``stops_in_process``: the server's rounds run in this process (Flower's simulation), so a
    first Ctrl-C or SIGTERM waits for the round in progress, as in process."""

    def make(run: Any, data: Any, **kwargs: Any) -> RemoteEngine:
        check_weighting_scheme(run.name, getattr(run.algorithm.config, "scheme", "paillier"))
        train = data.train

        return RemoteEngine(
            transport=transport,
            records=train,
            timeout=timeout,
            on_failure=on_failure,
            connect_timeout=connect_timeout,
            model_spec={
                "name": run.config.model.name,
                "feature_shape": list(train.feature_shape),
                "num_classes": train.num_classes,
            },
            **kwargs,
        )

    make.stops_in_process = stops_in_process  # type: ignore[attr-defined]
    return make
