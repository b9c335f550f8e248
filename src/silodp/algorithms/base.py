"""What every algorithm is: one local update per silo and one aggregation on the server.

Both steps are plain functions of parameters and data, so the in-process simulator and a real
federation (e.g. Flower clients and strategies) call the same code. Every local update returns
the DP events it ran (:class:`~silodp.accounting.SiloPrivacy`); the accountant is derived from
those events only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from silodp._validation import (
    check_choice,
    check_in_range,
    check_int,
    check_non_negative,
)
from silodp.accounting import FederatedAccountant, PrivacyPlan, SiloPrivacy
from silodp.accounting.interface import Accountant
from silodp.accounting.plan import CALIBRATION_DISCRETIZATION
from silodp.crypto.sampling import SharedSampleKey
from silodp.data import FederatedDataset, TestSplit
from silodp.errors import InvalidValueError
from silodp.evaluation import evaluate
from silodp.privacy.gradients import Params, batch_gradient
from silodp.privacy.randomness import Coins

__all__ = [
    "Algorithm",
    "AlgorithmConfig",
    "SiloData",
    "SiloUpdate",
    "average_params",
    "hyperparameter",
]


#: the largest local steps (or epochs) per round a config may ask for
MAX_STEPS = 10**6
#: the largest expected batch size (a batch above a silo's records takes all of them: q = 1)
MAX_BATCH_SIZE = 10**9
#: the largest learning rate (local or server) and clipping norm a config may set
MAX_SCALE = 1e6


def hyperparameter(default: Any, table: str | None, doc: str = "", *, account: bool = False) -> Any:
    """A config field: its default, the TOML table it is read from (``training`` or
    ``privacy``; ``None`` for what the experiment resolves, e.g. σ or the group bound), a
    one-line help, and whether the accounting depends on it (``account``: ``silodp account``
    then has an option for it)."""
    return field(default=default, metadata={"table": table, "doc": doc, "account": account})


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The public hyperparameters every algorithm has; each algorithm's ``Config`` extends it.

    A field's metadata says which TOML table it is read from (``[training]``, ``[privacy]``
    or ``[algorithm.NAME]``), so the config file maps onto these dataclasses directly. Every
    field is validated once, here, with its table-qualified name in the message.

    Attributes:
      local_steps: T, local steps per round.
      batch_size: expected mini-batch size (records; subjects for subject-level sampling).
      lr: local learning rate η.
      server_lr: global learning rate η_g applied to the averaged update.
      grad_method: per-example clipping path: ``auto`` (activation/gradient contractions where
        every layer supports them, else ``vmap``), or ``vmap`` (materialised per-example
        gradients; exact reference).
      clip: clipping bound C.
      noise_multiplier: σ; the noise added to a sum is ``N(0, σ² C² I)`` (resolved by the
        experiment: given or calibrated).
      num_silos: S, the number of silos (public; set from the data). The ULDP methods split
        their noise over the silos, and one curious silo knows its own share.
      span_cap: the span the experiment capped the data to (a subject's records kept in at
        most that many silos), or None when it did not; the record and silo units account
        for what the cap does to their neighbours (:mod:`silodp.algorithms.caps`).
      cross_silo_cap: whether a bound on a subject's records in the whole federation was
        applied across silos (``data.records_per_subject``; ``uldp_group``'s own bound counts
        without it), so that one record can push out another in a different silo.
    """

    local_steps: int = hyperparameter(10, "training", "Local steps per round T.")
    batch_size: int = hyperparameter(32, "training", "Expected batch size B.")
    lr: float = hyperparameter(0.1, "training", "Local learning rate.")
    server_lr: float = hyperparameter(1.0, "training", "Server learning rate.")
    grad_method: str = hyperparameter("auto", "training", "Per-example gradients: auto or vmap.")
    clip: float = hyperparameter(1.0, "privacy", "Clipping bound C.")
    noise_multiplier: float = hyperparameter(1.0, None)
    num_silos: int | None = hyperparameter(None, None)
    span_cap: int | None = hyperparameter(None, None)
    cross_silo_cap: bool = hyperparameter(
        False,
        None,
        "A bound on a subject's records in the whole federation dropped records across silos "
        "(data.records_per_subject): one record can push out another in a different silo.",
        account=True,
    )

    def __post_init__(self) -> None:
        if self.num_silos is not None:
            check_int("num_silos", self.num_silos, 1)
        if self.span_cap is not None:
            check_int("span_cap", self.span_cap, 1)
        if not isinstance(self.cross_silo_cap, bool):
            raise InvalidValueError(
                f"Expected cross_silo_cap to be true or false, got {self.cross_silo_cap!r}."
            )
        check_int(self.key("local_steps"), self.local_steps, 1, MAX_STEPS)
        check_choice(self.key("grad_method"), self.grad_method, ("auto", "vmap"))
        check_int(self.key("batch_size"), self.batch_size, 1, MAX_BATCH_SIZE)
        for name in ("lr", "server_lr", "clip"):  # beyond it float32 training overflows
            check_in_range(self.key(name), getattr(self, name), 0.0, MAX_SCALE, lo_open=True)
        check_non_negative("noise_multiplier", self.noise_multiplier)

    @classmethod
    def key(cls, name: str) -> str:
        """``name`` as it is written in a config file, e.g. ``training.lr``."""
        table = cls.__dataclass_fields__[name].metadata.get("table")
        return f"{table}.{name}" if table else name

    @classmethod
    def tables(cls) -> dict[str, str]:
        """``{field: table}`` of the fields read from a config file's tables."""
        return {
            f.name: f.metadata["table"] for f in fields(cls) if f.metadata.get("table") is not None
        }

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> AlgorithmConfig:
        """This config from the keys of ``settings`` it declares (the others belong to other
        algorithms or to the experiment and are left alone)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in settings.items() if k in names}
        for name, value in values.items():
            if isinstance(value, list):
                values[name] = tuple(value)
        return cls(**values)

    @classmethod
    def accounting_fields(cls) -> dict[str, Any]:
        """``{name: field}`` of the hyperparameters the accounting depends on."""
        return {f.name: f for f in fields(cls) if f.metadata.get("account")}

    def settings(self) -> dict[str, Any]:
        """``{field: value}`` of the fields read from a config file's tables."""
        return {name: getattr(self, name) for name in self.tables()}


