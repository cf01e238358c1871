"""Half precision on the GPU: every variant's bf16/fp16 call equals its CPU model bit for bit where the
float32 variant does, deterministic variants repeat bitwise, and a ResNet trained under autocast with
``tree`` is bitwise repeatable (eager and CUDA graph) while ``atomic`` is not (the negative control)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import kernels
import nnrand
from nnrand import models
from nnrand.train import GraphStep, autocast_for, forward_backward, optimizer_step, scaler_for
from tests.helpers import assert_bitwise_equal, byte_hash

pytestmark = pytest.mark.gpu

HALF = [torch.bfloat16, torch.float16]


def _inputs(op: str, device: str, dtype: torch.dtype):
    spec = kernels.spec(op)
    case = spec.test_cases()[0]
    args, kwargs = spec.make_inputs(case, torch.device(device))
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                 for a in args), kwargs


def _outs(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("key", [v.key for v in kernels.variants() if v.deterministic])
def test_half_gpu_equals_cpu_model_and_repeats(key, dtype):
    op, name = key.split("/")
    v = kernels.get(op, name)
    args, kwargs = _inputs(op, "cuda", dtype)
    runs = [_outs(v(*args, **kwargs)) for _ in range(5)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert_bitwise_equal(a, b, f"{key} repeat")
    assert all(t.dtype in (dtype, torch.float32) for t in runs[0])
    if v.cpu_bitexact:
        cpu_args, cpu_kwargs = _inputs(op, "cpu", dtype)
        for a, b in zip(runs[0], _outs(v(*cpu_args, **cpu_kwargs))):
            assert_bitwise_equal(a, b, f"{key} GPU vs CPU model")


def _train(model, batches, fmt, dtype, graph=False) -> str:
    """Hash of the weights and buffers after SGD steps with the forward under autocast."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    scaler = scaler_for("cuda", amp)
    autocast = functools.partial(autocast_for, "cuda", amp)

    step = None
    for x, y in batches:
        x = x.contiguous(memory_format=fmt)
        if graph:
            step = step or GraphStep(model, x, y, autocast, scaler)
            step(x, y)
        else:
            forward_backward(model, opt, x, y, autocast, scaler)
        optimizer_step(opt, scaler)
    torch.cuda.synchronize()
    return byte_hash(torch.cat([t.detach().float().flatten() for t in (*model.parameters(), *model.buffers())
                                if t.is_floating_point()]))


def _batches(n, batch, size, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(n)]


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_tree_under_autocast_is_repeatable_graph_equals_eager_and_atomic_is_not(dtype):
    fmt = torch.channels_last
    torch.manual_seed(0)
    base = models.build_model("resnet18_imagenet").cuda().to(memory_format=fmt)
    batches = _batches(3, 32, 32, seed=11)
    with nnrand.use_kernels("tree") as r:
        tree = [_train(copy.deepcopy(base), batches, fmt, dtype, graph=g) for g in (False, False, False, True)]
    assert len(set(tree)) == 1, tree
    rows = {row["aten_op"]: row for row in r.coverage.rows()}
    assert rows["convolution_backward"]["original"] == 0
    bn = rows.get("cudnn_batch_norm_backward") or rows["native_batch_norm_backward"]
    assert bn["original"] == 0 and rows["max_pool2d_with_indices_backward"]["original"] == 0
    assert not r.coverage.uncovered
    with nnrand.use_kernels("atomic"):
        atomic = [_train(copy.deepcopy(base), batches, fmt, dtype) for _ in range(5)]
    assert len(set(atomic)) > 1, "atomic under autocast gave one result in 5 runs: the negative control failed"


def test_fastest_deterministic_under_bf16_is_repeatable():
    fmt = torch.channels_last
    torch.manual_seed(0)
    base = models.build_model("resnet18_imagenet").cuda().to(memory_format=fmt)
    batches = _batches(3, 32, 32, seed=5)
    with nnrand.use_kernels("fastest-deterministic") as r:
        runs = [_train(copy.deepcopy(base), batches, fmt, torch.bfloat16) for _ in range(3)]
    assert len(set(runs)) == 1
    assert r.coverage.as_dict()["convolution_backward"].get("original", 0) == 0
    assert r.tuner.record()["choices"] and all("bfloat16" in k for k in r.tuner.record()["choices"])
    # the Winograd variants' half calls are tree's (half_as): not offered beside it, never chosen
    timed = [e for k, e in r.tuner.record()["choices"].items() if k.startswith(("conv_dgrad ", "conv_wgrad "))]
    assert timed and all("tree" in e["candidates"] and "winograd" not in e["candidates"] for e in timed)


@pytest.mark.parametrize("weight_dtype", [torch.float32, "half", None], ids=["w_fp32", "w_half", "no_w"])
@pytest.mark.parametrize("shape,layout", [((4, 6, 8, 8), "nchw"), ((3, 5, 7, 3), "nchw"),
                                          ((4, 8, 6, 6), "channels_last"), ((5, 12, 3, 3), "channels_last"),
                                          ((33, 20), "rows"), ((2, 64, 56, 56), "nchw")])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["tree", "atomic"])
