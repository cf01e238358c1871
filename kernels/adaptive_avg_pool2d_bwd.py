"""adaptive_avg_pool2d_bwd: backward of ``F.adaptive_avg_pool2d(x, (OH, OW))``. CUDA launchers for
``adaptive_avg_pool2d_bwd.cu`` and their CPU order models.

    dx = adaptive_avg_pool2d_bwd(dy, input_size=(H, W))

``dy`` (N, C, OH, OW) float32; ``dx`` (N, C, H, W) float32 in dy's layout (NCHW or channels_last; a
non-contiguous dy is first copied to the layout its strides suggest). Window of output (oh, ow): rows
[floor(oh*H/OH), ceil((oh+1)*H/OH)), columns likewise; kh x kw its size (windows overlap where H is no
multiple of OH, and OH > H makes them cover elements many times over).

Per-element contribution, the same in both variants and both layouts: ``(dy / kw) / kh``, two IEEE
float32 divisions in that order. That is torch's CUDA NCHW backward (``*ptr_gradOutput / kW / kH``), so
an element covered by one window gets torch's CUDA bits. torch's CPU backward divides in the other
order (``/ kh / kw``), which gives the same float32 whenever kh == kw or either is 1, and can differ by
one rounding otherwise; torch's CUDA channels_last kernel multiplies by ``(1/kW) * (1/kH)`` and
accumulates with fused multiply-adds, a third arithmetic.

Order of the additions into one dx element:
- ``tree``: the windows that cover it in (oh, ow) row-major order, from +0.0. That is the order of
  torch's CPU backward (it zeroes dx and adds each plane's windows in row-major order), so tree equals
  torch's CPU backward bit for bit wherever the two division orders agree on every contribution (in
  particular for square windows: 14->7, 7->1, 28->7).
  The CUDA kernel (``_tiled`` in the .cu file) computes each dy element's share once into shared
  memory and then adds, per dx element, the shares of its windows in that order; the shares and the
  order are the same as summing (dy / kw) / kh on the spot (``_direct``, the fallback for shapes
  whose tile does not fit), so both give the same bits. Where the windows tile the input exactly
  (H and W multiples of OH and OW: 14->7, 7->1, 7->7) every element has one window and its sum is
  +0.0 + share: ``_exact`` writes that straight from dy (four channels per thread in channels_last, two
  or four elements of one row and one window per thread in NCHW where W and KW allow), with no shared
  memory or tables; again the same bits.
- ``atomic``: arrival order of the atomicAdds, from +0.0. With one or two contributions the sum does
  not depend on it (0 + a + b = 0 + b + a); from three on it can.

A -0.0 gradient gives +0.0 (+0.0 + -0.0 = +0.0), as in torch's backward. Subnormals: float atomicAdd
flushes subnormal operands and results to sign-preserving zero, and the atomic model does too; tree's
ordinary additions keep them (kernels are compiled without -ftz).

torch's CUDA backward of this op is always its atomic kernel for NCHW, and it raises under
``torch.use_deterministic_algorithms(True)`` in both layouts, except that ``F.adaptive_avg_pool2d`` to
(1, 1) runs ``mean`` instead, whose backward is deterministic.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .order import F32, arrival_sum
from .registry import Case, define_op
from .runtime import (
    INT32_MAX,
    KernelArgumentError,
    cdiv,
    check_cuda,
    check_size,
    check_tensor,
    function,
    launch,
    memo_check,
    ptr,
    sm_count,
)

OP = "adaptive_avg_pool2d_bwd"
SOURCE = "adaptive_avg_pool2d_bwd.cu"
THREADS = 256
MAX_BLOCKS = 2**31 - 1
NEG_ZERO = F32(-0.0)  # x + (-0.0) == x for every x: the neutral padding of a masked addition


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


def size_pair(op: str, v) -> tuple[int, int]:
    """``input_size`` as (H, W), or a KernelArgumentError of ``op`` that says what was wrong."""
    try:
        vals = tuple(v)
    except TypeError:
        raise KernelArgumentError(op, "input_size", f"expected a pair of ints (H, W), got {v!r}") from None
    if len(vals) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in vals):
        raise KernelArgumentError(op, "input_size", f"expected a pair of ints (H, W), got {v!r}")
    if min(vals) < 1:
        raise KernelArgumentError(op, "input_size", f"expected sizes >= 1, got {v!r}")
    return int(vals[0]), int(vals[1])


def suggest_layout(t: torch.Tensor) -> str:
    """'nchw' or 'channels_last': the layout of a contiguous tensor, else the one its strides are
    closest to (channels_last when C has the smallest stride and H's exceeds W's), as torch's
    ``suggest_memory_format`` decides for a 4-D tensor."""
    if t.is_contiguous():
        return "nchw"
    if t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    s = t.stride()
    return "channels_last" if s[0] >= s[2] >= s[3] >= s[1] and t.shape[1] > 1 else "nchw"


def memory_format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


def _check_all(dy, input_size):
    dy = check_tensor(OP, "dy", dy, ndim=4)
    if dy.numel() == 0:
        raise KernelArgumentError(OP, "dy", f"expected a non-empty tensor, got shape {tuple(dy.shape)}")
    h, w = size_pair(OP, input_size)
    n, c, oh, ow = dy.shape
    if h * w > INT32_MAX or oh * ow > INT32_MAX:
        raise KernelArgumentError(OP, "input_size", f"H * W and OH * OW must be below 2^31, got {(h, w)}, {(oh, ow)}")
    check_size(OP, "dy", dy)
    if n * c * h * w > 2**40:
        raise KernelArgumentError(OP, "input_size", f"dx would have {n * c * h * w} elements; at most 2^40")
    return h, w


_CHECKED: dict = {}


def _check(dy, input_size):
    """Validate, then bring dy into a contiguous layout; returns (dy, (H, W), layout)."""
    h, w = memo_check(_CHECKED, _check_all, dy, tuple(input_size) if isinstance(input_size, list) else input_size)
    layout = suggest_layout(dy)
    return dy.contiguous(memory_format=memory_format(layout)), (h, w), layout


# --------------------------------------------------------------------------------------------------
# CUDA launchers

TILE_SHARES = 4096        # floats of one tile's shares (16 KiB): ~8 blocks of 256 threads per SM still fit
MAX_EXACT_BLOCKS = 1 << 16  # the exact kernel's grid at most (its threads loop)
TILE_MAX_OUT = 1 << 16    # dx elements of one tile at most (a bigger plane goes to the direct kernel)
SMEM_LIMIT = 48 * 1024    # dynamic shared memory without opting in
BLOCKS_PER_SM = 8         # 2048 resident threads per SM / 256


@functools.lru_cache(maxsize=1024)
def tree_plan(n: int, c: int, h: int, w: int, oh: int, ow: int, layout: str):
    """How the tiled tree kernel cuts this shape: (images N, channels C, P, CB, shared bytes, tiles),
    NCHW viewed as N*C images of one channel; None where it does not fit (the direct kernel runs).

    A tile is P images x CB channels; its shares (P * CB * OH * OW floats) must fit in TILE_SHARES
    beside the tables, and it should hold a few thousand dx elements (fewer on small problems, so that
    there are >= ~2048 tiles to spread over the SMs). CB is all channels where a whole image fits
    (the tile is then contiguous), else 32 (a warp's stores are 128 contiguous bytes), halved until
    the shares fit."""
    big_n, big_c = (n * c, 1) if layout == "nchw" else (n, c)
    hw, ohw = h * w, oh * ow
    tables = 64 + 8 * (h + w) + 4 * (oh + ow)  # FastDiv[5] padded, int2 rows/cols, float khf/kwf
    budget = min(TILE_SHARES, (SMEM_LIMIT - tables) // 4)
    if budget < ohw:
        return None
    target = min(4096, max(512, big_n * big_c * hw // 2048))
    if big_c * ohw <= budget and big_c * hw <= target:
        cb = big_c
    else:
        cb = min(32, big_c)
        while cb > 1 and cb * ohw > budget:
            cb //= 2
    if cb * hw > TILE_MAX_OUT:
        return None
    p = max(1, min(big_n, target // (cb * hw), budget // (cb * ohw)))
    tiles = cdiv(big_n, p) * cdiv(big_c, cb)
    return big_n, big_c, p, cb, tables + 4 * p * cb * ohw, tiles


def magic_divider(d: int) -> tuple[int, int]:
    """(m, s) with n // d == (umulhi(n, m) + n) >> s for every 0 <= n < 2^31 (32-bit unsigned arithmetic;
    torch's IntDivider): s the least with 2^s >= d, m = 2^32 (2^s - d) // d + 1. For 1 <= d <= 2^31."""
    if not 1 <= d <= 2**31:
        raise ValueError(f"magic_divider: divisor must be in [1, 2^31], got {d}")
    s = (d - 1).bit_length()
    return ((1 << 32) * ((1 << s) - d)) // d + 1, s


def exact_windows(h: int, w: int, oh: int, ow: int) -> bool:
    """Whether the pooling windows tile the input exactly (each dx element in exactly one window)."""
    return oh <= h and ow <= w and h % oh == 0 and w % ow == 0


def _launch_exact(dy: torch.Tensor, dx: torch.Tensor, layout: str) -> bool:
    """tree through the exact kernel where the windows tile dx and every index fits 32 bits; False if not."""
    n, c, h, w = dx.shape
    oh, ow = dy.shape[2:]
    if not exact_windows(h, w, oh, ow) or dx.numel() + THREADS * MAX_EXACT_BLOCKS > INT32_MAX:
        return False
    kh, kw = h // oh, w // ow
    aligned = dy.data_ptr() % 16 == 0 and dx.data_ptr() % 16 == 0
    if layout == "channels_last":
        vec = 4 if c % 4 == 0 and aligned else 1
        divisors = (c // vec, w, h, kh, kw)
    else:   # vec elements of one row in one window: one share, one vector store
        vec = next((v for v in (4, 2) if w % v == 0 and kw % v == 0 and aligned), 1)
        divisors = (h * w // vec, w // vec, 1, kh, kw // vec)
    total = dx.numel() // vec
    q = [v for d in divisors for v in _magic(d)]
    blocks = max(1, min(cdiv(total, THREADS), MAX_EXACT_BLOCKS))
    launch(function(SOURCE, "adaptive_avg_pool2d_bwd_tree_exact", dy.device), (blocks,), (THREADS,),
           (dy.data_ptr(), dx.data_ptr(), total, c, h, w, oh, ow, int(layout == "channels_last"), vec, *q),
           device=dy.device)
    return True


@functools.lru_cache(maxsize=256)
def _magic(d: int) -> tuple[int, int]:
    return magic_divider(d)


def _launch(kind: str, dy, input_size) -> torch.Tensor:
    dy, (h, w), layout = _check(dy, input_size)
    check_cuda(OP, "dy", dy)
    n, c, oh, ow = dy.shape
    dx = torch.empty((n, c, h, w), device=dy.device, dtype=torch.float32, memory_format=memory_format(layout))
    i32 = np.int32
    if kind == "tree" and _launch_exact(dy, dx, layout):
        return dx
    plan = tree_plan(n, c, h, w, oh, ow, layout) if kind in ("tree", "tree_tiled") else None
    if plan is not None:
        big_n, big_c, p, cb, smem, tiles = plan
        blocks = max(1, min(tiles, BLOCKS_PER_SM * sm_count(dy.device)))  # blocks loop over the tiles
        launch(function(SOURCE, "adaptive_avg_pool2d_bwd_tree_tiled", dy.device), (blocks,), (THREADS,),
               (ptr(dy), ptr(dx), np.int64(big_n), i32(big_c), i32(h), i32(w), i32(oh), i32(ow), i32(cb), i32(p)),
               device=dy.device, shared_mem=smem)
        return dx
    if kind == "atomic":
        dx.zero_()  # the atomics add onto +0.0
        name, total = "adaptive_avg_pool2d_bwd_atomic", dy.numel()  # one thread per dy element
    else:
        name, total = "adaptive_avg_pool2d_bwd_tree_direct", dx.numel()  # one thread per dx element
    blocks = max(1, min(cdiv(total, THREADS), MAX_BLOCKS))
    launch(function(SOURCE, name, dy.device), (blocks,), (THREADS,),
           (ptr(dy), ptr(dx), np.int64(total), i32(c), i32(h), i32(w), i32(oh), i32(ow),
            i32(layout == "channels_last")), device=dy.device)
    return dx


def adaptive_avg_pool2d_bwd_atomic_cuda(dy, *, input_size) -> torch.Tensor:
    return _launch("atomic", dy, input_size)


def adaptive_avg_pool2d_bwd_tree_cuda(dy, *, input_size) -> torch.Tensor:
    """tree: the exact kernel where the windows tile the input (exact_windows), else the tiled kernel where
    the shape fits it (tree_plan), else the direct one; same bits."""
    return _launch("tree", dy, input_size)


def adaptive_avg_pool2d_bwd_tree_tiled_cuda(dy, *, input_size) -> torch.Tensor:
    """tree without the exact kernel: the tiled one where a tile fits, else the direct one (for tests and
    timing beside the exact kernel). Same bits."""
    return _launch("tree_tiled", dy, input_size)


def adaptive_avg_pool2d_bwd_tree_direct_cuda(dy, *, input_size) -> torch.Tensor:
    """tree's direct kernel whatever the shape (what tree runs where no tile fits); for tests and
    timing beside the tiled kernel. Same bits."""
    return _launch("tree_direct", dy, input_size)


# --------------------------------------------------------------------------------------------------
# Geometry and CPU order models (NumPy, one float32 rounding per operation, in the kernels' order)


def start_index(a, b, c):
    """floor(a * c / b) (torch's START_IND)."""
    return (np.asarray(a, dtype=np.int64) * c) // b


def end_index(a, b, c):
    """ceil((a + 1) * c / b) (torch's END_IND)."""
    return ((np.asarray(a, dtype=np.int64) + 1) * c + b - 1) // b


@functools.lru_cache(maxsize=256)
def axis_table(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one axis of input length ``size`` pooled to ``out``: the window length of every output
    (``k``, (out,)), and for every input position the windows covering it in increasing order, padded:
    (``windows`` (size, m), ``valid`` (size, m)); m is the most windows covering one position."""
    o = np.arange(out)
    k = end_index(o, out, size) - start_index(o, out, size)
    i = np.arange(size)
    lo, hi = start_index(i, size, out), end_index(i, size, out)
    m = int((hi - lo).max())
    windows = lo[:, None] + np.arange(m)[None, :]
    valid = windows < hi[:, None]
    return k, np.minimum(windows, out - 1), valid


def shares(dy: np.ndarray, h: int, w: int) -> np.ndarray:
    """g(oh, ow) = (dy / kw) / kh in float32, per dy element (NCHW array)."""
    _, _, oh, ow = dy.shape
    kh = axis_table(h, oh)[0].astype(F32)
    kw = axis_table(w, ow)[0].astype(F32)
    return (dy.astype(F32) / kw[None, None, None, :]) / kh[None, None, :, None]


def contributions(dy: torch.Tensor, h: int, w: int) -> np.ndarray:
    """Every dx element's contributions in tree's order, -0.0 where a slot is empty:
    (N, C, H, W, mh * mw) float32, NCHW."""
    g = shares(dy.detach().cpu().contiguous().numpy(), h, w)
    _, rows, rvalid = axis_table(h, dy.shape[2])
    _, cols, cvalid = axis_table(w, dy.shape[3])
    vals = g[:, :, rows[:, :, None, None], cols[None, None, :, :]]  # (N, C, H, mh, W, mw)
    mask = rvalid[:, :, None, None] & cvalid[None, None, :, :]
    vals = np.where(mask, vals, NEG_ZERO).astype(F32)
    n, c = g.shape[:2]
    return vals.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h, w, -1)  # row-major (oh, ow) per element


def _cpu_prologue(dy, input_size):
    dy, (h, w), layout = _check(dy, input_size)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs a CPU tensor, got one on {dy.device}")
    return dy, h, w, layout


def dx_tensor(dx: np.ndarray, layout: str) -> torch.Tensor:
    """A CPU model's (N, C, H, W) result as a tensor in ``layout``."""
    return torch.from_numpy(np.ascontiguousarray(dx)).contiguous(memory_format=memory_format(layout))


def adaptive_avg_pool2d_bwd_tree_cpu(dy, *, input_size, rng=None) -> torch.Tensor:
    dy, h, w, layout = _cpu_prologue(dy, input_size)
    parts = contributions(dy, h, w)
    acc = np.zeros(parts.shape[:-1], dtype=F32)
    for k in range(parts.shape[-1]):  # +0.0, then each window in row-major order
        acc = acc + parts[..., k]
    return dx_tensor(acc, layout)


def adaptive_avg_pool2d_bwd_atomic_cpu(dy, *, input_size, rng=None) -> torch.Tensor:
    dy, h, w, layout = _cpu_prologue(dy, input_size)
    return dx_tensor(arrival_sum(contributions(dy, h, w), rng), layout)


# --------------------------------------------------------------------------------------------------
# Helpers for tests and benchmarks: float64 reference, per-element counts and error bound


def reference(dy: torch.Tensor, *, input_size) -> torch.Tensor:
    """Exact dx in float64 (NCHW): every element of a window receives dy / (kh * kw)."""
    h, w = size_pair(OP, input_size)
    g = dy.detach().cpu().double().contiguous().numpy()
    _, _, oh, ow = g.shape
    kh, rows, rvalid = axis_table(h, oh)
    kw, cols, cvalid = axis_table(w, ow)
    exact = g / (kh[:, None] * kw[None, :]).astype(np.float64)
    out = np.zeros(g.shape[:2] + (h, w))
    for j in range(rows.shape[1]):
        for i in range(cols.shape[1]):
            m = rvalid[:, j][:, None] & cvalid[:, i][None, :]
            out += np.where(m, exact[:, :, rows[:, j][:, None], cols[:, i][None, :]], 0.0)
    return torch.from_numpy(out)


def counts(h: int, w: int, oh: int, ow: int) -> np.ndarray:
    """(H, W): how many windows cover each element."""
    return axis_table(h, oh)[2].sum(1)[:, None] * axis_table(w, ow)[2].sum(1)[None, :]


def error_bound(dy: torch.Tensor, h: int, w: int) -> np.ndarray:
    """(N, C, H, W) bound on |float32 dx - exact|: each of an element's k contributions is rounded twice
    (two divisions) and then passes through at most k - 1 additions, so |error| <= gamma(k + 1) *
    sum |exact contribution| (Higham's gamma(m) = m u / (1 - m u), u = 2^-24)."""
    _, _, oh, ow = dy.shape
    k = counts(h, w, oh, ow).astype(np.float64)
    u = 2.0**-24
    gam = (k + 1) * u / (1 - (k + 1) * u)
    # Below 2^-126 a rounding is off by up to half the smallest subnormal, 2^-150, whatever the
    # magnitude: one such term per rounding (2 per contribution, 1 per addition).
    return (2 * k + 1) * 2.0**-150 + gam * reference(dy.abs(), input_size=(h, w)).numpy()


# --------------------------------------------------------------------------------------------------
# torch's own backward (the peers)


def _x_like(dy: torch.Tensor, h: int, w: int, requires_grad: bool = False) -> torch.Tensor:
    x = torch.empty((dy.shape[0], dy.shape[1], h, w), device=dy.device, dtype=dy.dtype,
                    memory_format=memory_format(suggest_layout(dy)))
    return x.zero_().requires_grad_(requires_grad)


def torch_backward(dy, *, input_size) -> torch.Tensor:
    """aten's ``_adaptive_avg_pool2d_backward`` (what autograd calls for a non-(1, 1) output); it reads
    only the shape and memory format of the forward input."""
    h, w = size_pair(OP, input_size)
    return torch.ops.aten._adaptive_avg_pool2d_backward(dy, _x_like(dy, h, w))


_GRAPHS: dict = {}


def torch_autograd_backward(dy, *, input_size) -> torch.Tensor:
    """The backward of ``F.adaptive_avg_pool2d`` through autograd, on a graph built once per shape,
    layout and deterministic mode (the forward is not timed): to (1, 1) that is ``mean``'s backward."""
    h, w = size_pair(OP, input_size)
    key = (tuple(dy.shape), suggest_layout(dy), dy.device, h, w, torch.are_deterministic_algorithms_enabled())
    graph = _GRAPHS.get(key)
    if graph is None:
        if len(_GRAPHS) >= 4:
            _GRAPHS.clear()
        x = _x_like(dy, h, w, requires_grad=True)
        with torch.enable_grad():
            graph = _GRAPHS[key] = (x, torch.nn.functional.adaptive_avg_pool2d(x, tuple(dy.shape[2:])))
    x, y = graph
    return torch.autograd.grad(y, x, dy, retain_graph=True)[0]


def _peers() -> dict:
    return {"torch": torch_backward, "torch_autograd": torch_autograd_backward}


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, reference, cases


# Values a gradient can hold that arithmetic treats specially: infinities, NaN, signed zeros, subnormals.
SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, -0.0, 1e-40, -3e-39, 0.0]


def make_dy(p: dict, seed: int, device: torch.device) -> torch.Tensor:
    """The upstream gradient (n, c, oh, ow) of a resampling case: random normal from ``seed``
    (``special``: with Inf, NaN, -0.0 and subnormals mixed in; ``noncontig``: a strided view of a larger
    tensor; ``layout``: channels_last or NCHW). Shared with upsample_bilinear2d_bwd."""
    g = torch.Generator().manual_seed(seed)
    if p.get("noncontig"):  # sliced on the device, so the strides survive the move
        big = torch.randn((p["n"], p["c"], 2 * p["oh"], p["ow"] + 3), generator=g).to(device)
        return big[:, :, ::2, 1:p["ow"] + 1]
    dy = torch.randn((p["n"], p["c"], p["oh"], p["ow"]), generator=g)
    if p.get("special"):
        flat = dy.view(-1)
        sel = torch.randperm(flat.numel(), generator=g)[:len(SPECIALS)]
        flat[sel] = torch.tensor(SPECIALS)
    if p.get("layout") == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    return dy.to(device)


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    return (make_dy(p, case.seed, device),), {"input_size": (p["h"], p["w"])}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    return reference(*args, **kwargs)


def _case(name, n, c, h, w, oh, ow, seed, layout="nchw", **extra) -> Case:
    params = {"n": n, "c": c, "h": h, "w": w, "oh": oh, "ow": ow, "layout": layout, **extra}
    contention = float(counts(h, w, oh, ow).mean())  # windows per element
    return Case(OP, name, params, seed=seed, contention=contention)


def _test_cases() -> list[Case]:
    rows = [
        # name, n, c, h, w, oh, ow, extra
        ("square_14to7", 2, 3, 14, 14, 7, 7, {}),
        ("nondiv_13to7", 2, 3, 13, 13, 7, 7, {}),
        ("nondiv_25x11to7x4", 2, 3, 25, 11, 7, 4, {}),
        ("head_7to1", 3, 4, 7, 7, 1, 1, {}),
        ("up_3to8", 2, 3, 3, 3, 8, 8, {}),              # OH > H: every element under several windows
        ("up_1to5x3", 2, 2, 1, 1, 5, 3, {}),            # 1x1 input
        ("in_1x9_to_1x4", 2, 3, 1, 9, 1, 4, {}),
        ("identity_6", 1, 3, 6, 6, 6, 6, {}),
        ("tiles_c40_13to7", 3, 40, 13, 13, 7, 7, {}),   # channels_last: a short last chunk of channels
        ("tiles_5to3", 5, 7, 5, 5, 3, 3, {}),           # a short last tile of images
        ("special_13to5", 2, 3, 13, 13, 5, 5, {"special": True}),
        # windows tiling the input exactly (the exact kernel): specials (-0.0 shares) on it, four channels
        # per thread in channels_last (C % 4 == 0), rectangular windows
        ("special_14to7", 2, 3, 14, 14, 7, 7, {"special": True}),
        ("exact_c8_28to7", 2, 8, 28, 28, 7, 7, {}),
        ("exact_c4_8x6to4x2", 3, 4, 8, 6, 4, 2, {}),
    ]
    cases, seed = [], 6000
    for name, n, c, h, w, oh, ow, extra in rows:
        for layout in ("nchw", "channels_last"):
            if extra.get("special") and layout == "channels_last":
                continue
            cases.append(_case(f"{name}_{layout}", n, c, h, w, oh, ow, seed, layout, **extra))
            seed += 1
    cases.append(_case("noncontig_13to7", 2, 3, 13, 13, 7, 7, seed, noncontig=True))
    return cases


def _bench_cases(scale: str) -> list[Case]:
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    n, c = (64, 512) if scale != "cpu" else (2, 16)
    rows = [
        ("vgg_14to7", 14, 7, ("nchw", "channels_last")),     # vgg11_bn's head on a 448 px input
        ("vgg_13to7", 13, 7, ("nchw",)),                      # non-divisible: overlapping windows
        ("vgg_25to7", 25, 7, ("nchw", "channels_last")),
        ("resnet_head_7to1", 7, 1, ("nchw", "channels_last")),
        ("up_4to28", 4, 28, ("nchw",)),                       # OH > H: 64 windows per element
    ]
    if scale == "quick":
        rows = [rows[0], rows[1], rows[3]]
    cases, seed = [], 900
    for name, size, out, layouts in rows:
        cc = 64 if name.startswith("up") and scale != "cpu" else c
        for layout in layouts:
            cases.append(_case(f"{name}_b{n}_{layout}", n, cc, size, size, out, out, seed, layout))
            seed += 1
    return cases


def _bytes_moved(case: Case) -> int:
    p = case.params
    return 4 * p["n"] * p["c"] * (p["oh"] * p["ow"] + p["h"] * p["w"])


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, adaptive_avg_pool2d_bwd_atomic_cuda, adaptive_avg_pool2d_bwd_atomic_cpu,
         "one thread per dy element; (dy / kw) / kh atomicAdd-ed into its window (as torch's CUDA backward; "
         "overlapping windows collide)"),
        ("tree", True, False, adaptive_avg_pool2d_bwd_tree_cuda, adaptive_avg_pool2d_bwd_tree_cpu,
         "each dx element summed by one thread: the windows covering it in (oh, ow) row-major order from "
         "+0.0 (torch's CPU order); shares computed once per dy element into shared memory, or straight "
         "from dy where the windows tile the input exactly"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
)
