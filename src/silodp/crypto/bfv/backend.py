"""SEAL's BFV through TenSEAL's ``sealapi`` bindings: one context per CRT plaintext prime,
keys, (de)serialisation and the flooding ciphertext.

Only this module imports ``tenseal``. SEAL draws its own encryption randomness (``u``, errors)
from its Blake2xb PRNG seeded by the operating system; the flooding noise and every mask come
from the caller's :class:`~silodp.crypto.randomness.RandomSource`.

SEAL offers no way to add to a ciphertext's coefficients from Python, so flooding builds the
ciphertext ``(f, 0)`` (``f`` the flooding polynomial in every prime of ``q``) in SEAL's own
uncompressed serial format and adds it homomorphically; its header version is read from a
plaintext SEAL itself wrote, and loading checks that every coefficient is reduced.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import tenseal.sealapi as sealapi

from silodp.crypto.bfv.params import SUPPORTED_DEGREES
from silodp.crypto.randomness import RandomSource

__all__ = ["BfvContext", "BfvKeyPair", "ciphertext_primes"]

_HEADER = struct.Struct("<HBBBBHQ")  # SEAL's SEALHeader
_MAGIC = 0xA15E


def _seal_primes(poly_degree: int, coeff_bits: tuple[int, ...]) -> Any:
    if poly_degree not in SUPPORTED_DEGREES:
        raise ValueError(f"Expected poly_degree={poly_degree!r} in {sorted(SUPPORTED_DEGREES)}.")
    return sealapi.CoeffModulus.Create(poly_degree, list(coeff_bits))


@cache
def ciphertext_primes(poly_degree: int, coeff_bits: tuple[int, ...]) -> tuple[int, ...]:
    """The ciphertext primes SEAL picks for ``coeff_bits`` (deterministic), the special prime
    last; the others form the modulus ``q`` ciphertexts live in."""
    return tuple(int(m.value()) for m in _seal_primes(poly_degree, coeff_bits))


def _scratch_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="silodp-bfv-", dir=base)
    os.close(fd)
    return path


class BfvContext:
    """SEAL context, encoder and evaluator for one plaintext prime (128-bit security: SEAL
    refuses parameters above the HE standard's modulus size)."""

    def __init__(self, poly_degree: int, coeff_bits: tuple[int, ...], plain_modulus: int) -> None:
        self._path = ""
        parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.BFV)
        parms.set_poly_modulus_degree(poly_degree)
        parms.set_coeff_modulus(_seal_primes(poly_degree, coeff_bits))
        parms.set_plain_modulus(sealapi.Modulus(plain_modulus))
        self.context = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.TC128)
        if not self.context.parameters_set():
            raise ValueError(
                f"SEAL refused BFV parameters poly_degree={poly_degree}, coeff_bits={coeff_bits}, "
                f"plain_modulus={plain_modulus}: {self.context.parameters_error_message()} "
                "(expected 128-bit secure parameters, HE standard)."
            )
        self.poly_degree = poly_degree
        self.plain_modulus = plain_modulus
        self.primes = ciphertext_primes(poly_degree, coeff_bits)[:-1]
        self.coeff_modulus = math.prod(self.primes)
        self.evaluator = sealapi.Evaluator(self.context)
        self._path = _scratch_path()
        self._version: tuple[int, int] | None = None

    @property
    def parms_id(self) -> Any:
        return self.context.first_parms_id()

    def plaintext(self, values: Sequence[int] | np.ndarray) -> Any:
        """The plaintext polynomial with coefficients ``values`` (residues below ``t``, at
        most ``poly_degree`` of them), built in SEAL's serial format (no batching)."""
        data = np.asarray(values, dtype=np.uint64)
        if data.ndim != 1 or not 1 <= data.size <= self.poly_degree:
            raise ValueError(f"Expected 1..{self.poly_degree} coefficients, got {data.shape}.")
        if data.size and int(data.max()) >= self.plain_modulus:
            raise ValueError(f"Expected coefficients below t={self.plain_modulus}.")
        dyn = self._framed(struct.pack("<Q", data.size) + data.tobytes())
        body = struct.pack("<4Q", 0, 0, 0, 0) + struct.pack("<Qd", data.size, 1.0) + dyn
        blob = self._framed(body)
        plain = sealapi.Plaintext()
        self._load(plain, blob)
        return plain

    @staticmethod
    def constant(value: int) -> Any:
        """The constant plaintext polynomial ``value``."""
        return sealapi.Plaintext(f"{int(value):X}")

    def coefficients(self, plain: Any) -> np.ndarray:
        """The ``poly_degree`` coefficients of a (non-NTT) plaintext."""
        out = np.zeros(self.poly_degree, dtype=np.uint64)
        count = plain.coeff_count()
        out[:count] = [plain.data(i) for i in range(count)]
        return out

    def to_bytes(self, obj: Any) -> bytes:
        try:
            obj.save(self._path)
            with open(self._path, "rb") as fh:
                return fh.read()
        finally:
            self._wipe()

    def _load(self, obj: Any, blob: bytes) -> None:
        """``obj.load`` from ``blob`` through the scratch file (tenseal's SEAL objects load
        only from files), emptied again at once: plaintexts and flooding polynomials are
        secret and must not stay in it."""
        try:
            with open(self._path, "wb") as fh:
                fh.write(blob)
            obj.load(self.context, self._path)
        finally:
            self._wipe()

    def _wipe(self) -> None:
        with open(self._path, "wb"):
            pass

    def ciphertext_from_bytes(self, blob: bytes) -> Any:
        """Loads a ciphertext, checked valid for this context (SEAL raises otherwise)."""
        ct = sealapi.Ciphertext(self.context)
        self._load(ct, blob)
        if not sealapi.is_valid_for(ct, self.context):
            raise ValueError("Ciphertext is not valid for this BFV context.")
        return ct

    def _seal_version(self) -> tuple[int, int]:
        if self._version is None:
            head = self.to_bytes(sealapi.Plaintext("1"))[: _HEADER.size]
            magic, _size, major, minor, _compr, _res, _total = _HEADER.unpack(head)
            if magic != _MAGIC:
                raise RuntimeError("Unexpected SEAL serialisation header.")
            self._version = (major, minor)
        return self._version

    def _framed(self, payload: bytes) -> bytes:
        """``payload`` behind an uncompressed SEAL header of this SEAL version."""
        major, minor = self._seal_version()
        total = _HEADER.size + len(payload)
        return _HEADER.pack(_MAGIC, _HEADER.size, major, minor, 0, 0, total) + payload

    def level(self, drop: int = 0) -> tuple[Any, tuple[int, ...]]:
        """The ``parms_id`` and the primes of ``q`` with its last ``drop`` primes dropped
        (modulus switching: ciphertexts at that level are smaller and cheaper)."""
        data = self.context.first_context_data()
        for _ in range(drop):
            data = data.next_context_data()
            if data is None:
                raise ValueError(f"Expected drop={drop} below {len(self.primes)} primes.")
        primes = tuple(int(m.value()) for m in data.parms().coeff_modulus())
        return data.parms_id(), primes

    def flooding(self, source: RandomSource, log2_bound: int, drop: int = 0) -> Any:
        """The ciphertext ``(f, 0)``, ``f`` uniform in ``[-2^log2_bound, 2^log2_bound)`` per
        coefficient, at the level with ``drop`` primes dropped; adding it floods ``c0``'s
        noise."""
        parms_id, primes = self.level(drop)
        n = self.poly_degree
        nbytes = (log2_bound + 1 + 7) // 8
        raw = source.token_bytes(n * nbytes)
        span = 1 << (log2_bound + 1)
        offset = 1 << log2_bound
        values = [
            (int.from_bytes(raw[i : i + nbytes], "little") % span) - offset
            for i in range(0, n * nbytes, nbytes)
        ]
        obj = np.array(values, dtype=object)
        rows = [np.asarray(obj % q, dtype=np.uint64) for q in primes]
        data = np.concatenate(rows + [np.zeros(n * len(primes), dtype=np.uint64)])
        dyn = self._framed(struct.pack("<Q", data.size) + data.tobytes())
        body = (
            struct.pack("<4Q", *parms_id)
            + b"\x00"
            + struct.pack("<QQQdQ", 2, n, len(primes), 1.0, 1)
            + dyn
        )
        return self.ciphertext_from_bytes(self._framed(body))

    def __del__(self) -> None:
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass


