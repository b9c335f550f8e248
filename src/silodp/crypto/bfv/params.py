"""Public parameters of the BFV weighting backend, derived from public values only.

The ring has degree ``N`` (8192 or 16384) and a ciphertext modulus of at most the Homomorphic
Encryption Standard's 128-bit bound (``log2 Q <= 218`` for ``N = 8192``, 438 for 16384),
checked again by SEAL; the last prime is SEAL's special prime (public-key encryption computes
at it and divides it out; fixed-point weights also use it to switch keys), the others form
``q``. Plaintexts are coefficient vectors:
the encrypted weight is a constant polynomial, so ``w * P(x)`` multiplies every coefficient
of ``P`` by ``w`` and no batching (slot) encoding is needed. The aggregate must be an exact
integer of up to ``log2(2 |D|_max)`` bits (:class:`~silodp.crypto.encoding.WeightingEncoding` with
``L = lcm(1..N_max)``), more than one plaintext modulus (< 2^60) holds, so it is computed
modulo several primes ``t_1 .. t_m`` (distinct from the ciphertext primes) and recombined by
the CRT: ``T = prod t_j > 2 |D|_max 2^32`` (the ``2^32`` makes a tampered or wrongly keyed
aggregate decode out of range with probability ``1 - 2^-32``).

Noise, in the ``c0 + c1 s - round(q m / t)`` form and the infinity norm, with SEAL's errors
bounded by :data:`MAX_ERROR` (centred binomial, sigma 3.2) and ternary ``s``, ``u``:

* a fresh public-key encryption: ``E_f <= MAX_ERROR (2N + 1)``;
* the encrypted weight is a constant polynomial, so multiplying it by a plaintext with
  coefficients below ``t`` gives ``E_p <= N t E_f + t + 1`` (the ``t + 1``: rounding of the
  scaled constant and of the product's carry);
* a silo's sum over at most ``A`` subjects (the public subject count), its plaintext noise and
  mask and a fresh encryption of zero: ``E_s <= A E_p + E_f + 2``;
* noise flooding: the silo adds to ``c0`` a uniform integer in ``[-2^beta, 2^beta)`` per
  coefficient with ``2^beta >= 2^lambda N C E_s`` (``C`` ciphertexts per silo), so the
  statistical distance between its whole message's noise and flooding alone is at most
  ``N C E_s / 2^(beta+1) <= 2^-(lambda+1)``: the key holder learns nothing from the noise;
* the sum over ``S`` silos decrypts correctly when ``2 t (S (E_s + 2^beta) + S + 1) < q``;
  the plan asks for :data:`DECRYPT_MARGIN_BITS` more (SEAL's gamma-corrected decryption is
  exact only a relative ``2^-55`` or so inside that bound).

With ``weights = "fixed_point"`` (:mod:`silodp.crypto.bfv.fixed_weights`) the silos compute
the weight ``Enc(floor(2^k/n_a))`` themselves, and its noise ``E_w`` takes the place of
``E_f`` in ``E_p``. Each step's worst case, with ``P`` SEAL's special prime, ``l`` the primes
of ``q`` and ``q_max`` the largest:

* the chain of the ``S`` silos: one fresh encryption and ``S - 1`` products by a monomial
  ``X^c`` (a signed permutation of the noise's coefficients: the bound is unchanged; since
  every partial count stays below ``N`` the scaled plaintext is permuted exactly) each
  followed by a fresh ``Enc(0)``: ``E_c <= S E_f``;
* the product by the public plaintext ``F`` (``n_max`` non-zero coefficients below ``t``):
  ``E_F <= n_max t E_c + t + 1`` (``t + 1``: the rounding of the scaled monomial times ``F``
  and of the reduced product);
* one key switching (SEAL's hybrid method: RNS digits below ``q_j`` times the key's errors,
  divided by ``P`` and rounded): ``E_ks <= l N q_max MAX_ERROR / P + N + 2``;
* the trace, ``log2 N`` steps ``c + σ(c)`` (an automorphism permutes the noise, the key
  switching adds ``E_ks``, the sum's rounding at most 1): ``E_w <= N (E_F + E_ks + 1)``;
* then the weight is switched down by ``level_drop`` primes to ``q'``, the smallest level at
  which the decryption condition above still holds with ``q'`` for ``q``
  (:func:`switched_noise`): ``E_w' <= ceil(E_w q'/q) + level_drop (N + 2)``. The silos'
  products, ``Enc(0)`` and flooding are at that level. A fresh encryption there has noise at
  most ``E_f`` as well (SEAL encrypts one level higher and divides by the dropped prime).

:func:`plan_bfv_round` picks the prime size minimising the number of moduli under these
conditions and refuses parameters that cannot meet them, naming the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gmpy2

from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.errors import EncodingOverflowError

__all__ = [
    "MAX_ERROR",
    "TAMPER_MARGIN_BITS",
    "BfvParameters",
    "BfvPlan",
    "FIXED_POINT_COEFF_BITS",
    "FIXED_POINT_DEGREE",
    "WEIGHTS",
    "batching_primes",
    "fixed_point_bits",
    "fixed_weight_noise",
    "plan_bfv_round",
    "switched_noise",
    "trace_elements",
]

#: largest |coefficient| of SEAL's error distribution (centred binomial of 42 bits: <= 21)
MAX_ERROR = 21
#: the CRT modulus exceeds twice the honest aggregate's bound by this many bits
TAMPER_MARGIN_BITS = 32
#: ring degrees with their HE-standard 128-bit coefficient-modulus size (SEAL's BFVDefault)
SUPPORTED_DEGREES = {8192: 218, 16384: 438}
#: default ciphertext primes: three 60-bit primes for q and SEAL's special prime (218 bits)
DEFAULT_COEFF_BITS = (60, 60, 60, 38)
MIN_PLAIN_BITS = 20
MAX_PLAIN_BITS = 60
#: bits of margin in the decryption condition: SEAL's decryption (base conversion with
#: gamma-correction) is exact a hair inside q / 2t, not exactly up to it
DECRYPT_MARGIN_BITS = 4
#: the largest prime size a plan picks: the silos' residue products
#: (:func:`silodp.crypto.bfv.weighting.mulmod`) are exact below 2^52
MAX_PLAN_BITS = 52
#: how the weights ``n_{s,a}/n_a`` are encoded: exactly through ``L = lcm(1..n_max)`` and the
#: server's inverted blinded counts, or as ``floor(2^k/n_a)/2^k`` computed by the silos under
#: encryption (:mod:`silodp.crypto.bfv.fixed_weights`)
WEIGHTS = ("exact", "fixed_point")
#: the ring fixed-point weights need (``n_max < N``, and room for the trace's noise) and
#: SEAL's 128-bit default modulus for it (389 bits of ``q``, a 49-bit special prime last)
FIXED_POINT_DEGREE = 16384
FIXED_POINT_COEFF_BITS = (48, 48, 48, 49, 49, 49, 49, 49, 49)


@dataclass(frozen=True)
class BfvParameters:
    """Scheme parameters every party agrees on: the ring degree ``poly_degree`` (coordinates
    per ciphertext), the bit sizes ``coeff_bits`` of the ciphertext primes (the last is SEAL's
    special prime; the total may not exceed the HE standard's 128-bit bound) and the
    statistical security ``flood_bits`` of noise flooding."""

    poly_degree: int = 8192
    coeff_bits: tuple[int, ...] = DEFAULT_COEFF_BITS
    flood_bits: int = 40

    def __post_init__(self) -> None:
        n = self.poly_degree
        if isinstance(n, bool) or n not in SUPPORTED_DEGREES:
            raise ValueError(
                f"Expected poly_degree={n!r} in {sorted(SUPPORTED_DEGREES)} (128-bit security "
                "per the Homomorphic Encryption Standard with SEAL's default modulus)."
            )
        bits = self.coeff_bits
        if (
            not isinstance(bits, tuple)
            or len(bits) < 2
            or any(isinstance(b, bool) or not isinstance(b, int) or not 20 <= b <= 60 for b in bits)
        ):
            raise ValueError(
                f"Expected coeff_bits={bits!r} as a tuple of >= 2 prime sizes in [20, 60]."
            )
        if sum(bits) > SUPPORTED_DEGREES[n]:
            raise ValueError(
                f"Expected coeff_bits={bits!r} to total at most {SUPPORTED_DEGREES[n]} bits for "
                f"poly_degree={n} (128-bit security, HE standard), got {sum(bits)}."
            )
        lam = self.flood_bits
        if isinstance(lam, bool) or not isinstance(lam, int) or not 40 <= lam <= 128:
            raise ValueError(f"Expected flood_bits={lam!r} to be an int in [40, 128].")


def batching_primes(
    poly_degree: int, bits: int, count: int, exclude: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    """The ``count`` largest primes below ``2^bits`` that are ``1 mod 2 poly_degree``,
    largest first; deterministic, so public (any primes would do for coefficient plaintexts;
    these also allow batching)."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError(f"Expected bits={bits!r} to be an int.")
    if not MIN_PLAIN_BITS <= bits <= MAX_PLAIN_BITS:
        raise ValueError(f"Expected bits={bits} in [{MIN_PLAIN_BITS}, {MAX_PLAIN_BITS}].")
    step = 2 * poly_degree
    k = ((1 << bits) - 2) // step
    out: list[int] = []
    while len(out) < count:
        p = k * step + 1
        if p.bit_length() < bits:
            raise ValueError(f"Fewer than {count} batching primes of {bits} bits.")
        if p not in exclude and gmpy2.is_prime(p, 50):
            out.append(p)
        k -= 1
    return tuple(out)


@dataclass(frozen=True)
class BfvPlan:
    """Everything public about one round's BFV arithmetic."""

    params: BfvParameters
    encoding: WeightingEncoding  # over T = prod(plain_moduli), no packing
    plain_moduli: tuple[int, ...]
    coeff_modulus: int  # q, product of the ciphertext primes
    dim: int
    blocks: int
    flood_log2: int  # beta: flooding noise is uniform in [-2^beta, 2^beta)
    silo_noise_bound: int  # E_s
    weights: str = "exact"  # WEIGHTS
    weight_noise_bound: int = 0  # E_w of a fixed-point weight at level_drop (0: exact)
    level_drop: int = 0  # primes of q dropped (modulus switching) before the silos' products

    @property
    def ciphertexts_per_silo(self) -> int:
        return self.blocks * len(self.plain_moduli)


def _fresh_noise(n: int) -> int:
    return MAX_ERROR * (2 * n + 1)


def _silo_noise(n: int, t: int, subjects: int, weight_noise: int) -> int:
    pair = n * t * weight_noise + t + 1
    return subjects * pair + _fresh_noise(n) + 2


def trace_elements(poly_degree: int) -> tuple[int, ...]:
    """The Galois elements ``2^j + 1``, ``j = 1..log2 N``, of the trace to the constant
    coefficient: ``c <- c + σ_g(c)`` for each in turn keeps ``N`` times the constant
    coefficient and zeroes every other."""
    return tuple((1 << j) + 1 for j in range(1, poly_degree.bit_length()))


def switched_noise(noise: int, q: int, q_level: int, poly_degree: int, drop: int) -> int:
    """The noise bound after switching from ``q`` down to ``q_level`` (``drop`` primes, each
    step ``c <- round(c q'/q)``): the noise scales by ``q'/q`` and each step's rounding adds at
    most ``(1 + ||s||_1)/2 + 1 <= N + 2`` (ternary ``s``, and the scaled plaintext's
    rounding)."""
    return -(-noise * q_level // q) + drop * (poly_degree + 2)


def fixed_point_bits(num_subjects: int, n_max: int, *, delta_bound: float, precision: float) -> int:
    """``k`` of the fixed-point weights ``floor(2^k/n_a)``: the weighting error
    ``sum_a sum_s n_{s,a} (1/n_a - floor(2^k/n_a)/2^k) |delta| <= A n_max delta_bound / 2^k``
    stays below ``precision``."""
    return max(1, math.ceil(math.log2(num_subjects * n_max * delta_bound / precision)))


def fixed_weight_noise(
    poly_degree: int, t: int, *, num_silos: int, n_max: int, ciphertext_primes: tuple[int, ...]
) -> int:
    """``E_w``: the worst-case noise of a fixed-point weight ciphertext under plaintext prime
    ``t`` (module docstring; ``ciphertext_primes`` with SEAL's special prime last)."""
    n = poly_degree
    qs = [int(p) for p in ciphertext_primes[:-1]]
    special = int(ciphertext_primes[-1])
    chain = num_silos * _fresh_noise(n)
    after_f = n_max * t * chain + t + 1
    key_switch = -(-len(qs) * n * max(qs) * MAX_ERROR // special) + n + 2
    return n * (after_f + key_switch + 1)


def plan_bfv_round(
    params: BfvParameters,
    *,
    ciphertext_primes: tuple[int, ...],
    n_max: int,
    num_subjects: int,
    num_silos: int,
    dim: int,
    delta_bound: float = 1.0,
    noise_bound: float = 1e6,
    precision: float = 1e-10,
    weights: str = "exact",
) -> BfvPlan:
    """The plaintext primes, block count and flooding bound for a ``dim``-parameter round
    (``ciphertext_primes``: SEAL's primes for ``params.coeff_bits``, the special prime last);
    raises :class:`EncodingOverflowError` if no prime size meets the noise conditions."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"Expected dim={dim!r} to be a positive int.")
    if weights not in WEIGHTS:
        raise ValueError(f"Expected weights={weights!r} in {list(WEIGHTS)}.")
    if len(ciphertext_primes) != len(params.coeff_bits):
        raise ValueError(
            f"Expected {len(params.coeff_bits)} ciphertext primes, got {len(ciphertext_primes)}."
        )
    taken = frozenset(int(p) for p in ciphertext_primes)
    q = math.prod(int(p) for p in ciphertext_primes[:-1])
    if q.bit_length() < 100:
        raise ValueError(f"Expected a ciphertext modulus of >= 100 bits, got {q.bit_length()}.")
    n = params.poly_degree
    blocks = -(-dim // n)
    fixed = weights == "fixed_point"
    bits_k = None
    if fixed:
        if n_max >= n:
            raise EncodingOverflowError(
                f"Fixed-point weights encode a subject's count as X^n_a in a ring of degree "
                f"{n}: expected n_max={n_max} < poly_degree={n}."
            )
        bits_k = fixed_point_bits(num_subjects, n_max, delta_bound=delta_bound, precision=precision)

    def weight_noise(t: int) -> int:
        if not fixed:
            return _fresh_noise(n)
        return fixed_weight_noise(
            n, t, num_silos=num_silos, n_max=n_max, ciphertext_primes=ciphertext_primes
        )

    def encoding(modulus: int) -> WeightingEncoding:
        return WeightingEncoding(
            modulus=modulus,
            n_max=n_max,
            num_subjects=num_subjects,
            num_silos=num_silos,
            delta_bound=delta_bound,
            noise_bound=noise_bound,
            precision=precision,
            packing=False,
            weight_bits=bits_k,
        )

    probe = encoding(1 << 30000)
    need = (2 * probe.aggregate_bound) << TAMPER_MARGIN_BITS
    q_primes = [int(p) for p in ciphertext_primes[:-1]]
    # fixed-point weights are switched down before the silos' products when the noise allows
    drops = range(len(q_primes) - 1, -1, -1) if fixed else (0,)
    best: tuple[int, int, tuple[int, ...], int, int, int, int] | None = None
    for bits in range(MIN_PLAIN_BITS, MAX_PLAN_BITS + 1):
        count = max(1, math.ceil(need.bit_length() / bits))
        try:
            primes = batching_primes(n, bits, count, taken)
            while math.prod(primes) <= need:
                count += 1
                primes = batching_primes(n, bits, count, taken)
        except ValueError:  # not enough primes of this size
            continue
        t = primes[0]
        for drop in drops:  # the largest drop that still decrypts
            q_level = math.prod(q_primes[: len(q_primes) - drop])
            weight = switched_noise(weight_noise(t), q, q_level, n, drop)
            silo = _silo_noise(n, t, num_subjects, weight)
            beta = (silo * n * count * blocks << params.flood_bits).bit_length()
            total = num_silos * (silo + (1 << beta)) + num_silos + 1
            if (2 * t * total) << DECRYPT_MARGIN_BITS < q_level:
                break
        else:
            continue
        cost = count * (len(q_primes) - drop)  # products cost about the primes of q left
        if best is None or cost < best[0] or (cost == best[0] and bits <= 32):
            best = (cost, bits, primes, beta, silo, drop, weight)  # among equals, primes
            # below 2^32 are cheapest for the silos' residue arithmetic
    if best is None:
        raise EncodingOverflowError(
            f"No plaintext prime size in [{MIN_PLAIN_BITS}, {MAX_PLAN_BITS}] bits keeps the "
            f"flooded noise of {num_silos} silos x {num_subjects} subjects below q / 2t for "
            f"poly_degree={n} (q of {q.bit_length()} bits, flood_bits={params.flood_bits}, "
            f"weights={weights!r}); expected a larger poly_degree or fewer subjects."
        )
    _cost, _bits, primes, beta, silo, drop, weight = best
    return BfvPlan(
        params,
        encoding(math.prod(primes)),
        primes,
        q,
        dim,
        blocks,
        beta,
        silo,
        weights=weights,
        weight_noise_bound=weight if fixed else 0,
        level_drop=drop,
    )
