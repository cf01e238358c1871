"""embedding_bwd: the weight gradient of an embedding lookup, as aten's embedding_dense_backward. CUDA
launchers for ``embedding_bwd.cu`` and their CPU order models; the machinery is index_add's
(kernels/index_add.py, kernels/segsum.cuh).

    grad_weight = embedding_bwd(grad_output, indices, num_weights=V, padding_idx=-1, scale_grad_by_freq=False)

grad_output (..., D) float32 and indices (...) int64 (the lookup's indices); grad_weight (V, D) float32
is index_add of the flattened tokens: rows equal to ``padding_idx`` get no gradient (-1 or None: none),
and with ``scale_grad_by_freq`` every term is divided by the count of its index in ``indices`` (one
IEEE float32 division per term, before it is added; aten multiplies by the reciprocal instead, so the
two differ by rounding).

Out-of-range indices raise KernelArgumentError (on the GPU after the kernels are queued; see
index_add.py; ``check_range="device"``: a device-side assertion instead, no host synchronisation;
``check_range=False``: no check, bad indices add nothing).

Order of the additions into one grad_weight element: as index_add's variants: ``atomic`` in arrival
order, ``sorted`` the row's tokens in token order, chunks of 32 * 2^e, fixed 32-ary tree over the chunk
partials.
"""
from __future__ import annotations

import numpy as np
import torch

from .index_add import (
    BOUNDARY_COUNTS,
    check_index,
    check_index_range,
    check_rows,
    draw_index,
    draw_values,
    BENCH_KWARGS,
    FIXED_NOTE,
    check_schedule,
    NO_CHECK,
    range_check,
    segsum_atomic_cuda,
    segsum_counts_cuda,
    segsum_cpu,
    segsum_fixed_cuda,
    segsum_sorted_cuda,
)
from .registry import Case, define_op
from .runtime import KernelArgumentError, check_cuda, check_size, check_tensor, memo_check

OP = "embedding_bwd"
SOURCE = "embedding_bwd.cu"

_CHECKED: dict = {}


def _check_all(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    g = check_tensor(OP, "grad_output", grad_output)
    if g.dim() < 1:
        raise KernelArgumentError(OP, "grad_output", "expected a tensor of shape (..., D), got a scalar")
    indices = check_index(OP, "indices", indices, device=g.device)
    if tuple(indices.shape) != tuple(g.shape[:-1]):
        raise KernelArgumentError(OP, "indices", f"expected grad_output's leading shape {tuple(g.shape[:-1])}, "
                                                 f"got {tuple(indices.shape)}")
    rows = check_rows(OP, "num_weights", num_weights)
    if indices.numel() and rows == 0:
        raise KernelArgumentError(OP, "num_weights", f"no rows to add {indices.numel()} tokens into")
    if padding_idx is None:
        padding_idx = -1
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)) or \
            not -1 <= padding_idx < max(rows, 1):
        raise KernelArgumentError(OP, "padding_idx", f"expected None, -1 (none) or a row in [0, {rows}), got "
                                                     f"{padding_idx!r}")
    if not isinstance(scale_grad_by_freq, bool):
        raise KernelArgumentError(OP, "scale_grad_by_freq", f"expected a bool, got {scale_grad_by_freq!r}")
    check_size(OP, "grad_output", g)
    d = g.shape[-1]
    if rows * d > 2**40:
        raise KernelArgumentError(OP, "num_weights", f"grad_weight would have {rows * d} elements; at most 2^40")
    return rows, int(padding_idx), d


def _prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    rows, skip, d = memo_check(_CHECKED, _check_all, grad_output, indices, num_weights, padding_idx,
                               scale_grad_by_freq)
    return indices.reshape(-1).contiguous(), grad_output.reshape(-1, d).contiguous(), rows, skip


def _counts(key, rows, scale_grad_by_freq, check_range):
    """(counts or None, check): each index's count over the batch for ``scale_grad_by_freq`` (segsum_count:
    integer atomics, exact; bad indices not counted, and no host synchronisation), after a sync range
    check, which is then not repeated."""
    check = range_check(OP, "indices", check_range)
    if not (scale_grad_by_freq and key.numel()):
        return None, check
    if check.sync:
        check_index_range(OP, "indices", key, rows)
        check = NO_CHECK
    return segsum_counts_cuda(SOURCE, key, rows), check


def _with_counts(segsum, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, check_range, **kw):
    """A launcher that divides each term by its index's count itself (atomic, fixed; ``kw``: the launcher's
    own arguments)."""
    key, g, rows, skip = _prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    check_cuda(OP, "grad_output", g)
    counts, check = _counts(key, rows, scale_grad_by_freq, check_range)
    return segsum(SOURCE, OP, key, g, rows, skip=skip, counts=counts, check=check, **kw)


