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
  noise has std σC: one Gaussian (σ) per round, sub-sampled at rate q when the server samples
  subjects (it zeroes the weights of the others). The server divides the secure sum by the
  public expected number of subjects ``q·|U|`` and applies the global learning rate.
* ``uldp_avg_w``: ``uldp_avg`` with ``w_{s,a} = n_{s,a}/n_a``, by default computed and
  applied through the private weighting protocol of ULDP-FL (Protocol 1; :mod:`silodp.crypto`):
  the weights, the per-subject weighting and the secure sum happen under Paillier encryption,
  multiplicative blinding and pairwise masks, all parties run in this process.

The noise is split over silos, so these guarantees hold for the released model and, against
the server, only if it sees nothing but the sum of the silos' messages (secure aggregation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import gaussian_steps, poisson_gaussian_steps
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
    sgd_step,
    uniform_batch,
)
from silodp.algorithms.dp_sgd import LocalItemDP
from silodp.crypto.messages import EncryptedWeights, MaskedWeightedSum
from silodp.crypto.protocol import ProtocolConfig, WeightingSession, with_identities
from silodp.crypto.randomness import RandomSource
from silodp.data import FederatedDataset
from silodp.privacy.ghost import clipper_for
from silodp.privacy.gradients import Params, clip_factors, tree_norm
from silodp.privacy.noise import gaussian_noise
from silodp.privacy.randomness import Coins
from silodp.privacy.per_subject import per_subject_deltas, subject_batches

__all__ = [
    "ProtocolRound",
    "RoundWeights",
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
    "against the server, only if it sees just the sum of the silos' messages"
)

SIMULATED_AGGREGATION_NOTE = (
    "the in-process simulator does not implement secure aggregation: ε holds for the "
    "released model; against the server it assumes secure aggregation"
)

PROTOCOL_AGGREGATION_NOTE = (
    "private weighting protocol run in-process: weights n_{s,a}/n_a, per-subject weighting "
    "and the sum over silos were computed under Paillier encryption with blinded histograms "
    "and pairwise masks; the server object decrypted only the sum over all silos. This holds "
    "against an honest-but-curious server that colludes with no silo (key shares signed with "
    "registered Ed25519 identity keys); the server learns which subjects were sampled; "
    "deltas are clipped so that their fixed-point encodings stay within C, and the noise is "
    "rounded on the aggregate's grid, a post-processing of the accounted Gaussian mechanism"
)

WEIGHTS_IN_CLEAR_NOTE = (
    "weights not private: the weights n_{s,a}/n_a were computed in the clear from "
    "every silo's subject histogram"
)


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
    """This round's subject weights (zero for subjects not sub-sampled), silos x subjects."""

    weights: torch.Tensor
    sampled: torch.Tensor


