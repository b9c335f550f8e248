"""Constructors for the DP events silodp's mechanisms run (dp-accounting event types).

Noise multipliers here are *relative to the sensitivity* of the noised sum: a sum with
sensitivity ``Δ`` and noise ``N(0, σ²C²)`` has noise multiplier ``σC/Δ``.
"""

from __future__ import annotations

import attr
from dp_accounting import dp_event
from scipy import stats

from silodp._validation import check_int, check_non_negative, check_probability

__all__ = [
    "KnownSampleDpEvent",
    "PoissonReplaceOneDpEvent",
    "gaussian_steps",
    "known_sample_gaussian_steps",
    "poisson_gaussian_steps",
    "replace_one",
    "subject_mixture_steps",
]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class KnownSampleDpEvent(dp_event.DpEvent):
    """``event`` applied with probability ``sampling_probability``, to an adversary that
    *knows* whether it was applied (it drew or saw the sample).

    Sub-sampling then gives no amplification: the adversary's view is the pair
    ``(q·P + (1-q)·⊥, q·P' + (1-q)·⊥)`` with ``⊥`` an outcome it can tell apart, whose privacy
    loss distribution is the mixture ``q·PLD(P, P') + (1-q)·δ_0``. Over R rounds of a Gaussian
    with noise multiplier σ this is ``δ(ε) = Σ_n Bin(n; R, q)·δ_Gauss(ε; √n/σ)`` (SPEC §2).
    """

    sampling_probability: float
    event: dp_event.DpEvent


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PoissonReplaceOneDpEvent(dp_event.DpEvent):
    """One Poisson-sampled Gaussian step (rate ``sampling_probability``, noise multiplier
    ``noise_multiplier``) between two datasets that differ by *replacing* one unit with
    another, each included at that rate.

    Its dominating pair is dp-accounting's ``REPLACE_ONE`` pair for a sub-sampled Gaussian,
    ``(q·N(-1, σ²) + (1-q)·N(0, σ²), q·N(1, σ²) + (1-q)·N(0, σ²))``: the two units' clipped
    contributions point in opposite directions. It dominates the add/remove pair too (a unit
    whose contribution is zero changes nothing), so it bounds a step in which a unit is either
    added or swapped for another.
    """

    sampling_probability: float
    noise_multiplier: float


def replace_one(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """``event`` (add/remove adjacency) seen by datasets that differ by replacing one unit.

    A Gaussian's sensitivity doubles (noise multiplier halved); a Poisson-sampled Gaussian
    becomes :class:`PoissonReplaceOneDpEvent`; compositions are rewritten part by part.

    Raises:
      ValueError: ``event`` holds another kind of mechanism (mixtures, known samples).
    """
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(replace_one(event.event), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent(tuple(replace_one(e) for e in event.events))
    if isinstance(event, dp_event.NoOpDpEvent):
        return event
    if isinstance(event, dp_event.GaussianDpEvent):
        return dp_event.GaussianDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
        event.event, dp_event.GaussianDpEvent
    ):
        return PoissonReplaceOneDpEvent(event.sampling_probability, event.event.noise_multiplier)
    raise ValueError(f"Expected Gaussian or Poisson-sampled Gaussian events, got {event!r}.")


def gaussian_steps(noise_multiplier: float, steps: int) -> dp_event.DpEvent:
    """``steps`` Gaussian mechanisms without sampling."""
    check_non_negative("noise_multiplier", noise_multiplier)
    check_int("steps", steps, 1)
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), steps)


def poisson_gaussian_steps(
    sampling_probability: float, noise_multiplier: float, steps: int
) -> dp_event.DpEvent:
    """``steps`` Poisson-sampled Gaussian mechanisms (DP-SGD steps)."""
    check_probability("sampling_probability", sampling_probability, allow_zero=True)
    check_non_negative("noise_multiplier", noise_multiplier)
    check_int("steps", steps, 1)
    inner = dp_event.PoissonSampledDpEvent(
        sampling_probability, dp_event.GaussianDpEvent(noise_multiplier)
    )
    return dp_event.SelfComposedDpEvent(inner, steps)


def subject_mixture_steps(
    sampling_probability: float, noise_multiplier: float, group_size: int, steps: int
) -> dp_event.DpEvent:
    """DP-SGD steps seen by a subject with ``group_size`` records (SPEC §3).

    Under Poisson record sampling at rate q, ``j ~ Binomial(k, q)`` of the subject's records are
    in a step, so the step is a mixture of Gaussians with sensitivities ``j`` (in units of C).
    """
    check_probability("sampling_probability", sampling_probability, allow_zero=True)
    check_int("group_size", group_size, 1)
    check_int("steps", steps, 1)
    pmf = stats.binom.pmf(range(group_size + 1), group_size, sampling_probability)
    # drop impossible counts (e.g. q = 1 puts all mass on k): dp-accounting's mixture PLD
    # fails on zero-probability components
    points = [(float(j), float(p)) for j, p in enumerate(pmf) if p > 0.0]
    total = sum(p for _, p in points)
    inner: dp_event.DpEvent
    if len(points) == 1:
        sensitivity = points[0][0]
        inner = (
            dp_event.NoOpDpEvent()
            if sensitivity == 0.0
            else dp_event.GaussianDpEvent(noise_multiplier / sensitivity)
        )
    else:
        inner = dp_event.MixtureOfGaussiansDpEvent(
            float(noise_multiplier),
            tuple(j for j, _ in points),
            tuple(p / total for _, p in points),
        )
    return dp_event.SelfComposedDpEvent(inner, steps)


def known_sample_gaussian_steps(
    sampling_probability: float, noise_multiplier: float, steps: int
) -> dp_event.DpEvent:
    """``steps`` Gaussian mechanisms, each run with probability q on a sample the adversary
    knows (:class:`KnownSampleDpEvent`): no amplification by sub-sampling."""
    check_probability("sampling_probability", sampling_probability, allow_zero=True)
    check_non_negative("noise_multiplier", noise_multiplier)
    check_int("steps", steps, 1)
    inner = KnownSampleDpEvent(sampling_probability, dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(inner, steps)
