"""The private weighting protocol end to end: correctness, privacy of the messages,
sub-sampling and dropout."""

from __future__ import annotations

from fractions import Fraction

import gmpy2
import numpy as np
import pytest

from silodp.crypto.errors import (
    EncodingOverflowError,
    InsecureKeyError,
    SiloDropoutError,
    StageError,
    SubjectBoundError,
    ValueOutOfRangeError,
)
from silodp.crypto.paillier import generate_keypair
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.protocol import (
    ProtocolConfig,
    Server,
    ServerStage,
    Silo,
    WeightingSession,
    plaintext_weighted_sum,
    run_weighting_round,
)
from silodp.crypto.weighted_sum import half_decryption_suffices

BITS = 512


def _problem(seed: int, silos: int, subjects: int, dim: int, n_max: int, *, zero_frac=0.3):
    rng = np.random.default_rng(seed)
    hist: dict[int, dict[int, int]] = {s: {} for s in range(silos)}
    for a in range(subjects):
        total = int(rng.integers(1, n_max + 1))
        cut = np.sort(rng.integers(0, total + 1, silos - 1))
        parts = np.diff(np.concatenate([[0], cut, [total]]))
        for s in range(silos):
            if parts[s] and rng.random() > zero_frac / 2:
                hist[s][a] = int(parts[s])
        if not any(a in hist[s] for s in range(silos)):
            hist[int(rng.integers(silos))][a] = total
    deltas = {
        s: {a: rng.uniform(-1.0, 1.0, dim) * rng.choice([1.0, 1e-6]) for a in hist[s]}
        for s in range(silos)
    }
    noise = {s: rng.normal(0.0, 3.0, dim) for s in range(silos)}
    return hist, deltas, noise


def _tolerance(subjects: int, silos: int, ref: np.ndarray) -> float:
    return (subjects + silos) * 0.5e-10 + 4 * np.finfo(float).eps * float(np.abs(ref).max() + 1)


def _config(silos: int, subjects: int, n_max: int, **kw: object) -> ProtocolConfig:
    args: dict = dict(
        silo_ids=tuple(range(silos)),
        subject_ids=tuple(range(subjects)),
        n_max=n_max,
        noise_bound=100.0,
        insecure_test_key_bits=BITS,
        workers=1,
    )
    args.update(kw)
    return ProtocolConfig(**args)


@pytest.mark.parametrize(
    ("seed", "silos", "subjects", "dim", "n_max"),
    [(0, 2, 1, 1, 1), (1, 2, 5, 7, 20), (2, 3, 8, 5, 200), (3, 5, 12, 4, 250), (4, 4, 30, 3, 60)],
)
def test_decrypted_aggregate_equals_plaintext_weighted_sum(seed, silos, subjects, dim, n_max):
    hist, deltas, noise = _problem(seed, silos, subjects, dim, n_max)
    out = run_weighting_round(
        deltas,
        hist,
        n_max=n_max,
        noise=noise,
        noise_bound=100.0,
        insecure_test_key_bits=BITS,
        workers=1,
        source=ChaCha20Prg(bytes([seed]) * 32),
    )
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    assert out.dtype == np.float64 and out.shape == (dim,)
    np.testing.assert_allclose(out, ref, rtol=0, atol=_tolerance(subjects, silos, ref))


def test_half_decryption_is_used_only_when_the_bound_allows() -> None:
    keys = generate_keypair(insecure_test_key_bits=BITS)
    small = _config(3, 8, 20).encoding(keys.public_key.n)
    large = _config(3, 8, 200).encoding(keys.public_key.n)
    assert half_decryption_suffices(keys.private_key, small)
    assert not half_decryption_suffices(keys.private_key, large)


def test_fifty_silos() -> None:
    hist, deltas, noise = _problem(5, 50, 6, 2, 150, zero_frac=0.8)
    out = run_weighting_round(
        deltas, hist, n_max=150, noise=noise, noise_bound=100.0, insecure_test_key_bits=BITS
    )
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    np.testing.assert_allclose(out, ref, rtol=0, atol=_tolerance(6, 50, ref))


