"""ULDP-NAIVE and ULDP-GROUP-k (see :mod:`silodp.algorithms.uldp` for the family)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import (
    gaussian_steps,
)
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
    sgd_step,
)
from silodp.algorithms.dp_sgd import LocalItemDP
from silodp.algorithms.registry import register
from silodp.algorithms.uldp_common import (
    SIMULATED_AGGREGATION_NOTE,
    UldpNaiveConfig,
    apply_total,
    exact_sum,
    gaussian_share,
    share_grid,
)
from silodp.data import FederatedDataset
from silodp.privacy.gradients import Params, clip_tree
from silodp.privacy.randomness import Coins

#: ULDP-NAIVE's threat model: secure aggregation as the rest of the family, without a subject
#: sample (the shared ``SECURE_AGGREGATION`` text speaks of one)
NAIVE_SECURE_AGGREGATION = (
    "secure aggregation: noise is split over silos; ε holds for the released model and, "
    "against the server, only if it sees just the sum of the silos' messages; every subject's "
    "records enter every round (none is left out), so one ε holds against every "
    "adversary"
)


@register
class UldpNaive(Algorithm):
    """Local non-private training; clipped silo delta + ``N(0, σ²C²S)``; secure sum.

    Sensitivity of the sum is 2·S·C (each silo's clipped delta can flip), so a round is a
    Gaussian mechanism with noise multiplier σ/2; each silo adds its ``1/S`` share of it.
    """

    name = "uldp_naive"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = NAIVE_SECURE_AGGREGATION
    Config = UldpNaiveConfig
    #: messages are float64 (on the noise grid, or unnoised), summed exactly
    message_dtype = torch.float64
    config: UldpNaiveConfig

    def __init__(self, config: AlgorithmConfig, *, num_silos: int | None = None) -> None:
        super().__init__(config)
        self.num_silos = num_silos

    def run_notes(self) -> list[str]:
        # no OWN_NOISE_NOTE: σ/2 already covers one silo (its own delta leaves the sensitivity
        # with its noise share)
        return [SIMULATED_AGGREGATION_NOTE]

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        return cls(config, num_silos=train.num_silos)

    def silo_setup(self) -> dict[str, Any]:
        return {"num_silos": self.num_silos}

    def secure_sum_grid(self) -> float | None:
        silos = self.num_silos
        if silos is None:
            raise ValueError("uldp_naive needs num_silos; build it with for_data().")
        cfg = self.config
        return share_grid(cfg.noise_multiplier / 2.0, 2.0 * silos * cfg.clip, silos)

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        return 1.0

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        # A silo's clipped delta moves by up to 2C when a subject's records leave it.
        event = gaussian_steps(self.config.noise_multiplier / 2.0, 1)
        return SiloPrivacy({"subject": event}, scope="aggregate")

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
        if self.num_silos is None:
            raise ValueError("uldp_naive needs num_silos; build it with for_data().")
        steps = cfg.local_epochs * math.ceil(silo.num_records / cfg.batch_size)
        size = min(cfg.batch_size, silo.num_records)

        local = {k: v.clone() for k, v in params.items()}
        for _ in range(steps):
            idx = coins.permutation(silo.num_records)[:size]
            local = sgd_step(model, local, silo, idx, lr=cfg.lr)
        delta = {k: local[k] - params[k] for k in params}
        message = gaussian_share(
            clip_tree(delta, cfg.clip),
            noise_multiplier=cfg.noise_multiplier / 2.0,
            sensitivity=2.0 * self.num_silos * cfg.clip,
            coins=coins,
            shares=self.num_silos,
        )
        privacy = self.silo_privacy(sampling_rate=1.0)
        return SiloUpdate(silo.silo, message, silo.num_records, privacy)

    def aggregate(
        self, params: Params, updates: Sequence[SiloUpdate], states: Sequence[Any] = ()
    ) -> Params:
        """``w + η_g · Σ_s message_s / S`` (the sum is what secure aggregation reveals; summed
        in float64, cast after)."""
        silos = self.num_silos or len(updates)
        cfg = self.config
        grid = share_grid(cfg.noise_multiplier / 2.0, 2.0 * silos * cfg.clip, silos)
        total = exact_sum(params, updates, grid)
        scale = float(silos)
        return apply_total(params, total, self.config.server_lr / scale)


@register
class UldpGroup(LocalItemDP):
    """ULDP-GROUP-k: ≤ k records per subject federation-wide, DP-SGD per silo, group privacy.

    ``group_size`` is the federation-wide bound k (the runner drops records above it with
    fixed seeded flags). The subject guarantee converts the record-level guarantee of all
    silos jointly (``group_scope="federation"``: no composition over silos) and is also
    bounded by the per-silo mixture analysis composed over the silos a subject spans; the
    smaller is reported.
    """

    name = "uldp_group"
    calibration_unit = "subject"
    group_scope = "federation"
    threat_model = (
        "local noise: the subject ε holds against the server and other silos; the record ε "
        "not against the silos (inf there): the federation-wide cap shows a silo which of "
        "its records are kept, which a record elsewhere decides"
    )

    def uses_span(self) -> bool:
        """No: beside the federation-wide cap, capping the span would let one added record
        move several silos' records (:mod:`silodp.algorithms.caps`); the per-silo mixture
        bound composes over every silo instead, and the group conversion needs no span."""
        return False
