"""One self-contained HTML report of an experiment or a sweep (figures embedded, no network).

``write_report(DIR, OUT.html)`` reads what ``silodp run`` or ``silodp sweep`` wrote in DIR and
writes OUT.html, with every figure inside it as a PNG data URI and no external resource, and
beside it ``OUT_files/`` holding the same figures as PNG and the tables as CSV and markdown.
It computes no privacy number: every ε shown is copied from the runs' summaries, which the
ledgers back.

An experiment's report: the table of final numbers; per unit ε side by side (record against
subject: what item-level DP leaves of a subject); the comparison and each run's figures; the
data's distribution (from ``silo_private/``: un-noised, for the consortium only, and marked
so); the resolved configs; the ledgers' totals. A sweep's report: its table (mean ± std over
seeds, the non-private baseline first) and final utility against ε per algorithm.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from silodp import plotting
from silodp.errors import InvalidValueError
from silodp.io import atomic_write, write_text
from silodp.reports import columns_of, rows_csv

__all__ = ["write_report"]

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc;
padding: 0.3em 0.6em; text-align: right; } th { background: #f3f3f3; }
td:first-child, th:first-child { text-align: left; } img { max-width: 100%; }
.private { border-left: 4px solid #c33; padding-left: 1em; } pre { background: #f7f7f7;
padding: 0.8em; overflow-x: auto; } figure { margin: 1em 0; }
"""


