"""Divergence study: train a grid of noise configurations x members and report how predictions diverge.

The grid (``CONFIGURATIONS``, configuration -> train.Config overrides) runs through the training harness.
This module runs members and collects their files; the numbers come from ``nnrand.metrics`` (per-member
definitions) and ``nnrand.stats`` (bootstrap intervals over members, paired tests between configurations,
``COMPARISONS``), and ``nnrand.divergence_report`` renders them.

    python -m nnrand.study                             # default grid (CUDA) or the quick grid (CPU)
    python -m nnrand.study --time-budget 480           # stop cleanly before a member would pass 480 s
    python -m nnrand.study --jobs 3 --time-budget 540  # three members at a time (default: 8 per GPU on CUDA)
    python -m nnrand.study report                      # re-render from the files; trains nothing

Each configuration is one run directory of the harness (``<runs-dir>/<config>/member_XXX``); every
member is one ``nnrand.train.main`` call, so finished members are skipped and an unfinished one resumes
from its checkpoint. ``--jobs N`` makes that call in N worker processes at a time (spawned, so CUDA
starts fresh in each; with several GPUs visible, worker i uses GPU i mod count); every member is seeded
by its configuration, so the results are the same as one after another. On CUDA the default is
``JOBS_PER_GPU`` workers per GPU: ResNet-20 members leave an H200 partly idle one at a time. Outputs, by
backend (a CPU run never overwrites the GPU report):

    CUDA, default grid   reports/divergence.md        reports/divergence_*.png        reports/results/divergence*
    CUDA, --quick        reports/divergence_quick.md  reports/divergence_quick_*.png  reports/results/divergence_quick*
    CPU                  reports/divergence_cpu.md    reports/divergence_cpu_*.png    reports/results/divergence_cpu*

``--out PATH.md`` puts the report (and its PNGs and results, under ``<dir>/results``) elsewhere. The
results are ``<stem>.json`` (every metric, the kernel-noise summary, timing), ``<stem>_examples.npz``
(per-example disagreement, predictions, the most-disagreed test images) and ``<stem>_timing.json``.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from nnrand import metrics, mps, noise, routing, runio, stats, train

REPO = Path(__file__).resolve().parent.parent
TIMING_SCRIPT = REPO / "bench" / "dev" / "train_step_time.py"

# --------------------------------------------------------------------------------------------------
# Sizes (one place). The CUDA grid: ResNet-20 on the synthetic set, 10k training and 10k test images
# (the test set's size bounds how finely accuracy SD and disagreement resolve: with members disagreeing
# on a fraction d of n images, accuracy SD cannot fall far below sqrt(d / 2n), 0.2 pt at d = 8%, n = 10k),
# 20 epochs of batch 128 (1560 steps), forward + backward captured once in a CUDA graph, the test set
# evaluated every 5 epochs (a 10k-image evaluation costs about a third of a training epoch).
# Recipe probe on the H200 (bench/dev/recipe_probe.json, 8 members each, 4 at a time on the GPU), 20
# epochs: `algo` 96.06% test top-1, SD 0.30 pt; 40 epochs 96.95%, SD 0.18; lr 0.1 95.51%, SD 0.16. The
# full study at 15 epochs (10 members per configuration) gave `algo` SD 0.508 pt [0.34, 0.57].
SIZES = {
    "cuda": {"model": "resnet20", "epochs": 20, "batch_size": 128, "lr": 0.2, "n_train": 10_000, "n_test": 10_000,
             "cuda_graph": True, "eval_every": 5},
    # 2 CPU cores: 30 members of 8 steps each with the CPU order models, plus the timing pass: 5.2 min of
    # CPU time, 7.5 min wall on a shared 2-core machine (load average ~5), measured 2026-11-21.
    "quick": {"model": "small", "epochs": 2, "batch_size": 32, "lr": 0.2, "n_train": 128, "n_test": 256},
    # --smoke (what CI runs): two tiny members per configuration on the CPU, 2 steps each; it checks that
    # every configuration trains, collects and renders, not what the numbers are.
    "smoke": {"model": "small", "epochs": 1, "batch_size": 32, "lr": 0.2, "n_train": 64, "n_test": 64,
              "device": "cpu"},
}
MEMBERS = {"cuda": 10, "quick": 3, "smoke": 2}   # members per configuration by default
# Default workers per GPU. H200, ResNet-20 steps in a CUDA graph (3-epoch runs): one process alone 5.2 ms
# per step; eight processes at once 17.8-32.9 ms each (median 28.8), ~3.4 ms per step in aggregate, 1.5x
# the throughput of one (the GPU time-slices between them; each also fills the others' evaluation,
# checkpoint and start-up time). Under MPS (the default where it starts, nnrand/mps.py) the default study,
# 17 configurations x 10 members at 20 epochs, took 1011 s on one H200 (three parts: 60 members in 407 s,
# 60 in 377 s, 50 in 227 s, each including the collection; 15 epochs: 771 s), against 7.8 s per member
# at 15 epochs without it. On two H200s of one host (16 workers): 462 s of training in two runs (the
# wall-time ledger, study_runs.json) plus 44 s of collecting and rendering, 0.50x the one-GPU time.
JOBS_PER_GPU = 8
POOL_MODEL = {"resnet18": "resnet18_imagenet", "resnet20": "resnet20_maxpool"}  # model -> its max-pool sibling
TOP_FLIPS = 8  # most-disagreed test images kept per configuration

# --------------------------------------------------------------------------------------------------
# Configurations as data: name -> (train.Config overrides, what varies between members). Every entry
# but `native` runs nnrand's kernels, and every one fixes what it does not name.

ATTRIBUTION_OPS = ("conv_wgrad", "conv_dgrad", "bias_grad", "maxpool_bwd")   # one op atomic at a time

CONFIGURATIONS: dict[str, tuple[dict, str]] = {
    "control": ({"preset": "control"}, "fixed seeds, tree kernels: bitwise identical members expected"),
    "algo": ({"preset": "algo"}, "random init, batch order and augmentation per member; tree kernels"),
    "impl": ({"preset": "impl"}, "fixed seeds, every routed backward reduction atomic"),
    "algo+impl": ({"preset": "algo+impl"}, "both"),
    "ulp": ({"preset": "control", "perturb_ulp": True},
            "fixed seeds, tree kernels, one weight moved by one ULP at step 0 (a different weight per member)"),
    "init": ({"preset": "control", "init_seed": "member"}, "initialisation seed per member; all else fixed, tree"),
    "order": ({"preset": "control", "order_seed": "member"}, "batch-order seed per member; all else fixed, tree"),
    "aug": ({"preset": "control", "aug_seed": "member"}, "augmentation seed per member; all else fixed, tree"),
    **{f"atomic-{op}": ({"preset": "control", "kernel_ops": {op: "atomic"}},
                        f"fixed seeds, tree kernels except {op} atomic") for op in ATTRIBUTION_OPS},
    "native": ({"preset": "control", "kernel": "native"},
               "fixed seeds, stock PyTorch/cuDNN backward (default algorithms, not deterministic mode)"),
    "algo-bf16": ({"preset": "algo", "amp": "bf16"}, "algo with the forward under bf16 autocast (tree kernels "
                  "on the half tensors, float32 accumulation)"),
    "impl-bf16": ({"preset": "impl", "amp": "bf16"}, "impl with the forward under bf16 autocast (every routed "
                  "backward reduction atomic)"),
}
# Seed baselines repeated on a configuration's own model when it differs from the study's model (the
# max-pool sibling): its disagreement is compared with these, never with another architecture's.
BASELINES = ("control", "algo")

# Paired tests the results carry: (a, b) asks "is a's disagreement different from b's?". Entries whose
# configurations are absent are skipped; atomic-<op> is compared with the control of its own model.
COMPARISONS = [("impl", "algo"), ("impl", "ulp"), ("impl", "control"), ("ulp", "algo"), ("algo+impl", "algo"), ("impl", "native"),
               ("init", "algo"), ("order", "algo"), ("aug", "algo")] + \
              [(f"atomic-{op}", "control") for op in ATTRIBUTION_OPS] + [(f"atomic-{op}", "impl") for op in ATTRIBUTION_OPS] + \
              [("impl-bf16", "impl"), ("algo-bf16", "algo"), ("impl-bf16", "algo-bf16")]   # does bf16 change the answer?


@dataclass(frozen=True)
class Entry:
    """One configuration of the grid: Config overrides on top of the study's sizes."""

    name: str
    overrides: dict = field(default_factory=dict)
    note: str = ""


