"""Privacy numbers as text: rounded up (ε, μ) or down (lower bounds), checked against exact
rational arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from silodp.display import lower, upper

finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


def _expected(value: float, digits: int, up: bool) -> Fraction:
    """The nearest multiple of one unit in the ``digits``-th significant place of ``repr(value)``
    on the asked side, in exact rationals."""
    exact = Fraction(repr(value))
    if exact == 0:
        return exact
    exponent = math.floor(math.log10(abs(value)))
    # log10 of a float can be off by one near powers of ten: settle it exactly
    while Fraction(10) ** exponent > abs(exact):
        exponent -= 1
    while Fraction(10) ** (exponent + 1) <= abs(exact):
        exponent += 1
    unit = Fraction(10) ** (exponent - digits + 1)
    steps = math.ceil(exact / unit) if up else math.floor(exact / unit)
    return steps * unit


def _significant(text: str) -> int:
    mantissa = text.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return len(mantissa.rstrip("0")) if "." in text.split("e")[0] else len(mantissa)


@pytest.mark.parametrize(
    ("value", "up", "down"),
    [
        (1.2345, "1.24", "1.23"),
        (3.9974, "4", "3.99"),
        (4.0, "4", "4"),
        (0.1, "0.1", "0.1"),
        (99.95, "100", "99.9"),
        (0.000123456, "0.000124", "0.000123"),
        (12345.6, "1.24e+04", "1.23e+04"),
        (-1.2345, "-1.23", "-1.24"),
        (0.0, "0", "0"),
    ],
)
def test_known_values(value: float, up: str, down: str) -> None:
    assert upper(value) == up
    assert lower(value) == down


def test_no_bound_and_non_finite() -> None:
    assert upper(None) == "inf"
    assert lower(None) == "-inf"
    assert upper(math.inf) == "inf"
    assert lower(-math.inf) == "-inf"
    assert upper(math.nan) == "nan"


def test_fixed_places() -> None:
    assert upper(1.23441, places=4) == "1.2345"
    assert lower(1.23449, places=4) == "1.2344"
    assert upper(2.0, places=4) == "2.0000"
    assert upper(1e-9, places=4) == "0.0001"
    assert lower(1e-9, places=4) == "0.0000"


@given(finite, st.integers(1, 6))
def test_significant_figures_on_the_safe_side(value: float, digits: int) -> None:
    for side, text in ((True, upper(value, digits)), (False, lower(value, digits))):
        if math.isinf(float(text)):  # rounded up past the largest float: still a bound
            assert side and value > 0
            continue
        assert Fraction(text) == _expected(value, digits, side), text
        assert _significant(text) <= digits, text
        # the text read back is on the asked side of the float itself
        assert (float(text) >= value) if side else (float(text) <= value)


@given(finite.filter(lambda v: abs(v) < 1e12), st.integers(0, 6))
def test_fixed_places_on_the_safe_side(value: float, places: int) -> None:
    scale = Fraction(10) ** places
    exact = Fraction(repr(value))
    up, down = upper(value, places=places), lower(value, places=places)
    assert Fraction(up) == math.ceil(exact * scale) / scale
    assert Fraction(down) == math.floor(exact * scale) / scale
    assert len(up.partition(".")[2]) == places


def test_rounding_to_nearest_would_fail() -> None:
    """The check above rejects the usual ``.3g``: it prints 1.2345 below itself."""
    assert Fraction(format(1.2345, ".3g")) != _expected(1.2345, 3, True)
    assert float(format(1.2345, ".3g")) < 1.2345
