"""f-DP trade-off functions and the privacy loss distributions of PriFedSync's steps.

The mathematics behind :mod:`silodp.accounting.fdp`: Gaussian and sub-sampled trade-off
functions (Dong, Roth & Su 2019), their conversion to dp-accounting PLDs through a piecewise-
linear lower envelope on the PLD grid, the pessimistic PLD and RDP of one NoisySGD step under
replacement adjacency, and the CLT μ estimates of the paper's Theorem 2.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import optimize, stats

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_positive,
    check_probability,
)
from silodp.accounting.conversions import gdp_epsilon, rdp_curve
from silodp.accounting.hockey import epsilon_for_delta

__all__ = [
    "BATCH_SAMPLING",
    "client_sampled_epsilon",
    "client_sampled_tradeoff",
    "clt_mu",
    "composed_client_sampled_tradeoff",
    "subsampled_tradeoff",
    "tradeoff_gaussian",
    "tradeoff_pld",
]

BATCH_SAMPLING = ("uniform", "poisson")
DISCRETIZATION = 1e-3
# the CLT estimates' per-round losses are small (μ/√R), so they need a finer grid to stay close
ESTIMATE_DISCRETIZATION = 1e-4
MAX_TANGENTS = 20_000
FLOAT_SLACK = 1e-12
# beyond this μ, G_μ is (numerically) no privacy at any useful δ; estimates report inf
MAX_ESTIMATE_MU = 40.0


# ----------------------------------------------------------------------------- CLT μ


def clt_mu(
    noise_multiplier: float, sample_rate: float, steps: int, *, batch_sampling: str = "uniform"
) -> float:
    """CLT μ of ``steps`` sub-sampled NoisySGD steps (an estimate, not a bound).

    Uniform batches (DRS19 Cor. 5.4, the paper's Theorem 2):
    ``√2·c·sqrt(e^{σ^-2}Φ(1.5/σ) + 3Φ(-0.5/σ) - 2)``; Poisson batches (Bu et al. 2020):
    ``c·sqrt(e^{σ^-2} - 1)``; ``c = q·√steps``. Same values as Opacus' ``compute_mu_uniform`` /
    ``compute_mu_poisson``.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("sample_rate", sample_rate, allow_zero=True)
    check_int("steps", steps, 0)
    check_choice("batch_sampling", batch_sampling, BATCH_SAMPLING)
    c = q * math.sqrt(steps)
    if c == 0.0:
        return 0.0
    if sigma**-2 > MAX_EXP:  # e^{σ^-2} overflows a float: an estimate without bound
        return math.inf
    if batch_sampling == "poisson":
        return c * math.sqrt(math.expm1(sigma**-2))
    inner = (
        math.exp(sigma**-2) * stats.norm.cdf(1.5 / sigma) + 3.0 * stats.norm.cdf(-0.5 / sigma) - 2.0
    )
    return math.sqrt(2.0) * c * math.sqrt(max(inner, 0.0))


#: the largest x with e^x a finite float (``math.exp`` overflows above it)
MAX_EXP = math.log(sys.float_info.max)


def _gdp_epsilon_or_zero(mu: float, delta: float) -> float:
    if mu <= 0.0:
        return 0.0
    return math.inf if mu > MAX_ESTIMATE_MU else gdp_epsilon(mu, delta)


# ----------------------------------------------------------------------------- trade-off functions


def tradeoff_gaussian(mu: float, alphas: np.ndarray) -> np.ndarray:
    """``G_μ(α) = Φ(Φ^{-1}(1-α) - μ)``, the trade-off of ``N(0,1)`` vs ``N(μ,1)``."""
    check_in_range("mu", mu, 0.0, math.inf, hi_open=True)
    a = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)
    return np.asarray(stats.norm.cdf(stats.norm.isf(a) - mu), dtype=np.float64)


def client_sampled_tradeoff(mu: float, p: float, alphas: np.ndarray) -> np.ndarray:
    """One round with client sampling, the paper's Lemma 3.8: ``max(G_μ(α), 1 - α - p²)``."""
    check_probability("p", p, allow_zero=True)
    a = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)
    return np.maximum(tradeoff_gaussian(mu, a), 1.0 - a - p * p)


