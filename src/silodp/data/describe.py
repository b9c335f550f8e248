"""Summaries of a federated dataset's shape: silo sizes, subject sizes and spans, and (for a
:class:`FederatedData`) what a subject is, how the test split was made and the scaling."""

from __future__ import annotations

from typing import Any

import numpy as np

from silodp.data.dataset import FederatedData, FederatedDataset
from silodp.errors import InvalidValueError

__all__ = ["describe", "format_description"]


def _pow2_histogram(values: np.ndarray) -> list[dict[str, int]]:
    """Counts of positive integers in bins ``[1,1], [2,3], [4,7], ...`` (empty bins kept)."""
    top = int(values.max())
    bins = []
    lo = 1
    while lo <= top:
        hi = 2 * lo - 1
        bins.append({"lo": lo, "hi": hi, "count": int(((values >= lo) & (values <= hi)).sum())})
        lo *= 2
    return bins


def describe(data: FederatedData | FederatedDataset) -> dict[str, Any]:
    """JSON-serialisable statistics of ``data`` (its training records, plus its split).

    Subject statistics cover subjects holding at least one record (ids without records, e.g.
    from a heavy Zipf allocation, are counted in ``num_subjects`` only).

    Keys: ``num_records``, ``num_silos``, ``num_subjects`` (id range),
    ``subjects_with_records``, ``num_classes``, ``feature_shape``, ``records_per_silo`` (list),
    ``subjects_per_silo`` (list), ``records_per_subject`` (min/median/mean/max and a
    power-of-two ``histogram``), ``span`` (``max`` and ``histogram``: number of subjects whose
    records occupy exactly ``i`` silos, as ``{"i": count}``), ``max_records_subject_silo``
    (largest ``n_{s,a}``), ``max_records_subject`` (largest ``n_a``),
    ``max_records_subject_id`` (the original id of a subject holding that many, e.g. a table's
    ``"p0042"``; its dense id as text where subjects have no original ids), ``dropped_records``
    (records the data's own caps, ``data.records_per_subject*``, dropped; the privacy bounds
    each algorithm applies are listed by ``silodp describe`` as ``privacy_caps``), and
    ``silo_ids``: the original silo id of each silo index (``silo_ids[i]`` is silo ``i``'s id
    in the data, e.g. a table's silo column; ``None`` where silos were drawn).

    Given a :class:`FederatedData`, also ``subjects`` (``from``: column, records,
    leaf_users, simulated or given; ``note``: one line), ``scaling`` (what was applied to
    the features) and ``split``: ``kind`` (record, subject or file), ``fraction``,
    ``train_records``, ``test_records``, ``train_subjects``, ``test_subjects`` and
    ``shared_subjects`` (subjects with records on both sides; the last two are ``None``
    where test records carry no subject), and with ``data.test_per_client``
    ``distinct_test_records`` and ``repeated_test_records`` (draws repeating a record in the
    same client's test set; ``test_records`` counts every draw).
    """
    if isinstance(data, FederatedData):
        out = _describe_train(data.train)
        out["subjects"] = {"from": data.subjects_from, "note": data.subjects_note}
        out["scaling"] = data.scaling
        if data.feature_names:
            out["feature_columns"] = list(data.feature_names)
        split = data.split
        out["split"] = {
            "kind": None if split is None else split.kind,
            "fraction": None if split is None else split.fraction,
            "train_records": len(data.train),
            "test_records": len(data.test),
            "train_subjects": out["subjects_with_records"],
            "test_subjects": None if split is None else split.test_subjects,
            "shared_subjects": None if split is None else split.shared_subjects,
        }
        if split is not None and split.distinct_test_records is not None:
            out["split"]["distinct_test_records"] = split.distinct_test_records
            out["split"]["repeated_test_records"] = split.repeated_test_records
        return out
    if not isinstance(data, FederatedDataset):
        raise InvalidValueError(
            f"Expected a FederatedData or FederatedDataset, got {type(data).__name__}."
        )
    return _describe_train(data)


def _describe_train(dataset: FederatedDataset) -> dict[str, Any]:
    hist = dataset.histogram()
    per_subject_all = hist.sum(axis=0)
    present = per_subject_all > 0
    per_subject = per_subject_all[present]
    spans = (hist[:, present] > 0).sum(axis=0)
    span_counts = np.bincount(spans, minlength=dataset.num_silos + 1)
    return {
        "num_records": len(dataset),
        "num_silos": int(dataset.num_silos),
        "num_subjects": int(dataset.num_subjects),
        "subjects_with_records": int(present.sum()),
        "num_classes": int(dataset.num_classes),
        "feature_shape": [int(d) for d in dataset.feature_shape],
        "records_per_silo": [int(c) for c in dataset.silo_sizes()],
        "subjects_per_silo": [int(c) for c in (hist > 0).sum(axis=1)],
        "records_per_subject": {
            "min": int(per_subject.min()),
            "median": float(np.median(per_subject)),
            "mean": float(per_subject.mean()),
            "max": int(per_subject.max()),
            "histogram": _pow2_histogram(per_subject),
        },
        "span": {
            "max": int(spans.max()),
            "histogram": {str(i): int(span_counts[i]) for i in range(1, dataset.num_silos + 1)},
        },
        "max_records_subject_silo": int(hist.max()),
        "max_records_subject": int(per_subject.max()),
        "max_records_subject_id": dataset.subject_name(int(np.argmax(per_subject_all))),
        "dropped_records": int(dataset.dropped_records),
        "silo_ids": None if dataset.silo_names is None else list(dataset.silo_names),
    }


