"""What the embedding gradient's sums kernel costs apart from its work (CUDA machine): embedding_bwd's
sorted variant per index pattern (Zipf, uniform, all distinct, one hot row) and per gradient size, each
kernel's time from torch.profiler (bench/dev/segsum_phases.py's kernel_times). The sums kernel's time
barely follows the tokens (256 or 2048) and grows with the zero fill before it (the fill's writes still
draining from L2 when the sums read).

    PYTHONPATH=. python bench/dev/segsum_sums_floor.py
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench/dev")
import kernels  # noqa: E402
from nnrand.audit import _zipf  # noqa: E402
from segsum_phases import kernel_times  # noqa: E402


def patterns(dev: torch.device) -> None:
    """2048 tokens (256 for one) into a 32000 x 768 gradient, per index pattern."""
    V, D = 32000, 768
    f = kernels.get("embedding_bwd", "sorted")
    g = torch.Generator().manual_seed(4)
    cases = {
        "zipf 2048": _zipf(g, 2048, V), "uniform 2048": torch.randint(0, V, (2048,), generator=g),
        "distinct 2048": (torch.arange(2048) * 13) % V, "zipf 256": _zipf(g, 256, V),
        "one row x 32 then distinct": torch.cat([torch.zeros(32, dtype=torch.long), torch.arange(1, 2017) * 13 % V]),
        "one row x 293 then distinct": torch.cat([torch.zeros(293, dtype=torch.long), torch.arange(1, 1756) * 13 % V]),
    }
    for name, idx in cases.items():
        idx = idx.to(dev)
        grad = torch.randn(idx.numel(), D, generator=g).to(dev)
        kt = kernel_times(lambda: f(grad, idx, num_weights=V, check_range=False), 20)
        print(f"{name:28s} " + ", ".join(f"{k} {v:.1f}" for k, v in kt.items()), flush=True)


def sizes(dev: torch.device) -> None:
    """Zipf tokens into gradients of 3 to 98 MB."""
    f = kernels.get("embedding_bwd", "sorted")
    g = torch.Generator().manual_seed(4)
    for V, D, n in ((32000, 768, 256), (1000, 768, 256), (4000, 768, 256), (16000, 768, 256), (32000, 768, 2048),
                    (2000, 768, 2048)):
        idx = _zipf(g, n, V).to(dev)
        grad = torch.randn(n, D, generator=g).to(dev)
        kt = kernel_times(lambda: f(grad, idx, num_weights=V, check_range=False), 20)
        print(f"V {V:6d} D {D} n {n:5d} ({V * D * 4 / 1e6:5.1f} MB) "
              + ", ".join(f"{k} {v:.1f}" for k, v in kt.items()), flush=True)


if __name__ == "__main__":
    device = torch.device("cuda")
    patterns(device)
    sizes(device)
