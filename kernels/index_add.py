"""index_add: out (M, D) = 0; out[index[i], :] += src[i, :]. CUDA launchers for ``index_add.cu`` and their
CPU order models, and the scatter-sum machinery that scatter_add and embedding_bwd share (segsum.cuh).

    out = index_add(index, src, num_rows=M)        # index (N,) int64, src (N, D) float32

A non-contiguous ``src`` is copied to a contiguous one first. Indices outside [0, M) raise
KernelArgumentError naming a bad value (the smallest negative one, else the largest). On the GPU the
kernels are queued first and the check reads one number back afterwards (sorted: the count of valid
keys its row-start pass already computed; atomic: one aminmax), so the device never waits for the
host mid-call; ``check_range="device"`` makes the kernels themselves fail on a bad index (a device-side
assertion, as PyTorch's CUDA index kernels: no host synchronisation at all; what the routing uses), and
``check_range=False`` checks nothing: bad indices then add nothing (the kernels drop them, never touching
memory out of bounds). RangeCheck has the details.

Order of the additions into one output element (the only thing that decides its bits):
- ``atomic``: arrival order of the atomicAdds, from +0.0; float atomicAdd flushes subnormal operands and
  results to sign-preserving zero, and the model does the same.
- ``sorted``: the row's k contributions in source order, cut into chunks of L = 32 * 2^e (smallest e with
  ceil(k / L) <= 1024); each chunk summed one value at a time from +0.0; with more than one chunk, the
  partials are combined by a 32-ary tree whose every node is a halving tree over 32 consecutive children
  (missing children +0.0): at most two levels, since there are at most 1024 chunks. The bits of a row
  depend only on its own contributions in source order (not on other rows, nor on the GPU).
Both start every row at +0.0, so a row of -0.0 contributions ends at +0.0 (as torch's zeros + index_add).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .order import F32, halving32_jit, rng_of
from .registry import Case, define_op
from .runtime import (
    SLOT,
    KernelArgumentError,
    Launch,
    cdiv,
    check_cuda,
    check_size,
    check_tensor,
    fork,
    function,
    launch,
    memo_check,
    ptr,
    sm_count,
    ticket_counters,
)

OP = "index_add"
SOURCE = "index_add.cu"
THREADS = 256
MAX_BLOCKS = 2**31 - 1
CHUNK_MIN = 32       # SEG_CHUNK_MIN of segsum.cuh
MAX_CHUNKS = 1024    # SEG_MAX_CHUNKS
FAN = 32             # SEG_FAN: children of a tree node
SCALAR_BELOW_D = 4   # row form with D < 4 runs the one-thread-per-chunk kernel (a warp would idle)


def chunk_len(k: int) -> int:
    """Chunk length of a row of ``k`` contributions (``seg_chunk_len``)."""
    L = CHUNK_MIN
    while -(-k // L) > MAX_CHUNKS:
        L *= 2
    return L


# --------------------------------------------------------------------------------------------------
# Shared argument checks


def check_rows(op: str, arg: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise KernelArgumentError(op, arg, f"expected an int, got {v!r}")
    if v < 0:
        raise KernelArgumentError(op, arg, f"expected a value >= 0, got {v}")
    return int(v)


def check_index(op: str, arg: str, t, *, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(op, arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise KernelArgumentError(op, arg, f"expected dtype torch.int64, got {t.dtype}")
    if t.device != device:
        raise KernelArgumentError(op, arg, f"expected a tensor on {device}, got one on {t.device}")
    return t


RANGE_CHECKS = ("sync", "device", "off")


@dataclass(frozen=True)
class RangeCheck:
    """How a scatter sum on the GPU checks its indices against [0, rows) (``check_range``):

    - ``"sync"`` (or True, the default): after the kernels are queued, one number is read back and a bad
      index raises KernelArgumentError naming it (the host waits for the GPU once per call);
    - ``"device"``: the kernels themselves fail on a bad index with a device-side assertion that prints the
      op and the index, as PyTorch's own CUDA index kernels do: no host synchronisation (CUDA-graph
      capture works), but the error surfaces at the next synchronisation and the CUDA context is lost;
    - ``"off"`` (or False): no check; bad indices add nothing (the kernels never touch memory out of
      bounds for them).

    The CPU models always check (their sort needs valid keys)."""
    op: str
    arg: str
    mode: str

    @property
    def sync(self) -> bool:
        return self.mode == "sync"

    @property
    def trap(self) -> np.int32:
        """The kernels' ``trap`` argument."""
        return np.int32(self.mode == "device")


def range_check(op: str, arg: str, check_range) -> RangeCheck:
    """``check_range`` (True, False or one of RANGE_CHECKS) as a RangeCheck for index argument ``arg``."""
    if check_range is True or check_range is False:
        return RangeCheck(op, arg, "sync" if check_range else "off")
    if not isinstance(check_range, str) or check_range not in RANGE_CHECKS:
        raise KernelArgumentError(op, "check_range", f"expected True, False or one of {RANGE_CHECKS}, got "
                                                     f"{check_range!r}")
    return RangeCheck(op, arg, check_range)


NO_CHECK = RangeCheck("", "", "off")
# The benchmarks time the variants as the routing runs them: range-checked in the kernels, no host
# synchronisation (torch's own CUDA kernels check the same way)
BENCH_KWARGS = (("check_range", "device"),)


def check_index_range(op: str, arg: str, index: torch.Tensor, rows: int) -> None:
    """Every index in [0, rows): one aminmax on the index's device, one transfer. Names the bad value
    (the smallest if one is negative, else the largest)."""
    if index.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(index)).tolist()  # one transfer
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise KernelArgumentError(op, arg, f"index {bad} is out of range for {rows} rows (expected 0 <= index < {rows})")


# --------------------------------------------------------------------------------------------------
# The scatter-sum machinery (segsum.cuh): row form (key (N,), src (N, D)) or element form (key and src
# (N, D), destination key * D + column).


def _key_dtype(space: int) -> tuple[torch.dtype, str, int]:
    """(dtype, name, offset): the narrowest signed key type holding destination - offset for every
    destination in [0, space] (space itself is the sentinel of out-of-range indices). Fewer bytes, fewer
    radix-sort passes: torch's radix sort runs one 8-bit pass per key byte, so 16-bit keys (up to 65535
    destinations, shifted by -32768) take 2 passes where int32 takes 4."""
    if space <= 2**16 - 1:
        return torch.int16, "i16", 2**15
    if space <= 2**32 - 1:
        return torch.int32, "i32", 2**31
    return torch.int64, "i64", 0


def _blocks(total: int) -> int:
    return max(1, min(cdiv(total, THREADS), MAX_BLOCKS))


def segsum_counts_cuda(source: str, key: torch.Tensor, rows: int) -> torch.Tensor:
    """counts (rows,) int64: how many keys equal each row (keys outside [0, rows) not counted); integer
    atomics, exact, no host synchronisation."""
    counts = torch.zeros(rows, device=key.device, dtype=torch.int64)
    if key.numel():
        launch(function(source, "segsum_count", key.device), (_blocks(key.numel()),), (THREADS,),
               (ptr(key), np.int64(key.numel()), np.int64(rows), ptr(counts)), device=key.device)
    return counts


def segsum_atomic_cuda(source: str, prefix: str, key: torch.Tensor, src: torch.Tensor, rows: int, *,
                       elementwise: bool = False, skip: int = -1, counts: torch.Tensor | None = None,
                       check: RangeCheck = NO_CHECK) -> torch.Tensor:
    """out (rows, D) = 0, then one atomicAdd per element of src (contiguous). Keys outside [0, rows) add
    nothing, or fail the kernel (``check`` device), or raise KernelArgumentError after the kernel is
    queued (``check`` sync: one aminmax and one transfer, the only host synchronisation)."""
    d = src.shape[1]
    out = torch.zeros((rows, d), device=src.device, dtype=torch.float32)
    total = src.numel()
    if total == 0:
        return out
    launch(function(source, f"{prefix}_atomic", src.device), (_blocks(total),), (THREADS,),
           (ptr(src), ptr(key), ptr(out), np.int64(total), np.int32(d), np.int32(elementwise), np.int64(skip),
            np.uint64(0) if counts is None else ptr(counts), np.int64(rows), check.trap), device=src.device)
    if check.sync:
        check_index_range(check.op, check.arg, key, rows)
    return out


FIXED_NOTE = ("no sort: terms rounded to int64 multiples of 2^-s (s from max |src| and the row count, so "
              "no sum overflows), int64 atomicAdd (exact, so any order gives the same bits), one rounding")
FIXED_MAX_BLOCKS = 1024  # blocks of segsum_fixed_max: one atomicMax each


def fixed_log2n(n: int) -> int:
    """c = ceil(log2 n) for n >= 1 source rows (0 for n <= 1): each output element has at most n terms."""
    return max(0, int(n) - 1).bit_length()


def fixed_shift(max_abs: float, n: int) -> int:
    """The fixed variant's shift s (``seg_fixed_shift``): terms become integers of 2^-s units, s = 62 -
    ceil(log2 n) - E with ``max_abs`` < 2^E; 0 when ``max_abs`` is 0."""
    bits = int(np.float32(abs(max_abs)).view(np.uint32))
    if bits == 0:
        return 0
    be = bits >> 23
    return 62 - fixed_log2n(n) - (-126 if be == 0 else be - 126)


