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
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import gmpy2
import numpy as np

from silodp.crypto.encoding import MAX_N_MAX, WeightingEncoding, check_bound
from silodp.crypto.errors import (
    InsecureKeyError,
    MalformedMessageError,
    ProtocolError,
    SenderError,
    SetupDropoutError,
    SiloDropoutError,
    StageError,
    SubjectBoundError,
    ValueOutOfRangeError,
)
from silodp.crypto.identity import (
    IDENTITY_PUBLIC_BYTES,
    IdentityKey,
    generate_identity,
    verify_key_share,
)
from silodp.crypto.keyagree import (
    SEED_BYTES,
    DHKeyPair,
    PairwiseKeys,
    derive_pairwise_keys,
    generate_dh_keypair,
    open_seed,
    seal_seed,
)
from silodp.crypto.messages import (
    SESSION_ID_BYTES,
    EncryptedWeights,
    KeyDirectory,
    KeyShare,
    MaskedHistogram,
    MaskedWeightedSum,
    SealedSeed,
    ServerHello,
    SiloId,
    SubjectId,
)
from silodp.crypto.paillier import (
    DEFAULT_KEY_BITS,
    MIN_KEY_BITS,
    PaillierKeyPair,
    PaillierPublicKey,
    check_key_bits,
    generate_keypair,
)
from silodp.crypto.prg import ChaCha20Prg, MaskStream, derive_key
from silodp.crypto.randomness import RandomSource, SystemRandomSource, bernoulli, random_unit
from silodp.crypto.rerandomize import RerandomizationMode, Rerandomizer, make_rerandomizer
from silodp.crypto.sampling import SharedSampleKey
from silodp.crypto.weighted_sum import (
    aggregate_and_decrypt,
    choose_slots,
    compute_silo_ciphertexts,
    modelled_round_products,
    prepare_silo_round,
    product_seconds,
    resolve_workers,
)

__all__ = [
    "ProtocolConfig",
    "RoundEstimate",
    "RoundResult",
    "Server",
    "ServerStage",
    "Silo",
    "SiloStage",
    "WeightingSession",
    "plaintext_weighted_sum",
    "run_weighting_round",
    "with_identities",
]


def _sorted_ids(ids: Collection[Hashable]) -> tuple[Hashable, ...]:
    try:
        return tuple(sorted(ids))  # type: ignore[type-var]
    except TypeError:
        return tuple(sorted(ids, key=repr))


@dataclass(frozen=True)
class ProtocolConfig:
    """Public parameters every party agrees on before the protocol starts.

    ``delta_bound`` bounds each coordinate of a clipped delta (the clip norm ``C`` does);
    ``noise_bound`` each coordinate of a silo's noise; both are enforced when encoding.
    ``workers``: processes for the per-parameter loops (``None``: all CPUs for large models).
    """

    silo_ids: tuple[SiloId, ...]
    subject_ids: tuple[SubjectId, ...]
    n_max: int
    delta_bound: float = 1.0
    noise_bound: float = 1e6
    precision: float = 1e-10
    key_bits: int = DEFAULT_KEY_BITS
    insecure_test_key_bits: int | None = None
    rerandomization: RerandomizationMode = "fixed-base"
    workers: int | None = None
    packing: bool = True
    identity_keys: tuple[tuple[SiloId, bytes], ...] | None = None

    def __post_init__(self) -> None:
        silos = self.silo_ids
        if not isinstance(silos, tuple) or len(silos) < 2:
            raise ValueError(f"Expected silo_ids as a tuple of >= 2 ids, got {silos!r}.")
        for s in silos:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"Expected non-negative int silo ids, got {s!r}.")
        if len(set(silos)) != len(silos) or list(silos) != sorted(silos):
            raise ValueError(f"Expected distinct silo ids in increasing order, got {silos!r}.")
        subjects = self.subject_ids
        if not isinstance(subjects, tuple) or not subjects:
            raise ValueError(f"Expected subject_ids as a non-empty tuple, got {subjects!r:.80}.")
        if len(set(subjects)) != len(subjects):
            raise ValueError("Expected distinct subject ids.")
        n = self.n_max
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N_MAX:
            raise ValueError(f"Expected n_max={n!r} to be an int in [1, {MAX_N_MAX}].")
        for name in ("delta_bound", "noise_bound"):
            check_bound(name, getattr(self, name))
        check_key_bits(self.key_bits, insecure_test_key_bits=self.insecure_test_key_bits)
        if self.rerandomization not in ("fixed-base", "full"):
            raise ValueError(
                f"Expected rerandomization in ('fixed-base', 'full'), got {self.rerandomization!r}."
            )
        if self.workers is not None:
            resolve_workers(self.workers, 0)
        if self.identity_keys is not None:
            ids = self.identity_keys
            if not isinstance(ids, tuple) or sorted(s for s, _ in ids) != list(silos):
                raise ValueError(
                    f"Expected identity_keys as (silo, key) pairs for silos {list(silos)}."
                )
            for s, key in ids:
                if not isinstance(key, bytes) or len(key) != IDENTITY_PUBLIC_BYTES:
                    raise ValueError(
                        f"Expected a {IDENTITY_PUBLIC_BYTES}-byte Ed25519 key for silo {s}."
                    )

    def identity_of(self, silo: SiloId) -> bytes | None:
        """Silo ``silo``'s registered Ed25519 public key (``None``: keys not authenticated)."""
        return None if self.identity_keys is None else dict(self.identity_keys)[silo]

    @property
    def modulus_bits(self) -> int:
        return check_key_bits(self.key_bits, insecure_test_key_bits=self.insecure_test_key_bits)

    @property
    def leader(self) -> SiloId:
        """The silo that draws the shared seed."""
        return self.silo_ids[0]

    def encoding(self, modulus: int) -> WeightingEncoding:
        """The fixed-point encoding for ``modulus`` (raises if it could overflow)."""
        return WeightingEncoding(
            modulus=modulus,
            n_max=self.n_max,
            num_subjects=len(self.subject_ids),
            num_silos=len(self.silo_ids),
            delta_bound=self.delta_bound,
            noise_bound=self.noise_bound,
            precision=self.precision,
            packing=self.packing,
        )

    def slots_for(self, encoding: WeightingEncoding, dim: int) -> int:
        """Coordinates per ciphertext for a ``dim``-parameter round (public: every party
        derives the same value)."""
        if not self.packing:
            return 1
        pairs = len(self.subject_ids) * len(self.silo_ids)
        return choose_slots(encoding, dim, pairs, key_bits=encoding.modulus.bit_length())

    def check_public_key(self, public_key: PaillierPublicKey) -> None:
        """Refuses a modulus smaller than configured (never below 2048 bits unless the config
        explicitly asks for an insecure test key)."""
        want = self.modulus_bits
        if self.insecure_test_key_bits is None:
            want = max(want, MIN_KEY_BITS)
        if public_key.bits < want:
            raise InsecureKeyError(
                f"Refusing a {public_key.bits}-bit Paillier modulus: this configuration "
                f"requires at least {want} bits."
            )


