"""How the scatter sums (index_add, scatter_add, embedding_bwd) check their indices: ``check_range``
True/"sync" (raise after the kernels, one read back), "device" (a device-side assertion in the kernels,
no host synchronisation: what the routing uses), False/"off" (bad indices add nothing). On the GPU:
"device" gives the sync mode's bits, never synchronises (torch's sync debug mode set to "error" is the
witness, with the sync mode raising there as the negative control), is captured by a CUDA graph, and
fails the kernel naming the op and the index (in a child process: the CUDA context is lost after)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import index_add as ia
from tests.segsum_checks import check_bound
from tests.helpers import differing_bits

OPS = ("index_add", "scatter_add", "embedding_bwd")
ARG = {"index_add": "index", "scatter_add": "index", "embedding_bwd": "indices"}
CPU = torch.device("cpu")
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent


def inputs(op: str, device: torch.device, *, rows: int = 50, n: int = 3000, d: int = 24, seed: int = 3,
           bad: int | None = None, **extra):
    """(args, kwargs) for ``op``: n source rows of width d, 30% of them on one hot row; ``bad`` replaces
    one index (scatter_add: a full index, the element form)."""
    g = torch.Generator().manual_seed(seed)
    index = ia.draw_index(g, (n, d) if op == "scatter_add" else (n,), rows, 0.3)
    src = ia.draw_values(g, (n, d))
    if bad is not None:
        index.view(-1)[n // 2] = bad
    if op == "embedding_bwd":
        return (src.to(device), index.to(device)), {"num_weights": rows, **extra}
    return (index.to(device), src.to(device)), {"num_rows": rows, **extra}


def contributions(op: str, args: tuple, kw: dict):
    """(exact float64 sums, count, sum of |term|) per output element (ia.contributions)."""
    if op == "embedding_bwd":
        grad, idx = args
        return ia.contributions(idx, grad, kw["num_weights"], skip=kw.get("padding_idx", -1),
                                scaled=kw.get("scale_grad_by_freq", False))
    index, src = args
    return ia.contributions(index, src, kw["num_rows"], elementwise=op == "scatter_add")


# --------------------------------------------------------------------------------------------------
# CPU


def test_gpu_cases_take_the_binned_and_compact_fixed_schedules():
    """The GPU tests below reach scatter_add's binned fixed schedule (device assertion, no host
    synchronisation, CUDA-graph capture) through inputs()'s dense element form: keep it dense enough; and
    the row form's compact one at 8000 rows and more, direct at 50."""
    assert ia.fixed_schedule(3000 * 24, 50 * 24, elementwise=True) == "binned"
    assert ia.fixed_schedule(3000 * 24, 8000 * 24, elementwise=False, src_rows=3000) == "compact"
    assert ia.fixed_schedule(3000 * 24, 50 * 24, elementwise=False, src_rows=3000) == "direct"


def test_range_check_modes():
    assert [ia.range_check("index_add", "index", v).mode for v in (True, False, "sync", "device", "off")] == \
        ["sync", "off", "sync", "device", "off"]
    assert ia.range_check("index_add", "index", "device").trap == 1
    assert ia.range_check("index_add", "index", True).sync and not ia.range_check("index_add", "index", "device").sync
    for v in ("strict", 1, None):
        with pytest.raises(KernelArgumentError, match="argument 'check_range': expected True, False or one of"):
            ia.range_check("index_add", "index", v)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("variant", ["atomic", "sorted", "fixed"])
def test_models_validate_check_range_and_always_check(op, variant):
    """The CPU models refuse a bad check_range value and check the range whatever the mode (their sort
    needs valid keys)."""
    fn = kernels.get(op, variant)
    args, kw = inputs(op, CPU, n=40, d=3)
    with pytest.raises(KernelArgumentError, match=f"^{op}: argument 'check_range'"):
        fn(*args, **kw, check_range="never")
    args, kw = inputs(op, CPU, n=40, d=3, bad=50)
    for mode in (True, "device", "off", False):
        with pytest.raises(KernelArgumentError, match=f"argument '{ARG[op]}': index 50 is out of range for 50 rows"):
            fn(*args, **kw, check_range=mode)


# --------------------------------------------------------------------------------------------------
# GPU

# rows 8000 (more than the 3000 source rows): the fixed variant's compact schedule in the row form, whose
# zero fill runs on a second stream
GPU_CASES = [(op, v, extra) for op in OPS for v in ("sorted", "fixed", "atomic")
             for extra in ([{}, {"padding_idx": 7, "scale_grad_by_freq": True}] if op == "embedding_bwd" else [{}])] + [
    ("index_add", "fixed", {"rows": 8000}),
    ("embedding_bwd", "fixed", {"rows": 8000, "padding_idx": 7, "scale_grad_by_freq": True})]
GPU_IDS = [f"{op}-{v}" + "".join(f"-{k}-{x}" for k, x in extra.items()) for op, v, extra in GPU_CASES]


