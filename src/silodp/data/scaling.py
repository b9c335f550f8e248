"""Feature scaling for tables: from public constants, or from a DP estimate.

Gradient-trained models fail on raw table features whose scales differ by orders of magnitude
(a column near 2,500 next to columns near 0.05: the model predicts the majority class).
``[data] scaling`` chooses a transform, applied identically to training and test records:

* ``"bounds"``: public ``feature_bounds`` ``[lo, hi]`` map each feature to [-1, 1]; values
  outside the bounds are clipped. Public constants: no privacy cost.
* ``"standard"``: public ``feature_mean`` and ``feature_std``: ``(x - mean) / std``. No privacy
  cost, no clipping.
* ``"dp"``: mean and standard deviation estimated with differential privacy across the
  silos by :func:`dp_feature_stats` (see there for the mechanism and its guarantee).

:func:`scale_warning` flags tables whose feature scales differ by a factor of
:data:`SCALE_RATIO_WARNING` or more.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from dp_accounting import dp_event

from silodp._validation import check_int, check_positive
from silodp.data.dataset import FederatedData, FederatedDataset, TestSplit
from silodp.errors import InvalidValueError
from silodp.privacy.noise import gaussian_mechanism
from silodp.privacy.randomness import Coins

__all__ = [
    "SCALINGS",
    "SCALE_RATIO_WARNING",
    "SENSITIVITY_PER_FEATURE",
    "VARIANCE_FLOOR",
    "FeatureStats",
    "check_bounds",
    "check_per_feature",
    "dp_feature_stats",
    "feature_scales",
    "resolve_bounds",
    "resolve_per_feature",
    "scale_warning",
    "silo_moment_sums",
    "stats_sensitivity",
    "to_unit",
]

logger = logging.getLogger(__name__)

SCALINGS = ("none", "bounds", "standard", "dp")

#: L2 diameter of ``{(t, t²) : t ∈ [-1, 1]}``, one feature's share of the released vector:
#: the largest of ``|t - s|·sqrt(1 + (t + s)²)`` over ``t, s ∈ [-1, 1]``, attained at
#: ``t = 1, s = -1``.
SENSITIVITY_PER_FEATURE = 2.0

#: Smallest variance (on the [-1, 1] scale) :func:`dp_feature_stats` reports: a noisy
#: variance estimate can be tiny or negative; the floor keeps the standard deviation >= 0.1,
#: so scaled features stay within ±20 however the noise fell.
VARIANCE_FLOOR = 1e-2

#: :func:`scale_warning` fires when the largest per-feature scale is at least this many
#: times the smallest.
SCALE_RATIO_WARNING = 100.0


def stats_sensitivity(num_features: int) -> float:
    """L2 sensitivity ``Δ = 2·sqrt(d)`` of one silo's release in :func:`dp_feature_stats`.

    ``Δ`` is the L2 diameter of the set the per-record vector ``v = (x̂, x̂²)`` ranges over,
    ``{(t, t²) : t ∈ [-1, 1]}^d``: per feature the diameter is 2
    (:data:`SENSITIVITY_PER_FEATURE`) and the squared diameters of a product add up.
    """
    d = check_int("num_features", num_features, 1)
    return SENSITIVITY_PER_FEATURE * math.sqrt(d)


# --- parsing public constants -----------------------------------------------------------


def _finite_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _is_pair(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(_finite_number(v) for v in value)
    )


def check_bounds(name: str, value: Any) -> tuple[float, float] | tuple[tuple[float, float], ...]:
    """Validates ``[lo, hi]`` (all features) or ``[[lo, hi], ...]`` (one pair per feature).

    Returns the value as tuples. Raises ``ValueError`` naming ``name`` unless every pair is
    two finite numbers with ``lo < hi``.
    """
    expected = "[lo, hi] or one [lo, hi] per feature column, with finite lo < hi"
    if _is_pair(value):
        pairs: list[Any] = [value]
        single = True
    elif (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(_is_pair(p) for p in value)
    ):
        pairs, single = list(value), False
    else:
        raise InvalidValueError(f"Expected {name}={value!r} to be {expected}.")
    out = []
    for i, (lo, hi) in enumerate(pairs):
        if not float(lo) < float(hi):
            where = "" if single else f" (pair {i})"
            raise InvalidValueError(
                f"Expected {name}={value!r} to have lo < hi{where}; got [{lo}, {hi}]."
            )
        width = float(hi) - float(lo)
        if not math.isfinite(width) or width > np.finfo(np.float32).max:
            where = "" if single else f" (pair {i})"
            raise InvalidValueError(
                f"Expected {name}={value!r} to have a width hi - lo a float32 holds{where}; "
                f"[{lo}, {hi}] is {width:g} wide, and every feature would scale to 0."
            )
        out.append((float(lo), float(hi)))
    return out[0] if single else tuple(out)


def check_per_feature(
    name: str, value: Any, *, positive: bool = False
) -> float | tuple[float, ...]:
    """Validates a number or a non-empty list of numbers (one per feature column)."""
    kind = "positive finite" if positive else "finite"
    items = [value] if _finite_number(value) else value
    if (
        not isinstance(items, Sequence)
        or isinstance(items, str)
        or len(items) == 0
        or not all(_finite_number(v) for v in items)
        or (positive and not all(float(v) > 0 for v in items))
    ):
        raise InvalidValueError(
            f"Expected {name}={value!r} to be a {kind} number or one {kind} number per feature "
            "column."
        )
    floats = tuple(float(v) for v in items)
    _check_float32_range(name, value, floats, reciprocal=positive)
    return floats[0] if _finite_number(value) else floats


def _check_float32_range(
    name: str, value: Any, floats: tuple[float, ...], *, reciprocal: bool
) -> None:
    """Refuses a ``"standard"`` constant outside float32's range: a mean beyond its largest
    value, or a std below 1 / that value, turns ``(x - mean) / std`` into inf (a std above
    it squashes every feature to about 0). ``reciprocal``: ``name`` is the divisor
    (``feature_std``)."""
    big = float(np.finfo(np.float32).max)
    for i, v in enumerate(floats):
        got = f"{name}={value!r}" if len(floats) == 1 else f"{v!r} at index {i} of {name}"
        if reciprocal and v < 1.0 / big:
            raise InvalidValueError(
                f"Expected {name} >= {1.0 / big:.4g} (1 / float32's largest value), got {got}: "
                "dividing by it overflows float32, so the scaled features would be infinite."
            )
        if abs(v) > big:
            effect = (
                "every scaled feature would be about 0"
                if reciprocal
                else "every scaled feature would overflow float32"
            )
            raise InvalidValueError(
                f"Expected {name} within float32's range (|{name}| <= {big:.4g}), got {got}: "
                f"{effect}."
            )


def _feature_count_error(name: str, value: Any, count: int, num_features: int) -> InvalidValueError:
    return InvalidValueError(
        f"Expected {name}={value!r} to give one value for all features or exactly "
        f"{num_features} (one per feature column), got {count}."
    )


def resolve_bounds(bounds: Any, num_features: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature ``(lo, hi)`` float64 arrays of length ``num_features`` from ``bounds``
    (``[lo, hi]`` or one pair per feature; see :func:`check_bounds`)."""
    d = check_int("num_features", num_features, 1)
    if bounds is None:
        raise InvalidValueError(
            "Expected feature_bounds=[lo, hi] or one pair per feature, got None."
        )
    checked = check_bounds("feature_bounds", bounds)
    pairs = np.asarray(checked, dtype=np.float64).reshape(-1, 2)
    if len(pairs) == 1:
        pairs = np.repeat(pairs, d, axis=0)
    elif len(pairs) != d:
        raise _feature_count_error("feature_bounds", bounds, len(pairs), d)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def resolve_per_feature(
    name: str, value: Any, num_features: int, *, positive: bool = False
) -> np.ndarray:
    """A float64 array of length ``num_features`` from a number or one number per feature."""
    d = check_int("num_features", num_features, 1)
    checked = check_per_feature(name, value, positive=positive)
    arr = np.atleast_1d(np.asarray(checked, dtype=np.float64))
    if len(arr) == 1:
        return np.repeat(arr, d)
    if len(arr) != d:
        raise _feature_count_error(name, value, len(arr), d)
    return arr


