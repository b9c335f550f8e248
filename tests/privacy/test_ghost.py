"""The fast per-example path equals materialised per-example gradients on every layer type."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from silodp.models import build_model
from silodp.privacy import ghost
from silodp.privacy.ghost import GhostClipper, supported
from silodp.privacy.gradients import (
    CLIP_MARGIN,
    clip_factors,
    per_example_gradients,
    per_example_norms,
    subject_average_weights,
    weighted_sum,
)
from silodp.privacy.randomness import Coins


class ConvZoo(nn.Module):
    """Strided, padded and dilated convolutions, a bias-free linear layer and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 3, kernel_size=3, stride=2, padding=1)
        self.c2 = nn.Conv2d(3, 4, kernel_size=(2, 3), dilation=(1, 2), bias=False)
        self.fc = nn.Linear(4 * 4 * 1, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten(1))


class SharedConv(nn.Module):
    """One convolution applied twice (weight sharing: per-example gradients add up)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 2, kernel_size=3, padding=1)
        self.fc = nn.Linear(2 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.c(torch.tanh(self.c(x)))).flatten(1))


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 3)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(x).mean(dim=1))


def _cases(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    yield "mlp", build_model("mlp", (1, 8, 8), 10), torch.randn(6, 1, 8, 8, generator=gen), 10
    yield (
        "mnist_cnn",
        build_model("mnist_cnn", (1, 8, 8), 10),
        torch.randn(6, 1, 8, 8, generator=gen),
        10,
    )
    yield (
        "uldp_cnn",
        build_model("uldp_cnn", (1, 16, 16), 10),
        torch.randn(6, 1, 16, 16, generator=gen),
        10,
    )
    yield "conv_zoo", ConvZoo(), torch.randn(6, 2, 9, 9, generator=gen), 5
    yield "shared_conv", SharedConv(), torch.randn(6, 2, 5, 5, generator=gen), 3
    # repeated tokens within an example exercise the embedding's ghost norm
    yield "tokens", Tokens(), torch.randint(0, 3, (6, 7), generator=gen), 4
    yield (
        "shakespeare_lstm",
        build_model("shakespeare_lstm", (9,), 80),
        torch.randint(0, 80, (4, 9), generator=gen),
        80,
    )


@pytest.fixture(params=["per_example", "gram", "compiled"])
def route(request, monkeypatch) -> str:
    """The ways a layer's norms are computed: materialised per-example gradients where they
    are small, Gram matrices otherwise (forced here by a zero size limit), both through
    torch (``compiled=False``); or, for a plain MLP, the compiled path
    (:mod:`silodp.privacy.dense_kernel`; the other models then take the first route)."""
    if request.param == "gram":
        monkeypatch.setattr(ghost, "PER_EXAMPLE_LIMIT", 0)
    return request.param


def _slack(tol: float) -> float:
    """How far above the exact norm the clipper's norms may lie: they are upper bounds that
    include the rounding of Gram sums (``ghost._norm_bounds``): negligible in float64, up to
    ~1e-2 relative in float32 for convolutions' many positions."""
    return tol if tol < 1e-6 else 2e-2


def _assert_bounds(got: torch.Tensor, exact: torch.Tensor, tol: float, name: str) -> None:
    """``got`` at least the exact norms (up to the reference's own rounding) and at most
    :func:`_slack` above them."""
    assert bool((got >= exact * (1 - tol) - tol * 1e-3).all()), (name, got, exact)
    assert bool((got <= exact * (1 + _slack(tol)) + tol * 1e-3).all()), (name, got, exact)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("with_subjects", [False, True])
def test_fast_path_equals_materialised_per_example_gradients(
    dtype, tol, with_subjects, route
) -> None:
    for name, model, x, classes in _cases(dtype):
        model = model.to(dtype)
        if x.is_floating_point():
            x = x.to(dtype)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        y = torch.arange(x.shape[0]) % classes
        subjects = torch.tensor([0, 0, 1, 2, 2, 2])[: x.shape[0]]
        weigh = (lambda f, s=subjects: subject_average_weights(f, s)) if with_subjects else None
        grads = per_example_gradients(model, params, x, y)
        norms = per_example_norms(grads)
        factors = clip_factors(norms, 0.3)
        expected = weighted_sum(grads, factors if weigh is None else weigh(factors))
        clipper = GhostClipper(model, compiled=route == "compiled")
        assert clipper.fast, name
        got_norms, got = clipper.norms_and_sum(params, x, y, clip=0.3, weigh=weigh)
        _assert_bounds(got_norms, norms, tol, name)
        assert got.keys() == expected.keys()
        for key in expected:
            scale = float(expected[key].abs().max()) + 1e-30
            err = float((got[key] - expected[key]).abs().max()) / scale
            assert err <= _slack(tol), (name, key, err)


