"""nnrand.trace: recording training runs op by op, finding the first divergent op, clear errors for bad files."""
from __future__ import annotations

import io
import json
import types

import numpy as np
import pytest
import torch

from nnrand import routing, trace, train
from tests.helpers import routed_recording

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


def test_eight_byte_values_are_fingerprinted_as_two_words():
    """A float64 or int64 element is two 4-byte words (low half first), each with its own weight: a flipped
    top bit (a float64's sign) at an odd position changes the fingerprint, which one 64-bit word times an
    even weight would wrap away (trace format version 1)."""
    g = torch.Generator().manual_seed(6)
    for x in (torch.randn(9, generator=g, dtype=torch.float64),
              torch.randint(-(1 << 40), 1 << 40, (9,), generator=g, dtype=torch.int64)):
        y = x.clone()
        y.view(torch.int64)[3] ^= -(1 << 63)   # the top bit of the element with weight 4 in version 1
        assert int(trace.fingerprint(x)) != int(trace.fingerprint(y))
        words = x.view(torch.int32).to(torch.int64).numpy()
        want = int(np.sum((np.arange(1, 19, dtype=np.int64) * words).astype(np.int64)))
        assert int(trace.fingerprint(x)) == want
        old = int(np.sum(np.arange(1, 10, dtype=np.int64) * x.view(torch.int64).numpy()))
        assert old == int(np.sum(np.arange(1, 10, dtype=np.int64) * y.view(torch.int64).numpy()))


def test_bool_values_are_fingerprinted_by_their_bytes():
    """A bool tensor viewed from other bytes may hold 2: its fingerprint and summaries read the bytes as
    they are (as the kernel does), not converted to 0/1."""
    b = torch.tensor([2, 0, 1], dtype=torch.uint8).view(torch.bool)
    assert int(trace.fingerprint(b)) == 1 * 2 + 2 * 0 + 3 * 1
    assert [float(v) for v in trace.summaries(b)] == [5.0**0.5, 2.0]


def test_traces_of_two_versions_load_but_are_not_compared(tmp_path, capsys):
    a = _write(tmp_path / "a.trace", _arrays(4, seed=5))
    arrays = _arrays(4, seed=5)
    hdr = json.loads(bytes(arrays["header"]).decode())
    arrays["header"] = np.frombuffer(json.dumps({**hdr, "version": 1}).encode(), dtype=np.uint8)
    old = _write(tmp_path / "old.trace", arrays)
    assert trace.load(old).header["version"] == 1 and trace.VERSION == 3
    assert trace.diff(trace.load(old), trace.load(old))["status"] == "identical"
    with pytest.raises(trace.TraceFormatError, match="version 3 trace and .* version 1"):
        trace.diff(trace.load(a), trace.load(old))
    with pytest.raises(SystemExit) as e:
        trace.cli(["diff", str(a), str(old)])
    assert e.value.code == 2 and "defined differently" in capsys.readouterr().err


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
    # without naming every module (a routed op's module: the owner of a parameter it takes, or a hooked
    # parameterless leaf such as the max-pool) the same module paths as the full recording's
    names = [routed.header["modules"][m] for m in routed.cols["module"][rsel]]
    assert all(names) and names == [full.header["modules"][m] for m in full.cols["module"][sel]]
    with pytest.raises(routing.RoutingError, match="use_kernels"):
        with trace.record(None, ops="routed"):
            pass


def test_routed_module_paths_under_autocast_match_the_full_recording():
    """Under bfloat16 autocast a conv takes a cast copy of its weight, not the parameter: ops="routed" finds
    the module through the copy's autograd node, the same paths as ops="all" names."""
    need_all_ops()
    from nnrand import models

    torch.manual_seed(0)
    model = models.small(4)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    paths = {}
    for ops in ("routed", "all"):
        with routing.use_kernels("tree"), trace.record(None, ops=ops, model=model) as rec:
            rec.step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        a = rec.arrays()
        header = json.loads(bytes(a["header"]).decode())
        paths[ops] = [(header["ops"][o], header["modules"][m], header["dtypes"][d])
                      for o, m, d in zip(a["op"], a["module"], a["dtype"]) if header["ops"][o] in trace.ROUTED_ATEN]
    assert paths["routed"] == paths["all"] and all(m for _, m, _ in paths["routed"])
    assert ("convolution_backward", "stem.0", "bfloat16") in paths["routed"]
    # a routed forward op (a conv where the routing takes the forward) gets the weight's autocast copy
    with routing.use_kernels("tree"), trace.record(None, ops="routed", model=model) as rec:
        conv = model.stem[0]
        copy = conv.weight.to(torch.bfloat16)
        assert rec._owner((x.to(torch.bfloat16), copy, None), None) == "stem.0"
        assert rec._owner((x, copy.detach()), None) == ""


def test_a_compiled_module_recorded_compiles_nothing_more_and_records_what_eager_does():
    """The recorder's dispatch keeps dynamo off its own frames (cheaper than torch's per-call wrapper): a
    module compiled before recording runs under it with no new graph compiled, and its records (ops and
    fingerprints) are those of the same module run eagerly."""
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x).sum().backward()

    def run(module, named: torch.nn.Module | None = None) -> dict:
        model.zero_grad(set_to_none=True)
        with trace.record(None, model=named) as rec:
            for _ in range(2):
                rec.step()
                module(x).sum().backward()
        return rec.arrays()

    graphs = dict(dynamo_utils.counters["stats"])
    got = run(compiled)
    assert dict(dynamo_utils.counters["stats"]) == graphs and graphs.get("unique_graphs", 0) >= 1
    want = run(model)
    for k in ("op", "shape", "dtype", "fp"):
        assert np.array_equal(got[k], want[k]), k
    assert len(got["fp"]) > 40
    # with the model named (its modules' forwards wrapped while recording): nothing compiled under it nor
    # after it, and the same records
    named = run(compiled, model)
    compiled(x).sum().backward()
    assert dict(dynamo_utils.counters["stats"]) == graphs
    named_eager = run(model, model)
    for k in ("op", "shape", "dtype", "fp", "module"):
        assert np.array_equal(named[k], named_eager[k]), k
    assert np.array_equal(named["fp"], want["fp"]) and len(set(named["module"].tolist())) > 1
    # negative control: the same dispatch, its code a copy dynamo was not told to skip and the frame
    # callback left on, gets compiled
    dispatch = trace.Recorder.__dict__["__torch_dispatch__"]
    unskipped = types.FunctionType(dispatch.__code__.replace(co_name="unskipped"), dispatch.__globals__)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(trace.Recorder, "__torch_dispatch__", unskipped)
        m.setattr(trace, "_set_eval_frame", lambda callback: None)
        run(compiled)
    assert dict(dynamo_utils.counters["stats"]) != graphs


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


_KIND_DTYPE = {k: d for d, k in reversed(list(trace.FP_KINDS.items()))}   # 7: uint8 (bool reads as its byte)


