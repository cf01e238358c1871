"""conv_wgrad split plans on chosen shapes (default: the 1x1 stride-2 ones; pass name fragments to pick
others), CUDA: for tile 128 or 64 and 8-64 splits, GPU time per call (CUDA events, L2 flushed, median of
30) of atomic and of tree with the separate and the fused combine, against cuDNN (benchmark mode, TF32
off) and the default plan.

    PYTHONPATH=. python bench/dev/conv_wgrad_plan_sweep.py [name fragment ...]
"""
import itertools
import sys

import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
from kernels import conv_wgrad as cw  # noqa: E402
from bench.timing import cuda_event_times, L2Flush, median, cudnn_flags  # noqa: E402

dev = torch.device("cuda")
spec = kernels.spec("conv_wgrad")
peer = spec.peers()["torch"]
flush = L2Flush(dev)
names = sys.argv[1:] or ["conv1x1s2"]
cases = [c for c in spec.bench_cases("gpu") if any(n in c.name for n in names)]
orig = cw.plan
A = kernels.get("conv_wgrad", "atomic"); T = kernels.get("conv_wgrad", "tree")
def t(fn):
    return median(cuda_event_times(fn, 30, dev, flush=flush)) * 1e6
for case in cases:
    (x, dy), kw = spec.make_inputs(case, dev)
    g = cw._check(x, dy, kw["kernel_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
    with cudnn_flags(True, False):
        peer(x, dy, **kw); cud = t(lambda: peer(x, dy, **kw))
    p0 = orig(g.m, g.r, g.k)
    ref = T(x, dy, **kw).double()
    print(f"{case.name} m{g.m} r{g.r} k{g.k} default plan {p0}: cudnn {cud:.1f}", flush=True)
    for tile, S in itertools.product((128, 64), (8, 16, 32, 64)):
        chunk = -(-(-(-g.k // S)) // 16) * 16
        S2 = -(-g.k // chunk)
        p = cw.Plan(tile, S2, chunk)
        cw.plan = lambda m, r, k, split=True, p=p: p
        res = {}
        try:
            res["atomic"] = t(lambda: A(x, dy, **kw))
            for mode in ("separate", "fused"):
                cw.FUSE = mode
                out = T(x, dy, **kw)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                res[mode] = t(lambda: T(x, dy, **kw))
        finally:
            cw.plan = orig; cw.FUSE = "auto"
        blocks = -(-g.m // tile) * -(-g.r // tile) * S2
        print(f"  tile {tile} S {S2} chunk {chunk} blocks {blocks}: " + " ".join(f"{k} {v:.1f}" for k, v in res.items())
              + f"  sep/atomic {res['separate']/res['atomic']:.2f} fused/atomic {res['fused']/res['atomic']:.2f} best/cudnn {min(res['separate'], res['fused'])/cud:.2f} err {err:.1e}", flush=True)
