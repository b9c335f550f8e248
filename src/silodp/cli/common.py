"""What every command prints the same way: errors, warnings, progress, ε values, and against
whom each holds.

This module is imported by ``silodp --help``: it imports nothing heavy (no torch, numpy or
tqdm at import time).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

import typer

__all__ = [
    "BUDGET_EXIT_CODE",
    "INTERRUPTED_EXIT_CODE",
    "TERMINATED_EXIT_CODE",
    "Terminated",
    "WHO",
    "check_config_file",
    "cli_messages",
    "differing",
    "fail",
    "fmt",
    "progress",
    "sigterm_interrupts",
    "summary_table",
]

#: the exit code of a run a privacy budget stopped
BUDGET_EXIT_CODE = 3

#: the exit code of a command stopped by Ctrl-C (SIGINT), as shells report it
INTERRUPTED_EXIT_CODE = 130

#: the exit code of a command stopped by SIGTERM (``kill PID``), as shells report it
TERMINATED_EXIT_CODE = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a run as Ctrl-C does (every ``finally`` runs, children included)."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: how each adversary is named in printed output
WHO = {
    "released": "the released model (outsiders)",
    "server": "the server",
    "silos": "the silos",
}


def fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``error: message`` and exits with ``code`` (2: bad input)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def check_config_file(path: Path, name: str = "CONFIG") -> None:
    """Fails unless ``path`` is an existing file (found before anything slow is imported)."""
    if not path.exists():
        fail(f"Expected {name} {str(path)!r} to be an experiment TOML file; it does not exist.")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        fail(f"Expected {name} {str(path)!r} to be an experiment TOML file; it is {what}.")


def fmt(value: float | None) -> str:
    return "inf" if value is None else format(value, ".3g")


def differing(record: dict[str, Any]) -> list[tuple[str, str, float | None]]:
    """(adversary, unit, ε) wherever an adversary's ε differs from the headline ε."""
    headline = record.get("epsilon", {})
    out = []
    for who, values in record.get("epsilon_by_adversary", {}).items():
        for unit, value in values.items():
            if value != headline.get(unit):
                out.append((who, unit, value))
    return out


#: the order of the ε columns in printed tables
UNITS = ("record", "silo", "subject")


def protects(record: dict[str, Any]) -> str:
    """What a run's guarantee protects: the unit its ε target was set for (else its first
    unit), or nothing for a run without noise."""
    units = record.get("units") or []
    if not units:
        return "nothing (no noise)"
    unit = (record.get("calibration") or {}).get("unit") or units[0]
    return f"each {unit}"


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The final lines of ``silodp run``: a table of each run's accuracy, what its guarantee
    protects and its ε per unit (against every party), then the ε that differ per adversary.

    An ε above the largest target among the runs is marked ``!``: the unit is not protected at
    the level asked for (e.g. a subject's ε under record-level DP)."""
    runs = summary["runs"]
    units = [u for u in UNITS if any(u in r.get("epsilon", {}) for r in runs)]
    personal = any(r.get("personalised_accuracy") is not None for r in runs)
    targets = [
        r["calibration"]["target_epsilon"]
        for r in runs
        if isinstance((r.get("calibration") or {}).get("target_epsilon"), int | float)
    ]
    target = max(targets) if targets else None
    header = ["method", "protects", "accuracy", *(["personalised"] if personal else [])]
    header += [f"ε {u}" for u in units]
    rows = []
    for r in runs:
        acc = format(r["test_accuracy"], ".3f") if r.get("test_accuracy") is not None else "–"
        row = [r["algorithm"], protects(r), acc]
        if personal:
            value = r.get("personalised_accuracy")
            row.append("–" if value is None else format(value, ".3f"))
        for u in units:
            if u not in r.get("epsilon", {}):
                row.append("–")
                continue
            value = r["epsilon"][u]
            above = target is not None and (value is None or value > target * 1.001)
            row.append(fmt(value) + (" !" if above else ""))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        first = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2], strict=True)]
        rest = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  " + "  ".join(first + rest).rstrip()

    out = [line(header)] + [line(row) for row in rows]
    deltas = {r["delta"] for r in runs if r.get("delta")}
    whom = {r.get("adversary") for r in runs if r.get("adversary")}
    if deltas:
        against = (
            "every party"
            if whom == {"strongest"}
            else ", ".join(sorted(WHO.get(w, w) for w in whom if w))
        )
        out.append(f"  ε at δ={', '.join(f'{d:g}' for d in sorted(deltas))} against {against}")
    if target is not None and any("!" in cell for row in rows for cell in row[3:]):
        out.append(f"  ! above the target ε={target:g}: that unit is not protected at this level")
    for r in runs:
        grouped: dict[tuple[str, float | None], list[str]] = {}
        for who, unit, value in differing(r):
            grouped.setdefault((unit, value), []).append(WHO[who])
        for (unit, value), names in grouped.items():
            out.append(f"  {r['algorithm']}: ε({unit}={fmt(value)}) against {' and '.join(names)}")
        if r.get("noise", {}).get("mode") == "seeded":
            out.append(f"  {r['algorithm']}: seeded noise, not for production")
    return out


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


