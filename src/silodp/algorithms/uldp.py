"""The ULDP-FL family (Kato et al., "ULDP-FL: federated learning with across-silo user-level
differential privacy"): subject-level DP when a subject's records sit in several silos.

* ``uldp_naive``: non-private local training, the silo's model delta clipped to C, noise
  ``N(0, σ²C²·S)`` per silo. Removing a subject changes (not removes) every silo's data, so
  each clipped delta moves by up to 2C (replacement, as for UserLDP) and the sum has
  sensitivity 2·S·C; the summed noise has std σ·C·S: one Gaussian (σ/2) per round.
* ``uldp_group`` (ULDP-GROUP-k): at most k records per subject in the whole federation (fixed,
  seeded flags; the rest dropped before training), DP-SGD in each silo; the record-level
  guarantee of all silos jointly is converted to groups of k.
* ``uldp_avg`` / ``uldp_sgd``: per silo and per subject, train from the global model on that
  subject's records only (Q epochs; one gradient step for SGD), clip the delta to C, weight it
  by ``w_{s,a}`` (``w >= 0``, ``Σ_s w_{s,a} <= 1``), sum over subjects and add ``N(0, σ²C²/S)``.
  Removing a subject moves the sum over silos by at most ``Σ_s w_{s,a} C <= C`` and the summed
  noise has std σC: one Gaussian (σ) per round, Poisson sub-sampled at rate q (the weights of
  the subjects outside the sample are zero). The server divides the secure sum by the public
  expected number of subjects ``q·|U|`` and applies the global learning rate.
* ``uldp_avg_w``: ``uldp_avg`` with ``w_{s,a} = n_{s,a}/n_a``, by default computed and
  applied through the private weighting protocol of ULDP-FL (Protocol 1; :mod:`silodp.crypto`):
  the weights, the per-subject weighting and the secure sum happen under Paillier encryption,
  multiplicative blinding and pairwise masks, all parties run in this process.

Noise: every silo releases the exact Gaussian mechanism's share
(:func:`~silodp.privacy.noise.gaussian_mechanism`, ``shares=S``: float64 values on a grid) and
the server sums the silos' messages in float64 - exactly - before anything is rounded to the
parameters' dtype; through the protocol, each silo draws its noise as exact rounded-Gaussian
integers on the protocol's own grid (:mod:`silodp.crypto.encoding`). Either way the released
sum is a post-processing of the continuous Gaussian mechanism that is accounted.

Who sees the subject sample decides whom sub-sampling protects (SPEC §2).
``subject_sampler="silos"`` (default): the silos derive each round's sample from a key they
share and the server never sees (:mod:`silodp.crypto.sampling`; through the protocol, a key
derived from its shared seed); the server's messages do not depend on the sample, so the
amplified ε holds for the released model and against the server, and the known-sample ε
(no amplification) against the silos. ``subject_sampler="server"``: the server draws it and
gets no amplification; the silos see it too with clear weights (zeroed), not through the
protocol (``Enc(0)``). :meth:`UldpAvg.silo_privacy` returns these per-adversary views.

The noise is split over silos, so every guarantee against the server holds only if it sees
nothing but the sum of the silos' messages (secure aggregation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
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
    sgd_step,
)
from silodp.algorithms.dp_sgd import LocalItemDP
from silodp.crypto.messages import EncryptedWeights, MaskedWeightedSum
from silodp.crypto.protocol import ProtocolConfig, WeightingSession, with_identities
from silodp.crypto.randomness import RandomSource
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset
from silodp.privacy.ghost import clipper_for
from silodp.privacy.gradients import Params, clip_factors, tree_norm
from silodp.privacy.noise import gaussian_mechanism, grid_exponent
from silodp.privacy.per_subject import per_subject_deltas, subject_batches
from silodp.privacy.randomness import Coins

__all__ = [
    "ProtocolRound",
    "RoundWeights",
    "SiloSide",
    "UldpAvg",
    "UldpAvgW",
    "UldpGroup",
    "UldpNaive",
    "UldpSgd",
    "check_weights",
    "record_weights",
    "uniform_weights",
]

SECURE_AGGREGATION = (
    "secure aggregation: noise is split over silos; ε holds for the released model and, "
    "against the server, only if it sees just the sum of the silos' messages; the subject "
    "sample amplifies ε only against parties that do not learn it (ε per adversary)"
)

SIMULATED_AGGREGATION_NOTE = (
    "the in-process simulator does not implement secure aggregation: ε holds for the "
    "released model; every ε against the server assumes secure aggregation (the server "
    "sees only the sum of the silos' messages)"
)

OWN_NOISE_NOTE = (
    "against the silos: one curious silo knows its own share (1/S of the variance) of the "
    "noise, so its ε is accounted at the noise multiplier σ·√((S-1)/S) that the other silos' "
    "noise gives it; silos that collude are not covered"
)

PROTOCOL_AGGREGATION_NOTE = (
    "private weighting protocol run in-process: weights n_{s,a}/n_a, per-subject weighting "
    "and the sum over silos were computed under Paillier encryption with blinded histograms "
    "and pairwise masks; the server object decrypted only the sum over all silos. This holds "
    "against an honest-but-curious server that colludes with no silo (key shares signed with "
    "registered Ed25519 identity keys); deltas are clipped so that their fixed-point "
    "encodings stay within C, and each silo draws its noise exactly as rounded-Gaussian "
    "integers on the aggregate's grid, a post-processing of the accounted Gaussian mechanism"
)

WEIGHTS_IN_CLEAR_NOTE = (
    "weights not private: the weights n_{s,a}/n_a were computed in the clear from "
    "every silo's subject histogram"
)


def sampling_note(*, rate: float, sampler: str, protocol: bool) -> str | None:
    """Which ε holds against whom, given who draws the subject sample (None when ``rate`` is 1:
    no sub-sampling, every adversary has the same ε)."""
    if rate >= 1.0:
        return None
    head = f"subject sample (rate {rate:g})"
    if sampler == "silos" and protocol:
        return (
            f"{head} drawn by the silos from a key derived from the protocol's shared seed: "
            "the server encrypts a weight for every subject and learns nothing about the "
            "sample, so the sub-sampled ε holds for the released model and against the "
            "server; against the silos, who know the sample, the known-sample ε (no "
            "amplification)"
        )
    if sampler == "silos":
        return (
            f"{head} drawn by the silos from a key they share and the server never sees: "
            "the server's messages do not depend on it, so the sub-sampled ε holds for the "
            "released model and against the server; against the silos, who know the "
            "sample, the known-sample ε (no amplification)"
        )
    if protocol:
        return (
            f"{head} drawn by the server, hidden from the silos by Enc(0) weights: the "
            "sub-sampled ε holds for the released model and against the silos; against the "
            "server, which knows the sample, the known-sample ε (no amplification)"
        )
    return (
        f"{head} drawn by the server and sent as zero weights: the sub-sampled ε holds "
        "only for the released model; against the server and the silos, who know the "
        "sample, the known-sample ε (no amplification)"
    )


def _gaussian_share(
    values: Params, *, noise_multiplier: float, sensitivity: float, coins: Coins, shares: int
) -> Params:
    """One silo's share of the Gaussian mechanism (σ, Δ) on the sum of ``shares`` silos'
    values (:func:`~silodp.privacy.noise.gaussian_mechanism`); σ = 0 releases the values
    unnoised, in float64 (no guarantee: the accountant reports ε = ∞)."""
    if noise_multiplier == 0.0:
        return {k: v.to(torch.float64) for k, v in values.items()}
    return gaussian_mechanism(
        values,
        noise_multiplier=noise_multiplier,
        sensitivity=sensitivity,
        coins=coins,
        shares=shares,
    )


def _exact_sum(params: Params, updates: Sequence[SiloUpdate], grid: float | None) -> Params:
    """``Σ_s message_s``, exactly: the shares of the Gaussian mechanism are multiples of the
    power of two ``grid``, summed as integers (``grid=None``: σ = 0, no noise, a float64 sum).
    Refuses messages off the grid or a sum beyond float64's exact integers (2^53 steps)."""
    out: Params = {}
    for k, v in params.items():
        if grid is None:
            out[k] = sum(
                (u.params[k].to(torch.float64) for u in updates),
                torch.zeros(v.shape, dtype=torch.float64),
            )
            continue
        steps = [u.params[k].to(torch.float64) / grid for u in updates]
        if any(not torch.equal(t, torch.round(t)) or t.abs().max() >= 2.0**62 for t in steps):
            raise ValueError(f"Expected every silo's message {k!r} on the noise grid {grid!r}.")
        total = sum((t.to(torch.int64) for t in steps), torch.zeros(v.shape, dtype=torch.int64))
        if int(total.abs().max()) >= 2**53:
            raise ValueError(
                f"Expected the sum of the messages {k!r} below 2^53 grid steps of {grid!r}."
            )
        out[k] = total.to(torch.float64) * grid
    return out


