"""Per-example gradient norms and clipped sums without materialising per-example gradients.

For a layer ``y = W a (+ b)`` applied at positions ``t`` (sequence steps, conv patches), the
gradient of example i is ``G_i = Σ_t g_{i,t} a_{i,t}^T``. One forward and one backward pass give
every layer's inputs ``a`` and output gradients ``g``; from them, per layer:

* materialised per-example gradients ``G_i`` (``T·p·d`` per example), whose norms, per-subject
  sums and weighted sum are then cheap — for ``Conv2d`` (one grouped weight-gradient
  convolution with the batch folded into the groups, no unfold) unless they exceed
  ``PER_EXAMPLE_LIMIT`` elements, for ``Linear`` where they cost fewer flops than
* Gram matrices, ``||G_i||² = Σ_{t,t'} (a_t·a_t')(g_t·g_t')`` (``T²·(d+p)``; ``||g_i||²·||a_i||²``
  when there is one position), with the weighted sum ``Σ_i w_i G_i`` as one contraction.

So DP-SGD (``w_i = c_i``) and HiGradAvgDP (``w_i = c_i / m_{a(i)}``, a per-subject average of
clipped gradients) cost about one plain training step plus these contractions. Supported
layers: ``Linear``, ``Conv2d`` (any stride/padding/dilation, ``groups=1``), ``Embedding``; the
LSTM of :mod:`silodp.models` is built from ``Linear`` layers for this reason. A model with any
other parametrised layer falls back to exact ``vmap`` per-example gradients, with a warning
naming the layer.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.nn.grad import conv2d_weight

from silodp.privacy.dense_chain import DenseChain
from silodp.privacy.gradients import (
    Params,
    clip_factors,
    clipped_weighted_sum,
    per_example_gradients,
    per_example_norms,
    zero_rows,
)

if TYPE_CHECKING:
    from silodp.privacy.dense_kernel import DenseKernel

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
    #: the tensors' version counters when recorded (an in-place operation bumps them)
    versions: list[int] = field(default_factory=list)

    def modified(self) -> bool:
        """Whether a recorded input or output was changed in place after it was recorded."""
        tensors = [t for pair in zip(self.inputs, self.outputs, strict=True) for t in pair]
        return any(t._version != v for t, v in zip(tensors, self.versions, strict=True))


Maker = Callable[[torch.Tensor], dict[str, torch.Tensor]]
#: subjects -> squared norms of the per-subject summed gradients, one per subject row
SubjectSq = Callable[["_Subjects"], torch.Tensor]
#: per layer: the module, the inputs of each of its calls, and the gradients of their outputs
Captured = dict[str, tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]]]

#: per-example gradients of one layer are materialised only below this many elements
PER_EXAMPLE_LIMIT = 1 << 27
#: ... and a convolution's are computed a batch slice of at most this many bytes at a time:
#: glibc's malloc unmaps freed blocks above its mmap threshold (32 MiB at most), so one
#: larger tensor per step costs a fresh mapping and a page fault per 4 KiB on every step
PIECE_BYTES = 16 * 2**20
#: subjects with at most this many records may be "small" (see :class:`_Subjects`; the limit
#: of a model is where pairs cost about as much as gradients, :func:`_small_limit`)
SMALL_SUBJECT = 64
#: larger subjects are cut into chunks of this many records (see :class:`_Subjects`)
SUBJECT_CHUNK = 32
#: per-subject passes hold at most about this many bytes of captured activations and output
#: gradients (and at least ``max_batch`` records)
PASS_BYTES = 8 * 2**20
#: where a model's layers are all one-position linear layers and ``B²·Σ(d + p)`` is at most
#: this, one masked Gram matrix of the batch gives every subject's norm in a few operations
#: (:func:`_dense_subject_sq`); listing pairs and chunks costs a few dozen (measured on the
#: 4,810-parameter mlp at 64 records: 39 µs against 136 µs with Zipf subjects, the same with
#: uniform ones)
DENSE_GRAM_MACS = 1 << 20


#: the pairs ``i < j`` of ``SMALL_SUBJECT`` slots ordered by ``j``: a subject of ``n`` records
#: has the first ``n(n-1)/2`` of them
_PAIR_J, _PAIR_I = np.tril_indices(SMALL_SUBJECT, -1)


class _Subjects:
    """The subjects of a batch, laid out once for every layer.

    ``inverse`` maps every record to its subject row ``0..num-1``. Subjects with at most
    ``small`` records are "small": their records' pairs ``i < j`` are listed
    (``pair_i``, ``pair_j``, ``pair_subject``). Larger ones are "big": cut into chunks of
    :data:`SUBJECT_CHUNK` records (``chunks``, record indices with ``batch`` standing for a
    zero row; ``owner``, the big subject of each chunk). The bookkeeping runs in numpy: a few
    dozen operations on arrays of a few hundred integers.
    """

    def __init__(
        self, inverse: torch.Tensor, counts: torch.Tensor, small: int = SMALL_SUBJECT
    ) -> None:
        if not 1 <= small <= SMALL_SUBJECT:
            raise ValueError(f"Expected small={small} in [1, {SMALL_SUBJECT}].")
        self.inverse = inverse
        inv, n = inverse.numpy(), counts.numpy()
        self.num, self.batch = int(n.size), int(inv.size)
        order = np.argsort(inv, kind="stable")  # records grouped by subject
        starts = np.cumsum(n) - n
        m = n * (n - 1) // 2  # pairs per subject
        big = n > small
        empty = torch.zeros(0, dtype=torch.long)
        self.pair_i = self.pair_j = self.pair_subject = empty
        self.big_ids = self.chunks = self.owner = empty
        self.num_chunks = 0
        #: records of subjects that are not big (``None``: all records)
        self.unbig_rows: torch.Tensor | None = None
        if big.any():
            self._big(np.flatnonzero(big), n, starts, order)
            self.unbig_rows = torch.from_numpy(np.flatnonzero(~big[inv]))
            m[big] = 0
        pairs = int(m.sum())
        if pairs:
            ids = np.flatnonzero(m)
            m = m[ids]
            slot = np.arange(pairs) - np.repeat(np.cumsum(m) - m, m)
            first = np.repeat(starts[ids], m)
            self.pair_i = torch.from_numpy(order[first + _PAIR_I[slot]])
            self.pair_j = torch.from_numpy(order[first + _PAIR_J[slot]])
            self.pair_subject = torch.from_numpy(np.repeat(ids, m))
        self._ones: torch.Tensor | None = None

    def _big(self, big: np.ndarray, n: np.ndarray, starts: np.ndarray, order: np.ndarray) -> None:
        self.big_ids = torch.from_numpy(big)
        per = -(-n[big] // SUBJECT_CHUNK)  # chunks per big subject
        owner = np.repeat(np.arange(big.size), per)
        block = np.arange(owner.size) - np.repeat(np.cumsum(per) - per, per)
        offset = block[:, None] * SUBJECT_CHUNK + np.arange(SUBJECT_CHUNK)
        at = np.minimum(starts[big][owner][:, None] + offset, self.batch - 1)
        chunks = np.where(offset < n[big][owner][:, None], order[at], self.batch)
        self.chunks = torch.from_numpy(chunks.reshape(-1))
        self.owner = torch.from_numpy(owner)
        self.num_chunks = int(owner.size)

    def ones(self, like: torch.Tensor) -> torch.Tensor:
        """A (batch, 1) column of ones (the constant input of a bias), shared by the layers."""
        if self._ones is None or self._ones.dtype != like.dtype:
            self._ones = like.new_ones(self.batch, 1)
        return self._ones


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 (itself if it already is). Norms are formed from activations and
    output gradients separately: in float32 a gradient entry below 2^-75 squares to 0 while
    its product with a large activation does not, so the norm of ``g aᵀ`` could vanish (and
    a gradient of ~1e19 overflow); every float32 value squares exactly within float64's
    range."""
    return t if t.dtype == torch.float64 else t.double()


