"""Privacy numbers as text, rounded to the safe side.

An ε or μ is an upper bound on what a run leaks; printed to 3 significant figures the usual
way, 1.2345 reads "1.23", a smaller number than the bound. Every ε and μ that silodp prints,
tables and figures included, goes through :func:`upper`, which rounds towards +∞ (1.2345 →
"1.24"), so the text is still an upper bound. A lower bound (the audit's measured ε) goes
through :func:`lower`, which rounds towards −∞. Both start from the shortest decimal that
reads back as the same float (``repr``), so the printed text, read back, is on the right side
of the float: ε = 0.1 prints "0.1", not the "0.101" its binary value (0.1000…0055) would round
up to.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Context, Decimal

__all__ = ["lower", "upper", "upper_and_lower"]


def upper(value: float | None, digits: int = 3, *, places: int | None = None) -> str:
    """``value`` rounded up to ``digits`` significant figures (``g`` style), or to ``places``
    decimals (``f`` style) when given; ``None`` (no finite bound) is ``"inf"``."""
    return _rounded(value, ROUND_CEILING, digits, places)


def lower(value: float | None, digits: int = 3, *, places: int | None = None) -> str:
    """``value`` rounded down, as :func:`upper`; ``None`` is ``"-inf"``."""
    return _rounded(value, ROUND_FLOOR, digits, places)


def upper_and_lower(bound: float, measured: float) -> tuple[str, str]:
    """A claimed upper bound and a measured lower bound: rounded outwards (up and down); when
    the measurement exceeds the bound, both whole (``repr``), since rounded outwards they could
    read as the bound holding."""
    if measured > bound:
        return repr(bound), repr(measured)
    return upper(bound), lower(measured)


def _rounded(value: float | None, rounding: str, digits: int, places: int | None) -> str:
    if value is None:
        return "inf" if rounding == ROUND_CEILING else "-inf"
    value = float(value)
    if not math.isfinite(value):
        return format(value, "g")
    exact = Decimal(repr(value))  # reads back as ``value`` exactly
    if places is not None:
        context = Context(prec=max(28, exact.adjusted() + places + 2))
        return format(exact.quantize(Decimal(1).scaleb(-places), rounding, context), "f")
    if value == 0:
        return "0"
    rounded = Context(prec=digits, rounding=rounding).plus(exact)
    # at most ``digits`` significant figures: the float nearest ``rounded`` prints as it,
    # in the same style as format(value, ".3g"); subnormal floats may not, so they print the
    # decimal itself
    text = format(float(rounded), f".{digits}g")
    return text if Decimal(text) == rounded else format(rounded, "g")
