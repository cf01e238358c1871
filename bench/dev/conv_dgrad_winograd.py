"""conv_dgrad per 3x3 stride-1 shape: cuDNN's fastest and deterministic data gradient beside nnrand's
``tree`` (direct implicit GEMM) and ``winograd`` (fused F(2x2, 3x3)), GPU time from CUDA-graph replays,
fp32 with TF32 off, and winograd's distance to tree (max |diff| / max |dx|) as a sanity check.

    python bench/dev/conv_dgrad_winograd.py                      # torchvision resnet18 224 px, batch 128
    python bench/dev/conv_dgrad_winograd.py --batch 64 --layouts channels_last
"""
from __future__ import annotations

import argparse

import torch

import kernels
from bench.timing import cudnn_flags, graph_replay_us

# (Cin = Cout, spatial size): the stride-1 3x3 convs of torchvision resnet18 / resnet50 at 224 px
SHAPES = ((64, 56), (128, 28), (256, 14), (512, 7))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["nchw", "channels_last"], choices=["nchw", "channels_last"])
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args(argv)
    tree, wino = kernels.get("conv_dgrad", "tree"), kernels.get("conv_dgrad", "winograd")
    print(f"{torch.cuda.get_device_name()}, batch {args.batch}, us per call (GPU time)")
    for layout in args.layouts:
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        for c, hw in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(c, c, 3, 3, device="cuda", generator=g) / 24.0
            dy = torch.randn(args.batch, c, hw, hw, device="cuda", generator=g).contiguous(memory_format=fmt)
            size = (args.batch, c, hw, hw)
            kw = dict(input_size=(hw, hw), stride=1, padding=1, dilation=1)

            def torch_dgrad():
                return torch.nn.grad.conv2d_input(size, w, dy, 1, 1, 1)
            times = {}
            for name, bench, det in (("cudnn_fastest", True, False), ("cudnn_det", False, True)):
                with cudnn_flags(benchmark=bench, deterministic=det):
                    torch_dgrad()
                    times[name] = graph_replay_us(torch_dgrad, calls=args.calls, replays=args.replays)
            times["tree"] = graph_replay_us(lambda: tree(w, dy, **kw), calls=args.calls, replays=args.replays)
            times["winograd"] = graph_replay_us(lambda: wino(w, dy, **kw), calls=args.calls, replays=args.replays)
            a, b = tree(w, dy, **kw), wino(w, dy, **kw)
            rel = ((a - b).abs().max() / a.abs().max()).item()
            fast = times["cudnn_fastest"]
            print(f"{layout:13s} 3x3 {c:3d}->{c:3d} {hw:2d}x{hw:<2d}  " +
                  "  ".join(f"{k} {v:7.1f}" for k, v in times.items()) +
                  f"  winograd/cudnn_fastest {times['winograd'] / fast:.2f}x  tree/cudnn_fastest "
                  f"{times['tree'] / fast:.2f}x  max|wino-tree|/max|tree| {rel:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
