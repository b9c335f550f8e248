"""Every ε ``silodp account`` prints, recomputed through a second, independent route.

For each private algorithm in :data:`silodp.algorithms.ALGORITHMS`, at each point of a grid
over (record sampling rate q, σ, local steps T, rounds R, group size k, span, silos S, silos
per round, subject sampling rate), silodp's ε is taken the way a user sees it — from
:func:`silodp.cli.account.account_report`, the function behind ``silodp account`` — for every
unit it reports and every adversary (``epsilon_by_adversary``). The test then rebuilds the
mechanism from SPEC.md's description (never from silodp's events or accountant) and computes
its ε independently:

* closed-form Gaussian DP (μ-GDP → ε(δ), written here with scipy) where the composition is an
  unsampled Gaussian, and the SPEC's closed form δ(ε) = Σ_n Bin(n; R, q)·δ_Gauss(ε; √n/σ) for
  a party that knows the sample: both exact;
* dp-accounting's PLD accountant (pessimistic: an upper bound; its optimistic
  ``pessimistic_estimate=False`` PLD: a lower bound) and RDP accountant, on DpEvents built
  here;
* Opacus' ``RDPAccountant`` (upper bound) and ``PRVAccountant`` (its rigorous lower and upper
  ε of Gopi et al. 2021) for Poisson-subsampled Gaussians.

Each silodp ε must be **at least** every lower bound (a reported ε below the true ε is a
privacy bug; float slack only) and **agree** with the independent tight upper bound within a
stated relative tolerance (or, where silodp may legitimately beat that bound, be no larger
than it). ``test_crosscheck_has_teeth`` shows the tolerances are small enough that one step
more or a σ 3% smaller in the independent route is detected.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy import optimize, stats

from silodp.algorithms import ALGORITHMS
from silodp.cli.account import account_report

DELTA = 1e-5
ADVERSARIES = ("released", "server", "silos")

# --- tolerances (relative to the independent value) -------------------------------------
# silodp reports dp-accounting PLDs on a grid of 1e-3 (pessimistic connect-the-dots). On this
# grid the measured disagreements are: ≤ 5e-7 against the closed forms, ≤ 2e-5 against
# dp-accounting's PLD accountant on a 2x finer grid, ≤ 2e-4 against dp-accounting's own mixture
# builder on a 10x coarser grid. The tolerances leave ~10x room for other platforms and
# library versions, and stay well below what a wrong count or rate changes: one step more in
# 50 moves ε by ~1%, a σ 3% smaller by ~3-6% (test_crosscheck_has_teeth).
#: silodp's PLD against an exact closed form (GDP, known-sample)
EXACT_TOL = 1e-3
#: silodp against dp-accounting's PLD accountant (grid 5e-4), both pessimistic
PLD_TOL = 1e-3
#: silodp against the mixture PLD of dp-accounting's builder on a 1e-2 grid (pessimistic):
#: the coarse grid (chosen for speed) adds its own pessimism
MIXTURE_TOL = 2e-3
#: the float slack by which a lower bound may exceed silodp's ε (a correct upper bound is
#: never below a lower bound: anything more is a privacy bug)
LOWER_SLACK = 1e-9


# --- independent routes -------------------------------------------------------------------


def _gdp_delta(mu: float, eps: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth & Su 2019, Cor. 2.13), in logs for stability."""
    a = stats.norm.logcdf(-eps / mu + mu / 2)
    b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
    return 0.0 if b >= a else math.exp(a) * -math.expm1(b - a)


def _solve(delta_of: Any, delta: float = DELTA) -> float:
    """Smallest ε >= 0 with δ(ε) <= delta for a decreasing δ(·)."""
    if delta_of(0.0) <= delta:
        return 0.0
    hi = 1.0
    while delta_of(hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: delta_of(e) - delta, 0.0, hi, xtol=1e-12))


@cache
def gdp(mu: float) -> float:
    """ε at δ of μ-GDP: exact for a composition of unsampled Gaussians (μ² adds up)."""
    return _solve(lambda e: _gdp_delta(mu, e))


@cache
def known_sample(q: float, mu_round: float, rounds: int) -> float:
    """ε at δ of R rounds, each a Gaussian (μ per round) run with probability q on a sample
    the adversary knows: δ(ε) = Σ_n Bin(n; R, q)·δ_GDP(ε; √n·μ) (SPEC §2)."""
    ns = np.arange(1, rounds + 1)
    weights = stats.binom.pmf(ns, rounds, q)
    return _solve(
        lambda e: float(
            sum(
                w * _gdp_delta(math.sqrt(n) * mu_round, e) for n, w in zip(ns, weights, strict=True)
            )
        )
    )


