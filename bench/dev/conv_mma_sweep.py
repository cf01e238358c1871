"""Tensor-core conv backward (kernels/conv_mma.py) per pipeline depth, beside cuDNN's fastest, bf16.

    python bench/dev/conv_mma_sweep.py                    # a few ResNet-50 shapes, batch 64, channels_last
    python bench/dev/conv_mma_sweep.py --stages 2 3 4

Times are GPU microseconds per call (bench.timing.graph_replay_us: medians of CUDA-graph replays). The
depth never changes the bits (same accumulation order); this picks conv_mma.STAGES.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402
from kernels import conv_mma  # noqa: E402

SHAPES = (  # (cin, cout, k, stride, pad, size): ResNet-50 at 224 px
    (64, 64, 3, 1, 1, 56), (64, 256, 1, 1, 0, 56), (256, 64, 1, 1, 0, 56), (128, 128, 3, 2, 1, 56),
    (256, 256, 3, 1, 1, 14), (1024, 256, 1, 1, 0, 14), (512, 512, 3, 1, 1, 7), (3, 64, 7, 2, 3, 224),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    wgrad, dgrad = kernels.get("conv_wgrad", "tree"), kernels.get("conv_dgrad", "tree")
    print("| shape | grad | cudnn_fastest | " + " | ".join(f"stages {s}" for s in a.stages) + " |")
    print("|---|---|---|" + "---|" * len(a.stages))
    for cin, cout, k, s, pad, size in SHAPES:
        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
        x, w = rand(a.batch, cin, size, size), rand(cout, cin, k, k)
        o = (size + 2 * pad - k) // s + 1
        dy = rand(a.batch, cout, o, o)
        geom = dict(stride=s, padding=pad)
        calls = {
            "dgrad": (lambda: dgrad(w, dy, input_size=(size, size), **geom), [True, False, False]),
            "wgrad": (lambda: wgrad(x, dy, kernel_size=k, **geom), [False, True, False]),
        }
        for grad, (fn, mask) in calls.items():
            if grad == "dgrad" and cin % 8:
                continue
            with cudnn_flags(benchmark=True, deterministic=False):
                ref = graph_replay_us(lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, mask), calls=5, replays=10)
            row = []
            for st in a.stages:
                conv_mma.STAGES = st
                row.append(graph_replay_us(fn, calls=5, replays=10))
            print(f"| {cin}->{cout} k{k} s{s} {size}px | {grad} | {ref:.1f} | "
                  + " | ".join(f"{t:.1f} ({t / ref:.2f}x)" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
