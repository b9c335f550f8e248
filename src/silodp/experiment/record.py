"""Recording a run: the released files (metrics, summary, model, plots) and the silo-private
ones, written as each round ends so that an interrupted run keeps an exact record of what it
spent."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from silodp import faults, stopping
from silodp.config import to_toml_dict
from silodp.errors import OutputExistsError
from silodp.experiment.prepare import PreparedRun
from silodp.federated import Engine, RoundResult
from silodp.io import atomic_write, json_number, write_json, write_jsonl
from silodp.ledger import BudgetExceededError

logger = logging.getLogger(__name__)

__all__ = [
    "OUTPUTS",
    "PRIVATE_DIR",
    "WEIGHTS_FILE",
    "check_output",
    "noise_notes",
    "noise_record",
    "record_rounds",
    "resolved_config",
    "split_row",
    "subject_sampling",
    "subject_weights",
    "summary",
    "write_private",
]

#: silo-local outputs: data-dependent, not covered by any ε; must not leave the silos
PRIVATE_DIR = "silo_private"

#: the subject weights w_{s,a} of a weighted ULDP run, under ``PRIVATE_DIR`` (they follow
#: the silos' histograms): arrays ``weights`` and ``holds`` (n_{s,a} > 0), silos x subjects
WEIGHTS_FILE = "subject_weights.npz"

#: per-round diagnostics that depend on the data and are not noised (a round's wall time
#: grows with the sampled records and subjects, so it is one of them)
DIAGNOSTIC_KEYS = ("largest_group_per_batch", "subjects_per_batch", "wall_time_s")

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
        "comparison.png) are computed on the held-out test split, which no ε covers (with "
        "data.test_per_client each client's test records also follow its training labels' "
        "mix): release them only if that split is public or its holders agree; "
        "summary.json's are of round test_accuracy_round's model (the last evaluated, see "
        "training.eval_every)"
    ),
    "silo_private": [
        f"{PRIVATE_DIR}/: un-noised, data-dependent diagnostics (records dropped by the "
        "bounds, subjects and largest group per batch, wall times, the data description, "
        "the subject weights w_{s,a} of the weighted ULDP methods; checkpoint.pt, the "
        "last round's model, silo states and these diagnostics, kept for --resume); "
        "no ε covers them and they must not leave the silos",
        "ledger.sqlite: the DP events of every round (functions of the plan) with the time each "
        "was recorded; those times follow how long each silo's round took, which is "
        "data-dependent: keep the ledger inside the consortium",
    ],
}

Row = dict[str, Any]


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
        "source": "PCG64 seeded from training.seed, keyed by the run's settings and records: "
        "reproducible, not for production",
    }


def gaps_clause(by_adversary: Mapping[str, Mapping[str, Any]], where: str) -> str:
    """``"; {where} no finite ε against …"`` naming the (adversary, unit) pairs with no finite
    ε (``None``) although the released model has one, or ``""`` when there are none."""
    released = by_adversary.get("released") or {}
    missing = [
        f"the {who} at {unit} level"
        for who, units in by_adversary.items()
        if who != "released"
        for unit, eps in units.items()
        if eps is None and released.get(unit) is not None
    ]
    if not missing:
        return ""
    return (
        f"; {where} no finite ε against {', '.join(missing)} "
        "(epsilon_by_adversary; the notes say why)"
    )


def threat_model(
    statement: str, by_adversary: Mapping[str, Mapping[str, Any]], run: PreparedRun
) -> str:
    """The algorithm's threat ``statement`` with what this run's ε per adversary says beyond
    it: the (adversary, unit) pairs with no finite ε although the released model has one
    (caps, weights in the clear, the protocol's set-up), a group bound taken from the data, and
    a seeded run's condition."""
    released = by_adversary.get("released") or {}
    out = statement + gaps_clause(by_adversary, "in this run")
    if run.group_size_source.startswith("data") and released.get("subject") is not None:
        out += (
            f"; the subject-level ε assumes at most k = {run.group_size} records per subject, "
            "a bound taken from this data (the notes say why that is no guarantee)"
        )
    if run.privacy.noise == "seeded":
        out += (
            "; seeded coins: every ε assumes the seed stays secret, and whoever knows it (it is "
            "in config.toml; on the Flower engines the server sends it to the silos) has none"
        )
    return out


def noise_notes(mode: str) -> list[str]:
    if mode == "seeded":
        return [
            "seeded: not for production - every sample and all noise can be recomputed "
            "from the config's seed, so no ε holds against anyone who knows it"
        ]
    return []


def resolved_config(run: PreparedRun) -> dict[str, Any]:
    """The run's config as a TOML mapping, with everything the run resolved written in."""
    algorithm = run.algorithm
    privacy = dataclasses.replace(
        run.privacy,
        # a non-private algorithm resolves no σ: the config's stays
        noise_multiplier=(
            run.noise_multiplier
            if run.noise_multiplier is not None
            else run.privacy.noise_multiplier
        ),
        epsilon=None if run.cell is not None else run.privacy.epsilon,
        group_size=run.group_size,
        span=run.span,
        # the units this run accounts: a budget elsewhere binds the experiment's other runs
        budget=run.accounted_budget() or None,
    )
    resolved = dataclasses.replace(
        run.config,
        algorithms=(algorithm.name,),
        training=run.training,
        privacy=privacy,
        hyperparameters=algorithm.config.settings(),
        overrides={},
        sweep=None,
    )
    return to_toml_dict(resolved)


def _last_with(results: Sequence[RoundResult], key: str) -> tuple[int, Any] | None:
    """The last round whose ``key`` has a value, and that value (``None``: no round's has)."""
    for r in reversed(results):
        value = getattr(r, key) if hasattr(r, key) else r.metrics.get(key)
        if value is not None:
            return r.round, value
    return None


def _last(results: Sequence[RoundResult], key: str) -> Any:
    found = _last_with(results, key)
    return None if found is None else found[1]


def summary(
    run: PreparedRun,
    results: Sequence[RoundResult],
    status: str,
    by_adversary: Sequence[dict[str, dict[str, float | None]]] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's ``summary.json``: outcome, privacy spent (per unit and adversary), bounds,
    calibration, threat model, notes and what each output is."""
    last = results[-1] if results else None
    algorithm = run.algorithm
    private = run.plan is not None
    out: dict[str, Any] = {
        "algorithm": run.name,
        "status": status,
        "rounds_completed": len(results),
        "rounds_planned": run.training.rounds,
        "test_accuracy": _last(results, "test_accuracy"),
        "test_loss": json_number(_last(results, "test_loss")),
        "epsilon": last.to_json()["epsilon"] if last else {},
        "epsilon_route": last.epsilon_route if last else {},
        "adversary": run.privacy.adversary if private else None,
        "epsilon_by_adversary": by_adversary[-1] if by_adversary else {},
        "mu": last.to_json()["mu"] if last else {},
        **({"mu_estimates": last.to_json()["mu_estimates"]} if last and last.mu_estimates else {}),
        "delta": run.privacy.delta if private else None,
        "units": list(algorithm.units) if private else [],
        "noise_multiplier": run.noise_multiplier,
        "noise": noise_record(run.privacy.noise),
        "clip": algorithm.config.clip if private else None,
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
        "threat_model": (
            threat_model(algorithm.threat_model, by_adversary[-1] if by_adversary else {}, run)
            if private or not algorithm.private
            else "none: noise_multiplier = 0, no differential privacy"
        ),
        "weights_private": getattr(algorithm, "weights_private", None),
        "empty_rounds": sum(1 for r in results if not r.silos),
        "notes": algorithm.run_notes() + run.notes + noise_notes(run.privacy.noise),
        "outputs": OUTPUTS,
        "account_command": run.account_command(),
    }
    for key in {k for r in results for k in r.metrics}:
        out[key] = _last(results, key)
    if last is not None and last.estimates is not None:
        out["epsilon_estimates"] = last.to_json()["epsilon_estimates"]
    found = _last_with(results, "test_accuracy")
    evaluated = None if found is None else found[0]
    out["test_accuracy_round"] = evaluated
    if status != "running" and last is not None and evaluated not in (None, last.round):
        out["notes"] = [
            *out["notes"],
            f"test_accuracy (and the other evaluated metrics) is of round {evaluated}'s "
            f"model: round {last.round}'s, the last trained (model.pt once the run ends), was "
            f"not evaluated (training.eval_every = {run.training.eval_every}; the run ended "
            "before its last planned round)",
        ]
    out.update(algorithm.summary_fields())
    out.update(extra or {})
    return out


def subject_weights(run: PreparedRun) -> tuple[np.ndarray, str] | None:
    """The weights ``w_{s,a}`` (silos x subjects) that the run's algorithm applies and how they
    were obtained, or ``None`` for an algorithm that weights no subject.

    Weights held by the algorithm are returned as they are; weights that the private
    weighting protocol computes under encryption (``uldp_avg_w``) are recomputed here from
    the silos' histograms with the algorithm's own ``make_weights`` (``n_{s,a}/n_a``, which
    the protocol computes to its fixed-point precision)."""
    held = getattr(run.algorithm, "weights", None)
    if held is not None:
        return np.asarray(held, dtype=np.float64), "the weights the algorithm applied"
    make = getattr(run.algorithm, "make_weights", None)
    if make is None:
        return None
    return (
        np.asarray(make(run.train), dtype=np.float64),
        "recomputed from the silos' histograms as the private weighting protocol computes "
        "them under encryption",
    )


def subject_sampling(run: PreparedRun, num_subjects: int) -> dict[str, Any] | None:
    """The run's subject sub-sampling (rate q, who draws it, who learns it) and what the
    per-round ``subjects_per_batch`` counts of the silo-private diagnostics are; ``None`` for
    an algorithm that samples no subjects."""
    config = run.algorithm.config
    rate = getattr(config, "subject_rate", None)
    known_to = getattr(run.algorithm, "sample_known_to", None)
    if rate is None or known_to is None:
        return None
    drawn_by = getattr(config, "subject_sampler", "server")
    knows = list(known_to())
    if rate >= 1.0:
        counts = "every subject: no sub-sampling, each silo trains all its subjects"
    elif "silos" not in knows:
        counts = (
            "not the sample: it is hidden from the silos, and each silo trains all its subjects"
        )
    elif drawn_by == "silos":
        counts = "hidden: the silos draw the sample and do not report how many they trained"
    else:
        counts = "sampled: subjects each silo trained in the server's sample"
    return {
        "rate": rate,
        "drawn_by": drawn_by,
        "known_to": knows,
        "subjects": num_subjects,
        "expected_per_round": rate * num_subjects,
        "counts": counts,
    }


def _write_weights(run_dir: Path, run: PreparedRun) -> dict[str, Any] | None:
    found = subject_weights(run)
    if found is None:
        return None
    weights, how = found
    holds = run.train.histogram() > 0
    if weights.shape != holds.shape:
        raise ValueError(
            f"Expected subject weights of shape {holds.shape} (silos, subjects), got "
            f"{weights.shape}."
        )

    def save(tmp: Path) -> None:
        with tmp.open("wb") as handle:
            np.savez_compressed(handle, weights=weights, holds=holds)

    atomic_write(run_dir / PRIVATE_DIR / WEIGHTS_FILE, save)
    used = np.where(holds, weights, 0.0)
    per_subject = used.sum(axis=0)[holds.any(axis=0)]
    return {
        "file": WEIGHTS_FILE,
        "how": how,
        "pairs_weighted": int(((used > 0) & holds).sum()),
        "sum_per_subject": (
            {"min": float(per_subject.min()), "max": float(per_subject.max())}
            if per_subject.size
            else None
        ),
    }


def write_private(run_dir: Path, run: PreparedRun, wall_time_s: float) -> None:
    """The run's silo-private summary and, for a weighted ULDP run, its subject weights."""
    write_json(
        run_dir / PRIVATE_DIR / "summary.json",
        {
            "note": "silo-private: data-dependent, not covered by any ε; keep inside the silos",
            "dropped_records": run.train.dropped_records,
            "group_size": run.group_size,
            "group_size_source": run.group_size_source,
            "wall_time_s": round(wall_time_s, 3),
            "subject_weights": _write_weights(run_dir, run),
            "subject_sampling": subject_sampling(run, run.train.num_subjects),
        },
    )


def check_output(out_dir: Path, names: Sequence[str], overwrite: bool) -> None:
    """Raises:
    OutputExistsError: a run's results already exist and ``overwrite`` is false."""
    for name in names:
        existing = out_dir / name / "summary.json"
        if existing.exists() and not overwrite:
            try:
                status = json.loads(existing.read_text(encoding="utf-8")).get("status")
            except (OSError, ValueError, AttributeError):
                status = None
            resume = (
                f" It stopped before its end (status {status!r}): continue it with "
                f"`silodp run --resume {out_dir}`."
                if isinstance(status, str) and status not in ("complete", "budget_exhausted")
                else ""
            )
            raise OutputExistsError(
                f"Results already exist at {str(existing)!r}; choose another --out or pass "
                f"--overwrite.{resume}"
            )


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


def read_rows(run_dir: Path, up_to: int) -> tuple[list[Row], list[Row]]:
    """The released and silo-private rows a run wrote for rounds ``1..up_to`` (a resumed run
    keeps them and drops any of a round it runs again)."""

    def rows(path: Path) -> list[Row]:
        if not path.is_file():
            return []
        found = [
            json.loads(line)
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        return [r for r in found if r["round"] <= up_to]

    return rows(run_dir / "metrics.jsonl"), rows(run_dir / PRIVATE_DIR / "diagnostics.jsonl")


def _write_rows(run_dir: Path, rows: list[Row], private_rows: list[Row]) -> None:
    """Rewrites ``metrics.jsonl`` and, if any round has silo-private diagnostics,
    ``silo_private/diagnostics.jsonl``."""
    write_jsonl(run_dir / "metrics.jsonl", rows)
    if any(len(private) > 1 for private in private_rows):
        write_jsonl(run_dir / PRIVATE_DIR / "diagnostics.jsonl", private_rows)


def record_rounds(
    engine: Engine,
    rounds: int,
    run_dir: Path,
    summary_of: Callable[[str, list[RoundResult]], dict[str, Any]],
    *,
    bar: Callable[[Row], None] | None = None,
    extra: Callable[[RoundResult], Row] | None = None,
    stop: Callable[[RoundResult], bool] | None = None,
    checkpoint: Callable[[int, list[Row], list[Row]], None] | None = None,
    start: int = 1,
    previous: tuple[list[Row], list[Row]] = ([], []),
    defer_stops: bool = False,
) -> tuple[list[RoundResult], list[Row], list[Row], str]:
    """Runs ``engine`` from round ``start`` with a callback that rewrites ``metrics.jsonl``
    (released) and ``silo_private/diagnostics.jsonl`` (not covered by ε) after every round,
    first calling ``checkpoint(round, rows, private_rows)`` (so a round is either in the
    checkpoint or run again, never half-recorded); ``summary.json`` says "running" (rewritten
    with every round, so that a process killed outright leaves the rounds it completed), or
    "interrupted" if training raises; the final parameters go to ``model.pt`` (written whole,
    then renamed). ``extra`` adds fields to a round's released record. A round the privacy
    budget does not allow ends the run cleanly with what it has (status ``budget_exhausted``).
    Rounds before ``start`` are ``previous`` (their released and silo-private rows, from the
    checkpoint), written to both files before anything trains: a run killed after its last
    checkpoint and before that round's rows has no round left to run on resume.
    ``defer_stops``: a first Ctrl-C or SIGTERM while the rounds run stops the run
    once the round in progress is recorded (:mod:`silodp.stopping`).
    Returns the results, the released and the silo-private rows and the status."""
    rows, private_rows = list(previous[0]), list(previous[1])
    private_by_round = {r["round"]: r for r in private_rows}
    results = [RoundResult.from_json(r, private_by_round.get(r["round"])) for r in rows]

    def record(result: RoundResult) -> None:
        public, private = split_row(result, extra(result) if extra is not None else None)
        if checkpoint is not None:
            checkpoint(result.round, [*rows, public], [*private_rows, private])
            faults.reached("checkpoint_written", result.round)
        # counted only once checkpointed: a stop while the checkpoint is written leaves the
        # round out of the summary, as out of the checkpoint (it runs again on resume)
        results.append(result)
        rows.append(public)
        private_rows.append(private)
        _write_rows(run_dir, rows, private_rows)
        # the rounds so far: a process killed outright leaves a summary of what it spent
        write_json(run_dir / "summary.json", summary_of("running", results))
        faults.reached("round_written", result.round)
        if bar is not None:
            bar(public)
        stopping.check()  # a stop that waited for this round

    if rows:  # resumed: the rows the checkpoint holds (a run killed after its last round's
        # checkpoint and before that round's row would otherwise never write it)
        _write_rows(run_dir, rows, private_rows)
    write_json(run_dir / "summary.json", summary_of("running", results))
    status = "complete"
    try:
        deferring: AbstractContextManager[None] = (
            stopping.rounds_running() if defer_stops else nullcontext()
        )
        with deferring:
            try:
                if start <= rounds:
                    engine.run(rounds, [record], stop=stop, start=start)
            except BudgetExceededError as err:
                status = "budget_exhausted"
                logger.warning("%s", err)
        atomic_write(run_dir / "model.pt", lambda tmp: torch.save(engine.params, tmp))
    except BaseException:
        # a stop between appending a round's result and writing its row: the summary and
        # metrics.jsonl say the same rounds (a resume continues from the checkpoint)
        kept = min(len(results), len(rows), len(private_rows))
        del results[kept:], rows[kept:], private_rows[kept:]
        with stopping.shielded():  # a second stop now would leave the summary "running"
            write_jsonl(run_dir / "metrics.jsonl", rows)
            write_json(run_dir / "summary.json", summary_of("interrupted", results))
        raise
    return results, rows, private_rows, status