def embedding_bwd_atomic_cuda(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                              check_range: bool | str = True) -> torch.Tensor:
    return _with_counts(segsum_atomic_cuda, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq,
                        check_range)


def embedding_bwd_fixed_cuda(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                             check_range: bool | str = True, schedule: str | None = None) -> torch.Tensor:
    """``schedule``: ``direct`` or ``compact``, None to let index_add.fixed_schedule choose; the bits are
    the same either way."""
    check_schedule(OP, schedule)
    return _with_counts(segsum_fixed_cuda, grad_output, indices, num_weights, padding_idx, scale_grad_by_freq,
                        check_range, schedule=schedule)


def embedding_bwd_sorted_cuda(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                              check_range: bool | str = True) -> torch.Tensor:
    key, g, rows, skip = _prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    check_cuda(OP, "grad_output", g)
    return segsum_sorted_cuda(SOURCE, OP, key, g, rows, skip=skip, scaled=scale_grad_by_freq,
                              check=range_check(OP, "indices", check_range))


def _cpu_prologue(*args, check_range):
    range_check(OP, "indices", check_range)  # a bad value is an error here too
    key, g, rows, skip = _prologue(*args)
    check_index_range(OP, "indices", key, rows)  # the models always check (their sort needs valid keys)
    if g.device.type != "cpu":
        raise KernelArgumentError(OP, "grad_output", f"the CPU model needs CPU tensors, got one on {g.device}")
    return key, g, rows, skip


def embedding_bwd_sorted_cpu(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                             check_range: bool | str = True, rng=None) -> torch.Tensor:
    key, g, rows, skip = _cpu_prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq,
                                     check_range=check_range)
    return segsum_cpu("sorted", key, g, rows, skip=skip, scaled=scale_grad_by_freq)


def embedding_bwd_atomic_cpu(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                             check_range: bool | str = True, rng=None) -> torch.Tensor:
    key, g, rows, skip = _cpu_prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq,
                                     check_range=check_range)
    return segsum_cpu("atomic", key, g, rows, skip=skip, scaled=scale_grad_by_freq, rng=rng)


def embedding_bwd_fixed_cpu(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False,
                            check_range: bool | str = True, rng=None, schedule: str | None = None) -> torch.Tensor:
    """The fixed sums' bits, whichever CUDA ``schedule`` is named (a name the CUDA launcher knows; whether it
    takes this form is the launcher's check: every schedule gives these bits)."""
    check_schedule(OP, schedule)
    key, g, rows, skip = _cpu_prologue(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq,
                                     check_range=check_range)
    return segsum_cpu("fixed", key, g, rows, skip=skip, scaled=scale_grad_by_freq)


# --------------------------------------------------------------------------------------------------
# Op spec


def _make_inputs(case: Case, device: torch.device) -> tuple[tuple, dict]:
    """Tokens (batch, seq) with a fraction ``dup`` on one hot row (num_weights // 2; a padding_idx case
    pads that row), grad_output normal (batch, seq, D)."""
    p = case.params
    g = torch.Generator().manual_seed(case.seed)
    shape = (p["batch"], p["seq"])
    indices = draw_index(g, shape, max(p["m"], 1), p.get("dup", 0.0), p.get("counts"))
    grad = draw_values(g, (*shape, p["d"]), p.get("special", ""))
    kw = {"num_weights": p["m"], "padding_idx": p.get("padding_idx", -1),
          "scale_grad_by_freq": p.get("scale", False)}
    return (grad.to(device), indices.to(device)), kw


def _reference(args: tuple, kwargs: dict) -> torch.Tensor:
    grad, indices = args
    d = grad.shape[-1]
    key = indices.reshape(-1).cpu()
    g = grad.detach().cpu().double().reshape(-1, d)
    pad = kwargs.get("padding_idx", -1)
    pad = -1 if pad is None else pad
    if kwargs.get("scale_grad_by_freq"):
        counts = torch.bincount(key, minlength=kwargs["num_weights"]).double()
        g = g / counts[key][:, None]
    keep = key != pad
    out = torch.zeros(kwargs["num_weights"], d, dtype=torch.float64)
    return out.index_add_(0, key[keep], g[keep])


def _case(name: str, seed: int, **params) -> Case:
    n, m, dup = params["batch"] * params["seq"], max(params["m"], 1), params.get("dup", 0.0)
    return Case(OP, name, params, seed=seed, contention=dup * n + (1 - dup) * n / m)