def test_unsupported_layer_falls_back_with_a_warning(caplog) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    assert supported(model) == ["1 (LayerNorm)"]
    with caplog.at_level(logging.WARNING, logger="silodp"):
        clipper = GhostClipper(model)
    assert not clipper.fast
    assert "1 (LayerNorm)" in caplog.text
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 1])
    grads = per_example_gradients(model, params, x, y)
    expected = weighted_sum(grads, clip_factors(per_example_norms(grads), 1.0))
    _, got = clipper.norms_and_sum(params, x, y, clip=1.0)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])


def test_norms_respect_the_clip_in_the_sum() -> None:
    model = build_model("mlp", (4,), 3).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 50
    norms, summed = GhostClipper(model).norms_and_sum(params, x, torch.tensor([1]), clip=0.25)
    assert float(norms[0]) > 0.25  # the example is clipped
    total = torch.sqrt(sum(v.pow(2).sum() for v in summed.values()))
    assert float(total) == pytest.approx(0.25 * (1 - CLIP_MARGIN), rel=1e-9)
    assert float(total) <= 0.25


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_per_subject_norms_and_sum_equal_materialised_subject_gradients(dtype, tol, route) -> None:
    for name, model, x, classes in _cases(dtype):
        model = model.to(dtype)
        if x.is_floating_point():
            x = x.to(dtype)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        y = torch.arange(x.shape[0]) % classes
        subjects = torch.tensor([5, 9, 5, 2, 9, 5])[: x.shape[0]]
        ids, inverse, counts = torch.unique(subjects, return_inverse=True, return_counts=True)
        grads = per_example_gradients(model, params, x, y)
        mean = {
            k: torch.zeros(len(ids), *g.shape[1:], dtype=g.dtype).index_add_(0, inverse, g)
            / counts.to(g.dtype).reshape(-1, *[1] * (g.dim() - 1))
            for k, g in grads.items()
        }
        norms = per_example_norms(mean)
        coeff = torch.linspace(-1.0, 2.0, len(ids), dtype=dtype)
        expected = weighted_sum(mean, coeff * clip_factors(norms, 0.2))
        for max_batch in (256, 2):  # one pass, or several passes of whole subjects
            got_norms, got = GhostClipper(
                model, compiled=route == "compiled"
            ).subject_norms_and_sum(
                params,
                x,
                y,
                subjects,
                weigh=lambda n, c=coeff: c * clip_factors(n, 0.2),
                max_batch=max_batch,
            )
            _assert_bounds(got_norms, norms, tol, name)
            for key in expected:
                scale = float(expected[key].abs().max()) + 1e-30
                err = float((got[key] - expected[key]).abs().max()) / scale
                assert err <= _slack(tol), (name, key, max_batch, err)


def test_uldp_sgd_fast_path_equals_per_subject_training() -> None:
    import dataclasses

    import numpy as np

    from silodp.algorithms import make_algorithm
    from silodp.data import FederatedDataset
    from silodp.federated.simulator import silo_tensors

    rng = np.random.default_rng(0)
    n = 200
    train = FederatedDataset(
        x=rng.normal(size=(n, 1, 8, 8)).astype(np.float32),
        y=rng.integers(0, 10, n),
        silo=rng.integers(0, 3, n),
        subject=rng.integers(0, 30, n),
        num_classes=10,
    )
    silo = silo_tensors(train)[1]
    silo = dataclasses.replace(silo, x=silo.x.double())
    for model_name in ("mlp", "mnist_cnn"):
        model = build_model(model_name, (1, 8, 8), 10).double()
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        messages = []
        for method in ("auto", "vmap"):
            cfg = dict(lr=0.3, clip=0.05, noise_multiplier=0.0, grad_method=method)
            algo = make_algorithm("uldp_sgd", cfg, train)
            plan = algo.configure_round(1, Coins.seeded(0))
            update = algo.local_update(model, params, silo, Coins.seeded(0), plan)
            messages.append(update.params)
        for key in params:
            torch.testing.assert_close(messages[0][key], messages[1][key], rtol=1e-9, atol=1e-12)


def _inplace_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, kernel_size=3),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5),
        nn.ReLU(inplace=True),
        nn.Linear(5, 4),
    )


def _replacing_hook() -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 5), nn.ReLU(), nn.Linear(5, 4))
    model[1].register_forward_hook(lambda mod, inp, out: 3.0 * out)
    return model


@pytest.mark.parametrize("make", [_inplace_cnn, _replacing_hook], ids=["inplace", "hook"])
def test_in_place_changes_and_output_hooks_give_the_true_gradients(make) -> None:
    torch.manual_seed(0)
    model = make().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1, 6, 6, generator=gen, dtype=torch.float64)
    y = torch.arange(6) % 4
    grads = per_example_gradients(model, params, x, y)
    norms = per_example_norms(grads)
    expected = weighted_sum(grads, clip_factors(norms, 0.5))
    clipper = GhostClipper(model)
    assert clipper._chain is None  # neither model is traced: the hooks' path
    for _ in range(2):  # the first call finds the change and runs again; the second copies
        got_norms, got = clipper.norms_and_sum(params, x, y, clip=0.5)
        torch.testing.assert_close(got_norms, norms, rtol=1e-10, atol=1e-12)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12)
