"""silodp report: one self-contained HTML file (every figure a PNG data URI, nothing fetched)
of an experiment or a sweep, with the figures and tables beside it."""

from __future__ import annotations

import base64
import html
import json
import re
import statistics
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from silodp import plotting
from silodp.cli import app
from silodp.config import parse_config
from silodp.display import upper
from silodp.experiment import run_experiment
from silodp.experiment.grid import load_grid, run_grid
from silodp.html_report import _rounds_over_seeds

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
        self.alts: list[str] = []
        self.external: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.images.append(values.get("src") or "")
            self.alts.append(values.get("alt") or "")
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
    files = tmp_path / "r_files"
    lines = (files / "final.md").read_text().splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    row = next(line for line in lines if line.startswith("| local_item_dp "))
    cells = dict(zip(header, (c.strip() for c in row.split("|")[1:-1]), strict=True))
    for unit in ("subject", "record"):  # each ε shown rounded up to 4 significant figures
        assert cells[f"ε ({unit})"] == upper(item["epsilon"][unit], 4)
        assert cells[f"ε ({unit})"] in text
    assert "silo-private" in text and "resolved config" in text and "Ledger" in text
    assert "notes" not in text  # none of these runs has notes
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


def test_a_unit_without_a_finite_bound_reads_inf_and_a_data_bound_is_not_made_public(
    tmp_path: Path,
) -> None:
    """uldp_avg_w with weights in the clear has no ε against the silos (stored as null): the
    report's tables said "-", the mark of a unit an algorithm does not report. A k taken from
    the data is not public: a --public report of such a run is refused."""
    raw = json.loads(json.dumps(TINY))
    raw["algorithms"] = ["fedavg", "uldp_avg_w", "local_item_dp"]
    raw["privacy"] |= {"weighting": "clear", "group_size": "max"}
    run_experiment(parse_config(raw), tmp_path / "run")
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "r.html")]
    )
    assert result.exit_code == 0, result.output
    final = (tmp_path / "r_files" / "final.md").read_text().splitlines()
    header = [c.strip() for c in final[0].strip("|").split("|")]
    rows = {
        r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in final[2:]
    }
    subject = header.index("ε (subject)")
    assert rows["uldp_avg_w"][subject] == "inf"  # no guarantee against the silos
    assert rows["fedavg"][subject] == "-"  # no ε at all
    assert rows["local_item_dp"][subject] not in ("-", "inf")
    # each run's ε at its own δ (a per-algorithm delta was not shown anywhere)
    assert rows["local_item_dp"][header.index("δ")] == "1e-05"
    assert rows["fedavg"][header.index("δ")] == "-"
    public = ["report", str(tmp_path / "run"), "--out", str(tmp_path / "p.html"), "--public"]
    refused = CliRunner().invoke(app, public)
    assert refused.exit_code != 0 and "local_item_dp" in refused.output
    assert "group_size" in refused.output and not (tmp_path / "p.html").exists()


