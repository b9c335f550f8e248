"""Where every privacy-relevant random choice comes from: :class:`Coins`.

Batch sampling, subject and silo sampling, shuffles and Gaussian noise all draw from a
:class:`Coins` object, never from a global or config-seeded generator directly. Two modes:

* ``secure`` (the default of ``silodp run``): every draw comes from the operating system's
  CSPRNG (``os.urandom``). Nobody, including whoever wrote the config, can recompute a sample
  or subtract the noise. Runs are not reproducible.
* ``seeded``: draws come from numpy's PCG64 stream keyed by a ``SeedSequence`` of the run seed
  and the stream's position (round, stream, silo). Bit-for-bit reproducible, for tests and
  experiments only: anyone who knows the seed can recompute every coin and the noise, so a
  seeded run's ε is *not* a guarantee against anyone who knows the config.

Independent streams are derived with :meth:`Coins.spawn` (seeded: a child ``SeedSequence``;
secure: a fresh CSPRNG reader), so results never depend on the order parties run in.
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch

from silodp._validation import check_choice, check_int, check_probability

__all__ = ["MODES", "Coins", "NoiseMode"]

NoiseMode = Literal["secure", "seeded"]
MODES: tuple[str, ...] = ("secure", "seeded")


class Coins:
    """A source of uniform random bits for mechanisms (see the module docstring).

    Build with :meth:`secure` or :meth:`seeded`; derive independent streams with
    :meth:`spawn`.
    """

    def __init__(self, mode: str, seed_sequence: np.random.SeedSequence | None = None) -> None:
        self.mode = check_choice("noise", mode, MODES)
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
        base = list(entropy) if isinstance(entropy, list | tuple) else [int(entropy)]
        spawn_key = tuple(self._seq.spawn_key) + tuple(key)
        return Coins("seeded", np.random.SeedSequence(base, spawn_key=spawn_key))

    # --- raw bits -------------------------------------------------------------------------
    def uint64(self, n: int) -> np.ndarray:
        """``n`` independent uniform 64-bit words."""
        check_int("n", n, 0)
        if self._rng is None:
            return np.frombuffer(os.urandom(8 * n), dtype=np.uint64).copy()
        return self._rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)

    def token_bytes(self, nbytes: int) -> bytes:
        """``nbytes`` uniform bytes (also makes a ``Coins`` a crypto ``RandomSource``)."""
        check_int("nbytes", nbytes, 0)
        if self._rng is None:
            return os.urandom(nbytes)
        return self._rng.bytes(nbytes)

    # --- derived draws ----------------------------------------------------------------------
    def uniform(self, n: int) -> torch.Tensor:
        """``n`` float64 values uniform on the 2^-53 grid of ``[0, 1)``."""
        words = self.uint64(n) >> np.uint64(11)
        return torch.from_numpy(words.astype(np.float64) * 2.0**-53)

    def bernoulli(self, n: int, rate: float) -> torch.Tensor:
        """``n`` independent Bernoulli(``rate``) draws as a bool tensor (Poisson sampling).

        ``P(True)`` is ``rate`` rounded to the 2^-53 grid, i.e. exact up to 1.1e-16.
        """
        check_probability("rate", rate, allow_zero=True)
        return self.uniform(n) < rate

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of ``range(n)`` (int64), by sorting random keys."""
        check_int("n", n, 0)
        keys = self.uint64(n)
        return torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64))

    def __repr__(self) -> str:
        return f"Coins({self.mode!r})"
