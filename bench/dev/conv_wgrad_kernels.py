"""conv_wgrad's kernel choices on a CUDA machine: per weight-gradient shape, tree and atomic under each setting of
the wide tiles (WIDE in kernels/conv_wgrad.py) and of the cp.async stages (STAGES) beside cuDNN's fastest
algorithm, and whether tree's bits stay those of the first setting (they must: neither changes the plan).

    python3 bench/dev/conv_wgrad_kernels.py [--wide ,t64w,t64m,auto] [--stages 0,3] [--shapes m64|all]
                                            [--repeats 20] [--layouts nchw,cl]

"us": the median over repeats of CUDA-event time around 10 back-to-back calls, divided by 10.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels import conv_wgrad  # noqa: E402
from bench.timing import back_to_back_us, cudnn_flags  # noqa: E402

# (name, batch, Cin, Cout, H, kernel, stride, padding): the M <= 64 weight gradients of torchvision's
# resnet18 (batch 128) and resnet50 (batch 64) at 224 px and of the CIFAR ResNet-18 (batch 128)
SHAPES = [
    ("r18_224 7x7s2 3->64 224", 128, 3, 64, 224, 7, 2, 3),
    ("r18_224 3x3 64->64 56", 128, 64, 64, 56, 3, 1, 1),
    ("r50_224 3x3 64->64 56", 64, 64, 64, 56, 3, 1, 1),
    ("r50_224 1x1 256->64 56", 64, 256, 64, 56, 1, 1, 0),
    ("cifar 3x3 64->64 32", 128, 64, 64, 32, 3, 1, 1),
]
# the other weight gradients of torchvision's resnet18 at 224 px, batch 128
SHAPES_R18 = [
    ("r18_224 3x3s2 64->128 56", 128, 64, 128, 56, 3, 2, 1),
    ("r18_224 3x3 128->128 28", 128, 128, 128, 28, 3, 1, 1),
    ("r18_224 1x1s2 64->128 56", 128, 64, 128, 56, 1, 2, 0),
    ("r18_224 3x3s2 128->256 28", 128, 128, 256, 28, 3, 2, 1),
    ("r18_224 3x3 256->256 14", 128, 256, 256, 14, 3, 1, 1),
    ("r18_224 3x3s2 256->512 14", 128, 256, 512, 14, 3, 2, 1),
    ("r18_224 3x3 512->512 7", 128, 512, 512, 7, 3, 1, 1),
]


@contextlib.contextmanager
def setting(wide: str, stages: int):
    saved = conv_wgrad.WIDE, conv_wgrad.STAGES
    conv_wgrad.WIDE, conv_wgrad.STAGES = wide, stages
    try:
        yield
    finally:
        conv_wgrad.WIDE, conv_wgrad.STAGES = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wide", default=",t64w,t64m,auto", help="comma-separated WIDE settings ('' = 64x64 tiles)")
    ap.add_argument("--stages", default=str(conv_wgrad.STAGES), help="comma-separated STAGES settings")
    ap.add_argument("--shapes", choices=("m64", "all"), default="m64",
                    help="m64: the M <= 64 shapes; all: those and the rest of resnet18's at 224 px")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layouts", default="nchw,cl")
    args = ap.parse_args()
    if not kernels.cuda_available():
        print("conv_wgrad_kernels: needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    choices = [(w, int(st)) for w in args.wide.split(",") for st in args.stages.split(",")]
    tree, atomic = kernels.get("conv_wgrad", "tree"), kernels.get("conv_wgrad", "atomic")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    failures = 0
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, n, cin, cout, h, k, s, p in SHAPES + (SHAPES_R18 if args.shapes == "all" else []):
        for layout in args.layouts.split(","):
            x = torch.randn(n, cin, h, h, device=dev, generator=gen)
            oh = (h + 2 * p - k) // s + 1
            dy = torch.randn(n, cout, oh, oh, device=dev, generator=gen)
            if layout == "cl":
                x, dy = x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last)
            kw = dict(kernel_size=k, stride=s, padding=p)
            w = torch.empty(cout, cin, k, k, device=dev)

            def cudnn():
                return torch.ops.aten.convolution_backward(dy, x, w, None, (s, s), (p, p), (1, 1), False, (0, 0), 1,
                                                           (False, True, False))[1]
            with cudnn_flags(True, False):
                fast = back_to_back_us(cudnn, calls=10, repeats=args.repeats, warmup=3)
            pl = conv_wgrad.plan(cout, cin * k * k, n * oh * oh)
            line = f"{name:<26} {layout:<4} plan t{pl.tile} S{pl.splits} Kc{pl.chunk}  cudnn {fast:8.1f}"
            ref = None
            for wd, st in choices:
                with setting(wd, st):
                    out = tree(x, dy, **kw)
                    if ref is None:
                        ref = out
                    same = torch.equal(out, ref)
                    failures += not same
                    tt = back_to_back_us(lambda: tree(x, dy, **kw), calls=10, repeats=args.repeats, warmup=3)
                    ta = back_to_back_us(lambda: atomic(x, dy, **kw), calls=10, repeats=args.repeats, warmup=3)
                line += (f" | {wd or 't64'}/{st}: tree {tt:8.1f} ({tt / fast:.2f}x) atomic {ta:8.1f}"
                         f"{'' if same else ' BITS DIFFER'}")
            print(line, flush=True)
    print(f"{failures} failure(s): tree bits that changed with the kernel choice")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
