"""The methods of ``silodp bench step`` and the builders of their steps (:func:`build_step`).

Every method runs one full step on the same random batch (gradient, clipping, noise, update):

* ``plain``: mean loss, one backward pass (``torch.autograd.grad``), functional parameters,
  SGD update: the baseline of ``ratio_to_plain``. ``plain_fedavg`` is silodp FedAvg's step
  (``torch.func.grad``), for reference.
* silodp's DP steps call :func:`~silodp.algorithms.dp_sgd.clipped_noisy_step` on the whole
  batch (LocalItemDP/LocalGroupDP; HiGradAvgDP with ``weigh=subject_average_weights``;
  ``vmap`` with ``grad_method="vmap"``); UserLDP runs its ``local_update`` with one step. All
  draw from secure :class:`~silodp.privacy.randomness.Coins` and release through the exact
  :func:`~silodp.privacy.noise.gaussian_mechanism`.
* ``local_item_dp_float_noise``: the same DP-SGD step with the noise silodp no longer uses —
  float32 ``torch.randn`` from a seeded generator (truncated near 5.8σ, see
  :mod:`silodp.privacy.noise`). A reference for the cost of exact noise only
  (``noise_ratio`` = ``local_item_dp`` / this); never a mechanism.
* Opacus runs on an ``nn.Module`` copy of the same model with its ``DPOptimizer`` (noise
  included): ``opacus_hooks`` (``GradSampleModule``, per-example gradients) and
  ``opacus_ghost`` (``GradSampleModuleFastGradientClipping``: ghost norms for Linear layers,
  per-example norms for the rest, two backward passes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ALIASES",
    "LSTM_METHODS",
    "METHODS",
    "NOTES",
    "SPECS",
    "ModelSpec",
    "Skip",
    "StepData",
    "build_step",
    "estimate_extra_bytes",
    "make_data",
]

CLIP = 1.0
NOISE = 1.0
LR = 0.05


@dataclass(frozen=True)
class ModelSpec:
    """The input a benchmark model takes: feature shape, classes, token ids or floats."""

    feature_shape: tuple[int, ...]
    num_classes: int
    tokens: bool = False


SPECS: dict[str, ModelSpec] = {
    "femnist_cnn": ModelSpec((1, 28, 28), 62),
    "mnist_cnn": ModelSpec((1, 28, 28), 10),
    "mlp": ModelSpec((64,), 10),
    "shakespeare_lstm": ModelSpec((80,), 80, tokens=True),
}
#: Image/tabular methods, in the order they are timed and printed.
METHODS = (
    "plain",
    "plain_fedavg",
    "opacus_hooks",
    "opacus_ghost",
    "local_item_dp",
    "local_item_dp_float_noise",
    "local_group_dp",
    "higradavg_uniform",
    "higradavg_skewed",
    "user_ldp",
    "vmap",
    "subject_norm_uniform",
    "subject_norm_skewed",
    "subject_norm_uniform_torch",
    "subject_norm_skewed_torch",
)
#: Methods for the character LSTM.
LSTM_METHODS = (
    "plain",
    "plain_fedavg",
    "local_item_dp",
    "vmap",
    "opacus_plain_dplstm",
    "opacus_hooks_dplstm",
    "opacus_ghost_dplstm",
)
#: Methods that run exactly the step of another one (reported, not timed twice).
ALIASES = {"local_group_dp": "local_item_dp"}

NOTES = {
    "plain": "mean loss, one backward (autograd.grad), functional params: the baseline",
    "plain_fedavg": "silodp FedAvg's step (torch.func.grad); reference",
    "opacus_hooks": "GradSampleModule + DPOptimizer (per-example grads)",
    "opacus_ghost": "ghost clipping (2 backward passes) + DPOptimizerFastGradientClipping",
    "local_item_dp": "clipped_noisy_step, grad_method=auto (exact noise)",
    "local_item_dp_float_noise": "the same step with float32 torch.randn noise: reference only",
    "local_group_dp": "same step as local_item_dp (only sigma differs); not re-timed",
    "higradavg_uniform": "per-subject average of clipped grads, ~0.93 subjects/record",
    "higradavg_skewed": "per-subject average of clipped grads, Zipf: ~50 subjects per 512",
    "user_ldp": "mean gradient clipped as a whole (via local_update, T=1)",
    "vmap": "grad_method=vmap (materialised per-example grads; reference)",
    "subject_norm_uniform": "GhostClipper.subject_norms_and_sum + noise, uniform subjects",
    "subject_norm_skewed": "GhostClipper.subject_norms_and_sum + noise, skewed subjects",
    "subject_norm_uniform_torch": "the same through the torch routes (compiled=False): baseline",
    "subject_norm_skewed_torch": "the same through the torch routes (compiled=False): baseline",
    "opacus_plain_dplstm": "plain SGD on the Opacus DPLSTM model (its own baseline)",
    "opacus_hooks_dplstm": "opacus.layers.DPLSTM + GradSampleModule + DPOptimizer",
    "opacus_ghost_dplstm": "opacus.layers.DPLSTM + ghost clipping",
}
LSTM_VMAP_NOTE = (
    "vmap over silodp's Linear-built LSTM (vmap over nn.LSTM is not used: the model has none)"
)


class Skip(Exception):
    """A method that cannot or should not run on this model/batch (reason in the message)."""


@dataclass
class StepData:
    x: torch.Tensor
    y: torch.Tensor
    uniform: torch.Tensor
    skewed: torch.Tensor


def make_data(model: str, batch: int, *, seed: int = 0) -> StepData:
    """A random batch for ``model`` with two subject layouts: ~uniform and Zipf-skewed."""
    spec = SPECS[model]
    gen = torch.Generator().manual_seed(seed)
    if spec.tokens:
        x = torch.randint(0, spec.num_classes, (batch, *spec.feature_shape), generator=gen)
    else:
        x = torch.randn((batch, *spec.feature_shape), generator=gen)
    y = torch.randint(0, spec.num_classes, (batch,), generator=gen)
    # uniform over ~6.64 B subjects: ~475 distinct subjects in 512 records
    uniform = torch.randint(0, max(2, round(6.64 * batch)), (batch,), generator=gen)
    # Zipf(1) over ~55 B/512 subjects: ~50 distinct subjects in 512 records, a few large
    pool = max(2, round(55 * batch / 512))
    weights = 1.0 / torch.arange(1, pool + 1, dtype=torch.float64)
    skewed = torch.multinomial(weights, batch, replacement=True, generator=gen)
    return StepData(x, y, uniform, skewed)


def _num_params(module: nn.Module, kinds: tuple[type, ...] | None = None) -> int:
    total = 0
    for sub in module.modules():
        if kinds is not None and not isinstance(sub, kinds):
            continue
        total += sum(p.numel() for p in sub.parameters(recurse=False))
    return total


def estimate_extra_bytes(model_name: str, batch: int, method: str) -> float:
    """Rough extra memory of a method (bytes): where per-example gradients are materialised,
    about twice ``B × params × 4`` (the gradients and a same-sized temporary)."""
    spec = SPECS[model_name]
    from silodp.models import build_model

    model = build_model(model_name, spec.feature_shape, spec.num_classes)
    params = _num_params(model)
    if method in ("opacus_hooks", "vmap", "opacus_hooks_dplstm"):
        return 2.0 * batch * params * 4
    if method == "opacus_ghost":  # Linear layers ghost-clipped, the rest per-example
        return 2.0 * batch * (params - _num_params(model, (nn.Linear, nn.Embedding))) * 4
    if method.startswith("subject_norm"):
        # per-example conv gradients (and a temporary), plus at most one chunk of per-subject
        # linear-layer gradients (``ghost.PER_EXAMPLE_LIMIT`` elements)
        from silodp.privacy.ghost import PER_EXAMPLE_LIMIT

        conv = _num_params(model, (nn.Conv2d,))
        return 2.0 * batch * conv * 4 + 4.0 * PER_EXAMPLE_LIMIT
    return 0.0


def _silo(data: StepData, subjects: torch.Tensor) -> Any:
    from silodp.algorithms import SiloData

    return SiloData(silo=0, x=data.x, y=data.y, subject=subjects)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _plain_step(model: nn.Module, data: StepData) -> Callable[[], object]:
    """Mean loss, one backward pass (``autograd.grad``), functional parameters, SGD update."""
    from torch.func import functional_call
    from torch.nn import functional as F

    params = _params(model)

    def step() -> object:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(model, leaves, (data.x,)), data.y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {k: v.detach() - LR * g for (k, v), g in zip(leaves.items(), grads, strict=True)}

    return step


def _fedavg_step(model: nn.Module, data: StepData) -> Callable[[], object]:
    """FedAvg's step: ``batch_gradient`` (``torch.func.grad``) and the SGD update."""
    from silodp.privacy.gradients import batch_gradient

    params = _params(model)

    def step() -> object:
        grads = batch_gradient(model, params, data.x, data.y)
        return {k: v - LR * grads[k] for k, v in params.items()}

    return step


