"""``silodp bench``: speed and memory measured side by side in one run."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import typer

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmarks: DP step speed, ULDP per-subject training, accounting, protocols.",
)

STEP_COLUMNS = (
    "model",
    "batch",
    "method",
    "examples_per_s",
    "ratio_to_plain",
    "step_ms",
    "sys_ms",
    "minflt",
    "peak_rss_mb",
    "subjects",
    "note",
)
STEP_CHECK_COLUMNS = (
    "model",
    "batch",
    "slowest_silodp",
    "silodp_ratio",
    "ratio_ok",
    "fastest_opacus",
    "opacus_ratio",
    "vs_opacus_ok",
    "noise_ratio",
    "noise_ok",
    "subject_norm_ratio",
    "subject_norm_ok",
    "torch_routes_ratio",
    "max_extra_mb",
    "memory_ok",
)
ULDP_COLUMNS = (
    "source",
    "model",
    "subjects",
    "silo_subject_pairs",
    "fill",
    "algorithm",
    "path",
    "vectorised_s",
    "loop_s",
    "paper_style_s",
    "speedup",
    "max_abs_diff",
    "local_update_s",
    "local_update_user_s",
    "local_update_sys_s",
    "local_update_minflt",
    "local_update_speedup",
    "round_gmac",
    "floor_s",
    "max_speedup",
    "peak_rss_mb",
    "loop_peak_rss_mb",
)

JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON object per row, one per line.")]
ThreadsOpt = Annotated[
    int, typer.Option("--threads", min=1, help="torch intra-op and BLAS threads.")
]


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """No warnings, and silodp's and Opacus' log at ERROR, until the block (or the command it
    decorates) ends: a command may run inside a longer-lived process (typer's CliRunner, a
    notebook)."""
    loggers = [logging.getLogger(name) for name in ("silodp", "opacus")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def _say(message: str, as_json: bool) -> None:
    """Informational lines: stdout for tables, stderr with ``--json`` (stdout stays JSON)."""
    typer.echo(message, err=as_json)


def _emit(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], as_json: bool, **extra: Any
) -> None:
    from silodp.bench.common import format_table

    if as_json:
        for row in rows:
            typer.echo(json.dumps(_clean({**extra, **row})))
    else:
        typer.echo(format_table(rows, columns))


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, float) and value != value:  # NaN
            value = None
        elif isinstance(value, float) and value in (float("inf"), float("-inf")):
            value = None
        out[key] = value
    return out


@bench_app.command()
@_silenced()
def step(
    quick: Annotated[
        bool, typer.Option("--quick", help="femnist_cnn at B=256 only (about 2 minutes).")
    ] = False,
    as_json: JsonOpt = False,
    repeats: Annotated[
        int | None,
        typer.Option("--repeats", min=1, help="Interleaved repeats (median)."),
    ] = None,
    threads: ThreadsOpt = 1,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="Models (repeatable); default all.")
    ] = None,
    batch: Annotated[
        list[int] | None, typer.Option("--batch", min=1, help="Batch sizes (repeatable).")
    ] = None,
    lstm: Annotated[bool, typer.Option(help="Also the shakespeare_lstm rows (B=32).")] = True,
    rss: Annotated[bool, typer.Option(help="Measure peak RSS in fresh worker processes.")] = True,
    max_extra_gb: Annotated[
        float, typer.Option(help="Skip methods estimated to need more extra memory (GB).")
    ] = 6.0,
) -> None:
    """Examples/s of one training step: plain SGD, Opacus (hooks, ghost) and silodp's DP steps."""
    from silodp.bench.step import DEFAULT_BATCHES, DEFAULT_MODELS, run_step_bench, step_checks
    from silodp.bench.step_methods import SPECS

    models = tuple(model) if model else (("femnist_cnn",) if quick else DEFAULT_MODELS)
    unknown = [m for m in models if m not in SPECS]
    if unknown:
        raise typer.BadParameter(f"Expected --model in {sorted(SPECS)}, got {unknown}.")
    batches = tuple(batch) if batch else ((256,) if quick else DEFAULT_BATCHES)
    repeats = repeats or 3
    started = time.perf_counter()
    rows = run_step_bench(
        models=models,
        batches=batches,
        lstm=lstm and not quick,
        repeats=repeats,
        threads=threads,
        measure_rss=rss,
        max_extra_gb=max_extra_gb,
        log=lambda m: _say(f"  [{time.perf_counter() - started:4.0f} s] {m}", True),
    )
    used = rows[0]["threads"] if rows else threads
    _say(
        f"silodp bench step: torch threads = {used}; median of {repeats} interleaved repeats; "
        "ratio_to_plain = method time / plain time; sys_ms, minflt = system CPU ms and minor "
        "page faults of this process per step; peak_rss_mb = extra peak RSS over a "
        "worker that only builds model and data (fresh process).",
        as_json,
    )
    _emit(rows, STEP_COLUMNS, as_json, table="step")
    checks = step_checks(rows)
    if checks:
        _say(
            "\nTargets: every silodp DP step <= 2.5x plain and at least as fast as Opacus' "
            "fastest mode; DP-SGD with exact noise <= 1.2x the same step with float32 "
            "torch.randn noise (noise_ratio = local_item_dp / local_item_dp_float_noise); "
            "on the mlp, the per-subject-norm steps <= 2x plain (subject_norm_ratio; "
            "torch_routes_ratio: the same steps without the compiled path); femnist B=512 "
            "within 2 GB extra memory.",
            as_json,
        )
        _emit(checks, STEP_CHECK_COLUMNS, as_json, table="step_check")
    _say(f"\ntook {time.perf_counter() - started:.0f} s", as_json)


