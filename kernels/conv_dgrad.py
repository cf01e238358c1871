"""conv_dgrad: 2-D convolution data gradient (groups = 1). CUDA launchers for ``conv_dgrad.cu``
and their CPU order models.

    dx = conv_dgrad(w, dy, input_size=(H, W), stride=1, padding=0, dilation=1)

w: (Cout, Cin, KH, KW); dy: (N, Cout, OH, OW), NCHW or channels_last; dx: (N, Cin, H, W) in dy's layout.
The tree CUDA launcher also takes bf16/fp16 w and dy (dx in w's dtype), on tensor cores (kernels/conv_mma.py).
OH and OW must be the conv output sizes of (H, W). Each dx element sums the products of the taps
(co, kh, kw) whose window covers it; where windows overlap (kernel extent > stride) several dy
positions feed one dx element, and the order in which their contributions meet is what the variants
differ in:

- ``atomic``: every dy position's contributions are atomicAdd-ed into dx (the scatter of cuDNN's
  ALGO_0): the arrival order is the scheduler's.
- ``tree``: every dx element gathers its contributions in one thread, in a fixed order. Where a stride-1
  launch would have few blocks (deep layers at small batches, or 128-column tiles short of one wave) the
  launcher splits that order into at most ``SPLIT_MAX`` contiguous ranges, each one FMA chain written as a
  partial, and adds the partials in range order (``tree_split``: a function of the shape alone, so the bits
  are the same on every GPU).

A stride-1 forward conv is this op on flipped, transposed weights (``conv_forward_tree_cuda``, the
"forward form" below); the routing's ``fastest-deterministic`` offers it to its tuner for forward convs.

Both kernels multiply-add with FFMA (one rounding per product and sum), which NumPy/torch on the CPU do
not reproduce; so ``cpu_bitexact`` is False, and the CPU models follow each variant's reduction
structure in float32 instead: products summed over Cout by a float32 matmul, then the KH*KW taps of a
dx element added in a fixed order (``tree``: torch's col2im ``fold``) or in a random order (``atomic``).

Speed: reports/kernels.md (``pytest --benchmark-only`` on an H200) has every variant beside cuDNN on
every ResNet-18 shape; ``bench/dev/conv_dgrad_check.py`` adds bounds and run-to-run counts per shape.
Cin <= 4 with dilation 1 (network stems) runs its own kernel, tree_stem (see conv_dgrad.cu).

CPU models: 16 -> 16 channels, 3x3, 32x32, batch 64 costs about 44 ms of CPU time on one thread for
either model (torch's own float32 data gradient: 4 ms); the tap columns (a 9x larger intermediate than
dx) are the price of modelling the per-tap partial sums, and their bits do not depend on the thread count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .order import rng_of
from . import conv_mma
from .registry import Case, define_op, round_outputs
from .runtime import (
    INT32_MAX,
    SLOT,
    KernelArgumentError,
    Launch,
    cdiv,
    check_cuda,
    check_tensor,
    function,
    layout_of,
    memo_check,
)
from .shapes import HOSTILE_CONV, RESNET18_CONV, ConvGeometry, ConvShape, check_dgrad_output

OP = "conv_dgrad"
SOURCE = "conv_dgrad.cu"
BM, BN, THREADS = 128, 64, 256      # GEMM block tile (rows x columns) and threads; see conv_dgrad.cu
STEM_MAX_CIN = 4
STEM_SMEM_FLOATS = 11776            # dynamic shared memory cap (46 KiB: 48 KiB less the static part)
MAX_KERNEL = 32                     # taps per axis the CUDA kernels list in shared memory
ATOMIC_ORDERS = 32                  # CPU atomic model: runs of dx planes, one random tap order each


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


@dataclass(frozen=True)
class Geometry(ConvGeometry):
    """ConvGeometry and ``layout``, dy's (and dx's)."""

    layout: str

    @property
    def dx_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cin, self.h, self.w)

    @property
    def dx_stride(self) -> tuple[int, int, int, int]:
        c, h, w = self.cin, self.h, self.w
        return (h * w * c, 1, w * c, c) if self.layout == "channels_last" else (c * h * w, h * w, w, 1)


def _pair(arg: str, v, minimum: int) -> tuple[int, int]:
    vals = tuple(v) if isinstance(v, (tuple, list, torch.Size)) else (v,) * 2
    if len(vals) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in vals):
        raise KernelArgumentError(OP, arg, f"expected an int or a pair of ints, got {v!r}")
    if any(x < minimum for x in vals):
        raise KernelArgumentError(OP, arg, f"expected values >= {minimum}, got {v!r}")
    return int(vals[0]), int(vals[1])


_CHECKED: dict[tuple, Geometry] = {}


def _check(w, dy, input_size, stride, padding, dilation) -> Geometry:
    """Validate the arguments (once per configuration: ``runtime.memo_check``)."""
    return memo_check(_CHECKED, _check_all, w, dy, input_size, stride, padding, dilation)


def _check_all(w, dy, input_size, stride, padding, dilation) -> Geometry:
    w = check_tensor(OP, "w", w, ndim=4, half_ok=True)   # half: only the launchers that say so take it
    dy = check_tensor(OP, "dy", dy, ndim=4, device=w.device, half_ok=True)
    layout_of(OP, "w", w)  # w may be NCHW or channels_last; the launchers repack it
    layout = layout_of(OP, "dy", dy)
    params = tuple(_hashable(v) for v in (input_size, stride, padding, dilation))
    # the types are part of the key: 1, 1.0 and True compare equal, and only ints are accepted
    types = tuple(tuple(map(type, v)) if isinstance(v, tuple) else type(v) for v in params)
    try:
        return _geometry(tuple(w.shape), tuple(dy.shape), layout, *params, types)
    except TypeError:  # an unhashable argument: validate without the cache (raises the proper error)
        return _geometry.__wrapped__(tuple(w.shape), tuple(dy.shape), layout, *params, types)


def _hashable(v):
    return tuple(v) if isinstance(v, (list, tuple, torch.Size)) else v


@functools.lru_cache(maxsize=1024)
def _geometry(w_shape, dy_shape, layout, input_size, stride, padding, dilation, types) -> Geometry:
    """Size checks of one call; cached per argument set and types (errors are raised, never cached)."""
    h, wd = _pair("input_size", input_size, 1)
    sh, sw = _pair("stride", stride, 1)
    ph, pw = _pair("padding", padding, 0)
    dh, dw = _pair("dilation", dilation, 1)
    cout, cin, kh, kw = w_shape
    if kh < 1 or kw < 1:
        raise KernelArgumentError(OP, "w", f"expected a kernel of at least 1x1, got shape {w_shape}")
    n, oh, ow = check_dgrad_output(OP, dy_shape, cout, h, wd, kh, kw, sh, sw, ph, pw, dh, dw)
    if n * h * wd > INT32_MAX or n * oh * ow > INT32_MAX or cin * kh * kw > INT32_MAX:
        raise KernelArgumentError(OP, "dy", f"pixel counts must fit in int32, got batch {n} of {h}x{wd}")
    return Geometry(n=n, cin=cin, cout=cout, kh=kh, kw=kw, h=h, w=wd, oh=oh, ow=ow, sh=sh, sw=sw,
                    ph=ph, pw=pw, dh=dh, dw=dw, layout=layout)


def _empty_dx(g: Geometry, device, zero: bool) -> torch.Tensor:
    fmt = torch.channels_last if g.layout == "channels_last" else torch.contiguous_format
    dx = torch.empty(g.dx_shape, dtype=torch.float32, device=device, memory_format=fmt)
    return dx.zero_() if zero else dx


def _trivial(g: Geometry) -> bool:
    """Nothing to compute: dx is empty, or there are no output channels (dx = 0, as in torch)."""
    return g.n * g.cin * g.h * g.w == 0 or g.cout == 0


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _check_dtypes(w, dy, half_ok: bool) -> None:
    if not half_ok:
        check_tensor(OP, "w", w)   # float32
        check_tensor(OP, "dy", dy)


def _cuda_prologue(w, dy, input_size, stride, padding, dilation, *, half_ok: bool = False) -> Geometry:
    g = _check(w, dy, input_size, stride, padding, dilation)
    check_cuda(OP, "dy", dy)
    _check_dtypes(w, dy, half_ok)
    if g.kh > MAX_KERNEL or g.kw > MAX_KERNEL:
        raise KernelArgumentError(OP, "w", f"the CUDA kernels take kernels up to {MAX_KERNEL}x{MAX_KERNEL}, "
                                  f"got {g.kh}x{g.kw}")
    if g.sh * g.sw > 65535:
        raise KernelArgumentError(OP, "stride", f"the CUDA kernels take stride_h * stride_w <= 65535, got {(g.sh, g.sw)}")
    return g


class LaunchPlan(NamedTuple):
    """Everything about one launch that depends only on the geometry (cached): the kernel, its grid,
    block and dynamic shared memory, the scalar arguments after the three pointers, whether dx is
    zero-filled first, how w is repacked ('stem', 'tap_major' or 'channels_last'), and the GEMM
    kernels' split of the reduction (None: the stem kernel, which takes no split arguments)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int]
    shared: int
    scalars: tuple
    zero_fill: bool
    packing: str
    ksplit: int | None = None


