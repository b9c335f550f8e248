"""The weighting protocol's arithmetic over BFV: the same steps and the same decrypted sum as
the Paillier protocol (:mod:`silodp.crypto.protocol`), computed modulo the CRT primes
``t_1 .. t_m`` of a :class:`~silodp.crypto.bfv.params.BfvPlan`. Parties are objects called in
one process (:class:`BfvWeightingSession`); there are no BFV message types or stage checks yet.
``uldp_avg_w`` with ``scheme = "bfv"`` drives it in the in-process simulator through
:class:`~silodp.crypto.bfv.simulation.BfvProtocol`.

Per prime ``t`` (all parties derive the primes from public values):

* set-up: the blinds ``r_a`` are uniform units mod ``t`` (from the shared seed); silo ``s``
  sends ``r_a n_{s,a} + sum_j ±mask mod t`` for every public subject; the server sums to
  ``r_a n_a mod t`` (uniform on ``Z_t^*`` when ``0 < n_a <= N_max < t``; 0, weight 0, for a
  subject without records, as with Paillier) and inverts it;
* round: the server sends ``Enc((r_a n_a)^-1)`` as a constant polynomial for every
  public subject (``Enc(0)`` outside its sample); silo ``s`` computes, for each block of ``N``
  parameters, ``sum_a Enc(w'_a) * P_a`` with ``P_a`` the polynomial whose coefficients are
  ``r_a n_{s,a} M e_{s,a} mod t`` (plaintext x ciphertext
  products in the NTT domain), adds the plaintext ``noise + masks mod t``, a fresh ``Enc(0)``
  (re-randomisation) and the flooding ciphertext;
* the server adds the silos' ciphertexts, decrypts every prime and block, recombines by the CRT
  modulo ``T = prod t`` and decodes exactly as the Paillier aggregate (``T`` exceeds twice the
  honest bound by 2^32: an inconsistent aggregate raises
  :class:`~silodp.crypto.errors.ValueOutOfRangeError`).

With ``weights = "fixed_point"`` (:mod:`~silodp.crypto.bfv.fixed_weights`, for ``n_max``
too large for ``L``) there is no blind, histogram or inverse: the silos compute
``Enc(floor(2^k/n_a))`` themselves, once per training, and multiply by ``n_{s,a} S e_{s,a}``
(the weight carries ``L = 2^k``); the round is otherwise the same. The server cannot then
hide a sample of its own in the weights, so only the silos may sample.

What each party learns (honest-but-curious, as the Paillier protocol):

* **Silos** see BFV ciphertexts of the weights only: IND-CPA under RLWE at 128-bit security
  (HE standard parameters) hides ``n_a``, and the sample when the server samples. They see
  nothing of other silos beyond what the Paillier protocol's set-up shows.
* **The server (key holder)** sees ``r_a n_a mod t`` per prime (uniform and independent of
  ``n_a``), each silo's ciphertexts and the decrypted aggregate. A silo's ciphertext decrypts
  to its weighted sum plus pairwise masks uniform mod ``t`` (which cancel only in the sum over
  all silos); its ``c1`` is re-randomised by a fresh encryption of zero (pseudorandom under
  RLWE, even to the key holder), and its noise is flooded so that the noise distribution is
  within statistical distance ``2^-(lambda+1)`` of data-independent flooding
  (:mod:`~silodp.crypto.bfv.params`). So the server learns the aggregate and nothing else, up
  to RLWE and that statistical distance per silo message, which adds up over messages
  (Paillier has no statistical term).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from silodp.crypto.bfv import fixed_weights
from silodp.crypto.bfv.backend import (
    BfvContext,
    BfvKeyPair,
    ciphertext_primes,
    decryptor,
    encryptor,
    galois_keys,
    new_ciphertext,
    new_plaintext,
)
from silodp.crypto.bfv.params import BfvParameters, BfvPlan, plan_bfv_round, trace_elements
from silodp.crypto.errors import ProtocolError, SiloDropoutError, SubjectBoundError
from silodp.crypto.identity import generate_identity, verify_key_share
from silodp.crypto.keyagree import (
    SEED_BYTES,
    derive_pairwise_keys,
    generate_dh_keypair,
    open_seed,
    seal_seed,
)
from silodp.crypto.prg import ChaCha20Prg, derive_key
from silodp.crypto.randomness import RandomSource, SystemRandomSource, random_unit
from silodp.crypto.sampling import SharedSampleKey
from silodp.crypto.weighted_sum import resolve_workers

__all__ = [
    "BfvServer",
    "BfvSilo",
    "BfvWeightingSession",
    "authenticated_setup",
    "mulmod",
    "subject_sample_key",
    "uniform_residues",
]


#: subjects x primes from which the fixed-point weights are computed in worker processes
PARALLEL_MIN_WORK = 64


def mulmod(values: np.ndarray, scalar: int, modulus: int) -> np.ndarray:
    """``values * scalar mod modulus`` for residues ``values`` below ``modulus < 2^52``:
    the quotient estimated in float64 (off by at most 2), the remainder exact in wrapping
    64-bit arithmetic, then corrected."""
    t = int(modulus)
    if not 2 <= t < (1 << 52):
        raise ValueError(f"Expected a modulus in [2, 2^52), got {t}.")
    a = np.asarray(values, dtype=np.uint64)
    b = int(scalar) % t
    if t <= (1 << 32):  # the product fits in 64 bits
        return (a * np.uint64(b)) % np.uint64(t)
    quot = np.floor(a.astype(np.float64) * float(b) / float(t)).astype(np.uint64)
    with np.errstate(over="ignore"):
        rem = (a * np.uint64(b) - quot * np.uint64(t)).view(np.int64)
    tt = np.int64(t)
    for _ in range(3):
        rem = np.where(rem < 0, rem + tt, rem)
        rem = np.where(rem >= tt, rem - tt, rem)
    return rem.astype(np.uint64)


def uniform_residues(source: RandomSource, modulus: int, count: int) -> np.ndarray:
    """``count`` independent uniform residues mod ``modulus`` (rejection sampling)."""
    t = int(modulus)
    bits = t.bit_length()
    if bits > 63:
        raise ValueError(f"Expected a modulus below 2^63, got {bits} bits.")
    mask = np.uint64((1 << bits) - 1)
    parts: list[np.ndarray] = []
    have = 0
    while have < count:
        need = count - have
        draw = need + need // 2 + 16
        raw = np.frombuffer(source.token_bytes(8 * draw), dtype=np.uint64) & mask
        kept = raw[raw < np.uint64(t)]
        parts.append(kept)
        have += kept.size
    return np.concatenate(parts)[:count]


def subject_sample_key(seed: bytes) -> SharedSampleKey:
    """The key from which every silo derives each round's subject sample (from the shared
    seed; the server never holds it)."""
    return SharedSampleKey(derive_key(seed, b"silodp/bfv/subject-sample"))


def _stream(key: bytes, label: str) -> ChaCha20Prg:
    return ChaCha20Prg(derive_key(key, label.encode()))


@dataclass
class BfvSilo:
    """Silo ``silo_id``: its histogram, its pairwise mask keys, the shared seed."""

    silo_id: int
    plan: BfvPlan
    contexts: tuple[BfvContext, ...]
    public_keys: tuple[Any, ...]
    histogram: Mapping[Hashable, int] = field(repr=False)
    subject_ids: tuple[Hashable, ...]
    pair_keys: Mapping[int, bytes] = field(repr=False)
    seed: bytes = field(repr=False)
    source: RandomSource = field(repr=False)
    _blinds: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for a, c in self.histogram.items():
            self.plan.encoding.check_subject_count(int(c), a)
        self._encryptors: dict[int, Any] = {}
        prg = _stream(self.seed, "silodp/bfv/blinds")
        self._blinds = [
            [random_unit(prg, t) for _ in self.subject_ids] for t in self.plan.plain_moduli
        ]
        self.sample_key = subject_sample_key(self.seed)

    def subject_sample(self, round_index: int, rate: float) -> frozenset[Hashable]:
        """Round ``round_index``'s Poisson sample of the public subjects at ``rate``, the same
        at every silo (from the shared seed; the server never sees it)."""
        chosen = self.sample_key.sample(round_index, len(self.subject_ids), rate)
        return frozenset(a for a, c in zip(self.subject_ids, chosen, strict=True) if c)

    def _masks(self, label: str, j: int, count: int) -> np.ndarray:
        t = np.uint64(self.plan.plain_moduli[j])
        total = np.zeros(count, dtype=np.uint64)
        for other, key in sorted(self.pair_keys.items()):
            mask = uniform_residues(_stream(key, f"{label}/{j}"), int(t), count)
            signed = mask if self.silo_id < other else (t - mask) % t
            total = np.asarray((total + signed) % t, dtype=np.uint64)
        return total

    @property
    def fixed_point(self) -> bool:
        return self.plan.weights == "fixed_point"

    def _encryptor(self, j: int) -> Any:
        if j not in self._encryptors:
            self._encryptors[j] = encryptor(self.contexts[j], self.public_keys[j])
        return self._encryptors[j]

    def counts(self) -> list[int]:
        """This silo's count of every public subject: its input to the fixed-point weights'
        chain, in which it multiplies each subject's ciphertext by ``X^count``."""
        return [int(self.histogram.get(a, 0)) for a in self.subject_ids]

    def masked_histogram(self) -> list[np.ndarray]:
        """Per prime: ``r_a n_{s,a} + masks mod t`` for every public subject."""
        out = []
        for j, t in enumerate(self.plan.plain_moduli):
            counts = [int(self.histogram.get(a, 0)) for a in self.subject_ids]
            blinded = np.array(
                [r * c % t for r, c in zip(self._blinds[j], counts, strict=True)], dtype=np.uint64
            )
            out.append((blinded + self._masks("histogram", j, len(counts))) % np.uint64(t))
        return out

    def weighted_sum(
        self,
        weights: Sequence[Sequence[Any]],
        deltas: Mapping[Hashable, np.ndarray],
        encoded_noise: Sequence[int],
        round_index: int,
        sampling_rate: float | None = None,
    ) -> list[list[Any]]:
        """Per prime and block, this silo's masked, re-randomised, flooded ciphertext. With
        ``sampling_rate`` the silos sample: subjects outside the round's sample are left out
        (weight 0) and need no delta."""
        plan, enc = self.plan, self.plan.encoding
        n = plan.params.poly_degree
        dim = plan.dim
        own = [a for a in self.subject_ids if int(self.histogram.get(a, 0)) > 0]
        if sampling_rate is not None:
            sample = self.subject_sample(round_index, sampling_rate)
            own = [a for a in own if a in sample]
        missing = [a for a in own if a not in deltas]
        if missing:
            raise ValueError(f"Silo {self.silo_id}: no delta for subject(s) {missing[:5]}.")
        index = {a: i for i, a in enumerate(self.subject_ids)}
        rows = []
        for a in own:
            row = np.asarray(deltas[a], dtype=np.float64)
            if row.shape != (dim,):
                raise ValueError(f"Expected a delta of shape ({dim},) for {a!r}, got {row.shape}.")
            rows.append(enc.encode_deltas_array(row))
        noise = [int(v) for v in enc.check_encoded_noise(encoded_noise)]
        if len(noise) != dim:
            raise ValueError(f"Expected {dim} encoded noise values, got {len(noise)}.")
        out: list[list[Any]] = []
        for j, ctx in enumerate(self.contexts):
            t = ctx.plain_modulus
            ev = ctx.evaluator
            level, _ = ctx.level(plan.level_drop)  # the weights' level
            acc: list[Any] = [None] * plan.blocks
            tmp = new_ciphertext(ctx)
            for a, e in zip(own, rows, strict=True):
                i = index[a]
                if self.fixed_point:  # the weight floor(2^k/n_a) holds L = 2^k already
                    scalar = int(self.histogram[a]) * enc.num_silos % t
                else:
                    scalar = self._blinds[j][i] * int(self.histogram[a]) * enc.multiplier % t
                values = mulmod(np.mod(e, t).astype(np.uint64), scalar, t)
                lifted = new_ciphertext(ctx)
                ev.transform_to_ntt(weights[j][i], lifted)
                for b in range(plan.blocks):
                    chunk = values[b * n : (b + 1) * n]
                    if not chunk.any():  # adds nothing (and SEAL refuses a zero product)
                        continue
                    plain = ctx.plaintext(chunk)
                    ev.transform_to_ntt_inplace(plain, level)
                    if acc[b] is None:
                        acc[b] = new_ciphertext(ctx)
                        ev.multiply_plain(lifted, plain, acc[b])
                    else:
                        ev.multiply_plain(lifted, plain, tmp)
                        ev.add_inplace(acc[b], tmp)
            extra = (
                np.array([v % t for v in noise], dtype=np.uint64)
                + self._masks(f"round/{round_index}", j, dim)
            ) % np.uint64(t)
            encryptor_j = self._encryptor(j)
            blocks = []
            for b in range(plan.blocks):
                zero = new_ciphertext(ctx)
                encryptor_j.encrypt_zero(level, zero)
                if acc[b] is None:
                    ct = zero
                else:
                    ct = acc[b]
                    ev.transform_from_ntt_inplace(ct)
                    ev.add_inplace(ct, zero)
                ev.add_plain_inplace(ct, ctx.plaintext(extra[b * n : (b + 1) * n]))
                ev.add_inplace(ct, ctx.flooding(self.source, plan.flood_log2, plan.level_drop))
                blocks.append(ct)
            out.append(blocks)
        return out


