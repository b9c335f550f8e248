"""Public parameters of the BFV weighting backend, derived from public values only.

The ring has degree ``N`` (8192 or 16384) and a ciphertext modulus of at most the Homomorphic
Encryption Standard's 128-bit bound (``log2 Q <= 218`` for ``N = 8192``, 438 for 16384),
checked again by SEAL; the last prime is SEAL's special prime (unused: nothing here switches
keys), the others form ``q``. Plaintexts are coefficient vectors: the encrypted weight is a
constant polynomial, so ``w * P(x)`` multiplies every coefficient of ``P`` by ``w`` and no
batching (slot) encoding is needed. The aggregate must be an exact integer of up to
``log2(2 |D|_max)`` bits (:class:`~silodp.crypto.encoding.WeightingEncoding` with
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
* the sum over ``S`` silos decrypts correctly when ``2 t (S (E_s + 2^beta) + S + 1) < q``.

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
    "batching_primes",
    "plan_bfv_round",
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

    @property
    def ciphertexts_per_silo(self) -> int:
        return self.blocks * len(self.plain_moduli)


def _silo_noise(n: int, t: int, subjects: int) -> int:
    fresh = MAX_ERROR * (2 * n + 1)
    pair = n * t * fresh + t + 1
    return subjects * pair + fresh + 2


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
) -> BfvPlan:
    """The plaintext primes, block count and flooding bound for a ``dim``-parameter round
    (``ciphertext_primes``: SEAL's primes for ``params.coeff_bits``, the special prime last);
    raises :class:`EncodingOverflowError` if no prime size meets the noise conditions."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"Expected dim={dim!r} to be a positive int.")
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
        )

    probe = encoding(1 << 30000)
    need = (2 * probe.aggregate_bound) << TAMPER_MARGIN_BITS
    best: tuple[int, int, tuple[int, ...], int, int] | None = None
    for bits in range(MIN_PLAIN_BITS, MAX_PLAIN_BITS + 1):
        count = max(1, math.ceil(need.bit_length() / bits))
        try:
            primes = batching_primes(n, bits, count, taken)
            while math.prod(primes) <= need:
                count += 1
                primes = batching_primes(n, bits, count, taken)
        except ValueError:  # not enough primes of this size
            continue
        t = primes[0]
        silo = _silo_noise(n, t, num_subjects)
        beta = (silo * n * count * blocks << params.flood_bits).bit_length()
        total = num_silos * (silo + (1 << beta)) + num_silos + 1
        if 2 * t * total >= q:
            continue
        if best is None or count < best[0] or (count == best[0] and bits <= 32):
            best = (count, bits, primes, beta, silo)  # among equals, primes below 2^32 are
            # cheapest for the silos' residue arithmetic
    if best is None:
        raise EncodingOverflowError(
            f"No plaintext prime size in [{MIN_PLAIN_BITS}, {MAX_PLAIN_BITS}] bits keeps the "
            f"flooded noise of {num_silos} silos x {num_subjects} subjects below q / 2t for "
            f"poly_degree={n} (q of {q.bit_length()} bits, flood_bits={params.flood_bits}); "
            f"expected a larger poly_degree or fewer subjects."
        )
    count, _bits, primes, beta, silo = best
    return BfvPlan(params, encoding(math.prod(primes)), primes, q, dim, blocks, beta, silo)
