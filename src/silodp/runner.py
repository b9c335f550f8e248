"""Runs an experiment config: data, calibration, simulation, and every output file.

Everything that can be wrong with a config (bad values, an unreachable privacy target, missing
data) is found before the first round trains, so a failed start leaves no results behind. Each
round's metrics, including the privacy spent so far, are written atomically as soon as the
round ends, so an interrupted run keeps an exact record of what it spent.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

from silodp import plotting
from silodp.accounting import FederatedAccountant
from silodp.accounting.plan import PrivacyPlan, calibrate_noise
from silodp.algorithms import ALGORITHMS, Algorithm, AlgorithmConfig, make_algorithm
from silodp.algorithms.uldp import SECURE_AGGREGATION
from silodp.config import ExperimentConfig, PrivacyConfig, TrainingConfig, to_toml_dict
from silodp.data import FederatedData, FederatedDataset
from silodp.data.build import build_federated_data
from silodp.data.describe import describe
from silodp.data.partition import cap_records, cap_span
from silodp.federated import RoundResult, Simulator
from silodp.io import write_json, write_jsonl, write_text
from silodp.models import build_model

__all__ = ["OutputExistsError", "PreparedRun", "prepare_run", "run_experiment"]

logger = logging.getLogger(__name__)

ProgressFactory = Callable[[str, int], Callable[[RoundResult], None]]


class OutputExistsError(FileExistsError):
    """The output directory already holds results of a run."""


@dataclass
class PreparedRun:
    """One algorithm's run, fully resolved before training starts."""

    name: str
    algorithm: Algorithm
    training: TrainingConfig
    privacy: PrivacyConfig
    train: FederatedDataset
    group_size: int | None
    group_size_source: str
    span: int
    span_source: str
    plan: PrivacyPlan | None
    noise_multiplier: float | None
    calibration: dict[str, Any]

    @property
    def silos_per_round(self) -> int:
        return self.training.silos_per_round or self.train.num_silos

    def account_command(self) -> str | None:
        """A ``silodp account`` call that reproduces this run's per-round ε (all silos taking
        part; with fewer silos per round the run's ε is at most this)."""
        if self.plan is None or self.noise_multiplier is None:
            return None
        args = [
            "silodp",
            "account",
            "--algorithm",
            self.name,
            "--noise-multiplier",
            repr(self.noise_multiplier),
            "--delta",
            repr(self.privacy.delta),
            "--sample-rate",
            repr(max(self.plan.sampling_rates)),
            "--steps",
            str(self.training.local_steps),
            "--rounds",
            str(self.training.rounds),
            "--silos",
            str(self.train.num_silos),
            "--silos-per-round",
            str(self.silos_per_round),
            "--span",
            str(self.span),
        ]
        if self.group_size is not None:
            args += ["--group-size", str(self.group_size)]
        if self.name == "higradavg_dp":
            args += ["--sampling", self.privacy.sampling]
        return shlex.join(args)


def _group_bound(train: FederatedDataset, value: int | str, scope: str) -> int:
    if isinstance(value, int):
        return value
    counts = train.histogram().sum(axis=0) if scope == "federation" else train.histogram()
    counts = counts[counts > 0]
    return int(counts.max()) if value == "max" else max(1, int(np.median(counts)))


def _bound_data(
    train: FederatedDataset, privacy: PrivacyConfig, seed: int, scope: str | None
) -> tuple[FederatedDataset, int | None, str, int, str]:
    """Applies the public span and group bounds (dropping excess records, SPEC §1).

    ``scope`` says what the group bound counts: a subject's records in one silo (``silo``) or
    in the whole federation (``federation``, ULDP-GROUP-k); ``None`` when the algorithm's
    accounting does not use one.
    """
    span_source = "config" if privacy.span is not None else "number of silos (worst case)"
    span = min(privacy.span or train.num_silos, train.num_silos)
    train = cap_span(train, span=span, seed=seed)
    if scope is None:
        return train, None, "not used by this algorithm", span, span_source
    where = "in one silo" if scope == "silo" else "in the federation"
    if privacy.group_size is not None:
        k = _group_bound(train, privacy.group_size, scope)
        if scope == "federation":
            train = cap_records(train, total=k, seed=seed)
        else:
            train = cap_records(train, per_silo=k, seed=seed)
        source = (
            "config"
            if isinstance(privacy.group_size, int)
            else f"data ({privacy.group_size} records of a subject {where})"
        )
        return train, k, source, span, span_source
    largest = _group_bound(train, "max", scope)
    logger.warning(
        "privacy.group_size is not set: using the data's largest count of one subject's "
        "records %s (%d) as the bound k. That bound depends on the data; set "
        "privacy.group_size to a public bound for a strictly valid subject-level guarantee.",
        where,
        largest,
    )
    return train, largest, f"data (largest {where}; set privacy.group_size)", span, span_source