def _as(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype of the weights ``w`` (float64 where the release must be, see
    :func:`_release_dtype`; itself otherwise)."""
    return t if t.dtype == w.dtype else t.to(w.dtype)


def _subject_bias_sq(bias: torch.Tensor, inverse: torch.Tensor, num: int) -> torch.Tensor:
    """Squared norms (float64) of the per-subject sums of a layer's bias gradients."""
    wide = _wide(bias)
    return wide.new_zeros(num, wide.shape[1]).index_add_(0, inverse, wide).pow(2).sum(1)


@dataclass
class _Stats:
    """One layer's share of a clipped sum: squared per-example norms, per-subject squared
    norms on demand, and the weighted sum of its per-example gradients."""

    sq: torch.Tensor
    subject_sq: SubjectSq
    weighted: Maker
    #: a one-position linear layer's inputs, output gradients and whether it has a bias: its
    #: per-subject norms are computed with the model's other such layers (``_subject_sq``)
    rows: tuple[torch.Tensor, torch.Tensor, bool] | None = None
    #: with ``rows``: each record's ``||g||`` and ``||[a, 1]||`` (float64)
    row_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    #: where ``sq`` is a Gram sum over positions, ``Σ_t ||g_t||·||a_t||`` per example (the
    #: scale of its rounding error, see :func:`_norm_bounds`); ``None`` where ``sq`` is the
    #: norm of the very per-example vector the weighted sum adds, or a product of norms
    mag: torch.Tensor | None = None
    #: the longest sum of products behind ``sq`` and the per-subject routes' Gram entries
    terms: int = 0
    #: positions per example (a subject's Gram sums run over its records' positions)
    positions: int = 1
    #: the largest input norm (a record's, or a position's) of a layer whose release
    #: multiplies ``w·g`` by ``a``, as a 0-dim float64 tensor (see :func:`_release_dtype`)
    a_scale: torch.Tensor | None = None


def _per_example_stats(
    shape: torch.Size, pieces: list[torch.Tensor], bias: torch.Tensor | None
) -> _Stats:
    """Stats from materialised per-example weight gradients, given as consecutive batch
    slices ``(b_i, p, d)`` (see :data:`PIECE_BYTES`), and bias gradients."""
    flats = [piece.reshape(piece.shape[0], -1) for piece in pieces]
    bounds = [0]
    for flat in flats:
        bounds.append(bounds[-1] + flat.shape[0])
    slices = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    # norms without a squared copy of the gradients (of the very vectors ``weighted`` adds),
    # in float64 like the other layers' norms
    norms = [torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64) for flat in flats]
    sq = torch.cat(norms).square_()
    if bias is not None:
        sq = sq + torch.linalg.vector_norm(bias, dim=1, dtype=torch.float64).square_()

    def subject_sq(subjects: _Subjects) -> torch.Tensor:
        inverse, num = subjects.inverse, subjects.num
        # per-subject sums a block of columns at a time, each block under PIECE_BYTES
        columns = flats[0].shape[1]
        block = max(1, PIECE_BYTES // (max(num, 1) * flats[0].element_size()))
        out = torch.zeros(num, dtype=torch.float64)
        for lo in range(0, columns, block):
            cols = slice(lo, min(lo + block, columns))
            summed = flats[0].new_zeros(num, cols.stop - lo)
            for flat, part in zip(flats, slices, strict=True):
                summed.index_add_(0, inverse[part], flat[:, cols])
            out += torch.linalg.vector_norm(summed, dim=1, dtype=torch.float64).square_()
        if bias is not None:
            out = out + _subject_bias_sq(bias, inverse, num)
        return out

    def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = flats[0].dtype
        parts = [_as(flat, w) for flat in flats]
        total = w[slices[0]] @ parts[0]
        for flat, part in zip(parts[1:], slices[1:], strict=True):
            total.addmv_(flat.T, w[part])
        out = {"weight": total.reshape(shape).to(dtype)}
        if bias is not None:
            out["bias"] = (w @ _as(bias, w)).to(dtype)
        return out

    return _Stats(sq, subject_sq, weighted)


def _conv_stats(module: nn.Conv2d, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> _Stats:
    """Conv2d: per-example weight gradients from grouped weight-gradient convolutions (the
    batch folded into groups, a slice of at most :data:`PIECE_BYTES` at a time), unless they
    would be too large (then Gram matrices)."""
    weight = cast(torch.Tensor, module.weight)
    batch, (p, cin, kh, kw) = inputs[0].shape[0], weight.shape
    if batch * p * cin * kh * kw > PER_EXAMPLE_LIMIT:
        pairs = [_positions(module, a, g) for a, g in zip(inputs, grads, strict=True)]
        return _linear_stats(module, _cat([a for a, _ in pairs]), _cat([g for _, g in pairs]))
    padding = cast(tuple[int, ...], module.padding)  # string padding is unsupported
    step = max(1, PIECE_BYTES // (p * cin * kh * kw * weight.element_size()))
    pieces = []
    for lo in range(0, batch, step):
        width = min(step, batch - lo)
        piece = None
        for a, g in zip(inputs, grads, strict=True):
            one = conv2d_weight(
                a[lo : lo + width].reshape(1, width * cin, *a.shape[2:]),
                (width * p, cin, kh, kw),
                g[lo : lo + width].reshape(1, width * p, *g.shape[2:]),
                stride=module.stride,
                padding=padding,
                dilation=module.dilation,
                groups=width,
            ).reshape(width, p, -1)
            piece = one if piece is None else piece.add_(one)
        assert piece is not None
        pieces.append(piece)
    bias = None
    if module.bias is not None:
        bias = sum(g.sum(dim=(2, 3)) for g in grads)
    return _per_example_stats(weight.shape, pieces, cast(torch.Tensor | None, bias))


def _positions(
    module: nn.Module, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, d) inputs and (B, T, p) output gradients of a Linear or Conv2d call."""
    batch = a.shape[0]
    if isinstance(module, nn.Conv2d):
        padding = cast(tuple[int, ...], module.padding)
        cols = F.unfold(
            a, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
        )  # (B, d, T)
        return cols.transpose(1, 2), g.reshape(batch, g.shape[1], -1).transpose(1, 2)
    return a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Positions of several calls side by side (no copy for a single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _linear_stats(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> _Stats:
    """Linear (or unfolded conv) layer with (B, T, d) inputs and (B, T, p) output gradients.

    Per-example gradients cost ``T·p·d`` per example, Gram matrices ``T²·(d+p)``: the cheaper
    is used (one position: ``||g||²·||a||²``).
    """
    batch, positions, d = a.shape
    p = g.shape[2]
    shape = cast(torch.Tensor, module.weight).shape
    has_bias = getattr(module, "bias", None) is not None
    a1, g1 = a[:, 0], g[:, 0]
    bias = (g1 if positions == 1 else g.sum(1)) if has_bias else None
    if positions > 1 and p * d <= positions * (d + p) and batch * p * d <= PER_EXAMPLE_LIMIT:
        return _per_example_stats(shape, [torch.bmm(g.transpose(1, 2), a)], bias)
    # norms in float64 (see :func:`_wide`); ``weighted`` uses a and g as they are
    if positions == 1:
        # ||g aᵀ||² + ||g||² = ||g||²·(||a||² + 1), the norms taken in float64 on the fly
        a_norm = torch.linalg.vector_norm(a1, dim=1, dtype=torch.float64)
        if has_bias:
            a_norm = torch.hypot(a_norm, torch.ones_like(a_norm))
        g_norm = torch.linalg.vector_norm(g1, dim=1, dtype=torch.float64)
        sq = (g_norm * a_norm).square_()
    else:
        aw, gw = _wide(a), _wide(g)
        sq = (torch.bmm(aw, aw.transpose(1, 2)) * torch.bmm(gw, gw.transpose(1, 2))).sum(dim=(1, 2))
        if bias is not None:
            sq = sq + torch.linalg.vector_norm(bias, dim=1, dtype=torch.float64).square_()

    def subject_sq(subjects: _Subjects) -> torch.Tensor:
        inverse, num = subjects.inverse, subjects.num
        width = int(torch.bincount(inverse, minlength=num).max()) if positions == 1 else 0
        if positions == 1 and num * p * d <= batch * batch and width * p * d <= batch * (d + p):
            # per-subject gradients Σ_{i∈a} g_i a_iᵀ from subjects' rows padded to the
            # largest subject, a few subjects at a time (when they are fewer elements than
            # the Gram matrix and cost fewer flops)
            out = _wide(_padded_subject_grad_sq(a1, g1, inverse, num))
        elif positions == 1:
            # ||Σ_{i∈a} g_i a_iᵀ||² = Σ_{i,j∈a} (g_i·g_j)(a_i·a_j): a masked B×B Gram matrix
            a1w, g1w = _wide(a1), _wide(g1)
            gram = (a1w @ a1w.T) * (g1w @ g1w.T)
            rows = gram.new_zeros(num, batch).index_add_(0, inverse, gram)  # Σ_{i∈a} K_ij
            same = rows[inverse, torch.arange(batch)]  # Σ_{i∈a(j)} K_ij
            out = gram.new_zeros(num).index_add_(0, inverse, same)
        else:
            out = _padded_subject_sq(_wide(a), _wide(g), inverse, num)
        if bias is not None:
            out = out + _subject_bias_sq(bias, inverse, num)
        return out

    def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = g.dtype
        ga, aa = _as(g, w), _as(a, w)
        if positions == 1:
            weight = (ga[:, 0] * w[:, None]).T @ aa[:, 0]
        else:
            weight = torch.einsum("b,btp,btd->pd", w, ga, aa)
        out = {"weight": weight.reshape(shape).to(dtype)}
        if bias is not None:
            out["bias"] = (w @ _as(bias, w)).to(dtype)
        return out

    if positions == 1:
        return _Stats(
            sq,
            subject_sq,
            weighted,
            (a1, g1, has_bias),
            (g_norm, a_norm),
            terms=d + p + 2,
            a_scale=a_norm.max() if batch else None,
        )
    norms_a = torch.linalg.vector_norm(a, dim=2, dtype=torch.float64)
    if has_bias:  # the bias's input 1 beside every position's a
        norms_a = torch.hypot(norms_a, torch.ones_like(norms_a))
    mag = (norms_a * torch.linalg.vector_norm(g, dim=2, dtype=torch.float64)).sum(1)
    terms = d + p + _grid_terms(positions) + 2
    return _Stats(
        sq,
        subject_sq,
        weighted,
        mag=mag,
        terms=terms,
        positions=positions,
        a_scale=norms_a.max() if batch else None,
    )


def _grid_terms(positions: int) -> int:
    """The rounding length of summing a ``T × T`` Gram product: ``T²`` recursively, but
    torch reduces floating-point tensors in a cascade, no worse than a row sum followed by a
    column sum (``2T``) once ``T`` passes a few dozen."""
    return min(positions**2, 2 * positions + 64)


#: a written element costs about this many flops (in the cost model of the routes)
WRITE_COST = 4


def _linear_subject_sq(
    subjects: _Subjects,
    layers: list[tuple[torch.Tensor, torch.Tensor, bool]],
    sq: torch.Tensor,
    norms: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, bool] | None:
    """Squared norms of the per-subject sums ``Σ_{i∈S} g_i a_iᵀ`` (and ``Σ_{i∈S} g_i`` with a
    bias), summed over one-position linear layers, given their summed per-example squared
    norms ``sq``, and whether the pairs' dot products were taken in float32 (their rounding
    then counts in :func:`_norm_bounds`); ``None`` when the big subjects' chunks would cost
    more than a layer's whole-batch Gram matrix or need more than :data:`PER_EXAMPLE_LIMIT`
    elements.

    A bias is folded in as a constant input 1. Small subjects (see :class:`_Subjects`) by the
    Gram route over their pairs, ``||G_S||² = Σ_{i∈S} sq_i + 2 Σ_{i<j∈S} (a_i·a_j)(g_i·g_j)``:
    the records of every pair gathered once for all layers, multiplied, and the products'
    per-layer sums taken by one matrix product with a 0/1 column selector. Big subjects by
    their gradients, one batched matrix product per layer over chunks of their records,
    summed per subject.
    """
    widths = [(g.shape[1], a.shape[1] + int(bias)) for a, g, bias in layers]
    if subjects.num_chunks:
        for p, d in widths:
            elements = subjects.num_chunks * p * d
            cost = elements * (SUBJECT_CHUNK + 2 * WRITE_COST)
            if elements > PER_EXAMPLE_LIMIT or cost > subjects.batch**2 * (d + p):
                return None
    pairs = int(subjects.pair_i.numel())
    if pairs * sum(p + d for p, d in widths) * layers[0][0].element_size() > PIECE_BYTES:
        return None
    ones = subjects.ones(layers[0][1])
    # rows [g_i, a_i, (1)] of every layer side by side, then a zero row (chunks' padding)
    columns = []
    for a, g, bias in layers:
        columns += [g, a, ones] if bias else [g, a]
    # in the activations' dtype: the chunks' products are materialised gradients (their
    # rounding is in the bound's release term)
    padded = layers[0][0].new_empty(subjects.batch + 1, sum(p + d for p, d in widths))
    rows = torch.cat(columns, dim=1, out=padded[: subjects.batch])
    padded[subjects.batch] = 0.0
    inverse, total = subjects.inverse, sq
    if subjects.unbig_rows is not None:  # big subjects' norms come from their gradients
        inverse = inverse.index_select(0, subjects.unbig_rows)
        total = total.index_select(0, subjects.unbig_rows)
    out = sq.new_zeros(subjects.num).index_add_(0, inverse, total)
    narrow = False
    if pairs:
        # columns -> per layer (2 (g_i·g_j), a_i·a_j)
        # (layers, 2, columns): row (k, 0) sums layer k's g columns (times 2), (k, 1) its a
        select = np.zeros((len(layers), 2, rows.shape[1]))
        at = 0
        for k, (p, d) in enumerate(widths):
            select[k, 0, at : at + p] = 2.0
            select[k, 1, at + p : at + p + d] = 1.0
            at += p + d
        # the dot products in the rows' dtype where every record's blocks have norms in
        # [2^-40, 2^40] (or are 0), so no entry that matters under- or overflows when squared
        # (their rounding is in _norm_bounds' γ), else in float64
        narrow = _moderate(norms)
        base = rows if narrow else _wide(rows)
        first, second = _pair_buffers(int(subjects.pair_i.numel()), base.shape[1], base.dtype)
        products = torch.index_select(base, 0, subjects.pair_i, out=first)
        products.mul_(torch.index_select(base, 0, subjects.pair_j, out=second))
        # (2·layers, pairs): the selector on the left is the fast orientation of this product
        dots = torch.mm(
            torch.as_tensor(select.reshape(2 * len(layers), -1), dtype=products.dtype), products.T
        )
        dots = _wide(dots)
        cross = (dots[0::2] * dots[1::2]).sum(0)
        out.index_add_(0, subjects.pair_subject, cross)
    if subjects.num_chunks:
        blocks = padded.index_select(0, subjects.chunks).view(
            subjects.num_chunks, SUBJECT_CHUNK, -1
        )
        grads = []
        at = 0
        for p, d in widths:
            gb, ab = blocks[..., at : at + p], blocks[..., at + p : at + p + d]
            grads.append(torch.bmm(gb.transpose(1, 2), ab).view(subjects.num_chunks, -1))
            at += p + d
        flat = grads[0] if len(grads) == 1 else torch.cat(grads, dim=1)
        summed = flat.new_zeros(int(subjects.big_ids.numel()), flat.shape[1])
        summed.index_add_(0, subjects.owner, flat)
        big = torch.linalg.vector_norm(summed, dim=1, dtype=torch.float64).square_()
        out.index_copy_(0, subjects.big_ids, big)
    return out, narrow and rows.dtype != torch.float64


_BUFFERS = threading.local()


def _pair_buffers(pairs: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``(pairs, width)`` tensors for the pairs' gathered rows, views of buffers kept
    per thread and dtype and grown as needed (at most :data:`PIECE_BYTES` each): allocated
    afresh every step, blocks of this size (~1 MB for the mlp at 512 records) were returned
    to the kernel and faulted in again, ~300 page faults and 0.4-0.6 ms a step."""
    kept = getattr(_BUFFERS, "pairs", None)
    if kept is None:
        kept = _BUFFERS.pairs = {}
    size = pairs * width
    buffers = kept.get(dtype)
    if buffers is None or buffers[0].numel() < size:
        buffers = kept[dtype] = (torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype))
    return (buffers[0][:size].view(pairs, width), buffers[1][:size].view(pairs, width))


#: below or above these norms, a record's rows go to float64 for the pairs' dot products
MODERATE_NORMS = (2.0**-40, 2.0**40)


def _moderate(norms: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every nonzero block norm lies in :data:`MODERATE_NORMS`."""
    stacked = torch.cat([torch.cat(pair) for pair in norms])
    stacked = stacked[stacked != 0]
    if not stacked.numel():
        return True
    low, high = (float(v) for v in torch.aminmax(stacked))
    return MODERATE_NORMS[0] <= low and high <= MODERATE_NORMS[1]


def _embedding_stats(module: nn.Embedding, idx: torch.Tensor, g: torch.Tensor) -> _Stats:
    batch = idx.shape[0]
    idx = idx.reshape(batch, -1)
    g = g.reshape(batch, idx.shape[1], -1)
    gw = _wide(g)  # norms in float64 (see :func:`_wide`)
    same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(gw.dtype)
    sq = (same * torch.bmm(gw, gw.transpose(1, 2))).sum(dim=(1, 2))

    def subject_sq(subjects: _Subjects) -> torch.Tensor:
        inverse, num = subjects.inverse, subjects.num
        rows, slot = _subject_layout(inverse, num)
        ip = _pad_by_subject(idx.unsqueeze(-1), rows, slot, num).squeeze(-1)
        # padding has zero gradient, so its (arbitrary) token id contributes nothing
        gp = _pad_by_subject(gw, rows, slot, num)
        same_p = (ip.unsqueeze(2) == ip.unsqueeze(1)).to(gw.dtype)
        return (same_p * torch.bmm(gp, gp.transpose(1, 2))).sum((1, 2))

    def weighted(w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = w[:, None, None] * _as(g, w)
        out = torch.zeros(module.weight.shape, dtype=rows.dtype)
        out.index_add_(0, idx.reshape(-1), rows.reshape(-1, g.shape[-1]))
        return {"weight": out.to(g.dtype)}

    positions = idx.shape[1]
    mag = torch.linalg.vector_norm(g, dim=2, dtype=torch.float64).sum(1)
    terms = g.shape[2] + _grid_terms(positions) + 2
    return _Stats(sq, subject_sq, weighted, mag=mag, terms=terms, positions=positions)


def _layer_stats(
    module: nn.Module, inputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> _Stats:
    if isinstance(module, nn.Embedding):
        a = _cat([i.reshape(i.shape[0], -1) for i in inputs])
        g = _cat([gi.reshape(gi.shape[0], -1, gi.shape[-1]) for gi in grads])
        return _embedding_stats(module, a, g)
    if isinstance(module, nn.Conv2d):
        return _conv_stats(module, inputs, grads)
    pairs = [_positions(module, a, g) for a, g in zip(inputs, grads, strict=True)]
    return _linear_stats(module, _cat([a for a, _ in pairs]), _cat([g for _, g in pairs]))


class GhostClipper:
    """Clipped (weighted) gradient sums of a model at ghost-clipping cost.

    Args:
      model: the module; its parameters are replaced functionally by ``params`` on each call.
    """

    def __init__(self, model: nn.Module, *, compiled: bool = True) -> None:
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
        #: whether the hooks copy what they record (see :meth:`_hooked_capture`)
        self._copy_outputs = False
        #: the MLP passes written out, where the model is one (else hooks and autograd)
        self._chain = DenseChain.trace(model) if self.fast else None
        #: per-subject sums of a plain MLP in compiled code (:mod:`.dense_kernel`), by dtype
        self._compiled = compiled and self._chain is not None
        self._kernels: dict[torch.dtype, DenseKernel | None] = {}
        #: bytes of captured activations and output gradients per record, by input shape
        #: (known after a first capture; sets the size of per-subject passes)
        self._record_bytes: dict[tuple[int, ...], int] = {}

    @property
    def fast(self) -> bool:
        return not self.unsupported

    def _capture(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[dict[str, _Stats], Callable[[torch.Tensor], dict[str, _Stats]]]:
        """One forward and backward pass of ``Σ_i scale_i · loss_i``: every layer's stats, and
        a function giving them again with some examples' rows zeroed (``zero``: a mask over
        the batch), from the same captured tensors (the model does not run again)."""
        captured = None if self._chain is None else self._chain.capture(params, x, y, scale)
        if captured is not None:
            by_name = {name: (name, module, [a], [g]) for name, module, a, g in captured}
            layers = [by_name[name] for name in self._layers if name in by_name]
        else:
            layers = self._hooked_capture(params, x, y, scale)
        if x.shape[0]:
            size = sum(t.numel() * t.element_size() for *_, a, g in layers for t in (*a, *g))
            self._record_bytes[tuple(x.shape[1:])] = max(1, size // x.shape[0])

        def build(zero: torch.Tensor | None = None) -> dict[str, _Stats]:
            stats: dict[str, _Stats] = {}
            for name, module, inputs, gs in layers:
                if zero is not None:  # every supported layer has the batch first
                    inputs = [zero_rows(t, zero) for t in inputs]
                    gs = [zero_rows(t, zero) for t in gs]
                stats[name] = _layer_stats(module, inputs, gs)
            return stats

        return build(), build

    def _hooked_capture(
        self, params: Params, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None
    ) -> list[tuple[str, nn.Module, list[torch.Tensor], list[torch.Tensor]]]:
        """Every layer's inputs and output gradients, recorded by forward hooks and
        ``autograd.grad``.

        The hooks run before the model's own forward hooks (which may replace the output):
        the gradient at the layer's own output is the one its parameters' gradient needs. A
        recorded tensor that a later operation changes in place (e.g. ``ReLU(inplace=True)``)
        would give the gradient of the changed tensor; when that happens, the pass runs
        again with each layer's input and output copied (the output's copy is what the rest
        of the model sees), and later calls copy from the start."""
        calls = {name: _Calls(module) for name, module in self._layers.items()}
        copy = self._copy_outputs
        handles = []
        for name, module in self._layers.items():

            def hook(
                mod: nn.Module, inp: tuple, out: torch.Tensor, name: str = name
            ) -> torch.Tensor | None:
                record = calls[name]
                record.inputs.append(inp[0].detach().clone() if copy else inp[0].detach())
                record.outputs.append(out)
                record.versions += [record.inputs[-1]._version, out._version]
                return out.clone() if copy else None

            handles.append(module.register_forward_hook(hook, prepend=True))
        try:
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            with torch.enable_grad():
                # a copy of x: a model that writes to its input must not change what a second
                # pass (below) or the caller sees
                logits = functional_call(self.model, leaves, (x.clone(),))
                again = not copy and any(c.modified() for c in calls.values())
                if not again:
                    losses = F.cross_entropy(logits, y, reduction="none")
                    loss = losses.sum() if scale is None else torch.dot(losses, scale)
                    outputs = [o for c in calls.values() for o in c.outputs]
                    grads_out = torch.autograd.grad(loss, outputs)
        finally:
            for h in handles:
                h.remove()
        if again:
            self._copy_outputs = True
            return self._hooked_capture(params, x, y, scale)
        layers = []
        pos = 0
        for name, c in calls.items():
            gs = list(grads_out[pos : pos + len(c.outputs)])
            pos += len(c.outputs)
            if gs:
                layers.append((name, c.module, c.inputs, gs))
        return layers

    @staticmethod
    def _assemble(params: Params, stats: dict[str, _Stats], weights: torch.Tensor) -> Params:
        weights = weights.to(_release_dtype(params, stats, weights))
        summed: Params = {}
        for name, layer in stats.items():
            for pname, value in layer.weighted(weights).items():
                summed[f"{name}.{pname}" if name else pname] = value
        for key, value in params.items():  # parameters this batch does not reach
            if key not in summed:
                summed[key] = torch.zeros_like(value)
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
            weights = factors if weigh is None else weigh(factors)
            return norms, clipped_weighted_sum(grads, norms, weights)
        kernel = self._kernel(next(iter(params.values())).dtype)
        if kernel is not None:  # every record its own subject
            batch = int(x.shape[0])
            ones = torch.ones(batch, dtype=torch.long)
            compiled = self._compiled_pass(kernel, params, x, y, torch.arange(batch), ones)
            if compiled is not None:
                norms, fused_release = compiled
                factors = clip_factors(norms, clip)
                return norms, fused_release(factors if weigh is None else weigh(factors))
        stats, rebuild = self._capture(params, x, y, None)
        sq = torch.stack([layer.sq for layer in stats.values()]).sum(0)
        release = next(iter(params.values())).dtype
        mag = _magnitudes(stats)
        norms = _norm_bounds(sq, mag, stats, release, int(x.shape[0]))
        factors = clip_factors(norms, clip)
        weights = factors if weigh is None else weigh(factors)
        stats = _without_non_finite(stats, rebuild, norms)
        return norms, self._assemble(params, stats, weights)

    def subject_norms_and_sum(
        self,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        subjects: torch.Tensor,
        *,
        weigh: Callable[[torch.Tensor], torch.Tensor],
        max_batch: int = 256,
    ) -> tuple[torch.Tensor, Params]:
        """Per-subject mean gradients ``G_a = mean_{i in a} g_i``: their norms, and
        ``Σ_a v_a G_a`` with ``v = weigh(norms)`` (one weight per subject, in the order of
        ``torch.unique(subjects)``).

        The norms come from per-example gradients summed per subject where those are small
        (conv layers), else from Gram matrices restricted to each subject's rows; the sum from
        one contraction with per-example weights ``v_{a(i)}``. Whole subjects are processed
        in passes of about ``max_batch`` records: a pass's activations stay in cache, and the
        per-subject Gram matrices grow with the square of a pass. Needs every layer supported
        (no fallback).
        """
        if not self.fast:
            raise ValueError(
                f"Per-subject norms need every layer supported; unsupported: {self.unsupported}."
            )
        _, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
        dtype = next(iter(params.values())).dtype
        num = counts.numel()
        kernel = self._kernel(dtype)
        records = self._record_bytes.get(tuple(x.shape[1:]))
        per_pass = max_batch if records is None else max(max_batch, PASS_BYTES // records)
        if inverse.numel() <= per_pass:  # one pass over the whole batch
            norms, release = self._subject_pass(kernel, params, x, y, inverse, counts)
            return norms, release(weigh(norms))
        # consecutive subjects, about per_pass records per pass
        passes = torch.div(torch.cumsum(counts, 0) - counts, per_pass, rounding_mode="floor")
        parts = []
        for part in torch.unique(passes):
            members = torch.nonzero(passes == part).flatten()
            rows = torch.nonzero(torch.isin(inverse, members)).flatten()
            local = torch.searchsorted(members, inverse[rows])
            bounds, release = self._subject_pass(
                kernel, params, x[rows], y[rows], local, counts[members]
            )
            parts.append((members, release, bounds))
        norms = torch.zeros(num, dtype=torch.float64)
        for members, _, bounds in parts:
            norms[members] = bounds
        coefficients = weigh(norms)
        total: Params | None = None
        for members, release, _ in parts:
            summed = release(coefficients[members])
            if total is None:
                total = summed
            else:
                for k, v in summed.items():
                    total[k].add_(v)
        assert total is not None
        return norms, total

    def _kernel(self, dtype: torch.dtype) -> DenseKernel | None:
        """The compiled path for parameters of ``dtype``, where the model is a plain MLP
        (:meth:`DenseKernel.build`) that has no hooks or patched layers now."""
        chain = self._chain
        if not self._compiled or chain is None:
            return None
        if dtype not in self._kernels:
            from silodp.privacy.dense_kernel import DenseKernel

            self._kernels[dtype] = DenseKernel.build(chain.body, dtype)
        kernel = self._kernels[dtype]
        if kernel is None or chain.altered():
            return None
        return kernel

    def _subject_pass(
        self,
        kernel: DenseKernel | None,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        inverse: torch.Tensor,
        counts: torch.Tensor,
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Params]]:
        """Upper bounds of the norms of one pass's per-subject sums, and the function
        giving ``Σ_a v_a G_a`` from the coefficients ``v`` (one per subject of the pass): in
        compiled code where ``kernel`` applies to this pass, else from the layers' stats."""
        compiled = self._compiled_pass(kernel, params, x, y, inverse, counts)
        if compiled is not None:
            return compiled
        dtype = next(iter(params.values())).dtype
        scale = counts.to(dtype).reciprocal_().index_select(0, inverse)
        stats, rebuild = self._capture(params, x, y, scale)
        bounds = _subject_norm_bounds(stats, inverse, counts, dtype)
        stats = _without_non_finite(stats, rebuild, bounds, inverse)
        return bounds, lambda v: self._assemble(params, stats, v.index_select(0, inverse))

    def _compiled_pass(
        self,
        kernel: DenseKernel | None,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        inverse: torch.Tensor,
        counts: torch.Tensor,
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], Params]] | None:
        """:meth:`_subject_pass` in compiled code; ``None`` where ``kernel`` does not apply
        to this pass (see :meth:`DenseKernel.capture`)."""
        if kernel is None or self._chain is None:
            return None
        dtype = next(iter(params.values())).dtype
        rows = x.flatten(1) if self._chain.flatten else x
        fused = kernel.capture(params, rows, y, inverse, counts)
        if fused is None:
            return None
        self._record_bytes[tuple(x.shape[1:])] = kernel.record_bytes
        largest = fused.largest
        # a Gram sum adds up to gram² products of dot products; a materialised gradient sums
        # each entry over the subject's records, then the entries' squares
        gram = min(largest, kernel.largest_gram)
        terms = kernel.width + 2 * largest + gram * gram + kernel.largest_gradient
        bounds = _rounded_bounds(
            fused.sq, fused.mag, terms, kernel.width, kernel.layers, dtype, int(x.shape[0])
        )
        bad = ~np.isfinite(bounds.numpy())
        drop = torch.from_numpy(bad) if bad.any() else None

        def fused_release(coefficients: torch.Tensor) -> Params:
            fused.check(coefficients)
            wide = _wide_release(dtype, coefficients, fused.a_max, fused.mag)
            return fused.release(coefficients, wide, drop)

        return bounds, fused_release


