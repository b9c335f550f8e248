"""ULDP-AVG and ULDP-SGD: per-subject training, weighted, clipped and noised (see
:mod:`silodp.algorithms.uldp` for the family)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from dp_accounting import dp_event
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import (
    gaussian_steps,
    known_sample_gaussian_steps,
    poisson_gaussian_steps,
)
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
)
from silodp.algorithms.registry import register
from silodp.algorithms.uldp_common import (
    OWN_NOISE_NOTE,
    SECURE_AGGREGATION,
    SIMULATED_AGGREGATION_NOTE,
    WEIGHTS_IN_CLEAR_NOTE,
    RoundWeights,
    SiloSide,
    UldpConfig,
    apply_total,
    check_weights,
    deltas_method,
    exact_sum,
    gaussian_share,
    sampling_note,
    share_grid,
    uniform_weights,
)
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset
from silodp.privacy.ghost import clipper_for
from silodp.privacy.gradients import Params, clip_factors, drop_non_finite, row_norms
from silodp.privacy.per_subject import per_subject_deltas, subject_batches
from silodp.privacy.randomness import Coins
from silodp.privacy.stacked import StackedModel

#: ULDP-SGD on a CNN: below this many records per subject on average, the norms of
#: per-example gradients at the shared weights are cheaper than stacked per-subject copies
#: (measured crossover about 2.5 on uldp_cnn and mnist_cnn: docs/performance.md).
STACKED_MIN_RECORDS = 3


@register
class UldpAvg(Algorithm):
    """ULDP-AVG with uniform weights ``1/S``: per-subject training and weighted clipping.

    Subject sub-sampling at ``subject_rate`` q, drawn as ``subject_sampler`` says: by the
    silos from the key in :attr:`silo_side` (set up by :meth:`for_data` from its coins), or by
    the server in :meth:`configure_round`. :meth:`silo_privacy` states the guarantee per
    adversary: sub-sampled ``(q, σ)`` for whoever does not learn the sample, the known-sample
    mechanism for whoever does.
    """

    name = "uldp_avg"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = SECURE_AGGREGATION
    Config = UldpConfig
    #: messages are float64 (on the noise grid, or unnoised), summed exactly
    message_dtype = torch.float64
    config: UldpConfig
    #: one full-batch gradient step per subject instead of Q epochs of mini-batches
    single_step: ClassVar[bool] = False
    #: whether the weights were computed without revealing silos' histograms
    weights_private: bool = True

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        weights: np.ndarray | None = None,
        sample_key: SharedSampleKey | None = None,
    ) -> None:
        super().__init__(config)
        self.weights = None if weights is None else torch.from_numpy(check_weights(weights))
        #: silo-side secrets: :meth:`configure_round` and :meth:`aggregate` never read them
        self.silo_side = None if sample_key is None else SiloSide(sample_key)

    def account_options(self) -> dict[str, Any]:
        if self.config.subject_rate >= 1.0:
            return {}
        return {"subject_sampler": self.config.subject_sampler}

    def run_notes(self) -> list[str]:
        notes = [] if self.weights_private else [WEIGHTS_IN_CLEAR_NOTE]
        return notes + self._sampling_notes() + [SIMULATED_AGGREGATION_NOTE, *self._own_noise()]

    def weights_seen_by(self) -> tuple[str, ...]:
        """The adversaries with no subject-level guarantee because they see the weights
        (none: ``uldp_avg``'s weights are uniform and public)."""
        return ()

    def _own_noise(self) -> list[str]:
        return [] if "silos" in self.weights_seen_by() else [OWN_NOISE_NOTE]

    def _sampling_notes(self) -> list[str]:
        cfg = self.config
        note = sampling_note(
            rate=cfg.subject_rate,
            sampler=cfg.subject_sampler,
            protocol=self._server_sample_hidden_from_silos,
            no_guarantee=self.weights_seen_by(),
        )
        return [] if note is None else [note]

    @classmethod
    def make_weights(cls, train: FederatedDataset) -> np.ndarray:
        return uniform_weights(train.num_silos, train.num_subjects)

    @staticmethod
    def shared_sample_key(config: UldpConfig, coins: Coins | None) -> SharedSampleKey | None:
        """The silos' shared sampling key (32 bytes from ``coins``, secure by default) when
        they draw the subject sample, else ``None``."""
        if config.subject_sampler != "silos":
            return None
        return SharedSampleKey.generate(coins if coins is not None else Coins.secure())

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        cfg: UldpConfig = cls.configure(config)
        return cls(
            cfg,
            weights=cls.make_weights(train),
            sample_key=cls.shared_sample_key(cfg, coins),
        )

    @property
    def num_subjects(self) -> int:
        return int(self._base_weights().shape[1])

    def silo_setup(self) -> dict[str, Any]:
        return {"weights": self._base_weights().numpy()}

    @classmethod
    def at_silo(
        cls,
        config: AlgorithmConfig,
        setup: Mapping[str, Any],
        *,
        sample_key: SharedSampleKey | None = None,
    ) -> Algorithm:
        return cls(config, weights=setup["weights"], sample_key=sample_key)

    def secure_sum_grid(self) -> float | None:
        cfg = self.config
        return share_grid(cfg.noise_multiplier, cfg.clip, self._silo_count())

    def _base_weights(self) -> torch.Tensor:
        if self.weights is None:
            raise ValueError(f"{self.name} needs weights; build it with for_data().")
        return self.weights

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        return self.config.subject_rate

    @property
    def _server_sample_hidden_from_silos(self) -> bool:
        """Whether a sample drawn by the server stays hidden from the silos (clear weights:
        no, the silos see the zeros)."""
        return False

    def sample_known_to(self) -> tuple[str, ...]:
        """The adversaries that learn the subject sample (accounted without amplification)."""
        if self.config.subject_sampler == "silos":
            return ("silos",)
        return ("server",) if self._server_sample_hidden_from_silos else ("server", "silos")

    #: the sum's sensitivity, in units of C, to a subject's records in the other silos, for a
    #: silo that knows its own records (fixed weights 1/S: its own term does not move)
    silos_sensitivity: ClassVar[float] = 1.0

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        """One round: a Gaussian with noise multiplier σ on the sum over silos, Poisson
        sub-sampled at ``sampling_rate`` (the released model's view). Adversaries that learn
        the sample get no amplification (known-sample events). A curious silo also knows its
        own share of the noise: to it the other silos' noise has multiplier σ·√((S-1)/S),
        against a sensitivity of :attr:`silos_sensitivity` · C (its own records fixed)."""
        sigma = self.config.noise_multiplier
        num_silos = self._silo_count()
        silo_sigma = sigma * math.sqrt((num_silos - 1) / num_silos) / self.silos_sensitivity
        knows = self.sample_known_to()

        def event(noise: float, known: bool) -> dp_event.DpEvent:
            if sampling_rate >= 1.0:
                return gaussian_steps(noise, 1)
            if known:
                return known_sample_gaussian_steps(sampling_rate, noise, 1)
            return poisson_gaussian_steps(sampling_rate, noise, 1)

        views: dict[str, dict[str, dp_event.DpEvent]] = {}
        if "server" in knows and sampling_rate < 1.0:
            views["server"] = {"subject": event(sigma, True)}
        if num_silos > 1:  # with one silo there is no other silo to learn anything
            views["silos"] = {"subject": event(silo_sigma, "silos" in knows)}
        return SiloPrivacy({"subject": event(sigma, False)}, scope="aggregate", views=views)

    def _silo_count(self) -> int:
        """S, from the config or from the weights of :meth:`for_data`."""
        if self.config.num_silos is not None:
            return self.config.num_silos
        if self.weights is not None:
            return int(self.weights.shape[0])
        raise ValueError(
            f"{self.name} needs the number of silos to account a curious silo; set "
            "AlgorithmConfig.num_silos or build it with for_data()."
        )

    def configure_round(self, round_index: int, coins: Coins) -> RoundWeights:
        """Server: this round's weights. ``subject_sampler="server"``: Poisson-samples subjects
        at ``subject_rate`` from ``coins`` and zeroes the others' weights; ``"silos"``: the
        base weights, the same whatever the silos' sample."""
        weights = self._base_weights()
        cfg = self.config
        if cfg.subject_sampler == "silos":
            return RoundWeights(weights, None, round_index)
        if cfg.subject_rate >= 1.0:
            sampled = torch.ones(self.num_subjects, dtype=torch.bool)
        else:
            sampled = coins.bernoulli(self.num_subjects, cfg.subject_rate)
        return RoundWeights(weights * sampled.to(weights.dtype), sampled, round_index)

    def silo_sample(self, round_index: int) -> torch.Tensor:
        """Silo side: round ``round_index``'s subject sample derived from the shared key."""
        if self.silo_side is None:
            raise ValueError(
                f"{self.name} with subject_sampler='silos' needs the silos' shared sample key; "
                "build it with for_data()."
            )
        return self.silo_side.sample(round_index, self.num_subjects, self.config.subject_rate)

    def _samples_at_silos(self) -> bool:
        cfg = self.config
        return cfg.subject_sampler == "silos" and cfg.subject_rate < 1.0

    def _silo_row(self, instructions: RoundWeights, silo: int) -> torch.Tensor:
        """Silo ``silo``'s weights this round, zero outside the sample."""
        row = instructions.weights[silo]
        if instructions.sampled is None and self._samples_at_silos():
            row = row * self.silo_sample(instructions.round_index).to(row.dtype)
        return row

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
        if not isinstance(instructions, RoundWeights):
            raise ValueError(f"{self.name} needs this round's RoundWeights from configure_round.")
        row = self._silo_row(instructions, silo.silo)
        present = torch.unique(silo.subject)
        order = present[row[present] > 0]
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        if order.numel() and self.single_step and self._fast(model, silo.subject, order):
            total = self._single_step_sum(model, params, silo, order, row)
        elif order.numel():
            batches = subject_batches(
                silo.subject,
                order,
                epochs=1 if self.single_step else cfg.local_epochs,
                batch_size=None if self.single_step else cfg.batch_size,
                coins=coins,
            )
            for rows, deltas in per_subject_deltas(
                model, params, silo.x, silo.y, batches, lr=cfg.lr, method=deltas_method(cfg)
            ):
                # per-subject norms parameter by parameter (no concatenated copy of the
                # chunk), in float64 as clip_factors' margin needs
                norms = [row_norms(d.flatten(1)) for d in deltas.values()]
                total_norms = torch.linalg.vector_norm(torch.stack(norms), dim=0)
                factors = clip_factors(total_norms, cfg.clip)
                coeff = factors * row[order[rows]].to(factors.dtype)
                for k, d in deltas.items():
                    kept = drop_non_finite(d, total_norms)
                    total[k] += torch.tensordot(coeff.to(d.dtype), kept, dims=1)
        message = gaussian_share(
            total,
            noise_multiplier=cfg.noise_multiplier,
            sensitivity=cfg.clip,
            coins=coins,
            shares=int(instructions.weights.shape[0]),
        )
        privacy = self.silo_privacy(sampling_rate=cfg.subject_rate)
        # how many of its subjects were sampled is the silos' secret when they sample
        counts = [] if self._samples_at_silos() else [int(order.numel())]
        return SiloUpdate(silo.silo, message, silo.num_records, privacy, subjects_per_batch=counts)

    def _fast(self, model: nn.Module, subjects: torch.Tensor, order: torch.Tensor) -> bool:
        """Whether one full-batch step per subject is summed from per-subject gradient norms
        (no model copies). Chains of convolutions train their subjects' copies as one
        grouped model instead (``per_subject_deltas``) when the subjects ``order`` hold
        :data:`STACKED_MIN_RECORDS` or more records on average."""
        if self.config.grad_method != "auto" or not clipper_for(model).fast:
            return False
        if StackedModel.trace(model) is None:
            return True
        records = int(torch.isin(subjects, order).sum())
        return records < STACKED_MIN_RECORDS * order.numel()

    def _single_step_sum(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        order: torch.Tensor,
        row: torch.Tensor,
    ) -> Params:
        """``Σ_a w_a clip(-η G_a)`` for one full-batch step per subject, from per-subject
        gradient norms (no per-subject model copies)."""
        cfg = self.config
        keep = torch.isin(silo.subject, order)
        subjects = silo.subject[keep]
        ids = torch.unique(subjects)
        weights = row[ids].to(next(iter(params.values())).dtype)

        def coefficients(norms: torch.Tensor) -> torch.Tensor:
            return -cfg.lr * weights * clip_factors(cfg.lr * norms, cfg.clip)

        _, summed = clipper_for(model).subject_norms_and_sum(
            params, silo.x[keep], silo.y[keep], subjects, weigh=coefficients
        )
        return summed

    def aggregate(
        self, params: Params, updates: Sequence[SiloUpdate], states: Sequence[Any] = ()
    ) -> Params:
        """``w + η_g · Σ_s message_s / (q·|U|)``: the secure sum (in float64, cast after) over
        the public expected number of sampled subjects."""
        cfg = self.config
        grid = share_grid(cfg.noise_multiplier, cfg.clip, self._silo_count())
        total = exact_sum(params, updates, grid)
        scale = self.config.subject_rate * self.num_subjects
        return apply_total(params, total, self.config.server_lr / scale)


@register
class UldpSgd(UldpAvg):
    """ULDP-SGD: as ULDP-AVG with one full-batch gradient step per subject."""

    name = "uldp_sgd"
    single_step = True


#: noise coordinates are encoded up to this many standard deviations (exceeding it, with
#: probability below 1e-300 per coordinate, aborts the round with ValueOutOfRangeError)
