"""conv_dgrad ``winograd``: the data gradient of 3x3 stride-1 convolutions by Winograd F(2x2, 3x3), its
transforms fused into one GEMM kernel (deterministic: each dx element is one fixed expression, no split
of the reduction). CUDA launchers for ``conv_dgrad_winograd.cu`` and the CPU order model; the algorithm and
the exact order of its arithmetic are described at the top of the .cu file.

    dx = conv_dgrad winograd(w, dy, *, input_size, stride=1, padding=0, dilation=1)

Shapes it does not cover (any kernel other than 3x3, stride or dilation other than 1, padding above 2,
fewer than MIN_CHANNELS channels on either side, a GPU without ``cp.async``, below compute capability
8.0) run ``tree``'s float32 implicit GEMM, bits included, so the variant is a drop-in for every conv the
harness routes. The kernels take float32: bf16/fp16 calls on CUDA run ``tree``'s tensor-core kernels
(conv_mma.py), with its bits, on covered and uncovered shapes alike (the CPU model, like every CPU model,
takes them widened to float32).

Why: a 3x3 stride-1 data gradient is a dense GEMM of K = 9 * Cout per dx element, which cuDNN computes by
Winograd (deterministically: it splits no reduction) at 2.25x fewer multiply-adds than the direct sum.
The ``tree`` implicit GEMM pays all 36 products per 2x2 outputs, and on torchvision resnet18 at 224 px
those shapes are most of the backward pass (reports/kernels.md, per-shape tables).

The CPU model keeps the transforms' order bit for bit and computes the 16 GEMMs with a float32 BLAS (not
the GPU's FFMA chain), so it is not CPU bit-exact; :func:`magnitude` and :func:`rounding_depth` give the
error bound the tests check both against.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from . import conv_dgrad as direct
from . import conv_wgrad_winograd as wgrad_wino
from .conv_dgrad import OP, Geometry
from .order import F32
from .registry import HALF_DTYPES, define_op
from .runtime import INT32_MAX, SLOT, KernelArgumentError, Launch, cdiv, function

SOURCE = "conv_dgrad_winograd.cu"
THREADS = 256
XI = 16              # transform positions: 4 x 4
TILES, OUT = 32, 32  # 2x2 tiles and output channels per block (WD_TILES, WD_OUT)
SMEM = 4 * (16 * 8 * 36 + 2 * 16 * 8 * 32)   # dynamic shared memory of the fused kernels (WD_SMEM floats)
MAX_PADDING = 2      # the correlation's padding 2 - p must be >= 0

# Fewest channels on either side: the GEMMs are (Cin x Cout) per tile block, so a handful of channels
# wastes most of a 32-wide block while the transforms still cost their traffic (the direct kernel's stem
# path serves Cin <= 4).
MIN_CHANNELS = 16


def applies(g: Geometry) -> bool:
    """3x3, stride 1, dilation 1, padding <= 2, at least MIN_CHANNELS channels in and out, offsets that
    the kernel's 32-bit spatial arithmetic holds: the shapes this F(2x2, 3x3) path serves."""
    if (g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) != (3, 3, 1, 1, 1, 1) or max(g.ph, g.pw) > MAX_PADDING:
        return False
    # the largest per-image offset: (rows + 4) * row stride, the same for dx (NCHW or channels_last); the
    # grid's y dimension counts blocks of OUT dx channels
    span = (g.h + 4) * (g.w + 4) * max(g.cin, g.cout)
    return min(g.cin, g.cout) >= MIN_CHANNELS and span <= INT32_MAX and cdiv(g.cin, OUT) <= 65535


def tiles(g: Geometry) -> tuple[int, int, int]:
    """(tile rows, tile columns, T): 2x2 dx tiles per image, and over the batch."""
    tp, tq = cdiv(g.h, 2), cdiv(g.w, 2)
    return tp, tq, g.n * tp * tq


def _padded_out(g: Geometry) -> int:
    """Kp: dx channels rounded up to a block's OUT (U holds zeros past Cin)."""
    return cdiv(g.cin, OUT) * OUT


# --------------------------------------------------------------------------------------------------
# CUDA


def _covered(g: Geometry, dev: torch.device) -> bool:
    return not direct._trivial(g) and applies(g) and torch.cuda.get_device_capability(dev)[0] >= 8


