"""``silodp bench uldp``: ULDP-AVG / ULDP-SGD per-subject local training, vectorised vs loop.

One round's local work in every silo: each subject present in the silo is trained from the
global model on its own records (ULDP-AVG: ``local_epochs`` epochs of mini-batches; ULDP-SGD:
one full-batch step). :func:`~silodp.privacy.per_subject.per_subject_deltas` trains the
subjects together (``vmap`` over stacked parameter copies, in memory-bounded chunks);
:func:`~silodp.privacy.per_subject.per_subject_deltas_loop` trains one model copy at a time.
Both run on exactly the same planned batches, so their deltas must agree (max abs difference
reported). ``local_update_s`` is the algorithm's whole ``local_update`` over all silos
(vectorised deltas plus clipping, weighting and noise).

On the ULDP-FL paper's setting a round is also timed the way the paper's own implementation
runs it (:func:`paper_style_deltas`), side by side with the rest, for the check against it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from silodp.bench.common import (
    Row,
    Usage,
    interleaved_usage,
    peak_rss_mb,
    run_workers,
    vm_hwm_mb,
)

__all__ = ["SETTINGS", "UldpSetting", "run_uldp_bench", "worker_uldp"]

#: Speed-up of the vectorised path over the loop that silodp aims for at 100 subjects.
TARGET_SPEEDUP = 5.0


@dataclass(frozen=True)
class UldpSetting:
    """A data source, its model and the ULDP hyperparameters of its shipped config."""

    source: str
    model: str
    max_records: int | None
    local_epochs: int
    batch_size: int
    lr: float
    sgd_lr: float = 0.5


SETTINGS: dict[str, UldpSetting] = {
    # configs/uldp_digits_uniform.toml
    "digits": UldpSetting("digits", "mlp", None, local_epochs=2, batch_size=16, lr=0.1),
    # configs/uldp_fmnist_uniform.toml
    "fashion_mnist": UldpSetting(
        "fashion_mnist", "mnist_cnn", 10000, local_epochs=1, batch_size=16, lr=0.05
    ),
    # the same with the MLP (vmap over subjects, 50,890 parameters) on 30,000 records
    "fashion_mnist_mlp": UldpSetting(
        "fashion_mnist", "mlp", 30000, local_epochs=1, batch_size=16, lr=0.05
    ),
    # the ULDP-FL paper's setting: its 21,840-parameter CNN, 6,000 records, 5 local epochs
    "fashion_mnist_uldp_cnn": UldpSetting(
        "fashion_mnist", "uldp_cnn", 6000, local_epochs=5, batch_size=16, lr=0.05
    ),
}
ALGORITHMS = ("uldp_avg", "uldp_sgd")
#: (source, algorithm) whose round is also timed the way the ULDP-FL paper's own
#: implementation runs it (:func:`time_paper_style`): the check against the paper compares
#: CPU seconds measured side by side in one run, on whatever host runs the bench.
PAPER_STYLE = frozenset({("fashion_mnist_uldp_cnn", "uldp_avg")})
#: CPU seconds of one ULDP-AVG round of the paper's implementation on its setting (its CNN,
#: Fashion-MNIST 6,000 records, 100 subjects, 5 silos, 5 local epochs), one thread, measured
#: once on another run and host: context only (in the check rows), never the check, since a
#: constant compared with this host's time says as much about the hosts as the code.
PAPER_REPORTED_CPU_S = 17.0


@dataclass
class Federation:
    setting: UldpSetting
    num_subjects: int
    model: nn.Module
    params: dict[str, torch.Tensor]
    silos: list[Any]
    train: Any


def build_federation(source: str, num_subjects: int, *, num_silos: int = 5) -> Federation:
    """The federated data (``uldp_uniform`` allocation), its silos' tensors and the model."""
    from silodp.data.build import DataConfig, build_federated_data
    from silodp.federated.simulator import silo_tensors
    from silodp.models import build_model

    setting = SETTINGS[source]
    data = build_federated_data(
        DataConfig(
            source=setting.source,
            num_silos=num_silos,
            num_subjects=num_subjects,
            allocation="uldp_uniform",
            max_records=setting.max_records,
        )
    )
    train = data.train
    model = build_model(setting.model, train.feature_shape, train.num_classes)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Federation(setting, num_subjects, model, params, silo_tensors(train), train)


