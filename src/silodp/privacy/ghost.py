"""Per-example gradient norms and clipped sums without materialising per-example gradients.

For a layer ``y = W a (+ b)`` applied at positions ``t`` (sequence steps, conv patches), the
gradient of example i is ``G_i = Σ_t g_{i,t} a_{i,t}^T``. One forward and one backward pass give
every layer's inputs ``a`` and output gradients ``g``; from them:

* the squared norm ``||G_i||²`` is ``||g_i||²·||a_i||²`` when there is one position, else either
  ``Σ_{t,t'} (a_t·a_t')(g_t·g_t')`` (ghost norm, Gram matrices) or, when ``T² > p·d``, the norm of
  the per-example ``G_i`` itself — whichever is cheaper;
* the clipped, weighted sum ``Σ_i w_i G_i`` is one contraction ``einsum('b,btp,btd->pd')``.

So DP-SGD (``w_i = c_i``) and HiGradAvgDP (``w_i = c_i / m_{a(i)}``, a per-subject average of
clipped gradients) cost about one plain training step plus these contractions. Supported
layers: ``Linear``, ``Conv2d`` (any stride/padding/dilation, ``groups=1``), ``Embedding``; the
LSTM of :mod:`silodp.models` is built from ``Linear`` layers for this reason. A model with any
other parametrised layer falls back to exact ``vmap`` per-example gradients, with a warning
naming the layer.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp.privacy.gradients import (
    Params,
    clip_factors,
    per_example_gradients,
    per_example_norms,
    weighted_sum,
)

__all__ = ["GhostClipper", "clipper_for", "supported"]

logger = logging.getLogger(__name__)

SUPPORTED = (nn.Linear, nn.Conv2d, nn.Embedding)
Weigh = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def supported(model: nn.Module) -> list[str]:
    """Names of parametrised layers the fast path cannot handle (empty: fully supported)."""
    bad = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        if not isinstance(module, SUPPORTED) or (
            isinstance(module, nn.Conv2d)
            and (module.groups != 1 or isinstance(module.padding, str))
        ):
            bad.append(f"{name or '<root>'} ({type(module).__name__})")
    return bad


@dataclass
class _Calls:
    """Inputs and outputs of every call of one layer during a forward pass."""

    module: nn.Module
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


def _positions(
    module: nn.Module, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, d) inputs and (B, T, p) output gradients of a Linear or Conv2d call."""
    batch = a.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = cast(tuple[int, ...], module.padding)  # string padding is unsupported
        cols = F.unfold(
            a, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
        )  # (B, d, T)
        return cols.transpose(1, 2), g.reshape(batch, g.shape[1], -1).transpose(1, 2)
    return a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])


def _linear_stats(
    module: nn.Module, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """Squared per-example norms of (weight, bias) grads and a weighted-sum function."""
    positions = a.shape[1]
    d, p = a.shape[2], g.shape[2]
    if positions == 1:
        sq = g[:, 0].pow(2).sum(1) * a[:, 0].pow(2).sum(1)
    elif positions * positions <= p * d:
        gram_a = torch.bmm(a, a.transpose(1, 2))
        gram_g = torch.bmm(g, g.transpose(1, 2))
        sq = (gram_a * gram_g).sum(dim=(1, 2))
    else:
        sq = torch.bmm(g.transpose(1, 2), a).pow(2).sum(dim=(1, 2))
    has_bias = getattr(module, "bias", None) is not None
    if has_bias:
        sq = sq + g.sum(1).pow(2).sum(1)

    def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
        shape = cast(torch.Tensor, module.weight).shape
        weight = torch.einsum("b,btp,btd->pd", w, g, a).reshape(shape)
        out = {"weight": weight}
        if has_bias:
            out["bias"] = torch.einsum("b,btp->p", w, g)
        return out

    return sq, weighted


def _embedding_stats(
    module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    batch = idx.shape[0]
    idx = idx.reshape(batch, -1)
    g = g.reshape(batch, idx.shape[1], -1)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)
    sq = (same * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2))

    def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
        out = torch.zeros_like(module.weight)
        out.index_add_(0, idx.reshape(-1), (w[:, None, None] * g).reshape(-1, g.shape[-1]))
        return {"weight": out}

    return sq, weighted


