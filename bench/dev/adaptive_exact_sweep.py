"""adaptive_avg_pool2d_bwd on the H200 benchmark shapes: atomic, tree (the launcher's choice: exact where
the windows tile the input, else tiled), the tiled kernel alone and the direct kernel alone; GPU time per
call (median of 30, CUDA events behind a spin kernel, L2 flushed), and whether direct and tiled agree.

    PYTHONPATH=. python3 bench/dev/adaptive_exact_sweep.py
"""
import statistics, torch
from kernels import adaptive_avg_pool2d_bwd as m
from bench.timing import cuda_event_times, L2Flush
dev = torch.device("cuda")
flush = L2Flush(dev)
def t_us(fn):
    for _ in range(3): fn()
    return statistics.median(cuda_event_times(fn, 30, dev, flush)) * 1e6

cases = [(64, 512, 14, 7, "nchw"), (64, 512, 14, 7, "channels_last"), (64, 512, 13, 7, "nchw"),
         (64, 512, 25, 7, "nchw"), (64, 512, 25, 7, "channels_last"), (64, 512, 7, 1, "nchw"),
         (64, 512, 7, 1, "channels_last"), (64, 64, 4, 28, "nchw")]
for n, c, h, o, layout in cases:
    g = torch.Generator(device=dev).manual_seed(0)
    dy = torch.randn(n, c, o, o, device=dev, generator=g).contiguous(memory_format=m.memory_format(layout))
    row = {}
    row["atomic"] = t_us(lambda: m.adaptive_avg_pool2d_bwd_atomic_cuda(dy, input_size=(h, h)))
    row["tree"] = t_us(lambda: m.adaptive_avg_pool2d_bwd_tree_cuda(dy, input_size=(h, h)))
    row["tiled"] = t_us(lambda: m.adaptive_avg_pool2d_bwd_tree_tiled_cuda(dy, input_size=(h, h)))
    row["direct"] = t_us(lambda: m.adaptive_avg_pool2d_bwd_tree_direct_cuda(dy, input_size=(h, h)))
    ref = m.adaptive_avg_pool2d_bwd_tree_cuda(dy, input_size=(h, h))
    same = torch.equal(ref, m.adaptive_avg_pool2d_bwd_tree_direct_cuda(dy, input_size=(h, h)))
    print(f"{n}x{c} {h}->{o} {layout}: plan {m.tree_plan(n, c, h, h, o, o, layout)}, direct==tiled {same}")
    print("   " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