def _write_row(ptr: int, n: int, dtype: torch.dtype, out_ptr: int) -> None:
    """The fingerprint kernel's work modelled on the CPU: the (fp, L2, max) row of the ``n`` elements at host
    address ``ptr``, read as they are now (a launch that comes too late reads what is there then), written
    to ``out_ptr``."""
    import ctypes

    t = torch.frombuffer(bytearray((ctypes.c_char * (n * dtype.itemsize)).from_address(ptr)), dtype=dtype)
    l2, mx = trace.summaries(t)
    row = torch.stack((trace.fingerprint(t).view(torch.float64), l2, mx)).numpy()
    ctypes.memmove(out_ptr, row.ctypes.data, 24)


class KernelStandIn:
    """The launch paths of the fingerprint kernel on CPU tensors: per op (``_launch_fingerprints``), the
    deferred batches (``_launch_deferred``) and a snapshot's launches made again (``_launch_struct``), each
    reading the memory when it is called; ``launches``: the size of each launch, deferred ones as
    ("deferred", size), launches made again as ("struct", size)."""

    def __init__(self, monkeypatch, fused=lambda t: t.dtype == torch.float32):
        self.launches: list = []
        monkeypatch.setattr(trace, "_fused", fused)
        monkeypatch.setattr(trace, "_launch_fingerprints", self.per_op)
        monkeypatch.setattr(trace, "_launch_deferred", self.deferred)
        monkeypatch.setattr(trace, "_fp_state", lambda index, stream=None: None)
        monkeypatch.setattr(trace, "_launch_struct", self.struct)

    def struct(self, st, struct, blocks: int, stream=None) -> None:
        """A launch of FpBatch bytes (a snapshot's launch made again): its descriptors, as ``deferred``."""
        count = struct[0]
        assert len(struct) == trace._FP_BATCH_SLOTS   # the kernel's FpBatch, whole
        self.launches.append(("struct", count))
        self.descriptors(list(struct[1:1 + 5 * count]), blocks)

    def per_op(self, ts: list[torch.Tensor], ptrs: list[int]) -> None:
        self.launches.append(len(ts))
        for t, ptr in zip(ts, ptrs):
            t = t.contiguous()
            _write_row(t.data_ptr(), t.numel(), t.dtype, ptr)

    def deferred(self, d) -> None:
        self.launches.append(("deferred", len(d.held)))
        self.descriptors(d.desc, d.blocks)
        assert len(d.held) <= trace.FP_BATCH

    @staticmethod
    def descriptors(desc: list[int], total: int) -> None:
        first = 0
        for k in range(0, len(desc), 5):
            ptr, n, chunk, out, packed = desc[k:k + 5]
            # the descriptor as fingerprint_batch reads it: its blocks in launch order, the one-launch split
            blocks = (packed >> 32) & 0xFFFF
            assert (packed & 0xFFFFFFFF, blocks, chunk) == (first, trace.fp_blocks(n), trace.fp_chunk(n, blocks))
            first += blocks
            _write_row(ptr, n, _KIND_DTYPE[packed >> 48], out)
        assert first == total <= trace.FP_SCRATCH_BLOCKS and len(desc) <= 5 * trace.FP_BATCH


