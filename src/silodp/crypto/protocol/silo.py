"""A silo of the weighting protocol: it holds its histogram ``n_{s,a}``, its X25519 key, the
pairwise keys, the shared seed and the blinds ``r_a``, and answers each round with its masked
encrypted weighted sum (steps 1-3 and 5 of :mod:`~silodp.crypto.protocol.session`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import gmpy2
import numpy as np

from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.errors import MalformedMessageError, SenderError, StageError, SubjectBoundError
from silodp.crypto.identity import IdentityKey, verify_key_share
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
from silodp.crypto.paillier import PaillierPublicKey
from silodp.crypto.prg import ChaCha20Prg, MaskStream, derive_key
from silodp.crypto.protocol.config import ProtocolConfig, _expect_stage
from silodp.crypto.randomness import RandomSource, SystemRandomSource, random_unit
from silodp.crypto.rerandomize import FullRerandomizer, Rerandomizer
from silodp.crypto.sampling import SharedSampleKey
from silodp.crypto.weighted_sum import compute_silo_ciphertexts, prepare_silo_round, resolve_workers

__all__ = ["Silo", "SiloStage"]


class SiloStage(enum.Enum):
    CREATED = "created"
    AWAITING_DIRECTORY = "awaiting key directory"
    AWAITING_SEED = "awaiting sealed seed"
    HAS_SEED = "has shared seed"
    READY = "ready"


def _pair_masks(
    own: SiloId, keys: Mapping[SiloId, PairwiseKeys], info: bytes, session: bytes, n: int
) -> list[tuple[MaskStream, int]]:
    """Mask streams shared with each peer: ``+`` for the lower id of the pair, ``-`` else."""
    return [
        (MaskStream(derive_key(k.mask_key, info, salt=session), n), 1 if own < peer else -1)
        for peer, k in sorted(keys.items())
    ]


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
        self._rerandomizer = FullRerandomizer(pk)
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
        self._check_round_message(msg)
        if noise is not None and encoded_noise is not None:
            raise ValueError("Pass either noise or encoded_noise, not both.")
        weights = self._parse_weights(msg)
        given = noise if encoded_noise is None else np.asarray(encoded_noise)
        dim = self._round_dim(msg.dim, dim, deltas, given)
        included = self._included_subjects(msg.round_index, deltas, sampling_rate)
        matrix = self._delta_matrix(included, deltas, dim)
        noise_ints = self._noise_on_grid(dim, noise, encoded_noise)
        self._last_round = msg.round_index
        ciphertexts = self._masked_ciphertexts(
            msg.round_index, weights, included, matrix, noise_ints
        )
        return MaskedWeightedSum(
            self._session, self.silo_id, msg.round_index, dim, tuple(ciphertexts)
        )

    def _check_round_message(self, msg: EncryptedWeights) -> None:
        """Refuses weights of the wrong type, at the wrong stage, from another session or for
        a round not after the last one this silo answered."""
        if not isinstance(msg, EncryptedWeights):
            raise MalformedMessageError(f"Expected EncryptedWeights, got {type(msg).__name__}.")
        _expect_stage(f"Silo {self.silo_id}", self._stage, SiloStage.READY, what="EncryptedWeights")
        self._check_session(msg.session_id)
        if msg.round_index <= self._last_round:
            raise StageError(
                f"Silo {self.silo_id}: round {msg.round_index} is not after round "
                f"{self._last_round} (a repeated round would reuse its masks)."
            )

    def _parse_weights(self, msg: EncryptedWeights) -> list[Any]:
        """The encrypted weights as mpz, one valid ciphertext per public subject."""
        pk, _ = self._keys_ready()
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
        return weights

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

    def _included_subjects(
        self,
        round_index: int,
        deltas: Mapping[SubjectId, np.ndarray],
        sampling_rate: float | None,
    ) -> tuple[SubjectId, ...]:
        """The subjects this silo weights in round ``round_index``: those with records here,
        or, when the silos sample at ``sampling_rate``, those of them in the round's sample.
        ``deltas`` must cover exactly these (when sampling: all of them, none not held here).
        """
        own = self.own_subjects
        if sampling_rate is None:
            if set(deltas) != set(own):
                raise ValueError(
                    f"Silo {self.silo_id}: deltas for {len(deltas)} subjects, expected exactly "
                    f"the {len(own)} subjects with records here (missing "
                    f"{sorted(map(repr, set(own) - set(deltas)))[:5]}, extra "
                    f"{sorted(map(repr, set(deltas) - set(own)))[:5]})."
                )
            return own
        sample = self.subject_sample(round_index, sampling_rate)
        included = tuple(a for a in own if a in sample)
        missing, extra = set(included) - set(deltas), set(deltas) - set(own)
        if missing or extra:
            raise ValueError(
                f"Silo {self.silo_id}: expected deltas for the {len(included)} sampled "
                f"subjects with records here (missing {sorted(map(repr, missing))[:5]}, "
                f"not held here {sorted(map(repr, extra))[:5]})."
            )
        return included

    def _delta_matrix(
        self, included: Sequence[SubjectId], deltas: Mapping[SubjectId, np.ndarray], dim: int
    ) -> np.ndarray:
        """The deltas of ``included``, in order, as the rows of a float64 ``(subjects, dim)``
        matrix; each must be a float vector of length ``dim``."""
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
        return matrix

    def _noise_on_grid(
        self,
        dim: int,
        noise: np.ndarray | None,
        encoded_noise: Sequence[int] | np.ndarray | None,
    ) -> list[int]:
        """The silo's ``dim`` noise values as signed integers on the aggregate's grid:
        ``encoded_noise`` checked against its bound, else real ``noise`` (zeros if ``None``)
        rounded onto the grid."""
        _, encoding = self._keys_ready()
        if encoded_noise is not None:
            if np.asarray(encoded_noise).shape != (dim,):
                raise ValueError(
                    f"Silo {self.silo_id}: expected {dim} encoded noise values, got "
                    f"{np.asarray(encoded_noise).shape}."
                )
            return encoding.check_encoded_noise(encoded_noise)
        noise_vec = np.zeros(dim) if noise is None else np.asarray(noise)
        if noise_vec.shape != (dim,) or noise_vec.dtype.kind != "f" or noise_vec.dtype.itemsize > 8:
            raise ValueError(
                f"Silo {self.silo_id}: expected float noise of shape ({dim},), got "
                f"{noise_vec.shape} {noise_vec.dtype}."
            )
        return encoding.encode_noise(noise_vec.astype(np.float64))

    def _masked_ciphertexts(
        self,
        round_index: int,
        weights: Sequence[Any],
        included: Sequence[SubjectId],
        matrix: np.ndarray,
        noise_ints: Sequence[int],
    ) -> list[int]:
        """The arithmetic of step 5: one masked, re-randomised ciphertext per ``slots``
        parameters of ``matrix`` (rows: ``included``), with the noise and this round's
        pairwise masks. Draws one re-randomising secret per ciphertext."""
        pk, encoding = self._keys_ready()
        rerand = self._rerandomizer
        assert rerand is not None
        lifted = self._lift_weights(weights, included)
        masks = _pair_masks(
            self.silo_id, self._pairs, b"round|%d" % round_index, self._session, int(pk.n_mpz)
        )
        dim = matrix.shape[1]
        slots = self.config.slots_for(encoding, dim)
        job = prepare_silo_round(pk, encoding, lifted, masks, rerand, slots)
        count = -(-dim // slots)
        secrets = rerand.draw(self._rng, count)
        workers = resolve_workers(self.config.workers, count * len(included) // 4 + count)
        return compute_silo_ciphertexts(job, matrix, noise_ints, secrets, workers=workers)

    def _lift_weights(self, weights: Sequence[Any], included: Sequence[SubjectId]) -> list[Any]:
        """``c_a = Enc(w_a)^(r_a n_{s,a} M)`` (``M = L S``) for each included subject ``a``, in
        order. They never leave the silo; each outgoing ciphertext is re-randomised."""
        pk, encoding = self._keys_ready()
        n, n2 = pk.n_mpz, pk.n_squared
        index = {a: i for i, a in enumerate(self.config.subject_ids)}
        lifted = []
        for a in included:
            i = index[a]
            exponent = self._blinds[i] * self._counts[i] * encoding.multiplier % n
            lifted.append(gmpy2.powmod(weights[i], exponent, n2))
        return lifted
