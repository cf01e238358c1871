"""sum: 1-D float32 -> scalar. CUDA launchers for ``sum.cu`` and their CPU order models.

Partition (shared by every variant, a function of n only): ``G = min(ceil(n / 4 / 256), 1024)``
blocks of 256 threads; thread g of the grid adds float4 slots g, g + 256G, ... into four lane
accumulators, combines them as (a0 + a1) + (a2 + a3), and the block reduces its threads with the warp
halving tree of ``common.cuh``.
"""
from __future__ import annotations

import numpy as np
import torch

from .order import F32, arrival_sum, block_tree, pad_to, seq_sum, strided_reduce
from .registry import Case, define_op
from .runtime import (
    KernelArgumentError,
    cdiv,
    check_cuda,
    check_size,
    check_tensor,
    cupy_stream,
    function,
    launch,
    ptr,
    sm_count,
    ticket_counters,
)

OP = "sum"
SOURCE = "sum.cu"
THREADS = 256
MAX_BLOCKS = 1024  # one wave of 8 blocks per SM on an H200; fewer partials keep the final pass short

# exact: integers of 2^-EXACT_FRAC units; elements must satisfy |x| < 2^EXACT_MAX_EXP. Each element is
# split into 22-bit windows with unit 2^K (see sum.cu); the last window rounds to nearest.
EXACT_FRAC = 56
EXACT_MAX_EXP = 32
EXACT_WINDOWS = (10, -12, -34, -56)
EXACT_MAX_N = 2**31  # per-thread int64 window sums and the 128-bit total cannot overflow below this
EXACT_BLOCKS_PER_SM = 6  # __launch_bounds__(256, 6) of sum_exact


FLAG_NAN, FLAG_POS_INF, FLAG_NEG_INF, FLAG_RANGE = 1, 2, 4, 8


class SumRangeError(KernelArgumentError):
    """An element is outside the exact variant's range (|x| >= 2^32)."""


def blocks_for(n: int) -> int:
    return max(1, min(cdiv(cdiv(n, 4), THREADS), MAX_BLOCKS))


def _check(x: object) -> torch.Tensor:
    x = check_tensor(OP, "x", x, ndim=1)
    if x.numel() > 1 and x.stride(0) != 1:
        raise KernelArgumentError(OP, "x", f"expected a contiguous 1-D tensor, got stride {x.stride(0)}")
    check_size(OP, "x", x)
    return x


def _check_exact_size(x: torch.Tensor) -> None:
    if x.numel() > EXACT_MAX_N:
        raise KernelArgumentError(OP, "x", f"the exact variant sums at most 2^31 elements, got {x.numel()}")


# --------------------------------------------------------------------------------------------------
# CUDA launchers


def _aligned(x: torch.Tensor) -> torch.Tensor:
    # float4 loads need 16-byte alignment. A view that starts mid-allocation is copied once so that the
    # kernel's order (and so its bits) depends only on n, never on where the data starts.
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _cuda_prologue(x) -> torch.Tensor:
    x = _check(x)
    check_cuda(OP, "x", x)
    return _aligned(x)


def sum_atomic_cuda(x: torch.Tensor) -> torch.Tensor:
    x = _cuda_prologue(x)
    out = torch.zeros((), device=x.device, dtype=torch.float32)
    if x.numel() == 0:
        return out
    fn = function(SOURCE, "sum_atomic", x.device)
    launch(fn, (blocks_for(x.numel()),), (THREADS,), (ptr(x), np.int64(x.numel()), ptr(out)), device=x.device)
    return out


def sum_tree_cuda(x: torch.Tensor) -> torch.Tensor:
    x = _cuda_prologue(x)
    if x.numel() == 0:
        return torch.zeros((), device=x.device, dtype=torch.float32)
    out = torch.empty((), device=x.device, dtype=torch.float32)
    g = blocks_for(x.numel())
    partials = torch.empty(g, device=x.device, dtype=torch.float32)
    launch(function(SOURCE, "sum_partials", x.device), (g,), (THREADS,),
           (ptr(x), np.int64(x.numel()), ptr(partials)), device=x.device)
    launch(function(SOURCE, "sum_final", x.device), (1,), (THREADS,),
           (ptr(partials), np.int64(g), ptr(out)), device=x.device)
    return out


def sum_lastblock_cuda(x: torch.Tensor) -> torch.Tensor:
    x = _cuda_prologue(x)
    if x.numel() == 0:
        return torch.zeros((), device=x.device, dtype=torch.float32)
    g = blocks_for(x.numel())
    partials = torch.empty(g, device=x.device, dtype=torch.float32)
    counter = ticket_counters(x.device, 1)
    out = torch.empty((), device=x.device, dtype=torch.float32)
    launch(function(SOURCE, "sum_lastblock", x.device), (g,), (THREADS,),
           (ptr(x), np.int64(x.numel()), ptr(partials), ptr(counter), ptr(out)), device=x.device)
    return out


