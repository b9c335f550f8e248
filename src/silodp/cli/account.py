"""``silodp account``: the ε a plan spends, or the σ that meets a target, for any algorithm.

One report function (:func:`account_report`) builds the answer as data through the same
planning code a run uses; one printer shows it. The options an algorithm's accounting depends
on (``--group-size``, ``--sampling``, ``--client-rate``, ...) are generated from the
algorithms' config dataclasses, so a new algorithm's option appears without touching this file.
"""

from __future__ import annotations

import inspect
import json
import math
import typing
from typing import Annotated, Any

import typer

from silodp import display
from silodp._validation import check_finite, check_in_range, check_int, check_probability
from silodp.accounting import PrivacyPlan
from silodp.accounting.accountant import TARGETS
from silodp.accounting.calibrate import check_target_epsilon
from silodp.accounting.interface import spent
from silodp.accounting.plan import feature_statistics_releases
from silodp.algorithms import ALGORITHMS, make_algorithm
from silodp.algorithms.planning import account_plan, calibrate
from silodp.cli.common import WHO, differing, fail
from silodp.config import MAX_ROUNDS
from silodp.errors import InvalidValueError, SilodpError
from silodp.experiment.record import gaps_clause
from silodp.io import json_number

__all__ = ["MAX_COUNT", "MAX_NOISE_MULTIPLIER", "account", "account_report", "print_report"]

#: the largest count (steps, silos, clients, group size) the command accounts
MAX_COUNT = 10**6
#: the largest σ the command accounts (ε is 0 to every printed digit long before it)
MAX_NOISE_MULTIPLIER = 1e6


