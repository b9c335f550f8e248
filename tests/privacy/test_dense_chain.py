"""The MLP passes written out (``silodp.privacy.dense_chain``).

They must give every linear layer the inputs and output gradients that hooks and autograd
record, be what the ghost clipper uses for MLPs, and step aside (the clipper then uses the
hooks) wherever they would compute something else: models that are not MLP chains, hooks
added after tracing, labels ``F.cross_entropy`` ignores or refuses, inputs that are not one
row per record.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from silodp.models import MLP, build_model
from silodp.privacy.dense_chain import DenseChain
from silodp.privacy.ghost import GhostClipper
from silodp.privacy.gradients import clip_factors, per_example_gradients, per_example_norms


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) + x)


class Twice(nn.Module):
    """One layer applied twice: a chain, but its gradients are the sum of two calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.relu(self.a(x)))


class MyLinear(nn.Linear):
    pass


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return {
        "mlp": (MLP(12, 5, hidden=7), (3, 4)),
        "deep_no_bias": (
            nn.Sequential(
                nn.Flatten(),
                nn.Linear(12, 8, bias=False),
                nn.ReLU(),
                nn.Linear(8, 6),
                nn.ReLU(),
                nn.Linear(6, 5, bias=False),
            ),
            (2, 6),
        ),
        # a ReLU on the input and two in a row; no flatten, flat input
        "relu_first": (
            nn.Sequential(nn.ReLU(), nn.Linear(12, 9), nn.ReLU(), nn.ReLU(), nn.Linear(9, 5)),
            (12,),
        ),
        "one_layer": (nn.Sequential(nn.Flatten(), nn.Linear(12, 5)), (12,)),
        "inplace_relu": (
            nn.Sequential(nn.Linear(12, 6), nn.ReLU(inplace=True), nn.Linear(6, 5)),
            (12,),
        ),
    }