def _share_grid(noise_multiplier: float, sensitivity: float, shares: int) -> float | None:
    """The grid of :func:`gaussian_mechanism`'s shares (None when σ = 0: no noise)."""
    if noise_multiplier <= 0:
        return None
    return math.ldexp(1.0, grid_exponent(noise_multiplier * sensitivity / math.sqrt(shares)))


def _apply(params: Params, total: Params, factor: float) -> Params:
    """``w + factor · total``, computed in float64 and only then cast to ``w``'s dtype."""
    return {
        k: (v.to(torch.float64) + factor * total[k].to(torch.float64)).to(v.dtype)
        for k, v in params.items()
    }


def uniform_weights(num_silos: int, num_subjects: int) -> np.ndarray:
    """``w_{s,a} = 1/S`` for every silo and subject."""
    return np.full((num_silos, num_subjects), 1.0 / num_silos)


def record_weights(histogram: np.ndarray) -> np.ndarray:
    """``w_{s,a} = n_{s,a} / n_a`` (0 for subjects without records)."""
    hist = np.asarray(histogram, dtype=np.float64)
    totals = hist.sum(axis=0, keepdims=True)
    return np.divide(hist, totals, out=np.zeros_like(hist), where=totals > 0)


def check_weights(weights: np.ndarray, *, tolerance: float = 1e-9) -> np.ndarray:
    """Validates ULDP weights: finite, ``w >= 0`` and ``Σ_s w_{s,a} <= 1`` for every subject."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"Expected weights of shape (silos, subjects), got {w.shape}.")
    if not np.isfinite(w).all():
        raise ValueError("Expected finite weights; found NaN or inf.")
    if (w < 0).any():
        s, a = np.argwhere(w < 0)[0]
        raise ValueError(f"Expected weights >= 0, got w[{s}, {a}]={w[s, a]}.")
    sums = w.sum(axis=0)
    over = np.flatnonzero(sums > 1.0 + tolerance)
    if len(over):
        a = int(over[0])
        raise ValueError(
            f"Expected the weights of every subject to sum to at most 1 over silos; subject {a} "
            f"sums to {sums[a]:.6g} ({len(over)} subject(s) over)."
        )
    return w


@dataclass(frozen=True)
class RoundWeights:
    """What the server sends every silo in a clear-weights round (silos x subjects).

    ``subject_sampler="server"``: ``sampled`` is the server's sample and ``weights`` are zero
    outside it. ``"silos"``: ``sampled`` is ``None`` and ``weights`` are the base weights; each
    silo zeroes the subjects outside the sample it derives itself (:class:`SiloSide`), so
    nothing here depends on the sample.
    """

    weights: torch.Tensor
    sampled: torch.Tensor | None = None
    round_index: int = 0


@dataclass(frozen=True, repr=False)
class SiloSide:
    """What the silos hold and the server step never reads: the key from which every silo
    derives the same per-round subject sample (:mod:`silodp.crypto.sampling`)."""

    sample_key: SharedSampleKey

    def sample(self, round_index: int, num_subjects: int, rate: float) -> torch.Tensor:
        """Round ``round_index``'s Poisson sample at ``rate`` (bool, one per public subject)."""
        return torch.from_numpy(self.sample_key.sample(round_index, num_subjects, rate))

    def __repr__(self) -> str:
        return "SiloSide(<secret>)"


