"""The record unit of a run whose data were capped (docs/guarantees.md, C4 "what the caps
do"): the replace-one event, its PLD and RDP, and the runs that charge it."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats
from typer.testing import CliRunner

from silodp.accounting import FederatedAccountant, SiloPrivacy
from silodp.accounting import conversions as cv
from silodp.accounting.accountant import _dominating_by_rate
from silodp.accounting.events import (
    PoissonReplaceOneDpEvent,
    poisson_gaussian_steps,
    replace_one,
    subject_mixture_steps,
)
from silodp.cli import app
from silodp.cli.account import account_report
from silodp.config import parse_config
from silodp.data.build import build_federated_data
from silodp.errors import InvalidValueError
from silodp.experiment import run_experiment
from silodp.ledger.serialize import event_from_json, event_to_json

DELTA = 1e-5
#: configs/fashion_mnist.toml's plan: record ε = 4 calibrated for add/remove gives this σ
FMNIST = {"q": 0.128, "sigma": 1.3286888205050922, "steps": 5, "rounds": 10}


def _record_epsilon(event: dp_event.DpEvent, rounds: int) -> float:
    acc = FederatedAccountant(units=("record",), span=1, delta=DELTA)
    acc.compose_round([SiloPrivacy({"record": event})], count=rounds)
    return acc.estimates()["record"].epsilon


@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.01, 1.0, 200), (0.128, 1.33, 50)])
def test_replace_one_pld_is_dp_accountings_replace_one_accountant(q, sigma, steps) -> None:
    """silodp's record ε of one record replaced equals dp-accounting's own PLD accountant with
    ``REPLACE_ONE`` (built from its events, not silodp's), and exceeds add/remove."""
    ours = _record_epsilon(replace_one(poisson_gaussian_steps(q, sigma, steps)), 1)
    reference = pld_privacy_accountant.PLDAccountant(
        pld_privacy_accountant.NeighborRel.REPLACE_ONE, value_discretization_interval=1e-3
    )
    reference.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-6)
    assert ours > 1.2 * _record_epsilon(poisson_gaussian_steps(q, sigma, steps), 1)


def _binned_replace_pair_lower_bound(q: float, sigma: float, steps: int) -> float:
    """ε of a replace-one pair that capping produces, through a post-processing (outputs
    binned on a grid): a lower bound on the true ε, computed from the two output densities
    directly. One record's clipped gradient is -C in one dataset and, replaced, +C in the
    other; each is in a batch with probability q; noise N(0, σ²C²); C = 1."""
    edges = np.arange(-20.0, 20.0 + 0.005, 0.005)

    def binned(components: list[tuple[float, float]]) -> dict[int, float]:
        cdf = sum(w * stats.norm.cdf(edges, loc=m, scale=sigma) for m, w in components)
        mass = np.diff(cdf)
        return {i: math.log(v) for i, v in enumerate(mass) if v > 1e-300}

    upper = binned([(0.0, 1 - q), (-1.0, q)])
    lower = binned([(0.0, 1 - q), (1.0, q)])
    pld = pld_lib.from_two_probability_mass_functions(
        upper, lower, pessimistic_estimate=False, value_discretization_interval=1e-3
    )
    return float(pld.self_compose(steps).get_epsilon_for_delta(DELTA))


def test_capped_record_epsilon_is_above_what_a_capped_pair_reaches() -> None:
    """At configs/fashion_mnist.toml's plan, the replacement a per-silo cap makes reaches
    ε ≈ 6.36 (a lower bound); the add/remove ε at the same σ (≈ 3.98, what was reported
    before the caps were accounted) is below it, and the capped local_item_dp's is above."""
    p = FMNIST
    steps = p["steps"] * p["rounds"]
    reached = _binned_replace_pair_lower_bound(p["q"], p["sigma"], steps)
    assert reached > 6.0
    kwargs = dict(
        noise_multiplier=p["sigma"],
        sample_rate=p["q"],
        steps=p["steps"],
        rounds=p["rounds"],
        silos=5,
    )
    capped = account_report("local_item_dp", **kwargs, settings={"group_size": 8})
    uncapped = account_report(
        "local_item_dp", **kwargs, settings={"group_size": 8, "group_capped": False}
    )
    assert uncapped["epsilon"]["record"] < reached
    assert capped["epsilon"]["record"] >= reached


