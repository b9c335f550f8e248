"""Which data a run started on: a digest of the records as loaded and split, kept under the
run's ``silo_private/`` and compared when the run resumes (a changed file could move test
subjects into training)."""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from typing import Any

from silodp.config import ExperimentConfig
from silodp.data import FederatedData
from silodp.data.dataset import hash_arrays
from silodp.errors import InvalidValueError
from silodp.experiment.record import PRIVATE_DIR
from silodp.io import write_json

__all__ = [
    "DATA_DIGEST_FILE",
    "check_data_unchanged",
    "check_run_data",
    "data_digest",
    "record_data",
]

#: a run's digest of the data it trains and tests on, under its ``silo_private/``: a resume
#: recomputes it and refuses other data (derived from the records, so silo-private)
DATA_DIGEST_FILE = "data_digest.json"

_DIGESTS: weakref.WeakKeyDictionary[FederatedData, str] = weakref.WeakKeyDictionary()


def data_digest(data: FederatedData) -> str:
    """SHA-256 of the federated data as loaded and split: the training records, labels,
    silos and subjects and the test records, labels and silos, each array hashed with its
    dtype and shape (as :func:`silodp.engines.silo.silo_digest` hashes one silo's records),
    and the number of classes and silos."""
    cached = _DIGESTS.get(data)
    if cached is not None:
        return cached
    h = hashlib.sha256(b"silodp-data-digest-v1")
    train, test = data.train, data.test
    h.update(f"classes={train.num_classes};silos={train.num_silos}".encode())
    parts = {
        "train.x": train.x,
        "train.y": train.y,
        "train.silo": train.silo,
        "train.subject": train.subject,
        "test.x": test.x,
        "test.y": test.y,
        "test.silo": test.silo,
    }
    hash_arrays(h, parts)
    digest = h.hexdigest()
    _DIGESTS[data] = digest
    return digest


def _data_source(config: ExperimentConfig) -> str:
    """The data's source as the config names it: its path (and test path), or the source."""
    cfg = config.data
    if cfg.path is None:
        return f"[data] source = {cfg.source!r}"
    where = f"[data] path = {cfg.path!r}"
    if cfg.test_path is not None:
        where += f" (test_path = {cfg.test_path!r})"
    return where


def _digest_record(config: ExperimentConfig, data: FederatedData) -> dict[str, Any]:
    return {
        "digest": data_digest(data),
        "method": "sha256 over the dtype, shape and bytes of the training records, labels, "
        "silos and subjects and the test records, labels and silos, after loading and splitting",
        "source": config.data.source,
        "path": config.data.path,
        "test_path": config.data.test_path,
        "train_records": len(data.train),
        "test_records": len(data.test),
    }


def _refuse_changed_data(
    config: ExperimentConfig, data: FederatedData, recorded: Path, was: dict[str, Any]
) -> InvalidValueError:
    counts = ""
    if "train_records" in was and "test_records" in was:
        counts = (
            f" (then {was['train_records']} training and {was['test_records']} test records, "
            f"now {len(data.train)} and {len(data.test)})"
        )
    return InvalidValueError(
        f"Expected the data the run started on to resume it: the data of "
        f"{_data_source(config)} changed since the run started{counts}; its digest differs "
        f"from the one recorded in {str(recorded)!r}. A resumed run must continue on the same "
        "records (a changed file can move test subjects into training). Restore the data as "
        "it was, or start afresh into another directory with silodp run CONFIG --out NEW_DIR "
        "(nothing was written)."
    )


def _read_digest(path: Path) -> dict[str, Any]:
    try:
        was = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(was, dict) or not isinstance(was.get("digest"), str):
            raise ValueError("no digest")
    except (OSError, ValueError) as err:
        raise InvalidValueError(
            f"Expected {str(path)!r} to hold the digest of the data the run started on, but it "
            f"cannot be read ({err}); the run cannot be checked to continue on the same data."
        ) from None
    return was


def check_data_unchanged(out: Path, config: ExperimentConfig, data: FederatedData) -> None:
    """Before a resume writes anything: refuses ``data`` if it is not the data every started
    run in ``out`` recorded (:data:`DATA_DIGEST_FILE`), and a run that checkpointed a round
    but holds no digest (a run records it before its first round, so it was lost: the data
    could not be compared).

    Raises:
      InvalidValueError: the data changed since a run started, or cannot be compared.
    """
    current = data_digest(data)
    found = sorted(out.rglob(f"{PRIVATE_DIR}/{DATA_DIGEST_FILE}"))
    for path in found:
        was = _read_digest(path)
        if was["digest"] != current:
            raise _refuse_changed_data(config, data, path, was)
    # a run that checkpointed a round continues from it (a run with no checkpoint starts its
    # rounds again)
    started = {
        p.parent if p.parent.name != PRIVATE_DIR else p.parent.parent
        for p in out.rglob("checkpoint.pt")
    }
    lost = sorted(d for d in started if not (d / PRIVATE_DIR / DATA_DIGEST_FILE).is_file())
    if lost:
        names = ", ".join(str(d.relative_to(out)) for d in lost)
        raise InvalidValueError(
            f"Expected {str(lost[0] / PRIVATE_DIR / DATA_DIGEST_FILE)!r}, the digest of the "
            f"data run(s) {names} started on: a run records it before its first round, and "
            f"without it a resume cannot check that {_data_source(config)} is unchanged. "
            "Restore it, or start afresh into another directory (nothing was written)."
        )


def record_data(
    run_dir: Path, config: ExperimentConfig, data: FederatedData, *, resume: bool
) -> None:
    """Writes the run's :data:`DATA_DIGEST_FILE` (a resume keeps the one its run started
    with, and records one where none was: a run that had not begun its rounds)."""
    path = run_dir / PRIVATE_DIR / DATA_DIGEST_FILE
    if resume and path.is_file():  # compared before the run resumed: kept as it started
        return
    write_json(path, _digest_record(config, data))


def check_run_data(run_dir: Path, config: ExperimentConfig, data: FederatedData) -> None:
    """Refuses to resume the run in ``run_dir`` on ``data`` if it recorded other data.

    Raises:
      InvalidValueError: the data changed since the run started.
    """
    digest = run_dir / PRIVATE_DIR / DATA_DIGEST_FILE
    if digest.is_file():
        was = _read_digest(digest)
        if was["digest"] != data_digest(data):
            raise _refuse_changed_data(config, data, digest, was)
