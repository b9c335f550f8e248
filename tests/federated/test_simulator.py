"""The simulator's bookkeeping: coins per stream (secure runs differ, seeded runs repeat), silo
sampling, JSON rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from silodp.accounting import FederatedAccountant
from silodp.algorithms import make_algorithm
from silodp.data import FederatedDataset, TestSplit
from silodp.federated.simulator import (
    SAMPLING_STREAM,
    SCALING_STREAM,
    SERVER_STREAM,
    SETUP_STREAM,
    SILO_STREAM,
    RoundResult,
    Simulator,
    round_coins,
    run_coins,
)
from silodp.models import build_model

ALPHA = 1e-6


def _draw(mode: str, *key: int) -> list[int]:
    return round_coins(mode, *key).uint64(4).tolist()


def test_seeded_round_streams_are_reproducible_and_independent() -> None:
    a = _draw("seeded", 7, 3, SILO_STREAM, 1)
    assert a == _draw("seeded", 7, 3, SILO_STREAM, 1)
    others = [
        (7, 3, SILO_STREAM, 2),
        (7, 4, SILO_STREAM, 1),
        (8, 3, SILO_STREAM, 1),
        (7, 3, SAMPLING_STREAM, 0),
        (7, 3, SERVER_STREAM, 0),
    ]
    for key in others:
        assert _draw("seeded", *key) != a


def test_run_wide_streams_repeat_no_round_stream() -> None:
    """The set-up and feature-statistics streams are none of the rounds' streams (a key
    ``(seed, 3)`` was numpy's zero-padded ``(seed, 3, 0, 0)``: round 3's silo 0 stream)."""
    run = {stream: run_coins("seeded", 7, stream).uint64(4).tolist() for stream in (3, 4)}
    assert run[SETUP_STREAM] != run[SCALING_STREAM]
    assert run[SETUP_STREAM] == run_coins("seeded", 7, SETUP_STREAM).uint64(4).tolist()
    rounds = {
        tuple(_draw("seeded", 7, r, stream, silo))
        for r in range(1, 9)
        for stream in (SILO_STREAM, SAMPLING_STREAM, SERVER_STREAM)
        for silo in range(4)
    }
    assert not {tuple(v) for v in run.values()} & rounds
    assert run_coins("secure", 7, SETUP_STREAM).is_secure


def test_secure_round_streams_ignore_the_seed() -> None:
    assert _draw("secure", 7, 3, SILO_STREAM, 1) != _draw("secure", 7, 3, SILO_STREAM, 1)
    assert round_coins("secure", 7, 3, SILO_STREAM, 1).is_secure


def _federation(n: int = 48, silos: int = 4):
    rng = np.random.default_rng(0)
    train = FederatedDataset(
        x=rng.normal(size=(n, 4)).astype(np.float32),
        y=rng.integers(0, 3, n),
        silo=np.arange(n) % silos,
        subject=np.arange(n) // 2,
        num_classes=3,
    )
    test = TestSplit(x=rng.normal(size=(10, 4)).astype(np.float32), y=rng.integers(0, 3, 10))
    return train, test


def _simulate(name: str, noise: str, *, rounds: int = 2, silos_per_round: int = 2, **cfg):
    train, test = _federation()
    config = dict(local_steps=2, batch_size=6, noise_multiplier=1.0, group_size=2, **cfg)
    algo = make_algorithm(name, config)
    sim = Simulator(
        algorithm=algo,
        model=build_model("mlp", (4,), 3, seed=0),
        train=train,
        test=test,
        accountant=None
        if algo.calibration_unit is None
        else FederatedAccountant(units=algo.units, span=4, delta=1e-5),
        silos_per_round=silos_per_round,
        seed=11,
        noise=noise,
    )
    results = sim.run(rounds)
    return sim, results


@pytest.mark.parametrize("name", ["local_item_dp", "higradavg_dp", "user_ldp", "fedavg"])
def test_seeded_runs_repeat_and_secure_runs_differ(name) -> None:
    a, ra = _simulate(name, "seeded")
    b, rb = _simulate(name, "seeded")
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert [r.silos for r in ra] == [r.silos for r in rb]
    c, _ = _simulate(name, "secure")
    d, _ = _simulate(name, "secure")
    assert any(not torch.equal(c.params[k], d.params[k]) for k in c.params)


def _fedavg_simulator(silos: int = 4, **kwargs) -> Simulator:
    train, test = _federation(silos=silos)
    return Simulator(
        algorithm=make_algorithm("fedavg", dict()),
        model=build_model("mlp", (4,), 3),
        train=train,
        test=test,
        accountant=None,
        silos_per_round=1,
        seed=0,
        **kwargs,
    )


def test_secure_silo_sampling_is_uniform() -> None:
    sim = _fedavg_simulator(silos=4)
    picks = [sim.sample_silos(r)[0] for r in range(2000)]
    assert stats.chisquare(np.bincount(picks, minlength=4)).pvalue > ALPHA
    assert len(set(picks)) == 4


def test_simulator_refuses_an_unknown_noise_mode() -> None:
    with pytest.raises(ValueError, match="noise='float'"):
        _fedavg_simulator(noise="float")


def _personalised(noise: str) -> Simulator:
    train, test = _federation()
    config = dict(local_steps=2, batch_size=4, noise_multiplier=1.0, client_rate=0.5)
    sim = Simulator(
        algorithm=make_algorithm("prifedsync", config),
        model=build_model("mlp", (4,), 3, seed=0),
        train=train,
        test=test,
        accountant=None,
        seed=5,
        noise=noise,
    )
    sim.run(3)
    return sim


def test_personalised_seeded_runs_repeat_and_secure_runs_differ() -> None:
    a, b = _personalised("seeded"), _personalised("seeded")
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert [a.sample_silos(r) for r in range(1, 5)] == [b.sample_silos(r) for r in range(1, 5)]
    c, d = _personalised("secure"), _personalised("secure")
    differ = any(not torch.equal(c.params[k], d.params[k]) for k in c.params)
    assert differ or [c.sample_silos(r) for r in range(8)] != [d.sample_silos(r) for r in range(8)]


def test_round_result_json_has_no_non_finite_numbers() -> None:
    result = RoundResult(
        round=1,
        test_accuracy=0.1,
        test_loss=math.nan,
        epsilon={"subject": math.inf, "record": 1.5},
        epsilon_route={"subject": "none", "record": "pld"},
        mu={},
        wall_time_s=0.1,
        silos=[0],
    )
    row = result.to_json()
    text = json.dumps(row, allow_nan=False)
    assert json.loads(text)["test_loss"] is None
    assert row["epsilon"] == {"subject": None, "record": 1.5}


def test_seeded_runs_of_other_settings_draw_independent_noise(tmp_path) -> None:
    """Two seeded runs on one seed that differ only in the clip drew the same batches and
    noise: from their two models anyone solved for the noiseless one, while a shared ledger
    composed them as independent releases. Their coins are now keyed by the settings; the
    same settings still repeat."""
    from silodp.config import parse_config
    from silodp.experiment import run_experiment

    def model(tag: str, clip: float, sigma: float) -> dict[str, torch.Tensor]:
        raw = {
            "name": tag,
            "algorithms": ["local_item_dp"],
            "data": {"source": "digits", "num_silos": 2, "num_subjects": 20, "max_records": 160},
            "model": {"name": "mlp"},
            "training": {"rounds": 1, "local_steps": 1, "batch_size": 16, "lr": 0.05, "seed": 5},
            "privacy": {"noise_multiplier": sigma, "noise": "seeded", "clip": clip},
        }
        run_experiment(parse_config(raw), tmp_path / tag, log=lambda m: None)
        return torch.load(tmp_path / tag / "local_item_dp" / "model.pt")

    # clips far above every gradient: the models differ only by the noise, C·σ·N each
    m1, m2, again = model("a", 1024.0, 1.0), model("b", 2048.0, 1.0), model("c", 1024.0, 1.0)
    clean = model("clean", 1024.0, 0.0)
    assert all(torch.equal(m1[k], again[k]) for k in m1)
    for k in clean:
        noise = float((m1[k] - clean[k]).abs().max())
        recovered = m1[k] + 1024.0 * (m1[k] - m2[k]) / (2048.0 - 1024.0)
        assert float((recovered - clean[k]).abs().max()) > 0.1 * noise > 0


def test_seeded_coins_are_keyed_by_the_records_and_not_by_where_results_go() -> None:
    """Other records draw other coins, as other settings do; a ledger,
    a budget or a number's spelling (1 or 1.0) change nothing a run computes, nor its coins
    (every engine trains the same model, bit for bit)."""
    import dataclasses
    from pathlib import Path

    from silodp.config import load_config
    from silodp.data.build import build_federated_data
    from silodp.experiment.prepare import prepare_run

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "smoke.toml")
    data = build_federated_data(config.data)
    seed = prepare_run("local_item_dp", config, data).coin_seed
    elsewhere = config.with_ledger("/tmp/elsewhere.sqlite")
    assert config.hyperparameters["clip"] == 1.0
    elsewhere = dataclasses.replace(
        elsewhere,
        hyperparameters={**elsewhere.hyperparameters, "clip": 1},
        privacy=dataclasses.replace(elsewhere.privacy, budget={"record": 100.0}),
    )
    assert prepare_run("local_item_dp", elsewhere, data).coin_seed == seed
    # another record set (a record the caps drop anyway changes nothing trained, nor coins)
    fewer = dataclasses.replace(data, train=data.train.subset(np.arange(0, len(data.train), 2)))
    assert prepare_run("local_item_dp", config, fewer).coin_seed != seed
    assert prepare_run("local_group_dp", config, data).coin_seed != seed
