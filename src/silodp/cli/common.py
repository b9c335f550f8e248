"""What every command prints the same way: errors, warnings, progress, ε values, and against
whom each holds.

This module is imported by ``silodp --help``: it imports nothing heavy (no torch, numpy or
tqdm at import time).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

import typer

from silodp import display

__all__ = [
    "BUDGET_EXIT_CODE",
    "SILO_FAILURE_EXIT_CODE",
    "INTERRUPTED_EXIT_CODE",
    "TERMINATED_EXIT_CODE",
    "Terminated",
    "WHO",
    "SweepProgress",
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

#: the exit code of a run a silo's failure stopped part-way (Flower engines): the rounds
#: before it are kept and ``--resume`` continues it
SILO_FAILURE_EXIT_CODE = 4

#: the exit code of a command stopped by Ctrl-C (SIGINT), as shells report it
INTERRUPTED_EXIT_CODE = 130

#: the exit code of a command stopped by SIGTERM (``kill PID``), as shells report it
TERMINATED_EXIT_CODE = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping a run as Ctrl-C does (every ``finally`` runs, children included)."""


#: the process that installed :func:`_stop` (worker processes forked from it inherit the
#: handler, and a terminal's Ctrl-C reaches them too: only this one says what it does)
_handler_owner: int | None = None


