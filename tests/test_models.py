"""build_model: output shapes, per-seed determinism, bad names."""

from __future__ import annotations

import pytest
import torch

from silodp.models import MODELS, build_model

# (name, feature shape, classes, input batch)
CASES = [
    ("mlp", (7,), 3, lambda: torch.randn(5, 7)),
    ("mlp", (1, 8, 8), 10, lambda: torch.randn(5, 1, 8, 8)),
    ("linear", (1, 8, 8), 10, lambda: torch.randn(5, 1, 8, 8)),
    ("mnist_cnn", (1, 8, 8), 10, lambda: torch.randn(4, 1, 8, 8)),
    ("mnist_cnn", (1, 28, 28), 10, lambda: torch.randn(3, 1, 28, 28)),
    ("femnist_cnn", (1, 28, 28), 62, lambda: torch.randn(2, 1, 28, 28)),
    ("uldp_cnn", (1, 28, 28), 10, lambda: torch.randn(3, 1, 28, 28)),
    ("shakespeare_lstm", (6,), 80, lambda: torch.randint(0, 80, (3, 6))),
]


def test_cases_cover_every_model() -> None:
    assert {c[0] for c in CASES} == set(MODELS)


@pytest.mark.parametrize(("name", "shape", "classes", "make_x"), CASES)
def test_output_shape(name, shape, classes, make_x) -> None:
    model = build_model(name, shape, classes, seed=0)
    x = make_x()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (x.shape[0], classes)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("name", "shape", "classes", "make_x"), CASES)
def test_deterministic_per_seed(name, shape, classes, make_x) -> None:
    a = build_model(name, shape, classes, seed=3).state_dict()
    b = build_model(name, shape, classes, seed=3).state_dict()
    c = build_model(name, shape, classes, seed=4).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert any(not torch.equal(a[key], c[key]) for key in a)


def test_uldp_cnn_has_the_papers_parameter_count() -> None:
    # conv 1->10 5x5 (260) + conv 10->20 5x5 (5,020) + dense 320->50 (16,050) + 50->10 (510)
    model = build_model("uldp_cnn", (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 21_840
    with pytest.raises(ValueError, match=r"side >= 14 for uldp_cnn.*got side 8"):
        build_model("uldp_cnn", (1, 8, 8), 10)


def test_build_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp", (4,), 2, seed=9)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_bad_name_is_named() -> None:
    with pytest.raises(ValueError, match=r"model='resnet_9000'"):
        build_model("resnet_9000", (4,), 2)


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("mnist_cnn", (8, 8), r"\(C, H, H\), got \(8, 8\)"),
        ("femnist_cnn", (1, 28, 27), r"\(C, H, H\), got \(1, 28, 27\)"),
        ("shakespeare_lstm", (2, 3), r"\(seq_len,\), got \(2, 3\)"),
    ],
)
def test_bad_feature_shape(name, shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, 10)


def test_bad_num_classes() -> None:
    with pytest.raises(ValueError, match=r"num_classes=1"):
        build_model("mlp", (4,), 1)
