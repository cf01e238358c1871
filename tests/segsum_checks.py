"""Checks shared by the scatter-sum ops (index_add, scatter_add, embedding_bwd: kernels/segsum.cuh):
error bounds against float64, "some arrival order" for atomic results, an independent implementation of
the sorted order straight from its description."""
from __future__ import annotations

import numpy as np
import torch

from kernels import index_add as ia
from tests.helpers import assert_within_bound, differing_bits

F32 = np.float32


def check_bound(result: torch.Tensor, ref: torch.Tensor, count: np.ndarray, abs_sum: np.ndarray, *,
                scaled: bool = False) -> None:
    """|result - float64 reference| within ia.error_bound per element (finite references); NaN where the
    reference is NaN, the same infinities where it is infinite. Prints the first offenders."""
    assert_within_bound(result, ref.detach().cpu().double().numpy(), ia.error_bound(count, abs_sum, scaled=scaled))


def check_some_order(result: torch.Tensor, sorted_result: torch.Tensor, count: np.ndarray) -> None:
    """An atomic result: elements with <= 2 contributions have the sorted variant's bits (0 + a + b =
    0 + b + a; and a single subnormal-free term is exact either way)."""
    few = (count <= 2).reshape(-1)
    diff = differing_bits(result, sorted_result)
    bad = diff[few[diff]]
    assert bad.size == 0, f"elements with <= 2 contributions differ from sorted at {bad[:10]}"


def _node(children: list[np.ndarray], width: int) -> np.ndarray:
    v = list(children) + [np.zeros(width, F32)] * (ia.FAN - len(children))
    half = ia.FAN // 2
    while half >= 1:
        v = [(v[i] + v[i + half]).astype(F32) for i in range(half)]
        half //= 2
    return v[0]


def split_runs(warp: bool) -> list[tuple[str, int | None]]:
    """(split, group) for segsum_sorted_cuda: every task split at its default group, then, in the warp
    kernel (``warp``), the fill, gaps and once splits at every group (the thread kernel takes no group)."""
    groups = [(s, g) for s in ("fill", "gaps", "once") for g in ia.FILL_GROUPS] if warp else []
    return [(s, None) for s in ia.SPLITS] + groups


def poison_allocator(shape) -> None:
    """Leave NaN in the CUDA caching allocator's next block of this size: the sorted kernels' rows, tiles,
    gaps and once splits write every output row themselves, so a row they missed would show as NaN (the fill split
    zero-fills the output first: a row its sums missed is +0.0, which only the bitwise checks catch)."""
    junk = torch.full(shape, float("nan"), device="cuda")
    del junk


def spec_sorted(keys: np.ndarray, vals: np.ndarray, space: int, skip: int = -1) -> np.ndarray:
    """The sorted variant's order written out from its description, independently of the Numba model:
    per destination its values in source order, chunks of L = 32 * 2^e (smallest e with at most 1024
    chunks) summed from +0.0, more than one chunk combined by a 32-ary tree of halving trees."""
    width = vals.shape[1]
    out = np.zeros((space, width), F32)
    for m in np.unique(keys):
        if m == skip:
            continue
        rows = vals[np.nonzero(keys == m)[0]].astype(F32)  # source order
        k = len(rows)
        L = 32
        while -(-k // L) > 1024:
            L *= 2
        parts = []
        for c0 in range(0, k, L):
            acc = np.zeros(width, F32)
            for r in rows[c0:c0 + L]:
                acc = (acc + r).astype(F32)
            parts.append(acc)
        while len(parts) > 1:
            parts = [_node(parts[i:i + ia.FAN], width) for i in range(0, len(parts), ia.FAN)]
        out[m] = parts[0]
    return out


def bad_index_case(rows: int = 40):
    """(index, src, keep): 3000 source rows of 20 into ``rows`` rows, 100 indices at -5 and 100 at rows
    and beyond; ``keep`` marks the valid ones."""
    g = torch.Generator().manual_seed(11)
    index = ia.draw_index(g, (3000,), rows, 0.3)
    src = ia.draw_values(g, (3000, 20))
    bad = torch.randperm(3000, generator=g)[:200]
    index[bad[:100]] = -5
    index[bad[100:]] = rows + torch.arange(100)
    return index, src, (index >= 0) & (index < rows)


def check_sorted_repeatable(spec, sorted_variant, case, repeats: int, before=None):
    """``sorted_variant`` on the case's CUDA inputs: ``repeats`` more calls give the first one's bits, and
    its CPU model gives them too (NaN payloads aside). ``before(args, kw)`` runs first (to poison the
    allocator, say). Returns (the CUDA result, the CPU model's, CUDA args, kw)."""
    args, kw = spec.make_inputs(case, torch.device("cuda"))
    cpu_args, _ = spec.make_inputs(case, torch.device("cpu"))
    if before is not None:
        before(args, kw)
    first = sorted_variant(*args, **kw)
    for _ in range(repeats):
        assert differing_bits(first, sorted_variant(*args, **kw)).size == 0
    model = sorted_variant(*cpu_args, **kw)
    diff = differing_bits(first, model)
    assert diff.size == 0, f"CUDA sorted differs from its CPU model at {diff[:10]}"
    return first, model, args, kw


def check_atomic_some_order(spec, sorted_variant, atomic, case, stats, runs: int = 3, bound_options=None):
    """``runs`` calls of ``atomic`` on the case's CUDA inputs, each within the float64 bound and equal to
    the sum in some arrival order (``stats(cpu_args, kw)`` -> (_, count, abs_sum); ``bound_options(kw)``:
    check_bound's options for the case). Returns (CUDA args, kw, ref, count, abs_sum) for the caller's
    peer checks."""
    args, kw = spec.make_inputs(case, torch.device("cuda"))
    cpu_args, _ = spec.make_inputs(case, torch.device("cpu"))
    ref = spec.reference(cpu_args, kw)
    _, count, abs_sum = stats(cpu_args, kw)
    model = sorted_variant(*cpu_args, **kw)
    bound = bound_options(kw) if bound_options is not None else {}
    for _ in range(runs):
        out = atomic(*args, **kw)
        check_bound(out, ref, count, abs_sum, **bound)
        check_some_order(out, model, count)
    return args, kw, ref, count, abs_sum
