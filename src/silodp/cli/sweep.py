"""``silodp sweep``: a grid of experiments over any config keys, with a non-private baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from silodp.cli.common import (
    INTERRUPTED_EXIT_CODE,
    TERMINATED_EXIT_CODE,
    SweepProgress,
    Terminated,
    fail,
    sigterm_interrupts,
)

__all__ = ["sweep"]


def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="Sweep TOML: base config, \\[grid], seeds.")],
    out: Annotated[Path, typer.Option(help="Results directory of the sweep.")] = Path("runs/sweep"),
    overwrite: Annotated[
        bool, typer.Option(help="Run every cell again, replacing another sweep's results.")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress view.")] = False,
) -> None:
    """Run a sweep: every combination of a grid of config values and seeds, each an experiment.

    SWEEP_FILE names a base config (relative to it) and a \\[grid] of keys (``algorithms``,
    ``privacy.epsilon``, ``data.num_silos``, any config key) with their values; ``seeds``
    repeats every cell; ``baseline = true`` (the default) adds a non-private ``fedavg`` cell per
    grid point. Run the same command again to continue an interrupted sweep: finished cells
    are kept. Progress (unless --quiet): one view of the whole sweep on stderr, the cell
    running, rounds done of every round planned, time elapsed and left; a bar on a terminal,
    plain lines otherwise. Writes OUT/cells/<cell>/ (each an experiment), OUT/results.csv and
    OUT/results.md (accuracy: mean ± std over seeds; ε: the largest over seeds). Exit codes:
    0 done, 2 bad input, 130/143 interrupted."""
    from silodp.errors import OutputExistsError, SilodpError
    from silodp.experiment.grid import expand, load_grid, run_grid
    from silodp.io import check_writable_dir
    from silodp.ledger.run import BudgetExceededError

    try:
        check_writable_dir(out, name="--out")
        spec = load_grid(sweep_file)
    except (SilodpError, OSError) as err:
        fail(str(err))
    typer.echo(f"silodp: sweep {spec.name!r}: {len(expand(spec))} cells from {sweep_file}")
    view = None if quiet else SweepProgress()
    try:
        with sigterm_interrupts():
            try:
                summary = run_grid(
                    spec,
                    out,
                    overwrite=overwrite,
                    progress=None if view is None else view.run,
                    log=typer.echo if view is None else view.log,
                    on_cell=None if view is None else view.cell,
                )
            finally:  # the bar ends before any message below
                if view is not None:
                    view.close()
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        typer.echo(
            f"interrupted: stopped by {'SIGTERM' if terminated else 'Ctrl-C'}; finished cells "
            f"are kept in {out}/cells/.\ncontinue with: silodp sweep {sweep_file} --out {out}",
            err=True,
        )
        raise typer.Exit(TERMINATED_EXIT_CODE if terminated else INTERRUPTED_EXIT_CODE) from None
    except OutputExistsError as err:  # nothing ran: another sweep's results are in the way
        fail(str(err))
    except BudgetExceededError as err:  # running it again would meet the same budget
        fail(
            f"{err} (finished cells are kept in {out}/cells/; {out}/results.md tabulates them, "
            "marked partial, with each shared ledger's total; the budget declared on the ledger "
            "binds every later run there)"
        )
    except (SilodpError, ValueError, OSError) as err:
        fail(f"{err} (finished cells are kept in {out}/cells/; run the command again to continue)")
    typer.echo(f"\n{summary['cells']} cells; table in {out}/results.md and {out}/results.csv")
    typer.echo((out / "results.md").read_text(encoding="utf-8"))
