"""Where an eager training step's host time goes, per mode: forward, backward and optimizer phases timed
on the host clock (no synchronisation inside a step, so on a host-bound step each phase's wall time is
its host time), then torch.profiler's CPU time per aten op summed over a few steps, modes side by side.

    python bench/dev/step_host_split.py --model torchvision:resnet18 --batch 64 --size 64 \
        --modes native torch_deterministic tree --steps 30 --top 25

The question it answers: of a routed mode's extra milliseconds per eager step, how many are spent in
the routed backward ops and how many elsewhere. A mode may be named more than once (run again, in the
order given, to see how much the order moves a figure). ``passthrough`` is PyTorch's deterministic mode
(without its NaN fill of new memory, as the routing runs it) plus a Python override of each aten op the
routing overrides that only calls the original kernel: the dispatcher's trip into Python, and nothing
of the routing's own work. Profiled times include the profiler's own cost, and an
op's time includes the ops it calls (so autograd's nodes and the aten ops inside them both count it).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.models import Mode, step_arguments, step_case  # noqa: E402


PASSTHROUGH_OPS = ("convolution_backward", "cudnn_batch_norm_backward", "native_batch_norm_backward",
                   "max_pool2d_with_indices_backward")


@contextlib.contextmanager
def passthrough(key: str):
    """PyTorch's deterministic mode as the routing runs it (no NaN fill; ``routing._deterministic_mode``) and a
    pass-through Python override of each routed aten op at dispatch key ``key``."""
    from nnrand import routing

    lib = torch.library.Library("aten", "IMPL")
    for op in PASSTHROUGH_OPS:
        try:
            original = torch.library.get_kernel(f"aten::{op}", key)
        except RuntimeError:   # no kernel there (cuDNN's op on CPU)
            continue
        lib.impl(op, (lambda o: lambda keyset, *a: o.call_boxed(keyset, *a))(original), key, with_keyset=True)
    try:
        with routing._deterministic_mode(strict=True):
            yield
    finally:
        lib._destroy()


def run(mode: str, args) -> tuple[dict, dict]:
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model, opt, x, y = step_case(args, dev)
    phases = {"forward": [], "backward": [], "optimizer": [], "step (synchronised)": []}
    gc.collect()   # the garbage of the modes run before is not this one's
    with passthrough(dev.type.upper()) if mode == "passthrough" else Mode(mode):
        def step(record: bool):
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            sync()
            t4 = time.perf_counter()
            if record:
                for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t0)):
                    phases[k].append(v * 1e3)

        for _ in range(args.warmup):
            step(False)
        for _ in range(args.steps):
            step(True)
        ops: dict[str, tuple[float, float]] = {}   # aten op -> (CPU ms, calls) per step
        if args.top:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_steps):
                    step(False)
            for e in prof.key_averages():
                ops[e.key] = (e.cpu_time_total / 1e3 / args.profile_steps, e.count / args.profile_steps)
    return {k: statistics.median(v) for k, v in phases.items()}, ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    step_arguments(p)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="aten ops listed by CPU time (0: no profile)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the CPU order models: a smoke test)")
    args = p.parse_args()
    results = {}
    for i, m in enumerate(args.modes):
        results[m if m not in results else f"{m} ({i + 1})"] = run(m, args)
    modes = list(results)
    print(f"{args.model}, batch {args.batch}, {args.size} px, {args.layout}: host ms per step, median of "
          f"{args.steps} steps")
    print(f"  {'phase':<22}" + "".join(f"{m:>22}" for m in modes))
    for k in results[modes[0]][0]:
        print(f"  {k:<22}" + "".join(f"{results[m][0][k]:22.2f}" for m in modes))
    if args.top:
        keys = set()
        for m in modes:
            keys |= set(results[m][1])
        base = modes[0]
        rows = []
        for k in keys:
            vals = [results[m][1].get(k, (0.0, 0.0)) for m in modes]
            rows.append((max(v[0] for v in vals) - min(v[0] for v in vals), k, vals))
        rows.sort(reverse=True)
        print(f"\nprofiled CPU ms per step (calls per step), the {args.top} ops whose time differs most between "
              f"modes (first: {base}):")
        for _, k, vals in rows[:args.top]:
            print(f"  {k[:48]:<48}" + "".join(f"{v[0]:12.3f} ({v[1]:5.0f})" for v in vals))


if __name__ == "__main__":
    main()
