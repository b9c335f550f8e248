"""Exclusive locks between processes on one file: one writer per ledger, one run per results
directory.

:func:`acquire` takes an exclusive ``flock`` on a lock file (created if missing, holding the
holder's process id); :func:`release` gives it back, and the last holder in the process removes
the file. A process that dies releases its locks with it (the file stays, free). Locks are
counted per process, so code that takes the same lock twice (a run and its ledger) nests.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import suppress

__all__ = ["Held", "acquire", "holder", "release"]

#: the locks this process holds: lock file -> (its descriptor, how many holders)
_HELD: dict[str, list[int]] = {}


class Held(Exception):
    """Another process holds the lock; ``holder`` is its process id as it wrote it ("?" if
    unreadable)."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"{name} is held by process {holder}")
        self.name = name
        self.holder = holder


def acquire(name: str) -> str:
    """Takes the lock file ``name`` without waiting; returns ``name`` for :func:`release`.

    Raises:
      Held: another process holds it.
    """
    held = _HELD.get(name)
    if held is not None:
        held[1] += 1
        return name
    while True:
        fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise Held(name, holder) from None
        try:  # the file a releasing holder unlinked is no lock any more: take the new one
            same = os.path.samestat(os.fstat(fd), os.stat(name))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[name] = [fd, 1]
    return name


def holder(name: str) -> str | None:
    """The process id another process holds the existing lock file ``name`` under (``None``:
    no such file, free, or held by this process). Creates nothing."""
    if name in _HELD:
        return None
    try:
        fd = os.open(name, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)  # closing releases a lock taken only to test it
    return None


def release(name: str) -> None:
    """Releases a lock of :func:`acquire`; the last holder in this process removes the file."""
    held = _HELD.get(name)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[name]
        with suppress(FileNotFoundError):
            os.unlink(name)  # while still holding it: a waiter then retries on a new file
        os.close(held[0])  # closing the descriptor releases the flock