@pytest.fixture
def sync_errors():
    """torch's sync debug mode at "error" for the test's body: any host synchronisation torch makes raises."""
    try:
        yield lambda: torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("op,variant,extra", GPU_CASES, ids=GPU_IDS)
def test_gpu_device_check_never_synchronises_and_keeps_the_bits(op, variant, extra, cuda_sync, sync_errors):
    fn = kernels.get(op, variant)
    args, kw = inputs(op, CUDA, **extra)
    want = fn(*args, **kw)  # sync mode; also compiles and allocates outside the debug mode
    fn(*args, **kw, check_range="device")
    torch.cuda.synchronize()
    sync_errors()
    out = fn(*args, **kw, check_range="device")
    unchecked = fn(*args, **kw, check_range=False)
    with pytest.raises(RuntimeError, match="synchroniz"):  # negative control: the sync mode reads back
        fn(*args, **kw)
    torch.cuda.set_sync_debug_mode("default")
    if variant == "atomic":  # arrival order varies: within the summation bound of the exact sums
        exact, count, abs_sum = contributions(op, args, kw)
        check_bound(out, torch.from_numpy(exact), count, abs_sum, scaled=kw.get("scale_grad_by_freq", False))
    else:
        assert differing_bits(out, want).size == 0 and differing_bits(unchecked, want).size == 0


@pytest.mark.gpu
@pytest.mark.parametrize("op,variant,rows", [("index_add", "sorted", 50), ("index_add", "fixed", 50),
                                             ("scatter_add", "fixed", 50), ("embedding_bwd", "sorted", 50),
                                             ("embedding_bwd", "sorted", 20000), ("index_add", "sorted", 8000),
                                             ("index_add", "fixed", 8000), ("embedding_bwd", "fixed", 20000)])
def test_gpu_device_check_is_captured_by_a_cuda_graph(op, variant, rows, cuda_sync):
    """Captured once, replayed on new source values written into the captured input: eager's bits.
    20000 and 8000 rows (more than the 3000 source rows): the sorted sums' ``fill`` split and the fixed
    sums' ``compact`` schedule, whose zero fill runs on a second stream (forked and joined inside the
    capture)."""
    fn = kernels.get(op, variant)
    args, kw = inputs(op, CUDA, rows=rows)
    src_pos = 0 if op == "embedding_bwd" else 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: compilation, cached buffers
            fn(*args, **kw, check_range="device")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args, **kw, check_range="device")
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        args[src_pos].copy_(ia.draw_values(g, tuple(args[src_pos].shape)))
        graph.replay()
        assert differing_bits(out, fn(*args, **kw)).size == 0


CHILD = textwrap.dedent("""
    import sys, torch, kernels
    from tests.test_segsum_range_check import inputs
    op, variant, bad, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    args, kw = inputs(op, torch.device("cuda"), bad=bad, rows=rows)
    kernels.get(op, variant)(*args, **kw, check_range="device")
    torch.cuda.synchronize()
    print("no error")
""")


@pytest.mark.gpu
@pytest.mark.parametrize("op,variant,bad,rows", [("index_add", "atomic", 50, 50), ("index_add", "sorted", -3, 50),
                                                 ("index_add", "fixed", 77, 50), ("scatter_add", "sorted", 50, 50),
                                                 ("scatter_add", "fixed", 51, 50), ("embedding_bwd", "fixed", -1, 50),
                                                 ("embedding_bwd", "fixed", 8000, 8000)])
def test_gpu_device_check_fails_the_kernel_naming_op_and_index(op, variant, bad, rows):
    """-1 in embedding_bwd is also the "no padding row" value: it must fail, not be skipped. 8000 rows: the
    fixed variant's compact schedule."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", CHILD, op, variant, str(bad), str(rows)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "no error" not in said, said[-2000:]
    assert f"nnrand {op}: index {bad} is out of range for {rows} rows" in said, said[-2000:]
    assert "device-side assert" in said, said[-2000:]


@pytest.mark.gpu
def test_gpu_routed_scatter_sums_never_synchronise(cuda_sync, sync_errors):
    """A routed embedding backward and index_add inside torch's sync debug mode at "error"."""
    import nnrand

    g = torch.Generator(device="cuda").manual_seed(4)
    emb = torch.nn.Embedding(1000, 64).to(CUDA)
    tok = torch.randint(0, 1000, (8, 128), device=CUDA, generator=g)
    weight = torch.randn(8, 128, 64, device=CUDA, generator=g)
    idx = torch.randint(0, 100, (1024,), device=CUDA, generator=g)
    src = torch.randn(1024, 64, device=CUDA, generator=g)

    def step():
        (emb(tok) * weight).sum().backward()
        return torch.index_add(torch.zeros(100, 64, device=CUDA), 0, idx, src)

    with nnrand.use_kernels("tree") as r:
        step()  # compiles, allocates
        torch.cuda.synchronize()
        sync_errors()
        step()
        torch.cuda.set_sync_debug_mode("default")
    assert r.coverage["embedding_dense_backward"] == {"sorted": 2}
    assert r.coverage["index_add"] == {"sorted": 2}