def test_a_sweep_shows_inf_and_its_public_report_refuses_a_data_bound(tmp_path: Path) -> None:
    import tomli_w

    base = {**TINY, "algorithms": ["uldp_avg_w", "local_item_dp"]}
    base["privacy"] = {**TINY["privacy"], "weighting": "clear", "group_size": "max"}
    (tmp_path / "base.toml").write_text(tomli_w.dumps(base))
    (tmp_path / "s.toml").write_text(
        'base = "base.toml"\nseeds = [0]\n[grid]\n"privacy.noise_multiplier" = [1.5]\n'
    )
    run_grid(load_grid(tmp_path / "s.toml"), tmp_path / "sweep", log=lambda m: None)
    table = (tmp_path / "sweep" / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| uldp_avg_w "))
    # its subject ε against every party: none (then the δ and adversary of the ε column)
    assert row.rstrip().endswith("| inf | 1e-05 | strongest |")
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "s.html")]
    )
    assert result.exit_code == 0, result.output
    shown = (tmp_path / "s_files" / "results.md").read_text()
    assert "| uldp_avg_w |" in shown and "inf" in shown and "unbounded" not in shown
    public = ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "p.html"), "--public"]
    refused = CliRunner().invoke(app, public)
    assert refused.exit_code != 0 and "group_size" in refused.output
    assert not (tmp_path / "p.html").exists()


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
    # accuracy per grid point, accuracy against ε, one per-round figure per grid point (σ)
    assert len(page.images) == 4
    assert (tmp_path / "s_files" / "rounds_001.png").read_bytes().startswith(PNG)
    # the per-round curves: mean and std over the seeds, each grid point with its baseline
    manifest = json.loads((tmp_path / "sweep" / "grid.json").read_text())
    points = _rounds_over_seeds(tmp_path / "sweep", manifest["cells"])
    assert sorted(points) == ["privacy.noise_multiplier=1.0", "privacy.noise_multiplier=3.0"]
    accuracy, epsilon, views = points["privacy.noise_multiplier=3.0"]
    assert list(accuracy) == ["fedavg (non-private)", "local_item_dp (subject ε)"]
    assert list(epsilon) == ["local_item_dp (subject ε)"]
    cells = sorted((tmp_path / "sweep" / "cells").glob("*noise_multiplier=3.0*"))
    rows = [
        [json.loads(line) for line in (c / "local_item_dp" / "metrics.jsonl").open()] for c in cells
    ]
    assert len(rows) == 2  # the two seeds
    rounds, mean, std = accuracy["local_item_dp (subject ε)"]
    for r, m, s in zip(rounds, mean, std, strict=True):
        values = [run[r - 1]["test_accuracy"] for run in rows]
        assert m == pytest.approx(statistics.mean(values))
        assert s == pytest.approx(statistics.stdev(values))
    assert views and {(v["delta"], v["adversary"]) for v in views} == {(1e-5, "strongest")}
    # ε: the largest over the seeds (the bound each seed's run meets), with no band; the
    # seeds' ε are equal here (σ is fixed), so one seed's is raised to tell max from mean
    raised = cells[1] / "local_item_dp" / "metrics.jsonl"
    rows[1] = [{**r, "epsilon": {"subject": 1.5 * r["epsilon"]["subject"]}} for r in rows[1]]
    raised.write_text("".join(json.dumps(r) + "\n" for r in rows[1]))
    _, epsilon, _ = _rounds_over_seeds(tmp_path / "sweep", manifest["cells"])[
        "privacy.noise_multiplier=3.0"
    ]
    rounds, largest, spread = epsilon["local_item_dp (subject ε)"]
    assert rounds == [1, 2] and set(spread) == {0.0}
    for r, e in zip(rounds, largest, strict=True):
        assert e == rows[1][r - 1]["epsilon"]["subject"] > rows[0][r - 1]["epsilon"]["subject"]
    text = " ".join(page.text)
    assert "fedavg" in text and "local_item_dp" in text and "accuracy_std" in text
    assert (tmp_path / "s_files" / "utility_vs_epsilon.png").read_bytes().startswith(PNG)
    assert (tmp_path / "s_files" / "accuracy_by_grid_point.png").read_bytes().startswith(PNG)
    assert re.search(r"^algorithm,baseline,", (tmp_path / "s_files" / "results.csv").read_text())
    # an unfinished sweep (a cell cut short) is refused with the command that continues it; its
    # report said "exit 0" with an empty table
    cut = sorted((tmp_path / "sweep" / "cells").glob("*noise_multiplier=3.0-seed1"))[0]
    summary = json.loads((cut / "summary.json").read_text())
    summary["runs"][0]["status"] = "interrupted"
    (cut / "summary.json").write_text(json.dumps(summary))
    again = CliRunner().invoke(
        app, ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "t.html")]
    )
    assert again.exit_code == 2 and "1 of its cells" in again.output and cut.name in again.output
    assert "silodp sweep SWEEP_FILE --out" in again.output and not (tmp_path / "t.html").exists()


