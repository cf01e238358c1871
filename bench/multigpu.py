"""Several GPUs of one host: NCCL all-reduce repeatability, DDP with native vs nnrand kernels, and
``--world-invariant`` training on 1 and N GPUs, with step times. Writes ``reports/multigpu.md``.

    python -m bench.multigpu                      # every section on all visible GPUs (a few minutes)
    python -m bench.multigpu --only allreduce     # one section
    python -m bench.multigpu --render             # the report from reports/results/multigpu.json only
    python -m bench.multigpu --only ddp --results reports/results/multigpu_h100.json \
        --report reports/multigpu_h100.md          # another GPU model: its own results and report

Sections (each launches ``torchrun`` child processes; results are merged into the JSON file section by
section with atomic writes, so an interrupted run keeps what it finished):

    allreduce   ``dist.all_reduce`` (sum, fp32) of seeded per-rank tensors from 2^10 to 25e6 elements,
                ``--repeats`` times on the same inputs, per NCCL_ALGO (default, Ring, Tree): distinct
                results (SHA-256 of the bytes) and median time
    ddp         ``torchrun -m nnrand.train`` of ResNet-18 (CIFAR, synthetic data) with DDP on N GPUs,
                ``--runs`` rounds of ``--kernel native`` (also with ``--cudnn-benchmark``, NCHW and
                channels_last: the fastest native configuration), ``--kernel tree`` (also with
                ``--cudnn-heuristic b``) and ``--kernel fastest-deterministic`` (per-shape conv choices
                planned by one process on the per-rank batch), each eager and with ``--cuda-graph``:
                distinct final-weight checksums, median step time; ``--ddp-modes`` runs a subset
    invariant   ``--world-invariant`` on 1, 2, 4 ... N GPUs at the same global batch, with micro-batches of
                B/W (one per rank on W GPUs) for each of those world sizes W > 1, and B/4 (the default):
                final-weight checksum and logits hash per world size, step time, with ``tree`` eager and
                with ``--cuda-graph`` (each micro-batch a graph replay); per micro-batch size, a
                one-process ``fastest-deterministic`` planning run and every world size captured with its
                plan; and the one-process tree run without micro-batches, for the cost of each piece

``--gpus N`` limits the sections of that call to N GPUs; sections measured with other GPU counts on the
same GPU model are kept, and each says how many it used, so the DDP cost is measured on two GPUs of a
four-GPU host and the world-invariant section on all four:

    python -m bench.multigpu --gpus 2 --only allreduce ddp && python -m bench.multigpu --only invariant

The cost table compares the world-invariant rows with DDP at the DDP section's GPU count.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "reports" / "results" / "multigpu.json"
REPORT = ROOT / "reports" / "multigpu.md"
SECTIONS = ("allreduce", "ddp", "invariant")
ALGOS = ("default", "Ring", "Tree")
SIZES = (2**10, 2**16, 2**20, 2**24, 25_000_000)
# the DDP section's modes: kernels, and the step eager or one CUDA-graph replay (all-reduces captured).
# native also as the fastest configuration a user runs: cuDNN choosing by timing (cudnn.benchmark), in
# NCHW and channels_last
DDP_MODES = {"native": ["--kernel", "native"], "tree": ["--kernel", "tree"],
             "native_graph": ["--kernel", "native", "--cuda-graph"], "tree_graph": ["--kernel", "tree", "--cuda-graph"]}
# tree with cuDNN's heuristic mode b for the convs it leaves to torch (the forward convs: nnrand.noise)
DDP_MODES.update({"tree_hb": ["--kernel", "tree", "--cudnn-heuristic", "b"],
                  "tree_hb_graph": ["--kernel", "tree", "--cudnn-heuristic", "b", "--cuda-graph"]})
DDP_MODES.update({"fastdet": ["--kernel", "fastest-deterministic"],
                  "fastdet_graph": ["--kernel", "fastest-deterministic", "--cuda-graph"]})
DDP_MODES.update({"native_bench": ["--kernel", "native", "--cudnn-benchmark"],
                  "native_bench_graph": ["--kernel", "native", "--cudnn-benchmark", "--cuda-graph"],
                  "native_bench_cl": ["--kernel", "native", "--cudnn-benchmark", "--channels-last"],
                  "native_bench_cl_graph": ["--kernel", "native", "--cudnn-benchmark", "--channels-last",
                                            "--cuda-graph"]})
DDP_LABELS = {"native": "native", "tree": "tree", "native_graph": "native, CUDA graph", "tree_graph": "tree, CUDA graph",
              "tree_hb": "tree, cuDNN heuristic b", "tree_hb_graph": "tree, cuDNN heuristic b, CUDA graph",
              "fastdet": "fastest-deterministic", "fastdet_graph": "fastest-deterministic, CUDA graph",
              "native_bench": "native, cudnn.benchmark", "native_bench_graph": "native, cudnn.benchmark, CUDA graph",
              "native_bench_cl": "native, cudnn.benchmark, channels_last",
              "native_bench_cl_graph": "native, cudnn.benchmark, channels_last, CUDA graph"}
NATIVE_MODES = tuple(m for m in DDP_MODES if m.startswith("native"))
TREE_MODES = ("tree", "tree_graph", "tree_hb", "tree_hb_graph")
# modes that run with the per-shape conv choices of a one-process planning run (several processes must
# share one plan: --autotune-plan)
PLANNED = ("fastdet", "fastdet_graph")
# the world-invariant section's kernel families: tree, and fastest-deterministic with one plan per micro-batch
# size (a one-process --world-invariant run: every micro-batch has that shape on any world size)
# (its name in the report, its flags, the DDP mode of the same kernels)
INV_KERNELS = {"tree": ("tree", ["--kernel", "tree"], "tree"),
               "fastdet": ("fastest-deterministic", ["--kernel", "fastest-deterministic"], "fastdet")}
# ResNet-18 (CIFAR variant) on the synthetic set: 1 epoch of 40 steps at batch 128
BATCH = 128
TRAIN = ["--model", "resnet18", "--epochs", "1", "--n-train", "5120", "--n-test", "1000", "--batch-size", str(BATCH),
         "--no-progress", "--no-report", "--no-resume", "--dist-timeout", "120"]


# --------------------------------------------------------------------------------------------------
# Children


def allreduce_worker(args) -> int:
    """One rank of the all-reduce measurement (run under torchrun)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rows = []
    for n in SIZES:
        g = torch.Generator(device="cuda").manual_seed(1000 + rank)
        src = torch.randn(n, device="cuda", generator=g)
        buf = torch.empty_like(src)
        hashes, times = set(), []
        for _ in range(args.repeats):
            buf.copy_(src)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(buf)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
            hashes.add(hashlib.sha256(buf.cpu().numpy().tobytes()).hexdigest())
        rows.append({"elements": n, "distinct": len(hashes), "repeats": args.repeats,
                     "median_us": statistics.median(times[1:] or times)})
    if rank == 0:
        Path(args.result).write_text(json.dumps(rows))
    dist.destroy_process_group()
    return 0


