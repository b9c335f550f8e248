"""The private weighting protocol of ``uldp_avg_w`` when the silos run apart.

The protocol's parties (:mod:`silodp.crypto.protocol`) are the in-process ones; only their
messages travel. The run's set-up message carries the protocol's public parameters, with every
silo's identity key as the silos gave it in their hello, and the server's hello; each silo
answers with its signed key share. Two more exchanges finish the set-up: with the key
directory (every silo derives its pairwise keys; the leader seals the shared seed for every
other silo) and with each silo's sealed seed (each silo returns its masked histogram). Every
round's message then carries the encrypted weights, and each silo answers with its masked
encrypted weighted sum; the server decrypts only their product.

A silo keeps nothing between messages: its party is rebuilt from the silo's secret, the
session, and the public transcript the server relays with every message (hello, directory,
the seed sealed for that silo). The set-up's randomness derives from the secret and the
session, so a rebuild reaches the same keys, seed and blinds; each round's re-randomisation
draws from the operating system's CSPRNG.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from silodp.algorithms import Algorithm
from silodp.algorithms.uldp_protocol import UldpAvgW
from silodp.crypto.identity import IdentityKey, generate_identity
from silodp.crypto.messages import KeyDirectory, KeyShare, MaskedHistogram, SealedSeed
from silodp.crypto.prg import ChaCha20Prg, derive_key
from silodp.crypto.protocol import Parties, ProtocolConfig, Server, Silo, SiloStage
from silodp.engines.messages import MalformedReplyError

__all__ = [
    "Ask",
    "identity_key",
    "server_setup",
    "silo_party",
    "uses_protocol",
]

#: sends every silo its stage's body and returns every silo's reply (or raises)
Ask = Callable[[str, Mapping[int, dict[str, Any]]], dict[int, Any]]
DIRECTORY = "directory"
SEED = "seed"


def uses_protocol(algorithm: Algorithm) -> bool:
    """Whether ``algorithm`` aggregates through the private weighting protocol."""
    return isinstance(algorithm, UldpAvgW) and algorithm.protocol is not None


def identity_key(secret: bytes) -> IdentityKey:
    """The silo's long-term Ed25519 identity key, derived from its secret."""
    return generate_identity(ChaCha20Prg(derive_key(secret, b"silodp/engine/identity")))


def _check_reply(silo: int, reply: Any, cls: type, what: str) -> Any:
    if not isinstance(reply, cls):
        raise MalformedReplyError(
            f"Silo {silo} sent a malformed reply: expected a {cls.__name__} for the {what}, "
            f"got {type(reply).__name__}."
        )
    return reply


def _field(silo: int, reply: Any, key: str, cls: type, what: str) -> Any:
    """``reply[key]``, checked to be a ``cls``, in silo ``silo``'s reply to the ``what``."""
    _check_reply(silo, reply, dict, what)
    return _check_reply(silo, reply.get(key), cls, what)


def server_setup(
    algorithm: UldpAvgW,
    identities: Mapping[int, bytes],
    setup: Callable[[dict[str, Any]], dict[int, Any]],
    ask: Ask,
) -> dict[int, dict[str, Any]]:
    """Runs the protocol's set-up with the silos and hands ``algorithm`` the server's party.

    ``identities``: each silo's identity key from its hello; ``setup`` sends the run's set-up
    with the protocol's public part added and returns each silo's reply (its key share);
    ``ask`` the later stages. Returns, per silo, what every later message must relay to it.
    """
    assert algorithm.protocol is not None
    planned = algorithm.protocol.config
    # the engines refuse scheme = "bfv" before any message: only Paillier's protocol runs here
    assert isinstance(planned, ProtocolConfig)
    registry = tuple(sorted((int(s), bytes(k)) for s, k in identities.items()))
    config = dataclasses.replace(planned, identity_keys=registry)
    server = Server(config)
    public = {"config": config, "hello": server.hello()}
    shares = setup(public)
    directory: KeyDirectory | None = None
    for s in config.silo_ids:
        directory = server.receive_key_share(
            _field(s, shares[s], "key_share", KeyShare, "server's hello")
        )
    assert directory is not None
    sealed = ask(DIRECTORY, {s: {"directory": directory} for s in config.silo_ids})
    seeds: dict[int, SealedSeed] = {}
    for s, reply in sealed.items():
        for message in _field(s, reply, "sealed", list, "key directory"):
            relayed = server.relay_seed(_check_reply(s, message, SealedSeed, "key directory"))
            seeds[relayed.recipient] = relayed
    relay = {s: {"directory": directory, "sealed": seeds.get(s)} for s in config.silo_ids}
    histograms = ask(SEED, relay)
    for s in config.silo_ids:
        server.receive_histogram(
            _field(s, histograms[s], "histogram", MaskedHistogram, "sealed seed")
        )
    algorithm.protocol = Parties(config, own_server=server)
    return relay


class _SetUpThenFresh:
    """Bytes derived from the silo's secret and the session while the set-up is (re)played,
    then the operating system's CSPRNG."""

    def __init__(self, key: bytes) -> None:
        self._prg = ChaCha20Prg(key)
        self.fresh = False

    def token_bytes(self, nbytes: int) -> bytes:
        return secrets.token_bytes(nbytes) if self.fresh else self._prg.token_bytes(nbytes)


def silo_party(
    secret: bytes,
    silo: int,
    subjects: np.ndarray,
    public: Mapping[str, Any],
    relay: Mapping[str, Any] | None = None,
) -> tuple[Silo, Any]:
    """Silo ``silo``'s party, rebuilt as far as the transcript goes, and its last reply:
    its key share (hello only), its sealed seeds (with the directory), or its masked
    histogram (with the seed too; the party is then ready for rounds, and draws fresh)."""
    config: ProtocolConfig = public["config"]
    ids, counts = np.unique(np.asarray(subjects), return_counts=True)
    histogram = {int(a): int(c) for a, c in zip(ids, counts, strict=True)}
    source = _SetUpThenFresh(
        derive_key(secret, b"silodp/engine/weighting", salt=public["hello"].session_id)
    )
    party = Silo(silo, config, histogram, source=source, identity=identity_key(secret))
    reply: Any = party.receive_hello(public["hello"])
    if relay is None:
        return party, reply
    reply = party.receive_directory(relay["directory"])
    if "sealed" not in relay:
        return party, reply
    if party.stage is SiloStage.AWAITING_SEED:
        if relay["sealed"] is None:
            raise ValueError(f"Silo {silo}: expected the leader's sealed seed.")
        party.receive_seed(relay["sealed"])
    reply = party.masked_histogram()
    source.fresh = True
    return party, reply