def _stop(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM: deferred to the end of the round in progress while rounds run
    (:mod:`silodp.stopping`), else (or the second time) raised at once."""
    from silodp import stopping

    stop: KeyboardInterrupt = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    if stopping.defer(stop):
        if os.getpid() != _handler_owner or stopping.shielding():  # a forked worker: its
            return  # parent says it, once; a shielded write: the run is stopping already
        again = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        typer.echo(
            f"\nstopping once the round in progress is recorded and checkpointed ({again} "
            "again stops now; that round's recorded spending then counts in full and the "
            "round runs again on resume)",
            err=True,
        )
        return
    raise stop


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread, as Ctrl-C
    raises ``KeyboardInterrupt``; while a run's rounds are running, the first of either waits
    for the round in progress to be checkpointed (:mod:`silodp.stopping`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _handler_owner
    _handler_owner = os.getpid()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # SIGINT ignored (a background job's): left so
    handled = [s for s, h in previous.items() if s == signal.SIGTERM or h is not signal.SIG_IGN]
    for sig in handled:
        signal.signal(sig, _stop)
    try:
        yield
    finally:
        for sig in handled:
            signal.signal(sig, previous[sig])


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
    """An ε or μ to 3 significant figures, rounded up (``None``: no finite bound)."""
    return display.upper(value)


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
    the level asked for (e.g. a subject's ε under record-level DP). The comparison is exact:
    calibration leaves a calibrated ε at or below its target, so any excess, however small,
    is marked (the printed value, rounded up, is then above the target too)."""
    runs = summary["runs"]
    units = [u for u in UNITS if any(u in r.get("epsilon", {}) for r in runs)]
    personal = any(r.get("personalised_accuracy") is not None for r in runs)
    own = {
        i: r["calibration"]["target_epsilon"]
        for i, r in enumerate(runs)
        if isinstance((r.get("calibration") or {}).get("target_epsilon"), int | float)
    }
    # each run against its own target; a run given σ against the largest target asked for
    fallback = max(own.values()) if own else None
    targets = [own.get(i, fallback) for i in range(len(runs))]
    deltas = {r["delta"] for r in runs if r.get("delta")}
    whom = {r.get("adversary") for r in runs if r.get("adversary")}
    per_row = len(deltas) > 1 or len(whom) > 1  # the runs' ε are not at one δ, against one
    header = ["method", "protects", "accuracy", *(["personalised"] if personal else [])]
    first_epsilon = len(header)
    header += [f"ε {u}" for u in units]
    if per_row:
        header += ["at δ", "against"]
    rows = []
    earlier = False  # an accuracy of a model before the released one (not evaluated)
    for r, target in zip(runs, targets, strict=True):
        acc = format(r["test_accuracy"], ".3f") if r.get("test_accuracy") is not None else "–"
        evaluated = r.get("test_accuracy_round")
        if evaluated is not None and r.get("rounds_completed") not in (None, evaluated):
            acc += f" (r{evaluated})"
            earlier = True
        row = [r["algorithm"], protects(r), acc]
        if personal:
            value = r.get("personalised_accuracy")
            row.append("–" if value is None else format(value, ".3f"))
        for u in units:
            if u not in r.get("epsilon", {}):
                row.append("–")
                continue
            value = r["epsilon"][u]
            above = target is not None and (value is None or value > target)
            row.append(fmt(value) + (" !" if above else ""))
        if per_row:
            delta, who = r.get("delta"), r.get("adversary")
            row.append(f"{delta:g}" if isinstance(delta, int | float) else "–")
            row.append(str(who) if who else "–")
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        first = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2], strict=True)]
        rest = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  " + "  ".join(first + rest).rstrip()

    out = [line(header)] + [line(row) for row in rows]
    if deltas and not per_row:
        (delta,) = deltas
        (who,) = whom or {"strongest"}
        against = "every party" if who == "strongest" else WHO.get(who, who)
        out.append(f"  ε at δ={delta:g} against {against}")
    elif per_row:
        out.append(
            "  each run's ε is at its own δ, against its own adversary (strongest: every party)"
        )
    if earlier:
        out.append(
            "  (rN): the accuracy of round N's model; the released model is a later round's, "
            "not evaluated (training.eval_every)"
        )
    marked = any("!" in cell for row in rows for cell in row[first_epsilon:])
    if marked and len({t for t in targets if t is not None}) == 1:
        (target,) = {t for t in targets if t is not None}
        out.append(f"  ! above the target ε={target:g}: that unit is not protected at this level")
    elif marked:
        out.append(
            "  ! above the run's target ε (a run given σ: the largest target): that unit is "
            "not protected at this level"
        )
    for r in runs:
        grouped: dict[tuple[str, float | None], list[str]] = {}
        for who, unit, value in differing(r):
            grouped.setdefault((unit, value), []).append(WHO[who])
        for (unit, value), names in grouped.items():
            out.append(f"  {r['algorithm']}: ε({unit}={fmt(value)}) against {' and '.join(names)}")
        if r.get("noise", {}).get("mode") == "seeded":
            out.append(f"  {r['algorithm']}: seeded noise, not for production")
        source = str(r.get("group_size_source") or "")
        if source.startswith("data") and r.get("epsilon", {}).get("subject") is not None:
            where = "in one silo" if "in one silo" in source else "in the federation"
            out.append(
                f"  {r['algorithm']}: ε(subject) assumes k={r['group_size']} records per subject "
                f"{where}, taken from the data: no guarantee until privacy.group_size sets a "
                "public bound"
            )
        if r.get("round_attempts_cut_short"):
            out.append(
                f"  {r['algorithm']}: ε counts {r['round_attempts_cut_short']} round(s) cut short "
                "and run again on resume in full (silodp ledger show lists them)"
            )
        if r.get("rounds_charged_not_completed"):
            rounds = ", ".join(map(str, r["rounds_charged_not_completed"]))
            out.append(f"  {r['algorithm']}: ε counts round(s) {rounds}, charged and not completed")
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