@bench_app.command()
@_silenced()
def uldp(
    quick: Annotated[
        bool, typer.Option("--quick", help="digits only, 100 and 1000 subjects.")
    ] = False,
    as_json: JsonOpt = False,
    repeats: Annotated[
        int, typer.Option("--repeats", min=1, help="Interleaved repeats (median).")
    ] = 3,
    threads: ThreadsOpt = 1,
    rss: Annotated[bool, typer.Option(help="Measure peak RSS in fresh worker processes.")] = True,
    source: Annotated[
        list[str] | None,
        typer.Option(
            "--source",
            help="Setting to run (repeatable): digits, fashion_mnist (mnist_cnn), "
            "fashion_mnist_mlp (30,000 records) or fashion_mnist_uldp_cnn (the ULDP-FL "
            "paper's CNN and setting); default all, --quick digits.",
        ),
    ] = None,
    subjects: Annotated[
        list[int] | None,
        typer.Option("--subjects", min=1, help="Subject counts (repeatable); default 100, 1000."),
    ] = None,
) -> None:
    """ULDP-AVG/SGD per-subject local training: vectorised vs one-model-at-a-time loop."""
    from silodp.bench.uldp import TARGET_SPEEDUP, run_uldp_bench, uldp_checks

    started = time.perf_counter()
    from silodp.bench.uldp import SETTINGS

    sources = tuple(source) if source else (("digits",) if quick else tuple(SETTINGS))
    unknown = [s for s in sources if s not in SETTINGS]
    if unknown:
        raise typer.BadParameter(f"Expected --source in {sorted(SETTINGS)}, got {unknown}.")
    rows = run_uldp_bench(
        sources=sources,
        subject_counts=tuple(subjects) if subjects else (100, 1000),
        repeats=repeats,
        threads=threads,
        measure_rss=rss,
        log=lambda m: _say(f"  [{time.perf_counter() - started:4.0f} s] {m}", True),
    )
    used = rows[0]["threads"] if rows else threads
    _say(
        f"silodp bench uldp: torch threads = {used}; 5 silos, uldp_uniform allocation; seconds "
        f"per round (all silos), median of {repeats} interleaved repeats; speedup = loop / "
        "vectorised (per_subject_deltas: the subjects of a chunk trained together; path = "
        "stacked: a CNN's copies as one grouped channels-last model, vmap: torch.func.vmap); "
        "local_update_speedup = loop / the algorithm's local_update (clipping, weighting and "
        "noise included; uldp_sgd: per-subject norms without model copies, except on the "
        "stacked path, which is faster there); peak_rss_mb = extra peak RSS of "
        "one round of the algorithm's "
        "local_update (vectorised) in a fresh process, loop_peak_rss_mb the same for the loop; "
        "paper_style_s = a uldp_avg round run the way the ULDP-FL paper's implementation runs "
        "it (its setting only; clipping, weighting and noise included); "
        "fill = share of the vectorised batch slots holding a real record; local_update_user_s, "
        "_sys_s, _minflt = user and system CPU seconds and minor page faults of this process "
        "per local_update round (median; the JSON rows have them for every path); "
        "round_gmac = the round's multiply-adds (forward and backward, real records only, "
        "direct algorithm), floor_s = round_gmac at this machine's peak rate (the faster of "
        "a large matrix product and a large convolution, measured before and after; printed "
        "below), about the least time any implementation of the same arithmetic can take; "
        "max_speedup = loop_s / floor_s, about the largest speed-up over the loop any "
        "implementation could show.",
        as_json,
    )
    _emit(rows, ULDP_COLUMNS, as_json, table="uldp")
    if rows:
        plural = "" if used == 1 else "s"
        _say(f"peak: {rows[0]['peak_gmac_s']:.1f} GMAC/s ({used} thread{plural})", as_json)
    _say(
        f"\nTarget: local_update >= {TARGET_SPEEDUP:g}x faster than the loop at 100 subjects, "
        f"and on the ULDP-FL paper's setting >= {TARGET_SPEEDUP:g}x faster than its own "
        "implementation (vs_paper = paper_cpu_s / cpu_s: user + system CPU-s of a round "
        "run the paper's way, per subject a model copy, an optimiser and a DataLoader, over "
        "local_update's, timed side by side in this run); memory bounded at 1000. "
        "max_speedup / local_update_speedup = local_update_s / floor_s is how far the "
        "round is from its floor; where max_speedup is below the target, no implementation "
        "of the round's arithmetic could reach it here (to the accuracy of the measured "
        "peak).",
        as_json,
    )
    _emit(
        uldp_checks(rows),
        (
            "source",
            "subjects",
            "algorithm",
            "speedup",
            "local_update_speedup",
            "max_speedup",
            "paper_cpu_s",
            "cpu_s",
            "vs_paper",
            "target",
            "ok",
            "extra_mb",
            "memory_vs_fewest",
        ),
        as_json,
        table="uldp_check",
    )
    _say(f"\ntook {time.perf_counter() - started:.0f} s", as_json)