def has_maxpool(model: str) -> bool:
    """Whether ``model`` contains a max-pool (so that max-pool backward runs at all). A model that cannot
    be built here counts as having one: the harness's validation names the problem later."""
    from nnrand import models

    try:
        net = models.build_model(model)
    except (ValueError, ImportError):
        return True
    return any(isinstance(m, torch.nn.MaxPool2d) for m in net.modules())


def default_grid(model: str) -> list[Entry]:
    """``CONFIGURATIONS`` for ``model``. ``atomic-maxpool_bwd`` runs on the model's max-pool sibling when
    it has no max-pool itself (``POOL_MODEL``; dropped if there is none), and that sibling gets its own
    ``BASELINES`` (``control@<model>``, ``algo@<model>``)."""
    grid, extra = [], []
    for name, (over, note) in CONFIGURATIONS.items():
        over = dict(over)
        if name == "atomic-maxpool_bwd" and not has_maxpool(model):
            if model not in POOL_MODEL:
                continue
            pool = POOL_MODEL[model]
            over["model"] = pool
            note += f" (model {pool}: {model} has no max-pool)"
            extra = [Entry(f"{b}@{pool}", dict(CONFIGURATIONS[b][0], model=pool),
                           CONFIGURATIONS[b][1] + f" (model {pool}: the seed baseline of atomic-maxpool_bwd)")
                     for b in BASELINES]
        grid.append(Entry(name, over, note))
    return grid + extra


def baseline_for(name: str, model: str, names: set[str]) -> str:
    """Configuration ``name`` on ``model`` when the grid has it there (``name@model``, see BASELINES)."""
    cand = f"{name}@{model}"
    return cand if cand in names else name


class StudyError(ValueError):
    """A bad study option or grid file, detected before anything trains."""


def load_grid_file(path: str | Path) -> dict:
    """A grid file (JSON, or TOML by its .toml suffix)::

        members = 3                 # optional
        lrs = [0.1, 0.2]            # optional
        [sizes]                     # optional: Config fields for every run (epochs, n_train, model, ...)
        epochs = 4
        [[config]]                  # one table per configuration
        name = "impl"
        preset = "impl"
        note = "fixed seeds, atomic kernels"
        [[config]]
        name = "atomic-conv_wgrad"
        preset = "control"
        kernel_ops = { conv_wgrad = "atomic" }
    """
    path = Path(path)
    if path.suffix == ".toml" and sys.version_info < (3, 11):
        raise StudyError(f"--grid {path}: TOML grid files need Python 3.11 (tomllib); use JSON")
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            spec = tomllib.loads(text)
        else:
            spec = json.loads(text)
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        raise StudyError(f"--grid {path}: {e}") from None
    known = {"members", "lrs", "sizes", "config"}
    if not isinstance(spec, dict) or set(spec) - known or not spec.get("config"):
        raise StudyError(f"--grid {path}: expected keys {sorted(known)} with a non-empty 'config' list")
    fields = {f.name for f in dataclasses.fields(train.Config)}
    entries = []
    for i, c in enumerate(spec["config"]):
        c = dict(c)
        name, note = c.pop("name", None), c.pop("note", "")
        if not name or "/" in name:
            raise StudyError(f"--grid {path}: config #{i} needs a 'name' without '/'")
        bad = set(c) - fields
        if bad:
            raise StudyError(f"--grid {path}: config {name!r} has unknown fields {sorted(bad)}; "
                             f"valid: {', '.join(sorted(fields))}")
        entries.append(Entry(name, c, note))
    sizes = spec.get("sizes", {})
    if set(sizes) - fields:
        raise StudyError(f"--grid {path}: unknown [sizes] fields {sorted(set(sizes) - fields)}")
    return {"entries": entries, "members": spec.get("members"), "lrs": spec.get("lrs"), "sizes": sizes}


# --------------------------------------------------------------------------------------------------
# The plan: (configuration, lr) -> one run directory; each member one harness call


@dataclass(frozen=True)
class Planned:
    name: str
    config: dict          # Config fields shared by every member
    note: str
    entry: str            # the grid entry's name (without the lr suffix)
    lr: float


@dataclass
class Study:
    backend: str          # "cuda" or "cpu"
    quick: bool
    members: int
    plan: list[Planned]
    runs_dir: Path
    reports_dir: Path
    stem: str
    command: str = "python -m nnrand.study"   # how this study was invoked (the report's resume hint)
    smoke: bool = False                        # the --smoke sizes (CI): numbers say nothing, code paths run

    @property
    def results_path(self) -> Path:
        return self.reports_dir / "results" / f"{self.stem}.json"

    @property
    def examples_path(self) -> Path:
        return self.reports_dir / "results" / f"{self.stem}_examples.npz"

    @property
    def timing_path(self) -> Path:
        return self.reports_dir / "results" / f"{self.stem}_timing.json"

    @property
    def report_path(self) -> Path:
        return self.reports_dir / f"{self.stem}.md"


def default_stem(backend: str, quick: bool, smoke: bool = False) -> str:
    if smoke:
        return "divergence_smoke_cpu" if backend == "cpu" else "divergence_smoke"
    if backend == "cpu":
        return "divergence_cpu"
    return "divergence_quick" if quick else "divergence"


def _n_params(model: str, dataset: str) -> int:
    from nnrand import models

    return models.param_count(models.build_model(model, 100 if dataset == "cifar100" else 10))


