"""UserLDP (Marathe et al.): silo-level local DP, which implies subject-level DP.

Per step: compute the mini-batch's mean gradient, clip it **as a whole** to C, add
``N(0, σ²C²I)`` (the exact Gaussian mechanism of :mod:`silodp.privacy.noise` at sensitivity
``2C`` with noise multiplier ``σ/2``). Replacing a silo's whole dataset moves the clipped
gradient by at most 2C (replacement adjacency, as local DP requires), so each step is a
Gaussian mechanism with noise multiplier σ/2 relative to its sensitivity; there is no
amplification by sampling (q = 1). The silo-level guarantee composes over the T·R steps; a
subject spread over ``span`` silos is protected by the composition over those silos. Holds
against the server and other silos.

Neighbouring datasets, per unit (:attr:`UserLDP.adjacency`): ``silo``, one silo's whole dataset
replaced by any other (``replace-one``, local DP); ``subject``, one subject's records added or
removed (``add/remove``), which changes each of the ≤ ``span`` silos it occupies by a
replacement of that silo's dataset. When the data were capped to a ``span``, replacing one
silo's dataset can change which records the other silos keep, so the silo unit then composes
over every silo (:mod:`silodp.algorithms.caps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from dp_accounting import dp_event
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import gaussian_steps
from silodp.algorithms.base import Algorithm, SiloData, SiloUpdate, uniform_batch
from silodp.algorithms.caps import (
    CAPS_SEEN_BY_SILOS_NOTE,
    caps_seen_by_silos,
    silo_event_under_span_cap,
)
from silodp.algorithms.dp_sgd import noisy_sum
from silodp.algorithms.registry import register
from silodp.privacy.gradients import Params, batch_gradient, clip_tree
from silodp.privacy.randomness import Coins

__all__ = ["UserLDP"]

#: Replacement adjacency doubles the sensitivity of the clipped gradient.
REPLACEMENT_FACTOR = 2.0


@register
class UserLDP(Algorithm):
    """Local DP for each silo's whole dataset (sensitivity 2C, no sampling amplification)."""

    name = "user_ldp"
    units = ("silo", "subject")
    calibration_unit = "subject"
    threat_model = "local DP: holds against the server and other silos"
    adjacency: ClassVar[Mapping[str, str]] = {"silo": "replace-one", "subject": "add/remove"}

    def account_options(self) -> dict[str, Any]:
        return {"cross_silo_cap": True} if self.config.cross_silo_cap else {}

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        cfg = self.config
        event = gaussian_steps(cfg.noise_multiplier / REPLACEMENT_FACTOR, cfg.local_steps)
        silo = silo_event_under_span_cap(
            event, span_cap=cfg.span_cap, cross_silo=cfg.cross_silo_cap, num_silos=cfg.num_silos
        )
        views = {}
        if caps_seen_by_silos(cross_silo=cfg.cross_silo_cap, span_cap=cfg.span_cap):
            views["silos"] = {"silo": dp_event.NonPrivateDpEvent(), "subject": event}
        return SiloPrivacy({"silo": silo, "subject": event}, views=views)

    def accounting_notes(self) -> list[str]:
        cfg = self.config
        seen = caps_seen_by_silos(cross_silo=cfg.cross_silo_cap, span_cap=cfg.span_cap)
        return [CAPS_SEEN_BY_SILOS_NOTE] if seen else []

    def run_notes(self) -> list[str]:
        return super().run_notes() + self.accounting_notes()

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

        def step(local: Params, idx: torch.Tensor) -> Params:
            grads = batch_gradient(model, local, silo.x[idx], silo.y[idx])
            clipped = clip_tree(grads, cfg.clip)
            noisy = noisy_sum(
                clipped,
                noise_multiplier=cfg.noise_multiplier / REPLACEMENT_FACTOR,
                sensitivity=REPLACEMENT_FACTOR * cfg.clip,
                coins=coins,
            )
            return {
                name: value.add(noisy[name].to(value.dtype), alpha=-cfg.lr)
                for name, value in local.items()
            }

        return self.run_steps(
            params,
            silo,
            select=lambda: uniform_batch(silo.num_records, cfg.batch_size, coins),
            step=step,
        )
