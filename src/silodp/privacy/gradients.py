"""Per-example gradients, clipping and per-subject averaging, vectorised.

Per-example gradients come from ``torch.func.vmap(grad(...))``; no Python loop over examples.
A per-subject average of clipped per-example gradients is a weighted sum of per-example
gradients with weight ``c_i / m_{a(i)}`` (``c_i`` the clip factor of example i, ``m_a`` the
number of examples of subject ``a`` in the batch), so it is computed with one ``index_add``
for the counts and one weighted reduction.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

__all__ = [
    "Params",
    "batch_gradient",
    "clip_factors",
    "clip_tree",
    "clipped_weighted_sum",
    "drop_non_finite",
    "per_example_gradients",
    "per_example_norms",
    "row_norms",
    "subject_average_weights",
    "tree_norm",
    "weighted_sum",
    "zero_rows",
]

Params = dict[str, torch.Tensor]

#: the margin :func:`clip_factors` and :func:`clip_tree` clip below ``clip``: a clipped
#: vector released in float32 rounds by at most 2^-24 relative per element (the factor and
#: the product), and its float64 norm errs by under 2^-53 per element, so C·(1 - 2^-20)
#: keeps the released norm at most C for any vector of fewer than 2^30 elements
CLIP_MARGIN = 2.0**-20


def _loss(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def batch_gradient(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    """Gradient of the mean cross-entropy over the batch."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        grads = torch.autograd.grad(_loss(model, leaves, x, y), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def per_example_gradients(
    model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor
) -> Params:
    """Gradient of each example's loss: a dict of tensors with a leading batch dimension."""

    def one(p: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return _loss(model, p, xi.unsqueeze(0), yi.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


#: columns of a block of rows that :func:`row_norms` converts to float64 at a time (a whole
#: 64 x 400k block converted at once took 30x the float32 norm; by 8192 columns, 3x)
WIDE_COLUMNS = 8192


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """L2 norm of each row of a 2-D tensor, in float64: every float32 element squares exactly
    there, so the norm errs by far less than :data:`CLIP_MARGIN` (a float32 norm can err by
    more, over long sums). Converted a block of :data:`WIDE_COLUMNS` columns at a time."""
    if rows.dtype == torch.float64 or rows.shape[1] <= WIDE_COLUMNS:
        return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)
    sq = torch.zeros(rows.shape[0], dtype=torch.float64)
    for j in range(0, rows.shape[1], WIDE_COLUMNS):
        block = rows[:, j : j + WIDE_COLUMNS]
        sq += torch.linalg.vector_norm(block, dim=1, dtype=torch.float64).square_()
    return sq.sqrt_()


def per_example_norms(grads: Params) -> torch.Tensor:
    """L2 norm of each example's full gradient (over all parameters), in float64
    (:func:`row_norms`)."""
    norms = [row_norms(g.reshape(g.shape[0], -1)) for g in grads.values()]
    return torch.linalg.vector_norm(torch.stack(norms), dim=0)


def tree_norm(tensors: Params) -> torch.Tensor:
    """L2 norm of a dict of tensors seen as one vector."""
    return torch.sqrt(sum((t.pow(2).sum() for t in tensors.values()), torch.tensor(0.0)))


def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, C' / ||g||)`` with ``C' = clip·(1 - CLIP_MARGIN)``: the scaling that keeps
    each clipped vector, as rounded to float32 or float64, at norm at most ``clip`` when
    ``norms`` are exact to within :data:`CLIP_MARGIN` (float64 norms of the vectors,
    :func:`per_example_norms`; the ghost clipper's rounding bounds). 0 where the norm is not
    finite (callers also drop that vector, see :func:`drop_non_finite`). Computed in float64
    and returned in the dtype of ``norms`` (floating, else torch's default)."""
    if not norms.is_floating_point():
        norms = norms.to(torch.get_default_dtype())
    values = norms.detach().numpy()
    wide = values.astype(np.float64, copy=False)
    limit = clip * (1.0 - CLIP_MARGIN)
    factors = np.minimum(limit / (wide + 1e-12), 1.0)
    factors = np.where(np.isfinite(wide), factors, 0.0)
    return torch.from_numpy(np.asarray(factors, values.dtype))


def drop_non_finite(values: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``values`` (a leading dimension of one row per norm) with the rows whose norm is not
    finite set to 0: such a row (a record's gradient, a subject's delta) then contributes
    nothing, rather than turning every weighted sum it enters into NaN (``0·inf``) — the
    whole message would otherwise depend on one record or subject."""
    bad = ~torch.isfinite(norms)
    return zero_rows(values, bad) if bool(bad.any()) else values


def zero_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values`` with the rows (leading dimension) marked in the bool mask ``rows`` set to 0."""
    return values.masked_fill(rows.view(-1, *[1] * (values.dim() - 1)), 0)


def subject_average_weights(factors: torch.Tensor, subjects: torch.Tensor) -> torch.Tensor:
    """Weights ``c_i / m_{a(i)}`` that turn a weighted sum into a sum of subject averages.

    Args:
      factors: per-example clip factors ``c_i``.
      subjects: subject id of each example (any integers).
    """
    _, inverse = torch.unique(subjects, return_inverse=True)
    counts = torch.zeros(int(inverse.max()) + 1, dtype=factors.dtype)
    counts.index_add_(0, inverse, torch.ones_like(factors))
    return factors / counts[inverse]


def weighted_sum(grads: Params, weights: torch.Tensor) -> Params:
    """``sum_i w_i g_i`` for each parameter tensor (in the dtype of ``g``)."""
    return {name: torch.tensordot(weights.to(g.dtype), g, dims=1) for name, g in grads.items()}


def clip_tree(tensors: Params, clip: float) -> Params:
    """``tensors`` (one vector) scaled so that the vector released, as rounded to its dtype,
    has L2 norm at most ``clip``: the norm is taken in float64 and a vector within
    :data:`CLIP_MARGIN` of ``clip`` is scaled to ``clip·(1 - CLIP_MARGIN)`` (a clip to the
    exact norm in float32 left up to ~1e-7 relative above ``clip``). All zeros when its norm
    is not finite (see :func:`drop_non_finite`)."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))
    if not math.isfinite(norm):
        return {name: torch.zeros_like(t) for name, t in tensors.items()}
    limit = clip * (1.0 - CLIP_MARGIN)
    if norm <= limit:
        return {name: t.clone() for name, t in tensors.items()}
    factor = limit / norm
    return {name: t * factor for name, t in tensors.items()}


def clipped_weighted_sum(grads: Params, norms: torch.Tensor, weights: torch.Tensor) -> Params:
    """``sum_i w_i g_i`` over the rows whose norm is finite (:func:`drop_non_finite`)."""
    return {
        name: torch.tensordot(weights.to(g.dtype), drop_non_finite(g, norms), dims=1)
        for name, g in grads.items()
    }
