"""Every conv backward of a network, per shape: cuDNN's fastest, cuDNN deterministic, each nnrand variant
and the autotuner's choice, as GPU time from CUDA-graph replays.

    python -m bench.conv_shapes      # ResNet-50 (224 px, batch 64), ResNet-18 (CIFAR, batch 128; 224 px, batch 128)
    python -m bench.conv_shapes --only resnet18_cifar --layouts channels_last
    python -m bench.conv_shapes --render                 # the section of reports/kernels.md from the result file
    python -m bench.conv_shapes --only resnet50_224 --dtype bf16   # bf16 tensors (autocast's), keys <net>_bf16
    python -m bench.conv_shapes --cudnn-heuristic b      # cudnn_det under cuDNN's heuristic mode B, keys <net>_hb

Per network, the distinct conv configurations of one forward (counted: ResNet-50's 53 convs are 23
shapes) are found by forward hooks on the meta device. For each shape, layout (NCHW, channels_last), and
gradient (dX: data, dW: weight), on seeded random tensors, fp32 with TF32 off:

    cudnn_fastest   torch's convolution_backward, cudnn.benchmark on, deterministic off: cuDNN's fastest
                    algorithm, nondeterministic ones allowed (what a user runs for speed)
    cudnn_det       the same under PyTorch's deterministic mode, cudnn.benchmark off: what nnrand's
                    ``torch_det`` candidate runs (cuDNN's heuristic choice among deterministic algorithms)
    <variant>       every registry variant of the op (``atomic`` for reference: nondeterministic)
    auto            what ``use_kernels("fastest-deterministic")`` chose for the shape (a fresh tuner,
                    timing as in training); its time is the chosen column's

The forward conv of each shape gets the same columns in a table of its own: ``cudnn_fastest`` (timed
choice), ``cudnn_det`` (cuDNN's heuristic under deterministic mode, what ``tree`` and ``torch_det`` run),
``tree`` (conv_dgrad's tree on flipped, transposed weights: stride-1 ungrouped shapes only) and ``auto``
(what ``fastest-deterministic`` chose: it tunes forward convs too).

Each time is the median GPU time per call over ``--replays`` replays of a CUDA graph of ``--calls``
back-to-back calls (``bench.timing.graph_replay_us``: no launch gaps, no host time). Network totals
weight each shape by how often it occurs. Results: ``reports/results/conv_shapes.json`` (written after
each network and layout: an interrupted run keeps what it measured); the rendered section goes into
``reports/kernels.md`` between its conv-shapes markers.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "reports" / "results" / "conv_shapes.json"
KERNELS_MD = ROOT / "reports" / "kernels.md"
BEGIN, END = "<!-- conv-shapes: begin (python -m bench.conv_shapes) -->", "<!-- conv-shapes: end -->"
NETWORKS = {  # key: (model name for nnrand.models.build_model, batch, image size, classes)
    "resnet50_224": ("torchvision:resnet50", 64, 224, 1000),
    "resnet18_cifar": ("resnet18", 128, 32, 10),
    "resnet18_224": ("torchvision:resnet18", 128, 224, 1000),
}
LAYOUTS = ("nchw", "channels_last")
GRADS = {"dgrad": 0, "wgrad": 1}
PEERS = ("cudnn_fastest", "cudnn_det")
TARGET_TOTAL, TARGET_SHAPE = 1.05, 1.3   # autotuned / cudnn_fastest: network total, every shape and gradient
TARGET_SHAPE_HALF = 1.2                   # bf16/fp16: every shape and gradient
DTYPES = ("fp32", "bf16", "fp16")


def conv_shapes(model_name: str, batch: int, size: int, classes: int) -> list[dict]:
    """The distinct Conv2d configurations of one forward, with their counts (hooks on the meta device)."""
    import torch

    from nnrand import models

    with torch.device("meta"):
        model = models.build_model(model_name, classes)
    seen: Counter = Counter()

    def hook(mod, inputs, output):
        x = inputs[0]
        seen[(tuple(x.shape), tuple(mod.weight.shape), tuple(mod.stride), tuple(mod.padding), tuple(mod.dilation),
              int(mod.groups), mod.bias is not None)] += 1
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.empty(batch, 3, size, size, device="meta"))
    return [{"x": list(k[0]), "w": list(k[1]), "stride": list(k[2]), "padding": list(k[3]), "dilation": list(k[4]),
             "groups": k[5], "count": n} for k, n in seen.items()]


def network_arguments(p, *, batch: int, calls: int, replays: int) -> None:
    """The options of a script that times one network's conv shapes: --model, --batch, --size, --classes
    (as ``conv_shapes`` takes them) and the CUDA-graph timing's --calls and --replays."""
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--calls", type=int, default=calls)
    p.add_argument("--replays", type=int, default=replays)


