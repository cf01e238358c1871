"""Several GPUs (NCCL): --world-invariant gives the bits of one GPU on two (and on four where the machine
has them), eager or with each micro-batch a graph replay; DDP with tree kernels repeats bitwise, eager or captured in a CUDA graph. Skipped on machines
with fewer than two GPUs."""
from __future__ import annotations

import pytest
import torch

from nnrand import runio
from tests.test_distributed import result_of, torchrun

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

GPU = ["--device", "cuda", "--model", "resnet18", "--n-train", "1024", "--n-test", "256", "--batch-size", "64"]


def test_world_invariant_on_one_two_and_four_gpus_eager_and_captured(tmp_path):
    """The same bits on 1, 2 and (where the machine has them) 4 GPUs: 4 micro-batches of 16 per step,
    each micro-batch run eagerly or as a replay of one captured graph (--cuda-graph)."""
    runs = {}
    for n in (w for w in (1, 2, 4) if w <= torch.cuda.device_count()):
        for mode, extra in (("eager", []), ("graph", ["--cuda-graph"])):
            out = tmp_path / f"w{n}_{mode}"
            r = torchrun(n, out, *GPU, "--world-invariant", "--micro-batch", "16", *extra)
            assert r.returncode == 0, r.stderr[-3000:]
            runs[n, mode] = result_of(out)
            meta = runio.read_json(runio.member_dir(out, "run", 0) / "config.json")
            assert meta["config"]["cuda_graph"] is bool(extra) and runs[n, mode]["world_size"] == n
    assert len({r["final_checksum"] for r in runs.values()}) == 1, runs
    assert len({r["logits_hash"] for r in runs.values()}) == 1, runs


def test_ddp_with_tree_kernels_repeats_and_its_cuda_graph_gives_the_same_bits(tmp_path):
    """Two eager DDP runs and two whose step is one captured graph (DDP's all-reduces inside): one
    checksum and one logits hash. On two ranks every all-reduced element is one addition of two terms,
    so DDP's bucket layout (rebuilt after its first step, before the capture) cannot change a bit."""
    runs = {}
    for name, extra in (("eager0", []), ("eager1", []), ("graph0", ["--cuda-graph"]), ("graph1", ["--cuda-graph"])):
        r = torchrun(2, tmp_path / name, *GPU, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = result_of(tmp_path / name)
        meta = runio.read_json(runio.member_dir(tmp_path / name, "run", 0) / "config.json")
        assert meta["config"]["cuda_graph"] is bool(extra) and runs[name]["world_size"] == 2
    assert len({r["final_checksum"] for r in runs.values()}) == 1, runs
    assert len({r["logits_hash"] for r in runs.values()}) == 1, runs
