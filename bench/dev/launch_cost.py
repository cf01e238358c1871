"""Host time per call of the pieces of a routed backward op, on inputs so small that the GPU keeps up.

    python3 bench/dev/launch_cost.py

Each row: microseconds of host time per call (perf_counter over ``--calls`` calls after a warm-up, one
synchronisation at the end), for torch's own ops, each variant's launcher, and aten::convolution_backward
natively and routed. What a routed conv adds to a host-bound step is the routed row minus the native one.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import kernels  # noqa: E402
import nnrand  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print cProfile's top N functions of the routed conv backward calls")
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    c, hw = 16, 8
    x = torch.randn(2, c, hw, hw, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, c, 3, 3, device="cuda", generator=g)
    dy = torch.randn(2, c, hw, hw, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    geom = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    conv_args = (dy, x, w, [c], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    torch.backends.cudnn.benchmark = True
    rows = [
        ("torch.empty", lambda: torch.empty(1024, device="cuda")),
        ("torch add", lambda: x.add(x)),
        ("conv_dgrad tree", lambda: kernels.get("conv_dgrad", "tree").cuda(w, dy, input_size=(hw, hw), **geom)),
        ("conv_wgrad tree", lambda: kernels.get("conv_wgrad", "tree").cuda(x, dy, kernel_size=(3, 3), **geom)),
        ("conv_wgrad winograd", lambda: kernels.get("conv_wgrad", "winograd").cuda(x, dy, kernel_size=(3, 3),
                                                                                   **geom)),
        ("bias_grad tree", lambda: kernels.get("bias_grad", "tree").cuda(dy)),
        ("aten conv backward, native", lambda: torch.ops.aten.convolution_backward(*conv_args)),
    ]
    out = [(name, per_call_us(fn, args.calls)) for name, fn in rows]
    no_bias = (*conv_args[:-1], [True, True, False])
    with nnrand.use_kernels("tree"):
        out.append(("aten conv backward, routed tree", per_call_us(
            lambda: torch.ops.aten.convolution_backward(*conv_args), args.calls)))
        out.append(("  the same, no bias gradient", per_call_us(
            lambda: torch.ops.aten.convolution_backward(*no_bias), args.calls)))
        out.append(("  dgrad + wgrad launchers inside it", per_call_us(lambda: (rows[2][1](), rows[3][1]()), args.calls)))
    from nnrand import routing

    real = routing._deterministic_mode
    routing._deterministic_mode = lambda strict: contextlib.nullcontext()
    try:
        with nnrand.use_kernels("tree"):
            out.append(("  no bias, deterministic mode off", per_call_us(
                lambda: torch.ops.aten.convolution_backward(*no_bias), args.calls)))
    finally:
        routing._deterministic_mode = real
    out.append(("aten conv backward native, no bias", per_call_us(
        lambda: torch.ops.aten.convolution_backward(*no_bias), args.calls)))
    if args.profile:
        import cProfile
        import pstats

        with nnrand.use_kernels("tree"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                torch.ops.aten.convolution_backward(*conv_args)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    print(f"host us per call ({args.calls} calls, {torch.cuda.get_device_name()}):")
    for name, us in out:
        print(f"  {name:<34} {us:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