class BfvServer:
    """The key holder: BFV keys per prime, the inverted blinded counts (exact weights) or the
    Galois keys of the trace (fixed-point weights), the aggregate."""

    def __init__(self, plan: BfvPlan, subject_ids: tuple[Hashable, ...]) -> None:
        self.plan = plan
        self.subject_ids = subject_ids
        params = plan.params
        self.contexts = tuple(
            BfvContext(params.poly_degree, params.coeff_bits, t) for t in plan.plain_moduli
        )
        self.keys = BfvKeyPair.generate(self.contexts)
        self.galois_keys: tuple[Any, ...] = ()
        if plan.weights == "fixed_point":
            elements = trace_elements(params.poly_degree)
            self.galois_keys = tuple(
                galois_keys(ctx, sk, elements)
                for ctx, sk in zip(self.contexts, self.keys.secret_keys, strict=True)
            )
        self._inverses: list[list[int]] | None = None
        self._histograms: list[list[np.ndarray]] = []

    @property
    def public_keys(self) -> tuple[Any, ...]:
        return self.keys.public_keys

    def receive_histogram(self, masked: list[np.ndarray]) -> None:
        if len(masked) != len(self.plan.plain_moduli):
            raise ProtocolError(f"Expected {len(self.plan.plain_moduli)} residue vectors.")
        self._histograms.append(masked)

    def finish_setup(self, num_silos: int) -> None:
        if len(self._histograms) != num_silos:
            raise SiloDropoutError([], 0)
        inverses = []
        for j, t in enumerate(self.plan.plain_moduli):
            sums = np.zeros(len(self.subject_ids), dtype=object)
            for h in self._histograms:
                sums = sums + h[j].astype(object)
            row = []
            for v in sums:
                v = int(v) % t
                # n_a = 0 (no record anywhere, as in the Paillier protocol): weight 0
                row.append(pow(v, -1, t) if v else 0)
            inverses.append(row)
        self._inverses = inverses

    def encrypt_weights(self, sampled: Collection[Hashable] | None = None) -> list[list[Any]]:
        """Per prime, ``Enc((r_a n_a)^-1)`` (a constant polynomial) for every public subject
        (``Enc(0)`` for subjects outside ``sampled``)."""
        if self.plan.weights == "fixed_point":
            raise ProtocolError(
                "With fixed-point weights the silos compute the weights (chain of monomials); "
                "the server encrypts none, so it cannot hide a sample of its own in them."
            )
        if self._inverses is None:
            raise ProtocolError("Set-up is not finished.")
        out = []
        for ctx, pk, row in zip(self.contexts, self.public_keys, self._inverses, strict=True):
            enc_j = encryptor(ctx, pk)
            cts = []
            for a, inv in zip(self.subject_ids, row, strict=True):
                value = inv if sampled is None or a in sampled else 0
                ct = new_ciphertext(ctx)
                enc_j.encrypt(ctx.constant(value), ct)
                cts.append(ct)
            out.append(cts)
        return out

    def aggregate(self, replies: Sequence[list[list[Any]]]) -> np.ndarray:
        """Adds every silo's ciphertexts, decrypts each prime and block, recombines by the CRT
        and decodes; raises ValueOutOfRangeError on an inconsistent aggregate."""
        plan = self.plan
        moduli = plan.plain_moduli
        big_t = plan.encoding.modulus
        residues = []
        for j, ctx in enumerate(self.contexts):
            dec = decryptor(ctx, self.keys.secret_keys[j])
            parts = []
            for b in range(plan.blocks):
                acc = replies[0][j][b]
                for reply in replies[1:]:
                    ctx.evaluator.add_inplace(acc, reply[j][b])
                plain = new_plaintext()
                dec.decrypt(acc, plain)
                parts.append(ctx.coefficients(plain))
            residues.append(np.concatenate(parts)[: plan.dim].astype(object))
        total = np.zeros(plan.dim, dtype=object)
        for t, r in zip(moduli, residues, strict=True):
            cofactor = big_t // t
            total = total + r * (cofactor * pow(cofactor, -1, t))
        total = total % big_t
        half = big_t // 2
        return np.array(
            [plan.encoding.decode_signed(int(v) - big_t if v > half else int(v)) for v in total],
            dtype=np.float64,
        )


