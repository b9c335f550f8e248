"""Fixed-point encoding on Z_n: exactness, signs, lcm trick and overflow refusal."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from silodp.crypto.encoding import (
    FixedPointCodec,
    WeightingEncoding,
    lcm_upto,
    precision_digits,
)
from silodp.crypto.errors import EncodingOverflowError, SubjectBoundError, ValueOutOfRangeError

N512 = (2**255 - 19) * (2**257 - 93)  # an odd 512-bit modulus (only its size matters here)


def _enc(**kw: object) -> WeightingEncoding:
    args: dict = dict(modulus=N512, n_max=50, num_subjects=10, num_silos=3)
    args.update(kw)
    return WeightingEncoding(**args)


def test_lcm_upto_matches_math_lcm() -> None:
    for n in (1, 2, 3, 10, 97, 250):
        assert lcm_upto(n) == math.lcm(*range(1, n + 1))
    assert lcm_upto(2000).bit_length() == 2878  # ~ N_max * log2(e): why 3072-bit keys
    with pytest.raises(ValueError, match="n_max"):
        lcm_upto(0)


def test_precision_digits() -> None:
    assert precision_digits(1e-10) == 10
    assert precision_digits(1e-3) == 3
    assert precision_digits(1) == 0
    for bad in (3e-10, 0.5, -1e-10, 0.0):
        with pytest.raises(ValueError, match="precision"):
            precision_digits(bad)


def test_encoding_is_exact_and_ties_go_to_even() -> None:
    codec = FixedPointCodec(10)
    assert codec.encode(0.1) == 1_000_000_000  # exact rational 0.1000000000000000055...
    assert codec.encode(-0.1) == -1_000_000_000
    assert codec.encode(1e-11) == 0
    assert codec.encode(6e-11) == 1
    assert codec.encode(-6e-11) == -1
    half = FixedPointCodec(1)
    assert half.encode(0.25) == 2 and half.encode(0.75) == 8  # 2.5 -> 2, 7.5 -> 8
    assert half.encode(-0.25) == -2
    # a value whose float32 rounding would change the 10th digit
    x = 0.123456789012345
    assert codec.encode(x) == round(Fraction(x) * 10**10)
    assert codec.encode(float(np.float32(x))) != codec.encode(x)


def test_negatives_live_as_n_minus_abs() -> None:
    n = 1009
    assert FixedPointCodec.to_residue(-5, n) == n - 5
    assert FixedPointCodec.centered(n - 5, n) == -5
    assert FixedPointCodec.centered(5, n) == 5


@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=-1.0, max_value=1.0, allow_nan=False))
def test_round_trip_within_precision(x: float) -> None:
    enc = _enc()
    e = enc.encode_deltas(np.array([x]))[0]
    residue = FixedPointCodec.to_residue(e * enc.multiplier, enc.modulus)
    assert abs(enc.decode(residue) - x) <= 0.5e-10 + 1e-16


def test_overflow_parameters_are_refused_at_setup() -> None:
    with pytest.raises(EncodingOverflowError, match="wrap"):
        _enc(n_max=400)  # lcm(1..400) alone has ~580 bits
    with pytest.raises(EncodingOverflowError):
        _enc(delta_bound=1e150)
    ok = _enc(n_max=250, noise_bound=1e3)
    assert ok.headroom_bits > 0
    assert 2 * ok.aggregate_bound < ok.modulus


def test_values_beyond_declared_bounds_are_refused() -> None:
    enc = _enc(delta_bound=1.0, noise_bound=5.0)
    with pytest.raises(ValueOutOfRangeError, match="1.5"):
        enc.encode_deltas(np.array([0.2, 1.5]))
    with pytest.raises(ValueOutOfRangeError):
        enc.encode_noise(np.array([-6.0]))
    with pytest.raises(ValueError, match="finite"):
        enc.encode_deltas(np.array([np.nan]))
    with pytest.raises(ValueError, match="float64"):
        enc.encode_deltas(np.array(["a"]))
    assert enc.encode_deltas(np.array([1.0, -1.0], dtype=np.float32)) == [10**10, -(10**10)]


def test_subject_count_above_n_max_is_refused() -> None:
    enc = _enc(n_max=20)
    assert enc.check_subject_count(20, "a") == 20
    with pytest.raises(SubjectBoundError, match="21"):
        enc.check_subject_count(21, "a")


def test_decode_refuses_out_of_range_aggregates() -> None:
    enc = _enc()
    with pytest.raises(ValueOutOfRangeError):
        enc.decode(enc.modulus // 2)


def test_lcm_makes_every_weight_an_integer() -> None:
    enc = _enc(n_max=30)
    n = enc.modulus
    for n_a in range(1, 31):
        for n_sa in range(0, n_a + 1):
            w = n_sa * pow(n_a, -1, n) * enc.multiplier % n
            assert w * n_a == n_sa * enc.multiplier  # exactly L n_sa / n_a, no wrap-around
    # the failure the check prevents: a count that does not divide L decodes to garbage
    bad = pow(31, -1, n) * enc.multiplier % n
    assert bad * 31 != enc.multiplier and bad > n // 2**100


def test_noise_is_encoded_on_the_aggregate_grid_which_is_a_multiple_of_the_silo_count() -> None:
    # D = S X + sum_s round(y_s): the weighted deltas enter with L S n_sa / n_a (a multiple of
    # S) and the noise on the grid 1 / (L S 10^d), so the rounding is a post-processing
    enc = _enc(n_max=12, num_silos=4)
    assert enc.lcm == lcm_upto(12) and enc.multiplier == 4 * lcm_upto(12)
    assert enc.noise_scale == enc.multiplier * 10**10
    z = 0.123456789012345678
    assert enc.encode_noise(np.array([z]))[0] == round(Fraction(z) * enc.noise_scale)
    for n_a in range(1, 13):
        for n_sa in range(n_a + 1):
            assert (enc.multiplier * n_sa // n_a) % 4 == 0
    assert enc.max_abs_error == 10 / 2e10 + 4 / (2 * enc.noise_scale)


def test_rounded_noise_shares_are_a_function_of_the_summed_gaussian_only_for_multiples_of_s():
    # g_u(x) = sum_s round(x / S + u_s), u_s = y_s - G / S: S m + sum_s round(y_s) equals
    # g_u(S m + G) for every integer m, so a delta part that is a multiple of S makes the
    # decrypted aggregate a post-processing of (S X + G); a shift by 1 does not commute
    rng = np.random.default_rng(0)
    silos = 5
    misses = 0
    for _ in range(300):
        y = rng.normal(0.0, 1e3, silos)
        g = sum(Fraction(v) for v in y)
        u = [Fraction(v) - g / silos for v in y]
        m = int(rng.integers(-(10**6), 10**6))
        shares = sum(round(Fraction(v)) for v in y)
        assert silos * m + shares == sum(round((silos * m + g) / silos + us) for us in u)
        misses += 1 + shares != sum(round((1 + g) / silos + us) for us in u)
    assert misses > 100


@pytest.mark.parametrize(("sigma", "clip", "silos"), [(1.0, 1.0, 3), (0.7, 0.3, 5), (2.5, 1e-3, 2)])
def test_silo_noise_scale_covers_the_accounted_std_on_the_grid(sigma, clip, silos) -> None:
    # S silos each add round(N(0, a^2)) on the grid 1/(M 10^d): the decoded continuous sum has
    # std sqrt(S) a / (M 10^d), which must be at least σ C and is no more than 2^-64 above it
    enc = _enc(num_silos=silos, noise_bound=100.0)
    a = enc.silo_noise_scale(noise_multiplier=sigma, sensitivity=clip)
    assert isinstance(a, Fraction) and a.denominator <= 2**64
    target = Fraction(sigma) * Fraction(clip) * enc.noise_scale
    assert silos * a * a >= target * target
    below = a - Fraction(1, 2**64)
    assert silos * below * below < target * target
    assert enc.silo_noise_scale(noise_multiplier=0.0, sensitivity=clip) == 0
    with pytest.raises(ValueError, match="noise_multiplier"):
        enc.silo_noise_scale(noise_multiplier=-1.0, sensitivity=clip)


def test_encoded_noise_is_checked_against_its_bound_and_type() -> None:
    enc = _enc(noise_bound=5.0)
    top = enc.max_encoded_noise
    assert top == math.ceil(5 * enc.noise_scale)
    big = np.array([top, -top, 0, 7], dtype=object)  # Python ints beyond int64
    assert enc.check_encoded_noise(big) == [top, -top, 0, 7]
    assert enc.check_encoded_noise(np.array([3, -4], dtype=np.int64)) == [3, -4]
    with pytest.raises(ValueOutOfRangeError, match="encoded noise"):
        enc.check_encoded_noise(np.array([top + 1], dtype=object))
    with pytest.raises(ValueError, match="integers"):
        enc.check_encoded_noise(np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="integer"):
        enc.check_encoded_noise(np.array([1, 0.5], dtype=object))
    with pytest.raises(ValueError, match="1-d"):
        enc.check_encoded_noise(np.zeros((2, 2), dtype=np.int64))
    # a list of Python ints, as encode_noise gives, with a value at or above 2^63 and a
    # negative one (numpy reads such a list as float64, which was refused)
    wide = 2**63 + 1  # uint64 alone; beside a negative value, numpy reads float64
    assert top >= wide and np.asarray([wide, -1]).dtype == np.float64
    assert enc.check_encoded_noise([wide, -1, 0]) == [wide, -1, 0]
    assert enc.check_encoded_noise([top, -top, 0]) == [top, -top, 0]
    with pytest.raises(ValueError, match="integer"):
        enc.check_encoded_noise([1, 0.5])
    with pytest.raises(ValueOutOfRangeError, match="encoded noise"):
        enc.check_encoded_noise([top + 1, -1])


def test_vectorised_rounding_equals_the_exact_scalar_rounding() -> None:
    from silodp.crypto.encoding import _round_scaled, round_scaled_array

    rng = np.random.default_rng(1)
    for digits in (0, 3, 10, 13):
        xs = np.concatenate(
            [
                rng.uniform(-1, 1, 5000),
                rng.uniform(-1e-8, 1e-8, 500),
                (2 * rng.integers(-1000, 1000, 500) + 1) / 2048.0,  # ties at 10^d
                (2 * rng.integers(-1000, 1000, 500) + 1) / 2.0**30,
                np.ldexp(1.0, -rng.integers(1, 1074, 500)),
                rng.uniform(-1e5, 1e5, 500),
                [0.0, -0.0, 1.0, -1.0, 5e-324, 0.5, 1.5, 2.5, -2.5],
            ]
        )
        xs = xs[np.abs(xs) * 10.0**digits < 2.0**60]
        got = round_scaled_array(xs, digits)
        assert [int(v) for v in got] == [_round_scaled(float(v), 10**digits) for v in xs]
    with pytest.raises(ValueError, match="digits=14"):
        round_scaled_array(np.zeros(1), 14)
    with pytest.raises(ValueError, match="below 2"):
        round_scaled_array(np.array([1e10]), 10)


def test_zero_bounds_pack_finitely_many_slots() -> None:
    enc = _enc(delta_bound=0.0, noise_bound=0.0)
    assert enc.aggregate_bound == 0
    # one bit per slot; as many slots as keep 2 * (2^(K+1) - 1) below the modulus: with
    # bound 0 the packing loop never ended
    assert enc.slot_bits == 1
    k = enc.max_slots
    assert 2 * (2 ** (k + 1) - 1) >= N512 > 2 * (2**k - 1)
    assert enc.unpack(0, enc.max_slots) == [0] * enc.max_slots