#: a release in float32 is exact enough where every nonzero weight is at least this, every
#: input norm at most RELEASE_INPUT and every kept unit's ``|weight|·mag`` at least
#: RELEASE_SCALE; beyond, the weighted sums run in float64
RELEASE_WEIGHT = 2.0**-100
RELEASE_INPUT = 2.0**40
RELEASE_SCALE = 2.0**-60


def _release_dtype(params: Params, stats: dict[str, _Stats], weights: torch.Tensor) -> torch.dtype:
    """The dtype to form the weighted sums in: the parameters', or float64 where a weight
    is tiny (a float32 subnormal keeps few digits, and the clip bound needs them all) or an
    input is huge (``w·g`` can underflow to an absolute error that ``a`` then multiplies)."""
    dtype = next(iter(params.values())).dtype
    scales = [layer.a_scale for layer in stats.values() if layer.a_scale is not None]
    high = float(torch.stack(scales).amax()) if scales else None
    return _wide_release(dtype, weights, high, _magnitudes(stats))


def _wide_release(
    dtype: torch.dtype, weights: torch.Tensor, high: float | None, mag: torch.Tensor | None
) -> torch.dtype:
    """:func:`_release_dtype` from the parameters' ``dtype``, the weights, the largest input
    norm ``high`` (``None``: no input; not finite: float64) and the units' rounding scales
    ``mag`` (one per weight).

    The bound's slack covers the release's rounding as ``γ_r·|w|·mag`` per unit, a relative
    error. Where a product ``w·g`` (or its product with ``a``) falls below float32's normal
    range its rounding is absolute instead: at most 2^-150 per product, times an input of at
    most 2^40, so per unit (up to 2^20 outputs of a layer, 2^10 positions) at most 2^-90,
    below the slack's ``γ_r·RELEASE_SCALE ≥ 2^-23·2^-60``."""
    if dtype == torch.float64:
        return dtype
    if high is not None and not high <= RELEASE_INPUT:  # NaN: a dropped record's
        return torch.float64
    magnitude = np.abs(weights.detach().numpy())
    kept = magnitude > 0
    if mag is not None:  # a unit without gradient adds exact zeros
        kept &= mag.numpy() > 0
    if kept.any():
        if float(magnitude[kept].min()) < RELEASE_WEIGHT:
            return torch.float64
        if mag is not None and bool((magnitude[kept] * mag.numpy()[kept] < RELEASE_SCALE).any()):
            return torch.float64
    return dtype


