"""conv_wgrad ``winograd``: the weight gradient of 3x3 stride-1 convolutions by Winograd F(3, 2), with a
fixed-order split-K combine (deterministic). CUDA launchers for ``conv_wgrad_winograd.cu`` and the CPU
order model; the algorithm and the exact order of its arithmetic are described at the top of the .cu file.

    conv_wgrad winograd(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> dw

Shapes it does not cover (any kernel other than 3x3, stride or dilation other than 1, fewer than
MIN_CHANNELS channels) run ``tree``'s implicit GEMM, bits included, so the variant is a drop-in for every
conv the harness routes; so do bf16/fp16 calls on CUDA (tree's tensor-core kernels, conv_mma.py).

The tile axis T = N * ceil(OH/2) * ceil(OW/2) is cut into S chunks by :func:`plan`, a function of the
shapes only, as the direct kernels cut theirs; the CPU model keeps the transforms' and the combine's
order bit for bit, and computes each chunk's GEMM with a float32 BLAS (not the GPU's FFMA order), so it
is not CPU bit-exact. :func:`magnitude` gives the float64 quantity the error bound of the tests scales.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from . import conv_wgrad as direct
from .conv_wgrad import OP, Geometry, Plan, tree_combine
from .order import F32
from .registry import HALF_DTYPES, define_op
from .runtime import cdiv, function, launch, ptr

SOURCE = "conv_wgrad_winograd.cu"
THREADS = 256
XI = 16             # transform positions: 4 x 4
MAX_SPLITS = 4095   # gridDim.z = 16 * S <= 65535


# Fewest input and output channels for the Winograd path: its GEMMs are Cout x Cin, and with a handful
# of channels (the 3->64 stem) they waste most of every tile while the transforms still cost 4x the
# traffic of x and dy. H200, batch 128: the 3->64 3x3 stem took 230 us by Winograd against 72 us by
# tree; 64->64 3x3 32x32 took 278 us against 446 us.
MIN_CHANNELS = 16


def applies(g: Geometry) -> bool:
    """3x3, stride 1, dilation 1 (any padding), at least MIN_CHANNELS channels in and out: the shapes
    this F(3, 2) path serves."""
    return (g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) == (3, 3, 1, 1, 1, 1) and min(g.cin, g.cout) >= MIN_CHANNELS


def tiles(g: Geometry) -> tuple[int, int, int]:
    """(tile rows, tile columns, T): 2x2 output tiles per image, and over the batch."""
    tp, tq = cdiv(g.oh, 2), cdiv(g.ow, 2)
    return tp, tq, g.n * tp * tq


def plan(k_out: int, c_in: int, t: int) -> Plan:
    """Output tile and split of the tile axis for the 16 GEMMs (Cout x Cin each, reduction over T); the
    direct kernels' base rule (conv_wgrad.split_for, without their refit to whole waves) with 16 times as
    many output tiles. Shapes only."""
    tile = 128 if k_out >= 128 and c_in >= 128 else 64
    splits, chunk = direct.split_for(XI * cdiv(k_out, tile) * cdiv(c_in, tile), t, max_splits=MAX_SPLITS)
    return Plan(tile, splits, chunk)


def _round4(v: int) -> int:
    return cdiv(v, 4) * 4


# --------------------------------------------------------------------------------------------------
# CUDA


def _wino_cuda(x: torch.Tensor, dy: torch.Tensor, g: Geometry) -> torch.Tensor:
    tp, tq, t = tiles(g)
    p = plan(g.cout, g.cin, t)
    kp, cp = _round4(g.cout), _round4(g.cin)
    dev = x.device
    V = torch.empty((XI, t, cp), device=dev, dtype=torch.float32)
    U = torch.empty((XI, t, kp), device=dev, dtype=torch.float32)
    part = torch.empty((XI, p.splits, g.cout, g.cin), device=dev, dtype=torch.float32)
    dw = torch.empty(g.w_shape, device=dev, dtype=torch.float32)
    i32, i64 = np.int32, np.int64
    launch(function(SOURCE, "wino_wgrad_input", dev), (min(cdiv(t * cp, THREADS), 65535 * 8),), (THREADS,),
           (ptr(x), ptr(V), i32(g.cin), i32(g.h), i32(g.w), i32(g.ph), i32(g.pw), i32(tp), i32(tq), i32(t),
            i32(cp), *(i64(s) for s in x.stride())), device=dev)
    launch(function(SOURCE, "wino_wgrad_dy", dev), (min(cdiv(t * kp, THREADS), 65535 * 8),), (THREADS,),
           (ptr(dy), ptr(U), i32(g.cout), i32(g.oh), i32(g.ow), i32(tp), i32(tq), i32(t), i32(kp),
            *(i64(s) for s in dy.stride())), device=dev)
    launch(function(SOURCE, f"wino_wgrad_gemm_t{p.tile}", dev),
           (cdiv(g.cin, p.tile), cdiv(g.cout, p.tile), XI * p.splits), (THREADS,),
           (ptr(U), ptr(V), ptr(part), i32(t), i32(kp), i32(cp), i32(g.cout), i32(g.cin), i32(p.chunk),
            i32(p.splits)), device=dev)
    launch(function(SOURCE, "wino_wgrad_output", dev), (cdiv(g.cout * g.cin, 32),), (512,),
           (ptr(part), ptr(dw), i32(g.cout), i32(g.cin), i32(p.splits)), device=dev)
    return dw


def conv_wgrad_winograd_cuda(x, dy, *, kernel_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    if x.dtype in HALF_DTYPES or dy.dtype in HALF_DTYPES:   # tree's tensor-core kernels, its bits
        return direct.conv_wgrad_tree_cuda(x, dy, kernel_size=kernel_size, stride=stride, padding=padding,
                                           dilation=dilation)
    g = direct._cuda_prologue(x, dy, kernel_size, stride, padding, dilation)
    if direct._empty(g):
        return torch.zeros(g.w_shape, device=x.device, dtype=torch.float32)
    if not applies(g):
        return direct._split_and_combine(x, dy, g, direct.plan(g.m, g.r, g.k))
    return _wino_cuda(x, dy, g)


conv_wgrad_winograd_cuda.half_as = "tree"   # its bf16/fp16 calls are tree's (the routing's tuner reads this)


# --------------------------------------------------------------------------------------------------
# CPU order model: the transforms and the combine in the kernels' order, float32, one rounding per
# operation (NumPy float32 arithmetic); the chunk GEMMs with a float32 BLAS.


def _bt(e0, e1, e2, e3, absolute: bool = False):
    """One axis of B^T d: e0 - e2, e1 + e2, e2 - e1, e1 - e3 (with |B^T| when ``absolute``)."""
    if absolute:
        return e0 + e2, e1 + e2, e2 + e1, e1 + e3
    return e0 - e2, e1 + e2, e2 - e1, e1 - e3


def _a(e0, e1, absolute: bool = False):
    """One axis of A g: e0, e0 + e1, e0 - e1, -e1."""
    if absolute:
        return e0, e0 + e1, e0 + e1, e1
    return e0, e0 + e1, e0 - e1, -e1


def _gt(e0, e1, e2, e3, absolute: bool = False):
    """One axis of G^T m: e0 + h(e1 + e2), h(e1 - e2), h(e1 + e2) + e3 with h = 0.5 (exact products)."""
    h = e0.dtype.type(0.5)
    u = e1 + e2
    v = e1 + e2 if absolute else e1 - e2
    return e0 + h * u, h * v, h * u + e3


def input_transform(x: torch.Tensor, g: Geometry, *, absolute: bool = False, dtype=F32) -> np.ndarray:
    """V[xi, t, ci] = (B^T d B)[xi] of tile t's 4x4 input patch (rows first, then columns)."""
    tp, tq, t = tiles(g)
    xv = x.detach().to(torch.float64 if dtype == np.float64 else torch.float32)
    if absolute:
        xv = xv.abs()
    bottom, right = max(0, 2 * tp + 2 - g.ph - g.h), max(0, 2 * tq + 2 - g.pw - g.w)
    xp = F.pad(xv, (g.pw, right, g.ph, bottom)).permute(0, 2, 3, 1).contiguous()   # (n, rows, cols, c)
    sn, sh, sw, sc = xp.stride()
    d = xp.as_strided((g.n, tp, tq, 4, 4, g.cin), (sn, 2 * sh, 2 * sw, sh, sw, sc)).numpy()
    rows = _bt(d[:, :, :, 0], d[:, :, :, 1], d[:, :, :, 2], d[:, :, :, 3], absolute)   # each (n,tp,tq,4,c)
    out = np.empty((4, 4, g.n, tp, tq, g.cin), dtype=dtype)
    for a in range(4):
        s = rows[a]
        for b, v in enumerate(_bt(s[:, :, :, 0], s[:, :, :, 1], s[:, :, :, 2], s[:, :, :, 3], absolute)):
            out[a, b] = v
    return out.reshape(XI, t, g.cin)


