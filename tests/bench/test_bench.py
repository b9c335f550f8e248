"""``silodp bench``: each benchmark's core on a tiny configuration (shapes and correctness of
the rows, never timings)."""

from __future__ import annotations

import json
import logging
import math
import time
import warnings

import pytest
import torch
from typer.testing import CliRunner

from silodp.bench import uldp as uldp_bench
from silodp.bench.account import CALIBRATIONS, calibration_rows, config_rows, round_rows
from silodp.bench.common import (
    format_table,
    interleaved_medians,
    interleaved_usage,
    run_worker,
)
from silodp.bench.step import METHODS, estimate_extra_bytes, run_step_bench, step_checks
from silodp.bench.uldp import run_uldp_bench, uldp_checks
from silodp.cli import app

# Opacus' hooks warn that no input requires grad (true of the first layer; harmless here)
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")

STEP_KEYS = {
    "model": str,
    "batch": int,
    "method": str,
    "threads": int,
}


def _number_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and math.isfinite(float(value)))


@pytest.fixture(scope="module")
def step_rows() -> list[dict]:
    return run_step_bench(
        models=("mlp",), batches=(16,), lstm=False, repeats=1, threads=1, measure_rss=False
    )


def test_step_rows_have_keys_and_types(step_rows: list[dict]) -> None:
    assert [r["method"] for r in step_rows] == list(METHODS)
    for row in step_rows:
        for key, kind in STEP_KEYS.items():
            assert isinstance(row[key], kind), (key, row)
        assert row["threads"] == 1
        for key in ("examples_per_s", "ratio_to_plain", "peak_rss_mb"):
            assert key in row and _number_or_none(row[key]), (key, row)
    timed = {r["method"]: r for r in step_rows if "skipped" not in r}
    for method in ("plain", "local_item_dp", "higradavg_uniform", "user_ldp", "vmap"):
        assert timed[method]["examples_per_s"] > 0
    assert timed["plain"]["ratio_to_plain"] == pytest.approx(1.0)
    assert timed["local_group_dp"]["examples_per_s"] == timed["local_item_dp"]["examples_per_s"]
    checks = step_checks(step_rows)
    assert checks and checks[0]["model"] == "mlp"
    assert isinstance(checks[0]["ratio_ok"], bool)
    # the exact noise's cost beside the same step with float32 torch.randn noise
    assert "local_item_dp_float_noise" in timed and "local_item_dp_float_noise" not in (
        checks[0]["slowest_silodp"],
    )
    assert checks[0]["noise_ratio"] == pytest.approx(
        timed["local_item_dp"]["step_ms"] / timed["local_item_dp_float_noise"]["step_ms"]
    )
    assert isinstance(checks[0]["noise_ok"], bool)
    # the per-subject-norm steps against 2x plain, beside their torch routes (the baseline)
    for method in ("subject_norm_uniform_torch", "subject_norm_skewed_torch"):
        assert timed[method]["examples_per_s"] > 0
    assert checks[0]["subject_norm_ratio"] == max(
        timed[m]["ratio_to_plain"] for m in ("subject_norm_uniform", "subject_norm_skewed")
    )
    assert checks[0]["torch_routes_ratio"] == max(
        timed[m]["ratio_to_plain"]
        for m in ("subject_norm_uniform_torch", "subject_norm_skewed_torch")
    )
    assert checks[0]["subject_norm_ok"] == (checks[0]["subject_norm_ratio"] <= 2.0)


def test_the_torch_baseline_of_the_subject_norm_step_is_skipped_without_a_compiled_path() -> None:
    from silodp.bench.step_methods import Skip, build_step

    with pytest.raises(Skip, match="no compiled path"):
        build_step("mnist_cnn", 4, "subject_norm_uniform_torch")
    assert callable(build_step("mlp", 4, "subject_norm_uniform_torch"))


def test_memory_estimate_skips_per_example_gradients_of_big_models() -> None:
    # femnist_cnn (6.6M parameters) at B=512: per-example gradients are ~13.5 GB, twice over
    assert estimate_extra_bytes("femnist_cnn", 512, "opacus_hooks") > 20 * 2**30
    assert estimate_extra_bytes("femnist_cnn", 512, "local_item_dp") == 0.0