def authenticated_setup(
    silos: Sequence[int], root: RandomSource
) -> tuple[dict[int, dict[int, bytes]], dict[int, bytes]]:
    """The Paillier protocol's set-up, played in one process: every silo signs an X25519 key
    share with its Ed25519 identity key, every silo checks every peer's signature and derives
    the pairwise keys, the lowest silo seals a fresh seed for each other silo
    (ChaCha20-Poly1305), which opens it. Returns each silo's pairwise mask keys and seed."""
    silos = tuple(sorted(silos))
    session_id = root.token_bytes(16)
    sources = {s: ChaCha20Prg(root.token_bytes(32)) for s in silos}
    identities = {s: generate_identity(sources[s]) for s in silos}
    registry = {s: identities[s].public_bytes for s in silos}  # registered out of band
    dh = {s: generate_dh_keypair(sources[s]) for s in silos}
    shares = {
        s: (dh[s].public_bytes, identities[s].sign_key_share(session_id, s, dh[s].public_bytes))
        for s in silos
    }  # relayed by the server as a key directory
    pairs: dict[int, dict[int, Any]] = {s: {} for s in silos}
    for s in silos:
        for peer, (public, signature) in shares.items():
            if peer == s:
                continue
            verify_key_share(registry[peer], signature, session_id, peer, public)
            pairs[s][peer] = derive_pairwise_keys(s, dh[s], peer, public, session_id=session_id)
    leader = min(silos)
    seed = sources[leader].token_bytes(SEED_BYTES)
    seeds = {leader: seed}
    for s in silos:
        if s != leader:
            nonce, sealed = seal_seed(
                pairs[leader][s],
                seed,
                session_id=session_id,
                sender=leader,
                recipient=s,
                source=sources[leader],
            )
            seeds[s] = open_seed(
                pairs[s][leader], nonce, sealed, session_id=session_id, sender=leader, recipient=s
            )
    masks = {s: {peer: k.mask_key for peer, k in pairs[s].items()} for s in silos}
    return masks, seeds


