"""The noise each local DP algorithm releases has the scale its accounting assumes: with every
clipped gradient replaced by zero, a local step is pure noise, and its standard deviation
must be σ·C (``local_item_dp``, ``local_group_dp``, ``higradavg_dp``: sensitivity C;
``user_ldp``: σ/2 at sensitivity 2C). A halved sensitivity in the mechanism call passed every
other test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from silodp.algorithms import SiloData, dp_sgd, make_algorithm, user_ldp
from silodp.models import build_model
from silodp.privacy.randomness import Coins

ALPHA = 1e-4
SIGMA, CLIP, LR = 1.3, 0.7, 1.0


def _silo(n: int = 200) -> SiloData:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=gen)
    return SiloData(silo=0, x=x, y=torch.randint(0, 3, (n,), generator=gen),
                    subject=torch.arange(n) % 50)  # fmt: skip


def _released_noise(name: str, monkeypatch: pytest.MonkeyPatch, reps: int = 40) -> np.ndarray:
    """One local step's noise, rescaled to the mechanism's output, over ``reps`` updates."""
    zero = lambda params: {k: torch.zeros_like(v) for k, v in params.items()}  # noqa: E731
    monkeypatch.setattr(dp_sgd, "clipped_sum", lambda model, params, *a, **k: zero(params))
    monkeypatch.setattr(user_ldp, "batch_gradient", lambda model, params, x, y: zero(params))
    model = build_model("mlp", (4,), 3, seed=0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    config = dict(local_steps=1, batch_size=1, lr=LR, clip=CLIP, noise_multiplier=SIGMA,
                  group_size=4)  # fmt: skip
    algo = make_algorithm(name, config)
    silo = _silo()
    if name == "user_ldp":
        scale = 1.0
    else:
        q = algo.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        if name == "higradavg_dp":
            scale = algo.subject_rate(q) * silo.num_subjects
        else:
            scale = q * silo.num_records
    draws = []
    for r in range(reps):
        update = algo.local_update(model, params, silo, Coins.seeded(7, r))
        step = [((params[k] - update.params[k]).double() * scale / LR).reshape(-1) for k in params]
        draws.append(torch.cat(step).numpy())
    return np.concatenate(draws)


def _pvalue(z: np.ndarray, std: float) -> float:
    """Two-sided χ² test that zero-mean ``z`` has standard deviation ``std``."""
    stat = float(np.sum(z**2)) / std**2
    return float(min(1.0, 2 * min(stats.chi2.cdf(stat, z.size), stats.chi2.sf(stat, z.size))))


@pytest.mark.parametrize("name", ["local_item_dp", "local_group_dp", "higradavg_dp", "user_ldp"])
def test_released_noise_is_sigma_c(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    z = _released_noise(name, monkeypatch)
    assert z.size > 5000
    right = SIGMA * CLIP
    assert _pvalue(z, right) > ALPHA
    assert _pvalue(z, 0.9 * right) < ALPHA
    assert _pvalue(z, 1.1 * right) < ALPHA
    assert _pvalue(z, 0.5 * right) < ALPHA  # half the sensitivity, as in the mutant
