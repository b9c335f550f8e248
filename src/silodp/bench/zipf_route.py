"""``silodp bench protocol --zipf-route``: the fixed-point weights
(:mod:`silodp.crypto.bfv.fixed_weights`, ``weight_encoding = "fixed_point"``) at
``uldp_fmnist_zipf``'s shape, whose ``n_max`` makes ``L = lcm(1..n_max)`` too large for exact
weights (8,790 bits for the data's largest subject, 6,095 records).

The row: the plan :class:`~silodp.crypto.bfv.simulation.BfvProtocolConfig` makes for that shape
(CRT primes, the primes of ``q`` dropped before the silos' products, flooding bits, the
weight's worst-case noise bound); one subject spread over 12 of the silos, its chain run
through every silo under the plan's first prime with the code a run uses
(:func:`~silodp.crypto.bfv.fixed_weights.run_chain`), checked against ``floor(2^k/n_a)`` with
every other coefficient zero, and its noise as SEAL measures it beside the bounds, after the
trace (``trace_noise_*``, the chain, ``F`` and the trace's bound) and after the switch down
(``noise_*``); the costs
extrapolated from that chain's CPU time (the weights, once per training) and from
:func:`~silodp.crypto.bfv.simulation.estimate_bfv_round` (a round's silo products, ``Enc(0)``,
flooding and decryptions).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from silodp.crypto.bfv.params import BfvPlan

__all__ = ["ZIPF_COLUMNS", "ZIPF_SHAPE", "run_zipf_route", "subject_weight", "zipf_plan"]

Row = dict[str, Any]

#: ``uldp_fmnist_zipf``'s shape (``silodp describe``): silos, public subjects, (silo, subject)
#: pairs with records, ``mnist_cnn``'s parameters, and the config's ``n_max``
ZIPF_SHAPE = {"silos": 50, "subjects": 909, "pairs": 438, "dim": 105_866, "n_max": 10000}

ZIPF_COLUMNS = [
    "poly_degree",
    "primes",
    "plain_bits",
    "level_drop",
    "k",
    "flood_bits",
    "trace_noise_bound_bits",
    "trace_noise_bits",
    "noise_bound_bits",
    "noise_bits",
    "weight_ok",
    "subject_prime_s",
    "weights_cpu_min",
    "round_cpu_min",
    "weights_gb_per_silo",
]


def zipf_plan(shape: dict[str, int], *, noise_bound: float = 1e3) -> BfvPlan:
    """The fixed-point plan for ``shape`` (delta bound 1, precision 1e-10, as a run's)."""
    from silodp.crypto.bfv.simulation import BfvProtocolConfig

    config = BfvProtocolConfig(
        silo_ids=tuple(range(shape["silos"])),
        subject_ids=tuple(range(shape["subjects"])),
        n_max=shape["n_max"],
        delta_bound=1.0,
        noise_bound=noise_bound,
        precision=1e-10,
        weights="fixed_point",
    )
    return config.plan(shape["dim"])


def subject_weight(plan: BfvPlan, counts: list[int]) -> Row:
    """One subject's weight through the whole chain (``counts``: each silo's records of it)
    under the plan's first prime: whether it decrypts to ``floor(2^k/n_a)`` alone, its noise
    bits against the plan's bound, and the chain's CPU seconds."""
    from silodp.crypto.bfv import backend, fixed_weights
    from silodp.crypto.bfv.params import trace_elements

    n_a = sum(counts)
    if not 0 <= n_a <= plan.encoding.n_max:
        raise ValueError(f"Expected 0 <= sum(counts)={n_a} <= n_max={plan.encoding.n_max}.")
    k = plan.encoding.weight_bits
    if k is None:
        raise ValueError("Expected a fixed-point plan (weights='fixed_point').")
    params = plan.params
    t = plan.plain_moduli[0]
    ctx = backend.BfvContext(params.poly_degree, params.coeff_bits, t)
    keys = backend.BfvKeyPair.generate([ctx])
    sk = keys.secret_keys[0]
    galois = backend.galois_keys(ctx, sk, trace_elements(params.poly_degree))
    enc = backend.encryptor(ctx, keys.public_keys[0])
    f = fixed_weights.weight_polynomial(params.poly_degree, t, plan.encoding.n_max, k)
    level, primes = ctx.level(plan.level_drop)
    start = time.process_time()
    (weight,) = fixed_weights.run_chain(
        ctx, enc, [[c] for c in counts], ctx.plaintext(f), galois, level
    )
    seconds = time.process_time() - start
    (top,) = fixed_weights.run_chain(ctx, enc, [[c] for c in counts], ctx.plaintext(f), galois)
    trace_noise = _noise_bits(ctx, sk, top, plan.coeff_modulus, t)
    plain = backend.new_plaintext()
    backend.decryptor(ctx, sk).decrypt(weight, plain)
    coeffs = ctx.coefficients(plain)
    want = ((1 << k) // n_a) % t if n_a else 0
    ok = int(coeffs[0]) == want and not coeffs[1:].any()
    return {
        "weight_ok": "yes" if ok else "no",
        "trace_noise_bits": trace_noise,
        "noise_bits": _noise_bits(ctx, sk, weight, math.prod(primes), t),
        "subject_prime_s": seconds,
        "ct_bytes": len(ctx.to_bytes(weight)),
    }


def _noise_bits(ctx: Any, secret_key: Any, ct: Any, modulus: int, t: int) -> int:
    """Bits of a ciphertext's noise ``v`` as SEAL measures it: its invariant noise
    ``|t (c0 + c1 s) mod q|`` has ``bits(q) - budget - 1`` bits, about ``bits(t) + bits(v)``."""
    from silodp.crypto.bfv import backend

    budget = backend.noise_budget(ctx, secret_key, ct)
    return modulus.bit_length() - budget - 1 - (t.bit_length() - 1)


def run_zipf_route(
    shape: dict[str, int] | None = None, *, noise_bound: float = 1e3, seed: int = 0
) -> list[Row]:
    """The row described in the module docstring, at ``shape`` (default
    :data:`ZIPF_SHAPE`)."""
    from silodp.crypto.bfv.backend import ciphertext_primes
    from silodp.crypto.bfv.params import fixed_weight_noise
    from silodp.crypto.bfv.simulation import estimate_bfv_round

    sh = dict(ZIPF_SHAPE if shape is None else shape)
    plan = zipf_plan(sh, noise_bound=noise_bound)
    rng = np.random.default_rng(seed)
    counts = [0] * sh["silos"]  # a large subject spread over some silos, zeros elsewhere
    for s in rng.choice(sh["silos"], size=min(sh["silos"], 12), replace=False):
        counts[int(s)] = int(rng.integers(1, max(2, sh["n_max"] // 12)))
    measured = subject_weight(plan, counts)
    estimate = estimate_bfv_round(
        plan, pairs=sh["pairs"], num_subjects=sh["subjects"], num_silos=sh["silos"]
    )
    weights = sh["subjects"] * len(plan.plain_moduli)
    row: Row = {
        "poly_degree": plan.params.poly_degree,
        "primes": len(plan.plain_moduli),
        "plain_bits": plan.plain_moduli[0].bit_length(),
        "level_drop": plan.level_drop,
        "k": plan.encoding.weight_bits,
        "flood_bits": plan.flood_log2,
        "trace_noise_bound_bits": fixed_weight_noise(
            plan.params.poly_degree,
            plan.plain_moduli[0],
            num_silos=sh["silos"],
            n_max=sh["n_max"],
            ciphertext_primes=ciphertext_primes(plan.params.poly_degree, plan.params.coeff_bits),
        ).bit_length(),
        "noise_bound_bits": plan.weight_noise_bound.bit_length(),
        **measured,
        "weights_cpu_min": weights * measured["subject_prime_s"] / 60,
        "round_cpu_min": estimate.cpu_seconds / 60,
        "weights_gb_per_silo": weights * measured["ct_bytes"] / 1e9,
    }
    return [{c: row[c] for c in ZIPF_COLUMNS}]