def test_weights_are_exact_fractions_of_counts() -> None:
    # one subject split 1:2 over two silos, unit deltas: weights 1/3 and 2/3 exactly
    hist = {0: {"x": 1}, 1: {"x": 2}}
    deltas = {0: {"x": np.array([1.0, -1.0])}, 1: {"x": np.array([1.0, 0.5])}}
    out = run_weighting_round(deltas, hist, n_max=3, insecure_test_key_bits=BITS)
    np.testing.assert_allclose(out, [1.0, 0.0], rtol=0, atol=1e-10)


def test_one_and_two_workers_agree() -> None:
    hist, deltas, noise = _problem(6, 3, 4, 40, 30)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    for kw in ({"workers": 1}, {"workers": 2}):
        out = run_weighting_round(
            deltas,
            hist,
            n_max=30,
            noise=noise,
            noise_bound=100.0,
            insecure_test_key_bits=BITS,
            **kw,
        )
        np.testing.assert_allclose(out, ref, rtol=0, atol=_tolerance(4, 3, ref))


def test_n_max_2000_with_a_3072_bit_key() -> None:
    hist, deltas, noise = _problem(7, 3, 3, 2, 2000)
    hist[0][0] = 2000 - sum(hist[s].get(0, 0) for s in (1, 2))  # one subject exactly at N_max
    deltas[0][0] = np.array([0.5, -0.25])
    keys = generate_keypair(3072, source=ChaCha20Prg(bytes([7]) * 32))
    config = _config(3, 3, 2000, insecure_test_key_bits=None)
    session = WeightingSession(config, hist, keypair=keys, source=ChaCha20Prg(bytes(32)))
    result = session.run_round(deltas, noise=noise)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    np.testing.assert_allclose(result.aggregate, ref, rtol=0, atol=_tolerance(3, 3, ref))


@pytest.mark.slow
def test_2048_bit_key_round() -> None:
    hist, deltas, noise = _problem(8, 3, 10, 20, 1000)
    out = run_weighting_round(deltas, hist, n_max=1000, noise=noise, key_bits=2048)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    np.testing.assert_allclose(out, ref, rtol=0, atol=_tolerance(10, 3, ref))


def test_subject_above_n_max_is_refused_at_setup() -> None:
    hist = {0: {"a": 6, "b": 1}, 1: {"a": 5}}  # n_a = 11 > 10, each silo alone below
    deltas = {0: {"a": np.zeros(2), "b": np.zeros(2)}, 1: {"a": np.zeros(2)}}
    with pytest.raises(SubjectBoundError, match="'a' with 11"):
        run_weighting_round(deltas, hist, n_max=10, insecure_test_key_bits=BITS)
    config = _config(2, 1, 4, subject_ids=("a",))
    with pytest.raises(SubjectBoundError, match="5 records"):
        Silo(0, config, {"a": 5})


def test_insecure_and_overflowing_parameters_are_refused() -> None:
    with pytest.raises(InsecureKeyError):
        _config(2, 2, 10, key_bits=1024, insecure_test_key_bits=None)
    with pytest.raises(EncodingOverflowError):
        run_weighting_round(
            {0: {0: np.zeros(1)}, 1: {0: np.zeros(1)}},
            {0: {0: 1}, 1: {0: 1}},
            n_max=2000,
            insecure_test_key_bits=BITS,
        )
    # a silo expecting a 2048-bit key refuses the server's 512-bit one
    keys = generate_keypair(insecure_test_key_bits=BITS)
    server_cfg = _config(2, 1, 10)
    hello = Server(server_cfg, keypair=keys).hello()
    strict = _config(2, 1, 10, insecure_test_key_bits=None, key_bits=2048)
    with pytest.raises(InsecureKeyError, match="512"):
        Silo(0, strict, {0: 1}).receive_hello(hello)


