"""PriFedSync accounting in f-DP / Gaussian DP (Zheng et al., "Federated f-Differential Privacy").

PriFedSync (SPEC §2): each round the server Poisson-samples clients at rate ``p``; a sampled
client ``j`` runs ``K`` NoisySGD steps on batches of ``B_j`` of its ``n_j`` records, each step
adding ``N(0, 4C²σ²)`` to a sum of per-record gradients clipped to ``C``, and sends its noisy
model to the server. Neighbouring datasets differ by *replacing* one record of one client, so the
noised sum has sensitivity ``2C`` and ``σ`` is the ratio of noise std to sensitivity (the
convention of Dong, Roth & Su 2019 and of Opacus' GDP analysis). The privacy unit is the
record.

What is computed (see ``docs/accounting-fdp.md``):

* **Rigorous guarantee** ``epsilon["record"]``: per client, the ``K·R`` sub-sampled Gaussian
  steps composed numerically with dp-accounting's privacy loss distributions (PLD), pessimistic
  discretisation. For fixed-size batches (``"uniform"``) each step is ``C_q(G_{1/σ})``-DP
  (DRS19, Thm 4.2, sampling without replacement, replacement adjacency); the trade-off function
  is replaced by a piecewise-linear *lower* bound (maximum of its supporting lines), turned into
  a pair of discrete distributions and composed with dp-accounting. For Poisson batches the step
  is dp-accounting's Poisson-sampled Gaussian under ``REPLACE_ONE``. dp-accounting's RDP bound
  for sampling without replacement (Wang, Balle & Kasiviswanathan 2019) is a second rigorous
  route; the smaller of the valid values is reported. Client sampling at rate ``p`` is accounted
  by the mixture ``p·PLD_round + (1-p)·PLD_identity`` per round: a client's records influence
  what anybody sees only in rounds in which that client is sampled, so the round is dominated by
  the pair ``(pP + (1-p)⊥, pP' + (1-p)⊥)``; this holds against the server and every coalition
  of clients (hence for both federated notions) and is never looser than Lemma 3.8's
  ``max(f, 1-α-p)``.
* **CLT estimates** (labelled, never reported as the guarantee): the paper's Theorem 2 μ,
  ``μ_j = √2·c_j·sqrt(e^{σ^-2}Φ(1.5/σ) + 3Φ(-0.5/σ) - 2)`` with ``c_j = (B_j/n_j)√(KR)``
  (``c_j·sqrt(e^{σ^-2}-1)`` for Poisson batches, Bu et al. 2020); weak federated ``G_{μmax}``,
  strong federated ``G_{√(m-1)·μmax}``; and Theorem 1's client-sampled
  ``max(G_μ, 1-α-p²)^{⊗R}``. The paper's ``p²`` (client ``i`` learns about client ``j`` only
  in rounds where both are sampled) ignores that the global model carries ``j``'s contribution
  into later rounds, so it is reported as an estimate only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
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
from silodp.accounting.conversions import RDP_ORDERS, gdp_epsilon, rdp_curve, rdp_epsilon

__all__ = [
    "BATCH_SAMPLING",
    "FdpReport",
    "PriFedSyncPlan",
    "account_prifedsync",
    "calibrate_prifedsync",
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
CALIBRATION_DISCRETIZATION = 5e-3
# the CLT estimates' per-round losses are small (μ/√R), so they need a finer grid to stay close
ESTIMATE_DISCRETIZATION = 1e-4
MAX_TANGENTS = 20_000
FLOAT_SLACK = 1e-12
MAX_NOISE_MULTIPLIER = 1e3
MIN_NOISE_MULTIPLIER = 0.05
# beyond this μ, G_μ is (numerically) no privacy at any useful δ; estimates report inf
MAX_ESTIMATE_MU = 40.0
THREAT_MODEL = (
    "record-level, replacement adjacency; the rigorous ε holds against the server and any "
    "coalition of the other clients (strong, hence also weak, federated f-DP); noise is added "
    "locally, no trust in the server is needed; CLT values are estimates"
)


# ----------------------------------------------------------------------------- plan and report


@dataclass(frozen=True, kw_only=True)
class PriFedSyncPlan:
    """The public facts of a PriFedSync run that its privacy depends on.

    Attributes:
      noise_multiplier: σ; each local step adds ``N(0, 4C²σ²)`` to a sum of per-record gradients
        clipped to ``C`` (replacement adjacency, sensitivity ``2C``).
      sample_rates: per client ``j``, ``B_j / n_j``; one entry per client (``m`` clients).
      local_steps: K, local iterations per round.
      rounds: R, synchronisation rounds.
      client_rate: p, the Poisson sampling rate of clients per round.
      delta: δ at which ε is reported.
      batch_sampling: ``"uniform"`` (fixed-size batches drawn without replacement, as
        Algorithm 2 trains) or ``"poisson"`` (each record independently at rate ``B_j/n_j``).
    """

    noise_multiplier: float
    sample_rates: tuple[float, ...]
    local_steps: int
    rounds: int
    client_rate: float = 1.0
    delta: float = 1e-5
    batch_sampling: str = "uniform"

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        if not self.sample_rates:
            raise ValueError("Expected at least one client sample rate, got none.")
        for i, rate in enumerate(self.sample_rates):
            check_probability(f"sample_rates[{i}]", rate)
        check_int("local_steps", self.local_steps, 1)
        check_int("rounds", self.rounds, 1)
        check_probability("client_rate", self.client_rate)
        check_in_range("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        check_choice("batch_sampling", self.batch_sampling, BATCH_SAMPLING)

    @property
    def clients(self) -> int:
        """m, the number of clients."""
        return len(self.sample_rates)


@dataclass(frozen=True)
class FdpReport:
    """Privacy of a PriFedSync plan after ``round`` rounds.

    Attributes:
      round: rounds composed so far.
      mu: CLT μ (Theorem 2): ``"client_max"`` = max_j μ_j, ``"weak"`` = μmax (one other client
        attacks), ``"strong"`` = √(m-1)·μmax (all other clients collude). Estimates.
      epsilon: rigorous ε at ``plan.delta``: ``"record"`` (the guarantee, with client sampling
        where ``p < 1``) and ``"record_every_round"`` (the client takes part in every round).
      epsilon_route: how each ε was obtained (``"pld"``, ``"pld-client-sampling"``, ``"rdp"``).
      estimates: labelled non-rigorous ε at ``plan.delta`` from the CLT μ.
    """

    round: int
    mu: dict[str, float]
    epsilon: dict[str, float]
    epsilon_route: dict[str, str]
    estimates: dict[str, float] = field(default_factory=dict)


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
    if batch_sampling == "poisson":
        return c * math.sqrt(math.expm1(sigma**-2))
    inner = (
        math.exp(sigma**-2) * stats.norm.cdf(1.5 / sigma) + 3.0 * stats.norm.cdf(-0.5 / sigma) - 2.0
    )
    return math.sqrt(2.0) * c * math.sqrt(max(inner, 0.0))


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
    return float(pld.get_epsilon_for_delta(delta))


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


@lru_cache(maxsize=64)
def _step_rdp(noise_multiplier: float, q: float, batch_sampling: str) -> np.ndarray | None:
    """RDP of one step from dp-accounting (uniform batches only), or None."""
    if batch_sampling != "uniform":
        return None
    # source size / sample size only matter through their ratio
    event = dp_event.SampledWithoutReplacementDpEvent(
        1_000_000, round(q * 1_000_000), dp_event.GaussianDpEvent(noise_multiplier)
    )
    return rdp_curve(event, replace_one=True)


# ----------------------------------------------------------------------------- the accountant


def _epsilon(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    return float(pld.get_epsilon_for_delta(delta))


def account_prifedsync(plan: PriFedSyncPlan, *, per_round: bool = False) -> list[FdpReport]:
    """Privacy of a PriFedSync plan: the final report (``[last]``) or one per round ``1..R``.

    The rigorous ε is that of the most exposed client (largest ``B_j/n_j``); for
    ``epsilon["record_every_round"]`` it takes part in every round, for ``epsilon["record"]``
    in each round with probability ``p`` (the two agree when ``p = 1``). Per-round reports
    compose one more round onto the kept state, so ``per_round=True`` costs about R PLD
    compositions, not R accountings.
    """
    sigma, p = plan.noise_multiplier, plan.client_rate
    q_max = max(plan.sample_rates)
    round_pld = _round_pld(sigma, q_max, plan.local_steps, plan.batch_sampling, DISCRETIZATION)
    sampled_round = _client_sampled(round_pld, p)
    step_rdp = _step_rdp(sigma, q_max, plan.batch_sampling)
    mu_round = clt_mu(sigma, q_max, plan.local_steps, batch_sampling=plan.batch_sampling)
    paper_round = None
    if p < 1.0 and mu_round <= MAX_ESTIMATE_MU:
        paper_round = tradeoff_pld(mu_round, p=p, discretization=ESTIMATE_DISCRETIZATION)

    wanted = range(1, plan.rounds + 1) if per_round else [plan.rounds]
    reports: list[FdpReport] = []
    state_all: pld_lib.PrivacyLossDistribution | None = None
    state_sampled: pld_lib.PrivacyLossDistribution | None = None
    state_paper: pld_lib.PrivacyLossDistribution | None = None
    done = 0
    for r in wanted:
        count = r - done
        state_all = _advance(state_all, round_pld, count)
        if sampled_round is not None:
            state_sampled = _advance(state_sampled, sampled_round, count)
        if paper_round is not None:
            state_paper = _advance(state_paper, paper_round, count)
        done = r
        reports.append(_report(plan, r, state_all, state_sampled, state_paper, step_rdp, q_max))
    return reports


def _client_sampled(
    round_pld: pld_lib.PrivacyLossDistribution,
    p: float,
    discretization: float = DISCRETIZATION,
) -> pld_lib.PrivacyLossDistribution | None:
    """``p·PLD_round + (1-p)·PLD_identity``: the round's dominating pair mixed with ``⊥``."""
    if p >= 1.0:
        return None
    identity = pld_lib.identity(value_discretization_interval=discretization)
    return round_pld.compute_mixture(identity, p)