def _features_2d(x: np.ndarray, where: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype.kind != "f":
        raise InvalidValueError(
            f"Expected float features of shape (records, features) in {where}, got dtype "
            f"{x.dtype} and shape {x.shape}; feature scaling is for tables."
        )
    return x


def to_unit(x: np.ndarray, lo: np.ndarray | float, hi: np.ndarray | float) -> np.ndarray:
    """``x̂ = 2·(clip(x, lo, hi) - lo) / (hi - lo) - 1`` per feature: [lo, hi] -> [-1, 1];
    values outside the bounds are clipped to them. float64."""
    x = np.asarray(x, dtype=np.float64)
    return 2.0 * (np.clip(x, lo, hi) - lo) / (hi - lo) - 1.0


# --- the transform ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FeatureStats:
    """A per-feature affine transform ``(clip(x) - mean) / std`` on the raw scale.

    Attributes:
      kind: ``"bounds"``, ``"standard"`` or ``"dp"`` (how ``mean``/``std`` were obtained).
      mean, std: float64 arrays, one entry per feature, in the table's units.
      lo, hi: clip bounds applied before the transform (``None``: no clipping).
      noise_multiplier: ``σ`` of a DP estimate (``None`` for public constants).
      num_pairs: the public number of (silo, subject) pairs a DP estimate averaged over.
    """

    kind: str
    mean: np.ndarray
    std: np.ndarray
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    noise_multiplier: float | None = None
    num_pairs: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SCALINGS[1:]:
            raise InvalidValueError(f"Expected kind={self.kind!r} to be one of {SCALINGS[1:]}.")
        mean = np.asarray(self.mean, dtype=np.float64).reshape(-1)
        std = np.asarray(self.std, dtype=np.float64).reshape(-1)
        if mean.shape != std.shape or not (np.all(np.isfinite(mean)) and np.all(std > 0)):
            raise InvalidValueError(
                f"Expected finite mean and positive std of equal length, got {mean} and {std}."
            )
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    @property
    def num_features(self) -> int:
        return len(self.mean)

    @classmethod
    def from_bounds(cls, bounds: Any, num_features: int) -> FeatureStats:
        """``"bounds"`` scaling: clip to ``[lo, hi]`` and map to [-1, 1]."""
        lo, hi = resolve_bounds(bounds, num_features)
        return cls(kind="bounds", mean=(lo + hi) / 2.0, std=(hi - lo) / 2.0, lo=lo, hi=hi)

    @classmethod
    def standard(cls, mean: Any, std: Any, num_features: int) -> FeatureStats:
        """``"standard"`` scaling with public ``mean`` and ``std`` (numbers or per feature)."""
        return cls(
            kind="standard",
            mean=resolve_per_feature("feature_mean", mean, num_features),
            std=resolve_per_feature("feature_std", std, num_features, positive=True),
        )

    @property
    def dp_event(self) -> dp_event.DpEvent:
        """What one silo ran (``GaussianDpEvent(σ)``, at sensitivity :func:`stats_sensitivity`)
        for a DP estimate; ``NoOpDpEvent`` for public constants. Composing it over the silos
        a subject spans is the accountant's job (see :func:`dp_feature_stats`)."""
        if self.noise_multiplier is None:
            return dp_event.NoOpDpEvent()
        return dp_event.GaussianDpEvent(self.noise_multiplier)

    def transform(self, x: np.ndarray) -> np.ndarray:
        """``(clip(x, lo, hi) - mean) / std`` as float32 (no clipping without bounds)."""
        x = _features_2d(x, "FeatureStats.transform")
        if x.shape[1] != self.num_features:
            raise InvalidValueError(
                f"Expected {self.num_features} feature columns (as the scaling was built for), "
                f"got {x.shape[1]}."
            )
        values = np.asarray(x, dtype=np.float64)
        if self.lo is not None and self.hi is not None:
            values = np.clip(values, self.lo, self.hi)
        with np.errstate(over="ignore"):
            scaled = (values - self.mean) / self.std
        bad = ~(np.abs(scaled) <= np.finfo(np.float32).max) & np.isfinite(values)
        if bad.any():  # named by feature, not by record: the values stay unprinted
            col = int(np.nonzero(bad)[1][0])
            keys = "feature_mean and feature_std" if self.kind == "standard" else "mean and std"
            raise InvalidValueError(
                f"Expected {keys} to keep the scaled features within float32's range, got "
                f"(x - {float(self.mean[col])!r}) / {float(self.std[col])!r} beyond it for "
                f"feature {col} ({int(bad.sum())} value(s) overflow)."
            )
        return scaled.astype(np.float32)

    def apply(self, data: FederatedData) -> FederatedData:
        """``data`` with the transform applied to training and test features alike."""
        if data.scaling != "none":
            raise InvalidValueError(
                f"Expected unscaled data, got data already scaled by {data.scaling!r}."
            )
        test = data.test
        return replace(
            data,
            train=data.train.with_features(self.transform(data.train.x)),
            test=TestSplit(x=self.transform(test.x), y=test.y, silo=test.silo),
            scaling=self.kind,
        )


# --- the DP estimate --------------------------------------------------------------------


def silo_moment_sums(train: FederatedDataset, *, bounds: Any) -> np.ndarray:
    """What each silo releases in :func:`dp_feature_stats`, before noise.

    Row ``s`` (shape ``(num_silos, 2d)``) is ``Σ_a mean_{r ∈ D_{s,a}} (x̂_r, x̂_r²)``: over the
    subjects ``a`` with records in silo ``s``, the average over the subject's records there
    of ``x̂`` (features clipped to ``bounds`` and mapped to [-1, 1]) followed by ``x̂²``.
    """
    x = _features_2d(train.x, "the training records")
    lo, hi = resolve_bounds(bounds, x.shape[1])
    unit = to_unit(x, lo, hi)
    v = np.concatenate([unit, unit**2], axis=1)
    cell = train.silo * train.num_subjects + train.subject
    order = np.argsort(cell, kind="stable")
    sorted_cells = cell[order]
    starts = np.flatnonzero(np.r_[True, sorted_cells[1:] != sorted_cells[:-1]])
    counts = np.diff(np.r_[starts, len(cell)])
    averages = np.add.reduceat(v[order], starts, axis=0) / counts[:, None]
    cell_silo = sorted_cells[starts] // train.num_subjects
    sums = np.zeros((train.num_silos, v.shape[1]), dtype=np.float64)
    np.add.at(sums, cell_silo, averages)
    return sums


def dp_feature_stats(
    train: FederatedDataset,
    *,
    bounds: Any,
    noise_multiplier: float,
    coins: Coins,
    variance_floor: float = VARIANCE_FLOOR,
) -> FeatureStats:
    """Per-feature mean and standard deviation estimated with differential privacy.

    Mechanism. Each feature is clipped to its public ``bounds`` (``[lo, hi]`` for all
    features or one pair per feature) and mapped to ``x̂ ∈ [-1, 1]``. In each silo ``s``, for
    each subject ``a`` with records there, the silo averages ``v = (x̂, x̂²)`` (``2d`` values)
    over the subject's records in ``s``, sums these averages over its subjects
    (:func:`silo_moment_sums`) and releases the sum through the Gaussian mechanism
    (:func:`silodp.privacy.noise.gaussian_mechanism` with noise multiplier ``σ`` and
    ``Δ = 2·sqrt(d)``, :func:`stats_sensitivity`): local noise, drawn by silo ``s`` from
    ``coins.spawn(s)``. The server adds the releases, divides by the public number ``N`` of
    (silo, subject) pairs holding records (silo subject counts are public in silodp, as silo
    sizes are), and reports ``mean = E[x̂]`` clipped to [-1, 1] and ``std = sqrt(E[x̂²] -
    E[x̂]²)`` clipped to the variance values can have, ``[floor, max(floor, 1 - mean²)]``, per
    feature (post-processing: the noise can put the raw estimates where no data could), mapped
    back to the raw scale (:class:`FeatureStats`; applying it clips to the same bounds).

    Sensitivity. ``Δ`` is the L2 diameter of the set ``{(t, t²) : t ∈ [-1, 1]}^d`` that ``v``
    ranges over, hence of its convex hull, where the per-subject averages lie. Adding or
    removing one subject's records in a silo changes that silo's sum by one average, of
    norm at most ``sqrt(2d) <= Δ``; changing one record changes one average by at most
    ``Δ / n_{s,a} <= Δ``; replacing a subject's records in the silo moves its average within
    the hull, by at most ``Δ``.

    Guarantee. Each silo's release is the Gaussian mechanism with noise multiplier ``σ`` at
    the subject-in-silo level (Dwork & Roth 2014, Thm A.1; Balle & Wang 2018 for the exact
    curve): a subject occupying ``span`` silos is covered by ``span`` such releases, so at
    the subject level the estimate is ``GaussianDpEvent(σ)`` composed ``span`` times; at the
    record level a record sits in one silo, so it is one ``GaussianDpEvent(σ)``. The caller's
    accountant does that composition (:attr:`FeatureStats.dp_event` is one silo's event) and
    adds it to the training's. The noise protects against the server and other silos; each
    silo sees its own records.

    Args:
      train: training records with float features of shape ``(n, d)``.
      bounds: public feature bounds (required).
      noise_multiplier: ``σ > 0``.
      coins: source of the noise; silo ``s`` uses ``coins.spawn(s)``.
      variance_floor: smallest variance on the [-1, 1] scale (:data:`VARIANCE_FLOOR`).
    """
    if not isinstance(train, FederatedDataset):
        raise InvalidValueError(f"Expected a FederatedDataset, got {type(train).__name__}.")
    if bounds is None:
        raise InvalidValueError(
            "dp_feature_stats needs public feature_bounds ([lo, hi] or one pair per feature) "
            "to clip the features; got feature_bounds=None."
        )
    sigma = check_positive("noise_multiplier", noise_multiplier)
    floor = check_positive("variance_floor", variance_floor)
    if not isinstance(coins, Coins):
        raise InvalidValueError(f"Expected coins to be a Coins, got {type(coins).__name__}.")
    sums = silo_moment_sums(train, bounds=bounds)
    d = sums.shape[1] // 2
    lo, hi = resolve_bounds(bounds, d)
    sensitivity = stats_sensitivity(d)
    total = np.zeros(2 * d, dtype=np.float64)
    for s in range(train.num_silos):
        released = gaussian_mechanism(
            {"v": torch.from_numpy(sums[s].copy())},
            noise_multiplier=sigma,
            sensitivity=sensitivity,
            coins=coins.spawn(s),
        )["v"]
        total += released.detach().cpu().numpy().astype(np.float64)
    num_pairs = int((train.histogram() > 0).sum())
    # post-processing into what values in [-1, 1] can have: a mean in [-1, 1], a variance
    # at most 1 - mean² (the noise put means at ±1.7 and stds at 1.7 on a small federation)
    first = np.clip(total[:d] / num_pairs, -1.0, 1.0)
    second = total[d:] / num_pairs
    unit_std = np.sqrt(np.clip(second - first**2, floor, np.maximum(floor, 1.0 - first**2)))
    half = (hi - lo) / 2.0
    return FeatureStats(
        kind="dp",
        mean=lo + (first + 1.0) * half,
        std=unit_std * half,
        lo=lo,
        hi=hi,
        noise_multiplier=sigma,
        num_pairs=num_pairs,
    )


# --- the scale check --------------------------------------------------------------------


def feature_scales(x: np.ndarray) -> np.ndarray:
    """Per-feature root mean square ``sqrt(mean(x²))``: large for a big offset or a big
    spread, so a column near 2,500 and one near 0.05 differ by ~5·10⁴."""
    values = np.asarray(_features_2d(x, "feature_scales"), dtype=np.float64)
    return np.sqrt(np.mean(values**2, axis=0))


def scale_warning(
    x: np.ndarray,
    names: Sequence[str],
    *,
    where: str = "the table",
    threshold: float = SCALE_RATIO_WARNING,
) -> str | None:
    """A warning text when the features' scales differ by ``threshold`` times or more.

    The scale of a feature is :func:`feature_scales` on the records given; all-zero columns
    are ignored. Computed locally by whoever loads the table, on its own records: the text
    names columns and the ratio's power of ten only, no statistic of the records (it goes
    to the console, which may be shared beyond the data's holders). Returns ``None`` when the
    scales are comparable.
    """
    scales = feature_scales(x)
    if len(names) != len(scales):
        raise InvalidValueError(f"Expected {len(scales)} feature names, got {len(names)}.")
    used = np.flatnonzero(scales > 0)
    if len(used) < 2:
        return None
    ratio = float(scales[used].max() / scales[used].min())
    if ratio < threshold:
        return None
    order = used[np.argsort(scales[used])]
    top, bottom = scales[order[-1]], scales[order[0]]
    # the columns far from the other end: >= threshold x the smallest, <= largest / threshold
    large_cols = [i for i in order[::-1] if scales[i] >= threshold * bottom][:3]
    small_cols = [i for i in order if scales[i] * threshold <= top][:3]
    large = ", ".join(repr(names[i]) for i in large_cols)
    small = ", ".join(repr(names[i]) for i in small_cols)
    power = int(math.floor(math.log10(ratio)))
    return (
        f"The feature columns of {where} differ in scale by a factor of 10^{power} or more "
        f"(root mean square: largest {large}; smallest {small}). Unscaled, such features can "
        "train to "
        'the majority class. Set [data] scaling = "bounds" (with feature_bounds), '
        '"standard" (with feature_mean and feature_std) or "dp" (with feature_bounds; a '
        'DP estimate across silos); scaling = "none" keeps the raw values.'
    )
