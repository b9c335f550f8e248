"""Fixed-point weights under BFV: the silos compute ``Enc(floor(2^k/n_a))`` for every public
subject ``a`` under the key holder's key, and nobody learns a count.

The exact weights need ``L = lcm(1..n_max)`` in the plaintext, which outgrows any practical
CRT modulus for large ``n_max`` (8,790 bits for 6,095). Here ``L`` is ``2^k``
(:func:`~silodp.crypto.bfv.params.fixed_point_bits`), per CRT prime ``t``:

1. **chain**: the first silo (in silo order) encrypts the monomial ``X^{n_{1,a}}``; every
   following silo multiplies the ciphertext by its plaintext monomial ``X^{n_{s,a}}`` and
   adds a fresh ``Enc(0)``. The result encrypts ``X^{n_a}``: as ``n_a <= n_max < N`` there is
   no wrap-around ``X^N = -1``, so this is a one-hot encoding of ``n_a``. Every silo touches
   every subject's ciphertext (``X^0 = 1`` when it holds none), so the pattern of messages
   does not depend on who holds whom;
2. the last silo multiplies by the public plaintext
   ``F = N^{-1} sum_{d=1}^{n_max} floor(2^k/d) X^{-d}`` (``X^{-d} = -X^{N-d}``): the constant
   coefficient becomes ``N^{-1} floor(2^k/n_a)``, and 0 when ``n_a = 0``;
3. and applies the trace ``c <- c + σ_g(c)`` over :func:`~silodp.crypto.bfv.params.trace_elements`
   (Galois keys from the key holder): every other coefficient becomes 0 and the constant one
   is multiplied by ``N``. The result, ``Enc(floor(2^k/n_a))`` as a constant polynomial, is
   what the silos' plaintext x ciphertext sums take, as the exact weights.

The floor keeps ``sum_s n_{s,a} floor(2^k/n_a) / 2^k <= 1``, which the sensitivity needs.
The worst-case noise of every step is bounded in :mod:`silodp.crypto.bfv.params`.

What each party learns (honest-but-curious, no collusion):

* **the key holder** sees none of these ciphertexts: in a deployment the chain's messages go
  from silo to silo under the silos' pairwise authenticated encryption (the server relays
  only those), and the weights go from the last silo to the others the same way. It then
  sees the silos' flooded, masked sums as with exact weights: the noise of a weight enters a
  silo's message only there, under the flooding bound;
* **a silo** sees ciphertexts under a key it does not hold (IND-CPA under RLWE; circular
  security for the Galois keys). The fresh ``Enc(0)`` of each hop matters: without it the
  first silo, which knows its ciphertext's randomness, could recompute the rest of the chain
  for every candidate count and compare with the weight it receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from silodp.crypto.bfv.backend import BfvContext, apply_galois, new_ciphertext
from silodp.crypto.bfv.params import trace_elements

__all__ = ["chain_hop", "chain_start", "finish_weights", "monomial", "weight_polynomial"]


def weight_polynomial(poly_degree: int, t: int, n_max: int, k: int) -> np.ndarray:
    """The coefficients of ``F = N^{-1} sum_{d=1}^{n_max} floor(2^k/d) X^{-d}`` modulo
    ``t``."""
    n = poly_degree
    if not 1 <= n_max < n:
        raise ValueError(f"Expected 1 <= n_max={n_max} < poly_degree={n}.")
    n_inv = pow(n, -1, t)
    f = np.zeros(n, dtype=np.uint64)
    for d in range(1, n_max + 1):  # X^{-d} = -X^{N-d}
        f[n - d] = (-((1 << k) // d) * n_inv) % t
    return f


def monomial(ctx: BfvContext, power: int) -> Any:
    """The plaintext ``X^power`` (``0 <= power < N``)."""
    if not 0 <= power < ctx.poly_degree:
        raise ValueError(f"Expected a power in [0, {ctx.poly_degree}), got {power}.")
    coeffs = np.zeros(power + 1, dtype=np.uint64)
    coeffs[power] = 1
    return ctx.plaintext(coeffs)


def chain_start(ctx: BfvContext, encryptor: Any, counts: Sequence[int]) -> list[Any]:
    """The first silo: ``Enc(X^{n_{s,a}})`` for every public subject's count."""
    out = []
    for c in counts:
        ct = new_ciphertext(ctx)
        encryptor.encrypt(monomial(ctx, int(c)), ct)
        out.append(ct)
    return out


def chain_hop(
    ctx: BfvContext, encryptor: Any, ciphertexts: Sequence[Any], counts: Sequence[int]
) -> list[Any]:
    """A following silo: each ciphertext times ``X^{n_{s,a}}``, plus a fresh ``Enc(0)``."""
    if len(ciphertexts) != len(counts):
        raise ValueError(f"Expected {len(counts)} ciphertexts, got {len(ciphertexts)}.")
    ev = ctx.evaluator
    out = []
    for ct, c in zip(ciphertexts, counts, strict=True):
        fresh = new_ciphertext(ctx)
        encryptor.encrypt_zero(fresh)
        if c:
            shifted = new_ciphertext(ctx)
            ev.multiply_plain(ct, monomial(ctx, int(c)), shifted)
            ev.add_inplace(shifted, fresh)
            out.append(shifted)
        else:  # X^0 = 1: the ciphertext itself, re-randomised
            ev.add_inplace(fresh, ct)
            out.append(fresh)
    return out


def finish_weights(
    ctx: BfvContext, ciphertexts: Sequence[Any], f_plain: Any, galois: Any
) -> list[Any]:
    """The last silo: each ``Enc(X^{n_a})`` times ``F``, then the trace: ``Enc(floor(2^k/n_a))``
    as a constant polynomial."""
    ev = ctx.evaluator
    elements = trace_elements(ctx.poly_degree)
    out = []
    for ct in ciphertexts:
        weight = new_ciphertext(ctx)
        ev.multiply_plain(ct, f_plain, weight)
        for g in elements:
            ev.add_inplace(weight, apply_galois(ctx, weight, g, galois))
        out.append(weight)
    return out
