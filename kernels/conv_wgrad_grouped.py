"""conv_wgrad_grouped: weight gradient of a grouped 2-D convolution (depthwise included). CUDA launchers for
``conv_wgrad_grouped.cu`` and their CPU order models (Numba, bit for bit).

    conv_wgrad_grouped(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1) -> dw
    x (N, Cin, H, W), dy (N, Cout, OH, OW) float32, any strides (NCHW, channels_last, sliced views);
    dw (Cout, Cin/groups, KH, KW) contiguous.

The reduction over K = N*OH*OW is cut by :func:`plan` (a function of the shapes and of whether the
channels of x are innermost in memory, never of the device) into S chunks per channel tile; every block
reduces its chunk to one partial per dw element in the order conv_wgrad_grouped.cu documents, and the
variants differ only in how the S partials meet:

    atomic   atomicAdd into dw in arrival order             (model: random order per element, subnormals
                                                              flushed as float atomicAdd does)
    tree     workspace + the tile's last block: lane l adds partials l, l + 32, ... in order, then a
             halving tree over the 32 lanes; S = 1 stores the block partial

Products and sums are separate float32 roundings (no FMA contraction), so the CPU models are bit-exact:
``tree`` equals its model on every input; ``atomic`` equals its model for the arrival order the GPU took.
The layout chooses the lane mapping (lanes along ow for NCHW, along channels for channels_last), so the
two layouts of one input give different (each reproducible) bits.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .order import F32, arrival_sum, halving_tree, pad_to, seq_sum
from .registry import Case, define_op
from .runtime import (
    INT32_MAX,
    KernelArgumentError,
    cdiv,
    check_cuda,
    check_tensor,
    cudnn_default_heuristics,
    function,
    launch,
    memo_check,
    ptr,
    ticket_counters,
)
from .shapes import GroupedGeometry, conv_out

OP = "conv_wgrad_grouped"
SOURCE = "conv_wgrad_grouped.cu"
THREADS = 256
WARPS = 8
TAP_SIZES = (9, 25, 49)   # taps per block the kernels are built for; larger kernels are cut into tap groups
# Split of the reduction: about TARGET_BLOCKS blocks (132 SMs x 8 resident 256-thread blocks is ~1000:
# two waves), each with at least MIN_WORK (pair, position) terms per tap (8 per thread), at most
# MAX_SPLITS partials per element (the last block's lanes read S / 32 each). Constants, not the device.
TARGET_BLOCKS = 2048
MIN_WORK = 8 * THREADS
MAX_SPLITS = 1024


# --------------------------------------------------------------------------------------------------
# Arguments and the plan


@dataclass(frozen=True)
class Geometry(GroupedGeometry):
    channel_inner: bool  # x's channels innermost in memory (channels_last): lanes along channels

    @property
    def pairs(self) -> int:
        return self.cout * self.cin_g

    @property
    def k(self) -> int:
        return self.n * self.oh * self.ow

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.cout, self.cin_g, self.kh, self.kw)


@dataclass(frozen=True)
class Plan:
    tk: int        # taps per block (a kernel size of conv_wgrad_grouped.cu)
    tgroups: int   # tap groups (ceil(KH*KW / tk))
    ct: int        # pairs per channel tile (lanes of a warp along pairs)
    tiles: int     # channel tiles
    splits: int    # S: chunks of the reduction = partials per dw element
    chunk: int     # positions per chunk (the last may be shorter)

    @property
    def q(self) -> int:
        return 32 // self.ct

    @property
    def lanes(self) -> int:  # P: position lanes of a block
        return WARPS * self.q


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def plan(g: Geometry) -> Plan:
    return _plan(g.kh * g.kw, g.pairs, g.k, g.channel_inner, TARGET_BLOCKS, MIN_WORK, MAX_SPLITS)


@functools.lru_cache(maxsize=1024)
def _plan(kk: int, pairs: int, k: int, channel_inner: bool, target_blocks: int, min_work: int,
          max_splits: int) -> Plan:
    tk = next((t for t in TAP_SIZES if t >= kk), TAP_SIZES[-1])
    tgroups = cdiv(kk, tk)
    ct = min(32 if tk <= 25 else 16, _next_pow2(pairs)) if channel_inner else 1
    tiles = cdiv(pairs, ct)
    s = max(1, min(cdiv(target_blocks, tiles * tgroups), k // cdiv(min_work, ct), max_splits))
    chunk = cdiv(k, s)
    return Plan(tk, tgroups, ct, tiles, cdiv(k, chunk), chunk)


def pair_of(arg: str, v, minimum: int, op: str = OP) -> tuple[int, int]:
    vals = tuple(v) if isinstance(v, (tuple, list, torch.Size)) else (v, v)
    if len(vals) != 2 or not all(isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in vals):
        raise KernelArgumentError(op, arg, f"expected an int or a pair of ints, got {v!r}")
    if any(int(e) < minimum for e in vals):
        raise KernelArgumentError(op, arg, f"expected values >= {minimum}, got {v!r}")
    return int(vals[0]), int(vals[1])


def check_groups(op: str, groups, cin: int, cout: int) -> int:
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise KernelArgumentError(op, "groups", f"expected an int >= 1, got {groups!r}")
    if cin % groups or cout % groups:
        raise KernelArgumentError(op, "groups", f"{groups} groups must divide both channel counts, got Cin = {cin} "
                                  f"and Cout = {cout}")
    return int(groups)


def channels_inner(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor's channels are innermost in memory (channels_last, or a view with the
    channel stride the smallest of C, W); NCHW wins for tensors that are both."""
    if t.is_contiguous():
        return False
    if t.is_contiguous(memory_format=torch.channels_last):
        return True
    return t.shape[1] > 1 and t.stride(1) < t.stride(3)


