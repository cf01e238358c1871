"""Routing at the dispatcher: names checked against the registry, what reaches the variants (any model:
subclasses, functional calls, torch.compile), coverage counts, the determinism guard, state restored.

What the routed backward computes is the variant's output, bit for bit: each routed aten op is checked
against a direct call of its registry variant on the same tensors. The variants' own accuracy is tested
in their op tests; here, in addition, routed and stock conv gradients are both held to the same bound
derived from the summation length: a float32 dot product of K terms, in any order and with or without
FMA, is off by at most gamma_K * sum |terms| (Higham, Accuracy and Stability, 3.1), per element.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
import nnrand
from nnrand import autotune, models, routing
from tests.helpers import bitwise_equal, gamma

FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def need_ops(*ops: str) -> None:
    missing = [op for op in ops if not routing.registered_variants(op)]
    # every routed op must be registered: a missing one is a failure, not a reason to skip
    assert not missing, f"routed kernel ops missing from the registry: {', '.join(missing)}"


def batch(n: int, seed: int, fmt=torch.contiguous_format, size: int = 32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g).contiguous(memory_format=fmt)
    return x, torch.randint(0, 10, (n,), generator=g)


def grads(model: nn.Module, x, y) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def equal_lists(a, b) -> bool:
    return all(bitwise_equal(u, v) for u, v in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------------
# Resolution


def test_unknown_op_lists_valid_ops():
    with pytest.raises(routing.RoutingError) as e:
        routing.resolve("tree", {"conv_bgrad": "tree"})
    for op in routing.ROUTED_OPS:
        assert op in str(e.value)


def test_unknown_variant_lists_registry_names():
    need_ops("bias_grad")
    with pytest.raises(routing.RoutingError) as e:
        routing.resolve("tree", {"bias_grad": "no_such_variant"})
    for name in routing.registered_variants("bias_grad"):
        assert name in str(e.value)
    assert "native" in str(e.value)


def test_unknown_family_and_bad_override_syntax():
    with pytest.raises(routing.RoutingError, match="tree, atomic, native"):
        routing.resolve("fast")
    with pytest.raises(routing.RoutingError, match="OP=VARIANT"):
        routing.parse_overrides(["conv_wgrad"])
    assert routing.parse_overrides(["conv_wgrad=atomic", "bias_grad = tree"]) == \
        {"conv_wgrad": "atomic", "bias_grad": "tree"}


def test_family_with_per_op_override():
    need_ops(*routing.ROUTED_OPS)
    r = routing.resolve("tree", {"conv_wgrad": "atomic", "maxpool_bwd": "native"})
    assert dict(r.used) == {"conv_wgrad": "atomic", "conv_dgrad": "tree", "bias_grad": "tree",
                            "maxpool_bwd": "native", "conv_wgrad_grouped": "tree", "conv_dgrad_grouped": "tree",
                            "adaptive_avg_pool2d_bwd": "tree", "upsample_bilinear2d_bwd": "tree",
                            # the family's deterministic variant of the scatter sums is named sorted
                            "embedding_bwd": "sorted", "index_add": "sorted", "scatter_add": "sorted",
                            "bn_fwd": "tree"}
    assert not r.deterministic and not r.claims_determinism
    # the atomic family keeps torch's BatchNorm forward; asked by name, bn_fwd runs its atomic variant
    assert routing.resolve("atomic").used["bn_fwd"] == "native"
    assert routing.resolve("atomic", {"bn_fwd": "atomic"}).used["bn_fwd"] == "atomic"
    assert routing.resolve("tree").claims_determinism
    assert not routing.resolve("native").claims_determinism
    # every variant the registry lists for an op is accepted by name
    for op in routing.ROUTED_OPS:
        for name in routing.registered_variants(op):
            assert routing.resolve("native", {op: name}).used[op] == name


def test_bias_grad_names_the_variants_both_registry_ops_have():
    need_ops("bias_grad")
    names = routing.registered_variants("bias_grad")
    for reg in routing.REGISTRY_OPS["bias_grad"]:
        have = {v.name for v in kernels.variants(reg)}
        assert set(names) <= have
    assert {"tree", "atomic"} <= set(names)


def test_unregistered_op_falls_back_with_a_note(monkeypatch):
    real = routing.registered_variants
    monkeypatch.setattr(routing, "registered_variants", lambda op: [] if op == "maxpool_bwd" else real(op))
    r = routing.resolve("tree")
    assert r.used["maxpool_bwd"] == "native" and r.requested["maxpool_bwd"] == "tree"
    assert "maxpool_bwd" in r.notes
    with pytest.raises(routing.RoutingError, match="not in the kernel registry"):
        routing.resolve("native", {"maxpool_bwd": "tree"})


# --------------------------------------------------------------------------------------------------
# Opening and closing


def _kernel_debug(op: str) -> str:
    return repr(torch.library.get_kernel(f"aten::{op}", "CPU"))


def _state():
    from torch.utils import deterministic as det

    ops = [r.op for r in routing.ATEN_OPS if "CPU" in r.keys] + [g.op for g in routing.UNCOVERED_OPS]
    return ({op: _kernel_debug(op) for op in ops}, torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory,
            torch.backends.cudnn.deterministic)


def test_native_overrides_nothing():
    before = _state()
    with nnrand.use_kernels("native") as r:
        assert r.aten_ops == []
        assert _state() == before
        torch.manual_seed(0)
        model = models.build_model("small")
        x, y = batch(2, seed=1)
        grads(model, x, y)
    assert r.coverage.as_dict() == {}


def test_restores_everything_on_exit_and_on_exception():
    need_ops(*routing.ROUTED_OPS)
    before = _state()
    with nnrand.use_kernels("tree") as r:
        assert set(r.aten_ops) == {a.op for a in routing.ATEN_OPS}
        assert torch.are_deterministic_algorithms_enabled()
        assert _state()[0]["convolution_backward"] != before[0]["convolution_backward"]
    assert _state() == before
    with pytest.raises(RuntimeError, match="boom"):
        with nnrand.use_kernels("tree"):
            raise RuntimeError("boom")
    assert _state() == before and routing.active() is None
    with nnrand.use_kernels("atomic"):  # and the next context opens normally
        assert routing.active() is not None


def test_nesting_is_refused_and_the_outer_context_survives():
    need_ops(*routing.ROUTED_OPS)
    with nnrand.use_kernels("tree") as outer:
        with pytest.raises(routing.RoutingError, match="do not nest"):
            with nnrand.use_kernels("atomic"):
                pass
        assert routing.active().routing.family == "tree"
        torch.manual_seed(0)
        model = models.build_model("small")
        grads(model, *batch(2, seed=2))
    assert outer.coverage["convolution_backward"]["tree"] == 10


def test_only_routed_ops_are_overridden():
    need_ops("maxpool_bwd")
    with nnrand.use_kernels("native", {"maxpool_bwd": "tree"}) as r:
        assert r.aten_ops == ["max_pool2d_with_indices_backward"]
        # every routed op is deterministic and native ones run under PyTorch's deterministic mode
        assert torch.are_deterministic_algorithms_enabled()
        torch.manual_seed(0)
        model = models.build_model("small")
        grads(model, *batch(2, seed=3))
    assert r.coverage.as_dict() == {"max_pool2d_with_indices_backward": {"tree": 1}}


# --------------------------------------------------------------------------------------------------
# What reaches the variants: exactly their outputs


def _layer_inputs(layer: nn.Module, x: torch.Tensor, seed: int):
    """Forward one layer, return (output, a random upstream gradient dy)."""
    x = x.detach().requires_grad_(True)
    out = layer(x)
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g).contiguous(memory_format=routing.memory_format_of(out))
    return x, out, dy


@pytest.mark.parametrize("layout", list(FORMATS))
@pytest.mark.parametrize("family", ["tree", "atomic"])
def test_conv_backward_is_the_variants_output(layout, family):
    need_ops("conv_wgrad", "conv_dgrad", "bias_grad")
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 7, 3, stride=2, padding=1, bias=True).to(memory_format=FORMATS[layout])
    x0, _ = batch(3, seed=21, fmt=FORMATS[layout], size=11)
    x0 = torch.cat([x0, x0[:, :2]], 1).contiguous(memory_format=FORMATS[layout])  # 5 channels
    with nnrand.use_kernels(family, rng=np.random.default_rng(5)) as r:
        x, out, dy = _layer_inputs(conv, x0, seed=22)
        out.backward(dy)
    assert r.coverage["convolution_backward"] == {family: 1}
    geom = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1))
    rng = np.random.default_rng(5)  # the same draws, in the order the override makes them: dx, dw, db
    want_dx = kernels.get("conv_dgrad", family)(conv.weight.detach(), dy, input_size=(11, 11), rng=rng, **geom)
    want_dw = kernels.get("conv_wgrad", family)(x.detach(), dy, kernel_size=(3, 3), rng=rng, **geom)
    want_db = kernels.get("bias_grad", family)(dy, rng=rng)
    assert bitwise_equal(x.grad, want_dx) and bitwise_equal(conv.weight.grad, want_dw)
    assert bitwise_equal(conv.bias.grad, want_db)


@pytest.mark.parametrize("layout", list(FORMATS))
@pytest.mark.parametrize("k", [1, 3])
def test_conv_weight_gradient_has_the_parameters_strides(layout, k):
    """A routed dW carries its weight's own strides (DDP's buckets are laid out like the parameters and
    warn and copy otherwise): a 1x1 weight in channels_last has strides (C, 1, C, C) where a freshly
    allocated contiguous tensor of its shape has (C, 1, 1, 1). The values are the variant's output."""
    need_ops("conv_wgrad")
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 4, k, padding=k // 2, bias=False).to(memory_format=FORMATS[layout])
    x0, _ = batch(2, seed=31, fmt=FORMATS[layout], size=9)
    x0 = torch.cat([x0, x0], 1).contiguous(memory_format=FORMATS[layout])  # 6 channels
    with nnrand.use_kernels("tree"):
        x, out, dy = _layer_inputs(conv, x0, seed=32)
        out.backward(dy)
    assert conv.weight.grad.stride() == conv.weight.stride()
    want = kernels.get("conv_wgrad", "tree")(x.detach(), dy, kernel_size=(k, k), stride=(1, 1),
                                             padding=(k // 2, k // 2), dilation=(1, 1))
    assert bitwise_equal(conv.weight.grad, want)


@pytest.mark.parametrize("layout", list(FORMATS))
def test_maxpool_and_batchnorm_backward_are_the_variants_output(layout):
    need_ops("maxpool_bwd", "bias_grad")
    fmt = FORMATS[layout]
    x0, _ = batch(4, seed=31, fmt=fmt, size=9)
    pool = nn.MaxPool2d(3, stride=2, padding=1)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, 3))
    with nnrand.use_kernels("tree") as r:
        x, out, dy = _layer_inputs(pool, x0, seed=32)
        out.backward(dy)
        xb, outb, dyb = _layer_inputs(bn, x0, seed=33)
        outb.backward(dyb)
    assert r.coverage["max_pool2d_with_indices_backward"] == {"tree": 1}
    assert r.coverage["native_batch_norm_backward"] == {"tree": 1}
    _, idx = F.max_pool2d(x0, 3, 2, 1, return_indices=True)
    want = kernels.get("maxpool_bwd", "tree")(dy, idx.contiguous(memory_format=routing.memory_format_of(idx)),
                                              input_size=(9, 9), kernel_size=(3, 3), stride=(2, 2),
                                              padding=(1, 1), dilation=(1, 1))
    assert bitwise_equal(x.grad, want)
    # the batch statistics torch saved for the backward, recomputed by the same forward op
    _, saved_mean, saved_invstd = torch.native_batch_norm(x0, bn.weight, bn.bias, None, None, True, 0.1, bn.eps)
    dx, dgamma, dbeta = kernels.get("bn_bwd", "tree")(dyb, x0, saved_mean, saved_invstd, bn.weight.detach())
    assert bitwise_equal(xb.grad, dx) and bitwise_equal(bn.weight.grad, dgamma) and bitwise_equal(bn.bias.grad, dbeta)


