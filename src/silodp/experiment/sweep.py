"""A PriFedSync sweep: every cell of ``[sweep]`` as a run, and the table of rounds to target."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from silodp import plotting, reports
from silodp.algorithms.planning import account_plan
from silodp.config import ExperimentConfig, SweepConfig, to_toml_dict
from silodp.data import FederatedData
from silodp.data.describe import describe
from silodp.experiment.ledger import check_plans_fit
from silodp.experiment.prepare import PreparedRun, prepare_run
from silodp.experiment.record import PRIVATE_DIR, check_output, read_rows
from silodp.experiment.run import (
    EXPERIMENT_FILE,
    ProgressFactory,
    finished,
    replace_previous,
    train_run,
)
from silodp.io import write_json, write_text

__all__ = ["run_sweep"]


def run_sweep(
    config: ExperimentConfig,
    data: FederatedData,
    out: Path,
    *,
    overwrite: bool,
    progress: ProgressFactory | None,
    log: Callable[[str], None],
    resume: bool = False,
    engine_factory: Any = None,
) -> dict[str, Any]:
    """Runs every cell of ``config.sweep``; writes the table (``prifedsync_table.md``/``.csv``)
    and ``personalised_vs_global.png`` into ``out``."""
    sweep = config.sweep
    assert sweep is not None
    (name,) = config.algorithms
    runs = [prepare_run(name, config, data, cell=cell) for cell in sweep.cells()]
    if not resume:
        check_output(out, tuple(run.name for run in runs), overwrite)
        check_plans_fit(runs)  # a refusal by a budget comes before anything is written
        if overwrite:
            replace_previous(out, config, log)
    log(
        f"{name} sweep: {len(runs)} runs, target {sweep.target_metric} accuracy "
        f"{sweep.target_accuracy:g}, at most {config.training.rounds} rounds each"
    )
    write_json(out / PRIVATE_DIR / "data.json", describe(data))
    if not resume:  # what --resume continues, written once every cell is prepared
        write_text(out / EXPERIMENT_FILE, tomli_w.dumps(to_toml_dict(config)))
    all_rows: dict[str, list[dict[str, Any]]] = {}
    summaries, table = [], []
    key = f"{sweep.target_metric}_accuracy"
    for i, run in enumerate(runs, start=1):
        done = finished(out / run.name) if resume else None
        if done is not None:
            rows, run_summary = read_rows(out / run.name, run.training.rounds)[0], done
        else:
            rows, run_summary = train_run(
                run,
                data,
                out / run.name,
                progress,
                sweep,
                resume=resume,
                engine_factory=engine_factory,
            )
        label = run.name.removeprefix(f"{name}/")
        all_rows[label] = rows
        summaries.append(run_summary)
        hit = reports.rounds_to_target(rows, key=key, target=sweep.target_accuracy)
        at = int(hit["round"]) if hit is not None else int(rows[-1]["round"])
        schedule = {**dataclasses.asdict(run.training), **run.algorithm.config.settings()}
        table.append(
            reports.sweep_row(
                label=label,
                training=schedule,
                noise_multiplier=run.noise_multiplier,
                metrics=rows,
                target_key=key,
                target=sweep.target_accuracy,
                account_command=run.account_command(at),
                epsilon_planned=_planned_epsilon(run, rows, run_summary),
                status=run_summary.get("status"),
            )
        )
        title = _table_title(config, sweep, data)
        if i < len(runs):  # rewritten after each cell: it says until the last that it is partial
            title += f" **Partial: {i} of {len(runs)} cells so far.**"
        reports.write_table(table, out, stem="prifedsync_table", title=title)
    plotting.plot_personalised(
        all_rows,
        out / "personalised_vs_global.png",
        f"{config.name}: personalised (solid) vs global (dashed)",
        target=sweep.target_accuracy,
    )
    experiment = {"name": config.name, "runs": summaries, "table": table}
    write_json(out / "summary.json", experiment)
    return experiment


def _planned_epsilon(
    run: PreparedRun, rows: list[dict[str, Any]], summary: dict[str, Any]
) -> float | None:
    """The record ε of every round the cell planned: the guarantee of what it released, since
    the round the table reads (and the round it stopped at) is chosen from the models' own
    accuracy; ε at that round is what was spent by then, no guarantee on its own.

    It is the cell's summary ε where that covers every planned round (the ledger's, which
    counts a round cut short and run again in full), else the larger of that and the plan's."""
    if run.plan is None:
        return None
    written = (summary.get("epsilon") or {}).get("record", math.nan)
    spent = math.inf if written is None else float(written)
    rounds = summary.get("rounds_charged", int(rows[-1]["round"]) if rows else 0)
    if rounds >= run.plan.rounds and not math.isnan(spent):
        return spent
    planned = float(account_plan(run.algorithm, run.plan)[-1]["record"].epsilon)
    return planned if math.isnan(spent) else max(planned, spent)


def _table_title(config: ExperimentConfig, sweep: SweepConfig, data: FederatedData) -> str:
    return (
        f"**{config.name}** — {data.name}, {data.train.num_silos} clients: rounds R until the "
        f"mean {sweep.target_metric} test accuracy over clients reaches "
        f"{100 * sweep.target_accuracy:g}%, and the privacy spent by then (μ: the CLT estimate "
        f"of Theorem 2, not a guarantee; ε at δ={config.privacy.delta:g}: the accountant's "
        "rigorous bound at R, and for all planned rounds, which is the guarantee: R is read "
        "from the models' own accuracy). Accuracies in %."
    )
