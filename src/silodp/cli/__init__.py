"""The ``silodp`` command line: run experiments, describe data, account privacy.

Every :class:`~silodp.errors.SilodpError` (and a path that cannot be read or written) ends a
command with ``error: message`` and exit code 2, as does a bad option (``error: Invalid value
for '--steps': ...``); the commands parse, call the library and print, nothing more.

Importing this module (and so ``silodp --help`` and ``silodp run --help``) imports no heavy
library: torch, the experiment, the accounting, Flower, matplotlib and pandas are imported
inside the commands, and ``account`` and ``bench`` (whose options are generated from the
algorithms) are loaded only when they run or their own help is asked for.
"""

from __future__ import annotations

import importlib
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import click
import typer
from typer.core import TyperGroup

from silodp.cli.common import (
    BUDGET_EXIT_CODE,
    INTERRUPTED_EXIT_CODE,
    SILO_FAILURE_EXIT_CODE,
    TERMINATED_EXIT_CODE,
    Terminated,
    check_config_file,
    cli_messages,
    fail,
    progress,
    sigterm_interrupts,
    summary_table,
)
from silodp.errors import SilodpError
from silodp.io import check_writable_dir

__all__ = ["LAZY_COMMANDS", "MAX_TIMEOUT", "app", "main"]

#: commands loaded only when used: name -> (module, attribute, the help line ``silodp --help``
#: shows for it, which must be the first paragraph of the command's own help)
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "account": (
        "silodp.cli.account",
        "account",
        "What ε does a plan spend (--noise-multiplier), or what σ reaches an ε (--target-epsilon)?",
    ),
    "audit": (
        "silodp.cli.audit",
        "audit",
        "Audit the privacy of CONFIG's algorithms: train each with canaries, attack the "
        "released model, and print an empirical lower bound on ε (with its confidence) beside "
        "the claimed ε.",
    ),
    "sweep": (
        "silodp.cli.sweep",
        "sweep",
        "Run a sweep: every combination of a grid of config values and seeds, each an experiment.",
    ),
    "report": (
        "silodp.cli.report",
        "report",
        "Write one self-contained HTML report of a run's or a sweep's results (figures inside).",
    ),
    "bench": (
        "silodp.bench.cli",
        "bench_app",
        "Benchmarks: DP step speed, ULDP per-subject training, accounting, protocols.",
    ),
}

#: the order ``silodp --help`` lists the commands in (any other command follows)
ORDER = (
    "run",
    "sweep",
    "report",
    "describe",
    "account",
    "audit",
    "ledger",
    "federation",
    "bench",
)

#: the longest --timeout (seconds) ``silodp run`` accepts: one week
MAX_TIMEOUT = 7 * 24 * 3600.0

#: the engine that runs in this process (the others are Flower's)
IN_PROCESS = "inprocess"


class _Placeholder(click.Command):
    """What ``silodp --help`` lists for a command that is not loaded yet."""


def _load(name: str) -> click.Command:
    module, attribute, _ = LAZY_COMMANDS[name]
    obj = getattr(importlib.import_module(module), attribute)
    if isinstance(obj, typer.Typer):
        command: click.Command = typer.main.get_group(obj)
    else:
        single = typer.Typer()
        single.command(name=name)(obj)
        command = typer.main.get_command(single)
    command.name = name
    return command


class _Commands(TyperGroup):
    """The root command: loads the heavy commands on first use, and prints every usage error
    as one ``error: ...`` line (exit code 2) instead of a panel or a traceback."""

    _listing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, (_, _, help_line) in LAZY_COMMANDS.items():
            if name not in self.commands:
                self.add_command(_Placeholder(name, help=help_line), name)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if isinstance(command, _Placeholder) and not self._listing:
            command = _load(cmd_name)
            self.commands[cmd_name] = command
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True  # list the commands by their help lines, without loading them
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            with cli_messages():
                return super().main(args, prog_name, complete_var, False, **extra)
        try:
            with cli_messages():
                result = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:
            typer.echo(err.format_message(), err=True)
            sys.exit(err.exit_code)
        except click.UsageError as err:
            typer.secho(f"error: {err.format_message()}", fg=typer.colors.RED, err=True)
            if err.ctx is not None:
                typer.echo(f"Try '{err.ctx.command_path} --help' for help.", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            typer.secho(f"error: {err.format_message()}", fg=typer.colors.RED, err=True)
            sys.exit(err.exit_code)
        except click.Abort:
            typer.secho("error: aborted", fg=typer.colors.RED, err=True)
            sys.exit(INTERRUPTED_EXIT_CODE)
        except OSError as err:  # a path the command could not read or write
            typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
            sys.exit(2)
        sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Cross-silo federated learning with differential privacy at the record, silo or "
    "subject level.",
)


