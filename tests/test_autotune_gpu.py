"""fastest-deterministic on the GPU: the tuner's choices (cuDNN's deterministic algorithms among them)
give bitwise repeatable training, across tuners that share the cache as across processes, a CUDA graph
replays eager's bits, and cuDNN's nondeterministic dW algorithm is shown to vary (the negative control)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import nnrand
from nnrand import autotune, models
from tests.helpers import bitwise_equal

from .test_routing_gpu import _batches, _train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_autotuned_training_is_bitwise_repeatable_and_graph_equals_eager(layout, tmp_path):
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    base = models.build_model("resnet18_imagenet").cuda().to(memory_format=fmt)
    batches = _batches(4, 32, 32, seed=7)
    cache = tmp_path / "autotune.json"
    runs, records = [], []
    for graph in (False, False, True):
        tuner = autotune.Tuner(cache=cache)   # the first times, the others read its choices from the cache
        with nnrand.use_kernels("fastest-deterministic", tuner=tuner) as r:
            runs.append(_train(copy.deepcopy(base), batches, graph=graph, fmt=fmt))
        assert not r.coverage.uncovered
        records.append({k: c["choice"] for k, c in tuner.record()["choices"].items()})
    assert records[0] == records[1] == records[2] and records[0]
    for other in runs[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(runs[0], other))
    routed = r.coverage.as_dict()["convolution_backward"]
    assert sum(routed.values()) == 20 * 3 and "original" not in routed   # graph: 2 warm-up passes + capture


def test_torch_det_choice_repeats_bitwise_and_atomic_varies():
    """A 3x3 conv's dW with torch's kernel pinned (cuDNN's deterministic algorithm), 20 repeats: one
    distinct result. The same call routed to the atomic variant is the negative control: it must vary,
    or 20 repeats of this shape prove nothing."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 64, 28, 28, device="cuda", generator=g)
    w = torch.randn(64, 64, 3, 3, device="cuda", generator=g)
    dy = torch.randn(64, 64, 28, 28, device="cuda", generator=g)

    def dw():
        return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])[1]
    key = autotune.conv_key("conv_wgrad", x, w, (1, 1), (1, 1), (1, 1), 1, "nchw")
    hashes, varied = set(), set()
    with nnrand.use_kernels("fastest-deterministic", tuner=autotune.Tuner(cache=None, pinned={key: "torch_det"})) as r:
        for _ in range(20):
            hashes.add(dw().cpu().numpy().tobytes())
    assert r.coverage["convolution_backward"] == {"torch_det": 20}
    assert len(hashes) == 1
    with nnrand.use_kernels("atomic"):
        for _ in range(20):
            varied.add(dw().cpu().numpy().tobytes())
    assert len(varied) > 1, "the atomic dW gave one result in 20: no negative control on this shape"


class _Forward(autotune.Tuner):
    """Picks ``choice`` (``tree`` or ``winograd``: the forward form on those kernels, or ``torch_det``) for
    every forward conv configuration that offers it, times the rest as usual."""

    def __init__(self, choice: str, pinned: dict | None = None):
        super().__init__(cache=None, pinned=pinned)
        self.forward_choice = choice

    def _time(self, key, device, candidates):
        if key.startswith("conv_fwd ") and self.forward_choice in candidates:
            return {"choice": self.forward_choice, "times_us": {}}
        return super()._time(key, device, candidates)


@pytest.mark.parametrize("forward,amp", [("tree", None), ("tree", torch.bfloat16), ("winograd", None)],
                         ids=["tree-fp32", "tree-bf16", "winograd-fp32"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_routed_forward_form_trains_repeatably_and_graph_equals_eager(layout, forward, amp):
    """Every stride-1 forward conv on the forward form (tree's, or the Winograd one where it applies: the
    routing's override of aten::convolution, bias, layout contract, autocast's bf16): eager twice (and, in
    float32, a CUDA graph) give the same weights and buffers, with forward convs counted as ``forward``.
    Negative control: torch's forward everywhere instead, the backward choices the same, gives other bits,
    so the forward form really ran."""
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    base = models.build_model("resnet18_imagenet").cuda().to(memory_format=fmt)
    batches = _batches(3, 16, 32, seed=11)
    cast = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else contextlib.nullcontext
    runs = []
    tuner = _Forward(forward)   # one tuner: the backward choices it times are made once, for every run
    for graph in ((False, False, True) if amp is None else (False, False)):   # GraphStep captures float32
        with nnrand.use_kernels("fastest-deterministic", tuner=tuner) as r, cast():
            runs.append(_train(copy.deepcopy(base), batches, graph=graph, fmt=fmt))
        assert r.coverage.as_dict()["convolution"].get(forward, 0) > 0, r.coverage
    for other in runs[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(runs[0], other))
    backward = {k: c["choice"] for k, c in tuner.record()["choices"].items() if not k.startswith("conv_fwd ")}
    with nnrand.use_kernels("fastest-deterministic", tuner=_Forward(autotune.TORCH_DET, backward)) as r, cast():
        torch_forward = _train(copy.deepcopy(base), batches, fmt=fmt)
    assert forward not in r.coverage.as_dict()["convolution"]
    assert not all(bitwise_equal(a, b) for a, b in zip(runs[0], torch_forward))


def test_queued_timing_counts_the_gpu_and_lengthens_its_sleep_for_a_slow_host(monkeypatch):
    """The tuner's timer queues the calls behind a sleep so that only the GPU's work is timed. A call whose
    host part (a 2 ms busy wait) outlasts the first sleep (2^16 cycles) makes the timer sleep longer until
    the host is done first. Bounds, not speeds: the call's kernel spins 2^18 cycles (under 2 ms at any SM
    clock above 131 MHz), so the queued time per call is below 2 ms, while the unqueued events, recorded
    around calls that each keep the host 2 ms before queueing anything, cannot be below it."""
    import time as _time

    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(autotune, "SLEEP_CYCLES", 1 << 16)   # at most 66 us at 1 GHz or more: far below 6 ms

    def call():
        t0 = _time.perf_counter()
        while _time.perf_counter() - t0 < 2e-3:
            pass
        torch.cuda._sleep(1 << 18)

    call()
    queued = autotune.events_us(call, dev, calls=3, repeats=3, queued=True)
    unqueued = autotune.events_us(call, dev, calls=3, repeats=3)
    assert queued < 2000.0 <= unqueued, (queued, unqueued)   # below 2 ms only if the sleep grew past 6 ms


def test_queued_timing_of_a_candidate_that_waits_for_the_gpu_warns_and_times_it_unqueued(monkeypatch):
    """A call that synchronises can never be queued behind a sleep: once the sleep reaches its cap the
    repeats run unqueued, with a warning (and a finite time), instead of sleeping on."""
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(autotune, "SLEEP_CYCLES", 1 << 14)
    monkeypatch.setattr(autotune, "SLEEP_CYCLES_MAX", 1 << 17)

    def call():
        torch.cuda._sleep(1 << 12)
        torch.cuda.synchronize()

    with pytest.warns(RuntimeWarning, match="waits for the GPU"):
        t = autotune.events_us(call, dev, calls=2, repeats=2, queued=True)
    assert 0.0 < t < float("inf")