def test_cells_at_one_epsilon_get_no_accuracy_against_epsilon_figure(tmp_path: Path) -> None:
    """Cells calibrated to one ε end at the same ε: the sweep report shows accuracy per grid
    point, and no accuracy-against-ε figure (it would be a vertical line)."""
    rows = [
        {"algorithm": "fedavg", "baseline": True, "data.num_silos": 2, "accuracy_mean": 0.9},
        {
            "algorithm": "uldp_avg",
            "baseline": False,
            "data.num_silos": 2,
            "accuracy_mean": 0.7,
            "accuracy_std": 0.01,
            "epsilon_subject_mean": 3.99,
            "epsilon_subject_std": 0.0,
        },
        {
            "algorithm": "uldp_avg",
            "baseline": False,
            "data.num_silos": 3,
            "accuracy_mean": 0.6,
            "accuracy_std": 0.02,
            "epsilon_subject_mean": 3.98,
            "epsilon_subject_std": 0.0,
        },
        # a record-level ε beside a subject-level one does not count as a spread
        {
            "algorithm": "uldp_group",
            "baseline": False,
            "data.num_silos": 3,
            "accuracy_mean": 0.5,
            "epsilon_subject_mean": 3.9,
            "epsilon_record_mean": 0.28,
        },
    ]
    assert plotting.epsilon_spread(rows) < 1.05
    assert plotting.epsilon_spread([*rows[1:2], {**rows[2], "epsilon_subject_mean": 8.0}]) > 2
    figure = plotting.plot_accuracy_by_grid(rows, tmp_path / "bars.png")
    assert figure is not None and figure.read_bytes().startswith(PNG)
    assert plotting.plot_accuracy_by_grid([{"algorithm": "x"}], tmp_path / "none.png") is None


def test_report_of_a_directory_without_results_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert "Expected" in result.output and not (tmp_path / "r.html").exists()


# --- ULDP: the subject weights and the subject sampling (silo-private) -------------------------

ULDP = {
    "name": "tiny-uldp-report",
    "algorithms": ["uldp_avg", "uldp_avg_w", "uldp_naive"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 30, "max_records": 300},
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5},
    "algorithm": {
        # the server draws the sample: each silo's count of sampled subjects is recorded
        "uldp_avg": {"subject_rate": 0.5, "subject_sampler": "server"},
        # the silos draw it: the counts are their secret and not recorded
        "uldp_avg_w": {"weighting": "clear", "subject_rate": 0.5, "subject_sampler": "silos"},
    },
}


@pytest.fixture(scope="module")
def uldp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uldp")
    run_experiment(parse_config(ULDP), out)
    return out


def _histogram() -> np.ndarray:
    """n_{s,a} of the ULDP config's training data, built again from the config."""
    from silodp.data.build import build_federated_data

    return build_federated_data(parse_config(ULDP).data).train.histogram()


def test_uldp_runs_write_their_subject_weights_under_silo_private_only(uldp: Path) -> None:
    import json

    hist = _histogram()
    expected = {
        "uldp_avg": np.full(hist.shape, 1.0 / hist.shape[0]),
        "uldp_avg_w": hist / hist.sum(axis=0, keepdims=True),  # n_{s,a} / n_a
    }
    for name, weights in expected.items():
        with np.load(uldp / name / "silo_private" / "subject_weights.npz") as saved:
            np.testing.assert_allclose(saved["weights"], weights, rtol=0, atol=1e-12)
            np.testing.assert_array_equal(saved["holds"], hist > 0)
        private = json.loads((uldp / name / "silo_private" / "summary.json").read_text())
        assert private["subject_weights"]["pairs_weighted"] == int((hist > 0).sum())
        assert private["subject_sampling"]["rate"] == 0.5
    # nothing of the weights outside silo_private/; an algorithm without weights writes none
    assert sorted(p.relative_to(uldp).parts[1] for p in uldp.rglob("subject_weights*")) == [
        "silo_private",
        "silo_private",
    ]
    naive = json.loads((uldp / "uldp_naive" / "silo_private" / "summary.json").read_text())
    assert naive["subject_weights"] is None and naive["subject_sampling"] is None


