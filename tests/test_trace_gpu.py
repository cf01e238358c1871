"""nnrand.trace on the GPU: the fused fingerprint kernel against the torch formula, and traces of two
tree runs bitwise equal."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nnrand import trace, train
from tests.helpers import bitwise_equal, routed_recording

pytestmark = pytest.mark.gpu


BLOCK = trace._FP_WORDS_PER_BLOCK   # elements per block before a tensor gets another one


@pytest.mark.parametrize("n", [1, 255, 1023, BLOCK + 1, 3 * BLOCK + 13, 1 << 20, (1 << 22) + 3])
def test_fused_fingerprint_matches_the_formula(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, device="cuda", generator=g) * 3
    got = trace.fingerprint_cuda(x)
    fp, l2, mx = got[0].view(torch.int64), got[1], got[2]
    assert int(fp) == int(trace.fingerprint(x))
    assert float(mx) == float(x.abs().max())
    # x*x is exact in double (24-bit significands); two sums of n doubles in different orders differ by
    # at most 2 (n - 1) 2^-53 relative, the square root halves that; one more rounding each for the root
    want = torch.linalg.vector_norm(x.double())
    assert abs(float(l2) - float(want)) <= (n + 2) * 2.0**-53 * float(want)
    reps = {trace.fingerprint_cuda(x).cpu().numpy().tobytes() for _ in range(20)}
    assert len(reps) == 1
    x[n // 2] = float("nan")
    got = trace.fingerprint_cuda(x)
    assert torch.isnan(got[1]) and torch.isnan(got[2]) and int(got[0].view(torch.int64)) == int(trace.fingerprint(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_unaligned_four_byte_tensors_get_the_bits_of_an_aligned_copy(dtype):
    """4-byte elements are read in groups of 4, by one 16-byte load where the tensor is 16-byte aligned and
    by four loads where not, in the same order: a view starting 1-3 elements into an allocation gives
    the (fp, L2, max) bits of its aligned copy, in either kernel, and fp equals the formula's."""
    g = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(3 * BLOCK + 13, device="cuda", generator=g) * 5   # several blocks and a short one
    base = base if dtype == torch.float32 else base.round().to(dtype)
    for offset in (1, 2, 3):
        for n in (5, BLOCK + 1, 3 * BLOCK + 13 - offset):
            view = base[offset:offset + n]
            assert view.data_ptr() % 16 != 0
            copy = view.clone()
            assert copy.data_ptr() % 16 == 0
            got, want = trace.fingerprint_cuda(view), trace.fingerprint_cuda(copy)
            assert bitwise_equal(got, want), (offset, n)
            assert int(got[0].view(torch.int64)) == int(trace.fingerprint(copy))
            out = torch.empty(2, 3, dtype=torch.float64, device="cuda")
            trace._launch_fingerprints([view, copy], [out[0].data_ptr(), out[1].data_ptr()])
            assert bitwise_equal(out[0], want) and bitwise_equal(out[1], want)


def test_batched_fingerprints_equal_one_launch_each():
    """fingerprint_batch gives every tensor the bits of its own launch: sizes from one word to the 1024-block
    cap, a non-contiguous one, more tensors than one launch takes (FP_BATCH) and more blocks than the
    scratch holds (FP_SCRATCH_BLOCKS), bit for bit in each of 10 repeats."""
    g = torch.Generator(device="cuda").manual_seed(5)
    sizes = [1, 255, 4096, BLOCK + 1, 1 << 20, (1 << 22) + 3] + [37 * k for k in range(1, 121)] + [1 << 24] * 17
    ts = [torch.randn(n, device="cuda", generator=g) for n in sizes]
    ts.append(torch.randn(300, 70, device="cuda", generator=g).T)   # read in logical order, like one launch
    assert len(ts) > trace.FP_BATCH and sum(trace.fp_blocks(t.numel()) for t in ts) > trace.FP_SCRATCH_BLOCKS
    want = torch.stack([trace.fingerprint_cuda(t) for t in ts])
    for _ in range(10):
        got = torch.zeros(len(ts), 3, dtype=torch.float64, device="cuda")
        trace._launch_fingerprints(ts, [got[i].data_ptr() for i in range(len(ts))])
        assert bitwise_equal(got.view(torch.int64), want.view(torch.int64))