def member_config(p: Planned, member: int, *, runs_dir: Path, progress: bool) -> dict:
    """The ``train.main`` config of one member: one member per call so the study can stop between them."""
    cfg = dict(p.config, out=str(runs_dir), name=p.name, members=1, first_member=member, progress=progress,
               report=False, save_epoch_weights=True)
    if cfg.get("perturb_ulp") and "perturb_index" not in p.config:
        # A different weight per member, drawn from the base seed: members differ by these ULPs only.
        n = _n_params(cfg["model"], cfg.get("dataset", "synthetic"))
        cfg["perturb_index"] = noise.derive(cfg.get("seed", 0), 5, member) % n
    return cfg


def make_study(*, device: str | None = None, quick: bool | None = None, members: int | None = None,
               lrs: list[float] | None = None, configs: list[str] | None = None, grid_file: str | None = None,
               sizes: dict | None = None, runs_dir: str | None = None, out: str | None = None,
               smoke: bool = False, trains: bool = True) -> Study:
    """Resolve the grid, sizes and paths; check every configuration with the harness's own validation.
    ``smoke``: the tiny CI sizes, on the CPU unless ``device`` says otherwise. ``trains=False`` (status and
    report, which read run files only): a CUDA study resolves on a machine without CUDA, so members trained
    on GPU machines are collected and rendered anywhere; the harness's checks, which need the device, are
    left to the machines that train."""
    device = device or (SIZES["smoke"]["device"] if smoke else "cuda" if torch.cuda.is_available() else "cpu")
    backend = torch.device(device).type
    if trains and backend == "cuda" and not torch.cuda.is_available():
        raise StudyError("--device cuda: no CUDA device is available here")
    quick = (backend != "cuda") if quick is None else quick
    size = "smoke" if smoke else "quick" if quick else "cuda"
    # the study's recipe keeps colour as a cue (its subgroups are defined by it); a grid's [sizes] may change it
    base = dict(SIZES[size], device=device, shuffle_channels=False)
    spec = load_grid_file(grid_file) if grid_file else None
    if spec:
        base.update(spec["sizes"])
    base.update({k: v for k, v in (sizes or {}).items() if v is not None})
    entries = spec["entries"] if spec else default_grid(base["model"])
    members = members or (spec and spec["members"]) or MEMBERS[size]
    if members < 2:
        raise StudyError(f"--members must be >= 2 (divergence needs pairs), got {members}")
    lrs = lrs or (spec and spec["lrs"]) or [base["lr"]]
    if configs:
        names = {e.name for e in entries}
        unknown = [c for c in configs if c not in names]
        if unknown:
            raise StudyError(f"--configs: unknown {', '.join(unknown)}; grid: {', '.join(e.name for e in entries)}")
        entries = [e for e in entries if e.name in configs]
    plan = []
    for e in entries:
        for lr in lrs:
            name = e.name if len(lrs) == 1 else f"{e.name}_lr{lr:g}"
            cfg = dict(base, lr=float(lr))
            cfg.update(e.overrides)   # an entry's own lr wins over the lr grid
            plan.append(Planned(name, cfg, e.note, e.name, float(cfg["lr"])))
    if len({p.name for p in plan}) != len(plan):
        raise StudyError("configuration names must be unique")
    heuristics = {p.config.get("cudnn_heuristic") for p in plan}
    if len(heuristics) > 1:   # members share processes (jobs 1, pool workers); torch reads the mode once in each
        raise StudyError(f"--grid: configurations ask for cuDNN heuristics {sorted(map(str, heuristics))}; a study "
                         "trains members in shared processes, where torch reads the heuristic once: set "
                         "cudnn_heuristic once, in [sizes]")
    for p in plan if trains else ():  # the harness's validation, before anything trains
        try:
            train.resolve(train.Config(**member_config(p, 0, runs_dir=Path("runs"), progress=False)))
        except (train.ConfigError, routing.RoutingError, TypeError) as e:
            raise StudyError(f"configuration {p.name!r}: {e}") from None
    stem = default_stem(backend, quick, smoke)
    reports_dir = REPO / "reports"
    if out:
        o = Path(out)
        stem, reports_dir = (o.stem, o.parent) if o.suffix == ".md" else (stem, o)
    return Study(backend, quick, members, plan, Path(runs_dir or Path("runs") / stem), reports_dir, stem,
                 smoke=smoke)


# --------------------------------------------------------------------------------------------------
# Running: every unfinished member, stopping cleanly at the time budget


def member_done(study: Study, p: Planned, member: int) -> bool:
    """Whether the member is finished. One finished under another config (the study's epochs or sizes
    changed, its runs directory kept) is an error, not a result of this study."""
    d = runio.member_dir(study.runs_dir, p.name, member)
    if not runio.is_finished(d):
        return False
    cfg = train.resolve(train.Config(**member_config(p, member, runs_dir=study.runs_dir, progress=False)))
    differ = train.finished_config_diff(d, cfg)
    if differ:
        raise train.ConfigError(f"{d} holds a finished member run under another config (differs in: "
                                f"{', '.join(differ)}); use another --runs-dir, or remove that directory")
    return True


def done_count(study: Study) -> int:
    return sum(member_done(study, p, m) for p in study.plan for m in range(study.members))


class MemberError(RuntimeError):
    """A member failed in a worker process (``--jobs``); the message names its configuration and member,
    ``__cause__`` is the worker's exception (with the worker's traceback as its own cause)."""


