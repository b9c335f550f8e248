"""describe() on a hand-built dataset."""

from __future__ import annotations

import json

import numpy as np

from silodp.data.dataset import FederatedDataset
from silodp.data.describe import describe, format_description


def _dataset() -> FederatedDataset:
    # n[s, a]:      a=0  a=1  a=2  a=3(no records)  a=4
    #   silo 0       3    1    0    0               0
    #   silo 1       1    0    0    0               2
    #   silo 2       1    0    1    0               0
    silo = [0, 0, 0, 1, 2, 0, 2, 1, 1]
    subject = [0, 0, 0, 0, 0, 1, 2, 4, 4]
    return FederatedDataset(
        x=np.zeros((9, 1, 2, 2), dtype=np.float32),
        y=np.arange(9) % 3,
        silo=np.array(silo),
        subject=np.array(subject),
        num_classes=3,
        dropped_records=4,
    )


def test_describe_numbers() -> None:
    d = describe(_dataset())
    assert d["num_records"] == 9
    assert d["num_silos"] == 3
    assert d["num_subjects"] == 5
    assert d["subjects_with_records"] == 4
    assert d["num_classes"] == 3
    assert d["feature_shape"] == [1, 2, 2]
    assert d["records_per_silo"] == [4, 3, 2]
    assert d["subjects_per_silo"] == [2, 2, 2]
    rps = d["records_per_subject"]  # 5, 1, 1, 2
    assert (rps["min"], rps["median"], rps["mean"], rps["max"]) == (1, 1.5, 2.25, 5)
    assert rps["histogram"] == [
        {"lo": 1, "hi": 1, "count": 2},
        {"lo": 2, "hi": 3, "count": 1},
        {"lo": 4, "hi": 7, "count": 1},
    ]
    assert d["span"] == {"max": 3, "histogram": {"1": 3, "2": 0, "3": 1}}
    assert d["max_records_subject_silo"] == 3
    assert d["max_records_subject"] == 5
    assert d["dropped_records"] == 4
    assert json.loads(json.dumps(d)) == d


def test_format_description() -> None:
    text = format_description(describe(_dataset()))
    assert "records                            9" in text
    assert "4 / 5" in text
    assert "records per silo                   4 3 2" in text
    assert "min 1  median 1.5  mean 2.25  max 5" in text
    assert "max span (silos per subject)       3" in text
    assert "dropped records (data caps)        4" in text
