"""Conversions dp-accounting does not provide: group privacy and Gaussian DP.

* RDP group privacy (Mironov 2017, Prop. 2): if a mechanism is (α, ε)-RDP and α >= 2^{c+1},
  it is (α/2^c, 3^c ε)-RDP for groups of 2^c records (a group of k <= 2^c is covered).
* (ε, δ) group privacy (Dwork & Roth 2014, Thm 2.2): (ε, δ)-DP gives
  (kε, k e^{(k-1)ε} δ)-DP for groups of k.
* μ-GDP (Dong, Roth & Su 2019): δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import optimize, special, stats

from silodp._validation import check_in_range, check_int, check_positive

__all__ = [
    "RDP_ORDERS",
    "gdp_delta",
    "gdp_epsilon",
    "group_epsilon_dp",
    "rdp_curve",
    "rdp_epsilon",
    "rdp_group_curve",
]

# Dense at small orders (where single records are tight; steps of 0.5 up to 10 keep an ε
# evaluation fast, within ~3% of a 0.1 grid) and long enough that orders
# divided by a group's 2^c still reach the useful range.
RDP_ORDERS: np.ndarray = np.unique(
    np.concatenate(
        [
            [1.1, 1.25, 1.5, 1.75],
            np.arange(2.0, 10.0, 0.5),
            np.arange(10.0, 64.0),
            np.round(np.geomspace(64.0, 2048.0, 16)),
        ]
    )
)


def rdp_curve(
    event: dp_event.DpEvent, orders: np.ndarray | None = None, *, replace_one: bool = False
) -> np.ndarray:
    """RDP ε(α) of ``event`` at ``orders`` (default ``RDP_ORDERS``), add/remove adjacency
    (or replace-one with ``replace_one``)."""
    if orders is None and not replace_one:
        return _default_curve(event).copy()
    chosen = RDP_ORDERS if orders is None else orders
    return _compute_curve(event, tuple(float(a) for a in chosen), replace_one=replace_one)


@lru_cache(maxsize=1024)
def _default_curve(event: dp_event.DpEvent) -> np.ndarray:
    return _compute_curve(event, tuple(float(a) for a in RDP_ORDERS))


def _compute_curve(
    event: dp_event.DpEvent, orders: tuple[float, ...], *, replace_one: bool = False
) -> np.ndarray:
    """dp-accounting's RDP of ``event`` at ``orders`` (add/remove adjacency, or replace-one),
    with silodp's own events (:func:`_own_curve`) inside it."""
    own = _own_curve(event, orders, replace_one=replace_one)
    if own is not None:
        return own
    relation = (
        rdp_lib.NeighborRel.REPLACE_ONE if replace_one else rdp_lib.NeighborRel.ADD_OR_REMOVE_ONE
    )
    accountant = rdp_lib.RdpAccountant(orders=list(orders), neighboring_relation=relation)
    with _quiet():
        accountant.compose(event)
    return np.array(accountant._rdp, dtype=np.float64)  # noqa: SLF001 - checked by tests


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting logs every fractional order its series cannot evaluate (it then uses
    +inf there, which is safe); those messages are noise for silodp users."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl_logger.setLevel(level)


