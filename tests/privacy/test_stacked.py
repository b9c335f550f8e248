"""Copies of a CNN run as one grouped channels-last model (``silodp.privacy.stacked``).

Each copy's logits and gradients must equal the model applied to that copy alone with its
own parameters (in float64, on images with a constant background, so max-pooling windows
hold ties and the ReLU-before-pooling rewrite is exercised where it could differ); models
that are not chains of the supported layers must be refused, not run wrongly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp.models import MLP, FemnistCNN, MnistCNN, ShakespeareLSTM, UldpCNN
from silodp.privacy.stacked import StackedModel

TOL = 1e-10
COPIES = 3


def _sequential() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, kernel_size=3, stride=2, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1, padding=1),
        nn.Conv2d(4, 3, kernel_size=2, dilation=2, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 5, bias=False),
    )


MODELS = {
    "uldp_cnn": (lambda: UldpCNN(num_classes=4, in_channels=1, side=16), (1, 16, 16)),
    "mnist_cnn": (lambda: MnistCNN(num_classes=3, in_channels=1, side=8), (1, 8, 8)),
    "femnist_cnn": (lambda: FemnistCNN(num_classes=5, in_channels=2, side=8), (2, 8, 8)),
    "sequential": (_sequential, (2, 11, 11)),
}


def _copies(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v.detach().expand(COPIES, *v.shape) + 0.1 * torch.randn(COPIES, *v.shape, generator=gen)
        for k, v in model.named_parameters()
    }


def _images(shape: tuple[int, ...], n: int, seed: int) -> torch.Tensor:
    """Images whose left half is a constant background (ties in every pooling window there;
    negative and zero pre-activations), the rest noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(COPIES, n, *shape, generator=gen, dtype=torch.float64)
    x[..., : shape[-1] // 2] = 0.0
    return x


@pytest.mark.parametrize("name", list(MODELS))
def test_each_copy_gets_its_own_logits_and_gradients(name: str) -> None:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    stacked = StackedModel.trace(model)
    assert stacked is not None
    params = _copies(model, seed=1)
    x = _images(shape, n=4, seed=2)
    y = torch.randint(0, 3, (COPIES, 4), generator=torch.Generator().manual_seed(3))

    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    logits = stacked(leaves, x)
    assert logits.shape[:2] == (COPIES, 4)
    loss = sum(F.cross_entropy(logits[s], y[s]) for s in range(COPIES))
    grads = torch.autograd.grad(loss, list(leaves.values()))

    for s in range(COPIES):
        own = {k: v[s].clone().requires_grad_(True) for k, v in params.items()}
        expected = functional_call(model, own, (x[s],))
        assert float((logits[s] - expected).detach().abs().max()) <= TOL
        own_grads = torch.autograd.grad(F.cross_entropy(expected, y[s]), list(own.values()))
        for k, g, g_own in zip(leaves, grads, own_grads, strict=True):
            assert float((g[s] - g_own).abs().max()) <= TOL, k
            assert float(g_own.abs().max()) > 0 or k.endswith("bias"), k  # the copy trained


def test_relu_before_pooling_is_run_after_it_unless_the_pooling_pads() -> None:
    stacked = StackedModel.trace(UldpCNN(num_classes=10))
    assert stacked is not None
    kinds = [op.kind for op in stacked.ops]
    assert kinds == [
        "conv", "maxpool", "relu", "conv", "maxpool", "relu",
        "flatten", "linear", "relu", "linear",
    ]  # fmt: skip
    padded = StackedModel.trace(_sequential())  # MaxPool2d(2, stride=1, padding=1)
    assert padded is not None
    assert [op.kind for op in padded.ops][:3] == ["conv", "relu", "maxpool"]


def test_records_must_be_stacked_images() -> None:
    stacked = StackedModel.trace(MnistCNN(num_classes=3, side=8))
    assert stacked is not None
    params = {k: v.detach().expand(2, *v.shape) for k, v in MnistCNN(3, side=8).named_parameters()}
    with pytest.raises(ValueError, match=r"\(S, n, C, H, W\), got \(2, 4, 64\)"):
        stacked(params, torch.zeros(2, 4, 64))


class _ConvHead(nn.Module):
    """conv, then ``middle(x, conv)``'s result flattened into a linear head."""

    def __init__(self, middle) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, kernel_size=3, padding=1)
        self.fc = nn.Linear(16, 2)
        self.middle = middle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.middle(x, self.conv).flatten(1))


def _conv_then_linear(conv: nn.Conv2d) -> nn.Module:
    return nn.Sequential(conv, nn.Flatten(), nn.Linear(16, 2))


