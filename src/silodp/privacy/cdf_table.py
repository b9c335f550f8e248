"""The coarse CDF table of the rounded-Gaussian sampler (:mod:`silodp.privacy.rounded_gaussian`).

For one scale ``s``: cells of ``M = 2^m`` grid points cover ``±TABLE_STDS`` standard deviations,
their CDF boundaries are tabulated once to 128-bit fixed point, with a 16-bit guide and a
per-cell threshold below which a proposal inside the cell is accepted at once. Also the float64
estimate of a ratio of masses inside a cell (:func:`_ratio`) and its rigorous error bound
(:func:`_margin`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import mpmath
import numpy as np

from silodp.privacy.exact_cdf import _tail

#: The coarse table covers ``±TABLE_STDS`` standard deviations (Φ(-9) ≈ 2^-63); samples
#: beyond it are drawn by the exact arbitrary-precision path.
TABLE_STDS = 9
#: Coarse cells hold ``M = 2^(floor(log2 s) - CELL_SHIFT)`` grid points: σ/128 to σ/64 wide.
CELL_SHIFT = 6
#: Bits of the coarse-table boundaries (fixed point) and of the first coarse lookup.
BOUNDARY_BITS = 128
GUIDE_BITS = 16
#: Slack for the float64 evaluation of an acceptance ratio (its error is below 2^-49).
FLOAT_MARGIN = 2.0**-40

_INT64_SAFE = 2**62


@dataclass(frozen=True, eq=False)
class _Table:
    """Coarse cells of ``M`` grid points and their CDF boundaries for one scale ``s``.

    Boundary ``j`` (``j = 0..n-1``) sits at ``b_j = (c_lo + j)·M - ½`` grid units; its CDF
    ``B_j = Φ(b_j / s)`` satisfies ``T_j - 1 < B_j·2^128 < T_j + 1``. A uniform's *position*
    is ``#{j : B_j <= U}``: 0 and ``n`` are the tails, position ``i`` in between is cell
    ``c_lo + i - 1``, i.e. grid points ``base[i] .. base[i] + M - 1``.
    """

    scale: Fraction
    s: float
    m: int  # M = 2^m
    c_lo: int
    bounds: tuple[int, ...]  # T_j
    above32: np.ndarray  # A_j = ceil((T_j+1) / 2^96): U's 32-bit prefix >= A_j => B_j < U
    below32: np.ndarray  # floor((T_j-1) / 2^96) - 1: prefix <= this => U < B_j
    guide: np.ndarray  # position for each 16-bit prefix, -1 where the prefix does not decide
    base: np.ndarray  # per position: first grid point of the cell (int64 or object)
    base_f: np.ndarray  # the same as float64
    star_off: np.ndarray  # per position: offset of the cell's point nearest 0 (float64)
    accept_bits: int  # a: bits of the acceptance uniform in the first word
    fast_accept: np.ndarray  # per position: v < this (v the a-bit prefix) => accept
    bucket_base: np.ndarray  # per 16-bit prefix: first point of its cell (0 if undecided)
    bucket_fast: np.ndarray  # per 16-bit prefix: fast_accept·2^m of its cell (0 if undecided)
    bucket_clean: np.ndarray  # per 16-bit prefix: decided and not a tail

    @property
    def cell(self) -> int:
        return 1 << self.m

    @property
    def size(self) -> int:
        return len(self.bounds)

    @property
    def reach(self) -> int:
        """Largest ``|k|`` of a table point."""
        return (abs(self.c_lo) + self.size + 2) * self.cell

    @property
    def guided(self) -> bool:
        """Whether the vectorised guide path applies (int64 points, offset in the first word)."""
        return self.int64 and (self.m == 0 or self.m + self.accept_bits == 32)

    @property
    def int64(self) -> bool:
        """Whether every table point and offset fits int64 with room to spare."""
        return self.reach < _INT64_SAFE


def _cdf_fixed_point(b: Fraction, prec: int) -> int:
    """``floor(Φ(b)·2^128)`` up to ±1 (the table treats ``T ± 1`` as undecided)."""
    q, _ = _tail(abs(b), prec)
    with mpmath.workprec(prec):
        scaled = mpmath.ldexp(q, BOUNDARY_BITS)
        if b <= 0:
            return int(mpmath.floor(scaled))
        return (1 << BOUNDARY_BITS) - int(mpmath.ceil(scaled))


def _cell_exponent(scale: Fraction) -> int:
    top = scale.numerator.bit_length() - scale.denominator.bit_length()
    while Fraction(2) ** top > scale:
        top -= 1
    while Fraction(2) ** (top + 1) <= scale:
        top += 1
    return max(0, top - CELL_SHIFT)  # top = floor(log2 s)


@functools.lru_cache(maxsize=32)
def _table(scale: Fraction) -> _Table:
    m = _cell_exponent(scale)
    cell = 1 << m
    reach = math.ceil(TABLE_STDS * scale)
    c_lo = -(reach // cell) - 2
    c_hi = reach // cell + 1
    edges = [Fraction(2 * (c * cell) - 1, 2) for c in range(c_lo, c_hi + 2)]
    bounds = tuple(_cdf_fixed_point(b / scale, 200) for b in edges)
    n = len(bounds)
    lows = [t - 1 for t in bounds]
    highs = [t + 1 for t in bounds]
    shift32 = BOUNDARY_BITS - 32
    above32 = np.array([-(-h >> shift32) for h in highs], dtype=np.int64)
    below32 = np.array([(lo >> shift32) - 1 for lo in lows], dtype=np.int64)
    shift = BOUNDARY_BITS - GUIDE_BITS
    above = np.array([-(-h >> shift) for h in highs], dtype=np.int64)
    below = np.array([(lo >> shift) - 1 for lo in lows], dtype=np.int64)
    prefixes = np.arange(1 << GUIDE_BITS, dtype=np.int64)
    count = np.searchsorted(above, prefixes, side="right")
    decided = (count == n) | (prefixes <= below[np.minimum(count, n - 1)])
    guide = np.where(decided, count, -1).astype(np.int32)

    cells = [c_lo + i - 1 for i in range(n + 1)]  # positions 0 and n are the tails
    firsts = [c * cell for c in cells]
    fits = (abs(c_lo) + n + 2) * cell < _INT64_SAFE
    base = np.array(firsts, dtype=np.int64 if fits else object)
    base_f = np.array([float(f) for f in firsts], dtype=np.float64)
    star = [0 if f >= 0 else cell - 1 for f in firsts]
    star_off = np.array(star, dtype=np.float64)
    accept_bits = 32 - m if m <= 26 else 32
    s = float(scale)
    fast = np.zeros(n + 1, dtype=np.int64)
    if m > 0:
        inner = np.arange(1, n)
        ends = [np.zeros(n - 1), np.full(n - 1, float(cell - 1))]
        worst = np.minimum(*(_ratio(base_f[inner], star_off[inner], e, s) for e in ends))
        margin = _margin(s)
        fast[inner] = np.floor(np.maximum(worst - margin, 0.0) * 2.0**accept_bits)
    else:
        fast[1:n] = 1 << accept_bits
    clean = (guide > 0) & (guide < n)
    cell_of = np.where(clean, guide, 0)
    bucket_base = np.where(clean, base[cell_of], 0).astype(base.dtype)
    # per bucket: the fast threshold times 2^m, for a comparison with the whole 32-bit word
    shifted = np.minimum(fast[cell_of], (1 << accept_bits) - 1) << (
        m if m + accept_bits == 32 else 0
    )
    bucket_fast = np.where(clean, shifted, 0).astype(np.uint32)
    return _Table(
        scale=scale,
        s=s,
        m=m,
        c_lo=c_lo,
        bounds=bounds,
        above32=above32,
        below32=below32,
        guide=guide,
        base=base,
        base_f=base_f,
        star_off=star_off,
        accept_bits=accept_bits,
        fast_accept=fast,
        bucket_base=bucket_base,
        bucket_fast=bucket_fast,
        bucket_clean=clean,
    )


def _margin(s: float) -> float:
    """Bound on ``|float ratio - p_k/p_k*|``: ``1/(4s²)`` from the approximation below plus
    :data:`FLOAT_MARGIN` for float64 rounding."""
    return 0.25 / (s * s) + FLOAT_MARGIN


def _ratio(base_f: np.ndarray, star: np.ndarray, off: np.ndarray, s: float) -> np.ndarray:
    """float64 estimate of ``p_k / p_k*`` for ``k = base + off``, ``k* = base + star``.

    With ``D(k) = ∫_{k-½}^{k+½} e^{-t²/(2s²)} dt = e^{-k²/(2s²)} ∫_{-½}^{½} cosh(kt/s²)
    e^{-t²/(2s²)} dt`` and ``e^{-1/(8s²)} <= e^{-t²/(2s²)} <= 1`` on the interval,
    ``D(k) = e^{-k²/(2s²)} J(k/(2s²)) (1 - θ_k)``, ``J(h) = sinh(h)/h``,
    ``0 <= θ_k <= 1/(8s²)``; so the ratio is ``e^{-(k-k*)(k+k*)/(2s²)} J_k / J_k*`` within
    ``1/(4s²)`` (the ratio is at most 1). Used for ``s >= 128`` (cells of one point below):
    ``|h| <= 5/s``, ``J`` by its series to ``h^6`` (truncation < 2^-52), the exponent below
    0.2 and computed to a few ulps, so float64 adds less than 2^-49.
    """
    delta = off - star
    total = 2.0 * base_f + off + star
    inv = 1.0 / (2.0 * s * s)
    h = (base_f + off) * inv
    hs = (base_f + star) * inv
    return np.exp(-(delta * total) * inv) * _sinhc(h) / _sinhc(hs)


def _sinhc(h: np.ndarray) -> np.ndarray:
    h2 = h * h
    return 1.0 + h2 * (1.0 / 6.0 + h2 * (1.0 / 120.0 + h2 * (1.0 / 5040.0)))
