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
from dataclasses import dataclass
from typing import Any

from silodp import display

__all__ = [
    "Row",
    "Usage",
    "format_table",
    "interleaved_medians",
    "interleaved_usage",
    "peak_rss_mb",
    "run_worker",
    "vm_hwm_mb",
    "run_workers",
    "set_threads",
]

Row = dict[str, Any]


def set_threads(threads: int) -> int:
    """Sets torch's intra-op threads and the BLAS threads of compiled code (numba's matrix
    products go through SciPy's OpenBLAS, which otherwise uses every core); returns what
    torch reports using."""
    import scipy.linalg.cython_blas  # noqa: F401  (loads that BLAS, so that it can be limited)
    import threadpoolctl
    import torch

    threads = max(1, int(threads))
    torch.set_num_threads(threads)
    threadpoolctl.threadpool_limits(limits=threads, user_api="blas")
    return int(torch.get_num_threads())


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def vm_hwm_mb() -> float | None:
    """``VmHWM`` of /proc/self/status (peak RSS of this process image), MiB; None if absent."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Usage:
    """One call's cost: wall seconds, this process's user and system CPU seconds and minor
    page faults (``resource.getrusage(RUSAGE_SELF)``; torch's intra-op threads included)."""

    wall_s: float
    user_s: float
    sys_s: float
    minor_faults: float

    @staticmethod
    def median(samples: Sequence[Usage]) -> Usage:
        """Field by field median of ``samples``."""
        return Usage(
            statistics.median(u.wall_s for u in samples),
            statistics.median(u.user_s for u in samples),
            statistics.median(u.sys_s for u in samples),
            statistics.median(u.minor_faults for u in samples),
        )


def interleaved_usage(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    min_sample_s: float = 0.05,
    max_calls: int = 50,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> dict[str, Usage]:
    """Median :class:`Usage` of one call of each function over ``repeats`` round-robin passes.

    Each pass calls every function in turn; ``warmup`` passes are run first and discarded. A
    function faster than ``min_sample_s`` is called several times in a row per pass (up to
    ``max_calls``, fixed in the first pass by :func:`_calls_per_sample`) and the sample is
    the mean per call, so millisecond steps are not lost in timer and scheduler noise. A
    function that raises is
    dropped from later passes (``on_error`` is told). CPU times and page faults are less
    sensitive than wall time to other jobs on the host.
    """
    samples: dict[str, list[Usage]] = {name: [] for name in fns}
    calls: dict[str, int] = {}
    alive = dict(fns)
    for r in range(warmup + repeats):
        for name, fn in list(alive.items()):
            inner = calls.get(name, 1)
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            try:
                for _ in range(inner):
                    fn()
                elapsed = (time.perf_counter() - start) / inner
                after = resource.getrusage(resource.RUSAGE_SELF)
                if name not in calls:
                    calls[name] = _calls_per_sample(fn, elapsed, min_sample_s, max_calls)
            except Exception as err:  # noqa: BLE001 - reported, the others go on
                alive.pop(name)
                samples.pop(name, None)
                if on_error is not None:
                    on_error(name, err)
                continue
            if r >= warmup:
                samples[name].append(
                    Usage(
                        elapsed,
                        (after.ru_utime - before.ru_utime) / inner,
                        (after.ru_stime - before.ru_stime) / inner,
                        (after.ru_minflt - before.ru_minflt) / inner,
                    )
                )
    return {name: Usage.median(us) for name, us in samples.items() if us}


def _calls_per_sample(
    fn: Callable[[], object], first: float, min_sample_s: float, max_calls: int
) -> int:
    """Calls in a row per sample, from a second call's time when the first (``first``
    seconds, which may include one-time set-up such as tracing or tables) was short enough
    for a second to be cheap."""
    elapsed = first
    if first < 10 * min_sample_s:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    return max(1, min(max_calls, math.ceil(min_sample_s / max(elapsed, 1e-9))))


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    min_sample_s: float = 0.05,
    max_calls: int = 50,
    on_error: Callable[[str, BaseException], None] | None = None,
) -> dict[str, float]:
    """Median wall time (s) of one call of each function: :func:`interleaved_usage`'s."""
    usage = interleaved_usage(
        fns,
        repeats=repeats,
        warmup=warmup,
        min_sample_s=min_sample_s,
        max_calls=max_calls,
        on_error=on_error,
    )
    return {name: u.wall_s for name, u in usage.items()}


def run_worker(args: Sequence[str], *, timeout: float = 600.0) -> dict[str, Any]:
    """Runs ``python -m silodp.bench.worker ARGS`` in a fresh process; its last JSON line.

    Returns ``{"error": ...}`` when the worker fails or times out.
    """
    # Through ``sh`` (which forks the worker rather than exec'ing it): Linux carries the
    # peak RSS of the process that forks across exec into ru_maxrss, so a worker forked
    # from this (large) process would report at least our size.
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "silodp.bench.worker", *args]
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


def run_workers(
    jobs_args: Mapping[str, Sequence[str]], *, jobs: int = 2, timeout: float = 600.0
) -> dict[str, dict[str, Any]]:
    """:func:`run_worker` for each named argument list, ``jobs`` processes at a time (peak
    RSS is per process, so concurrent workers do not disturb each other's figure)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {
            name: pool.submit(run_worker, args, timeout=timeout) for name, args in jobs_args.items()
        }
        return {name: future.result() for name, future in futures.items()}


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


def _format(value: Any, column: str, cell: Callable[[Any], str] | None) -> str:
    """A table cell: an ε column's finite numbers rounded up (3 significant figures, so the
    text is still an upper bound), else ``cell`` or this module's format."""
    finite = isinstance(value, float) and math.isfinite(value)
    if "epsilon" in column and finite:
        return display.upper(value)
    return (_cell if cell is None else cell)(value)


def format_table(
    rows: Sequence[Row], columns: Sequence[str], cell: Callable[[Any], str] | None = None
) -> str:
    """A plain-text table of ``rows`` restricted to ``columns`` (Markdown pipe syntax; numbers
    right-aligned, text left-aligned); ``cell`` formats a value (default: this module's; ε
    columns are rounded up either way)."""
    cells = [[_format(row.get(c), c, cell) for c in columns] for row in rows]
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

    rule = (
        "|"
        + "|".join(
            "-" * (w + 1) + ":" if num else "-" * (w + 2)
            for w, num in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(list(columns)), rule, *(line(r) for r in cells)])
