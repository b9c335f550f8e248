"""The exact Gaussian noise: the rounded Gaussian has exactly the law of round(N(0, s²)) (tests
accept the right s and reject a 2% larger one), its rare exact paths agree with arbitrary
precision, its tails go beyond any float32 Box–Muller output, and the Gaussian mechanism
releases values on its grid that hide the input's low-order bits."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

import silodp.privacy.cdf_table as table_module
import silodp.privacy.noise as noise_module
import silodp.privacy.rounded_gaussian as sampler_module
from silodp.privacy.noise import (
    _draw,
    _Lazy,
    _position_exact,
    _table,
    _tail_exact,
    gaussian_mechanism,
    grid_exponent,
    rounded_gaussian,
)
from silodp.privacy.randomness import Coins

# Significance level: a test with secure coins fails spuriously with probability < ALPHA.
# Statistical tests draw from seeded coins (deterministic); those that say so also reject a
# wrong law at this level (e.g. σ 2-10% off, an acceptance ratio 10% off)
ALPHA = 1e-7


def exact_cdf(edges: np.ndarray, scale: float) -> np.ndarray:
    """``P(Z < e)`` for ``Z ~ N(0, scale²)`` (float64 is ample for bins of mass > 1e-6)."""
    return stats.norm.cdf(np.asarray(edges, dtype=np.float64) / scale)


def chi2_pvalue(k: np.ndarray, scale: float, bins: int = 60) -> float:
    """Chi-square test of ``k`` against the exact law of round(N(0, scale²)) on bins of
    integers with roughly equal mass (edges at half-integers)."""
    qs = stats.norm.ppf(np.linspace(0, 1, bins + 1)[1:-1]) * scale
    edges = np.unique(np.floor(qs) + 0.5)
    probs = np.diff(np.concatenate([[0.0], exact_cdf(edges, scale), [1.0]]))
    counts = np.bincount(np.searchsorted(edges, k.astype(np.float64)), minlength=probs.size)
    expected = probs * k.size
    return float(stats.chisquare(counts, expected).pvalue)


def variance_pvalue(z: np.ndarray, scale: float) -> float:
    """Two-sided chi-square test of H0: z ~ iid N(0, scale²) via Σz²/scale² ~ χ²(n)."""
    stat = float(np.sum(np.square(z, dtype=np.float64))) / scale**2
    return float(min(1.0, 2.0 * min(stats.chi2.cdf(stat, z.size), stats.chi2.sf(stat, z.size))))


def ks_pvalue(k: np.ndarray, scale: float) -> float:
    """KS distance of the sample's CDF from the exact discrete CDF, at the sample's support
    points (a discrete law makes the usual p-value conservative, so this errs towards
    acceptance under H0 and keeps power against a wrong scale)."""
    values, counts = np.unique(k, return_counts=True)
    empirical = np.cumsum(counts) / k.size
    exact = exact_cdf(values + 0.5, scale)
    d = float(np.max(np.abs(empirical - exact)))
    return float(stats.kstwo.sf(d, k.size))


@pytest.mark.parametrize("scale", [0.4, 3.0, 200.0, 2.0**30 * 1.37])
def test_rounded_gaussian_has_the_exact_law_and_rejects_a_wrong_scale(scale) -> None:
    k = rounded_gaussian(400_000, scale=scale, coins=Coins.seeded(101))
    assert k.dtype == np.int64
    assert chi2_pvalue(k, scale) > ALPHA
    assert ks_pvalue(k, scale) > ALPHA
    assert chi2_pvalue(k, scale * 1.02) < ALPHA or ks_pvalue(k, scale * 1.02) < ALPHA


def test_rounded_gaussian_is_seeded_by_its_coins() -> None:
    a = rounded_gaussian(1000, scale=2.0**30, coins=Coins.seeded(5))
    b = rounded_gaussian(1000, scale=2.0**30, coins=Coins.seeded(5))
    c = rounded_gaussian(1000, scale=2.0**30, coins=Coins.seeded(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(
        rounded_gaussian(1000, scale=2.0**30, coins=Coins.secure()),
        rounded_gaussian(1000, scale=2.0**30, coins=Coins.secure()),
    )


def test_large_scales_beyond_the_guide_stay_int64_while_they_fit() -> None:
    for scale in (2.0**40, 2.0**55):  # offsets from fresh words (m > 26)
        k = rounded_gaussian(50_000, scale=scale, coins=Coins.seeded(102))
        assert k.dtype == np.int64
        z = k.astype(np.float64) / scale
        assert stats.kstest(z, "norm").pvalue > ALPHA
        assert variance_pvalue(z, 1.02) < ALPHA


def test_huge_scale_gives_python_ints_with_the_right_law() -> None:
    scale = Fraction(2**100) + Fraction(1, 3)
    k = rounded_gaussian(80_000, scale=scale, coins=Coins.seeded(103))
    assert k.dtype == object and all(isinstance(v, int) for v in k[:10])
    z = np.array([float(Fraction(v) / scale) for v in k])  # exact ints, then standardised
    assert stats.kstest(z, "norm").pvalue > ALPHA
    assert variance_pvalue(z, 1.0) > ALPHA
    assert variance_pvalue(z, 1.02) < ALPHA


def test_float32_box_muller_cannot_reach_the_tails_the_sampler_reaches() -> None:
    """The old float32 sampler's radius is at most sqrt(-2 ln 2^-24) = 5.768σ. Conditioning
    the coarse uniform on its first 30 bits being 0 (so U < 2^-30, i.e. Z < -5.99σ) must give
    exactly the lower tail of the rounded Gaussian, which the old sampler never produced."""
    assert math.sqrt(-2 * math.log(2.0**-24)) < 5.77
    scale = 64.0
    table = _table(Fraction(scale))
    n = 4000
    coins = Coins.seeded(104)
    prefix = np.zeros(n, dtype=np.uint64)  # first 30 bits zero, the next 34 random
    prefix |= coins.uint64(n) >> np.uint64(30)
    k, _ = _draw(table, n, coins, prefix=prefix, bits=64)
    k = k.astype(np.float64)
    assert np.all(k < -5.9 * scale)
    # conditional law: P(K <= k | U < 2^-30) = Φ((k+½)/s) / 2^-30, compared at the sample's
    # support points
    values, counts = np.unique(k, return_counts=True)
    empirical = np.cumsum(counts) / n
    exact = stats.norm.cdf((values + 0.5) / scale) / 2.0**-30
    assert float(stats.kstwo.sf(np.max(np.abs(empirical - exact)), n)) > ALPHA
    wrong = stats.norm.cdf((values + 0.5) / (1.02 * scale)) / stats.norm.cdf(
        stats.norm.ppf(2.0**-30) * 1.0
    )
    assert float(stats.kstwo.sf(np.max(np.abs(empirical - wrong)), n)) < ALPHA


def test_tail_counts_match_the_gaussian() -> None:
    """10^7 draws: the count beyond 4.5σ is Poisson with the exact mean (about 73; at a 5%
    larger σ it would be about 195, which this rejects)."""
    scale = 32.0
    k = rounded_gaussian(10_000_000, scale=scale, coins=Coins.seeded(105))
    cut = math.ceil(4.5 * scale)
    mean = 10_000_000 * 2 * stats.norm.sf((cut - 0.5) / scale)
    count = int(np.sum(np.abs(k) >= cut))
    assert stats.poisson.cdf(count, mean) > ALPHA / 2 and stats.poisson.sf(count - 1, mean) > ALPHA


# --- the exact paths -----------------------------------------------------------------------


def _reference_position(table, u: Fraction) -> int:
    """``#{j : Φ(b_j/s) <= u}`` at 600 bits."""
    with mpmath.workprec(600):
        uu = mpmath.mpf(u.numerator) / u.denominator
        count = 0
        for j in range(table.size):
            b = Fraction(2 * (table.c_lo + j) * table.cell - 1, 2) / table.scale
            cdf = mpmath.ncdf(mpmath.mpf(b.numerator) / b.denominator)
            count += cdf <= uu
        return count


