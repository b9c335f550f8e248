"""The forward and backward passes of an MLP, written out.

Ghost clipping (:mod:`silodp.privacy.ghost`) needs every linear layer's inputs ``a`` and
output gradients ``g`` of ``Σ_i s_i·CE(f(x_i), y_i)``. For any model it records them with
forward hooks and ``autograd.grad``; for a small MLP that machinery costs more than the
arithmetic (measured on the 4,810-parameter ``mlp`` at 64 records: ~0.17 ms of hooks,
functional call and autograd against ~0.05 ms for the same passes written out).

:class:`DenseChain` writes them out for models whose ``forward`` is a chain
(:func:`silodp.privacy.chain.trace`) of an optional ``flatten(1)`` followed by ``Linear``
layers and ReLUs::

    forward   a_k = input of linear k,  z = a_k Wᵀ + b,  ReLU: h = max(z, 0)
    loss      ∂/∂logits Σ_i s_i CE_i = s_i (softmax(logits_i) - onehot(y_i))
    backward  g_k = gradient at linear k's output; through linear k: g Wₖ;
              through a ReLU: g where its output is > 0, else 0 (``threshold_backward``,
              as autograd)

The gradients equal autograd's up to floating-point rounding. The clipping guarantee does
not depend on them being exact: norms and sums are both computed from the same ``(a, g)``.

Only ``nn.Sequential``, :class:`silodp.models.MLP` and :class:`silodp.models.Linear` (exactly
these types, holding only ``Linear``, ``ReLU`` and ``Flatten`` modules) are traced: their
``forward`` has no branch on attributes and no side effect, so the traced chain stays what
the model computes as long as its modules stay the same, which the ghost clipper checks on
every call (:func:`silodp.privacy.ghost.clipper_for`). :meth:`DenseChain.capture` also
re-checks that the model has no hooks or patched layers since
(:func:`silodp.privacy.chain.altered`) and returns ``None`` (the caller keeps the hooks) for
those, for inputs that are not one row per record after the flatten, and for labels
outside ``[0, classes)`` (so the hooks' path raises or ignores them exactly as
``F.cross_entropy`` does).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from silodp.privacy import chain
from silodp.privacy.chain import Op
from silodp.privacy.gradients import Params

__all__ = ["DenseChain"]

#: one captured layer: its name, the module, its inputs ``(B, d)``, its output gradients
#: ``(B, p)``
Captured = tuple[str, nn.Module, torch.Tensor, torch.Tensor]


class DenseChain:
    """A traced MLP: optional ``flatten(1)``, then ``Linear`` layers and ReLUs."""

    def __init__(self, model: nn.Module, ops: list[Op]) -> None:
        self.model = model
        self.ops = ops
        self.flatten = ops[0].kind == "flatten"
        self._body = ops[1:] if self.flatten else ops

    @classmethod
    def trace(cls, model: nn.Module) -> DenseChain | None:
        """The chain of ``model``, or ``None`` if it is not an MLP as above."""
        from silodp.models import MLP, Linear

        # any other forward (the model's or a nested module's) may branch on attributes or
        # have side effects, which a trace would freeze
        known = (nn.Sequential, MLP, Linear, nn.Linear, nn.ReLU, nn.Flatten)
        if type(model) not in (nn.Sequential, MLP, Linear) or any(
            type(m) not in known for m in model.modules()
        ):
            return None
        ops = chain.trace(model)
        if not ops:
            return None
        body = ops[1:] if ops[0].kind == "flatten" else ops
        kinds = {op.kind for op in body}
        if "linear" not in kinds or not kinds <= {"linear", "relu"}:
            return None
        linear = [op.prefix for op in body if op.kind == "linear"]
        if len(set(linear)) != len(linear):
            return None  # a layer applied twice: the hooks' path sums its calls
        return cls(model, ops)

    @property
    def body(self) -> list[Op]:
        """The chain after the optional flatten: ``Linear`` and ``ReLU`` ops."""
        return self._body

    def altered(self) -> bool:
        """Whether the model has hooks or patched layers since it was traced."""
        return chain.altered(self.model, self.ops)

    def capture(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None
    ) -> list[Captured] | None:
        """Every linear layer's ``(name, module, a, g)`` for the loss
        ``Σ_i scale_i·CE(f(x_i), y_i)`` (``scale`` ``None``: all 1), in chain order; ``None``
        where this path does not apply (see the module docstring)."""
        if self.altered():
            return None
        h = x.flatten(1) if self.flatten else x
        if h.dim() != 2 or y.dim() != 1 or y.dtype != torch.long or y.numel() != h.shape[0]:
            return None
        with torch.no_grad():
            inputs: list[torch.Tensor] = []  # per op: its input (linear) or output (relu)
            for op in self._body:
                if op.kind == "linear":
                    inputs.append(h)
                    h = F.linear(h, params[op.prefix + "weight"], _bias(params, op))
                else:
                    h = torch.relu(h)
                    inputs.append(h)
            if h.dim() != 2 or h.shape[0] != y.shape[0]:
                return None
            if y.numel():
                low, high = (int(v) for v in torch.aminmax(y))
                if low < 0 or high >= h.shape[1]:
                    return None
            g = torch.softmax(h, dim=1)
            g[torch.arange(y.numel()), y] -= 1.0
            if scale is not None:
                g.mul_(scale.to(g.dtype).unsqueeze(1))
            out: list[Captured] = []
            last = next(i for i, op in enumerate(self._body) if op.kind == "linear")
            for i in range(len(self._body) - 1, last - 1, -1):
                op = self._body[i]
                if op.kind == "relu":
                    g = torch.ops.aten.threshold_backward(g, inputs[i], 0)
                    continue
                assert op.module is not None
                out.append((op.prefix[:-1], op.module, inputs[i], g))
                if i > last:
                    g = g @ params[op.prefix + "weight"]
        out.reverse()
        return out


def _bias(params: Params, op: Op) -> torch.Tensor | None:
    module = op.module
    assert isinstance(module, nn.Linear)
    return None if module.bias is None else params[op.prefix + "bias"]
