"""Kernel routing: names checked against the registry, module state restored, gradients through the
plugged models equal to stock autograd within a bound derived from torch's own float32 error.

Bound (the flash-attention rule): with ``ref`` the float64 gradient of the same model and input,
``max|plug - ref| <= 2 * max|stock - ref| + 4 * u * max|ref|`` per parameter, u = 2^-24. The routed
backward differs from stock only in the order and grouping of float32 sums; the stock float32 error
against float64 measures what float32 arithmetic costs on this network and input, a different order
of the same sums costs the same order of error, and 2x leaves room for both errors to add up. The
``4u`` floor covers parameters whose stock gradient happens to land on the float64 value.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from nnrand import models, routing

U = 2.0**-24
FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


def need_ops(*ops: str) -> None:
    missing = [op for op in ops if not routing.registered_variants(op)]
    # every routed op must be registered: a missing one is a failure, not a reason to skip
    assert not missing, f"routed kernel ops missing from the registry: {', '.join(missing)}"


def batch(n: int, seed: int, fmt=torch.contiguous_format):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g).contiguous(memory_format=fmt)
    return x, torch.randint(0, 10, (n,), generator=g)


def grads(model: nn.Module, x, y) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


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
    for v in kernels.variants("bias_grad"):
        assert v.name in str(e.value)
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
                            "maxpool_bwd": "native"}
    assert not r.deterministic
    assert routing.resolve("tree").deterministic
    # every variant the registry lists for an op is accepted by name
    for op in routing.ROUTED_OPS:
        for v in kernels.variants(op):
            assert routing.resolve("native", {op: v.name}).used[op] == v.name


def test_unregistered_op_falls_back_with_a_note(monkeypatch):
    real = routing.registered_variants
    monkeypatch.setattr(routing, "registered_variants", lambda op: [] if op == "maxpool_bwd" else real(op))
    r = routing.resolve("tree")
    assert r.used["maxpool_bwd"] == "native" and r.requested["maxpool_bwd"] == "tree"
    assert "maxpool_bwd" in r.notes
    with pytest.raises(routing.RoutingError, match="not in the kernel registry"):
        routing.resolve("native", {"maxpool_bwd": "tree"})


# --------------------------------------------------------------------------------------------------
# Installation and restoration


def _forwards(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def test_native_installs_nothing():
    model = models.build_model("small")
    before = _forwards(model)
    with routing.use_kernels(routing.resolve("native"), model) as names:
        assert names == []
        assert _forwards(model) == before


def test_restores_on_exit_and_on_exception():
    need_ops("bias_grad")
    model = models.build_model("small")
    sentinel = model.fc.forward  # a pre-existing instance forward must come back, not be deleted
    model.fc.forward = sentinel
    before = _forwards(model)
    with routing.use_kernels(routing.resolve("tree"), model) as names:
        assert "fc" in names and "stem.1" in names
        assert model.fc.__dict__["forward"] is not sentinel
    assert _forwards(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with routing.use_kernels(routing.resolve("tree"), model):
            raise RuntimeError("boom")
    assert _forwards(model) == before
    assert model.fc.__dict__["forward"] is sentinel


def test_unsupported_module_is_refused_before_anything_changes():
    need_ops("conv_wgrad")
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.Conv2d(4, 4, 3, groups=2, bias=False))
    before = _forwards(model)
    with pytest.raises(routing.RoutingError, match="groups"):
        with routing.use_kernels(routing.resolve("native", {"conv_wgrad": "tree"}), model):
            pass
    assert _forwards(model) == before


def test_only_routed_ops_are_intercepted():
    need_ops("maxpool_bwd")
    model = models.build_model("small")
    with routing.use_kernels(routing.resolve("native", {"maxpool_bwd": "tree"}), model) as names:
        assert names == [n for n, m in model.named_modules() if isinstance(m, nn.MaxPool2d)]


# --------------------------------------------------------------------------------------------------
# Gradients and BN state


CASES = [(m, f) for m in models.MODELS for f in FORMATS]


@pytest.mark.parametrize("model_name,layout", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_gradients_match_stock_autograd(model_name, layout):
    need_ops(*routing.ROUTED_OPS)
    fmt = FORMATS[layout]
    n = 2 if model_name.startswith("resnet18") else 4
    torch.manual_seed(0)
    base = models.build_model(model_name).to(memory_format=fmt)
    x, y = batch(n, seed=11, fmt=fmt)
    ref = grads(copy.deepcopy(base).double(), x.double(), y)
    stock_model = copy.deepcopy(base)
    stock = grads(stock_model, x, y)
    plugged_model = copy.deepcopy(base)
    with routing.use_kernels(routing.resolve("tree"), plugged_model) as names:
        plugged = grads(plugged_model, x, y)
    assert names, "nothing was intercepted"
    bad = []
    for (pname, _), r, s, p in zip(base.named_parameters(), ref, stock, plugged):
        assert p.dtype == torch.float32 and p.shape == s.shape
        err_stock = (s.double() - r).abs().max().item()
        err_plug = (p.double() - r).abs().max().item()
        bound = 2 * err_stock + 4 * U * r.abs().max().item()
        if not err_plug <= bound:
            bad.append(f"{pname}: |plug-ref| {err_plug:.3g} > bound {bound:.3g} (|stock-ref| {err_stock:.3g})")
    assert not bad, "\n".join(bad)
    # running statistics and batch counts update as torch's do, bit for bit
    for (bname, a), b in zip(stock_model.named_buffers(), plugged_model.buffers()):
        assert torch.equal(a, b), f"buffer {bname} differs from torch's update"


@pytest.mark.parametrize("layout", list(FORMATS))
def test_atomic_routing_matches_stock_and_varies(layout):
    """atomic variants are measured, not asserted equal: within the same bound, and (negative control)
    their CPU models give different bits from one arrival order to another."""
    need_ops(*routing.ROUTED_OPS)
    fmt = FORMATS[layout]
    torch.manual_seed(0)
    base = models.build_model("small").to(memory_format=fmt)
    x, y = batch(8, seed=5, fmt=fmt)
    ref = grads(copy.deepcopy(base).double(), x.double(), y)
    stock = grads(copy.deepcopy(base), x, y)
    runs = []
    for _ in range(3):
        m = copy.deepcopy(base)
        with routing.use_kernels(routing.resolve("atomic"), m):
            runs.append(grads(m, x, y))
    for got in runs:
        for r, s, p in zip(ref, stock, got):
            err_stock = (s.double() - r).abs().max().item()
            assert (p.double() - r).abs().max().item() <= 2 * err_stock + 4 * U * r.abs().max().item()
    distinct = {tuple(hash(g.numpy().tobytes()) for g in run) for run in runs}
    assert len(distinct) > 1, "atomic CPU models gave identical gradients three times"


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
        with routing.use_kernels(routing.resolve("tree"), m):
            g = grads(m, x, y)
        if first is None:
            first = g
        assert all(torch.equal(a, b) for a, b in zip(first, g))


def test_seeded_kernel_rng_reproduces_atomic_order():
    need_ops(*routing.ROUTED_OPS)
    import numpy as np

    torch.manual_seed(0)
    base = models.build_model("small")
    x, y = batch(4, seed=7)
    out = []
    for _ in range(2):
        m = copy.deepcopy(base)
        with routing.use_kernels(routing.resolve("atomic"), m, rng=np.random.default_rng(123)):
            out.append(grads(m, x, y))
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_eval_mode_uses_running_stats():
    need_ops("bias_grad")
    torch.manual_seed(0)
    base = models.build_model("small")
    x, _ = batch(4, seed=8)
    m = copy.deepcopy(base)
    with routing.use_kernels(routing.resolve("tree"), m):
        m.train()
        m(x)
        m.eval()
        with torch.no_grad():
            got = m(x)
    base.train()
    base(x)
    base.eval()
    with torch.no_grad():
        want = base(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("override", [{"conv_dgrad": "native"}, {"conv_wgrad": "native"}],
                         ids=["dgrad_native", "wgrad_native"])
def test_conv_with_one_gradient_native(override):
    """One conv gradient from a kernel, the other from torch's convolution_backward, in one layer."""
    need_ops(*routing.ROUTED_OPS)
    torch.manual_seed(0)
    base = models.build_model("small")
    x, y = batch(4, seed=9)
    ref = grads(copy.deepcopy(base).double(), x.double(), y)
    stock = grads(copy.deepcopy(base), x, y)
    m = copy.deepcopy(base)
    with routing.use_kernels(routing.resolve("tree", override), m):
        plugged = grads(m, x, y)
    for r, s, p in zip(ref, stock, plugged):
        err_stock = (s.double() - r).abs().max().item()
        assert (p.double() - r).abs().max().item() <= 2 * err_stock + 4 * U * r.abs().max().item()
