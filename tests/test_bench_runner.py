"""End to end on the CPU backend: the bench machinery measures one tiny case of every registered op,
derives its ratios and renders the report; plus the pytest glue (``--benchmark-only``) on a few items."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from bench import report, results
from bench.runner import Item, Session, Settings, Subject, Unavailable, plan, subjects

ROOT = results.ROOT


def tiny_settings(repeats: int = 3, **kw) -> Settings:
    return Settings.make(backend="cpu", repeats=repeats, variance_budget_s=0.0, timing_budget_s=0.0, rounds=3,
                         warmup=1, ceiling_copy_bytes=1 << 20, ceiling_matmul_n=64, **kw)


def smallest_case(op: str):
    spec = kernels.spec(op)
    return min(spec.test_cases(), key=spec.bytes_moved)


def specced_ops() -> list[str]:
    out = []
    for op in kernels.ops():
        try:
            kernels.spec(op)
        except KeyError:
            continue
        out.append(op)
    return out


def test_settings_defaults_and_plan_follow_the_registry():
    s = Settings.make(backend="cpu")
    assert s.scale == "cpu" and s.repeats == 100 and s.device == torch.device("cpu")
    assert Settings.make(backend="cpu", repeats=7).repeats == 7
    with pytest.raises(ValueError):
        Settings.make(backend="cpu", repeats=0)
    items = plan(s)
    for op in kernels.ops():
        mine = [it for it in items if it.op == op]
        if op not in specced_ops():
            assert len(mine) == 1 and mine[0].skip
            continue
        names = {it.subject.name for it in mine}
        assert {v.name for v in kernels.variants(op)} <= names
        for peer in kernels.spec(op).peers():
            assert peer in names
            if peer.startswith("torch") and not peer.endswith("deterministic"):
                assert f"{peer}_deterministic" in names
        assert len({it.id for it in mine}) == len(mine)


def test_one_tiny_case_per_registered_op(tmp_path):
    session = Session(tiny_settings())
    ops = specced_ops()
    assert ops, "no op has a spec"
    for op in ops:
        case = smallest_case(op)
        for sub in subjects(op):
            try:
                rows = session.measure(Item(op, case, sub))
            except Unavailable:
                continue
            got = {r["metric"]: r["value"] for r in rows}
            for m in ("latency", "latency_host", "distinct_results", "err_max_abs", "err_rel_l2"):
                assert m in got, (op, sub.name, m)
            assert got["latency"] > 0
            if sub.kind == "variant" and sub.deterministic:
                assert got["distinct_results"] == 1.0, (op, sub.name)
                assert got["max_ulp"] == 0.0, (op, sub.name)
    df = session.table()
    measured = df[df["kind"] == "variant"]
    assert set(measured["op"]) == set(ops)
    assert {"ratio_atomic", "bandwidth_frac"} <= set(df["metric"])
    assert (df[df["kind"] == "ceiling"]["value"] > 0).all()
    for field in ("torch", "numba", "git_sha", "date"):
        assert (df[field].astype(str) != "").all()
    md = report.render(df, tmp_path / "kernels_cpu.md", plots=False)
    assert "CPU order models" in md
    for op in ops:
        assert f"### {op}" in md


def test_variant_bench_kwargs_reach_that_variant_only_and_the_report(tmp_path):
    """A spec's per-variant benchmark arguments are added to that variant's calls over the op-wide ones,
    named in its latency note, and listed under the op's table; the other variants are called as
    before."""
    spec = kernels.spec("sum")
    assert spec.bench_kwargs_of("exact") == {"check_range": False}
    assert spec.bench_kwargs_of("tree") == {}
    index_add = kernels.spec("index_add")
    assert index_add.bench_kwargs_of("sorted") == dict(index_add.bench_kwargs) != {}
    subs = {s.name: s for s in subjects("sum")}
    assert subs["exact"].extra == (("check_range", False),) and subs["tree"].extra == ()
    session = Session(tiny_settings())
    case = smallest_case("sum")
    for name in ("atomic", "exact", "tree"):
        session.measure(Item("sum", case, subs[name]))
    df = session.table()
    notes = df[(df["metric"] == "latency")].set_index("variant")["note"]
    assert notes["exact"].endswith(f"{results.NOTE_SEP}called with check_range=False")
    assert results.NOTE_SEP not in notes["tree"]
    md = report.render(df, tmp_path / "kernels_cpu.md", plots=False)
    assert "- exact: called with check_range=False (every case)" in md
    assert "- tree:" not in md


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_inputs_one_tiny_case_per_registered_op(tmp_path, dtype):
    """``--bench-dtype``: every variant runs on half inputs (a variant that cannot is a failure, raised),
    deterministic ones repeat bitwise, results come back in half where the op's output follows a half
    argument, half tensors are counted at 2 bytes, and the rows, file stem and report say the dtype."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    session = Session(tiny_settings(dtype=dtype))
    assert session.settings.dtype == dtype
    full = Session(tiny_settings())
    for op in specced_ops():
        case = smallest_case(op)
        args, kwargs = session.inputs(case)
        f32_args, f32_kwargs = full.inputs(case)
        chosen = kernels.spec(op).half_inputs
        pairs = [(a, b) for i, (a, b) in enumerate(zip(f32_args, args)) if chosen is None or i in chosen]
        if chosen is None:
            pairs += [(f32_kwargs[k], kwargs[k]) for k in f32_kwargs]
        converted = [(a, b) for a, b in pairs if isinstance(a, torch.Tensor) and a.dtype == torch.float32]
        floats = [a for a, _ in converted]
        assert floats and all(b.dtype == half for _, b in converted), op
        if chosen is not None:  # the others stay float32, as under autocast
            assert all(b.dtype == a.dtype for i, (a, b) in enumerate(zip(f32_args, args))
                       if i not in chosen and isinstance(a, torch.Tensor)), op
        for sub in subjects(op):
            if sub.kind != "variant":
                continue
            rows = session.measure(Item(op, case, sub))
            got = {r["metric"]: r["value"] for r in rows}
            assert all(r["dtype"] == dtype for r in rows)
            spec_bytes = kernels.spec(op).bytes_moved(case)
            # the half inputs alone save 2 bytes per element of every float input
            saved = sum(t.numel() * 2 for t in floats)
            assert rows[0]["case_bytes"] <= spec_bytes - saved, op
            if sub.deterministic:
                assert got["distinct_results"] == 1.0 and got["max_ulp"] == 0.0, (op, sub.name)
        out = kernels.get(op, kernels.variants(op)[-1].name)(*args, **kwargs)
        assert any(t.dtype == half for t in (out if isinstance(out, tuple) else (out,))), op
    assert results.stem("cuda", quick=True, dtype=dtype) == f"kernels_quick_{dtype}"
    assert results.stem("cpu", partial=True, dtype=dtype) == f"kernels_cpu_{dtype}_partial"
    df = session.table()
    path = results.write(df, tmp_path / "t.csv")
    assert set(results.read(path)["dtype"]) == {dtype}
    md = report.render(df, tmp_path / f"kernels_cpu_{dtype}.md", plots=False)
    assert f"**Inputs in {dtype}**" in md


