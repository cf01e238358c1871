"""bn_bwd: BatchNorm backward in training mode, fused. CUDA launchers for ``bn_bwd.cu`` and CPU order models.

    dx, dgamma, dbeta = kernels.get("bn_bwd", "tree")(dy, x, mean, invstd, weight)

dy, x: float32 (N, C, H, W) in NCHW or channels_last (dy is brought to x's layout), or (N, C). The CUDA
launchers also take bf16/fp16 dy and x (autocast's BatchNorm: read as half, float32 sums, dx written in x's
dtype; dgamma and dbeta in weight's dtype, float32 without a weight), with the bits of the float32 kernels on
the widened tensors rounded once (the registry's half-precision call, which the CPU models take). mean, invstd:
the saved batch statistics (C,) (invstd = 1 / sqrt(var + eps)); weight: (C,) or None (ones). With M values
per channel and xhat = (x - mean) * invstd:

    dbeta = sum(dy),  dgamma = sum(dy * xhat),  dx = (weight * invstd) * ((dy - dbeta / M) - xhat * (dgamma / M))

dx comes back in x's layout, dgamma and dbeta as (C,) (dgamma also when weight is None). One reduction kernel
forms both sums in one pass over dy and x, with bias_grad's block split (``nchw_plan`` / ``rows_plan``: the
shape and layout alone fix it); one elementwise kernel writes dx. Every float operation in the kernels is a
round-to-nearest intrinsic that is never contracted into FMA, and the CPU models replay the same float32
operations in the same order, so the ``tree`` variant's bits equal its model's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .bias_grad import THREADS, nchw_plan, rows_plan
from .order import F32, arrival_sum, block_tree, halving32_jit, halving_tree, pad_to, seq_sum, strided_reduce
from . import registry
from .registry import Case, define_op
from .runtime import (
    INT32_MAX,
    MEMO_LIMIT,
    KernelArgumentError,
    act_defines,
    cdiv,
    check_cuda,
    check_key,
    memo_check,
    check_size,
    check_tensor,
    SLOT,
    Launch,
    function,
    layout_of,
    ticket_counters,
)

OP = "bn_bwd"
SOURCE = "bn_bwd.cu"
MAX_GRID_Y = 65535
DX_ROWS = 8                # rows layout: rows of dx per thread (a block covers TY * DX_ROWS rows)
MAX_DX_BLOCKS = 1 << 20    # NCHW dx: grid-stride past this many blocks (the bits never depend on it)
EPS = 1e-5                 # the variance epsilon of the test and benchmark inputs


# --------------------------------------------------------------------------------------------------
# Argument checks (shared by the CUDA launchers and the CPU models)


def _check_all(dy, x, mean, invstd, weight, half_ok: bool = False) -> tuple[str, bool]:
    """(layout, whether dy must be copied into x's layout); raises naming the argument."""
    x = check_tensor(OP, "x", x, ndim=(2, 4), half_ok=half_ok)
    if x.dim() == 2:
        if not x.is_contiguous():
            raise KernelArgumentError(OP, "x", f"expected a contiguous (N, C) tensor, got strides {x.stride()}")
        layout = "rows"
    else:
        layout = layout_of(OP, "x", x)
    c = x.shape[1]
    if c == 0:
        raise KernelArgumentError(OP, "x", f"expected at least one channel, got shape {tuple(x.shape)}")
    dy = check_tensor(OP, "dy", dy, ndim=x.dim(), device=x.device, dtype=x.dtype)
    if dy.shape != x.shape:
        raise KernelArgumentError(OP, "dy", f"expected x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    for name, t in (("mean", mean), ("invstd", invstd), ("weight", weight)):
        if t is None and name == "weight":
            continue
        check_tensor(OP, name, t, ndim=1, device=x.device, half_ok=half_ok)
        if t.shape[0] != c:
            raise KernelArgumentError(OP, name, f"expected shape ({c},) (one value per channel of x), "
                                                f"got {tuple(t.shape)}")
    check_size(OP, "x", x)
    n = x.shape[0]
    if layout == "nchw":
        s = x.shape[2] * x.shape[3]
        if c > MAX_GRID_Y:
            raise KernelArgumentError(OP, "x", f"NCHW path supports at most {MAX_GRID_Y} channels, got {c}")
        if n > INT32_MAX or s > INT32_MAX:
            raise KernelArgumentError(OP, "x", f"N and H*W must be below 2^31, got N={n}, H*W={s}")
    else:
        r = n if x.dim() == 2 else n * x.shape[2] * x.shape[3]
        vec, tx, ty, tiles, _, _ = rows_plan(max(r, 1), c)
        if tiles > MAX_GRID_Y or cdiv(r, ty * DX_ROWS) > INT32_MAX:
            raise KernelArgumentError(OP, "x", f"{r} rows of {c} channels exceed the launch grid")
    return layout, not _in_layout(dy, layout)


def _in_layout(t: torch.Tensor, layout: str) -> bool:
    if layout == "channels_last":
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous()


_CHECKED: dict[tuple, tuple[str, bool]] = {}


def _check(dy, x, mean, invstd, weight, half_ok: bool = False) -> tuple[torch.Tensor, str]:
    """Validate everything before any work; returns (dy in x's layout, layout). Memoised per configuration
    (``runtime.memo_check``: dtypes, devices, shapes and strides), so a launcher called once per BatchNorm
    layer per step checks each configuration once."""
    layout, convert = memo_check(_CHECKED, _check_all, dy, x, mean, invstd, weight, half_ok)
    if convert:
        dy = dy.contiguous(memory_format=_memory_format(layout))
    return dy, layout


def _memory_format(layout: str) -> torch.memory_format:
    return torch.channels_last if layout == "channels_last" else torch.contiguous_format


# --------------------------------------------------------------------------------------------------
# Plans: grids and the kernels' integer arguments, a function of the shape and layout only (cached)


@functools.lru_cache(maxsize=512)
def _plan(shape: tuple[int, ...], layout: str) -> dict:
    n, c = shape[0], shape[1]
    if layout == "nchw":
        s = shape[2] * shape[3]
        vec, p, e = nchw_plan(n, c, s)
        nvec = n * c * s // vec
        return dict(
            kind="nchw", p=p, counters=c, workspace=2 * c * p if p > 1 else 0, m=np.int64(n * s),
            red_grid=(p, c), red_block=(THREADS,),
            red_args=(np.int64(n), np.int32(c), np.int64(s), np.int64(e), np.int32(vec)),
            dx_grid=(min(cdiv(nvec, THREADS), MAX_DX_BLOCKS),), dx_block=(THREADS,),
            dx_args=(np.int64(nvec), np.int32(c), np.int64(s), np.int32(vec)),
        )
    r = n if len(shape) == 2 else n * shape[2] * shape[3]
    vec, tx, ty, tiles, rb, p = rows_plan(r, c)
    rbx = ty * DX_ROWS
    return dict(
        kind="rows", p=p, counters=tiles, workspace=2 * p * c if p > 1 else 0, m=np.int64(r),
        red_grid=(p, tiles), red_block=(tx, ty),
        red_args=(np.int64(r), np.int32(c), np.int64(rb), np.int32(vec)),
        dx_grid=(cdiv(r, rbx), tiles), dx_block=(tx, ty),
        dx_args=(np.int64(r), np.int32(c), np.int64(rbx), np.int32(vec)),
    )


def partials_per_channel(shape: tuple[int, ...], layout: str) -> int:
    """How many block partials meet in each of dbeta and dgamma: the atomic variant's contention."""
    if layout == "nchw":
        return nchw_plan(shape[0], shape[1], shape[2] * shape[3])[1]
    r = shape[0] if len(shape) == 2 else shape[0] * shape[2] * shape[3]
    return rows_plan(r, shape[1])[5]


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _aligned(t: torch.Tensor, layout: str) -> torch.Tensor:
    """float4 loads need 16-byte aligned rows; the bits must not depend on the address, so a misaligned
    tensor (a view at an odd offset) is copied rather than read with scalar loads."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=_memory_format(layout))


@dataclass(frozen=True)
class _Setup:
    """What a launch needs that only the call's signature (``_signature``) decides: validated once, the
    two launches configured once (their pointers given per call)."""
    layout: str
    fmt: torch.memory_format
    convert_dy: bool          # dy is not in x's layout
    widen_stats: bool         # half activations: statistics and weight read as float32
    param_dtype: torch.dtype  # dgamma's and dbeta's dtype
    plan: dict
    reduce: Launch | None     # the variant's reduction: (dy, x, mean, invstd[, workspace, counters], dbeta, dgamma)
    dx: Launch | None         # dx: (dy, x, mean, invstd, weight, dbeta, dgamma, dx)


_SETUPS: dict[tuple, _Setup] = {}
_NULL = 0   # a null pointer argument (no weight, no workspace)


def _signature(variant: str, dy, x, mean, invstd, weight) -> tuple | None:
    """dtypes, devices, shapes and strides of every argument (``runtime.check_key``: None where one cannot
    be keyed, a sparse tensor say; then checked in full)."""
    return check_key(variant, dy, x, mean, invstd, weight)


def _setup(variant: str, half: torch.dtype | None, dy, x, mean, invstd, weight) -> _Setup:
    layout, convert = _check_all(dy, x, mean, invstd, weight, True)
    check_cuda(OP, "x", x)
    dev, defines = x.device, act_defines(x.dtype)
    plan = _plan(tuple(x.shape), layout) if x.numel() else {}
    reduce = dx = None
    if plan:
        kind, four = plan["kind"], (SLOT,) * 4
        # atomic adds into zeros; tree writes every element itself, through a workspace and counters
        # when a channel has several blocks (p > 1)
        tail = (SLOT, SLOT) if variant == "atomic" else (SLOT,) * 4
        reduce = Launch.of(function(SOURCE, f"bn_bwd_{kind}_{variant}", dev, defines), plan["red_grid"],
                           plan["red_block"], four + plan["red_args"] + tail, device=dev)
        dx = Launch.of(function(SOURCE, f"bn_bwd_dx_{kind}", dev, defines), plan["dx_grid"], plan["dx_block"],
                       four + (SLOT, SLOT, SLOT, plan["m"]) + plan["dx_args"] + (SLOT,), device=dev)
    return _Setup(layout, _memory_format(layout), convert, half is not None,
                  weight.dtype if weight is not None else torch.float32, plan, reduce, dx)


def _launch(variant: str, dy, x, mean, invstd, weight):
    key = _signature(variant, dy, x, mean, invstd, weight)
    st = _SETUPS.get(key) if key is not None else None
    if st is None:
        half = registry.half_dtype(OP, (dy, x, mean, invstd, weight))
        if half is not None and not (getattr(dy, "dtype", None) == getattr(x, "dtype", None) == half):
            # half and float32 activations together: what the registry's widening call does, here too
            args = (dy, x, mean, invstd, weight)
            return registry.round_outputs(OP, _launch(variant, *registry.widen(args, half)), args)
        st = _setup(variant, half, dy, x, mean, invstd, weight)   # raises on anything the kernels do not take
        if key is not None and len(_SETUPS) < MEMO_LIMIT:
            _SETUPS[key] = st
    if st.convert_dy:
        dy = dy.contiguous(memory_format=st.fmt)
    c, dev = x.shape[1], x.device
    if st.widen_stats:   # statistics and weight widened (exact); sums stay float32
        mean, invstd = mean.float(), invstd.float()
        weight = weight.float() if weight is not None else None
    if not st.plan:   # an empty batch
        return (torch.empty(x.shape, device=dev, dtype=x.dtype, memory_format=st.fmt),
                torch.zeros(c, device=dev, dtype=st.param_dtype), torch.zeros(c, device=dev, dtype=st.param_dtype))
    plan, layout = st.plan, st.layout
    dy, x = _aligned(dy, layout), _aligned(x, layout)
    # held in locals until the launches are queued: a freed temporary's memory could be handed to dbeta
    mean, invstd = mean.contiguous(), invstd.contiguous()
    weight = weight.contiguous() if weight is not None else None
    inputs = (dy.data_ptr(), x.data_ptr(), mean.data_ptr(), invstd.data_ptr())
    if variant == "atomic":   # adds into zeros
        dbeta, dgamma = torch.zeros(c, device=dev), torch.zeros(c, device=dev)
        st.reduce(*inputs, dbeta.data_ptr(), dgamma.data_ptr())
    else:
        dbeta, dgamma = torch.empty(c, device=dev), torch.empty(c, device=dev)
        workspace = counters = None
        if plan["p"] > 1:
            workspace = torch.empty(plan["workspace"], device=dev)
            counters = ticket_counters(dev, plan["counters"])
        st.reduce(*inputs, workspace.data_ptr() if workspace is not None else _NULL,
                  counters.data_ptr() if counters is not None else _NULL, dbeta.data_ptr(), dgamma.data_ptr())
    dx = torch.empty(x.shape, device=dev, dtype=x.dtype, memory_format=st.fmt)
    st.dx(*inputs, weight.data_ptr() if weight is not None else _NULL, dbeta.data_ptr(), dgamma.data_ptr(),
          dx.data_ptr())
    if st.param_dtype != torch.float32:   # a half weight's gradients, rounded once (out_like)
        return dx, dgamma.to(st.param_dtype), dbeta.to(st.param_dtype)
    return dx, dgamma, dbeta


def bn_bwd_atomic_cuda(dy, x, mean, invstd, weight=None):
    return _launch("atomic", dy, x, mean, invstd, weight)


def bn_bwd_tree_cuda(dy, x, mean, invstd, weight=None):
    return _launch("tree", dy, x, mean, invstd, weight)


# --------------------------------------------------------------------------------------------------
# CPU order models: the same float32 operations in the same order as the kernels


def nchw_partials(terms: np.ndarray) -> np.ndarray:
    """Block partials [K, C, P] of the NCHW reduction of K term arrays [K, N, C, S], bit for bit: thread t
    of block (p, c) adds slots t, t + T, ... of chunk p per lane, lanes combined as (a0+a1)+(a2+a3), then
    ``block_tree``."""
    k, n, c, s = terms.shape
    vec, p, e = nchw_plan(n, c, s)
    virtual = np.ascontiguousarray(terms.transpose(0, 2, 1, 3)).reshape(k, c, n * s)
    chunks = pad_to(virtual, 2, p * e).reshape(k, c, p, e // (THREADS * vec), THREADS, vec)
    lanes = seq_sum(chunks, 3)  # [K, C, P, thread, lane]
    if vec == 4:
        per_thread = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3])
    else:
        per_thread = lanes[..., 0]
    return block_tree(per_thread)


@functools.lru_cache(maxsize=None)
def _nchw_jit():
    """Numba twins of :func:`nchw_partials` (terms formed on the fly) and of the dx formula: the same float32
    operations in the same order, one pass over dy and x each instead of NumPy's transposed copies and
    padded chunk arrays. Compiled on first use."""
    import numba

    tree32 = halving32_jit()

    @numba.njit(cache=False)
    def partials(d, v, m, istd, vec, p, e, threads):
        # d, v (N, C, S) float32. Block (blk, ch) covers the channel's flattened n*S values [blk*e, blk*e + e);
        # value j of it goes to slot q = (j - blk*e) % (threads*vec), i.e. thread q // vec, lane q % vec, in
        # increasing j (the kernel's slot loop); values past the end are the model's +0.0 padding, skipped
        # exactly. Runs of values that stay inside one image row and one slot sweep are added as vectors.
        n, c, s = d.shape
        length = n * s
        tv = threads * vec
        out = np.zeros((2, c, p), np.float32)
        acc0 = np.zeros(tv, np.float32)
        acc1 = np.zeros(tv, np.float32)
        lanes = np.zeros(32, np.float32)
        warps = np.zeros(32, np.float32)
        for ch in range(c):
            mc = m[ch]
            ic = istd[ch]
            for blk in range(p):
                acc0[:] = np.float32(0.0)
                acc1[:] = np.float32(0.0)
                j = blk * e
                hi = min(j + e, length)
                ni = j // s
                sp = j - ni * s
                q = 0
                while j < hi:
                    run = min(s - sp, tv - q, hi - j)
                    dr = d[ni, ch, sp:sp + run]
                    vr = v[ni, ch, sp:sp + run]
                    for u in range(run):
                        dd = dr[u]
                        xh = (vr[u] - mc) * ic
                        acc0[q + u] = acc0[q + u] + dd
                        acc1[q + u] = acc1[q + u] + dd * xh
                    j += run
                    q += run
                    if q == tv:
                        q = 0
                    sp += run
                    if sp == s:
                        sp = 0
                        ni += 1
                for k in range(2):  # per thread (a0 + a1) + (a2 + a3), then block_tree
                    acc = acc0 if k == 0 else acc1
                    nw = threads // 32
                    for w in range(nw):
                        for i in range(32):
                            b = (w * 32 + i) * vec
                            if vec == 4:
                                lanes[i] = (acc[b] + acc[b + 1]) + (acc[b + 2] + acc[b + 3])
                            else:
                                lanes[i] = acc[b]
                        warps[w] = tree32(lanes)
                    for w in range(nw, 32):
                        warps[w] = np.float32(0.0)
                    out[k, ch, blk] = tree32(warps)
        return out

    @numba.njit(cache=False)
    def dx(d, v, m, istd, g, a, b):
        # dx = (g * istd) * ((dy - a) - xhat * b), xhat = (x - mean) * istd, per element as the NumPy model
        n, c, s = d.shape
        out = np.empty((n, c, s), np.float32)
        for ni in range(n):
            for ch in range(c):
                mc = m[ch]
                ic = istd[ch]
                k = g[ch] * ic
                ac = a[ch]
                bc = b[ch]
                for sp in range(s):
                    xh = (v[ni, ch, sp] - mc) * ic
                    out[ni, ch, sp] = k * ((d[ni, ch, sp] - ac) - xh * bc)
        return out

    return partials, dx


def nchw_partials_jit(d: np.ndarray, v: np.ndarray, m: np.ndarray, istd: np.ndarray) -> np.ndarray:
    """:func:`nchw_partials` of the terms (dy, dy * xhat) straight from dy and x (N, C, S), mean and invstd
    (C,): the same bits (tests/test_bn_bwd.py checks it), without materialising the terms."""
    n, c, s = d.shape
    vec, p, e = nchw_plan(n, c, s)
    return _nchw_jit()[0](d, v, m, istd, vec, p, e, THREADS)


def rows_partials(terms: np.ndarray) -> tuple[np.ndarray, int]:
    """Block partials [K, P, C] of the rows reduction of K term arrays [K, R, C], bit for bit, and TY:
    thread (tx, ty) adds rows r0 + ty, r0 + ty + TY, ... in order, then a halving tree over ty."""
    k, r, c = terms.shape
    _, _, ty, _, rb, p = rows_plan(r, c)
    blocks = pad_to(terms, 1, p * rb).reshape(k, p, rb // ty, ty, c)
    acc = seq_sum(blocks, 2)  # [K, P, TY, C]
    return halving_tree(np.moveaxis(acc, 2, -1)), ty


def _cpu_arrays(dy, x, mean, invstd, weight, layout):
    for name, t in (("dy", dy), ("x", x), ("mean", mean), ("invstd", invstd), ("weight", weight)):
        if t is not None and t.device.type != "cpu":
            raise KernelArgumentError(OP, name, f"the CPU model needs a CPU tensor, got one on {t.device}")
    c = x.shape[1]
    if layout == "nchw":
        n, _, h, w = x.shape
        d, v = (t.detach().numpy().reshape(n, c, h * w) for t in (dy, x))
        chan = (1, c, 1)
    else:
        d, v = (np.ascontiguousarray(t.detach().numpy() if t.dim() == 2 else
                                     t.detach().permute(0, 2, 3, 1).reshape(-1, c).numpy()) for t in (dy, x))
        chan = (1, c)
    m = mean.detach().numpy().astype(F32).reshape(chan)
    istd = invstd.detach().numpy().astype(F32).reshape(chan)
    g = np.ones(chan, dtype=F32) if weight is None else weight.detach().numpy().astype(F32).reshape(chan)
    return d, v, m, istd, g


def cpu_sums(variant: str, d: np.ndarray, v: np.ndarray, m: np.ndarray, istd: np.ndarray, layout: str,
             rng) -> np.ndarray:
    """The two channel sums [2, C] (sum(dy), sum(dy * xhat)) of the variant's reduction kernel, bit for bit:
    d, v as ``_cpu_arrays`` gives them (dy and x as (N, C, S) or (R, C)), m and istd per channel."""
    c = v.shape[1]
    if layout == "nchw":
        d, v = np.ascontiguousarray(d), np.ascontiguousarray(v)
        partials = nchw_partials_jit(d, v, m.reshape(c), istd.reshape(c))  # [2, C, P]
        if variant == "atomic":
            sums = arrival_sum(partials, rng)
        elif partials.shape[-1] == 1:
            sums = partials[..., 0]
        else:
            sums = strided_reduce(partials, THREADS)
    else:
        xhat = (v - m) * istd
        partials, ty = rows_partials(np.stack([d, d * xhat]))  # [2, P, C]: the two sums' terms, as the kernels
        if variant == "atomic":
            sums = arrival_sum(np.swapaxes(partials, 1, 2), rng)
        elif partials.shape[1] == 1:
            sums = partials[:, 0]
        else:
            acc = seq_sum(pad_to(partials, 1, ty).reshape(2, -1, ty, c), 1)  # [2, TY, C]
            sums = halving_tree(np.swapaxes(acc, 1, 2))
    return np.asarray(sums, dtype=F32)


def _cpu(variant: str, dy, x, mean, invstd, weight, rng):
    dy, layout = _check(dy, x, mean, invstd, weight)
    shape, c = tuple(x.shape), x.shape[1]
    d, v, m, istd, g = _cpu_arrays(dy, x, mean, invstd, weight, layout)
    if x.numel() == 0:
        return torch.empty(shape, memory_format=_memory_format(layout)), torch.zeros(c), torch.zeros(c)
    sums = cpu_sums(variant, d, v, m, istd, layout, rng)
    mf = np.float32(int(_plan(shape, layout)["m"]))  # one rounding of M, as __ll2float_rn
    chan = m.shape
    a, b = (sums[0] / mf).reshape(chan), (sums[1] / mf).reshape(chan)
    if layout == "nchw":
        dx = _nchw_jit()[1](d, v, m.reshape(c), istd.reshape(c), g.reshape(c), a.reshape(c), b.reshape(c))
        return (torch.from_numpy(dx.reshape(shape)), torch.from_numpy(np.ascontiguousarray(sums[1])),
                torch.from_numpy(np.ascontiguousarray(sums[0])))
    dx = (g * istd) * ((d - a) - ((v - m) * istd) * b)
    if len(shape) == 2:
        out = torch.from_numpy(np.ascontiguousarray(dx, dtype=F32))
    else:
        n, _, h, w = shape
        out = torch.from_numpy(np.ascontiguousarray(dx, dtype=F32).reshape(n, h, w, c)).permute(0, 3, 1, 2)
    return out, torch.from_numpy(np.ascontiguousarray(sums[1])), torch.from_numpy(np.ascontiguousarray(sums[0]))


def bn_bwd_atomic_cpu(dy, x, mean, invstd, weight=None, *, rng=None):
    return _cpu("atomic", dy, x, mean, invstd, weight, rng)


def bn_bwd_tree_cpu(dy, x, mean, invstd, weight=None, *, rng=None):
    return _cpu("tree", dy, x, mean, invstd, weight, rng)


# --------------------------------------------------------------------------------------------------
# Op spec


def reference_parts(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgamma, dbeta) in float64 on the CPU, from the same saved statistics."""
    dy, x, mean, invstd = (t.detach().to("cpu", torch.float64) for t in args[:4])
    weight = args[4] if len(args) > 4 else kwargs.get("weight")
    c = x.shape[1]
    chan = (1, c) if x.dim() == 2 else (1, c, 1, 1)
    dims = (0,) if x.dim() == 2 else (0, 2, 3)
    w = torch.ones(c, dtype=torch.float64) if weight is None else weight.detach().to("cpu", torch.float64)
    m = x.numel() // c
    xhat = (x - mean.view(chan)) * invstd.view(chan)
    dbeta = dy.sum(dims)
    dgamma = (dy * xhat).sum(dims)
    dx = (w * invstd).view(chan) * ((dy - (dbeta / m).view(chan)) - xhat * (dgamma / m).view(chan))
    return dx, dgamma, dbeta


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    """The exact result as one float64 tensor: dx (flattened in N, C, H, W order), dgamma, dbeta, as the
    benchmark compares a tuple of outputs (``bench.metrics.reference_error`` splits it per part)."""
    return torch.cat([t.reshape(-1) for t in reference_parts(args, kwargs)])


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """dy and x random from the seed; mean and invstd are x's own batch statistics (as the forward pass
    saves them), weight random around 1 or None."""
    shape, layout = tuple(case.params["shape"]), case.params["layout"]
    g = torch.Generator().manual_seed(case.seed)
    x = torch.randn(shape, generator=g) * 2.0 + 0.5
    dy = torch.randn(shape, generator=g) * case.params.get("scale", 1.0)
    c = shape[1]
    weight = 1.0 + 0.5 * torch.randn(c, generator=g) if case.params.get("affine", True) else None
    dims = (0,) if len(shape) == 2 else (0, 2, 3)
    var, mean = torch.var_mean(x.double(), dims, correction=0)
    invstd = (1.0 / torch.sqrt(var + EPS)).float()
    mean = mean.float()
    if layout == "channels_last":
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    args = tuple(t.to(device) if t is not None else None for t in (dy, x, mean, invstd, weight))
    return args, {}


def case_of(name: str, shape: tuple[int, ...], layout: str, seed: int, op: str = OP, **extra) -> Case:
    """A case of ``op`` (bn_bwd, or bn_fwd, whose reduction this is): contention = partials per channel."""
    params = {"shape": list(shape), "layout": layout, **extra}
    return Case(op, f"{name}_{layout}", params, seed=seed, contention=float(partials_per_channel(shape, layout)))


HOSTILE_SHAPES = (
    (1, 1, 1, 1), (2, 3, 5, 7), (3, 5, 1, 1), (1, 1025, 2, 2), (64, 1, 32, 32), (2, 7, 33, 33),
    (5, 13, 17, 3), (4, 64, 8, 8),
)
HOSTILE_ROWS = ((1023, 3), (2, 1025), (1, 1), (257, 64), (4097, 10))


def _test_cases() -> list[Case]:
    cases = []
    for i, shape in enumerate(HOSTILE_SHAPES):
        for layout in ("nchw", "channels_last"):
            # every third shape without weight (BatchNorm(affine=False))
            cases.append(case_of("x".join(map(str, shape)), shape, layout, seed=600 + i, affine=i % 3 != 2))
    for i, shape in enumerate(HOSTILE_ROWS):
        cases.append(case_of(f"{shape[0]}x{shape[1]}", shape, "rows", seed=700 + i, affine=i % 3 != 2))
    return cases


def bench_shapes(scale: str) -> list[tuple[int, str, tuple[int, ...]]]:
    """ResNet-18's BatchNorm inputs (every conv output is normalised), batch 128 (8 at scale "cpu"): (index,
    name without its prefix, shape), shared with bn_fwd."""
    from .shapes import bias_grad_shapes

    out = []
    for i, (name, shape) in enumerate(bias_grad_shapes()):
        if len(shape) != 4:
            continue  # the classifier's (N, 10) bias has no BatchNorm
        out.append((i, name.removeprefix("dy_"), (8,) + shape[1:] if scale == "cpu" else shape))
    return out


def _bench_cases(scale: str) -> list[Case]:
    return [case_of(f"bn_{name}", shape, layout, seed=800 + i)
            for i, name, shape in bench_shapes(scale) for layout in ("nchw", "channels_last")]


def _torch_peer(dy, x, mean, invstd, weight=None):
    w = weight if weight is not None else torch.ones_like(mean)
    return tuple(torch.ops.aten.native_batch_norm_backward(dy, x, w, None, None, mean, invstd, True, EPS,
                                                           [True, True, True]))


def _peers() -> dict:
    return {"torch": _torch_peer}


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, bn_bwd_atomic_cuda, bn_bwd_atomic_cpu,
         "both channel sums' block partials atomicAdd-ed in arrival order; dx elementwise"),
        ("tree", True, False, bn_bwd_tree_cuda, bn_bwd_tree_cpu,
         "both channel sums' block partials combined in index order by the channel's last block; dx elementwise"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    # dy and x read once, dx written once; mean, invstd, weight read, dgamma and dbeta written
    bytes_moved=lambda case: 12 * int(np.prod(case.params["shape"])) + 20 * case.params["shape"][1],
    # half inputs: dx as x, dgamma and dbeta as weight (float32 under autocast, as cuDNN returns them)
    out_like=(1, (4, "weight")),
    half_native=True,
    half_inputs=(0, 1),  # dy and x; under autocast the statistics and the affine weight stay float32
)
