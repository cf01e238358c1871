"""Time one training step (forward, backward, SGD update) under each backward routing, in one process.

    python3 bench/dev/train_step_time.py                    # CUDA: ResNet-18 (CIFAR), batch 128, fp32
    python3 bench/dev/train_step_time.py --channels-last
    python3 bench/dev/train_step_time.py --device cpu       # small model, batch 32, CPU order models

Modes:
    tree                 every backward reduction through the registry's tree variants (nnrand.use_kernels)
    atomic               every backward reduction through the atomic variants
    native               stock PyTorch/cuDNN (cudnn.benchmark off, as the harness pins it)
    torch_deterministic  stock PyTorch with torch.use_deterministic_algorithms(True), cudnn.deterministic

TF32 is off in every mode. Each mode is warmed up, then the modes are timed in interleaved rounds (so
a drift of the shared machine hits them alike) with CUDA events around every step (wall clock on the
CPU); the table shows medians and the ratios to native and to torch_deterministic. Target: tree <= 1.3x
native. ``--json PATH`` also writes the rows with the environment fingerprint.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

# deterministic cuBLAS needs this before CUDA initialises (torch_deterministic mode)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from nnrand import models, noise, routing  # noqa: E402
from nnrand.fingerprint import fingerprint  # noqa: E402

MODES = ("tree", "atomic", "native", "torch_deterministic")
TARGET = 1.3  # tree step time / native step time


@contextlib.contextmanager
def mode_context(mode: str, model):
    deterministic = mode in ("tree", "torch_deterministic")
    with noise.pinned_flags(tf32=False, cudnn_deterministic=deterministic):
        if mode in ("tree", "atomic"):
            with routing.use_kernels(mode, model=model):
                yield
        elif mode == "torch_deterministic":
            before = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                yield
            finally:
                torch.use_deterministic_algorithms(before)
        else:
            yield


def make(args, device, fmt):
    torch.manual_seed(0)
    model = models.build_model(args.model).to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g).to(device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    return model, opt, x, y


def step(model, opt, x, y) -> None:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def timed_steps(model, opt, x, y, n: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(n):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(model, opt, x, y)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            step(model, opt, x, y)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def main(argv=None) -> int:
    cuda_default = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda" if cuda_default else "cpu")
    p.add_argument("--model", help="default resnet18 on CUDA, small on CPU")
    p.add_argument("--batch-size", type=int, help="default 128 on CUDA, 32 on CPU")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--warmup", type=int, help="steps per mode before timing (default 10 CUDA, 1 CPU)")
    p.add_argument("--steps", type=int, help="timed steps per mode per round (default 20 CUDA, 2 CPU)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the modes")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--json", help="also write rows (with the fingerprint) to this file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.model = args.model or ("resnet18" if cuda else "small")
    args.batch_size = args.batch_size or (128 if cuda else 32)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    steps = args.steps if args.steps is not None else (20 if cuda else 2)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format

    modes = list(args.modes)
    if cuda and not kernels.cuda_available():
        skipped = [m for m in modes if m in ("tree", "atomic")]
        print(f"CuPy missing: skipping {', '.join(skipped)}", file=sys.stderr)
        modes = [m for m in modes if m not in skipped]
    setups = {}
    for mode in modes:
        setups[mode] = make(args, device, fmt)
        model, opt, x, y = setups[mode]
        with mode_context(mode, model):
            timed_steps(model, opt, x, y, warmup, cuda)
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            model, opt, x, y = setups[mode]
            with mode_context(mode, model):
                times[mode] += timed_steps(model, opt, x, y, steps, cuda)

    med = {m: statistics.median(t) for m, t in times.items()}
    layout = "channels_last" if args.channels_last else "nchw"
    where = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"{args.model}, batch {args.batch_size}, fp32 (TF32 off), {layout}, {where}; "
          f"median of {len(next(iter(times.values())))} steps per mode after {warmup} warm-up steps")
    print(f"{'mode':<20} {'ms/step':>10} {'p10':>9} {'p90':>9} {'x native':>9} {'x torch_det':>12}")
    rows = []
    for m in modes:
        t = sorted(times[m])
        p10, p90 = t[len(t) // 10], t[(9 * len(t)) // 10]
        vs_native = med[m] / med["native"] if "native" in med else float("nan")
        vs_det = med[m] / med["torch_deterministic"] if "torch_deterministic" in med else float("nan")
        print(f"{m:<20} {med[m]:>10.2f} {p10:>9.2f} {p90:>9.2f} {vs_native:>9.2f} {vs_det:>12.2f}")
        rows.append({"mode": m, "model": args.model, "batch": args.batch_size, "layout": layout,
                     "median_ms": med[m], "p10_ms": p10, "p90_ms": p90, "x_native": vs_native,
                     "x_torch_deterministic": vs_det, "steps": len(t)})
    if "tree" in med and "native" in med:
        ratio = med["tree"] / med["native"]
        print(f"tree / native = {ratio:.2f} (target <= {TARGET}): {'met' if ratio <= TARGET else 'NOT met'}")
    if args.json:
        env = fingerprint(device)
        Path(args.json).write_text(json.dumps([dict(r, **env) for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