def _echo_line(line: str) -> None:
    """One line on stderr; above a progress bar when stderr is a terminal."""
    if _is_terminal(sys.stderr):
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
    else:
        typer.echo(line, err=True)


class _Once(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


class _LineHandler(logging.Handler):
    """``warning: message`` (or ``error: message``) on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "warning" if record.levelno < logging.ERROR else "error"
            _echo_line(f"{level}: {record.getMessage()}")
        except Exception:  # pragma: no cover - as logging.Handler does
            self.handleError(record)


@contextlib.contextmanager
def cli_messages() -> Iterator[None]:
    """While a command runs, silodp's log warnings and Python warnings print as
    ``warning: message`` lines on stderr, each distinct message once."""
    handler = _LineHandler(level=logging.WARNING)
    once = _Once()
    handler.addFilter(once)
    logger = logging.getLogger("silodp")
    logger.addHandler(handler)
    # printed here only: a dependency may give the root logger a handler mid-run (absl's
    # logging.warning calls logging.basicConfig), which would print each warning again
    propagate, logger.propagate = logger.propagate, False
    previous = warnings.showwarning

    def show(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        text = str(message)
        if text not in once.seen:
            once.seen.add(text)
            _echo_line(f"warning: {text}")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous
        logger.removeHandler(handler)
        logger.propagate = propagate


def _postfix(row: dict[str, Any]) -> dict[str, str]:
    postfix = {}
    if row.get("test_accuracy") is not None:
        postfix["acc"] = f"{row['test_accuracy']:.3f}"
    for unit, value in row.get("epsilon", {}).items():
        postfix[f"ε_{unit}"] = fmt(value)
    postfix.update({f"ε_{unit}[{who}]": fmt(value) for who, unit, value in differing(row)})
    return postfix


#: at most about this many plain progress lines per run when stderr is not a terminal
PLAIN_LINES = 100


def progress(name: str, rounds: int) -> Callable[[dict[str, Any]], None]:
    """A run's progress: a bar redrawn in place on a terminal; otherwise (a log file, a pipe)
    one plain line per round, or every few rounds for runs of more than :data:`PLAIN_LINES`
    rounds (always the first and the last)."""
    if not _is_terminal(sys.stderr):
        every = max(1, math.ceil(rounds / PLAIN_LINES))

        def line(row: dict[str, Any]) -> None:
            r = row["round"]
            if r == 1 or r == rounds or r % every == 0:
                fields = ", ".join(f"{k}={v}" for k, v in _postfix(row).items())
                typer.echo(
                    f"{name}: round {r}/{rounds}" + (f", {fields}" if fields else ""), err=True
                )

        return line

    from tqdm import tqdm

    bar = tqdm(total=rounds, desc=f"{name:>15}", unit="round", file=sys.stderr, leave=True)

    def update(row: dict[str, Any]) -> None:
        bar.set_postfix(_postfix(row))
        bar.update(1)
        if row["round"] == rounds:
            bar.close()

    return update
