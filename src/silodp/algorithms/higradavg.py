"""HiGradAvgDP (Marathe et al.): hierarchical gradient averaging for subject-level DP.

Per step: select a batch; clip every per-example gradient to C; **average the clipped
gradients of each subject** (so one subject contributes a vector of norm ≤ C); sum over subjects;
add ``N(0, σ²C²I)``; divide by the public expected number of subjects in a batch. Removing one
subject changes the sum by at most C, so each step is a Gaussian mechanism with sensitivity C at
subject level, sub-sampled at the subject's inclusion rate:

* ``sampling="record"``: Poisson records at ``q = B/n_s``; a subject with ≤ k records in the
  silo is in the batch with probability ``1-(1-q)^k`` (SPEC §2; the workshop paper's rate
  ``B/n_s`` under-counts).
* ``sampling="subject"``: Poisson subjects at ``q = B/(subjects in silo)``, up to
  ``subject_records`` random records of each; the rate is exactly q.

Subject-level guarantee composes over the ``span`` silos a subject occupies; it holds against
the server and other silos (noise is local). Silo sizes and subject counts are treated as
public, as ``n_s`` is in DP-SGD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from silodp._validation import check_choice, check_int
from silodp.accounting import SiloPrivacy
from silodp.accounting.events import poisson_gaussian_steps
from silodp.algorithms.base import (
    Algorithm,
    SiloData,
    SiloUpdate,
    check_group_bound,
    hyperparameter,
    poisson_mask,
)
from silodp.algorithms.dp_sgd import GroupBoundConfig, clipped_noisy_step
from silodp.algorithms.registry import register
from silodp.privacy.gradients import Params, subject_average_weights
from silodp.privacy.randomness import Coins

__all__ = ["HiGradAvgConfig", "HiGradAvgDP", "select_subject_batch"]


@dataclass(frozen=True, kw_only=True)
class HiGradAvgConfig(GroupBoundConfig):
    """HiGradAvgDP's hyperparameters.

    Attributes:
      sampling: batch selection, ``record`` (Poisson records) or ``subject`` (Poisson
        subjects, up to ``subject_records`` records each).
      subject_records: records used per sampled subject with ``sampling="subject"``.
    """

    sampling: str = hyperparameter(
        "record", "privacy", "higradavg_dp: record or subject sampling.", account=True
    )
    subject_records: int = hyperparameter(8, "privacy", "Records per sampled subject.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.key("sampling"), self.sampling, ("record", "subject"))
        check_int(self.key("subject_records"), self.subject_records, 1)


def select_subject_batch(
    subjects: torch.Tensor, *, rate: float, per_subject: int, coins: Coins
) -> torch.Tensor:
    """Poisson-samples subjects at ``rate`` (exactly) and keeps ``per_subject`` records of each
    chosen one, uniformly at random (all of them if it has fewer).

    Vectorised: one sort by (subject, random distinct rank) and a rank within each subject.
    """
    uniq, inverse = torch.unique(subjects, return_inverse=True)
    chosen = coins.bernoulli(uniq.numel(), rate)
    keys = coins.ranks(subjects.numel())
    order = torch.argsort(inverse * subjects.numel() + keys)
    sorted_group = inverse[order]
    counts = torch.bincount(inverse, minlength=uniq.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(subjects.numel()) - starts[sorted_group]
    keep = (rank < per_subject) & chosen[sorted_group]
    return torch.sort(order[keep]).values


@register
class HiGradAvgDP(Algorithm):
    """Subject-level DP by averaging each subject's clipped gradients before noising."""

    name = "higradavg_dp"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = "local noise: holds against the server and other silos"
    Config = HiGradAvgConfig
    config: HiGradAvgConfig

    def group_bound_scope(self) -> str | None:
        """``silo`` with record sampling (its inclusion rate 1-(1-q)^k uses the bound k)."""
        return "silo" if self.config.sampling == "record" else None

    def account_options(self) -> dict[str, Any]:
        return {"group_size": self.config.group_size, "sampling": self.config.sampling}

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        """Record rate ``B/n_s``, or subject rate ``B/(subjects in silo)`` with subject sampling."""
        if self.config.sampling == "subject":
            return min(1.0, self.config.batch_size / num_subjects)
        return min(1.0, self.config.batch_size / num_records)

    def subject_rate(self, sampling_rate: float) -> float:
        """Probability that a given subject is in one step's batch."""
        if self.config.sampling == "subject":
            return sampling_rate
        return 1.0 - (1.0 - sampling_rate) ** self.config.group_size

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        cfg = self.config
        rate = self.subject_rate(sampling_rate)
        return SiloPrivacy(
            {"subject": poisson_gaussian_steps(rate, cfg.noise_multiplier, cfg.local_steps)}
        )

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
        n, subjects = silo.num_records, silo.num_subjects
        if cfg.sampling == "record":  # the inclusion rate 1-(1-q)^k relies on the bound k
            check_group_bound(silo, cfg.group_size)
        q = self.sampling_rate(num_records=n, num_subjects=subjects)
        expected_subjects = self.subject_rate(q) * subjects

        def select() -> torch.Tensor:
            if cfg.sampling == "subject":
                return select_subject_batch(
                    silo.subject, rate=q, per_subject=cfg.subject_records, coins=coins
                )
            return poisson_mask(n, q, coins)

        return self.run_steps(
            params,
            silo,
            select=select,
            step=lambda local, idx: clipped_noisy_step(
                model,
                local,
                silo,
                idx,
                config=cfg,
                scale=expected_subjects,
                coins=coins,
                weigh=subject_average_weights,
            ),
        )
