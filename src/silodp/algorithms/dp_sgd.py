"""DP-SGD in each silo: LocalItemDP and LocalGroupDP (Marathe et al., subject-level DP in FL).

Both run the same mechanism: Poisson-sample records at ``q = B/n_s``, clip each per-example
gradient to C, sum, add ``N(0, σ²C²I)``, divide by the expected batch size ``B`` (public).
The sum goes through :func:`~silodp.privacy.noise.gaussian_mechanism` (sensitivity C): the
noise is exact (snapped to a grid, exactly sampled), so each step is the Gaussian mechanism the
accountant charges; batches and noise come from the silo's :class:`~silodp.privacy.randomness.
Coins` (secret in secure mode).

* ``local_item_dp`` (LocalItemDP, = DP-SGD of Abadi et al. 2016): σ is calibrated for
  **record-level** (ε, δ). silodp also reports the subject-level ε this implies (group
  conversion over the subject's ≤ k records per silo, composed over ``span`` silos) so users see
  what item-level DP does not give them.
* ``local_group_dp`` (LocalGroupDP): the same steps, with σ calibrated so that the
  **subject-level** ε (group-converted, horizontally composed) meets the target.

Guarantees hold against the server and the other silos (noise is added locally).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from dp_accounting import dp_event
from torch import nn

from silodp._validation import check_int
from silodp.accounting import SiloPrivacy
from silodp.accounting.events import poisson_gaussian_steps, subject_mixture_steps
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
    check_group_bound,
    hyperparameter,
    poisson_mask,
)
from silodp.algorithms.caps import (
    CAPS_SEEN_BY_SILOS_NOTE,
    caps_seen_by_silos,
    record_event_under_caps,
)
from silodp.algorithms.registry import register
from silodp.errors import InvalidValueError
from silodp.privacy.ghost import clipper_for
from silodp.privacy.gradients import (
    Params,
    clip_factors,
    clipped_weighted_sum,
    per_example_gradients,
    per_example_norms,
)
from silodp.privacy.noise import gaussian_mechanism
from silodp.privacy.randomness import Coins

__all__ = [
    "GroupBoundConfig",
    "LocalGroupDP",
    "LocalItemDP",
    "clipped_noisy_step",
    "clipped_sum",
    "noisy_sum",
]


@dataclass(frozen=True, kw_only=True)
class GroupBoundConfig(AlgorithmConfig):
    """Hyperparameters of the algorithms whose accounting uses a bound on a subject's records.

    Attributes:
      group_size: public bound k on one subject's records (in one silo; in the federation for
        ``uldp_group``), resolved by the experiment from ``privacy.group_size``.
      group_capped: whether a subject's records above ``group_size`` are dropped before
        training (the experiment does so when ``privacy.group_size`` is set). One added record
        can then push out another, so the record unit is accounted for a replacement
        (:mod:`silodp.algorithms.caps`); the default assumes it.
    """

    group_size: int = hyperparameter(
        1, None, "Bound k on one subject's records in one silo.", account=True
    )
    group_capped: bool = hyperparameter(
        True,
        None,
        "Records above the group size are dropped before training (the run does so when "
        "privacy.group_size is set): the record unit then covers one record pushing out "
        "another of its subject.",
        account=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("group_size", self.group_size, 1)
        if not isinstance(self.group_capped, bool):
            raise InvalidValueError(
                f"Expected group_capped to be true or false, got {self.group_capped!r}."
            )


def clipped_sum(
    model: nn.Module,
    params: Params,
    silo: SiloData,
    idx: torch.Tensor,
    *,
    config: AlgorithmConfig,
    weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Params:
    """``Σ_i w_i clip(g_i)`` over the batch ``idx`` (zeros for an empty batch).

    ``weigh(factors, subjects)`` turns the clip factors into the weights of the sum (default:
    the factors themselves, i.e. a plain sum of clipped gradients).
    """
    if idx.numel():
        subjects = silo.subject[idx]
        as_weights = None if weigh is None else (lambda factors: weigh(factors, subjects))
        x, y = silo.x[idx], silo.y[idx]
        if config.grad_method == "vmap" or not clipper_for(model).fast:
            grads = per_example_gradients(model, params, x, y)
            norms = per_example_norms(grads)
            factors = clip_factors(norms, config.clip)
            weights = factors if as_weights is None else as_weights(factors)
            summed = clipped_weighted_sum(grads, norms, weights)
        else:
            _, summed = clipper_for(model).norms_and_sum(
                params, x, y, clip=config.clip, weigh=as_weights
            )
    else:
        summed = {k: torch.zeros_like(v) for k, v in params.items()}
    return summed


def noisy_sum(
    summed: Params, *, noise_multiplier: float, sensitivity: float, coins: Coins
) -> Params:
    """``summed`` released by the exact Gaussian mechanism (std ``σ·Δ``); returned unchanged
    when ``σ = 0`` (a non-private run, which reports no privacy)."""
    if noise_multiplier == 0:
        return summed
    return gaussian_mechanism(
        summed, noise_multiplier=noise_multiplier, sensitivity=sensitivity, coins=coins
    )


def clipped_noisy_step(
    model: nn.Module,
    params: Params,
    silo: SiloData,
    idx: torch.Tensor,
    *,
    config: AlgorithmConfig,
    scale: float,
    coins: Coins,
    weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Params:
    """``w - η (Σ_i w_i clip(g_i) + N(0, σ²C²)) / scale`` on the batch ``idx``: the clipped sum
    (:func:`clipped_sum`) through the exact Gaussian mechanism with sensitivity ``C``, then
    divided by the public ``scale``."""
    summed = clipped_sum(model, params, silo, idx, config=config, weigh=weigh)
    noisy = noisy_sum(
        summed, noise_multiplier=config.noise_multiplier, sensitivity=config.clip, coins=coins
    )
    step = -config.lr / scale
    out = {}
    for name, value in params.items():
        update = noisy[name].to(value.dtype, copy=True)
        # value + step·update, written over its own copy (no second parameter-sized buffer)
        out[name] = torch.add(value.detach(), update, alpha=step, out=update)
    return out


@register
class LocalItemDP(Algorithm):
    """DP-SGD per silo; record-level (ε, δ)-DP, subject level derived by group conversion."""

    name = "local_item_dp"
    units = ("record", "subject")
    calibration_unit = "record"
    threat_model = "local noise: holds against the server and other silos"
    Config = GroupBoundConfig
    config: GroupBoundConfig

    def group_bound_scope(self) -> str | None:
        return self.group_scope

    def account_options(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "group_size": cfg.group_size,
            "group_capped": cfg.group_capped,
            **({"cross_silo_cap": True} if cfg.cross_silo_cap else {}),
        }

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        cfg = self.config
        q = sampling_rate
        record = poisson_gaussian_steps(q, cfg.noise_multiplier, cfg.local_steps)
        subject = subject_mixture_steps(q, cfg.noise_multiplier, cfg.group_size, cfg.local_steps)
        capped = record_event_under_caps(
            record,
            subject,
            group_capped=cfg.group_capped,
            cross_silo=self._cross_silo(),
            span_cap=cfg.span_cap,
        )
        views = {}
        if self._caps_seen_by_silos():
            views["silos"] = {"record": dp_event.NonPrivateDpEvent(), "subject": subject}
        return SiloPrivacy(
            {"record": capped, "subject": subject},
            record_event=record,
            group_size=cfg.group_size,
            group_scope=self.group_scope,
            views=views,
        )

    def _cross_silo(self) -> bool:
        """Whether a cap bounds a subject's records across silos (data's or uldp_group's)."""
        return self.config.cross_silo_cap or self.group_scope == "federation"

    def _caps_seen_by_silos(self) -> bool:
        return caps_seen_by_silos(cross_silo=self._cross_silo(), span_cap=self.config.span_cap)

    def accounting_notes(self) -> list[str]:
        return [CAPS_SEEN_BY_SILOS_NOTE] if self._caps_seen_by_silos() else []

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
        check_group_bound(silo, cfg.group_size)
        q = self.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        return self.run_steps(
            params,
            silo,
            select=lambda: poisson_mask(silo.num_records, q, coins),
            step=lambda local, idx: clipped_noisy_step(
                model,
                local,
                silo,
                idx,
                config=cfg,
                scale=q * silo.num_records,
                coins=coins,
            ),
        )


@register
class LocalGroupDP(LocalItemDP):
    """DP-SGD per silo with σ calibrated for subject-level (ε, δ) through group privacy."""

    name = "local_group_dp"
    calibration_unit = "subject"