def sum_exact_cuda(x: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """Order-independent sum. With ``check_range`` (default) the host waits for the kernel and raises
    :class:`SumRangeError` if an element had |x| >= 2^32; without it such a result is NaN."""
    x = _cuda_prologue(x)
    _check_exact_size(x)
    if x.numel() == 0:
        return torch.zeros((), device=x.device, dtype=torch.float32)
    # Integer addition makes the result independent of the partition, so this grid may follow the GPU:
    # one resident wave (the kernel's launch bounds guarantee EXACT_BLOCKS_PER_SM blocks per SM).
    g = max(1, min(cdiv(cdiv(x.numel(), 4), THREADS), sm_count(x.device) * EXACT_BLOCKS_PER_SM))
    partials = torch.empty((g, 2), device=x.device, dtype=torch.int64)
    state = ticket_counters(x.device, 2)  # [ticket counter, flag accumulator], left at zero
    flags = torch.empty(1, device=x.device, dtype=torch.int32)
    out = torch.empty((), device=x.device, dtype=torch.float32)
    launch(function(SOURCE, "sum_exact", x.device), (g,), (THREADS,),
           (ptr(x), np.int64(x.numel()), ptr(partials), ptr(state), ptr(flags), ptr(out)),
           device=x.device)
    if check_range and int(flags.item()) & FLAG_RANGE:
        raise SumRangeError(OP, "x", f"the exact variant needs |x| < 2^{EXACT_MAX_EXP} for every element")
    return out


# --------------------------------------------------------------------------------------------------
# CPU order models


def block_partials(x: np.ndarray) -> np.ndarray:
    """Per-block partials of the shared first pass, bit for bit."""
    g = blocks_for(x.size)
    slots = g * THREADS
    xs = pad_to(np.asarray(x, dtype=F32), 0, 4 * slots).reshape(-1, slots, 4)  # [k, thread, lane]
    acc = seq_sum(xs, 0)
    per_thread = (acc[:, 0] + acc[:, 1]) + (acc[:, 2] + acc[:, 3])
    return block_tree(per_thread.reshape(g, THREADS))


def reduce_partials(partials: np.ndarray) -> np.float32:
    """``reduce_partials`` of common.cuh: one block, thread t adds partials t, t + 256, ... in order."""
    return strided_reduce(partials, THREADS)


def _cpu_input(x) -> np.ndarray:
    x = _check(x)
    if x.device.type != "cpu":
        raise KernelArgumentError(OP, "x", f"the CPU model needs a CPU tensor, got one on {x.device}")
    return x.detach().numpy()


def sum_atomic_cpu(x: torch.Tensor, *, rng=None) -> torch.Tensor:
    a = _cpu_input(x)
    if a.size == 0:
        return torch.zeros(())
    return torch.from_numpy(np.asarray(arrival_sum(block_partials(a), rng), dtype=F32).reshape(()))


def sum_tree_cpu(x: torch.Tensor, *, rng=None) -> torch.Tensor:
    a = _cpu_input(x)
    if a.size == 0:
        return torch.zeros(())
    return torch.from_numpy(np.asarray(reduce_partials(block_partials(a)), dtype=F32).reshape(()))


def exact_integer(a: np.ndarray) -> tuple[int, int]:
    """The exact variant's integer total (units of 2^-56) as a Python int, and its flags.

    Mirrors ``split`` in sum.cu in float32: t = r + C_k rounds r to a multiple of 2^K_k, the bit
    patterns' difference is that multiple, r - (t - C_k) is the exact remainder."""
    x = np.ascontiguousarray(a, dtype=F32)
    bits = x.view(np.uint32)
    mag = bits & 0x7FFFFFFF
    negative = (bits >> 31).astype(bool)
    flags = 0
    if np.any(mag > 0x7F800000):
        flags |= FLAG_NAN
    if np.any((mag == 0x7F800000) & ~negative):
        flags |= FLAG_POS_INF
    if np.any((mag == 0x7F800000) & negative):
        flags |= FLAG_NEG_INF
    limit = np.float32(2.0**EXACT_MAX_EXP).view(np.uint32)
    if np.any((mag >= limit) & (mag < 0x7F800000)):
        flags |= FLAG_RANGE
    r = x[mag < limit]
    total = 0
    for k, unit in enumerate(EXACT_WINDOWS):
        c = F32(1.5 * 2.0 ** (unit + 23))
        t = r + c
        q = t.view(np.int32).astype(np.int64) - int(np.array(c).view(np.int32))
        total += int(q.sum()) << (unit + EXACT_FRAC)
        if k + 1 < len(EXACT_WINDOWS):
            r = r - (t - c)
    return total, flags


def round_integer_to_f32(total: int) -> np.float32:
    """Round an integer number of 2^-56 units to the nearest float32, ties to even (as fixed_to_float)."""
    magnitude = abs(total)
    length = magnitude.bit_length()
    if length > 24:
        drop = length - 24
        q, rem = magnitude >> drop, magnitude & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        if rem > half or (rem == half and q & 1):
            q += 1
        mantissa, exponent = q, drop - EXACT_FRAC
    else:
        mantissa, exponent = magnitude, -EXACT_FRAC
    value = np.ldexp(F32(mantissa), exponent).astype(F32)
    return F32(-value if total < 0 else value)


def sum_exact_cpu(x: torch.Tensor, *, rng=None, check_range: bool = True) -> torch.Tensor:
    a = _cpu_input(x)
    _check_exact_size(x)
    if a.size == 0:
        return torch.zeros(())
    total, flags = exact_integer(a)
    if flags & FLAG_RANGE and check_range:
        raise SumRangeError(OP, "x", f"the exact variant needs |x| < 2^{EXACT_MAX_EXP} for every element")
    if flags & (FLAG_NAN | FLAG_RANGE) or (flags & FLAG_POS_INF and flags & FLAG_NEG_INF):
        value = F32(np.nan)
    elif flags & FLAG_POS_INF:
        value = F32(np.inf)
    elif flags & FLAG_NEG_INF:
        value = F32(-np.inf)
    else:
        value = round_integer_to_f32(total)
    return torch.tensor(value, dtype=torch.float32)


def exact_error_bound(n: int, result: float) -> float:
    """|exact(x) - sum(x)| bound: each element is rounded to the nearest multiple of 2^-56 (error
    <= 2^-57), then the integer total is rounded once to float32: <= n 2^-57 + 2^-24 (|result| + n 2^-57)."""
    grid = n * 2.0 ** -(EXACT_FRAC + 1)
    return grid + 2.0**-24 * (abs(result) + grid)


# --------------------------------------------------------------------------------------------------
# Op spec: inputs, float64 reference, cases, peers


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    g = torch.Generator().manual_seed(case.seed)
    kind = p.get("kind", "normal")
    n = p["n"]
    if kind == "normal":
        x = torch.randn(n, generator=g)
    elif kind == "cancel":  # large-magnitude cancellation: where the order of additions shows
        x = torch.randn(n, generator=g) * 1e7
    else:
        raise ValueError(f"{OP}: unknown input kind {kind!r}")
    return (x.to(device),), {}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0].detach().to("cpu", torch.float64).sum()