def member_error(name: str, member: int, exc: BaseException) -> MemberError:
    err = MemberError(f"configuration {name!r} member {member}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def run(study: Study, *, time_budget: float | None = None, progress: bool = True, jobs: int = 1,
        trainer=None) -> dict:
    """Train the members not finished yet; returns {"trained", "stopped", "remaining"}. With a time
    budget, a member is started only if the time spent so far plus the median duration of the members
    trained in this call fits (the first one always starts: an interrupted member resumes anyway).

    ``jobs`` > 1 trains that many members at a time in worker processes (see ``run_parallel``).
    ``trainer`` replaces ``train.main`` (default); with jobs > 1 it must be picklable (a module-level
    function), as it is called in the workers."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    units = [(p, m) for p in study.plan for m in range(study.members)]
    todo = [(p, m) for p, m in units if not member_done(study, p, m)]
    if jobs > 1 and todo:
        return run_parallel(study, units, todo, time_budget=time_budget, progress=progress, jobs=jobs,
                            trainer=trainer)
    start = time.monotonic()
    durations: list[float] = []
    trained = 0
    bar = tqdm(total=len(units), initial=len(units) - len(todo), desc="study members", unit="member",
               disable=not progress)
    try:
        for p, m in todo:
            elapsed = time.monotonic() - start
            est = statistics.median(durations) if durations else 0.0
            if time_budget is not None and durations and elapsed + est > time_budget:
                return {"trained": trained, "stopped": True, "remaining": len(todo) - trained}
            bar.set_postfix_str(f"{p.name} member {m}")
            t0 = time.monotonic()
            (trainer or train.main)(member_config(p, m, runs_dir=study.runs_dir, progress=progress))
            durations.append(time.monotonic() - t0)
            trained += 1
            bar.update(1)
    finally:
        bar.close()
    return {"trained": trained, "stopped": False, "remaining": 0}


# --------------------------------------------------------------------------------------------------
# Wall time: one ledger entry per `run` call that trained, so a study finished in parts (time budgets,
# interruptions) still states its total training time and on how many GPUs it ran

WALL_LEDGER = "study_runs.json"


def ledger_path(study: Study) -> Path:
    return study.runs_dir / WALL_LEDGER


def read_ledger(study: Study) -> list[dict]:
    """The ledger's entries, oldest first; [] when there is none yet. A damaged ledger raises a
    ``StudyError`` naming the file (training never depends on it: delete it to start over)."""
    path = ledger_path(study)
    if not path.exists():
        return []
    try:
        entries = runio.read_json(path)["runs"]
        if not isinstance(entries, list):
            raise TypeError(f"'runs' is a {type(entries).__name__}, not a list")
        for i, e in enumerate(entries):
            bad = [k for k in LEDGER_NUMBERS if not isinstance(e, dict) or isinstance(e.get(k), bool)
                   or not isinstance(e.get(k), (int, float))]
            if bad:
                raise ValueError(f"entry {i} lacks a number for {', '.join(bad)}")
    except (ValueError, KeyError, TypeError) as e:
        raise StudyError(f"{path}: unreadable study ledger ({type(e).__name__}: {e}); delete it to start a "
                         "new one (members are not affected)") from None
    return entries


LEDGER_NUMBERS = ("wall_s", "trained", "jobs", "gpus")   # what every entry must hold
ENDS = ("finished", "stopped", "interrupted", "failed")    # how a run call ended: all members done, at the time
                                                           # budget, by Ctrl-C, by an error


def gpus_used(study: Study, jobs: int, gpus: list[str] | None = None) -> int:
    """GPUs a run call's members ran on: 0 on the CPU; with workers, one per visible GPU up to the worker
    count (worker i takes GPU i mod count); one when members run in this process or one GPU is visible.
    ``gpus``: ``worker_gpus(study)`` when the caller has it."""
    if study.backend != "cuda":
        return 0
    gpus = worker_gpus(study) if gpus is None else gpus
    return min(jobs, len(gpus)) if jobs > 1 and gpus else 1


def record_run(study: Study, *, started: str, wall_s: float, jobs: int, trained: int, end: str,
               mps_on: bool = False) -> dict:
    """Append one `run` call to the ledger (atomic rewrite): when it started, its wall time (the MPS
    daemon's start, worker start-up and every member it trained or resumed; not the collection or the
    timing pass), the members it finished, how it ended (``ENDS``) and what it ran on. Returns the entry."""
    if end not in ENDS:
        raise ValueError(f"end must be one of {', '.join(ENDS)}, got {end!r}")
    gpus = worker_gpus(study)
    entry = {"started": started, "wall_s": round(float(wall_s), 3), "trained": int(trained), "end": end,
             "jobs": int(jobs), "backend": study.backend, "gpus": gpus_used(study, jobs, gpus),
             "gpu_ids": gpus[:jobs] if jobs > 1 and gpus else None, "mps": bool(mps_on), "host": platform.node()}
    runio.write_json(ledger_path(study), {"runs": [*read_ledger(study), entry]})
    return entry


def wall_summary(entries: list[dict]) -> dict | None:
    """Total training wall time over the ledger's entries, with the GPU counts they ran on (a study
    resumed on another machine, or with another GPU count, says so: its total is then no one machine's)."""
    if not entries:
        return None
    return {"ledger": WALL_LEDGER, "parts": len(entries), "total_s": round(sum(e["wall_s"] for e in entries), 3),
            "trained": sum(e["trained"] for e in entries), "gpus": sorted({e["gpus"] for e in entries}),
            "hosts": sorted({e.get("host") or "?" for e in entries}), "jobs": sorted({e["jobs"] for e in entries}),
            "mps": sorted({bool(e.get("mps")) for e in entries}),
            "part_s": [e["wall_s"] for e in entries],
            "interrupted": sum(e.get("end") == "interrupted" or bool(e.get("interrupted")) for e in entries),
            "failed": sum(e.get("end") == "failed" for e in entries)}


