"""Running an experiment config: data, preparation, one engine per run, every output file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tomli_w
import torch

from silodp import display, faults, locking, plotting, tracking
from silodp.accounting import SiloPrivacy
from silodp.accounting.interface import Accountant, spent
from silodp.config import ExperimentConfig, SweepConfig, load_config, to_toml_dict
from silodp.data import FederatedData
from silodp.data.build import build_federated_data
from silodp.data.describe import describe
from silodp.errors import InvalidValueError, OutputExistsError
from silodp.experiment.checkpoint import load_checkpoint, save_checkpoint
from silodp.experiment.digest import check_data_unchanged, check_run_data, record_data
from silodp.experiment.ledger import (
    LEDGER_FILE,
    accountant_of,
    check_plans_fit,
    check_shared_ledger,
    describe_shared_ledger,
    open_no_noise_ledger,
    open_run_ledger,
    resume_run_ledger,
    set_aside_ledger,
    set_aside_replaced_ledger,
)
from silodp.experiment.prepare import PreparedRun, dp_scaling, prepare_run
from silodp.experiment.record import (
    PRIVATE_DIR,
    check_output,
    read_rows,
    record_rounds,
    resolved_config,
    summary,
    write_private,
)
from silodp.federated import RoundResult, Simulator
from silodp.federated.engine import Engine, spent_fields
from silodp.io import check_writable_dir, write_json, write_text
from silodp.ledger.run import BudgetExceededError, RunLedger
from silodp.ledger.store import SQLITE_HEADER
from silodp.models import build_model

__all__ = [
    "ProgressFactory",
    "engine_arguments",
    "holding_results",
    "kept_runs",
    "replace_previous",
    "resume_experiment",
    "run_experiment",
    "train_run",
]

logger = logging.getLogger(__name__)

#: ``progress(name, rounds)`` returns a callback that receives each round's released record
#: (the row written to ``metrics.jsonl``) as soon as it is written.
ProgressFactory = Callable[[str, int], Callable[[dict[str, Any]], None]]


def _charged_epsilon(accountant: Accountant, rounds: int) -> dict[str, Any]:
    """The summary's privacy fields once every planned round is charged."""
    return {**spent_fields(spent(accountant)), "rounds_charged": rounds}


def _charged_note(out: dict[str, Any], rounds: int) -> str:
    at_stop = ", ".join(f"{u} {display.upper(v, 4)}" for u, v in out["epsilon_at_stop"].items())
    charged = out["rounds_charged"]
    what = (
        f"ε is that of all {rounds} planned rounds, which the ledger is charged"
        if charged >= rounds
        else f"the ledger was charged through round {charged} of {rounds} when the budget "
        "ran out, and ε is that"
    )
    return (
        f"stopped at round {out['stopped_at_round']} when the accuracy target was reached; "
        f"that round depends on the data, so {what} (ε after the rounds run: {at_stop}, "
        "epsilon_at_stop, not a guarantee)"
    )


def _charged_beyond(
    ledger: RunLedger, results: Sequence[RoundResult], out: dict[str, Any]
) -> dict[str, Any]:
    """An interrupted run's summary fields for the rounds the ledger was charged that did not
    complete (a remote round's silos are charged before its messages leave, and those that
    answered released their noisy updates): ``epsilon`` and ``epsilon_by_adversary`` become
    the ledger's charge for this run, the completed rounds' values are kept beside them, and
    a note names the rounds. Empty when every charged round completed."""
    try:
        completed = {r.round for r in results}
        open_rounds = sorted(ledger.recorded_rounds() - completed)
        if not open_rounds:
            return {}
        charged = spent_fields(spent(ledger.charged()))
    except Exception as err:  # the ledger is what failed: the summary says so
        return {
            "notes": [
                *out["notes"],
                f"the ledger could not be read back ({err}); rounds it was charged that did "
                "not complete may be missing from epsilon: silodp ledger show gives its total",
            ]
        }
    shown = ", ".join(
        f"{u} {display.upper(v, 4)}" for u, v in charged["epsilon"].items() if v is not None
    )
    return {
        "epsilon_of_completed_rounds": out["epsilon"],
        "epsilon_by_adversary_of_completed_rounds": out["epsilon_by_adversary"],
        **{k: charged[k] for k in ("epsilon", "epsilon_by_adversary")},
        "rounds_charged_not_completed": open_rounds,
        "notes": [
            *out["notes"],
            f"round(s) {', '.join(map(str, open_rounds))} were charged to the ledger and did "
            f"not complete (what a silo sent before the stop may have been released), so ε is "
            f"the ledger's charge for this run ({shown}); epsilon_of_completed_rounds is that "
            "of the rounds completed",
        ],
    }


