"""ULDP-AVG-w: weights ``n_{s,a}/n_a`` through the private weighting protocol (see
:mod:`silodp.algorithms.uldp` for the family)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from dp_accounting import dp_event
from torch import nn

from silodp.accounting import SiloPrivacy
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
)
from silodp.algorithms.registry import register
from silodp.algorithms.uldp_avg import UldpAvg
from silodp.algorithms.uldp_common import (
    BFV_ENCRYPTION,
    FIXED_POINT_WEIGHTS,
    PROTOCOL_AGGREGATION_NOTE,
    WEIGHTS_IN_CLEAR_NOTE,
    ZERO_TOTALS_NOTE,
    UldpAvgWConfig,
    apply_total,
    deltas_method,
    record_weights,
)
from silodp.crypto.messages import EncryptedWeights, MaskedWeightedSum
from silodp.crypto.protocol import Parties, ProtocolConfig, WeightingSession, with_identities
from silodp.crypto.randomness import RandomSource
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset
from silodp.data.bounds import check_records_per_subject
from silodp.errors import InvalidValueError
from silodp.privacy.gradients import Params, clip_factors, drop_non_finite, row_norms
from silodp.privacy.per_subject import per_subject_deltas, subject_batches
from silodp.privacy.randomness import Coins

if TYPE_CHECKING:  # importing silodp.crypto.bfv needs tenseal: only with scheme = "bfv"
    from silodp.crypto.bfv.simulation import BfvProtocol, BfvWeights

NOISE_BOUND_STDS = 40.0
#: fixed-point precision of the weighting protocol (decimal digits after the point)
PROTOCOL_PRECISION = 1e-10


@dataclass(frozen=True)
class ProtocolRound:
    """What the server sends every silo in a protocol round: the encrypted weights only (a
    weight for every subject when the silos sample; ``Enc(0)`` for those outside the server's
    sample otherwise, which the silos cannot tell apart)."""

    message: EncryptedWeights | BfvWeights


def _rounded_gaussian(n: int, scale: Fraction, coins: Coins) -> np.ndarray:
    """``n`` exact samples of ``round(N(0, scale²))`` (zeros for ``scale = 0``)."""
    if scale == 0:
        return np.zeros(n, dtype=np.int64)
    from silodp.privacy.noise import rounded_gaussian

    return rounded_gaussian(n, scale=scale, coins=coins)


@register
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
    Config = UldpAvgWConfig
    config: UldpAvgWConfig

    def account_options(self) -> dict[str, Any]:
        cfg = self.config
        # the weighting decides what the server and the silos see (clear weights: inf)
        options = {**super().account_options(), "weighting": cfg.weighting}
        if cfg.weighting == "protocol" and cfg.scheme != "paillier":
            options |= {"scheme": cfg.scheme, "weight_encoding": cfg.weight_encoding}
        return options

    def __init__(
        self,
        config: AlgorithmConfig,
        *,
        weights: np.ndarray | None = None,
        protocol: WeightingSession | Parties | BfvProtocol | None = None,
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
        cfg: UldpAvgWConfig = cls.configure(config)
        coins = coins if coins is not None else Coins.secure()
        if cfg.weighting == "clear":
            return cls(
                cfg,
                weights=cls.make_weights(train),
                sample_key=cls.shared_sample_key(cfg, coins),
            )
        # named by the data's own subject ids here; the sealed protocol knows only indices
        check_records_per_subject(train, cfg.n_max, name=cfg.key("n_max"))
        root: RandomSource = source if source is not None else coins
        hist = train.histogram()
        histograms = {
            s: {a: int(c) for a, c in enumerate(hist[s]) if c} for s in range(train.num_silos)
        }
        if cfg.scheme == "bfv":
            return cls(
                cfg,
                protocol=cls.bfv_protocol(cfg, histograms, train.num_subjects, root),
                num_subjects=train.num_subjects,
            )
        protocol_config = cls.protocol_config(
            cfg,
            num_silos=train.num_silos,
            num_subjects=train.num_subjects,
            insecure_test_key_bits=insecure_test_key_bits,
        )
        # identity keys registered "out of band": here, by the process that plays every party
        protocol_config, identities = with_identities(protocol_config, root)
        session = WeightingSession(protocol_config, histograms, source=root, identities=identities)
        return cls(cfg, protocol=session, num_subjects=train.num_subjects)

    @staticmethod
    def bfv_protocol(
        config: UldpAvgWConfig,
        histograms: Mapping[int, Mapping[int, int]],
        num_subjects: int,
        source: RandomSource,
    ) -> BfvProtocol:
        """The BFV weighting protocol (:mod:`silodp.crypto.bfv`) for these histograms, with
        the Paillier protocol's bounds; its keys follow once the model's size is known
        (:meth:`initial_state`)."""
        from silodp.crypto.bfv.simulation import BfvProtocol, BfvProtocolConfig

        public = BfvProtocolConfig(
            **_public_fields(config, len(histograms), num_subjects),
            weights=config.weight_encoding,
        )
        return BfvProtocol(public, histograms, source=source)

    def initial_state(self, params: Params) -> Any:
        """None; with the BFV protocol, first sets it up for the model's parameter count
        (public: every party knows the model's architecture)."""
        dim = sum(int(v.numel()) for v in params.values())
        if self.protocol is not None:
            self._encoding_clip(dim)  # refuses a clip the encoding cannot keep
        start = getattr(self.protocol, "start", None)
        if start is not None:
            start(dim)
        return super().initial_state(params)

    def check_model_size(self, dim: int) -> None:
        """Refuses, before anything is written, a ``dim``-parameter model whose deltas the
        protocol's encoding cannot keep within the clip (see :meth:`_encoding_clip`)."""
        if self.protocol is not None:
            self._encoding_clip(dim)

    def _encoding_clip(self, dim: int) -> float:
        """``C - sqrt(dim) h / 2``: the clip that keeps a delta's fixed-point encoding (each
        coordinate rounded to the grid ``h``) within the accounted norm ``C``."""
        clip = self.config.clip - math.sqrt(dim) * PROTOCOL_PRECISION / 2
        if not clip > 0:
            raise ValueError(
                f"Expected {self.config.key('clip')}={self.config.clip!r} above "
                f"sqrt(parameters) * {PROTOCOL_PRECISION} / 2 = "
                f"{math.sqrt(dim) * PROTOCOL_PRECISION / 2:.3g} for a {dim}-parameter model "
                "with weighting = 'protocol' (its fixed-point encoding moves each delta by up "
                "to that much)."
            )
        return clip

    @staticmethod
    def protocol_config(
        config: UldpAvgWConfig,
        *,
        num_silos: int,
        num_subjects: int,
        insecure_test_key_bits: int | None = None,
    ) -> ProtocolConfig:
        """The weighting protocol's public parameters for a federation of ``num_silos`` silos
        and ``num_subjects`` subjects (identity keys not yet registered)."""
        return ProtocolConfig(
            **_public_fields(config, num_silos, num_subjects),
            key_bits=config.key_bits,
            insecure_test_key_bits=insecure_test_key_bits,
        )

    def silo_setup(self) -> dict[str, Any]:
        """With the protocol: only the public subject count; each silo's party of the
        protocol is set up by messages (:mod:`silodp.engines.weighting`) and handed to
        :meth:`at_silo` as ``setup["parties"]``."""
        if self.protocol is not None:
            return {"weighting": "protocol", "num_subjects": self.num_subjects}
        return super().silo_setup()

    @classmethod
    def at_silo(
        cls,
        config: AlgorithmConfig,
        setup: Mapping[str, Any],
        *,
        sample_key: SharedSampleKey | None = None,
    ) -> Algorithm:
        if setup.get("weighting") != "protocol":
            return super().at_silo(config, setup, sample_key=sample_key)
        parties = setup.get("parties")
        if parties is None:
            raise InvalidValueError(
                f"{cls.name}: expected the silo's party of the weighting protocol, set up "
                "before the first round."
            )
        return cls(config, protocol=parties, num_subjects=int(setup["num_subjects"]))

    def secure_sum_grid(self) -> float | None:
        """None with the protocol: its own encrypted, masked sum is the secure aggregation."""
        return None if self.protocol is not None else super().secure_sum_grid()

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

    def weights_seen_by(self) -> tuple[str, ...]:
        """The adversaries that learn something of the data through the weighting itself, and
        so have no subject-level guarantee (ε = ∞ against them):

        * ``weighting = "clear"``: the server computes every ``n_{s,a}/n_a`` and sends the
          matrix to every silo, so both see which subjects have records where;
        * the protocol with exact weights (Paillier, or BFV with ``weight_encoding =
          "exact"``): the server inverts the blinded totals ``r_a n_a``, which are 0 exactly
          for a listed subject with no record in any silo. Removing a subject's records makes
          its total 0, so the server tells the two datasets apart;
        * fixed-point weights (BFV): the silos compute the weights under encryption and the
          server sees no total: nobody.
        """
        cfg = self.config
        many_silos = cfg.num_silos is None or cfg.num_silos > 1
        if self.protocol is None and (self.weights is not None or cfg.weighting == "clear"):
            return ("server", "silos") if many_silos else ("server",)
        if cfg.scheme == "bfv" and cfg.weight_encoding == "fixed_point":
            return ()
        return ("server",)

    #: To a curious silo s0 holding records of subject a, a's records in the other silos also
    #: set s0's own weight n_{s0,a}/n_a, which s0 does not see: removing them moves its own
    #: term by up to C as well as the others' by up to C, so the sum moves by up to
    #: 2C(1 - n_{s0,a}/n_a) < 2C (uniform weights: C)
    silos_sensitivity: ClassVar[float] = 2.0

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        """As ``uldp_avg``'s (against the silos at sensitivity 2C: :attr:`silos_sensitivity`),
        except against the adversaries :meth:`weights_seen_by` names: no guarantee (a
        non-private event)."""
        privacy = super().silo_privacy(sampling_rate=sampling_rate)
        seen_by = self.weights_seen_by()
        if not seen_by:
            return privacy
        views = dict(privacy.views)
        for who in seen_by:
            views[who] = {unit: dp_event.NonPrivateDpEvent() for unit in privacy.events}
        return dataclasses.replace(privacy, views=views)

    def accounting_notes(self) -> list[str]:
        seen_by = self.weights_seen_by()
        if not seen_by:
            return []
        return [ZERO_TOTALS_NOTE if seen_by == ("server",) else WEIGHTS_IN_CLEAR_NOTE]

    def run_notes(self) -> list[str]:
        leak = [ZERO_TOTALS_NOTE] if self.weights_seen_by() == ("server",) else []
        if self.protocol is None:
            return super().run_notes() + leak
        note = PROTOCOL_AGGREGATION_NOTE
        if self.config.scheme == "bfv":
            note = note.replace("under Paillier encryption", BFV_ENCRYPTION)
        if self.config.weight_encoding == "fixed_point":
            note = note.replace(
                "weights n_{s,a}/n_a, per-subject weighting", FIXED_POINT_WEIGHTS
            ).replace("with blinded histograms and pairwise masks", "with pairwise masks")
        return [note, *leak, *self._sampling_notes(), *self._own_noise()]

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
        state: Any = None,
    ) -> SiloUpdate:
        if self.protocol is None:
            return super().local_update(model, params, silo, coins, instructions)
        if not isinstance(instructions, ProtocolRound):
            raise ValueError(f"{self.name} needs this round's ProtocolRound from configure_round.")
        cfg = self.config
        party: Any = self.protocol.silos[silo.silo]  # Paillier's or BFV's silo party
        names = list(params)
        dim = sum(int(params[k].numel()) for k in names)
        clip = self._encoding_clip(dim)
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
                model, params, silo.x, silo.y, batches, lr=cfg.lr, method=deltas_method(cfg)
            ):
                flat = torch.cat([deltas[k].reshape(deltas[k].shape[0], -1) for k in names], dim=1)
                norms = row_norms(flat)
                factors = clip_factors(norms, clip)
                kept = drop_non_finite(flat * factors[:, None], norms)
                clipped = kept.detach().cpu().numpy().astype(np.float64)
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

    def aggregate(
        self, params: Params, updates: Sequence[SiloUpdate], states: Sequence[Any] = ()
    ) -> Params:
        """As ``uldp_avg``; with the protocol the sum is decrypted from the silos' masked
        encrypted messages (all silos must answer, else ``SiloDropoutError``)."""
        if self.protocol is None:
            return super().aggregate(params, updates)
        server: Any = self.protocol.server  # Paillier's or BFV's server party
        expected = (
            MaskedWeightedSum if self.config.scheme == "paillier" else _bfv_weighted_sum_type()
        )
        for update in updates:
            if not isinstance(update.payload, expected):
                raise ValueError(
                    f"{self.name}: silo {update.silo} sent no {expected.__name__} payload."
                )
            server.receive_weighted_sum(update.payload)
        result = server.finish_round()
        self._dim = int(result.aggregate.shape[0])
        total = _unflatten(torch.from_numpy(result.aggregate), params)
        scale = self.config.subject_rate * self.num_subjects
        return apply_total(params, total, self.config.server_lr / scale)


def _bfv_weighted_sum_type() -> type:
    from silodp.crypto.bfv.simulation import BfvWeightedSum

    return BfvWeightedSum


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


def _public_fields(config: UldpAvgWConfig, num_silos: int, num_subjects: int) -> dict[str, Any]:
    """The public parameters every weighting scheme shares: parties, bounds, precision."""
    std = config.noise_multiplier * config.clip / math.sqrt(num_silos)
    return {
        "silo_ids": tuple(range(num_silos)),
        "subject_ids": tuple(range(num_subjects)),
        "n_max": config.n_max,
        "delta_bound": config.clip,
        "noise_bound": NOISE_BOUND_STDS * std,
        "precision": PROTOCOL_PRECISION,
    }