class ServerStage(enum.Enum):
    CREATED = "created"
    COLLECTING_KEYS = "collecting key shares"
    RELAYING_SEEDS = "relaying sealed seeds"
    COLLECTING_HISTOGRAMS = "collecting masked histograms"
    READY = "ready"
    ROUND_OPEN = "round open"
    ABORTED = "aborted"


class SiloStage(enum.Enum):
    CREATED = "created"
    AWAITING_DIRECTORY = "awaiting key directory"
    AWAITING_SEED = "awaiting sealed seed"
    HAS_SEED = "has shared seed"
    READY = "ready"


def _expect_stage(party: str, stage: enum.Enum, *allowed: enum.Enum, what: str) -> None:
    if stage not in allowed:
        raise StageError(f"{party}: {what} is not expected at stage '{stage.value}'.")


def _pair_masks(
    own: SiloId, keys: Mapping[SiloId, PairwiseKeys], info: bytes, session: bytes, n: int
) -> list[tuple[MaskStream, int]]:
    """Mask streams shared with each peer: ``+`` for the lower id of the pair, ``-`` else."""
    return [
        (MaskStream(derive_key(k.mask_key, info, salt=session), n), 1 if own < peer else -1)
        for peer, k in sorted(keys.items())
    ]


@dataclass(frozen=True)
class RoundResult:
    """The decrypted aggregate of a round; ``sampled``: the subjects the server gave a
    non-zero encrypted weight (every subject when the silos sample: the server does not
    know their sample)."""

    round_index: int
    aggregate: np.ndarray = field(repr=False)
    sampled: frozenset[SubjectId]


