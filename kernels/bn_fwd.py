"""bn_fwd: BatchNorm forward in training mode. CUDA launchers for ``bn_fwd.cu`` (whose channel reduction,
``bn_reduce.cuh``, is bn_bwd's) and CPU order models.

    y, save_mean, save_invstd = kernels.get("bn_fwd", "tree")(x, weight, bias, running_mean, running_var,
                                                              momentum=0.1, eps=1e-5)

x: float32 (N, C, H, W) in NCHW or channels_last, or (N, C); weight, bias: (C,) or None (1 and +0.0);
running_mean, running_var: (C,) float32 or None, updated in place where given (as torch's BatchNorm does).
Per channel c with M values and shift k = the channel's first value (x[0, c, 0, 0]):

    s = sum(x - k),  t = sum((x - k)^2)       one pass over x: bn_bwd's reduction, its block split and
                                              combine (atomic: arrival order; tree: index order)
    a = s / M,  mean = k + a,  var = max((t - s * a) / M, 0),  invstd = 1 / sqrt(var + eps)
    running_mean = momentum * mean + (1 - momentum) * running_mean
    running_var = momentum * (var * M / (M - 1)) + (1 - momentum) * running_var
    y = ((x - mean) * invstd) * weight + bias

The shift keeps t - s * a from cancelling (the sums are of deviations from a value of the channel, not of
x); var is the biased batch variance, as torch saves it (invstd) and normalises with it. Three kernels: the
sums, the statistics (one thread per channel) and y (elementwise, in x's layout). Every float operation is
a round-to-nearest intrinsic never contracted into FMA, and the CPU models replay them in the same order:
the ``tree`` variant's bits, statistics and running statistics included, equal its model's.

Where it runs: ``nnrand.use_kernels`` routes aten::cudnn_batch_norm (torch's float32 CUDA BatchNorm in
training) to the family's variant (``tree``; the ``atomic`` family keeps cuDNN's forward, which is
deterministic: its noise study is about the backward's atomics).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .bias_grad import THREADS, rows_plan
from .bn_bwd import (DX_ROWS, HOSTILE_ROWS, HOSTILE_SHAPES, _memory_format, _plan, bench_shapes, case_of,
                     cpu_sums)
from .order import F32
from .registry import Case, define_op
from .runtime import (
    INT32_MAX,
    MEMO_LIMIT,
    SLOT,
    KernelArgumentError,
    Launch,
    cdiv,
    check_cuda,
    check_key,
    check_size,
    check_tensor,
    function,
    layout_of,
    memo_check,
    ticket_counters,
)

OP = "bn_fwd"
SOURCE = "bn_fwd.cu"
MAX_GRID_Y = 65535


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


def _check_momentum(momentum) -> None:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not np.isfinite(momentum):
        raise KernelArgumentError(OP, "momentum", f"expected a finite number, got {momentum!r}")


def _check_all(x, weight, bias, running_mean, running_var, eps) -> str:
    """x's layout; raises naming the argument (momentum: _check_momentum, per call)."""
    x = check_tensor(OP, "x", x, ndim=(2, 4))
    if x.dim() == 2:
        if not x.is_contiguous():
            raise KernelArgumentError(OP, "x", f"expected a contiguous (N, C) tensor, got strides {x.stride()}")
        layout = "rows"
    else:
        layout = layout_of(OP, "x", x)
    c = x.shape[1]
    if c == 0:
        raise KernelArgumentError(OP, "x", f"expected at least one channel, got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                    ("running_var", running_var)):
        if t is None:
            continue
        check_tensor(OP, name, t, ndim=1, device=x.device)
        if t.shape[0] != c:
            raise KernelArgumentError(OP, name, f"expected shape ({c},) (one value per channel of x), "
                                                f"got {tuple(t.shape)}")
        if name.startswith("running") and not t.is_contiguous():
            raise KernelArgumentError(OP, name, "expected a contiguous tensor (it is updated in place)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not np.isfinite(eps):
        raise KernelArgumentError(OP, "eps", f"expected a finite number, got {eps!r}")
    if eps < 0:
        raise KernelArgumentError(OP, "eps", f"expected eps >= 0, got {eps!r}")
    m = x.numel() // c
    if (running_var is not None) and m < 2 and x.numel():
        raise KernelArgumentError(OP, "x", f"the unbiased variance of running_var needs 2 values per channel or "
                                           f"more, got {m}")
    check_size(OP, "x", x)
    n = x.shape[0]
    if layout == "nchw":   # bn_bwd's limits: the reduction and the elementwise kernel are its
        if c > MAX_GRID_Y:
            raise KernelArgumentError(OP, "x", f"NCHW path supports at most {MAX_GRID_Y} channels, got {c}")
        if n > INT32_MAX or x.shape[2] * x.shape[3] > INT32_MAX:
            raise KernelArgumentError(OP, "x", f"N and H*W must be below 2^31, got N={n}, "
                                               f"H*W={x.shape[2] * x.shape[3]}")
    else:
        r = n if x.dim() == 2 else n * x.shape[2] * x.shape[3]
        _, _, ty, tiles, _, _ = rows_plan(max(r, 1), c)
        if tiles > MAX_GRID_Y or cdiv(r, ty * DX_ROWS) > INT32_MAX:
            raise KernelArgumentError(OP, "x", f"{r} rows of {c} channels exceed the launch grid")
    return layout


_CHECKED: dict[tuple, str] = {}


def _check(x, weight, bias, running_mean, running_var, momentum, eps) -> str:
    """Memoised per configuration (``runtime.memo_check``); momentum, which torch's cumulative average
    (momentum=None) changes every step, is checked per call and is no part of the configuration."""
    _check_momentum(momentum)
    return memo_check(_CHECKED, _check_all, x, weight, bias, running_mean, running_var, eps)


def _empty_result(x, layout):
    c = x.shape[1]
    nan = torch.full((c,), float("nan"), device=x.device)
    return torch.empty(x.shape, device=x.device, memory_format=_memory_format(layout)), nan, nan.clone()


# --------------------------------------------------------------------------------------------------
# CUDA launchers


@dataclass(frozen=True)
class _Setup:
    layout: str
    plan: dict
    reduce: Launch | None   # (x[, workspace, counters], sum_d, sum_dd)
    stats: Launch | None    # (x, sum_d, sum_dd, momentum's bits, running_mean, running_var, save_mean, save_invstd)
    y: Launch | None        # (x, mean, invstd, weight, bias, y)


_SETUPS: dict[tuple, _Setup] = {}
_NULL = 0


def _setup(variant: str, x, weight, bias, running_mean, running_var, eps) -> _Setup:
    layout = _check_all(x, weight, bias, running_mean, running_var, eps)
    check_cuda(OP, "x", x)
    dev = x.device
    plan = _plan(tuple(x.shape), layout) if x.numel() else {}
    if not plan:
        return _Setup(layout, plan, None, None, None)
    kind, c = plan["kind"], x.shape[1]
    tail = (SLOT, SLOT) if variant == "atomic" else (SLOT,) * 4
    reduce = Launch.of(function(SOURCE, f"bn_fwd_{kind}_{variant}", dev), plan["red_grid"], plan["red_block"],
                       (SLOT,) + plan["red_args"] + tail, device=dev)
    kstride = np.int64(x.shape[2] * x.shape[3]) if kind == "nchw" else np.int64(1)
    stats = Launch.of(function(SOURCE, "bn_fwd_stats", dev), (cdiv(c, THREADS),), (THREADS,),
                      (SLOT, kstride, SLOT, SLOT, plan["m"], np.int32(c), _float_bits(eps), SLOT,
                       SLOT, SLOT, SLOT, SLOT), device=dev)
    y = Launch.of(function(SOURCE, f"bn_fwd_y_{kind}", dev), plan["dx_grid"], plan["dx_block"],
                  (SLOT,) * 5 + plan["dx_args"] + (SLOT,), device=dev)
    return _Setup(layout, plan, reduce, stats, y)


def _float_bits(v: float) -> np.int32:
    """A float32 kernel argument as a Launch takes it: its bits, as an int32 (the slot's first four bytes)."""
    return np.float32(v).view(np.int32)


def _aligned(t: torch.Tensor, layout: str) -> torch.Tensor:
    """float4 loads need 16-byte aligned rows; the bits must not depend on the address (bn_bwd's rule)."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=_memory_format(layout))


def _launch(variant: str, x, weight, bias, running_mean, running_var, momentum, eps):
    _check_momentum(momentum)
    key = check_key(variant, x, weight, bias, running_mean, running_var, eps)
    st = _SETUPS.get(key) if key is not None else None
    if st is None:
        st = _setup(variant, x, weight, bias, running_mean, running_var, eps)
        if key is not None and len(_SETUPS) < MEMO_LIMIT:
            _SETUPS[key] = st
    if not st.plan:   # an empty batch: no statistics (NaN), running statistics untouched
        return _empty_result(x, st.layout)
    plan, dev, c = st.plan, x.device, x.shape[1]
    x = _aligned(x, st.layout)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    sums = torch.zeros(2, c, device=dev) if variant == "atomic" else torch.empty(2, c, device=dev)
    if variant == "atomic":   # adds into zeros
        st.reduce(x.data_ptr(), sums[0].data_ptr(), sums[1].data_ptr())
    else:
        workspace = counters = None
        if plan["p"] > 1:
            workspace = torch.empty(plan["workspace"], device=dev)
            counters = ticket_counters(dev, plan["counters"])
        st.reduce(x.data_ptr(), workspace.data_ptr() if workspace is not None else _NULL,
                  counters.data_ptr() if counters is not None else _NULL, sums[0].data_ptr(), sums[1].data_ptr())
    stats = torch.empty(2, c, device=dev)
    st.stats(x.data_ptr(), sums[0].data_ptr(), sums[1].data_ptr(), int(_float_bits(momentum)),
             running_mean.data_ptr() if running_mean is not None else _NULL,
             running_var.data_ptr() if running_var is not None else _NULL, stats[0].data_ptr(), stats[1].data_ptr())
    y = torch.empty(x.shape, device=dev, memory_format=_memory_format(st.layout))
    st.y(x.data_ptr(), stats[0].data_ptr(), stats[1].data_ptr(),
         weight.data_ptr() if weight is not None else _NULL, bias.data_ptr() if bias is not None else _NULL,
         y.data_ptr())
    return y, stats[0], stats[1]


def bn_fwd_atomic_cuda(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1, eps=1e-5):
    return _launch("atomic", x, weight, bias, running_mean, running_var, momentum, eps)


def bn_fwd_tree_cuda(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1, eps=1e-5):
    return _launch("tree", x, weight, bias, running_mean, running_var, momentum, eps)


# --------------------------------------------------------------------------------------------------
# CPU order models: the same float32 operations in the same order as the kernels


def _cpu(variant: str, x, weight, bias, running_mean, running_var, momentum, eps, rng):
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("running_mean", running_mean),
                    ("running_var", running_var)):
        if t is not None and t.device.type != "cpu":
            raise KernelArgumentError(OP, name, f"the CPU model needs a CPU tensor, got one on {t.device}")
    layout = _check(x, weight, bias, running_mean, running_var, momentum, eps)
    shape, c = tuple(x.shape), x.shape[1]
    if x.numel() == 0:
        return _empty_result(x, layout)
    if layout == "nchw":
        v = x.detach().numpy().reshape(shape[0], c, -1)
        k = v[0, :, 0].reshape(1, c, 1)
    else:
        v = np.ascontiguousarray(x.detach().numpy() if x.dim() == 2 else
                                 x.detach().permute(0, 2, 3, 1).reshape(-1, c).numpy())
        k = v[0].reshape(1, c)
    d = v - k   # dy's values in the kernels' FWD mode (float32, one rounding)
    sums = cpu_sums(variant, d, v, k, np.ones_like(k), layout, rng)   # [2, C]
    mf = np.float32(int(_plan(shape, layout)["m"]))   # one rounding of M, as __ll2float_rn
    s, t = sums[0], sums[1]
    a = s / mf
    mean = k.reshape(c) + a
    var = (t - s * a) / mf
    var = np.where(var < 0, F32(0), var).astype(F32)
    invstd = F32(1) / np.sqrt(var + F32(eps))
    with torch.no_grad():
        mom = F32(momentum)
        keep = F32(1) - mom
        if running_mean is not None:
            rm = running_mean.numpy()
            running_mean.copy_(torch.from_numpy(mom * mean + keep * rm))
        if running_var is not None:
            rv = running_var.numpy()
            unbiased = (var * mf) / (mf - F32(1))
            running_var.copy_(torch.from_numpy(mom * unbiased + keep * rv))
    chan = k.shape
    w = np.ones(chan, F32) if weight is None else weight.detach().numpy().astype(F32).reshape(chan)
    b = np.zeros(chan, F32) if bias is None else bias.detach().numpy().astype(F32).reshape(chan)
    y = (((v - mean.reshape(chan)) * invstd.reshape(chan)) * w + b).astype(F32)
    if layout == "nchw":
        out = torch.from_numpy(np.ascontiguousarray(y).reshape(shape))
    elif len(shape) == 2:
        out = torch.from_numpy(np.ascontiguousarray(y))
    else:
        n, _, h, wd = shape
        out = torch.from_numpy(np.ascontiguousarray(y).reshape(n, h, wd, c)).permute(0, 3, 1, 2)
    return out, torch.from_numpy(np.ascontiguousarray(mean, F32)), torch.from_numpy(np.ascontiguousarray(invstd, F32))


def bn_fwd_atomic_cpu(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1, eps=1e-5, *,
                      rng=None):
    return _cpu("atomic", x, weight, bias, running_mean, running_var, momentum, eps, rng)


def bn_fwd_tree_cpu(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1, eps=1e-5, *,
                    rng=None):
    return _cpu("tree", x, weight, bias, running_mean, running_var, momentum, eps, rng)


# --------------------------------------------------------------------------------------------------
# Op spec

EPS = 1e-5


def reference_parts(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, invstd) in float64 on the CPU (biased batch variance, as torch saves it)."""
    x = args[0].detach().to("cpu", torch.float64)
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    eps = kwargs.get("eps", args[6] if len(args) > 6 else EPS)
    c = x.shape[1]
    chan = (1, c) if x.dim() == 2 else (1, c, 1, 1)
    dims = (0,) if x.dim() == 2 else (0, 2, 3)
    var, mean = torch.var_mean(x, dims, correction=0)
    invstd = 1.0 / torch.sqrt(var + eps)
    w = torch.ones(c, dtype=torch.float64) if weight is None else weight.detach().to("cpu", torch.float64)
    b = torch.zeros(c, dtype=torch.float64) if bias is None else bias.detach().to("cpu", torch.float64)
    y = (x - mean.view(chan)) * invstd.view(chan) * w.view(chan) + b.view(chan)
    return y, mean, invstd


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    """The exact result as one float64 tensor: y (flattened in N, C, H, W order), mean, invstd."""
    return torch.cat([t.reshape(-1) for t in reference_parts(args, kwargs)])


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """x random from the seed around an offset (so the shift matters), weight and bias random or None; no
    running statistics (benchmarks call the op repeatedly; tests pass their own)."""
    shape, layout = tuple(case.params["shape"]), case.params["layout"]
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randn(shape, generator=g) * case.params.get("scale", 2.0) + case.params.get("offset", 3.0)
    c = shape[1]
    affine = case.params.get("affine", True)
    weight = 1.0 + 0.5 * torch.randn(c, generator=g) if affine else None
    bias = 0.5 * torch.randn(c, generator=g) if affine else None
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return tuple(t.to(device) if t is not None else None for t in (x, weight, bias)), {}


def _case(name: str, shape: tuple[int, ...], layout: str, seed: int, **extra) -> Case:
    return case_of(name, shape, layout, seed, OP, **extra)


def _test_cases() -> list[Case]:
    cases = []
    for i, shape in enumerate(HOSTILE_SHAPES):
        for layout in ("nchw", "channels_last"):
            cases.append(_case("x".join(map(str, shape)), shape, layout, seed=900 + i, affine=i % 3 != 2))
    for i, shape in enumerate(HOSTILE_ROWS):
        cases.append(_case(f"{shape[0]}x{shape[1]}", shape, "rows", seed=950 + i, affine=i % 3 != 2))
    return cases


def _bench_cases(scale: str) -> list[Case]:
    """bn_bwd's: ResNet-18's BatchNorm inputs, batch 128."""
    return [_case(f"bnf_{name}", shape, layout, seed=980 + i)
            for i, name, shape in bench_shapes(scale) for layout in ("nchw", "channels_last")]


def _torch_peer(x, weight=None, bias=None, running_mean=None, running_var=None, momentum=0.1, eps=EPS):
    """torch's training-mode forward as torch.nn runs it (aten::_batch_norm_impl_index: cuDNN's kernel on CUDA for
    float32 with a weight, ATen's otherwise; bench/dev/bn_fwd_cost.py times both): output, mean, invstd."""
    out = torch.ops.aten._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True, momentum, eps,
                                                torch.backends.cudnn.enabled)
    return tuple(out[:3])


def _peers() -> dict:
    return {"torch": _torch_peer}


define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, bn_fwd_atomic_cuda, bn_fwd_atomic_cpu,
         "shifted channel sums' block partials atomicAdd-ed in arrival order; statistics per channel; y elementwise"),
        ("tree", True, False, bn_fwd_tree_cuda, bn_fwd_tree_cpu,
         "shifted channel sums' block partials combined in index order; statistics per channel; y elementwise"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    # x read twice (sums, y), y written; weight, bias read, mean and invstd written
    bytes_moved=lambda case: 12 * int(np.prod(case.params["shape"])) + 16 * case.params["shape"][1],
    out_like=(0, (1, "weight")),   # y as x; mean and invstd float32 (as the weight under autocast)
)