def test_server_never_sees_an_unmasked_blinded_count() -> None:
    hist, deltas, _ = _problem(9, 3, 10, 2, 50)
    config = _config(3, 10, 50)
    seen: list = []
    # run the set-up by hand to intercept what the server receives
    server = Server(config, source=ChaCha20Prg(bytes([1]) * 32))
    silos = {s: Silo(s, config, hist[s], source=ChaCha20Prg(bytes([s + 2]) * 32)) for s in hist}
    hello = server.hello()
    directory = None
    for silo in silos.values():
        share = silo.receive_hello(hello)
        seen.append(share)
        directory = server.receive_key_share(share)
    assert directory is not None
    sealed = [m for silo in silos.values() for m in silo.receive_directory(directory)]
    for envelope in sealed:
        seen.append(envelope)
        silos[envelope.recipient].receive_seed(server.relay_seed(envelope))
    n = server.public_key.n
    blinds = silos[0]._blinds
    assert all(silo._blinds == blinds for silo in silos.values())  # shared seed -> same r_a
    total = [0] * 10
    for s, silo in silos.items():
        msg = silo.masked_histogram()
        seen.append(msg)
        for a in range(10):
            exposed = blinds[a] * hist[s].get(a, 0) % n
            assert msg.values[a] != exposed
            total[a] = (total[a] + msg.values[a]) % n
        server.receive_histogram(msg)
    for a in range(10):  # masks cancel: the server obtains exactly r_a n_a
        n_a = sum(hist[s].get(a, 0) for s in hist)
        assert total[a] == blinds[a] * n_a % n
        assert server._inverses[a] == pow(blinds[a] * n_a, -1, n)
    # the seed never travels in clear
    seed = silos[0]._seed
    assert seed is not None
    assert not any(seed in getattr(m, "ciphertext", b"") for m in seen)


def _manual_round(session: WeightingSession, deltas, noise, *, skip=(), round_index=None):
    server = session.server
    index = session._next_round if round_index is None else round_index
    session._next_round = index + 1
    weights = server.open_round(index, len(next(iter(noise.values()))))
    replies = {}
    for s, silo in session.silos.items():
        if s in skip:
            continue
        replies[s] = silo.weighted_sum(weights, deltas[s], noise[s])
        server.receive_weighted_sum(replies[s])
    return replies


def test_dropout_aborts_and_leaves_nothing_decryptable() -> None:
    hist, deltas, noise = _problem(10, 3, 5, 4, 40)
    # one coordinate per ciphertext, so each decrypts to one masked coordinate
    config = _config(3, 5, 40, packing=False)
    session = WeightingSession(config, hist, source=ChaCha20Prg(bytes(32)))
    server = session.server
    replies = _manual_round(session, deltas, noise, skip={2})
    assert server.pending == (2,)
    with pytest.raises(SiloDropoutError, match=r"\[2\]") as info:
        server.finish_round()
    assert info.value.missing == (2,) and info.value.round_index == 0
    assert server.stage is ServerStage.READY and server._contrib == {}
    # even decrypting the partial product yields masked garbage, not the partial sum
    key, enc = server._keys.private_key, server.encoding
    n2 = server.public_key.n_squared
    partial = {s: deltas[s] for s in (0, 1)}
    ref = plaintext_weighted_sum(
        partial, {s: hist[s] for s in hist}, noise={s: noise[s] for s in (0, 1)}
    )
    for j in range(4):
        residue = key.decrypt(replies[0].ciphertexts[j] * replies[1].ciphertexts[j] % n2)
        signed = residue - key.public_key.n if residue > key.public_key.n // 2 else residue
        assert abs(signed) > enc.aggregate_bound  # far outside anything decodable
        assert abs(signed / (enc.multiplier * enc.scale) - ref[j]) > 1e6
    # the next round (fresh masks) succeeds with everyone present
    result = session.run_round(deltas, noise=noise)
    full = plaintext_weighted_sum(deltas, hist, noise=noise)
    np.testing.assert_allclose(result.aggregate, full, rtol=0, atol=_tolerance(5, 3, full))
    assert result.round_index == 1


