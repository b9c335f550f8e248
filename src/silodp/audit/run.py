"""Running an audit: train the configured algorithm with canaries, attack, bound ε from below.

The algorithm, its calibration, clipping, noise, sampling, accounting and ledger are the
experiment's own (:func:`~silodp.experiment.prepare.prepare_run`,
:func:`~silodp.experiment.train_run`); the audit changes only the model (``linear``, so a canary
owns a weight column; :mod:`silodp.audit.canaries`) and adds canaries to the training data.

* ``one-run`` (default): ``canaries`` canaries each included with probability ½ in one training
  run; ε's lower bound from the guesses on them (:func:`~silodp.audit.bounds.best_one_run_epsilon`).
* ``many-runs``: ``runs`` trainings, each with one canary included with probability ½; the
  Clopper–Pearson bound at a threshold chosen on the first half of the runs
  (:func:`~silodp.audit.bounds.split_threshold_epsilon`). The noise multiplier is the first
  run's (calibrated once, with its canary included) for every run.

The claimed ε is the audited run's own, against the released model (what the attack sees),
read from its summary after its ledger has been verified against it.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from silodp._validation import check_choice, check_int, check_probability
from silodp.audit.attack import canary_scores, roc_curve
from silodp.audit.bounds import best_one_run_epsilon, split_threshold_epsilon
from silodp.audit.canaries import CANARY_UNITS, add_canaries, draw_canaries
from silodp.config import RUN_KEYS, ExperimentConfig, ModelConfig
from silodp.data import FederatedData
from silodp.errors import InvalidValueError
from silodp.experiment.ledger import LEDGER_FILE
from silodp.experiment.prepare import prepare_run
from silodp.experiment.run import ProgressFactory, engine_arguments, train_run
from silodp.federated.simulator import Simulator
from silodp.io import json_number, write_json
from silodp.ledger import Ledger
from silodp.ledger.report import same_epsilon, verify_ledger
from silodp.models import build_model

__all__ = ["ATTACK", "DESIGNS", "audit_algorithm", "default_unit"]

DESIGNS = ("one-run", "many-runs")
#: an audited run's result and its plot, in ``out/<algorithm>/``
AUDIT_FILE, ROC_FILE = "audit.json", "audit_roc.png"

ATTACK = (
    "white-box dedicated-feature canaries: each canary owns an input feature no other record "
    "has, so its clipped gradient moves one weight column of a linear model; the attacker "
    "scores the released model's change in that column towards the canary's label"
)

#: the value of a canary record's own feature: its gradient is then about 10x the clipping
#: bound, so clipping leaves it exactly at the bound, almost all of it in the canary's column
AMPLITUDE_PER_CLIP = 10.0


def default_unit(algorithm: Any) -> str:
    """``subject`` (the unit silodp is about) unless the algorithm reports units without it
    (e.g. record-level only): then its calibration unit."""
    units = tuple(algorithm.units)
    if not units or "subject" in units:
        return "subject"
    if algorithm.calibration_unit in CANARY_UNITS:
        return str(algorithm.calibration_unit)
    return "record"


def _audit_config(
    config: ExperimentConfig, name: str, *, seed: int | None = None, **privacy: Any
) -> ExperimentConfig:
    """``config`` reduced to algorithm ``name`` with its own schedule and privacy settings
    resolved, the linear model, no shared ledger or budget, and ``privacy``/``seed`` set."""
    if name not in config.algorithms:
        raise InvalidValueError(
            f"Expected --algorithm to be one of the config's algorithms "
            f"({', '.join(config.algorithms)}), got {name!r}."
        )
    if config.data.scaling == "dp":
        raise InvalidValueError(
            "Expected [data] scaling other than 'dp' to audit: the audit measures training "
            "alone, and DP feature statistics would be a release the canaries' features miss."
        )
    training, priv = config.for_algorithm(name)
    if seed is not None:
        training = dataclasses.replace(training, seed=seed)
    priv = dataclasses.replace(priv, ledger=None, budget=None, **privacy)
    own = {
        k: v
        for k, v in config.overrides.get(name, {}).items()
        if k not in RUN_KEYS["training"] | RUN_KEYS["privacy"]
    }
    return dataclasses.replace(
        config,
        algorithms=(name,),
        model=ModelConfig(name="linear"),
        training=training,
        privacy=priv,
        overrides={name: own} if own else {},
        sweep=None,
    )


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = torch.load(run_dir / "model.pt", weights_only=True)
    return params


#: the most memory the audited data (records widened by a feature per canary) may take
MAX_AUDIT_BYTES = 8 * 2**30


def _check_fits(data: FederatedData, train: Any, canaries: int, unit: str) -> None:
    """Refuses, before anything is drawn, a number of canaries whose audited data would not
    fit in memory: every record (the canaries' own too) gets one more feature per canary."""
    per_canary = 1.0
    if unit != "record":
        counts = train.histogram().sum(axis=0)
        per_canary = float(counts[counts > 0].mean()) if (counts > 0).any() else 1.0
    records = len(data.train) + len(data.test) + canaries * per_canary
    features = int(np.prod(data.train.feature_shape)) + canaries
    size = records * features * data.train.x.dtype.itemsize
    if size > MAX_AUDIT_BYTES:
        raise InvalidValueError(
            f"Expected --canaries small enough for the audited data to fit in memory: "
            f"{canaries} canaries add about {canaries * per_canary:,.0f} records and widen "
            f"every record by {canaries} features, about {size / 2**30:,.1f} GB (at most "
            f"{MAX_AUDIT_BYTES / 2**30:.0f} GB). Use fewer canaries."
        )


def _claimed(summary: dict[str, Any], unit: str, run_dir: Path) -> dict[str, Any]:
    """The audited run's claim at ``unit``: its ε against each adversary recomputed from the
    events of its verified ledger, which must agree with its summary."""
    ledger = run_dir / LEDGER_FILE
    private = summary.get("noise_multiplier") not in (None, 0, 0.0)
    if private and not ledger.is_file():
        raise InvalidValueError(
            f"Expected the audited run's ledger at {str(ledger)!r}: a claimed ε is read only "
            "after its ledger has been verified."
        )
    problems = verify_ledger(ledger) if ledger.is_file() else []
    if problems:
        raise InvalidValueError(
            f"Expected the audited run's ledger to agree with its results: {problems[0]}"
        )
    written = summary.get("epsilon_by_adversary") or {}
    by: dict[str, float | None] = {who: v.get(unit) for who, v in written.items()}
    if private:
        with Ledger(ledger, read_only=True) as held:
            replayed = held.replay([held.runs()[-1].id]).estimates_by_adversary()
        recomputed = {who: json_number(v[unit].epsilon) for who, v in replayed.items() if unit in v}
        for who, value in recomputed.items():
            said = by.get(who)
            if not same_epsilon(said, value):
                raise InvalidValueError(
                    f"Expected the audited run's summary to give the ε its ledger's events give "
                    f"at unit {unit!r} against {who!r}: the summary says {said!r}, the ledger "
                    f"{value!r}."
                )
        by = recomputed
    headline = (summary.get("epsilon") or {}).get(unit)
    epsilon = by.get("released") if by else headline
    return {
        "epsilon": epsilon,
        "epsilon_headline": headline,
        "epsilon_by_adversary": by,
        "private": private,
        # the summaries write an infinite ε as null: say which null it is
        "status": "not private" if not private else ("infinite" if epsilon is None else "finite"),
    }


def audit_algorithm(
    config: ExperimentConfig,
    data: FederatedData,
    name: str,
    out: Path,
    *,
    unit: str | None = None,
    design: str = "one-run",
    canaries: int = 1000,
    runs: int = 200,
    significance: float = 0.05,
    seed: int | None = None,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Audits algorithm ``name`` of ``config`` on ``data``; writes ``out/<name>/`` (the audited
    run, its ledger, ``audit.json`` and ``audit_roc.png``) and returns the report.

    ``seed``: the auditor's coins (canary inclusion, labels, shapes); ``None`` draws them from
    the operating system. Training's own coins follow the config's ``[privacy] noise``.

    Raises:
      InvalidValueError: a unit the data cannot express, a bad design or count.
    """
    from silodp.audit.plot import plot_audit

    started = time.perf_counter()
    check_choice("design", design, DESIGNS)
    check_probability("significance", significance)
    cfg = _audit_config(config, name)
    probe = prepare_run(name, cfg, data)
    unit = unit or default_unit(probe.algorithm)
    check_choice("unit", unit, CANARY_UNITS)
    reported = tuple(probe.algorithm.units)
    if probe.algorithm.private and unit not in reported:
        raise InvalidValueError(
            f"Expected --unit to be a unit {name!r} reports ε for ({', '.join(reported)}); got "
            f"{unit!r}: it claims nothing at that unit, so no bound could contradict it."
        )
    rng = np.random.default_rng(seed if seed is not None else secrets.randbits(128))
    amplitude = AMPLITUDE_PER_CLIP * max(1.0, float(probe.algorithm.config.clip))
    run_dir = out / name
    for old in (AUDIT_FILE, ROC_FILE):  # an earlier audit's result never sits beside this run
        (run_dir / old).unlink(missing_ok=True)
    if design == "one-run":
        check_int("canaries", canaries, 2)
        _check_fits(data, probe.train, canaries, unit)
        # shaped after the data as training sees it (capped to the run's public bounds)
        drawn = draw_canaries(probe.train, canaries, unit, rng, amplitude=amplitude)
        audited = add_canaries(data, drawn)
        run = prepare_run(name, cfg, audited)
        log(
            f"{name}: {len(drawn)} {unit} canaries ({int(drawn.included.sum())} included, "
            f"{int(drawn.records_per_canary.mean() + 0.5)} records each on average), "
            f"σ={_fmt(run.noise_multiplier)}"
        )
        _, summary = train_run(run, audited, run_dir, progress)
        scores = canary_scores(_initial_params(run, audited), _final_params(run_dir), drawn)
        included = drawn.included
        claimed = _claimed(summary, unit, run_dir)
        delta = run.privacy.delta
        best = best_one_run_epsilon(scores, included, delta=delta, significance=significance)
        ceiling = best_one_run_epsilon(
            included * 1.0, included, delta=delta, significance=significance
        ).epsilon
        bound: dict[str, Any] = {
            "epsilon": best.epsilon,
            "guesses": best.guesses,
            "positive_guesses": best.positive,
            "negative_guesses": best.negative,
            "correct": best.correct,
        }
        counts = {"canaries": len(drawn), "included": int(included.sum()), "runs": 1}
        sigma = run.noise_multiplier
    else:
        check_int("runs", runs, 4)
        log(
            f"{name}: {runs} trainings on the config's data; the first is recorded in "
            f"{run_dir / LEDGER_FILE}, the other {runs - 1} in no ledger"
        )
        scores_list, bits = [], []
        sigma = None
        delta = cfg.privacy.delta
        bits_all = rng.random(runs) < 0.5
        bits_all[0] = True  # the run whose ledger gives the claimed ε holds its canary
        for j in range(runs):
            one = draw_canaries(probe.train, 1, unit, rng, amplitude=amplitude)
            one = dataclasses.replace(one, included=np.array([bits_all[j]]))
            audited = add_canaries(data, one)
            if j == 0:
                run = prepare_run(name, cfg, audited)
                sigma = run.noise_multiplier
                _, summary = train_run(run, audited, run_dir, None)
                final = _final_params(run_dir)
                claimed = _claimed(summary, unit, run_dir)
                fixed = (  # σ as calibrated for the first run; a non-private one as it is
                    cfg
                    if sigma is None
                    else _audit_config(config, name, noise_multiplier=sigma, epsilon=None)
                )
            else:  # independent coins in every run, seeded noise included
                seeded = _audit_config(fixed, name, seed=fixed.training.seed + j)
                run = prepare_run(name, seeded, audited)
                final = _train_quietly(run, audited)
            scores_list.append(float(canary_scores(_initial_params(run, audited), final, one)[0]))
            bits.append(bool(bits_all[j]))
            if (j + 1) % max(1, runs // 10) == 0 or j + 1 == runs:
                log(f"{name}: run {j + 1}/{runs}")
        scores, included = np.array(scores_list), np.array(bits)
        eps, threshold = split_threshold_epsilon(
            scores, included, delta=delta, significance=significance
        )
        bound = {"epsilon": eps, "threshold": threshold}
        ceiling = split_threshold_epsilon(
            included * 1.0, included, delta=delta, significance=significance
        )[0]
        counts = {"canaries": runs, "included": int(included.sum()), "runs": runs}
    fpr, tpr = roc_curve(scores, included)
    report = {
        "algorithm": name,
        "unit": unit,
        "design": design,
        "attack": ATTACK,
        "view": "released model",
        **counts,
        "delta": delta,
        "noise_multiplier": sigma,
        # seeded training coins: the claim guards nobody who knows the config (the auditor
        # does), so a bound under it says only that the statistics found no contradiction
        "noise": cfg.for_algorithm(name)[1].noise,
        "claimed_epsilon": claimed["epsilon"],
        "claim": claimed["status"],
        "adjacency": probe.algorithm.adjacency_of(unit) if unit in reported else None,
        "claimed_epsilon_by_adversary": claimed["epsilon_by_adversary"],
        "lower_bound": bound["epsilon"],
        # the largest bound this audit could show (every guess right): at or below the
        # claim, the audit could not have contradicted it
        "max_lower_bound": ceiling,
        "confidence": 1 - significance,
        "bound": bound,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "run_dir": str(run_dir),
        "seeded_auditor": seed is not None,
        "auditor_seed": seed,
    }
    write_json(
        run_dir / AUDIT_FILE,
        {**report, "scores": scores.tolist(), "inclusion": included.tolist()},
    )
    plot_audit(fpr, tpr, report, run_dir / ROC_FILE)
    return report


def _linear(run: Any, data: FederatedData) -> torch.nn.Module:
    """The audited model, as training builds it from the run's seed."""
    train = data.train
    return build_model("linear", train.feature_shape, train.num_classes, seed=run.training.seed)


def _initial_params(run: Any, data: FederatedData) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in _linear(run, data).named_parameters()}


def _train_quietly(run: Any, data: FederatedData) -> dict[str, torch.Tensor]:
    """One training with the run's algorithm in-process, nothing recorded (the many-runs
    design's runs after the first)."""
    engine = Simulator(
        **engine_arguments(run, data, _linear(run, data), eval_every=run.training.rounds)
    )
    engine.run(run.training.rounds)
    return engine.params


def _fmt(value: float | None) -> str:
    return "-" if value is None else ("inf" if not math.isfinite(value) else f"{value:.4g}")