@bench_app.command()
@_silenced()
def account(
    as_json: JsonOpt = False,
    threads: ThreadsOpt = 1,
    samples: Annotated[
        int, typer.Option("--samples", min=1, help="Rounds timed at each checkpoint (median).")
    ] = 5,
    configs: Annotated[
        bool, typer.Option("--configs/--no-configs", help="Calibrate the shipped configs too.")
    ] = True,
) -> None:
    """Time to calibrate σ (RDP only vs all routes with PLD), per-round accounting cost (bounded
    vs full PLD support) and calibration time of the shipped configs."""
    from silodp.bench.account import (
        CALIBRATION_COLUMNS,
        CONFIG_COLUMNS,
        CONFIG_TARGET_S,
        ROUND_COLUMNS,
        SILO_RECORDS,
        run_account_bench,
    )
    from silodp.bench.common import set_threads

    used = set_threads(threads)
    started = time.perf_counter()
    calibrated, per_round, shipped = run_account_bench(
        threads=threads, samples=samples, configs=configs
    )
    _say(
        f"silodp bench account: torch threads = {used}; plan: {len(SILO_RECORDS)} silos of "
        f"{', '.join(map(str, SILO_RECORDS))} records (100 subjects each), B=16, T=10 local "
        "steps, R=20 rounds, span 5, target epsilon 4 at delta 1e-5. rdp_s: calibration on "
        "the RDP routes only; all_s: calibrate_noise (RDP bisection, then every route incl. "
        "PLD), pld_phase_s its time in PLD evaluations; *_eval_s: one epsilon evaluation of the "
        "plan at sigma_all on that route alone (caches cleared).",
        as_json,
    )
    _emit(calibrated, CALIBRATION_COLUMNS, as_json, table="calibration")
    _say(
        f"\nPer round: compose_round + estimates (all routes) after N rounds already composed, "
        f"median of {samples}, at the calibrated sigma; growth = round_s / round_s after 10 "
        "rounds (target: flat). round_s: composed PLD bounded to pld_points (default); "
        "*_full: its full support (pld_points=None), timed interleaved.",
        as_json,
    )
    _emit(per_round, ROUND_COLUMNS, as_json, table="round")
    if shipped:
        _say(
            f"\nShipped configs (configs/*.toml with their data present): seconds to calibrate "
            f"sigma as a run plans it (target: under {CONFIG_TARGET_S:g} s).",
            as_json,
        )
        _emit(shipped, CONFIG_COLUMNS, as_json, table="config")
    _say(f"\ntook {time.perf_counter() - started:.0f} s", as_json)


def _register_protocol() -> None:
    from silodp.bench import protocol

    protocol.register(bench_app)


_register_protocol()
