"""GPU time of the grouped conv ``tree`` kernels (conv_dgrad_grouped and conv_wgrad_grouped) per grouped conv
shape of a network and layout, beside torch's own backward of that gradient (cudnn.benchmark on), with a
checksum of each ``tree`` result, so that two checkouts of the kernels can be compared in one session: same
shapes, same seeded tensors, bit-identical results where a change keeps the accumulation order.

    python bench/dev/conv_grouped_tree.py --model torchvision:mobilenet_v3_small --batch 128 --size 224
    NNRAND_ROOT=/tmp/base python bench/dev/conv_grouped_tree.py ...   # the same script over another checkout

GPU time per call: median of CUDA-graph replays (bench.timing.graph_replay_us), fp32, TF32 off.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.environ.get("NNRAND_ROOT") or str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench.conv_shapes import conv_shapes, network_arguments, shape_name  # noqa: E402
from bench.metrics import byte_hash  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402
from kernels import conv_dgrad_grouped, conv_wgrad_grouped  # noqa: E402
from nnrand import noise  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    network_arguments(p, batch=128, calls=5, replays=10)
    p.add_argument("--layouts", nargs="+", default=["nchw", "channels_last"], choices=["nchw", "channels_last"])
    args = p.parse_args()
    print(f"kernels from {conv_dgrad_grouped.__file__}")
    totals: dict[str, float] = {}
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        for s in conv_shapes(args.model, args.batch, args.size, args.classes):
            if s["groups"] == 1:
                continue
            for layout in args.layouts:
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                g = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(*s["x"], device="cuda", generator=g).contiguous(memory_format=fmt)
                w = torch.randn(*s["w"], device="cuda", generator=g).contiguous(memory_format=fmt)
                geom = dict(stride=tuple(s["stride"]), padding=tuple(s["padding"]), dilation=tuple(s["dilation"]),
                            groups=s["groups"])
                y = torch.nn.functional.conv2d(x, w, None, **geom)
                dy = torch.randn(y.shape, device="cuda", generator=g).contiguous(memory_format=fmt)
                args_t = (dy, x, w, None, list(geom["stride"]), list(geom["padding"]), list(geom["dilation"]), False,
                          [0, 0], s["groups"])
                calls = {
                    "dgrad": lambda: conv_dgrad_grouped.conv_dgrad_grouped_tree_cuda(
                        w, dy, input_size=tuple(s["x"][-2:]), **geom),
                    "wgrad": lambda: conv_wgrad_grouped.conv_wgrad_grouped_tree_cuda(
                        x, dy, kernel_size=tuple(s["w"][-2:]), **geom),
                }
                peers = {
                    "dgrad": lambda: torch.ops.aten.convolution_backward(*args_t, [True, False, False])[0],
                    "wgrad": lambda: torch.ops.aten.convolution_backward(*args_t, [False, True, False])[1],
                }
                line = f"{shape_name(s):<28} x{s['count']:<2} {layout:<13}"
                for name, fn in calls.items():
                    us = graph_replay_us(fn, calls=args.calls, replays=args.replays)
                    with cudnn_flags(benchmark=True, deterministic=False):
                        peers[name]()   # the benchmark's pick, made before the capture
                        torch_us = graph_replay_us(peers[name], calls=args.calls, replays=args.replays)
                    totals[f"{layout} {name} tree"] = totals.get(f"{layout} {name} tree", 0.0) + us * s["count"]
                    totals[f"{layout} {name} torch"] = totals.get(f"{layout} {name} torch", 0.0) + torch_us * s["count"]
                    line += f"  {name} {us:8.1f} us (torch {torch_us:7.1f}) {byte_hash(fn())[:12]}"
                print(line, flush=True)
    print("totals (us, count-weighted): " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
