"""One self-contained HTML report of an experiment or a sweep (figures embedded, no network).

``write_report(DIR, OUT.html)`` reads what ``silodp run`` or ``silodp sweep`` wrote in DIR and
writes OUT.html, with every figure inside it as a PNG data URI and no external resource, and
beside it ``OUT_files/`` holding the same figures as PNG and the tables as CSV and markdown.
It computes no privacy number: every ε shown is copied from the runs' summaries, which the
ledgers back.

An experiment's report: the table of final numbers; per unit ε side by side (record against
subject: what item-level DP leaves of a subject); the comparison and each run's figures
(the subject sub-sampling rate of a ULDP run); PriFedSync's personalised against global
accuracy per round; the data's distribution and the ULDP runs' subject weights ``w_{s,a}``
and subjects trained per round (from ``silo_private/``: un-noised, for the consortium only,
and marked so); the resolved configs; the ledgers' totals. A sweep's report: its table
(mean ± std over seeds, the non-private baseline first), final utility against ε per
algorithm and, for PriFedSync, personalised against global accuracy per round (mean ± std
over seeds).
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
import os
import shutil
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from silodp import display, plotting
from silodp.errors import InvalidValueError
from silodp.io import atomic_write, write_text
from silodp.reports import columns_of, rows_csv

__all__ = ["write_report"]

#: the runs' silo-private directory (``silodp.experiment.record.PRIVATE_DIR``, named here so
#: that a report needs no torch)
PRIVATE_DIR = "silo_private"
#: what an experiment writes once prepared (``silodp.experiment.run.EXPERIMENT_FILE``)
EXPERIMENT_FILE = "experiment.toml"

#: the mark in every report's head by which a later report knows it may replace the file
GENERATOR = "<meta name='generator' content='silodp report'>"

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
      InvalidValueError: ``results_dir`` holds neither an experiment nor a sweep, or ``out``
        (or ``out``'s ``_files`` directory) is not a path a file (a directory) can be written
        to; both are found before anything is written.
    """
    src, out = Path(results_dir), Path(out)
    files = out.with_name(out.stem + "_files")
    if out.is_dir():
        raise InvalidValueError(
            f"Expected the report {str(out)!r} to be an HTML file to write; it is a directory."
        )
    if os.path.lexists(files) and not files.is_dir():
        raise InvalidValueError(
            f"Expected {str(files)!r} to be the directory of the report's figures and tables; "
            "it is not a directory."
        )
    _check_replaceable(out, files, own=out.resolve() == (src / "report.html").resolve())
    if (src / "grid.json").is_file():
        from silodp.experiment.grid import unfinished_cells

        unfinished = unfinished_cells(src)
        if unfinished or not (src / "summary.json").is_file():
            raise InvalidValueError(
                f"Expected {str(src)!r} to hold a finished sweep; "
                + (
                    f"{len(unfinished)} of its cells ({', '.join(unfinished[:3])}"
                    + (", ..." if len(unfinished) > 3 else "")
                    + ") have not finished"
                    if unfinished
                    else "its tables were not written"
                )
                + ". Run the same `silodp sweep SWEEP_FILE --out "
                f"{src}` again to continue it (finished cells are kept), then write its report."
            )
        if public:  # every cell is an experiment
            for cell in sorted((src / "cells").glob("*/summary.json")):
                _check_public(_json(cell))
        build = _sweep
    elif (src / "summary.json").is_file() and "runs" in _json(src / "summary.json"):
        runs = _json(src / "summary.json")["runs"]
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise InvalidValueError(
                f"Expected {str(src / 'summary.json')!r} to list its runs as silodp writes "
                f"them (a list of objects); its runs are {type(runs).__name__}."
            )
        if public:
            _check_public(_json(src / "summary.json"))
        build = functools.partial(_experiment, public=public)
    else:
        stopped = (src / EXPERIMENT_FILE).is_file()
        raise InvalidValueError(
            f"Expected {str(src)!r} to hold the results of silodp run (summary.json with its "
            "runs) or silodp sweep (grid.json)"
            + ("; it does not exist." if not src.exists() else ".")
            + (
                f" It holds an experiment that has not finished: continue it with "
                f"`silodp run --resume {src}`, then write its report."
                if stopped
                else ""
            )
        )
    # the figures and tables go to a fresh directory that replaces the old one whole: files
    # of an earlier report (e.g. the silo-private ones a --public report leaves out) go too
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{files.name}.", dir=out.parent))
    try:
        title, content = build(src, staging)
        title = html.escape(title)
        page = (
            f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>{GENERATOR}"
            f"<title>{title}</title>"
            f"<style>{STYLE}</style></head><body><h1>{title}</h1>\n{content}\n</body></html>\n"
        )
        written = write_text(out, page)
        if files.is_dir():
            shutil.rmtree(files)
        os.replace(staging, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _check_public(summary: Mapping[str, Any]) -> None:
    """Refuses a public report of runs whose group bound k was taken from the data: k is not
    public, and the report would show it (the resolved config, the account command) and
    every ε computed from it."""
    from_data = [
        r["algorithm"]
        for r in summary.get("runs", [])
        if str(r.get("group_size_source") or "").startswith("data")
    ]
    if from_data:
        raise InvalidValueError(
            f"Expected the runs of a --public report to use a public group bound; {from_data} "
            "took privacy.group_size from the data, which is not public (the report would show "
            "it and the ε computed from it). Set privacy.group_size to a public number and "
            "run again, or write the report without --public for the consortium."
        )


def _is_report(path: Path) -> bool:
    """Whether ``path`` is a file this module wrote (its head names the generator)."""
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return (
        path.is_file()
        and not path.is_symlink()
        and (GENERATOR.encode() in head or head.startswith(_OLDER_HEAD))
    )


#: how reports began before they carried :data:`GENERATOR`
_OLDER_HEAD = b"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>"


def _check_replaceable(out: Path, files: Path, *, own: bool) -> None:
    """Refuses to write over a file that is not a report (e.g. ``--out DIR/summary.json``)
    or into a ``_files`` directory beside no report; ``own``: ``out`` is the results' own
    ``report.html``, which ``silodp run`` rewrites (older runs wrote it without the mark)."""
    if os.path.lexists(out) and not (own and not out.is_symlink()) and not _is_report(out):
        raise InvalidValueError(
            f"Expected --out {str(out)!r} to be a new file or a report silodp wrote; it exists "
            "and is not one. Give another path (nothing was written)."
        )
    if files.is_dir() and any(files.iterdir()) and not (own or _is_report(out)):
        raise InvalidValueError(
            f"Expected {str(files)!r} (where the report's figures and tables go) to be new or "
            f"to belong to the report {str(out)!r}; it holds files and that report does not "
            "exist. Remove it or give another --out (nothing was written)."
        )
    foreign = [p.name for p in files.iterdir() if not _is_output(p)] if files.is_dir() else []
    if foreign:
        raise InvalidValueError(
            f"Expected {str(files)!r} to hold only a report's figures and tables, which a new "
            f"report replaces; it also holds {sorted(foreign)[:5]}. Move them or give another "
            "--out (nothing was written)."
        )


def _is_output(path: Path) -> bool:
    """Whether ``path`` is a file a report writes into its ``_files`` directory."""
    return path.is_file() and not path.is_symlink() and path.suffix in (".png", ".csv", ".md")


def _json(path: Path) -> Any:
    """The JSON file at ``path``; one that cannot be read is an error naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidValueError(
            f"Expected {str(path)!r} to be a JSON file silodp wrote; it cannot be read ({err})."
        ) from None


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
        "<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c), c))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _bound(epsilon: Mapping[str, float | None], unit: str) -> float | None:
    """A unit's ε from a summary or ledger mapping: ``inf`` where the unit is there without a
    finite bound (written as ``null``: no guarantee), ``None`` ("-") where it is not there."""
    if unit not in epsilon:
        return None
    value = epsilon[unit]
    return math.inf if value is None else float(value)


def _cell(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        # privacy bounds, and σ (copied into a config, it reaches the run's ε or less): up
        if column.startswith(("ε", "epsilon")) or column == "σ":
            return display.upper(value, 4)
        return f"{value:.4g}"
    return str(value)


def _save_tables(
    files: Path, name: str, rows: Sequence[Mapping[str, Any]], columns: list[str]
) -> None:
    write_text(files / f"{name}.csv", rows_csv(rows, columns))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c), c) for c in columns) + " |" for r in rows]
    write_text(files / f"{name}.md", "\n".join(lines) + "\n")


# --- an experiment ----------------------------------------------------------------------------

#: the final-table columns of PriFedSync's two accuracies, and the summary keys they copy
PERSONAL = {
    "personalised accuracy": "personalised_accuracy",
    "global accuracy": "global_accuracy",
}


def _final_rows(summary: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    units = sorted({u for r in summary["runs"] for u in (r.get("epsilon") or {})})
    # PriFedSync: the personalised models' and the global model's mean accuracy over clients
    personal = [c for c in PERSONAL if any(r.get(PERSONAL[c]) is not None for r in summary["runs"])]
    # a run whose released model (its last round's) was not evaluated: the accuracy's round
    earlier = any(
        r.get("test_accuracy_round") not in (None, r.get("rounds_completed"))
        for r in summary["runs"]
    )
    rows = []
    for run in summary["runs"]:
        row = {
            "algorithm": run["algorithm"],
            "status": run.get("status"),
            "rounds": run.get("rounds_completed"),
            "test accuracy": run.get("test_accuracy"),
            **({"accuracy of round": run.get("test_accuracy_round")} if earlier else {}),
            **{c: run.get(PERSONAL[c]) for c in personal},
            **{f"ε ({u})": _bound(run.get("epsilon") or {}, u) for u in units},
            "σ": run.get("noise_multiplier"),
            "δ": run.get("delta") if run.get("epsilon") else None,
            "against": run.get("adversary") if run.get("epsilon") else None,
        }
        rows.append(row)
    columns = ["algorithm", "status", "rounds", "test accuracy"]
    columns += ["accuracy of round", *personal] if earlier else personal
    return rows, [*columns, *(f"ε ({u})" for u in units), "σ", "δ", "against"]


def _experiment(src: Path, files: Path, *, public: bool = False) -> tuple[str, str]:
    summary = _json(src / "summary.json")
    rows, columns = _final_rows(summary)
    _save_tables(files, "final", rows, columns)
    parts = [
        "<h2>Final numbers</h2>",
        _table(rows, columns),
        "<p>ε is each run's final ε against the adversary named, composed from the events its "
        "ledger holds for it (a shared ledger's total over every run on it is listed with "
        "each run below; inf: no finite guarantee at that unit against that adversary; -: the "
        "algorithm reports no ε at that unit); test accuracy is on the held-out split, which "
        "no ε covers.</p>",
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
    parts += _personalised(src, summary["runs"], files)
    for run in summary["runs"]:
        name = run["algorithm"]
        run_dir = src / name
        parts.append(f"<h3>{html.escape(name)}</h3>")
        sampling = _subject_rate(run_dir)
        if sampling:
            parts.append(f"<p>{html.escape(sampling)}</p>")
        for figure, caption in (
            ("accuracy_loss.png", "accuracy and loss"),
            ("epsilon.png", "ε per unit against round"),
        ):
            if (run_dir / figure).is_file():
                parts.append(
                    _figure(
                        run_dir / figure,
                        f"{name}: {caption}",
                        files,
                        # one file beside the others (a sweep cell's name holds a "/")
                        f"{name.replace('/', '_')}_{figure}",
                    )
                )
        if (run_dir / "config.toml").is_file():
            config_text = (run_dir / "config.toml").read_text(encoding="utf-8")
            parts.append(
                f"<details><summary>resolved config</summary><pre>"
                f"{html.escape(config_text)}</pre></details>"
            )
        ledger = _run_ledger(run_dir)
        if ledger is not None:
            parts.append(_ledger_totals(*ledger))
        if run.get("notes"):  # what its numbers mean: a resume's extra rounds, seeded coins
            items = "".join(f"<li>{html.escape(str(note))}</li>" for note in run["notes"])
            parts.append(f"<details><summary>notes</summary><ul>{items}</ul></details>")
    if not public:
        parts += _private(src, summary["runs"], files)
    return str(summary.get("name", src.name)), "\n".join(parts)


def _private(src: Path, runs: Sequence[Mapping[str, Any]], files: Path) -> list[str]:
    """The silo-private section: the data's distribution, and each weighted ULDP run's subject
    weights and subjects trained per round (from the runs' ``silo_private/``)."""
    parts = []
    data = src / PRIVATE_DIR / "data.json"
    if data.is_file():
        spread = files / "data_distribution.png"
        plotting.plot_data_distribution(_json(data), spread)
        parts.append(_figure(spread, "records per silo, records per subject, silos per subject"))
    for run in runs:
        parts += _subject_weights(src / run["algorithm"], run["algorithm"], files)
    if not parts:
        return []
    return [
        "<div class='private'><h2>The data (silo-private)</h2><p>Exact, un-noised "
        "counts: no ε covers them; keep this section inside the consortium.</p>",
        *parts,
        "</div>",
    ]


def _subject_rate(run_dir: Path) -> str | None:
    """The public sentence on a run's subject sub-sampling (its resolved config's
    ``subject_rate`` and ``subject_sampler``), if it samples subjects."""
    path = run_dir / "config.toml"
    if not path.is_file():
        return None
    privacy = tomllib.loads(path.read_text(encoding="utf-8")).get("privacy", {})
    rate = privacy.get("subject_rate")
    if rate is None:
        return None
    if rate >= 1:
        return "Subject sub-sampling: none (q = 1): every subject takes part in every round."
    who = privacy.get("subject_sampler", "server")
    return (
        f"Subject sub-sampling: each subject is in a round's sample with probability "
        f"q = {rate:g} (Poisson), drawn by the {who}."
    )


def _subject_weights(run_dir: Path, name: str, files: Path) -> list[str]:
    """A weighted ULDP run's subject weights (figure and table of its histograms) and its
    subjects trained per round, from ``run_dir/silo_private/``; nothing for other runs."""
    path = run_dir / PRIVATE_DIR / "summary.json"
    private = _json(path) if path.is_file() else {}
    weights_info, sampling = private.get("subject_weights"), private.get("subject_sampling")
    if not weights_info and not sampling:
        return []
    parts = [f"<h3>{html.escape(name)}: subject weights and subject sampling</h3>"]
    holds = None
    if weights_info and (run_dir / PRIVATE_DIR / weights_info["file"]).is_file():
        import numpy as np

        with np.load(run_dir / PRIVATE_DIR / weights_info["file"]) as saved:
            weights, holds = saved["weights"], saved["holds"]
        figure = files / f"{name}_subject_weights.png"
        plotting.plot_subject_weights(weights, holds, figure, f"{name}: subject weights w_{{s,a}}")
        rows, columns = _weight_rows(weights, holds)
        _save_tables(files, f"{name}_subject_weights", rows, columns)
        parts += [
            f"<p>The weights w<sub>s,a</sub> of silo s for subject a "
            f"({html.escape(weights_info['how'])}), over the (silo, subject) pairs where the "
            "silo holds records of the subject: each subject's update in a silo is clipped "
            "to C and multiplied by its weight, and Σ<sub>s</sub> w<sub>s,a</sub> ≤ 1 bounds "
            "what one subject moves the sum.</p>",
            _figure(
                figure,
                f"{name}: nonzero w_s,a per silo (left) and Σ_s w_s,a per subject (right)",
            ),
            "<details><summary>the histograms as a table</summary>"
            + _table(rows, columns)
            + "</details>",
        ]
    if sampling:
        parts.append(_sampling_section(run_dir, name, sampling, holds, files))
    return parts


def _weight_rows(weights: Any, holds: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of :func:`plotting.weight_histograms`: one per bin, a count per silo and the
    subjects whose weights sum into the bin."""
    edges, per_silo, per_subject = plotting.weight_histograms(weights, holds)
    silos = [f"silo {s}" for s in range(len(per_silo))]
    rows = [
        {
            "from": round(float(edges[b]), 4),
            "to": round(float(edges[b + 1]), 4),
            **{silos[s]: int(per_silo[s][b]) for s in range(len(per_silo))},
            "subjects (Σ_s w)": int(per_subject[b]),
        }
        for b in range(len(edges) - 1)
    ]
    return rows, ["from", "to", *silos, "subjects (Σ_s w)"]


def _sampling_section(
    run_dir: Path, name: str, sampling: Mapping[str, Any], holds: Any, files: Path
) -> str:
    """The subjects trained per round (silo-private counts), or why they are not shown."""
    rate = sampling["rate"]
    head = (
        f"Subject sub-sampling: rate q = {rate:g}, drawn by the {sampling['drawn_by']}, known "
        f"to {' and '.join(sampling['known_to']) or 'no party'}; expected "
        f"q·|U| = {sampling['expected_per_round']:.4g} subjects per round "
        f"(|U| = {sampling['subjects']}). Per-round counts recorded: {sampling['counts']}."
    )
    rows = [
        r
        for r in _jsonl(run_dir / PRIVATE_DIR / "diagnostics.jsonl")
        if r.get("subjects_per_batch")
    ]
    if not rows:
        return (
            f"<p>{html.escape(head)} No per-round count is drawn: the run recorded none "
            "(the silos keep the sample, and how many subjects each trained, to themselves)."
            "</p>"
        )
    expected = None
    if holds is not None and sampling["counts"].startswith(("sampled", "every")):
        pairs = int(holds.sum())
        silos = sum(len(r["subjects_per_batch"]) for r in rows) / len(rows) / len(holds)
        expected = min(rate, 1.0) * pairs * silos
    figure = files / f"{name}_subject_sampling.png"
    plotting.plot_subject_sampling(rows, figure, f"{name}: subjects trained", expected=expected)
    return f"<p>{html.escape(head)}</p>" + _figure(
        figure,
        f"{name}: (silo, subject) pairs trained per round, summed over the silos (a subject "
        "held by k silos counts k times)" + ("; dashed: expected" if expected is not None else ""),
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        return [
            json.loads(line)
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidValueError(
            f"Expected {str(path)!r} to hold one JSON object per line, as silodp writes it; it "
            f"cannot be read ({err})."
        ) from None


def _personalised(src: Path, runs: Sequence[Mapping[str, Any]], files: Path) -> list[str]:
    """PriFedSync: personalised and global accuracy per round, every run that has them."""
    found = {}
    for run in runs:
        rows = _jsonl(src / run["algorithm"] / "metrics.jsonl")
        if any(r.get("personalised_accuracy") is not None for r in rows):
            found[run["algorithm"]] = rows
    if not found:
        return []
    figure = files / "personalised_vs_global.png"
    plotting.plot_personalised(found, figure, "personalised (solid) vs global (dashed)")
    return [
        "<h2>Personalised and global accuracy</h2>",
        _figure(
            figure,
            "mean accuracy over the clients' own test splits against round: each client's "
            "personalised model (solid) and the global model (dashed)",
        ),
    ]


def _run_ledger(run_dir: Path) -> tuple[Path, bool] | None:
    """The ledger a run wrote to and whether it is shared (``privacy.ledger``), from the
    registration the run wrote beside its results (``ledger_run.json``)."""
    own = run_dir / "ledger.sqlite"
    try:
        registered = Path(_json(run_dir / "ledger_run.json")["ledger"])
    except (OSError, ValueError, KeyError, TypeError):
        registered = own
    if registered.is_file():
        return registered, registered.resolve() != own.resolve()
    return (own, False) if own.is_file() else None


def _ledger_totals(path: Path, shared: bool = False) -> str:
    from silodp.ledger.report import ledger_report

    report = ledger_report(path)
    rows = [
        {
            "ledger total": kind,
            "runs": len(total["runs"]),
            **{f"ε ({u})": _bound(total["epsilon"], u) for u in total["epsilon"]},
            # the δ and adversary the total is composed at (the declared budget's, else the
            # smallest δ of the runs and the first run's adversary): not this run's
            "δ": total.get("delta"),
            "against": total.get("adversary", "strongest") if not total.get("error") else None,
            # runs one accountant cannot compose (clients of a round at two σ): no total
            **({"not composed": total["error"]} if total.get("error") else {}),
            # units some runs do not account: what they spent there has no bound
            **(
                {
                    "inf: not accounted by": "; ".join(
                        f"{u}: runs {ids}" for u, ids in total["unaccounted"].items()
                    )
                }
                if total.get("unaccounted")
                else {}
            ),
        }
        for kind, total in report["total"].items()
    ]
    every = {c for r in rows for c in r}
    bounds = sorted(c for c in every if c.startswith("ε ("))
    columns = ["ledger total", "runs", *bounds, "δ", "against"]
    columns += sorted(every - set(columns))
    where = (
        f"Shared ledger {html.escape(str(path))}: the total of every run on it, this one and "
        "the others"
        if shared
        else "Ledger"
    )
    return (
        f"<p>{where} (events read back and composed, at the δ and against the adversary shown, "
        "which may differ from a run's own):</p>" + _table(rows, columns)
    )


# --- a sweep ------------------------------------------------------------------------------------


def _shown_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A sweep's table row as shown: an ε (mean, largest over seeds) with no finite bound in
    some seed (its ``_unbounded`` mark) reads inf, not "-" (a unit not reported)."""
    out = {k: v for k, v in row.items() if not k.endswith("_unbounded")}
    if row.get("algorithm") == "fedavg":  # no noise: no ε at any unit, not a missing one
        out["algorithm"] = "fedavg (non-private)"
    for key in row:
        if key.endswith("_unbounded") and row[key]:
            for kind in ("_mean", "_max"):
                out[key.removesuffix("_unbounded") + kind] = math.inf
    return out


def _bound_first(columns: Sequence[str]) -> list[str]:
    """``columns`` with each ``epsilon_<unit>_max`` (the bound every seed meets) moved before
    that unit's mean and standard deviation, so the mean is not read as the bound."""
    out = [c for c in columns if not (c.startswith("epsilon_") and c.endswith("_max"))]
    for column in columns:
        if column.startswith("epsilon_") and column.endswith("_max"):
            mean = column.removesuffix("_max") + "_mean"
            out.insert(out.index(mean) if mean in out else len(out), column)
    return out


def _sweep(src: Path, files: Path) -> tuple[str, str]:
    summary = _json(src / "summary.json") if (src / "summary.json").is_file() else {}
    rows = summary.get("rows") or []
    shown = [_shown_row(r) for r in rows]
    columns = _bound_first(columns_of(shown))
    _save_tables(files, "results", shown, columns)
    parts = [
        "<h2>Results (accuracy and ε: mean and standard deviation over seeds; "
        "epsilon_&lt;unit&gt;_max: the largest over seeds, the bound every seed's run meets, "
        "at the delta and against the adversary shown)</h2>",
        _table(shown, columns),
    ]
    for ledger in summary.get("ledgers") or []:  # a row's ε is its cell's; this, the data's
        path = Path(ledger["path"])
        if path.is_file():
            parts.append(_ledger_totals(path, shared=True))
    figure = files / "accuracy_by_grid_point.png"
    if plotting.plot_accuracy_by_grid(rows, figure) is not None:
        parts += [
            _figure(
                figure,
                "final test accuracy per algorithm at each grid point (mean ± std over seeds); "
                "grey, hatched: the non-private baseline",
            )
        ]
    figure = files / "utility_vs_epsilon.png"
    # cells calibrated to one ε end at the same ε: accuracy against ε would be a vertical line
    if plotting.epsilon_spread(rows) > 1.05 and plotting.plot_utility_vs_epsilon(rows, figure):
        parts += [
            _figure(
                figure,
                "final test accuracy (mean ± std over seeds) against final ε (the largest "
                "over seeds); dashed: the non-private baseline",
            )
        ]
    cells = _json(src / "grid.json")["cells"]
    points = _rounds_over_seeds(src, cells)
    if points:
        parts.append(
            "<h2>Accuracy (mean ± std over seeds) and ε (the largest over seeds) per round</h2>"
        )
    for i, (point, (accuracy, epsilon, views)) in enumerate(points.items()):
        if i == MAX_ROUND_FIGURES:
            parts.append(
                f"<p>{len(points) - i} more grid points: run <code>silodp report</code> on "
                "their cells.</p>"
            )
            break
        figure = files / f"rounds_{i:03d}.png"
        plotting.plot_rounds_over_seeds(accuracy, epsilon, figure, point, views)
        parts.append(
            _figure(
                figure,
                f"{point}: test accuracy (left, the mean with a band of ± one standard "
                f"deviation) and ε{plotting.held_at(views) if views else ''} (right, the "
                "largest) against round, over the seeds that reached the round (a seed "
                "stopped early, e.g. by its budget, leaves the later rounds' curves); dashed "
                "grey: the non-private baseline",
            )
        )
    series = _personalised_over_seeds(src, cells)
    if series:
        figure = files / "personalised_vs_global.png"
        plotting.plot_personalised_over_seeds(
            series, figure, "personalised (solid) vs global (dashed), mean ± std over seeds"
        )
        parts += [
            "<h2>Personalised and global accuracy</h2>",
            _figure(
                figure,
                "mean accuracy over the clients' own test splits against round: the "
                "personalised models (solid) and the global model (dashed), mean over seeds "
                "with a band of ± one standard deviation",
            ),
        ]
    parts.append(
        f"<p>{len(cells)} cells in {html.escape(str(src / 'cells'))}; each is an "
        "experiment: run <code>silodp report</code> on one for its figures.</p>"
    )
    return str(summary.get("name", src.name)), "\n".join(parts)


#: at most this many per-round figures in a sweep's report (one per grid point)
MAX_ROUND_FIGURES = 24

#: the unit whose ε a sweep's per-round figure draws for a run, first found in this order
UNIT_ORDER = ("subject", "record", "silo")


def _rounds_over_seeds(
    src: Path, cells: Sequence[Mapping[str, Any]]
) -> dict[str, tuple[dict[str, plotting.Band], dict[str, plotting.Band], list[dict[str, Any]]]]:
    """Per grid point (the cell's values other than its algorithms), per algorithm: test
    accuracy per round, mean and standard deviation over the seeds that reached the round,
    and ε per round, the largest over those seeds (the bound each of them meets; no band);
    and the ``delta`` and ``adversary`` of the point's private runs. A baseline cell joins
    every grid point whose values include its own."""
    accuracy: dict[str, dict[str, dict[int, list[float]]]] = {}
    epsilon: dict[str, dict[str, dict[int, list[float]]]] = {}
    views: dict[str, list[dict[str, Any]]] = {}
    baselines: list[tuple[dict[str, Any], str, list[dict[str, Any]]]] = []
    private_points: dict[str, dict[str, Any]] = {}
    for cell in cells:
        path = src / "cells" / cell["id"] / "summary.json"
        if not path.is_file():
            continue
        values = {k: v for k, v in cell["values"].items() if k != "algorithms"}
        point = ", ".join(f"{k}={v}" for k, v in values.items()) or "all cells"
        if not cell["baseline"]:
            private_points[point] = values
        for run in _json(path).get("runs", []):
            rows = _jsonl(src / "cells" / cell["id"] / run["algorithm"] / "metrics.jsonl")
            if cell["baseline"]:
                baselines.append((values, f"{run['algorithm']} (non-private)", rows))
                continue
            unit = next((u for u in UNIT_ORDER if u in (run.get("epsilon") or {})), None)
            label = run["algorithm"] + (f" ({unit} ε)" if unit else "")
            _pool(accuracy.setdefault(point, {}).setdefault(label, {}), rows, "test_accuracy")
            if unit is not None:
                views.setdefault(point, []).append(
                    {"delta": run.get("delta"), "adversary": run.get("adversary")}
                )
                by_round = epsilon.setdefault(point, {}).setdefault(label, {})
                for row in rows:
                    value = (row.get("epsilon") or {}).get(unit)
                    if value is not None:
                        by_round.setdefault(row["round"], []).append(float(value))
                # a seed stopped at its accuracy target was charged its whole plan: that ε,
                # at the round it was charged through (as the run's own epsilon.png draws it)
                # (and an interrupted seed charged a round it did not complete: its ε is that
                # charge, at that round)
                charged = (run.get("epsilon") or {}).get(unit)
                through = run.get("rounds_charged") or max(
                    run.get("rounds_charged_not_completed") or [0]
                )
                if through and charged is not None:
                    by_round.setdefault(int(through), []).append(float(charged))
    for values, label, rows in baselines:
        targets = [
            p for p, pv in private_points.items() if all(pv.get(k) == v for k, v in values.items())
        ]
        for point in targets or [", ".join(f"{k}={v}" for k, v in values.items()) or "all cells"]:
            _pool(accuracy.setdefault(point, {}).setdefault(label, {}), rows, "test_accuracy")
    return {
        point: (
            {label: _band(r) for label, r in sorted(curves.items(), key=_baseline_first) if r},
            {label: _largest(r) for label, r in epsilon.get(point, {}).items() if r},
            views.get(point, []),
        )
        for point, curves in accuracy.items()
    }


def _baseline_first(item: tuple[str, Any]) -> bool:
    return not item[0].endswith("(non-private)")


def _pool(by_round: dict[int, list[float]], rows: Sequence[Mapping[str, Any]], key: str) -> None:
    for row in rows:
        if row.get(key) is not None:
            by_round.setdefault(row["round"], []).append(float(row[key]))


def _personalised_over_seeds(
    src: Path, cells: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, plotting.Band]]:
    """Per algorithm and grid point, the personalised and global accuracy per round: mean and
    standard deviation over the seeds that reached the round (0 for one seed)."""
    pooled: dict[str, dict[str, dict[int, list[float]]]] = {}
    for cell in cells:
        path = src / "cells" / cell["id"] / "summary.json"
        if not path.is_file():
            continue
        values = ", ".join(f"{k}={v}" for k, v in cell["values"].items() if k != "algorithms")
        for run in _json(path).get("runs", []):
            rows = _jsonl(src / "cells" / cell["id"] / run["algorithm"] / "metrics.jsonl")
            if not any(r.get("personalised_accuracy") is not None for r in rows):
                continue
            label = run["algorithm"] + (f" ({values})" if values else "")
            curves = pooled.setdefault(label, {"personalised": {}, "global": {}})
            for row in rows:
                for kind in curves:
                    value = row.get(f"{kind}_accuracy")
                    if value is not None:
                        curves[kind].setdefault(row["round"], []).append(float(value))
    return {
        label: {kind: _band(by_round) for kind, by_round in curves.items() if by_round}
        for label, curves in pooled.items()
    }


def _largest(by_round: Mapping[int, Sequence[float]]) -> plotting.Band:
    """Per round, the largest value (an ε every seed's run meets), with no spread."""
    rounds = sorted(by_round)
    return rounds, [max(by_round[r]) for r in rounds], [0.0] * len(rounds)


def _band(by_round: Mapping[int, Sequence[float]]) -> plotting.Band:
    rounds = sorted(by_round)
    means = [sum(by_round[r]) / len(by_round[r]) for r in rounds]
    stds = [
        math.sqrt(sum((v - m) ** 2 for v in by_round[r]) / (len(by_round[r]) - 1))
        if len(by_round[r]) > 1
        else 0.0
        for r, m in zip(rounds, means, strict=True)
    ]
    return rounds, means, stds
