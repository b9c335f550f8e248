"""The BFV weighting protocol as the in-process simulator drives it: the same server and silo
calls as the Paillier parties (:class:`~silodp.crypto.protocol.WeightingSession`), so that
``uldp_avg_w`` runs either scheme through one code path.

:class:`BfvProtocol` plays the set-up of :func:`~silodp.crypto.bfv.weighting.authenticated_setup`
(identity-signed X25519 key shares, pairwise keys, a sealed shared seed) when it is built, so
the silos' subject sample is defined from the start. The BFV plan (plaintext primes, blocks,
flooding) depends on the model's parameter count, so keys, masked histograms and the server's
inverses follow in :meth:`BfvProtocol.start` once that count is known. Every party still runs
in one process: this shows what is computed, sent and decrypted, not isolation between
machines; the Flower engine does not run this scheme.

:func:`estimate_bfv_round` is the cost model ``silodp run`` prints: each operation of a round
timed once here, times how often a round performs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from silodp.crypto.bfv.backend import (
    BfvContext,
    BfvKeyPair,
    ciphertext_primes,
    decryptor,
    encryptor,
    new_ciphertext,
    new_plaintext,
)
from silodp.crypto.bfv.params import (
    FIXED_POINT_COEFF_BITS,
    FIXED_POINT_DEGREE,
    WEIGHTS,
    BfvParameters,
    BfvPlan,
    plan_bfv_round,
)
from silodp.crypto.bfv.weighting import (
    BfvSilo,
    BfvWeightingSession,
    authenticated_setup,
    subject_sample_key,
)
from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.errors import ProtocolError, SiloDropoutError, StageError
from silodp.crypto.protocol.estimate import RoundEstimate
from silodp.crypto.randomness import RandomSource, SystemRandomSource
from silodp.crypto.sampling import SharedSampleKey

#: where long steps report their progress (``silodp`` commands print its INFO lines)
PROGRESS = logging.getLogger("silodp.progress")

__all__ = [
    "BfvProtocol",
    "BfvProtocolConfig",
    "BfvRoundResult",
    "BfvWeightedSum",
    "BfvWeights",
    "estimate_bfv_round",
]


@dataclass(frozen=True)
class BfvProtocolConfig:
    """The public parameters every party agrees on (as
    :class:`~silodp.crypto.protocol.ProtocolConfig` for Paillier)."""

    silo_ids: tuple[int, ...]
    subject_ids: tuple[int, ...]
    n_max: int
    delta_bound: float
    noise_bound: float
    precision: float
    params: BfvParameters | None = None  # None: the default for ``weights``
    weights: str = "exact"  # or "fixed_point" (silodp.crypto.bfv.fixed_weights)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"Expected weights={self.weights!r} in {list(WEIGHTS)}.")
        if self.params is None:
            fixed = self.weights == "fixed_point"
            params = (
                BfvParameters(FIXED_POINT_DEGREE, FIXED_POINT_COEFF_BITS)
                if fixed
                else BfvParameters()
            )
            object.__setattr__(self, "params", params)

    @property
    def parameters(self) -> BfvParameters:
        assert self.params is not None  # set in __post_init__
        return self.params

    def plan(self, dim: int) -> BfvPlan:
        """The round's public BFV plan for ``dim`` parameters."""
        params = self.parameters
        return plan_bfv_round(
            params,
            ciphertext_primes=ciphertext_primes(params.poly_degree, params.coeff_bits),
            n_max=self.n_max,
            num_subjects=len(self.subject_ids),
            num_silos=len(self.silo_ids),
            dim=dim,
            delta_bound=self.delta_bound,
            noise_bound=self.noise_bound,
            precision=self.precision,
            weights=self.weights,
        )


@dataclass(frozen=True)
class BfvWeights:
    """Server -> silos, round ``round_index``: per prime, ``Enc((r_a n_a)^-1)`` for every
    public subject (``Enc(0)`` outside a server-drawn sample)."""

    round_index: int
    weights: list[list[Any]] = field(repr=False)


