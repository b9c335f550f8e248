"""Injected randomness: every key, blind, mask and sample is drawn from a :class:`RandomSource`.

The default source is the operating system's CSPRNG (:mod:`secrets`). Tests inject a seeded
:class:`~silodp.crypto.prg.ChaCha20Prg` (also a ``RandomSource``) for reproducible runs. The
helpers below turn bytes into integers without bias: :func:`randbelow` uses rejection
sampling, never ``x % n`` on a short draw.
"""

from __future__ import annotations

import math
import secrets
from typing import Protocol, runtime_checkable

__all__ = [
    "RandomSource",
    "SystemRandomSource",
    "bernoulli",
    "randbelow",
    "randbits",
    "random_unit",
]


@runtime_checkable
class RandomSource(Protocol):
    """Anything that yields uniformly random bytes."""

    def token_bytes(self, nbytes: int) -> bytes:  # pragma: no cover - protocol
        ...


class SystemRandomSource:
    """The OS CSPRNG (``secrets.token_bytes``)."""

    def token_bytes(self, nbytes: int) -> bytes:
        return secrets.token_bytes(nbytes)

    def __repr__(self) -> str:
        return "SystemRandomSource()"


def randbits(source: RandomSource, k: int) -> int:
    """A uniform integer in ``[0, 2**k)``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"Expected k={k!r} to be a non-negative int.")
    if k == 0:
        return 0
    nbytes = (k + 7) // 8
    value = int.from_bytes(source.token_bytes(nbytes), "big")
    return value >> (8 * nbytes - k)


def randbelow(source: RandomSource, n: int) -> int:
    """A uniform integer in ``[0, n)`` by rejection sampling (expected < 2 draws)."""
    n = int(n)
    if n <= 0:
        raise ValueError(f"Expected n={n!r} > 0.")
    k = n.bit_length()
    while True:
        value = randbits(source, k)
        if value < n:
            return value


def random_unit(source: RandomSource, n: int) -> int:
    """A uniform element of the multiplicative group ``Z_n^*`` (rejection sampling)."""
    n = int(n)
    if n < 2:
        raise ValueError(f"Expected modulus n={n!r} >= 2.")
    while True:
        value = randbelow(source, n)
        if value != 0 and math.gcd(value, n) == 1:
            return value


def bernoulli(source: RandomSource, p: float) -> bool:
    """``True`` with probability ``p`` (53-bit resolution)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"Expected probability p={p!r} in [0, 1].")
    return randbits(source, 53) < p * (1 << 53)
