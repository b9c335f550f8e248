"""Fixed-point weights under BFV (``weights = "fixed_point"``): the silos' chain, the product by
``F`` and the trace give ``Enc(floor(2^k/n_a))`` with every other coefficient zero, within the
planned worst-case noise; a round decrypts to the clear weighted sum within the encoding's
error and never above the exact weights; the plan refuses what it cannot hold; a server
sample is refused; each hop re-randomises."""

from __future__ import annotations

import math

import numpy as np
import pytest

from silodp.algorithms.uldp_common import FIXED_POINT_MAX_N, WEIGHT_ENCODINGS
from silodp.crypto.bfv import BfvParameters, BfvWeightingSession, fixed_weights, plan_bfv_round
from silodp.crypto.bfv.backend import (
    BfvContext,
    ciphertext_primes,
    decryptor,
    encryptor,
    galois_keys,
    new_ciphertext,
    new_plaintext,
    noise_budget,
)
from silodp.crypto.bfv.params import (
    FIXED_POINT_COEFF_BITS,
    FIXED_POINT_DEGREE,
    WEIGHTS,
    fixed_point_bits,
    fixed_weight_noise,
    trace_elements,
)
from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.errors import EncodingOverflowError, ProtocolError
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.protocol import plaintext_weighted_sum

PARAMS = BfvParameters(FIXED_POINT_DEGREE, FIXED_POINT_COEFF_BITS)
PRIMES = ciphertext_primes(FIXED_POINT_DEGREE, FIXED_POINT_COEFF_BITS)

#: three silos, five subjects: one with no record anywhere, one at n_max, one in every silo
N_MAX = 40
HIST = {0: {0: 3, 1: 1, 3: 40}, 1: {0: 2, 2: 5}, 2: {1: 4, 2: 1}}
TOTALS = {0: 5, 1: 5, 2: 6, 3: 40, 4: 0}


def _session(hist=HIST, dim: int = 60, seed: int = 0, **kw) -> BfvWeightingSession:
    return BfvWeightingSession(
        hist,
        n_max=N_MAX,
        dim=dim,
        params=PARAMS,
        subject_ids=list(range(5)),
        noise_bound=100.0,
        source=ChaCha20Prg(bytes([seed]) * 32),
        weights="fixed_point",
        **kw,
    )


@pytest.fixture(scope="module")
def session() -> BfvWeightingSession:
    return _session()


