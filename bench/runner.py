"""The benchmark machinery: what gets measured (the plan), and measuring one subject on one case.

A *subject* is one thing that computes an op: a registry variant, or a peer from the op's spec
(PyTorch's own op, CuPy/CUB, ...). Peers whose name starts with ``torch`` are also measured in torch's
deterministic mode as ``<name>_deterministic`` unless the spec lists that name itself. Everything is
derived from ``kernels.ops()``, ``kernels.variants(op)`` and ``kernels.spec(op)``; nothing here names an
op or a variant (the report's ratios take the variant named ``atomic`` as each op's baseline).

For every subject and case this measures, on one fixed input:

* variance: ``repeats`` calls -> :class:`bench.metrics.VarianceTracker` (distinct results, ...);
* error of the first result against the op's float64 reference;
* latency: CUDA-event median on CUDA (cold L2), else the host median; plus pytest-benchmark's own
  synchronized host timing when a ``benchmark`` fixture is given;
* bandwidth (``spec.bytes_moved``) and FLOP rate (``spec.flops``) from the latency.

``Settings.dtype`` ``bf16`` / ``fp16``: every float32 tensor the op's ``make_inputs`` draws (or those
``spec.half_inputs`` names: bn_bwd's dy and x) is rounded to that dtype before anything runs (the subjects see half inputs, as under ``torch.autocast``; nnrand's variants
sum in float32 and round each output once, see ``kernels/registry.py``); the float64 reference is taken on
those half inputs, and the bytes moved count each half tensor at its own size (:func:`half_bytes`).
"""
from __future__ import annotations

import functools

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from kernels.registry import Case
from nnrand.fingerprint import row_fingerprint

from . import results
from .metrics import VarianceTracker, parts, reference_error
from .timing import Ceilings, L2Flush, host_times, measure_ceilings, median, queued_event_times, synced, \
    synchronize, torch_mode

# --------------------------------------------------------------------------------------------------
# Settings

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Settings:
    backend: str                 # "cuda" (kernels on the GPU) or "cpu" (the CPU order models)
    scale: str                   # bench_cases scale: "gpu", "quick" or "cpu"
    quick: bool
    repeats: int                 # variance repeats per subject (fewer only where the budget runs out)
    min_repeats: int             # never fewer than this, whatever the budget
    variance_budget_s: float     # wall time allowed for the variance repeats of one subject
    event_rounds: int            # CUDA-event timed calls per subject
    rounds: int                  # pytest-benchmark rounds per subject (at most)
    timing_budget_s: float       # wall time allowed for the host-timed rounds of one subject
    warmup: int                  # untimed calls before measuring (cuDNN autotuning happens here)
    dtype: str = "float32"       # inputs: "float32", or "bf16" / "fp16" (float32 inputs rounded to it)
    ceiling_copy_bytes: int | None = None   # None: 1 GiB on CUDA, 64 MiB on the CPU
    ceiling_matmul_n: int | None = None     # None: 8192 on CUDA, 1024 on the CPU

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self.backend == "cuda" else "cpu")

    @classmethod
    def make(cls, backend: str | None = None, quick: bool | None = None, repeats: int | None = None,
             dtype: str | None = None, **overrides) -> "Settings":
        """Defaults for the backend: ``auto`` / None picks CUDA when CUDA kernels can run here.

        Full GPU run: 100 repeats within 4 s per subject (a 1.2 ms cuDNN dgrad: 100 in 0.12 s), so every
        registered op fits in the 10-minute budget. CPU: the models are 10^3-10^5 x slower than the
        kernels, so repeats and timing rounds are budgeted by time (at least 3 repeats) and the run
        finishes in minutes on 2 cores."""
        if backend in (None, "auto"):
            backend = os.environ.get("NNRAND_BENCH_BACKEND", "auto")
        if backend == "auto":
            backend = "cuda" if kernels.cuda_available() else "cpu"
        if backend not in ("cuda", "cpu"):
            raise ValueError(f"unknown backend {backend!r}; use cuda, cpu or auto")
        if backend == "cuda" and not kernels.cuda_available():
            raise RuntimeError("backend cuda asked for, but CUDA kernels cannot run here (no CUDA device or no CuPy)")
        if quick is None:
            quick = os.environ.get("NNRAND_BENCH_QUICK", "") not in ("", "0")
        dtype = dtype or os.environ.get("NNRAND_BENCH_DTYPE") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"unknown input dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if backend == "cuda":
            base = dict(scale="quick" if quick else "gpu", repeats=30 if quick else 100, min_repeats=10,
                        variance_budget_s=2.0 if quick else 4.0, event_rounds=20 if quick else 50,
                        rounds=10 if quick else 30, timing_budget_s=1.0 if quick else 2.0, warmup=3)
        else:
            base = dict(scale="cpu", repeats=20 if quick else 100, min_repeats=3,
                        variance_budget_s=0.5 if quick else 1.0, event_rounds=0,
                        rounds=5 if quick else 10, timing_budget_s=0.3 if quick else 0.4, warmup=1)
        if repeats is not None:
            if repeats < 1:
                raise ValueError(f"repeats must be >= 1, got {repeats}")
            base["repeats"] = repeats
            base["min_repeats"] = min(base["min_repeats"], repeats)
        base.update(overrides)
        return cls(backend=backend, quick=quick, dtype=dtype, **base)


