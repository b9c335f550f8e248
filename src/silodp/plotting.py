"""Figures of a run (matplotlib, Agg backend). Only the runner and CLI import this module."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from silodp import display  # noqa: E402
from silodp.io import atomic_write  # noqa: E402

__all__ = [
    "held_at",
    "plot_batch_histograms",
    "plot_comparison",
    "plot_data_distribution",
    "plot_epsilon",
    "plot_personalised",
    "plot_personalised_over_seeds",
    "plot_subject_sampling",
    "plot_subject_weights",
    "plot_training",
    "plot_units",
    "plot_utility_vs_epsilon",
    "save_figure",
    "weight_histograms",
]

Metrics = Sequence[Mapping[str, Any]]


def save_figure(fig: Any, path: Path) -> Path:
    """Writes ``fig`` to ``path`` as a PNG (whole or not at all) and closes it."""
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def _series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    rows = [(m["round"], m[key]) for m in metrics if m.get(key) is not None]
    return [r for r, _ in rows], [v for _, v in rows]


def plot_training(metrics: Metrics, path: Path, title: str) -> Path:
    """Test accuracy and loss against round."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (left, "test_accuracy", "test accuracy"),
        (right, "test_loss", "test loss"),
    ):
        rounds, values = _series(metrics, key)
        ax.plot(rounds, values, marker="o", markersize=3)
        ax.set_xlabel("round")
        _whole_rounds(ax)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_epsilon(
    metrics: Metrics,
    path: Path,
    title: str,
    delta: float,
    charged: tuple[int, Mapping[str, float | None]] | None = None,
) -> Path:
    """ε per privacy unit against round: the headline ε (solid, against the run's
    ``adversary``) and, dashed, the ε against each adversary whose ε differs from it.
    ``charged``: (rounds, headline ε per unit) of a run stopped early but charged every
    planned round (a sweep cell at its accuracy target), drawn as a marker at that round."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    units = sorted({u for m in metrics for u in m.get("epsilon", {})})
    adjacency = next((m["adjacency"] for m in metrics if "adjacency" in m), None)
    against = next((m["adversary"] for m in metrics if m.get("adversary")), None)
    for unit in units:
        label = unit + f" ({adjacency_at(adjacency, unit)})"
        label += f", against {against}" if against else ""
        _curve(ax, metrics, lambda m, u=unit: m["epsilon"].get(u), label=label)
        # adversaries whose ε differs from the headline; those with the same curve share one
        # line (drawn apart, one would hide the other)
        same: dict[tuple[Any, ...], list[str]] = {}
        for who in ("released", "server", "silos"):

            def value(m: Mapping[str, Any], u: str = unit, w: str = who) -> Any:
                return m.get("epsilon_by_adversary", {}).get(w, {}).get(u)

            def reports(m: Mapping[str, Any], u: str = unit, w: str = who) -> bool:
                return u in m.get("epsilon_by_adversary", {}).get(w, {})

            # None is ε = inf: it differs from a finite headline as much as any number
            if any(value(m) != m["epsilon"].get(unit) for m in metrics if reports(m)):
                same.setdefault(tuple(value(m) for m in metrics), []).append(who)
        for whom in same.values():

            def shared(m: Mapping[str, Any], u: str = unit, w: str = whom[0]) -> Any:
                return m.get("epsilon_by_adversary", {}).get(w, {}).get(u)

            label = f"{unit}, against {' and '.join(whom)}"
            _curve(ax, metrics, shared, label=label, linestyle="--")
    if charged is not None:
        rounds, epsilon = charged
        for unit in units:
            at_end = epsilon.get(unit)
            if at_end is not None:
                ax.plot([rounds], [at_end], marker="*", markersize=11, linestyle="none", color="k")
                ax.annotate(
                    f"{unit}: {display.upper(at_end)} charged through round {rounds}",
                    (rounds, at_end),
                    textcoords="offset points",
                    xytext=(-6, 6),
                    ha="right",
                    fontsize=8,
                )
    ax.set_xlabel("round")
    _whole_rounds(ax)
    ax.set_ylabel(f"ε at δ={delta:g}")
    if units:
        ax.legend(title="unit", fontsize=8)
        replaced = [u for u in units if adjacency_at(adjacency, u) == "replace-one"]
        if replaced:
            ax.text(
                0.01,
                0.99,
                f"{', '.join(replaced)}: replace-one adjacency, not comparable with add/remove ε",
                transform=ax.transAxes,
                va="top",
                fontsize=8,
            )
    else:
        ax.text(0.5, 0.5, "not private", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    return save_figure(fig, path)


def adjacency_at(adjacency: str | Mapping[str, str] | None, unit: str) -> str:
    """The adjacency of the guarantee at ``unit``: a run's metrics hold one name for all its
    units, a mapping ``{unit: name}`` where they differ (user_ldp), or nothing (add/remove)."""
    if adjacency is None:
        return "add/remove"
    return adjacency if isinstance(adjacency, str) else adjacency.get(unit, "add/remove")


#: what a legend says of an ε curve that has no finite bound (stored as ``null``)
NO_BOUND = "inf: no guarantee, not drawn"


def _curve(ax: Any, metrics: Metrics, value: Any, *, label: str, **style: Any) -> None:
    """``value(m)`` against round; rounds where it is ``None`` (an ε with no finite bound)
    are not drawn, and the legend says from which round on."""
    rows = [(m["round"], value(m)) for m in metrics if value(m) is not None]
    unbounded = [m["round"] for m in metrics if value(m) is None]
    if unbounded:
        since = "" if not rows else f" from round {unbounded[0]}"
        label = f"{label} ({NO_BOUND}{since})"
    ax.plot(
        [r for r, _ in rows], [v for _, v in rows], marker="o", markersize=3, label=label, **style
    )


def plot_batch_histograms(metrics: Metrics, path: Path, title: str) -> Path:
    """Histograms of the largest subject group per mini-batch and distinct subjects per batch."""
    groups = [g for m in metrics for g in m.get("largest_group_per_batch", [])]
    distinct = [d for m in metrics for d in m.get("subjects_per_batch", [])]
    # one panel per diagnostic the algorithm reports (the ULDP methods report no batches'
    # largest group: their "batch" is the subjects sampled in a silo)
    panels = [p for p in ("groups", "distinct") if (groups if p == "groups" else distinct)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4))
    axes = list(np.atleast_1d(axes))
    for ax, panel in zip(axes, panels, strict=False):
        if panel == "groups":
            ax.hist(groups, bins=range(0, max(groups) + 2), align="left", rwidth=0.85)
            ax.set_xlabel("records of the largest subject in a mini-batch")
        else:
            ax.hist(distinct, bins=min(30, max(distinct) + 1), rwidth=0.85)
            ax.set_xlabel("distinct subjects in a mini-batch")
        ax.set_ylabel("mini-batches")
    fig.suptitle(title)
    return save_figure(fig, path)


#: one marker per algorithm in the comparison, so that overlapping curves stay told apart
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


#: ε curves closer than this (relative, every round) are drawn as overlapping and labelled
OVERLAP = 0.02


def _overlap(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]]) -> str | None:
    """``"same"`` if two ε curves are equal, ``"close"`` if within :data:`OVERLAP` at every
    round (they overlap on the plot), else ``None``."""
    if len(a) != len(b) or any(r != s for (r, _), (s, _) in zip(a, b, strict=True)):
        return None
    gaps = [abs(u - v) / max(abs(u), abs(v), 1e-12) for (_, u), (_, v) in zip(a, b, strict=True)]
    if max(gaps, default=0.0) <= 1e-9:
        return "same"
    return "close" if max(gaps, default=0.0) <= OVERLAP else None


def plot_comparison(
    runs: Mapping[str, Metrics],
    path: Path,
    *,
    unit: str = "subject",
    delta: float | Mapping[str, float],
) -> Path:
    """Utility against round (left) and ε at ``unit`` against round (right), all methods
    (``unit``: the first of subject, silo, record that a run reports when none reports it).
    ``delta``: the runs' δ, or each run's by name; runs at different δ or against different
    adversaries say theirs in their labels."""
    deltas = {n: delta if isinstance(delta, int | float) else delta[n] for n in runs}
    adversaries = {
        n: next((m["adversary"] for m in ms if m.get("adversary")), None) for n, ms in runs.items()
    }
    reported = {u for ms in runs.values() for m in ms for u in m.get("epsilon", {})}
    if unit not in reported:
        unit = next((u for u in ("subject", "silo", "record") if u in reported), unit)
    one_view = len(set(deltas.values())) <= 1 and len(set(adversaries.values()) - {None}) <= 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: dict[str, list[tuple[int, float]]] = {}  # ε curves drawn so far, by algorithm
    for i, (name, metrics) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        marker = MARKERS[i % len(MARKERS)]
        rounds, acc = _series(metrics, "test_accuracy")
        left.plot(rounds, acc, marker=marker, markersize=3, label=name, color=colour)
        rows = [
            (m["round"], m["epsilon"][unit])
            for m in metrics
            if m.get("epsilon", {}).get(unit) is not None
        ]
        unbounded = [
            m["round"] for m in metrics if unit in m.get("epsilon", {}) and not _finite(m, unit)
        ]
        replace_one = any(adjacency_at(m.get("adjacency"), unit) == "replace-one" for m in metrics)
        if rows:
            # algorithms calibrated to one target often share their ε curve exactly: say so,
            # and draw the later one with open markers so that both stay visible
            close = [(o, _overlap(curve, rows)) for o, curve in drawn.items()]
            same, how = next(((o, h) for o, h in close if h), (None, None))
            label = name + (" (replace-one ε: not comparable)" if replace_one else "")
            if not one_view:
                label += f" (δ={deltas[name]:g}, against {adversaries[name] or '–'})"
            if same:
                label += (
                    f" (same ε as {same})"
                    if how == "same"
                    else f" (ε within {OVERLAP:.0%} of {same})"
                )
            right.plot(
                [r for r, _ in rows],
                [v for _, v in rows],
                marker=marker,
                markersize=7 if same else 3,
                markerfacecolor="none" if same else colour,
                label=label,
                color=colour,
                linestyle=":" if replace_one else ("--" if same else "-"),
            )
            drawn[name] = rows
        if unbounded:  # listed, so that a method without a finite ε is not simply missing
            since = "" if not rows else f" from round {unbounded[0]}"
            view = "" if one_view else f" (δ={deltas[name]:g}, against {adversaries[name] or '–'})"
            right.plot(
                [], [], color=colour, marker=marker, label=f"{name}{view} ({NO_BOUND}{since})"
            )
    left.set_xlabel("round")
    _whole_rounds(left)
    left.set_ylabel("test accuracy")
    left.grid(alpha=0.3)
    left.legend()
    right.set_xlabel("round")
    _whole_rounds(right)
    if one_view:
        shown = next(iter(deltas.values()), None)
        right.set_ylabel(f"{unit}-level ε" + (f" at δ={shown:g}" if shown is not None else ""))
        against = next((a for a in adversaries.values() if a), None)
        if against:
            right.set_title(f"ε against {against}", fontsize=10)
    else:  # each curve's label carries its δ and adversary
        right.set_ylabel(f"{unit}-level ε (δ, adversary: per curve)")
    if right.lines:
        if any(v > 0 for line in right.lines for v in line.get_ydata()):
            right.set_yscale("log")
        right.legend(fontsize="small", loc="best")
    else:
        right.text(
            0.5, 0.5, "no run reports an ε", ha="center", va="center", transform=right.transAxes
        )
    right.grid(alpha=0.3)
    return save_figure(fig, path)


def _finite(m: Mapping[str, Any], unit: str) -> bool:
    return m.get("epsilon", {}).get(unit) is not None


def plot_personalised(
    runs: Mapping[str, Metrics], path: Path, title: str, *, target: float | None = None
) -> Path:
    """Personalised (solid) and global (dashed) models' mean accuracy over clients' own test
    splits against round, one colour per run (PriFedSync's personalisation figure)."""
    fig, ax = plt.subplots(figsize=(7.5 + (3.0 if len(runs) > 1 else 0.0), 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, metrics) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        rounds, acc = _series(metrics, "personalised_accuracy")
        ax.plot(rounds, acc, color=colour, label=f"{name} personalised")
        rounds, acc = _series(metrics, "global_accuracy")
        ax.plot(rounds, acc, color=colour, linestyle="--", label=f"{name} global")
    if target is not None:
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label="target")
    ax.set_xlabel("synchronisation round")
    _whole_rounds(ax)
    ax.set_ylabel("mean test accuracy over clients")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize="x-small")
    ax.set_title(title)
    return save_figure(fig, path)


