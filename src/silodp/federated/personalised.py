"""The in-process personalised-FL engine (PriFedSync): Poisson client sampling, per-client
state, a global and a personalised model per client, f-DP accounting per round.

Randomness follows :mod:`silodp.federated.simulator`: each round's client sample and each
(round, client) update draw from their own :class:`~silodp.privacy.randomness.Coins`. With
``noise="secure"`` (the default) they come from the OS CSPRNG, so neither the client sample nor
a client's batches and noise can be recomputed from the seed; ``noise="seeded"`` derives them
from the seed, reproducibly, for tests and experiments only. The privacy
of round ``r`` is the accountant's report for ``r`` rounds (:func:`silodp.accounting.fdp.
account_prifedsync` with ``per_round=True``), whatever the sample was: an empty round changes no
model and still counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from silodp._validation import check_choice, check_int
from silodp.accounting.fdp import FdpReport
from silodp.algorithms.base import SiloUpdate
from silodp.algorithms.prifedsync import ClientState, PriFedSync
from silodp.data import FederatedDataset, TestSplit
from silodp.federated.simulator import (
    SAMPLING_STREAM,
    SILO_STREAM,
    RoundResult,
    SimulationCallback,
    evaluate,
    round_coins,
    silo_tensors,
)
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import MODES

__all__ = ["PersonalisedRoundResult", "PersonalisedSimulator", "client_tests"]


@dataclass
class PersonalisedRoundResult(RoundResult):
    """A round of personalised FL: ``test_accuracy``/``test_loss`` are the global model's mean
    over clients' own test splits; ``personalised_accuracy`` the mean of each client's
    personalised model on its own split; ``estimates`` the accountant's labelled CLT-derived
    ε (not guarantees)."""

    global_accuracy: float | None = None
    personalised_accuracy: float | None = None
    estimates: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out = super().to_json()
        out["mu"] = _finite(self.mu)
        out["global_accuracy"] = self.global_accuracy
        out["personalised_accuracy"] = self.personalised_accuracy
        out["epsilon_estimates"] = _finite(self.estimates)
        return out


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    """``values`` with non-finite numbers as ``None`` (JSON has no infinity)."""
    return {k: v if math.isfinite(v) else None for k, v in values.items()}


def client_tests(test: TestSplit, num_clients: int) -> list[TestSplit]:
    """Each client's own test split (the shared split for every client when it has none)."""
    out = []
    for s in range(num_clients):
        idx = test.silo_indices(s)
        if len(idx) == 0:
            raise ValueError(f"Expected test records for client {s}, got none.")
        out.append(TestSplit(x=test.x[idx], y=test.y[idx]))
    return out


class PersonalisedSimulator:
    """Runs PriFedSync rounds in process.

    Args:
      algorithm: the :class:`PriFedSync` instance (its config carries p, K, B, C, σ, η, α).
      model: the network whose parameters are trained (used functionally).
      train: the clients' training records (one silo per client).
      test: test records; with ``test.silo`` set, each client is evaluated on its own.
      reports: the accountant's per-round reports (``reports[r-1]`` covers rounds ``1..r``);
        ``None`` for a run without accounting.
      seed: run seed (of the coins only with ``noise="seeded"``).
      eval_every: evaluate every this many rounds (and after the last).
      noise: ``secure`` (OS CSPRNG coins) or ``seeded`` (from ``seed``; reproducible).
    """

    def __init__(
        self,
        *,
        algorithm: PriFedSync,
        model: nn.Module,
        train: FederatedDataset,
        test: TestSplit,
        reports: Sequence[FdpReport] | None,
        seed: int = 0,
        eval_every: int = 1,
        noise: str = "secure",
    ) -> None:
        self.noise = check_choice("noise", noise, MODES)
        self.algorithm = algorithm
        self.model = model
        self.clients = silo_tensors(train)
        algorithm.check_clients(len(self.clients))
        self.tests = client_tests(test, len(self.clients))
        self.reports = list(reports) if reports is not None else None
        self.seed = check_int("seed", seed, 0)
        self.eval_every = check_int("eval_every", eval_every, 1)
        self.params: Params = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.states: list[ClientState] = [
            algorithm.initial_state(self.params) for _ in self.clients
        ]

    def sample_clients(self, round_index: int) -> list[int]:
        coins = round_coins(self.noise, self.seed, round_index, SAMPLING_STREAM)
        return self.algorithm.sample_clients(len(self.clients), coins)

    def evaluate(self) -> tuple[float, float, float]:
        """(global accuracy, global loss, personalised accuracy), each a mean over clients of
        the result on the client's own test split."""
        glob = [evaluate(self.model, self.params, t) for t in self.tests]
        personal = [
            evaluate(self.model, s.personal, t)[0]
            for s, t in zip(self.states, self.tests, strict=True)
        ]
        return (
            float(np.mean([a for a, _ in glob])),
            float(np.mean([loss for _, loss in glob])),
            float(np.mean(personal)),
        )

    def run_round(self, round_index: int, *, evaluate_now: bool = True) -> PersonalisedRoundResult:
        """One synchronisation round: sample, train the sampled clients, aggregate, account."""
        start = time.perf_counter()
        chosen = self.sample_clients(round_index)
        updates: list[SiloUpdate] = []
        for j in chosen:
            coins = round_coins(self.noise, self.seed, round_index, SILO_STREAM, j)
            updates.append(
                self.algorithm.local_train(self.model, self.clients[j], self.states[j], coins)
            )
        self.params = self.algorithm.sync(self.params, updates, self.states)
        epsilon: dict[str, float] = {}
        routes: dict[str, str] = {}
        mu: dict[str, float] = {}
        estimates: dict[str, float] = {}
        if self.reports is not None:
            if round_index > len(self.reports):
                raise ValueError(
                    f"Round {round_index} is beyond the {len(self.reports)} accounted rounds."
                )
            report = self.reports[round_index - 1]
            if report.round != round_index:
                raise ValueError(
                    f"Expected the accountant's report for round {round_index}, got round "
                    f"{report.round}."
                )
            epsilon, routes = dict(report.epsilon), dict(report.epsilon_route)
            mu, estimates = dict(report.mu), dict(report.estimates)
        acc = loss = personal = None
        if evaluate_now:
            acc, loss, personal = self.evaluate()
        return PersonalisedRoundResult(
            round=round_index,
            test_accuracy=acc,
            test_loss=loss,
            epsilon=epsilon,
            epsilon_route=routes,
            mu=mu,
            wall_time_s=time.perf_counter() - start,
            silos=chosen,
            largest_group_per_batch=[g for u in updates for g in u.group_sizes],
            subjects_per_batch=[d for u in updates for d in u.subjects_per_batch],
            global_accuracy=acc,
            personalised_accuracy=personal,
            estimates=estimates,
        )

    def run(
        self,
        rounds: int,
        callbacks: Sequence[SimulationCallback] = (),
        *,
        stop: Callable[[PersonalisedRoundResult], bool] | None = None,
    ) -> list[PersonalisedRoundResult]:
        """Runs up to ``rounds`` rounds; ``stop(result)`` returning true ends the run early."""
        results = []
        rounds = check_int("rounds", rounds, 1)
        for r in range(1, rounds + 1):
            result = self.run_round(r, evaluate_now=r % self.eval_every == 0 or r == rounds)
            for cb in callbacks:
                cb(result)
            results.append(result)
            if stop is not None and stop(result):
                break
        return results

    @property
    def personal_params(self) -> list[Params]:
        """Every client's personalised model."""
        return [s.personal for s in self.states]