class UldpNaive(Algorithm):
    """Local non-private training; clipped silo delta + ``N(0, σ²C²S)``; secure sum.

    Sensitivity of the sum is 2·S·C (each silo's clipped delta can flip), so a round is a
    Gaussian mechanism with noise multiplier σ/2.
    """

    name = "uldp_naive"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = SECURE_AGGREGATION

    def __init__(self, config: AlgorithmConfig, *, num_silos: int | None = None) -> None:
        super().__init__(config)
        self.num_silos = num_silos

    def run_notes(self) -> list[str]:
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
        generator: torch.Generator,
        instructions: Any = None,
    ) -> SiloUpdate:
        cfg = self.config
        if self.num_silos is None:
            raise ValueError("uldp_naive needs num_silos; build it with for_data().")
        steps = cfg.local_epochs * math.ceil(silo.num_records / cfg.batch_size)

        local = {k: v.clone() for k, v in params.items()}
        for _ in range(steps):
            idx = uniform_batch(silo.num_records, cfg.batch_size, generator)
            local = sgd_step(model, local, silo, idx, lr=cfg.lr)
        delta = {k: local[k] - params[k] for k in params}
        factor = torch.clamp(cfg.clip / (tree_norm(delta) + 1e-12), max=1.0)
        std = cfg.noise_multiplier * cfg.clip * math.sqrt(self.num_silos)
        message = {
            k: v * factor
            + gaussian_noise(v.shape, std=std, generator=generator, secure=cfg.secure_noise)
            for k, v in delta.items()
        }
        privacy = self.silo_privacy(sampling_rate=1.0)
        return SiloUpdate(silo.silo, message, silo.num_records, privacy)

    def aggregate(self, params: Params, updates: Any) -> Params:
        """``w + η_g · Σ_s message_s / S`` (the sum is what secure aggregation reveals)."""
        total = {k: sum(u.params[k] for u in updates) for k in params}
        scale = float(self.num_silos or len(updates))
        return {k: v + self.config.server_lr * total[k] / scale for k, v in params.items()}


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
    """ULDP-AVG with uniform weights ``1/S``: per-subject training and weighted clipping."""

    name = "uldp_avg"
    units = ("subject",)
    calibration_unit = "subject"
    threat_model = SECURE_AGGREGATION
    #: one full-batch gradient step per subject instead of Q epochs of mini-batches
    single_step: ClassVar[bool] = False
    #: whether the weights were computed without revealing silos' histograms
    weights_private: bool = True

    def run_notes(self) -> list[str]:
        notes = [] if self.weights_private else [WEIGHTS_IN_CLEAR_NOTE]
        return notes + [SIMULATED_AGGREGATION_NOTE]

    def __init__(self, config: AlgorithmConfig, *, weights: np.ndarray | None = None) -> None:
        super().__init__(config)
        self.weights = None if weights is None else torch.from_numpy(check_weights(weights))

    @classmethod
    def make_weights(cls, train: FederatedDataset) -> np.ndarray:
        return uniform_weights(train.num_silos, train.num_subjects)

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        return cls(config, weights=cls.make_weights(train))

    @property
    def num_subjects(self) -> int:
        if self.weights is None:
            raise ValueError(f"{self.name} needs weights; build it with for_data().")
        return int(self.weights.shape[1])

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        return self.config.subject_rate

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        sigma = self.config.noise_multiplier
        event = (
            gaussian_steps(sigma, 1)
            if sampling_rate >= 1.0
            else poisson_gaussian_steps(sampling_rate, sigma, 1)
        )
        return SiloPrivacy({"subject": event}, scope="aggregate")

    def configure_round(self, round_index: int, generator: torch.Generator) -> RoundWeights:
        """Server: Poisson-samples subjects at ``subject_rate``; zeroes the others' weights."""
        if self.weights is None:
            raise ValueError(f"{self.name} needs weights; build it with for_data().")
        q = self.config.subject_rate
        if q >= 1.0:
            sampled = torch.ones(self.num_subjects, dtype=torch.bool)
        else:
            sampled = torch.rand(self.num_subjects, generator=generator) < q
        return RoundWeights(self.weights * sampled.to(self.weights.dtype), sampled)

    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        generator: torch.Generator,
        instructions: Any = None,
    ) -> SiloUpdate:
        cfg = self.config
        if not isinstance(instructions, RoundWeights):
            raise ValueError(f"{self.name} needs this round's RoundWeights from configure_round.")
        row = instructions.weights[silo.silo]
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
                generator=generator,
            )
            for rows, deltas in per_subject_deltas(
                model, params, silo.x, silo.y, batches, lr=cfg.lr
            ):
                flat = torch.cat([d.reshape(d.shape[0], -1) for d in deltas.values()], dim=1)
                factors = torch.clamp(cfg.clip / (flat.norm(dim=1) + 1e-12), max=1.0)
                coeff = factors * row[order[rows]].to(factors.dtype)
                for k, d in deltas.items():
                    total[k] += torch.tensordot(coeff, d, dims=1)
        num_silos = int(instructions.weights.shape[0])
        std = cfg.noise_multiplier * cfg.clip / math.sqrt(num_silos)
        message = {
            k: v + gaussian_noise(v.shape, std=std, generator=generator, secure=cfg.secure_noise)
            for k, v in total.items()
        }
        privacy = self.silo_privacy(sampling_rate=cfg.subject_rate)
        return SiloUpdate(
            silo.silo, message, silo.num_records, privacy, subjects_per_batch=[int(order.numel())]
        )

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
        """``w + η_g · Σ_s message_s / (q·|U|)``: the secure sum over the public expected
        number of sampled subjects."""
        total = {k: sum(u.params[k] for u in updates) for k in params}
        scale = self.config.subject_rate * self.num_subjects
        return {k: v + self.config.server_lr * total[k] / scale for k, v in params.items()}


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
    """What the server sends every silo in a protocol round: the encrypted weights only (the
    silos do not learn which subjects were sampled)."""

    message: EncryptedWeights


