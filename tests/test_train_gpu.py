"""nnrand.train on the GPU: cuDNN's heuristic mode b (--cudnn-heuristic) in fresh processes repeats bitwise
and is recorded; a process already on CUDA under another mode refuses it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnrand import noise, runio, train

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent


def test_heuristic_b_repeats_bitwise_and_is_recorded(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != noise.HEURISTIC_ENV}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    sums = []
    for name in ("first", "second"):
        # ResNet-18 at batch 64: the shape where the two heuristics pick different forward algorithms
        argv = ["--device", "cuda", "--kernel", "tree", "--model", "resnet18", "--batch-size", "64", "--n-train",
                "256", "--n-test", "64", "--epochs", "1", "--cudnn-heuristic", "b", "--no-progress", "--no-report",
                "--no-resume", "--out", str(tmp_path), "--name", name]
        run = subprocess.run([sys.executable, "-m", "nnrand.train", *argv], capture_output=True, text=True, env=env,
                             cwd=REPO, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        member = runio.member_dir(tmp_path, name, 0)
        meta = runio.read_json(member / "config.json")
        assert meta["config"]["cudnn_heuristic"] == "b" and meta["flags"]["cudnn_heuristic"] == "b"
        sums.append(json.loads((member / "result.json").read_text())["final_checksum"])
    assert sums[0] == sums[1]


def test_a_process_on_cuda_refuses_another_heuristic(tmp_path, monkeypatch):
    torch.zeros(1, device="cuda")   # CUDA in use: torch may have read the variable already
    monkeypatch.delenv(noise.HEURISTIC_ENV, raising=False)
    cfg = dict(out=str(tmp_path), name="b", device="cuda", model="small", n_train=32, n_test=16, batch_size=16,
               epochs=1, progress=False, report=False, cudnn_heuristic="b")
    with pytest.raises(train.ConfigError, match=f"already uses CUDA under cuDNN heuristic instant.*{noise.HEURISTIC_ENV}=1"):
        train.main(cfg)
    assert noise.cudnn_heuristic_now() == "instant" and not (tmp_path / "b").exists()
