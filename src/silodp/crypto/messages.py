"""The messages of the private weighting protocol, one frozen dataclass per stage.

Each message checks its own shape when built (types, byte lengths, non-negative ids); the
receiving party checks what needs context (session, stage, sender, lengths, ranges mod ``n``).
Both raise :class:`~silodp.crypto.errors.MalformedMessageError`. Integers travel as Python
``int`` (ciphertexts mod ``n^2``, masked values mod ``n``).

Set-up: ``ServerHello`` (server -> all: session id, Paillier modulus) -> ``KeyShare``
(silo -> server: X25519 public key) -> ``KeyDirectory`` (server -> all) -> ``SealedSeed``
(lowest silo -> each other silo, relayed by the server) -> ``MaskedHistogram`` (silo -> server:
``r_a n_{s,a}`` plus pairwise masks). Each round: ``EncryptedWeights`` (server -> all) ->
``MaskedWeightedSum`` (silo -> server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from silodp.crypto.errors import MalformedMessageError

__all__ = [
    "SESSION_ID_BYTES",
    "EncryptedWeights",
    "KeyDirectory",
    "KeyShare",
    "MaskedHistogram",
    "MaskedWeightedSum",
    "Message",
    "SealedSeed",
    "ServerHello",
    "SiloId",
    "SubjectId",
]

SESSION_ID_BYTES = 16
SiloId: TypeAlias = int
SubjectId: TypeAlias = Any  # any hashable id (int or str); Any keeps Mapping invariance usable


def _check_session(session_id: object) -> None:
    if not isinstance(session_id, bytes) or len(session_id) != SESSION_ID_BYTES:
        raise MalformedMessageError(
            f"Expected a {SESSION_ID_BYTES}-byte session id, got {session_id!r}."
        )


def _check_id(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedMessageError(f"Expected {name}={value!r} to be a non-negative int.")


def _check_bytes(name: str, value: object, size: int | None = None) -> None:
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        want = f"{size} bytes" if size is not None else "bytes"
        raise MalformedMessageError(f"Expected {name} to be {want}, got {value!r:.60}.")


def _check_ints(name: str, values: object) -> None:
    if not isinstance(values, tuple):
        raise MalformedMessageError(f"Expected {name} as a tuple, got {type(values).__name__}.")
    for i, v in enumerate(values):
        if type(v) is not int:
            raise MalformedMessageError(f"Expected int {name}[{i}], got {type(v).__name__}.")


@dataclass(frozen=True)
class ServerHello:
    session_id: bytes
    paillier_n: int

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        if type(self.paillier_n) is not int or self.paillier_n < 15 or self.paillier_n % 2 == 0:
            raise MalformedMessageError(
                f"Expected an odd Paillier modulus, got {self.paillier_n!r}."
            )


@dataclass(frozen=True)
class KeyShare:
    """``signature``: Ed25519 signature of the key share (empty without identity keys)."""

    session_id: bytes
    sender: SiloId
    dh_public: bytes
    signature: bytes = b""

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("sender", self.sender)
        _check_bytes("dh_public", self.dh_public, 32)
        _check_bytes("signature", self.signature)


@dataclass(frozen=True)
class KeyDirectory:
    """Every silo's X25519 public key and, with identity keys, its signature."""

    session_id: bytes
    dh_publics: tuple[tuple[SiloId, bytes], ...]
    signatures: tuple[tuple[SiloId, bytes], ...] = ()

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        if not isinstance(self.dh_publics, tuple):
            raise MalformedMessageError("Expected dh_publics as a tuple of (silo, key) pairs.")
        for entry in self.dh_publics:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise MalformedMessageError(f"Expected a (silo, key) pair, got {entry!r:.60}.")
            _check_id("silo", entry[0])
            _check_bytes("dh_public", entry[1], 32)
        if not isinstance(self.signatures, tuple):
            raise MalformedMessageError("Expected signatures as a tuple of (silo, bytes) pairs.")
        for entry in self.signatures:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise MalformedMessageError(f"Expected a (silo, sig) pair, got {entry!r:.60}.")
            _check_id("silo", entry[0])
            _check_bytes("signature", entry[1])

    def as_dict(self) -> dict[SiloId, bytes]:
        return dict(self.dh_publics)


@dataclass(frozen=True)
class SealedSeed:
    session_id: bytes
    sender: SiloId
    recipient: SiloId
    nonce: bytes
    ciphertext: bytes

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("sender", self.sender)
        _check_id("recipient", self.recipient)
        _check_bytes("nonce", self.nonce, 12)
        _check_bytes("ciphertext", self.ciphertext)


@dataclass(frozen=True)
class MaskedHistogram:
    session_id: bytes
    sender: SiloId
    values: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("sender", self.sender)
        _check_ints("values", self.values)


@dataclass(frozen=True)
class EncryptedWeights:
    """``dim``: the number of model parameters, or 0 when the server leaves it to the silos
    (who must then all send the same)."""

    session_id: bytes
    round_index: int
    dim: int
    ciphertexts: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("round_index", self.round_index)
        _check_id("dim", self.dim)
        _check_ints("ciphertexts", self.ciphertexts)


@dataclass(frozen=True)
class MaskedWeightedSum:
    """``dim`` parameters packed into ``ceil(dim / K)`` ciphertexts (``K`` from
    :func:`~silodp.crypto.weighted_sum.choose_slots`)."""

    session_id: bytes
    sender: SiloId
    round_index: int
    dim: int
    ciphertexts: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("sender", self.sender)
        _check_id("round_index", self.round_index)
        _check_id("dim", self.dim)
        if self.dim < 1:
            raise MalformedMessageError(f"Expected dim >= 1, got {self.dim}.")
        _check_ints("ciphertexts", self.ciphertexts)


Message = (
    ServerHello
    | KeyShare
    | KeyDirectory
    | SealedSeed
    | MaskedHistogram
    | EncryptedWeights
    | MaskedWeightedSum
)
