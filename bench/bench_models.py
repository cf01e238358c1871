"""Whole-model CPU timing: one training epoch of the ``small`` ResNet (stock PyTorch, no kernel routing).

Reported by pytest-benchmark, never asserted: a wall-clock limit in a unit test fails on a busy machine
(20.5 s against a 20 s limit) without anything being wrong. Run with ``pytest --benchmark-only bench/bench_models.py``.
Measured: median 4.6 s per epoch (3 rounds, 4.4-7.0 s) with 2 threads on a 2-core AMD EPYC VM, torch 2.13
CPU; 8.3 s (105 ms/step) on an earlier idle 2-core machine.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from nnrand.models import build_model

EPOCH_IMAGES = 10_000  # the synthetic training set
BATCH = 128
STEPS = -(-EPOCH_IMAGES // BATCH)  # 79 SGD steps per epoch
WARMUP_STEPS = 2       # allocator and oneDNN primitive caches
ROUNDS = 3             # epochs timed


def test_small_epoch_cpu(benchmark):
    """``STEPS`` SGD steps (forward, cross-entropy, backward, momentum update) of ``small`` on one seeded
    batch of 128 32x32 images, at torch's default CPU thread count. ``extra_info`` has the thread count
    and the median process CPU time per epoch, all threads (less sensitive to other load than wall time)."""
    torch.manual_seed(0)
    net = build_model("small", 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    cpu_s = []

    def epoch():
        t0 = time.process_time()
        for _ in range(STEPS):
            step()
        cpu_s.append(time.process_time() - t0)

    for _ in range(WARMUP_STEPS):
        step()
    benchmark.pedantic(epoch, rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(model="small", device="cpu", threads=torch.get_num_threads(), batch=BATCH,
                                steps=STEPS, cpu_s_per_epoch=sorted(cpu_s)[len(cpu_s) // 2])
