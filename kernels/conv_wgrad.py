"""conv_wgrad: 2-D convolution weight gradient. CUDA launchers for ``conv_wgrad.cu`` and CPU order models.

    conv_wgrad(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> dw
    x (N, Cin, H, W), dy (N, Cout, OH, OW) float32, NCHW or channels_last; dw (Cout, Cin, KH, KW) contiguous.
    The atomic and tree CUDA launchers also take bf16/fp16 x and dy (dw in their dtype): tensor cores, the
    reduction split by :func:`half_plan` (longer chunks), the same combine order (kernels/conv_mma.py).

Implicit GEMM dw[m, r] = sum_k dy[m, k] * col[r, k], m = co, r = (ci, kh, kw), k = (n, oh, ow). The
reduction axis K = N*OH*OW is cut into S contiguous chunks of Kc by :func:`plan`, a function of the
shapes only (never of the device), so every float32 variant, the CPU models and every GPU split the
reduction the same way (half inputs on tensor cores: :func:`half_plan`, also of the shapes only). Each
chunk's partial tile is computed in float32 (FFMA on the GPU, a float32 BLAS matmul on the CPU); the
variants differ in how the S partials of an element are combined:

    atomic   atomicAdd in arrival order                      (model: random order per element)
    tree     workspace + fixed order: 8 strided groups, each sequential, then the 8 group sums in order
             (in the GEMM launch by each tile's last block, or by a second kernel: see FUSE)
    nosplit  S = 1, no combine at all

The GPU's FFMA rounding inside a chunk cannot be reproduced by a CPU BLAS, so no variant is CPU/GPU
bit-exact; the models keep the reduction structure (chunking and combine order) and the GPU kernels are
tested bitwise against themselves and within a derived bound against float64.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import conv_mma
from .order import F32, arrival_sum, pad_to, seq_sum
from .registry import Case, define_op
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
    ticket_counters,
)
from .shapes import HOSTILE_CONV, RESNET18_CONV, ConvGeometry, ConvShape, conv_out

OP = "conv_wgrad"
SOURCE = "conv_wgrad.cu"
THREADS = 256
BK = 16            # K-step of the GEMM kernels; chunk lengths are multiples of it
GROUPS = 8         # strided groups of the tree combine (conv_wgrad_reduce)
# Split-K aims at about TARGET_BLOCKS blocks (several waves, so that the last one is short) with chunks of
# at least CHUNK terms (shorter chunks spend too much on prologue and epilogue), but always allows
# MIN_SPLITS chunks of at least MIN_CHUNK terms, which helps short reductions (K = 2048 at 4x4).
# Constants, never the device's SM count. From H200 timings (bench/dev/conv_wgrad_check.py, ResNet-18
# shapes at batch 128): 256-term chunks took 391 us against 332 us for 576-term ones on 128->128 3x3
# 16x16 (atomic), while TARGET_BLOCKS 1024, 2048 or 4096 moved times by a few percent at most once
# CHUNK was 512.
TARGET_BLOCKS = 2048
CHUNK = 512
MIN_CHUNK = 256
MIN_SPLITS = 8
# Where 128x128 tiles would leave fewer than MIN_BLOCKS blocks (the 1x1 stride-2 shapes: 128->256 at
# 16x16 ran as 2 tiles x 16 splits = 32 blocks), the plan takes 64x64 tiles and enough splits of at
# least MIN_CHUNK terms to reach MIN_BLOCKS. H200, batch 128, channels_last, us per call (GPU time, L2
# flushed; bench/dev/conv_wgrad_plan_sweep.py), atomic / tree with the separate combine: 128->256 1x1
# s2: 100.9 / 96.4 as 2 tiles x 16 splits, 43.8 / 41.1 as 8 tiles x 32; 256->512 1x1 s2 8x8: 57.8 /
# 58.5 as 8 x 8, 41.4 / 41.9 as 32 x 8.
MIN_BLOCKS = 256
# Waves. Where the plan above gives at most WAVE_PLAN_MAX blocks (few waves, so the last one's tail
# counts), the split is redone to fill whole waves of WAVE_BLOCKS blocks (2 per SM on 132 SMs, a
# constant): one wave up to ONE_WAVE_TILES output tiles, two above (a third of a wave per split step is
# too coarse there). Fewer, longer chunks also leave fewer partials to combine. H200, fp32, NCHW, tree,
# us per call before / after (bench/dev/conv_split_waves.py, ResNet-18 CIFAR shapes): batch 64:
# 128->128 3x3 16x16 213.1 / 156.2, 256->256 3x3 8x8 214.5 / 162.0, 512->512 3x3 4x4 213.8 / 205.5,
# 64->128 1x1 s2 37.3 / 17.5, 256->512 3x3 s2 129.0 / 115.8; batch 128: 64->128 3x3 s2 262.8 / 171.9,
# 128->256 3x3 s2 224.5 / 162.0, 256->256 3x3 8x8 354.6 / 309.6. Plans with more blocks (64->64 3x3
# 32x32: 1152 and 2052 blocks, 512->512 3x3 4x4 at batch 128: 1152) measured faster as they are. The
# tensor-core wgrad (conv_mma.py) has a rule of its own (half_plan, below).
WAVE_BLOCKS = 264
WAVE_PLAN_MAX = 4 * WAVE_BLOCKS
ONE_WAVE_TILES = 48
WAVE_MIN_CHUNK = 128   # the 64->128 1x1 s2 time above is with chunks of 128 terms
# Where the GEMM keeps its per-row load constants: "s" shared memory (channels_last inputs get their
# own load mapping), "r" registers (the first version; kept for comparison in the dev script). On the
# H200 "s" was 5-15% faster than "r" on NCHW inputs and 25-40% faster for atomic on channels_last, with
# the same bits.
KERNEL_STYLE = "s"
# How tree runs its fixed-order combine (same bits every way): "fused" in the GEMM launch (the last
# block of each output tile combines it), "separate" (a second kernel), or "auto": fused when there
# are at least FUSE_MIN_TILES tiles and at most FUSE_MAX_SPLITS splits. The last block of a tile
# reads S*tile^2 floats alone, so the fused combine pays only where many tiles overlap their combines
# with other tiles' GEMMs. H200, batch 128, us per call fused / separate (bench/dev/conv_wgrad_check.py):
# 512->512 3x3 4x4 (144 tiles, S 8) 357.6 / 374.6 NCHW, 372.6 / 384.6 channels_last; 256->512 3x3 s2
# 8x8 (72 tiles, S 8) 233.9 / 209.9; 256->256 3x3 8x8 (36 tiles, S 16) 411.5 / 360.3; the stems and
# the 64-splits shapes (1-9 tiles) 1.5-3.7x slower fused.
FUSE = "auto"
FUSE_MIN_TILES = 128
FUSE_MAX_SPLITS = 8
# Tap tiles (conv_wgrad.cu, TAPK): where Cin is a multiple of the tile width, every tile of the r' column
# order holds one tap, and walks only the k whose pixel for that tap is not padding. Same bits as the
# full walk on finite inputs (tests/test_conv_wgrad.py compares them); every KERNEL_STYLE but "r" ("s"
# becomes "ts", channels_last's "cl" "tc"). Float32 only: the tensor-core path (conv_mma) has no tap tiles.
TAP_TILES = True
# Wide tiles (conv_wgrad.cu): a plan of 64x64 tiles for M <= 64 output channels and R > 128 columns runs on
# 64-row tiles (more FFMAs per shared-memory load), without tap tiles, the fused combine or a change of plan:
# the same chunks, the same bits. WIDE "auto": 64x192 ("t64w", two blocks an SM) where one such tile spans R,
# 64x128 ("t64m", three blocks an SM) where R > 192; "t64w" or "t64m" forces one, "" keeps 64x64 tiles.
# H200, us per call, 64x64 / 64x192 / 64x128, tree, NCHW (bench/dev/conv_wgrad_kernels.py): 7x7 s2 3->64 224x224
# (R 147) batch 128 1759 / 1654 / 1809; 3x3 64->64 56x56 (R 576) batch 128 1247 / 1273 / 1150, batch 64
# 636 / 655 / 593; 1x1 256->64 56x56 (R 256) batch 64 329 / 417 / 255; 3x3 64->64 32x32 batch 128 415 / 438 /
# 402. channels_last alike.
WIDE = "auto"
WIDE_COLUMNS = {"t64w": 192, "t64m": 128}   # each wide kernel's tile columns
# cp.async stages of the square-tile GEMM kernels whose row constants are in shared memory (every KERNEL_STYLE but
# "r"; the wide tiles keep registers): 0 keeps two stages, the next K-step's loads held in registers during the
# FFMAs. Same bits either way. H100, batch 128, NCHW, tree, us per call with 0 / 3 / 4 stages
# (bench/dev/conv_wgrad_kernels.py --stages 0,3,4 --shapes all): 128x128 tiles: 3x3 128->128 28x28 890.9 / 840.5
# / 842.7, 3x3 256->256 14x14 871.5 / 842.6 / 863.9, 3x3 512->512 7x7 845.3 / 823.9 / 816.0, 3x3 s2 256->512
# 494.0 / 462.3 / 461.1; 64x64: 1x1 s2 64->128 56x56 104.8 / 83.5 / 84.2; the wide tiles lost 10-14% (64->64
# 3x3 56x56, 64x128 tiles: 1116.5 / 1277.1 / 1253.9).
STAGES = 3


# --------------------------------------------------------------------------------------------------
# Arguments and the split plan


@dataclass(frozen=True)
class Geometry(ConvGeometry):
    @property
    def m(self) -> int:
        return self.cout

    @property
    def r(self) -> int:
        return self.cin * self.kh * self.kw

    @property
    def k(self) -> int:
        return self.n * self.oh * self.ow

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.cout, self.cin, self.kh, self.kw)


@dataclass(frozen=True)
class Plan:
    tile: int   # 128 (128x128 tiles, 8x8 per thread) or 64 (64x64, 4x4 per thread); half_plan: the larger
                # side of conv_mma.wgrad_tile's tile, bookkeeping only (the tensor-core kernels pick their own)
    splits: int  # S: chunks of the reduction, = partials combined per output element
    chunk: int  # Kc: reduction length per chunk (a multiple of BK); the last chunk may be shorter


def plan(m: int, r: int, k: int, *, split: bool = True, waves: bool = True) -> Plan:
    """Tile size and split of the reduction for an (M x R, reduction K) weight gradient. Depends only on
    the shapes: the same inputs are cut the same way on every GPU and on the CPU. ``waves``: refit a
    plan of few blocks to whole waves (above; the float32 kernels)."""
    return _plan(m, r, k, split, TARGET_BLOCKS, CHUNK, MIN_CHUNK, MIN_SPLITS, MIN_BLOCKS, waves)


@functools.lru_cache(maxsize=1024)
def _plan(m, r, k, split, target_blocks, chunk_len, min_chunk, min_splits, min_blocks, waves=False) -> Plan:
    tile = 128 if m >= 128 and r >= 128 else 64
    if not split:
        return Plan(tile, 1, max(BK, cdiv(k, BK) * BK))
    tiles = cdiv(m, tile) * cdiv(r, tile)
    splits, chunk = split_for(tiles, k, target_blocks, chunk_len, min_chunk, min_splits)
    if tile == 128 and tiles * splits < min_blocks:  # too few blocks: 64x64 tiles, chunks down to min_chunk
        tile, tiles = 64, cdiv(m, 64) * cdiv(r, 64)
        splits, chunk = split_for(tiles, k, target_blocks, chunk_len, min_chunk,
                                  max(min_splits, cdiv(min_blocks, tiles)))
    if waves and tiles * splits <= WAVE_PLAN_MAX:
        fit = min((1 if tiles <= ONE_WAVE_TILES else 2) * WAVE_BLOCKS // tiles, max(1, k // WAVE_MIN_CHUNK))
        if fit >= 1:
            chunk = cdiv(cdiv(k, fit), BK) * BK
            splits = cdiv(k, chunk)
    return Plan(tile, splits, chunk)


# The tensor-core kernels' split (conv_mma.py). A block there runs a K-step of 64 terms in a few hundred
# cycles, against thousands for the FFMA kernels, so the float32 rule above (up to 2048 blocks, chunks from
# 256 terms) cut their reductions into so many chunks that storing and combining the partials took longer
# than the products: 224 chunks of 896 terms for ResNet-50's 3x3 64->64 at 56x56, batch 64, a 33.0 MB
# workspace for a 73 KB weight gradient. Here: about HALF_TARGET_BLOCKS blocks of the kernel's own tiles
# (conv_mma.wgrad_tile), chunks of at least HALF_MIN_CHUNK terms. Constants, not the device's SM count:
# the chunks, and so the bits, stay a function of the shapes. bench/dev/conv_mma_split_sweep.py (H100, bf16,
# channels_last, every ResNet-50 shape at batch 64, count-weighted): 3663 us in all against 4560 with the
# float32 rule (cuDNN's fastest: 2003); 264 blocks gave the same total, 512- and 4096-term chunks 3998 and 4959.
HALF_TARGET_BLOCKS = 528
HALF_MIN_CHUNK = 1024
HALF_STEP = 64       # chunks are whole K-steps of either engine (conv_mma: WG_BK 64, BK 32)


def half_plan(m: int, r: int, k: int) -> Plan:
    """The split of an (M x R, reduction K) weight gradient on tensor cores (above); ``tile`` is the
    plan's bookkeeping only (the kernels pick their tiles by conv_mma.wgrad_tile, which never changes
    the bits)."""
    return _half_plan(m, r, k, HALF_TARGET_BLOCKS, HALF_MIN_CHUNK)


@functools.lru_cache(maxsize=1024)
def _half_plan(m: int, r: int, k: int, target_blocks: int, min_chunk: int) -> Plan:
    bm, bn = conv_mma.wgrad_tile(m, r)
    tiles = cdiv(m, bm) * cdiv(r, bn)
    s = max(1, min(cdiv(target_blocks, tiles), k // min_chunk))
    chunk = max(HALF_STEP, cdiv(cdiv(k, s), HALF_STEP) * HALF_STEP)
    return Plan(max(bm, bn), max(1, cdiv(k, chunk)), chunk)


def split_for(tiles: int, k: int, target_blocks: int = TARGET_BLOCKS, chunk_len: int = CHUNK,
              min_chunk: int = MIN_CHUNK, min_splits: int = MIN_SPLITS, max_splits: int | None = None) -> tuple[int, int]:
    """(S, Kc): the split of a length-k reduction shared by ``tiles`` output tiles (the rule above)."""
    s = max(1, min(cdiv(target_blocks, tiles), max(k // chunk_len, min(min_splits, k // min_chunk))))
    if max_splits is not None:
        s = min(s, max_splits)
    chunk = cdiv(cdiv(k, s), BK) * BK
    return cdiv(k, chunk), chunk


def _pair(arg: str, v, minimum: int) -> tuple[int, int]:
    vals = (v, v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
    if not isinstance(vals, (tuple, list)) or len(vals) != 2 or \
            not all(isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in vals):
        raise KernelArgumentError(OP, arg, f"expected an int or a pair of ints, got {v!r}")
    if any(int(e) < minimum for e in vals):
        raise KernelArgumentError(OP, arg, f"expected values >= {minimum}, got {v!r}")
    return int(vals[0]), int(vals[1])


_CHECKED: dict[tuple, "Geometry"] = {}


def _check(x, dy, kernel_size, stride, padding, dilation) -> Geometry:
    """Validate the arguments (once per configuration: ``runtime.memo_check``)."""
    return memo_check(_CHECKED, _check_all, x, dy, kernel_size, stride, padding, dilation)


def _check_all(x, dy, kernel_size, stride, padding, dilation) -> Geometry:
    x = check_tensor(OP, "x", x, ndim=4, half_ok=True)   # half: only the launchers that say so take it
    dy = check_tensor(OP, "dy", dy, ndim=4, half_ok=True)
    if dy.device != x.device:
        raise KernelArgumentError(OP, "dy", f"expected a tensor on {x.device} (like x), got one on {dy.device}")
    kh, kw = _pair("kernel_size", kernel_size, 1)
    sh, sw = _pair("stride", stride, 1)
    ph, pw = _pair("padding", padding, 0)
    dh, dw = _pair("dilation", dilation, 1)
    layout_of(OP, "x", x)
    layout_of(OP, "dy", dy)
    n, cin, h, w = x.shape
    oh, ow = conv_out(h, kh, sh, ph, dh), conv_out(w, kw, sw, pw, dw)
    if oh < 1 or ow < 1:
        raise KernelArgumentError(
            OP, "kernel_size", f"a {kh}x{kw} kernel (dilation {dh}x{dw}, padding {ph}x{pw}) does not fit "
            f"the {h}x{w} input: the output would be {oh}x{ow}")
    if dy.shape[0] != n or dy.shape[2] != oh or dy.shape[3] != ow:
        raise KernelArgumentError(
            OP, "dy", f"expected shape ({n}, Cout, {oh}, {ow}) for x of shape {tuple(x.shape)} and these conv "
            f"parameters, got {tuple(dy.shape)}")
    cout = dy.shape[1]
    for arg, count in (("x", x.numel()), ("dy", dy.numel()), ("kernel_size", cout * cin * kh * kw)):
        if count > INT32_MAX:  # the kernels index with 32-bit offsets
            raise KernelArgumentError(OP, arg, f"{count} elements exceeds the supported 2^31 - 1")
    return Geometry(n, cin, h, w, cout, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw)


def _empty(g: Geometry) -> bool:
    return g.n == 0 or g.cin == 0 or g.cout == 0


# --------------------------------------------------------------------------------------------------
# CUDA launchers


@functools.lru_cache(maxsize=512)
def _int_args(g: Geometry, sx: tuple, sd: tuple, p: Plan) -> tuple:
    """The GEMM's 24 int arguments (cached: converting them costs more host time than a small launch)."""
    return tuple(np.int32(v) for v in (g.cin, g.h, g.w, g.cout, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph,
                                       g.pw, g.dh, g.dw, *sx, *sd, g.k, p.chunk))