def _check_run_options(
    config: Path | None,
    engine: str,
    on_failure: str,
    timeout: float,
    out: Path,
    resume: Path | None,
    ledger: Path | None,
) -> None:
    """Everything about ``silodp run``'s options that can be checked before anything slow
    (importing torch, loading data, calibrating): a bad value is an error here, and nothing is
    written."""
    from silodp.engines import ENGINES

    if engine not in ENGINES:
        fail(f"Expected --engine to be one of {', '.join(ENGINES)}; got {engine!r}.")
    if on_failure not in ("abort", "skip"):
        fail(f"Expected --on-failure to be abort or skip; got {on_failure!r}.")
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        fail(
            f"Expected --timeout={timeout!r} to be a number of seconds in (0, {MAX_TIMEOUT:g}] "
            "(at most one week)."
        )
    if config is not None and resume is None:
        check_config_file(config)
    try:
        if resume is not None:
            if not resume.is_dir():
                raise SilodpError(
                    f"Expected --resume {str(resume)!r} to be the results directory of an "
                    "interrupted run; "
                    + ("it is not a directory." if resume.exists() else "it does not exist.")
                )
            check_writable_dir(resume, name="--resume")
        else:
            check_writable_dir(out, name="--out")
        if ledger is not None:
            if ledger.is_dir():
                raise SilodpError(
                    f"Expected --ledger {str(ledger)!r} to be a ledger file; it is a directory."
                )
            check_writable_dir(ledger.parent, name="--ledger's directory")
    except SilodpError as err:
        fail(str(err))


