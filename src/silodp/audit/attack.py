"""The attack: how far each canary's own weight column moved towards its label.

The attacker sees the released model (the final global parameters) and knows the initial one
(its seed is public) and the canaries (their features and labels) — not which were included.
A gradient step on canary ``i`` raises the weight of its label in its own column and lowers
the others; nothing else moves that column but the noise. The score is the column's change
projected on that direction, ``⟨ΔW[:, d+i], e_{y_i} - 1/K⟩``: about 0 for an excluded canary
(its column moved by noise alone), positive for an included one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from silodp.audit.canaries import Canaries
from silodp.errors import InvalidValueError

__all__ = ["canary_scores", "roc_curve"]


def _weight(params: Mapping[str, torch.Tensor]) -> np.ndarray:
    weights = [v for k, v in params.items() if k.endswith("weight") and v.dim() == 2]
    if len(weights) != 1:
        raise InvalidValueError(
            f"Expected the linear model's one weight matrix, got parameters {sorted(params)}."
        )
    return weights[0].detach().to(torch.float64).numpy()


def canary_scores(
    initial: Mapping[str, torch.Tensor], final: Mapping[str, torch.Tensor], canaries: Canaries
) -> np.ndarray:
    """One score per canary (higher: more likely included)."""
    delta = _weight(final) - _weight(initial)  # (classes, features)
    k = delta.shape[0]
    d, m = canaries.first_feature, len(canaries)
    if delta.shape[1] != d + m:
        raise InvalidValueError(
            f"Expected a model over {d + m} features (data and canaries), got {delta.shape[1]}."
        )
    columns = delta[:, d : d + m]  # (classes, canaries)
    own = columns[canaries.labels, np.arange(m)]
    return own - columns.sum(axis=0) / k


def roc_curve(scores: np.ndarray, included: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive rates, true-positive rates) of "in if score ≥ t" over every t."""
    order = np.argsort(-scores, kind="stable")
    inc = included[order]
    tp = np.concatenate([[0], np.cumsum(inc)])
    fp = np.concatenate([[0], np.cumsum(~inc)])
    return fp / max(1, int((~inc).sum())), tp / max(1, int(inc.sum()))