def prepare_run(name: str, config: ExperimentConfig, data: FederatedData) -> PreparedRun:
    """Resolves bounds, the privacy plan and σ for algorithm ``name``; trains nothing."""
    training, privacy = config.for_algorithm(name)
    cls = ALGORITHMS[name]
    uses_group = cls.uses_group_bound and not (
        name == "higradavg_dp" and privacy.sampling == "subject"
    )
    train, group_size, group_source, span, span_source = _bound_data(
        data.train, privacy, config.data.seed, cls.group_scope if uses_group else None
    )
    silos_per_round = training.silos_per_round or train.num_silos
    if silos_per_round > train.num_silos:
        raise ValueError(
            f"Expected training.silos_per_round={silos_per_round} <= {train.num_silos} silos."
        )
    algo_config = AlgorithmConfig(
        local_steps=training.local_steps,
        batch_size=training.batch_size,
        lr=training.lr,
        server_lr=training.server_lr,
        clip=privacy.clip,
        noise_multiplier=privacy.noise_multiplier or 0.0,
        group_size=group_size or 1,
        sampling=privacy.sampling,
        subject_records=privacy.subject_records,
        local_epochs=training.local_epochs,
        grad_method=training.grad_method,
        subject_rate=privacy.subject_rate,
        secure_noise=privacy.secure_noise,
        weighting=privacy.weighting,
        key_bits=privacy.key_bits,
        n_max=privacy.n_max,
        client_rate=training.client_rate,
        optimizer=training.optimizer,
        momentum=training.momentum,
        helper=training.helper,
        alpha=tuple(training.alpha) if isinstance(training.alpha, list) else training.alpha,
    )
    probe = make_algorithm(name, algo_config)
    if probe.threat_model == SECURE_AGGREGATION and silos_per_round != train.num_silos:
        raise ValueError(
            f"{name} splits its noise over all {train.num_silos} silos; expected "
            f"training.silos_per_round={silos_per_round} to be {train.num_silos}."
        )
    plan: PrivacyPlan | None = None
    sigma: float | None = None
    calibration: dict[str, Any] = {"method": "not private"}
    if probe.calibration_unit is not None:
        sizes = train.silo_sizes()
        subjects = (train.histogram() > 0).sum(axis=1)
        rates = tuple(
            probe.sampling_rate(num_records=int(n), num_subjects=int(a))
            for n, a in zip(sizes, subjects, strict=True)
        )
        plan = PrivacyPlan(
            sampling_rates=rates,
            rounds=training.rounds,
            silos_per_round=silos_per_round,
            span=span,
            delta=privacy.delta,
        )
        if privacy.noise_multiplier is not None:
            sigma = privacy.noise_multiplier
            calibration = {"method": "given noise_multiplier"}
        else:
            assert privacy.epsilon is not None
            started = time.perf_counter()
            sigma = calibrate_noise(name, algo_config, plan, target_epsilon=privacy.epsilon)
            calibration = {
                "method": "calibrated",
                "target_epsilon": privacy.epsilon,
                "unit": probe.calibration_unit,
                "seconds": round(time.perf_counter() - started, 2),
            }
        algo_config = dataclasses.replace(algo_config, noise_multiplier=sigma)
    return PreparedRun(
        name=name,
        algorithm=make_algorithm(name, algo_config, train),
        training=training,
        privacy=privacy,
        train=train,
        group_size=group_size,
        group_size_source=group_source,
        span=span,
        span_source=span_source,
        plan=plan,
        noise_multiplier=sigma,
        calibration=calibration,
    )


def _resolved_config(config: ExperimentConfig, run: PreparedRun) -> dict[str, Any]:
    privacy = dataclasses.replace(
        run.privacy,
        noise_multiplier=run.noise_multiplier,
        group_size=run.group_size,
        span=run.span,
    )
    resolved = dataclasses.replace(
        config,
        algorithms=(run.name,),
        training=run.training,
        privacy=privacy,
        overrides={},
    )
    return to_toml_dict(resolved)