def test_the_weights_decrypt_to_floor_2k_over_n_as_constant_polynomials(session) -> None:
    plan = session.plan
    k = plan.encoding.weight_bits
    assert k == fixed_point_bits(5, N_MAX, delta_bound=1.0, precision=1e-10)
    weights = session.weights()
    assert len(weights) == len(plan.plain_moduli) >= 2  # a CRT over several primes
    assert plan.level_drop > 0  # the weights are switched down before the silos' products
    for j, (ctx, sk) in enumerate(
        zip(session.server.contexts, session.server.keys.secret_keys, strict=True)
    ):
        t = ctx.plain_modulus
        for a, n_a in TOTALS.items():
            plain = new_plaintext()
            decryptor(ctx, sk).decrypt(weights[j][a], plain)
            coeffs = ctx.coefficients(plain)
            assert int(coeffs[0]) == ((1 << k) // n_a) % t if n_a else int(coeffs[0]) == 0
            assert not coeffs[1:].any(), (j, a)
            assert weights[j][a].parms_id() == ctx.level(plan.level_drop)[0]
            # the planned worst case bounds the noise SEAL measures: the invariant noise
            # |t (c0 + c1 s) mod q| has bits(q) - budget - 1 bits, about bits(t) + bits(v)
            assert noise_budget(ctx, sk, weights[j][a]) > 0
            q_level = math.prod(ctx.level(plan.level_drop)[1])  # switched down to it
            noise_bits = _noise_bits(ctx, sk, weights[j][a], q_level, t)
            assert noise_bits <= plan.weight_noise_bound.bit_length(), (noise_bits, j, a)
    assert session.timings["silo_weights"] > 0
    assert "server_weights" not in session.timings  # the server encrypted no weight
    assert session.server.galois_keys == ()  # dropped once the weights exist


def test_the_trace_and_a_silos_message_stay_within_their_worst_case_noise(
    session, monkeypatch
) -> None:
    """The bounds the plan relies on, against SEAL's measured noise: the weight before the
    switch down (chain, F, trace) and one silo's message without its flooding."""
    plan = session.plan
    ctx, sk = session.server.contexts[0], session.server.keys.secret_keys[0]
    t = ctx.plain_modulus
    k = plan.encoding.weight_bits
    enc = encryptor(ctx, session.server.public_keys[0])
    f_plain = ctx.plaintext(fixed_weights.weight_polynomial(FIXED_POINT_DEGREE, t, N_MAX, k))
    counts = [[HIST[s].get(a, 0) for a in range(5)] for s in sorted(HIST)]
    galois = galois_keys(ctx, sk, trace_elements(FIXED_POINT_DEGREE))  # the server's are
    # dropped once the weights exist
    top = fixed_weights.run_chain(ctx, enc, counts, f_plain, galois)
    bound = fixed_weight_noise(
        FIXED_POINT_DEGREE, t, num_silos=3, n_max=N_MAX, ciphertext_primes=PRIMES
    )
    for ct in top:
        assert ct.parms_id() == ctx.parms_id  # not switched
        assert 30 < _noise_bits(ctx, sk, ct, plan.coeff_modulus, t) <= bound.bit_length()
    # a silo's message with its flooding cut to [-1, 1): the rest of its noise, E_s
    real = BfvContext.flooding
    monkeypatch.setattr(
        BfvContext, "flooding", lambda self, source, bits, drop=0: real(self, source, 0, drop)
    )
    rng = np.random.default_rng(8)
    deltas = {a: rng.uniform(-1.0, 1.0, plan.dim) for a in HIST[0]}
    message = session.silos[0].weighted_sum(session.weights(), deltas, [0] * plan.dim, 0)
    q_level = math.prod(ctx.level(plan.level_drop)[1])
    measured = _noise_bits(ctx, sk, message[0][0], q_level, t)
    assert 0 < measured <= plan.silo_noise_bound.bit_length()
    # the flooding hides that measured noise: 2^beta >= 2^40 N C |v|, C ciphertexts a silo
    cts = plan.blocks * len(plan.plain_moduli)
    assert measured + 40 + math.ceil(math.log2(FIXED_POINT_DEGREE * cts)) <= plan.flood_log2


def _noise_bits(ctx, sk, ct, modulus: int, t: int) -> int:
    """SEAL's invariant noise |t (c0 + c1 s) mod q| has bits(q) - budget - 1 bits."""
    return modulus.bit_length() - noise_budget(ctx, sk, ct) - 1 - (t.bit_length() - 1)


def test_a_round_decrypts_to_the_clear_weighted_sum_never_above_it(session) -> None:
    rng = np.random.default_rng(3)
    dim = session.plan.dim
    deltas = {s: {a: rng.uniform(-1.0, 1.0, dim) for a in h} for s, h in HIST.items()}
    noise = {s: rng.normal(0.0, 3.0, dim) for s in HIST}
    got = session.run_round(deltas, noise=noise)
    want = plaintext_weighted_sum(deltas, HIST) + sum(noise.values())
    error = session.plan.encoding.max_abs_error + 1e-12
    assert float(np.abs(got - want).max()) <= error
    # with every delta at +1, the floor only lowers a weight: the sum stays at most the exact
    ones = {s: {a: np.ones(dim) for a in h} for s, h in HIST.items()}
    top = session.run_round(ones)
    exact = plaintext_weighted_sum(ones, HIST)
    assert float((top - exact).max()) <= 0.5e-10 * (5 + 3)  # the encoding's rounding only
    np.testing.assert_allclose(exact, 4.0)  # four subjects with records, each summing to 1
    # and the comparison can fail: exact weights with a subject's weight doubled differ
    doubled = {s: {a: (2.0 if a == 0 else 1.0) * d for a, d in h.items()} for s, h in ones.items()}
    assert float(np.abs(top - plaintext_weighted_sum(doubled, HIST)).max()) > 0.5


def test_silos_sample_and_the_weights_are_computed_once() -> None:
    session = _session(seed=1)
    rng = np.random.default_rng(4)
    dim = session.plan.dim
    deltas = {s: {a: rng.uniform(-1.0, 1.0, dim) for a in h} for s, h in HIST.items()}
    for round_index in (0, 1):
        got = session.run_round(deltas, silo_sampling_rate=0.5)
        if round_index == 0:
            spent = session.timings["silo_weights"]
        else:
            assert session.timings["silo_weights"] == spent  # reused, not recomputed
        sample = session.silos[0].subject_sample(round_index, 0.5)
        kept = {s: {a: d for a, d in h.items() if a in sample} for s, h in deltas.items()}
        want = plaintext_weighted_sum(kept, HIST)
        assert float(np.abs(got - want).max()) <= session.plan.encoding.max_abs_error
    with pytest.raises(ProtocolError, match="cannot hide a sample"):
        session.run_round(deltas, sampled={0, 1})


def test_worker_processes_compute_the_same_weights() -> None:
    """The chain split over two processes (subjects halved, ciphertexts serialised back)
    decrypts to the same weights as in one process."""
    lines: list[str] = []
    session = _session(seed=5, workers=2, progress=lines.append)
    weights = session.weights()
    plan, k = session.plan, session.plan.encoding.weight_bits
    assert len(lines) == 2 * len(plan.plain_moduli) and "parts done" in lines[-1]
    for j, (ctx, sk) in enumerate(
        zip(session.server.contexts, session.server.keys.secret_keys, strict=True)
    ):
        assert len(weights[j]) == 5
        for a, n_a in TOTALS.items():
            plain = new_plaintext()
            decryptor(ctx, sk).decrypt(weights[j][a], plain)
            coeffs = ctx.coefficients(plain)
            want = ((1 << k) // n_a) % ctx.plain_modulus if n_a else 0
            assert int(coeffs[0]) == want and not coeffs[1:].any(), (j, a)
    rng = np.random.default_rng(6)
    deltas = {s: {a: rng.uniform(-1.0, 1.0, plan.dim) for a in h} for s, h in HIST.items()}
    got = session.run_round(deltas)
    want_sum = plaintext_weighted_sum(deltas, HIST)
    assert float(np.abs(got - want_sum).max()) <= plan.encoding.max_abs_error


def test_a_failed_worker_part_names_itself() -> None:
    session = _session(seed=6)
    ctx = session.server.contexts[0]
    spec = fixed_weights.ChainSpec(
        FIXED_POINT_DEGREE,
        FIXED_POINT_COEFF_BITS,
        ctx.plain_modulus,
        N_MAX,
        session.plan.encoding.weight_bits,
        session.plan.level_drop,
        b"not a public key",
    )
    counts = [session.silos[s].counts() for s in sorted(session.silos)]
    galois = [galois_keys(ctx, session.server.keys.secret_keys[0], trace_elements(16384))]
    with pytest.raises(
        RuntimeError, match=r"part of prime 1/1 with subjects (0\.\.1|2\.\.4) failed"
    ):
        fixed_weights.compute_weights([ctx], [spec], galois, counts, workers=2)


def test_each_hop_re_randomises_the_chain() -> None:
    session = _session(hist={0: {0: 1}, 1: {0: 2}}, seed=2)
    ctx, sk = session.server.contexts[0], session.server.keys.secret_keys[0]
    enc = encryptor(ctx, session.server.public_keys[0])
    (start,) = fixed_weights.chain_start(ctx, enc, [3])
    for count in (0, 2):
        (hop,) = fixed_weights.chain_hop(ctx, enc, [start], [count])
        shifted = new_ciphertext(ctx)
        ctx.evaluator.multiply_plain(start, fixed_weights.monomial(ctx, max(count, 0)), shifted)
        assert ctx.to_bytes(hop) != ctx.to_bytes(shifted)  # a fresh Enc(0) was added
        assert ctx.to_bytes(hop) != ctx.to_bytes(start)
        (again,) = fixed_weights.chain_hop(ctx, enc, [start], [count])
        assert ctx.to_bytes(again) != ctx.to_bytes(hop)  # a new Enc(0) every time
        plain = new_plaintext()
        decryptor(ctx, sk).decrypt(hop, plain)
        coeffs = ctx.coefficients(plain)
        assert int(coeffs[3 + count]) == 1 and int(coeffs.sum()) == 1  # X^(3 + count)


def test_weight_polynomial_and_trace_elements() -> None:
    n, t, k = 16384, 65537, 20
    f = fixed_weights.weight_polynomial(n, t, 7, k)
    n_inv = pow(n, -1, t)
    assert int(f[n - 3]) == (-((1 << k) // 3) * n_inv) % t
    assert int(np.count_nonzero(f)) == 7 and int(f[0]) == 0  # n_a = 0 gets weight 0
    with pytest.raises(ValueError, match="n_max=16384"):
        fixed_weights.weight_polynomial(n, t, n, k)
    assert trace_elements(8) == (3, 5, 9)
    assert len(trace_elements(FIXED_POINT_DEGREE)) == 14


def test_the_plan_refuses_what_the_ring_cannot_hold() -> None:
    kw = dict(num_subjects=5, num_silos=3, dim=60, noise_bound=100.0, weights="fixed_point")
    with pytest.raises(EncodingOverflowError, match="n_max=16384 < poly_degree=16384"):
        plan_bfv_round(PARAMS, ciphertext_primes=PRIMES, n_max=16384, **kw)
    small = BfvParameters()  # 8192, 180 bits of q: no room for the trace's noise at scale
    large = {**kw, "num_subjects": 1000, "num_silos": 50}
    with pytest.raises(EncodingOverflowError, match="weights='fixed_point'"):
        plan_bfv_round(
            small, ciphertext_primes=ciphertext_primes(8192, small.coeff_bits), n_max=4000, **large
        )
    # which the exact weights' smaller noise would fit (at a small n_max)
    plan_bfv_round(
        small,
        ciphertext_primes=ciphertext_primes(8192, small.coeff_bits),
        n_max=20,
        **{**large, "weights": "exact"},
    )
    with pytest.raises(ValueError, match="weights='float'"):
        plan_bfv_round(PARAMS, ciphertext_primes=PRIMES, n_max=4, **{**kw, "weights": "float"})
    plan = plan_bfv_round(PARAMS, ciphertext_primes=PRIMES, n_max=N_MAX, **kw)
    assert plan.weights == "fixed_point" and plan.weight_noise_bound > 0
    kw["weights"] = "exact"
    exact = plan_bfv_round(PARAMS, ciphertext_primes=PRIMES, n_max=N_MAX, **kw)
    assert exact.weight_noise_bound == 0 and exact.encoding.weight_bits is None


def test_fixed_point_bits_keep_the_weighting_error_below_the_precision() -> None:
    for subjects, n_max, bound, precision in [(5, 40, 1.0, 1e-10), (1000, 10000, 2.5, 1e-8)]:
        k = fixed_point_bits(subjects, n_max, delta_bound=bound, precision=precision)
        assert subjects * n_max * bound / 2**k <= precision
        assert subjects * n_max * bound / 2 ** (k - 1) > precision  # and no more bits than that


def test_encoding_with_weight_bits() -> None:
    kw = dict(modulus=1 << 400, n_max=40, num_subjects=5, num_silos=3, packing=False)
    enc = WeightingEncoding(**kw, weight_bits=40)
    assert enc.lcm == 1 << 40 and enc.multiplier == 3 << 40
    exact = WeightingEncoding(**kw)
    assert enc.max_abs_error == pytest.approx(exact.max_abs_error + 5 * 40 / 2**40)
    for bad in (0, True, 5000, 2.0):
        with pytest.raises(ValueError, match="weight_bits"):
            WeightingEncoding(**kw, weight_bits=bad)
    with pytest.raises(EncodingOverflowError, match="L = 2\\^300"):
        WeightingEncoding(**{**kw, "modulus": 1 << 200}, weight_bits=300)


def test_the_algorithm_constants_agree_with_the_backend() -> None:
    assert WEIGHT_ENCODINGS == WEIGHTS
    assert FIXED_POINT_MAX_N == FIXED_POINT_DEGREE
    assert math.log2(FIXED_POINT_DEGREE) == len(trace_elements(FIXED_POINT_DEGREE))
