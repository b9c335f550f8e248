"""The arithmetic floor of a training round: its multiply-adds at this machine's fastest rate.

A round of per-subject training makes a fixed number of multiply-adds in its convolutions
and linear layers, however the subjects are batched: every real record passes forward and
backward through its subject's copy. :func:`training_macs` counts them for one record;
:func:`peak_rate` measures the rate of the fastest of two large single-precision kernels
(a matrix product and a convolution), which run close to the cores' peak. Their quotient is
about the least time any implementation of the same arithmetic in single precision can take
on this machine, and ``loop time / floor`` about the largest speed-up over a loop it could
show.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp.privacy.gradients import Params

__all__ = ["peak_rate", "training_macs"]


def training_macs(model: nn.Module, params: Params, example: torch.Tensor) -> int:
    """Multiply-adds of one gradient step's forward and backward pass for one record
    ``example`` (a batch of one), in ``model``'s ``Conv2d`` and ``Linear`` layers.

    Forward: ``output elements × inputs per output`` for each layer. Backward: the weights'
    gradient costs as much again, and so does the gradient of the layer's input, except for
    the first layer, whose input (the record) needs none. Bias additions, activations,
    pooling and the loss are left out (a floor, not an estimate)."""
    forward: list[int] = []

    def count(module: nn.Module, _inputs: object, output: object) -> None:
        assert isinstance(output, torch.Tensor)
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            per_output = module.in_channels // module.groups * kh * kw
        else:
            assert isinstance(module, nn.Linear)
            per_output = module.in_features
        forward.append(output.numel() * per_output)

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles = [m.register_forward_hook(count) for m in layers]
    try:
        with torch.no_grad():
            functional_call(model, params, (example,))
    finally:
        for handle in handles:
            handle.remove()
    if not forward:
        return 0
    return 3 * sum(forward) - forward[0]


def peak_rate(*, repeats: int = 5) -> float:
    """Multiply-adds per second of the faster of two large single-precision kernels, with
    torch's current threads: a 1024² matrix product (torch's BLAS) and a 3×3 convolution of
    64 to 64 channels on 32 × 32 channels-last images (oneDNN), each the fastest of
    ``repeats`` timings (a floor must not be raised by a slow moment of a shared machine).

    Both are kept because the libraries reach a CPU's vector units differently: on an AMD
    CPU with AVX-512, MKL's matrix product runs its AVX2 code, at about half of what
    oneDNN's convolution reaches."""
    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    product = torch.empty(size, size)
    images = torch.randn(32, 64, 32, 32).contiguous(memory_format=torch.channels_last)
    kernel = torch.randn(64, 64, 3, 3)
    conv_macs = 32 * 64 * 64 * 9 * 30 * 30
    with torch.no_grad():
        return max(
            size**3 / _fastest(lambda: torch.mm(a, b, out=product), repeats),
            conv_macs / _fastest(lambda: F.conv2d(images, kernel), repeats),
        )


def _fastest(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best
