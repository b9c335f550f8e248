"""DP-SGD in each silo: LocalItemDP and LocalGroupDP (Marathe et al., subject-level DP in FL).

Both run the same mechanism: Poisson-sample records at ``q = B/n_s``, clip each per-example
gradient to C, sum, add ``N(0, σ²C²I)``, divide by the expected batch size ``B`` (public).

* ``local_item_dp`` (LocalItemDP, = DP-SGD of Abadi et al. 2016): σ is calibrated for
  **record-level** (ε, δ). silodp also reports the subject-level ε this implies (group
  conversion over the subject's ≤ k records per silo, composed over ``span`` silos) so users see
  what item-level DP does not give them.
* ``local_group_dp`` (LocalGroupDP): the same steps, with σ calibrated so that the
  **subject-level** ε (group-converted, horizontally composed) meets the target.

Guarantees hold against the server and the other silos (noise is added locally).
"""

from __future__ import annotations

import torch
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import poisson_gaussian_steps, subject_mixture_steps
from silodp.algorithms.base import (
    Algorithm,
    SiloData,
    SiloUpdate,
    batch_diagnostics,
    check_group_bound,
    poisson_mask,
)
from silodp.privacy.gradients import (
    Params,
    clip_factors,
    per_example_gradients,
    per_example_norms,
    weighted_sum,
)
from silodp.privacy.noise import gaussian_noise

__all__ = ["LocalGroupDP", "LocalItemDP", "noisy_sgd_step"]


def noisy_sgd_step(
    params: Params,
    summed: Params,
    *,
    noise_std: float,
    scale: float,
    lr: float,
    generator: torch.Generator,
    secure: bool,
) -> Params:
    """``w - η (sum + N(0, noise_std²)) / scale``: one noisy step on a clipped sum."""
    out: Params = {}
    for name, value in params.items():
        noise = gaussian_noise(value.shape, std=noise_std, generator=generator, secure=secure)
        out[name] = value - lr * (summed[name] + noise) / scale
    return out


def zeros_like(params: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in params.items()}


class LocalItemDP(Algorithm):
    """DP-SGD per silo; record-level (ε, δ)-DP, subject level derived by group conversion."""

    name = "local_item_dp"
    units = ("record", "subject")
    calibration_unit = "record"
    threat_model = "local noise: holds against the server and other silos"

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        cfg = self.config
        q = sampling_rate
        record = poisson_gaussian_steps(q, cfg.noise_multiplier, cfg.local_steps)
        subject = subject_mixture_steps(q, cfg.noise_multiplier, cfg.group_size, cfg.local_steps)
        return SiloPrivacy(
            {"record": record, "subject": subject},
            record_event=record,
            group_size=cfg.group_size,
        )

    def local_update(
        self, model: nn.Module, params: Params, silo: SiloData, generator: torch.Generator
    ) -> SiloUpdate:
        cfg = self.config
        q = self.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        check_group_bound(silo, cfg.group_size)
        expected = q * silo.num_records
        local = {k: v.clone() for k, v in params.items()}
        groups, distinct = [], []
        for _ in range(cfg.local_steps):
            idx = poisson_mask(silo.num_records, q, generator)
            if idx.numel():
                grads = per_example_gradients(model, local, silo.x[idx], silo.y[idx])
                factors = clip_factors(per_example_norms(grads), cfg.clip)
                summed = weighted_sum(grads, factors)
            else:
                summed = zeros_like(local)
            local = noisy_sgd_step(
                local,
                summed,
                noise_std=cfg.noise_multiplier * cfg.clip,
                scale=expected,
                lr=cfg.lr,
                generator=generator,
                secure=cfg.secure_noise,
            )
            g, d = batch_diagnostics(silo.subject[idx])
            groups.append(g)
            distinct.append(d)
        privacy = self.silo_privacy_for(silo)
        return SiloUpdate(silo.silo, local, silo.num_records, privacy, groups, distinct)


class LocalGroupDP(LocalItemDP):
    """DP-SGD per silo with σ calibrated for subject-level (ε, δ) through group privacy."""

    name = "local_group_dp"
    calibration_unit = "subject"
