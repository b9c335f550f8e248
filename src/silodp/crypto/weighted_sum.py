"""The heavy arithmetic of a round: a silo's per-parameter ciphertexts and the server's
decryption, sequential or over worker processes (chunks of parameters).

Silo ``s``, parameter ``j``: with ``c_a = Enc(w'_a)^(r_a n_{s,a} M)`` (``M = L S``) lifted
once per subject and round (one full exponentiation each),

    C_j = prod_a c_a^(e_{a,j}) * Enc(e_noise_j + mask_j) * r_j^n

where ``e_{a,j}`` is the short signed fixed-point encoding of ``Delta_{s,a,j}`` (about
``log2(10^d * delta_bound)`` bits). Signs are handled by an offset: ``u = e + B >= 0`` with
``B = max |e|``, and the constant ``prod_a c_a^(-B)`` (one inversion and one short power per
round) cancels it. Each ``c_a^u`` is read from a fixed-base window table, so a parameter costs
about ``A * ceil(bits / w)`` modular products plus one re-randomisation ``r_j^n`` (a fresh
uniform ``r_j``: one full exponentiation, :mod:`~silodp.crypto.rerandomize`), instead of ``A``
full 3072-bit exponentiations. The plaintext noise (integers on the aggregate's grid ``M 10^d``,
drawn there by the silo) and mask enter as ``1 + t n`` (one product).

Packing (see :mod:`~silodp.crypto.encoding`): with ``K`` slots, ciphertext ``J`` carries
parameters ``J K .. J K + K - 1`` as digits in base ``B = 2^b``. Subject ``a``'s base for slot
``k`` is ``c_a^(B^k)`` (``b`` squarings, once per round), so the loop is the same with ``K``
tables per subject, each used ``dim / K`` times; noise and masks are packed the same way and
the offset constant becomes ``prod_a c_a^(-B_off sum_k B^k)``. The server decrypts ``dim / K``
ciphertexts instead of ``dim``. :func:`choose_slots` picks ``K`` from public values. Each
table is built and used one at a time (subject by subject), so its window can be wide.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import gmpy2
import numpy as np

from silodp.crypto.encoding import FixedPointCodec, WeightingEncoding
from silodp.crypto.fixedbase import FixedBaseTable, choose_window
from silodp.crypto.paillier import PaillierPrivateKey, PaillierPublicKey
from silodp.crypto.prg import MaskStream
from silodp.crypto.rerandomize import Rerandomizer

__all__ = [
    "SiloRoundJob",
    "aggregate_and_decrypt",
    "choose_slots",
    "compute_silo_ciphertexts",
    "half_decryption_suffices",
    "modelled_round_products",
    "prepare_silo_round",
    "product_seconds",
    "resolve_workers",
    "run_chunks",
]

PARALLEL_MIN_ITEMS = 256
HALF_DECRYPTION_MARGIN_BITS = 32


def resolve_workers(workers: int | None, items: int, *, min_items: int = PARALLEL_MIN_ITEMS) -> int:
    """Worker processes for ``items`` units of work: ``None`` means all usable CPUs when
    there are at least ``min_items`` (enough to repay starting them), else one
    (in-process)."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Expected workers={workers!r} to be a positive int or None.")
        return workers
    if items < min_items:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus)


_SHARED: dict[str, Any] = {}


def _init_worker(func: Callable[..., Any], shared: Any) -> None:
    _SHARED["func"] = func
    _SHARED["shared"] = shared


def _run_chunk(args: tuple[Any, ...]) -> Any:
    return _SHARED["func"](_SHARED["shared"], *args)


