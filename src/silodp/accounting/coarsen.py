"""Pessimistic re-discretisation of a privacy loss distribution onto a coarser grid.

A composed PLD's support widens with every composition (its privacy loss has a standard
deviation growing as √rounds), and composing one more round or reading ε off it costs time
linear in that support. :func:`coarsen_pld` moves a PLD from grid ``d`` to grid ``f·d`` so a
federated accountant can keep its composed state at a bounded number of points.

Each point's mass ``p`` at loss ``l`` is split between the two neighbouring coarse points
``a <= l < b = a + f·d`` so that the total mass and the mass ``Σ p·e^{-l}`` (the other
distribution of the pair) are both preserved; this is the "connect the dots" construction of
Doroshenko et al. (2022) applied to a discrete PLD. Writing ``x = e^{-L}``, the hockey-stick
divergence of a PLD is ``δ(ε) = E[(1 - e^ε x)_+] + P(L = ∞)``, the expectation of a convex
function of ``x``; a split that keeps ``E[x]`` and spreads ``x`` apart can therefore only raise
``δ(ε)`` for every ε (Jensen). The coarse pair dominates the fine one, and dominating pairs
compose into dominating pairs (Zhu, Dong & Wang 2022, Thm. 10), so every ε read from a
composition of coarsened PLDs is an upper bound on the fine one's. The share moved up is
enlarged by a relative ``1e-12`` so that float rounding can only err on the pessimistic side,
and the tiny negative masses FFT convolution leaves in the tails are set to zero (which can
only raise δ). Infinite-loss mass is kept as it is.

Unlike rounding every loss up (which shifts ε by up to the coarse step), the split keeps
``E[e^{-L}]`` and raises the mean loss by at most ``(f·d)²/8`` per coarsening, so the error is
of second order in the grid step.
"""

from __future__ import annotations

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp._validation import check_int

__all__ = ["coarsen_pld", "coarsen_pmf", "pld_points"]

#: relative enlargement of the mass moved to the upper coarse point (float safety margin)
_UPWARD_MARGIN = 1e-12


def coarsen_pmf(pmf: pld_pmf.PLDPmf, factor: int) -> pld_pmf.DensePLDPmf:
    """``pmf`` (pessimistic) on the grid ``factor`` times coarser, each point's mass split
    between its two coarse neighbours preserving the mass and ``Σ p·e^{-l}``."""
    check_int("factor", factor, 1)
    dense = pmf.to_dense_pmf()
    if factor == 1:
        return dense
    fine = float(dense._discretization)  # noqa: SLF001 - the PMF's own fields
    # FFT convolution leaves tiny negative masses (~1e-20) in the tails; as zero they can
    # only raise δ(ε) = Σ_{l>ε} p (1 - e^{ε-l}) + P(∞), so they are dropped
    probs = np.maximum(np.asarray(dense._probs, dtype=np.float64), 0.0)  # noqa: SLF001
    index = dense._lower_loss + np.arange(len(probs), dtype=np.int64)  # noqa: SLF001
    lower = index // factor  # floor: the coarse point at or below each loss
    offset = (index - lower * factor) * fine  # l - a, in [0, coarse)
    coarse = fine * factor
    # share of a point's mass at the upper neighbour b: keeps p·e^{-l} = p_a e^{-a} + p_b e^{-b}
    # (1 - e^{-o}) / (1 - e^{-c}) as a ratio of expm1s: no cancellation at any coarse step
    # (the form 1 - expm1(c - o)/expm1(c) loses ~1e-11 relative once c reaches ~260)
    up_share = np.expm1(-offset) / np.expm1(-coarse)
    up_share = np.minimum(1.0, up_share * (1.0 + _UPWARD_MARGIN))
    up = probs * up_share
    down = probs - up
    first = int(lower[0]) if len(lower) else 0
    size = int(lower[-1]) - first + 2 if len(lower) else 1
    out = np.bincount(lower - first, weights=down, minlength=size) + np.bincount(
        lower - first + 1, weights=up, minlength=size
    )
    nonzero = np.flatnonzero(out)
    if len(nonzero):
        out = out[nonzero[0] : nonzero[-1] + 1]
        first += int(nonzero[0])
    return pld_pmf.DensePLDPmf(
        coarse,
        first,
        out,
        dense._infinity_mass,  # noqa: SLF001
        pessimistic_estimate=True,
    )


def coarsen_pld(
    pld: pld_lib.PrivacyLossDistribution, factor: int
) -> pld_lib.PrivacyLossDistribution:
    """``pld`` on a grid ``factor`` times coarser (both PMFs; see the module docstring for why
    it dominates ``pld``)."""
    remove = coarsen_pmf(pld._pmf_remove, factor)  # noqa: SLF001
    if pld._symmetric:  # noqa: SLF001
        return pld_lib.PrivacyLossDistribution(remove)
    return pld_lib.PrivacyLossDistribution(remove, coarsen_pmf(pld._pmf_add, factor))  # noqa: SLF001


def pld_points(pld: pld_lib.PrivacyLossDistribution) -> int:
    """Grid points of the larger of ``pld``'s PMFs."""
    sizes = [pld._pmf_remove.size] + ([] if pld._symmetric else [pld._pmf_add.size])  # noqa: SLF001
    return int(max(sizes))
