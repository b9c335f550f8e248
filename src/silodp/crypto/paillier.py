"""Paillier encryption on gmpy2: key generation, encryption, CRT decryption, homomorphisms.

With ``g = n + 1``, ``Enc(m; r) = (1 + m n) r^n mod n^2`` (the binomial shortcut
``(1 + n)^m = 1 + m n mod n^2`` saves one exponentiation). Homomorphisms:
``Enc(a) Enc(b) = Enc(a + b)``, ``Enc(a)^k = Enc(k a)`` (negative ``k`` through the inverse
ciphertext), ``Enc(a) (1 + b n) = Enc(a + b)`` (adding a plaintext costs one product).
Decryption's exponentiations by the secret ``p - 1`` and ``q - 1`` run in constant time
(:mod:`~silodp.crypto.secretpow`).

Key sizes: 3072-bit moduli by default (about 128-bit security), never below 2048 bits. Smaller
keys exist only for fast tests and must be asked for by name (``insecure_test_key_bits``);
they raise :class:`~silodp.crypto.errors.InsecureKeyError` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gmpy2

from silodp.crypto.errors import InsecureKeyError
from silodp.crypto.randomness import RandomSource, SystemRandomSource, randbits, random_unit
from silodp.crypto.secretpow import SecretPower

__all__ = [
    "DEFAULT_KEY_BITS",
    "MAX_KEY_BITS",
    "MIN_KEY_BITS",
    "MIN_TEST_KEY_BITS",
    "PaillierKeyPair",
    "PaillierPrivateKey",
    "PaillierPublicKey",
    "check_key_bits",
    "generate_keypair",
]

DEFAULT_KEY_BITS = 3072
MIN_KEY_BITS = 2048
#: ciphertexts mod n² must fit the messages' 16384-bit bound (:mod:`silodp.crypto.messages`)
MAX_KEY_BITS = 8192
MIN_TEST_KEY_BITS = 128
_PRIME_REPS = 40


def check_key_bits(bits: int, *, insecure_test_key_bits: int | None = None) -> int:
    """The modulus size to use: ``bits`` (>= 2048) or, if given, ``insecure_test_key_bits``."""
    if insecure_test_key_bits is not None:
        t = insecure_test_key_bits
        if isinstance(t, bool) or not isinstance(t, int) or t < MIN_TEST_KEY_BITS or t % 2:
            raise ValueError(
                f"Expected insecure_test_key_bits={t!r} to be an even int >= {MIN_TEST_KEY_BITS}."
            )
        return t
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError(f"Expected key_bits={bits!r} to be an int.")
    if bits < MIN_KEY_BITS:
        raise InsecureKeyError(
            f"Refusing Paillier key_bits={bits}: below the {MIN_KEY_BITS}-bit minimum "
            f"(default {DEFAULT_KEY_BITS}). Tests may pass insecure_test_key_bits explicitly."
        )
    if bits > MAX_KEY_BITS:
        raise ValueError(
            f"Expected key_bits={bits} to be at most {MAX_KEY_BITS} (ciphertexts mod n² must fit "
            f"the protocol's messages; the default is {DEFAULT_KEY_BITS})."
        )
    if bits % 2:
        raise ValueError(f"Expected key_bits={bits} to be even.")
    return bits


@dataclass(frozen=True)
class PaillierPublicKey:
    """The public modulus ``n`` (``g = n + 1``)."""

    n: int
    _n: Any = field(init=False, repr=False, compare=False)
    _n2: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 15 or n % 2 == 0:
            raise ValueError(f"Expected the Paillier modulus n={n!r} to be an odd int >= 15.")
        object.__setattr__(self, "_n", gmpy2.mpz(n))
        object.__setattr__(self, "_n2", gmpy2.mpz(n) * gmpy2.mpz(n))

    @property
    def bits(self) -> int:
        return int(self.n).bit_length()

    @property
    def n_mpz(self) -> Any:
        return self._n

    @property
    def n_squared(self) -> Any:
        return self._n2

    def check_plaintext(self, m: int) -> int:
        if isinstance(m, bool) or not isinstance(m, int | type(self._n)) or not 0 <= m < self._n:
            raise ValueError(f"Expected a plaintext in [0, n), got {m!r}.")
        return int(m)

    def check_ciphertext(self, c: object) -> Any:
        """``c`` as an mpz if it is a valid ciphertext (``0 < c < n^2``, coprime to ``n``)."""
        if isinstance(c, bool) or not isinstance(c, int | type(self._n)):
            raise ValueError(f"Expected a ciphertext int, got {type(c).__name__}.")
        value = gmpy2.mpz(c)
        if not 0 < value < self._n2:
            raise ValueError(f"Ciphertext {int(value)} outside (0, n^2).")
        if gmpy2.gcd(value, self._n) != 1:
            raise ValueError("Ciphertext not coprime to n.")
        return value

    def random_factor(self, source: RandomSource) -> Any:
        """A fresh uniform ``r^n mod n^2`` (one full exponentiation)."""
        r = random_unit(source, self.n)
        return gmpy2.powmod(r, self._n, self._n2)

    def raw_encrypt(self, m: int, noise: Any) -> Any:
        """``(1 + m n) * noise mod n^2`` for a given ``noise = r^n``."""
        return (1 + gmpy2.mpz(m) * self._n) * noise % self._n2

    def encrypt(self, m: int, source: RandomSource | None = None) -> Any:
        """``Enc(m)`` with fresh randomness; ``m`` is reduced mod ``n`` (negatives wrap)."""
        if isinstance(m, bool) or not isinstance(m, int | type(self._n)):
            raise ValueError(f"Expected an integer plaintext, got {m!r}.")
        src = source if source is not None else SystemRandomSource()
        return self.raw_encrypt(gmpy2.mpz(m) % self._n, self.random_factor(src))

    def add(self, c1: Any, c2: Any) -> Any:
        """``Enc(a + b)`` from ``Enc(a)``, ``Enc(b)``."""
        return gmpy2.mpz(c1) * gmpy2.mpz(c2) % self._n2

    def add_plain(self, c: Any, m: int) -> Any:
        """``Enc(a + m)`` from ``Enc(a)`` (no fresh randomness)."""
        return gmpy2.mpz(c) * (1 + (gmpy2.mpz(m) % self._n) * self._n) % self._n2

    def mul_plain(self, c: Any, k: int) -> Any:
        """``Enc(k a)`` from ``Enc(a)``; a negative ``k`` uses the inverse ciphertext so the
        exponent stays ``|k|``."""
        k = gmpy2.mpz(k)
        if k < 0:
            return gmpy2.powmod(gmpy2.invert(gmpy2.mpz(c), self._n2), -k, self._n2)
        return gmpy2.powmod(gmpy2.mpz(c), k, self._n2)


@dataclass(frozen=True)
class PaillierPrivateKey:
    """The factors of ``n``, with CRT constants for decryption."""

    public_key: PaillierPublicKey
    p: int
    q: int
    _crt: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p, q = gmpy2.mpz(self.p), gmpy2.mpz(self.q)
        if p == q or p * q != self.public_key.n_mpz:
            raise ValueError("Expected distinct factors p, q with p * q == n.")
        if p > q:  # canonical order
            p, q = q, p
            object.__setattr__(self, "p", int(p))
            object.__setattr__(self, "q", int(q))
        p2, q2 = p * p, q * q
        g = self.public_key.n_mpz + 1
        hp = gmpy2.invert((gmpy2.powmod(g, p - 1, p2) - 1) // p, p)
        hq = gmpy2.invert((gmpy2.powmod(g, q - 1, q2) - 1) // q, q)
        q_inv = gmpy2.invert(q, p)
        pow_p, pow_q = SecretPower(int(p2), int(p - 1)), SecretPower(int(q2), int(q - 1))
        object.__setattr__(self, "_crt", (p, q, hp, hq, q_inv, pow_p, pow_q))

    def __repr__(self) -> str:  # never print the factors
        return f"PaillierPrivateKey(bits={self.public_key.bits})"

    def decrypt(self, c: Any) -> int:
        """The plaintext in ``[0, n)`` (CRT: two half-size, constant-time exponentiations)."""
        p, q, hp, hq, q_inv, pow_p, pow_q = self._crt
        c = gmpy2.mpz(c)
        mp = (pow_p(c) - 1) // p * hp % p
        mq = (pow_q(c) - 1) // q * hq % q
        return int(mq + q * ((mp - mq) * q_inv % p))

    def decrypt_mod_p(self, c: Any) -> int:
        """The plaintext reduced mod the smaller prime ``p`` (one half-size exponentiation);
        enough when the plaintext is known to be far smaller than ``p``."""
        p, _, hp, _, _, pow_p, _ = self._crt
        return int((pow_p(c) - 1) // p * hp % p)

    def decrypt_signed(self, c: Any) -> int:
        """The plaintext lifted to ``(-n/2, n/2]``."""
        m = self.decrypt(c)
        n = self.public_key.n
        return m - n if m > n // 2 else m


@dataclass(frozen=True)
class PaillierKeyPair:
    public_key: PaillierPublicKey
    private_key: PaillierPrivateKey


def _random_prime(bits: int, source: RandomSource) -> Any:
    """A prime of exactly ``bits`` bits whose two top bits are set (so p q has 2 bits)."""
    while True:
        start = gmpy2.mpz(randbits(source, bits)) | (gmpy2.mpz(3) << (bits - 2)) | 1
        prime = gmpy2.next_prime(start)
        if prime.bit_length() == bits and gmpy2.is_prime(prime, _PRIME_REPS):
            return prime


def generate_keypair(
    key_bits: int = DEFAULT_KEY_BITS,
    *,
    source: RandomSource | None = None,
    insecure_test_key_bits: int | None = None,
) -> PaillierKeyPair:
    """A fresh Paillier key pair with a ``key_bits``-bit modulus (primes of half the size)."""
    bits = check_key_bits(key_bits, insecure_test_key_bits=insecure_test_key_bits)
    src = source if source is not None else SystemRandomSource()
    while True:
        p = _random_prime(bits // 2, src)
        q = _random_prime(bits // 2, src)
        n = p * q
        if p != q and n.bit_length() == bits and gmpy2.gcd(n, (p - 1) * (q - 1)) == 1:
            break
    public = PaillierPublicKey(int(n))
    return PaillierKeyPair(public, PaillierPrivateKey(public, int(p), int(q)))