def dy_transform(dy: torch.Tensor, g: Geometry, *, absolute: bool = False, dtype=F32) -> np.ndarray:
    """U[xi, t, co] = (A g A^T)[xi] of tile t's 2x2 output-gradient tile (rows first, then columns)."""
    tp, tq, t = tiles(g)
    dv = dy.detach().to(torch.float64 if dtype == np.float64 else torch.float32)
    if absolute:
        dv = dv.abs()
    dp = F.pad(dv, (0, 2 * tq - g.ow, 0, 2 * tp - g.oh)).permute(0, 2, 3, 1).contiguous()
    q = dp.reshape(g.n, tp, 2, tq, 2, g.cout).numpy()   # q[:, P, i, Q, j, co]
    rows = _a(q[:, :, 0], q[:, :, 1], absolute)          # each (n, tp, tq, 2, co)
    out = np.empty((4, 4, g.n, tp, tq, g.cout), dtype=dtype)
    for a in range(4):
        r = rows[a]
        for b, v in enumerate(_a(r[:, :, :, 0], r[:, :, :, 1], absolute)):
            out[a, b] = v
    return out.reshape(XI, t, g.cout)


def output_transform(m: np.ndarray, *, absolute: bool = False) -> np.ndarray:
    """dw[co, ci, r, s] = (G^T M G)[r, s] from M[xi, co, ci]: rows of G^T first, then columns."""
    mm = m.reshape(4, 4, *m.shape[1:])                       # mm[a, b, co, ci]
    z = _gt(mm[0], mm[1], mm[2], mm[3], absolute)           # z[r][b, co, ci]
    w = np.empty((3, 3, *m.shape[1:]), dtype=m.dtype)
    for r in range(3):
        for s, v in enumerate(_gt(z[r][0], z[r][1], z[r][2], z[r][3], absolute)):
            w[r, s] = v
    return np.ascontiguousarray(w.transpose(2, 3, 0, 1))


