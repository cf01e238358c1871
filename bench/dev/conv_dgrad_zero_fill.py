"""conv_dgrad tree on the 1x1 stride-2 shapes (batch 128, both layouts), CUDA: phases no tap reaches
zeroed by a memset before the launch or by the kernel's own stores (EMPTY_ZEROS), GPU time per call
(CUDA events, L2 flushed, median of 30) beside atomic and cuDNN, and whether both give the same bits.

    PYTHONPATH=. python bench/dev/conv_dgrad_zero_fill.py
"""
import sys

import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
from kernels import conv_dgrad as cd  # noqa: E402
from bench.timing import cuda_event_times, L2Flush, median, cudnn_flags  # noqa: E402

dev = torch.device("cuda")
spec = kernels.spec("conv_dgrad")
peer = spec.peers()["torch"]
flush = L2Flush(dev)
A = kernels.get("conv_dgrad", "atomic"); T = kernels.get("conv_dgrad", "tree")
def t(fn):
    return median(cuda_event_times(fn, 30, dev, flush=flush)) * 1e6
for case in [c for c in spec.bench_cases("gpu") if "1x1s2" in c.name]:
    (w, dy), kw = spec.make_inputs(case, dev)
    with cudnn_flags(True, False):
        peer(w, dy, **kw); cud = t(lambda: peer(w, dy, **kw))
    a = t(lambda: A(w, dy, **kw))

    res = {}
    try:
        for memset in (True, False):
            cd.EMPTY_ZEROS = "memset" if memset else "kernel"
            res[memset] = (T(w, dy, **kw), t(lambda: T(w, dy, **kw)))
    finally:
        cd.EMPTY_ZEROS = "auto"
    same = torch.equal(res[True][0], res[False][0])
    tr, tz = res[True][1], res[False][1]
    print(f"{case.name}: cudnn {cud:.1f} atomic {a:.1f} tree(fill) {tr:.1f} tree(in-kernel zeros) {tz:.1f} same {same}; ratios {tr/a:.2f} {tz/a:.2f}", flush=True)
