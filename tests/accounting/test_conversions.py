"""Group-privacy and Gaussian-DP conversions against closed forms and hand computations."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import integrate, optimize, stats

from silodp.accounting import conversions as cv
from silodp.accounting.events import gaussian_steps, poisson_gaussian_steps

# --- RDP curves ---------------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.5, 1.0, 3.7])
@pytest.mark.parametrize("steps", [1, 7, 1000])
def test_gaussian_rdp_curve_closed_form(z, steps) -> None:
    """RDP of T unsampled Gaussians is α·T/(2z²) (also guards the private ``_rdp`` read)."""
    curve = cv.rdp_curve(gaussian_steps(z, steps))
    expected = cv.RDP_ORDERS * steps / (2 * z**2)
    np.testing.assert_allclose(curve, expected, rtol=1e-12, atol=0)
    orders = np.array([1.5, 2.0, 10.0, 77.0])
    np.testing.assert_allclose(
        cv.rdp_curve(gaussian_steps(z, steps), orders), orders * steps / (2 * z**2), rtol=1e-12
    )


def test_rdp_curve_is_a_copy_of_the_cache() -> None:
    event = gaussian_steps(1.0, 3)
    first = cv.rdp_curve(event)
    first[:] = -1.0
    np.testing.assert_allclose(cv.rdp_curve(event), cv.RDP_ORDERS * 3 / 2)


@pytest.mark.parametrize(
    "event",
    [
        gaussian_steps(1.3, 20),
        poisson_gaussian_steps(0.02, 1.1, 300),
        # a tuple: silodp caches curves per event, so events must be hashable
        dp_event.ComposedDpEvent((poisson_gaussian_steps(0.1, 2.0, 10), gaussian_steps(5.0, 2))),
    ],
)
def test_rdp_epsilon_matches_dp_accounting_public_api(event) -> None:
    orders = [float(a) for a in cv.RDP_ORDERS]
    acc = rdp_lib.RdpAccountant(orders=orders)
    acc.compose(event)
    expected = acc.get_epsilon(1e-6)
    got = cv.rdp_epsilon(cv.RDP_ORDERS, cv.rdp_curve(event), 1e-6)
    # sub-sampled Gaussians' integer orders are silodp's sum, 1e-9 above the exact value
    # (dp-accounting's own sum is within ~6e-9 of it)
    assert got == pytest.approx(expected, rel=1e-8)


def _exact_rdp(q: float, sigma: float, alpha: int) -> float:
    """log A_α / (α - 1) of the sub-sampled Gaussian summed term by term in 40 digits."""
    mpmath.mp.dps = 40
    q_, s_ = mpmath.mpf(q), mpmath.mpf(sigma)
    total = mpmath.fsum(
        mpmath.binomial(alpha, i)
        * q_**i
        * (1 - q_) ** (alpha - i)
        * mpmath.exp(mpmath.mpf(i * i - i) / (2 * s_ * s_))
        for i in range(alpha + 1)
    )
    return float(mpmath.log(total) / (alpha - 1))


def test_subsampled_gaussian_curve_is_an_upper_bound_within_its_slack() -> None:
    """Integer orders, summed at once as log1p of a sum of positive terms: at or above the
    exact value (40 digits) by at most twice the slack, over a spread of q and σ, and a σ
    0.1% off is told apart (dp-accounting's sum one term at a time was up to 1.2e-9 below
    the exact value here). Fractional orders are dp-accounting's own."""
    rng = np.random.default_rng(7)
    orders = np.array([2.0, 3.0, 10.0, 64.0, 256.0, 1024.0, 1.5, 7.5])
    for _ in range(6):
        q, sigma = 10 ** rng.uniform(-4, -0.01), 10 ** rng.uniform(-0.5, 1.5)
        ours = cv.rdp_curve(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), orders
        )
        exact = np.array([_exact_rdp(q, sigma, int(a)) for a in orders[:6]])
        assert (ours[:6] >= exact).all(), (q, sigma)
        assert (ours[:6] <= exact * (1 + 2 * cv.RDP_SLACK)).all(), (q, sigma)
        off = np.array([_exact_rdp(q, sigma * 1.001, int(a)) for a in orders[:6]])
        assert (np.abs(ours[:6] - off) > 2 * cv.RDP_SLACK * exact).all()
        theirs = rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, sigma, list(orders[6:]))
        np.testing.assert_array_equal(ours[6:], theirs)


