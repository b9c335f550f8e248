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
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import typer

from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.prg import MaskStream
from silodp.crypto.protocol import ProtocolConfig, WeightingSession, plaintext_weighted_sum

__all__ = ["COLUMNS", "format_rows", "protocol_rows", "register", "run_point"]

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


def format_rows(rows: Sequence[Row], columns: Sequence[str], *, as_json: bool) -> str:
    """One JSON object per line, or a Markdown table of ``columns``."""
    if as_json:
        return "\n".join(json.dumps(row) for row in rows)
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    lines.extend(
        "| " + " | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) + " |" for r in cells
    )
    return "\n".join(lines)


def register(bench_app: typer.Typer) -> None:
    """Adds ``protocol`` to the ``silodp bench`` command group."""

    @bench_app.command("protocol")
    def protocol_command(
        quick: bool = typer.Option(False, "--quick", help="Reduced grid (about two minutes)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per grid point."),
    ) -> None:
        """Private weighting protocol: time per phase and speed-up over python-paillier."""
        rows = protocol_rows(quick, progress=lambda line: typer.echo(line, err=True))
        typer.echo(format_rows(rows, COLUMNS, as_json=as_json))