Maker = Callable[[torch.Tensor], dict[str, torch.Tensor]]
#: per layer: the module, its inputs ((B, T, d) activations or (B, T) token ids) and output
#: gradients (B, T, p)
Captured = dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]


class GhostClipper:
    """Clipped (weighted) gradient sums of a model at ghost-clipping cost.

    Args:
      model: the module; its parameters are replaced functionally by ``params`` on each call.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.unsupported = supported(model)
        if self.unsupported:
            logger.warning(
                "Layers %s are not supported by the fast per-example path; using exact "
                "vmap per-example gradients for this model.",
                ", ".join(self.unsupported),
            )
        self._layers = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, SUPPORTED) and list(module.parameters(recurse=False))
        }

    @property
    def fast(self) -> bool:
        return not self.unsupported

    def _capture(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None
    ) -> Captured:
        """One forward and backward pass of ``Σ_i scale_i · loss_i``; every layer's inputs and
        output gradients, positions stacked along dimension 1."""
        calls = {name: _Calls(module) for name, module in self._layers.items()}
        handles = []
        for name, module in self._layers.items():

            def hook(mod: nn.Module, inp: tuple, out: torch.Tensor, name: str = name) -> None:
                calls[name].inputs.append(inp[0].detach())
                calls[name].outputs.append(out)

            handles.append(module.register_forward_hook(hook))
        try:
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            with torch.enable_grad():
                logits = functional_call(self.model, leaves, (x,))
                losses = F.cross_entropy(logits, y, reduction="none")
                loss = losses.sum() if scale is None else (losses * scale).sum()
                outputs = [o for c in calls.values() for o in c.outputs]
                grads_out = torch.autograd.grad(loss, outputs)
        finally:
            for h in handles:
                h.remove()
        captured: Captured = {}
        pos = 0
        for name, c in calls.items():
            gs = grads_out[pos : pos + len(c.outputs)]
            pos += len(c.outputs)
            if not gs:
                continue
            if isinstance(c.module, nn.Embedding):
                a = torch.cat([i.reshape(i.shape[0], -1) for i in c.inputs], dim=1)
                g = torch.cat([gi.reshape(gi.shape[0], -1, gi.shape[-1]) for gi in gs], dim=1)
            else:
                pairs = [_positions(c.module, a, gi) for a, gi in zip(c.inputs, gs, strict=True)]
                a = torch.cat([p[0] for p in pairs], dim=1)
                g = torch.cat([p[1] for p in pairs], dim=1)
            captured[name] = (c.module, a, g)
        return captured

    @staticmethod
    def _assemble(params: Params, makers: dict[str, Maker], weights: torch.Tensor) -> Params:
        summed: Params = {}
        for name, make in makers.items():
            for pname, value in make(weights).items():
                summed[f"{name}.{pname}" if name else pname] = value
        for key, value in params.items():  # parameters this batch does not reach
            summed.setdefault(key, torch.zeros_like(value))
        return summed

    def norms_and_sum(
        self,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        clip: float,
        weigh: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Params]:
        """Per-example gradient norms and ``Σ_i w_i g_i`` with ``w = weigh(c)`` (``c`` the
        clip factors ``min(1, C/||g_i||)``; default ``w = c``)."""
        if not self.fast:
            grads = per_example_gradients(self.model, params, x, y)
            norms = per_example_norms(grads)
            factors = clip_factors(norms, clip)
            return norms, weighted_sum(grads, factors if weigh is None else weigh(factors))
        sq = torch.zeros(x.shape[0], dtype=next(iter(params.values())).dtype)
        makers: dict[str, Maker] = {}
        for name, (module, a, g) in self._capture(params, x, y, None).items():
            if isinstance(module, nn.Embedding):
                layer_sq, makers[name] = _embedding_stats(module, a, g)
            else:
                layer_sq, makers[name] = _linear_stats(module, a, g)
            sq = sq + layer_sq
        norms = sq.clamp(min=0).sqrt()
        factors = clip_factors(norms, clip)
        return norms, self._assemble(params, makers, factors if weigh is None else weigh(factors))

    def subject_norms_and_sum(
        self,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        subjects: torch.Tensor,
        *,
        weigh: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, Params]:
        """Per-subject mean gradients ``G_a = mean_{i in a} g_i``: their norms, and
        ``Σ_a v_a G_a`` with ``v = weigh(norms)`` (one weight per subject, in the order of
        ``torch.unique(subjects)``).

        The norms come from Gram matrices restricted to each subject's rows (or from the
        per-subject gradient itself when that is smaller); the sum from one contraction with
        per-example weights ``v_{a(i)}``. Needs every layer supported (no fallback).
        """
        if not self.fast:
            raise ValueError(
                f"Per-subject norms need every layer supported; unsupported: {self.unsupported}."
            )
        _, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
        dtype = next(iter(params.values())).dtype
        scale = 1.0 / counts.to(dtype)[inverse]
        captured = self._capture(params, x, y, scale)
        rows, slot = _subject_layout(inverse, counts)
        num = counts.numel()
        sq = torch.zeros(num, dtype=dtype)
        makers: dict[str, Maker] = {}
        for name, (module, a, g) in captured.items():
            if isinstance(module, nn.Embedding):
                # per-subject: a subject's tokens are all its examples' tokens
                layer_sq = _embedding_subject_sq(a, g, rows, slot, num)
                _, makers[name] = _embedding_stats(module, a, g)
            else:
                layer_sq = _linear_subject_sq(module, a, g, rows, slot, num)
                _, makers[name] = _linear_stats(module, a, g)
            sq = sq + layer_sq
        norms = sq.clamp(min=0).sqrt()
        per_example = weigh(norms)[inverse]
        return norms, self._assemble(params, makers, per_example)


def _subject_layout(
    inverse: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (subject) and slot (position within the subject) of every example."""
    order = torch.argsort(inverse, stable=True)
    sorted_rows = inverse[order]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(inverse.numel()) - starts[sorted_rows]
    return inverse, slot


