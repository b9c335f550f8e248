"""``silodp bench protocol --zipf-route``: the measured cost of private fixed-point weights
under BFV, the route designed for configs whose ``n_max`` makes ``L = lcm(1..n_max)`` too
large for the exact encoding (``uldp_fmnist_zipf``: ``n_max = 6095``, ``L`` of 8,790 bits).
The route is not part of the protocol; this runs its operations for one subject at the
target's shape and extrapolates (``docs/protocol-performance.md``).

For one subject ``a`` and one CRT plaintext prime ``t``:

1-2. ``Enc(X^{n_a})`` under the key holder's key, in one of two ways (``product``):

   * ``chain``: the silos in turn multiply the ciphertext by their plaintext monomial
     ``X^{n_{s,a}}`` (a signed rotation of its coefficients: no noise growth, no depth) and
     add a fresh encryption of 0, so that no silo can link what it passed on to what comes
     later (without it, a silo that knows a ciphertext's randomness could test candidate
     counts against the weight it receives); the first silo encrypts its monomial;
   * ``tree``: every silo encrypts its monomial and the product of the S ciphertexts is
     taken by a party without the key (depth ``ceil(log2 S)``, relinearised);

   as ``n_a <= n_max < N`` there is no wrap-around ``X^N = -1``;
3. times the public plaintext ``F = N^{-1} Σ_{d=1}^{n_max} floor(2^k/d) X^{-d}`` (``X^{-d} =
   -X^{N-d}``), the constant coefficient is ``N^{-1} floor(2^k/n_a)`` (0 when ``n_a = 0``);
4. the trace, ``c <- c + σ_g(c)`` for the automorphisms ``X -> X^g``, ``g = 2^j + 1``
   (``j = 1..log2 N``), zeroes every other coefficient and multiplies the constant one by
   ``N``: ``Enc(floor(2^k/n_a))`` as a constant polynomial, the weight the silos' existing
   plaintext x ciphertext sum takes.

``k = ceil(log2(A·n_max·delta_bound/precision))`` keeps the weighting error
``Σ_a Σ_s n_{s,a} |floor(2^k/n_a)/2^k - 1/n_a|·|e|`` below the fixed-point precision; the
aggregate is then bounded like the exact encoding's with ``2^k`` in place of ``L``, which
sets the number of CRT primes.

The noise figures are SEAL's invariant noise budget (an empirical measure, not the
worst-case bounds the built BFV backend is planned with).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from silodp.crypto.bfv.params import TAMPER_MARGIN_BITS, batching_primes
from silodp.crypto.encoding import WeightingEncoding

__all__ = ["ZIPF_SHAPE", "ZIPF_COLUMNS", "fixed_point_weight", "run_zipf_route", "weight_bits"]

Row = dict[str, Any]

#: ``uldp_fmnist_zipf``'s shape (``silodp describe``): silos, public subjects, (silo, subject)
#: pairs with records, ``mnist_cnn``'s parameters, ``n_max``
ZIPF_SHAPE = {"silos": 50, "subjects": 909, "pairs": 438, "dim": 105_866, "n_max": 6095}
#: ring degree and SEAL's default 128-bit modulus for it (389 bits of q + a special prime)
POLY_DEGREE = 16384
COEFF_BITS = (48, 48, 48, 49, 49, 49, 49, 49, 49)
#: plaintext prime bits per product: the tree's depth leaves room for a silo's product after
#: the weight only with 20-bit primes at this degree; the chain keeps the fresh budget
PLAIN_BITS = {"chain": 32, "tree": 20}
#: statistical security of the flooding (bits), as the built backend's default
FLOOD_BITS = 40

ZIPF_COLUMNS = [
    "product",
    "poly_degree",
    "plain_bits",
    "moduli",
    "k",
    "depth",
    "budget_fresh",
    "budget_product",
    "budget_weight",
    "levels_dropped",
    "budget_after_silo",
    "budget_needed",
    "weight_ok",
    "encrypt_ms",
    "silo_step_ms",
    "galois_ms",
    "silo_product_ms",
    "subject_s",
    "training_cpu_h",
    "round_cpu_min",
    "weights_gb_per_silo",
]


def weight_bits(subjects: int, n_max: int, *, delta_bound: float, precision: float) -> int:
    """``k``: fixed-point bits of the weights ``floor(2^k/n_a)``."""
    return math.ceil(math.log2(subjects * n_max * delta_bound / precision))


def _moduli(silos: int, subjects: int, k: int, plain_bits: int, **bounds: float) -> int:
    """CRT primes of ``plain_bits`` bits for the aggregate bounded with ``2^k`` for ``L``
    (``bounds``: ``delta_bound``, ``noise_bound``, ``precision``)."""
    unit = WeightingEncoding(
        modulus=1 << 30000,
        n_max=1,
        num_subjects=subjects,
        num_silos=silos,
        packing=False,
        delta_bound=bounds["delta_bound"],
        noise_bound=bounds["noise_bound"],
        precision=bounds["precision"],
    )
    need = (2 * (unit.aggregate_bound << k)) << TAMPER_MARGIN_BITS
    return math.ceil(need.bit_length() / (plain_bits - 1))


def _tree_product(backend: Any, ctx: Any, cts: list[Any], relin: Any) -> tuple[Any, list[float]]:
    times = []
    while len(cts) > 1:
        nxt = []
        for i in range(0, len(cts) - 1, 2):
            start = time.perf_counter()
            nxt.append(backend.multiply_relinearize(ctx, cts[i], cts[i + 1], relin))
            times.append(time.perf_counter() - start)
        if len(cts) % 2:
            nxt.append(cts[-1])
        cts = nxt
    return cts[0], times


def fixed_point_weight(
    counts: list[int],
    *,
    n_max: int,
    k: int,
    product: str = "chain",
    poly_degree: int = POLY_DEGREE,
    coeff_bits: tuple[int, ...] = COEFF_BITS,
    plain_bits: int | None = None,
    budget_needed: int = FLOOD_BITS,
) -> Row:
    """Runs steps 1-4 for one subject whose silos hold ``counts`` records under one plaintext
    prime; returns the decrypted weight polynomial's coefficients, the expected weight, the
    noise budgets and the operation times. The weight is then switched to the lowest level
    at which its product with a full plaintext block keeps ``budget_needed`` bits."""
    from silodp.crypto.bfv import backend

    n = poly_degree
    if not 0 <= sum(counts) <= n_max < n:
        raise ValueError(f"Expected 0 <= sum(counts)={sum(counts)} <= n_max={n_max} < {n}.")
    if product not in PLAIN_BITS:
        raise ValueError(f"Expected product in {sorted(PLAIN_BITS)}, got {product!r}.")
    plain_bits = PLAIN_BITS[product] if plain_bits is None else plain_bits
    t = batching_primes(n, plain_bits, 1)[0]
    ctx = backend.BfvContext(n, coeff_bits, t)
    keys = backend.BfvKeyPair.generate([ctx])
    sk, pk = keys.secret_keys[0], keys.public_keys[0]
    galois = [(1 << j) + 1 for j in range(1, n.bit_length())]
    relin, gal = backend.evaluation_keys(ctx, sk, galois)  # relin: the tree only
    enc = backend.encryptor(ctx, pk)
    row: Row = {"product": product, "poly_degree": n, "plain_bits": plain_bits, "k": k}

    def encrypt(plain: Any) -> Any:
        ct = backend.new_ciphertext(ctx)
        enc.encrypt(plain, ct)
        return ct

    def monomial(c: int) -> Any:
        mono = np.zeros(c + 1, dtype=np.uint64)
        mono[c] = 1
        return ctx.plaintext(mono)

    start = time.perf_counter()
    first = encrypt(monomial(counts[0]))
    row["encrypt_ms"] = (time.perf_counter() - start) * 1e3
    row["budget_fresh"] = backend.noise_budget(ctx, sk, first)
    times = []
    if product == "chain":
        current = first
        for c in counts[1:]:
            start = time.perf_counter()
            shifted = backend.new_ciphertext(ctx)
            ctx.evaluator.multiply_plain(current, monomial(c), shifted)
            ctx.evaluator.add_inplace(shifted, encrypt(backend.BfvContext.constant(0)))
            current = shifted
            times.append(time.perf_counter() - start)
        row["depth"] = 0
    else:
        cts = [first]
        for c in counts[1:]:
            start = time.perf_counter()
            cts.append(encrypt(monomial(c)))
            times.append(time.perf_counter() - start)
        current, products = _tree_product(backend, ctx, cts, relin)
        times = [e + m for e, m in zip(times, products, strict=False)]  # a product per silo
        row["depth"] = math.ceil(math.log2(len(counts))) if len(counts) > 1 else 0
    # per silo: a monomial product and an Enc(0) (chain), or an encryption and a share of
    # the tree's products (tree)
    row["silo_step_ms"] = float(np.median(times)) * 1e3 if times else 0.0
    row["budget_product"] = backend.noise_budget(ctx, sk, current)
    n_inv = pow(n, -1, t)
    f = np.zeros(n, dtype=np.uint64)
    for d in range(1, n_max + 1):  # X^{-d} = -X^{N-d}
        f[n - d] = (-(2**k // d) * n_inv) % t
    weight = backend.new_ciphertext(ctx)
    ctx.evaluator.multiply_plain(current, ctx.plaintext(f), weight)
    times = []
    for g in galois:
        start = time.perf_counter()
        ctx.evaluator.add_inplace(weight, backend.apply_galois(ctx, weight, g, gal))
        times.append(time.perf_counter() - start)
    row["galois_ms"] = float(np.median(times)) * 1e3
    row["budget_weight"] = backend.noise_budget(ctx, sk, weight)
    plain = backend.new_plaintext()
    backend.decryptor(ctx, sk).decrypt(weight, plain)
    row["coefficients"] = ctx.coefficients(plain)
    n_a = sum(counts)
    row["expected"] = (2**k // n_a) % t if n_a else 0
    correct = row["coefficients"][0] == row["expected"] and not row["coefficients"][1:].any()
    row["weight_ok"] = "yes" if correct else "no"
    row["subject_s"] = (
        row["encrypt_ms"] + (len(counts) - 1) * row["silo_step_ms"] + len(galois) * row["galois_ms"]
    ) / 1e3
    # the silos' use: drop primes while the product with a full block still leaves the budget
    # for flooding and the sums, then time that product
    rng = np.random.default_rng(0)
    block = ctx.plaintext(rng.integers(0, t, size=n, dtype=np.uint64))
    row["budget_needed"] = budget_needed
    level, dropped = weight, 0
    while True:
        lower = backend.mod_switch_next(ctx, level)
        if lower is None:
            break
        probe = backend.new_ciphertext(ctx)
        ctx.evaluator.multiply_plain(lower, block, probe)
        if backend.noise_budget(ctx, sk, probe) < row["budget_needed"]:
            break
        level, dropped = lower, dropped + 1
    out = backend.new_ciphertext(ctx)
    reps = 5
    start = time.perf_counter()
    for _ in range(reps):
        ctx.evaluator.multiply_plain(level, block, out)
    row["silo_product_ms"] = (time.perf_counter() - start) / reps * 1e3
    row["levels_dropped"] = dropped
    row["budget_after_silo"] = backend.noise_budget(ctx, sk, out)
    row["ct_bytes"] = len(ctx.to_bytes(level))
    return row


def run_zipf_route(
    shape: dict[str, int] | None = None,
    *,
    delta_bound: float = 1.0,
    noise_bound: float = 1e3,
    precision: float = 1e-10,
    seed: int = 0,
    products: tuple[str, ...] = ("chain", "tree"),
) -> list[Row]:
    """The route's costs at ``shape`` (default :data:`ZIPF_SHAPE`), one row per way of
    forming ``Enc(X^{n_a})``: one subject spread over the silos, its weight checked against
    ``floor(2^k/n_a) mod t``, extrapolated to every subject and CRT prime (per training, when
    the silos sample and the weights are reused) and to a round's silo products (per round)."""
    sh = dict(ZIPF_SHAPE if shape is None else shape)
    silos, subjects, n_max = sh["silos"], sh["subjects"], sh["n_max"]
    k = weight_bits(subjects, n_max, delta_bound=delta_bound, precision=precision)
    rng = np.random.default_rng(seed)
    counts = [0] * silos  # a large subject spread over the silos, with zeros
    for s in rng.choice(silos, size=min(silos, 12), replace=False):
        counts[int(s)] = int(rng.integers(1, max(2, n_max // 12)))
    blocks = -(-sh["dim"] // POLY_DEGREE)
    rows = []
    for product in products:
        bounds = dict(delta_bound=delta_bound, noise_bound=noise_bound, precision=precision)
        moduli = _moduli(silos, subjects, k, PLAIN_BITS[product], **bounds)
        # after the silo's product: flooding 2^FLOOD_BITS times N x ciphertexts per silo
        # above a silo's noise, then the sums over subjects and silos
        needed = FLOOD_BITS + sum(
            math.ceil(math.log2(v)) for v in (POLY_DEGREE, blocks * moduli, subjects, silos)
        )
        row = fixed_point_weight(counts, n_max=n_max, k=k, product=product, budget_needed=needed)
        fixed_ms = row["encrypt_ms"] + row["silo_product_ms"]  # per silo ciphertext: Enc(0),
        # flooding and masks, about one encryption and one product
        round_ms = moduli * blocks * (sh["pairs"] * row["silo_product_ms"] + silos * fixed_ms)
        row.update(
            moduli=moduli,
            training_cpu_h=subjects * moduli * row["subject_s"] / 3600,
            round_cpu_min=round_ms / 1e3 / 60,
            weights_gb_per_silo=subjects * moduli * row["ct_bytes"] / 1e9,
        )
        rows.append({c: row[c] for c in ZIPF_COLUMNS})
    return rows
