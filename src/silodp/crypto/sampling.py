"""Poisson subject sampling from a key the silos share and the server never sees.

Amplification by sub-sampling protects a subject only against parties that do not know the
sample (SPEC §2). When the silos draw it, each silo computes the same sample from a shared
32-byte key and the public round index, so no message has to carry it: the server's view is
independent of the sample, and the silos (who know it) are accounted without amplification.

Round ``t``: the key is expanded with HKDF-SHA256 under the label
``silodp/uldp/subject-sample|round|t`` into a ChaCha20 key; its keystream gives one 64-bit word
``u_a`` per public subject (in the public order), the first 64 bits of a uniform ``U_a`` on
``[0, 1)``, and subject ``a`` is sampled iff ``U_a < q``. The word decides unless
``u_a = floor(q 2^64)`` (probability ``2^-64``, and never when ``q 2^64`` is an integer); then
further words of ``U_a`` are read, in subject order, from a second keystream of the round
(label suffix ``|ties``) until the comparison is decided. So each subject is in the sample
independently with probability exactly ``q`` (the float's binary value), as a pseudorandom
function of the key (ChaCha20, HKDF), and every holder of the key computes the same sample.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from silodp.crypto.prg import KEY_BYTES, ChaCha20Prg, derive_key
from silodp.crypto.randomness import RandomSource

__all__ = ["SAMPLE_LABEL", "SharedSampleKey"]

SAMPLE_LABEL = b"silodp/uldp/subject-sample"
_WORD_BITS = 64


def _check_rate(rate: float) -> Fraction:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"Expected rate={rate!r} in [0, 1].")
    return Fraction(rate)


def _below(prefix: int, source: ChaCha20Prg, rate: Fraction) -> bool:
    """Whether ``U < rate`` for the uniform ``U`` whose first 64 bits are ``prefix``, reading
    further 64-bit words from ``source`` until the comparison is decided."""
    bits = _WORD_BITS
    while True:
        scaled = rate * (1 << bits)
        if prefix + 1 <= scaled:
            return True
        if prefix >= scaled:
            return False
        prefix = (prefix << _WORD_BITS) | int.from_bytes(source.token_bytes(8), "little")
        bits += _WORD_BITS


class SharedSampleKey:
    """A silo-side secret from which every silo derives the same per-round subject sample.

    Never part of a message: the server step must not hold it. ``repr`` does not show it.
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
            size = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
            raise ValueError(f"Expected a {KEY_BYTES}-byte sample key, got {size!r}.")
        self._key = bytes(key)

    @classmethod
    def generate(cls, source: RandomSource) -> SharedSampleKey:
        """A fresh key from ``source`` (e.g. the OS CSPRNG, or a silo's random source)."""
        return cls(source.token_bytes(KEY_BYTES))

    def sample(self, round_index: int, num_subjects: int, rate: float) -> np.ndarray:
        """Round ``round_index``'s Poisson sample of ``num_subjects`` public subjects at
        ``rate``: a bool array, the same for every holder of the key."""
        if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
            raise ValueError(f"Expected round_index={round_index!r} to be an int >= 0.")
        if isinstance(num_subjects, bool) or not isinstance(num_subjects, int) or num_subjects < 0:
            raise ValueError(f"Expected num_subjects={num_subjects!r} to be an int >= 0.")
        exact = _check_rate(rate)
        if exact == 1:
            return np.ones(num_subjects, dtype=bool)
        info = SAMPLE_LABEL + b"|round|%d" % round_index
        prg = ChaCha20Prg(derive_key(self._key, info))
        words = np.frombuffer(prg.token_bytes(8 * num_subjects), dtype="<u8")
        cut = math.floor(exact * (1 << _WORD_BITS))  # < 2^64
        out = np.asarray(words < np.uint64(cut))
        ties = np.flatnonzero(words == np.uint64(cut))
        if ties.size and exact * (1 << _WORD_BITS) != cut:
            extra = ChaCha20Prg(derive_key(self._key, info + b"|ties"))
            for i in ties.tolist():
                out[i] = _below(cut, extra, exact)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharedSampleKey) and other._key == self._key

    def __hash__(self) -> int:
        return hash((SharedSampleKey, self._key))

    def __repr__(self) -> str:  # never print the key
        return "SharedSampleKey(<secret>)"
