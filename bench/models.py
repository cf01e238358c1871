"""Whole models under each backward mode: time per training step, bitwise repeatability, coverage.

    python -m bench.models                       # every model in MODELS (GPU: a few minutes)
    python -m bench.models --only resnet18_cifar torchvision_resnet50
    python -m bench.models --render              # reports/models.md from reports/results/models.json only
    python -m bench.models --only torchvision_resnet50 --amp bf16   # under torch.autocast in bf16
    python -m bench.models --cudnn-heuristic b   # every mode under cuDNN's heuristic mode B (rows <case>_hb)
    timeout 550 python -m bench.models --fresh   # repeated: each run resumes where the last one was stopped

Modes (fp32, TF32 off, or with ``--amp`` the forward under autocast in bf16/fp16 (fp16 with a GradScaler),
rows keyed ``<case>_<amp>``; each in NCHW and channels_last, the faster layout is the mode's figure):

    native               stock PyTorch/cuDNN, cudnn.benchmark on: the fastest configuration a user runs
    torch_deterministic  torch.use_deterministic_algorithms(True), cudnn.deterministic, cudnn.benchmark off
    tree                 nnrand.use_kernels("tree") (strict; a refused model is run again with strict=False;
                         cudnn.benchmark off inside, as use_kernels sets it for a deterministic routing)
    tree_winograd        tree with conv_wgrad=winograd (Winograd F(3,2) weight gradient where it applies)
    winograd             (on request) tree with conv_wgrad=winograd and conv_dgrad=winograd (also the data
                         gradient by Winograd, F(2x2,3x3), where it applies)
    fastest_deterministic  nnrand.use_kernels("fastest-deterministic"): per conv shape the fastest
                         deterministic candidate, timed in the first (warm-up) step of the first run and
                         read from the on-disk cache by the later runs
    atomic               nnrand.use_kernels("atomic")

Per model and mode, ``--runs`` runs (default 3) of ``--steps`` SGD steps (default 20) from the same
initial weights on the same seeded batches, in rounds: each round runs every mode and layout once, so a
drift of the machine's speed during a case hits all of them alike (atomic, a reference, runs afterwards
in tree's faster layout). ms/step is the median over the steps after ``--warmup``
of every run, each step timed with CUDA events (host enqueue gaps included, so host-bound steps show).
Repeatability: distinct SHA-1 hashes of the final weights over the runs. Native, tree, tree_winograd, winograd
and fastest_deterministic also run as a CUDA graph (``nnrand.train.GraphStep``: forward and backward captured
once, SGD eager) in each layout; the graph column is the faster one. Results are appended per model to ``reports/results/models.json``
(atomic writes: an interrupted run resumes at the next model, ``--fresh`` ones too); the report is rendered
from that file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "reports" / "results" / "models.json"
REPORT = ROOT / "reports" / "models.md"


@dataclass(frozen=True)
class ModelCase:
    key: str
    model: str
    batch: int
    size: int
    classes: int = 10


MODELS = (
    ModelCase("resnet18_cifar", "resnet18", 128, 32),
    ModelCase("resnet20_cifar", "resnet20", 128, 32),
    ModelCase("torchvision_resnet18_64px", "torchvision:resnet18", 64, 64),
    ModelCase("torchvision_resnet18", "torchvision:resnet18", 128, 224),
    ModelCase("torchvision_resnet50", "torchvision:resnet50", 64, 224),
    ModelCase("torchvision_vgg11_bn", "torchvision:vgg11_bn", 32, 224),
    ModelCase("torchvision_mobilenet_v3_small", "torchvision:mobilenet_v3_small", 128, 224),
    ModelCase("timm_resnet26d", "timm:resnet26d", 64, 128),
)
MODES = ("native", "torch_deterministic", "tree", "tree_winograd", "fastest_deterministic", "atomic")
ROUTED = {"tree": ("tree", None), "tree_winograd": ("tree", {"conv_wgrad": "winograd"}),
          "fastest_deterministic": ("fastest-deterministic", None), "atomic": ("atomic", None),
          "tree_python": ("tree", None), "winograd": ("tree", {"conv_wgrad": "winograd", "conv_dgrad": "winograd"})}
# modes on request only (--modes): tree_python is tree with every routed call through its Python kernel
# (NNRAND_REPLAY=0: no C++ replay layer), to show what that layer saves in the same run; winograd is
# tree_winograd with the Winograd data gradient too
EXTRA_MODES = ("tree_python", "winograd")
PYTHON_ONLY = ("tree_python",)
LAYOUTS = ("nchw", "channels_last")


# --------------------------------------------------------------------------------------------------
# Measuring


def _setup_env() -> None:
    # deterministic cuBLAS (torch_deterministic mode) needs this before CUDA initialises
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.path.insert(0, str(ROOT))


def _rank(order: tuple, key: str) -> tuple[int, str]:
    """Sort key: ``key``'s place in ``order`` (unknown keys last, by name)."""
    return (order.index(key), "") if key in order else (len(order), key)


