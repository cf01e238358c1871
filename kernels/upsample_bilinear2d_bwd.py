"""upsample_bilinear2d_bwd: backward of ``F.interpolate(x, (OH, OW), mode="bilinear", align_corners=...)``.
CUDA launchers for ``upsample_bilinear2d_bwd.cu`` and their CPU order models.

    dx = upsample_bilinear2d_bwd(dy, input_size=(H, W), align_corners=False)

``dy`` (N, C, OH, OW) float32; ``dx`` (N, C, H, W) float32 in dy's layout (NCHW or channels_last; a
non-contiguous dy is first copied to the layout its strides suggest). The output-size form only (no
explicit scale factors).

Weights: aten's, in float32 as its CUDA kernel computes them (see the header of the .cu file): per axis
i0, i1 = i0 + (i0 < in - 1), l1 = r - i0, l0 = 1 - l1 from the source index r; dy[oh, ow] = d sends
(l0h * l0w) * d, (l0h * l1w) * d, (l1h * l0w) * d, (l1h * l1w) * d to (i0h, i0w), (i0h, i1w), (i1h, i0w),
(i1h, i1w), in that order: the products torch's CUDA backward atomically adds. Without align_corners the
source index is one FMA, ``fma(scale, o + 0.5, -0.5)``, as nvcc compiles torch's ``scale * (o + 0.5) -
0.5``; the CPU model computes it exactly (the float product is exact in double). Same sizes: dx = dy
(torch copies then too).

Order of the additions into one dx element:
- ``tree``: the dy elements that touch it in (oh, ow) row-major order, each one's products in the
  order above, from +0.0. torch's CPU backward scatters in the same order (planes, then rows, then
  columns, four products each), but derives its weights differently (no FMA; the same index when an
  axis keeps its size), so equal bits are claimed only against torch's CUDA kernel, on elements whose
  sum cannot depend on the order (at most two products), and tested there on the GPU.
- ``atomic``: arrival order of the atomicAdds from +0.0; with up to two products per element (e.g.
  downsampling by an integer factor) the sum does not depend on it, with three or more it can.

Zero weights still send their (zero) product, as in torch, so an Inf or NaN gradient spreads NaN
(0 * Inf) to the neighbours it touches with weight 0. A -0.0 gradient gives +0.0. Subnormals: float
atomicAdd flushes subnormal operands and results to sign-preserving zero, and the atomic model does too.

torch's CUDA backward raises under ``torch.use_deterministic_algorithms(True)``; ``F.interpolate`` then
runs a decomposition instead (gathers and a lerp forward, whose backward is ``index_put_`` with
accumulate: deterministic, sort-based, different arithmetic).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .adaptive_avg_pool2d_bwd import dx_tensor, make_dy, memory_format, size_pair, suggest_layout
from .order import F32, arrival_sum
from .registry import Case, define_op
from .runtime import (
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

OP = "upsample_bilinear2d_bwd"
SOURCE = "upsample_bilinear2d_bwd.cu"
THREADS = 256
MAX_BLOCKS = 2**31 - 1
SMEM_LIMIT = 48 * 1024
NEG_ZERO = F32(-0.0)  # x + (-0.0) == x for every x: the neutral padding of a masked addition


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


def _check_all(dy, input_size, align_corners):
    dy = check_tensor(OP, "dy", dy, ndim=4)
    if dy.numel() == 0:
        raise KernelArgumentError(OP, "dy", f"expected a non-empty tensor, got shape {tuple(dy.shape)}")
    if not isinstance(align_corners, bool):
        raise KernelArgumentError(OP, "align_corners", f"expected a bool, got {align_corners!r}")
    h, w = size_pair(OP, input_size)
    n, c, oh, ow = dy.shape
    if max(h, w, oh, ow) >= 2**23:  # o + 0.5 and the source index must be exact in float32
        raise KernelArgumentError(OP, "input_size", f"sizes must be below 2^23, got {(h, w)} -> {(oh, ow)}")
    check_size(OP, "dy", dy)
    if n * c * h * w > 2**40:
        raise KernelArgumentError(OP, "input_size", f"dx would have {n * c * h * w} elements; at most 2^40")
    return h, w


_CHECKED: dict = {}


def _check(dy, input_size, align_corners):
    h, w = memo_check(_CHECKED, _check_all, dy, tuple(input_size) if isinstance(input_size, list) else input_size,
                      align_corners)
    layout = suggest_layout(dy)
    return dy.contiguous(memory_format=memory_format(layout)), (h, w), layout


# --------------------------------------------------------------------------------------------------
# Weights (aten's area_pixel_compute_scale / area_pixel_compute_source_index in float32)


def scale_of(size: int, out: int, align_corners: bool) -> np.float32:
    if align_corners:
        return F32(size - 1) / F32(out - 1) if out > 1 else F32(0.0)
    return F32(size) / F32(out)


@functools.lru_cache(maxsize=256)
def taps(size: int, out: int, align_corners: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(i0, i1, l0, l1) of every output index along one axis, bit for bit as the kernels compute them."""
    s = scale_of(size, out, align_corners)
    o = np.arange(out)
    if align_corners:
        r = s * o.astype(F32)
    else:
        # fma(s, o + 0.5, -0.5): the float32 product is exact in double, and so is the difference
        # wherever it is >= 0 (at most 49 significant bits); below 0 only the sign matters (clamped).
        r = (np.float64(s) * (o.astype(F32) + F32(0.5)).astype(np.float64) - 0.5).astype(F32)
        r = np.where(r < 0, F32(0.0), r).astype(F32)
    i0 = r.astype(np.int64)  # truncation, r >= 0
    assert i0.max() <= size - 1, (size, out, align_corners)
    i1 = i0 + (i0 < size - 1)
    l1 = (r - i0.astype(F32)).astype(F32)
    l0 = (F32(1.0) - l1).astype(F32)
    return i0, i1, l0, l1


