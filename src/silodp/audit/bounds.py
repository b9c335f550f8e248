"""Empirical lower bounds on ε from an attack's guesses: the statistics only (numpy/scipy).

Two designs:

* **One training run** (Steinke, Nasr & Jagielski, NeurIPS 2023). ``m`` canaries are each
  included independently with probability ½; the attacker guesses "in" or "out" for ``r`` of
  them (abstaining on the rest) and gets ``v`` right. If the mechanism is (ε, δ)-DP with respect
  to each canary, ``P[V ≥ v] ≤ P[Binomial(r, e^ε/(1+e^ε)) ≥ v] + 2·m·δ·α`` with
  ``α = max_{1≤i≤v} P[v-i ≤ Binomial(r, e^ε/(1+e^ε)) < v] / i`` (their Theorem 5.2).
  :func:`one_run_epsilon` returns the largest ε this rejects at the given significance: the
  mechanism is not (ε, δ)-DP, with confidence ``1 - significance``.
* **Many runs** (Jagielski, Ullman & Oprea 2020). Each run includes one canary with
  probability ½; a threshold on the attack's score gives false-positive and false-negative
  rates whose Clopper–Pearson upper bounds give ``ε ≥ log((1 - δ - FNR⁺) / FPR⁺)``, or the
  same with the two rates swapped, whichever is larger (:func:`clopper_pearson_epsilon`).

Both are lower bounds that hold whatever the attack is; a weak attack only makes them small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from silodp._validation import check_int, check_probability
from silodp.errors import InvalidValueError

__all__ = [
    "Guesses",
    "best_one_run_epsilon",
    "clopper_pearson_epsilon",
    "one_run_epsilon",
    "one_run_p_value",
    "split_threshold_epsilon",
]

#: the largest ε the searches consider (far beyond anything a finite audit can show)
EPSILON_CAP = 50.0


def _check_counts(m: int, r: int, v: int) -> None:
    check_int("m", m, 1)
    check_int("r", r, 0)
    check_int("v", v, 0)
    if not v <= r <= m:
        raise InvalidValueError(f"Expected correct <= guesses <= canaries, got {v}, {r}, {m}.")


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The largest probability, under any (ε, δ)-DP mechanism, of ``v`` or more correct
    guesses out of ``r`` among ``m`` canaries each included with probability ½."""
    _check_counts(m, r, v)
    check_probability("delta", delta, allow_zero=True)
    if v == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))  # accuracy of ε-DP randomised response
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[= v-1], P[= v-2], ...
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, beta + 2.0 * m * delta * alpha)


def one_run_epsilon(m: int, r: int, v: int, delta: float, significance: float) -> float:
    """The largest ε at which ``v`` correct of ``r`` guesses (``m`` canaries) rejects
    (ε, δ)-DP at ``significance`` (0 when nothing is rejected)."""
    check_probability("significance", significance)
    if one_run_p_value(m, r, v, 0.0, delta) >= significance:
        return 0.0
    lo, hi = 0.0, EPSILON_CAP
    if one_run_p_value(m, r, v, hi, delta) < significance:
        return hi
    for _ in range(40):  # p-value increases with ε: bisect the boundary (to 5e-11)
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) < significance:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Guesses:
    """One guess rule's outcome: ``positive`` "in" and ``negative`` "out" guesses, ``correct``
    of them right, and the ε lower bound they give."""

    positive: int
    negative: int
    correct: int
    epsilon: float

    @property
    def guesses(self) -> int:
        return self.positive + self.negative


def guess_counts(m: int) -> list[tuple[int, int]]:
    """The (positive, negative) guess counts tried on ``m`` canaries, fixed before any score is
    seen: 1%, 2%, 5%, 10%, 20%, 30% and 50% of the canaries, half from the top of the scores
    and half from the bottom (1% of 1,000: the top 5 and the bottom 5), and the top alone at
    1%, 5% and 10%."""
    pairs: list[tuple[int, int]] = []
    for frac in (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5):
        k = max(1, int(m * frac / 2))
        pairs.append((k, k))
    for frac in (0.01, 0.05, 0.1):
        pairs.append((max(1, int(m * frac)), 0))
    return sorted(set(pairs))


