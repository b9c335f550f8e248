"""A silo where its data is: its records, the algorithm's local update, its secrets.

:class:`SiloRuntime` answers the server's messages (:mod:`silodp.engines.messages` names them)
with exactly the code the in-process simulator runs: the same algorithm object (rebuilt from
the calibrated config and the public set-up, :meth:`Algorithm.at_silo`), the same coins, the
same local update. What is secret to the silos stays here: the key pair and pairwise keys of
the masked sum, the shared seed from which the subject sample is drawn, and the records.

A silo's records come from a file of its own (:func:`write_silo_data`, written per silo by
``silodp federation up`` or by the simulation): features, labels and the federation-wide
subject ids, with a digest the server checks before anything trains.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from silodp.algorithms import SiloData, SiloUpdate, algorithm_class
from silodp.crypto.masked_sum import MaskedSumParty
from silodp.crypto.prg import ChaCha20Prg, derive_key
from silodp.crypto.protocol import Parties
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset
from silodp.engines import messages as msg
from silodp.engines import weighting
from silodp.errors import InvalidValueError
from silodp.federated.simulator import SETUP_STREAM, SILO_STREAM, round_coins, run_coins
from silodp.io import atomic_write
from silodp.models import build_model

__all__ = [
    "SiloFile",
    "SiloRuntime",
    "read_silo_data",
    "silo_digest",
    "silo_file",
    "silo_secret",
    "write_silo_data",
]


def silo_digest(x: np.ndarray, y: np.ndarray, subject: np.ndarray) -> str:
    """SHA-256 of a silo's records (features, labels, subject ids) in file order."""
    h = hashlib.sha256()
    for a in (x, y, subject):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class SiloFile:
    """One silo's records as read from its file."""

    silo: int
    x: np.ndarray
    y: np.ndarray
    subject: np.ndarray

    @property
    def digest(self) -> str:
        return silo_digest(self.x, self.y, self.subject)


def silo_file(directory: str | Path, silo: int) -> Path:
    """Where silo ``silo``'s records are kept in ``directory`` (one file per silo)."""
    return Path(directory) / f"silo-{silo}.npz"


def write_silo_data(train: FederatedDataset, silo: int, path: Path) -> Path:
    """Writes silo ``silo``'s records of ``train`` to ``path`` (``.npz``, atomically)."""
    idx = train.silo_indices(silo)
    buffer = io.BytesIO()
    np.savez(
        buffer,
        silo=np.int64(silo),
        x=np.ascontiguousarray(train.x[idx]),
        y=train.y[idx],
        subject=train.subject[idx],
    )
    atomic_write(path, lambda p: p.write_bytes(buffer.getvalue()))
    return path


def read_silo_data(path: str | Path) -> SiloFile:
    """The silo file at ``path``.

    Raises:
      InvalidValueError: no such file, or not a silo file.
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidValueError(f"Expected a silo data file at {str(p)!r}; there is none.")
    try:
        with np.load(p, allow_pickle=False) as blob:
            return SiloFile(int(blob["silo"]), blob["x"], blob["y"], blob["subject"])
    except (KeyError, ValueError, OSError) as err:
        raise InvalidValueError(
            f"Expected {str(p)!r} to be a silo data file (silo, x, y, subject): {err}"
        ) from err


def silo_secret(path: str | Path) -> bytes:
    """The silo's own 32-byte secret kept at ``path`` (created there, mode 0600, on first
    use): every key of the silo's side of the masked sum derives from it and the session."""
    p = Path(path)
    if not p.is_file():
        secret = os.urandom(32)

        def write(q: Path) -> None:
            q.write_bytes(secret)
            q.chmod(0o600)

        atomic_write(p, write)
    secret = p.read_bytes()
    if len(secret) != 32:
        raise InvalidValueError(f"Expected a 32-byte silo secret in {str(p)!r}.")
    return secret


