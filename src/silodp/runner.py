"""Runs an experiment config: data, calibration, simulation, and every output file.

Everything that can be wrong with a config (bad values, an unreachable privacy target, missing
data) is found before the first round trains, so a failed start leaves no results behind. Each
round's metrics, including the privacy spent so far, are written atomically as soon as the
round ends, so an interrupted run keeps an exact record of what it spent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
import torch

from silodp import plotting, reports
from silodp.accounting import ADVERSARIES, FederatedAccountant, SiloPrivacy, conversions
from silodp.accounting.fdp import (
    FdpReport,
    PriFedSyncPlan,
    account_prifedsync,
    calibrate_prifedsync,
)
from silodp.accounting.plan import PrivacyPlan, calibrate_noise, find_sigma
from silodp.algorithms import ALGORITHMS, Algorithm, AlgorithmConfig, make_algorithm
from silodp.algorithms.prifedsync import PriFedSync
from silodp.config import (
    ExperimentConfig,
    PrivacyConfig,
    SweepCell,
    SweepConfig,
    TrainingConfig,
    to_toml_dict,
)
from silodp.data import FederatedData, FederatedDataset
from silodp.data.build import build_federated_data
from silodp.data.describe import describe
from silodp.data.partition import cap_records, cap_span
from silodp.federated import RoundResult, Simulator
from silodp.federated.personalised import PersonalisedRoundResult, PersonalisedSimulator
from silodp.io import write_json, write_jsonl, write_text
from silodp.models import build_model
from silodp.privacy.randomness import Coins

__all__ = [
    "OutputExistsError",
    "PreparedPriFedSync",
    "PreparedRun",
    "prepare_prifedsync",
    "prepare_run",
    "run_experiment",
]

logger = logging.getLogger(__name__)

#: ``progress(name, rounds)`` returns a callback that receives each round's released record
#: (the row written to ``metrics.jsonl``) as soon as it is written.
ProgressFactory = Callable[[str, int], Callable[[dict[str, Any]], None]]


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
    notes: list[str] = dataclasses.field(default_factory=list)

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
        if self.name.startswith("uldp_") and self.privacy.subject_rate < 1.0:
            args += ["--subject-sampler", self.privacy.subject_sampler]
            if self.name == "uldp_avg_w" and self.privacy.weighting == "protocol":
                args += ["--weighting", "protocol"]
        args += ["--adversary", self.privacy.adversary]
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


def _algorithm_config(
    training: TrainingConfig, privacy: PrivacyConfig, *, group_size: int, num_silos: int
) -> AlgorithmConfig:
    """The algorithm's hyperparameters from the (per-algorithm) training and privacy tables."""
    return AlgorithmConfig(
        num_silos=num_silos,
        local_steps=training.local_steps,
        batch_size=training.batch_size,
        lr=training.lr,
        server_lr=training.server_lr,
        clip=privacy.clip,
        noise_multiplier=privacy.noise_multiplier or 0.0,
        group_size=group_size,
        sampling=privacy.sampling,
        subject_records=privacy.subject_records,
        local_epochs=training.local_epochs,
        grad_method=training.grad_method,
        subject_rate=privacy.subject_rate,
        subject_sampler=privacy.subject_sampler,
        weighting=privacy.weighting,
        key_bits=privacy.key_bits,
        n_max=privacy.n_max,
        client_rate=training.client_rate,
        optimizer=training.optimizer,
        momentum=training.momentum,
        helper=training.helper,
        alpha=(
            tuple(training.alpha) if isinstance(training.alpha, list | tuple) else training.alpha
        ),
    )


#: silo-local outputs: data-dependent, not covered by any ε; must not leave the silos
PRIVATE_DIR = "silo_private"

#: the stream of the DP feature statistics' randomness
SCALING_STREAM = 4