def test_rdp_epsilon_without_orders_is_inf() -> None:
    assert cv.rdp_epsilon(np.array([]), np.array([]), 1e-5) == math.inf


# --- RDP group conversion (Mironov 2017, Prop. 2) -------------------------------------------


def test_rdp_group_k1_is_identity() -> None:
    curve = cv.rdp_curve(poisson_gaussian_steps(0.05, 1.0, 50))
    orders, grouped = cv.rdp_group_curve(cv.RDP_ORDERS, curve, 1)
    np.testing.assert_array_equal(orders, cv.RDP_ORDERS)
    np.testing.assert_array_equal(grouped, curve)


@pytest.mark.parametrize(("k", "c"), [(2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (16, 4)])
def test_rdp_group_power_of_two_by_hand(k, c) -> None:
    """k is rounded up to 2^c; orders α >= 2^{c+1} map to α/2^c with ε scaled by 3^c."""
    orders = np.array([1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0, 100.0])
    rdp = np.sqrt(orders) + 0.25 * orders  # any increasing curve
    new_orders, new_rdp = cv.rdp_group_curve(orders, rdp, k)
    keep = [i for i, a in enumerate(orders) if a >= 2 ** (c + 1)]
    assert list(new_orders) == [orders[i] / 2**c for i in keep]
    np.testing.assert_allclose(new_rdp, [rdp[i] * 3**c for i in keep], rtol=1e-15)
    assert np.all(new_orders >= 2.0)


def test_rdp_group_three_equals_four() -> None:
    curve = cv.rdp_curve(poisson_gaussian_steps(0.01, 1.0, 100))
    o3, r3 = cv.rdp_group_curve(cv.RDP_ORDERS, curve, 3)
    o4, r4 = cv.rdp_group_curve(cv.RDP_ORDERS, curve, 4)
    np.testing.assert_array_equal(o3, o4)
    np.testing.assert_array_equal(r3, r4)


def test_rdp_group_of_gaussian_is_valid() -> None:
    """For a Gaussian the exact group RDP is α k²/(2z²); Prop. 2 must not undercut it."""
    z, k = 2.0, 4
    curve = cv.rdp_curve(gaussian_steps(z, 1))
    orders, grouped = cv.rdp_group_curve(cv.RDP_ORDERS, curve, k)
    exact = orders * k**2 / (2 * z**2)
    assert np.all(grouped >= exact * (1 - 1e-12))


def test_rdp_group_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="group_size=0"):
        cv.rdp_group_curve(cv.RDP_ORDERS, cv.RDP_ORDERS, 0)


# --- (ε, δ) group conversion (Dwork & Roth, Thm 2.2) -----------------------------------------


def _gaussian_eps(sigma: float):
    """Exact ε(δ) of one Gaussian with noise multiplier σ (it is (1/σ)-GDP)."""
    return lambda d: cv.gdp_epsilon(1.0 / sigma, d)


def _hand_group_epsilon(eps_at, k: int, m: int, delta: float) -> float:
    """min m k ε(δ_r) s.t. m k e^{(k-1) ε(δ_r)} δ_r <= δ, solved by root finding.

    The constraint's left side increases in δ_r and ε(δ_r) decreases in δ_r, so the optimum is
    the δ_r where the constraint is tight.
    """

    def gap(log_dr: float) -> float:
        return math.log(m * k) + (k - 1) * eps_at(math.exp(log_dr)) + log_dr - math.log(delta)

    top = math.log(delta / (m * k))
    log_dr = optimize.brentq(gap, top - 600.0, top, xtol=1e-12)
    return m * k * eps_at(math.exp(log_dr))


@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("m", [1, 3])
def test_group_epsilon_dp_matches_hand_value(sigma, k, m) -> None:
    delta = 1e-5
    eps_at = _gaussian_eps(sigma)
    got = cv.group_epsilon_dp(eps_at, group_size=k, delta=delta, compositions=m)
    hand = _hand_group_epsilon(eps_at, k, m, delta)
    # the grid search can only be above the continuous optimum, and close to it
    assert got >= hand * (1 - 1e-9)
    assert got <= hand * 1.02
    # and the value is attained by a δ_r meeting the budget
    eps_r = got / (m * k)
    log_dr = optimize.brentq(
        lambda t: eps_at(math.exp(t)) - eps_r, -700.0, math.log(0.5), xtol=1e-12
    )
    assert math.log(m * k) + (k - 1) * eps_r + log_dr <= math.log(delta) + 1e-6


