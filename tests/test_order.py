"""kernels/order.py by itself: the accumulation orders the CPU models are built from, each against a
scalar float32 evaluation written out step by step (values chosen so that another order gives other bits)."""
from __future__ import annotations

import itertools

import numpy as np

from kernels.order import arrival_sum, block_tree, flush_subnormals, pad_to, seq_sum, strided_reduce, warp_tree

F32 = np.float32


def scalar_halving(v: list) -> np.float32:
    """v[i] += v[i + half] for half = n/2 .. 1, one float32 addition at a time; v[0] at the end."""
    v = [F32(x) for x in v]
    half = len(v) // 2
    while half:
        for i in range(half):
            v[i] = F32(v[i] + v[i + half])
        half //= 2
    return v[0]


def order_sensitive(n: int, seed: int) -> np.ndarray:
    """float32 values of mixed magnitudes: sums of them depend on the order of the additions."""
    g = np.random.default_rng(seed)
    return (g.standard_normal(n) * 10.0 ** g.integers(-4, 8, n)).astype(F32)


def test_seq_sum_adds_in_index_order_from_plus_zero():
    v = np.array([[1e8, 1.0, -1e8], [-0.0, -0.0, -0.0]], dtype=F32)
    got = seq_sum(v, 1)
    assert got[0] == 0.0                       # (1e8 + 1) rounds to 1e8 in float32; in another order 1.0
    assert got[1] == 0.0 and not np.signbit(got[1])   # from +0.0: a sum of -0.0 terms is +0.0
    x = order_sensitive(40, 1)
    acc = F32(0.0)
    for t in x:
        acc = F32(acc + t)
    assert seq_sum(x[:, None], 0)[0] == acc


def test_warp_and_block_trees_are_the_halving_trees_they_document():
    x = order_sensitive(32, 2)
    assert warp_tree(x) == scalar_halving(list(x))
    for threads, seed in ((64, 65), (96, 97), (256, 256), (1024, 1024)):   # seeds whose sums the order changes
        v = order_sensitive(threads, seed)
        assert block_tree(v) != seq_sum(v[:, None], 0)[0], threads
        warps = [scalar_halving(list(v[w:w + 32])) for w in range(0, threads, 32)]
        want = scalar_halving(warps + [F32(0.0)] * (32 - len(warps)))
        assert block_tree(v) == want, threads


def test_strided_reduce_gives_thread_t_items_t_plus_k_threads():
    x = order_sensitive(70, 4)                 # 32 threads: thread t adds items t, t + 32, t + 64 (if any)
    assert strided_reduce(x, 32) != seq_sum(x[:, None], 0)[0]   # a seed whose sum the order changes
    per_thread = []
    for t in range(32):
        acc = F32(0.0)
        for i in range(t, 70, 32):
            acc = F32(acc + x[i])
        per_thread.append(acc)
    assert strided_reduce(x, 32) == scalar_halving(per_thread)


def test_pad_to_pads_with_zeros_only_where_needed():
    v = np.ones((2, 5), dtype=F32)
    assert pad_to(v, 1, 5) is v
    assert pad_to(v, 1, 4).shape == (2, 8) and pad_to(v, 1, 4)[:, 5:].sum() == 0
    assert pad_to(np.ones((2, 0), dtype=F32), 1, 4).shape == (2, 4)   # an empty axis still gets one group


def test_arrival_sum_draws_each_order_and_flushes_subnormals_like_atomics():
    parts = np.array([1e8, 1.0, -1e8], dtype=F32)
    sums = {float(arrival_sum(parts, seed)) for seed in range(200)}
    every = {float(F32(F32(F32(0.0) + a) + b) + c) for a, b, c in itertools.permutations(parts)}
    assert sums == every and len(every) > 1   # seeded draws reach every arrival order's result, and only those
    assert arrival_sum(parts, 7) == arrival_sum(parts, 7)
    tiny = np.finfo(F32).tiny
    assert arrival_sum(np.array([tiny / 4, tiny / 4], dtype=F32), 0) == 0.0   # subnormal operands flush
    assert flush_subnormals(np.array([-tiny / 2], dtype=F32))[0] == 0.0
    assert np.signbit(flush_subnormals(np.array([-tiny / 2], dtype=F32))[0])  # sign-preserving zero