def dp_scaling(
    config: ExperimentConfig, data: FederatedData
) -> tuple[FederatedData, tuple[SiloPrivacy, ...], dict[str, Any]]:
    """``[data] scaling = "dp"``: per-feature mean/std estimated with DP before training.

    The estimate gets ``scaling_budget`` of ``privacy.epsilon``: its noise multiplier σ_s is
    the smallest for which its subject-level ε alone (one Gaussian per silo, composed over
    ``span`` silos: μ = √span/σ_s) is at most that share at ``privacy.delta``. Every run then
    composes these per-silo events with its rounds (``releases``), so its calibrated and
    reported ε include the estimate. Returns the scaled data, the events and a summary."""
    from silodp.data.scaling import dp_feature_stats

    privacy = config.privacy
    for name in config.algorithms:
        cls = ALGORITHMS[name]
        if name == "prifedsync" or "silo" in cls.units:
            raise ValueError(
                f"Expected [data] scaling = 'bounds' or 'standard' with {name}: the DP feature "
                f"statistics are accounted per record and subject, not for {name}'s "
                f"{'replace-one records' if name == 'prifedsync' else 'silo-level'} guarantee."
            )
    if privacy.epsilon is None:
        raise ValueError(
            "Expected privacy.epsilon with [data] scaling = 'dp': its budget is a share "
            "(data.scaling_budget) of that ε."
        )
    span = min(privacy.span or data.train.num_silos, data.train.num_silos)
    share = config.data.scaling_budget * privacy.epsilon
    sigma = find_sigma(lambda s: conversions.gdp_epsilon(math.sqrt(span) / s, privacy.delta), share)
    coins = Coins.for_mode(privacy.noise, config.training.seed, SCALING_STREAM)
    # on the records training will use: a subject then sits in at most ``span`` silos
    capped = cap_span(data.train, span=span, seed=config.data.seed)
    stats = dp_feature_stats(
        capped, bounds=config.data.feature_bounds, noise_multiplier=sigma, coins=coins
    )
    event = stats.dp_event
    releases = tuple(
        SiloPrivacy({"record": event, "subject": event}) for _ in range(data.train.num_silos)
    )
    summary = {
        "method": "dp",
        "noise_multiplier": sigma,
        "budget_fraction": config.data.scaling_budget,
        "epsilon_alone": conversions.gdp_epsilon(math.sqrt(span) / sigma, privacy.delta),
        "span": span,
        "delta": privacy.delta,
        "mean": stats.mean.tolist(),
        "std": stats.std.tolist(),
    }
    return stats.apply(data), releases, summary


NOT_PRIVATE_NOTE = (
    "noise_multiplier = 0: not private - the algorithm ran without noise and no ε holds; "
    "a non-private baseline"
)

#: the stream of the run's set-up randomness (e.g. the secret the silos share)
SETUP_STREAM = 3


def prepare_run(
    name: str,
    config: ExperimentConfig,
    data: FederatedData,
    *,
    releases: tuple[SiloPrivacy, ...] = (),
) -> PreparedRun:
    """Resolves bounds, the privacy plan and σ for algorithm ``name``; trains nothing.

    ``releases``: per-silo events of releases made before training (DP feature statistics),
    composed with the run's rounds in calibration and reporting."""
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
    algo_config = _algorithm_config(
        training, privacy, group_size=group_size or 1, num_silos=train.num_silos
    )
    probe = make_algorithm(name, algo_config)
    private = probe.calibration_unit is not None
    # σ = 0: the same algorithm (clipping, weighting, sampling) without noise, a non-private
    # baseline that reports no ε
    baseline = private and privacy.noise_multiplier == 0
    one_round = probe.silo_privacy(sampling_rate=1.0) if private else None
    if one_round is not None and one_round.scope == "aggregate":
        if silos_per_round != train.num_silos:
            raise ValueError(
                f"{name} splits its noise over all {train.num_silos} silos; expected "
                f"training.silos_per_round={silos_per_round} to be {train.num_silos}."
            )
    plan: PrivacyPlan | None = None
    sigma: float | None = None
    calibration: dict[str, Any] = {"method": "not private"}
    notes = _delta_notes(name, probe.units, privacy.delta, train) if private else []
    if baseline:
        sigma = 0.0
        calibration = {"method": "not private (noise_multiplier = 0)"}
        notes = [NOT_PRIVATE_NOTE]
    elif probe.calibration_unit is not None:
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
            adversary=privacy.adversary,
            releases=releases,
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
                "adversary": privacy.adversary,
                "seconds": round(time.perf_counter() - started, 2),
            }
        algo_config = dataclasses.replace(algo_config, noise_multiplier=sigma)
    setup_coins = Coins.for_mode(privacy.noise, training.seed, SETUP_STREAM)
    return PreparedRun(
        name=name,
        algorithm=make_algorithm(name, algo_config, train, coins=setup_coins),
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
        notes=notes,
    )


