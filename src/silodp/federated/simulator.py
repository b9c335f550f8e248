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

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from silodp import faults
from silodp._validation import check_choice, check_int
from silodp.accounting.interface import Accountant, spent
from silodp.algorithms import Algorithm, SiloData, SiloUpdate
from silodp.data import FederatedDataset, TestSplit
from silodp.evaluation import evaluate
from silodp.federated.engine import RoundCallback, RoundResult, StopRule
from silodp.ledger import RunLedger
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import MODES, Coins

__all__ = [
    "RoundResult",
    "SimulationCallback",
    "Simulator",
    "evaluate",
    "round_coins",
    "run_coins",
    "silo_tensors",
]

#: Called with each round's result as soon as the round ends.
SimulationCallback = RoundCallback

logger = logging.getLogger(__name__)


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


#: Independent random streams of one round.
SILO_STREAM, SAMPLING_STREAM, SERVER_STREAM = 0, 1, 2
#: Run-wide streams: the set-up's randomness (e.g. the secret the silos share) and the DP
#: feature statistics'; keyed as "round 0" (rounds count from 1) with streams no round uses
SETUP_STREAM, SCALING_STREAM = 3, 4


def coin_seed(seed: int, identity: str) -> int:
    """The seed of one run's seeded coins: the run seed keyed by ``identity`` (what the run
    computes: its resolved settings). Runs of different settings on one seed then draw
    independent coins; with the same coins, two released models of different settings
    (another clip, σ or algorithm) would subtract each other's noise away, and a ledger
    composing them as independent releases would read far below what they reveal together.
    A 63-bit integer (as an int64 carries it to a silo) whose bit 62 is set: every coin seed
    is two 32-bit words long, so no key is a prefix of another."""
    seed = check_int("seed", seed, 0)
    digest = hashlib.sha256(f"silodp-coins\0{seed}\0{identity}".encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) | (1 << 62)


def round_coins(noise: str, seed: int, round_index: int, stream: int, silo: int = 0) -> Coins:
    """The coins of one stream (a silo's update, silo sampling, the server's round set-up) of
    one round: fresh CSPRNG coins (``noise="secure"``, which ignores the rest) or a stream
    keyed by (seed, round, stream, silo) (``"seeded"``)."""
    return Coins.for_mode(noise, seed, round_index, stream, silo)


def run_coins(noise: str, seed: int, stream: int) -> Coins:
    """The coins of a run-wide stream (:data:`SETUP_STREAM`, :data:`SCALING_STREAM`): fresh
    CSPRNG coins, or the seeded stream keyed (seed, 0, stream, 0). Every key has the same
    length (numpy pads a short key with zeros, so ``(seed, 3)`` would be round 3's silo 0
    stream) and no round is numbered 0, so no round's stream repeats these."""
    return Coins.for_mode(noise, seed, 0, stream, 0)


