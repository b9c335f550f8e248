"""The aggregation server of the weighting protocol: it holds the Paillier secret key, relays
the leader's sealed seeds, turns the masked histograms into encrypted weights
``Enc((r_a n_a)^-1)`` and decrypts only the round's aggregate (steps 1-4 and 6 of
:mod:`~silodp.crypto.protocol.session`)."""

from __future__ import annotations

import enum
import math
from collections.abc import Collection
from dataclasses import dataclass, field

import gmpy2
import numpy as np

from silodp.crypto.errors import (
    MalformedMessageError,
    ProtocolError,
    SenderError,
    SetupDropoutError,
    SiloDropoutError,
    StageError,
    ValueOutOfRangeError,
)
from silodp.crypto.identity import verify_key_share
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
from silodp.crypto.paillier import PaillierKeyPair, PaillierPublicKey, generate_keypair
from silodp.crypto.protocol.config import ProtocolConfig, _expect_stage
from silodp.crypto.randomness import RandomSource, SystemRandomSource, bernoulli
from silodp.crypto.weighted_sum import aggregate_and_decrypt, resolve_workers

__all__ = ["RoundResult", "Server", "ServerStage"]


class ServerStage(enum.Enum):
    CREATED = "created"
    COLLECTING_KEYS = "collecting key shares"
    RELAYING_SEEDS = "relaying sealed seeds"
    COLLECTING_HISTOGRAMS = "collecting masked histograms"
    READY = "ready"
    ROUND_OPEN = "round open"
    ABORTED = "aborted"


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
