"""Every config shipped in configs/ parses and runs (shortened to one round, fewer records)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from silodp.config import parse_config
from silodp.experiment import run_experiment

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
#: configs that read user-supplied files; tests/federated/test_leaf_table_runs.py covers them
NEEDS_USER_DATA = {"femnist_small.toml", "shakespeare.toml", "uldp_tabular.toml"}


#: configs whose full models make even one round too long for the test suite; they are
#: prepared (data built, every σ calibrated) but not trained here
PREPARE_ONLY = {"uldp_fmnist_uniform.toml", "uldp_fmnist_zipf.toml", "uldp_fmnist_noniid.toml"}


#: 40 subjects, each with as many records as in the config where its n_max bounds them
FEWER_SUBJECTS = {
    "uldp_digits_uniform.toml": {"num_subjects": 40, "max_records": 600},
    "uldp_digits_zipf.toml": {"num_subjects": 40},
}


def _shipped() -> list[str]:
    return sorted(
        p.name
        for p in CONFIGS.glob("*.toml")
        if p.name not in NEEDS_USER_DATA | PREPARE_ONLY and not p.name.startswith("prifedsync_")
    )


def _sweeps() -> list[str]:
    return sorted(p.name for p in (CONFIGS / "papers").glob("prifedsync_*.toml"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PREPARE_ONLY))
def test_large_config_prepares_every_algorithm(name: str) -> None:
    from silodp.data.build import build_federated_data
    from silodp.experiment import prepare_run

    config = parse_config(tomllib.loads((CONFIGS / name).read_text()))
    data = build_federated_data(config.data)
    for algorithm in config.algorithms:
        run = prepare_run(algorithm, config, data)
        if algorithm != "fedavg":
            assert run.noise_multiplier is not None and run.noise_multiplier > 0


def test_every_shipped_config_parses() -> None:
    for path in [*CONFIGS.glob("*.toml"), *(CONFIGS / "papers").glob("prifedsync_*.toml")]:
        parse_config(tomllib.loads(path.read_text()))


def test_shipped_configs_and_the_demo_draw_secret_coins() -> None:
    from silodp.config import default_config_path

    paths = [*CONFIGS.glob("*.toml"), default_config_path()]
    for path in paths:
        config = parse_config(tomllib.loads(path.read_text()))
        assert config.privacy.noise == "secure", path.name
        for name in config.algorithms:
            assert config.for_algorithm(name)[1].noise == "secure", (path.name, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _shipped())
def test_shipped_config_runs_one_round(name: str, tmp_path: Path) -> None:
    raw = tomllib.loads((CONFIGS / name).read_text())
    raw["training"]["rounds"] = 1
    raw["training"]["local_steps"] = min(raw["training"].get("local_steps", 10), 2)
    # fewer records, but enough that no silo of a many-silo Zipf allocation ends up empty
    floor = 150 * raw["data"].get("num_silos", 5) if raw["data"].get("num_silos", 5) > 20 else 0
    raw["data"]["max_records"] = min(raw["data"].get("max_records", 1500), max(1500, floor))
    if raw["data"].get("num_subjects", 0) > 200:
        raw["data"]["num_subjects"] = 200
    if "uldp_avg_w" in raw["algorithms"]:  # the protocol's smallest keys: 3072 only costs time
        raw.setdefault("algorithm", {}).setdefault("uldp_avg_w", {}).setdefault("key_bits", 2048)
    # fewer subjects where the protocol runs: its cost is per (silo, subject) pair
    raw["data"].update(FEWER_SUBJECTS.get(name, {}))
    lines: list[str] = []
    summary = run_experiment(parse_config(raw), tmp_path, log=lines.append)
    assert [r["algorithm"] for r in summary["runs"]] == raw["algorithms"]
    protocol = "uldp_avg_w" in raw["algorithms"] and (
        raw.get("algorithm", {}).get("uldp_avg_w", {}).get("weighting", "protocol") == "protocol"
    )
    estimates = [line for line in lines if "private weighting protocol" in line]
    assert len(estimates) == int(protocol), lines
    for item in summary["runs"]:
        assert item["status"] == "complete"
        assert item["rounds_completed"] == 1
        if item["algorithm"] != "fedavg":
            assert item["epsilon"], item["algorithm"]
            # every unit has a finite ε against the released model, and the calibrated one
            # against the config's adversary (a unit no guarantee holds for against some
            # party, e.g. uldp_group's record level against the silos, reads None: inf)
            released = item["epsilon_by_adversary"]["released"]
            assert all(v is not None and v > 0 for v in released.values()), item["algorithm"]
            unit = item["calibration"].get("unit")
            if unit is not None:
                assert item["epsilon"][unit] is not None and item["epsilon"][unit] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", _sweeps())
def test_prifedsync_sweep_config_runs(name: str, tmp_path: Path) -> None:
    """Each PriFedSync sweep config, cut to its first grid cell and 2 rounds, writes its table."""
    raw = tomllib.loads((CONFIGS / "papers" / name).read_text())
    raw["training"]["rounds"] = 2
    for axis in ("client_rate", "noise_multiplier", "batch_size", "local_steps"):
        if raw["sweep"].get(axis):
            raw["sweep"][axis] = raw["sweep"][axis][:1]
    if raw["sweep"].get("local_steps"):
        raw["sweep"]["local_steps"] = [2]
    else:
        raw["training"]["local_steps"] = 2
    if "train_per_client" in raw["data"]:
        raw["data"]["train_per_client"] = 50
    else:
        raw["data"]["max_records"] = min(raw["data"].get("max_records", 2400), 2400)
    summary = run_experiment(parse_config(raw), tmp_path)
    (item,) = summary["runs"]
    assert item["status"] == "complete" and item["epsilon"]["record"] > 0
    assert item["mu_estimates"]["client_max"] > 0 and item["mu"] == {}
    assert (tmp_path / "prifedsync_table.md").is_file()
    assert (tmp_path / "prifedsync_table.csv").is_file()
    assert (tmp_path / "personalised_vs_global.png").is_file()