@functools.lru_cache(maxsize=256)
def gather_table(size: int, out: int, align_corners: bool):
    """For every input position p along one axis: the outputs touching it in increasing order, padded
    to m slots (``outs`` (size, m), ``valid``), and which of their two taps reach p (``hit`` (size, m, 2)),
    with the weights (``weight`` (size, m, 2))."""
    i0, i1, l0, l1 = taps(size, out, align_corners)
    lists = [np.nonzero((i0 == p) | (i1 == p))[0] for p in range(size)]
    m = max(1, max(len(x) for x in lists))
    outs = np.zeros((size, m), dtype=np.int64)
    valid = np.zeros((size, m), dtype=bool)
    for p, x in enumerate(lists):
        outs[p, :len(x)] = x
        valid[p, :len(x)] = True
    p = np.arange(size)[:, None]
    hit = np.stack([valid & (i0[outs] == p), valid & (i1[outs] == p)], axis=-1)
    weight = np.stack([l0[outs], l1[outs]], axis=-1).astype(F32)
    return outs, valid, hit, weight


def products(dy: torch.Tensor, h: int, w: int, align_corners: bool) -> np.ndarray:
    """Every dx element's products in tree's order ((oh, ow) row-major, then the four taps in torch's
    order), -0.0 in empty slots: (N, C, H, W, mh * mw * 4) float32, NCHW."""
    d = dy.detach().cpu().contiguous().numpy().astype(F32)
    _, _, oh, ow = d.shape
    ro, _, rhit, rw = gather_table(h, oh, align_corners)
    co, _, chit, cw = gather_table(w, ow, align_corners)
    vals = d[:, :, ro[:, :, None, None], co[None, None, :, :]]           # (N, C, H, mh, W, mw)
    out = []
    for j in range(ro.shape[1]):
        for i in range(co.shape[1]):
            dd = vals[:, :, :, j, :, i]                                    # (N, C, H, W)
            for a in (0, 1):
                for b in (0, 1):
                    wgt = (rw[:, j, a][:, None] * cw[:, i, b][None, :]).astype(F32)  # l_h * l_w, rounded
                    mask = rhit[:, j, a][:, None] & chit[:, i, b][None, :]
                    out.append(np.where(mask, (wgt * dd).astype(F32), NEG_ZERO))
    return np.stack(out, axis=-1).astype(F32)


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _scale_bits(size: int, out: int, align_corners: bool) -> np.int32:
    return np.array([scale_of(size, out, align_corners)], dtype=F32).view(np.int32)[0]


