"""Validation of FederatedDataset / TestSplit inputs."""

from __future__ import annotations

import numpy as np
import pytest

from silodp.data.bounds import cap_records
from silodp.data.dataset import FederatedDataset, TestSplit
from silodp.errors import InvalidValueError, SilodpError


def _parts(n: int = 6) -> dict:
    return {
        "x": np.zeros((n, 3), dtype=np.float32),
        "y": np.arange(n) % 2,
        "silo": np.arange(n) % 3,
        "subject": np.arange(n) // 2,
        "num_classes": 2,
    }


def test_valid_dataset_sizes() -> None:
    ds = FederatedDataset(**_parts())
    assert len(ds) == 6
    assert ds.num_silos == 3
    assert ds.num_subjects == 3
    assert ds.feature_shape == (3,)
    np.testing.assert_array_equal(ds.silo_sizes(), [2, 2, 2])
    assert ds.histogram().sum() == 6


def test_missing_subject_ids_are_counted() -> None:
    parts = _parts()
    parts["subject"] = np.array([0, 1, np.nan, 2, np.nan, 1])
    with pytest.raises(
        ValueError, match=r"2 record\(s\) have a missing subject \(first at index 2"
    ):
        FederatedDataset(**parts)


def test_negative_silo_named() -> None:
    parts = _parts()
    parts["silo"] = np.array([0, 1, 2, -4, 0, 1])
    with pytest.raises(ValueError, match=r"silo=-4 at index 3"):
        FederatedDataset(**parts)


def test_label_out_of_range_named() -> None:
    parts = _parts()
    parts["y"] = np.array([0, 1, 7, 1, 0, 1])
    with pytest.raises(ValueError, match=r"labels in \[0, 1\]; 1 record\(s\).*label=7 at index 2"):
        FederatedDataset(**parts)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_counted(bad: float) -> None:
    parts = _parts()
    parts["x"][4, 1] = bad
    parts["x"][4, 2] = bad
    with pytest.raises(
        ValueError, match=r"2 NaN/inf value\(s\) in 1 record\(s\) \(first at index 4"
    ):
        FederatedDataset(**parts)


def test_empty_silo_named() -> None:
    parts = _parts()
    parts["silo"] = np.array([0, 0, 2, 2, 0, 2])
    with pytest.raises(ValueError, match=r"1 silo\(s\) are empty \(silo ids: \[1\]\)"):
        FederatedDataset(**parts)
    with pytest.raises(ValueError, match=r"silo ids: \[1, 3\]"):
        FederatedDataset(**{**parts, "num_silos": 4})


def test_silo_beyond_num_silos() -> None:
    with pytest.raises(ValueError, match=r"silo ids in \[0, 1\], got silo=2"):
        FederatedDataset(**{**_parts(), "num_silos": 2})


def test_shape_mismatch_and_bad_class_count() -> None:
    parts = _parts()
    with pytest.raises(ValueError, match=r"subject to have shape \(6,\)"):
        FederatedDataset(**{**parts, "subject": np.zeros(5, dtype=int)})
    with pytest.raises(ValueError, match="num_classes=1"):
        FederatedDataset(**{**parts, "num_classes": 1})
    with pytest.raises(ValueError, match="empty dataset"):
        FederatedDataset(**{**_parts(), "x": np.zeros((0, 3))})


def test_subset_accumulates_drops() -> None:
    ds = FederatedDataset(**_parts(), dropped_records=2)
    sub = ds.subset(np.array([0, 1, 2]), dropped=3)
    assert len(sub) == 3
    assert sub.dropped_records == 5
    assert sub.num_silos == 3


def test_token_features_kept_as_ints() -> None:
    parts = _parts()
    parts["x"] = np.arange(12, dtype=np.int64).reshape(6, 2)
    ds = FederatedDataset(**parts)
    assert ds.x.dtype == np.int64


@pytest.mark.parametrize(
    ("test", "message"),
    [
        ({"x": np.zeros((2, 3)), "y": np.array([0, 7])}, r"test labels in \[0, 2\).*got 7"),
        ({"x": np.zeros((2, 5)), "y": np.array([0, 1])}, r"shape \(3,\), got \(5,\)"),
        ({"x": np.zeros((0, 3)), "y": np.zeros(0)}, "at least one test record"),
        (
            {"x": np.zeros((2, 3)), "y": np.array([0, 1]), "silo": np.array([0, 3])},
            r"test silos in \[0, 3\)",
        ),
    ],
)
def test_a_test_split_that_does_not_fit_the_training_data_is_named(
    test: dict, message: str
) -> None:
    # refused when the federation is assembled, not as an IndexError in the first evaluation
    from silodp.data.dataset import FederatedData

    with pytest.raises(InvalidValueError, match=message):
        FederatedData(train=FederatedDataset(**_parts()), test=TestSplit(**test))


def test_test_split_length_check() -> None:
    with pytest.raises(ValueError, match="got 2 vs 3"):
        TestSplit(x=np.zeros((3, 2)), y=np.zeros(2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": np.zeros((0, 3))}, "empty dataset"),
        ({"x": np.zeros((6, 3), dtype=complex)}, "numeric \\(real\\) features"),
        ({"x": np.full((6, 3), 1e300)}, "NaN/inf value"),
        ({"y": np.array([0, 1, 0.5, 1, 0, 1])}, "label=0.5 at index 2"),
        ({"y": np.array(["a"] * 6)}, "integer label ids"),
        ({"subject": np.array([0, 1, 2, 1e300, 0, 1])}, "subject=1e\\+300 at index 3"),
        ({"silo": np.array([0, 1, 2, 0, 1, 10**9])}, "3 silos|1000000001 silos"),
        ({"num_classes": 2.5}, "num_classes=2.5"),
        ({"num_classes": "2"}, "num_classes='2'"),
        ({"dropped_records": -1}, "dropped_records=-1"),
        ({"subject_names": "abc"}, "subject_names to be a list"),
        ({"silo_names": ["a", "b", "a"]}, "distinct silo_names, got 'a'"),
    ],
)
def test_bad_data_is_an_invalid_value_error(change: dict, message: str) -> None:
    parts = {**_parts(), **change}
    with pytest.raises(InvalidValueError, match=message) as err:
        FederatedDataset(**parts)
    assert isinstance(err.value, SilodpError) and isinstance(err.value, ValueError)


def test_messages_name_silos_by_their_original_ids() -> None:
    ds = FederatedDataset(**_parts(), silo_names=["h1", "h2", "h10"], subject_names=["a", "b", "c"])
    assert ds.silo_name(2) == "h10" and ds.subject_name(1) == "b"
    assert ds.silo_list([0, 2]) == "[0 ('h1'), 2 ('h10')]"
    assert ds.subset(np.arange(4)).silo_names == ["h1", "h2", "h10"]
    with pytest.raises(InvalidValueError, match=r"leaves silo\(s\) \[\d \('h\d+'\)"):
        cap_records(
            FederatedDataset(
                **{**_parts(), "subject": np.zeros(6)}, silo_names=["h1", "h2", "h10"]
            ),
            total=1,
            seed=0,
        )
