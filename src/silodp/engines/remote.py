"""The server's side when the silos run apart: the simulator's round, with messages.

:class:`RemoteEngine` is the in-process :class:`~silodp.federated.simulator.Simulator` with its
one silo-facing step (:meth:`silo_updates`) replaced by messages through a :class:`Transport`
(Flower's grid, or a loopback for tests): silo sampling, the round's instructions, the ledger,
the accounting, aggregation and evaluation are the simulator's own code. Before the first
round it learns which node is which silo from their replies (refusing unknown or duplicate
silos and records other than planned), sends each silo the calibrated algorithm and, for the
algorithms whose guarantee against the server needs it, sets up the masked sum
(:mod:`silodp.crypto.masked_sum`): the server then sees only the sum of the silos' messages.

Faults: every wait has a timeout. A silo that fails, times out or sends a malformed reply
aborts the round (:class:`SiloFailureError`), or with ``on_failure="skip"`` is left out of it
where the algorithm allows it. Algorithms that need every silo (the ULDP family) and the masked
sum always abort. Whatever happens, every silo chosen for a round is charged its planned events
before the round's messages are sent (a reply may wait at the transport while the server dies,
a late one may still arrive, the server cannot tell a dead silo from a slow one); a reply whose
events differ from the plan is refused as malformed.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from silodp import faults
from silodp._validation import check_choice
from silodp.accounting import SiloPrivacy
from silodp.algorithms import SiloUpdate
from silodp.algorithms.uldp_common import PROTOCOL_AGGREGATION_NOTE, SIMULATED_AGGREGATION_NOTE
from silodp.crypto.errors import ProtocolError
from silodp.crypto.masked_sum import unmask_sum
from silodp.data import FederatedDataset
from silodp.engines import messages as msg
from silodp.engines import weighting, wire
from silodp.engines.silo import silo_digest
from silodp.errors import SilodpError
from silodp.federated.simulator import Simulator

__all__ = ["FAILURE_POLICIES", "RemoteEngine", "SiloFailureError", "Transport", "kept_mask"]

logger = logging.getLogger(__name__)

FAILURE_POLICIES = ("abort", "skip")

MASKED_SUM_NOTE = (
    "secure aggregation run by the engine: each silo sent its message masked with pairwise "
    "masks (X25519 key agreement relayed by the server; the masks cancel only in the sum of "
    "every silo's message), and the server unmasked only that sum. ε against the server holds "
    "for an honest-but-curious server that relays the silos' keys faithfully (the key "
    "directory is not signed) and colludes with no silo; a round a silo misses is aborted"
)

REMOTE_PROTOCOL_NOTE = (
    "private weighting protocol run over messages between the silos and the server: weights "
    "n_{s,a}/n_a, per-subject weighting and the sum over silos were computed under Paillier "
    "encryption with blinded histograms and pairwise masks; the server decrypted only the sum "
    "over all silos. This holds against an honest-but-curious server that colludes with no "
    "silo; the silos' Ed25519 identity keys reached the server in their hello messages and "
    "were not compared out of band, so a server that substitutes keys is not covered. Deltas "
    "are clipped so that their fixed-point encodings stay within C, and each silo draws its "
    "noise exactly as rounded-Gaussian integers on the aggregate's grid, a post-processing of "
    "the accounted Gaussian mechanism"
)

CLEAR_REMOTE_NOTE = (
    "no secure aggregation in this run (no noise, so no grid for a masked sum): the server saw "
    "each silo's message"
)

PLANNING_NOTE = (
    "the server planned this run from every silo's records: it built the whole dataset to "
    "calibrate the noise and apply the span and group caps (docs/guarantees.md, G2), so ε "
    "against the server bounds what the silos' messages reveal, not a server kept from the data"
)

#: the in-process simulator's notes on aggregation, which this engine's notes replace
IN_PROCESS_NOTES = (SIMULATED_AGGREGATION_NOTE, PROTOCOL_AGGREGATION_NOTE)


class SiloFailureError(SilodpError):
    """A silo failed, timed out or sent a malformed reply where the round cannot go on."""


class NoReply(str):
    """Why a node gave no reply the server can read although it may have released its
    message (e.g. a transport error after it pulled the request): charged like no answer."""


class Transport(Protocol):
    """Moves messages between the server and the nodes the silos run on."""

    def wait_for_nodes(self, count: int, timeout: float) -> list[int]:
        """The connected nodes' ids once ``count`` are connected (fewer after ``timeout``)."""
        ...

    def exchange(
        self, requests: Mapping[int, tuple[str, bytes]], timeout: float
    ) -> dict[int, bytes | str]:
        """Sends each node its ``(kind, body)``; each node's reply body, or a string saying
        why there is none.

        Bytes: a reply reached the server (readable or not). A string: the node answered with
        an error instead of a reply, so it released nothing; a :class:`NoReply` string: an
        error that does not rule out a released message. No entry: no answer within
        ``timeout`` seconds; a reply may still come later, so the node may have released its
        message."""
        ...


