"""``silodp bench protocol``: cost of the private weighting protocol (ULDP-AVG-w) per phase.

The grid follows the paper's Figure 12: 10,000 records spread uniformly over subjects and 3
silos, ``N_max = 2000``, 3072-bit Paillier; parameters 16 -> 10^5 (20 subjects) and subjects
10 -> 40 (16 parameters); then 600 records with ``N_max = 64``, where ``slots`` coordinates
share one ciphertext (packing, :mod:`silodp.crypto.encoding`). Each point runs set-up and one
round of :class:`~silodp.crypto.protocol.WeightingSession` and reports wall time per phase:

* ``keygen_s`` (Paillier key), ``key_exchange_s`` (pk broadcast, X25519, sealed seed),
  ``histogram_s`` (blinded, masked histograms and server inverses) - once per training;
* ``server_weights_s`` (encrypted weights), ``silo_weighting_s`` (mean per silo),
  ``aggregation_s`` (product, decryption, decoding) - every round;
* ``silodp_s``: one round's compute, silos run one after another (server weights + every
  silo + aggregation).

``baseline_s`` is the same round done the straightforward way with python-paillier (``phe``):
one full-size ``Enc(w_a)^(r_a n_{s,a} L S e_{a,j} mod n)`` per subject and parameter, one fresh
encryption of the noise and mask per parameter, and phe's CRT decryption. The baseline runs
only up to 10^3 parameters, and on at most ``baseline_sample`` of them; its per-parameter cost
is constant, so the total is extrapolated linearly (``baseline_measured`` says how many
parameters were timed). Its decoded values must equal silodp's exactly
(``baseline_max_abs_diff``). ``max_abs_error`` compares silodp's decoded aggregate with the
float64 plaintext weighted sum.

**Targets** (:func:`target_rows`, printed after the grid): one round of ``uldp_avg_w`` at the
shape of the shipped Fashion-MNIST configs (silos, public subjects, (silo, subject) pairs with
records, the CNN's 105,866 parameters, ``N_max``). ``paillier_cpu_min`` is today's cost: the
Paillier cost model (:func:`~silodp.crypto.weighted_sum.modelled_round_products`, the estimate
``silodp run`` prints) times a 3072-bit product timed here. ``bfv_cpu_min`` is the BFV backend
(:mod:`silodp.crypto.bfv`): for ``measured`` targets, server weights, every silo (one of them
with ``sample_pairs`` pairs, the others with one, which separates the per-pair from the
per-silo cost) and the aggregation are run at full dimension and extrapolated linearly to the
target's pairs and subjects; other targets reuse those per-operation costs with their own
plan. ``ratio`` = ``paillier_cpu_min / bfv_cpu_min`` (target >= 20); ``round_ok``: the
sequential CPU time of a round is <= 15 minutes (so also its wall time on 2 cores).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import typer

from silodp.bench.common import format_table
from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.prg import MaskStream
from silodp.crypto.protocol import ProtocolConfig, WeightingSession, plaintext_weighted_sum

__all__ = [
    "COLUMNS",
    "TARGETS",
    "TARGET_COLUMNS",
    "format_rows",
    "protocol_rows",
    "register",
    "run_bfv_round",
    "run_point",
    "target_rows",
]

Row = dict[str, Any]

COLUMNS = [
    "params",
    "users",
    "n_max",
    "slots",
    "keygen_s",
    "key_exchange_s",
    "histogram_s",
    "server_weights_s",
    "silo_weighting_s",
    "aggregation_s",
    "silodp_s",
    "baseline_s",
    "baseline_measured",
    "speedup",
    "max_abs_error",
    "baseline_max_abs_diff",
]

RECORDS = 10_000
SILOS = 3
N_MAX = 2000
CLIP = 1.0
BASELINE_MAX_PARAMS = 1000


def _federation(
    params: int, users: int, *, silos: int, records: int, seed: int
) -> tuple[dict[int, dict[int, int]], dict[int, dict[int, np.ndarray]], dict[int, np.ndarray]]:
    """Uniform allocation (record -> random subject, random silo), clipped random deltas and
    per-silo Gaussian noise ``N(0, C^2 / S)``."""
    rng = np.random.default_rng(seed)
    owner = rng.integers(0, users, records)
    silo = rng.integers(0, silos, records)
    counts = np.zeros((silos, users), dtype=np.int64)
    np.add.at(counts, (silo, owner), 1)
    hist = {s: {a: int(counts[s, a]) for a in range(users) if counts[s, a]} for s in range(silos)}
    deltas: dict[int, dict[int, np.ndarray]] = {}
    for s in range(silos):
        deltas[s] = {}
        for a in hist[s]:
            v = rng.normal(size=params)
            deltas[s][a] = v * min(1.0, CLIP / float(np.linalg.norm(v)))
    noise = {s: rng.normal(0.0, CLIP / np.sqrt(silos), params) for s in range(silos)}
    return hist, deltas, noise


def _baseline(
    session: WeightingSession,
    hist: Mapping[int, Mapping[int, int]],
    deltas: Mapping[int, Mapping[int, np.ndarray]],
    noise: Mapping[int, np.ndarray],
    measured: int,
) -> tuple[float, float, np.ndarray]:
    """python-paillier on the first ``measured`` parameters: (fixed s, per-parameter s,
    decoded values)."""
    from phe import paillier as phe

    server = session.server
    private = server._keys.private_key
    pk = phe.PaillierPublicKey(server.public_key.n)
    sk = phe.PaillierPrivateKey(pk, private.p, private.q)
    n, n2 = pk.n, pk.nsquare
    encoding: WeightingEncoding = server.encoding
    subjects = session.config.subject_ids
    blinds = session.silos[session.config.silo_ids[0]]._blinds
    multiplier = encoding.multiplier

    t0 = time.perf_counter()
    weights = {
        a: phe.EncryptedNumber(pk, pk.raw_encrypt(inv))
        for a, inv in zip(subjects, server._inverses, strict=True)
    }
    fixed = time.perf_counter() - t0

    mask_key = bytes(range(32))
    masks = MaskStream(mask_key, n).values(0, measured)
    t0 = time.perf_counter()
    per_silo: list[list[int]] = []
    for index, s in enumerate(session.config.silo_ids):
        sign = 1 if index == 0 else -1 if index == 1 else 0  # one pair of masks that cancel
        enc_noise = encoding.encode_noise(noise[s][:measured])
        own = [(a, encoding.encode_deltas(deltas[s][a][:measured])) for a in hist[s]]
        scalars = {a: blinds[subjects.index(a)] * hist[s][a] * multiplier % n for a, _ in own}
        out = []
        for j in range(measured):
            acc = pk.raw_encrypt((enc_noise[j] + sign * masks[j]) % n)
            for a, enc in own:
                term = weights[a]._raw_mul(scalars[a] * enc[j] % n)
                acc = acc * term % n2
            out.append(acc)
        per_silo.append(out)
    values = []
    for j in range(measured):
        acc = 1
        for out in per_silo:
            acc = acc * out[j] % n2
        values.append(encoding.decode(sk.raw_decrypt(acc)))
    per_param = (time.perf_counter() - t0) / measured
    return fixed, per_param, np.asarray(values)


def run_point(
    params: int,
    users: int,
    *,
    silos: int = SILOS,
    records: int = RECORDS,
    n_max: int = N_MAX,
    key_bits: int = 3072,
    insecure_test_key_bits: int | None = None,
    baseline_sample: int | None = 32,
    workers: int | None = None,
    seed: int = 0,
) -> Row:
    """Set-up and one round at one grid point (plus the phe baseline if asked)."""
    hist, deltas, noise = _federation(params, users, silos=silos, records=records, seed=seed)
    config = ProtocolConfig(
        silo_ids=tuple(range(silos)),
        subject_ids=tuple(range(users)),
        n_max=n_max,
        delta_bound=CLIP,
        noise_bound=1e3,
        key_bits=key_bits,
        insecure_test_key_bits=insecure_test_key_bits,
        workers=workers,
    )
    session = WeightingSession(config, hist)
    result = session.run_round(deltas, noise=noise)
    t = session.timings
    reference = plaintext_weighted_sum(deltas, hist, noise=noise)
    silodp_s = t["server_weights"] + t["silo_weighting"] + t["aggregation"]
    row: Row = {
        "params": params,
        "users": users,
        "silos": silos,
        "key_bits": session.server.public_key.bits,
        "n_max": n_max,
        "records": records,
        "slots": config.slots_for(session.server.encoding, params),
        "keygen_s": t["keygen"],
        "key_exchange_s": t["key_exchange"],
        "histogram_s": t["histogram"],
        "server_weights_s": t["server_weights"],
        "silo_weighting_s": t["silo_weighting"] / silos,
        "aggregation_s": t["aggregation"],
        "silodp_s": silodp_s,
        "baseline_s": None,
        "baseline_measured": 0,
        "speedup": None,
        "max_abs_error": float(np.abs(result.aggregate - reference).max()),
        "baseline_max_abs_diff": None,
    }
    if baseline_sample and params <= BASELINE_MAX_PARAMS:
        measured = min(params, baseline_sample)
        fixed, per_param, values = _baseline(session, hist, deltas, noise, measured)
        baseline_s = fixed + per_param * params
        row.update(
            baseline_s=baseline_s,
            baseline_measured=measured,
            speedup=baseline_s / silodp_s,
            baseline_max_abs_diff=float(np.abs(values - result.aggregate[:measured]).max()),
        )
    return row


#: a small federation whose subjects hold at most ``PACKED_N_MAX`` records (about 30 each),
#: so that several coordinates share one ciphertext
PACKED_RECORDS = 600
PACKED_N_MAX = 64

#: (parameters, subjects, records, n_max)
QUICK_GRID = [(16, 10, RECORDS, N_MAX), (1000, 10, RECORDS, N_MAX), (1000, 10, 300, 64)]
FULL_GRID = (
    [(p, 20, RECORDS, N_MAX) for p in (16, 100, 1000, 10_000, 100_000)]
    + [(16, u, RECORDS, N_MAX) for u in (10, 30, 40)]
    + [(p, 20, PACKED_RECORDS, PACKED_N_MAX) for p in (1000, 10_000, 100_000)]
)


def protocol_rows(
    quick: bool, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """One row per grid point (``quick``: 16 and 10^3 parameters, 10 subjects, ~2 minutes).

    The paper's setting (10,000 records, ``N_max = 2000``: one coordinate per ciphertext)
    and a federation with at most 64 records per subject (``N_max = 64``: packed).
    ``progress`` is told about each point as it finishes."""
    grid = QUICK_GRID if quick else FULL_GRID
    sample = 16 if quick else 32
    rows = []
    for i, (p, u, r, m) in enumerate(grid, 1):
        start = time.perf_counter()
        rows.append(run_point(p, u, records=r, n_max=m, baseline_sample=sample))
        if progress is not None:
            progress(
                f"[{i}/{len(grid)}] params={p} users={u} n_max={m}: "
                f"{time.perf_counter() - start:.1f} s"
            )
    return rows


#: (name, silos, public subjects, pairs with records, parameters, n_max, measured): the shape
#: of the shipped configs (``silodp describe``; mnist_cnn has 105,866 parameters); the zipf
#: config's n_max is beyond exact weights: it ships with fixed-point weights
TARGETS = [
    ("uldp_fmnist_uniform", 5, 1000, 4313, 105_866, 32, True),
    ("uldp_fmnist_zipf", 50, 909, 438, 105_866, 10000, False),
]
#: targets whose config uses weight_encoding = "fixed_point"
FIXED_POINT_TARGETS = {"uldp_fmnist_zipf"}
TARGET_COLUMNS = [
    "target",
    "silos",
    "subjects",
    "pairs",
    "params",
    "n_max",
    "paillier_slots",
    "paillier_cpu_min",
    "bfv_moduli",
    "bfv_cpu_min",
    "ratio",
    "round_ok",
    "ratio_ok",
    "weights_mb_per_silo",
    "once_cpu_min",
    "bfv_how",
    "max_abs_error",
]


def _paillier_cpu_seconds(silos: int, subjects: int, pairs: int, dim: int, n_max: int) -> Row:
    from silodp.crypto.errors import EncodingOverflowError
    from silodp.crypto.paillier import generate_keypair
    from silodp.crypto.weighted_sum import modelled_round_products, product_seconds

    n = generate_keypair(3072).public_key.n
    config = ProtocolConfig(
        silo_ids=tuple(range(silos)), subject_ids=tuple(range(subjects)), n_max=n_max
    )
    try:
        encoding = config.encoding(n)
    except EncodingOverflowError:
        return {"paillier_slots": None, "paillier_cpu_s": None}
    slots = config.slots_for(encoding, dim)
    products = modelled_round_products(
        encoding, dim, pairs, slots, key_bits=n.bit_length(), silos=silos
    )
    return {"paillier_slots": slots, "paillier_cpu_s": products * product_seconds(n * n)}


def _cpu(func: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    out = func()
    return out, time.process_time() - start


def measure_bfv(
    silos: int, subjects: int, dim: int, n_max: int, *, sample_pairs: int = 5, seed: int = 0
) -> Row:
    """Per-operation CPU seconds of the BFV backend at full dimension: weight encryption per
    (subject, prime), silo cost per pair and per silo, aggregation; and the decoded error."""
    from silodp.crypto.bfv import BfvWeightingSession

    rng = np.random.default_rng(seed)
    hist: dict[int, dict[Any, int]] = {s: {s: 1} for s in range(silos)}  # one record each
    hist[silos - 1].update({silos + k: 1 for k in range(sample_pairs - 1)})
    session, keygen = _cpu(
        lambda: BfvWeightingSession(
            hist, n_max=n_max, dim=dim, subject_ids=tuple(range(subjects)), noise_bound=1e3
        )
    )
    plan = session.plan
    moduli = len(plan.plain_moduli)
    sample = sorted({a for h in hist.values() for a in h})
    weights, weights_s = _cpu(lambda: session.server.encrypt_weights())
    deltas = {s: {a: rng.uniform(-1, 1, dim) / np.sqrt(dim) for a in h} for s, h in hist.items()}
    noise = {s: rng.normal(0.0, 1.0 / np.sqrt(silos), dim) for s in hist}
    enc = plan.encoding
    replies, silo_s = [], []
    for s, silo in session.silos.items():
        coded = enc.encode_noise(noise[s])
        start = time.process_time()
        replies.append(silo.weighted_sum(weights, deltas[s], coded, 0))
        silo_s.append(time.process_time() - start)
    ctx = session.server.contexts[0]
    ct_bytes = len(ctx.to_bytes(weights[0][0]))
    result, aggregation_s = _cpu(lambda: session.server.aggregate(replies))
    reference = plaintext_weighted_sum(deltas, hist, noise=noise)
    one = float(np.mean(silo_s[:-1]))
    per_pair = max(0.0, (silo_s[-1] - one) / (sample_pairs - 1))
    cts = plan.blocks * moduli
    return {
        "moduli": moduli,
        "blocks": plan.blocks,
        "keygen_s": keygen,
        "weight_s": weights_s / (subjects * moduli),
        "product_s": per_pair / cts,
        "silo_ct_s": max(0.0, one - per_pair) / cts,
        "aggregation_ct_s": aggregation_s / cts,
        "ct_bytes": ct_bytes,
        "max_abs_error": float(np.abs(result - reference).max()),
        "sampled_subjects": len(sample),
    }


def _bfv_moduli(silos: int, subjects: int, dim: int, n_max: int) -> int:
    from silodp.crypto.bfv import BfvParameters, plan_bfv_round
    from silodp.crypto.bfv.backend import ciphertext_primes

    params = BfvParameters()
    primes = ciphertext_primes(params.poly_degree, params.coeff_bits)
    plan = plan_bfv_round(
        params,
        ciphertext_primes=primes,
        n_max=n_max,
        num_subjects=subjects,
        num_silos=silos,
        dim=dim,
        noise_bound=1e3,
    )
    return len(plan.plain_moduli)


def _fixed_point_target(
    silos: int, subjects: int, pairs: int, dim: int, n_max: int, paillier_s: float | None
) -> Row:
    """The BFV cost with fixed-point weights: a round and, once per training, the weights
    (:func:`~silodp.crypto.bfv.simulation.estimate_bfv_round`, operations timed here)."""
    from silodp.bench.zipf_route import zipf_plan
    from silodp.crypto.bfv.simulation import estimate_bfv_round

    shape = {"silos": silos, "subjects": subjects, "dim": dim, "n_max": n_max}
    plan = zipf_plan(shape)
    est = estimate_bfv_round(plan, pairs=pairs, num_subjects=subjects, num_silos=silos)
    ct_bytes = _level_ct_bytes(plan)
    return {
        "bfv_moduli": len(plan.plain_moduli),
        "bfv_cpu_min": est.cpu_seconds / 60,
        "ratio": None if paillier_s is None else paillier_s / est.cpu_seconds,
        "round_ok": "yes" if est.cpu_seconds <= 15 * 60 else "no",
        "ratio_ok": None,
        "weights_mb_per_silo": subjects * len(plan.plain_moduli) * ct_bytes / 1e6,
        "once_cpu_min": est.setup_cpu_seconds / 60,
        "bfv_how": "fixed-point weights: operations timed here, round and once per training",
    }


def _level_ct_bytes(plan: Any) -> int:
    """Bytes of one serialised ciphertext at the plan's level (as the weights are sent)."""
    from silodp.crypto.bfv.backend import BfvContext, BfvKeyPair, encryptor, new_ciphertext

    params = plan.params
    ctx = BfvContext(params.poly_degree, params.coeff_bits, plan.plain_moduli[0])
    keys = BfvKeyPair.generate([ctx])
    ct = new_ciphertext(ctx)
    encryptor(ctx, keys.public_keys[0]).encrypt_zero(ctx.level(plan.level_drop)[0], ct)
    return len(ctx.to_bytes(ct))


