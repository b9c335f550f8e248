"""The private weighting protocol of ULDP-AVG-w (SPEC §4; ULDP-FL, Protocol 1).

Parties: a :class:`Server` (holds the Paillier secret key) and :class:`Silo` s (each holds its
histogram ``n_{s,a}``, its X25519 key, its pairwise keys and the shared seed). Each party is a
small state machine; a message at the wrong stage, from the wrong sender, of the wrong length
or with out-of-range values raises a :class:`~silodp.crypto.errors.ProtocolError`.

Set-up (once)
  1. Server -> silos: ``ServerHello`` (session id, Paillier ``n``). Silos refuse keys below the
     configured size and parameters whose fixed-point aggregate could overflow ``n``.
  2. Silos -> server -> silos: X25519 public keys (``KeyShare`` / ``KeyDirectory``), each
     signed with the silo's Ed25519 identity key when ``identity_keys`` are registered
     (:mod:`~silodp.crypto.identity`; every silo checks every peer's signature); every pair
     derives AEAD and mask keys. The lowest silo draws a 32-byte seed and seals it for each
     other silo (``SealedSeed``, ChaCha20-Poly1305); the server only relays ciphertexts.
  3. From the seed every silo derives the same blinds ``r_a`` (uniform units mod ``n``) and
     sends ``r_a n_{s,a} + sum_j ±PRG(k_sj, a) mod n`` for *every* subject of the public list
     (``MaskedHistogram``). The server sums to ``r_a n_a`` (masks cancel) and inverts mod ``n``.

Round ``t``
  4. Server -> silos: ``EncryptedWeights``: ``Enc((r_a n_a)^-1)`` for every public subject when
     the silos sample (below), else ``Enc(0)`` for the subjects the server left out of its
     sample (hidden from the silos by semantic security).
  5. Each silo returns ``MaskedWeightedSum``: per parameter
     ``prod_a Enc((r_a n_a)^-1)^(r_a n_{s,a} L S Encode(Delta_{s,a}))`` times
     ``Enc(noise ± PRG(k_sj, t, j))`` (noise drawn as integers on the aggregate's grid
     ``L S 10^d``: the factor ``S`` makes it a post-processing of the continuous Gaussian
     mechanism, see :mod:`~silodp.crypto.encoding`), re-randomised (see
     :mod:`~silodp.crypto.weighted_sum` for how this is computed fast).
  6. The server multiplies the silos' ciphertexts (the masks cancel only if *all* silos
     contributed - otherwise :class:`~silodp.crypto.errors.SiloDropoutError` and nothing is
     decrypted), decrypts and decodes ``sum_{s,a} (n_{s,a}/n_a) Delta_{s,a} + sum_s noise_s``.

Subject sub-sampling, two ways. *By the silos* (``sampling_rate`` in :meth:`Silo.weighted_sum`):
every silo derives round ``t``'s Poisson sample from a key derived from the shared seed
(HKDF, label ``silodp/uldp-avg-w/subject-sample``; :mod:`~silodp.crypto.sampling`) and leaves
the subjects outside it out of its product (weight 0); the server encrypts every weight and
learns nothing about the sample, the silos all know it. *By the server* (``sampled`` or
``sampling_rate`` in :meth:`Server.open_round`): the server knows the sample, the silos do not.

What each party sees: the server sees ``r_a n_a`` (uniform on ``Z_n^*`` when ``r_a`` is),
masked values and ciphertexts; it decrypts only the aggregate. Silos see Paillier ciphertexts
only. The honest-but-curious model of the paper applies (no party deviates). Without registered
identity keys a server that swaps DH public keys could read the seed and unmask histograms;
with them (:func:`with_identities`, used by ``uldp_avg_w``) a swapped key is refused. ``N_max``
is a public bound every party must respect: a silo refuses its own count above it, and
:class:`WeightingSession` (which sees the whole federation, as a simulator does) refuses
``n_a > N_max`` before set-up; the protocol itself cannot detect an excess total.

This module runs every party in one process: :class:`WeightingSession` (set-up in its
constructor, then one round per :meth:`~WeightingSession.run_round`), :func:`run_weighting_round`
(set-up plus one round), :func:`with_identities` (registers fresh identity keys) and
:func:`plaintext_weighted_sum` (the value a round decrypts to, in the clear).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from silodp.crypto.errors import StageError, SubjectBoundError
from silodp.crypto.identity import IdentityKey, generate_identity
from silodp.crypto.messages import SealedSeed, SiloId, SubjectId
from silodp.crypto.paillier import DEFAULT_KEY_BITS, PaillierKeyPair
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.protocol.config import ProtocolConfig
from silodp.crypto.protocol.estimate import RoundEstimate, estimate_round
from silodp.crypto.protocol.server import RoundResult, Server
from silodp.crypto.protocol.silo import Silo
from silodp.crypto.randomness import RandomSource, SystemRandomSource

__all__ = [
    "Parties",
    "WeightingSession",
    "plaintext_weighted_sum",
    "run_weighting_round",
    "with_identities",
]


def with_identities(
    config: ProtocolConfig, source: RandomSource | None = None
) -> tuple[ProtocolConfig, dict[SiloId, IdentityKey]]:
    """Fresh Ed25519 identity keys for every silo and ``config`` with their public halves
    registered (what a deployment does out of band, once, before any session)."""
    src = source if source is not None else SystemRandomSource()
    identities = {s: generate_identity(src) for s in config.silo_ids}
    registry = tuple((s, key.public_bytes) for s, key in sorted(identities.items()))
    return dataclasses.replace(config, identity_keys=registry), identities


@dataclass(frozen=True)
class Parties:
    """The parties one process plays when they run apart (each set up by messages): the
    server alone, or one silo alone. Like :class:`WeightingSession`, it has ``config``,
    ``server`` and ``silos``; asking a silo's process for the server raises StageError."""

    config: ProtocolConfig
    silos: Mapping[SiloId, Silo] = field(default_factory=dict)
    own_server: Server | None = None

    @property
    def server(self) -> Server:
        if self.own_server is None:
            raise StageError("This process plays no server of the weighting protocol.")
        return self.own_server


