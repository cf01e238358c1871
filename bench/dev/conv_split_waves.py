"""Split-K against waves, per ResNet-18 (CIFAR) conv shape at batches 64 and 128: conv_wgrad tree with its
base plan (``plan(..., waves=False)``; the rows printed at git 4c278d4 were taken before the refit
existed, when the base plan was the default) against plans whose block count fits whole waves of 264
blocks (2 per SM on 132 SMs), and
conv_dgrad tree with its split-K target at 0 (no split), 264 and 528 blocks. GPU time per call, median
of CUDA-graph replays (bench.timing.graph_replay_us), fp32, NCHW.

    python bench/dev/conv_split_waves.py [--batches 64 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.conv_shapes import conv_shapes, shape_name  # noqa: E402
from bench.timing import graph_replay_us  # noqa: E402
from kernels import conv_dgrad as cd, conv_wgrad as cw  # noqa: E402
from kernels.runtime import cdiv  # noqa: E402

WAVE = 264


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    args = p.parse_args()
    wtree, dtree = kernels.get("conv_wgrad", "tree"), kernels.get("conv_dgrad", "tree")
    plan0 = cw.plan
    for batch in args.batches:
        for s in conv_shapes("resnet18", batch, 32, 10):
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(*s["x"], device="cuda", generator=g)
            w = torch.randn(*s["w"], device="cuda", generator=g)
            y = torch.nn.functional.conv2d(x, w, None, s["stride"], s["padding"])
            dy = torch.randn(y.shape, device="cuda", generator=g)
            geom = dict(stride=tuple(s["stride"]), padding=tuple(s["padding"]))
            k = tuple(s["w"][-2:])
            gw = cw._check(x, dy, k, geom["stride"], geom["padding"], 1)
            p0 = plan0(gw.m, gw.r, gw.k, waves=False)
            tiles = cdiv(gw.m, p0.tile) * cdiv(gw.r, p0.tile)
            row = [f"b{batch} {shape_name(s):<22} wgrad tiles {tiles} S {p0.splits} ({tiles * p0.splits} blocks) "
                   f"{graph_replay_us(lambda: wtree(x, dy, kernel_size=k, **geom), calls=10, replays=20):7.1f}"]
            for waves in (1, 2):
                s2 = max(1, waves * WAVE // tiles)
                if s2 == p0.splits or s2 > cdiv(gw.k, 16):
                    continue
                chunk = cdiv(cdiv(gw.k, s2), 16) * 16
                alt = cw.Plan(p0.tile, cdiv(gw.k, chunk), chunk)
                cw.plan = lambda m, r, kk, split=True, waves=True, alt=alt: alt
                try:
                    t = graph_replay_us(lambda: wtree(x, dy, kernel_size=k, **geom), calls=10, replays=20)
                finally:
                    cw.plan = plan0
                row.append(f"S {alt.splits} ({tiles * alt.splits}) {t:7.1f}")
            if s["stride"] == [1, 1]:
                target0 = cd.SPLIT_TARGET
                for target in (0, 264, 528):
                    cd.SPLIT_TARGET = target
                    cd._tree_plan.cache_clear()
                    try:
                        gd = cd._check(w, dy, tuple(s["x"][-2:]), 1, geom["padding"], 1)
                        ks = cd.tree_plan(gd, tuple(dy.stride())).ksplit
                        t = graph_replay_us(lambda: dtree(w, dy, input_size=tuple(s["x"][-2:]), **geom),
                                            calls=10, replays=20)
                    finally:
                        cd.SPLIT_TARGET = target0
                        cd._tree_plan.cache_clear()
                    row.append(f"| dgrad target {target} ksplit {ks} {t:7.1f}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