def _row(label: str, value: Any) -> str:
    return f"  {label:<34} {value}"


def _short_list(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return " ".join(str(v) for v in values)
    head = " ".join(str(v) for v in values[:limit])
    return f"{head} ... ({len(values)} values, min {min(values)}, max {max(values)})"


def _silo_ids(ids: list[str], limit: int = 12) -> str:
    shown = " ".join(f"{i}={name!r}" for i, name in enumerate(ids[:limit]))
    return shown if len(ids) <= limit else f"{shown}  ... ({len(ids)} silos)"


def format_description(d: dict[str, Any]) -> str:
    """A plain-text table of a :func:`describe` result."""
    rps = d["records_per_subject"]
    lines = [
        "Federated dataset",
        _row("records", d["num_records"]),
        _row("silos", d["num_silos"]),
        *(
            [_row("silo ids (index=id in the data)", _silo_ids(d["silo_ids"]))]
            if d.get("silo_ids") is not None
            else []
        ),
        _row(
            "subjects (with records / ids)", f"{d['subjects_with_records']} / {d['num_subjects']}"
        ),
        *(
            [_row("subjects are", d["subjects"]["note"])]
            if d.get("subjects", {}).get("note")
            else []
        ),
        _row("classes", d["num_classes"]),
        _row("feature shape", "x".join(map(str, d["feature_shape"])) or "scalar"),
        _row("dropped records (data caps)", d["dropped_records"]),
        *(
            [_row("feature columns", ", ".join(d["feature_columns"]))]
            if d.get("feature_columns")
            else []
        ),
        *([_row("feature scaling", d["scaling"])] if "scaling" in d else []),
        _row("records per silo", _short_list(d["records_per_silo"])),
        _row("subjects per silo", _short_list(d["subjects_per_silo"])),
        _row(
            "records per subject",
            f"min {rps['min']}  median {rps['median']:g}  mean {rps['mean']:.2f}  max {rps['max']}",
        ),
        _row(
            "max records of a subject",
            f"{d['max_records_subject']} (subject {d['max_records_subject_id']})"
            if d.get("max_records_subject_id") is not None
            else d["max_records_subject"],
        ),
        _row("max records of a subject in a silo", d["max_records_subject_silo"]),
        _row("max span (silos per subject)", d["span"]["max"]),
        "",
        "  records per subject     subjects",
    ]
    for b in rps["histogram"]:
        bounds = str(b["lo"]) if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}"
        lines.append(f"  {bounds:<23} {b['count']}")
    lines += ["", "  span (silos)            subjects"]
    for span, count in d["span"]["histogram"].items():
        lines.append(f"  {span:<23} {count}")
    if "split" in d:
        lines += ["", *_split_lines(d["split"])]
    if d.get("privacy_caps"):
        lines += ["", "  privacy bounds per algorithm (records dropped before it trains)"]
        for name, cap in d["privacy_caps"].items():
            k = "-" if cap["group_size"] is None else cap["group_size"]
            lines.append(
                f"  {name:<23} k {k}, span {cap['span']}: {cap['dropped_records']} dropped"
            )
    return "\n".join(lines)


def _unknown(value: Any) -> Any:
    return "unknown (test records carry no subject)" if value is None else value


def _split_lines(split: dict[str, Any]) -> list[str]:
    kind = split["kind"]
    how = {
        "record": "records held out, stratified by label",
        "subject": "whole subjects held out",
        "file": "separate test set",
        None: "not recorded",
    }[kind]
    if split["fraction"] is not None:
        how += f"; test_fraction {split['fraction']:g}"
    return [
        "Test split",
        _row("kind", f"{kind}: {how}"),
        _row("records (train / test)", f"{split['train_records']} / {split['test_records']}"),
        _row(
            "subjects (train / test)",
            f"{split['train_subjects']} / " + str(_unknown(split["test_subjects"])),
        ),
        _row("subjects on both sides", _unknown(split["shared_subjects"])),
        *(
            [
                _row(
                    "test records (distinct / repeated in a client)",
                    f"{split['distinct_test_records']} / {split['repeated_test_records']}",
                )
            ]
            if split.get("distinct_test_records") is not None
            else []
        ),
    ]