def _delta_notes(
    name: str, units: Sequence[str], delta: float, train: FederatedDataset
) -> list[str]:
    """Warns (and returns a note) when δ is not small against the number of units: an
    (ε, δ) guarantee with δ ≥ 1/n allows releasing one unit's data outright."""
    counts = {
        "record": len(train),
        "subject": int((train.histogram().sum(axis=0) > 0).sum()),
        "silo": train.num_silos,
    }
    notes = []
    for unit in units:
        n = counts[unit]
        if delta * n >= 1.0:
            note = (
                f"delta={delta:g} is not below 1/n = 1/{n} {unit}s: at this δ the guarantee "
                f"allows revealing one {unit}'s data outright; use δ well below 1/{n}"
            )
            logger.warning("%s: %s.", name, note)
            notes.append(note)
    return notes


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


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _summary(
    run: PreparedRun,
    results: list[RoundResult],
    status: str,
    by_adversary: Sequence[dict[str, dict[str, float | None]]] = (),
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
        "adversary": run.privacy.adversary if run.plan else None,
        "epsilon_by_adversary": by_adversary[-1] if by_adversary else {},
        "mu": last.mu if last else {},
        "delta": run.privacy.delta if run.plan else None,
        "units": list(algorithm.units) if run.plan else [],
        "noise_multiplier": run.noise_multiplier,
        "noise": noise_record(run.privacy.noise),
        "clip": run.privacy.clip if run.plan else None,
        "calibration": run.calibration,
        "group_size": run.group_size,
        "group_size_source": run.group_size_source,
        "span": run.span,
        "span_source": run.span_source,
        "sampling_rate": (
            {"min": min(run.plan.sampling_rates), "max": max(run.plan.sampling_rates)}
            if run.plan
            else None
        ),
        "threat_model": algorithm.threat_model,
        "weights_private": getattr(algorithm, "weights_private", None),
        "notes": algorithm.run_notes() + run.notes + noise_notes(run.privacy.noise),
        "outputs": OUTPUTS,
        "account_command": run.account_command(),
    }


#: What each output is, and what the guarantee covers (every summary lists it).
OUTPUTS: dict[str, Any] = {
    "covered_by_epsilon": ["model.pt", "feature_scaling.json (with [data] scaling = 'dp')"],
    "public_plan": [
        "config.toml",
        "summary.json and metrics.jsonl: epsilon, epsilon_by_adversary, mu, sigma, bounds "
        "(functions of the plan: silo sizes, subject counts and the bounds, which silodp "
        "treats as public; a group_size taken from the data is not public)",
        "epsilon.png",
    ],
    "evaluation": (
        "test_accuracy/test_loss (metrics.jsonl, summary.json, accuracy_loss.png, "
        "comparison.png) are computed on the held-out test split, which no ε covers: "
        "release them only if that split is public or its holders agree"
    ),
    "silo_private": [
        f"{PRIVATE_DIR}/: un-noised, data-dependent diagnostics (records dropped by the "
        "bounds, subjects and largest group per batch, wall times, the data description); "
        "no ε covers them and they must not leave the silos"
    ],
}


def noise_record(mode: str) -> dict[str, Any]:
    """Where a run's coins and noise came from, for its summary."""
    if mode == "secure":
        return {
            "mode": "secure",
            "source": "operating system CSPRNG for every sample and noise draw; exact "
            "(discrete, rounded) Gaussian noise",
        }
    return {
        "mode": "seeded",
        "source": "PCG64 seeded from training.seed: reproducible, not for production",
    }


def noise_notes(mode: str) -> list[str]:
    if mode == "seeded":
        return [
            "seeded: not for production - every sample and all noise can be recomputed "
            "from the config's seed, so no ε holds against anyone who knows it"
        ]
    return []