def _config(batch: int, **overrides: Any) -> Any:
    from silodp.algorithms.dp_sgd import GroupBoundConfig

    return GroupBoundConfig(
        local_steps=1,
        batch_size=batch,
        lr=LR,
        clip=CLIP,
        noise_multiplier=NOISE,
        group_size=batch,
        **overrides,
    )


def _dp_step(
    model: nn.Module,
    data: StepData,
    subjects: torch.Tensor,
    *,
    grad_method: str = "auto",
    per_subject: bool = False,
) -> Callable[[], object]:
    """``clipped_noisy_step`` on the whole batch: DP-SGD, or HiGradAvgDP's per-subject
    average of clipped gradients (``weigh=subject_average_weights``)."""
    from silodp.algorithms.dp_sgd import clipped_noisy_step
    from silodp.privacy.gradients import subject_average_weights
    from silodp.privacy.randomness import Coins

    batch = int(data.y.shape[0])
    config = _config(batch, grad_method=grad_method)
    params = _params(model)
    silo = _silo(data, subjects)
    idx = torch.arange(batch)
    coins = Coins.secure()
    scale = float(torch.unique(subjects).numel()) if per_subject else float(batch)
    weigh = subject_average_weights if per_subject else None

    def step() -> object:
        return clipped_noisy_step(
            model, params, silo, idx, config=config, scale=scale, coins=coins, weigh=weigh
        )

    return step