def worker_gpus(study: Study) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each GPU that workers spread over: one entry per visible GPU
    when the study runs on ``cuda`` (no index) and more than one GPU is visible, else none (the workers
    share the study's device). ``torch.cuda.device_count`` is what ``make_study``'s availability check
    already asked; entries of an inherited ``CUDA_VISIBLE_DEVICES`` are kept (worker i gets the i-th)."""
    devices = {p.config.get("device") for p in study.plan}
    if study.backend != "cuda" or devices != {"cuda"}:
        return []
    count = torch.cuda.device_count()
    if count < 2:
        return []
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        return [d.strip() for d in inherited.split(",")][:count]
    return [str(i) for i in range(count)]


def default_jobs(study: Study) -> int:
    """Members at a time when --jobs is not given: ``JOBS_PER_GPU`` per GPU on CUDA, 1 on the CPU."""
    if study.backend != "cuda":
        return 1
    return JOBS_PER_GPU * max(1, len(worker_gpus(study)))


def pin_gpu(counter, gpus: list[str]) -> str | None:
    """Worker side: take the next worker index from the shared counter and restrict this process to GPU
    ``index mod len(gpus)``. Must run before CUDA initialises here (importing torch does not)."""
    if not gpus:
        return None
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return os.environ["CUDA_VISIBLE_DEVICES"]


def _worker_init(counter, gpus: list[str], threads: int) -> None:
    # An idle worker ignores Ctrl-C (it would die in the pool's queue otherwise); while it trains, the
    # harness's own handler takes the signal, checkpoints at the next step and raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent's CPU thread count: CPU reductions split by thread, so it is part of a member's bits.
    torch.set_num_threads(threads)
    pin_gpu(counter, gpus)


@contextlib.contextmanager
def _inherited_env(**values: str):
    """Set environment variables that spawned workers inherit (read there before torch starts its thread
    pools); the previous values come back on exit. This process's runtimes read them long ago."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _train_member(cfg: dict, trainer=None) -> float:
    """Worker side: one member, one harness call; returns its duration in seconds."""
    t0 = time.monotonic()
    (trainer or train.main)(cfg)
    return time.monotonic() - t0


def run_parallel(study: Study, units: list, todo: list, *, time_budget: float | None, progress: bool,
                 jobs: int, trainer=None) -> dict:
    """``run`` with ``jobs`` members at a time, each one ``train.main`` call in a spawned worker process
    (progress bars off there; one bar here counts finished members). With a time budget, no member is
    submitted once the time spent plus the median duration of the members finished in this call would
    pass it; running members finish. A failing member stops submission; once the running ones are done it
    is raised as ``MemberError`` naming its configuration and member. Ctrl-C cancels what is queued and
    waits for the running members, which take the signal too (one process group) and checkpoint.

    Workers run with this process's ``torch.get_num_threads()`` and, unless set, OMP_WAIT_POLICY=PASSIVE:
    OpenMP threads of several processes spinning on the same cores made CPU steps ~20x slower (2 cores,
    2 workers; the bits are the same either way)."""
    # OMP_WAIT_POLICY is read when a worker loads torch; workers spawn at submit, so it stays set meanwhile
    with _inherited_env(**({} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"})):
        return _run_pool(study, units, todo, time_budget=time_budget, progress=progress, jobs=jobs,
                         trainer=trainer)


def _run_pool(study: Study, units: list, todo: list, *, time_budget: float | None, progress: bool, jobs: int,
              trainer) -> dict:
    ctx = multiprocessing.get_context("spawn")   # CUDA cannot be forked
    workers = min(jobs, len(todo))
    queue = collections.deque(todo)
    running: dict[concurrent.futures.Future, tuple[Planned, int]] = {}
    start = time.monotonic()
    durations: list[float] = []
    trained = 0
    stopped = False
    failures: list[MemberError] = []
    bar = tqdm(total=len(units), initial=len(units) - len(todo), desc="study members", unit="member",
               disable=not progress)
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                                  initargs=(ctx.Value("i", 0), worker_gpus(study),
                                                            torch.get_num_threads()))
    try:
        while True:
            while queue and len(running) < workers and not failures and not stopped:
                est = statistics.median(durations) if durations else 0.0
                if time_budget is not None and durations and time.monotonic() - start + est > time_budget:
                    stopped = True
                    break
                p, m = queue.popleft()
                cfg = member_config(p, m, runs_dir=study.runs_dir, progress=False)
                running[pool.submit(_train_member, cfg, trainer)] = (p, m)
            bar.set_postfix_str(", ".join(f"{p.name} member {m}" for p, m in running.values()))
            if not running:
                break
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                p, m = running.pop(fut)
                try:
                    durations.append(fut.result())
                except Exception as e:
                    failures.append(member_error(p.name, m, e))
                    if running:
                        tqdm.write(f"{failures[-1]}; waiting for the {len(running)} running member(s)",
                                   file=sys.stderr)
                    continue
                trained += 1
                bar.update(1)
    except KeyboardInterrupt as e:
        pool.shutdown(wait=True, cancel_futures=True)   # the running members checkpoint and stop
        stops = [e, *(f.exception() for f in running if not f.cancelled())]
        notes = [str(x) for x in stops if isinstance(x, KeyboardInterrupt) and str(x)]
        raise KeyboardInterrupt("; ".join(notes)) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    if failures:
        for extra in failures[1:]:
            print(f"also failed: {extra}", file=sys.stderr)
        raise failures[0]
    return {"trained": trained, "stopped": stopped, "remaining": len(todo) - trained}


def run_timing(study: Study, *, quick_steps: bool) -> bool:
    """Median training-step time of native, torch deterministic mode, nnrand atomic and nnrand tree,
    measured side by side in one fresh process (``bench/dev/train_step_time.py``; a fresh process so
    that CUBLAS_WORKSPACE_CONFIG is set before CUDA starts). Writes ``<stem>_timing.json``."""
    if not TIMING_SCRIPT.exists():
        print(f"timing pass skipped: {TIMING_SCRIPT} not found", file=sys.stderr)
        return False
    p0 = study.plan[0].config
    cmd = [sys.executable, str(TIMING_SCRIPT), "--device", p0["device"], "--model", p0["model"],
           "--batch-size", str(p0["batch_size"]), "--json", str(study.timing_path)]
    if p0.get("channels_last"):
        cmd.append("--channels-last")
    if quick_steps:
        cmd += ["--warmup", "1", "--steps", "1", "--rounds", "3"]
    study.timing_path.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"timing pass failed (exit {r.returncode}):\n{r.stderr[-2000:]}", file=sys.stderr)
        return False
    print(r.stdout.strip())
    return True


# --------------------------------------------------------------------------------------------------
# Collecting: run directories -> one results file (every number the report shows)


def _clean(o):
    """NaN/inf -> None, NumPy scalars -> Python, recursively (strict JSON)."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def _checksums(d: Path) -> list[tuple[int, int]]:
    f = d / "checksums.csv"
    return [(int(r["step"]), int(r["checksum"])) for r in runio.read_csv(f)] if f.exists() else []


L2_CACHE = "weights_l2.json"


def weight_distances(dirs: list[Path], epochs: int, checksums: list[int]) -> list[dict]:
    """Per epoch whose weights every member saved: pairwise L2 distances and the mean weight norm, summed
    up by ``stats.l2_growth`` (mean pairwise L2 with its interval, growth over the first epoch). One
    epoch in memory at a time (ResNet-18: 45 MB per member and epoch in float32).

    The matrices are kept beside the members in ``<config>/weights_l2.json``, valid for exactly the
    members they were taken over (names and ``checksums``, their final checksums): once it is written, the per-epoch weight
    files (most of a study's bytes) are not needed to collect the configuration again, so a study's
    finished configurations can move to another machine without them. A configuration whose members
    were trained on two machines needs its weight files together once, on one of them."""
    rows = _l2_rows(dirs, epochs, checksums)
    return stats.l2_growth([(e, np.asarray(m, dtype=np.float64), n) for e, m, n in rows])


def _l2_rows(dirs: list[Path], epochs: int, checksums: list[int]) -> list[tuple[int, list, float]]:
    cache = dirs[0].parent / L2_CACHE
    # a member is named with its final checksum: a member trained again (--no-resume) makes a new entry
    members = [[d.name, c] for d, c in zip(dirs, checksums)]
    if cache.exists():
        held = runio.read_json(cache)
        if held.get("members") == members:
            return [(r["epoch"], r["l2"], r["norm"]) for r in held["rows"]]
    rows, complete = [], True
    for e in range(epochs):
        files = [d / f"weights_epoch_{e:03d}.pt" for d in dirs]
        if not all(f.exists() for f in files):
            complete = False
            continue
        ws = [torch.load(f, map_location="cpu").numpy() for f in files]
        rows.append((e, stats.l2_matrix(ws).tolist(),
                     float(np.mean([np.linalg.norm(w.astype(np.float64)) for w in ws]))))
    if complete:   # a partial set would hide epochs: recomputed until every file is there
        runio.write_json(cache, {"members": members,
                                 "rows": [{"epoch": e, "l2": m, "norm": n} for e, m, n in rows]})
    return rows


def collect_config(study: Study, p: Planned) -> tuple[dict, dict]:
    """Metrics of one configuration from its finished members; (summary, per-example arrays; the
    members' ``logits`` among them, for the comparisons between configurations)."""
    dirs = [runio.member_dir(study.runs_dir, p.name, m) for m in range(study.members)]
    done = [d for d in dirs if runio.is_finished(d)]
    out = {"name": p.name, "entry": p.entry, "lr": p.lr, "note": p.note, "requested": study.members,
           "done": len(done), "done_members": [d.name for d in done]}
    if not done:
        return out, {}
    cfg0 = runio.read_json(done[0] / "config.json")
    c = cfg0["config"]
    out["setup"] = {"model": c["model"], "dataset": c["dataset"], "epochs": c["epochs"], "batch_size": c["batch_size"],
                    "n_train": c["n_train"], "n_test": c["n_test"], "data_seed": c["data_seed"],
                    "data_dir": c.get("data_dir"), "lr": c["lr"], "preset": c["preset"],
                    "seeds": {s: c[f"{s}_seed"] for s in noise.SOURCES}, "routing": cfg0["routing"]["ops"],
                    "flags": cfg0["flags"], "perturb": [runio.read_json(d / "config.json").get("perturb")
                                                        for d in done] if c.get("perturb_ulp") else None}
    out["fingerprint"] = cfg0["fingerprint"]
    results = [runio.read_json(d / "result.json") for d in done]
    out["step_time_ms"] = statistics.median(r["step_time_ms"] for r in results)
    out["train_time_s"] = sum(r["train_time_s"] for r in results)
    preds = []
    for d in done:
        with np.load(d / "predictions.npz") as f:
            preds.append((f["logits"].astype(np.float32), f["labels"].astype(np.int64), f["group"].astype(np.int64)))
    logits = np.stack([x[0] for x in preds])
    labels, groups = preds[0][1], preds[0][2]
    groups = groups if (groups >= 0).any() else None
    arrays = {}
    if len(done) >= 2:
        out["metrics"] = metrics.summarize(logits, labels, groups)
        out["metrics"]["ci"] = stats.config_stats(logits, labels, groups)
        # weights: pairwise distance per epoch, and the first step with differing bits per pair
        out["weights"] = weight_distances(done, c["epochs"], [r["final_checksum"] for r in results])
        sums = [_checksums(d) for d in done]
        firsts = [metrics.first_divergent_step(sums[i], sums[j]) for i, j in metrics.pairs(len(done))]
        out["first_divergence"] = {"per_pair": firsts,
                                   "checksum_steps": "every step of epoch 0, then every epoch end",
                                   "steps_per_epoch": c["n_train"] // c["batch_size"] if c["n_train"] else None}
        preds_arr = metrics.predictions(logits)
        dis = metrics.example_disagreement(preds_arr)
        conf = metrics.hardness(logits, labels)["confidence"]
        order = np.lexsort((np.arange(len(dis)), conf, -dis))  # most disagreed, then least confident
        top = [int(i) for i in order[:TOP_FLIPS] if dis[i] > 0]
        out["top_flips"] = top
        arrays = {"disagreement": dis.astype(np.float32), "preds": preds_arr.astype(np.int16),
                  "confidence": conf.astype(np.float32)}
    else:
        acc = metrics.accuracy(metrics.predictions(logits), labels)
        out["metrics"] = {"members": len(done), "accuracy": metrics.spread(acc)}
    arrays["labels"] = labels
    if groups is not None:
        arrays["groups"] = groups
    arrays["logits"] = logits
    return out, arrays


def comparisons(study: Study, configs: dict, logits: dict) -> list[dict]:
    """``COMPARISONS`` between the configurations with >= 2 finished members (``stats.compare_configs``);
    the baseline named by a comparison is taken on the first configuration's own model when the grid has
    one there (``control@resnet18_imagenet`` for ``atomic-maxpool_bwd``), and at the same lr."""
    by_entry = {(p.entry, p.lr): p.name for p in study.plan}
    names = {p.entry for p in study.plan}
    out = []
    for a_entry, b_entry in COMPARISONS:
        for p in study.plan:
            if p.entry != a_entry:
                continue
            b_name = by_entry.get((baseline_for(b_entry, p.config["model"], names), p.lr))
            if b_name is None or b_name not in logits or p.name not in logits:
                continue
            sa, sb = configs[p.name]["setup"], configs[b_name]["setup"]
            if any(sa[k] != sb[k] for k in ("model", "dataset", "n_test", "data_seed")):
                continue   # another model or test set: no paired test (atomic-maxpool_bwd vs impl on resnet18)
            labels = logits[p.name][1]
            if not np.array_equal(labels, logits[b_name][1]):
                continue
            out.append({"a": p.name, "b": b_name, **stats.compare_configs(logits[p.name][0], logits[b_name][0], labels)})
    return out


def kernel_noise(backend: str, reports_dir: Path) -> dict:
    """Per op, the atomic variant's run-to-run variance on the ResNet-18 cases of the kernel benchmark
    table (cases named ``contention_*`` are synthetic stress cases and are left out)."""
    import pandas as pd

    name = "kernels.csv" if backend == "cuda" else "kernels_cpu.csv"
    path = reports_dir / "results" / name
    if not path.exists():
        return {"source": str(path.relative_to(reports_dir.parent)) if path.is_relative_to(reports_dir.parent)
                else str(path), "found": False, "ops": {}}
    df = pd.read_csv(path)
    sel = df[(df["kind"] == "variant") & df["variant"].isin(["atomic", "tree"]) & (df["mode"] == "fast")
             & ~df["case"].fillna("").str.startswith("contention")]
    ops = {}
    for op in routing.ROUTED_OPS:
        rows = sel[sel["op"] == op]
        if rows.empty:
            continue
        info = {}
        for variant in ("atomic", "tree"):
            r = rows[rows["variant"] == variant]
            dist = r[r["metric"] == "distinct_results"]
            ulp = r[r["metric"] == "max_ulp"]["value"].dropna()
            if dist.empty:
                continue
            info[variant] = {"cases": int(len(dist)), "cases_varying": int((dist["value"] > 1).sum()),
                             "max_distinct": int(dist["value"].max()),
                             "repeats": int(dist["repeats"].max()) if dist["repeats"].notna().any() else None,
                             "median_max_ulp": float(ulp.median()) if len(ulp) else None,
                             "max_max_ulp": float(ulp.max()) if len(ulp) else None}
        info["case_names"] = sorted(rows["case"].dropna().unique().tolist())
        ops[op] = info
    meta = df.iloc[0]
    return {"source": f"reports/results/{name}", "found": True, "ops": ops,
            "gpu": None if pd.isna(meta.get("gpu")) else str(meta.get("gpu")),
            "git_sha": str(meta.get("git_sha")), "date": str(meta.get("date")),
            "scale": str(meta.get("scale"))}


def _test_images(setup: dict, indices: list[int]) -> tuple[np.ndarray | None, list[str] | None, str | None]:
    """The test images at ``indices`` (uint8 N,3,32,32) and the class names, regenerated from the
    dataset's seed (the synthetic set is code) or read from the CIFAR archive."""
    from nnrand import data

    try:
        ds = data.load_dataset(setup["dataset"], data_dir=setup.get("data_dir"), seed=setup["data_seed"],
                               n_train=setup["n_train"], n_test=setup["n_test"])
    except (data.DatasetError, ValueError, OSError) as e:
        return None, None, str(e)
    return ds.test_x[indices].numpy(), list(ds.classes), None


def _wall_or_none(study: Study) -> dict | None:
    try:
        return wall_summary(read_ledger(study))
    except StudyError as e:   # the report still renders; it says nothing of the wall time
        print(f"study: {e}", file=sys.stderr)
        return None


def collect(study: Study, timing: dict | None = None) -> dict:
    """Read every configuration's run directory; write ``<stem>.json`` and ``<stem>_examples.npz``."""
    configs, arrays, logits = {}, {}, {}
    for p in study.plan:
        s, a = collect_config(study, p)
        configs[p.name] = s
        z = a.pop("logits", None)
        if z is not None and len(z) >= 2:
            logits[p.name] = (z, a["labels"])
        arrays.update({f"{p.name}/{k}": v for k, v in a.items()})
    done = [c for c in configs.values() if c["done"]]
    fp = done[0]["fingerprint"] if done else None
    setup = done[0]["setup"] if done else None
    classes, why_no_images = None, "no finished members"
    top = sorted({i for c in configs.values() for i in c.get("top_flips", [])})
    if setup:
        images, classes, why_no_images = _test_images(setup, top)
        if images is not None:
            arrays["images"] = images
            arrays["image_index"] = np.array(top, dtype=np.int64)
    if timing is None and study.timing_path.exists():
        timing = {"rows": json.loads(study.timing_path.read_text()), "source": study.timing_path.name}
    res = {
        "backend": study.backend, "quick": study.quick, "smoke": study.smoke, "stem": study.stem,
        "collected": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "members": study.members, "runs_dir": str(study.runs_dir),
        "grid": [{"name": p.name, "entry": p.entry, "lr": p.lr, "note": p.note} for p in study.plan],
        "configs": configs,
        "comparisons": comparisons(study, configs, logits),
        "missing": [c["name"] for c in configs.values() if c["done"] < study.members],
        "classes": classes, "images_note": why_no_images,
        "fingerprint": fp, "kernel_noise": kernel_noise(study.backend, REPO / "reports"), "timing": timing,
        "command": study.command, "train_wall": _wall_or_none(study),
    }
    runio.write_text(study.results_path, json.dumps(_clean(res), indent=1) + "\n")
    # kept in the repository beside the report: class labels and subgroups fit 16 and 8 bits, and the
    # per-configuration copies of the same labels compress away
    small = {k: v.astype(np.int16 if k.endswith("/labels") else np.int8) if k.endswith(("/labels", "/groups")) else v
             for k, v in arrays.items()}
    runio.npz_save(study.examples_path, compress=True, **small)
    return res


# --------------------------------------------------------------------------------------------------
# Command line

EPILOG = """examples:
  python -m nnrand.study                                   the default grid: CUDA full size, CPU quick
  python -m nnrand.study --time-budget 480                 stop before a member would pass 480 s; rerun to resume
                                                           (480 leaves room for the timing pass and the report
                                                           inside a 10-minute command)
  python -m nnrand.study --jobs 3 --time-budget 540        three members at a time (worker processes; GPUs
                                                           spread over when several are visible)
  python -m nnrand.study --no-mps                          workers without the private CUDA MPS daemon (by
                                                           default they run under one when it can start: their
                                                           kernels overlap instead of taking turns on the GPU)
  python -m nnrand.study --quick --members 4               the small grid, 4 members per configuration
  python -m nnrand.study --smoke                           every configuration, 2 tiny CPU members (CI)
  python -m nnrand.study --configs control,impl,algo       a subset of the grid
  python -m nnrand.study --lr 0.1 --lr 0.4                 every configuration at two learning rates
  python -m nnrand.study --grid grid.toml                  a grid from a JSON/TOML file (see load_grid_file)
  python -m nnrand.study status                            members done per configuration
  python -m nnrand.study timing                            step time of native / deterministic / atomic / tree
  python -m nnrand.study report                            re-render the report from the files (trains nothing)

default grid (study.CONFIGURATIONS): control, algo, impl, algo+impl, ulp (one ULP in one weight), init, order,
aug (one seed source per member each), atomic-<op> for each of conv_wgrad, conv_dgrad, bias_grad, maxpool_bwd
(on resnet20_maxpool when the model has no max-pool, with control@ and algo@resnet20_maxpool as its seed
baselines), native, algo-bf16, impl-bf16. CUDA defaults: resnet20, synthetic 10k/10k, 20 epochs of batch 128
in a CUDA graph, the test set evaluated every 5 epochs, 10 members per configuration, 8 workers per GPU
under a private MPS daemon where one starts (17 min on one H200, 8.5 min on two), then a ~1 min timing pass; ~20 MB of run files per member, a few hundred kB without weights_epoch_*.pt and
checkpoint.pt, which a configuration no longer needs once 'report' has collected it (weights_l2.json).
CPU (--quick): small model, 128 training images, 2 epochs, 3 members. --smoke: 2 members of 2 steps each.
outputs: reports/divergence.md (CUDA), reports/divergence_quick.md (CUDA --quick), reports/divergence_cpu.md
(CPU), PNGs beside them, numbers in reports/results/<stem>.json; run directories under runs/<stem>/."""


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nnrand.study", description=__doc__.splitlines()[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("run", "report", "status", "timing"), default="run",
                   help="run (default): train what is missing, then collect and render; report: collect and "
                        "render only; status: members done per configuration; timing: the timing pass alone "
                        "(overwrites its file), then render")
    p.add_argument("--report-only", action="store_true", help="same as the 'report' command")
    g = p.add_argument_group("grid")
    g.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                   help="the small grid sizes (default on CPU)")
    g.add_argument("--smoke", action="store_true",
                   help=f"two tiny members per configuration on the CPU ({SIZES['smoke']['n_train']} training "
                        "images, one epoch), no timing pass: checks that every configuration trains, collects and "
                        "renders (what CI runs); report reports/divergence_smoke_cpu.md")
    g.add_argument("--grid", metavar="FILE", help="grid file, JSON or TOML")
    g.add_argument("--configs", help="comma-separated subset of the grid's configurations")
    g.add_argument("--members", type=int, help="members per configuration (default "
                   + ", ".join(f"{v} {k}" for k, v in MEMBERS.items()) + ")")
    g.add_argument("--lr", type=float, action="append", help="learning rate; repeat for a grid over lr")
    g.add_argument("--model", help="base model (default resnet20 on CUDA, small with --quick)")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--n-train", type=int)
    g.add_argument("--n-test", type=int)
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g = p.add_argument_group("run")
    g.add_argument("--runs-dir", help="run directories' root (default runs/<stem>)")
    g.add_argument("--out", help="report path (.md) or directory (default reports/<stem>.md by backend)")
    g.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="start no member that would end past this many seconds; exit 0 with a resume hint")
    g.add_argument("--jobs", type=_jobs, metavar="N",
                   help="train N members at a time, each in its own worker process; results are identical "
                        "either way, every member being seeded by its configuration. Default: "
                        f"{JOBS_PER_GPU} per visible GPU on CUDA (worker i uses GPU i mod count; workers on "
                        "one GPU run side by side under MPS, see --mps, and otherwise take turns), 1 on CPU "
                        "(one after another in this process; CPU workers share the cores)")
    g.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                   help="run the CUDA workers under a private CUDA MPS daemon (started for the run, stopped "
                        "after it): without MPS, processes on one GPU take turns; with it, their kernels "
                        "run side by side. Members' bits are the same either way. Default: on when there are "
                        "CUDA workers (--jobs > 1) and nvidia-cuda-mps-control is on PATH, with a note and "
                        "without it when the daemon cannot start or serve a client; --mps makes that an error, "
                        "--no-mps skips it")
    g.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="timing pass once all members are done (default on; skipped if its file exists)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return p