def test_old_tables_read_as_float32(tmp_path):
    df = results.frame([{"op": "sum", "variant": "tree", "kind": "variant", "metric": "latency", "value": 1.0}])
    assert list(df["dtype"]) == ["float32"]
    path = results.write(df.drop(columns=["dtype"]), tmp_path / "old.csv")
    back = results.read(path)
    assert list(back["dtype"]) == ["float32"] and list(back.columns[:len(results.KEY_COLUMNS)]) == results.KEY_COLUMNS
    with pytest.raises(ValueError, match="dtype"):
        Settings.make(backend="cpu", dtype="float64")


def test_noisy_subject_is_caught_and_unavailable_peer_is_skipped():
    """Negative control through the whole measurement: a subject that flips the last bit of the
    reference at random must show > 1 distinct results; a peer that cannot run is recorded as skipped."""
    op = specced_ops()[0]
    case = smallest_case(op)
    spec = kernels.spec(op)
    gen = torch.Generator().manual_seed(0)

    def noisy(*args, **kwargs):
        ref = spec.reference(args, kwargs).to(torch.float32)
        flip = torch.randint(0, 2, ref.shape, generator=gen, dtype=torch.int32)
        return (ref.contiguous().view(torch.int32) ^ flip).view(torch.float32)

    def broken(*args, **kwargs):
        raise RuntimeError("needs a GPU")

    session = Session(tiny_settings(repeats=8, min_repeats=8))
    rows = session.measure(Item(op, case, Subject(op, "noisy", "peer", noisy, "fast", None)))
    got = {r["metric"]: r["value"] for r in rows}
    assert got["distinct_results"] > 1 and got["max_ulp"] == 1.0 and got["frac_runs_differ"] > 0
    with pytest.raises(Unavailable):
        session.measure(Item(op, case, Subject(op, "broken", "peer", broken, "fast", None)))
    skipped = [r for r in session.rows if r["metric"] == "skipped"]
    assert len(skipped) == 1 and "needs a GPU" in skipped[0]["note"]
    with pytest.raises(RuntimeError):  # a variant's failure is not hidden as a skip
        session.measure(Item(op, case, Subject(op, "bad", "variant", broken, "fast", True)))
    failed = [r for r in session.rows if r["metric"] == "failed"]
    assert len(failed) == 1 and failed[0]["variant"] == "bad" and "needs a GPU" in failed[0]["note"]
    md = report.render(session.table(), results.ROOT / "unused.md", plots=False)
    assert "**Failed**" in md and "- bad: RuntimeError: needs a GPU" in md
    assert "- broken: RuntimeError: needs a GPU" in md


