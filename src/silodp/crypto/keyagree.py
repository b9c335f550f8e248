"""Pairwise keys between silos: X25519 through the server, HKDF, and the sealed shared seed.

Every silo draws an X25519 key pair and sends its public key to the server, which broadcasts
the directory. Silos ``i < j`` both compute ``X25519(sk_i, pk_j) = X25519(sk_j, pk_i)`` and
expand it with HKDF-SHA256 (salt: the session id; info: both ids and both public keys in
canonical order) into two independent keys: one for AEAD (ChaCha20-Poly1305, sealing the
shared seed), one for the mask generator. The server relays public keys and sealed seeds but
never holds a private key, so it cannot learn the pairwise keys or the seed - against an
*honest-but-curious* server. (A server that substitutes public keys could man-in-the-middle;
:mod:`~silodp.crypto.identity` signs the public keys with registered Ed25519 identity keys.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from silodp.crypto.errors import KeyAgreementError, SeedAuthenticationError
from silodp.crypto.prg import KEY_BYTES, derive_key
from silodp.crypto.randomness import RandomSource

__all__ = [
    "DH_PUBLIC_BYTES",
    "NONCE_BYTES",
    "SEED_BYTES",
    "DHKeyPair",
    "PairwiseKeys",
    "derive_pairwise_keys",
    "generate_dh_keypair",
    "open_seed",
    "seal_seed",
]

DH_PUBLIC_BYTES = 32
NONCE_BYTES = 12
SEED_BYTES = 32
_LABEL = b"silodp/uldp-avg-w/pairwise/v1"


@dataclass(frozen=True, repr=False)
class DHKeyPair:
    private_key: X25519PrivateKey
    public_bytes: bytes

    def __repr__(self) -> str:
        return f"DHKeyPair(public={self.public_bytes.hex()[:16]}...)"


def generate_dh_keypair(source: RandomSource) -> DHKeyPair:
    """An X25519 key pair whose private scalar comes from ``source``."""
    private = X25519PrivateKey.from_private_bytes(source.token_bytes(32))
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return DHKeyPair(private, public)


@dataclass(frozen=True, repr=False)
class PairwiseKeys:
    """Keys shared by silos ``low < high`` only."""

    low: int
    high: int
    aead_key: bytes = field(repr=False)
    mask_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Expected low={self.low} < high={self.high}.")
        for name in ("aead_key", "mask_key"):
            if len(getattr(self, name)) != KEY_BYTES:
                raise ValueError(f"Expected a {KEY_BYTES}-byte {name}.")

    def __repr__(self) -> str:
        return f"PairwiseKeys({self.low}, {self.high})"


def check_dh_public(public: object, *, owner: int) -> bytes:
    if not isinstance(public, bytes) or len(public) != DH_PUBLIC_BYTES:
        raise KeyAgreementError(
            f"Silo {owner}: expected a {DH_PUBLIC_BYTES}-byte X25519 public key, got {public!r}."
        )
    return public


def derive_pairwise_keys(
    own_id: int,
    own: DHKeyPair,
    peer_id: int,
    peer_public: bytes,
    *,
    session_id: bytes,
) -> PairwiseKeys:
    """The keys silo ``own_id`` shares with ``peer_id`` (both sides get the same)."""
    if own_id == peer_id:
        raise ValueError(f"A silo cannot agree a key with itself (id {own_id}).")
    check_dh_public(peer_public, owner=peer_id)
    try:
        shared = own.private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:  # all-zero shared secret: low-order point
        raise KeyAgreementError(f"X25519 with silo {peer_id}'s public key failed ({err}).") from err
    low, high = sorted((own_id, peer_id))
    pk_low, pk_high = (
        (own.public_bytes, peer_public)
        if own_id == low
        else (
            peer_public,
            own.public_bytes,
        )
    )
    info = b"|".join([_LABEL, str(low).encode(), str(high).encode(), pk_low, pk_high])
    master = derive_key(shared, info, salt=session_id)
    return PairwiseKeys(
        low,
        high,
        aead_key=derive_key(master, b"aead", salt=session_id),
        mask_key=derive_key(master, b"masks", salt=session_id),
    )


def _aad(session_id: bytes, sender: int, recipient: int) -> bytes:
    return b"|".join([b"silodp/seed/v1", session_id, str(sender).encode(), str(recipient).encode()])


def seal_seed(
    keys: PairwiseKeys,
    seed: bytes,
    *,
    session_id: bytes,
    sender: int,
    recipient: int,
    source: RandomSource,
) -> tuple[bytes, bytes]:
    """``(nonce, ciphertext)`` of ``seed`` under the pair's AEAD key, bound to the route."""
    if {sender, recipient} != {keys.low, keys.high}:
        raise ValueError(f"Keys of pair {keys.low, keys.high} cannot seal {sender}->{recipient}.")
    if len(seed) != SEED_BYTES:
        raise ValueError(f"Expected a {SEED_BYTES}-byte seed, got {len(seed)} bytes.")
    nonce = source.token_bytes(NONCE_BYTES)
    ciphertext = ChaCha20Poly1305(keys.aead_key).encrypt(
        nonce, seed, _aad(session_id, sender, recipient)
    )
    return nonce, ciphertext


def open_seed(
    keys: PairwiseKeys,
    nonce: bytes,
    ciphertext: bytes,
    *,
    session_id: bytes,
    sender: int,
    recipient: int,
) -> bytes:
    """The seed, or :class:`SeedAuthenticationError` if the tag does not verify."""
    try:
        seed = ChaCha20Poly1305(keys.aead_key).decrypt(
            nonce, ciphertext, _aad(session_id, sender, recipient)
        )
    except (InvalidTag, ValueError) as err:
        raise SeedAuthenticationError(
            f"Sealed seed from silo {sender} to silo {recipient} failed authentication."
        ) from err
    if len(seed) != SEED_BYTES:
        raise SeedAuthenticationError(f"Seed from silo {sender} has {len(seed)} bytes.")
    return seed