def weights_hash(model) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Mode:
    """The global state of one mode, entered around a run and restored after it."""

    def __init__(self, mode: str, strict: bool = True):
        self.mode, self.strict = mode, strict

    def __enter__(self):
        import contextlib

        import torch

        import nnrand

        self.stack = contextlib.ExitStack()
        b = torch.backends.cudnn
        before = (b.benchmark, b.deterministic, torch.are_deterministic_algorithms_enabled())

        def restore():
            b.benchmark, b.deterministic = before[0], before[1]
            torch.use_deterministic_algorithms(before[2])
        self.stack.callback(restore)
        b.benchmark = True
        self.routing = None
        try:
            if self.mode == "torch_deterministic":  # as PyTorch's reproducibility notes ask: benchmark off too
                b.deterministic, b.benchmark = True, False
                torch.use_deterministic_algorithms(True)
            elif self.mode in ROUTED:
                family, ops = ROUTED[self.mode]
                if self.mode in PYTHON_ONLY:
                    from nnrand import replay

                    before_env = os.environ.get(replay.ENV)
                    os.environ[replay.ENV] = "0"
                    self.stack.callback(lambda: os.environ.__setitem__(replay.ENV, before_env) if before_env
                                        is not None else os.environ.pop(replay.ENV, None))
                self.routing = self.stack.enter_context(nnrand.use_kernels(family, ops, strict=self.strict))
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def step_arguments(p) -> None:
    """The options of a dev script that profiles eager training steps of one model case per mode: --model,
    --batch, --size, --layout and --modes (defaults: torchvision resnet18 at 64 px, batch 64, the
    host-bound case)."""
    p.add_argument("--model", default="torchvision:resnet18")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--layout", choices=["nchw", "channels_last"], default="nchw")
    p.add_argument("--modes", nargs="+", default=["native", "torch_deterministic", "tree"])


def step_case(args, device):
    """(model, SGD optimizer, x, y) of ``step_arguments``' case on ``device``: seeded weights (seed 0) and
    one seeded batch of 10 classes, in ``args.layout``."""
    import torch

    from nnrand import models

    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    model = models.build_model(args.model, 10).to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device, generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), device=device, generator=g)
    return model, opt, x, y


def precision(amp: str | None):
    """(autocast context factory taking ``cache=``, GradScaler factory) for ``--amp``: float32 without."""
    import functools

    from nnrand.train import autocast_for, scaler_for

    return functools.partial(autocast_for, "cuda", amp), functools.partial(scaler_for, "cuda", amp)