def test_replace_one_rdp_is_mironovs_group_of_two() -> None:
    """The RDP route of a replaced record: at order β >= 2, three times the add/remove curve
    at 2β (Mironov 2017, Prop. 2); undefined (+inf) below; never below the PLD route."""
    base = poisson_gaussian_steps(0.05, 1.2, 30)
    curve = cv.rdp_curve(replace_one(base))
    doubled = cv.rdp_curve(base, 2.0 * cv.RDP_ORDERS)
    high = cv.RDP_ORDERS >= 2.0
    np.testing.assert_allclose(curve[high], 3.0 * doubled[high], rtol=1e-12)
    assert np.all(np.isinf(curve[~high]))
    acc = FederatedAccountant(units=("record",), span=1, delta=DELTA)
    acc.compose_round([SiloPrivacy({"record": replace_one(base)})], count=4)
    routes = acc.estimates()["record"].routes
    assert routes["rdp"] >= routes["pld"]
    # unsampled, a replacement is a Gaussian of twice the sensitivity: exact, no conversion
    assert replace_one(dp_event.GaussianDpEvent(2.0)) == dp_event.GaussianDpEvent(1.0)


def test_replace_one_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match="Expected Gaussian"):
        replace_one(subject_mixture_steps(0.1, 1.0, 3, 2))


def test_capped_events_round_trip_through_the_ledger_and_stay_hashable() -> None:
    record = poisson_gaussian_steps(0.1, 1.1, 3)
    event = dp_event.ComposedDpEvent(
        (replace_one(record), record, subject_mixture_steps(0.1, 1.1, 2, 3))
    )
    back = event_from_json(json.loads(json.dumps(event_to_json(event))))
    assert back == event and hash(back) == hash(event)


def test_a_larger_rate_dominates_replace_one_events_too() -> None:
    """Dominance by rate (the accountant picks the silo with the largest rates without
    computing ε) holds for replacements: the picked event has the larger ε."""
    small, large = (replace_one(poisson_gaussian_steps(q, 1.0, 5)) for q in (0.02, 0.2))
    assert _dominating_by_rate([small, large]) == 1
    assert _record_epsilon(large, 3) > _record_epsilon(small, 3)
    assert isinstance(large.event, PoissonReplaceOneDpEvent)


def test_calibration_reaches_a_record_target_whose_event_holds_a_mixture() -> None:
    """Under a span cap the record event holds the subject's mixture, which the fast (RDP)
    routes cannot bound; calibration then brackets σ with the PLD and still meets the target."""
    # against the released model: the silos have no record-level guarantee under a span cap
    plan = dict(sample_rate=0.1, steps=3, rounds=4, silos=3, span=2, settings={"group_size": 2})
    plan["adversary"] = "released"
    report = account_report("local_item_dp", target_epsilon=8.0, **plan)
    assert report["epsilon"]["record"] <= 8.0
    assert report["method"]["record"] == "pld-mixture"
    looser = account_report(
        "local_item_dp", noise_multiplier=report["noise_multiplier"] * 0.97, **plan
    )
    assert looser["epsilon"]["record"] > 8.0


