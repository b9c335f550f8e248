"""FedAvg (McMahan et al., 2017): plain local SGD, server averages. No privacy guarantee."""

from __future__ import annotations

import torch
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.algorithms.base import Algorithm, SiloData, SiloUpdate, batch_diagnostics
from silodp.privacy.gradients import Params, batch_gradient

__all__ = ["FedAvg"]


class FedAvg(Algorithm):
    """Non-private baseline: T steps of mini-batch SGD (batches drawn without replacement)."""

    name = "fedavg"
    units = ()
    calibration_unit = None
    threat_model = "none: no differential privacy"

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy | None:
        return None

    def local_update(
        self, model: nn.Module, params: Params, silo: SiloData, generator: torch.Generator
    ) -> SiloUpdate:
        cfg = self.config
        local = {k: v.clone() for k, v in params.items()}
        groups, distinct = [], []
        batch = min(cfg.batch_size, silo.num_records)
        for _ in range(cfg.local_steps):
            idx = torch.randperm(silo.num_records, generator=generator)[:batch]
            grads = batch_gradient(model, local, silo.x[idx], silo.y[idx])
            local = {k: v - cfg.lr * grads[k] for k, v in local.items()}
            g, d = batch_diagnostics(silo.subject[idx])
            groups.append(g)
            distinct.append(d)
        return SiloUpdate(silo.silo, local, silo.num_records, None, groups, distinct)