def _magnitudes(stats: dict[str, _Stats]) -> torch.Tensor | None:
    """Per example, the scale of the rounding errors behind its norm and its share of the
    release: ``Σ_layers mag`` for the Gram layers, the per-example norm for the others (the
    release rounds every layer's terms in proportion to it, and a subject's norm sums its
    records' gradients before squaring); ``None`` without layers."""
    parts = [
        layer.mag if layer.mag is not None else layer.sq.clamp(min=0).sqrt()
        for layer in stats.values()
    ]
    return _sum_layers(parts) if parts else None


def _norm_bounds(
    sq: torch.Tensor,
    mag: torch.Tensor | None,
    stats: dict[str, _Stats],
    release: torch.dtype,
    records: int,
    largest: int = 0,
    narrow_pairs: bool = False,
) -> torch.Tensor:
    """Norms to clip by that are upper bounds of the exact ones, from squared norms ``sq``
    computed in float64 (:func:`_wide`) and the scale ``mag`` of their rounding and of the
    release's (:func:`_magnitudes`; ``None``: no layers, the norm as it is). ``release``: the
    dtype of the weighted sum; ``records``: the records in the pass; ``largest``: for
    per-subject norms, the largest subject's number of records.

    A Gram sum ``Σ_{i,j} (a_i·a_j)(g_i·g_j)`` over positions (or a subject's records) equals
    ``||Σ_i g_i a_iᵀ||²`` only in exact arithmetic: when the terms cancel (records whose
    gradients nearly sum to 0, huge inputs that differ little) its computed value can be ~0
    or negative while the true norm is large, and a clip factor of 1 would release the
    contribution unclipped. Its error is at most ``γ·mag²`` with ``mag = Σ_i ||g_i||·||a_i||``
    and ``γ = 2·n·u`` (``u`` float64's unit roundoff, ``n`` the longest sum involved: the
    layer's dot products and positions, the layers, and for a subject of ``m`` records of
    ``T`` positions ``2mT`` plus its ``m(m-1)/2`` pairs where it may take the pairs route;
    adding exact zeros, as the dense route's products do outside the subject, costs no
    rounding). The weighted sum released beside it, and the materialised per-subject sums of
    the chunk routes, are computed in ``release``; their rounding of this unit's terms is at
    most ``γ_r·mag``, ``γ_r = 2·(records·layers + d + p + 32)·u_release``.
    The bound is ``sqrt(max(sq, 0)·(1 + γ) + γ·mag²) + (γ + γ_r)·mag``: without
    cancellation (``mag`` about the norm) a relative ``~γ_r`` above it (in float32 ~1e-4 for
    the mlp at 64 records, ~2e-4 at 512). A bound the release dtype cannot hold is ``inf``:
    such a record or subject is dropped like a non-finite one (its products could overflow
    there)."""
    if mag is None:
        bound = sq.clamp(min=0).sqrt_()
        return bound.masked_fill_(bound >= torch.finfo(release).max, math.inf)
    width = max(layer.terms for layer in stats.values())
    n = width + len(stats)
    if largest:
        positions = max(layer.positions for layer in stats.values())
        pairs = largest * (largest - 1) // 2 if largest <= SMALL_SUBJECT else 0
        n += 2 * largest * positions + pairs
    extra = 2 * (width + 2) * torch.finfo(release).eps if narrow_pairs else 0.0
    # (narrow_pairs: the pairs route's dot products, in float32, see _moderate)
    return _rounded_bounds(sq, mag, n, width, len(stats), release, records, extra)


