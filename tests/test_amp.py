"""Half precision (bfloat16, float16) through the registry, the routing under ``torch.autocast`` and
``python -m nnrand.train --amp``, on the CPU models.

The contract: half inputs are widened to float32 (exactly), the float32 variant runs, and each output is
rounded once to nearest even, to the dtype of the argument it is the gradient of (``OpSpec.out_like``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import nnrand
from nnrand import routing, runio, train
from tests.helpers import assert_bitwise_equal
from tests.test_train import tiny

HALF = [torch.bfloat16, torch.float16]
# unit roundoff (round to nearest) of each half dtype
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _first_case_inputs(op: str):
    spec = kernels.spec(op)
    case = spec.test_cases()[0]
    return spec.make_inputs(case, torch.device("cpu"))


def _halve(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("key", [v.key for v in kernels.variants()])
def test_half_inputs_round_the_float32_result_once(key, dtype):
    op, name = key.split("/")
    v = kernels.get(op, name)
    args, kwargs = _first_case_inputs(op)
    half = _halve(args, dtype)
    wide = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in half)
    out = _as_tuple(v(*half, rng=7, **kwargs))
    ref = _as_tuple(v(*wide, rng=7, **kwargs))   # the same draw of arrival order for atomic models
    assert len(out) == len(ref)
    for k, (o, r) in enumerate(zip(out, ref)):
        if o is None:
            assert r is None
            continue
        assert o.dtype == dtype, f"{key}: output {k} is {o.dtype}, expected {dtype} (every input was half)"
        assert o.shape == r.shape and o.stride() == r.stride()
        # exactly the float32 result rounded once to nearest even (Inf where it overflows the half range)
        assert_bitwise_equal(o, r.to(dtype), f"{key} output {k}")


def test_half_weight_by_keyword_rounds_its_gradients_like_by_position():
    args, _ = _first_case_inputs("bn_bwd")
    dy, x, mean, invstd, weight = (a.bfloat16() if a.dim() > 1 else a for a in args)
    tree = kernels.get("bn_bwd", "tree")
    by_position = tree(dy, x, mean, invstd, weight.bfloat16())
    by_keyword = tree(dy, x, mean, invstd, weight=weight.bfloat16())
    assert [t.dtype for t in by_keyword] == [torch.bfloat16] * 3
    for a, b in zip(by_position, by_keyword):
        assert_bitwise_equal(a, b, "bn_bwd weight by keyword")


def test_non_finite_and_extreme_values_round_as_torch_does():
    """Values past fp16's range, at its subnormals, Inf and NaN: every non-NaN output is torch's rounding
    of the float32 result, and NaN stays NaN (payloads are not part of the contract)."""
    dy = torch.tensor([65520.0, -65519.0, 2.0**-25, 3 * 2.0**-26, float("inf"), float("nan"), 1e-40, 1.0])
    dy = dy.reshape(1, 8, 1, 1)
    bias = kernels.get("bias_grad", "tree")
    for dtype in HALF:
        out = bias(dy.to(dtype))
        ref = bias(dy.to(dtype).float()).to(dtype)
        assert_bitwise_equal(out, ref, f"bias_grad {dtype}")
        assert torch.isnan(out[5]) and torch.isinf(out[4])


def test_batchnorm_gradients_of_float32_parameters_stay_float32():
    """Under autocast BatchNorm's input is half, its weight and statistics float32: dx is half, dgamma and
    dbeta float32 (as cuDNN returns them)."""
    args, kwargs = _first_case_inputs("bn_bwd")
    dy, x, mean, invstd, weight = args
    dx, dgamma, dbeta = kernels.get("bn_bwd", "tree")(dy.bfloat16(), x.bfloat16(), mean, invstd, weight, **kwargs)
    assert (dx.dtype, dgamma.dtype, dbeta.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    ref = kernels.get("bn_bwd", "tree")(dy.bfloat16().float(), x.bfloat16().float(), mean, invstd, weight)
    assert_bitwise_equal(dgamma, ref[1], "dgamma")   # no rounding at all for a float32 output
    assert_bitwise_equal(dbeta, ref[2], "dbeta")


def test_mixed_half_dtypes_are_refused_naming_the_argument():
    args, kwargs = _first_case_inputs("conv_wgrad")
    x, dy = args
    with pytest.raises(kernels.KernelArgumentError, match=r"conv_wgrad: argument '#1'.*float16.*bfloat16"):
        kernels.get("conv_wgrad", "tree")(x.bfloat16(), dy.half(), **kwargs)


def test_float64_is_still_refused():
    args, kwargs = _first_case_inputs("conv_wgrad")
    with pytest.raises(kernels.KernelArgumentError, match="float64"):
        kernels.get("conv_wgrad", "tree")(*(a.double() for a in args), **kwargs)


# --------------------------------------------------------------------------------------------------
# Routing under autocast


class _Net(nn.Module):
    """Every routed op a CNN under autocast meets: conv (+bias), BatchNorm, max-pool, a strided and a
    grouped conv, global pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.conv3(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _grads(dtype, family="tree", fmt=torch.contiguous_format):
    torch.manual_seed(0)
    net = _Net().to(memory_format=fmt)
    x = torch.randn(6, 3, 16, 16).contiguous(memory_format=fmt)
    y = torch.arange(6) % 5
    with nnrand.use_kernels(family) as routed:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
    return [p.grad.clone() for p in net.parameters()], routed.coverage


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_autocast_backward_is_routed_and_repeats_bitwise(dtype, fmt):
    grads, cov = _grads(dtype, fmt=fmt)
    rows = {r["aten_op"]: r for r in cov.rows()}
    for op in ("convolution_backward", "native_batch_norm_backward", "max_pool2d_with_indices_backward"):
        assert op in rows, f"{op} did not reach the routing under autocast"
        assert rows[op]["original"] == 0 and rows[op]["uncovered"] == 0, rows[op]
    assert rows["convolution_backward"]["routed"] == {"tree": 3}
    again, _ = _grads(dtype, fmt=fmt)
    for a, b in zip(grads, again):
        assert_bitwise_equal(a, b, f"{dtype} grads")
    assert all(g.dtype == torch.float32 for g in grads)   # autocast's casts back to the float32 parameters


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_routed_conv_gradients_are_the_variants_on_the_half_tensors(dtype):
    """One conv under autocast: the routed dW is the tree variant on exactly the half tensors autograd
    holds (x cast to half, dy = the half gradient of the output), rounded once; and it agrees with torch's
    own half backward within what two roundings and two float32 sums of K products allow."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 9, 9, generator=g)
    conv = nn.Conv2d(6, 5, 3, stride=2, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    up = torch.randn(4, 5, 5, 5, generator=g)

    def run(family):
        conv.weight.grad = None
        xx = x.clone().requires_grad_(True)
        with nnrand.use_kernels(family):
            with torch.autocast("cpu", dtype=dtype):
                out = conv(xx)
            (out.float() * up).sum().backward()
        return conv.weight.grad.clone(), xx.grad.clone()

    dw, dx = run("tree")
    xh, dyh, wh = x.to(dtype), up.to(dtype), conv.weight.detach().to(dtype)
    geom = dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1))
    want_dw = kernels.get("conv_wgrad", "tree")(xh, dyh, kernel_size=(3, 3), **geom)
    want_dx = kernels.get("conv_dgrad", "tree")(wh, dyh, input_size=(9, 9), **geom)
    assert want_dw.dtype == dtype and want_dx.dtype == dtype
    assert_bitwise_equal(dw, want_dw.float(), "dW")
    assert_bitwise_equal(dx, want_dx.float(), "dX")

    native_dw, _ = run("native")
    # both are float32 sums of the same K = N*OH*OW exact products (gamma_K * sum|terms| each), then
    # rounded once to the half dtype (u_h relative each). This assumes torch's CPU half conv backward
    # accumulates in float32 (its oneDNN/reference paths do for bf16 and fp16); the bound is for that.
    k = 4 * 5 * 5
    mag = torch.nn.grad.conv2d_weight(xh.double().abs(), conv.weight.shape, dyh.double().abs(), stride=2, padding=1)
    gam = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = 2 * gam * mag + 2 * UNIT[dtype] * (mag + 2 * gam * mag)
    assert bool(((dw.double() - native_dw.double()).abs() <= bound).all())


def test_atomic_under_autocast_still_claims_nothing():
    route = routing.resolve("atomic")
    assert not route.claims_determinism
    _, cov = _grads(torch.bfloat16, family="atomic")
    assert {"atomic"} == set(cov["convolution_backward"])


# --------------------------------------------------------------------------------------------------
# Training with --amp


def test_amp_is_validated_before_training(tmp_path):
    with pytest.raises(train.ConfigError, match="--amp must be one of bf16, fp16"):
        train.resolve(train.Config(**tiny(tmp_path, "x", amp="fp8")))
    with pytest.raises(train.ConfigError, match="--amp is not supported with --world-invariant"):
        train.resolve(train.Config(**tiny(tmp_path, "x", amp="bf16", world_invariant=True)))


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_training_repeats_bitwise_and_resumes_identically(tmp_path, amp):
    kw = dict(kernel="tree", amp=amp, epochs=2)
    a = train.main(tiny(tmp_path, "a", **kw))["members"][0]
    b = train.main(tiny(tmp_path, "b", **kw))["members"][0]
    assert a["final_checksum"] == b["final_checksum"] and a["logits_hash"] == b["logits_hash"]
    cov = a["coverage"]
    assert set(cov["convolution_backward"]) == {"tree"}
    assert set(cov["native_batch_norm_backward"]) == {"tree"}
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "r", interrupt_at_step=4, **kw))   # mid-way through epoch 2 (3 steps each)
    r = train.main(tiny(tmp_path, "r", **kw))["members"][0]
    assert r["final_checksum"] == a["final_checksum"] and r["logits_hash"] == a["logits_hash"]
    f32 = train.main(tiny(tmp_path, "f32", kernel="tree", epochs=2))["members"][0]
    assert f32["final_checksum"] != a["final_checksum"]   # the half forward changed the arithmetic


def test_fp16_resume_restores_the_grad_scaler(tmp_path, monkeypatch):
    """A scaler that grows every step (growth_interval=1) ends an uninterrupted run at a scale a resume
    reaches only if the checkpoint carried the scaler's state: a fresh scaler would restart at its initial
    scale and end 2^4 lower after 6 steps."""
    monkeypatch.setattr(train, "grad_scaler", lambda cfg: torch.amp.GradScaler("cpu", init_scale=2.0**8,
                                                                                growth_interval=1))
    kw = dict(kernel="tree", amp="fp16", epochs=2)

    def final_scaler(name):
        return torch.load(tmp_path / name / "member_000" / "checkpoint.pt", weights_only=False)["scaler"]
    train.main(tiny(tmp_path, "whole", **kw))
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "resumed", interrupt_at_step=4, **kw))
    assert final_scaler("resumed")["scale"] > 2.0**8          # grown before the interruption
    train.main(tiny(tmp_path, "resumed", **kw))
    whole, resumed = final_scaler("whole"), final_scaler("resumed")
    assert whole["scale"] > 2.0**8 + 2.0**4                     # it did grow over the run
    assert resumed == whole


def test_amp_run_names():
    assert train.resolve(train.Config(device="cpu", amp="bf16")).name.endswith("_small_bf16")
    assert not train.resolve(train.Config(device="cpu")).name.endswith("bf16")


def test_float32_configs_have_no_amp_key(tmp_path):
    """Runs made before --amp existed resume: a float32 member's config is unchanged."""
    train.main(tiny(tmp_path, "plain", kernel="tree"))
    meta = runio.read_json(tmp_path / "plain" / "member_000" / "config.json")
    assert "amp" not in meta["config"]


def test_scatter_sums_of_mixed_dtypes_go_to_torchs_kernel():
    """index_add of a float32 source into a bf16 tensor is torch's error, routed or not (the routed sum
    would otherwise return float32)."""
    self_ = torch.zeros(4, 3, dtype=torch.bfloat16)
    src, idx = torch.ones(5, 3), torch.tensor([0, 1, 1, 2, 3])
    with pytest.raises(RuntimeError):
        torch.index_add(self_, 0, idx, src)
    with nnrand.use_kernels("tree") as routed:
        with pytest.raises(RuntimeError):
            torch.index_add(self_, 0, idx, src)
        out = torch.index_add(self_, 0, idx, src.bfloat16())   # one dtype: routed, stays bf16
    assert out.dtype == torch.bfloat16
    assert routed.coverage["index_add"].get("original") == 1 and routed.coverage["index_add"].get("sorted") == 1