class BfvWeightingSession:
    """Server and silos in one process, BFV arithmetic (tests, benchmarks). The set-up is the
    Paillier protocol's (identity-signed X25519 key shares, pairwise keys, a sealed shared
    seed: :func:`authenticated_setup`), played in one process rather than by messages;
    ``setup``: that set-up's result when it has already been played (each silo's pairwise
    mask keys and seed)."""

    def __init__(
        self,
        histograms: Mapping[int, Mapping[Hashable, int]],
        *,
        n_max: int,
        dim: int,
        params: BfvParameters | None = None,
        subject_ids: Sequence[Hashable] | None = None,
        delta_bound: float = 1.0,
        noise_bound: float = 1e6,
        precision: float = 1e-10,
        source: RandomSource | None = None,
        setup: tuple[Mapping[int, Mapping[int, bytes]], Mapping[int, bytes]] | None = None,
        weights: str = "exact",
        progress: Callable[[str], None] | None = None,
        workers: int | None = None,
    ) -> None:
        silos = tuple(sorted(histograms))
        if len(silos) < 2:
            raise ValueError(f"Expected >= 2 silos, got {list(silos)}.")
        subjects = (
            tuple(subject_ids)
            if subject_ids is not None
            else tuple(sorted({a for h in histograms.values() for a in h}, key=repr))
        )
        totals: dict[Hashable, int] = {}
        for h in histograms.values():
            for a, c in h.items():
                totals[a] = totals.get(a, 0) + int(c)
        over = {a: c for a, c in totals.items() if c > n_max}
        if over:
            worst = max(over, key=lambda a: over[a])
            raise SubjectBoundError(
                f"{len(over)} subject(s) exceed n_max={n_max} records in total (e.g. "
                f"{worst!r} with {over[worst]})."
            )
        root = source if source is not None else SystemRandomSource()
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.params = params if params is not None else BfvParameters()
        self.plan = plan_bfv_round(
            self.params,
            ciphertext_primes=ciphertext_primes(self.params.poly_degree, self.params.coeff_bits),
            n_max=n_max,
            num_subjects=len(subjects),
            num_silos=len(silos),
            dim=dim,
            delta_bound=delta_bound,
            noise_bound=noise_bound,
            precision=precision,
            weights=weights,
        )
        self._progress = progress
        self._workers = workers
        self.server = BfvServer(self.plan, subjects)
        self._tick("keygen", t0)
        t0 = time.perf_counter()
        masks, seeds = setup if setup is not None else authenticated_setup(silos, root)
        if sorted(masks) != list(silos) or sorted(seeds) != list(silos):
            raise ValueError(f"Expected a set-up for silos {list(silos)}, got {sorted(seeds)}.")
        self._tick("key_exchange", t0)
        t0 = time.perf_counter()
        self.silos = {
            s: BfvSilo(
                s,
                self.plan,
                self.server.contexts,
                self.server.public_keys,
                histograms[s],
                subjects,
                masks[s],
                seeds[s],
                ChaCha20Prg(root.token_bytes(32)),
            )
            for s in silos
        }
        if self.plan.weights == "exact":  # fixed-point weights need no histogram at the server
            for silo in self.silos.values():
                self.server.receive_histogram(silo.masked_histogram())
            self.server.finish_setup(len(silos))
        self._tick("histogram", t0)
        self._round = 0
        self._weights: list[list[Any]] | None = None

    def _tick(self, name: str, start: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def weights(self) -> list[list[Any]]:
        """Per prime, the encrypted weight of every public subject, the same every round:
        the server's ``Enc((r_a n_a)^-1)`` (exact) or the silos' chain (fixed-point,
        :mod:`~silodp.crypto.bfv.fixed_weights`: the silos in order, the last one finishing);
        computed once."""
        if self._weights is not None:
            return self._weights
        t0 = time.perf_counter()
        if self.plan.weights == "exact":
            self._weights = self.server.encrypt_weights()
            self._tick("server_weights", t0)
            return self._weights
        plan, ctxs = self.plan, self.server.contexts
        k = plan.encoding.weight_bits
        assert k is not None  # fixed-point weights
        specs = [
            fixed_weights.ChainSpec(
                plan.params.poly_degree,
                plan.params.coeff_bits,
                ctx.plain_modulus,
                plan.encoding.n_max,
                k,
                plan.level_drop,
                ctx.to_bytes(pk),
            )
            for ctx, pk in zip(ctxs, self.server.public_keys, strict=True)
        ]
        # processes pay off only for a larger chain
        work = len(self.server.subject_ids) * len(specs)
        workers = resolve_workers(self._workers, work, min_items=PARALLEL_MIN_WORK)
        out = fixed_weights.compute_weights(
            ctxs,
            specs,
            self.server.galois_keys,
            [silo.counts() for silo in self.silos.values()],  # the chain in silo order
            workers=workers,
            progress=self._progress,
        )
        self._weights = out
        self.server.galois_keys = ()  # needed for the weights only (about 0.25 GB a prime)
        self._tick("silo_weights", t0)
        return out

    def run_round(
        self,
        deltas: Mapping[int, Mapping[Hashable, np.ndarray]],
        *,
        noise: Mapping[int, np.ndarray] | None = None,
        encoded_noise: Mapping[int, Sequence[int]] | None = None,
        sampled: Collection[Hashable] | None = None,
        silo_sampling_rate: float | None = None,
    ) -> np.ndarray:
        """One round: the decrypted ``sum_{s,a} (n_{s,a}/n_a) Delta_{s,a} + sum_s noise_s``.

        Sub-sampling by the server (``sampled``: ``Enc(0)`` outside it, fresh weights this
        round) or by the silos (``silo_sampling_rate``, from the shared seed). Without a
        server sample the weights do not change between rounds, so the server encrypts and
        sends them once and the silos reuse them (the silos' messages are re-randomised and
        flooded every round regardless)."""
        if sorted(deltas) != sorted(self.silos):
            raise ValueError(f"Deltas for silos {sorted(deltas)}, expected {sorted(self.silos)}.")
        if sampled is not None and silo_sampling_rate is not None:
            raise ValueError("Sample either at the server or at the silos, not both.")
        enc = self.plan.encoding
        if sampled is not None:
            t0 = time.perf_counter()
            weights = self.server.encrypt_weights(sampled)
            self._tick("server_weights", t0)
        else:
            weights = self.weights()
        t0 = time.perf_counter()
        replies = []
        for s, silo in self.silos.items():
            if encoded_noise is not None and s in encoded_noise:
                coded = list(encoded_noise[s])
            elif noise is not None and s in noise:
                coded = enc.encode_noise(noise[s])
            else:
                coded = [0] * self.plan.dim
            replies.append(
                silo.weighted_sum(
                    weights, deltas[s], coded, self._round, sampling_rate=silo_sampling_rate
                )
            )
        self._tick("silo_weighting", t0)
        t0 = time.perf_counter()
        out = self.server.aggregate(replies)
        self._tick("aggregation", t0)
        self._round += 1
        return out
