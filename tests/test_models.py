"""Models: shapes, parameter counts, layer vocabulary, max-pool placement, reproducible construction."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nnrand.models import MODELS, build_model, param_count
from tests.helpers import bitwise_equal

ALLOWED = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.Linear)
# Containers that hold layers but compute nothing themselves.
CONTAINERS = (nn.Sequential,)


def _build(name: str, seed: int = 0, num_classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, num_classes)


def _conv_bn(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k + 2 * cout  # bias-free conv + BN weight and bias


def _basic_block(cin: int, cout: int) -> int:
    projection = _conv_bn(cin, cout, 1) if cin != cout else 0
    return _conv_bn(cin, cout, 3) + _conv_bn(cout, cout, 3) + projection


def _expected_params(name: str, num_classes: int) -> int:
    """Counted from the architecture's definition, independently of the module tree."""
    if name.startswith("resnet18"):
        stem = _conv_bn(3, 64, 3 if name == "resnet18" else 7)
        body = sum(_basic_block(a, b) + _basic_block(b, b) for a, b in ((64, 64), (64, 128), (128, 256),
                                                                         (256, 512)))
        return stem + body + 512 * num_classes + num_classes
    if name.startswith("resnet20"):  # the max-pool has no parameters
        body = sum(_basic_block(a, b) + 2 * _basic_block(b, b) for a, b in ((16, 16), (16, 32), (32, 64)))
        return _conv_bn(3, 16, 3) + body + 64 * num_classes + num_classes
    if name == "small":
        body = _basic_block(16, 24) + _basic_block(24, 48) + _basic_block(48, 96)
        return _conv_bn(3, 16, 3) + body + 96 * num_classes + num_classes
    raise AssertionError(name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("num_classes", [10, 100])
def test_output_shape(name, num_classes):
    net = _build(name, num_classes=num_classes).eval()
    with torch.no_grad():
        for n in (1, 3):
            y = net(torch.randn(n, 3, 32, 32))
            assert y.shape == (n, num_classes) and y.dtype == torch.float32
            assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("num_classes", [10, 100])
def test_param_count(name, num_classes):
    assert param_count(_build(name, num_classes=num_classes)) == _expected_params(name, num_classes)


def test_param_count_published_figures():
    assert param_count(_build("resnet18")) == 11_173_962  # the CIFAR ResNet-18 everyone quotes
    assert 0.26e6 < param_count(_build("resnet20")) < 0.28e6  # He et al. 2016: 0.27M
    assert param_count(_build("small")) == 172_746  # models.py's docstring


@pytest.mark.parametrize("name", MODELS)
def test_layer_vocabulary(name):
    """Only layers the kernel routing intercepts; convs without bias, groups 1."""
    for mod_name, m in _build(name).named_modules():
        if isinstance(m, CONTAINERS) or next(m.children(), None) is not None:
            assert not list(m.parameters(recurse=False)), f"{mod_name} holds parameters directly"
            continue
        assert isinstance(m, ALLOWED), f"{name}: {mod_name} is a {type(m).__name__}"
        if isinstance(m, nn.Conv2d):
            assert m.bias is None and m.groups == 1, mod_name


@pytest.mark.parametrize("name,pools", [("resnet18", 0), ("resnet18_imagenet", 1), ("resnet20", 0),
                                        ("resnet20_maxpool", 1), ("small", 1)])
def test_max_pool_placement(name, pools):
    found = [m for m in _build(name).modules() if isinstance(m, nn.MaxPool2d)]
    assert len(found) == pools
    for m in found:
        assert (m.kernel_size, m.stride, m.padding) == (3, 2, 1)


def test_stems():
    stem18 = _build("resnet18").stem[0]
    stem_in = _build("resnet18_imagenet").stem[0]
    assert (stem18.kernel_size, stem18.stride, stem18.padding, stem18.out_channels) == ((3, 3), (1, 1), (1, 1), 64)
    assert (stem_in.kernel_size, stem_in.stride, stem_in.padding, stem_in.out_channels) == ((7, 7), (2, 2), (3, 3), 64)


@pytest.mark.parametrize("name,spatial", [("resnet18", [32, 16, 8, 4]), ("resnet18_imagenet", [8, 4, 2, 1]),
                                          ("resnet20", [32, 16, 8]), ("resnet20_maxpool", [16, 8, 4]),
                                          ("small", [16, 8, 4])])
def test_stage_resolutions(name, spatial):
    """Feature-map sizes at the end of each residual stage on 32x32 input."""
    net = _build(name).eval()
    sizes = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.shape[-1]))
             for m in net.stages if isinstance(m, nn.Sequential)]
    with torch.no_grad():
        net(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert sizes == spatial


@pytest.mark.parametrize("name", MODELS)
def test_construction_is_deterministic(name):
    a, b, c = _build(name, 0).state_dict(), _build(name, 0).state_dict(), _build(name, 1).state_dict()
    assert list(a) == list(b)
    assert all(bitwise_equal(a[k], b[k]) for k in a)
    convs = [k for k in a if k.endswith("weight") and a[k].ndim == 4]
    assert convs and all(not torch.equal(a[k], c[k]) for k in convs)


def test_init():
    net = _build("resnet18")
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert bitwise_equal(m.weight, torch.ones_like(m.weight))
            assert bitwise_equal(m.bias, torch.zeros_like(m.bias))
    # kaiming normal, fan_out, ReLU gain: std sqrt(2 / (cout * k * k)) over the 512x512x3x3 weights
    w = net.stages[3][1].conv2.weight
    expected = (2.0 / (512 * 9)) ** 0.5
    assert abs(w.std().item() / expected - 1) < 0.01  # 2.4M samples: relative std error ~0.05%


def test_does_not_seed():
    """Weights follow the caller's seed and the global RNG moves on afterwards: if build_model seeded
    internally, the draws after two builds under different seeds would coincide."""
    draws = []
    for seed in (123, 124):
        torch.manual_seed(seed)
        build_model("small")
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])


def test_bad_name():
    with pytest.raises(ValueError, match="resnet18.*resnet18_imagenet.*resnet20.*resnet20_maxpool.*small"):
        build_model("resnet50")


def test_backward_reaches_every_parameter():
    net = _build("small")
    F.cross_entropy(net(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
