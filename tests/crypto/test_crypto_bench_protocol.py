"""The protocol benchmark's building blocks on a tiny, insecure-key grid point."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from silodp.bench.protocol import COLUMNS, format_rows, register, run_point


def test_run_point_reports_phases_and_matches_the_phe_baseline() -> None:
    row = run_point(
        6, 4, records=300, n_max=300, insecure_test_key_bits=768, baseline_sample=4, workers=1
    )
    for key in ("params", "users", "silodp_s", "baseline_s", "speedup", "max_abs_error"):
        assert key in row
    assert row["params"] == 6 and row["users"] == 4 and row["key_bits"] == 768
    assert row["baseline_measured"] == 4
    assert row["baseline_max_abs_diff"] == 0.0  # identical decoded values
    assert row["max_abs_error"] < 1e-9
    assert row["silodp_s"] > 0 and row["speedup"] > 0
    assert row["slots"] == 1  # n_max = 300 leaves no room for a second coordinate
    lines = format_rows([row], COLUMNS, as_json=True).splitlines()
    assert json.loads(lines[0])["params"] == 6
    table = format_rows([row], COLUMNS, as_json=False)
    assert table.splitlines()[0].startswith("| params")


def test_small_n_max_packs_coordinates_and_still_matches_the_baseline() -> None:
    row = run_point(
        64, 4, records=40, n_max=40, insecure_test_key_bits=768, baseline_sample=8, workers=1
    )
    assert row["slots"] > 1
    assert row["baseline_max_abs_diff"] == 0.0
    assert row["max_abs_error"] < 1e-9


def test_register_adds_the_protocol_command() -> None:
    app = typer.Typer()
    register(app)

    @app.command("other")
    def other() -> None:  # a second command keeps typer in group mode
        pass

    result = CliRunner().invoke(app, ["protocol", "--help"])
    assert result.exit_code == 0, result.output
    assert "--quick" in result.output and "--json" in result.output


def test_protocol_rows_report_progress_per_grid_point(monkeypatch) -> None:
    import silodp.bench.protocol as bench

    calls = []

    def fake(params, users, *, records, n_max, baseline_sample):
        calls.append((params, users, records, n_max, baseline_sample))
        return {"params": params, "users": users}

    monkeypatch.setattr(bench, "run_point", fake)
    lines: list[str] = []
    rows = bench.protocol_rows(True, progress=lines.append)
    assert len(rows) == len(lines) == len(bench.QUICK_GRID) == len(calls)
    assert lines[0].startswith(f"[1/{len(bench.QUICK_GRID)}] params=16 users=10 n_max=2000")
    assert [c[:4] for c in calls] == [tuple(g) for g in bench.QUICK_GRID]
