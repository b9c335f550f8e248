"""Atomic result files: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "write_json", "write_jsonl", "write_text"]


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Calls ``write(tmp)`` on a temporary file beside ``path``, then renames it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    return write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
