"""Paillier on gmpy2: correctness, homomorphisms, CRT decryption and key-size refusal."""

from __future__ import annotations

import gmpy2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from silodp.crypto.errors import InsecureKeyError
from silodp.crypto.fixedbase import FixedBaseTable, choose_window
from silodp.crypto.paillier import (
    PaillierPrivateKey,
    PaillierPublicKey,
    check_key_bits,
    generate_keypair,
)
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.rerandomize import FullRerandomizer

KEYS = generate_keypair(source=ChaCha20Prg(bytes([1]) * 32), insecure_test_key_bits=512)
PK, SK = KEYS.public_key, KEYS.private_key
RNG = ChaCha20Prg(bytes([2]) * 32)
plain = st.integers(min_value=0, max_value=PK.n - 1)


def test_key_has_requested_size_and_valid_factors() -> None:
    assert PK.bits == 512
    assert SK.p * SK.q == PK.n and SK.p != SK.q
    assert gmpy2.is_prime(SK.p) and gmpy2.is_prime(SK.q)
    assert "p=" not in repr(SK) and str(SK.p) not in repr(SK)


def test_keygen_is_reproducible_from_an_injected_source() -> None:
    a = generate_keypair(source=ChaCha20Prg(bytes(32)), insecure_test_key_bits=256)
    b = generate_keypair(source=ChaCha20Prg(bytes(32)), insecure_test_key_bits=256)
    c = generate_keypair(source=ChaCha20Prg(bytes([9]) * 32), insecure_test_key_bits=256)
    assert a.public_key.n == b.public_key.n != c.public_key.n


@settings(max_examples=30, deadline=None)
@given(m=plain)
def test_decrypt_inverts_encrypt(m: int) -> None:
    c = PK.encrypt(m, RNG)
    assert SK.decrypt(c) == m
    assert 0 < c < PK.n_squared


def test_encryption_is_randomised() -> None:
    assert PK.encrypt(5, RNG) != PK.encrypt(5, RNG)


@settings(max_examples=30, deadline=None)
@given(a=plain, b=plain, k=st.integers(min_value=-(2**600), max_value=2**600))
def test_homomorphisms(a: int, b: int, k: int) -> None:
    ca, cb = PK.encrypt(a, RNG), PK.encrypt(b, RNG)
    n = PK.n
    assert SK.decrypt(PK.add(ca, cb)) == (a + b) % n
    assert SK.decrypt(PK.add_plain(ca, b)) == (a + b) % n
    assert SK.decrypt(PK.mul_plain(ca, k)) == (a * k) % n


def test_half_decryption_gives_the_plaintext_mod_p() -> None:
    for m in (0, 5, PK.n - 5, SK.p + 3):
        assert SK.decrypt_mod_p(PK.encrypt(m, RNG)) == m % SK.p


def test_negative_plaintexts_wrap_and_signed_decryption_lifts() -> None:
    c = PK.encrypt(-7, RNG)
    assert SK.decrypt(c) == PK.n - 7
    assert SK.decrypt_signed(c) == -7
    assert SK.decrypt_signed(PK.encrypt(7, RNG)) == 7


def test_key_size_is_refused_below_2048_bits() -> None:
    with pytest.raises(InsecureKeyError, match="1024"):
        generate_keypair(1024)
    with pytest.raises(InsecureKeyError):
        check_key_bits(2046)
    assert check_key_bits(3072) == 3072
    assert check_key_bits(3072, insecure_test_key_bits=512) == 512
    with pytest.raises(ValueError, match="insecure_test_key_bits"):
        check_key_bits(3072, insecure_test_key_bits=100)
    with pytest.raises(ValueError, match="insecure_test_key_bits"):
        check_key_bits(3072, insecure_test_key_bits=513)


def test_key_objects_validate() -> None:
    with pytest.raises(ValueError, match="odd"):
        PaillierPublicKey(100)
    with pytest.raises(ValueError, match="factors"):
        PaillierPrivateKey(PK, SK.p, SK.p)
    with pytest.raises(ValueError, match="n\\^2"):
        PK.check_ciphertext(PK.n_squared)
    with pytest.raises(ValueError, match="coprime"):
        PK.check_ciphertext(PK.n)
    with pytest.raises(ValueError, match="int"):
        PK.check_ciphertext(1.5)


@pytest.mark.slow
def test_default_key_is_3072_bits() -> None:
    keys = generate_keypair()
    assert keys.public_key.bits == 3072
    c = keys.public_key.encrypt(123)
    assert keys.private_key.decrypt(c) == 123


def test_fixed_base_table_matches_powmod() -> None:
    base = PK.encrypt(3, RNG)
    for window in (1, 3, 8):
        table = FixedBaseTable.build(base, PK.n_squared, 40, window)
        for e in (0, 1, 2**40 - 1, 123456789):
            assert table.pow(e) == gmpy2.powmod(base, e, PK.n_squared)
    with pytest.raises(ValueError, match="Exponent"):
        table.pow(2**40)
    assert choose_window(35, 10, element_bytes=128) <= choose_window(35, 10**5, element_bytes=128)
    assert choose_window(35, 10**6, element_bytes=10**6, memory_budget=10**9) < 12


def test_rerandomizer_yields_encryptions_of_zero() -> None:
    rer = FullRerandomizer(PK)
    secrets = rer.draw(RNG, 5)
    factors = [rer.factor(s) for s in secrets]
    assert len(set(factors)) == 5
    c = PK.encrypt(42, RNG)
    for f in factors:
        assert SK.decrypt(f) == 0
        assert SK.decrypt(c * f % PK.n_squared) == 42


def _two_part(x: int, prime: int) -> tuple[int, int]:
    """(2-adic valuation of ``prime - 1``, projection of ``x`` onto the 2-Sylow subgroup of
    ``Z_prime^*``), which the key holder can compute for any ciphertext."""
    a, odd = 0, prime - 1
    while odd % 2 == 0:
        odd, a = odd // 2, a + 1
    return a, int(gmpy2.powmod(x, odd, prime))


def test_rerandomizer_covers_the_subgroups_the_key_holder_can_project_onto() -> None:
    # Both primes = 1 mod 4, so the 2-parts of Z_p^* and Z_q^* are cyclic of order 2^a, 2^b
    # and their product is not cyclic: a randomiser made of powers of one secret base (with a
    # sign) reaches at most half of it, and the key holder reads the silo's data-dependent
    # factor through the rest (e.g. its Legendre symbols). Fresh uniform r^n reach all of it.
    keys = generate_keypair(source=ChaCha20Prg(bytes([10]) * 32), insecure_test_key_bits=512)
    pk, sk = keys.public_key, keys.private_key
    p, q = int(sk.p), int(sk.q)
    (a, _), (b, _) = _two_part(1, p), _two_part(1, q)
    assert a >= 2 and b >= 2  # the case where a single base leaks
    rer = FullRerandomizer(pk)
    factors = [int(rer.factor(s)) for s in rer.draw(ChaCha20Prg(bytes([11]) * 32), 400)]
    seen = {(_two_part(f % p, p)[1], _two_part(f % q, q)[1]) for f in factors}
    assert len(seen) == 2 ** (a + b)
    legendre = {(gmpy2.legendre(f, p), gmpy2.legendre(f, q)) for f in factors}
    assert legendre == {(1, 1), (1, -1), (-1, 1), (-1, -1)}