class SiloRuntime:
    """One silo's side of every run the server starts.

    It keeps nothing between messages that it could not rebuild: each round's message carries
    the run's public set-up (and the masked sum's public key directory and sealed seed), and
    the silo's keys derive from its ``secret`` and the session, so a silo process may start
    afresh for every message (as Flower's deployment runs it) or after a restart.
    """

    def __init__(self, data: SiloFile, secret: bytes | None = None) -> None:
        self.data = data
        self.secret = secret if secret is not None else os.urandom(32)
        self._cache: dict[str, Any] = {}

    def handle(self, kind: str, body: Any) -> Any:
        """The reply to the server's message ``kind`` with ``body``.

        Raises:
          InvalidValueError: an unknown message, or one that does not fit this silo.
        """
        handler = {
            msg.HELLO: self._hello,
            msg.SETUP: self._setup,
            msg.DIRECTORY: self._directory,
            msg.SEED: self._seed,
            msg.WEIGHTING: self._weighting,
            msg.TRAIN: self._train,
        }.get(kind)
        if handler is None:
            raise InvalidValueError(f"Expected a message kind among {msg.KINDS}, got {kind!r}.")
        if not isinstance(body, dict):
            raise InvalidValueError(f"Expected a mapping as the body of {kind!r}.")
        return handler(body)

    def _hello(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "silo": self.data.silo,
            "records": len(self.data.y),
            "digest": self.data.digest,
            "identity": weighting.identity_key(self.secret).public_bytes,
        }

    def _party(self, setup: dict[str, Any]) -> MaskedSumParty:
        session = setup["session"]
        source = ChaCha20Prg(derive_key(self.secret, b"silodp/engine/masked-sum", salt=session))
        return MaskedSumParty(self.data.silo, setup["silo_ids"], session, source=source)

    def _run(self, setup: dict[str, Any]) -> dict[str, Any]:
        """The run ``setup`` describes (built once per session in this process)."""
        if self._cache.get("session") == setup.get("session"):
            return self._cache
        d = self.data
        if setup["silo"] != d.silo:
            raise InvalidValueError(f"Silo {d.silo}: set-up addressed to silo {setup['silo']}.")
        if setup["digest"] != d.digest:
            raise InvalidValueError(
                f"Silo {d.silo}: the server planned for other records (digest "
                f"{setup['digest'][:12]}…, this silo's file has {d.digest[:12]}…)."
            )
        keep = np.asarray(setup["keep"], dtype=bool)
        if keep.shape != d.y.shape:
            raise InvalidValueError(
                f"Silo {d.silo}: expected a keep mask of {len(d.y)} records, got {keep.shape}."
            )
        idx = np.flatnonzero(keep)
        model = setup["model"]
        self._cache = {
            "session": setup["session"],
            "silo": SiloData(
                silo=d.silo,
                x=torch.from_numpy(np.ascontiguousarray(d.x[idx])),
                y=torch.from_numpy(d.y[idx]),
                subject=torch.from_numpy(d.subject[idx]),
            ),
            "model": build_model(
                model["name"], tuple(model["feature_shape"]), model["num_classes"], seed=0
            ),
            "party": self._party(setup) if setup["key_exchange"] else None,
            "algorithm": None,
        }
        return self._cache

    def _setup(self, body: dict[str, Any]) -> dict[str, Any]:
        run = self._run(body)
        reply: dict[str, Any] = {
            "dh_public": None if run["party"] is None else run["party"].public_key
        }
        if body.get("weighting") is not None:
            reply["key_share"] = self._weighting_party(body)[1]
        return reply

    def _weighting_party(
        self, setup: dict[str, Any], relay: dict[str, Any] | None = None
    ) -> tuple[Any, Any]:
        """This silo's party of the weighting protocol, rebuilt as far as ``relay`` goes."""
        public = setup.get("weighting")
        if public is None:
            raise InvalidValueError(f"Silo {self.data.silo}: no weighting protocol in this run.")
        subjects = self._run(setup)["silo"].subject.numpy()
        return weighting.silo_party(self.secret, self.data.silo, subjects, public, relay)

    def _weighting(self, body: dict[str, Any]) -> dict[str, Any]:
        stage = body.get("stage")
        if stage == weighting.DIRECTORY:
            _, sealed = self._weighting_party(body["setup"], {"directory": body["directory"]})
            return {"sealed": sealed}
        if stage == weighting.SEED:
            relay = {"directory": body["directory"], "sealed": body["sealed"]}
            party, histogram = self._weighting_party(body["setup"], relay)
            self._cache["weighting"] = party
            return {"histogram": histogram}
        raise InvalidValueError(
            f"Silo {self.data.silo}: expected a weighting stage among "
            f"{(weighting.DIRECTORY, weighting.SEED)}, got {stage!r}."
        )

    def _directory(self, body: dict[str, Any]) -> dict[str, Any]:
        party = self._run(body["setup"])["party"]
        if party is None:
            raise InvalidValueError(f"Silo {self.data.silo}: no masked sum in this run.")
        return {"sealed": party.receive_directory(body["directory"])}

    def _seed(self, body: dict[str, Any]) -> dict[str, Any]:
        run = self._run(body["setup"])
        party = run["party"]
        if party is None:
            raise InvalidValueError(f"Silo {self.data.silo}: no masked sum in this run.")
        if "keyed" not in run:
            sealed = party.receive_directory(body["directory"])
            if party.silo_id != party.leader:
                party.receive_seed(*body["sealed"][party.silo_id])
            elif sealed != {int(k): tuple(v) for k, v in body["sealed"].items()}:
                # the seeds this silo sealed (drawn once per party) came back altered
                raise InvalidValueError(f"Silo {party.silo_id}: the relayed seeds differ.")
            run["keyed"] = True
        return {}

    def _algorithm(self, setup: dict[str, Any], relay: dict[str, Any] | None = None) -> Any:
        """The algorithm as this silo runs it (``relay``: the weighting protocol's transcript,
        to rebuild this silo's party in a fresh process)."""
        run = self._run(setup)
        d = self.data.silo
        if run["algorithm"] is None:
            key = None
            if setup["silos_sample"] and setup["noise"] == "seeded":
                # as the run's set-up drew it: reproducible by whoever knows the seed
                key = SharedSampleKey.generate(run_coins("seeded", setup["seed"], SETUP_STREAM))
            elif setup["silos_sample"] and run["party"] is not None:
                key = run["party"].sample_key
            public = setup["public"]
            if setup.get("weighting") is not None:
                party = run.get("weighting")
                if party is None:
                    party = self._weighting_party(setup, relay)[0]
                public = {**public, "parties": Parties(setup["weighting"]["config"], {d: party})}
            run["algorithm"] = algorithm_class(setup["algorithm"]).at_silo(
                setup["config"], public, sample_key=key
            )
        return run["algorithm"]

    def _train(self, body: dict[str, Any]) -> dict[str, Any]:
        setup = body["setup"]
        run = self._run(setup)
        if run["party"] is not None:
            self._seed(body)
        round_index = int(body["round"])
        coins = round_coins(setup["noise"], setup["seed"], round_index, SILO_STREAM, self.data.silo)
        algorithm = self._algorithm(setup, body.get("weighting"))
        state = body["state"]
        update = algorithm.local_update(
            run["model"], body["params"], run["silo"], coins, body["instructions"], state
        )
        if setup["secure_sum"]:
            update = replace(update, params=self._masked(update, round_index, setup["grid"]))
        return {"update": msg.update_to_wire(update), "state": state}

    def _masked(self, update: SiloUpdate, round_index: int, grid: float) -> dict[str, Any]:
        """The update's message as integer steps of ``grid``, masked for the secure sum."""
        flat = torch.cat([v.reshape(-1).to(torch.float64) for v in update.params.values()])
        steps = flat / grid
        if not torch.equal(steps, torch.round(steps)):
            raise InvalidValueError(f"Silo {self.data.silo}: its message is off the noise grid.")
        masked = self._cache["party"].mask(steps.to(torch.int64).numpy(), round_index)
        return {msg.MASKED: masked}