def _torchrun(nproc: int, module_args: list[str], env: dict | None = None, timeout: int = 900):
    from nnrand.noise import HEURISTIC_ENV

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *module_args]
    # every child starts under PyTorch's default cuDNN heuristic: a mode that wants another passes
    # --cudnn-heuristic (an inherited TORCH_CUDNN_USE_HEURISTIC_MODE_B would change rows' algorithms under
    # labels that do not say so)
    base = {k: v for k, v in os.environ.items() if k != HEURISTIC_ENV}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(base, **(env or {})),
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)} failed (timeout): TimeoutError: no exit after {timeout} s") from None
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {child_error(r.stderr)}")
    return time.perf_counter() - t0


# torchrun's own lines around a failed child; the child's exception is the line worth keeping
LAUNCHER_ERRORS = ("ChildFailedError", "torch.distributed.elastic")


# an exception's last line ("FileNotFoundError: ...", "RankFailure: ...") or argparse's "prog: error: ..."
ERROR_LINE = re.compile(r"\b\w*(Error|Exception|Failure)(\b|:)|\berror: ")


def child_error(stderr: str) -> str:
    """The first exception line of a failed ``torchrun`` that is not the launcher's own summary: the
    child's exception, e.g. ``FileNotFoundError: ...`` (when one rank fails first, the others' later
    errors, a closed connection say, follow it); else the launcher's line; else the tail of stderr."""
    errors = [ln.strip() for ln in stderr.splitlines() if ERROR_LINE.search(ln)]
    own = [ln for ln in errors if not any(k in ln for k in LAUNCHER_ERRORS)]
    return own[0] if own else (errors or [stderr[-500:]])[-1]


def failure(e: RuntimeError, limit: int = 400) -> str:
    """A failed ``_torchrun``'s cause for the results: its child's error, without the command line."""
    return str(e).split("): ", 1)[-1][:limit]


