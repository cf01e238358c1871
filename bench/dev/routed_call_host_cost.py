"""Host time of one routed backward call against the same aten call unrouted, CUDA, per op: the Python
cost the routing adds to an eager step (the GPU runs behind; nothing synchronises inside the timed loop).

    python bench/dev/routed_call_host_cost.py [--dtype bf16] [--layout channels_last] [--calls 200]
    python bench/dev/routed_call_host_cost.py --dtype fp32 --layout nchw --cprofile 40 --cprofile-family tree

Rows: convolution_backward (dX+dW of a 3x3 256->256 14x14 conv, batch 64) under cuDNN benchmark, under
PyTorch's deterministic mode, and routed by fastest-deterministic (torch_det chosen) and tree; BatchNorm
backward (the conv's output) native and routed by each of the two families (both run its tree variant).
Each figure is the median over --calls calls of perf_counter around the call alone, in microseconds.
``--cprofile N`` adds the top N functions by own time over --calls rounds of the two routed calls, under
``--cprofile-family``; that loop does not synchronise, so the launches' own time includes waiting on a
full launch queue. ``--layers`` adds the layers under a routed call, each timed alone: the tree launchers
called directly (no dispatcher, no routing), a pass-through Python override of the BatchNorm backward (the
dispatcher's trip into Python and back, nothing else), one ``torch.empty`` and one kernel launch.
``--lines`` line-profiles --calls rounds of the routed conv and both BatchNorm backward calls under ``tree``
(the routing's handlers, the launchers' per-call closures, the launches; needs ``line_profiler``): which
lines of a routed call take its host time. The cuDNN BatchNorm backward (what a CUDA model in float32
calls) is timed beside the native one.
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

import nnrand  # noqa: E402
from bench.timing import cudnn_flags  # noqa: E402
from nnrand.train import AMP_DTYPES  # noqa: E402


def host_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if i % 20 == 19:
            torch.cuda.synchronize()   # keep the queue short: host time only, not back-pressure
    torch.cuda.synchronize()
    return statistics.median(times)


def profile(conv, bn, args) -> None:
    """cProfile ``--calls`` rounds of the routed conv and BatchNorm backward calls: the top functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        conv()
        bn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"cProfile, {args.cprofile_family}, {args.calls} rounds of one conv and one BatchNorm backward:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


def lines(calls: list, rounds: int) -> None:
    """Line-profile ``rounds`` rounds of ``calls`` (routed under the open ``tree`` context)."""
    try:
        from line_profiler import LineProfiler
    except ImportError:
        raise SystemExit("--lines needs line_profiler: pip install line_profiler") from None
    from kernels import bn_bwd, conv_dgrad, runtime
    from nnrand import routing

    lp = LineProfiler()
    for f in (routing._conv_backward, routing._conv_key, routing._conv_variants, routing._param_strides,
              routing._native_bn_backward, routing._cudnn_bn_backward, routing._bn_route, routing._call,
              routing.memory_format_of, routing.Coverage.add, bn_bwd._launch, bn_bwd._aligned,
              runtime.Launch.__call__, runtime._launch_kernel, runtime.ticket_counters, runtime.check_key,
              conv_dgrad._empty_dx, conv_dgrad._pack_weights):
        lp.add_function(f)
    for plan in routing._ACTIVE.conv_plans.values():   # the prepared launchers' per-call closures
        for fn in (plan.dgrad, plan.wgrad):
            if fn is not None:
                lp.add_function(fn)
    lp.enable_by_count()
    for i in range(rounds):
        for call in calls:
            call()
        if i % 20 == 19:
            torch.cuda.synchronize()
    lp.disable_by_count()
    torch.cuda.synchronize()
    lp.print_stats(output_unit=1e-6, stripzeros=True)