class Simulator:
    """The in-process engine: runs an algorithm over silos in one process.

    One round: the algorithm samples the silos (:meth:`Algorithm.sample_silos`), configures the
    round, each sampled silo runs its local update from its own state, the accountant composes
    the round's events (:meth:`Algorithm.accounted_events`), the server aggregates (updating
    the silos' states where the algorithm keeps any, e.g. PriFedSync's personalised models)
    and the model is evaluated (:meth:`Algorithm.evaluate`).

    Args:
      algorithm: the local update and aggregation to run.
      model: the module whose parameters are trained (used functionally).
      train: the federated training records.
      test: held-out records for evaluation.
      accountant: receives every round's DP events (None for non-private runs).
      silos_per_round: silos taking part per round (the algorithm may sample its own way).
      seed: run seed (of the data set-up; of the coins only with ``noise="seeded"``).
      eval_every: evaluate every this many rounds (and after the last).
      noise: where the coins come from: ``secure`` (OS CSPRNG; nothing privacy-relevant can be
        recomputed) or ``seeded`` (from ``seed``; reproducible, for tests and experiments).
      ledger: where every mechanism execution is recorded before its output is handed on, and
        whose budget each round must fit (``None``: nothing is recorded).
    """

    def __init__(
        self,
        *,
        algorithm: Algorithm,
        model: nn.Module,
        train: FederatedDataset,
        test: TestSplit,
        accountant: Accountant | None,
        silos_per_round: int | None = None,
        seed: int,
        eval_every: int = 1,
        noise: str = "secure",
        ledger: RunLedger | None = None,
    ) -> None:
        self.noise = check_choice("noise", noise, MODES)
        self.ledger = ledger
        self.algorithm = algorithm
        self.model = model
        self.silos = silo_tensors(train)
        self.test = test
        self.accountant = accountant
        self.silos_per_round = check_int(
            "silos_per_round", silos_per_round or len(self.silos), 1, len(self.silos)
        )
        self.seed = check_int("seed", seed, 0)
        self.eval_every = check_int("eval_every", eval_every, 1)
        self.params: Params = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.states = [algorithm.initial_state(self.params) for _ in self.silos]
        #: every silo's events of one round (from its public size)
        self.planned = [
            p for p in (algorithm.silo_privacy_for(silo) for silo in self.silos) if p is not None
        ]

    def coins(self, round_index: int, stream: int, silo: int = 0) -> Coins:
        """The coins of ``stream`` (and ``silo``) in round ``round_index``."""
        return round_coins(self.noise, self.seed, round_index, stream, silo)

    def sample_silos(self, round_index: int) -> list[int]:
        """This round's silos, drawn by the algorithm from the round's sampling coins."""
        coins = self.coins(round_index, SAMPLING_STREAM)
        return self.algorithm.sample_silos(len(self.silos), self.silos_per_round, coins)

    def _account(
        self, round_index: int, updates: list[SiloUpdate]
    ) -> tuple[dict, dict, dict, dict | None, dict | None]:
        privacy = self.algorithm.accounted_events(updates, self.planned)
        if self.ledger is not None:  # what the ledger holds is what is composed
            privacy = self.ledger.round_events(round_index)
        if self.accountant is None or not privacy:
            return {}, {}, {}, None, None
        self.accountant.compose_round(privacy)
        now = spent(self.accountant)
        epsilon = {unit: est.epsilon for unit, est in now.epsilon.items()}
        if self.ledger is not None:
            self.ledger.complete_round(round_index, privacy, epsilon)
            faults.reached("round_completed", round_index)
        return (
            epsilon,
            {unit: est.route for unit, est in now.epsilon.items()},
            now.mu,
            now.estimates or None,
            now.mu_estimates or None,
        )

    def _record_planned(self, round_index: int) -> bool:
        """Records the events of an algorithm accounted from its plan (whoever takes part)
        before the round runs; whether it is one."""
        planned = self.algorithm.accounted_events([], self.planned)
        if self.ledger is not None and planned:
            self.ledger.record_planned(round_index, planned)
            faults.reached("silo_recorded", round_index)
        return bool(planned)

    def record_update(self, round_index: int, update: SiloUpdate) -> None:
        """Records a silo's events in the ledger before its message reaches the server."""
        if self.ledger is not None and update.privacy is not None:
            self.ledger.record(round_index, f"silo:{update.silo}", update.privacy)
            faults.reached("silo_recorded", round_index)

    def silo_updates(
        self, round_index: int, chosen: list[int], instructions: Any, *, record: bool
    ) -> list[SiloUpdate]:
        """Runs the chosen silos' local updates (here: in this process, one after another);
        ``record``: each silo's events go to the ledger as its update ends. Another engine
        overrides this to run them where the silos are; the updates it returns are the silos
        that took part."""
        updates: list[SiloUpdate] = []
        for s in chosen:
            coins = self.coins(round_index, SILO_STREAM, s)
            update = self.algorithm.local_update(
                self.model, self.params, self.silos[s], coins, instructions, self.states[s]
            )
            if record:
                self.record_update(round_index, update)
            updates.append(update)
        return updates

    def to_aggregate(self, updates: list[SiloUpdate]) -> list[SiloUpdate]:
        """What the server's aggregation sees of the silos' updates (here: every one)."""
        return updates

    def run_round(self, round_index: int, *, evaluate_now: bool = True) -> RoundResult:
        """One round: local updates of the sampled silos, accounting, aggregation, evaluation."""
        start = time.perf_counter()
        if self.ledger is not None:  # refuses a round the budget does not allow
            self.ledger.check_round(self.planned, participants=self.silos_per_round)
        from_plan = self._record_planned(round_index)
        chosen = self.sample_silos(round_index)
        instructions = self.algorithm.configure_round(
            round_index, self.coins(round_index, SERVER_STREAM)
        )
        updates = self.silo_updates(round_index, chosen, instructions, record=not from_plan)
        chosen = [u.silo for u in updates]
        epsilon, routes, mu, estimates, mu_estimates = self._account(round_index, updates)
        self.params = self.algorithm.aggregate(self.params, self.to_aggregate(updates), self.states)
        metrics: dict[str, float | None] = {}
        if evaluate_now:
            metrics = dict(self.algorithm.evaluate(self.model, self.params, self.states, self.test))
        accuracy, loss = metrics.pop("test_accuracy", None), metrics.pop("test_loss", None)
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
            metrics=metrics,
            estimates=estimates,
            mu_estimates=mu_estimates,
        )

    def run(
        self,
        rounds: int,
        callbacks: Sequence[RoundCallback] = (),
        *,
        stop: StopRule | None = None,
        start: int = 1,
    ) -> list[RoundResult]:
        """Runs rounds ``start..rounds``; ``stop(result)`` returning true ends the run early."""
        results: list[RoundResult] = []
        rounds = check_int("rounds", rounds, 1)
        for r in range(check_int("start", start, 1), rounds + 1):
            result = self.run_round(r, evaluate_now=r % self.eval_every == 0 or r == rounds)
            for cb in callbacks:
                cb(result)
            results.append(result)
            if stop is not None and stop(result):
                break
        return results

    def charge_rounds(self, first: int, last: int) -> None:
        """Composes rounds ``first..last`` of the plan, every silo taking part, into the
        accountant and records them in the ledger, without running them: a run that stopped
        at a round read from its own results (an accuracy target) is charged its whole plan,
        since where it stopped depends on the data. Rounds the ledger already holds events of
        (charged before a stop, then resumed) are in the accountant and are not charged
        again."""
        if self.accountant is None or not self.planned:
            return
        events = list(self.planned)
        participants = self.silos_per_round
        done = self.ledger.recorded_rounds() if self.ledger is not None else set()
        for r in range(check_int("first", first, 1), last + 1):
            if r in done:
                continue
            if self.ledger is not None:
                self.ledger.check_round(events, participants=participants)
                self.ledger.record_planned(r, events)
            self.accountant.compose_round(events, participants=participants)
            if self.ledger is not None:
                epsilon = {u: e.epsilon for u, e in self.accountant.estimates().items()}
                self.ledger.complete_round(r, events, epsilon, participants=participants)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the global model and every silo's state (the coins of a
        round are a function of the seed and the round, so nothing else is needed)."""
        return {"params": self.params, "states": self.states}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from :meth:`state` of an earlier run of the same config."""
        self.params = state["params"]
        self.states = list(state["states"])

    @property
    def personal_params(self) -> list[Params]:
        """Every silo's personalised model, for algorithms that keep one."""
        return [s.personal for s in self.states]