@pytest.mark.parametrize("scale", [1.5, 300.0])
def test_position_at_a_boundary_goes_to_arbitrary_precision(scale) -> None:
    """Uniforms within 2^-300 of a boundary tie the 128-bit table and need mpmath; the
    answer must match a 600-bit reference."""
    table = _table(Fraction(scale))
    for j in (1, table.size // 3, table.size // 2, table.size - 2):
        b = Fraction(2 * (table.c_lo + j) * table.cell - 1, 2) / table.scale
        with mpmath.workprec(700):
            cdf = mpmath.ncdf(mpmath.mpf(b.numerator) / b.denominator)
            bits = int(mpmath.floor(mpmath.ldexp(cdf, 400)))
        for prefix in (bits - 1, bits + 1):
            lazy = _Lazy(prefix, 400, Coins.seeded(1))
            got = _position_exact(table, lazy)
            assert lazy.bits == 400  # decided from the given bits
            assert got == _reference_position(table, Fraction(prefix, 2**400))
            assert got == (j if prefix < bits else j + 1)


def test_injected_ties_are_resolved_consistently() -> None:
    """Coarse prefixes equal to a boundary's 32-bit prefix go through the exact path; each
    result lies in one of the two cells next to that boundary."""
    table = _table(Fraction(2.0**30 * 1.37))
    js = np.arange(5, table.size - 5, 7)
    # boundaries alone in their 32-bit prefix (the far tails share prefixes 0 and 2^32 - 1)
    js = js[(table.above32[js] > 2**24) & (table.above32[js] < 2**32 - 2**24)]
    assert js.size > 50
    prefix = (table.above32[js] - 1).astype(np.uint64)  # undecided at 32 bits
    n = js.size
    k, _ = _draw(table, n, Coins.seeded(106), prefix=prefix, bits=32)
    edges = (table.c_lo + js) * table.cell  # first point above boundary j
    assert np.all((k >= edges - table.cell) & (k < edges + table.cell))


def test_fallback_positions_alone_have_the_exact_cell_probabilities() -> None:
    """Cells chosen by the arbitrary-precision path only (a uniform with no bits yet)."""
    scale = 2.5
    table = _table(Fraction(scale))
    coins = Coins.seeded(107)
    n = 3000
    positions = np.array([_position_exact(table, _Lazy(0, 0, coins)) for _ in range(n)])
    edges = np.array([(table.c_lo + j) * table.cell - 0.5 for j in range(table.size)])
    probs = np.diff(np.concatenate([[0.0], exact_cdf(edges, scale), [1.0]]))
    keep = probs * n >= 5
    counts = np.bincount(positions, minlength=probs.size)
    obs = np.concatenate([counts[keep], [counts[~keep].sum()]])
    exp = np.concatenate([probs[keep], [probs[~keep].sum()]]) * n
    assert stats.chisquare(obs, exp).pvalue > ALPHA


def test_exact_acceptance_alone_accepts_at_the_mass_ratio() -> None:
    """``_accept_exact`` by itself, where the ratio ``p_k / p_k*`` is far from 1 (the sampler's
    own scales keep it within 2^-58 of 1, where no sample could tell a wrong ratio): it
    accepts at the ratio, and a ratio 10% off is rejected."""
    from silodp.privacy.exact_cdf import _accept_exact

    scale = Fraction(3, 2)

    def mass(k: int) -> float:
        return float(stats.norm.cdf((k + 0.5) / 1.5) - stats.norm.cdf((k - 0.5) / 1.5))

    coins = Coins.seeded(109)
    ratio = mass(2) / mass(1)  # = mass(-2) / mass(-1), about 0.53
    n = 3000
    accepted = 0
    for k, kstar in ((2, 1), (-2, -1)):
        accepted += sum(_accept_exact(_Lazy(0, 0, coins), k, kstar, scale) for _ in range(n))
    assert stats.binomtest(accepted, 2 * n, ratio).pvalue > ALPHA
    for wrong in (0.9 * ratio, 1.1 * ratio):
        assert stats.binomtest(accepted, 2 * n, wrong).pvalue < ALPHA


def test_fallback_acceptance_alone_has_the_exact_fine_law(monkeypatch) -> None:
    """Force every acceptance through mpmath (float margin 1): within a cell, the accepted
    points must follow the exact masses."""
    monkeypatch.setattr(table_module, "FLOAT_MARGIN", 1.0)
    noise_module._table.cache_clear()
    try:
        scale = 130.0  # M = 2: cells of two points
        k = rounded_gaussian(3000, scale=scale, coins=Coins.seeded(108))
        assert chi2_pvalue(k, scale, bins=20) > ALPHA
    finally:
        noise_module._table.cache_clear()


def test_tail_inversion_is_the_exact_inverse_cdf() -> None:
    table = _table(Fraction(3.0))
    u = Fraction(1, 2**80) + Fraction(1, 2**200)
    lazy = _Lazy(u.numerator, 200, Coins.seeded(0))
    k = _tail_exact(table, lazy, 0)
    with mpmath.workprec(400):
        uu = mpmath.mpf(u.numerator) / u.denominator
        assert mpmath.ncdf((k - 0.5) / 3.0) <= uu < mpmath.ncdf((k + 0.5) / 3.0)
    upper = _Lazy(2**200 - u.numerator, 200, Coins.seeded(0))
    assert _tail_exact(table, upper, table.size) == -k


# --- the Gaussian mechanism ----------------------------------------------------------------


def test_mechanism_releases_grid_values_with_the_right_sigma() -> None:
    sigma, clip = 0.8, 1.5
    values = {"w": torch.zeros(300_000), "b": torch.zeros(7, 3)}
    out = gaussian_mechanism(
        values, noise_multiplier=sigma, sensitivity=clip, coins=Coins.seeded(109)
    )
    assert set(out) == {"w", "b"} and out["b"].shape == (7, 3)
    assert all(t.dtype == torch.float64 for t in out.values())
    g = 2.0 ** grid_exponent(sigma * clip)
    z = torch.cat([t.reshape(-1) for t in out.values()]).numpy()
    assert np.array_equal(z / g, np.round(z / g))
    scale = sigma * clip  # in value units; the widening is below 1e-6 here
    assert stats.kstest(z, stats.norm(scale=scale).cdf).pvalue > ALPHA
    assert variance_pvalue(z, scale) > ALPHA
    assert variance_pvalue(z, 1.02 * scale) < ALPHA


def test_mechanism_hides_bits_below_the_grid() -> None:
    """Inputs that differ below the grid give identical releases for the same coins."""
    g = 2.0 ** grid_exponent(1.0)
    base = torch.linspace(-3, 3, 1001, dtype=torch.float64)
    base = torch.round(base / g) * g
    jitter = (torch.rand(1001, dtype=torch.float64) - 0.5) * 0.8 * g
    a = gaussian_mechanism(
        {"w": base}, noise_multiplier=1.0, sensitivity=1.0, coins=Coins.seeded(3)
    )
    b = gaussian_mechanism(
        {"w": base + jitter}, noise_multiplier=1.0, sensitivity=1.0, coins=Coins.seeded(3)
    )
    assert torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("shares", [2, 3])
def test_mechanism_shares_sum_to_the_full_noise(shares) -> None:
    sigma, clip, d = 1.0, 2.0, 100_000
    x = torch.randn(d, dtype=torch.float64)
    parts = [
        gaussian_mechanism(
            {"w": x / shares},
            noise_multiplier=sigma,
            sensitivity=clip,
            coins=Coins.seeded(110, party),  # each party its own stream
            shares=shares,
        )["w"]
        for party in range(shares)
    ]
    g = 2.0 ** grid_exponent(sigma * clip / math.sqrt(shares))
    for p in parts:  # each message: a multiple of g; its snapped part a multiple of S·g
        assert torch.equal(p / g, torch.round(p / g))
    total = sum(parts)
    residual = (total - x).numpy()
    assert stats.kstest(residual, stats.norm(scale=sigma * clip).cdf).pvalue > ALPHA
    assert variance_pvalue(residual, sigma * clip) > ALPHA
    assert variance_pvalue(residual, 1.02 * sigma * clip) < ALPHA


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, "noise_multiplier"),
        ({"sensitivity": 0.0}, "sensitivity"),
        ({"shares": 0}, "shares"),
    ],
)
def test_mechanism_refuses_bad_parameters(kwargs, name) -> None:
    args = {"noise_multiplier": 1.0, "sensitivity": 1.0, "shares": 1, **kwargs}
    with pytest.raises(ValueError, match=name):
        gaussian_mechanism({"w": torch.zeros(3)}, coins=Coins.seeded(0), **args)