@pytest.mark.parametrize("layout", list(FORMATS))
def test_routed_and_stock_conv_gradients_within_the_summation_bound(layout):
    """Both hold |g - g64| <= gamma_K * (|.|-sum of the terms), K the terms per output element."""
    need_ops("conv_wgrad", "conv_dgrad", "bias_grad")
    fmt = FORMATS[layout]
    torch.manual_seed(1)
    conv = nn.Conv2d(6, 8, 3, padding=1, bias=True).to(memory_format=fmt)
    x0 = torch.randn(4, 6, 10, 10, generator=torch.Generator().manual_seed(41)).contiguous(memory_format=fmt)
    x, out, dy = _layer_inputs(conv, x0, seed=42)
    out.backward(dy)
    stock = (x.grad, conv.weight.grad, conv.bias.grad)
    conv.zero_grad(set_to_none=True)
    with nnrand.use_kernels("tree"):
        xr, outr, _ = _layer_inputs(conv, x0, seed=42)
        outr.backward(dy)
    routed = (xr.grad, conv.weight.grad, conv.bias.grad)
    args = dict(bias_sizes=[8], stride=[1], padding=[1], dilation=[1], transposed=False, output_padding=[0],
                groups=1, output_mask=[True, True, True])
    ref = torch.ops.aten.convolution_backward(dy.double(), x0.double(), conv.weight.double(), **args)
    mag = torch.ops.aten.convolution_backward(dy.double().abs(), x0.double().abs(), conv.weight.double().abs(),
                                              **args)
    terms = (8 * 9, 4 * 10 * 10, 4 * 10 * 10)  # dx: Cout * taps; dw and db: N * OH * OW
    for name, k, r64, m64, s, p in zip(("dx", "dw", "db"), terms, ref, mag, stock, routed):
        bound = gamma(k) * m64
        assert ((s.double() - r64).abs() <= bound).all(), f"stock {name} outside the bound"
        assert ((p.double() - r64).abs() <= bound).all(), f"routed {name} outside the bound"