_CHECKED: dict[tuple, Geometry] = {}


def _check(x, dy, kernel_size, stride, padding, dilation, groups) -> Geometry:
    return memo_check(_CHECKED, _check_all, x, dy, kernel_size, stride, padding, dilation, groups)


def _check_all(x, dy, kernel_size, stride, padding, dilation, groups) -> Geometry:
    x = check_tensor(OP, "x", x, ndim=4)
    dy = check_tensor(OP, "dy", dy, ndim=4)
    if dy.device != x.device:
        raise KernelArgumentError(OP, "dy", f"expected a tensor on {x.device} (like x), got one on {dy.device}")
    kh, kw = pair_of("kernel_size", kernel_size, 1)
    sh, sw = pair_of("stride", stride, 1)
    ph, pw = pair_of("padding", padding, 0)
    dh, dw = pair_of("dilation", dilation, 1)
    n, cin, h, w = x.shape
    cout = dy.shape[1]
    groups = check_groups(OP, groups, cin, cout)
    oh, ow = conv_out(h, kh, sh, ph, dh), conv_out(w, kw, sw, pw, dw)
    if oh < 1 or ow < 1:
        raise KernelArgumentError(
            OP, "kernel_size", f"a {kh}x{kw} kernel (dilation {dh}x{dw}, padding {ph}x{pw}) does not fit "
            f"the {h}x{w} input: the output would be {oh}x{ow}")
    if dy.shape[0] != n or dy.shape[2] != oh or dy.shape[3] != ow:
        raise KernelArgumentError(
            OP, "dy", f"expected shape ({n}, Cout, {oh}, {ow}) for x of shape {tuple(x.shape)} and these conv "
            f"parameters, got {tuple(dy.shape)}")
    for arg, t in (("x", x), ("dy", dy)):  # 32-bit offsets: the furthest element must be below 2^31
        span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
        if t.numel() > INT32_MAX or span > INT32_MAX:
            raise KernelArgumentError(OP, arg, f"{t.numel()} elements (offset span {span}) exceeds the supported 2^31 - 1")
    if cout * (cin // groups) * kh * kw > INT32_MAX:
        raise KernelArgumentError(OP, "kernel_size", "dw would have 2^31 elements or more")
    return Geometry(n, cin, h, w, cout, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, groups, channels_inner(x))


def _empty(g: Geometry) -> bool:
    return g.n == 0 or g.cin == 0 or g.cout == 0


# --------------------------------------------------------------------------------------------------
# CUDA launchers


@functools.lru_cache(maxsize=512)
def _int_args(g: Geometry, sx: tuple, sd: tuple, p: Plan) -> tuple:
    return tuple(np.int32(v) for v in (g.n, g.cin, g.h, g.w, g.cout, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph,
                                       g.pw, g.dh, g.dw, g.cin_g, g.cout_g, *sx, *sd, p.ct.bit_length() - 1,
                                       p.splits, p.chunk, g.pairs))


def _launch(mode: str, x, dy, out, ws, counters, g: Geometry, p: Plan) -> None:
    fn = function(SOURCE, f"conv_wgrad_grouped_{mode}_t{p.tk}", x.device)
    launch(fn, (p.tiles, p.splits, p.tgroups), (THREADS,),
           (ptr(x), ptr(dy), ptr(out), ws, counters, *_int_args(g, x.stride(), dy.stride(), p)), device=x.device)


def _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, groups) -> Geometry:
    g = _check(x, dy, kernel_size, stride, padding, dilation, groups)
    check_cuda(OP, "x", x)
    return g