def best_one_run_epsilon(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    significance: float = 0.05,
    counts: Sequence[tuple[int, int]] | None = None,
) -> Guesses:
    """The best ε lower bound over the guess rules ``counts`` (default :func:`guess_counts`):
    guess "in" for the ``positive`` highest scores and "out" for the ``negative`` lowest. The
    rules are chosen without the inclusion bits and the significance is split over them
    (Bonferroni), so the bound reported holds at ``1 - significance`` overall."""
    s = np.asarray(scores, dtype=float)
    inc = np.asarray(included, dtype=bool)
    m = len(s)
    if m == 0 or inc.shape != s.shape:
        raise InvalidValueError(
            f"Expected one inclusion bit per score, got {inc.shape} for {s.shape}."
        )
    if not np.all(np.isfinite(s)):
        raise InvalidValueError("Expected finite attack scores.")
    counts = list(counts) if counts is not None else guess_counts(m)
    order = np.argsort(-s, kind="stable")  # highest first; ties keep canary order
    each = significance / len(counts)
    best: Guesses | None = None
    for pos, neg in counts:
        if pos + neg > m:
            continue
        correct = int(inc[order[:pos]].sum()) + int((~inc[order[m - neg :]]).sum() if neg else 0)
        eps = one_run_epsilon(m, pos + neg, correct, delta, each)
        if best is None or eps > best.epsilon:
            best = Guesses(pos, neg, correct, eps)
    assert best is not None
    return best


def _cp_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper–Pearson upper bound on a rate from ``k`` of ``n`` at level ``alpha``."""
    if n == 0 or k >= n:
        return 1.0
    return float(stats.beta.ppf(1 - alpha, k + 1, n - k))


def clopper_pearson_epsilon(
    false_positives: int,
    negatives: int,
    false_negatives: int,
    positives: int,
    *,
    delta: float,
    significance: float = 0.05,
) -> float:
    """``max(0, log((1 - δ - FNR⁺) / FPR⁺), log((1 - δ - FPR⁺) / FNR⁺))`` with each rate's
    Clopper–Pearson upper bound at ``significance / 2`` (both hold at ``1 - significance``)."""
    check_probability("delta", delta, allow_zero=True)
    fpr = _cp_upper(false_positives, negatives, significance / 2)
    fnr = _cp_upper(false_negatives, positives, significance / 2)
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        if b > 0 and 1 - delta - a > 0:
            best = max(best, math.log((1 - delta - a) / b))
    return best


def split_threshold_epsilon(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    significance: float = 0.05,
) -> tuple[float, float]:
    """The many-runs bound: the first half of the runs picks the threshold (the one whose
    Clopper–Pearson bound is largest there), the second half is scored at it, so the
    confidence is not spent on the choice. Returns ``(ε lower bound, threshold)``."""
    s = np.asarray(scores, dtype=float)
    inc = np.asarray(included, dtype=bool)
    half = len(s) // 2
    if half < 2:
        raise InvalidValueError(f"Expected at least 4 runs for a many-runs audit, got {len(s)}.")

    def bound(sc: np.ndarray, ic: np.ndarray, t: float) -> float:
        guess = sc > t
        return clopper_pearson_epsilon(
            int((guess & ~ic).sum()),
            int((~ic).sum()),
            int((~guess & ic).sum()),
            int(ic.sum()),
            delta=delta,
            significance=significance,
        )

    first_s, first_i = s[:half], inc[:half]
    candidates = np.unique(first_s)
    threshold = max(candidates, key=lambda t: bound(first_s, first_i, float(t)))
    return bound(s[half:], inc[half:], float(threshold)), float(threshold)