# --------------------------------------------------------------------------------------------------
# Any model: subclasses, functional calls, torch.compile


class MyConv(nn.Conv2d):
    """A subclass, as libraries write them (weight standardisation etc.); this one changes nothing."""


class FunctionalNet(nn.Module):
    """The small net's first layers written with F.* calls only."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.w2 = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.g, self.b = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8))
        self.fc = nn.Parameter(torch.randn(10, 8) * 0.1)

    def forward(self, x):
        x = F.relu(F.batch_norm(F.conv2d(x, self.w1, padding=1), None, None, self.g, self.b, training=True))
        x = F.max_pool2d(x, 3, 2, 1)
        x = F.conv2d(x, self.w2, stride=2, padding=1)
        return F.linear(x.mean((2, 3)), self.fc)


def module_twin(fn: FunctionalNet) -> nn.Module:
    """The same network from (subclassed) modules, sharing fn's initial weights."""
    net = nn.Sequential(MyConv(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, track_running_stats=False),
                        nn.ReLU(), nn.MaxPool2d(3, 2, 1), MyConv(8, 8, 3, stride=2, padding=1, bias=False))
    head = nn.Linear(8, 10, bias=False)
    with torch.no_grad():
        net[0].weight.copy_(fn.w1)
        net[4].weight.copy_(fn.w2)
        head.weight.copy_(fn.fc)

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.head = net, head

        def forward(self, x):
            return self.head(self.net(x).mean((2, 3)))
    return Twin()


def test_functional_and_subclassed_models_are_routed_alike():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(2)
    fn = FunctionalNet()
    twin = module_twin(fn)
    x, y = batch(4, seed=51, size=12)
    with nnrand.use_kernels("tree") as r1:
        g_fn = grads(fn, x, y)
    with nnrand.use_kernels("tree") as r2:
        g_mod = grads(twin, x, y)
    want = {"convolution_backward": {"tree": 2}, "native_batch_norm_backward": {"tree": 1},
            "max_pool2d_with_indices_backward": {"tree": 1}}
    assert r1.coverage.as_dict() == want and r2.coverage.as_dict() == want
    # parameters: fn (w1, w2, gamma, beta, fc), twin (conv1, gamma, beta, conv2, fc): the same bits
    for i, j in ((0, 0), (1, 3), (2, 1), (3, 2), (4, 4)):
        assert bitwise_equal(g_fn[i], g_mod[j]), f"functional parameter {i} differs from its module twin"


@pytest.mark.parametrize("layout", list(FORMATS))
def test_tree_routing_is_bitwise_repeatable(layout):
    need_ops(*routing.ROUTED_OPS)
    fmt = FORMATS[layout]
    torch.manual_seed(0)
    base = models.build_model("small").to(memory_format=fmt)
    x, y = batch(8, seed=6, fmt=fmt)
    first = None
    for _ in range(5):
        m = copy.deepcopy(base)
        with nnrand.use_kernels("tree") as r:
            g = grads(m, x, y)
        first = first or g
        assert equal_lists(first, g)
    assert r.coverage.as_dict() == {"convolution_backward": {"tree": 10},
                                    "max_pool2d_with_indices_backward": {"tree": 1},
                                    "native_batch_norm_backward": {"tree": 10}}