def test_slot_rows_keep_their_addresses_across_chunks_and_takes(monkeypatch):
    """_Slots hands out 24-byte rows from chunks of ROWS rows (the current chunk's address cached): row i
    of a step is at chunk i // ROWS, offset 24 (i % ROWS), after a take as before it."""
    monkeypatch.setattr(trace._Slots, "ROWS", 3)
    slots = trace._Slots(torch.device("cpu"))
    for n in (8, 5, 10):
        ptrs = [slots.next_ptr() for _ in range(n)]
        assert ptrs == [slots.chunks[i // 3].data_ptr() + 24 * (i % 3) for i in range(n)]
        assert slots.take().shape == (n, 3) and slots.used == 0
    assert len(slots.chunks) == 4


def test_kernel_written_rows_come_back_in_record_order(monkeypatch):
    """On a GPU the fingerprint kernel writes each record's (fp, L2, max) into a row of a per-device slot
    buffer that is read back once per step. The bookkeeping (rows across chunk boundaries, records whose
    values are tensors in between, several steps) is checked here on the CPU: a stand-in for the kernel
    writes the formula's values into the row's address, and the trace must equal the one recorded with
    every value a tensor. ops="all" defers its fingerprints to one launch per step here (nothing writes a
    recorded tensor); the per-op path launches an op's outputs, and a snapshot's tensors, together."""
    def run(mixed: bool, defer: bool = True) -> dict:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, 5, generator=g)
        with trace.record(None, defer=defer) as rec:
            for _ in range(3):
                rec.step()
                y = torch.relu(x @ x.T)
                # float64 records between float32 ones; without them, every value of a step is a slot row
                y = y.double().sum(0).float() if mixed else y.sum(0)
                (x * 2 + y.mean()).tanh().sum()
                torch.std_mean(x, 0)                                 # an op of two float32 outputs
                rec.snapshot([("x", x), ("y", y)])
        return rec.arrays()

    for mixed in (True, False):
        want = run(mixed)
        for defer in (True, False):
            with monkeypatch.context() as m:
                kernel = KernelStandIn(m)
                m.setattr(trace._Slots, "ROWS", 3)     # several chunks per step
                gathered = []
                gather = trace.Recorder._gather
                m.setattr(trace.Recorder, "_gather", lambda self, p: gathered.append(len(p)) or gather(self, p))
                got = run(mixed, defer)
            assert bool(gathered) == mixed   # one device's rows alone come back without the per-record gather
            assert sorted(got) == sorted(want) and len(want["fp"]) > 3 * 3
            for k in want:
                assert np.array_equal(got[k], want[k]), (mixed, defer, k)
            if defer:   # every float32 op record of a step in one launch at its end, the snapshot in its own
                assert [x[1] for x in kernel.launches if isinstance(x, tuple)] == [
                    int((got["dtype"][got["step"] == s] == 0).sum()) - 2 for s in range(3)]
                assert [x for x in kernel.launches if not isinstance(x, tuple)] == [2] * 3
            else:   # the outputs of one op and the tensors of one snapshot go to the kernel in one launch
                assert kernel.launches.count(2) == 2 * 3 and set(kernel.launches) == {1, 2}


def test_snapshot_of_one_list_reuses_its_records_until_a_tensor_changes(monkeypatch):
    """A snapshot given the same list again keeps its records' codes and launches its tensors at once; a
    tensor replaced in the list, or given new storage and shape, is seen. The trace equals the one of
    snapshots taken record by record (an iterator, never planned)."""
    def run(planned: bool) -> dict:
        g = torch.Generator().manual_seed(4)
        a, b = torch.randn(3, generator=g), torch.randn(2, 2, generator=g)
        named = [("a", a), ("b", b)]
        with trace.record(None) as rec:
            for step in range(4):
                rec.step()
                a.mul_(2)                                           # in place: the same tensors
                if step == 1:
                    named[0] = ("a_renamed", a)                     # the same tensor, another name
                if step == 2:
                    named[1] = ("b", torch.randn(5, generator=g))   # another tensor in the list
                if step == 3:
                    a.data = torch.randn(4, generator=g)            # the same tensor, new storage and shape
                rec.snapshot(named if planned else iter(named))
        return rec.arrays()

    for planned in (True, False):
        with monkeypatch.context() as m:
            kernel = KernelStandIn(m)
            got = run(planned)
        if planned:
            assert kernel.launches.count(2) == 4   # each step's snapshot in one launch of its own
        else:
            want = got
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    header = json.loads(bytes(got["header"]).decode())
    snap = got["op"] == header["ops"].index("parameter")
    assert [header["shapes"][c] for c in got["shape"][snap]] == ["3", "2x2"] * 2 + ["3", "5", "4", "5"]
    assert [header["modules"][c] for c in got["module"][snap]] == ["a", "b"] + ["a_renamed", "b"] * 3


def test_deferred_fingerprints_launch_before_a_recorded_tensor_is_written(monkeypatch):
    """ops="all" holds its kernel fingerprints back and launches them in batches; a batch must go out before
    any op writes a tensor it reads (in place, through a view, out=, a foreach op, resize_, set_, BatchNorm's
    running statistics, which its schema does not mark as written), and the
    memory of a recorded tensor that is freed must not be reused before: the stand-in kernel reads the
    memory when launched, and the trace equals the one whose values are computed at each op. Negative
    control: without the check for written tensors, the same run records other values."""
    def run() -> dict:
        g = torch.Generator().manual_seed(4)
        bn = torch.nn.BatchNorm1d(4)   # made outside: a new module's parameters start as uninitialised memory
        with trace.record(None) as rec:
            for _ in range(2):
                rec.step()
                a = torch.randn(20000, generator=g)      # 5 blocks of the kernel's
                x = a * 2
                x.add_(1)                                # in place
                x[3:9].mul_(-3)                          # through a view
                torch.mul(a, a, out=x)                   # out=
                torch._foreach_add_([x, a], 1.5)         # foreach, in place
                y = x.exp()
                del y                                    # freed while its fingerprint waits
                z = torch.randn(64, generator=g) + 0     # memory the allocator could hand out again
                z.resize_(32)                            # resized in place
                z.set_(torch.full((96,), 0.5).untyped_storage())   # another storage for a recorded tensor
                z.fill_(0.25)
                stats = bn.running_mean.detach()         # shares the running mean's storage
                bn(torch.randn(8, 4, generator=g))       # a training-mode BatchNorm updates it unmarked
                stats * 1
                rec.snapshot([("x", x), ("z", z)])
                x.sub_(a)                                # a snapshot's tensor written afterwards
        return rec.arrays()

    want = run()
    with monkeypatch.context() as m:
        kernel = KernelStandIn(m)
        got = run()
    assert any(isinstance(n, tuple) for n in kernel.launches)
    assert len(got["fp"]) == len(want["fp"]) > 20
    for k in ("op", "shape", "fp", "maxabs", "l2"):
        assert np.array_equal(got[k], want[k]), k
    with monkeypatch.context() as m:
        KernelStandIn(m)
        m.setattr(trace, "_writes_any", lambda *a: False)
        late = run()
    assert not np.array_equal(late["fp"], want["fp"])


def test_deferral_keeps_the_op_sequence_of_a_residual_model(monkeypatch):
    """Holding the storages of waiting fingerprints changes neither which ops autograd and the optimizer run
    (a stolen gradient, residual sums, momentum updates in place) nor any value: the trace of a residual
    MLP trained 3 steps with SGD and momentum equals the one recorded with values computed at each op."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.b(torch.relu(self.a(x))) + x)

    def run() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        with trace.record(None, model=model) as rec:
            for _ in range(3):
                rec.step()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                with rec.phase("optimizer"):
                    opt.step()
                rec.snapshot(model.named_parameters())
        return rec.arrays()

    want = run()
    with monkeypatch.context() as m:
        kernel = KernelStandIn(m, fused=lambda t: t.dtype in (torch.float32, torch.int64))
        got = run()
    assert sum(n for k, n in kernel.launches if k == "deferred") > 100
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_routed_backward_records_wait_for_the_end_of_the_pass(monkeypatch):
    """ops="routed" cannot see what writes a routed op's outputs, so in a backward pass it holds their
    storages (autograd then sums gradients out of place) and launches their fingerprints once, when the
    pass ends (inside it: before the optimizer runs). The trace equals the one with values computed per
    op, launched per op or not."""
    need_all_ops()
    want = routed_recording()   # no kernel: every value computed by the formula at its op
    for defer in (True, False):
        with monkeypatch.context() as m:
            kernel = KernelStandIn(m)
            in_pass = []
            deferred = kernel.deferred
            m.setattr(trace, "_launch_deferred",
                      lambda d: in_pass.append(torch._C._current_graph_task_id() >= 0) or deferred(d))
            got = routed_recording(defer)
        for k in want:
            assert np.array_equal(got[k], want[k]), (defer, k)
        backward = int((got["phase"] == trace.PHASES.index("backward")).sum())
        if defer:   # one launch per pass, at its end; the snapshots' and other launches per op
            assert [x[1] for x in kernel.launches if isinstance(x, tuple)] == [backward // 2] * 2
            assert in_pass == [True] * 2
        else:
            assert not in_pass and sum(kernel.launches) == len(got["fp"])


def test_routed_in_place_ops_in_backward_are_fingerprinted_at_once(monkeypatch):
    """gather's and index_select's backward run the routed scatter_add_ and index_add_ in place: autograd
    bumps their outputs' versions after the routed kernel returns, so they are fingerprinted at once, not
    watched (a watch would fail the recording); the records equal those launched per op."""
    need_all_ops()
    KernelStandIn(monkeypatch)

    def run(defer: bool) -> dict:
        g = torch.Generator().manual_seed(6)
        src = torch.randn(50, 8, generator=g, requires_grad=True)
        idx = torch.randint(0, 50, (30,), generator=g)
        with routing.use_kernels("tree"), trace.record(None, ops="routed", defer=defer) as rec:
            rec.step()
            loss = torch.gather(src, 0, idx[:, None].expand(30, 8)).sum() + torch.index_select(src, 0, idx).pow(2).sum()
            loss.backward()
        return rec.arrays()

    got, want = run(True), run(False)
    header = json.loads(bytes(got["header"]).decode())
    assert sorted(header["ops"]) == ["index_add_", "scatter_add_"]
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_routed_deferral_fails_when_a_hook_writes_a_recorded_gradient(monkeypatch):
    """A gradient hook that scales a conv's input gradient in place writes the output of a
    routed convolution_backward before the pass ends: a deferred fingerprint would read the scaled values,
    so the recording fails and names the op. Recorded per op (defer=False), its record is the op's own
    output: the same as without the hook, while the hook changes what follows (negative control)."""
    need_all_ops()

    def double(grad):
        grad.mul_(2)

    KernelStandIn(monkeypatch)
    with pytest.raises(trace.TraceError, match=r"aten::convolution_backward .*step 0.*defer=False"):
        routed_recording(hook=double, steps=1)

    def double_then_fail(grad):
        grad.mul_(2)
        raise ValueError("from the hook")

    # a pass that fails leaves its batch waiting: the recorder's exit launches it without the check, and
    # the error on its way out stays the hook's
    with pytest.raises(ValueError, match="from the hook"):
        routed_recording(hook=double_then_fail, steps=1)
    plain, hooked = routed_recording(defer=False, steps=1), routed_recording(defer=False, hook=double, steps=1)
    header = json.loads(bytes(plain["header"]).decode())
    hooked_op = [i for i in range(len(plain["fp"])) if header["ops"][plain["op"][i]] == "convolution_backward"
                 and header["modules"][plain["module"][i]] == "stages.0.0.conv2" and plain["output"][i] == 0]
    same = plain["fp"] == hooked["fp"]
    assert len(hooked_op) == 1 and same[:hooked_op[0] + 1].all() and not same.all()


def test_report_marks_ops_the_model_never_calls(tmp_path):
    """An op set atomic alone that the model never calls (the small CNN has no embedding) is reported as
    not called, not as 'identical'; one it calls parts the runs; the command is named."""
    cfg = train.resolve(train.Config(device="cpu", model="small", n_train=64, n_test=32, batch_size=32, epochs=1,
                                     progress=False, report=False, kernel="tree"))
    md = trace.report(cfg, 1, tmp_path / "t.md", tmp_path / "t.json", "python -m nnrand.trace report --steps 1",
                      ops=("conv_wgrad", "embedding_bwd"), cost_rounds=2)
    rows = {r["case"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert rows["conv_wgrad alone atomic"]["status"] == "diverge"
    assert rows["embedding_bwd alone atomic"]["status"] == "not run"
    assert rows["tree vs itself (control)"]["status"] == "identical"
    text = md.read_text()
    assert "| embedding_bwd alone atomic | op not called by small |" in text
    assert "Generated by `python -m nnrand.trace report --steps 1` (small," in text


def test_recording_cost_times_every_mode_in_each_round(tmp_path, monkeypatch):
    # two rounds of one timed step per mode (three warm-up steps in the first, two after): every mode gets
    # a time from every round, and recording every op writes more records than recording the routed ones
    cfg = train.resolve(train.Config(**TINY, kernel="tree"))
    entered, record = [], trace.record
    monkeypatch.setattr(trace, "record", lambda *a, ops, **k: entered.append(ops) or record(*a, ops=ops, **k))
    cost = trace.recording_cost(cfg, 1, tmp_path, rounds=2)
    assert entered == ["routed", "all", "all", "routed"]   # every other round in reverse order
    assert {m: cost[m]["steps_timed"] for m in ("none", "routed", "all")} == {"none": 2, "routed": 2, "all": 2}
    assert all(cost[m]["ms_per_step"] > 0 for m in cost)
    assert cost["all"]["records_per_step"] > cost["routed"]["records_per_step"] > 0
    assert "records_per_step" not in cost["none"]
    assert cost["all"]["ratio"] > 0 and cost["routed"]["ratio"] > 0 and cost["none"]["rounds"] == 2


def test_recording_cost_collects_garbage_and_warms_up_before_each_modes_steps(tmp_path, monkeypatch):
    """Before each mode's steps in each round: one garbage collection, then the warm-up steps (three in the
    first round, two after: a routing session's replay layer plans and records at a signature's first two
    calls), which are run but not timed."""
    cfg = train.resolve(train.Config(**TINY, kernel="tree"))
    events: list[str] = []
    monkeypatch.setattr(trace.gc, "collect", lambda *a: events.append("gc") or 0)
    step = trace.Recorder.step
    monkeypatch.setattr(trace.Recorder, "step", lambda self: events.append(self.ops) or step(self))
    cost = trace.recording_cost(cfg, 1, tmp_path, rounds=2)
    # the recorded modes' steps, per round and mode: gc, then warm-up + 1 timed step
    runs = "".join("g" if e == "gc" else e[0] for e in events)
    assert runs == "g" + "g" + "rrrr" + "g" + "aaaa" + "g" + "aaa" + "g" + "rrr" + "g", runs
    assert {m: cost[m]["steps_timed"] for m in ("none", "routed", "all")} == {"none": 2, "routed": 2, "all": 2}


def test_a_record_failing_midway_still_launches_the_rows_reserved_before_it(monkeypatch):
    """An op's outputs are fingerprinted in one launch after all their rows are reserved: when a later
    output's record raises, the rows reserved before it are still written (launched), not left unset."""
    kernel = KernelStandIn(monkeypatch)

    def refuse(t):
        raise RuntimeError("no values for this output")

    monkeypatch.setattr(trace, "record_values", refuse)
    out = (torch.ones(3), torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(4))
    rec = trace.Recorder(ops="routed")   # launched per op
    rec.step()
    with pytest.raises(RuntimeError, match="no values"):
        rec._add_outputs(out, "op", "m", "forward")
    assert kernel.launches == [2]    # the two float32 outputs before the failing float64 one
    with pytest.raises(RuntimeError, match="no values"):
        rec.snapshot([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.float64))])
    assert kernel.launches == [2, 1]
    rec = trace.Recorder()   # deferred: the reserved rows wait for the next launch, which writes them
    rec.step()
    with pytest.raises(RuntimeError, match="no values"):
        rec._add_outputs(out, "op", "m", "forward")
    rec._flush()
    assert kernel.launches == [2, 1, ("deferred", 2)]


