"""Tables of PriFedSync sweeps, shaped as the paper's Tables 1–3 (markdown and CSV).

Every privacy number in a table is copied from the run's per-round metrics, which hold the
accountant's reports (:mod:`silodp.accounting.fdp`); this module computes none itself.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from silodp import display
from silodp.io import write_text

__all__ = [
    "COLUMNS",
    "columns_of",
    "rounds_to_target",
    "rows_csv",
    "sweep_row",
    "to_csv",
    "to_markdown",
    "write_table",
]

#: (key, markdown header); CSV uses the keys and adds every other key of a row.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("client_rate", "p"),
    ("noise_multiplier", "σ"),
    ("batch_size", "B"),
    ("local_steps", "K"),
    ("rounds", "R"),
    ("total_iterations", "K·R"),
    ("total_examples", "B·K·R"),
    ("mu_max", "μ_max (CLT est.)"),
    ("mu_weak", "μ weak (CLT est.)"),
    ("mu_strong", "μ strong (CLT est.)"),
    ("epsilon", "ε (record) at R"),
    ("epsilon_planned", "ε (record), all planned rounds"),
    ("personalised_accuracy", "personalised acc at R"),
    ("global_accuracy", "global acc at R"),
    ("status", "run"),
)


def rounds_to_target(
    metrics: Sequence[Mapping[str, Any]], *, key: str, target: float
) -> Mapping[str, Any] | None:
    """The first round's metrics whose ``key`` is at least ``target`` (``None``: never)."""
    for row in metrics:
        value = row.get(key)
        if value is not None and value >= target:
            return row
    return None


def sweep_row(
    *,
    label: str,
    training: Mapping[str, Any],
    noise_multiplier: float | None,
    metrics: Sequence[Mapping[str, Any]],
    target_key: str,
    target: float,
    account_command: str | None,
    epsilon_planned: float | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    """One table row: rounds to reach ``target`` and the privacy spent at that round (at the
    last round, with ``reached = False``, when the target was not reached); ``status``: how
    the cell's run ended (``complete``, ``budget_exhausted``, ...)."""
    if not metrics:
        raise ValueError(f"Expected metrics of at least one round for {label!r}, got none.")
    hit = rounds_to_target(metrics, key=target_key, target=target)
    at = hit if hit is not None else metrics[-1]
    rounds = int(at["round"])
    batch, steps = int(training["batch_size"]), int(training["local_steps"])
    mu = at.get("mu_estimates") or {}  # the paper's CLT μ: estimates, not guarantees
    eps = at.get("epsilon") or {}
    return {
        "run": label,
        "client_rate": training["client_rate"],
        "noise_multiplier": noise_multiplier,
        "batch_size": batch,
        "local_steps": steps,
        "reached": hit is not None,
        "rounds": rounds,
        "rounds_run": int(metrics[-1]["round"]),
        "total_iterations": steps * rounds,
        "total_examples": batch * steps * rounds,
        "mu_max": mu.get("client_max"),
        "mu_weak": mu.get("weak"),
        "mu_strong": mu.get("strong"),
        "epsilon": eps.get("record"),
        "epsilon_planned": epsilon_planned,
        "epsilon_route": (at.get("epsilon_route") or {}).get("record"),
        "personalised_accuracy": at.get("personalised_accuracy"),
        "global_accuracy": at.get("global_accuracy"),
        "target_metric": target_key,
        "target_accuracy": target,
        "account_command": account_command,
        "status": status,
    }


def _cell(key: str, value: Any, row: Mapping[str, Any]) -> str:
    if value is None:
        return "—"
    if key == "rounds" and not row.get("reached", True):
        return f"not reached (>{value})"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "∞"
        if key.endswith("accuracy"):
            return f"{100 * value:.2f}"
        # privacy bounds, and σ (copied into a config, it reaches the row's ε or less): up
        if key.startswith(("epsilon", "mu_")) or key == "noise_multiplier":
            return display.upper(value)
        return f"{value:.3g}" if key != "client_rate" else f"{value:g}"
    return str(value)


def to_markdown(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> str:
    """A markdown table with :data:`COLUMNS`; accuracies in percent."""
    lines = [f"{title}\n"] if title else []
    lines.append("| " + " | ".join(h for _, h in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row.get(k), row) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def columns_of(rows: Sequence[Mapping[str, Any]], first: Sequence[str] = ()) -> list[str]:
    """Every key of the rows, in order of appearance, after ``first``."""
    return list(dict.fromkeys([*first, *(k for row in rows for k in row)]))


def rows_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """CSV of ``rows`` with these columns (a missing or ``None`` value is empty)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    return buffer.getvalue()


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """CSV with every key of the rows (table columns first)."""
    return rows_csv(rows, columns_of(rows, [k for k, _ in COLUMNS]))


def write_table(
    rows: Sequence[Mapping[str, Any]], out_dir: Path, *, stem: str, title: str = ""
) -> tuple[Path, Path]:
    """Writes ``stem.md`` and ``stem.csv`` atomically into ``out_dir``."""
    md = write_text(out_dir / f"{stem}.md", to_markdown(rows, title=title))
    table = write_text(out_dir / f"{stem}.csv", to_csv(rows))
    return md, table