def _write_private(run_dir: Path, run: PreparedRun, wall_time_s: float) -> None:
    write_json(
        run_dir / PRIVATE_DIR / "summary.json",
        {
            "note": "silo-private: data-dependent, not covered by any ε; keep inside the silos",
            "dropped_records": run.train.dropped_records,
            "group_size": run.group_size,
            "group_size_source": run.group_size_source,
            "wall_time_s": round(wall_time_s, 3),
        },
    )


def _check_output(out_dir: Path, names: tuple[str, ...], overwrite: bool) -> None:
    for name in names:
        existing = out_dir / name / "summary.json"
        if existing.exists() and not overwrite:
            raise OutputExistsError(
                f"Results already exist at {str(existing)!r}; choose another --out or pass "
                "--overwrite."
            )


#: per-round diagnostics that depend on the data and are not noised (a round's wall time
#: grows with the sampled records and subjects, so it is one of them)
DIAGNOSTIC_KEYS = ("largest_group_per_batch", "subjects_per_batch", "wall_time_s")

Row = dict[str, Any]


def split_row(result: RoundResult, extra: Row | None = None) -> tuple[Row, Row]:
    """A round's (released, silo-private) records: the private one keeps the un-noised,
    data-dependent diagnostics that no ε covers."""
    public = result.to_json()
    private = {"round": public["round"]}
    for key in DIAGNOSTIC_KEYS:
        if key in public:
            private[key] = public.pop(key)
    public.update(extra or {})
    return public, private


def _run_recorded(
    train: Callable[[list[Callable[[RoundResult], None]]], Any],
    final_params: Callable[[], Any],
    results: list[Any],
    run_dir: Path,
    summary: Callable[[str], dict[str, Any]],
    bar: Callable[[Row], None] | None,
    extra: Callable[[RoundResult], Row] | None = None,
) -> tuple[list[Row], list[Row]]:
    """Runs ``train`` with callbacks that append each round to ``results`` and rewrite
    ``metrics.jsonl`` (released) and ``silo_private/diagnostics.jsonl`` (not covered by ε);
    ``summary.json`` says "running", or "interrupted" if training raises; the final
    parameters go to ``model.pt`` (written whole, then renamed). ``extra`` adds fields to a
    round's released record. Returns the released and the silo-private rows."""
    rows: list[Row] = []
    private_rows: list[Row] = []

    def record(result: RoundResult) -> None:
        results.append(result)
        public, private = split_row(result, extra(result) if extra is not None else None)
        rows.append(public)
        private_rows.append(private)
        write_jsonl(run_dir / "metrics.jsonl", rows)
        if any(len(private) > 1 for private in private_rows):
            write_jsonl(run_dir / PRIVATE_DIR / "diagnostics.jsonl", private_rows)
        if bar is not None:
            bar(public)

    callbacks: list[Callable[[RoundResult], None]] = [record]
    write_json(run_dir / "summary.json", summary("running"))
    try:
        train(callbacks)
    except BaseException:
        write_json(run_dir / "summary.json", summary("interrupted"))
        raise
    torch.save(final_params(), run_dir / "model.tmp")
    (run_dir / "model.tmp").replace(run_dir / "model.pt")
    return rows, private_rows


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
        FederatedAccountant(
            units=run.algorithm.units,
            span=run.span,
            delta=run.privacy.delta,
            target=run.privacy.adversary,
        )
        if run.plan is not None
        else None
    )
    if accountant is not None and run.plan is not None and run.plan.releases:
        accountant.compose_release(run.plan.releases)
    simulator = Simulator(
        algorithm=run.algorithm,
        model=model,
        train=run.train,
        test=data.test,
        accountant=accountant,
        silos_per_round=run.silos_per_round,
        seed=run.training.seed,
        eval_every=run.training.eval_every,
        noise=run.privacy.noise,
    )
    results: list[RoundResult] = []
    by_adversary: list[dict[str, dict[str, float | None]]] = []

    def adversaries(result: RoundResult) -> Row:
        if accountant is None:
            return {}
        by = {
            adversary: {unit: _finite(est.epsilon) for unit, est in estimates.items()}
            for adversary, estimates in accountant.estimates_by_adversary().items()
        }
        by_adversary.append(by)
        return {"adversary": run.privacy.adversary, "epsilon_by_adversary": by}

    rows, private_rows = _run_recorded(
        lambda callbacks: simulator.run(run.training.rounds, callbacks),
        lambda: simulator.params,
        results,
        run_dir,
        lambda status: _summary(run, results, status, by_adversary),
        progress(run.name, run.training.rounds) if progress is not None else None,
        extra=adversaries,
    )
    title = f"{config.name}: {run.name}"
    plotting.plot_training(rows, run_dir / "accuracy_loss.png", title)
    plotting.plot_epsilon(rows, run_dir / "epsilon.png", title, run.privacy.delta)
    if any(r.get("largest_group_per_batch") or r.get("subjects_per_batch") for r in private_rows):
        plotting.plot_batch_histograms(
            private_rows, run_dir / PRIVATE_DIR / "batch_histograms.png", title
        )
    _write_private(run_dir, run, time.perf_counter() - started)
    summary = _summary(run, results, "complete", by_adversary)
    write_json(run_dir / "summary.json", summary)
    return rows, summary


