"""``silodp ledger show|verify``: a privacy ledger's history and totals, and its check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from silodp.cli.common import fail, fmt
from silodp.errors import SilodpError

__all__ = ["ledger_app"]

ledger_app = typer.Typer(
    no_args_is_help=True,
    help="Show or verify a privacy ledger (every DP event a run recorded, and the ε it gives).",
)


def print_ledger(report: dict[str, Any]) -> None:
    typer.echo(f"ledger {report['path']} (schema v{report['schema_version']})")
    for run in report["runs"]:
        eps = ", ".join(f"{u}={fmt(v)} via {run['routes'][u]}" for u, v in run["epsilon"].items())
        typer.echo(
            f"  run {run['id']}: {run['name']} ({run['algorithm']}), {run['status']}, "
            f"{run['rounds']} rounds, {run['events']} events, coins {run['noise'].get('mode')}"
        )
        typer.echo(f"      ε({eps or 'nothing spent'}) at δ={run['delta']:g}")
        if run["interrupted_rounds"]:
            typer.echo(f"      interrupted rounds (counted in full): {run['interrupted_rounds']}")
    for kind, total in report["total"].items():
        eps = ", ".join(f"{u}={fmt(v)}" for u, v in total["epsilon"].items())
        typer.echo(f"  total over runs {total['runs']} ({kind} accounting): ε({eps})")


#: how every SQLite database file starts
SQLITE_HEADER = b"SQLite format 3\x00"


def _ledger_file(path: Path) -> Path:
    """``path`` if it is a file; a clear error otherwise (before SQLite sees it)."""
    if not path.exists():
        fail(f"Expected PATH {str(path)!r} to be a ledger file; it does not exist.")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        fail(f"Expected PATH {str(path)!r} to be a ledger file; it is {what}.")
    try:
        with path.open("rb") as handle:
            header = handle.read(len(SQLITE_HEADER))
    except OSError as err:
        fail(f"Expected PATH {str(path)!r} to be a readable ledger file: {err.strerror or err}.")
    if header != SQLITE_HEADER:
        what = "empty" if not header else "not an SQLite database"
        fail(
            f"Expected PATH {str(path)!r} to be a silodp ledger (an SQLite database); it is {what}."
        )
    return path


@ledger_app.command()
def show(
    path: Annotated[Path, typer.Argument(help="The ledger file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The runs, rounds and events a ledger holds, and the ε they give per unit and route."""
    from silodp.ledger.report import ledger_report

    try:
        report = ledger_report(_ledger_file(path))
    except (SilodpError, OSError) as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        print_ledger(report)


@ledger_app.command()
def verify(path: Annotated[Path, typer.Argument(help="The ledger file.")]) -> None:
    """Recompute every ε from the recorded events and compare it with what the runs wrote;
    exit code 1 on any difference or a failed integrity check."""
    from silodp.ledger.report import verify_ledger

    try:
        problems = verify_ledger(_ledger_file(path))
    except (SilodpError, OSError) as err:
        fail(str(err))
    for problem in problems:
        typer.echo(f"mismatch: {problem}", err=True)
    if problems:
        raise typer.Exit(code=1)
    typer.echo(f"{path}: every written ε matches its recorded events")
