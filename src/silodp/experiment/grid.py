"""Sweeps over any config key: a grid file expanded into experiments, run, resumed, tabulated.

A sweep file names a base experiment config and a grid::

    name = "epsilon-sweep"
    base = "smoke.toml"               # relative to this file
    seeds = [0, 1, 2]                 # training.seed of each repeat
    baseline = true                   # a non-private fedavg cell per grid point (default)
    [grid]
    algorithms = ["local_item_dp", "uldp_avg"]   # one algorithm (or a list) per cell
    "privacy.epsilon" = [1.0, 4.0]
    "data.num_silos" = [3, 5]

Every combination of the grid's values and the seeds is one experiment (a *cell*), the base
config with those keys set and validated as any config is. With ``baseline``, each combination
of the grid's non-privacy keys and the seeds also gets a ``fedavg`` cell: the same data, model
and schedule without clipping or noise, the first row of every table. Cells run one after
another under ``OUT/cells/``; a cell that finished is skipped when the sweep runs again, and one
that was interrupted continues from its checkpoints through the ledger (``resume``). The
table (``OUT/results.csv``, ``OUT/results.md``) gives, per algorithm and grid point, the mean
and standard deviation over seeds of the final test accuracy and of ε per unit.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from silodp import display
from silodp.config import parse_config, to_toml_dict
from silodp.errors import ConfigError, InvalidValueError, OutputExistsError
from silodp.experiment.run import (
    EXPERIMENT_FILE,
    GRID_MANIFEST,
    ProgressFactory,
    previous_runs,
    resume_experiment,
    run_experiment,
)
from silodp.io import write_json, write_text
from silodp.ledger import LedgerError
from silodp.ledger.report import ledger_report, total_line
from silodp.ledger.run import BudgetExceededError
from silodp.reports import columns_of, rows_csv

__all__ = [
    "Cell",
    "CellProgress",
    "GridSpec",
    "expand",
    "grid_rows",
    "load_grid",
    "planned_rounds",
    "run_grid",
    "unfinished_cells",
]

#: the manifest of a sweep's results directory: the cells it expanded into
MANIFEST = GRID_MANIFEST
#: at most this many cells in one sweep (each is a whole experiment)
MAX_CELLS = 10_000
#: the grid key whose values name the algorithms of a cell
ALGORITHMS = "algorithms"


@dataclass(frozen=True)
class GridSpec:
    """A parsed sweep file: the base config (as TOML data), the grid and the seeds."""

    name: str
    base: Mapping[str, Any]
    axes: Mapping[str, tuple[Any, ...]]
    seeds: tuple[int, ...]
    baseline: bool = True


@dataclass(frozen=True)
class Cell:
    """One experiment of a sweep: the grid values it sets, its seed, and its directory name."""

    id: str
    values: Mapping[str, Any]
    seed: int
    baseline: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "values": dict(self.values),
            "seed": self.seed,
            "baseline": self.baseline,
        }


def load_grid(path: str | Path) -> GridSpec:
    """Reads a sweep file; the base config is read relative to it.

    Raises:
      ConfigError: the file, its base config or a grid entry is not what a sweep needs.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Expected a sweep file at {str(path)!r}; it does not exist.")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"Sweep file {str(path)!r} is not valid UTF-8 TOML: {err}") from err
    unknown = set(raw) - {"name", "base", "seeds", "baseline", "grid"}
    if unknown:
        hint = (
            " It looks like an experiment config: run it with `silodp run`."
            if unknown & {"algorithms", "data", "training", "privacy"}
            else ""
        )
        raise ConfigError(
            f"Unknown key(s) {sorted(unknown)} in sweep file {str(path)!r}; expected name, "
            f"base, seeds, baseline and [grid].{hint}"
        )
    base_name = raw.get("base")
    if not isinstance(base_name, str):
        raise ConfigError(f'Expected base = "CONFIG.toml" in sweep file {str(path)!r}.')
    base_path = (path.parent / base_name) if not Path(base_name).is_absolute() else Path(base_name)
    if not base_path.is_file():
        raise ConfigError(
            f"Expected base={base_name!r} of sweep file {str(path)!r} to be a config file "
            f"(looked for {str(base_path)!r})."
        )
    try:
        base = tomllib.loads(base_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"Base config {str(base_path)!r} is not valid TOML: {err}") from err
    parse_config(base)  # the base alone must be a valid experiment
    grid = raw.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError("Expected [grid] to be a table of key = [values].")
    axes: dict[str, tuple[Any, ...]] = {}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"Expected grid.{key} to be a non-empty list of values, got {values!r}."
            )
        repeated = sorted({json.dumps(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ConfigError(
                f"Expected grid.{key} to list distinct values, got {values!r} (repeated: "
                f"{', '.join(repeated)}); repeat runs with seeds instead."
            )
        axes[key] = tuple(values)
    seeds = raw.get("seeds", [base.get("training", {}).get("seed", 0)])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ConfigError(f"Expected seeds to be a list of distinct integers >= 0, got {seeds!r}.")
    baseline = raw.get("baseline", True)
    if not isinstance(baseline, bool):
        raise ConfigError(f"Expected baseline to be true or false, got {baseline!r}.")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"Expected name to be a non-empty string, got {name!r}.")
    spec = GridSpec(name=name, base=base, axes=axes, seeds=tuple(seeds), baseline=baseline)
    cells = expand(spec)
    if len(cells) > MAX_CELLS:
        raise ConfigError(f"Expected at most {MAX_CELLS} cells in a sweep, got {len(cells)}.")
    # every cell is a valid experiment before anything runs
    configs = [cell_config(spec, cell) for cell in cells]
    ran = sorted({a for c, cfg in zip(cells, configs, strict=True) if not c.baseline
                  for a in cfg.algorithms})  # fmt: skip
    for key in axes:
        parts = key.split(".")
        if parts[0] == "algorithm" and (len(parts) < 3 or parts[1] not in ran):
            raise ConfigError(
                f"Expected grid.{key} to set a hyperparameter of an algorithm the cells run "
                f"(algorithm.NAME.KEY with NAME one of {', '.join(ran)}); its section would "
                "be dropped from every cell, and the cells would differ in name only."
            )
    return spec


def _private_axis(key: str) -> bool:
    return key.startswith("privacy.") or key.startswith("algorithm.")


def expand(spec: GridSpec) -> list[Cell]:
    """The sweep's cells: baseline cells first (one per non-privacy grid point and seed), then
    every grid point and seed."""
    cells: list[Cell] = []
    if spec.baseline:
        keys = [k for k in spec.axes if k != ALGORITHMS and not _private_axis(k)]
        for combo in itertools.product(*(spec.axes[k] for k in keys)):
            for seed in spec.seeds:
                values = dict(zip(keys, combo, strict=True))
                cells.append(Cell(_cell_id(len(cells), values, seed, True), values, seed, True))
    keys = list(spec.axes)
    for combo in itertools.product(*(spec.axes[k] for k in keys)):
        for seed in spec.seeds:
            values = dict(zip(keys, combo, strict=True))
            cells.append(Cell(_cell_id(len(cells), values, seed, False), values, seed, False))
    return cells


#: grid keys that change what fedavg trains on or with although the baseline cells do not vary
#: them (they leave out private keys): its own settings, and the span cap of its data
_FEDAVG_OWN = ("algorithm.fedavg.", "privacy.span")


def _baseline_repeats(values: Mapping[str, Any]) -> bool:
    """Whether a cell's fedavg is its grid point's baseline again: no grid key of the cell
    changes fedavg from the baseline's (:data:`_FEDAVG_OWN`)."""
    return not any(k.startswith(_FEDAVG_OWN) for k in values)


def _cell_id(index: int, values: Mapping[str, Any], seed: int, baseline: bool) -> str:
    def short(value: Any) -> str:
        text = "+".join(map(str, value)) if isinstance(value, list) else str(value)
        return "".join(c if c.isalnum() or c in ".-+" else "_" for c in text)[:24]

    parts = ["baseline"] if baseline else []
    parts += [
        short(v) if k == ALGORITHMS else f"{k.split('.')[-1]}={short(v)}" for k, v in values.items()
    ]
    return f"{index:03d}-" + "-".join([*parts, f"seed{seed}"])


def cell_config(spec: GridSpec, cell: Cell) -> Any:
    """The cell's experiment config: the base with the cell's grid values and seed set."""
    raw = copy.deepcopy(dict(spec.base))
    for key, value in cell.values.items():
        if key == ALGORITHMS:
            raw[ALGORITHMS] = value if isinstance(value, list) else [value]
            continue
        *tables, leaf = key.split(".")
        node = raw
        for table in tables:
            node = node.setdefault(table, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Expected grid key {key!r} to name a config key in a table.")
        node[leaf] = value
    raw.setdefault("training", {})["seed"] = cell.seed
    raw["name"] = f"{spec.name}/{cell.id}"
    if cell.baseline:
        raw[ALGORITHMS] = ["fedavg"]
    elif spec.baseline and _baseline_repeats(cell.values):
        # the baseline cell of this point and seed trains the same fedavg: not twice (a cell
        # of fedavg alone trains it, and the table counts the baseline's)
        names = list(raw.get(ALGORITHMS) or ())
        if "fedavg" in names and len(set(names)) > 1:
            raw[ALGORITHMS] = [a for a in names if a != "fedavg"]
    sections = raw.get("algorithm")
    if isinstance(sections, dict):  # the base's sections of algorithms this cell does not run
        listed = set(raw.get(ALGORITHMS) or ())
        raw["algorithm"] = {k: v for k, v in sections.items() if k in listed}
    try:
        return parse_config(raw).with_absolute_ledgers()
    except ConfigError as err:
        raise ConfigError(f"Sweep cell {cell.id}: {err}") from err


@dataclass(frozen=True)
class CellProgress:
    """Where a sweep is when a cell starts, is kept (it finished in an earlier invocation) or
    finishes: cell ``index`` (from 1) of ``cells``, the ``rounds`` it plans (every run of its
    experiment), the rounds planned by the cells before it and by the whole sweep."""

    index: int
    cells: int
    label: str
    status: str  # "started", "kept" or "finished"
    rounds: int
    rounds_before: int
    rounds_total: int


def planned_rounds(config: Any) -> int:
    """The rounds a cell's experiment plans: every algorithm's, times the settings of a
    PriFedSync ``[sweep]`` (a run may stop sooner: at its target or its budget)."""
    runs = len(config.sweep.cells()) if config.sweep is not None else 1
    return runs * sum(config.for_algorithm(name)[0].rounds for name in config.algorithms)


def run_grid(
    spec: GridSpec,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = print,
    on_cell: Callable[[CellProgress], None] | None = None,
) -> dict[str, Any]:
    """Runs every cell of ``spec`` not finished yet in ``out_dir`` and writes the tables.

    A results directory of the same sweep continues where it stopped: finished cells are
    kept, interrupted ones resume. One of another sweep is refused unless ``overwrite``.
    ``progress`` follows each run's rounds; ``on_cell`` receives a :class:`CellProgress` as
    each cell starts, is kept or finishes (one view of the whole sweep).

    Raises:
      OutputExistsError: ``out_dir`` holds another sweep's cells and ``overwrite`` is false.
    """
    from silodp.experiment.run import holding_results

    out = Path(out_dir)
    with holding_results(out):  # one sweep at a time writes its directory
        return _run_grid(
            spec, out, overwrite=overwrite, progress=progress, log=log, on_cell=on_cell
        )


def _run_grid(
    spec: GridSpec,
    out: Path,
    *,
    overwrite: bool,
    progress: ProgressFactory | None,
    log: Callable[[str], None],
    on_cell: Callable[[CellProgress], None] | None,
) -> dict[str, Any]:
    cells = expand(spec)
    configs = [cell_config(spec, cell) for cell in cells]
    # each cell's whole config, digested: a base config edited since its cells ran is another
    # sweep (kept cells would show the old config's numbers under the new one's name)
    digests = [_config_digest(config) for config in configs]
    manifest = {
        "name": spec.name,
        "cells": [{**c.to_json(), "config": d} for c, d in zip(cells, digests, strict=True)],
    }
    existing = out / MANIFEST
    if not overwrite and not existing.exists():
        previous = previous_runs(out)
        if previous or (out / "summary.json").exists():
            raise OutputExistsError(
                f"{str(out)!r} holds an experiment's results"
                + (f" (runs {', '.join(previous)})" if previous else " (summary.json)")
                + ", not a sweep's; choose another --out or pass --overwrite."
            )
    if existing.is_file() and not overwrite:
        try:
            recorded = json.loads(existing.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise OutputExistsError(
                f"{str(existing)!r} cannot be read ({err}), so whether {str(out)!r} holds this "
                "sweep is unknown; choose another --out or pass --overwrite."
            ) from None
        if recorded != json.loads(json.dumps(manifest)):
            raise OutputExistsError(
                f"{str(out)!r} holds another sweep (its {MANIFEST} differs: the sweep file, "
                "its grid or its base config changed since its cells ran); choose another "
                "--out or pass --overwrite."
            )
    if overwrite:  # an earlier sweep's tables must not stand beside this one's cells
        for name in ("results.md", "results.csv", "summary.json"):
            (out / name).unlink(missing_ok=True)
    write_json(existing, manifest)
    planned = [planned_rounds(config) for config in configs]
    label = ""
    try:
        for i, cell in enumerate(cells, start=1):
            cell_dir = out / "cells" / cell.id
            what = ", ".join(f"{k}={v}" for k, v in cell.values.items())
            kind = "baseline " if cell.baseline else ""
            name = f"{kind}{what or 'base'}, seed {cell.seed}"
            label = f"[{i}/{len(cells)}] {name}"

            def report(status: str, i: int = i, name: str = name) -> None:
                if on_cell is not None:
                    at = CellProgress(
                        i,
                        len(cells),
                        name,
                        status,
                        planned[i - 1],
                        sum(planned[: i - 1]),
                        sum(planned),
                    )
                    on_cell(at)

            # a cell directory of another config (an earlier sweep's, left by an interrupted
            # --overwrite) is neither kept nor resumed: it runs again
            ours = not overwrite and _holds_config(cell_dir, digests[i - 1])
            if ours and _cell_done(cell_dir):
                log(f"{label}: done, kept")
                report("kept")
                continue
            log(label)
            report("started")
            if ours:
                resume_experiment(cell_dir, progress=progress, log=log)
            else:
                if (cell_dir / EXPERIMENT_FILE).exists() and not overwrite:
                    log(f"{label}: {cell_dir} holds a run of another config; it runs again")
                run_experiment(configs[i - 1], cell_dir, overwrite=True, progress=progress, log=log)
            report("finished")
    except BudgetExceededError as err:  # the cells before it stay, tabulated as such
        _write_tables(out, spec, configs, refused=f"the budget refused {label}: {err}")
        raise
    return _write_tables(out, spec, configs)


def _write_tables(
    out: Path, spec: GridSpec, configs: Sequence[Any], *, refused: str | None = None
) -> dict[str, Any]:
    """Writes ``results.csv``, ``results.md`` and ``summary.json`` of the finished cells and
    the totals of the shared ledgers; ``refused``: why the sweep stopped before its last cell
    (the tables then say they are partial)."""
    rows = grid_rows(out)
    ledgers = shared_ledger_totals(configs)
    write_text(out / "results.csv", rows_csv(rows, columns_of(rows)))
    partial = ""
    if refused is not None:
        partial = (
            f"\n**Partial:** {refused}. The rows pool the cells finished before it. A budget "
            "declared on a ledger binds every later run there, so the other cells can run only "
            "on another ledger, in another --out (where every cell runs, and spends, again).\n"
        )
    write_text(out / "results.md", _markdown(rows, spec) + partial + _ledger_lines(ledgers))
    summary: dict[str, Any] = {"name": spec.name, "cells": len(configs), "rows": rows}
    if refused is not None:
        summary["partial"] = refused
    if ledgers:
        summary["ledgers"] = ledgers
    write_json(out / "summary.json", summary)
    return summary


def shared_ledger_totals(configs: Sequence[Any]) -> list[dict[str, Any]]:
    """What each shared ledger the cells wrote through holds in total (every run on it, this
    sweep's cells and any other): a row's ε is one cell's, the data's spending is this."""
    paths = dict.fromkeys(p for config in configs for p in config.ledgers())
    found = []
    for path in paths:
        if not Path(path).is_file():
            continue
        try:
            found.append({"path": path, "total": ledger_report(path)["total"]})
        except LedgerError as err:
            found.append({"path": path, "error": str(err)})
    return found


def _ledger_lines(ledgers: Sequence[Mapping[str, Any]]) -> str:
    if not ledgers:
        return ""
    lines = [
        "",
        "Shared ledgers: the total spent on the data by every run on each (`silodp "
        "ledger show PATH` lists them):",
        "",
    ]
    for ledger in ledgers:
        where = f"`{ledger['path']}`"
        if "error" in ledger:
            lines.append(f"* {where}: cannot be read ({ledger['error']})")
            continue
        for kind, total in ledger["total"].items():
            lines.append(f"* {where}: {total_line(kind, total)}")
    return "\n".join(lines) + "\n"


def _config_digest(config: Any) -> str:
    """A digest of a cell's resolved config, as its ``experiment.toml`` would hold it."""
    text = tomli_w.dumps(to_toml_dict(config))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unfinished_cells(out_dir: str | Path) -> list[str]:
    """The cells of the sweep in ``out_dir`` (its :data:`MANIFEST`) that have not finished."""
    out = Path(out_dir)
    path = out / MANIFEST
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        ids = [(c["id"], c["config"]) for c in cells]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidValueError(
            f"Expected {str(path)!r} to list the sweep's cells as silodp writes it; it cannot be "
            f"read ({err})."
        ) from None
    return [
        str(i)
        for i, digest in ids
        if not (
            _holds_config(out / "cells" / str(i), digest) and _cell_done(out / "cells" / str(i))
        )
    ]


def _holds_config(cell_dir: Path, digest: str) -> bool:
    """Whether ``cell_dir`` holds a run of the config digested as ``digest``
    (:func:`_config_digest` of its ``experiment.toml``)."""
    try:
        text = (cell_dir / EXPERIMENT_FILE).read_bytes()
    except OSError:
        return False
    if hashlib.sha256(text).hexdigest()[:16] == digest:
        return True
    try:  # the same config written with other bytes (e.g. another text encoding)
        canonical = tomli_w.dumps(tomllib.loads(text.decode("utf-8")))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return hashlib.sha256(canonical.encode()).hexdigest()[:16] == digest


def _cell_done(cell_dir: Path) -> bool:
    path = cell_dir / "summary.json"
    if not path.is_file():
        return False
    try:  # one cut short while written (or damaged) is not done: the cell runs again
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(runs, list)
        and bool(runs)
        and all(isinstance(r, dict) for r in runs)
        and all(r.get("status") in ("complete", "budget_exhausted") for r in runs)
    )


def grid_rows(out_dir: str | Path) -> list[dict[str, Any]]:
    """Per algorithm and grid point (seeds pooled): mean and standard deviation of the final
    test accuracy and of ε per unit, ε's largest over the seeds (``epsilon_<unit>_max``) and
    the δ and adversary it holds at, from every finished cell; the baseline rows first."""
    out = Path(out_dir)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    baselines = any(cell["baseline"] for cell in manifest["cells"])
    for cell in manifest["cells"]:
        path = out / "cells" / cell["id"] / "summary.json"
        if not path.is_file() or not _holds_config(path.parent, cell["config"]):
            continue  # not run yet, or a run of another config
        values = {k: v for k, v in cell["values"].items() if k != ALGORITHMS}
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs", [])
        for run in runs:
            if run.get("status") not in ("complete", "budget_exhausted"):
                continue
            if (
                baselines
                and not cell["baseline"]
                and run["algorithm"] == "fedavg"
                and _baseline_repeats(cell["values"])
            ):
                continue  # the same fedavg as the baseline cell's: one seed counted once
            key = (run["algorithm"], json.dumps(values, sort_keys=True))
            group = groups.setdefault(
                key,
                {
                    "algorithm": run["algorithm"],
                    "baseline": cell["baseline"],
                    "values": values,
                    "accuracy": [],
                    "personalised": [],
                    "epsilon": {},
                    "seeds": [],
                    "budget_stopped": 0,
                    "held_at": set(),
                },
            )
            group["seeds"].append(cell["seed"])
            # trained fewer rounds than planned: its accuracy is pooled with the others'
            group["budget_stopped"] += run.get("status") == "budget_exhausted"
            if run.get("epsilon"):  # the δ and adversary its ε holds at
                group["held_at"].add((run.get("delta"), run.get("adversary")))
            group["accuracy"].append(run.get("test_accuracy"))
            group["personalised"].append(run.get("personalised_accuracy"))
            for unit, eps in (run.get("epsilon") or {}).items():
                group["epsilon"].setdefault(unit, []).append(eps)
    rows = []
    for group in groups.values():
        row: dict[str, Any] = {
            "algorithm": group["algorithm"],
            "baseline": group["baseline"],
            **group["values"],
            "seeds": len(group["seeds"]),
            "budget_stopped": group["budget_stopped"],
        }
        row["accuracy_mean"], row["accuracy_std"] = _mean_std(group["accuracy"])
        if any(v is not None for v in group["personalised"]):  # PriFedSync's own models
            mean, std = _mean_std(group["personalised"])
            row["personalised_accuracy_mean"], row["personalised_accuracy_std"] = mean, std
        for unit, values in sorted(group["epsilon"].items()):
            row[f"epsilon_{unit}_mean"], row[f"epsilon_{unit}_std"] = _mean_std(values)
            # the ε every seed's run meets (a mean could read below one of them)
            row[f"epsilon_{unit}_max"] = (
                None if any(v is None for v in values) else max(values, default=None)
            )
            if any(v is None for v in values):  # null: no finite bound in some seed
                row[f"epsilon_{unit}_unbounded"] = True
        if group["held_at"]:
            deltas = {d for d, _ in group["held_at"]}
            against = {a for _, a in group["held_at"]}
            row["delta"] = deltas.pop() if len(deltas) == 1 else None
            row["adversary"] = against.pop() if len(against) == 1 else "mixed"
        rows.append(row)
    rows.sort(key=lambda r: not r["baseline"])  # stable: expansion order within each
    return rows


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value); ``None`` where a value is missing
    or infinite (an infinite ε is written as null)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not values or len(finite) != len(values):
        return None, None
    mean = sum(finite) / len(finite)
    if len(finite) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))


