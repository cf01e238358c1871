"""Where a CPU training step of the default CPU model goes: stock kernels against the CPU order models.

    python bench/dev/cpu_step_profile.py [--model small] [--batch 64] [--steps 10] [--top 15]

Times ``--steps`` SGD steps (after 3 warm-up steps) on random seeded 32x32 batches under
``use_kernels("native")`` and ``use_kernels("tree")`` (whose backward runs the order models on a CPU), then
prints cProfile's top functions by own time over the tree steps: what `python -m nnrand.train --kernel
tree` spends its minute on.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nnrand  # noqa: E402
from nnrand import models  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    model = models.build_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for mode in ("native", "tree"):
        with nnrand.use_kernels(mode):
            for _ in range(3):
                step()
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            print(f"{args.model} batch {args.batch} {mode:<6} {(time.perf_counter() - t) / args.steps * 1e3:7.1f} "
                  f"ms/step ({torch.get_num_threads()} threads)")
    prof = cProfile.Profile()
    with nnrand.use_kernels("tree"):
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    print(f"cProfile over {args.steps} tree steps, by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
