"""PriFedSync (Zheng et al., "Federated f-differential privacy"): private personalised FedAvg.

One synchronisation round (the paper's Algorithm 1, with Algorithm 2 as local training):

1. The server Poisson-samples clients, each independently with probability ``p``
   (:meth:`PriFedSync.sample_clients`). A round in which no client is sampled is a no-op
   round: the global model does not change, and the round still counts in the accounting
   (silodp never re-draws the sample; the accountant composes exactly ``R`` rounds of
   Poisson client sampling).
2. Each sampled client ``j`` starts from its helper model ``h_j`` and runs ``K`` NoisySGD
   iterations (:meth:`PriFedSync.local_train`): a batch of exactly ``B_j = min(B, n_j)``
   distinct records drawn uniformly without replacement (:func:`~silodp.algorithms.base.
   uniform_batch`), each per-example gradient clipped to ``C``, summed, plus
   ``N(0, 4C²σ²I)`` (std ``2Cσ``: one record *replaced* moves the sum by at most ``2C``; the
   exact Gaussian mechanism of :mod:`silodp.privacy.noise` at sensitivity ``2C``), divided
   by ``B_j`` (public). ``sgd``, ``momentum`` and ``adam`` apply that noisy gradient; momentum
   and Adam's moments are functions of noisy gradients only, i.e. post-processing.
3. The server sets ``w_g ← (1-η) w_g + η·mean_{j∈Ω}(w̃_j)`` and each sampled client's helper to
   ``h_j = F_j(w_g)``: ``identity`` (``h_j = w_g``, FedAvg) or ``interpolate``
   (``h_j = (1-α_j) w̃_j + α_j w_g``).

Guarantee (record level, replacement adjacency inside one client's dataset): each client's
``K`` steps per round are the mechanism ``C_{B_j/n_j}(G_{1/σ})^{⊗K}``; composed over rounds
and client sampling this gives the weak/strong federated f-DP of the paper's Theorems 1–2,
computed by :mod:`silodp.accounting.fdp` (only the accountant reports μ and ε). Batch
selection here and in the accountant is the same: ``batch_sampling = "uniform"``. Noise is added
locally, so the guarantee holds against the server and the other clients.

Choices made explicit (the paper's public code differs on each): silodp accounts the privacy
it spends; batches are fixed-size uniform (as that code, and as accounted); an empty client
sample is kept as a no-op round (that code re-draws until non-empty, which the accounting
does not cover); the server pushes ``h_j = F_j(w_g)`` to the sampled clients (that code never
sends the global model); with ``interpolate``, a client only ever receives its helper.
Per-client state (personalised model, optimiser moments) lives in :class:`ClientState`, so
any engine — the in-process one or a real federation — runs the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from silodp._validation import check_choice, check_in_range
from silodp.accounting import SiloPrivacy
from silodp.accounting.fdp import accountant_for, step_events
from silodp.accounting.interface import Accountant
from silodp.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    SiloData,
    SiloUpdate,
    average_params,
    batch_diagnostics,
    hyperparameter,
    uniform_batch,
)
from silodp.algorithms.dp_sgd import noisy_sum
from silodp.algorithms.registry import register
from silodp.data import TestSplit
from silodp.errors import InvalidValueError
from silodp.evaluation import client_tests, evaluate
from silodp.privacy.ghost import clipper_for
from silodp.privacy.gradients import (
    Params,
    clip_factors,
    clipped_weighted_sum,
    per_example_gradients,
    per_example_norms,
)
from silodp.privacy.randomness import Coins

__all__ = ["BATCH_SAMPLING", "ClientState", "PriFedSync", "PriFedSyncConfig", "noisy_gradient"]

#: How local batches are drawn; the accountant must be given the same value.
BATCH_SAMPLING = "uniform"
_ADAM_BETA2, _ADAM_EPS = 0.999, 1e-8
#: One record replaced moves the clipped sum by at most 2C.
REPLACEMENT_SENSITIVITY = 2.0


@dataclass(frozen=True, kw_only=True)
class PriFedSyncConfig(AlgorithmConfig):
    """PriFedSync's hyperparameters.

    Attributes:
      client_rate: p, the Poisson client-sampling rate per round.
      optimizer: local optimizer applied to the noisy gradient: ``sgd``, ``momentum`` or
        ``adam``.
      momentum: momentum (and Adam's β1) of the local optimizer.
      helper: helper model ``identity`` (FedAvg) or ``interpolate``.
      alpha: interpolation weight α_i of the helper model, one for all clients or one per
        client.
    """

    client_rate: float = hyperparameter(
        1.0, "training", "prifedsync: Poisson sampling rate p of clients per round.", account=True
    )
    optimizer: str = hyperparameter("sgd", "training", "Local optimizer: sgd, momentum or adam.")
    momentum: float = hyperparameter(0.9, "training", "Momentum (Adam's beta1).")
    helper: str = hyperparameter("identity", "training", "Helper model: identity or interpolate.")
    alpha: float | tuple[float, ...] = hyperparameter(0.5, "training", "Interpolation weight.")
    batch_sampling: str = hyperparameter(
        BATCH_SAMPLING,
        None,
        "prifedsync: uniform (fixed-size batches, as trained) or poisson (accounting only).",
        account=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_in_range(self.key("client_rate"), self.client_rate, 0.0, 1.0, lo_open=True)
        check_choice(self.key("optimizer"), self.optimizer, ("sgd", "momentum", "adam"))
        check_in_range(self.key("momentum"), self.momentum, 0.0, 1.0, hi_open=True)
        check_choice(self.key("helper"), self.helper, ("identity", "interpolate"))
        for a in self.alpha if isinstance(self.alpha, tuple) else (self.alpha,):
            check_in_range(self.key("alpha"), a, 0.0, 1.0)
        check_choice("batch_sampling", self.batch_sampling, ("uniform", "poisson"))


@dataclass
class ClientState:
    """What one client keeps between rounds.

    Attributes:
      personal: the client's personalised model: its helper ``h_j`` (what it trains from when
        next sampled); the initial model until its first synchronisation.
      local: its last locally trained model ``w̃_j`` (the initial model before any training).
      moments: optimiser state (momentum buffer, Adam moments) keyed by parameter name.
      steps: optimiser steps taken so far (Adam's bias correction).
      rounds: synchronisation rounds the client took part in.
    """

    personal: Params
    local: Params
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: int = 0
    rounds: int = 0


def noisy_gradient(
    model: nn.Module,
    params: Params,
    silo: SiloData,
    idx: torch.Tensor,
    *,
    config: AlgorithmConfig,
    coins: Coins,
) -> Params:
    """``(Σ_{i∈idx} clip_C(g_i) + N(0, 4C²σ²I)) / B`` with ``B = config.batch_size`` capped at
    the silo's size (public): the NoisySGD gradient of Algorithm 2 (noise multiplier σ at the
    replacement sensitivity ``2C``)."""
    x, y = silo.x[idx], silo.y[idx]
    if config.grad_method == "vmap" or not clipper_for(model).fast:
        grads = per_example_gradients(model, params, x, y)
        norms = per_example_norms(grads)
        summed = clipped_weighted_sum(grads, norms, clip_factors(norms, config.clip))
    else:
        _, summed = clipper_for(model).norms_and_sum(params, x, y, clip=config.clip)
    noisy = noisy_sum(
        summed,
        noise_multiplier=config.noise_multiplier,
        sensitivity=REPLACEMENT_SENSITIVITY * config.clip,
        coins=coins,
    )
    scale = float(min(config.batch_size, silo.num_records))
    return {name: noisy[name].to(value.dtype) / scale for name, value in params.items()}


@register
class PriFedSync(Algorithm):
    """Personalised FedAvg with local NoisySGD/NoisyAdam and Poisson client sampling."""

    name = "prifedsync"
    units = ("record",)
    calibration_unit = "record"
    threat_model = "local noise: holds against the server and other clients"
    batch_sampling = BATCH_SAMPLING
    adjacency = "replace-one"
    calibration_tolerance = 1e-3
    Config = PriFedSyncConfig
    config: PriFedSyncConfig

    # --- policy -------------------------------------------------------------------------
    def uses_span(self) -> bool:
        """No: the guarantee is per record inside one client."""
        return False

    def check_schedule(self, silos_per_round: int | None, num_silos: int) -> int:
        if silos_per_round is not None:
            raise InvalidValueError(
                f"Expected training.silos_per_round unset for prifedsync (clients are Poisson-"
                f"sampled at training.client_rate), got {silos_per_round}."
            )
        self.check_clients(num_silos)
        return num_silos

    def sample_silos(self, num_silos: int, silos_per_round: int, coins: Coins) -> list[int]:
        return self.sample_clients(num_silos, coins)

    def make_accountant(
        self,
        *,
        span: int,
        delta: float,
        target: str = "strongest",
        stage: str = "report",
        units: Sequence[str] | None = None,
    ) -> Accountant:
        """The f-DP accountant (client sampling at p; the same ε against every adversary)."""
        clients = self.config.num_silos or 1
        return accountant_for(clients, self.config.client_rate, delta)(stage, units or self.units)

    def accounted_events(
        self, updates: Sequence[SiloUpdate], planned: Sequence[SiloPrivacy]
    ) -> list[SiloPrivacy]:
        """Every client's events, whoever was sampled: the accountant's mixture at rate p
        accounts the (server-drawn) client sample, and an empty round still counts."""
        return list(planned)

    def account_options(self) -> dict[str, Any]:
        return {"client_rate": self.config.client_rate, "clients": self.config.num_silos}

    def summary_fields(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "client_rate": cfg.client_rate,
            "clients": cfg.num_silos,
            "batch_sampling": self.batch_sampling,
            "helper": cfg.helper,
            "optimizer": cfg.optimizer,
            "adjacency": self.adjacency,
        }

    # --- server side --------------------------------------------------------------------
    def sample_clients(self, num_clients: int, coins: Coins) -> list[int]:
        """Poisson client sampling: each client independently with probability exactly ``p``.
        May be empty (a no-op round); never re-drawn."""
        draws = coins.bernoulli(num_clients, self.config.client_rate)
        return [int(i) for i in torch.nonzero(draws).flatten()]

    def alpha_for(self, client: int) -> float:
        """Interpolation weight ``α_client`` of the helper model."""
        alpha = self.config.alpha
        if isinstance(alpha, tuple):
            if client >= len(alpha):
                raise ValueError(
                    f"Expected one alpha per client: got {len(alpha)} values, no value for "
                    f"client {client}."
                )
            return alpha[client]
        return alpha

    def check_clients(self, num_clients: int) -> None:
        """Refuses a per-client ``alpha`` list whose length is not the number of clients."""
        if isinstance(self.config.alpha, tuple) and len(self.config.alpha) != num_clients:
            raise ValueError(
                f"Expected training.alpha to hold one value per client ({num_clients}), got "
                f"{len(self.config.alpha)} values."
            )

    def helper(self, client: int, local: Params, global_params: Params) -> Params:
        """``h = F_client(w_g)``: ``w_g`` (identity) or ``(1-α) w̃ + α w_g`` (interpolate)."""
        if self.config.helper == "identity":
            return {k: v.clone() for k, v in global_params.items()}
        a = self.alpha_for(client)
        return {k: (1.0 - a) * local[k] + a * global_params[k] for k in global_params}

    def aggregate(
        self, params: Params, updates: Sequence[SiloUpdate], states: Sequence[Any] = ()
    ) -> Params:
        """``(1-η) w_g + η·mean(w̃_j)`` (an empty round returns ``w_g`` unchanged), and, given
        the clients' ``states``, each sampled client's new local and personalised (helper)
        models written into them."""
        new_global = average_params(params, updates, server_lr=self.config.server_lr)
        if not states:
            return new_global
        for update in updates:
            state = states[update.silo]
            state.local = update.params
            state.personal = self.helper(update.silo, update.params, new_global)
            state.rounds += 1
        return new_global

    # --- client side --------------------------------------------------------------------
    def initial_state(self, params: Params) -> ClientState:
        """A client's state before training: every model equal to the initial one."""
        return ClientState(
            personal={k: v.detach().clone() for k, v in params.items()},
            local={k: v.detach().clone() for k, v in params.items()},
        )

    def local_train(
        self,
        model: nn.Module,
        silo: SiloData,
        state: ClientState,
        coins: Coins,
    ) -> SiloUpdate:
        """``K`` private steps from the client's helper model; updates the optimiser state in
        ``state`` and returns ``w̃_j`` as the message to the server."""
        cfg = self.config
        if cfg.batch_sampling != BATCH_SAMPLING:
            raise InvalidValueError(
                f"Expected batch_sampling={BATCH_SAMPLING!r} to train prifedsync (fixed-size "
                f"batches); got {cfg.batch_sampling!r}, which only the accountant supports."
            )
        local = {k: v.clone() for k, v in state.personal.items()}
        groups, distinct = [], []
        for _ in range(cfg.local_steps):
            idx = uniform_batch(silo.num_records, cfg.batch_size, coins)
            grad = noisy_gradient(model, local, silo, idx, config=cfg, coins=coins)
            local = self._apply(local, grad, state)
            largest, subjects = batch_diagnostics(silo.subject[idx])
            groups.append(largest)
            distinct.append(subjects)
        return SiloUpdate(
            silo.silo, local, silo.num_records, self.silo_privacy_for(silo), groups, distinct
        )

    def _apply(self, params: Params, grad: Params, state: ClientState) -> Params:
        cfg = self.config
        state.steps += 1
        out: Params = {}
        for name, value in params.items():
            g = grad[name]
            if cfg.optimizer == "sgd":
                out[name] = value - cfg.lr * g
                continue
            m = state.moments.setdefault(name, {})
            if cfg.optimizer == "momentum":
                m["v"] = cfg.momentum * m.get("v", torch.zeros_like(g)) + g
                out[name] = value - cfg.lr * m["v"]
                continue
            m["m"] = cfg.momentum * m.get("m", torch.zeros_like(g)) + (1 - cfg.momentum) * g
            m["s"] = _ADAM_BETA2 * m.get("s", torch.zeros_like(g)) + (1 - _ADAM_BETA2) * g * g
            m_hat = m["m"] / (1 - cfg.momentum**state.steps)
            s_hat = m["s"] / (1 - _ADAM_BETA2**state.steps)
            out[name] = value - cfg.lr * m_hat / (s_hat.sqrt() + _ADAM_EPS)
        return out

    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        coins: Coins,
        instructions: Any = None,
        state: Any = None,
    ) -> SiloUpdate:
        """One client's round from its ``state`` (:meth:`local_train`); without a state, from
        ``params`` as its helper and a fresh optimiser."""
        return self.local_train(model, silo, state or self.initial_state(params), coins)

    def evaluate(
        self, model: nn.Module, params: Params, states: Sequence[Any], test: TestSplit
    ) -> dict[str, float]:
        """Means over clients, each on its own test split: the global model's accuracy and
        loss (``test_accuracy``/``global_accuracy``, ``test_loss``) and the personalised
        models' accuracy (``personalised_accuracy``)."""
        tests = client_tests(test, len(states))
        glob = [evaluate(model, params, t) for t in tests]
        personal = [evaluate(model, s.personal, t)[0] for s, t in zip(states, tests, strict=True)]
        accuracy = float(np.mean([a for a, _ in glob]))
        return {
            "test_accuracy": accuracy,
            "test_loss": float(np.mean([loss for _, loss in glob])),
            "global_accuracy": accuracy,
            "personalised_accuracy": float(np.mean(personal)),
        }

    # --- privacy ------------------------------------------------------------------------
    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy:
        """The client's ``K`` steps: fixed-size uniform batches (``B`` of ``n = B/q``), Gaussian
        with noise multiplier σ relative to the replacement sensitivity ``2C``. A description
        of what ran; the federated guarantee comes from :mod:`silodp.accounting.fdp`."""
        cfg = self.config
        return step_events(cfg.noise_multiplier, sampling_rate, cfg.local_steps, cfg.batch_sampling)

    def run_notes(self) -> list[str]:
        notes = [
            "clients are Poisson-sampled each round; an empty sample is a no-op round that "
            "still counts in the accounting (never re-drawn)",
            "local batches are fixed-size uniform without replacement, as accounted "
            f"(batch_sampling={BATCH_SAMPLING!r})",
            "replacement adjacency inside a client: noise std 2·C·σ on the clipped sum",
            "μ (weak, strong, client_max) is the CLT limit of Theorem 2; ε['record'] is the "
            "accountant's rigorous bound",
            "ε is for replace-one adjacency (a record replaced), unlike the add/remove "
            "adjacency of the other algorithms: it is not directly comparable with their ε",
        ]
        if self.config.helper == "interpolate":
            notes.append("a client receives only its helper (1-α)w̃ + α·w_g, never w_g alone")
        return notes
