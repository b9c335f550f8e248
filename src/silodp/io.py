"""Atomic result files (a reader never sees a half-written file), and the check that a results
directory can be written before anything slow starts."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from silodp.errors import InvalidValueError

__all__ = [
    "atomic_write",
    "check_writable_dir",
    "json_number",
    "write_json",
    "write_jsonl",
    "write_text",
]


def json_number(value: float | None) -> float | None:
    """``value`` as the result files hold it: ``None`` for ∞ and NaN, which JSON has not (an
    ε of ``None`` is read back as ∞: no guarantee)."""
    return value if value is not None and math.isfinite(value) else None


def _umask() -> int:
    """The process's file-mode creation mask (read without changing it where Linux says it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # pragma: no cover - systems without /proc
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Calls ``write(tmp)`` on a temporary file beside ``path``, then renames it into place.

    The file gets the permissions any new file of the user gets (``0o666`` less the umask), as
    ``model.pt`` written by torch does, not the temporary file's ``0o600``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        tmp.chmod(0o666 & ~_umask())
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    return write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")  # pragma: no cover - a relative path's parents end at "."


def check_writable_dir(path: str | Path, *, name: str = "out_dir") -> Path:
    """Checks that ``path`` is a directory silodp can write in, or one it can create: the
    path itself, or else its nearest existing ancestor, is a directory in which a file can be
    made. Nothing is left behind (the probe file is removed; no directory is created).

    Raises:
      InvalidValueError: ``path`` (or a part of it) is a file, a broken link, or in a
        directory where files cannot be made (no permission, a read-only file system).
    """
    path = Path(path)
    shown = f"{name} {str(path)!r}"
    existing = _nearest_existing(path.absolute())
    if not existing.exists():
        raise InvalidValueError(
            f"Expected {shown} to be a directory; {str(existing)!r} is a broken symbolic link."
        )
    if not existing.is_dir():
        what = "a regular file" if existing.is_file() else "not a directory"
        if existing == path.absolute():
            raise InvalidValueError(f"Expected {shown} to be a directory; it is {what}.")
        raise InvalidValueError(
            f"Expected {shown} to be a directory path; {str(existing)!r} is {what}, so no "
            "directory can be made under it."
        )
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".silodp-write-check-")
    except OSError as err:
        where = "it" if existing == path.absolute() else f"{str(existing)!r}"
        raise InvalidValueError(
            f"Expected {shown} to be a writable directory; cannot create files in {where}: "
            f"{err.strerror or err}."
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path