def test_report_shows_the_weights_histograms_and_the_subjects_sampled(
    uldp: Path, tmp_path: Path
) -> None:
    import csv
    import json

    result = CliRunner().invoke(app, ["report", str(uldp), "--out", str(tmp_path / "u.html")])
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "u.html")
    text = " ".join(page.text)
    files = tmp_path / "u_files"
    hist = _histogram()
    weights = hist / hist.sum(axis=0, keepdims=True)
    # the table of uldp_avg_w's histograms is the histogram of the weights computed from the data
    rows = list(csv.DictReader((files / "uldp_avg_w_subject_weights.csv").open()))
    edges = np.linspace(0.0, 1.0, 21)
    assert [float(r["from"]) for r in rows] == pytest.approx(edges[:-1].tolist())
    for silo in range(hist.shape[0]):
        counts = np.histogram(weights[silo][hist[silo] > 0], bins=edges)[0]
        assert [int(r[f"silo {silo}"]) for r in rows] == counts.tolist()
    sums = np.histogram(np.clip(weights.sum(axis=0), 0, 1), bins=edges)[0]
    assert [int(r["subjects (Σ_s w)"]) for r in rows] == sums.tolist()
    assert sum(sums) == hist.shape[1] and sums[-1] == hist.shape[1]  # every Σ_s w = 1
    # uniform weights 1/S: every pair in the bin of 1/3
    avg = list(csv.DictReader((files / "uldp_avg_subject_weights.csv").open()))
    third = next(i for i, r in enumerate(avg) if float(r["from"]) <= 1 / 3 < float(r["to"]))
    assert sum(int(avg[third][f"silo {s}"]) for s in range(3)) == int((hist > 0).sum())
    for name in ("uldp_avg_subject_weights.png", "uldp_avg_w_subject_weights.png"):
        assert (files / name).read_bytes().startswith(PNG), name
    alts = " ".join(page.alts)
    assert "uldp_avg: nonzero w_s,a per silo" in alts and "uldp_avg_w: nonzero" in alts
    # the server's sample: counts recorded and drawn; the silos' sample: hidden, said so
    assert (files / "uldp_avg_subject_sampling.png").read_bytes().startswith(PNG)
    assert "uldp_avg: (silo, subject) pairs trained per round" in alts
    assert not (files / "uldp_avg_w_subject_sampling.png").exists()
    assert "No per-round count is drawn" in text and "hidden: the silos draw" in text
    diagnostics = [
        json.loads(line)
        for line in (uldp / "uldp_avg" / "silo_private" / "diagnostics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert all(len(r["subjects_per_batch"]) == 3 for r in diagnostics)
    assert "q = 0.5" in text and "drawn by the server" in text and "drawn by the silos" in text
    # uldp_naive weights no subject: no section of its own
    assert "uldp_naive: subject weights" not in text
    # each run's notes (e.g. that its aggregation was simulated), under the run
    summary = json.loads((uldp / "summary.json").read_text())
    noted = [r for r in summary["runs"] if r.get("notes")]
    assert noted and text.count("notes") == len(noted)
    page_html = (tmp_path / "u.html").read_text()
    for run in noted:
        assert all(html.escape(note) in page_html for note in run["notes"])


def test_a_public_report_leaves_out_the_weights_and_the_counts(uldp: Path, tmp_path: Path) -> None:
    args = ["report", str(uldp), "--out", str(tmp_path / "p.html"), "--public"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "p.html")
    text = " ".join(page.text)
    assert "silo-private" not in text and "subject weights" not in text
    assert not any("w_s,a" in alt or "pairs trained" in alt for alt in page.alts)
    assert not list((tmp_path / "p_files").glob("*subject_*"))
    # the rate q is part of the public plan
    assert "q = 0.5" in text


# --- PriFedSync: personalised against global accuracy ------------------------------------------

PRIFEDSYNC = {
    "name": "tiny-prifedsync-report",
    "algorithms": ["prifedsync"],
    "data": {
        "source": "digits",
        "num_silos": 4,
        "allocation": "shards",
        "shards_per_client": 2,
        "test_per_client": 20,
    },
    "model": {"name": "mlp"},
    "training": {
        "rounds": 3,
        "local_steps": 3,
        "batch_size": 8,
        "lr": 0.01,
        "optimizer": "adam",
        "helper": "interpolate",
        "alpha": 0.1,
    },
    "privacy": {"noise_multiplier": 1.0},
}


def test_prifedsync_report_has_personalised_and_global_accuracy(tmp_path: Path) -> None:
    import csv
    import json

    run_experiment(parse_config(PRIFEDSYNC), tmp_path / "run")
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "r.html")]
    )
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "r.html")
    files = tmp_path / "r_files"
    assert (files / "personalised_vs_global.png").read_bytes().startswith(PNG)
    assert any("personalised model (solid) and the global model" in a for a in page.alts)
    (row,) = list(csv.DictReader((files / "final.csv").open()))
    summary = json.loads((tmp_path / "run" / "prifedsync" / "summary.json").read_text())
    assert float(row["personalised accuracy"]) == pytest.approx(summary["personalised_accuracy"])
    assert float(row["global accuracy"]) == pytest.approx(summary["global_accuracy"])
    assert "personalised accuracy" in (files / "final.md").read_text()


