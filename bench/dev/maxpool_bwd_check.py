"""maxpool_bwd on a CUDA machine: correctness of every variant against its CPU model and float64, run-to-run
spread, and GPU time beside torch's own max_pool2d backward. Prints one table; --out writes the rows as
JSON with the environment fingerprint.

    PYTHONPATH=. python bench/dev/maxpool_bwd_check.py [--scale gpu|quick] [--repeats 50] [--out rows.json]

Timing: the stream is first held by a long ``torch.cuda._sleep`` so that the host enqueues every timed
call before the GPU reaches them; each call is bracketed by CUDA events and the median is reported
(GPU time only, launch overhead hidden). ``backlog`` says whether the sleep outlasted the enqueueing (if
not, gaps may have inflated the times). ``wall`` is the host-inclusive time per call of 200 calls in a
row, synchronized at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import kernels  # noqa: E402
from kernels import maxpool_bwd as mp  # noqa: E402
from nnrand.fingerprint import row_fingerprint  # noqa: E402

OP = "maxpool_bwd"
SLEEP_CYCLES = 80_000_000  # ~40 ms at 1.98 GHz: longer than enqueueing one round of timed calls
ROUND = 100                # timed calls per round


@contextlib.contextmanager
def torch_settings():
    """cuDNN autotuning on, TF32 off, for the duration; the previous flags are put back."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.allow_tf32) = saved


def gpu_times(fn, rounds: int = 3) -> tuple[float, bool]:
    """Median GPU microseconds per call, and whether the backlog held in every round."""
    fn()
    torch.cuda.synchronize()
    times, backlog = [], True
    for _ in range(rounds):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(ROUND)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(ROUND)]
        torch.cuda._sleep(SLEEP_CYCLES)
        marker = torch.cuda.Event()
        marker.record()
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        backlog &= not marker.query()  # still sleeping: every call was queued before the GPU got to it
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return statistics.median(times), backlog


