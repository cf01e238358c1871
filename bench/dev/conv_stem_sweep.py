"""conv_dgrad tree_stem on the ResNet-18 stems (3x3 and 7x7 stride 2, batch 128, both layouts), CUDA: GPU
time per call from CUDA-graph replays for several threads-per-block settings (STEM_BLOCK), beside the
atomic variant and cuDNN (benchmark mode, TF32 off), with each result's max error relative to float64.

    PYTHONPATH=. python bench/dev/conv_stem_sweep.py
"""
import sys

import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
from kernels import conv_dgrad as cd  # noqa: E402
from bench.timing import graph_replay_us, cudnn_flags  # noqa: E402

dev = torch.device("cuda")
spec = kernels.spec("conv_dgrad")
peer = spec.peers()["torch"]
cases = [c for c in spec.bench_cases("gpu") if "stem" in c.name]
for case in cases:
    (w, dy), kw = spec.make_inputs(case, dev)
    with cudnn_flags(benchmark=False, deterministic=True):
        ref = peer(w.double(), dy.double(), **kw)
    res = {}
    with cudnn_flags(True, False):
        res["cudnn"] = graph_replay_us(lambda: peer(w, dy, **kw), calls=10, replays=10)
    A = kernels.get("conv_dgrad", "atomic"); T = kernels.get("conv_dgrad", "tree")
    res["atomic"] = graph_replay_us(lambda: A(w, dy, **kw), calls=10, replays=10)
    for blk in (64, 128, 256):
        cd.STEM_BLOCK = blk
        cd._tree_plan.cache_clear()
        plan = cd.tree_plan(cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1)), tuple(dy.stride()))
        try:
            out = T(w, dy, **kw); torch.cuda.synchronize()
        except Exception as e:
            print(case.name, blk, "fail", e); continue
        err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
        us = graph_replay_us(lambda: T(w, dy, **kw), calls=10, replays=10)
        res[f"tree b{blk}"] = us
        print(f"{case.name} {plan.kernel} grid {plan.grid} block {plan.block} smem {plan.shared}: {us:.1f} us  relerr {err:.2e}", flush=True)
    print(case.name, {k: round(v, 1) for k, v in res.items()}, flush=True)