def _train(nproc: int, out: Path, name: str, extra: list[str]) -> dict:
    _torchrun(nproc, ["-m", "nnrand.train", *TRAIN, "--out", str(out), "--name", name, *extra])
    r = json.loads((out / name / "member_000" / "result.json").read_text())
    return {k: r[k] for k in ("final_checksum", "logits_hash", "step_time_ms", "test_top1", "world_size",
                              "world_invariant", "train_loss")}


# --------------------------------------------------------------------------------------------------
# Sections


def run_allreduce(n: int, scratch: Path, args) -> dict:
    scratch.mkdir(parents=True, exist_ok=True)   # rank 0 writes its result file there
    out = {}
    for algo in ALGOS:
        env = {} if algo == "default" else {"NCCL_ALGO": algo}
        path = scratch / f"allreduce_{algo}.json"
        try:
            _torchrun(n, ["-m", "bench.multigpu", "_allreduce", "--repeats", str(args.repeats), "--result", str(path)],
                      env=env)
            out[algo] = json.loads(path.read_text())
        except RuntimeError as e:
            out[algo] = {"error": failure(e)}
        print(f"allreduce {algo}: {out[algo]}", flush=True)
    return out


def run_ddp(n: int, scratch: Path, args) -> dict:
    """``--runs`` rounds of every mode in DDP_MODES (or those of ``--ddp-modes``), the modes interleaved
    within a round (so a drift of the machine's speed reaches every mode alike). The ``PLANNED`` modes first
    get their per-shape conv choices from one process training the per-rank batch (``--kernel
    fastest-deterministic``, timing each deterministic candidate once); every rank of their DDP runs then
    uses that plan."""
    modes = getattr(args, "ddp_modes", None) or list(DDP_MODES)
    out: dict = {mode: [] for mode in modes}
    extras = {mode: DDP_MODES[mode] for mode in modes}
    planned = [mode for mode in PLANNED if mode in extras]
    try:
        plan = _plan(n, scratch) if planned else None
    except RuntimeError as e:
        for mode in planned:
            out[mode] = {"error": "planning run: " + failure(e, 380)}
        print(f"ddp planning run failed: {out[planned[0]]['error']}", flush=True)
    else:
        if plan is not None:
            out["plan"] = plan
        for mode in planned:
            extras[mode] = [*DDP_MODES[mode], "--autotune-plan", plan["path"]]
    for i in range(args.runs):
        for mode, extra in extras.items():
            if isinstance(out[mode], dict):   # failed in an earlier round
                continue
            try:
                r = _train(n, scratch, f"ddp_{mode}_{i}", extra)
            except RuntimeError as e:
                out[mode] = {"error": failure(e)}
                print(f"ddp {mode} run {i} failed: {out[mode]['error']}", flush=True)
                continue
            out[mode].append(r)
            print(f"ddp {mode} run {i}: {r['final_checksum']} {r['step_time_ms']:.2f} ms", flush=True)
    return out