BLOCKS_PER_SM = 8  # 2048 resident threads per SM / 256: the tabled kernel's blocks loop over dx


@functools.lru_cache(maxsize=1024)
def tabled_plan(h: int, w: int, oh: int, ow: int, align_corners: bool):
    """(KH, KW, shared bytes) of the tabled tree kernel, or None where its tables exceed shared memory
    (the direct kernel runs). K per axis: the most outputs touching one input position, i.e. the
    largest count(i0 == p - 1) + count(i0 == p) (the outputs with i0 == p - 1 reach p through i1)."""
    ks = []
    for size, out in ((h, oh), (w, ow)):
        cnt = np.bincount(taps(size, out, align_corners)[0], minlength=size)
        ks.append(max(1, int((cnt + np.concatenate(([0], cnt[:-1]))).max())))
    smem = 64 + 8 * (h + w) + 4 * (ks[0] * h + ks[1] * w) + 8  # FastDiv[3] padded, ranges, weights, last
    return (ks[0], ks[1], smem) if smem <= SMEM_LIMIT else None


def _launch(kind: str, dy, input_size, align_corners, generic: bool = False) -> torch.Tensor:
    """``generic``: the general tabled kernel even where the one-tap kernel applies (same bits; tests)."""
    dy, (h, w), layout = _check(dy, input_size, align_corners)
    check_cuda(OP, "dy", dy)
    n, c, oh, ow = dy.shape
    if (oh, ow) == (h, w):
        return dy.clone(memory_format=memory_format(layout))  # torch copies when the sizes agree
    dx = torch.empty((n, c, h, w), device=dy.device, dtype=torch.float32, memory_format=memory_format(layout))
    i32 = np.int32
    args = (ptr(dy), ptr(dx), np.int64(dy.numel() if kind == "atomic" else dx.numel()), i32(c), i32(h), i32(w),
            i32(oh), i32(ow), i32(align_corners), _scale_bits(h, oh, align_corners),
            _scale_bits(w, ow, align_corners), i32(layout == "channels_last"))
    total = int(args[2])
    blocks = max(1, min(cdiv(total, THREADS), MAX_BLOCKS))
    plan = tabled_plan(h, w, oh, ow, bool(align_corners)) if kind == "tree" else None
    if plan is not None:
        kh, kw, smem = plan
        blocks = max(1, min(blocks, BLOCKS_PER_SM * sm_count(dy.device)))  # tables built once per block
        name = "upsample_bilinear2d_bwd_tree_tabled" + ("1" if kh == kw == 1 and not generic else "")
        launch(function(SOURCE, name, dy.device), (blocks,), (THREADS,),
               args + (i32(kh), i32(kw)), device=dy.device, shared_mem=smem)
        return dx
    if kind == "atomic":
        dx.zero_()  # the atomics add onto +0.0
    name = "upsample_bilinear2d_bwd_atomic" if kind == "atomic" else "upsample_bilinear2d_bwd_tree_direct"
    launch(function(SOURCE, name, dy.device), (blocks,), (THREADS,), args, device=dy.device)
    return dx


def upsample_bilinear2d_bwd_atomic_cuda(dy, *, input_size, align_corners=False) -> torch.Tensor:
    return _launch("atomic", dy, input_size, align_corners)


