"""The heavy arithmetic of a round: a silo's per-parameter ciphertexts and the server's
decryption, sequential or over worker processes (chunks of parameters).

Silo ``s``, parameter ``j``: with ``c_a = Enc(w'_a)^(r_a n_{s,a} L) * R_a`` lifted once per
subject and round (one full exponentiation each),

    C_j = prod_a c_a^(e_{a,j}) * Enc(L e_noise_j + mask_j)

where ``e_{a,j}`` is the short signed fixed-point encoding of ``Delta_{s,a,j}`` (about
``log2(10^d * delta_bound)`` bits). Signs are handled by an offset: ``u = e + B >= 0`` with
``B = max |e|``, and the constant ``prod_a c_a^(-B)`` (one inversion and one short power per
round) cancels it. Each ``c_a^u`` is read from a fixed-base window table, so a parameter costs
about ``A * ceil(bits / w)`` modular products plus one re-randomisation, instead of ``A`` full
3072-bit exponentiations. The plaintext noise and mask enter as ``1 + t n`` (one product).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import gmpy2
import numpy as np

from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.fixedbase import FixedBaseTable, choose_window
from silodp.crypto.paillier import PaillierPrivateKey, PaillierPublicKey
from silodp.crypto.prg import MaskStream
from silodp.crypto.rerandomize import Rerandomizer

__all__ = [
    "SiloRoundJob",
    "aggregate_and_decrypt",
    "compute_silo_ciphertexts",
    "half_decryption_suffices",
    "prepare_silo_round",
    "resolve_workers",
    "run_chunks",
]

PARALLEL_MIN_ITEMS = 256


def resolve_workers(workers: int | None, items: int) -> int:
    """Worker processes for ``items`` parameters: ``None`` means all usable CPUs when the
    batch is large enough to repay starting them, else one (in-process)."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Expected workers={workers!r} to be a positive int or None.")
        return workers
    if items < PARALLEL_MIN_ITEMS:
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


def _split(total: int, workers: int) -> list[tuple[int, int]]:
    parts = 1 if workers <= 1 else min(total, 4 * workers)
    bounds = np.linspace(0, total, parts + 1).astype(int).tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


@dataclass(frozen=True, repr=False)
class SiloRoundJob:
    """A silo's secrets for one round's parameter loop (never leaves the silo's processes)."""

    public_key: PaillierPublicKey
    encoding: WeightingEncoding
    tables: tuple[FixedBaseTable, ...]
    offset: int
    start_constant: Any
    masks: tuple[tuple[MaskStream, int], ...]
    rerandomizer: Rerandomizer

    def __repr__(self) -> str:
        return f"SiloRoundJob(subjects={len(self.tables)}, pairs={len(self.masks)})"


def prepare_silo_round(
    public_key: PaillierPublicKey,
    encoding: WeightingEncoding,
    lifted: Sequence[Any],
    masks: Sequence[tuple[MaskStream, int]],
    rerandomizer: Rerandomizer,
    dim: int,
) -> SiloRoundJob:
    """Window tables for the lifted weights ``c_a`` and the offset-cancelling constant."""
    n2 = public_key.n_squared
    offset = encoding.max_encoded_delta
    bits = max(1, (2 * offset).bit_length())
    window = choose_window(
        bits, dim, element_bytes=(int(n2).bit_length() + 7) // 8 + 32, bases=max(1, len(lifted))
    )
    tables = tuple(FixedBaseTable.build(c, n2, bits, window) for c in lifted)
    product = gmpy2.mpz(1)
    for c in lifted:
        product = product * c % n2
    start = gmpy2.powmod(gmpy2.invert(product, n2), offset, n2) if lifted else gmpy2.mpz(1)
    return SiloRoundJob(public_key, encoding, tables, offset, start, tuple(masks), rerandomizer)