def wide_tile(g: Geometry, p: Plan, name: str) -> tuple[str, int] | None:
    """The wide kernel (suffix, tile columns) that runs a plan of 64x64 tiles where M <= 64 (see WIDE), or
    None. Kernel choice only: the plan, and so the bits, stay those of the 64x64 tiles."""
    if not WIDE or name == "fused" or p.tile != 64 or g.m > 64 or g.r <= 128 or KERNEL_STYLE != "s":
        return None
    choice = WIDE if WIDE != "auto" else "t64w" if g.r <= 192 else "t64m"
    return choice, WIDE_COLUMNS[choice]


def _gemm(name: str, x: torch.Tensor, dy: torch.Tensor, g: Geometry, p: Plan, extra: int = 0) -> tuple[Launch, str]:
    """One GEMM kernel's launch for the signature of (x, dy), called with the pointers of x, dy, its output
    and ``extra`` more; and the style it runs ("cl", "tc", "ts": a split workspace is in r' order)."""
    ints = _int_args(g, x.stride(), dy.stride(), p)
    tile, columns = f"t{p.tile}", p.tile
    wide = wide_tile(g, p, name)
    if wide is not None:
        tile, columns = wide
    grid = (cdiv(g.r, columns), cdiv(g.m, p.tile), p.splits)
    style = KERNEL_STYLE
    if style == "s" and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
            and dy.is_contiguous(memory_format=torch.channels_last) and not dy.is_contiguous():
        style = "cl"  # same bits, loads along channels
    if style != "r" and TAP_TILES and wide is None and g.cin % p.tile == 0:
        style = "tc" if style == "cl" else "ts"  # same bits, padding terms skipped
    if STAGES and style != "r" and wide is None:   # (dynamic shared memory: the stages)
        smem = STAGES * BK * (p.tile + 4 + columns + 4) * 4
        defines = () if STAGES == 3 else (f"-DWG_STAGES={STAGES}",)   # (3: the source's default)
        fn = function(SOURCE, f"conv_wgrad_{name}_{tile}_{style}_a", x.device, defines, smem=smem)
    else:
        smem = 0
        fn = function(SOURCE, f"conv_wgrad_{name}_{tile}_{style}", x.device)
    return Launch.of(fn, grid, (THREADS,), (SLOT,) * (3 + extra) + ints, device=x.device, shared_mem=smem), style


