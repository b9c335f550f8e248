"""Preparing one run before anything trains: public bounds on the data, the privacy plan and σ.

Everything that can be wrong with a config (bad values, an unreachable privacy target, a
schedule the algorithm cannot run) is found here, before the first round, so a failed start
leaves no results behind. The algorithm answers every question through its methods; nothing
here names an algorithm.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shlex
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from silodp.accounting import PrivacyPlan, SiloPrivacy, conversions, find_sigma
from silodp.accounting.plan import feature_statistics_releases
from silodp.algorithms import ALGORITHMS, Algorithm, make_algorithm
from silodp.algorithms.planning import calibrate
from silodp.config import ExperimentConfig, PrivacyConfig, SweepCell, TrainingConfig
from silodp.data import FederatedData, FederatedDataset
from silodp.data.config import DataConfig
from silodp.data.partition import cap_records, cap_span
from silodp.errors import InvalidValueError
from silodp.federated.simulator import SCALING_STREAM, SETUP_STREAM, coin_seed, run_coins
from silodp.models import MODEL_INPUTS, build_model, dtype_name, input_mismatch

__all__ = ["PreparedRun", "check_model_fits", "dp_scaling", "prepare_run", "privacy_caps"]

logger = logging.getLogger(__name__)

NOT_PRIVATE_NOTE = (
    "noise_multiplier = 0: not private - the algorithm ran without noise and no ε holds; "
    "a non-private baseline"
)


@dataclass
class PreparedRun:
    """One algorithm's run (or one sweep cell), fully resolved before training starts."""

    name: str
    algorithm: Algorithm
    config: ExperimentConfig
    training: TrainingConfig
    privacy: PrivacyConfig
    train: FederatedDataset
    group_size: int | None
    group_size_source: str
    span: int
    span_source: str
    silos_per_round: int
    plan: PrivacyPlan | None
    noise_multiplier: float | None
    calibration: dict[str, Any]
    notes: list[str] = dataclasses.field(default_factory=list)
    cell: SweepCell | None = None
    #: the seed of its seeded coins: the run seed keyed by what the run computes
    #: (:func:`~silodp.federated.simulator.coin_seed`); unused by secure coins
    coin_seed: int = 0

    def accounted_budget(self) -> dict[str, float]:
        """The units of ``privacy.budget`` this run accounts: what binds it (an experiment's
        budget binds each of its runs at the units it reports; on a shared ledger a budget at
        any other unit is refused)."""
        units = self.algorithm.units
        return {u: v for u, v in (self.privacy.budget or {}).items() if u in units}

    def account_command(self, rounds: int | None = None) -> str | None:
        """A ``silodp account`` call that reproduces this run's ε after ``rounds`` rounds
        (default: all), for the worst-case silo taking part in every round."""
        if self.plan is None or not self.noise_multiplier:
            return None
        args = [
            "silodp",
            "account",
            "--algorithm",
            self.algorithm.name,
            "--noise-multiplier",
            repr(self.noise_multiplier),
            "--delta",
            repr(self.privacy.delta),
            "--sample-rate",
            repr(max(self.plan.sampling_rates)),
            "--steps",
            str(self.algorithm.config.local_steps),
            "--rounds",
            str(rounds if rounds is not None else self.training.rounds),
            "--silos",
            str(self.train.num_silos),
        ]
        # both default to S (and PriFedSync, whose clients are Poisson-sampled, takes no
        # --silos-per-round)
        if self.silos_per_round != self.train.num_silos:
            args += ["--silos-per-round", str(self.silos_per_round)]
        span = self.span
        if self.plan.releases and span == self.train.num_silos:
            # the DP feature statistics were computed on span-capped data even for an
            # algorithm that caps no span itself: --span says so (the statistics' events)
            span = statistics_span(self.config, self.train.num_silos)
        if span != self.train.num_silos:
            args += ["--span", str(span)]
        for option, value in self.algorithm.account_options().items():
            flag = option.replace("_", "-")
            if isinstance(value, bool):  # a switch: --name or --no-name
                args.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                args += [f"--{flag}", str(value)]
        if self.plan.releases:  # the DP feature statistics, composed into every ε
            release = self.plan.releases[0].events["subject"]
            args += ["--scaling-noise-multiplier", repr(release.noise_multiplier)]
        args += ["--adversary", self.privacy.adversary]
        return shlex.join(args)


