"""The ``silodp`` command line: run experiments, describe data, account privacy.

Every :class:`~silodp.errors.SilodpError` (and a missing file) ends a command with its message
and exit code 2; the commands parse, call the library and print, nothing more.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from tqdm import tqdm

from silodp.bench.cli import bench_app
from silodp.cli.common import BUDGET_EXIT_CODE, WHO, differing, fail, fmt
from silodp.config import default_config_path, load_config
from silodp.crypto.errors import ProtocolError
from silodp.errors import SilodpError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Cross-silo federated learning with differential privacy at the record, silo or "
    "subject level.",
)


app.add_typer(bench_app, name="bench")


def _progress(name: str, rounds: int) -> Any:
    bar = tqdm(total=rounds, desc=f"{name:>15}", unit="round", file=sys.stderr, leave=True)

    def update(row: dict[str, Any]) -> None:
        postfix = {}
        if row.get("test_accuracy") is not None:
            postfix["acc"] = f"{row['test_accuracy']:.3f}"
        for unit, value in row.get("epsilon", {}).items():
            postfix[f"ε_{unit}"] = fmt(value)
        postfix.update({f"ε_{unit}[{who}]": fmt(value) for who, unit, value in differing(row)})
        bar.set_postfix(postfix)
        bar.update(1)
        if row["round"] == rounds:
            bar.close()

    return update


@app.command()
def run(
    config: Annotated[
        Path | None, typer.Argument(help="Experiment TOML; omitted: the built-in demo.")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Results directory.")] = Path("runs/demo"),
    overwrite: Annotated[bool, typer.Option(help="Replace results already in --out.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue the experiment in this results directory from its last completed "
            "rounds (its own config; CONFIG and --out are not used)."
        ),
    ] = None,
    ledger: Annotated[
        Path | None,
        typer.Option(
            help="Privacy ledger shared with other runs on the same data (default: one in each "
            "run's directory); overrides [privacy] ledger."
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Where the silos run: inprocess (one process), flower-sim (Flower's simulation "
            "engine, one virtual SuperNode per silo) or flower-deploy (the local federation "
            "of `silodp federation up`)."
        ),
    ] = "inprocess",
    on_failure: Annotated[
        str,
        typer.Option(
            help="A silo that fails or times out in a round: abort the run, or skip it for the "
            "round where the algorithm allows it (Flower engines)."
        ),
    ] = "abort",
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the silos' replies (Flower engines).")
    ] = 600.0,
    federation: Annotated[
        Path, typer.Option(help="The directory of `silodp federation up` (flower-deploy).")
    ] = Path(".silodp-federation"),
) -> None:
    """Run an experiment: train every listed algorithm, write metrics, summaries and plots.

    Exit codes: 0 done, 2 bad input (nothing trained), 3 a privacy budget stopped a run (its
    model and results so far are kept)."""
    from silodp.engines import ENGINES
    from silodp.experiment import resume_experiment, run_experiment
    from silodp.ledger import BudgetExceededError

    if engine not in ENGINES:
        fail(f"Expected --engine to be one of {', '.join(ENGINES)}; got {engine!r}.")
    if on_failure not in ("abort", "skip"):
        fail(f"Expected --on-failure to be abort or skip; got {on_failure!r}.")
    if engine != "inprocess":
        _run_on_flower(config, out, engine, overwrite, resume, on_failure, timeout, federation)
        return
    if resume is not None:
        try:
            summary = resume_experiment(
                resume, progress=None if quiet else _progress, log=typer.echo
            )
        except BudgetExceededError as err:
            fail(str(err), code=BUDGET_EXIT_CODE)
        except (SilodpError, ProtocolError, ValueError, FileNotFoundError) as err:
            fail(str(err))
        _print_summary(summary, resume)
        return
    path = config or default_config_path()
    try:
        cfg = load_config(path)
        if ledger is not None:
            cfg = cfg.with_ledger(str(ledger))
    except SilodpError as err:
        fail(str(err))
    logging.basicConfig(level=logging.WARNING)
    typer.echo(f"silodp: running {cfg.name!r} ({', '.join(cfg.algorithms)}) from {path}")
    try:
        summary = run_experiment(
            cfg,
            out,
            overwrite=overwrite,
            progress=None if quiet else _progress,
            log=typer.echo,
        )
    except BudgetExceededError as err:
        fail(str(err), code=BUDGET_EXIT_CODE)
    except (SilodpError, ProtocolError, ValueError, FileNotFoundError) as err:
        fail(str(err))
    _print_summary(summary, out)


def _run_on_flower(
    config: Path | None,
    out: Path,
    engine: str,
    overwrite: bool,
    resume: Path | None,
    on_failure: str,
    timeout: float,
    federation: Path,
) -> None:
    """``silodp run --engine flower-sim|flower-deploy``."""
    from silodp.experiment.run import EXPERIMENT_FILE
    from silodp.ledger import BudgetExceededError

    path = (resume / EXPERIMENT_FILE) if resume is not None else (config or default_config_path())
    out = resume if resume is not None else out
    try:
        cfg = load_config(path)
    except SilodpError as err:
        fail(str(err))
    typer.echo(f"silodp: running {cfg.name!r} ({', '.join(cfg.algorithms)}) on {engine}")
    try:
        if engine == "flower-sim":
            from silodp.engines.flower.simulation import simulate

            summary = simulate(
                cfg,
                out,
                overwrite=overwrite,
                resume=resume is not None,
                timeout=timeout,
                on_failure=on_failure,
                log=typer.echo,
            )
        else:
            from silodp.engines.flower.deployment import submit

            summary = submit(
                path,
                out,
                directory=federation,
                overwrite=overwrite,
                resume=resume is not None,
                timeout=timeout,
                on_failure=on_failure,
                log=typer.echo,
            )
    except BudgetExceededError as err:
        fail(str(err), code=BUDGET_EXIT_CODE)
    except (SilodpError, ProtocolError, ValueError, FileNotFoundError) as err:
        fail(str(err))
    _print_summary(summary, out)


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    typer.echo(f"\nresults in {out}/")
    for item in summary["runs"]:
        eps = (
            ", ".join(
                f"{u}={'inf' if v is None else format(v, '.3g')}"
                for u, v in item["epsilon"].items()
            )
            or "not private"
        )
        acc = f"accuracy {item['test_accuracy']:.3f}"
        if item.get("personalised_accuracy") is not None:
            acc = (
                f"personalised accuracy {item['personalised_accuracy']:.3f}, "
                f"global {item['test_accuracy']:.3f}"
            )
        who = item.get("adversary")
        against = (
            ""
            if not who
            else (" against every party" if who == "strongest" else f" against {WHO[who]}")
        )
        typer.echo(
            f"  {item['algorithm']:>15}: {acc}  ε({eps}){against}"
            + (f" at δ={item['delta']:g}" if item["delta"] else "")
        )
        for who, unit, value in differing(item):
            typer.echo(f"  {'':>15}  against {WHO[who]}: ε({unit}={fmt(value)})")
        if item.get("noise", {}).get("mode") == "seeded":
            typer.echo(f"  {'':>15}  seeded: not for production")
    if any(item.get("status") == "budget_exhausted" for item in summary["runs"]):
        stopped = [
            item["algorithm"] for item in summary["runs"] if item["status"] == "budget_exhausted"
        ]
        typer.echo(f"privacy budget exhausted: {', '.join(stopped)} stopped early", err=True)
        raise typer.Exit(code=BUDGET_EXIT_CODE)


@app.command()
def describe(
    config: Annotated[Path, typer.Argument(help="Experiment TOML whose [data] to describe.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Describe a config's federated data: records per silo and subject, span, subjects."""
    from silodp.data.build import build_federated_data
    from silodp.data.describe import describe as describe_data
    from silodp.data.describe import format_description

    try:
        cfg = load_config(config)
        data = build_federated_data(cfg.data)
    except (SilodpError, FileNotFoundError) as err:
        fail(str(err))
    info = describe_data(data)
    typer.echo(json.dumps(info, indent=2) if as_json else format_description(info))


from silodp.cli.account import account  # noqa: E402  (registers the command)
from silodp.cli.audit import audit  # noqa: E402
from silodp.cli.federation import federation_app  # noqa: E402
from silodp.cli.ledger import ledger_app  # noqa: E402

app.command()(account)
app.command()(audit)
app.add_typer(ledger_app, name="ledger")
app.add_typer(federation_app, name="federation")


def main() -> None:  # pragma: no cover - console entry point
    app()