def run_chunks(
    func: Callable[..., Any], shared: Any, chunks: Sequence[tuple[Any, ...]], workers: int
) -> list[Any]:
    """``[func(shared, *chunk) for chunk in chunks]``, over ``workers`` processes if > 1.

    ``shared`` reaches the workers once (inherited on fork), chunks are pickled.
    """
    if workers <= 1 or len(chunks) <= 1:
        return [func(shared, *chunk) for chunk in chunks]
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(
        max_workers=min(workers, len(chunks)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(func, shared),
    ) as pool:
        return list(pool.map(_run_chunk, chunks))


def _split(total: int, workers: int, *, per_worker: int = 4) -> list[tuple[int, int]]:
    parts = 1 if workers <= 1 else min(total, per_worker * workers)
    bounds = np.linspace(0, total, parts + 1).astype(int).tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def _products_per_value(exponent_bits: int, uses: int) -> float:
    """Modular products per exponentiation from a window table used ``uses`` times (build
    included), at the window :func:`choose_window` would pick for one base."""
    w = choose_window(exponent_bits, uses, element_bytes=1024)
    windows = -(-exponent_bits // w)
    return windows * (1 + ((1 << w) - 1) / max(1, uses))


#: a decryption costs about this many full-size (mod n^2) products per modulus bit: two
#: half-size, constant-time exponentiations (CRT) of half-length exponents (OpenSSL: 3.6 ms
#: each at 3072 bits where a 6144-bit product takes 10.4 us); half decryption is one of them
DECRYPTION_PRODUCTS_PER_BIT = 0.23
#: a full exponentiation by an exponent of ``key_bits`` bits costs about this many products
#: per bit (a lift, a re-randomisation ``r^n``)
FULL_POWER_PRODUCTS_PER_BIT = 1.2
#: noise, mask and start constant of one ciphertext, per silo
PER_CIPHERTEXT_PRODUCTS = 5


def _ciphertext_products(
    encoding: WeightingEncoding, slots: int, key_bits: int, silos: int
) -> float:
    """Modelled products of one ciphertext: its decryption, and in each silo its
    re-randomisation, noise and mask."""
    half = (2 * encoding.packed_bound(slots)).bit_length() + HALF_DECRYPTION_MARGIN_BITS
    decrypt_bits = key_bits / 2 if half < key_bits // 2 - 1 else key_bits
    per_silo = FULL_POWER_PRODUCTS_PER_BIT * key_bits + PER_CIPHERTEXT_PRODUCTS
    return DECRYPTION_PRODUCTS_PER_BIT * decrypt_bits + silos * per_silo


def modelled_round_products(
    encoding: WeightingEncoding, dim: int, pairs: int, slots: int, *, key_bits: int, silos: int
) -> float:
    """Modular products (mod ``n^2``) of one round: ``pairs`` lifts (one full exponentiation
    each), ``pairs * dim`` table exponentiations, and per ciphertext one decryption and, in
    each of ``silos`` silos, one re-randomisation (a full exponentiation)."""
    if isinstance(silos, bool) or not isinstance(silos, int) or silos < 1:
        raise ValueError(f"Expected silos={silos!r} to be a positive int.")
    bits = max(1, (2 * encoding.max_encoded_delta).bit_length())
    count = -(-dim // slots)
    lifts = pairs * FULL_POWER_PRODUCTS_PER_BIT * key_bits
    return (
        lifts
        + pairs * dim * _products_per_value(bits, count)
        + count * _ciphertext_products(encoding, slots, key_bits, silos)
    )


def product_seconds(modulus_squared: int, repeats: int = 400) -> float:
    """Measured seconds of one modular product mod ``modulus_squared`` on this machine."""
    mod = gmpy2.mpz(modulus_squared)
    a, b = (mod - 3) // 2, (mod - 5) // 3
    start = time.perf_counter()
    for _ in range(repeats):
        a = a * b % mod
    return (time.perf_counter() - start) / repeats


def choose_slots(
    encoding: WeightingEncoding, dim: int, pairs: int, *, key_bits: int, silos: int
) -> int:
    """Coordinates per ciphertext for a ``dim``-parameter round, from public values only (so
    every party computes the same): the ``K <= max_slots`` minimising the modelled work of
    ``pairs`` (silo, subject) exponentiations per coordinate plus, per ciphertext, one
    decryption and ``silos`` re-randomisations. More slots divide those by ``K`` but give
    each window table ``dim / K`` uses, so building tables costs more per coordinate."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"Expected dim={dim!r} to be a positive int.")
    best, best_cost = 1, math.inf
    for slots in range(1, min(encoding.max_slots, dim) + 1):
        cost = modelled_round_products(encoding, dim, pairs, slots, key_bits=key_bits, silos=silos)
        if cost < best_cost:
            best, best_cost = slots, cost
    return best


@dataclass(frozen=True, repr=False)
class SiloRoundJob:
    """A silo's secrets for one round's parameter loop (never leaves the silo's processes).

    ``slot_bases[k][a] = c_a^(B^k)``: subject ``a``'s lifted weight shifted to packing slot
    ``k``; ``start_constant = prod_a c_a^(-offset * sum_k B^k)`` cancels the exponent offset.
    """

    public_key: PaillierPublicKey
    encoding: WeightingEncoding
    slot_bases: tuple[tuple[Any, ...], ...]
    slots: int
    offset: int
    exponent_bits: int
    start_constant: Any
    masks: tuple[tuple[MaskStream, int], ...]
    rerandomizer: Rerandomizer

    @property
    def subjects(self) -> int:
        return len(self.slot_bases[0]) if self.slot_bases else 0

    def __repr__(self) -> str:
        return f"SiloRoundJob(subjects={self.subjects}, pairs={len(self.masks)})"


def prepare_silo_round(
    public_key: PaillierPublicKey,
    encoding: WeightingEncoding,
    lifted: Sequence[Any],
    masks: Sequence[tuple[MaskStream, int]],
    rerandomizer: Rerandomizer,
    slots: int,
) -> SiloRoundJob:
    """Per-slot bases of the lifted weights ``c_a`` and the offset-cancelling constant
    (``slot_bits`` squarings per subject and slot)."""
    encoding.check_slots(slots)
    n2 = public_key.n_squared
    offset = encoding.max_encoded_delta
    bits = max(1, (2 * offset).bit_length())
    slot_bases = [tuple(gmpy2.mpz(c) for c in lifted)]
    shift = gmpy2.mpz(1) << encoding.slot_bits
    for _ in range(1, slots):
        slot_bases.append(tuple(gmpy2.powmod(c, shift, n2) for c in slot_bases[-1]))
    product = gmpy2.mpz(1)
    for c in lifted:
        product = product * c % n2
    spread = sum(1 << (encoding.slot_bits * k) for k in range(slots))
    start = gmpy2.powmod(gmpy2.invert(product, n2), offset * spread, n2) if lifted else 1
    return SiloRoundJob(
        public_key,
        encoding,
        tuple(slot_bases),
        slots,
        offset,
        bits,
        gmpy2.mpz(start),
        tuple(masks),
        rerandomizer,
    )


def _silo_chunk(
    job: SiloRoundJob,
    deltas: np.ndarray,
    noise_enc: Sequence[int],
    secrets: Sequence[int],
    start: int,
) -> list[int]:
    """Ciphertexts ``start .. start + len(secrets)`` from their ``slots * len(secrets)``
    coordinates (``deltas``: subjects x coordinates, ``noise_enc``: encoded noise, both
    zero-padded to whole ciphertexts)."""
    pk, enc = job.public_key, job.encoding
    n, n2 = pk.n_mpz, pk.n_squared
    slots, slot_bits = job.slots, enc.slot_bits
    m = len(secrets)
    offset = job.offset
    combined = [0] * m
    for stream, sign in job.masks:
        values = stream.values(start, start + m)
        if sign > 0:
            combined = [a + b for a, b in zip(combined, values, strict=True)]
        else:
            combined = [a - b for a, b in zip(combined, values, strict=True)]
    acc = []
    for j in range(m):
        packed_noise = 0
        for k in range(slots - 1, -1, -1):
            packed_noise = (packed_noise << slot_bits) + noise_enc[j * slots + k]
        t = (packed_noise + combined[j]) % n
        c = job.start_constant * (1 + t * n) % n2
        acc.append(c * job.rerandomizer.factor(secrets[j]) % n2)
    element_bytes = (int(n2).bit_length() + 7) // 8 + 32
    window = choose_window(job.exponent_bits, m, element_bytes=element_bytes)
    dmask = (1 << window) - 1
    for a, row in enumerate(deltas):
        exponents = [e + offset for e in enc.encode_deltas(row)]
        for k in range(slots):
            table = FixedBaseTable.build(job.slot_bases[k][a], n2, job.exponent_bits, window)
            rows = table.rows
            for j, u in enumerate(exponents[k::slots]):
                value = acc[j]
                for entry in rows:
                    d = u & dmask
                    if d:
                        value = value * entry[d] % n2
                    u >>= window
                acc[j] = value
    return [int(c) for c in acc]


def compute_silo_ciphertexts(
    job: SiloRoundJob,
    deltas: np.ndarray,
    noise: Sequence[int],
    secrets: Sequence[int],
    *,
    workers: int = 1,
) -> list[int]:
    """The silo's masked, re-randomised ciphertext for every ``slots`` parameters.

    ``deltas`` is ``(subjects, dim)`` in the order of ``job.slot_bases``; ``noise`` holds the
    ``dim`` noise values already encoded on the aggregate's grid (signed ints, checked against
    their bound by the caller); ``secrets`` one re-randomiser input per ciphertext (drawn by
    the caller from its random source).
    """
    dim = len(noise)
    slots = job.slots
    count = -(-dim // slots)
    if deltas.shape != (job.subjects, dim) or len(secrets) != count:
        raise ValueError(
            f"Expected deltas of shape {(job.subjects, dim)} and {count} secrets, "
            f"got {deltas.shape} and {len(secrets)}."
        )
    pad = count * slots - dim
    noise = [int(v) for v in noise] + [0] * pad
    if pad:
        deltas = np.concatenate([deltas, np.zeros((deltas.shape[0], pad))], axis=1)
    parts = _split(count, workers, per_worker=1)  # each chunk builds its own tables
    chunks = [
        (deltas[:, a * slots : b * slots], noise[a * slots : b * slots], list(secrets[a:b]), a)
        for a, b in parts
    ]
    out: list[int] = []
    for part in run_chunks(_silo_chunk, job, chunks, workers):
        out.extend(part)
    return out


def half_decryption_suffices(
    private_key: PaillierPrivateKey, encoding: WeightingEncoding, slots: int = 1
) -> bool:
    """Whether every honest (packed) aggregate is so far below ``p`` that ``m mod p``
    determines it (with ``2^32`` to spare, so a forged ciphertext still decodes out of range
    w.h.p.)."""
    bound = 2 * encoding.packed_bound(slots) << HALF_DECRYPTION_MARGIN_BITS
    return bound < min(private_key.p, private_key.q)


def _server_chunk(
    shared: tuple[PaillierPrivateKey, WeightingEncoding, bool, int],
    columns: Sequence[Sequence[int]],
) -> list[float]:
    key, enc, half, slots = shared
    n2 = key.public_key.n_squared
    p = key.p
    values: list[float] = []
    for column in zip(*columns, strict=True):
        acc = gmpy2.mpz(1)
        for c in column:
            acc = acc * c % n2
        if half:
            m = key.decrypt_mod_p(acc)
            packed = m - p if m > p // 2 else m
        else:
            packed = FixedPointCodec.centered(key.decrypt(acc), key.public_key.n)
        values.extend(enc.decode_signed(d) for d in enc.unpack(packed, slots))
    return values


def aggregate_and_decrypt(
    private_key: PaillierPrivateKey,
    encoding: WeightingEncoding,
    contributions: Sequence[Sequence[int]],
    *,
    slots: int = 1,
    dim: int | None = None,
    workers: int = 1,
) -> np.ndarray:
    """Multiplies the silos' ciphertext vectors (the masks cancel), decrypts, unpacks
    ``slots`` coordinates from each and decodes the first ``dim`` (all if ``None``).

    When the packed bound allows (small ``N_max``, few slots), only ``m mod p`` is computed:
    half the decryption cost.
    """
    count = len(contributions[0])
    half = half_decryption_suffices(private_key, encoding, slots)
    chunks = [(tuple(vec[a:b] for vec in contributions),) for a, b in _split(count, workers)]
    out: list[float] = []
    shared = (private_key, encoding, half, slots)
    for values in run_chunks(_server_chunk, shared, chunks, workers):
        out.extend(values)
    return np.asarray(out[: len(out) if dim is None else dim], dtype=np.float64)