def _group_bound(train: FederatedDataset, value: int | str, scope: str) -> int:
    if isinstance(value, int):
        return value
    counts = train.histogram().sum(axis=0) if scope == "federation" else train.histogram()
    counts = counts[counts > 0]
    return int(counts.max()) if value == "max" else max(1, int(np.median(counts)))


def _data_cap(data: DataConfig, scope: str, span: int) -> tuple[int, str] | None:
    """The group bound that the data's own public caps imply (``data.records_per_subject*``,
    applied when the data were built), with where it comes from; ``None`` without caps."""
    per_silo, total = data.records_per_subject_per_silo, data.records_per_subject
    options: list[tuple[int, str]] = []
    if total is not None:
        options.append((total, f"config (data.records_per_subject = {total})"))
    if per_silo is not None:
        if scope == "silo":
            options.append((per_silo, f"config (data.records_per_subject_per_silo = {per_silo})"))
        else:
            options.append(
                (
                    per_silo * span,
                    f"config (data.records_per_subject_per_silo = {per_silo} x span {span})",
                )
            )
    return min(options) if options else None


def _bound_data(
    train: FederatedDataset,
    privacy: PrivacyConfig,
    seed: int,
    algorithm: Algorithm,
    data: DataConfig,
) -> tuple[FederatedDataset, int | None, str, int, str]:
    """Applies the public span and group bounds (dropping excess records, SPEC §1). Without
    ``privacy.group_size`` the bound is the data's own public cap (:func:`_data_cap`), else
    the data's largest count (a warning: that bound depends on the data)."""
    span_source = "config" if privacy.span is not None else "number of silos (worst case)"
    if privacy.span is not None and privacy.span > train.num_silos:
        raise InvalidValueError(
            f"Expected privacy.span={privacy.span} to be at most the data's {train.num_silos} "
            "silos (a subject spans at most every silo); set it to the public bound on the "
            "silos one subject's records may occupy, or leave it unset for every silo."
        )
    span = privacy.span or train.num_silos
    if algorithm.uses_span():
        train = cap_span(train, span=span, seed=seed)
    elif span < train.num_silos:  # not capped: a subject may occupy every silo
        span, span_source = train.num_silos, "number of silos (this algorithm caps no span)"
    scope = algorithm.group_bound_scope()
    if scope is None:
        return train, None, "not used by this algorithm", span, span_source
    where = "in one silo" if scope == "silo" else "in the federation"
    if privacy.group_size is not None:
        k = _group_bound(train, privacy.group_size, scope)
        if scope == "federation":
            train = cap_records(train, total=k, seed=seed)
        else:
            train = cap_records(train, per_silo=k, seed=seed)
        source = "config"
        if not isinstance(privacy.group_size, int):
            source = f"data ({privacy.group_size} records of a subject {where})"
            logger.warning(
                "privacy.group_size = %r is computed from the data (k = %d, the %s count of "
                "one subject's records %s). That bound depends on the data; set "
                "privacy.group_size to a public number for a strictly valid subject-level "
                "guarantee.",
                privacy.group_size,
                k,
                privacy.group_size,
                where,
            )
        return train, k, source, span, span_source
    cap = _data_cap(data, scope, span)
    if cap is not None:  # public, and already applied when the data were built
        return train, cap[0], cap[1], span, span_source
    largest = _group_bound(train, "max", scope)
    logger.warning(
        "privacy.group_size is not set: using the data's largest count of one subject's "
        "records %s (%d) as the bound k. That bound depends on the data; set "
        "privacy.group_size to a public bound for a strictly valid subject-level guarantee.",
        where,
        largest,
    )
    return train, largest, f"data (largest {where}; set privacy.group_size)", span, span_source