def test_sweep_report_has_personalised_and_global_over_seeds(tmp_path: Path) -> None:
    import json
    import statistics

    import tomli_w

    (tmp_path / "base.toml").write_text(tomli_w.dumps(PRIFEDSYNC))
    (tmp_path / "s.toml").write_text(
        'base = "base.toml"\nseeds = [0, 1]\nbaseline = false\n'
        '[grid]\n"privacy.noise_multiplier" = [1.0]\n'
    )
    summary = run_grid(load_grid(tmp_path / "s.toml"), tmp_path / "sweep", log=lambda m: None)
    (row,) = summary["rows"]
    cells = sorted((tmp_path / "sweep" / "cells").iterdir())
    finals = [
        json.loads((c / "summary.json").read_text())["runs"][0]["personalised_accuracy"]
        for c in cells
    ]
    assert row["personalised_accuracy_mean"] == pytest.approx(statistics.mean(finals))
    assert row["personalised_accuracy_std"] == pytest.approx(statistics.stdev(finals))
    assert "personalised accuracy" in (tmp_path / "sweep" / "results.md").read_text()
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "sweep"), "--out", str(tmp_path / "s.html")]
    )
    assert result.exit_code == 0, result.output
    page = _read(tmp_path / "s.html")
    assert (tmp_path / "s_files" / "personalised_vs_global.png").read_bytes().startswith(PNG)
    assert any("mean over seeds" in a for a in page.alts)
    assert "personalised_accuracy_std" in " ".join(page.text)

    from silodp.html_report import _personalised_over_seeds

    series = _personalised_over_seeds(
        tmp_path / "sweep", json.loads((tmp_path / "sweep" / "grid.json").read_text())["cells"]
    )
    ((label, curves),) = series.items()
    rounds, means, stds = curves["personalised"]
    per_seed = [
        [
            json.loads(x)["personalised_accuracy"]
            for x in (c / "prifedsync" / "metrics.jsonl").open()
        ]
        for c in cells
    ]
    assert list(rounds) == [1, 2, 3]
    assert means == pytest.approx([statistics.mean(v) for v in zip(*per_seed, strict=True)])
    assert stds == pytest.approx([statistics.stdev(v) for v in zip(*per_seed, strict=True)])


