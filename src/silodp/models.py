"""Models selected by name in a config.

* ``femnist_cnn`` — the LEAF FEMNIST CNN (two 5x5 conv + pool, dense 2048, 62 classes).
* ``shakespeare_lstm`` — LEAF's stacked character LSTM (embedding 8, 2 x LSTM 256, linear head).
* ``mnist_cnn`` — a small CNN for 28x28 (or 8x8) grey images.
* ``mlp`` — a two-layer perceptron for flat or tabular features.
* ``linear`` — softmax regression on the flattened features (each input feature owns one
  column of the weight matrix; ``silodp audit`` trains it).

Models use no batch-norm (per-example gradients need per-example independence); dropout is
left out for the same reason.

Each model reads one kind of input (:data:`MODEL_INPUTS`): ``shakespeare_lstm`` integer token
ids, every other model real-valued features. :func:`build_model` refuses features of the other
kind when given their dtype, and the embedding model refuses real-valued input when called.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from silodp._validation import check_choice, check_int
from silodp.errors import InvalidValueError

__all__ = [
    "MODELS",
    "MODEL_INPUTS",
    "build_model",
    "check_model_input",
    "dtype_name",
    "input_mismatch",
]


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
            raise InvalidValueError(
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
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise InvalidValueError(
                f"Expected integer token ids for shakespeare_lstm (an embedding model), got "
                f"{dtype_name(x.dtype)} features of shape {tuple(x.shape[1:])}; real-valued "
                "features (a table, images) need a dense model such as mlp."
            )
        return self.head(self.lstm(self.embed(x))[:, -1, :])


def _image_side(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 3 or shape[1] != shape[2]:
        raise InvalidValueError(f"Expected image features of shape (C, H, H), got {shape}.")
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
        raise InvalidValueError(f"Expected token-id features of shape (seq_len,), got {shape}.")
    return ShakespeareLSTM(num_classes)


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "femnist_cnn": _femnist,
    "mnist_cnn": _mnist,
    "uldp_cnn": _uldp_cnn,
    "mlp": _mlp,
    "linear": _linear,
    "shakespeare_lstm": _lstm,
}


#: What each model reads: ``"tokens"`` (integer token ids) or ``"real"`` (real-valued
#: features), and the shape it takes, for messages.
MODEL_INPUTS: dict[str, tuple[str, str]] = {
    "femnist_cnn": ("real", "real-valued images of shape (C, H, H)"),
    "mnist_cnn": ("real", "real-valued images of shape (C, H, H)"),
    "uldp_cnn": ("real", "real-valued images of shape (C, H, H) with H >= 14"),
    "mlp": ("real", "real-valued features of any shape (flattened)"),
    "linear": ("real", "real-valued features of any shape (flattened)"),
    "shakespeare_lstm": (
        "tokens",
        "integer token ids of shape (seq_len,), each below the number of classes",
    ),
}


def dtype_name(dtype: np.dtype | torch.dtype | str) -> str:
    """``float32``, ``int64``: a numpy or torch dtype as messages name it."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(np.dtype(dtype))


def _input_kind(dtype: np.dtype | torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            return "real"
        return "tokens"
    return "tokens" if np.dtype(dtype).kind in "iu" else "real"


def input_mismatch(name: str, dtype: np.dtype | torch.dtype | str) -> str | None:
    """Why model ``name`` cannot read features of ``dtype`` (``None``: it can), e.g. "these
    are integer token ids, which need shakespeare_lstm"."""
    kind = MODEL_INPUTS.get(name, (None, ""))[0]
    if kind is None or _input_kind(dtype) == kind:
        return None  # a model registered without a declared input is not checked
    if kind == "real":
        return "these are integer token ids (e.g. LEAF Shakespeare), which need shakespeare_lstm"
    return (
        "these are real-valued features, which need a dense model such as mlp (a table's "
        "columns) or mnist_cnn (images)"
    )


def check_model_input(
    name: str, feature_shape: tuple[int, ...], dtype: np.dtype | torch.dtype | str
) -> None:
    """Refuses features whose dtype model ``name`` cannot read: integer token ids for a dense
    model, real-valued features for the embedding model.

    Raises:
      InvalidValueError: the features are of the other kind.
    """
    check_choice("model", name, MODELS)
    why = input_mismatch(name, dtype)
    if why is not None:
        raise InvalidValueError(
            f"Expected {MODEL_INPUTS[name][1]} for model {name!r}, got features of dtype "
            f"{dtype_name(dtype)} and shape {tuple(feature_shape)}: {why}."
        )


def build_model(
    name: str,
    feature_shape: tuple[int, ...],
    num_classes: int,
    *,
    seed: int = 0,
    dtype: np.dtype | torch.dtype | str | None = None,
) -> nn.Module:
    """Builds model ``name`` for records of ``feature_shape``; weights seeded by ``seed``.

    ``dtype``: the features' dtype, where known: a model that cannot read that kind of
    feature is refused (:func:`check_model_input`).

    Raises:
      InvalidValueError: an unknown model, or features of a shape or dtype it cannot read.
    """
    check_choice("model", name, MODELS)
    check_int("num_classes", num_classes, 2)
    if dtype is not None:
        check_model_input(name, tuple(feature_shape), dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](tuple(feature_shape), num_classes)
