"""A deterministic generator keyed by an agreed secret: ChaCha20 keystream as random bytes.

Two uses:

* :class:`ChaCha20Prg` - a sequential :class:`~silodp.crypto.randomness.RandomSource`. Silos
  that share a seed derive identical multiplicative blinds ``r_a`` from it (rejection sampling
  of units mod ``n``, see :func:`~silodp.crypto.randomness.random_unit`).
* :class:`MaskStream` - a *seekable* stream of integers mod ``n``: value ``i`` depends only on
  the key and ``i`` (not on how the stream is split into chunks), so worker processes can
  each produce the pairwise masks of their own parameter range. A value is the
  ``|n| + 128``-bit keystream block ``i`` reduced mod ``n`` (statistical distance from uniform
  below ``2**-128``; rejection sampling would make positions data-dependent). Silo ``i`` adds
  ``+mask`` and silo ``j`` adds ``-mask`` for their pair key, so masks cancel in the sum.

Keys are 32 bytes, derived with HKDF-SHA256 under distinct ``info`` labels (domain
separation: histogram masks, round-``t`` masks and blinds never share a keystream).
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KEY_BYTES", "ChaCha20Prg", "MaskStream", "derive_key"]

KEY_BYTES = 32
_BLOCK = 64
_MAX_BLOCKS = 1 << 32  # the 32-bit block counter of the 16-byte nonce
_STATISTICAL_BITS = 128


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ValueError(f"Expected a {KEY_BYTES}-byte key, got {size!r}.")
    return bytes(key)


def derive_key(secret: bytes, info: bytes, *, salt: bytes | None = None) -> bytes:
    """HKDF-SHA256 of ``secret`` to a 32-byte key, bound to ``info`` (and ``salt``)."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
        raise ValueError("Expected a secret of at least 16 bytes to derive a key from.")
    if not isinstance(info, bytes):
        raise ValueError(f"Expected info to be bytes, got {type(info).__name__}.")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info)
    return hkdf.derive(bytes(secret))


def _keystream(key: bytes, nonce: bytes, first_block: int, nbytes: int) -> bytes:
    last = first_block + (nbytes + _BLOCK - 1) // _BLOCK
    if first_block < 0 or last > _MAX_BLOCKS:
        raise ValueError(f"Keystream position {first_block} + {nbytes} bytes exceeds 2**32 blocks.")
    full_nonce = first_block.to_bytes(4, "little") + nonce
    encryptor = Cipher(algorithms.ChaCha20(key, full_nonce), mode=None).encryptor()
    return encryptor.update(bytes(nbytes))


class ChaCha20Prg:
    """Sequential ChaCha20 keystream; a ``RandomSource`` determined by ``key`` (and ``nonce``)."""

    def __init__(self, key: bytes, nonce: bytes = bytes(12)) -> None:
        self._key = _check_key(key)
        if not isinstance(nonce, bytes) or len(nonce) != 12:
            raise ValueError(f"Expected a 12-byte nonce, got {nonce!r}.")
        self._encryptor = Cipher(
            algorithms.ChaCha20(self._key, bytes(4) + nonce), mode=None
        ).encryptor()
        self._used = 0

    def token_bytes(self, nbytes: int) -> bytes:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"Expected nbytes={nbytes!r} to be a non-negative int.")
        self._used += nbytes
        if self._used > _MAX_BLOCKS * _BLOCK:
            raise ValueError("ChaCha20Prg exhausted (2**38 bytes); derive a fresh key.")
        return self._encryptor.update(bytes(nbytes))

    def __repr__(self) -> str:  # never print the key
        return f"ChaCha20Prg(used={self._used} bytes)"


@dataclass(frozen=True, repr=False)
class MaskStream:
    """Seekable uniform integers mod ``modulus``: ``value(i)`` is fixed by ``(key, i)``."""

    key: bytes
    modulus: int

    def __post_init__(self) -> None:
        _check_key(self.key)
        if isinstance(self.modulus, bool) or int(self.modulus) < 2:
            raise ValueError(f"Expected modulus={self.modulus!r} >= 2.")
        object.__setattr__(self, "modulus", int(self.modulus))

    @property
    def width(self) -> int:
        """Bytes of keystream per value."""
        return (self.modulus.bit_length() + _STATISTICAL_BITS + 7) // 8

    def values(self, start: int, stop: int) -> list[int]:
        """Values ``start .. stop-1``."""
        if not 0 <= start <= stop:
            raise ValueError(f"Expected 0 <= start={start} <= stop={stop}.")
        width = self.width
        offset = start * width
        skip = offset % _BLOCK
        stream = _keystream(self.key, bytes(12), offset // _BLOCK, skip + (stop - start) * width)
        n = self.modulus
        return [
            int.from_bytes(stream[skip + k * width : skip + (k + 1) * width], "big") % n
            for k in range(stop - start)
        ]

    def value(self, index: int) -> int:
        return self.values(index, index + 1)[0]

    def __repr__(self) -> str:
        return f"MaskStream(modulus_bits={self.modulus.bit_length()})"