def _poisson_event(q: float, sigma: float, n: int) -> dp_event.DpEvent:
    inner: dp_event.DpEvent = dp_event.GaussianDpEvent(sigma)
    if q < 1.0:
        inner = dp_event.PoissonSampledDpEvent(q, inner)
    return dp_event.SelfComposedDpEvent(inner, n)


@cache
def dpa_pld(q: float, sigma: float, n: int, d: float = 5e-4) -> float:
    """dp-accounting's PLD accountant (pessimistic upper bound), add/remove."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=d)
    acc.compose(_poisson_event(q, sigma, n))
    return float(acc.get_epsilon(DELTA))


@cache
def dpa_pld_lower(q: float, sigma: float, n: int, d: float = 1e-3) -> float:
    """dp-accounting's optimistic PLD: a lower bound on the true ε (add/remove)."""
    one = pld_lib.from_gaussian_mechanism(
        sigma,
        sampling_prob=q,
        value_discretization_interval=d,
        pessimistic_estimate=False,
        use_connect_dots=False,  # connect-the-dots is pessimistic only
    )
    return float(one.self_compose(n).get_epsilon_for_delta(DELTA))


def _quiet_rdp(acc: rdp_privacy_accountant.RdpAccountant, event: dp_event.DpEvent) -> float:
    """ε of ``event``; dp-accounting logs every fractional order it drops (then +inf there)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc.compose(event)
    finally:
        absl.setLevel(level)
    return float(acc.get_epsilon(DELTA))


@cache
def dpa_rdp(q: float, sigma: float, n: int) -> float:
    """dp-accounting's RDP accountant (default orders): a looser upper bound."""
    return _quiet_rdp(rdp_privacy_accountant.RdpAccountant(), _poisson_event(q, sigma, n))


@cache
def opacus_rdp(q: float, sigma: float, n: int) -> float:
    acc = RDPAccountant()
    acc.history = [(sigma, q, n)]
    return float(acc.get_epsilon(DELTA))


@cache
def opacus_prv(q: float, sigma: float, n: int) -> tuple[float, float]:
    """Opacus' PRV accountant: its rigorous (lower, upper) ε (eps_error 0.01)."""
    acc = PRVAccountant()
    acc.history = [(sigma, q, n)]
    eps_error, delta_error = 0.01, DELTA / 1000
    lower, _, upper = acc._get_dprv(eps_error, delta_error).compute_epsilon(  # noqa: SLF001
        DELTA, delta_error, eps_error
    )
    return float(lower), float(upper)


def _binomial_mixture(q: float, k: int) -> tuple[list[float], list[float]]:
    """A k-record subject's sensitivity under Poisson record sampling: j ~ Binomial(k, q)."""
    pmf = stats.binom.pmf(np.arange(k + 1), k, q)
    keep = pmf > 0
    return [float(j) for j in np.flatnonzero(keep)], [float(p) for p in pmf[keep] / pmf.sum()]


@cache
def _mixture_step(q: float, sigma: float, k: int, pessimistic: bool) -> Any:
    sens, probs = _binomial_mixture(q, k)
    return pld_lib.from_mixture_gaussian_mechanism(
        sigma,
        sens,
        probs,
        # the optimistic build (privacy buckets) is the slow one: a coarser grid, a looser
        # (still valid) lower bound
        value_discretization_interval=1e-2 if pessimistic else 2e-2,
        pessimistic_estimate=pessimistic,
        use_connect_dots=pessimistic,  # connect-the-dots is pessimistic only
    )


@cache
def dpa_mixture(q: float, sigma: float, k: int, n: int, *, pessimistic: bool) -> float:
    """n DP-SGD steps seen by a k-record subject, with dp-accounting's own mixture builder
    (``from_mixture_gaussian_mechanism``, not silodp's): an upper (pessimistic, grid 1e-2) or
    lower (optimistic, grid 2e-2) bound."""
    one = _mixture_step(q, sigma, k, pessimistic)
    return float(one.self_compose(n).get_epsilon_for_delta(DELTA))


