"""Exact comparisons against the Gaussian CDF, in arbitrary precision (mpmath).

The rare undecided steps of the rounded-Gaussian sampler (:mod:`silodp.privacy.rounded_gaussian`)
end here: a uniform known through a prefix of its bits (:class:`_Lazy`) is compared with a value
of the CDF or a ratio of rounded-Gaussian masses, computed with a rigorous error bound at
increasing precision, and its bits are extended from the coins until the comparison is decided.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath

from silodp.privacy.randomness import Coins


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