# --- PriFedSync: personalised FL with f-DP accounting --------------------------------------


@dataclass
class PreparedPriFedSync:
    """One PriFedSync run (a sweep cell or a listed algorithm), resolved before training.

    ``reports`` are the accountant's per-round reports for the planned rounds (``None`` when
    σ = 0: a non-private baseline).
    """

    name: str
    algorithm: PriFedSync
    training: TrainingConfig
    privacy: PrivacyConfig
    train: FederatedDataset
    plan: PriFedSyncPlan
    reports: list[FdpReport] | None
    noise_multiplier: float
    calibration: dict[str, Any]
    cell: SweepCell | None = None

    def account_command(self, rounds: int | None = None) -> str | None:
        """A ``silodp account`` call reproducing the μ and ε of ``rounds`` rounds (default:
        the planned rounds). It gives the largest client sampling rate ``B_j/n_j`` for every
        client, which fixes μ_max, the quantity every reported guarantee is computed from."""
        if self.reports is None:
            return None
        plan = self.plan
        return shlex.join(
            [
                "silodp",
                "account",
                "--algorithm",
                "prifedsync",
                "--noise-multiplier",
                repr(plan.noise_multiplier),
                "--sample-rate",
                repr(max(plan.sample_rates)),
                "--steps",
                str(plan.local_steps),
                "--rounds",
                str(rounds if rounds is not None else plan.rounds),
                "--clients",
                str(len(plan.sample_rates)),
                "--client-rate",
                repr(plan.client_rate),
                "--delta",
                repr(plan.delta),
            ]
        )


def prepare_prifedsync(
    config: ExperimentConfig,
    data: FederatedData,
    *,
    cell: SweepCell | None = None,
) -> PreparedPriFedSync:
    """Resolves PriFedSync's plan, σ (given or calibrated) and per-round privacy reports."""
    training, privacy = (
        config.for_cell(cell) if cell is not None else config.for_algorithm("prifedsync")
    )
    name = "prifedsync" if cell is None else f"prifedsync/{cell.label(training, privacy)}"
    if training.silos_per_round is not None:
        raise ValueError(
            f"Expected training.silos_per_round unset for prifedsync (clients are Poisson-"
            f"sampled at training.client_rate), got {training.silos_per_round}."
        )
    algo_config = _algorithm_config(training, privacy, group_size=1, num_silos=data.train.num_silos)
    probe = PriFedSync(algo_config)
    train = data.train
    probe.check_clients(train.num_silos)
    rates = tuple(
        probe.sampling_rate(num_records=int(n), num_subjects=1) for n in train.silo_sizes()
    )
    plan = PriFedSyncPlan(
        noise_multiplier=privacy.noise_multiplier or 1.0,
        sample_rates=rates,
        local_steps=training.local_steps,
        rounds=training.rounds,
        client_rate=training.client_rate,
        delta=privacy.delta,
        batch_sampling=probe.batch_sampling,
    )
    calibration: dict[str, Any]
    if privacy.noise_multiplier is not None:
        sigma = privacy.noise_multiplier
        calibration = {"method": "given noise_multiplier" if sigma > 0 else "not private"}
    else:
        assert privacy.epsilon is not None
        started = time.perf_counter()
        sigma = calibrate_prifedsync(plan, target_epsilon=privacy.epsilon)
        calibration = {
            "method": "calibrated",
            "target_epsilon": privacy.epsilon,
            "unit": "record",
            "seconds": round(time.perf_counter() - started, 2),
        }
    reports: list[FdpReport] | None = None
    if sigma > 0:
        plan = dataclasses.replace(plan, noise_multiplier=sigma)
        reports = account_prifedsync(plan, per_round=True)
        if [r.round for r in reports] != list(range(1, training.rounds + 1)):
            raise RuntimeError(
                f"Expected the accountant to report rounds 1..{training.rounds}, got "
                f"{[r.round for r in reports][:5]}..."
            )
    algo_config = dataclasses.replace(algo_config, noise_multiplier=sigma)
    return PreparedPriFedSync(
        name=name,
        algorithm=PriFedSync(algo_config),
        training=training,
        privacy=privacy,
        train=train,
        plan=plan,
        reports=reports,
        noise_multiplier=sigma,
        calibration=calibration,
        cell=cell,
    )


