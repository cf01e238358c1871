"""Shared test utilities: byte hashes, bit comparisons, ULP distances, summation error bounds."""
from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import torch

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)


def byte_hash(t: torch.Tensor) -> str:
    """SHA-1 of a tensor's bytes (any dtype, bf16 included: hashed as raw bytes)."""
    return hashlib.sha1(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def distinct(results: list[torch.Tensor]) -> int:
    return len({byte_hash(r) for r in results})


def gamma(depth: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): a float32 sum whose every term passes through at most k
    additions is off by at most gamma_k * sum |x_i|."""
    return depth * U32 / (1 - depth * U32)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: the same bit pattern (so +0.0 and -0.0 differ), or NaN in both (NaN payloads may differ
    between CPU and GPU). Same shape and dtype assumed."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if not a.is_floating_point():
        return a == b
    same = a.view(_BITS[a.element_size()]) == b.view(_BITS[b.element_size()])
    return same | (torch.isnan(a) & torch.isnan(b))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits in every element (NaN payloads aside). Unlike ``torch.equal``, -0.0 is
    not +0.0."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(_same_bits(a, b).all())


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: not bitwise equal: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    diff = ~_same_bits(a, b)
    if not bool(diff.any()):
        return
    idx = diff.nonzero()[:10].tolist()
    raise AssertionError(f"{what}: not bitwise equal; {int(diff.sum())} elements differ, first at {idx}: "
                         f"{a[diff][:5].tolist()} vs {b[diff][:5].tolist()}")


def float32_bits(t: torch.Tensor) -> np.ndarray:
    """float32 values as uint32 in logical (row-major) order, on the host (+0.0 and -0.0 differ)."""
    return t.detach().to("cpu").contiguous().reshape(-1).numpy().view(np.uint32)


def differing_bits(a: torch.Tensor, b: torch.Tensor, where=None) -> np.ndarray:
    """Flat (row-major) positions where two float32 tensors' bits differ, any NaN matching any NaN (payloads
    may differ between CPU and GPU); ``where``: a boolean mask broadcast to ``a``'s shape, the positions to
    compare."""
    x, y = float32_bits(a), float32_bits(b)
    bad = (x != y) & ~(np.isnan(x.view(np.float32)) & np.isnan(y.view(np.float32)))
    if where is not None:
        bad &= np.broadcast_to(where, a.shape).reshape(-1)
    return np.nonzero(bad)[0]


def assert_within_bound(result: torch.Tensor, ref: np.ndarray, bound) -> None:
    """|result - ref| <= bound (broadcast) wherever the float64 reference is finite; NaN exactly where it is
    NaN and its infinities where it is infinite. Names the first offenders."""
    r = result.detach().to("cpu").contiguous().double().numpy()
    assert r.shape == ref.shape, (r.shape, ref.shape)
    bound = np.broadcast_to(bound, ref.shape)
    fin = np.isfinite(ref)
    err = np.where(fin, np.abs(r - np.where(fin, ref, 0.0)), 0.0)
    bad = np.argwhere(fin & ~(err <= bound))
    assert bad.size == 0, f"{len(bad)} elements outside the bound, first at {bad[:5].tolist()}: " \
                          f"err {err[tuple(bad[:5].T)]}, bound {bound[tuple(bad[:5].T)]}"
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(r), nan), \
        f"NaN where the exact result has none, or the reverse, at {np.argwhere(np.isnan(r) != nan)[:5].tolist()}"
    inf = np.isinf(ref)
    assert np.array_equal(r[inf], ref[inf]), "infinities differ"


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two float32 tensors (ordered bit patterns)."""
    def ordered(t):
        i = t.detach().cpu().contiguous().numpy().view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    if a.numel() == 0:
        return 0
    return int(np.max(np.abs(ordered(a) - ordered(b))))


def entropy_from_seeds(monkeypatch, first: int = 0) -> None:
    """For the rest of a test, ``np.random.default_rng(None)`` (fresh OS entropy: a CPU order model's
    ``rng=None``) takes the seeds first, first + 1, ... instead: a check that ``rng=None`` gives each call a
    new arrival order then has the same outcome every run."""
    import itertools

    seeds = itertools.count(first)
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed=None: real(next(seeds) if seed is None else seed))


@contextlib.contextmanager
def nan_filled_memory():
    """PyTorch's deterministic mode, whose allocations (torch.empty) start filled with NaN: an element a
    kernel leaves unwritten shows. The mode found on entry is restored on exit."""
    from torch.utils import deterministic

    assert deterministic.fill_uninitialized_memory
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det)


def routed_recording(defer: bool = True, hook=None, steps: int = 2, device: str = "cpu",
                     recorders: list | None = None) -> dict:
    """ops="routed" over a few tree-routed training steps of a small conv net (a max-pool, BatchNorm and a
    residual sum); ``hook``: a gradient hook on the input of the first block's second conv (its only use);
    ``recorders``: the recorder is appended to it."""
    from nnrand import models, routing, trace

    torch.manual_seed(0)
    model = models.small(4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16, generator=g).to(device), torch.randint(0, 4, (4,), generator=g).to(device)
    handles = []
    if hook is not None:
        relu1 = model.stages[0][0].relu1
        handles.append(relu1.register_forward_hook(lambda m, a, out: [out.register_hook(hook), None][1]))
    with routing.use_kernels("tree"), trace.record(None, ops="routed", model=model, defer=defer) as rec:
        if recorders is not None:   # (before the steps: a test may look at a recording that failed)
            recorders.append(rec)
        for _ in range(steps):
            rec.step()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            rec.snapshot(model.named_parameters())
    for h in handles:
        h.remove()
    return rec.arrays()