def _config(setting: UldpSetting, algorithm: str) -> Any:
    from silodp.algorithms.uldp import UldpConfig

    return UldpConfig(
        local_epochs=setting.local_epochs,
        batch_size=setting.batch_size,
        lr=setting.sgd_lr if algorithm == "uldp_sgd" else setting.lr,
        clip=1.0,
        noise_multiplier=1.0,
    )


def plan_round(fed: Federation, algorithm: str, *, seed: int = 0) -> list[Any]:
    """Every silo's :class:`SubjectBatches` for one round (all subjects sampled)."""
    from silodp.privacy.per_subject import subject_batches
    from silodp.privacy.randomness import Coins

    single = algorithm == "uldp_sgd"
    coins = Coins.seeded(seed)
    plans = []
    for silo in fed.silos:
        order = torch.unique(silo.subject)
        plans.append(
            subject_batches(
                silo.subject,
                order,
                epochs=1 if single else fed.setting.local_epochs,
                batch_size=None if single else fed.setting.batch_size,
                coins=coins,
            )
        )
    return plans


def vectorised_deltas(
    fed: Federation, plans: Sequence[Any], lr: float, *, silo: int | None = None
) -> list[torch.Tensor]:
    """Per silo (or only ``silo``), a (subjects, parameters) matrix of deltas from
    ``per_subject_deltas``."""
    from silodp.privacy.per_subject import per_subject_deltas

    out = []
    for s, (data, plan) in enumerate(zip(fed.silos, plans, strict=True)):
        if silo is not None and s != silo:
            continue
        chunks = per_subject_deltas(fed.model, fed.params, data.x, data.y, plan, lr=lr)
        rows, parts = [], []
        for chunk_rows, deltas in chunks:
            rows.append(chunk_rows)
            parts.append(torch.cat([d.reshape(d.shape[0], -1) for d in deltas.values()], dim=1))
        stacked = torch.cat(parts, dim=0)
        out.append(torch.empty_like(stacked).index_copy_(0, torch.cat(rows), stacked))
    return out


def loop_deltas(
    fed: Federation, plans: Sequence[Any], lr: float, *, silo: int | None = None
) -> list[torch.Tensor]:
    """The same matrices from ``per_subject_deltas_loop`` (one model copy at a time)."""
    from silodp.privacy.per_subject import per_subject_deltas_loop

    out = []
    for s, (data, plan) in enumerate(zip(fed.silos, plans, strict=True)):
        if silo is not None and s != silo:
            continue
        deltas = per_subject_deltas_loop(fed.model, fed.params, data.x, data.y, plan, lr=lr)
        out.append(torch.stack([torch.cat([v.reshape(-1) for v in d.values()]) for d in deltas]))
    return out


