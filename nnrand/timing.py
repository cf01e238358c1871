"""CUDA-event timing of queued calls: the GPU time of a callable, with the host's launch cost kept out.

One home for the benchmarks (bench/timing.py), the audit (nnrand/audit.py) and anyone else who times GPU
work from Python.
"""
from __future__ import annotations

from typing import Callable

import torch

HOST_AHEAD_S = 200e-6   # host time per queued call the spin covers, at a ~2 GHz SM clock
SPIN_DOUBLINGS = 3   # a spin that ended too early is retried this many times, twice as long each time


def queued_event_times(fn: Callable[[], object], n: int, device: torch.device,
                       flush: Callable[[], object] | None = None,
                       host_ahead_s: float = HOST_AHEAD_S) -> tuple[list[float], bool]:
    """(seconds per call of ``fn`` from CUDA events, whether they may include host time). The stream first
    spins (torch.cuda._sleep, ``host_ahead_s`` of a ~2 GHz clock per call) while the host queues all ``n``
    calls, so each call's events time its GPU work alone. Where the GPU had already reached a call's start
    event when the host returned from queueing that call, the call may have waited for the host between
    its events: the whole timing runs again with twice the spin, up to SPIN_DOUBLINGS times; past that (a
    ``fn`` that waits for the GPU itself, as a host read-back does) the times are returned with ``True``.
    Without torch.cuda._sleep the calls are timed once, unqueued (``True``)."""
    spin = getattr(torch.cuda, "_sleep", None)
    for attempt in range(SPIN_DOUBLINGS + 1 if spin is not None else 1):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        torch.cuda.synchronize(device)
        if spin is not None:
            spin(int(2e9 * host_ahead_s * n * 2**attempt))
        caught_up = spin is None
        for s, e in zip(starts, ends):
            if flush is not None:
                flush()
            s.record()
            fn()
            e.record()
            caught_up = caught_up or s.query()   # the GPU was at this call before the host was done with it
        torch.cuda.synchronize(device)
        if not caught_up:
            break
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)], caught_up