def worker_mps(mode: bool | None, probe: tuple[str, ...] = mps.CUDA_PROBE) -> contextlib.ExitStack:
    """The MPS daemon around a run's CUDA workers, entered: ``mode`` True (--mps) needs it and raises
    ``mps.MPSError``; None (the default) starts it when it can and says so either way on stderr; False
    (--no-mps, or no CUDA workers) does nothing. A daemon configured outside (``CUDA_MPS_PIPE_DIRECTORY``
    set) is left to serve the workers."""
    stack = contextlib.ExitStack()
    if mode is False:
        return stack
    outside = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if mode is None and outside:
        print(f"study: workers under the MPS daemon that CUDA_MPS_PIPE_DIRECTORY names ({outside})", file=sys.stderr)
        return stack
    try:
        stack.enter_context(mps.daemon(probe=probe))
    except mps.MPSError as e:
        if mode:
            raise
        print(f"study: workers without MPS (they take turns on the GPU): {e}", file=sys.stderr)
        return stack
    print("study: workers under a private CUDA MPS daemon (--no-mps: without)", file=sys.stderr)
    return stack


def status_lines(study: Study) -> list[str]:
    lines = []
    for p in study.plan:
        done = sum(member_done(study, p, m) for m in range(study.members))
        lines.append(f"{p.name:<24} {done}/{study.members} members done")
    return lines