def grid_epsilon(row: Mapping[str, Any], unit: str) -> float | None:
    """A grid point's ε at ``unit``: the largest over its seeds (rows written before that was
    kept: the mean)."""
    value = row.get(f"epsilon_{unit}_max", row.get(f"epsilon_{unit}_mean"))
    return None if value is None else float(value)


def _reports(row: Mapping[str, Any], unit: str) -> bool:
    """Whether a grid row has an ε at ``unit``, finite or not."""
    return grid_epsilon(row, unit) is not None or bool(row.get(f"epsilon_{unit}_unbounded"))


def held_at(runs: Sequence[Mapping[str, Any]]) -> str:
    """``" at δ=1e-05, against strongest"`` when every run's ε is at one δ and against one
    adversary, else a pointer to where each run says it."""
    deltas = {r.get("delta") for r in runs}
    against = {r.get("adversary") for r in runs}
    if len(deltas) == 1 and len(against) == 1 and None not in deltas | against:
        return f" at δ={deltas.pop():g}, against {against.pop()}"
    return " (δ and adversary differ between runs: see each run's summary)"


def plot_units(runs: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Final ε at each unit, one group of bars per algorithm (log scale); ``None`` when no run
    is private."""
    private = [r for r in runs if r.get("epsilon")]
    if not private:
        return None
    units = sorted({u for r in private for u in r["epsilon"]})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(private)), 4))
    width = 0.8 / len(units)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, unit in enumerate(units):
        colour = colours[j % len(colours)]
        xs = [i + (j - (len(units) - 1) / 2) * width for i in range(len(private))]
        values = [r["epsilon"].get(unit) for r in private]
        bars = ax.bar(
            [x for x, v in zip(xs, values, strict=True) if v is not None],
            [v for v in values if v is not None],
            width=width,
            label=unit,
            color=colour,
        )
        ax.bar_label(bars, labels=[display.upper(v) for v in values if v is not None], fontsize=7)
        # a unit reported without a finite bound (null): no bar can be drawn, so say so
        for x, r in zip(xs, private, strict=True):
            if unit in r["epsilon"] and r["epsilon"][unit] is None:
                ax.annotate(
                    f"{unit}: inf" if len(units) > 1 else "inf",
                    (x, 0.02),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=colour,
                )
    ax.set_xticks(range(len(private)), [r["algorithm"] for r in private], rotation=15)
    ax.set_xlim(-0.5, len(private) - 0.5)  # every group, also one with no bar drawn
    drawn = [v for r in private for v in r["epsilon"].values() if v is not None]
    if drawn:
        ax.set_yscale("log")
    else:  # every ε is inf: nothing to scale, the annotations say it
        ax.set_yticks([])
    ax.set_ylabel("final ε")  # the axis is short: what the ε hold for goes in the title
    ax.set_title(f"ε{held_at(private)}; inf: no guarantee at that unit", fontsize=9)
    ax.legend(title="unit")
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, path)


def plot_data_distribution(data: Mapping[str, Any], path: Path) -> Path:
    """Records per silo, the histogram of records per subject and of silos per subject."""
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    per_silo = data.get("records_per_silo", [])
    a.bar(range(len(per_silo)), per_silo)
    a.set_xlabel("silo")
    a.set_ylabel("records")
    bins = data.get("records_per_subject", {}).get("histogram", [])
    b.bar(
        [f"{h['lo']}" if h["lo"] == h["hi"] else f"{h['lo']}-{h['hi']}" for h in bins],
        [h["count"] for h in bins],
    )
    b.tick_params(axis="x", rotation=45, labelsize=7)
    b.set_xlabel("records per subject")
    b.set_ylabel("subjects")
    spans = data.get("span", {}).get("histogram", {})
    c.bar(list(spans), list(spans.values()))
    c.set_xlabel("silos per subject")
    c.set_ylabel("subjects")
    fig.suptitle("the training data (silo-private: exact counts)")
    return save_figure(fig, path)


def plot_utility_vs_epsilon(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Final accuracy (mean ± std over seeds) against final ε (the largest over seeds: the
    bound every seed's run meets) per algorithm, at the subject unit where an algorithm
    reports it, else its other unit; the non-private baseline as a dashed line. ``None``
    when no row has an ε."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float, float, float]]] = {}
    unbounded: list[str] = []  # algorithms with no finite ε at their unit in some cell
    views = {(r.get("delta"), r.get("adversary")) for r in rows if r.get("adversary")}

    def view(row: Mapping[str, Any]) -> str:
        """Where cells differ in δ or adversary, one line per (δ, adversary): their ε are
        not points of one trade-off."""
        if len(views) <= 1 or row.get("adversary") is None:
            return ""
        delta = row.get("delta")
        shown = f"{delta:g}" if isinstance(delta, int | float) else "?"
        return f", δ={shown}, against {row['adversary']}"

    for row in rows:
        # the first unit the row reports: a finite record ε must not stand in for an
        # unbounded subject ε (the run would look more private than it is)
        unit = next((u for u in ("subject", "record", "silo") if _reports(row, u)), None)
        if unit is not None and row.get(f"epsilon_{unit}_unbounded"):
            label = f"{row['algorithm']} ({unit} ε{view(row)})"
            if label not in unbounded:  # no finite bound in some seed: named in the legend
                unbounded.append(label)
            unit = None
        if row.get("baseline") and row.get("accuracy_mean") is not None:
            ax.axhline(row["accuracy_mean"], color="grey", linestyle="--", linewidth=1)
        bound = grid_epsilon(row, unit) if unit is not None else None
        if bound is None or row.get("accuracy_mean") is None:
            continue
        series.setdefault(f"{row['algorithm']} ({unit} ε{view(row)})", []).append(
            (
                bound,
                0.0,  # the largest over seeds: a bound, no spread
                row["accuracy_mean"],
                row.get("accuracy_std") or 0.0,
            )
        )
    if not series:
        plt.close(fig)
        return None
    for label in unbounded:
        ax.plot([], [], color="grey", label=f"{label} ({NO_BOUND} in some cells)")
    for i, (label, points) in enumerate(series.items()):
        points.sort()
        ax.errorbar(
            [p[0] for p in points],
            [p[2] for p in points],
            xerr=[p[1] for p in points],
            yerr=[p[3] for p in points],
            marker=MARKERS[i % len(MARKERS)],
            capsize=3,
            label=label,
        )
    ax.set_xscale("log")
    # ticks at 1, 2 and 5 of each decade, as plain numbers: matplotlib's default labels the
    # minor ticks of a narrow range as "3×10⁰", which overlap
    ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    # the axis ends on labelled ticks: a point at 42.7 beyond the last label (20) read as ~30
    xs = [p[0] for points in series.values() for p in points]
    if min(xs) > 0 and math.isfinite(max(xs)):
        ax.set_xlim(_tick_at_or_below(min(xs)), _tick_at_or_above(max(xs)))
    private = [r for r in rows if r.get("adversary") is not None]
    ax.set_xlabel(f"final ε, largest over seeds{held_at(private) if private else ''}")
    ax.set_ylabel("final test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, path)


def _whole_rounds(ax: Any) -> None:
    """Round axes are ticked at whole rounds only (not 1.2, 1.4, ... on a short run)."""
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def _ticks_around(value: float) -> list[float]:
    """The 1-2-5 ticks of the log ε axis around ``value`` > 0."""
    decade = math.floor(math.log10(value))
    return [m * 10.0**e for e in (decade - 1, decade, decade + 1) for m in (1.0, 2.0, 5.0)]


def _tick_at_or_below(value: float) -> float:
    return max(t for t in _ticks_around(value) if t <= value * (1 + 1e-12))


def _tick_at_or_above(value: float) -> float:
    return min(t for t in _ticks_around(value) if t >= value * (1 - 1e-12))


def epsilon_spread(rows: Sequence[Mapping[str, Any]]) -> float:
    """The ratio of the largest to the smallest final ε among a sweep's rows (1.0 when every
    private cell ends at the same ε, as cells calibrated to one target do; then an accuracy
    against ε figure is a vertical line)."""
    values: list[float] = []
    for row in rows:  # at the unit plot_utility_vs_epsilon draws for the row
        unit = next((u for u in ("subject", "record", "silo") if _reports(row, u)), None)
        bound = grid_epsilon(row, unit) if unit is not None else None
        if bound and not row.get(f"epsilon_{unit}_unbounded"):
            values.append(bound)
    return max(values) / min(values) if values else 1.0


def _grid_label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in keys if k in row) or "all"


def plot_accuracy_by_grid(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Final accuracy (mean ± std over seeds) per algorithm at each grid point of a sweep, as
    grouped bars; the non-private baseline is the first bar of each group (grey, hatched).
    ``None`` when no row has an accuracy."""
    rows = [r for r in rows if r.get("accuracy_mean") is not None]
    if not rows:
        return None
    keys = list(dict.fromkeys(k for r in rows for k in r if "." in k))
    private = [r for r in rows if not r.get("baseline")]
    labels = list(dict.fromkeys(_grid_label(r, keys) for r in (private or rows)))
    groups: dict[str, dict[str, tuple[float, float]]] = {}
    for row in rows:
        name = f"{row['algorithm']} (non-private)" if row.get("baseline") else row["algorithm"]
        point = (row["accuracy_mean"], row.get("accuracy_std") or 0.0)
        if row.get("baseline") and private:  # the baseline of every point sharing its values
            shared = [k for k in keys if k in row]
            for other in private:
                if all(other.get(k) == row[k] for k in shared):
                    groups.setdefault(name, {})[_grid_label(other, keys)] = point
        else:
            groups.setdefault(name, {})[_grid_label(row, keys)] = point
    names = sorted(groups, key=lambda n: (not n.endswith("(non-private)"), 0))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(labels) * max(1, len(names)) ** 0.5), 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        xs = [j for j, label in enumerate(labels) if label in groups[name]]
        ys = [groups[name][labels[j]] for j in xs]
        baseline = name.endswith("(non-private)")
        ax.bar(
            [x - 0.4 + width * (i + 0.5) for x in xs],
            [y[0] for y in ys],
            width,
            yerr=[y[1] for y in ys],
            capsize=2,
            label=name,
            color="lightgrey" if baseline else colours[i % len(colours)],
            hatch="//" if baseline else None,
            edgecolor="grey" if baseline else None,
        )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(
        labels,
        rotation=20 if len(labels) > 3 else 0,
        ha="right" if len(labels) > 3 else "center",
        fontsize="small",
    )
    ax.set_ylabel("final test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small", ncol=2)
    return save_figure(fig, path)