def stops_early(config: ExperimentConfig, sweep: SweepConfig | None) -> bool:
    """Whether a run stops at the round its accuracy target is reached.

    Not with ``data.test_per_client``: each client's test records are drawn with the label mix
    of its training records, so the round the target is reached depends on the training
    labels outside the noise (one record can decide whether a label is tested at all), and
    choosing the released model by it would not be covered by ε. Such a run trains its whole
    plan and releases the last round's model; the round the target was reached is still
    recorded (``target_round``) and read by the tables.
    """
    if sweep is None or not sweep.stop_at_target:
        return False
    return config.data.test_per_client is None


def target_round(results: list[RoundResult], target: SweepConfig | None) -> int | None:
    """First round whose mean ``target.target_metric`` accuracy reached the target."""
    if target is None:
        return None
    key = f"{target.target_metric}_accuracy"
    for r in results:
        value = r.metrics.get(key)
        if value is not None and value >= target.target_accuracy:
            return r.round
    return None


#: Builds the engine of one prepared run from the run, the data and the simulator's arguments.
EngineFactory = Callable[..., Engine]


def _in_process(run: PreparedRun, data: FederatedData, **kwargs: Any) -> Engine:
    return Simulator(**kwargs)


def engine_arguments(
    run: PreparedRun,
    data: FederatedData,
    model: torch.nn.Module,
    *,
    accountant: Any = None,
    ledger: Any = None,
    eval_every: int | None = None,
) -> dict[str, Any]:
    """The simulator's arguments for one prepared run (what every engine is built from):
    its algorithm, the bounded training records, sampling, seed and noise."""
    return {
        "algorithm": run.algorithm,
        "model": model,
        "train": run.train,
        "test": data.test,
        "accountant": accountant,
        "silos_per_round": run.silos_per_round,
        "seed": run.coin_seed,
        "eval_every": run.training.eval_every if eval_every is None else eval_every,
        "noise": run.privacy.noise,
        "ledger": ledger,
    }


def _tracked(run: PreparedRun, run_dir: Path) -> tracking.TrackedRun:
    """What the trackers log of ``run``: its resolved config and the privacy settings."""
    private = run.plan is not None
    return tracking.TrackedRun(
        experiment=run.config.name,
        name=run.name,
        run_dir=run_dir,
        config=resolved_config(run),
        params={
            "algorithm": run.algorithm.name,
            "privacy_unit": run.algorithm.calibration_unit if private else None,
            "privacy_units": list(run.algorithm.units) if private else None,
            "noise_multiplier": run.noise_multiplier,
            "calibration": run.calibration["method"],
            "target_epsilon": run.calibration.get("target_epsilon"),
            "target_delta": run.privacy.delta if private else None,
        },
    )