HOSTILE_N = (1, 2, 3, 5, 31, 127, 255, 257, 1023, 1024, 1025, 4093, 65535, 65536, 65537, 1_000_003,
             2**21 + 1)


def _test_cases() -> list[Case]:
    return [Case(OP, f"n{n}", {"n": n}, seed=1000 + i) for i, n in enumerate(HOSTILE_N)]


def _bench_cases(scale: str) -> list[Case]:
    exps = {"gpu": range(16, 29, 2), "quick": (16, 20, 24, 28), "cpu": (12, 16, 20)}[scale]
    cases = [Case(OP, f"2^{e}", {"n": 2**e, "e": e}, seed=e) for e in exps]
    # contention: all blocks add into one scalar, so the number of colliding partials is the block count
    for e in exps:
        n = 2**e
        cases.append(Case(OP, f"2^{e}_cancel", {"n": n, "e": e, "kind": "cancel"}, seed=100 + e,
                          contention=float(blocks_for(n))))
    return cases


def _peers() -> dict:
    peers = {"torch": lambda x: torch.sum(x)}
    try:
        import cupy

        def cupy_sum(x):
            with cupy_stream(x.device):
                return torch.as_tensor(cupy.sum(cupy.from_dlpack(x)), device=x.device)

        peers["cupy"] = cupy_sum
    except Exception:
        pass
    return peers


# --------------------------------------------------------------------------------------------------
# Registry: the op's spec and its variants (tests, benchmarks and reports list them in this order)

define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, sum_atomic_cuda, sum_atomic_cpu,
         "single pass; block partials atomicAdd-ed into the output in arrival order"),
        ("tree", True, False, sum_tree_cuda, sum_tree_cpu,
         "two passes; block partials reduced in index order by one block"),
        ("lastblock", True, False, sum_lastblock_cuda, sum_tree_cpu,
         "single pass; the last block to finish reduces the partials in index order (bits = tree)"),
        ("exact", True, True, sum_exact_cuda, sum_exact_cpu,
         "exact integer sum of 2^-56 units (|x| < 2^32): same bits for any permutation"),
    ],
    # timed for its GPU work: the range flag's read-back is a host synchronisation (its own check, which
    # the tests run)
    variant_bench_kwargs=(("exact", (("check_range", False),)),),
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=lambda case: 4 * case.params["n"] + 4,
)