@cache
def replace_pair(q: float, sigma: float, n: int, *, pessimistic: bool) -> float:
    """n steps of the pair ((1-q)N(0,1) + qN(-a,1), (1-q)N(0,1) + qN(a,1)), a = 1/(2σ): one
    record's clipped gradient +C replaced by -C in a sum with noise N(0, 4C²σ²), in a batch
    with probability q. With Poisson batches this is the exact mechanism (dp-accounting's
    REPLACE_ONE PLD); it is achievable with fixed-size batches too, so its optimistic ε is a
    lower bound there."""
    one = pld_lib.from_gaussian_mechanism(
        2.0 * sigma,
        sensitivity=1.0,
        sampling_prob=q,
        value_discretization_interval=1e-3,
        pessimistic_estimate=pessimistic,
        use_connect_dots=pessimistic,
        neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE,
    )
    return float(one.self_compose(n).get_epsilon_for_delta(DELTA))


@cache
def replaced_and_added(
    q: float, sigma: float, replaced: int, added: int, *, pessimistic: bool
) -> float:
    """``replaced`` steps of one record swapped for another (gradients +C and -C, noise
    N(0, σ²C²), each record in the batch with probability q: dp-accounting's REPLACE_ONE PLD)
    composed with ``added`` steps of one record added (its add/remove PLD)."""

    def one(relation: Any) -> Any:
        return pld_lib.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            value_discretization_interval=1e-3,
            pessimistic_estimate=pessimistic,
            use_connect_dots=pessimistic,
            neighboring_relation=relation,
        )

    out = one(pld_lib.NeighborRel.REPLACE_ONE).self_compose(replaced)
    if added:
        out = out.compose(one(pld_lib.NeighborRel.ADD_OR_REMOVE_ONE).self_compose(added))
    return float(out.get_epsilon_for_delta(DELTA))


@cache
def dpa_rdp_without_replacement(q: float, sigma: float, n: int) -> float:
    """dp-accounting's RDP for fixed-size batches, replace-one (Wang et al. 2019)."""
    size = 10_000
    step = dp_event.SampledWithoutReplacementDpEvent(
        size, round(q * size), dp_event.GaussianDpEvent(sigma)
    )
    acc = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=rdp_privacy_accountant.NeighborRel.REPLACE_ONE
    )
    return _quiet_rdp(acc, dp_event.SelfComposedDpEvent(step, n))


