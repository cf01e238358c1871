"""maxpool_bwd: 2-D max-pool backward. CUDA launchers for ``maxpool_bwd.cu`` and their CPU order models.

    dx = maxpool_bwd(dy, indices, input_size=(H, W), kernel_size=3, stride=2, padding=1)

``dy`` (N, C, OH, OW) float32 and ``indices`` (N, C, OH, OW) int64 are what
``torch.nn.functional.max_pool2d(x, ..., return_indices=True)`` gives (the gradient of its output, and
the flat ``h * W + w`` position of each window's maximum inside the (n, c) plane of x). ``dx`` is
(N, C, H, W) in dy's layout (NCHW or channels_last); input positions that are no window's argmax get
+0.0. The CUDA launchers also take a bf16/fp16 ``dy`` and return dx in its dtype: the kernels widen each
gradient, add in float32 in the order below and round each dx element once, which are the bits of the
float32 variant on ``dy.float()`` rounded with ``.to(dy.dtype)`` (the registry's call on the CPU).

Order of the additions into one dx element (the only thing that decides its bits):
- ``tree``: the windows that can contain the element, in (oh, ow) row-major order, from +0.0. That is
  also the order torch's CPU backward adds in (it scatters the windows of a plane in row-major order)
  and, as measured on the H200, its CUDA backward gives the same bits in both layouts.
- ``atomic``: arrival order of the atomicAdds, from +0.0. With one or two contributions the sum does
  not depend on it (0 + a + b = 0 + b + a); from three on it can.

Subnormals: float atomicAdd flushes subnormal operands and results to sign-preserving zero (PTX
atom.add.f32), and the atomic model does the same; the kernels are compiled without -ftz (see
kernels/runtime.py), so tree's ordinary additions keep subnormals, as its model and torch's CPU backward do.

``indices`` must come from the forward with the same pool parameters. Anything else is the caller's
bug and is not checked (it would cost a pass over the indices): the atomic variant drops indices outside
[0, H * W), the tree variant ignores indices outside the windows that contain an element, and the CPU
models drop indices outside [0, H * W).
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import torch

from .order import F32, rng_of
from .registry import Case, define_op
from .runtime import (
    INT32_MAX,
    KernelArgumentError,
    act_defines,
    cdiv,
    check_cuda,
    memo_check,
    check_size,
    check_tensor,
    function,
    launch,
    layout_of,
    ptr,
)
from .shapes import HOSTILE_POOL, RESNET18_POOL, PoolShape

OP = "maxpool_bwd"
SOURCE = "maxpool_bwd.cu"
THREADS = 256
MAX_BLOCKS = 2**31 - 1

_FORMATS = (("nchw", torch.contiguous_format), ("channels_last", torch.channels_last))


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


def _pair(arg: str, v, *, minimum: int) -> tuple[int, int]:
    vals = (v, v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
    try:
        vals = tuple(vals)
    except TypeError:
        raise KernelArgumentError(OP, arg, f"expected an int or a pair of ints, got {v!r}") from None
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in vals):
        raise KernelArgumentError(OP, arg, f"expected an int or a pair of ints, got {v!r}")
    if any(x < minimum for x in vals):
        raise KernelArgumentError(OP, arg, f"expected values >= {minimum}, got {v!r}")
    return int(vals[0]), int(vals[1])


def pool_out(size: int, k: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """Output length of one pooled axis, as torch's ``pooling_output_shape`` computes it."""
    out = (size + 2 * pad - dilation * (k - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:  # the last window must start inside the input
        out -= 1
    return out


@functools.lru_cache(maxsize=256, typed=True)
def _params(input_size, kernel_size, stride, padding, dilation, ceil_mode) -> dict:
    h, w = _pair("input_size", input_size, minimum=1)
    kh, kw = _pair("kernel_size", kernel_size, minimum=1)
    empty = stride is None or (isinstance(stride, tuple) and len(stride) == 0)  # torch's default: stride=[]
    sh, sw = (kh, kw) if empty else _pair("stride", stride, minimum=1)
    ph, pw = _pair("padding", padding, minimum=0)
    dh, dw = _pair("dilation", dilation, minimum=1)
    if not isinstance(ceil_mode, bool):
        raise KernelArgumentError(OP, "ceil_mode", f"expected a bool, got {ceil_mode!r}")
    if ph > kh // 2 or pw > kw // 2:  # torch's own rule
        raise KernelArgumentError(OP, "padding", f"expected at most half the kernel size {(kh, kw)}, got {(ph, pw)}")
    if h * w > INT32_MAX:
        raise KernelArgumentError(OP, "input_size", f"H * W must be below 2^31, got {h} * {w}")
    oh = pool_out(h, kh, sh, ph, dh, ceil_mode)
    ow = pool_out(w, kw, sw, pw, dw, ceil_mode)
    if oh < 1 or ow < 1:
        raise KernelArgumentError(
            OP, "input_size", f"pool output would be {oh}x{ow} for input {h}x{w} (kernel {(kh, kw)}, "
            f"stride {(sh, sw)}, padding {(ph, pw)}, dilation {(dh, dw)}): too small")
    return dict(h=h, w=w, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw, oh=oh, ow=ow)


def _freeze(v):
    return tuple(v) if isinstance(v, (list, tuple, torch.Size)) else v


_CHECKED: dict[tuple, tuple] = {}


def _check(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode, half_ok: bool = False):
    """Validate everything before any work; returns (dy, indices, params, layout). Memoised per
    configuration (see ``runtime.check_key``). ``half_ok``: dy may be bf16/fp16 (the CUDA launchers)."""
    params, layout = memo_check(_CHECKED, _checked_params, dy, indices, input_size, kernel_size, stride, padding,
                                dilation, ceil_mode, half_ok)
    return dy, indices, params, layout


def _checked_params(*args):
    return _check_all(*args)[2:]


def _check_all(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode, half_ok: bool = False):
    dy = check_tensor(OP, "dy", dy, ndim=4, half_ok=half_ok)
    if not isinstance(indices, torch.Tensor):
        raise KernelArgumentError(OP, "indices", f"expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise KernelArgumentError(OP, "indices", f"expected dtype torch.int64 (as max_pool2d returns), got {indices.dtype}")
    if indices.device != dy.device:
        raise KernelArgumentError(OP, "indices", f"expected a tensor on {dy.device} (dy's device), got one on {indices.device}")
    if indices.shape != dy.shape:
        raise KernelArgumentError(OP, "indices", f"expected dy's shape {tuple(dy.shape)}, got {tuple(indices.shape)}")
    if dy.numel() == 0:
        raise KernelArgumentError(OP, "dy", f"expected a non-empty tensor, got shape {tuple(dy.shape)}")
    try:
        p = _params(_freeze(input_size), _freeze(kernel_size), _freeze(stride), _freeze(padding),
                    _freeze(dilation), ceil_mode)
    except TypeError:  # unhashable junk
        raise KernelArgumentError(OP, "input_size", "expected ints or pairs of ints for the pool parameters") from None
    n, c, oh, ow = dy.shape
    if (oh, ow) != (p["oh"], p["ow"]):
        raise KernelArgumentError(
            OP, "dy", f"expected spatial size {(p['oh'], p['ow'])} (the pool output of input_size "
            f"{(p['h'], p['w'])}), got {(oh, ow)}")
    # The layout both tensors share; a tensor with size-1 dims can be both, NCHW wins then.
    layout = next((name for name, fmt in _FORMATS
                   if dy.is_contiguous(memory_format=fmt) and indices.is_contiguous(memory_format=fmt)), None)
    if layout is None:
        dy_layout = layout_of(OP, "dy", dy)
        layout_of(OP, "indices", indices)
        raise KernelArgumentError(OP, "indices", f"expected the layout of dy ({dy_layout}), got strides {indices.stride()}")
    check_size(OP, "dy", dy)
    if n * c * p["h"] * p["w"] > 2**40:
        raise KernelArgumentError(OP, "input_size", f"dx would have {n * c * p['h'] * p['w']} elements; at most 2^40")
    return dy, indices, p, layout


def _memory_format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode):
    """Checks for a CUDA launcher: dy float32, bfloat16 or float16 (read as such by the kernels)."""
    dy, indices, p, layout = _check(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode,
                                    True)
    check_cuda(OP, "dy", dy)
    return dy, indices, p, layout


def _empty_dx(dy, p: dict, layout: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    n, c = dy.shape[:2]
    return torch.empty((n, c, p["h"], p["w"]), device=dy.device, dtype=dtype or dy.dtype,
                       memory_format=_memory_format(layout))


def _kernel(name: str, dy):
    return function(SOURCE, name, dy.device, act_defines(dy.dtype))


def _blocks(total: int) -> int:
    return max(1, min(cdiv(total, THREADS), MAX_BLOCKS))


def maxpool_bwd_atomic_cuda(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                            ceil_mode=False) -> torch.Tensor:
    dy, indices, p, layout = _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation,
                                            ceil_mode)
    c = dy.shape[1]
    dx = _empty_dx(dy, p, layout, torch.float32).zero_()  # the atomics add onto +0.0, in float32
    total = dy.numel()
    launch(_kernel("maxpool_bwd_atomic", dy), (_blocks(total),), (THREADS,),
           (ptr(dy), ptr(indices), ptr(dx), np.int64(total), np.int32(c), np.int32(p["h"] * p["w"]),
            np.int32(p["oh"] * p["ow"]), np.int32(layout == "channels_last")), device=dy.device)
    return dx if dy.dtype == torch.float32 else dx.to(dy.dtype)  # half: the sums rounded once


def _pool_args(p: dict, c: int, layout: str) -> tuple:
    return _pool_ints(c, layout, *(p[k] for k in _POOL_KEYS))


_POOL_KEYS = ("h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw")


@functools.lru_cache(maxsize=512)
def _pool_ints(c: int, layout: str, *vals) -> tuple:
    """The kernels' int32 pool arguments (cached: building them costs host time on every small call)."""
    p = dict(zip(_POOL_KEYS, vals))
    i32 = np.int32
    return (i32(c), i32(p["h"]), i32(p["w"]), i32(p["oh"]), i32(p["ow"]), i32(p["kh"]), i32(p["kw"]),
            i32(p["sh"]), i32(p["sw"]), i32(p["ph"]), i32(p["pw"]), i32(p["dh"]), i32(p["dw"]),
            i32(layout == "channels_last"))


# Shared memory of one maxpool_bwd_tile block: at most the default 48 KiB a block may take without
# opting in. Blocks stage about TILE_CELLS windows (NCHW: whole planes) or TILE_CHANNELS channels of one
# image (channels_last); larger planes fall back to the global gather.
SMEM_LIMIT = 48 * 1024
TILE_CELLS = 512
TILE_CHANNELS = 8


@functools.lru_cache(maxsize=512)
def tile_plan(n: int, c: int, h: int, w: int, oh: int, ow: int, layout: str) -> tuple[int, int, int, int] | None:
    """(grid, group, shift, shared bytes) of maxpool_bwd_tile, or None when a block's share does not
    fit in shared memory (then tree runs maxpool_bwd_tree). NCHW: ``group`` planes per block and
    2^shift threads per dx row (the next power of two >= W, at most 32); channels_last: ``group``
    channels per block, 2^shift = group. Depends on the shapes only; the bits never depend on it."""
    q = oh * ow
    if layout == "channels_last":
        group = 1 << min(max(c - 1, 0).bit_length(), TILE_CHANNELS.bit_length() - 1)
        shift = group.bit_length() - 1
        cells = q * group
        grid = n * cdiv(c, group)
    else:
        group = max(1, min(TILE_CELLS // q, n * c))
        shift = min(max(w - 1, 0).bit_length(), 5)
        cells = q * group
        grid = cdiv(n * c, group)
    smem = 8 * cells + 8 * (h + w)
    if smem > SMEM_LIMIT or grid > MAX_BLOCKS:
        return None
    return grid, group, shift, smem


# Pools with a stride-cell kernel in maxpool_bwd.cu (maxpool_bwd_cell_k<K>s<S>p<P>_*): square, dilation 1.
CELL_POOLS = frozenset({(3, 2, 1), (3, 2, 0), (2, 2, 0), (3, 1, 1)})


@functools.lru_cache(maxsize=512)
def cell_plan(h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, dh: int, dw: int,
              oh: int, ow: int) -> tuple[str, int, int] | None:
    """(kernel name stem, BH, BW) of tree's stride-cell kernel for this pool (BH x BW cells of stride x
    stride input positions), or None when maxpool_bwd.cu has no kernel for it. Depends on the pool
    only; the bits never depend on it."""
    if not (kh == kw and sh == sw and ph == pw and dh == dw == 1 and (kh, sh, ph) in CELL_POOLS):
        return None
    return f"maxpool_bwd_cell_k{kh}s{sh}p{ph}", cdiv(h, sh), cdiv(w, sw)


@functools.lru_cache(maxsize=512)
def cell_divisor(d: int) -> tuple[np.uint32, np.int32]:
    """(m, s) with n // d == (((n * m) >> 32) + n) >> s for every 0 <= n < 2**31 (the kernels' CellDiv):
    s = ceil(log2 d), m = floor(2**32 * (2**s - d) / d) + 1 < 2**32."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} outside [1, 2^31)")
    s = (d - 1).bit_length()
    return np.uint32((2**32 * (2**s - d)) // d + 1), np.int32(s)


def _cell(dy, indices, p: dict, layout: str, plan: tuple[str, int, int]) -> torch.Tensor:
    stem, bh, bw = plan
    n, c = dy.shape[:2]
    dx = _empty_dx(dy, p, layout)
    total = n * c * bh * bw
    blocks = _blocks(total)
    narrow = (total + blocks * THREADS <= INT32_MAX and n * c * p["h"] * p["w"] <= INT32_MAX
              and dy.numel() <= INT32_MAX)
    name = f"{stem}_{'cl' if layout == 'channels_last' else 'nchw'}_{'i32' if narrow else 'i64'}"
    i32 = np.int32
    launch(_kernel(name, dy), (blocks,), (THREADS,),
           (ptr(dy), ptr(indices), ptr(dx), np.int64(total), i32(c), i32(p["h"]), i32(p["w"]), i32(p["oh"]),
            i32(p["ow"]), i32(bh), i32(bw), *cell_divisor(c), *cell_divisor(bh), *cell_divisor(bw)),
           device=dy.device)
    return dx


def _cell_plan_of(p: dict):
    return cell_plan(*(p[k] for k in ("h", "w", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "oh", "ow")))


def maxpool_bwd_tree_cuda(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                          ceil_mode=False) -> torch.Tensor:
    dy, indices, p, layout = _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation,
                                            ceil_mode)
    plan = _cell_plan_of(p)
    if plan is not None:
        return _cell(dy, indices, p, layout, plan)
    return _tree_tiled(dy, indices, p, layout)


def _tree_tiled(dy, indices, p: dict, layout: str) -> torch.Tensor:
    n, c = dy.shape[:2]
    tiled = tile_plan(n, c, p["h"], p["w"], p["oh"], p["ow"], layout)
    if tiled is None:
        return _tree_gather(dy, indices, p, layout)
    grid, group, shift, smem = tiled
    dx = _empty_dx(dy, p, layout)
    units = n if layout == "channels_last" else n * c
    launch(_kernel("maxpool_bwd_tile", dy), (grid,), (THREADS,),
           (ptr(dy), ptr(indices), ptr(dx), np.int64(units), *_pool_args(p, c, layout), np.int32(group),
            np.int32(shift)), device=dy.device, shared_mem=smem)
    return dx


def _tree_gather(dy, indices, p: dict, layout: str) -> torch.Tensor:
    c = dy.shape[1]
    dx = _empty_dx(dy, p, layout)
    total = dx.numel()
    launch(_kernel("maxpool_bwd_tree", dy), (_blocks(total),), (THREADS,),
           (ptr(dy), ptr(indices), ptr(dx), np.int64(total), *_pool_args(p, c, layout)), device=dy.device)
    return dx


def maxpool_bwd_tree_gather_cuda(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                                 ceil_mode=False) -> torch.Tensor:
    """tree through the global-memory gather kernel only (what tree runs when the tile does not fit);
    for tests and timing beside the tiled path. Same bits."""
    dy, indices, p, layout = _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation,
                                            ceil_mode)
    return _tree_gather(dy, indices, p, layout)


def maxpool_bwd_tree_tile_cuda(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                               ceil_mode=False) -> torch.Tensor:
    """tree without the stride-cell kernel: tiled through shared memory, or the global gather where the
    tile does not fit; for tests and timing beside the cell kernel. Same bits."""
    dy, indices, p, layout = _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation,
                                            ceil_mode)
    return _tree_tiled(dy, indices, p, layout)


def maxpool_bwd_owner_cuda(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                           ceil_mode=False) -> torch.Tensor:
    dy, indices, p, layout = _cuda_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation,
                                            ceil_mode)
    c = dy.shape[1]
    dx = _empty_dx(dy, p, layout).zero_()  # positions no window owns stay +0.0
    total = dy.numel()
    launch(_kernel("maxpool_bwd_owner", dy), (_blocks(total),), (THREADS,),
           (ptr(dy), ptr(indices), ptr(dx), np.int64(total), *_pool_args(p, c, layout)), device=dy.device)
    return dx


# --------------------------------------------------------------------------------------------------
# CPU order models (Numba: one float32 addition per contribution, in the kernel's order)


@functools.lru_cache(maxsize=None)
def _jit():
    import numba

    tiny = F32(np.finfo(F32).tiny)

    @numba.njit(cache=False)
    def ftz(x):
        # float atomicAdd (PTX atom.add.f32) flushes subnormal operands and results to
        # sign-preserving zero; ordinary additions (tree) keep them.
        return x * F32(0.0) if abs(x) < tiny else x

    # Arrays are (A, Q, B): planes A, window cells Q = OH * OW (dx: H * W positions), B channels that
    # lie innermost in memory. NCHW is (N * C, Q, 1), channels_last (N, Q, C): no layout copies.

    @numba.njit(cache=False)
    def scatter_rowmajor(dy, idx, hw, dx):
        # The windows of each plane in (oh, ow) row-major order: per dx element, tree's order.
        for a in range(dy.shape[0]):
            for q in range(dy.shape[1]):
                for b in range(dy.shape[2]):
                    i = idx[a, q, b]
                    if i >= 0 and i < hw:
                        dx[a, i, b] = dx[a, i, b] + dy[a, q, b]

    @numba.njit(cache=False)
    def scatter_shuffled(dy, idx, hw, u, dx):
        # Arrival order: each dx element's contributions in a uniformly random order (a Fisher-Yates
        # shuffle driven by the uniforms u, one per window), independent across elements. Plane by
        # plane: counting-sort the windows by target, shuffle each group, add it from +0.0.
        n_el = hw * dy.shape[2]
        nb = dy.shape[2]
        start = np.zeros(n_el + 1, np.int64)
        cursor = np.zeros(n_el, np.int64)
        vals = np.empty(dy.shape[1] * nb, np.float32)
        keys = np.empty(dy.shape[1] * nb, np.float64)
        for a in range(dy.shape[0]):
            start[:] = 0
            for q in range(dy.shape[1]):
                for b in range(nb):
                    i = idx[a, q, b]
                    if i >= 0 and i < hw:
                        start[i * nb + b + 1] += 1
            for e in range(n_el):
                start[e + 1] += start[e]
                cursor[e] = start[e]
            for q in range(dy.shape[1]):
                for b in range(nb):
                    i = idx[a, q, b]
                    if i >= 0 and i < hw:
                        e = i * nb + b
                        vals[cursor[e]] = dy[a, q, b]
                        keys[cursor[e]] = u[a, q, b]
                        cursor[e] += 1
            for e in range(n_el):
                s = start[e]
                k = start[e + 1] - s
                for j in range(k - 1, 0, -1):
                    r = min(int(keys[s + j] * (j + 1)), j)
                    vals[s + j], vals[s + r] = vals[s + r], vals[s + j]
                acc = F32(0.0)
                for j in range(k):
                    acc = ftz(acc + ftz(vals[s + j]))
                dx[a, e] = acc

    return scatter_rowmajor, scatter_shuffled


def _cpu_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode):
    dy, indices, p, layout = _check(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs CPU tensors, got one on {dy.device}")
    n, c, oh, ow = dy.shape
    if layout == "channels_last":  # memory is N, OH, OW, C
        shape, dx_shape = (n, oh * ow, c), (n, p["h"] * p["w"], c)
        g, i = dy.detach().permute(0, 2, 3, 1), indices.permute(0, 2, 3, 1)
    else:
        shape, dx_shape = (n * c, oh * ow, 1), (n * c, p["h"] * p["w"], 1)
        g, i = dy.detach(), indices
    g = g.numpy().reshape(shape)  # views: both are contiguous in this order
    i = i.numpy().reshape(shape)
    return g, i, np.zeros(dx_shape, dtype=F32), p, layout


def _to_torch(dx: np.ndarray, dy: torch.Tensor, p: dict, layout: str) -> torch.Tensor:
    n, c = dy.shape[:2]
    out = torch.from_numpy(dx)
    if layout == "channels_last":
        return out.view(n, p["h"], p["w"], c).permute(0, 3, 1, 2)
    return out.view(n, c, p["h"], p["w"])


def maxpool_bwd_tree_cpu(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                         ceil_mode=False, rng=None) -> torch.Tensor:
    g, i, dx, p, layout = _cpu_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode)
    _jit()[0](g, i, p["h"] * p["w"], dx)
    return _to_torch(dx, dy, p, layout)


def maxpool_bwd_atomic_cpu(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1,
                           ceil_mode=False, rng=None) -> torch.Tensor:
    g, i, dx, p, layout = _cpu_prologue(dy, indices, input_size, kernel_size, stride, padding, dilation, ceil_mode)
    u = rng_of(rng).random(g.shape)
    _jit()[1](g, i, p["h"] * p["w"], u, dx.reshape(dx.shape[0], -1))
    return _to_torch(dx, dy, p, layout)


# --------------------------------------------------------------------------------------------------
# Helpers for tests and benchmarks: float64 reference, per-element contributions and error bound


def _flat(dy: torch.Tensor, indices: torch.Tensor):
    n, c, oh, ow = dy.shape
    return (dy.detach().to("cpu").contiguous().reshape(n * c, oh * ow),
            indices.to("cpu").contiguous().reshape(n * c, oh * ow))


def reference(dy: torch.Tensor, indices: torch.Tensor, *, input_size, **_) -> torch.Tensor:
    """float64 scatter-add of dy at indices, (N, C, H, W) NCHW on the CPU."""
    h, w = _pair("input_size", _freeze(input_size), minimum=1)
    g, i = _flat(dy, indices)
    out = torch.zeros(g.shape[0], h * w, dtype=torch.float64)
    out.scatter_add_(1, i, g.to(torch.float64))
    return out.view(dy.shape[0], dy.shape[1], h, w)


def contributions(dy: torch.Tensor, indices: torch.Tensor, *, input_size, **_):
    """Per dx element (NCHW flat): (count, abs_sum) of the gradients added into it, and the gradients
    themselves grouped by element in tree order: (values sorted by element, start offset per element)."""
    h, w = _pair("input_size", _freeze(input_size), minimum=1)
    g, i = _flat(dy, indices)
    planes = g.shape[0]
    key = (torch.arange(planes).unsqueeze(1) * (h * w) + i).reshape(-1).numpy()
    vals = g.reshape(-1).numpy()
    order = np.argsort(key, kind="stable")  # stable: row-major window order within an element
    count = np.bincount(key, minlength=planes * h * w)
    abs_sum = np.bincount(key, weights=np.abs(vals.astype(np.float64)), minlength=planes * h * w)
    start = np.concatenate(([0], np.cumsum(count)[:-1]))
    return count, abs_sum, vals[order], start


def error_bound(count: np.ndarray, abs_sum: np.ndarray) -> np.ndarray:
    """|float32 sum - exact| for ``count`` terms added one at a time from +0.0, in any order: the first
    addition is exact, each of the other count - 1 rounds once, so <= gamma(count - 1) * sum |term|,
    gamma(m) = m u / (1 - m u), u = 2^-24 (Higham, recursive summation)."""
    m = np.maximum(count.astype(np.float64) - 1.0, 0.0)
    u = 2.0**-24
    return m * u / (1.0 - m * u) * abs_sum


def possible_sums(values: np.ndarray, start: np.ndarray, count: np.ndarray, elements: np.ndarray) -> np.ndarray:
    """Every float32 result of adding an element's contributions from +0.0 in some order:
    (len(elements), count!) for elements that all have the same count (at most 6)."""
    k = int(count[elements[0]])
    assert np.all(count[elements] == k) and k <= 6
    terms = values[start[elements][:, None] + np.arange(k)[None, :]].astype(F32)
    perms = np.array(list(itertools.permutations(range(k))))
    out = np.zeros((len(elements), len(perms)), dtype=F32)
    for j in range(k):
        out = out + terms[:, perms[:, j]]
    return out


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, float64 reference, cases, peers


def _case_params(s: PoolShape, layout: str = "nchw", ties: bool = False, ceil_mode: bool = False) -> dict:
    return {"n": s.n, "c": s.c, "h": s.h, "w": s.w, "k": s.k, "stride": s.stride, "pad": s.pad,
            "dilation": s.dilation, "ceil_mode": ceil_mode, "layout": layout, "ties": ties}


def _pool_kwargs(p: dict) -> dict:
    return {"input_size": (p["h"], p["w"]), "kernel_size": p["k"], "stride": p["stride"], "padding": p["pad"],
            "dilation": p["dilation"], "ceil_mode": p.get("ceil_mode", False)}


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """x from case.seed (with ``ties``: values from {-1, 0, 1, 2}, so most windows hold several equal
    maxima and torch's first-maximum rule picks the argmax), torch's forward on the CPU (the same
    indices on every device), dy random normal."""
    p = case.params
    g = torch.Generator().manual_seed(case.seed)
    shape = (p["n"], p["c"], p["h"], p["w"])
    x = torch.randint(-1, 3, shape, generator=g).float() if p.get("ties") else torch.randn(shape, generator=g)
    kw = _pool_kwargs(p)
    _, indices = torch.nn.functional.max_pool2d(
        x, kw["kernel_size"], kw["stride"], kw["padding"], kw["dilation"], ceil_mode=kw["ceil_mode"],
        return_indices=True)
    dy = torch.randn(indices.shape, generator=g)
    if p.get("layout") == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
        indices = indices.contiguous(memory_format=torch.channels_last)
    return (dy.to(device), indices.to(device)), kw


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    return reference(*args, **kwargs)


def windows_per_position(p: dict) -> float:
    """Average number of windows covering an input position (in-bounds window cells / (H * W))."""
    kw = _pool_kwargs(p)
    prm = _params(kw["input_size"], _freeze(kw["kernel_size"]), _freeze(kw["stride"]), _freeze(kw["padding"]),
                  _freeze(kw["dilation"]), kw["ceil_mode"])

    def axis(size, k, s, pad, d, out):
        starts = np.arange(out) * s - pad
        pos = starts[:, None] + np.arange(k)[None, :] * d
        return int(np.sum((pos >= 0) & (pos < size)))

    rows = axis(prm["h"], prm["kh"], prm["sh"], prm["ph"], prm["dh"], prm["oh"])
    cols = axis(prm["w"], prm["kw"], prm["sw"], prm["pw"], prm["dw"], prm["ow"])
    return rows * cols / (prm["h"] * prm["w"])


def _case(name: str, s: PoolShape, seed: int, **kw) -> Case:
    params = _case_params(s, **kw)
    return Case(OP, name, params, seed=seed, contention=windows_per_position(params))


# Extra hostile cases beyond shapes.HOSTILE_POOL: ceil_mode, heavy ties, a window larger than the stride
# in one axis only.
_EXTRA_POOL = (
    (PoolShape("ceil_k3s2", 2, 3, 10, 7, 3, 2, 0), {"ceil_mode": True}),
    (PoolShape("ties_k3s1", 2, 3, 12, 11, 3, 1, 1), {"ties": True}),
    (PoolShape("ties_k5s2p2", 1, 4, 13, 13, 5, 2, 2), {"ties": True}),
)


def _test_cases() -> list[Case]:
    cases = []
    seed = 5000
    for s in HOSTILE_POOL:
        for layout in ("nchw", "channels_last"):
            cases.append(_case(f"{s.name}_{layout}", s, seed, layout=layout))
            seed += 1
    for s, kw in _EXTRA_POOL:
        cases.append(_case(s.name, s, seed, **kw))
        seed += 1
    for s in RESNET18_POOL:
        for n in (1, 128):
            for layout in ("nchw", "channels_last"):
                cases.append(_case(f"{s.name}_b{n}_{layout}", s.with_batch(n), seed, layout=layout))
                seed += 1
    return cases


def contention_shapes(n: int, c: int, size: int = 32) -> tuple[PoolShape, ...]:
    """k x k stride-1 pools (padding k // 2) on a size x size map: every input position lies in up to
    k^2 windows, and local maxima are the argmax of many of them."""
    return tuple(PoolShape(f"contention_k{k}s1_{size}", n, c, size, size, k, 1, k // 2) for k in (3, 5, 7))


def _bench_cases(scale: str) -> list[Case]:
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    if scale == "cpu":
        pools = [s.with_batch(8) for s in RESNET18_POOL]
        contention = contention_shapes(2, 8)
    else:
        pools = list(RESNET18_POOL)
        contention = contention_shapes(128, 64)
    cases = []
    for i, s in enumerate(pools):
        for layout in ("nchw", "channels_last"):
            cases.append(_case(f"{s.name}_b{s.n}_{layout}", s, 700 + i, layout=layout))
    for i, s in enumerate(contention):
        cases.append(_case(f"{s.name}_b{s.n}", s, 800 + i))
    return cases


def torch_backward(dy, indices, *, input_size, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch's own max_pool2d backward (aten) on the same dy and indices; it reads only the shape and
    memory format of the forward input, so an empty tensor of that shape stands in for x."""
    h, w = _pair("input_size", _freeze(input_size), minimum=1)
    fmt = torch.channels_last if (not dy.is_contiguous() and dy.is_contiguous(memory_format=torch.channels_last)) \
        else torch.contiguous_format
    x = torch.empty((dy.shape[0], dy.shape[1], h, w), device=dy.device, dtype=dy.dtype, memory_format=fmt)
    k = list(_pair("kernel_size", _freeze(kernel_size), minimum=1))
    s = k if stride is None else list(_pair("stride", _freeze(stride), minimum=1))
    return torch.ops.aten.max_pool2d_with_indices_backward(
        dy, x, k, s, list(_pair("padding", _freeze(padding), minimum=0)),
        list(_pair("dilation", _freeze(dilation), minimum=1)), ceil_mode, indices)


def _peers() -> dict:
    return {"torch": torch_backward}


def _bytes_moved(case: Case) -> int:
    p = case.params
    prm = _params(*(_freeze(v) for v in _pool_kwargs(p).values()))
    outputs = p["n"] * p["c"] * prm["oh"] * prm["ow"]
    return outputs * (4 + 8) + 4 * p["n"] * p["c"] * p["h"] * p["w"]


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, maxpool_bwd_atomic_cuda, maxpool_bwd_atomic_cpu,
         "one thread per window; its gradient atomicAdd-ed at the argmax (overlapping windows collide)"),
        ("tree", True, False, maxpool_bwd_tree_cuda, maxpool_bwd_tree_cpu,
         "each input gathers the windows whose argmax it is in (oh, ow) row-major order; one thread "
         "per stride cell from registers for common pools, else from a shared-memory copy of the "
         "block's windows (global gather for planes too large)"),
        ("owner", True, False, maxpool_bwd_owner_cuda, maxpool_bwd_tree_cpu,
         "one thread per window; the first window pointing at a position sums it in tree's order "
         "(bits = tree)"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
    half_native=True,
)