def test_batchnorm_half_kernels_equal_the_widening_call(name, dtype, shape, layout, weight_dtype):
    """bn_bwd's CUDA launcher reads and writes half itself (half_native); tree's bits must be those of the
    float32 kernel on the widened tensors, rounded once, i.e. the CPU model through the registry's call.
    atomic's sums depend on arrival order: for it only the output dtypes and layout are checked here."""
    v = kernels.get("bn_bwd", name)
    g = torch.Generator().manual_seed(17)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    if len(shape) == 4:
        x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    dims = [0] + list(range(2, len(shape)))
    mean = x.float().mean(dims)
    invstd = torch.rsqrt(x.float().var(dims, unbiased=False) + 1e-5)
    wd = dtype if weight_dtype == "half" else weight_dtype
    weight = None if wd is None else torch.rand(shape[1], generator=g).to(wd)
    cpu = kernels.get("bn_bwd", "tree")(dy, x, mean, invstd, weight)
    gpu = v(dy.cuda(), x.cuda(), mean.cuda(), invstd.cuda(), None if weight is None else weight.cuda())
    want_param = torch.float32 if weight is None else weight.dtype
    assert [t.dtype for t in gpu] == [dtype, want_param, want_param]
    assert gpu[0].is_contiguous(memory_format=fmt)
    if name == "tree":
        for a, b, what in zip(gpu, cpu, ("dx", "dgamma", "dbeta")):
            assert_bitwise_equal(a, b, what)


def test_batchnorm_half_x_with_float32_dy_equals_the_cpu_call():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, 6, 6, generator=g).half()
    dy = torch.randn(4, 8, 6, 6, generator=g)
    mean, invstd, weight = x.float().mean((0, 2, 3)), torch.rand(8, generator=g) + 0.5, torch.rand(8, generator=g)
    tree = kernels.get("bn_bwd", "tree")
    cpu = tree(dy, x, mean, invstd, weight)
    gpu = tree(dy.cuda(), x.cuda(), mean.cuda(), invstd.cuda(), weight.cuda())
    assert gpu[0].dtype == torch.float16
    for a, b, what in zip(gpu, cpu, ("dx", "dgamma", "dbeta")):
        assert_bitwise_equal(a, b, what)


@pytest.mark.parametrize("groups", [1, 2], ids=["dense", "grouped"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_routed_half_conv_backward_equals_the_widening_calls(dtype, layout, groups):
    """The routing widens a half dy once for dX, dW and the bias gradient; the bits must be those of each
    variant's own widening call (registry), and the dtypes those autocast expects."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    x, w, dy = rand(4, 8, 10, 10), rand(16, 8 // groups, 3, 3), rand(4, 16, 5, 5)
    geom = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1))
    with nnrand.use_kernels("tree") as r:
        dx, dw, db = torch.ops.aten.convolution_backward(dy, x, w, [16], [2, 2], [1, 1], [1, 1], False, [0, 0],
                                                         groups, [True, True, True])
    suffix = "" if groups == 1 else "_grouped"
    extra = {} if groups == 1 else {"groups": groups}
    want_dx = kernels.get(f"conv_dgrad{suffix}", "tree")(w, dy, input_size=(10, 10), **geom, **extra)
    want_dw = kernels.get(f"conv_wgrad{suffix}", "tree")(x, dy, kernel_size=(3, 3), **geom, **extra)
    want_db = kernels.get("bias_grad", "tree")(dy)
    assert r.coverage["convolution_backward"].get("original", 0) == 0, r.coverage
    for got, want in ((dx, want_dx), (dw, want_dw), (db, want_db)):
        assert got.dtype == want.dtype == dtype
        assert_bitwise_equal(got.contiguous(), want.contiguous())


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_winograd_half_calls_are_trees_tensor_core_calls(dtype):
    """The Winograd variants take float32; their bf16/fp16 calls run tree's tensor-core kernels: tree's bits
    and dtypes, on a 3x3 stride-1 shape the Winograd kernels cover in float32."""
    g = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(4, 32, 12, 12, device="cuda", generator=g).to(dtype)
    w = torch.randn(48, 32, 3, 3, device="cuda", generator=g).to(dtype)
    dy = torch.randn(4, 48, 12, 12, device="cuda", generator=g).to(dtype)
    geom = dict(stride=1, padding=1, dilation=1)
    for op, args, kw in (("conv_dgrad", (w, dy), {"input_size": (12, 12)}),
                         ("conv_wgrad", (x, dy), {"kernel_size": (3, 3)})):
        wino, tree = kernels.get(op, "winograd"), kernels.get(op, "tree")
        assert wino.half_native
        got, want = wino(*args, **kw, **geom), tree(*args, **kw, **geom)
        assert got.dtype == want.dtype
        assert_bitwise_equal(got, want, f"{op} {dtype}")
