"""Figures whose curves or labels could hide or garble what they show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from silodp import plotting


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    kept: list[Any] = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: kept.append(fig) or path)
    return kept


def test_adversaries_with_the_same_epsilon_share_one_curve(tmp_path: Path, figures) -> None:
    """Released model and server at the same ε (a ULDP run whose silos draw the sample): one
    dashed curve named for both, not two on top of each other; the silos' own curve apart."""
    rows = [
        {
            "round": r,
            "epsilon": {"subject": 4.0 * r},
            "adversary": "strongest",
            "epsilon_by_adversary": {
                "released": {"subject": 3.5 * r},
                "server": {"subject": 3.5 * r},
                "silos": {"subject": 4.0 * r},
            },
        }
        for r in (1, 2, 3)
    ]
    plotting.plot_epsilon(rows, tmp_path / "e.png", "uldp_avg", 1e-5)
    ax = figures[0].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "subject (add/remove), against strongest",
        "subject, against released and server",
    ]
    assert len(ax.get_lines()) == 2


def test_utility_against_epsilon_labels_a_narrow_log_axis_plainly(tmp_path, figures) -> None:
    """ε from 3 to 40 (about one decade): tick labels are plain numbers at 1, 2, 5 × 10^k, and
    no minor tick is labelled (matplotlib's default wrote overlapping "3×10⁰4×10⁰")."""
    rows = [
        {"algorithm": "a", "epsilon_subject_mean": e, "accuracy_mean": 0.5 + e / 100}
        for e in (3.0, 8.0, 40.0)
    ]
    plotting.plot_utility_vs_epsilon(rows, tmp_path / "u.png")
    fig = figures[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    major = [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi]
    minor = [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
    assert {"5", "10", "20"} <= set(major) and not minor
    assert all("×" not in t and "^" not in t for t in major)


def _unbounded_rows() -> list[dict[str, Any]]:
    """uldp_avg_w with clear weights: no finite ε against the silos (``null``), so none
    against every party; 3.5·r against the released model."""
    return [
        {
            "round": r,
            "epsilon": {"subject": None},
            "adversary": "strongest",
            "epsilon_by_adversary": {
                "released": {"subject": 3.5 * r},
                "server": {"subject": None},
                "silos": {"subject": None},
            },
        }
        for r in (1, 2, 3)
    ]


def test_an_epsilon_without_a_finite_bound_is_named_not_left_out(tmp_path, figures) -> None:
    """ε = inf (null) was silently skipped: the headline's legend entry had no line, and an
    adversary whose ε was inf never counted as differing."""
    rows = _unbounded_rows()
    plotting.plot_epsilon(rows, tmp_path / "e.png", "uldp_avg_w", 1e-5)
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == [
        f"subject (add/remove), against strongest ({plotting.NO_BOUND})",
        "subject, against released",
    ]
    finite = [
        {**r, "epsilon": {"subject": 3.5 * r["round"]}, "adversary": "released"} for r in rows
    ]
    plotting.plot_epsilon(finite, tmp_path / "f.png", "uldp_avg_w", 1e-5)
    legend = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert legend == [
        "subject (add/remove), against released",
        f"subject, against server and silos ({plotting.NO_BOUND})",
    ]
    plotting.plot_comparison(
        {"uldp_avg": finite, "uldp_avg_w": rows}, tmp_path / "c.png", delta=1e-5
    )
    right = figures[2].axes[1]
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    # against different adversaries: each curve says its own (one title read as one view)
    assert legend == [
        "uldp_avg (δ=1e-05, against released)",
        f"uldp_avg_w (δ=1e-05, against strongest) ({plotting.NO_BOUND})",
    ]
    assert right.get_title() == "" and "per curve" in right.get_ylabel()
    # at different δ too; at one δ and one adversary the axis says it once
    plotting.plot_comparison(
        {"a": finite, "b": finite}, tmp_path / "d.png", delta={"a": 1e-5, "b": 1e-3}
    )
    legend = [t.get_text() for t in figures[-1].axes[1].get_legend().get_texts()]
    assert legend[0] == "a (δ=1e-05, against released)"
    assert legend[1].startswith("b (δ=0.001, against released)")
    plotting.plot_comparison({"a": finite}, tmp_path / "e.png", delta={"a": 1e-5})
    right = figures[-1].axes[1]
    assert right.get_ylabel() == "subject-level ε at δ=1e-05"
    assert right.get_title() == "ε against released"
    # a record-level experiment: its record ε, not "no private run"
    record = [{**r, "epsilon": {"record": 0.5 * r["round"]}} for r in finite]
    plotting.plot_comparison({"p": record}, tmp_path / "r.png", delta=1e-5)
    assert figures[-1].axes[1].get_ylabel().startswith("record-level ε")
    runs = [
        {"algorithm": "uldp_avg", "epsilon": {"subject": 10.5}},
        {"algorithm": "uldp_avg_w", "epsilon": {"subject": None}},
    ]
    plotting.plot_units(runs, tmp_path / "u.png")
    texts = [t.get_text() for t in figures[-1].axes[0].texts]
    assert "inf" in texts
    labelled = [{**r, "delta": 1e-5, "adversary": "released"} for r in runs]
    plotting.plot_units(labelled, tmp_path / "u3.png")
    assert "at δ=1e-05, against released" in figures[-1].axes[0].get_title()


def test_a_units_figure_with_every_epsilon_inf_is_written(tmp_path: Path) -> None:
    """No bar to draw: the log scale made saving fail, and with it the whole report."""
    runs = [{"algorithm": "uldp_avg_w", "epsilon": {"subject": None}}]
    written = plotting.plot_units(runs, tmp_path / "u.png")
    assert written is not None and written.stat().st_size > 0


def test_a_sweep_run_without_a_finite_epsilon_is_not_drawn_as_the_baseline(
    tmp_path, figures
) -> None:
    """Per-round figure of a sweep: a private run whose ε is inf in every round has no ε
    band; it was drawn grey and dashed, as the non-private baseline is."""
    band = ([1, 2], [0.5, 0.6], [0.0, 0.0])
    accuracy = {"fedavg (non-private)": band, "uldp_avg (subject ε)": band}
    accuracy["uldp_avg_w (subject ε)"] = band
    epsilon = {"uldp_avg (subject ε)": ([1, 2], [1.0, 2.0], [0.0, 0.0])}
    plotting.plot_rounds_over_seeds(accuracy, epsilon, tmp_path / "r.png", "grid point")
    left, right = figures[0].axes
    styles = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in left.lines}
    assert styles["fedavg (non-private)"] == ("grey", "--")
    assert styles["uldp_avg_w (subject ε)"][0] != "grey"
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    assert legend == ["uldp_avg (subject ε)", f"uldp_avg_w (subject ε) ({plotting.NO_BOUND})"]
    # the ε axis says what the ε holds at, once the runs are given
    views = [{"delta": 1e-5, "adversary": "strongest"}] * 2
    plotting.plot_rounds_over_seeds(accuracy, epsilon, tmp_path / "r2.png", "grid point", views)
    label = figures.pop().axes[1].get_ylabel()
    assert "at δ=1e-05, against strongest" in label and "largest over seeds" in label
    rows = [
        {
            "algorithm": "uldp_avg",
            "baseline": False,
            "accuracy_mean": 0.5,
            "epsilon_subject_mean": 2.0,
            "epsilon_subject_std": 0.0,
        },
        {
            "algorithm": "uldp_avg_w",
            "baseline": False,
            "accuracy_mean": 0.6,
            "epsilon_subject_mean": None,
            "epsilon_subject_unbounded": True,
        },
    ]
    plotting.plot_utility_vs_epsilon(rows, tmp_path / "u.png")
    legend = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert f"uldp_avg_w (subject ε) ({plotting.NO_BOUND} in some cells)" in legend


def test_a_finite_record_epsilon_does_not_stand_in_for_an_unbounded_subject_one(
    tmp_path, figures
) -> None:
    """A row whose subject ε is unbounded was drawn at its small record ε, beside other
    algorithms' subject ε, looking the more private."""
    rows = [
        {
            "algorithm": "local_item_dp",
            "baseline": False,
            "accuracy_mean": 0.5,
            "epsilon_record_max": 1.0,
            "epsilon_subject_max": None,
            "epsilon_subject_unbounded": True,
        },
        {
            "algorithm": "uldp_avg",
            "baseline": False,
            "accuracy_mean": 0.6,
            "epsilon_subject_max": 8.0,
        },
    ]
    plotting.plot_utility_vs_epsilon(rows, tmp_path / "u.png")
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == [
        f"local_item_dp (subject ε) ({plotting.NO_BOUND} in some cells)",
        "uldp_avg (subject ε)",
    ]
    assert plotting.epsilon_spread(rows) == 1.0  # one finite point: nothing to spread


def test_cells_against_different_adversaries_are_not_one_trade_off(tmp_path, figures) -> None:
    """A sweep over privacy.adversary at one σ: one line joined the released model's ε and a
    curious silo's, as if ε were traded for accuracy."""
    rows = [
        {
            "algorithm": "uldp_avg",
            "baseline": False,
            "accuracy_mean": 0.5,
            "epsilon_subject_mean": eps,
            "epsilon_subject_std": 0.0,
            "delta": 1e-5,
            "adversary": who,
        }
        for eps, who in ((4.86, "released"), (7.82, "silos"))
    ]
    plotting.plot_utility_vs_epsilon(rows, tmp_path / "u.png")
    ax = figures[0].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "uldp_avg (subject ε, δ=1e-05, against released)",
        "uldp_avg (subject ε, δ=1e-05, against silos)",
    ]
    assert all(len(line.get_xdata()) == 1 for line in ax.lines if line.get_label() in legend)
    one = [{**r, "adversary": "released"} for r in rows]
    plotting.plot_utility_vs_epsilon(one, tmp_path / "v.png")
    legend = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts()]
    assert legend == ["uldp_avg (subject ε)"]


