"""The C++ replay layer (nnrand/replay.py, replay.cpp).

On the CPU: the layer over a Python kernel of a test op (its work aten ops only): replayed calls equal the
Python kernel's bit for bit, the signature decides the plan (shapes, address alignment, scalar arguments),
recordings that could differ from the call are refused (a value read back to Python, a CPU tensor the call
did not make), the counts reach the caller, and closing the layer gives the op back to Python. The
recorder's mapping of kernel arguments to tensors is checked without a GPU. These tests build the
extension (about 40 s on two cores, once per torch version); without a C++ toolchain they skip.

On the GPU: training steps routed ``tree`` with the layer equal the same steps with every routed call in
Python (``NNRAND_REPLAY=0``), bit for bit, in both layouts, with the same coverage, and the layer replays
every routed op kind it takes.
"""
from __future__ import annotations

import collections
import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import runtime
from nnrand import replay

_NAMES = itertools.count()


@pytest.fixture(scope="module")
def module():
    m = replay.load(quiet=True)
    if m is None:
        pytest.skip(f"the replay extension does not build here: {replay.failure()}")
    return m


class _TestOp:
    """A fresh op ``nnrand_replay_test<N>::<name>(Tensor x, Tensor w, float a, int[] shape) -> (Tensor, Tensor)``
    whose CPU kernel is ``handler`` in Python, called through the replay protocol, with the layer over it."""

    def __init__(self, module, handler):
        self.ns = f"nnrand_replay_test{next(_NAMES)}"
        self.lib = torch.library.Library(self.ns, "DEF")
        self.lib.define("op(Tensor x, Tensor w, float a, int[] shape) -> (Tensor, Tensor)")
        self.handler = handler
        self.python_calls = 0
        self.counts: collections.Counter = collections.Counter()
        self.taps = None
        self.lib.impl("op", self._kernel, "CPU", with_keyset=True)
        self.layer = replay.Layer(module, ["op"], lambda op, where, reason, n: self.counts.update({where: n}),
                                  namespace=self.ns, key="CPU")

    def _count(self, where: str) -> None:
        if self.taps is not None:
            self.taps.append(("op", where, None))
        self.counts[where] += 1

    def _kernel(self, keyset, *args):
        self.python_calls += 1
        if self.layer.pending("op"):
            self.taps = taps = []
            try:
                return self.layer.record("op", lambda: self.handler(self, *args), args, {}, taps)
            finally:
                self.taps = None
        return self.handler(self, *args)

    def __call__(self, *args):
        return getattr(torch.ops, self.ns).op(*args)

    def close(self):
        self.layer.close()
        self.lib._destroy()