class UldpAvgW(UldpAvg):
    """ULDP-AVG-w: weights ``n_{s,a}/n_a`` (Kato et al., ULDP-FL, Eq. (4)).

    ``weighting="protocol"`` (default): :meth:`for_data` runs the set-up of the private
    weighting protocol (Protocol 1) from each silo's own histogram - Paillier keys, X25519
    pairwise keys, shared seed, blinded masked histograms and the server's inverses. Each round
    the server sends ``Enc((r_a n_a)^-1)`` (``Enc(0)`` for subjects not sub-sampled), every silo
    trains and clips *all* its subjects (it cannot tell which were sampled) and returns its
    masked encrypted weighted sum plus encoded noise (:attr:`SiloUpdate.payload`), and the
    server decrypts only the sum over all silos. Guarantee: as ``uldp_avg`` at the subject
    level; the weighting reveals no histogram (see the README section on what each party
    learns). ``weighting="clear"``: the weights are computed from the histograms in the clear.

    Encoding: each clipped delta is clipped to ``C - sqrt(P) h / 2`` (``h`` the fixed-point
    step, ``P`` the parameter count) so that its rounded encoding still has norm ``<= C``: the
    sensitivity ``C`` of the accounting holds for what is actually summed.
    """

    name = "uldp_avg_w"

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        weights: np.ndarray | None = None,
        protocol: WeightingSession | None = None,
        num_subjects: int | None = None,
    ) -> None:
        super().__init__(config, weights=weights)
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
        """Clear weights, or the protocol set up from each silo's histogram (``source``: the
        parties' cryptographic randomness, the OS CSPRNG by default; small keys only through
        ``insecure_test_key_bits``)."""
        if config.weighting == "clear":
            return cls(config, weights=cls.make_weights(train))
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
        protocol_config, identities = with_identities(protocol_config, source)
        session = WeightingSession(
            protocol_config, histograms, source=source, identities=identities
        )
        return cls(config, protocol=session, num_subjects=train.num_subjects)

    @property
    def num_subjects(self) -> int:
        if self.protocol is not None and self._num_subjects is not None:
            return self._num_subjects
        return super().num_subjects

    def run_notes(self) -> list[str]:
        if self.protocol is None:
            return [WEIGHTS_IN_CLEAR_NOTE, SIMULATED_AGGREGATION_NOTE]
        return [PROTOCOL_AGGREGATION_NOTE]

    def configure_round(self, round_index: int, generator: torch.Generator) -> Any:
        """Server: Poisson-samples subjects at ``subject_rate`` (same draws as ``uldp_avg``);
        with the protocol, encrypts ``(r_a n_a)^-1`` for the sampled and 0 for the others."""
        if self.protocol is None:
            return super().configure_round(round_index, generator)
        q = self.config.subject_rate
        n = self.num_subjects
        if q >= 1.0:
            sampled = torch.ones(n, dtype=torch.bool)
        else:
            sampled = torch.rand(n, generator=generator) < q
        chosen = {int(a) for a in torch.nonzero(sampled).flatten()}
        message = self.protocol.server.open_round(round_index, self._dim, sampled=chosen)
        return ProtocolRound(message)

    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        generator: torch.Generator,
        instructions: Any = None,
    ) -> SiloUpdate:
        cfg = self.config
        protocol = isinstance(instructions, ProtocolRound)
        if self.protocol is not None and not protocol:
            raise ValueError(f"{self.name} needs this round's ProtocolRound from configure_round.")
        if self.protocol is None and not isinstance(instructions, RoundWeights):
            raise ValueError(f"{self.name} needs this round's RoundWeights from configure_round.")
        names = list(params)
        dim = sum(int(params[k].numel()) for k in names)
        clip = cfg.clip
        if protocol:
            clip = cfg.clip - math.sqrt(dim) * PROTOCOL_PRECISION / 2
        order = torch.unique(silo.subject)  # every subject here: sampling is hidden in protocol
        clipped: list[tuple[torch.Tensor, torch.Tensor]] = []
        if order.numel():
            batches = subject_batches(
                silo.subject,
                order,
                epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                generator=generator,
            )
            for rows, deltas in per_subject_deltas(
                model, params, silo.x, silo.y, batches, lr=cfg.lr
            ):
                flat = torch.cat([deltas[k].reshape(deltas[k].shape[0], -1) for k in names], dim=1)
                factors = torch.clamp(clip / (flat.norm(dim=1) + 1e-12), max=1.0)
                clipped.append((order[rows], flat * factors[:, None]))
        if self.protocol is not None:
            num_silos = len(self.protocol.config.silo_ids)
        else:
            num_silos = int(instructions.weights.shape[0])
        std = cfg.noise_multiplier * cfg.clip / math.sqrt(num_silos)
        noise = {
            k: gaussian_noise(v.shape, std=std, generator=generator, secure=cfg.secure_noise)
            for k, v in params.items()
        }
        privacy = self.silo_privacy(sampling_rate=cfg.subject_rate)
        if not protocol:
            row = instructions.weights[silo.silo]
            total = torch.zeros(dim, dtype=next(iter(params.values())).dtype)
            for subjects, flat in clipped:
                total += torch.tensordot(row[subjects].to(flat.dtype), flat, dims=1)
            sampled = int((row[order] > 0).sum()) if order.numel() else 0
            message = {k: v + noise[k] for k, v in _unflatten(total, params).items()}
            return SiloUpdate(
                silo.silo, message, silo.num_records, privacy, subjects_per_batch=[sampled]
            )
        assert self.protocol is not None
        vectors = {
            int(a): v.detach().cpu().numpy().astype(np.float64)
            for subjects, flat in clipped
            for a, v in zip(subjects.tolist(), flat, strict=True)
        }
        noise_vec = torch.cat([noise[k].reshape(-1) for k in names]).cpu().numpy()
        reply = self.protocol.silos[silo.silo].weighted_sum(
            instructions.message, vectors, noise_vec.astype(np.float64), dim=dim
        )
        return SiloUpdate(
            silo.silo,
            {},
            silo.num_records,
            privacy,
            subjects_per_batch=[int(order.numel())],
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
        dtype = next(iter(params.values())).dtype
        total = _unflatten(torch.from_numpy(result.aggregate).to(dtype), params)
        scale = self.config.subject_rate * self.num_subjects
        return {k: v + self.config.server_lr * total[k] / scale for k, v in params.items()}


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
