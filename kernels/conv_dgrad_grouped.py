"""conv_dgrad_grouped: data gradient of a grouped 2-D convolution (depthwise included). CUDA launchers for
``conv_dgrad_grouped.cu`` and their CPU order models (Numba, bit for bit).

    conv_dgrad_grouped(w, dy, *, input_size=(H, W), stride=1, padding=0, dilation=1, groups=1) -> dx
    w (Cout, Cin/groups, KH, KW), dy (N, Cout, OH, OW) float32, any strides; dx (N, Cin, H, W) in dy's
    layout (channels_last when dy's channels are innermost, else NCHW).

- ``tree``: a gather. Each dx element is one thread's sum, from +0.0, over Cout/groups output channels
  ascending, then taps (kh, kw) row-major, of float32 products each rounded once (no FMA), written once.
  Deterministic without atomics or a workspace; the name keeps the registry's pair of variants (the
  order is a fixed sequential chain, not a tree), and the bits do not depend on layout or launch shape.
- ``atomic``: a scatter. Each dy element atomicAdds its Cin/groups * KH*KW products into dx (zeroed);
  where windows overlap (kernel extent > stride) or Cout/groups > 1 the products of one dx element meet
  in arrival order. For depthwise convs the op needs no atomics at all: this variant is the
  nondeterministic baseline (what a scatter implementation does), kept for symmetry and measurement.
  Model: per dx element a random order of the same products, subnormals flushed as atomicAdd does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .conv_wgrad_grouped import (
    HOSTILE,
    GroupedConv,
    _next_pow2,
    bytes_moved,
    channels_inner,
    check_groups,
    conv_params,
    flops,
    grouped_bench_cases,
    pair_of,
)
from .order import rng_of
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
)
from .shapes import GroupedGeometry, check_dgrad_output

OP = "conv_dgrad_grouped"
SOURCE = "conv_dgrad_grouped.cu"
THREADS = 256
WARPS = 8
ITEMS = 8            # positions per thread and block (chunk = P * ITEMS)
TAP_SIZES = (9, 25, 49)  # depthwise kernels keep up to this many weights in registers


@dataclass(frozen=True)
class Geometry(GroupedGeometry):
    channels_last: bool  # dy's channels innermost: dx is channels_last, lanes run along channels

    @property
    def dx_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cin, self.h, self.w)


_CHECKED: dict[tuple, Geometry] = {}


def _check(w, dy, input_size, stride, padding, dilation, groups) -> Geometry:
    return memo_check(_CHECKED, _check_all, w, dy, input_size, stride, padding, dilation, groups)


def _check_all(w, dy, input_size, stride, padding, dilation, groups) -> Geometry:
    w = check_tensor(OP, "w", w, ndim=4)
    dy = check_tensor(OP, "dy", dy, ndim=4, device=w.device)
    h, wd = pair_of("input_size", input_size, 1, OP)
    sh, sw = pair_of("stride", stride, 1, OP)
    ph, pw = pair_of("padding", padding, 0, OP)
    dh, dw = pair_of("dilation", dilation, 1, OP)
    cout, cin_g, kh, kw = w.shape
    if kh < 1 or kw < 1 or cin_g < 1:
        raise KernelArgumentError(OP, "w", f"expected a (Cout, Cin/groups >= 1, KH >= 1, KW >= 1) tensor, got {tuple(w.shape)}")
    if not isinstance(groups, (int, np.integer)) or isinstance(groups, bool) or groups < 1:
        raise KernelArgumentError(OP, "groups", f"expected an int >= 1, got {groups!r}")
    check_groups(OP, groups, cin_g * int(groups), cout)  # Cout must split into the groups
    n, oh, ow = check_dgrad_output(OP, tuple(dy.shape), cout, h, wd, kh, kw, sh, sw, ph, pw, dh, dw)
    cin = cin_g * int(groups)
    for arg, t in (("w", w), ("dy", dy)):
        span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
        if t.numel() > INT32_MAX or span > INT32_MAX:
            raise KernelArgumentError(OP, arg, f"{t.numel()} elements (offset span {span}) exceeds the supported 2^31 - 1")
    if n * cin * h * wd > INT32_MAX:
        raise KernelArgumentError(OP, "input_size", f"dx would have {n * cin * h * wd} elements; at most 2^31 - 1")
    return Geometry(n, cin, h, wd, cout, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, int(groups), channels_inner(dy))


def _empty_dx(g: Geometry, device, zero: bool) -> torch.Tensor:
    fmt = torch.channels_last if g.channels_last else torch.contiguous_format
    dx = torch.empty(g.dx_shape, dtype=torch.float32, device=device, memory_format=fmt)
    return dx.zero_() if zero else dx


def _trivial(g: Geometry) -> bool:
    return g.n * g.cin * g.h * g.w == 0 or g.cout == 0


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _cuda_prologue(w, dy, input_size, stride, padding, dilation, groups) -> Geometry:
    g = _check(w, dy, input_size, stride, padding, dilation, groups)
    check_cuda(OP, "dy", dy)
    return g


@functools.lru_cache(maxsize=1024)
def launch_plan(g: Geometry, scatter: bool) -> tuple[str, tuple[int, int, int], int, int]:
    """(kernel, grid, ct, chunk): channel tiles of ct lanes, chunks of positions (dy's for the scatter,
    dx's for the gather). Speed only: the order of every dx element's sum does not depend on it."""
    channels = g.cout if scatter else g.cin
    ct = min(32, _next_pow2(channels)) if g.channels_last else 1
    chunk = WARPS * (32 // ct) * ITEMS
    positions = g.n * (g.oh * g.ow if scatter else g.h * g.w)
    tiles = cdiv(channels, ct)
    if tiles > 65535:
        raise KernelArgumentError(OP, "w", f"{channels} channels in tiles of {ct} exceed the launch grid")
    kk = g.kh * g.kw
    depthwise = (g.cin_g if scatter else g.cout_g) == 1
    tk = next((t for t in TAP_SIZES if t >= kk), 0) if depthwise else 0
    if scatter:
        kernel = f"conv_dgrad_grouped_atomic_t{tk}"
    else:
        kernel = f"conv_dgrad_grouped_tree_t{tk}_{'s1' if g.sh == g.sw == 1 else 'sn'}"
    return kernel, (cdiv(positions, chunk), tiles, 1), ct, chunk


def _run(w, dy, g: Geometry, scatter: bool) -> torch.Tensor:
    kernel, grid, ct, chunk = launch_plan(g, scatter)
    dx = _empty_dx(g, dy.device, zero=scatter)  # the scatter adds onto +0.0; the gather writes every element
    ints = (g.n, g.cin, g.h, g.w, g.cout, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.cin_g,
            g.cout_g, *dy.stride(), *dx.stride(), *w.stride(), ct.bit_length() - 1, chunk,
            g.cout if scatter else g.cin)
    launch(function(SOURCE, kernel, dy.device), grid, (THREADS,),
           (ptr(dy), ptr(w), ptr(dx), *(np.int32(v) for v in ints)), device=dy.device)
    return dx


def conv_dgrad_grouped_tree_cuda(w, dy, *, input_size, stride=1, padding=0, dilation=1, groups=1):
    g = _cuda_prologue(w, dy, input_size, stride, padding, dilation, groups)
    if _trivial(g):
        return _empty_dx(g, dy.device, zero=True)
    return _run(w, dy, g, scatter=False)


def conv_dgrad_grouped_atomic_cuda(w, dy, *, input_size, stride=1, padding=0, dilation=1, groups=1):
    g = _cuda_prologue(w, dy, input_size, stride, padding, dilation, groups)
    if _trivial(g):
        return _empty_dx(g, dy.device, zero=True)
    return _run(w, dy, g, scatter=True)


# --------------------------------------------------------------------------------------------------
# CPU order models (Numba)


@functools.lru_cache(maxsize=None)
def _jit():
    import numba

    tiny = np.float32(np.finfo(np.float32).tiny)

    @numba.njit(cache=False)
    def ftz(v):
        return v * np.float32(0.0) if abs(v) < tiny else v

    @numba.njit(cache=False)
    def terms(w, dy, n, ci, h, x, sh, sw, ph, pw, dh, dw, cin_g, cout_g, buf):
        # The products of dx[n, ci, h, x] in the gather's order; returns their count.
        kh_, kw_ = w.shape[2], w.shape[3]
        oh_, ow_ = dy.shape[2], dy.shape[3]
        g = ci // cin_g
        cig = ci - g * cin_g
        m = 0
        for cog in range(cout_g):
            co = g * cout_g + cog
            for kh in range(kh_):
                th = h + ph - kh * dh
                if th < 0 or th % sh != 0:
                    continue
                oh = th // sh
                if oh >= oh_:
                    continue
                for kw in range(kw_):
                    tw = x + pw - kw * dw
                    if tw < 0 or tw % sw != 0:
                        continue
                    ow = tw // sw
                    if ow >= ow_:
                        continue
                    buf[m] = dy[n, co, oh, ow] * w[co, cig, kh, kw]
                    m += 1
        return m

    @numba.njit(cache=False)
    def gather(w, dy, cin, h_, w_, sh, sw, ph, pw, dh, dw, cin_g, cout_g):
        n_ = dy.shape[0]
        out = np.empty((n_, cin, h_, w_), np.float32)
        buf = np.empty(cout_g * w.shape[2] * w.shape[3], np.float32)
        for n in range(n_):
            for ci in range(cin):
                for h in range(h_):
                    for x in range(w_):
                        m = terms(w, dy, n, ci, h, x, sh, sw, ph, pw, dh, dw, cin_g, cout_g, buf)
                        acc = np.float32(0.0)
                        for j in range(m):
                            acc = acc + buf[j]
                        out[n, ci, h, x] = acc
        return out

    @numba.njit(cache=False)
    def scatter(w, dy, cin, h_, w_, sh, sw, ph, pw, dh, dw, cin_g, cout_g, seed):
        # Arrival order: the element's products in a uniformly random order (Fisher-Yates), added with
        # subnormal operands and results flushed to sign-preserving zero, from +0.0.
        np.random.seed(seed)
        n_ = dy.shape[0]
        out = np.empty((n_, cin, h_, w_), np.float32)
        buf = np.empty(cout_g * w.shape[2] * w.shape[3], np.float32)
        for n in range(n_):
            for ci in range(cin):
                for h in range(h_):
                    for x in range(w_):
                        m = terms(w, dy, n, ci, h, x, sh, sw, ph, pw, dh, dw, cin_g, cout_g, buf)
                        for j in range(m - 1, 0, -1):
                            r = int(np.random.random() * (j + 1))
                            if r > j:
                                r = j
                            buf[j], buf[r] = buf[r], buf[j]
                        acc = np.float32(0.0)
                        for j in range(m):
                            acc = ftz(acc + ftz(buf[j]))
                        out[n, ci, h, x] = acc
        return out

    return gather, scatter


def _cpu_prologue(w, dy, input_size, stride, padding, dilation, groups) -> Geometry:
    g = _check(w, dy, input_size, stride, padding, dilation, groups)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs CPU tensors, got one on {dy.device}")
    return g


def _in_layout(dx: np.ndarray, g: Geometry) -> torch.Tensor:
    t = torch.from_numpy(dx)
    return t.contiguous(memory_format=torch.channels_last) if g.channels_last else t


def _model_args(w, dy, g: Geometry) -> tuple:
    return (w.detach().contiguous().numpy(), dy.detach().contiguous().numpy(), g.cin, g.h, g.w, g.sh, g.sw,
            g.ph, g.pw, g.dh, g.dw, g.cin_g, g.cout_g)


def conv_dgrad_grouped_tree_cpu(w, dy, *, input_size, stride=1, padding=0, dilation=1, groups=1, rng=None):
    g = _cpu_prologue(w, dy, input_size, stride, padding, dilation, groups)
    if _trivial(g):
        return _empty_dx(g, "cpu", zero=True)
    return _in_layout(_jit()[0](*_model_args(w, dy, g)), g)


def conv_dgrad_grouped_atomic_cpu(w, dy, *, input_size, stride=1, padding=0, dilation=1, groups=1, rng=None):
    g = _cpu_prologue(w, dy, input_size, stride, padding, dilation, groups)
    if _trivial(g):
        return _empty_dx(g, "cpu", zero=True)
    seed = int(rng_of(rng).integers(0, 2**31 - 1))
    return _in_layout(_jit()[1](*_model_args(w, dy, g), seed), g)


# --------------------------------------------------------------------------------------------------
# Op spec


def _kwargs(p: dict) -> dict:
    _, _, s, pad, d, _, _ = conv_params(p)
    return {"input_size": (p["h"], p["w"]), "stride": s, "padding": pad, "dilation": d, "groups": p["groups"]}


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    kh, kw, _, _, _, oh, ow = conv_params(p)
    gen = torch.Generator().manual_seed(case.seed)
    cin_g = p["cin"] // p["groups"]
    w = torch.randn((p["cout"], cin_g, kh, kw), generator=gen) / float(np.sqrt(cin_g * kh * kw))
    dy = torch.randn((p["n"], p["cout"], oh, ow), generator=gen)
    if p.get("layout", "nchw") == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    return (w.to(device), dy.to(device)), _kwargs(p)


def torch_dgrad(w, dy, *, input_size, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
    """aten convolution_backward with only the input gradient asked for (the caller sets cuDNN flags)."""
    size = (dy.shape[0], w.shape[1] * groups, *input_size)
    return torch.nn.grad.conv2d_input(size, w, dy, stride, padding, dilation, groups)


def _torch_dgrad_default(w, dy, **kw) -> torch.Tensor:
    """cuDNN with its default heuristics (``cudnn.benchmark`` off), deterministic mode off."""
    with cudnn_default_heuristics():
        return torch_dgrad(w, dy, **kw)


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    w, dy = (a.detach().to("cpu", torch.float64) for a in args)
    return torch_dgrad(w, dy, **kwargs)


def taps_per_element(p: dict) -> int:
    """Most products that can meet in one dx element: Cout/groups times the taps that can overlap."""
    kh, kw, (sh, sw), _, (dh, dw), _, _ = conv_params(p)
    per = lambda k, s, d: cdiv(k, s // np.gcd(s, d))  # noqa: E731
    return (p["cout"] // p["groups"]) * per(kh, sh, dh) * per(kw, sw, dw)


def _case(layer: GroupedConv, seed: int, layout: str = "nchw", suffix: str = "") -> Case:
    params = {**layer.params(), "layout": layout}
    tag = "" if layout == "nchw" else "_cl"
    return Case(OP, f"{layer.name}{tag}{suffix}", params, seed=seed, contention=float(taps_per_element(params)))


def _test_cases() -> list[Case]:
    cases = [_case(layer, 6000 + i) for i, layer in enumerate(HOSTILE)]
    cases += [_case(layer, 6100 + i, "channels_last") for i, layer in enumerate(HOSTILE)]
    return cases


def _bench_cases(scale: str) -> list[Case]:
    return grouped_bench_cases(_case, scale, 6000)


define_op(
    OP,
    variants=[
        ("atomic", False, False, conv_dgrad_grouped_atomic_cuda, conv_dgrad_grouped_atomic_cpu,
         "scatter: each dy element's products atomicAdd-ed into dx in arrival order (for depthwise only "
         "a baseline: the gather needs no atomics)"),
        ("tree", True, False, conv_dgrad_grouped_tree_cuda, conv_dgrad_grouped_tree_cpu,
         "gather: one thread per dx element, products in (cog, kh, kw) order, written once; no atomics"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=lambda: {"torch": torch_dgrad, "cudnn_default": _torch_dgrad_default},
    bytes_moved=bytes_moved,
    flops=flops,
)
