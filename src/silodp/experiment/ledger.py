"""Opening a run's privacy ledger: where it lives, its budget, and the plan checked against it
before the first round (and, read only, before an experiment writes anything)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dp_accounting import dp_event

from silodp.accounting import UNITS, FederatedAccountant, SiloPrivacy
from silodp.accounting.fdp import FdpAccountant
from silodp.accounting.interface import Accountant
from silodp.experiment.prepare import PreparedRun
from silodp.io import check_writable_dir, write_json
from silodp.ledger import Ledger, LedgerError, RunLedger
from silodp.ledger.report import verify_ledger
from silodp.ledger.run import (
    accounted_units,
    check_accounted,
    check_budget,
    check_declarable,
    check_one_kind,
    held_to,
    total_before,
)
from silodp.ledger.store import check_free, is_blank_ledger, merge_declared

__all__ = [
    "LEDGER_FILE",
    "budget_of",
    "check_plans_fit",
    "check_shared_ledger",
    "describe_shared_ledger",
    "open_no_noise_ledger",
    "open_run_ledger",
    "set_aside_ledger",
    "set_aside_replaced_ledger",
]

logger = logging.getLogger(__name__)

#: a run's own ledger, in its directory, unless ``privacy.ledger`` names a shared one
LEDGER_FILE = "ledger.sqlite"


def budget_of(run: PreparedRun) -> dict[str, float]:
    """``privacy.budget`` (its units the run accounts), else, on the run's own ledger, the
    target ε at the calibration unit of a calibrated run. On a shared ledger only a declared
    budget binds the total: a target is what the run itself spends (calibration meets it),
    not a cap on what others spent."""
    own = run.accounted_budget()
    if own:
        return own
    if run.privacy.ledger is not None:
        return {}
    if run.calibration.get("method") == "calibrated" and run.algorithm.calibration_unit:
        return {run.algorithm.calibration_unit: float(run.calibration["target_epsilon"])}
    return {}


def _noise_id(run: PreparedRun) -> dict[str, Any]:
    """Where the coins came from, with an id of the seed material (never the seed itself);
    ``none`` for a run without noise."""
    if run.plan is None:
        return {"mode": "none"}
    if run.privacy.noise == "seeded":  # of the run's coin seed: one per seed and settings
        digest = hashlib.sha256(f"silodp-seed:{run.coin_seed}".encode()).hexdigest()
        return {"mode": "seeded", "seed_id": digest[:16]}
    return {"mode": "secure", "seed_id": "os-csprng"}


def _path(run: PreparedRun, run_dir: Path) -> Path:
    return Path(run.privacy.ledger) if run.privacy.ledger else run_dir / LEDGER_FILE


def resume_run_ledger(
    run: PreparedRun,
    run_dir: Path,
    accountant: Accountant,
    config_hash: str,
    completed: int = 0,
) -> RunLedger | None:
    """The ledger entry of ``run`` left unfinished, reopened with ``accountant`` composing all
    it recorded (``None``: the run never registered, e.g. it was killed while calibrating).
    ``completed``: the rounds its checkpoint holds. The ledger is verified first
    (:func:`~silodp.ledger.report.verify_ledger`): a resumed run composes what it holds.

    Raises:
      LedgerError: the ledger is missing, unsound, edited, or lacks rounds the checkpoint
        holds (resuming would count less than was spent).
    """
    path = _path(run, run_dir)
    registered = _registration(run_dir, path, shared=run.privacy.ledger is not None)
    # missing, empty, or stopped while its schema was created: it holds no spending, unless
    # the run registered (in this ledger, or in one it was moved with: its rows may be lost)
    blank = is_blank_ledger(path) and not (run_dir / REGISTRATION_FILE).exists()
    if not path.is_file() or path.stat().st_size == 0 or blank:
        if completed or registered is not None:
            held = (
                f"whose checkpoint holds {completed} round(s)"
                if completed
                else f"which registered there as run {registered} ({REGISTRATION_FILE}) and "
                "may have recorded spending before its first checkpoint"
            )
            raise LedgerError(
                f"Expected the ledger {str(path)!r} of run {run.name!r}, {held}; it is "
                "missing, empty or holds no tables, so what the run spent would go uncounted. "
                "Restore it (with its -wal file), or start the run afresh (--overwrite)."
            )
        return None
    if registered is None and completed == 0 and run.privacy.ledger is not None:
        # on a shared ledger, a run that never registered recorded nothing: a run of the same
        # config there is another directory's
        return None
    problems = verify_ledger(path)
    if problems:
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        raise LedgerError(
            f"Expected the ledger {str(path)!r} to verify before run {run.name!r} resumes on "
            f"it; {len(problems)} problem(s): {shown}. Restore the ledger the run wrote, or "
            "start the run afresh (--overwrite)."
        )
    return RunLedger.resume(
        Ledger(path),
        name=run.name,
        config_hash=config_hash,
        accountant=accountant,
        budget=budget_of(run),
        completed=completed,
        run_id=registered,
    )


#: in a run's directory: which run of its ledger it is (a shared ledger may hold the same
#: config run into other directories), written when the run registers
REGISTRATION_FILE = "ledger_run.json"


def _registration(run_dir: Path, path: Path, *, shared: bool) -> int | None:
    """The id under which the run in ``run_dir`` registered in the ledger at ``path``.

    Raises:
      LedgerError: ``shared`` and the run registered in another ledger file (e.g. a relative
        path read from another working directory): resuming on this one would leave what it
        spent there out of this one's budget.
    """
    try:
        found = json.loads((run_dir / REGISTRATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict):
        return None
    if found.get("ledger") != str(path.resolve()):
        other = found.get("ledger")
        if shared and isinstance(other, str):
            raise LedgerError(
                f"Expected run {run_dir.name!r} to resume on the shared ledger it registered "
                f"in, {other!r} ({REGISTRATION_FILE}); its config names "
                f"{str(path.resolve())!r}. Resume it where that path names the same file, or "
                "restore the ledger there."
            )
        return None  # a run directory moved with its own ledger
    run_id = found.get("run_id")
    return run_id if isinstance(run_id, int) and not isinstance(run_id, bool) else None


def _existing(path: str | None) -> Path | None:
    """The shared ledger file at ``path`` if it holds anything (an empty file, like a missing
    one, becomes a new ledger when a run opens it)."""
    if path is None:
        return None
    where = Path(path)
    if where.is_file() and where.stat().st_size == 0:
        return None
    return where if where.exists() or where.is_symlink() else None


def check_shared_ledger(path: str | None) -> None:
    """Checks, read only and before an experiment writes anything, that the shared ledger
    ``privacy.ledger`` (``--ledger``) is a silodp ledger a run can write to, or can be created.

    Raises:
      LedgerError: the file is not a ledger this silodp can use, or cannot be written.
      InvalidValueError: its directory cannot be written (or made).
    """
    if path is None:
        return
    where = Path(path)
    check_writable_dir(where.parent, name="the directory of privacy.ledger")
    existing = _existing(path)
    if existing is None:
        return
    check_free(existing)  # another run writing to it: refused before anything loads
    with Ledger(existing, read_only=True):  # refuses a directory, another database, ...
        pass
    if not os.access(existing, os.R_OK | os.W_OK):
        raise LedgerError(
            f"Expected the ledger {str(existing)!r} to be writable by this user; it is not."
        )


def describe_shared_ledger(path: str) -> str:
    """One line naming the shared ledger a run will write (absolute: a relative path is read
    from the working directory), and what it holds: new, or its runs and declared budget."""
    where = Path(path).resolve()
    existing = _existing(path)
    if existing is None:
        return f"shared ledger: {where} (new: nothing spent on it yet)"
    with Ledger(existing, read_only=True) as ledger:
        runs, budget = len(ledger.runs()), ledger.budget()
    declared = ", ".join(f"{u} ε ≤ {b['epsilon']:g}" for u, b in budget.items())
    return f"shared ledger: {where} ({runs} earlier run(s)" + (
        f"; declared budget {declared})" if declared else ")"
    )


def check_plans_fit(runs: Sequence[PreparedRun]) -> None:
    """Checks each run's whole plan against its budget, read only and before an experiment
    writes anything, as :func:`open_run_ledger` does when the run registers: an experiment
    refused by a budget is refused before it writes anything.

    A run's own ledger is new (an earlier one is set aside), so only a shared ledger has
    spending to count: what it holds, its declared budget (:func:`ledger_budget`), and the
    plans of the runs before this one in ``runs`` that write to it (the algorithms of one
    experiment, or the cells of one sweep, run one after another).

    Raises:
      BudgetExceededError: a plan, composed onto what the ledger holds and the plans before
        it, exceeds its budget.
      LedgerError: the shared ledger cannot be read, or a budget cannot be held on it.
    """
    before: dict[str, list[PreparedRun]] = {}
    #: per shared ledger: its declared budget, with what the runs before will declare
    declared: dict[str, dict[str, dict[str, Any]]] = {}
    #: per shared ledger: the accounting kinds of its runs and of the runs before
    kinds: dict[str, set[str]] = {}
    #: per shared ledger: the units each of its runs, and each run before, accounts
    accounted: dict[str, dict[str, Sequence[str] | None]] = {}
    for run in runs:
        if run.plan is None and run.privacy.ledger is None:
            continue  # no noise, no ledger of its own
        accountant = accountant_of(run)
        spec = accountant.spec()
        budget = budget_of(run)
        total: Accountant = accountant
        spent: dict[str, float] = {}
        shared = run.privacy.ledger
        existing = _existing(shared)
        key = str(Path(shared).resolve()) if shared is not None else ""
        if existing is not None:
            with Ledger(existing, read_only=True) as ledger:
                declared.setdefault(key, ledger.budget())
                kinds.setdefault(key, {r.accountant.get("kind", "?") for r in ledger.runs()})
                accounted.setdefault(key, accounted_units(ledger))
                total, held = total_before(ledger, accountant)
            if held:
                spent = {unit: est.epsilon for unit, est in total.estimates().items()}
        sources = _budget_sources(run, budget, declared.get(key, {}) if shared else {})
        if shared is not None:
            where = repr(shared)
            budget = held_to(budget, declared.get(key, {}), accountant, where=where)
            check_one_kind(kinds.get(key, set()), spec["kind"], budget, where=where)
            kinds.setdefault(key, set()).add(spec["kind"])
            check_accounted(budget, accounted.get(key, {}), where=where)
            accounted.setdefault(key, {})[f"{run.name} (planned)"] = spec.get("units")
            planned = before.setdefault(key, [])
            # the experiment's earlier runs of this accounting kind, as a total replays them
            same_kind = [r for r in planned if accountant_of(r).spec()["kind"] == spec["kind"]]
            if same_kind:
                total = copy.deepcopy(total)
                for earlier in same_kind:
                    _compose_plan(earlier, total)
                spent = {unit: est.epsilon for unit, est in total.estimates().items()}
            planned.append(run)
            if run.privacy.budget:  # what this run will declare binds the runs after it
                check_declarable(run.privacy.budget, accountant, where=where)
                declared[key] = merge_declared(
                    declared.get(key, {}),
                    run.privacy.budget,
                    float(spec["delta"]),
                    str(spec.get("target", "strongest")),
                    where=where,
                )
        would_be: dict[str, float] | None = None
        if shared is not None or budget:
            try:  # on a shared ledger, the plans must compose even without a budget
                would_be = _plan_epsilon(run, total)
            except ValueError as err:
                raise LedgerError(
                    f"Expected the plan of {run.name} to compose with the runs before it on the "
                    f"shared ledger {shared!r}: {err} Give it its own ledger."
                ) from None
        if budget and would_be is not None:
            what = f"whole plan of {run.name}"
            if any(math.isinf(v) for v in spent.values()):
                what += (
                    " (the ledger's total is already inf: a run without noise, such as fedavg, "
                    "released a model of its data; in a sweep, baseline = false leaves it out)"
                )
            if run.plan is None:
                what = (
                    f"release of {run.name}, which trains without noise (leave it out of this "
                    "experiment; in a sweep, set baseline = false),"
                )
            check_budget(budget, spent, would_be, what, sources)


def _budget_sources(
    run: PreparedRun, own: Mapping[str, float], declared: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """Where each unit's budget comes from: a budget declared on the ledger before this run
    (where it is the smaller), the config's ``privacy.budget``, or a calibrated run's target
    ε (``own``: the run's budget without the ledger's)."""
    out = {}
    for unit in {*own, *declared}:
        if unit in declared and float(declared[unit]["epsilon"]) <= own.get(unit, math.inf):
            out[unit] = f"declared on the ledger {run.privacy.ledger!r} by an earlier run"
        elif unit in (run.privacy.budget or {}):
            out[unit] = "privacy.budget"
        else:
            out[unit] = "the run's target ε, as privacy.budget is unset"
    return out


def set_aside_ledger(run_dir: Path) -> Path | None:
    """Renames the run ledger ``run_dir/ledger.sqlite`` (with any ``-wal``/``-shm`` beside it)
    to ``ledger.replaced-<UTC time>.sqlite`` in ``run_dir``; returns the new name (``None``: no
    ledger there)."""
    if not (run_dir / LEDGER_FILE).is_file():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir / f"ledger.replaced-{stamp}.sqlite"
    n = 1
    while target.exists():
        n += 1
        target = run_dir / f"ledger.replaced-{stamp}-{n}.sqlite"
    for suffix in ("-wal", "-shm"):  # a writer stopped without closing leaves these
        side = run_dir / (LEDGER_FILE + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    os.replace(run_dir / LEDGER_FILE, target)
    return target


def set_aside_replaced_ledger(run: PreparedRun, run_dir: Path) -> Path | None:
    """Before a run starts afresh in ``run_dir`` (``--overwrite``, or a run started again
    without ``--resume``), renames the replaced run's own ledger to
    ``ledger.replaced-<UTC time>.sqlite`` beside it and returns the new name.

    The replaced run's spending stays on record there, but does not count against the new
    run's budget: a per-run ledger belongs to the results it is written with. A shared ledger
    (``privacy.ledger``) is never moved: every run on its data counts against its budget.
    """
    if run.privacy.ledger:
        return None
    target = set_aside_ledger(run_dir)
    if target is None:
        return None
    logger.warning(
        "%s: the replaced run's ledger is kept as %s; what it spent does not count against "
        "this run's budget (a shared privacy.ledger counts every run).",
        run.name,
        target,
    )
    return target


def open_run_ledger(
    run: PreparedRun, run_dir: Path, accountant: Accountant, config_hash: str
) -> RunLedger:
    """Registers ``run`` in its ledger after checking its whole plan against the budget.

    Raises:
      BudgetExceededError: the plan, composed onto what the ledger already holds, would exceed
        the budget (nothing is recorded).
      LedgerError: the ledger file cannot be used, or the run would declare a budget on a
        shared ledger at a unit it does not account.
    """
    if run.privacy.ledger is not None and run.privacy.budget:
        check_declarable(run.privacy.budget, accountant, where=repr(run.privacy.ledger))
    ledger = RunLedger(
        Ledger(_path(run, run_dir)),
        name=run.name,
        algorithm=run.algorithm.name,
        accountant=accountant,
        noise=_noise_id(run),
        budget=budget_of(run),
        declared=run.privacy.budget if run.privacy.ledger is not None else run.accounted_budget(),
        config_hash=config_hash,
        plan_check=lambda total: _plan_epsilon(run, total),
    )
    where = _path(run, run_dir).resolve()
    write_json(run_dir / REGISTRATION_FILE, {"ledger": str(where), "run_id": ledger.run_id})
    return ledger


def accountant_of(run: PreparedRun) -> Accountant:
    """The accountant ``run``'s events compose in: its algorithm's; for a run without noise
    on a shared ledger, one of every unit (its release is ε = inf in each)."""
    if run.plan is None:
        return FederatedAccountant(
            units=UNITS, span=run.span, delta=run.privacy.delta, target=run.privacy.adversary
        )
    return run.algorithm.make_accountant(
        span=run.span, delta=run.privacy.delta, target=run.privacy.adversary
    )


def no_noise_release() -> list[SiloPrivacy]:
    """What a run without noise spends on its data: a release with no guarantee for any
    unit, against anyone (the model itself is published without noise)."""
    return [SiloPrivacy(events={u: dp_event.NonPrivateDpEvent() for u in UNITS}, scope="aggregate")]


def open_no_noise_ledger(
    run: PreparedRun, run_dir: Path, config_hash: str, *, resume: bool = False
) -> RunLedger:
    """Records a run without noise (``fedavg``, σ = 0) on its shared ledger: its model spends
    ε = inf on the ledger's data, so every total there reads inf from now on, and a budget
    declared there refuses it (and every later run). Recorded before it trains, as a release.

    Raises:
      BudgetExceededError: the ledger (or the run's config) has a budget.
      LedgerError: the ledger cannot be used.
    """
    assert run.plan is None and run.privacy.ledger is not None
    accountant = accountant_of(run)
    if resume:
        reopened = resume_run_ledger(run, run_dir, accountant, config_hash)
        if reopened is not None:
            if not reopened.has_release:  # stopped between registering and recording it
                # a budget declared there since (by another run) refuses it, as a new run
                reopened.check({u: math.inf for u in reopened.budget}, "release without noise")
                reopened.record_release(no_noise_release())
            return reopened
    ledger = open_run_ledger(run, run_dir, accountant, config_hash)
    ledger.record_release(no_noise_release())
    return ledger


def _compose_plan(run: PreparedRun, total: Accountant) -> None:
    """Composes ``run``'s whole plan onto ``total`` (over the run's own span, and at its own
    client rate for PriFedSync, as a ledger replays it)."""
    own: dict[str, Any] = {"span": run.span} if isinstance(total, FederatedAccountant) else {}
    if isinstance(total, FdpAccountant) and run.plan is not None:
        own = {"client_rate": accountant_of(run).spec()["client_rate"]}
    if run.plan is None:  # no noise: its model is a release without a guarantee
        total.compose_release(no_noise_release(), **own)
        return
    if run.plan.releases:
        total.compose_release(run.plan.releases, **own)
    events = run.algorithm.plan_events(run.plan)
    if events:
        total.compose_round(
            events, count=run.plan.rounds, participants=run.plan.silos_per_round, **own
        )


def _plan_epsilon(run: PreparedRun, total: Accountant) -> dict[str, float]:
    """ε per unit of ``total`` (what the ledger holds) with the run's whole plan composed on."""
    trial = copy.deepcopy(total)
    _compose_plan(run, trial)
    return {unit: est.epsilon for unit, est in trial.estimates().items()}
