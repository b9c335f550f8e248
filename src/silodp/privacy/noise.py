"""Exact Gaussian noise: a sampler of the rounded Gaussian and the Gaussian mechanism on a grid.

Why not ``torch.randn``: a float32 Gaussian (24-bit uniforms through Box–Muller) never leaves
radius 5.768σ, so an output beyond it from one dataset is impossible from its neighbour — an
infinite privacy loss the accountant does not see (mass 1.4e-4 per unsampled step at σ=0.5).
A float64 Gaussian has the same flaw further out, and its low-order bits leak the input
(Mironov, "On significance of the least significant bits for differential privacy", CCS 2012).

What silodp releases instead (:func:`gaussian_mechanism`): the input snapped to a power-of-two
grid ``g`` plus ``g·K``, ``K`` the *exactly* sampled rounded Gaussian :func:`rounded_gaussian`.
The sum equals ``round_g(snapped + Z)`` for a true continuous Gaussian ``Z``: a deterministic
post-processing of the continuous Gaussian mechanism whose sensitivity bounds the true one —
exactly the mechanism the accountant charges, with no floating-point caveat.

All randomness comes from a :class:`~silodp.privacy.randomness.Coins`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import mpmath
import numpy as np
import torch

from silodp._validation import check_int
from silodp.privacy.randomness import Coins

__all__ = ["gaussian_mechanism", "grid_exponent", "rounded_gaussian"]

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
#: Bits of the grid below the noise std in :func:`gaussian_mechanism`.
GRID_BITS = 30
#: Samples drawn per vectorised pass: temporaries stay in cache and are reused by the
#: allocator instead of being faulted in afresh (a measured ~2x on 6.6M samples).
CHUNK = 1 << 18

_INT64_SAFE = 2**62


# --- exact comparisons against the Gaussian CDF (arbitrary precision) -----------------------


class _Lazy:
    """A uniform ``U`` on [0, 1) known through its first ``bits`` bits ``prefix``; more bits
    are drawn from ``coins`` only when a comparison needs them."""

    __slots__ = ("bits", "coins", "prefix")

    def __init__(self, prefix: int, bits: int, coins: Coins) -> None:
        self.prefix, self.bits, self.coins = int(prefix), int(bits), coins

    def extend(self) -> None:
        self.prefix = (self.prefix << 64) | int(self.coins.uint64(1)[0])
        self.bits += 64

    def interval(self) -> tuple[mpmath.mpf, mpmath.mpf]:
        """``[lo, hi)`` containing ``U`` (exact at the current working precision)."""
        lo = mpmath.ldexp(mpmath.mpf(self.prefix), -self.bits)
        hi = mpmath.ldexp(mpmath.mpf(self.prefix + 1), -self.bits)
        return lo, hi


def _mp(value: Fraction) -> mpmath.mpf:
    return mpmath.mpf(value.numerator) / value.denominator


def _tail(x: Fraction, prec: int) -> tuple[mpmath.mpf, mpmath.mpf]:
    """``Q(x) = P(N(0,1) > x)`` for ``x >= 0`` at ``prec`` bits, and a bound on its error:
    the argument is rounded once (relative error ``x²·2^-prec`` in ``Q``) and mpmath's
    ``erfc`` is taken to be accurate to ``2^-(prec-8)`` relative (it works with guard bits)."""
    with mpmath.workprec(prec):
        q = mpmath.erfc(_mp(x) / mpmath.sqrt(2)) / 2
        slack = 2 * (1 + _mp(x * x)) * mpmath.ldexp(1, 8 - prec)
        return q, q * slack


def _working_precision(lazy: _Lazy, x: Fraction) -> int:
    magnitude = max(1, x.numerator.bit_length() - x.denominator.bit_length() + 1)
    return max(128, lazy.bits + 64 + 2 * magnitude)


def _below_cdf(lazy: _Lazy, x: Fraction) -> bool:
    """Whether ``U < Φ(x)``, exactly: the CDF is computed with a rigorous error bound at
    increasing precision and ``U`` is extended until the two are separated."""
    prec = _working_precision(lazy, x)
    while True:
        q, err = _tail(abs(x), prec)
        with mpmath.workprec(prec + lazy.bits + 64):
            lo, hi = lazy.interval()
            if x <= 0:  # Φ(x) = Q(-x)
                if hi <= q - err:
                    return True
                if lo >= q + err:
                    return False
            else:  # U < Φ(x)  <=>  1 - U > Q(x)
                if 1 - hi >= q + err:
                    return True
                if 1 - lo <= q - err:
                    return False
            width = hi - lo
        if width > err:
            lazy.extend()
        else:
            prec *= 2


def _mass(k: int, scale: Fraction, prec: int) -> tuple[mpmath.mpf, mpmath.mpf]:
    """``P(round(Z) = k)`` for ``Z ~ N(0, scale²)`` and a bound on its error (``prec`` bits);
    by symmetry ``p_k = p_|k| = Q((|k|-½)/s) - Q((|k|+½)/s)`` and ``p_0 = 1 - 2 Q(½/s)``."""
    j = abs(k)
    upper, err_u = _tail(Fraction(2 * j + 1, 2) / scale, prec)
    with mpmath.workprec(prec):
        if j == 0:
            return 1 - 2 * upper, 2 * err_u + mpmath.ldexp(1, 4 - prec)
        lower, err_l = _tail(Fraction(2 * j - 1, 2) / scale, prec)
        return lower - upper, err_l + err_u + mpmath.ldexp(lower, 4 - prec)


def _accept_exact(lazy: _Lazy, k: int, kstar: int, scale: Fraction) -> bool:
    """Whether ``V < p_k / p_kstar`` exactly (``V`` the lazy uniform)."""
    prec = lazy.bits + 64 + 3 * max(8, math.ceil(scale).bit_length())
    while True:
        pk, ek = _mass(k, scale, prec)
        ps, es = _mass(kstar, scale, prec)
        with mpmath.workprec(prec + lazy.bits + 64):
            if pk - ek > 0 and ps - es > 0:
                ratio = pk / ps
                err = ratio * (ek / (pk - ek) + es / (ps - es)) * 2
                lo, hi = lazy.interval()
                if hi <= ratio - err:
                    return True
                if lo >= ratio + err:
                    return False
                wide = hi - lo > err
            else:
                wide = False
        if wide:
            lazy.extend()
        else:
            prec *= 2


# --- the coarse table ------------------------------------------------------------------------


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


# --- the sampler -------------------------------------------------------------------------------


def _position_exact(table: _Table, lazy: _Lazy) -> int:
    """``#{j : B_j <= U}`` exactly, by bisection over the boundaries."""

    def below(j: int) -> bool:  # U < B_j
        lo, hi = table.bounds[j] - 1, table.bounds[j] + 1
        while lazy.bits <= 2 * BOUNDARY_BITS:
            if lazy.bits <= BOUNDARY_BITS:
                sh = BOUNDARY_BITS - lazy.bits
                if (lazy.prefix + 1) << sh <= lo:
                    return True
                if lazy.prefix << sh >= hi:
                    return False
            else:
                sh = lazy.bits - BOUNDARY_BITS
                if lazy.prefix + 1 <= lo << sh:
                    return True
                if lazy.prefix >= hi << sh:
                    return False
            lazy.extend()
        edge = Fraction(2 * (table.c_lo + j) * table.cell - 1, 2)
        return _below_cdf(lazy, edge / table.scale)

    first, last = 0, table.size  # answer in [first, last]
    while first < last:
        mid = (first + last) // 2
        if below(mid):
            last = mid
        else:
            first = mid + 1
    return first


