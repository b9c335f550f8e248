"""``silodp bench step``: one training step per method, examples/s and ratio to plain SGD.

Times the steps built by :mod:`silodp.bench.step_methods` (which says what each method runs)
interleaved on the same batch, measures each one's extra peak RSS in a fresh worker process,
and checks the results against the targets (:func:`step_checks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from silodp.bench.common import Row, interleaved_usage, peak_rss_mb, run_workers, vm_hwm_mb
from silodp.bench.step_methods import (
    ALIASES,
    LSTM_METHODS,
    LSTM_VMAP_NOTE,
    METHODS,
    NOTES,
    SPECS,
    ModelSpec,
    Skip,
    StepData,
    build_step,
    estimate_extra_bytes,
    make_data,
)

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_MODELS",
    "LSTM_METHODS",
    "METHODS",
    "ModelSpec",
    "Skip",
    "build_step",
    "estimate_extra_bytes",
    "run_step_bench",
]

DEFAULT_MODELS = ("femnist_cnn", "mnist_cnn", "mlp")
DEFAULT_BATCHES = (64, 256, 512)
LSTM_BATCH = 32


@dataclass
class StepCase:
    model: str
    batch: int
    methods: Sequence[str]
    notes: dict[str, str] = field(default_factory=dict)


def cases(models: Sequence[str], batches: Sequence[int], *, lstm: bool) -> list[StepCase]:
    out = [StepCase(m, b, METHODS) for m in models for b in batches]
    if lstm:
        out.append(StepCase("shakespeare_lstm", LSTM_BATCH, LSTM_METHODS, {"vmap": LSTM_VMAP_NOTE}))
    return out


def _failed(skipped: dict[str, str], name: str, err: BaseException) -> None:
    skipped[name] = f"failed: {type(err).__name__}: {str(err)[:120]}"


def _subjects_of(data: StepData, method: str) -> int | None:
    if method.endswith("uniform"):
        return int(torch.unique(data.uniform).numel())
    if method.endswith("skewed"):
        return int(torch.unique(data.skewed).numel())
    return None


def run_step_bench(
    *,
    models: Sequence[str] = DEFAULT_MODELS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    lstm: bool = True,
    repeats: int = 3,
    threads: int = 1,
    measure_rss: bool = True,
    rss_steps: int = 1,
    rss_jobs: int = 2,
    max_extra_gb: float = 6.0,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Rows ``{model, batch, method, threads, examples_per_s, ratio_to_plain, step_ms,
    user_ms, sys_ms, minflt, peak_rss_mb, ...}`` for every model × batch × method (skipped
    methods carry ``skipped``); ``user_ms``, ``sys_ms`` and ``minflt`` are this process's CPU
    time and minor page faults per step (medians)."""
    from silodp.bench.common import set_threads

    threads = set_threads(threads)
    limit = max_extra_gb * 2**30
    rows: list[Row] = []
    for case in cases(models, batches, lstm=lstm):
        data = make_data(case.model, case.batch)
        steps: dict[str, Callable[[], object]] = {}
        skipped: dict[str, str] = {}
        for method in case.methods:
            if method in ALIASES:
                continue
            try:
                steps[method] = build_step(
                    case.model, case.batch, method, data=data, max_extra_bytes=limit
                )
            except Skip as why:
                skipped[method] = str(why)

        if log is not None:
            log(f"{case.model} B={case.batch}: timing {len(steps)} methods, {repeats} repeats")
        usage = interleaved_usage(
            steps, repeats=repeats, warmup=1, on_error=partial(_failed, skipped)
        )
        medians = {name: u.wall_s for name, u in usage.items()}
        steps.clear()
        plain = medians.get("plain")
        case_rows = []
        for method in case.methods:
            timed = ALIASES.get(method, method)
            seconds = medians.get(timed)
            row: Row = {
                "model": case.model,
                "batch": case.batch,
                "method": method,
                "threads": threads,
                "examples_per_s": None if seconds is None else case.batch / seconds,
                "ratio_to_plain": None if seconds is None or not plain else seconds / plain,
                "step_ms": None if seconds is None else 1e3 * seconds,
                # this process's CPU per step: system time and minor faults show allocation
                # churn (large blocks mapped and faulted in afresh every step)
                "user_ms": None if timed not in usage else 1e3 * usage[timed].user_s,
                "sys_ms": None if timed not in usage else 1e3 * usage[timed].sys_s,
                "minflt": None if timed not in usage else usage[timed].minor_faults,
                "peak_rss_mb": None,
                "subjects": _subjects_of(data, method),
                "repeats": repeats,
                "note": case.notes.get(method) or NOTES.get(method, ""),
            }
            if timed in skipped:
                row["skipped"] = skipped[timed]
                row["note"] = f"skipped: {skipped[timed]}"
            case_rows.append(row)
        if measure_rss:
            if log is not None:
                log(f"{case.model} B={case.batch}: peak memory, one fresh process per method")
            _add_rss(case, case_rows, threads=threads, steps=rss_steps, limit=limit, jobs=rss_jobs)
        rows.extend(case_rows)
        if log is not None:
            log(f"done {case.model} B={case.batch}")
    return rows


