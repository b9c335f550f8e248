"""Per-subject local training (ULDP-AVG/SGD's hot path): batch plans and the vectorised trainer.

The vectorised trainer (vmap over subjects, chunked) must equal the naive one-subject-at-a-time
loop on the same batches, in float64, for every chunk size; the batch plan must use every record
of each subject exactly once per epoch and no record of anyone else.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from silodp.models import MLP, MnistCNN
from silodp.privacy.gradients import batch_gradient
from silodp.privacy.per_subject import (
    default_chunk_size,
    per_subject_deltas,
    per_subject_deltas_loop,
    subject_batches,
)
from silodp.privacy.randomness import Coins

TOL = 1e-9

# Subject id -> number of records in the silo: very different counts, ids not dense, and a
# subject (5) present in the silo but not trained (not in ORDER).
COUNTS = {12: 17, 3: 1, 0: 5, 7: 2, 5: 4}
ORDER = torch.tensor([12, 3, 0, 7])


def _subjects(counts: dict[int, int], seed: int = 0) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in counts.items()])
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    return ids[perm]  # records of a subject are interleaved with the others'


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(5, 3, hidden=8).double()
    return MnistCNN(num_classes=3, in_channels=1, side=8).double()


def _features(name: str, n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, 5) if name == "mlp" else (n, 1, 8, 8)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=gen)
    return x, y


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _gather(chunks, num: int) -> list[dict[str, torch.Tensor]]:
    """Per-subject deltas by row from the yielded chunks; checks the chunks cover every row
    0..num-1 exactly once."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rows, deltas in chunks:
        assert rows.numel() > 0
        for i, row in enumerate(rows.tolist()):
            assert row not in out
            out[row] = {k: v[i] for k, v in deltas.items()}
    assert sorted(out) == list(range(num))
    return [out[row] for row in range(num)]


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --- the batch plan -----------------------------------------------------------------------


def _check_plan(subjects: torch.Tensor, order: torch.Tensor, epochs: int, batch_size) -> None:
    plan = subject_batches(
        subjects,
        order,
        epochs=epochs,
        batch_size=batch_size,
        coins=Coins.seeded(3),
    )
    num = int(order.numel())
    assert plan.num_subjects == num
    assert plan.index.shape == plan.mask.shape and plan.mask.dtype == torch.bool
    assert plan.index.shape[0] == epochs and plan.index.shape[2] == num
    steps, size = plan.index.shape[1], plan.index.shape[3]
    if batch_size is None:
        assert steps == 1  # one full batch per epoch
    else:
        assert size <= batch_size
    for row in range(num):
        mine = torch.nonzero(subjects == order[row]).flatten().tolist()
        n_a = len(mine)
        for e in range(epochs):
            used = plan.index[e, :, row][plan.mask[e, :, row]].tolist()
            # every record of the subject exactly once, and nothing else
            assert sorted(used) == sorted(mine)
            # real records fill the first steps: ceil(n_a / B) steps, all full but the last
            per_step = plan.mask[e, :, row].sum(dim=1).tolist()
            width = size if batch_size is not None else max(n_a, 1)
            expected = [max(0, min(width, n_a - j * width)) for j in range(steps)]
            assert per_step == expected


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize("batch_size", [None, 1, 3, 4, 100])
def test_subject_batches_cover_each_record_once_per_epoch(epochs, batch_size) -> None:
    _check_plan(_subjects(COUNTS), ORDER, epochs, batch_size)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subjects=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    epochs=st.integers(1, 3),
    batch_size=st.one_of(st.none(), st.integers(1, 8)),
    data=st.data(),
)
def test_subject_batches_property(subjects, epochs, batch_size, data) -> None:
    present = sorted(set(subjects))
    chosen = data.draw(st.lists(st.sampled_from(present), min_size=1, unique=True))
    _check_plan(torch.tensor(subjects), torch.tensor(chosen), epochs, batch_size)


def test_subject_batches_are_seeded_and_reshuffled_every_epoch() -> None:
    subjects = _subjects({0: 30, 1: 30})
    order = torch.tensor([0, 1])

    def plan(seed: int):
        return subject_batches(subjects, order, epochs=2, batch_size=4, coins=Coins.seeded(seed))

    a, b, c = plan(1), plan(1), plan(2)
    assert torch.equal(a.index, b.index) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.index, c.index)
    assert not torch.equal(a.index[0], a.index[1])  # a new shuffle each epoch