def upsample_bilinear2d_bwd_tree_cuda(dy, *, input_size, align_corners=False) -> torch.Tensor:
    return _launch("tree", dy, input_size, align_corners)


def upsample_bilinear2d_bwd_tree_generic_cuda(dy, *, input_size, align_corners=False) -> torch.Tensor:
    """tree through the general tabled kernel even where every position takes one dy element per axis
    (where tree runs _tabled1); for tests. Same bits."""
    return _launch("tree", dy, input_size, align_corners, generic=True)


def upsample_bilinear2d_bwd_tree_direct_cuda(dy, *, input_size, align_corners=False) -> torch.Tensor:
    """tree's direct kernel whatever the shape (what tree runs where the tables exceed shared memory):
    weights computed per product; for tests and timing beside the tabled kernel. Same bits."""
    return _launch("tree_direct", dy, input_size, align_corners)


# --------------------------------------------------------------------------------------------------
# CPU order models


def _cpu_prologue(dy, input_size, align_corners):
    dy, (h, w), layout = _check(dy, input_size, align_corners)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs a CPU tensor, got one on {dy.device}")
    return dy, h, w, layout


def upsample_bilinear2d_bwd_tree_cpu(dy, *, input_size, align_corners=False, rng=None) -> torch.Tensor:
    dy, h, w, layout = _cpu_prologue(dy, input_size, align_corners)
    if tuple(dy.shape[2:]) == (h, w):
        return dy.clone(memory_format=memory_format(layout))
    parts = products(dy, h, w, align_corners)
    acc = np.zeros(parts.shape[:-1], dtype=F32)
    for k in range(parts.shape[-1]):  # +0.0, then each product in tree's order
        acc = acc + parts[..., k]
    return dx_tensor(acc, layout)


def upsample_bilinear2d_bwd_atomic_cpu(dy, *, input_size, align_corners=False, rng=None) -> torch.Tensor:
    dy, h, w, layout = _cpu_prologue(dy, input_size, align_corners)
    if tuple(dy.shape[2:]) == (h, w):
        return dy.clone(memory_format=memory_format(layout))
    return dx_tensor(arrival_sum(products(dy, h, w, align_corners), rng), layout)


# --------------------------------------------------------------------------------------------------
# Helpers for tests and benchmarks: float64 reference, per-element counts and error bound


def _scatter64(d: np.ndarray, h: int, w: int, align_corners: bool) -> np.ndarray:
    """sum of l_h * l_w * d in float64 (with the op's float32 weights)."""
    _, _, oh, ow = d.shape
    i0h, i1h, l0h, l1h = taps(h, oh, align_corners)
    i0w, i1w, l0w, l1w = taps(w, ow, align_corners)
    out = np.zeros(d.shape[:2] + (h, w))
    with np.errstate(invalid="ignore"):  # 0 * Inf = NaN is a result here, as in torch
        _scatter_into(out, d, h, w, ((i0h, l0h), (i1h, l1h)), ((i0w, l0w), (i1w, l1w)))
    return out


def _scatter_into(out, d, h, w, hs, ws):
    for ih, lh in hs:
        for iw, lw in ws:
            wgt = lh.astype(np.float64)[:, None] * lw.astype(np.float64)[None, :]
            tgt = (ih[:, None] * w + iw[None, :]).reshape(-1)
            vals = (wgt[None, None] * d).reshape(d.shape[0], d.shape[1], -1)
            flat = out.reshape(d.shape[0], d.shape[1], -1)
            for k in range(flat.shape[0]):
                for c in range(flat.shape[1]):
                    flat[k, c] += np.bincount(tgt, weights=vals[k, c], minlength=h * w)


