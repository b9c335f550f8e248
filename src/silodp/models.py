"""Models selected by name in a config.

* ``femnist_cnn`` — the LEAF FEMNIST CNN (two 5x5 conv + pool, dense 2048, 62 classes).
* ``shakespeare_lstm`` — LEAF's stacked character LSTM (embedding 8, 2 x LSTM 256, linear head).
* ``mnist_cnn`` — a small CNN for 28x28 (or 8x8) grey images.
* ``mlp`` — a two-layer perceptron for flat or tabular features.
* ``linear`` — softmax regression on the flattened features (each input feature owns one
  column of the weight matrix; ``silodp audit`` trains it).

Models use no batch-norm (per-example gradients need per-example independence); dropout is
left out for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from silodp._validation import check_choice, check_int

__all__ = ["MODELS", "build_model"]


class FemnistCNN(nn.Module):
    """LEAF's FEMNIST CNN (Caldas et al., 2018) for 1x28x28 images."""

    def __init__(self, num_classes: int = 62, in_channels: int = 1, side: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(2)
        reduced = side // 4
        self.fc1 = nn.Linear(64 * reduced * reduced, 2048)
        self.fc2 = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MnistCNN(nn.Module):
    """A small CNN: conv 16 -> pool -> conv 32 -> pool -> dense 64."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, side: int = 28) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(2)
        reduced = side // 4
        self.fc1 = nn.Linear(32 * reduced * reduced, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class UldpCNN(nn.Module):
    """The ULDP-FL paper's MNIST model (21,840 parameters at 28x28): conv 1->10 5x5, max-pool,
    conv 10->20 5x5, max-pool, dense 320->50->10, ReLU between (the architecture of PyTorch's
    classic MNIST example; the paper's dropout is left out)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, side: int = 28) -> None:
        super().__init__()
        reduced = ((side - 4) // 2 - 4) // 2
        if reduced < 1:
            raise ValueError(
                f"Expected images of side >= 14 for uldp_cnn (two 5x5 convolutions and two "
                f"2x2 poolings), got side {side}."
            )
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(20 * reduced * reduced, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class Linear(nn.Module):
    """Flatten, one linear layer: softmax regression."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(num_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """Flatten, one hidden ReLU layer, linear head."""

    def __init__(self, num_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(num_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class LinearLSTM(nn.Module):
    """A stacked LSTM built from ``nn.Linear`` layers (same maths as ``nn.LSTM``).

    Per layer: ``gates = W_ih x_t + W_hh h_{t-1} + b`` (input projection of all steps at once,
    recurrent projection per step). Made of linear layers so per-example gradient norms come
    from activations and output gradients (see :mod:`silodp.privacy.ghost`), where ``vmap``
    over ``nn.LSTM`` falls back to a per-example loop.
    """

    def __init__(self, input_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.input_proj = nn.ModuleList(
            nn.Linear(input_size if i == 0 else hidden, 4 * hidden) for i in range(num_layers)
        )
        self.recurrent = nn.ModuleList(
            nn.Linear(hidden, 4 * hidden, bias=False) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        out = x
        for proj, rec in zip(self.input_proj, self.recurrent, strict=True):
            projected = proj(out)  # (B, T, 4H)
            h = x.new_zeros(batch, self.hidden)
            c = x.new_zeros(batch, self.hidden)
            hs = []
            for t in range(steps):
                gates = projected[:, t] + rec(h)
                i, f, g, o = gates.chunk(4, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                hs.append(h)
            out = torch.stack(hs, dim=1)
        return out


class ShakespeareLSTM(nn.Module):
    """LEAF's next-character model: embedding 8, two stacked LSTM(256), linear head."""

    def __init__(self, num_classes: int = 80, embed_dim: int = 8, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, embed_dim)
        self.lstm = LinearLSTM(embed_dim, hidden, num_layers=2)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[:, -1, :])


def _image_side(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(f"Expected image features of shape (C, H, H), got {shape}.")
    return shape[0], shape[1]


def _femnist(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, side = _image_side(shape)
    return FemnistCNN(num_classes, channels, side)


def _mnist(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, side = _image_side(shape)
    return MnistCNN(num_classes, channels, side)


def _uldp_cnn(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, side = _image_side(shape)
    return UldpCNN(num_classes, channels, side)


def _mlp(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(math.prod(shape), num_classes)


def _linear(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return Linear(math.prod(shape), num_classes)


def _lstm(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(shape) != 1:
        raise ValueError(f"Expected token-id features of shape (seq_len,), got {shape}.")
    return ShakespeareLSTM(num_classes)


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "femnist_cnn": _femnist,
    "mnist_cnn": _mnist,
    "uldp_cnn": _uldp_cnn,
    "mlp": _mlp,
    "linear": _linear,
    "shakespeare_lstm": _lstm,
}


def build_model(
    name: str, feature_shape: tuple[int, ...], num_classes: int, *, seed: int = 0
) -> nn.Module:
    """Builds model ``name`` for records of ``feature_shape``; weights seeded by ``seed``."""
    check_choice("model", name, MODELS)
    check_int("num_classes", num_classes, 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](tuple(feature_shape), num_classes)
