"""index_add: CPU order models against float64 and against the order as documented, bad inputs, hostile
values, and (on a GPU) the CUDA kernels against their models, bitwise.

Error bound (``index_add.error_bound``): an output element with k contributions is a float32 sum of k
terms from +0.0 in some binary tree (any arrival order for atomic, chunks + fixed tree for sorted); each
term passes through at most k - 1 roundings, so |out - exact| <= gamma(k - 1) * sum |term|.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import index_add as ia
from tests.segsum_checks import (bad_index_case, check_atomic_some_order, check_bound, check_some_order,
                                 check_sorted_repeatable, poison_allocator, spec_sorted, split_runs)
from tests.helpers import bitwise_equal, differing_bits, entropy_from_seeds, float32_bits

OP = "index_add"
SPEC = kernels.spec(OP)
SORTED = kernels.get(OP, "sorted")
ATOMIC = kernels.get(OP, "atomic")
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]


def stats(args, kw):
    index, src = args
    return ia.contributions(index, src, kw["num_rows"])


# --------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_models_within_bound_of_float64(case):
    args, kw = SPEC.make_inputs(case, CPU)
    ref = SPEC.reference(args, kw)
    _, count, abs_sum = stats(args, kw)
    s = SORTED(*args, **kw)
    assert s.shape == (kw["num_rows"], args[1].shape[1]) and s.dtype == torch.float32 and s.is_contiguous()
    check_bound(s, ref, count, abs_sum)
    a = ATOMIC(*args, **kw, rng=case.seed)
    check_bound(a, ref, count, abs_sum)
    check_some_order(a, s, count)
    if count.size and count.max() <= 1:
        assert bitwise_equal(s, ref.float())


@pytest.mark.parametrize("case", [c for c in TEST_CASES if c.params["n"] <= 5000 or "long" in c.name], ids=lambda c: c.name)
def test_sorted_model_is_the_documented_order(case):
    args, kw = SPEC.make_inputs(case, CPU)
    index, src = args
    want = spec_sorted(index.numpy(), src.contiguous().numpy(), kw["num_rows"])
    diff = differing_bits(SORTED(*args, **kw), torch.from_numpy(want))
    assert diff.size == 0, f"model and documented order differ at {diff[:10]}"


def test_sorted_order_tree_is_not_sequential_negative_control():
    """The two-level case really goes through the tree: a plain source-order sum gives other bits, and
    the documented-order checker above sees the difference."""
    case = next(c for c in TEST_CASES if c.name == "cancel_d32_dup100")
    args, kw = SPEC.make_inputs(case, CPU)
    index, src = args
    s = SORTED(*args, **kw)
    seq = torch.zeros_like(s)
    for i in range(src.shape[0]):  # one addition at a time in source order
        seq[index[i]] = seq[index[i]] + src[i]
    assert differing_bits(s, seq).size > 0
    _, count, abs_sum = stats(args, kw)
    check_bound(seq, SPEC.reference(args, kw), count, abs_sum)  # also a correct sum, just another order


def test_atomic_model_varies_with_order_negative_control(monkeypatch):
    case = next(c for c in TEST_CASES if c.name == "cancel_d32_dup100")
    args, kw = SPEC.make_inputs(case, CPU)
    results = {float32_bits(ATOMIC(*args, **kw, rng=seed)).tobytes() for seed in range(10)}
    assert len(results) >= 5, f"only {len(results)} distinct results over 10 arrival orders"
    entropy_from_seeds(monkeypatch, 100)   # rng=None: a fresh generator per call, its entropy seeded here
    assert len({float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(3)}) > 1
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(3)}) == 1
    assert float32_bits(ATOMIC(*args, **kw, rng=4)).tobytes() == float32_bits(ATOMIC(*args, **kw, rng=4)).tobytes()


def test_bound_check_rejects_a_dropped_term_negative_control():
    case = next(c for c in TEST_CASES if c.name == "d33_dup50_two_levels")
    args, kw = SPEC.make_inputs(case, CPU)
    index, src = args
    _, count, abs_sum = stats(args, kw)
    dropped = src.clone()
    dropped[int(torch.nonzero(index == kw["num_rows"] // 2)[7])] = 0.0
    with pytest.raises(AssertionError, match="outside the bound"):
        check_bound(SORTED(index, dropped, **kw), SPEC.reference(args, kw), count, abs_sum)


def test_negative_zeros_sum_to_positive_zero():
    """Every row starts at +0.0, so -0.0 contributions leave +0.0 (torch.zeros(...).index_add_ too)."""
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    src = torch.full((6, 3), -0.0)
    for v in (SORTED, ATOMIC):
        out = v(index, src, num_rows=4, rng=0)
        assert (float32_bits(out) == 0).all(), v.key
    assert (float32_bits(ia.torch_index_add(index, src, num_rows=4)) == 0).all()


def test_inf_nan_pass_through():
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    src = torch.tensor([[float("inf")], [1.0], [float("inf")], [float("-inf")], [float("nan")], [2.0], [3.0]])
    want = torch.tensor([[float("inf")], [float("nan")], [float("nan")], [3.0]])
    for v in (SORTED, ATOMIC):
        out = v(index, src, num_rows=4, rng=1)
        assert differing_bits(out, want).size == 0, (v.key, out)


def test_subnormals_flush_only_in_atomic():
    tiny = float(np.finfo(np.float32).tiny)
    index = torch.tensor([0, 1, 1])
    src = torch.tensor([[tiny / 4], [1.5 * tiny], [-1.0 * tiny]])
    s = SORTED(index, src, num_rows=2)
    assert s[0, 0].item() == tiny / 4 and s[1, 0].item() == 0.5 * tiny  # kept
    a = ATOMIC(index, src, num_rows=2, rng=0)
    assert (float32_bits(a) == 0).all()  # operand and result flushed, as float atomicAdd does


def test_noncontiguous_src_gives_the_contiguous_bits():
    case = next(c for c in TEST_CASES if c.name == "noncontig_d24")
    (index, src), kw = SPEC.make_inputs(case, CPU)
    assert not src.is_contiguous()
    assert np.array_equal(float32_bits(SORTED(index, src, **kw)), float32_bits(SORTED(index, src.contiguous(), **kw)))


def test_empty_index_gives_zeros():
    for v in (SORTED, ATOMIC):
        out = v(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 5), num_rows=7)
        assert out.shape == (7, 5) and (float32_bits(out) == 0).all()


def test_chunk_len_and_partial_slots():
    assert [ia.chunk_len(k) for k in (1, 32, 33, 32768, 32769, 65536, 65537, 10**6)] == \
        [32, 32, 32, 32, 64, 64, 128, 1024]
    # Rows with >= 2 chunks take slots 2 * floor(s / 32) + c: disjoint and below 2 * floor(n / 32), for
    # random row layouts with hot rows.
    rng = np.random.default_rng(0)
    for _ in range(200):
        counts = rng.choice([1, 5, 31, 33, 64, 65, 700, 1025, 40000], size=rng.integers(1, 12))
        n = int(counts.sum())
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        used = []
        for s, k in zip(starts, counts):
            nc = -(-int(k) // ia.chunk_len(int(k)))
            if nc > 1:
                used.extend(2 * (int(s) // 32) + c for c in range(nc))
        assert len(used) == len(set(used)) and (not used or max(used) < 2 * (n // 32))


def test_key_type_and_vector_width():
    # 16-bit keys (stored as key - 32768) while destinations and the sentinel fit: two radix passes
    assert ia._key_dtype(65535) == (torch.int16, "i16", 2**15)
    assert ia._key_dtype(65536) == (torch.int32, "i32", 2**31)
    assert ia._key_dtype(2**32 - 1)[1] == "i32" and ia._key_dtype(2**32)[1] == "i64"
    src = torch.zeros(4, 1024)
    assert [ia._vec(src, d) for d in (17, 33, 48, 64, 96, 128, 130, 512)] == [1, 1, 2, 2, 4, 4, 2, 4]
    assert ia._vec(src.view(-1)[1:1025].view(4, 256), 64) == 1  # misaligned: scalar loads


def _random_rows(rng, sizes: list[int], most: int):
    """A sorted key list of 1 to most - 1 rows, each of a count drawn from ``sizes``, and a skip row (-1:
    none): (counts, skip, keys, row starts, the set of (row, chunk) that the sums must take)."""
    counts = rng.choice(sizes, size=rng.integers(1, most))
    skip = int(rng.integers(-1, len(counts)))
    keys = np.repeat(np.arange(len(counts)), counts)
    start = np.concatenate(([0], np.cumsum(counts)))
    want = {(m, c) for m in range(len(counts)) if m != skip
            for c in range(-(-int(counts[m]) // ia.chunk_len(int(counts[m]))))}
    return counts, skip, keys, start, want


def _group_positions(keys, skip: int, group: int):
    """(p, m): the sorted positions the fill split's warp tasks take at ``group`` warps a tile, in task
    order (task w takes tile w // group and its lanes h with h % group == w % group), with their
    destinations; the skipped destination's positions left out."""
    n = len(keys)
    for w in range(-(-n // 32) * group):
        tile, sub = w // group, w % group
        for h in range(sub, 32, group):
            p = tile * 32 + h
            if p < n and keys[p] != skip:
                yield p, int(keys[p])


def test_fill_split_groups_take_every_chunk_once():
    """The fill split's warp kernel, replayed on the host for every group: task w takes tile w // group
    and, of its 32 positions, those at lanes h with h % group == w % group; a position takes chunk 0 of a
    row that starts there and the chunk c >= 1 that starts there. Over all tasks, every chunk of every row
    but the skipped one exactly once."""
    rng = np.random.default_rng(2)
    for _ in range(40):
        counts, skip, keys, start, want = _random_rows(rng, [0, 1, 2, 5, 31, 32, 33, 64, 65, 700, 1025], 12)
        for group in ia.FILL_GROUPS:
            got = []
            for p, m in _group_positions(keys, skip, group):
                s, L = int(start[m]), ia.chunk_len(int(counts[m]))
                if (p - s) % L == 0:
                    got.append((m, (p - s) // L))
            assert sorted(got) == sorted(want), group


def _once_kernel_writes(counts, skip: int, blocks: int, per: int) -> tuple[list[int], list[int]]:
    """segsum_once's loop replayed on the host (segsum.cuh seg_once_body): block b takes tiles b * per,
    then every blocks * per further; warp w < here reads tile t0 + w's 32 destinations; a destination is
    summed when it has 1 to CHUNK_MIN contributions (and is not the skip row), zeroed when it has none (or
    is the skip row), left alone otherwise. Returns (summed, zeroed), a destination once per write."""
    space = len(counts)
    tiles = -(-space // 32)
    per = max(1, min(per, ia.ONCE_PER_MAX))   # as the kernel clamps it
    summed, zeroed = [], []
    for b in range(blocks):
        for t0 in range(b * per, tiles, blocks * per):
            for w in range(min(per, tiles - t0)):
                for lane in range(32):
                    m = (t0 + w) * 32 + lane
                    if m >= space:
                        continue
                    k = 0 if m == skip else int(counts[m])
                    if k == 0:
                        zeroed.append(m)
                    elif k <= ia.CHUNK_MIN:
                        summed.append(m)
    return summed, zeroed


def test_once_split_writes_every_row_once(monkeypatch):
    """The once split, replayed on the host: segsum_once's grid (once_grid at 132 and at 2 SMs, and forced
    ones as the GPU tests force them) zeroes the empty and skipped rows and sums the rows of one chunk; the
    long-rows kernel, at every group, takes chunk 0 of the rows of more than CHUNK_MIN contributions that
    start at its positions and the chunks c >= 1. Every row is written by exactly one write, and every chunk
    of every row but the skipped one is summed exactly once."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        counts, skip, keys, start, want = _random_rows(rng, [0, 0, 1, 2, 31, 32, 33, 64, 65, 700, 1025], 400)
        space = len(counts)
        grids = [(1, 3), (1, 8), (2, 8), (3, 20)]
        for sms in (132, 2):
            monkeypatch.setattr(ia, "sm_count", lambda dev, sms=sms: sms)
            grids.append(ia.once_grid(space, torch.device("cpu")))
        for group in ia.FILL_GROUPS[trial % 2::2]:
            roots, got = [], []
            for p, m in _group_positions(keys, skip, group):
                s, k = int(start[m]), int(counts[m])
                L = ia.chunk_len(k)
                if (p == s and k > ia.CHUNK_MIN) or (p != s and (p - s) % L == 0):
                    got.append((m, (p - s) // L))
                    if p == s:
                        roots.append(m)   # the tree's root of this row: written once, by its last node
            for blocks, per in grids:
                summed, zeroed = _once_kernel_writes(counts, skip, blocks, per)
                assert sorted(summed + zeroed + roots) == list(range(space)), (blocks, per, group)
                chunks = got + [(m, 0) for m in summed]
                assert len(chunks) == len(set(chunks)) and set(chunks) == want, (blocks, per, group)


def test_task_split_sums_every_chunk_once():
    """The sorted kernels' work split, replayed on the host: destination tasks take chunk 0 of each
    non-empty row (and write the empty and skipped rows), tile tasks of 32 positions take the chunks
    c >= 1 that start in them; every chunk of every row exactly once, at most one per tile and row."""
    rng = np.random.default_rng(1)
    for _ in range(100):
        counts, skip, keys, start, want = _random_rows(rng, [0, 0, 1, 5, 32, 33, 64, 65, 700, 1025, 40000], 10)
        n, space = len(keys), len(counts)
        got = [(m, 0) for m in range(space) if counts[m] and m != skip]
        for tile in range(-(-n // 32)):
            p = np.arange(tile * 32, min(n, tile * 32 + 32))
            m = keys[p]
            s = start[m]
            L = np.array([ia.chunk_len(int(counts[r])) for r in m])
            head = (p != s) & ((p - s) % L == 0) & (m != skip)
            assert len(set(m[head])) == head.sum()
            got += [(int(r), int(c)) for r, c in zip(m[head], ((p - s) // L)[head])]
        assert len(got) == len(set(got)) and set(got) == want


BAD = [
    ("index", (torch.zeros(4, dtype=torch.int32), torch.zeros(4, 3)), {"num_rows": 5}),
    ("index", (torch.zeros(4, 1, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": 5}),
    ("index", (torch.zeros(3, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": 5}),
    ("index", ([0, 1], torch.zeros(2, 3)), {"num_rows": 5}),
    ("index", (torch.zeros(4, dtype=torch.int64).to("meta"), torch.zeros(4, 3)), {"num_rows": 5}),
    ("src", (torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.float64)), {"num_rows": 5}),
    ("src", (torch.zeros(4, dtype=torch.int64), torch.zeros(4)), {"num_rows": 5}),
    ("num_rows", (torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": True}),
    ("num_rows", (torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": -1}),
    ("num_rows", (torch.zeros(4, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": 0}),
]


@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("variant", ["sorted", "atomic", "fixed"])
def test_bad_arguments_name_the_argument(arg, args, kw, variant):
    with pytest.raises(KernelArgumentError, match=f"^{OP}: argument '{arg}'"):
        kernels.get(OP, variant)(*args, **kw)


@pytest.mark.parametrize("bad", [-1, 5, 1 << 40])
def test_out_of_range_index_names_the_value(bad):
    index = torch.tensor([0, 4, bad, 2])
    with pytest.raises(KernelArgumentError, match=f"argument 'index': index {bad} is out of range for 5 rows"):
        SORTED(index, torch.zeros(4, 3), num_rows=5)


def test_spec_tables():
    gpu = SPEC.bench_cases("gpu")
    assert {c.params.get("dup", 0.0) for c in gpu} == {0.0, 0.01, 0.5, 1.0}
    big = next(c for c in gpu if c.params.get("dup") == 1.0)
    assert (big.params["n"], big.params["d"], big.params["m"]) == (1_000_000, 64, 100_000)
    assert big.contention == 1_000_000
    assert SPEC.bytes_moved(big) == 10**6 * 64 * 4 + 10**6 * 8 + 10**5 * 64 * 4
    case = next(c for c in TEST_CASES if c.name == "d130_dup100")
    (index, _), kw = SPEC.make_inputs(case, CPU)
    assert (index == kw["num_rows"] // 2).all()  # 100% duplicates: one hot row
    assert set(SPEC.peers()) == {"torch"}


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels against their CPU models, bitwise

CUDA = torch.device("cuda")
REPEATS = 50
ONCE_GRIDS = ((1, 3), (1, 8), (2, 8))   # (blocks, tiles per block) forced on segsum_once


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_sorted_bitwise_repeatable_and_equals_model(case, cuda_sync, monkeypatch):
    _, model, args, kw = check_sorted_repeatable(
        SPEC, SORTED, case, REPEATS, before=lambda args, kw: poison_allocator((kw["num_rows"], args[1].shape[1])))
    scalar = ia.index_add_sorted_scalar_cuda(*args, **kw)  # the one-thread-per-chunk kernel: same bits
    assert differing_bits(scalar, model).size == 0
    index, src = args[0], args[1].contiguous()
    for force_scalar in (False, True):  # every task split of both kernels: the same chunks and tree
        for split, group in split_runs(not force_scalar and src.shape[1] >= ia.SCALAR_BELOW_D):
            poison_allocator((kw["num_rows"], src.shape[1]))  # rows, tiles, gaps, once: a row they missed is NaN
            out = ia.segsum_sorted_cuda(ia.SOURCE, OP, index, src, kw["num_rows"],
                                        force_scalar=force_scalar, split=split, group=group)
            assert differing_bits(out, model).size == 0, (force_scalar, split, group)
    monkeypatch.setattr(ia, "gap_blocks", lambda space, dev: 1)   # one block takes every tile in turn
    poison_allocator((kw["num_rows"], src.shape[1]))
    out = ia.segsum_sorted_cuda(ia.SOURCE, OP, index, src, kw["num_rows"], split="gaps")
    assert differing_bits(out, model).size == 0
    for grid in ONCE_GRIDS:   # segsum_once's tiles per block: a grid-stride loop, partial last groups
        monkeypatch.setattr(ia, "once_grid", lambda space, dev, grid=grid: grid)
        poison_allocator((kw["num_rows"], src.shape[1]))
        out = ia.segsum_sorted_cuda(ia.SOURCE, OP, index, src, kw["num_rows"], split="once")
        assert differing_bits(out, model).size == 0, grid


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_atomic_is_some_order_and_peers_within_bound(case, cuda_sync):
    args, kw, ref, count, abs_sum = check_atomic_some_order(SPEC, SORTED, ATOMIC, case, stats)
    check_bound(ia.torch_index_add(*args, **kw), ref, count, abs_sum)


# (n, rows, width, dup, bad): sizes around the one-block sort's rounds (32 * ceil(n / 1024) per warp)
# and limits (16384 keys, 65535 destinations, one digit pass up to 255), the merge sort's tiles (2048
# keys), limits (32768 keys; int32 keys beyond 65535 destinations) and starts (fused into the merge, or
# the starts kernel for 30000 keys into 10^6 rows); width > 0: the element form; bad: indices outside
# [0, rows) (the sentinel, sorted last)
SORTS = (
    (1, 10, 0, 0.0, 0), (31, 3, 0, 0.0, 0), (1000, 255, 0, 0.3, 0), (1025, 256, 0, 0.0, 0),
    (5000, 65535, 0, 0.01, 0), (16384, 50000, 0, 0.5, 0), (16384, 65535, 0, 1.0, 0), (16383, 300, 0, 0.0, 40),
    (2048, 100, 8, 0.2, 0), (16384, 40, 16, 0.0, 7), (12000, 254, 0, 0.0, 25),
    (2047, 50000, 0, 0.01, 0), (2049, 50000, 0, 0.01, 3), (4097, 7, 0, 0.0, 0), (32768, 50000, 0, 0.01, 0),
    (32767, 65535, 0, 1.0, 9), (30000, 1_000_000, 0, 0.01, 11), (3000, 70000, 0, 0.5, 0),
    (32768, 20000, 4, 0.01, 5), (30000, 3, 0, 0.0, 0),
    # the radix sort's tiles (2048 keys), one to three digit passes, all keys equal, the element form
    (4095, 511, 0, 0.0, 2), (4097, 512, 0, 0.5, 0), (12289, 70000, 0, 0.01, 0), (100_000, 100_000, 0, 0.01, 13),
    (65536, 300, 0, 1.0, 0), (262_144, 1_000_000, 0, 0.0, 5), (131_072, 40_000, 8, 0.3, 3),
    # the rank sort: its limit (65536 keys, element numbers in 16 bits beside int16 keys; the last one is
    # made bad, so it packs beside the sentinel 65535 to all ones, the padding's value), around its tile of
    # staged keys (8192: four full tiles), int32 keys
    (65536, 65535, 0, 0.01, 64), (8191, 3000, 0, 0.2, 4), (8192, 3000, 0, 0.2, 4), (65535, 100_000, 0, 0.0, 2),
    # more than 256 tiles (the scan's carry between its rounds); no key at all
    (600_000, 100_000, 0, 0.01, 3), (0, 10, 0, 0.0, 0),
)


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows,width,dup,bad", SORTS)
def test_gpu_key_sorts_are_torch_sort(n, rows, width, dup, bad, cuda_sync):
    """The rank sort, the merge sort, the one-block sort and the radix sort (where each applies) give
    torch.sort(stable=True)'s keys and permutation and the row starts exactly (the starts kernel's, which
    the torch path runs, checked by a search on the CPU), and the same on every call."""
    g = torch.Generator().manual_seed(n + rows)
    shape = (n // width, width) if width else (n,)
    index = ia.draw_index(g, shape, rows, dup)
    if bad:
        flat = index.view(-1)
        where = torch.randperm(flat.numel(), generator=g)[:bad]
        flat[where] = torch.where(torch.arange(bad) % 2 == 0, rows + torch.arange(bad), -1 - torch.arange(bad))
        flat[-1] = rows  # the last element bad too (see the rank sort's cases above)
    index = index.to(CUDA)
    want = ia.sort_keys(ia.SOURCE, OP, index, rows, width=width, method="torch")
    kname = want[3]
    # the starts from the CPU: the first sorted position with a destination >= m
    space = rows * max(width, 1)
    first = torch.searchsorted(want[0].cpu().long() + want[4], torch.arange(space + 1))
    assert torch.equal(want[2].cpu(), first)
    assert kname == ("i16" if rows * max(width, 1) < 2**16 else "i32")
    methods = [m for m in ia.SORTS if m != "torch" and ia.sort_takes(m, n, kname)]
    assert "radix" in methods and ("rank" in methods) == (n <= ia.RANK_MAX)
    for method in methods:
        for _ in range(5):
            got = ia.sort_keys(ia.SOURCE, OP, index, rows, width=width, method=method)
            assert got[3:] == want[3:]
            assert all(bitwise_equal(x, y) for x, y in zip(got[:3], want[:3])), method


def test_launcher_constants_match_segsum_cuh():
    """The host's copies of segsum.cuh's sizes (chunking, tree fan-out, the one-block sort's launch)."""
    text = (Path(ia.__file__).parent / "segsum.cuh").read_text()
    define = dict(re.findall(r"^#define (SEG_\w+) (\d+)\b", text, re.M))
    assert int(define["SEG_CHUNK_MIN"]) == ia.CHUNK_MIN and int(define["SEG_MAX_CHUNKS"]) == ia.MAX_CHUNKS
    assert int(define["SEG_FAN"]) == ia.FAN
    assert int(define["SEG_SORT_MAX"]) == ia.SORT_MAX and int(define["SEG_SORT_THREADS"]) == ia.SORT_THREADS
    digits, warps = int(define["SEG_SORT_DIGITS"]), int(define["SEG_SORT_WARPS"])
    assert warps * 32 == ia.SORT_THREADS
    assert ia.SORT_SMEM == (2 * ia.SORT_MAX + (digits + 1) * warps + warps) * 4  # SEG_SORT_SMEM
    assert ia.SORT_SMEM <= 227 * 1024  # an H100/H200 block's shared-memory limit
    assert int(define["SEG_MSORT_TILE"]) == ia.MSORT_TILE and int(define["SEG_MSORT_MAX"]) == ia.MSORT_MAX
    assert int(define["SEG_MSORT_THREADS"]) == ia.MSORT_THREADS
    assert int(define["SEG_MSORT_MERGE_THREADS"]) == ia.MSORT_MERGE_THREADS
    assert ia.MSORT_TILE == int(define["SEG_MSORT_PER"]) * ia.MSORT_THREADS
    assert 4 * ia.MSORT_MAX <= ia.SMEM_PER_SM  # the merge stages every tile's destinations
    assert int(define["SEG_RSORT_TILE"]) == ia.RSORT_TILE and int(define["SEG_RSORT_BITS"]) == ia.RSORT_BITS
    assert int(define["SEG_RSORT_THREADS"]) == ia.RSORT_THREADS
    assert int(define["SEG_RANK_THREADS"]) == ia.RANK_THREADS and int(define["SEG_RANK_MAX"]) == ia.RANK_MAX
    assert int(define["SEG_SUMS_BLOCKS"]) == ia.SUMS_BLOCKS


def test_radix_digits_take_the_fewest_passes_of_at_most_nine_bits():
    # destinations 0 .. space: bit_length(space) bits, spread evenly over ceil(bits / 9) passes
    assert ia.radix_digits(0) == ia.radix_digits(1) == (1, 1)
    assert ia.radix_digits(511) == (1, 9) and ia.radix_digits(512) == (2, 5)
    assert ia.radix_digits(100_000) == (2, 9)          # 17 bits
    assert ia.radix_digits(1_000_000) == (3, 7)        # 20 bits
    assert ia.radix_digits(2**32 - 1) == (4, 8)
    assert ia.RSORT_BITS == 9 and all(b <= ia.RSORT_BITS for _, b in map(ia.radix_digits, range(0, 70000, 97)))


@pytest.mark.parametrize("rows,width", [(300, 0), (100_000, 0), (200_000, 5), (2**30, 3)])
def test_radix_sort_launch_plan(monkeypatch, rows, width):
    """radix_sort's launches without a GPU (kernels and launches stood in for, on a CPU workspace): per pass
    count, scan, place, each a kernel segsum.cuh defines, over one grid row per tile (scan: per digit);
    the index's range check in the first count only; pass p reads what pass p - 1 wrote and the last
    writes skey and perm; the counts, their prefixes, the totals and the buffers between passes are
    disjoint parts of one workspace."""
    calls = []

    class Recorded:
        def __init__(self, fn, grid, block, args, device, shared_mem=0):
            self.fn, self.grid, self.args = fn, grid, args

        @classmethod
        def of(cls, *a, **k):
            return cls(*a, **k)

        def __call__(self, *values):
            it = iter(values)
            calls.append((self.fn, self.grid, [next(it) if a is ia.SLOT else a for a in self.args]))

    monkeypatch.setattr(ia, "function", lambda source, name, dev, *a, **k: name)
    monkeypatch.setattr(ia, "Launch", Recorded)
    n = 3 * ia.RSORT_TILE + 7
    space = rows * max(width, 1)
    ktype, _, offset = ia._key_dtype(space)
    key = torch.zeros((n // width, width) if width else (n,), dtype=torch.int64)
    n = key.numel()
    skey, perm = torch.empty(n, dtype=ktype), torch.empty(n, dtype=torch.int64)
    check = ia.RangeCheck(OP, "index", "device")
    ia.radix_sort(ia.SOURCE, OP, key, skey, perm, rows, width=width, offset=offset, check=check)
    passes, bits = ia.radix_digits(space)
    tiles, digits = -(-n // ia.RSORT_TILE), 1 << bits
    kname = {torch.int16: "i16", torch.int32: "i32"}[ktype]
    assert [c[0] for c in calls] == [f"{OP}_rsort_count", "segsum_rsort_scan", f"{OP}_rsort_place_{kname}"] * passes
    text = (Path(ia.__file__).parent / "segsum.cuh").read_text()
    assert "PREFIX##_rsort_count(" in text and "segsum_rsort_scan(" in text
    assert "PREFIX##_rsort_place_##KEYNAME(" in text and f"SEG_RSORT_PLACE(PREFIX, {kname}," in text
    written, parts = [], set()
    for p in range(passes):
        (_, cgrid, cargs), (_, sgrid, sargs), (_, pgrid, pargs) = calls[3 * p: 3 * p + 3]
        assert cgrid == pgrid == (tiles,) and sgrid == (digits,)
        # count (idx, kin, n, width, rows, shift, bits, counts, trap)
        assert cargs[0] == key.data_ptr() and cargs[2:7] == [n, width, rows, bits * p, bits]
        assert cargs[8] == (check.trap if p == 0 else 0)
        counts = cargs[7]
        # scan (counts, tiles, prefix, totals); place (idx, kin, vin, n, width, rows, shift, bits, prefix,
        # totals, kout, vout, skey, perm, offset)
        assert sargs[0] == counts and sargs[1] == tiles and pargs[8:10] == sargs[2:4]
        assert pargs[0:2] == cargs[0:2] and pargs[3:8] == cargs[2:7] and pargs[14] == offset
        assert pargs[1:3] == ([0, 0] if p == 0 else written[-1])
        if p == passes - 1:
            assert pargs[10:14] == [0, 0, skey.data_ptr(), perm.data_ptr()]
        else:
            assert pargs[12:14] == [0, 0] and 0 not in pargs[10:12] and pargs[10:12] != pargs[1:3]
            written.append(pargs[10:12])
        parts.update({(counts, 4 * digits * tiles), (sargs[2], 4 * digits * tiles), (sargs[3], 4 * digits)})
        parts.update((ptr, 4 * n) for pair in written for ptr in pair)
    assert len({tuple(w) for w in written}) == min(passes - 1, 2)  # alternating between two buffers
    # disjoint parts that tile one int32 workspace of radix_words: counts [tile][digit], prefixes
    # [digit][tile], totals, buffers
    spans = sorted(parts)
    assert len(spans) == 3 + 2 * min(passes - 1, 2)
    assert all(a + size == b for (a, size), (b, _) in zip(spans, spans[1:]))
    assert spans[0][0] == calls[0][2][7] and sum(size for _, size in spans) == 4 * ia.radix_words(n, passes, bits)


@pytest.mark.gpu
@pytest.mark.parametrize("passes", [1, 2, 3, 4])
def test_gpu_radix_sort_passes_are_a_stable_sort(passes, cuda_sync):
    """radix_sort alone (no row starts, so destinations up to 2^32 - 1 fit in memory) against a stable
    sort on the CPU of the same narrowed keys, the sentinel of bad indices included, for one to four
    digit passes; the same on every call."""
    rows, width = {1: (100, 4), 2: (50_000, 0), 3: (200_000, 5), 4: (2**30, 3)}[passes]
    space = rows * max(width, 1)
    assert ia.radix_digits(space)[0] == passes
    g = torch.Generator().manual_seed(passes)
    n = 3 * ia.RSORT_TILE + 5
    shape = (n // width, width) if width else (n,)
    index = ia.draw_index(g, shape, rows, 0.2).view(-1)
    index[torch.randperm(index.numel(), generator=g)[:6]] = torch.tensor([-1, rows, -5, rows + 9, -1, rows])
    e = torch.arange(index.numel())
    dest = torch.where((index >= 0) & (index < rows), index * width + e % width if width else index, space)
    ktype, _, offset = ia._key_dtype(space)
    want_key, want_perm = torch.sort((dest - offset).to(ktype), stable=True)
    key = index.view(shape).to(CUDA)
    for _ in range(5):
        skey = torch.empty(index.numel(), device=CUDA, dtype=ktype)
        perm = torch.empty(index.numel(), device=CUDA, dtype=torch.int64)
        ia.radix_sort(ia.SOURCE, OP, key, skey, perm, rows, width=width, offset=offset)
        assert torch.equal(skey.cpu(), want_key) and torch.equal(perm.cpu(), want_perm)


def test_key_sorts_refuse_what_they_cannot_sort():
    with pytest.raises(KernelArgumentError, match="method.*16385 keys.*one-block"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(16385, dtype=torch.int64), 10, method="one_block")
    with pytest.raises(KernelArgumentError, match="method.*one-block.*at most 65535"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(10, dtype=torch.int64), 70000, method="one_block")
    with pytest.raises(KernelArgumentError, match="method.*32769 keys.*merge"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(32769, dtype=torch.int64), 10, method="merge")
    with pytest.raises(KernelArgumentError, match="method.*8589934592 destinations.*merge"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(4, dtype=torch.int64), 2**31, width=4, method="merge")
    with pytest.raises(KernelArgumentError, match="method.*2147483648 keys.*radix"):
        ia.sort_keys(ia.SOURCE, OP, torch.empty(2**31, dtype=torch.int64, device="meta"), 10, method="radix")
    with pytest.raises(KernelArgumentError, match="method.*8589934592 destinations.*radix"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(4, dtype=torch.int64), 2**31, width=4, method="radix")
    with pytest.raises(KernelArgumentError, match="method.*65537 keys.*rank"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(65537, dtype=torch.int64), 10, method="rank")
    with pytest.raises(KernelArgumentError, match="method.*8589934592 destinations.*rank"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(4, dtype=torch.int64), 2**31, width=4, method="rank")
    with pytest.raises(KernelArgumentError, match="method.*expected one of"):
        ia.sort_keys(ia.SOURCE, OP, torch.zeros(4, dtype=torch.int64), 10, method="bucket")


def test_default_split():
    """fill where most destinations are empty, and in the warp kernels up to FILL_UP_TO contributions per
    destination; rows beyond (and for the thread kernel from one per destination)."""
    assert ia.default_split(2047, 2048, False) == ia.default_split(2047, 2048, True) == "fill"
    assert ia.default_split(ia.FILL_UP_TO * 2000, 2000, False) == "fill"
    assert ia.default_split(ia.FILL_UP_TO * 2000 + 1, 2000, False) == "rows"
    assert ia.default_split(2000, 2000, True) == "rows"
    assert all(ia.default_split(n, m, sc) in ia.SPLITS and ia.default_split(n, m, sc) not in ("tiles", "gaps", "once")
               for n in (1, 10, 1000, 10**6) for m in (1, 100, 10**5) for sc in (False, True))


def test_fill_group(monkeypatch):
    """The fill split's warps per position tile: doubled while twice as many warps still fit at once
    (132 SMs x 3 blocks x 8 warps = 3168), up to FILL_GROUP_MAX: 64 tiles x 6 slices (2048 keys of 768
    floats) get 8; 512 x 6 one; every result a power of two the kernel takes."""
    monkeypatch.setattr(ia, "sm_count", lambda dev: 132)
    cpu = torch.device("cpu")
    assert ia.fill_group(64 * 6, cpu) == 8 and ia.fill_group(512 * 6, cpu) == 1
    assert ia.fill_group(1, cpu) == ia.FILL_GROUP_MAX
    assert ia.fill_group(792, cpu) == 4 and ia.fill_group(793, cpu) == 2   # 792 x 4 = 3168 warps
    assert all(ia.fill_group(t, cpu) in ia.FILL_GROUPS for t in range(1, 5000, 7))
    for bad in (3, 0, 64, True, 2.0):   # refused before anything runs, an empty input too
        for n in (2, 0):
            with pytest.raises(KernelArgumentError, match="argument 'group'"):
                ia.segsum_sorted_cuda(ia.SOURCE, OP, torch.zeros(n, dtype=torch.int64), torch.zeros(n, 8), 3,
                                      group=bad)


def test_default_sort():
    """rank for int16 and int32 keys up to RANK_UP_TO, merge up to MSORT_MAX, the radix sort beyond;
    torch.sort for int64 keys and beyond the radix sort's limit."""
    assert ia.default_sort(1, "i16") == ia.default_sort(ia.RANK_UP_TO, "i32") == "rank"
    assert ia.default_sort(ia.RANK_UP_TO + 1, "i16") == ia.default_sort(ia.MSORT_MAX, "i32") == "merge"
    assert ia.default_sort(ia.MSORT_MAX + 1, "i16") == ia.default_sort(10**6, "i32") == "radix"
    assert ia.default_sort(5, "i64") == ia.default_sort(10**6, "i64") == "torch"
    assert ia.default_sort(ia.RSORT_MAX, "i32") == "radix" and ia.default_sort(2**31, "i32") == "torch"
    assert ia.RANK_UP_TO <= ia.RANK_MAX


@pytest.mark.gpu
@pytest.mark.parametrize("dup", [0.01, 0.5, 1.0])
def test_gpu_bench_size_sorted_repeatable_atomic_varies(dup, cuda_sync):
    """The benchmark's shape (1e6 x 64 into 1e5 rows): sorted gives one result over repeats and stays
    within the bound; atomic (negative control) gives more than one where a row is hot."""
    case = next(c for c in SPEC.bench_cases("gpu") if c.params.get("dup") == dup)
    args, kw = SPEC.make_inputs(case, CUDA)
    first = SORTED(*args, **kw)
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(10)} | {float32_bits(first).tobytes()}) == 1
    cpu_args = tuple(a.cpu() for a in args)
    _, count, abs_sum = stats(cpu_args, kw)
    check_bound(first, SPEC.reference(cpu_args, kw), count, abs_sum)
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(10)}
    print(f"dup {dup}: atomic {len(atomic)} distinct / 10")
    assert len(atomic) > 1


@pytest.mark.gpu
def test_gpu_runs_on_torch_current_stream(cuda_sync):
    """src is rewritten on a side stream behind a long sleep; a launch on any other stream would read
    the old values."""
    case = next(c for c in TEST_CASES if c.name == "d33_dup50_two_levels")
    (index, src), kw = SPEC.make_inputs(case, CUDA)
    new = torch.randn(src.shape, generator=torch.Generator().manual_seed(99))
    expected = SORTED(index.cpu(), new, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf = src.clone()
        torch.cuda._sleep(50_000_000)
        buf.copy_(new.to(CUDA, non_blocking=False))
        out = SORTED(index, buf, **kw)
        out_a = ATOMIC(index, buf, **kw)
    side.synchronize()
    assert differing_bits(out, expected).size == 0
    _, count, abs_sum = stats((index.cpu(), new), kw)
    check_bound(out_a, SPEC.reference((index.cpu(), new), kw), count, abs_sum)


@pytest.mark.gpu
def test_gpu_out_of_range_and_device_mismatch(cuda_sync):
    src = torch.zeros(3, 4, device=CUDA)
    with pytest.raises(KernelArgumentError, match="index 7 is out of range"):
        SORTED(torch.tensor([0, 7, 1], device=CUDA), src, num_rows=5)
    with pytest.raises(KernelArgumentError, match="argument 'index'"):
        ATOMIC(torch.tensor([0, 1, 1]), src, num_rows=5)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sorted", "atomic"])
def test_gpu_unchecked_bad_indices_add_nothing(variant, cuda_sync):
    """check_range=False: no host synchronisation; indices outside [0, M) are dropped by the kernels
    (the sorted keys pass maps them to a sentinel past the last row) and the rest sums as usual."""
    index, src, keep = bad_index_case(40)
    want = SORTED(index[keep], src[keep], num_rows=40)
    poison_allocator((40, 20))
    out = kernels.get(OP, variant)(index.to(CUDA), src.to(CUDA), num_rows=40, check_range=False)
    if variant == "sorted":
        assert differing_bits(out, want).size == 0
    else:
        _, count, abs_sum = ia.contributions(index[keep], src[keep], 40)
        check_bound(out, SPEC.reference((index[keep], src[keep]), {"num_rows": 40}), count, abs_sum)
    with pytest.raises(KernelArgumentError, match="index -5 is out of range for 40 rows"):
        kernels.get(OP, variant)(index.to(CUDA), src.to(CUDA), num_rows=40)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [32767, 32768, 65535, 65536])
def test_gpu_key_width_boundaries(rows, cuda_sync):
    """Around the int16 key limits (65535 destinations, stored as key - 32768, and the sentinel): the
    first and last rows, hot and cold, bit for bit against the model; an index == rows still raises."""
    g = torch.Generator().manual_seed(rows)
    index = torch.cat([torch.full((70,), rows - 1), torch.zeros(40, dtype=torch.int64),
                       torch.randint(0, rows, (500,), generator=g), torch.full((3,), rows // 2)])
    index = index[torch.randperm(len(index), generator=g)]
    src = ia.draw_values(g, (len(index), 8))
    want = SORTED(index, src, num_rows=rows)
    poison_allocator((rows, 8))
    assert differing_bits(SORTED(index.to(CUDA), src.to(CUDA), num_rows=rows), want).size == 0
    assert differing_bits(ia.index_add_sorted_scalar_cuda(index.to(CUDA), src.to(CUDA), num_rows=rows), want).size == 0
    index[5] = rows
    with pytest.raises(KernelArgumentError, match=f"index {rows} is out of range"):
        SORTED(index.to(CUDA), src.to(CUDA), num_rows=rows)