@pytest.mark.parametrize("layout", list(FORMATS))
def test_atomic_routing_varies_with_the_arrival_order(layout):
    """Negative control: the CPU models of the atomic variants, given two different seeded arrival
    orders, give different gradients; the same seed gives the same bits (nothing else varies)."""
    need_ops(*routing.ROUTED_OPS)
    fmt = FORMATS[layout]
    torch.manual_seed(0)
    base = models.build_model("small").to(memory_format=fmt)
    x, y = batch(8, seed=5, fmt=fmt)
    runs = []
    for seed in (1, 2, 1):
        m = copy.deepcopy(base)
        with nnrand.use_kernels("atomic", rng=np.random.default_rng(seed)):
            runs.append(grads(m, x, y))
    assert equal_lists(runs[0], runs[2])
    # values, not bits: a difference in the sign of a zero alone would not show a reordered sum
    assert not all(torch.equal(u, v) for u, v in zip(runs[0], runs[1])), "two arrival orders gave identical gradients"


def test_torch_compile_reaches_convolution_backward():
    need_ops(*routing.ROUTED_OPS)
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = nn.Sequential(MyConv(3, 6, 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(6, 6, 3, stride=2, padding=1, bias=True), nn.Flatten(), nn.LazyLinear(10))
    x, y = batch(2, seed=61, size=8)
    model(x)  # materialise the lazy layer before compiling
    compiled = torch.compile(model, backend="inductor")
    out = []
    try:
        for _ in range(2):
            with nnrand.use_kernels("tree") as r:
                out.append(grads(compiled, x, y))
            assert r.coverage["convolution_backward"] == {"tree": 2}
    finally:
        torch._dynamo.reset()
    assert equal_lists(out[0], out[1])


@pytest.mark.parametrize("pool", ["max", "adaptive"])
def test_pool_backwards_the_variants_do_not_take_go_to_the_original_kernel_with_the_reason(pool):
    """An unbatched input, a float64 one and an empty batch: torch's own kernel, its result unchanged, each
    counted as original with why."""
    need_ops("maxpool_bwd", "adaptive_avg_pool2d_bwd")
    op = "max_pool2d_with_indices_backward" if pool == "max" else "_adaptive_avg_pool2d_backward"
    layer = nn.MaxPool2d(2) if pool == "max" else nn.AdaptiveAvgPool2d(3)
    g = torch.Generator().manual_seed(8)
    inputs = {"unbatched input": torch.randn(2, 6, 6, generator=g),
              "dtype torch.float64": torch.randn(1, 2, 6, 6, generator=g, dtype=torch.float64),
              "empty input": torch.randn(0, 2, 6, 6, generator=g)}
    for why, x in inputs.items():
        stock = x.clone().requires_grad_()
        layer(stock).square().sum().backward()
        x.requires_grad_()
        with nnrand.use_kernels("tree", strict=False) as r:
            layer(x).square().sum().backward()
        assert r.coverage[op] == {"original": 1} and r.coverage.reasons[op] == {why}, why
        assert bitwise_equal(x.grad, stock.grad), why


def test_unsupported_conv_goes_to_the_original_kernel_and_is_counted():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(4)
    # the transposed conv last, so its upstream gradient is the loss's in both runs
    model = nn.Sequential(nn.Conv2d(4, 4, 3, bias=False), nn.ConvTranspose2d(4, 4, 3, bias=False))
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(71))
    stock = copy.deepcopy(model)
    stock(x).sum().backward()
    with nnrand.use_kernels("tree") as r:
        model(x).sum().backward()
    assert r.coverage["convolution_backward"] == {"tree": 1, "original": 1}
    assert any("transposed" in why for why in r.coverage.reasons["convolution_backward"])
    assert bitwise_equal(model[1].weight.grad, stock[1].weight.grad)  # the original kernel's own result


# --------------------------------------------------------------------------------------------------
# The guard


