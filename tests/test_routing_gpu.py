"""Routing on the GPU: whole models routed at the dispatcher, bitwise repeatable under ``tree``, the CUDA
graph of a routed step equal to eager, torchvision models covered (skipped where torchvision is absent)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kernels
import nnrand
from nnrand import models
from nnrand.train import GraphStep
from tests.helpers import bitwise_equal

pytestmark = pytest.mark.gpu


def _batches(n: int, batch: int, size: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(n)]


def _train(model, batches, graph: bool = False, fmt=torch.contiguous_format) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    step = None
    for x, y in batches:
        x = x.contiguous(memory_format=fmt)
        if graph:
            step = step or GraphStep(model, x, y)
            step(x, y)
        else:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()] + [b.detach().clone() for b in model.buffers()]


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_tree_training_is_bitwise_repeatable_and_graph_equals_eager(layout):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    base = models.build_model("resnet18_imagenet").cuda().to(memory_format=fmt)
    batches = _batches(4, 32, 32, seed=7)
    runs = []
    with nnrand.use_kernels("tree") as r:
        for graph in (False, False, True):
            runs.append(_train(copy.deepcopy(base), batches, graph=graph, fmt=fmt))
    for other in runs[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(runs[0], other))
    cov = r.coverage.as_dict()
    # 20 convs: two eager runs of 4 steps, then the graph's two warm-up passes and its capture
    assert cov["convolution_backward"] == {"tree": 20 * 4 * 2 + 20 * 3}
    assert set(cov) >= {"cudnn_batch_norm_backward", "max_pool2d_with_indices_backward"} or \
        set(cov) >= {"native_batch_norm_backward", "max_pool2d_with_indices_backward"}
    assert not r.coverage.uncovered


def test_torchvision_resnet18_fully_covered_and_repeatable():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    base = tv.models.resnet18(num_classes=10).cuda().to(memory_format=torch.channels_last)
    batches = _batches(3, 16, 64, seed=8)
    with nnrand.use_kernels("tree") as r:
        a = _train(copy.deepcopy(base), batches, fmt=torch.channels_last)
        b = _train(copy.deepcopy(base), batches, fmt=torch.channels_last)
    assert all(bitwise_equal(u, v) for u, v in zip(a, b))
    cov = r.coverage.as_dict()
    assert cov["convolution_backward"] == {"tree": 2 * 3 * 20}
    bn = cov.get("cudnn_batch_norm_backward", {}).get("tree", 0) + cov.get("native_batch_norm_backward", {}).get("tree", 0)
    assert bn == 2 * 3 * 20
    assert not r.coverage.uncovered


@pytest.mark.parametrize("name", ["vgg11_bn", "mobilenet_v3_small"])
def test_torchvision_models_with_adaptive_pooling_and_depthwise_convs_are_covered(name):
    """vgg11_bn pools adaptively to 7x7, mobilenet_v3_small has depthwise convs: both are routed under
    strict tree and repeat bitwise."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(tv.models, name)(num_classes=10).cuda()
    x = torch.randn(4, 3, 64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    out = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)   # the classifiers' dropout masks
        with nnrand.use_kernels("tree", model=model) as r:
            model(x).sum().backward()
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert not r.coverage.uncovered and r.deterministic
    assert all(bitwise_equal(a, b) for run in out[1:] for a, b in zip(out[0], run))
    routed = r.coverage.as_dict()
    if name == "vgg11_bn":
        assert routed["_adaptive_avg_pool2d_backward"] == {"tree": 1}
    else:
        assert "original" not in routed["convolution_backward"]


@pytest.mark.parametrize("dtype, layout", [(torch.float32, "nchw"), (torch.float32, "channels_last"),
                                           (torch.bfloat16, "channels_last"), (torch.bfloat16, "nchw")])