FBIN_BITS = 9                 # SEG_FBIN_BITS: at most 2^9 bins
FBIN_WIDTH_MIN = 4096         # destinations per bin at least: a place tile's runs of one bin long
FBIN_WIDTH_MAX = 4096         # SEG_FBIN_WIDTH_MAX: one bin's shared accumulators (64 KB of limbs)
FBIN_THREADS = 256            # SEG_FBIN_THREADS (place)
FBIN_REDUCE_THREADS = 512     # SEG_FBIN_REDUCE_THREADS
FBIN_TILE = 2048              # SEG_FBIN_TILE: terms per place block
FBIN_PAGE = 16384             # SEG_FBIN_PAGE: entries per page of a bin (one reduce block each)
FBIN_MIN_TERMS_PER_DST = 4    # binned where the terms are at least this many times the destinations
FBIN_MAX_TERMS = 2**31 - 2**12  # int element numbers in the kernels (a tile past the last one included)
SCHEDULES = ("direct", "binned", "compact")
COMPACT_MAX_ROWS = 2**31 - 2  # the compact schedule's representatives hold a source row + 1 in 32 bits


def fbin_layout(space: int) -> tuple[int, int, int]:
    """(bb, nb, nbits) of the binned schedule over ``space`` destinations (at most FBIN_WIDTH_MAX x
    2^FBIN_BITS): bins of 2^bb of them (FBIN_WIDTH_MIN to FBIN_WIDTH_MAX), nb <= 2^FBIN_BITS bins, told
    apart by their nbits low bits."""
    if not 1 <= space <= FBIN_WIDTH_MAX << FBIN_BITS:
        raise ValueError(f"fbin_layout: {space} destinations; the binned schedule takes 1 to "
                         f"{FBIN_WIDTH_MAX << FBIN_BITS}")
    width = max(FBIN_WIDTH_MIN, 1 << max(0, cdiv(space, 1 << FBIN_BITS) - 1).bit_length())
    nb = cdiv(space, width)
    return width.bit_length() - 1, nb, max(0, nb - 1).bit_length()


def binned_takes(total: int, space: int, *, elementwise: bool, plain: bool = True) -> bool:
    """Whether the binned schedule can sum ``total`` terms into ``space`` destinations at all: the element
    form, ``plain`` (no skipped row, no count scaling), int element numbers, at most 2^FBIN_BITS bins of
    FBIN_WIDTH_MAX."""
    return elementwise and plain and total <= FBIN_MAX_TERMS and space <= (FBIN_WIDTH_MAX << FBIN_BITS)


def compact_takes(src_rows: int, *, elementwise: bool) -> bool:
    """Whether the compact schedule can sum ``src_rows`` source rows: the row form, at most
    COMPACT_MAX_ROWS of them."""
    return not elementwise and src_rows <= COMPACT_MAX_ROWS


def check_schedule(op: str, schedule: str | None) -> None:
    """A ``schedule`` argument of the fixed variant: None (the launcher chooses) or one of SCHEDULES."""
    if schedule not in (None, *SCHEDULES):
        raise KernelArgumentError(op, "schedule", f"expected one of {SCHEDULES}, got {schedule!r}")


def fixed_schedule(total: int, space: int, *, elementwise: bool, plain: bool = True,
                   src_rows: int | None = None) -> str:
    """The fixed variant's schedule for ``total`` terms into ``space`` destinations (segsum.cuh; all give
    the same bits): in the row form (``src_rows``, the source rows, required there), ``compact`` where
    there are fewer terms than destinations (fewer source rows than output rows: one accumulator row per
    source row, the output zero-filled beside; see compact_takes); ``binned`` for the element form
    (``plain``: no skipped row, no count scaling) where the terms are at least FBIN_MIN_TERMS_PER_DST per destination and the
    destinations fit 2^FBIN_BITS bins of FBIN_WIDTH_MAX; else ``direct``, one global atomic per term into
    an accumulator per destination. The binned one writes every term
    to memory and reads it back, and zeroes and flushes a bin's accumulators per page: it wins where the
    direct atomics keep meeting the same destinations, loses a little where they do not. On the H200
    (``bench/dev/segsum_phases.py``, eager, per call), 262144 x 32 terms into 10000 x 32 with 1% of each
    column on one hot row: binned 130 us, direct 184, the atomic variant 153; with 50%: 131 against 286
    (atomic 804); all on the hot row: 123 against 93 (a direct thread holds its one destination and adds
    it once). Uniform indices, 4 to 32 terms per destination (``--fixed-schedules``): binned 1.11x to
    1.21x the direct time; direct 1.20x to 1.40x the atomic variant's, binned 1.33x to 1.69x. Compact
    against direct (``--compact`` at 88a3b73, us a call), on every shape it swept with fewer source rows
    than output rows: embedding_bwd of 2048 Zipf tokens into 32000 x 768, 51.6 against 146.0; 16384 tokens
    177.9 against 219.9; 512 tokens 35.5 against 139.0; 2048 x 4096 into 32000 227.7 against 746.5; 4096 x
    512 into 50000 59.3 against 156.7; 10^5 x 16 into 10^6 87.4 against 151.0; index_add (uniform) of 10^5
    x 16 into 10^6 52.4 against 109.1; 16384 x 512 into 50000 153.7 against 204.2; 1024 x 256 into 10^5
    36.8 against 144.5. With as many source rows (index_add 50000 x 128 into 50000) 99.8 against 93.1, and
    more (10^6 x 64 into 10^5) 729.5 against 467.9: there an accumulator row per source row outweighs one
    per destination."""
    if not elementwise:
        if src_rows is None:
            raise ValueError("fixed_schedule: the row form needs src_rows")
        if total < space and compact_takes(src_rows, elementwise=False):
            return "compact"
    binned = binned_takes(total, space, elementwise=elementwise, plain=plain)
    return "binned" if binned and total >= FBIN_MIN_TERMS_PER_DST * space else "direct"


def segsum_fixed_cuda(source: str, prefix: str, key: torch.Tensor, src: torch.Tensor, rows: int, *,
                      elementwise: bool = False, skip: int = -1, counts: torch.Tensor | None = None,
                      check: RangeCheck = NO_CHECK, schedule: str | None = None) -> torch.Tensor:
    """out (rows, D): order-independent fixed-point sums (segsum.cuh, ``fixed``). One zero fill, then
    max, add and out (``direct``), or place, reduce and out (``binned``, element form only), or, with the
    output zero-filled on a second stream beside them, prep (max and each destination's representative
    row), add and the representatives' rows out (``compact``, row form only; ``schedule`` None:
    fixed_schedule's choice); no host synchronisation but a sync ``check``'s (as segsum_atomic_cuda). The
    shift comes from max |src| over every finite element of src and from its row count N; every schedule
    gives the same bits."""
    n_rows, d = src.shape
    dev = src.device
    total = src.numel()
    check_schedule(prefix, schedule)
    if total == 0:
        return torch.zeros((rows, d), device=dev, dtype=torch.float32)
    space = rows * d
    plain = skip < 0 and counts is None
    if schedule is None:
        schedule = fixed_schedule(total, space, elementwise=elementwise, plain=plain, src_rows=n_rows)
    elif schedule == "binned" and not binned_takes(total, space, elementwise=elementwise, plain=plain):
        raise KernelArgumentError(prefix, "schedule", "'binned' takes the element form only, with at most "
                                  f"{FBIN_MAX_TERMS} terms into {FBIN_WIDTH_MAX << FBIN_BITS} destinations "
                                  f"(got {total} into {space})")
    elif schedule == "compact" and not compact_takes(n_rows, elementwise=elementwise):
        raise KernelArgumentError(prefix, "schedule", "'compact' takes the row form only, with at most "
                                  f"{COMPACT_MAX_ROWS} source rows (got {n_rows}"
                                  f"{', the element form' if elementwise else ''})")
    if schedule == "compact":
        out = torch.empty((rows, d), device=dev, dtype=torch.float32)
        _fixed_compact(source, prefix, key, src, out, skip, counts, check)
        if check.sync:
            check_index_range(check.op, check.arg, key, rows)
        return out
    binned = schedule == "binned"
    bb, nb, nbits = fbin_layout(space) if binned else (0, 0, 0)
    words = cdiv(space, 8)  # 4 flag bits per output element
    # one zero fill: int64 accumulators | flag words | max |src| bits | (binned) the bins' cursors, the
    # page pool's counter, each bin's pages (nb x pages), each pool page's bin and place in it
    extra = nb + 1 + nb * cdiv(total, FBIN_PAGE) + 2 * (cdiv(total, FBIN_PAGE) + nb) if binned else 0
    buf = torch.zeros(space + cdiv(words + 1 + extra, 2), device=dev, dtype=torch.int64)
    acc = ptr(buf)
    flags = np.uint64(int(acc) + 8 * space)
    maxbits = np.uint64(int(flags) + 4 * words)
    log2n = np.int32(fixed_log2n(n_rows))
    if binned:
        pages = cdiv(total, FBIN_PAGE)  # the most one bin can fill
        cursor = int(maxbits) + 4
        pool = cursor + 4 * nb
        page_of = pool + 4
        page_bin = page_of + 4 * nb * pages
        page_idx = page_bin + 4 * (pages + nb)
        entries = torch.empty(((pages + nb) * FBIN_PAGE, 2), device=dev, dtype=torch.int32)  # (destination, bits)
        launch(function(source, f"{prefix}_fbin_place", dev), (cdiv(total, FBIN_TILE),), (FBIN_THREADS,),
               (ptr(src), ptr(key), np.int32(total), np.int32(d), np.int64(rows), np.int32(bb), np.int32(nb),
                np.int32(nbits), np.uint64(cursor), np.uint64(pool), np.uint64(page_of), np.int32(pages),
                np.uint64(page_bin), np.uint64(page_idx), ptr(entries), maxbits, check.trap), device=dev)
        limbs = 16 << bb  # four 32-bit limb sums per destination of a bin
        launch(function(source, "segsum_fbin_reduce", dev, smem=limbs), (pages + nb,), (FBIN_REDUCE_THREADS,),
               (ptr(entries), np.uint64(pool), np.uint64(page_bin), np.uint64(page_idx), np.uint64(cursor),
                np.int32(bb), acc, flags, maxbits, log2n), device=dev, shared_mem=limbs)
    else:
        launch(function(source, "segsum_fixed_max", dev), (_max_blocks(total),), (THREADS,),
               (ptr(src), np.int64(total), maxbits), device=dev)
        _fixed_add(source, prefix, key, src, acc, flags, maxbits, log2n, elementwise, skip, counts, rows, check,
                   np.uint64(0))
    out = torch.empty((rows, d), device=dev, dtype=torch.float32)
    launch(function(source, "segsum_fixed_out", dev), (_blocks(words),), (THREADS,),
           (acc, flags, ptr(out), np.int64(space), maxbits, log2n), device=dev)
    if check.sync:
        check_index_range(check.op, check.arg, key, rows)
    return out