class MixedNet(nn.Module):
    """Routed ops and one nondeterministic op nnrand does not cover (reflection padding)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head_pad = nn.ReflectionPad2d(1)
        self.fc = nn.Linear(4 * 10 * 10, 10)

    def forward(self, x):
        return self.fc(self.head_pad(torch.relu(self.bn(self.conv(x)))).flatten(1))


def test_strict_refuses_an_uncovered_nondeterministic_op_naming_op_and_module():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(7)
    model = MixedNet()
    x, y = batch(2, seed=81, size=8)
    with pytest.raises(routing.NondeterministicOpError) as e:
        with nnrand.use_kernels("tree", model=model):
            grads(model, x, y)
    assert "aten::reflection_pad2d" in str(e.value) and "head_pad" in str(e.value)
    assert "ReflectionPad2d" in str(e.value)
    assert routing.active() is None and not torch.are_deterministic_algorithms_enabled()


def test_strict_refuses_an_uncovered_backward_reached_through_a_later_input():
    """The guard looks at every tensor input: grid_sample whose grid alone requires a gradient still runs
    its (uncovered) backward, so strict mode refuses it; without any gradient it runs."""
    g = torch.Generator().manual_seed(83)
    image = torch.randn(2, 3, 8, 8, generator=g)
    grid = (torch.rand(2, 5, 5, 2, generator=g) * 2 - 1).requires_grad_()
    with pytest.raises(routing.NondeterministicOpError, match="grid_sampler_2d"):
        with nnrand.use_kernels("tree"):
            F.grid_sample(image, grid, align_corners=False).sum().backward()
    with nnrand.use_kernels("tree"), torch.no_grad():
        out = F.grid_sample(image, grid, align_corners=False)
    assert out.shape == (2, 3, 5, 5)


def test_warn_mode_warns_once_and_counts_uncovered():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(7)
    model = MixedNet()
    x, y = batch(2, seed=82, size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nnrand.use_kernels("tree", strict=False) as r:
            grads(model, x, y)
            grads(model, x, y)
    ours = [w for w in caught if "nnrand" in str(w.message)]
    assert len(ours) == 1 and "reflection_pad2d_backward" in str(ours[0].message)
    assert r.coverage.uncovered == ["reflection_pad2d_backward"]
    assert r.coverage["reflection_pad2d_backward"] == {"uncovered": 2}
    assert r.coverage["convolution_backward"] == {"tree": 2}
    assert not r.deterministic


def test_guard_is_off_without_a_determinism_claim_and_for_routed_or_exact_pooling():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(7)
    model = MixedNet()
    x, y = batch(2, seed=83, size=8)
    with nnrand.use_kernels("atomic", rng=np.random.default_rng(0)) as r:
        grads(model, x, y)  # atomic claims nothing: no error, no count
    assert r.coverage.uncovered == []
    model.head_pad = nn.AdaptiveAvgPool2d(1)
    model.fc = nn.Linear(4, 10)
    with nnrand.use_kernels("tree") as r:  # a 1x1 output is a mean: exact backward, not refused
        grads(model, x, y)
    assert r.coverage.uncovered == [] and r.deterministic
    model.head_pad = nn.AdaptiveAvgPool2d(3)
    model.fc = nn.Linear(36, 10)
    with nnrand.use_kernels("tree") as r:  # 3x3: routed to the adaptive pooling variant
        grads(model, x, y)
    assert r.coverage["_adaptive_avg_pool2d_backward"] == {"tree": 1} and r.deterministic
    with nnrand.use_kernels("tree", {"adaptive_avg_pool2d_bwd": "native"}):  # not routed: guarded again
        with pytest.raises(routing.NondeterministicOpError, match="_adaptive_avg_pool2d"):
            grads(model, x, y)


def test_no_grad_forward_of_an_uncovered_op_is_allowed():
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(7)
    model = MixedNet().eval()
    x, _ = batch(2, seed=84, size=8)
    with torch.no_grad():
        want = model(x)
    with nnrand.use_kernels("tree") as r, torch.no_grad():
        got = model(x)
    # no backward is recorded, so the uncovered op is not refused, not counted as uncovered, and the
    # forward is torch's own
    assert bitwise_equal(got, want) and r.coverage.uncovered == []
    assert routing.active() is None


# --------------------------------------------------------------------------------------------------
# What the guard leaves to PyTorch, and global state


def test_cudnn_benchmark_is_off_under_a_deterministic_routing_and_restored():
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with nnrand.use_kernels("tree"):
            assert not torch.backends.cudnn.benchmark  # forward algorithms chosen by timing differ per process
        assert torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = before


def _unpool(x):
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    return F.max_unpool2d(out, idx, 2)


def test_strict_refuses_an_op_pytorch_flags_with_the_same_error():
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with pytest.raises(routing.NondeterministicOpError, match="max_unpool2d"):
        with nnrand.use_kernels("tree"):
            _unpool(x).sum().backward()


def test_lenient_mode_counts_what_pytorch_only_warned_about(monkeypatch):
    """An op outside the guard's table that PyTorch's deterministic mode only warns about (warn_only)
    is counted uncovered: put_ without accumulate."""
    x = torch.zeros(16)
    idx = torch.tensor([1, 1, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nnrand.use_kernels("tree", strict=False) as r:
            x.put_(idx, torch.tensor([1.0, 2.0, 3.0]))
    if not any("deterministic implementation" in str(w.message) for w in caught):
        pytest.skip("this torch build does not flag put_ on the CPU")
    assert not r.deterministic and r.coverage.uncovered
    assert any("deterministic implementation" in str(w.message) for w in caught)  # still shown to the user


def test_ops_pytorch_makes_deterministic_are_not_refused():
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with nnrand.use_kernels("tree") as r:
        torch.nn.ReplicationPad2d(1)(x).sum().backward()
    assert r.deterministic


def test_a_biasless_conv_under_bias_only_routing_counts_as_original():
    torch.manual_seed(5)
    conv = nn.Conv2d(3, 4, 3, bias=False)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with nnrand.use_kernels("native", {"bias_grad": "tree"}) as r:
        conv(x).sum().backward()
    assert r.coverage["convolution_backward"] == {"original": 1}


def test_nested_unhashable_arguments_still_raise_the_argument_error():
    g = torch.Generator().manual_seed(0)
    w, dy = torch.randn(4, 3, 3, 3, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    with pytest.raises(kernels.KernelArgumentError):
        kernels.get("conv_dgrad", "tree")(w, dy, input_size=(8, [8]), stride=(1, 1), padding=(1, 1),
                                          dilation=(1, 1))


# --------------------------------------------------------------------------------------------------
# Argument forms the aten schemas allow


def _conv_bwd(dy, x, w, mask, stride, padding, dilation, bias=True):
    return torch.ops.aten.convolution_backward(dy, x, w, [w.shape[0]] if bias else None, stride, padding, dilation,
                                               False, [0], 1, mask)


@pytest.mark.parametrize("geom", [(9, 2, 2, 0, 1), (11, 3, 2, 1, 1), (10, 3, 1, 2, 2)],
                         ids=["k2s2", "k3s2p1", "k3d2p2"])
def test_every_output_mask_with_one_element_lists(geom):
    """Each requested gradient is its variant's output bit for bit, the others None, for stride, padding
    and dilation given as one-element lists (as aten passes square ones)."""
    need_ops("conv_wgrad", "conv_dgrad", "bias_grad")
    h, k, s, p, d = geom
    g = torch.Generator().manual_seed(h * 10 + k)
    x, w = torch.randn(2, 3, h, h, generator=g), torch.randn(4, 3, k, k, generator=g)
    dy = torch.randn_like(F.conv2d(x, w, stride=s, padding=p, dilation=d)).normal_(generator=g)
    kw = dict(stride=(s, s), padding=(p, p), dilation=(d, d))
    want = (kernels.get("conv_dgrad", "tree")(w, dy, input_size=(h, h), **kw),
            kernels.get("conv_wgrad", "tree")(x, dy, kernel_size=(k, k), **kw).contiguous(),
            kernels.get("bias_grad", "tree")(dy))
    for mask in ([a, b, c] for a in (True, False) for b in (True, False) for c in (True, False)):
        with nnrand.use_kernels("tree"):
            got = _conv_bwd(dy, x, w, mask, [s], [p], [d])
        for m, gt, wt in zip(mask, got, want):
            assert (gt is None) == (not m)
            if m:
                assert bitwise_equal(gt, wt)


def test_one_gradient_native_the_other_routed():
    need_ops("conv_wgrad", "conv_dgrad")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    dy = torch.randn(2, 4, 9, 9, generator=g)
    stock = _conv_bwd(dy, x, w, [True, True, False], [1], [1], [1], bias=False)
    with nnrand.use_kernels("tree", {"conv_dgrad": "native"}) as r:
        got = _conv_bwd(dy, x, w, [True, True, False], [1], [1], [1], bias=False)
    assert bitwise_equal(got[0], stock[0])  # the original kernel's dX
    assert bitwise_equal(got[1], kernels.get("conv_wgrad", "tree")(x, dy, kernel_size=(3, 3), stride=(1, 1),
                                                                  padding=(1, 1), dilation=(1, 1)).contiguous())
    assert r.coverage["convolution_backward"] == {"tree": 1}


def test_non_contiguous_upstream_gradient_gives_the_same_bits():
    need_ops("conv_wgrad", "conv_dgrad")
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    dy = torch.randn(2, 4, 8, 8, generator=g)
    odd = dy.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channels-last strides, NCHW input
    with nnrand.use_kernels("tree"):
        a = _conv_bwd(dy, x, w, [True, True, False], [1], [1], [1], bias=False)
        b = _conv_bwd(odd, x, w, [True, True, False], [1], [1], [1], bias=False)
    assert bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


def test_batchnorm_forms():
    """BatchNorm1d on (N, C, L) is routed as (N, C, L, 1); affine=False returns no dgamma; eval mode
    (running statistics) goes to the original kernel and is counted with its reason."""
    need_ops("bias_grad")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 7, generator=g, requires_grad=True)
    dy = torch.randn(4, 6, 7, generator=g)
    bn = nn.BatchNorm1d(6)
    with nnrand.use_kernels("tree") as r:
        bn(x).backward(dy)
    _, mean, invstd = torch.native_batch_norm(x.detach(), bn.weight, bn.bias, None, None, True, 0.1, bn.eps)
    dx, dgamma, dbeta = kernels.get("bn_bwd", "tree")(dy.unsqueeze(-1), x.detach().unsqueeze(-1), mean, invstd,
                                                      bn.weight.detach())
    assert bitwise_equal(x.grad, dx.squeeze(-1)) and bitwise_equal(bn.weight.grad, dgamma)
    assert bitwise_equal(bn.bias.grad, dbeta) and r.coverage["native_batch_norm_backward"] == {"tree": 1}
    plain = nn.BatchNorm2d(3, affine=False)
    x2 = torch.randn(2, 3, 5, 5, generator=g, requires_grad=True)
    with nnrand.use_kernels("tree") as r:
        plain(x2).sum().backward()
        plain.eval()
        plain(x2).sum().backward()
    assert r.coverage["native_batch_norm_backward"] == {"tree": 1, "original": 1}
    assert any("eval-mode" in why for why in r.coverage.reasons["native_batch_norm_backward"])


# --------------------------------------------------------------------------------------------------
# The ops routed beside the convolution, pooling and BatchNorm backward: each gives its variant's bits


def _variant(op, name="tree"):
    return kernels.get(op, name)


@pytest.mark.parametrize("family", ["tree", "atomic"])
def test_pooling_upsampling_and_embedding_backward_give_their_variants_bits(family):
    need_ops("adaptive_avg_pool2d_bwd", "upsample_bilinear2d_bwd", "embedding_bwd")
    g = torch.Generator().manual_seed(5)
    rng_seed = 3
    x = torch.randn(2, 3, 9, 11, generator=g, requires_grad=True)
    dy = torch.randn(2, 3, 4, 5, generator=g)
    up = torch.randn(2, 3, 17, 23, generator=g)
    w = torch.randn(20, 6, generator=g, requires_grad=True)
    tok = torch.randint(0, 20, (4, 7), generator=g)
    dtok = torch.randn(4, 7, 6, generator=g)
    sorted_or_tree = "sorted" if family == "tree" else family
    with nnrand.use_kernels(family, rng=np.random.default_rng(rng_seed)) as r:
        torch.nn.functional.adaptive_avg_pool2d(x, (4, 5)).backward(dy)
        pooled = x.grad.clone()
        x.grad = None
        torch.nn.functional.interpolate(x, size=(17, 23), mode="bilinear", align_corners=True).backward(up)
        upsampled = x.grad.clone()
        torch.nn.functional.embedding(tok, w).backward(dtok)
    assert r.coverage["_adaptive_avg_pool2d_backward"] == {family: 1}
    assert r.coverage["upsample_bilinear2d_backward"] == {family: 1}
    assert r.coverage["embedding_dense_backward"] == {sorted_or_tree: 1}
    if family == "tree":  # atomic CPU models draw an order per call: compare the deterministic ones
        assert bitwise_equal(pooled, _variant("adaptive_avg_pool2d_bwd")(dy, input_size=(9, 11)))
        assert bitwise_equal(upsampled, _variant("upsample_bilinear2d_bwd")(up, input_size=(9, 11), align_corners=True))
        assert bitwise_equal(w.grad, _variant("embedding_bwd", "sorted")(dtok, tok, num_weights=20))


def test_index_add_and_scatter_add_are_self_plus_the_variants_sum():
    need_ops("index_add", "scatter_add")
    g = torch.Generator().manual_seed(6)
    base = torch.randn(5, 4, 3, generator=g)
    src = torch.randn(5, 9, 3, generator=g)
    idx = torch.randint(0, 4, (9,), generator=g)
    with nnrand.use_kernels("tree") as r:
        out = torch.index_add(base, 1, idx, src, alpha=2.0)
        inplace = base.clone().index_add_(1, idx, src)
        sidx = torch.randint(0, 5, (7, 3), generator=g)
        ssrc = torch.randn(7, 3, generator=g)
        scattered = torch.zeros(5, 3).scatter_add(0, sidx, ssrc)
    assert r.coverage["index_add"] == {"sorted": 2}     # functional and in-place
    variant = _variant("index_add", "sorted")
    rows = variant(idx, (src * 2.0).movedim(1, 0).reshape(9, -1), num_rows=4)
    assert bitwise_equal(out, base + rows.reshape(4, 5, 3).movedim(0, 1))
    rows = variant(idx, src.movedim(1, 0).reshape(9, -1), num_rows=4)
    assert bitwise_equal(inplace, base + rows.reshape(4, 5, 3).movedim(0, 1))
    assert bitwise_equal(scattered, _variant("scatter_add", "sorted")(sidx, ssrc, num_rows=5))
    assert r.coverage["scatter_add"] == {"sorted": 1}


def test_fastest_deterministic_runs_scatter_add_with_a_full_index_fixed():
    """fastest-deterministic: a full index (each element its own destination) runs ``fixed`` (no sort of
    N * D keys), an index broadcast along the rows runs ``sorted``; tree runs sorted for both; an explicit
    scatter_add variant is kept for both."""
    need_ops("scatter_add")
    g = torch.Generator().manual_seed(8)
    full = torch.randint(0, 5, (40, 3), generator=g)
    rows = torch.randint(0, 5, (40,), generator=g)[:, None].expand(40, 3)
    src = torch.randn(40, 3, generator=g)
    for family, overrides, elementwise in ((routing.FASTEST, None, "fixed"), ("tree", None, "sorted"),
                                           (routing.FASTEST, {"scatter_add": "sorted"}, "sorted")):
        route = routing.resolve(family, overrides)
        assert ("scatter_add" in route.notes) == (elementwise == "fixed")
        with nnrand.use_kernels(route, tuner=autotune.Tuner(cache=None)) as r:  # no conv: the tuner idles
            a = torch.zeros(5, 3).scatter_add(0, full, src)
            b = torch.zeros(5, 3).scatter_add(0, rows, src)
        assert r.coverage["scatter_add"] == ({elementwise: 1, "sorted": 1} if elementwise != "sorted" else {"sorted": 2})
        assert bitwise_equal(a, _variant("scatter_add", elementwise)(full, src, num_rows=5))
        assert bitwise_equal(b, _variant("scatter_add", "sorted")(rows, src, num_rows=5))


def test_grouped_and_depthwise_conv_backward_give_their_variants_bits():
    need_ops("conv_wgrad_grouped", "conv_dgrad_grouped")
    g = torch.Generator().manual_seed(7)
    for cin, cout, groups in ((8, 8, 8), (8, 12, 4)):
        x = torch.randn(2, cin, 9, 9, generator=g, requires_grad=True)
        w = torch.randn(cout, cin // groups, 3, 3, generator=g, requires_grad=True)
        dy = torch.randn(2, cout, 5, 5, generator=g)
        with nnrand.use_kernels("tree") as r:
            torch.nn.functional.conv2d(x, w, stride=2, padding=1, groups=groups).backward(dy)
        assert r.coverage["convolution_backward"] == {"tree": 1}
        geom = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=groups)
        assert bitwise_equal(w.grad, _variant("conv_wgrad_grouped")(x.detach(), dy, kernel_size=(3, 3), **geom))
        assert bitwise_equal(x.grad, _variant("conv_dgrad_grouped")(w.detach(), dy, input_size=(9, 9), **geom))


def test_index_add_and_scatter_add_with_an_empty_index_return_self():
    """No contributions (an expert that got no tokens, a graph without edges, a gather of zero columns):
    the result is self, as in eager, and the call counts as routed."""
    need_ops("index_add", "scatter_add")
    g = torch.Generator().manual_seed(8)
    base = torch.randn(8, 16, generator=g)
    x = torch.randn(4, 5, generator=g, requires_grad=True)
    with nnrand.use_kernels("tree") as r:
        out = base.index_add(0, torch.zeros(0, dtype=torch.long), torch.zeros(0, 16))
        torch.gather(x, 1, torch.zeros(4, 0, dtype=torch.long)).sum().backward()   # its backward: scatter_add
    assert bitwise_equal(out, base + 0.0)   # self plus an all-zero sum: -0.0 becomes +0.0, as the routing adds
    assert bitwise_equal(x.grad, torch.zeros(4, 5))
    assert r.coverage["index_add"] == {"sorted": 1} and r.coverage["scatter_add"] == {"sorted": 1}


def test_out_of_place_index_add_is_contiguous_like_torchs():
    """torch's index_add and scatter_add (and their meta kernels, which torch.compile checks) return a
    contiguous result whatever self's strides; the routed ones too, with the same values."""
    need_ops("index_add", "scatter_add")
    g = torch.Generator().manual_seed(9)
    self_t = torch.randn(5, 6, generator=g).t()                     # (6, 5), strides (1, 6)
    self_cl = torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last)
    idx, src = torch.tensor([0, 2, 2]), torch.randn(3, 5, generator=g)
    sidx, ssrc = torch.randint(0, 2, (2, 3, 4, 4), generator=g), torch.randn(2, 3, 4, 4, generator=g)
    want = (torch.index_add(self_t, 0, idx, src), torch.scatter_add(self_cl, 0, sidx, ssrc))
    with nnrand.use_kernels("tree") as r:
        got = (torch.index_add(self_t, 0, idx, src), torch.scatter_add(self_cl, 0, sidx, ssrc))
        got[0].view(-1)   # a view of the flat result, as eager allows
    assert r.coverage["index_add"] == {"sorted": 1} and r.coverage["scatter_add"] == {"sorted": 1}
    # the same sums in another order: each path rounds at most 3 additions (3 contributions at most per
    # element), each by at most 2^-24 times a partial of at most 4 terms under 8 in magnitude
    assert max(t.abs().max().item() for t in (self_t, self_cl, src, ssrc)) < 8
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.stride() == b.stride()
        assert torch.allclose(a, b, rtol=0, atol=2 * 3 * 2.0**-24 * (4 * 8))