def test_two_tree_runs_record_identical_traces(tmp_path, monkeypatch):
    cfg = train.resolve(train.Config(device="cuda", model="resnet18", n_train=512, n_test=64, batch_size=64,
                                     epochs=1, progress=False, report=False, kernel="tree"))
    a = trace.load(trace.record_training(cfg, 2, tmp_path / "a.trace"))
    b = trace.load(trace.record_training(cfg, 2, tmp_path / "b.trace"))
    d = trace.diff(a, b)
    assert d == {"status": "identical", "records": len(a)}, trace.format_diff(d)
    routed = trace.load(trace.record_training(cfg, 2, tmp_path / "r.trace", ops="routed"))
    assert len(routed) < len(a)
    # the kernel path changes neither which ops run nor what they compute: the same run with every
    # fingerprint taken by the torch formula gives the same records and fingerprints
    monkeypatch.setattr(trace, "_fused", lambda t: False)
    c = trace.load(trace.record_training(cfg, 2, tmp_path / "c.trace"))
    d = trace.diff(a, c)
    assert d == {"status": "identical", "records": len(a)}, trace.format_diff(d)


def test_routed_recording_through_the_replay_layer_equals_python_kernels(tmp_path, monkeypatch):
    """ops="routed" with the C++ replay layer on: replayed calls are recorded in C++ (the layer's trace sink,
    counted here) or reach the recorder from C++, and the trace equals the one recorded with every routed
    call in Python (NNRAND_REPLAY=0), record for record: the same ops, modules and fingerprints."""
    import contextlib

    from nnrand import replay, routing

    if replay.load(quiet=True) is None:
        pytest.skip(f"the replay extension does not build here: {replay.failure()}")
    cfg = train.resolve(train.Config(device="cuda", model="resnet18", n_train=512, n_test=64, batch_size=64,
                                     epochs=1, progress=False, report=False, kernel="tree"))
    notified, recs = [], []
    notify = routing._notify
    monkeypatch.setattr(routing, "_notify", lambda s, op, out, args: (notified.append(op), notify(s, op, out, args)))
    record = trace.record

    @contextlib.contextmanager
    def kept(*args, **kwargs):
        with record(*args, **kwargs) as rec:
            recs.append(rec)
            yield rec

    monkeypatch.setattr(trace, "record", kept)
    monkeypatch.setenv(replay.ENV, "1")
    on = trace.load(trace.record_training(cfg, 3, tmp_path / "on.trace", ops="routed"))
    assert recs[0].sink_stats["recorded"] > 0, recs[0].sink_stats
    monkeypatch.setenv(replay.ENV, "0")
    count = len(notified)
    off = trace.load(trace.record_training(cfg, 3, tmp_path / "off.trace", ops="routed"))
    assert len(notified) == count and recs[1].sink_stats == {}
    d = trace.diff(on, off)
    assert d == {"status": "identical", "records": len(on)}, trace.format_diff(d)


@pytest.mark.parametrize("ops,amp", [("all", None), ("routed", None), ("all", "fp16")])
def test_steps_replayed_from_a_cuda_graph_record_the_eager_trace(tmp_path, ops, amp):
    """Forward and backward captured once (``--cuda-graph``) and replayed: the captured ops' records added at
    each replay, their fingerprints written by the replay, give the eager run's trace bit for bit (tree:
    the same kernels in the same order; fp16: with the loss scaler's steps between)."""
    import dataclasses

    cfg = train.resolve(train.Config(device="cuda", model="resnet18", n_train=512, n_test=64, batch_size=64,
                                     epochs=1, progress=False, report=False, kernel="tree", amp=amp))
    eager = trace.load(trace.record_training(cfg, 3, tmp_path / "eager.trace", ops=ops))
    graph = trace.load(trace.record_training(dataclasses.replace(cfg, cuda_graph=True), 3, tmp_path / "graph.trace",
                                             ops=ops))
    d = trace.diff(eager, graph)
    assert d == {"status": "identical", "records": len(eager)}, trace.format_diff(d)
    # not the capture's values replayed three times: each step's backward records (another batch, other
    # weights) differ from the last step's, but for the few constant ones (the loss gradient's seed of ones)
    back = graph.cols["phase"] == trace.PHASES.index("backward")
    fps = [graph.cols["fp"][back & (graph.cols["step"] == s)] for s in range(3)]
    assert len(fps[0]) > 0 and all(len(f) == len(fps[0]) for f in fps)
    assert (fps[0] != fps[1]).mean() > 0.5 and (fps[1] != fps[2]).mean() > 0.5