TEST_TABLE = (
    ("b4x33_d64", dict(batch=4, seq=33, d=64, m=200)),
    ("b2x40_d3_dup50", dict(batch=2, seq=40, d=3, m=20, dup=0.5)),
    ("b8x200_d48_dup100", dict(batch=8, seq=200, d=48, m=10, dup=1.0)),
    ("pad_hot_row", dict(batch=4, seq=50, d=16, m=30, dup=0.5, padding_idx=15)),
    ("pad_cold_row", dict(batch=4, seq=50, d=16, m=30, dup=0.5, padding_idx=3)),
    ("scale_dup50", dict(batch=6, seq=100, d=20, m=40, dup=0.5, scale=True)),
    ("scale_pad_dup100", dict(batch=4, seq=300, d=8, m=7, dup=1.0, scale=True, padding_idx=0)),
    ("empty", dict(batch=0, seq=5, d=8, m=10)),
    ("d1", dict(batch=3, seq=77, d=1, m=12, dup=0.3)),
    ("infnan", dict(batch=2, seq=64, d=16, m=8, dup=0.3, special="infnan")),
    ("negzero", dict(batch=2, seq=64, d=16, m=8, special="negzero")),
    ("sparse_d128_scale", dict(batch=4, seq=60, d=128, m=2000, dup=0.2, scale=True, padding_idx=5)),
    # sparse, five column slices (the last one partly idle), rows of one token among a hot one and the pad
    ("sparse_d520_pad", dict(batch=3, seq=50, d=520, m=400, dup=0.1, padding_idx=200)),
    ("sparse_d520_scale", dict(batch=3, seq=50, d=520, m=400, dup=0.1, scale=True)),
    # rows of 32 and 33 tokens (one chunk, two), the pad on one of each, divided by the counts
    ("counts_d128_scale_pad33", dict(batch=6, seq=49, d=128, m=len(BOUNDARY_COUNTS), counts=BOUNDARY_COUNTS,
                                     scale=True, padding_idx=4)),
    ("counts_d64_pad32", dict(batch=6, seq=49, d=64, m=len(BOUNDARY_COUNTS), counts=BOUNDARY_COUNTS,
                              padding_idx=3)),
)


def _test_cases() -> list[Case]:
    return [_case(name, 8000 + i, **p) for i, (name, p) in enumerate(TEST_TABLE)]


def _bench_cases(scale: str) -> list[Case]:
    """A language model's input embedding: 50k x 512 weights, a batch of 32 x 512 tokens; ``dup`` the
    fraction of tokens on one hot row (1%, 50%, 100%), the rest uniform."""
    if scale not in ("gpu", "quick", "cpu"):
        raise ValueError(f"{OP}: unknown bench scale {scale!r}")
    b, t, d, m = (4, 64, 64, 1000) if scale == "cpu" else (32, 512, 512, 50_000)
    cases = []
    for i, dup in enumerate((0.01, 0.5, 1.0)):
        cases.append(_case(f"v{m}_d{d}_b{b}x{t}_dup{int(dup * 100)}", 930 + i, batch=b, seq=t, d=d, m=m, dup=dup))
    cases.append(_case(f"v{m}_d{d}_b{b}x{t}_dup50_scale", 933, batch=b, seq=t, d=d, m=m, dup=0.5, scale=True))
    return cases


def torch_embedding_backward(grad_output, indices, *, num_weights, padding_idx=-1, scale_grad_by_freq=False, **_):
    return torch.ops.aten.embedding_dense_backward(grad_output, indices, num_weights,
                                                   -1 if padding_idx is None else padding_idx, scale_grad_by_freq)


def _peers() -> dict:
    return {"torch": torch_embedding_backward}  # and torch_deterministic, added by bench.runner


def _bytes_moved(case: Case) -> int:
    p = case.params
    n = p["batch"] * p["seq"]
    return n * p["d"] * 4 + n * 8 + p["m"] * p["d"] * 4


define_op(
    OP,
    variants=[
        ("atomic", False, False, embedding_bwd_atomic_cuda, embedding_bwd_atomic_cpu,
         "one thread per grad_output element, atomicAdd into the zeroed gradient"),
        ("sorted", True, False, embedding_bwd_sorted_cuda, embedding_bwd_sorted_cpu,
         "stable sort of the tokens by index; token order in chunks of 32*2^e, fixed 32-ary tree over "
         "chunk partials (hot rows split across warps)"),
        ("fixed", True, True, embedding_bwd_fixed_cuda, embedding_bwd_fixed_cpu, FIXED_NOTE),
    ],
    make_inputs=_make_inputs,
    reference=_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    peers=_peers,
    bytes_moved=_bytes_moved,
    bench_kwargs=BENCH_KWARGS,
)
