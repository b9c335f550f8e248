"""The federated accountant: composes what every silo ran, per privacy unit (SPEC §3).

Each round, every participating silo reports a :class:`SiloPrivacy` — the dp-accounting events
its mechanism ran, one per unit it protects. The accountant then composes, per unit:

* ``record`` and ``silo``: a record (or a silo's dataset) lives in one silo, so silos compose
  in parallel: each round adds the silo event that dominates the others once.
* ``subject``: a subject may hold records in up to ``span`` silos and the server sees every
  silo's update, so each round adds the dominating silo event ``min(span, silos)``
  times (horizontal composition by PLD/RDP self-composition, not a rule of thumb).

Within one round silodp's silo events differ only in their sampling rate (same noise, steps and
group bound; a silo whose batch takes all its records runs at rate 1), so they are ordered
by dominance: the one with the largest rates dominates (sub-sampling at a smaller rate is a
post-processing of sub-sampling at a larger one: :func:`_dominating_by_rate`); where
the events differ otherwise, no one is known to dominate and every distinct event is composed
(one round's ε does not order events over many rounds: :meth:`FederatedAccountant._worst`).

Routes, each a valid upper bound; the smallest is reported with its name:

* ``pld``: dp-accounting's PLD (pessimistic discretisation) of the unit's events; for a subject
  seen through DP-SGD that is the exact mixture-of-Gaussians mechanism (``pld-mixture``). The
  composed PLD is kept at most ``pld_points`` grid points wide between rounds: before it is
  composed further, a wider one moves to a grid 2^j times coarser by the pessimistic split of
  :mod:`silodp.accounting.coarsen` (still an upper bound), and the round's events are split
  onto that grid before they are composed, so one round costs the same after 10 or 10⁴ rounds.
* ``rdp``: dp-accounting's RDP of the unit's events (the Poisson sub-sampled Gaussian's integer
  orders summed by :mod:`silodp.accounting.conversions`, 1e-9 above the exact value).
* ``rdp-group``: record-level RDP converted to groups of ``k`` (Mironov 2017, Prop. 2).
* ``dp-group``: record-level (ε, δ) converted to groups (Dwork & Roth 2014, Thm 2.2), then basic
  composition over the silos a subject spans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp._validation import check_choice, check_in_range, check_int
from silodp.accounting import conversions
from silodp.accounting.coarsen import coarsen_pld, pld_points
from silodp.accounting.events import KnownSampleDpEvent, PoissonReplaceOneDpEvent
from silodp.accounting.hockey import EpsilonForDelta, epsilon_for_delta
from silodp.accounting.pld import (
    DEFAULT_DISCRETIZATION,
    event_pld,
    fits,
    is_supported,
    loss_variance,
)

__all__ = [
    "ADVERSARIES",
    "COMPOSED_PLD_POINTS",
    "ROUTES",
    "TARGETS",
    "UNITS",
    "Estimate",
    "FederatedAccountant",
    "SiloPrivacy",
]

UNITS = ("record", "silo", "subject")
#: Who looks at the outputs: the released model (outsiders), the server, the silos.
ADVERSARIES = ("released", "server", "silos")
#: What a reported/calibrated ε may be taken against: one adversary, or the strongest of them.
TARGETS = ("strongest", *ADVERSARIES)
ROUTES = ("pld", "rdp", "rdp-group", "dp-group")
#: Default bound, in grid points, on a composed PLD's support between rounds (see
#: :class:`FederatedAccountant`): after 1000 rounds ε stays within ~1e-4 (relative) above the
#: full-support composition (``tests/accounting/test_coarsen.py``), and one round's update
#: costs what it cost after 10 rounds (``silodp bench account``).
COMPOSED_PLD_POINTS = 2**14


@dataclass(frozen=True)
class SiloPrivacy:
    """The DP events one silo ran in one round.

    Attributes:
      events: unit -> event, each in that unit's add/remove adjacency (noise multipliers
        relative to that unit's sensitivity).
      record_event: the record-level event where the subject guarantee can also be derived by
        group conversion (DP-SGD based mechanisms).
      group_size: the public bound ``k`` used for group conversion.
      group_scope: ``silo`` when ``group_size`` bounds one subject's records inside one silo
        (the group-converted guarantee then composes over the ``span`` silos), ``federation``
        when it bounds the subject's records in the whole federation (the group conversion
        applies once to all silos' mechanisms jointly, as in ULDP-GROUP-k).
      scope: ``silo`` when the events are this silo's own mechanism (the server sees each
        silo's output), ``aggregate`` when they describe the securely aggregated sum of all
        silos of the round (noise split over silos; counted once per round, and valid against
        the server only under secure aggregation).
      views: adversary -> unit -> event, for adversaries whose view differs from ``events``
        (e.g. ``server`` or ``silos`` when they drew or saw a sub-sample and so get no
        amplification: :class:`~silodp.accounting.events.KnownSampleDpEvent`). ``events`` is
        the view of the released model (outsiders); an adversary not named here sees that.
    """

    events: Mapping[str, dp_event.DpEvent]
    record_event: dp_event.DpEvent | None = None
    group_size: int | None = None
    group_scope: str = "silo"
    scope: str = "silo"
    views: Mapping[str, Mapping[str, dp_event.DpEvent]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for unit in self.events:
            check_choice("unit", unit, UNITS)
        for adversary, view in self.views.items():
            check_choice("adversary", adversary, ADVERSARIES)
            if set(view) != set(self.events):
                raise ValueError(
                    f"Expected the {adversary!r} view to cover units {sorted(self.events)}, "
                    f"got {sorted(view)}."
                )
        if (self.record_event is None) != (self.group_size is None):
            raise ValueError("Expected record_event and group_size to be given together.")
        check_choice("group_scope", self.group_scope, ("silo", "federation"))
        check_choice("scope", self.scope, ("silo", "aggregate"))

    def view(self, adversary: str) -> Mapping[str, dp_event.DpEvent]:
        """The events as ``adversary`` sees them."""
        return self.views.get(adversary, self.events)


@dataclass(frozen=True)
class Estimate:
    """ε at the accountant's δ for one unit: the smallest valid route and every route tried."""

    epsilon: float
    route: str
    routes: Mapping[str, float]