R_PRIME_STYLES = ("cl", "tc", "ts")   # kernel styles whose tile columns run in r' = (kh, kw, ci) order


def fused(g: Geometry, p: Plan) -> bool:
    """Whether tree combines in the GEMM launch (see FUSE); the bits are the same either way."""
    if p.splits == 1:
        return False
    if FUSE in ("fused", "separate"):
        return FUSE == "fused"
    if FUSE != "auto":
        raise ValueError(f"{OP}: FUSE must be 'auto', 'fused' or 'separate', got {FUSE!r}")
    return cdiv(g.m, p.tile) * cdiv(g.r, p.tile) >= FUSE_MIN_TILES and p.splits <= FUSE_MAX_SPLITS


def _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, *, half_ok: bool = False) -> Geometry:
    g = _check(x, dy, kernel_size, stride, padding, dilation)
    check_cuda(OP, "x", x)
    _check_dtypes(x, dy, half_ok)
    return g


def _check_dtypes(x, dy, half_ok: bool) -> None:
    if not half_ok:
        check_tensor(OP, "x", x)   # float32
    if dy.dtype != x.dtype:
        raise KernelArgumentError(OP, "dy", f"expected dtype {x.dtype} (as x), got {dy.dtype}")


def _prepare_half(x, dy, g: Geometry, kw: dict, *, atomic: bool) -> Callable:
    """A bf16 / fp16 call of tree or atomic: the tensor-core kernels (conv_mma.py) where they take the
    shape, else float32 copies through the float32 launcher, rounded once (the registry's widening call)."""
    if _empty(g):
        return lambda x, dy: torch.zeros(g.w_shape, device=x.device, dtype=x.dtype)
    if conv_mma.eligible(x.dtype, g.cin, g.cout, x, dy, pad_cin=True):
        return conv_mma.prepare_wgrad(x, dy, g, half_plan, atomic=atomic)
    launcher = conv_wgrad_atomic_cuda if atomic else conv_wgrad_tree_cuda
    return lambda x, dy: launcher(x.float(), dy.float(), **kw).to(x.dtype)


