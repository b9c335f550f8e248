"""Authenticated key shares: Ed25519 identity keys sign each silo's X25519 public key.

Without authentication the server relays the silos' Diffie-Hellman public keys and could
substitute its own (man in the middle), then open the sealed seed and unmask histograms. With
identity keys registered out of band (``ProtocolConfig.identity_keys``: each silo's Ed25519
public key, exchanged before the federation starts, e.g. in its membership agreement), every
silo signs ``label | session id | silo id | X25519 public key`` and every other silo checks the
signature against the registered key before deriving a pairwise key; a substituted, replayed
(other session) or re-attributed key is refused with
:class:`~silodp.crypto.errors.KeyAuthenticationError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from silodp.crypto.errors import KeyAuthenticationError
from silodp.crypto.randomness import RandomSource

__all__ = [
    "IDENTITY_PUBLIC_BYTES",
    "SIGNATURE_BYTES",
    "IdentityKey",
    "generate_identity",
    "key_share_transcript",
    "verify_key_share",
]

IDENTITY_PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
_LABEL = b"silodp/uldp-avg-w/key-share/v1"


def key_share_transcript(session_id: bytes, silo_id: int, dh_public: bytes) -> bytes:
    """The bytes a silo signs for its key share (bound to the session and its id)."""
    return b"|".join([_LABEL, session_id, str(silo_id).encode(), dh_public])


@dataclass(frozen=True, repr=False)
class IdentityKey:
    """A silo's long-term Ed25519 signing key (its public half is registered out of band)."""

    private_key: Ed25519PrivateKey
    public_bytes: bytes

    def sign_key_share(self, session_id: bytes, silo_id: int, dh_public: bytes) -> bytes:
        return self.private_key.sign(key_share_transcript(session_id, silo_id, dh_public))

    def __repr__(self) -> str:
        return f"IdentityKey(public={self.public_bytes.hex()[:16]}...)"


def generate_identity(source: RandomSource) -> IdentityKey:
    """An Ed25519 identity key whose seed comes from ``source``."""
    private = Ed25519PrivateKey.from_private_bytes(source.token_bytes(32))
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return IdentityKey(private, public)


def verify_key_share(
    identity_public: bytes, signature: bytes, session_id: bytes, silo_id: int, dh_public: bytes
) -> None:
    """Raises :class:`KeyAuthenticationError` unless ``signature`` is silo ``silo_id``'s
    signature of its key share ``dh_public`` in this session."""
    try:
        key = Ed25519PublicKey.from_public_bytes(identity_public)
        key.verify(signature, key_share_transcript(session_id, silo_id, dh_public))
    except (InvalidSignature, ValueError) as err:
        raise KeyAuthenticationError(
            f"Key share of silo {silo_id} is not signed by its registered identity key: "
            "refusing it (substituted, replayed or corrupted)."
        ) from err