def test_worker_reports_peak_rss() -> None:
    out = run_worker(["step", "--model", "mlp", "--batch", "16", "--method", "plain"])
    assert "error" not in out, out
    assert out["peak_rss_mb"] > 10 and out["threads"] == 1


def test_uldp_vectorised_matches_loop() -> None:
    rows = run_uldp_bench(
        sources=("digits",), subject_counts=(20,), repeats=1, threads=1, measure_rss=False
    )
    assert {r["algorithm"] for r in rows} == {"uldp_avg", "uldp_sgd"}
    for row in rows:
        assert row["subjects"] == 20 and row["silo_subject_pairs"] > 0
        assert row["path"] == "vmap"  # the mlp has no convolution
        for key in ("vectorised_s", "loop_s", "speedup", "local_update_s"):
            assert isinstance(row[key], float) and row[key] > 0, key
        assert row["max_abs_diff"] < 1e-4
        assert row["max_abs_delta"] > 0  # the comparison is not vacuous
        for path in ("vectorised", "loop", "local_update"):
            assert row[f"{path}_user_s"] >= 0 and row[f"{path}_sys_s"] >= 0
            assert row[f"{path}_minflt"] >= 0
        # the floor: every real record of the round through the mlp (64-64-10), forward and
        # backward (the first layer's input needs no gradient), at the measured matmul rate
        macs_per_record = 3 * (64 * 64 + 64 * 10) - 64 * 64
        assert row["round_gmac"] * 1e9 == pytest.approx(row["record_passes"] * macs_per_record)
        assert row["floor_s"] == pytest.approx(row["round_gmac"] / row["peak_gmac_s"])
        assert row["max_speedup"] == pytest.approx(row["loop_s"] / row["floor_s"])
        assert row["floor_s"] < row["loop_s"]
    assert all("speedup" in c for c in uldp_checks(rows))


def test_uldp_check_compares_the_papers_setting_with_its_way_timed_side_by_side() -> None:
    """On the paper's setting the check adds a row: the CPU-s of a round run the paper's way
    over local_update's, both user + system, both from the same run (no constant)."""
    row = {
        "source": "fashion_mnist_uldp_cnn",
        "subjects": 100,
        "algorithm": "uldp_avg",
        "speedup": 2.0,
        "local_update_speedup": 2.5,
        "local_update_user_s": 3.0,
        "local_update_sys_s": 0.4,
        "paper_style_user_s": 16.0,
        "paper_style_sys_s": 1.0,
        "max_speedup": 4.5,
    }
    checks = uldp_checks([row])
    assert checks[0]["max_speedup"] == 4.5 and checks[1]["max_speedup"] is None
    assert [c["target"] for c in checks] == [">= 5x", ">= 5x the paper's way, side by side"]
    assert checks[1]["cpu_s"] == pytest.approx(3.4)
    assert checks[1]["paper_cpu_s"] == pytest.approx(17.0)
    assert checks[1]["vs_paper"] == pytest.approx(5.0)
    assert checks[1]["ok"] is True
    assert uldp_checks([{**row, "local_update_user_s": 3.5}])[1]["ok"] is False
    assert uldp_checks([{**row, "paper_style_user_s": 15.0}])[1]["ok"] is False
    # the ratio is the measured round's, never the reported 17 CPU-s (context only)
    assert uldp_checks([{**row, "paper_style_user_s": 1.0}])[1]["vs_paper"] < 1
    no_paper = {k: v for k, v in row.items() if not k.startswith("paper_style")}
    assert len(uldp_checks([no_paper])) == 1


