"""conv_dgrad tree_stem at each pixel count per lane group (4, 8) and channel count per lane (3, 4) on the
network stems, CUDA: GPU time per call from CUDA-graph replays, beside cuDNN's fastest algorithm
(benchmark mode, nondeterministic allowed) and PyTorch's deterministic mode, TF32 off; every setting's dx
checked bitwise against the default plan's (the settings never change a bit).

    PYTHONPATH=. python bench/dev/conv_stem_tiles.py [--calls 10] [--replays 10]

Shapes: ResNet-50's stem (7x7 stride 2, 3->64, 224 px, batch 64) and the ResNet-18 CIFAR stem (3x3
stride 1, 3->64, 32 px, batch 128), NCHW and channels_last.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels  # noqa: E402
from kernels import conv_dgrad as cd  # noqa: E402
from bench.timing import cudnn_flags, graph_replay_us  # noqa: E402

SHAPES = [("resnet50 stem 7x7s2 3->64 224px b64", 64, 7, 2, 3, 224),
          ("resnet18 cifar stem 3x3s1 3->64 32px b128", 128, 3, 1, 1, 32)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--replays", type=int, default=10)
    a = p.parse_args()
    dev = torch.device("cuda")
    tree = kernels.get("conv_dgrad", "tree")
    gen = torch.Generator(device=dev).manual_seed(5)
    for name, n, k, stride, pad, size in SHAPES:
        out = (size + 2 * pad - k) // stride + 1
        w = torch.randn(64, 3, k, k, device=dev, generator=gen)
        for layout in ("nchw", "channels_last"):
            dy = torch.randn(n, 64, out, out, device=dev, generator=gen)
            if layout == "channels_last":
                dy = dy.contiguous(memory_format=torch.channels_last)
            kw = dict(input_size=(size, size), stride=stride, padding=pad, dilation=1)
            x_like = torch.empty(n, 3, size, size, device=dev)

            def torch_dgrad():
                return torch.ops.aten.convolution_backward(dy, x_like, w, None, (stride, stride), (pad, pad), (1, 1),
                                                           False, (0, 0), 1, (True, False, False))[0]

            row = {}
            with cudnn_flags(True, False):
                row["cudnn_fastest"] = graph_replay_us(torch_dgrad, calls=a.calls, replays=a.replays)
            with cudnn_flags(False, True):
                row["cudnn_det"] = graph_replay_us(torch_dgrad, calls=a.calls, replays=a.replays)
            with cudnn_flags(False, False):
                first = tree(w, dy, **kw)
                g = cd._check(w, dy, kw["input_size"], stride, pad, 1)
                default = cd.tree_plan(g, tuple(dy.stride())).kernel
                row[f"tree default ({default})"] = graph_replay_us(lambda: tree(w, dy, **kw), calls=a.calls,
                                                                   replays=a.replays)
                for px in cd.STEM_PIXELS:
                    for nc in (3, 4):
                        plan = (lambda g, st, px=px, nc=nc: cd.stem_launch_plan(g, st, pixels=px, channels=nc))
                        run = (lambda plan=plan: cd._run(plan, w, dy, kw["input_size"], stride, pad, 1))
                        same = torch.equal(run().view(torch.int32), first.view(torch.int32))
                        us = graph_replay_us(run, calls=a.calls, replays=a.replays)
                        row[f"p{px} c{nc}{'' if same else ' BITS DIFFER'}"] = us
            print(f"{name}, {layout}, {torch.cuda.get_device_name()}: "
                  + ", ".join(f"{key} {us:.1f} us" for key, us in row.items()), flush=True)


if __name__ == "__main__":
    main()