CASES = {
    "no convolution": lambda: MLP(5, 3),
    "lstm": lambda: ShakespeareLSTM(num_classes=10),
    "residual add": lambda: _ConvHead(lambda x, conv: x + conv(x)),
    "sigmoid": lambda: _ConvHead(lambda x, conv: torch.sigmoid(conv(x))),
    "in-place relu": lambda: _ConvHead(lambda x, conv: F.relu(conv(x), inplace=True)),
    "supported head": lambda: _ConvHead(lambda x, conv: torch.relu(conv(x))),
    "grouped conv": lambda: _conv_then_linear(nn.Conv2d(2, 2, 3, padding=1, groups=2)),
    "padding by name": lambda: _conv_then_linear(nn.Conv2d(1, 1, 3, padding="same")),
    "reflect padding": lambda: _conv_then_linear(
        nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")
    ),
    "pooling with indices": lambda: nn.Sequential(
        nn.Conv2d(1, 1, 3), nn.MaxPool2d(2, return_indices=True)
    ),
    "ends with images": lambda: nn.Sequential(nn.Conv2d(1, 1, 3), nn.ReLU()),
    "linear on images": lambda: nn.Sequential(nn.Conv2d(1, 1, 3), nn.Linear(2, 2), nn.Flatten()),
    "pooling after flatten": lambda: nn.Sequential(
        nn.Conv2d(1, 1, 3), nn.Flatten(), nn.MaxPool2d(2), nn.Linear(2, 2)
    ),
    "forward hook": lambda: _hooked(_ConvHead(lambda x, conv: torch.relu(conv(x)))),
    "backward pre-hook": lambda: _backward_pre_hooked(
        _ConvHead(lambda x, conv: torch.relu(conv(x)))
    ),
    "subclassed conv": lambda: _conv_then_linear(_ScaledConv(1, 1, 3, padding=1)),
    "patched forward": lambda: _patched(_conv_then_linear(nn.Conv2d(1, 1, 3, padding=1))),
    "tied weights": lambda: _tied(),
}


class _ScaledConv(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3 * super().forward(x)


def _hooked(model: nn.Module) -> nn.Module:
    model.conv.register_forward_hook(lambda _m, _i, out: out * 2)
    return model


def _backward_pre_hooked(model: nn.Module) -> nn.Module:
    model.conv.register_full_backward_pre_hook(lambda _m, grad: (grad[0] * 10,))
    return model


def _patched(model: nn.Module) -> nn.Module:
    conv = model[0]
    original = conv.forward
    conv.forward = lambda x: 3 * original(x)
    return model


def _tied() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(1, 1, 3, padding=1), nn.Conv2d(1, 1, 3, padding=1), nn.Flatten(), nn.Linear(16, 2)
    )
    model[1].weight = model[0].weight
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_models_outside_the_supported_chains_are_refused(name: str) -> None:
    model = CASES[name]()
    stacked = StackedModel.trace(model)
    if name == "supported head":  # the same module with supported layers: traced
        assert stacked is not None
        assert [op.kind for op in stacked.ops] == ["conv", "relu", "flatten", "linear"]
        return
    assert stacked is None


def test_global_module_hooks_are_refused() -> None:
    model = _ConvHead(lambda x, conv: torch.relu(conv(x)))
    assert StackedModel.trace(model) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda _m, _i, out: out)
    try:
        assert StackedModel.trace(model) is None
    finally:
        handle.remove()
    assert StackedModel.trace(model) is not None


def _instance_override(name: str) -> nn.Module:
    model = _conv_then_linear(nn.Conv2d(1, 1, 3, padding=1))
    conv = model[0]
    original = getattr(conv, name)
    setattr(conv, name, lambda *args: 3 * original(*args))
    return model


@pytest.mark.parametrize("name", ["_conv_forward", "_call_impl"])
def test_layers_with_an_overridden_method_are_refused(name) -> None:
    assert StackedModel.trace(_instance_override(name)) is None


def test_a_root_with_a_patched_forward_is_refused() -> None:
    model = _ConvHead(lambda x, conv: torch.relu(conv(x)))
    original = model.forward
    model.forward = lambda x: 2 * original(x)
    assert StackedModel.trace(model) is None


def test_a_class_level_patch_of_a_stock_layer_is_refused(monkeypatch) -> None:
    model = _conv_then_linear(nn.Conv2d(1, 1, 3, padding=1))
    assert StackedModel.trace(model) is not None
    original = nn.Conv2d.forward
    monkeypatch.setattr(nn.Conv2d, "forward", lambda self, x: 3 * original(self, x))
    assert StackedModel.trace(model) is None
