"""Torch mode flags (restored on exit), device-side timing, and the session's measured ceilings.

On CUDA a timed call is measured with CUDA events around it, L2 flushed before each call (so a small
input is read from HBM, as in a training step, not from a warm 50 MB L2), and the stream held by a
short spin kernel while the host queues the calls, so host launch overhead does not leak into the
device time. On the CPU the clock is ``time.perf_counter``.
"""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from nnrand.noise import set_deterministic_algorithms, tf32_new_api
from nnrand.timing import HOST_AHEAD_S, queued_event_times  # noqa: F401  (re-exported: the benchmarks' timer)

MODES = ("fast", "deterministic")


# --------------------------------------------------------------------------------------------------
# Global torch flags


@contextlib.contextmanager
def torch_mode(mode: str):
    """``fast``: cuDNN autotuning on (``cudnn.benchmark=True``), deterministic algorithms off.
    ``deterministic``: ``torch.use_deterministic_algorithms(True)`` and ``cudnn.deterministic=True``
    (autotuning stays on: it picks among deterministic algorithms only). TF32 is off in both, so every
    float32 op really computes in float32. Every flag is put back on exit, errors included."""
    if mode not in MODES:
        raise ValueError(f"unknown torch mode {mode!r}; known: {', '.join(MODES)}")
    cudnn = torch.backends.cudnn
    saved = {
        "benchmark": cudnn.benchmark,
        "cudnn_deterministic": cudnn.deterministic,
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }
    new_api = tf32_new_api()
    if new_api:
        saved["matmul_prec"] = torch.backends.cuda.matmul.fp32_precision
        saved["conv_prec"] = cudnn.conv.fp32_precision
    else:
        saved["matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
        saved["cudnn_tf32"] = cudnn.allow_tf32
    try:
        if new_api:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            cudnn.conv.fp32_precision = "ieee"
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            cudnn.allow_tf32 = False
        det = mode == "deterministic"
        cudnn.benchmark = True
        cudnn.deterministic = det
        set_deterministic_algorithms(det, False)
        yield
    finally:
        cudnn.benchmark = saved["benchmark"]
        cudnn.deterministic = saved["cudnn_deterministic"]
        set_deterministic_algorithms(saved["algorithms"], saved["warn_only"])
        if new_api:
            torch.backends.cuda.matmul.fp32_precision = saved["matmul_prec"]
            cudnn.conv.fp32_precision = saved["conv_prec"]
        else:
            torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
            cudnn.allow_tf32 = saved["cudnn_tf32"]


# --------------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronize: what a host clock (pytest-benchmark) may time."""
    if device.type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


class L2Flush:
    """Overwrites a buffer larger than the L2 cache (H200: 50 MB) so the next kernel starts cold."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def cuda_event_times(fn: Callable[[], object], n: int, device: torch.device, flush: L2Flush | None = None,
                     host_ahead_s: float = HOST_AHEAD_S) -> list[float]:
    """Seconds per call of ``fn`` from CUDA events, ``n`` calls queued behind a spin kernel (see
    :func:`queued_event_times`; a timing that includes host time warns)."""
    times, host_included = queued_event_times(fn, n, device, flush, host_ahead_s)
    if host_included:
        warnings.warn(f"cuda_event_times: {getattr(fn, '__name__', fn)!r} waits for the GPU while it is queued, "
                      "so its times include the host's", RuntimeWarning, stacklevel=2)
    return times


def host_times(fn: Callable[[], object], n: int, device: torch.device) -> list[float]:
    """Seconds per call of ``fn`` on the host clock, each call synchronized."""
    out = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# --------------------------------------------------------------------------------------------------
# Ceilings measured in the session


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float      # bytes/s, read + written, of a large device-to-device copy
    flop_rate: float      # FLOP/s of a large float32 matmul, TF32 off
    copy_bytes: int
    matmul_n: int


def measure_ceilings(device: torch.device, *, copy_bytes: int | None = None, matmul_n: int | None = None,
                     repeats: int = 10) -> Ceilings:
    """Copy bandwidth and float32 matmul rate on ``device``: what the op tables are measured against."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or ((1 << 30) if cuda else (64 << 20))
    matmul_n = matmul_n or (8192 if cuda else 1024)
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(matmul_n, matmul_n, device=device)
    b = torch.randn(matmul_n, matmul_n, device=device)
    c = torch.empty_like(a)
    with torch_mode("fast"):
        copy = lambda: dst.copy_(src)  # noqa: E731
        mm = lambda: torch.mm(a, b, out=c)  # noqa: E731
        for f in (copy, mm):
            f()
        if cuda:
            t_copy = min(cuda_event_times(copy, repeats, device))
            t_mm = min(cuda_event_times(mm, repeats, device))
        else:
            t_copy = min(host_times(copy, repeats, device))
            t_mm = min(host_times(mm, max(3, repeats // 3), device))
    del src, dst, a, b, c
    return Ceilings(bandwidth=2 * copy_bytes / t_copy, flop_rate=2 * matmul_n**3 / t_mm,
                    copy_bytes=copy_bytes, matmul_n=matmul_n)


# --------------------------------------------------------------------------------------------------
# Plain CUDA timers for the kernel dev scripts in bench/dev/ (no L2 flush, no spin kernel: they time
# what a caller sees on a warm cache, or pure GPU time through graph replay).


@contextlib.contextmanager
def cudnn_flags(benchmark: bool, deterministic: bool):
    """cudnn.benchmark / cudnn.deterministic as given, TF32 off; the previous flags restored on exit. TF32
    goes through torch's fp32_precision flags where this torch has them (reading the legacy allow_tf32
    after those were set is an error in torch), else through allow_tf32."""
    from nnrand.noise import _set_tf32, _tf32_flags

    cudnn = torch.backends.cudnn
    saved = (cudnn.benchmark, cudnn.deterministic, _tf32_flags())
    cudnn.benchmark, cudnn.deterministic = benchmark, deterministic
    if "conv" in saved[2]:
        _set_tf32({"matmul": "ieee", "conv": "ieee", "rnn": "ieee"})
    else:
        _set_tf32({"matmul": False, "cudnn": False})
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic = saved[:2]
        _set_tf32(saved[2])


@contextlib.contextmanager
def deterministic_mode(fill_uninitialized_memory: bool = True):
    """PyTorch's deterministic mode as a user turns it on (``use_deterministic_algorithms(True)``,
    cudnn.deterministic, cudnn.benchmark off, TF32 off), optionally without torch's filling of uninitialised
    outputs; everything put back on exit."""
    from torch.utils import deterministic as det

    before = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        with cudnn_flags(benchmark=False, deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = before


def back_to_back_us(fn: Callable[[], object], *, calls: int, repeats: int, warmup: int = 0) -> float:
    """Median device time per call, CUDA events around ``calls`` back-to-back calls: the host queues
    the next call while the GPU runs the previous one, so host time hides where the kernels are longer."""
    from nnrand.autotune import events_us

    for _ in range(warmup):
        fn()
    return events_us(fn, torch.device("cuda", torch.cuda.current_device()), calls, repeats)


def graph_replay_us(fn: Callable[[], object], *, calls: int, replays: int) -> float:
    """Median GPU time per call from CUDA-graph replays of ``calls`` back-to-back calls (launch gaps and
    host overhead excluded). ``fn`` must be capturable: no host sync, no allocator outside torch's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)