def cli(argv: list[str] | None = None) -> int:
    from nnrand import divergence_report
    from nnrand.data import DatasetError

    p = parser()
    args = p.parse_args(argv)
    if args.report_only:
        args.command = "report"
    # deterministic cuBLAS (the timing pass's torch deterministic mode) needs this before CUDA starts
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        study = make_study(device=args.device, quick=args.quick, members=args.members, lrs=args.lr,
                           configs=[c.strip() for c in args.configs.split(",")] if args.configs else None,
                           grid_file=args.grid, runs_dir=args.runs_dir, out=args.out,
                           sizes={"model": args.model, "epochs": args.epochs, "batch_size": args.batch_size,
                                  "n_train": args.n_train, "n_test": args.n_test}, smoke=args.smoke,
                           trains=args.command in ("run", "timing"))
    except StudyError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    argv = sys.argv[1:] if argv is None else argv
    study.command = " ".join(["python -m nnrand.study", *[a for a in argv if a not in ("report", "--report-only")]])
    if args.command == "status":
        print("\n".join(status_lines(study)))
        wall = _wall_or_none(study)
        if wall:
            from nnrand.divergence_report import wall_line

            print(wall_line(wall))
        return 0
    if args.command == "timing" and not run_timing(study, quick_steps=study.backend == "cpu"):
        return 1
    outcome = {"stopped": False}
    # what a member can fail with that the user fixes (an option, the disk, the data, a damaged checkpoint)
    user_errors = (train.ConfigError, routing.RoutingError, runio.DiskSpaceError, runio.CheckpointError,
                   DatasetError)
    if args.command == "run":
        jobs = args.jobs or default_jobs(study)
        workers = study.backend == "cuda" and jobs >= 2
        if args.mps and not workers:
            p.exit(2, f"{p.prog}: error: --mps: MPS shares a GPU between worker processes; it needs the cuda "
                      f"device and --jobs > 1 (here: {study.backend}, {jobs} job{'s' * (jobs != 1)})\n")
        try:
            read_ledger(study)   # a damaged ledger stops the run before it trains, not after
        except StudyError as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        done_before = done_count(study)
        todo = len(study.plan) * study.members - done_before
        ledger = dict(started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      jobs=jobs, mps_on=False, end="failed")
        t0 = time.monotonic()
        try:
            stack = worker_mps(args.mps if workers else False)
        except mps.MPSError as e:
            p.exit(2, f"{p.prog}: error: --mps: {e}\n")
        try:
            with stack:
                ledger["mps_on"] = "CUDA_MPS_PIPE_DIRECTORY" in os.environ
                outcome = run(study, time_budget=args.time_budget, progress=args.progress, jobs=jobs)
            ledger["end"] = "stopped" if outcome["stopped"] else "finished"
        except user_errors as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        except MemberError as e:   # from a worker: the usage errors above exit the same way
            if isinstance(e.__cause__, user_errors):
                p.exit(2, f"{p.prog}: error: {e}\n")
            raise
        except KeyboardInterrupt as e:
            ledger["end"] = "interrupted"
            print(f"\n{str(e) or 'interrupted'}; rerun the same command to resume", file=sys.stderr)
            return 130
        finally:
            if todo:   # every call with members to train, however it ended: its finished members and time count
                entry = record_run(study, wall_s=time.monotonic() - t0, trained=done_count(study) - done_before,
                                   **ledger)
                if ledger["end"] in ("stopped", "finished"):
                    print(f"trained {entry['trained']} member(s) in {entry['wall_s']:.1f} s on "
                          + (f"{entry['gpus']} GPU(s)" if study.backend == "cuda" else "the CPU")
                          + f", {jobs} at a time")
        if not outcome["stopped"] and args.timing and not study.smoke and not study.timing_path.exists():
            run_timing(study, quick_steps=study.backend == "cpu")
    t_collect = time.monotonic()
    if args.command == "report" and not study.runs_dir.exists():
        if not study.results_path.exists():
            p.exit(2, f"{p.prog}: error: neither {study.runs_dir} nor {study.results_path} exists\n")
        res = json.loads(study.results_path.read_text())   # render from the results file alone
    else:
        res = collect(study)
    t_render = time.monotonic()
    path = divergence_report.render(res, study.report_path, study.examples_path)
    print(f"report: {path} (collected in {t_render - t_collect:.1f} s, rendered in {time.monotonic() - t_render:.1f} s)")
    if outcome["stopped"]:
        print(f"time budget reached after {outcome['trained']} members; {outcome['remaining']} remain: "
              f"resume with the same command")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
