"""Where the time of a recorded training step goes: nnrand.trace's cost taken apart.

    python3 bench/dev/trace_host_cost.py                          # resnet18, batch 128, tree kernels
    python3 bench/dev/trace_host_cost.py --profile 30             # plus cProfile's top 30 under ops="all"
    python3 bench/dev/trace_host_cost.py --profile 30 --profile-mode routed   # ... under ops="routed"
    python3 bench/dev/trace_host_cost.py --kineto 15              # plus the GPU's top 15 kernels, routed and all
    python3 bench/dev/trace_host_cost.py --split                  # plus host time per thread: op, record, rest
    python3 bench/dev/trace_host_cost.py --parts                  # only the host time of a record's pieces
    python3 bench/dev/trace_host_cost.py --cost 5 --steps 40      # only trace.recording_cost, as the report runs it
    python3 bench/dev/trace_host_cost.py --cost 5 --steps 40 --cuda-graph   # the same, steps replayed from graphs
    python3 bench/dev/trace_host_cost.py --kernel-gbs             # only the fingerprint kernel's device time
    python3 bench/dev/trace_host_cost.py --routed-split           # host time of each piece of ops="routed"
    python3 bench/dev/trace_host_cost.py --routed-parts 8         # ops="routed"'s step cost taken apart
    python3 bench/dev/trace_host_cost.py --all-split              # ... of ops="all"
    python3 bench/dev/trace_host_cost.py --launches               # ops="all"'s deferred launches, call by call
    python3 bench/dev/trace_host_cost.py --sink-parts             # the host time of the trace sink's pieces

Per mode, the median step time (synchronised; CUDA on a GPU) over ``--steps`` steps after 3 warm-up steps,
each step as ``trace.recording_cost`` times it (forward, backward, optimizer step, parameter snapshot):

    none     no recording
    null     a dispatch mode that only calls each op (the price of intercepting every op in Python)
    lean     the same, dispatched as the recorder's mode is (no per-call dynamo-disabling wrapper): what
             the recorder adds is its cost over this one
    hooks    only the recorder's module naming (the model's forwards wrapped: the module stack and the
             autograd nodes' paths)
    ghooks   the same by global module hooks (what a recorder without a model installs)
    routed   trace.record(ops="routed")
    all      trace.record(ops="all")
    observe        (--routed-parts) a routing.observe observer that does nothing
    routed_nosnap  (--routed-parts) trace.record(ops="routed") without the parameter snapshot

and the host time of one record's fingerprint alone (``trace.record_values`` on a 128x64x32x32 tensor).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# NNRAND_ROOT: another checkout's nnrand and kernels (an A/B of two commits with this script)
sys.path.insert(0, os.environ.get("NNRAND_ROOT") or str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from nnrand import noise, routing, trace, train  # noqa: E402


class Split:
    """Host time inside the recorder's dispatch, per thread (forward/optimizer on the main thread, backward on
    autograd's device thread): calling the op, recording its outputs (``_add``), and the rest of the step."""

    def __init__(self):
        self.op, self.add, self.calls, self.records = {}, {}, {}, {}
        self.by_op: dict[str, list[float]] = {}   # aten op: [calls, s calling, s recording] over the run

    def install(self):
        rec_dispatch, rec_add = trace.Recorder.__torch_dispatch__, trace.Recorder._add
        split = self

        def dispatch(self, func, types, args=(), kwargs=None):
            th = threading.current_thread().name
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            t1 = time.perf_counter()
            split.op[th] = split.op.get(th, 0.0) + (t1 - t0)
            split.calls[th] = split.calls.get(th, 0) + 1
            try:
                return rec_dispatch(self, _Done(func, out), types, args, kwargs)
            finally:
                t2 = time.perf_counter()
                split.add[th] = split.add.get(th, 0.0) + (t2 - t1)
                row = split.by_op.setdefault(func._overloadpacket.__name__, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += t1 - t0
                row[2] += t2 - t1

        def add(self, *a, **k):
            th = threading.current_thread().name
            split.records[th] = split.records.get(th, 0) + 1
            return rec_add(self, *a, **k)

        trace.Recorder.__torch_dispatch__, trace.Recorder._add = dispatch, add
        return lambda: (setattr(trace.Recorder, "__torch_dispatch__", rec_dispatch),
                        setattr(trace.Recorder, "_add", rec_add))

    def report(self, steps: int, null: dict[str, list[float]] | None = None, top: int = 20) -> None:
        for th in sorted(self.calls):
            print(f"  thread {th}: {self.calls[th] / steps:.0f} ops and {self.records.get(th, 0) / steps:.0f} "
                  f"records per step; {self.op[th] / steps * 1e3:.2f} ms calling ops, "
                  f"{self.add[th] / steps * 1e3:.2f} ms recording per step")
        null = null or {}
        print(f"  the {top} aten ops of most host time per step (us per call: calling it under the null mode, "
              "calling it recorded, recording it):")
        rows = sorted(self.by_op.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]
        for name, (n, call, add) in rows:
            nn, ncall = null.get(name, (0, 0.0))
            print(f"    {name:40s} {n / steps:5.0f}/step {ncall / max(nn, 1) * 1e6:8.1f} {call / n * 1e6:8.1f} "
                  f"{add / n * 1e6:8.1f}  ({(call + add) / steps * 1e3:.2f} ms/step)")


class TimedNull(TorchDispatchMode):
    """The null mode, timing each aten op's call: by_op[name] = [calls, seconds]."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, list[float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        row = self.by_op.setdefault(func._overloadpacket.__name__, [0, 0.0])
        row[0] += 1
        row[1] += time.perf_counter() - t0
        return out


class _Done:
    """An op already called: the recorder's dispatch gets its output instead of calling it again."""

    def __init__(self, func, out):
        self.func, self.out, self._overloadpacket, self._schema = func, out, func._overloadpacket, func._schema

    def __hash__(self):   # the recorder's per-op caches see the op
        return hash(self.func)

    def __eq__(self, other):
        return self.func == (other.func if isinstance(other, _Done) else other)

    def __call__(self, *args, **kwargs):
        return self.out


class NullMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class LeanNullMode(TorchDispatchMode):
    """A mode that only calls each op, dispatched as the recorder's is: without torch's per-call
    dynamo-disabling wrapper (``_should_skip_dynamo``), dynamo's frame callback off around the call."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = trace._set_eval_frame(None)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            trace._set_eval_frame(prior)


@contextlib.contextmanager
def hooks_only(model: torch.nn.Module | None):
    """The module naming an ops="all" recorder installs, without recording: the model's forwards wrapped,
    or (``model`` None) the global module hooks it installs without a model."""
    rec = trace.Recorder(ops="all", model=model)
    rec._name_modules()
    try:
        yield None
    finally:
        rec._remove_hooks()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def model_and_batch(cfg):
    """(device, x, y, model, optimizer, named parameters): ``cfg``'s model and a seeded batch of 32 x 32
    images, as every mode's steps take them."""
    dev = torch.device(cfg.device)
    seeds = noise.member_seeds({s: "fixed" for s in ("init", "order", "aug")} | {"kernel": 0}, cfg.seed, 0)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(cfg.batch_size, 3, 32, 32, device=dev, generator=g)
    y = torch.randint(0, 10, (cfg.batch_size,), device=dev, generator=g)
    model, opt = train.build(cfg, seeds, 10, torch.contiguous_format)
    return dev, x, y, model, opt, list(model.named_parameters())


def steps_ms(cfg, mode: str, steps: int, tmp: Path, profile: int = 0, kineto: int = 0,
             null: TorchDispatchMode | None = None, warmed=None) -> float:
    """Median ms per step in ``mode``; ``null``: the dispatch mode the "null" mode runs (NullMode());
    ``warmed()``: called once the warm-up steps are done (before the first timed step)."""
    dev, x, y, model, opt, named = model_and_batch(cfg)
    ctx = {"none": contextlib.nullcontext(), "null": null or NullMode(), "lean": LeanNullMode(),
           "hooks": hooks_only(model), "ghooks": hooks_only(None),
           "observe": contextlib.nullcontext(),
           "routed": trace.record(tmp / "r.trace", ops="routed", model=model),
           "routed_nosnap": trace.record(tmp / "r.trace", ops="routed", model=model),
           "all": trace.record(tmp / "a.trace", ops="all", model=model)}[mode]
    times = []
    prof = cProfile.Profile() if profile else None
    act = torch.profiler.ProfilerActivity.CUDA if dev.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    kin = torch.profiler.profile(activities=[act]) if kineto else None
    with routing.use_kernels(cfg.kernel, cfg.kernel_ops, strict=cfg.strict), ctx as rec, \
            (routing.observe(lambda op, out, args: None) if mode == "observe" else contextlib.nullcontext()):
        for i in range(steps + 3):
            if isinstance(rec, trace.Recorder):
                rec.step()
            sync(dev)
            if warmed is not None and i == 3:
                warmed()
            if prof is not None and i >= 3:
                prof.enable()
            if kin is not None and i == 3:
                kin.__enter__()
            t = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if isinstance(rec, trace.Recorder) and mode != "routed_nosnap":
                rec.snapshot(named)
            sync(dev)
            if i >= 3:
                times.append((time.perf_counter() - t) * 1e3)
            if prof is not None:
                prof.disable()
    if kin is not None:
        kin.__exit__(None, None, None)
        print(f"\nGPU kernels, ops={mode}, {steps} steps, top {kineto} by device time:")
        print(kin.key_averages().table(sort_by="self_device_time_total", row_limit=kineto))
    if prof is not None:
        print(f"\ncProfile, ops={mode}, {steps} steps, top {profile} by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return statistics.median(times)


def routed_parts(cfg, steps: int, tmp: Path, rounds: int) -> None:
    """ops="routed"'s cost taken apart, the modes taking turns over ``rounds`` rounds (every other round in
    reverse order), each mode's cost the median over rounds of its step over the unrecorded one's:
    observe (a routing.observe observer that does nothing: the cost of handing the routed calls to Python),
    routed_nosnap (the recording without its parameter snapshot) and routed."""
    modes = ("none", "observe", "routed_nosnap", "routed")
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    ms: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        got = {m: steps_ms(cfg, m, steps, tmp) for m in (modes if r % 2 == 0 else modes[::-1])}
        for m in modes:
            ms[m].append(got[m])
            ratios[m].append(got[m] / got["none"])
    print(f"\nops='routed' taken apart ({rounds} rounds of {steps} steps, paired per round):")
    for m in modes:
        print(f"  {m:14s} {statistics.median(ms[m]):8.2f} ms/step  x{statistics.median(ratios[m]):.3f}")


def per_call_us(fn, n: int, dev: torch.device, reset=None) -> float:
    """Host microseconds per call of ``fn()`` (median of 5 batches of ``n`` calls, the device drained
    before each batch; ``reset()`` after each batch, untimed)."""
    out = []
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        if reset is not None:
            reset()
    sync(dev)
    return statistics.median(out)


def parts(dev: torch.device, n: int = 2000) -> None:
    """Host time of each piece of one record's path, on a 128x64x32x32 float32 output of ``dev`` (recorded as
    ops="all" records it: fingerprints deferred, one launch per FP_BATCH records)."""
    t = torch.randn(128, 64, 32, 32, device=dev)
    small = torch.randn(64, device=dev)
    rec = trace.Recorder(ops="all")
    rec.step()

    def reset(r: trace.Recorder = rec):   # the step's records dropped, so the batches time the same work
        r.pending.clear()
        r.rows.clear()
        for s in r.slots.values():
            s.reset()

    print(f"\nhost us per call ({dev}, median of 5 batches of {n}):")
    record = lambda: rec._add_outputs(t, "relu", "stages.0", "forward")  # noqa: E731
    rows = [("torch._C._current_autograd_node()", torch._C._current_autograd_node),
            ("torch.neg on a 64-float tensor", lambda: torch.neg(small))]
    if trace._fused(t):
        ptr = torch.empty(3, dtype=torch.float64, device=dev).data_ptr()
        rows = [("one output's record (_add_outputs)", record),
                ("its fingerprint launch alone (_launch_fingerprint)", lambda: trace._launch_fingerprint(t, ptr)),
                *rows]
    for name, fn in rows:
        print(f"  {per_call_us(fn, n, dev, reset):8.2f}  {name}")
    # ops="routed" launches a forward op's fingerprints at once (it does not see what writes its outputs next)
    routed = trace.Recorder(ops="routed")
    routed.step()
    bn = (t, small, small.clone(), torch.empty(0, device=dev))   # a training BatchNorm forward's outputs
    for name, fn in (("a routed BatchNorm forward's record (3 outputs, launched at once)",
                      lambda: routed._add_outputs(bn, "cudnn_batch_norm", "stages.0.bn1", "forward")),
                     ("t.detach()", t.detach)):
        print(f"  {per_call_us(fn, n, dev, lambda: reset(routed)):8.2f}  {name}")
    with NullMode():
        print(f"  {per_call_us(lambda: torch.neg(small), n, dev):8.2f}  torch.neg, under a dispatch mode that only "
              "calls each op")
    with LeanNullMode():
        print(f"  {per_call_us(lambda: torch.neg(small), n, dev):8.2f}  torch.neg, under the same mode dispatched as "
              "the recorder's (no dynamo-disabling wrapper)")
    rec2 = trace.Recorder(ops="all")
    with rec2:
        rec2.step()
        print(f"  {per_call_us(lambda: torch.neg(small), n, dev, lambda: reset(rec2)):8.2f}  torch.neg, recorded "
              "(ops='all')")
        reset(rec2)
    # the kernel's path with its launches left out (on a CPU too: the Python a GPU record runs besides them)
    real = trace._fused, trace._launch_fingerprints, trace._launch_deferred
    trace._fused, trace._launch_fingerprints = (lambda x: True), (lambda ts, ptrs: None)
    trace._launch_deferred = lambda d: None
    try:
        print(f"  {per_call_us(record, n, dev, reset):8.2f}  one output's record on the kernel's path, its launches "
              "left out")
    finally:
        trace._fused, trace._launch_fingerprints, trace._launch_deferred = real

def routed_split(cfg, steps: int, tmp: Path, mode: str = "routed") -> None:
    """Host time per step in each piece of an ops="routed" (or "all") recording (its methods timed from
    outside; a method called by another counts in both)."""
    pieces = ("_observe", "_owner", "_add_outputs", "_add", "_pass_ended", "_launch_deferred", "snapshot", "_flush",
              "_pre", "_post", "_take_sink", "_sink_pass_ended", "_sink_snapshot") if mode == "routed" else \
        ("__torch_dispatch__", "_add_outputs", "_add", "_launch_deferred", "snapshot", "_flush", "_Named.__call__")
    owner = {name: trace._Named if name.startswith("_Named.") else trace.Recorder for name in pieces}
    spent = {name: [0, 0.0] for name in pieces}
    real = {name: owner[name].__dict__[name.split(".")[-1]] for name in pieces}

    def timed(name):
        fn = real[name]

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name][0] += 1
                spent[name][1] += time.perf_counter() - t0
        return wrapper

    for name in pieces:
        setattr(owner[name], name.split(".")[-1], timed(name))
    def reset():   # the warm-up steps (a routing session's first two record its replay plans) not counted
        for name in pieces:
            spent[name] = [0, 0.0]

    try:
        none = steps_ms(cfg, "none", steps, tmp)
        ms = steps_ms(cfg, mode, steps, tmp, warmed=reset)
    finally:
        for name, fn in real.items():
            setattr(owner[name], name.split(".")[-1], fn)
    n = steps   # the timed steps (the counts include each step's rec.step(), made before its timer starts)
    print(f"\nops='{mode}' with its pieces timed: {ms:.2f} ms/step against {none:.2f} unrecorded; per step "
          f"(averaged over the {n} timed steps):")
    for name, (calls, sec) in spent.items():
        print(f"  {name:15s} {calls / n:6.1f} calls  {sec / n * 1e3:7.3f} ms  {sec / max(calls, 1) * 1e6:7.1f} us/call")


def sink_parts(cfg, tmp: Path, n: int = 200) -> None:
    """Host time of the trace sink's pieces (ops="routed" with a model over the replay layer), after three
    recorded steps: an empty take, a parameter snapshot in C++ (with and without the lists it is given),
    and a take of its records."""
    dev, x, y, model, opt, named = model_and_batch(cfg)
    with routing.use_kernels(cfg.kernel, cfg.kernel_ops, strict=cfg.strict), \
            trace.record(tmp / "s.trace", ops="routed", model=model) as rec:
        for _ in range(3):
            rec.step()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            rec.snapshot(named)
        if rec._sink is None:
            print("no trace sink here (no replay layer, or no CUDA)")
            return
        sink = rec._sink
        ts, mods = [t for _, t in named], [rec._sink_name(k) for k, _ in named]

        def timed(label, fn, after=None):
            sync(dev)
            spent = 0.0
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                spent += time.perf_counter() - t0
                if after is not None:
                    after()
            print(f"  {label:48s} {spent / n * 1e6:8.1f} us")

        rec.step()
        print(f"trace sink pieces ({len(named)} parameters), host us per call, mean of {n}:")
        timed("sink_take, nothing waiting", lambda: sink.sink_take(False, False, True, 0, 0))
        timed("the lists a snapshot hands over", lambda: ([t for _, t in named], [rec._sink_name(k) for k, _ in named]))
        timed("sink_snapshot alone (then an untimed take)", lambda: sink.sink_snapshot(ts, 0, mods),
              lambda: (rec._take_sink(), rec.step()))
        timed("Recorder.snapshot (then an untimed take)", lambda: rec.snapshot(named),
              lambda: (rec._take_sink(), rec.step()))
        timed("Recorder._take_sink of a snapshot's records", rec._take_sink,
              lambda: (rec.step(), sink.sink_snapshot(ts, 0, mods)))
        sink.sink_snapshot(ts, 0, mods)
        timed("Recorder._flush of a snapshot's records", rec._flush, lambda: sink.sink_snapshot(ts, 0, mods))


def launches(cfg, steps: int, tmp: Path) -> None:
    """Host time of each deferred fingerprint launch under ops="all", per thread: the launch
    (``trace._launch_batch``), the wait of torch's stream for it (``trace._wait_for``) and the whole call
    (``trace._launch_deferred``), with the tensors and bytes of its batch."""
    real = {name: getattr(trace, name) for name in ("_launch_deferred", "_launch_batch", "_wait_for")}
    calls: list[dict] = []

    def timed(name):
        fn = real[name]

        def wrapper(*a, **k):
            outer = name == "_launch_deferred"
            if outer:
                inside.pieces = {}
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                us = (time.perf_counter() - t0) * 1e6
                pieces = getattr(inside, "pieces", None)
                if outer:
                    d = a[0]
                    calls.append({"thread": threading.current_thread().name, "us": us, "tensors": len(d.held),
                                  "mb": d.nbytes / 1e6, "blocks": d.blocks, **pieces})
                    inside.pieces = None
                elif pieces is not None:   # (a snapshot's batch launches are not a deferred launch's)
                    pieces[name] = pieces.get(name, 0.0) + us
        return wrapper

    inside = threading.local()   # per thread: the pieces of the deferred launch under way, or None
    for name in real:
        setattr(trace, name, timed(name))
    try:
        ms = steps_ms(cfg, "all", steps, tmp)
    finally:
        for name, fn in real.items():
            setattr(trace, name, fn)
    per_step = len(calls) / (steps + 3)
    print(f"\nops='all', {ms:.2f} ms/step: {per_step:.1f} deferred launches per step; the last step's, in order "
          "(us of host time: whole call, _launch_batch, _wait_for):")
    last = calls[-round(per_step):] if per_step else []
    for c in last:
        print(f"  {c['thread']:>16s} {c['us']:8.1f} {c.get('_launch_batch', 0):8.1f} {c.get('_wait_for', 0):8.1f}  "
              f"{c['tensors']:3d} tensors {c['mb']:8.1f} MB {c['blocks']:6d} blocks")
    us = sorted(c["us"] for c in calls)
    if us:
        print(f"  over every step: median {statistics.median(us):.1f} us, max {us[-1]:.1f} us, "
              f"{sum(us) / (steps + 3) / 1e3:.2f} ms per step")


def kernel_gbs(reps: int = 100) -> None:
    """Device time per fingerprint launch (``bench.timing.cuda_event_times``: CUDA events, launches queued
    behind a spin kernel; median of ``reps``) and the bytes read per second: one tensor per launch of
    ``fingerprint``, and 96 tensors per launch of ``fingerprint_batch``."""
    from bench import timing

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    out = torch.empty(96, 3, dtype=torch.float64, device=dev)
    ptrs = [out[i].data_ptr() for i in range(96)]

    def us(fn) -> float:
        return timing.median(timing.cuda_event_times(fn, reps, dev)) * 1e6

    print(f"\nfingerprint kernel device time ({torch.cuda.get_device_name()}, median of {reps} launches):")
    for shape in ((64, 1024), (128, 64, 32, 32), (128, 128, 16, 16, 2), (32, 1 << 20)):
        t = torch.randn(*shape, device=dev, generator=g)
        one = us(lambda: trace._launch_fingerprint(t, ptrs[0]))
        print(f"  one {'x'.join(map(str, shape)):>18s} float32: {one:8.1f} us  {t.numel() * 4 / one / 1e3:7.0f} GB/s")
    for numel in (1 << 16, 1 << 20):
        ts = [torch.randn(numel, device=dev, generator=g) for _ in range(96)]
        batch = us(lambda: trace._launch_fingerprints(ts, ptrs))
        print(f"  96 x {numel:>9d} float32 (batch): {batch:8.1f} us  {96 * numel * 4 / batch / 1e3:7.0f} GB/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kernel", default="tree")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's top N under --profile-mode")
    p.add_argument("--profile-mode", default="all", choices=("routed", "all"))
    p.add_argument("--kineto", type=int, default=0, metavar="N",
                   help="the top N GPU kernels by device time under ops='routed' and 'all' (torch.profiler)")
    p.add_argument("--split", action="store_true",
                   help="host time per thread in calling ops and in recording them, under ops='all'")
    p.add_argument("--parts", action="store_true",
                   help="host time of each piece of one record's path (a record, its launch, a dispatch) and exit")
    p.add_argument("--cost", type=int, default=0, metavar="ROUNDS",
                   help="only trace.recording_cost (the report's measurement) over ROUNDS rounds of --steps steps")
    p.add_argument("--kernel-gbs", action="store_true", help="only the fingerprint kernel's device time and GB/s")
    p.add_argument("--routed-split", action="store_true", help="only the host time of ops='routed' by piece")
    p.add_argument("--all-split", action="store_true", help="only the host time of ops='all' by piece")
    p.add_argument("--launches", action="store_true",
                   help="only the host time of ops='all''s deferred fingerprint launches, call by call")
    p.add_argument("--routed-parts", type=int, default=0, metavar="ROUNDS",
                   help="only ops='routed' taken apart (observer alone, without the snapshot), paired rounds")
    p.add_argument("--sink-parts", action="store_true", help="only the host time of the trace sink's pieces")
    p.add_argument("--cuda-graph", action="store_true", help="--cost with each mode's steps replayed from a graph")
    p.add_argument("--tmp", default="/tmp/nnrand-trace-cost")
    a = p.parse_args(argv)
    cfg = train.resolve(train.Config(model=a.model, batch_size=a.batch, kernel=a.kernel, device=a.device,
                                     cuda_graph=a.cuda_graph))
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    if a.parts:
        parts(dev)
        return 0
    if a.kernel_gbs:
        kernel_gbs()
        return 0
    if a.routed_parts:
        routed_parts(cfg, a.steps, tmp, a.routed_parts)
        return 0
    if a.launches:
        launches(cfg, a.steps, tmp)
        return 0
    if a.sink_parts:
        sink_parts(cfg, tmp)
        return 0
    if a.routed_split or a.all_split:
        routed_split(cfg, a.steps, tmp, "routed" if a.routed_split else "all")
        return 0
    if a.cost:
        cost = trace.recording_cost(cfg, a.steps, tmp, rounds=a.cost)
        base = cost["none"]["ms_per_step"]
        print(f"recording_cost ({trace.__file__}, {a.cost} rounds of {a.steps} steps):", "  ".join(
            f"{m} {c['ms_per_step']:.2f} ms ({c['ms_per_step'] / base:.3f}x, "
            f"paired {c.get('ratio', float('nan')):.3f}x)"
            for m, c in cost.items()))
        return 0
    t = torch.randn(128, 64, 32, 32, device=dev)
    for _ in range(20):
        trace.record_values(t)
    sync(dev)
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        trace.record_values(t)
    host = (time.perf_counter() - t0) / n * 1e6
    sync(dev)
    gpu = (time.perf_counter() - t0) / n * 1e6
    print(f"record_values on 128x64x32x32 float32 ({dev}): {host:.1f} us host per call, {gpu:.1f} us with the device")
    base = None
    for mode in ("none", "null", "lean", "ghooks", "hooks", "routed", "all"):
        ms = steps_ms(cfg, mode, a.steps, tmp)
        base = base or ms
        print(f"{mode:7s} {ms:8.2f} ms/step  {ms / base:5.2f}x", flush=True)
    if a.kineto:
        steps_ms(cfg, "none", a.steps, tmp, kineto=a.kineto)
        steps_ms(cfg, "routed", a.steps, tmp, kineto=a.kineto)
    if a.profile and a.profile_mode == "routed":
        steps_ms(cfg, "routed", a.steps, tmp, profile=a.profile)
    if a.profile and a.profile_mode == "all" or a.kineto:
        steps_ms(cfg, "all", a.steps, tmp, profile=a.profile if a.profile_mode == "all" else 0, kineto=a.kineto)
    if a.split:
        timed = TimedNull()
        steps_ms(cfg, "null", a.steps, tmp, null=timed)
        split = Split()
        undo = split.install()
        try:
            ms = steps_ms(cfg, "all", a.steps, tmp)
        finally:
            undo()
        print(f"\nops='all' with the split timers: {ms:.2f} ms/step; per step (3 warm-up steps included, "
              f"averaged over {a.steps + 3}):")
        split.report(a.steps + 3, timed.by_op)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
