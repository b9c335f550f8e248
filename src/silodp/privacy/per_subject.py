"""Per-subject local training, vectorised across subjects (ULDP-AVG/SGD's hot path).

For every subject of a silo: start from the global model, train on that subject's records
only (``epochs`` epochs of mini-batch SGD, or one full-batch gradient step), and return the
model delta. Subjects are trained together on stacked parameter copies: CNNs that are chains
of convolutions, linear layers, ReLU and max-pooling as one grouped channels-last model
(:mod:`silodp.privacy.stacked`, one group per subject), other models with
``torch.func.vmap``; subjects are processed in chunks so memory stays bounded for thousands
of subjects, and so a chunk's activations stay small enough to be reused from step to step
rather than mapped afresh.

Batching: each epoch, every subject's records are shuffled (one draw of distinct random ranks
for all subjects from a :class:`~silodp.privacy.randomness.Coins`, so each subject's order is
exactly uniform) and cut into batches of ``batch_size``; a subject with fewer records simply has
empty (masked) batches at the end of the epoch, which leave its parameters unchanged. The naive
loop :func:`per_subject_deltas_loop` trains one subject at a time on exactly the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from silodp._validation import check_choice, check_int, check_positive
from silodp.privacy.gradients import Params
from silodp.privacy.randomness import Coins
from silodp.privacy.stacked import StackedModel

__all__ = [
    "SubjectBatches",
    "default_chunk_size",
    "per_subject_deltas",
    "per_subject_deltas_loop",
    "largest_activation_bytes",
    "subject_batches",
]

#: Memory budget for one chunk's stacked parameters, gradients and updates.
CHUNK_BUDGET_BYTES = 256 * 2**20
#: Largest stacked tensor of a chunk (one parameter, the gathered records, or one layer's
#: activations, for all its subjects). glibc's malloc serves blocks above its mmap
#: threshold (32 MiB at most) with a fresh mapping that is unmapped when freed, so every
#: step of a chunk with larger tensors faults every page in again (on Fashion-MNIST's MLP
#: that was over half of a round's time, in the kernel); below it, freed blocks are reused.
#: 16 MiB leaves room under the threshold and measured as fast as any smaller size
#: (``docs/performance.md``, "Allocation churn").
STACKED_TENSOR_BYTES = 16 * 2**20
#: Tensors of one layer's output size alive at once for a chunk in a step (the output, its
#: gradient, and the copy vmap's grouped convolutions make to lay subjects out as channel
#: groups): ``uldp_cnn`` on Fashion-MNIST faulted pages in every step with chunks of 25+
#: subjects (two copies under the limit), not with 15 (three).
ACTIVATION_COPIES = 3


@dataclass(frozen=True)
class SubjectBatches:
    """Record indices of each subject's mini-batches for one round.

    ``index[e, j]`` is a ``(subjects, batch)`` tensor of record indices for epoch ``e``, step
    ``j``; ``mask[e, j]`` marks the real ones (padding is masked out).
    """

    index: torch.Tensor  # (epochs, steps, subjects, batch)
    mask: torch.Tensor  # same shape, bool

    @property
    def num_subjects(self) -> int:
        return int(self.index.shape[2])


def subject_batches(
    subjects: torch.Tensor,
    order: torch.Tensor,
    *,
    epochs: int,
    batch_size: int | None,
    coins: Coins,
) -> SubjectBatches:
    """Plans every subject's batches.

    Args:
      subjects: subject id of each record of the silo.
      order: the subject ids to train, in output order.
      epochs: local epochs Q.
      batch_size: records per batch; ``None`` for one full batch per epoch.
      coins: shuffle each subject's records every epoch.
    """
    check_int("epochs", epochs, 1)
    num = int(order.numel())
    lookup = torch.full((int(max(subjects.max(), order.max())) + 1,), -1, dtype=torch.long)
    lookup[order] = torch.arange(num)
    row_of_record = lookup[subjects]
    records = torch.nonzero(row_of_record >= 0).flatten()
    rows = row_of_record[records]
    by_row = torch.argsort(rows, stable=True)
    rows, records = rows[by_row], records[by_row]
    counts = torch.bincount(rows, minlength=num)
    position = torch.arange(len(rows)) - (torch.cumsum(counts, 0) - counts)[rows]
    longest = max(int(counts.max()), 1) if num else 1
    size = longest if batch_size is None else min(check_int("batch_size", batch_size, 1), longest)
    steps = math.ceil(longest / size)
    padded = torch.full((num, steps * size), -1, dtype=torch.long)
    padded[rows, position] = records
    valid = padded >= 0
    index, mask = [], []
    for _ in range(epochs):
        keys = coins.ranks(padded.numel()).reshape(padded.shape)
        keys[~valid] = padded.numel()  # padding sorts last
        perm = torch.argsort(keys, dim=1)
        shuffled = torch.gather(padded, 1, perm)
        index.append(shuffled.clamp(min=0).reshape(num, steps, size).transpose(0, 1))
        mask.append((shuffled >= 0).reshape(num, steps, size).transpose(0, 1))
    return SubjectBatches(torch.stack(index), torch.stack(mask))


def default_chunk_size(params: Params, *, record_bytes: int = 0, activation_bytes: int = 0) -> int:
    """Subjects per chunk: stacked params, grads and updates fit the memory budget, and no
    stacked tensor — one parameter, one step's gathered records (``record_bytes`` per
    subject) or :data:`ACTIVATION_COPIES` of one layer's output for a step
    (``activation_bytes`` per subject) — exceeds :data:`STACKED_TENSOR_BYTES`."""
    total = sum(p.numel() * p.element_size() for p in params.values())
    sizes = [p.numel() * p.element_size() for p in params.values()]
    largest = max([*sizes, record_bytes, ACTIVATION_COPIES * activation_bytes])
    by_budget = CHUNK_BUDGET_BYTES // (4 * max(total, 1))
    by_tensor = STACKED_TENSOR_BYTES // max(largest, 1)
    return max(1, min(512, by_budget, by_tensor))


def _chunks(order: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, order.numel(), size):
        yield order[start : start + size]


def largest_activation_bytes(model: nn.Module, params: Params, example: torch.Tensor) -> int:
    """Bytes of the largest output of any of ``model``'s modules for one record ``example``
    (a batch of one), found by one forward pass with ``params``."""
    largest = 0

    def record(_module: nn.Module, _inputs: object, output: object) -> None:
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    handles = [m.register_forward_hook(record) for m in model.modules()]
    try:
        with torch.no_grad():
            functional_call(model, params, (example,))
    finally:
        for handle in handles:
            handle.remove()
    return largest


def per_subject_deltas(
    model: nn.Module,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: SubjectBatches,
    *,
    lr: float,
    chunk_size: int | None = None,
    method: str = "auto",
) -> Iterator[tuple[torch.Tensor, Params]]:
    """Trains every planned subject from ``params``; yields ``(rows, deltas)`` chunk by chunk.

    ``rows`` are the chunk's rows of ``batches`` (subjects with similar record counts are
    trained together, so chunks come in order of record count, not of rows);
    ``deltas[name]`` has a leading dimension of those subjects. Each step's batches are cut
    to the chunk's longest real batch, so small subjects do not pay for large ones.

    ``method``: ``vmap`` (subjects of a chunk trained together), ``stacked`` (the same, as one
    grouped channels-last model: :class:`~silodp.privacy.stacked.StackedModel`, for chains of
    convolutions, linear layers, ReLU, max-pooling and flatten), ``auto`` (``stacked`` where
    the model is such a chain with a convolution, else ``vmap``) or ``loop`` (one after
    another). By default a chunk's size keeps every stacked parameter, gathered batch and
    activation of a step under :data:`STACKED_TENSOR_BYTES`.
    """
    check_positive("lr", lr)
    check_choice("method", method, ("auto", "vmap", "stacked", "loop"))
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, 1)
    epochs, steps, _, width_max = batches.index.shape
    record_bytes = width_max * (x[:1].numel() * x.element_size() + y.element_size())

    def masked_loss(
        p: Params, xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor
    ) -> torch.Tensor:
        logits = functional_call(model, p, (xb,))
        losses = F.cross_entropy(logits, yb, reduction="none")
        weights = mb.to(losses.dtype)
        return (losses * weights).sum() / weights.sum().clamp(min=1.0)

    stacked = StackedModel.trace(model) if method in ("auto", "stacked") else None
    if method == "stacked" and stacked is None:
        raise ValueError(
            f"Expected a chain of Conv2d, Linear, ReLU, MaxPool2d and flatten for "
            f"method='stacked', got {type(model).__name__}."
        )
    subject_grad = vmap(grad(masked_loss)) if stacked is None else _stacked_grad(stacked)
    # real records per (epoch, step, subject): a prefix of each padded batch
    real = batches.mask.sum(dim=3)
    by_size = torch.argsort(real[0].sum(dim=0), stable=True)
    if method == "loop":
        for row in by_size:
            yield row.reshape(1), _one_subject(model, params, x, y, batches, int(row), lr=lr)
        return
    chunk = chunk_size
    if chunk is None:
        activation = largest_activation_bytes(model, params, x[:1].clone()) if len(x) else 0
        chunk = default_chunk_size(
            params, record_bytes=record_bytes, activation_bytes=width_max * activation
        )
    # one step's records, gathered into buffers reused by every step and chunk
    x_buf = x.new_empty((min(chunk, by_size.numel()) * width_max, *x.shape[1:]))
    y_buf = y.new_empty((x_buf.shape[0],))
    for rows in _chunks(by_size, chunk):
        width = rows.numel()
        # the chunk's parameter copies, trained in place and yielded as its deltas
        local = {k: v.detach().expand(width, *v.shape).clone() for k, v in params.items()}
        for e in range(epochs):
            for j in range(steps):
                size = int(real[e, j, rows].max())
                if size == 0:
                    continue
                idx = batches.index[e, j, rows, :size].reshape(-1)
                xb = torch.index_select(x, 0, idx, out=x_buf[: idx.numel()])
                yb = torch.index_select(y, 0, idx, out=y_buf[: idx.numel()])
                mb = batches.mask[e, j, rows, :size]
                # padding slots hold some record of the silo: zeroed (features and label),
                # so that no subject's arithmetic touches another's data (a record whose
                # activations overflow would otherwise turn the masked-out terms into NaN)
                xb.masked_fill_(~mb.reshape(-1, *[1] * (x.dim() - 1)), 0)
                yb.masked_fill_(~mb.reshape(-1), 0)
                grads = subject_grad(
                    local, xb.view(width, size, *x.shape[1:]), yb.view(width, size), mb
                )
                for k, v in local.items():
                    v.sub_(grads[k], alpha=lr)
                del grads
        for k, v in local.items():
            v.sub_(params[k])
        yield rows, local


def _stacked_grad(
    stacked: StackedModel,
) -> Callable[[Params, torch.Tensor, torch.Tensor, torch.Tensor], Params]:
    """``vmap(grad(masked_loss))`` computed by ``stacked``: each subject's gradient of its
    masked mean loss (the subjects are independent, so one backward pass of the sum of
    their losses gives every subject's gradient)."""

    def subject_grad(local: Params, xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor) -> Params:
        leaves = {k: v.detach().requires_grad_(True) for k, v in local.items()}
        logits = stacked(leaves, xb)
        losses = F.cross_entropy(logits.flatten(0, 1), yb.reshape(-1), reduction="none")
        weights = mb.to(losses.dtype)
        per_subject = (losses.view(yb.shape) * weights).sum(dim=1)
        total = (per_subject / weights.sum(dim=1).clamp(min=1.0)).sum()
        grads = torch.autograd.grad(total, list(leaves.values()))
        return dict(zip(leaves, grads, strict=True))

    return subject_grad


def _one_subject(
    model: nn.Module,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: SubjectBatches,
    row: int,
    *,
    lr: float,
) -> Params:
    """Trains row ``row`` of ``batches`` alone; its delta with a leading dimension of 1."""
    local = {k: v.detach().clone() for k, v in params.items()}
    epochs, steps = batches.index.shape[:2]
    for e in range(epochs):
        for j in range(steps):
            keep = batches.mask[e, j, row]
            if not bool(keep.any()):
                continue
            idx = batches.index[e, j, row][keep]
            leaves = {k: v.detach().requires_grad_() for k, v in local.items()}
            loss = F.cross_entropy(functional_call(model, leaves, (x[idx],)), y[idx])
            grads = torch.autograd.grad(loss, list(leaves.values()))
            local = {
                k: v.detach().sub(g, alpha=lr)
                for (k, v), g in zip(leaves.items(), grads, strict=True)
            }
    return {k: (local[k] - params[k]).unsqueeze(0) for k in params}


def per_subject_deltas_loop(
    model: nn.Module,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: SubjectBatches,
    *,
    lr: float,
) -> list[Params]:
    """Reference: one model copy trained at a time on the same batches (slow; for checks)."""
    out = []
    for row in range(batches.num_subjects):
        delta = _one_subject(model, params, x, y, batches, row, lr=lr)
        out.append({k: v[0] for k, v in delta.items()})
    return out
