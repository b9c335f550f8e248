"""Checkpoints: what a run needs to continue after its last completed round.

A checkpoint holds the round, the rows of ``metrics.jsonl`` and of the silo-private
diagnostics so far, the engine's state (the global model and every silo's state,
e.g. PriFedSync's helper models and optimiser moments) and what it must match to be used: the
run's resolved config and silodp's version. Each round's coins are a function of the seed and
the round (secure ones are fresh anyway), so no generator state needs keeping. It is written
whole (temporary file, fsync, rename) as soon as a round ends, before the round's metrics, so
a crash leaves the last complete one and a round is either in it or run again. It lives in
the run's ``silo_private/``: the silos' states and their un-noised diagnostics are in it, so it
must not leave the consortium with the released files.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from silodp.errors import InvalidValueError
from silodp.experiment.record import PRIVATE_DIR
from silodp.federated import Engine
from silodp.io import atomic_write

__all__ = ["CHECKPOINT", "checkpoint_path", "code_version", "load_checkpoint", "save_checkpoint"]

#: the checkpoint, relative to the run's directory
CHECKPOINT = f"{PRIVATE_DIR}/checkpoint.pt"
#: where versions before it wrote it (read, so that such a run is refused, not restarted)
_OLD_CHECKPOINT = "checkpoint.pt"


def checkpoint_path(run_dir: Path) -> Path | None:
    """The run's checkpoint file, where it is (``None``: there is none)."""
    for name in (CHECKPOINT, _OLD_CHECKPOINT):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


@functools.cache
def code_version() -> str:
    """silodp's version and a digest of its source files, which a checkpoint must match: a
    run continues only with the code that started it."""
    try:
        version = metadata.version("silodp")
    except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        version = "unknown"
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return f"{version}+{digest.hexdigest()[:12]}"


def save_checkpoint(
    run_dir: Path,
    round_index: int,
    engine: Engine,
    config_hash: str,
    rows: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """Writes the checkpoint after ``round_index``: the engine's state and the run's released
    and silo-private rows so far (which the files are rewritten from on resume)."""
    state = {
        "round": round_index,
        "engine": engine.state(),
        "rows": rows,
        "config_hash": config_hash,
        "version": code_version(),
    }
    atomic_write(run_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))


def load_checkpoint(run_dir: Path, config_hash: str) -> dict[str, Any] | None:
    """The run's last checkpoint (``None``: it completed no round).

    Raises:
      InvalidValueError: the checkpoint is of another config or another silodp version.
    """
    path = checkpoint_path(run_dir)
    if path is None:
        return None
    try:
        state: dict[str, Any] = torch.load(path, weights_only=False)
        if not isinstance(state, dict) or not {"config_hash", "version"} <= set(state):
            raise ValueError("not a checkpoint of a silodp run")
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        raise InvalidValueError(
            f"Expected {str(path)!r} to be the run's checkpoint, but it cannot be read "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}). Restore it, or "
            "start the run afresh (--overwrite; what its rounds spent stays in its ledger)."
        ) from None
    if state["config_hash"] != config_hash:
        raise InvalidValueError(
            f"Expected the checkpoint {str(path)!r} to be of this run's config; the config "
            "changed since it was written. Resume with the config the run started with."
        )
    if state["version"] != code_version():
        raise InvalidValueError(
            f"Expected the checkpoint {str(path)!r} to be written by silodp "
            f"{code_version()}, got {state['version']}; resume with that version."
        )
    return state