class Server:
    """The aggregation server: Paillier key holder, relay, and decryptor of the aggregate."""

    def __init__(
        self,
        config: ProtocolConfig,
        *,
        keypair: PaillierKeyPair | None = None,
        source: RandomSource | None = None,
    ) -> None:
        self.config = config
        self._rng = source if source is not None else SystemRandomSource()
        if keypair is None:
            keypair = generate_keypair(
                config.key_bits,
                source=self._rng,
                insecure_test_key_bits=config.insecure_test_key_bits,
            )
        config.check_public_key(keypair.public_key)
        self._keys = keypair
        self.encoding = config.encoding(keypair.public_key.n)
        self._session = self._rng.token_bytes(SESSION_ID_BYTES)
        self._stage = ServerStage.CREATED
        self._dh: dict[SiloId, bytes] = {}
        self._signatures: dict[SiloId, bytes] = {}
        self._relayed: set[SiloId] = set()
        self._hist_sum = [0] * len(config.subject_ids)
        self._hist_from: set[SiloId] = set()
        self._inverses: list[int] = []
        self._round: int | None = None
        self._last_round = -1
        self._dim = 0
        self._sampled: frozenset[SubjectId] = frozenset()
        self._contrib: dict[SiloId, tuple[int, ...]] = {}

    @property
    def public_key(self) -> PaillierPublicKey:
        return self._keys.public_key

    @property
    def stage(self) -> ServerStage:
        return self._stage

    @property
    def session_id(self) -> bytes:
        return self._session

    def _check_sender(self, session: bytes, sender: SiloId, seen: Collection[SiloId]) -> None:
        if session != self._session:
            raise MalformedMessageError("Message from another session.")
        if sender not in self.config.silo_ids:
            raise SenderError(f"Server: unknown silo {sender}.")
        if sender in seen:
            raise SenderError(f"Server: second message from silo {sender} at this stage.")

    def hello(self) -> ServerHello:
        _expect_stage("Server", self._stage, ServerStage.CREATED, what="hello")
        self._stage = ServerStage.COLLECTING_KEYS
        return ServerHello(self._session, self.public_key.n)

    @property
    def setup_pending(self) -> tuple[SiloId, ...]:
        """Silos whose set-up message for the current stage has not arrived."""
        silos = self.config.silo_ids
        if self._stage is ServerStage.COLLECTING_KEYS:
            return tuple(s for s in silos if s not in self._dh)
        if self._stage is ServerStage.RELAYING_SEEDS:
            leader = self.config.leader
            return (leader,) if len(self._relayed) < len(silos) - 1 else ()
        if self._stage is ServerStage.COLLECTING_HISTOGRAMS:
            return tuple(s for s in silos if s not in self._hist_from)
        return ()

    def abort_setup(self) -> None:
        """Called when set-up times out: raises :class:`SetupDropoutError` naming the silos
        that did not answer, and leaves the server unusable (stage ``aborted``)."""
        _expect_stage(
            "Server",
            self._stage,
            ServerStage.COLLECTING_KEYS,
            ServerStage.RELAYING_SEEDS,
            ServerStage.COLLECTING_HISTOGRAMS,
            what="abort_setup",
        )
        stage, missing = self._stage.value, self.setup_pending
        self._stage = ServerStage.ABORTED
        self._dh, self._hist_sum, self._inverses = {}, [], []
        raise SetupDropoutError(missing, stage)

    def receive_key_share(self, msg: KeyShare) -> KeyDirectory | None:
        """Stores a silo's DH public key; returns the directory once all have arrived."""
        if not isinstance(msg, KeyShare):
            raise MalformedMessageError(f"Expected a KeyShare, got {type(msg).__name__}.")
        _expect_stage("Server", self._stage, ServerStage.COLLECTING_KEYS, what="KeyShare")
        self._check_sender(msg.session_id, msg.sender, self._dh)
        registered = self.config.identity_of(msg.sender)
        if registered is not None:
            verify_key_share(registered, msg.signature, self._session, msg.sender, msg.dh_public)
        self._dh[msg.sender] = msg.dh_public
        self._signatures[msg.sender] = msg.signature
        if len(self._dh) < len(self.config.silo_ids):
            return None
        self._stage = ServerStage.RELAYING_SEEDS
        signatures = tuple(sorted(self._signatures.items())) if registered is not None else ()
        return KeyDirectory(self._session, tuple(sorted(self._dh.items())), signatures)

    def relay_seed(self, msg: SealedSeed) -> SealedSeed:
        """Forwards a sealed seed from the leader to one other silo (cannot open it)."""
        if not isinstance(msg, SealedSeed):
            raise MalformedMessageError(f"Expected a SealedSeed, got {type(msg).__name__}.")
        _expect_stage("Server", self._stage, ServerStage.RELAYING_SEEDS, what="SealedSeed")
        if msg.session_id != self._session:
            raise MalformedMessageError("Message from another session.")
        if msg.sender != self.config.leader:
            raise SenderError(
                f"Server: only silo {self.config.leader} sends seeds, not {msg.sender}."
            )
        if msg.recipient not in self.config.silo_ids or msg.recipient == msg.sender:
            raise SenderError(f"Server: no silo {msg.recipient} to relay a seed to.")
        if msg.recipient in self._relayed:
            raise SenderError(f"Server: a seed for silo {msg.recipient} was already relayed.")
        self._relayed.add(msg.recipient)
        if len(self._relayed) == len(self.config.silo_ids) - 1:
            self._stage = ServerStage.COLLECTING_HISTOGRAMS
        return msg

    def receive_histogram(self, msg: MaskedHistogram) -> None:
        """Adds a masked histogram; with all of them, computes ``(r_a n_a)^-1 mod n``."""
        if not isinstance(msg, MaskedHistogram):
            raise MalformedMessageError(f"Expected a MaskedHistogram, got {type(msg).__name__}.")
        _expect_stage(
            "Server", self._stage, ServerStage.COLLECTING_HISTOGRAMS, what="MaskedHistogram"
        )
        self._check_sender(msg.session_id, msg.sender, self._hist_from)
        n = self.public_key.n
        if len(msg.values) != len(self.config.subject_ids):
            raise MalformedMessageError(
                f"Histogram from silo {msg.sender} has {len(msg.values)} values, expected "
                f"{len(self.config.subject_ids)}."
            )
        for i, v in enumerate(msg.values):
            if not 0 <= v < n:
                raise MalformedMessageError(
                    f"Histogram value {i} from silo {msg.sender} not in [0, n)."
                )
        self._hist_from.add(msg.sender)
        self._hist_sum = [(a + b) % n for a, b in zip(self._hist_sum, msg.values, strict=True)]
        if len(self._hist_from) < len(self.config.silo_ids):
            return
        inverses = []
        for blinded in self._hist_sum:
            if blinded == 0:  # n_a = 0: the subject has no record anywhere; weight 0
                inverses.append(0)
                continue
            if math.gcd(blinded, n) != 1:
                raise ProtocolError("A blinded count shares a factor with n; restart the set-up.")
            inverses.append(int(gmpy2.invert(blinded, n)))
        self._inverses = inverses
        self._hist_sum = []
        self._stage = ServerStage.READY

    def open_round(
        self,
        round_index: int,
        dim: int | None,
        *,
        sampled: Collection[SubjectId] | None = None,
        sampling_rate: float | None = None,
    ) -> EncryptedWeights:
        """Encrypted weights for a round: all subjects, an explicit ``sampled`` set, or a
        Poisson sample at ``sampling_rate`` drawn here. ``dim=None``: the number of parameters
        is taken from the silos' replies (which must agree)."""
        _expect_stage("Server", self._stage, ServerStage.READY, what="open_round")
        if isinstance(round_index, bool) or not isinstance(round_index, int):
            raise ValueError(f"Expected an int round_index, got {round_index!r}.")
        if round_index <= self._last_round:
            raise StageError(f"Round {round_index} is not after round {self._last_round}.")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"Expected dim={dim!r} to be a positive int or None.")
        subjects = self.config.subject_ids
        if sampled is not None and sampling_rate is not None:
            raise ValueError("Pass either sampled or sampling_rate, not both.")
        if sampling_rate is not None:
            if not 0.0 <= sampling_rate <= 1.0:
                raise ValueError(f"Expected sampling_rate={sampling_rate!r} in [0, 1].")
            chosen = frozenset(a for a in subjects if bernoulli(self._rng, sampling_rate))
        elif sampled is not None:
            chosen = frozenset(sampled)
            unknown = chosen - set(subjects)
            if unknown:
                raise ValueError(
                    f"Sampled subjects not in the protocol: {sorted(map(repr, unknown))}."
                )
        else:
            chosen = frozenset(subjects)
        pk = self.public_key
        ciphertexts = tuple(
            int(pk.encrypt(inv if a in chosen else 0, self._rng))
            for a, inv in zip(subjects, self._inverses, strict=True)
        )
        self._round, self._last_round, self._dim = round_index, round_index, dim or 0
        self._sampled = chosen
        self._contrib = {}
        self._stage = ServerStage.ROUND_OPEN
        return EncryptedWeights(self._session, round_index, dim or 0, ciphertexts)

    def receive_weighted_sum(self, msg: MaskedWeightedSum) -> None:
        if not isinstance(msg, MaskedWeightedSum):
            raise MalformedMessageError(f"Expected a MaskedWeightedSum, got {type(msg).__name__}.")
        _expect_stage("Server", self._stage, ServerStage.ROUND_OPEN, what="MaskedWeightedSum")
        self._check_sender(msg.session_id, msg.sender, self._contrib)
        if msg.round_index != self._round:
            raise StageError(
                f"Masked sum for round {msg.round_index}; round {self._round} is open."
            )
        if self._dim and msg.dim != self._dim:
            raise MalformedMessageError(
                f"Masked sum from silo {msg.sender} is for {msg.dim} parameters, expected "
                f"{self._dim}."
            )
        expected = -(-msg.dim // self.config.slots_for(self.encoding, msg.dim))
        if len(msg.ciphertexts) != expected:
            raise MalformedMessageError(
                f"Masked sum from silo {msg.sender} has {len(msg.ciphertexts)} ciphertexts, "
                f"expected {expected} for {msg.dim} parameters."
            )
        n2 = self.public_key.n_squared
        for j, c in enumerate(msg.ciphertexts):
            if not 0 < c < n2:
                raise MalformedMessageError(
                    f"Ciphertext {j} from silo {msg.sender} not in (0, n^2)."
                )
        self._contrib[msg.sender] = msg.ciphertexts
        self._dim = msg.dim

    @property
    def pending(self) -> tuple[SiloId, ...]:
        """Silos whose masked sum for the open round has not arrived."""
        if self._stage is not ServerStage.ROUND_OPEN:
            return ()
        return tuple(s for s in self.config.silo_ids if s not in self._contrib)

    def abort_round(self) -> None:
        """Drops the open round and every ciphertext received for it."""
        _expect_stage("Server", self._stage, ServerStage.ROUND_OPEN, what="abort_round")
        self._contrib = {}
        self._round = None
        self._stage = ServerStage.READY

    def finish_round(self) -> RoundResult:
        """Decrypts the aggregate; if a silo is missing, aborts with ``SiloDropoutError``."""
        _expect_stage("Server", self._stage, ServerStage.ROUND_OPEN, what="finish_round")
        round_index = self._round
        assert round_index is not None
        missing = self.pending
        if missing:
            self.abort_round()
            raise SiloDropoutError(missing, round_index)
        contributions = [self._contrib[s] for s in self.config.silo_ids]
        self._contrib = {}
        slots = self.config.slots_for(self.encoding, self._dim)
        workers = resolve_workers(self.config.workers, len(contributions[0]))
        try:
            aggregate = aggregate_and_decrypt(
                self._keys.private_key,
                self.encoding,
                contributions,
                slots=slots,
                dim=self._dim,
                workers=workers,
            )
        except ValueOutOfRangeError as err:
            self._round = None
            self._stage = ServerStage.READY
            raise MalformedMessageError(
                f"Round {round_index}: the decrypted aggregate is out of range - a silo sent "
                "inconsistent ciphertexts."
            ) from err
        self._round = None
        self._stage = ServerStage.READY
        return RoundResult(round_index, aggregate, self._sampled)


class Silo:
    """One silo: its histogram, its DH key, pairwise keys, the shared seed and the blinds."""

    def __init__(
        self,
        silo_id: SiloId,
        config: ProtocolConfig,
        histogram: Mapping[SubjectId, int],
        *,
        source: RandomSource | None = None,
        identity: IdentityKey | None = None,
    ) -> None:
        """``identity``: the silo's Ed25519 key; required when the config registers
        ``identity_keys`` (and must match its entry)."""
        if silo_id not in config.silo_ids:
            raise ValueError(f"Silo id {silo_id!r} is not among {config.silo_ids}.")
        registered = config.identity_of(silo_id)
        if registered is not None and (identity is None or identity.public_bytes != registered):
            raise ValueError(f"Silo {silo_id}: expected the identity key registered in the config.")
        self._identity = identity
        unknown = set(histogram) - set(config.subject_ids)
        if unknown:
            raise ValueError(f"Silo {silo_id}: subjects {sorted(map(repr, unknown))} not public.")
        self.silo_id = silo_id
        self.config = config
        counts = []
        for a in config.subject_ids:
            c = histogram.get(a, 0)
            if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
                raise ValueError(f"Silo {silo_id}: expected a count >= 0 for {a!r}, got {c!r}.")
            if c > config.n_max:
                raise SubjectBoundError(
                    f"Silo {silo_id}: subject {a!r} has {c} records here alone, above "
                    f"n_max={config.n_max}."
                )
            counts.append(int(c))
        self._counts = counts
        self._rng = source if source is not None else SystemRandomSource()
        self._stage = SiloStage.CREATED
        self._session = b""
        self._pk: PaillierPublicKey | None = None
        self._encoding: WeightingEncoding | None = None
        self._dh: DHKeyPair | None = None
        self._pairs: dict[SiloId, PairwiseKeys] = {}
        self._seed: bytes | None = None
        self._sample_key: SharedSampleKey | None = None
        self._blinds: list[int] = []
        self._rerandomizer: Rerandomizer | None = None
        self._last_round = -1

    @property
    def stage(self) -> SiloStage:
        return self._stage

    @property
    def own_subjects(self) -> tuple[SubjectId, ...]:
        """Subjects with at least one record in this silo (deltas are expected for these)."""
        return tuple(a for a, c in zip(self.config.subject_ids, self._counts, strict=True) if c)

    def _keys_ready(self) -> tuple[PaillierPublicKey, WeightingEncoding]:
        assert self._pk is not None and self._encoding is not None
        return self._pk, self._encoding

    @property
    def encoding(self) -> WeightingEncoding:
        """The fixed-point encoding of this session (after the server's hello)."""
        if self._encoding is None:
            raise StageError(f"Silo {self.silo_id}: no encoding before the server's hello.")
        return self._encoding

    @property
    def sample_key(self) -> SharedSampleKey:
        """The subject-sampling key every silo derives from the shared seed (the server
        never sees the seed, hence neither this key nor the samples)."""
        if self._sample_key is None:
            raise StageError(f"Silo {self.silo_id}: no sample key before the shared seed.")
        return self._sample_key

    def subject_sample(self, round_index: int, rate: float) -> frozenset[SubjectId]:
        """Round ``round_index``'s Poisson sample of the public subjects at ``rate``: the
        same in every silo of the session."""
        subjects = self.config.subject_ids
        chosen = self.sample_key.sample(round_index, len(subjects), rate)
        return frozenset(a for a, keep in zip(subjects, chosen.tolist(), strict=True) if keep)

    def _check_session(self, session: bytes) -> None:
        if session != self._session:
            raise MalformedMessageError(f"Silo {self.silo_id}: message from another session.")

    def receive_hello(self, msg: ServerHello) -> KeyShare:
        if not isinstance(msg, ServerHello):
            raise MalformedMessageError(f"Expected a ServerHello, got {type(msg).__name__}.")
        _expect_stage(f"Silo {self.silo_id}", self._stage, SiloStage.CREATED, what="ServerHello")
        pk = PaillierPublicKey(msg.paillier_n)
        self.config.check_public_key(pk)
        self._encoding = self.config.encoding(pk.n)  # refuses overflowing parameters
        self._pk = pk
        self._session = msg.session_id
        self._dh = generate_dh_keypair(self._rng)
        self._rerandomizer = make_rerandomizer(self.config.rerandomization, pk, self._rng)
        self._stage = SiloStage.AWAITING_DIRECTORY
        public = self._dh.public_bytes
        signature = b""
        if self._identity is not None:
            signature = self._identity.sign_key_share(self._session, self.silo_id, public)
        return KeyShare(self._session, self.silo_id, public, signature)

    def receive_directory(self, msg: KeyDirectory) -> list[SealedSeed]:
        """Derives pairwise keys; the leader returns one sealed seed per other silo."""
        if not isinstance(msg, KeyDirectory):
            raise MalformedMessageError(f"Expected a KeyDirectory, got {type(msg).__name__}.")
        _expect_stage(
            f"Silo {self.silo_id}", self._stage, SiloStage.AWAITING_DIRECTORY, what="KeyDirectory"
        )
        self._check_session(msg.session_id)
        directory = msg.as_dict()
        if sorted(directory) != list(self.config.silo_ids) or len(directory) != len(msg.dh_publics):
            raise MalformedMessageError(
                f"Silo {self.silo_id}: key directory lists silos {sorted(directory)}, "
                f"expected {list(self.config.silo_ids)}."
            )
        assert self._dh is not None
        if directory[self.silo_id] != self._dh.public_bytes:
            raise MalformedMessageError(f"Silo {self.silo_id}: directory altered its own key.")
        if self.config.identity_keys is not None:
            signatures = dict(msg.signatures)
            for peer, public in directory.items():
                registered = self.config.identity_of(peer)
                assert registered is not None
                sig = signatures.get(peer, b"")
                verify_key_share(registered, sig, self._session, peer, public)
        self._pairs = {
            peer: derive_pairwise_keys(
                self.silo_id, self._dh, peer, public, session_id=self._session
            )
            for peer, public in directory.items()
            if peer != self.silo_id
        }
        if self.silo_id != self.config.leader:
            self._stage = SiloStage.AWAITING_SEED
            return []
        seed = self._rng.token_bytes(SEED_BYTES)
        sealed = []
        for peer, keys in sorted(self._pairs.items()):
            nonce, ciphertext = seal_seed(
                keys,
                seed,
                session_id=self._session,
                sender=self.silo_id,
                recipient=peer,
                source=self._rng,
            )
            sealed.append(SealedSeed(self._session, self.silo_id, peer, nonce, ciphertext))
        self._set_seed(seed)
        return sealed

    def receive_seed(self, msg: SealedSeed) -> None:
        if not isinstance(msg, SealedSeed):
            raise MalformedMessageError(f"Expected a SealedSeed, got {type(msg).__name__}.")
        _expect_stage(
            f"Silo {self.silo_id}", self._stage, SiloStage.AWAITING_SEED, what="SealedSeed"
        )
        self._check_session(msg.session_id)
        if msg.recipient != self.silo_id or msg.sender != self.config.leader:
            raise SenderError(
                f"Silo {self.silo_id}: seed routed {msg.sender}->{msg.recipient}, expected "
                f"{self.config.leader}->{self.silo_id}."
            )
        seed = open_seed(
            self._pairs[msg.sender],
            msg.nonce,
            msg.ciphertext,
            session_id=self._session,
            sender=msg.sender,
            recipient=self.silo_id,
        )
        self._set_seed(seed)

    def _set_seed(self, seed: bytes) -> None:
        pk, _ = self._keys_ready()
        self._seed = seed
        prg = ChaCha20Prg(derive_key(seed, b"silodp/uldp-avg-w/blinds", salt=self._session))
        self._blinds = [random_unit(prg, pk.n) for _ in self.config.subject_ids]
        label = b"silodp/uldp-avg-w/subject-sample"
        self._sample_key = SharedSampleKey(derive_key(seed, label, salt=self._session))
        self._stage = SiloStage.HAS_SEED

    def masked_histogram(self) -> MaskedHistogram:
        """``r_a n_{s,a}`` plus pairwise masks, for every public subject (zeros included)."""
        _expect_stage(f"Silo {self.silo_id}", self._stage, SiloStage.HAS_SEED, what="histogram")
        pk, _ = self._keys_ready()
        n = pk.n
        values = [r * c % n for r, c in zip(self._blinds, self._counts, strict=True)]
        count = len(values)
        for stream, sign in _pair_masks(self.silo_id, self._pairs, b"histogram", self._session, n):
            masks = stream.values(0, count)
            values = [(v + sign * m) % n for v, m in zip(values, masks, strict=True)]
        self._stage = SiloStage.READY
        return MaskedHistogram(self._session, self.silo_id, tuple(values))

    def weighted_sum(
        self,
        msg: EncryptedWeights,
        deltas: Mapping[SubjectId, np.ndarray],
        noise: np.ndarray | None = None,
        *,
        dim: int | None = None,
        encoded_noise: Sequence[int] | np.ndarray | None = None,
        sampling_rate: float | None = None,
    ) -> MaskedWeightedSum:
        """The silo's masked encrypted ``sum_a w_{s,a} Delta_{s,a} + noise`` for a round.

        ``deltas`` holds one clipped vector of length ``msg.dim`` for every subject with a
        record here (the silo cannot tell which subjects the server sampled). With
        ``sampling_rate``, the silos sample: the silo derives the round's sample
        (:meth:`subject_sample`), leaves the other subjects out (weight 0) and needs deltas
        only for its sampled subjects. Noise: ``encoded_noise``, integers already on the
        aggregate's grid (a DP release draws them there exactly, see
        :mod:`~silodp.crypto.encoding`), or real ``noise`` rounded onto it. When the server
        left ``msg.dim`` at 0, the length is ``dim``, else that of the noise or the deltas.
        """
        if not isinstance(msg, EncryptedWeights):
            raise MalformedMessageError(f"Expected EncryptedWeights, got {type(msg).__name__}.")
        _expect_stage(f"Silo {self.silo_id}", self._stage, SiloStage.READY, what="EncryptedWeights")
        self._check_session(msg.session_id)
        if msg.round_index <= self._last_round:
            raise StageError(
                f"Silo {self.silo_id}: round {msg.round_index} is not after round "
                f"{self._last_round} (a repeated round would reuse its masks)."
            )
        if noise is not None and encoded_noise is not None:
            raise ValueError("Pass either noise or encoded_noise, not both.")
        pk, encoding = self._keys_ready()
        subjects = self.config.subject_ids
        if len(msg.ciphertexts) != len(subjects):
            raise MalformedMessageError(
                f"Silo {self.silo_id}: {len(msg.ciphertexts)} weight ciphertexts, expected "
                f"{len(subjects)}."
            )
        weights = []
        for i, c in enumerate(msg.ciphertexts):
            try:
                weights.append(pk.check_ciphertext(c))
            except ValueError as err:
                raise MalformedMessageError(f"Silo {self.silo_id}: weight {i}: {err}") from err
        given = noise if encoded_noise is None else np.asarray(encoded_noise)
        dim = self._round_dim(msg.dim, dim, deltas, given)
        own = self.own_subjects
        if sampling_rate is None:
            included = own
            if set(deltas) != set(own):
                raise ValueError(
                    f"Silo {self.silo_id}: deltas for {len(deltas)} subjects, expected exactly "
                    f"the {len(own)} subjects with records here (missing "
                    f"{sorted(map(repr, set(own) - set(deltas)))[:5]}, extra "
                    f"{sorted(map(repr, set(deltas) - set(own)))[:5]})."
                )
        else:
            sample = self.subject_sample(msg.round_index, sampling_rate)
            included = tuple(a for a in own if a in sample)
            missing, extra = set(included) - set(deltas), set(deltas) - set(own)
            if missing or extra:
                raise ValueError(
                    f"Silo {self.silo_id}: expected deltas for the {len(included)} sampled "
                    f"subjects with records here (missing {sorted(map(repr, missing))[:5]}, "
                    f"not held here {sorted(map(repr, extra))[:5]})."
                )
        matrix = np.zeros((len(included), dim), dtype=np.float64)
        for row, a in enumerate(included):
            vec = np.asarray(deltas[a])
            if vec.shape != (dim,):
                raise ValueError(
                    f"Silo {self.silo_id}: delta of subject {a!r} has shape {vec.shape}, "
                    f"expected ({dim},)."
                )
            if vec.dtype.kind != "f" or vec.dtype.itemsize > 8:
                raise ValueError(f"Silo {self.silo_id}: expected float deltas, got {vec.dtype}.")
            matrix[row] = vec  # widening to float64 is exact
        if encoded_noise is not None:
            if np.asarray(encoded_noise).shape != (dim,):
                raise ValueError(
                    f"Silo {self.silo_id}: expected {dim} encoded noise values, got "
                    f"{np.asarray(encoded_noise).shape}."
                )
            noise_ints = encoding.check_encoded_noise(encoded_noise)
        else:
            noise_vec = np.zeros(dim) if noise is None else np.asarray(noise)
            if (
                noise_vec.shape != (dim,)
                or noise_vec.dtype.kind != "f"
                or noise_vec.dtype.itemsize > 8
            ):
                raise ValueError(
                    f"Silo {self.silo_id}: expected float noise of shape ({dim},), got "
                    f"{noise_vec.shape} {noise_vec.dtype}."
                )
            noise_ints = encoding.encode_noise(noise_vec.astype(np.float64))
        self._last_round = msg.round_index
        n, n2 = pk.n_mpz, pk.n_squared
        rerand = self._rerandomizer
        assert rerand is not None
        index = {a: i for i, a in enumerate(subjects)}
        lifted = []
        lift_secrets = rerand.draw(self._rng, len(included))
        for a, secret in zip(included, lift_secrets, strict=True):
            i = index[a]
            exponent = self._blinds[i] * self._counts[i] * encoding.multiplier % n
            c = gmpy2.powmod(weights[i], exponent, n2)
            lifted.append(c * rerand.factor(secret) % n2)
        masks = _pair_masks(
            self.silo_id, self._pairs, b"round|%d" % msg.round_index, self._session, int(n)
        )
        slots = self.config.slots_for(encoding, dim)
        job = prepare_silo_round(pk, encoding, lifted, masks, rerand, slots)
        count = -(-dim // slots)
        secrets = rerand.draw(self._rng, count)
        workers = resolve_workers(self.config.workers, count * len(included) // 4 + count)
        ciphertexts = compute_silo_ciphertexts(job, matrix, noise_ints, secrets, workers=workers)
        return MaskedWeightedSum(
            self._session, self.silo_id, msg.round_index, dim, tuple(ciphertexts)
        )

    @staticmethod
    def _round_dim(
        announced: int,
        dim: int | None,
        deltas: Mapping[SubjectId, np.ndarray],
        noise: np.ndarray | None,
    ) -> int:
        if announced:
            return announced
        if dim is None:
            if noise is not None:
                dim = int(np.asarray(noise).shape[0])
            elif deltas:
                dim = int(np.asarray(next(iter(deltas.values()))).shape[-1])
            else:
                raise ValueError("The server left dim open: pass dim, noise or deltas.")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"Expected dim={dim!r} to be a positive int.")
        return dim


def with_identities(
    config: ProtocolConfig, source: RandomSource | None = None
) -> tuple[ProtocolConfig, dict[SiloId, IdentityKey]]:
    """Fresh Ed25519 identity keys for every silo and ``config`` with their public halves
    registered (what a deployment does out of band, once, before any session)."""
    src = source if source is not None else SystemRandomSource()
    identities = {s: generate_identity(src) for s in config.silo_ids}
    registry = tuple((s, key.public_bytes) for s, key in sorted(identities.items()))
    return dataclasses.replace(config, identity_keys=registry), identities


def _child_source(source: RandomSource) -> RandomSource:
    return ChaCha20Prg(source.token_bytes(32))


@dataclass(frozen=True)
class RoundEstimate:
    """Modelled cost of one protocol round (see :meth:`WeightingSession.estimate_round`)."""

    pairs: int  # (silo, subject) pairs with records
    dim: int
    slots: int  # coordinates per ciphertext
    cpu_seconds: float


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
        machine (training not included): the cost model of
        :func:`~silodp.crypto.weighted_sum.choose_slots` times a measured modular product."""
        encoding = self.server.encoding
        pairs = sum(len(silo.own_subjects) for silo in self.silos.values())
        slots = self.config.slots_for(encoding, dim)
        key_bits = encoding.modulus.bit_length()
        products = modelled_round_products(encoding, dim, pairs, slots, key_bits=key_bits)
        seconds = products * product_seconds(encoding.modulus**2)
        return RoundEstimate(pairs=pairs, dim=dim, slots=slots, cpu_seconds=seconds)

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
    rerandomization: RerandomizationMode = "fixed-base",
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
        rerandomization=rerandomization,
        workers=workers,
    )
    session = WeightingSession(config, histograms, source=source)
    result = session.run_round(deltas, noise=noise, sampled=sampled, sampling_rate=sampling_rate)
    return result.aggregate
