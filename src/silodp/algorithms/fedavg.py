"""FedAvg (McMahan et al., 2017): plain local SGD, server averages. No privacy guarantee."""

from __future__ import annotations

from typing import Any

from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.algorithms.base import Algorithm, SiloData, SiloUpdate, sgd_step, uniform_batch
from silodp.algorithms.registry import register
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import Coins

__all__ = ["FedAvg"]


@register
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
        coins: Coins,
        instructions: Any = None,
        state: Any = None,
    ) -> SiloUpdate:
        cfg = self.config
        return self.run_steps(
            params,
            silo,
            select=lambda: uniform_batch(silo.num_records, cfg.batch_size, coins),
            step=lambda local, idx: sgd_step(model, local, silo, idx, lr=cfg.lr),
        )
