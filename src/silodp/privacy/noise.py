"""Gaussian noise for DP mechanisms.

Noise is drawn from an injected ``torch.Generator`` (reproducible runs), or, in secure mode,
from the operating system's CSPRNG (``os.urandom``) through the Box-Muller transform in float64
so that noise cannot be predicted from a seed.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from silodp._validation import check_non_negative
from silodp.privacy.randomness import Coins

__all__ = ["add_gaussian_noise", "gaussian_mechanism", "gaussian_noise", "noise_like"]


def _secure_standard_normal(numel: int) -> np.ndarray:
    pairs = (numel + 1) // 2
    raw = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
    # 53 random bits -> uniform in (0, 1]; never 0 so the logarithm is finite.
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * math.pi * u2
    out = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])
    return out[:numel]


def gaussian_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    std: float,
    generator: torch.Generator | None,
    secure: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Samples ``N(0, std^2)`` of ``shape``.

    Args:
      shape: output shape.
      std: standard deviation (``noise_multiplier * clip``).
      generator: source of randomness; required unless ``secure``.
      secure: draw from the OS CSPRNG instead of ``generator``.
    """
    check_non_negative("std", std)
    if secure:
        numel = math.prod(shape)
        # np.asarray: a 0-d array times a float is a numpy scalar, which from_numpy rejects.
        values = np.asarray(_secure_standard_normal(numel).reshape(tuple(shape)) * std)
        return torch.from_numpy(values).to(dtype)
    if generator is None:
        raise ValueError("Expected a torch.Generator for noise (or secure=True), got None.")
    return torch.randn(tuple(shape), generator=generator, dtype=dtype) * std


def add_gaussian_noise(
    tensors: dict[str, torch.Tensor],
    *,
    std: float,
    generator: torch.Generator | None,
    secure: bool = False,
) -> dict[str, torch.Tensor]:
    """Returns ``tensors`` with independent ``N(0, std^2)`` noise added to every coordinate."""
    return {
        name: t
        + gaussian_noise(t.shape, std=std, generator=generator, secure=secure, dtype=t.dtype)
        for name, t in tensors.items()
    }


def noise_like(
    tensors: dict[str, torch.Tensor],
    *,
    std: float,
    generator: torch.Generator | None,
    secure: bool = False,
) -> dict[str, torch.Tensor]:
    """Independent ``N(0, std^2)`` noise shaped like each of ``tensors``, drawn in one call
    (one draw for the whole model keeps the per-step cost low for small models)."""
    first = next(iter(tensors.values()))
    total = sum(t.numel() for t in tensors.values())
    flat = gaussian_noise((total,), std=std, generator=generator, secure=secure, dtype=first.dtype)
    out, start = {}, 0
    for name, t in tensors.items():
        out[name] = flat[start : start + t.numel()].view(t.shape)
        start += t.numel()
    return out


def gaussian_mechanism(
    values: dict[str, torch.Tensor],
    *,
    noise_multiplier: float,
    sensitivity: float,
    coins: Coins,
    shares: int = 1,
) -> dict[str, torch.Tensor]:
    """Releases ``values`` plus Gaussian noise: the Gaussian mechanism with L2 sensitivity
    ``sensitivity`` and noise multiplier ``noise_multiplier`` (std ``σΔ``).

    ``shares > 1``: one of ``shares`` parties (silos) whose released values are summed (secure
    aggregation); each adds std ``σΔ/√shares`` and the *sum* is the Gaussian mechanism on the
    sum of the parties' values. Every party must pass the same public (σ, Δ, shares).

    PLACEHOLDER: continuous float noise; replaced by the exact sampler.
    """
    std = noise_multiplier * sensitivity / math.sqrt(shares)
    out: dict[str, torch.Tensor] = {}
    for name, t in values.items():
        u1 = coins.uniform(t.numel()).clamp_min(2.0**-53)
        u2 = coins.uniform(t.numel())
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        out[name] = t + (z * std).to(t.dtype).view(t.shape)
    return out