def test_a_routed_conv_backward_prepares_once_per_signature_and_equals_the_launchers(dtype, layout, monkeypatch):
    """The routing prepares tree's launchers once per call signature (validation, plan and launch
    configuration) and replays them on each call's own tensors: every call's gradients, on fresh tensors
    each time, equal the launchers called directly, bitwise, fp32 and bf16 (tensor cores), stride 1 (split
    data gradient), stride 2 (phases) and a 3-channel stem whose float32 dy is, on alternate calls, a view
    at an address that is not 16-byte aligned (the stem kernel's scalar twin, chosen per call)."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    prepared = {"conv_dgrad": 0, "conv_wgrad": 0}
    for op in prepared:
        launcher = kernels.get(op, "tree").cuda
        original = launcher.prepare

        def counting(*args, _op=op, _original=original, **kwargs):
            prepared[_op] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(launcher, "prepare", counting)
    g = torch.Generator(device="cuda").manual_seed(3)

    def tensor(shape, shift: bool = False):
        t = torch.randn(shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
        if not shift:
            return t
        # the same values, shape and strides one element past the start of a larger buffer
        buf = torch.empty(t.numel() + 1, device="cuda", dtype=dtype)[1:]
        return buf.as_strided(t.shape, t.stride()).copy_(t)

    configs = [(64, 128, 1), (64, 128, 2), (3, 64, 1)]   # (Cin, Cout, stride)
    alive = []   # every call's tensors kept: a later call's cannot reuse their memory, so addresses differ
    with nnrand.use_kernels("tree"):
        for i in range(4):
            for cin, cout, stride in configs:
                oh = (14 + 2 - 3) // stride + 1
                x, w = tensor((4, cin, 14, 14)), tensor((cout, cin, 3, 3))
                # float32 only: the tensor-core kernels' 16-byte loads take allocator-aligned tensors
                dy = tensor((4, cout, oh, oh), shift=dtype == torch.float32 and cin == 3 and i % 2 == 1)
                alive.append((x, w, dy))
                dx, dw, _ = torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * 2, [1, 1], [1, 1], False,
                                                                [0, 0], 1, [True, True, False])
                want_dx = kernels.get("conv_dgrad", "tree")(w, dy, input_size=(14, 14), stride=stride, padding=1)
                want_dw = kernels.get("conv_wgrad", "tree")(x, dy, kernel_size=(3, 3), stride=stride, padding=1)
                assert bitwise_equal(dx, want_dx) and bitwise_equal(dw, want_dw)
    assert prepared == {"conv_dgrad": 3, "conv_wgrad": 3}


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_batchnorm_forward_is_routed_with_its_backward(layout):
    """Under tree, a float32 NCHW BatchNorm2d in training runs bn_fwd's tree kernels (output, running statistics)
    and its backward bn_bwd's on the statistics bn_fwd saved. Its empty reserve space is what cuDNN's forward
    gives there too, so a backward run after the context (cuDNN's) gives cuDNN's bits on bn_fwd's statistics.
    channels_last inputs, the atomic family, a routing whose BatchNorm backward is native and eval mode keep
    cuDNN's forward (counted as the original with the reason where routed)."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(41)
    bn = torch.nn.BatchNorm2d(8).cuda()
    with torch.no_grad():
        bn.weight.copy_(torch.rand(8, device="cuda", generator=g) + 0.5)
        bn.bias.copy_(torch.randn(8, device="cuda", generator=g))
    x0 = (torch.randn(16, 8, 10, 10, device="cuda", generator=g) * 2 + 1).contiguous(memory_format=fmt)
    x = x0.clone().requires_grad_()
    dy = torch.randn(16, 8, 10, 10, device="cuda", generator=g).contiguous(memory_format=fmt)
    w, b = bn.weight.detach(), bn.bias.detach()
    rm0, rv0 = bn.running_mean.clone(), bn.running_var.clone()
    with nnrand.use_kernels("tree") as r:
        out = bn(x)
        out.backward(dy)
    assert r.coverage["cudnn_batch_norm_backward"] == {"tree": 1}
    if layout == "channels_last":
        assert r.coverage["cudnn_batch_norm"] == {"original": 1}
        assert any("channels_last" in why for why in r.coverage.reasons["cudnn_batch_norm"])
        return
    assert r.coverage["cudnn_batch_norm"] == {"tree": 1}
    rm, rv = rm0.clone(), rv0.clone()
    y, mean, invstd = kernels.get("bn_fwd", "tree")(x0, w, b, rm, rv, bn.momentum, bn.eps)
    assert bitwise_equal(out, y) and bitwise_equal(bn.running_mean, rm) and bitwise_equal(bn.running_var, rv)
    dx, dgamma, dbeta = kernels.get("bn_bwd", "tree")(dy, x0, mean, invstd, w)
    assert bitwise_equal(x.grad, dx) and bitwise_equal(bn.weight.grad, dgamma) and bitwise_equal(bn.bias.grad, dbeta)
    # cuDNN's own reserve space here is empty too; its backward, after the context, reads bn_fwd's statistics
    reserve = torch.ops.aten.cudnn_batch_norm(x0, w, b, None, None, True, 0.1, bn.eps)[3]
    assert reserve.numel() == 0
    x2 = x0.clone().requires_grad_()
    bn.weight.grad = bn.bias.grad = None
    with nnrand.use_kernels("tree") as r:
        out2 = bn(x2)
    out2.backward(dy)
    assert r.coverage["cudnn_batch_norm"] == {"tree": 1} and r.coverage["cudnn_batch_norm_backward"] == {}
    want = torch.ops.aten.cudnn_batch_norm_backward(x0, dy, w, None, None, mean, invstd, bn.eps, reserve)
    assert bitwise_equal(x2.grad, want[0]) and bitwise_equal(bn.weight.grad, want[1])
    for family, ops in (("atomic", None), ("tree", {"bias_grad": "native"})):
        with nnrand.use_kernels(family, ops=ops, strict=False) as r:
            bn(x)
        assert r.coverage["cudnn_batch_norm"] == ({} if family == "atomic" else {"original": 1}), family
    bn.eval()
    with nnrand.use_kernels("tree") as r:
        bn(x)
    assert r.coverage["cudnn_batch_norm"] == {"original": 1}
    assert any("eval-mode" in why for why in r.coverage.reasons["cudnn_batch_norm"])
