"""The messages of the private weighting protocol, one frozen dataclass per stage.

Each message checks its own shape when built, before any party computes with it: exact types
(``int``, ``bytes``, tuples), byte lengths, non-negative ids, one entry per silo, and sizes —
a modulus of at most :data:`MAX_MODULUS_BITS` bits, residues below ``2^MAX_MODULUS_BITS`` and
ciphertexts below its square, at most :data:`MAX_ENTRIES` integers. The receiving party checks
what needs context (session, stage, sender, lengths, ranges mod ``n``).
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
    "MAX_DIM",
    "MAX_ENTRIES",
    "MAX_INDEX",
    "MAX_MODULUS_BITS",
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
#: the largest Paillier modulus a message may carry (16384 bits; silodp's default is 3072)
MAX_MODULUS_BITS = 16384
#: the most integers one message may carry (subjects, or packed ciphertexts)
MAX_ENTRIES = 2**24
#: the largest silo id, round index or parameter count a message may name
MAX_INDEX = 2**62
#: the most model parameters a round message may name
MAX_DIM = 2**31
#: an Ed25519 signature's length (empty without identity keys)
SIGNATURE_BYTES = 64
#: bounds on a sealed seed's ciphertext (a 32-byte seed and its 16-byte tag)
SEALED_BYTES = (16, 4096)
SiloId: TypeAlias = int
SubjectId: TypeAlias = Any  # any hashable id (int or str); Any keeps Mapping invariance usable


def _show(value: object, limit: int = 60) -> str:
    """``value`` as a message shows it: a short repr, never failing (a huge int's repr
    raises ``ValueError`` past 4300 digits)."""
    if type(value) is int and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit int>"
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_session(session_id: object) -> None:
    if type(session_id) is not bytes or len(session_id) != SESSION_ID_BYTES:
        raise MalformedMessageError(
            f"Expected a {SESSION_ID_BYTES}-byte session id, got {_show(session_id)}."
        )


def _check_id(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INDEX:
        raise MalformedMessageError(
            f"Expected {name}={_show(value)} to be a non-negative int (at most 2^62)."
        )


def _check_bytes(name: str, value: object, size: int | tuple[int, int] | None = None) -> None:
    ok = type(value) is bytes
    if ok and isinstance(size, int):
        ok = len(value) == size  # type: ignore[arg-type]
    elif ok and isinstance(size, tuple):
        ok = size[0] <= len(value) <= size[1]  # type: ignore[arg-type]
    if not ok:
        if isinstance(size, tuple):
            want = f"{size[0]} to {size[1]} bytes"
        else:
            want = f"{size} bytes" if size is not None else "bytes"
        got = f"{len(value)} bytes" if isinstance(value, bytes) else f"{_show(value)}"
        raise MalformedMessageError(f"Expected {name} to be {want}, got {got}.")


def _check_ints(name: str, values: object, bits: int) -> None:
    """A tuple of at most :data:`MAX_ENTRIES` ints in ``[0, 2^bits)``: residues mod ``n``
    (``bits`` = the largest modulus's) or ciphertexts mod ``n^2`` (twice that)."""
    if not isinstance(values, tuple):
        raise MalformedMessageError(f"Expected {name} as a tuple, got {type(values).__name__}.")
    if len(values) > MAX_ENTRIES:
        raise MalformedMessageError(f"Expected at most {MAX_ENTRIES} {name}, got {len(values)}.")
    for i, v in enumerate(values):
        if type(v) is not int:
            raise MalformedMessageError(f"Expected int {name}[{i}], got {type(v).__name__}.")
        if v < 0 or v.bit_length() > bits:
            size = "negative" if v < 0 else f"a {v.bit_length()}-bit int"
            raise MalformedMessageError(
                f"Expected {name}[{i}] to be an int in [0, 2^{bits}), got {size}."
            )


def _check_pairs(name: str, entries: object, size: int | tuple[int, int] | None) -> None:
    """``(silo, bytes)`` pairs, one per silo."""
    if not isinstance(entries, tuple):
        raise MalformedMessageError(f"Expected {name} as a tuple of (silo, bytes) pairs.")
    if len(entries) > MAX_ENTRIES:
        raise MalformedMessageError(f"Expected at most {MAX_ENTRIES} {name}, got {len(entries)}.")
    seen: set[int] = set()
    for entry in entries:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise MalformedMessageError(f"Expected a (silo, bytes) pair, got {_show(entry)}.")
        _check_id("silo", entry[0])
        _check_bytes(name.removesuffix("s"), entry[1], size)
        if entry[0] in seen:
            raise MalformedMessageError(
                f"Expected one {name} entry per silo; silo {entry[0]} has two."
            )
        seen.add(entry[0])


@dataclass(frozen=True)
class ServerHello:
    session_id: bytes
    paillier_n: int

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        n = self.paillier_n
        if type(n) is not int or n < 15 or n % 2 == 0 or n.bit_length() > MAX_MODULUS_BITS:
            got = f"a {n.bit_length()}-bit int" if type(n) is int else f"{_show(n)}"
            raise MalformedMessageError(
                f"Expected an odd Paillier modulus of at most {MAX_MODULUS_BITS} bits, got {got}."
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
        if self.signature != b"":
            _check_bytes("signature", self.signature, SIGNATURE_BYTES)


@dataclass(frozen=True)
class KeyDirectory:
    """Every silo's X25519 public key and, with identity keys, its signature."""

    session_id: bytes
    dh_publics: tuple[tuple[SiloId, bytes], ...]
    signatures: tuple[tuple[SiloId, bytes], ...] = ()

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_pairs("dh_publics", self.dh_publics, 32)
        _check_pairs("signatures", self.signatures, SIGNATURE_BYTES)

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
        _check_bytes("ciphertext", self.ciphertext, SEALED_BYTES)


@dataclass(frozen=True)
class MaskedHistogram:
    session_id: bytes
    sender: SiloId
    values: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_session(self.session_id)
        _check_id("sender", self.sender)
        _check_ints("values", self.values, MAX_MODULUS_BITS)


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
        if self.dim > MAX_DIM:
            raise MalformedMessageError(f"Expected dim <= {MAX_DIM}, got {self.dim}.")
        _check_ints("ciphertexts", self.ciphertexts, 2 * MAX_MODULUS_BITS)


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
        if self.dim > MAX_DIM:
            raise MalformedMessageError(f"Expected dim <= {MAX_DIM}, got {self.dim}.")
        if self.dim < 1:
            raise MalformedMessageError(f"Expected dim >= 1, got {self.dim}.")
        _check_ints("ciphertexts", self.ciphertexts, 2 * MAX_MODULUS_BITS)


Message = (
    ServerHello
    | KeyShare
    | KeyDirectory
    | SealedSeed
    | MaskedHistogram
    | EncryptedWeights
    | MaskedWeightedSum
)
