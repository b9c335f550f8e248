"""What every party of the weighting protocol shares: the public :class:`ProtocolConfig`
(ids, bounds, key size, packing, registered identity keys) and the stage check the
:class:`~silodp.crypto.protocol.server.Server` and the
:class:`~silodp.crypto.protocol.silo.Silo` run on every message."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from silodp.crypto.encoding import MAX_N_MAX, WeightingEncoding, check_bound
from silodp.crypto.errors import InsecureKeyError, StageError
from silodp.crypto.identity import IDENTITY_PUBLIC_BYTES
from silodp.crypto.messages import SiloId, SubjectId
from silodp.crypto.paillier import DEFAULT_KEY_BITS, MIN_KEY_BITS, PaillierPublicKey, check_key_bits
from silodp.crypto.weighted_sum import choose_slots, resolve_workers

__all__ = ["ProtocolConfig"]


@dataclass(frozen=True)
class ProtocolConfig:
    """Public parameters every party agrees on before the protocol starts.

    ``delta_bound`` bounds each coordinate of a clipped delta (the clip norm ``C`` does);
    ``noise_bound`` each coordinate of a silo's noise; both are enforced when encoding.
    ``workers``: processes for the per-parameter loops (``None``: all CPUs for large models).
    """

    silo_ids: tuple[SiloId, ...]
    subject_ids: tuple[SubjectId, ...]
    n_max: int
    delta_bound: float = 1.0
    noise_bound: float = 1e6
    precision: float = 1e-10
    key_bits: int = DEFAULT_KEY_BITS
    insecure_test_key_bits: int | None = None
    workers: int | None = None
    packing: bool = True
    identity_keys: tuple[tuple[SiloId, bytes], ...] | None = None

    def __post_init__(self) -> None:
        silos = self.silo_ids
        if not isinstance(silos, tuple) or len(silos) < 2:
            raise ValueError(f"Expected silo_ids as a tuple of >= 2 ids, got {silos!r}.")
        for s in silos:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"Expected non-negative int silo ids, got {s!r}.")
        if len(set(silos)) != len(silos) or list(silos) != sorted(silos):
            raise ValueError(f"Expected distinct silo ids in increasing order, got {silos!r}.")
        subjects = self.subject_ids
        if not isinstance(subjects, tuple) or not subjects:
            raise ValueError(f"Expected subject_ids as a non-empty tuple, got {subjects!r:.80}.")
        if len(set(subjects)) != len(subjects):
            raise ValueError("Expected distinct subject ids.")
        n = self.n_max
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N_MAX:
            raise ValueError(f"Expected n_max={n!r} to be an int in [1, {MAX_N_MAX}].")
        for name in ("delta_bound", "noise_bound"):
            check_bound(name, getattr(self, name))
        check_key_bits(self.key_bits, insecure_test_key_bits=self.insecure_test_key_bits)
        if self.workers is not None:
            resolve_workers(self.workers, 0)
        if self.identity_keys is not None:
            ids = self.identity_keys
            if not isinstance(ids, tuple) or sorted(s for s, _ in ids) != list(silos):
                raise ValueError(
                    f"Expected identity_keys as (silo, key) pairs for silos {list(silos)}."
                )
            for s, key in ids:
                if not isinstance(key, bytes) or len(key) != IDENTITY_PUBLIC_BYTES:
                    raise ValueError(
                        f"Expected a {IDENTITY_PUBLIC_BYTES}-byte Ed25519 key for silo {s}."
                    )

    def identity_of(self, silo: SiloId) -> bytes | None:
        """Silo ``silo``'s registered Ed25519 public key (``None``: keys not authenticated)."""
        return None if self.identity_keys is None else dict(self.identity_keys)[silo]

    @property
    def modulus_bits(self) -> int:
        return check_key_bits(self.key_bits, insecure_test_key_bits=self.insecure_test_key_bits)

    @property
    def leader(self) -> SiloId:
        """The silo that draws the shared seed."""
        return self.silo_ids[0]

    def encoding(self, modulus: int) -> WeightingEncoding:
        """The fixed-point encoding for ``modulus`` (raises if it could overflow)."""
        return WeightingEncoding(
            modulus=modulus,
            n_max=self.n_max,
            num_subjects=len(self.subject_ids),
            num_silos=len(self.silo_ids),
            delta_bound=self.delta_bound,
            noise_bound=self.noise_bound,
            precision=self.precision,
            packing=self.packing,
        )

    def slots_for(self, encoding: WeightingEncoding, dim: int) -> int:
        """Coordinates per ciphertext for a ``dim``-parameter round (public: every party
        derives the same value)."""
        if not self.packing:
            return 1
        pairs = len(self.subject_ids) * len(self.silo_ids)
        return choose_slots(
            encoding, dim, pairs, key_bits=encoding.modulus.bit_length(), silos=len(self.silo_ids)
        )

    def check_public_key(self, public_key: PaillierPublicKey) -> None:
        """Refuses a modulus smaller than configured (never below 2048 bits unless the config
        explicitly asks for an insecure test key)."""
        want = self.modulus_bits
        if self.insecure_test_key_bits is None:
            want = max(want, MIN_KEY_BITS)
        if public_key.bits < want:
            raise InsecureKeyError(
                f"Refusing a {public_key.bits}-bit Paillier modulus: this configuration "
                f"requires at least {want} bits."
            )


def _expect_stage(party: str, stage: enum.Enum, *allowed: enum.Enum, what: str) -> None:
    if stage not in allowed:
        raise StageError(f"{party}: {what} is not expected at stage '{stage.value}'.")
