"""The seam between an experiment and whatever runs its rounds.

An :class:`Engine` runs rounds of one algorithm and reports each as a :class:`RoundResult` to
callbacks as soon as the round ends: the experiment records results, progress and (through a
callback) every round's privacy spending, whichever engine ran it. The in-process
:class:`~silodp.federated.simulator.Simulator` is one engine; a deployment on a real federation
is another module implementing the same two members.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from silodp.privacy.gradients import Params

__all__ = ["Engine", "RoundCallback", "RoundResult", "StopRule"]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass
class RoundResult:
    """What one round produced: utility, privacy spent so far, diagnostics.

    ``metrics`` holds an algorithm's further evaluation results (e.g. PriFedSync's
    ``global_accuracy`` and ``personalised_accuracy``); ``estimates`` the accountant's
    labelled non-rigorous ε (never guarantees).
    """

    round: int
    test_accuracy: float | None
    test_loss: float | None
    epsilon: dict[str, float]
    epsilon_route: dict[str, str]
    mu: dict[str, float]
    wall_time_s: float
    silos: list[int]
    largest_group_per_batch: list[int] = field(default_factory=list)
    subjects_per_batch: list[int] = field(default_factory=list)
    metrics: dict[str, float | None] = field(default_factory=dict)
    estimates: dict[str, float] | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "round": self.round,
            "test_accuracy": self.test_accuracy,
            "test_loss": _finite(self.test_loss),
            "epsilon": {k: _finite(v) for k, v in self.epsilon.items()},
            "epsilon_route": self.epsilon_route,
            "mu": {k: _finite(v) for k, v in self.mu.items()},
            "wall_time_s": self.wall_time_s,
            "silos": self.silos,
            "largest_group_per_batch": self.largest_group_per_batch,
            "subjects_per_batch": self.subjects_per_batch,
        }
        out.update(self.metrics)
        if self.estimates is not None:
            out["epsilon_estimates"] = {k: _finite(v) for k, v in self.estimates.items()}
        return out


#: Called with each round's result as soon as the round ends (records, progress, ledgers).
RoundCallback = Callable[[RoundResult], None]
#: ``stop(result)`` returning true ends a run after that round.
StopRule = Callable[[RoundResult], bool]


class Engine(Protocol):
    """Runs the rounds of one algorithm."""

    #: the global model's parameters after the rounds run so far
    params: Params

    def run(
        self,
        rounds: int,
        callbacks: Sequence[RoundCallback] = (),
        *,
        stop: StopRule | None = None,
    ) -> list[RoundResult]:
        """Runs up to ``rounds`` rounds, calling every callback after each."""
        ...