def run_once(case: ModelCase, mode: str, layout: str, batches, args, *, strict: bool = True) -> dict:
    """One run of ``args.steps`` SGD steps from the seeded initial weights: the step times after the
    warm-up (ms), the final weights' hash and the routing's coverage per step."""
    import torch

    from nnrand import models
    from nnrand.train import forward_backward, optimizer_step

    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    autocast, make_scaler = precision(getattr(args, "amp", None))
    coverage = None
    torch.manual_seed(0)
    model = models.build_model(case.model, case.classes).cuda().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = make_scaler()
    events = []
    with Mode(mode, strict) as m:
        for step, (x, y) in enumerate(batches[:args.steps]):
            x = x.contiguous(memory_format=fmt)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            forward_backward(model, opt, x, y, autocast, scaler)
            optimizer_step(opt, scaler)
            b.record()
            events.append((step, a, b))
        torch.cuda.synchronize()
        if m.routing is not None:
            # per step, rounded up: an op met once in the whole run still shows (an uncovered one above all)
            coverage = {op: {k: -(-v // args.steps) for k, v in c.items()}
                        for op, c in m.routing.coverage.as_dict().items()}
    out = {"times": [a.elapsed_time(b) for step, a, b in events if step >= args.warmup],
           "hash": weights_hash(model), "coverage": coverage}
    del model, opt
    torch.cuda.empty_cache()   # every run, whichever mode ran before it, starts from an empty allocator cache
    return out


def summary(runs: list[dict]) -> dict:
    """A mode's figures from its runs: the median step time over every run, each run's own median (the
    spread between runs that a comparison has to clear), distinct final hashes."""
    return {"ms": statistics.median(t for r in runs for t in r["times"]),
            "run_ms": [round(statistics.median(r["times"]), 3) for r in runs],
            "distinct": len({r["hash"] for r in runs}), "runs": len(runs), "coverage": runs[-1]["coverage"]}


def compare(a: dict, b: dict) -> str:
    """``a`` against ``b`` by step time: "below", "above", or "overlap" where the per-run medians of the two
    overlap (the difference is inside the spread between runs). Rows measured before per-run medians were
    kept compare by their medians alone."""
    if a.get("run_ms") and b.get("run_ms"):
        if max(a["run_ms"]) < min(b["run_ms"]):
            return "below"
        if min(a["run_ms"]) > max(b["run_ms"]):
            return "above"
        return "overlap"
    return "below" if a["ms"] < b["ms"] else "above"


def interleaved(jobs: list, runs: int) -> list[tuple[int, object]]:
    """The order of the runs: round r runs every job once, in the same order every round, so a drift of
    the machine's speed during a case (a host-bound eager step follows the CPU's) hits every mode alike
    instead of whichever ran last."""
    return [(r, job) for r in range(runs) for job in jobs]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def run_interleaved(case: ModelCase, jobs: list[tuple[str, str]], batches, args, run=None) -> dict:
    """Every (mode, layout) job's ``args.runs`` runs in ``interleaved`` rounds: per job its ``summary``
    with ``wall_s``, or ``error`` for a mode that runs no step (its later rounds skipped). A routed
    ``tree*`` mode that nnrand refuses under strict=True runs with strict=False from then on, the refusal
    noted (``refused_strict``); runs it kept under strict=True before are dropped, so one setting makes a
    job's figures."""
    run = run or run_once
    runs = {job: [] for job in jobs}
    notes = {job: {} for job in jobs}
    wall = {job: 0.0 for job in jobs}
    strict = {job: True for job in jobs}
    for r, job in interleaved(jobs, args.runs):
        mode, layout = job
        if "error" in notes[job]:
            continue
        t0 = time.perf_counter()
        try:
            try:
                res = run(case, mode, layout, batches, args, strict=strict[job])
            except Exception as e:
                if not (strict[job] and mode.startswith("tree") and "nnrand" in type(e).__module__):
                    raise
                strict[job] = False
                notes[job]["refused_strict"] = _error(e)
                runs[job].clear()
                res = run(case, mode, layout, batches, args, strict=False)
            done = f"{statistics.median(res['times']):8.2f} ms"
            runs[job].append(res)
        except Exception as e:   # a mode that runs no step is a result: note the error
            notes[job]["error"] = done = _error(e)
        wall[job] += time.perf_counter() - t0
        print(f"  {case.key:<32} round {r + 1}/{args.runs} {mode:<20} {layout:<14} {done}", flush=True)
    return {job: dict(notes[job] if "error" in notes[job] else dict(summary(runs[job]), **notes[job]),
                      wall_s=round(wall[job], 1)) for job in jobs}


def run_graph(case: ModelCase, mode: str, layout: str, batches, args, *, strict: bool = True) -> dict:
    import torch

    from nnrand import models
    from nnrand.train import GraphStep, optimizer_step

    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    autocast, make_scaler = precision(getattr(args, "amp", None))
    torch.manual_seed(0)
    model = models.build_model(case.model, case.classes).cuda().to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = make_scaler()
    times = []
    with Mode(mode, strict):
        graph = GraphStep(model, batches[0][0].contiguous(memory_format=fmt), batches[0][1], autocast, scaler)
        for step, (x, y) in enumerate(batches[:args.steps]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph(x.contiguous(memory_format=fmt), y)
            optimizer_step(opt, scaler)
            b.record()
            times.append((step, a, b))
        torch.cuda.synchronize()
    return {"ms": statistics.median(a.elapsed_time(b) for s, a, b in times if s >= args.warmup)}


def measure(case: ModelCase, args) -> dict:
    import torch

    g = torch.Generator(device="cuda").manual_seed(1234)
    batches = [(torch.randn(case.batch, 3, case.size, case.size, device="cuda", generator=g),
                torch.randint(0, case.classes, (case.batch,), device="cuda", generator=g))
               for _ in range(args.steps)]
    row = {"case": asdict(case), "modes": {}, "amp": getattr(args, "amp", None)}
    modes = [m for m in args.modes if m != "atomic"]
    results = run_interleaved(case, [(m, lay) for m in modes for lay in LAYOUTS], batches, args)
    if "atomic" in args.modes:   # a reference, in tree's faster layout: after the others
        tree = {lay: results[m, lay] for m, lay in results if m == "tree" and "ms" in results[m, lay]}
        lay = min(tree, key=lambda k: tree[k]["ms"]) if tree else "channels_last"
        results.update(run_interleaved(case, [("atomic", lay)], batches, args))
    for mode in args.modes:
        per_layout = {lay: res for (m, lay), res in results.items() if m == mode}
        for lay, res in per_layout.items():
            print(f"  {case.key:<32} {mode:<20} {lay:<14} " +
                  (f"{res['ms']:8.2f} ms  {res['distinct']}/{res['runs']} distinct" if "ms" in res
                   else res["error"]), flush=True)
        ok = {k: v for k, v in per_layout.items() if "ms" in v}
        best = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
        row["modes"][mode] = {"layouts": per_layout, "layout": best}
        if best and mode in ("native", "tree", "tree_winograd", "winograd", "fastest_deterministic"):
            # in both layouts: a host-bound eager step can make the eager-faster layout the slower graph
            graphs = {}
            for lay in ok:
                try:
                    strict = not per_layout[lay].get("refused_strict")
                    graphs[lay] = run_graph(case, mode, lay, batches, args, strict=strict)
                except Exception as e:
                    graphs[lay] = {"error": _error(e)}
                print(f"  {case.key:<32} {mode:<20} {'graph ' + lay:<14} {graphs[lay]}", flush=True)
            timed = {k: v for k, v in graphs.items() if "ms" in v}
            g_best = min(timed, key=lambda k: timed[k]["ms"]) if timed else best
            row["modes"][mode]["graph"] = dict(graphs[g_best], layout=g_best)
            row["modes"][mode]["graph_layouts"] = graphs
        torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------------------
# Result file and report


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": {}}


def save(data: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, RESULTS)


def _label(row: dict) -> str:
    """The model as the report names it: ``torchvision:resnet50 (bf16)`` for an --amp row, ``(heuristic b)``
    for a --cudnn-heuristic b row."""
    tags = [t for t in (row.get("amp"), "heuristic b" if row.get("cudnn_heuristic") == "b" else None) if t]
    return row["case"]["model"] + (f" ({', '.join(tags)})" if tags else "")


def _best(row: dict, mode: str) -> dict | None:
    m = row["modes"].get(mode)
    return None if not m or not m.get("layout") else dict(m["layouts"][m["layout"]], layout=m["layout"])


# forward aten ops a routing may take (the tuner's forward convs, bn_fwd's BatchNorm)
FORWARD_OPS = {"convolution": "conv fwd", "cudnn_batch_norm": "bn fwd"}


def _coverage_text(cov: dict | None) -> str:
    """Per aten op: calls routed to nnrand's kernels, then ``/torch_det n`` (the tuner chose torch's own
    deterministic kernel) and ``/orig n`` (passed on), or UNCOVERED; backward ops by their forward's name,
    the forward convs the tuner routes as ``conv fwd``, routed BatchNorm forwards as ``bn fwd``."""
    if not cov:
        return "-"
    parts = []
    for op, c in sorted(cov.items()):
        det = c.get("torch_det", 0)
        routed = sum(n for k, n in c.items() if k not in ("original", "uncovered", "torch_det"))
        name = FORWARD_OPS.get(op, op.replace("_backward", ""))
        if c.get("uncovered"):
            parts.append(f"{name}: UNCOVERED {c['uncovered']}")
        else:
            parts.append(f"{name} {routed}" + (f"/torch_det {det}" if det else "")
                         + (f"/orig {c['original']}" if c.get("original") else ""))
    return "; ".join(parts)


def _ratio(row: dict, mode: str, graph: bool = False) -> float | None:
    """Mode over native (each in its faster layout; graph: graph over native's graph)."""
    a, b = _best(row, mode), _best(row, "native")
    if a is None or b is None:
        return None
    if graph:
        ga, gb = row["modes"][mode].get("graph", {}), row["modes"]["native"].get("graph", {})
        return ga["ms"] / gb["ms"] if "ms" in ga and "ms" in gb else None
    return a["ms"] / b["ms"]


def decisive(value: float, limit: float, digits: int = 2) -> str:
    """``value`` with ``digits`` decimals, or as many more as it takes (up to 6) not to print it as the
    ``limit`` it is compared with: 1.0548 against 1.05 reads 1.055, not a "1.05 (NOT met)"."""
    d = digits
    while d < 6 and value != limit and f"{value:.{d}f}" == f"{limit:.{d}f}":
        d += 1
    return f"{value:.{d}f}"


def targets(data: dict) -> list[str]:
    """The figures the routing is held to, each with its verdict, computed from the result file."""
    rows = data["rows"]
    out = ["## Targets", ""]

    def verdict(value, limit) -> str:
        if value is None:
            return "not measured"
        return f"{decisive(value, limit)}x (target <= {limit:.2f}x: {'met' if value <= limit else 'NOT met'})"

    r18 = rows.get("resnet18_cifar")
    if r18:
        for mode in ("tree", "tree_winograd", "winograd"):
            if mode == "winograd" and mode not in r18["modes"]:   # a mode on request only
                continue
            out.append(f"- our ResNet-18 (CIFAR, batch 128), {mode}: eager {verdict(_ratio(r18, mode), 1.10)}, "
                       f"CUDA graph {verdict(_ratio(r18, mode, graph=True), 1.05)} of native")
        if "fastest_deterministic" in r18["modes"]:
            out.append(f"- our ResNet-18 (CIFAR, batch 128), fastest_deterministic: eager "
                       f"{verdict(_ratio(r18, 'fastest_deterministic'), 1.05)}, CUDA graph "
                       f"{verdict(_ratio(r18, 'fastest_deterministic', graph=True), 1.05)} of native")
    for key in ("torchvision_resnet50", "torchvision_resnet18", "torchvision_resnet50_bf16"):
        if key in rows:
            for mode in ("tree", "tree_winograd", "winograd", "fastest_deterministic"):
                if mode not in rows[key]["modes"]:
                    continue
                limit = 1.05 if mode == "fastest_deterministic" and not rows[key].get("amp") else 1.10
                graph = _ratio(rows[key], mode, graph=True)
                out.append(f"- {_label(rows[key])} (batch {rows[key]['case']['batch']}, 224 px), {mode} "
                           f"in its faster layout: {verdict(_ratio(rows[key], mode), limit)} of the fastest native"
                           + (f"; CUDA graph {verdict(graph, limit)} of native's graph" if graph is not None else ""))
    found, refused = {"below": [], "above": [], "overlap": []}, []
    for key, row in rows.items():
        t, d = _best(row, "tree"), _best(row, "torch_deterministic")
        if t is None:
            continue
        if d is None:
            refused.append(_label(row))
        else:
            found[compare(t, d)].append(f"{_label(row)} {row['case']['size']} px ({t['ms']:.2f} vs {d['ms']:.2f} ms)")
    out.append(f"- tree below PyTorch's deterministic mode: {'; '.join(found['below']) or 'none'}")
    out.append(f"- tree NOT below it: {'; '.join(found['above']) or 'none'}")
    if found["overlap"]:
        out.append(f"- tree and PyTorch's deterministic mode within the spread of their runs (each run's median "
                   f"step overlaps the other mode's): {'; '.join(found['overlap'])}")
    if refused:
        out.append(f"- PyTorch's deterministic mode runs no step: {', '.join(refused)}")
    trees = [_best(r, "tree") for r in rows.values()]
    trees = [(row, t) for row, t in zip(rows.values(), trees) if t and not t.get("refused_strict")]
    full = [f"{_label(row)} {row['case']['size']} px ({t['distinct']}/{t['runs']})" for row, t in trees]
    one = all(t["distinct"] == 1 for _, t in trees)
    once = [_label(row) for row, t in trees if t["runs"] < 2]   # one run cannot show a second result
    verdict_1 = ("no model measured" if not full else "NOT 1 everywhere" if not one else
                 f"1 everywhere, but {', '.join(once)} ran once: not shown" if once else "1 everywhere: met")
    out.append(f"- distinct final-weight hashes under tree where the coverage is full: {', '.join(full)} "
               f"({verdict_1})")
    return out


MEASURED = ("git_sha", "date", "gpu")   # what each row keeps of the run that measured it


def _measured_line(data: dict) -> list[str]:
    """Which row was measured when and on which GPU, wherever that is not simply the header's run (rows
    from several runs, or all from a run before the header's). A row that predates the GPU's record counts
    as the header's GPU."""
    env = data.get("fingerprint", {})
    by = {}
    for key, row in data.get("rows", {}).items():
        m = row.get("measured") or {}
        by.setdefault((str(m.get("git_sha"))[:7], m.get("date"), m.get("gpu") or env.get("gpu")), []).append(key)
    header = (str(env.get("git_sha"))[:7], env.get("gpu"))
    if not by or (len(by) == 1 and next(iter(by))[::2] == header):
        return []
    gpus = len({g for _, _, g in by} | {env.get("gpu")}) > 1
    return ["Rows measured in separate runs: " + "; ".join(
        f"{', '.join(keys)} at git {sha}{f' on {gpu}' if gpus else ''} ({date})"
        for (sha, date, gpu), keys in by.items()) + ".", ""]


def render(data: dict) -> str:
    env = data.get("fingerprint", {})
    out = ["# Whole models: step time, repeatability and coverage per backward mode", "",
           f"Generated by `python -m bench.models` from `reports/results/models.json`. GPU: {env.get('gpu')}, "
           f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}, CUDA {env.get('cuda')}, git {env.get('git_sha')}, "
           f"{env.get('date')}. fp32 (rows marked bf16/fp16: forward under torch.autocast in that dtype; rows marked heuristic b: every mode's convs with cudnn.benchmark off picked by cuDNN's heuristic mode B, `--cudnn-heuristic b`), TF32 off, SGD (momentum 0.9, nesterov), random seeded batches.", "",
           *_measured_line(data),
           "ms/step: median over steps after the warm-up of every run, CUDA events around each step (host "
           "gaps included). Each mode's figure is its faster layout (NCHW or channels_last, shown). "
           "`native` is stock PyTorch with cudnn.benchmark in its fastest layout: every ratio is to it, "
           "measured in the same process. `torch_deterministic` is PyTorch's deterministic mode as a user turns "
           "it on (use_deterministic_algorithms(True), cudnn.deterministic, cudnn.benchmark off), with its default "
           "fill of new memory with NaN (`torch.utils.deterministic.fill_uninitialized_memory`), which nnrand's "
           "routing turns off. The runs of a row repeat in one process. distinct: distinct final-weight SHA-1 "
           "hashes over the runs. "
           "graph: forward+backward captured once as a CUDA graph (`--cuda-graph`), SGD eager, in its faster layout (shown as CL for channels_last where it differs from the eager one). coverage "
           "(per step, rounded up): aten ops routed to nnrand's kernels / to torch's deterministic kernel by the "
           "tuner (torch_det) / passed to the original kernel / uncovered; backward ops named by their forward, "
           "the forward convs fastest-deterministic tunes as conv fwd. Where a "
           "mode's graph time is far below its eager time, its eager step is host-bound: each routed op "
           "adds the host cost of its dispatch and launches, which the graph removes (rows measured from git "
           "8c9985a on: the conv, BatchNorm and max-pool backwards replayed in C++ per call signature, "
           "`nnrand/replay.py`; earlier rows, and the ops and signatures that layer does not take: Python, "
           "`bench/dev/launch_cost.py`); where both are close, the GPU time of the kernels decides "
           "(`reports/kernels.md`). A "
           "host-bound row's eager ratio follows the speed of the machine's CPU, which differs between machines "
           "of one GPU type by tenths of the ratio: compare such rows through the graph column, or by a "
           "same-machine A/B (`bench/dev/routing_host_cost.py --rounds`).", ""]
    head = ("| model | batch x px | mode | layout | ms/step | x native | distinct | graph ms | graph x native "
            "| coverage / note |")
    out += [head, "|---" * (head.count("|") - 1) + "|"]
    keys = [c.key for c in MODELS]
    order = [row_key(k, amp, h) for k in keys for amp in (None, "bf16", "fp16") for h in ("instant", "b")]
    order += sorted(k for k in data["rows"] if k not in order)
    rows = [(k, data["rows"][k]) for k in order if k in data["rows"]]
    for key, row in rows:
        case = row["case"]
        if row.get("error"):
            out.append(f"| {_label(row)} | {case['batch']} x {case['size']} | - | - | - | - | - | - | - "
                       f"| not measured: {row['error']} |")
            continue
        native = _best(row, "native")
        ng = row["modes"].get("native", {}).get("graph", {})
        for mode in (*MODES, *(m for m in EXTRA_MODES if m in row["modes"])):   # modes on request where run
            b = _best(row, mode)
            if b is None:
                err = next((v.get("error") for v in row["modes"].get(mode, {}).get("layouts", {}).values()), "")
                if mode in row["modes"]:
                    out.append(f"| {_label(row)} | {case['batch']} x {case['size']} | {mode} | - | - | - | - | - | - "
                               f"| runs no step: {err.split(', but you set')[0]} |")
                continue
            ratio = b["ms"] / native["ms"] if native else float("nan")
            g = row["modes"][mode].get("graph", {})
            gms = f"{g['ms']:.2f}" if "ms" in g else ("-" if not g else "fails")
            if "ms" in g and g.get("layout") and g["layout"] != b["layout"]:
                gms += f" ({'CL' if g['layout'] == 'channels_last' else 'NCHW'})"
            gx = f"{g['ms'] / ng['ms']:.2f}" if "ms" in g and "ms" in ng else "-"
            note = _coverage_text(b.get("coverage")) if mode in ROUTED else ""
            if b.get("refused_strict"):
                op = b["refused_strict"].split(" in ")[0].split(": ")[-1]
                note = f"strict: refused ({op}); run with strict=False: {note}"
            out.append(f"| {_label(row)} | {case['batch']} x {case['size']} | {mode} | {b['layout']} | "
                       f"{b['ms']:.2f} | {ratio:.2f} | {b['distinct']}/{b['runs']} | {gms} | {gx} | {note} |")
    out += ["", *targets(data), "", "Every layout measured (ms/step, distinct/runs; each run's median where "
            "kept):", ""]
    for key, row in rows:
        cells = []
        # in MODES and LAYOUTS order, as the file is read back (its keys sorted) and as it was measured
        for mode, m in sorted(row["modes"].items(), key=lambda kv: _rank(MODES, kv[0])):
            for lay, r in sorted(m["layouts"].items(), key=lambda kv: _rank(LAYOUTS, kv[0])):
                runs = f"; runs {'/'.join(f'{v:.2f}' for v in r['run_ms'])}" if r.get("run_ms") else ""
                cells.append(f"{mode}/{lay} " + (f"{r['ms']:.2f} ({r['distinct']}/{r['runs']}{runs})" if "ms" in r
                                                  else "error"))
        out.append(f"- {_label(row)} ({row['case']['batch']} x {row['case']['size']}): " + "; ".join(cells))
    return "\n".join(out) + "\n"


def row_key(case_key: str, amp: str | None = None, heuristic: str | None = None) -> str:
    """A row's key: the case, ``_<amp>`` under --amp, ``_hb`` under --cudnn-heuristic b."""
    return case_key + (f"_{amp}" if amp else "") + ("_hb" if heuristic == "b" else "")


def to_measure(rows: dict, cases: list, *, only: list | None, fresh: bool, amp: str | None,
               heuristic: str | None = None) -> list[tuple]:
    """(case, row key) pairs a run measures: the ``only`` cases whether or not the result file has them;
    else every case with ``fresh``, or the cases the file lacks. Rows not measured stay in the file."""
    out = []
    for case in cases:
        key = row_key(case.key, amp, heuristic)
        if only:
            if case.key in only:
                out.append((case, key))
        elif fresh or key not in rows:
            out.append((case, key))
    return out


def fresh_todo(data: dict, todo: list[tuple], settings: dict, *, resume: bool) -> tuple[list[tuple], str, bool]:
    """Under --fresh: the (case, row key) pairs still to measure, the run's id and whether it resumes one.
    A --fresh run records its row keys and settings in the result file (``fresh_run``) before it measures
    and stamps each row it measures with its id; the same command after an interruption finds that record
    and measures only the rows it has not stamped. ``resume=False`` (--no-resume) starts over."""
    keys = [k for _, k in todo]
    pending = data.get("fresh_run")
    if resume and pending and pending.get("keys") == keys and pending.get("settings") == settings:
        run = pending["id"]
        return [(c, k) for c, k in todo if data["rows"].get(k, {}).get("fresh_run") != run], run, True
    run = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}-{os.getpid()}"
    for row in data["rows"].values():   # an abandoned run's stamps
        row.pop("fresh_run", None)
    data["fresh_run"] = {"id": run, "keys": keys, "settings": settings}
    return todo, run, False


def finish_fresh(data: dict) -> None:
    """A --fresh run that measured every row it recorded: its record and its rows' stamps go."""
    for key in data.pop("fresh_run", {}).get("keys", []):
        data["rows"].get(key, {}).pop("fresh_run", None)


def dropped_modes(row: dict | None, modes: list[str]) -> list[str]:
    """Modes of an existing row that a run measuring only ``modes`` replaces: a row's ratios come from one
    run, so the new row holds the new modes alone."""
    return sorted(set((row or {}).get("modes", {})) - set(modes))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.splitlines()[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=[c.key for c in MODELS], help="these model cases only")
    p.add_argument("--modes", nargs="+", choices=[*MODES, *EXTRA_MODES], default=list(MODES))
    p.add_argument("--runs", type=int, default=3, help="runs per mode and layout (default %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="SGD steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="steps of each run left out of the times")
    p.add_argument("--amp", choices=["bf16", "fp16"], help="forward under torch.autocast in this dtype (rows "
                   "<case>_<amp>); default float32")
    p.add_argument("--cudnn-heuristic", choices=["instant", "b"], default="instant",
                   help="the cuDNN heuristic of every mode's convs with cudnn.benchmark off (nnrand.noise; rows "
                   "<case>_hb for b): one per process, so one per run of this command (default %(default)s, "
                   "PyTorch's, whatever the environment says)")
    p.add_argument("--fresh", action="store_true", help="measure every case again (default: skip cases in the file; "
                   "--only cases are always measured); rows of cases not measured stay in the file. An "
                   "interrupted --fresh run resumes when the same command runs again")
    p.add_argument("--no-resume", action="store_true", help="with --fresh: start over rather than resume an "
                   "interrupted --fresh run")
    p.add_argument("--render", action="store_true", help="only render reports/models.md from the result file")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    if args.no_resume and not args.fresh:
        p.error("--no-resume goes with --fresh (a run without it measures only the rows the file lacks)")
    args.modes = list(dict.fromkeys(args.modes))   # a mode named twice runs once per round
    if args.render:
        REPORT.write_text(render(load()))
        print(f"report: {REPORT}")
        return 0
    _setup_env()
    import torch

    from nnrand import noise
    from nnrand.fingerprint import fingerprint

    try:   # before anything touches CUDA: torch reads it at its first convolution
        noise.set_cudnn_heuristic(args.cudnn_heuristic)
    except ValueError as e:
        p.error(str(e))

    if not torch.cuda.is_available():
        p.error("measuring needs a CUDA GPU (use --render to re-render the report)")
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    data = load()
    before = data.get("fingerprint", {})
    for row in data["rows"].values():   # rows from an earlier run keep that run's commit, date and GPU
        m = row.setdefault("measured", {k: before.get(k) for k in MEASURED})
        m.setdefault("gpu", before.get("gpu"))
    env = fingerprint("cuda")   # the header's once this run measures a row (else the file's stays)
    data["settings"] = {"runs": args.runs, "steps": args.steps, "warmup": args.warmup, "order": "rounds"}
    todo = to_measure(data["rows"], MODELS, only=args.only, fresh=args.fresh, amp=args.amp,
                      heuristic=args.cudnn_heuristic)
    for key in sorted({row_key(c.key, args.amp, args.cudnn_heuristic) for c in MODELS} - {k for _, k in todo}):
        if key in data["rows"]:
            print(f"{key}: in the result file, skipped (--fresh or --only to measure again)")
    run = None
    if args.fresh:
        settings = {"modes": args.modes, "runs": args.runs, "steps": args.steps, "warmup": args.warmup,
                    "amp": args.amp, "cudnn_heuristic": args.cudnn_heuristic}
        total = len(todo)
        todo, run, resumed = fresh_todo(data, todo, settings, resume=not args.no_resume)
        if resumed:
            print(f"resuming an interrupted --fresh run: {len(todo)} of {total} rows left (--no-resume to start "
                  "over)", flush=True)
        save(data)
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False):
        for case, key in todo:
            print(f"{key}: {case.model}, batch {case.batch}, {case.size}px, {args.amp or 'fp32'}", flush=True)
            lost = dropped_modes(data["rows"].get(key), args.modes)
            if lost:
                print(f"  {key}: the row's {', '.join(lost)} results are dropped (a row's ratios come from one "
                      "run: measure every mode to keep them)", flush=True)
            data["fingerprint"] = env
            try:
                data["rows"][key] = measure(case, args)
            except Exception as e:  # a model that cannot be built here (missing package) is noted, not fatal
                data["rows"][key] = {"case": asdict(case), "modes": {}, "error": f"{type(e).__name__}: {e}",
                                     "amp": args.amp}
                print(f"  {key}: {e}", flush=True)
            data["rows"][key]["measured"] = {k: env.get(k) for k in MEASURED}
            if args.cudnn_heuristic == "b":
                data["rows"][key]["cudnn_heuristic"] = "b"
            if run is not None:
                data["rows"][key]["fresh_run"] = run
            save(data)
    if run is not None:
        finish_fresh(data)
        save(data)
    text = render(data)
    REPORT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