def test_mechanism_refuses_values_off_the_grid_range() -> None:
    with pytest.raises(ValueError, match="2\\^52"):
        gaussian_mechanism(
            {"w": torch.tensor([1e30])},
            noise_multiplier=1.0,
            sensitivity=1.0,
            coins=Coins.seeded(0),
        )
    with pytest.raises(ValueError, match="2\\^52"):
        gaussian_mechanism(
            {"w": torch.tensor([math.nan])},
            noise_multiplier=1.0,
            sensitivity=1.0,
            coins=Coins.seeded(0),
        )


def test_empty_draws() -> None:
    assert rounded_gaussian(0, scale=3.0, coins=Coins.seeded(0)).shape == (0,)
    out = gaussian_mechanism(
        {"w": torch.zeros(0)}, noise_multiplier=1.0, sensitivity=1.0, coins=Coins.seeded(0)
    )
    assert out["w"].shape == (0,)


def test_rounded_gaussian_refuses_bad_scales() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="scale"):
            rounded_gaussian(3, scale=bad, coins=Coins.seeded(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("shares", [1, 2, 3])
def test_float32_and_float64_inputs_snap_identically(shares) -> None:
    """The float32 fast path (scaling by a power of two, rint) and the float64 path agree
    exactly; for shares = 3 the exact integer snapping picks the nearest multiple of 3g."""
    x = torch.randn(20_000) * 5
    kw = {"noise_multiplier": 0.7, "sensitivity": 1.3, "shares": shares}
    a = gaussian_mechanism({"w": x}, coins=Coins.seeded(8), **kw)["w"]
    b = gaussian_mechanism({"w": x.double()}, coins=Coins.seeded(8), **kw)["w"]
    assert torch.equal(a, b)
    g = 2.0 ** grid_exponent(0.7 * 1.3 / math.sqrt(shares))
    noise = gaussian_mechanism({"w": torch.zeros(20_000)}, coins=Coins.seeded(8), **kw)["w"]
    snapped = (a - noise).numpy()
    step = shares * g
    assert np.array_equal(snapped / step, np.round(snapped / step))
    assert float(np.max(np.abs(snapped - x.double().numpy()))) <= step / 2


# --- scales beyond float range (the weighting protocol's grid) ---------------------------


def _standardised(samples: np.ndarray, scale: Fraction) -> np.ndarray:
    return np.array([float(Fraction(int(v)) / scale) for v in samples])


def test_wide_scales_have_the_gaussian_law_and_reject_a_wrong_scale() -> None:
    from scipy import stats

    scale = Fraction(2**1100) * Fraction(3, 7)  # far beyond float64's range
    samples = rounded_gaussian(20_000, scale=scale, coins=Coins.seeded(11))
    assert samples.dtype == object and all(isinstance(v, int) for v in samples[:10])
    z = _standardised(samples, scale)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 1.1, "norm").pvalue < 1e-6  # a 10% wrong scale is rejected


def test_wide_scales_fill_the_fine_grid_uniformly() -> None:
    from scipy import stats

    scale = Fraction(2**300) + Fraction(1, 3)
    samples = rounded_gaussian(8_000, scale=scale, coins=Coins.seeded(12))
    fine = 2 ** (scale.numerator.bit_length() - scale.denominator.bit_length() - 64)
    while scale / fine >= 2**65:
        fine *= 2
    while scale / fine < 2**64:
        fine //= 2
    # within a coarse cell the density is flat to 2^-49: the fine offset is uniform
    offsets = np.array([((int(v) + fine // 2) % fine) / fine for v in samples])
    counts, _ = np.histogram(offsets, bins=16, range=(0.0, 1.0))
    assert stats.chisquare(counts).pvalue > 1e-3


def test_half_cell_acceptance_is_exact() -> None:
    """The exact acceptance path alone, where the ratio is far from 1 (a small coarse scale),
    against ratios computed independently with scipy; a wrong ratio is rejected."""
    from scipy import stats

    from silodp.privacy.noise import _accept_half_cell

    s, fine, c = Fraction(3, 4), 2, 1
    cells = 2 * fine

    def mass(h: int) -> float:
        lo = (c - 0.5 + h / cells) / float(s)
        return stats.norm.cdf(lo + 1 / (cells * float(s))) - stats.norm.cdf(lo)

    coins = Coins.seeded(13)
    trials = 4_000
    for h in range(cells):
        ratio = mass(h) / mass(0)  # c > 0: the half-cell nearest 0 is h = 0
        words = coins.uint64(trials)
        accepted = sum(_accept_half_cell(c, h, fine, s, int(v), coins) for v in words)
        assert stats.binomtest(accepted, trials, ratio).pvalue > 1e-4
        if h:
            assert stats.binomtest(accepted, trials, ratio * 0.8).pvalue < 1e-6


def test_wide_scales_through_the_exact_path_only(monkeypatch) -> None:
    from scipy import stats

    from silodp.privacy import noise

    monkeypatch.setattr(sampler_module, "FAST_ACCEPT", 0)  # every fine proposal decided exactly
    scale = Fraction(2**200) * Fraction(5, 9)
    samples = noise.rounded_gaussian(300, scale=scale, coins=Coins.seeded(14))
    assert stats.kstest(_standardised(samples, scale), "norm").pvalue > 1e-3


def test_small_draws_come_from_a_reserve_each_sample_handed_out_once() -> None:
    """Small draws are consecutive slices of refills of d, 2d, 4d, … (capped) drawn from
    the same coins; a request that does not fit the rest starts a new refill."""
    scale = Fraction(1234567, 8)
    table = table_module._table(scale)
    d = 1000
    cap = noise_module.RESERVE_MAX
    coins = Coins.seeded(7)
    got = [noise_module._noise(table, d, coins)[0].copy() for _ in range(200)]
    reference = Coins.seeded(7)
    expected = []
    refill = 0
    while len(expected) < 200:
        refill = d if not refill else max(d, min(2 * refill, cap))
        block = sampler_module._draw(table, refill, reference)[0]
        expected += [block[i : i + d] for i in range(0, refill - d + 1, d)]
    for a, b in zip(got, expected[:200], strict=True):
        assert np.array_equal(a, b)
    assert len({a.tobytes() for a in got}) == len(got)  # no release repeats another


def test_reserves_belong_to_their_coins_and_large_draws_bypass_them() -> None:
    table = table_module._table(Fraction(1000))
    first = noise_module._noise(table, 100, Coins.seeded(8))[0]
    again = noise_module._noise(table, 100, Coins.seeded(8))[0]  # new coins: a new reserve
    assert np.array_equal(first, again)
    large = noise_module.RESERVE_BELOW
    coins = Coins.seeded(9)
    direct = sampler_module._draw(table, large, Coins.seeded(9))[0]
    assert np.array_equal(noise_module._noise(table, large, coins)[0], direct)
    assert coins not in noise_module._RESERVES


def test_many_small_releases_have_the_right_sigma() -> None:
    """Releases of a small model's size from one coins (the reserve's path) together have
    the mechanism's law, and a 2% larger sigma is rejected."""
    sigma, clip = 0.7, 1.3
    coins = Coins.seeded(111)
    values = {"w": torch.zeros(48, 50), "b": torch.zeros(10)}
    z = np.concatenate(
        [
            torch.cat(
                [
                    t.reshape(-1)
                    for t in gaussian_mechanism(
                        values, noise_multiplier=sigma, sensitivity=clip, coins=coins
                    ).values()
                ]
            ).numpy()
            for _ in range(120)
        ]
    )
    assert coins in noise_module._RESERVES
    scale = sigma * clip
    assert stats.kstest(z, stats.norm(scale=scale).cdf).pvalue > ALPHA
    assert variance_pvalue(z, scale) > ALPHA
    assert variance_pvalue(z, 1.02 * scale) < ALPHA


def test_a_forked_child_does_not_hand_out_its_parents_reserve() -> None:
    import multiprocessing

    table = table_module._table(Fraction(1000))
    coins = Coins.secure()
    noise_module._noise(table, 100, coins)  # the reserve now holds samples
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child() -> None:
        queue.put(noise_module._noise(table, 100, coins)[0].tolist())

    process = context.Process(target=child)
    process.start()
    in_child = queue.get(timeout=60)
    process.join(timeout=60)
    in_parent = noise_module._noise(table, 100, coins)[0].tolist()
    assert in_child != in_parent  # equal only if the child replayed the parent's samples


def _within_cell_score(draws: np.ndarray, scale: float, cell: int) -> float:
    """Score statistic (standardised) of the Gaussian's tilt towards 0 inside the sampler's
    coarse cells of ``cell`` points: about 0 for a law uniform within each cell, about
    ``sqrt(Σ λ²/12)`` for the Gaussian, whose density falls by ``λ = |x| cell / s²`` across a
    cell at ``x``."""
    base = (draws // cell) * cell
    offset = (draws - base).astype(np.float64)
    away = np.where(base >= 0, offset, (cell - 1) - offset) / cell  # position away from 0
    lam = np.abs(np.where(base >= 0, base, base + cell - 1)).astype(np.float64) * cell / scale**2
    return float(np.sum(lam * (0.5 - away)) / np.sqrt(np.sum(lam**2) / 12.0))


def test_the_within_cell_stage_has_the_gaussian_tilt() -> None:
    """The sampler's rejection inside a coarse cell: accepting every proposal (uniform within
    cells of s/64 points) passed every other test, whose χ² bins cannot see a 1/512 tilt."""
    scale = 2.0**30
    cell = table_module._table(Fraction(scale)).cell
    assert 32 <= scale / cell <= 256  # cells coarse enough for the tilt to be measurable
    draws = sampler_module.rounded_gaussian(4_000_000, scale=scale, coins=Coins.seeded(5))
    expected = _within_cell_score(draws, scale, cell)
    assert expected > 4.0  # about 9 for the exact law
    # the same statistic on draws uniform within their cells: about 0
    rng = np.random.default_rng(0)
    flat = (draws // cell) * cell + rng.integers(0, cell, draws.size)
    assert abs(_within_cell_score(flat, scale, cell)) < 4.0