TINY = {
    "name": "tiny",
    "algorithms": ["local_item_dp", "user_ldp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 60, "max_records": 600},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "noise": "seeded"},
}


@pytest.mark.parametrize(
    ("privacy", "data", "capped", "across"),
    [
        ({}, {}, False, False),
        ({"group_size": 4}, {}, True, False),
        ({"span": 2, "group_size": 4}, {}, True, True),
        ({}, {"records_per_subject_per_silo": 2}, True, False),
        ({}, {"records_per_subject": 6}, True, True),
    ],
    ids=["no-caps", "group-cap", "span-cap", "data-cap-per-silo", "data-cap-federation"],
)
def test_runs_charge_the_caps_they_apply(tmp_path: Path, privacy, data, capped, across) -> None:
    """A run sets what it capped in the algorithm's config, whether the bound is privacy's or
    the data's own (``data.records_per_subject*`` drop records the same way); its record ε is
    the one ``silodp account`` gives for its account command, which names the caps; capping
    raises the record ε above the uncapped run's at the same σ, and a cap across silos (span,
    or a federation-wide count) raises user_ldp's silo ε too."""
    raw = json.loads(json.dumps(TINY))
    raw["privacy"].update(privacy)
    raw["data"].update(data)
    summary = run_experiment(parse_config(raw), tmp_path / "run")
    runs = {r["algorithm"]: r for r in summary["runs"]}
    command = shlex.split(runs["local_item_dp"]["account_command"])
    assert ("--group-capped" if capped else "--no-group-capped") in command
    assert ("--cross-silo-cap" in command) == ("records_per_subject" in data)
    account = json.loads(CliRunner().invoke(app, [*command[1:], "--json"]).output)
    # the released model's record ε; a cap across silos leaves the silos none (they see which
    # of their records other silos' records pushed out)
    by = runs["local_item_dp"]["epsilon_by_adversary"]
    item = by["released"]["record"]
    assert (by["silos"]["record"] is None) == across
    assert (runs["local_item_dp"]["epsilon"]["record"] is None) == across
    released = account["epsilon_by_adversary"]["released"]["record"]
    assert item == pytest.approx(released, rel=1e-5)  # per round vs at once
    plain = account_report(
        "local_item_dp",
        noise_multiplier=1.5,
        sample_rate=account["plan"]["sample_rate"],
        steps=2,
        rounds=2,
        silos=3,
        settings={"group_size": account["plan"]["group_size"], "group_capped": False},
    )["epsilon"]["record"]
    if capped:
        assert item > 1.2 * plain
    else:
        assert item == pytest.approx(plain, rel=1e-5)
    silo = runs["user_ldp"]["epsilon_by_adversary"]["released"]["silo"]
    assert (runs["user_ldp"]["epsilon_by_adversary"]["silos"]["silo"] is None) == across
    plain_silo = account_report("user_ldp", noise_multiplier=1.5, steps=2, rounds=2, silos=3)
    if across:
        assert silo > 1.2 * plain_silo["epsilon"]["silo"]
    else:
        assert silo == pytest.approx(plain_silo["epsilon"]["silo"], rel=1e-5)


@pytest.mark.parametrize(
    ("algorithms", "privacy", "data", "match"),
    [
        (["local_item_dp"], {"span": 2}, {}, "privacy.group_size to be a public number"),
        (["local_group_dp"], {"span": 2, "group_size": "max"}, {}, "got 'max'"),
        (
            ["local_item_dp"],
            {"span": 2, "group_size": 4},
            {"records_per_subject": 6},
            r"records_per_subject_per_silo\) instead",
        ),
    ],
)
def test_caps_the_record_unit_cannot_cover_are_refused(
    tmp_path: Path, algorithms, privacy, data, match
) -> None:
    """A span cap moves records only as many as a *public* k allows, and beside a
    federation-wide count it could move several silos' records: refused, before anything is
    written."""
    raw = json.loads(json.dumps(TINY))
    raw["algorithms"] = algorithms
    raw["privacy"].update(privacy)
    raw["data"].update(data)
    with pytest.raises(InvalidValueError, match=match):
        run_experiment(parse_config(raw), tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.json"))


@pytest.mark.parametrize(
    ("data", "k", "source"),
    [
        ({"records_per_subject_per_silo": 40}, 40, "data.records_per_subject_per_silo = 40"),
        ({"records_per_subject": 50}, 50, "data.records_per_subject = 50"),
        (
            {"records_per_subject_per_silo": 40, "records_per_subject": 50},
            40,
            "data.records_per_subject_per_silo = 40",
        ),
    ],
)
def test_a_data_cap_is_the_group_bound_without_group_size(
    tmp_path: Path, caplog, data, k, source
) -> None:
    """Without privacy.group_size, a run used the data's largest count of one subject's
    records as k (a bound that depends on the data, with a warning) even where the data's
    own public cap bounds it: the cap is k now, even above every subject's count."""
    raw = json.loads(json.dumps(TINY))
    raw["algorithms"] = ["local_group_dp"]
    raw["privacy"] = {"epsilon": 4.0, "noise": "seeded"}
    raw["training"]["rounds"] = 1
    raw["data"].update(data)
    config = parse_config(raw)
    with caplog.at_level("WARNING"):
        run = run_experiment(config, tmp_path / "run")["runs"][0]
    largest = build_federated_data(config.data).train.max_records_per_subject_per_silo()
    assert largest < k  # the data's own count would have given a smaller, data-dependent k
    assert run["group_size"] == k
    assert run["group_size_source"] == f"config ({source})"
    assert "depends on the data" not in caplog.text


def test_the_threat_model_says_which_adversaries_this_run_has_no_epsilon_against(
    tmp_path: Path,
) -> None:
    """The text was the algorithm's alone ("holds against the server and other silos") while
    the run's ε against the silos was none under a span cap."""
    raw = json.loads(json.dumps(TINY))
    raw["algorithms"] = ["local_item_dp"]
    raw["privacy"].update(span=2, group_size=4)
    run = run_experiment(parse_config(raw), tmp_path / "capped")["runs"][0]
    assert run["epsilon_by_adversary"]["silos"]["record"] is None
    assert "in this run no finite ε against the silos at record level" in run["threat_model"]
    assert "seeded coins: every ε assumes the seed stays secret" in run["threat_model"]
    raw["privacy"] = {"noise_multiplier": 1.5, "group_size": 4}  # secure coins, no span cap
    plain = run_experiment(parse_config(raw), tmp_path / "plain")["runs"][0]
    assert all(
        v is not None for units in plain["epsilon_by_adversary"].values() for v in units.values()
    )
    assert "in this run" not in plain["threat_model"] and "seeded" not in plain["threat_model"]


@pytest.mark.parametrize("group_size", [None, "median", 30])
def test_a_group_bound_from_the_data_is_labelled_no_guarantee(
    tmp_path: Path, group_size: int | str | None
) -> None:
    """Without a public privacy.group_size, k came from the data: the run reported its
    subject ε like any other, with the source only in ``group_size_source``. Its threat model,
    its notes and the console table now say that ε is no guarantee; a public k says nothing."""
    from silodp.cli.common import summary_table

    raw = json.loads(json.dumps(TINY))
    raw["algorithms"] = ["local_group_dp", "user_ldp"]
    raw["training"]["rounds"] = 1
    if group_size is not None:
        raw["privacy"]["group_size"] = group_size
    summary = run_experiment(parse_config(raw), tmp_path / "run")
    group, ldp = summary["runs"]
    from_data = group_size != 30
    assert group["group_size_source"].startswith("data") == from_data
    k = group["group_size"]
    noted = [n for n in group["notes"] if n.startswith(f"subject-level ε with k = {k} from")]
    assert len(noted) == from_data
    assert (f"assumes at most k = {k} records per subject" in group["threat_model"]) == from_data
    printed = "\n".join(summary_table(summary))
    assert (
        f"local_group_dp: ε(subject) assumes k={k} records per subject in one silo" in printed
    ) == from_data
    # user_ldp's subject ε does not use k: nothing is said of it
    assert "k = " not in ldp["threat_model"] and "user_ldp: ε(subject) assumes" not in printed
    written = json.loads((tmp_path / "run" / "local_group_dp" / "summary.json").read_text())
    assert written["notes"] == group["notes"]
