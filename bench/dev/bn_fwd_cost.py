"""GPU time of a training-mode BatchNorm forward per network shape: cuDNN's kernel (aten::cudnn_batch_norm,
what torch runs for a float32 CUDA BatchNorm2d), ATen's own (aten::native_batch_norm) and the registry's bn_fwd
variants, in both layouts, with the number of distinct results over repeated calls (output, saved mean and
saved inverse std; hashed on the device, nnrand.audit.digest).

    python bench/dev/bn_fwd_cost.py --model torchvision:resnet18 --batch 128 --size 224
    python bench/dev/bn_fwd_cost.py --model resnet18 --batch 128 --size 32 --layouts nchw

GPU time per call: median of CUDA-graph replays (bench.timing.graph_replay_us), fp32.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.conv_shapes import network_arguments  # noqa: E402
from bench.timing import graph_replay_us  # noqa: E402
import kernels  # noqa: E402
from nnrand.audit import digest  # noqa: E402

KERNELS = {
    "cudnn": lambda x, w, b, rm, rv: torch.ops.aten.cudnn_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)[:3],
    "native": lambda x, w, b, rm, rv: torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5),
    "tree": lambda x, w, b, rm, rv: kernels.get("bn_fwd", "tree")(x, w, b, rm, rv, 0.1, 1e-5),
    "atomic": lambda x, w, b, rm, rv: kernels.get("bn_fwd", "atomic")(x, w, b, rm, rv, 0.1, 1e-5),
}


def bn_shapes(model_name: str, batch: int, size: int, classes: int) -> list[tuple[tuple[int, ...], int]]:
    """The input shapes of one forward's BatchNorm2d layers, with their counts (hooks on the meta device)."""
    from nnrand import models

    with torch.device("meta"):
        model = models.build_model(model_name, classes)
    seen: Counter = Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.register_forward_hook(lambda mod, inputs, out: seen.update([tuple(inputs[0].shape)]))
    with torch.no_grad():
        model(torch.empty(batch, 3, size, size, device="meta"))
    return list(seen.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    network_arguments(p, batch=128, calls=5, replays=10)
    p.add_argument("--layouts", default="nchw,channels_last", help="comma-separated layouts (nchw, channels_last)")
    p.add_argument("--repeats", type=int, default=20, help="calls whose results are hashed per kernel")
    args = p.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or not set(layouts) <= {"nchw", "channels_last"}:
        p.error(f"--layouts: expected a comma-separated list of nchw and channels_last, got {args.layouts!r}")
    totals: Counter = Counter()
    for shape, count in bn_shapes(args.model, args.batch, args.size, args.classes):
        for layout in layouts:
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            g = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.5).contiguous(memory_format=fmt)
            c = shape[1]
            w, b = torch.rand(c, device="cuda", generator=g) + 0.5, torch.randn(c, device="cuda", generator=g)
            cells = []
            for name, fn in KERNELS.items():
                rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
                us = graph_replay_us(lambda: fn(x, w, b, rm, rv), calls=args.calls, replays=args.replays)
                hashes = {digest(fn(x, w, b, rm.clone(), rv.clone())) for _ in range(args.repeats)}
                totals[f"{layout} {name}"] += us * count
                cells.append(f"{name} {us:8.1f} us {len(hashes)}/{args.repeats} distinct")
            print(f"{'x'.join(map(str, shape)):<20} x{count:<2} {layout:<13} " + "  ".join(cells), flush=True)
    print("totals (us, count-weighted): " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
