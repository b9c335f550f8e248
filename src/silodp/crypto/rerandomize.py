"""Fresh encryption randomness for the silos' outgoing ciphertexts.

The server holds the Paillier secret key, so it could read the randomness ``rho`` of any
ciphertext it receives (``rho = c^(n^-1 mod phi) mod n``). A silo's weighted sum is computed
from the server's own weight ciphertexts; without fresh randomness its ``rho`` is a product of
powers of values the server chose, with exponents derived from the silo's data. Every ciphertext
a silo sends is therefore multiplied by ``R = r^n`` for a fresh ``r`` uniform in ``Z_n^*`` (an
encryption of zero): ``rho * r`` is uniform in ``Z_n^*`` whatever ``rho`` was, so the
ciphertext is a fresh encryption of its plaintext and says nothing beyond it (perfect hiding,
given ``r``). One full exponentiation per ciphertext.

Cheaper randomisers that raise a fixed secret ``h^n`` to a short exponent do not hide against
the key holder: knowing ``p`` and ``q``, it can project any ciphertext onto the small-order
subgroups of ``Z_p^*`` and ``Z_q^*`` (the Legendre symbol mod ``p`` is one such projection),
where powers of one base cover at most a cyclic part of a non-cyclic group, so the projection of
the silo's data-dependent factor shows through (``tests/crypto/test_crypto_paillier.py``
checks that the factors drawn here cover the 2-parts of both groups).

The *plaintext* of each silo's ciphertext is masked information-theoretically by the pairwise
additive masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import gmpy2

from silodp.crypto.paillier import PaillierPublicKey
from silodp.crypto.randomness import RandomSource, random_unit

__all__ = ["FullRerandomizer", "Rerandomizer"]


class Rerandomizer(Protocol):
    """Draws secret inputs (in the party's process) and maps each to an ``n``-th residue."""

    def draw(self, source: RandomSource, count: int) -> list[int]:  # pragma: no cover
        ...

    def factor(self, secret: int) -> Any:  # pragma: no cover
        ...


@dataclass(frozen=True, repr=False)
class FullRerandomizer:
    """``R = r^n mod n^2`` for ``r`` uniform in ``Z_n^*``."""

    public_key: PaillierPublicKey

    def draw(self, source: RandomSource, count: int) -> list[int]:
        return [random_unit(source, self.public_key.n) for _ in range(count)]

    def factor(self, secret: int) -> Any:
        pk = self.public_key
        return gmpy2.powmod(gmpy2.mpz(secret), pk.n_mpz, pk.n_squared)

    def __repr__(self) -> str:
        return "FullRerandomizer()"
