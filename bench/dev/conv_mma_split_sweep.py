"""The tensor-core weight gradient's split of the reduction (conv_wgrad.half_plan) swept over its two constants,
per ResNet-50 conv shape (224 px, batch 64, channels_last, bf16), beside cuDNN's fastest.

    python bench/dev/conv_mma_split_sweep.py                        # the default candidates
    python bench/dev/conv_mma_split_sweep.py --candidates 528:1024 1056:512 --batch 32

A candidate is TARGET_BLOCKS:MIN_CHUNK; ``fp32rule`` is the float32 kernels' plan without the refit to waves
(what the tensor-core kernels ran before half_plan). Times are GPU microseconds per call (CUDA-graph replays,
bench.timing.graph_replay_us); the totals weight each shape by its count in one forward. Beside each time:
the candidate's split S and its largest |difference| from the fp32rule result over the largest |value|
(printed, not checked: a split changes the rounding, not the sum; tests/test_conv_mma_gpu.py bounds it).
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.conv_shapes import NETWORKS, conv_shapes  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402
from kernels import conv_mma, conv_wgrad  # noqa: E402
from kernels.shapes import conv_out  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidates", nargs="+", default=["264:1024", "528:512", "528:1024", "528:2048", "1056:1024"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    model, _, size, classes = NETWORKS["resnet50_224"]
    shapes = conv_shapes(model, a.batch, size, classes)
    plans = {"fp32rule": functools.partial(conv_wgrad.plan, waves=False)}
    for c in a.candidates:
        t, m = map(int, c.split(":"))
        plans[c] = functools.partial(conv_wgrad._half_plan, target_blocks=t, min_chunk=m)
    g = torch.Generator(device="cuda").manual_seed(0)
    totals = dict.fromkeys(["cudnn_fastest", *plans], 0.0)
    print("| shape | x | cudnn_fastest | " + " | ".join(plans) + " |")
    print("|---|---|---|" + "---|" * len(plans))
    for s in shapes:
        def rand(*shape):
            t = torch.randn(*shape, device="cuda", generator=g).to(dtype)
            return t.contiguous(memory_format=torch.channels_last)
        x, w = rand(*s["x"]), rand(*s["w"])
        k, st, pad = s["w"][2], s["stride"], s["padding"]
        dil = s["dilation"]
        oh, ow = (conv_out(s["x"][2 + i], s["w"][2 + i], st[i], pad[i], dil[i]) for i in (0, 1))
        dy = rand(s["x"][0], s["w"][0], oh, ow)
        geo = conv_wgrad._check(x, dy, (k, s["w"][3]), tuple(st), tuple(pad), tuple(s["dilation"]))
        if not conv_mma.eligible(dtype, geo.cin, geo.cout, x, dy, pad_cin=True):
            continue
        with cudnn_flags(benchmark=True, deterministic=False):
            ref = graph_replay_us(lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, st, pad, s["dilation"], False, [0, 0], 1, [False, True, False]), calls=5, replays=10)
        totals["cudnn_fastest"] += s["count"] * ref
        base = conv_mma.wgrad(x, dy, geo, plans["fp32rule"], atomic=False).float()
        cells = []
        for name, plan_of in plans.items():
            gp = conv_mma.padded_geometry(geo) if geo.cin % conv_mma.ALIGN else geo
            pl = plan_of(gp.m, gp.r, gp.k)
            t = graph_replay_us(lambda: conv_mma.wgrad(x, dy, geo, plan_of, atomic=False), calls=5, replays=10)
            err = ((conv_mma.wgrad(x, dy, geo, plan_of, atomic=False).float() - base).abs().max()
                   / base.abs().max()).item()
            totals[name] += s["count"] * t
            cells.append(f"{t:.1f} ({t / ref:.2f}x, S={pl.splits}, {err:.0e})")
        name = f"{s['w'][1]}->{s['w'][0]} k{k} s{st[0]} {s['x'][2]}px"
        print(f"| {name} | {s['count']} | {ref:.1f} | " + " | ".join(cells) + " |", flush=True)
    print("| total | | " + " | ".join(f"{v:.0f} ({v / totals['cudnn_fastest']:.2f}x)" for v in totals.values()) + " |")


if __name__ == "__main__":
    main()