def _plain(op, x, w, a, shape):
    """aten ops only: an out= call, an elementwise op with a Python scalar, a permute and a copy, a view."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x, w, out=y)
    z = (y * a).permute(1, 0).contiguous().view(shape)
    op._count("replayable")
    return z, y


def _inputs(seed: int, rows: int = 4, cols: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)


def _same(a, b) -> bool:
    return all(torch.equal(p, q) and p.stride() == q.stride() for p, q in zip(a, b))


def test_replayed_calls_equal_the_python_kernel_and_are_counted(module):
    op = _TestOp(module, _plain)
    try:
        x, w = _inputs(0)
        want = _plain(op, x, w, 0.5, [3, 8])
        op.counts.clear()
        got = [op(x, w, 0.5, [3, 8]) for _ in range(10)]
        assert all(_same(g, want) for g in got)
        # the first call plans in Python, the second is recorded there, the other eight are replayed
        assert op.python_calls == 2
        s = op.layer.stats()["op"]
        assert (s["plans"], s["replayed"], s["python"], s["recorded"], s["refused"]) == (1, 8, 2, 1, 0)
        op.layer.drain()
        assert op.counts == {"replayable": 10}
        # new values in the same tensors (the signature holds the addresses' low bits): the plan computes on
        # them, not on the recorded ones
        x2, w2 = _inputs(1)
        x.copy_(x2)
        w.copy_(w2)
        assert _same(op(x, w, 0.5, [3, 8]), _plain(op, x2, w2, 0.5, [3, 8]))
        assert op.python_calls == 2
    finally:
        op.close()


def test_the_signature_decides_the_plan(module):
    op = _TestOp(module, _plain)
    try:
        x, w = _inputs(2, 4, 6)
        calls = [(x, w, 0.5, [3, 8]),                    # the base
                 (x, w, 0.25, [3, 8]),                   # another scalar
                 (x, w, 0.5, [8, 3]),                    # another list
                 (*_inputs(3, 2, 12), 0.5, [3, 8]),      # another shape
                 (x.t().contiguous().t(), w, 0.5, [3, 8])]   # other strides
        base = torch.randn(4 * 6 + 1, generator=torch.Generator().manual_seed(4))
        calls.append((base[1:].view(4, 6), w, 0.5, [3, 8]))   # 4 bytes past an aligned address
        for args in calls:
            for _ in range(3):
                assert _same(op(*args), _plain(op, *args))
        s = op.layer.stats()["op"]
        assert (s["signatures"], s["plans"], s["replayed"]) == (len(calls), len(calls), len(calls))
    finally:
        op.close()


def _reads_back(op, x, w, a, shape):
    """A decision on tensor data in Python: its replay would keep the recorded branch."""
    y = x * w
    if float(y.sum()) > 0:
        y = y * a
    op._count("reads")
    return y.reshape(shape), y


def _splits(op, x, w, a, shape):
    """An op returning a list of tensors (the layer keeps registers of tensors and tuples only)."""
    top, bottom = x.split(2)
    op._count("splits")
    return torch.cat([bottom, top]).reshape(shape), x * w


@pytest.mark.parametrize("handler, why", [(_reads_back, "returned a float"), (_splits, "list of tensors")])
def test_recordings_that_could_differ_are_refused(module, handler, why):
    op = _TestOp(module, handler)
    try:
        x, w = _inputs(5)
        for sign in (1.0, -1.0, 1.0, -1.0, 1.0, -1.0):
            assert _same(op(x * sign, w, 0.5, [3, 8]), handler(op, x * sign, w, 0.5, [3, 8]))
        s = op.layer.stats()["op"]
        assert s["plans"] == 0 and s["replayed"] == 0 and s["refused"] >= 1
        assert op.python_calls == 6
        assert any(why in reason for reason in s["refusals"])
    finally:
        op.close()


_HELD = runtime.keep_persistent(torch.zeros(4, 6))
_LOOSE = torch.zeros(4, 6)


def _holds(op, x, w, a, shape):
    """A persistent runtime buffer the handler holds from before the call (as a stream's ticket counters):
    a constant of the plan, the same tensor at every replay."""
    op._count("held")
    return (x + _HELD).reshape(shape), x * w


def _holds_loose(op, x, w, a, shape):
    """A tensor the handler holds that the runtime does not keep: it could be another one next call."""
    op._count("loose")
    return (x + _LOOSE).reshape(shape), x * w


def test_a_persistent_buffer_is_the_same_tensor_at_every_replay(module):
    op = _TestOp(module, _holds)
    try:
        x, w = _inputs(7)
        for value in (0.0, 1.0, 2.0, 3.0, 4.0):
            _HELD.fill_(value)
            assert _same(op(x, w, 0.5, [3, 8]), _holds(op, x, w, 0.5, [3, 8]))
        assert op.layer.stats()["op"]["replayed"] == 3
    finally:
        op.close()


def test_a_held_tensor_that_is_not_persistent_refuses_the_recording(module):
    op = _TestOp(module, _holds_loose)
    try:
        x, w = _inputs(8)
        for _ in range(6):
            assert _same(op(x, w, 0.5, [3, 8]), _holds_loose(op, x, w, 0.5, [3, 8]))
        s = op.layer.stats()["op"]
        assert s["plans"] == 0 and op.python_calls == 6
        assert any("no persistent runtime buffer" in why for why in s["refusals"])
    finally:
        op.close()


def _difference(op, x, w, a, shape):
    op._count("difference")
    return ((x - w) * a).reshape(shape), x * w


def test_arguments_sharing_memory_are_part_of_the_signature(module):
    """A plan recorded with one tensor in both places must not serve a call with two tensors (its
    registers would read the same one twice), nor the other way round."""
    op = _TestOp(module, _difference)
    try:
        t, _ = _inputs(9)
        x, w = _inputs(10)
        base = torch.randn(48, generator=torch.Generator().manual_seed(11))
        # one tensor twice; two tensors; two disjoint views of one storage; two overlapping ones
        calls = [(t, t), (x, w), (t, t), (x, w), (base[:24].view(4, 6), base[24:].view(4, 6)),
                 (base[:24].view(4, 6), base[4:28].view(4, 6))]
        for args in calls * 3:
            assert _same(op(*args, 0.5, [3, 8]), _difference(op, *args, 0.5, [3, 8]))
        s = op.layer.stats()["op"]
        assert s["signatures"] == 4 and s["plans"] == 4
    finally:
        op.close()


def _fails_second_call(op, x, w, a, shape):
    """Raises in the op's second Python call: the signature's recorded one."""
    if op.python_calls == 2:
        raise ValueError("second call")
    op._count("fails")
    return (x * a).reshape(shape), x * w


def test_an_exception_in_a_recorded_call_leaves_the_layer_usable(module):
    op = _TestOp(module, _fails_second_call)
    try:
        x, w = _inputs(12)
        want = _fails_second_call(op, x, w, 0.5, [3, 8])
        assert _same(op(x, w, 0.5, [3, 8]), want)
        with pytest.raises(ValueError, match="second call"):
            op(x, w, 0.5, [3, 8])
        assert runtime.RECORDER is None and not op.layer.pending("op")
        # the failed call was no attempt: the next one is recorded, the two after it replayed
        for _ in range(3):
            assert _same(op(x, w, 0.5, [3, 8]), want)
        s = op.layer.stats()["op"]
        assert (op.python_calls, s["plans"], s["replayed"]) == (3, 1, 2)
    finally:
        op.close()


def test_close_takes_the_layer_off_even_when_folding_the_counts_fails(module):
    op = _TestOp(module, _plain)
    x, w = _inputs(13)
    for _ in range(3):
        op(x, w, 0.5, [3, 8])

    def broken():
        raise RuntimeError("drain failed")
    op.layer.drain = broken
    with pytest.raises(RuntimeError, match="drain failed"):
        op.layer.close()
    assert not module.enabled()
    op(x, w, 0.5, [3, 8])
    assert op.python_calls == 3
    op.lib._destroy()


def test_a_call_of_the_original_kernel_replays_through_the_captured_kernel(module, monkeypatch):
    """A handler that passes its call on to the kernel registered before it (torch's C++ kernel of an aten
    test op here) and adjusts the result: recorded as a call of that kernel, which the layer captured
    before the override, and replayed through it."""
    import warnings

    from nnrand import routing

    name = "_test_optional_intlist"   # values + addends, elementwise, on int32 (an aten test op, C++ CPU kernel)
    original = routing._Original(torch.library.get_kernel(f"aten::{name}", "CPU"), name)
    python_calls = collections.Counter()
    lib = torch.library.Library("aten", "IMPL")
    box = {}

    def kernel(keyset, values, addends):
        python_calls["n"] += 1
        layer, taps = box["layer"], []

        def handler():
            taps.append((name, "original", None))
            return original.call_boxed(keyset, values, addends) * 2
        return layer.record(name, handler, (values, addends), {}, taps) if layer.pending(name) else handler()

    monkeypatch.setattr(routing, "_REPLAY_MODULE", module)   # _Original tells the C++ layer it is inside
    for captured in (True, False):
        if captured:
            replay.capture(module, [name], namespace="aten", key="CPU")
        layer = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                lib.impl(name, kernel, "CPU", with_keyset=True)
            box["layer"] = layer = replay.Layer(module, [name], lambda *a: None, namespace="aten", key="CPU")
            monkeypatch.setattr(routing, "_REPLAY_ORIGINALS", layer.originals)
            assert layer.originals == (frozenset({name}) if captured else frozenset())
            python_calls.clear()
            values = torch.arange(6, dtype=torch.int32)
            for i in range(6):
                values.add_(i)   # new values in the same tensor: the plan reads them
                want = (values + torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)) * 2
                assert torch.equal(torch.ops.aten._test_optional_intlist(values, [1, 2, 3, 4, 5, 6]), want)
            s = layer.stats()[name]
            if captured:
                assert (python_calls["n"], s["plans"], s["replayed"]) == (2, 1, 4)
                # one step calling the captured kernel (its own aten ops not logged), then the handler's mul
                assert layer.plan_steps == [(f"original {name}", "op aten::mul")]
                assert not module.inside()
            else:   # the original not captured: its work cannot be replayed
                assert python_calls["n"] == 6 and s["plans"] == 0
                assert any("not captured" in why for why in s["refusals"])
        finally:
            if layer is not None:
                layer.close()
            lib._destroy()
            lib = torch.library.Library("aten", "IMPL")
    lib._destroy()


def test_routed_ops_an_original_dispatches_go_to_torch_on_replay_too(module, monkeypatch):
    """torch's kernel of aten::dist dispatches aten::sub itself. With sub routed (a kernel whose result
    differs from torch's unless an original kernel is running), a replayed dist must see sub as the Python
    path does: torch's, because dist's own kernel is running."""
    import warnings

    from nnrand import routing

    dist = routing._Original(torch.library.get_kernel("aten::dist", "CPU"), "dist")
    sub = torch.library.get_kernel("aten::sub.Tensor", "CPU")
    box, lib, layer = {}, torch.library.Library("aten", "IMPL"), None

    def routed_sub(keyset, a, b, alpha=1):
        out = sub.call_boxed(keyset, a, b, alpha=alpha)
        return out if routing._inside_original() else out + 100

    def routed_dist(keyset, a, b, p=2):
        taps = []

        def handler():
            taps.append(("dist", "original", None))
            return dist.call_boxed(keyset, a, b, p)
        return box["layer"].record("dist", handler, (a, b, p), {}, taps) if box["layer"].pending("dist") \
            else handler()

    monkeypatch.setattr(routing, "_REPLAY_MODULE", module)
    replay.capture(module, ["dist"], namespace="aten", key="CPU")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("dist", routed_dist, "CPU", with_keyset=True)
            lib.impl("sub.Tensor", routed_sub, "CPU", with_keyset=True)
        box["layer"] = layer = replay.Layer(module, ["dist"], lambda *a: None, namespace="aten", key="CPU")
        monkeypatch.setattr(routing, "_REPLAY_ORIGINALS", layer.originals)
        a, b = torch.ones(4), torch.zeros(4)
        assert [torch.dist(a, b).item() for _ in range(5)] == [2.0] * 5   # |a - b| = 2, never 200-odd
        assert layer.stats()["dist"]["replayed"] == 3
    finally:
        if layer is not None:
            layer.close()
        lib._destroy()


def test_python_only_and_close_give_the_calls_back_to_python(module):
    op = _TestOp(module, _plain)
    x, w = _inputs(6)
    try:
        for _ in range(3):
            op(x, w, 0.5, [3, 8])
        assert op.python_calls == 2
        op.layer.python_only(True)
        op(x, w, 0.5, [3, 8])
        assert op.python_calls == 3
        op.layer.python_only(False)
        module.enter_original()   # a call made from inside an original kernel
        try:
            op(x, w, 0.5, [3, 8])
        finally:
            module.leave_original()
        assert op.python_calls == 4
        op(x, w, 0.5, [3, 8])
        assert op.python_calls == 4
    finally:
        op.layer.close()
    assert not module.enabled()
    op(x, w, 0.5, [3, 8])
    assert op.python_calls == 5
    op.lib._destroy()


def test_an_observer_sees_every_replayed_call_and_its_errors_reach_the_caller(module):
    """With an observer set, each replayed call hands it (op, outputs, arguments): the outputs the caller
    gets, the argument objects the caller passed. Calls that run in Python are the Python kernel's to
    report (none here). An exception the observer raises reaches the caller as itself; None stops it."""
    op = _TestOp(module, _plain)
    seen = []

    def observer(name, out, args):
        seen.append((name, out, args))
        if args[2] == 0.25:
            raise ValueError("observer refuses 0.25")
    try:
        x, w = _inputs(9)
        for _ in range(2):   # planned, then recorded: both in Python
            op(x, w, 0.5, [3, 8])
        op.layer.observe(observer)
        got = [op(x, w, 0.5, [3, 8]) for _ in range(3)]
        assert op.python_calls == 2 and len(seen) == 3
        for (name, out, args), g in zip(seen, got):
            assert name == "op" and isinstance(out, tuple) and len(out) == 2
            assert all(torch.equal(a, b) and a.data_ptr() == b.data_ptr() for a, b in zip(out, g))
            assert args[0] is x and args[1] is w and args[2] == 0.5 and list(args[3]) == [3, 8]
        for _ in range(2):   # another signature: planned and recorded in Python, unobserved here
            op(x, w, 0.25, [3, 8])
        with pytest.raises(ValueError, match="observer refuses 0.25"):
            op(x, w, 0.25, [3, 8])
        assert len(seen) == 4
        op.layer.observe(None)
        op(x, w, 0.25, [3, 8])
        assert len(seen) == 4 and op.python_calls == 4
    finally:
        op.close()


class _Fn:
    ptr = 0x1234


def test_recorder_maps_kernel_arguments_to_the_call_tensors():
    x = torch.randn(8)
    rec = replay.Recorder(torch.device("cpu"))
    rec.input(0, x)
    with rec:
        y = torch.empty(16)
    rec.launch(_Fn, (2, 1, 1, 128, 1, 1), 0, None, [x.data_ptr(), y.data_ptr(), 7, 0, -3], None, None, "k")
    assert rec.refusal is None
    kind, fn, dims, smem, slots, pointers, name = rec.steps[-1]
    assert (kind, fn, dims, slots, name) == ("launch", 0x1234, (2, 1, 1, 128, 1, 1), [0, 0, 7, 0, -3], "k")
    assert pointers == [(0, rec.reg[id(x)]), (1, rec.reg[id(y)])]
    # an argument at an address's size that no tensor of the call owns: the call cannot be replayed
    stray = replay.ADDRESS + 4096
    assert stray not in rec.by_ptr
    rec.launch(_Fn, (1, 1, 1, 32, 1, 1), 0, None, [stray], None, None, "k2")
    assert "is no tensor the call knows" in rec.refusal
    rec2 = replay.Recorder(torch.device("cpu"))
    rec2.launch(_Fn, (1, 1, 1, 32, 1, 1), 0, None, [1], None, (1, 2), "k3")
    assert "struct" in rec2.refusal


# --------------------------------------------------------------------------------------------------
# GPU


class _Net(nn.Module):
    """Every op kind the layer takes: convs (with and without bias), BatchNorm, max pooling."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _steps(model, fmt, n: int = 5):
    g = torch.Generator(device="cuda").manual_seed(11)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(n):
        x = torch.randn(16, 3, 32, 32, device="cuda", generator=g).contiguous(memory_format=fmt)
        y = torch.randint(0, 10, (16,), device="cuda", generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in itertools.chain(model.parameters(), model.buffers())]


def _replay_against_python(monkeypatch, run, family: str = "tree"):
    """``run()`` under ``use_kernels(family)`` with every routed call in Python (``NNRAND_REPLAY=0``), then
    with the replay layer: (results, coverage, replay statistics) of each, keyed "0" and "1"."""
    import nnrand

    if replay.load(quiet=True) is None:
        pytest.skip(f"the replay extension does not build here: {replay.failure()}")
    out = {}
    for env in ("0", "1"):
        monkeypatch.setenv(replay.ENV, env)
        with nnrand.use_kernels(family) as r:
            got = run()
        out[env] = (got, r.coverage.as_dict(), r.replay)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_replayed_training_equals_python_kernels(layout, cudnn, monkeypatch, cuda_sync):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    base = _Net().cuda().to(memory_format=fmt)
    before = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = cudnn   # cuDNN's BatchNorm backward, or torch's native one
    try:
        out = _replay_against_python(monkeypatch, lambda: _steps(copy.deepcopy(base), fmt))
    finally:
        torch.backends.cudnn.enabled = before
    (runs0, coverage0, stats0), (runs1, coverage1, stats1) = out["0"], out["1"]
    assert all(torch.equal(a, b) for a, b in zip(runs0, runs1, strict=True))
    assert coverage0 == coverage1
    assert stats0 is None
    bn = "cudnn_batch_norm_backward" if cudnn else "native_batch_norm_backward"
    # cuDNN's BatchNorm forward is routed (bn_fwd) on NCHW inputs, and replayed like the backward ops
    # (channels_last inputs keep cuDNN's forward: counted as the original kernel)
    fwd = ("cudnn_batch_norm",) if cudnn and layout != "channels_last" else ()
    if cudnn:
        assert set(coverage1["cudnn_batch_norm"]) == {"tree" if fwd else "original"}, coverage1
    else:
        assert "cudnn_batch_norm" not in coverage1, coverage1
    for op in ("convolution_backward", bn, "max_pool2d_with_indices_backward", *fwd):
        s = stats1[op]
        # 5 steps: per signature, one call plans and one is recorded in Python; the rest replay
        assert s["plans"] == s["signatures"] and s["refused"] == 0, s
        assert s["replayed"] + s["python"] == sum(coverage1[op].values()), s
        assert s["replayed"] >= 3 * s["signatures"], s


@pytest.mark.gpu
def test_gpu_a_call_passed_to_the_original_kernel_replays_through_it(monkeypatch, cuda_sync):
    """A transposed conv's backward goes to torch's kernel, which the layer captured before the routing's
    override: replayed through it, with the bits of the Python path."""
    g = torch.Generator(device="cuda").manual_seed(3)
    conv = nn.ConvTranspose2d(8, 4, 3, stride=2).cuda()
    x = torch.randn(4, 8, 9, 9, device="cuda", generator=g, requires_grad=True)

    def run():
        grads = []
        for _ in range(5):
            x.grad = None
            conv.zero_grad()
            conv(x).square().sum().backward()
            grads += [x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone()]
        return grads
    out = _replay_against_python(monkeypatch, run)
    assert all(torch.equal(a, b) for a, b in zip(out["0"][0], out["1"][0], strict=True))
    assert out["0"][1] == out["1"][1] == {"convolution_backward": {"original": 5}}
    s = out["1"][2]["convolution_backward"]
    assert (s["plans"], s["replayed"], s["python"]) == (1, 3, 2)


@pytest.mark.gpu
def test_gpu_fastest_deterministic_replays_its_tuned_backward(monkeypatch, cuda_sync):
    """Under fastest-deterministic the tuner picks, per conv backward, nnrand's kernel or torch's (replayed
    through the captured kernel); the second session reads the first one's choices from the tuner's cache,
    so both make the same choices and must give the same bits. Its tuned forward convs stay in Python."""
    torch.manual_seed(0)
    base = _Net().cuda().to(memory_format=torch.channels_last)
    out = _replay_against_python(monkeypatch, lambda: _steps(copy.deepcopy(base), torch.channels_last),
                                 "fastest-deterministic")
    assert all(torch.equal(a, b) for a, b in zip(out["0"][0], out["1"][0], strict=True))
    assert out["0"][1] == out["1"][1]
    s = out["1"][2]["convolution_backward"]
    assert s["plans"] == s["signatures"] and s["replayed"] > 0, s
