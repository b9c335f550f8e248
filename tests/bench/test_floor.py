"""The arithmetic floor of ``silodp bench uldp``: multiply-adds of a training step."""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from silodp.bench.floor import peak_rate, training_macs
from silodp.models import build_model


def test_training_macs_of_the_uldp_papers_cnn_by_hand() -> None:
    model = build_model("uldp_cnn", (1, 28, 28), 10)
    params = dict(model.named_parameters())
    conv1 = 24 * 24 * 10 * (1 * 5 * 5)  # forward and weights' gradient; its input needs none
    conv2 = 8 * 8 * 20 * (10 * 5 * 5)  # forward, weights' and input's gradients
    dense = 320 * 50 + 50 * 10
    expected = 2 * conv1 + 3 * conv2 + 3 * dense
    assert expected == 1_297_500
    assert training_macs(model, params, torch.zeros(1, 1, 28, 28)) == expected


@pytest.mark.parametrize(
    ("name", "shape"),
    [("uldp_cnn", (1, 28, 28)), ("mnist_cnn", (1, 28, 28)), ("mlp", (64,)), ("linear", (20,))],
)
def test_training_macs_equal_torch_flop_counter_of_a_real_step(
    name: str, shape: tuple[int, ...]
) -> None:
    """PyTorch's own counter, run on an actual forward and backward pass (gradients of the
    parameters only, as per-subject training takes them), counts 2 flops per multiply-add."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    params = dict(model.named_parameters())
    x = torch.randn(1, *shape)
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(model(x), torch.tensor([3]))
        torch.autograd.grad(loss, list(params.values()))
    assert training_macs(model, params, x) * 2 == counter.get_total_flops()


def test_peak_rate_is_at_least_a_matrix_products_rate() -> None:
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    started = time.perf_counter()
    torch.mm(a, b)
    product = size**3 / (time.perf_counter() - started)
    rate = peak_rate(repeats=3)
    # a 2-core CPU makes between 10^8 and 10^13 single-precision multiply-adds a second;
    # peak_rate takes the fastest of several products (and convolutions), so it is not
    # much below one timed product (a factor 2 covers a slow moment of its own)
    assert 1e8 < rate < 1e13
    assert rate > product / 2
