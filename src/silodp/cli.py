"""The ``silodp`` command line: run experiments, describe data, account privacy."""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from tqdm import tqdm

from silodp.accounting.plan import (
    CalibrationError,
    PrivacyPlan,
    account_plan,
    account_plan_by_adversary,
    calibrate_noise,
)
from silodp.algorithms import ALGORITHMS, AlgorithmConfig, make_algorithm
from silodp.bench.cli import bench_app
from silodp.config import ConfigError, default_config_path, load_config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Cross-silo federated learning with differential privacy at the record, silo or "
    "subject level.",
)


app.add_typer(bench_app, name="bench")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _progress(name: str, rounds: int) -> Any:
    bar = tqdm(total=rounds, desc=f"{name:>15}", unit="round", file=sys.stderr, leave=True)

    def update(row: dict[str, Any]) -> None:
        postfix = {}
        if row.get("test_accuracy") is not None:
            postfix["acc"] = f"{row['test_accuracy']:.3f}"
        for unit, value in row.get("epsilon", {}).items():
            postfix[f"ε_{unit}"] = _fmt(value)
        postfix.update({f"ε_{unit}[{who}]": _fmt(value) for who, unit, value in _differing(row)})
        bar.set_postfix(postfix)
        bar.update(1)
        if row["round"] == rounds:
            bar.close()

    return update


#: how each adversary is named in printed output
WHO = {
    "released": "the released model (outsiders)",
    "server": "the server",
    "silos": "the silos",
}


def _fmt(value: float | None) -> str:
    return "inf" if value is None else format(value, ".3g")


def _differing(record: dict[str, Any]) -> list[tuple[str, str, float | None]]:
    """(adversary, unit, ε) wherever an adversary's ε differs from the headline ε."""
    headline = record.get("epsilon", {})
    out = []
    for who, values in record.get("epsilon_by_adversary", {}).items():
        for unit, value in values.items():
            if value != headline.get(unit):
                out.append((who, unit, value))
    return out