def wall_time(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def distinct(fn, repeats: int) -> int:
    uniques: list[torch.Tensor] = []
    for _ in range(repeats):
        out = fn()
        if not any(torch.equal(out, u) for u in uniques):
            uniques.append(out)
    return len(uniques)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().reshape(-1).numpy().view(np.uint32)


def check(name: str, out: torch.Tensor, cpu_args, kw, tree_model: torch.Tensor, count, abs_sum, ref) -> tuple[str, float]:
    """'bitwise' (equal to tree's CPU model, which every deterministic variant must be), 'some-order'
    (atomic, or a peer: every element the sum in a possible order), or
    'FAIL: ...'; and the largest error / bound ratio over elements with a nonzero bound."""
    err = np.abs(out.detach().cpu().contiguous().reshape(-1).numpy().astype(np.float64) - ref)
    bound = mp.error_bound(count, abs_sum)
    outside = int(np.sum(err > bound))
    nz = bound > 0
    ratio = float(np.max(err[nz] / bound[nz])) if nz.any() else 0.0
    if outside:
        return f"FAIL: {outside} elements outside the bound", ratio
    if np.array_equal(bits(out), bits(tree_model)):
        return "bitwise", ratio
    if name in {v.name for v in kernels.variants(OP) if v.deterministic} | {"tree_gather"}:
        return f"FAIL: differs from its CPU model at {int(np.sum(bits(out) != bits(tree_model)))} elements", ratio
    try:
        _check_some_order(out, tree_model, cpu_args, kw, count)
    except AssertionError as e:
        return f"FAIL: {e}", ratio
    return "some-order", ratio


def _check_some_order(out, tree_model, cpu_args, kw, count):
    r, t = bits(out), bits(tree_model)
    few = count <= 2
    assert np.array_equal(r[few], t[few]), "elements with <= 2 contributions differ from tree"
    _, _, vals, start = mp.contributions(*cpu_args, **kw)
    for k in (3, 4, 5):
        els = np.nonzero(count == k)[0]
        if els.size:
            cands = mp.possible_sums(vals, start, count, els).view(np.uint32)
            ok = np.any(cands == r[els][:, None], axis=1)
            assert ok.all(), f"{int(np.sum(~ok))} elements with {k} contributions match no order"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="gpu", choices=("gpu", "quick"))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--only", default="", help="comma-separated substrings: run the cases whose name has one")
    args = ap.parse_args(argv)
    if not kernels.cuda_available():
        print("needs a CUDA device and CuPy", file=sys.stderr)
        return 2
    spec = kernels.spec(OP)
    dev = torch.device("cuda")
    env = row_fingerprint()
    print(env)
    rows = []
    with torch_settings():
        only = [o for o in args.only.split(",") if o]
        for case in spec.bench_cases(args.scale):
            if only and not any(o in case.name for o in only):
                continue
            cpu_args, kw = spec.make_inputs(case, torch.device("cpu"))
            gpu_args, _ = spec.make_inputs(case, dev)
            layout = case.params["layout"]
            tree_model = kernels.get(OP, "tree")(*cpu_args, **kw)
            ref = spec.reference(cpu_args, kw).reshape(-1).numpy()
            count, abs_sum, _, _ = mp.contributions(*cpu_args, **kw)
            collide = int(np.sum(count >= 3))
            fns = {v.name: (lambda v=v: v(*gpu_args, **kw)) for v in kernels.variants(OP)}
            # tree's fallback kernel (global gather), timed beside the tiled one; same bits as tree.
            fns["tree_gather"] = lambda: mp.maxpool_bwd_tree_gather_cuda(*gpu_args, **kw)
            for peer, f in spec.peers().items():
                fns[peer] = lambda f=f: f(*gpu_args, **kw)
            results = {}
            for name, fn in fns.items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    status, ratio = check(name, out, cpu_args, kw, tree_model, count, abs_sum, ref)
                    n_distinct = distinct(fn, args.repeats)
                    t_gpu, backlog = gpu_times(fn)
                    t_wall = wall_time(fn)
                    torch.cuda.synchronize()
                except Exception as e:  # one failing variant must not hide the others' figures
                    status, ratio, n_distinct, t_gpu, backlog, t_wall = f"ERROR {type(e).__name__}: {e}", \
                        float("nan"), -1, float("nan"), False, float("nan")
                results[name] = t_gpu
                print(f"  {case.name} {name}: {status[:60]}, {n_distinct}/{args.repeats} distinct, "
                      f"{t_gpu:.2f} us", flush=True)
                rows.append({"op": OP, "case": case.name, "layout": layout, "contention": case.contention,
                             "collide3": collide, "variant": name, "check": status, "err_over_bound": ratio,
                             "distinct": n_distinct, "repeats": args.repeats, "gpu_us": t_gpu,
                             "backlog": backlog, "wall_us": t_wall,
                             "gbps": spec.bytes_moved(case) / (t_gpu * 1e-6) / 1e9, **env})
            for r in rows[-len(fns):]:
                r["vs_atomic"] = r["gpu_us"] / results["atomic"]
                r["vs_torch"] = r["gpu_us"] / results["torch"]
    hdr = ("case", "variant", "cont", "n>=3", "check", "err/bnd", "distinct", "gpu_us", "GB/s", "x atomic",
           "x torch", "wall_us", "backlog")
    fmt = "{:<36} {:<11} {:>6} {:>7} {:<12} {:>7} {:>8} {:>8} {:>7} {:>8} {:>7} {:>8} {:>7}"
    print(fmt.format(*hdr))
    for r in rows:
        print(fmt.format(r["case"], r["variant"], f"{r['contention']:.1f}", r["collide3"], r["check"][:12],
                         f"{r['err_over_bound']:.2f}", f"{r['distinct']}/{r['repeats']}", f"{r['gpu_us']:.2f}",
                         f"{r['gbps']:.0f}", f"{r['vs_atomic']:.3f}", f"{r['vs_torch']:.3f}", f"{r['wall_us']:.1f}",
                         str(r["backlog"])))
    for r in rows:
        if not r["check"].startswith(("bitwise", "some-order")):
            print(f"{r['case']} {r['variant']}: {r['check']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 1 if any(r["check"].startswith(("FAIL", "ERROR")) for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