def _add_rss(
    case: StepCase, rows: list[Row], *, threads: int, steps: int, limit: float, jobs: int
) -> None:
    common = [
        "step",
        "--model",
        case.model,
        "--batch",
        str(case.batch),
        "--threads",
        str(threads),
        "--steps",
        str(steps),
        "--max-extra-bytes",
        str(int(limit)),
    ]
    wanted = ["none"]
    for row in rows:
        method = str(ALIASES.get(row["method"], row["method"]))
        if "skipped" not in row and method not in wanted:
            wanted.append(method)
    jobs_args = {m: [*common, "--method", m] for m in wanted}
    if any(m.startswith("opacus") for m in wanted):
        jobs_args["none+opacus"] = [*common, "--method", "none", "--with-opacus"]
    results = run_workers(jobs_args, jobs=jobs)
    for row in rows:
        method = str(ALIASES.get(row["method"], row["method"]))
        if "skipped" in row:
            continue
        base = results["none+opacus" if method.startswith("opacus") else "none"]
        baseline = base.get("peak_rss_mb")
        result = results[method]
        if "error" in result or baseline is None:
            row["rss_error"] = result.get("error") or base.get("error")
            continue
        row["peak_rss_mb"] = max(0.0, float(result["peak_rss_mb"]) - float(baseline))
        row["peak_rss_total_mb"] = float(result["peak_rss_mb"])
        row["baseline_rss_mb"] = float(baseline)


def worker_step(
    model: str, batch: int, method: str, *, steps: int, max_extra_bytes: float
) -> dict[str, Any]:
    """Builds the model and data (and, unless ``method == "none"``, runs ``steps`` steps);
    reports this process's peak RSS."""
    data = make_data(model, batch)
    spec = SPECS[model]
    from silodp.models import build_model

    build_model(model, spec.feature_shape, spec.num_classes)
    if method != "none":
        fn = build_step(model, batch, method, data=data, max_extra_bytes=max_extra_bytes)
        for _ in range(steps):
            fn()
    return {"peak_rss_mb": peak_rss_mb(), "vm_hwm_mb": vm_hwm_mb(), "method": method}


#: silodp's DP training steps (the targets apply to these; ``vmap`` is a reference path;
#: ``subject_norm_*`` is ``uldp_sgd``'s step).
SILODP_DP_METHODS = (
    "local_item_dp",
    "local_group_dp",
    "higradavg_uniform",
    "higradavg_skewed",
    "user_ldp",
    "subject_norm_uniform",
    "subject_norm_skewed",
)
OPACUS_METHODS = ("opacus_hooks", "opacus_ghost", "opacus_hooks_dplstm", "opacus_ghost_dplstm")
#: Targets: every silodp DP step at most this many times plain SGD's time ...
TARGET_RATIO = 2.5
#: ... DP-SGD with exact noise at most this many times the same step with float noise ...
TARGET_NOISE_RATIO = 1.2
#: ... and femnist at B=512 within this much extra memory (MiB).
TARGET_FEMNIST_512_MB = 2048.0
#: the per-subject-norm step (``uldp_sgd``'s) on the mlp at most this many times plain SGD
TARGET_SUBJECT_NORM_MLP = 2.0