def _geometry_kw(kernel_size, stride, padding, dilation) -> dict:
    return dict(kernel_size=kernel_size, stride=stride, padding=padding, dilation=dilation)


def prepare_atomic(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> Callable:
    """``run(x, dy) -> dw`` of the atomic variant for calls with the signature (dtypes, device, shapes,
    strides) of these x and dy and these arguments: validated and planned once (see ``prepare_tree``)."""
    g = _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, half_ok=True)
    if x.dtype != torch.float32:
        return _prepare_half(x, dy, g, _geometry_kw(kernel_size, stride, padding, dilation), atomic=True)
    dev = x.device
    gemm = None if _empty(g) else _gemm("atomic", x, dy, g, plan(g.m, g.r, g.k))[0]

    def run(x, dy):
        dw = torch.zeros(g.w_shape, device=dev, dtype=torch.float32)
        if gemm is not None:
            gemm(x.data_ptr(), dy.data_ptr(), dw.data_ptr())
        return dw
    return run


def conv_wgrad_atomic_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    return prepare_atomic(x, dy, **_geometry_kw(kernel_size, stride, padding, dilation))(x, dy)


def _prepare_split(x, dy, g: Geometry, p: Plan) -> Callable:
    """``run(x, dy) -> dw``: the split GEMM and its fixed-order combine (in the GEMM launch where ``fused``)."""
    dev = x.device
    if p.splits == 1:  # one chunk: the GEMM stores the final values itself
        gemm = _gemm("split", x, dy, g, p)[0]

        def run(x, dy):
            dw = torch.empty(g.w_shape, device=dev, dtype=torch.float32)
            gemm(x.data_ptr(), dy.data_ptr(), dw.data_ptr())
            return dw
        return run
    if fused(g, p):  # workspace [tile][S][tile^2]; each tile's last block writes dw
        tiles = cdiv(g.m, p.tile) * cdiv(g.r, p.tile)
        ws_numel = tiles * p.splits * p.tile * p.tile
        gemm = _gemm("fused", x, dy, g, p, extra=2)[0]

        def run(x, dy):
            dw = torch.empty(g.w_shape, device=dev, dtype=torch.float32)
            ws = torch.empty(ws_numel, device=dev, dtype=torch.float32)
            counters = ticket_counters(dev, tiles)   # held until the launch is queued (a capture's own)
            gemm(x.data_ptr(), dy.data_ptr(), dw.data_ptr(), ws.data_ptr(), counters.data_ptr())
            return dw
        return run
    mr = g.m * g.r
    gemm, style = _gemm("split", x, dy, g, p)
    args = (SLOT, np.int32(p.splits), np.int32(mr), SLOT)
    r_prime = style in R_PRIME_STYLES
    if r_prime:  # the workspace is in the GEMM's column order r' = (kh, kw, ci)
        args += (np.int32(g.r), np.int32(g.cin), np.int32(g.kh * g.kw))
    combine = Launch.of(function(SOURCE, "conv_wgrad_reduce_cl" if r_prime else "conv_wgrad_reduce", dev),
                        (cdiv(mr, 32),), (32 * GROUPS,), args, device=dev)

    def run(x, dy):
        dw = torch.empty(g.w_shape, device=dev, dtype=torch.float32)
        partials = torch.empty((p.splits, mr), device=dev, dtype=torch.float32)
        gemm(x.data_ptr(), dy.data_ptr(), partials.data_ptr())
        combine(partials.data_ptr(), dw.data_ptr())
        return dw
    return run