def _record_epsilon(plan: PriFedSyncPlan, discretization: float = DISCRETIZATION) -> float:
    """The rigorous record ε of ``plan`` by the PLD route only (what calibration needs)."""
    q_max = max(plan.sample_rates)
    round_pld = _round_pld(
        plan.noise_multiplier, q_max, plan.local_steps, plan.batch_sampling, discretization
    )
    sampled_round = _client_sampled(round_pld, plan.client_rate, discretization)
    composed = (round_pld if sampled_round is None else sampled_round).self_compose(plan.rounds)
    return _epsilon(composed, plan.delta)


def _advance(
    state: pld_lib.PrivacyLossDistribution | None,
    one: pld_lib.PrivacyLossDistribution,
    count: int,
) -> pld_lib.PrivacyLossDistribution:
    step = one if count == 1 else one.self_compose(count)
    return step if state is None else state.compose(step)


def _report(
    plan: PriFedSyncPlan,
    r: int,
    state_all: pld_lib.PrivacyLossDistribution,
    state_sampled: pld_lib.PrivacyLossDistribution | None,
    state_paper: pld_lib.PrivacyLossDistribution | None,
    step_rdp: np.ndarray | None,
    q_max: float,
) -> FdpReport:
    delta, m = plan.delta, plan.clients
    mu_max = clt_mu(
        plan.noise_multiplier, q_max, plan.local_steps * r, batch_sampling=plan.batch_sampling
    )
    mu = {"client_max": mu_max, "weak": mu_max, "strong": math.sqrt(m - 1) * mu_max}
    every: dict[str, float] = {"pld": _epsilon(state_all, delta)}
    if step_rdp is not None:
        every["rdp"] = rdp_epsilon(RDP_ORDERS, step_rdp * plan.local_steps * r, delta)
    every_route = min(every, key=lambda key: every[key])
    epsilon = {"record_every_round": every[every_route]}
    route = {"record_every_round": every_route}
    if state_sampled is not None:
        sampled = _epsilon(state_sampled, delta)
        if sampled < every[every_route]:
            epsilon["record"], route["record"] = sampled, "pld-client-sampling"
        else:
            epsilon["record"], route["record"] = every[every_route], every_route
    else:
        epsilon["record"], route["record"] = every[every_route], every_route
    estimates = {
        "record_clt_weak": _gdp_epsilon_or_zero(mu["weak"], delta),
        "record_clt_strong": _gdp_epsilon_or_zero(mu["strong"], delta),
    }
    if state_paper is not None:
        estimates["record_clt_weak_client_sampling"] = _epsilon(state_paper, delta)
    return FdpReport(round=r, mu=mu, epsilon=epsilon, epsilon_route=route, estimates=estimates)


