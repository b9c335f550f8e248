"""Gaussian noise has the stated σ: a variance test and a KS test that also reject wrong σ."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from silodp.privacy.noise import add_gaussian_noise, gaussian_noise, noise_like

# Significance level. For the unseeded (secure) draws this is the false-failure probability of
# each test under the right σ, so every secure test below fails spuriously with prob. < 1e-6.
ALPHA = 1e-7
N = 60_000


def variance_pvalue(x: np.ndarray, sigma: float) -> float:
    """Two-sided chi-square test of H0: x ~ iid N(0, σ²) via Σx²/σ² ~ χ²(n)."""
    stat = float(np.sum(np.square(x, dtype=np.float64))) / sigma**2
    n = x.size
    return float(min(1.0, 2.0 * min(stats.chi2.cdf(stat, n), stats.chi2.sf(stat, n))))


def ks_pvalue(x: np.ndarray, sigma: float) -> float:
    return float(stats.kstest(x.astype(np.float64), stats.norm(scale=sigma).cdf).pvalue)


def mean_pvalue(x: np.ndarray, sigma: float) -> float:
    z = float(np.mean(x, dtype=np.float64)) / (sigma / np.sqrt(x.size))
    return float(2.0 * stats.norm.sf(abs(z)))


def _accepts(x: np.ndarray, sigma: float) -> bool:
    # Bonferroni over the three tests keeps the family's false-failure probability <= 3·ALPHA/3.
    a = ALPHA / 3
    return variance_pvalue(x, sigma) > a and ks_pvalue(x, sigma) > a and mean_pvalue(x, sigma) > a


def _rejects(x: np.ndarray, sigma: float) -> bool:
    return variance_pvalue(x, sigma) < ALPHA and ks_pvalue(x, sigma) < ALPHA


@pytest.mark.parametrize("sigma", [0.3, 1.0, 4.0])
def test_seeded_noise_has_right_sigma(sigma) -> None:
    gen = torch.Generator().manual_seed(11)
    x = gaussian_noise((N // 4, 4), std=sigma, generator=gen).numpy().ravel()
    assert _accepts(x, sigma)
    assert _rejects(x, sigma * 2 / 3)
    assert _rejects(x, sigma * 3 / 2)


@pytest.mark.parametrize("sigma", [0.3, 1.0, 4.0])
def test_secure_noise_has_right_sigma(sigma) -> None:
    x = gaussian_noise((N,), std=sigma, generator=None, secure=True).numpy()
    assert _accepts(x, sigma)
    assert _rejects(x, sigma * 2 / 3)
    assert _rejects(x, sigma * 3 / 2)


@pytest.mark.parametrize("secure", [False, True])
def test_wrong_sigma_noise_is_rejected(secure) -> None:
    """The test has power: noise drawn at σ·2/3 or σ·3/2 fails against σ."""
    sigma = 1.5
    gen = torch.Generator().manual_seed(5)
    for factor in (2 / 3, 3 / 2):
        x = gaussian_noise((N,), std=sigma * factor, generator=gen, secure=secure).numpy()
        assert _rejects(x, sigma)


def test_secure_noise_odd_sizes_and_pairs_are_uncorrelated() -> None:
    # Box–Muller pairs (r cos θ, r sin θ) land at i and i + numel/2: they must be uncorrelated.
    x = gaussian_noise((2 * 30_001,), std=1.0, generator=None, secure=True).numpy().astype(float)
    half = x.size // 2
    r = np.corrcoef(x[:half], x[half:])[0, 1]
    # |r|·sqrt(n) ~ N(0,1) under independence; 5.7 sd <=> p ~ 1e-8
    assert abs(r) * np.sqrt(half) < 5.7
    for shape in [(), (1,), (3,), (5, 7), (2, 3, 3)]:
        out = gaussian_noise(shape, std=2.0, generator=None, secure=True)
        assert out.shape == torch.Size(shape)
        assert out.dtype == torch.float32
        assert torch.isfinite(out).all()


def test_secure_noise_ignores_generator_seed() -> None:
    a = gaussian_noise((64,), std=1.0, generator=torch.Generator().manual_seed(0), secure=True)
    b = gaussian_noise((64,), std=1.0, generator=torch.Generator().manual_seed(0), secure=True)
    assert not torch.equal(a, b)


def test_seeded_noise_is_reproducible() -> None:
    a = gaussian_noise((64,), std=1.0, generator=torch.Generator().manual_seed(7))
    b = gaussian_noise((64,), std=1.0, generator=torch.Generator().manual_seed(7))
    c = gaussian_noise((64,), std=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_missing_generator_raises() -> None:
    with pytest.raises(ValueError, match="torch.Generator"):
        gaussian_noise((3,), std=1.0, generator=None)
    with pytest.raises(ValueError, match="torch.Generator"):
        add_gaussian_noise({"w": torch.zeros(2)}, std=1.0, generator=None)


def test_negative_std_raises_and_zero_std_is_zero() -> None:
    with pytest.raises(ValueError, match=r"std=-1\.0"):
        gaussian_noise((3,), std=-1.0, generator=torch.Generator())
    zero = gaussian_noise((4,), std=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(zero, torch.zeros(4))
    assert torch.equal(gaussian_noise((4,), std=0.0, generator=None, secure=True), torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_gaussian_noise_shapes_dtypes_and_independence(dtype) -> None:
    tensors = {"a": torch.full((300, 100), 5.0, dtype=dtype), "b": torch.zeros(20_000, dtype=dtype)}
    gen = torch.Generator().manual_seed(1)
    out = add_gaussian_noise(tensors, std=2.0, generator=gen)
    assert out.keys() == tensors.keys()
    for k in tensors:
        assert out[k].shape == tensors[k].shape and out[k].dtype == dtype
    da = (out["a"] - 5.0).numpy().ravel()
    db = out["b"].numpy().ravel()
    assert _accepts(da, 2.0) and _accepts(db, 2.0)
    # different tensors get different noise (not the same stream reused)
    assert not np.allclose(da[:1000], db[:1000])
    # inputs are not modified in place
    assert torch.equal(tensors["b"], torch.zeros(20_000, dtype=dtype))


@pytest.mark.parametrize("secure", [False, True])
def test_noise_like_has_right_sigma_and_shapes(secure) -> None:
    like = {"w": torch.zeros(200, 150), "b": torch.zeros(150), "s": torch.zeros(())}
    gen = torch.Generator().manual_seed(3)
    noise = noise_like(like, std=0.7, generator=gen, secure=secure)
    assert {k: v.shape for k, v in noise.items()} == {k: v.shape for k, v in like.items()}
    flat = torch.cat([v.reshape(-1) for v in noise.values()]).numpy()
    assert _accepts(flat, 0.7)
    assert _rejects(flat, 0.7 * 1.1) and _rejects(flat, 0.7 / 1.1)
    # different tensors get different (not repeated) draws
    assert not torch.equal(noise["b"], noise["w"][0])
