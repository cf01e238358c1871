"""scatter_add: out (M, D) = 0; out[index[i, j], j] += src[i, j] (torch's scatter_add_ along dim 0, with
index of src's shape). CUDA launchers for ``scatter_add.cu`` and their CPU order models; the machinery
is index_add's (kernels/index_add.py, kernels/segsum.cuh).

    out = scatter_add(index, src, num_rows=M)      # index (N, D) int64, src (N, D) float32

An index whose columns are all one column (stride 0 along dim 1: ``idx[:, None].expand(N, D)``, as graph
libraries build it) is index_add's row form and runs index_add's kernels on ``index[:, 0]``: found from
the strides alone, no pass over the data. Any other index is the element form: N * D contributions,
src[i, j] going to destination (index[i, j], j).

Order of the additions into one output element, in both forms (index_add.py has the details):
- ``atomic``: arrival order, from +0.0 (subnormals flushed as float atomicAdd does).
- ``sorted``: the element's contributions in source order (i ascending), chunks of 32 * 2^e summed in
  order from +0.0, chunk partials combined by a fixed 32-ary tree of halving trees. In the element form
  the sort is over N * D keys (index * D + j), so it costs a sort of N * D keys where the row form sorts N
  (the radix sort of M * D destinations takes ceil(bit_length(M * D) / 9) passes).
- ``fixed``: no order at all (integer sums of the terms rounded to multiples of 2^-s). The element form
  with at least index_add.FBIN_MIN_TERMS_PER_DST terms per destination (and at most 2^21 destinations,
  2^31 - 2^12 terms) takes the binned schedule: terms
  placed by bin of destinations, summed in shared memory, no global atomic per term; the row form (an
  expanded index) with fewer source rows than output rows the compact one: an accumulator row per source
  row, the output zero-filled beside (``schedule``: index_add.fixed_schedule; every schedule gives the
  same bits).

Out-of-range indices raise KernelArgumentError (on the GPU after the kernels are queued; see
index_add.py; ``check_range=False``: no check, no host synchronisation, bad indices add nothing).
"""
from __future__ import annotations

import torch

from .index_add import (
    check_index,
    check_index_range,
    check_rows,
    check_schedule,
    draw_index,
    draw_values,
    noncontiguous,
    BENCH_KWARGS,
    FIXED_NOTE,
    range_check,
    segsum_atomic_cuda,
    segsum_cpu,
    segsum_fixed_cuda,
    segsum_sorted_cuda,
)
from .registry import Case, define_op
from .runtime import KernelArgumentError, check_cuda, check_size, check_tensor, memo_check

OP = "scatter_add"
SOURCE = "scatter_add.cu"

_CHECKED: dict = {}


def _check_all(index, src, num_rows):
    src = check_tensor(OP, "src", src, ndim=2)
    index = check_index(OP, "index", index, device=src.device)
    if index.shape != src.shape:
        raise KernelArgumentError(OP, "index", f"expected src's shape {tuple(src.shape)}, got {tuple(index.shape)}")
    rows = check_rows(OP, "num_rows", num_rows)
    if index.numel() and rows == 0:
        raise KernelArgumentError(OP, "num_rows", f"no rows to add {index.numel()} elements into")
    check_size(OP, "src", src)
    if rows * src.shape[1] > 2**40:
        raise KernelArgumentError(OP, "num_rows", f"the output would have {rows * src.shape[1]} elements; at most 2^40")
    # row form: every column is column 0 (stride 0 along dim 1), or a single column
    return rows, bool(src.shape[1] <= 1 or index.stride(1) == 0)


def _prologue(index, src, num_rows):
    """(key, src, rows, elementwise): key (N,) in the row form, (N, D) contiguous in the element form."""
    rows, row_form = memo_check(_CHECKED, _check_all, index, src, num_rows)
    key = index[:, 0] if row_form and index.shape[1] else index
    return key.contiguous(), src.contiguous(), rows, not row_form


def scatter_add_atomic_cuda(index, src, *, num_rows, check_range: bool | str = True) -> torch.Tensor:
    key, src, rows, elementwise = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_atomic_cuda(SOURCE, OP, key, src, rows, elementwise=elementwise,
                              check=range_check(OP, "index", check_range))


def scatter_add_sorted_cuda(index, src, *, num_rows, check_range: bool | str = True) -> torch.Tensor:
    key, src, rows, elementwise = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_sorted_cuda(SOURCE, OP, key, src, rows, elementwise=elementwise,
                              check=range_check(OP, "index", check_range))


def scatter_add_fixed_cuda(index, src, *, num_rows, check_range: bool | str = True,
                           schedule: str | None = None) -> torch.Tensor:
    """``schedule``: ``direct``, ``binned`` (element form only) or ``compact`` (row form only), None to let
    fixed_schedule choose; the bits are the same either way (kernels/index_add.py: segsum_fixed_cuda)."""
    key, src, rows, elementwise = _prologue(index, src, num_rows)
    check_cuda(OP, "src", src)
    return segsum_fixed_cuda(SOURCE, OP, key, src, rows, elementwise=elementwise,
                             check=range_check(OP, "index", check_range), schedule=schedule)


def _cpu_prologue(index, src, num_rows, check_range):
    range_check(OP, "index", check_range)  # a bad value is an error here too
    key, src, rows, elementwise = _prologue(index, src, num_rows)
    check_index_range(OP, "index", key, rows)  # the models always check (their sort needs valid keys)
    if src.device.type != "cpu":
        raise KernelArgumentError(OP, "src", f"the CPU model needs CPU tensors, got one on {src.device}")
    return key, src, rows, elementwise


def scatter_add_sorted_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None) -> torch.Tensor:
    key, src, rows, elementwise = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("sorted", key, src, rows, elementwise=elementwise)