@dataclass
class BfvKeyPair:
    """The key holder's BFV keys, one pair per plaintext prime (never leaves the server)."""

    contexts: tuple[BfvContext, ...]
    public_keys: tuple[Any, ...]
    secret_keys: tuple[Any, ...]

    @classmethod
    def generate(cls, contexts: Sequence[BfvContext]) -> BfvKeyPair:
        publics, secrets = [], []
        for ctx in contexts:
            keygen = sealapi.KeyGenerator(ctx.context)
            pk = sealapi.PublicKey()
            keygen.create_public_key(pk)
            publics.append(pk)
            secrets.append(keygen.secret_key())
        return cls(tuple(contexts), tuple(publics), tuple(secrets))

    def __repr__(self) -> str:  # never print keys
        return f"BfvKeyPair(moduli={len(self.contexts)})"


def public_key_from_bytes(ctx: BfvContext, blob: bytes) -> Any:
    """Loads a public key (for ``ctx``) saved with :meth:`BfvContext.to_bytes`."""
    key = sealapi.PublicKey()
    ctx._load(key, blob)
    return key


def save_galois_keys(galois: Any, path: str) -> None:
    """Writes Galois keys (public evaluation keys, hundreds of MB at N = 16384) to ``path``."""
    galois.save(path)


def load_galois_keys(ctx: BfvContext, path: str) -> Any:
    galois = sealapi.GaloisKeys()
    galois.load(ctx.context, path)
    return galois


