"""fastest-deterministic on the GPU: the tuner's choices (cuDNN's deterministic algorithms among them)
give bitwise repeatable training, across tuners that share the cache as across processes, a CUDA graph
replays eager's bits, and cuDNN's nondeterministic dW algorithm is shown to vary (the negative control)."""
from __future__ import annotations

import copy

import pytest
import torch

import nnrand
from nnrand import autotune, models

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
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
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