def test_keep_is_refused_for_a_captured_step(tmp_path):
    cfg = train.resolve(train.Config(device="cuda", model="resnet18", n_train=256, n_test=64, batch_size=64,
                                     epochs=1, progress=False, report=False, kernel="tree", cuda_graph=True))
    with pytest.raises(train.ConfigError, match="--keep"):
        trace.record_training(cfg, 1, tmp_path / "k.trace", keep={(0, "backward", 3)})


def test_recorded_rows_match_the_formula_across_slot_chunks(monkeypatch):
    """Records whose values the kernel writes into the per-step slot rows (several chunks per step) equal
    those computed by the torch formula, record by record: fingerprints and max |x| exactly, L2 within the
    bound above."""
    def run() -> dict:
        g = torch.Generator(device="cuda").manual_seed(11)
        x = torch.randn(64, 300, device="cuda", generator=g)
        with trace.record(None) as rec:
            for _ in range(3):
                rec.step()
                y = torch.relu(x @ x.T).double().sum(0).float()
                (x.T.contiguous() * 2 + y.mean()).tanh().sum()
                rec.snapshot([("x", x), ("y", y)])
        return rec.arrays()

    monkeypatch.setattr(trace._Slots, "ROWS", 4)
    got = run()
    monkeypatch.setattr(trace, "_fused", lambda t: False)
    want = run()
    assert len(got["fp"]) == len(want["fp"]) > 12
    assert np.array_equal(got["fp"], want["fp"]) and np.array_equal(got["maxabs"], want["maxabs"])
    n = 64 * 300   # the largest record's element count
    assert np.all(np.abs(got["l2"] - want["l2"]) <= (n + 2) * 2.0**-53 * np.abs(want["l2"]))


def test_out_slot_is_written_and_checked():
    x = torch.arange(10, dtype=torch.float32, device="cuda")
    out = torch.zeros(2, 3, dtype=torch.float64, device="cuda")
    trace.fingerprint_cuda(x, out[1])
    assert int(out[1, 0].view(torch.int64)) == int(trace.fingerprint(x)) and float(out[1, 2]) == 9.0
    assert bitwise_equal(out[0], torch.zeros(3, dtype=torch.float64, device="cuda"))
    with pytest.raises(ValueError, match="out must be 3 contiguous float64"):
        trace.fingerprint_cuda(x, out[:, 0])


