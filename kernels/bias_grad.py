"""bias_grad: dB[c] = sum of dY over N (and H, W). CUDA launchers for ``bias_grad.cu`` and CPU order models.

Inputs: (N, C, H, W) in NCHW or channels_last, or (N, C) from a linear layer. The block split is a
function of the shape and layout only (see ``nchw_plan`` / ``rows_plan``), so a deterministic variant's
bits are the same on any GPU and equal to its CPU model.
"""
from __future__ import annotations

import numpy as np
import torch

from .order import F32, arrival_sum, block_tree, halving_tree, pad_to, seq_sum, strided_reduce
from .registry import Case, define_op
from .runtime import (
    KernelArgumentError,
    cdiv,
    check_cuda,
    check_size,
    check_tensor,
    function,
    launch,
    layout_of,
    ptr,
    ticket_counters,
)

OP = "bias_grad"
SOURCE = "bias_grad.cu"
THREADS = 256
# Split constants. They are constants, never read off the GPU, so the bits depend on the shape alone.
TARGET_BLOCKS = 512       # NCHW: about four blocks per SM of an H200 (132 SMs); channels split only when few
TARGET_ROW_BLOCKS = 256   # rows: fewer, longer blocks keep the last block's pass over the partials short
MIN_ROW_ITEMS = 8         # rows: at least this many rows per thread before a column tile is split again
CLUSTER_SIZES = (2, 4, 8)  # NCHW tree: P blocks of a channel combine in a cluster (compute capability >= 9)