@dataclass(frozen=True, eq=False)
class SiloData:
    """One silo's records as tensors; ``subject`` ids are federation-wide."""

    silo: int
    x: torch.Tensor
    y: torch.Tensor
    subject: torch.Tensor

    @property
    def num_records(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_subjects(self) -> int:
        """Distinct subjects in this silo (public metadata, like the silo's size)."""
        return int(torch.unique(self.subject).numel())


@dataclass
class SiloUpdate:
    """A silo's result for one round: its message to the server, events run, diagnostics.

    ``params`` is the message: the silo's new local parameters for averaging algorithms, or
    its noisy weighted sum of model deltas for the ULDP family.
    """

    silo: int
    params: Params
    num_records: int
    privacy: SiloPrivacy | None
    group_sizes: list[int] = field(default_factory=list)
    subjects_per_batch: list[int] = field(default_factory=list)
    #: Anything else the server step needs from this silo (e.g. protocol messages).
    payload: Any = None


def average_params(
    global_params: Params, updates: Sequence[SiloUpdate], *, server_lr: float = 1.0
) -> Params:
    """``w + η_g · mean_s(w_s - w)``: the unweighted average of the silos' models."""
    if not updates:
        return {k: v.clone() for k, v in global_params.items()}
    out: Params = {}
    for name, value in global_params.items():
        mean_delta = torch.stack([u.params[name] - value for u in updates]).mean(dim=0)
        out[name] = value + server_lr * mean_delta
    return out


class Algorithm(ABC):
    """A federated algorithm: ``local_update`` in each silo, ``aggregate`` on the server.

    A subclass registers itself with :func:`~silodp.algorithms.registry.register`, declares its
    hyperparameters in its own ``Config`` (a subclass of :class:`AlgorithmConfig`) and answers
    through methods what the experiment asks of it: what it protects (``units``), how it is
    calibrated (``calibration_unit``, :meth:`make_accountant`, :meth:`plan_events`), which
    silos take part (:meth:`sample_silos`, :meth:`needs_every_silo`), what it needs from a
    deployment (:meth:`needs_secure_aggregation`) and what ``silodp account`` reproduces it
    (:meth:`account_options`). Nothing outside its file names it.
    """

    name: ClassVar[str]
    #: The dataclass of this algorithm's hyperparameters.
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    #: Units this algorithm's events protect (reported every round).
    units: ClassVar[tuple[str, ...]] = ()
    #: Unit at which a target ε calibrates σ (None: not private).
    calibration_unit: ClassVar[str | None] = None
    #: Threat model statement reported with results.
    threat_model: ClassVar[str] = ""
    #: What ``group_size`` bounds: a subject's records in one silo, or in the federation.
    group_scope: ClassVar[str] = "silo"
    #: Neighbouring datasets of the guarantee: ``add/remove`` (one unit's data added or
    #: removed) or ``replace-one`` (one unit's data replaced); ``{unit: adjacency}`` where the
    #: units differ (see :meth:`adjacency_of`).
    adjacency: ClassVar[str | Mapping[str, str]] = "add/remove"
    #: Relative tolerance of σ when calibrating to a target ε.
    calibration_tolerance: ClassVar[float] = 1e-2
    #: The dtype of a silo's message values (``None``: the model parameters' dtype).
    message_dtype: ClassVar[torch.dtype | None] = None

    def __init__(self, config: AlgorithmConfig | Mapping[str, Any]) -> None:
        self.config = self.configure(config)

    @classmethod
    def configure(cls, config: AlgorithmConfig | Mapping[str, Any]) -> Any:
        """``config`` as this algorithm's ``Config``: as is, or built from a mapping of
        hyperparameters (the keys it declares).

        Raises:
          InvalidValueError: a config of another algorithm, or a value out of range."""
        if isinstance(config, Mapping):
            return cls.Config.from_settings(config)
        if not isinstance(config, cls.Config):
            raise InvalidValueError(
                f"Expected a {cls.Config.__name__} for {cls.name!r}, got {type(config).__name__}."
            )
        return config

    def run_notes(self) -> list[str]:
        """Caveats a reviewer must read beside this algorithm's reported ε (in summaries)."""
        return []

    def accounting_notes(self) -> list[str]:
        """Why an adversary's ε is what it is where the plan alone does not say (e.g. no
        guarantee against a party that sees data-dependent values); ``silodp account`` prints
        them."""
        return []

    @classmethod
    def adjacency_of(cls, unit: str) -> str:
        """The neighbouring datasets of the guarantee at ``unit`` (:attr:`adjacency`)."""
        return cls.adjacency if isinstance(cls.adjacency, str) else cls.adjacency[unit]

    @abstractmethod
    def silo_privacy(self, *, sampling_rate: float) -> SiloPrivacy | None:
        """The events one round runs in a silo whose batches are drawn at ``sampling_rate``."""

    # --- policy: what the experiment asks ------------------------------------------------
    @property
    def private(self) -> bool:
        """Whether the algorithm has a DP guarantee (and a σ to calibrate)."""
        return self.calibration_unit is not None

    def group_bound_scope(self) -> str | None:
        """What the public bound ``group_size`` counts, ``silo`` (a subject's records in one
        silo) or ``federation`` (in all silos), or ``None`` when the accounting does not use
        one (the experiment then caps nothing)."""
        return None

    def uses_span(self) -> bool:
        """Whether the guarantee relies on the public span bound (silos per subject), so that
        the experiment caps the data to it."""
        return True

    def needs_every_silo(self) -> bool:
        """Whether every silo must take part in every round (noise split over all silos)."""
        privacy = self.silo_privacy(sampling_rate=1.0) if self.private else None
        return privacy is not None and privacy.scope == "aggregate"

    def needs_secure_aggregation(self) -> bool:
        """Whether the guarantee against the server needs it to see only the silos' sum."""
        return self.needs_every_silo()

    def check_schedule(self, silos_per_round: int | None, num_silos: int) -> int:
        """The silos taking part per round for a configured ``silos_per_round`` (``None``:
        all of them). Raises:
          InvalidValueError: the schedule does not fit the algorithm or the federation."""
        chosen = silos_per_round or num_silos
        if chosen > num_silos:
            raise InvalidValueError(
                f"Expected training.silos_per_round={chosen} <= {num_silos} silos."
            )
        if self.needs_every_silo() and chosen != num_silos:
            raise InvalidValueError(
                f"{self.name} splits its noise over all {num_silos} silos; expected "
                f"training.silos_per_round={chosen} to be {num_silos}."
            )
        return chosen

    def sample_silos(self, num_silos: int, silos_per_round: int, coins: Coins) -> list[int]:
        """This round's silos: ``silos_per_round`` uniformly without replacement (every silo
        if that is all of them)."""
        if silos_per_round == num_silos:
            return list(range(num_silos))
        return sorted(int(s) for s in coins.permutation(num_silos)[:silos_per_round])

    # --- accounting ---------------------------------------------------------------------
    def make_accountant(
        self,
        *,
        span: int,
        delta: float,
        target: str = "strongest",
        stage: str = "report",
        units: Sequence[str] | None = None,
    ) -> Accountant:
        """A fresh accountant of this algorithm's events (``stage``: see
        :data:`~silodp.accounting.interface.STAGES`)."""
        extra: dict[str, Any] = {}
        if stage == "fast":
            extra = {"routes": ("rdp", "rdp-group"), "discretization": CALIBRATION_DISCRETIZATION}
        elif stage == "calibrate":
            extra = {"discretization": CALIBRATION_DISCRETIZATION}
        return FederatedAccountant(
            units=units or self.units, span=span, delta=delta, target=target, **extra
        )

    def with_noise(self, noise_multiplier: float) -> Algorithm:
        """The same algorithm at another σ, for planning (no data set-up)."""
        return type(self)(replace(self.config, noise_multiplier=noise_multiplier))

    def plan_events(self, plan: PrivacyPlan) -> list[SiloPrivacy]:
        """The events one round runs in each silo of ``plan`` (from their sampling rates)."""
        algorithm = self
        if self.config.num_silos is None:  # the ULDP methods need S to account a curious silo
            algorithm = type(self)(replace(self.config, num_silos=len(plan.sampling_rates)))
        # silos at one rate run the same events: built once per rate (plans of 10⁶ silos)
        by_rate = {
            rate: algorithm.silo_privacy(sampling_rate=rate) for rate in set(plan.sampling_rates)
        }
        events = [by_rate[rate] for rate in plan.sampling_rates]
        return [e for e in events if e is not None]

    def accounted_events(
        self, updates: Sequence[SiloUpdate], planned: Sequence[SiloPrivacy]
    ) -> list[SiloPrivacy]:
        """The events a round charges: those of the silos that ran (``planned``: every silo's
        events, for algorithms whose accounting does not depend on who took part)."""
        return [u.privacy for u in updates if u.privacy is not None]

    def account_options(self) -> dict[str, Any]:
        """The ``silodp account`` options, beyond the plan's, that reproduce this algorithm's
        accounting (e.g. ``{"group_size": 3}``)."""
        return {}

    def summary_fields(self) -> dict[str, Any]:
        """Algorithm-specific facts for a run's summary."""
        return {}

    @classmethod
    def for_data(
        cls, config: AlgorithmConfig, train: FederatedDataset, *, coins: Coins | None = None
    ) -> Algorithm:
        """The algorithm set up for a federation (server-side public facts, e.g. weights).

        ``coins``: the set-up's randomness (e.g. a secret the silos share); default secure."""
        return cls(config)

    def silo_setup(self) -> dict[str, Any]:
        """What a silo needs, besides the config, to run this algorithm where its data is:
        public set-up facts only (e.g. the weights), never a secret of the server's."""
        return {}

    @classmethod
    def at_silo(
        cls,
        config: AlgorithmConfig,
        setup: Mapping[str, Any],
        *,
        sample_key: SharedSampleKey | None = None,
    ) -> Algorithm:
        """The algorithm as a silo runs it, from :meth:`silo_setup` and the silos' shared
        sample key (where the silos draw the subject sample)."""
        return cls(config, **setup)

    def secure_sum_grid(self) -> float | None:
        """For algorithms whose silos' messages are summed by secure aggregation
        (:meth:`needs_secure_aggregation`): the grid every message is a whole multiple of,
        so the sum is exact over the integers; ``None`` when the messages are not on a grid
        (no noise)."""
        return None

    # --- one round ----------------------------------------------------------------------
    def initial_state(self, params: Params) -> Any:
        """What a silo keeps between rounds (``None``: nothing; personalised algorithms keep
        their models here)."""
        return None

    def configure_round(self, round_index: int, coins: Coins) -> Any:
        """Server step before a round: what it sends every silo besides the model (e.g. this
        round's subject weights). ``None`` for algorithms that need nothing. ``coins``: the
        server's randomness for this round."""
        return None

    @abstractmethod
    def local_update(
        self,
        model: nn.Module,
        params: Params,
        silo: SiloData,
        coins: Coins,
        instructions: Any = None,
        state: Any = None,
    ) -> SiloUpdate:
        """Runs one round of local training from ``params`` on ``silo``.

        ``coins`` is the silo's randomness for this round (batch sampling and noise: secret
        in secure mode); ``instructions`` is what :meth:`configure_round` returned; ``state``
        what the silo kept (:meth:`initial_state`).
        """

    def aggregate(
        self, params: Params, updates: Sequence[SiloUpdate], states: Sequence[Any] = ()
    ) -> Params:
        """Server step: average of the sampled silos' models (post-processing). ``states``:
        every silo's state, which personalised algorithms update."""
        return average_params(params, updates, server_lr=self.config.server_lr)

    def evaluate(
        self, model: nn.Module, params: Params, states: Sequence[Any], test: TestSplit
    ) -> dict[str, float]:
        """Utility on the held-out ``test`` split: ``test_accuracy`` and ``test_loss``."""
        accuracy, loss = evaluate(model, params, test)
        return {"test_accuracy": accuracy, "test_loss": loss}

    def sampling_rate(self, *, num_records: int, num_subjects: int) -> float:
        """Poisson sampling rate of a silo's batches: ``q = min(1, B / n_s)`` for records."""
        return min(1.0, self.config.batch_size / num_records)

    def run_steps(
        self,
        params: Params,
        silo: SiloData,
        *,
        select: Callable[[], torch.Tensor],
        step: Callable[[Params, torch.Tensor], Params],
    ) -> SiloUpdate:
        """``local_steps`` times: pick a batch with ``select``, update with ``step``; records
        the per-batch diagnostics and the events of :meth:`silo_privacy_for`."""
        local = {k: v.clone() for k, v in params.items()}
        groups, distinct = [], []
        for _ in range(self.config.local_steps):
            idx = select()
            local = step(local, idx)
            largest, subjects = batch_diagnostics(silo.subject[idx])
            groups.append(largest)
            distinct.append(subjects)
        privacy = self.silo_privacy_for(silo)
        return SiloUpdate(silo.silo, local, silo.num_records, privacy, groups, distinct)

    def silo_privacy_for(self, silo: SiloData) -> SiloPrivacy | None:
        """The events one round runs in ``silo`` (from its public size only)."""
        rate = self.sampling_rate(num_records=silo.num_records, num_subjects=silo.num_subjects)
        return self.silo_privacy(sampling_rate=rate)


def check_group_bound(silo: SiloData, group_size: int) -> None:
    """Refuses a silo in which a subject holds more records than the accounted bound ``k``."""
    _, counts = torch.unique(silo.subject, return_counts=True)
    largest = int(counts.max())
    if largest > group_size:
        raise ValueError(
            f"Silo {silo.silo} holds {largest} records of one subject, above the accounted "
            f"group_size={group_size}; cap the data (privacy.group_size) or raise the bound."
        )


def batch_diagnostics(subjects: torch.Tensor) -> tuple[int, int]:
    """(largest group of one subject, distinct subjects) in a mini-batch."""
    if subjects.numel() == 0:
        return 0, 0
    _, counts = torch.unique(subjects, return_counts=True)
    return int(counts.max()), int(counts.numel())


def sgd_step(
    model: nn.Module, params: Params, silo: SiloData, idx: torch.Tensor, *, lr: float
) -> Params:
    """One plain (non-private) mini-batch SGD step on the records ``idx`` of ``silo``."""
    grads = batch_gradient(model, params, silo.x[idx], silo.y[idx])
    return {k: v - lr * grads[k] for k, v in params.items()}


def uniform_batch(n: int, size: int, coins: Coins) -> torch.Tensor:
    """``min(size, n)`` distinct indices drawn uniformly (sampling without replacement): the
    first ones of an exactly uniform permutation."""
    return coins.permutation(n)[: min(size, n)]


def poisson_mask(n: int, rate: float, coins: Coins) -> torch.Tensor:
    """Indices selected by independent Bernoulli(rate) draws (Poisson sampling; each index
    is in with probability exactly ``rate``)."""
    return torch.nonzero(coins.bernoulli(n, rate)).flatten()


def to_numpy(params: Params) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in params.items()}
