"""Feature scaling of tables: public bounds/standard constants, the DP estimate, the warning."""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from dp_accounting import dp_event

from silodp.data.build import DataConfig, build_federated_data
from silodp.data.dataset import FederatedData, FederatedDataset
from silodp.data.scaling import (
    SENSITIVITY_PER_FEATURE,
    VARIANCE_FLOOR,
    FeatureStats,
    dp_feature_stats,
    scale_warning,
    silo_moment_sums,
    stats_sensitivity,
    to_unit,
)
from silodp.errors import InvalidValueError
from silodp.models import build_model
from silodp.privacy.randomness import Coins

COLUMNS = ["chol", "a", "b", "c"]
MEANS = [2500.0, 0.05, 0.05, 0.05]
STDS = [150.0, 0.02, 0.02, 0.02]


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _clinical_csv(path: Path, n: int = 800, seed: int = 0) -> Path:
    """One uninformative column near 2,500 and informative columns near 0.05; ~63% class 0."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 3))
    frame = pd.DataFrame(
        {
            "chol": MEANS[0] + STDS[0] * rng.normal(size=n),
            **{c: MEANS[1] + STDS[1] * z[:, i] for i, c in enumerate(COLUMNS[1:])},
            "label": (z[:, 0] + z[:, 1] > 0.45).astype(int),
            "site": rng.integers(0, 3, size=n),
        }
    )
    frame.to_csv(path, index=False)
    return path


def _table(path: Path, **kwargs: object) -> DataConfig:
    return DataConfig(
        source="table",
        path=str(path),
        feature_columns=tuple(COLUMNS),
        silo_column="site",
        allocation="column",
        **kwargs,  # type: ignore[arg-type]
    )


def _sgd_accuracy(data: FederatedData, steps: int = 300) -> float:
    """Plain mini-batch SGD on silodp's MLP, then test accuracy."""
    model = build_model("mlp", data.train.feature_shape, data.train.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = model(torch.from_numpy(data.test.x)).argmax(1).numpy()
    return float((pred == data.test.y).mean())


def test_raw_scales_train_to_the_majority_class_and_scaling_fixes_it(
    tmp_path: Path, one_thread: None
) -> None:
    path = _clinical_csv(tmp_path / "clinical.csv")
    raw = build_federated_data(_table(path))
    majority = float(np.bincount(raw.test.y).max() / len(raw.test))
    assert 0.55 < majority < 0.7
    assert _sgd_accuracy(raw) <= majority + 0.02  # the symptom: chance level
    standard = build_federated_data(
        _table(path, scaling="standard", feature_mean=tuple(MEANS), feature_std=tuple(STDS))
    )
    bounds = build_federated_data(
        _table(path, scaling="bounds", feature_bounds=((1500, 3500), *[(0.0, 0.1)] * 3))
    )
    assert standard.scaling == "standard" and bounds.scaling == "bounds"
    assert _sgd_accuracy(standard) > 0.9
    assert _sgd_accuracy(bounds) > 0.9


def test_bounds_scaling_maps_to_unit_clips_and_treats_test_alike(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {"f": [0.0, 5.0, 10.0, 20.0, -3.0, 7.5] * 5, "g": [1.0] * 30, "label": [0, 1] * 15}
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_csv(tmp_path / "test.csv", index=False)
    cfg = DataConfig(
        source="table",
        path=str(tmp_path / "t.csv"),
        test_path=str(tmp_path / "test.csv"),
        feature_bounds=((0.0, 10.0), (0.0, 4.0)),
        scaling="bounds",
    )
    data = build_federated_data(cfg)
    expected = {0.0: -1.0, 5.0: 0.0, 10.0: 1.0, 20.0: 1.0, -3.0: -1.0, 7.5: 0.5}
    want = np.array([expected[v] for v in frame["f"]], dtype=np.float32)
    np.testing.assert_allclose(data.test.x[:, 0], want)
    np.testing.assert_allclose(data.test.x[:, 1], -0.5)
    assert data.train.x.min() >= -1.0 and data.train.x.max() <= 1.0
    assert set(np.round(data.train.x[:, 0], 6)) <= set(expected.values())


def test_standard_scaling_uses_the_public_constants(tmp_path: Path) -> None:
    path = _clinical_csv(tmp_path / "c.csv", n=200)
    data = build_federated_data(_table(path, scaling="standard", feature_mean=0.05, feature_std=2))
    raw = build_federated_data(_table(path))
    np.testing.assert_allclose(data.train.x, (raw.train.x - 0.05) / 2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(data.test.x, (raw.test.x - 0.05) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scaling": "minmax"}, "scaling='minmax'"),
        ({"scaling": "bounds"}, "scaling='bounds' needs feature_bounds"),
        ({"scaling": "dp"}, "scaling='dp' needs feature_bounds"),
        ({"scaling": "standard", "feature_mean": 0.0}, "needs feature_std"),
        ({"feature_bounds": (0, 1)}, r"feature_bounds=\(0, 1\) is only used with scaling"),
        (
            {"scaling": "standard", "feature_mean": 0, "feature_std": 1, "feature_bounds": (0, 1)},
            "feature_bounds",
        ),
        ({"scaling": "bounds", "feature_bounds": (1, 1)}, r"feature_bounds=\(1, 1\).*lo < hi"),
        ({"scaling": "bounds", "feature_bounds": ((0, 1), (2,))}, "feature_bounds="),
        ({"scaling": "bounds", "feature_bounds": "0,1"}, "feature_bounds='0,1'"),
        ({"scaling": "standard", "feature_mean": 0, "feature_std": 0}, "feature_std=0"),
        ({"scaling": "standard", "feature_mean": 0, "feature_std": (1, -1)}, "feature_std="),
        (
            {"scaling": "standard", "feature_mean": (0, 0), "feature_std": (1, 1, 1)},
            "equal length",
        ),
        (
            {"scaling": "bounds", "feature_bounds": ((0, 1), (0, 1)), "feature_columns": ("a",)},
            r"one per feature column \['a'\]\), got 2",
        ),
        ({"scaling_budget": 0.0}, r"scaling_budget=0.0 in \(0.0, 0.5\]"),
        ({"scaling_budget": 0.6}, "scaling_budget=0.6"),
    ],
)
def test_scaling_config_errors_name_the_key_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataConfig(source="table", path="t.csv", **kwargs)


def test_scaling_is_for_tables() -> None:
    with pytest.raises(ValueError, match="scaling='none' for source='digits'"):
        DataConfig(scaling="bounds", feature_bounds=(0, 1))


def test_per_feature_lengths_are_checked_against_the_table(tmp_path: Path) -> None:
    path = _clinical_csv(tmp_path / "c.csv", n=60)
    cfg = DataConfig(source="table", path=str(path), scaling="bounds", feature_bounds=((0, 1),) * 3)
    with pytest.raises(ValueError, match=r"exactly 5 \(one per feature column\), got 3.*'site'"):
        build_federated_data(cfg)


def test_toml_style_lists_are_accepted() -> None:
    cfg = DataConfig(
        source="table", path="t.csv", scaling="bounds", feature_bounds=[[0, 1], [2, 3]]
    )
    assert cfg.feature_bounds == ((0.0, 1.0), (2.0, 3.0))


# --- the warning ----------------------------------------------------------------------------


def test_raw_scales_log_a_warning_naming_the_columns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _clinical_csv(tmp_path / "c.csv", n=100)
    with caplog.at_level(logging.WARNING, logger="silodp.data.build"):
        build_federated_data(_table(path))
    (record,) = [r for r in caplog.records if "differ in scale" in r.getMessage()]
    text = record.getMessage()
    assert "'chol'" in text and "'a'" in text and 'scaling = "bounds"' in text
    assert '"standard"' in text and '"dp"' in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="silodp.data.build"):
        build_federated_data(_table(path, scaling="standard", feature_mean=0, feature_std=1))
    assert not caplog.records


def test_scale_warning_threshold() -> None:
    x = np.column_stack([np.full(10, 99.0), np.ones(10), np.zeros(10)]).astype(np.float32)
    assert scale_warning(x, ["big", "one", "zero"]) is None  # ratio 99, zero column ignored
    x[:, 0] = 100.0
    text = scale_warning(x, ["big", "one", "zero"])
    assert text is not None and "largest 'big'; smallest 'one'" in text
    assert "10^2 or more" in text and "'zero'" not in text
    # names and the ratio's power of ten: no statistic of the records
    x[:, 0] = 123.456
    assert "123" not in scale_warning(x, ["big", "one", "zero"])


# --- the DP estimate ------------------------------------------------------------------------


def _federation(
    num_subjects: int, *, num_silos: int = 4, num_features: int = 3, seed: int = 0
) -> FederatedDataset:
    """Subjects with 1-3 records each, in one or two silos; features in about [0, 10]."""
    rng = np.random.default_rng(seed)
    per_subject = rng.integers(1, 4, size=num_subjects)
    subject = np.repeat(np.arange(num_subjects), per_subject)
    home = rng.integers(0, num_silos, size=num_subjects)
    away = rng.integers(0, num_silos, size=num_subjects)
    silo = np.where(rng.random(len(subject)) < 0.7, home[subject], away[subject])
    centres = np.array([2.0, 5.0, 8.0])[:num_features]
    x = centres + rng.normal(size=(len(subject), num_features)) * np.arange(1, num_features + 1)
    return FederatedDataset(
        x=x.astype(np.float32),
        y=rng.integers(0, 2, size=len(subject)),
        silo=silo,
        subject=subject,
        num_classes=2,
        num_silos=num_silos,
    )


def test_dp_feature_stats_are_close_to_the_truth() -> None:
    train = _federation(3000)
    bounds = (-2.0, 12.0)
    stats = dp_feature_stats(train, bounds=bounds, noise_multiplier=0.5, coins=Coins.seeded(0))
    clipped = np.clip(train.x.astype(np.float64), *bounds)
    np.testing.assert_allclose(stats.mean, clipped.mean(axis=0), atol=0.05)
    np.testing.assert_allclose(stats.std, clipped.std(axis=0), rtol=0.03)
    assert stats.kind == "dp" and stats.dp_event == dp_event.GaussianDpEvent(0.5)
    assert stats.num_pairs == int((train.histogram() > 0).sum())
    data = FederatedData(train=train, test=_test_like(train))
    scaled = stats.apply(data)
    assert scaled.scaling == "dp"
    assert np.all(np.abs(scaled.train.x.mean(axis=0)) < 0.05)
    assert np.all(np.abs(scaled.train.x.std(axis=0) - 1.0) < 0.05)
    np.testing.assert_allclose(scaled.test.x, stats.transform(data.test.x))
    with pytest.raises(ValueError, match="already scaled by 'dp'"):
        stats.apply(scaled)


def _test_like(train: FederatedDataset):  # type: ignore[no-untyped-def]
    from silodp.data.dataset import TestSplit

    return TestSplit(x=train.x[:50] * 2.0, y=train.y[:50])


def test_dp_feature_stats_stay_where_bounded_values_can_be() -> None:
    """On a small federation with much noise, the estimates were left where no data could be
    (means beyond the bounds, stds above the half-range or at 0.01 of it), so scaled features
    reached ±285. Post-processing keeps each mean within the bounds and each std between 0.1
    half-range and what values of that mean can have: scaled training features within ±20."""
    train = _federation(12, num_silos=3, num_features=3, seed=1)
    bounds = (0.0, 10.0)
    half = 5.0
    outside = 0
    for k in range(40):
        stats = dp_feature_stats(train, bounds=bounds, noise_multiplier=3.0, coins=Coins.seeded(k))
        unit_mean = (stats.mean - 5.0) / half
        unit_std = stats.std / half
        assert np.all(np.abs(unit_mean) <= 1.0)
        assert np.all(unit_std >= math.sqrt(VARIANCE_FLOOR) - 1e-12)
        ceiling = np.sqrt(np.maximum(VARIANCE_FLOOR, 1.0 - unit_mean**2))
        assert np.all(unit_std <= ceiling + 1e-12)
        assert np.abs(stats.transform(train.x)).max() <= 2.0 / math.sqrt(VARIANCE_FLOOR)
        outside += int(np.any(np.abs(unit_mean) == 1.0) or np.any(unit_std == ceiling))
    assert outside >= 5  # the noise does put raw estimates out of range at this σ


def test_dp_feature_stats_is_seeded_and_needs_bounds() -> None:
    train = _federation(100)
    a = dp_feature_stats(train, bounds=(0, 10), noise_multiplier=1.0, coins=Coins.seeded(7))
    b = dp_feature_stats(train, bounds=(0, 10), noise_multiplier=1.0, coins=Coins.seeded(7))
    c = dp_feature_stats(train, bounds=(0, 10), noise_multiplier=1.0, coins=Coins.seeded(8))
    np.testing.assert_array_equal(a.mean, b.mean)
    assert not np.array_equal(a.mean, c.mean)
    with pytest.raises(ValueError, match="needs public feature_bounds"):
        dp_feature_stats(train, bounds=None, noise_multiplier=1.0, coins=Coins.seeded(0))
    with pytest.raises(ValueError, match="noise_multiplier=0"):
        dp_feature_stats(train, bounds=(0, 1), noise_multiplier=0, coins=Coins.seeded(0))
    with pytest.raises(ValueError, match=r"exactly 3 \(one per feature column\), got 2"):
        dp_feature_stats(
            train, bounds=((0, 1), (0, 1)), noise_multiplier=1.0, coins=Coins.seeded(0)
        )


def test_sensitivity_formula() -> None:
    assert stats_sensitivity(1) == SENSITIVITY_PER_FEATURE == 2.0
    assert stats_sensitivity(9) == pytest.approx(6.0)
    # per feature: the diameter of {(t, t^2): t in [-1, 1]} is 2 (at t = 1, s = -1)
    t = np.linspace(-1.0, 1.0, 801)
    points = np.stack([t, t**2], axis=1)
    diameter = np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1)).max()
    assert diameter == pytest.approx(SENSITIVITY_PER_FEATURE)


