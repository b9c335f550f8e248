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
   what the silos' plaintext x ciphertext sums take, as the exact weights, after switching
   it down to the plan's level (fewer primes of ``q``: smaller, and cheaper products).

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

import multiprocessing
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from silodp.crypto.bfv.backend import (
    BfvContext,
    apply_galois,
    encryptor,
    load_galois_keys,
    new_ciphertext,
    public_key_from_bytes,
    save_galois_keys,
)
from silodp.crypto.bfv.params import trace_elements

__all__ = [
    "ChainSpec",
    "chain_hop",
    "chain_start",
    "compute_weights",
    "finish_weights",
    "monomial",
    "run_chain",
    "weight_polynomial",
]


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
        # the same two operations whatever the count (X^0 = 1 included), so a hop's duration
        # does not tell how many subjects the silo holds
        shifted = new_ciphertext(ctx)
        ev.multiply_plain(ct, monomial(ctx, int(c)), shifted)
        fresh = new_ciphertext(ctx)
        encryptor.encrypt_zero(fresh)
        ev.add_inplace(shifted, fresh)
        out.append(shifted)
    return out


def finish_weights(
    ctx: BfvContext,
    ciphertexts: Sequence[Any],
    f_plain: Any,
    galois: Any,
    parms_id: Any = None,
) -> list[Any]:
    """The last silo: each ``Enc(X^{n_a})`` times ``F``, then the trace: ``Enc(floor(2^k/n_a))``
    as a constant polynomial, switched down to ``parms_id`` (the plan's level) if given."""
    ev = ctx.evaluator
    elements = trace_elements(ctx.poly_degree)
    out = []
    for ct in ciphertexts:
        weight = new_ciphertext(ctx)
        ev.multiply_plain(ct, f_plain, weight)
        for g in elements:
            ev.add_inplace(weight, apply_galois(ctx, weight, g, galois))
        if parms_id is not None:
            ev.mod_switch_to_inplace(weight, parms_id)
        out.append(weight)
    return out


def run_chain(
    ctx: BfvContext,
    enc: Any,
    counts: Sequence[Sequence[int]],
    f_plain: Any,
    galois: Any,
    parms_id: Any = None,
) -> list[Any]:
    """The whole chain for some subjects under one prime: ``counts[i]`` are the ``i``-th silo's
    counts of those subjects, silos in chain order (each step is that silo's own call)."""
    cts = chain_start(ctx, enc, counts[0])
    for row in counts[1:]:
        cts = chain_hop(ctx, enc, cts, row)
    return finish_weights(ctx, cts, f_plain, galois, parms_id)


@dataclass(frozen=True)
class ChainSpec:
    """Public parameters of the weights under one prime, as a worker process rebuilds them."""

    poly_degree: int
    coeff_bits: tuple[int, ...]
    plain_modulus: int
    n_max: int
    weight_bits: int
    level_drop: int
    public_key: bytes = field(repr=False)


def _inputs(ctx: BfvContext, spec: ChainSpec) -> tuple[Any, Any, Any]:
    """The encryptor, ``F`` and the weights' level for ``spec`` in ``ctx``."""
    enc = encryptor(ctx, public_key_from_bytes(ctx, spec.public_key))
    f = weight_polynomial(spec.poly_degree, spec.plain_modulus, spec.n_max, spec.weight_bits)
    level, _ = ctx.level(spec.level_drop)
    return enc, ctx.plaintext(f), level


def _worker(spec: ChainSpec, galois_path: str, counts: list[list[int]]) -> list[bytes]:
    ctx = BfvContext(spec.poly_degree, spec.coeff_bits, spec.plain_modulus)
    enc, f_plain, level = _inputs(ctx, spec)
    galois = load_galois_keys(ctx, galois_path)
    return [ctx.to_bytes(ct) for ct in run_chain(ctx, enc, counts, f_plain, galois, level)]


def compute_weights(
    contexts: Sequence[BfvContext],
    specs: Sequence[ChainSpec],
    galois: Sequence[Any],
    counts: Sequence[Sequence[int]],
    *,
    workers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[list[Any]]:
    """Per prime, the weight ciphertexts of every subject (``counts``: per silo in chain order,
    per subject). With ``workers > 1`` the subjects are split over that many processes (each
    runs the same calls for its share, the Galois keys passed through a temporary file); each
    part's ciphertexts come back serialised and are loaded into ``contexts`` as it finishes.
    A failed part cancels the others and raises, naming the part."""
    subjects = len(counts[0])
    if workers <= 1 or subjects < 2:
        out = []
        for j, (ctx, spec) in enumerate(zip(contexts, specs, strict=True)):
            enc, f_plain, level = _inputs(ctx, spec)
            out.append(run_chain(ctx, enc, counts, f_plain, galois[j], level))
            if progress is not None:
                progress(f"fixed-point weights: prime {j + 1}/{len(specs)} done")
        return out
    parts = min(workers, subjects)
    bounds = np.linspace(0, subjects, parts + 1).astype(int)
    results: list[list[list[Any]]] = [[[] for _ in range(parts)] for _ in specs]
    paths = []
    try:
        for g in galois:
            fd, path = tempfile.mkstemp(prefix="silodp-galois-")
            os.close(fd)
            paths.append(path)
            save_galois_keys(g, path)
        # as silodp.crypto.weighted_sum.run_chunks: fork where there is one (no re-import of
        # the caller's __main__; the workers use SEAL only, from files and pickled counts)
        methods = multiprocessing.get_all_start_methods()
        start = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(max_workers=parts, mp_context=start) as pool:
            futures = {
                pool.submit(
                    _worker,
                    spec,
                    paths[j],
                    [list(row[bounds[c] : bounds[c + 1]]) for row in counts],
                ): (j, c)
                for j, spec in enumerate(specs)
                for c in range(parts)
            }
            for done, future in enumerate(as_completed(futures), start=1):
                j, c = futures[future]
                try:
                    blobs = future.result()
                except Exception as err:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise RuntimeError(
                        f"Fixed-point weights: the part of prime {j + 1}/{len(specs)} with "
                        f"subjects {bounds[c]}..{bounds[c + 1] - 1} failed in its worker "
                        f"process ({type(err).__name__}: {err}); a killed worker often means "
                        "too little memory for the ciphertexts."
                    ) from err
                results[j][c] = [contexts[j].ciphertext_from_bytes(b) for b in blobs]
                del blobs
                if progress is not None:
                    progress(f"fixed-point weights: {done}/{len(futures)} parts done")
    finally:
        for path in paths:
            os.unlink(path)
    return [[ct for chunk in per_prime for ct in chunk] for per_prime in results]