def conv_wgrad_grouped_atomic_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1):
    g = _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, groups)
    dw = torch.zeros(g.w_shape, device=x.device, dtype=torch.float32)  # the atomics add onto +0.0
    if not _empty(g):
        _launch("atomic", x, dy, dw, np.uint64(0), np.uint64(0), g, plan(g))
    return dw


def conv_wgrad_grouped_tree_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1):
    g = _cuda_prologue(x, dy, kernel_size, stride, padding, dilation, groups)
    if _empty(g):
        return torch.zeros(g.w_shape, device=x.device, dtype=torch.float32)
    p = plan(g)
    dw = torch.empty(g.w_shape, device=x.device, dtype=torch.float32)
    if p.splits == 1:  # each block stores its partial: no workspace, no tickets
        _launch("tree", x, dy, dw, np.uint64(0), np.uint64(0), g, p)
        return dw
    tickets = p.tgroups * p.tiles
    ws = torch.empty(tickets * p.splits * p.ct * p.tk, device=x.device, dtype=torch.float32)
    counters = ticket_counters(x.device, tickets)
    _launch("tree", x, dy, dw, ptr(ws), ptr(counters), g, p)
    return dw


# --------------------------------------------------------------------------------------------------
# CPU order models (Numba: one float32 rounding per product and per addition, in the kernel's order)


