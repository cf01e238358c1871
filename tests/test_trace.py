"""nnrand.trace: recording training runs op by op, finding the first divergent op, clear errors for bad files."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from nnrand import routing, trace, train

TINY = dict(device="cpu", model="small", n_train=64, n_test=16, batch_size=16, epochs=1, progress=False,
            report=False)


def recorded(tmp_path, name: str, steps: int = 2, **kw) -> trace.Trace:
    cfg = train.resolve(train.Config(**{**TINY, **kw}))
    return trace.load(trace.record_training(cfg, steps, tmp_path / f"{name}.trace"))


def need_all_ops():
    missing = [op for op in routing.ROUTED_OPS if not routing.registered_variants(op)]
    assert not missing, f"routed kernel ops missing from the registry: {', '.join(missing)}"


def test_atomic_runs_part_at_a_routed_backward_op_of_step_0(tmp_path):
    """Two arrival orders of the atomic CPU models (seeded, as two GPU runs differ): the first divergent
    record is a routed backward op of step 0, attributed to a module; the forward of step 0 agrees."""
    need_all_ops()
    a = recorded(tmp_path, "a", kernel="atomic", kernel_seed=1)
    b = recorded(tmp_path, "b", kernel="atomic", kernel_seed=2)
    d = trace.diff(a, b)
    assert d["status"] == "diverge"
    first = d["first"]
    assert (first["step"], first["phase"]) == (0, "backward")
    assert first["op"] in trace.ROUTED_ATEN and first["module"].startswith(("stem", "stages"))
    assert d["first_by_phase"]["forward"]["step"] == 1  # step 0's forward ran on identical weights
    assert d["per_step"][0]["differ"] > 0 and "first divergent record" in trace.format_diff(d)


def test_tree_traces_are_identical(tmp_path):
    need_all_ops()
    a, b = recorded(tmp_path, "a", kernel="tree"), recorded(tmp_path, "b", kernel="tree")
    assert trace.diff(a, b) == {"status": "identical", "records": len(a)}
    assert len(a) > 0 and {"forward", "backward", "optimizer"} <= {trace.PHASES[i] for i in a.cols["phase"]}


def test_one_ulp_change_first_differs_at_the_forward_op_that_reads_it(tmp_path):
    """Flat parameter 0 is the stem conv's weight: the first divergence is that conv's forward."""
    need_all_ops()
    a = recorded(tmp_path, "a", kernel="tree", steps=1)
    b = recorded(tmp_path, "b", kernel="tree", steps=1, perturb_ulp=True, perturb_index=0)
    first = trace.diff(a, b)["first"]
    assert (first["step"], first["phase"], first["op"], first["module"]) == (0, "forward", "convolution", "stem.0")


def _arrays(n: int, seed: int) -> dict:
    """A hand-built trace of n records of one step."""
    rng = np.random.default_rng(seed)
    header = {"format": trace.FORMAT, "version": trace.VERSION, "meta": {}, "records": n, "ops": ["add", "mul"],
              "modules": ["", "m"], "shapes": ["3"], "dtypes": ["float32"]}
    return {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
            "step": np.zeros(n, np.int32), "phase": np.zeros(n, np.uint8), "index": np.arange(n, dtype=np.int32),
            "op": (np.arange(n) % 2).astype(np.int32), "module": np.ones(n, np.int32),
            "output": np.zeros(n, np.int16), "shape": np.zeros(n, np.int32), "dtype": np.zeros(n, np.int16),
            "fp": rng.integers(-2**62, 2**62, n), "l2": rng.random(n), "maxabs": rng.random(n)}


def _write(path, arrays: dict):
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    path.write_bytes(buf.getvalue())
    return path


@pytest.mark.parametrize("k", [0, 7, 19])
def test_hand_built_pair_first_difference_found_exactly(tmp_path, k):
    a = _arrays(20, seed=1)
    b = {key: v.copy() for key, v in a.items()}
    b["fp"][k] += 1
    b["fp"][-1] += 1  # a later difference must not mask the first
    d = trace.diff(trace.load(_write(tmp_path / "a.trace", a)), trace.load(_write(tmp_path / "b.trace", b)))
    assert d["status"] == "diverge" and d["first"]["record"] == k and d["first"]["index"] == k
    assert d["first"]["op"] == ("add" if k % 2 == 0 else "mul") and d["first"]["module"] == "m"


def test_different_op_sequences_are_reported_not_compared(tmp_path):
    a = _arrays(20, seed=1)
    b = {key: v.copy() for key, v in a.items()}
    b["op"][5] = 1 - b["op"][5]
    d = trace.diff(trace.load(_write(tmp_path / "a.trace", a)), trace.load(_write(tmp_path / "b.trace", b)))
    assert d["status"] == "different ops" and d["record"] == 5
    short = {key: (v[:10] if key != "header" else v) for key, v in a.items()}
    hdr = json.loads(bytes(a["header"]).decode())
    short["header"] = np.frombuffer(json.dumps({**hdr, "records": 10}).encode(), dtype=np.uint8)
    d = trace.diff(trace.load(_write(tmp_path / "a.trace", a)), trace.load(_write(tmp_path / "s.trace", short)))
    assert d["status"] == "different ops" and d["record"] == 10


def test_malformed_files_fail_clearly(tmp_path):
    good = _write(tmp_path / "good.trace", _arrays(5, seed=2))
    data = good.read_bytes()
    (tmp_path / "cut.trace").write_bytes(data[: len(data) // 2])
    with pytest.raises(trace.TraceFormatError, match="not a complete nnrand trace"):
        trace.load(tmp_path / "cut.trace")
    (tmp_path / "text.trace").write_text("hello")
    with pytest.raises(trace.TraceFormatError, match="not a complete nnrand trace"):
        trace.load(tmp_path / "text.trace")
    with pytest.raises(trace.TraceFormatError, match="not an nnrand trace"):
        trace.load(_write(tmp_path / "foreign.trace", {"x": np.zeros(3)}))
    arrays = _arrays(5, seed=2)
    hdr = json.loads(bytes(arrays["header"]).decode())
    arrays["header"] = np.frombuffer(json.dumps({**hdr, "version": 99}).encode(), dtype=np.uint8)
    with pytest.raises(trace.TraceFormatError, match="version 99"):
        trace.load(_write(tmp_path / "future.trace", arrays))
    arrays = _arrays(5, seed=2)
    arrays["fp"] = arrays["fp"][:3]
    with pytest.raises(trace.TraceFormatError, match="damaged"):
        trace.load(_write(tmp_path / "short.trace", arrays))


def test_cli_diff_reports_and_exits_by_result(tmp_path, capsys):
    a = _write(tmp_path / "a.trace", _arrays(6, seed=3))
    b_arr = _arrays(6, seed=3)
    b_arr["fp"][2] += 5
    b = _write(tmp_path / "b.trace", b_arr)
    assert trace.cli(["diff", str(a), str(a)]) == 0
    assert trace.cli(["diff", str(a), str(b), "--plot", str(tmp_path / "g.png")]) == 1
    out = capsys.readouterr().out
    assert "identical" in out and "first divergent record 2" in out and (tmp_path / "g.png").exists()
    (tmp_path / "cut.trace").write_bytes(a.read_bytes()[:40])
    with pytest.raises(SystemExit) as e:
        trace.cli(["diff", str(a), str(tmp_path / "cut.trace")])
    assert e.value.code == 2 and "not a complete nnrand trace" in capsys.readouterr().err


def test_fingerprint_is_exact_and_position_sensitive():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, generator=g)
    y = x.clone()
    y[[10, 20]] = y[[20, 10]]  # a swap keeps every sum of values
    assert int(trace.fingerprint(x)) == int(trace.fingerprint(x.clone()))
    assert int(trace.fingerprint(x)) != int(trace.fingerprint(y))
    z = x.clone()
    z[500] = torch.nextafter(z[500], torch.tensor(float("inf")))  # one ULP
    assert int(trace.fingerprint(x)) != int(trace.fingerprint(z))
    bits = x.view(torch.int32).to(torch.int64).numpy()
    want = int(np.sum((np.arange(1, 1001, dtype=np.int64) * bits).astype(np.int64)))
    assert int(trace.fingerprint(x)) == want


def test_lockstep_replicas_differ_on_one_axis_only():
    import dataclasses

    cfg = train.resolve(train.Config(**TINY))
    for vary in trace.VARY:
        a, b = trace.lockstep_configs(cfg, vary)
        changed = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
        want = {"none": set(), "kernel": {"kernel_seed"}, "ulp": {"perturb_ulp"}}.get(vary, {f"{vary}_seed"})
        assert changed == want, (vary, changed)
    with pytest.raises(ValueError, match="--vary"):
        trace.lockstep_configs(cfg, "weather")


def test_lockstep_ulp_keeps_the_first_differing_output_in_full(tmp_path):
    need_all_ops()
    cfg = train.resolve(train.Config(**TINY, kernel="tree"))
    d = trace.lockstep(cfg, "ulp", 1, tmp_path, keep=1)
    assert (d["first"]["phase"], d["first"]["op"], d["first"]["module"]) == ("forward", "convolution", "stem.0")
    assert d["max_ulp"] >= 1 and d["rel_l2"] > 0


def test_routed_recording_sees_exactly_the_routed_ops(tmp_path):
    """ops="routed" records through the routing's observers: the routed backward ops of every step, each
    with its module, the same fingerprints as the full recording's records of those ops."""
    need_all_ops()
    cfg = train.resolve(train.Config(**TINY, kernel="tree"))
    full = trace.load(trace.record_training(cfg, 1, tmp_path / "all.trace"))
    routed = trace.load(trace.record_training(cfg, 1, tmp_path / "routed.trace", ops="routed"))
    ops = {routed.header["ops"][i] for i in routed.cols["op"]} - {"parameter"}
    assert ops == {"convolution_backward", "native_batch_norm_backward", "max_pool2d_with_indices_backward"}
    sel = np.array([full.header["ops"][i] in trace.ROUTED_ATEN for i in full.cols["op"]])
    rsel = np.array([routed.header["ops"][i] in trace.ROUTED_ATEN for i in routed.cols["op"]])
    assert np.array_equal(full.cols["fp"][sel], routed.cols["fp"][rsel])
    assert all(routed.header["modules"][m] for m in routed.cols["module"][rsel])
    with pytest.raises(routing.RoutingError, match="use_kernels"):
        with trace.record(None, ops="routed"):
            pass


