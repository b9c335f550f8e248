"""Shared pieces of the benchmarks: interleaved timing, fresh-process peak RSS, tables.

Speed is judged by ratios measured side by side in one process: every repeat runs each method
once, round-robin, so slow phases of a shared machine hit all methods alike; the median over
repeats is reported. Memory is the peak resident set size (``ru_maxrss``) of a fresh worker
process running a few steps, minus that of a worker which only builds the model and the data.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "Row",
    "format_table",
    "interleaved_medians",
    "peak_rss_mb",
    "print_rows",
    "run_worker",
    "set_threads",
]

Row = dict[str, Any]


def set_threads(threads: int) -> int:
    """Sets torch's intra-op threads; returns what torch reports using."""
    import torch

    torch.set_num_threads(max(1, int(threads)))
    return int(torch.get_num_threads())


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> dict[str, float]:
    """Median wall time (s) of each function over ``repeats`` round-robin passes.

    Each pass calls every function once, in order; ``warmup`` passes are run first and
    discarded. A function that raises is dropped from later passes (``on_error`` is told).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    alive = dict(fns)
    for r in range(warmup + repeats):
        for name, fn in list(alive.items()):
            start = time.perf_counter()
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - reported, the others go on
                alive.pop(name)
                times.pop(name, None)
                if on_error is not None:
                    on_error(name, err)
                continue
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def run_worker(args: Sequence[str], *, timeout: float = 600.0) -> dict[str, Any]:
    """Runs ``python -m silodp.bench.worker ARGS`` in a fresh process; its last JSON line.

    Returns ``{"error": ...}`` when the worker fails or times out.
    """
    cmd = [sys.executable, "-m", "silodp.bench.worker", *args]
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker exit {proc.returncode}: {tail[:200]}"}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if math.isinf(value):
            return "inf"
        magnitude = abs(value)
        if magnitude == 0:
            return "0"
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01:
            return f"{value:.3g}"
        return f"{value:.2e}"
    return str(value)


def format_table(rows: Sequence[Row], columns: Sequence[str]) -> str:
    """A plain-text table of ``rows`` restricted to ``columns`` (Markdown pipe syntax)."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(row.get(c), int | float) or row.get(c) is None for row in rows)
        for c in columns
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + ":" if num else "-" * (w + 2)
        for w, num in zip(widths, numeric, strict=True)
    ) + "|"
    return "\n".join([line(list(columns)), rule, *(line(r) for r in cells)])


def print_rows(
    rows: Sequence[Row],
    columns: Sequence[str],
    *,
    as_json: bool,
    echo: Callable[[str], None] = print,
) -> None:
    """One JSON object per line (``as_json``), else a readable table."""
    if as_json:
        for row in rows:
            echo(json.dumps(row, default=_json_default))
    else:
        echo(format_table(rows, columns))


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
