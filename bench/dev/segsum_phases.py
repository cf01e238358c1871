"""The scatter sums (index_add, scatter_add, embedding_bwd) on a CUDA machine, phase by phase: every
bench case's variants (sorted in each task split, fixed, and for scatter_add's element form fixed in
each schedule, atomic) timed per call (CUDA events, L2 flushed, median of 30), eagerly and as a
CUDA-graph replay (no host work: what the GPU alone takes), and each kernel's share from torch.profiler
(CUPTI sees CuPy's launches too).

    PYTHONPATH=. python bench/dev/segsum_phases.py [--ops index_add scatter_add] [--reps 20]
    PYTHONPATH=. python bench/dev/segsum_phases.py --splits   # index_add's sorted sums per task split
    PYTHONPATH=. python bench/dev/segsum_phases.py --sorts    # the key sorts alone, per method
    PYTHONPATH=. python bench/dev/segsum_phases.py --skew     # task splits on Zipf-skewed keys
    PYTHONPATH=. python bench/dev/segsum_phases.py --fixed-schedules   # scatter_add's fixed, per schedule
    PYTHONPATH=. python bench/dev/segsum_phases.py --fill   # embedding_bwd's zero fill beside the sort
    PYTHONPATH=. python bench/dev/segsum_phases.py --fill-grid   # embedding_bwd per split, lane width
    PYTHONPATH=. python bench/dev/segsum_phases.py --groups [--depths]   # the fill split's sums per warps per tile
    PYTHONPATH=. python bench/dev/segsum_phases.py --gaps   # zeros of the empty rows beside the sums
    PYTHONPATH=. python bench/dev/segsum_phases.py --gap-builds   # ... per zero store and sums depth
    PYTHONPATH=. python bench/dev/segsum_phases.py --once   # every row written once: zeros and short rows in one pass
    PYTHONPATH=. python bench/dev/segsum_phases.py --once-builds   # ... per build of its kernels and order
    PYTHONPATH=. python bench/dev/segsum_phases.py --compact   # fixed, compact schedule: zeros beside the sums

``--splits`` times the key sorts (kernels/index_add.py's sort_keys: merge, one block, radix, rank, torch.sort),
checking they agree, then index_add's sorted variant in each task split (and atomic) over shapes beyond the
bench cases: heavy rows, narrow and wide rows, as many rows as sources, mostly empty outputs (what
kernels/index_add.py's default_split is chosen from), checking the splits' bits agree.

``--fill`` times embedding_bwd's sorted variant (the ``fill`` split: the gradient zero-filled on a side stream
beside the key sort) per grid of the fill (ia.ZERO_BLOCKS_PER_SM), beside the fill alone, the key sort
alone and PyTorch's embedding backward in both modes, on the audit's embedding shapes (Zipf tokens).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from unittest import mock

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import kernels  # noqa: E402
from bench.timing import L2Flush, cuda_event_times, median  # noqa: E402
from kernels import index_add as ia  # noqa: E402

OPS = ("index_add", "scatter_add", "embedding_bwd")


def sorted_split(op: str, split: str):
    """The op's sorted variant with the task split forced (same bits)."""
    variant = kernels.get(op, "sorted")
    module = sys.modules[variant.cuda.__module__]
    original = ia.segsum_sorted_cuda

    def forced(*a, **k):
        return original(*a, **{**k, "split": split})

    def run(*args, **kw):
        with mock.patch.object(module, "segsum_sorted_cuda", forced):
            return variant(*args, **kw)
    return run