@functools.lru_cache(maxsize=None)
def _jit():
    import numba

    @numba.njit(cache=False)
    def block_partials(x, dy, kh_, kw_, sh, sw, ph, pw, dh, dw, cin_g, cout_g, ct, splits, chunk, tk, tgroups,
                       tiles):
        # Steps 1-3 of conv_wgrad_grouped.cu: out[tg, tile, s, c, i] is block (tile, s, tg)'s partial
        # of pair tile * ct + c, tap tg * tk + i.
        n_, cin, h, w = x.shape
        cout, oh_, ow_ = dy.shape[1], dy.shape[2], dy.shape[3]
        pairs = cout * cin_g
        kk = kh_ * kw_
        q_ = 32 // ct
        p_ = 8 * q_
        ohw = oh_ * ow_
        k_all = n_ * ohw
        out = np.zeros((tgroups, tiles, splits, ct, tk), np.float32)
        lanes = np.zeros((8, q_, tk), np.float32)
        for tg in range(tgroups):
            tap0 = tg * tk
            ntap = min(tk, kk - tap0)
            for tile in range(tiles):
                for c in range(ct):
                    e = tile * ct + c
                    if e >= pairs:
                        continue
                    co = e // cin_g
                    cx = (co // cout_g) * cin_g + (e - co * cin_g)
                    for s in range(splits):
                        k0 = s * chunk
                        k1 = min(k_all, k0 + chunk)
                        lanes[:] = 0
                        for wp in range(8):
                            for q in range(q_):
                                k = k0 + wp * q_ + q
                                while k < k1:
                                    n = k // ohw
                                    rest = k - n * ohw
                                    oh = rest // ow_
                                    ow = rest - oh * ow_
                                    gy = dy[n, co, oh, ow]
                                    for i in range(ntap):
                                        tap = tap0 + i
                                        kh = tap // kw_
                                        kw = tap - kh * kw_
                                        ih = oh * sh - ph + kh * dh
                                        iw = ow * sw - pw + kw * dw
                                        if ih >= 0 and ih < h and iw >= 0 and iw < w:
                                            lanes[wp, q, i] = lanes[wp, q, i] + gy * x[n, cx, ih, iw]
                                    k += p_
                        half = q_ // 2
                        while half >= 1:  # halving tree over the warp's position lanes
                            for wp in range(8):
                                for q in range(half):
                                    for i in range(ntap):
                                        lanes[wp, q, i] = lanes[wp, q, i] + lanes[wp, q + half, i]
                            half //= 2
                        for i in range(ntap):  # the 8 warp sums, a halving tree
                            v = lanes[:, 0, i]
                            out[tg, tile, s, c, i] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
        return out

    return block_partials


def block_partials(x: torch.Tensor, dy: torch.Tensor, g: Geometry, p: Plan) -> np.ndarray:
    """Every block's partial, shape (tgroups, tiles, S, ct, tk), as the kernels compute them."""
    xn = x.detach().contiguous().numpy()
    dyn = dy.detach().contiguous().numpy()
    return _jit()(xn, dyn, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.cin_g, g.cout_g, p.ct, p.splits,
                  p.chunk, p.tk, p.tgroups, p.tiles)


def tree_combine(partials: np.ndarray) -> np.ndarray:
    """The last block's combine over the last axis (S partials): lane l adds partials l, l + 32, ... in
    order from +0.0, then a halving tree over the 32 lanes. S = 1: the partial itself."""
    partials = np.asarray(partials, dtype=F32)
    if partials.shape[-1] == 1:
        return partials[..., 0]
    cols = pad_to(partials, -1, 32)
    cols = cols.reshape(*cols.shape[:-1], -1, 32)
    return halving_tree(seq_sum(cols, -2))


def _to_dw(per_block: np.ndarray, g: Geometry, p: Plan) -> torch.Tensor:
    """(tgroups, tiles, ct, tk) results -> dw (Cout, Cin_g, KH, KW)."""
    kk = g.kh * g.kw
    dw = np.empty((g.pairs, kk), dtype=F32)
    for tg in range(p.tgroups):
        tap0 = tg * p.tk
        ntap = min(p.tk, kk - tap0)
        dw[:, tap0:tap0 + ntap] = per_block[tg].reshape(p.tiles * p.ct, p.tk)[:g.pairs, :ntap]
    return torch.from_numpy(dw.reshape(g.w_shape))


def _cpu_prologue(x, dy, kernel_size, stride, padding, dilation, groups) -> Geometry:
    g = _check(x, dy, kernel_size, stride, padding, dilation, groups)
    if x.device.type != "cpu":
        raise KernelArgumentError(OP, "x", f"the CPU model needs CPU tensors, got one on {x.device}")
    return g


def conv_wgrad_grouped_atomic_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1, rng=None):
    g = _cpu_prologue(x, dy, kernel_size, stride, padding, dilation, groups)
    if _empty(g):
        return torch.zeros(g.w_shape)
    p = plan(g)
    parts = np.moveaxis(block_partials(x, dy, g, p), 2, -1)  # (tgroups, tiles, ct, tk, S)
    return _to_dw(arrival_sum(parts, rng), g, p)


