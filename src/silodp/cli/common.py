"""What every command prints the same way: errors, ε values, and against whom each holds."""

from __future__ import annotations

from typing import Any, NoReturn

import typer

__all__ = ["BUDGET_EXIT_CODE", "WHO", "differing", "fail", "fmt"]

#: the exit code of a run a privacy budget stopped
BUDGET_EXIT_CODE = 3

#: how each adversary is named in printed output
WHO = {
    "released": "the released model (outsiders)",
    "server": "the server",
    "silos": "the silos",
}


def fail(message: str, code: int = 2) -> NoReturn:
    """Prints ``error: message`` and exits with ``code`` (2: bad input)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=code)


def fmt(value: float | None) -> str:
    return "inf" if value is None else format(value, ".3g")


def differing(record: dict[str, Any]) -> list[tuple[str, str, float | None]]:
    """(adversary, unit, ε) wherever an adversary's ε differs from the headline ε."""
    headline = record.get("epsilon", {})
    out = []
    for who, values in record.get("epsilon_by_adversary", {}).items():
        for unit, value in values.items():
            if value != headline.get(unit):
                out.append((who, unit, value))
    return out
