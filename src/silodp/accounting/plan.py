"""A training plan: the public facts its privacy depends on, and accounting it from events.

A plan is what the accountant needs and nothing private: the sampling rate of each silo, the
number of rounds, how many silos take part per round, the span bound and δ. Its ε is computed
by feeding an accountant the per-silo DP events of one round (whatever mechanism produced them),
so a plan's numbers and a run's per-round numbers come from one code path. The plan assumes
the worst case for participation: the most privacy-losing silo takes part in every round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dp_accounting import dp_event

from silodp._validation import check_choice, check_in_range, check_int, check_probability
from silodp.accounting.accountant import TARGETS, Estimate, SiloPrivacy

if TYPE_CHECKING:
    from silodp.accounting.interface import Accountant

__all__ = [
    "PrivacyPlan",
    "account_events",
    "account_events_by_adversary",
    "feature_statistics_releases",
]

#: PLD discretisation while calibrating (coarser than reporting: faster, still an upper bound)
CALIBRATION_DISCRETIZATION = 5e-3


def feature_statistics_releases(
    noise_multiplier: float, silos: int, *, span_cap: bool, federation_cap: bool
) -> tuple[SiloPrivacy, ...]:
    """The per-silo events of the DP feature statistics (``[data] scaling = "dp"``): each
    silo's statistics through the Gaussian mechanism at ``noise_multiplier``, each changed by
    at most one subject's contribution.

    At the record level, one added record changes its own silo's statistics; with a span cap
    (its silo can enter the subject's kept silos and push one out) or a federation-wide cap
    of the subject's records (it can push one of them out of another silo), two silos'; with
    both, the kept silos can change on both sides, so every silo is counted."""
    check_int("silos", silos, 1)
    changed = 1
    if span_cap and federation_cap:
        changed = silos
    elif span_cap or federation_cap:
        changed = min(2, silos)
    event = dp_event.GaussianDpEvent(noise_multiplier)
    record = dp_event.SelfComposedDpEvent(event, changed) if changed > 1 else event
    return tuple(SiloPrivacy({"record": record, "subject": event}) for _ in range(silos))


@dataclass(frozen=True, kw_only=True)
class PrivacyPlan:
    """The public facts of a training run that its privacy depends on.

    Attributes:
      sampling_rates: the batch sampling rate of each silo (as the algorithm defines it).
      rounds: R.
      silos_per_round: silos taking part in each round.
      span: bound on the silos one subject's records occupy.
      delta: δ at which ε is reported.
      adversary: whom the plan's ε holds against: ``strongest`` (default: every adversary of
        the threat model), ``released`` (outsiders who see the model), ``server`` or ``silos``.
      releases: per-silo events of releases before round 1 (e.g. DP feature statistics),
        composed with the rounds.
    """

    sampling_rates: tuple[float, ...]
    rounds: int
    silos_per_round: int
    span: int
    delta: float
    adversary: str = "strongest"
    releases: tuple[SiloPrivacy, ...] = ()

    def __post_init__(self) -> None:
        if not self.sampling_rates:
            raise ValueError("Expected at least one silo sampling rate, got none.")
        for i, rate in enumerate(self.sampling_rates):
            check_probability(f"sampling_rates[{i}]", rate, allow_zero=True)
        check_int("rounds", self.rounds, 1)
        check_int("silos_per_round", self.silos_per_round, 1, len(self.sampling_rates))
        check_int("span", self.span, 1)
        check_in_range("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        check_choice("adversary", self.adversary, TARGETS)


def account_events(
    accountant: Accountant,
    silos: Sequence[SiloPrivacy],
    plan: PrivacyPlan,
    *,
    per_round: bool = False,
    as_run: bool = False,
) -> list[dict[str, Estimate]]:
    """ε per unit after each of the plan's rounds of ``silos``' events (``per_round``) or only
    after the last one, from a fresh ``accountant``.

    ``as_run``: the rounds are composed one at a time, as a run composes them, also when only
    the last ε is wanted. A run's composed PLD moves to coarser grids as it grows
    (pessimistically), so its ε can lie above that of the rounds composed at once: up to
    about 1.5e-4 relative after 1,000 rounds."""
    if plan.releases:
        accountant.compose_release(plan.releases)
    if not silos:
        return [{}] * (plan.rounds if per_round else 1)
    if not (per_round or as_run):
        accountant.compose_round(silos, count=plan.rounds, participants=plan.silos_per_round)
        return [accountant.estimates()]
    out = []
    for done in range(1, plan.rounds + 1):
        accountant.compose_round(silos, participants=plan.silos_per_round)
        if per_round or done == plan.rounds:
            out.append(accountant.estimates())
    return out


def account_events_by_adversary(
    accountant: Accountant, silos: Sequence[SiloPrivacy], plan: PrivacyPlan
) -> dict[str, dict[str, Estimate]]:
    """ε per unit after the plan's last round against each adversary."""
    if plan.releases:
        accountant.compose_release(plan.releases)
    if silos:
        accountant.compose_round(silos, count=plan.rounds, participants=plan.silos_per_round)
    return accountant.estimates_by_adversary()
