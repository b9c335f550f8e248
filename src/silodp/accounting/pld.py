"""Privacy loss distributions of silodp's events, built with dp-accounting.

dp-accounting's ``PLDAccountant`` rebuilds a mechanism's PLD on every ``compose`` call; for the
mixture-of-Gaussians mechanism that build dominates the cost, so silodp builds each distinct
event's PLD once (with the batched builder of :mod:`silodp.accounting.mixture`, identical to
dp-accounting's) and composes the cached result.
"""

from __future__ import annotations

from functools import lru_cache

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp.accounting.events import KnownSampleDpEvent
from silodp.accounting.mixture import mixture_gaussian_pld

__all__ = ["DEFAULT_DISCRETIZATION", "event_pld", "is_supported"]

DEFAULT_DISCRETIZATION = 1e-3
PLD = pld_lib


def is_supported(event: dp_event.DpEvent) -> bool:
    """Whether :func:`event_pld` can build a PLD for ``event``."""
    if isinstance(event, KnownSampleDpEvent):
        return is_supported(event.event)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return is_supported(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return all(is_supported(e) for e in event.events)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return isinstance(event.event, dp_event.GaussianDpEvent)
    return isinstance(
        event, (dp_event.GaussianDpEvent, dp_event.MixtureOfGaussiansDpEvent, dp_event.NoOpDpEvent)
    )


@lru_cache(maxsize=256)
def event_pld(
    event: dp_event.DpEvent, discretization: float = DEFAULT_DISCRETIZATION
) -> pld_lib.PrivacyLossDistribution:
    """The (pessimistic, add/remove) PLD of ``event``.

    Supported: Gaussian, Poisson-sampled Gaussian, mixture of Gaussians, a known-sample
    event around any of these, and their (self-)compositions. Raises ``ValueError`` for
    anything else.
    """
    if isinstance(event, dp_event.SelfComposedDpEvent):
        if event.count == 0:
            return pld_lib.identity(value_discretization_interval=discretization)
        return event_pld(event.event, discretization).self_compose(event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        result = pld_lib.identity(value_discretization_interval=discretization)
        for inner in event.events:
            result = result.compose(event_pld(inner, discretization))
        return result
    if isinstance(event, dp_event.NoOpDpEvent):
        return pld_lib.identity(value_discretization_interval=discretization)
    if isinstance(event, KnownSampleDpEvent):
        # the adversary knows whether the mechanism ran: q·PLD + (1-q)·(loss 0)
        inner = event_pld(event.event, discretization)
        if event.sampling_probability >= 1.0:
            return inner
        identity = pld_lib.identity(value_discretization_interval=discretization)
        if event.sampling_probability == 0.0:
            return identity
        return inner.compute_mixture(identity, event.sampling_probability)
    if isinstance(event, dp_event.GaussianDpEvent):
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier,
            value_discretization_interval=discretization,
        )
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
        event.event, dp_event.GaussianDpEvent
    ):
        if event.sampling_probability == 0:
            return pld_lib.identity(value_discretization_interval=discretization)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.event.noise_multiplier,
            sampling_prob=event.sampling_probability,
            value_discretization_interval=discretization,
        )
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        # dp-accounting's from_mixture_gaussian_mechanism, bit for bit, built faster
        return mixture_gaussian_pld(
            event.standard_deviation,
            list(event.sensitivities),
            list(event.sampling_probs),
            value_discretization_interval=discretization,
        )
    raise ValueError(f"Expected an event silodp can build a PLD for, got {event!r}.")