def write_report(results_dir: str | Path, out: str | Path, *, public: bool = False) -> Path:
    """Writes the report of the experiment or sweep in ``results_dir`` to ``out``;
    ``public`` leaves out the silo-private section (the data's exact counts).

    Raises:
      InvalidValueError: ``results_dir`` holds neither an experiment nor a sweep.
    """
    src, out = Path(results_dir), Path(out)
    files = out.with_name(out.stem + "_files")
    if (src / "grid.json").is_file():
        body = _sweep(src, files)
    elif (src / "summary.json").is_file() and "runs" in _json(src / "summary.json"):
        body = _experiment(src, files, public=public)
    else:
        raise InvalidValueError(
            f"Expected {str(src)!r} to hold the results of silodp run (summary.json with its "
            "runs) or silodp sweep (grid.json)."
        )
    title = html.escape(body[0])
    page = (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{STYLE}</style></head><body><h1>{title}</h1>\n{body[1]}\n</body></html>\n"
    )
    return write_text(out, page)


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _figure(path: Path, caption: str, files: Path | None = None, name: str = "") -> str:
    """``path`` embedded as a data URI (and copied into ``files`` as ``name``, if given)."""
    raw = path.read_bytes()
    if files is not None and name:
        atomic_write(files / name, lambda tmp: tmp.write_bytes(raw))
    data = base64.b64encode(raw).decode("ascii")
    return (
        f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _save_tables(
    files: Path, name: str, rows: Sequence[Mapping[str, Any]], columns: list[str]
) -> None:
    write_text(files / f"{name}.csv", rows_csv(rows, columns))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    write_text(files / f"{name}.md", "\n".join(lines) + "\n")


# --- an experiment ----------------------------------------------------------------------------


def _final_rows(summary: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    units = sorted({u for r in summary["runs"] for u in (r.get("epsilon") or {})})
    rows = []
    for run in summary["runs"]:
        row = {
            "algorithm": run["algorithm"],
            "status": run.get("status"),
            "rounds": run.get("rounds_completed"),
            "test accuracy": run.get("test_accuracy"),
            **{f"ε ({u})": (run.get("epsilon") or {}).get(u) for u in units},
            "σ": run.get("noise_multiplier"),
            "against": run.get("adversary") if run.get("epsilon") else None,
        }
        rows.append(row)
    columns = ["algorithm", "status", "rounds", "test accuracy", *(f"ε ({u})" for u in units)]
    return rows, [*columns, "σ", "against"]


def _experiment(src: Path, files: Path, *, public: bool = False) -> tuple[str, str]:
    summary = _json(src / "summary.json")
    rows, columns = _final_rows(summary)
    _save_tables(files, "final", rows, columns)
    parts = [
        "<h2>Final numbers</h2>",
        _table(rows, columns),
        "<p>ε is each run's final ε against the adversary named (its ledger's total); "
        "test accuracy is on the held-out split, which no ε covers.</p>",
    ]
    by_unit = files / "epsilon_by_unit.png"
    if plotting.plot_units(summary["runs"], by_unit) is not None:
        parts += [
            "<h2>ε per unit</h2>",
            _figure(
                by_unit,
                "final ε at each unit an algorithm "
                "reports: a record-level guarantee leaves a subject with many records far "
                "less protected",
            ),
        ]
    if (src / "comparison.png").is_file():
        parts += [
            "<h2>Utility and ε against round</h2>",
            _figure(src / "comparison.png", "all algorithms", files, "comparison.png"),
        ]
    for run in summary["runs"]:
        name = run["algorithm"]
        run_dir = src / name
        parts.append(f"<h3>{html.escape(name)}</h3>")
        for figure, caption in (
            ("accuracy_loss.png", "accuracy and loss"),
            ("epsilon.png", "ε per unit against round"),
        ):
            if (run_dir / figure).is_file():
                parts.append(
                    _figure(run_dir / figure, f"{name}: {caption}", files, f"{name}_{figure}")
                )
        if (run_dir / "config.toml").is_file():
            parts.append(
                f"<details><summary>resolved config</summary><pre>"
                f"{html.escape((run_dir / 'config.toml').read_text())}</pre></details>"
            )
        ledger = run_dir / "ledger.sqlite"
        if ledger.is_file():
            parts.append(_ledger_totals(ledger))
    data = src / "silo_private" / "data.json"
    if data.is_file() and not public:
        spread = files / "data_distribution.png"
        plotting.plot_data_distribution(_json(data), spread)
        parts += [
            "<div class='private'><h2>The data (silo-private)</h2><p>Exact, un-noised "
            "counts: no ε covers them; keep this section inside the consortium.</p>",
            _figure(spread, "records per silo, records per subject, silos per subject"),
            "</div>",
        ]
    return str(summary.get("name", src.name)), "\n".join(parts)


def _ledger_totals(path: Path) -> str:
    from silodp.ledger.report import ledger_report

    report = ledger_report(path)
    rows = [
        {
            "ledger total": kind,
            "runs": len(total["runs"]),
            **{f"ε ({u})": v for u, v in total["epsilon"].items()},
        }
        for kind, total in report["total"].items()
    ]
    columns = sorted({c for r in rows for c in r}, key=lambda c: (c != "ledger total", c))
    return "<p>Ledger (events read back and composed):</p>" + _table(rows, columns)


# --- a sweep ------------------------------------------------------------------------------------


def _sweep(src: Path, files: Path) -> tuple[str, str]:
    summary = _json(src / "summary.json") if (src / "summary.json").is_file() else {}
    rows = summary.get("rows") or []
    columns = columns_of(rows)
    _save_tables(files, "results", rows, columns)
    parts = ["<h2>Results (mean and standard deviation over seeds)</h2>", _table(rows, columns)]
    figure = files / "utility_vs_epsilon.png"
    if plotting.plot_utility_vs_epsilon(rows, figure) is not None:
        parts += [
            _figure(
                figure,
                "final test accuracy against final ε (mean ± std over "
                "seeds); dashed: the non-private baseline",
            )
        ]
    cells = _json(src / "grid.json")["cells"]
    parts.append(
        f"<p>{len(cells)} cells in {html.escape(str(src / 'cells'))}; each is an "
        "experiment: run <code>silodp report</code> on one for its figures.</p>"
    )
    return str(summary.get("name", src.name)), "\n".join(parts)
