"""The Python cost routing adds to one aten call, on the CPU (no GPU needed): convolution_backward on tiny
tensors, so the op itself costs little and the dispatch around it shows.

    python bench/dev/routing_overhead_cpu.py [--calls 3000] [--rounds 5]

Rows, median host us per call (smallest over --rounds rounds): the aten call as registered; the same call
through a bare Python kernel registered with torch.library that hands it straight back (the dispatcher's
trip into Python and out, which any Python-registered override pays); and routed by
``use_kernels("fastest-deterministic")`` with torch's kernel chosen (the routing's own Python on top of that
trip). One thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import nnrand  # noqa: E402


def host_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(1, 2, 3, 3, generator=g), torch.randn(1, 2, 3, 3, generator=g)
    w = torch.randn(2, 2, 1, 1, generator=g)

    def conv():
        return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                   [True, True, False])

    original = torch.library.get_kernel("aten::convolution_backward", "CPU")
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        rows.setdefault("aten call", []).append(host_us(conv, args.calls))
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("convolution_backward", lambda keyset, *a: original.call_boxed(keyset, *a), "CPU",
                     with_keyset=True)
        try:
            rows.setdefault("bare Python kernel", []).append(host_us(conv, args.calls))
        finally:
            lib._destroy()
        with nnrand.use_kernels("fastest-deterministic") as r:
            rows.setdefault("routed fastest-deterministic", []).append(host_us(conv, args.calls))
        assert r.coverage["convolution_backward"] == {"torch_det": args.calls + 200}, r.coverage
    print(f"host us per convolution_backward call (CPU, 1x2x3x3, 1x1 kernel; torch {torch.__version__}), "
          f"smallest of {args.rounds} medians of {args.calls} calls:")
    for name, v in rows.items():
        print(f"  {name:<30} {min(v):7.2f}")


if __name__ == "__main__":
    main()