def subsampled_tradeoff(noise_multiplier: float, q: float, alphas: np.ndarray) -> np.ndarray:
    """``C_q(G_{1/σ})(α)``: one NoisySGD step on a fixed-size batch (DRS19, Thm 4.2).

    ``f_q = q·G_{1/σ} + (1-q)·Id`` on ``[0, α*]`` with ``α* = Φ(-1/(2σ))`` (where its slope
    is -1), the segment of slope -1 to the mirror point, and ``f_q^{-1}`` after it.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("q", q, allow_zero=True)
    mu0 = 1.0 / sigma
    a = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)

    def f_q(x: np.ndarray) -> np.ndarray:
        return np.asarray(q * tradeoff_gaussian(mu0, x) + (1.0 - q) * (1.0 - x))

    a_star = float(stats.norm.cdf(-mu0 / 2.0))
    b_star = float(f_q(np.array([a_star]))[0])
    out = np.empty_like(a)
    left = a <= a_star
    right = a >= b_star
    mid = ~left & ~right
    out[left] = f_q(a[left])
    out[mid] = a_star + b_star - a[mid]
    # f_q^{-1}(α) = the t with f_q(t) = α; f_q is strictly decreasing on [0, α*]
    for i in np.flatnonzero(right):
        target = a[i]
        if target >= 1.0:
            out[i] = 0.0
            continue
        out[i] = optimize.brentq(
            lambda x, level=target: float(f_q(np.array([x]))[0]) - level, 0.0, a_star
        )
    return out


# ----------------------------------------------------------------------------- trade-off → PLD


@dataclass(frozen=True)
class _Tangents:
    """Supporting lines ``y = b + s(x - a)`` of a symmetric trade-off, ``s = -e^{label·d}``.

    ``labels`` are the privacy losses ``log(-s)`` in units of the PLD grid ``d``: the lines sit
    exactly on the grid, so building the PLD needs no rounding (this is dp-accounting's
    "connect the dots" discretisation, seen from the trade-off side: ``δ(kd)`` is exact).
    """

    a: np.ndarray
    b: np.ndarray
    labels: np.ndarray


def _loss_grid(l_max: float, spacing: float) -> np.ndarray:
    """Integer losses ``0, k, 2k, …`` (units of ``spacing``) reaching ``l_max``, at most
    ``MAX_TANGENTS`` of them."""
    n = math.ceil(l_max / spacing)
    stride = max(1, math.ceil(n / MAX_TANGENTS))
    return np.arange(0, n + stride, stride, dtype=np.int64)


def _gaussian_tangents(mu: float, spacing: float) -> _Tangents:
    """Tangents of ``G_μ`` at thresholds ``t ≥ μ/2`` (the test rejects N(0,1) when x > t)."""
    t_max = mu + 9.0
    labels = _loss_grid(mu * t_max - mu * mu / 2.0, spacing)
    t = (labels * spacing + mu * mu / 2.0) / mu
    return _Tangents(stats.norm.sf(t), stats.norm.cdf(t - mu), labels)


def _subsampled_tangents(noise_multiplier: float, q: float, spacing: float) -> _Tangents:
    """Tangents of ``f_q`` (hence of ``C_q(G_{1/σ})``) where its slope is ≤ -1."""
    mu0 = 1.0 / noise_multiplier
    t_max = mu0 + 9.0
    l_max = float(np.logaddexp(math.log1p(-q), math.log(q) + mu0 * t_max - mu0 * mu0 / 2.0))
    labels = _loss_grid(l_max, spacing)
    losses = labels * spacing
    # e^l = (1-q) + q e^{μ0 t - μ0²/2}, solved for t without overflow
    log_excess = losses + np.log1p(-(1.0 - q) * np.exp(-losses)) - math.log(q)
    t = (np.maximum(log_excess, 0.0) + mu0 * mu0 / 2.0) / mu0
    beta = (1.0 - q) * stats.norm.cdf(t) + q * stats.norm.cdf(t - mu0)
    return _Tangents(stats.norm.sf(t), beta, labels)


@dataclass(frozen=True)
class _Envelope:
    """Vertices ``(xs, ys)`` of a piecewise-linear trade-off on ``[0, 1]``; segment ``j`` has
    privacy loss ``labels[j]·d`` (``None`` on ``y = 0``, where only the null distribution
    has mass)."""

    xs: np.ndarray
    ys: np.ndarray
    labels: list[int | None]


def _upper_envelope(
    slopes: np.ndarray, intercepts: np.ndarray, labels: list[int | None]
) -> _Envelope:
    """``max_i (slopes_i·x + intercepts_i)`` on ``[0, 1]`` (convex hull trick)."""
    order = np.lexsort((intercepts, slopes))
    stack: list[int] = []
    for i in order.tolist():
        m, c = slopes[i], intercepts[i]
        if stack and slopes[stack[-1]] == m:
            stack.pop()  # same slope: the later one in the sort has the larger intercept
        while len(stack) >= 2:
            m1, c1 = slopes[stack[-2]], intercepts[stack[-2]]
            m2, c2 = slopes[stack[-1]], intercepts[stack[-1]]
            # the top line is redundant if the new one overtakes line 1 before it does
            if (c - c1) * (m2 - m1) >= (c2 - c1) * (m - m1):
                stack.pop()
            else:
                break
        stack.append(i)
    ms, cs = slopes[stack], intercepts[stack]
    # line i of the stack is on top between cross[i-1] and cross[i]; crossings increase
    cross = (cs[:-1] - cs[1:]) / (ms[1:] - ms[:-1])
    first = int(np.searchsorted(cross, 0.0, side="right"))  # on top at x = 0
    last = int(np.searchsorted(cross, 1.0, side="left"))  # on top at x = 1
    inner = np.arange(first, last)
    xs = np.concatenate([[0.0], cross[inner], [1.0]])
    ys = np.concatenate([[cs[first]], ms[inner] * cross[inner] + cs[inner], [ms[last] + cs[last]]])
    return _Envelope(xs, np.maximum(ys, 0.0), [labels[stack[j]] for j in range(first, last + 1)])


def _envelope(
    tangents: _Tangents, spacing: float, extra_intercept: float | None = None
) -> _Envelope:
    """The symmetric piecewise-linear lower bound built from ``tangents``.

    Uses the tangents, their mirror images (tangents of the inverse function, loss ``-l``), the
    line ``1 - α - extra`` when given (slope -1, loss 0) and ``y = 0``. Every line lies below
    the trade-off function, so their maximum does too: the bound errs on the pessimistic side.
    """
    a, b = tangents.a, tangents.b
    s = -np.exp(tangents.labels * spacing)
    slopes = [s, 1.0 / s]
    intercepts = [b - s * a, a - b / s]
    labels: list[int | None] = [*tangents.labels.tolist(), *(-tangents.labels).tolist()]
    if extra_intercept is not None:
        slopes.append(np.array([-1.0]))
        intercepts.append(np.array([extra_intercept]))
        labels.append(0)
    slopes.append(np.array([0.0]))
    intercepts.append(np.array([0.0]))
    labels.append(None)
    return _upper_envelope(np.concatenate(slopes), np.concatenate(intercepts), labels)


def _pair_pld(envelope: _Envelope, discretization: float) -> pld_lib.PrivacyLossDistribution:
    """PLD of the discrete pair ``(P, Q)`` whose trade-off is the envelope.

    Segment ``j`` is one outcome with ``P = Δx``, ``Q = -Δy`` and loss ``log(Q/P) = label·d``;
    the gap ``1 - y_0`` at α = 0 is an outcome only ``Q`` produces and the segment on ``y = 0``
    one only ``P`` produces. ``T(P, Q)`` is exactly the envelope (Neyman–Pearson). Both
    directions are kept, so nothing relies on the envelope being symmetric.
    """
    dx = np.diff(envelope.xs)
    dy = -np.diff(envelope.ys)
    remove: dict[int, float] = {}
    add: dict[int, float] = {}
    # FLOAT_SLACK absorbs floating-point error in the vertices (it only raises δ)
    infinity_remove = max(0.0, 1.0 - float(envelope.ys[0])) + FLOAT_SLACK
    infinity_add = FLOAT_SLACK
    for px, qy, label in zip(dx.tolist(), dy.tolist(), envelope.labels, strict=True):
        if label is None:
            infinity_add += px
            continue
        remove[label] = remove.get(label, 0.0) + qy
        add[-label] = add.get(-label, 0.0) + px
    return pld_lib.PrivacyLossDistribution.create_from_rounded_probability(
        remove,
        infinity_remove,
        discretization,
        pessimistic_estimate=True,
        rounded_probability_mass_function_add=add,
        infinity_mass_add=infinity_add,
        symmetric=False,
    )


def tradeoff_pld(
    mu: float, *, p: float = 1.0, discretization: float = DISCRETIZATION
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of ``max(G_μ, 1 - α - p²)`` (``G_μ`` when ``p = 1``)."""
    check_positive("mu", mu)
    check_probability("p", p, allow_zero=True)
    extra = 1.0 - p * p if p < 1.0 else None
    envelope = _envelope(_gaussian_tangents(mu, discretization), discretization, extra)
    return _pair_pld(envelope, discretization)