def calibrate_prifedsync(plan: PriFedSyncPlan, *, target_epsilon: float) -> float:
    """Smallest σ (bisection, relative tolerance 1e-3) whose rigorous record ε is ≤ the target.

    ``plan.noise_multiplier`` is ignored; σ is searched in ``[MIN_NOISE_MULTIPLIER,
    MAX_NOISE_MULTIPLIER]`` (a target met already at the lower end returns that end). The
    bisection runs on a coarser PLD grid; the result is then checked on the reporting grid and
    raised until ``account_prifedsync(...)[-1].epsilon["record"] <= target_epsilon``. Raises
    ``ValueError`` naming the target when even ``MAX_NOISE_MULTIPLIER`` does not reach it.
    """
    target = check_positive("target_epsilon", target_epsilon)

    def eps(sigma: float, discretization: float = CALIBRATION_DISCRETIZATION) -> float:
        return _record_epsilon(replace(plan, noise_multiplier=sigma), discretization)

    hi = 1.0
    if eps(hi) <= target:
        lo = hi / 2.0
        while eps(lo) <= target:
            hi = lo
            lo /= 2.0
            if lo < MIN_NOISE_MULTIPLIER:
                return MIN_NOISE_MULTIPLIER if eps(MIN_NOISE_MULTIPLIER) <= target else hi
    else:
        while eps(hi) > target:
            hi *= 2.0
            if hi > MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"Expected target_epsilon={target_epsilon!r} to be reachable with "
                    f"noise_multiplier <= {MAX_NOISE_MULTIPLIER:g}; it is not."
                )
        lo = hi / 2.0
    while hi - lo > 1e-3 * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    for _ in range(100):  # confirm on the reporting grid
        if eps(hi, DISCRETIZATION) <= target:
            return hi
        hi *= 1.001
    raise ValueError(f"Expected target_epsilon={target_epsilon!r} to be reachable; it is not.")
