"""The ULDP-FL family (Kato et al., "ULDP-FL: federated learning with across-silo user-level
differential privacy"): subject-level DP when a subject's records sit in several silos.

* ``uldp_naive``: non-private local training, the silo's model delta clipped to C, noise
  ``N(0, σ²C²·S)`` per silo. Removing a subject changes (not removes) every silo's data, so
  each clipped delta moves by up to 2C (replacement, as for UserLDP) and the sum has
  sensitivity 2·S·C; the summed noise has std σ·C·S: one Gaussian (σ/2) per round.
* ``uldp_group`` (ULDP-GROUP-k): at most k records per subject in the whole federation (fixed,
  seeded flags; the rest dropped before training), DP-SGD in each silo; the record-level
  guarantee of all silos jointly is converted to groups of k.
* ``uldp_avg`` / ``uldp_sgd``: per silo and per subject, train from the global model on that
  subject's records only (Q epochs; one gradient step for SGD), clip the delta to C, weight it
  by ``w_{s,a}`` (``w >= 0``, ``Σ_s w_{s,a} <= 1``), sum over subjects and add ``N(0, σ²C²/S)``.
  Removing a subject moves the sum over silos by at most ``Σ_s w_{s,a} C <= C`` and the summed
  noise has std σC: one Gaussian (σ) per round, Poisson sub-sampled at rate q (the weights of
  the subjects outside the sample are zero). The server divides the secure sum by the public
  expected number of subjects ``q·|U|`` and applies the global learning rate.
* ``uldp_avg_w``: ``uldp_avg`` with ``w_{s,a} = n_{s,a}/n_a``, by default computed and
  applied through the private weighting protocol of ULDP-FL (Protocol 1; :mod:`silodp.crypto`):
  the weights, the per-subject weighting and the secure sum happen under Paillier encryption,
  multiplicative blinding and pairwise masks, all parties run in this process.

Noise: every silo releases the exact Gaussian mechanism's share
(:func:`~silodp.privacy.noise.gaussian_mechanism`, ``shares=S``: float64 values on a grid) and
the server sums the silos' messages in float64 - exactly - before anything is rounded to the
parameters' dtype; through the protocol, each silo draws its noise as exact rounded-Gaussian
integers on the protocol's own grid (:mod:`silodp.crypto.encoding`). Either way the released
sum is a post-processing of the continuous Gaussian mechanism that is accounted.

Who sees the subject sample decides whom sub-sampling protects (SPEC §2).
``subject_sampler="silos"`` (default): the silos derive each round's sample from a key they
share and the server never sees (:mod:`silodp.crypto.sampling`; through the protocol, a key
derived from its shared seed); the server's messages do not depend on the sample, so the
amplified ε holds for the released model and against the server, and the known-sample ε
(no amplification) against the silos. ``subject_sampler="server"``: the server draws it and
gets no amplification; the silos see it too with clear weights (zeroed), not through the
protocol (``Enc(0)``). :meth:`UldpAvg.silo_privacy` returns these per-adversary views.

The noise is split over silos, so every guarantee against the server holds only if it sees
nothing but the sum of the silos' messages (secure aggregation).
"""

from __future__ import annotations

from silodp.algorithms.uldp_avg import UldpAvg, UldpSgd
from silodp.algorithms.uldp_common import (
    RoundWeights,
    SiloSide,
    UldpAvgWConfig,
    UldpConfig,
    UldpNaiveConfig,
    check_weights,
    record_weights,
    uniform_weights,
)
from silodp.algorithms.uldp_naive import UldpGroup, UldpNaive
from silodp.algorithms.uldp_protocol import ProtocolRound, UldpAvgW

__all__ = [
    "ProtocolRound",
    "RoundWeights",
    "SiloSide",
    "UldpAvg",
    "UldpAvgW",
    "UldpAvgWConfig",
    "UldpConfig",
    "UldpGroup",
    "UldpNaive",
    "UldpNaiveConfig",
    "UldpSgd",
    "check_weights",
    "record_weights",
    "uniform_weights",
]