def _split_and_combine(x, dy, g: Geometry, p: Plan) -> torch.Tensor:
    return _prepare_split(x, dy, g, p)(x, dy)


def prepare_tree(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> Callable:
    """``run(x, dy) -> dw`` of the tree variant for calls with the signature (dtypes, device, shapes, strides)
    of these x and dy and these arguments: validated, planned and its launches configured here, once, so a
    call only allocates and launches (the routing prepares once per call signature). The module's settings
    (KERNEL_STYLE, TAP_TILES, WIDE, STAGES, FUSE, the split plan's and conv_mma's) are read here. A half call that the
    tensor-core kernels do not take runs the float32 launcher on widened copies, prepared per call."""
    g = _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, half_ok=True)
    if x.dtype != torch.float32:
        return _prepare_half(x, dy, g, _geometry_kw(kernel_size, stride, padding, dilation), atomic=False)
    if _empty(g):
        return lambda x, dy: torch.zeros(g.w_shape, device=x.device, dtype=torch.float32)
    return _prepare_split(x, dy, g, plan(g.m, g.r, g.k))


def conv_wgrad_tree_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    return prepare_tree(x, dy, **_geometry_kw(kernel_size, stride, padding, dilation))(x, dy)


def conv_wgrad_nosplit_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    g = _cuda_prologue(x, dy, kernel_size, stride, padding, dilation)
    if _empty(g):
        return torch.zeros(g.w_shape, device=x.device, dtype=torch.float32)
    return _split_and_combine(x, dy, g, plan(g.m, g.r, g.k, split=False))