def _max_blocks(total: int) -> int:
    """The grid of segsum_fixed_max (and segsum_fixed_prep) over ``total`` words: at most FIXED_MAX_BLOCKS."""
    return max(1, min(cdiv(total, 4 * THREADS), FIXED_MAX_BLOCKS))


def _fixed_add(source, prefix, key, src, acc, flags, maxbits, log2n, elementwise, skip, counts, rows, check, rep):
    """segsum_fixed_add over every element of src (``rep``: the compact schedule's representatives, or 0)."""
    total, d = src.numel(), src.shape[1]
    # a wave of 8 blocks per SM: each thread then adds several elements of one column (see the kernel)
    blocks = max(1, min(cdiv(total, THREADS), 8 * sm_count(src.device)))
    launch(function(source, f"{prefix}_fixed_add", src.device), (blocks,), (THREADS,),
           (ptr(src), ptr(key), acc, flags, np.int64(total), np.int32(d), np.int32(elementwise), np.int64(skip),
            np.uint64(0) if counts is None else ptr(counts), np.int64(rows), maxbits, log2n, rep, check.trap),
           device=src.device)


COMPACT_ZERO_BLOCKS_PER_SM = 2   # the compact schedule's zero fill (segsum_zero_cs) beside prep and add


def _fixed_compact(source, prefix, key, src, out, skip, counts, check) -> None:
    """The compact schedule into ``out`` (rows, D): its zero fill queued first on a second stream
    (segsum_zero_cs: streaming stores, which leave L2 to the accumulators; at most
    COMPACT_ZERO_BLOCKS_PER_SM blocks an SM, so that prep and add find room beside it), then on the caller's
    stream one small zero fill (max |src| and the representatives, rows words), prep (which zeroes the
    N x D accumulators and their flags), add, and after the join the representatives' rows out.

    H200, ``bench/dev/segsum_phases.py --compact``, us a call, each after an L2 flush. At 88a3b73, fill
    blocks an SM 2 / 4 / 8 / 16: embedding_bwd of 2048 Zipf tokens into a 32000 x 768 gradient 51.6 / 57.3 /
    56.2 / 55.3 (the sorted variant 51.8, the atomic one 37.7; 52.1 / 57.8 / 56.4 / 55.3 at 6048145); 512
    tokens 35.5 / 37.0 / 42.5 / 42.5; 4096 into 50000 x 512 59.3 / 64.0 / 63.2 / 61.6; 10^5 x 16 into 10^6
    87.4 / 86.3 / 87.3 / 88.8; index_add of 1024 x 256 into 10^5 rows 36.8 / 36.8 / 42.7 / 43.0; 10^5 x 16
    into 10^6 52.4 / 53.2 / 52.9 / 51.8. Tried at 9b0715f on the first shape, with the small zero fill queued
    before the fork (the fill waited for it), and dropped: the fill in plain stores (53.9 against 51.1
    streaming, 8 an SM); the fill queued after prep (55.9: the add, 8 blocks an SM, kept the SMs until it
    ended); no fill, a last kernel writing every destination, zeros included (53.9; in the timeline, calls
    queued back to back, prep 6.3, add 11.9 and that kernel 25.4, one after another, the call's kernels
    ending 48.2 us after its first began)."""
    n_rows, d = src.shape
    dev, total, rows = src.device, src.numel(), out.shape[0]
    words = cdiv(total, 8)   # 4 flag bits per accumulator element
    zero16 = cdiv(8 * total + 4 * words, 16)   # what prep zeroes, in 16-byte words
    buf = torch.empty(2 * zero16 + cdiv(1 + rows, 2), device=dev, dtype=torch.int64)
    acc = ptr(buf)
    flags = np.uint64(int(acc) + 8 * total)
    maxbits = np.uint64(int(acc) + 16 * zero16)
    rep = np.uint64(int(maxbits) + 4)
    log2n = np.int32(fixed_log2n(n_rows))
    join = zero_beside(source, out, dev, "segsum_zero_cs", COMPACT_ZERO_BLOCKS_PER_SM)
    try:
        buf[2 * zero16:].zero_()
        launch(function(source, "segsum_fixed_prep", dev), (_max_blocks(max(total, 2 * zero16)),), (THREADS,),
               (ptr(src), np.int64(total), ptr(key), np.int64(n_rows), np.int64(rows), np.int64(skip), rep, maxbits,
                acc, np.int64(zero16)), device=dev)
        _fixed_add(source, prefix, key, src, acc, flags, maxbits, log2n, False, skip, counts, rows, check, rep)
    finally:   # also on an error (out of memory, say): out must not be freed while the side stream fills it
        join()
    vec = 4 if d % 4 == 0 else 1
    launch(function(source, f"segsum_fixed_rows_out{vec}", dev), (_blocks(total // vec),), (THREADS,),
           (acc, flags, ptr(key), rep, ptr(out), np.int64(n_rows), np.int32(d), np.int64(rows), maxbits, log2n),
           device=dev)


def _vec(src: torch.Tensor, d: int) -> int:
    """Floats per lane in the warp kernel: the fewest column slices of 32 * VEC, then the smallest VEC
    (all 32 lanes busy, more source rows per round trip): D = 64 -> 2, 128 and 512 -> 4, 17 -> 1."""
    ok = [v for v in (1, 2, 4) if d % v == 0 and src.data_ptr() % (4 * v) == 0]
    fewest = min(cdiv(d, 32 * v) for v in ok)
    return min(v for v in ok if cdiv(d, 32 * v) == fewest)


MAX_GRID_Y = 65535


SORT_MAX = 16384          # SEG_SORT_MAX: up to this many keys (int16 ones), one block sorts them
SORT_THREADS = 1024
SORT_SMEM = (2 * SORT_MAX + 257 * 32 + 32) * 4   # SEG_SORT_SMEM
SPLITS = ("rows", "tiles", "fill", "gaps", "once")   # tiles, gaps, once: no default takes them (default_split)
ZERO_BLOCKS_PER_SM = 2  # the fill split's zero fill (FILL_ZERO): its grid beside the sort
GAP_BLOCKS_PER_SM = 8   # segsum_zero_gaps' grid beside the sums (see default_split)
GAP_MAX_WIDTH = (2**31 - 1) // 32   # segsum_zero_gaps indexes a tile of 32 destinations' floats in int
ONCE_BLOCKS_PER_SM = 4  # SEG_ONCE_BLOCKS: segsum_once's resident blocks an SM (see once_grid)
ONCE_PER_MAX = 8        # SEG_WARPS: tiles of 32 destinations a segsum_once block takes at once, at most
LONG_GROUP = 1          # the once split's long-rows kernel: warps per tile of 32 sorted positions (see --once)
ONCE_ORDERS = ("beside", "after", "first")   # segsum_once beside the long rows, after them, or before them
ONCE_ORDER = "beside"


# The fill split's zero fill: streaming stores (segsum_zero_cs; segsum_zero: plain ones). H200,
# bench/dev/segsum_phases.py --compact at 88a3b73, us a call, streaming against plain: 2048 Zipf tokens
# into a 32000 x 768 gradient 51.8 / 52.8 (the sums after the fill 15.2 us in the timeline; 18.6 with plain
# stores at 9b0715f); 16384 tokens 75.9 / 77.0; 4096 into 50000 x 512 64.8 / 67.1; index_add 10^5 x 16
# into 10^6 rows 98.2 / 102.6; 16384 x 512 into 50000 65.0 / 67.0; faster or level on 10 of the 12 shapes,
# slower on 2048 x 4096 into 32000 (176.4 / 174.1) and 1024 x 256 into 10^5 (41.9 / 41.8).
FILL_ZERO = "segsum_zero_cs"
FILL_UP_TO = 16  # contributions per destination, on average, up to which the warp kernels take the fill split


def default_split(n: int, space: int, scalar: bool) -> str:
    """The sorted kernels' task split for n contributions into ``space`` destinations (segsum.cuh), from
    ``bench/dev/segsum_phases.py``. ``fill`` where most destinations are empty (n < space; H200, --splits,
    index_add 1e5 x 16 into 1e6 rows: 128 us, tiles 158, rows 449), and in the warp kernels up to
    FILL_UP_TO contributions per destination: the tiles split, which sums the chunk 0 of 32 destinations
    one after another in one warp, is several times slower on skewed keys, where a few rows take most
    contributions (H100, --skew at 1d868f3, Zipf keys: 2048 x 768 into 2000 rows: fill 44.5 us, rows 35.2,
    tiles 219.4; 16384 x 768 into 8000: fill 72.1, rows 86.7, tiles 488.6; 1e6 x 64 into 1e5: fill 287.8,
    rows 331.2, tiles 575.1), and at most 1.12x faster on uniform keys (1e6 x 64 into 1e5: tiles 217.3,
    fill 242.3; 16384 x 768 into 8000: fill 60.5, tiles 76.9); beyond, ``rows``, which needs no zero pass
    (H200, --splits, 1e6 x 64 into 1000 rows: rows 219 us, fill 215, tiles 445). The thread kernel (no
    tiles) takes ``rows`` from n >= space. No default takes ``gaps`` (the zeros after the sort, beside the
    sums): beside the zero stores the latency-bound sums slow two- to fourfold, so it gains a few percent on
    some shapes and loses up to 1.5x on others (H200, --gaps at 7da88da, plain zero stores, 8 blocks an SM,
    us: 2048 Zipf tokens into a 32000 x 768 gradient, gaps 53.5, fill 52.8, the sums kernel 39.4 beside the
    zeros; 16384 tokens 84.1, fill 77.6; index_add 1e5 x 16 into 1e6 rows 148.2, fill 100.7; 1e6 x 64 into
    1e5 208.9, fill 217.0; --gap-builds at 06c83cf, streaming stores as now: 2048 tokens 54.7, fill 53.2;
    512 tokens 50.6, fill 54.0; 16384 tokens 84.1, fill 78.0; 4096 into 50000 x 512 67.6, fill 66.8). Nor
    ``once`` (segsum_once: the zeros and the rows of one chunk in one pass): its kernel alone takes twice a
    plain fill where it zeroes most of the output (H200, 2048 Zipf tokens into a 32000 x 768 gradient:
    segsum_once 50.3 us alone, --once-builds at ff35d5c; segsum_zero 23.2, --once at e0928e6), so the call
    is slower on every embedding shape (2048 tokens: 71.0 against fill 52.4, --once at 31fc4ea; 84.0
    against 52.9, --once-builds at ff35d5c; 16384 tokens 116.2 against 77.7, 4096 into 50000 x 512 67.2
    against 66.4, both 31fc4ea); it was faster only where every destination has a few contributions and
    nothing is zeroed (1e6 x 64 into 1e5 uniform, long rows at one warp a tile: 183.8 and 183.7 against
    fill 215.9 and 219.9, 31fc4ea and e0928e6)."""
    return "fill" if (n < space if scalar else n <= FILL_UP_TO * space) else "rows"


FILL_GROUPS = (1, 2, 4, 8, 16, 32)   # warps that may share a tile of 32 sorted positions (the fill split)
FILL_GROUP_MAX = 8
SUMS_BLOCKS = 3                       # SEG_SUMS_BLOCKS: blocks of the fill and tiles kernels an SM


def fill_group(tasks: int, dev: torch.device) -> int:
    """Warps per tile of sorted positions in the fill split's warp kernel, for ``tasks`` (tile, column
    slice) pairs: doubled, up to FILL_GROUP_MAX, while twice as many warps still fit on the GPU at once
    (SUMS_BLOCKS blocks of 8 an SM). Few tiles (few keys) leave most SMs idle, and each warp's chain of
    dependent loads (its tile's rows, one after another) is then the kernel's time: more warps share the
    rows out. H200, bench/dev/segsum_phases.py --groups at 472eaee, us a call (its sums kernel): 2048 Zipf
    tokens into a 32000 x 768 gradient (64 x 6 tasks: 8 warps), 1 warp 63.6 (29.4), 2: 60.4 (25.9), 4: 52.4
    (18.7), 8: 52.8 (18.6), 16: 55.0 (21.0); 1024 x 256 into 10^5 rows (8), 1: 54.2 (17.3), 8: 41.9 (5.1);
    16384 x 768 (1), 1: 78.3, 2: 86.9; 10^6 x 64 into 10^5 (1), 1: 222.4, 2: 274.1."""
    capacity = SUMS_BLOCKS * (THREADS // 32) * sm_count(dev)
    g = 1
    while g < FILL_GROUP_MAX and tasks * 2 * g <= capacity:
        g *= 2
    return g


MSORT_TILE = 2048            # SEG_MSORT_TILE: keys per block of the tile sort
MSORT_THREADS = 256          # SEG_MSORT_THREADS
MSORT_MAX = 32768            # SEG_MSORT_MAX: the merge sort takes up to this many keys
MSORT_MERGE_THREADS = 1024   # SEG_MSORT_MERGE_THREADS
MSORT_STARTS_FUSED = 2**21   # the merge writes the starts where (space + 1) * tiles is at most this
SMEM_PER_SM = 227 * 1024     # an H100/H200 SM's shared memory for blocks
RSORT_TILE = 2048            # SEG_RSORT_TILE: keys per block of the radix sort's count and place
RSORT_THREADS = 256          # SEG_RSORT_THREADS
RSORT_BITS = 9               # SEG_RSORT_BITS: most bits per digit
RSORT_MAX = 2**31 - 1        # positions are 32-bit between the passes
RANK_THREADS = 256           # SEG_RANK_THREADS
RANK_MAX = 65536             # SEG_RANK_MAX: the rank sort takes up to this many keys
SORTS = ("merge", "one_block", "radix", "rank", "torch")


RANK_UP_TO = 4096  # keys up to which the rank sort is the default


def default_sort(n: int, kname: str) -> str:
    """The key sort for n keys of type ``kname``, from ``bench/dev/segsum_phases.py --sorts`` on the H200
    at 1b152d9 (n keys into 50000 rows unless said, us per call incl. the row starts): ``rank`` for int16
    and int32 keys up to RANK_UP_TO (1024 keys: 10.9, one block 13.8, merge 18.1; 2048 into 32000 rows:
    11.3, one block 16.1, merge 18.2; 4096: 14.1, merge 19.0, one block 21.3; 2048 into 10^6 rows: 22.5,
    merge 30.2); ``merge`` up to MSORT_MAX (8192: 20.3; 16384:
    23.5, one block 49.9, torch 44.8; 32768: 28.1, radix 34.0; 16384 into 10^6 rows: 49.1, radix 59.5);
    ``radix`` beyond, up to RSORT_MAX (65536: 35.2, torch 48.1; 10^6 keys into 10^5 rows: 65.4, torch
    116.2; 8388608 keys into 320000: 374.1, torch 504.1); ``torch`` for int64 keys and beyond."""
    return next((m for m in ("rank", "merge", "radix") if sort_takes(m, n, kname) and
                 (m != "rank" or n <= RANK_UP_TO)), "torch")


def sort_takes(method: str, n: int, kname: str) -> bool:
    """Whether sort_keys' ``method`` (not ``torch``, which takes any) sorts n keys of type ``kname``."""
    if method == "one_block":
        return kname == "i16" and n <= SORT_MAX
    limit = {"merge": MSORT_MAX, "radix": RSORT_MAX, "rank": RANK_MAX}[method]
    return kname in ("i16", "i32") and n <= limit


def sort_keys(source: str, prefix: str, key: torch.Tensor, rows: int, *, width: int = 0,
              check: RangeCheck = NO_CHECK, method: str | None = None):
    """(skey, perm, start, key type name, offset): the destinations of ``key`` (row form, ``width`` 0:
    key[e]; element form: key[e] * width + e % width; ``rows * max(width, 1)`` for a key outside [0, rows),
    or a device-side assertion with a ``check`` device), narrowed to the smallest key type (_key_dtype:
    stored as destination - offset), sorted stably: perm[p] is the element at sorted position p; and
    start[m], the first sorted position with a destination >= m, for m = 0 .. space (start[space]: the
    valid keys). ``method`` (default: default_sort): ``rank``, each key's position counted over all the
    keys (up to RANK_MAX int16 or int32 keys; O(n^2) comparisons over many blocks); ``merge``, a tile sort
    and a merge by rank that also writes the starts where they are few enough (segsum.cuh; two launches);
    ``one_block``, one block sorts up to SORT_MAX int16 keys; ``radix``, a radix sort of the destinations'
    significant bits only (int16 and int32 keys, radix_sort: three launches per pass of up to 9 bits);
    ``torch``, the keys kernel then torch.sort(stable=True). The starts kernel after each but a fused
    merge. All give the same skey, perm and start."""
    n = key.numel()
    dev = key.device
    space = rows * width if width else rows
    ktype, kname, offset = _key_dtype(space)
    passes = 1 if space <= 255 else 2  # the one-block sort's 8-bit digits (the sentinel, space, included)
    if method is None:
        method = default_sort(n, kname)
    elif method not in SORTS:
        raise KernelArgumentError(prefix, "method", f"expected one of {SORTS}, got {method!r}")
    if method == "merge" and not sort_takes(method, n, kname):
        raise KernelArgumentError(prefix, "method", f"{n} keys into {space} destinations: the merge sort takes "
                                                    f"up to {MSORT_MAX} keys into at most {2**32 - 1}")
    if method == "rank" and not sort_takes(method, n, kname):
        raise KernelArgumentError(prefix, "method", f"{n} keys into {space} destinations: the rank sort takes "
                                                    f"up to {RANK_MAX} keys into at most {2**32 - 1}")
    if method == "one_block" and not sort_takes(method, n, kname):
        raise KernelArgumentError(prefix, "method", f"{n} keys into {space} destinations: the one-block sort "
                                                    f"takes up to {SORT_MAX} keys into at most 65535")
    if method == "radix" and not sort_takes(method, n, kname):
        raise KernelArgumentError(prefix, "method", f"{n} keys into {space} destinations: the radix sort takes "
                                                    f"up to {RSORT_MAX} keys into at most {2**32 - 1}")
    start = torch.empty(space + 1, device=dev, dtype=torch.int64)
    if method == "torch":
        keys = torch.empty(n, device=dev, dtype=ktype)
        if n:
            launch(function(source, f"{prefix}_keys_{kname}", dev), (_blocks(n),), (THREADS,),
                   (ptr(key), ptr(keys), np.int64(n), np.int64(width), np.int64(rows), np.int64(offset), check.trap),
                   device=dev)
        skey, perm = torch.sort(keys, stable=True)
    else:
        skey = torch.empty(n, device=dev, dtype=ktype)
        perm = torch.empty(n, device=dev, dtype=torch.int64)
        if method == "merge" and _merge_sort(source, prefix, kname, key, skey, perm, start, width, rows, offset, check):
            return skey, perm, start, kname, offset
        if method == "radix" and n:
            radix_sort(source, prefix, key, skey, perm, rows, width=width, offset=offset, check=check)
        if method == "rank" and n:
            launch(function(source, f"{prefix}_rank_{kname}", dev), (cdiv(n, 32),), (RANK_THREADS,),
                   (ptr(key), ptr(skey), ptr(perm), np.int32(n), np.int64(width), np.int64(rows), np.int64(offset),
                    check.trap), device=dev)
        if method == "one_block" and n:
            launch(function(source, f"{prefix}_sort_i16", dev, smem=SORT_SMEM), (1,), (SORT_THREADS,),
                   (ptr(key), ptr(skey), ptr(perm), np.int32(n), np.int64(width), np.int64(rows), np.int64(offset),
                    np.int32(passes), check.trap), device=dev, shared_mem=SORT_SMEM)
    launch(function(source, f"{prefix}_starts_{kname}", dev), (_blocks(space + 1),), (THREADS,),
           (ptr(skey), np.int64(n), np.int64(space), np.int64(offset), ptr(start)), device=dev)
    return skey, perm, start, kname, offset


def radix_digits(space: int) -> tuple[int, int]:
    """(passes, bits per digit) of the radix sort for destinations 0 .. space (the sentinel included):
    the fewest passes of at most RSORT_BITS bits, the bits spread evenly (10^5 rows: 17 bits, 2 x 9)."""
    b = max(1, int(space).bit_length())
    passes = cdiv(b, RSORT_BITS)
    return passes, cdiv(b, passes)


def radix_words(n: int, passes: int, bits: int) -> int:
    """The radix sort's int32 workspace: counts [tile][digit], their prefixes [digit][tile], the digits'
    totals, then (with two passes or more) 32-bit keys and positions between the passes in two buffers,
    alternating."""
    digits, tiles = 1 << bits, cdiv(n, RSORT_TILE)
    return digits * (2 * tiles + 1) + 2 * n * min(passes - 1, 2)


def radix_sort(source: str, prefix: str, key: torch.Tensor, skey: torch.Tensor, perm: torch.Tensor, rows: int,
               *, width: int = 0, offset: int, check: RangeCheck = NO_CHECK) -> None:
    """sort_keys' ``radix`` (segsum.cuh): the destinations of ``key`` (as sort_keys) sorted stably into
    ``skey`` (int16 or int32, destination - ``offset``) and ``perm`` (int64), by radix_digits' passes of
    three launches each (count, scan, place). No host synchronisation; n >= 1 keys, up to RSORT_MAX."""
    n = key.numel()
    dev = key.device
    passes, bits = radix_digits(rows * width if width else rows)
    digits, tiles = 1 << bits, cdiv(n, RSORT_TILE)
    ws = torch.empty(radix_words(n, passes, bits), device=dev, dtype=torch.int32)
    counts = ws.data_ptr()
    tile_prefix = counts + 4 * digits * tiles
    totals = tile_prefix + 4 * digits * tiles
    between = [(totals + 4 * digits + 8 * n * b, totals + 4 * digits + 8 * n * b + 4 * n) for b in range(2)]
    kname = {torch.int16: "i16", torch.int32: "i32"}[skey.dtype]
    count, scan = function(source, f"{prefix}_rsort_count", dev), function(source, "segsum_rsort_scan", dev)
    place = function(source, f"{prefix}_rsort_place_{kname}", dev)
    common = (np.int64(n), np.int64(width), np.int64(rows))
    for p in range(passes):   # launches configured once per shape (Launch.of), pointers per call
        kin, vin = (0, 0) if p == 0 else between[(p - 1) % 2]
        shift = (np.int32(bits * p), np.int32(bits))
        Launch.of(count, (tiles,), (RSORT_THREADS,), (SLOT, SLOT, *common, *shift, SLOT,
                                                      check.trap if p == 0 else np.int32(0)), device=dev)(
            key.data_ptr(), kin, counts)
        Launch.of(scan, (digits,), (RSORT_THREADS,), (SLOT, np.int32(tiles), SLOT, SLOT), device=dev)(
            counts, tile_prefix, totals)
        out = (0, 0, skey.data_ptr(), perm.data_ptr()) if p == passes - 1 else (*between[p % 2], 0, 0)
        Launch.of(place, (tiles,), (RSORT_THREADS,), (SLOT, SLOT, SLOT, *common, *shift, SLOT, SLOT, SLOT, SLOT, SLOT,
                                                      SLOT, np.int64(offset)), device=dev)(
            key.data_ptr(), kin, vin, tile_prefix, totals, *out)


def _merge_sort(source, prefix, kname, key, skey, perm, start, width, rows, offset, check) -> bool:
    """sort_keys' merge: the tile sort, then the merge by rank into skey and perm; True where the merge
    also wrote the starts ((space + 1) * tiles <= MSORT_STARTS_FUSED)."""
    n = key.numel()
    dev = key.device
    space = rows * width if width else rows
    tiles = cdiv(n, MSORT_TILE)
    scratch = torch.empty((2, max(1, tiles) * MSORT_TILE), device=dev, dtype=torch.int32)  # destinations, positions
    if n:
        launch(function(source, f"{prefix}_msort_tile_{kname}", dev), (tiles,), (MSORT_THREADS,),
               (ptr(key), ptr(scratch[0]), ptr(scratch[1]), np.int64(n), np.int64(width), np.int64(rows), check.trap),
               device=dev)
    fused = (space + 1) * tiles <= MSORT_STARTS_FUSED
    smem = 4 * tiles * MSORT_TILE  # every tile's destinations
    per_sm = max(1, min(2048 // MSORT_MERGE_THREADS, SMEM_PER_SM // max(smem, 1)))
    blocks = max(1, min(cdiv(n + (space + 1 if fused else 0), MSORT_MERGE_THREADS), per_sm * sm_count(dev)))
    launch(function(source, f"{prefix}_msort_merge_{kname}", dev, smem=smem), (blocks,),
           (MSORT_MERGE_THREADS,), (ptr(scratch[0]), ptr(scratch[1]), np.int64(n), np.int64(space), np.int64(offset),
                                    np.int32(fused), ptr(skey), ptr(perm), ptr(start)), device=dev, shared_mem=smem)
    return fused


def once_grid(space: int, dev: torch.device) -> tuple[int, int]:
    """(blocks, per): segsum_once's grid over ``space`` destinations and the tiles of 32 a block takes at
    once: the fewest per (at most ONCE_PER_MAX) that let ONCE_BLOCKS_PER_SM blocks an SM hold every tile
    in one wave, and a grid of at most that many blocks (a grid-stride loop beyond)."""
    tiles, resident = cdiv(space, 32), ONCE_BLOCKS_PER_SM * sm_count(dev)
    per = max(1, min(ONCE_PER_MAX, cdiv(tiles, resident)))
    return max(1, min(cdiv(tiles, per), resident)), per


def zero_beside(source: str, out: torch.Tensor, dev: torch.device, kernel: str, per_sm: int):
    """+0.0 into ``out`` on a second stream (``kernel``: segsum_zero or segsum_zero_cs, a grid of at most
    ``per_sm`` blocks an SM: room for the kernels queued beside it); returns ``join``, which the caller's
    stream must run before anything there touches ``out`` (see fork)."""
    side, join = fork(dev)
    with torch.cuda.stream(side):
        launch(function(source, kernel, dev), (max(1, min(cdiv(out.numel(), 4 * THREADS), per_sm * sm_count(dev))),),
               (THREADS,), (ptr(out), np.int64(out.numel())), device=dev)
    return join


def gap_blocks(space: int, dev: torch.device) -> int:
    """segsum_zero_gaps' grid over ``space`` destinations: a block per 32, at most GAP_BLOCKS_PER_SM an SM."""
    return max(1, min(cdiv(space, 32), GAP_BLOCKS_PER_SM * sm_count(dev)))


def segsum_sorted_cuda(source: str, prefix: str, key: torch.Tensor, src: torch.Tensor, rows: int, *,
                       elementwise: bool = False, skip: int = -1, scaled: bool = False,
                       force_scalar: bool = False, split: str | None = None, group: int | None = None,
                       check: RangeCheck = NO_CHECK) -> torch.Tensor:
    """out (rows, D): each destination's contributions in source order, chunked, fixed tree (see the
    module docstring). No host synchronisation: keys (narrowed, bad ones to a sentinel) and their stable
    sort (sort_keys: a rank sort, or a tile sort and a merge by rank, or a radix sort; torch.sort for int64
    keys), row starts, sums. Task splits (``split``, default: default_split; ``group``: the warps that
    share a tile of sorted positions in the fill, gaps and once splits' warp kernel, default fill_group, in
    once LONG_GROUP; no other split nor the thread kernel takes it; all sum the same chunks in the same
    order, so give the same bits): ``rows``: a task per destination (it writes the row, zeros where empty:
    no zero fill) and per 32 sorted positions; ``tiles`` (warp
    kernels): a task per 32 destinations instead (zeros for the empty ones, rows of one contribution read
    lane-parallel); ``fill``: the output is zero-filled on a second stream while the keys are sorted, and
    the sums, after the fill, take only the tiles of 32 sorted positions; ``gaps``: the sums as in
    ``fill`` over an unfilled output, beside them on a second stream (after the sort) segsum_zero_gaps
    zeroes the destinations no key reaches (gap_blocks: at most GAP_BLOCKS_PER_SM blocks an SM); ``once`` (warp
    kernels): every destination written once, no zero fill: the rows of more than CHUNK_MIN contributions by
    the warp kernel's position tiles (at VEC 1, LONG_GROUP warps a tile), and beside them on a second
    stream segsum_once, which sums the rows of 1 to CHUNK_MIN and zeroes the empty ones in one pass
    (once_grid). The thread kernel knows ``rows``, ``fill`` and ``gaps`` (``tiles`` and ``once`` run as
    ``fill``).
    Keys outside [0, rows) add nothing, or fail the keys kernel (``check`` device), or raise
    KernelArgumentError after the kernels are queued (``check`` sync: start[space], the count of valid
    keys, read back). ``force_scalar`` runs the one-thread-per-chunk kernel in the row form (same bits;
    for tests)."""
    if group is not None and (isinstance(group, bool) or not isinstance(group, (int, np.integer)) or
                              group not in FILL_GROUPS):
        raise KernelArgumentError(prefix, "group", f"expected one of {FILL_GROUPS}, got {group!r}")
    d = src.shape[1]
    dev = src.device
    n = key.numel()
    if n == 0 or d == 0:
        return torch.zeros((rows, d), device=dev, dtype=torch.float32)
    space, width = (rows * d, 1) if elementwise else (rows, d)
    scalar = elementwise or width < SCALAR_BELOW_D or force_scalar
    if split is None:
        split = default_split(n, space, scalar)
    elif split not in SPLITS:
        raise KernelArgumentError(prefix, "split", f"expected one of {SPLITS}, got {split!r}")
    if split == "once" and ONCE_ORDER not in ONCE_ORDERS:
        raise KernelArgumentError(prefix, "split", f"index_add.ONCE_ORDER: expected one of {ONCE_ORDERS}, got "
                                                   f"{ONCE_ORDER!r}")
    if scalar and split in ("tiles", "once"):
        split = "fill"
    if split in ("gaps", "once") and width > GAP_MAX_WIDTH:
        split = "fill"
    out = torch.empty((rows, d), device=dev, dtype=torch.float32)
    join = zero_beside(source, out, dev, FILL_ZERO, ZERO_BLOCKS_PER_SM) if split == "fill" else None  # beside the sort
    try:
        return _sorted_sums(source, prefix, key, src, out, split, scalar, elementwise, skip, scaled, check, join,
                            group)
    except BaseException:
        if join is not None:  # an error before the sums (out of memory, say): out must not be freed
            join()            # while the side stream may still be filling it
        raise


def _sorted_sums(source, prefix, key, src, out, split, scalar, elementwise, skip, scaled, check, join, group):
    """segsum_sorted_cuda after its checks and zero fill: sort, row starts, sums into ``out`` (``join``:
    the current stream waits for the fill on the side stream before the sums, None without one;
    ``group``: segsum_sorted_cuda's); in the gaps split, segsum_zero_gaps on the side stream beside the
    sums, in the once split segsum_once; the current stream waits for it before returning."""
    d = src.shape[1]
    dev = src.device
    n = key.numel()
    rows = out.shape[0]
    space, width = (rows * d, 1) if elementwise else (rows, d)
    skey, perm, start, kname, offset = sort_keys(source, prefix, key, rows, width=d if elementwise else 0,
                                                 check=check)
    vec = 1 if scalar else _vec(src, width)
    once = split == "once"   # segsum_once at `vec`; the long rows in the warp kernel at VEC 1
    slices = 1 if scalar else cdiv(width, 32 * (1 if once else vec))
    slots = max(1, 2 * (n // CHUNK_MIN))
    part = torch.empty((2, slots, width), device=dev, dtype=torch.float32)
    counters = ticket_counters(dev, 2 * slots * slices)  # left at zero by the kernel's last arrivals
    fill = split in ("fill", "gaps", "once")   # the sums take position tiles only: other kernels write the rest
    if fill and not scalar:   # the kernel's `fill`: the warps per tile of sorted positions
        fill = int(group) if group is not None else LONG_GROUP if once else fill_group(cdiv(n, 32) * slices, dev)
    args = (ptr(src), ptr(skey), ptr(perm), ptr(start), ptr(out), ptr(part[0]), ptr(part[1]), ptr(counters),
            np.uint64(int(ptr(counters)) + 4 * slots * slices), np.int64(n), np.int32(width), np.int64(skip),
            np.int32(scaled), np.int64(space), np.int64(offset), np.int32(fill))
    if join is not None:
        join()

    def sums():
        if scalar:  # a thread per destination (rows) and per sorted position
            launch(function(source, f"{prefix}_scalar_{kname}", dev), (_blocks((0 if fill else space) + n),),
                   (THREADS,), args, device=dev)
            return
        # a warp per destination (or 32 of them; or none) and per 32 sorted positions (fill, gaps: `fill`
        # warps per 32); grid rows: slices
        warps = {"rows": space, "tiles": cdiv(space, 32)}.get(split, 0) + cdiv(n, 32) * max(1, int(fill))
        kernel = f"{prefix}_rows{vec}{ {'rows': '', 'tiles': '_tiles'}.get(split, '_fill')}_{kname}"
        if once:
            kernel = f"{prefix}_rows1_long_{kname}"
        launch(function(source, kernel, dev), (max(1, min(cdiv(warps, THREADS // 32), MAX_BLOCKS)),
                                               min(slices, MAX_GRID_Y)), (THREADS,), args, device=dev)

    if split == "gaps" or (once and ONCE_ORDER == "beside"):
        side, rejoin = fork(dev)
    if split == "gaps":  # zeros where no key goes, queued first (then the sums fill the GPU around them)
        try:
            with torch.cuda.stream(side):
                launch(function(source, "segsum_zero_gaps", dev), (gap_blocks(space, dev),), (THREADS,),
                       (ptr(start), ptr(out), np.int64(space), np.int32(width), np.int64(skip)), device=dev)
            sums()
        finally:
            rejoin()
    elif once:  # the long rows first, here (right after the starts), every other row beside them in one pass
        blocks, per = once_grid(space, dev)

        def short_rows():   # segsum_once: the empty rows and those of one chunk
            launch(function(source, f"segsum_once{vec}", dev), (blocks,), (THREADS,),
                   (ptr(src), ptr(perm), ptr(start), ptr(out), np.int32(width), np.int64(skip), np.int32(scaled),
                    np.int64(space), np.int32(per)), device=dev)
        if ONCE_ORDER == "beside":
            try:
                sums()
                with torch.cuda.stream(side):
                    short_rows()
            finally:
                rejoin()
        else:   # one stream: segsum_once before or after the long rows
            for f in (short_rows, sums) if ONCE_ORDER == "first" else (sums, short_rows):
                f()
    else:
        sums()
    if check.sync and int(start[space]) != n:  # the one host synchronisation, after the work is queued
        check_index_range(check.op, check.arg, key, rows)
    return out


# --------------------------------------------------------------------------------------------------
# CPU order models (Numba: one float32 addition per contribution, in the kernels' order)


@functools.lru_cache(maxsize=None)
def _jit():
    import numba

    tiny = F32(np.finfo(F32).tiny)

    @numba.njit(cache=False)
    def ftz(x):
        # float atomicAdd flushes subnormal operands and results to sign-preserving zero
        return x * F32(0.0) if abs(x) < tiny else x

    node = halving32_jit()   # a 32-ary tree node: halving tree over its 32 children

    @numba.njit(cache=False)
    def sorted_sum(keys, vals, order, skip, out):
        # keys (n,), vals (n, D), order: a stable argsort of keys (so a row's contributions in source order)
        n, d = vals.shape
        part = np.zeros((MAX_CHUNKS, d), np.float32)
        nodes = np.zeros((FAN, d), np.float32)
        v = np.zeros(FAN, np.float32)
        p = 0
        while p < n:
            m = keys[order[p]]
            e = p + 1
            while e < n and keys[order[e]] == m:
                e += 1
            k = e - p
            if m != skip:
                L = CHUNK_MIN
                while (k + L - 1) // L > MAX_CHUNKS:
                    L *= 2
                nc = (k + L - 1) // L
                for c in range(nc):
                    lo = p + c * L
                    hi = min(lo + L, e)
                    for j in range(d):
                        acc = F32(0.0)
                        for q in range(lo, hi):
                            acc = acc + vals[order[q], j]
                        part[c, j] = acc
                if nc == 1:
                    for j in range(d):
                        out[m, j] = part[0, j]
                else:
                    ng = (nc + FAN - 1) // FAN
                    for g in range(ng):
                        cnt = min(FAN, nc - FAN * g)
                        for j in range(d):
                            for i in range(FAN):
                                v[i] = part[FAN * g + i, j] if i < cnt else F32(0.0)
                            nodes[g, j] = node(v)
                    for j in range(d):
                        if ng == 1:
                            out[m, j] = nodes[0, j]
                        else:
                            for i in range(FAN):
                                v[i] = nodes[i, j] if i < ng else F32(0.0)
                            out[m, j] = node(v)
            p = e

    @numba.njit(cache=False)
    def arrival_sum(keys, vals, order, u, skip, out):
        # Each output element's contributions in a uniformly random order (Fisher-Yates driven by the
        # uniforms u, one per contribution and column), independent across elements, from +0.0 with
        # atomicAdd's flush.
        n, d = vals.shape
        buf = np.empty(n, np.float32)
        p = 0
        while p < n:
            m = keys[order[p]]
            e = p + 1
            while e < n and keys[order[e]] == m:
                e += 1
            k = e - p
            if m != skip:
                for j in range(d):
                    for q in range(k):
                        buf[q] = vals[order[p + q], j]
                    for q in range(k - 1, 0, -1):
                        r = min(int(u[order[p + q], j] * (q + 1)), q)
                        buf[q], buf[r] = buf[r], buf[q]
                    acc = F32(0.0)
                    for q in range(k):
                        acc = ftz(acc + ftz(buf[q]))
                    out[m, j] = acc
            p = e

    return sorted_sum, arrival_sum


def scaled_values(key: np.ndarray, vals: np.ndarray, rows: int) -> np.ndarray:
    """Each value divided by its destination's count, one float32 rounding (the kernels' __fdiv_rn)."""
    counts = np.bincount(key, minlength=rows).astype(F32)
    return (vals / counts[key][:, None]).astype(F32)


FLAG_NAN, FLAG_POS_INF, FLAG_NEG_INF = 1, 2, 4  # SEG_FLAG_* of segsum.cuh


def fixed_sum(dst: np.ndarray, vals: np.ndarray, space: int, s: int) -> np.ndarray:
    """The fixed variant's sums (float32, ``space``) of the terms ``vals`` (float32) into the elements
    ``dst``: every finite term rounded to the nearest integer multiple of 2^-s (ties to even), the integers
    summed exactly (int64: they cannot overflow, see segsum.cuh), each sum rounded to float32 (int64 ->
    float32 to nearest even, times 2^-s in float64, narrowed); NaN where a term is NaN or both infinities
    occur, else the infinity where one occurs."""
    fin = np.isfinite(vals)
    q = np.rint(vals[fin].astype(np.float64) * 2.0**s).astype(np.int64)
    acc = np.zeros(space, np.int64)
    np.add.at(acc, dst[fin], q)  # integer sums: exact, so any order gives these
    out = (acc.astype(F32).astype(np.float64) * 2.0**-s).astype(F32)
    if not fin.all():
        bad, v = dst[~fin], vals[~fin]
        flags = np.zeros(space, np.uint8)
        code = np.where(np.isnan(v), FLAG_NAN, np.where(v > 0, FLAG_POS_INF, FLAG_NEG_INF)).astype(np.uint8)
        np.bitwise_or.at(flags, bad, code)
        out[flags == FLAG_POS_INF] = np.inf
        out[flags == FLAG_NEG_INF] = -np.inf
        out[((flags & FLAG_NAN) != 0) | (flags == FLAG_POS_INF | FLAG_NEG_INF)] = np.nan
    return out


def segsum_cpu(kind: str, key: torch.Tensor, src: torch.Tensor, rows: int, *, elementwise: bool = False,
               skip: int = -1, scaled: bool = False, rng=None) -> torch.Tensor:
    """The CPU model of ``segsum_<kind>_cuda`` (kind: "sorted", "atomic" or "fixed"); same arguments."""
    d = src.shape[1]
    vals = src.detach().contiguous().numpy()
    k = key.contiguous().numpy()
    if kind == "fixed":
        finite = np.abs(vals[np.isfinite(vals)])
        s = fixed_shift(finite.max() if finite.size else 0.0, vals.shape[0])
    if elementwise:
        k = (k * d + np.arange(d, dtype=np.int64)).reshape(-1)
        vals, space = vals.reshape(-1, 1), rows * d
    else:
        space = rows
    if scaled:
        vals = scaled_values(k, vals, space)
    if kind == "fixed":
        keep = k != skip
        width = vals.shape[1]
        dst = (k[keep, None] * width + np.arange(width)).reshape(-1)
        return torch.from_numpy(fixed_sum(dst, vals[keep].reshape(-1), space * width, s)).view(rows, d)
    out = np.zeros((space, vals.shape[1]), dtype=F32)
    if k.size:
        order = np.argsort(k, kind="stable")
        sorted_sum, arrival = _jit()
        if kind == "sorted":
            sorted_sum(k, vals, order, skip, out)
        else:
            arrival(k, vals, order, rng_of(rng).random(vals.shape), skip, out)
    return torch.from_numpy(out).view(rows, d)


# --------------------------------------------------------------------------------------------------
# Helpers for tests: float64 reference, per-element counts and error bound


def contributions(key: torch.Tensor, src: torch.Tensor, rows: int, *, elementwise: bool = False, skip: int = -1,
                  scaled: bool = False):
    """(exact float64 sum, count, sum of |term|) per output element, (rows, D) each; terms are the exact
    quotients with ``scaled``."""
    d = src.shape[1]
    vals = src.detach().to("cpu", torch.float64).contiguous().numpy()
    k = key.to("cpu").contiguous().numpy()
    if elementwise:
        k, vals = (k * d + np.arange(d)).reshape(-1), vals.reshape(-1, 1)
    space = rows * d if elementwise else rows
    keep = k != skip
    k, vals = k[keep], vals[keep]
    counts = np.bincount(k, minlength=space)
    if scaled:
        vals = vals / counts[k][:, None]
    kt, vt = torch.from_numpy(k), torch.from_numpy(vals)
    exact = torch.zeros(space, vals.shape[1], dtype=torch.float64).index_add_(0, kt, vt).numpy()
    absum = torch.zeros(space, vals.shape[1], dtype=torch.float64).index_add_(0, kt, vt.abs()).numpy()
    cnt = np.broadcast_to(counts[:, None], exact.shape)
    return exact.reshape(rows, d), cnt.reshape(rows, d).copy(), absum.reshape(rows, d)


def error_bound(count: np.ndarray, abs_sum: np.ndarray, *, scaled: bool = False) -> np.ndarray:
    """|float32 sum - exact| for ``count`` terms added from +0.0 in any binary tree: each term passes
    through at most count - 1 roundings, so <= gamma(count - 1) * sum |term| (Higham). With ``scaled``
    each term is first rounded once more (the division): <= gamma(count) * sum |exact term|."""
    m = np.maximum(count.astype(np.float64) - (0.0 if scaled else 1.0), 0.0)
    u = 2.0**-24
    with np.errstate(invalid="ignore"):   # one infinite term (m = 0): NaN, an element no bound covers
        return m * u / (1.0 - m * u) * abs_sum


# --------------------------------------------------------------------------------------------------
# index_add launchers and models

_CHECKED: dict = {}


def _check_all(index, src, num_rows):
    src = check_tensor(OP, "src", src, ndim=2)
    index = check_index(OP, "index", index, device=src.device)
    if index.dim() != 1:
        raise KernelArgumentError(OP, "index", f"expected a 1-D tensor, got shape {tuple(index.shape)}")
    if index.shape[0] != src.shape[0]:
        raise KernelArgumentError(OP, "index", f"expected {src.shape[0]} entries (src's rows), got {index.shape[0]}")
    rows = check_rows(OP, "num_rows", num_rows)
    if index.numel() and rows == 0:
        raise KernelArgumentError(OP, "num_rows", f"no rows to add {index.numel()} source rows into")
    check_size(OP, "src", src)
    if rows * src.shape[1] > 2**40:
        raise KernelArgumentError(OP, "num_rows", f"the output would have {rows * src.shape[1]} elements; at most 2^40")
    return rows


def _prologue(index, src, num_rows):
    rows = memo_check(_CHECKED, _check_all, index, src, num_rows)
    return index.contiguous(), src.contiguous(), rows


def _check_arg(check_range) -> RangeCheck:
    return range_check(OP, "index", check_range)


def index_add_atomic_cuda(index, src, *, num_rows, check_range: bool | str = True) -> torch.Tensor:
    index, src, rows = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_atomic_cuda(SOURCE, OP, index, src, rows, check=_check_arg(check_range))


def index_add_sorted_cuda(index, src, *, num_rows, check_range: bool | str = True) -> torch.Tensor:
    index, src, rows = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_sorted_cuda(SOURCE, OP, index, src, rows, check=_check_arg(check_range))


def index_add_fixed_cuda(index, src, *, num_rows, check_range: bool | str = True,
                         schedule: str | None = None) -> torch.Tensor:
    """``schedule``: ``direct`` or ``compact``, None to let fixed_schedule choose; the bits are the same
    either way (segsum_fixed_cuda)."""
    index, src, rows = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_fixed_cuda(SOURCE, OP, index, src, rows, check=_check_arg(check_range), schedule=schedule)


def index_add_sorted_scalar_cuda(index, src, *, num_rows, check_range: bool | str = True) -> torch.Tensor:
    """sorted through the thread-per-task kernel whatever D (same bits; for tests)."""
    index, src, rows = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_sorted_cuda(SOURCE, OP, index, src, rows, force_scalar=True, check=_check_arg(check_range))


def _cpu_prologue(index, src, num_rows, check_range):
    _check_arg(check_range)  # a bad value is an error here too
    index, src, rows = _prologue(index, src, num_rows)
    check_index_range(OP, "index", index, rows)  # the models always check (their sort needs valid keys)
    if src.device.type != "cpu":
        raise KernelArgumentError(OP, "src", f"the CPU model needs CPU tensors, got one on {src.device}")
    return index, src, rows


def index_add_sorted_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None) -> torch.Tensor:
    index, src, rows = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("sorted", index, src, rows)


def index_add_atomic_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None) -> torch.Tensor:
    index, src, rows = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("atomic", index, src, rows, rng=rng)


def index_add_fixed_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None,
                        schedule: str | None = None) -> torch.Tensor:
    """The fixed sums' bits, whichever CUDA ``schedule`` is named (a name the CUDA launcher knows; whether it
    takes this form is the launcher's check: every schedule gives these bits)."""
    check_schedule(OP, schedule)
    index, src, rows = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("fixed", index, src, rows)


# --------------------------------------------------------------------------------------------------
# Inputs shared by the three ops' case tables


def draw_index(g: torch.Generator, shape, rows: int, dup: float, counts=None) -> torch.Tensor:
    """Indices of ``shape`` in [0, rows): a fraction ``dup`` of them (exactly round(dup * count)) equal
    to one hot row (rows // 2), placed at random; the rest uniform. ``counts`` (one per row, summing to the
    indices' count) instead: exactly counts[r] indices equal to r, in random order."""
    count = int(np.prod(shape)) if len(shape) else 1
    if counts is not None:
        if len(counts) != rows or sum(counts) != count:
            raise ValueError(f"counts: expected {rows} counts summing to {count}, got {counts}")
        idx = torch.repeat_interleave(torch.arange(rows), torch.tensor(counts, dtype=torch.int64))
        return idx[torch.randperm(count, generator=g)].view(shape)
    idx = torch.randint(0, rows, (count,), generator=g)
    hot = int(round(dup * count))
    if hot:
        where = torch.randperm(count, generator=g)[:hot]
        idx[where] = rows // 2
    return idx.view(shape)


def draw_values(g: torch.Generator, shape, special: str = "") -> torch.Tensor:
    """Normal values; ``negzero``: every other row all -0.0; ``infnan``: a few +-Inf and NaN;
    ``cancel``: magnitudes from 2^-20 to 2^20 (where the order of additions shows)."""
    x = torch.randn(shape, generator=g)
    if special == "negzero":
        x[::2] = -0.0
    elif special == "infnan":
        flat = x.view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[:6]
        flat[pos] = torch.tensor([float("inf"), float("-inf"), float("nan"), float("inf"), float("nan"), 1.0])
    elif special == "cancel":
        x = x * torch.exp2(torch.randint(-20, 21, shape, generator=g).float())
    return x


def noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as a view with column stride 2."""
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, ::2] = x
    return wide[:, ::2]


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    p = case.params
    g = torch.Generator().manual_seed(case.seed)
    index = draw_index(g, (p["n"],), max(p["m"], 1), p.get("dup", 0.0), p.get("counts"))
    src = draw_values(g, (p["n"], p["d"]), p.get("special", ""))
    if p.get("noncontig"):
        src = noncontiguous(src)
    return (index.to(device), src.to(device)), {"num_rows": p["m"]}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    index, src = args
    out = torch.zeros(kwargs["num_rows"], src.shape[1], dtype=torch.float64)
    return out.index_add_(0, index.cpu(), src.detach().cpu().double())


def _case(name: str, seed: int, **params) -> Case:
    n, m, dup = params["n"], max(params["m"], 1), params.get("dup", 0.0)
    return Case(OP, name, params, seed=seed, contention=dup * n + (1 - dup) * n / m)


# Contributions per row around the chunk boundary (a row of up to CHUNK_MIN is one chunk), empty rows
BOUNDARY_COUNTS = (0, 1, 31, 32, 33, 64, 65, 0, 2, 32, 33, 1)

# Hostile shapes: odd D (each kernel width: scalar below 4, float / float2 / float4 lanes), a row hot
# enough for one tree level (k > 32), two levels (k > 1024), longer chunks (k > 32768), empty, D = 1.
TEST_TABLE = (
    ("uniform_d17", dict(n=1023, d=17, m=100)),
    ("uniform_d64", dict(n=1025, d=64, m=300)),
    ("d1", dict(n=1025, d=1, m=50)),
    ("d2_dup50", dict(n=700, d=2, m=40, dup=0.5)),
    ("d130_dup100", dict(n=257, d=130, m=9, dup=1.0)),
    ("d33_dup50_two_levels", dict(n=2500, d=33, m=64, dup=0.5)),
    ("d4_dup100_two_levels", dict(n=3000, d=4, m=5, dup=1.0)),
    ("d1_dup100_long_chunks", dict(n=40000, d=1, m=3, dup=1.0)),
    ("d8_dup100_long_chunks", dict(n=33000, d=8, m=2, dup=1.0)),
    ("empty", dict(n=0, d=8, m=10)),
    ("empty_no_rows", dict(n=0, d=3, m=0)),
    ("one_row", dict(n=100, d=5, m=1)),
    ("noncontig_d24", dict(n=600, d=24, m=50, dup=0.2, noncontig=True)),
    ("negzero_d12", dict(n=400, d=12, m=30, special="negzero")),
    ("infnan_d16", dict(n=500, d=16, m=20, dup=0.3, special="infnan")),
    ("cancel_d32_dup100", dict(n=1500, d=32, m=4, dup=1.0, special="cancel")),
    ("sparse_d64", dict(n=300, d=64, m=1000)),          # fewer rows than destinations: most rows one term
    ("sparse_d6_dup30", dict(n=200, d=6, m=700, dup=0.3)),
    ("sparse_d17_dup5", dict(n=500, d=17, m=3000, dup=0.05)),   # float lanes, rows of one term batched
    ("sparse_d64_negzero", dict(n=300, d=64, m=1000, special="negzero")),  # a single -0.0 row becomes +0.0
    ("sparse_d2", dict(n=300, d=2, m=2000)),   # thread kernel; the gaps split's runs at every float alignment
    # rows of one chunk and of two at the boundary (32, 33 contributions), at each lane width
    *((f"counts_d{d}", dict(n=sum(BOUNDARY_COUNTS), d=d, m=len(BOUNDARY_COUNTS), counts=BOUNDARY_COUNTS))
      for d in (17, 64, 128)),
    # fewer rows than destinations with +-Inf and NaN: the fixed variant's compact schedule at 1 and 4 floats a
    # thread (its flags per accumulator element)
    ("sparse_infnan_d5", dict(n=300, d=5, m=900, dup=0.3, special="infnan")),
    ("sparse_infnan_d12", dict(n=300, d=12, m=900, dup=0.3, special="infnan")),
)


def _test_cases() -> list[Case]:
    return [_case(name, 6000 + i, **p) for i, (name, p) in enumerate(TEST_TABLE)]


DUPS = (0.01, 0.5, 1.0)


def _bench_cases(scale: str) -> list[Case]:
    """``dup``: the fraction of indices equal to one hot row (1%, 50%, 100%); the rest uniform. GPU: a
    graph-network aggregation, 1e6 messages of 64 floats into 1e5 nodes."""
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    n, d, m = {"gpu": (1_000_000, 64, 100_000), "quick": (1_000_000, 64, 100_000), "cpu": (4096, 16, 512)}[scale]
    cases = [_case(f"n{n}_d{d}_m{m}_uniform", 900, n=n, d=d, m=m)]
    for i, dup in enumerate(DUPS):
        cases.append(_case(f"n{n}_d{d}_m{m}_dup{int(dup * 100)}", 901 + i, n=n, d=d, m=m, dup=dup))
    return cases


def torch_index_add(index, src, *, num_rows, **_):
    return torch.zeros(num_rows, src.shape[1], device=src.device, dtype=src.dtype).index_add_(0, index, src)


def _peers() -> dict:
    # bench.runner measures "torch" also under torch.use_deterministic_algorithms as torch_deterministic
    return {"torch": torch_index_add}


def _bytes_moved(case: Case) -> int:
    p = case.params
    return p["n"] * p["d"] * 4 + p["n"] * 8 + p["m"] * p["d"] * 4


define_op(
    OP,
    variants=[
        # name, deterministic, order-independent, CUDA launcher, CPU model, note
        ("atomic", False, False, index_add_atomic_cuda, index_add_atomic_cpu,
         "one thread per src element, atomicAdd into the zeroed output (as torch's CUDA index_add)"),
        ("sorted", True, False, index_add_sorted_cuda, index_add_sorted_cpu,
         "stable sort by index; each row sums its sources in source order in chunks of 32*2^e, chunk "
         "partials combined by a fixed 32-ary tree (hot rows split across warps)"),
        ("fixed", True, True, index_add_fixed_cuda, index_add_fixed_cpu, FIXED_NOTE),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
    bench_kwargs=BENCH_KWARGS,
    out_like=(1,),  # the sum as src
)
