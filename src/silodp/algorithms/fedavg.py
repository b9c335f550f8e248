"""FedAvg (McMahan et al., 2017): plain local SGD, server averages. No privacy guarantee."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.algorithms.base import Algorithm, SiloData, SiloUpdate, uniform_batch
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
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        generator: torch.Generator,
        instructions: Any = None,
    ) -> SiloUpdate:
        cfg = self.config

        def step(local: Params, idx: torch.Tensor) -> Params:
            grads = batch_gradient(model, local, silo.x[idx], silo.y[idx])
            return {k: v - cfg.lr * grads[k] for k, v in local.items()}

        return self.run_steps(
            params,
            silo,
            select=lambda: uniform_batch(silo.num_records, cfg.batch_size, generator),
            step=step,
        )
