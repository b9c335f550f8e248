"""Shared input checks for public boundaries.

Each helper raises :class:`~silodp.errors.InvalidValueError` (a ``ValueError``) naming the
parameter, the value received and what was expected, e.g.
``Expected noise_multiplier=-1.0 in [0, inf).``
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

from silodp.errors import InvalidValueError


def check_finite(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidValueError(f"Expected {name}={value!r} to be a finite number.")
    return float(value)


def check_in_range(
    name: str,
    value: float,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """Checks ``lo <= value <= hi`` (open ends where asked) and returns ``float(value)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidValueError(f"Expected {name}={value!r} to be a number.")
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            raise InvalidValueError(
                f"Expected {name} to be a number of at most {sys.float_info.max:.3g} in "
                f"magnitude, got an integer of {value.bit_length()} bits."
            ) from None
    elif math.isnan(value):
        raise InvalidValueError(f"Expected {name}={value!r} to be a number.")
    below = value <= lo if lo_open else value < lo
    above = value >= hi if hi_open else value > hi
    if below or above:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise InvalidValueError(f"Expected {name}={value!r} in {left}{lo}, {hi}{right}.")
    return float(value)


def check_positive(name: str, value: float) -> float:
    return check_in_range(name, value, 0.0, math.inf, lo_open=True, hi_open=True)


def check_non_negative(name: str, value: float) -> float:
    return check_in_range(name, value, 0.0, math.inf, hi_open=True)


def check_probability(name: str, value: float, *, allow_zero: bool = False) -> float:
    return check_in_range(name, value, 0.0, 1.0, lo_open=not allow_zero)


def check_int(name: str, value: int, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise InvalidValueError(f"Expected {name}={value!r} to be an integer.") from None
    if value < lo or (hi is not None and value > hi):
        upper = "inf" if hi is None else str(hi)
        raise InvalidValueError(f"Expected {name}={value!r} to be an integer in [{lo}, {upper}].")
    return int(value)


def check_choice(name: str, value: str, choices: Iterable[str]) -> str:
    options = tuple(choices)
    if value not in options:
        expected = ", ".join(map(repr, options))
        raise InvalidValueError(f"Expected {name}={value!r} to be one of {expected}.")
    return value
