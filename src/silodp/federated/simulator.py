"""The in-process simulator: samples silos, runs their local updates, aggregates, accounts.

Randomness: every (round, stream, silo) gets its own :class:`~silodp.privacy.randomness.Coins`
(:func:`round_coins`): silo sampling, the server's round set-up and each silo's update (batch
sampling and noise) draw from independent streams, so results do not depend on the order silos
are run in. With ``noise="secure"`` (the default) the coins come from the operating system's
CSPRNG: nothing privacy-relevant (which silos, records or subjects were sampled, the noise) can
be recomputed from the seed or the config. ``noise="seeded"`` derives them from the run seed
with ``numpy.random.SeedSequence``: bit-for-bit reproducible, for tests and experiments only —
anyone who knows the seed can subtract the noise, so its ε protects nobody who knows it.
Every silo update's DP events go to the accountant in the same round they were produced.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp._validation import check_choice, check_int
from silodp.accounting import FederatedAccountant
from silodp.algorithms import Algorithm, SiloData, SiloUpdate
from silodp.data import FederatedDataset, TestSplit
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import MODES, Coins

__all__ = ["RoundResult", "SimulationCallback", "Simulator", "round_coins", "silo_tensors"]

logger = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """What one round produced: utility, privacy spent so far, diagnostics."""

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

    def to_json(self) -> dict[str, object]:
        def finite(v: float | None) -> float | None:
            return v if v is not None and math.isfinite(v) else None

        return {
            "round": self.round,
            "test_accuracy": self.test_accuracy,
            "test_loss": finite(self.test_loss),
            "epsilon": {k: finite(v) for k, v in self.epsilon.items()},
            "epsilon_route": self.epsilon_route,
            "mu": self.mu,
            "wall_time_s": self.wall_time_s,
            "silos": self.silos,
            "largest_group_per_batch": self.largest_group_per_batch,
            "subjects_per_batch": self.subjects_per_batch,
        }


#: Called with each round's result as soon as the round ends (progress, checkpoints, logs).
SimulationCallback = Callable[[RoundResult], None]


def silo_tensors(train: FederatedDataset) -> list[SiloData]:
    """Each silo's records as tensors."""
    out = []
    for s in range(train.num_silos):
        idx = train.silo_indices(s)
        out.append(
            SiloData(
                silo=s,
                x=torch.from_numpy(np.ascontiguousarray(train.x[idx])),
                y=torch.from_numpy(train.y[idx]),
                subject=torch.from_numpy(train.subject[idx]),
            )
        )
    return out


def evaluate(
    model: nn.Module, params: Params, test: TestSplit, *, batch_size: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``params`` on ``test``."""
    correct, loss_sum = 0, 0.0
    x_all, y_all = torch.from_numpy(test.x), torch.from_numpy(test.y)
    with torch.no_grad():
        for start in range(0, len(test), batch_size):
            x, y = x_all[start : start + batch_size], y_all[start : start + batch_size]
            logits = functional_call(model, params, (x,))
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    return correct / len(test), loss_sum / len(test)


#: Independent random streams of one round.
SILO_STREAM, SAMPLING_STREAM, SERVER_STREAM = 0, 1, 2


def round_coins(noise: str, seed: int, round_index: int, stream: int, silo: int = 0) -> Coins:
    """The coins of one stream (a silo's update, silo sampling, the server's round set-up) of
    one round: fresh CSPRNG coins (``noise="secure"``, which ignores the rest) or a stream
    keyed by (seed, round, stream, silo) (``"seeded"``)."""
    return Coins.for_mode(noise, seed, round_index, stream, silo)


class Simulator:
    """Runs an algorithm over silos in one process.

    Args:
      algorithm: the local update and aggregation to run.
      model: the module whose parameters are trained (used functionally).
      train: the federated training records.
      test: held-out records for evaluation.
      accountant: receives every silo's DP events each round (None for non-private runs).
      silos_per_round: silos sampled uniformly without replacement each round.
      seed: run seed (of the data set-up; of the coins only with ``noise="seeded"``).
      noise: where the coins come from: ``secure`` (OS CSPRNG; nothing privacy-relevant can be
        recomputed) or ``seeded`` (from ``seed``; reproducible, for tests and experiments).
    """

    def __init__(
        self,
        *,
        algorithm: Algorithm,
        model: nn.Module,
        train: FederatedDataset,
        test: TestSplit,
        accountant: FederatedAccountant | None,
        silos_per_round: int,
        seed: int,
        eval_every: int = 1,
        noise: str = "secure",
    ) -> None:
        self.noise = check_choice("noise", noise, MODES)
        self.algorithm = algorithm
        self.model = model
        self.silos = silo_tensors(train)
        self.test = test
        self.accountant = accountant
        self.silos_per_round = check_int("silos_per_round", silos_per_round, 1, len(self.silos))
        self.seed = check_int("seed", seed, 0)
        self.eval_every = eval_every
        self.params: Params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def coins(self, round_index: int, stream: int, silo: int = 0) -> Coins:
        """The coins of ``stream`` (and ``silo``) in round ``round_index``."""
        return round_coins(self.noise, self.seed, round_index, stream, silo)

    def sample_silos(self, round_index: int) -> list[int]:
        """``silos_per_round`` silos uniformly without replacement (every silo if that is all)."""
        if self.silos_per_round == len(self.silos):
            return list(range(len(self.silos)))
        coins = self.coins(round_index, SAMPLING_STREAM)
        perm = coins.permutation(len(self.silos))[: self.silos_per_round]
        return sorted(int(s) for s in perm)

    def run_round(self, round_index: int, *, evaluate_now: bool = True) -> RoundResult:
        """One round: local updates of the sampled silos, accounting, aggregation, evaluation."""
        start = time.perf_counter()
        chosen = self.sample_silos(round_index)
        instructions = self.algorithm.configure_round(
            round_index, self.coins(round_index, SERVER_STREAM)
        )
        updates: list[SiloUpdate] = []
        for s in chosen:
            coins = self.coins(round_index, SILO_STREAM, s)
            updates.append(
                self.algorithm.local_update(
                    self.model, self.params, self.silos[s], coins, instructions
                )
            )
        privacy = [u.privacy for u in updates if u.privacy is not None]
        epsilon: dict[str, float] = {}
        routes: dict[str, str] = {}
        mu: dict[str, float] = {}
        if self.accountant is not None and privacy:
            self.accountant.compose_round(privacy)
            for unit, est in self.accountant.estimates().items():
                epsilon[unit], routes[unit] = est.epsilon, est.route
            mu = self.accountant.mu()
        self.params = self.algorithm.aggregate(self.params, updates)
        accuracy = loss = None
        if evaluate_now:
            accuracy, loss = evaluate(self.model, self.params, self.test)
        return RoundResult(
            round=round_index,
            test_accuracy=accuracy,
            test_loss=loss,
            epsilon=epsilon,
            epsilon_route=routes,
            mu=mu,
            wall_time_s=time.perf_counter() - start,
            silos=chosen,
            largest_group_per_batch=[g for u in updates for g in u.group_sizes],
            subjects_per_batch=[d for u in updates for d in u.subjects_per_batch],
        )

    def run(self, rounds: int, callbacks: Sequence[SimulationCallback] = ()) -> list[RoundResult]:
        results = []
        for r in range(1, check_int("rounds", rounds, 1) + 1):
            result = self.run_round(r, evaluate_now=r % self.eval_every == 0 or r == rounds)
            for cb in callbacks:
                cb(result)
            results.append(result)
        return results