def _geometry_args(g: Geometry, dy_stride: tuple[int, ...]) -> tuple:
    i32 = np.int32
    return (i32(g.n), i32(g.cin), i32(g.h), i32(g.w), i32(g.cout), i32(g.oh), i32(g.ow), i32(g.kh),
            i32(g.kw), i32(g.sh), i32(g.sw), i32(g.ph), i32(g.pw), i32(g.dh), i32(g.dw),
            *(np.int64(s) for s in dy_stride), *(np.int64(s) for s in g.dx_stride))


def phase_offsets(k: int, s: int, p: int, d: int) -> list[list[int]]:
    """Per stride phase r (dx index = r mod s), the dy offsets (r + p - kk*d) / s of the taps kk that
    reach it, kk ascending (the kernels' tap lists); empty where no tap does."""
    return [[(r + p - kk * d) // s for kk in range(k) if (r + p - kk * d) % s == 0] for r in range(s)]


STEM_TAPS = (2, 4, 7)       # tree_stem kernels: most taps of a phase along W each one takes
STEM_PIXELS = (4, 8)        # tree_stem kernels: dx pixels per lane group each one takes
STEM_WIDE_PIXELS = 8        # pixels per group where a phase row is at least STEM_WIDE_MIN pixels wide
STEM_WIDE_MIN = 32
STEM_MAX_TJ = 32            # lane groups along a phase row per block, at most
STEM_BLOCK = 256            # threads per block, about
STEM_SPLIT = 4              # lanes per pixel group, splitting Cout (DG_STEM_SPLIT in conv_dgrad.cu)


def _stem_load(g: Geometry, dy_stride: tuple[int, ...], pixels: int) -> str:
    """How tree_stem loads dy (see conv_dgrad.cu): 'cl' (float4 over four output channels), 'rows'
    (aligned float4 chunks of NCHW rows) or 'scalar'. The caller also checks dy's address (16 bytes)."""
    if g.layout == "channels_last" and g.cout % 4 == 0 and dy_stride[1] == 1 and \
            all(dy_stride[d] % 4 == 0 for d in (0, 2, 3)):
        return "cl"
    if g.layout == "nchw" and pixels % 4 == 0 and g.ow % 4 == 0 and dy_stride[3] == 1 and \
            all(s % 4 == 0 for s in dy_stride[:3]):
        return "rows"
    return "scalar"


def stem_pixels(g: Geometry) -> int:
    """Pixels per lane group of tree_stem: 8 on phase rows of STEM_WIDE_MIN pixels or more (11 dy values
    loaded per tap row and output channel feed 8 pixels' products, where 4 pixels take 7), else 4 (more
    groups for narrow images). Never changes a bit: a dx element's FMA chain is the same either way."""
    return STEM_WIDE_PIXELS if -(-g.w // g.sw) >= STEM_WIDE_MIN else 4


def _stem_plan(g: Geometry, dy_stride: tuple[int, ...], pixels: int | None = None,
               channels: int | None = None) -> tuple | None:
    """(kernel, grid, block, shared bytes, extra scalars) of tree_stem, or None when it does not apply
    (dilation, more than 7 taps of a phase along W: the GEMM runs). ``pixels``: per lane group (one of
    STEM_PIXELS; default ``stem_pixels``); ``channels``: dx channels a lane computes (3 or 4, at least
    Cin; default the fewest). Neither changes a bit of dx."""
    if g.dh != 1 or g.dw != 1:
        return None
    offs_h = phase_offsets(g.kh, g.sh, g.ph, g.dh)
    offs_w = phase_offsets(g.kw, g.sw, g.pw, g.dw)
    taps = max(len(o) for o in offs_h) * max(len(o) for o in offs_w)
    t = next((t for t in STEM_TAPS if t >= max(len(o) for o in offs_w)), None)
    if t is None:
        return None
    px = stem_pixels(g) if pixels is None else pixels
    if px not in STEM_PIXELS:
        raise ValueError(f"{OP}: tree_stem takes {STEM_PIXELS} pixels per lane group, not {px}")
    hq, wq = cdiv(g.h, g.sh), cdiv(g.w, g.sw)  # pixels per image of the largest phase (0, 0)
    tj = min(STEM_MAX_TJ, cdiv(wq, px))          # groups along a row: the row's width where it fits
    ti = max(1, min(STEM_BLOCK // (tj * STEM_SPLIT), hq))
    cw = min(cdiv(g.cout, 4) * 4, STEM_SMEM_FLOATS // (4 * max(taps, 1)) // 4 * 4)
    tiles_i, tiles_j = cdiv(hq, ti), cdiv(wq, tj * px)
    grid = (g.n * tiles_i * tiles_j, 1, g.sh * g.sw)
    nc = (3 if g.cin <= 3 else 4) if channels is None else channels
    if nc not in (3, 4) or nc < g.cin:
        raise ValueError(f"{OP}: tree_stem computes 3 or 4 (>= Cin = {g.cin}) channels per lane, not {nc}")
    kernel = f"conv_dgrad_tree_stem_p{px}_t{t}_c{nc}_{_stem_load(g, dy_stride, px)}"
    extra = tuple(np.int32(v) for v in (tj, ti, tiles_i, tiles_j, cw))
    return kernel, grid, (ti * tj * STEM_SPLIT,), 16 * max(taps, 1) * cw, extra


# Who zeroes the phases no tap reaches (3 of 4 for a 1x1 stride-2 conv): "memset" before the launch (their
# blocks return at once, skip_empty = 1), "kernel" (their blocks store the zeros, skip_empty = 0), or
# "auto": the kernel on channels_last with Cin % 4 == 0 (float4 stores over channels), else the memset.
# Same bits every way. H200, batch 128, GPU us per call (bench/dev/conv_dgrad_zero_fill.py), 1x1
# stride 2, memset / kernel: channels_last 64->128 47.1 / 45.3, 128->256 61.6 / 56.0, 256->512 66.3 /
# 62.8 (atomic: 54.5, 54.3, 86.0); NCHW, where the zeros are every other element of a row, 46.5 / 55.1
# on 64->128.
EMPTY_ZEROS = "auto"


# Split K of the tree GEMM: a stride-1 shape whose launch has fewer blocks than SPLIT_TARGET splits each
# element's reduction into ksplit = min(SPLIT_TARGET // blocks, SPLIT_MAX, slices // SPLIT_MIN_SLICES)
# ranges (partials, then a fixed-order sum). SPLIT_TARGET is two resident blocks on each of 132 SMs (H100,
# H200): a constant, not read from the device, so a shape's bits are the same on every GPU.
SPLIT_TARGET = 264
SPLIT_MAX = 8
SPLIT_MIN_SLICES = 16   # (tap, 8 output channels) slices per range, at least


# Waves: a stride-1 launch of 128-column tiles (Cin >= 128: the value of WIDE_MIN_CIN, fixed here so that the
# split, and so the bits, never move with that setting) with SPLIT_TARGET narrow blocks or more but fewer than
# SPLIT_TARGET 128-column blocks (less than one wave of two blocks on every SM) is split into the fewest ranges
# whose blocks fill whole waves to SPLIT_WAVE_FILL. Narrower launches keep the rule above. H100, fp32, us per
# call unsplit / split (bench/dev/conv_tree_gemm.py --split-waves off,on, NCHW; blocks of 128x128):
# torchvision resnet18 at 224 px, batch 128: 3x3 512->512 7x7 (196 blocks, split 4) 1074.1 / 855.5
# (channels_last 1132.4 / 898.7); resnet50, batch 64: 3x3 256->256 14x14 (196, 4) 539.5 / 451.1, 1x1
# 256->1024 14x14 (196, 4) 242.4 / 227.9. Launches of one to two waves measured no better or worse split:
# 3x3 256->256 14x14 at batch 128 (392 blocks, split 2) 824.5 / 847.2, resnet50's 3x3 128->128 28x28 (392,
# 2) 424.2 / 456.0 and 1x1 2048->512 7x7 (400, 3) 252.2 / 278.7.
SPLIT_WAVES = True
SPLIT_WAVES_MAX = 1   # waves: launches of more keep one range
SPLIT_WAVE_FILL = 0.9


def tree_split(g: Geometry, blocks: int, waves: bool | None = None) -> int:
    """How many ranges the tree GEMM splits each dx element's reduction into (1: no split); ``blocks``: the
    narrow grid's blocks, ``waves``: the waves rule (default SPLIT_WAVES)."""
    if g.sh != 1 or g.sw != 1:
        return 1
    slices = g.kh * g.kw * cdiv(g.cout, 8)
    if blocks < SPLIT_TARGET:
        return max(1, min(SPLIT_TARGET // blocks, SPLIT_MAX, slices // SPLIT_MIN_SLICES))
    if not (SPLIT_WAVES if waves is None else waves) or g.cin < 128:
        return 1
    wide = blocks // cdiv(g.cin, BN) * cdiv(g.cin, 2 * BN)   # the launch's 128-column blocks
    if wide >= SPLIT_WAVES_MAX * SPLIT_TARGET:
        return 1
    for s in range(1, SPLIT_MAX + 1):
        if s > 1 and slices // s < SPLIT_MIN_SLICES:
            break
        if wide * s >= SPLIT_WAVE_FILL * cdiv(wide * s, SPLIT_TARGET) * SPLIT_TARGET:
            return s
    return 1


# The tree GEMM's wide tiles (128 x 128, kernels conv_dgrad_tree_*_wide[1]) for Cin >= WIDE_MIN_CIN: each
# thread holds 8 x 8 accumulators instead of 8 x 4, so a shared-memory load feeds twice the FMAs. Every
# dx element is the same FMA chain in either width and the split is reckoned on the narrow grid, so the
# width never changes a bit. Halving the blocks costs where there are few: the wide tile is taken where
# the blocks that have taps fill the SMs once (WAVE_SMS) or each split range is a long chain
# (WIDE_MIN_SLICES slices of 8 output channels, counting every tap: an upper bound at stride 2); at most
# WAVE_SMS blocks with taps run the one-block-per-SM register budget (_wide1), more the two-block budget
# (_wide; on channels_last it spills 88 bytes and still gains). Measured on an H100
# (bench/dev/conv_tree_gemm.py, fp32, ResNet-50 224 px batch 64 and ResNet-18 CIFAR batch 128 shapes):
# two-block wide tiles cut 1x1 256->64 56x56 from 338 to 266 us (NCHW) and from 370 to 295 us
# (channels_last), the one-block budget 3x3 512->512 7x7 channels_last from 723 (two-block, spilling) to
# 579 us (narrow 715); 1x1 stride-2 256->512 at 8x8, batch 128 (32 wide blocks with taps, 64-slice
# chains) stays narrow: 56 us against 76 wide (two-block).
WIDE_MIN_CIN = 128
WAVE_SMS = 132            # SMs of an H100 / H200: a constant, so a plan is the same on every GPU
WIDE_MIN_SLICES = 128
# Deep stages (kernels conv_dgrad_tree_*_deep): the 128 x 64 tile's unsplit launches load 16 output
# channels per stage instead of 8, so a block waits at half as many barriers and has twice the FMAs
# between a stage's loads and their use. The same chains, so the same bits, signed zeros included, for any
# Cout (conv_dgrad.cu, dgrad_gemm_body's BK; tests/test_conv_dgrad.py). Split launches keep stages of 8
# (their ranges are counted in them, tree_split), and so does a Cout of an odd number of 8-channel stages,
# which stages of 16 would pad with 8 more zero channels per tap (the forward form of a 3-channel stem:
# 75.2 us in stages of 8, 108.9 in stages of 16, H100 at d131b0f, an earlier form of these kernels).
# H200, fp32, GPU us per call at f69bf1f (bench/dev/conv_tree_gemm.py --deep on,off), stages of 8 / 16,
# torchvision resnet18 at 224 px, batch 128: 3x3 64->64 56x56 1027.0 / 938.3 (NCHW), 1106.5 / 1019.3
# (channels_last), 3x3 s2 64->128 600.4 / 533.4, every dgrad shape 16235 / 15806 us (NCHW), 17018 / 16607
# (channels_last), the same bits in every call; shapes on other tiles unchanged. False: stages of 8 everywhere.
DEEP_SLICES = True
# Deep stages on the wide tile too (kernels conv_dgrad_tree_*_wide_deep, two-block register budget): unsplit
# launches of the two-block wide kernels where Cout fills stages of 16 as of 8. The same chains, the same bits.
# H100, fp32, us per call, stages of 8 / 16 (bench/dev/conv_tree_gemm.py --wide-deep off,on), torchvision
# resnet18 at 224 px, batch 128: 3x3 128->128 28x28 813.2 / 790.9 (NCHW), 866.0 / 805.0 (channels_last, where
# the stages of 8 spill 88 bytes and those of 16 none; on NCHW the stages of 16 spill 32); 3x3 256->256 14x14
# 822.6 / 801.6, 910.3 / 848.9.
WIDE_DEEP = True
# 128-thread blocks on the 128 x 64 tile (kernels conv_dgrad_tree_nchw_t128[_deep]): NCHW launches that keep the
# narrow tile and have at least T128_MIN_BLOCKS blocks with taps run it on 128 threads, each an 8 x 8 register
# tile (as the wide tile's) instead of 256 threads of 8 x 4, so a shared-memory load feeds twice the FMAs. The same
# chains, so the same bits. H200, fp32, us per call, 256 / 128 threads (bench/dev/conv_tree_gemm.py --t128 off,on):
# torchvision resnet18 224 px batch 128: 3x3 64->64 56x56 946.7 / 888.4, 3x3 s2 64->128 56x56 535.8 / 497.0, 1x1 s2
# 64->128 56x56 (784 blocks) 122.7 / 114.6; ResNet-18 CIFAR batch 128: 3x3 64->64 32x32 320.6 / 303.5. Smaller
# launches lost: 1x1 s2 64->128 32x32 (256 blocks) 37.0 / 43.6, 1x1 s2 256->512 14x14 (196) 83.0 / 111.5.
T128 = True
T128_MIN_BLOCKS = 4 * WAVE_SMS


def tree_plan(g: Geometry, dy_stride: tuple[int, ...]) -> LaunchPlan:
    if EMPTY_ZEROS not in ("auto", "memset", "kernel"):
        raise ValueError(f"{OP}: EMPTY_ZEROS must be 'auto', 'memset' or 'kernel', got {EMPTY_ZEROS!r}")
    return _tree_plan(g, dy_stride, EMPTY_ZEROS, (WIDE_MIN_CIN, WAVE_SMS, WIDE_MIN_SLICES), DEEP_SLICES, SPLIT_WAVES,
                      WIDE_DEEP, T128_MIN_BLOCKS if T128 else None)


@functools.lru_cache(maxsize=1024)
def _tree_plan(g: Geometry, dy_stride: tuple[int, ...], empty_zeros: str, wide_rule: tuple[int, int, int],
               deep: bool = False, waves: bool = False, wide_deep: bool = False,
               t128: int | None = None) -> LaunchPlan:
    rows_taps, cols_taps = phase_offsets(g.kh, g.sh, g.ph, g.dh), phase_offsets(g.kw, g.sw, g.pw, g.dw)
    empty = not all(rows_taps) or not all(cols_taps)
    phases = sum(map(bool, rows_taps)) * sum(map(bool, cols_taps))   # the phases that have taps
    head = (*_geometry_args(g, dy_stride), np.int32(empty))
    stem = stem_launch_plan(g, dy_stride) if g.cin <= STEM_MAX_CIN else None
    if stem is not None:
        return stem
    rows = g.n * cdiv(g.h, g.sh) * cdiv(g.w, g.sw)  # pixels of the largest phase (0, 0)
    kernel = "conv_dgrad_tree_cl" if g.layout == "channels_last" else "conv_dgrad_tree_nchw"
    if empty_zeros == "auto":
        empty_zeros = "kernel" if g.layout == "channels_last" and g.cin % 4 == 0 else "memset"
    fill = empty and empty_zeros == "memset"
    grid = (cdiv(rows, BM), cdiv(g.cin, BN), g.sh * g.sw)
    # never with phases no tap reaches: their zeros go to dx, which the split's sum would overwrite
    # (tree_split splits stride 1 only, where every phase has taps)
    ksplit = tree_split(g, grid[0] * grid[1] * grid[2], waves) if not empty else 1
    wide_min_cin, wave_sms, wide_min_slices = wide_rule
    widened = False
    if g.cin >= wide_min_cin:
        wide = (grid[0], cdiv(g.cin, 2 * BN), grid[2])
        working = wide[0] * wide[1] * ksplit * phases   # their blocks
        if working >= wave_sms or g.kh * g.kw * cdiv(g.cout, 8) // ksplit >= wide_min_slices:
            kernel += "_wide" if working > wave_sms else "_wide1"
            grid, widened = wide, True
    threads = THREADS
    if t128 is not None and not widened and g.layout != "channels_last" and grid[0] * grid[1] * ksplit * phases >= t128:
        kernel += "_t128"   # see T128
        threads = 128
    if deep and ksplit == 1 and cdiv(g.cout, 8) % 2 == 0 and (not widened or (wide_deep and kernel.endswith("_wide"))):
        kernel += "_deep"   # see DEEP_SLICES and WIDE_DEEP
    return LaunchPlan(kernel, (grid[0], grid[1] * ksplit, grid[2]), (threads,), 0,
                      (*head[:-1], np.int32(fill), np.int32(ksplit)), fill, "tap_major", ksplit)


def stem_launch_plan(g: Geometry, dy_stride: tuple[int, ...], pixels: int | None = None,
                     channels: int | None = None) -> LaunchPlan | None:
    """tree_stem's launch for Cin <= STEM_MAX_CIN (``_stem_plan``'s choices, or the given ones), None where
    it does not apply."""
    stem = _stem_plan(g, dy_stride, pixels, channels)
    if stem is None:
        return None
    rows_taps, cols_taps = phase_offsets(g.kh, g.sh, g.ph, g.dh), phase_offsets(g.kw, g.sw, g.pw, g.dw)
    empty = not all(rows_taps) or not all(cols_taps)
    kernel, grid, block, shared, extra = stem
    return LaunchPlan(kernel, grid, block, shared, (*_geometry_args(g, dy_stride), np.int32(empty), *extra), empty,
                      "stem")


@functools.lru_cache(maxsize=1024)
def atomic_plan(g: Geometry, dy_stride: tuple[int, ...]) -> LaunchPlan:
    blocks = cdiv(g.n * g.oh * g.ow, BM) * cdiv(g.kh * g.kw * g.cin, BN)  # 1-D, column tile fastest
    if blocks > INT32_MAX:
        raise KernelArgumentError(OP, "dy", f"{blocks} blocks exceed the launch grid")
    kernel = "conv_dgrad_atomic_cl" if g.layout == "channels_last" else "conv_dgrad_atomic_nchw"
    # the scatter accumulates into zeros
    return LaunchPlan(kernel, (blocks, 1, 1), (THREADS,), 0,
                      (*_geometry_args(g, dy_stride), np.int32(0), np.int32(1)), True, "channels_last", 1)


def _pack_weights(w: torch.Tensor, g: Geometry, packing: str) -> torch.Tensor:
    if packing == "stem":  # [kh][kw][co][ci padded to 4]: one float4 per (tap, co) holds every channel
        return F.pad(w.permute(2, 3, 0, 1), (0, 4 - g.cin)).contiguous()
    if packing == "tap_major":  # [kh][kw][co][ci]: the GEMM B rows of one tap are contiguous
        return w.permute(2, 3, 0, 1).contiguous()
    return w.permute(0, 2, 3, 1).contiguous()  # [co][kh][kw][ci]: B = (Cout, KH*KW*Cin), row-major


def _prepare(plan_of, w, dy, input_size, stride, padding, dilation) -> Callable:
    """``run(w, dy) -> dx`` (float32) for calls with the signature (dtypes, device, shapes, strides) of these
    w and dy and these arguments: validated, planned and its launches configured here, once; a call
    allocates, packs the weights and launches. The module's switches are read here."""
    g = _cuda_prologue(w, dy, input_size, stride, padding, dilation)
    dev = dy.device
    if _trivial(g):
        return lambda w, dy: _empty_dx(g, dev, zero=True)
    plan = plan_of(g, tuple(dy.stride()))
    # the GEMM kernels take the partials' buffer last (null without a split); the stem kernels do not
    tail = (SLOT,) if plan.ksplit is not None else ()
    null_tail = (0,) * len(tail)

    def kernel(name: str) -> Launch:
        return Launch.of(function(SOURCE, name, dev), plan.grid, plan.block, (SLOT, SLOT, SLOT, *plan.scalars, *tail),
                         device=dev, shared_mem=plan.shared)
    main = kernel(plan.kernel)
    # the stem's vector loads need a 16-byte aligned dy: its scalar twin takes any other address
    unaligned = main if plan.packing != "stem" or plan.kernel.endswith("_scalar") else \
        kernel(plan.kernel.rsplit("_", 1)[0] + "_scalar")
    n = g.n * g.cin * g.h * g.w
    split = plan.ksplit is not None and plan.ksplit > 1
    dx_sum = Launch.of(function(SOURCE, "conv_dgrad_split_sum", dev), (min(cdiv(n, 256), 4096), 1, 1), (256,),
                       (SLOT, SLOT, np.int64(n), np.int32(plan.ksplit)), device=dev) if split else None

    def run(w, dy):
        dx = _empty_dx(g, dev, zero=plan.zero_fill)
        wmat = _pack_weights(w, g, plan.packing)
        k = unaligned if dy.data_ptr() % 16 else main
        if split:
            part = torch.empty(plan.ksplit * n, dtype=torch.float32, device=dev)
            k(dy.data_ptr(), wmat.data_ptr(), dx.data_ptr(), part.data_ptr())
            dx_sum(part.data_ptr(), dx.data_ptr())
        else:
            k(dy.data_ptr(), wmat.data_ptr(), dx.data_ptr(), *null_tail)
        return dx
    return run


def _run(plan_of, w, dy, input_size, stride, padding, dilation) -> torch.Tensor:
    return _prepare(plan_of, w, dy, input_size, stride, padding, dilation)(w, dy)


def prepare_tree(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> Callable:
    """``run(w, dy) -> dx`` of the tree variant for calls with the signature of these w and dy and these
    arguments, decided once (the routing prepares once per call signature; see ``_prepare``). A half call
    that the tensor-core kernels do not take runs the float32 launcher on widened copies, prepared per call."""
    if w.dtype == torch.float32 and dy.dtype == torch.float32:
        return _prepare(tree_plan, w, dy, input_size, stride, padding, dilation)
    # bf16 / fp16: the tensor-core kernel (conv_mma.py) where it takes the shape, else float32 copies
    # through the float32 kernel, rounded once as the registry's widening call rounds (dx as w)
    g = _cuda_prologue(w, dy, input_size, stride, padding, dilation, half_ok=True)
    if not _trivial(g) and conv_mma.eligible(dy.dtype, g.cin, g.cout, w, dy):
        return conv_mma.prepare_dgrad(w, dy, g)
    return lambda w, dy: round_outputs(OP, _run(tree_plan, w.float(), dy.float(), input_size, stride, padding,
                                                dilation), (w, dy))


def conv_dgrad_tree_cuda(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    return prepare_tree(w, dy, input_size=input_size, stride=stride, padding=padding, dilation=dilation)(w, dy)


def prepare_atomic(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> Callable:
    """``run(w, dy) -> dx`` of the atomic variant (float32), decided once as ``prepare_tree``'s."""
    return _prepare(atomic_plan, w, dy, input_size, stride, padding, dilation)


def conv_dgrad_atomic_cuda(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    return _run(atomic_plan, w, dy, input_size, stride, padding, dilation)


conv_dgrad_tree_cuda.prepare = prepare_tree
conv_dgrad_atomic_cuda.prepare = prepare_atomic


# --------------------------------------------------------------------------------------------------
# A stride-1 forward conv as a data gradient: y = conv2d(x, w, padding=p) (dilation 1, groups 1) is the
# data gradient of the conv whose weights are w with Cin and Cout swapped and both spatial axes flipped,
# w'[ci, co, r, s] = w[co, ci, KH-1-r, KW-1-s], at padding KH-1-p (the taps that read x at offset r - p
# are the taps that a dy pixel at the same place scatters to). So the tree kernel computes it, with its
# fixed order (float32 GEMM: each y element's FMA chain over (kh, kw, ci), kh and kw descending, cut into
# ranges by the split for deep layers; its stem kernel where Cout <= 4; bf16/fp16 on tensor cores). The routing's
# fastest-deterministic family offers it to its tuner beside torch's own forward conv.


def forward_args(x: torch.Tensor, w: torch.Tensor, padding) -> dict:
    """The data-gradient arguments that compute ``conv2d(x, w, padding=padding)`` (stride 1, dilation 1):
    ``input_size`` is y's size, the padding KH-1-p per axis (a padding above KH-1 has no such form)."""
    check_tensor(OP, "x", x, ndim=4, half_ok=True)
    check_tensor(OP, "w", w, ndim=4, device=x.device, half_ok=True)
    kh, kw = int(w.shape[-2]), int(w.shape[-1])
    ph, pw = _pair("padding", padding, 0)
    if ph > kh - 1 or pw > kw - 1:
        raise KernelArgumentError(OP, "padding", f"the forward form takes padding <= kernel size - 1, got {(ph, pw)} "
                                  f"for a {kh}x{kw} kernel")
    return dict(input_size=(int(x.shape[-2]) + 2 * ph - kh + 1, int(x.shape[-1]) + 2 * pw - kw + 1),
                padding=(kh - 1 - ph, kw - 1 - pw))


def forward_weights(w: torch.Tensor) -> torch.Tensor:
    """w' of the forward form: (Cin, Cout, KH, KW), w's spatial axes flipped, contiguous."""
    return w.flip(-2, -1).transpose(0, 1).contiguous()


def conv_forward_tree_cuda(x, w, *, padding=0) -> torch.Tensor:
    """``conv2d(x, w, padding=padding)``, stride 1, by the tree data-gradient launcher on w' (y in x's
    layout; bf16/fp16 on tensor cores where conv_mma takes the shape, as the data gradient does)."""
    return conv_dgrad_tree_cuda(forward_weights(w), x, **forward_args(x, w, padding))


def conv_forward_tree_cpu(x, w, *, padding=0, rng=None) -> torch.Tensor:
    """The CPU order model of :func:`conv_forward_tree_cuda`: the tree data gradient's model on w'."""
    return conv_dgrad_tree_cpu(forward_weights(w), x, **forward_args(x, w, padding))


# --------------------------------------------------------------------------------------------------
# CPU order models


def _cpu_prologue(w, dy, input_size, stride, padding, dilation) -> Geometry:
    g = _check(w, dy, input_size, stride, padding, dilation)
    _check_dtypes(w, dy, half_ok=False)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs CPU tensors, got one on {dy.device}")
    return g


def tap_columns(w: torch.Tensor, dy: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Every tap's contribution, (N, Cin*KH*KW, OH*OW) in float32: column (ci, kh, kw) at dy position
    (oh, ow) is sum_co w[co, ci, kh, kw] * dy[n, co, oh, ow], one float32 matmul (sums over Cout)."""
    wm = w.detach().reshape(g.cout, g.cin * g.kh * g.kw).t()
    return torch.matmul(wm, dy.detach().contiguous().reshape(g.n, g.cout, g.oh * g.ow))


def _in_layout(dx: torch.Tensor, g: Geometry) -> torch.Tensor:
    return dx.contiguous(memory_format=torch.channels_last) if g.layout == "channels_last" else dx.contiguous()


def conv_dgrad_tree_cpu(w, dy, *, input_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    """Fixed order: per dx element, +0.0 plus the taps' column sums in (kh, kw) order (col2im's order:
    the same bits as ``F.fold`` of :func:`tap_columns`, one strided add per tap over every plane)."""
    g = _cpu_prologue(w, dy, input_size, stride, padding, dilation)
    if _trivial(g):
        return _empty_dx(g, "cpu", zero=True)
    planes = g.n * g.cin
    c = tap_columns(w, dy, g).reshape(planes, g.kh, g.kw, g.oh, g.ow)
    dx = torch.zeros((planes, g.h, g.w), dtype=torch.float32)
    for move in _tap_moves(g):
        if move is not None:
            (hs, ws), (kh, kw, os_, ows) = move
            dx[:, hs, ws] += c[:, kh, kw, os_, ows]
    return _in_layout(dx.reshape(g.dx_shape), g)


def _span(k: int, size: int, out: int, s: int, p: int, d: int) -> tuple[int, int, int]:
    """dy rows o whose tap k lands inside dx (0 <= o*s - p + k*d < size): o in [lo, hi), first row h0."""
    lo = max(0, cdiv(p - k * d, s))
    hi = min(out, (size - 1 + p - k * d) // s + 1)
    return lo, hi, lo * s - p + k * d


def _tap_moves(g: Geometry) -> list:
    """Per tap (kh, kw) in row-major order: ((dx rows, dx cols), (kh, kw, dy rows, dy cols)) as slices,
    None where the tap reaches no dx element."""
    moves = []
    for kh in range(g.kh):
        hlo, hhi, h0 = _span(kh, g.h, g.oh, g.sh, g.ph, g.dh)
        for kw in range(g.kw):
            wlo, whi, w0 = _span(kw, g.w, g.ow, g.sw, g.pw, g.dw)
            if hhi <= hlo or whi <= wlo:
                moves.append(None)
                continue
            moves.append(((slice(h0, h0 + (hhi - hlo - 1) * g.sh + 1, g.sh),
                           slice(w0, w0 + (whi - wlo - 1) * g.sw + 1, g.sw)),
                          (kh, kw, slice(hlo, hhi), slice(wlo, whi))))
    return moves


def conv_dgrad_atomic_cpu(w, dy, *, input_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    """Arrival order: the (n, ci) planes of dx are split into ATOMIC_ORDERS contiguous runs, and each
    run adds its taps' contributions into +0.0 in its own random permutation of the KH*KW taps, drawn
    from ``rng``. Taps that do not reach an element leave it alone, so only overlapping windows (kernel
    extent > stride) see the order."""
    g = _cpu_prologue(w, dy, input_size, stride, padding, dilation)
    if _trivial(g):
        return _empty_dx(g, "cpu", zero=True)
    taps, planes = g.kh * g.kw, g.n * g.cin
    c = tap_columns(w, dy, g).reshape(planes, g.kh, g.kw, g.oh, g.ow)
    moves = _tap_moves(g)
    runs = min(ATOMIC_ORDERS, planes)
    orders = np.argsort(rng_of(rng).random((runs, taps)), axis=1)
    bounds = [planes * r // runs for r in range(runs + 1)]
    dx = torch.zeros((planes, g.h, g.w), dtype=torch.float32)
    for r, order in enumerate(orders):
        lo, hi = bounds[r], bounds[r + 1]
        for t in order:
            if moves[t] is not None:
                (hs, ws), (kh, kw, os_, ows) = moves[t]
                dx[lo:hi, hs, ws] += c[lo:hi, kh, kw, os_, ows]
    return _in_layout(dx.reshape(g.dx_shape), g)


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, float64 reference, cases, peers


def conv_kwargs(case: Case) -> dict:
    p = case.params
    return {"input_size": (p["h"], p["w"]), "stride": p["stride"], "padding": p["pad"], "dilation": p["dilation"]}


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    s = ConvShape(case.name, p["n"], p["cin"], p["cout"], p["k"], p["stride"], p["pad"], p["h"], p["w"],
                  p["dilation"])
    gen = torch.Generator().manual_seed(case.seed)
    w = torch.randn(s.w_shape, generator=gen) / float(np.sqrt(s.cin * s.k * s.k))
    dy = torch.randn(s.y_shape, generator=gen)
    if p.get("layout", "nchw") == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    return (w.to(device), dy.to(device)), conv_kwargs(case)


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    w, dy = (a.detach().to("cpu", torch.float64) for a in args)
    h, wd = kwargs["input_size"]
    return torch.nn.grad.conv2d_input((dy.shape[0], w.shape[1], h, wd), w, dy, kwargs.get("stride", 1),
                                      kwargs.get("padding", 0), kwargs.get("dilation", 1))


def taps_per_element(k: int, stride: int, dilation: int) -> int:
    """Most taps along one axis that can land on one dx element: ceil(k / (s / gcd(s, d)))."""
    step = stride // np.gcd(stride, dilation)
    return cdiv(k, step)


def _case(s: ConvShape, layout: str, seed: int) -> Case:
    params = {"n": s.n, "cin": s.cin, "cout": s.cout, "k": s.k, "stride": s.stride, "pad": s.pad,
              "h": s.h, "w": s.w, "dilation": s.dilation, "layout": layout}
    name = s.name if layout == "nchw" else f"{s.name}_cl"
    return Case(OP, f"{name}_b{s.n}", params, seed=seed,
                contention=float(taps_per_element(s.k, s.stride, s.dilation) ** 2))


def _test_cases() -> list[Case]:
    cases = [_case(s, "nchw", 100 + i) for i, s in enumerate(HOSTILE_CONV)]
    cases += [_case(s, "channels_last", 200 + i) for i, s in enumerate(HOSTILE_CONV)]
    cases += [_case(s.with_batch(1), "nchw", 300 + i) for i, s in enumerate(RESNET18_CONV)]
    return cases


def _bench_cases(scale: str) -> list[Case]:
    if scale == "cpu":
        return [_case(s.with_batch(4), "nchw", 400 + i) for i, s in enumerate(RESNET18_CONV)]
    layouts = ("nchw", "channels_last") if scale == "gpu" else ("nchw",)
    return [_case(s, lay, 500 + i) for lay in layouts for i, s in enumerate(RESNET18_CONV)]


def torch_dgrad(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """aten convolution_backward with only the input gradient asked for (the caller sets cudnn flags)."""
    size = (dy.shape[0], w.shape[1], *input_size)
    return torch.nn.grad.conv2d_input(size, w, dy, stride, padding, dilation)


def _peers() -> dict:
    return {"torch": torch_dgrad}


def _shape_of(case: Case) -> ConvShape:
    p = case.params
    return ConvShape(case.name, p["n"], p["cin"], p["cout"], p["k"], p["stride"], p["pad"], p["h"], p["w"],
                     p["dilation"])


def _bytes_moved(case: Case) -> int:
    s = _shape_of(case)
    numel = lambda shape: int(np.prod(shape))  # noqa: E731
    return 4 * (numel(s.w_shape) + numel(s.y_shape) + numel(s.x_shape))


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, conv_dgrad_atomic_cuda, conv_dgrad_atomic_cpu,
         "scatter (cuDNN ALGO_0 style): tiled SGEMM dy^T.w per dy position, taps atomicAdd-ed "
         "into dx; overlapping windows arrive in any order; FFMA, so not CPU bit-exact"),
        ("tree", True, False, conv_dgrad_tree_cuda, conv_dgrad_tree_cpu,
         "gather: implicit GEMM per stride phase, each dx element one FMA chain in (kh, kw, co) "
         "order (split into fixed ranges summed in order for stride-1 shapes of few blocks), written "
         "once; FFMA, so not CPU bit-exact"),
    ],
    cpu_bitexact=False,
    half_native=("tree",),  # bf16 / fp16 on tensor cores (conv_mma.py)
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
    flops=lambda case: _shape_of(case).flops,
)