def test_group_epsilon_dp_single_record_is_the_record_epsilon() -> None:
    eps_at = _gaussian_eps(2.0)
    got = cv.group_epsilon_dp(eps_at, group_size=1, delta=1e-5)
    assert got == pytest.approx(eps_at(1e-5), rel=1e-3)
    assert got >= eps_at(1e-5)


def test_group_epsilon_dp_large_groups_stay_finite() -> None:
    """Large k needs δ_r ~ e^{-(k-1) ε_r}: far below δ, but still a finite valid bound."""
    for sigma, k in ((3.0, 20), (10.0, 64)):  # optimum near δ_r ~ e^-80, below e^-40·δ/k
        eps_at = _gaussian_eps(sigma)
        got = cv.group_epsilon_dp(eps_at, group_size=k, delta=1e-5)
        hand = _hand_group_epsilon(eps_at, k, 1, 1e-5)
        assert hand * (1 - 1e-9) <= got <= hand * 1.02


def test_group_epsilon_dp_infinite_when_nothing_fits() -> None:
    assert cv.group_epsilon_dp(lambda d: math.inf, group_size=3, delta=1e-5) == math.inf


# --- Gaussian DP ----------------------------------------------------------------------------


def _delta_by_density_integral(mu: float, eps: float) -> float:
    """∫ max(0, p(x) - e^ε q(x)) dx with P = N(μ, 1), Q = N(0, 1) (hockey stick)."""

    def f(x: float) -> float:
        return max(0.0, stats.norm.pdf(x, loc=mu) - math.exp(eps) * stats.norm.pdf(x))

    lo, hi = -12.0, mu + 12.0 + eps / mu
    value, _ = integrate.quad(f, lo, hi, points=[eps / mu + mu / 2], limit=500, epsabs=1e-14)
    return value


def _delta_by_tradeoff(mu: float, eps: float) -> float:
    """sup_α 1 - G_μ(α) - e^ε α with G_μ(α) = Φ(Φ^{-1}(1-α) - μ) (f-DP duality), numerically."""

    def neg(t):  # α = Φ(-t) is the type-I error of the threshold test "reject if x > t"
        alpha = stats.norm.sf(t)
        beta = stats.norm.cdf(t - mu)  # G_μ(α): type-II error against N(μ, 1)
        return -(1.0 - beta - math.exp(eps) * alpha)

    grid = np.linspace(-20.0, 40.0, 60_001)
    t0 = float(grid[np.argmin(neg(grid))])
    res = optimize.minimize_scalar(
        neg, bounds=(t0 - 2e-3, t0 + 2e-3), method="bounded", options={"xatol": 1e-12}
    )
    return max(0.0, -res.fun)


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 4.0])
def test_gdp_delta_against_numeric_integrals(mu, eps) -> None:
    got = cv.gdp_delta(mu, eps)
    by_density = _delta_by_density_integral(mu, eps)
    by_tradeoff = _delta_by_tradeoff(mu, eps)
    assert got == pytest.approx(by_density, rel=1e-6, abs=1e-13)
    assert got == pytest.approx(by_tradeoff, rel=1e-6, abs=1e-13)


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 1e-2])
def test_gdp_round_trip(mu, delta) -> None:
    eps = cv.gdp_epsilon(mu, delta)
    if eps == 0.0:
        assert cv.gdp_delta(mu, 0.0) <= delta
    else:
        assert cv.gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-6)
        assert cv.gdp_delta(mu, eps * 0.99) > delta
    assert cv.gdp_epsilon(mu, cv.gdp_delta(mu, 1.5)) == pytest.approx(1.5, rel=1e-7)


def test_gdp_epsilon_monotone() -> None:
    mus = [0.2, 0.5, 1.0, 2.0, 4.0]
    eps = [cv.gdp_epsilon(m, 1e-5) for m in mus]
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    deltas = [1e-9, 1e-6, 1e-3]
    eps = [cv.gdp_epsilon(1.0, d) for d in deltas]
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False))


def test_gdp_tiny_mu_gives_zero_epsilon() -> None:
    assert cv.gdp_epsilon(1e-8, 1e-3) == 0.0


def test_gdp_bad_inputs() -> None:
    with pytest.raises(ValueError, match="mu=0"):
        cv.gdp_delta(0.0, 1.0)
    with pytest.raises(ValueError, match="mu=-1"):
        cv.gdp_epsilon(-1.0, 1e-5)
    with pytest.raises(ValueError, match="delta=1.5"):
        cv.gdp_epsilon(1.0, 1.5)