def reference(dy: torch.Tensor, *, input_size, align_corners=False) -> torch.Tensor:
    """Exact dx in float64 (NCHW) for the op's float32 weights; dy itself where the sizes agree."""
    h, w = size_pair(OP, input_size)
    d = dy.detach().cpu().double().contiguous().numpy()
    if d.shape[2:] == (h, w):
        return torch.from_numpy(d.copy())
    return torch.from_numpy(_scatter64(d, h, w, align_corners))


def counts(h: int, w: int, oh: int, ow: int, align_corners: bool) -> np.ndarray:
    """(H, W): how many products each element receives (zero-weight ones included)."""
    if (oh, ow) == (h, w):
        return np.ones((h, w), dtype=np.int64)
    _, _, rhit, _ = gather_table(h, oh, align_corners)
    _, _, chit, _ = gather_table(w, ow, align_corners)
    return rhit.sum((1, 2))[:, None] * chit.sum((1, 2))[None, :]


def error_bound(dy: torch.Tensor, h: int, w: int, align_corners: bool) -> np.ndarray:
    """(N, C, H, W) bound on |float32 dx - exact|: each of k products is rounded twice ((l_h * l_w),
    then * d) and passes through at most k - 1 additions: gamma(k + 1) * sum |exact product|."""
    _, _, oh, ow = dy.shape
    k = counts(h, w, oh, ow, align_corners).astype(np.float64)
    u = 2.0**-24
    gam = (k + 1) * u / (1 - (k + 1) * u)
    # Below 2^-126 a rounding is off by up to half the smallest subnormal, 2^-150, whatever the
    # magnitude: one such term per rounding (2 per contribution, 1 per addition).
    return (2 * k + 1) * 2.0**-150 + gam * reference(dy.abs(), input_size=(h, w), align_corners=align_corners).numpy()


# --------------------------------------------------------------------------------------------------
# torch's own backward (the peers)


def torch_backward(dy, *, input_size, align_corners=False) -> torch.Tensor:
    """aten's ``upsample_bilinear2d_backward`` (what autograd of the aten forward calls)."""
    h, w = size_pair(OP, input_size)
    n, c, oh, ow = dy.shape
    return torch.ops.aten.upsample_bilinear2d_backward(dy, [oh, ow], [n, c, h, w], align_corners, None, None)


_GRAPHS: dict = {}


def torch_autograd_backward(dy, *, input_size, align_corners=False) -> torch.Tensor:
    """The backward of ``F.interpolate(..., mode="bilinear")`` through autograd, on a graph built once
    per shape, layout and deterministic mode (the forward is not timed). In deterministic mode on a GPU
    F.interpolate takes its decomposition, whose backward is ``index_put_`` with accumulate."""
    h, w = size_pair(OP, input_size)
    key = (tuple(dy.shape), suggest_layout(dy), dy.device, h, w, align_corners,
           torch.are_deterministic_algorithms_enabled())
    graph = _GRAPHS.get(key)
    if graph is None:
        if len(_GRAPHS) >= 4:
            _GRAPHS.clear()
        x = torch.empty((dy.shape[0], dy.shape[1], h, w), device=dy.device, dtype=dy.dtype,
                        memory_format=memory_format(suggest_layout(dy))).zero_().requires_grad_(True)
        with torch.enable_grad():
            y = torch.nn.functional.interpolate(x, size=tuple(dy.shape[2:]), mode="bilinear",
                                                align_corners=align_corners)
        graph = _GRAPHS[key] = (x, y)
    x, y = graph
    return torch.autograd.grad(y, x, dy, retain_graph=True)[0]


def _peers() -> dict:
    return {"torch": torch_backward, "torch_autograd": torch_autograd_backward}


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, reference, cases

def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    return (make_dy(p, case.seed, device),), {"input_size": (p["h"], p["w"]), "align_corners": p["align_corners"]}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    return reference(*args, **kwargs)