def train_run(
    run: PreparedRun,
    data: FederatedData,
    run_dir: Path,
    progress: ProgressFactory | None,
    sweep: SweepConfig | None = None,
    *,
    resume: bool = False,
    engine_factory: EngineFactory | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Trains one prepared run on an engine (``engine_factory``; default the in-process
    simulator) and writes its directory.

    ``resume``: continue the run in ``run_dir`` from its last checkpoint (its ledger keeps
    everything it recorded, a round cut short included).

    With ``[tracking]`` in the config, the run is also logged there (see
    :mod:`silodp.tracking`); a resumed run continues its tracked run.

    Raises:
      InvalidValueError: resuming a run whose config or silodp version changed.
      BudgetExceededError: the plan does not fit the ledger's budget.
    """
    started = time.perf_counter()
    config_text = tomli_w.dumps(resolved_config(run))
    config_hash = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    config = run.config
    model = build_model(
        config.model.name, data.train.feature_shape, data.train.num_classes, seed=run.training.seed
    )
    checkpoint = None
    if resume:
        written = run_dir / "config.toml"
        if written.is_file() and written.read_text(encoding="utf-8") != config_text:
            raise InvalidValueError(
                f"Expected {str(written)!r} to be the config being resumed; the config (or "
                "what it resolves to) changed since the run started."
            )
        check_run_data(run_dir, config, data)  # the data the run started on
        checkpoint = load_checkpoint(run_dir, config_hash)
    accountant = None
    ledger = None
    #: a run without noise on a shared ledger: its release recorded there, not its rounds
    no_noise = None
    if run.plan is None and run.privacy.ledger is not None:
        no_noise = open_no_noise_ledger(run, run_dir, config_hash, resume=resume)
    if run.plan is not None:
        accountant = accountant_of(run)
        completed = int(checkpoint["round"]) if checkpoint is not None else 0
        ledger = (
            resume_run_ledger(run, run_dir, accountant, config_hash, completed) if resume else None
        )
        if not resume:
            set_aside_replaced_ledger(run, run_dir)
        if ledger is None:
            ledger = open_run_ledger(run, run_dir, accountant, config_hash)
            if run.plan.releases:
                ledger.record_release(run.plan.releases)
                accountant.compose_release(run.plan.releases)
    record_data(run_dir, config, data, resume=resume)  # what a resume must find again
    write_text(run_dir / "config.toml", config_text)
    make_engine = engine_factory or _in_process
    engine = make_engine(
        run, data, **engine_arguments(run, data, model, accountant=accountant, ledger=ledger)
    )
    start = 1
    previous: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    stops_at_target = stops_early(config, sweep)
    if checkpoint is not None:
        engine.restore(checkpoint["engine"])
        start, previous = checkpoint["round"] + 1, checkpoint["rows"]
        done = [RoundResult.from_json(row) for row in previous[0]]
        if stops_at_target and target_round(done, sweep) is not None:
            start = run.training.rounds + 1  # it had stopped at the target: train no further
    by_adversary: list[dict[str, dict[str, float | None]]] = [
        r["epsilon_by_adversary"] for r in previous[0] if r.get("epsilon_by_adversary")
    ]

    def adversaries(result: RoundResult) -> dict[str, Any]:
        if accountant is None or not result.epsilon:
            return {}
        by = spent_fields(spent(accountant))["epsilon_by_adversary"]
        by_adversary.append(by)
        row: dict[str, Any] = {"adversary": run.privacy.adversary, "epsilon_by_adversary": by}
        if run.algorithm.adjacency != "add/remove":
            row["adjacency"] = run.algorithm.adjacency
        return row

    def summary_of(status: str, results: list[RoundResult]) -> dict[str, Any]:
        extra = None
        if sweep is not None:
            extra = {
                "target_accuracy": sweep.target_accuracy,
                "target_round": target_round(results, sweep),
            }
        fields = getattr(engine, "summary_fields", None)
        extra = {**(extra or {}), **(fields() if fields is not None else {})}
        out = summary(run, results, status, by_adversary, extra)
        rewrite = getattr(engine, "summary_notes", None)
        if rewrite is not None:
            out["notes"] = rewrite(out["notes"])
        if sweep is not None and sweep.stop_at_target and not stops_at_target:
            out["notes"] = [
                *out["notes"],
                "trained every planned round although the accuracy target may be reached "
                "earlier (target_round): each client's test records follow its training "
                "labels (data.test_per_client), so stopping there would choose the released "
                "model by the training labels outside the noise",
            ]
        if charged:  # stopped at the accuracy target: the plan is the guarantee
            out["epsilon_at_stop"] = out["epsilon"]
            out["epsilon_by_adversary_at_stop"] = out["epsilon_by_adversary"]
            out.update(charged)
            out["notes"] = [*out["notes"], _charged_note(out, run.training.rounds)]
        if status == "interrupted" and ledger is not None and not charged:
            # (a run stopped at its target: epsilon is already the ledger's whole charge)
            out.update(_charged_beyond(ledger, results, out))
        repeated = ledger.repeated_attempts() if ledger is not None else 0
        if repeated:
            out["round_attempts_cut_short"] = repeated
            out["notes"] = [
                *out["notes"],
                f"{repeated} round(s) were cut short and run again on resume: the ledger "
                "composes each attempt in full, so ε is larger than account_command's (the "
                "plan's); silodp ledger show lists them",
            ]
        return out

    #: ε of every planned round, once a run stopped at its accuracy target is charged them
    charged: dict[str, Any] = {}

    def reached(result: RoundResult) -> bool:
        return stops_at_target and target_round([result], sweep) is not None

    tracker = tracking.open_run(
        config.tracking, _tracked(run, run_dir), resume=resume, previous=previous[0]
    )
    with tracker:
        try:
            results, rows, private_rows, status = record_rounds(
                engine,
                run.training.rounds,
                run_dir,
                summary_of,
                bar=tracker.chain(
                    progress(run.name, run.training.rounds) if progress is not None else None
                ),
                extra=adversaries,
                stop=reached,
                checkpoint=lambda r, public, private: save_checkpoint(
                    run_dir, r, engine, config_hash, (public, private)
                ),
                start=start,
                previous=previous,
                # in process (also Flower's simulation, whose server runs here), a stop
                # waits for the round in progress (a deployment's ServerApp is stopped with
                # its run on the federation)
                defer_stops=engine_factory is None
                or bool(getattr(engine_factory, "stops_in_process", False)),
            )
            stopped = int(rows[-1]["round"]) if rows else 0
            if status == "complete" and accountant is not None and stopped < run.training.rounds:
                # the stop was read from the models' accuracy, so where it fell depends on the
                # data: only the whole plan is a guarantee, and the ledger is charged it
                try:
                    engine.charge_rounds(stopped + 1, run.training.rounds)
                    # a checkpoint of the whole plan: a resume only writes the outputs
                    save_checkpoint(
                        run_dir, run.training.rounds, engine, config_hash, (rows, private_rows)
                    )
                except BudgetExceededError as err:  # what could be charged is in the ledger
                    status = "budget_exhausted"
                    logger.warning("%s", err)
                except BaseException:
                    write_json(run_dir / "summary.json", summary_of("interrupted", results))
                    raise
                through = run.training.rounds
                if status == "budget_exhausted" and ledger is not None:
                    through = max(ledger.recorded_rounds(), default=stopped)
                charged.update(_charged_epsilon(accountant, through))
                charged["stopped_at_round"] = stopped
        except BaseException as err:
            for held in (ledger, no_noise):
                if held is not None:
                    held.finish("interrupted")
                    held.close()
            # the trackers end with what the summary says was charged (not only the rounds)
            tracker.close_stopped(err, run_dir)
            raise
        for held in (ledger, no_noise):
            if held is not None:
                held.finish(status)
                held.close()  # frees the ledger's write lock for the next run
        try:  # stopped while writing its outputs: its rounds are kept, and a resume writes them
            if charged:  # the ε a run stopped at its target was charged: the trackers' last
                tracker.log_round(
                    {
                        "round": charged["rounds_charged"],
                        "epsilon": charged["epsilon"],
                        "epsilon_by_adversary": charged["epsilon_by_adversary"],
                    }
                )
            faults.reached("run_recorded", len(rows))
            title = f"{config.name}: {run.name}"
            plotting.plot_training(rows, run_dir / "accuracy_loss.png", title)
            if any(r.get("epsilon") for r in rows):  # a run without noise has no ε to draw
                plotting.plot_epsilon(
                    rows,
                    run_dir / "epsilon.png",
                    title,
                    run.privacy.delta,
                    # a cell stopped at its target: the ε it was charged, at the plan's end
                    (charged["rounds_charged"], charged["epsilon"]) if charged else None,
                )
            if any(r.metrics.get("personalised_accuracy") is not None for r in results):
                plotting.plot_personalised(
                    {run.name: rows},
                    run_dir / "personalised_vs_global.png",
                    title,
                    target=sweep.target_accuracy if sweep else None,
                )
            if any(
                r.get("largest_group_per_batch") or r.get("subjects_per_batch")
                for r in private_rows
            ):
                plotting.plot_batch_histograms(
                    private_rows, run_dir / PRIVATE_DIR / "batch_histograms.png", title
                )
            write_private(run_dir, run, time.perf_counter() - started)
            final = summary_of(status, results)
            write_json(run_dir / "summary.json", final)
        except BaseException as err:
            write_json(run_dir / "summary.json", summary_of("interrupted", results))
            tracker.close_stopped(err, run_dir)
            raise
        tracker.close(status, run_dir)
    return rows, final


def _log_protocol_estimate(
    run: PreparedRun, config: ExperimentConfig, data: FederatedData, log: Callable[[str], None]
) -> None:
    """Says, before training, what one round of the private weighting protocol will cost."""
    session = getattr(run.algorithm, "protocol", None)
    if session is None:
        return
    model = build_model(config.model.name, data.train.feature_shape, data.train.num_classes)
    dim = sum(int(p.numel()) for p in model.parameters())
    check = getattr(run.algorithm, "check_model_size", None)
    if check is not None:  # before anything is written (it would refuse in the first round)
        check(dim)
    est = session.estimate_round(dim)
    minutes = est.cpu_seconds / 60
    log(
        f"{run.name}: private weighting protocol, {est.scheme}, {est.pairs} (silo, subject) "
        f"pairs x {dim} "
        f"parameters, {est.slots} per ciphertext: about {minutes:.3g} CPU-minutes per round "
        f"of cryptography on this machine ({run.training.rounds} rounds; estimate)"
    )
    if est.setup_cpu_seconds > 0:
        log(
            f"{run.name}: the silos compute the encrypted fixed-point weights once, before the "
            f"first round: about {est.setup_cpu_seconds / 60:.3g} CPU-minutes (estimate)"
        )


def _prepare_data(
    config: ExperimentConfig, out: Path, log: Callable[[str], None]
) -> tuple[FederatedData, tuple[SiloPrivacy, ...], dict[str, Any] | None]:
    """The data, the events of releases before training and the DP feature statistics (which
    are written only once every run's ledger has recorded them)."""
    data = build_federated_data(config.data)
    releases: tuple[SiloPrivacy, ...] = ()
    scaling = None
    if config.data.scaling == "dp":
        data, releases, scaling = dp_scaling(config, data)
        alone = display.upper(scaling["epsilon_alone"])
        log(
            f"feature scaling: DP mean/std per feature, noise multiplier "
            f"{scaling['noise_multiplier']:.4g}, subject-level ε {alone} "
            f"alone at δ={config.privacy.delta:g} (composed into every run's ε)"
        )
    log(
        f"data: {len(data.train)} training records, {data.train.num_silos} silos, "
        f"{data.train.num_subjects} subjects, {len(data.test)} test records"
    )
    return data, releases, scaling


def _shown_sigma(sigma: float, calibration: Mapping[str, Any]) -> str:
    """σ for the console: a calibrated one rounded up to 4 figures (copied into a config, it
    reaches the target ε or less), a given one as given."""
    if calibration.get("method") == "calibrated":
        return display.upper(sigma, 4)
    return f"{sigma:.6g}"


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = logger.info,
    resume: bool = False,
    engine_factory: EngineFactory | None = None,
) -> dict[str, Any]:
    """Runs every algorithm of ``config`` (or every cell of its sweep); writes
    ``out_dir/<algorithm>/...`` and a comparison.

    ``resume``: continue the experiment in ``out_dir`` (see :func:`resume_experiment`): runs
    that completed are kept, the others continue from their last checkpoint.

    Returns the experiment summary (also written to ``out_dir/summary.json``).

    ``overwrite``: replace the experiment in ``out_dir`` (see :func:`replace_previous`), once
    every run is prepared and its plan fits its budget.

    Raises:
      OutputExistsError: results exist in ``out_dir`` and ``overwrite`` is false.
      InvalidValueError: another run holds ``out_dir``, or ``out_dir``, a tracking store or
        the shared ledger's directory cannot be created or written (found before the data is
        loaded).
      LedgerError: the shared ledger is not one a run can write to (found before the data is
        loaded).
      BudgetExceededError: a run's whole plan does not fit its budget on the ledger as it
        stands (found before anything is written).
      SilodpError: bad data, a schedule or target the algorithm cannot meet (found before
        anything trains).
    """
    tracking.check_installed(config.tracking)
    out = check_writable_dir(out_dir, name="out_dir")
    if not resume:  # written absolute: a resume from anywhere finds the same ledgers
        config = config.with_absolute_ledgers()
    with holding_results(out):
        from silodp.experiment.sweep import run_sweep

        tracking.check_writable(config.tracking)
        for shared in config.ledgers():
            check_shared_ledger(shared)
            log(describe_shared_ledger(shared))
        if resume and config.data.scaling == "dp":
            raise InvalidValueError(
                "Expected [data] scaling other than 'dp' to resume: the DP feature statistics are "
                "drawn again on every start and are not kept; start the run afresh."
            )
        if not resume:
            check_no_other_experiment(out, config.algorithms, overwrite)
        if config.sweep is None and not resume:
            check_output(out, config.algorithms, overwrite)
        data, releases, scaling = _prepare_data(config, out, log)
        if resume:  # before anything is written: the runs continue on the data they began on
            check_data_unchanged(out, config, data)
        if config.sweep is not None:
            return run_sweep(
                config,
                data,
                out,
                overwrite=overwrite,
                progress=progress,
                log=log,
                resume=resume,
                engine_factory=engine_factory,
            )
        runs = []
        for name in config.algorithms:
            run = prepare_run(name, config, data, releases=releases)
            if run.noise_multiplier is not None and run.plan is not None:
                log(
                    f"{name}: noise multiplier "
                    f"{_shown_sigma(run.noise_multiplier, run.calibration)} "
                    f"({run.calibration['method']}), "
                    + (f"group size k={run.group_size}, " if run.group_size else "")
                    + f"span={run.span}, "
                    f"{run.train.dropped_records} record(s) dropped by these bounds"
                )
            _log_protocol_estimate(run, config, data, log)
            runs.append(run)
        if not resume:
            check_plans_fit(runs)  # a refusal by a budget comes before anything is written
            if overwrite:
                replace_previous(out, config, log)
        write_json(out / PRIVATE_DIR / "data.json", describe(data))
        if not resume:  # what --resume continues, written once everything is prepared
            write_text(out / EXPERIMENT_FILE, tomli_w.dumps(to_toml_dict(config)))
        all_rows: dict[str, list[dict[str, Any]]] = {}
        summaries = []
        for run in runs:
            done = finished(out / run.name) if resume else None
            if done is not None:
                log(f"{run.name}: already {done['status']}; kept as it is")
                rows, run_summary = read_rows(out / run.name, run.training.rounds)[0], done
            else:
                rows, run_summary = train_run(
                    run,
                    data,
                    out / run.name,
                    progress,
                    resume=resume,
                    engine_factory=engine_factory,
                )
            all_rows[run.name] = rows
            summaries.append(run_summary)
        if scaling is not None:  # released once every run's ledger recorded its events
            write_json(out / "feature_scaling.json", scaling)
        deltas = {run.name: run.privacy.delta for run in runs}
        plotting.plot_comparison(all_rows, out / "comparison.png", delta=deltas)
        experiment = {"name": config.name, "runs": summaries}
        write_json(out / "summary.json", experiment)
        return experiment


#: the lock a run holds on its results directory (see :mod:`silodp.locking`)
RESULTS_LOCK = ".silodp-run.lock"


@contextmanager
def holding_results(out: Path) -> Iterator[None]:
    """Holds ``out``'s lock while the body runs: one experiment (or sweep, or resume) at a
    time writes there, so that an ``--overwrite`` cannot remove the files of a run still
    writing them. Directories made here and left empty (a refused run) are removed.

    Raises:
      InvalidValueError: another process holds it.
    """
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    where = out.resolve()
    lock = None
    try:
        try:
            lock = locking.acquire(str(where / RESULTS_LOCK))
        except locking.Held as held:
            raise InvalidValueError(
                f"Expected --out {str(out)!r} to be free; another silodp run (process "
                f"{held.holder}) is writing there. Wait for it to end, or choose another --out "
                "(nothing was written)."
            ) from None
        # a run writing inside this directory, or around it, would lose files to this one
        for other in [
            *(d / RESULTS_LOCK for d in where.parents),
            *where.rglob(f"*/{RESULTS_LOCK}"),
        ]:
            pid = locking.holder(str(other))
            if pid is not None:
                raise InvalidValueError(
                    f"Expected --out {str(out)!r} to be free; another silodp run (process "
                    f"{pid}) is writing {'inside' if where in other.parents else 'around'} it, "
                    f"in {str(other.parent)!r}. Wait for it to end, or choose another --out "
                    "(nothing was written)."
                )
        yield
    finally:
        if lock is not None:
            locking.release(lock)
        for made in created:  # a refused run leaves none of the directories it made
            try:
                made.rmdir()  # only if empty
            except OSError:
                break


#: the experiment's config as it started, which ``--resume`` continues
EXPERIMENT_FILE = "experiment.toml"

#: what an experiment (or ``silodp report``) writes at the top of its directory, beside the
#: run directories: what ``--overwrite`` replaces with them
EXPERIMENT_OUTPUTS = (
    "summary.json",
    EXPERIMENT_FILE,
    "comparison.png",
    "feature_scaling.json",
    "personalised_vs_global.png",
    "prifedsync_table.md",
    "prifedsync_table.csv",
    "report.html",
    "report_files",
    PRIVATE_DIR,
)


def previous_runs(out: Path) -> list[str]:
    """The run directories (names directly in ``out``) of the experiment ``out`` holds, as its
    ``summary.json`` and ``experiment.toml`` list them."""
    names: list[str] = []
    try:
        names += [
            str(r["algorithm"])
            for r in json.loads((out / "summary.json").read_text(encoding="utf-8"))["runs"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with (out / EXPERIMENT_FILE).open("rb") as handle:
            names += [str(n) for n in tomllib.load(handle).get("algorithms", [])]
    except (OSError, ValueError, TypeError):
        pass
    firsts = {name.split("/")[0] for name in names}
    return sorted(n for n in firsts if n not in ("", ".", "..") and os.sep not in n)


#: the manifest a grid sweep (``silodp sweep``) writes at the top of its directory
GRID_MANIFEST = "grid.json"


def check_no_other_experiment(out: Path, algorithms: Sequence[str], overwrite: bool) -> None:
    """Refuses (unless ``overwrite``) an ``out`` that holds a grid sweep, or an experiment
    whose runs are not ``algorithms``: its ``summary.json`` and ``experiment.toml`` would be
    replaced by ones that no longer list them.

    Raises:
      OutputExistsError: so."""
    if overwrite:
        return
    if (out / GRID_MANIFEST).exists():
        raise OutputExistsError(
            f"{str(out)!r} holds a sweep's results ({GRID_MANIFEST}); choose another --out or "
            "pass --overwrite."
        )
    previous = previous_runs(out)
    if previous and set(previous) != {n.split("/")[0] for n in algorithms}:
        raise OutputExistsError(
            f"{str(out)!r} holds another experiment's results (runs {', '.join(previous)}; "
            f"this config runs {', '.join(algorithms)}); choose another --out or pass "
            "--overwrite."
        )


def _is_ledger(path: Path, keep: set[Path]) -> bool:
    """Whether ``path`` is a ledger (or a ledger's -wal/-shm/-lock file) to keep: a run's own,
    one in ``keep``, or any SQLite database (a shared ledger an earlier config named there)."""
    name = path.name
    if (name.startswith("ledger.") and ".sqlite" in name) or path.resolve() in keep:
        return True
    for suffix in ("-wal", "-shm", "-lock"):
        if name.endswith(suffix) and _is_database(path.with_name(name[: -len(suffix)])):
            return True
    return _is_database(path)


def _is_database(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


def _remove(path: Path, keep: set[Path]) -> None:
    """Removes ``path`` (a file, or a directory with everything in it) except every ledger
    file in it and the files in ``keep``; a symbolic link is removed, never followed."""
    if path.is_symlink() or path.is_file():
        if not _is_ledger(path, keep):
            path.unlink()
        return
    if not path.is_dir():
        return
    for entry in sorted(path.iterdir()):
        _remove(entry, keep)
    if not any(path.iterdir()):
        path.rmdir()


def replace_previous(out: Path, config: ExperimentConfig, log: Callable[[str], None]) -> None:
    """``--overwrite``: removes the experiment in ``out`` that ``config`` replaces: its
    summary and config first (so that ``out`` no longer claims a finished or resumable
    experiment), then the directory of every run it listed or ``config`` lists, then its other
    top-level outputs (:data:`EXPERIMENT_OUTPUTS`).

    Every run's privacy ledger stays: ``ledger.sqlite`` is renamed
    ``ledger.replaced-<UTC time>.sqlite`` in its run directory (its spending stays on record;
    it does not count against a new run's budget), and a shared ``privacy.ledger`` is never
    moved. Nothing outside ``out`` is touched, nor anything in it that silodp did not write
    there (a symbolic link is removed, not followed).
    """
    keep: set[Path] = set()
    for named in config.ledgers():
        shared = Path(named).resolve()
        keep |= {shared, *(shared.with_name(shared.name + s) for s in ("-wal", "-shm"))}
    names = sorted({*previous_runs(out), *(n.split("/")[0] for n in config.algorithms)})
    dirs = [out / n for n in names if (out / n).is_dir() and not (out / n).is_symlink()]
    if not dirs and not any(os.path.lexists(out / n) for n in EXPERIMENT_OUTPUTS):
        return
    log(f"--overwrite: replacing the previous results in {out}/")
    for name in ("summary.json", EXPERIMENT_FILE):
        _remove(out / name, keep)
    for run_dir in dirs:
        for ledger in sorted(run_dir.rglob(LEDGER_FILE)):
            if ledger.resolve() not in keep and not ledger.parent.is_symlink():
                target = set_aside_ledger(ledger.parent)
                logger.warning(
                    "%s: the replaced run's ledger is kept as %s; what it spent does not count "
                    "against a new run's budget (a shared privacy.ledger counts every run).",
                    ledger.parent.relative_to(out),
                    target,
                )
        _remove(run_dir, keep)
    for name in [n for n in names if (out / n).is_symlink()] + list(EXPERIMENT_OUTPUTS):
        _remove(out / name, keep)


def finished(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a run that ended (completed, or stopped by its budget), else ``None``."""
    summary = _readable_summary(run_dir / "summary.json")
    if summary is None:
        return None
    return summary if summary.get("status") in ("complete", "budget_exhausted") else None


def _readable_summary(path: Path) -> dict[str, Any] | None:
    """The summary at ``path``, or ``None`` if there is none or it cannot be read (cut short
    while written, or damaged: the run or experiment it belongs to resumes and writes it)."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def resume_experiment(
    out_dir: str | Path,
    *,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = logger.info,
    engine_factory: EngineFactory | None = None,
) -> dict[str, Any]:
    """Continues the experiment in ``out_dir`` from the config it started with: completed runs
    are kept, each other run continues after its last completed round, and every event its
    ledger recorded before the interruption counts.

    Raises:
      InvalidValueError: ``out_dir`` holds no experiment, or a run's config or silodp version
        changed.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidValueError(
            f"Expected {str(out)!r} to be the results directory of an experiment to resume; "
            "it is not a directory."
        )
    if out.is_dir():
        check_writable_dir(out, name="the results directory")
    path = out / EXPERIMENT_FILE
    done = _readable_summary(out / "summary.json")
    if done is not None and every_run_finished(done):
        log(f"{out}: every run already finished; nothing to resume")
        return done
    if not path.is_file():
        raise InvalidValueError(
            f"Expected an experiment to resume in {str(out)!r}: it has no {EXPERIMENT_FILE}, "
            "so it stopped before its runs were prepared (e.g. while calibrating or setting up "
            "the weighting protocol) and nothing was trained or recorded; start it again with "
            f"silodp run CONFIG --out {out}."
        )
    return run_experiment(
        load_config(path, written=True),
        out,
        progress=progress,
        log=log,
        resume=True,
        engine_factory=engine_factory,
    )


def every_run_finished(summary: Mapping[str, Any]) -> bool:
    """Whether an experiment summary lists runs that all ended (complete, or stopped by their
    budget): a resume of it has nothing to do."""
    runs = summary.get("runs")
    return (
        isinstance(runs, list)
        and bool(runs)
        and all(
            isinstance(r, dict) and r.get("status") in ("complete", "budget_exhausted")
            for r in runs
        )
    )


def _checkpointed_round(run_dir: Path) -> int:
    """The last round in the run's checkpoint (0: none)."""
    from silodp.experiment.checkpoint import checkpoint_path

    path = checkpoint_path(run_dir)
    if path is None:
        return 0
    import torch

    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception:  # an unreadable checkpoint keeps nothing
        return 0
    # the rounds trained (a run charged its plan after stopping at its accuracy target is
    # checkpointed at the plan's last round, with the rows of the rounds it trained)
    rows = state.get("rows", ([], []))[0]
    return int(rows[-1]["round"]) if rows else 0


def kept_runs(out_dir: str | Path, names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """What an interrupted experiment in ``out_dir`` kept, per run: its name, ``status``
    (``complete``, ``budget_exhausted``, ``interrupted`` or ``not started``), the rounds it
    kept (completed, or checkpointed for a run that continues on ``--resume``) and the rounds
    planned. ``names``: the runs the experiment listed, reported as not started if they have
    no directory yet."""
    out = Path(out_dir)
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(out.rglob("summary.json")):
        run_dir = path.parent
        if run_dir == out or PRIVATE_DIR in run_dir.relative_to(out).parts:
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        status = data.get("status", "interrupted")
        if status == "running":
            status = "interrupted"
        done = status in ("complete", "budget_exhausted")
        found[str(run_dir.relative_to(out))] = {
            "run": str(run_dir.relative_to(out)),
            "status": status,
            "rounds_kept": int(data.get("rounds_completed", 0))
            if done
            else _checkpointed_round(run_dir),
            "rounds_planned": data.get("rounds_planned"),
        }
    for name in names:
        if name not in found and not any(key.startswith(f"{name}/") for key in found):
            found[name] = {
                "run": name,
                "status": "not started",
                "rounds_kept": 0,
                "rounds_planned": None,
            }
    order = {name: i for i, name in enumerate(names)}
    return sorted(
        found.values(), key=lambda r: (order.get(r["run"].split("/")[0], len(order)), r["run"])
    )
