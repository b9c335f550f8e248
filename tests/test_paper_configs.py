"""The paper reproduction sweeps under configs/papers/: every cell is a valid config, and the
first cell and the first private cell of each run (cut to one round)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from silodp.experiment import run_experiment
from silodp.experiment.grid import cell_config, expand, load_grid

PAPERS = Path(__file__).resolve().parents[1] / "configs" / "papers"
SWEEPS = sorted(p.name for p in PAPERS.glob("*.toml") if not p.name.startswith("prifedsync_"))


def test_the_paper_sweeps_are_there_and_name_what_they_mirror() -> None:
    assert {
        "subject_dp_fig1.toml",
        "subject_dp_fig3_alpha.toml",
        "subject_dp_small.toml",
        "uldp_fig4_8.toml",
        "uldp_silos.toml",
        "uldp_fig10_sampling.toml",
    } <= set(SWEEPS)
    for name in SWEEPS:
        header = (PAPERS / name).read_text().split("\nname")[0]
        assert "paper" in header and ("Figure" in header or "variant" in header), name
        assert "differ" in header or "Here" in header or "bases/" in header, name


@pytest.mark.parametrize("name", SWEEPS)
def test_every_cell_of_a_paper_sweep_is_a_valid_config(name: str) -> None:
    spec = load_grid(PAPERS / name)
    cells = expand(spec)
    assert cells[0].baseline and not cells[-1].baseline
    for cell in cells:
        config = cell_config(spec, cell)
        if not cell.baseline:
            assert config.privacy.epsilon == 4.0 and config.privacy.delta == 1e-5
            assert config.privacy.noise == "secure"
            # the base's sections of algorithms the cell does not run are left out
            assert set(config.overrides) <= set(config.algorithms)


@pytest.mark.slow
@pytest.mark.parametrize("name", SWEEPS)
def test_the_first_cells_of_a_paper_sweep_run(name: str, tmp_path: Path) -> None:
    spec = load_grid(PAPERS / name)
    cells = expand(spec)
    first_private = next(c for c in cells if not c.baseline)
    for cell in (cells[0], first_private):
        config = cell_config(spec, cell)
        config = dataclasses.replace(
            config, training=dataclasses.replace(config.training, rounds=1)
        )
        summary = run_experiment(config, tmp_path / cell.id, log=lambda _: None)
        assert [r["algorithm"] for r in summary["runs"]] == list(config.algorithms)
        for item in summary["runs"]:
            assert item["status"] == "complete" and item["rounds_completed"] == 1
            if item["algorithm"] != "fedavg":
                assert item["epsilon"] and all(
                    v is not None and 0 < v for v in item["epsilon"].values()
                )