# --------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Subject:
    op: str
    name: str
    kind: str                       # "variant" or "peer"
    fn: Callable[..., torch.Tensor]
    mode: str                       # torch_mode() it runs under
    deterministic: bool | None      # the registry's claim for variants; peers: True in deterministic mode
    extra: tuple[tuple[str, object], ...] = ()   # keyword arguments fn adds to every call (the spec's)

    def __call__(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return self.fn(*args, **kwargs)


def subjects(op: str) -> list[Subject]:
    """The op's variants (registration order), then its peers."""
    spec = kernels.spec(op)
    out = []
    for v in kernels.variants(op):
        extra = spec.bench_kwargs_of(v.name)
        out.append(Subject(op, v.name, "variant", functools.partial(v, **extra) if extra else v, "fast",
                           v.deterministic, tuple(extra.items())))
    peers = spec.peers()
    for name, fn in peers.items():
        det = name.endswith("deterministic")
        out.append(Subject(op, name, "peer", fn, "deterministic" if det else "fast", True if det else None))
        twin = f"{name}_deterministic"
        if name.startswith("torch") and not det and twin not in peers:
            out.append(Subject(op, twin, "peer", fn, "deterministic", True))
    return out


@dataclass(frozen=True)
class Item:
    """One benchmark test: a subject on a case, or an op that cannot be benchmarked (``skip``)."""
    op: str
    case: Case | None
    subject: Subject | None
    skip: str = ""

    @property
    def id(self) -> str:
        if self.case is None:
            return f"{self.op}/-"
        return f"{self.op}/{self.case.name}/{self.subject.name}"


def plan(settings: Settings) -> list[Item]:
    """Every (op, case, subject) of the registry, grouped by case so each input is made once."""
    items = []
    for op in kernels.ops():
        try:
            spec = kernels.spec(op)
        except KeyError:
            items.append(Item(op, None, None, skip=f"op {op!r} has variants but no op spec "
                                                     "(no inputs, reference or cases to benchmark)"))
            continue
        subs = subjects(op)
        for case in spec.bench_cases(settings.scale):
            items.extend(Item(op, case, s) for s in subs)
    return items


# --------------------------------------------------------------------------------------------------
# Measuring


def layout_of_case(case: Case) -> str:
    p = case.params
    return str(p.get("layout", p.get("memory_format", "")))


@dataclass
class Session:
    """State shared by the benchmarks of one run: settings, the current case's inputs and reference,
    the ceilings, and the result rows."""
    settings: Settings
    rows: list[dict] = field(default_factory=list)
    planned: int = 0         # benchmarks in the plan, and how many of them were measured (or tried)
    attempted: int = 0
    ceilings: Ceilings | None = None
    _case_id: str | None = None
    _inputs: tuple | None = None
    _reference: torch.Tensor | None = None
    _flush: L2Flush | None = None

    def ensure_ceilings(self) -> Ceilings:
        if self.ceilings is None:
            dev = self.settings.device
            self.ceilings = measure_ceilings(dev, copy_bytes=self.settings.ceiling_copy_bytes,
                                             matmul_n=self.settings.ceiling_matmul_n)
            base = self._base(None, None, kind="ceiling")
            self.rows.append({**base, "variant": "copy", "metric": "bandwidth", "value": self.ceilings.bandwidth,
                              "unit": "B/s", "note": f"device-to-device copy of {self.ceilings.copy_bytes} bytes "
                                                     "(bytes read + written)"})
            n = self.ceilings.matmul_n
            self.rows.append({**base, "variant": "matmul", "metric": "flop_rate", "value": self.ceilings.flop_rate,
                              "unit": "FLOP/s", "note": f"float32 matmul {n}x{n}x{n}, TF32 off"})
        return self.ceilings

    def inputs(self, case: Case) -> tuple[tuple, dict]:
        if self._case_id != case.id:
            self._inputs = self._reference = None
            if self.settings.device.type == "cuda":
                torch.cuda.empty_cache()
            spec = kernels.spec(case.op)
            args, kwargs = spec.make_inputs(case, self.settings.device)
            self._inputs = to_dtype(args, kwargs, DTYPES[self.settings.dtype], spec.half_inputs)
            self._case_id = case.id
        return self._inputs

    def reference(self, case: Case) -> torch.Tensor:
        args, kwargs = self.inputs(case)
        if self._reference is None:
            self._reference = kernels.spec(case.op).reference(args, kwargs)
        return self._reference

    def flush(self) -> L2Flush | None:
        if self.settings.device.type != "cuda":
            return None
        if self._flush is None:
            self._flush = L2Flush(self.settings.device)
        return self._flush

    def _base(self, case: Case | None, subject: Subject | None, kind: str | None = None) -> dict:
        s = self.settings
        row = {"op": case.op if case else (subject.op if subject else ""), "variant": subject.name if subject else "",
               "kind": kind or (subject.kind if subject else ""), "case": case.name if case else "",
               "params": results.params_json(case.params) if case else "",
               "layout": layout_of_case(case) if case else "",
               "contention": case.contention if case and case.contention is not None else math.nan,
               "deterministic": "" if subject is None or subject.deterministic is None else subject.deterministic,
               "mode": subject.mode if subject else "", "backend": s.backend, "scale": s.scale, "dtype": s.dtype,
               "repeats": math.nan, "note": ""}
        if case is not None:
            spec = kernels.spec(case.op)
            row["case_bytes"] = float(spec.bytes_moved(case))
            row["case_flops"] = float(spec.flops(case)) if spec.flops is not None else math.nan
        return {**row, **row_fingerprint()}

    def record_skip(self, item: Item, reason: str, metric: str = "skipped") -> None:
        base = self._base(item.case, item.subject)
        if item.case is None:
            base["op"] = item.op
        self.rows.append({**base, "metric": metric, "value": math.nan, "unit": "", "note": reason})

    def measure(self, item: Item, benchmark=None) -> list[dict]:
        """Measure one subject on one case; returns (and records) its rows. A peer that cannot run here
        raises :class:`Unavailable` after recording a ``skipped`` row; any other error is recorded as a
        ``failed`` row (so the report shows it) and raised."""
        self.attempted += 1
        try:
            return self._measure(item, benchmark)
        except Unavailable:
            raise
        except Exception as e:
            self.record_skip(item, _reason(e), metric="failed")
            raise

    def _measure(self, item: Item, benchmark) -> list[dict]:
        if item.skip:
            self.record_skip(item, item.skip)
            raise Unavailable(item.skip)
        s, case, sub = self.settings, item.case, item.subject
        dev = s.device
        self.ensure_ceilings()
        args, kwargs = self.inputs(case)
        call = lambda: sub(args, kwargs)  # noqa: E731
        rows: list[dict] = []
        with torch_mode(sub.mode):
            try:
                first = call()
                synchronize(dev)
            except Exception as e:  # a variant's failure is a failure; a peer may be unavailable here
                if sub.kind == "variant":
                    raise
                reason = _reason(e)
                self.record_skip(item, reason)
                raise Unavailable(f"{item.id}: {reason}") from e
            try:
                parts(first)  # a tensor, or a tuple of tensors (an op with several outputs)
            except TypeError:
                raise TypeError(f"{item.id} returned {type(first).__name__}, expected a torch.Tensor or a "
                                "tuple of them") from None
            out_parts = parts(first)
            del first
            for _ in range(s.warmup - 1):
                call()
            synchronize(dev)

            # variance: the same input, repeated; the budget trims repeats only for slow subjects
            tracker = VarianceTracker(store_bytes=(8 << 30) if dev.type == "cuda" else (1 << 30))
            t0 = time.perf_counter()
            for i in range(s.repeats):
                tracker.add(call())
                if i + 1 >= s.min_repeats and time.perf_counter() - t0 > s.variance_budget_s:
                    break
            synchronize(dev)
            per_call = max(1e-7, (time.perf_counter() - t0) / tracker.repeats)
            n = tracker.repeats
            var = tracker.summary()
            err = reference_error(tracker.first, self.reference(case))
            del tracker

            # latency
            if dev.type == "cuda":
                times, host_included = queued_event_times(call, s.event_rounds, dev, flush=self.flush())
                latency, how = median(times), f"CUDA events, median of {len(times)} (L2 flushed)"
                if host_included:
                    how += f"{results.NOTE_SEP}includes host time (the call waits for the GPU)"
            else:
                times = []
                latency, how = math.nan, ""
            rounds = int(max(3, min(s.rounds, s.timing_budget_s / per_call)))
            host = None
            if benchmark is not None:
                benchmark.extra_info.update({"op": sub.op, "variant": sub.name, "kind": sub.kind,
                                             "case": case.name, "mode": sub.mode})
                benchmark.pedantic(synced(call, dev), rounds=rounds, warmup_rounds=1, iterations=1)
                stats = getattr(benchmark, "stats", None)
                if stats is not None and getattr(stats, "stats", None) is not None:
                    host = float(stats.stats.median)
            if host is None:
                host = median(host_times(call, rounds, dev))
            if math.isnan(latency):
                latency, how = host, f"host clock, median of {rounds}"

        base = self._base(case, sub)
        if s.dtype != "float32":
            base["case_bytes"] = half_bytes(base["case_bytes"], (args, kwargs), out_parts)
        add = lambda metric, value, **kw: rows.append(  # noqa: E731
            {**base, "metric": metric, "value": float(value), "unit": results.UNITS[metric], **kw})
        if sub.extra:
            how += results.NOTE_SEP + "called with " + ", ".join(f"{k}={v!r}" for k, v in sub.extra)
        add("latency", latency, note=how)
        add("latency_host", host, note=f"pytest-benchmark/host clock, each call synchronized, median of {rounds}")
        if base["case_bytes"] and latency > 0:
            add("bandwidth", base["case_bytes"] / latency)
        if not math.isnan(base["case_flops"]) and latency > 0:
            add("flop_rate", base["case_flops"] / latency)
        for k, v in var.items():
            add(k, v, repeats=n)
        for k, v in err.items():
            add(k, v)
        if benchmark is not None:
            benchmark.extra_info.update({"latency_s": latency, "latency_how": how, **var, **err, "repeats": n})
        self.rows.extend(rows)
        return rows

    def table(self):
        """The rows so far as the result table, with the derived metrics (ratios, ceiling fractions)."""
        return results.derive(results.frame(self.rows))


def to_dtype(args: tuple, kwargs: dict, dtype: torch.dtype, positions: tuple[int, ...] | None = None):
    """(args, kwargs) with every float32 tensor rounded to ``dtype`` (round to nearest even), or only the
    positional ones at ``positions`` (``OpSpec.half_inputs``: what autocast makes half); the rest as is."""
    if dtype == torch.float32:
        return args, kwargs
    conv = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a  # noqa: E731
    if positions is not None:
        return tuple(conv(a) if i in positions else a for i, a in enumerate(args)), kwargs
    return tuple(conv(a) for a in args), {k: conv(a) for k, a in kwargs.items()}


def half_bytes(spec_bytes: float, inputs: tuple[tuple, dict], outputs) -> float:
    """Bytes moved with half inputs: ``spec.bytes_moved`` counts every floating tensor once at 4 bytes per
    element, so each half input and each half output is counted again at 2 (its own ``nbytes``) and the
    2 bytes per element it does not move are taken off. NaN where that leaves nothing (a spec that does
    not count some tensor)."""
    args, kwargs = inputs
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)] + list(outputs)
    saved = sum(t.numel() * t.element_size() for t in tensors if t.dtype in (torch.bfloat16, torch.float16))
    left = spec_bytes - saved
    return float(left) if left > 0 or spec_bytes == saved == 0 else math.nan


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


class Unavailable(Exception):
    """A subject that cannot run on this machine (the reason is recorded as a ``skipped`` row)."""