def test_subsampled_subjects_contribute_zero() -> None:
    hist, deltas, noise = _problem(11, 3, 8, 3, 30)
    session = WeightingSession(_config(3, 8, 30), hist, source=ChaCha20Prg(bytes([3]) * 32))
    result = session.run_round(deltas, noise=noise, sampled={1, 4, 5})
    ref = plaintext_weighted_sum(deltas, hist, noise=noise, sampled={1, 4, 5})
    np.testing.assert_allclose(result.aggregate, ref, rtol=0, atol=_tolerance(8, 3, ref))
    assert result.sampled == frozenset({1, 4, 5})
    none = session.run_round(deltas, sampled=set())
    np.testing.assert_allclose(none.aggregate, 0.0, atol=0)
    poisson = session.run_round(deltas, noise=noise, sampling_rate=0.5)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise, sampled=poisson.sampled)
    np.testing.assert_allclose(poisson.aggregate, ref, rtol=0, atol=_tolerance(8, 3, ref))


def test_masked_sums_hide_each_silo_and_change_every_round() -> None:
    hist, deltas, noise = _problem(12, 2, 3, 3, 20)
    config = _config(2, 3, 20, packing=False)  # one coordinate per ciphertext
    session = WeightingSession(config, hist, source=ChaCha20Prg(bytes([4]) * 32))
    key, enc = session.server._keys.private_key, session.server.encoding
    first = _manual_round(session, deltas, noise)
    session.server.finish_round()
    second = _manual_round(session, deltas, noise)
    session.server.finish_round()
    for s in (0, 1):
        own = plaintext_weighted_sum({s: deltas[s]}, hist, noise={s: noise[s]})
        for j in range(3):
            a = key.decrypt(first[s].ciphertexts[j])
            b = key.decrypt(second[s].ciphertexts[j])
            assert a != b  # fresh masks per round
            # a single silo's plaintext is uniformly masked: nowhere near its true value
            signed = enc.codec.centered(a, key.public_key.n)
            assert (
                abs(signed) > enc.aggregate_bound
                or abs(signed / (enc.multiplier * enc.scale) - own[j]) > 1e3
            )


def test_silo_ciphertexts_carry_randomness_the_key_holder_cannot_predict() -> None:
    """Every ciphertext a silo sends is multiplied by a fresh ``r^n``
    (:mod:`~silodp.crypto.rerandomize`). The key holder reads any ciphertext's encryption
    randomness ``rho = c^(n^-1 mod phi) mod n``; without that factor, ``rho`` of parameter ``j``
    would be ``prod_a rho(w_a)^(r_a n_{s,a} M e_{s,a,j})``: the randomness the server chose for
    its own weights raised to the silo's un-noised encoded deltas (the noise and the masks
    enter as ``1 + t n``, of randomness 1), so e.g. its Legendre symbol mod ``p`` shows their
    parity. The test computes that product (with the silo's blinds and deltas) and checks that
    each ciphertext's ``rho`` differs from it by a factor other than 1, a new one each time."""
    hist, deltas, noise = _problem(16, 2, 3, 4, 20)
    config = _config(2, 3, 20, packing=False)  # one coordinate per ciphertext
    session = WeightingSession(config, hist, source=ChaCha20Prg(bytes([11]) * 32))
    key, enc = session.server._keys.private_key, session.server.encoding
    n = gmpy2.mpz(key.public_key.n)
    n_inv = gmpy2.invert(n, (key.p - 1) * (key.q - 1))

    def randomness(c: int) -> gmpy2.mpz:  # c = (1 + m n) rho^n mod n^2, so c = rho^n mod n
        return gmpy2.powmod(gmpy2.mpz(c) % n, n_inv, n)

    weights = session.server.open_round(0, 4)
    fresh = []
    for s, silo in session.silos.items():
        reply = silo.weighted_sum(weights, deltas[s], noise[s])
        predicted = [gmpy2.mpz(1)] * 4
        for a in silo.own_subjects:
            i = config.subject_ids.index(a)
            lift = silo._blinds[i] * silo._counts[i] * enc.multiplier % n
            base = gmpy2.powmod(randomness(weights.ciphertexts[i]), lift, n)
            for j, e in enumerate(enc.encode_deltas(deltas[s][a])):
                predicted[j] = predicted[j] * gmpy2.powmod(base, e, n) % n
        assert len(reply.ciphertexts) == 4
        for c, rho in zip(reply.ciphertexts, predicted, strict=True):
            fresh.append(randomness(c) * gmpy2.invert(rho, n) % n)
    # re-randomised: no ciphertext's rho is the predictable product (1 under the mutation)
    assert all(factor != 1 for factor in fresh)
    assert len(set(fresh)) == len(fresh)  # by a fresh factor per ciphertext and silo