def test_a_silo_release_moves_by_at_most_the_sensitivity() -> None:
    train = _federation(60, num_features=3, seed=1)
    bounds = (0.0, 10.0)
    delta = stats_sensitivity(3)
    base = silo_moment_sums(train, bounds=bounds)
    worst = 0.0
    for a in range(train.num_subjects):  # remove every subject in turn
        keep = np.flatnonzero(train.subject != a)
        moved = np.linalg.norm(base - silo_moment_sums(train.subset(keep), bounds=bounds), axis=1)
        worst = max(worst, float(moved.max()))
    assert 0 < worst <= math.sqrt(2 * 3) <= delta  # removal: one average, norm <= sqrt(2d)
    rng = np.random.default_rng(2)
    for _ in range(200):  # change one record to anything (clipped to the bounds)
        x = train.x.copy()
        x[rng.integers(len(x))] = rng.uniform(-20, 30, size=3)
        moved = np.linalg.norm(base - silo_moment_sums(train.with_features(x), bounds=bounds), 1)
        assert moved.max() <= delta + 1e-9
    # a one-record subject moved from the lower to the upper bound attains Δ exactly
    hist = train.histogram()
    s, a = map(int, np.argwhere(hist == 1)[0])
    r = int(np.flatnonzero((train.silo == s) & (train.subject == a))[0])
    low, high = train.x.copy(), train.x.copy()
    low[r], high[r] = 0.0, 10.0
    gap = silo_moment_sums(train.with_features(low), bounds=bounds)[s]
    gap -= silo_moment_sums(train.with_features(high), bounds=bounds)[s]
    assert np.linalg.norm(gap) == pytest.approx(delta)