def _row_keys(x: np.ndarray, y: np.ndarray, subject: np.ndarray) -> list[bytes]:
    flat = np.ascontiguousarray(x).reshape(len(y), -1)
    return [
        hashlib.blake2b(flat[i].tobytes() + y[i].tobytes() + subject[i].tobytes()).digest()
        for i in range(len(y))
    ]


def kept_mask(full: FederatedDataset, kept: FederatedDataset, silo: int) -> np.ndarray:
    """Which of silo ``silo``'s records in ``full`` (in order) the bounded ``kept`` holds: the
    bounds keep an ordered subset, so each kept record is matched to the next equal one."""
    a, b = full.silo_indices(silo), kept.silo_indices(silo)
    keys_full = _row_keys(full.x[a], full.y[a], full.subject[a])
    keys_kept = _row_keys(kept.x[b], kept.y[b], kept.subject[b])
    mask = np.zeros(len(a), dtype=bool)
    j = 0
    for i, key in enumerate(keys_full):
        if j < len(keys_kept) and key == keys_kept[j]:
            mask[i] = True
            j += 1
    if j != len(keys_kept):
        raise ValueError(f"Silo {silo}'s bounded records are not a subset of its records.")
    return mask


class RemoteEngine(Simulator):
    """Runs the silos' local updates where the silos are, through ``transport``.

    Args (beyond :class:`Simulator`'s):
      transport: the message channel to the nodes.
      records: every silo's records before the run's bounds (what each silo's file holds).
      timeout: seconds any one exchange may take.
      on_failure: ``"abort"`` the run at a failed silo, or ``"skip"`` it for the round where
        the algorithm allows it.
      connect_timeout: seconds to wait for every silo's node to connect.
      model_spec: the model's ``name``, ``feature_shape`` and ``num_classes``.
    """

    def __init__(
        self,
        *,
        transport: Transport,
        records: FederatedDataset,
        timeout: float = 600.0,
        on_failure: str = "abort",
        connect_timeout: float = 300.0,
        model_spec: Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        #: the run's records after its bounds (what the silos train on)
        self.bounded: FederatedDataset = kwargs["train"]
        self.model_spec = dict(model_spec)
        self.transport = transport
        self.records = records
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.on_failure = check_choice("on_failure", on_failure, FAILURE_POLICIES)
        grid = None
        if self.algorithm.needs_secure_aggregation():
            grid = self.algorithm.secure_sum_grid()
        #: the grid of the masked sum's integers (None: messages go to the server as they are)
        self.grid = grid
        self.nodes: dict[int, int] = {}
        self._identities: dict[int, bytes] = {}
        self._relay: dict[int, Any] = {}
        self._dim = sum(int(v.numel()) for v in self.params.values())
        self._connect()

    @property
    def secure_sum(self) -> bool:
        return self.grid is not None

    def summary_fields(self) -> dict[str, Any]:
        """How the server aggregated (``aggregation``), for the run's summary."""
        if self._relay:
            aggregation = (
                "private weighting protocol: the server decrypted only the sum of the silos' "
                "masked, encrypted messages"
            )
        elif self.secure_sum:
            aggregation = "masked sum: the server saw only the sum of the silos' messages"
        elif self.algorithm.needs_secure_aggregation():
            aggregation = "clear (no noise, no guarantee): the server saw each silo's message"
        else:
            aggregation = "clear: the server saw each silo's message"
        return {"aggregation": aggregation}

    def summary_notes(self, notes: Sequence[str]) -> list[str]:
        """The run summary's ``notes`` with each note on how the in-process simulator
        aggregates replaced, once and in place, by what this engine did
        (:meth:`aggregation_note`), the other notes kept as they are, and
        :data:`PLANNING_NOTE` last."""
        mine = self.aggregation_note()
        out: list[str] = []
        for note in notes:
            if note in IN_PROCESS_NOTES:
                if mine in out:
                    continue
                note = mine
            if note not in out:
                out.append(note)
        return [n for n in out if n != PLANNING_NOTE] + [PLANNING_NOTE]

    def aggregation_note(self) -> str:
        """What the server of this run could see of the silos' messages, for the summary's
        notes (replacing the in-process simulator's)."""
        if self._relay:
            return REMOTE_PROTOCOL_NOTE
        if self.secure_sum:
            return MASKED_SUM_NOTE
        return CLEAR_REMOTE_NOTE

    # --- set-up ---------------------------------------------------------------------------
    def _send(
        self, requests: Mapping[int, tuple[str, Any]]
    ) -> tuple[dict[int, Any], dict[int, str], set[int]]:
        """Sends each silo its message: every silo's decoded reply, why the others gave none
        (a failure, a timeout or an unreadable reply), and the silos that may have released
        their message to the server: those whose reply reached it (readable or not) and those
        that gave no answer in time (a late reply may still reach it)."""
        by_node = {self.nodes[s]: (kind, wire.encode(body)) for s, (kind, body) in requests.items()}
        replies = self.transport.exchange(by_node, self.timeout)
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}
        released: set[int] = set()
        for s in requests:
            reply = replies.get(self.nodes[s])
            if isinstance(reply, NoReply):  # an error after which it may have sent its message
                released.add(s)
                failed[s] = f"no reply ({reply})"
                continue
            if isinstance(reply, str):  # an error the silo raised: it sent nothing
                failed[s] = reply
                continue
            released.add(s)
            if reply is None:
                failed[s] = f"no answer within {self.timeout:g} s"
                continue
            try:
                out[s] = wire.decode(reply)
            except wire.WireError as err:
                failed[s] = f"unreadable reply ({err})"
        return out, failed, released

    def _exchange(self, requests: Mapping[int, tuple[str, Any]], what: str) -> dict[int, Any]:
        """:meth:`_send`, where every silo must answer (else SiloFailureError)."""
        out, failed, _ = self._send(requests)
        if failed:
            raise SiloFailureError(
                f"{what}: " + "; ".join(f"silo {s}: {why}" for s, why in sorted(failed.items()))
            )
        return out

    def _connect(self) -> None:
        expected = self.records.num_silos
        nodes = self.transport.wait_for_nodes(expected, self.connect_timeout)
        if len(nodes) < expected:
            raise SiloFailureError(
                f"Expected {expected} silos' nodes to connect within {self.connect_timeout:g} s; "
                f"{len(nodes)} did."
            )
        replies = self.transport.exchange(
            {n: (msg.HELLO, wire.encode({})) for n in nodes}, self.timeout
        )
        seen: dict[int, int] = {}
        for node in nodes:
            reply = replies.get(node, f"no answer within {self.timeout:g} s")
            if isinstance(reply, str):
                raise SiloFailureError(f"Node {node} did not say which silo it is: {reply}")
            try:
                hello = wire.decode(reply)
            except wire.WireError as err:
                raise SiloFailureError(f"Node {node}'s hello cannot be read: {err}") from None
            silo = hello.get("silo") if isinstance(hello, dict) else None
            if isinstance(silo, bool) or not isinstance(silo, int) or not 0 <= silo < expected:
                raise SiloFailureError(
                    f"Node {node} answers as silo {silo!r}; expected one of 0..{expected - 1}."
                )
            if silo in seen:
                raise SiloFailureError(
                    f"Nodes {seen[silo]} and {node} both answer as silo {silo}; expected one "
                    "node per silo."
                )
            idx = self.records.silo_indices(silo)
            digest = silo_digest(
                self.records.x[idx], self.records.y[idx], self.records.subject[idx]
            )
            if hello.get("records") != len(idx) or hello.get("digest") != digest:
                raise SiloFailureError(
                    f"Silo {silo} (node {node}) holds {hello.get('records')!r} records with "
                    f"digest {str(hello.get('digest'))[:12]}…; the run was planned for "
                    f"{len(idx)} records with digest {digest[:12]}…."
                )
            seen[silo] = node
            identity = hello.get("identity")
            if not isinstance(identity, bytes):
                raise SiloFailureError(f"Silo {silo} (node {node}) gave no identity key.")
            self._identities[silo] = identity
        missing = sorted(set(range(expected)) - set(seen))
        if missing:
            raise SiloFailureError(f"No node answers as silo(s) {missing}.")
        self.nodes = seen
        self._setup()

    def _setup(self) -> None:
        algorithm = self.algorithm
        public = algorithm.silo_setup()
        session = secrets.token_bytes(16)
        silos_sample = bool(getattr(algorithm.config, "subject_sampler", None) == "silos")
        protocol = weighting.uses_protocol(algorithm)
        ids = sorted(self.nodes)
        requests = {}
        for s in ids:
            requests[s] = (
                msg.SETUP,
                {
                    "silo": s,
                    "digest": None,
                    "keep": None,
                    "algorithm": algorithm.name,
                    "config": algorithm.config,
                    "public": public,
                    "model": self.model_spec,
                    "noise": self.noise,
                    "seed": self.seed,
                    "secure_sum": self.secure_sum,
                    # the masked sum's keys; without it, the seed of a silos' sample (σ = 0)
                    "key_exchange": self.secure_sum
                    or (silos_sample and self.noise != "seeded" and not protocol),
                    "grid": self.grid,
                    "session": session,
                    "silo_ids": ids,
                    "silos_sample": silos_sample,
                },
            )
        for s in ids:
            body = requests[s][1]
            idx = self.records.silo_indices(s)
            body["digest"] = silo_digest(
                self.records.x[idx], self.records.y[idx], self.records.subject[idx]
            )
            body["keep"] = kept_mask(self.records, self.bounded, s)
        self._setups = {s: requests[s][1] for s in ids}
        self._keys: dict[str, Any] = {"directory": None, "sealed": None}
        if protocol:
            replies = self._weighting_setup(algorithm)
        else:
            replies = self._exchange(requests, "set-up")
        if not self._setups[ids[0]]["key_exchange"]:
            return
        for s in ids:
            reply = replies[s]
            if not isinstance(reply, dict) or not isinstance(reply.get("dh_public"), bytes):
                raise SiloFailureError(f"Silo {s}'s set-up reply has no public key (dh_public).")
        directory = {s: replies[s]["dh_public"] for s in ids}
        sealed = self._exchange(
            {s: (msg.DIRECTORY, {"setup": self._setups[s], "directory": directory}) for s in ids},
            "key exchange",
        )
        leader = ids[0]
        seeds = sealed[leader].get("sealed") if isinstance(sealed[leader], dict) else None
        if not isinstance(seeds, dict) or sorted(seeds) != ids[1:]:
            got = sorted(seeds) if isinstance(seeds, dict) else repr(seeds)[:80]
            raise SiloFailureError(f"Silo {leader} sealed the seed for {got}; expected {ids[1:]}.")
        # public: relayed with every round, so that a silo needs to keep nothing but its secret
        self._keys = {"directory": directory, "sealed": seeds}

    def _weighting_setup(self, algorithm: Any) -> dict[int, Any]:
        """The weighting protocol's set-up (:mod:`silodp.engines.weighting`) within the run's:
        the set-up message carries its public part, two more exchanges finish it."""
        replies: dict[int, Any] = {}

        def setup(public: dict[str, Any]) -> dict[int, Any]:
            for body in self._setups.values():
                body["weighting"] = public
            replies.update(
                self._exchange({s: (msg.SETUP, b) for s, b in self._setups.items()}, "set-up")
            )
            return replies

        def ask(stage: str, bodies: Mapping[int, dict[str, Any]]) -> dict[int, Any]:
            requests = {
                s: (msg.WEIGHTING, {"setup": self._setups[s], "stage": stage, **body})
                for s, body in bodies.items()
            }
            return self._exchange(requests, f"weighting protocol set-up ({stage})")

        try:
            self._relay = weighting.server_setup(algorithm, self._identities, setup, ask)
        except (ProtocolError, ValueError) as err:
            raise SiloFailureError(f"Weighting protocol set-up failed: {err}") from err
        return replies

    # --- one round ------------------------------------------------------------------------
    def silo_updates(
        self, round_index: int, chosen: list[int], instructions: Any, *, record: bool
    ) -> list[SiloUpdate]:
        requests = {
            s: (
                msg.TRAIN,
                {
                    "round": round_index,
                    "setup": self._setups[s],
                    **self._keys,
                    "weighting": self._relay.get(s),
                    "params": self.params,
                    "instructions": instructions,
                    "state": self.states[s],
                },
            )
            for s in chosen
        }
        #: what each chosen silo is planned to run: the events it is charged
        planned = {s: self.algorithm.silo_privacy_for(self.silos[s]) for s in chosen}
        if record:
            # Before any message leaves: a silo's noisy reply may sit at the transport (a
            # SuperLink) before this process reads it, and this process may die in between;
            # every chosen silo is charged its planned events now (an aborted round stays open
            # in the ledger and counts in full; a resumed run records its retry as a new
            # attempt). A silo that ends up sending nothing stays charged (conservative).
            for s in chosen:
                self._record_release(round_index, s, planned[s])
        started = time.perf_counter()
        replies, failed, may_have_sent = self._send(requests)
        updates = []
        for s in chosen:
            if s not in may_have_sent:
                continue  # an error the silo raised: it sent nothing
            try:
                if s not in replies:
                    raise msg.MalformedReplyError(failed[s])
                update = msg.update_from_wire(
                    replies[s],
                    silo=s,
                    like=self.params,
                    masked_size=self._dim if self.secure_sum else None,
                    encrypted=bool(self._relay),
                    dtype=self.algorithm.message_dtype,
                )
                state, before = replies[s]["state"], self.states[s]
                if before is not None and type(state) is not type(before):
                    raise msg.MalformedReplyError(
                        f"Silo {s}'s state is a {type(state).__name__}, not a "
                        f"{type(before).__name__}."
                    )
                if update.privacy != planned[s]:
                    # what was charged is the plan: a silo claiming other events (or none)
                    # ran something else, and its message is not used
                    raise msg.MalformedReplyError(
                        f"Silo {s} reported privacy events {update.privacy!r:.200}, not the "
                        f"planned {planned[s]!r:.200}."
                    )
            except msg.MalformedReplyError as err:
                failed[s] = str(err) + (
                    " (charged its planned events)" if record and self.ledger is not None else ""
                )
                continue
            self.states[s] = replies[s]["state"]
            updates.append(update)
        if failed:
            why = "; ".join(f"silo {s}: {w}" for s, w in sorted(failed.items()))
            may_skip = not (self.secure_sum or self.algorithm.needs_every_silo())
            charged = (
                [s for s in chosen if planned[s] is not None]
                if record and self.ledger is not None
                else []
            )
            if self.on_failure == "abort" or not may_skip or not updates:
                raise SiloFailureError(
                    f"Round {round_index}: {why}. The round is aborted"
                    + ("" if may_skip else f" ({self.algorithm.name} needs every silo)")
                    + "; nothing of it was aggregated"
                    + (
                        f"; the planned events of silo(s) {charged}, charged before the round's "
                        "messages were sent, are in the ledger."
                        if charged
                        else "."
                    )
                )
            logger.warning("round %d: skipping %s", round_index, why)
        logger.debug(
            "round %d: %d replies in %.2f s",
            round_index,
            len(updates),
            time.perf_counter() - started,
        )
        return updates

    def _record_release(self, round_index: int, silo: int, privacy: SiloPrivacy | None) -> None:
        """Records the events a silo is charged for a round (as :meth:`record_update` does for
        an update)."""
        if self.ledger is not None and privacy is not None:
            self.ledger.record(round_index, f"silo:{silo}", privacy)
            faults.reached("silo_recorded", round_index)

    def to_aggregate(self, updates: list[SiloUpdate]) -> list[SiloUpdate]:
        return [self._unmasked_sum(updates)] if self.secure_sum else updates

    def _unmasked_sum(self, updates: list[SiloUpdate]) -> SiloUpdate:
        """One update holding the sum of every silo's message (what the server learns)."""
        assert self.grid is not None
        total = unmask_sum([u.params[msg.MASKED] for u in updates])  # type: ignore[misc]
        flat = torch.from_numpy(total.astype(np.float64)) * self.grid
        params, start = {}, 0
        for k, v in self.params.items():
            size = int(v.numel())
            params[k] = flat[start : start + size].reshape(v.shape)
            start += size
        return replace(updates[0], params=params)
