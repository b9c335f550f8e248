"""``silodp report``: one self-contained HTML file of an experiment's or a sweep's results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from silodp.cli.common import fail

__all__ = ["report"]


def report(
    results: Annotated[Path, typer.Argument(help="What silodp run or silodp sweep wrote (--out).")],
    out: Annotated[Path, typer.Option(help="The HTML file to write.")] = Path("report.html"),
    public: Annotated[
        bool,
        typer.Option(
            help="Leave out the silo-private section (the data's exact counts); refused for "
            "runs whose group bound k was taken from the data (k is not public)."
        ),
    ] = False,
) -> None:
    """Write one self-contained HTML report of a run's or a sweep's results (figures inside).

    Beside OUT it writes OUT_files/ with the figures as PNG and the tables as CSV and markdown.
    It computes no ε itself: every number is copied from the results. An experiment's report
    has a section of silo-private data counts, marked so: keep it inside the consortium, or
    write the report with --public, which leaves it out."""
    from silodp.errors import SilodpError
    from silodp.html_report import write_report
    from silodp.io import check_writable_dir

    if out.is_dir():
        fail(
            f"Expected --out {str(out)!r} to be the HTML file to write; it is a directory "
            f"(give a file path, e.g. --out {str(out / 'report.html')!r})."
        )
    try:
        check_writable_dir(out.parent if str(out.parent) else Path("."), name="--out's directory")
        path = write_report(results, out, public=public)
    except (SilodpError, OSError, ValueError, KeyError) as err:
        fail(str(err))
    typer.echo(
        f"report: {path} (figures and tables also in {path.with_name(path.stem + '_files')}/)"
    )
