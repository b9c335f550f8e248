"""The BFV backend of the weighting protocol: the decrypted sum equals the clear weighted sum,
tampering, a missing silo and a wrong key are detected, parameters are validated, and what
the key holder sees of one silo is masked and flooded."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from silodp.crypto.bfv import BfvParameters, BfvWeightingSession, batching_primes, plan_bfv_round
from silodp.crypto.bfv.backend import (
    BfvContext,
    BfvKeyPair,
    ciphertext_primes,
    decryptor,
    encryptor,
    new_ciphertext,
    new_plaintext,
)
from silodp.crypto.bfv.weighting import mulmod, uniform_residues
from silodp.crypto.errors import EncodingOverflowError, SubjectBoundError, ValueOutOfRangeError
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.protocol import plaintext_weighted_sum

PRIMES = ciphertext_primes(8192, BfvParameters().coeff_bits)


def _problem(seed: int, silos: int, subjects: int, dim: int, n_max: int):
    rng = np.random.default_rng(seed)
    hist: dict[int, dict[int, int]] = {s: {} for s in range(silos)}
    for a in range(subjects):
        total = int(rng.integers(1, n_max + 1))
        cut = np.sort(rng.integers(0, total + 1, silos - 1))
        parts = np.diff(np.concatenate([[0], cut, [total]]))
        for s in range(silos):
            if parts[s]:
                hist[s][a] = int(parts[s])
    deltas = {
        s: {a: rng.uniform(-1.0, 1.0, dim) * rng.choice([1.0, 1e-6]) for a in hist[s]}
        for s in range(silos)
    }
    noise = {s: rng.normal(0.0, 3.0, dim) for s in range(silos)}
    return hist, deltas, noise


def _tolerance(subjects: int, silos: int, ref: np.ndarray) -> float:
    return (subjects + silos) * 0.5e-10 + 4 * np.finfo(float).eps * float(np.abs(ref).max() + 1)


def _session(hist, dim, n_max, seed=0, **kw):
    return BfvWeightingSession(
        hist, n_max=n_max, dim=dim, noise_bound=100.0, source=ChaCha20Prg(bytes([seed]) * 32), **kw
    )


@pytest.mark.parametrize(
    ("seed", "silos", "subjects", "dim", "n_max"),
    [(0, 2, 1, 1, 1), (1, 3, 6, 9000, 20), (2, 4, 12, 5, 250)],
)
def test_decrypted_sum_equals_the_clear_weighted_sum(seed, silos, subjects, dim, n_max) -> None:
    hist, deltas, noise = _problem(seed, silos, subjects, dim, n_max)
    session = _session(hist, dim, n_max, seed)
    got = session.run_round(deltas, noise=noise)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    assert got.shape == (dim,)
    assert np.max(np.abs(got - ref)) <= _tolerance(subjects, silos, ref)
    # a second round (fresh masks and flooding) decrypts to the same value
    again = session.run_round(deltas, noise=noise)
    assert np.max(np.abs(again - ref)) <= _tolerance(subjects, silos, ref)


def test_subsampled_subjects_contribute_zero_and_encoded_noise_is_exact() -> None:
    hist, deltas, _ = _problem(3, 3, 8, 6, 30)
    session = _session(hist, 6, 30)
    sampled = {0, 2, 5}
    coded = {s: [s + 1, -(s + 2), 0, 7, -7, 3] for s in hist}
    got = session.run_round(deltas, encoded_noise=coded, sampled=sampled)
    ref = plaintext_weighted_sum(deltas, hist, sampled=sampled)
    extra = np.sum([np.array(v, dtype=float) for v in coded.values()], axis=0)
    extra /= session.plan.encoding.noise_scale
    assert np.max(np.abs(got - (ref + extra))) <= _tolerance(8, 3, ref)


def _replies(session, deltas):
    weights = session.server.encrypt_weights()
    zero = [0] * session.plan.dim
    return [silo.weighted_sum(weights, deltas[s], zero, 0) for s, silo in session.silos.items()]


def test_tampered_missing_and_wrongly_keyed_aggregates_are_refused() -> None:
    hist, deltas, _ = _problem(4, 3, 5, 4, 16)
    session = _session(hist, 4, 16)
    server = session.server
    ctx = server.contexts[0]
    # tampered: one silo's ciphertext gains an encryption of a random plaintext
    replies = _replies(session, deltas)
    junk = new_ciphertext(ctx)
    encryptor(ctx, server.public_keys[0]).encrypt(ctx.plaintext([12345, 1, 2, 3]), junk)
    ctx.evaluator.add_inplace(replies[1][0][0], junk)
    with pytest.raises(ValueOutOfRangeError, match="exceeds"):
        server.aggregate(replies)
    # a missing silo: its masks do not cancel
    with pytest.raises(ValueOutOfRangeError, match="exceeds"):
        server.aggregate(_replies(session, deltas)[:2])
    # a wrong key: decryption gives garbage
    honest = _replies(session, deltas)
    server.keys = BfvKeyPair.generate(server.contexts)
    with pytest.raises(ValueOutOfRangeError, match="exceeds"):
        server.aggregate(honest)


def test_one_silos_ciphertext_decrypts_to_a_masked_value() -> None:
    hist, deltas, _ = _problem(5, 3, 5, 4, 16)
    session = _session(hist, 4, 16)
    server = session.server
    replies = _replies(session, deltas)
    alone = plaintext_weighted_sum({0: deltas[0]}, hist)
    with pytest.raises(ValueOutOfRangeError):
        got = server.aggregate([replies[0]])
        assert np.max(np.abs(got - alone)) > 1.0  # pragma: no cover - w.p. 2^-32
    # and its noise is flooded: far less budget left than after the products alone
    ctx = server.contexts[0]
    dec = decryptor(ctx, server.keys.secret_keys[0])
    flooded = replies[0][0][0]
    fresh = new_ciphertext(ctx)
    encryptor(ctx, server.public_keys[0]).encrypt(ctx.constant(1), fresh)
    assert dec.invariant_noise_budget(fresh) - dec.invariant_noise_budget(flooded) >= 100


def _c1(ct) -> np.ndarray:
    """The second component ``c1`` of a (non-NTT, two-component) ciphertext: its
    coefficients modulo every prime of its level."""
    assert ct.size() == 2 and not ct.is_ntt_form()
    size = ct.coeff_modulus_size() * ct.poly_modulus_degree()
    data = ct.dyn_array()
    return np.array([data.at(i) for i in range(size, 2 * size)], dtype=np.uint64)


def test_each_message_is_re_randomised_by_a_fresh_encryption_of_zero() -> None:
    """A silo's ``c1`` is ``sum_a c1(w_a) P_a + c1(z)``: the server's own weight ciphertexts
    times the silo's blinded data ``P_a``, plus the ``c1`` of a fresh ``Enc(0)`` ``z`` (flooding,
    noise and masks only touch ``c0``). Were one ``z`` reused, the difference of two messages'
    ``c1`` would be ``sum_a c1(w_a) (P_a - P'_a)``: known bases, the silo's data. Two silos
    with the same counts and deltas, a delta repeating every ``N`` coordinates (two blocks
    with the same ``P_a``) and two rounds (the same weights) give eight messages per prime
    whose ``P_a`` are all equal, so their ``c1`` differ only by their ``z``: all must differ,
    in almost every coefficient."""
    n = BfvParameters().poly_degree
    hist = {0: {"a": 1, "b": 2}, 1: {"a": 1, "b": 2}}
    rng = np.random.default_rng(8)
    same = {a: np.tile(rng.uniform(-1.0, 1.0, n), 2) for a in ("a", "b")}
    session = _session(hist, 2 * n, 4)
    assert session.plan.blocks == 2
    weights = session.weights()
    zero = [0] * (2 * n)
    c1s = [[] for _ in session.plan.plain_moduli]
    for round_index in (0, 1):
        for silo in session.silos.values():
            reply = silo.weighted_sum(weights, same, zero, round_index)
            for j, blocks in enumerate(reply):
                c1s[j].extend(_c1(ct) for ct in blocks)
    for per_prime in c1s:
        assert len(per_prime) == 8
        for x in range(8):
            for y in range(x):
                assert np.mean(per_prime[x] == per_prime[y]) < 0.01


def test_masked_messages_hide_each_silo_and_change_every_round() -> None:
    """The round masks are derived per round (label ``round/<t>``): with the same masks every
    round, the difference of a silo's decrypted messages of two rounds would be that of its
    weighted sums, in the clear. With identical inputs in rounds 0 and 1, every coordinate of
    each silo's decrypted message changes (mod every prime), only by the masks, and a single
    silo's message recombines (CRT) to nothing decodable (as with Paillier,
    ``test_masked_sums_hide_each_silo_and_change_every_round``)."""
    hist, deltas, _ = _problem(9, 2, 3, 3, 20)
    session = _session(hist, 3, 20)
    server, plan = session.server, session.plan
    enc = plan.encoding
    weights = session.weights()
    coded = {s: [s + 1, -(s + 2), 7] for s in hist}  # the same noise both rounds

    def decrypted(reply) -> list[np.ndarray]:  # per prime, the residues of the dim coordinates
        out = []
        for j, ctx in enumerate(server.contexts):
            plain = new_plaintext()
            decryptor(ctx, server.keys.secret_keys[j]).decrypt(reply[j][0], plain)
            out.append(ctx.coefficients(plain)[: plan.dim])
        return out

    big_t = enc.modulus
    for s, silo in session.silos.items():
        first = decrypted(silo.weighted_sum(weights, deltas[s], coded[s], 0))
        second = decrypted(silo.weighted_sum(weights, deltas[s], coded[s], 1))
        for j, t in enumerate(plan.plain_moduli):
            assert np.all(first[j] != second[j])  # fresh masks per round
            unmasked = [
                (msg[j] + np.uint64(t) - silo._masks(f"round/{r}", j, plan.dim)) % np.uint64(t)
                for r, msg in ((0, first), (1, second))
            ]
            np.testing.assert_array_equal(*unmasked)  # they differ by the masks only
        # a single silo's message is uniformly masked: nowhere near a decodable value
        total = (
            sum(
                first[j].astype(object) * (big_t // t * pow(big_t // t, -1, t))
                for j, t in enumerate(plan.plain_moduli)
            )
            % big_t
        )
        for v in total:
            signed = int(v) - big_t if v > big_t // 2 else int(v)
            assert abs(signed) > enc.aggregate_bound


def test_flooding_leaves_the_sum_of_many_silos_decryptable() -> None:
    plan = plan_bfv_round(
        BfvParameters(),
        ciphertext_primes=PRIMES,
        n_max=32,
        num_subjects=1000,
        num_silos=5,
        dim=105_866,
    )
    assert plan.blocks == 13
    assert 2**plan.flood_log2 >= plan.silo_noise_bound * 8192 * plan.ciphertexts_per_silo << 40
    q = math.prod(PRIMES[:-1])
    t = max(plan.plain_moduli)
    assert 2 * t * 5 * (plan.silo_noise_bound + 2**plan.flood_log2 + 1) < q
    assert math.prod(plan.plain_moduli) > (2 * plan.encoding.aggregate_bound) << 32
    # the flooded ciphertext of a real context keeps a positive budget after summing 5 of them
    ctx = BfvContext(8192, BfvParameters().coeff_bits, t)
    keys = BfvKeyPair.generate([ctx])
    acc = None
    src = ChaCha20Prg(bytes(32))
    for _ in range(5):
        ct = new_ciphertext(ctx)
        encryptor(ctx, keys.public_keys[0]).encrypt(ctx.constant(3), ct)
        ctx.evaluator.add_inplace(ct, ctx.flooding(src, plan.flood_log2))
        if acc is None:
            acc = ct
        else:
            ctx.evaluator.add_inplace(acc, ct)
    out = new_plaintext()
    decryptor(ctx, keys.secret_keys[0]).decrypt(acc, out)
    assert ctx.coefficients(out)[0] == 15


def test_secret_polynomials_do_not_stay_in_the_scratch_file() -> None:
    """Plaintexts (a silo's blinded deltas) and flooding polynomials pass through a scratch file
    to reach SEAL; it is emptied after every load and save, and removed with the context."""
    import os

    t = batching_primes(8192, 32, 1, frozenset(PRIMES))[0]
    ctx = BfvContext(8192, BfvParameters().coeff_bits, t)
    path = ctx._path
    plain = ctx.plaintext(np.arange(1, 9, dtype=np.uint64))
    assert os.path.getsize(path) == 0
    assert list(ctx.coefficients(plain)[:8]) == list(range(1, 9))
    ctx.flooding(ChaCha20Prg(bytes(32)), 60)
    assert os.path.getsize(path) == 0
    blob = ctx.to_bytes(plain)
    assert len(blob) > 8 and os.path.getsize(path) == 0
    del ctx
    assert not os.path.exists(path)


def test_parameter_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"poly_degree=4096 in \[8192, 16384\]"):
        BfvParameters(poly_degree=4096)
    with pytest.raises(ValueError, match="coeff_bits=.*at most 218 bits"):
        BfvParameters(coeff_bits=(60, 60, 60, 60))
    with pytest.raises(ValueError, match=r"flood_bits=20 to be an int in \[40, 128\]"):
        BfvParameters(flood_bits=20)
    with pytest.raises(ValueError, match=r"bits=70 in \[20, 60\]"):
        batching_primes(8192, 70, 1)
    with pytest.raises(EncodingOverflowError, match="expected a larger poly_degree"):
        plan_bfv_round(
            BfvParameters(),
            ciphertext_primes=PRIMES,
            n_max=4,
            num_subjects=10**15,
            num_silos=3,
            dim=10,
        )
    with pytest.raises(ValueError, match="dim=0"):
        plan_bfv_round(
            BfvParameters(), ciphertext_primes=PRIMES, n_max=4, num_subjects=2, num_silos=2, dim=0
        )
    with pytest.raises(SubjectBoundError, match="n_max=3"):
        BfvWeightingSession({0: {"a": 2}, 1: {"a": 2}}, n_max=3, dim=2)
    session = _session({0: {"a": 1}, 1: {"a": 1}}, 2, 2)
    with pytest.raises(ValueOutOfRangeError, match="delta value 2.0 exceeds the bound 1.0"):
        session.run_round({0: {"a": np.array([2.0, 0.0])}, 1: {"a": np.zeros(2)}})
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        session.run_round({0: {"a": np.zeros(3)}, 1: {"a": np.zeros(2)}})


def test_primes_are_distinct_from_the_ciphertext_primes_and_public() -> None:
    plan = plan_bfv_round(
        BfvParameters(), ciphertext_primes=PRIMES, n_max=200, num_subjects=50, num_silos=4, dim=9
    )
    again = plan_bfv_round(
        BfvParameters(), ciphertext_primes=PRIMES, n_max=200, num_subjects=50, num_silos=4, dim=9
    )
    assert plan.plain_moduli == again.plain_moduli
    assert len(set(plan.plain_moduli)) == len(plan.plain_moduli)
    assert not set(plan.plain_moduli) & set(PRIMES)
    assert all(p % (2 * 8192) == 1 for p in plan.plain_moduli)


def test_mulmod_and_uniform_residues() -> None:
    rng = np.random.default_rng(0)
    for t in (65537, 68_718_428_161, (1 << 51) - 129):
        a = rng.integers(0, t, 2000, dtype=np.uint64)
        b = int(rng.integers(0, t))
        assert [int(v) for v in mulmod(a, b, t)] == [int(x) * b % t for x in a]
    with pytest.raises(ValueError, match="modulus"):
        mulmod(np.zeros(1, dtype=np.uint64), 1, 1 << 53)
    r = uniform_residues(ChaCha20Prg(bytes(32)), 1000003, 20000)
    assert r.max() < 1000003 and abs(float(r.mean()) / 1000003 - 0.5) < 0.01


def test_silodp_crypto_imports_without_tenseal_or_torch() -> None:
    code = (
        "import sys, silodp.crypto, silodp.crypto.protocol; "
        "assert 'tenseal' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    bfv = "import sys, silodp.crypto.bfv; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", bfv], check=True)


def test_silos_sample_from_the_shared_seed_and_reuse_the_weights() -> None:
    hist, deltas, _ = _problem(6, 3, 10, 5, 12)
    session = _session(hist, 5, 12)
    silos = list(session.silos.values())
    sample = silos[0].subject_sample(0, 0.5)
    assert all(silo.subject_sample(0, 0.5) == sample for silo in silos)
    assert silos[0].subject_sample(1, 0.5) != sample or silos[0].subject_sample(2, 0.5) != sample
    only_sampled = {s: {a: v for a, v in d.items() if a in sample} for s, d in deltas.items()}
    got = session.run_round(only_sampled, silo_sampling_rate=0.5)
    ref = plaintext_weighted_sum(deltas, hist, sampled=sample)
    assert np.max(np.abs(got - ref)) <= _tolerance(10, 3, ref)
    first = session._weights
    session.run_round(deltas)
    assert session._weights is first  # encrypted once, reused while the server does not sample
    with pytest.raises(ValueError, match="not both"):
        session.run_round(deltas, sampled={0}, silo_sampling_rate=0.5)


def test_set_up_agrees_pairwise_keys_and_one_seed_by_signed_x25519() -> None:
    hist, _, _ = _problem(7, 4, 6, 3, 10)
    session = _session(hist, 3, 10)
    silos = session.silos
    assert len({silo.seed for silo in silos.values()}) == 1
    for s, silo in silos.items():
        assert sorted(silo.pair_keys) == [o for o in silos if o != s]
        for o, key in silo.pair_keys.items():
            assert key == silos[o].pair_keys[s]
    keys = {k for silo in silos.values() for k in silo.pair_keys.values()}
    assert len(keys) == 4 * 3 // 2  # one key per pair, all distinct
    assert "key_exchange" in session.timings


def test_a_silos_repr_shows_no_secret() -> None:
    """The histogram, pairwise mask keys, shared seed and random source stay out of repr."""
    from silodp.crypto.bfv.weighting import BfvSilo

    shown = {f.name for f in dataclasses.fields(BfvSilo) if f.repr}
    assert shown.isdisjoint({"histogram", "pair_keys", "seed", "source", "_blinds"})
    assert "silo_id" in shown
