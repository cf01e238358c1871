"""What PyTorch's deterministic mode costs by itself, and inside nnrand's tree routing.

    python3 bench/dev/det_mode_cost.py --model resnet20 --size 32 --batch 128

Times an SGD step (median of CUDA-event timed steps after a warm-up, channels_last off) and the forward
alone under: native (cudnn.benchmark); native + cudnn.deterministic; native +
torch.use_deterministic_algorithms(True) (uninitialised-memory fill off, as nnrand runs it); tree as
``use_kernels`` runs it (deterministic mode on); and tree with deterministic mode left off (a
measurement only: that configuration does not make the ops nnrand passes on deterministic). TF32 off.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nnrand  # noqa: E402
from nnrand import models, noise, routing  # noqa: E402


@contextlib.contextmanager
def flags(cudnn_det: bool = False, torch_det: bool = False):
    from torch.utils import deterministic as det

    before = (torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled(),
              det.fill_uninitialized_memory)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.use_deterministic_algorithms(torch_det)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = before[0]
        torch.use_deterministic_algorithms(before[1])
        det.fill_uninitialized_memory = before[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet20")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):  # fp32 arithmetic: TF32 off
        torch.backends.cudnn.benchmark = True
        return run(args)


def run(args) -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda", generator=g)
    y = torch.randint(0, 10, (args.batch,), device="cuda", generator=g)

    def timed(model, fn) -> float:
        out = []
        for i in range(args.steps + 5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(model)
            b.record()
            if i >= 5:
                out.append((a, b))
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in out)

    def step(model):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    def forward(model):
        with torch.no_grad():
            model(x)

    no_det = contextlib.nullcontext
    configs = [
        ("native", lambda: flags()),
        ("native + cudnn.deterministic", lambda: flags(cudnn_det=True)),
        ("native + deterministic mode", lambda: flags(cudnn_det=True, torch_det=True)),
        ("tree (as use_kernels runs it)", lambda: nnrand.use_kernels("tree")),
    ]
    rows = []
    for name, make in configs:
        torch.manual_seed(0)
        model = models.build_model(args.model).cuda()
        with make():
            rows.append((name, timed(model, step), timed(model, forward)))
    real = routing._deterministic_mode
    routing._deterministic_mode = lambda strict: no_det()
    try:
        torch.manual_seed(0)
        model = models.build_model(args.model).cuda()
        with nnrand.use_kernels("tree"):
            rows.append(("tree, deterministic mode off", timed(model, step), timed(model, forward)))
    finally:
        routing._deterministic_mode = real
    print(f"{args.model} batch {args.batch} {args.size}px, {torch.cuda.get_device_name()}, NCHW, fp32:")
    print(f"  {'configuration':<32} {'step ms':>8} {'forward ms':>11}")
    for name, s, f in rows:
        print(f"  {name:<32} {s:8.2f} {f:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