def test_cross_gpu_comparison_is_added_to_the_report(tmp_path):
    a = _write(tmp_path / "a.trace", _arrays(6, seed=5))
    results = tmp_path / "trace.json"
    results.write_text(json.dumps({"fingerprint": {"gpu": "x", "torch": "t", "git_sha": "s"}, "steps": 1,
                                   "model": "m", "batch_size": 2, "rows": [],
                                   "cost": {m: {"ms_per_step": 1.0, "records_per_step": 1, "bytes_per_step": 10}
                                            for m in ("none", "routed", "all")}}))
    md = trace.add_cross_gpu(results, a, a, tmp_path / "trace.md")
    assert "identical: 6 records" in md.read_text()
    assert len(json.loads(results.read_text())["cross_gpu"]) == 1
    trace.add_cross_gpu(results, a, a, tmp_path / "trace.md")  # the same pair again replaces its entry
    assert len(json.loads(results.read_text())["cross_gpu"]) == 1


def test_kernel_written_rows_come_back_in_record_order(monkeypatch):
    """On a GPU the fingerprint kernel writes each record's (fp, L2, max) into a row of a per-device slot
    buffer that is read back once per step. The bookkeeping (rows across chunk boundaries, records whose
    values are tensors in between, several steps) is checked here on the CPU: a stand-in for the kernel
    writes the formula's values into the row's address, and the trace must equal the one recorded with
    every value a tensor."""
    import ctypes

    def run(mixed: bool) -> dict:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 5, generator=g)
        with trace.record(None) as rec:
            for _ in range(3):
                rec.step()
                y = torch.relu(x @ x.T)
                # float64 records between float32 ones; without them, every value of a step is a slot row
                y = y.double().sum(0).float() if mixed else y.sum(0)
                (x * 2 + y.mean()).tanh().sum()
                torch.std_mean(x, 0)                                 # an op of two float32 outputs
                rec.snapshot([("x", x), ("y", y)])
        return rec.arrays()

    launches = []

    def stand_in(ts: list[torch.Tensor], ptrs: list[int]) -> None:
        launches.append(len(ts))
        for t, ptr in zip(ts, ptrs):
            l2, mx = trace.summaries(t)
            row = torch.stack((trace.fingerprint(t).view(torch.float64), l2, mx)).numpy()
            ctypes.memmove(ptr, row.ctypes.data, 24)

    for mixed in (True, False):
        want = run(mixed)
        with monkeypatch.context() as m:
            m.setattr(trace, "_fused", lambda t: t.dtype == torch.float32)
            m.setattr(trace, "_launch_fingerprints", stand_in)
            m.setattr(trace._Slots, "ROWS", 3)     # several chunks per step
            launches.clear()
            gathered = []
            gather = trace.Recorder._gather
            m.setattr(trace.Recorder, "_gather", lambda self, p: gathered.append(len(p)) or gather(self, p))
            got = run(mixed)
        assert bool(gathered) == mixed   # one device's rows alone come back without the per-record gather
        assert sorted(got) == sorted(want) and len(want["fp"]) > 3 * 3
        for k in want:
            assert np.array_equal(got[k], want[k]), (mixed, k)
        # the outputs of one op and the tensors of one snapshot go to the kernel in one launch
        assert launches.count(2) == 2 * 3 and set(launches) == {1, 2}