@dataclass(frozen=True)
class BfvWeightedSum:
    """Silo -> server: per prime and block, the silo's masked, re-randomised, flooded sum."""

    silo: int
    round_index: int
    ciphertexts: list[list[Any]] = field(repr=False)


@dataclass(frozen=True)
class BfvRoundResult:
    """The decrypted ``sum_{s,a} (n_{s,a}/n_a) Delta_{s,a} + sum_s noise_s`` of a round."""

    round_index: int
    aggregate: np.ndarray


class _ServerSide:
    """The key holder's calls: open a round, receive every silo's sum, decrypt the total."""

    def __init__(self, owner: BfvProtocol) -> None:
        self._owner = owner
        self._round: int | None = None
        self._replies: dict[int, BfvWeightedSum] = {}

    def open_round(
        self, round_index: int, dim: int | None = None, *, sampled: Collection[int] | None = None
    ) -> BfvWeights:
        """The round's encrypted weights. Without a server sample they do not change between
        rounds, so they are computed once and reused (sent once per training): encrypted by
        the server (exact weights), or by the silos' chain (fixed-point weights, which refuse
        a server sample)."""
        session = self._owner.session(dim)
        if sampled is not None:
            weights = session.server.encrypt_weights(sampled)
        else:
            weights = session.weights()
        self._round = round_index
        self._replies = {}
        return BfvWeights(round_index, weights)

    def receive_weighted_sum(self, message: BfvWeightedSum) -> None:
        if self._round is None or message.round_index != self._round:
            raise StageError(
                f"Expected a weighted sum for round {self._round}, got round "
                f"{message.round_index} from silo {message.silo}."
            )
        if message.silo not in self._owner.config.silo_ids or message.silo in self._replies:
            raise ProtocolError(f"Unexpected or repeated weighted sum from silo {message.silo}.")
        self._replies[message.silo] = message

    def finish_round(self) -> BfvRoundResult:
        """Decrypts the sum over every silo (raises SiloDropoutError if one is missing)."""
        silos = self._owner.config.silo_ids
        missing = [s for s in silos if s not in self._replies]
        if self._round is None or missing:
            raise SiloDropoutError(missing, self._round or 0)
        session = self._owner.session()
        total = session.server.aggregate([self._replies[s].ciphertexts for s in silos])
        result = BfvRoundResult(self._round, total)
        self._round, self._replies = None, {}
        return result


class _SiloSide:
    """Silo ``silo_id``'s calls: the round's subject sample and its encrypted weighted sum."""

    def __init__(self, owner: BfvProtocol, silo_id: int, sample_key: SharedSampleKey) -> None:
        self._owner = owner
        self.silo_id = silo_id
        self._sample_key = sample_key

    def subject_sample(self, round_index: int, rate: float) -> frozenset[int]:
        """Round ``round_index``'s Poisson sample at ``rate`` (the same at every silo)."""
        ids = self._owner.config.subject_ids
        chosen = self._sample_key.sample(round_index, len(ids), rate)
        return frozenset(a for a, c in zip(ids, chosen, strict=True) if c)

    @property
    def encoding(self) -> WeightingEncoding:
        return self._party().plan.encoding

    def _party(self) -> BfvSilo:
        return self._owner.session().silos[self.silo_id]

    def weighted_sum(
        self,
        message: BfvWeights,
        deltas: Mapping[Any, np.ndarray],
        *,
        dim: int,
        encoded_noise: Any,
        sampling_rate: float | None = None,
    ) -> BfvWeightedSum:
        session = self._owner.session(dim)
        cts = session.silos[self.silo_id].weighted_sum(
            message.weights,
            deltas,
            list(encoded_noise),
            message.round_index,
            sampling_rate=sampling_rate,
        )
        return BfvWeightedSum(self.silo_id, message.round_index, cts)


