"""Where an eager step's host time goes, from a torch.profiler timeline (CPU ops, CUDA runtime and driver
calls, every thread): per mode, each phase's wall time on the calling thread, and in the backward, what
autograd's own threads spend inside its nodes, in the routed ops, and between them.

    python bench/dev/step_timeline.py --model torchvision:resnet18 --batch 64 --size 64 \
        --modes native torch_deterministic tree --steps 5 --trace-dir /tmp/timelines

Per mode it prints, per step (mean over the profiled steps):
  * forward / backward / optimizer: wall ms on the calling thread (profiler annotations);
  * backward: ms inside autograd nodes (top-level CPU ops of every thread during the backward),
    and the gap: the backward's wall time not inside any node there (engine work, waiting for the GIL);
  * per aten op of interest (the routed backward ops): calls, ms inside it, of which in CPU ops it calls
    (allocations, copies), in driver/runtime calls (launches) and the rest (Python, the dispatcher's
    trip into it, argument conversion);
  * the top-level nodes of the backward by ms.
Timed under the profiler, whose own cost per event (about a microsecond) is in every figure; compare modes
within one run. ``--trace-dir`` keeps each mode's Chrome trace (gzip) for a closer look.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.models import Mode, step_arguments, step_case  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
OPS = ("aten::convolution_backward", "aten::cudnn_batch_norm_backward", "aten::native_batch_norm_backward",
       "aten::max_pool2d_with_indices_backward", "aten::convolution")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def record(mode: str, args, path: Path) -> None:
    """Run ``args.warmup`` steps, then profile ``args.steps`` into a Chrome trace at ``path``."""
    model, opt, x, y = step_case(args, torch.device("cuda"))
    rf = torch.profiler.record_function

    def step():
        opt.zero_grad(set_to_none=True)
        with rf("phase.forward"):
            loss = F.cross_entropy(model(x), y)
        with rf("phase.backward"):
            loss.backward()
        with rf("phase.optimizer"):
            opt.step()
        torch.cuda.synchronize()

    with Mode(mode):
        for _ in range(args.warmup):
            step()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                step()
    prof.export_chrome_trace(str(path))


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") in HOST_CATS]


def _top_level(events: list[dict]) -> list[dict]:
    """The events of one thread not inside another (sorted by start)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _children(parent: dict, events: list[dict]) -> list[dict]:
    """The direct children of ``parent`` among ``events`` (one thread's, sorted by start)."""
    lo, hi = parent["ts"], parent["ts"] + parent["dur"]
    inside = [e for e in events if e is not parent and lo <= e["ts"] and e["ts"] + e["dur"] <= hi]
    return _top_level(inside)


def summarise(path: Path, steps: int) -> dict:
    events = _load(path)
    by_tid = defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    spans = {p: [e for e in events if e["cat"] == "user_annotation" and e["name"] == f"phase.{p}"] for p in PHASES}
    main = spans["forward"][0]["tid"]
    out = {"phases": {p: sum(e["dur"] for e in spans[p]) / steps / 1e3 for p in PHASES}}
    # the backward's threads: every thread with CPU ops inside a backward span (autograd's device threads
    # for CUDA nodes, the caller for CPU ones)
    inside_nodes = gap = 0.0
    nodes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0])   # ms, calls, in CPU ops, in driver
    for span in spans["backward"]:
        lo, hi = span["ts"], span["ts"] + span["dur"]
        busy = 0.0
        for evs in by_tid.values():
            window = [e for e in evs if lo <= e["ts"] < hi and e is not span]
            top = [e for e in _top_level(window) if e["cat"] == "cpu_op"]
            busy += sum(e["dur"] for e in top)
            for e in top:
                nodes[e["name"]][0] += e["dur"]
                nodes[e["name"]][1] += 1
            for e in window:
                if e["cat"] == "cpu_op" and e["name"] in OPS:
                    kids = _children(e, window)
                    o = ops[e["name"]]
                    o[0] += e["dur"]
                    o[1] += 1
                    o[2] += sum(k["dur"] for k in kids if k["cat"] == "cpu_op")
                    o[3] += sum(k["dur"] for k in kids if k["cat"] in ("cuda_runtime", "cuda_driver"))
        inside_nodes += busy
        gap += max(span["dur"] - busy, 0.0)
    out["backward_in_nodes"] = inside_nodes / steps / 1e3
    out["backward_gap"] = gap / steps / 1e3
    out["ops"] = {k: [v[0] / steps / 1e3, v[1] / steps, v[2] / steps / 1e3, v[3] / steps / 1e3]
                  for k, v in ops.items()}
    out["nodes"] = {k: [v[0] / steps / 1e3, v[1] / steps] for k, v in nodes.items()}
    # the forward on the calling thread: routed forward convs and everything else
    fwd_ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for span in spans["forward"]:
        lo, hi = span["ts"], span["ts"] + span["dur"]
        window = [e for e in by_tid[main] if lo <= e["ts"] < hi and e is not span]
        for e in _top_level(window):
            if e["cat"] == "cpu_op":
                fwd_ops[e["name"]][0] += e["dur"]
                fwd_ops[e["name"]][1] += 1
    out["forward_ops"] = {k: [v[0] / steps / 1e3, v[1] / steps] for k, v in fwd_ops.items()}
    return out