# --- what silodp's ε must satisfy ----------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """Independent values for one unit and adversary.

    ``lower``: values the true ε is at least (exact or optimistic routes). ``upper``: an
    independent valid upper bound; with ``tight`` silodp must agree with it within ``rel``
    (both directions), otherwise only not exceed it by more than ``rel``. ``also``: looser
    independent upper bounds (RDP, PRV), which silodp must not exceed either.
    """

    lower: dict[str, float]
    upper: tuple[str, float]
    rel: float
    tight: bool = True
    also: dict[str, float] = field(default_factory=dict)

    def check(self, eps: float, where: str) -> None:
        routes = {**self.lower, self.upper[0]: self.upper[1], **self.also}
        info = f"{where}: silodp ε={eps!r}, independent routes {routes}"
        assert eps is not None and math.isfinite(eps), info
        for name, low in self.lower.items():
            assert eps >= low * (1 - LOWER_SLACK) - LOWER_SLACK, f"below {name}: {info}"
        for name, up in [self.upper, *self.also.items()]:
            assert eps <= up * (1 + self.rel), f"above {name} by more than {self.rel:g}: {info}"
        name, up = self.upper
        if self.tight:
            assert eps >= up * (1 - self.rel), f"below {name} by more than {self.rel:g}: {info}"

    def agrees(self, eps: float) -> bool:
        """Whether ``eps`` passes :meth:`check` (for the teeth test)."""
        try:
            self.check(eps, "")
        except AssertionError:
            return False
        return True


def no_guarantee() -> Bound:
    """An adversary that sees data-dependent values outside the mechanism: ε = ∞ (silodp
    reports it as null)."""
    return Bound({"sees the data": math.inf}, ("none", math.inf), 0.0)


def exact(mu: float) -> Bound:
    value = gdp(mu)
    return Bound({"gdp": value}, ("gdp", value), EXACT_TOL)


def exact_known_sample(q: float, mu_round: float, rounds: int) -> Bound:
    value = known_sample(q, mu_round, rounds)
    return Bound({"known-sample": value}, ("known-sample", value), EXACT_TOL)


def poisson(q: float, sigma: float, n: int) -> Bound:
    """Poisson-subsampled Gaussian composed n times (exact GDP when q = 1)."""
    if q >= 1.0:
        return exact(math.sqrt(n) / sigma)
    prv_lower, prv_upper = opacus_prv(q, sigma, n)
    return Bound(
        {"dpa-pld-optimistic": dpa_pld_lower(q, sigma, n), "opacus-prv-lower": prv_lower},
        ("dpa-pld", dpa_pld(q, sigma, n)),
        PLD_TOL,
        also={
            "dpa-rdp": dpa_rdp(q, sigma, n),
            "opacus-rdp": opacus_rdp(q, sigma, n),
            "opacus-prv-upper": prv_upper,
        },
    )


def mixture(q: float, sigma: float, k: int, n: int, *, lower_steps: int | None = None) -> Bound:
    """A k-record subject's view of n DP-SGD steps (exact GDP with μ = k√n/σ when q = 1).

    ``lower_steps``: the lower bound uses that many steps only (a subject whose k records sit
    in one silo), and silodp may beat the upper bound (it reports its smallest route)."""
    m = n if lower_steps is None else lower_steps
    if q >= 1.0:
        low, up = gdp(k * math.sqrt(m) / sigma), gdp(k * math.sqrt(n) / sigma)
        return Bound({"gdp-lower": low}, ("gdp", up), EXACT_TOL, tight=lower_steps is None)
    if k == 1:
        bound = poisson(q, sigma, n)
        if lower_steps is None:
            return bound
        return Bound(
            {"dpa-pld-optimistic": dpa_pld_lower(q, sigma, m)}, bound.upper, PLD_TOL, tight=False
        )
    return Bound(
        {"dpa-mixture-optimistic": dpa_mixture(q, sigma, k, m, pessimistic=False)},
        ("dpa-mixture", dpa_mixture(q, sigma, k, n, pessimistic=True)),
        MIXTURE_TOL,
        tight=lower_steps is None,
    )


def capped_record(p: Point, *, federation: bool) -> Bound:
    """The record unit of DP-SGD on capped data (docs/guarantees.md, "Caps"): the group cap
    (on by default in ``silodp account``) lets one added record push out another of its
    subject, a replacement in its silo (and, for a federation-wide cap, possibly a removal in
    another silo instead: one add/remove step more); a span below the silos lets it move its
    subject's (≤ k) records into one silo and out of another: k-record subject steps in two
    silos (``uldp_group``, with its federation-wide cap, caps no span)."""
    n, s, q, k = p.steps * p.rounds, p.sigma, p.q, p.k
    added = n if federation else 0
    subject_silos = 2 if p.span < p.silos and not federation else 0
    if q >= 1.0:  # unsampled Gaussians: replaced (sensitivity 2C), added (C), subjects (kC)
        return exact(math.sqrt((4 + (1 if federation else 0) + subject_silos * k * k) * n) / s)
    assert k == 1 or subject_silos == 0, "the grid has no sampled point with k > 1 and a span cap"
    added += subject_silos * n  # a one-record subject is one record added or removed
    low = replaced_and_added(q, s, n, added, pessimistic=False)
    up = replaced_and_added(q, s, n, added, pessimistic=True)
    return Bound({"dpa-replace-optimistic": low}, ("dpa-replace", up), PLD_TOL)


# --- the grid -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One plan. ``q``: the per-step sampling rate (``--sample-rate``; for the ULDP methods
    the subject rate, for ``higradavg_dp`` with subject sampling the subject rate)."""

    q: float
    sigma: float
    steps: int
    rounds: int
    k: int
    span: int
    silos: int
    silos_per_round: int | None = None

    @property
    def horizontal(self) -> int:
        """Silos one subject's records are composed over per round (SPEC §3)."""
        return min(self.span, self.silos_per_round or self.silos, self.silos)

    def kwargs(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.sigma,
            "delta": DELTA,
            "sample_rate": self.q,
            "steps": self.steps,
            "rounds": self.rounds,
            "silos": self.silos,
            "silos_per_round": self.silos_per_round,
            "span": self.span,
        }