def composed_client_sampled_tradeoff(
    mu: float, p: float, rounds: int, alphas: np.ndarray, *, discretization: float = DISCRETIZATION
) -> np.ndarray:
    """A lower bound on ``max(G_μ, 1 - α - p²)^{⊗R}`` at ``alphas`` (Theorem 1's trade-off).

    The ``R``-fold composition of the pessimistic PLD gives ``δ(ε)``; each ``ε`` yields the
    valid line ``1 - δ(ε) - e^ε α``; their maximum over a grid of ε is returned.
    """
    check_int("rounds", rounds, 1)
    pld = tradeoff_pld(mu, p=p, discretization=discretization).self_compose(rounds)
    a = np.clip(np.asarray(alphas, dtype=np.float64), 0.0, 1.0)
    positive = np.geomspace(1e-4, 30.0, 200)
    eps_grid = np.concatenate([-positive[::-1], [0.0], positive])
    best = np.zeros_like(a)
    for eps in eps_grid:
        delta = float(pld.get_delta_for_epsilon(float(eps)))
        best = np.maximum(best, 1.0 - delta - math.exp(eps) * a)
    return np.minimum(best, 1.0 - a)


def client_sampled_epsilon(
    mu: float, p: float, rounds: int, delta: float, *, discretization: float = DISCRETIZATION
) -> float:
    """ε at ``delta`` of ``max(G_μ, 1 - α - p²)^{⊗R}`` (Theorem 1 with CLT per-round μ)."""
    check_int("rounds", rounds, 1)
    check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
    pld = tradeoff_pld(mu, p=p, discretization=discretization).self_compose(rounds)
    return epsilon_for_delta(pld, delta)