def kernel_times(fn, reps: int) -> dict[str, float]:
    """Mean device time per call of each kernel name (µs)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:60]] += e.device_time / reps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def timeline(fn, calls: int = 3) -> list[str]:
    """The kernels of the last of ``calls`` calls of fn, in start order (torch.profiler's trace), the
    calls queued behind a spin (so no kernel waits for the host): start (us after the call's first
    kernel), duration (us), stream and name, to see what overlaps."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(2e9 * 2e-3 * calls))
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels_ = sorted((e for e in events if e.get("cat") == "kernel" and "sleep" not in e["name"].lower()
                       and "spin" not in e["name"].lower()), key=lambda e: e["ts"])
    last = kernels_[-len(kernels_) // calls:]
    t0 = last[0]["ts"]
    return [f"{e['ts'] - t0:7.1f} +{e['dur']:6.1f}  stream {e['args'].get('stream')}  {e['name'][:50]}" for e in last]


def graph_of(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def us(fn, dev: torch.device, flush) -> float:
    """fn's median time per call (us): CUDA events, L2 flushed, 30 calls."""
    return median(cuda_event_times(fn, 30, dev, flush=flush)) * 1e6


def timed_alike(fns: dict, dev: torch.device, flush) -> list[str]:
    """'name time' for each of ``fns`` (float32 results), after checking each gives the first one's bits."""
    first, row = None, []
    for name, fn in fns.items():
        out = fn()
        first = out if first is None else first
        assert torch.equal(out.view(torch.int32), first.view(torch.int32)), name
        row.append(f"{name} {us(fn, dev, flush):7.1f}")
    return row


# (n, D, rows): contributions per destination from 0.05 to 10000
SPLIT_SHAPES = ((1_000_000, 64, 1000), (1_000_000, 64, 100), (200_000, 256, 5000), (1_000_000, 64, 100_000),
                (100_000, 16, 1_000_000), (1_000_000, 8, 100_000), (50_000, 128, 50_000), (1_000_000, 2, 1000),
                (1_000_000, 2, 2_000_000), (16384, 512, 50_000))


# (n, rows): the key sorts (sort_keys' methods), one to three digit passes, int16 and int32 keys
SORT_SHAPES = ((1024, 50_000), (2048, 32_000), (4096, 50_000), (8192, 50_000), (12288, 50_000), (16384, 50_000),
               (16384, 200),
               (32768, 50_000), (65536, 50_000), (16384, 1_000_000), (32768, 1_000_000), (2048, 1_000_000),
               (262_144, 50_000), (1_000_000, 1000), (1_000_000, 100_000), (1_000_000, 1_000_000),
               (8_388_608, 320_000))


def sort_sweep(dev: torch.device, flush) -> None:
    for n, m in SORT_SHAPES:
        g = torch.Generator().manual_seed(2)
        idx = ia.draw_index(g, (n,), m, 0.01).to(dev)
        row, first = [f"sort n {n:6d} rows {m:7d}"], None
        kname = ia._key_dtype(m)[1]
        for method in ia.SORTS:
            if method != "torch" and not ia.sort_takes(method, n, kname):
                continue

            def fn(method=method):
                return ia.sort_keys(ia.SOURCE, "index_add", idx, m, method=method)
            out = fn()
            first = out if first is None else first
            assert all(torch.equal(a, b) for a, b in zip(out[:3], first[:3])), method
            row.append(f"{method} {us(fn, dev, flush):6.1f} us")
        print("  ".join(row), flush=True)


def split_cells(idx: torch.Tensor, src: torch.Tensor, m: int, dev: torch.device, flush) -> tuple[list[str], str]:
    """index_add's sorted variant per task split ('split time' cells, bits checked equal) and the default
    split for the shape."""
    cells = timed_alike({split: (lambda split=split: ia.segsum_sorted_cuda(ia.SOURCE, "index_add", idx, src, m,
                                                                          split=split))
                         for split in ia.SPLITS}, dev, flush)
    return cells, ia.default_split(idx.numel(), m, src.shape[1] < ia.SCALAR_BELOW_D)


def split_sweep(dev: torch.device, flush) -> None:
    sort_sweep(dev, flush)
    for n, d, m in SPLIT_SHAPES:
        g = torch.Generator().manual_seed(1)
        idx = ia.draw_index(g, (n,), m, 0.0).to(dev)
        src = torch.randn(n, d, generator=g).to(dev)
        cells, default = split_cells(idx, src, m, dev, flush)
        t = us(lambda: ia.segsum_atomic_cuda(ia.SOURCE, "index_add", idx, src, m), dev, flush)
        print("  ".join([f"n {n:8d} D {d:4d} rows {m:8d}"] + cells) + f"  atomic {t:7.1f} us  (default: {default})",
              flush=True)


# (n, D, rows): Zipf-skewed keys (nnrand.audit's embedding law) from 1 to 10 per destination, where
# default_split took the tiles before 1d868f3's sweep
SKEW_SHAPES = ((2048, 768, 2000), (16384, 768, 8000), (16384, 512, 16384), (100_000, 64, 50_000),
               (1_000_000, 64, 100_000), (200_000, 256, 20_000))


def skew_sweep(dev: torch.device, flush) -> None:
    """index_add's sorted variant per task split on Zipf-skewed keys (hot rows beside many cold ones) and
    on uniform ones, bits checked equal across the splits."""
    from nnrand.audit import _zipf

    for n, d, m in SKEW_SHAPES:
        for law in ("zipf", "uniform"):
            g = torch.Generator().manual_seed(5)
            idx = (_zipf(g, n, m) if law == "zipf" else torch.randint(0, m, (n,), generator=g)).to(dev)
            src = torch.randn(n, d, generator=g).to(dev)
            cells, default = split_cells(idx, src, m, dev, flush)
            print("  ".join([f"{law:7s} n {n:8d} D {d:4d} rows {m:7d}"] + cells) + f" us  (default: {default})",
                  flush=True)


# (n, D, rows): scatter_add's element form at 1 to 32 terms per destination (16384 x 32 destinations),
# wider and narrower rows
FIXED_SHAPES = (*((16_384 * k, 32, 16_384) for k in (1, 2, 4, 8, 16, 32)), (65_536, 128, 4096),
                (1_000_000, 8, 50_000))


def fixed_sweep(dev: torch.device, flush) -> None:
    """scatter_add's fixed variant in each schedule (their bits checked equal) and atomic, uniform index,
    over FIXED_SHAPES: where kernels/index_add.py's fixed_schedule switches to ``binned``."""
    fixed = kernels.scatter_add.scatter_add_fixed_cuda
    for n, d, m in FIXED_SHAPES:
        g = torch.Generator().manual_seed(3)
        idx = ia.draw_index(g, (n, d), m, 0.0).to(dev)
        src = torch.randn(n, d, generator=g).to(dev)
        row = [f"n {n:8d} D {d:4d} rows {m:7d} ({n / m:5.1f} terms per destination)"] + timed_alike(
            {s: (lambda s=s: fixed(idx, src, num_rows=m, check_range=False, schedule=s)) for s in ia.SCHEDULES},
            dev, flush)
        atomic = kernels.get("scatter_add", "atomic")
        t = us(lambda: atomic(idx, src, num_rows=m, check_range=False), dev, flush)
        chosen = ia.fixed_schedule(n * d, m * d, elementwise=True)
        print("  ".join(row) + f"  atomic {t:7.1f} us  (default: {chosen})", flush=True)


# (V, D, tokens): nnrand.audit's embedding rows (small_batch, lm_tokens) and two more gradients of mostly
# empty rows
FILL_SHAPES = ((32_000, 768, 2048), (32_000, 768, 16_384), (50_000, 512, 16_384), (1_000_000, 16, 100_000))
FILL_BLOCKS = (2, 4, 6, 8, 16)


def fill_sweep(dev: torch.device, flush) -> None:
    """embedding_bwd's sorted variant per ZERO_BLOCKS_PER_SM (bits checked equal across them; on the audit's
    small batch, each one's kernel timeline), beside the atomic variant, the zero fill alone at each grid and
    as torch's zero_, the key sort alone (default, then per method), PyTorch's embedding backward (default
    and deterministic mode; a timing in the latter includes its filling of uninitialised memory), and the
    sorted variant per key sort with its kernels' times (torch.profiler)."""
    from nnrand.audit import _zipf

    sorted_bwd = kernels.get("embedding_bwd", "sorted")
    for v, d, n in FILL_SHAPES:
        g = torch.Generator().manual_seed(4)
        idx = _zipf(g, n, v).to(dev)
        grad = torch.randn(n, d, generator=g).to(dev)
        out = torch.empty(v, d, device=dev)
        emb = kernels.embedding_bwd
        zero = kernels.runtime.function(emb.SOURCE, "segsum_zero", dev)
        sm = kernels.runtime.sm_count(dev)

        def fill(k):
            blocks = max(1, min(kernels.runtime.cdiv(out.numel(), 4 * ia.THREADS), k * sm))
            kernels.runtime.launch(zero, (blocks,), (ia.THREADS,), (kernels.runtime.ptr(out), np.int64(out.numel())),
                                   device=dev)
        print(f"\nembedding V {v} D {d} tokens {n}: {out.numel() * 4 / 1e6:.0f} MB of gradient", flush=True)
        print("  fill alone: " + "  ".join(f"{k}/SM {us(lambda k=k: fill(k), dev, flush):6.1f}" for k in FILL_BLOCKS)
              + f"  zero_ {us(out.zero_, dev, flush):6.1f} us", flush=True)
        sort = us(lambda: ia.sort_keys(emb.SOURCE, emb.OP, idx, v), dev, flush)
        native = torch.ops.aten.embedding_dense_backward
        t_default = us(lambda: native(grad, idx, v, -1, False), dev, flush)
        torch.use_deterministic_algorithms(True)
        try:
            t_det = us(lambda: native(grad, idx, v, -1, False), dev, flush)
        finally:
            torch.use_deterministic_algorithms(False)
        print(f"  sort alone {sort:6.1f} us  torch default {t_default:6.1f} us  deterministic {t_det:6.1f} us",
              flush=True)

        def with_blocks(k):
            with mock.patch.object(ia, "ZERO_BLOCKS_PER_SM", k):
                return sorted_bwd(grad, idx, num_weights=v, check_range=False)
        row = timed_alike({f"{k}/SM": (lambda k=k: with_blocks(k)) for k in FILL_BLOCKS}, dev, flush)
        atomic = us(lambda: kernels.get("embedding_bwd", "atomic")(grad, idx, num_weights=v, check_range=False), dev,
                    flush)
        print("  sorted: " + "  ".join(row) + f"  (targets: deterministic / 3 = {t_det / 3:.1f} us, 1.1 x atomic "
              f"{atomic:.1f} = {1.1 * atomic:.1f} us)", flush=True)
        if (v, d, n) == FILL_SHAPES[0]:   # the audit's small batch: where the fill's grid moves the sums' start
            for k in FILL_BLOCKS:
                print(f"  {k}/SM timeline (start, duration us):\n    " +
                      "\n    ".join(timeline(lambda k=k: with_blocks(k))), flush=True)
        kname = ia._key_dtype(v)[1]
        sorts = [m for m in ia.SORTS if m == "torch" or ia.sort_takes(m, n, kname)]
        print("  key sort alone: " + "  ".join(
            f"{m} {us(lambda m=m: ia.sort_keys(emb.SOURCE, emb.OP, idx, v, method=m), dev, flush):6.1f}"
            for m in sorts) + f" us (default: {ia.default_sort(n, kname)})", flush=True)

        def with_sort(m):
            with mock.patch.object(ia, "default_sort", lambda *a, m=m: m):
                return sorted_bwd(grad, idx, num_weights=v, check_range=False)
        print("  sorted per key sort: " + "  ".join(timed_alike({m: (lambda m=m: with_sort(m)) for m in sorts},
                                                                dev, flush)) + " us", flush=True)
        for m in sorts:
            kt = kernel_times(lambda m=m: with_sort(m), 20)
            print(f"  {m}'s kernels: " + ", ".join(f"{name} {t:.1f}" for name, t in kt.items()) + " us", flush=True)


# (floats per lane in flight, blocks per SM) of the warp sums: segsum.cuh's SEG_LANE_FLOATS and SEG_SUMS_BLOCKS
DEPTHS = ((16, 3), (32, 2), (64, 1))


def with_defines(fn, defines: dict):
    """fn with each kernel whose name contains a key of ``defines`` compiled with that key's -D options."""
    original = ia.function

    def compiled(source, name, device, given=(), *a, **k):
        extra = next((opts for part, opts in defines.items() if part in name), ())
        return original(source, name, device, (*given, *extra), *a, **k)

    def run():
        with mock.patch.object(ia, "function", compiled):
            return fn()
    return run


def with_constants(fn, **values):
    """fn with kernels/index_add.py's module names in ``values`` set to them for the call."""
    def run():
        with mock.patch.multiple(ia, **values):
            return fn()
    return run


def with_depth(fn, floats: int, blocks: int):
    """fn with the sorted sums kernels compiled for ``floats`` per lane in flight and ``blocks`` per SM."""
    return with_defines(fn, {"_rows": (f"-DSEG_LANE_FLOATS={floats}", f"-DSEG_SUMS_BLOCKS={blocks}")})


def fill_grid(dev: torch.device, flush) -> None:
    """embedding_bwd's sorted variant on FILL_SHAPES per task split, column width of a lane
    (kernels/index_add.py _vec: 1, 2 or 4 floats) and, in the fill split, DEPTHS, bits checked equal: the
    call's time and its sums kernel's (torch.profiler)."""
    from nnrand.audit import _zipf

    for v, d, n in FILL_SHAPES:
        g = torch.Generator().manual_seed(4)
        idx = _zipf(g, n, v).to(dev)
        grad = torch.randn(n, d, generator=g).to(dev)
        print(f"\nembedding V {v} D {d} tokens {n} (default: {ia.default_split(n, v, False)}, vec "
              f"{ia._vec(grad, d)})", flush=True)
        first = None
        for split in ia.SPLITS:
            forced = sorted_split("embedding_bwd", split)   # (made once: not inside the timed calls)
            for floats, blocks in DEPTHS if split == "fill" else DEPTHS[:1]:
                for vec in (1, 2, 4):
                    if d % vec:
                        continue

                    def plain(vec=vec, forced=forced):
                        with mock.patch.object(ia, "_vec", lambda *a, vec=vec: vec):
                            return forced(grad, idx, num_weights=v, check_range=False)
                    run = with_depth(plain, floats, blocks)
                    out = run()
                    first = out if first is None else first
                    assert torch.equal(out.view(torch.int32), first.view(torch.int32)), (split, vec, floats)
                    sums = sum(t for name, t in kernel_times(run, 20).items() if "embedding_bwd_rows" in name)
                    print(f"  {split:5s} vec {vec} floats {floats:2d} blocks {blocks}: call {us(run, dev, flush):6.1f}"
                          f" us, sums kernel {sums:6.1f} us", flush=True)


# (op, n, D, rows, law): fill-split shapes of the three ops (nnrand.audit's embedding rows first)
GROUP_SHAPES = (("embedding_bwd", 2048, 768, 32_000, "zipf"), ("embedding_bwd", 16_384, 768, 32_000, "zipf"),
                ("embedding_bwd", 4096, 512, 50_000, "zipf"), ("embedding_bwd", 100_000, 16, 1_000_000, "zipf"),
                ("index_add", 100_000, 16, 1_000_000, "uniform"), ("index_add", 16_384, 512, 50_000, "uniform"),
                ("index_add", 1_000_000, 64, 100_000, "uniform"), ("index_add", 50_000, 128, 50_000, "uniform"),
                ("index_add", 1024, 256, 100_000, "uniform"))


def scatter_inputs(op: str, n: int, d: int, m: int, law: str, dev: torch.device):
    """(index, src, args, kwargs) of ``op`` (embedding_bwd or index_add): n keys into m rows of d floats,
    keys by ``law`` (zipf: nnrand.audit's, or uniform), seeded; no range check (as the routing runs)."""
    from nnrand.audit import _zipf

    g = torch.Generator().manual_seed(6)
    idx = (_zipf(g, n, m) if law == "zipf" else torch.randint(0, m, (n,), generator=g)).to(dev)
    src = torch.randn(n, d, generator=g).to(dev)
    args = (src, idx) if op == "embedding_bwd" else (idx, src)
    return idx, src, args, {"num_weights" if op == "embedding_bwd" else "num_rows": m, "check_range": False}


def peer_times(op: str, args: tuple, kw: dict, dev: torch.device, flush) -> tuple[float, float, float]:
    """us per call of the op's atomic variant and of PyTorch's op in default and deterministic mode."""
    atomic = us(lambda: kernels.get(op, "atomic")(*args, **kw), dev, flush)
    native = kernels.spec(op).peers()["torch"]
    t_default = us(lambda: native(*args, **kw), dev, flush)
    torch.use_deterministic_algorithms(True)
    try:
        t_det = us(lambda: native(*args, **kw), dev, flush)
    finally:
        torch.use_deterministic_algorithms(False)
    return atomic, t_default, t_det


def peers_line(op: str, args: tuple, kw: dict, dev: torch.device, flush) -> str:
    """The atomic variant's and PyTorch's times (peer_times) and #17's targets from them, one line."""
    atomic, t_default, t_det = peer_times(op, args, kw, dev, flush)
    return (f"atomic {atomic:6.1f}  torch {t_default:6.1f}  deterministic {t_det:6.1f} us  (targets: "
            f"deterministic / 3 = {t_det / 3:.1f}, 1.1 x atomic = {1.1 * atomic:.1f})")


def print_splits(op: str, law: str, n: int, d: int, m: int, fns: dict, args: tuple, kw: dict, dev: torch.device,
                 flush) -> None:
    """One line: the shape, its default split, each of ``fns`` timed (bits checked alike), then peers_line."""
    row = timed_alike(fns, dev, flush)
    print(f"{op} {law} n {n} D {d} rows {m} (default: {ia.default_split(n, m, d < ia.SCALAR_BELOW_D)}): "
          + "  ".join(row) + "  " + peers_line(op, args, kw, dev, flush), flush=True)


def group_sweep(dev: torch.device, flush, depths: bool = False) -> None:
    """The fill split's warps per tile of sorted positions (kernels/index_add.py fill_group) on GROUP_SHAPES:
    the call and its sums kernel (torch.profiler) per group, bits checked equal, beside the rows split,
    the default, the atomic variant and PyTorch's op in both modes; the default call's kernel timeline
    for the audit's small batch, and there (``depths``) each group's call per DEPTHS of the sums."""
    for op, n, d, m, law in GROUP_SHAPES:
        idx, src, args, kw = scatter_inputs(op, n, d, m, law, dev)
        fill, rows = sorted_split(op, "fill"), sorted_split(op, "rows")   # (made once: not inside the timed calls)

        def grouped(group):
            def run():
                with mock.patch.object(ia, "fill_group", lambda tasks, dev: group):
                    return fill(*args, **kw)
            return run
        groups = {f"{group} warps": grouped(group) for group in ia.FILL_GROUPS}
        fns = {**groups, "rows": lambda: rows(*args, **kw),
               "default": lambda: kernels.get(op, "sorted")(*args, **kw)}
        row = timed_alike(fns, dev, flush)
        atomic, t_default, t_det = peer_times(op, args, kw, dev, flush)
        vec = ia._vec(src, d)
        tasks = -(-n // 32) * -(-d // (32 * vec))
        print(f"{op} {law} n {n} D {d} rows {m} (default: {ia.default_split(n, m, d < ia.SCALAR_BELOW_D)}, "
              f"{ia.fill_group(tasks, dev)} warps a tile): " + "  ".join(row) +
              f"  atomic {atomic:6.1f}  torch {t_default:6.1f}  deterministic {t_det:6.1f} us", flush=True)
        sums = {name: sum(t for k, t in kernel_times(fn, 20).items() if "_rows" in k or "_scalar" in k)
                for name, fn in groups.items()}
        print("  sums kernel: " + "  ".join(f"{name} {t:6.1f}" for name, t in sums.items()) + " us", flush=True)
        if (op, n) == ("embedding_bwd", 2048):
            print("  default's timeline (start, duration us):\n    " + "\n    ".join(timeline(fns["default"])),
                  flush=True)
            for floats, blocks in DEPTHS if depths else ():
                cells = timed_alike({name: with_depth(fn, floats, blocks) for name, fn in groups.items()}, dev, flush)
                print(f"  {floats} floats a lane, {blocks} blocks an SM: " + "  ".join(cells) + " us", flush=True)


# (op, n, D, rows, law): the gaps split's shapes: GROUP_SHAPES and wider outputs of few keys
GAP_SHAPES = (*GROUP_SHAPES, ("embedding_bwd", 512, 768, 32_000, "zipf"), ("embedding_bwd", 2048, 4096, 32_000, "zipf"),
              ("index_add", 1_000_000, 64, 1000, "uniform"))
GAP_BLOCKS = (1, 2, 4, 8, 16)


def zeros_alone(op: str, idx: torch.Tensor, rows: int, d: int, blocks: int, dev: torch.device, flush) -> str:
    """'B/SM zero T gaps T': segsum_zero over a rows x d output and segsum_zero_gaps after idx's sort, each
    alone on a grid of ``blocks`` an SM."""
    rt = kernels.runtime
    source = (kernels.embedding_bwd if op == "embedding_bwd" else ia).SOURCE
    start = ia.sort_keys(source, op, idx, rows)[2]
    out = torch.empty(rows, d, device=dev)
    grid = (max(1, min(rt.cdiv(out.numel(), 4 * ia.THREADS), blocks * rt.sm_count(dev))),)
    with mock.patch.object(ia, "GAP_BLOCKS_PER_SM", blocks):
        gap_grid = (ia.gap_blocks(rows, dev),)
    zero, gaps = (rt.function(source, name, dev) for name in ("segsum_zero", "segsum_zero_gaps"))
    t_zero = us(lambda: rt.launch(zero, grid, (ia.THREADS,), (rt.ptr(out), np.int64(out.numel())), device=dev),
                dev, flush)
    t_gaps = us(lambda: rt.launch(gaps, gap_grid, (ia.THREADS,), (rt.ptr(start), rt.ptr(out), np.int64(rows),
                                                              np.int32(d), np.int64(-1)), device=dev), dev, flush)
    return f"{blocks}/SM zero {t_zero:6.1f} gaps {t_gaps:6.1f}"


# (op, n, D, rows): where the gaps split's builds are compared
GAP_BUILD_SHAPES = (("embedding_bwd", 2048, 768, 32_000), ("embedding_bwd", 512, 768, 32_000),
                    ("embedding_bwd", 16_384, 768, 32_000), ("embedding_bwd", 4096, 512, 50_000))


def gap_builds(dev: torch.device, flush) -> None:
    """On the embedding rows of GAP_BUILD_SHAPES (Zipf tokens): the gaps split per grid of its zeros, their
    stores plain or streaming (SEG_GAP_STREAMING), and the sums' depth (DEPTHS), bits checked equal to
    the fill split's; the fill split at each depth; each build's kernel timeline on the audit's small batch."""
    from nnrand.audit import _zipf

    for op, n, d, m in GAP_BUILD_SHAPES:
        g = torch.Generator().manual_seed(6)
        idx = _zipf(g, n, m).to(dev)
        src = torch.randn(n, d, generator=g).to(dev)
        fill, gaps = sorted_split(op, "fill"), sorted_split(op, "gaps")

        def call(split, blocks=None):
            return with_constants(lambda: split(src, idx, num_weights=m, check_range=False),
                                  GAP_BLOCKS_PER_SM=blocks or ia.GAP_BLOCKS_PER_SM)
        fns = {}
        for floats, sums_blocks in DEPTHS[:2]:
            depth = (f"-DSEG_LANE_FLOATS={floats}", f"-DSEG_SUMS_BLOCKS={sums_blocks}")
            fns[f"fill {floats}f"] = with_depth(call(fill), floats, sums_blocks)
            for streaming in (0, 1):
                for blocks in (4, 8, 16):
                    fns[f"gaps {blocks}/SM{' cs' if streaming else ''} {floats}f"] = with_defines(
                        call(gaps, blocks), {"_rows": depth, "zero_gaps": (f"-DSEG_GAP_STREAMING={streaming}",)})
        print(f"{op} n {n} D {d} rows {m}: " + "  ".join(timed_alike(fns, dev, flush)) + " us", flush=True)
        if n == 2048:
            for name in ("gaps 8/SM 16f", "gaps 8/SM cs 16f", "gaps 8/SM 32f", "gaps 8/SM cs 32f"):
                print(f"  {name} timeline (start, duration us):\n    " + "\n    ".join(timeline(fns[name])),
                      flush=True)


def gap_sweep(dev: torch.device, flush) -> None:
    """The gaps split (the output's empty rows zeroed beside the sums, after the sort) per grid of its zero
    kernel (ia.GAP_BLOCKS_PER_SM) and, at 8 an SM, per warps per position tile, bits checked equal to the
    fill and rows splits', beside them, the atomic variant and PyTorch's op in both modes; each gaps call's
    kernel timeline on the audit's small batch."""
    for op, n, d, m, law in GAP_SHAPES:
        idx, src, args, kw = scatter_inputs(op, n, d, m, law, dev)
        splits = {split: sorted_split(op, split) for split in ("fill", "rows", "gaps")}   # (made once)

        def gaps(blocks, group=None):
            return with_constants(lambda: splits["gaps"](*args, **kw), GAP_BLOCKS_PER_SM=blocks,
                                  fill_group=(lambda t, dev: group) if group else ia.fill_group)
        fns = {"fill": lambda: splits["fill"](*args, **kw), "rows": lambda: splits["rows"](*args, **kw),
               **{f"gaps {b}/SM": gaps(b) for b in GAP_BLOCKS},
               **{f"gaps 8/SM {group} warps": gaps(8, group) for group in (1, 4)},
               "default": lambda: kernels.get(op, "sorted")(*args, **kw)}
        print_splits(op, law, n, d, m, fns, args, kw, dev, flush)
        print("  zeros alone: " + "  ".join(zeros_alone(op, idx, m, d, b, dev, flush) for b in GAP_BLOCKS) + " us",
              flush=True)
        if (op, n, d) == ("embedding_bwd", 2048, 768):
            for b in GAP_BLOCKS:
                print(f"  gaps {b}/SM timeline (start, duration us):\n    " +
                      "\n    ".join(timeline(gaps(b))), flush=True)


ONCE_BLOCKS = (2, 4, 8)


def once_sweep(dev: torch.device, flush) -> None:
    """The once split (segsum_once: zeros and rows of one chunk in one pass over the destinations, the longer
    rows beside it on a second stream) per grid (ia.ONCE_BLOCKS_PER_SM) and warps per position tile of the
    long rows (ia.LONG_GROUP), bits checked equal to the fill split's, beside the fill and gaps splits, the
    default, the atomic variant and PyTorch's op in both modes, on GAP_SHAPES; each kernel's time
    (torch.profiler) of the once call at the defaults and of the fill split, and, on the audit's small
    batch, the once call's kernel timeline."""
    for op, n, d, m, law in GAP_SHAPES:
        idx, src, args, kw = scatter_inputs(op, n, d, m, law, dev)
        splits = {split: sorted_split(op, split) for split in ("fill", "gaps", "once")}   # (made once)

        def once(blocks, group):
            return with_constants(lambda: splits["once"](*args, **kw), ONCE_BLOCKS_PER_SM=blocks, LONG_GROUP=group)
        fns = {"fill": lambda: splits["fill"](*args, **kw), "gaps": lambda: splits["gaps"](*args, **kw),
               **{f"once {b}/SM": once(b, ia.LONG_GROUP) for b in ONCE_BLOCKS},
               **{f"once {g} warps": once(ia.ONCE_BLOCKS_PER_SM, g) for g in (1, 4)},
               "default": lambda: kernels.get(op, "sorted")(*args, **kw)}
        print_splits(op, law, n, d, m, fns, args, kw, dev, flush)
        for name in ("once 4/SM", "fill"):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in kernel_times(fns[name], 20).items())
            print(f"  {name} kernels (us): {parts}", flush=True)
        if (op, n, d) == ("embedding_bwd", 2048, 768):
            print("  once 4/SM timeline (start, duration us):\n    " + "\n    ".join(timeline(fns["once 4/SM"])),
                  flush=True)


COMPACT_ZERO_BLOCKS = (2, 4, 8, 16)
FILL_ZEROS = ("segsum_zero_cs", "segsum_zero")


def compact_sweep(dev: torch.device, flush) -> None:
    """The fixed variant's compact schedule (row form: an accumulator row per source row, the output
    zero-filled on a second stream beside them) per grid of that fill (ia.COMPACT_ZERO_BLOCKS_PER_SM), bits
    checked equal to the direct schedule's, beside the sorted variant's default per kernel of its fill split's
    zero fill (ia.FILL_ZERO: streaming or plain stores), the atomic variant and PyTorch's op in both modes, on
    GAP_SHAPES; each kernel's time (torch.profiler) of the compact call and of the atomic one, and on the
    audit's small batch the kernel timelines of the compact call and of the sorted one."""
    for op, n, d, m, law in GAP_SHAPES:
        idx, src, args, kw = scatter_inputs(op, n, d, m, law, dev)
        fixed = kernels.get(op, "fixed").cuda   # the launcher itself: it takes schedule=

        def compact(blocks):
            return with_constants(lambda: fixed(*args, **kw, schedule="compact"), COMPACT_ZERO_BLOCKS_PER_SM=blocks)

        def sorted_fill(zero):
            return with_constants(lambda: kernels.get(op, "sorted")(*args, **kw), FILL_ZERO=zero)
        row = timed_alike({"direct": lambda: fixed(*args, **kw, schedule="direct"),
                           **{f"compact {b}/SM": compact(b) for b in COMPACT_ZERO_BLOCKS}}, dev, flush)
        row += timed_alike({f"sorted {z}": sorted_fill(z) for z in FILL_ZEROS}, dev, flush)
        chosen = ia.fixed_schedule(n * d, m * d, elementwise=False, src_rows=n)
        print(f"{op} {law} n {n} D {d} rows {m} (fixed default: {chosen}, sorted: "
              f"{ia.default_split(n, m, d < ia.SCALAR_BELOW_D)}): " + "  ".join(row) + "  " +
              peers_line(op, args, kw, dev, flush), flush=True)
        for name, fn in (("compact", compact(ia.COMPACT_ZERO_BLOCKS_PER_SM)),
                         ("atomic", lambda: kernels.get(op, "atomic")(*args, **kw))):
            parts = ", ".join(f"{k} {v:.1f}" for k, v in kernel_times(fn, 20).items())
            print(f"  {name} kernels (us): {parts}", flush=True)
        if (op, n, d) == ("embedding_bwd", 2048, 768):
            for name, fn in (("compact", compact(ia.COMPACT_ZERO_BLOCKS_PER_SM)),
                             ("sorted", sorted_fill(ia.FILL_ZERO))):
                print(f"  {name} timeline (start, duration us):\n    " + "\n    ".join(timeline(fn)), flush=True)


# (op, n, D, rows, law): where the once split's builds and orders are compared
ONCE_BUILD_SHAPES = (("embedding_bwd", 2048, 768, 32_000, "zipf"), ("embedding_bwd", 512, 768, 32_000, "zipf"),
                     ("embedding_bwd", 4096, 512, 50_000, "zipf"), ("index_add", 100_000, 16, 1_000_000, "uniform"))


def once_builds(dev: torch.device, flush) -> None:
    """The once split per build of segsum_once (4 blocks an SM, or 8 with 2 source rows in flight), of the
    long-rows kernel (32 source rows in flight at 2 blocks an SM, or 8 at 4), tiles per block (ONCE_PER_MAX 1
    or 8) and order (ia.ONCE_ORDERS: beside the long rows, or after or before them on one stream, where the
    profiler's kernel times are each kernel's alone), bits checked equal to the fill split's; the kernels of
    a few of them on the audit's small batch."""
    once_defs = {"4/SM": ({}, 4), "8/SM": ({"segsum_once": ("-DSEG_ONCE_BLOCKS=8", "-DSEG_ONCE_U=2")}, 8)}
    long_defs = {"L32": {}, "L8": {"_long_": ("-DSEG_LONG_ROWS=8", "-DSEG_LONG_BLOCKS=4")}}
    for op, n, d, m, law in ONCE_BUILD_SHAPES:
        idx, src, args, kw = scatter_inputs(op, n, d, m, law, dev)
        fill, once = sorted_split(op, "fill"), sorted_split(op, "once")

        def build(once_name, long_name, per, order):
            defines, blocks = once_defs[once_name]
            run = with_constants(lambda: once(*args, **kw), ONCE_BLOCKS_PER_SM=blocks, ONCE_PER_MAX=per,
                                 ONCE_ORDER=order)
            return with_defines(run, {**defines, **long_defs[long_name]})
        fns = {"fill": lambda: fill(*args, **kw)}
        for once_name in once_defs:
            for long_name in long_defs:
                for per in (1, 8):
                    for order in ia.ONCE_ORDERS:
                        fns[f"{once_name} {long_name} p{per} {order}"] = build(once_name, long_name, per, order)
        row = timed_alike(fns, dev, flush)
        print(f"{op} {law} n {n} D {d} rows {m}:\n  " + "\n  ".join(row) + "\n  " +
              peers_line(op, args, kw, dev, flush), flush=True)
        if (op, n, d) == ("embedding_bwd", 2048, 768):
            for name in ("4/SM L32 p1 after", "8/SM L32 p1 after", "8/SM L8 p1 after", "8/SM L8 p1 beside",
                         "4/SM L8 p1 beside"):
                parts = ", ".join(f"{k} {v:.1f}" for k, v in kernel_times(fns[name], 20).items())
                print(f"  {name} kernels (us): {parts}", flush=True)
            for name in ("8/SM L8 p1 beside", "8/SM L8 p1 first"):
                print(f"  {name} timeline (start, duration us):\n    " + "\n    ".join(timeline(fns[name])),
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--splits", action="store_true", help="index_add's sorted sums per task split, then stop")
    ap.add_argument("--skew", action="store_true",
                    help="index_add's sorted sums per task split on Zipf-skewed and uniform keys, then stop")
    ap.add_argument("--sorts", action="store_true", help="the key sorts alone (as --splits begins), then stop")
    ap.add_argument("--fixed-schedules", action="store_true",
                    help="scatter_add's fixed sums per schedule over terms per destination, then stop")
    ap.add_argument("--fill", action="store_true",
                    help="embedding_bwd's sorted variant per grid of its zero fill, then stop")
    ap.add_argument("--fill-grid", action="store_true",
                    help="embedding_bwd's sorted variant per task split and lane width, then stop")
    ap.add_argument("--groups", action="store_true",
                    help="the fill split's sums per warps per position tile, then stop")
    ap.add_argument("--depths", action="store_true", help="with --groups: also per depth of the sums' loads")
    ap.add_argument("--gaps", action="store_true",
                    help="the gaps split per grid of its zero kernel, then stop")
    ap.add_argument("--gap-builds", action="store_true",
                    help="the gaps split per grid, zero stores and depth of the sums, then stop")
    ap.add_argument("--compact", action="store_true",
                    help="the fixed variant's compact schedule per grid of its zero fill, beside direct and sorted, "
                         "then stop")
    ap.add_argument("--once", action="store_true",
                    help="the once split per grid and warps per tile of its long rows, then stop")
    ap.add_argument("--once-builds", action="store_true",
                    help="the once split per build of its two kernels, tiles per block and order, then stop")
    a = ap.parse_args()
    dev = torch.device("cuda")
    flush = L2Flush(dev)
    # one sweep, the first flag set in this order, then stop
    sweeps = ((a.compact, compact_sweep), (a.once_builds, once_builds), (a.once, once_sweep),
              (a.gap_builds, gap_builds), (a.gaps, gap_sweep), (a.groups, lambda d, f: group_sweep(d, f, a.depths)),
              (a.fill, fill_sweep), (a.fill_grid, fill_grid), (a.skew, skew_sweep), (a.splits, split_sweep),
              (a.sorts, sort_sweep), (a.fixed_schedules, fixed_sweep))
    sweep = next((fn for on, fn in sweeps if on), None)
    if sweep is not None:
        sweep(dev, flush)
        return
    for op in a.ops:
        spec = kernels.spec(op)
        for case in spec.bench_cases("gpu"):
            args, kw = spec.make_inputs(case, dev)
            kw = {**kw, **dict(spec.bench_kwargs)}  # as benchmarked and routed: no host synchronisation
            subjects = {"atomic": lambda: kernels.get(op, "atomic")(*args, **kw),
                        **{f"sorted_{split}": (lambda split=split: sorted_split(op, split)(*args, **kw))
                           for split in ia.SPLITS},
                        "fixed": lambda: kernels.get(op, "fixed")(*args, **kw)}
            if op == "scatter_add" and not case.params.get("broadcast"):  # the element form: both schedules
                fixed = kernels.scatter_add.scatter_add_fixed_cuda
                subjects.update({f"fixed_{s}": (lambda s=s: fixed(*args, **kw, schedule=s)) for s in ia.SCHEDULES})
            print(f"\n{op} {case.name}")
            for name, fn in subjects.items():
                t, tg = us(fn, dev, flush), us(graph_of(fn), dev, flush)
                times = kernel_times(fn, a.reps)
                parts = ", ".join(f"{k} {v:.0f}" for k, v in list(times.items())[:7])
                print(f"  {name:14s} eager {t:7.1f} us  graph {tg:7.1f} us  kernels {sum(times.values()):7.1f} us"
                      f"   [{parts}]")


if __name__ == "__main__":
    main()