def _child_source(source: RandomSource) -> RandomSource:
    return ChaCha20Prg(source.token_bytes(32))


class WeightingSession:
    """Runs the server and every silo in one process (tests, the simulator, benchmarks).

    Set-up happens in the constructor; :meth:`run_round` runs one weighting round. Phase wall
    times accumulate in :attr:`timings` (seconds): ``keygen``, ``key_exchange``,
    ``histogram``, and per round ``server_weights``, ``silo_weighting`` (sum over silos),
    ``aggregation``.
    """

    def __init__(
        self,
        config: ProtocolConfig,
        histograms: Mapping[SiloId, Mapping[SubjectId, int]],
        *,
        source: RandomSource | None = None,
        keypair: PaillierKeyPair | None = None,
        unresponsive: Collection[SiloId] = (),
        identities: Mapping[SiloId, IdentityKey] | None = None,
    ) -> None:
        """``identities``: each silo's Ed25519 key when ``config.identity_keys`` is set;
        ``unresponsive``: silos that never answer during set-up (to exercise dropout)."""
        if sorted(histograms) != list(config.silo_ids):
            raise ValueError(
                f"Histograms for silos {sorted(histograms)}, expected {list(config.silo_ids)}."
            )
        totals: dict[SubjectId, int] = {}
        for hist in histograms.values():
            for a, c in hist.items():
                totals[a] = totals.get(a, 0) + int(c)
        over = {a: t for a, t in totals.items() if t > config.n_max}
        if over:
            worst = max(over, key=lambda a: over[a])
            raise SubjectBoundError(
                f"{len(over)} subject(s) exceed n_max={config.n_max} records in total (e.g. "
                f"{worst!r} with {over[worst]}); their weights n_s,a/n_a would not decode. "
                "Drop excess records before training or raise n_max."
            )
        root = source if source is not None else SystemRandomSource()
        self.config = config
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.server = Server(config, keypair=keypair, source=_child_source(root))
        self._tick("keygen", t0)
        self.silos = {
            s: Silo(
                s,
                config,
                histograms[s],
                source=_child_source(root),
                identity=None if identities is None else identities[s],
            )
            for s in config.silo_ids
        }
        t0 = time.perf_counter()
        hello = self.server.hello()
        directory = None
        for s, silo in self.silos.items():
            if s not in unresponsive:
                directory = self.server.receive_key_share(silo.receive_hello(hello))
        if directory is None:
            self.server.abort_setup()  # raises SetupDropoutError
        assert directory is not None
        sealed: list[SealedSeed] = []
        for silo in self.silos.values():
            sealed.extend(silo.receive_directory(directory))
        for msg in sealed:
            self.silos[msg.recipient].receive_seed(self.server.relay_seed(msg))
        self._tick("key_exchange", t0)
        t0 = time.perf_counter()
        for silo in self.silos.values():
            self.server.receive_histogram(silo.masked_histogram())
        self._tick("histogram", t0)
        self._next_round = 0

    def _tick(self, name: str, start: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def estimate_round(self, dim: int) -> RoundEstimate:
        """The modelled CPU cost of one ``dim``-parameter round's cryptography on this
        machine (training not included): see
        :func:`~silodp.crypto.protocol.estimate.estimate_round`."""
        pairs = sum(len(silo.own_subjects) for silo in self.silos.values())
        return estimate_round(self.config, self.server.encoding, pairs=pairs, dim=dim)

    def run_round(
        self,
        deltas: Mapping[SiloId, Mapping[SubjectId, np.ndarray]],
        *,
        noise: Mapping[SiloId, np.ndarray] | None = None,
        encoded_noise: Mapping[SiloId, Sequence[int] | np.ndarray] | None = None,
        sampled: Collection[SubjectId] | None = None,
        sampling_rate: float | None = None,
        silo_sampling_rate: float | None = None,
        dim: int | None = None,
    ) -> RoundResult:
        """One round; ``deltas[s][a]`` for every subject with records in silo ``s``.

        Sub-sampling by the server: ``sampled`` or ``sampling_rate``; by the silos (the server
        encrypts every weight and never learns the sample): ``silo_sampling_rate``, with deltas
        needed only for each silo's sampled subjects. Noise: real ``noise`` or
        ``encoded_noise`` already on the aggregate's grid, per silo."""
        if sorted(deltas) != list(self.config.silo_ids):
            raise ValueError(f"Deltas for silos {sorted(deltas)}, expected {self.config.silo_ids}.")
        if silo_sampling_rate is not None and (sampled is not None or sampling_rate is not None):
            raise ValueError("Sample either at the server or at the silos, not both.")
        if dim is None:
            dims = {np.asarray(v).shape[-1] for d in deltas.values() for v in d.values()}
            if len(dims) != 1:
                raise ValueError(f"Expected deltas of one common length, got lengths {dims}.")
            dim = int(dims.pop())
        round_index = self._next_round
        self._next_round += 1
        t0 = time.perf_counter()
        weights = self.server.open_round(
            round_index, dim, sampled=sampled, sampling_rate=sampling_rate
        )
        self._tick("server_weights", t0)
        t0 = time.perf_counter()
        replies = [
            silo.weighted_sum(
                weights,
                deltas[s],
                None if noise is None else noise.get(s),
                encoded_noise=None if encoded_noise is None else encoded_noise.get(s),
                sampling_rate=silo_sampling_rate,
            )
            for s, silo in self.silos.items()
        ]
        self._tick("silo_weighting", t0)
        t0 = time.perf_counter()
        for reply in replies:
            self.server.receive_weighted_sum(reply)
        result = self.server.finish_round()
        self._tick("aggregation", t0)
        return result


def plaintext_weighted_sum(
    deltas: Mapping[SiloId, Mapping[SubjectId, np.ndarray]],
    histograms: Mapping[SiloId, Mapping[SubjectId, int]],
    *,
    noise: Mapping[SiloId, np.ndarray] | None = None,
    sampled: Collection[SubjectId] | None = None,
) -> np.ndarray:
    """``sum_s sum_a (n_{s,a}/n_a) Delta_{s,a} + sum_s noise_s`` in float64 (reference)."""
    totals: dict[SubjectId, int] = {}
    for hist in histograms.values():
        for a, c in hist.items():
            totals[a] = totals.get(a, 0) + int(c)
    terms: list[np.ndarray] = []
    for s, per_subject in deltas.items():
        for a, vec in per_subject.items():
            if sampled is not None and a not in sampled:
                continue
            count = int(histograms[s].get(a, 0))
            if count:
                terms.append(np.asarray(vec, dtype=np.float64) * (count / totals[a]))
    if noise is not None:
        terms.extend(np.asarray(v, dtype=np.float64) for v in noise.values())
    if not terms:
        raise ValueError("Nothing to sum.")
    return np.sum(np.stack(terms), axis=0)


def _sorted_ids(ids: Collection[Hashable]) -> tuple[Hashable, ...]:
    try:
        return tuple(sorted(ids))  # type: ignore[type-var]
    except TypeError:
        return tuple(sorted(ids, key=repr))


def _subjects_of(histograms: Mapping[SiloId, Mapping[SubjectId, int]]) -> tuple[SubjectId, ...]:
    return _sorted_ids({a for hist in histograms.values() for a in hist})


def run_weighting_round(
    deltas: Mapping[SiloId, Mapping[SubjectId, np.ndarray]],
    histograms: Mapping[SiloId, Mapping[SubjectId, int]],
    *,
    n_max: int,
    noise: Mapping[SiloId, np.ndarray] | None = None,
    sampled: Collection[SubjectId] | None = None,
    sampling_rate: float | None = None,
    delta_bound: float = 1.0,
    noise_bound: float = 1e6,
    precision: float = 1e-10,
    key_bits: int = DEFAULT_KEY_BITS,
    insecure_test_key_bits: int | None = None,
    workers: int | None = None,
    subject_ids: Sequence[SubjectId] | None = None,
    source: RandomSource | None = None,
) -> np.ndarray:
    """Set-up plus one round of the protocol, all parties in this process.

    ``deltas[s][a]``: the clipped float64 delta of subject ``a`` in silo ``s`` (every subject
    with records there); ``histograms[s][a]``: ``n_{s,a}``. Returns the decrypted
    ``sum_{s,a} (n_{s,a}/n_a) Delta_{s,a} + sum_s noise_s``, equal to the plaintext value
    within ``(subjects + silos) * precision / 2``.
    """
    config = ProtocolConfig(
        silo_ids=tuple(sorted(histograms)),
        subject_ids=tuple(subject_ids) if subject_ids is not None else _subjects_of(histograms),
        n_max=n_max,
        delta_bound=delta_bound,
        noise_bound=noise_bound,
        precision=precision,
        key_bits=key_bits,
        insecure_test_key_bits=insecure_test_key_bits,
        workers=workers,
    )
    session = WeightingSession(config, histograms, source=source)
    result = session.run_round(deltas, noise=noise, sampled=sampled, sampling_rate=sampling_rate)
    return result.aggregate