def _has_clusters(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9
MAX_GRID_Y = 65535


def nchw_plan(n: int, c: int, s: int) -> tuple[int, int, int]:
    """(vec, P, E): float4 slots when H*W % 4 == 0; P chunks of E values per channel."""
    vec = 4 if s % 4 == 0 else 1
    length = n * s
    unit = THREADS * vec
    p = max(1, min(cdiv(TARGET_BLOCKS, c), cdiv(length, unit)))
    e = cdiv(cdiv(length, p), unit) * unit
    return vec, cdiv(length, e), e


def rows_plan(r: int, c: int) -> tuple[int, int, int, int, int, int]:
    """(vec, TX, TY, tiles, RB, P) for a row-major [r, c] matrix."""
    vec = 4 if c % 4 == 0 else 1
    tx = min(32, 1 << (cdiv(c, vec) - 1).bit_length())
    ty = THREADS // tx
    tiles = cdiv(c, tx * vec)
    p = max(1, min(cdiv(TARGET_ROW_BLOCKS, tiles), cdiv(r, ty * MIN_ROW_ITEMS)))
    rb = cdiv(cdiv(r, p), ty) * ty
    return vec, tx, ty, tiles, rb, cdiv(r, rb)


def _check(dy: object) -> tuple[torch.Tensor, str]:
    dy = check_tensor(OP, "dy", dy, ndim=(2, 4))
    if dy.dim() == 2:
        if not dy.is_contiguous():
            raise KernelArgumentError(OP, "dy", f"expected a contiguous (N, C) tensor, got strides {dy.stride()}")
        layout = "rows"
    else:
        layout = layout_of(OP, "dy", dy)
    if dy.shape[1] == 0:
        raise KernelArgumentError(OP, "dy", f"expected at least one channel, got shape {tuple(dy.shape)}")
    check_size(OP, "dy", dy)
    return dy, layout


def _as_rows(dy: torch.Tensor, layout: str) -> torch.Tensor:
    """The [R, C] row-major view of a channels_last or (N, C) tensor (no copy)."""
    return dy if layout == "rows" else dy.permute(0, 2, 3, 1).reshape(-1, dy.shape[1])


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _launch(dy: torch.Tensor, variant: str) -> torch.Tensor:
    dy, layout = _check(dy)
    check_cuda(OP, "dy", dy)
    c = dy.shape[1]
    if dy.numel() == 0:
        return torch.zeros(c, device=dy.device, dtype=torch.float32)
    # atomic adds into zeros; tree writes every element itself
    out = (torch.zeros if variant == "atomic" else torch.empty)(c, device=dy.device, dtype=torch.float32)
    if dy.data_ptr() % 16:
        dy = dy.clone(memory_format=torch.preserve_format)  # float4 loads; bits must not depend on the address
    dev = dy.device
    if layout == "nchw":
        n, s = dy.shape[0], dy.shape[2] * dy.shape[3]
        if c > MAX_GRID_Y:
            raise KernelArgumentError(OP, "dy", f"NCHW path supports at most {MAX_GRID_Y} channels, got {c}")
        if n >= 2**31 or s >= 2**31:
            raise KernelArgumentError(OP, "dy", f"N and H*W must be below 2^31, got N={n}, H*W={s}")
        vec, p, e = nchw_plan(n, c, s)
        args = (ptr(dy), np.int64(n), np.int32(c), np.int64(s), np.int64(e), np.int32(vec))
        if variant == "atomic":
            launch(function(SOURCE, "bias_grad_nchw_atomic", dev), (p, c), (THREADS,), args + (ptr(out),), device=dev)
        elif p in CLUSTER_SIZES and _has_clusters(dev):
            launch(function(SOURCE, f"bias_grad_nchw_tree_cluster{p}", dev), (p, c), (THREADS,), args + (ptr(out),),
                   device=dev)
        else:
            partials = torch.empty(c * p, device=dev, dtype=torch.float32)
            counters = ticket_counters(dev, c)
            launch(function(SOURCE, "bias_grad_nchw_tree", dev), (p, c), (THREADS,),
                   args + (ptr(partials), ptr(counters), ptr(out)), device=dev)
        return out
    rows = _as_rows(dy, layout)
    r = rows.shape[0]
    vec, tx, ty, tiles, rb, p = rows_plan(r, c)
    smem = THREADS * vec * 4
    args = (ptr(rows), np.int64(r), np.int32(c), np.int64(rb), np.int32(vec))
    if variant == "atomic":
        launch(function(SOURCE, "bias_grad_rows_atomic", dev), (p, tiles), (tx, ty), args + (ptr(out),),
               device=dev, shared_mem=smem)
    else:
        partials = torch.empty(p * c, device=dev, dtype=torch.float32)
        counters = ticket_counters(dev, tiles)
        launch(function(SOURCE, "bias_grad_rows_tree", dev), (p, tiles), (tx, ty),
               args + (ptr(partials), ptr(counters), ptr(out)), device=dev, shared_mem=smem)
    return out


def bias_grad_atomic_cuda(dy: torch.Tensor) -> torch.Tensor:
    return _launch(dy, "atomic")


def bias_grad_tree_cuda(dy: torch.Tensor) -> torch.Tensor:
    return _launch(dy, "tree")


# --------------------------------------------------------------------------------------------------
# CPU order models


def nchw_partials(a: np.ndarray) -> np.ndarray:
    """Block partials [C, P] of the NCHW path, bit for bit."""
    n, c, h, w = a.shape
    s = h * w
    vec, p, e = nchw_plan(n, c, s)
    virtual = np.ascontiguousarray(a.reshape(n, c, s).transpose(1, 0, 2)).reshape(c, n * s)
    chunks = pad_to(virtual, 1, p * e).reshape(c, p, e // (THREADS * vec), THREADS, vec)
    lanes = seq_sum(chunks, 2)  # [C, P, thread, lane]
    per_thread = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3]) if vec == 4 else lanes[..., 0]
    return block_tree(per_thread)


def rows_partials(m: np.ndarray) -> tuple[np.ndarray, int]:
    """Block partials [P, C] of the rows path, bit for bit, and the block's TY."""
    r, c = m.shape
    _, _, ty, _, rb, p = rows_plan(r, c)
    blocks = pad_to(m, 0, p * rb).reshape(p, rb // ty, ty, c)
    acc = seq_sum(blocks, 1)  # [P, TY, C]
    return halving_tree(np.moveaxis(acc, 1, -1)), ty


def _cpu_input(dy) -> tuple[np.ndarray, str]:
    dy, layout = _check(dy)
    if dy.device.type != "cpu":
        raise KernelArgumentError(OP, "dy", f"the CPU model needs a CPU tensor, got one on {dy.device}")
    dy = dy.detach()
    if layout == "nchw":
        return dy.numpy(), layout
    return np.ascontiguousarray(_as_rows(dy, layout).numpy()), layout


def _cpu(dy: torch.Tensor, variant: str, rng) -> torch.Tensor:
    a, layout = _cpu_input(dy)
    c = dy.shape[1]
    if dy.numel() == 0:
        return torch.zeros(c)
    if layout == "nchw":
        partials = nchw_partials(a)  # [C, P]
        out = arrival_sum(partials, rng) if variant == "atomic" else strided_reduce(partials, THREADS)
    else:
        partials, ty = rows_partials(a)  # [P, C]
        if variant == "atomic":
            out = arrival_sum(partials.T, rng)
        else:
            acc = seq_sum(pad_to(partials, 0, ty).reshape(-1, ty, c), 0)  # [TY, C]
            out = halving_tree(acc.T)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=F32))