#: the bins of the subject-weight histograms: 20 equal bins over [0, 1], where every ULDP
#: weight and every subject's sum of weights over silos lies
WEIGHT_BINS = np.linspace(0.0, 1.0, 21)


def weight_histograms(
    weights: np.ndarray, holds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The histograms of a ULDP run's subject weights ``w_{s,a}`` (silos x subjects), over the
    (silo, subject) pairs where the silo holds records of the subject (``holds``): the bin
    edges, per silo the counts of its nonzero weights (silos x bins), and the counts of each
    subject's ``Σ_s w_{s,a}`` over the subjects with records (bins)."""
    used = np.where(holds, np.asarray(weights, dtype=np.float64), 0.0)
    per_silo = np.stack(
        [np.histogram(row[row > 0], bins=WEIGHT_BINS)[0] for row in used]
        or [np.zeros(len(WEIGHT_BINS) - 1, dtype=np.int64)]
    )
    sums = np.clip(used.sum(axis=0)[np.asarray(holds).any(axis=0)], 0.0, 1.0)
    return WEIGHT_BINS, per_silo, np.histogram(sums, bins=WEIGHT_BINS)[0]


def plot_subject_weights(weights: np.ndarray, holds: np.ndarray, path: Path, title: str) -> Path:
    """The subject weights of a ULDP run (:func:`weight_histograms`): left, each silo's nonzero
    ``w_{s,a}`` (stacked, one colour per silo); right, each subject's ``Σ_s w_{s,a}``, the share
    of the clip bound its updates may use (at most 1)."""
    edges, per_silo, per_subject = weight_histograms(weights, holds)
    centres, width = (edges[:-1] + edges[1:]) / 2, float(edges[1] - edges[0])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = np.zeros(len(centres))
    for silo, counts in enumerate(per_silo):
        left.bar(centres, counts, width=width * 0.9, bottom=bottom, label=f"silo {silo}")
        bottom += counts
    left.set_xlabel("w_{s,a} (nonzero, pairs where silo s holds records of subject a)")
    left.set_ylabel("(silo, subject) pairs")
    if 1 < len(per_silo) <= 10:
        left.legend(fontsize="x-small")
    right.bar(centres, per_subject, width=width * 0.9, color="tab:orange")
    right.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set_xlabel("Σ_s w_{s,a} per subject (at most 1)")
    right.set_ylabel("subjects")
    for ax in (left, right):
        ax.set_xlim(0.0, 1.05)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_subject_sampling(
    rows: Metrics, path: Path, title: str, *, expected: float | None = None
) -> Path:
    """Per round, the (silo, subject) pairs trained: the sum over the silos of each silo's
    ``subjects_per_batch`` (a subject held by k silos counts k times), with the expected
    number as a dashed line."""
    counts = [
        (r["round"], sum(r["subjects_per_batch"])) for r in rows if r.get("subjects_per_batch")
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r for r, _ in counts], [c for _, c in counts], width=0.8)
    if expected is not None:
        ax.axhline(expected, color="grey", linestyle="--", linewidth=1, label="expected")
        ax.legend(fontsize="small")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("(silo, subject) pairs trained")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title)
    return save_figure(fig, path)


