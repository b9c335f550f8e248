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
from typing import Any, Protocol

from silodp.accounting.interface import Spent
from silodp.io import json_number
from silodp.privacy.gradients import Params

__all__ = ["Engine", "RoundCallback", "RoundResult", "StopRule", "spent_fields"]


def spent_fields(spent: Spent) -> dict[str, Any]:
    """``spent`` as a summary holds it: ``epsilon`` and ``epsilon_route`` against the
    accountant's target, ``epsilon_by_adversary``, ``mu`` and, where there are any, the
    labelled ``epsilon_estimates`` and ``mu_estimates``."""
    out: dict[str, Any] = {
        "epsilon": {u: json_number(e.epsilon) for u, e in spent.epsilon.items()},
        "epsilon_route": {u: e.route for u, e in spent.epsilon.items()},
        "epsilon_by_adversary": {
            adversary: {u: json_number(e.epsilon) for u, e in by.items()}
            for adversary, by in spent.by_adversary.items()
        },
        "mu": {u: json_number(m) for u, m in spent.mu.items()},
    }
    if spent.estimates:
        out["epsilon_estimates"] = {k: json_number(v) for k, v in spent.estimates.items()}
    if spent.mu_estimates:
        out["mu_estimates"] = {k: json_number(v) for k, v in spent.mu_estimates.items()}
    return out


@dataclass
class RoundResult:
    """What one round produced: utility, privacy spent so far, diagnostics.

    ``metrics`` holds an algorithm's further evaluation results (e.g. PriFedSync's
    ``global_accuracy`` and ``personalised_accuracy``); ``estimates`` and ``mu_estimates``
    the accountant's labelled non-rigorous ε and μ (never guarantees; ``mu`` is exact).
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
    mu_estimates: dict[str, float] | None = None

    @classmethod
    def from_json(cls, row: dict[str, Any], private: dict[str, Any] | None = None) -> RoundResult:
        """The result a written row (and its silo-private row) records (``None`` ε is ∞)."""
        private = private or {}
        metric_keys = ("global_accuracy", "personalised_accuracy")

        def numbers(values: dict[str, Any]) -> dict[str, float]:
            return {k: math.inf if v is None else v for k, v in values.items()}

        estimates = row.get("epsilon_estimates")
        mu_estimates = row.get("mu_estimates")
        return cls(
            round=row["round"],
            test_accuracy=row.get("test_accuracy"),
            test_loss=row.get("test_loss"),
            epsilon=numbers(row.get("epsilon", {})),
            epsilon_route=dict(row.get("epsilon_route", {})),
            mu=numbers(row.get("mu", {})),
            wall_time_s=private.get("wall_time_s", 0.0),
            silos=list(row.get("silos", [])),
            largest_group_per_batch=list(private.get("largest_group_per_batch", [])),
            subjects_per_batch=list(private.get("subjects_per_batch", [])),
            metrics={k: row[k] for k in metric_keys if k in row},
            estimates=None if estimates is None else numbers(estimates),
            mu_estimates=None if mu_estimates is None else numbers(mu_estimates),
        )

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "round": self.round,
            "test_accuracy": self.test_accuracy,
            "test_loss": json_number(self.test_loss),
            "epsilon": {k: json_number(v) for k, v in self.epsilon.items()},
            "epsilon_route": self.epsilon_route,
            "mu": {k: json_number(v) for k, v in self.mu.items()},
            "wall_time_s": self.wall_time_s,
            "silos": self.silos,
            "largest_group_per_batch": self.largest_group_per_batch,
            "subjects_per_batch": self.subjects_per_batch,
        }
        out.update(self.metrics)
        if self.estimates is not None:
            out["epsilon_estimates"] = {k: json_number(v) for k, v in self.estimates.items()}
        if self.mu_estimates is not None:
            out["mu_estimates"] = {k: json_number(v) for k, v in self.mu_estimates.items()}
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
        start: int = 1,
    ) -> list[RoundResult]:
        """Runs rounds ``start..rounds``, calling every callback after each."""
        ...

    def charge_rounds(self, first: int, last: int) -> None:
        """Accounts (and records in the ledger) rounds ``first..last`` of the plan without
        running them: a run stopped at a round chosen from its own results pays its plan."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep to continue after the rounds run so far."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from an earlier :meth:`state`."""
        ...