def _rounded_bounds(
    sq: torch.Tensor,
    mag: torch.Tensor,
    terms: int,
    width: int,
    layers: int,
    release: torch.dtype,
    records: int,
    extra: float = 0.0,
) -> torch.Tensor:
    """:func:`_norm_bounds` given the longest sum ``terms`` behind ``sq`` (in ``sq``'s
    dtype), the longest dot product ``width`` of a layer, the number of ``layers`` and an
    ``extra`` relative error: ``sqrt(max(sq, 0)·(1 + γ) + γ·mag²) + (γ + γ_r)·mag``, ``inf``
    where the release dtype cannot hold it."""
    limit = torch.finfo(release).max
    gamma = terms * torch.finfo(sq.dtype).eps + extra
    gamma_r = (records * layers + width + SUBJECT_CHUNK) * torch.finfo(release).eps
    m = mag.numpy()  # float64, as sq (numpy: a few µs less per call on small batches)
    bound = np.maximum(sq.numpy(), 0.0)
    bound *= 1.0 + gamma
    bound += gamma * m * m
    np.sqrt(bound, out=bound)
    bound += (gamma + gamma_r) * m
    bound[(m >= limit) | (bound >= limit)] = math.inf  # NaN stays NaN: not finite either
    return torch.from_numpy(bound)