def layers(x, w, dy, mean, invstd, gamma, bn, calls: int) -> list[tuple[str, float]]:
    """The layers under a routed call, each timed alone (see the module docstring)."""
    import numpy as np

    from kernels import bn_bwd, conv_dgrad, conv_wgrad, runtime

    rows = [("conv tree launchers direct (dX + dW)", host_us(
        lambda: (conv_dgrad.conv_dgrad_tree_cuda(w, dy, input_size=tuple(x.shape[2:]), stride=1, padding=1),
                 conv_wgrad.conv_wgrad_tree_cuda(x, dy, kernel_size=tuple(w.shape[2:]), stride=1, padding=1)),
        calls))]
    rows.append(("bn tree launcher direct", host_us(lambda: bn_bwd.bn_bwd_tree_cuda(dy, x, mean, invstd, gamma),
                                                     calls)))
    original = torch.library.get_kernel("aten::native_batch_norm_backward", "CUDA")
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("native_batch_norm_backward", lambda keyset, *a: original.call_boxed(keyset, *a), "CUDA",
             with_keyset=True)
    try:
        rows.append(("bn pass-through Python override", host_us(bn, calls)))
    finally:
        lib._destroy()
    rows.append(("torch.empty (1 MiB)", host_us(lambda: torch.empty(1 << 18, device="cuda"), calls)))
    fn = runtime.function(conv_dgrad.SOURCE, "conv_dgrad_split_sum", x.device)
    part = torch.empty(1, device="cuda")
    rows.append(("one launch (empty grid work)", host_us(
        lambda: runtime.launch(fn, (1, 1, 1), (256,), (runtime.ptr(part), runtime.ptr(part), np.int64(0),
                                                        np.int32(1)), device=x.device), calls)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--layout", choices=["nchw", "channels_last"], default="channels_last")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="cProfile the routed calls: top N")
    p.add_argument("--layers", action="store_true", help="time the layers under a routed call, each alone")
    p.add_argument("--lines", action="store_true", help="line-profile the routed calls under tree (line_profiler)")
    p.add_argument("--cprofile-family", choices=["fastest-deterministic", "tree"], default="fastest-deterministic",
                   help="the routing whose conv and BatchNorm backward calls --cprofile profiles")
    args = p.parse_args()
    dtype = AMP_DTYPES.get(args.dtype, torch.float32)
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, 14, 14, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = torch.randn(256, 256, 3, 3, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    dy = torch.randn(64, 256, 14, 14, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    mean = torch.zeros(256, device="cuda")
    invstd = torch.ones(256, device="cuda")
    gamma = torch.ones(256, device="cuda")

    def conv():
        return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [True, True, False])

    def bn():
        return torch.ops.aten.native_batch_norm_backward(dy, x, gamma, None, None, mean, invstd, True, 1e-5,
                                                         [True, True, True])
    beta, running_mean, running_var = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda"), \
        torch.ones(256, device="cuda")
    # cuDNN's BatchNorm backward takes what its forward saved (cuDNN takes float32 activations only)
    xf = x.float()
    _, save_mean, save_var, reserve = torch.ops.aten.cudnn_batch_norm(xf, gamma, beta, running_mean, running_var,
                                                                       True, 0.1, 1e-5)
    dyf = dy.float()

    def bn_cudnn():
        return torch.ops.aten.cudnn_batch_norm_backward(xf, dyf, gamma, running_mean, running_var, save_mean,
                                                        save_var, 1e-5, reserve)
    rows = []
    with cudnn_flags(benchmark=True, deterministic=False):
        rows += [("conv native (cudnn.benchmark)", host_us(conv, args.calls)), ("bn native", host_us(bn, args.calls)),
                 ("bn cudnn native", host_us(bn_cudnn, args.calls))]
    with cudnn_flags(benchmark=False, deterministic=True):
        torch.use_deterministic_algorithms(True)
        rows.append(("conv PyTorch deterministic mode", host_us(conv, args.calls)))
        torch.use_deterministic_algorithms(False)
    with nnrand.use_kernels("fastest-deterministic") as r:
        rows.append(("conv routed fastest-deterministic", host_us(conv, args.calls)))
        rows.append(("bn routed (fastest-deterministic)", host_us(bn, args.calls)))
        print("tuner:", r.tuner.counts())
        if args.cprofile and args.cprofile_family == "fastest-deterministic":
            profile(conv, bn, args)
    with nnrand.use_kernels("tree"):
        rows.append(("conv routed tree", host_us(conv, args.calls)))
        rows.append(("bn routed (tree)", host_us(bn, args.calls)))
        rows.append(("bn cudnn routed (tree)", host_us(bn_cudnn, args.calls)))
        if args.cprofile and args.cprofile_family == "tree":
            profile(conv, bn, args)
        if args.lines:
            lines([conv, bn, bn_cudnn], args.calls)
    if args.layers:
        rows += layers(x, w, dy, mean, invstd, gamma, bn, args.calls)
    print(f"host us per call, {args.dtype}, {args.layout}:")
    for name, us in rows:
        print(f"  {name:<36} {us:8.1f}")


if __name__ == "__main__":
    main()