def test_the_papers_way_trains_the_same_deltas_as_the_loop() -> None:
    """With every subject's records in one batch, the order a DataLoader shuffles them into
    cannot change a step, so the paper's way (model copy, optimiser, DataLoader) must give the
    loop's deltas: the stand-in times the same arithmetic."""
    from silodp.privacy.per_subject import per_subject_deltas_loop, subject_batches
    from silodp.privacy.randomness import Coins

    fed = uldp_bench.build_federation("digits", 20)
    loaders = uldp_bench.paper_style_loaders(
        fed, batch_size=10_000, generator=torch.Generator().manual_seed(0)
    )
    compared = 0
    for silo, silo_loaders in zip(fed.silos, loaders, strict=True):
        order = torch.unique(silo.subject)
        assert len(silo_loaders) == len(order)
        plan = subject_batches(
            silo.subject, order, epochs=3, batch_size=None, coins=Coins.seeded(1)
        )
        ref = per_subject_deltas_loop(fed.model, fed.params, silo.x, silo.y, plan, lr=0.1)
        got = uldp_bench.paper_style_deltas(fed, silo_loaders, 0.1, epochs=3)
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.allclose(a[k], b[k], atol=1e-5), k
                compared += int(b[k].abs().max() > 0)
    assert compared > 0  # the deltas are not all zero
    # the comparison tells a wrong learning rate or epoch count apart
    for lr, epochs in ((0.2, 3), (0.1, 2)):
        other = uldp_bench.paper_style_deltas(fed, loaders[-1], lr, epochs=epochs)
        assert not all(torch.allclose(other[0][k], ref[0][k], atol=1e-5) for k in ref[0])


def test_the_papers_way_is_timed_beside_the_rest_where_it_applies(monkeypatch) -> None:
    monkeypatch.setattr(uldp_bench, "PAPER_STYLE", frozenset({("digits", "uldp_avg")}))
    rows = run_uldp_bench(
        sources=("digits",),
        subject_counts=(100,),
        algorithms=("uldp_avg", "uldp_sgd"),
        repeats=1,
        threads=1,
        measure_rss=False,
    )
    timed = {r["algorithm"]: r["paper_style_s"] for r in rows}
    assert timed["uldp_sgd"] is None
    assert isinstance(timed["uldp_avg"], float) and timed["uldp_avg"] > 0
    (avg,) = (r for r in rows if r["algorithm"] == "uldp_avg")
    assert avg["paper_style_user_s"] >= 0 and avg["paper_style_sys_s"] >= 0
    checks = [c for c in uldp_checks(rows) if c["algorithm"] == "uldp_avg"]
    assert [c["target"] for c in checks] == [">= 5x", ">= 5x the paper's way, side by side"]
    assert checks[1]["vs_paper"] == pytest.approx(checks[1]["paper_cpu_s"] / checks[1]["cpu_s"])


def test_uldp_peak_rss_in_fresh_processes() -> None:
    (row,) = run_uldp_bench(
        sources=("digits",), subject_counts=(20,), algorithms=("uldp_sgd",), repeats=1
    )
    assert "vectorised_rss_error" not in row and "loop_rss_error" not in row, row
    assert row["peak_rss_mb"] >= 0 and row["loop_peak_rss_mb"] >= 0
    assert row["baseline_rss_mb"] > 10


def test_account_rows() -> None:
    cheap = [c for c in CALIBRATIONS if c.algorithm in ("user_ldp", "uldp_avg")]
    rows = calibration_rows(calibrations=cheap, rounds=5)
    for row in rows:
        assert row["sigma_all"] <= row["sigma_rdp"] * 1.01  # PLD is never looser
        assert row["epsilon_at_sigma_all"] <= row["target_epsilon"] + 1e-9
        assert row["pld_evals"] > 0 and row["pld_phase_s"] > 0
    per_round = round_rows(checkpoints=(2, 4), samples=1, calibrations=cheap)
    assert [r["rounds_composed"] for r in per_round] == [2, 4, 2, 4]
    for row in per_round:
        assert row["round_s"] > 0 and row["epsilon"] > 0 and row["growth"] > 0
        assert row["round_s_full"] > 0 and row["growth_full"] > 0
        # the bounded composition never reports less than the full-support one
        assert row["epsilon"] >= row["epsilon_full"]