def test_a_cell_charged_its_whole_plan_shows_the_charged_epsilon(tmp_path: Path, figures) -> None:
    """A sweep cell stopped at round 2 of 3 is charged all 3: its curve ended at round 2's ε,
    below the ε it reports, with no mark of the charge."""
    rows = [{"round": r, "epsilon": {"record": 0.5 * r}, "adversary": "strongest"} for r in (1, 2)]
    plotting.plot_epsilon(rows, tmp_path / "e.png", "cell", 1e-5, charged=(3, {"record": 1.6}))
    ax = figures[0].axes[0]
    assert "record: 1.6 charged through round 3" in [t.get_text() for t in ax.texts]
    starred = [line for line in ax.lines if line.get_marker() == "*"]
    assert [(list(s.get_xdata()), list(s.get_ydata())) for s in starred] == [([3], [1.6])]


def test_utility_against_epsilon_ends_its_axis_on_labelled_ticks(tmp_path, figures) -> None:
    """A point at ε = 42.7 stood beyond the last label (20) and read as about 30: the axis now
    runs from the labelled tick at or below the smallest ε to the one at or above the largest."""
    rows = [
        {"algorithm": "a", "epsilon_subject_max": e, "accuracy_mean": 0.5 + e / 100}
        for e in (3.65, 8.13, 42.7)
    ]
    plotting.plot_utility_vs_epsilon(rows, tmp_path / "u.png")
    fig = figures[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_xlim() == pytest.approx((2.0, 50.0))
    labels = {t.get_text() for t in ax.get_xticklabels() if 2.0 <= t.get_position()[0] <= 50.0}
    assert {"2", "50"} <= labels


def test_round_axes_are_ticked_at_whole_rounds(tmp_path, figures) -> None:
    rows = [{"round": r, "epsilon": {"subject": 2.0 * r}, "adversary": "strongest"} for r in (1, 2)]
    plotting.plot_epsilon(rows, tmp_path / "e.png", "uldp_avg", 1e-5)
    ax = figures[0].axes[0]
    figures[0].canvas.draw()
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks)