def _target_round(
    results: Sequence[PersonalisedRoundResult], target: SweepConfig | None
) -> int | None:
    """First round whose mean ``target.target_metric`` accuracy reached the target."""
    if target is None:
        return None
    for r in results:
        value = (
            r.personalised_accuracy if target.target_metric == "personalised" else r.global_accuracy
        )
        if value is not None and value >= target.target_accuracy:
            return r.round
    return None


def _prifedsync_summary(
    run: PreparedPriFedSync,
    results: Sequence[PersonalisedRoundResult],
    status: str,
    target: SweepConfig | None,
) -> dict[str, Any]:
    last = results[-1] if results else None
    evaluated = [r for r in results if r.test_accuracy is not None]
    final = evaluated[-1] if evaluated else None
    private = run.reports is not None
    return {
        "algorithm": run.name,
        "status": status,
        "rounds_completed": len(results),
        "rounds_planned": run.training.rounds,
        "target_accuracy": target.target_accuracy if target else None,
        "target_round": _target_round(results, target),
        "test_accuracy": final.test_accuracy if final else None,
        "test_loss": final.test_loss if final else None,
        "global_accuracy": final.global_accuracy if final else None,
        "personalised_accuracy": final.personalised_accuracy if final else None,
        "epsilon": last.to_json()["epsilon"] if last else {},
        "epsilon_route": last.epsilon_route if last else {},
        "epsilon_estimates": last.to_json()["epsilon_estimates"] if last else {},
        "mu": last.to_json()["mu"] if last else {},
        "delta": run.privacy.delta if private else None,
        "units": list(run.algorithm.units) if private else [],
        "noise_multiplier": run.noise_multiplier,
        "clip": run.privacy.clip,
        "calibration": run.calibration,
        "client_rate": run.training.client_rate,
        "clients": run.train.num_silos,
        "empty_rounds": sum(1 for r in results if not r.silos),
        "batch_sampling": run.algorithm.batch_sampling,
        "sampling_rate": {"min": min(run.plan.sample_rates), "max": max(run.plan.sample_rates)},
        "helper": run.training.helper,
        "optimizer": run.training.optimizer,
        "threat_model": run.algorithm.threat_model,
        "notes": run.algorithm.run_notes()
        + ([] if private else ["noise_multiplier = 0: not private, no privacy reported"])
        + [
            "ε is for replace-one adjacency (a record replaced), unlike the add/remove "
            "adjacency of the other algorithms: it is not directly comparable with their ε"
        ]
        + noise_notes(run.privacy.noise),
        "adjacency": "replace-one",
        "adversary": run.privacy.adversary if private else None,
        "epsilon_by_adversary": (
            {a: last.to_json()["epsilon"] for a in ADVERSARIES} if last and private else {}
        ),
        "noise": noise_record(run.privacy.noise),
        "outputs": OUTPUTS,
        "account_command": run.account_command(),
    }