def test_weight_ciphertexts_are_fresh_and_hide_the_inverse() -> None:
    hist, _, _ = _problem(13, 2, 3, 1, 20)
    session = WeightingSession(_config(2, 3, 20), hist)
    w1 = session.server.open_round(0, 1)
    session.server.abort_round()
    w2 = session.server.open_round(1, 1)
    assert all(a != b for a, b in zip(w1.ciphertexts, w2.ciphertexts, strict=True))
    n = session.server.public_key.n
    for c, inv in zip(w1.ciphertexts, session.server._inverses, strict=True):
        assert c % n != 1 and (c - 1) // n != inv  # not the deterministic 1 + w n
        assert gmpy2.gcd(c, n) == 1


def test_a_silo_silent_during_set_up_aborts_with_a_named_error() -> None:
    from silodp.crypto.errors import SetupDropoutError

    hist, _, _ = _problem(14, 3, 4, 1, 20)
    with pytest.raises(SetupDropoutError, match=r"collecting key shares.*\[1\]") as info:
        WeightingSession(_config(3, 4, 20), hist, unresponsive={1})
    assert info.value.missing == (1,)
    # the same at the histogram stage, driving the parties by hand
    session_config = _config(3, 4, 20)
    server = Server(session_config)
    silos = {s: Silo(s, session_config, hist[s]) for s in range(3)}
    hello = server.hello()
    directory = None
    for silo in silos.values():
        directory = server.receive_key_share(silo.receive_hello(hello))
    assert directory is not None
    sealed = [m for silo in silos.values() for m in silo.receive_directory(directory)]
    for msg in sealed:
        silos[msg.recipient].receive_seed(server.relay_seed(msg))
    server.receive_histogram(silos[0].masked_histogram())
    assert server.setup_pending == (1, 2)
    with pytest.raises(SetupDropoutError, match=r"masked histograms.*\[1, 2\]"):
        server.abort_setup()
    assert server.stage is ServerStage.ABORTED
    with pytest.raises(StageError):
        server.open_round(0, 1)