def test_silo_moment_sums_average_within_a_subject() -> None:
    train = FederatedDataset(
        x=np.array([[0.0], [10.0], [5.0], [10.0]], dtype=np.float32),
        y=[0, 1, 0, 1],
        silo=[0, 0, 0, 1],
        subject=[0, 0, 1, 0],
        num_classes=2,
    )
    sums = silo_moment_sums(train, bounds=(0, 10))
    # silo 0: subject 0 averages (-1, 1) and (1, 1) -> (0, 1); subject 1 gives (0, 0)
    np.testing.assert_allclose(sums, [[0.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(to_unit(np.array([[-5.0, 5.0, 15.0]]), 0.0, 10.0), [[-1, 0, 1]])


def test_dp_noise_has_the_calibrated_scale() -> None:
    """The error of the mean estimate has std σ·Δ·sqrt(S)/N; a 20% wrong σ is rejected."""
    train = _federation(40, num_silos=3, num_features=3, seed=3)
    bounds = (0.0, 10.0)  # the means sit inside (unit scale about -0.6, 0, 0.6): never clipped
    sums = silo_moment_sums(train, bounds=bounds)
    n_pairs = int((train.histogram() > 0).sum())
    exact = sums.sum(axis=0)[:3] / n_pairs
    assert np.all(np.abs(exact) < 0.7)
    sigma = 0.3
    errors = np.concatenate(
        [
            (
                dp_feature_stats(
                    train, bounds=bounds, noise_multiplier=sigma, coins=Coins.seeded(k)
                ).mean
                - 5.0
            )
            / 5.0
            - exact
            for k in range(400)
        ]
    )

    def ratio(s: float) -> float:
        return float(errors.std() / (s * stats_sensitivity(3) * math.sqrt(3) / n_pairs))

    assert abs(errors.mean()) < 0.1 * errors.std()
    assert abs(ratio(sigma) - 1.0) < 0.1
    assert abs(ratio(0.8 * sigma) - 1.0) > 0.1 and abs(ratio(1.25 * sigma) - 1.0) > 0.1


def test_dp_scaling_builds_unscaled_data_for_the_runner(tmp_path: Path) -> None:
    path = _clinical_csv(tmp_path / "c.csv", n=300)
    cfg = _table(path, scaling="dp", feature_bounds=((1500, 3500), *[(0.0, 0.1)] * 3))
    assert cfg.scaling_budget == 0.1
    data = build_federated_data(cfg)
    raw = build_federated_data(_table(path))
    assert data.scaling == "none"
    np.testing.assert_array_equal(data.train.x, raw.train.x)
    stats = dp_feature_stats(
        data.train, bounds=cfg.feature_bounds, noise_multiplier=1.0, coins=Coins.seeded(0)
    )
    scaled = stats.apply(data)
    assert scaled.split == data.split and scaled.subjects_note == data.subjects_note
    assert np.all(np.abs(scaled.train.x.mean(axis=0)) < 0.5)


def test_feature_stats_from_bounds_and_standard() -> None:
    stats = FeatureStats.from_bounds((0.0, 4.0), 2)
    np.testing.assert_allclose(stats.transform(np.array([[0.0, 6.0]], np.float32)), [[-1, 1]])
    assert isinstance(stats.dp_event, dp_event.NoOpDpEvent)
    with pytest.raises(ValueError, match="Expected 2 feature columns"):
        stats.transform(np.zeros((1, 3), np.float32))
    std = FeatureStats.standard((1.0, 2.0), 2.0, 2)
    np.testing.assert_allclose(std.transform(np.array([[3.0, 2.0]], np.float32)), [[1, 0]])


@pytest.mark.parametrize(
    ("algorithm", "what"),
    [
        ("user_ldp", "user_ldp's silo-level (replace-one) guarantee"),
        ("prifedsync", "prifedsync's record-level (replace-one) guarantee"),
        ("local_item_dp", None),
    ],
)
def test_dp_scaling_names_the_guarantee_it_does_not_compose_with(
    algorithm: str, what: str | None
) -> None:
    import dataclasses

    from silodp.config import load_config
    from silodp.errors import InvalidValueError
    from silodp.experiment.prepare import dp_scaling

    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.toml"
    config = dataclasses.replace(load_config(smoke), algorithms=(algorithm,))
    if what is None:  # an add/remove record/subject guarantee: refused only for lack of ε
        with pytest.raises(InvalidValueError, match="privacy.epsilon"):
            dp_scaling(
                dataclasses.replace(
                    config, privacy=dataclasses.replace(config.privacy, epsilon=None)
                ),
                None,
            )  # type: ignore[arg-type]
        return
    with pytest.raises(InvalidValueError, match=re.escape(what)):
        dp_scaling(config, None)  # type: ignore[arg-type]


def test_dp_scaling_refuses_a_span_one_algorithm_overrides() -> None:
    """The statistics are computed and composed over privacy.span once for every algorithm:
    an [algorithm.NAME] span below it would compose their release over fewer silos than they
    touched (an optimistic subject ε)."""
    import dataclasses

    from silodp.config import load_config
    from silodp.errors import InvalidValueError
    from silodp.experiment.prepare import dp_scaling

    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.toml"
    config = load_config(smoke)
    config = dataclasses.replace(
        config, algorithms=("local_item_dp",), overrides={"local_item_dp": {"span": 1}}
    )
    with pytest.raises(InvalidValueError, match=r"no \[algorithm.local_item_dp\] span"):
        dp_scaling(config, None)  # type: ignore[arg-type]


def test_bounds_whose_width_overflows_are_refused() -> None:
    """[-1e308, 1e308] is infinitely wide in floating point: every feature scaled to 0."""
    from silodp.data.scaling import check_bounds
    from silodp.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match="width hi - lo a float32 holds"):
        check_bounds("feature_bounds", [-1e308, 1e308])
    assert check_bounds("feature_bounds", [-1e30, 1e30]) == (-1e30, 1e30)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"feature_mean": 0.0, "feature_std": 1e-40},
            r"Expected feature_std >= 2.939e-39 \(1 / float32's largest value\), got "
            r"feature_std=1e-40",
        ),
        (
            {"feature_mean": 1e300, "feature_std": 1.0},
            r"Expected feature_mean within float32's range .*, got feature_mean=1e\+300",
        ),
        (
            {"feature_mean": (0.0, -1e39), "feature_std": 1.0},
            r"Expected feature_mean within .*got -1e\+39 at index 1 of feature_mean",
        ),
        (
            {"feature_mean": 0.0, "feature_std": (1.0, 1e-45)},
            r"Expected feature_std >= .*got 1e-45 at index 1 of feature_std",
        ),
        (
            {"feature_mean": 0.0, "feature_std": 1e39},
            r"Expected feature_std within float32's range .*got feature_std=1e\+39",
        ),
    ],
)
def test_standard_constants_beyond_float32_are_refused_naming_the_key(
    kwargs: dict, message: str
) -> None:
    """feature_std = 1e-40 printed numpy's overflow warning, then blamed the data ("Expected
    finite features; ... NaN/inf"); now the config names the constant."""
    with pytest.raises(InvalidValueError, match=message):
        DataConfig(source="table", path="t.csv", scaling="standard", **kwargs)
    with pytest.raises(InvalidValueError, match=message.split(" ")[1]):
        FeatureStats.standard(kwargs["feature_mean"], kwargs["feature_std"], 2)