@pytest.mark.slow  # a second pytest process: ~10-20 s on 2 cores
def test_benchmark_only_session_writes_table_json_and_report(tmp_path):
    op = specced_ops()[0]
    variant = kernels.variants(op)[-1].name
    env = {**os.environ, "NNRAND_BENCH_DIR": str(tmp_path), "NNRAND_BENCH_QUICK": "1"}
    env.pop("NNRAND_BENCH_STEM", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--benchmark-only", "-q", "-p", "no:cacheprovider", "bench",
         "-k", f"{op} and {variant}", "--variance-repeats", "3", "--bench-backend", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # -k selected part of the plan: the outputs are marked partial, a complete table is never replaced
    assert not (tmp_path / "results" / "kernels_cpu.csv").exists()
    df = results.read(tmp_path / "results" / "kernels_cpu_partial.csv")
    assert set(df[df["kind"] == "variant"]["variant"]) == {variant}
    assert (df[df["metric"] == "distinct_results"]["repeats"] <= 3).all()
    assert (tmp_path / "results" / "kernels_cpu_partial_benchmark.json").stat().st_size > 0
    md = (tmp_path / "kernels_cpu_partial.md").read_text()
    assert "CPU order models" in md and f"### {op}" in md


class _FakeEvent:
    """A CUDA event stand-in: ``query`` answers what the test says the GPU had reached."""

    reached = False

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def query(self):
        return _FakeEvent.reached

    def elapsed_time(self, other):
        return 2.0   # ms


@pytest.mark.parametrize("reached, sleep, attempts, flagged", [
    (False, True, 1, False),   # the spin outlasted the queueing: one timing, GPU time alone
    (True, True, 4, True),     # the GPU always caught up: three doublings, then flagged
    (False, False, 1, True),   # no spin kernel: one unqueued timing, flagged
])
def test_queued_event_times_retry_and_flag(monkeypatch, reached, sleep, attempts, flagged):
    from bench import timing

    spins, calls = [], []
    monkeypatch.setattr(_FakeEvent, "reached", reached)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    if sleep:
        monkeypatch.setattr(torch.cuda, "_sleep", spins.append, raising=False)
    else:
        monkeypatch.delattr(torch.cuda, "_sleep", raising=False)
    times, host = timing.queued_event_times(lambda: calls.append(1), 5, torch.device("cpu"), host_ahead_s=1e-4)
    assert times == [2e-3] * 5 and host == flagged
    assert len(calls) == 5 * attempts
    assert spins == ([int(2e9 * 1e-4 * 5 * 2**a) for a in range(attempts)] if sleep else [])


@pytest.mark.gpu
def test_queued_event_times_tell_a_call_that_waits_for_the_gpu():
    """Calls queued behind the spin are timed as GPU work alone; a call that reads a result back (a host
    synchronisation) can never be queued, and its times are flagged as including host time."""
    from bench.timing import queued_event_times

    dev = torch.device("cuda")
    x = torch.ones(1 << 20, device=dev)
    times, host = queued_event_times(lambda: x.sum(), 10, dev)
    assert not host and len(times) == 10
    times, host = queued_event_times(lambda: x.sum().item(), 10, dev)
    assert host and len(times) == 10


@pytest.mark.gpu
def test_cuda_backend_tiny_case_per_registered_op():
    """The CUDA path (CUDA events behind a spin kernel, L2 flush, synchronized host rounds, peers in
    both torch modes) on one small case per op; deterministic variants must repeat bit for bit."""
    session = Session(Settings.make(backend="cuda", repeats=20, event_rounds=5, rounds=3, ceiling_copy_bytes=64 << 20,
                                    ceiling_matmul_n=1024))
    assert session.ensure_ceilings().bandwidth > 1e11  # any GPU copies faster than 100 GB/s
    for op in specced_ops():
        case = smallest_case(op)
        for sub in subjects(op):
            try:
                rows = session.measure(Item(op, case, sub))
            except Unavailable:
                continue
            got = {r["metric"]: r["value"] for r in rows}
            lat = next(r for r in rows if r["metric"] == "latency")
            assert lat["note"].startswith("CUDA events") and 0 < got["latency"] < 1.0, (op, sub.name)
            if sub.kind == "variant" and sub.deterministic:
                assert got["distinct_results"] == 1.0, (op, sub.name)
    torch.cuda.synchronize()
    df = session.table()
    assert {"ratio_atomic", "ratio_fastest_peer", "bandwidth_frac"} <= set(df["metric"])
    assert (df["backend"] == "cuda").all() and (df["gpu"] != "none").all()