def _silo_chunk(
    job: SiloRoundJob, deltas: np.ndarray, noise: np.ndarray, secrets: Sequence[int], start: int
) -> list[int]:
    pk, enc = job.public_key, job.encoding
    n, n2 = pk.n_mpz, pk.n_squared
    m = int(noise.shape[0])
    offset = job.offset
    exponents = [[e + offset for e in enc.encode_deltas(row)] for row in deltas]
    noise_enc = enc.encode_noise(noise)
    multiplier = enc.multiplier
    combined = [0] * m
    for stream, sign in job.masks:
        values = stream.values(start, start + m)
        if sign > 0:
            combined = [a + b for a, b in zip(combined, values, strict=True)]
        else:
            combined = [a - b for a, b in zip(combined, values, strict=True)]
    wbits = job.tables[0].window_bits if job.tables else 1
    dmask = (1 << wbits) - 1
    rows_of = [t.rows for t in job.tables]
    out: list[int] = []
    for j in range(m):
        t = (multiplier * noise_enc[j] + combined[j]) % n
        acc = job.start_constant * (1 + t * n) % n2
        acc = acc * job.rerandomizer.factor(secrets[j]) % n2
        for a, rows in enumerate(rows_of):
            u = exponents[a][j]
            for row in rows:
                d = u & dmask
                if d:
                    acc = acc * row[d] % n2
                u >>= wbits
        out.append(int(acc))
    return out


def compute_silo_ciphertexts(
    job: SiloRoundJob,
    deltas: np.ndarray,
    noise: np.ndarray,
    secrets: Sequence[int],
    *,
    workers: int = 1,
) -> list[int]:
    """The silo's masked, re-randomised ciphertext for every parameter.

    ``deltas`` is ``(subjects, dim)`` in the order of ``job.tables``; ``secrets`` holds one
    re-randomiser input per parameter (drawn by the caller from its random source).
    """
    dim = int(noise.shape[0])
    if deltas.shape != (len(job.tables), dim) or len(secrets) != dim:
        raise ValueError(
            f"Expected deltas of shape {(len(job.tables), dim)} and {dim} secrets, "
            f"got {deltas.shape} and {len(secrets)}."
        )
    chunks = [(deltas[:, a:b], noise[a:b], list(secrets[a:b]), a) for a, b in _split(dim, workers)]
    out: list[int] = []
    for part in run_chunks(_silo_chunk, job, chunks, workers):
        out.extend(part)
    return out


HALF_DECRYPTION_MARGIN_BITS = 32


def half_decryption_suffices(private_key: PaillierPrivateKey, encoding: WeightingEncoding) -> bool:
    """Whether every honest aggregate is so far below ``p`` that ``m mod p`` determines it
    (with ``2^32`` to spare, so a forged ciphertext still decodes out of range w.h.p.)."""
    bound = 2 * encoding.aggregate_bound << HALF_DECRYPTION_MARGIN_BITS
    return bound < min(private_key.p, private_key.q)


def _server_chunk(
    shared: tuple[PaillierPrivateKey, WeightingEncoding, bool], columns: Sequence[Sequence[int]]
) -> list[float]:
    key, enc, half = shared
    n2 = key.public_key.n_squared
    p = key.p
    values: list[float] = []
    for column in zip(*columns, strict=True):
        acc = gmpy2.mpz(1)
        for c in column:
            acc = acc * c % n2
        if half:
            m = key.decrypt_mod_p(acc)
            values.append(enc.decode_signed(m - p if m > p // 2 else m))
        else:
            values.append(enc.decode(key.decrypt(acc)))
    return values


def aggregate_and_decrypt(
    private_key: PaillierPrivateKey,
    encoding: WeightingEncoding,
    contributions: Sequence[Sequence[int]],
    *,
    workers: int = 1,
) -> np.ndarray:
    """Multiplies the silos' ciphertext vectors (the masks cancel), decrypts and decodes.

    When the fixed-point bound allows (small ``N_max``), only ``m mod p`` is computed: half the
    decryption cost.
    """
    dim = len(contributions[0])
    half = half_decryption_suffices(private_key, encoding)
    chunks = [(tuple(vec[a:b] for vec in contributions),) for a, b in _split(dim, workers)]
    out: list[float] = []
    for values in run_chunks(_server_chunk, (private_key, encoding, half), chunks, workers):
        out.extend(values)
    return np.asarray(out, dtype=np.float64)