def account_report(
    algorithm: str,
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float = 1e-5,
    sample_rate: float = 1.0,
    steps: int = 1,
    rounds: int = 1,
    silos: int = 1,
    silos_per_round: int | None = None,
    span: int | None = None,
    adversary: str = "strongest",
    unit: str | None = None,
    per_round: bool = False,
    settings: dict[str, Any] | None = None,
    require_group_size: bool = False,
    scaling_noise_multiplier: float | None = None,
) -> dict[str, Any]:
    """The privacy of a plan of ``algorithm`` as one JSON-ready mapping: ε per unit (against
    ``adversary`` and against each adversary), the routes, μ where defined, labelled
    estimates, the plan and the threat model.

    Raises:
      SilodpError: exactly one of ``noise_multiplier`` and ``target_epsilon`` is not given, a
        value is out of range, the algorithm is not private or the target is unreachable;
        with ``require_group_size``, the accounting uses the bound k and ``settings`` does not
        give it (the default k = 1 is the best case, which a run with k unset never assumes).
    """
    if (noise_multiplier is None) == (target_epsilon is None):
        raise InvalidValueError("Expected exactly one of --noise-multiplier and --target-epsilon.")
    values = {"local_steps": steps, "batch_size": 1, "num_silos": silos, **(settings or {})}
    probe = make_algorithm(algorithm, {**values, "noise_multiplier": noise_multiplier or 0.0})
    # the DP feature statistics are computed on data capped to --span, whichever algorithm
    statistics_span_cap = span is not None and span < silos
    if span is not None and span < silos:
        if probe.uses_span():
            # a run caps the data to this span: the record and silo units cover it
            values["span_cap"] = span
            probe = make_algorithm(
                algorithm, {**values, "noise_multiplier": noise_multiplier or 0.0}
            )
        else:  # a run caps no span for it: a subject may occupy every silo
            span = silos
    if not probe.private:
        raise InvalidValueError(
            f"Algorithm {algorithm!r} is not differentially private; it has no ε."
        )
    scope = probe.group_bound_scope()
    if require_group_size and scope is not None and "group_size" not in (settings or {}):
        where = "in the whole federation" if scope == "federation" else "in one silo"
        raise InvalidValueError(
            f"Expected --group-size (the public bound k on one subject's records {where}): "
            f"{algorithm}'s ε depends on it, and k = 1 would assume every subject holds one "
            "record. Give the bound the run uses (privacy.group_size; a run without it takes "
            "the data's largest)."
        )
    if unit is not None and unit not in probe.units:
        raise InvalidValueError(
            f"Expected --unit={unit!r} to be one of the units {algorithm!r} protects: "
            f"{', '.join(probe.units)}."
        )
    try:  # a schedule a run would refuse (e.g. ULDP's noise split over every silo)
        silos_per_round = probe.check_schedule(silos_per_round, silos)
    except InvalidValueError as err:
        raise InvalidValueError(
            str(err).replace("training.silos_per_round", "--silos-per-round")
        ) from None
    plan = PrivacyPlan(
        sampling_rates=(sample_rate,) * silos,
        rounds=rounds,
        silos_per_round=silos_per_round,
        span=silos if span is None else span,
        delta=delta,
        adversary=adversary,
        releases=()
        if scaling_noise_multiplier is None
        else feature_statistics_releases(
            scaling_noise_multiplier,
            silos,
            span_cap=statistics_span_cap,
            federation_cap=bool((settings or {}).get("cross_silo_cap")),
        ),
    )
    method = "given"
    if target_epsilon is not None:
        noise_multiplier = calibrate(
            probe,
            plan,
            target_epsilon=target_epsilon,
            unit=unit,
            rel_tol=probe.calibration_tolerance,
        )
        method = "calibrated"
    assert noise_multiplier is not None
    algo = probe.with_noise(noise_multiplier)
    accountant = algo.make_accountant(span=plan.span, delta=delta, target=adversary)
    curve = account_plan(algo, plan, per_round=per_round, accountant_factory=lambda *_: accountant)
    # the headline (against the accountant's target, ``adversary``) and the per-adversary
    # values come from one composed state
    now = spent(accountant)
    final, by_adversary = now.epsilon, now.by_adversary
    by_adversary_json = {
        who: {u: json_number(e.epsilon) for u, e in estimates.items()}
        for who, estimates in by_adversary.items()
    }
    result: dict[str, Any] = {
        "algorithm": algorithm,
        "epsilon": {u: json_number(e.epsilon) for u, e in final.items()},
        "adversary": adversary,
        "epsilon_by_adversary": by_adversary_json,
        "noise_multiplier": noise_multiplier,
        "noise_multiplier_source": method,
        "delta": delta,
        "method": {u: e.route for u, e in final.items()},
        "routes": {u: {k: json_number(v) for k, v in e.routes.items()} for u, e in final.items()},
        "epsilon_route": {u: e.route for u, e in final.items()},
        "plan": {
            "sample_rate": sample_rate,
            "steps": steps,
            "rounds": rounds,
            "silos": silos,
            "clients": silos,
            "silos_per_round": plan.silos_per_round,
            "span": plan.span,
            **(
                {"scaling_noise_multiplier": scaling_noise_multiplier}
                if scaling_noise_multiplier is not None
                else {}
            ),
            **(settings or {}),
            **algo.account_options(),
        },
        "adjacency": algo.adjacency,
        "group_bound": algo.group_bound_scope(),
        "threat_model": algo.threat_model + gaps_clause(by_adversary_json, "in this plan"),
        "notes": algo.accounting_notes(),
    }
    mu = {u: m for u, m in now.mu.items() if math.isfinite(m)}
    if mu:
        result["mu"] = mu
    if now.estimates:
        result["estimates"] = {k: json_number(v) for k, v in now.estimates.items()}
    if now.mu_estimates:
        result["mu_estimates"] = {k: json_number(v) for k, v in now.mu_estimates.items()}
    if per_round:
        result["per_round"] = [
            {"round": r, "epsilon": {u: json_number(e.epsilon) for u, e in row.items()}}
            for r, row in enumerate(curve, start=1)
        ]
    return result


def _sigma(result: dict[str, Any]) -> str:
    """σ to 6 figures; a calibrated one rounded up (copied into a config, it reaches the
    target ε or less)."""
    sigma = result["noise_multiplier"]
    return (
        display.upper(sigma, 6)
        if result["noise_multiplier_source"] == "calibrated"
        else (f"{sigma:.6g}")
    )