def _own_curve(
    event: dp_event.DpEvent, orders: tuple[float, ...], *, replace_one: bool
) -> np.ndarray | None:
    """RDP of an event holding silodp's own events (which dp-accounting does not know), or
    None if it holds none; compositions add up, the other parts through dp-accounting.

    * :class:`~silodp.accounting.events.KnownSampleDpEvent` is the mixture
      ``(qP + (1-q)⊥, qP' + (1-q)⊥)`` with ``⊥`` distinguishable, whose Rényi divergence is
      exactly ``log(q·e^{(α-1)ρ(α)} + 1 - q)/(α-1)`` for the inner curve ρ.
    * :class:`~silodp.accounting.events.PoissonReplaceOneDpEvent`: replacing one record is
      adding one and removing another, a distance of 2 in add/remove adjacency, so Mironov's
      group privacy (Prop. 2, groups of 2) bounds it: at order β >= 2, ``3 ε(2β)`` for the
      add/remove curve ε of the same sub-sampled Gaussian; +inf below.
    """
    from silodp.accounting.events import KnownSampleDpEvent, PoissonReplaceOneDpEvent

    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = _own_curve(event.event, orders, replace_one=replace_one)
        return None if inner is None else event.count * inner
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [_own_curve(e, orders, replace_one=replace_one) for e in event.events]
        if all(p is None for p in parts):
            return None
        return np.sum(
            [
                p if p is not None else _compute_curve(e, orders, replace_one=replace_one)
                for p, e in zip(parts, event.events, strict=True)
            ],
            axis=0,
        )
    alphas = np.asarray(orders, dtype=np.float64)
    if not replace_one and _is_poisson_gaussian(event):
        assert isinstance(event, dp_event.PoissonSampledDpEvent)
        assert isinstance(event.event, dp_event.GaussianDpEvent)
        return _poisson_gaussian_curve(
            event.sampling_probability, event.event.noise_multiplier, alphas
        )
    if isinstance(event, PoissonReplaceOneDpEvent):
        if replace_one:
            raise ValueError(
                f"Expected an add/remove event to analyse as replace-one, got {event!r}."
            )
        add_remove = dp_event.PoissonSampledDpEvent(
            event.sampling_probability, dp_event.GaussianDpEvent(event.noise_multiplier)
        )
        doubled = _compute_curve(add_remove, tuple(float(2.0 * a) for a in alphas))
        return np.where(alphas >= 2.0, 3.0 * doubled, np.inf)
    if not isinstance(event, KnownSampleDpEvent):
        return None
    q = event.sampling_probability
    inner = _compute_curve(event.event, orders, replace_one=replace_one)
    with np.errstate(over="ignore"):
        # log(q e^{(α-1)ρ} + 1 - q) computed stably: logaddexp(log q + (α-1)ρ, log(1-q))
        log_q = math.log(q) if q > 0 else -math.inf
        log_rest = math.log1p(-q) if q < 1 else -math.inf
        value = np.logaddexp(log_q + (alphas - 1.0) * inner, log_rest) / (alphas - 1.0)
    return np.where(np.isnan(value), np.inf, value)


#: relative amount every integer order's RDP of :func:`_poisson_gaussian_curve` is raised by:
#: over 300 times its largest rounding error against the sum in 40 digits (3e-12 relative, over
#: q in [1e-4, 1), σ in [0.3, 30] and orders 2 to 2,048)
RDP_SLACK = 1e-9


def _is_poisson_gaussian(event: dp_event.DpEvent) -> bool:
    return (
        type(event) is dp_event.PoissonSampledDpEvent
        and type(event.event) is dp_event.GaussianDpEvent
        and 0.0 < event.sampling_probability < 1.0
        and event.event.noise_multiplier > 0.0
    )


