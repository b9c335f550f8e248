"""ε(δ) of a dp-accounting PLD, read from its PMFs with array operations.

dp-accounting's ``get_epsilon_for_delta`` walks the loss grid in a Python loop (one
``math.exp`` per grid point). A composed PLD has millions of points, and the dp-group route asks
for ε at hundreds of δ, so that loop dominated ``silodp account`` for long plans (20 s of 34 s
at 10⁸ steps). :class:`EpsilonForDelta` computes the same quantity from the same PMFs: the
running masses are cumulative sums in the library's order, the stopping point is the first
grid point where the library's loop stops, and the result is the library's formula, so it is
the same upper bound (``tests/accounting/test_hockey.py`` compares the two on every kind of
PLD silodp builds). Nothing is re-derived: the PMFs are dp-accounting's, pessimistic as built.
The stopping point is found by a binary search on δ(ε) at the grid's losses (which never
decreases along the loop) and confirmed by the library's own test in a window around it, so a
query costs O(log n) after one O(n) pass; the dp-group route asks for hundreds of δ per round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

__all__ = ["EpsilonForDelta", "epsilon_for_delta"]

#: grid points either side of the binary search's answer where the library's test is checked
_WINDOW = 64


class _PmfCurve:
    """One PMF's losses (descending) and the library's running masses above each loss."""

    def __init__(self, pmf: pld_pmf.PLDPmf) -> None:
        self.infinity_mass = float(pmf._infinity_mass)  # noqa: SLF001 - the PMF's own fields
        if isinstance(pmf, pld_pmf.DensePLDPmf):
            probs = np.flip(np.asarray(pmf._probs, dtype=float))  # noqa: SLF001
            upper = (pmf._lower_loss + len(probs) - 1) * pmf._discretization  # noqa: SLF001
            # itertools.count(upper, -d) adds -d repeatedly: a sequential cumulative sum
            steps = np.full(len(probs), -pmf._discretization)  # noqa: SLF001
            steps[0] = upper
            losses = np.cumsum(steps)
        else:
            keys = sorted(pmf._loss_probs, reverse=True)  # noqa: SLF001
            probs = np.array([pmf._loss_probs[k] for k in keys], dtype=float)  # noqa: SLF001
            losses = np.array([k * pmf._discretization for k in keys], dtype=float)  # noqa: SLF001
        self.losses = losses
        # masses strictly above losses[j] (index j) and after all of them (index n)
        self.upper = np.cumsum(np.concatenate([[self.infinity_mass], probs]))
        self.lower = np.cumsum(np.concatenate([[0.0], np.exp(-losses) * probs]))
        n = len(losses)
        # δ at ε = losses[j] from the same masses (nondecreasing in j): where the library's
        # loop stops for a given δ, up to rounding; made monotone for a binary search
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            at_loss = self.upper[:n] - np.exp(losses + np.log(self.lower[:n]))
        self._at_loss = np.maximum.accumulate(np.nan_to_num(at_loss, nan=-np.inf))
        #: indices j whose mass below exp(-loss) is zero (the library's underflow exit)
        self._zero_lower = np.flatnonzero(self.lower[1:] == 0)

    def _stops(self, delta: float, lo: int, hi: int) -> np.ndarray:
        """The library's stopping test at grid points ``lo..hi-1``."""
        upper, lower = self.upper[lo:hi], self.lower[lo:hi]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return (
                (upper > delta)
                & (lower > 0)
                & (np.log((upper - delta) / lower) >= self.losses[lo:hi])
            )

    def _stop_index(self, delta: float) -> int:
        """The first grid point where the library's loop stops (``n``: none). The test is
        made where the monotone δ(loss) crosses ``delta``; it is accepted when a window there
        shows the test turning from false to true, else every point is tested."""
        n = len(self.losses)
        guess = int(np.searchsorted(self._at_loss, delta, side="left"))
        lo, hi = max(0, guess - _WINDOW), min(n, guess + _WINDOW)
        stop = self._stops(delta, lo, hi)
        if stop.any() and (lo == 0 or not stop[0]):
            return lo + int(np.argmax(stop))
        stop = self._stops(delta, 0, n)
        return int(np.argmax(stop)) if stop.any() else n

    def _stop_indices(self, deltas: np.ndarray) -> list[int]:
        """:meth:`_stop_index` of each of ``deltas``, the windows tested side by side."""
        n = len(self.losses)
        if n == 0:
            return [0] * len(deltas)
        guess = np.searchsorted(self._at_loss, deltas, side="left")
        lo = np.maximum(guess - _WINDOW, 0)
        index = lo[:, None] + np.arange(2 * _WINDOW)[None, :]
        inside = index < n
        index = np.minimum(index, n - 1)
        upper, lower, column = self.upper[index], self.lower[index], deltas[:, None]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            stop = (
                inside
                & (upper > column)
                & (lower > 0)
                & (np.log((upper - column) / lower) >= self.losses[index])
            )
        found = stop.any(axis=1) & ((lo == 0) | ~stop[:, 0])
        first = lo + np.argmax(stop, axis=1)
        return [
            int(first[i]) if found[i] else self._stop_index(float(deltas[i]))
            for i in range(len(deltas))
        ]

    def epsilons(self, deltas: np.ndarray) -> list[float]:
        """:meth:`epsilon` of each of ``deltas`` (the same values, found together)."""
        return [
            self.epsilon(float(delta), stop)
            for delta, stop in zip(deltas, self._stop_indices(deltas), strict=True)
        ]

    def epsilon(self, delta: float, stop: int | None = None) -> float:
        if self.infinity_mass > delta:
            return math.inf
        j = self._stop_index(delta) if stop is None else stop
        # the library returns early where the mass below exp(-loss) underflowed to zero
        zero = self._zero_lower[self._zero_lower < j]
        underflow = zero[self.upper[1:][zero] >= delta]
        if len(underflow):
            return max(0.0, float(self.losses[int(underflow[0])]))
        mass_upper, mass_lower = float(self.upper[j]), float(self.lower[j])
        if mass_upper <= mass_lower + delta:
            return 0.0
        return math.log((mass_upper - delta) / mass_lower)


class EpsilonForDelta:
    """``pld.get_epsilon_for_delta`` as a callable that reads the PLD once and answers every δ
    in time linear in the PMF's size with array operations."""

    def __init__(self, pld: pld_lib.PrivacyLossDistribution) -> None:
        self._curves = [_PmfCurve(pld._pmf_remove)]  # noqa: SLF001
        if not pld._symmetric:  # noqa: SLF001
            self._curves.append(_PmfCurve(pld._pmf_add))  # noqa: SLF001

    def __call__(self, delta: float) -> float:
        return max(curve.epsilon(delta) for curve in self._curves)

    def many(self, deltas: Sequence[float]) -> list[float]:
        """``[self(d) for d in deltas]``, computed together (the dp-group route asks for
        hundreds of δ at once)."""
        values = np.asarray(deltas, dtype=np.float64)
        per_curve = [curve.epsilons(values) for curve in self._curves]
        return [max(column) for column in zip(*per_curve, strict=True)]


def epsilon_for_delta(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    """The smallest ε whose hockey-stick divergence of ``pld`` is at most ``delta`` (the same
    value as ``pld.get_epsilon_for_delta(delta)``)."""
    return EpsilonForDelta(pld)(delta)