def data_bound_note(k: int | None, source: str) -> str:
    """The note of a run whose group bound ``k`` was taken from the data (``source``, e.g.
    ``data (largest in one silo; set privacy.group_size)``)."""
    counted = source.removeprefix("data").strip(" ()").split(";")[0]
    return (
        f"subject-level ε with k = {k} from the data ({counted}), not a public bound: it "
        f"covers subjects with at most {k} records counted that way, not every possible "
        "subject, and k itself, written in config.toml and the account command, is the data's "
        "exact count and is covered by no ε. Set privacy.group_size to a public bound for a "
        "guarantee"
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
            logger.warning("%s.", note)  # the same for every algorithm: printed once
            notes.append(note)
    return notes


def _caps(
    name: str,
    algorithm: Algorithm,
    privacy: PrivacyConfig,
    config: ExperimentConfig,
    span: int,
    num_silos: int,
) -> dict[str, Any]:
    """What the data's caps and the public bounds dropped, as the algorithm's config records
    it (the record and silo units account for it: :mod:`silodp.algorithms.caps`).

    Raises:
      InvalidValueError: caps whose effect on the algorithm's record unit is not covered.
    """
    data = config.data
    across = data.records_per_subject is not None
    data_capped = across or data.records_per_subject_per_silo is not None
    span_cap = span if algorithm.uses_span() and span < num_silos else None
    record = "record" in algorithm.units
    if record and data_capped and algorithm.adjacency_of("record") != "add/remove":
        raise InvalidValueError(
            f"Expected no data.records_per_subject* caps with {name}: they change which other "
            f"records a silo keeps, which its {algorithm.adjacency_of('record')} record "
            "accounting does not cover."
        )
    scope = algorithm.group_bound_scope()
    if record and scope is not None and span_cap is not None:
        if across:
            raise InvalidValueError(
                f"Expected no data.records_per_subject with privacy.span={span} below the "
                f"{num_silos} silos for {name}: a record moving its subject between silos "
                "would change records in several silos, which its record-level ε does not "
                "cover; cap records per silo (data.records_per_subject_per_silo) instead."
            )
        if not isinstance(privacy.group_size, int):
            raise InvalidValueError(
                f"Expected privacy.group_size to be a public number with privacy.span={span} "
                f"below the {num_silos} silos for {name}, got {privacy.group_size!r}: one "
                "added record can move its subject's records into another silo, and only a "
                "public bound k limits how many (a k taken from the data does not)."
            )
    return {
        "group_capped": (privacy.group_size is not None and scope is not None) or data_capped,
        "cross_silo_cap": across,
        "span_cap": span_cap,
    }


def privacy_caps(config: ExperimentConfig, data: FederatedData) -> dict[str, dict[str, Any]]:
    """What each listed private algorithm's public bounds keep of ``data`` before it trains
    (as :func:`prepare_run` applies them; nothing is calibrated): per algorithm, the group
    bound ``k`` and the ``span`` used with their sources, and the records dropped."""
    out: dict[str, dict[str, Any]] = {}
    for name in config.algorithms:
        _, privacy = config.for_algorithm(name)
        probe = make_algorithm(name, config.algorithm_config(name, num_silos=data.train.num_silos))
        if not probe.private:
            continue
        train, k, k_source, span, span_source = _bound_data(
            data.train, privacy, config.data.seed, probe, config.data
        )
        out[name] = {
            "group_size": k,
            "group_size_source": k_source,
            "span": span,
            "span_source": span_source,
            "dropped_records": len(data.train) - len(train),
        }
    return out


def _check_public_classes(name: str, config: ExperimentConfig, data: FederatedData) -> None:
    """Refuses a private run on a table whose classes were read from its labels: the model
    has one output per class, so the released model would show whether a record with a
    label no other record has took part.

    Raises:
      InvalidValueError: ``[data] source = "table"`` without ``label_values``.
    """
    if config.data.source != "table" or config.data.label_values is not None:
        return
    raise InvalidValueError(
        f"Expected [data] label_values (the public list of classes) for the private run "
        f"{name!r} on a table: without it the model's {data.train.num_classes} outputs are "
        "the distinct labels found in the data, and the released model would show whether a "
        "record with a rare label took part, which no ε covers. Declare the classes from the "
        'data\'s documentation, e.g. label_values = [0, 1] or ["no", "yes"].'
    )


#: the (model, classes) each data set was found to fit, so that a sweep's cells and an
#: experiment's algorithms build and try the model once
_FITTING: weakref.WeakKeyDictionary[FederatedData, set[tuple[str, int]]] = (
    weakref.WeakKeyDictionary()
)


def check_model_fits(config: ExperimentConfig, data: FederatedData) -> None:
    """Refuses a ``[model]`` that cannot read the data's records: the model is built for the
    data's feature shape and dtype and run forward, without gradients, on the first two
    training records (no training; the weights are thrown away).

    Raises:
      InvalidValueError: the model cannot be built for the data's features, refuses their
        dtype, or fails on (or gives no ``num_classes`` outputs for) a record.
    """
    model_name = config.model.name
    train = data.train
    key = (model_name, train.num_classes)
    if key in _FITTING.get(data, set()):
        return
    shape = tuple(train.feature_shape)
    dtype = train.x.dtype
    expects = MODEL_INPUTS.get(model_name, ("", "the records it was built for"))[1]

    def refuse(why: str) -> InvalidValueError:
        return InvalidValueError(
            f"Expected [model] name = {model_name!r} to fit the data ({data.name}: features of "
            f"shape {shape}, dtype {dtype_name(dtype)}, {train.num_classes} classes): "
            f"{model_name} reads {expects}; {why}."
        )

    mismatch = input_mismatch(model_name, dtype)
    if mismatch is not None:
        raise refuse(mismatch)
    try:
        model = build_model(model_name, shape, train.num_classes, dtype=dtype)
    except (ValueError, TypeError, RuntimeError) as err:
        raise refuse(f"it cannot be built for them ({str(err).rstrip('.')})") from None
    x = torch.from_numpy(np.ascontiguousarray(train.x[:2]))
    try:
        with torch.no_grad():
            out = model(x)
    except (ValueError, TypeError, RuntimeError, IndexError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise refuse(f"run on two training records it failed ({first.rstrip('.')})") from None
    if tuple(out.shape) != (len(x), train.num_classes):
        raise refuse(
            f"run on {len(x)} training records it gave outputs of shape {tuple(out.shape)}, "
            f"not ({len(x)}, {train.num_classes})"
        )
    _FITTING.setdefault(data, set()).add(key)


def prepare_run(
    name: str,
    config: ExperimentConfig,
    data: FederatedData,
    *,
    releases: tuple[SiloPrivacy, ...] = (),
    cell: SweepCell | None = None,
) -> PreparedRun:
    """Resolves bounds, the privacy plan and σ for algorithm ``name``; trains nothing.

    ``releases``: per-silo events of releases made before training (DP feature statistics),
    composed with the run's rounds in calibration and reporting. ``cell``: a sweep cell
    applied to ``config``.

    Raises:
      InvalidValueError: the schedule does not fit the algorithm or the data, or the model
        cannot read the data's records (:func:`check_model_fits`).
      CalibrationError: the target ε is unreachable.
    """
    if cell is not None:
        config = config.for_cell(cell)
    check_model_fits(config, data)
    training, privacy = config.for_algorithm(name)
    probe = make_algorithm(name, config.algorithm_config(name, num_silos=data.train.num_silos))
    train, group_size, group_source, span, span_source = _bound_data(
        data.train, privacy, config.data.seed, probe, config.data
    )
    silos_per_round = probe.check_schedule(training.silos_per_round, train.num_silos)
    caps = _caps(name, probe, privacy, config, span, train.num_silos)
    algo_config = config.algorithm_config(
        name, group_size=group_size or 1, num_silos=train.num_silos, **caps
    )
    probe = make_algorithm(name, algo_config)
    if probe.private and privacy.noise_multiplier != 0:
        _check_public_classes(name, config, data)
    plan: PrivacyPlan | None = None
    sigma: float | None = None
    calibration: dict[str, Any] = {"method": "not private"}
    notes: list[str] = []
    if probe.private and privacy.noise_multiplier is not None and privacy.epsilon is not None:
        if config.data.scaling != "dp":  # there ε is the DP statistics' budget basis
            logger.warning(
                "privacy.epsilon = %g is no target while privacy.noise_multiplier = %g is set: "
                "the runs use that σ as given and report the ε it spends, unchecked against "
                "%g; drop one of the two keys",
                privacy.epsilon,
                privacy.noise_multiplier,
                privacy.epsilon,
            )
    if probe.private and privacy.noise_multiplier == 0:
        # the same algorithm (clipping, weighting, sampling) without noise: a baseline
        sigma = 0.0
        calibration = {"method": "not private (noise_multiplier = 0)"}
        notes = [NOT_PRIVATE_NOTE]
        logger.warning("%s.", NOT_PRIVATE_NOTE)
    elif probe.private:
        notes = _delta_notes(name, probe.units, privacy.delta, train)
        unbound = [u for u in privacy.budget or {} if u not in probe.units]
        if unbound and privacy.ledger is None:  # (a shared ledger refuses such a run)
            notes.append(
                f"privacy.budget at {', '.join(unbound)} does not bind {name}: it reports no ε "
                f"there (only at {', '.join(probe.units)}), so nothing bounds what it spends "
                "at that unit"
            )
        if group_source.startswith("data") and "subject" in probe.units:
            notes.append(data_bound_note(group_size, group_source))
        sizes = train.silo_sizes()
        subjects = (train.histogram() > 0).sum(axis=1)
        plan = PrivacyPlan(
            sampling_rates=tuple(
                probe.sampling_rate(num_records=int(n), num_subjects=int(a))
                for n, a in zip(sizes, subjects, strict=True)
            ),
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
            sigma = calibrate(
                probe,
                plan,
                target_epsilon=privacy.epsilon,
                rel_tol=probe.calibration_tolerance,
            )
            calibration = {
                "method": "calibrated",
                "target_epsilon": privacy.epsilon,
                "unit": probe.calibration_unit,
                "adversary": privacy.adversary,
                "seconds": round(time.perf_counter() - started, 2),
            }
    if sigma is not None:
        algo_config = dataclasses.replace(algo_config, noise_multiplier=sigma)
    label = (
        name if cell is None else f"{name}/{cell.label(config.algorithm_settings(name), privacy)}"
    )
    identity = _identity(name, algo_config, config, train, silos_per_round)
    coins_seed = coin_seed(training.seed, identity)
    setup_coins = run_coins(privacy.noise, coins_seed, SETUP_STREAM)
    return PreparedRun(
        name=label,
        algorithm=make_algorithm(name, algo_config, train, coins=setup_coins),
        config=config,
        training=training,
        privacy=privacy,
        train=train,
        group_size=group_size,
        group_size_source=group_source,
        span=span,
        span_source=span_source,
        silos_per_round=silos_per_round,
        plan=plan,
        noise_multiplier=sigma,
        calibration=calibration,
        notes=notes,
        cell=cell,
        coin_seed=coins_seed,
    )


def _identity(
    name: str, run_config: Any, config: ExperimentConfig, train: FederatedDataset, silos: int
) -> str:
    """What a run computes, as text: its algorithm's resolved settings (σ included), the
    model, the silos per round and a digest of the records it trains on (the identity its
    seeded coins are keyed by, :func:`~silodp.federated.simulator.coin_seed`). Where the
    results go (ledger, budget, evaluation) is left out, and numbers are compared as values
    (``clip = 1`` is ``clip = 1.0``)."""
    return json.dumps(
        _as_values(
            {
                "algorithm": name,
                "settings": dataclasses.asdict(run_config),
                "model": dataclasses.asdict(config.model),
                "silos_per_round": silos,
                "records": train.digest(),
            }
        ),
        sort_keys=True,
    )


def _as_values(value: Any) -> Any:
    """``value`` with every number a float and every other leaf its text."""
    if isinstance(value, dict):
        return {str(k): _as_values(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_values(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return str(value)


def statistics_span(config: ExperimentConfig, num_silos: int) -> int:
    """The span cap of the data the DP feature statistics are computed on: ``privacy.span``
    (at most the silos), for every algorithm of the config alike."""
    return min(config.privacy.span or num_silos, num_silos)


def dp_scaling(
    config: ExperimentConfig, data: FederatedData
) -> tuple[FederatedData, tuple[SiloPrivacy, ...], dict[str, Any]]:
    """``[data] scaling = "dp"``: per-feature mean/std estimated with DP before training.

    The estimate gets ``scaling_budget`` of ``privacy.epsilon``: its noise multiplier σ_s is
    the smallest for which its subject-level ε alone (one Gaussian per silo, composed over
    ``span`` silos: μ = √span/σ_s) is at most that share at ``privacy.delta``. Every run then
    composes these per-silo events with its rounds (``releases``), so its calibrated and
    reported ε include the estimate. Returns the scaled data, the events and a summary.

    Raises:
      InvalidValueError: an algorithm whose guarantee does not compose with the statistics'
        record- and subject-level events, or no ``privacy.epsilon`` to take a share of.
    """
    from silodp.data.scaling import dp_feature_stats

    privacy = config.privacy
    for name in config.algorithms:
        if config.for_algorithm(name)[1].span != privacy.span:
            raise InvalidValueError(
                f"Expected no [algorithm.{name}] span with [data] scaling = 'dp': the DP "
                "feature statistics are computed once, composed over privacy.span for every "
                "algorithm."
            )
        cls = ALGORITHMS[name]
        refused = [
            f"{u}-level ({cls.adjacency_of(u)})"
            for u in cls.units
            if u == "silo" or cls.adjacency_of(u) != "add/remove"
        ]
        if refused:
            what = " and ".join(refused)
            raise InvalidValueError(
                f"Expected [data] scaling = 'bounds' or 'standard' with {name}: the DP feature "
                f"statistics are accounted per record and subject, not for {name}'s "
                f"{what} guarantee."
            )
    if privacy.epsilon is None:
        raise InvalidValueError(
            "Expected privacy.epsilon with [data] scaling = 'dp': its budget is a share "
            "(data.scaling_budget) of that ε."
        )
    span = statistics_span(config, data.train.num_silos)
    share = config.data.scaling_budget * privacy.epsilon
    sigma = find_sigma(lambda s: conversions.gdp_epsilon(math.sqrt(span) / s, privacy.delta), share)
    bounds = json.dumps(_as_values(config.data.feature_bounds))
    identity = f"dp-scaling\0{sigma!r}\0{span}\0{bounds}\0{data.train.digest()}"
    coins = run_coins(privacy.noise, coin_seed(config.training.seed, identity), SCALING_STREAM)
    # on the records training will use: a subject then sits in at most ``span`` silos
    capped = cap_span(data.train, span=span, seed=config.data.seed)
    stats = dp_feature_stats(
        capped, bounds=config.data.feature_bounds, noise_multiplier=sigma, coins=coins
    )
    # with a span cap or a federation-wide cap of the data, one added record can move its
    # subject's records from one silo to others: more silos' statistics change, each by at
    # most one subject's contribution
    releases = feature_statistics_releases(
        sigma,
        data.train.num_silos,
        span_cap=span < data.train.num_silos,
        federation_cap=config.data.records_per_subject is not None,
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