def step_checks(rows: Sequence[Row]) -> list[Row]:
    """Per model and batch: the slowest silodp DP step against the targets (≤ 2.5× plain,
    at least as fast as Opacus' fastest mode), DP-SGD with exact noise against the same step
    with float noise (≤ 1.2×: ``noise_ratio``) and, for femnist at B=512, the largest extra
    memory of a silodp DP step against 2 GB."""
    out: list[Row] = []
    keys = list(dict.fromkeys((r["model"], r["batch"]) for r in rows))
    for model, batch in keys:
        group = [r for r in rows if r["model"] == model and r["batch"] == batch]
        ours = [r for r in group if r["method"] in SILODP_DP_METHODS and r["ratio_to_plain"]]
        theirs = [r for r in group if r["method"] in OPACUS_METHODS and r["ratio_to_plain"]]
        if not ours:
            continue
        worst = max(ours, key=lambda r: r["ratio_to_plain"])
        best_opacus = min(theirs, key=lambda r: r["ratio_to_plain"]) if theirs else None
        check: Row = {
            "model": model,
            "batch": batch,
            "slowest_silodp": worst["method"],
            "silodp_ratio": worst["ratio_to_plain"],
            "ratio_target": f"<= {TARGET_RATIO:g}",
            "ratio_ok": worst["ratio_to_plain"] <= TARGET_RATIO,
            "fastest_opacus": None if best_opacus is None else best_opacus["method"],
            "opacus_ratio": None if best_opacus is None else best_opacus["ratio_to_plain"],
            "vs_opacus_ok": None
            if best_opacus is None
            else worst["ratio_to_plain"] <= best_opacus["ratio_to_plain"],
        }
        exact = next((r for r in group if r["method"] == "local_item_dp"), None)
        floating = next((r for r in group if r["method"] == "local_item_dp_float_noise"), None)
        if exact and floating and exact.get("step_ms") and floating.get("step_ms"):
            ratio = exact["step_ms"] / floating["step_ms"]
            check["noise_ratio"] = ratio
            check["noise_target"] = f"<= {TARGET_NOISE_RATIO:g}"
            check["noise_ok"] = ratio <= TARGET_NOISE_RATIO
        if model == "mlp":
            _subject_norm_check(check, group)
        if model == "femnist_cnn" and batch == 512:
            mems = [r["peak_rss_mb"] for r in ours if r.get("peak_rss_mb") is not None]
            if mems:
                check["max_extra_mb"] = max(mems)
                check["memory_ok"] = max(mems) <= TARGET_FEMNIST_512_MB
        out.append(check)
    return out


def _subject_norm_check(check: Row, group: Sequence[Row]) -> None:
    """The slowest per-subject-norm step against :data:`TARGET_SUBJECT_NORM_MLP`, beside the
    slowest of the same steps through the torch routes (the baseline of the compiled path)."""
    for suffix, key in (("", "subject_norm"), ("_torch", "torch_routes")):
        names = {f"subject_norm_uniform{suffix}", f"subject_norm_skewed{suffix}"}
        ratios = [
            r["ratio_to_plain"] for r in group if r["method"] in names and r["ratio_to_plain"]
        ]
        if ratios:
            check[f"{key}_ratio"] = max(ratios)
    if "subject_norm_ratio" in check:
        check["subject_norm_ok"] = check["subject_norm_ratio"] <= TARGET_SUBJECT_NORM_MLP