def chunk_partials(u: np.ndarray, v: np.ndarray, p: Plan) -> np.ndarray:
    """part[s, xi, co, ci]: the float32 product of U[xi]^T and V[xi] over chunk s of the tile axis (the
    GPU's missing terms past T read as +0.0)."""
    t = u.shape[1]
    pad = p.splits * p.chunk - t
    ut = torch.from_numpy(np.pad(u, ((0, 0), (0, pad), (0, 0)))).reshape(XI, p.splits, p.chunk, -1)
    vt = torch.from_numpy(np.pad(v, ((0, 0), (0, pad), (0, 0)))).reshape(XI, p.splits, p.chunk, -1)
    out = torch.bmm(ut.flatten(0, 1).transpose(1, 2), vt.flatten(0, 1))   # (16 * S, co, ci)
    return out.reshape(XI, p.splits, *out.shape[1:]).transpose(0, 1).numpy()


def conv_wgrad_winograd_cpu(x, dy, *, kernel_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    g = direct._cpu_prologue(x, dy, kernel_size, stride, padding, dilation)
    if direct._empty(g):
        return torch.zeros(g.w_shape)
    if not applies(g):
        return direct.conv_wgrad_tree_cpu(x, dy, kernel_size=kernel_size, stride=stride, padding=padding,
                                          dilation=dilation)
    _, _, t = tiles(g)
    p = plan(g.cout, g.cin, t)
    part = chunk_partials(dy_transform(dy, g), input_transform(x, g), p)    # (S, 16, co, ci)
    m = tree_combine(part.reshape(p.splits, -1)).reshape(XI, g.cout, g.cin)
    return torch.from_numpy(output_transform(m))


def magnitude(x: torch.Tensor, dy: torch.Tensor, g: Geometry) -> torch.Tensor:
    """float64 |G^T| (sum_t |A||g_t||A^T| (.) |B^T||d_t||B|) |G|: the Winograd evaluation with every input
    and coefficient replaced by its absolute value. A float32 evaluation whose every path passes at most
    ``depth`` roundings is within gamma_depth times this of the exact dw (tests/test_conv_wgrad.py)."""
    u = dy_transform(dy.cpu(), g, absolute=True, dtype=np.float64)
    v = input_transform(x.cpu(), g, absolute=True, dtype=np.float64)
    m = torch.bmm(torch.from_numpy(u).transpose(1, 2), torch.from_numpy(v)).numpy()
    return torch.from_numpy(output_transform(m, absolute=True))


def rounding_depth(g: Geometry) -> int:
    """Most roundings on any path of the float32 evaluation: 2 (U) + 2 (V) + chunk (product and FFMA
    accumulation) + at most ceil(S / 8) + 8 (combine) + 4 (output transform), rounded up."""
    _, _, t = tiles(g)
    p = plan(g.cout, g.cin, t)
    return p.chunk + p.splits + 8 + 9


# conv_wgrad's spec is in conv_wgrad.py; this adds a variant to it.
define_op(
    OP,
    variants=[
        ("winograd", True, False, conv_wgrad_winograd_cuda, conv_wgrad_winograd_cpu,
         "3x3 stride 1, >= 16 channels: Winograd F(3,2) transforms + 16 split-K GEMMs, partials summed in tree's "
         "fixed order; other shapes run tree. FFMA in the GEMMs, so not CPU bit-exact (the model keeps the "
         "transforms, chunking and combine order)"),
    ],
    cpu_bitexact=False,
    half_native=("winograd",),  # bf16 / fp16: tree's tensor-core kernels
)
