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
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_positive,
    check_probability,
)
from silodp.accounting.accountant import ADVERSARIES, Estimate, SiloPrivacy
from silodp.accounting.calibrate import calibrate_noise
from silodp.accounting.conversions import RDP_ORDERS, rdp_epsilon
from silodp.accounting.hockey import epsilon_for_delta
from silodp.accounting.plan import PrivacyPlan
from silodp.accounting.pld import MAX_PLD_POINTS, fits, pld_loss_moments
from silodp.accounting.tradeoff import (
    BATCH_SAMPLING,
    DISCRETIZATION,
    ESTIMATE_DISCRETIZATION,
    MAX_ESTIMATE_MU,
    _gdp_epsilon_or_zero,
    _round_pld,
    _step_pld,
    _step_rdp,
    client_sampled_epsilon,
    client_sampled_tradeoff,
    clt_mu,
    composed_client_sampled_tradeoff,
    subsampled_tradeoff,
    tradeoff_gaussian,
    tradeoff_pld,
)
from silodp.errors import InvalidValueError

__all__ = [
    "BATCH_SAMPLING",
    "FdpAccountant",
    "FdpReport",
    "PriFedSyncPlan",
    "account_prifedsync",
    "calibrate_prifedsync",
    "client_sampled_epsilon",
    "client_sampled_tradeoff",
    "clt_mu",
    "composed_client_sampled_tradeoff",
    "step_events",
    "subsampled_tradeoff",
    "tradeoff_gaussian",
    "tradeoff_pld",
]

