"""Dev check for the reduction kernels (sum, bias_grad) on a CUDA machine.

    python3 bench/dev/reduce_check.py [--quick]

Times every variant beside torch (and CuPy for sum) with CUDA graphs of back-to-back calls (pure GPU time,
launch overhead excluded) and with per-call CUDA events (what a Python caller sees), counts distinct
results over repeats, and prints one table per op. The benchmark suite (pytest --benchmark-only) is the
reporting path; this script is for iterating on the kernels.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from bench.timing import back_to_back_us, graph_replay_us  # noqa: E402
from kernels.bias_grad import partials_per_channel  # noqa: E402
from kernels.shapes import bias_grad_shapes  # noqa: E402


def event_time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def distinct(fn, reps: int) -> int:
    return len({fn().cpu().numpy().tobytes() for _ in range(reps)})


def copy_bandwidth() -> float:
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    for _ in range(20):
        y.copy_(x)
    t = graph_replay_us(lambda: y.copy_(x), calls=10, replays=20)
    return 2 * x.numel() * 4 / (t * 1e-6) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw:.2f} TB/s (read + write)")

    print("\n## sum (graph us | event us | distinct/100 | % of copy bandwidth)")
    peers = kernels.spec("sum").peers()
    exps = (16, 20, 24, 28) if args.quick else range(16, 29, 2)
    for e in exps:
        x = torch.randn(1 << e, device="cuda") * 1e3
        fns = {f"{v.name}": (lambda v=v: v(x)) for v in kernels.variants("sum")}
        fns["exact_nocheck"] = lambda: kernels.get("sum", "exact").cuda(x, check_range=False)
        fns.update({f"peer:{k}": (lambda f=f: f(x)) for k, f in peers.items()})
        row = []
        for name, fn in fns.items():
            g = (back_to_back_us(fn, calls=20, repeats=20, warmup=5) if name in ("exact", "peer:cupy")
                 else graph_replay_us(fn, calls=20, replays=20))
            ev = event_time_us(fn)
            d = distinct(fn, 100)
            pct = 100 * (4 << e) / (g * 1e-6) / (bw * 1e12)
            row.append(f"{name}={g:.1f}|{ev:.1f}|{d}|{pct:.0f}%")
        print(f"2^{e}: " + "  ".join(row))

    print("\n## bias_grad (graph us | event us | distinct/100)")
    for name, shape in bias_grad_shapes():
        for layout in (("rows",) if len(shape) == 2 else ("nchw", "channels_last")):
            dy = torch.randn(shape, device="cuda")
            if layout == "channels_last":
                dy = dy.contiguous(memory_format=torch.channels_last)
            fns = {v.name: (lambda v=v: v(dy)) for v in kernels.variants("bias_grad")}
            fns["peer:torch"] = (lambda: dy.sum(0)) if dy.dim() == 2 else (lambda: dy.sum((0, 2, 3)))
            res = {n: (graph_replay_us(f, calls=20, replays=20), event_time_us(f), distinct(f, 100))
                   for n, f in fns.items()}
            ratio = res["tree"][0] / res["atomic"][0]
            vs_torch = res["tree"][0] / res["peer:torch"][0]
            cells = "  ".join(f"{n}={g:.1f}|{e:.1f}|{d}" for n, (g, e, d) in res.items())
            print(f"{name} {layout} P={partials_per_channel(shape, layout)}: {cells}  tree/atomic={ratio:.3f} "
                  f"tree/torch={vs_torch:.3f}")


if __name__ == "__main__":
    main()