def _train_prifedsync(
    config: ExperimentConfig,
    data: FederatedData,
    run: PreparedPriFedSync,
    run_dir: Path,
    progress: ProgressFactory | None,
    sweep: SweepConfig | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    resolved = dataclasses.replace(
        config,
        algorithms=("prifedsync",),
        training=run.training,
        privacy=dataclasses.replace(
            run.privacy, noise_multiplier=run.noise_multiplier, epsilon=None
        ),
        overrides={},
        sweep=None,
    )
    write_text(run_dir / "config.toml", tomli_w.dumps(to_toml_dict(resolved)))
    model = build_model(
        config.model.name, data.train.feature_shape, data.train.num_classes, seed=run.training.seed
    )
    simulator = PersonalisedSimulator(
        algorithm=run.algorithm,
        model=model,
        train=run.train,
        test=data.test,
        reports=run.reports,
        seed=run.training.seed,
        eval_every=run.training.eval_every,
        noise=run.privacy.noise,
    )
    results: list[PersonalisedRoundResult] = []

    def reached(result: PersonalisedRoundResult) -> bool:
        if sweep is None or not sweep.stop_at_target:
            return False
        return _target_round([result], sweep) is not None

    def adversaries(result: RoundResult) -> Row:
        if run.reports is None:
            return {}
        # client sampling is accounted as known to everyone (the server draws it): the same ε
        # holds against every adversary
        eps = {unit: _finite(value) for unit, value in result.epsilon.items()}
        return {
            "adversary": run.privacy.adversary,
            "epsilon_by_adversary": {adversary: eps for adversary in ADVERSARIES},
            "adjacency": "replace-one",
        }

    rows, _ = _run_recorded(
        lambda callbacks: simulator.run(run.training.rounds, callbacks, stop=reached),
        lambda: simulator.params,
        results,
        run_dir,
        lambda status: _prifedsync_summary(run, results, status, sweep),
        progress(run.name, run.training.rounds) if progress is not None else None,
        extra=adversaries,
    )
    title = f"{config.name}: {run.name}"
    plotting.plot_training(rows, run_dir / "accuracy_loss.png", title)
    plotting.plot_epsilon(rows, run_dir / "epsilon.png", title, run.privacy.delta)
    plotting.plot_personalised(
        {run.name: rows},
        run_dir / "personalised_vs_global.png",
        title,
        target=sweep.target_accuracy if sweep else None,
    )
    summary = _prifedsync_summary(run, results, "complete", sweep)
    write_json(run_dir / "summary.json", summary)
    return rows, summary


def _run_sweep(
    config: ExperimentConfig,
    data: FederatedData,
    out: Path,
    *,
    overwrite: bool,
    progress: ProgressFactory | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Runs every cell of ``config.sweep``; writes the table (``prifedsync_table.md``/``.csv``)
    and ``personalised_vs_global.png`` into ``out``."""
    sweep = config.sweep
    assert sweep is not None
    runs = [prepare_prifedsync(config, data, cell=cell) for cell in sweep.cells()]
    _check_output(out, tuple(run.name for run in runs), overwrite)
    log(
        f"prifedsync sweep: {len(runs)} runs, target {sweep.target_metric} accuracy "
        f"{sweep.target_accuracy:g}, at most {config.training.rounds} rounds each"
    )
    write_json(out / PRIVATE_DIR / "data.json", describe(data))
    all_rows: dict[str, list[dict[str, Any]]] = {}
    summaries, table = [], []
    key = f"{sweep.target_metric}_accuracy"
    for run in runs:
        rows, run_summary = _train_prifedsync(config, data, run, out / run.name, progress, sweep)
        label = run.name.removeprefix("prifedsync/")
        all_rows[label] = rows
        summaries.append(run_summary)
        hit = reports.rounds_to_target(rows, key=key, target=sweep.target_accuracy)
        at = int(hit["round"]) if hit is not None else int(rows[-1]["round"])
        table.append(
            reports.sweep_row(
                label=label,
                training=dataclasses.asdict(run.training),
                noise_multiplier=run.noise_multiplier,
                metrics=rows,
                target_key=key,
                target=sweep.target_accuracy,
                account_command=run.account_command(at),
            )
        )
        reports.write_table(
            table, out, stem="prifedsync_table", title=_table_title(config, sweep, data)
        )
    plotting.plot_personalised(
        all_rows,
        out / "personalised_vs_global.png",
        f"{config.name}: personalised (solid) vs global (dashed)",
        target=sweep.target_accuracy,
    )
    summary = {"name": config.name, "runs": summaries, "table": table}
    write_json(out / "summary.json", summary)
    return summary


def _table_title(config: ExperimentConfig, sweep: SweepConfig, data: FederatedData) -> str:
    return (
        f"**{config.name}** — {data.name}, {data.train.num_silos} clients: rounds R until the "
        f"mean {sweep.target_metric} test accuracy over clients reaches "
        f"{100 * sweep.target_accuracy:g}%, and the privacy spent by then (μ: Gaussian DP by "
        f"the CLT of Theorem 2; ε at δ={config.privacy.delta:g}: the accountant's rigorous "
        "bound). Accuracies in %."
    )


def _log_protocol_estimate(
    run: PreparedRun, config: ExperimentConfig, data: FederatedData, log: Callable[[str], None]
) -> None:
    """Says, before training, what one round of the private weighting protocol will cost."""
    session = getattr(run.algorithm, "protocol", None)
    if session is None:
        return
    model = build_model(config.model.name, data.train.feature_shape, data.train.num_classes)
    dim = sum(int(p.numel()) for p in model.parameters())
    est = session.estimate_round(dim)
    minutes = est.cpu_seconds / 60
    log(
        f"{run.name}: private weighting protocol, {est.pairs} (silo, subject) pairs x {dim} "
        f"parameters, {est.slots} per ciphertext: about {minutes:.3g} CPU-minutes per round "
        f"of cryptography on this machine ({run.training.rounds} rounds; estimate)"
    )


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
    if config.sweep is None:
        _check_output(out, config.algorithms, overwrite)
    data = build_federated_data(config.data)
    releases: tuple[SiloPrivacy, ...] = ()
    if config.data.scaling == "dp":
        data, releases, scaling = dp_scaling(config, data)
        write_json(out / "feature_scaling.json", scaling)
        log(
            f"feature scaling: DP mean/std per feature, noise multiplier "
            f"{scaling['noise_multiplier']:.4g}, subject-level ε {scaling['epsilon_alone']:.3g} "
            f"alone at δ={config.privacy.delta:g} (composed into every run's ε)"
        )
    log(
        f"data: {len(data.train)} training records, {data.train.num_silos} silos, "
        f"{data.train.num_subjects} subjects, {len(data.test)} test records"
    )
    if config.sweep is not None:
        return _run_sweep(config, data, out, overwrite=overwrite, progress=progress, log=log)
    runs: list[PreparedRun | PreparedPriFedSync] = []
    for name in config.algorithms:
        if name == "prifedsync":
            runs.append(prepare_prifedsync(config, data))
            continue
        run = prepare_run(name, config, data, releases=releases)
        if run.noise_multiplier is not None:
            log(
                f"{name}: noise multiplier {run.noise_multiplier:.4g} "
                f"({run.calibration['method']}), "
                + (f"group size k={run.group_size}, " if run.group_size else "")
                + f"span={run.span}, "
                f"{run.train.dropped_records} record(s) dropped by these bounds"
            )
        _log_protocol_estimate(run, config, data, log)
        runs.append(run)
    write_json(out / PRIVATE_DIR / "data.json", describe(data))
    all_rows: dict[str, list[dict[str, Any]]] = {}
    summaries = []
    for prepared in runs:
        run_dir = out / prepared.name
        if isinstance(prepared, PreparedPriFedSync):
            rows, run_summary = _train_prifedsync(config, data, prepared, run_dir, progress)
        else:
            rows, run_summary = _train(config, data, prepared, run_dir, progress)
        all_rows[prepared.name] = rows
        summaries.append(run_summary)
    plotting.plot_comparison(all_rows, out / "comparison.png", delta=config.privacy.delta)
    summary = {"name": config.name, "runs": summaries}
    write_json(out / "summary.json", summary)
    return summary
