"""``base^e mod m`` for a fixed *secret* exponent through OpenSSL's constant-time Montgomery
exponentiation (``BN_mod_exp_mont_consttime`` of libcrypto).

Paillier decryption raises every ciphertext to ``p - 1`` modulo ``p^2``: the exponent is the
private key. gmpy2's ``powmod`` runs in time that depends on the exponent's bits and, on this
kind of host, took about twice as long as OpenSSL's fixed-window, constant-time routine (5.2 ms
against 2.7-2.9 ms for a 1536-bit exponent modulo a 3072-bit ``p^2``). libcrypto is the library
Python's own ``ssl`` and ``hashlib`` modules are linked against, so it is present wherever
Python is; if it cannot be loaded, :class:`SecretPower` falls back to gmpy2 with a
``RuntimeWarning`` (``backend`` says which is in use).

The OpenSSL objects belong to one process: after a ``fork`` (worker processes) they are
rebuilt on first use, and pickling keeps only the modulus and exponent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings
from typing import Any

import gmpy2

__all__ = ["SecretPower", "openssl_available"]

_LIB: Any = None
_LOADED = False


def _load() -> Any:
    global _LIB, _LOADED
    if _LOADED:
        return _LIB
    _LOADED = True
    name = ctypes.util.find_library("crypto")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        vp, cp, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
        for fn, res, args in (
            ("BN_new", vp, []),
            ("BN_clear_free", None, [vp]),
            ("BN_CTX_new", vp, []),
            ("BN_CTX_free", None, [vp]),
            ("BN_bin2bn", vp, [cp, i, vp]),
            ("BN_bn2binpad", i, [vp, ctypes.c_void_p, i]),
            ("BN_MONT_CTX_new", vp, []),
            ("BN_MONT_CTX_free", None, [vp]),
            ("BN_MONT_CTX_set", i, [vp, vp, vp]),
            ("BN_mod_exp_mont_consttime", i, [vp, vp, vp, vp, vp, vp]),
        ):
            f = getattr(lib, fn)
            f.restype = res
            f.argtypes = args
    except (OSError, AttributeError):
        return None
    _LIB = lib
    return lib


def openssl_available() -> bool:
    """Whether libcrypto's constant-time exponentiation could be loaded."""
    return _load() is not None


class _Native:
    """The OpenSSL state of one :class:`SecretPower` in one process."""

    def __init__(self, lib: Any, modulus: int, exponent: int) -> None:
        self.lib = lib
        self.size = (modulus.bit_length() + 7) // 8
        self.ctx = lib.BN_CTX_new()
        self.mod = self._bn(modulus)
        self.exp = self._bn(exponent)
        self.base = lib.BN_new()
        self.out = lib.BN_new()
        self.mont = lib.BN_MONT_CTX_new()
        if not all((self.ctx, self.mod, self.exp, self.base, self.out, self.mont)):
            raise MemoryError("OpenSSL could not allocate big numbers.")
        if lib.BN_MONT_CTX_set(self.mont, self.mod, self.ctx) != 1:
            raise ValueError("OpenSSL refused the modulus (it must be odd).")
        self.buffer = ctypes.create_string_buffer(self.size)

    def _bn(self, value: int) -> Any:
        raw = value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")
        return self.lib.BN_bin2bn(raw, len(raw), None)

    def pow(self, base: int) -> int:
        lib = self.lib
        raw = base.to_bytes(self.size, "big")
        if not lib.BN_bin2bn(raw, len(raw), self.base):
            raise MemoryError("OpenSSL could not convert the base.")
        if (
            lib.BN_mod_exp_mont_consttime(
                self.out, self.base, self.exp, self.mod, self.ctx, self.mont
            )
            != 1
        ):
            raise ArithmeticError("OpenSSL modular exponentiation failed.")
        if lib.BN_bn2binpad(self.out, self.buffer, self.size) != self.size:
            raise ArithmeticError("OpenSSL result does not fit the modulus size.")
        return int.from_bytes(self.buffer.raw, "big")

    def __del__(self) -> None:  # also after a failed __init__: free what was allocated
        lib = self.lib
        for name in ("base", "out", "exp", "mod"):
            if getattr(self, name, None):
                lib.BN_clear_free(getattr(self, name))
        if getattr(self, "mont", None):
            lib.BN_MONT_CTX_free(self.mont)
        if getattr(self, "ctx", None):
            lib.BN_CTX_free(self.ctx)


class SecretPower:
    """``x -> x^exponent mod modulus`` for an odd ``modulus`` and a secret ``exponent >= 1``.

    ``backend="auto"`` uses OpenSSL when it loads, else gmpy2; ``"gmpy2"`` forces gmpy2.
    """

    def __init__(self, modulus: int, exponent: int, *, backend: str = "auto") -> None:
        modulus, exponent = int(modulus), int(exponent)
        if modulus < 3 or modulus % 2 == 0:
            raise ValueError("Expected an odd modulus >= 3.")
        if exponent < 1:
            raise ValueError("Expected an exponent >= 1.")
        if backend not in ("auto", "gmpy2"):
            raise ValueError(f"Expected backend='auto' or 'gmpy2', got {backend!r}.")
        self._modulus = modulus
        self._exponent = exponent
        self._want_openssl = backend == "auto"
        self._native: _Native | None = None
        self._pid = -1

    def __repr__(self) -> str:  # never print the exponent
        return f"SecretPower(bits={self._modulus.bit_length()}, backend={self.backend!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"modulus": self._modulus, "exponent": self._exponent, "auto": self._want_openssl}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["modulus"], state["exponent"], backend="auto" if state["auto"] else "gmpy2"
        )

    def _state(self) -> _Native | None:
        if not self._want_openssl:
            return None
        pid = os.getpid()
        if self._pid != pid:
            lib = _load()
            if lib is None:
                warnings.warn(
                    "libcrypto could not be loaded: secret exponentiations fall back to gmpy2, "
                    "which does not run in constant time.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._native = None if lib is None else _Native(lib, self._modulus, self._exponent)
            self._pid = pid
        return self._native

    @property
    def backend(self) -> str:
        return "openssl" if self._want_openssl and _load() is not None else "gmpy2"

    def __call__(self, base: Any) -> Any:
        x = gmpy2.mpz(base) % self._modulus
        native = self._state()
        if native is None:
            return gmpy2.powmod(x, self._exponent, self._modulus)
        return gmpy2.mpz(native.pow(int(x)))