def _float_noise_step(model: nn.Module, data: StepData) -> Callable[[], object]:
    """``local_item_dp``'s step with the float32 ``torch.randn`` noise silodp used before its
    exact sampler (kept here only as the reference of the noise's cost)."""
    from silodp.algorithms.dp_sgd import clipped_sum

    batch = int(data.y.shape[0])
    config = _config(batch)
    params = _params(model)
    silo = _silo(data, data.uniform)
    idx = torch.arange(batch)
    gen = torch.Generator().manual_seed(1)
    numel = sum(v.numel() for v in params.values())

    def step() -> object:
        summed = clipped_sum(model, params, silo, idx, config=config)
        flat = torch.randn(numel, generator=gen) * (NOISE * CLIP)
        out, start = {}, 0
        for k, v in params.items():
            noise = flat[start : start + v.numel()].view(v.shape)
            out[k] = v.add(summed[k].add(noise), alpha=-LR / batch)
            start += v.numel()
        return out

    return step


def _user_ldp_step(model: nn.Module, data: StepData) -> Callable[[], object]:
    """UserLDP's step, through its ``local_update`` with one local step (its step is internal;
    this adds a parameter copy and batch diagnostics)."""
    from silodp.algorithms import make_algorithm
    from silodp.privacy.randomness import Coins

    batch = int(data.y.shape[0])
    algorithm = make_algorithm("user_ldp", _config(batch))
    params = _params(model)
    silo = _silo(data, data.uniform)
    coins = Coins.secure()

    def step() -> object:
        return algorithm.local_update(model, params, silo, coins)

    return step


def _subject_norm_step(
    model: nn.Module, data: StepData, subjects: torch.Tensor, *, compiled: bool = True
) -> Callable[[], object]:
    """``uldp_sgd``'s step; ``compiled=False``: through the torch routes, where the model has
    a compiled path (:mod:`silodp.privacy.dense_kernel`; else the same step, not re-timed)."""
    from silodp.algorithms.dp_sgd import noisy_sum
    from silodp.privacy import ghost
    from silodp.privacy.gradients import clip_factors
    from silodp.privacy.randomness import Coins

    clipper = ghost.clipper_for(model) if compiled else ghost.GhostClipper(model, compiled=False)
    method = getattr(clipper, "subject_norms_and_sum", None)
    if method is None:
        raise Skip("no per-subject norm function in silodp.privacy.ghost")
    if not clipper.fast:
        raise Skip(f"unsupported layers for per-subject norms: {clipper.unsupported}")
    if not compiled and ghost.GhostClipper(model)._kernel(torch.float32) is None:
        raise Skip("no compiled path for this model: the same step as subject_norm_*")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    coins = Coins.secure()
    rate = -LR / float(torch.unique(subjects).numel())

    def step() -> object:
        _, summed = method(params, data.x, data.y, subjects, weigh=lambda n: clip_factors(n, CLIP))
        noisy = noisy_sum(summed, noise_multiplier=NOISE, sensitivity=CLIP, coins=coins)
        # one fused update per parameter, as in clipped_noisy_step
        return {k: torch.add(v, noisy[k].to(v.dtype), alpha=rate) for k, v in params.items()}

    return step


