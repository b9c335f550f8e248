"""What the ULDP-FL family shares: hyperparameters, threat-model notes, the split Gaussian
mechanism and its exact sum, and the subject weights (see :mod:`silodp.algorithms.uldp`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from silodp._validation import check_choice, check_in_range, check_int
from silodp.algorithms.base import (
    MAX_STEPS,
    AlgorithmConfig,
    SiloUpdate,
    hyperparameter,
)
from silodp.crypto.paillier import check_key_bits
from silodp.crypto.sampling import SharedSampleKey
from silodp.errors import InvalidValueError
from silodp.privacy.gradients import Params
from silodp.privacy.noise import gaussian_mechanism, grid_exponent
from silodp.privacy.randomness import Coins


@dataclass(frozen=True, kw_only=True)
class UldpNaiveConfig(AlgorithmConfig):
    """ULDP-NAIVE's hyperparameters.

    Attributes:
      local_epochs: Q, epochs of the silo's (non-private) local training per round.
    """

    local_epochs: int = hyperparameter(1, "training", "Local epochs Q.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.key("local_epochs"), self.local_epochs, 1, MAX_STEPS)


@dataclass(frozen=True, kw_only=True)
class UldpConfig(UldpNaiveConfig):
    """The weighted ULDP methods' hyperparameters (``uldp_avg``, ``uldp_sgd``).

    Attributes:
      local_epochs: Q, epochs of per-subject training (``uldp_avg``).
      subject_rate: q, the subject-level Poisson sub-sampling rate (1: every subject).
      subject_sampler: who draws the subject sample: ``silos`` (from a secret the silos
        share and the server never sees; amplification holds against the server, not against
        the silos) or ``server`` (no amplification against the server).
    """

    subject_rate: float = hyperparameter(1.0, "privacy", "Subject sampling rate q.")
    subject_sampler: str = hyperparameter(
        "silos",
        "privacy",
        "ULDP with --sample-rate < 1 (the subject rate): who draws the subject sample, silos "
        "(hidden from the server) or server.",
        account=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_in_range(self.key("subject_rate"), self.subject_rate, 0.0, 1.0, lo_open=True)
        check_choice(self.key("subject_sampler"), self.subject_sampler, ("silos", "server"))


#: encryption schemes of the private weighting protocol (``UldpAvgWConfig.scheme``)
SCHEMES = ("paillier", "bfv")
#: how BFV encodes the weights (``UldpAvgWConfig.weight_encoding``;
#: :data:`silodp.crypto.bfv.params.WEIGHTS`, repeated here: importing it needs tenseal)
WEIGHT_ENCODINGS = ("exact", "fixed_point")
#: the ring degree of fixed-point weights (``silodp.crypto.bfv.params.FIXED_POINT_DEGREE``)
FIXED_POINT_MAX_N = 16384


@dataclass(frozen=True, kw_only=True)
class UldpAvgWConfig(UldpConfig):
    """``uldp_avg_w``'s hyperparameters.

    Attributes:
      weighting: weights ``n_{s,a}/n_a`` through the private weighting protocol
        (``protocol``; no party sees another silo's histogram) or computed in the clear.
      scheme: the weighting protocol's encryption: ``paillier`` (the default) or ``bfv``
        (lattice-based, :mod:`silodp.crypto.bfv`; the in-process simulator only). ``bfv``
        needs ``weighting = "protocol"``.
      weight_encoding: with ``scheme = "bfv"``: ``exact`` weights through
        ``L = lcm(1..n_max)`` and the server's inverted blinded counts, or ``fixed_point``
        weights ``floor(2^k/n_a)/2^k`` (never above ``n_{s,a}/n_a``) that the silos compute
        under encryption (:mod:`silodp.crypto.bfv.fixed_weights`), for an ``n_max`` too large
        for ``L`` (up to 16383); subjects then may be sampled only by the silos.
      key_bits: Paillier modulus size of the weighting protocol (at least 2048).
      n_max: public bound on one subject's records in the federation (weighting protocol).
    """

    weighting: str = hyperparameter(
        "protocol",
        "privacy",
        "uldp_avg_w: protocol (the silos do not learn a server-drawn sample) or clear.",
        account=True,
    )
    scheme: str = hyperparameter(
        "paillier",
        "privacy",
        "uldp_avg_w with weighting = protocol: paillier or bfv (lattice-based; in-process "
        "simulator only).",
        account=True,
    )
    weight_encoding: str = hyperparameter(
        "exact",
        "privacy",
        "uldp_avg_w with scheme = bfv: exact (L = lcm(1..n_max)) or fixed_point "
        "(floor(2^k/n_a)/2^k computed by the silos under encryption; n_max < 16384).",
        account=True,
    )
    key_bits: int = hyperparameter(3072, "privacy", "Paillier modulus bits (>= 2048).")
    n_max: int = hyperparameter(2000, "privacy", "Bound on a subject's records (protocol).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.key("weighting"), self.weighting, ("protocol", "clear"))
        check_choice(self.key("scheme"), self.scheme, SCHEMES)
        if self.scheme != "paillier" and self.weighting != "protocol":
            raise InvalidValueError(
                f"Expected {self.key('scheme')}={self.scheme!r} only with "
                f"{self.key('weighting')}='protocol' (the scheme encrypts the weighting "
                f"protocol; got {self.key('weighting')}={self.weighting!r})."
            )
        check_choice(self.key("weight_encoding"), self.weight_encoding, WEIGHT_ENCODINGS)
        check_key_bits(self.key_bits)  # the protocol's own rule: at least 2048 bits
        check_int(self.key("n_max"), self.n_max, 1)
        if self.weight_encoding == "fixed_point":
            key = self.key("weight_encoding")
            if self.scheme != "bfv":
                raise InvalidValueError(
                    f"Expected {key}='fixed_point' only with {self.key('scheme')}='bfv' (got "
                    f"{self.key('scheme')}={self.scheme!r})."
                )
            if self.n_max >= FIXED_POINT_MAX_N:
                raise InvalidValueError(
                    f"Expected {self.key('n_max')}={self.n_max} < {FIXED_POINT_MAX_N} with "
                    f"{key}='fixed_point' (a count is the exponent of X in a ring of degree "
                    f"{FIXED_POINT_MAX_N})."
                )
            if self.subject_sampler == "server" and self.subject_rate < 1.0:
                raise InvalidValueError(
                    f"Expected {self.key('subject_sampler')}='silos' with {key}='fixed_point' "
                    "and a subject sample: the silos compute the weights, so the server cannot "
                    f"hide a sample of its own in them (got subject_rate={self.subject_rate})."
                )


SECURE_AGGREGATION = (
    "secure aggregation: noise is split over silos; ε holds for the released model and, "
    "against the server, only if it sees just the sum of the silos' messages; the subject "
    "sample amplifies ε only against parties that do not learn it (ε per adversary)"
)

SIMULATED_AGGREGATION_NOTE = (
    "the in-process simulator does not implement secure aggregation: ε holds for the "
    "released model; every ε against the server assumes secure aggregation (the server "
    "sees only the sum of the silos' messages)"
)

OWN_NOISE_NOTE = (
    "against the silos: one curious silo knows its own share (1/S of the variance) of the "
    "noise, so its ε is accounted at the noise multiplier σ·√((S-1)/S) that the other silos' "
    "noise gives it; silos that collude are not covered"
)

PROTOCOL_AGGREGATION_NOTE = (
    "private weighting protocol run in-process: weights n_{s,a}/n_a, per-subject weighting "
    "and the sum over silos were computed under Paillier encryption with blinded histograms "
    "and pairwise masks; the server object decrypted only the sum over all silos. This holds "
    "against an honest-but-curious server that colludes with no silo (key shares signed with "
    "registered Ed25519 identity keys); deltas are clipped so that their fixed-point "
    "encodings stay within C, and each silo draws its noise exactly as rounded-Gaussian "
    "integers on the aggregate's grid, a post-processing of the accounted Gaussian mechanism"
)

#: how the BFV scheme encrypts, in place of "under Paillier encryption" in the note above
BFV_ENCRYPTION = (
    "under BFV encryption (lattice-based, 128-bit parameters, CRT over plaintext primes, "
    "each silo's ciphertexts re-randomised and noise-flooded)"
)

#: with fixed-point weights, in place of "weights n_{s,a}/n_a, per-subject weighting" above
FIXED_POINT_WEIGHTS = (
    "fixed-point weights floor(2^k/n_a)/2^k (at most n_{s,a}/n_a; computed by the silos "
    "from their counts under the server's key, each passing the ciphertexts on "
    "re-randomised), per-subject weighting"
)

WEIGHTS_IN_CLEAR_NOTE = (
    "weights not private: the weights n_{s,a}/n_a were computed in the clear from "
    "every silo's subject histogram, which the server and every silo see: no subject-level "
    "guarantee holds against them (ε = inf); the released model's ε stands"
)

ZERO_TOTALS_NOTE = (
    "the weighting protocol's set-up shows the server which listed subjects have no record in "
    "any silo (their blinded total r_a·n_a is 0), so removing a subject's records is visible "
    "to it: no subject-level guarantee holds against the server (ε = inf); the released "
    "model's and the silos' ε stand. weight_encoding = 'fixed_point' (scheme = 'bfv') shows "
    "the server no totals"
)


def sampling_note(
    *, rate: float, sampler: str, protocol: bool, no_guarantee: tuple[str, ...] = ()
) -> str | None:
    """Which ε holds against whom, given who draws the subject sample and which adversaries
    (``no_guarantee``: ``"server"``, ``"silos"``) see the weights and so have no subject-level
    guarantee at all (None when ``rate`` is 1: no sub-sampling)."""
    if rate >= 1.0:
        return None
    head = f"subject sample (rate {rate:g})"
    if sampler == "silos" and protocol:
        how = (
            "drawn by the silos from a key derived from the protocol's shared seed: the "
            "server encrypts a weight for every subject and learns nothing about the sample"
        )
        knows = {"server": False, "silos": True}
    elif sampler == "silos":
        how = (
            "drawn by the silos from a key they share and the server never sees: the "
            "server's messages do not depend on it"
        )
        knows = {"server": False, "silos": True}
    elif protocol:
        how = "drawn by the server, hidden from the silos by Enc(0) weights"
        knows = {"server": True, "silos": False}
    else:
        how = "drawn by the server and sent as zero weights"
        knows = {"server": True, "silos": True}
    names = {"server": "the server", "silos": "the silos"}
    amplified = [names[w] for w in ("server", "silos") if w not in no_guarantee and not knows[w]]
    known = [names[w] for w in ("server", "silos") if w not in no_guarantee and knows[w]]
    blind = [names[w] for w in ("server", "silos") if w in no_guarantee]
    parts = [
        "the sub-sampled ε holds for the released model"
        + ("".join(f" and against {w}" for w in amplified) if amplified else " only")
    ]
    if known:
        who = " and ".join(known)
        verb = "knows" if len(known) == 1 and known[0] == "the server" else "know"
        parts.append(f"against {who}, who {verb} the sample, the known-sample ε (no amplification)")
    if blind:
        who = " and ".join(blind)
        parts.append(f"against {who}, no subject-level guarantee (ε = inf: see the weights' note)")
    return f"{head} {how}; " + "; ".join(parts)


def deltas_method(cfg: UldpConfig) -> str:
    """``per_subject_deltas``' method: the materialised ``vmap`` reference when the config
    asks for ``grad_method = "vmap"``, else the fastest path for the model."""
    return "vmap" if cfg.grad_method == "vmap" else "auto"


def gaussian_share(
    values: Params, *, noise_multiplier: float, sensitivity: float, coins: Coins, shares: int
) -> Params:
    """One silo's share of the Gaussian mechanism (σ, Δ) on the sum of ``shares`` silos'
    values (:func:`~silodp.privacy.noise.gaussian_mechanism`); σ = 0 releases the values
    unnoised, in float64 (no guarantee: the accountant reports ε = ∞)."""
    if noise_multiplier == 0.0:
        return {k: v.to(torch.float64) for k, v in values.items()}
    return gaussian_mechanism(
        values,
        noise_multiplier=noise_multiplier,
        sensitivity=sensitivity,
        coins=coins,
        shares=shares,
    )


def exact_sum(params: Params, updates: Sequence[SiloUpdate], grid: float | None) -> Params:
    """``Σ_s message_s``, exactly: the shares of the Gaussian mechanism are multiples of the
    power of two ``grid``, summed as integers (``grid=None``: σ = 0, no noise, a float64 sum).
    Refuses messages off the grid or a sum beyond float64's exact integers (2^53 steps)."""
    out: Params = {}
    for k, v in params.items():
        if grid is None:
            out[k] = sum(
                (u.params[k].to(torch.float64) for u in updates),
                torch.zeros(v.shape, dtype=torch.float64),
            )
            continue
        steps = [u.params[k].to(torch.float64) / grid for u in updates]
        if any(not torch.equal(t, torch.round(t)) or t.abs().max() >= 2.0**62 for t in steps):
            raise ValueError(f"Expected every silo's message {k!r} on the noise grid {grid!r}.")
        total = sum((t.to(torch.int64) for t in steps), torch.zeros(v.shape, dtype=torch.int64))
        if int(total.abs().max()) >= 2**53:
            raise ValueError(
                f"Expected the sum of the messages {k!r} below 2^53 grid steps of {grid!r}."
            )
        out[k] = total.to(torch.float64) * grid
    return out


def share_grid(noise_multiplier: float, sensitivity: float, shares: int) -> float | None:
    """The grid of :func:`gaussian_mechanism`'s shares (None when σ = 0: no noise)."""
    if noise_multiplier <= 0:
        return None
    return math.ldexp(1.0, grid_exponent(noise_multiplier * sensitivity / math.sqrt(shares)))


def apply_total(params: Params, total: Params, factor: float) -> Params:
    """``w + factor · total``, computed in float64 and only then cast to ``w``'s dtype."""
    return {
        k: (v.to(torch.float64) + factor * total[k].to(torch.float64)).to(v.dtype)
        for k, v in params.items()
    }


def uniform_weights(num_silos: int, num_subjects: int) -> np.ndarray:
    """``w_{s,a} = 1/S`` for every silo and subject."""
    return np.full((num_silos, num_subjects), 1.0 / num_silos)


def record_weights(histogram: np.ndarray) -> np.ndarray:
    """``w_{s,a} = n_{s,a} / n_a`` (0 for subjects without records)."""
    hist = np.asarray(histogram, dtype=np.float64)
    totals = hist.sum(axis=0, keepdims=True)
    return np.divide(hist, totals, out=np.zeros_like(hist), where=totals > 0)


def check_weights(weights: np.ndarray, *, tolerance: float = 1e-9) -> np.ndarray:
    """Validates ULDP weights: finite, ``w >= 0`` and ``Σ_s w_{s,a} <= 1`` for every subject."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"Expected weights of shape (silos, subjects), got {w.shape}.")
    if not np.isfinite(w).all():
        raise ValueError("Expected finite weights; found NaN or inf.")
    if (w < 0).any():
        s, a = np.argwhere(w < 0)[0]
        raise ValueError(f"Expected weights >= 0, got w[{s}, {a}]={w[s, a]}.")
    sums = w.sum(axis=0)
    over = np.flatnonzero(sums > 1.0 + tolerance)
    if len(over):
        a = int(over[0])
        raise ValueError(
            f"Expected the weights of every subject to sum to at most 1 over silos; subject {a} "
            f"sums to {sums[a]:.6g} ({len(over)} subject(s) over)."
        )
    return w


@dataclass(frozen=True)
class RoundWeights:
    """What the server sends every silo in a clear-weights round (silos x subjects).

    ``subject_sampler="server"``: ``sampled`` is the server's sample and ``weights`` are zero
    outside it. ``"silos"``: ``sampled`` is ``None`` and ``weights`` are the base weights; each
    silo zeroes the subjects outside the sample it derives itself (:class:`SiloSide`), so
    nothing here depends on the sample.
    """

    weights: torch.Tensor
    sampled: torch.Tensor | None = None
    round_index: int = 0


@dataclass(frozen=True, repr=False)
class SiloSide:
    """What the silos hold and the server step never reads: the key from which every silo
    derives the same per-round subject sample (:mod:`silodp.crypto.sampling`)."""

    sample_key: SharedSampleKey

    def sample(self, round_index: int, num_subjects: int, rate: float) -> torch.Tensor:
        """Round ``round_index``'s Poisson sample at ``rate`` (bool, one per public subject)."""
        return torch.from_numpy(self.sample_key.sample(round_index, num_subjects, rate))

    def __repr__(self) -> str:
        return "SiloSide(<secret>)"
