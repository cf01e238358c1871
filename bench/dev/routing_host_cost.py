"""Host cost of routed training steps: where the Python time of a step goes, per mode.

    python3 bench/dev/routing_host_cost.py                                  # torchvision resnet18, 64 px
    python3 bench/dev/routing_host_cost.py --model resnet18 --size 32 --batch 128 --profile 40

For each mode (native, tree): the host time to enqueue one step (perf_counter around the step, no
synchronisation inside it; the GPU runs behind) and the GPU-inclusive time per step (CUDA events), as
medians over ``--steps`` steps after warm-up; then, with ``--profile N``, cProfile's top N functions by
own time over those steps under ``tree``. A step whose enqueue time exceeds its GPU time is host-bound.
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
from nnrand import models, noise  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="torchvision:resnet18")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N under tree")
    args = p.parse_args(argv)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda", generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device="cuda", generator=g)
    torch.backends.cudnn.benchmark = True

    def run(mode: str, profile: bool):
        torch.manual_seed(0)
        model = models.build_model(args.model).cuda().to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        ctx = nnrand.use_kernels(mode) if mode != "native" else nnrand.use_kernels("native")
        host, gpu = [], []
        prof = cProfile.Profile() if profile else None
        with ctx:
            for i in range(args.steps + 5):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if prof is not None and i >= 5:
                    prof.enable()
                t = time.perf_counter()
                a.record()
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                b.record()
                dt = time.perf_counter() - t
                if prof is not None:
                    prof.disable()
                torch.cuda.synchronize()
                if i >= 5:
                    host.append(dt * 1e3)
                    gpu.append(a.elapsed_time(b))
        return statistics.median(host), statistics.median(gpu), prof

    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        torch.backends.cudnn.benchmark = True
        for mode in ("native", "tree"):
            h, gms, prof = run(mode, profile=args.profile > 0 and mode == "tree")
            print(f"{args.model} {args.batch}x{args.size} {mode:<7} host enqueue {h:7.2f} ms/step, "
                  f"events {gms:7.2f} ms/step (synchronised before each step)")
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