@app.command()
def run(
    config: Annotated[
        Path | None, typer.Argument(help="Experiment TOML; omitted: the built-in demo.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Results directory (default: runs/<CONFIG's file name without .toml>, "
            "runs/demo for the demo).",
        ),
    ] = None,
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
            "run's directory); overrides \\[privacy] ledger."
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Where the silos run: inprocess (one process), flower-sim (Flower's simulation "
            "engine, one virtual SuperNode per silo) or flower-deploy (the local federation "
            "of `silodp federation up`)."
        ),
    ] = IN_PROCESS,
    on_failure: Annotated[
        str,
        typer.Option(
            help="A silo that fails or times out in a round: abort the run, or skip it for the "
            "round where the algorithm allows it (Flower engines)."
        ),
    ] = "abort",
    timeout: Annotated[
        float,
        typer.Option(
            help="Seconds to wait for the silos' replies (Flower engines; at most one week)."
        ),
    ] = 600.0,
    federation: Annotated[
        Path, typer.Option(help="The directory of `silodp federation up` (flower-deploy).")
    ] = Path(".silodp-federation"),
    report: Annotated[
        bool | None,
        typer.Option(
            "--report/--no-report",
            help="Write OUT/report.html (as `silodp report` does) when the run ends; default: "
            "on for the built-in demo, off for a CONFIG.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run an experiment: train every listed algorithm, write metrics, summaries and plots.

    Progress goes to stderr: a bar per algorithm on a terminal, one line per round otherwise.
    Ctrl-C (or SIGTERM) stops the run, keeps every completed round and prints the command that
    continues it. Exit codes: 0 done, 2 bad input (nothing trained), 3 a privacy budget stopped
    a run (its model and results so far are kept), 4 a silo failed on flower-sim (the rounds
    before it are kept; the message gives the command that continues), 130 interrupted by
    Ctrl-C, 143 by SIGTERM."""
    if resume is not None:
        extra = [
            name
            for name, given in (
                ("CONFIG", config is not None),
                ("--out", out is not None),
                ("--overwrite", overwrite),
                ("--ledger", ledger is not None),
            )
            if given
        ]
        if extra:
            fail(
                f"Expected --resume {str(resume)!r} without {', '.join(extra)}: a resumed run "
                "continues with the config, results directory and ledger it started with "
                f"({str(resume / 'experiment.toml')!r})."
            )
    if out is None:
        out = Path("runs") / (config.stem if config is not None else "demo")
    _check_run_options(config, engine, on_failure, timeout, out, resume, ledger)
    target = resume if resume is not None else out
    restart = ["silodp", "run", *([str(config)] if config else []), "--out", str(out)]
    follow = [] if engine == IN_PROCESS else ["--engine", engine]
    if engine == "flower-deploy" and federation != Path(".silodp-federation"):
        follow += ["--federation", str(federation)]
    try:
        with sigterm_interrupts():
            if engine != IN_PROCESS:
                summary = _run_on_flower(
                    config, out, engine, overwrite, resume, on_failure, timeout, federation, ledger
                )
            else:
                summary = _run_in_process(config, out, overwrite, quiet, resume, ledger)
    except KeyboardInterrupt as stop:
        _interrupted(target, follow, restart, terminated=isinstance(stop, Terminated))
    written = None
    if report if report is not None else (config is None and resume is None):
        written = _write_report(target)
    _print_summary(summary, target, written)


def _write_report(results: Path) -> Path | None:
    """``results/report.html``; a failure is a warning (the run's results are already kept)."""
    from silodp.html_report import write_report

    typer.echo("writing the HTML report...", err=True)
    try:
        return write_report(results, results / "report.html")
    except (SilodpError, OSError, ValueError, KeyError) as err:
        typer.secho(f"warning: no report written: {err}", fg=typer.colors.YELLOW, err=True)
        return None


def _fail_on(err: BaseException) -> NoReturn:
    from silodp.ledger import BudgetExceededError

    if isinstance(err, BudgetExceededError):
        fail(str(err), code=BUDGET_EXIT_CODE)
    fail(str(err))


def _errors() -> tuple[type[BaseException], ...]:
    """What a run raises for bad input or an environment it cannot use."""
    from silodp.crypto.errors import ProtocolError

    return (SilodpError, ProtocolError, ValueError, OSError)


def _run_in_process(
    config: Path | None,
    out: Path,
    overwrite: bool,
    quiet: bool,
    resume: Path | None,
    ledger: Path | None,
) -> dict[str, Any]:
    from silodp.config import default_config_path, load_config
    from silodp.experiment import resume_experiment, run_experiment

    errors = _errors()
    bars = None if quiet else progress
    if resume is not None:
        try:
            return resume_experiment(resume, progress=bars, log=typer.echo)
        except errors as err:
            _fail_on(err)
    path = config or default_config_path()
    try:
        cfg = load_config(path)
        if ledger is not None:
            cfg = cfg.with_ledger(str(ledger.expanduser().absolute()))
    except (SilodpError, OSError) as err:
        fail(str(err))
    typer.echo(f"silodp: running {cfg.name!r} ({', '.join(cfg.algorithms)}) from {path}")
    try:
        return run_experiment(cfg, out, overwrite=overwrite, progress=bars, log=typer.echo)
    except errors as err:
        _fail_on(err)


def _interrupted(
    out: Path, follow: list[str], restart: list[str], *, terminated: bool = False
) -> NoReturn:
    """After Ctrl-C (or SIGTERM): what the run kept, and the command that continues it; exit
    code 130 (143)."""
    from silodp.experiment.run import EXPERIMENT_FILE, kept_runs

    typer.echo("", err=True)
    names: tuple[str, ...] = ()
    resumable = (out / EXPERIMENT_FILE).is_file()
    dp_scaling = False
    if resumable:
        try:
            from silodp.config import load_config

            started = load_config(out / EXPERIMENT_FILE, written=True)
            names, dp_scaling = started.algorithms, started.data.scaling == "dp"
        except (SilodpError, OSError):
            pass
    kept = kept_runs(out, names) if out.is_dir() else []
    trained = [r for r in kept if r["rounds_kept"] > 0]
    by = "SIGTERM" if terminated else "Ctrl-C"
    typer.echo(
        f"interrupted: stopped by {by}; kept in {out}/ (every completed round is checkpointed):"
        if trained
        else f"interrupted: stopped by {by} before any round completed; nothing trained in {out}/",
        err=True,
    )
    for item in kept:
        planned = item["rounds_planned"]
        of = f" of {planned}" if planned else ""
        if item["status"] == "not started":
            what = "not started"
        elif item["status"] in ("complete", "budget_exhausted"):
            what = f"{item['status'].replace('_', ' ')}, {item['rounds_kept']}{of} rounds"
        else:
            what = f"interrupted, {item['rounds_kept']}{of} rounds checkpointed"
        typer.echo(f"  {item['run']}: {what}", err=True)
    if resumable and not dp_scaling:
        command = shlex.join(["silodp", "run", "--resume", str(out), *follow])
        typer.echo(f"continue with: {command}", err=True)
    else:
        why = (
            "[data] scaling = 'dp' draws its statistics again on every start, so this run "
            "cannot be resumed"
            if dp_scaling
            else "it stopped before its runs were prepared"
        )
        command = shlex.join([*restart, *follow, *(["--overwrite"] if dp_scaling else [])])
        typer.echo(f"{why}; start again with: {command}", err=True)
    raise typer.Exit(code=TERMINATED_EXIT_CODE if terminated else INTERRUPTED_EXIT_CODE)


def _run_on_flower(
    config: Path | None,
    out: Path,
    engine: str,
    overwrite: bool,
    resume: Path | None,
    on_failure: str,
    timeout: float,
    federation: Path,
    ledger: Path | None,
) -> dict[str, Any]:
    """``silodp run --engine flower-sim|flower-deploy`` (``ledger``: ``--ledger``, which every
    run writes through, wherever the server runs)."""
    from silodp.config import default_config_path, load_config
    from silodp.experiment.run import EXPERIMENT_FILE

    path = (resume / EXPERIMENT_FILE) if resume is not None else (config or default_config_path())
    out = resume if resume is not None else out
    try:
        cfg = load_config(path, written=resume is not None)
        if ledger is not None:
            cfg = cfg.with_ledger(str(ledger.resolve()))
    except (SilodpError, OSError) as err:
        fail(str(err))
    typer.echo(f"silodp: running {cfg.name!r} ({', '.join(cfg.algorithms)}) on {engine}")
    try:
        if engine == "flower-sim":
            from silodp.engines.flower.simulation import simulate
            from silodp.engines.remote import SiloFailureError

            try:
                return simulate(
                    cfg,
                    out,
                    overwrite=overwrite,
                    resume=resume is not None,
                    timeout=timeout,
                    on_failure=on_failure,
                    log=typer.echo,
                )
            except SiloFailureError as err:  # rounds ran, and were charged, before it
                fail(
                    f"{err}\nThe rounds completed before it are kept, and what was charged is "
                    f"in the ledger; continue with: silodp run --resume {out} --engine "
                    "flower-sim",
                    code=SILO_FAILURE_EXIT_CODE,
                )
        from silodp.engines.flower.deployment import submit

        return submit(
            path,
            out,
            ledger=ledger,
            directory=federation,
            overwrite=overwrite,
            resume=resume is not None,
            timeout=timeout,
            on_failure=on_failure,
            log=typer.echo,
        )
    except _errors() as err:
        _fail_on(err)


def _print_summary(summary: dict[str, Any], out: Path, report: Path | None = None) -> None:
    typer.echo(f"\nresults in {out}/")
    for line in summary_table(summary):
        typer.echo(line)
    if report is not None:
        typer.echo(f"report: {report}")
    if any(item.get("status") == "budget_exhausted" for item in summary["runs"]):
        stopped = [
            item["algorithm"] for item in summary["runs"] if item["status"] == "budget_exhausted"
        ]
        typer.echo(f"privacy budget exhausted: {', '.join(stopped)} stopped early", err=True)
        raise typer.Exit(code=BUDGET_EXIT_CODE)


@app.command()
def describe(
    config: Annotated[Path, typer.Argument(help="Experiment TOML whose \\[data] to describe.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Describe a config's federated data: records per silo and subject, span, subjects.

    The counts are exact (no noise, covered by no ε) and name subjects by their ids: keep
    them among the data's holders, as silo_private/ says of a run's copy."""
    from silodp.config import load_config
    from silodp.data.build import build_federated_data
    from silodp.data.describe import describe as describe_data
    from silodp.data.describe import format_description
    from silodp.experiment.prepare import privacy_caps

    check_config_file(config)
    try:
        cfg = load_config(config)
        data = build_federated_data(cfg.data)
        caps = privacy_caps(cfg, data)
    except (SilodpError, OSError) as err:
        fail(str(err))
    info = {**describe_data(data), "privacy_caps": caps}
    if cfg.data.scaling == "dp":  # the data is returned unscaled: a run estimates it
        info["scaling"] = "dp (estimated with DP when a run starts; not applied here)"
    info["privacy_note"] = DESCRIBE_NOTE
    if as_json:
        typer.echo(json.dumps(info, indent=2))
    else:
        typer.echo(format_description(info) + f"\nNote: {DESCRIBE_NOTE}.")


#: what ``silodp describe`` prints is not covered by any ε
DESCRIBE_NOTE = (
    "these counts are exact (no noise; no ε covers them) and name subjects by their ids: "
    "keep them among the data's holders"
)


from silodp.cli.federation import federation_app  # noqa: E402
from silodp.cli.ledger import ledger_app  # noqa: E402

app.add_typer(ledger_app, name="ledger")
app.add_typer(federation_app, name="federation")


def main() -> None:  # pragma: no cover - console entry point
    app()