@pytest.mark.filterwarnings("ignore::UserWarning")   # torch's beta/prototype notes for CSR, nested, quantized
def test_outputs_without_dense_bytes_are_skipped_and_complex_ones_recorded():
    """Sparse CSR, nested, quantized and meta outputs are not recorded (the user's op runs as without the
    recorder); complex outputs are fingerprinted as (real, imaginary) pairs, their L2 and max over the
    moduli."""
    with trace.Recorder() as rec:
        rec.step()
        torch.eye(3).to_sparse_csr()
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
        torch.empty(3, device="meta") + 1
        z = torch.tensor([3 + 4j, 0j], dtype=torch.complex128) * 1
    arrays = rec.arrays()
    ops = json.loads(bytes(arrays["header"]).decode())["ops"]
    recorded_ops = [ops[i] for i in arrays["op"]]
    assert "mul" in recorded_ops and len(arrays["fp"]) == len(arrays["step"])
    k = len(recorded_ops) - 1 - recorded_ops[::-1].index("mul")
    assert arrays["l2"][k] == 5.0 and arrays["maxabs"][k] == 5.0
    assert arrays["fp"][k] == int(trace.fingerprint(z))
    assert int(trace.fingerprint(z)) == int(trace.fingerprint(torch.view_as_real(z)))


def test_a_failing_record_leaves_rows_and_values_aligned(monkeypatch, tmp_path):
    """An output whose record raises adds no row: when the caller catches the error and goes on, the
    trace still saves and loads with every row's values."""
    real = trace.record_values

    def picky(t):
        if t.dtype == torch.float64:
            raise RuntimeError("no values for this output")
        return real(t)

    monkeypatch.setattr(trace, "record_values", picky)
    with trace.Recorder() as rec:
        rec.step()
        torch.ones(3) * 2
        with pytest.raises(RuntimeError, match="no values"):
            torch.ones(3, dtype=torch.float64) * 2   # the float64 ones: its record fails, so does the op
        torch.ones(2) + 1
    t = trace.load(rec.save(tmp_path / "t.trace"))
    assert len(t) == 4   # ones, mul, ones, add: the float32 records, each with its values
    assert {t.header["dtypes"][i] for i in t.cols["dtype"]} == {"float32"}
    assert t.cols["l2"][1] == float(torch.linalg.vector_norm(torch.full((3,), 2.0, dtype=torch.float64)))