def test_standard_scaling_that_overflows_names_the_constants_not_the_data(
    tmp_path: Path,
) -> None:
    """Constants in range can still overflow for large features (a column near 2,500 divided
    by 1e-36): the error names feature_mean/feature_std and the feature columns, without
    numpy's RuntimeWarning; a tiny std that keeps the values in range is applied."""
    path = _clinical_csv(tmp_path / "c.csv", n=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            InvalidValueError,
            match=r"Expected feature_mean and feature_std to keep the scaled features within "
            r"float32's range, got \(x - 0\.0\) / 1e-36 beyond it for feature 0 \(.*The feature "
            r"columns of .* are \['chol', 'a', 'b', 'c'\]",
        ):
            build_federated_data(
                _table(path, scaling="standard", feature_mean=0, feature_std=1e-36)
            )
        data = build_federated_data(
            _table(path, scaling="standard", feature_mean=0, feature_std=1e-30)
        )
    raw = build_federated_data(_table(path))
    np.testing.assert_allclose(data.train.x, raw.train.x.astype(np.float64) * 1e30, rtol=1e-6)


@pytest.mark.parametrize(
    ("span_cap", "federation_cap"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_one_added_record_changes_no_more_silos_statistics_than_are_charged(
    span_cap: bool, federation_cap: bool
) -> None:
    """The record-level events of the DP statistics count the silos whose sums one added
    record can change. With a federation-wide cap and a span cap together, three silos could
    change (the added record's, the one whose record it pushed out, and one leaving the kept
    silos) while two were charged."""
    from silodp.accounting.plan import feature_statistics_releases
    from silodp.data.partition import assemble, cap_records, cap_span
    from silodp.data.scaling import silo_moment_sums

    silos, k, span = 5, 3, 2
    event = feature_statistics_releases(
        1.0, silos, span_cap=span_cap, federation_cap=federation_cap
    )[0].events["record"]
    charged = getattr(event, "count", 1)

    def sums(x, silo, subject):  # type: ignore[no-untyped-def]
        y = np.zeros(len(x), dtype=np.int64)
        d = assemble(x, y, silo=silo, subject=subject, num_classes=2, num_silos=silos)
        if federation_cap:
            d = cap_records(d, total=k, seed=0)
        if span_cap:
            d = cap_span(d, span=span, seed=0)
        return silo_moment_sums(d, bounds=[-1.0, 1.0])

    rng = np.random.default_rng(1)
    worst = 0
    for _ in range(1500):
        n = int(rng.integers(7, 12))
        x = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
        silo = rng.integers(0, silos, n)
        silo[:silos] = np.arange(silos)  # every silo holds a record of another subject
        subject = np.zeros(n, dtype=np.int64)
        subject[:silos] = np.arange(1, silos + 1)
        added = int(rng.integers(0, silos))
        before = sums(x, silo, subject)
        after = sums(
            np.vstack([x, rng.uniform(-1, 1, (1, 1)).astype(np.float32)]),
            np.r_[silo, added],
            np.r_[subject, 0],
        )
        worst = max(worst, int((np.abs(before - after).sum(axis=1) > 1e-12).sum()))
    assert worst <= charged
    assert worst == (3 if span_cap and federation_cap else 2 if span_cap or federation_cap else 1)


def test_dp_statistics_and_training_keep_the_same_capped_records(tmp_path: Path) -> None:
    """The span cap's priorities hash the records as loaded: the DP statistics (on the raw
    records) and training (on the scaled ones) keep each subject in the same silos, so a
    subject with span 1 feeds one silo's statistics and that silo's training only."""
    from silodp.config import load_config
    from silodp.data.bounds import cap_span
    from silodp.experiment.prepare import dp_scaling, prepare_run

    rng = np.random.default_rng(3)
    rows = [
        (f"p{a}", silo, *rng.normal(size=2).round(3), int(rng.integers(0, 2)))
        for a in range(24)
        for silo in "ABC"
        for _ in range(int(rng.integers(1, 4)))
    ]
    pd.DataFrame(rows, columns=["subj", "silo", "f0", "f1", "label"]).to_csv(
        tmp_path / "span.csv", index=False
    )
    (tmp_path / "c.toml").write_text(
        'name = "span"\nalgorithms = ["uldp_avg"]\n'
        f'[data]\nsource = "table"\npath = "{tmp_path / "span.csv"}"\n'
        'feature_columns = ["f0", "f1"]\n'
        'label_column = "label"\nlabel_values = [0, 1]\nsubject_column = "subj"\n'
        'silo_column = "silo"\nallocation = "column"\nscaling = "dp"\n'
        "feature_bounds = [-2.0, 2.0]\n"
        '[model]\nname = "mlp"\n'
        "[training]\nrounds = 1\nlocal_steps = 1\nbatch_size = 8\nlr = 0.1\n"
        "[privacy]\nepsilon = 4.0\ndelta = 1e-5\nclip = 1.0\nspan = 1\n"
    )
    config = load_config(tmp_path / "c.toml")
    data = build_federated_data(config.data)
    statistics_on = cap_span(data.train, span=1, seed=config.data.seed)
    scaled, releases, _ = dp_scaling(config, data)
    trained_on = prepare_run("uldp_avg", config, scaled, releases=releases).train
    assert data.train.max_span() == 3 and trained_on.max_span() == 1
    np.testing.assert_array_equal(trained_on.histogram(), statistics_on.histogram())