def paper_style_loaders(
    fed: Federation,
    *,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> list[list[Any]]:
    """Per silo, per subject (increasing id), a torch ``DataLoader`` over that subject's
    records as a list of ``(x, y)`` pairs, shuffled mini-batches of ``batch_size`` (default:
    the setting's): how the ULDP-FL paper's implementation holds a silo's data, built once
    before training as it does, so that no round pays for it."""
    from torch.utils.data import DataLoader

    size = fed.setting.batch_size if batch_size is None else batch_size
    out: list[list[Any]] = []
    for data in fed.silos:
        records: dict[int, list[Any]] = {}
        for i, subject in enumerate(data.subject.tolist()):
            records.setdefault(subject, []).append((data.x[i], data.y[i]))
        out.append(
            [
                DataLoader(records[s], batch_size=size, shuffle=True, generator=generator)  # type: ignore[arg-type]
                for s in sorted(records)
            ]
        )
    return out


def paper_style_deltas(
    fed: Federation, loaders: Sequence[Any], lr: float, *, epochs: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """One silo's per-subject deltas (in the order of ``loaders``, one per subject) trained
    the way the ULDP-FL paper's implementation trains them: per subject a deep copy of the
    global model and a ``torch.optim.SGD`` optimiser; per mini-batch of its ``DataLoader``,
    ``zero_grad``, forward, cross-entropy, ``backward``, ``step`` and the loss read back as a
    float; ``epochs`` (default: the setting's ``local_epochs``) passes over the loader. The
    same arithmetic as :func:`~silodp.privacy.per_subject.per_subject_deltas_loop` on the
    same model, with the paper's per-step machinery around it (its CNN's dropout, which
    silodp's ``uldp_cnn`` leaves out, is left out here too)."""
    passes = fed.setting.local_epochs if epochs is None else epochs
    start = copy.deepcopy(fed.model)
    with torch.no_grad():
        for name, p in start.named_parameters():
            p.copy_(fed.params[name])
    out = []
    for loader in loaders:
        model = copy.deepcopy(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(passes):
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                loss.item()
        out.append({k: v.detach() - fed.params[k] for k, v in model.named_parameters()})
    return out


def time_paper_style(
    fed: Federation, loaders: Sequence[Sequence[Any]], lr: float, *, clip: float = 1.0
) -> None:
    """One ULDP-AVG round in every silo the paper's way: :func:`paper_style_deltas`, then each
    delta clipped to L2 norm ``clip`` over all parameters and weighted, the weighted deltas
    summed and Gaussian noise added, parameter tensor by parameter tensor."""
    for silo_loaders in loaders:
        deltas = paper_style_deltas(fed, silo_loaders, lr)
        total: dict[str, torch.Tensor] = {}
        for delta in deltas:
            norm = float(torch.stack([(v**2).sum() for v in delta.values()]).sum().sqrt())
            scale = min(1.0, clip / max(norm, 1e-12)) / max(len(deltas), 1)
            for k, v in delta.items():
                total[k] = total[k] + v * scale if k in total else v * scale
        for k, v in total.items():
            total[k] = v + torch.randn_like(v) * clip


def compare(fed: Federation, plans: Sequence[Any], lr: float) -> tuple[float, float]:
    """(max abs difference between the two paths' deltas, max abs delta), silo by silo."""
    diff = scale = 0.0
    for s in range(len(fed.silos)):
        (vec,) = vectorised_deltas(fed, plans, lr, silo=s)
        (ref,) = loop_deltas(fed, plans, lr, silo=s)
        if ref.numel():
            diff = max(diff, float((vec - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    return diff, scale


def time_vectorised(fed: Federation, plans: Sequence[Any], lr: float) -> None:
    """One round of ``per_subject_deltas`` in every silo, chunks consumed and dropped."""
    from silodp.privacy.per_subject import per_subject_deltas

    for data, plan in zip(fed.silos, plans, strict=True):
        for _ in per_subject_deltas(fed.model, fed.params, data.x, data.y, plan, lr=lr):
            pass


def time_loop(fed: Federation, plans: Sequence[Any], lr: float) -> None:
    """One round of ``per_subject_deltas_loop`` in every silo."""
    from silodp.privacy.per_subject import per_subject_deltas_loop

    for data, plan in zip(fed.silos, plans, strict=True):
        per_subject_deltas_loop(fed.model, fed.params, data.x, data.y, plan, lr=lr)


def local_update_round(fed: Federation, algorithm: str) -> Callable[[], object]:
    """The algorithm's ``local_update`` in every silo for one round (vectorised path)."""
    from silodp.algorithms import make_algorithm
    from silodp.privacy.randomness import Coins

    algo = make_algorithm(algorithm, _config(fed.setting, algorithm), fed.train)
    coins = Coins.secure()

    def run() -> object:
        instructions = algo.configure_round(0, coins)
        return [
            algo.local_update(fed.model, fed.params, silo, coins, instructions)
            for silo in fed.silos
        ]

    return run


def run_uldp_bench(
    *,
    sources: Sequence[str] = ("digits", "fashion_mnist", "fashion_mnist_mlp"),
    subject_counts: Sequence[int] = (100, 1000),
    algorithms: Sequence[str] = ALGORITHMS,
    repeats: int = 3,
    threads: int = 1,
    measure_rss: bool = True,
    rss_jobs: int = 2,
    log: Callable[[str], None] | None = None,
) -> list[Row]:
    """Rows ``{source, model, subjects, algorithm, vectorised_s, loop_s, speedup,
    max_abs_diff, local_update_s, peak_rss_mb, ...}``; times are medians of interleaved
    repeats of one round over all silos, with this process's user and system CPU seconds and
    minor page faults per round beside them (``*_user_s``, ``*_sys_s``, ``*_minflt``: system
    time and faults show allocation churn, large blocks mapped and faulted in afresh on
    every step, and are less sensitive than wall time to other jobs). ``fill`` is the share
    of the vectorised path's batch slots holding a real record (the vmap path groups subjects
    by record count and cuts each step to its chunk's longest real batch, so it computes on
    fewer padded slots). ``round_gmac`` is the round's multiply-adds on its
    ``record_passes`` real records (every epoch's; :func:`~silodp.bench.floor.training_macs`
    each), ``peak_gmac_s`` this machine's peak rate
    (:func:`~silodp.bench.floor.peak_mac_rate`, measured before and after the timings, the
    faster kept), ``floor_s`` their quotient
    (about the least time any implementation of the round's arithmetic can take here) and
    ``max_speedup`` = ``loop_s / floor_s``, about the largest speed-up over the loop any such
    implementation could show."""
    from silodp.bench.common import set_threads
    from silodp.bench.floor import peak_mac_rate, training_macs

    threads = set_threads(threads)
    rate = peak_mac_rate()
    rows: list[Row] = []
    for source in sources:
        for count in subject_counts:
            fed = build_federation(source, count)
            record_macs = training_macs(fed.model, fed.params, fed.silos[0].x[:1])
            for algorithm in algorithms:
                if log is not None:
                    what = f"{source} subjects={count} {algorithm}"
                    log(f"{what}: vectorised vs loop, {repeats} repeats")
                lr = _config(fed.setting, algorithm).lr
                plans = plan_round(fed, algorithm)
                diff, scale = compare(fed, plans, lr)
                timed: dict[str, Callable[[], object]] = {
                    "vectorised": partial(time_vectorised, fed, plans, lr),
                    "loop": partial(time_loop, fed, plans, lr),
                    "local_update": local_update_round(fed, algorithm),
                }
                if (source, algorithm) in PAPER_STYLE:
                    timed["paper_style"] = partial(
                        time_paper_style, fed, paper_style_loaders(fed), lr
                    )
                usage = interleaved_usage(timed, repeats=repeats, warmup=0)
                medians = {name: u.wall_s for name, u in usage.items()}
                pairs = sum(int(p.num_subjects) for p in plans)
                real = sum(int(p.mask.sum()) for p in plans)
                slots = sum(int(p.mask.numel()) for p in plans)
                rows.append(
                    {
                        "source": source,
                        "model": fed.setting.model,
                        "subjects": count,
                        "silo_subject_pairs": pairs,
                        "fill": real / max(slots, 1),
                        "records": int(sum(s.num_records for s in fed.silos)),
                        "algorithm": algorithm,
                        "path": _path(fed.model),
                        "threads": threads,
                        "vectorised_s": medians["vectorised"],
                        "loop_s": medians["loop"],
                        "speedup": medians["loop"] / medians["vectorised"],
                        "local_update_s": medians["local_update"],
                        "local_update_speedup": medians["loop"] / medians["local_update"],
                        "max_abs_diff": diff,
                        "max_abs_delta": scale,
                        "paper_style_s": medians.get("paper_style"),
                        **_cpu_columns(usage),
                        "record_passes": real,
                        "round_gmac": real * record_macs / 1e9,
                        "peak_rss_mb": None,
                        "repeats": repeats,
                        "target": f">= {TARGET_SPEEDUP:g}x at 100 subjects"
                        if count == 100
                        else "memory bounded",
                    }
                )
                if log is not None:
                    log(f"done {source} subjects={count} {algorithm}")
    # the floor takes the faster rate seen, before or after the timings
    rate = max(rate, peak_mac_rate())
    for row in rows:
        macs = row["round_gmac"] * 1e9
        row["peak_gmac_s"] = rate / 1e9
        row["floor_s"] = macs / rate
        row["max_speedup"] = row["loop_s"] / row["floor_s"] if macs else None
    if measure_rss:
        if log is not None:
            log(f"peak memory: {3 * len(rows)} fresh processes ({rss_jobs} at a time)")
        _add_rss(rows, threads=threads, jobs=rss_jobs)
    return rows


def _path(model: nn.Module) -> str:
    """How ``per_subject_deltas`` trains the subjects of a chunk together on ``model``."""
    from silodp.privacy.stacked import StackedModel

    return "vmap" if StackedModel.trace(model) is None else "stacked"


def _cpu_columns(usage: dict[str, Usage]) -> Row:
    """``{name}_user_s``, ``{name}_sys_s`` and ``{name}_minflt`` of every timed path."""
    out: Row = {}
    for name, u in usage.items():
        out[f"{name}_user_s"] = u.user_s
        out[f"{name}_sys_s"] = u.sys_s
        out[f"{name}_minflt"] = u.minor_faults
    return out


def _add_rss(rows: list[Row], *, threads: int, jobs: int) -> None:
    """Extra peak RSS of one round, vectorised (the algorithm's ``local_update``) and loop,
    for every row, each in a fresh process against a baseline that builds the same data."""
    jobs_args: dict[str, list[str]] = {}
    for row in rows:
        key = f"{row['source']}/{row['subjects']}/{row['algorithm']}"
        common = ["uldp", "--source", row["source"], "--subjects", str(row["subjects"])]
        common += ["--algorithm", row["algorithm"], "--threads", str(threads)]
        for path in ("none", "vectorised", "loop"):
            jobs_args[f"{key}/{path}"] = [*common, "--path", path]
    results = run_workers(jobs_args, jobs=jobs)
    for row in rows:
        key = f"{row['source']}/{row['subjects']}/{row['algorithm']}"
        base = results[f"{key}/none"].get("peak_rss_mb")
        for path, column in (("vectorised", "peak_rss_mb"), ("loop", "loop_peak_rss_mb")):
            result = results[f"{key}/{path}"]
            if base is None or "peak_rss_mb" not in result:
                row[f"{path}_rss_error"] = result.get("error") or "no baseline"
                continue
            row[column] = max(0.0, float(result["peak_rss_mb"]) - float(base))
        if base is not None:
            row["baseline_rss_mb"] = float(base)


def worker_uldp(source: str, subjects: int, algorithm: str, path: str) -> dict[str, Any]:
    """Builds the federation and runs one round: ``vectorised`` (the algorithm's
    ``local_update`` in every silo), ``loop`` (``per_subject_deltas_loop``) or ``none``
    (baseline); reports this process's peak RSS."""
    fed = build_federation(source, subjects)
    lr = _config(fed.setting, algorithm).lr
    if path == "vectorised":  # the algorithm's own local_update: deltas reduced chunk by chunk
        local_update_round(fed, algorithm)()
    elif path == "loop":
        time_loop(fed, plan_round(fed, algorithm), lr)
    chunk = None
    if path == "vectorised":
        from silodp.privacy.per_subject import default_chunk_size

        chunk = default_chunk_size(fed.params)
    return {
        "peak_rss_mb": peak_rss_mb(),
        "vm_hwm_mb": vm_hwm_mb(),
        "path": path,
        "chunk_size": chunk,
        "params": sum(v.numel() for v in fed.params.values()),
    }


def uldp_checks(rows: Sequence[Row]) -> list[Row]:
    """The ≥ 5× target at 100 subjects (on the paper's setting, a second row: the CPU seconds
    of a round run the paper's way, ``paper_cpu_s``, over ``local_update``'s, ``cpu_s``, both
    user + system and timed side by side); at more subjects, the vectorised path's extra memory
    next to its value at the smallest count of the same source and algorithm (bounded:
    it should not grow with the number of subjects)."""
    out: list[Row] = []
    for row in rows:
        check: Row = {
            "source": row["source"],
            "subjects": row["subjects"],
            "algorithm": row["algorithm"],
            "speedup": row["speedup"],
            "local_update_speedup": row["local_update_speedup"],
            "max_speedup": row.get("max_speedup"),
            "extra_mb": row.get("peak_rss_mb"),
        }
        if row["subjects"] == 100:
            # the algorithm's local_update (clipping, weighting and noise included) is what runs
            check["target"] = f">= {TARGET_SPEEDUP:g}x"
            check["ok"] = row["local_update_speedup"] >= TARGET_SPEEDUP
            paper = row.get("paper_style_user_s")
            cpu = row.get("local_update_user_s")
            if paper is not None and cpu is not None:
                paper += row.get("paper_style_sys_s") or 0.0
                cpu += row.get("local_update_sys_s") or 0.0
                out.append(check)
                check = {
                    **check,
                    "speedup": None,
                    "local_update_speedup": None,
                    "max_speedup": None,
                    "target": f">= {TARGET_SPEEDUP:g}x the paper's way, side by side",
                    "paper_cpu_s": paper,
                    "cpu_s": cpu,
                    "vs_paper": paper / cpu,
                    "paper_reported_cpu_s": PAPER_REPORTED_CPU_S,
                    "ok": paper / cpu >= TARGET_SPEEDUP,
                }
        else:
            smallest = min(
                (
                    r
                    for r in rows
                    if r["source"] == row["source"] and r["algorithm"] == row["algorithm"]
                ),
                key=lambda r: r["subjects"],
            )
            check["target"] = "memory bounded"
            small, large = smallest.get("peak_rss_mb"), row.get("peak_rss_mb")
            if small is not None and large is not None and smallest is not row:
                check["memory_vs_fewest"] = large / max(small, 1.0)
        out.append(check)
    return out