def bias_grad_atomic_cpu(dy: torch.Tensor, *, rng=None) -> torch.Tensor:
    return _cpu(dy, "atomic", rng)


def bias_grad_tree_cpu(dy: torch.Tensor, *, rng=None) -> torch.Tensor:
    return _cpu(dy, "tree", rng)


# --------------------------------------------------------------------------------------------------
# Op spec


def partials_per_channel(shape: tuple[int, ...], layout: str) -> int:
    """How many block partials meet in each dB element: the atomic variant's contention."""
    if layout == "nchw":
        return nchw_plan(shape[0], shape[1], shape[2] * shape[3])[1]
    r = shape[0] if len(shape) == 2 else shape[0] * shape[2] * shape[3]
    return rows_plan(r, shape[1])[5]


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    shape, layout = tuple(case.params["shape"]), case.params["layout"]
    g = torch.Generator().manual_seed(case.seed)
    dy = torch.randn(shape, generator=g) * case.params.get("scale", 1.0)
    if layout == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    return (dy.to(device),), {}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    dy = args[0].detach().to("cpu", torch.float64)
    return dy.sum(0) if dy.dim() == 2 else dy.sum((0, 2, 3))


def _case(name: str, shape: tuple[int, ...], layout: str, seed: int, **extra) -> Case:
    params = {"shape": list(shape), "layout": layout, **extra}
    return Case(OP, f"{name}_{layout}", params, seed=seed,
                contention=float(partials_per_channel(shape, layout)))


HOSTILE_SHAPES = (
    (1, 1, 1, 1), (2, 3, 5, 7), (3, 5, 1, 1), (2, 7, 33, 33), (1, 1023, 1, 1), (4, 64, 8, 8),
    (5, 13, 17, 3), (1, 1025, 2, 2), (64, 1, 32, 32),
)
HOSTILE_ROWS = ((1, 1), (2, 1025), (1023, 3), (257, 64), (4097, 10), (1, 512))


def _test_cases() -> list[Case]:
    cases = []
    for i, shape in enumerate(HOSTILE_SHAPES):
        for layout in ("nchw", "channels_last"):
            cases.append(_case(f"{'x'.join(map(str, shape))}", shape, layout, seed=200 + i))
    for i, shape in enumerate(HOSTILE_ROWS):
        cases.append(_case(f"{shape[0]}x{shape[1]}", shape, "rows", seed=300 + i))
    return cases


def _bench_cases(scale: str) -> list[Case]:
    from .shapes import bias_grad_shapes

    cases = []
    shapes = bias_grad_shapes()
    if scale == "cpu":
        shapes = tuple((name, (8,) + shape[1:]) for name, shape in shapes)
    for i, (name, shape) in enumerate(shapes):
        layouts = ("rows",) if len(shape) == 2 else ("nchw", "channels_last")
        for layout in layouts:
            cases.append(_case(name, shape, layout, seed=400 + i))
    # contention knob: the same number of values split over fewer channels means more partials per channel
    n = 8 if scale == "cpu" else 128
    for c in (512, 64, 8, 1):
        shape = (n, c, 32, 32) if c <= 64 else (n, c, 8, 8)
        cases.append(_case(f"contention_c{c}", shape, "nchw", seed=500 + c))
    return cases


def _peers() -> dict:
    return {"torch": lambda dy: dy.sum(0) if dy.dim() == 2 else dy.sum((0, 2, 3))}


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, bias_grad_atomic_cuda, bias_grad_atomic_cpu,
         "block partials atomicAdd-ed into dB in arrival order"),
        ("tree", True, False, bias_grad_tree_cuda, bias_grad_tree_cpu,
         "block partials combined in index order: by the channel's last block, or in a cluster (sm_90)"),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=lambda case: 4 * int(np.prod(case.params["shape"])) + 4 * case.params["shape"][1],
)
