"""Privacy loss distributions of silodp's events, built with dp-accounting.

dp-accounting's ``PLDAccountant`` rebuilds a mechanism's PLD on every ``compose`` call; for the
mixture-of-Gaussians mechanism that build dominates the cost, so silodp builds each distinct
event's PLD once (with the batched builder of :mod:`silodp.accounting.mixture`, identical to
dp-accounting's) and composes the cached result.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp.accounting.events import KnownSampleDpEvent, PoissonReplaceOneDpEvent
from silodp.accounting.mixture import mixture_gaussian_pld

__all__ = [
    "DEFAULT_DISCRETIZATION",
    "MAX_PLD_POINTS",
    "coarsest_fit",
    "event_pld",
    "fits",
    "is_supported",
    "loss_variance",
    "pld_loss_moments",
]

DEFAULT_DISCRETIZATION = 1e-3
#: The largest PLD, in grid points, silodp builds (160 MB of float64; composing needs a few
#: times that). A longer plan is accounted by its other routes (RDP), which cost nothing to
#: compose: at 10⁹ DP-SGD steps the PLD took 10 GB and 72 s, at 10¹² more than this machine has.
MAX_PLD_POINTS = 2 * 10**7
#: Width of a composed PLD in standard deviations of its privacy loss: measured 17–53 for
#: sampled and unsampled Gaussians composed 10³–10⁶ times (dp-accounting's tail truncation).
_WIDTH_IN_STD = 60.0
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
        event,
        (
            dp_event.GaussianDpEvent,
            dp_event.MixtureOfGaussiansDpEvent,
            dp_event.NoOpDpEvent,
            PoissonReplaceOneDpEvent,
        ),
    )


def loss_variance(event: dp_event.DpEvent, discretization: float = DEFAULT_DISCRETIZATION) -> float:
    """Variance of the privacy loss of ``event``'s PLD (of the wider of its two PMFs), from
    the PLDs of its single mechanisms only: compositions add variances, so the size of a long
    plan's PLD is known before it is built."""
    return _loss_moments(event, discretization)[1]


@lru_cache(maxsize=256)
def _loss_moments(event: dp_event.DpEvent, discretization: float) -> tuple[float, float]:
    """(mean, variance) of the privacy loss of ``event``'s PLD."""
    if isinstance(event, dp_event.SelfComposedDpEvent):
        mean, variance = _loss_moments(event.event, discretization)
        return event.count * mean, event.count * variance
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [_loss_moments(e, discretization) for e in event.events]
        return sum(m for m, _ in parts), sum(v for _, v in parts)
    if isinstance(event, KnownSampleDpEvent):  # q·(inner) + (1-q)·(loss 0)
        q = event.sampling_probability
        mean, variance = _loss_moments(event.event, discretization)
        return q * mean, q * (variance + mean**2) - (q * mean) ** 2
    ratio = _loss_ratio(event)
    if ratio is not None and (ratio * ratio + 2 * _TAIL_IN_STD * ratio) > (
        MAX_PLD_POINTS * discretization
    ):  # one mechanism's PLD alone would not fit (e.g. σ = 0.001): never built
        return 0.5 * ratio * ratio, math.inf
    return pld_loss_moments(event_pld(event, discretization))


#: how many standard deviations of the privacy loss a Gaussian PLD keeps on each side
#: (dp-accounting truncates at a tail mass of 1e-15, about 8)
_TAIL_IN_STD = 10.0


def _loss_ratio(event: dp_event.DpEvent) -> float | None:
    """The largest sensitivity / σ of one Gaussian-family mechanism (its privacy loss lies
    within ratio²/2 + a few ratio of 0, sub-sampled or not), else ``None``."""
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        event = event.event
    if isinstance(event, dp_event.GaussianDpEvent):
        return 1.0 / event.noise_multiplier if event.noise_multiplier > 0 else math.inf
    if isinstance(event, PoissonReplaceOneDpEvent):
        return 2.0 / event.noise_multiplier if event.noise_multiplier > 0 else math.inf
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        top = max(abs(s) for s in event.sensitivities)
        return top / event.standard_deviation if event.standard_deviation > 0 else math.inf
    return None


def coarsest_fit(event: dp_event.DpEvent, discretization: float) -> float | None:
    """The finest grid, ``discretization`` doubled as often as needed, on which ``event``'s
    PLD fits (``None``: none within 2^60 times)."""
    for _ in range(61):
        if fits(loss_variance(event, discretization), discretization):
            return discretization
        discretization *= 2.0
    return None


def pld_loss_moments(pld: pld_lib.PrivacyLossDistribution) -> tuple[float, float]:
    """(mean, variance) of the privacy loss of ``pld``'s wider PMF (finite losses only)."""
    pmfs = [pld._pmf_remove] + ([] if pld._symmetric else [pld._pmf_add])  # noqa: SLF001
    moments = [(0.0, 0.0)]
    for pmf in pmfs:
        dense = pmf.to_dense_pmf()
        probs = np.asarray(dense._probs, dtype=float)  # noqa: SLF001
        total = probs.sum()
        if total > 0:
            step = dense._discretization  # noqa: SLF001
            losses = (dense._lower_loss + np.arange(len(probs))) * step  # noqa: SLF001
            # elementwise sums, not a BLAS dot: OpenBLAS's threaded dot was seen to spin
            # forever in a Ray driver's server thread (Flower's simulation)
            mean = float(np.sum(probs * losses) / total)
            moments.append((mean, float(np.sum(probs * (losses - mean) ** 2) / total)))
    return max(moments, key=lambda m: m[1])


def fits(variance: float, discretization: float = DEFAULT_DISCRETIZATION) -> bool:
    """Whether a PLD whose privacy loss has this variance stays within :data:`MAX_PLD_POINTS`."""
    return _WIDTH_IN_STD * math.sqrt(variance) / discretization <= MAX_PLD_POINTS


@lru_cache(maxsize=256)
def event_pld(
    event: dp_event.DpEvent, discretization: float = DEFAULT_DISCRETIZATION
) -> pld_lib.PrivacyLossDistribution:
    """The (pessimistic, add/remove) PLD of ``event``.

    Supported: Gaussian, Poisson-sampled Gaussian, mixture of Gaussians, a known-sample
    event around any of these, the replace-one sub-sampled Gaussian
    (:class:`PoissonReplaceOneDpEvent`, dp-accounting's ``REPLACE_ONE`` PLD), and their
    (self-)compositions. Raises ``ValueError`` for anything else.
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
    if isinstance(event, PoissonReplaceOneDpEvent):
        if event.sampling_probability == 0:
            return pld_lib.identity(value_discretization_interval=discretization)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier,
            sampling_prob=event.sampling_probability,
            value_discretization_interval=discretization,
            neighboring_relation=pld_lib.NeighborRel.REPLACE_ONE,
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