#: one curve of :func:`plot_personalised_over_seeds`: rounds and, per round, mean and std
Band = tuple[Sequence[int], Sequence[float], Sequence[float]]


def plot_personalised_over_seeds(
    series: Mapping[str, Mapping[str, Band]], path: Path, title: str
) -> Path:
    """Personalised (solid) and global (dashed) mean accuracy over clients against round, each
    the mean over seeds with a band of ± one standard deviation; ``series`` maps a label to
    ``{"personalised": band, "global": band}``."""
    fig, ax = plt.subplots(figsize=(7.5 + (3.0 if len(series) > 1 else 0.0), 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, curves) in enumerate(series.items()):
        colour = colours[i % len(colours)]
        for kind, style in (("personalised", "-"), ("global", "--")):
            if kind not in curves:
                continue
            rounds, mean, std = (np.asarray(v, dtype=float) for v in curves[kind])
            ax.plot(rounds, mean, color=colour, linestyle=style, label=f"{label} {kind}")
            ax.fill_between(rounds, mean - std, mean + std, color=colour, alpha=0.15)
    ax.set_xlabel("synchronisation round")
    _whole_rounds(ax)
    ax.set_ylabel("mean test accuracy over clients")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize="x-small")
    ax.set_title(title)
    return save_figure(fig, path)