def _poisson_gaussian_curve(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of the Poisson sub-sampled Gaussian (add/remove, 0 < q < 1, σ > 0): dp-accounting's
    for fractional orders; for integer orders α its sum (Mironov, Talwar & Zhang 2019, Sec.
    3.3) ``A_α = Σ_i C(α, i) q^i (1-q)^{α-i} e^{(i²-i)/(2σ²)}``, evaluated at once instead of
    one term at a time (calibration composes this curve at every σ it tries; dp-accounting's
    loop took half of the slowest shipped config's calibration) as ``log A_α = log1p(S)``,
    ``S = Σ_{i>=2} C(α, i) q^i (1-q)^{α-i} expm1((i²-i)/(2σ²))``: the binomial weights sum
    to 1, so ``A_α - 1`` is a sum of positive terms and keeps its relative precision where
    ``A_α`` is close to 1. Raised by :data:`RDP_SLACK`, so never below the exact value
    (dp-accounting's sum one term at a time lies up to ~6e-9 above it and ~1.2e-9 below)."""
    out = np.empty(len(alphas), dtype=np.float64)
    whole = np.array([float(a).is_integer() and a >= 2 for a in alphas], dtype=bool)
    if (~whole).any():
        with _quiet():
            out[~whole] = rdp_lib._compute_rdp_poisson_subsampled_gaussian(  # noqa: SLF001
                q, sigma, [float(a) for a in alphas[~whole]]
            )
    log_q, log_rest = math.log(q), math.log1p(-q)
    for k in np.flatnonzero(whole):
        alpha = int(alphas[k])
        i = np.arange(2, alpha + 1, dtype=np.float64)
        x = (i * i - i) / (2.0 * sigma**2)
        log_expm1 = x + np.log(-np.expm1(-x))  # log(e^x - 1), x > 0: stable at both ends
        terms = (
            special.gammaln(alpha + 1.0)
            - special.gammaln(i + 1.0)
            - special.gammaln(alpha - i + 1.0)
            + i * log_q
            + (alpha - i) * log_rest
            + log_expm1
        )
        top = float(terms.max())
        log_s = top + math.log(float(np.exp(terms - top).sum()))
        log_a = log_s + math.log1p(math.exp(-log_s)) if log_s > 0 else math.log1p(math.exp(log_s))
        out[k] = log_a / (alpha - 1.0) * (1.0 + RDP_SLACK)
    return out


def rdp_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> float:
    """Smallest ε at ``delta`` from an RDP curve (dp-accounting's conversion)."""
    if len(orders) == 0:
        return math.inf
    eps, _ = rdp_lib.compute_epsilon(list(orders), list(rdp), delta)
    return float(eps)


def rdp_group_curve(
    orders: np.ndarray, rdp: np.ndarray, group_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Mironov's Prop. 2: the RDP curve for groups of ``group_size`` (rounded up to 2^c).

    Returns the new orders ``α/2^c`` (only those with ``α >= 2^{c+1}``) and ``3^c ε(α)``.
    """
    check_int("group_size", group_size, 1)
    c = math.ceil(math.log2(group_size)) if group_size > 1 else 0
    if c == 0:
        return orders, rdp
    keep = orders >= 2.0 ** (c + 1)
    return orders[keep] / 2.0**c, rdp[keep] * 3.0**c


#: δ_r values :func:`group_epsilon_dp` asks for at once
_GROUP_CHUNK = 64


def group_epsilon_dp(
    epsilon_at: Callable[[float], float],
    *,
    group_size: int,
    delta: float,
    compositions: int = 1,
) -> float:
    """Dwork–Roth group privacy, then basic composition over ``compositions`` mechanisms.

    Each of ``compositions`` mechanisms is (ε_r, δ_r)-DP for single records, with
    ``ε_r = epsilon_at(δ_r)``; the group of ``k`` records over all of them is
    ``(m k ε_r, m k e^{(k-1) ε_r} δ_r)``. Returns the smallest such ε over a grid of δ_r
    whose total δ is at most ``delta``.
    """
    k = check_int("group_size", group_size, 1)
    m = check_int("compositions", compositions, 1)
    check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
    # ε_r = epsilon_at(δ_r) never increases with δ_r, so the largest δ_r on the grid (steps of
    # 0.25 nats down from δ/(mk)) that meets the budget gives the smallest ε. The scan goes as
    # deep as floats allow: large groups need δ_r ~ e^{-(k-1) ε_r}, far below δ. The budget is
    # checked in log space (no clamping of the exponent, which could accept an invalid δ_r).
    log_budget = math.log(delta)
    top = math.log(delta / (m * k))
    grid = np.arange(top, max(top - 700.0, -740.0), -0.25)
    many = getattr(epsilon_at, "many", None)  # ε at many δ at once, where it can
    for start in range(0, len(grid), _GROUP_CHUNK):
        chunk = grid[start : start + _GROUP_CHUNK]
        deltas = [math.exp(log_delta_r) for log_delta_r in chunk]
        values = many(deltas) if many is not None else (epsilon_at(d) for d in deltas)
        for log_delta_r, eps_r in zip(chunk, values, strict=True):
            if not math.isfinite(eps_r):
                return math.inf  # then also infinite at every smaller δ_r
            if math.log(m * k) + (k - 1) * eps_r + log_delta_r <= log_budget:
                return m * k * eps_r
    return math.inf


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)."""
    check_positive("mu", mu)
    a = stats.norm.logcdf(-epsilon / mu + mu / 2)
    b = epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2)
    if b >= a:
        return 0.0
    return float(math.exp(a) * -math.expm1(b - a))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε) <= ``delta`` for μ-GDP (root of the monotone δ(ε))."""
    check_positive("mu", mu)
    check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12))
