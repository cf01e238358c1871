"""maxpool_bwd on the ResNet stem pool (128 x 64 x 16 x 16, 3x3 stride 2 pad 1), CUDA: GPU time of every
variant, of tree's kernels one by one (stride cells, tiled, global gather) and of torch's backward from
CUDA-graph replays (warm L2, no launch overhead); then tree's tiled kernel under other block shapes
(TILE_CELLS for NCHW, TILE_CHANNELS for channels_last), with a check that the bits never change; then
the stride-1 contention pools (k x k, 32 x 32, C 64), where the stride-cell kernel covers k = 3.

    PYTHONPATH=. python bench/dev/maxpool_tile_sweep.py
    PYTHONPATH=. ncu -k regex:maxpool --section SpeedOfLight --section Occupancy \\
        python bench/dev/maxpool_tile_sweep.py --once      # one call of each variant, for a profiler
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels import maxpool_bwd as mp  # noqa: E402
from bench.timing import graph_replay_us  # noqa: E402

KW = dict(input_size=(16, 16), kernel_size=3, stride=2, padding=1)
TREE_KERNELS = {"tree": kernels.get("maxpool_bwd", "tree"), "tree_tile": mp.maxpool_bwd_tree_tile_cuda,
                "tree_gather": mp.maxpool_bwd_tree_gather_cuda}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--once", action="store_true", help="run each variant once (NCHW) and exit")
    args = ap.parse_args()
    if not kernels.cuda_available():
        print("maxpool_tile_sweep: needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    x = torch.randn(128, 64, 16, 16, device=dev, generator=torch.Generator(dev).manual_seed(0))
    saved = mp.TILE_CELLS, mp.TILE_CHANNELS
    try:
        for layout in ("nchw", "channels_last"):
            xi = x if layout == "nchw" else x.contiguous(memory_format=torch.channels_last)
            y, idx = torch.nn.functional.max_pool2d(xi, 3, 2, 1, return_indices=True)
            dy = torch.randn_like(y)  # y's layout

            def call(name):
                v = TREE_KERNELS[name] if name in TREE_KERNELS else kernels.get("maxpool_bwd", name)
                return lambda: v(dy, idx, **KW)

            names = ("atomic", "tree", "tree_tile", "tree_gather", "owner")
            if args.once:
                for name in names:
                    call(name)()
                torch.cuda.synchronize()
                return 0
            ref = call("tree")()
            same = {n: torch.equal(call(n)(), ref) for n in names if n != "atomic"}
            us = {n: graph_replay_us(call(n), calls=20, replays=20) for n in names}
            us["torch"] = graph_replay_us(lambda: torch.ops.aten.max_pool2d_with_indices_backward(
                dy, xi, [3, 3], [2, 2], [1, 1], [1, 1], False, idx), calls=20, replays=20)
            print(layout, "GPU us per call:", {k: round(v, 2) for k, v in us.items()},
                  f"tree / atomic {us['tree'] / us['atomic']:.3f}; same bits as tree: {same}", flush=True)
            sizes = [(c, 8) for c in (64, 128, 256, 512, 1024, 2048)] if layout == "nchw" else \
                [(512, c) for c in (1, 2, 4, 8, 16, 32)]
            for cells, channels in sizes:
                mp.TILE_CELLS, mp.TILE_CHANNELS = cells, channels
                mp.tile_plan.cache_clear()
                same = torch.equal(call("tree_tile")(), ref)
                t = graph_replay_us(call("tree_tile"), calls=20, replays=20)
                print(f"  TILE_CELLS {cells} TILE_CHANNELS {channels}: plan (grid, group, shift, smem) "
                      f"{mp.tile_plan(128, 64, 16, 16, 8, 8, layout)}, tiled {t:.2f} us, same bits {same}", flush=True)
    finally:
        mp.TILE_CELLS, mp.TILE_CHANNELS = saved
        mp.tile_plan.cache_clear()
    for layout in ("nchw", "channels_last"):
        for k in (3, 5, 7):
            kw = dict(input_size=(32, 32), kernel_size=k, stride=1, padding=k // 2)
            x = torch.randn(32, 64, 32, 32, device=dev, generator=torch.Generator(dev).manual_seed(k))
            x = x if layout == "nchw" else x.contiguous(memory_format=torch.channels_last)
            y, idx = torch.nn.functional.max_pool2d(x, k, 1, k // 2, return_indices=True)
            dy = torch.randn_like(y)
            fns = {"atomic": kernels.get("maxpool_bwd", "atomic"), **TREE_KERNELS}
            ref = fns["tree"](dy, idx, **kw)
            same = all(torch.equal(fns[n](dy, idx, **kw), ref) for n in TREE_KERNELS)
            us = {n: graph_replay_us(lambda f=f: f(dy, idx, **kw), calls=10, replays=10) for n, f in fns.items()}
            print(f"{layout} k{k} s1 32x32 (32 x 64 planes), cell plan {mp._cell_plan_of(_params(kw))}: "
                  f"GPU us per call {({n: round(v, 2) for n, v in us.items()})}, same bits {same}", flush=True)
    return 0


def _params(kw: dict) -> dict:
    return mp._params(kw["input_size"], kw["kernel_size"], kw["stride"], kw["padding"], 1, False)


if __name__ == "__main__":
    raise SystemExit(main())