def conv_wgrad_grouped_tree_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1, rng=None):
    g = _cpu_prologue(x, dy, kernel_size, stride, padding, dilation, groups)
    if _empty(g):
        return torch.zeros(g.w_shape)
    p = plan(g)
    parts = np.moveaxis(block_partials(x, dy, g, p), 2, -1)
    return _to_dw(tree_combine(parts), g, p)


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, float64 reference, cases, peers


@dataclass(frozen=True)
class GroupedConv:
    """One grouped conv layer: (N, Cin, H, W) -> (N, Cout, OH, OW), square kernel unless ``kw`` is set."""

    name: str
    n: int
    cin: int
    cout: int
    groups: int
    k: int
    stride: int | tuple[int, int]
    pad: int | tuple[int, int]
    h: int
    w: int
    dilation: int = 1
    kw: int | None = None

    def params(self) -> dict:
        return {"n": self.n, "cin": self.cin, "cout": self.cout, "groups": self.groups, "k": self.k,
                "kw": self.kw or self.k, "stride": self.stride, "pad": self.pad, "h": self.h, "w": self.w,
                "dilation": self.dilation}


def conv_params(p: dict) -> tuple:
    """(KH, KW, (sh, sw), (ph, pw), (dh, dw), OH, OW) of a case's params."""
    kh, kw = p["k"], p.get("kw", p["k"])
    sh, sw = pair_of("stride", p["stride"], 1)
    ph, pw = pair_of("padding", p["pad"], 0)
    dh, dw = pair_of("dilation", p["dilation"], 1)
    return kh, kw, (sh, sw), (ph, pw), (dh, dw), conv_out(p["h"], kh, sh, ph, dh), conv_out(p["w"], kw, sw, pw, dw)


# Depthwise layers of MobileNetV2 and MobileNetV3 (small and large) at 224 px, ConvNeXt-T's 7x7 depthwise,
# ResNeXt-50 32x4d's grouped 3x3 convs: (name, N, C, groups, k, stride, pad, H). Shared with conv_dgrad_grouped.
MODEL_LAYERS: tuple[GroupedConv, ...] = (
    GroupedConv("mnv2_dw3_32_112", 128, 32, 32, 32, 3, 1, 1, 112, 112),
    GroupedConv("mnv2_dw3s2_96_112", 128, 96, 96, 96, 3, 2, 1, 112, 112),
    GroupedConv("mnv2_dw3_144_56", 128, 144, 144, 144, 3, 1, 1, 56, 56),
    GroupedConv("mnv2_dw3s2_144_56", 128, 144, 144, 144, 3, 2, 1, 56, 56),
    GroupedConv("mnv2_dw3_192_28", 128, 192, 192, 192, 3, 1, 1, 28, 28),
    GroupedConv("mnv2_dw3_384_14", 128, 384, 384, 384, 3, 1, 1, 14, 14),
    GroupedConv("mnv2_dw3_576_14", 128, 576, 576, 576, 3, 1, 1, 14, 14),
    GroupedConv("mnv2_dw3s2_576_14", 128, 576, 576, 576, 3, 2, 1, 14, 14),
    GroupedConv("mnv2_dw3_960_7", 128, 960, 960, 960, 3, 1, 1, 7, 7),
    GroupedConv("mnv3s_dw3s2_16_112", 128, 16, 16, 16, 3, 2, 1, 112, 112),
    GroupedConv("mnv3s_dw5s2_96_14", 128, 96, 96, 96, 5, 2, 2, 14, 14),
    GroupedConv("mnv3s_dw5_240_7", 128, 240, 240, 240, 5, 1, 2, 7, 7),
    GroupedConv("mnv3s_dw5_576_7", 128, 576, 576, 576, 5, 1, 2, 7, 7),
    GroupedConv("mnv3l_dw5s2_72_56", 128, 72, 72, 72, 5, 2, 2, 56, 56),
    GroupedConv("convnext_dw7_96_56", 64, 96, 96, 96, 7, 1, 3, 56, 56),
    GroupedConv("convnext_dw7_384_14", 64, 384, 384, 384, 7, 1, 3, 14, 14),
    GroupedConv("resnext_g32_128_56", 64, 128, 128, 32, 3, 1, 1, 56, 56),
    GroupedConv("resnext_g32s2_256_56", 64, 256, 256, 32, 3, 2, 1, 56, 56),
    GroupedConv("resnext_g32_512_14", 64, 512, 512, 32, 3, 1, 1, 14, 14),
    GroupedConv("resnext_g32_1024_7", 64, 1024, 1024, 32, 3, 1, 1, 7, 7),
)

