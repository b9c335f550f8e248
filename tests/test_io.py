"""Result files are written whole and with the permissions the user's umask gives new files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from silodp.io import atomic_write, write_json


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        write_json(tmp_path / "summary.json", {"a": 1})
        atomic_write(tmp_path / "model.bin", lambda tmp: tmp.write_bytes(b"\x00"))
        plain = tmp_path / "plain.txt"
        plain.write_text("x")  # what any new file of this user gets
    finally:
        os.umask(previous)
    for name in ("summary.json", "model.bin", "plain.txt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "f.json", fail)
    assert list(tmp_path.iterdir()) == []