def test_packing_carries_several_coordinates_per_ciphertext() -> None:
    from silodp.crypto.weighted_sum import choose_slots

    hist, deltas, noise = _problem(15, 3, 4, 300, 6)
    config = _config(3, 4, 6, noise_bound=100.0)
    session = WeightingSession(config, hist, source=ChaCha20Prg(bytes([5]) * 32))
    encoding = session.server.encoding
    assert encoding.max_slots > 1
    slots = config.slots_for(encoding, 300)
    assert slots > 1 and slots == choose_slots(encoding, 300, 12, key_bits=BITS, silos=3)
    weights = session.server.open_round(0, None)
    replies = [session.silos[s].weighted_sum(weights, deltas[s], noise[s]) for s in range(3)]
    assert all(len(r.ciphertexts) == -(-300 // slots) and r.dim == 300 for r in replies)
    for r in replies:
        session.server.receive_weighted_sum(r)
    out = session.server.finish_round().aggregate
    ref = plaintext_weighted_sum(deltas, hist, noise=noise)
    assert out.shape == (300,)
    np.testing.assert_allclose(out, ref, rtol=0, atol=_tolerance(4, 3, ref))
    unpacked = _config(3, 4, 6, noise_bound=100.0, packing=False)
    assert unpacked.slots_for(unpacked.encoding(session.server.public_key.n), 300) == 1


def test_unpack_recovers_balanced_digits_and_refuses_out_of_range() -> None:
    from silodp.crypto.encoding import WeightingEncoding
    from silodp.crypto.errors import ValueOutOfRangeError

    enc = WeightingEncoding(modulus=(1 << 511) + 1, n_max=4, num_subjects=2, num_silos=2)
    k = enc.max_slots
    assert k > 2
    rng = np.random.default_rng(0)
    digits = [int(v) for v in rng.integers(-enc.aggregate_bound, enc.aggregate_bound, k)]
    digits[0], digits[-1] = -enc.aggregate_bound, enc.aggregate_bound
    packed = sum(d << (enc.slot_bits * i) for i, d in enumerate(digits))
    assert enc.unpack(packed, k) == digits
    with pytest.raises(ValueOutOfRangeError):
        enc.unpack(enc.packed_bound(k) + 1, k)
    with pytest.raises(ValueError, match="slots"):
        enc.unpack(0, k + 1)


def test_round_estimate_counts_pairs_and_scales_with_parameters() -> None:
    from silodp.crypto.weighted_sum import modelled_round_products

    hist, _, _ = _problem(21, 3, 10, 4, 20)
    session = WeightingSession(_config(3, 10, 20), hist, source=ChaCha20Prg(bytes([9]) * 32))
    est = session.estimate_round(1000)
    assert est.pairs == sum(len(h) for h in hist.values())
    assert est.slots == session.config.slots_for(session.server.encoding, 1000)
    assert est.cpu_seconds > 0
    enc, bits = session.server.encoding, session.server.encoding.modulus.bit_length()
    small = modelled_round_products(enc, 1000, est.pairs, est.slots, key_bits=bits, silos=3)
    large = modelled_round_products(enc, 100_000, est.pairs, est.slots, key_bits=bits, silos=3)
    assert 50 < large / small < 100  # linear in parameters, tables amortised better


def test_silos_sample_subjects_from_the_shared_seed_and_the_server_never_sees_it() -> None:
    hist, deltas, noise = _problem(31, 3, 12, 3, 30, zero_frac=0.0)
    session = WeightingSession(_config(3, 12, 30), hist, source=ChaCha20Prg(bytes([6]) * 32))
    server, silos = session.server, session.silos
    key = server._keys.private_key
    samples = []
    for round_index in range(3):
        # every silo derives the same sample, a fresh one each round
        per_silo = {silo.subject_sample(round_index, 0.5) for silo in silos.values()}
        assert len(per_silo) == 1
        (sample,) = per_silo
        assert 0 < len(sample) < 12
        samples.append(sample)
        # the server's message is the same whatever the sample: a weight for every subject
        weights = server.open_round(round_index, 3)
        assert [key.decrypt(c) for c in weights.ciphertexts] == server._inverses
        assert all(inv != 0 for inv in server._inverses)
        wanted = {s: {a: v for a, v in deltas[s].items() if a in sample} for s in silos}
        for s, silo in silos.items():
            server.receive_weighted_sum(
                silo.weighted_sum(weights, wanted[s], noise[s], sampling_rate=0.5)
            )
        result = server.finish_round()
        assert result.sampled == frozenset(range(12))  # all the server knows
        # the decrypted sum is the weighted sum over the sampled subjects only
        ref = plaintext_weighted_sum(deltas, hist, noise=noise, sampled=sample)
        np.testing.assert_allclose(result.aggregate, ref, rtol=0, atol=_tolerance(12, 3, ref))
        full = plaintext_weighted_sum(deltas, hist, noise=noise)
        assert np.abs(result.aggregate - full).max() > 1e-3
    assert len(set(samples)) > 1


def test_the_silos_sample_depends_on_the_session_seed() -> None:
    hist, _, _ = _problem(32, 2, 40, 1, 20)
    a = WeightingSession(_config(2, 40, 20), hist, source=ChaCha20Prg(bytes([1]) * 32))
    b = WeightingSession(_config(2, 40, 20), hist, source=ChaCha20Prg(bytes([2]) * 32))
    assert a.silos[0].sample_key == a.silos[1].sample_key
    assert a.silos[0].sample_key != b.silos[0].sample_key
    assert a.silos[0].subject_sample(0, 0.5) != b.silos[0].subject_sample(0, 0.5)
    with pytest.raises(StageError, match="sample key"):
        Silo(0, _config(2, 40, 20), hist[0]).subject_sample(0, 0.5)


def test_silo_sampled_round_checks_its_deltas_and_run_round_drives_it() -> None:
    hist, deltas, noise = _problem(33, 2, 10, 2, 20, zero_frac=0.0)
    session = WeightingSession(_config(2, 10, 20), hist, source=ChaCha20Prg(bytes([8]) * 32))
    with pytest.raises(ValueError, match="either"):
        session.run_round(deltas, sampled={1}, silo_sampling_rate=0.5)
    # extra deltas of unsampled subjects held here are accepted and left out
    result = session.run_round(deltas, noise=noise, silo_sampling_rate=0.5)
    sample = session.silos[1].subject_sample(result.round_index, 0.5)
    ref = plaintext_weighted_sum(deltas, hist, noise=noise, sampled=sample)
    np.testing.assert_allclose(result.aggregate, ref, rtol=0, atol=_tolerance(10, 2, ref))
    # a sampled subject held here without a delta is refused
    sample = session.silos[0].subject_sample(1, 0.5)
    held = [a for a in hist[0] if a in sample]
    assert held
    weights = session.server.open_round(1, 2)
    short = {a: deltas[0][a] for a in held[1:]}
    with pytest.raises(ValueError, match="missing"):
        session.silos[0].weighted_sum(weights, short, sampling_rate=0.5)


def test_encoded_noise_enters_the_aggregate_exactly() -> None:
    hist, deltas, _ = _problem(34, 3, 5, 4, 20)
    session = WeightingSession(_config(3, 5, 20), hist, source=ChaCha20Prg(bytes([10]) * 32))
    enc = session.server.encoding
    rng = np.random.default_rng(0)
    ints = {s: [int(v) * 10**9 + 3 for v in rng.integers(-(10**9), 10**9, 4)] for s in range(3)}
    result = session.run_round(deltas, encoded_noise=ints)
    clean = plaintext_weighted_sum(deltas, hist)
    summed = [sum(ints[s][j] for s in range(3)) for j in range(4)]
    expected = clean + np.array([float(Fraction(v, enc.noise_scale)) for v in summed])
    np.testing.assert_allclose(result.aggregate, expected, rtol=0, atol=_tolerance(5, 3, expected))
    weights = session.server.open_round(1, 4)
    too_big = [enc.max_encoded_noise + 1, 0, 0, 0]
    with pytest.raises(ValueOutOfRangeError, match="encoded noise"):
        session.silos[0].weighted_sum(weights, deltas[0], encoded_noise=too_big)
    with pytest.raises(ValueError, match="either"):
        session.silos[0].weighted_sum(weights, deltas[0], np.zeros(4), encoded_noise=[0] * 4)
    with pytest.raises(ValueError, match="encoded noise values"):
        session.silos[0].weighted_sum(weights, deltas[0], encoded_noise=[0] * 3)