def _mu_squared(event: dp_event.DpEvent) -> float | None:
    """μ² if ``event`` is a composition of unsampled Gaussians (exactly μ-GDP), else None."""
    if isinstance(event, dp_event.GaussianDpEvent):
        return math.inf if event.noise_multiplier == 0 else event.noise_multiplier**-2
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = _mu_squared(event.event)
        return None if inner is None else event.count * inner
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [_mu_squared(e) for e in event.events]
        return None if any(p is None for p in parts) else float(sum(parts))  # type: ignore[arg-type]
    return None


def _rdp_supported(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _rdp_supported(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return all(_rdp_supported(e) for e in event.events)
    return not isinstance(event, dp_event.MixtureOfGaussiansDpEvent)


def _mixture_group(event: dp_event.DpEvent) -> int:
    """Largest sensitivity of a mixture inside ``event`` (0 when there is none)."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _mixture_group(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return max((_mixture_group(e) for e in event.events), default=0)
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        return int(max(event.sensitivities))
    return 0


def _rates_apart(event: dp_event.DpEvent) -> tuple[Any, tuple[float, ...]]:
    """``event`` with its sub-sampling probabilities taken out: (what remains, the
    probabilities in a fixed order). Two events with equal remains differ only in them."""
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        inner, rates = _rates_apart(event.event)
        return ("poisson", inner), (event.sampling_probability, *rates)
    if isinstance(event, KnownSampleDpEvent):
        inner, rates = _rates_apart(event.event)
        return ("known", inner), (event.sampling_probability, *rates)
    if isinstance(event, PoissonReplaceOneDpEvent):
        return ("poisson-replace", event.noise_multiplier), (event.sampling_probability,)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner, rates = _rates_apart(event.event)
        return ("self", event.count, inner), rates
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [_rates_apart(e) for e in event.events]
        return ("composed", tuple(p for p, _ in parts)), tuple(r for _, q in parts for r in q)
    return event, ()


def _sampled_at_one(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """``event`` with each mechanism that no sub-sampling wraps written as its Poisson
    sub-sampling at rate 1, which is the same mechanism: a silo whose batch takes every record
    then compares by rate with silos that sample theirs."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_sampled_at_one(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent(tuple(_sampled_at_one(e) for e in event.events))
    if isinstance(
        event, dp_event.PoissonSampledDpEvent | KnownSampleDpEvent | PoissonReplaceOneDpEvent
    ):
        return event
    return dp_event.PoissonSampledDpEvent(1.0, event)


def _dominating_by_rate(events: Sequence[dp_event.DpEvent]) -> int | None:
    """Index of an event that dominates all others because they differ only in sub-sampling
    probabilities and its are the largest, each; None when there is no such event.

    Poisson sub-sampling at rate q is a post-processing of sub-sampling at q' >= q: the pair
    ((1-q)Q + qP, Q) is ((1-q')Q + q'P, Q) with each output kept with probability q/q' and
    otherwise replaced by a fresh draw from Q (the mechanism without the unit), for both
    adjacency directions, and for replace-one pairs, whose two sides share that Q component
    (:class:`PoissonReplaceOneDpEvent`); a known sample likewise (replace the output by ⊥
    instead). Dominance survives composition, for PLD and RDP alike. No ε is computed."""
    parts = [_rates_apart(_sampled_at_one(e)) for e in events]
    shape = parts[0][0]
    if not parts[0][1] or any(p[0] != shape for p in parts):
        return None
    best = max(range(len(parts)), key=lambda i: parts[i][1])
    if all(all(a >= b for a, b in zip(parts[best][1], p[1], strict=True)) for p in parts):
        return best
    return None


@dataclass
class _UnitState:
    pld: pld_lib.PrivacyLossDistribution | None
    rdp: np.ndarray | None
    #: variance of the privacy loss composed into ``pld`` (and ``record_pld``) so far
    pld_variance: float = 0.0
    record_variance: float = 0.0
    #: grid of ``pld`` (and ``record_pld``) in multiples of the accountant's discretisation
    pld_factor: int = 1
    record_factor: int = 1
    mu_sq: float | None = 0.0
    mixture: bool = False
    # group-conversion routes (subject unit of DP-SGD based mechanisms)
    group_size: int | None = None
    group_rdp: np.ndarray | None = None
    record_pld: pld_lib.PrivacyLossDistribution | None = None
    group_silos: int = 0
    #: subject-level events composed without a record-level event (e.g. a release before
    #: training), with their counts: the group routes must include them too
    others: list[tuple[dp_event.DpEvent, int]] = field(default_factory=list)
    touched: bool = False
    routes_failed: set[str] = field(default_factory=set)


class FederatedAccountant:
    """Composes silos' DP events round by round and reports ε per unit.

    Args:
      units: the units to account (subset of ``record``, ``silo``, ``subject``).
      span: public bound on the number of silos one subject's records occupy.
      delta: the δ at which ε is reported.
      discretization: PLD value discretisation (coarser is faster and still an upper bound).
      max_mixture_group: largest group size for which the exact mixture PLD is built.
      routes: the routes to compute (default: all of ``ROUTES``); fewer is faster.
      target: whom :meth:`estimates` and :meth:`mu` report against by default: an adversary
        of ``ADVERSARIES`` or ``strongest`` (per unit the largest ε of any of them: the
        number that holds against all).
      pld_points: bound on a composed PLD's support between rounds, in grid points: wider
        compositions move to a coarser grid by a pessimistic split (an upper bound on the
        full-support ε, within a small relative error that grows with rounds², see
        :mod:`silodp.accounting.coarsen`); ``None`` keeps the full support on the
        ``discretization`` grid (one round then costs time linear in √rounds).
    """

    def __init__(
        self,
        *,
        units: Sequence[str],
        span: int,
        delta: float,
        discretization: float = DEFAULT_DISCRETIZATION,
        max_mixture_group: int = 64,
        routes: Sequence[str] = ROUTES,
        target: str = "strongest",
        pld_points: int | None = COMPOSED_PLD_POINTS,
    ) -> None:
        self.target = check_choice("target", target, TARGETS)
        self.pld_points = None if pld_points is None else check_int("pld_points", pld_points, 16)
        #: (event, times, grid factor) -> that event composed ``times`` times on that grid
        self._round_plds: dict[
            tuple[dp_event.DpEvent, int, int], pld_lib.PrivacyLossDistribution
        ] = {}
        for route in routes:
            check_choice("route", route, ROUTES)
        self.routes = frozenset(routes)
        for unit in units:
            check_choice("unit", unit, UNITS)
        self.units = tuple(units)
        self.span = check_int("span", span, 1)
        self.delta = check_in_range("delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)
        self.discretization = discretization
        self.max_mixture_group = check_int("max_mixture_group", max_mixture_group, 1)
        self.rounds = 0
        #: estimates per view, computed once per composed state
        self._estimate_cache: dict[str, dict[str, Estimate]] = {}
        self._views: dict[str, dict[str, _UnitState]] = {}
        self._views["released"] = {
            unit: _UnitState(
                pld=(
                    pld_lib.identity(value_discretization_interval=discretization)
                    if "pld" in self.routes
                    else None
                ),
                rdp=np.zeros_like(conversions.RDP_ORDERS) if "rdp" in self.routes else None,
            )
            for unit in self.units
        }

    # --- composition ------------------------------------------------------------------
    @staticmethod
    def _worst(
        events: Sequence[dp_event.DpEvent], proxies: Sequence[dp_event.DpEvent] | None = None
    ) -> dp_event.DpEvent:
        """An event that dominates each of ``events``: the one at the largest sampling rates
        where they differ only in rates (``proxies``, same order, are compared instead where
        given), else their composition, each distinct event once (composed ``m`` times, it
        covers a subject in any ``m`` of the silos). A larger single-round ε proves no
        dominance over many rounds: a Gaussian at σ = 2 has ε 1.99 in one round and 33.1 in
        100, a Gaussian at σ = 0.6 sampled at q = 0.05 has 3.78 and 11.5 (δ = 1e-5)."""
        pairs = list(dict.fromkeys(zip(events, proxies or events, strict=True)))
        if len(pairs) == 1:
            return pairs[0][0]
        by_rate = _dominating_by_rate([proxy for _, proxy in pairs])
        if by_rate is not None:
            return pairs[by_rate][0]
        return dp_event.ComposedDpEvent(tuple(dict.fromkeys(event for event, _ in pairs)))

    def compose_round(
        self,
        silos: Sequence[SiloPrivacy],
        *,
        count: int = 1,
        participants: int | None = None,
        span: int | None = None,
    ) -> None:
        """Adds ``count`` rounds in which the given silos took part with these events.

        ``participants`` (default ``len(silos)``) is how many silos ran in each round; planning
        passes every silo that may take part with the number that does. ``span`` (default the
        accountant's) is the span of the run that recorded these events, where a ledger's total
        composes runs of different spans.
        """
        self._compose(silos, count=count, participants=participants, span=span)
        self.rounds += count

    def compose_release(self, silos: Sequence[SiloPrivacy], *, span: int | None = None) -> None:
        """Adds a release outside the training rounds (e.g. DP feature statistics computed
        before round 1), composed like one round but not counted as one."""
        self._compose(silos, count=1, participants=None, span=span)

    def _compose(
        self,
        silos: Sequence[SiloPrivacy],
        *,
        count: int,
        participants: int | None,
        span: int | None = None,
    ) -> None:
        check_int("count", count, 1)
        span = self.span if span is None else check_int("span", span, 1)
        self._estimate_cache.clear()
        taking_part = (
            len(silos) if participants is None else check_int("participants", participants, 1)
        )
        # An adversary whose view first differs now starts from the history it shared with
        # the released model so far.
        for adversary in sorted({a for s in silos for a in s.views}):
            if adversary not in self._views:
                self._views[adversary] = {
                    unit: dataclasses.replace(state, routes_failed=set(state.routes_failed))
                    for unit, state in self._views["released"].items()
                }
        for adversary, states in self._views.items():
            for unit in self.units:
                self._compose_unit(
                    states[unit], unit, adversary, silos, count, min(taking_part, span)
                )

    def _compose_unit(
        self,
        state: _UnitState,
        unit: str,
        adversary: str,
        silos: Sequence[SiloPrivacy],
        count: int,
        horizontal: int,
    ) -> None:
        """``horizontal``: the silos one subject's events compose over, at most (the span,
        capped by the silos taking part)."""
        reporting = [s for s in silos if unit in s.events]
        if not reporting:
            return
        events = [s.view(adversary)[unit] for s in reporting]
        # Mixture events are ranked through their record-level event (same order, cheaper).
        proxies = [
            s.record_event if s.record_event is not None and not _rdp_supported(e) else e
            for s, e in zip(reporting, events, strict=True)
        ]
        scopes = {s.scope for s in reporting}
        if len(scopes) > 1:
            raise ValueError(f"Expected one event scope per round, got {sorted(scopes)}.")
        state.touched = True
        if scopes == {"aggregate"} or unit != "subject":
            m = 1  # one aggregate mechanism per round; records/silos compose in parallel
        else:
            m = min(horizontal, len(events))
        worst = self._worst(events, proxies)
        times = m * count
        self._compose_pld(state, worst, times)
        if state.rdp is not None:
            state.rdp = (
                state.rdp + times * conversions.rdp_curve(worst) if _rdp_supported(worst) else None
            )
        mu_sq = _mu_squared(worst)
        state.mu_sq = None if mu_sq is None or state.mu_sq is None else state.mu_sq + times * mu_sq
        if unit == "subject" and self.routes & {"rdp-group", "dp-group"}:
            if any(s.record_event is not None for s in reporting):
                self._compose_group(state, silos, m, count)
            else:
                # not a group-converted mechanism: composed into the group routes as is
                state.others = [*state.others, (worst, times)]
                if state.group_rdp is not None and state.group_size is not None:
                    state.group_rdp = state.group_rdp + times * self._at_group_orders(
                        worst, state.group_size
                    )

    def _compose_pld(self, state: _UnitState, event: dp_event.DpEvent, times: int) -> None:
        if state.pld is None:
            return
        group = _mixture_group(event)
        if not is_supported(event) or group > self.max_mixture_group:
            state.pld = None
            return
        composed = self._compose_bounded(
            state.pld, state.pld_factor, state.pld_variance, event, times
        )
        if composed is None:
            state.pld = None  # a plan too long for a PLD: the other routes bound it
            return
        state.pld, state.pld_factor, state.pld_variance = composed
        state.mixture = state.mixture or group > 0

    def _compose_bounded(
        self,
        pld: pld_lib.PrivacyLossDistribution,
        factor: int,
        variance: float,
        event: dp_event.DpEvent,
        times: int,
    ) -> tuple[pld_lib.PrivacyLossDistribution, int, float] | None:
        """``pld`` (on the grid ``factor`` times the discretisation) composed with ``event``
        ``times`` times: (the composition, its grid factor, its loss variance), or None when
        the PLD would not fit in memory. With ``pld_points`` set, the composition is moved
        to a coarser grid first when it is wider than that."""
        step = self.discretization
        added = times * loss_variance(event, step)
        total = variance + added
        if self.pld_points is None:  # full support on the fine grid
            if not fits(total, step):
                return None
            return pld.compose(event_pld(event, step).self_compose(times)), 1, total
        if not fits(added, step):  # the new rounds are built on the fine grid
            return None
        points = pld_points(pld)
        if points > self.pld_points:  # coarsened only when composed further: a plan's last
            grow = 2 ** math.ceil(math.log2(points / self.pld_points))  # ε reads it whole
            pld, factor = coarsen_pld(pld, grow), factor * grow
        return pld.compose(self._round_pld(event, times, factor)), factor, total

    def _round_pld(
        self, event: dp_event.DpEvent, times: int, factor: int
    ) -> pld_lib.PrivacyLossDistribution:
        """``event`` composed ``times`` times on the fine grid, split onto the grid ``factor``
        times coarser; kept for the next rounds when it is small."""
        key = (event, times, factor)
        cached = self._round_plds.get(key)
        if cached is not None:
            return cached
        fine = event_pld(event, self.discretization).self_compose(times)
        out = coarsen_pld(fine, factor) if factor > 1 else fine
        if self.pld_points is not None and pld_points(out) <= 4 * self.pld_points:
            if len(self._round_plds) >= 16:
                self._round_plds.clear()
            self._round_plds[key] = out
        return out

    def _compose_group(
        self, state: _UnitState, silos: Sequence[SiloPrivacy], m: int, count: int
    ) -> None:
        with_record = [s for s in silos if s.record_event is not None]
        if not with_record:
            return
        group = max(int(s.group_size or 1) for s in with_record)
        if state.group_size is None:
            state.group_size = group
            state.record_pld = pld_lib.identity(value_discretization_interval=self.discretization)
            for event, times in state.others:  # composed before the first group round
                extra = times * self._at_group_orders(event, group)
                state.group_rdp = extra if state.group_rdp is None else state.group_rdp + extra
        elif group != state.group_size:
            raise ValueError(
                f"Expected the same group_size every round, got {group} after {state.group_size}."
            )
        if any(s.group_scope == "federation" for s in with_record):
            m = 1  # the bound holds for all silos jointly: convert the joint mechanism once
        state.group_silos = max(state.group_silos, m)
        record = self._worst([s.record_event for s in with_record if s.record_event])
        curve = conversions.rdp_curve(record)
        _, grouped = conversions.rdp_group_curve(conversions.RDP_ORDERS, curve, group)
        add = m * count * grouped
        state.group_rdp = add if state.group_rdp is None else state.group_rdp + add
        if "dp-group" in self.routes and state.record_pld is not None:
            composed = self._compose_bounded(
                state.record_pld, state.record_factor, state.record_variance, record, count
            )
            if composed is None:
                state.record_pld = None
                return
            state.record_pld, state.record_factor, state.record_variance = composed

    @staticmethod
    def _at_group_orders(event: dp_event.DpEvent, group: int) -> np.ndarray:
        """Subject-level RDP of ``event`` at the orders of the group-converted curve."""
        orders, _ = conversions.rdp_group_curve(
            conversions.RDP_ORDERS, conversions.RDP_ORDERS, group
        )
        if not _rdp_supported(event):
            return np.full(len(orders), np.inf)
        return conversions.rdp_curve(event, orders)

    # --- reporting --------------------------------------------------------------------
    @property
    def split_adversaries(self) -> tuple[str, ...]:
        """Adversaries whose view has differed from the released model's so far."""
        return tuple(a for a in self._views if a != "released")

    def _states(self, adversary: str) -> dict[str, _UnitState]:
        check_choice("adversary", adversary, ADVERSARIES)
        return self._views.get(adversary, self._views["released"])

    def _view_estimates(self, adversary: str) -> dict[str, Estimate]:
        """:meth:`_estimates` of ``adversary``'s view (the released model's where it has none
        of its own), computed once per composed state."""
        check_choice("adversary", adversary, ADVERSARIES)
        key = adversary if adversary in self._views else "released"
        if key not in self._estimate_cache:
            self._estimate_cache[key] = self._estimates(self._views[key])
        return dict(self._estimate_cache[key])

    def estimates_by_adversary(self) -> dict[str, dict[str, Estimate]]:
        """ε per unit against each adversary (``released``, ``server``, ``silos``)."""
        return {a: self._view_estimates(a) for a in ADVERSARIES}

    def estimates(self, adversary: str | None = None) -> dict[str, Estimate]:
        """ε at ``delta`` per accounted unit (``inf`` where no route is valid) against
        ``adversary`` (default: the accountant's ``target``); ``strongest`` gives, per unit,
        the largest ε of any adversary."""
        target = check_choice("adversary", adversary or self.target, TARGETS)
        if target != "strongest":
            return self._view_estimates(target)
        if not self.split_adversaries:
            return self._view_estimates("released")
        by = self.estimates_by_adversary()
        return {
            unit: max((by[a][unit] for a in ADVERSARIES), key=lambda e: e.epsilon)
            for unit in by["released"]
        }

    def _estimates(self, states: Mapping[str, _UnitState]) -> dict[str, Estimate]:
        out: dict[str, Estimate] = {}
        for unit, state in states.items():
            if not state.touched:
                out[unit] = Estimate(0.0, "none", {})
                continue
            routes: dict[str, float] = {}
            if state.pld is not None:
                name = "pld-mixture" if state.mixture else "pld"
                routes[name] = epsilon_for_delta(state.pld, self.delta)
            if state.rdp is not None:
                routes["rdp"] = conversions.rdp_epsilon(
                    conversions.RDP_ORDERS, state.rdp, self.delta
                )
            if state.group_rdp is not None and state.group_size is not None:
                orders, _ = conversions.rdp_group_curve(
                    conversions.RDP_ORDERS, conversions.RDP_ORDERS, state.group_size
                )
                if "rdp-group" in self.routes:
                    routes["rdp-group"] = conversions.rdp_epsilon(
                        orders, state.group_rdp, self.delta
                    )
                record_pld = state.record_pld
                # (ε, δ) group conversion covers only the record-level mechanism
                if "dp-group" in self.routes and record_pld is not None and not state.others:
                    routes["dp-group"] = conversions.group_epsilon_dp(
                        EpsilonForDelta(record_pld),
                        group_size=state.group_size,
                        delta=self.delta,
                        compositions=max(state.group_silos, 1),
                    )
            finite = {k: v for k, v in routes.items() if math.isfinite(v)}
            if finite:
                route = min(finite, key=finite.__getitem__)
                out[unit] = Estimate(finite[route], route, routes)
            else:
                out[unit] = Estimate(math.inf, "none", routes)
        return out

    def spec(self) -> dict[str, Any]:
        """What rebuilds an empty accountant like this one (:func:`accountant_from_spec`)."""
        return {
            "kind": "federated",
            "units": list(self.units),
            "span": self.span,
            "delta": self.delta,
            "target": self.target,
            "discretization": self.discretization,
            "routes": sorted(self.routes),
            "pld_points": self.pld_points,
        }

    def labelled_estimates(self) -> dict[str, float]:
        """Non-rigorous estimates reported beside ε (none: every number here is a bound)."""
        return {}

    def mu_estimates(self) -> dict[str, float]:
        """Non-rigorous μ reported beside :meth:`mu` (none: every μ here is exact)."""
        return {}

    def epsilons(self, adversary: str | None = None) -> dict[str, float]:
        return {unit: est.epsilon for unit, est in self.estimates(adversary).items()}

    def mu(self, adversary: str | None = None) -> dict[str, float]:
        """μ of Gaussian DP for units whose events are unsampled Gaussians (exact), against
        ``adversary`` (default: the ``target``; ``strongest``: only where every adversary's
        view is exactly Gaussian, the largest μ)."""
        target = check_choice("adversary", adversary or self.target, TARGETS)
        if target == "strongest":
            views = [self._states(a) for a in ADVERSARIES]
            return {
                unit: max(math.sqrt(v[unit].mu_sq) for v in views)  # type: ignore[arg-type]
                for unit in self.units
                if all(v[unit].touched and v[unit].mu_sq is not None for v in views)
            }
        return {
            unit: math.sqrt(state.mu_sq)
            for unit, state in self._states(target).items()
            if state.touched and state.mu_sq is not None
        }