def _markdown(rows: Sequence[Mapping[str, Any]], spec: GridSpec) -> str:
    grid_keys = [k for k in spec.axes if k != ALGORITHMS]
    units = sorted(
        {
            k[len("epsilon_") : -len("_mean")]
            for r in rows
            for k in r
            if k.startswith("epsilon_") and k.endswith("_mean")
        }
    )
    personal = any("personalised_accuracy_mean" in r for r in rows)
    header = ["algorithm", *grid_keys, "seeds", "test accuracy"]
    header += ["personalised accuracy"] if personal else []
    header += [f"ε ({u})" for u in units]
    header += ["δ", "against"] if units else []
    lines = [f"# {spec.name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def pm(mean: float | None, std: float | None, text: Callable[[float], str]) -> str:
        if mean is None:
            return "-"
        return text(mean) if std is None else f"{text(mean)} ± {text(std)}"

    def accuracy(value: float) -> str:
        return f"{value:.3f}"

    def epsilon(value: float) -> str:
        return display.upper(value, places=2)  # an ε's mean and spread, rounded up

    for row in rows:
        name = row["algorithm"] + (
            " (non-private baseline)"
            if row["baseline"]
            else " (non-private)"
            if row["algorithm"] == "fedavg"
            else ""
        )
        seeds = str(row["seeds"])
        if row.get("budget_stopped"):
            seeds += f" ({row['budget_stopped']} stopped by the budget)"
        repeated = row["seeds"] > 1  # a single seed has no spread to show

        def std(key: str, row: Mapping[str, Any] = row, repeated: bool = repeated) -> Any:
            return row.get(key) if repeated else None

        cells = [
            name,
            *(str(row.get(k, "")) for k in grid_keys),
            seeds,
            pm(row["accuracy_mean"], std("accuracy_std"), accuracy),
        ]
        if personal:
            cells.append(
                pm(
                    row.get("personalised_accuracy_mean"),
                    std("personalised_accuracy_std"),
                    accuracy,
                )
            )
        cells += [
            "inf"
            if row.get(f"epsilon_{u}_unbounded")
            else pm(row.get(f"epsilon_{u}_max", row.get(f"epsilon_{u}_mean")), None, epsilon)
            for u in units
        ]
        if units:
            delta = row.get("delta")
            cells += ["-" if delta is None else f"{delta:g}", str(row.get("adversary") or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Accuracy: mean ± standard deviation over seeds. ε: each run's final ε at the δ and "
        "against the adversary shown, the largest over seeds (the bound every seed's run "
        'meets; "-": not private at that unit; inf: no finite guarantee there in some seed).',
        "Each row's ε is one run's: the runs of a sweep train on the same data, so together "
        "they spend more (a shared ledger, `privacy.ledger`, composes them: its total is "
        "below when the cells wrote to one). Each run's ε against every adversary is in its "
        "cell's summary.json (`epsilon_by_adversary`).",
    ]
    if any(row.get("budget_stopped") for row in rows):
        lines.append(
            "A seed stopped by the budget trained fewer rounds than planned: its final "
            "accuracy and the ε it spent are pooled with the other seeds'."
        )
    return "\n".join(lines) + "\n"
