"""Fresh encryption randomness for the silos' outgoing ciphertexts.

The server holds the Paillier secret key, so it could read the randomness ``rho`` of any
ciphertext it receives (``rho = c^(n^-1 mod phi) mod n``). A silo's weighted sum is computed
from the server's own weight ciphertexts; without fresh randomness its ``rho`` is a product of
powers of values the server chose, with exponents derived from the silo's data. Every ciphertext
a silo sends is therefore multiplied by a fresh ``n``-th residue ``R`` (an encryption of zero):

* :class:`FullRerandomizer` - ``R = r^n`` with ``r`` uniform in ``Z_n^*``: the randomness of the
  result is uniform whatever it was before (statistical hiding). One full exponentiation each.
* :class:`FixedBaseRerandomizer` (default) - ``R = (-1)^b * H^x`` with ``H = h^n`` for a
  silo-secret uniform ``h`` of Jacobi symbol ``-1`` (so the Jacobi symbol of the result, the
  one property anyone can compute, is uniform), a random sign and a random 256-bit ``x``,
  evaluated with a precomputed window table: ~33 modular products instead of ~3700. This is the
  short-exponent randomiser of Damgard-Jurik-Nielsen; its hiding against the key holder is
  computational (discrete logarithms in the large prime-order parts of ``Z_p^*``, ``Z_q^*``
  with an unknown base and exponent), not statistical. Choose ``"full"`` when that matters more
  than speed.

The *plaintext* of each silo's ciphertext is masked information-theoretically by the pairwise
additive masks in either case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import gmpy2

from silodp.crypto.fixedbase import FixedBaseTable
from silodp.crypto.paillier import PaillierPublicKey
from silodp.crypto.randomness import RandomSource, randbits, random_unit

__all__ = [
    "FixedBaseRerandomizer",
    "FullRerandomizer",
    "RerandomizationMode",
    "Rerandomizer",
    "make_rerandomizer",
]

RerandomizationMode = Literal["fixed-base", "full"]
SHORT_EXPONENT_BITS = 256


class Rerandomizer(Protocol):
    """Draws secret inputs (in the party's process) and maps each to an ``n``-th residue."""

    def draw(self, source: RandomSource, count: int) -> list[int]:  # pragma: no cover
        ...

    def factor(self, secret: int) -> Any:  # pragma: no cover
        ...


@dataclass(frozen=True, repr=False)
class FullRerandomizer:
    public_key: PaillierPublicKey

    def draw(self, source: RandomSource, count: int) -> list[int]:
        return [random_unit(source, self.public_key.n) for _ in range(count)]

    def factor(self, secret: int) -> Any:
        pk = self.public_key
        return gmpy2.powmod(gmpy2.mpz(secret), pk.n_mpz, pk.n_squared)

    def __repr__(self) -> str:
        return "FullRerandomizer()"


@dataclass(frozen=True, repr=False)
class FixedBaseRerandomizer:
    public_key: PaillierPublicKey
    table: FixedBaseTable = field(repr=False)
    exponent_bits: int = SHORT_EXPONENT_BITS

    @classmethod
    def create(
        cls, public_key: PaillierPublicKey, source: RandomSource, *, window_bits: int = 8
    ) -> FixedBaseRerandomizer:
        n = public_key.n
        while True:  # Jacobi symbol -1: the parity of x makes the result's symbol uniform
            h = random_unit(source, n)
            if gmpy2.jacobi(h, n) == -1:
                break
        base = gmpy2.powmod(h, public_key.n_mpz, public_key.n_squared)
        table = FixedBaseTable.build(base, public_key.n_squared, SHORT_EXPONENT_BITS, window_bits)
        return cls(public_key, table)

    def draw(self, source: RandomSource, count: int) -> list[int]:
        return [randbits(source, self.exponent_bits + 1) for _ in range(count)]

    def factor(self, secret: int) -> Any:
        value = self.table.pow(secret >> 1)
        if secret & 1:  # (-1)^n = -1: multiplying by -1 adds another n-th residue
            value = self.public_key.n_squared - value
        return value

    def __repr__(self) -> str:
        return "FixedBaseRerandomizer()"


def make_rerandomizer(
    mode: RerandomizationMode, public_key: PaillierPublicKey, source: RandomSource
) -> Rerandomizer:
    if mode == "full":
        return FullRerandomizer(public_key)
    if mode == "fixed-base":
        return FixedBaseRerandomizer.create(public_key, source)
    raise ValueError(f"Expected rerandomization in ('fixed-base', 'full'), got {mode!r}.")