def _subject_norm_bounds(
    stats: dict[str, _Stats], inverse: torch.Tensor, counts: torch.Tensor, release: torch.dtype
) -> torch.Tensor:
    """Upper bounds of the norms of the per-subject summed gradients (:func:`_norm_bounds`
    over :func:`_model_subject_sq`), one per subject row."""
    sq, narrow = _model_subject_sq(stats, inverse, counts)
    mag = _magnitudes(stats)
    assert mag is not None
    subject_mag = mag.new_zeros(int(counts.numel())).index_add_(0, inverse, mag)
    largest = int(counts.max()) if counts.numel() else 0
    return _norm_bounds(sq, subject_mag, stats, release, int(inverse.numel()), largest, narrow)


def _without_non_finite(
    stats: dict[str, _Stats],
    rebuild: Callable[[torch.Tensor], dict[str, _Stats]],
    sq: torch.Tensor,
    inverse: torch.Tensor | None = None,
) -> dict[str, _Stats]:
    """``stats``, or, where some example's (``inverse`` given: some subject's) squared norm
    ``sq`` is not finite, the same pass with its records zeroed: its weight is 0, but
    ``0·inf`` would turn every contraction into NaN."""
    bad = ~torch.isfinite(sq)
    if not bool(bad.any()):
        return stats
    return rebuild(bad if inverse is None else bad.index_select(0, inverse))