def _summary(
    run: PreparedRun, results: list[RoundResult], status: str, started: float
) -> dict[str, Any]:
    last = results[-1] if results else None
    final_acc = next(
        (r.test_accuracy for r in reversed(results) if r.test_accuracy is not None), None
    )
    final_loss = next((r.test_loss for r in reversed(results) if r.test_loss is not None), None)
    algorithm = run.algorithm
    return {
        "algorithm": run.name,
        "status": status,
        "rounds_completed": len(results),
        "rounds_planned": run.training.rounds,
        "test_accuracy": final_acc,
        "test_loss": final_loss,
        "epsilon": last.to_json()["epsilon"] if last else {},
        "epsilon_route": last.epsilon_route if last else {},
        "mu": last.mu if last else {},
        "delta": run.privacy.delta if run.plan else None,
        "units": list(algorithm.units),
        "noise_multiplier": run.noise_multiplier,
        "clip": run.privacy.clip if run.plan else None,
        "calibration": run.calibration,
        "group_size": run.group_size,
        "group_size_source": run.group_size_source,
        "span": run.span,
        "span_source": run.span_source,
        "dropped_records": run.train.dropped_records,
        "sampling_rate": (
            {"min": min(run.plan.sampling_rates), "max": max(run.plan.sampling_rates)}
            if run.plan
            else None
        ),
        "threat_model": algorithm.threat_model,
        "weights_private": getattr(algorithm, "weights_private", None),
        "notes": algorithm.run_notes(),
        "account_command": run.account_command(),
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def _check_output(out_dir: Path, names: tuple[str, ...], overwrite: bool) -> None:
    for name in names:
        existing = out_dir / name / "summary.json"
        if existing.exists() and not overwrite:
            raise OutputExistsError(
                f"Results already exist at {str(existing)!r}; choose another --out or pass "
                "--overwrite."
            )


def _train(
    config: ExperimentConfig,
    data: FederatedData,
    run: PreparedRun,
    run_dir: Path,
    progress: ProgressFactory | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    started = time.perf_counter()
    write_text(run_dir / "config.toml", tomli_w.dumps(_resolved_config(config, run)))
    model = build_model(
        config.model.name,
        data.train.feature_shape,
        data.train.num_classes,
        seed=run.training.seed,
    )
    accountant = (
        FederatedAccountant(units=run.algorithm.units, span=run.span, delta=run.privacy.delta)
        if run.plan is not None
        else None
    )
    simulator = Simulator(
        algorithm=run.algorithm,
        model=model,
        train=run.train,
        test=data.test,
        accountant=accountant,
        silos_per_round=run.silos_per_round,
        seed=run.training.seed,
        eval_every=run.training.eval_every,
    )
    results: list[RoundResult] = []
    rows: list[dict[str, Any]] = []

    def record(result: RoundResult) -> None:
        results.append(result)
        rows.append(result.to_json())
        write_jsonl(run_dir / "metrics.jsonl", rows)

    callbacks: list[Callable[[RoundResult], None]] = [record]
    if progress is not None:
        callbacks.append(progress(run.name, run.training.rounds))
    write_json(run_dir / "summary.json", _summary(run, results, "running", started))
    try:
        simulator.run(run.training.rounds, callbacks)
    except BaseException:
        write_json(run_dir / "summary.json", _summary(run, results, "interrupted", started))
        raise
    torch.save(simulator.params, run_dir / "model.tmp")
    (run_dir / "model.tmp").replace(run_dir / "model.pt")
    title = f"{config.name}: {run.name}"
    plotting.plot_training(rows, run_dir / "accuracy_loss.png", title)
    plotting.plot_epsilon(rows, run_dir / "epsilon.png", title, run.privacy.delta)
    plotting.plot_batch_histograms(rows, run_dir / "batch_histograms.png", title)
    summary = _summary(run, results, "complete", started)
    write_json(run_dir / "summary.json", summary)
    return rows, summary


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = logger.info,
) -> dict[str, Any]:
    """Runs every algorithm of ``config``; writes ``out_dir/<algorithm>/...`` and a comparison.

    Returns the experiment summary (also written to ``out_dir/summary.json``).
    """
    out = Path(out_dir)
    _check_output(out, config.algorithms, overwrite)
    data = build_federated_data(config.data)
    log(
        f"data: {len(data.train)} training records, {data.train.num_silos} silos, "
        f"{data.train.num_subjects} subjects, {len(data.test)} test records"
    )
    runs = []
    for name in config.algorithms:
        run = prepare_run(name, config, data)
        if run.noise_multiplier is not None:
            log(
                f"{name}: noise multiplier {run.noise_multiplier:.4g} "
                f"({run.calibration['method']}), "
                + (f"group size k={run.group_size}, " if run.group_size else "")
                + f"span={run.span}, "
                f"{run.train.dropped_records} record(s) dropped by these bounds"
            )
        runs.append(run)
    write_json(out / "data.json", describe(data.train))
    all_rows: dict[str, list[dict[str, Any]]] = {}
    summaries = []
    for run in runs:
        run_dir = out / run.name
        all_rows[run.name], run_summary = _train(config, data, run, run_dir, progress)
        summaries.append(run_summary)
    plotting.plot_comparison(all_rows, out / "comparison.png", delta=config.privacy.delta)
    summary = {"name": config.name, "runs": summaries}
    write_json(out / "summary.json", summary)
    return summary