# ----------------------------------------------------------------------------- rigorous steps


@lru_cache(maxsize=64)
def _step_pld(
    noise_multiplier: float, q: float, batch_sampling: str, discretization: float
) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of one local step (replacement adjacency)."""
    if batch_sampling == "poisson":
        # noise std 2Cσ; with Poisson sampling the replaced record's gradient moves the sum by
        # at most C from the rest of the batch in either dataset (dp-accounting REPLACE_ONE)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=2.0 * noise_multiplier,
            sensitivity=1.0,
            sampling_prob=q,
            value_discretization_interval=discretization,
            neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE,
        )
    if q >= 1.0:
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=noise_multiplier, value_discretization_interval=discretization
        )
    envelope = _envelope(_subsampled_tangents(noise_multiplier, q, discretization), discretization)
    return _pair_pld(envelope, discretization)


@lru_cache(maxsize=64)
def _round_pld(
    noise_multiplier: float, q: float, steps: int, batch_sampling: str, discretization: float
) -> pld_lib.PrivacyLossDistribution:
    return _step_pld(noise_multiplier, q, batch_sampling, discretization).self_compose(steps)


#: the source size of :func:`_step_rdp`'s sampling event: q is represented on this grid
_RATE_GRID = 10**12


@lru_cache(maxsize=64)
def _step_rdp(noise_multiplier: float, q: float, batch_sampling: str) -> np.ndarray | None:
    """RDP of one step from dp-accounting (uniform batches only), or None."""
    if batch_sampling != "uniform":
        return None
    # source size / sample size only matter through their ratio, which is q rounded *up*
    # (a larger rate only adds privacy loss; rounding to nearest could drop a small q to 0)
    size = _RATE_GRID
    event = dp_event.SampledWithoutReplacementDpEvent(
        size, min(size, math.ceil(q * size)), dp_event.GaussianDpEvent(noise_multiplier)
    )
    return rdp_curve(event, replace_one=True)