conv_wgrad_tree_cuda.prepare = prepare_tree
conv_wgrad_atomic_cuda.prepare = prepare_atomic


def tap_walk(g: Geometry, tap: int, kbeg: int, kend: int) -> np.ndarray:
    """The k a tap tile of ``tap`` (= kh*KW + kw) walks in the chunk [kbeg, kend), in walk order: the
    kernel's compaction (wgrad_tile, TAPK: the valid rectangle, ``before``, the position-to-k map) line
    for line, for tests on machines without a GPU. The loads' address arithmetic is not mirrored here;
    the GPU tests compare the tap kernels' bits with the full walk's."""
    th = tap // g.kw
    tih, tiw = th * g.dh - g.ph, (tap - th * g.kw) * g.dw - g.pw
    ohlo = 0 if tih >= 0 else (g.sh - 1 - tih) // g.sh
    owlo = 0 if tiw >= 0 else (g.sw - 1 - tiw) // g.sw
    ohhi = 0 if g.h - 1 - tih < 0 else min(g.oh, (g.h - 1 - tih) // g.sh + 1)
    owhi = 0 if g.w - 1 - tiw < 0 else min(g.ow, (g.w - 1 - tiw) // g.sw + 1)
    hv, wvalid = max(0, ohhi - ohlo), max(0, owhi - owlo)
    ohw = g.oh * g.ow

    def before(k: int) -> int:
        n, l = divmod(k, ohw)
        oh, ow = divmod(l, g.ow)
        rows = min(max(oh - ohlo, 0), hv)
        cols = min(max(ow - owlo, 0), wvalid) if ohlo <= oh < ohlo + hv else 0
        return n * hv * wvalid + rows * wvalid + cols

    wv, nv = max(wvalid, 1), max(hv * wvalid, 1)
    j = np.arange(before(kbeg), before(kend))
    n, l = np.divmod(j, nv)
    oh, ow = np.divmod(l, wv)
    return n * ohw + (oh + ohlo) * g.ow + ow + owlo


# --------------------------------------------------------------------------------------------------
# CPU order models


def im2col(x: torch.Tensor, g: Geometry) -> torch.Tensor:
    """col[k, r'] as a (K, R) float32 tensor, k = (n, oh, ow), r' = (kh, kw, ci): a strided window view
    of the padded channels-last x, copied once (F.unfold is several times slower on the CPU). r' is a
    permutation of dw's r = (ci, kh, kw); :func:`chunk_partials` puts r back in order."""
    xp = x.new_zeros((g.n, g.h + 2 * g.ph, g.w + 2 * g.pw, g.cin), dtype=torch.float32)
    xp[:, g.ph:g.ph + g.h, g.pw:g.pw + g.w] = x.detach().permute(0, 2, 3, 1)   # padded in one copy
    sn, sh, sw, _ = xp.stride()
    win = xp.as_strided((g.n, g.oh, g.ow, g.kh, g.kw, g.cin),
                        (sn, sh * g.sh, sw * g.sw, sh * g.dh, sw * g.dw, 1))
    return win.reshape(g.k, g.r)


def chunk_partials(x: torch.Tensor, dy: torch.Tensor, g: Geometry, p: Plan, *, gemm_order: bool = False) -> np.ndarray:
    """The S chunk partials, shape (S, M*R), each a float32 matmul over its (at most Kc) reduction terms:
    one batched float32 BLAS call for the full chunks, one matmul for a shorter last chunk (the kernel
    reads its missing terms as +0.0, which adds nothing). Columns in dw's order (m, ci, kh, kw), or with
    ``gemm_order`` in the GEMM's (m, kh, kw, ci): a combine that adds each column alone can run first and
    :func:`weight_order` move the one combined row instead of S."""
    a = dy.detach().permute(0, 2, 3, 1).reshape(g.k, g.m)   # [k, m]
    b = im2col(x, g)                                        # [k, r']
    full = g.k // p.chunk
    out = torch.empty((p.splits, g.m, g.r), dtype=torch.float32)
    if full:
        n = full * p.chunk
        torch.bmm(a[:n].reshape(full, p.chunk, g.m).transpose(1, 2), b[:n].reshape(full, p.chunk, g.r),
                  out=out[:full])
    if full < p.splits:
        torch.mm(a[full * p.chunk:].T, b[full * p.chunk:], out=out[full])
    out = out.reshape(p.splits, g.m * g.r).numpy()
    return out if gemm_order else weight_order(out, g)


def weight_order(cols: np.ndarray, g: Geometry) -> np.ndarray:
    """Rows of (m, kh, kw, ci) columns, (..., M*R), as (..., M*R) in dw's order (m, ci, kh, kw)."""
    lead = cols.shape[:-1]
    out = cols.reshape(*lead, g.m, g.kh, g.kw, g.cin)
    return np.ascontiguousarray(np.moveaxis(out, -1, -3)).reshape(*lead, g.m * g.r)


def tree_combine(partials: np.ndarray) -> np.ndarray:
    """``conv_wgrad_reduce``: group j adds partials j, j + 8, ... in order; then the 8 group sums in order."""
    s = partials.shape[0]
    if s == 1:  # the GEMM stored its single partial plus +0.0 (a -0.0 sum stored as +0.0, as a combine would)
        return np.asarray(partials[0], dtype=F32) + F32(0)
    grouped = pad_to(np.asarray(partials, dtype=F32), 0, GROUPS).reshape(-1, GROUPS, partials.shape[1])
    return seq_sum(seq_sum(grouped, 0), 0)


def _cpu_prologue(x, dy, kernel_size, stride, padding, dilation) -> Geometry:
    g = _check(x, dy, kernel_size, stride, padding, dilation)
    if x.device.type != "cpu":
        raise KernelArgumentError(OP, "x", f"the CPU model needs CPU tensors, got one on {x.device}")
    _check_dtypes(x, dy, half_ok=False)
    return g


def conv_wgrad_atomic_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    g = _cpu_prologue(x, dy, kernel_size, stride, padding, dilation)
    if _empty(g):
        return torch.zeros(g.w_shape)
    partials = chunk_partials(x, dy, g, plan(g.m, g.r, g.k))
    return torch.from_numpy(arrival_sum(partials.T, rng).reshape(g.w_shape))


def conv_wgrad_tree_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    g = _cpu_prologue(x, dy, kernel_size, stride, padding, dilation)
    if _empty(g):
        return torch.zeros(g.w_shape)
    partials = chunk_partials(x, dy, g, plan(g.m, g.r, g.k), gemm_order=True)
    return torch.from_numpy(weight_order(tree_combine(partials), g).reshape(g.w_shape))


def conv_wgrad_nosplit_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    g = _cpu_prologue(x, dy, kernel_size, stride, padding, dilation)
    if _empty(g):
        return torch.zeros(g.w_shape)
    partials = chunk_partials(x, dy, g, plan(g.m, g.r, g.k, split=False), gemm_order=True)
    return torch.from_numpy(weight_order(tree_combine(partials), g).reshape(g.w_shape))


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, float64 reference, cases, peers


def _shape_of(case: Case) -> ConvShape:
    p = case.params
    return ConvShape(case.name, p["n"], p["cin"], p["cout"], p["k"], p["stride"], p["pad"], p["h"], p["w"],
                     p.get("dilation", 1))


def _kwargs(s: ConvShape) -> dict:
    return {"kernel_size": s.k, "stride": s.stride, "padding": s.pad, "dilation": s.dilation}


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    s = _shape_of(case)
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn(s.x_shape, generator=gen)
    dy = torch.randn(s.y_shape, generator=gen)
    if case.params.get("layout", "nchw") == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    return (x.to(device), dy.to(device)), _kwargs(s)


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    x, dy = (a.detach().to("cpu", torch.float64) for a in args)
    kh, kw = _pair("kernel_size", kwargs["kernel_size"], 1)
    return torch.nn.grad.conv2d_weight(x, (dy.shape[1], x.shape[1], kh, kw), dy, stride=kwargs.get("stride", 1),
                                       padding=kwargs.get("padding", 0), dilation=kwargs.get("dilation", 1))


def _case(s: ConvShape, seed: int, layout: str = "nchw", **extra) -> Case:
    params = {"n": s.n, "cin": s.cin, "cout": s.cout, "k": s.k, "stride": s.stride, "pad": s.pad,
              "h": s.h, "w": s.w, "dilation": s.dilation, "layout": layout, **extra}
    _, _, oh, ow = s.y_shape
    contention = float(plan(s.cout, s.cin * s.k * s.k, s.n * oh * ow).splits)  # partials per dw element
    suffix = "" if layout == "nchw" else "_cl"
    return Case(OP, f"{s.name}_n{s.n}{suffix}", params, seed=seed, contention=contention)


def _test_cases() -> list[Case]:
    """Hostile shapes (both layouts), every ResNet-18 shape at batch 1, and at batch 128 (``slow``)."""
    cases = [_case(s, 2000 + i) for i, s in enumerate(HOSTILE_CONV)]
    cases += [_case(s, 2100 + i, "channels_last") for i, s in enumerate(HOSTILE_CONV)]
    cases += [_case(s.with_batch(1), 2200 + i) for i, s in enumerate(RESNET18_CONV)]
    cases += [_case(s, 2300 + i, slow=True) for i, s in enumerate(RESNET18_CONV)]
    return cases


def _bench_cases(scale: str) -> list[Case]:
    if scale == "cpu":
        return [_case(s.with_batch(8), 3000 + i) for i, s in enumerate(RESNET18_CONV)]
    layouts = ("nchw", "channels_last") if scale == "gpu" else ("nchw",)
    return [_case(s, 3100 + 100 * j + i, layout) for j, layout in enumerate(layouts)
            for i, s in enumerate(RESNET18_CONV)]


def _torch_wgrad(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """aten convolution_backward with only the weight gradient requested (cuDNN on CUDA; the caller
    sets the cuDNN flags)."""
    kh, kw = _pair("kernel_size", kernel_size, 1)
    return torch.nn.grad.conv2d_weight(x, (dy.shape[1], x.shape[1], kh, kw), dy, stride=stride,
                                       padding=padding, dilation=dilation)


def _bytes_moved(case: Case) -> int:
    s = _shape_of(case)
    return 4 * (int(np.prod(s.x_shape)) + int(np.prod(s.y_shape)) + int(np.prod(s.w_shape)))


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

_FMA = ("; FFMA inside a chunk, so not CPU bit-exact (the model keeps chunking and combine order); float32 "
        "with Cin a multiple of the tile skips padding terms (an Inf or NaN dy at a padded tap gives no NaN)")
define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, conv_wgrad_atomic_cuda, conv_wgrad_atomic_cpu,
         "implicit GEMM, split-K; chunk partial tiles atomicAdd-ed into dw in arrival order" + _FMA),
        ("tree", True, False, conv_wgrad_tree_cuda, conv_wgrad_tree_cpu,
         "implicit GEMM, same split-K; chunk partials to a workspace, summed in a fixed order" + _FMA),
        ("nosplit", True, False, conv_wgrad_nosplit_cuda, conv_wgrad_nosplit_cpu,
         "implicit GEMM without split-K: one block per output tile owns the whole reduction" + _FMA),
    ],
    cpu_bitexact=False,
    half_native=("atomic", "tree"),  # bf16 / fp16 on tensor cores (conv_mma.py)
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=lambda: {"torch": _torch_wgrad},
    bytes_moved=_bytes_moved,
    flops=lambda case: _shape_of(case).flops,
)