def target_rows(
    targets: Sequence[tuple[str, int, int, int, int, int, bool]] = tuple(TARGETS),
    *,
    sample_pairs: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """One row per target: today's Paillier cost beside the BFV backend's (see the module
    docstring)."""
    rows: list[Row] = []
    unit: Row | None = None
    for name, silos, subjects, pairs, dim, n_max, measured in targets:
        start = time.perf_counter()
        row: Row = {
            "target": name,
            "silos": silos,
            "subjects": subjects,
            "pairs": pairs,
            "params": dim,
            "n_max": n_max,
        }
        paillier = _paillier_cpu_seconds(silos, subjects, pairs, dim, n_max)
        row["paillier_slots"] = paillier["paillier_slots"]
        cpu = paillier["paillier_cpu_s"]
        row["paillier_cpu_min"] = None if cpu is None else cpu / 60
        if name in FIXED_POINT_TARGETS:
            row.update(_fixed_point_target(silos, subjects, pairs, dim, n_max, cpu))
            rows.append(row)
            if progress is not None:
                progress(f"target {name}: {time.perf_counter() - start:.1f} s")
            continue
        moduli = _bfv_moduli(silos, subjects, dim, n_max)
        how = "extrapolated from the first measured target's per-operation costs"
        if measured:
            unit = measure_bfv(silos, subjects, dim, n_max, sample_pairs=sample_pairs)
            how = f"measured ({sample_pairs} pairs in one silo, 1 in the others), extrapolated"
            row["max_abs_error"] = unit["max_abs_error"]
        if unit is not None:
            cts = unit["blocks"] * moduli
            bfv_s = (
                unit["keygen_s"] * moduli / unit["moduli"] / 60  # set-up, amortised over rounds
                + subjects * moduli * unit["weight_s"]
                + pairs * cts * unit["product_s"]
                + silos * cts * unit["silo_ct_s"]
                + cts * unit["aggregation_ct_s"]
            )
            row.update(
                bfv_moduli=moduli,
                bfv_cpu_min=bfv_s / 60,
                ratio=None if cpu is None else cpu / bfv_s,
                round_ok="yes" if bfv_s <= 15 * 60 else "no",
                ratio_ok=None if cpu is None else ("yes" if cpu / bfv_s >= 20 else "no"),
                weights_mb_per_silo=subjects * moduli * unit["ct_bytes"] / 1e6,
                bfv_how=how,
            )
        rows.append(row)
        if progress is not None:
            progress(f"target {name}: {time.perf_counter() - start:.1f} s")
    return rows


class _LazyDeltas(Mapping[Any, np.ndarray]):
    """Silo ``silo``'s unit-norm random deltas, drawn on access (a full-scale round would not
    fit in memory otherwise: 4,300 x 10^5 float64)."""

    def __init__(self, silo: int, subjects: Mapping[Any, int], dim: int) -> None:
        self.silo, self.subjects, self.dim = silo, subjects, dim

    def __getitem__(self, subject: Any) -> np.ndarray:
        if subject not in self.subjects:
            raise KeyError(subject)
        v = np.random.default_rng([self.silo, int(subject)]).standard_normal(self.dim)
        return v / np.linalg.norm(v)

    def __iter__(self) -> Any:
        return iter(self.subjects)

    def __len__(self) -> int:
        return len(self.subjects)


def run_bfv_round(
    silos: int = 5,
    subjects: int = 1000,
    *,
    records: int = 10_000,
    dim: int = 105_866,
    n_max: int = 32,
    seed: int = 0,
) -> Row:
    """Set-up and one whole BFV round, every party in this process one after another, at a
    config's shape (defaults: ``uldp_fmnist_uniform``, ``uldp_uniform`` allocation); CPU and
    wall seconds, and the error against the float64 weighted sum."""
    from silodp.crypto.bfv import BfvWeightingSession

    rng = np.random.default_rng(seed)
    owner = rng.integers(0, subjects, records)
    where = rng.integers(0, silos, records)
    counts = np.zeros((silos, subjects), dtype=np.int64)
    np.add.at(counts, (where, owner), 1)
    hist: dict[int, dict[Any, int]] = {
        s: {a: int(c) for a, c in enumerate(counts[s]) if c} for s in range(silos)
    }
    wall0, cpu0 = time.perf_counter(), time.process_time()
    session = BfvWeightingSession(
        hist, n_max=n_max, dim=dim, subject_ids=tuple(range(subjects)), noise_bound=40.0
    )
    setup_s = time.perf_counter() - wall0
    wall1, cpu1 = time.perf_counter(), time.process_time()
    lazy = {s: _LazyDeltas(s, hist[s], dim) for s in range(silos)}
    result = session.run_round(lazy)
    wall, cpu = time.perf_counter() - wall1, time.process_time() - cpu1
    totals = counts.sum(axis=0)
    reference = np.zeros(dim)
    for s in range(silos):
        for a, c in hist[s].items():
            reference += lazy[s][a] * (c / totals[a])
    return {
        "silos": silos,
        "subjects": subjects,
        "pairs": sum(len(h) for h in hist.values()),
        "params": dim,
        "n_max": n_max,
        "moduli": len(session.plan.plain_moduli),
        "setup_s": setup_s,
        "setup_cpu_s": cpu1 - cpu0,
        "round_wall_s": wall,
        "round_cpu_s": cpu,
        **{f"{k}_s": v for k, v in session.timings.items() if k not in ("keygen", "histogram")},
        "max_abs_error": float(np.abs(result - reference).max()),
    }


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 0.01:
            return f"{value:.3g}"
        return f"{value:.1e}"
    return str(value)


def format_rows(
    rows: Sequence[Row], columns: Sequence[str], *, as_json: bool, table: str | None = None
) -> str:
    """One JSON object per line (with a ``table`` key when given), or a Markdown table of
    ``columns`` (numbers right-aligned, text left-aligned)."""
    if as_json:
        extra = {} if table is None else {"table": table}
        return "\n".join(json.dumps({**extra, **row}) for row in rows)
    return format_table(rows, columns, cell=_cell)


def register(bench_app: typer.Typer) -> None:
    """Adds ``protocol`` to the ``silodp bench`` command group."""

    @bench_app.command("protocol")
    def protocol_command(
        quick: bool = typer.Option(False, "--quick", help="Reduced grid (about two minutes)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per grid point."),
        targets_only: bool = typer.Option(
            False, "--targets-only", help="Only the paper-scale targets (Paillier vs BFV)."
        ),
        bfv_round: bool = typer.Option(
            False,
            "--bfv-round",
            help="Also run one whole BFV round at uldp_fmnist_uniform's shape (~5-10 CPU-min).",
        ),
        zipf_route: bool = typer.Option(
            False,
            "--zipf-route",
            help="Also run the fixed-point weights for one subject at uldp_fmnist_zipf's shape, "
            "checked, with their noise and costs (~30 s).",
        ),
        threads: int = typer.Option(
            1,
            "--threads",
            min=1,
            help="torch intra-op threads (the protocol itself is torch-free).",
        ),
    ) -> None:
        """Private weighting protocol: time per phase and speed-up over python-paillier, then
        each paper-scale target's BFV cost beside today's Paillier cost."""
        from silodp.bench.common import set_threads

        set_threads(threads)
        echo = lambda line: typer.echo(line, err=True)  # noqa: E731
        # explanatory lines beside the tables on stdout, on stderr with --json
        say = lambda line: typer.echo(line, err=as_json)  # noqa: E731
        if not targets_only:
            rows = protocol_rows(quick, progress=echo)
            typer.echo(format_rows(rows, COLUMNS, as_json=as_json, table="protocol"))
        say(
            "Targets: one uldp_avg_w round at the shipped Fashion-MNIST configs' shape; "
            "paillier_cpu_min = today's Paillier cost model, bfv_cpu_min = the BFV backend; "
            "ratio = paillier_cpu_min / bfv_cpu_min (target >= 20, ratio_ok); round_ok: one "
            "round's sequential CPU <= 15 min."
        )
        targets = target_rows(progress=echo)
        typer.echo(format_rows(targets, TARGET_COLUMNS, as_json=as_json, table="targets"))
        if bfv_round:
            row = run_bfv_round()
            typer.echo(format_rows([row], list(row), as_json=as_json, table="bfv_round"))
        if zipf_route:
            from silodp.bench.zipf_route import ZIPF_COLUMNS, run_zipf_route

            say(
                "zipf route (weight_encoding = fixed_point): one subject's weight through the "
                "50 silos' chain under one prime, checked (weight_ok); noise_bits as SEAL "
                "measures it beside the plan's worst-case noise_bound_bits; weights_cpu_min = "
                "every subject and prime once per training, round_cpu_min = one round."
            )
            rows = run_zipf_route()
            typer.echo(format_rows(rows, ZIPF_COLUMNS, as_json=as_json, table="zipf_route"))