def test_exit_leaves_no_dispatch_mode_behind_when_the_flush_fails(monkeypatch):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    rec = trace.Recorder()

    def broken():
        raise RuntimeError("transfer failed")

    with pytest.raises(RuntimeError, match="transfer failed"):
        with rec:
            rec.step()
            torch.ones(2) * 2
            monkeypatch.setattr(rec, "_flush", broken)
    assert not _get_current_dispatch_mode_stack() and not rec._hooks
    with pytest.raises(RuntimeError, match="entered once"):
        monkeypatch.undo()
        with rec:
            with rec:
                pass
    assert not _get_current_dispatch_mode_stack() and not rec._hooks


def test_a_module_whose_forward_raises_is_left_off_the_path():
    class Bad(torch.nn.Module):
        def forward(self, x):
            torch.ones(1) * 3
            raise ValueError("bad input")

    lin = torch.nn.Linear(2, 2)
    with trace.Recorder() as rec:
        rec.step()
        with pytest.raises(ValueError, match="bad input"):
            Bad()(torch.ones(2))
        rec.step()
        lin(torch.ones(1, 2)).sum()
    arrays = rec.arrays()
    modules = json.loads(bytes(arrays["header"]).decode())["modules"]
    step1 = [modules[m] for m, s in zip(arrays["module"], arrays["step"]) if s == 1]
    assert step1 and "Bad" not in " ".join(step1) and "Linear" in step1


def test_the_recorders_own_ops_are_quiet_on_its_thread_only():
    """While the recorder runs its own ops (a step's transfer, a snapshot) they are not records; another
    thread's ops in that time (autograd's per-device backward) still are."""
    import threading

    rec = trace.Recorder()
    rec.step()
    neg = torch.ops.aten.neg.default
    rec._quiet = True
    other = threading.Thread(target=rec.__torch_dispatch__, args=(neg, (), (torch.ones(2),)))
    other.start()
    other.join()
    rec.__torch_dispatch__(neg, (), (torch.ones(3),))   # this thread's: quiet
    assert len(rec.rows) == 1 and rec.tables["shapes"] == {"2": 0}
    rec._quiet = False
    rec.__torch_dispatch__(neg, (), (torch.ones(3),))
    assert len(rec.rows) == 2


def test_paused_records_nothing_on_any_thread():
    """paused() (a CUDA-graph step's warm-up) hides ops on every thread, autograd's device threads included;
    after it, both threads' ops are records again."""
    import threading

    rec = trace.Recorder()
    rec.step()
    neg = torch.ops.aten.neg.default

    def both():
        other = threading.Thread(target=rec.__torch_dispatch__, args=(neg, (), (torch.ones(2),)))
        other.start()
        other.join()
        rec.__torch_dispatch__(neg, (), (torch.ones(3),))

    with rec.paused():
        both()
    assert rec.rows == []
    both()
    assert len(rec.rows) == 2


