"""The arithmetic floor of a training round: its multiply-adds at this machine's peak rate.

A round of per-subject training makes a fixed number of multiply-adds in its convolutions
and linear layers, however the subjects are batched: every real record passes forward and
backward through its subject's copy. :func:`training_macs` counts them for one record, as
the direct algorithm makes them on real values; :func:`peak_mac_rate` measures two large
single-precision kernels, the faster of which runs close to the cores' peak. Their quotient
is about the least time any implementation of the same arithmetic can take on this
machine, and ``loop time / floor`` about the largest speed-up over a loop it could show.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp.privacy.gradients import Params

__all__ = ["peak_mac_rate", "training_macs"]


def training_macs(model: nn.Module, params: Params, example: torch.Tensor) -> int:
    """Multiply-adds of one gradient step's forward and backward pass for one record
    ``example`` (a batch of one), in ``model``'s ``Conv2d`` and ``Linear`` layers.

    Per layer call, the forward's multiply-adds on real values (a zero-padded convolution's
    products with its padding are left out); the weights' gradient costs as much again, and
    so does the gradient of the layer's input where that input depends on the parameters
    (not for a layer applied to the record itself). Bias additions, activations, pooling and
    the loss are left out. Fast convolution algorithms (Winograd's, FFTs) make fewer
    multiplications than this direct count."""
    if example.dim() == 0 or example.shape[0] != 1:
        raise ValueError(f"Expected a batch of one record, got shape {tuple(example.shape)}.")
    total = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            forward = _conv_macs(module, inputs[0].shape[-2:], output.shape[-2:])
        elif isinstance(module, nn.Linear):
            forward = output.numel() * module.in_features
        else:
            return
        total += (3 if inputs[0].requires_grad else 2) * forward

    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    handles = [m.register_forward_hook(count) for m in layers]
    try:
        with torch.enable_grad():
            functional_call(model, leaves, (example.detach(),))
    finally:
        for handle in handles:
            handle.remove()
    return total


def _conv_macs(conv: nn.Conv2d, size_in: torch.Size, size_out: torch.Size) -> int:
    """Forward multiply-adds of ``conv`` on one record: output channels × input channels per
    group × the (output position, kernel tap) pairs that land on the image, not on its
    zero padding."""
    pairs = 1
    for axis in range(2):
        kernel, stride = conv.kernel_size[axis], conv.stride[axis]
        dilation = conv.dilation[axis]
        pad: int | None
        if conv.padding_mode != "zeros":  # padded with image values: every pair is real
            pad = None
        elif isinstance(conv.padding, str):  # "valid" or "same" (the extra pixel goes last)
            pad = 0 if conv.padding == "valid" else dilation * (kernel - 1) // 2
        else:
            pad = int(conv.padding[axis])
        pairs *= sum(
            1
            for i in range(size_out[axis])
            for j in range(kernel)
            if pad is None or 0 <= i * stride + j * dilation - pad < size_in[axis]
        )
    return conv.out_channels * (conv.in_channels // conv.groups) * pairs


def peak_mac_rate(*, repeats: int = 5) -> float:
    """Multiply-adds per second of the faster of two large single-precision kernels, with
    torch's current threads: a 1024² matrix product (torch's BLAS) and a 3×3 convolution of
    64 to 64 channels on 32 × 32 channels-last images (oneDNN), each the fastest of
    ``repeats`` timings (a floor must not be raised by a slow moment of a shared machine).

    Both are kept because the libraries reach a CPU's vector units differently: on an AMD
    CPU with AVX-512, MKL's matrix product runs its AVX2 code, at about half of what
    oneDNN's convolution reaches. A measured rate is at most the true peak, so the floor it
    gives is at least the true least time."""
    size = 1024
    a, b = torch.ones(size, size), torch.ones(size, size)  # the values do not change the time
    product = torch.empty(size, size)
    images = torch.ones(32, 64, 32, 32).contiguous(memory_format=torch.channels_last)
    kernel = torch.ones(64, 64, 3, 3)
    with torch.no_grad():
        conv_macs = F.conv2d(images, kernel).numel() * 64 * 3 * 3
        return max(
            size**3 / _fastest(lambda: torch.mm(a, b, out=product), repeats),
            conv_macs / _fastest(lambda: F.conv2d(images, kernel), repeats),
        )


def _fastest(run: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timings of ``run``, in seconds, after one warm-up."""
    run()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best
