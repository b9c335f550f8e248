"""silodp report: one self-contained HTML file (every figure a PNG data URI, nothing fetched)
of an experiment or a sweep, with the figures and tables beside it."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from silodp.cli import app
from silodp.config import parse_config
from silodp.experiment import run_experiment
from silodp.experiment.grid import load_grid, run_grid

PNG = b"\x89PNG\r\n\x1a\n"

TINY = {
    "name": "tiny-report",
    "algorithms": ["fedavg", "local_item_dp", "higradavg_dp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 30, "max_records": 300},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "group_size": 3},
}


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.external: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.images.append(values.get("src") or "")
        for key in ("src", "href"):
            value = values.get(key) or ""
            if value and not value.startswith("data:"):
                self.external.append(value)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    assert page.external == []  # nothing to fetch: viewable offline
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    return page


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exp")
    run_experiment(parse_config(TINY), out)
    return out


def test_experiment_report_embeds_every_figure_and_copies_numbers(
    experiment: Path, tmp_path: Path
) -> None:
    import json

    result = CliRunner().invoke(app, ["report", str(experiment), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "r.html")
    text = " ".join(page.text)
    # comparison, ε per unit, data, and each run's figures (fedavg has no ε figure)
    assert len(page.images) == 3 + 3 + 2
    summary = json.loads((experiment / "summary.json").read_text())
    item = next(r for r in summary["runs"] if r["algorithm"] == "local_item_dp")
    assert (
        f"{item['epsilon']['subject']:.4g}" in text and f"{item['epsilon']['record']:.4g}" in text
    )
    assert "silo-private" in text and "resolved config" in text and "Ledger" in text
    files = tmp_path / "r_files"
    assert (files / "final.csv").read_text().startswith("algorithm,status,rounds,test accuracy")
    assert (files / "final.md").is_file()
    for name in (
        "comparison.png",
        "epsilon_by_unit.png",
        "data_distribution.png",
        "local_item_dp_epsilon.png",
        "fedavg_accuracy_loss.png",
    ):
        assert (files / name).read_bytes().startswith(PNG), name


def test_a_public_report_leaves_out_the_silo_private_section(
    experiment: Path, tmp_path: Path
) -> None:
    args = ["report", str(experiment), "--out", str(tmp_path / "p.html"), "--public"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "p.html")
    assert "silo-private" not in " ".join(page.text) and len(page.images) == 3 + 3 + 1
    assert not (tmp_path / "p_files" / "data_distribution.png").exists()


def test_sweep_report_has_its_table_and_utility_against_epsilon(tmp_path: Path) -> None:
    import tomli_w

    (tmp_path / "base.toml").write_text(tomli_w.dumps({**TINY, "algorithms": ["local_item_dp"]}))
    (tmp_path / "s.toml").write_text(
        'base = "base.toml"\nseeds = [0, 1]\n[grid]\n"privacy.noise_multiplier" = [1.0, 3.0]\n'
    )
    run_grid(load_grid(tmp_path / "s.toml"), tmp_path / "sweep", log=lambda m: None)
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "s.html")]
    )
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "s.html")
    assert len(page.images) == 1
    text = " ".join(page.text)
    assert "fedavg" in text and "local_item_dp" in text and "accuracy_std" in text
    assert (tmp_path / "s_files" / "utility_vs_epsilon.png").read_bytes().startswith(PNG)
    assert re.search(r"^algorithm,baseline,", (tmp_path / "s_files" / "results.csv").read_text())


def test_report_of_a_directory_without_results_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert "Expected" in result.output and not (tmp_path / "r.html").exists()
