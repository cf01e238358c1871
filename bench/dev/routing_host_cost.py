"""Host cost of routed training steps: where the Python time of a step goes, per mode.

    python3 bench/dev/routing_host_cost.py                                  # torchvision resnet18, 64 px
    python3 bench/dev/routing_host_cost.py --model resnet18 --size 32 --batch 128 --profile 40
    python3 bench/dev/routing_host_cost.py --model resnet18 --size 32 --batch 128 --amp bf16 \
        --modes native torch_deterministic fastest-deterministic tree --profile 30 --profile-mode fastest-deterministic

For each mode (``--modes``: native, torch_deterministic, or a routing family such as tree): the host time
to enqueue one step (perf_counter around the step, no synchronisation inside it; the GPU runs behind) and
the GPU-inclusive time per step (CUDA events), as medians over ``--steps`` steps after warm-up; then, with
``--profile N``, cProfile's top N functions by own time over those steps under ``--profile-mode``, and with
``--torch-profile N`` torch.profiler's top N ops by self CPU time under each mode. A step whose enqueue
time exceeds its GPU time is host-bound. ``--amp``: the forward under torch.autocast in that dtype.

``cpu`` is the process's CPU time per step (every thread: the autograd engine's included), which a shared
host's other tenants disturb less than wall time. With ``--rounds R`` the modes run in turn R times, each
with a fresh model, and every figure is the smallest of the R medians.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nnrand  # noqa: E402
from bench.timing import deterministic_mode  # noqa: E402
from nnrand import models, noise  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="torchvision:resnet18")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--modes", nargs="+", default=["native", "tree"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N under --profile-mode")
    p.add_argument("--profile-mode", default="tree")
    p.add_argument("--torch-profile", type=int, default=0, metavar="N",
                   help="print torch.profiler's top N ops by self CPU time, per mode")
    args = p.parse_args(argv)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda", generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device="cuda", generator=g)
    torch.backends.cudnn.benchmark = True

    torch_deterministic = deterministic_mode   # PyTorch's defaults otherwise (uninitialised memory filled)

    def step(model, opt):
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def run(mode: str, profile: bool):
        torch.manual_seed(0)
        model = models.build_model(args.model).cuda().to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        ctx = torch_deterministic() if mode == "torch_deterministic" else nnrand.use_kernels(mode)
        host, gpu, cpu = [], [], []
        prof = cProfile.Profile() if profile else None
        with ctx:
            for i in range(args.steps + 5):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if prof is not None and i >= 5:
                    prof.enable()
                t, c = time.perf_counter(), time.process_time()
                a.record()
                step(model, opt)
                b.record()
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if prof is not None:
                    prof.disable()
                torch.cuda.synchronize()
                if i >= 5:
                    host.append(dt * 1e3)
                    cpu.append(dc * 1e3)
                    gpu.append(a.elapsed_time(b))
            if args.torch_profile:
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
                    for _ in range(5):
                        step(model, opt)
                    torch.cuda.synchronize()
                print(f"torch.profiler, {mode}, 5 steps, by self CPU time:")
                print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
        return statistics.median(host), statistics.median(cpu), statistics.median(gpu), prof

    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        torch.backends.cudnn.benchmark = True
        results: dict[str, list] = {}
        for r in range(args.rounds):
            for mode in args.modes:
                h, c, gms, prof = run(mode, profile=args.profile > 0 and mode == args.profile_mode and r == 0)
                results.setdefault(mode, []).append((h, c, gms))
                if prof is not None:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        for mode, per_round in results.items():
            h, c, gms = (min(col) for col in zip(*per_round))
            print(f"{args.model} {args.batch}x{args.size} {args.amp or 'fp32'} {mode:<22} host enqueue {h:7.2f} "
                  f"ms/step, cpu {c:7.2f} ms/step, events {gms:7.2f} ms/step (synchronised before each step; "
                  f"min over {args.rounds} round(s) of the median of {args.steps} steps)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
