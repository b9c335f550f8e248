"""``silodp account --algorithm prifedsync`` as a user runs it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from silodp.accounting.fdp import PriFedSyncPlan, account_prifedsync
from silodp.cli import app

runner = CliRunner()
ARGS = [
    "account",
    "--algorithm",
    "prifedsync",
    "--sample-rate",
    "0.01",
    "--steps",
    "10",
    "--rounds",
    "20",
    "--clients",
    "10",
    "--client-rate",
    "0.5",
    "--delta",
    "1e-5",
]


def test_json_has_the_fields_and_the_rigorous_epsilon() -> None:
    result = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert "mu" not in out  # no μ-GDP guarantee: the CLT μ are estimates
    assert set(out["mu_estimates"]) >= {"weak", "strong", "client_max"}
    assert out["mu_estimates"]["strong"] > out["mu_estimates"]["weak"]
    text = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0"]).output
    assert "client_max: μ ≈" in text and "(CLT estimate, not a guarantee)" in text
    assert "Gaussian DP, a guarantee" not in text
    assert {"record", "record_every_round"} <= set(out["epsilon"])
    assert out["epsilon_route"]["record"] == "pld-client-sampling"
    assert "record_clt_weak" in out["estimates"]
    assert out["plan"]["clients"] == 10 and out["plan"]["client_rate"] == 0.5
    assert "server" in out["threat_model"]
    plan = PriFedSyncPlan(
        noise_multiplier=1.0,
        sample_rates=(0.01,) * 10,
        local_steps=10,
        rounds=20,
        client_rate=0.5,
    )
    assert out["epsilon"]["record"] == account_prifedsync(plan)[-1].epsilon["record"]


def test_per_round_and_text_output() -> None:
    result = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0", "--json", "--per-round"])
    out = json.loads(result.output)
    assert [r["round"] for r in out["per_round"]] == list(range(1, 21))
    assert out["per_round"][-1]["epsilon"]["record"] == out["epsilon"]["record"]
    text = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0"])
    assert text.exit_code == 0
    assert "guarantee" in text.output and "estimate" in text.output


def test_target_epsilon_calibrates() -> None:
    result = runner.invoke(app, [*ARGS, "--target-epsilon", "1.5", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["noise_multiplier_source"] == "calibrated"
    assert out["epsilon"]["record"] <= 1.5


def test_bad_values_name_the_value() -> None:
    bad = runner.invoke(
        app, [*ARGS[:-6], "--clients", "10", "--client-rate", "1.5", "--noise-multiplier", "1.0"]
    )
    assert bad.exit_code != 0
    assert "client_rate=1.5" in bad.output
    bad = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0", "--batch-sampling", "x"])
    assert bad.exit_code != 0 and "batch_sampling='x'" in bad.output
    bad = runner.invoke(app, [*ARGS, "--noise-multiplier", "1.0", "--clients", "0"])
    assert bad.exit_code != 0 and "clients=0" in bad.output