def encryptor(ctx: BfvContext, public_key: Any) -> Any:
    return sealapi.Encryptor(ctx.context, public_key)


def decryptor(ctx: BfvContext, secret_key: Any) -> Any:
    return sealapi.Decryptor(ctx.context, secret_key)


def new_ciphertext(ctx: BfvContext) -> Any:
    return sealapi.Ciphertext(ctx.context)


def new_plaintext() -> Any:
    return sealapi.Plaintext()


def evaluation_keys(ctx: BfvContext, secret_key: Any, galois_elements: Sequence[int]) -> Any:
    """Relinearisation keys and Galois keys for ``galois_elements`` (odd, below ``2N``) under
    ``secret_key``: what ciphertext products and automorphisms need (the key holder makes
    them; they reveal nothing of the key under RLWE with circular security)."""
    keygen = sealapi.KeyGenerator(ctx.context, secret_key)
    relin = sealapi.RelinKeys()
    keygen.create_relin_keys(relin)
    galois = sealapi.GaloisKeys()
    keygen.create_galois_keys([int(g) for g in galois_elements], galois)
    return relin, galois


def galois_keys(ctx: BfvContext, secret_key: Any, galois_elements: Sequence[int]) -> Any:
    """Galois keys only (no relinearisation keys) for ``galois_elements`` under
    ``secret_key``."""
    keygen = sealapi.KeyGenerator(ctx.context, secret_key)
    galois = sealapi.GaloisKeys()
    keygen.create_galois_keys([int(g) for g in galois_elements], galois)
    return galois


def multiply_relinearize(ctx: BfvContext, a: Any, b: Any, relin: Any) -> Any:
    """``a·b``, relinearised back to two components."""
    out = sealapi.Ciphertext(ctx.context)
    ctx.evaluator.multiply(a, b, out)
    ctx.evaluator.relinearize_inplace(out, relin)
    return out


def apply_galois(ctx: BfvContext, ct: Any, element: int, galois: Any) -> Any:
    """The automorphism ``X -> X^element`` applied to ``ct``'s plaintext."""
    out = sealapi.Ciphertext(ctx.context)
    ctx.evaluator.apply_galois(ct, int(element), galois, out)
    return out


def mod_switch_next(ctx: BfvContext, ct: Any) -> Any | None:
    """``ct`` with the last prime of its modulus dropped, or ``None`` at the last level."""
    if ct.parms_id() == ctx.context.last_parms_id():
        return None
    out = sealapi.Ciphertext(ctx.context)
    ctx.evaluator.mod_switch_to_next(ct, out)
    return out


def noise_budget(ctx: BfvContext, secret_key: Any, ct: Any) -> int:
    """SEAL's invariant noise budget of ``ct`` in bits (0: it no longer decrypts correctly).
    An empirical measure for benchmarks, not a worst-case bound."""
    return int(sealapi.Decryptor(ctx.context, secret_key).invariant_noise_budget(ct))
