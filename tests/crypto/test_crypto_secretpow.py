"""Constant-time secret exponentiation (OpenSSL) agrees with gmpy2 and survives pickling and
fork."""

from __future__ import annotations

import multiprocessing
import pickle
import random

import gmpy2
import pytest

from silodp.crypto.paillier import generate_keypair
from silodp.crypto.secretpow import SecretPower, openssl_available


def _odd(bits: int, rng: random.Random) -> int:
    return rng.getrandbits(bits) | 1 | (1 << (bits - 1))


def test_openssl_backend_is_loaded_here() -> None:
    assert openssl_available()
    assert SecretPower(15, 3).backend == "openssl"
    assert SecretPower(15, 3, backend="gmpy2").backend == "gmpy2"


@pytest.mark.parametrize("backend", ["auto", "gmpy2"])
def test_agrees_with_gmpy2_powmod(backend: str) -> None:
    rng = random.Random(7)
    for bits in (64, 1024, 3072):
        m = _odd(bits, rng)
        e = rng.getrandbits(bits // 2) | 1
        power = SecretPower(m, e, backend=backend)
        for base in [0, 1, 2, m - 1, m, m + 5, 3 * m + 7] + [
            rng.getrandbits(bits + 40) for _ in range(10)
        ]:
            assert power(base) == gmpy2.powmod(base, e, m)


def test_refuses_even_moduli_and_non_positive_exponents() -> None:
    with pytest.raises(ValueError, match="odd"):
        SecretPower(16, 3)
    with pytest.raises(ValueError, match="exponent"):
        SecretPower(15, 0)
    with pytest.raises(ValueError, match="backend"):
        SecretPower(15, 3, backend="fast")


def test_repr_hides_the_exponent() -> None:
    assert "123456789" not in repr(SecretPower(1000003, 123456789))


def _child(power: SecretPower, base: int, out: multiprocessing.Queue) -> None:
    out.put(power(base))


def test_pickled_and_forked_copies_rebuild_their_state() -> None:
    rng = random.Random(3)
    m, e = _odd(2048, rng), rng.getrandbits(1024) | 1
    power = SecretPower(m, e)
    base = rng.getrandbits(2000)
    want = gmpy2.powmod(base, e, m)
    assert power(base) == want  # builds the OpenSSL state in this process
    assert pickle.loads(pickle.dumps(power))(base) == want
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(power, base, out))
    child.start()
    got = out.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == want


def test_paillier_decryption_uses_it_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = generate_keypair(insecure_test_key_bits=512)
    pk, sk = keys.public_key, keys.private_key
    calls: list[str] = []
    real = SecretPower.__call__

    def counted(self: SecretPower, base: object) -> object:
        calls.append(self.backend)
        return real(self, base)

    monkeypatch.setattr(SecretPower, "__call__", counted)
    for m in (0, 1, 12345, pk.n - 1):
        c = pk.encrypt(m)
        assert sk.decrypt(c) == m
        assert sk.decrypt_mod_p(c) == m % sk.p
    # every exponentiation by p - 1 or q - 1 went through the constant-time OpenSSL path
    assert calls == ["openssl"] * 12
    assert pickle.loads(pickle.dumps(sk)).decrypt(pk.encrypt(99)) == 99
    assert len(calls) == 14


def test_missing_libcrypto_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import silodp.crypto.secretpow as sp

    monkeypatch.setattr(sp, "_load", lambda: None)
    power = SecretPower(1000003, 65537)
    with pytest.warns(RuntimeWarning, match="constant time"):
        assert power(12345) == gmpy2.powmod(12345, 65537, 1000003)
    assert power.backend == "gmpy2"
