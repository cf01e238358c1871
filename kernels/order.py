"""Building blocks of the CPU order models: float32 arithmetic in exactly the order the kernels use.

Every function works on float32 NumPy arrays and performs one IEEE-754 float32 rounding per addition,
as the GPU's FADD does (NVRTC's default: no flush-to-zero, round to nearest even), so a deterministic
kernel and its model agree bit for bit. Batched leading axes let one call model many thread blocks.

The shared device-side building blocks these mirror live in ``kernels/common.cuh``:
``warp_tree`` <-> ``warp_reduce``, ``block_tree`` <-> ``block_reduce``.
"""
from __future__ import annotations

import functools

import numpy as np

F32 = np.float32
WARP = 32


def rng_of(rng) -> np.random.Generator:
    """``None`` -> fresh entropy (a new arrival order every call), int -> seeded, Generator -> itself."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


def seq_sum(v: np.ndarray, axis: int) -> np.ndarray:
    """acc = +0.0; acc += v[k] for k in order along ``axis`` (one thread's register accumulation)."""
    v = np.moveaxis(np.asarray(v, dtype=F32), axis, 0)
    acc = np.zeros(v.shape[1:], dtype=F32)
    for k in range(v.shape[0]):
        acc = acc + v[k]
    return acc


def pad_to(v: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    """Zero-pad ``axis`` to a multiple of ``multiple``. Adding +0.0 to an accumulator that started at
    +0.0 changes nothing (it can never hold -0.0), so padding models a guarded, skipped load exactly."""
    n = v.shape[axis]
    extra = (-n) % multiple
    if extra == 0 and n > 0:
        return v
    if n == 0:
        extra = multiple
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, extra)
    return np.pad(v, widths)


def halving_tree(v: np.ndarray) -> np.ndarray:
    """Reduce the last axis (a power of two) by halving: v[i] += v[i + half], half = n/2 .. 1.

    This is ``__shfl_down_sync`` with offsets 16, 8, 4, 2, 1 (lane 0 holds the result), and equally a
    shared-memory tree ``s[i] += s[i + half]``."""
    n = v.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"halving_tree: the last axis must have a power-of-two length, got {n}")
    half = n // 2
    while half >= 1:
        v = v[..., :half] + v[..., half : 2 * half]
        half //= 2
    return v[..., 0]


def warp_tree(v: np.ndarray) -> np.ndarray:
    """``warp_reduce``: the last axis holds the 32 lanes of a warp."""
    assert v.shape[-1] == WARP
    return halving_tree(np.asarray(v, dtype=F32))


def block_tree(v: np.ndarray) -> np.ndarray:
    """``block_reduce``: the last axis holds a block's threads (a multiple of 32, at most 1024).

    Each warp reduces its lanes; warp 0 then loads the per-warp sums (zero past the last warp) and
    reduces them the same way."""
    v = np.asarray(v, dtype=F32)
    threads = v.shape[-1]
    assert threads % WARP == 0 and threads <= 1024
    per_warp = warp_tree(v.reshape(*v.shape[:-1], threads // WARP, WARP))
    return warp_tree(pad_to(per_warp, -1, WARP))


def flush_subnormals(v: np.ndarray) -> np.ndarray:
    """Subnormal values to sign-preserving zero, as float atomicAdd (PTX atom.add.f32) treats its
    operands and results."""
    v = np.asarray(v, dtype=F32)
    return np.where(np.abs(v) < np.finfo(F32).tiny, v * F32(0.0), v).astype(F32)


def arrival_sum(partials: np.ndarray, rng, init: np.ndarray | float = 0.0) -> np.ndarray:
    """``atomicAdd`` of each partial into an output that starts at ``init``, in a random arrival order
    drawn independently for every output element (the last axis holds the partials). Like the
    hardware's float atomicAdd, subnormal operands and results flush to sign-preserving zero."""
    partials = np.asarray(partials, dtype=F32)
    gen = rng_of(rng)
    keys = gen.random(partials.shape)
    order = np.argsort(keys, axis=-1)
    shuffled = np.take_along_axis(partials, order, axis=-1)
    shuffled = flush_subnormals(shuffled)
    acc = flush_subnormals(np.broadcast_to(np.asarray(init, dtype=F32), partials.shape[:-1]).copy())
    for k in range(shuffled.shape[-1]):
        acc = flush_subnormals(acc + shuffled[..., k])
    return acc


def strided_reduce(partials: np.ndarray, threads: int) -> np.ndarray:
    """``reduce_partials`` of common.cuh over the last axis: one block of ``threads`` threads, thread t
    adds items t, t + threads, ... in order, then ``block_tree``."""
    cols = pad_to(np.asarray(partials, dtype=F32), -1, threads)
    cols = cols.reshape(*cols.shape[:-1], -1, threads)
    return block_tree(seq_sum(cols, -2))


@functools.lru_cache(maxsize=1)
def halving32_jit():
    """:func:`warp_tree` for the Numba-compiled models: a halving tree over v[0:32] in place (v[i] += v[i + half],
    half = 16 .. 1), returning v[0]. Compiled on first use; njit callers call it like any function."""
    import numba

    @numba.njit(cache=False)
    def halving32(v):
        half = 16
        while half >= 1:
            for i in range(half):
                v[i] = v[i] + v[i + half]
            half //= 2
        return v[0]

    return halving32