def plot_rounds_over_seeds(
    accuracy: Mapping[str, Band],
    epsilon: Mapping[str, Band],
    path: Path,
    title: str,
    runs: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Test accuracy (left) against round per algorithm, the mean over seeds with a band of
    ± one standard deviation, and ε (right, log scale) as given in ``epsilon`` (a sweep's
    report gives the largest over seeds, with no band: the bound every seed's run meets);
    ``runs`` (their ``delta`` and ``adversary``) say what the ε holds at, on its axis. A run
    without ε (the non-private baseline, labelled "(non-private)") is drawn on the left
    only, dashed and grey; a private one whose ε has no finite bound (a label naming its
    unit's ε, no band) is named on the right."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: dict[str, list[tuple[int, float]]] = {}
    for i, (label, band) in enumerate(accuracy.items()):
        unbounded = label not in epsilon and label.endswith(" ε)")
        baseline = label not in epsilon and not unbounded
        colour = "grey" if baseline else colours[i % len(colours)]
        if unbounded:
            right.plot([], [], color=colour, label=f"{label} ({NO_BOUND})")
        rounds, mean, std = (np.asarray(v, dtype=float) for v in band)
        left.plot(
            rounds,
            mean,
            color=colour,
            linestyle="--" if baseline else "-",
            marker=None if baseline else MARKERS[i % len(MARKERS)],
            markersize=4,
            label=label,
        )
        left.fill_between(rounds, mean - std, mean + std, color=colour, alpha=0.15)
        if label in epsilon:
            rounds, mean, std = (np.asarray(v, dtype=float) for v in epsilon[label])
            curve = list(zip(rounds.astype(int).tolist(), mean.tolist(), strict=True))
            # curves of methods calibrated to one target lie on each other: say so
            close = [(o, _overlap(c, curve)) for o, c in drawn.items()]
            same, how = next(((o, h) for o, h in close if h), (None, None))
            shown = label
            if same:
                shown += (
                    f" (same ε as {same})"
                    if how == "same"
                    else f" (ε within {OVERLAP:.0%} of {same})"
                )
            right.plot(
                rounds,
                mean,
                color=colour,
                marker=MARKERS[i % len(MARKERS)],
                markersize=7 if same else 4,
                markerfacecolor="none" if same else colour,
                linestyle="--" if same else "-",
                label=shown,
            )
            right.fill_between(rounds, mean - std, mean + std, color=colour, alpha=0.15)
            drawn[label.split(" (")[0]] = curve
    left.set_xlabel("round")
    _whole_rounds(left)
    left.set_ylabel("test accuracy")
    left.grid(alpha=0.3)
    left.legend(fontsize="x-small")
    right.set_xlabel("round")
    _whole_rounds(right)
    held = held_at(runs) if runs else ""
    right.set_ylabel(f"ε{held}\nlargest over seeds (the unit in each label)", fontsize="small")
    if epsilon:
        right.set_yscale("log")
    if right.lines:
        right.legend(fontsize="x-small")
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize="medium")
    return save_figure(fig, path)