# Each point is chosen so that a wrong count (steps, rounds, span, S) or rate moves ε well
# beyond the tolerances; sizes are kept small so the file runs in well under a minute.
FULL = Point(q=1.0, sigma=2.0, steps=5, rounds=4, k=2, span=2, silos=3)  # no sampling: exact
SAMPLED = Point(q=0.05, sigma=1.0, steps=10, rounds=5, k=3, span=3, silos=3, silos_per_round=2)
SINGLE = Point(q=0.02, sigma=0.8, steps=20, rounds=3, k=1, span=1, silos=2)  # k = 1: record
ULDP = Point(q=0.1, sigma=1.0, steps=1, rounds=50, k=1, span=3, silos=3)  # SPEC's example

POINTS = {"full": FULL, "sampled": SAMPLED, "single": SINGLE, "uldp": ULDP}


def expected(algorithm: str, p: Point, settings: dict[str, Any]) -> dict[str, dict[str, Bound]]:
    """adversary -> unit -> Bound, from SPEC §2-3 (never from silodp's events)."""
    T, R, m, s, q = p.steps, p.rounds, p.horizontal, p.sigma, p.q
    same = lambda units: dict.fromkeys(ADVERSARIES, units)  # noqa: E731 - one view for all
    if algorithm in ("local_item_dp", "local_group_dp"):
        # DP-SGD per silo: record = one record replaced in its silo over T·R steps (the data
        # are capped: capped_record); subject = the k-record mixture over T·R steps in each
        # of the m silos it spans
        record = capped_record(p, federation=False)
        out = same({"record": record, "subject": mixture(q, s, p.k, T * R * m)})
        return _silos_see_caps(out, "record", p.span < p.silos)
    if algorithm == "uldp_group":
        # k bounds the subject's records in the whole federation: at worst all in one silo
        # (lower bound); silodp's per-silo mixture over the silos is a valid upper bound (no
        # span: uldp_group caps none, so a subject may occupy every silo of a round), and its
        # federation-wide group conversion may beat it
        every = min(p.silos_per_round or p.silos, p.silos)
        subject = mixture(q, s, p.k, T * R * every, lower_steps=T * R)
        out = same({"record": capped_record(p, federation=True), "subject": subject})
        return _silos_see_caps(out, "record", True)
    if algorithm == "higradavg_dp":
        # one subject's averaged gradient has sensitivity C; it is in a batch with
        # probability 1-(1-q)^k under record sampling, q under subject sampling
        rate = q if settings.get("sampling") == "subject" else 1.0 - (1.0 - q) ** p.k
        return same({"subject": poisson(rate, s, T * R * m)})
    if algorithm == "user_ldp":
        # clipped batch mean, replacement: sensitivity 2C, noise σC, no sampling; with a
        # span cap, one silo's dataset decides which records every silo keeps: all S silos
        silos = p.silos if p.span < p.silos else 1
        out = same(
            {
                "silo": exact(2 * math.sqrt(T * R * silos) / s),
                "subject": exact(2 * math.sqrt(T * R * m) / s),
            }
        )
        return _silos_see_caps(out, "silo", p.span < p.silos)
    if algorithm == "uldp_naive":
        # S clipped deltas each moving by 2C, noise σC·S on the sum: one Gaussian (σ/2) a round
        return same({"subject": exact(2 * math.sqrt(R) / s)})
    if algorithm in ("uldp_avg", "uldp_sgd", "uldp_avg_w"):
        # one Gaussian (σ, sensitivity C) per round on the secure sum, subjects Poisson-sampled
        # at q; a curious silo knows its 1/S share of the noise: σ·√((S-1)/S) to it; a party
        # that learns the sample gets no amplification
        sampler = settings.get("subject_sampler", "silos")
        hidden_from_silos = (
            algorithm == "uldp_avg_w" and settings.get("weighting", "protocol") == "protocol"
        )
        knows = {
            "silos": sampler == "silos" or not hidden_from_silos,
            "server": sampler == "server",
        }
        silo_sigma = s * math.sqrt((p.silos - 1) / p.silos)
        if algorithm == "uldp_avg_w":
            # weights n_{s,a}/n_a: a subject's records elsewhere also set a curious silo's own
            # weight, which it does not see: the sum moves by up to 2C to it
            silo_sigma /= 2.0

        def view(sigma: float, known: bool) -> Bound:
            if q < 1.0 and known:
                return exact_known_sample(q, 1.0 / sigma, R)
            return poisson(q, sigma, R)

        out = {
            "released": {"subject": view(s, False)},
            "server": {"subject": view(s, knows["server"])},
            "silos": {"subject": view(silo_sigma, knows["silos"])},
        }
        if algorithm == "uldp_avg_w":
            # clear weights n_{s,a}/n_a: computed by the server, sent to every silo; the
            # protocol's exact weights: the server inverts r_a·n_a, which is 0 exactly when a
            # listed subject has no record (fixed-point BFV weights show it no total)
            fixed = settings.get("weight_encoding") == "fixed_point"
            seen_by = (
                {"server", "silos"} if not hidden_from_silos else set() if fixed else {"server"}
            )
            for who in seen_by:
                out[who] = {"subject": no_guarantee()}
        return out
    if algorithm == "prifedsync":
        return same(_prifedsync(p, settings))
    raise AssertionError(f"no independent route for {algorithm!r}: add one to this test")


