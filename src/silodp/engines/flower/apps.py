"""The ServerApp (runs the experiment, the silos through the grid) and the ClientApp (a silo).

The ServerApp reads its run config: ``config`` (the experiment's TOML file, on the server's
machine), ``out`` (the output directory), and optionally ``resume``, ``overwrite``,
``timeout``, ``connect-timeout``, ``on-failure`` and ``workdir`` (the directory the config's
relative paths are read from: the submitting user's). The ClientApp reads its node config:
``data`` (the silo's records, a file of :func:`~silodp.engines.silo.write_silo_data`; its
secret is kept beside it as ``<data>.key``), or in a simulation ``partition-id`` with the run
config's ``silo-dir``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from silodp import display
from silodp.engines import wire
from silodp.engines.factory import check_engine_config, remote_engine_factory, silo_file
from silodp.engines.flower.transport import GridTransport, reply_content, request_of
from silodp.engines.silo import SiloRuntime, read_silo_data, silo_secret
from silodp.errors import SilodpError

if TYPE_CHECKING:
    from silodp.config import ExperimentConfig

__all__ = ["client_app", "server_app", "silo_data_path", "submitted_config"]

server_app = ServerApp()
client_app = ClientApp()

#: where a simulation's virtual silos find their data files (``silo-<partition-id>.npz``)
SILO_DIR_ENV = "SILODP_SILO_DIR"

#: one runtime per silo data file in this process
_RUNTIMES: dict[str, SiloRuntime] = {}


def silo_data_path(context: Context) -> Path:
    """The silo's data file: the node config's ``data``, else (simulation) the run config's
    ``silo-dir`` and the node's ``partition-id``."""
    node = context.node_config
    if "data" in node:
        return Path(str(node["data"]))
    directory = context.run_config.get("silo-dir") or os.environ.get(SILO_DIR_ENV)
    if "partition-id" in node and directory:
        return silo_file(str(directory), int(node["partition-id"]))
    raise SilodpError(
        "Expected the SuperNode's node config to name the silo's data file (data=PATH)."
    )


def _runtime(context: Context) -> SiloRuntime:
    path = silo_data_path(context)
    key = str(path.resolve())
    if key not in _RUNTIMES:
        _RUNTIMES[key] = SiloRuntime(read_silo_data(path), silo_secret(f"{path}.key"))
    return _RUNTIMES[key]


@client_app.query()
def silo_query(message: Message, context: Context) -> Message:
    """A silo's reply to one of the server's messages (errors go back as Flower errors)."""
    kind, body = request_of(message)
    reply = _runtime(context).handle(kind, wire.decode(body))
    return Message(reply_content(wire.encode(reply)), reply_to=message)


def _say(message: str) -> None:
    """A line in the run's log (the ServerApp's output is what ``flwr run --stream`` shows)."""
    print(f"silodp: {message}", file=sys.stderr, flush=True)


def _round_lines(name: str, rounds: int) -> Any:
    """One log line per round: the run's progress, readable in a streamed log."""

    def update(row: dict[str, Any]) -> None:
        parts = [f"{name}: round {row['round']}/{rounds}"]
        if row.get("test_accuracy") is not None:
            parts.append(f"accuracy {row['test_accuracy']:.3f}")
        eps = row.get("epsilon") or {}
        parts += [f"ε_{unit} {display.upper(v)}" for unit, v in eps.items() if v is not None]
        _say(", ".join(parts))

    return update


def _option(config: Any, key: str, default: Any) -> Any:
    return config[key] if key in config else default


def submitted_config(run_config: Any) -> ExperimentConfig:
    """The experiment a run config submits: its ``config`` file, with relative ledger and
    data paths read from ``workdir`` (the submitting user's directory, not this process's)
    and ``ledger`` (``silodp run --ledger``) in place of the config's ledgers."""
    from silodp.config import load_config

    workdir = str(_option(run_config, "workdir", ""))
    config = load_config(str(run_config["config"]), base=workdir or None)
    if str(_option(run_config, "ledger", "")):  # silodp run --ledger
        config = config.with_ledger(str(run_config["ledger"]))
    return config


@server_app.main()
def experiment(grid: Grid, context: Context) -> None:
    """Runs the experiment of the run config's ``config`` file with the connected silos."""
    from silodp.experiment.run import resume_experiment, run_experiment

    rc = context.run_config
    factory = remote_engine_factory(
        GridTransport(grid),
        timeout=float(_option(rc, "timeout", 600.0)),
        on_failure=str(_option(rc, "on-failure", "abort")),
        connect_timeout=float(_option(rc, "connect-timeout", 300.0)),
    )
    out = Path(str(rc["out"]))
    if bool(_option(rc, "resume", False)):
        resume_experiment(out, log=_say, progress=_round_lines, engine_factory=factory)
        return
    config = submitted_config(rc)
    check_engine_config(config)  # before any run draws or records anything
    run_experiment(
        config,
        out,
        overwrite=bool(_option(rc, "overwrite", False)),
        log=_say,
        progress=_round_lines,
        engine_factory=factory,
    )
