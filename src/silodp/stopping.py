"""A stop asked for while a run's rounds are running takes effect once the round in progress
is recorded and checkpointed.

A round records its silos' spending in the ledger before their messages are aggregated, so a
round cut short is composed in full and then runs again on resume: a calibrated run whose
budget is its target ε would end one round short. The command line's Ctrl-C and SIGTERM
handlers therefore :func:`defer` the first stop that arrives inside :func:`rounds_running`;
the round loop :func:`check`\\ s after each recorded round and raises it there. A second stop,
or one outside the rounds (calibrating, writing figures), is raised at once, except inside
:func:`shielded`: the few writes that record a stopped run's state finish first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["check", "defer", "rounds_running", "shielded", "shielding"]

#: re-entrant: the signal handler (:func:`defer`) runs in the main thread, possibly while that
#: thread is inside one of the sections below
_lock = threading.RLock()
_running = 0
_shielded = 0
_pending: BaseException | None = None


@contextlib.contextmanager
def rounds_running() -> Iterator[None]:
    """Within the block, a first stop is deferred to the end of the round in progress."""
    global _running, _pending
    with _lock:
        _running += 1
    try:
        yield
    except BaseException:
        with _lock:
            _running -= 1
            if _running == 0:  # an error (or the stop itself) ends the rounds anyway
                _pending = None
        raise
    with _lock:
        _running -= 1
        stop = _pending if _running == 0 else None
        if _running == 0:
            _pending = None
    if stop is not None:  # the rounds ended (the last one, or a stop at a target) before it
        raise stop


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Within the block every stop waits for its end, then the first one is raised: for the
    writes that say a stopped run was interrupted (a second Ctrl-C right after the first
    left its summary saying "running")."""
    global _shielded, _pending
    with _lock:
        _shielded += 1
    try:
        yield
    finally:
        with _lock:
            _shielded -= 1
            stop = _pending if _shielded == 0 and _running == 0 else None
            if stop is not None:
                _pending = None
    if stop is not None:
        raise stop


def shielding() -> bool:
    """Whether a stop now waits for a :func:`shielded` block."""
    with _lock:
        return _shielded > 0


def defer(stop: BaseException) -> bool:
    """Keeps ``stop`` for the end of the round in progress if rounds are running and no stop
    is kept yet, or for the end of a :func:`shielded` block; ``False``: raise it now."""
    global _pending
    with _lock:
        if _shielded:
            _pending = _pending or stop
            return True
        if _running == 0 or _pending is not None:
            return False
        _pending = stop
        return True


def check() -> None:
    """Raises the deferred stop, if there is one (called once a round is recorded)."""
    global _pending
    with _lock:
        stop, _pending = _pending, None
    if stop is not None:
        raise stop