def test_account_config_rows(tmp_path) -> None:
    """A shipped-style config gets a row per calibrated algorithm; one whose data is missing
    gets a row saying it was not run."""
    from pathlib import Path

    smoke = (Path(__file__).parents[2] / "configs" / "smoke.toml").read_text()
    quick = smoke.replace(
        'algorithms = ["fedavg", "local_item_dp", "local_group_dp", "higradavg_dp", "user_ldp"]',
        'algorithms = ["fedavg", "user_ldp"]',
    )
    assert quick != smoke
    (tmp_path / "a.toml").write_text(quick)
    (tmp_path / "b.toml").write_text(
        quick.replace('source = "digits"', 'source = "csv"\npath = "no/such/file.csv"')
    )
    rows = config_rows(tmp_path)
    assert [(r["config"], r.get("algorithm")) for r in rows] == [
        ("a.toml", "user_ldp"),
        ("b.toml", None),
    ]
    assert rows[0]["calibrate_s"] >= 0
    assert rows[0]["sigma"] > 0
    assert rows[0]["met"] == (rows[0]["calibrate_s"] < rows[0]["target_s"])
    assert rows[1]["note"].startswith("not run")


def test_interleaved_medians_drops_failing_function() -> None:
    errors: list[str] = []

    def boom() -> None:
        raise RuntimeError("no")

    out = interleaved_medians(
        {"ok": lambda: None, "bad": boom},
        repeats=2,
        on_error=lambda name, err: errors.append(name),
    )
    assert set(out) == {"ok"} and errors == ["bad"]


def test_interleaved_usage_counts_cpu_time_and_page_faults() -> None:
    """A call that touches fresh pages shows them as minor faults, a busy loop as user time."""
    import mmap

    def touch() -> None:
        with mmap.mmap(-1, 64 * 4096) as area:  # a fresh mapping: every page faults in
            for page in range(64):
                area[page * 4096] = 1

    def spin() -> None:
        sum(range(200_000))

    out = interleaved_usage({"touch": touch, "spin": spin}, repeats=3, warmup=0)
    assert out["touch"].minor_faults >= 32
    assert out["spin"].user_s > 0 and out["spin"].wall_s > 0
    assert interleaved_medians({"spin": spin}, repeats=1, warmup=0)["spin"] > 0


def test_calls_per_sample_are_sized_past_a_slow_first_call() -> None:
    """A step whose first call pays a 0.1 s set-up is still timed over many calls per
    sample (sized by its second call), not one cold call each."""
    count = []

    def step() -> None:
        count.append(1)
        time.sleep(0.1 if len(count) == 1 else 0.001)

    interleaved_usage({"step": step}, repeats=1, warmup=1, min_sample_s=0.05, max_calls=50)
    # 1 (first) + 1 (second, sizing) + the measured pass: up to 50 calls of ~1 ms; sized by
    # the first call it would be 1 (0.05 s / 0.1 s). At least 5 unless a 1 ms sleep takes 10.
    assert len(count) - 2 >= 5


def test_format_table() -> None:
    text = format_table([{"a": "x", "b": 1.5}, {"a": "yy", "b": None}], ["a", "b"])
    lines = text.splitlines()
    assert lines[0].startswith("| a") and len(lines) == 4 and "-" in lines[3]


def test_cli_step_json() -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench", "step", "--model", "mlp", "--batch", "16", "--repeats", "1",
            "--no-lstm", "--no-rss", "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    step = [r for r in rows if r["table"] == "step"]
    assert {r["method"] for r in step} == set(METHODS)
    for row in step:
        assert set(STEP_KEYS) | {"examples_per_s", "ratio_to_plain", "peak_rss_mb"} <= set(row)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch", "0"], "0 is not in the range x>=1"),
        (["--model", "nosuchmodel"], "Expected --model in ['femnist_cnn', 'mlp'"),
    ],
)
def test_cli_step_refuses_bad_models_and_batches_naming_them(args, message) -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--no-rss", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_a_bench_command_leaves_the_log_and_warnings_as_it_found_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Run in-process (as here, under CliRunner), a bench command used to leave silodp's log
    at ERROR and every warning ignored for the rest of the process."""
    filters = list(warnings.filters)
    result = CliRunner().invoke(app, ["bench", "step", "--no-rss", "--model", "nosuchmodel"])
    assert result.exit_code == 2
    assert warnings.filters == filters
    logging.getLogger("silodp.data.loaders").warning("heard after the bench")
    assert "heard after the bench" in caplog.text