def print_report(result: dict[str, Any]) -> None:
    """The report as text: σ, then ε per unit (guarantees), against whom where it differs,
    μ and labelled estimates."""
    plan = result["plan"]
    typer.echo(
        f"{result['algorithm']}: σ = {_sigma(result)} "
        f"({result['noise_multiplier_source']}), δ = {result['delta']:g}, "
        f"S = {plan['silos']}, R = {plan['rounds']}, "
        + (f"k = {plan['group_size']}, " if result.get("group_bound") else "")
        + f"ε against {result['adversary']}"
        + (f", {result['adjacency']} adjacency" if result["adjacency"] == "replace-one" else "")
    )
    per_unit = result["adjacency"] if isinstance(result["adjacency"], dict) else {}
    for u, eps in result["epsilon"].items():
        routes = ", ".join(f"{k}={display.upper(v, 4)}" for k, v in result["routes"][u].items())
        value = display.upper(eps, places=4)
        adjacency = f", {per_unit[u]} adjacency" if u in per_unit else ""
        typer.echo(
            f"  {u:>20}: ε = {value}  via {result['method'][u]}  (guarantee{adjacency}; {routes})"
        )
    for who, unit, other in differing(result):
        typer.echo(f"  {unit:>20}: ε = {display.upper(other, places=4)} against {WHO[who]}")
    for key, eps in result.get("estimates", {}).items():
        value = display.upper(eps, places=4)
        typer.echo(f"  {key:>20}: ε ≈ {value}  (CLT estimate, not a guarantee)")
    for u, m in result.get("mu", {}).items():
        mu = display.upper(m, places=4)
        typer.echo(f"  {u:>20}: μ = {mu} (Gaussian DP, a guarantee)")
    for key, m in result.get("mu_estimates", {}).items():
        mu = "inf" if m is None else display.upper(m, places=4)
        typer.echo(f"  {key:>20}: μ ≈ {mu}  (CLT estimate, not a guarantee)")
    for row in result.get("per_round", []):
        text = ", ".join(f"{u}={display.upper(v, places=4)}" for u, v in row["epsilon"].items())
        typer.echo(f"  round {row['round']:>4}: ε({text})")
    typer.echo(f"  threat model: {result['threat_model']}")
    for note in result["notes"]:
        typer.echo(f"  note: {note}")


def _generated_options() -> dict[str, tuple[type, Any, str]]:
    """``{name: (type, default, help)}`` of every hyperparameter some algorithm's accounting
    depends on (the ``account`` metadata of its config field)."""
    options: dict[str, tuple[type, Any, str]] = {}
    for cls in ALGORITHMS.values():
        for name, f in cls.Config.accounting_fields().items():
            kind = type(f.default)
            options.setdefault(name, (kind, f.default, f.metadata.get("doc", "")))
    return options


def account(  # noqa: PLR0913 - the command's options
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
            help="Per-step sampling rate q of each silo (records; subjects for subject "
            "sampling and ULDP; B/n of every client for prifedsync)."
        ),
    ] = 1.0,
    steps: Annotated[int, typer.Option(help="Local steps per round T (K for prifedsync).")] = 1,
    rounds: Annotated[int, typer.Option(help="Rounds R.")] = 1,
    silos: Annotated[
        int | None,
        typer.Option(help="Silos S (required: the subject-level ε and a silo's depend on it)."),
    ] = None,
    clients: Annotated[
        int | None, typer.Option(help="prifedsync: clients m (an alias of --silos).")
    ] = None,
    silos_per_round: Annotated[
        int | None, typer.Option(help="Silos taking part per round (default S).")
    ] = None,
    span: Annotated[
        int | None, typer.Option(help="Silos one subject may span (default S).")
    ] = None,
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
    per_round: Annotated[bool, typer.Option(help="Also list ε after every round.")] = False,
    scaling_noise_multiplier: Annotated[
        float | None,
        typer.Option(
            help="σ of the DP feature statistics each silo released before round 1 "
            "(\\[data] scaling = 'dp'), composed into every ε."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    **settings: Any,
) -> None:
    """What ε does a plan spend (--noise-multiplier), or what σ reaches an ε (--target-epsilon)?

    --steps is the number of local steps per round and --rounds the number of rounds R, so a
    silo runs steps × rounds steps in all. Every ε is an upper bound for the worst-case silo
    taking part in every round.
    """
    try:
        if clients is not None:
            silos = check_int("--clients", clients, 1, MAX_COUNT)
        if silos is None:
            raise InvalidValueError(
                "Expected --silos S (--clients for prifedsync): the subject-level ε and the ε "
                "against a curious silo depend on the number of silos, and S = 1 would be the "
                "best case."
            )
        _check_unread_options(algorithm, settings)
        _check_options(
            delta=delta,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            sample_rate=sample_rate,
            steps=steps,
            rounds=rounds,
            silos=silos,
            silos_per_round=silos_per_round,
            span=span,
            settings=settings,
        )
        if adversary not in TARGETS:
            raise InvalidValueError(f"Expected adversary={adversary!r} to be one of {TARGETS}.")
        if scaling_noise_multiplier is not None:
            check_in_range(
                "--scaling-noise-multiplier",
                scaling_noise_multiplier,
                0.0,
                MAX_NOISE_MULTIPLIER,
                lo_open=True,
            )
        result = account_report(
            algorithm,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            rounds=rounds,
            silos=silos,
            silos_per_round=silos_per_round,
            span=span,
            adversary=adversary,
            unit=unit,
            per_round=per_round,
            settings={k: v for k, v in settings.items() if v is not None},
            require_group_size=True,
            scaling_noise_multiplier=scaling_noise_multiplier,
        )
    except (SilodpError, ValueError) as err:
        fail(str(err))
    except (OverflowError, MemoryError) as err:
        fail(
            f"Expected a plan this machine can account; composing --steps={steps} x "
            f"--rounds={rounds} over --silos={silos} with {_shown(settings)} ran out of "
            f"{'memory' if isinstance(err, MemoryError) else 'floating-point range'} ({err}). "
            "Use smaller counts."
        )
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_report(result)


def _check_unread_options(algorithm: str, settings: dict[str, Any]) -> None:
    """Refuses a generated option the algorithm's accounting does not read (it would change
    nothing, while the output looks as if it had)."""
    if algorithm not in ALGORITHMS:
        return  # make_algorithm names the algorithms
    reads = ALGORITHMS[algorithm].Config.accounting_fields()
    unread = sorted(k for k, v in settings.items() if v is not None and k not in reads)
    if unread:
        names = ", ".join(f"--{k.replace('_', '-')}" for k in unread)
        own = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(reads)) or "none"
        raise InvalidValueError(
            f"Expected only options {algorithm}'s accounting reads; it does not read {names} "
            f"(its own: {own})."
        )