def report(results: dict, top: int) -> None:
    modes = list(results)
    w = 16
    print(f"  {'ms per step':<44}" + "".join(f"{m[:w - 1]:>{w}}" for m in modes))
    for p in PHASES:
        print(f"  {p + ' (wall)':<44}" + "".join(f"{results[m]['phases'][p]:{w}.2f}" for m in modes))
    print(f"  {'backward: inside nodes':<44}" + "".join(f"{results[m]['backward_in_nodes']:{w}.2f}" for m in modes))
    print(f"  {'backward: between nodes (gap)':<44}" + "".join(f"{results[m]['backward_gap']:{w}.2f}" for m in modes))
    names = sorted({k for m in modes for k in results[m]["ops"]})
    for name in names:
        for i, part in enumerate(("ms", "calls", "  in CPU ops", "  in driver/runtime")):
            vals = [results[m]["ops"].get(name, [0.0, 0, 0.0, 0.0])[i] for m in modes]
            label = f"{name[6:]} {part}" if i < 2 else part
            print(f"  {label[:44]:<44}" + "".join(f"{v:{w}.2f}" for v in vals))
        vals = [results[m]["ops"].get(name, [0.0, 0, 0.0, 0.0]) for m in modes]
        print(f"  {'  rest (Python, dispatch)':<44}" + "".join(f"{v[0] - v[2] - v[3]:{w}.2f}" for v in vals))
    for key, title in (("nodes", "backward nodes"), ("forward_ops", "forward top-level ops")):
        names = {k for m in modes for k in results[m][key]}
        rows = sorted(names, key=lambda k: -max(results[m][key].get(k, [0.0])[0] for m in modes))[:top]
        print(f"\n  {title}, ms per step (calls):")
        for k in rows:
            vals = [results[m][key].get(k, [0.0, 0]) for m in modes]
            print(f"  {k[:44]:<44}" + "".join(f"{v[0]:9.2f} ({v[1]:4.0f})" for v in vals))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    step_arguments(p)
    p.add_argument("--steps", type=int, default=5, help="profiled steps per mode")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="nodes and forward ops listed")
    p.add_argument("--trace-dir", type=Path, help="keep each mode's Chrome trace here (MODEL-MODE.json.gz)")
    p.add_argument("--summarise", nargs="+", type=Path, metavar="TRACE",
                   help="only summarise traces written before (mode = the file name's last part)")
    args = p.parse_args()
    if args.summarise:
        results = {t.name.split(".")[0].rsplit("-", 1)[-1]: summarise(t, args.steps) for t in args.summarise}
    else:
        if not torch.cuda.is_available():
            p.error("needs a CUDA device (or --summarise with saved traces)")
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for m in args.modes:
                where = args.trace_dir or Path(tmp)
                where.mkdir(parents=True, exist_ok=True)
                path = where / f"{args.model.replace(':', '_')}-{m}.json"
                record(m, args, path)
                results[m] = summarise(path, args.steps)
                if args.trace_dir:
                    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as z:
                        z.write(f.read())
                    path.unlink()
    if args.summarise:
        print(f"traces {', '.join(t.name for t in args.summarise)}: {args.steps} profiled steps each")
    else:
        print(f"{args.model}, batch {args.batch}, {args.size} px, {args.layout}: {args.steps} profiled steps")
    report(results, args.top)


if __name__ == "__main__":
    main()