# Small hostile layers for tests.
HOSTILE: tuple[GroupedConv, ...] = (
    GroupedConv("dw3_s1", 2, 8, 8, 8, 3, 1, 1, 9, 11),
    GroupedConv("dw3_s2_odd", 3, 6, 6, 6, 3, 2, 1, 13, 7),
    GroupedConv("dw5_s2_p2", 2, 5, 5, 5, 5, 2, 2, 11, 12),
    GroupedConv("dw7_p3", 2, 4, 4, 4, 7, 1, 3, 10, 9),
    GroupedConv("dw9_taps81", 1, 3, 3, 3, 9, 1, 4, 10, 10),         # two tap groups of 49 + 32
    GroupedConv("multiplier2", 2, 4, 8, 4, 3, 1, 1, 7, 8),          # Cin/groups = 1, Cout/groups = 2
    GroupedConv("groups4", 2, 8, 12, 4, 3, 1, 1, 6, 7),             # Cin/groups = 2, Cout/groups = 3
    GroupedConv("asym_s_p", 2, 6, 6, 6, 3, (2, 1), (0, 1), 9, 8),    # per-axis stride and padding
    GroupedConv("rect_k", 2, 4, 4, 4, 3, 1, (1, 2), 8, 8, kw=5),     # 3x5 kernel
    GroupedConv("dilation2", 2, 6, 6, 6, 3, 1, 2, 9, 10, 2),
    GroupedConv("spatial1x1", 3, 16, 16, 16, 3, 1, 1, 1, 1),
    GroupedConv("k1_on_1x1", 4, 6, 6, 3, 1, 1, 0, 1, 1),
    GroupedConv("groups1", 2, 3, 5, 1, 3, 1, 1, 6, 6),
    GroupedConv("many_splits", 80, 1, 1, 1, 3, 1, 1, 32, 32),      # S = 40 > 32: the last block's lanes loop
    GroupedConv("dw3_s3_d2", 2, 4, 4, 4, 3, 3, 2, 13, 11, 2),      # dilation 2 under stride 3
    GroupedConv("groups2_s2_d3", 2, 4, 6, 2, 3, 2, 3, 12, 11, 3),  # Cout/groups = 3, dilation 3 under stride 2
    GroupedConv("dw5_s2_d2", 2, 4, 4, 4, 5, 2, 4, 12, 13, 2),      # dilation equal to the stride
    GroupedConv("dw3_s2_d5", 2, 3, 3, 3, 3, 2, 5, 14, 12, 5),      # depthwise, dilation 5 under stride 2
)


def _case(layer: GroupedConv, seed: int, layout: str = "nchw", suffix: str = "") -> Case:
    params = {**layer.params(), "layout": layout}
    kh, kw, _, _, _, oh, ow = conv_params(params)
    g = Geometry(layer.n, layer.cin, layer.h, layer.w, layer.cout, oh, ow, kh, kw, 1, 1, 0, 0, 1, 1, layer.groups,
                 layout == "channels_last")
    contention = float(plan(g).splits)
    tag = "" if layout == "nchw" else "_cl"
    return Case(OP, f"{layer.name}{tag}{suffix}", params, seed=seed, contention=contention)


