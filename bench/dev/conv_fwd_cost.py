"""Forward convolution per network shape: what cuDNN's timed choice (cudnn.benchmark) gains over its
heuristic choice under PyTorch's deterministic mode (what a deterministic routing runs unless the tuner of
fastest-deterministic takes the forward; the heuristic's plan is made first, see below), per layout,
and what nnrand's deterministic data-gradient kernels give when they compute the forward of a stride-1
conv (y = conv(x, w, p) is the data gradient of a conv with weights flip(w)^T and padding k-1-p): tree's,
and the Winograd one (kernels/conv_dgrad_winograd.py: prepare_forward) where it applies.

    python bench/dev/conv_fwd_cost.py --model resnet18 --batch 64 --size 32
    python bench/dev/conv_fwd_cost.py --model torchvision:resnet50 --batch 64 --size 224 --classes 1000

GPU time per call, median of CUDA-graph replays (bench.timing.graph_replay_us), fp32 with TF32 off. The
heuristic column also names the kernels it launches (torch.profiler), to see the algorithm cuDNN took.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.conv_shapes import conv_shapes, network_arguments, shape_name  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402
from nnrand import noise  # noqa: E402


def kernel_names(fn) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " + ".join(n[:60] for n in dict.fromkeys(names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    network_arguments(p, batch=64, calls=10, replays=20)
    args = p.parse_args()
    tree = kernels.get("conv_dgrad", "tree")
    wino = kernels.conv_dgrad_winograd
    totals: dict[str, float] = {}
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        for s in conv_shapes(args.model, args.batch, args.size, args.classes):
            row = {}
            for layout in ("nchw", "channels_last"):
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                g = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(*s["x"], device="cuda", generator=g).contiguous(memory_format=fmt)
                w = torch.randn(*s["w"], device="cuda", generator=g).contiguous(memory_format=fmt)

                def fwd():
                    return torch.nn.functional.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"],
                                                      s["groups"])
                # torch caches one cuDNN plan per configuration and cudnn.deterministic, whatever
                # cudnn.benchmark says: the heuristic's plan must be made first, and nothing timed
                # under deterministic mode may run before it
                with cudnn_flags(benchmark=False, deterministic=True):
                    row[f"{layout} heuristic"] = graph_replay_us(fwd, calls=args.calls, replays=args.replays)
                    names = kernel_names(fwd)
                    ref = fwd().double()
                with cudnn_flags(benchmark=True, deterministic=False):
                    row[f"{layout} fastest"] = graph_replay_us(fwd, calls=args.calls, replays=args.replays)
                k = s["w"][-1]
                if s["stride"] == [1, 1] and s["groups"] == 1 and s["dilation"] == [1, 1]:
                    wt = w.flip(-1, -2).transpose(0, 1).contiguous(memory_format=fmt)
                    pad = k - 1 - s["padding"][0]
                    out_hw = tuple(h + 2 * s["padding"][0] - k + 1 for h in s["x"][-2:])

                    def ours():
                        return tree(wt, x, input_size=out_hw, padding=pad)
                    err = (ours().double() - ref).abs().max().item()
                    row[f"{layout} tree_dgrad"] = graph_replay_us(ours, calls=args.calls, replays=args.replays)
                    row[f"{layout} tree_err"] = err
                    if wino.forward_applies(x, w, tuple(s["padding"])):
                        run = wino.prepare_forward(x, w, padding=tuple(s["padding"]))
                        row[f"{layout} winograd"] = graph_replay_us(lambda: run(x, w), calls=args.calls,
                                                                    replays=args.replays)
                        row[f"{layout} winograd_err"] = (run(x, w).double() - ref).abs().max().item()
                print(f"{shape_name(s):<22} x{s['count']} {layout:<13} fastest {row[f'{layout} fastest']:7.1f}  "
                      f"heuristic {row[f'{layout} heuristic']:7.1f}  "
                      f"tree_dgrad {row.get(f'{layout} tree_dgrad', float('nan')):7.1f}  "
                      f"winograd {row.get(f'{layout} winograd', float('nan')):7.1f}  [{names}]", flush=True)
            for key, v in row.items():
                if not key.endswith("_err"):
                    totals[key] = totals.get(key, 0.0) + v * s["count"]
    print("totals (us, count-weighted; tree_dgrad over stride-1 shapes only, winograd over the float32 3x3 "
          "stride-1 ones it covers):")
    for key, v in totals.items():
        print(f"  {key:<26} {v:9.1f}")


if __name__ == "__main__":
    main()
