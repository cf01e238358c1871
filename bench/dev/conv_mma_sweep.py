"""Tensor-core conv backward (kernels/conv_mma.py) per engine and pipeline shape, beside cuDNN's fastest, bf16.

    python bench/dev/conv_mma_sweep.py                                # a few ResNet-50 shapes, batch 64, CL
    python bench/dev/conv_mma_sweep.py --configs wgmma:3 wgmma:4 mma:4

A config is ENGINE:STAGES (wgmma needs 3 or more stages). Times are GPU microseconds per call
(bench.timing.graph_replay_us: medians of CUDA-graph replays); `err` is the largest |difference| from cuDNN's
float32 result on the widened tensors, over the largest |value| of that result, for each config. Stages
never change the bits (same accumulation order); the engine may.
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


def configure(config: str) -> None:
    engine, stages = config.split(":")
    conv_mma.ENGINE = engine
    conv_mma.STAGES[engine] = int(stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["wgmma:3", "wgmma:4", "mma:4"])
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    defaults = dict(conv_mma.STAGES)
    wgrad, dgrad = kernels.get("conv_wgrad", "tree"), kernels.get("conv_dgrad", "tree")
    print("| shape | grad | cudnn_fastest | " + " | ".join(a.configs) + " |")
    print("|---|---|---|" + "---|" * len(a.configs))
    for cin, cout, k, s, pad, size in SHAPES:
        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
        x, w = rand(a.batch, cin, size, size), rand(cout, cin, k, k)
        o = (size + 2 * pad - k) // s + 1
        dy = rand(a.batch, cout, o, o)
        geom = dict(stride=s, padding=pad)
        with cudnn_flags(benchmark=False, deterministic=True):
            ref_dx, ref_dw, _ = torch.ops.aten.convolution_backward(
                dy.float(), x.float(), w.float(), None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1,
                [True, True, False])
        calls = {
            "dgrad": (lambda: dgrad(w, dy, input_size=(size, size), **geom), [True, False, False], ref_dx),
            "wgrad": (lambda: wgrad(x, dy, kernel_size=k, **geom), [False, True, False], ref_dw),
        }
        for grad, (fn, mask, ref) in calls.items():
            if grad == "dgrad" and cin % 8:
                continue
            with cudnn_flags(benchmark=True, deterministic=False):
                t_ref = graph_replay_us(lambda: torch.ops.aten.convolution_backward(
                    dy, x, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, mask), calls=5, replays=10)
            row = []
            for config in a.configs:
                configure(config)
                err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                t = graph_replay_us(fn, calls=5, replays=10)
                row.append(f"{t:.1f} ({t / t_ref:.2f}x, err {err:.1e})")
            print(f"| {cin}->{cout} k{k} s{s} {size}px | {grad} | {t_ref:.1f} | " + " | ".join(row) + " |",
                  flush=True)
    conv_mma.ENGINE = None
    conv_mma.STAGES.update(defaults)


if __name__ == "__main__":
    main()
