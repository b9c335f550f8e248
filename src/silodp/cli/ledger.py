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
    from silodp.ledger.report import total_line
    from silodp.ledger.store import SCHEMA_VERSION

    version = report["schema_version"]
    read_as = f", read as v{SCHEMA_VERSION} without migrating" if version < SCHEMA_VERSION else ""
    typer.echo(f"ledger {report['path']} (schema v{version}{read_as})")
    for run in report["runs"]:
        eps = ", ".join(f"{u}={fmt(v)} via {run['routes'][u]}" for u, v in run["epsilon"].items())
        typer.echo(
            f"  run {run['id']}: {run['name']} ({run['algorithm']}), {run['status']}, "
            f"{run['rounds']} rounds, {run['events']} events, coins {run['noise'].get('mode')}"
        )
        against = run.get("adversary", "strongest")
        if run.get("error"):
            typer.echo(f"      not composed, no bound ({run['error']})")
        else:
            typer.echo(f"      ε({eps or 'nothing spent'}) at δ={run['delta']:g} against {against}")
        if run["noise"].get("mode") == "none":
            typer.echo("      trained without noise: its model has no guarantee for any unit")
        if run["interrupted_rounds"]:
            typer.echo(f"      interrupted rounds (counted in full): {run['interrupted_rounds']}")
        if run.get("rounds_run_again"):
            typer.echo(
                f"      rounds run more than once (every attempt counted in full): "
                f"{run['rounds_run_again']}"
            )
    for kind, total in report["total"].items():
        typer.echo(f"  {total_line(kind, total)}")
        if total.get("error"):
            continue
        if total.get("without_noise"):
            typer.echo(
                f"      inf: run(s) {total['without_noise']} released a model of this data "
                "without noise"
            )
        for unit, ids in total.get("unaccounted", {}).items():
            typer.echo(
                f"      inf at {unit}: run(s) {ids} do not account it, so what they spent "
                "there has no bound"
            )
    for unit, limit in report.get("budget", {}).items():
        typer.echo(
            f"  budget declared on this ledger: {unit} ε ≤ {limit['epsilon']:g} at "
            f"δ={limit['delta']:g} against {limit.get('adversary', 'strongest')} (binds every "
            "run that writes here)"
        )


def _ledger_file(path: Path) -> Path:
    """``path`` if it can be a ledger file; a clear error otherwise (before SQLite sees it)."""
    from silodp.ledger.store import ledger_file_problem

    problem = ledger_file_problem(path)
    if problem is not None:
        fail(f"Expected PATH {str(path)!r} to be a silodp ledger (an SQLite database); {problem}.")
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
    exit code 1 on any difference or a failed integrity check, 2 if the file cannot be read as
    a ledger at all (not a ledger, or too damaged for SQLite to open)."""
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
