"""``silodp federation up|down``: a local Flower federation for trying deployment out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from silodp.cli.common import check_config_file, fail
from silodp.errors import InvalidValueError, SilodpError

federation_app = typer.Typer(
    help="Start and stop a local Flower federation (SuperLink + one SuperNode per silo, on "
    "127.0.0.1, with TLS and SuperNode authentication).",
    no_args_is_help=True,
)

DIRECTORY = typer.Option(help="Where the federation keeps its keys, data files and logs.")


@federation_app.command("up")
def up(
    config: Annotated[Path, typer.Argument(help="Experiment TOML whose data the silos hold.")],
    silos: Annotated[
        int | None,
        typer.Option(help="SuperNodes to start: one per silo, so it must match the data's silos."),
    ] = None,
    directory: Annotated[Path, DIRECTORY] = Path(".silodp-federation"),
) -> None:
    """Start the federation; then `silodp run CONFIG --engine flower-deploy`."""
    from silodp.io import check_writable_dir

    check_config_file(config)
    try:
        if silos is not None and silos < 1:
            raise InvalidValueError(f"Expected --silos={silos} to be a positive integer.")
        check_writable_dir(directory, name="--directory")
        from silodp.engines.flower.deployment import up as start

        start(config, directory=directory, silos=silos, log=typer.echo)
    except (SilodpError, OSError) as err:
        fail(str(err))


@federation_app.command("down")
def down(directory: Annotated[Path, DIRECTORY] = Path(".silodp-federation")) -> None:
    """Stop every process of the federation (by the PIDs `up` recorded)."""
    from silodp.engines.flower.deployment import down as stop

    try:
        stop(directory=directory, log=typer.echo)
    except (SilodpError, OSError) as err:
        fail(str(err))