def test_index_add_with_a_mismatched_source_raises_torchs_error():
    """A source whose shape does not fit self and the index goes to torch's kernel, which refuses it
    (the flattened rows would otherwise line up silently when the element counts agree)."""
    need_ops("index_add")
    with nnrand.use_kernels("tree") as r:
        with pytest.raises(RuntimeError, match="source"):
            torch.zeros(4, 2, 3).index_add(0, torch.tensor([0, 1]), torch.ones(2, 3, 2))
    assert r.coverage["index_add"] == {routing.ORIGINAL: 1}


def test_ops_an_original_kernel_calls_are_not_routed_or_counted_again():
    """torch's CPU index_add runs scatter_add_ through the dispatcher: a float64 index_add (not routed,
    passed to the original kernel) counts once, as index_add, and its inner scatter_add_ goes straight
    to torch's kernel."""
    need_ops("index_add", "scatter_add")
    g = torch.Generator().manual_seed(10)
    base, src = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    idx = torch.tensor([0, 3, 3, 5, 1])
    with nnrand.use_kernels("tree") as r:
        for _ in range(3):
            out = base.index_add(0, idx, src)
    assert r.coverage.as_dict() == {"index_add": {routing.ORIGINAL: 3}}
    assert bitwise_equal(out, base.index_add(0, idx, src))