def _hooked(clipper: GhostClipper, *args):
    return {name: (a[0], g[0]) for name, _, a, g in clipper._hooked_capture(*args)}


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize("scaled", [False, True])
def test_capture_equals_hooks_and_autograd(name, scaled) -> None:
    model, shape = _models()[name]
    model = model.double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (9,), generator=gen)
    scale = torch.rand(9, generator=gen, dtype=torch.float64) if scaled else None
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    dense = DenseChain.trace(model)
    assert dense is not None, name
    got = dense.capture(params, x, y, scale)
    assert got is not None
    expected = _hooked(GhostClipper(model), params, x, y, scale)
    assert [n for n, *_ in got] == [n for n in expected]  # every layer, in chain order
    for layer, _, a, g in got:
        torch.testing.assert_close(a, expected[layer][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, expected[layer][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_ghost_clipper_uses_it_for_mlps_and_matches_vmap(monkeypatch, compiled) -> None:
    """The written-out passes (``compiled=False``), or the compiled path built on the same
    trace; either way no hooks."""
    model = build_model("mlp", (1, 4, 4), 6).double()
    clipper = GhostClipper(model, compiled=compiled)
    assert clipper._chain is not None

    def refuse(*args, **kwargs):
        raise AssertionError("the hooks (or, compiled, the torch passes) were used")

    monkeypatch.setattr(clipper, "_hooked_capture", refuse)
    if compiled:
        monkeypatch.setattr(clipper, "_capture", refuse)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 1, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 6, (11,), generator=gen)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    norms, summed = clipper.norms_and_sum(params, x, y, clip=0.05)
    grads = per_example_gradients(model, params, x, y)
    expected_norms = per_example_norms(grads)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-10, atol=1e-12)
    factors = clip_factors(expected_norms, 0.05)
    for key, g in grads.items():
        expected = (g * factors.reshape(-1, *[1] * (g.dim() - 1))).sum(0)
        torch.testing.assert_close(summed[key], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "model",
    [
        Residual(),
        Twice(),
        nn.Sequential(nn.Linear(6, 4), nn.GELU(), nn.Linear(4, 3)),
        nn.Sequential(MyLinear(6, 4), nn.ReLU(), nn.Linear(4, 3)),
        nn.Sequential(nn.ReLU(), nn.Flatten()),  # no linear layer
        nn.Sequential(nn.Linear(6, 4), nn.Flatten(), nn.Linear(4, 3)),  # flatten inside
        build_model("mnist_cnn", (1, 8, 8), 3),
    ],
    ids=[
        "residual",
        "twice",
        "gelu",
        "subclass",
        "no_linear",
        "inner_flatten",
        "cnn",
    ],
)
def test_other_models_are_not_traced(model) -> None:
    assert DenseChain.trace(model) is None


def test_hooks_added_after_tracing_send_the_clipper_back_to_the_hooks() -> None:
    model = build_model("mlp", (6,), 3).double()
    clipper = GhostClipper(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1])
    before, _ = clipper.norms_and_sum(params, x, y, clip=10.0)
    model.fc1.register_forward_pre_hook(lambda mod, args: (args[0] * 3.0,))
    assert clipper._chain is not None and clipper._chain.capture(params, x, y, None) is None
    after, _ = clipper.norms_and_sum(params, x, y, clip=10.0)
    expected = per_example_norms(per_example_gradients(model, params, x, y))
    torch.testing.assert_close(after, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(after, before)  # the hook changed the gradients


def test_ignored_labels_fall_back_to_cross_entropy() -> None:
    model = build_model("mlp", (6,), 3).double()
    clipper = GhostClipper(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y = torch.tensor([0, -100, 2, 1])  # F.cross_entropy's ignore_index: no loss, no gradient
    assert clipper._chain is not None and clipper._chain.capture(params, x, y, None) is None
    norms, _ = clipper.norms_and_sum(params, x, y, clip=1.0)
    assert float(norms[1]) == 0.0 and bool((norms[[0, 2, 3]] > 0).all())


@pytest.mark.parametrize("label", [3, -1])
def test_labels_out_of_range_are_refused_as_by_cross_entropy(label) -> None:
    model = build_model("mlp", (6,), 3)
    clipper = GhostClipper(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    y = torch.tensor([0, label])
    assert clipper._chain is not None
    assert clipper._chain.capture(params, torch.randn(2, 6), y, None) is None
    with pytest.raises((IndexError, RuntimeError)):
        clipper.norms_and_sum(params, torch.randn(2, 6), y, clip=1.0)


def test_inputs_with_positions_use_the_hooks() -> None:
    # no flatten: the layers apply to the last dimension of (B, T, d) inputs
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).double()

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).mean(1)

    dense = DenseChain.trace(model)
    assert dense is not None
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert dense.capture(params, x, torch.tensor([0, 1]), None) is None
    assert DenseChain.trace(Pooled()) is None  # the mean is not a chain operation


class Custom(nn.Module):
    """An MLP by hand: its forward could branch on attributes, so it is not traced."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_only_sequential_and_the_library_mlp_are_traced() -> None:
    assert DenseChain.trace(Custom()) is None
    assert DenseChain.trace(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)))
    assert DenseChain.trace(build_model("mlp", (6,), 3)) is not None


def test_a_replaced_layer_rebuilds_the_cached_clipper() -> None:
    from silodp.privacy.ghost import clipper_for

    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    first = clipper_for(model)
    assert clipper_for(model) is first
    first.norms_and_sum(params, x, y, clip=1.0)
    model[1] = nn.Tanh()  # no longer a chain of linear layers and ReLUs
    again = clipper_for(model)
    assert again is not first and again._chain is None
    norms, _ = again.norms_and_sum(params, x, y, clip=1.0)
    expected = per_example_norms(per_example_gradients(model, params, x, y))
    torch.testing.assert_close(norms, expected, rtol=1e-10, atol=1e-12)


def test_a_model_writing_to_its_input_leaves_the_callers_batch_alone() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            x.mul_(0.5)
            return torch.relu_(out)  # changes the recorded output: the pass runs again

    model = Writes().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    before = x.clone()
    y = torch.tensor([0, 1, 2, 0, 1])
    norms, _ = GhostClipper(model).norms_and_sum(params, x, y, clip=1.0)
    assert torch.equal(x, before)

    class Same(nn.Module):  # the same function without the write (autograd refuses it)
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x))

    expected = per_example_norms(per_example_gradients(Same().double(), params, x, y))
    torch.testing.assert_close(norms, expected, rtol=1e-10, atol=1e-12)


def test_a_custom_module_inside_a_sequential_is_not_traced() -> None:
    class Gate(nn.Module):  # fx traces through it and would freeze its branch
        def __init__(self) -> None:
            super().__init__()
            self.skip = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 0 if self.skip else x

    model = nn.Sequential(nn.Linear(6, 5), Gate(), nn.ReLU(), nn.Linear(5, 3))
    assert DenseChain.trace(model) is None
    assert DenseChain.trace(build_model("linear", (2, 3), 4)) is not None