def _pad_by_subject(
    t: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, num: int
) -> torch.Tensor:
    """(B, T, k) per-example tensors -> (subjects, max_count * T, k), zero padded."""
    width = int(slot.max()) + 1
    out = t.new_zeros(num, width, *t.shape[1:])
    out[rows, slot] = t
    return out.reshape(num, width * t.shape[1], *t.shape[2:])


def _linear_subject_sq(
    module: nn.Module,
    a: torch.Tensor,
    g: torch.Tensor,
    rows: torch.Tensor,
    slot: torch.Tensor,
    num: int,
) -> torch.Tensor:
    ap, gp = _pad_by_subject(a, rows, slot, num), _pad_by_subject(g, rows, slot, num)
    positions, d, p = ap.shape[1], ap.shape[2], gp.shape[2]
    if positions * positions <= p * d:
        sq = (torch.bmm(ap, ap.transpose(1, 2)) * torch.bmm(gp, gp.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.bmm(gp.transpose(1, 2), ap).pow(2).sum((1, 2))
    if getattr(module, "bias", None) is not None:
        sq = sq + gp.sum(1).pow(2).sum(1)
    return sq


def _embedding_subject_sq(
    idx: torch.Tensor, g: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, num: int
) -> torch.Tensor:
    ip = _pad_by_subject(idx.unsqueeze(-1), rows, slot, num).squeeze(-1)
    # padding has zero gradient, so its (arbitrary) token id contributes nothing
    gp = _pad_by_subject(g, rows, slot, num)
    same = (ip.unsqueeze(2) == ip.unsqueeze(1)).to(g.dtype)
    return (same * torch.bmm(gp, gp.transpose(1, 2))).sum((1, 2))


_CLIPPERS: weakref.WeakKeyDictionary[nn.Module, GhostClipper] = weakref.WeakKeyDictionary()


def clipper_for(model: nn.Module) -> GhostClipper:
    """The (cached) :class:`GhostClipper` of ``model``."""
    if model not in _CLIPPERS:
        _CLIPPERS[model] = GhostClipper(model)
    return _CLIPPERS[model]