def test_per_pixel_cross_entropy_is_not_refused():
    """nll_loss2d with reduction "none" is elementwise (PyTorch's CUDA kernel alerts only for the
    reductions): strict routing runs it; a reduced 2-D loss is still refused."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 5, 4, 4, generator=g, requires_grad=True)
    target = torch.randint(0, 5, (2, 4, 4), generator=g)
    with nnrand.use_kernels("tree", strict=True) as r:
        F.cross_entropy(logits, target, reduction="none").mean().backward()
    assert r.deterministic and not r.coverage.uncovered
    with pytest.raises(routing.NondeterministicOpError, match="nll_loss2d_forward"):
        with nnrand.use_kernels("tree", strict=True):
            F.cross_entropy(logits, target)


def test_prepared_launchers_take_the_tensors_alone_and_refusals_stay_with_the_call():
    """``_prepared``: a launcher with ``prepare`` is prepared once with the plan's tensors and keyword
    arguments and then called with the tensors alone; one whose preparation refuses the signature stays as
    it was (the call raises and is counted there); one without ``prepare`` keeps its keyword arguments."""
    seen = []

    def launcher(a, b, *, size):
        return ("plain", a, b, size)

    def prepare(a, b, *, size):
        seen.append((a, b, size))
        return lambda a, b: ("prepared", a, b, size)
    launcher.prepare = prepare
    fn, kw = routing._prepared(launcher, (1, 2), {"size": 3})
    assert kw == {} and fn(4, 5) == ("prepared", 4, 5, 3) and seen == [(1, 2, 3)]

    def refusing(a, b, *, size):
        raise kernels.KernelArgumentError("conv_dgrad", "dy", "refused")
    launcher.prepare = refusing
    fn, kw = routing._prepared(launcher, (1, 2), {"size": 3})
    assert fn is launcher and kw == {"size": 3}
    del launcher.prepare
    assert routing._prepared(launcher, (1, 2), {"size": 3}) == (launcher, {"size": 3})
    assert routing._prepared(None, (), {"size": 3}) == (None, {"size": 3})


def test_the_trace_sink_is_offered_to_a_lone_observer_and_shared_off_by_a_second():
    """routing.sink(): the replay extension while its C++ layer replays CUDA calls and one observer watches;
    a second observer turns the sink off for good (sink_share), and the sink is offered to no one after."""
    calls = []

    class Module:
        def sink_share(self):
            calls.append("share")

    class Layer:
        key, module = "CUDA", Module()

        def observe(self, fn):
            calls.append("observe" if fn is not None else "unobserve")

    with routing.use_kernels("tree"):
        session = routing._ACTIVE
        assert routing.sink() is None   # no replay layer on this machine's session
        session.replay = layer = Layer()
        try:
            assert routing.sink() is None   # nobody observes
            with routing.observe(lambda op, out, args: None):
                assert routing.sink() is layer.module and "share" not in calls
                with routing.observe(lambda op, out, args: None):
                    assert routing.sink() is None and calls.count("share") == 1
                assert routing.sink() is layer.module   # offered again to a lone observer (a new recorder);
            layer.key = "CPU"                             # the sink already started stays shared off in C++
            with routing.observe(lambda op, out, args: None):
                assert routing.sink() is None   # a layer over CPU kernels: no sink
        finally:
            session.replay = None
    assert calls[-1] == "unobserve"