def test_report_marks_ops_the_model_never_calls(tmp_path):
    """An op set atomic alone that the model never calls (the small CNN has no embedding) is reported as
    not called, not as 'identical'; one it calls parts the runs; the command is named."""
    cfg = train.resolve(train.Config(device="cpu", model="small", n_train=64, n_test=32, batch_size=32, epochs=1,
                                     progress=False, report=False, kernel="tree"))
    md = trace.report(cfg, 1, tmp_path / "t.md", tmp_path / "t.json", "python -m nnrand.trace report --steps 1",
                      ops=("conv_wgrad", "embedding_bwd"))
    rows = {r["case"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert rows["conv_wgrad alone atomic"]["status"] == "diverge"
    assert rows["embedding_bwd alone atomic"]["status"] == "not run"
    assert rows["tree vs itself (control)"]["status"] == "identical"
    text = md.read_text()
    assert "| embedding_bwd alone atomic | op not called by small |" in text
    assert "Generated by `python -m nnrand.trace report --steps 1` (small," in text


def test_recording_cost_times_every_mode_in_each_round(tmp_path):
    # two rounds of one timed step per mode (three warm-up steps in the first, one after): every mode gets
    # a time from every round, and recording every op writes more records than recording the routed ones
    cfg = train.resolve(train.Config(**TINY, kernel="tree"))
    cost = trace.recording_cost(cfg, 1, tmp_path, rounds=2)
    assert {m: cost[m]["steps_timed"] for m in ("none", "routed", "all")} == {"none": 2, "routed": 2, "all": 2}
    assert all(cost[m]["ms_per_step"] > 0 for m in cost)
    assert cost["all"]["records_per_step"] > cost["routed"]["records_per_step"] > 0
    assert "records_per_step" not in cost["none"]


def test_a_record_failing_midway_still_launches_the_rows_reserved_before_it(monkeypatch):
    """An op's outputs are fingerprinted in one launch after all their rows are reserved: when a later
    output's record raises, the rows reserved before it are still written (launched), not left unset."""
    launched = []
    monkeypatch.setattr(trace, "_fused", lambda t: t.dtype == torch.float32)
    monkeypatch.setattr(trace, "_launch_fingerprints", lambda ts, ptrs: launched.append(len(ts)))

    def refuse(t):
        raise RuntimeError("no values for this output")

    monkeypatch.setattr(trace, "record_values", refuse)
    rec = trace.Recorder()
    rec.step()
    out = (torch.ones(3), torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(4))
    with pytest.raises(RuntimeError, match="no values"):
        rec._add_outputs(out, "op", "m", "forward")
    assert launched == [2]    # the two float32 outputs before the failing float64 one
    with pytest.raises(RuntimeError, match="no values"):
        rec.snapshot([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))])
    assert launched == [2, 1]