def _silos_see_caps(
    bounds: dict[str, dict[str, Bound]], unit: str, across: bool
) -> dict[str, dict[str, Bound]]:
    """With a cap across silos (a span cap, a federation-wide bound) a silo's kept records
    depend on the other silos' records, which it sees: no guarantee at ``unit`` against the
    silos."""
    if across:
        bounds = {who: dict(view) for who, view in bounds.items()}
        bounds["silos"][unit] = no_guarantee()
    return bounds


def _prifedsync(p: Point, settings: dict[str, Any]) -> dict[str, Bound]:
    """Record level, replace-one: K·R NoisySGD steps, noise N(0, 4C²σ²) on a sum with
    sensitivity 2C (μ = 1/σ per step unsampled), clients Poisson-sampled at p per round by the
    server (known to it: no amplification)."""
    K, R, s, q = p.steps, p.rounds, p.sigma, p.q
    rate = settings.get("client_rate", 1.0)
    poisson_batches = settings.get("batch_sampling") == "poisson"
    if q >= 1.0:
        every = exact(math.sqrt(K * R) / s)
        sampled = exact_known_sample(rate, math.sqrt(K) / s, R) if rate < 1.0 else every
        return {"record": sampled, "record_every_round": every}
    if rate < 1.0:
        raise AssertionError("the grid has no point with both batch and client sampling")
    n = K * R
    low = {"replace-pair-optimistic": replace_pair(q, s, n, pessimistic=False)}
    if poisson_batches:
        bound = Bound(low, ("replace-pair", replace_pair(q, s, n, pessimistic=True)), PLD_TOL)
    else:
        # Fixed-size batches: if every other record's gradient is v and the replaced one goes
        # from v to -v, a batch without it sums like a batch with v, so one step is the pair
        # (N(0,1), (1-q)N(0,1) + qN(1/σ,1)) in either order: add/remove's Poisson-subsampled
        # Gaussian at (q, σ). It is achievable, so its optimistic ε is a lower bound; silodp's
        # f-DP route (C_q(G_1/σ), DRS19 Thm 4.2) must lie between it and dp-accounting's RDP
        # bound for sampling without replacement.
        low["displacement-pair-optimistic"] = dpa_pld_lower(q, s, n)
        upper = ("dpa-rdp-wor", dpa_rdp_without_replacement(q, s, n))
        bound = Bound(low, upper, 0.0, tight=False)
    return {"record": bound, "record_every_round": bound}


#: (algorithm, settings) per point; every private algorithm must appear (checked below)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[
        (pt, name, {"group_size": POINTS[pt].k})
        for pt in ("full", "sampled", "single")
        for name in ("local_item_dp", "local_group_dp", "uldp_group")
    ],
    ("full", "higradavg_dp", {"group_size": 2}),
    ("sampled", "higradavg_dp", {"group_size": 3}),
    ("sampled", "higradavg_dp", {"group_size": 3, "sampling": "subject"}),
    ("full", "user_ldp", {}),
    ("sampled", "user_ldp", {}),
    ("full", "uldp_naive", {}),
    ("uldp", "uldp_naive", {}),
    *[(pt, name, {}) for pt in ("full", "uldp") for name in ("uldp_avg", "uldp_sgd", "uldp_avg_w")],
    ("uldp", "uldp_avg", {"subject_sampler": "server"}),
    ("uldp", "uldp_sgd", {"subject_sampler": "server"}),
    ("uldp", "uldp_avg_w", {"subject_sampler": "server"}),
    ("uldp", "uldp_avg_w", {"subject_sampler": "server", "weighting": "clear"}),
    ("uldp", "uldp_avg_w", {"scheme": "bfv", "weight_encoding": "fixed_point"}),
    ("full", "prifedsync", {}),
    ("full", "prifedsync", {"client_rate": 0.5}),
    ("sampled", "prifedsync", {}),
    ("sampled", "prifedsync", {"batch_sampling": "poisson"}),
]


