"""Accounting against an adversary that knows the sub-sample (no amplification)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from silodp.accounting import FederatedAccountant, SiloPrivacy
from silodp.accounting import conversions as conv
from silodp.accounting.events import (
    gaussian_steps,
    known_sample_gaussian_steps,
    poisson_gaussian_steps,
)
from silodp.accounting.pld import event_pld

DELTA = 1e-5


def closed_form_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    """δ(ε) = Σ_n Bin(n; R, q)·δ_Gauss(ε; √n/σ), solved for ε (independent of silodp)."""
    n = np.arange(rounds + 1)
    weights = stats.binom.pmf(n, rounds, q)
    mu = np.sqrt(n[1:]) / sigma

    def excess(eps: float) -> float:
        gauss = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )
        return float((weights[1:] * gauss).sum()) - delta

    return optimize.brentq(excess, 1e-9, 200.0)


# (q, σ, R) -> the figures of the review: amplified vs known sample
CASES = [(0.1, 1.0, 50, 5.15, 16.07), (0.5, 2.0, 100, 14.28, 21.59), (0.05, 5.0, 300, 0.64, 3.65)]


@pytest.mark.parametrize(("q", "sigma", "rounds", "amplified", "known"), CASES)
def test_known_sample_matches_closed_form(q, sigma, rounds, amplified, known) -> None:
    exact = closed_form_epsilon(q, sigma, rounds, DELTA)
    assert exact == pytest.approx(known, abs=0.01)
    event = known_sample_gaussian_steps(q, sigma, 1)
    pld = event_pld(event, 1e-3).self_compose(rounds).get_epsilon_for_delta(DELTA)
    rdp = conv.rdp_epsilon(conv.RDP_ORDERS, rounds * conv.rdp_curve(event), DELTA)
    # upper bounds, and tight for the PLD
    assert exact <= pld <= exact * (1 + 1e-3)
    assert rdp >= exact
    amp = event_pld(poisson_gaussian_steps(q, sigma, 1), 1e-3).self_compose(rounds)
    assert amp.get_epsilon_for_delta(DELTA) == pytest.approx(amplified, abs=0.01)


def test_known_sample_rate_one_is_the_gaussian() -> None:
    known = event_pld(known_sample_gaussian_steps(1.0, 1.3, 1), 1e-3).self_compose(10)
    plain = event_pld(gaussian_steps(1.3, 1), 1e-3).self_compose(10)
    assert known.get_epsilon_for_delta(DELTA) == pytest.approx(
        plain.get_epsilon_for_delta(DELTA), rel=1e-6
    )


def _uldp_round(q: float, sigma: float, *, knows: tuple[str, ...]) -> SiloPrivacy:
    known = {"subject": known_sample_gaussian_steps(q, sigma, 1)}
    return SiloPrivacy(
        {"subject": poisson_gaussian_steps(q, sigma, 1)},
        scope="aggregate",
        views={adversary: known for adversary in knows},
    )


def test_accountant_reports_each_adversary() -> None:
    acc = FederatedAccountant(units=("subject",), span=3, delta=DELTA)
    acc.compose_round([_uldp_round(0.1, 1.0, knows=("server",))] * 3, count=50)
    by = acc.estimates_by_adversary()
    assert by["released"]["subject"].epsilon == pytest.approx(5.15, abs=0.02)
    assert by["silos"]["subject"].epsilon == by["released"]["subject"].epsilon
    assert by["server"]["subject"].epsilon == pytest.approx(16.07, abs=0.03)
    strongest = acc.estimates("strongest")["subject"]
    assert strongest.epsilon == by["server"]["subject"].epsilon
    assert acc.split_adversaries == ("server",)


def test_an_adversary_that_learns_the_sample_later_keeps_the_shared_history() -> None:
    acc = FederatedAccountant(units=("subject",), span=1, delta=DELTA, routes=("pld",))
    acc.compose_round([_uldp_round(0.1, 1.0, knows=())], count=10)
    acc.compose_round([_uldp_round(0.1, 1.0, knows=("silos",))], count=10)
    reference = FederatedAccountant(units=("subject",), span=1, delta=DELTA, routes=("pld",))
    reference.compose_round([_uldp_round(0.1, 1.0, knows=())], count=10)
    reference.compose_round([_uldp_round(0.1, 1.0, knows=())], count=10)
    amplified = reference.estimates()["subject"].epsilon
    mixed = acc.estimates("silos")["subject"].epsilon
    assert acc.estimates("released")["subject"].epsilon == pytest.approx(amplified)
    assert acc.estimates()["subject"].epsilon == mixed  # default: the strongest adversary
    assert mixed > amplified * 1.5  # ten unamplified rounds cost far more
    with pytest.raises(ValueError, match="adversary='everyone'"):
        acc.estimates("everyone")


def test_views_must_cover_the_same_units() -> None:
    with pytest.raises(ValueError, match="view to cover units"):
        SiloPrivacy(
            {"subject": gaussian_steps(1.0, 1)},
            views={"server": {"record": gaussian_steps(1.0, 1)}},
        )
