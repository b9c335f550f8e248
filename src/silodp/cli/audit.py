"""``silodp audit``: an empirical lower bound on ε beside the claimed ε, per algorithm."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from silodp import display
from silodp.cli.common import (
    INTERRUPTED_EXIT_CODE,
    TERMINATED_EXIT_CODE,
    Terminated,
    fail,
    sigterm_interrupts,
)

__all__ = ["audit"]


def _table(reports: list[dict[str, Any]]) -> str:
    lines = [
        f"{'algorithm':>15}  {'unit':<7}  {'claimed ε':>10}  {'lower bound':>11}  "
        f"{'guesses':>12}  {'seconds':>7}"
    ]
    for r in reports:
        bound = r["bound"]
        guesses = (
            f"{bound['correct']}/{bound['guesses']}" if "guesses" in bound else f"{r['runs']} runs"
        )
        claim = r.get("claim", "finite")
        if claim == "finite":
            claimed, measured = display.upper_and_lower(r["claimed_epsilon"], r["lower_bound"])
        else:
            claimed = "inf" if claim == "infinite" else "not private"
            measured = display.lower(r["lower_bound"])
        lines.append(
            f"{r['algorithm']:>15}  {r['unit']:<7}  {claimed:>10}  {measured:>11}  "
            f"{guesses:>12}  {r['wall_time_s']:>7.0f}"
        )
    return "\n".join(lines)


def audit(
    config: Annotated[Path, typer.Argument(help="Experiment TOML whose algorithms to audit.")],
    algorithm: Annotated[
        list[str] | None,
        typer.Option(help="Algorithm to audit (repeatable; default: every one in CONFIG)."),
    ] = None,
    unit: Annotated[
        str | None,
        typer.Option(
            help="Canary unit: subject (several records over several silos, shaped like the "
            "data's subjects) or record. Default: subject where the algorithm reports it."
        ),
    ] = None,
    design: Annotated[
        str,
        typer.Option(
            help="one-run (many canaries in one training) or many-runs (one canary per "
            "training, Clopper-Pearson; for small models)."
        ),
    ] = "one-run",
    canaries: Annotated[int, typer.Option(help="Canaries of a one-run audit.")] = 1000,
    runs: Annotated[int, typer.Option(help="Trainings of a many-runs audit.")] = 200,
    significance: Annotated[float, typer.Option(help="1 - confidence of the lower bound.")] = 0.05,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed of the auditor's coins (default: drawn from the OS)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory of the audited runs.")] = Path("runs/audit"),
    overwrite: Annotated[bool, typer.Option(help="Replace an audit already in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress output.")] = False,
) -> None:
    """Audit the privacy of CONFIG's algorithms: train each with canaries, attack the released
    model, and print an empirical lower bound on ε (with its confidence) beside the claimed ε.

    A lower bound above the claimed ε means the claim is wrong (at that confidence). Writes
    OUT/<algorithm>/ with the audited run, audit.json and audit_roc.png.
    Exit codes: 0 done, 1 a lower bound above its claimed ε, 2 bad input."""
    from silodp.algorithms import ALGORITHMS
    from silodp.audit.canaries import CANARY_UNITS
    from silodp.audit.run import DESIGNS, audit_algorithm
    from silodp.config import load_config
    from silodp.crypto.errors import ProtocolError
    from silodp.data.build import build_federated_data
    from silodp.errors import SilodpError
    from silodp.experiment.record import check_output
    from silodp.io import check_writable_dir

    if unit is not None and unit not in CANARY_UNITS:
        fail(f"Expected --unit to be one of {', '.join(CANARY_UNITS)}; got {unit!r}.")
    if design not in DESIGNS:
        fail(f"Expected --design to be one of {', '.join(DESIGNS)}; got {design!r}.")
    if canaries < 2:
        fail(f"Expected --canaries >= 2; got {canaries}.")
    if runs < 4:
        fail(f"Expected --runs >= 4; got {runs}.")
    if not 0 < significance < 1:
        fail(f"Expected --significance in (0, 1); got {significance}.")
    reports: list[dict[str, Any]] = []
    try:
        check_writable_dir(out, name="--out")
        cfg = load_config(config)
        names = list(algorithm or cfg.algorithms)
        for name in names:
            if name not in cfg.algorithms:
                raise SilodpError(
                    f"Expected --algorithm to be one of the config's algorithms "
                    f"({', '.join(cfg.algorithms)}); got {name!r}."
                )
            units = ALGORITHMS[name].units
            if unit is not None and units and unit not in units:  # before anything trains
                raise SilodpError(
                    f"Expected --unit to be a unit {name!r} reports ε for ({', '.join(units)}); "
                    f"got {unit!r}: it claims nothing at that unit, so no bound could "
                    "contradict it."
                )
        check_output(out, names, overwrite)
        log = (lambda msg: None) if quiet else (lambda msg: typer.echo(msg, err=True))
        log(f"silodp: auditing {', '.join(names)} from {config}")
        for name in names:  # the config's, or an [algorithm.X] table's own
            privacy = cfg.for_algorithm(name)[1]
            if privacy.ledger is not None or privacy.budget:
                # said whether or not --quiet: this spending stays off the consortium's ledger
                typer.echo(
                    f"silodp audit: {name}'s shared ledger and budget "
                    f"({privacy.ledger or '-'}; {dict(privacy.budget or {}) or '-'}) are not "
                    f"charged: each audited training is recorded in its own ledger under "
                    f"{out}/ (and a many-runs audit's further trainings in none). Audit data "
                    "whose privacy you are willing to spend.",
                    err=True,
                )
        data = build_federated_data(cfg.data)
        with sigterm_interrupts():
            for name in names:
                reports.append(
                    audit_algorithm(
                        cfg,
                        data,
                        name,
                        out,
                        unit=unit,
                        design=design,
                        canaries=canaries,
                        runs=runs,
                        significance=significance,
                        seed=seed,
                        log=log,
                    )
                )
    except KeyboardInterrupt as stop:
        _stopped(out, reports, terminated=isinstance(stop, Terminated))
    except (SilodpError, ProtocolError, ValueError, OSError) as err:
        done = ", ".join(r["algorithm"] for r in reports)
        fail(str(err) + (f" (audits finished and kept in {out}/: {done})" if done else ""))
    above = [r["algorithm"] for r in reports if _violates(r)]
    if as_json:
        json.dump(reports, sys.stdout, indent=2)
        typer.echo("")
    else:
        conf = f"{1 - significance:.0%}"
        typer.echo(f"\nempirical lower bounds on ε ({conf} confidence), released-model attacker:")
        typer.echo(_table(reports))
        for note in _caveats(reports):
            typer.echo(f"note: {note}")
        typer.echo(f"\nresults in {out}/ (audit.json, audit_roc.png per algorithm)")
    if above:
        typer.secho(
            f"lower bound above the claimed ε: {', '.join(above)} - at {1 - significance:.0%} "
            "confidence the claim does not hold (a bug, unless this is the chance the "
            "confidence leaves)",
            fg=typer.colors.RED,
            err=True,
        )
        raise typer.Exit(code=1)


def _stopped(out: Path, reports: list[dict[str, Any]], *, terminated: bool) -> NoReturn:
    """After Ctrl-C (or SIGTERM): which audits finished; exit code 130 (143)."""
    done = ", ".join(r["algorithm"] for r in reports) or "none"
    typer.echo(
        f"interrupted: stopped by {'SIGTERM' if terminated else 'Ctrl-C'}; audits finished and "
        f"kept in {out}/: {done}. An audit cut short is not a result: run it again with "
        "--overwrite.",
        err=True,
    )
    raise typer.Exit(code=TERMINATED_EXIT_CODE if terminated else INTERRUPTED_EXIT_CODE)


def _violates(report: dict[str, Any]) -> bool:
    """A lower bound above an add/remove claim (canaries are added or removed: a bound above
    a replace-one claim does not contradict it, that notion not implying this one)."""
    claimed = report["claimed_epsilon"]
    comparable = report.get("adjacency") in (None, "add/remove")
    return claimed is not None and comparable and report["lower_bound"] > claimed


def _caveats(reports: list[dict[str, Any]]) -> list[str]:
    """What the table's rows cannot show: claims no bound of that audit could exceed, and
    bounds above a claim of another adjacency."""
    notes = []
    for r in reports:
        claimed, ceiling = r["claimed_epsilon"], r.get("max_lower_bound")
        if claimed is not None and ceiling is not None and ceiling <= claimed:
            notes.append(
                f"{r['algorithm']}: this audit could not contradict its claim (every guess "
                f"right would show {display.lower(ceiling)}); more canaries or runs raise that"
            )
        elif claimed is not None and not _violates(r) and r["lower_bound"] > claimed:
            notes.append(
                f"{r['algorithm']}: its bound is above a {r['adjacency']} claim, which "
                "add/remove canaries do not test (not a contradiction)"
            )
    return notes