def scatter_add_atomic_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None) -> torch.Tensor:
    key, src, rows, elementwise = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("atomic", key, src, rows, elementwise=elementwise, rng=rng)


def scatter_add_fixed_cpu(index, src, *, num_rows, check_range: bool | str = True, rng=None,
                          schedule: str | None = None) -> torch.Tensor:
    """The fixed sums' bits, whichever CUDA ``schedule`` is named (a name the CUDA launcher knows; whether it
    takes this form is the launcher's check: every schedule gives these bits)."""
    check_schedule(OP, schedule)
    key, src, rows, elementwise = _cpu_prologue(index, src, num_rows, check_range)
    return segsum_cpu("fixed", key, src, rows, elementwise=elementwise)


# --------------------------------------------------------------------------------------------------
# Op spec


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """``broadcast``: one index per row expanded along dim 1 (stride 0); else an index per element, a
    fraction ``dup`` of all entries on the hot row (so about that fraction of each column)."""
    p = case.params
    g = torch.Generator().manual_seed(case.seed)
    n, d, m = p["n"], p["d"], max(p["m"], 1)
    if p.get("broadcast"):
        index = draw_index(g, (n,), m, p.get("dup", 0.0)).to(device)[:, None].expand(n, d)
    else:
        index = draw_index(g, (n, d), m, p.get("dup", 0.0)).to(device)
    src = draw_values(g, (n, d), p.get("special", ""))
    if p.get("noncontig"):
        src = noncontiguous(src)
    return (index, src.to(device)), {"num_rows": p["m"]}


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    index, src = args
    out = torch.zeros(kwargs["num_rows"], src.shape[1], dtype=torch.float64)
    return out.scatter_add_(0, index.cpu(), src.detach().cpu().double())


def _case(name: str, seed: int, **params) -> Case:
    n, m, dup = params["n"], max(params["m"], 1), params.get("dup", 0.0)
    # expected contributions into the hot output element (per column in both forms)
    return Case(OP, name, params, seed=seed, contention=dup * n + (1 - dup) * n / m)


TEST_TABLE = (
    ("elem_d17", dict(n=1023, d=17, m=100)),
    ("elem_d1", dict(n=1025, d=1, m=50, dup=0.3)),
    ("elem_d5_dup100_two_levels", dict(n=1200, d=5, m=6, dup=1.0)),
    ("elem_d3_dup100_long_chunks", dict(n=33000, d=3, m=2, dup=1.0)),
    ("bcast_d64_dup50", dict(n=1100, d=64, m=70, dup=0.5, broadcast=True)),
    ("bcast_d2", dict(n=700, d=2, m=40, dup=0.2, broadcast=True)),
    ("empty", dict(n=0, d=8, m=10)),
    ("empty_bcast", dict(n=0, d=4, m=3, broadcast=True)),
    ("noncontig_d24", dict(n=600, d=24, m=50, dup=0.2, noncontig=True)),
    ("negzero_d12", dict(n=400, d=12, m=30, special="negzero")),
    ("infnan_d16", dict(n=500, d=16, m=20, dup=0.3, special="infnan")),
    ("cancel_bcast_d32_dup100", dict(n=1500, d=32, m=4, dup=1.0, special="cancel", broadcast=True)),
)


def _test_cases() -> list[Case]:
    return [_case(name, 7000 + i, **p) for i, (name, p) in enumerate(TEST_TABLE)]


def _bench_cases(scale: str) -> list[Case]:
    """``dup``: the fraction of indices on one hot row. broadcast: graph aggregation
    (1e6 edges of 64 floats into 1e5 nodes, index expanded); element: an index per element."""
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    if scale == "cpu":
        bcast, elem = (4096, 16, 512), (2048, 8, 256)
    else:
        bcast, elem = (1_000_000, 64, 100_000), (2**18, 32, 10_000)
    cases = []
    for i, dup in enumerate((0.01, 0.5, 1.0)):
        n, d, m = bcast
        cases.append(_case(f"bcast_n{n}_d{d}_m{m}_dup{int(dup * 100)}", 910 + i, n=n, d=d, m=m, dup=dup, broadcast=True))
    for i, dup in enumerate((0.01, 0.5, 1.0)):
        n, d, m = elem
        cases.append(_case(f"elem_n{n}_d{d}_m{m}_dup{int(dup * 100)}", 920 + i, n=n, d=d, m=m, dup=dup))
    return cases


def torch_scatter_add(index, src, *, num_rows, **_):
    return torch.zeros(num_rows, src.shape[1], device=src.device, dtype=src.dtype).scatter_add_(0, index, src)


def _peers() -> dict:
    return {"torch": torch_scatter_add}  # and torch_deterministic, added by bench.runner


def _bytes_moved(case: Case) -> int:
    p = case.params
    index_bytes = p["n"] * 8 if p.get("broadcast") else p["n"] * p["d"] * 8
    return p["n"] * p["d"] * 4 + index_bytes + p["m"] * p["d"] * 4


define_op(
    OP,
    variants=[
        ("atomic", False, False, scatter_add_atomic_cuda, scatter_add_atomic_cpu,
         "one thread per element, atomicAdd into the zeroed output (as torch's CUDA scatter_add)"),
        ("sorted", True, False, scatter_add_sorted_cuda, scatter_add_sorted_cpu,
         "stable sort by destination (by row for an expanded index, else by element); source order in "
         "chunks of 32*2^e, fixed 32-ary tree over chunk partials"),
        ("fixed", True, True, scatter_add_fixed_cuda, scatter_add_fixed_cpu,
         FIXED_NOTE + "; an index per element, 4+ terms per destination: terms binned by destination, "
                      "summed in shared memory"),
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