def make_x_dy(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    p = case.params
    kh, kw, _, _, _, oh, ow = conv_params(p)
    gen = torch.Generator().manual_seed(case.seed)
    x = torch.randn((p["n"], p["cin"], p["h"], p["w"]), generator=gen)
    dy = torch.randn((p["n"], p["cout"], oh, ow), generator=gen)
    if p.get("layout", "nchw") == "channels_last":
        x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
    return x.to(device), dy.to(device)


def _kwargs(p: dict) -> dict:
    kh, kw, s, pad, d, _, _ = conv_params(p)
    return {"kernel_size": (kh, kw), "stride": s, "padding": pad, "dilation": d, "groups": p["groups"]}


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    return make_x_dy(case, device), _kwargs(case.params)


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    x, dy = (a.detach().to("cpu", torch.float64) for a in args)
    return _torch_wgrad(x, dy, **kwargs)


def _torch_wgrad(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
    """aten convolution_backward with only the weight gradient asked for (cuDNN on CUDA; the caller
    sets the cuDNN flags)."""
    kh, kw = pair_of("kernel_size", kernel_size, 1)
    return torch.nn.grad.conv2d_weight(x, (dy.shape[1], x.shape[1] // groups, kh, kw), dy, stride=stride,
                                       padding=padding, dilation=dilation, groups=groups)


def _torch_wgrad_default(x, dy, **kw) -> torch.Tensor:
    """cuDNN with its default heuristics (``cudnn.benchmark`` off), deterministic mode off."""
    with cudnn_default_heuristics():
        return _torch_wgrad(x, dy, **kw)


def _test_cases() -> list[Case]:
    cases = [_case(layer, 5000 + i) for i, layer in enumerate(HOSTILE)]
    cases += [_case(layer, 5100 + i, "channels_last") for i, layer in enumerate(HOSTILE)]
    return cases


def _small(layer: GroupedConv, n: int, hw_div: int) -> GroupedConv:
    from dataclasses import replace

    return replace(layer, n=n, h=max(1, layer.h // hw_div), w=max(1, layer.w // hw_div))


def grouped_bench_cases(case, scale: str, base: int) -> list[Case]:
    """A grouped-conv op's benchmark cases from ``case(layer, seed, layout="nchw", suffix="")``, seeds from
    ``base``: a few scaled-down layers for the CPU models, four layers (quick), or every layer in both
    layouts."""
    if scale == "cpu":  # the Numba models on a few scaled-down layers
        picks = [MODEL_LAYERS[i] for i in (0, 10, 14, 16)]
        return [case(_small(layer, 2, 4), base + 200 + i, suffix="_small") for i, layer in enumerate(picks)]
    if scale == "quick":
        return [case(MODEL_LAYERS[i], base + 300 + i) for i in (0, 6, 14, 18)]
    return [case(layer, base + 400 + 100 * j + i, layout) for j, layout in enumerate(("nchw", "channels_last"))
            for i, layer in enumerate(MODEL_LAYERS)]


def bytes_moved(case: Case) -> int:
    """x, dy and the weights once each, float32 (both grouped-conv gradients)."""
    p = case.params
    kh, kw, _, _, _, oh, ow = conv_params(p)
    return 4 * (p["n"] * p["cin"] * p["h"] * p["w"] + p["n"] * p["cout"] * oh * ow
                + p["cout"] * (p["cin"] // p["groups"]) * kh * kw)


def flops(case: Case) -> int:
    p = case.params
    kh, kw, _, _, _, oh, ow = conv_params(p)
    return 2 * p["n"] * p["cout"] * oh * ow * (p["cin"] // p["groups"]) * kh * kw


def _bench_cases(scale: str) -> list[Case]:
    return grouped_bench_cases(_case, scale, 5000)


# --------------------------------------------------------------------------------------------------
# Registry

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, conv_wgrad_grouped_atomic_cuda, conv_wgrad_grouped_atomic_cpu,
         "split reduction over N*OH*OW; each block's partial per dw element atomicAdd-ed in arrival order"),
        ("tree", True, False, conv_wgrad_grouped_tree_cuda, conv_wgrad_grouped_tree_cpu,
         "same blocks and partials; the channel tile's last block combines them in a fixed order"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=lambda: {"torch": _torch_wgrad, "cudnn_default": _torch_wgrad_default},
    bytes_moved=bytes_moved,
    flops=flops,
)