def test_a_captured_steps_records_replayed_give_the_eager_rows():
    """The bookkeeping of a recorded CUDA-graph capture, on the CPU: the records made inside capturing()
    go to the capture, none to the step; replayed() adds them to each step with the step's number and
    indices continuing the step's, as the same ops run eagerly step after step would be recorded (the
    values here are those of the capture's ops, which a CPU capture does not rerun: the same inputs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)

    def run(m):   # the gradients None before each backward, as in a training step (and a graph's capture)
        m.zero_grad(set_to_none=True)
        loss = m(x).square().sum()
        loss.backward()

    with trace.Recorder(model=model) as eager:
        for _ in range(3):
            eager.step()
            torch.ones(2).neg()   # an op of the step before the captured ones
            run(model)
    want = eager.arrays()
    with trace.Recorder(model=model) as rec:
        for s in range(3):
            rec.step()
            torch.ones(2).neg()
            if s == 0:   # captured at the first step, as record_training does
                rows = len(rec.rows)
                with rec.capturing(None) as cap:
                    run(model)
                assert len(rec.rows) == rows and rec.index == rows and cap.ops > 0
                assert len(cap.rows) == len(cap.pending)
            rec.replayed(cap)
    got = rec.arrays()
    for col in trace.COLUMNS:
        assert np.array_equal(got[col], want[col]), col
    assert got["header"].tobytes() == want["header"].tobytes()


def test_replayed_values_are_the_capture_rows_as_the_replay_left_them(monkeypatch):
    """With the kernel's stand-in writing slot rows (chunks of 3 rows): the records of a capture come back,
    per replay, with the values the replay wrote into the capture's rows (here written by hand, as a CPU
    capture reruns nothing), after the step's own records, across chunk boundaries on both sides."""
    KernelStandIn(monkeypatch)
    monkeypatch.setattr(trace._Slots, "ROWS", 3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    with trace.Recorder(model=model) as rec:
        for s in range(3):
            rec.step()
            torch.ones(2).neg()
            if s == 0:
                with rec.capturing(None) as cap:
                    model(x).square().sum()
                n = len(cap.rows)
                assert n > 3 and len(cap.slots[-1].chunks) > 1
            with rec.paused():   # "the replay": new L2 values in every row
                for chunk in cap.slots[-1].chunks:
                    chunk[:, 1] = 10.0 * s
            rec.replayed(cap)
    got = rec.arrays()
    for s in range(3):
        l2 = got["l2"][got["step"] == s]
        assert len(l2) == 2 + n and (l2[:2] == 2.0 ** 0.5).all() and (l2[2:] == 10.0 * s).all()   # ones, neg first


def test_a_replay_launches_waiting_fingerprints_before_it_writes(monkeypatch):
    """A replay writes the graph's outputs behind the dispatcher: a fingerprint waiting for its batch is
    taken before the replay runs, not after (the value recorded is the op's)."""
    KernelStandIn(monkeypatch)
    base, zero = torch.arange(4.0), torch.zeros(1)
    with trace.Recorder() as rec:
        rec.step()
        with rec.capturing(None) as cap:
            pass
        out = base.neg()   # recorded, its fingerprint waiting
        assert rec._deferred is not None

        class Graph:   # a replay rewriting ``out`` where no dispatcher sees it
            captured = cap

            def __call__(self, x, y):
                out.numpy()[:] = 7.0
                return x, y

        trace.replay(rec, Graph(), zero, zero)
    assert rec.arrays()["maxabs"].tolist() == [3.0]
    with pytest.raises(trace.TraceError, match="captured without a recorder"):
        trace.replay(trace.Recorder(), types.SimpleNamespace(captured=None), None, None)


def test_a_capture_is_recorded_one_at_a_time_and_never_with_kept_tensors():
    rec = trace.Recorder(keep={(0, "forward", 0)})
    with pytest.raises(trace.TraceError, match="keep"), rec.capturing(None):
        pass
    rec = trace.Recorder()
    with rec.capturing(None), pytest.raises(trace.TraceError, match="one at a time"), rec.capturing(None):
        pass
    assert rec._capture is None


def test_profiler_annotations_take_no_index():
    """record_function ranges (torch's optimizers open one in zero_grad) are dispatched as ops but compute
    nothing: a step calling zero_grad between forward and backward records what one without it does, at
    the same indices (as a step replayed from a graph, which has no zero_grad)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    got = []
    for zero in (False, True):
        with trace.Recorder() as rec:
            rec.step()
            loss = model(x).sum()
            if zero:
                opt.zero_grad(set_to_none=True)
                with torch.autograd.profiler.record_function("a range"):
                    pass
            loss.backward()
        got.append(rec.arrays())
        model.zero_grad(set_to_none=True)
    for col in trace.COLUMNS:
        assert np.array_equal(got[0][col], got[1][col]), col


def test_slots_append_copies_rows_across_chunk_boundaries(monkeypatch):
    """A replayed capture's rows copied after the step's own: every row lands in order whatever chunk
    boundaries the source and destination cross, and the next row handed out follows them."""
    monkeypatch.setattr(trace._Slots, "ROWS", 3)
    src, dst = trace._Slots(torch.device("cpu")), trace._Slots(torch.device("cpu"))
    for _ in range(7):
        src.next_ptr()
    for c in range(3):
        src.chunks[c].copy_(torch.arange(9 * c, 9 * c + 9, dtype=torch.float64).view(3, 3))
    for _ in range(2):
        dst.next_ptr()
    assert dst.append(src) == 2 and dst.used == 9
    p = dst.next_ptr()
    assert p == dst.chunks[3].data_ptr() and dst.used == 10
    got = torch.cat(dst.chunks)
    assert torch.equal(got[2:9], torch.arange(21, dtype=torch.float64).view(7, 3))
    assert dst.append(src) == 10 and dst.used == 17
    assert dst.next_ptr() == dst.chunks[5].data_ptr() + 24 * 2
    assert torch.equal(torch.cat(dst.chunks)[10:17], torch.arange(21, dtype=torch.float64).view(7, 3))


def test_a_model_deep_copied_while_recorded_reports_to_the_same_recorder():
    """A CUDA-graph step warms up on a deep copy of the model. ops="all": the copy's module wrappers are bound
    to the copy and report to the recorder's naming, not to a copy of it, under the original's paths; the
    copy computes with its own weights, and its wrappers pass straight through once the recording ends.
    ops="routed" (hooks on the model's parameterless leaves): the copy's hooks stay bound to the recorder."""
    import copy

    class Pushes(list):   # the stack's pushes, counted
        pushed = 0

        def append(self, item):
            self.pushed += 1
            super().append(item)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2))
    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    with trace.Recorder(ops="all", model=model) as rec:
        twin = copy.deepcopy(model)
        wrapper = twin[1].__dict__["forward"]
        assert isinstance(wrapper, trace._Named) and wrapper.naming is rec._naming and wrapper.module is twin[1]
        assert wrapper.path == "1" and wrapper is not model[1].__dict__["forward"]
        with torch.no_grad():
            twin[0].weight.mul_(2)
        rec.step()
        got = twin(x)
    assert not any("forward" in m.__dict__ for m in model.modules())
    a = rec.arrays()
    header = json.loads(bytes(a["header"]).decode())
    named = [(header["ops"][o], header["modules"][m]) for o, m in zip(a["op"], a["module"])]
    # (the copy's and the weight's ops come first, outside any module) the conv, then the pool's two outputs
    assert named[-3:] == [("convolution", "0"), ("max_pool2d_with_indices", "1"), ("max_pool2d_with_indices", "1")]
    assert torch.equal(got, twin(x)) and not torch.equal(got, model(x))
    rec._naming.stack = Pushes()   # after the recording, the copy's wrappers push nothing
    twin(x)
    assert rec._naming.stack.pushed == 0 and twin[1].__dict__["forward"] is wrapper
    rec._naming.on = True   # (control: the same wrappers, naming on, push)
    twin(x)
    assert rec._naming.stack.pushed == 3
    rec._naming.on = False   # the copy compiles (dynamo guards the wrappers' attributes)
    assert torch.equal(torch.compile(twin, backend="eager")(x), got)

    with routing.use_kernels("tree"), trace.Recorder(ops="routed", model=model) as rec:
        twin = copy.deepcopy(model)
        hooks = list(twin[1]._forward_pre_hooks.values())
        assert hooks and all(h.__self__ is rec for h in hooks) and "forward" not in twin[1].__dict__


def test_with_a_model_its_forwards_are_wrapped_not_hooked():
    """With a model, ops="all" names the model's modules by wrapping their forwards (no global or per-module
    hook, which put every module call on torch's slower path): the ops of each module and the backward ops
    of what it returns carry its path; a forward that raises leaves the stack; on exit every module's
    ``__dict__`` is as it was (an instance's own forward put back), and a wrapped forward keeps its
    signature and attributes and pickles as the forward it stands for."""
    import inspect
    import pickle

    from torch.nn.modules import module as mm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    own = model[1].forward   # an instance's own forward, wrapped and put back
    model[1].forward = own
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    with trace.Recorder(ops="all", model=model) as rec:
        assert not mm._global_forward_hooks and not mm._global_forward_pre_hooks
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert inspect.signature(model[0].forward) == inspect.signature(torch.nn.Linear(1, 1).forward)
        assert model[0].forward.__name__ == "forward"
        restored = pickle.loads(pickle.dumps(model))
        rec.step()
        model(x).sum().backward()
        with pytest.raises(RuntimeError):
            model(torch.randn(5, 7))
        assert rec.stack == []
        model[2].forward(torch.ones(1, 3))   # called directly: named too
    assert torch.equal(restored(x), model(x))
    a = rec.arrays()
    header = json.loads(bytes(a["header"]).decode())
    recs = [(trace.PHASES[p], header["ops"][o], header["modules"][m])
            for p, o, m in zip(a["phase"], a["op"], a["module"])]
    assert ("forward", "addmm", "0") in recs and ("forward", "addmm", "2") in recs
    assert ("forward", "relu", "1") in recs and ("backward", "threshold_backward", "1") in recs
    assert ("backward", "mm", "2") in recs and recs[-1][2] == "2"
    assert model[1].__dict__["forward"] is own and not any("forward" in model[i].__dict__ for i in (0, 2))


def test_module_wrappers_take_a_static_forward_and_nested_recorders():
    """A class whose forward is a staticmethod is wrapped as it is called; two recorders on one model, left
    in either order, leave no wrapper behind."""
    class Static(torch.nn.Module):
        @staticmethod
        def forward(x):
            return x * 2

    model = torch.nn.Sequential(Static())
    x = torch.ones(2)
    with trace.Recorder(ops="all", model=model):
        assert torch.equal(model(x), x * 2)
    assert "forward" not in model[0].__dict__
    for first_out in (True, False):
        a, b = trace.Recorder(ops="all", model=model), trace.Recorder(ops="all", model=model)
        a.__enter__()
        b.__enter__()
        assert model[0].__dict__["forward"].inner is not None   # b's wrapper over a's
        (a if first_out else b).__exit__(None, None, None)
        (b if first_out else a).__exit__(None, None, None)
        assert not any("forward" in m.__dict__ for m in model.modules()), first_out


@pytest.mark.parametrize("ops", ["all", "routed"])
def test_a_recorder_that_fails_to_enter_leaves_no_naming_behind(ops):
    """An error while entering (the dispatch mode for ops="all", the routing's observer for ops="routed")
    takes the module wrappers or hooks out again."""
    from torch.nn.modules import module as mm

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.MaxPool1d(1))

    def fail(*args, **kwargs):
        raise RuntimeError("entering failed")

    rec = trace.Recorder(ops=ops, model=model)
    with pytest.MonkeyPatch.context() as m, routing.use_kernels("tree"):
        m.setattr(trace, "_dynamo_skips_dispatch", fail)
        m.setattr(routing, "observe", fail)
        with pytest.raises(RuntimeError, match="entering failed"):
            rec.__enter__()
    assert not rec._hooks and not rec._naming.on and not mm._global_forward_hooks
    assert not any("forward" in mod.__dict__ or mod._forward_pre_hooks or mod._forward_hooks
                   for mod in model.modules())


def test_a_model_holding_a_data_parallel_is_named_by_global_hooks():
    """DataParallel replicates its module by copying each submodule's ``__dict__`` (a replica would share the
    original's wrapper): a model holding one is named by global module hooks, nothing put in any
    ``__dict__``."""
    from torch.nn.modules import module as mm

    model = torch.nn.Sequential(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    with trace.Recorder(ops="all", model=model):
        assert mm._global_forward_hooks and not any("forward" in m.__dict__ for m in model.modules())
        model(torch.ones(1, 2))
    assert not mm._global_forward_hooks


def test_lockstep_with_kept_tensors_refuses_a_captured_step(tmp_path):
    cfg = train.Config(**TINY, cuda_graph=True)   # (not resolved: a CPU config refuses --cuda-graph)
    with pytest.raises(train.ConfigError, match="--keep 0"):
        trace.lockstep(cfg, "kernel", 1, tmp_path, keep=1)


def test_ops_before_the_first_step_keep_their_own_indices():
    with trace.Recorder() as rec:
        torch.ones(2) * 2            # before step(): step 0
        rec.step()
        torch.ones(2) * 3
    arrays = rec.arrays()
    pairs = list(zip(arrays["step"].tolist(), arrays["index"].tolist()))
    assert len(set(pairs)) == len(pairs) and {s for s, _ in pairs} == {0}


def test_kept_bfloat16_and_ulps_of_every_float_dtype():
    x = torch.tensor([1.0, -2.0, 0.0], dtype=torch.bfloat16)
    kept = trace.kept_array(x)
    assert kept.dtype == np.int16 and np.array_equal(trace.kept_values(kept, "bfloat16"), [1.0, -2.0, 0.0])
    up = trace.kept_array(torch.nextafter(x, torch.full_like(x, 10.0)))
    assert trace.ulp_distance(kept, up, "bfloat16") == 1
    assert trace.ulp_distance(np.array([1.0]), np.array([np.nextafter(1.0, 2.0)]), "float64") == 1
    assert trace.ulp_distance(np.array([-0.0], np.float16), np.array([0.0], np.float16), "float16") == 0
    tiny = np.float32(1e-45)
    assert trace.ulp_distance(np.array([-tiny]), np.array([tiny]), "float32") == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        trace.ulp_distance(np.zeros(1), np.zeros(1), "int32")


def test_foreign_and_damaged_files_fail_as_trace_format_errors(tmp_path):
    np.save(tmp_path / "plain.npy", np.zeros(3))
    with pytest.raises(trace.TraceFormatError, match="NumPy array file"):
        trace.load(tmp_path / "plain.npy")
    arrays = _arrays(5, seed=4)
    arrays["header"] = np.frombuffer(json.dumps([1, 2]).encode(), dtype=np.uint8)
    with pytest.raises(trace.TraceFormatError, match="not a JSON object"):
        trace.load(_write(tmp_path / "list.trace", arrays))
    arrays = _arrays(5, seed=4)
    arrays["op"][2] = 7   # past the two-entry op table
    with pytest.raises(trace.TraceFormatError, match="op codes outside"):
        trace.load(_write(tmp_path / "codes.trace", arrays))
    arrays = _arrays(5, seed=4)
    hdr = json.loads(bytes(arrays["header"]).decode())
    del hdr["modules"]
    arrays["header"] = np.frombuffer(json.dumps(hdr).encode(), dtype=np.uint8)
    with pytest.raises(trace.TraceFormatError, match="no module table"):
        trace.load(_write(tmp_path / "tables.trace", arrays))
    # a corrupted byte inside a compressed member: zlib's error, as a format error
    good = _write(tmp_path / "good.trace", _arrays(200, seed=5)).read_bytes()
    at = good.index(b"fp.npy") + 200
    (tmp_path / "flip.trace").write_bytes(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:])
    with pytest.raises(trace.TraceFormatError):
        trace.load(tmp_path / "flip.trace")


def test_infinite_summaries_of_equal_outputs_do_not_hide_the_spread(tmp_path):
    a = _arrays(4, seed=6)
    a["l2"][0] = np.inf            # the same Inf in both runs
    b = {k: v.copy() for k, v in a.items()}
    b["fp"][2] += 1
    b["l2"][2] = a["l2"][2] * 2    # the one real difference: relative 0.5
    d = trace.diff(trace.load(_write(tmp_path / "a.trace", a)), trace.load(_write(tmp_path / "b.trace", b)))
    assert d["per_step"][0]["max_rel_l2_summary"] == 0.5
    json.loads(json.dumps(d, allow_nan=False))   # valid JSON: no NaN or Inf in the comparison


def test_cli_refuses_a_perturb_index_past_the_parameters(tmp_path):
    with pytest.raises(SystemExit) as e:
        trace.cli(["record", "--device", "cpu", "--model", "small", "--n-train", "32", "--n-test", "16",
                   "--batch-size", "16", "--steps", "1", "--perturb-ulp", "--perturb-index", "999999999",
                   "--no-progress", "-o", str(tmp_path / "p.trace")])
    assert e.value.code == 2


def test_wrapped_forwards_change_no_result_on_models_not_ours():
    """Naming by wrapped forwards leaves what a model computes alone: a conv subclass whose forward calls
    super().forward, a module with its own forward hook, attention returning a tuple with None, and
    torch.func.functional_call with other weights give the same outputs and gradients, bit for bit, recorded
    and not; every module call is named once (the stack empty after)."""
    class Scaled(torch.nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 0.5

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = Scaled(2, 4, 3, padding=1)
            self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = torch.nn.Linear(4, 3)
            self.head.register_forward_hook(lambda m, a, out: out + 1)

        def forward(self, x):
            h = self.conv(x).flatten(2).transpose(1, 2)
            h, _ = self.attn(h, h, h, need_weights=False)
            return self.head(h.mean(1))

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 2, 5, 5, generator=torch.Generator().manual_seed(3))
    other = {k: v * 1.5 for k, v in net.named_parameters()}

    def run() -> list[torch.Tensor]:
        net.zero_grad(set_to_none=True)
        y = net(x)
        y.square().sum().backward()
        z = torch.func.functional_call(net, other, (x,))
        return [y.detach(), z.detach(), *(p.grad for p in net.parameters())]

    want = run()
    with trace.Recorder(ops="all", model=net) as rec:
        rec.step()
        got = run()
        assert rec.stack == []
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    a = rec.arrays()
    header = json.loads(bytes(a["header"]).decode())
    assert {"conv", "attn", "head"} <= set(header["modules"])


def test_a_snapshot_of_the_same_list_into_the_same_rows_launches_its_last_structs_again(monkeypatch):
    """``snapshot`` of one list, step after step: the first launch into a placement of its rows goes the per-op
    way; the next ones into the same rows launch the bytes built then again (the structs hold tensor and row
    addresses). Records before it that move its rows go the per-op way, and so do, without a record, a tensor
    swapped in the list, another storage (``.data``), another shape or other strides at the same address
    (not contiguous: copied per launch, never launched again). The kernel's stand-in reads each launch's
    descriptors: every record equals the formula's, values written in place between steps included."""
    steps = ((0, 2), (0, ("struct", 2)), (0, ("struct", 2)), (2, 2), (2, ("struct", 2)), (0, 2), (0, ("struct", 2)))

    def run(kernel: KernelStandIn | None) -> tuple[dict, list]:
        g = torch.Generator().manual_seed(3)
        w, b, e = torch.randn(8, 5, generator=g), torch.randn(5, generator=g), torch.randn(3, generator=g)
        named = [("w", w), ("b", b)]
        launches = []
        with trace.record(None) as rec:
            def snapshot():
                if kernel is not None:
                    kernel.launches.clear()
                rec.snapshot(named)
                launches.append(list(kernel.launches) if kernel is not None else None)

            for extra, _ in steps:
                rec.step()
                for _ in range(extra):   # records before the snapshot: its rows come after theirs
                    e.neg()
                w.mul_(0.5)   # values written in place: same addresses, the next launch reads them
                snapshot()
            # the list's tensors changed without a record (so its rows stay put): another tensor in the list,
            # another storage, another shape at the same address, other strides at the same address (not
            # contiguous: per op every time); each a new plan, its first launch per op
            changes = (lambda: named.__setitem__(1, ("b", b * 2)),
                       lambda: setattr(w, "data", torch.randn(8, 5, generator=g)),
                       lambda: w.resize_(4, 5),
                       lambda: w.as_strided_((5, 4), (1, 5)))
            for change in changes:
                with rec.paused():
                    change()
                for _ in range(2):
                    rec.step()
                    snapshot()
        return rec.arrays(), launches

    with monkeypatch.context() as m:
        kernel = KernelStandIn(m)
        built = []
        real = trace._fp_batches
        m.setattr(trace, "_fp_batches", lambda ts, outs: built.append(len(ts)) or real(ts, outs))
        got, launches = run(kernel)
    assert launches == [[way] for _, way in steps] + [[2], [("struct", 2)]] * 3 + [[2], [2]]
    assert built == [2] * 6   # once per plan and placement launched again
    want, _ = run(None)
    assert np.array_equal(got["fp"], want["fp"]) and np.array_equal(got["maxabs"], want["maxabs"])
    assert np.array_equal(got["op"], want["op"]) and (got["phase"] == trace._PHASE["other"]).sum() == 2 * (7 + 8)



def test_the_recorder_takes_the_trace_sinks_records_in_order_and_codes_them(monkeypatch):
    """The Python side of the trace sink (nnrand/replay.cpp), against a stand-in that hands over records as the
    sink does: a first take row by row (new ops, modules and dtypes coded in the order of their records, and
    each code handed back to the sink), a later take already coded, the op indices continued by the calls, the
    pending values (device, slot row) of each record, and a record written early failing the recording with
    its op and module named."""
    model = torch.nn.Linear(2, 2)

    class Sink:
        def __init__(self):
            self.codes, self.takes = [], []

        def sink_dtype(self, t):
            return {torch.float32: 6, torch.int64: 4}.get(t.dtype, 99)

        def sink_start(self, pass_ended, unnamed, owners, defer):
            self.owners = {id(p): m for p, m in owners}
            return ["convolution_backward", "cudnn_batch_norm"]

        def sink_code(self, kind, key, a, b):
            self.codes.append((kind, key, a, b))

        def sink_take(self, launch, values, checked, step, index):
            return self.takes.pop(0)

    def rows(*records):   # (call, op, module, phase, output, shape, dtype, device, slot)
        return np.array(records, dtype=np.int64).tobytes()

    sink = Sink()
    monkeypatch.setattr(trace, "_kernels_here", lambda: True)
    rec = trace.Recorder(ops="routed", model=model)
    rec._owners, rec._owned = {id(model.weight): "lin", id(model.bias): "lin"}, [model.weight, model.bias]
    rec._start_sink(sink)
    assert set(sink.owners.values()) == {rec._sink_names["lin"]}   # both parameters, of one module
    assert (3, 2, trace._PHASE["other"], 0) in sink.codes   # the phases' codes given at the start
    lin, none = rec._sink_names["lin"], rec._sink_names[""]
    rec.index, rec._phase = 5, "optimizer"
    # first take: two calls (the second with two outputs), then a snapshot record; shapes new
    sink.takes.append((0, 3, 0, rows((0, 1, lin, 0, 0, 0, 6, 0, 0), (1, 0, none, 1, 0, 1, 6, 0, 1),
                                     (1, 0, none, 1, 1, 0, 4, 0, 2), (2, -1, lin, 2, 0, 1, 6, 0, 3)),
                       [[3, 4], [7]], [], [], {}, None, 0, b""))
    rec._sink_snap_ops.append("parameter")
    rec._sink_snap["parameter"] = 0
    rec._take_sink()
    opt, back, other = (trace._PHASE[p] for p in ("optimizer", "backward", "other"))
    assert rec.rows == [(0, opt, 5, 0, 0, 0, 0, 0), (0, back, 6, 1, 1, 0, 1, 0), (0, back, 6, 1, 1, 1, 0, 1),
                        (0, other, 7, 2, 0, 0, 1, 0)]
    assert rec.index == 8 and rec.pending == [(("sink", 0), i) for i in range(4)]
    assert list(rec.tables["ops"]) == ["cudnn_batch_norm", "convolution_backward", "parameter"]
    assert list(rec.tables["modules"]) == ["lin", ""] and list(rec.tables["dtypes"]) == ["float32", "int64"]
    assert list(rec.tables["shapes"]) == ["3x4", "7"]

    def key(op, mod):   # (op, module) packed as the sink keys their codes
        return op * (1 << 32) + mod

    assert [c for c in sink.codes if c[0] != 3] == [(1, 0, 0, 0), (1, 1, 1, 0), (0, key(1, lin), 0, 0), (2, 6, 0, 0),
                                                   (0, key(0, none), 1, 1), (2, 4, 1, 0), (0, key(-1, lin), 2, 0)]
    # a later take comes coded; its second record (row 5 of the sink) was written before its launch
    coded = np.array([(0, 1, 8, 1, 1, 0, 1, 0), (0, 1, 8, 1, 1, 1, 0, 1)], dtype=np.int64).tobytes()
    sink.takes.append((3, 1, 4, b"", [], [], [5], {}, coded, 0, np.array([4, 5], dtype=np.int64).tobytes()))
    with pytest.raises(trace.TraceError, match=r"output 1 of aten::convolution_backward \(step 0, backward index 8"):
        rec._take_sink()
    assert rec.index == 9 and rec.rows[-1] == (0, 1, 8, 1, 1, 1, 0, 1) and rec.pending[-1] == (("sink", 0), 5)