class BfvProtocol:
    """Server and silos of the BFV weighting protocol in one process, with the calls
    ``uldp_avg_w`` makes of the Paillier parties: ``config``, ``server`` and ``silos``."""

    def __init__(
        self,
        config: BfvProtocolConfig,
        histograms: Mapping[int, Mapping[int, int]],
        *,
        source: RandomSource | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if sorted(histograms) != list(config.silo_ids):
            raise ValueError(
                f"Histograms for silos {sorted(histograms)}, expected {list(config.silo_ids)}."
            )
        self.config = config
        self._histograms: dict[int, Mapping[Hashable, int]] = {
            s: {a: int(c) for a, c in h.items()} for s, h in histograms.items()
        }
        self._root = source if source is not None else SystemRandomSource()
        # long steps (the fixed-point weights) report to logger silodp.progress by default
        self._progress = progress if progress is not None else PROGRESS.info
        self._setup = authenticated_setup(config.silo_ids, self._root)
        seeds = self._setup[1]
        self._session: BfvWeightingSession | None = None
        self.server = _ServerSide(self)
        self.silos = {s: _SiloSide(self, s, subject_sample_key(seeds[s])) for s in config.silo_ids}

    def start(self, dim: int) -> None:
        """Keys, masked histograms and inverses for a ``dim``-parameter model (once)."""
        self.session(dim)

    def session(self, dim: int | None = None) -> BfvWeightingSession:
        if self._session is None:
            if dim is None:
                raise StageError(
                    "The BFV weighting protocol needs the model's parameter count before its "
                    "first round (BfvProtocol.start)."
                )
            cfg = self.config
            self._session = BfvWeightingSession(
                self._histograms,
                n_max=cfg.n_max,
                dim=dim,
                params=cfg.parameters,
                subject_ids=cfg.subject_ids,
                delta_bound=cfg.delta_bound,
                noise_bound=cfg.noise_bound,
                precision=cfg.precision,
                source=self._root,
                setup=self._setup,
                weights=cfg.weights,
                progress=self._progress,
            )
        elif dim is not None and dim != self._session.plan.dim:
            raise ValueError(f"Expected dim={self._session.plan.dim} (set up), got {dim}.")
        return self._session

    def estimate_round(self, dim: int) -> RoundEstimate:
        pairs = sum(1 for h in self._histograms.values() for c in h.values() if c)
        return estimate_bfv_round(
            self.config.plan(dim),
            pairs=pairs,
            num_subjects=len(self.config.subject_ids),
            num_silos=len(self.config.silo_ids),
        )


def _cpu(func: Callable[[], Any], repeat: int = 3) -> float:
    """The median CPU seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        func()
        times.append(time.process_time() - start)
    return float(np.median(times))


def estimate_bfv_round(
    plan: BfvPlan, *, pairs: int, num_subjects: int, num_silos: int
) -> RoundEstimate:
    """The modelled CPU cost on this machine of one round's BFV cryptography (training not
    included) when fresh weights are encrypted (the first round, or every round when the server
    samples): per prime, ``num_subjects`` weight encryptions; per pair, the exact encoding of
    its delta and, per block and prime, one plaintext, its NTT and a plaintext product; per
    silo, block and prime, the fixed work (``Enc(0)``, noise and masks, flooding); per block
    and prime, one decryption. Each operation is timed here once (median of three).

    With fixed-point weights the server encrypts none; the silos' chain is the estimate's
    ``setup_cpu_seconds`` (once per training): per prime and subject, one encryption,
    ``num_silos - 1`` monomial products with an ``Enc(0)``, the product by ``F`` and the
    trace's ``log2 N`` automorphisms and additions."""
    params = plan.params
    n = params.poly_degree
    m = len(plan.plain_moduli)
    fixed = plan.weights == "fixed_point"
    ctx = BfvContext(n, params.coeff_bits, plan.plain_moduli[0])
    keys = BfvKeyPair.generate([ctx])
    enc = encryptor(ctx, keys.public_keys[0])
    ev = ctx.evaluator
    rng = np.random.default_rng(0)
    values = rng.integers(0, plan.plain_moduli[0], n, dtype=np.uint64)
    level, _ = ctx.level(plan.level_drop)  # where the silos' products run
    weight = new_ciphertext(ctx)
    enc.encrypt(ctx.constant(3), weight)
    ev.mod_switch_to_inplace(weight, level)
    lifted = new_ciphertext(ctx)
    ev.transform_to_ntt(weight, lifted)
    acc = new_ciphertext(ctx)
    ev.multiply_plain(lifted, ctx.plaintext(values), acc)  # NTT form, as the silos' sums
    tmp = new_ciphertext(ctx)

    def encrypt_weight() -> None:
        enc.encrypt(ctx.constant(3), new_ciphertext(ctx))

    def product() -> None:
        plain = ctx.plaintext(values)
        ev.transform_to_ntt_inplace(plain, level)
        ev.multiply_plain(lifted, plain, tmp)
        ev.add_inplace(acc, tmp)

    def silo_fixed() -> None:
        zero = new_ciphertext(ctx)
        enc.encrypt_zero(level, zero)
        ev.add_plain_inplace(zero, ctx.plaintext(values))
        ev.add_inplace(zero, ctx.flooding(SystemRandomSource(), plan.flood_log2, plan.level_drop))

    def decrypt() -> None:
        plain = new_plaintext()
        decryptor(ctx, keys.secret_keys[0]).decrypt(weight, plain)
        ctx.coefficients(plain)

    delta = rng.uniform(-1.0, 1.0, plan.dim) * plan.encoding.delta_bound / np.sqrt(plan.dim)
    encode = _cpu(lambda: plan.encoding.encode_deltas_array(delta))
    cts = plan.blocks * m
    seconds = (
        (0 if fixed else num_subjects * m * _cpu(encrypt_weight))
        + pairs * (encode + cts * _cpu(product))
        + num_silos * cts * _cpu(silo_fixed)
        + cts * _cpu(decrypt)
    )
    setup = _chain_seconds(ctx, keys, plan, num_silos) * num_subjects * m if fixed else 0.0
    return RoundEstimate(
        pairs=pairs,
        dim=plan.dim,
        slots=n,
        cpu_seconds=seconds,
        scheme=f"BFV, {m} primes" + (", fixed-point weights" if fixed else ""),
        setup_cpu_seconds=setup,
    )


