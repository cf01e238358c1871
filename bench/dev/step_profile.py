"""Where a training step's GPU time goes, per mode: torch.profiler over a few steps of a model, CUDA time
summed per kernel name (top rows), for native vs routed modes side by side. TF32 off unless ``--tf32``.

    python bench/dev/step_profile.py --model torchvision:resnet50 --batch 64 --size 224 --amp bf16 \
        --modes native fastest_deterministic --layout channels_last
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from bench.models import Mode, precision  # noqa: E402
from nnrand import models, noise  # noqa: E402
from nnrand.train import GraphStep, forward_backward, optimizer_step  # noqa: E402


def profile(mode: str, args) -> None:
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    autocast, make_scaler = precision(args.amp)
    torch.manual_seed(0)
    model = models.build_model(args.model, 10).cuda().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = make_scaler()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda", generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device="cuda", generator=g)

    graph = None

    def step():
        nonlocal graph
        if args.graph:
            graph = graph or GraphStep(model, x, y, autocast, scaler)
            graph(x, y)
        else:
            forward_backward(model, opt, x, y, autocast, scaler)
        optimizer_step(opt, scaler)
    with Mode(mode):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows.setdefault(e.name, [0.0, 0])
            rows[e.name][0] += e.device_time / args.steps
            rows[e.name][1] += 1
    total = sum(v[0] for v in rows.values())
    if args.cprofile:
        import cProfile
        import pstats

        with Mode(mode):
            step()   # plans made before the profile, as for the wall time below
            prof_host = cProfile.Profile()
            prof_host.enable()
            for _ in range(args.steps):
                step()
            prof_host.disable()
            torch.cuda.synchronize()
        print(f"-- {mode}: host functions by own time over {args.steps} steps")
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(args.cprofile)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with Mode(mode):
        # a new routing session plans each configuration at its first call (tuner cache lookups): one
        # step before the clock starts, so the wall time is the steady state's
        step()
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
    print(f"== {mode}{' (graph)' if args.graph else ''}: kernel time per step {total / 1e3:.2f} ms "
          f"({len(rows)} kernels), wall per step {start.elapsed_time(end) / args.steps:.2f} ms")
    for name, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {us / 1e3:8.3f} ms  x{n // args.steps:<4} {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="torchvision:resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--amp", choices=["bf16", "fp16"])
    p.add_argument("--layout", choices=["nchw", "channels_last"], default="channels_last")
    p.add_argument("--modes", nargs="+", default=["native", "fastest_deterministic"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="also cProfile the steps: top N functions")
    p.add_argument("--graph", action="store_true", help="forward+backward as a CUDA graph (nnrand.train.GraphStep)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-gc", action="store_true", help="Python's cyclic garbage collector off while steps run "
                   "(whether its pauses are part of the host time)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 in cuDNN convs and matmuls (default off, as "
                   "nnrand.train and bench.models run fp32)")
    args = p.parse_args()
    if args.no_gc:
        import gc

        gc.collect()
        gc.disable()
    # PyTorch's default lets cuDNN convolutions use TF32: pinned as the suite's own runs pin it
    with noise.pinned_flags(tf32=args.tf32, cudnn_deterministic=False):
        for mode in args.modes:
            profile(mode, args)


if __name__ == "__main__":
    main()
