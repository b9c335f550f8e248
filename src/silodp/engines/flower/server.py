"""The ServerApp: runs the experiment, with the silos (:mod:`.client`) through the grid.

It reads its run config: ``config`` (the experiment's TOML file, on the server's machine),
``out`` (the output directory), and optionally ``resume``, ``overwrite``, ``timeout``,
``connect-timeout``, ``on-failure`` and ``workdir`` (the directory the config's relative paths
are read from: the submitting user's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from silodp import display
from silodp.engines.factory import check_engine_config, remote_engine_factory
from silodp.engines.flower.transport import GridTransport

if TYPE_CHECKING:
    from silodp.config import ExperimentConfig

__all__ = ["server_app", "submitted_config"]

server_app = ServerApp()


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