def _case(name, n, c, h, w, oh, ow, align_corners, seed, layout="nchw", **extra) -> Case:
    params = {"n": n, "c": c, "h": h, "w": w, "oh": oh, "ow": ow, "align_corners": align_corners,
              "layout": layout, **extra}
    return Case(OP, name, params, seed=seed, contention=float(counts(h, w, oh, ow, align_corners).mean()))


def _test_cases() -> list[Case]:
    rows = [
        # name, n, c, h, w, oh, ow, extra
        ("x2_8to16", 2, 3, 8, 8, 16, 16, {}),
        ("x8_4x5to32x40", 2, 3, 4, 5, 32, 40, {}),
        ("odd_7x9to19x13", 2, 3, 7, 9, 19, 13, {}),
        ("down_20x18to7x6", 2, 3, 20, 18, 7, 6, {}),       # downsampling, non-integer ratios
        ("down_int_16to8", 2, 3, 16, 8, 8, 4, {}),          # every element touched by one dy element
        ("in_1x1_to_5x4", 2, 3, 1, 1, 5, 4, {}),            # 1x1 input: every product lands on it
        ("out_1x1_from_6x5", 2, 3, 6, 5, 1, 1, {}),         # 1x1 output
        ("same_6x7", 1, 3, 6, 7, 6, 7, {}),                 # sizes agree: a copy, as in torch
        ("one_axis_same_6x5to6x11", 2, 3, 6, 5, 6, 11, {}),
        ("special_5to12", 2, 3, 5, 5, 12, 12, {"special": True}),
    ]
    cases, seed = [], 7000
    for name, n, c, h, w, oh, ow, extra in rows:
        for ac in (False, True):
            for layout in ("nchw", "channels_last"):
                if extra.get("special") and layout == "channels_last":
                    continue
                cases.append(_case(f"{name}_ac{int(ac)}_{layout}", n, c, h, w, oh, ow, ac, seed, layout, **extra))
                seed += 1
    cases.append(_case("noncontig_6to13_ac0", 2, 3, 6, 6, 13, 13, False, seed, noncontig=True))
    return cases


def _bench_cases(scale: str) -> list[Case]:
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    # segmentation decoders at batch 8: features upsampled x2 and x4, logits (21 classes) x8 to 512 px
    rows = [
        # name, c, h, out, align_corners, layouts
        ("x2_64to128_c256", 256, 64, 128, False, ("nchw", "channels_last")),
        ("x2_64to128_c256", 256, 64, 128, True, ("nchw",)),
        ("x4_128to512_c64", 64, 128, 512, False, ("nchw",)),
        ("x4_128to512_c64", 64, 128, 512, True, ("nchw",)),
        ("x8_64to512_c21", 21, 64, 512, False, ("nchw", "channels_last")),
        ("x8_64to512_c21", 21, 64, 512, True, ("nchw",)),
        ("down_256to96_c64", 64, 256, 96, False, ("nchw",)),
    ]
    if scale == "quick":
        rows = [rows[0], rows[4], rows[6]]
    n = 8 if scale != "cpu" else 1
    cases, seed = [], 950
    for name, c, size, out, ac, layouts in rows:
        if scale == "cpu":  # the same ratios on small maps
            c, size, out = 4, max(2, size // 16), max(2, out // 16)
        for layout in layouts:
            cases.append(_case(f"{name}_ac{int(ac)}_b{n}_{layout}", n, c, size, size, out, out, ac, seed, layout))
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
        ("atomic", False, False, upsample_bilinear2d_bwd_atomic_cuda, upsample_bilinear2d_bwd_atomic_cpu,
         "one thread per dy element; its four weighted products atomicAdd-ed into dx (as torch's CUDA backward)"),
        ("tree", True, False, upsample_bilinear2d_bwd_tree_cuda, upsample_bilinear2d_bwd_tree_cpu,
         "one thread per dx element; the dy elements touching it in (oh, ow) row-major order, each one's "
         "products in torch's order, from +0.0; per-axis ranges and weights tabled in shared memory"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
)