def _plan(n: int, scratch: Path) -> dict:
    """The DDP modes' plan: one process of ``--kernel fastest-deterministic`` on the per-rank batch (B/n)."""
    return plan_run(scratch, "ddp_plan", ["--batch-size", str(BATCH // n)]) | {"batch": BATCH // n}


def plan_run(scratch: Path, name: str, extra: list[str]) -> dict:
    """One process of ``--kernel fastest-deterministic`` (timing each deterministic candidate once per conv
    configuration): its config.json is the plan. Returns its path, the choice per conv configuration, and
    the run's final checksum and logits hash (runs that follow the plan on one process give these bits)."""
    _torchrun(1, ["-m", "nnrand.train", *TRAIN, "--out", str(scratch), "--name", name, "--kernel",
                  "fastest-deterministic", *extra])
    member = scratch / name / "member_000"
    try:
        record = json.loads((member / "config.json").read_text()).get("autotune") or {}
        choices = {k: (v["choice"] if isinstance(v, dict) else v) for k, v in record.get("choices", {}).items()}
        result = json.loads((member / "result.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:   # a run that exited 0 without its files
        raise RuntimeError(f"{name} failed (output): {type(e).__name__}: {e}") from None
    return {"path": str(member / "config.json"), "choices": choices, "final_checksum": result["final_checksum"],
            "logits_hash": result["logits_hash"]}


def invariant_layouts(batch: int, n: int) -> list[tuple[int, int]]:
    """(micro-batch, world size) pairs of the invariant section: micro-batches of B/W (one per rank on W
    GPUs) for every power-of-two W from 2 to n, B/n, and B/4, each on every power-of-two world size up to n
    that the layout allows (1, 2, 4 on four GPUs)."""
    from nnrand import distributed

    worlds = [2 ** i for i in range(n.bit_length())]   # 1, 2, 4 ... up to n
    out = []
    for micro in sorted({batch // w for w in worlds if w > 1} | {batch // n, batch // 4}, reverse=True):
        for world in worlds:
            try:
                distributed.check_invariant_layout(batch, micro, world)
            except ValueError:
                continue
            out.append((micro, world))
    return out


def run_invariant(n: int, scratch: Path, args) -> dict:
    """Every layout eager and captured with ``tree``; then, per micro-batch size, a one-process
    ``fastest-deterministic`` planning run and every layout captured with its plan."""
    layouts = invariant_layouts(BATCH, n)
    out: dict = {}

    def run(key: str, name: str, world: int, flags: list[str]) -> None:
        try:
            out[key] = _train(world, scratch, name, flags)
        except RuntimeError as e:
            out[key] = {"error": failure(e), "world_size": world}
            print(f"invariant {key} failed: {out[key]['error']}", flush=True)
        else:
            print(f"invariant {key}: {out[key]['final_checksum']} {out[key]['step_time_ms']:.2f} ms", flush=True)

    def one(key: str, micro: int, world: int, kernels: str, extra: list[str], graph: bool) -> None:
        run(key, f"inv_{key}", world, [*INV_KERNELS[kernels][1], "--world-invariant", "--micro-batch", str(micro),
                                       *extra] + (["--cuda-graph"] if graph else []))
        out[key].update(micro_batch=micro, graph=graph, kernels=kernels)

    # the one-process references without micro-batches, eager and captured
    run("single_tree", "single_tree", 1, ["--kernel", "tree"])
    run("single_tree_graph", "single_tree_graph", 1, ["--kernel", "tree", "--cuda-graph"])
    for graph in (False, True):
        for micro, world in layouts:
            one(f"m{micro}_w{world}" + ("_graph" if graph else ""), micro, world, "tree", [], graph)
    for micro in sorted({m for m, _ in layouts}, reverse=True):
        try:
            plan = out[f"plan_m{micro}"] = plan_run(scratch, f"inv_plan_m{micro}",
                                                    ["--world-invariant", "--micro-batch", str(micro)])
        except RuntimeError as e:
            out[f"plan_m{micro}"] = {"error": "planning run: " + failure(e, 380)}
            print(f"invariant plan m{micro} failed: {out[f'plan_m{micro}']['error']}", flush=True)
            continue
        for m, world in layouts:
            if m == micro:
                one(f"m{micro}_w{world}_fastdet_graph", micro, world, "fastdet", ["--autotune-plan", plan["path"]],
                    True)
    return out


# --------------------------------------------------------------------------------------------------
# Results and report


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save(data: dict, path: Path = RESULTS) -> None:
    from nnrand import runio

    runio.write_json(path, data)


def carry_over(data: dict, gpu: str | None) -> dict:
    """The results a new measurement on ``gpu`` (a GPU model's name) adds to: none when they were measured on
    another model; otherwise every section, each with its own GPU count (a file written before sections
    kept one gets the file's count)."""
    if not data or data.get("fingerprint", {}).get("gpu") != gpu:
        return {}
    data = json.loads(json.dumps(data))
    for m in data.get("measured", {}).values():
        m.setdefault("gpus", data.get("gpus"))
    data.pop("gpus", None)
    return data


def _distinct(runs: list[dict], key: str = "final_checksum") -> int:
    return len({r[key] for r in runs})


def _machine(m: dict) -> str:
    """A section's machine: its GPUs' UUIDs (hashed), else its host name (device machines share one)."""
    if m.get("machine"):
        return f"GPUs {m['machine']}"
    return f"host {m['host']}" if m.get("host") else "an unrecorded machine"


def machine_id() -> str | None:
    """12 hex digits naming the visible GPUs by their UUIDs (None where torch does not report them)."""
    import torch

    try:
        ids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except (AttributeError, RuntimeError):
        return None
    return hashlib.sha256(",".join(ids).encode()).hexdigest()[:12] if ids else None


def invariant_rows(inv: dict) -> list[dict]:
    """The world-invariant section's training runs (not the one-process references or the plans), in order."""
    return [r for k, r in inv.items() if not k.startswith(("single_tree", "plan_"))]


def _kernels(r: dict) -> str:
    """A world-invariant row's kernel family as the report names it (rows written before the section had
    several: tree)."""
    return INV_KERNELS[r.get("kernels", "tree")][0]


def _ddp_mode(r: dict) -> str:
    """The DDP mode with a world-invariant row's kernels and step (eager or captured)."""
    return INV_KERNELS[r.get("kernels", "tree")][2] + ("_graph" if r.get("graph") else "")


def _bit_check(inv: dict, rows: list[dict], micro: int, family: str) -> list[str]:
    """The bullet saying whether one micro-batch size and kernel family (a key of INV_KERNELS) gave one set of
    bits everywhere (and, for the planned family, whether its planning run gave them too), or why it has no
    rows."""
    kernels = INV_KERNELS[family][0]
    plan = inv.get(f"plan_m{micro}") if family == "fastdet" else None
    if plan and "error" in plan:
        return [f"- micro-batch {micro}, `{kernels}`: failed: `{plan['error']}`."]
    same = [r for r in rows if r["micro_batch"] == micro and _kernels(r) == kernels and "error" not in r]
    if not same:
        return []
    bits = {(r["final_checksum"], r["logits_hash"]) for r in same}
    where = ", ".join(f"{r['world_size']}{' (graph)' if r.get('graph') else ''}" for r in same)
    line = f"- micro-batch {micro}, `{kernels}`: {'identical' if len(bits) == 1 else 'DIFFERENT'} bits on {where} GPUs"
    if plan:
        agree = bits == {(plan["final_checksum"], plan["logits_hash"])}
        line += (f"; the planning run (one GPU, eager, timing each candidate) gave {'the same' if agree else 'OTHER'} "
                 f"bits; its choices: {_choices(plan)}")
    return [line + "."]


def _choices(plan: dict) -> str:
    """A plan's choices: how many conv configurations chose each candidate, per op where the keys name one
    (``conv_dgrad x=...``: the tuner's keys; forward convs are ``conv_fwd``)."""
    ops: dict[str, Counter] = {}
    for key, choice in plan["choices"].items():
        op, sep, _ = key.partition(" ")
        ops.setdefault(op if sep else "", Counter())[choice] += 1

    def one(counts: Counter) -> str:
        return ", ".join(f"`{c}` x{k}" for c, k in sorted(counts.items()))
    if set(ops) <= {""}:
        return one(ops.get("", Counter())) or "none"
    return "; ".join(f"{op or 'other'}: {one(c)}" for op, c in sorted(ops.items()))


def _step(r: dict) -> str:
    return "CUDA graph" if r.get("graph") else "eager"


def _how(r: dict) -> str:
    return ", " + _step(r)


def section_gpus(data: dict, section: str) -> int | None:
    """GPUs a section ran on (results written before sections kept their own count: the file's)."""
    return data.get("measured", {}).get(section, {}).get("gpus", data.get("gpus"))


def render(data: dict) -> str:
    env = data.get("fingerprint", {})
    counts = {s: section_gpus(data, s) for s in SECTIONS if data.get(s)}
    measured = {k: m for k, m in data.get("measured", {}).items() if data.get(k)}
    machines = {_machine(m) for m in measured.values()}
    visible = [m["visible"] for m in measured.values() if m.get("visible")] or [data.get("visible") or
                                                                              max(counts.values(), default=None)]
    used = "; ".join(f"{s} on {g}" for s, g in counts.items())
    where = (f"{max(visible)} x {env.get('gpu', '?')} of one host" if len(machines) == 1 else
             f"{env.get('gpu', '?')} GPUs of {len(machines)} machines")
    lines = [
        "# Several GPUs: repeatability across runs and across world sizes",
        "",
        f"Generated by `python -m bench.multigpu` on {where} (driver "
        f"{env.get('driver', '?')}, NCCL {data.get('nccl', '?')}, torch {env.get('torch', '?')}, git "
        f"{str(env.get('git_sha', '?'))[:7]}, {env.get('date', '?')}). fp32, TF32 off."
        + (f" GPUs per section: {used}." if len(set(counts.values())) > 1 else ""),
        "",
    ]
    if len({m.get("git_sha") for m in measured.values()}) > 1 or len(machines) > 1:
        lines += ["Sections measured separately: " + "; ".join(
            f"{k} at git {str(m.get('git_sha'))[:7]}" + (f" on {_machine(m)}" if len(machines) > 1 else "")
            + f" ({m.get('date')})" for k, m in measured.items()) + "."
            + (" Ratios between sections measured on different machines compare machines as well as modes."
               if len(machines) > 1 else ""), ""]
    ar = data.get("allreduce")
    n = counts.get("allreduce")
    if ar:
        lines += ["## NCCL all-reduce repeatability",
                  "",
                  f"`dist.all_reduce` (sum, fp32) on {n} GPUs of the same seeded per-rank tensors, repeated: "
                  "distinct results (SHA-256 of the bytes) / repeats, and median time.",
                  "",
                  "| elements | " + " | ".join(f"{a} distinct | {a} µs" for a in ALGOS) + " |",
                  "|---:|" + "---:|---:|" * len(ALGOS)]
        for i, size in enumerate(SIZES):
            cells = []
            for a in ALGOS:
                rows = ar.get(a)
                if not isinstance(rows, list):
                    cells += ["failed", "-"]
                    continue
                r = rows[i]
                cells += [f"{r['distinct']}/{r['repeats']}", f"{r['median_us']:.0f}"]
            lines.append(f"| {size:,} | " + " | ".join(cells) + " |")
        errors = {a: v["error"] for a, v in ar.items() if isinstance(v, dict)}
        for a, e in errors.items():
            lines += ["", f"NCCL_ALGO={a} failed: `{e}`"]
        lines.append("")
    ddp = data.get("ddp")
    n = counts.get("ddp")
    medians = {}
    if ddp:
        lines += ["## DDP at a fixed world size: native kernels vs nnrand `tree`",
                  "",
                  f"`torchrun --nproc_per_node {n} -m nnrand.train {' '.join(data.get('train_args', TRAIN))}` "
                  "(ResNet-18, CIFAR-sized synthetic set), each run from the same seeds; `CUDA graph` adds "
                  "`--cuda-graph` (the forward, backward and DDP's all-reduces captured once, replayed every step), "
                  "`cudnn.benchmark` adds `--cudnn-benchmark` (cuDNN picks its algorithms by timing: the fastest "
                  "native configuration, with `channels_last` adding `--channels-last`)"
                  + (", `cuDNN heuristic b` adds `--cudnn-heuristic b` (cuDNN's heuristic mode B picks the "
                     "algorithms of the convs `tree` leaves to torch: no timing, so runs repeat)"
                     if any(m.startswith("tree_hb") and ddp.get(m) for m in ddp) else "") + ".",
                  "",
                  "| kernels | runs | distinct final weights | median step ms |",
                  "|---|---:|---:|---:|"]
        for mode, label in DDP_LABELS.items():
            runs = ddp.get(mode) or []
            if isinstance(runs, dict):
                lines.append(f"| {label} | failed: `{runs['error']}` | - | - |")
            elif runs:
                medians[mode] = statistics.median(r["step_time_ms"] for r in runs)
                distinct = _distinct(runs) if len(runs) > 1 else "- (one run)"
                lines.append(f"| {label} | {len(runs)} | {distinct} | {medians[mode]:.2f} |")
        for eager, graph in (("tree", "tree_graph"), ("tree_hb", "tree_hb_graph"), ("fastdet", "fastdet_graph")):
            if isinstance(ddp.get(eager), list) and isinstance(ddp.get(graph), list) and ddp[eager] and ddp[graph]:
                both = ddp[eager] + ddp[graph]
                lines += ["", f"`{DDP_LABELS[eager]}` eager and with a CUDA graph together: {_distinct(both)} "
                          f"distinct final weights and {_distinct(both, 'logits_hash')} distinct logits hashes in "
                          f"{len(both)} runs."]
        plan = ddp.get("plan")
        if plan:
            lines += ["", f"`fastest-deterministic`: per-shape conv choices from one process training {plan['batch']} "
                      f"images per step (`--kernel fastest-deterministic`), passed to every rank with "
                      f"`--autotune-plan`: {len(plan['choices'])} conv configurations, choices {_choices(plan)}."]
        lines.append("")
    inv = data.get("invariant")
    rows = invariant_rows(inv or {})
    if inv:
        lines += [f"## `--world-invariant`: the same bits on 1 to {counts.get('invariant')} GPUs",
                  "",
                  "Same global batch and seeds as above; micro-batches of M images (BatchNorm's virtual batch). "
                  "Kernels `tree`, or `fastest-deterministic` with the per-shape conv choices of one process "
                  "training micro-batches of M (`--autotune-plan`: every rank runs micro-batches of that shape on "
                  "any world size). Equal checksums and logits hashes across world sizes are the claim.",
                  "",
                  "| micro-batch | kernels | GPUs | step | final-weight checksum | logits hash | test top-1 | "
                  "median step ms |",
                  "|---:|---|---:|---|---|---|---:|---:|"]
        for r in rows:
            head = f"| {r['micro_batch']} | {_kernels(r)} | {r['world_size']} | {_step(r)} |"
            if "error" in r:
                lines.append(f"{head} failed: `{r['error']}` | - | - | - |")
                continue
            lines.append(f"{head} {r['final_checksum']} | {r['logits_hash']} | {r['test_top1']:.4f} | "
                         f"{r['step_time_ms']:.2f} |")
        lines.append("")
        for micro in sorted({r["micro_batch"] for r in rows}, reverse=True):
            for family in INV_KERNELS:
                lines += _bit_check(inv, rows, micro, family)
        for key, label in (("single_tree", "eager"), ("single_tree_graph", "CUDA graph")):
            r = inv.get(key)
            if r:
                figure = f"failed: `{r['error']}`" if "error" in r else f"{r['step_time_ms']:.2f} ms/step"
                lines.append(f"- one process, no micro-batches (`--kernel tree`, {label}): {figure}.")
        lines.append("")
    trees = [m for m in TREE_MODES if m in medians]
    natives = [m for m in NATIVE_MODES if m in medians]
    if trees and natives:
        lines += ["## Cost", "", "| comparison | ratio | target |", "|---|---:|---:|"]
        for tree, native, what in (("tree", "native", f"eager ({n} GPUs)"),
                                   ("tree_graph", "native_graph", "both CUDA graph")):
            if tree in medians and native in medians:
                lines.append(f"| DDP `tree` / DDP native with the same flags (no cudnn.benchmark), {what} | "
                             f"{medians[tree] / medians[native]:.3f} | - |")
        fastest_tree, fastest_native = min(trees, key=medians.get), min(natives, key=medians.get)
        lines.append(f"| fastest DDP `tree` ({DDP_LABELS[fastest_tree]}) / fastest DDP native "
                     f"({DDP_LABELS[fastest_native]}) | {medians[fastest_tree] / medians[fastest_native]:.3f} | "
                     "<= 1.10 |")
        dets = [m for m in (*TREE_MODES, *PLANNED) if m in medians]
        best_det = min(dets, key=medians.get)
        if any(m in medians for m in PLANNED):
            lines.append(f"| fastest deterministic DDP, any nnrand routing ({DDP_LABELS[best_det]}) / fastest DDP "
                         f"native ({DDP_LABELS[fastest_native]}) | {medians[best_det] / medians[fastest_native]:.3f} | - |")
        at_n = [r for r in rows if r["world_size"] == n and n > 1 and "error" not in r]
        for micro in sorted({r["micro_batch"] for r in at_n}, reverse=True):
            same = [r for r in at_n if r["micro_batch"] == micro]
            for r in same:   # like for like: the same kernels, eager against eager DDP, captured against captured
                if _ddp_mode(r) in medians:
                    lines.append(f"| `--world-invariant` micro-batch {micro}, `{_kernels(r)}`{_how(r)} / DDP "
                                 f"`{_kernels(r)}`{_how(r)} ({n} GPUs) | "
                                 f"{r['step_time_ms'] / medians[_ddp_mode(r)]:.3f} | - |")
            tree_rows = [r for r in same if _kernels(r) == "tree"]
            if tree_rows:
                best = min(tree_rows, key=lambda r: r["step_time_ms"])
                lines.append(f"| fastest `--world-invariant` micro-batch {micro}, `tree` ({_step(best)}) / fastest "
                             f"DDP `tree` ({DDP_LABELS[fastest_tree]}), {n} GPUs | "
                             f"{best['step_time_ms'] / medians[fastest_tree]:.3f} | <= 1.15 |")
            best = min(same, key=lambda r: r["step_time_ms"])
            if best not in tree_rows and _ddp_mode(best) != best_det:   # else a like-for-like row above
                lines.append(f"| fastest `--world-invariant` micro-batch {micro}, any nnrand routing "
                             f"(`{_kernels(best)}`{_how(best)}) / fastest deterministic DDP ({DDP_LABELS[best_det]}), "
                             f"{n} GPUs | {best['step_time_ms'] / medians[best_det]:.3f} | - |")
        for r in rows:   # one GPU: against the one-process tree step, eager against eager, captured against captured
            single = inv.get("single_tree_graph" if r.get("graph") else "single_tree") or {"error": "not run"}
            if r["world_size"] == 1 and _kernels(r) == "tree" and "error" not in r and "error" not in single:
                lines.append(f"| `--world-invariant` micro-batch {r['micro_batch']}, `tree`{_how(r)} / plain `tree`"
                             f"{_how(r)}, one GPU | {r['step_time_ms'] / single['step_time_ms']:.3f} | - |")
        if inv:
            lines += ["",
                      "With one micro-batch per rank the world-invariant step adds to DDP's work a copy of the flat "
                      "gradient, one all_gather of every rank's gradient and BatchNorm statistics, and the "
                      "fixed-order additions on every rank; smaller micro-batches add their own forward and backward "
                      "passes (smaller kernels, more launches). Eager steps are partly host-bound (DDP's eager step "
                      "can be the slower one), so the captured rows give the cost of these pieces."]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multigpu", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("_allreduce", help=argparse.SUPPRESS)
    w.add_argument("--repeats", type=int, default=30)
    w.add_argument("--result", required=True)
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--gpus", type=int, help="GPUs this call's sections use (default: all visible); sections "
                   "measured earlier with another count on the same GPU model are kept, each with its count")
    p.add_argument("--repeats", type=int, default=30, help="all-reduce repeats per size (default 30)")
    p.add_argument("--runs", type=int, default=3, help="DDP runs per mode (default 3)")
    p.add_argument("--ddp-modes", nargs="+", choices=list(DDP_MODES), metavar="MODE",
                   help=f"the ddp section's modes (default all: {', '.join(DDP_MODES)})")
    p.add_argument("--scratch", default="runs/multigpu", help="where the child runs write (default %(default)s)")
    p.add_argument("--render", action="store_true", help="only re-render the report from the results file")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results file (default %(default)s); a "
                   "measurement on another GPU model replaces its sections, so keep each model in its own file")
    p.add_argument("--replace", action="store_true", help="let a measurement on another GPU model drop the "
                   "results file's sections (without it, that is an error)")
    p.add_argument("--report", type=Path, default=REPORT, help="the report rendered from it (default %(default)s)")
    args = p.parse_args(argv)
    if args.cmd == "_allreduce":
        return allreduce_worker(args)
    data = load(args.results)
    if not args.render:
        import torch

        from nnrand.fingerprint import fingerprint

        if not torch.cuda.is_available():
            p.exit(2, f"{p.prog}: error: needs CUDA GPUs (found none)\n")
        visible = torch.cuda.device_count()
        n = args.gpus or visible
        if not 1 <= n <= visible:
            p.exit(2, f"{p.prog}: error: --gpus {n}: expected 1 to the {visible} visible GPUs\n")
        env = fingerprint("cuda")
        machine = machine_id()
        held = data.get("fingerprint", {}).get("gpu")
        if data and held != env.get("gpu") and not args.replace:
            p.exit(2, f"{p.prog}: error: {args.results} holds sections measured on {held or 'an unrecorded GPU'}, "
                      f"this is {env.get('gpu')}: "
                      "write this GPU model's results to their own file (--results, --report), or pass --replace\n")
        if args.ddp_modes and "ddp" in args.only and data.get("ddp") and not args.replace:
            p.exit(2, f"{p.prog}: error: --ddp-modes would replace the ddp section of {args.results} (modes "
                      f"{', '.join(m for m in data['ddp'] if m in DDP_MODES)}) with a subset: write it to its own "
                      "file (--results, --report), or pass --replace\n")
        data = carry_over(data, env.get("gpu"))
        nccl = torch.cuda.nccl.version()
        data.update(visible=visible, fingerprint=env, train_args=TRAIN,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
        scratch = Path(args.scratch)
        for section in args.only:
            data[section] = {"allreduce": run_allreduce, "ddp": run_ddp, "invariant": run_invariant}[section](
                n, scratch, args)
            data.setdefault("measured", {})[section] = {**{k: env.get(k) for k in ("git_sha", "date", "host")},
                                                        "gpus": n, "visible": visible, "machine": machine}
            save(data, args.results)
    if not data:
        p.exit(2, f"{p.prog}: error: no results in {args.results}; run without --render first\n")
    from nnrand import runio

    runio.write_text(args.report, render(data))
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
