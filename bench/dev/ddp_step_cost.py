"""Where a data-parallel step's time goes: the same model and per-rank batch trained with and without
DistributedDataParallel, with stock kernels and with nnrand routing, timed three ways per step.

    torchrun --standalone --nproc_per_node 2 bench/dev/ddp_step_cost.py            # ResNet-18, 64 per rank
    torchrun --standalone --nproc_per_node 2 bench/dev/ddp_step_cost.py --profile tree:ddp

Setups are ``<mode>:<wrap>``: mode ``native`` (stock kernels, NCHW, cudnn.benchmark off as the harness pins
it), ``native_fast`` (channels_last, cudnn.benchmark on: what a user chasing speed runs), ``tree`` (nnrand
routing, NCHW) and ``tree_cl`` (routing, channels_last); wrap ``local`` (each rank trains its own copy, no
communication) or ``ddp``. TF32 off throughout. Columns, medians over the timed steps on rank 0:

    host_ms     wall time of the Python step call, no synchronisation (the host's enqueue cost)
    gpu_ms      CUDA events around the step on the current stream
    thru_ms     wall time of ``--steps`` back-to-back steps between two synchronisations, per step

``thru_ms`` is what training sees. ``host_ms`` close to ``thru_ms`` means the step is host-bound.
``--profile SETUP`` adds torch.profiler's top rows (self CPU time and CUDA time) for a few steps of SETUP
and every rank's NCCL kernel durations in order. ``--bucket-mb`` and ``--grad-view`` set DDP's options.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nnrand import models, noise, routing  # noqa: E402

MODES = ("native", "native_fast", "tree", "tree_cl")
WRAPS = ("local", "ddp")


def build(mode: str, wrap: str, args, device):
    fmt = torch.channels_last if mode in ("native_fast", "tree_cl") else torch.contiguous_format
    torch.manual_seed(0)
    model = models.build_model(args.model).to(device, memory_format=fmt)
    net = model
    if wrap == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index],
                                                        bucket_cap_mb=args.bucket_mb,
                                                        gradient_as_bucket_view=args.grad_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(args.batch, 3, 32, 32, generator=g).to(device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    return model, net, opt, x, y


@contextlib.contextmanager
def mode_context(mode: str, model):
    with noise.pinned_flags(tf32=False, cudnn_deterministic=mode.startswith("tree")):
        torch.backends.cudnn.benchmark = mode == "native_fast"
        try:
            if mode.startswith("tree"):
                with routing.use_kernels("tree", model=model):
                    yield
            else:
                yield
        finally:
            torch.backends.cudnn.benchmark = False


def step(net, opt, x, y) -> None:
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def timed(setup, n: int) -> dict:
    model, net, opt, x, y = setup
    host, gpu = [], []
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        step(net, opt, x, y)
        host.append((time.perf_counter() - t) * 1e3)
        b.record()
        gpu.append((a, b))
    torch.cuda.synchronize()
    thru = (time.perf_counter() - t_all) * 1e3 / n
    return {"host": host, "gpu": [a.elapsed_time(b) for a, b in gpu], "thru": [thru]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=64, help="images per rank")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="timed steps per setup per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--setups", nargs="+", default=[f"{m}:{w}" for m in MODES for w in WRAPS])
    p.add_argument("--profile", help="SETUP to profile after the timing")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (its default: 25)")
    p.add_argument("--grad-view", action="store_true", help="DDP's gradient_as_bucket_view")
    args = p.parse_args(argv)

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    setups = {}
    for name in args.setups:
        mode, wrap = name.split(":")
        setups[name] = build(mode, wrap, args, device)
        with mode_context(mode, setups[name][0]):
            timed(setups[name], args.warmup)
    rows = {name: {"host": [], "gpu": [], "thru": []} for name in setups}
    for _ in range(args.rounds):
        for name, s in setups.items():
            with mode_context(name.split(":")[0], s[0]):
                for k, v in timed(s, args.steps).items():
                    rows[name][k] += v
    if rank == 0:
        print(f"{args.model}, {args.batch} images per rank, {dist.get_world_size()} ranks, "
              f"{torch.cuda.get_device_name(device)}, fp32 (TF32 off); medians of {args.rounds} x {args.steps} steps; "
              f"DDP bucket_cap_mb {args.bucket_mb:g}, gradient_as_bucket_view {args.grad_view}")
        print(f"{'setup':<20} {'host_ms':>8} {'gpu_ms':>8} {'thru_ms':>8}")
        for name, r in rows.items():
            print(f"{name:<20} {statistics.median(r['host']):8.2f} {statistics.median(r['gpu']):8.2f} "
                  f"{statistics.median(r['thru']):8.2f}")
        sys.stdout.flush()
    if args.profile:
        s = setups[args.profile]
        with mode_context(args.profile.split(":")[0], s[0]):
            timed(s, 3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed(s, 5)
        if rank == 0:
            avg = prof.key_averages()
            print(f"\nprofile {args.profile}, 5 steps: by self CPU time")
            print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            print(f"\nprofile {args.profile}, 5 steps: by CUDA time")
            print(avg.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        # every NCCL kernel in launch order: a long one waited for the other rank
        nccl = [round(e.time_range.elapsed_us()) for e in prof.events() if e.name.startswith("ncclDevKernel")]
        print(f"rank {rank} NCCL kernel us, in order: {nccl}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
