"""A model's ``forward`` as a chain of stock layers, traced with ``torch.fx``.

The fast paths that run a model's arithmetic themselves (:mod:`silodp.privacy.stacked`, the
grouped copies of a CNN; :mod:`silodp.privacy.dense_chain`, hand-written passes of an MLP)
accept only models whose ``forward`` is a chain: each operation takes the previous one's
output and nothing else, and is one of ``Conv2d`` (no groups, zero padding), ``Linear``,
ReLU, ``MaxPool2d`` and ``flatten(1)``. :func:`trace` returns that chain, or ``None`` for
anything else, including a model that would not compute what its trace says: hooks (its
modules' or global ones), parametrizations, subclassed or patched layers, tied weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn import functional as F

__all__ = ["Op", "altered", "trace"]

_RELU = (torch.relu, F.relu)


@dataclass(frozen=True)
class Op:
    """One step of the chain: ``kind`` in conv, linear, relu, maxpool, flatten."""

    kind: str
    module: nn.Module | None = None  # conv / linear / maxpool: its settings
    prefix: str = ""  # parameter names are prefix + "weight" / "bias"


def trace(model: nn.Module) -> list[Op] | None:
    """The chain of ``model``'s forward (see the module docstring), or ``None``."""
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - an untraceable model is not a chain
        return None
    modules = dict(model.named_modules())
    ops: list[Op] = []
    current: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if current is not None:
                return None
            current = node
            continue
        if node.op == "output":
            if node.args[0] is not current:
                return None
            break
        if current is None or len(current.users) != 1 or not node.args:
            return None
        if node.args[0] is not current or any(
            isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())
        ):
            return None
        op = _op_of(node, modules)
        if op is None:
            return None
        ops.append(op)
        current = node
    if altered(model, ops):
        return None
    return ops


def _op_of(node: fx.Node, modules: dict[str, nn.Module]) -> Op | None:
    """The supported operation ``node`` runs, or ``None``."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        prefix = f"{node.target}."
        if type(module) not in _STOCK:
            return None  # a subclass may compute something else
        if isinstance(module, nn.Conv2d):
            plain = module.groups == 1 and module.padding_mode == "zeros"
            if plain and not isinstance(module.padding, str):
                return Op("conv", module, prefix)
            return None
        if isinstance(module, nn.Linear):
            return Op("linear", module, prefix)
        if isinstance(module, nn.ReLU):
            return Op("relu")
        if isinstance(module, nn.MaxPool2d) and not module.return_indices:
            return Op("maxpool", module)
        if isinstance(module, nn.Flatten) and module.start_dim == 1 and module.end_dim == -1:
            return Op("flatten")
        return None
    rest = [*node.args[1:]]
    if node.op == "call_function" and node.target in _RELU and not rest:
        return None if node.kwargs.get("inplace") else Op("relu")
    if node.op == "call_method" and node.target == "relu" and not rest and not node.kwargs:
        return Op("relu")
    flatten_args = rest == [1] or node.kwargs in ({"start_dim": 1},)
    if node.op == "call_method" and node.target == "flatten" and flatten_args:
        return Op("flatten") if len(rest) + len(node.kwargs) == 1 else None
    if node.op == "call_function" and node.target is torch.flatten and flatten_args:
        return Op("flatten") if len(rest) + len(node.kwargs) == 1 else None
    return None


#: the module types a chain may hold (exactly these, not subclasses): what the fast paths
#: reimplement
_STOCK = (nn.Conv2d, nn.Linear, nn.ReLU, nn.MaxPool2d, nn.Flatten)


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` has hooks or parametrizations, which tracing would not keep."""
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    return any(hooks) or hasattr(module, "parametrizations")


def _methods(cls: type) -> dict[str, object]:
    """The methods ``cls`` defines or inherits below ``nn.Module``."""
    out: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        if issubclass(base, nn.Module) and base is not nn.Module:
            out.update({k: v for k, v in vars(base).items() if callable(v)})
    return out


#: the stock layers' methods as imported (a class-level patch changes what they compute)
_PRISTINE: dict[type, dict[str, object]] = {cls: _methods(cls) for cls in _STOCK}


def _patched(module: nn.Module) -> bool:
    """Whether ``module`` has an instance attribute shadowing a method of its class (e.g.
    ``forward``, ``_conv_forward``, ``_call_impl``), or is a stock layer whose class methods
    were replaced since import: tracing follows the class, training the instance."""
    cls = type(module)
    if any(callable(v) and hasattr(cls, k) for k, v in vars(module).items()):
        return True
    pristine = _PRISTINE.get(cls)
    return pristine is not None and _methods(cls) != pristine


def altered(model: nn.Module, ops: list[Op]) -> bool:
    """Whether running ``model`` would differ from its traced chain of stock layers: hooks
    (its modules' or global ones), patched methods, or tied weights (a parameter shared by
    two layers appears once in ``named_parameters``)."""
    if any(_hooked(m) for m in model.modules()) or _global_hooks():
        return True
    if _patched(model) or any(op.module is not None and _patched(op.module) for op in ops):
        return True
    named = dict(model.named_parameters())
    return any(
        op.prefix and getattr(op.module, p, None) is not None and f"{op.prefix}{p}" not in named
        for op in ops
        for p in ("weight", "bias")
    )


def _global_hooks() -> bool:
    """Whether hooks registered for every module (``register_module_*_hook``) are active."""
    from torch.nn.modules import module as base

    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    return any(getattr(base, name, None) for name in names)
