"""Flower's simulation engine (Ray) runs a 10-silo experiment with the in-process numbers."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
import tomli_w
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_ten_silo_simulation_matches_in_process(tmp_path):
    raw = {
        "name": "sim10",
        "algorithms": ["uldp_avg"],
        "data": {
            "source": "digits",
            "num_silos": 10,
            "num_subjects": 60,
            "max_records": 600,
            "test_fraction": 0.2,
        },
        "model": {"name": "mlp"},
        "training": {"rounds": 2, "local_steps": 1, "batch_size": 16, "lr": 0.5},
        "privacy": {"noise_multiplier": 1.5, "noise": "seeded", "subject_rate": 0.5},
    }
    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps(raw))
    runs = {}
    for engine in ("inprocess", "flower-sim"):
        out = tmp_path / engine
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "silodp.cli",
                "run",
                str(config),
                "--out",
                str(out),
                "--engine",
                engine,
                "--ledger",
                str(tmp_path / f"{engine}.sqlite"),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[engine] = out
    a = torch.load(runs["inprocess"] / "uldp_avg" / "model.pt")
    b = torch.load(runs["flower-sim"] / "uldp_avg" / "model.pt")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    sa, sb = (json.loads((runs[e] / "uldp_avg" / "summary.json").read_text()) for e in runs)
    assert sa["epsilon"] == sb["epsilon"]
    assert sb["aggregation"].startswith("masked sum")
    # the silos' raw records and secrets stay out of --out (they sat in --out/.federation/)
    files = {e: {p.relative_to(runs[e]) for p in runs[e].rglob("*") if p.is_file()} for e in runs}
    assert files["flower-sim"] == files["inprocess"]
    # --ledger reaches the flower-sim run: both ledgers hold the same spending
    totals = {}
    for engine in runs:
        with sqlite3.connect(tmp_path / f"{engine}.sqlite") as db:
            totals[engine] = db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT round) FROM events WHERE kind = 'round'"
            ).fetchone()
    assert totals["flower-sim"] == totals["inprocess"] and totals["inprocess"][1] == 2