@pytest.mark.parametrize("where", ["existing", "results"])
def test_report_out_that_is_a_directory_is_refused_before_any_figure(
    tmp_path: Path, where: str
) -> None:
    """--out naming a directory (an existing one, or the results themselves) used to fail at
    the last step with "[Errno 21] Is a directory", after writing OUT_files/ full of PNGs."""
    results = tmp_path / "results"
    raw = {**TINY, "algorithms": ["local_item_dp"], "training": {**TINY["training"], "rounds": 1}}
    run_experiment(parse_config(raw), results)
    out = results if where == "results" else tmp_path / "existdir"
    out.mkdir(exist_ok=True)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(app, ["report", str(results), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert (
        f"error: Expected --out {str(out)!r} to be the HTML file to write; it is a directory"
        in result.output
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT_files/
    assert not (tmp_path / f"{out.name}_files").exists()


def test_report_out_over_a_file_that_is_not_a_report_is_refused(
    experiment: Path, tmp_path: Path
) -> None:
    """--out naming an existing file silodp report did not write (here the results' own
    summary.json, or a stray _files directory) is refused before anything is written; a
    report it wrote is replaced."""
    summary = experiment / "summary.json"
    before = summary.read_bytes()
    result = CliRunner().invoke(app, ["report", str(experiment), "--out", str(summary)])
    assert result.exit_code == 2, result.output
    assert f"error: Expected --out {str(summary)!r} to be a new file or a report" in result.output
    assert summary.read_bytes() == before and not (experiment / "summary_files").exists()

    stray = tmp_path / "r_files"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["report", str(experiment), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2, result.output
    assert f"Expected {str(stray)!r} (where the report's figures" in result.output
    assert sorted(p.name for p in stray.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "r.html").exists()

    out = tmp_path / "again.html"
    for _ in range(2):  # its own report is replaced
        result = CliRunner().invoke(app, ["report", str(experiment), "--out", str(out)])
        assert result.exit_code == 0, result.output
    _read(out)


def test_a_public_report_over_a_full_one_leaves_no_silo_private_file(
    experiment: Path, tmp_path: Path
) -> None:
    """A --public report written where a full one was kept the full one's silo-private
    figures in OUT_files/, beside a report said to leave them out."""
    out = tmp_path / "r.html"
    assert CliRunner().invoke(app, ["report", str(experiment), "--out", str(out)]).exit_code == 0
    assert (tmp_path / "r_files" / "data_distribution.png").is_file()
    public = CliRunner().invoke(app, ["report", str(experiment), "--out", str(out), "--public"])
    assert public.exit_code == 0, public.output
    assert not (tmp_path / "r_files" / "data_distribution.png").exists()
    assert (tmp_path / "r_files" / "final.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r_files"]  # no staging
    # a file of the user's in OUT_files/ is never removed: refused
    (tmp_path / "r_files" / "notes.txt").write_text("mine")
    again = CliRunner().invoke(app, ["report", str(experiment), "--out", str(out)])
    assert again.exit_code == 2 and "also holds ['notes.txt']" in again.output
    assert (tmp_path / "r_files" / "notes.txt").read_text() == "mine"


def test_a_run_on_a_shared_ledger_shows_that_ledger_s_total(tmp_path: Path) -> None:
    """The report read totals from DIR/<run>/ledger.sqlite only: runs on a shared ledger
    showed none, and the caption called the run's own ε its ledger's total."""
    ledger = tmp_path / "shared.sqlite"
    raw = {**TINY, "algorithms": ["local_item_dp"], "training": {**TINY["training"], "rounds": 1}}
    raw = {**raw, "privacy": {**TINY["privacy"], "ledger": str(ledger)}}
    run_experiment(parse_config({**raw, "name": "first"}), tmp_path / "a")
    run_experiment(parse_config({**raw, "name": "second"}), tmp_path / "b")
    out = tmp_path / "r.html"
    result = CliRunner().invoke(app, ["report", str(tmp_path / "b"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(_read(out).text)
    assert f"Shared ledger {ledger}" in text
    from silodp.ledger.report import ledger_report

    total = ledger_report(ledger)["total"]["federated"]
    assert len(total["runs"]) == 2
    assert upper(total["epsilon"]["record"], 4) in text
    # with the δ and adversary it is composed at, which may differ from the run's own
    html_text = out.read_text()
    assert "<th>δ</th>" in html_text and "<th>against</th>" in html_text
    assert f"<td>{total['delta']:.4g}</td><td>{total['adversary']}</td>" in html_text


def test_a_report_written_before_the_generator_mark_is_replaced(
    experiment: Path, tmp_path: Path
) -> None:
    out = tmp_path / "old.html"
    out.write_text("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>x")
    result = CliRunner().invoke(app, ["report", str(experiment), "--out", str(out)])
    assert result.exit_code == 0, result.output
    _read(out)


def test_a_sweep_rows_unbounded_epsilon_reads_inf_in_every_epsilon_column() -> None:
    """The largest ε over seeds (the headline since it was added) read "-", the mark of a
    unit not reported, where some seed had no finite bound."""
    from silodp.html_report import _cell, _shown_row

    row = {
        "algorithm": "uldp_avg_w",
        "epsilon_subject_mean": None,
        "epsilon_subject_max": None,
        "epsilon_subject_unbounded": True,
    }
    shown = _shown_row(row)
    assert _cell(shown["epsilon_subject_max"], "epsilon_subject_max") == "inf"
    assert _cell(shown["epsilon_subject_mean"], "epsilon_subject_mean") == "inf"
    assert "epsilon_subject_unbounded" not in shown


@pytest.mark.parametrize(
    ("summary", "said"),
    [('{"runs": [', "to be a JSON file silodp wrote"), ('{"runs": "nope"}', "its runs are str")],
)
def test_a_damaged_summary_is_an_error_naming_the_file(
    tmp_path: Path, summary: str, said: str
) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.json").write_text(summary)
    result = CliRunner().invoke(
        app, ["report", str(tmp_path / "out"), "--out", str(tmp_path / "r.html")]
    )
    assert result.exit_code == 2 and said in result.output
    assert "summary.json" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_prifedsync_sweep_report_can_be_written_again(tmp_path: Path) -> None:
    """A sweep cell's name holds a "/": its figures went into a subdirectory of ``_files``,
    which the second report refused as a file it had not written."""
    raw = {**PRIFEDSYNC, "training": {**PRIFEDSYNC["training"], "rounds": 1}}
    raw["sweep"] = {"client_rate": [0.5], "noise_multiplier": [1.0], "target_accuracy": 0.01}
    run_experiment(parse_config(raw), tmp_path / "run")
    args = ["report", str(tmp_path / "run"), "--out", str(tmp_path / "r.html")]
    for _ in range(2):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    files = tmp_path / "r_files"
    assert not [p for p in files.iterdir() if p.is_dir()]
    assert any(p.name.endswith("_epsilon.png") for p in files.iterdir())


def test_a_sweep_seed_stopped_at_its_target_is_drawn_at_the_epsilon_it_was_charged(
    tmp_path: Path,
) -> None:
    """A seed stopped at its accuracy target after round 2 was charged all 5 planned rounds;
    the sweep's per-round ε curve ended at round 2's lower ε (its own epsilon.png draws the
    charge)."""
    cell = tmp_path / "cells" / "c1"
    (cell / "uldp_avg").mkdir(parents=True)
    rows = [{"round": r, "test_accuracy": 0.5, "epsilon": {"subject": float(r)}} for r in (1, 2)]
    (cell / "uldp_avg" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {
        "algorithm": "uldp_avg",
        "epsilon": {"subject": 4.5},
        "rounds_charged": 5,
        "delta": 1e-5,
        "adversary": "strongest",
    }
    (cell / "summary.json").write_text(json.dumps({"runs": [run]}))
    cells = [{"id": "c1", "values": {"algorithms": ["uldp_avg"]}, "baseline": False}]
    (_, epsilon, _) = _rounds_over_seeds(tmp_path, cells)["all cells"]
    rounds, largest, _ = epsilon["uldp_avg (subject ε)"]
    assert rounds == [1, 2, 5] and largest == [1.0, 2.0, 4.5]
    # interrupted with round 3 charged, not completed: its ε (the ledger's charge) at round 3
    del run["rounds_charged"]
    run["rounds_charged_not_completed"] = [3]
    (cell / "summary.json").write_text(json.dumps({"runs": [run]}))
    (_, epsilon, _) = _rounds_over_seeds(tmp_path, cells)["all cells"]
    rounds, largest, _ = epsilon["uldp_avg (subject ε)"]
    assert rounds == [1, 2, 3] and largest == [1.0, 2.0, 4.5]


def test_sigma_is_shown_rounded_up() -> None:
    """A calibrated σ of 6.2472 was shown as 6.247: copied into a config, that σ gives
    ε = 4.000016 against the target 4. Rounded up, it reaches the target or less."""
    from silodp.html_report import _cell
    from silodp.reports import _cell as table_cell

    assert _cell(6.247241713687909, "σ") == "6.248"
    assert _cell(1.5, "σ") == "1.5"
    assert table_cell("noise_multiplier", 6.241, {}) == "6.25"
    assert table_cell("noise_multiplier", 1.5, {}) == "1.5"


def test_a_sweep_table_shows_the_bound_over_seeds_before_the_mean() -> None:
    from silodp.html_report import _bound_first

    columns = ["algorithm", "epsilon_record_mean", "epsilon_record_std", "epsilon_record_max"]
    columns += ["epsilon_subject_mean", "epsilon_subject_max", "delta"]
    assert _bound_first(columns) == [
        "algorithm",
        "epsilon_record_max",
        "epsilon_record_mean",
        "epsilon_record_std",
        "epsilon_subject_max",
        "epsilon_subject_mean",
        "delta",
    ]