def shape_name(s: dict) -> str:
    n, c, h, w = s["x"]
    co, _, kh, kw = s["w"]
    st = f"s{s['stride'][0]}" if s["stride"][0] > 1 else ""
    g = f"g{s['groups']}" if s["groups"] > 1 else ""
    return f"{kh}x{kw}{st}{g} {c}->{co} {h}x{w}"


def measure_shape(s: dict, layout: str, args) -> dict:
    """GPU time (us) of every candidate for dX and dW of one shape."""
    import torch

    import kernels
    import nnrand
    from bench.timing import cudnn_flags, graph_replay_us
    from nnrand import autotune, routing

    from nnrand.train import AMP_DTYPES

    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    dtype = AMP_DTYPES.get(getattr(args, "dtype", "fp32"), torch.float32)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*s["x"], device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = torch.randn(*s["w"], device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    y = torch.nn.functional.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"], s["groups"])
    dy = torch.randn(y.shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    del y
    geom = dict(stride=tuple(s["stride"]), padding=tuple(s["padding"]), dilation=tuple(s["dilation"]))
    if s["groups"] > 1:
        geom["groups"] = s["groups"]

    def aten(mask):
        return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, s["stride"], s["padding"], s["dilation"],
                                                           False, [0, 0], s["groups"], mask)
    out: dict = {}
    for grad, slot in GRADS.items():
        op = f"conv_{grad}" + ("_grouped" if s["groups"] > 1 else "")
        mask = [slot == 0, slot == 1, False]
        times: dict[str, float | None] = {}
        times["cudnn_fastest"], times["cudnn_det"] = _cudnn_times(aten(mask), args)
        for v in kernels.variants(op):
            # through the registry's call: half tensors widened to float32, the result rounded back
            if grad == "dgrad":
                call = (lambda v=v: v(w, dy, input_size=tuple(s["x"][-2:]), **geom))
            else:
                call = (lambda v=v: v(x, dy, kernel_size=tuple(s["w"][-2:]), **geom))
            try:
                call()
            except kernels.KernelArgumentError:
                times[v.name] = None   # the variant does not take this shape
                continue
            times[v.name] = graph_replay_us(call, calls=args.calls, replays=args.replays)
        # what the routing's tuner picks, timing as it does in training (a fresh tuner, no disk cache)
        tuner = autotune.Tuner(cache=None)
        with cudnn_flags(benchmark=False, deterministic=False), \
                nnrand.use_kernels("fastest-deterministic", {o: "tree" for o in routing.TUNABLE if o != op},
                                   tuner=tuner):
            aten(mask)()
        torch.cuda.synchronize()
        (entry,) = tuner.record()["choices"].values()
        choice = entry["choice"]
        out[grad] = {"times_us": times, "auto": choice, "auto_column": "cudnn_det" if choice == autotune.TORCH_DET
                     else choice, "tuner_times_us": entry["times_us"],
                     "deterministic": {v.name: v.deterministic for v in kernels.variants(op)}}
    out["fwd"] = _measure_forward(s, x, w, args)
    return out


def _cudnn_times(fn, args) -> tuple[float, float]:
    """GPU us per call of torch's ``fn`` with cuDNN's fastest algorithms (cudnn.benchmark on, deterministic
    off) and under PyTorch's deterministic mode with cudnn.benchmark off (``cudnn_det``). cudnn.deterministic
    is part of torch's cuDNN plan cache key and cudnn.benchmark is not: the two are two plans, and the
    tuner's torch_det candidate the latter."""
    import torch
    from torch.utils import deterministic as det

    from bench.timing import cudnn_flags, graph_replay_us

    with cudnn_flags(benchmark=True, deterministic=False):
        fastest = graph_replay_us(fn, calls=args.calls, replays=args.replays)
    with cudnn_flags(benchmark=False, deterministic=True):
        fill = det.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        det.fill_uninitialized_memory = False   # as the routing runs it: no fill of every new output
        try:
            deterministic = graph_replay_us(fn, calls=args.calls, replays=args.replays)
        finally:
            torch.use_deterministic_algorithms(False)
            det.fill_uninitialized_memory = fill
    return fastest, deterministic


def _measure_forward(s: dict, x, w, args) -> dict:
    """The forward conv of one shape: cuDNN's timed and heuristic choices, the tree forward form where the
    shape has one, and what fastest-deterministic's tuner chose (a fresh tuner, no disk cache)."""
    import torch

    import nnrand
    from bench.timing import cudnn_flags, graph_replay_us
    from kernels import conv_dgrad, conv_dgrad_winograd
    from nnrand import autotune, routing

    def fwd():
        return torch.nn.functional.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"], s["groups"])
    times: dict[str, float | None] = {}
    times["cudnn_fastest"], times["cudnn_det"] = _cudnn_times(fwd, args)
    k = s["w"][-2:]
    formable = s["stride"] == [1, 1] and s["dilation"] == [1, 1] and s["groups"] == 1 and \
        all(p <= kk - 1 for p, kk in zip(s["padding"], k))
    times["tree"] = graph_replay_us(lambda: conv_dgrad.conv_forward_tree_cuda(x, w, padding=tuple(s["padding"])),
                                    calls=args.calls, replays=args.replays) if formable else None
    pad = tuple(s["padding"])
    wino = formable and conv_dgrad_winograd.forward_applies(x, w, pad)
    times["winograd"] = graph_replay_us(lambda: conv_dgrad_winograd.conv_forward_winograd_cuda(x, w, padding=pad),
                                        calls=args.calls, replays=args.replays) if wino else None
    tuner = autotune.Tuner(cache=None)
    # the routing tunes only forwards that record a backward (as in training: the weight requires grad)
    wg = w.detach().requires_grad_()
    with cudnn_flags(benchmark=False, deterministic=False), \
            nnrand.use_kernels("fastest-deterministic", {o: "tree" for o in routing.TUNABLE if o != "conv_dgrad"},
                               tuner=tuner):
        torch.nn.functional.conv2d(x, wg, None, s["stride"], s["padding"], s["dilation"], s["groups"])
    torch.cuda.synchronize()
    entries = list(tuner.record()["choices"].values())
    if formable and not entries:
        raise RuntimeError(f"forward conv {shape_name(s)}: the routing did not tune a shape its forward form "
                           "covers; the auto column would not be the tuner's choice")
    choice = entries[0]["choice"] if entries else autotune.TORCH_DET   # not tuned: torch's forward runs
    return {"times_us": times, "auto": choice, "auto_column": "cudnn_det" if choice == autotune.TORCH_DET else choice,
            "tuner_times_us": entries[0]["times_us"] if entries else {},
            "deterministic": {"tree": True, "winograd": True}}


def measure(args) -> dict:
    import torch

    from nnrand import runio
    from nnrand.fingerprint import fingerprint

    data = load()
    data.setdefault("networks", {})
    data["fingerprint"] = fingerprint("cuda")
    data["settings"] = {"calls": args.calls, "replays": args.replays}
    dtype = getattr(args, "dtype", "fp32")
    heuristic = getattr(args, "cudnn_heuristic", "instant")
    for name in args.only or list(NETWORKS):
        model_name, batch, size, classes = NETWORKS[name]
        shapes = conv_shapes(model_name, batch, size, classes)
        key = network_key(name, dtype, heuristic)
        if args.fresh:   # this network, dtype and heuristic start over; the file's other sections stay
            data["networks"].pop(key, None)
        net = data["networks"].setdefault(key, {"model": model_name, "batch": batch, "size": size, "layouts": {},
                                                "dtype": dtype})
        if heuristic == "b":
            net["cudnn_heuristic"] = "b"
        if net.get("shapes") not in (None, shapes):   # the model's convs changed: rows of the old list go
            net["layouts"] = {}
        net["shapes"] = shapes
        for layout in args.layouts:
            rows = []
            for i, s in enumerate(shapes):
                m = measure_shape(s, layout, args)
                rows.append({"shape": shape_name(s), **m})
                torch.cuda.empty_cache()
                best = {g: m[g]["times_us"] for g in GRADS}
                print(f"{key} {layout} [{i + 1}/{len(shapes)}] {shape_name(s):<26} x{s['count']}  " +
                      "  ".join(f"{g}: fastest {t['cudnn_fastest']:.1f} det {t['cudnn_det']:.1f} "
                                f"tree {t['tree']:.1f} auto={m[g]['auto']}" for g, t in best.items()), flush=True)
            net["layouts"][layout] = {"rows": rows, "measured": {k: data["fingerprint"].get(k)
                                                                 for k in ("git_sha", "date", "gpu")}}
            runio.write_json(RESULTS, data)
            torch.cuda.empty_cache()
    return data


def network_key(name: str, dtype: str = "fp32", heuristic: str = "instant") -> str:
    """A network's key in the result file: ``<net>``, ``_<dtype>`` for half tensors, ``_hb`` measured under
    cuDNN's heuristic mode B (a process runs one heuristic, so its rows never replace the default's): keyed
    as bench.models keys its rows."""
    from bench.models import row_key

    return row_key(name, None if dtype == "fp32" else dtype, heuristic)


def load() -> dict:
    from nnrand import runio

    return runio.read_json(RESULTS) if RESULTS.exists() else {"networks": {}}


# --------------------------------------------------------------------------------------------------
# Report


def _auto_time(r: dict, grad: str) -> float:
    """The tuner's choice's time; NaN where it has none (a variant that refused the shape stores None)."""
    v = r[grad]["times_us"].get(r[grad]["auto_column"])
    return math.nan if v is None else v


def _best_det(r: dict, grad: str) -> tuple[str, float]:
    t = r[grad]["times_us"]
    det = {n: v for n, v in t.items() if v is not None and (n == "cudnn_det" or r[grad]["deterministic"].get(n))}
    name = min(det, key=det.get)
    return name, det[name]


def totals(net: dict, layout: str) -> dict:
    """Count-weighted sums per column and gradient, and the worst per-shape ratio of auto to cuDNN fastest."""
    rows = net["layouts"][layout]["rows"]
    counts = [s["count"] for s in net["shapes"]]
    out: dict = {"sum": {}, "worst": {}, "worst_trained": None}
    # the first conv of a forward reads the images, which need no gradient: a training step never computes
    # its dX (when it occurs once, its configuration is that conv's alone)
    untrained = rows[0]["shape"] if rows and counts[0] == 1 else None
    for grad in GRADS:
        cols = {"cudnn_fastest", "cudnn_det", "tree", "auto", "best_det"}
        sums = dict.fromkeys(cols, 0.0)
        worst = trained = (0.0, None)
        for r, n in zip(rows, counts):
            t = r[grad]["times_us"]
            vals = {"cudnn_fastest": t["cudnn_fastest"], "cudnn_det": t["cudnn_det"], "tree": t.get("tree"),
                    "auto": _auto_time(r, grad), "best_det": _best_det(r, grad)[1]}
            for c, v in vals.items():
                sums[c] += n * (v if v is not None else math.nan)
            ratio = vals["auto"] / vals["cudnn_fastest"]
            if math.isnan(ratio):   # a shape without a time is the worst, never left out of the verdict
                ratio = math.inf
            if ratio > worst[0]:
                worst = (ratio, r["shape"])
            if ratio > trained[0] and not (grad == "dgrad" and r["shape"] == untrained):
                trained = (ratio, r["shape"])
        out["sum"][grad] = sums
        out["worst"][grad] = worst
        if grad == "dgrad" and worst[1] == untrained and untrained is not None:
            out["worst_trained"] = trained
    out["sum"]["both"] = {c: out["sum"]["dgrad"][c] + out["sum"]["wgrad"][c] for c in out["sum"]["dgrad"]}
    if rows and all("fwd" in r for r in rows):   # results measured before forward convs were: none
        sums = dict.fromkeys(("cudnn_fastest", "cudnn_det", "tree_or_det", "auto"), 0.0)
        for r, n in zip(rows, counts):
            t = r["fwd"]["times_us"]
            # the tree column's total takes torch's heuristic forward where a shape has no tree form
            vals = {"cudnn_fastest": t["cudnn_fastest"], "cudnn_det": t["cudnn_det"],
                    "tree_or_det": t["tree"] if t.get("tree") is not None else t["cudnn_det"],
                    "auto": _auto_time(r, "fwd")}
            for c, v in vals.items():
                sums[c] += n * v
        out["sum"]["fwd"] = sums
    return out


def _fmt(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def render_section(data: dict) -> str:
    """The markdown section (tables per network and layout, totals, targets) from the result file."""
    from bench.models import decisive

    env = data.get("fingerprint", {})
    out = [BEGIN, "## Conv backward per network shape: cuDNN fastest, cuDNN deterministic, nnrand, autotuned", "",
           f"Generated by `python -m bench.conv_shapes` from `reports/results/conv_shapes.json`. GPU: {env.get('gpu')}, "
           f"torch {env.get('torch')}, cuDNN {env.get('cudnn')}, git {env.get('git_sha')}, {env.get('date')}. TF32 "
           "off; the tensors' dtype in each heading (bf16/fp16: nnrand's `tree` and `atomic` run on tensor cores, "
           "kernels/conv_mma.py, float32 accumulation, the wgmma engine on compute capability 9.0; its other "
           "variants widen to float32 and round the result once; cuDNN runs its half-precision tensor-core "
           "algorithms); microseconds of GPU time per call (median over CUDA-graph replays). `cudnn_fastest` allows "
           "cuDNN's nondeterministic algorithms (cudnn.benchmark on); `cudnn_det` is PyTorch's deterministic mode "
           "(cudnn.benchmark off), the autotuner's `torch_det` candidate; `atomic` is nondeterministic and shown "
           "for reference only. `auto` is the candidate `--kernel fastest-deterministic` chose for the shape "
           "(timed by the tuner in the same run), its time that column's. ×n: occurrences in one forward.", ""]
    for key, net in data.get("networks", {}).items():
        both = {}   # layout -> its dX + dW totals, for the verdict across layouts
        for layout, lay in net["layouts"].items():
            rows = lay["rows"]
            if not rows:
                continue
            variants = [n for n in rows[0]["dgrad"]["times_us"] if n not in PEERS]
            wvariants = [n for n in rows[0]["wgrad"]["times_us"] if n not in PEERS]
            m = lay.get("measured", {})
            half = net.get("dtype", "fp32") != "fp32"
            target_shape = TARGET_SHAPE_HALF if half else TARGET_SHAPE
            hb = (", cuDNN heuristic b (`--cudnn-heuristic b`: `cudnn_det`, `torch_det` and torch's forward run "
                  "the algorithms of cuDNN's heuristic mode B)") if net.get("cudnn_heuristic") == "b" else ""
            out += [f"### {net['model']}, batch {net['batch']}, {net['size']} px, {layout}, "
                    f"{net.get('dtype', 'fp32')}{hb}", "",
                    f"Measured at git {str(m.get('git_sha'))[:7]} on {m.get('date')}"
                    + (f", on {m['gpu']}" if m.get("gpu") and m["gpu"] != env.get("gpu") else "") + ".", ""]
            head = (["shape", "×n"] + [f"dX {c}" for c in (*PEERS, *variants)] + ["dX auto"] +
                    [f"dW {c}" for c in (*PEERS, *wvariants)] + ["dW auto"])
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for r, s in zip(rows, net["shapes"]):
                cells = [r["shape"], str(s["count"])]
                for grad, names in (("dgrad", variants), ("wgrad", wvariants)):
                    t = r[grad]["times_us"]
                    cells += [_fmt(t.get(c)) for c in (*PEERS, *names)]
                    ratio = _auto_time(r, grad) / t["cudnn_fastest"]
                    cells.append(f"{r[grad]['auto']} ({ratio:.2f}x)")
                out.append("| " + " | ".join(cells) + " |")
            tot = totals(net, layout)
            out += ["", "| total (us, count-weighted) | cuDNN fastest | cuDNN det | tree | autotuned | best "
                    "deterministic per shape |", "|---|---|---|---|---|---|"]
            for grad, label in (("dgrad", "dX"), ("wgrad", "dW"), ("both", "dX + dW")):
                t = tot["sum"][grad]
                f = t["cudnn_fastest"]
                out.append(f"| {label} | {f:.0f} | {t['cudnn_det']:.0f} ({t['cudnn_det'] / f:.2f}x) | "
                           f"{t['tree']:.0f} ({t['tree'] / f:.2f}x) | {t['auto']:.0f} ({t['auto'] / f:.2f}x) | "
                           f"{t['best_det']:.0f} ({t['best_det'] / f:.2f}x) |")
            if "fwd" in tot["sum"]:
                out += _forward_table(rows, net["shapes"], tot["sum"]["fwd"])
            both[layout] = tot["sum"]["both"]
            total_ratio = both[layout]["auto"] / both[layout]["cudnn_fastest"]
            out += ["", f"Targets: autotuned total {decisive(total_ratio, TARGET_TOTAL)}x this layout's cuDNN "
                    f"fastest (target <= "
                    f"{TARGET_TOTAL:.2f}x: {'met' if total_ratio <= TARGET_TOTAL else 'NOT met'}); worst single shape " +
                    "; ".join(f"{g} {decisive(tot['worst'][g][0], target_shape)}x ({tot['worst'][g][1]})"
                              for g in GRADS) +
                    f" (target <= {target_shape:.1f}x each: " +
                    ("met" if all(tot["worst"][g][0] <= target_shape for g in GRADS) else "NOT met") + ")" +
                    ("" if tot["worst_trained"] is None else
                     f"; the first conv's dX is never computed in training (its input is the images), and the "
                     f"worst dgrad among the others is {decisive(tot['worst_trained'][0], target_shape)}x "
                     f"({tot['worst_trained'][1]})") +
                    ".", ""]
        out += _across_layouts(net, both, decisive)
    out.append(END)
    return "\n".join(out) + "\n"


def _across_layouts(net: dict, both: dict, decisive) -> list[str]:
    """The verdict against the fastest configuration a user would run: cuDNN's fastest backward total in
    its faster layout, against the autotuned deterministic total in its own faster layout (``both``: each
    measured layout's dX + dW totals)."""
    if len(both) < 2:
        return []
    native = min(both, key=lambda k: both[k]["cudnn_fastest"])
    ours = min(both, key=lambda k: both[k]["auto"] if not math.isnan(both[k]["auto"]) else math.inf)
    ratio = both[ours]["auto"] / both[native]["cudnn_fastest"]
    hb = ", heuristic b" if net.get("cudnn_heuristic") == "b" else ""
    return [f"Across layouts ({net['model']}, {net.get('dtype', 'fp32')}{hb}): "
            f"cuDNN's fastest backward total is {both[native]['cudnn_fastest']:.0f} us in {native}; the autotuned "
            f"deterministic one {both[ours]['auto']:.0f} us in {ours}, {decisive(ratio, TARGET_TOTAL)}x it "
            f"(target <= {TARGET_TOTAL:.2f}x: {'met' if ratio <= TARGET_TOTAL else 'NOT met'}).", ""]


def _forward_table(rows: list[dict], shapes: list[dict], t: dict) -> list[str]:
    """The forward conv table of one network and layout, and its count-weighted total."""
    out = ["", "Forward convs (`tree`: the forward form of conv_dgrad's tree, stride-1 ungrouped shapes; "
           "`winograd`: the same form on conv_dgrad's Winograd kernels, float32 3x3 shapes with >= 16 channels):",
           "", "| shape | ×n | fwd cudnn_fastest | fwd cudnn_det | fwd tree | fwd winograd | fwd auto |",
           "|---|---|---|---|---|---|---|"]
    for r, s in zip(rows, shapes):
        f = r["fwd"]
        cells = [r["shape"], str(s["count"])] + [_fmt(f["times_us"].get(c)) for c in (*PEERS, "tree", "winograd")]
        cells.append(f"{f['auto']} ({_auto_time(r, 'fwd') / f['times_us']['cudnn_fastest']:.2f}x)")
        out.append("| " + " | ".join(cells) + " |")
    fast = t["cudnn_fastest"]
    out += ["", f"Forward total (us, count-weighted): cuDNN fastest {fast:.0f}, cuDNN det {t['cudnn_det']:.0f} "
            f"({t['cudnn_det'] / fast:.2f}x), tree where it applies and cuDNN det elsewhere {t['tree_or_det']:.0f} "
            f"({t['tree_or_det'] / fast:.2f}x), autotuned {t['auto']:.0f} ({t['auto'] / fast:.2f}x)."]
    return out


def splice(markdown: str, section: str) -> str:
    """``markdown`` with its conv-shapes section replaced by ``section`` (appended when absent)."""
    if BEGIN in markdown and END in markdown:
        head, rest = markdown.split(BEGIN, 1)
        return head + section.rstrip("\n") + rest.split(END, 1)[1]
    return markdown.rstrip("\n") + "\n\n" + section


def write_report(data: dict) -> Path:
    from nnrand import runio

    text = KERNELS_MD.read_text() if KERNELS_MD.exists() else "# Kernels\n"
    runio.write_text(KERNELS_MD, splice(text, render_section(data)))
    return KERNELS_MD


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conv_shapes", description=__doc__.splitlines()[0],
                                epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(NETWORKS), help="these networks only")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--calls", type=int, default=5, help="calls per captured graph (default %(default)s)")
    p.add_argument("--replays", type=int, default=10, help="graph replays per time (default %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="the tensors' dtype (default %(default)s)")
    p.add_argument("--cudnn-heuristic", choices=["instant", "b"], default="instant",
                   help="the cuDNN heuristic of the convs torch runs with cudnn.benchmark off (cudnn_det, the "
                        "tuner's torch_det, torch's forward; nnrand.noise): one per process (rows <net>_hb for b; "
                        "default instant, PyTorch's, whatever the environment says)")
    p.add_argument("--fresh", action="store_true",
                   help="measure the networks asked for from scratch (their earlier rows dropped; other sections stay)")
    p.add_argument("--render", action="store_true", help="only render the report section from the result file")
    args = p.parse_args(argv)
    if not args.render:
        import torch

        from nnrand import noise

        try:   # before anything touches CUDA: torch reads it at its first convolution
            noise.set_cudnn_heuristic(args.cudnn_heuristic)
        except ValueError as e:
            p.error(str(e))
        if not torch.cuda.is_available():
            p.error("measuring needs a CUDA GPU (use --render to re-render the report)")
        data = measure(args)   # TF32 off inside (bench.timing.cudnn_flags)
    else:
        data = load()
        if not data.get("networks"):
            p.error(f"{RESULTS} holds no measurements yet")
    path = write_report(data)
    print(render_section(data))
    print(f"report: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
