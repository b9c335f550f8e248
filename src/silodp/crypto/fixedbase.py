"""Fixed-base exponentiation with precomputed window tables (the "comb" of Lim-Lee style).

For a base ``c`` used with many short exponents, store ``c^(d * 2^(w i))`` for every window
``i`` and digit ``d < 2^w``; then ``c^e`` costs one modular product per non-zero ``w``-bit
digit of ``e`` and no squaring. Building costs ``(2^w - 1)`` products per window.
:func:`choose_window` picks ``w`` for a known number of uses under a memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gmpy2

__all__ = ["FixedBaseTable", "choose_window"]

MAX_WINDOW_BITS = 12


def choose_window(
    exponent_bits: int,
    uses: int,
    *,
    element_bytes: int,
    bases: int = 1,
    memory_budget: int = 64 << 20,
) -> int:
    """The window size minimising build + use products within ``memory_budget`` bytes."""
    if exponent_bits < 1 or uses < 0:
        raise ValueError(f"Expected exponent_bits={exponent_bits} >= 1 and uses={uses} >= 0.")
    best, best_cost = 1, None
    for w in range(1, MAX_WINDOW_BITS + 1):
        windows = -(-exponent_bits // w)
        entries = windows * ((1 << w) - 1)
        if w > 1 and bases * entries * element_bytes > memory_budget:
            break
        cost = entries + uses * windows
        if best_cost is None or cost < best_cost:
            best, best_cost = w, cost
    return best


@dataclass(frozen=True, repr=False)
class FixedBaseTable:
    """``rows[i][d] = base^(d * 2^(window_bits * i)) mod modulus`` (``rows[i][0]`` unused)."""

    modulus: Any
    exponent_bits: int
    window_bits: int
    rows: tuple[tuple[Any, ...], ...]

    @classmethod
    def build(
        cls, base: Any, modulus: Any, exponent_bits: int, window_bits: int = 8
    ) -> FixedBaseTable:
        if not 1 <= window_bits <= MAX_WINDOW_BITS:
            raise ValueError(f"Expected window_bits={window_bits} in [1, {MAX_WINDOW_BITS}].")
        if exponent_bits < 1:
            raise ValueError(f"Expected exponent_bits={exponent_bits} >= 1.")
        mod = gmpy2.mpz(modulus)
        step = gmpy2.mpz(base) % mod
        one = gmpy2.mpz(1)
        rows = []
        for _ in range(-(-exponent_bits // window_bits)):
            row = [one, step]
            for _ in range((1 << window_bits) - 2):
                row.append(row[-1] * step % mod)
            rows.append(tuple(row))
            step = row[-1] * step % mod  # step^(2^w)
        return cls(mod, exponent_bits, window_bits, tuple(rows))

    def __repr__(self) -> str:
        return f"FixedBaseTable(exponent_bits={self.exponent_bits}, window_bits={self.window_bits})"

    def pow(self, exponent: int) -> Any:
        """``base^exponent`` for ``0 <= exponent < 2^exponent_bits``."""
        e = int(exponent)
        if not 0 <= e < (1 << self.exponent_bits):
            raise ValueError(f"Exponent outside [0, 2^{self.exponent_bits}).")
        mask = (1 << self.window_bits) - 1
        acc = gmpy2.mpz(1)
        mod = self.modulus
        for row in self.rows:
            d = e & mask
            if d:
                acc = acc * row[d] % mod
            e >>= self.window_bits
        return acc
