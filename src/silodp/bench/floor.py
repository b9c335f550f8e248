"""The arithmetic floor of a training round: its multiply-adds at this machine's fastest rate.

A round of per-subject training makes a fixed number of multiply-adds in its convolutions
and linear layers, however the subjects are batched: every real record passes forward and
backward through its subject's copy. :func:`training_macs` counts them for one record;
:func:`matmul_rate` measures the rate of a large single-precision matrix product, the
fastest kernel this machine runs (it reaches close to the cores' peak). Their quotient is
the time no implementation of the same arithmetic in single precision can beat on this
machine, and ``loop time / floor`` the largest speed-up over a loop it could show.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.func import functional_call

from silodp.privacy.gradients import Params

__all__ = ["matmul_rate", "training_macs"]


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


def matmul_rate(*, size: int = 1024, repeats: int = 7) -> float:
    """Multiply-adds per second of a ``size``² single-precision matrix product with torch's
    current threads: the fastest of ``repeats`` timings (the floor it feeds must not be
    raised by a slow moment of a shared machine)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - started)
    return size**3 / best
