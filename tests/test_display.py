"""Privacy numbers as text: rounded up (ε, μ) or down (lower bounds), checked against exact
rational arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import example, given
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
@example(5e-324, 3)
@example(-5e-324, 3)
@example(1.7976931348623157e308, 3)
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


def test_the_expected_values_reject_rounding_to_nearest() -> None:
    """The exact reference above tells the two roundings apart: ``.3g`` prints 1.2345 below
    itself, and ``_expected`` does not accept it."""
    assert Fraction(format(1.2345, ".3g")) != _expected(1.2345, 3, True)
    assert float(format(1.2345, ".3g")) < 1.2345


def test_subnormal_values_print_their_decimal() -> None:
    assert upper(5e-324) == "5e-324" and lower(-5e-324) == "-5e-324"


# --- the tables that show ε: each ε (and μ) cell rounded up, other numbers as before --------


def test_report_tables_round_only_privacy_columns_up() -> None:
    """ε, μ and σ (privacy columns) are rounded up; other numbers to nearest."""
    from silodp.html_report import _cell as html_cell
    from silodp.reports import _cell as md_cell

    # 1.2345 is stored as 1.23449999…: to nearest it reads 1.234 (4 figures), 1.23 (3)
    assert html_cell(1.2345, "ε (subject)") == "1.235"
    assert html_cell(1.2345, "epsilon_subject_mean") == "1.235"
    # σ is rounded up too: copied into a config, it reaches the reported ε or less
    assert html_cell(1.2345, "σ") == "1.235"
    assert html_cell(1.2345, "privacy.epsilon") == "1.234"  # a grid axis: a target, an input
    assert md_cell("epsilon", 1.2345, {}) == "1.24"
    assert md_cell("mu_weak", 1.2345, {}) == "1.24"
    assert md_cell("noise_multiplier", 1.2345, {}) == "1.24"


def test_bench_tables_round_epsilon_columns_up() -> None:
    from silodp.bench.common import format_table

    row = {"epsilon": 1.2345, "epsilon_full": 0.012341, "sigma": 1.2345}
    cells = format_table([row], list(row)).splitlines()[-1].split("|")[1:-1]
    assert [c.strip() for c in cells] == ["1.24", "0.0124", "1.23"]


def test_audit_table_rounds_the_claim_up_the_measurement_down_and_a_violation_whole() -> None:
    from silodp.cli.audit import _table

    def report(claimed: float, measured: float) -> dict[str, object]:
        return {
            "algorithm": "uldp_avg",
            "unit": "subject",
            "claimed_epsilon": claimed,
            "lower_bound": measured,
            "bound": {"correct": 9, "guesses": 10},
            "wall_time_s": 1.0,
        }

    holds = _table([report(1.2345, 0.5678)]).splitlines()[1].split()
    assert holds[2:4] == ["1.24", "0.567"]
    # rounded, claimed 1.2341 → 1.24 and measured 1.2349 → 1.23 would read as a claim holding
    broken = _table([report(1.2341, 1.2349)]).splitlines()[1].split()
    assert broken[2:4] == ["1.2341", "1.2349"]