# --- vectorised training == the naive loop --------------------------------------------------


# Smaller subjects for the CNN (each vmapped step costs far more than the MLP's).
CNN_COUNTS = {12: 5, 3: 1, 0: 3, 7: 2, 5: 3}
SCHEDULES = [(1, None), (2, 3), (3, 1), (2, 100)]
CASES = [("mlp", e, b) for e, b in SCHEDULES] + [
    ("mnist_cnn", 1, None),
    ("mnist_cnn", 2, 3),
    pytest.param("mnist_cnn", 3, 1, marks=pytest.mark.slow),
    pytest.param("mnist_cnn", 2, 100, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model_name", "epochs", "batch_size"), CASES)
@pytest.mark.parametrize("chunk_size", [1, 2, None])
@pytest.mark.parametrize("method", ["auto", "vmap", "stacked"])
def test_vectorised_equals_loop(model_name, epochs, batch_size, chunk_size, method) -> None:
    subjects = _subjects(COUNTS if model_name == "mlp" else CNN_COUNTS)
    x, y = _features(model_name, len(subjects))
    model = _model(model_name)
    params = _params(model)
    plan = subject_batches(
        subjects,
        ORDER,
        epochs=epochs,
        batch_size=batch_size,
        coins=Coins.seeded(7),
    )
    if method == "stacked" and model_name == "mlp":  # no convolution: refused by name
        with pytest.raises(ValueError, match="method='stacked'.*MLP"):
            next(per_subject_deltas(model, params, x, y, plan, lr=0.3, method=method))
        return
    fast = _gather(
        per_subject_deltas(model, params, x, y, plan, lr=0.3, chunk_size=chunk_size, method=method),
        len(ORDER),
    )
    slow = per_subject_deltas_loop(model, params, x, y, plan, lr=0.3)
    assert len(slow) == len(ORDER)
    for f, s in zip(fast, slow, strict=True):
        assert all(v.dtype == torch.float64 for v in f.values())
        assert _max_abs_diff(f, s) <= TOL
        assert max(float(v.abs().max()) for v in s.values()) > 1e-3  # the subject did train


def test_convolutional_chunks_are_sized_by_their_activations() -> None:
    """A CNN's largest stacked tensor is a layer's output for a step, not a parameter: the
    default chunk keeps it under the limit, and every subject is still trained."""
    from silodp.privacy.per_subject import (
        ACTIVATION_COPIES,
        STACKED_TENSOR_BYTES,
        largest_activation_bytes,
    )

    model = _model("mnist_cnn")
    params = _params(model)
    subjects = _subjects(COUNTS)
    x, y = _features("mnist_cnn", len(subjects))
    # the first convolution's output: 16 channels of 8 x 8 (padded) in float64 per record
    activation = largest_activation_bytes(model, params, x[:1])
    assert activation == 16 * 8 * 8 * 8
    width = 64
    chunk = default_chunk_size(params, activation_bytes=width * activation)
    assert ACTIVATION_COPIES == 3
    # 16 MiB / (3 copies x 64 records x 8,192 bytes) = 10.67: ten subjects
    assert chunk == 10
    assert chunk * ACTIVATION_COPIES * width * activation <= STACKED_TENSOR_BYTES
    assert (chunk + 1) * ACTIVATION_COPIES * width * activation > STACKED_TENSOR_BYTES
    assert chunk < default_chunk_size(params)  # the activations, not the weights, decide
    plan = subject_batches(subjects, ORDER, epochs=1, batch_size=2, coins=Coins.seeded(0))
    chunks = list(per_subject_deltas(model, params, x, y, plan, lr=0.1))
    assert sum(rows.numel() for rows, _ in chunks) == len(ORDER)
    assert max(rows.numel() for rows, _ in chunks) > 1  # subjects trained together
    with pytest.raises(ValueError, match="method"):
        list(per_subject_deltas(model, params, x, y, plan, lr=0.1, method="gpu"))


def test_vectorised_does_not_modify_params_and_default_chunk_is_positive() -> None:
    model = _model("mlp")
    params = _params(model)
    before = {k: v.clone() for k, v in params.items()}
    subjects = _subjects(COUNTS)
    x, y = _features("mlp", len(subjects))
    plan = subject_batches(subjects, ORDER, epochs=1, batch_size=2, coins=Coins.seeded(0))
    list(per_subject_deltas(model, params, x, y, plan, lr=0.1))
    for k in params:
        assert torch.equal(params[k], before[k])
    assert default_chunk_size(params) >= 1


@pytest.mark.parametrize("model_name", ["mlp", "mnist_cnn"])  # vmap and stacked paths
def test_full_batch_delta_depends_only_on_the_subjects_own_records(model_name) -> None:
    """With full batches, a subject's delta is the same whether it is trained alone or with
    others (padding is masked), and does not move when other subjects' records change."""
    subjects = _subjects(COUNTS)
    x, y = _features(model_name, len(subjects))
    model = _model(model_name)
    params = _params(model)

    def deltas(order, xx):
        plan = subject_batches(subjects, order, epochs=2, batch_size=None, coins=Coins.seeded(0))
        return _gather(per_subject_deltas(model, params, xx, y, plan, lr=0.2), len(order))

    together = deltas(ORDER, x)
    others = subjects != 3
    x_changed = x.clone()
    x_changed[others] = x_changed[others] * 5.0 + 1.0
    changed = deltas(ORDER, x_changed)
    for row, a in enumerate(ORDER.tolist()):
        alone = deltas(torch.tensor([a]), x)[0]
        assert _max_abs_diff(together[row], alone) <= TOL
    assert _max_abs_diff(together[1], changed[1]) <= TOL  # subject 3 is row 1
    assert _max_abs_diff(together[0], changed[0]) > 1e-3  # subject 12 did see the change
    # others' records non-finite (as their activations would be if they overflowed):
    # subject 3's padding slots, which point at a record of the silo (here subject 12's),
    # must not turn its delta into NaN
    x_bad = x.clone()
    x_bad[others] = float("inf")
    assert int(subjects[0]) != 3  # padding points at record 0
    assert _max_abs_diff(together[1], deltas(ORDER, x_bad)[1]) <= TOL


@pytest.mark.parametrize("model_name", ["mlp", "mnist_cnn"])
def test_single_full_batch_step_is_minus_lr_times_mean_gradient(model_name) -> None:
    """ULDP-SGD's step: one full-batch gradient step on the mean loss (descent, not ascent)."""
    subjects = _subjects(COUNTS)
    x, y = _features(model_name, len(subjects))
    model = _model(model_name)
    params = _params(model)
    lr = 0.05
    plan = subject_batches(subjects, ORDER, epochs=1, batch_size=None, coins=Coins.seeded(0))
    fast = _gather(per_subject_deltas(model, params, x, y, plan, lr=lr), len(ORDER))
    for row, a in enumerate(ORDER.tolist()):
        mine = subjects == a
        grads = batch_gradient(model, params, x[mine], y[mine])
        expected = {k: -lr * g for k, g in grads.items()}
        assert _max_abs_diff(fast[row], expected) <= TOL
        # first-order decrease of the subject's loss: <Δ, ∇L> = -lr·||∇L||² < 0
        inner = sum(float((fast[row][k] * grads[k]).sum()) for k in grads)
        assert inner < 0
        norm_sq = sum(float(g.pow(2).sum()) for g in grads.values())
        assert inner == pytest.approx(-lr * norm_sq, rel=1e-9)


def test_chunks_are_trained_in_place_without_touching_earlier_chunks_or_the_inputs() -> None:
    """Parameter copies are updated in place across vmap calls and records are gathered into
    buffers reused by every step and chunk: a yielded chunk's deltas must not change while
    later chunks train, and ``params``, ``x``, ``y`` must not change at all."""
    subjects = _subjects(COUNTS)
    x, y = _features("mlp", len(subjects))
    model = _model("mlp")
    params = _params(model)
    inputs = {k: v.clone() for k, v in params.items()}, x.clone(), y.clone()
    plan = subject_batches(subjects, ORDER, epochs=2, batch_size=3, coins=Coins.seeded(5))
    kept, copies = [], []
    for rows, deltas in per_subject_deltas(model, params, x, y, plan, lr=0.3, chunk_size=1):
        kept.append((rows, deltas))
        copies.append({k: v.clone() for k, v in deltas.items()})
    assert len(kept) == len(ORDER)
    for (_, deltas), copy in zip(kept, copies, strict=True):
        assert all(torch.equal(deltas[k], copy[k]) for k in deltas)
    assert all(torch.equal(params[k], inputs[0][k]) for k in params)
    assert torch.equal(x, inputs[1]) and torch.equal(y, inputs[2])
    slow = per_subject_deltas_loop(model, params, x, y, plan, lr=0.3)
    for got, want in zip(_gather(kept, len(ORDER)), slow, strict=True):
        assert _max_abs_diff(got, want) <= TOL


def test_default_chunk_keeps_every_stacked_tensor_under_the_limit() -> None:
    """No stacked parameter or gathered batch of a chunk exceeds STACKED_TENSOR_BYTES (larger
    blocks are fresh mappings from glibc, faulted in again on every step)."""
    from silodp.privacy.per_subject import STACKED_TENSOR_BYTES

    params = _params(MLP(784, 10, hidden=64))
    record_bytes = 16 * (784 * 4 + 8)
    chunk = default_chunk_size(params, record_bytes=record_bytes)
    largest = max(v.numel() * v.element_size() for v in params.values())
    # fc1's weight, 784 x 64 float32 = 200,704 bytes per subject, is the largest stacked
    # tensor: 16 MiB holds 83 of them (the 256 MiB budget would allow 329)
    assert largest == 784 * 64 * 4
    assert chunk == 83
    assert chunk * max(largest, record_bytes) <= STACKED_TENSOR_BYTES
    assert (chunk + 1) * largest > STACKED_TENSOR_BYTES  # as many subjects as fit
    huge = {"w": torch.zeros(STACKED_TENSOR_BYTES // 2)}  # 2x the limit per subject in float32
    assert default_chunk_size(huge) == 1


class _InPlaceInput(nn.Module):
    """Adds 1 to its input in place before a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.add_(1.0))


def test_per_subject_deltas_leave_the_silo_records_untouched() -> None:
    """Sizing a chunk runs the model on one record: on a copy, so a model that writes to its
    input cannot change the silo's data from round to round."""
    model = _InPlaceInput().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(6, 4, dtype=torch.float64)
    before = x.clone()
    subjects = torch.tensor([0, 0, 1, 1, 2, 2])
    plan = subject_batches(
        subjects, torch.tensor([0, 1, 2]), epochs=1, batch_size=None, coins=Coins.seeded(0)
    )
    list(per_subject_deltas(model, params, x, torch.tensor([0, 1, 2, 0, 1, 2]), plan, lr=0.1))
    assert torch.equal(x, before)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_below_one_is_refused_naming_it(chunk_size) -> None:
    from silodp.errors import InvalidValueError

    model = _InPlaceInput().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    subjects = torch.tensor([0, 1])
    plan = subject_batches(
        subjects, torch.tensor([0, 1]), epochs=1, batch_size=None, coins=Coins.seeded(0)
    )
    x = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(InvalidValueError, match=rf"chunk_size={chunk_size}"):
        list(per_subject_deltas(model, params, x, subjects, plan, lr=0.1, chunk_size=chunk_size))


@pytest.mark.parametrize(("name", "method"), [("mlp", "vmap"), ("cnn", "stacked")])
def test_padding_slots_carry_no_other_record_label(name, method) -> None:
    """Padding slots are filled from record 0; here it belongs to a subject not trained, with
    a label no model accepts: the padded paths never read it (features and label zeroed)."""
    model = _model(name)
    params = _params(model)
    subjects = torch.tensor([9, 0, 0, 0, 1, 2, 2])  # uneven: padding in every step
    x, y = _features(name, len(subjects))
    y[0] = 99
    order = torch.tensor([0, 1, 2])
    plan = subject_batches(subjects, order, epochs=2, batch_size=2, coins=Coins.seeded(3))
    fast = _gather(per_subject_deltas(model, params, x, y, plan, lr=0.3, method=method), 3)
    slow = per_subject_deltas_loop(model, params, x, y, plan, lr=0.3)
    for a, b in zip(fast, slow, strict=True):
        assert _max_abs_diff(a, b) < 1e-12
