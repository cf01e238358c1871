"""Several GPUs (NCCL): --world-invariant gives the bits of one GPU on two; DDP with tree kernels repeats
bitwise. Skipped on machines with fewer than two GPUs."""
from __future__ import annotations

import pytest
import torch

from tests.test_distributed import result_of, torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

GPU = ["--device", "cuda", "--model", "resnet18", "--n-train", "1024", "--n-test", "256", "--batch-size", "64"]


def test_world_invariant_on_one_and_two_gpus(tmp_path):
    runs = {}
    for n in (1, 2):
        r = torchrun(n, tmp_path / f"w{n}", *GPU, "--world-invariant", "--micro-batch", "16")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = result_of(tmp_path / f"w{n}")
    assert runs[1]["final_checksum"] == runs[2]["final_checksum"]
    assert runs[1]["logits_hash"] == runs[2]["logits_hash"]


def test_ddp_with_tree_kernels_repeats(tmp_path):
    sums = []
    for i in range(2):
        r = torchrun(2, tmp_path / f"r{i}", *GPU)
        assert r.returncode == 0, r.stderr[-3000:]
        sums.append(result_of(tmp_path / f"r{i}")["final_checksum"])
    assert sums[0] == sums[1]