def _dplstm_model(spec: ModelSpec) -> nn.Module:
    from opacus.layers import DPLSTM

    class OpacusShakespeare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(spec.num_classes, 8)
            self.lstm = DPLSTM(8, 256, num_layers=2, batch_first=True)
            self.head = nn.Linear(256, spec.num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(self.embed(x))
            return self.head(out[:, -1, :])

    torch.manual_seed(0)
    return OpacusShakespeare()


def _opacus_step(model: nn.Module, data: StepData, mode: str) -> Callable[[], object]:
    """One Opacus DP-SGD step (``hooks``, ``ghost``) or a plain step (``plain``)."""
    batch = int(data.y.shape[0])
    criterion = nn.CrossEntropyLoss()
    model.train()
    if mode == "plain":
        sgd = torch.optim.SGD(model.parameters(), lr=LR)

        def plain() -> object:
            sgd.zero_grad(set_to_none=True)
            criterion(model(data.x), data.y).backward()
            sgd.step()
            return None

        return plain
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    gen = torch.Generator().manual_seed(1)
    if mode == "hooks":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model)
        opt = DPOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=LR),
            noise_multiplier=NOISE,
            max_grad_norm=CLIP,
            expected_batch_size=batch,
            generator=gen,
        )

        def hooks() -> object:
            opt.zero_grad(set_to_none=True)
            criterion(gsm(data.x), data.y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)  # frees the per-example gradients
            return None

        return hooks
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    ghost = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
    )
    fopt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(ghost.parameters(), lr=LR),
        noise_multiplier=NOISE,
        max_grad_norm=CLIP,
        expected_batch_size=batch,
        loss_reduction="mean",
        generator=gen,
    )
    dp_loss = DPLossFastGradientClipping(ghost, fopt, criterion, loss_reduction="mean")

    def ghost_step() -> object:
        fopt.zero_grad(set_to_none=True)
        dp_loss(ghost(data.x), data.y).backward()
        fopt.step()
        fopt.zero_grad(set_to_none=True)
        return None

    return ghost_step


def build_step(
    model_name: str,
    batch: int,
    method: str,
    *,
    data: StepData | None = None,
    max_extra_bytes: float = math.inf,
) -> Callable[[], object]:
    """A zero-argument function running one step of ``method``; raises :class:`Skip`."""
    from silodp.models import build_model

    spec = SPECS[model_name]
    estimate = estimate_extra_bytes(model_name, batch, method)
    if estimate > max_extra_bytes:
        raise Skip(
            f"estimated {estimate / 2**30:.1f} GB extra memory > limit "
            f"{max_extra_bytes / 2**30:.1f} GB"
        )
    data = data or make_data(model_name, batch)
    if method.startswith("opacus"):
        try:
            import opacus  # noqa: F401
        except ImportError as err:
            raise Skip(f"opacus not installed ({err})") from err
        mode = method.split("_")[1]
        if method.endswith("_dplstm"):
            try:
                module = _dplstm_model(spec)
            except Exception as err:  # noqa: BLE001
                raise Skip(f"opacus.layers.DPLSTM unusable: {err}") from err
        else:
            module = build_model(model_name, spec.feature_shape, spec.num_classes)
        try:
            return _opacus_step(module, data, mode)
        except Exception as err:  # noqa: BLE001
            raise Skip(f"opacus setup failed: {type(err).__name__}: {err}") from err
    model = build_model(model_name, spec.feature_shape, spec.num_classes)
    method = ALIASES.get(method, method)
    if method == "plain":
        return _plain_step(model, data)
    if method == "plain_fedavg":
        return _fedavg_step(model, data)
    if method == "local_item_dp":
        return _dp_step(model, data, data.uniform)
    if method == "local_item_dp_float_noise":
        return _float_noise_step(model, data)
    if method == "vmap":
        return _dp_step(model, data, data.uniform, grad_method="vmap")
    if method == "user_ldp":
        return _user_ldp_step(model, data)
    if method.startswith("higradavg"):
        subjects = data.uniform if method.endswith("uniform") else data.skewed
        return _dp_step(model, data, subjects, per_subject=True)
    if method.startswith("subject_norm"):
        subjects = data.uniform if "uniform" in method else data.skewed
        return _subject_norm_step(model, data, subjects, compiled=not method.endswith("_torch"))
    raise ValueError(f"Unknown method {method!r}.")
