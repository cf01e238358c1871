"""Where a routed op's host time goes inside autograd's backward, against the same aten calls made directly.

    python bench/dev/routed_backward_split.py [--dtype bf16] [--layout channels_last] [--calls 200]

One conv (3x3 256->256, 14x14, batch 64) and a training-mode BatchNorm after it. For each mode (stock
PyTorch under cudnn.benchmark; PyTorch's deterministic mode with uninitialised-memory filling off, as the
routing sets it; routed fastest-deterministic; routed tree), medians over --calls of perf_counter, in us:

- conv, bn: convolution_backward (dX and dW) and native_batch_norm_backward called from Python, each alone;
- backward: torch.autograd.grad through both layers (the engine's own work included, graph retained);
- handler: inside the routed ops' Python kernels during that backward (their entry to their return);
- outside: backward - handler for routed modes: the engine, the dispatcher's trip into Python and back, and
  the unrouted ops of the backward (compare with the stock row's backward).

``--clock process``: the process's CPU time (every thread, the autograd engine's included) in place of wall
time, which a shared host's other tenants disturb less.

The GPU runs behind: nothing synchronises inside a timed call (every 20 calls the queue is drained). The
modes run in turn --rounds times; each figure is the smallest of its per-round medians (a shared host's
noise only ever adds time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nnrand  # noqa: E402
from nnrand import routing  # noqa: E402
from bench.timing import cudnn_flags, deterministic_mode  # noqa: E402
from nnrand.train import AMP_DTYPES  # noqa: E402

_HANDLER_NS = [0]


def _timed_bind_observed(fn, session, op, *bound):
    """routing._bind_observed with the time inside the kernel added to _HANDLER_NS."""
    inner = _ORIGINAL_BIND(fn, session, op, *bound)

    def kernel(keyset, *args, **kwargs):
        t0 = CLOCK[0]()
        try:
            return inner(keyset, *args, **kwargs)
        finally:
            _HANDLER_NS[0] += (CLOCK[0]() - t0) * 1e9
    return kernel


_ORIGINAL_BIND = routing._bind_observed


CLOCK = [time.perf_counter]


def timed(fn, calls: int) -> tuple[float, float]:
    """Median host us per call of fn and median handler us per call."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times, inside = [], []
    for i in range(calls):
        _HANDLER_NS[0] = 0
        clock = CLOCK[0]
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e6)
        inside.append(_HANDLER_NS[0] / 1e3)
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times), statistics.median(inside)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--layout", choices=["nchw", "channels_last"], default="channels_last")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = p.parse_args()
    CLOCK[0] = time.process_time if args.clock == "process" else time.perf_counter
    dtype = AMP_DTYPES.get(args.dtype, torch.float32)
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    x, w, dy = rand(64, 256, 14, 14).requires_grad_(), rand(256, 256, 3, 3).requires_grad_(), rand(64, 256, 14, 14)
    gamma = torch.ones(256, device="cuda", requires_grad=True)
    beta = torch.zeros(256, device="cuda", requires_grad=True)
    mean, invstd = torch.zeros(256, device="cuda"), torch.ones(256, device="cuda")
    xd, wd = x.detach(), w.detach()

    @torch.no_grad()
    def conv():
        torch.ops.aten.convolution_backward(dy, xd, wd, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                            [True, True, False])

    @torch.no_grad()
    def bn():
        torch.ops.aten.native_batch_norm_backward(dy, xd, gamma, None, None, mean, invstd, True, 1e-5,
                                                  [True, True, True])

    def graph():
        out = F.batch_norm(F.conv2d(x, w, padding=1), None, None, gamma, beta, training=True)
        return lambda: torch.autograd.grad(out, (x, w, gamma, beta), dy, retain_graph=True)

    routing._bind_observed = _timed_bind_observed
    rows: dict[str, list] = {}
    try:
        modes = [("stock (cudnn.benchmark)", lambda: cudnn_flags(benchmark=True, deterministic=False)),
                 ("PyTorch deterministic mode", lambda: deterministic_mode(fill_uninitialized_memory=False)),
                 ("routed fastest-deterministic", lambda: nnrand.use_kernels("fastest-deterministic")),
                 ("routed tree", lambda: nnrand.use_kernels("tree"))]
        for _ in range(args.rounds):
            for name, ctx in modes:
                with ctx():
                    c, _ = timed(conv, args.calls)
                    n, _ = timed(bn, args.calls)
                    b, h = timed(graph(), args.calls)
                rows.setdefault(name, []).append((c, n, b, h))
    finally:
        routing._bind_observed = _ORIGINAL_BIND
    print(f"host us per call, conv 3x3 256->256 14x14 batch 64 + BatchNorm, {args.dtype}, {args.layout}, "
          f"min over {args.rounds} rounds of the median of {args.calls} calls:")
    print(f"  {'mode':<30} {'conv':>7} {'bn':>7} {'backward':>9} {'handler':>8} {'outside':>8}")
    for name, per_round in rows.items():
        c, n, b, h = (min(col) for col in zip(*per_round))
        o = min(r[2] - r[3] for r in per_round)
        print(f"  {name:<30} {c:7.1f} {n:7.1f} {b:9.1f} {h:8.1f} {o:8.1f}")


if __name__ == "__main__":
    main()
