"""The arithmetic floor of ``silodp bench uldp``: multiply-adds of a training step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from silodp.bench import floor
from silodp.bench.floor import peak_mac_rate, training_macs
from silodp.models import build_model


def _macs(model: nn.Module, example: torch.Tensor) -> int:
    return training_macs(model, dict(model.named_parameters()), example)


def test_training_macs_of_the_uldp_papers_cnn_by_hand() -> None:
    conv1 = 24 * 24 * 10 * (1 * 5 * 5)  # forward and weights' gradient; its input needs none
    conv2 = 8 * 8 * 20 * (10 * 5 * 5)  # forward, weights' and input's gradients
    dense = 320 * 50 + 50 * 10
    expected = 2 * conv1 + 3 * conv2 + 3 * dense
    assert expected == 1_297_500
    assert _macs(build_model("uldp_cnn", (1, 28, 28), 10), torch.zeros(1, 1, 28, 28)) == expected


def test_training_macs_leave_out_products_with_zero_padding() -> None:
    """mnist_cnn's 3×3 convolutions have padding 1: along a side of n, 3n - 2 of the 3n
    (position, tap) pairs land on the image."""
    conv1 = (3 * 28 - 2) ** 2 * 16 * 1
    conv2 = (3 * 14 - 2) ** 2 * 32 * 16
    dense = 32 * 7 * 7 * 64 + 64 * 10
    expected = 2 * conv1 + 3 * conv2 + 3 * dense
    assert _macs(build_model("mnist_cnn", (1, 28, 28), 10), torch.zeros(1, 1, 28, 28)) == expected


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(
    ("padding", "padding_mode"), [(0, "zeros"), (2, "zeros"), ("same", "zeros"), (2, "reflect")]
)
def test_training_macs_of_a_grouped_strided_dilated_convolution_by_brute_force(
    padding: int | str, padding_mode: str
) -> None:
    stride = 1 if padding == "same" else 2
    conv = nn.Conv2d(
        4,
        6,
        (3, 2),
        stride=stride,
        padding=padding,
        dilation=(2, 3),
        groups=2,
        padding_mode=padding_mode,
    )
    x = torch.zeros(1, 4, 11, 9)
    out = conv(x).shape[-2:]
    pad = (conv._reversed_padding_repeated_twice[2], conv._reversed_padding_repeated_twice[0])
    real = 0  # (output position, tap) pairs on the image, counted one by one
    for i in range(out[0]):
        for j in range(out[1]):
            for a in range(3):
                for b in range(2):
                    row = i * conv.stride[0] + a * 2 - pad[0]
                    col = j * conv.stride[1] + b * 3 - pad[1]
                    inside = 0 <= row < 11 and 0 <= col < 9
                    real += inside or padding_mode != "zeros"
    # one layer on the record itself: forward and the weights' gradient
    assert _macs(conv, x) == 2 * real * 6 * (4 // 2)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("uldp_cnn", (1, 28, 28)),
        ("mlp", (64,)),
        ("linear", (20,)),
    ],
)
def test_training_macs_equal_torch_flop_counter_of_a_real_step(
    name: str, shape: tuple[int, ...]
) -> None:
    """PyTorch's own counter, run on an actual forward and backward pass (gradients of the
    parameters only, as per-subject training takes them), counts 2 flops per multiply-add
    (models without padding, where the two counts mean the same)."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    padded = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.padding != (0, 0)]
    assert not padded, f"{name} pads its convolutions: the two counts differ there"
    x = torch.randn(1, *shape)
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(model(x), torch.tensor([3]))
        torch.autograd.grad(loss, list(model.parameters()))
    assert _macs(model, x) * 2 == counter.get_total_flops()


def test_training_macs_count_an_input_gradient_only_where_it_is_needed() -> None:
    """After an embedding the first linear layer's input depends on a parameter."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 5))
    x = torch.tensor([[1, 2, 3]])
    assert _macs(model, x) == 3 * 12 * 5
    assert _macs(nn.Sequential(nn.ReLU()), torch.zeros(1, 3)) == 0


def test_training_macs_reject_a_batch_of_several_records() -> None:
    model = build_model("mlp", (64,), 10)
    with pytest.raises(ValueError, match=r"batch of one record, got shape \(2, 64\)"):
        _macs(model, torch.zeros(2, 64))


def test_peak_mac_rate_is_the_faster_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([2.0, 0.5])  # the matrix product, then the convolution
    monkeypatch.setattr(floor, "_fastest", lambda run, repeats: next(times))
    images = torch.zeros(32, 64, 32, 32)
    with FlopCounterMode(display=False) as counter:
        F.conv2d(images, torch.zeros(64, 64, 3, 3))
    conv_macs = counter.get_total_flops() // 2
    assert peak_mac_rate() == max(1024**3 / 2.0, conv_macs / 0.5)
    times = iter([0.001, 1.0])
    assert peak_mac_rate() == 1024**3 / 0.001


def test_peak_mac_rate_times_real_kernels() -> None:
    # a 2-core CPU makes between 10^8 and 10^13 single-precision multiply-adds a second
    assert 1e8 < peak_mac_rate(repeats=1) < 1e13