def _silodp(point: str, algorithm: str, settings: dict[str, Any]) -> dict[str, Any]:
    """``account_report`` at ``point`` (computed once per test session; read only)."""
    return _report(point, algorithm, tuple(sorted(settings.items())))


@cache
def _report(point: str, algorithm: str, settings: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    kwargs = POINTS[point].kwargs()
    if algorithm in ("uldp_naive", "uldp_avg", "uldp_sgd", "uldp_avg_w", "prifedsync"):
        kwargs["silos_per_round"] = None  # they need every silo (clients sampled at p)
    return account_report(algorithm, **kwargs, settings=dict(settings))


def test_every_private_algorithm_is_cross_checked() -> None:
    private = {n for n, cls in ALGORITHMS.items() if cls.calibration_unit is not None}
    assert private == {name for _, name, _ in CASES}


@pytest.mark.parametrize(("point", "algorithm", "settings"), CASES, ids=lambda v: str(v))
def test_epsilon_matches_an_independent_route(point, algorithm, settings) -> None:
    report = _silodp(point, algorithm, settings)
    bounds = expected(algorithm, POINTS[point], settings)
    for adversary in ADVERSARIES:
        got = report["epsilon_by_adversary"][adversary]
        assert set(got) == set(bounds[adversary]), (adversary, got)
        for unit, eps in got.items():
            bound = bounds[adversary][unit]
            if math.isinf(bound.upper[1]):
                assert eps is None, (adversary, unit, eps)  # ∞, written as null
                continue
            bound.check(eps, f"{algorithm} {settings} at {point}, {adversary}/{unit}")
    for unit, eps in report["epsilon"].items():  # the headline: the strongest adversary
        views = [report["epsilon_by_adversary"][a][unit] for a in ADVERSARIES]
        assert eps == (None if None in views else max(views))


def test_spec_known_sample_example() -> None:
    """SPEC §2: σ = 1, q = 0.1, R = 50 is ε ≈ 16.07 against a party that knows the sample and
    5.15 amplified."""
    report = _silodp("uldp", "uldp_avg", {"subject_sampler": "server", "weighting": "clear"})
    assert report["epsilon_by_adversary"]["server"]["subject"] == pytest.approx(16.07, abs=0.01)
    assert report["epsilon_by_adversary"]["released"]["subject"] == pytest.approx(5.15, abs=0.01)


@pytest.mark.parametrize(
    ("point", "algorithm", "settings", "unit", "perturbed"),
    [
        # one step more (T·R + 1 of 50 steps: ~1% more ε) in the independent route
        (
            "sampled",
            "local_item_dp",
            {"group_size": 3},
            "record",
            lambda p: capped_record(
                dataclasses.replace(p, steps=p.steps * p.rounds + 1, rounds=1), federation=False
            ),
        ),
        # σ 3% smaller in the closed form
        (
            "full",
            "user_ldp",
            {},
            "subject",
            lambda p: exact(2 * math.sqrt(p.steps * p.rounds * p.horizontal) / (0.97 * p.sigma)),
        ),
        # the subject composed over one silo fewer than it spans
        (
            "sampled",
            "local_item_dp",
            {"group_size": 3},
            "subject",
            lambda p: mixture(p.q, p.sigma, p.k, p.steps * p.rounds * (p.horizontal - 1)),
        ),
        # one round more for a party that knows the sample
        (
            "uldp",
            "uldp_avg",
            {"subject_sampler": "server"},
            "subject",
            lambda p: exact_known_sample(p.q, 1 / p.sigma, p.rounds + 1),
        ),
    ],
    ids=["one-step-more", "sigma-3pc-smaller", "span-minus-one", "one-round-more"],
)
def test_crosscheck_has_teeth(point, algorithm, settings, unit, perturbed) -> None:
    report = _silodp(point, algorithm, settings)
    adversary = "server" if algorithm == "uldp_avg" else "released"
    eps = report["epsilon_by_adversary"][adversary][unit]
    assert expected(algorithm, POINTS[point], settings)[adversary][unit].agrees(eps)
    assert not perturbed(POINTS[point]).agrees(eps)


def test_lower_bounds_have_teeth() -> None:
    """Where silodp may beat the independent upper bound, the lower bounds alone must catch a
    plausible accounting error: PriFedSync's fixed-size batches accounted as Poisson batches
    (half the ε), or a 3-record subject accounted as one record."""
    pri = _silodp("sampled", "prifedsync", {"batch_sampling": "poisson"})["epsilon"]["record"]
    assert not expected("prifedsync", SAMPLED, {})["released"]["record"].agrees(pri)
    report = _silodp("sampled", "uldp_group", {"group_size": 3})["epsilon"]
    subject = expected("uldp_group", SAMPLED, {"group_size": 3})["released"]["subject"]
    assert subject.agrees(report["subject"])
    assert not subject.agrees(report["record"])


def test_per_round_epsilon_and_mu_match_closed_forms() -> None:
    """``--per-round`` prints the headline ε after every round, and μ where the composition
    is an unsampled Gaussian: both against the closed forms, round by round."""
    p = FULL
    T, m, s = p.steps, p.horizontal, p.sigma
    # against the released model: with the span cap the silos have no silo-level guarantee
    report = account_report("user_ldp", **p.kwargs(), per_round=True, adversary="released")
    assert [row["round"] for row in report["per_round"]] == list(range(1, p.rounds + 1))
    S = p.silos  # the span cap (span < S) makes the silo unit compose over every silo
    assert p.span < S
    for row in report["per_round"]:
        r = row["round"]
        exact(2 * math.sqrt(T * r * S) / s).check(row["epsilon"]["silo"], f"user_ldp round {r}")
        exact(2 * math.sqrt(T * r * m) / s).check(row["epsilon"]["subject"], f"round {r}")
    assert report["mu"]["silo"] == pytest.approx(2 * math.sqrt(T * p.rounds * S) / s, rel=1e-12)
    assert report["mu"]["subject"] == pytest.approx(2 * math.sqrt(T * p.rounds * m) / s, rel=1e-12)
    # the client sample known to the server, round by round (f-DP accountant)
    report = _silodp("full", "prifedsync", {"client_rate": 0.5})
    rows = account_report(
        "prifedsync",
        **{**p.kwargs(), "silos_per_round": None},
        per_round=True,
        settings={"client_rate": 0.5},
    )["per_round"]
    for row in rows:
        r = row["round"]
        exact_known_sample(0.5, math.sqrt(T) / s, r).check(row["epsilon"]["record"], f"r={r}")
        exact(math.sqrt(T * r) / s).check(row["epsilon"]["record_every_round"], f"r={r}")
    # composed round by round or all at once: the same ε up to float rounding
    assert rows[-1]["epsilon"] == pytest.approx(report["epsilon"], rel=1e-9)


@pytest.mark.parametrize("batch_sampling", ["uniform", "poisson"])
def test_prifedsync_clt_estimates_match_opacus(batch_sampling) -> None:
    """The labelled CLT estimates (μ of the paper's Theorem 2 and their ε) against Opacus'
    GDP analysis: the same formulas, so they agree to float precision."""
    from opacus.accountants.analysis import gdp as opacus_gdp

    p = SAMPLED
    report = _silodp("sampled", "prifedsync", {"batch_sampling": batch_sampling})
    compute = (
        opacus_gdp.compute_mu_poisson
        if batch_sampling == "poisson"
        else opacus_gdp.compute_mu_uniform
    )
    mu = float(compute(steps=p.steps * p.rounds, noise_multiplier=p.sigma, sample_rate=p.q))
    assert report["mu_estimates"]["weak"] == pytest.approx(mu, rel=1e-12)
    assert report["mu_estimates"]["strong"] == pytest.approx(math.sqrt(p.silos - 1) * mu, rel=1e-12)
    estimates = report["estimates"]
    weak = opacus_gdp.eps_from_mu(mu=mu, delta=DELTA)
    strong = opacus_gdp.eps_from_mu(mu=math.sqrt(p.silos - 1) * mu, delta=DELTA)
    assert estimates["record_clt_weak"] == pytest.approx(weak, rel=1e-6)
    assert estimates["record_clt_strong"] == pytest.approx(strong, rel=1e-6)