def prepare_winograd(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> Callable:
    """``run(w, dy) -> dx`` (float32, dy's layout) for calls with the signature of these w and dy and these
    arguments (planned and its launches configured once); ``tree``'s where the shape is not covered, and
    for bf16/fp16 calls (tree's tensor-core kernels, its bits)."""
    if w.dtype in HALF_DTYPES or dy.dtype in HALF_DTYPES:
        return direct.prepare_tree(w, dy, input_size=input_size, stride=stride, padding=padding, dilation=dilation)
    g = direct._cuda_prologue(w, dy, input_size, stride, padding, dilation)
    if not _covered(g, dy.device):
        return direct.prepare_tree(w, dy, input_size=input_size, stride=stride, padding=padding, dilation=dilation)
    sw = w.stride()   # w: (Cout, Cin, 3, 3) = (c, k, r, s) of the correlation, flipped
    return _prepared(g, dy, (sw[1], sw[0], sw[2], sw[3]), flip=True)


def _prepared(g: Geometry, dy: torch.Tensor, w_strides: tuple[int, int, int, int], flip: bool) -> Callable:
    """The two launches of a covered call: the filter transform reading the correlation's g[k, c] at
    ``w_strides`` (k, c, r, s), spatially flipped or not, then the fused kernel."""
    dev = dy.device
    tp, tq, t = tiles(g)
    kp = _padded_out(g)
    i32, i64 = np.int32, np.int64
    swk, swc, swr, sws = w_strides
    # a size-1 dim is only ever read at index 0: its stride (any value torch allows there) is not passed on,
    # so the kernel's 32-bit spatial arithmetic sees the strides ``applies`` bounded
    dy_stride = tuple(0 if n == 1 else st for n, st in zip(dy.shape, dy.stride()))
    filt = Launch.of(function(SOURCE, "wino_dgrad_filter", dev), (min(cdiv(g.cout * kp, THREADS), 65535 * 8),),
                     (THREADS,), (SLOT, SLOT, i32(g.cin), i32(g.cout), i32(kp), i64(swk), i64(swc), i64(swr),
                                  i64(sws), i32(1 if flip else 0)), device=dev)
    kernel = "wino_dgrad_cl" if g.layout == "channels_last" else "wino_dgrad_nchw"
    main = Launch.of(function(SOURCE, kernel, dev, smem=SMEM), (cdiv(t, TILES), kp // OUT), (THREADS,),
                     (SLOT, SLOT, SLOT, i32(g.cout), i32(g.cin), i32(kp), i32(g.oh), i32(g.ow), i32(g.h), i32(g.w),
                      i32(2 - g.ph), i32(2 - g.pw), i32(tp), i32(tq), i32(t), *(i64(s) for s in dy_stride),
                      *(i64(s) for s in g.dx_stride)), device=dev, shared_mem=SMEM)

    def run(w, dy):
        u = torch.empty(XI * g.cout * kp, dtype=torch.float32, device=dev)
        dx = direct._empty_dx(g, dev, zero=False)
        filt(w.data_ptr(), u.data_ptr())
        main(dy.data_ptr(), u.data_ptr(), dx.data_ptr())
        return dx
    return run


def conv_dgrad_winograd_cuda(w, dy, *, input_size, stride=1, padding=0, dilation=1) -> torch.Tensor:
    return prepare_winograd(w, dy, input_size=input_size, stride=stride, padding=padding, dilation=dilation)(w, dy)


conv_dgrad_winograd_cuda.prepare = prepare_winograd
conv_dgrad_winograd_cuda.half_as = "tree"   # its bf16/fp16 calls are tree's (the routing's tuner reads this)


# A stride-1 forward conv is a data gradient on flipped, transposed weights (kernels/conv_dgrad.py: the
# forward form). Here the filter transform reads w[k, c] in place, unflipped: the same U, so the same bits
# as the data gradient on conv_dgrad.forward_weights(w), without that copy.


def forward_applies(x: torch.Tensor, w: torch.Tensor, padding) -> bool:
    """Whether ``conv2d(x, w, padding=padding)`` (stride 1) runs the Winograd kernels here: float32, a
    shape ``applies`` takes, and on CUDA a GPU that has them; elsewhere :func:`prepare_forward` and the
    CPU model run tree's forward form."""
    return _forward_covered(x, w, padding) is not None


def _forward_covered(x: torch.Tensor, w: torch.Tensor, padding) -> Geometry | None:
    """The forward form's geometry where the Winograd kernels run it (see :func:`forward_applies`)."""
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 4 or w.dim() != 4:
        return None
    try:
        g = _forward_geometry(x, w, padding)
    except KernelArgumentError:
        return None
    covered = _covered(g, x.device) if x.is_cuda else not direct._trivial(g) and applies(g)
    return g if covered else None


def _forward_geometry(x: torch.Tensor, w: torch.Tensor, padding) -> Geometry:
    """The data gradient's geometry of the forward form, checked. Its weight is (Cin, Cout, 3, 3): a
    stand-in of that shape takes w's place in the checks (no kernel reads it; the launches read w)."""
    args = direct.forward_args(x, w, padding)
    proxy = torch.empty((w.shape[1], w.shape[0], *w.shape[2:]), dtype=w.dtype, device=w.device)
    return direct._check(proxy, x, args["input_size"], 1, args["padding"], 1)


def prepare_forward(x, w, *, padding=0) -> Callable:
    """``run(x, w) -> y = conv2d(x, w, padding=padding)`` (stride 1, no bias, float32, y in x's layout) for
    calls with the signature of these x and w; tree's forward form where :func:`forward_applies` does not
    hold (half-precision calls included: tree's tensor-core path)."""
    g = _forward_covered(x, w, padding)
    if g is None:
        return lambda x, w: direct.conv_forward_tree_cuda(x, w, padding=padding)
    sw = w.stride()   # (k, c, r, s): w's output channels are the data gradient's dx channels
    run = _prepared(g, x, (sw[0], sw[1], sw[2], sw[3]), flip=False)
    return lambda x, w: run(w, x)   # x in dy's place


def conv_forward_winograd_cuda(x, w, *, padding=0) -> torch.Tensor:
    """``conv2d(x, w, padding=padding)``, stride 1, by the Winograd data-gradient kernels (see above)."""
    return prepare_forward(x, w, padding=padding)(x, w)


# --------------------------------------------------------------------------------------------------
# CPU order model: the transforms in the kernels' order, float32, one rounding per operation (NumPy
# float32 arithmetic); the 16 GEMMs with a float32 BLAS. ``absolute``: every input and coefficient
# replaced by its absolute value (float64 for the error bound's magnitude).


def _g(e0, e1, e2, absolute: bool = False):
    """One axis of G g: e0, h((e0 + e2) + e1), h((e0 + e2) - e1), e2 with h = 0.5 (exact products)."""
    h = e0.dtype.type(0.5)
    a = e0 + e2
    return e0, h * (a + e1), h * (a + e1 if absolute else a - e1), e2


def _at(e0, e1, e2, e3, absolute: bool = False):
    """One axis of A^T m: (e0 + e1) + e2, (e1 - e2) - e3."""
    if absolute:
        return (e0 + e1) + e2, (e1 + e2) + e3
    return (e0 + e1) + e2, (e1 - e2) - e3


def filter_transform(w: torch.Tensor, *, absolute: bool = False, dtype=F32) -> np.ndarray:
    """U[xi, c, k] = (G g G^T)[xi] of g = w[c, k] flipped in both axes (first along r, then along s)."""
    wv = w.detach().cpu().to(torch.float64 if dtype == np.float64 else torch.float32)
    wt = (wv.abs() if absolute else wv).numpy()[:, :, ::-1, ::-1]       # (c, k, r, s) of the correlation
    rows = _g(wt[:, :, 0], wt[:, :, 1], wt[:, :, 2], absolute)   # 4 x (c, k, s)
    out = np.empty((4, 4, *wt.shape[:2]), dtype=dtype)
    for a in range(4):
        r = rows[a]
        for b, v in enumerate(_g(r[..., 0], r[..., 1], r[..., 2], absolute)):
            out[a, b] = v
    return out.reshape(XI, *wt.shape[:2])


def patch_transform(dy: torch.Tensor, g: Geometry, *, absolute: bool = False, dtype=F32) -> np.ndarray:
    """V[xi, c, t] = (B^T d B)[xi] of tile t's 4x4 patch of dy, rows 2P - (2 - ph) .. + 3, zeros outside
    dy: conv_wgrad winograd's input transform (the same B^T, in the same order) of dy at padding 2 - p,
    over the 2x2 tiles of dx."""
    as_input = wgrad_wino.Geometry(n=g.n, cin=g.cout, h=g.oh, w=g.ow, cout=g.cin, oh=g.h, ow=g.w, kh=3, kw=3,
                                   sh=1, sw=1, ph=2 - g.ph, pw=2 - g.pw, dh=1, dw=1)
    v = wgrad_wino.input_transform(dy, as_input, absolute=absolute, dtype=dtype)   # (xi, t, c)
    return np.ascontiguousarray(v.transpose(0, 2, 1))


def output_transform(m: np.ndarray, g: Geometry, *, absolute: bool = False) -> np.ndarray:
    """dx (n, k, h, w) from M[xi, k, t]: (A^T m A) per (k, t), first along rows, then along columns, cropped
    to dx's size."""
    tp, tq, _ = tiles(g)
    mm = m.reshape(4, 4, g.cin, g.n, tp, tq)
    r = _at(mm[0], mm[1], mm[2], mm[3], absolute)             # 2 x (4 b, k, n, tp, tq)
    y = np.empty((2, 2, g.cin, g.n, tp, tq), dtype=m.dtype)
    for i in range(2):
        for j, v in enumerate(_at(r[i][0], r[i][1], r[i][2], r[i][3], absolute)):
            y[i, j] = v
    dx = y.transpose(3, 2, 4, 0, 5, 1).reshape(g.n, g.cin, 2 * tp, 2 * tq)
    return np.ascontiguousarray(dx[:, :, :g.h, :g.w])


def _gemms(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """M[xi] = U[xi]^T V[xi], (k, t), summed over c by a BLAS of u's dtype."""
    return torch.bmm(torch.from_numpy(u).transpose(1, 2), torch.from_numpy(v)).numpy()


def conv_dgrad_winograd_cpu(w, dy, *, input_size, stride=1, padding=0, dilation=1, rng=None) -> torch.Tensor:
    g = direct._cpu_prologue(w, dy, input_size, stride, padding, dilation)
    if direct._trivial(g) or not applies(g):
        return direct.conv_dgrad_tree_cpu(w, dy, input_size=input_size, stride=stride, padding=padding,
                                          dilation=dilation)
    m = _gemms(filter_transform(w), patch_transform(dy, g))
    return direct._in_layout(torch.from_numpy(output_transform(m, g)), g)


def conv_forward_winograd_cpu(x, w, *, padding=0, rng=None) -> torch.Tensor:
    """The CPU order model of :func:`conv_forward_winograd_cuda`: the data gradient's model on the forward
    form's weights (the same U); tree's forward form where the Winograd path does not apply (float32 only)."""
    if not forward_applies(x, w, padding):
        return direct.conv_forward_tree_cpu(x, w, padding=padding)
    return conv_dgrad_winograd_cpu(direct.forward_weights(w), x, **direct.forward_args(x, w, padding))


def magnitude(w: torch.Tensor, dy: torch.Tensor, g: Geometry) -> torch.Tensor:
    """float64 |A^T| (sum_c |G||g||G^T| (.) |B^T||d||B|) |A|: the Winograd evaluation with every input and
    coefficient replaced by its absolute value. A float32 evaluation whose every path passes at most
    ``rounding_depth`` roundings is within gamma_depth times this of the exact dx
    (tests/test_conv_dgrad_winograd.py)."""
    u = filter_transform(w, absolute=True, dtype=np.float64)
    v = patch_transform(dy, g, absolute=True, dtype=np.float64)
    return torch.from_numpy(output_transform(_gemms(u, v), g, absolute=True))


def rounding_depth(g: Geometry) -> int:
    """Most roundings on any path of the float32 evaluation: 4 (U: two per axis; the halvings are exact)
    + 2 (V) + Cout (the product and the accumulation over c) + 4 (output transform)."""
    return 4 + 2 + g.cout + 4


# conv_dgrad's spec is in conv_dgrad.py; this adds a variant to it.
define_op(
    OP,
    variants=[
        ("winograd", True, False, conv_dgrad_winograd_cuda, conv_dgrad_winograd_cpu,
         "3x3 stride 1, >= 16 channels: Winograd F(2x2,3x3) with its transforms fused into one GEMM kernel, "
         "each dx element one FFMA chain over Cout per transform position; other shapes run tree. FFMA, so "
         "not CPU bit-exact (the model keeps the transforms' order)"),
    ],
    cpu_bitexact=False,
    half_native=("winograd",),  # bf16 / fp16: tree's tensor-core kernels
)
