"""Secure aggregation of integer vectors by pairwise masks: the server learns only the sum.

Every silo draws an X25519 key pair; the server relays the public keys (a directory) and the
silos derive pairwise keys (:mod:`~silodp.crypto.keyagree`). In round ``r`` silo ``i`` sends
``x_i + Σ_{j>i} m_ij(r) - Σ_{j<i} m_ji(r) (mod 2^64)``, where ``m_ij(r)`` is a ChaCha20 stream
keyed by the pair's mask key and the round: the masks cancel in the sum over all silos, and
any proper subset of messages is uniformly distributed to the server. The leader (the lowest
silo id) also seals a fresh seed to every other silo, from which all silos derive the same
:class:`~silodp.crypto.sampling.SharedSampleKey` without the server learning it.

Security: against an honest-but-curious server (which relays keys faithfully) and silos that
do not collude with it. Every silo must answer in every round: there is no dropout recovery,
so a round with a silo missing is aborted as a whole (its masks would not cancel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from silodp.crypto.errors import MalformedMessageError
from silodp.crypto.keyagree import (
    SEED_BYTES,
    PairwiseKeys,
    derive_pairwise_keys,
    generate_dh_keypair,
    open_seed,
    seal_seed,
)
from silodp.crypto.prg import ChaCha20Prg, derive_key
from silodp.crypto.randomness import RandomSource, SystemRandomSource
from silodp.crypto.sampling import SharedSampleKey

__all__ = ["MaskedSumParty", "unmask_sum"]

_SAMPLE_LABEL = b"silodp/masked-sum/subject-sample"


def _mask(keys: PairwiseKeys, session_id: bytes, round_index: int, size: int) -> np.ndarray:
    key = derive_key(keys.mask_key, b"round|%d" % round_index, salt=session_id)
    stream = ChaCha20Prg(key).token_bytes(8 * size)
    return np.frombuffer(stream, dtype="<u8").astype(np.uint64)


class MaskedSumParty:
    """One silo's side: its key pair, its pairwise keys, the shared seed, the masking."""

    def __init__(
        self,
        silo_id: int,
        silo_ids: Sequence[int],
        session_id: bytes,
        *,
        source: RandomSource | None = None,
    ) -> None:
        if silo_id not in silo_ids or len(set(silo_ids)) != len(silo_ids):
            raise ValueError(f"Expected silo {silo_id} among distinct silos {list(silo_ids)}.")
        self.silo_id = silo_id
        self.silo_ids = tuple(sorted(silo_ids))
        self.session_id = bytes(session_id)
        self._rng = source if source is not None else SystemRandomSource()
        self._dh = generate_dh_keypair(self._rng)
        self._pairs: dict[int, PairwiseKeys] = {}
        self._seed: bytes | None = None
        #: the directory received and what this silo answered (a relayed copy gets the same)
        self._answered: tuple[dict[int, bytes], dict[int, tuple[bytes, bytes]]] | None = None

    def __repr__(self) -> str:
        return f"MaskedSumParty(silo={self.silo_id}, <secret>)"

    @property
    def public_key(self) -> bytes:
        """What the server relays to the other silos."""
        return self._dh.public_bytes

    @property
    def leader(self) -> int:
        return self.silo_ids[0]

    def receive_directory(self, directory: Mapping[int, bytes]) -> dict[int, tuple[bytes, bytes]]:
        """Derives the pairwise keys from every silo's public key; the leader returns the seed
        sealed to each other silo (``{recipient: (nonce, ciphertext)}``), others nothing.

        The same directory received again (a message relayed twice, or a process that
        handles several of a session's messages) gets the same answer: the leader's seed is
        drawn once per party, so every silo derives the same sample key.

        Raises:
          MalformedMessageError: a directory that lists other silos or alters this silo's key,
            or one that differs from the directory this party has already received.
        """
        if self._answered is not None:
            received, answer = self._answered
            if dict(directory) != received:
                raise MalformedMessageError(
                    f"Silo {self.silo_id}: a second key directory differs from the first."
                )
            return dict(answer)
        if sorted(directory) != list(self.silo_ids):
            raise MalformedMessageError(
                f"Silo {self.silo_id}: key directory lists silos {sorted(directory)}, expected "
                f"{list(self.silo_ids)}."
            )
        if directory[self.silo_id] != self._dh.public_bytes:
            raise MalformedMessageError(f"Silo {self.silo_id}: directory altered its own key.")
        self._pairs = {
            peer: derive_pairwise_keys(
                self.silo_id, self._dh, peer, public, session_id=self.session_id
            )
            for peer, public in directory.items()
            if peer != self.silo_id
        }
        sealed: dict[int, tuple[bytes, bytes]] = {}
        if self.silo_id == self.leader:
            self._seed = self._rng.token_bytes(SEED_BYTES)
            sealed = {
                peer: seal_seed(
                    keys,
                    self._seed,
                    session_id=self.session_id,
                    sender=self.silo_id,
                    recipient=peer,
                    source=self._rng,
                )
                for peer, keys in sorted(self._pairs.items())
            }
        self._answered = (dict(directory), sealed)
        return dict(sealed)

    def receive_seed(self, nonce: bytes, ciphertext: bytes) -> None:
        """Opens the leader's sealed seed (``SeedAuthenticationError`` if altered)."""
        if self.silo_id == self.leader:
            raise MalformedMessageError(f"Silo {self.silo_id} is the leader; it sent the seed.")
        self._seed = open_seed(
            self._pairs[self.leader],
            nonce,
            ciphertext,
            session_id=self.session_id,
            sender=self.leader,
            recipient=self.silo_id,
        )

    @property
    def sample_key(self) -> SharedSampleKey:
        """The key every silo derives from the shared seed (the server never holds it)."""
        if self._seed is None:
            raise MalformedMessageError(f"Silo {self.silo_id} has no shared seed yet.")
        return SharedSampleKey(derive_key(self._seed, _SAMPLE_LABEL, salt=self.session_id))

    def mask(self, values: np.ndarray, round_index: int) -> np.ndarray:
        """``values`` (int64) plus this silo's pairwise masks of round ``round_index``, as
        uint64 modulo 2^64."""
        if len(self._pairs) != len(self.silo_ids) - 1:
            raise MalformedMessageError(f"Silo {self.silo_id} has no pairwise keys yet.")
        ints = np.asarray(values)
        if ints.dtype != np.int64 or ints.ndim != 1:
            raise ValueError(f"Expected a flat int64 vector, got {ints.dtype} {ints.shape}.")
        out = ints.view(np.uint64).copy()
        for peer, keys in self._pairs.items():
            m = _mask(keys, self.session_id, round_index, out.size)
            if self.silo_id < peer:
                out += m
            else:
                out -= m
        return out


def unmask_sum(messages: Sequence[np.ndarray]) -> np.ndarray:
    """The sum (int64, two's complement modulo 2^64) of every silo's masked message.

    Raises:
      MalformedMessageError: messages of different lengths or not uint64.
    """
    if not messages:
        raise MalformedMessageError("Expected at least one masked message.")
    size = messages[0].shape
    total = np.zeros(size, dtype=np.uint64)
    for i, m in enumerate(messages):
        if m.dtype != np.uint64 or m.shape != size:
            raise MalformedMessageError(
                f"Expected masked message {i} as uint64 of shape {size}, got {m.dtype} {m.shape}."
            )
        total += m
    return total.view(np.int64)