class _ProgressHandler(logging.Handler):
    """Progress of long steps (logger ``silodp.progress``, level INFO) as plain lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno < logging.WARNING:
                _echo_line(record.getMessage())
        except Exception:  # pragma: no cover - as logging.Handler does
            self.handleError(record)


@contextlib.contextmanager
def cli_messages() -> Iterator[None]:
    """While a command runs, silodp's log warnings and Python warnings print as
    ``warning: message`` lines on stderr, each distinct message once, and the progress of
    long steps (logger ``silodp.progress``) as plain lines."""
    handler = _LineHandler(level=logging.WARNING)
    once = _Once()
    handler.addFilter(once)
    logger = logging.getLogger("silodp")
    logger.addHandler(handler)
    progress_logger = logging.getLogger("silodp.progress")
    progress_handler = _ProgressHandler(level=logging.INFO)
    progress_logger.addHandler(progress_handler)
    progress_level = progress_logger.level
    progress_logger.setLevel(logging.INFO)
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
        progress_logger.removeHandler(progress_handler)
        progress_logger.setLevel(progress_level)


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


def _clock(seconds: float) -> str:
    """``h:mm:ss`` or ``m:ss``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class SweepProgress:
    """One progress view over every cell of ``silodp sweep``: which cell runs (``cell i/N``
    and its grid values), the rounds done out of every round the sweep plans, the time
    elapsed and an estimate of the time left (from the rounds trained since this view
    started; cells kept from an earlier invocation count as done, not as speed).

    On a terminal, one bar redrawn in place; otherwise (a CI log, a pipe) one plain line
    per cell event and per round (every few rounds for runs of more than
    :data:`PLAIN_LINES` rounds; always the first and the last). Pass :meth:`cell` as
    ``run_grid``'s ``on_cell``, :meth:`run` as its ``progress`` and :meth:`log` as its
    ``log`` (lines printed above the bar); :meth:`close` at the end.
    """

    def __init__(
        self, *, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = _is_terminal(self.stream)
        self.clock = clock
        self.started = clock()
        self.at: Any = None  # the last CellProgress
        self.runs: dict[str, int] = {}  # the last round of each run of the current cell
        self.trained = 0  # rounds trained since this view started
        self.bar: Any = None

    def done(self) -> int:
        """Rounds done across the sweep: the cells before the current one (as planned), and
        the current cell's runs' rounds (all of them once it finished or was kept)."""
        at = self.at
        if at is None:
            return 0
        if at.status in ("kept", "finished"):
            return int(at.rounds_before + at.rounds)
        return int(at.rounds_before + min(sum(self.runs.values()), at.rounds))

    def status(self) -> str:
        """``D/T rounds, elapsed E, ETA R``."""
        at, done = self.at, self.done()
        total = at.rounds_total if at is not None else 0
        elapsed = self.clock() - self.started
        text = f"{done}/{total} rounds, elapsed {_clock(elapsed)}"
        if done >= total:
            return text
        if self.trained == 0:
            return text + ", ETA ?"
        return text + f", ETA {_clock(elapsed / self.trained * (total - done))}"

    def _where(self) -> str:
        at = self.at
        return f"cell {at.index}/{at.cells} ({at.label})"

    def cell(self, at: Any) -> None:
        """A cell started, was kept or finished (``at``: a ``CellProgress`` of
        :mod:`silodp.experiment.grid`)."""
        self.at = at
        if at.status == "started":
            self.runs = {}
        if not self.terminal:
            what = {
                "started": f"started, {at.rounds} rounds planned",
                "kept": "finished before, kept",
                "finished": "finished",
            }.get(at.status, at.status)
            self._line(f"sweep: {self._where()} {what}; {self.status()}")
            return
        self._draw()

    def run(self, name: str, rounds: int) -> Callable[[dict[str, Any]], None]:
        """One run's rounds, counted into the sweep's view (a ``ProgressFactory``)."""
        every = max(1, math.ceil(rounds / PLAIN_LINES))

        def update(row: dict[str, Any]) -> None:
            r = int(row["round"])
            self.runs[name] = r
            self.trained += 1
            fields = ", ".join(f"{k}={v}" for k, v in _postfix(row).items())
            what = f"{name}: round {r}/{rounds}" + (f", {fields}" if fields else "")
            if self.terminal:
                self._draw(what)
            elif r == 1 or r == rounds or r % every == 0:
                self._line(f"  {what} | sweep: {self.status()}")

        return update

    def log(self, line: str) -> None:
        """A line on stdout, above the bar on a terminal."""
        if self.terminal and self.bar is not None:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stdout)
        else:
            typer.echo(line)

    def close(self) -> None:
        if self.bar is not None:
            self._draw()
            self.bar.close()
            self.bar = None

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _draw(self, run: str = "") -> None:
        from tqdm import tqdm

        if self.at is None:
            return
        if self.bar is None:
            self.bar = tqdm(
                total=self.at.rounds_total, file=self.stream, bar_format="{desc} |{bar}|"
            )
        label = self.at.label if len(self.at.label) <= 40 else self.at.label[:39] + "…"
        text = self.status() + (f" | {run}" if run else "")
        self.bar.n = self.done()
        self.bar.set_description_str(
            f"cell {self.at.index}/{self.at.cells} ({label})", refresh=False
        )
        # the status after the bar, as literal text (tqdm formats bar_format)
        self.bar.bar_format = "{desc} |{bar}| " + text.replace("{", "{{").replace("}", "}}")
        self.bar.refresh()