def _chain_seconds(ctx: BfvContext, keys: BfvKeyPair, plan: BfvPlan, num_silos: int) -> float:
    """CPU seconds of one subject's fixed-point weight under one prime (one Galois key timed
    for the trace's ``log2 N`` automorphisms)."""
    from silodp.crypto.bfv import fixed_weights
    from silodp.crypto.bfv.backend import apply_galois, galois_keys

    enc = encryptor(ctx, keys.public_keys[0])
    ev = ctx.evaluator
    first = fixed_weights.chain_start(ctx, enc, [1])
    f_plain = ctx.plaintext(
        fixed_weights.weight_polynomial(
            ctx.poly_degree, ctx.plain_modulus, plan.encoding.n_max, plan.encoding.weight_bits or 1
        )
    )
    galois = galois_keys(ctx, keys.secret_keys[0], [3])
    out = new_ciphertext(ctx)
    hop = _cpu(lambda: fixed_weights.chain_hop(ctx, enc, first, [1]))
    times_f = _cpu(lambda: ev.multiply_plain(first[0], f_plain, out))
    trace = _cpu(lambda: ev.add_inplace(out, apply_galois(ctx, first[0], 3, galois)))
    start = _cpu(lambda: fixed_weights.chain_start(ctx, enc, [1]))
    level, _ = ctx.level(plan.level_drop)
    switch = _cpu(lambda: ev.mod_switch_to(out, level, new_ciphertext(ctx)))
    steps = ctx.poly_degree.bit_length() - 1
    return start + (num_silos - 1) * hop + times_f + steps * trace + switch