@app.command()
def run(
    config: Annotated[
        Path | None, typer.Argument(help="Experiment TOML; omitted: the built-in demo.")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Results directory.")] = Path("runs/demo"),
    overwrite: Annotated[bool, typer.Option(help="Replace results already in --out.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Run an experiment: train every listed algorithm, write metrics, summaries and plots."""
    from silodp.runner import OutputExistsError, run_experiment

    path = config or default_config_path()
    try:
        cfg = load_config(path)
    except ConfigError as err:
        _fail(str(err))
    logging.basicConfig(level=logging.WARNING)
    typer.echo(f"silodp: running {cfg.name!r} ({', '.join(cfg.algorithms)}) from {path}")
    try:
        summary = run_experiment(
            cfg,
            out,
            overwrite=overwrite,
            progress=None if quiet else _progress,
            log=typer.echo,
        )
    except (OutputExistsError, CalibrationError, ValueError, FileNotFoundError) as err:
        _fail(str(err))
    typer.echo(f"\nresults in {out}/")
    for item in summary["runs"]:
        eps = (
            ", ".join(
                f"{u}={'inf' if v is None else format(v, '.3g')}"
                for u, v in item["epsilon"].items()
            )
            or "not private"
        )
        acc = f"accuracy {item['test_accuracy']:.3f}"
        if item.get("personalised_accuracy") is not None:
            acc = (
                f"personalised accuracy {item['personalised_accuracy']:.3f}, "
                f"global {item['test_accuracy']:.3f}"
            )
        who = item.get("adversary")
        against = (
            ""
            if not who
            else (" against every party" if who == "strongest" else f" against {WHO[who]}")
        )
        typer.echo(
            f"  {item['algorithm']:>15}: {acc}  ε({eps}){against}"
            + (f" at δ={item['delta']:g}" if item["delta"] else "")
        )
        for who, unit, value in _differing(item):
            typer.echo(f"  {'':>15}  against {WHO[who]}: ε({unit}={_fmt(value)})")
        if item.get("noise", {}).get("mode") == "seeded":
            typer.echo(f"  {'':>15}  seeded: not for production")


@app.command()
def describe(
    config: Annotated[Path, typer.Argument(help="Experiment TOML whose [data] to describe.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Describe a config's federated data: records per silo and subject, span, subjects."""
    from silodp.data.build import build_federated_data
    from silodp.data.describe import describe as describe_data
    from silodp.data.describe import format_description

    try:
        cfg = load_config(config)
        data = build_federated_data(cfg.data)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        _fail(str(err))
    info = describe_data(data)
    typer.echo(json.dumps(info, indent=2) if as_json else format_description(info))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@app.command()
def account(
    algorithm: Annotated[str, typer.Option(help=f"One of: {', '.join(ALGORITHMS)}.")],
    delta: Annotated[float, typer.Option(help="δ of the reported ε.")] = 1e-5,
    noise_multiplier: Annotated[
        float | None, typer.Option(help="σ; report the ε it gives.")
    ] = None,
    target_epsilon: Annotated[
        float | None, typer.Option(help="ε to reach; report the σ it needs.")
    ] = None,
    sample_rate: Annotated[
        float,
        typer.Option(
            help="Per-step Poisson sampling rate q (records; subjects with --sampling subject)."
        ),
    ] = 1.0,
    steps: Annotated[int, typer.Option(help="Local steps per round T.")] = 1,
    rounds: Annotated[int, typer.Option(help="Rounds R.")] = 1,
    silos: Annotated[int, typer.Option(help="Silos S.")] = 1,
    silos_per_round: Annotated[
        int | None, typer.Option(help="Silos taking part per round (default S).")
    ] = None,
    span: Annotated[
        int | None, typer.Option(help="Silos one subject may span (default S).")
    ] = None,
    group_size: Annotated[
        int, typer.Option(help="Bound k on one subject's records in one silo.")
    ] = 1,
    sampling: Annotated[str, typer.Option(help="higradavg_dp: record or subject.")] = "record",
    subject_sampler: Annotated[
        str,
        typer.Option(
            help="ULDP with --sample-rate < 1 (the subject rate): who draws the subject sample, "
            "silos (hidden from the server) or server."
        ),
    ] = "silos",
    weighting: Annotated[
        str,
        typer.Option(
            help="uldp_avg_w: protocol (the silos do not learn a server-drawn sample) or clear."
        ),
    ] = "protocol",
    adversary: Annotated[
        str,
        typer.Option(
            help="Whom the headline ε (and --target-epsilon) holds against: strongest, "
            "released, server or silos."
        ),
    ] = "strongest",
    unit: Annotated[
        str | None,
        typer.Option(help="Unit of --target-epsilon (default: the algorithm's calibration unit)."),
    ] = None,
    clients: Annotated[
        int | None,
        typer.Option(help="prifedsync: clients m (default --silos), each at --sample-rate B/n."),
    ] = None,
    client_rate: Annotated[
        float, typer.Option(help="prifedsync: Poisson sampling rate p of clients per round.")
    ] = 1.0,
    batch_sampling: Annotated[
        str,
        typer.Option(help="prifedsync: uniform (fixed-size batches, as trained) or poisson."),
    ] = "uniform",
    per_round: Annotated[bool, typer.Option(help="Also list ε after every round.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """What ε does a plan spend (--noise-multiplier), or what σ reaches an ε (--target-epsilon)?

    --steps is the number of local steps per round (K for prifedsync) and --rounds the number of
    rounds R, so a client runs steps × rounds steps in all. For prifedsync, --sample-rate is
    B/n of every client and ε is record-level (f-DP accounting; CLT μ values are estimates).
    """
    if (noise_multiplier is None) == (target_epsilon is None):
        _fail("Expected exactly one of --noise-multiplier and --target-epsilon.")
    if algorithm == "prifedsync":
        _account_prifedsync(
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            sample_rate=sample_rate,
            steps=steps,
            rounds=rounds,
            clients=clients if clients is not None else silos,
            client_rate=client_rate,
            batch_sampling=batch_sampling,
            delta=delta,
            per_round=per_round,
            as_json=as_json,
        )
        return
    try:
        config = AlgorithmConfig(
            local_steps=steps,
            batch_size=1,
            noise_multiplier=noise_multiplier or 0.0,
            group_size=group_size,
            sampling=sampling,
            subject_sampler=subject_sampler,
            weighting=weighting,
            num_silos=silos,
        )
        probe = make_algorithm(algorithm, config)
        plan = PrivacyPlan(
            sampling_rates=(sample_rate,) * silos,
            rounds=rounds,
            silos_per_round=silos_per_round or silos,
            span=span or silos,
            delta=delta,
            adversary=adversary,
        )
        if probe.calibration_unit is None:
            _fail(f"Algorithm {algorithm!r} is not differentially private; it has no ε.")
        method = "given"
        if target_epsilon is not None:
            noise_multiplier = calibrate_noise(
                algorithm, config, plan, target_epsilon=target_epsilon, unit=unit
            )
            method = "calibrated"
        assert noise_multiplier is not None
        algo = make_algorithm(algorithm, replace(config, noise_multiplier=noise_multiplier))
        curve = account_plan(algo, plan, per_round=True)
        by_adversary = account_plan_by_adversary(algo, plan)
    except (ValueError, CalibrationError) as err:
        _fail(str(err))
    # the headline comes from the same composition as the per-adversary values
    final = (
        {
            u: max((by[u] for by in by_adversary.values()), key=lambda e: e.epsilon)
            for u in curve[-1]
        }
        if adversary == "strongest"
        else by_adversary[adversary]
    )
    result: dict[str, Any] = {
        "algorithm": algorithm,
        "epsilon": {u: _finite(e.epsilon) for u, e in final.items()},
        "adversary": adversary,
        "epsilon_by_adversary": {
            who: {u: _finite(e.epsilon) for u, e in estimates.items()}
            for who, estimates in by_adversary.items()
        },
        "noise_multiplier": noise_multiplier,
        "noise_multiplier_source": method,
        "delta": delta,
        "method": {u: e.route for u, e in final.items()},
        "routes": {u: {k: _finite(v) for k, v in e.routes.items()} for u, e in final.items()},
        "epsilon_route": {u: e.route for u, e in final.items()},
        "plan": {
            "sample_rate": sample_rate,
            "steps": steps,
            "rounds": rounds,
            "silos": silos,
            "silos_per_round": plan.silos_per_round,
            "span": plan.span,
            "group_size": group_size,
            "sampling": sampling,
            "subject_sampler": subject_sampler,
            "weighting": weighting,
        },
        "threat_model": probe.threat_model,
    }
    mu = _mu(algo, plan)
    if mu:
        result["mu"] = mu
    if per_round:
        result["per_round"] = [{u: _finite(e.epsilon) for u, e in row.items()} for row in curve]
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"{algorithm}: σ = {noise_multiplier:.6g} ({method}), δ = {delta:g}, ε against {adversary}"
    )
    for u, e in final.items():
        typer.echo(
            f"  {u:>8}: ε = {e.epsilon:.4f}  via {e.route}  "
            f"(routes: {', '.join(f'{k}={v:.4g}' for k, v in e.routes.items())})"
        )
    for who, u, value in _differing(result):
        typer.echo(f"  {u:>8}: ε = {_fmt(value)} against {WHO[who]}")
    for u, m in (mu or {}).items():
        typer.echo(f"  {u:>8}: μ = {m:.4f} (Gaussian DP)")
    typer.echo(f"  threat model: {probe.threat_model}")


def _account_prifedsync(
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    sample_rate: float,
    steps: int,
    rounds: int,
    clients: int,
    client_rate: float,
    batch_sampling: str,
    delta: float,
    per_round: bool,
    as_json: bool,
) -> None:
    """The ``account`` command for PriFedSync (f-DP accounting, ``silodp.accounting.fdp``)."""
    from silodp.accounting.fdp import (
        THREAT_MODEL,
        PriFedSyncPlan,
        account_prifedsync,
        calibrate_prifedsync,
    )

    try:
        if clients < 1:
            raise ValueError(f"Expected clients={clients!r} to be an integer in [1, inf].")
        plan = PriFedSyncPlan(
            noise_multiplier=noise_multiplier if noise_multiplier is not None else 1.0,
            sample_rates=(sample_rate,) * clients,
            local_steps=steps,
            rounds=rounds,
            client_rate=client_rate,
            delta=delta,
            batch_sampling=batch_sampling,
        )
        method = "given"
        if target_epsilon is not None:
            sigma = calibrate_prifedsync(plan, target_epsilon=target_epsilon)
            plan = replace(plan, noise_multiplier=sigma)
            method = "calibrated"
        reports = account_prifedsync(plan, per_round=per_round)
    except ValueError as err:
        _fail(str(err))
    final = reports[-1]
    result: dict[str, Any] = {
        "algorithm": "prifedsync",
        "noise_multiplier": plan.noise_multiplier,
        "noise_multiplier_source": method,
        "delta": delta,
        "mu": final.mu,
        "epsilon": {k: _finite(v) for k, v in final.epsilon.items()},
        "epsilon_route": final.epsilon_route,
        "method": final.epsilon_route["record"],
        "estimates": {k: _finite(v) for k, v in final.estimates.items()},
        "plan": {
            "sample_rate": sample_rate,
            "steps": steps,
            "rounds": rounds,
            "clients": clients,
            "client_rate": client_rate,
            "batch_sampling": batch_sampling,
        },
        "threat_model": THREAT_MODEL,
    }
    if per_round:
        result["per_round"] = [
            {
                "round": r.round,
                "mu": r.mu,
                "epsilon": {k: _finite(v) for k, v in r.epsilon.items()},
                "estimates": {k: _finite(v) for k, v in r.estimates.items()},
            }
            for r in reports
        ]
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(
        f"prifedsync: σ = {plan.noise_multiplier:.6g} ({method}), δ = {delta:g}, "
        f"m = {clients}, p = {client_rate:g}, K = {steps}, R = {rounds}"
    )
    for key, eps in final.epsilon.items():
        typer.echo(f"  {key:>20}: ε = {eps:.4f}  via {final.epsilon_route[key]}  (guarantee)")
    for key, eps in final.estimates.items():
        typer.echo(f"  {key:>20}: ε ≈ {eps:.4f}  (CLT estimate, not a guarantee)")
    for key, mu in final.mu.items():
        typer.echo(f"  {key:>20}: μ ≈ {mu:.4f}  (CLT Gaussian DP, estimate)")
    if per_round:
        for r in reports:
            typer.echo(f"  round {r.round:>4}: ε(record) = {r.epsilon['record']:.4f}")
    typer.echo(f"  threat model: {THREAT_MODEL}")


def _mu(algorithm: Any, plan: PrivacyPlan) -> dict[str, float]:
    from silodp.accounting import FederatedAccountant

    acc = FederatedAccountant(
        units=algorithm.units, span=plan.span, delta=plan.delta, routes=("rdp",)
    )
    events = [algorithm.silo_privacy(sampling_rate=r) for r in plan.sampling_rates]
    acc.compose_round(
        [e for e in events if e is not None], count=plan.rounds, participants=plan.silos_per_round
    )
    return acc.mu()


def main() -> None:  # pragma: no cover - console entry point
    app()
