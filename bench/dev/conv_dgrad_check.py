"""conv_dgrad on a CUDA machine: every variant against float64, distinct results over repeats, and
timings beside cuDNN, on every ResNet-18 conv shape at batch 128.

    python3 bench/dev/conv_dgrad_check.py [--quick] [--repeats 20] [--csv out.csv]

--quick: NCHW only (the full run adds channels_last). cuDNN runs with cudnn.benchmark on and TF32 off
("cudnn"), and in deterministic mode ("cudnn_det"); the flags are restored on exit. Times are medians of
CUDA-event timings of single calls after warm-up ("host_us": the Python call alone; "b2b_us": per call over
10 back-to-back calls, where host time hides behind the GPU's); "err/bound" is the largest |dx - dx_float64| divided by
the element's own worst-case bound gamma_depth * sum |w| |dy| (<= 1 passes; the cuDNN rows are shown
against the atomic variant's bound for comparison only: their algorithms are not tied to it).
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels.conv_dgrad import OP  # noqa: E402
from bench.timing import back_to_back_us, cudnn_flags  # noqa: E402

U32 = 2.0**-24


def depth(name: str, case) -> int:
    """Longest chain of roundings a dx element passes through (see tests/test_conv_dgrad.py)."""
    p = case.params
    if name == "tree":
        return p["cout"] * p["k"] * p["k"] + 1
    return p["cout"] + p["k"] * p["k"] + 1  # atomic, and a bound cuDNN's fp32 algorithms meet too


def time_us(fn, repeats: int) -> tuple[float, float]:
    """Median device time of one call (CUDA events around it, GPU idle before) and median host time
    of the call itself (Python, checks, allocation, launch). Where the two are close the call is
    bound by the host, not by its kernels."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times), statistics.median(host)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="NCHW only")
    ap.add_argument("--repeats", type=int, default=20, help="repeats for distinct results and timing")
    ap.add_argument("--csv", type=pathlib.Path, help="also write the rows to this CSV file")
    args = ap.parse_args()
    if not kernels.cuda_available():
        print("conv_dgrad_check: needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    spec = kernels.spec(OP)
    variants = kernels.variants(OP)
    peer = spec.peers()["torch"]
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    rows, failures = [], 0
    for case in spec.bench_cases("quick" if args.quick else "gpu"):
        (w, dy), kw = spec.make_inputs(case, dev)
        with cudnn_flags(benchmark=False, deterministic=True):
            ref = peer(w.double(), dy.double(), **kw)  # float64 on the GPU: the reference
            absref = peer(w.double().abs(), dy.double().abs(), **kw)
        flops = spec.flops(case)
        impls = [(v.name, (lambda v=v: v(w, dy, **kw)), (True, False)) for v in variants]
        impls += [("cudnn", lambda: peer(w, dy, **kw), (True, False)),
                  ("cudnn_det", lambda: peer(w, dy, **kw), (False, True))]
        res = {}
        for name, fn, flags in impls:
            with cudnn_flags(*flags):
                out = fn()
                torch.cuda.synchronize()
                bound = depth("tree" if name == "tree" else "atomic", case) * U32 * absref
                err = ((out.double() - ref).abs() / bound.clamp_min(1e-300)).max().item()
                seen = [out]  # distinct results, compared bitwise on the device
                for _ in range(args.repeats - 1):
                    again = fn()
                    if not any(torch.equal(again, s) for s in seen):
                        seen.append(again)
                torch.cuda.synchronize()  # surfaces any launch error here
                us, host_us = time_us(fn, args.repeats)
                b2b = back_to_back_us(fn, calls=10, repeats=args.repeats)
            if name in {v.name for v in variants}:
                failures += err > 1.0
            res[name] = dict(us=us, host_us=host_us, b2b_us=b2b, err=err, distinct=len(seen))
        for name, r in res.items():
            rows.append(dict(case=case.name, variant=name, us=round(r["us"], 1), host_us=round(r["host_us"], 1),
                             b2b_us=round(r["b2b_us"], 1),
                             b2b_vs_cudnn=round(r["b2b_us"] / res["cudnn"]["b2b_us"], 2),
                             b2b_tree_vs_atomic=round(res["tree"]["b2b_us"] / res["atomic"]["b2b_us"], 2)
                             if name == "tree" else "",
                             tflops=round(flops / r["us"] / 1e6, 2),
                             vs_cudnn=round(r["us"] / res["cudnn"]["us"], 2),
                             tree_vs_atomic=round(res["tree"]["us"] / res["atomic"]["us"], 2) if name == "tree" else "",
                             distinct=r["distinct"], err_over_bound=f"{r['err']:.3f}"))
        for row in rows[-len(res):]:  # as it goes: a run cut short keeps what it measured
            print(f"    {row['variant']:<10} {row['us']:>8} us (host {row['host_us']}, b2b {row['b2b_us']})  "
                  f"x cudnn {row['vs_cudnn']}/{row['b2b_vs_cudnn']} tree/atomic "
                  f"{row['tree_vs_atomic'] or '-'}/{row['b2b_tree_vs_atomic'] or '-'} distinct {row['distinct']}",
                  flush=True)
        print(f"  done {case.name}", flush=True)
    head = ["case", "variant", "us", "host_us", "b2b_us", "tflops", "vs_cudnn", "tree_vs_atomic", "b2b_vs_cudnn",
            "b2b_tree_vs_atomic", "distinct", "err_over_bound"]
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in head]
    print("  ".join(h.ljust(n) for h, n in zip(head, widths)))
    for r in rows:
        print("  ".join(str(r[h]).ljust(n) for h, n in zip(head, widths)))
    tree = [r for r in rows if r["variant"] == "tree"]
    slow = [r["case"] for r in tree if r["vs_cudnn"] > 2.0]
    heavy = [r["case"] for r in tree if r["tree_vs_atomic"] > 1.10]
    print(f"tree within 2x of cuDNN on {len(tree) - len(slow)}/{len(tree)} cases; over: {slow or 'none'}")
    print(f"tree within 1.10x of atomic on {len(tree) - len(heavy)}/{len(tree)} cases; over: {heavy or 'none'}")
    if args.csv:
        with args.csv.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=head)
            wr.writeheader()
            wr.writerows(rows)
    print(f"{failures} result(s) outside the float64 bound")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