def _values(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:   # bytes 0, 1 and 2: read as they are, like the formula
        return torch.randint(0, 3, (n,), device="cuda", generator=g, dtype=torch.uint8).view(torch.bool)
    if dtype == torch.float64:   # every bit of both halves in play
        return torch.randn(n, device="cuda", generator=g, dtype=torch.float64) * 100
    if dtype.is_floating_point:
        return (torch.randn(n, device="cuda", generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
    return torch.randint(lo, hi, (n,), device="cuda", generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", list(trace.FP_KINDS), ids=str)
def test_every_kernel_dtype_matches_the_formula(dtype):
    """Each element type the kernel takes: the formula's fingerprint (bit patterns zero-extended for one
    byte, sign-extended otherwise) and max |x| exactly; L2 within the bound of n + 3 roundings of 2^-53
    relative (a square of an integer above 2^26 rounds once, the sum of n positive terms n - 1 times,
    the root once); NaN summaries for a NaN; one launch of a mixed batch gives every tensor its own bits."""
    g = torch.Generator(device="cuda").manual_seed(8)
    for n in (1, 4097, (1 << 20) + 5):
        x = _values(dtype, n, g)
        got = trace.fingerprint_cuda(x)
        assert int(got[0].view(torch.int64)) == int(trace.fingerprint(x))
        want_l2, want_mx = trace.summaries(x)
        assert float(got[2]) == float(want_mx)
        assert abs(float(got[1]) - float(want_l2)) <= (n + 3) * 2.0**-53 * float(want_l2)
    if dtype.is_floating_point:
        x[n // 3] = float("nan")
        got = trace.fingerprint_cuda(x)
        assert torch.isnan(got[1]) and torch.isnan(got[2])
        assert int(got[0].view(torch.int64)) == int(trace.fingerprint(x))
    ts = [_values(d, 3000 + 17 * k, g) for k, d in enumerate(trace.FP_KINDS)] + [x]
    want = torch.stack([trace.fingerprint_cuda(t) for t in ts])
    out = torch.zeros(len(ts), 3, dtype=torch.float64, device="cuda")
    trace._launch_fingerprints(ts, [out[i].data_ptr() for i in range(len(ts))])
    assert bitwise_equal(out.view(torch.int64), want.view(torch.int64))


def test_routed_records_deferred_to_the_end_of_backward_equal_per_op_launches(monkeypatch):
    """ops="routed" launches a backward pass's fingerprints when the pass ends: the same records, bit for
    bit, as launching per op, and the fingerprints of the torch formula; a gradient hook that writes a
    routed op's output in place fails the deferred recording."""
    deferred = routed_recording(device="cuda")
    per_op = routed_recording(defer=False, device="cuda")
    for k in deferred:
        assert np.array_equal(deferred[k], per_op[k]), k
    monkeypatch.setattr(trace, "_fused", lambda t: False)
    formula = routed_recording(device="cuda")
    assert np.array_equal(deferred["fp"], formula["fp"]) and len(formula["fp"]) > 50
    monkeypatch.undo()

    def double(grad):
        grad.mul_(2)

    with pytest.raises(trace.TraceError, match="aten::convolution_backward"):
        routed_recording(device="cuda", hook=double, steps=1)


def test_deferred_fingerprints_equal_the_formula_under_writes_and_streams(monkeypatch):
    """ops="all" launches its fingerprints in batches: before an op writes a recorded tensor (in place,
    through a view, out=, foreach), per stream (a side stream's records go out on it), with freed
    recorded tensors' memory held. The records equal those of the torch formula computed at each op;
    without the check for written tensors (negative control) they do not."""
    def run() -> dict:
        g = torch.Generator(device="cuda").manual_seed(9)
        side = torch.cuda.Stream()
        with trace.record(None) as rec:
            for _ in range(3):
                rec.step()
                a = torch.randn(1 << 16, device="cuda", generator=g)
                x = a * 2
                x.add_(1)
                x[3:900].mul_(-3)
                torch.mul(a, a, out=x)
                torch._foreach_add_([x, a], 1.5)
                y = x.exp()
                del y
                k = (x > 0).sum()                       # int64 and bool records
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    w = x * 3
                    w.sub_(1)
                torch.cuda.current_stream().wait_stream(side)
                x.add_(w)
                x.mul_(k.to(torch.float32))
                rec.snapshot([("x", x), ("w", w)])
        return rec.arrays()

    got = run()
    with monkeypatch.context() as m:
        m.setattr(trace, "_fused", lambda t: False)
        want = run()
    assert len(got["fp"]) == len(want["fp"]) > 30
    for key in ("op", "shape", "dtype", "fp", "maxabs"):
        assert np.array_equal(got[key], want[key]), key
    with monkeypatch.context() as m:
        m.setattr(trace, "_writes_any", lambda *a: False)
        late = run()
    assert not np.array_equal(late["fp"], want["fp"])


def test_a_stream_waits_for_a_side_stream_batch_before_writing_what_it_reads(monkeypatch):
    """A batch recorded on a side stream goes out on that stream; when the main stream then writes one of
    its tensors, the recorder makes the main stream wait for that launch. Here the side stream is kept busy
    (a sleep enqueued after the user's own wait) so that without the recorder's wait the main stream's write
    lands first: the records equal the formula's only with the wait (negative control without it)."""
    def run() -> dict:
        g = torch.Generator(device="cuda").manual_seed(12)
        side = torch.cuda.Stream()
        with trace.record(None) as rec:
            for _ in range(2):
                rec.step()
                x = torch.randn(1 << 20, device="cuda", generator=g)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    w = x * 3                                 # recorded on the side stream, waiting
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(50_000_000)             # not an op: the side batch goes out after it
                w.mul_(-2)                                    # the main stream writes what the batch reads
                rec.snapshot([("w", w)])
        return rec.arrays()

    got = run()
    with monkeypatch.context() as m:
        m.setattr(trace, "_fused", lambda t: False)
        want = run()
    assert np.array_equal(got["fp"], want["fp"]) and len(got["fp"]) >= 6
    with monkeypatch.context() as m:
        m.setattr(trace, "_wait_for", lambda index, stream: None)
        raced = run()
        # the raced side batch may still be running (behind its sleep) and writes the value rows of a
        # recorder now gone, whose memory the next test's rows may already have: it ends here
        torch.cuda.synchronize()
    assert not np.array_equal(raced["fp"], want["fp"])


def test_deferred_batches_split_at_their_limits(monkeypatch):
    """A deferred batch goes out when it holds FP_BATCH tensors, would pass the scratch's FP_SCRATCH_BLOCKS
    blocks, or holds more than HELD_BYTES of storage (lowered here): every split launch gives the records
    of the torch formula."""
    calls = []
    launch = trace._launch_deferred
    BIG = trace.FP_MAX_BLOCKS * trace.FP_THREADS * trace.FP_WORDS_PER_THREAD   # float32 elements
    assert trace.fp_blocks(BIG) == trace.FP_MAX_BLOCKS and 20 * trace.FP_MAX_BLOCKS > trace.FP_SCRATCH_BLOCKS

    def counted(d):
        calls.append((len(d.held), d.blocks, d.nbytes))
        launch(d)

    def run(limit: int) -> dict:
        g = torch.Generator(device="cuda").manual_seed(13)
        with monkeypatch.context() as m:
            m.setattr(trace, "HELD_BYTES", limit)
            m.setattr(trace, "_launch_deferred", counted)
            with trace.record(None) as rec:
                rec.step()
                big = torch.randn(BIG, device="cuda", generator=g)   # FP_MAX_BLOCKS blocks each
                for _ in range(20):
                    big = big + 1.0
                small = torch.randn(8, device="cuda", generator=g)
                for _ in range(2 * trace.FP_BATCH):
                    small = small * 1.5
        return rec.arrays()

    got = run(trace.HELD_BYTES)
    assert max(n for n, _, _ in calls) == trace.FP_BATCH                   # split by count
    assert any(b + trace.FP_MAX_BLOCKS > trace.FP_SCRATCH_BLOCKS for _, b, _ in calls)   # split by scratch blocks
    calls.clear()
    lowered = run(64 << 20)
    # split by held bytes: a batch passes the limit by its last tensor at most
    assert max(nbytes for _, _, nbytes in calls) <= (64 << 20) + 4 * BIG
    with monkeypatch.context() as m:
        m.setattr(trace, "_fused", lambda t: False)
        want = run(trace.HELD_BYTES)
    for arrays in (got, lowered):
        assert np.array_equal(arrays["fp"], want["fp"]) and len(want["fp"]) > 2 * trace.FP_BATCH



def test_a_snapshot_list_recorded_step_after_step_gives_the_formula_records(monkeypatch):
    """One parameter list of more tensors than one batch launch takes, snapshotted every step (its launches
    built once and launched again while its rows stay where they were), the values written in place between
    steps, one step with a record more before the snapshot (its rows move, then move back): the records equal
    the torch formula's, each step's fingerprints differ from the last's (the launches read the new values),
    and the launches were made again in the two steps whose rows had not moved."""
    sizes = (1, 300, BLOCK + 5, 7, 4096, 33) * 17   # 102 tensors: two launches of up to FP_BATCH (96)
    fresh = []

    def run() -> dict:
        g = torch.Generator(device="cuda").manual_seed(13)
        params = [torch.randn(n, device="cuda", generator=g) for n in sizes]
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        with trace.record(None) as rec:
            for s in range(5):
                rec.step()
                torch._foreach_mul_(params, 1.5)
                if s == 2:
                    params[0].add_(1)   # one record more before the snapshot in this step
                rec.snapshot(named)
        return rec.arrays()

    with monkeypatch.context() as m:
        per_op = trace._launch_fingerprints
        m.setattr(trace, "_launch_fingerprints", lambda ts, outs: fresh.append(len(ts)) or per_op(ts, outs))
        got = run()
    with monkeypatch.context() as m:
        m.setattr(trace, "_fused", lambda t: False)
        want = run()
    assert fresh == [len(sizes)] * 3   # steps 0, 2 and 3 per op; 1 and 4 launched again
    assert len(got["fp"]) == len(want["fp"]) == 5 * len(sizes) + 1   # (an in-place _foreach_mul_ has no outputs)
    for key in ("op", "module", "shape", "fp", "maxabs"):
        assert np.array_equal(got[key], want[key]), key
    snaps = got["fp"][got["phase"] == trace._PHASE["other"]].reshape(5, len(sizes))
    assert (snaps[1:] != snaps[:-1]).all()


def _small_cuda_net():
    """The small conv net of ``routed_recording`` (seeded) on the GPU, with a seeded batch of 4: (model, x, y)."""
    from nnrand import models

    torch.manual_seed(0)
    model = models.small(4).cuda()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(4, 3, 16, 16, generator=g).cuda(), torch.randint(0, 4, (4,), generator=g).cuda()


def _sink_or_skip():
    from nnrand import replay

    if replay.load(quiet=True) is None:
        pytest.skip(f"the replay extension does not build here: {replay.failure()}")


@pytest.mark.parametrize("defer", [True, False])
def test_the_trace_sink_records_what_the_python_observer_records(monkeypatch, defer):
    """ops="routed" with a model: the calls the replay layer replays (from a signature's third call on) are
    recorded in C++ by its trace sink. Every column and every string table, in the same order, equals the
    recording where each call reaches the recorder's Python observer (the sink turned off); with
    ``defer=False`` the backward outputs launch at once, as in Python."""
    from nnrand import routing

    _sink_or_skip()
    recs: list = []
    on = routed_recording(device="cuda", steps=4, defer=defer, recorders=recs)
    stats = recs[0].sink_stats
    # every replayed call taken (none passed to Python), with more records than calls (multi-output ops)
    assert stats["recorded"] > 0 and stats["declined"] == 0 and stats["rows"] > stats["recorded"], stats
    monkeypatch.setattr(routing, "sink", lambda: None)
    off = routed_recording(device="cuda", steps=4, defer=defer, recorders=recs)
    assert recs[1].sink_stats == {}
    assert on.keys() == off.keys()
    for k in on:
        assert np.array_equal(on[k], off[k]), k


def test_the_trace_sink_fails_a_recording_whose_deferred_output_is_written_early(monkeypatch):
    """A gradient hook that writes a conv backward's output in place in the fourth step (its calls replayed
    and recorded by the sink by then) fails the recording at the pass's end, in the sink's callback, naming
    the op; the same hook run before it writes nothing (negative control: the recording passes)."""
    _sink_or_skip()
    passes, raised = [0], []

    def double_late(grad):
        passes[0] += 1
        if passes[0] > 3:
            grad.mul_(2)

    pass_ended = trace.Recorder._sink_pass_ended

    def watched(self, task):
        try:
            return pass_ended(self, task)
        except trace.TraceError:
            raised.append(task)
            raise

    monkeypatch.setattr(trace.Recorder, "_sink_pass_ended", watched)
    recs: list = []
    routed_recording(device="cuda", steps=3, hook=double_late, recorders=recs)
    assert recs[0].sink_stats["recorded"] > 0 and not raised
    passes[0] = 0
    with pytest.raises(trace.TraceError, match="aten::convolution_backward"):
        routed_recording(device="cuda", steps=4, hook=double_late)
    assert len(raised) == 1   # the sink's check, not the Python path's


def test_the_trace_sink_takes_the_snapshots_it_can_and_passes_on_the_rest(monkeypatch):
    """Snapshots under the sink: the parameters (a generator) are recorded in C++; a list holding a
    non-contiguous tensor goes the Python way. Both give the records (every column, the tables in order)
    of a recording without the sink."""
    import torch.nn.functional as F

    from nnrand import models, routing

    _sink_or_skip()

    def run():
        model, x, y = _small_cuda_net()
        extra = [("cols", torch.arange(12.0, device="cuda").reshape(3, 4).t()),
                 ("half", torch.linspace(-1, 1, 5, device="cuda").half())]
        # more records in one step than a chunk of the sink's slot rows holds (4096): read back across chunks
        many = [(f"t{i}", torch.full((i % 7 + 1,), i * 0.5 - 900.0, device="cuda")) for i in range(4200)]
        with routing.use_kernels("tree"), trace.record(None, ops="routed", model=model) as rec:
            for step in range(4):
                rec.step()
                F.cross_entropy(model(x), y).backward()
                rec.snapshot(model.named_parameters())
                rec.snapshot(extra, op="extra")
                if step == 2:
                    rec.snapshot(many, op="many")
        return rec.arrays(), rec.sink_stats

    on, stats = run()
    params = len(list(models.small(4).parameters()))
    assert stats["rows"] >= 4 * params + 4200, stats   # every parameter snapshot and the long list: the sink's
    ops = json.loads(bytes(on["header"]).decode())["ops"]
    many = on["fp"][on["op"] == ops.index("many")]
    assert len(many) == 4200 and len(np.unique(many)) > 4000   # read back across chunks, not one row repeated
    monkeypatch.setattr(routing, "sink", lambda: None)
    off, none = run()
    assert none == {}
    for k in on:
        assert np.array_equal(on[k], off[k]), k


def test_the_trace_sink_follows_phases_pauses_and_a_second_observer(monkeypatch):
    """Under the sink: forward ops inside ``rec.phase("other")``, a ``step`` inside a phase, paused passes,
    and a second ``routing.observe`` observer added late (with a pause inside it) give the records of the
    recording without the sink, and the second observer sees the same calls in both (the sink, off for good
    once it came, does not take them back after the pause)."""
    import torch.nn.functional as F

    from nnrand import routing

    _sink_or_skip()

    def run():
        model, x, y = _small_cuda_net()
        seen: list = []
        with routing.use_kernels("tree"), trace.record(None, ops="routed", model=model) as rec:
            for step in range(5):
                rec.step()
                F.cross_entropy(model(x), y).backward()
                with rec.phase("other"):
                    model(x)
                    if step == 3:
                        rec.step()   # its forward ops are the step's "forward" ones
                        model(x)
                with rec.paused():
                    F.cross_entropy(model(x), y).backward()
            with routing.observe(lambda op, out, args: seen.append(op)):
                with rec.paused():
                    F.cross_entropy(model(x), y).backward()
                rec.step()
                F.cross_entropy(model(x), y).backward()
        return rec.arrays(), rec.sink_stats, seen

    on, stats, seen_on = run()
    assert stats["recorded"] > 0 and stats["declined"] > 0, stats   # the sink took calls, then passed them on
    ops = json.loads(bytes(on["header"]).decode())["ops"]
    bn = on["op"] == ops.index("cudnn_batch_norm")
    assert (on["phase"][bn] == trace._PHASE["other"]).sum() > 0 and (on["phase"][bn] == 0).sum() > 0
    monkeypatch.setattr(routing, "sink", lambda: None)
    off, none, seen_off = run()
    assert none == {} and seen_on == seen_off and seen_on.count("convolution_backward") > 0
    for k in on:
        assert np.array_equal(on[k], off[k]), k
