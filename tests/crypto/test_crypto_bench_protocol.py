"""The protocol benchmark's building blocks on a tiny, insecure-key grid point."""

from __future__ import annotations

import json

import pytest
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


def test_target_rows_put_bfv_beside_the_paillier_cost_model() -> None:
    from silodp.bench.protocol import TARGET_COLUMNS, target_rows

    targets = [
        ("small", 2, 6, 7, 300, 8, True),
        ("too_large_for_paillier", 3, 6, 9, 300, 3000, False),
    ]
    rows = target_rows(targets, sample_pairs=3)
    small, large = rows
    assert small["bfv_moduli"] >= 1 and small["paillier_slots"] >= 1
    assert small["max_abs_error"] < 1e-9
    assert small["ratio"] > 0
    assert small["ratio"] == pytest.approx(small["paillier_cpu_min"] / small["bfv_cpu_min"])
    assert small["round_ok"] == "yes" and "measured" in small["bfv_how"]
    # n_max = 3000 overflows a 3072-bit Paillier plaintext; BFV adds CRT primes instead
    assert large["paillier_cpu_min"] is None and large["ratio"] is None
    assert large["bfv_moduli"] > small["bfv_moduli"] and "extrapolated" in large["bfv_how"]
    table = format_rows(rows, TARGET_COLUMNS, as_json=False)
    assert table.splitlines()[0].replace(" ", "").startswith("|target|silos|")


def test_run_bfv_round_reports_a_whole_round_and_its_error() -> None:
    from silodp.bench.protocol import run_bfv_round

    row = run_bfv_round(3, 12, records=60, dim=50, n_max=60)
    assert row["pairs"] > 0 and row["moduli"] >= 1
    assert row["round_cpu_s"] > 0 and row["silo_weighting_s"] > 0
    assert row["max_abs_error"] < 1e-9


def test_format_rows_tags_json_rows_with_their_table_and_aligns_text_left() -> None:
    rows = [{"target": "uniform", "ratio": 55.1}, {"target": "zipf", "ratio": None}]
    lines = format_rows(rows, ["target", "ratio"], as_json=True, table="targets").splitlines()
    assert [json.loads(line)["table"] for line in lines] == ["targets", "targets"]
    text = format_rows(rows, ["target", "ratio"], as_json=False).splitlines()
    assert text[2].startswith("| uniform |") and text[3].startswith("| zipf    |")
