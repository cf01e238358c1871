"""The tensor-core data gradient's tile (conv_mma.dgrad_tile) per ResNet-50 conv shape (224 px, batch 64,
channels_last, bf16), beside cuDNN's fastest.

    python bench/dev/conv_mma_dgrad_tiles.py
    python bench/dev/conv_mma_dgrad_tiles.py --batch 32 --dtype fp16

Columns: every (BM, BN) the engine has (``/S``: with S shared-memory stages, ``--stages``), and ``rule``,
what dgrad_tile picks per launch. Times are GPU microseconds per call (CUDA-graph replays,
bench.timing.graph_replay_us), weight repacking included; the totals weight each shape by its count in
one forward. ``same`` says whether every tile gave the bits of 128-row tiles (it must: the tile is a
speed knob).

H100 at git f54cdb3, every ResNet-50 shape: BM 128 (BN by the channels, as before) 3118 us in all,
dgrad_tile's rule 3072, cuDNN's fastest 1577; 4 or 6 stages slower for every tile (3716-5022).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.conv_shapes import NETWORKS, conv_shapes  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402
from kernels import conv_dgrad, conv_mma  # noqa: E402
from kernels.shapes import conv_out  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--stages", nargs="+", type=int, default=[0],
                   help="shared-memory stages per tile (0: the engine's default, conv_mma.STAGES)")
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    engine = conv_mma.default_engine(torch.device("cuda"))
    model, _, size, classes = NETWORKS["resnet50_224"]
    g = torch.Generator(device="cuda").manual_seed(0)
    tiles = [(128, 128), (128, 64)] + ([(64, 128), (64, 64)] if engine == "wgmma" else [])
    runs = [(t, st) for st in a.stages for t in tiles] + [(None, 0)]
    names = ["cudnn_fastest", *(f"{t[0]}x{t[1]}" + (f"/{st}" if st else "") for t, st in runs[:-1]), "rule"]
    totals = dict.fromkeys(names, 0.0)
    print(f"engine {engine}\n| shape | x | " + " | ".join(names) + " | same |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for s in conv_shapes(model, a.batch, size, classes):
        def rand(*shape):
            t = torch.randn(*shape, device="cuda", generator=g).to(dtype)
            return t.contiguous(memory_format=torch.channels_last)
        x, w = rand(*s["x"]), rand(*s["w"])
        st, pad, dil = tuple(s["stride"]), tuple(s["padding"]), tuple(s["dilation"])
        oh, ow = (conv_out(s["x"][2 + i], s["w"][2 + i], st[i], pad[i], dil[i]) for i in (0, 1))
        dy = rand(s["x"][0], s["w"][0], oh, ow)
        geo = conv_dgrad._check(w, dy, tuple(s["x"][2:]), st, pad, dil)
        if not conv_mma.eligible(dtype, geo.cin, geo.cout, w, dy):
            continue
        with cudnn_flags(benchmark=True, deterministic=False):
            ref = graph_replay_us(lambda: torch.ops.aten.convolution_backward(
                dy, x, w, None, st, pad, dil, False, [0, 0], 1, [True, False, False]), calls=5, replays=10)
        times = [ref]
        want = conv_mma.dgrad(w, dy, geo, tile=(128, 128))
        same = True
        for tile, stages in runs:
            kw = dict(tile=tile, stages=stages or None)
            times.append(graph_replay_us(lambda: conv_mma.dgrad(w, dy, geo, **kw), calls=5, replays=10))
            same &= bool(torch.equal(conv_mma.dgrad(w, dy, geo, **kw).view(torch.int16), want.view(torch.int16)))
        for k, t in zip(names, times):
            totals[k] += s["count"] * t
        name = f"{s['w'][1]}->{s['w'][0]} k{s['w'][2]} s{st[0]} {s['x'][2]}px"
        print(f"| {name} | {s['count']} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {same} |", flush=True)
    ref = totals["cudnn_fastest"]
    print("| total | | " + " | ".join(f"{v:.0f} ({v / ref:.2f}x)" for v in totals.values()) + " | |")


if __name__ == "__main__":
    main()