class UldpNaive(Algorithm):
    """Local non-private training; clipped silo delta + ``N(0, σ²C²S)``; secure sum.

    Sensitivity of the sum is 2·S·C (each silo's clipped delta can flip), so a round is a
    Gaussian mechanism with noise multiplier σ/2; each silo adds its ``1/S`` share of it.
    """

    name = "uldp_naive"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = SECURE_AGGREGATION

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
        factor = torch.clamp(cfg.clip / (tree_norm(delta) + 1e-12), max=1.0)
        message = _gaussian_share(
            {k: v * factor for k, v in delta.items()},
            noise_multiplier=cfg.noise_multiplier / 2.0,
            sensitivity=2.0 * self.num_silos * cfg.clip,
            coins=coins,
            shares=self.num_silos,
        )
        privacy = self.silo_privacy(sampling_rate=1.0)
        return SiloUpdate(silo.silo, message, silo.num_records, privacy)

    def aggregate(self, params: Params, updates: Any) -> Params:
        """``w + η_g · Σ_s message_s / S`` (the sum is what secure aggregation reveals; summed
        in float64, cast after)."""
        silos = self.num_silos or len(updates)
        cfg = self.config
        grid = _share_grid(cfg.noise_multiplier / 2.0, 2.0 * silos * cfg.clip, silos)
        total = _exact_sum(params, updates, grid)
        scale = float(silos)
        return _apply(params, total, self.config.server_lr / scale)


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

    def run_notes(self) -> list[str]:
        notes = [] if self.weights_private else [WEIGHTS_IN_CLEAR_NOTE]
        return notes + self._sampling_notes() + [SIMULATED_AGGREGATION_NOTE, OWN_NOISE_NOTE]

    def _sampling_notes(self) -> list[str]:
        cfg = self.config
        note = sampling_note(
            rate=cfg.subject_rate,
            sampler=cfg.subject_sampler,
            protocol=self._server_sample_hidden_from_silos,
        )
        return [] if note is None else [note]

    @classmethod
    def make_weights(cls, train: FederatedDataset) -> np.ndarray:
        return uniform_weights(train.num_silos, train.num_subjects)

    @staticmethod
    def shared_sample_key(config: AlgorithmConfig, coins: Coins | None) -> SharedSampleKey | None:
        """The silos' shared sampling key (32 bytes from ``coins``, secure by default) when
        they draw the subject sample, else ``None``."""
        if config.subject_sampler != "silos":
            return None
        return SharedSampleKey.generate(coins if coins is not None else Coins.secure())

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        return cls(
            config,
            weights=cls.make_weights(train),
            sample_key=cls.shared_sample_key(config, coins),
        )

    @property
    def num_subjects(self) -> int:
        return int(self._base_weights().shape[1])

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

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        """One round: a Gaussian with noise multiplier σ on the sum over silos, Poisson
        sub-sampled at ``sampling_rate`` (the released model's view). Adversaries that learn
        the sample get no amplification (known-sample events). A curious silo also knows its
        own share of the noise: to it the other silos' noise has multiplier σ·√((S-1)/S),
        against a sensitivity still at most C (its own records aside)."""
        sigma = self.config.noise_multiplier
        num_silos = self._silo_count()
        silo_sigma = sigma * math.sqrt((num_silos - 1) / num_silos)
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
    ) -> SiloUpdate:
        cfg = self.config
        if not isinstance(instructions, RoundWeights):
            raise ValueError(f"{self.name} needs this round's RoundWeights from configure_round.")
        row = self._silo_row(instructions, silo.silo)
        present = torch.unique(silo.subject)
        order = present[row[present] > 0]
        total = {k: torch.zeros_like(v) for k, v in params.items()}
        if order.numel() and self.single_step and self._fast(model):
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
                model, params, silo.x, silo.y, batches, lr=cfg.lr
            ):
                flat = torch.cat([d.reshape(d.shape[0], -1) for d in deltas.values()], dim=1)
                factors = torch.clamp(cfg.clip / (flat.norm(dim=1) + 1e-12), max=1.0)
                coeff = factors * row[order[rows]].to(factors.dtype)
                for k, d in deltas.items():
                    total[k] += torch.tensordot(coeff, d, dims=1)
        message = _gaussian_share(
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

    def _fast(self, model: nn.Module) -> bool:
        return self.config.grad_method == "auto" and clipper_for(model).fast

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

    def aggregate(self, params: Params, updates: Any) -> Params:
        """``w + η_g · Σ_s message_s / (q·|U|)``: the secure sum (in float64, cast after) over
        the public expected number of sampled subjects."""
        cfg = self.config
        grid = _share_grid(cfg.noise_multiplier, cfg.clip, self._silo_count())
        total = _exact_sum(params, updates, grid)
        scale = self.config.subject_rate * self.num_subjects
        return _apply(params, total, self.config.server_lr / scale)


class UldpSgd(UldpAvg):
    """ULDP-SGD: as ULDP-AVG with one full-batch gradient step per subject."""

    name = "uldp_sgd"
    single_step = True


#: noise coordinates are encoded up to this many standard deviations (exceeding it, with
#: probability below 1e-300 per coordinate, aborts the round with ValueOutOfRangeError)
NOISE_BOUND_STDS = 40.0
#: fixed-point precision of the weighting protocol (decimal digits after the point)
PROTOCOL_PRECISION = 1e-10


@dataclass(frozen=True)
class ProtocolRound:
    """What the server sends every silo in a protocol round: the encrypted weights only (a
    weight for every subject when the silos sample; ``Enc(0)`` for those outside the server's
    sample otherwise, which the silos cannot tell apart)."""

    message: EncryptedWeights


def _rounded_gaussian(n: int, scale: Fraction, coins: Coins) -> np.ndarray:
    """``n`` exact samples of ``round(N(0, scale²))`` (zeros for ``scale = 0``)."""
    if scale == 0:
        return np.zeros(n, dtype=np.int64)
    from silodp.privacy.noise import rounded_gaussian

    return rounded_gaussian(n, scale=scale, coins=coins)


class UldpAvgW(UldpAvg):
    """ULDP-AVG-w: weights ``n_{s,a}/n_a`` (Kato et al., ULDP-FL, Eq. (4)).

    ``weighting="protocol"`` (default): :meth:`for_data` runs the set-up of the private
    weighting protocol (Protocol 1) from each silo's own histogram - Paillier keys, X25519
    pairwise keys, shared seed, blinded masked histograms and the server's inverses. Each round
    the server sends ``Enc((r_a n_a)^-1)``; every silo trains and clips its subjects, returns
    its masked encrypted weighted sum plus its noise (:attr:`SiloUpdate.payload`), and the
    server decrypts only the sum over all silos. Sub-sampling by the silos (default): each silo
    derives the round's sample from the protocol's shared seed, trains only its sampled
    subjects and leaves the others out of its encrypted sum; the server encrypts every weight
    and learns nothing about the sample. By the server: ``Enc(0)`` for the subjects outside
    its sample, and every silo trains all its subjects (it cannot tell which were sampled).
    Guarantee: as ``uldp_avg`` at the subject level; the weighting reveals no histogram (see
    the README section on what each party learns). ``weighting="clear"``: the weights are
    computed from the histograms in the clear.

    Encoding: each clipped delta is clipped to ``C - sqrt(P) h / 2`` (``h`` the fixed-point
    step, ``P`` the parameter count) so that its rounded encoding still has norm ``<= C``: the
    sensitivity ``C`` of the accounting holds for what is actually summed. Each silo's noise
    is drawn exactly as rounded-Gaussian integers on the aggregate's grid
    (:meth:`~silodp.crypto.encoding.WeightingEncoding.silo_noise_scale`), so the decrypted sum
    is a post-processing of the Gaussian mechanism with noise multiplier σ.
    """

    name = "uldp_avg_w"

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        weights: np.ndarray | None = None,
        protocol: WeightingSession | None = None,
        num_subjects: int | None = None,
        sample_key: SharedSampleKey | None = None,
    ) -> None:
        super().__init__(config, weights=weights, sample_key=sample_key)
        if protocol is not None and num_subjects is None:
            num_subjects = len(protocol.config.subject_ids)
        self.protocol = protocol
        self._num_subjects = num_subjects
        self._dim: int | None = None
        self.weights_private = protocol is not None

    @classmethod
    def make_weights(cls, train: FederatedDataset) -> np.ndarray:
        return record_weights(train.histogram())

    @classmethod
    def for_data(
        cls,
        config: AlgorithmConfig,
        train: FederatedDataset,
        *,
        insecure_test_key_bits: int | None = None,
        source: RandomSource | None = None,
        coins: Coins | None = None,
    ) -> Algorithm:
        """Clear weights (and the silos' sample key from ``coins``), or the protocol set up
        from each silo's histogram with the parties' cryptographic randomness from ``source``,
        else ``coins`` (the OS CSPRNG by default); small keys only through
        ``insecure_test_key_bits``."""
        coins = coins if coins is not None else Coins.secure()
        if config.weighting == "clear":
            return cls(
                config,
                weights=cls.make_weights(train),
                sample_key=cls.shared_sample_key(config, coins),
            )
        root: RandomSource = source if source is not None else coins
        hist = train.histogram()
        histograms = {
            s: {a: int(c) for a, c in enumerate(hist[s]) if c} for s in range(train.num_silos)
        }
        std = config.noise_multiplier * config.clip / math.sqrt(train.num_silos)
        protocol_config = ProtocolConfig(
            silo_ids=tuple(range(train.num_silos)),
            subject_ids=tuple(range(train.num_subjects)),
            n_max=config.n_max,
            delta_bound=config.clip,
            noise_bound=NOISE_BOUND_STDS * std,
            precision=PROTOCOL_PRECISION,
            key_bits=config.key_bits,
            insecure_test_key_bits=insecure_test_key_bits,
        )
        # identity keys registered "out of band": here, by the process that plays every party
        protocol_config, identities = with_identities(protocol_config, root)
        session = WeightingSession(protocol_config, histograms, source=root, identities=identities)
        return cls(config, protocol=session, num_subjects=train.num_subjects)

    def _silo_count(self) -> int:
        if self.config.num_silos is None and self.protocol is not None:
            return len(self.protocol.config.silo_ids)
        return super()._silo_count()

    @property
    def num_subjects(self) -> int:
        if self.protocol is not None and self._num_subjects is not None:
            return self._num_subjects
        return super().num_subjects

    @property
    def _server_sample_hidden_from_silos(self) -> bool:
        if self.protocol is not None:
            return True
        if self.weights is not None:
            return False
        return self.config.weighting == "protocol"  # no data yet: as it will be set up

    def run_notes(self) -> list[str]:
        if self.protocol is None:
            return super().run_notes()
        return [PROTOCOL_AGGREGATION_NOTE, *self._sampling_notes(), OWN_NOISE_NOTE]

    def silo_sample(self, round_index: int) -> torch.Tensor:
        """Silo side: round ``round_index``'s subject sample (through the protocol, from the
        key every silo derives from the shared seed)."""
        if self.protocol is None:
            return super().silo_sample(round_index)
        silo = self.protocol.silos[self.protocol.config.silo_ids[0]]
        chosen = silo.subject_sample(round_index, self.config.subject_rate)
        return torch.tensor([a in chosen for a in self.protocol.config.subject_ids])

    def configure_round(self, round_index: int, coins: Coins) -> Any:
        """Server: as ``uldp_avg``; with the protocol, encrypts ``(r_a n_a)^-1`` for every
        subject, except ``Enc(0)`` outside its own sample when the server samples."""
        if self.protocol is None:
            return super().configure_round(round_index, coins)
        cfg = self.config
        chosen = None
        if cfg.subject_sampler == "server" and cfg.subject_rate < 1.0:
            sampled = coins.bernoulli(self.num_subjects, cfg.subject_rate)
            chosen = {int(a) for a in torch.nonzero(sampled).flatten()}
        message = self.protocol.server.open_round(round_index, self._dim, sampled=chosen)
        return ProtocolRound(message)

    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        coins: Coins,
        instructions: Any = None,
    ) -> SiloUpdate:
        if self.protocol is None:
            return super().local_update(model, params, silo, coins, instructions)
        if not isinstance(instructions, ProtocolRound):
            raise ValueError(f"{self.name} needs this round's ProtocolRound from configure_round.")
        cfg = self.config
        party = self.protocol.silos[silo.silo]
        names = list(params)
        dim = sum(int(params[k].numel()) for k in names)
        clip = cfg.clip - math.sqrt(dim) * PROTOCOL_PRECISION / 2
        present = torch.unique(silo.subject)
        at_silos = self._samples_at_silos()
        if at_silos:
            chosen = party.subject_sample(instructions.message.round_index, cfg.subject_rate)
            order = present[torch.tensor([int(a) in chosen for a in present.tolist()])]
        else:
            order = present  # a server's sample is hidden in the encrypted weights
        vectors: dict[int, np.ndarray] = {}
        if order.numel():
            batches = subject_batches(
                silo.subject, order, epochs=cfg.local_epochs, batch_size=cfg.batch_size, coins=coins
            )
            for rows, deltas in per_subject_deltas(
                model, params, silo.x, silo.y, batches, lr=cfg.lr
            ):
                flat = torch.cat([deltas[k].reshape(deltas[k].shape[0], -1) for k in names], dim=1)
                factors = torch.clamp(clip / (flat.norm(dim=1) + 1e-12), max=1.0)
                clipped = (flat * factors[:, None]).detach().cpu().numpy().astype(np.float64)
                for a, vector in zip(order[rows].tolist(), clipped, strict=True):
                    vectors[int(a)] = vector
        scale = party.encoding.silo_noise_scale(
            noise_multiplier=cfg.noise_multiplier, sensitivity=cfg.clip
        )
        reply = party.weighted_sum(
            instructions.message,
            vectors,
            dim=dim,
            encoded_noise=_rounded_gaussian(dim, scale, coins),
            sampling_rate=cfg.subject_rate if at_silos else None,
        )
        return SiloUpdate(
            silo.silo,
            {},
            silo.num_records,
            self.silo_privacy(sampling_rate=cfg.subject_rate),
            subjects_per_batch=[] if at_silos else [int(order.numel())],
            payload=reply,
        )

    def aggregate(self, params: Params, updates: Sequence[SiloUpdate]) -> Params:
        """As ``uldp_avg``; with the protocol the sum is decrypted from the silos' masked
        encrypted messages (all silos must answer, else ``SiloDropoutError``)."""
        if self.protocol is None:
            return super().aggregate(params, updates)
        server = self.protocol.server
        for update in updates:
            if not isinstance(update.payload, MaskedWeightedSum):
                raise ValueError(
                    f"{self.name}: silo {update.silo} sent no MaskedWeightedSum payload."
                )
            server.receive_weighted_sum(update.payload)
        result = server.finish_round()
        self._dim = int(result.aggregate.shape[0])
        total = _unflatten(torch.from_numpy(result.aggregate), params)
        scale = self.config.subject_rate * self.num_subjects
        return _apply(params, total, self.config.server_lr / scale)


def _unflatten(vector: torch.Tensor, like: Params) -> Params:
    """Splits a flat vector into tensors shaped like ``like`` (in its key order)."""
    out: Params = {}
    start = 0
    for k, v in like.items():
        size = int(v.numel())
        out[k] = vector[start : start + size].reshape(v.shape)
        start += size
    if start != vector.numel():
        raise ValueError(f"Expected {start} values, got {vector.numel()}.")
    return out
