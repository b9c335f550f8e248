"""What every algorithm is: one local update per silo and one aggregation on the server.

Both steps are plain functions of parameters and data, so the in-process simulator and a real
federation (e.g. Flower clients and strategies) call the same code. Every local update returns
the DP events it ran (:class:`~silodp.accounting.SiloPrivacy`); the accountant is derived from
those events only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_non_negative,
    check_positive,
    check_probability,
)
from silodp.accounting import SiloPrivacy
from silodp.data import FederatedDataset
from silodp.privacy.gradients import Params, batch_gradient
from silodp.privacy.randomness import Coins

__all__ = ["Algorithm", "AlgorithmConfig", "SiloData", "SiloUpdate", "average_params"]


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Public hyperparameters of a local update.

    Attributes:
      local_steps: T, local steps per round.
      batch_size: expected mini-batch size (records; subjects for subject-level sampling).
      lr: local learning rate η.
      server_lr: global learning rate η_g applied to the averaged update.
      clip: clipping bound C.
      noise_multiplier: σ; the noise added to a sum is ``N(0, σ² C² I)``.
      group_size: public bound k on one subject's records inside one silo (group conversion).
      sampling: HiGradAvgDP batch selection, ``record`` (Poisson records) or ``subject``
        (Poisson subjects, up to ``subject_records`` records each).
      subject_records: records used per sampled subject with ``sampling="subject"``.
      local_epochs: Q, epochs of per-subject (ULDP-AVG) or per-silo (ULDP-NAIVE) training.
      subject_rate: ULDP subject-level Poisson sub-sampling rate q (1: every subject).
      subject_sampler: who draws the ULDP subject sample: ``silos`` (from a secret the silos
        share and the server never sees; amplification holds against the server, not against
        the silos) or ``server`` (the server draws it: no amplification against the server).
      grad_method: per-example clipping path: ``auto`` (activation/gradient contractions where
        every layer supports them, else ``vmap``), or ``vmap`` (materialised per-example
        gradients; exact reference).
      weighting: ``uldp_avg_w`` weights ``n_{s,a}/n_a``: ``protocol`` (the private weighting
        protocol; no party sees another silo's histogram) or ``clear`` (computed from the
        histograms in the clear).
      num_silos: S, the number of silos (public). The ULDP methods split their noise over the
        silos, and one curious silo knows its own share: accounting that adversary needs S.
      key_bits: Paillier modulus size of the weighting protocol (at least 2048).
      n_max: public bound on a subject's records in the federation for the weighting protocol.
      client_rate: PriFedSync Poisson client-sampling rate p per round.
      optimizer: PriFedSync local optimizer applied to the noisy gradient: ``sgd``,
        ``momentum`` or ``adam``.
      momentum: momentum (and Adam's β1) of the local optimizer.
      helper: PriFedSync helper model ``identity`` (FedAvg) or ``interpolate``.
      alpha: interpolation weight α_i of the helper model, one for all clients or one per client.
    """

    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.1
    server_lr: float = 1.0
    clip: float = 1.0
    noise_multiplier: float = 1.0
    group_size: int = 1
    sampling: str = "record"
    subject_records: int = 8
    local_epochs: int = 1
    subject_rate: float = 1.0
    subject_sampler: str = "silos"
    grad_method: str = "auto"
    weighting: str = "protocol"
    key_bits: int = 3072
    n_max: int = 2000
    num_silos: int | None = None
    client_rate: float = 1.0
    optimizer: str = "sgd"
    momentum: float = 0.9
    helper: str = "identity"
    alpha: float | tuple[float, ...] = 0.5

    def __post_init__(self) -> None:
        check_choice("weighting", self.weighting, ("protocol", "clear"))
        check_int("key_bits", self.key_bits, 1)
        check_int("n_max", self.n_max, 1)
        if self.num_silos is not None:
            check_int("num_silos", self.num_silos, 1)
        check_probability("client_rate", self.client_rate)
        check_choice("optimizer", self.optimizer, ("sgd", "momentum", "adam"))
        check_in_range("momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_choice("helper", self.helper, ("identity", "interpolate"))
        for a in self.alpha if isinstance(self.alpha, tuple) else (self.alpha,):
            check_in_range("alpha", a, 0.0, 1.0)
        check_int("local_steps", self.local_steps, 1)
        check_int("local_epochs", self.local_epochs, 1)
        check_probability("subject_rate", self.subject_rate)
        check_choice("subject_sampler", self.subject_sampler, ("silos", "server"))
        check_choice("grad_method", self.grad_method, ("auto", "vmap"))
        check_int("batch_size", self.batch_size, 1)
        check_positive("lr", self.lr)
        check_positive("server_lr", self.server_lr)
        check_positive("clip", self.clip)
        check_non_negative("noise_multiplier", self.noise_multiplier)
        check_int("group_size", self.group_size, 1)
        check_choice("sampling", self.sampling, ("record", "subject"))
        check_int("subject_records", self.subject_records, 1)


@dataclass(frozen=True, eq=False)
class SiloData:
    """One silo's records as tensors; ``subject`` ids are federation-wide."""

    silo: int
    x: torch.Tensor
    y: torch.Tensor
    subject: torch.Tensor

    @property
    def num_records(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_subjects(self) -> int:
        """Distinct subjects in this silo (public metadata, like the silo's size)."""
        return int(torch.unique(self.subject).numel())


@dataclass
class SiloUpdate:
    """A silo's result for one round: its message to the server, events run, diagnostics.

    ``params`` is the message: the silo's new local parameters for averaging algorithms, or
    its noisy weighted sum of model deltas for the ULDP family.
    """

    silo: int
    params: Params
    num_records: int
    privacy: SiloPrivacy | None
    group_sizes: list[int] = field(default_factory=list)
    subjects_per_batch: list[int] = field(default_factory=list)
    #: Anything else the server step needs from this silo (e.g. protocol messages).
    payload: Any = None


def average_params(
    global_params: Params, updates: Sequence[SiloUpdate], *, server_lr: float = 1.0
) -> Params:
    """``w + η_g · mean_s(w_s - w)``: the unweighted average of the silos' models."""
    if not updates:
        return {k: v.clone() for k, v in global_params.items()}
    out: Params = {}
    for name, value in global_params.items():
        mean_delta = torch.stack([u.params[name] - value for u in updates]).mean(dim=0)
        out[name] = value + server_lr * mean_delta
    return out


class Algorithm(ABC):
    """A federated algorithm: ``local_update`` in each silo, ``aggregate`` on the server."""

    name: ClassVar[str]
    #: Units this algorithm's events protect (reported every round).
    units: ClassVar[tuple[str, ...]] = ()
    #: Unit at which a target ε calibrates σ (None: not private).
    calibration_unit: ClassVar[str | None] = None
    #: Threat model statement reported with results.
    threat_model: ClassVar[str] = ""
    #: Whether the accounting relies on ``config.group_size`` (a bound on a subject's records).
    uses_group_bound: ClassVar[bool] = False
    #: What ``group_size`` bounds: a subject's records in one silo, or in the federation.
    group_scope: ClassVar[str] = "silo"

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    def run_notes(self) -> list[str]:
        """Caveats a reviewer must read beside this algorithm's reported ε (in summaries)."""
        return []

    @abstractmethod
    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy | None:
        """The events one round runs in a silo whose batches are drawn at ``sampling_rate``."""

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        """The algorithm set up for a federation (server-side public facts, e.g. weights).

        ``coins``: the set-up's randomness (e.g. a secret the silos share); default secure."""
        return cls(config)

    def configure_round(self, round_index: int, coins: Coins) -> Any:
        """Server step before a round: what it sends every silo besides the model (e.g. this
        round's subject weights). ``None`` for algorithms that need nothing. ``coins``: the
        server's randomness for this round."""
        return None

    @abstractmethod
    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        coins: Coins,
        instructions: Any = None,
    ) -> SiloUpdate:
        """Runs one round of local training from ``params`` on ``silo``.

        ``coins`` is the silo's randomness for this round (batch sampling and noise: secret
        in secure mode); ``instructions`` is what :meth:`configure_round` returned.
        """

    def aggregate(self, params: Params, updates: Sequence[SiloUpdate]) -> Params:
        """Server step: average of the sampled silos' models (post-processing)."""
        return average_params(params, updates, server_lr=self.config.server_lr)

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        """Poisson sampling rate of a silo's batches: ``q = min(1, B / n_s)`` for records."""
        return min(1.0, self.config.batch_size / num_records)

    def run_steps(
        self,
        params: Params,
        silo: SiloData,
        *,
        select: Callable[[], torch.Tensor],
        step: Callable[[Params, torch.Tensor], Params],
    ) -> SiloUpdate:
        """``local_steps`` times: pick a batch with ``select``, update with ``step``; records
        the per-batch diagnostics and the events of :meth:`silo_privacy_for`."""
        local = {k: v.clone() for k, v in params.items()}
        groups, distinct = [], []
        for _ in range(self.config.local_steps):
            idx = select()
            local = step(local, idx)
            largest, subjects = batch_diagnostics(silo.subject[idx])
            groups.append(largest)
            distinct.append(subjects)
        privacy = self.silo_privacy_for(silo)
        return SiloUpdate(silo.silo, local, silo.num_records, privacy, groups, distinct)

    def silo_privacy_for(self, silo: SiloData) -> SiloPrivacy | None:
        """The events one round runs in ``silo`` (from its public size only)."""
        rate = self.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        return self.silo_privacy(sampling_rate=rate)


def check_group_bound(silo: SiloData, group_size: int) -> None:
    """Refuses a silo in which a subject holds more records than the accounted bound ``k``."""
    _, counts = torch.unique(silo.subject, return_counts=True)
    largest = int(counts.max())
    if largest > group_size:
        raise ValueError(
            f"Silo {silo.silo} holds {largest} records of one subject, above the accounted "
            f"group_size={group_size}; cap the data (privacy.group_size) or raise the bound."
        )


def batch_diagnostics(subjects: torch.Tensor) -> tuple[int, int]:
    """(largest group of one subject, distinct subjects) in a mini-batch."""
    if subjects.numel() == 0:
        return 0, 0
    _, counts = torch.unique(subjects, return_counts=True)
    return int(counts.max()), int(counts.numel())


def sgd_step(
    model: nn.Module, params: Params, silo: SiloData, idx: torch.Tensor, *, lr: float
) -> Params:
    """One plain (non-private) mini-batch SGD step on the records ``idx`` of ``silo``."""
    grads = batch_gradient(model, params, silo.x[idx], silo.y[idx])
    return {k: v - lr * grads[k] for k, v in params.items()}


def uniform_batch(n: int, size: int, coins: Coins) -> torch.Tensor:
    """``min(size, n)`` distinct indices drawn uniformly (sampling without replacement): the
    first ones of an exactly uniform permutation."""
    return coins.permutation(n)[: min(size, n)]


def poisson_mask(n: int, rate: float, coins: Coins) -> torch.Tensor:
    """Indices selected by independent Bernoulli(rate) draws (Poisson sampling; each index
    is in with probability exactly ``rate``)."""
    return torch.nonzero(coins.bernoulli(n, rate)).flatten()


def to_numpy(params: Params) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in params.items()}