def _shown(settings: dict[str, Any]) -> str:
    given = {k: v for k, v in settings.items() if v is not None}
    return ", ".join(f"--{k.replace('_', '-')}={v}" for k, v in given.items()) or "no other options"


def _option_help(name: str, doc: str, default: Any) -> str:
    """An option's help; ``--group-size`` has no default where the ε depends on it."""
    if name == "group_size":
        return (
            "Bound k on one subject's records (in one silo; in the whole federation for "
            "uldp_group). Required where the ε depends on it: no default."
        )
    return f"{doc} (default: {default})"


def _check_options(
    *,
    delta: float,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    sample_rate: float,
    steps: int,
    rounds: int,
    silos: int,
    silos_per_round: int | None,
    span: int | None,
    settings: dict[str, Any],
) -> None:
    """Refuses, naming the option, every numeric value the command cannot account: not finite,
    out of range, or beyond the counts it handles (nothing is clamped)."""
    check_int("--silos", silos, 1, MAX_COUNT)
    check_int("--steps", steps, 1, MAX_COUNT)
    check_int("--rounds", rounds, 1, MAX_ROUNDS)
    for name, value in (("--silos-per-round", silos_per_round), ("--span", span)):
        if value is not None and not 1 <= value <= silos:
            raise InvalidValueError(
                f"Expected {name}={value} to be an integer in [1, {silos}] (at most --silos)."
            )
    check_in_range("--delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
    check_probability("--sample-rate", sample_rate, allow_zero=True)
    if noise_multiplier is not None:
        check_in_range(
            "--noise-multiplier", noise_multiplier, 0.0, MAX_NOISE_MULTIPLIER, lo_open=True
        )
    if target_epsilon is not None:
        check_finite("--target-epsilon", target_epsilon)
        check_target_epsilon(target_epsilon, "--target-epsilon")
        if sample_rate == 0.0:
            raise InvalidValueError(
                "Expected --sample-rate above 0 with --target-epsilon: at rate 0 no record is "
                "ever used, so the plan spends nothing and no σ is calibrated (give "
                "--noise-multiplier to see that its ε is 0)."
            )
    for name, value in settings.items():
        option = f"--{name.replace('_', '-')}"
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int) and value > MAX_COUNT:
            raise InvalidValueError(f"Expected {option}={value} to be at most {MAX_COUNT}.")
        elif isinstance(value, float):
            check_finite(option, value)


def _with_generated_options(command: Any) -> Any:
    """``command`` whose ``**settings`` are the generated hyperparameter options."""
    signature = inspect.signature(command)
    hints = typing.get_type_hints(command, include_extras=True)
    params = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in signature.parameters.values()
        if p.kind != p.VAR_KEYWORD
    ]
    for name, (kind, default, doc) in sorted(_generated_options().items()):
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    kind | None, typer.Option(help=_option_help(name, doc, default))
                ],
            )
        )
    command.__signature__ = signature.replace(parameters=params)
    return command


account = _with_generated_options(account)
