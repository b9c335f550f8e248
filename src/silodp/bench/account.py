"""``silodp bench account``: time to calibrate σ, and per-round cost of the accountant.

Calibration: the smallest σ meeting a target ε, with the fast RDP routes only (``rdp``,
``rdp-group``: the same bisection as the first phase of
:func:`~silodp.algorithms.planning.calibrate`) and with every route
(:func:`~silodp.algorithms.planning.calibrate` itself: RDP bisection, then a bisection on
every route including PLD). One ε evaluation of the plan on each route alone is timed too.

Per round: a :class:`~silodp.accounting.FederatedAccountant` (all routes) has already
composed N rounds (one ``compose_round(count=N)`` call); then ``compose_round`` +
``estimates`` for one more round is timed (median of a few), at N = 10, 100, 1000, with the
composed PLD's support bounded (the default ``pld_points``) and with its full support
(``pld_points=None``, the accountant before the bound), interleaved; ``growth`` is the time
after N rounds over the time after 10 for each.

Shipped configs: every private algorithm of every ``configs/*.toml`` whose data is present is
planned as a run plans it (:func:`~silodp.experiment.prepare.prepare_run`) and the seconds of
its σ calibration are reported against the 5 s target.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from silodp.bench.common import Row

__all__ = [
    "CALIBRATIONS",
    "CALIBRATION_COLUMNS",
    "CONFIG_COLUMNS",
    "CONFIG_TARGET_S",
    "ROUND_COLUMNS",
    "Calibration",
    "calibration_rows",
    "config_rows",
    "round_rows",
    "run_account_bench",
]

CALIBRATION_COLUMNS = (
    "algorithm",
    "unit",
    "sigma_rdp",
    "rdp_s",
    "sigma_all",
    "all_s",
    "pld_phase_s",
    "pld_evals",
    "pld_eval_s",
    "rdp_eval_s",
    "epsilon_at_sigma_all",
    "route",
)
ROUND_COLUMNS = (
    "algorithm",
    "units",
    "sigma",
    "rounds_composed",
    "round_s",
    "growth",
    "round_s_full",
    "growth_full",
    "epsilon",
    "epsilon_full",
    "route",
)
CONFIG_COLUMNS = ("config", "algorithm", "unit", "sigma", "calibrate_s", "target_s", "met", "note")
#: the target for calibrating σ of a shipped config, in seconds
CONFIG_TARGET_S = 5.0

FAST_ROUTES = ("rdp", "rdp-group")
ALL_ROUTES = ("pld", "rdp", "rdp-group", "dp-group")


@dataclass(frozen=True)
class Calibration:
    """One algorithm calibrated at one unit (``label`` names the row)."""

    label: str
    algorithm: str
    unit: str
    group_size: int = 1


CALIBRATIONS = (
    Calibration("local_item_dp", "local_item_dp", "record"),
    Calibration("local_group_dp (k=4)", "local_group_dp", "subject", group_size=4),
    Calibration("higradavg_dp (k=4)", "higradavg_dp", "subject", group_size=4),
    Calibration("user_ldp", "user_ldp", "subject"),
    Calibration("uldp_avg", "uldp_avg", "subject"),
)

#: The public plan every calibration uses: 5 silos, their sizes and subjects per silo.
SILO_RECORDS = (300, 280, 260, 320, 290)
SILO_SUBJECTS = (100, 100, 100, 100, 100)


def _plan(
    calibration: Calibration, *, rounds: int, batch_size: int, local_steps: int, delta: float
) -> tuple[Any, Any]:
    from silodp.accounting.plan import PrivacyPlan
    from silodp.algorithms import make_algorithm

    probe = make_algorithm(
        calibration.algorithm,
        {
            "local_steps": local_steps,
            "batch_size": batch_size,
            "group_size": calibration.group_size,
            "num_silos": len(SILO_RECORDS),
        },
    )
    config = probe.config
    rates = tuple(
        probe.sampling_rate(num_records=n, num_subjects=m)
        for n, m in zip(SILO_RECORDS, SILO_SUBJECTS, strict=True)
    )
    plan = PrivacyPlan(
        sampling_rates=rates,
        rounds=rounds,
        silos_per_round=len(rates),
        span=len(rates),
        delta=delta,
    )
    return config, plan


def _epsilon(
    calibration: Calibration, config: Any, plan: Any, sigma: float, routes: Sequence[str]
) -> tuple[float, str]:
    from silodp.accounting.plan import CALIBRATION_DISCRETIZATION
    from silodp.algorithms import make_algorithm
    from silodp.algorithms.planning import account_plan

    algorithm = make_algorithm(calibration.algorithm, replace(config, noise_multiplier=sigma))
    est = account_plan(
        algorithm,
        plan,
        units=(calibration.unit,),
        routes=routes,
        discretization=CALIBRATION_DISCRETIZATION,
    )[-1][calibration.unit]
    return est.epsilon, est.route


def calibrate_rdp(
    calibration: Calibration, config: Any, plan: Any, target: float, rel_tol: float = 1e-2
) -> tuple[float, int]:
    """σ on the fast RDP routes only (the first phase of calibration); (σ, ε evaluations)."""
    from silodp.accounting import find_sigma

    calls = 0

    def eps(sigma: float) -> float:
        nonlocal calls
        calls += 1
        return _epsilon(calibration, config, plan, sigma, FAST_ROUTES)[0]

    return find_sigma(eps, target, rel_tol=rel_tol), calls


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    _clear_caches()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _clear_caches() -> None:
    """Empties silodp's per-event RDP and PLD caches so no timing reuses another's work."""
    from silodp.accounting import conversions, pld

    for module, name in ((conversions, "_default_curve"), (pld, "event_pld")):
        cached = getattr(module, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


@contextmanager
def _phases() -> Iterator[dict[str, list[float]]]:
    """Times every accounting made by calibration, split by whether the accountant computes
    the PLD route (``pld``) or only the RDP ones (``rdp``)."""
    from silodp.accounting import calibrate as calibrate_module

    original = calibrate_module.account_events
    spent: dict[str, list[float]] = {"rdp": [], "pld": []}

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            routes = getattr(args[0], "routes", ALL_ROUTES)
            spent["pld" if "pld" in routes else "rdp"].append(time.perf_counter() - start)

    calibrate_module.account_events = timed  # type: ignore[assignment]
    try:
        yield spent
    finally:
        calibrate_module.account_events = original  # type: ignore[assignment]


def calibration_rows(
    *,
    target_epsilon: float = 4.0,
    delta: float = 1e-5,
    rounds: int = 20,
    batch_size: int = 16,
    local_steps: int = 10,
    calibrations: Sequence[Calibration] = CALIBRATIONS,
) -> list[Row]:
    """One row per calibration: σ and seconds with RDP routes only and with all routes."""
    from silodp.algorithms import make_algorithm
    from silodp.algorithms.planning import calibrate

    rows: list[Row] = []
    for cal in calibrations:
        config, plan = _plan(
            cal, rounds=rounds, batch_size=batch_size, local_steps=local_steps, delta=delta
        )
        (sigma_rdp, evals), rdp_s = _timed(
            partial(calibrate_rdp, cal, config, plan, target_epsilon)
        )
        with _phases() as spent:
            sigma_all, all_s = _timed(
                partial(
                    calibrate,
                    make_algorithm(cal.algorithm, config),
                    plan,
                    target_epsilon=target_epsilon,
                    unit=cal.unit,
                )
            )
        (eps_all, route), _ = _timed(partial(_epsilon, cal, config, plan, sigma_all, ALL_ROUTES))
        _, rdp_eval_s = _timed(partial(_epsilon, cal, config, plan, sigma_all, FAST_ROUTES))
        (eps_pld, _), pld_eval_s = _timed(partial(_epsilon, cal, config, plan, sigma_all, ("pld",)))
        rows.append(
            {
                "algorithm": cal.label,
                "unit": cal.unit,
                "target_epsilon": target_epsilon,
                "delta": delta,
                "rounds": rounds,
                "sigma_rdp": sigma_rdp,
                "rdp_s": rdp_s,
                "rdp_evals": evals,
                "sigma_all": sigma_all,
                "all_s": all_s,
                "all_rdp_phase_s": sum(spent["rdp"]),
                "pld_phase_s": sum(spent["pld"]),
                "pld_evals": len(spent["pld"]),
                "epsilon_at_sigma_all": eps_all,
                "route": route,
                "rdp_eval_s": rdp_eval_s,
                "pld_eval_s": pld_eval_s,
                "pld_epsilon": eps_pld,
                "sigma_saved": 1.0 - sigma_all / sigma_rdp if sigma_rdp else None,
            }
        )
    return rows


def round_rows(
    *,
    checkpoints: Sequence[int] = (10, 100, 1000),
    samples: int = 5,
    delta: float = 1e-5,
    sigmas: dict[str, float] | None = None,
    batch_size: int = 16,
    local_steps: int = 10,
    calibrations: Sequence[Calibration] = CALIBRATIONS,
) -> list[Row]:
    """Per calibration and checkpoint N: median seconds of ``compose_round`` + ``estimates``
    for one round after N rounds are composed (all routes), at σ ``sigmas[label]`` (default
    1.0; the benchmark passes the calibrated σ); ``*_full``: the same with the composed PLD's
    full support (``pld_points=None``), timed interleaved with it."""
    from silodp.accounting import FederatedAccountant
    from silodp.accounting.accountant import COMPOSED_PLD_POINTS
    from silodp.algorithms import make_algorithm

    rows: list[Row] = []
    for cal in calibrations:
        config, plan = _plan(
            cal, rounds=1, batch_size=batch_size, local_steps=local_steps, delta=delta
        )
        sigma = (sigmas or {}).get(cal.label, 1.0)
        algorithm = make_algorithm(cal.algorithm, replace(config, noise_multiplier=sigma))
        events = [algorithm.silo_privacy(sampling_rate=q) for q in plan.sampling_rates]
        silos = [s for s in events if s is not None]
        for n in checkpoints:
            accountants = {
                name: FederatedAccountant(
                    units=algorithm.units, span=plan.span, delta=delta, pld_points=points
                )
                for name, points in (("bounded", COMPOSED_PLD_POINTS), ("full", None))
            }
            ff_s = {
                name: _timed(partial(acc.compose_round, silos, count=n))[1]
                for name, acc in accountants.items()
            }
            times: dict[str, list[float]] = {name: [] for name in accountants}
            estimates: dict[str, dict[str, Any]] = {}
            for _ in range(samples):
                for name, accountant in accountants.items():  # interleaved
                    start = time.perf_counter()
                    accountant.compose_round(silos)
                    estimates[name] = accountant.estimates()
                    times[name].append(time.perf_counter() - start)
            est = estimates["bounded"].get(cal.unit)
            est_full = estimates["full"].get(cal.unit)
            median = {name: statistics.median(t) for name, t in times.items()}
            first = next((r for r in rows if r["algorithm"] == cal.label), None)
            rows.append(
                {
                    "algorithm": cal.label,
                    "units": ",".join(algorithm.units),
                    "sigma": sigma,
                    "rounds_composed": n,
                    "round_s": median["bounded"],
                    "round_s_min": min(times["bounded"]),
                    "growth": median["bounded"]
                    / (first["round_s"] if first else median["bounded"]),
                    "round_s_full": median["full"],
                    "growth_full": median["full"]
                    / (first["round_s_full"] if first else median["full"]),
                    "fast_forward_s": ff_s["bounded"],
                    "fast_forward_s_full": ff_s["full"],
                    "epsilon": None if est is None else est.epsilon,
                    "epsilon_full": None if est_full is None else est_full.epsilon,
                    "route": None if est is None else est.route,
                    "samples": samples,
                }
            )
    return rows


def config_rows(config_dir: str | Path = "configs") -> list[Row]:
    """One row per private algorithm of each ``config_dir/*.toml``: σ and the seconds its
    calibration took (as a run plans it, per-event caches cleared first), against
    :data:`CONFIG_TARGET_S`. A config whose data is missing gets one row saying so."""
    from silodp.config import load_config
    from silodp.data.build import build_federated_data
    from silodp.experiment.prepare import dp_scaling, prepare_run

    rows: list[Row] = []
    for path in sorted(Path(config_dir).glob("*.toml")):
        try:
            config = load_config(path)
            data = build_federated_data(config.data)
            releases: tuple[Any, ...] = ()
            if config.data.scaling == "dp":
                data, releases, _ = dp_scaling(config, data)
        except Exception as err:  # noqa: BLE001 - a config the host cannot load is reported
            rows.append({"config": path.name, "note": f"not run: {type(err).__name__}"})
            continue
        for name in config.algorithms:
            _clear_caches()
            run = prepare_run(name, config, data, releases=releases)
            seconds = run.calibration.get("seconds")
            if seconds is None:
                continue  # not private, or σ given
            rows.append(
                {
                    "config": path.name,
                    "algorithm": name,
                    "unit": run.calibration.get("unit"),
                    "sigma": run.noise_multiplier,
                    "calibrate_s": seconds,
                    "target_s": CONFIG_TARGET_S,
                    "met": seconds < CONFIG_TARGET_S,
                    "note": "",
                }
            )
    return rows


def run_account_bench(
    *, threads: int = 1, quick: bool = False, samples: int = 5, configs: bool = True
) -> tuple[list[Row], list[Row], list[Row]]:
    """(calibration rows, per-round rows, shipped-config rows; the last empty without
    ``configs`` or with ``quick``)."""
    from silodp.bench.common import set_threads

    set_threads(threads)
    calibrations = CALIBRATIONS[:2] if quick else CALIBRATIONS
    checkpoints = (10, 100) if quick else (10, 100, 1000)
    calibrated = calibration_rows(calibrations=calibrations)
    sigmas = {row["algorithm"]: row["sigma_all"] for row in calibrated}
    per_round = round_rows(
        checkpoints=checkpoints, samples=samples, calibrations=calibrations, sigmas=sigmas
    )
    shipped = config_rows() if configs and not quick else []
    return calibrated, per_round, shipped