def _small_limit(layers: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> int:
    """Largest "small" subject for these one-position linear layers: a pair of records costs
    about ``Σ (p + d)`` (gathered and multiplied), a record in a gradient ``Σ p·d``, so pairs
    are cheaper up to about ``2·Σ p·d / (3·Σ (p + d))`` records (at least 2, at most
    :data:`SMALL_SUBJECT`)."""
    widths = [(g.shape[1], a.shape[1] + int(bias)) for a, g, bias in layers]
    limit = 2 * sum(p * d for p, d in widths) // (3 * sum(p + d for p, d in widths))
    return max(2, min(SMALL_SUBJECT, limit))


def _model_subject_sq(
    stats: dict[str, _Stats], inverse: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """Squared norms of the per-subject summed gradients of the whole model: one-position
    linear layers together (:func:`_linear_subject_sq`), every other layer (or all of them,
    where that route is too costly) by its own ``subject_sq``; and whether some pairs' dot
    products were taken in float32."""
    linear = [layer for layer in stats.values() if layer.rows is not None]
    rows = [layer.rows for layer in linear if layer.rows is not None]
    norms = [layer.row_norms for layer in linear if layer.row_norms is not None]
    if rows and len(rows) == len(stats):
        batch = int(inverse.numel())
        width = sum(a.shape[1] + g.shape[1] + int(bias) for a, g, bias in rows)
        if batch * batch * width <= DENSE_GRAM_MACS:
            dense = _dense_subject_sq(rows, inverse, int(counts.numel()))
            if bool(torch.isfinite(dense).all()):
                return dense, False
    subjects = _Subjects(inverse, counts, _small_limit(rows) if rows else SMALL_SUBJECT)
    total = None
    narrow = False
    if rows:
        sq = _sum_layers([layer.sq for layer in linear])
        listed = _linear_subject_sq(subjects, rows, sq, norms)
        if listed is not None:
            total, narrow = listed
    if total is None:
        linear = []
    full = [
        layer.subject_sq(subjects)
        for layer in stats.values()
        if not any(layer is other for other in linear)
    ]
    if full:
        rest = _sum_layers(full)
        total = rest if total is None else total + rest
    assert total is not None
    return total, narrow


def _dense_subject_sq(
    rows: list[tuple[torch.Tensor, torch.Tensor, bool]], inverse: torch.Tensor, num: int
) -> torch.Tensor:
    """``Σ_layers ||Σ_{i∈S} g_i ãᵢᵀ||²`` for every subject ``S`` (``ã = [a, 1]`` with a bias)
    as ``Σ_{i,j∈S} K_ij``, ``K = Σ_layers (G Gᵀ) ∘ (A Aᵀ + bias)``: one ``B × B`` matrix, then
    ``diag(M K Mᵀ)`` with ``M`` the subjects' 0/1 membership. A non-finite record spreads
    NaN to every subject (``0·inf`` in ``M K``): the caller then uses the other route, which
    keeps it to its own subject."""
    total: torch.Tensor | None = None
    for a, g, bias in rows:
        a, g = _wide(a), _wide(g)
        gram = a @ a.T
        if bias:
            gram += 1.0
        gram.mul_(g @ g.T)
        total = gram if total is None else total.add_(gram)
    assert total is not None
    batch = inverse.numel()
    member = total.new_zeros(num, batch)
    member[inverse, torch.arange(batch)] = 1.0
    return ((member @ total) * member).sum(1)


def _sum_layers(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def _subject_layout(inverse: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row (subject) and slot (position within the subject) of every example."""
    counts = torch.bincount(inverse, minlength=num)
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(inverse.numel()) - starts[inverse[order]]
    return inverse, slot


def _pad_by_subject(
    t: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, num: int
) -> torch.Tensor:
    """(B, T, k) per-example tensors -> (subjects, max_count * T, k), zero padded."""
    width = int(slot.max()) + 1
    out = t.new_zeros(num, width, *t.shape[1:])
    out[rows, slot] = t
    return out.reshape(num, width * t.shape[1], *t.shape[2:])


def _padded_subject_grad_sq(
    a: torch.Tensor, g: torch.Tensor, inverse: torch.Tensor, num: int
) -> torch.Tensor:
    """Squared norms of ``Σ_{i∈a} g_i a_iᵀ`` for (B, d) inputs and (B, p) output gradients,
    computed subject by subject in chunks of at most ``PER_EXAMPLE_LIMIT`` elements."""
    rows, slot = _subject_layout(inverse, num)
    ap = _pad_by_subject(a[:, None, :], rows, slot, num)  # (num, width, d)
    gp = _pad_by_subject(g[:, None, :], rows, slot, num)  # (num, width, p)
    per = max(1, PER_EXAMPLE_LIMIT // (a.shape[1] * g.shape[1]))
    return torch.cat(
        [
            torch.linalg.vector_norm(
                torch.bmm(gp[i : i + per].transpose(1, 2), ap[i : i + per]),
                dim=(1, 2),
                dtype=torch.float64,
            ).square_()
            for i in range(0, num, per)
        ]
    )


def _padded_subject_sq(
    a: torch.Tensor, g: torch.Tensor, inverse: torch.Tensor, num: int
) -> torch.Tensor:
    """Squared norms of per-subject summed weight gradients from Gram matrices over each
    subject's positions (padded to the largest subject)."""
    rows, slot = _subject_layout(inverse, num)
    ap, gp = _pad_by_subject(a, rows, slot, num), _pad_by_subject(g, rows, slot, num)
    positions, d, p = ap.shape[1], ap.shape[2], gp.shape[2]
    if positions * positions <= p * d:
        return (torch.bmm(ap, ap.transpose(1, 2)) * torch.bmm(gp, gp.transpose(1, 2))).sum((1, 2))
    return torch.bmm(gp.transpose(1, 2), ap).pow(2).sum((1, 2))


#: per model: its modules when its clipper was built, and the clipper
_CLIPPERS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Module, ...], GhostClipper]] = (
    weakref.WeakKeyDictionary()
)


def clipper_for(model: nn.Module) -> GhostClipper:
    """The (cached) :class:`GhostClipper` of ``model``, built again when the model's modules
    changed since (a layer replaced or added: the clipper's layers and traced chain would
    be stale). The modules themselves are kept, so a replaced one cannot be mistaken for a
    new one at the same address."""
    modules = tuple(model.modules())
    cached = _CLIPPERS.get(model)
    if (
        cached is None
        or len(cached[0]) != len(modules)
        or any(a is not b for a, b in zip(cached[0], modules, strict=True))
    ):
        cached = (modules, GhostClipper(model))
        _CLIPPERS[model] = cached
    return cached[1]