CALIBRATION_DISCRETIZATION = 5e-3
THREAT_MODEL = (
    "record-level, replacement adjacency; the rigorous ε holds against the server and any "
    "coalition of the other clients (strong, hence also weak, federated f-DP); noise is added "
    "locally, so a server that runs the agreed plan learns no more (the silos run the plan "
    "it sends unchecked: docs/guarantees.md C5); CLT values are estimates"
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


# ----------------------------------------------------------------------------- events


def step_events(
    noise_multiplier: float, sample_rate: float, steps: int, batch_sampling: str = "uniform"
) -> SiloPrivacy:
    """One client's round as DP events: ``steps`` NoisySGD steps (Gaussian with noise
    multiplier σ relative to the replacement sensitivity ``2C``) on batches drawn at
    ``sample_rate``: fixed-size without replacement (``uniform``) or Poisson."""
    check_choice("batch_sampling", batch_sampling, BATCH_SAMPLING)
    check_probability("sample_rate", sample_rate)
    gaussian = dp_event.GaussianDpEvent(noise_multiplier)
    if batch_sampling == "poisson":
        step: dp_event.DpEvent = dp_event.PoissonSampledDpEvent(sample_rate, gaussian)
    else:
        # the exact ratio: ``sample_size / source_dataset_size`` gives back ``sample_rate``
        rate = Fraction(sample_rate)
        step = dp_event.SampledWithoutReplacementDpEvent(rate.denominator, rate.numerator, gaussian)
    return SiloPrivacy({"record": dp_event.SelfComposedDpEvent(step, steps)})


def _parse(event: dp_event.DpEvent) -> tuple[float, float, int, str]:
    """(σ, sampling rate, steps, batch sampling) of one client's round of NoisySGD."""
    if not isinstance(event, dp_event.SelfComposedDpEvent):
        raise ValueError(f"Expected a self-composed NoisySGD step, got {event!r}.")
    step, steps = event.event, event.count
    if isinstance(step, dp_event.SampledWithoutReplacementDpEvent):
        inner, rate, sampling = step.event, step.sample_size / step.source_dataset_size, "uniform"
    elif isinstance(step, dp_event.PoissonSampledDpEvent):
        inner, rate, sampling = step.event, step.sampling_probability, "poisson"
    else:
        raise ValueError(f"Expected a sub-sampled Gaussian step, got {step!r}.")
    if not isinstance(inner, dp_event.GaussianDpEvent):
        raise ValueError(f"Expected a Gaussian mechanism in each step, got {inner!r}.")
    return inner.noise_multiplier, rate, steps, sampling


# ----------------------------------------------------------------------------- the accountant


class FdpAccountant:
    """PriFedSync's accountant: f-DP per client, composed round by round, with the same
    interface as :class:`~silodp.accounting.FederatedAccountant`.

    Each round composes the round of the most exposed client (largest sampling rate) among the
    silos' events it is given, mixed with the identity at the client rate ``p`` (a client's
    records influence what anybody sees only in rounds in which it is sampled), whichever
    clients the round actually sampled: the server draws that sample, and the mixture is what
    accounts it. ε is reported at ``record`` (the guarantee, with client sampling) and
    ``record_every_round`` (the client takes part in every round); the same values hold against
    every adversary. :meth:`mu` and :meth:`labelled_estimates` are CLT estimates, never
    guarantees.

    Args:
      clients: m, the number of clients (the strong federated μ is ``√(m-1)·μmax``).
      client_rate: p, the Poisson client-sampling rate per round.
      delta: δ of every reported ε.
      discretization: PLD grid of the rigorous routes.
      rigorous_only: compute only the rigorous ``record`` ε on the PLD route (calibration).
    """

    units: tuple[str, ...] = ("record",)

    def __init__(
        self,
        *,
        clients: int,
        client_rate: float,
        delta: float,
        discretization: float = DISCRETIZATION,
        rigorous_only: bool = False,
    ) -> None:
        self.clients = check_int("clients", clients, 1)
        self.client_rate = check_probability("client_rate", client_rate)
        self.delta = check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
        self.discretization = discretization
        self.rigorous_only = rigorous_only
        self.rounds = 0
        self._all: pld_lib.PrivacyLossDistribution | None = None
        self._all_complete = True
        self._paper_before: list[tuple[float, int]] = []
        self._paper_void = False
        self._rdp: np.ndarray | None = np.zeros(len(RDP_ORDERS))
        self._mu_squared = 0.0
        self._variance = 0.0
        self._sampled: pld_lib.PrivacyLossDistribution | None = None
        self._paper: pld_lib.PrivacyLossDistribution | None = None
        self._report: FdpReport | None = None

    @staticmethod
    def _mechanism_of(silos: Sequence[SiloPrivacy]) -> tuple[float, float, int, str]:
        """(σ, largest sampling rate, steps, batch sampling) of a round's clients."""
        parsed = [_parse(s.events["record"]) for s in silos if "record" in s.events]
        if not parsed:
            raise ValueError("Expected each client's record-level events, got none.")
        if len({(sigma, k, b) for sigma, _, k, b in parsed}) > 1:
            raise ValueError("Expected every client to run the same σ, steps and batch sampling.")
        sigma, _, steps, sampling = parsed[0]
        return sigma, max(rate for _, rate, _, _ in parsed), steps, sampling

    def compose_round(
        self,
        silos: Sequence[SiloPrivacy],
        *,
        count: int = 1,
        participants: int | None = None,
        client_rate: float | None = None,
    ) -> None:
        """Adds ``count`` rounds of the most exposed client's events among ``silos``.

        ``client_rate``: the rate ``p`` those rounds sampled clients at, when they belong to
        another run than this accountant's (a shared ledger's replay); default
        :attr:`client_rate`. Rounds at different rates compose each at its own rate."""
        check_int("count", count, 1)
        p = self.client_rate
        if client_rate is not None:
            p = check_probability("client_rate", client_rate)
        sigma, q, steps, sampling = self._mechanism_of(silos)
        _, step_variance = pld_loss_moments(_step_pld(sigma, q, sampling, self.discretization))
        variance = self._variance + step_variance * steps * count
        if not fits(variance, self.discretization):
            raise InvalidValueError(
                f"Expected a plan whose privacy loss distribution this machine can build: "
                f"{steps} local steps x {self.rounds + count} rounds of the replace-one "
                f"Gaussian at σ={sigma:g}, rate {q:g} needs more than {MAX_PLD_POINTS:.0e} "
                "grid points. Use fewer steps or rounds."
            )
        round_pld = _round_pld(sigma, q, steps, sampling, self.discretization)
        # the rounds with client sampling: each at its own rate (kept from the first sampled
        # round on; the rounds before it ran every client, which is what _all holds of them)
        if p < 1.0 or self._sampled is not None:
            if self._sampled is None and self.rounds:
                self._sampled = self._all
            identity = pld_lib.identity(value_discretization_interval=self.discretization)
            one = round_pld if p >= 1.0 else round_pld.compute_mixture(identity, p)
            self._sampled = _advance(self._sampled, one, count)
        # every round as if every client took part; calibration skips it when clients are
        # sampled, and then it no longer holds every round
        if self._all_complete and self.rigorous_only and p < 1.0:
            self._all, self._all_complete = None, False
        if self._all_complete:
            self._all = _advance(self._all, round_pld, count)
        if not self.rigorous_only:
            self._estimate_round(clt_mu(sigma, q, steps, batch_sampling=sampling), p, count)
        # the RDP route and the CLT μ add up over rounds (μ² is linear in the steps)
        rdp = _step_rdp(sigma, q, sampling)
        if rdp is None or self._rdp is None:
            self._rdp = None
        else:
            self._rdp = self._rdp + rdp * (steps * count)
        self._mu_squared += clt_mu(sigma, q, steps * count, batch_sampling=sampling) ** 2
        self._variance = variance
        self.rounds += count
        self._report = None

    def _estimate_round(self, mu_round: float, p: float, count: int) -> None:
        """Adds ``count`` rounds of CLT μ ``mu_round`` at client rate ``p`` to the paper's
        client-sampled estimate (kept from the first sampled round on, each round at its own μ
        and p; none once a round's μ is beyond :data:`MAX_ESTIMATE_MU`)."""
        if self._paper_void or mu_round > MAX_ESTIMATE_MU:
            self._paper_void, self._paper, self._paper_before = True, None, []
            return
        if p >= 1.0 and self._paper is None:  # no client sampled yet: kept for later
            self._paper_before.append((mu_round, count))
            return
        for mu_before, count_before in self._paper_before:  # rounds that ran every client
            self._paper = _advance(self._paper, self._paper_round(mu_before, 1.0), count_before)
        self._paper_before = []
        self._paper = _advance(self._paper, self._paper_round(mu_round, p), count)

    @staticmethod
    def _paper_round(mu_round: float, p: float) -> pld_lib.PrivacyLossDistribution:
        return tradeoff_pld(mu_round, p=p, discretization=ESTIMATE_DISCRETIZATION)

    def spec(self) -> dict[str, Any]:
        """What rebuilds an empty accountant like this one."""
        return {
            "kind": "fdp",
            "clients": self.clients,
            "client_rate": self.client_rate,
            "delta": self.delta,
            "discretization": self.discretization,
            "rigorous_only": self.rigorous_only,
        }

    def compose_release(self, silos: Sequence[SiloPrivacy]) -> None:
        raise ValueError(
            "Expected no release before training with PriFedSync: its replace-one record "
            "guarantee does not compose with the add/remove events of a release."
        )

    def report(self) -> FdpReport:
        """Everything this accountant knows after the rounds composed so far (computed once
        per composed state: ε, μ and the estimates of a round all come from it)."""
        if self._report is None:
            self._report = self._compute_report()
        return self._report

    def _compute_report(self) -> FdpReport:
        if self.rounds == 0:
            raise ValueError("Expected at least one composed round, got none.")
        r, delta = self.rounds, self.delta
        epsilon: dict[str, float] = {}
        route: dict[str, str] = {}
        if self._all is not None:
            every = {"pld": _epsilon(self._all, delta)}
            if self._rdp is not None:
                every["rdp"] = rdp_epsilon(RDP_ORDERS, self._rdp, delta)
            best = min(every, key=lambda key: every[key])
            epsilon["record_every_round"], route["record_every_round"] = every[best], best
        sampled = _epsilon(self._sampled, delta) if self._sampled is not None else math.inf
        if "record_every_round" in epsilon and epsilon["record_every_round"] <= sampled:
            epsilon["record"], route["record"] = (
                epsilon["record_every_round"],
                route["record_every_round"],
            )
        else:
            epsilon["record"], route["record"] = sampled, "pld-client-sampling"
        if self.rigorous_only:
            return FdpReport(round=r, mu={}, epsilon=epsilon, epsilon_route=route)
        mu_max = math.sqrt(self._mu_squared)
        mu = {
            "client_max": mu_max,
            "weak": mu_max,
            "strong": math.sqrt(self.clients - 1) * mu_max,
        }
        estimates = {
            "record_clt_weak": _gdp_epsilon_or_zero(mu["weak"], delta),
            "record_clt_strong": _gdp_epsilon_or_zero(mu["strong"], delta),
        }
        if self._paper is not None:
            estimates["record_clt_weak_client_sampling"] = _epsilon(self._paper, delta)
        return FdpReport(round=r, mu=mu, epsilon=epsilon, epsilon_route=route, estimates=estimates)

    def estimates(self, adversary: str | None = None) -> dict[str, Estimate]:
        report = self.report()
        return {
            key: Estimate(value, report.epsilon_route[key], {report.epsilon_route[key]: value})
            for key, value in report.epsilon.items()
        }

    def estimates_by_adversary(self) -> dict[str, dict[str, Estimate]]:
        """The same ε against every adversary: the client sample is accounted as known."""
        estimates = self.estimates()
        return {adversary: dict(estimates) for adversary in ADVERSARIES}

    def mu(self, adversary: str | None = None) -> dict[str, float]:
        """No μ of Gaussian DP holds: the subsampled mechanism's trade-off falls below every
        ``G_μ`` near α = 0 with μ < 1/σ, so its CLT μ is an estimate (:meth:`mu_estimates`)."""
        return {}

    def mu_estimates(self) -> dict[str, float]:
        """The paper's Theorem 2 μ by the central limit theorem (``client_max``, ``weak``,
        ``strong``): estimates, never guarantees."""
        return dict(self.report().mu)

    def labelled_estimates(self) -> dict[str, float]:
        return dict(self.report().estimates)


def _epsilon(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    return epsilon_for_delta(pld, delta)


def _advance(
    state: pld_lib.PrivacyLossDistribution | None,
    one: pld_lib.PrivacyLossDistribution,
    count: int,
) -> pld_lib.PrivacyLossDistribution:
    step = one if count == 1 else one.self_compose(count)
    return step if state is None else state.compose(step)


def _plan_events(plan: PriFedSyncPlan) -> list[SiloPrivacy]:
    return [
        step_events(plan.noise_multiplier, q, plan.local_steps, plan.batch_sampling)
        for q in plan.sample_rates
    ]


def _privacy_plan(plan: PriFedSyncPlan) -> PrivacyPlan:
    return PrivacyPlan(
        sampling_rates=plan.sample_rates,
        rounds=plan.rounds,
        silos_per_round=plan.clients,
        span=1,
        delta=plan.delta,
    )


def account_prifedsync(plan: PriFedSyncPlan, *, per_round: bool = False) -> list[FdpReport]:
    """Privacy of a PriFedSync plan: the final report (``[last]``) or one per round ``1..R``.

    The rigorous ε is that of the most exposed client (largest ``B_j/n_j``); for
    ``epsilon["record_every_round"]`` it takes part in every round, for ``epsilon["record"]``
    in each round with probability ``p`` (the two agree when ``p = 1``). Per-round reports
    compose one more round onto the kept state, so ``per_round=True`` costs about R PLD
    compositions, not R accountings.
    """
    accountant = FdpAccountant(clients=plan.clients, client_rate=plan.client_rate, delta=plan.delta)
    events = _plan_events(plan)
    if not per_round:
        accountant.compose_round(events, count=plan.rounds)
        return [accountant.report()]
    reports = []
    for _ in range(plan.rounds):
        accountant.compose_round(events)
        reports.append(accountant.report())
    return reports


def accountant_for(clients: int, client_rate: float, delta: float):  # type: ignore[no-untyped-def]
    """The accountant factory of :func:`~silodp.accounting.calibrate.calibrate_noise`: the
    rigorous PLD route on a coarse grid while searching, every route when reporting."""

    def make(stage: str, units: Sequence[str]) -> FdpAccountant:
        if stage == "report":
            return FdpAccountant(clients=clients, client_rate=client_rate, delta=delta)
        return FdpAccountant(
            clients=clients,
            client_rate=client_rate,
            delta=delta,
            discretization=CALIBRATION_DISCRETIZATION,
            rigorous_only=True,
        )

    return make


def calibrate_prifedsync(plan: PriFedSyncPlan, *, target_epsilon: float) -> float:
    """Smallest σ (relative tolerance 1e-3) whose rigorous record ε is at most the target:
    :func:`~silodp.accounting.calibrate.calibrate_noise` on these events and this accountant.

    ``plan.noise_multiplier`` is ignored. The search runs on a coarser PLD grid; the result is
    confirmed on the reporting grid, so ``account_prifedsync(...)[-1].epsilon["record"] <=
    target_epsilon``.

    Raises:
      CalibrationError: the target is not positive or is unreachable.
    """
    return calibrate_noise(
        lambda sigma: _plan_events(_with_sigma(plan, sigma)),
        accountant_for(plan.clients, plan.client_rate, plan.delta),
        _privacy_plan(plan),
        target_epsilon=target_epsilon,
        unit="record",
        rel_tol=1e-3,
        what="'prifedsync'",
    )


def _with_sigma(plan: PriFedSyncPlan, sigma: float) -> PriFedSyncPlan:
    return PriFedSyncPlan(
        noise_multiplier=sigma,
        sample_rates=plan.sample_rates,
        local_steps=plan.local_steps,
        rounds=plan.rounds,
        client_rate=plan.client_rate,
        delta=plan.delta,
        batch_sampling=plan.batch_sampling,
    )
