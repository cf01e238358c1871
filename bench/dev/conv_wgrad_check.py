"""conv_wgrad on a CUDA machine: every variant against float64, distinct results over repeats, and
timings beside cuDNN, on every ResNet-18 conv shape at batch 128.

    python3 bench/dev/conv_wgrad_check.py [--quick] [--repeats 20] [--csv out.csv] [--graph]
                                          [--targets 1024,4096] [--styles r,s] [--taps on,off]

--quick: NCHW only (the full run adds channels_last). cuDNN runs with cudnn.benchmark on and TF32 off
("cudnn", its fastest weight-gradient algorithm) and in deterministic mode ("cudnn_det"); the flags are
restored on exit. "us" is the median over repeats of CUDA-event time around 10 back-to-back calls,
divided by 10 (launch overhead that the GPU hides is not counted); "err/bound" is the largest
|dw - dw_float64| over the element's own bound gamma_(Kc+S+9) * sum |x*dy| (tests/test_conv_wgrad.py
derives it; <= 1 passes; cuDNN is held to the atomic variant's bound; winograd, where F(3,2) applies, to
its own bound over the magnitude of its own expression). --graph adds "gpu_us": the same
10 calls replayed from a CUDA graph (no host launch cost at all). --targets / --styles / --taps time tree and
atomic under other split targets (TARGET_BLOCKS), kernel styles (KERNEL_STYLE: "r" row constants in
registers, "s" in shared memory) and with tap tiles on or off (TAP_TILES: padding terms skipped where Cin
is a multiple of the tile width) and check that tree keeps the bits of the shipped configuration
wherever the split is the same (styles move loads, tap tiles skip only the padding's zero terms: the same
bits on finite inputs); the main table always uses the shipped configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels import conv_wgrad  # noqa: E402
from kernels import conv_wgrad_winograd as wino  # noqa: E402
from kernels.conv_wgrad import GROUPS, OP, plan  # noqa: E402
from bench.timing import back_to_back_us, cudnn_flags, graph_replay_us  # noqa: E402

U32 = 2.0**-24


@contextlib.contextmanager
def configuration(blocks: int, style: str, tap: bool):
    saved = conv_wgrad.TARGET_BLOCKS, conv_wgrad.KERNEL_STYLE, conv_wgrad.TAP_TILES
    conv_wgrad.TARGET_BLOCKS, conv_wgrad.KERNEL_STYLE, conv_wgrad.TAP_TILES = blocks, style, tap
    try:
        yield
    finally:
        conv_wgrad.TARGET_BLOCKS, conv_wgrad.KERNEL_STYLE, conv_wgrad.TAP_TILES = saved


@contextlib.contextmanager
def fuse_mode(mode: str):
    saved = conv_wgrad.FUSE
    conv_wgrad.FUSE = mode
    try:
        yield
    finally:
        conv_wgrad.FUSE = saved


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.int32).cpu().numpy().tobytes()).hexdigest()


def _in_mode(mode, variant, x, dy, kw):
    with fuse_mode(mode):
        return variant(x, dy, **kw)


def _geom_args(case):
    p = case.params
    m, r, k = geometry(case)
    oh = (p["h"] + 2 * p["pad"] - p["dilation"] * (p["k"] - 1) - 1) // p["stride"] + 1
    ow = (p["w"] + 2 * p["pad"] - p["dilation"] * (p["k"] - 1) - 1) // p["stride"] + 1
    return (p["n"], p["cin"], p["h"], p["w"], p["cout"], oh, ow, p["k"], p["k"], p["stride"], p["stride"],
            p["pad"], p["pad"], p["dilation"], p["dilation"])


def geometry(case):
    p = case.params
    oh = (p["h"] + 2 * p["pad"] - p["dilation"] * (p["k"] - 1) - 1) // p["stride"] + 1
    ow = (p["w"] + 2 * p["pad"] - p["dilation"] * (p["k"] - 1) - 1) // p["stride"] + 1
    return p["cout"], p["cin"] * p["k"] * p["k"], p["n"] * oh * ow


def depth(name: str, case) -> int:
    m, r, k = geometry(case)
    pl = plan(m, r, k, split=name != "nosplit")
    return pl.chunk + pl.splits + GROUPS + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="NCHW only")
    ap.add_argument("--repeats", type=int, default=20, help="repeats for distinct results and timing")
    ap.add_argument("--csv", type=pathlib.Path, help="also write the rows to this CSV file")
    ap.add_argument("--graph", action="store_true", help="also time from CUDA-graph replays")
    ap.add_argument("--targets", default="", help="comma-separated TARGET_BLOCKS values to time tree/atomic at")
    ap.add_argument("--styles", default="", help="comma-separated KERNEL_STYLE values to time tree/atomic with")
    ap.add_argument("--taps", default="", help="comma-separated TAP_TILES settings (on, off) to time tree/atomic with")
    args = ap.parse_args()
    if not kernels.cuda_available():
        print("conv_wgrad_check: needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    spec = kernels.spec(OP)
    variants = kernels.variants(OP)
    peer = spec.peers()["torch"]
    targets = [int(t) for t in args.targets.split(",") if t] or [conv_wgrad.TARGET_BLOCKS]
    styles = [st for st in args.styles.split(",") if st] or [conv_wgrad.KERNEL_STYLE]
    if not set(args.taps.split(",")) <= {"", "on", "off"}:
        ap.error(f"--taps: expected a comma-separated list of on and off, got {args.taps!r}")
    taps = [t == "on" for t in args.taps.split(",") if t] or [conv_wgrad.TAP_TILES]
    shipped = (conv_wgrad.TARGET_BLOCKS, conv_wgrad.KERNEL_STYLE, conv_wgrad.TAP_TILES)
    combos = [(t, st, tap) for t in targets for st in styles for tap in taps if (t, st, tap) != shipped]
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, TARGET_BLOCKS {conv_wgrad.TARGET_BLOCKS}, "
          f"KERNEL_STYLE {conv_wgrad.KERNEL_STYLE}, TAP_TILES {conv_wgrad.TAP_TILES}")
    rows, sweep, failures = [], [], 0
    for case in spec.bench_cases("quick" if args.quick else "gpu"):
        (x, dy), kw = spec.make_inputs(case, dev)
        with cudnn_flags(benchmark=False, deterministic=True):
            ref = peer(x.double(), dy.double(), **kw)  # float64 on the GPU: the reference
            mag = peer(x.double().abs(), dy.double().abs(), **kw)
        flops = spec.flops(case)
        m, r, k = geometry(case)
        pl = plan(m, r, k)
        impls = [(v.name, (lambda v=v: v(x, dy, **kw)), (True, False)) for v in variants]
        # tree with its combine forced into the GEMM launch or into a second kernel (same bits as tree).
        tree = kernels.get(OP, "tree")
        for mode in ("fused", "separate"):
            impls.append((f"tree_{mode}", (lambda mode=mode: _in_mode(mode, tree, x, dy, kw)), (True, False)))
        impls += [("cudnn", lambda: peer(x, dy, **kw), (True, False)),
                  ("cudnn_det", lambda: peer(x, dy, **kw), (False, True))]
        res = {}
        for name, fn, flags in impls:
            with cudnn_flags(*flags):
                out = fn()
                torch.cuda.synchronize()  # surfaces a launch error here
                bound = depth(name if name in ("tree", "nosplit") else "atomic", case) * U32 * mag
                if name.startswith("tree_"):
                    bound = depth("tree", case) * U32 * mag
                g = conv_wgrad.Geometry(*_geom_args(case))
                if name == "winograd" and wino.applies(g):  # its own expression: its own magnitude
                    bound = wino.rounding_depth(g) * U32 * wino.magnitude(x, dy, g).to(dev)
                err = ((out.double() - ref).abs() / bound.clamp_min(1e-300)).max().item()
                seen = {digest(out)}
                for _ in range(args.repeats - 1):
                    seen.add(digest(fn()))
                us = back_to_back_us(fn, calls=10, repeats=args.repeats, warmup=3)
                gus = graph_replay_us(fn, calls=10, replays=args.repeats) if args.graph and name != "cudnn_det" else float("nan")
            failures += not err <= 1.0
            if name.startswith("tree_") and not torch.equal(out, res["tree"]["out"]):
                print(f"  FAIL {case.name} {name}: bits differ from tree", flush=True)
                failures += 1
            res[name] = dict(us=us, gpu_us=gus, err=err, distinct=len(seen), out=out)
        for name, rr in res.items():
            fz = "F" if conv_wgrad.fused(conv_wgrad.Geometry(*_geom_args(case)), pl) else ""
            rows.append(dict(case=case.name, plan=f"t{pl.tile} S{pl.splits} Kc{pl.chunk}{fz}", variant=name,
                             us=round(rr["us"], 1), gpu_us=round(rr["gpu_us"], 1),
                             tflops=round(flops / rr["us"] / 1e6, 2),
                             vs_cudnn=round(rr["us"] / res["cudnn"]["us"], 2),
                             tree_vs_atomic=round(rr["us"] / res["atomic"]["us"], 2) if name.startswith("tree") else "",
                             distinct=rr["distinct"], err_over_bound=f"{rr['err']:.3f}"))
        for row in rows[-len(res):]:  # as it goes: a run cut short keeps what it measured
            print(f"    {row['variant']:<13} {row['us']:>8} us  x cudnn {row['vs_cudnn']:<5} "
                  f"x atomic {row['tree_vs_atomic'] or '-':<5} distinct {row['distinct']} err/bound "
                  f"{row['err_over_bound']}", flush=True)
        for t, st, tap in combos:
            with configuration(t, st, tap):
                tp = plan(m, r, k)
                atomic, tree = kernels.get(OP, "atomic"), kernels.get(OP, "tree")
                same = torch.equal(tree(x, dy, **kw), res["tree"]["out"]) if tp == pl else ""
                failures += same is False
                ta = back_to_back_us(lambda: atomic(x, dy, **kw), calls=10, repeats=args.repeats, warmup=3)
                tt = back_to_back_us(lambda: tree(x, dy, **kw), calls=10, repeats=args.repeats, warmup=3)
            sweep.append(dict(case=case.name, target=t, style=st, tap="on" if tap else "off",
                              plan=f"t{tp.tile} S{tp.splits} Kc{tp.chunk}",
                              atomic_us=round(ta, 1), tree_us=round(tt, 1),
                              tree_vs_cudnn=round(tt / res["cudnn"]["us"], 2), tree_same_bits=same))
        print(f"  done {case.name} ({pl})", flush=True)
    torch.cuda.synchronize()
    for table, head in ((rows, ["case", "plan", "variant", "us", "gpu_us", "tflops", "vs_cudnn", "tree_vs_atomic",
                                "distinct", "err_over_bound"]),
                        (sweep, ["case", "target", "style", "tap", "plan", "atomic_us", "tree_us", "tree_vs_cudnn",
                                 "tree_same_bits"])):
        if not table:
            continue
        widths = [max(len(h), *(len(str(row[h])) for row in table)) for h in head]
        print("  ".join(h.ljust(n) for h, n in zip(head, widths)))
        for row in table:
            print("  ".join(str(row[h]).ljust(n) for h, n in zip(head, widths)))
    if args.csv:  # rows to the file named, the style/target sweep (if any) beside it
        for table, path in ((rows, args.csv), (sweep, args.csv.with_name(args.csv.stem + "_sweep.csv"))):
            if table:
                with path.open("w", newline="") as f:
                    wr = csv.DictWriter(f, fieldnames=list(table[0]))
                    wr.writeheader()
                    wr.writerows(table)
    print(f"{failures} failure(s): results outside the float64 bound or tree bits that changed with the style")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
