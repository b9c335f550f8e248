"""The exact sampler of the rounded Gaussian ``round(N(0, s²))``: :func:`rounded_gaussian`.

Two stages: the coarse cell by inversion of a uniform through the table of
:mod:`silodp.privacy.cdf_table`, then the point inside the cell by rejection; the rare
comparisons that float64 and fixed point leave undecided are settled exactly in arbitrary
precision (:mod:`silodp.privacy.exact_cdf`). Scales above ``2^100`` split off an exact coarse
sample (:func:`_wide_rounded_gaussian`).

All randomness comes from a :class:`~silodp.privacy.randomness.Coins`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

from silodp._validation import check_int
from silodp.privacy.cdf_table import (
    _INT64_SAFE,
    BOUNDARY_BITS,
    GUIDE_BITS,
    _margin,
    _ratio,
    _Table,
    _table,
)
from silodp.privacy.exact_cdf import _accept_exact, _below_cdf, _Lazy, _mp
from silodp.privacy.randomness import Coins

__all__ = ["rounded_gaussian"]

#: Samples drawn per vectorised pass: temporaries stay in cache and are reused by the
#: allocator instead of being faulted in afresh (a measured ~2x on 6.6M samples).
CHUNK = 1 << 18


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
