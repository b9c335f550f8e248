"""An algorithm added by one file: registered, configured from TOML, calibrated, run, accounted.

Everything the toy algorithm needs lives in this file; the experiment, the config parser and
the accounting find it through the registry and its methods alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from dp_accounting import dp_event, pld
from torch import nn

from silodp._validation import check_in_range
from silodp.accounting import SiloPrivacy
from silodp.accounting.events import poisson_gaussian_steps
from silodp.algorithms import ALGORITHMS, Algorithm, AlgorithmConfig, register
from silodp.algorithms.base import SiloData, SiloUpdate, hyperparameter, poisson_mask
from silodp.algorithms.dp_sgd import clipped_noisy_step
from silodp.cli.account import _generated_options, account_report
from silodp.config import ConfigError, parse_config
from silodp.experiment import run_experiment
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import Coins


@dataclass(frozen=True, kw_only=True)
class ToyConfig(AlgorithmConfig):
    """The toy's one hyperparameter: how much more noise than σ it adds (σ·boost)."""

    boost: float = hyperparameter(1.0, "privacy", "toy_dp: noise boost.", account=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_in_range(self.key("boost"), self.boost, 1.0, 10.0)


class ToyDP(Algorithm):
    """DP-SGD with its noise multiplied by ``boost``: record-level, local noise."""

    name = "toy_dp"
    Config = ToyConfig
    units = ("record",)
    calibration_unit = "record"
    threat_model = "local noise: holds against the server and other silos"

    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        cfg = self.config
        sigma = cfg.noise_multiplier * cfg.boost
        event = poisson_gaussian_steps(sampling_rate, sigma, cfg.local_steps)
        return SiloPrivacy({"record": event})

    def account_options(self) -> dict[str, Any]:
        return {"boost": self.config.boost}

    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        coins: Coins,
        instructions: Any = None,
        state: Any = None,
    ) -> SiloUpdate:
        cfg = self.config
        q = self.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        boosted = replace(cfg, noise_multiplier=cfg.noise_multiplier * cfg.boost)
        return self.run_steps(
            params,
            silo,
            select=lambda: poisson_mask(silo.num_records, q, coins),
            step=lambda local, idx: clipped_noisy_step(
                model, local, silo, idx, config=boosted, scale=q * silo.num_records, coins=coins
            ),
        )


@pytest.fixture
def toy() -> Iterator[type[Algorithm]]:
    register(ToyDP)
    try:
        yield ToyDP
    finally:
        ALGORITHMS.pop(ToyDP.name)


RAW = {
    "name": "toy",
    "algorithms": ["fedavg", "toy_dp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 60, "max_records": 600},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"epsilon": 3.0, "boost": 2.0, "noise": "seeded"},
}


def _independent_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's own PLD accountant on the toy's mechanism."""
    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def test_unregistered_algorithm_and_its_key_are_config_errors() -> None:
    without_key = {**RAW, "privacy": {k: v for k, v in RAW["privacy"].items() if k != "boost"}}
    with pytest.raises(ConfigError, match="'toy_dp'"):
        parse_config(without_key)
    with pytest.raises(ConfigError, match=r"Unknown key\(s\) \['boost'\]"):
        parse_config({**RAW, "algorithms": ["fedavg"]})


def test_toy_plugin_runs_from_a_config_and_meets_its_target(toy, tmp_path: Path) -> None:
    config = parse_config(RAW)
    assert config.algorithm_config("toy_dp").boost == 2.0
    with pytest.raises(ConfigError, match=r"privacy\.boost=20"):
        parse_config({**RAW, "privacy": {**RAW["privacy"], "boost": 20.0}})
    summary = run_experiment(config, tmp_path)
    run = summary["runs"][1]
    assert run["algorithm"] == "toy_dp" and run["status"] == "complete"
    sigma, q = run["noise_multiplier"], run["sampling_rate"]["max"]
    # the calibrated σ meets the target for the boosted mechanism, by an independent count
    eps = _independent_epsilon(q, sigma * 2.0, 2 * 2, 1e-5)
    assert eps <= 3.0 * 1.002 and eps > 2.8
    assert run["epsilon"]["record"] == pytest.approx(eps, rel=2e-3)
    assert "--boost 2.0" in run["account_command"]
    lines = (tmp_path / "toy_dp" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["round"] for r in rows] == [1, 2]


def test_toy_plugin_is_accounted_by_the_account_report(toy) -> None:
    assert "boost" in _generated_options()
    out = account_report(
        "toy_dp",
        noise_multiplier=1.0,
        sample_rate=0.1,
        steps=5,
        rounds=4,
        silos=2,
        settings={"boost": 3.0},
    )
    assert out["epsilon"]["record"] == pytest.approx(
        _independent_epsilon(0.1, 3.0, 20, 1e-5), rel=2e-3
    )
    assert out["plan"]["boost"] == 3.0
