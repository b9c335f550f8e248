"""``silodp bench``: speed and memory measured side by side in one run."""

from __future__ import annotations

import typer

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: DP step speed, ULDP per-subject training, accounting, protocols.",
)
