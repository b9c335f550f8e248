"""Where every privacy-relevant random choice comes from: :class:`Coins`.

Batch sampling, subject and silo sampling, shuffles and Gaussian noise all draw from a
:class:`Coins` object, never from a global or config-seeded generator directly. Two modes:

* ``secure`` (the default of ``silodp run``): every draw comes from an AES-256-CTR keystream
  under a fresh 256-bit key and 64-bit nonce read from the operating system's CSPRNG
  (``os.urandom``) when the ``Coins`` is made (and again after 2^36 bytes, or in a forked
  child process) — the CTR_DRBG construction of NIST SP 800-90A, at several GB/s with AES-NI
  instead of ~0.3 GB/s for ``os.urandom`` itself. Nobody, including whoever wrote the config, can
  recompute a sample or subtract the noise. Runs are not reproducible.
* ``seeded``: draws come from numpy's PCG64 stream keyed by a ``SeedSequence`` of the run seed
  and the stream's position (round, stream, silo). Bit-for-bit reproducible, for tests and
  experiments only: anyone who knows the seed can recompute every coin and the noise, so a
  seeded run's ε is *not* a guarantee against anyone who knows the config.

Independent streams are derived with :meth:`Coins.spawn` (seeded: a child ``SeedSequence``;
secure: a fresh key), so results never depend on the order parties run in.

Derived draws are exact: :meth:`Coins.bernoulli` is true with probability exactly ``rate`` (the
float's binary value, compared bit by bit against lazily extended uniform bits) and
:meth:`Coins.permutation` is exactly uniform (random keys, redrawn on the rare tie).
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Literal

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from silodp._validation import check_choice, check_int, check_probability

__all__ = ["MODES", "Coins", "NoiseMode"]

NoiseMode = Literal["secure", "seeded"]
MODES: tuple[str, ...] = ("secure", "seeded")

#: Bytes drawn under one AES-256 key before a fresh key is read from ``os.urandom``.
REKEY_BYTES = 2**36


class _Keystream:
    """AES-256-CTR keystream under a key from ``os.urandom``; rekeyed after ``REKEY_BYTES``
    and in a forked child (a child must never replay its parent's stream)."""

    def __init__(self) -> None:
        self._rekey()

    def _rekey(self) -> None:
        key, nonce = os.urandom(32), os.urandom(8)
        # counter block = 64-bit random nonce + 64-bit block counter from 0
        cipher = Cipher(algorithms.AES(key), modes.CTR(nonce + bytes(8)))
        self._encryptor = cipher.encryptor()
        self._pid = os.getpid()
        self._used = 0

    def read(self, nbytes: int) -> np.ndarray:
        """``nbytes`` keystream bytes as a uint8 array (8-byte aligned)."""
        out = np.empty(-(-nbytes // 8) + 2, dtype=np.uint64).view(np.uint8)
        if nbytes == 0:
            return out[:0]
        if os.getpid() != self._pid or self._used + nbytes > REKEY_BYTES:
            self._rekey()
        self._used += nbytes
        # the output buffer must have one spare block
        self._encryptor.update_into(_zeros(nbytes), out.data[: nbytes + 15])
        return out[:nbytes]


_ZEROS = memoryview(bytes(0))


def _zeros(nbytes: int) -> memoryview:
    """``nbytes`` zero bytes, from one buffer kept for the largest request (read-only zero
    pages: reading them costs no page faults after the first time)."""
    global _ZEROS
    if len(_ZEROS) < nbytes:
        _ZEROS = memoryview(bytes(max(nbytes, 2 * len(_ZEROS))))
    return _ZEROS[:nbytes]


class Coins:
    """A source of uniform random bits for mechanisms (see the module docstring).

    Build with :meth:`secure` or :meth:`seeded`; derive independent streams with
    :meth:`spawn`.
    """

    def __init__(self, mode: str, seed_sequence: np.random.SeedSequence | None = None) -> None:
        self.mode = check_choice("noise", mode, MODES)
        self._stream: _Keystream | None = None
        if self.mode == "seeded":
            if seed_sequence is None:
                raise ValueError("Expected a SeedSequence for seeded coins, got None.")
            self._seq: np.random.SeedSequence | None = seed_sequence
            self._rng: np.random.Generator | None = np.random.Generator(
                np.random.PCG64(seed_sequence)
            )
        else:
            self._seq = None
            self._rng = None
            self._stream = _Keystream()

    @classmethod
    def secure(cls) -> Coins:
        """Coins from the OS CSPRNG."""
        return cls("secure")

    @classmethod
    def seeded(cls, *entropy: int) -> Coins:
        """Reproducible coins keyed by non-negative integers (e.g. seed, round, stream, silo)."""
        for i, value in enumerate(entropy):
            check_int(f"entropy[{i}]", value, 0)
        return cls("seeded", np.random.SeedSequence(list(entropy)))

    @classmethod
    def for_mode(cls, mode: str, *entropy: int) -> Coins:
        """``seeded(*entropy)`` or ``secure()`` (which ignores ``entropy``)."""
        check_choice("noise", mode, MODES)
        return cls.seeded(*entropy) if mode == "seeded" else cls.secure()

    @property
    def is_secure(self) -> bool:
        return self.mode == "secure"

    def spawn(self, *key: int) -> Coins:
        """An independent stream for ``key`` (the same key gives the same seeded stream)."""
        if self._seq is None:
            return Coins.secure()
        for i, value in enumerate(key):
            check_int(f"key[{i}]", value, 0)
        entropy = self._seq.entropy
        if entropy is None or isinstance(entropy, int):
            base = [] if entropy is None else [entropy]
        else:
            base = [int(e) for e in entropy]
        spawn_key = tuple(self._seq.spawn_key) + tuple(key)
        return Coins("seeded", np.random.SeedSequence(base, spawn_key=spawn_key))

    # --- raw bits -------------------------------------------------------------------------
    def uint64(self, n: int) -> np.ndarray:
        """``n`` independent uniform 64-bit words."""
        check_int("n", n, 0)
        if self._stream is not None:
            return self._stream.read(8 * n).view(np.uint64)
        assert self._rng is not None
        return self._rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)

    def token_bytes(self, nbytes: int) -> bytes:
        """``nbytes`` uniform bytes (also makes a ``Coins`` a crypto ``RandomSource``)."""
        check_int("nbytes", nbytes, 0)
        if self._stream is not None:
            return self._stream.read(nbytes).tobytes()
        assert self._rng is not None
        return self._rng.bytes(nbytes)

    def below(self, prefix: int, bits: int, threshold: Fraction) -> bool:
        """Whether a uniform ``U`` on [0, 1) is below ``threshold``, given its first ``bits``
        bits ``prefix``: exact, drawing further 64-bit words until the comparison is decided."""
        while True:
            scaled = threshold * 2**bits
            if prefix + 1 <= scaled:
                return True
            if prefix >= scaled:
                return False
            prefix = (prefix << 64) | int(self.uint64(1)[0])
            bits += 64

    # --- derived draws ----------------------------------------------------------------------
    def uniform(self, n: int) -> torch.Tensor:
        """``n`` float64 values uniform on the 2^-53 grid of ``[0, 1)``."""
        words = self.uint64(n) >> np.uint64(11)
        return torch.from_numpy(words.astype(np.float64) * 2.0**-53)

    def bernoulli(self, n: int, rate: float) -> torch.Tensor:
        """``n`` independent Bernoulli(``rate``) draws as a bool tensor (Poisson sampling).

        ``P(True)`` is exactly ``rate`` (the float's binary value): a 64-bit word ``u`` decides
        ``U < rate`` unless ``u = floor(rate·2^64)`` (probability 2^-64), where further words
        are drawn until the comparison is decided (:meth:`below`).
        """
        check_probability("rate", rate, allow_zero=True)
        exact = Fraction(rate)
        words = self.uint64(n)
        if exact == 1:
            return torch.ones(n, dtype=torch.bool)
        cut = int(exact * 2**64)  # floor; < 2^64
        out = words < np.uint64(cut)
        if exact * 2**64 != cut:  # rate is not a multiple of 2^-64: ties need more bits
            for i in np.flatnonzero(words == np.uint64(cut)):
                out[i] = self.below(cut, 64, exact)
        return torch.from_numpy(out)

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of ``range(n)`` (int64): the order of ``n`` random
        64-bit keys, redrawn in the rare case that two keys tie (so it is exactly uniform)."""
        check_int("n", n, 0)
        while True:
            keys = self.uint64(n)
            order = np.argsort(keys, kind="stable")
            if n < 2 or bool(np.all(keys[order[1:]] != keys[order[:-1]])):
                return torch.from_numpy(order.astype(np.int64))

    def ranks(self, n: int) -> torch.Tensor:
        """Distinct uniformly random ranks ``0..n-1`` (int64): the inverse of
        :meth:`permutation`, for use as sort keys."""
        order = self.permutation(n)
        out = torch.empty(n, dtype=torch.int64)
        out[order] = torch.arange(n, dtype=torch.int64)
        return out

    def __repr__(self) -> str:
        return f"Coins({self.mode!r})"
