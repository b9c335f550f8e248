"""`uldp_avg_w` through the private weighting protocol on the Fashion-MNIST ULDP config with
the ULDP-FL paper's CNN (`uldp_cnn`, 21,840 parameters: the config's 106k-parameter `mnist_cnn`
has the same layer kinds and made the round take over three minutes, the protocol's cost being
per parameter) and 2048-bit keys, cut to a size one round of which takes under a minute: the
trained model equals the one trained with weights computed in the clear.

Without noise (σ = 0) and with seeded coins: the protocol draws its noise on its own grid and
the clear weights on another, so with σ > 0 the two models would differ by independent noise;
seeded coins give both runs the same batch shuffles."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from silodp.config import parse_config
from silodp.experiment import run_experiment
from silodp.models import build_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "uldp_fmnist_uniform.toml"
MODEL = "uldp_cnn"


def _raw(weighting: str) -> dict:
    raw = tomllib.loads(CONFIG.read_text())
    raw["algorithms"] = ["uldp_avg_w"]
    raw["model"]["name"] = MODEL
    raw["algorithm"] = {"uldp_avg_w": {"weighting": weighting, "n_max": 64, "key_bits": 2048}}
    raw["data"].update(num_silos=3, num_subjects=8, max_records=240)
    raw["training"].update(rounds=1, local_epochs=1)
    raw["privacy"].pop("epsilon", None)
    raw["privacy"].update(noise_multiplier=0.0, noise="seeded")
    return raw


@pytest.mark.slow
@pytest.mark.integration
def test_fmnist_cnn_trains_through_the_protocol_as_with_clear_weights(tmp_path: Path) -> None:
    lines: list[str] = []
    (private,) = run_experiment(
        parse_config(_raw("protocol")), tmp_path / "protocol", log=lines.append
    )["runs"]
    (clear,) = run_experiment(parse_config(_raw("clear")), tmp_path / "clear")["runs"]
    assert private["weights_private"] is True and clear["weights_private"] is False
    assert not any("weights not private" in n for n in private["notes"])
    assert any("private weighting protocol, " in line for line in lines), lines
    assert private["epsilon"] == clear["epsilon"]
    a = torch.load(tmp_path / "protocol" / "uldp_avg_w" / "model.pt")
    b = torch.load(tmp_path / "clear" / "uldp_avg_w" / "model.pt")
    assert a.keys() == b.keys()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved < 1e-5
    # and the round did move the model: the comparison is not between two untouched copies
    init = dict(build_model(MODEL, (1, 28, 28), 10, seed=0).named_parameters())
    assert max(float((a[k] - init[k].detach()).abs().max()) for k in a) > 100 * moved