def _tail_exact(table: _Table, lazy: _Lazy, position: int) -> int:
    """``K`` with ``Φ((K-½)/s) <= U < Φ((K+½)/s)`` for a uniform in a tail of the table."""
    s = table.scale

    def below(k: int) -> bool:  # U < Φ((k+½)/s)
        return _below_cdf(lazy, Fraction(2 * k + 1, 2) / s)

    if position == 0:  # U < Φ((c_lo M - ½)/s): K <= c_lo M - 1
        hi = table.c_lo * table.cell - 1
        step = 1
        lo = hi - step
        while below(lo):
            hi, step = lo, step * 2
            lo = hi - step
    else:  # U >= Φ(((c_lo + n - 1) M - ½)/s): K >= (c_lo + n - 1) M
        lo = (table.c_lo + table.size - 1) * table.cell - 1
        step = 1
        hi = lo + step
        while not below(hi):
            lo, step = hi, step * 2
            hi = lo + step
    while hi - lo > 1:  # invariant: U >= Φ((lo+½)/s), U < Φ((hi+½)/s)
        mid = (lo + hi) // 2
        if below(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _offsets(table: _Table, words: np.ndarray, coins: Coins) -> tuple[np.ndarray, np.ndarray]:
    """Uniform offsets in ``[0, M)`` (exact ints, and as float64) for len(words) proposals:
    the low ``m`` bits of the 32-bit ``words`` when ``m <= 26``, else fresh words."""
    m, count = table.m, len(words)
    if m + table.accept_bits == 32:
        off = (words & np.uint32(table.cell - 1)).astype(np.int64)
        return off, off.astype(np.float64)
    if m <= 62:
        off = (coins.uint64(count) >> np.uint64(64 - m)).astype(np.int64)
        return (off if table.int64 else off.astype(object)), off.astype(np.float64)
    chunks = -(-m // 64)
    raw = coins.uint64(count * chunks).reshape(count, chunks)
    exact = np.empty(count, dtype=object)
    for i in range(count):
        value = 0
        for word in raw[i]:
            value = (value << 64) | int(word)
        exact[i] = value >> (64 * chunks - m)
    return exact, exact.astype(np.float64)


def _fine(
    table: _Table, position: np.ndarray, words: np.ndarray, coins: Coins
) -> tuple[np.ndarray, np.ndarray]:
    """One rejection round of the fine stage for proposals in cells ``position``, from the
    32-bit ``words`` (acceptance bits high, offset bits low).

    Returns (accepted mask, offsets). The proposal is uniform on the cell's ``M`` points; it is
    accepted with probability exactly ``p_k / p_k*`` (``k*`` the cell's point nearest 0, whose
    mass bounds every mass in the cell): the low ``a`` bits of each word start a uniform ``V``;
    ``V`` below a per-cell lower bound of the ratio accepts at once, otherwise ``V`` is
    compared with the float64 ratio ± :func:`_margin`, with 64 more bits if needed, and with
    the exact ratio when it falls inside the margin.
    """
    off, off_f = _offsets(table, words, coins)
    a = table.accept_bits
    v = (words >> np.uint32(32 - a)).astype(np.int64) if a < 32 else words.astype(np.int64)
    accepted = v < table.fast_accept[position]
    slow = np.flatnonzero(~accepted)
    if slow.size == 0:
        return accepted, off
    pos = position[slow]
    ratio = _ratio(table.base_f[pos], table.star_off[pos], off_f[slow], table.s)
    margin = _margin(table.s)
    step = 2.0**-a
    vs = v[slow].astype(np.float64)
    yes = (vs + 1.0) * step <= ratio - margin
    no = vs * step >= ratio + margin
    unsure = np.flatnonzero(~(yes | no))
    if unsure.size:
        more = coins.uint64(unsure.size)
        lo = (vs[unsure] + (more >> np.uint64(11)).astype(np.float64) * 2.0**-53) * step
        hi = lo + 2.0**-53 * step
        yes[unsure] = hi <= ratio[unsure] - margin
        no[unsure] = lo >= ratio[unsure] + margin
        for u in np.flatnonzero(~(yes[unsure] | no[unsure])):
            i = unsure[u]
            first = int(table.base[int(pos[i])])
            k = first + int(off[slow[i]])
            kstar = first if first >= 0 else first + table.cell - 1
            prefix = (int(v[slow[i]]) << 64) | int(more[u])
            yes[i] = _accept_exact(_Lazy(prefix, a + 64, coins), k, kstar, table.scale)
    accepted[slow] = yes
    return accepted, off


def _as_fraction(scale: float | int | Fraction) -> Fraction:
    if isinstance(scale, bool) or not isinstance(scale, int | float | Fraction):
        raise ValueError(f"Expected scale={scale!r} to be a float, int or Fraction.")
    if isinstance(scale, float) and not math.isfinite(scale):
        raise ValueError(f"Expected scale={scale!r} to be finite.")
    value = Fraction(scale)
    if value <= 0:
        raise ValueError(f"Expected scale={scale!r} > 0.")
    return value


def _uniform_words(coins: Coins, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """``n`` uniform words of ``dtype`` (uint16 or uint32) from ``coins``."""
    per = 8 // np.dtype(dtype).itemsize
    return coins.uint64(-(-n // per)).view(dtype)[:n]


def _draw(
    table: _Table,
    n: int,
    coins: Coins,
    *,
    prefix: np.ndarray | None = None,
    bits: int = 32,
    fine: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """``n`` exact samples for ``table`` (int64, or object beyond int64), and the largest
    magnitude of a sample beyond the table (0 if none).

    Sample ``i``'s coarse uniform starts with the ``bits``-bit ``prefix[i]`` (16 <= bits <= 64;
    32 random bits when ``None``) and its first fine-stage word is the uint32 ``fine[i]``
    (random when ``None``). The common case costs a few vectorised passes per chunk of
    :data:`CHUNK` samples: a 16-bit guide lookup gives the cell's first point and its
    acceptance threshold; the rest (about 2%) is collected and finished by :func:`_resolve`.
    """
    if prefix is not None and (not GUIDE_BITS <= bits <= 64 or prefix.shape != (n,)):
        raise ValueError(f"Expected {n} prefixes of 16 to 64 bits, got {prefix.shape}, {bits}.")
    multi = table.cell > 1
    if n == 0:
        return np.zeros(0, dtype=np.int64 if table.int64 else object), 0
    if prefix is None:
        bits = 32
    if not table.guided:
        prefix = _uniform_words(coins, n, np.uint32) if prefix is None else prefix
        fine = _uniform_words(coins, n, np.uint32) if multi and fine is None else fine
        out = np.zeros(n, dtype=np.int64 if table.int64 else object)
        slow = np.arange(n)
        top = np.right_shift(prefix, prefix.dtype.type(bits - GUIDE_BITS), dtype=np.intp)
        parts = [(slow, top, prefix, fine)]
    else:
        out = np.empty(n, dtype=np.int64)
        parts = []
        mask = np.uint32(table.cell - 1)
        for begin in range(0, n, CHUNK):
            stop = min(begin + CHUNK, n)
            size = stop - begin
            p = _uniform_words(coins, size, np.uint32) if prefix is None else prefix[begin:stop]
            top = np.right_shift(p, p.dtype.type(bits - GUIDE_BITS), dtype=np.intp)
            chunk = out[begin:stop]
            np.take(table.bucket_base, top, out=chunk, mode="wrap")
            if multi:
                f = _uniform_words(coins, size, np.uint32) if fine is None else fine[begin:stop]
                # acceptance bits on top: v < threshold  <=>  f < threshold·2^m
                slow = np.flatnonzero(f >= np.take(table.bucket_fast, top, mode="wrap"))
                parts.append((slow + begin, top[slow], p[slow], f[slow]))
                chunk += np.bitwise_and(f, mask, out=f if fine is None else None)
            else:
                slow = np.flatnonzero(~np.take(table.bucket_clean, top, mode="wrap"))
                parts.append((slow + begin, top[slow], p[slow], None))
    slow = np.concatenate([q[0] for q in parts])
    largest = 0
    if slow.size:
        top_slow = np.concatenate([q[1] for q in parts])
        prefix_slow = np.concatenate([q[2].astype(np.uint64) for q in parts])
        fine_slow = np.concatenate([q[3] for q in parts]) if multi else None
        tails = _resolve(table, out, slow, top_slow, prefix_slow, bits, fine_slow, coins)
        if tails:
            largest = max(abs(v) for _, v in tails)
            if out.dtype != object and largest >= _INT64_SAFE:
                out = out.astype(object)
            for i, v in tails:
                out[i] = v
    return out, largest


def _resolve(
    table: _Table,
    out: np.ndarray,
    slow: np.ndarray,
    top: np.ndarray,
    prefix: np.ndarray,
    bits: int,
    fine: np.ndarray | None,
    coins: Coins,
) -> list[tuple[int, int]]:
    """Completes the samples ``slow`` of ``out`` — ``top``, ``prefix`` and ``fine`` are
    theirs: guide index, coarse prefix of ``bits`` bits, first fine-stage word — by finding
    the cell where 16 bits did not decide it (32 bits, then :func:`_position_exact`), the
    fine stage, and the tails; returns the tail samples as (index, value) for the caller."""
    position = table.guide[top].astype(np.int64)
    current = prefix.astype(np.uint64)
    current_bits = np.full(slow.size, bits, dtype=np.int64)
    dirty = np.flatnonzero(position < 0)
    if dirty.size:
        if bits >= 32:
            p32 = (current[dirty] >> np.uint64(bits - 32)).astype(np.int64)
        else:  # draw the next 16 bits of these uniforms
            extra = _uniform_words(coins, dirty.size, np.uint16).astype(np.uint64)
            current[dirty] = (current[dirty] << np.uint64(16)) | extra
            current_bits[dirty] = 32
            p32 = current[dirty].astype(np.int64)
        count = np.searchsorted(table.above32, p32, side="right")
        last = table.size - 1
        decided = (count == table.size) | (p32 <= table.below32[np.minimum(count, last)])
        position[dirty[decided]] = count[decided]
        lazies: dict[int, _Lazy] = {}
        for j in dirty[~decided]:
            lazy = _Lazy(int(current[j]), int(current_bits[j]), coins)
            position[j] = _position_exact(table, lazy)
            lazies[int(j)] = lazy
    else:
        lazies = {}
    is_tail = (position == 0) | (position == table.size)
    inner = np.flatnonzero(~is_tail)
    if table.cell > 1:
        assert fine is not None
        pending, cells, words = inner, position[inner], fine[inner]
        while pending.size:
            accepted, off = _fine(table, cells, words, coins)
            done = slow[pending[accepted]]
            out[done] = table.base[cells[accepted]] + off[accepted]
            pending, cells = pending[~accepted], cells[~accepted]
            words = _uniform_words(coins, pending.size, np.uint32)
    else:
        out[slow[inner]] = table.base[position[inner]]
    tails = []
    for j in np.flatnonzero(is_tail):
        lazy = lazies.get(int(j)) or _Lazy(int(current[j]), int(current_bits[j]), coins)
        tails.append((int(slow[j]), _tail_exact(table, lazy, int(position[j]))))
    return tails


def rounded_gaussian(n: int, *, scale: float | int | Fraction, coins: Coins) -> np.ndarray:
    """``n`` i.i.d. samples of ``K = floor(Z + ½)``, ``Z ~ N(0, scale²)`` — exactly.

    Guarantee: each output has *exactly* the law ``P(K = k) = Φ((k+½)/s) - Φ((k-½)/s)``
    (``s = scale``, any positive float, int or Fraction, up to ~2^100 and beyond), i.e. ``K``
    is an exact post-processing (rounding) of a continuous Gaussian; ties (``Z + ½``
    an integer) have probability 0, so half-to-even rounding gives the same law. Exact
    assuming only uniform coins and, on the rare arbitrary-precision path, that mpmath's
    ``erfc`` is accurate to ``2^8`` units of its working precision (guard bits included).

    Algorithm (two stages, vectorised; Python loops only over rare undecided entries):

    1. *Coarse cell* by inversion of a uniform ``U``. Cells of ``M = 2^m`` grid points
       (``M ≈ s/64..s/128``, one point when ``s < 128``) cover ``±9 s``; their CDF boundaries
       are tabulated once per scale to 128-bit fixed point with mpmath (``T_j``, with
       ``|B_j·2^128 - T_j| < 1``). The first 16 bits of ``U`` decide the cell for most
       samples through a guide table; otherwise its first 32 bits by binary search; where
       those still straddle a boundary, ``U`` gets 64 more bits at a time and is compared
       exactly with ``T_j ± 1``, and beyond 256 bits (probability ~2^-128) with the boundary
       computed in arbitrary precision. Beyond the table (``|Z| > 9s``, probability ~2^-63),
       ``K`` is found by exact inversion of the CDF (:func:`_tail_exact`). The cell is
       therefore chosen with exactly its probability.
    2. *Fine point* by rejection inside the cell: a uniform offset in ``[0, M)`` (``M`` is a
       power of two: exact), accepted with probability ``p_k / p_k*`` where ``p_k*`` (the
       cell's point nearest 0) is the largest mass in the cell (``p_k`` falls with ``|k|``).
       Acceptance compares a fresh uniform with the ratio: against a per-cell lower bound
       first, then the float64 ratio with a rigorous error margin (:func:`_ratio`), then
       exactly (mpmath) when the uniform falls within the margin (probability ~2^-38). About
       1% of proposals are rejected and redrawn in the same cell.

    Args:
      n: number of samples.
      scale: the standard deviation ``s`` of ``Z`` in grid units.
      coins: the source of uniform bits.

    Returns:
      int64 array when every table point fits int64 (``s`` below ~2^57), else an object
      array of Python ints. Scales above 2^100 (the weighting protocol's grid can need
      2^3000) split off an exact coarse sample (:func:`_wide_rounded_gaussian`).
    """
    check_int("n", n, 0)
    exact = _as_fraction(scale)
    if exact > 2**WIDE_SCALE_BITS:
        return _wide_rounded_gaussian(n, exact, coins)
    return _draw(_table(exact), n, coins)[0]


#: scales above 2^WIDE_SCALE_BITS are split into a coarse exact sample and a fine part
WIDE_SCALE_BITS = 100
#: the coarse part's scale lies in [2^COARSE_BITS, 2^(COARSE_BITS+1))
COARSE_BITS = 64
#: a fine proposal's uniform below 1 - 2^-48 accepts at once (when |coarse| < 2^70)
FAST_ACCEPT = 2**64 - 2**16


def _wide_rounded_gaussian(n: int, scale: Fraction, coins: Coins) -> np.ndarray:
    """``round(s·N)`` for a huge scale ``s`` (above 2^100), exactly, as an object array.

    Write ``s = K·s'`` with ``K = 2^j`` and ``s' ∈ [2^64, 2^65)``, and ``X = s'·N``. Then
    ``round(s·N) = round(K·X) = K·C + round(K·F)`` with ``C = round(X)`` (drawn exactly by
    the two-stage sampler) and ``F = X - C ∈ [-½, ½)``. Given ``C = c``, ``X`` has density
    ``∝ φ(x/s')`` on ``[c-½, c+½)``; cut that interval into ``2K`` half-cells of width
    ``1/(2K)``, each inside one rounding cell of ``K·F`` (half-cell ``h`` has
    ``round(K·F) = ⌈h/2⌉ - K/2``). Propose a half-cell uniformly (exact: ``j+1`` random
    bits) and accept it with probability ``p_h / p_max``, its Gaussian mass over the largest
    half-cell mass (the one nearest 0). Over an interval of width 1 the density varies by a
    factor ``≥ exp(-(|c|+1)/s'²) ≥ 1 - 2^-49`` when ``|c| < 2^70``, so a uniform below
    ``1 - 2^-48`` accepts at once; otherwise (probability ~2^-48) the ratio is computed in
    arbitrary precision and compared exactly, with the uniform's bits extended until decided.
    The accepted half-cell therefore has exactly its conditional probability given ``C``,
    and the output exactly the law of ``round(s·N)``.
    """
    j = scale.numerator.bit_length() - scale.denominator.bit_length() - COARSE_BITS
    while scale / 2**j >= 2 ** (COARSE_BITS + 1):
        j += 1
    while scale / 2**j < 2**COARSE_BITS:
        j -= 1
    fine = 2**j  # K
    coarse_scale = scale / fine
    coarse = rounded_gaussian(n, scale=coarse_scale, coins=coins)
    nbytes = (j + 1 + 7) // 8
    cells = 2 * fine  # half-cells per unit interval (a power of two)
    out = np.empty(n, dtype=object)
    for i in range(n):
        c = int(coarse[i])
        while True:
            raw = coins.token_bytes(nbytes + 8)
            h = int.from_bytes(raw[:nbytes], "little") & (cells - 1)
            v = int.from_bytes(raw[nbytes:], "little")
            if v < FAST_ACCEPT and abs(c) < 2**70:
                break
            if _accept_half_cell(c, h, fine, coarse_scale, v, coins):
                break
        out[i] = fine * c + (h + 1) // 2 - fine // 2
    return out


def _accept_half_cell(c: int, h: int, fine: int, s: Fraction, v: int, coins: Coins) -> bool:
    """Exactly: is the uniform ``V`` (first 64 bits ``v``, more drawn as needed) below
    ``p_h / p_max`` (half-cell masses of ``N(0, s²)`` on ``[c-½, c+½)``)?"""
    cells = 2 * fine
    best = 0 if c > 0 else (cells - 1 if c < 0 else fine)
    bits = 64
    prec = 2 * (fine.bit_length() + s.numerator.bit_length() + s.denominator.bit_length()) + 256
    while True:
        with mpmath.workprec(prec):

            def mass(k: int) -> mpmath.mpf:
                lo = (Fraction(c) - Fraction(1, 2) + Fraction(k, cells)) / s
                hi = lo + Fraction(1, cells) / s
                return mpmath.ncdf(_mp(hi)) - mpmath.ncdf(_mp(lo))

            ratio = mass(h) / mass(best)
            slack = mpmath.mpf(2) ** (-(prec // 2))  # far above the working error
            r_lo, r_hi = ratio - slack, ratio + slack
            for _ in range(8):
                v_lo = mpmath.mpf(v) / mpmath.mpf(2) ** bits
                v_hi = mpmath.mpf(v + 1) / mpmath.mpf(2) ** bits
                if v_hi <= r_lo:
                    return True
                if v_lo >= r_hi:
                    return False
                v = (v << 64) | int.from_bytes(coins.token_bytes(8), "little")
                bits += 64
        prec *= 2


# --- the Gaussian mechanism ----------------------------------------------------------------


def grid_exponent(std: float) -> int:
    """``e`` with ``2^e`` about ``2^-30·std``: ``floor(log2 std) - 30``."""
    _, exponent = math.frexp(std)  # std = f·2^exponent, f in [0.5, 1)
    return exponent - 1 - GRID_BITS


def _power_of_two(exponent: int) -> float:
    """``2^exponent`` as a float64 (exact; multiplying by it is exact barring over/underflow,
    which the callers' range checks exclude)."""
    if not -1022 <= exponent <= 1023:
        raise ValueError(f"Expected a grid exponent in [-1022, 1023], got {exponent}.")
    return math.ldexp(1.0, exponent)


def _snap(x: np.ndarray, exponent: int, shares: int) -> np.ndarray:
    """``q`` with ``q·shares·2^exponent`` the point of the grid ``shares·2^exponent`` nearest
    ``x`` (exact; float64 holding integers; overwrites ``x``)."""
    if shares & (shares - 1) == 0:  # power of two: one exact scaling, rint (ties to even)
        x *= _power_of_two(-exponent - (shares.bit_length() - 1))
        return np.rint(x, out=x)
    scaled = np.multiply(x, _power_of_two(-exponent), out=x)
    whole = np.floor(scaled)
    frac = scaled - whole  # exact, in [0, 1)
    quotient, rest = np.divmod(whole.astype(np.int64), shares)
    # round((whole + frac)/shares): up iff rest + frac > shares/2, i.e. frac > shares/2 - rest
    up = frac > (shares / 2.0 - rest)
    return (quotient + up).astype(np.float64)


def _snapped(
    values: dict[str, torch.Tensor], names: list[str], d: int, exponent: int, shares: int
) -> np.ndarray:
    """The flattened values in units of ``g = 2^exponent``, snapped to multiples of ``shares``
    (exact integers in a float array: float32 when every input is float32 and ``shares`` a
    power of two — scaling by a power of two and rounding to an integer are exact — float64
    otherwise). Refuses values that are not finite or reach ``2^52`` grid steps."""
    shift = -exponent - (shares.bit_length() - 1)
    low_precision = (
        shares & (shares - 1) == 0
        and -126 <= shift <= 127  # the scaling factor is a normal float32
        and all(values[k].dtype == torch.float32 for k in names)
    )
    flat = torch.empty(d, dtype=torch.float32 if low_precision else torch.float64)
    start = 0
    for k in names:
        numel = values[k].numel()
        flat[start : start + numel] = values[k].detach().reshape(-1)
        start += numel
    limit = 2.0**52 * math.ldexp(1.0, exponent)
    if d:
        low, high = (float(v) for v in torch.aminmax(flat))
        if not (-limit < low and high < limit):
            raise ValueError(
                f"Expected finite values below 2^52 grid steps ({limit:.3g}) for the Gaussian "
                f"mechanism, got values in [{low:.3g}, {high:.3g}]."
            )
    x = flat.numpy()
    if low_precision:  # |x|/g < 2^52 < 2^127: no overflow; underflow only rounds to 0 anyway
        x *= np.float32(_power_of_two(shift))
        q = np.rint(x, out=x)
    else:
        q = _snap(x, exponent, shares)
    if shares > 1:
        q *= shares
    return q


def gaussian_mechanism(
    values: dict[str, torch.Tensor],
    *,
    noise_multiplier: float,
    sensitivity: float,
    coins: Coins,
    shares: int = 1,
) -> dict[str, torch.Tensor]:
    """Releases ``values`` through the Gaussian mechanism with L2 sensitivity ``Δ`` and noise
    multiplier ``σ``, exactly (no floating-point caveat).

    Every coordinate is snapped to the grid ``S·g`` (``S = shares``, ``g = 2^e`` with
    ``e = floor(log2(σΔ/√S)) - 30``, :func:`grid_exponent`), and ``g·K`` is added, ``K`` from
    :func:`rounded_gaussian` with scale ``σΔ'/(√S·g)`` (rounded up), where
    ``Δ' = Δ + S²·g·√d`` and ``d`` is the number of coordinates.

    Guarantee (shares = 1): the released vector is ``snap(x) + round_g(Z)``,
    ``Z ~ N(0, σ²Δ'² I)``; as ``snap(x)`` is on the grid, this equals ``round_g(snap(x) + Z)``:
    a deterministic post-processing of the continuous Gaussian mechanism applied to
    ``snap(x)``. Snapping moves each input by at most ``g·√d/2`` in L2, so neighbouring inputs'
    snapped values differ by at most ``Δ + g·√d <= Δ'``: the release is at least as private as
    the Gaussian mechanism with noise multiplier ``σ`` at sensitivity ``Δ`` — what the
    accountant charges. The output reveals nothing of the input's bits below the grid.

    Guarantee (shares = S > 1, one of S parties whose messages are summed by secure
    aggregation): party ``s`` releases ``x̃_s + g·round(G_s/g)``, ``x̃_s ∈ S·g·ℤ`` (each
    party's snapping error is at most ``S·g·√d/2``, so the snapped sum has sensitivity at most
    ``Δ + S²·g·√d = Δ'``), ``G_s ~ N(0, σ²Δ'²/S)`` i.i.d. Write ``G = Σ G_s ~ N(0, σ²Δ'²)`` and
    ``u_s = G_s - G/S``: the ``u_s`` are independent of ``G`` and of the data. Then
    ``Σ_s (x̃_s + round_g(G_s)) = h_u(X̃ + G)`` with ``X̃ = Σ x̃_s ∈ S·g·ℤ`` and
    ``h_u(y) = Σ_s round_g(y/S + u_s)``, because ``h_u(y + S·g·m) = h_u(y) + S·g·m`` for
    integers ``m`` (rounding commutes with shifts by multiples of ``g``). So the sum is a
    post-processing, with data-independent randomness, of the Gaussian mechanism
    ``X̃ + N(0, σ²Δ'²)``: noise multiplier σ at sensitivity Δ (the argument of
    :mod:`silodp.crypto.encoding`). Every party must use the same public (σ, Δ, S, d).

    Returns float64 tensors, shaped as ``values``, whose entries are exact multiples of ``g``.
    Callers with ``shares > 1`` must sum the messages in float64 (exact, as long as the sum
    stays below ``2^53·g``) and cast afterwards; callers with ``shares = 1`` may cast to their
    dtype at once (post-processing).

    Raises:
      ValueError: ``noise_multiplier`` or ``sensitivity`` not finite and positive,
        ``shares < 1``, or a value so large that ``|value|/g >= 2^52`` (not exactly
        representable on the grid in float64), or non-finite.
    """
    sigma = _check_positive_finite("noise_multiplier", noise_multiplier)
    delta = _check_positive_finite("sensitivity", sensitivity)
    shares = check_int("shares", shares, 1)
    names = list(values)
    if not names:
        return {}
    d = sum(values[k].numel() for k in names)
    exponent = grid_exponent(sigma * delta / math.sqrt(shares))
    g = math.ldexp(1.0, exponent)
    widened = delta + shares * shares * g * math.sqrt(d)
    # float64 rounding of these few operations is far below the 2^-48 we round up by
    scale = sigma * widened / (math.sqrt(shares) * g) * (1.0 + 2.0**-48)
    grid = _snapped(values, names, d, exponent, shares)
    table = _table(_as_fraction(scale))
    noise, largest = _draw(table, d, coins)
    if max(table.reach, largest) >= 2**51:
        raise ValueError(
            f"Expected the noise to stay below 2^51 grid steps, got {max(table.reach, largest)}."
        )
    total = np.empty(d, dtype=np.float64)
    for start in range(0, d, CHUNK):  # in cache-sized pieces
        part = total[start : start + CHUNK]
        np.add(grid[start : start + CHUNK], noise[start : start + CHUNK], out=part)  # exact
        part *= g
    out_flat = torch.from_numpy(total)
    out: dict[str, torch.Tensor] = {}
    start = 0
    for k in names:
        numel = values[k].numel()
        out[k] = out_flat[start : start + numel].view(values[k].shape)
        start += numel
    return out


def _check_positive_finite(name: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"Expected {name}={value!r} to be a finite number > 0.")
    return float(value)
