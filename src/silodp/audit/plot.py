"""The audit's figure: the attack's ROC against the trade-off curve of the claimed (ε, δ)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from silodp import display
from silodp.plotting import plt, save_figure

__all__ = ["dp_tradeoff_tpr", "plot_audit", "unbounded_claim_label"]


def dp_tradeoff_tpr(epsilon: float, delta: float, fpr: np.ndarray) -> np.ndarray:
    """The largest true-positive rate any test can have at false-positive rate ``fpr``
    against an (ε, δ)-DP mechanism: ``min(1, e^ε·α + δ, 1 - e^-ε·(1 - δ - α))``."""
    a = np.asarray(fpr, dtype=float)
    if not math.isfinite(epsilon):
        return np.ones_like(a)
    return np.clip(
        np.minimum(np.exp(epsilon) * a + delta, 1 - np.exp(-epsilon) * (1 - delta - a)), 0, 1
    )


def unbounded_claim_label(report: dict[str, Any]) -> str:
    """The legend of a claim without a finite ε: an infinite one, or a non-private run's."""
    if report.get("claim") == "infinite":
        return "claimed ε = inf (no bound)"
    return "claimed: not private (no bound)"


def plot_audit(fpr: np.ndarray, tpr: np.ndarray, report: dict[str, Any], path: Path) -> Path:
    """Log-log ROC of the attack, with the (ε, δ) trade-off curves of the claimed ε and of the
    measured lower bound."""
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    grid = np.logspace(-4, 0, 400)
    delta = float(report["delta"])
    claimed = report.get("claimed_epsilon")
    lower = float(report["lower_bound"])
    if claimed is not None:
        shown_claim, shown_lower = display.upper_and_lower(claimed, lower)
        ax.plot(
            grid,
            dp_tradeoff_tpr(claimed, delta, grid),
            color="C3",
            label=f"claimed ({shown_claim}, {delta:g})-DP bound",
        )
    else:
        shown_lower = display.lower(lower)
        ax.plot([], [], color="C3", label=unbounded_claim_label(report))
    ax.plot(
        grid,
        dp_tradeoff_tpr(lower, delta, grid),
        color="C1",
        linestyle="--",
        label=f"measured lower bound ε ≥ {shown_lower} ({report['confidence']:.0%})",
    )
    keep = fpr > 0
    ax.step(fpr[keep], tpr[keep], where="post", color="C0", label="attack ROC")
    ax.plot(grid, grid, color="grey", linewidth=0.8, linestyle=":", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-3 if report.get("canaries", 0) <= 2000 else 1e-4, 1)
    ax.set_ylim(1e-3, 1.05)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(
        f"{report['algorithm']} ({report['unit']} canaries, {report['design']})", fontsize=10
    )
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)
