"""conv_dgrad_grouped: CPU order models against float64 and the documented order, hostile inputs, argument
checks; on a GPU the gather against its model bit for bit, determinism and the scatter's negative control.

Error bound. A dx element sums T <= Cout/groups * KH * KW products, each rounded once and then added in
some order from +0.0 (tree: fixed; atomic: arrival): no term passes through more than 1 + T roundings,
so |fl(s) - s| <= gamma(1 + T) * sum |t| (Higham), with sum |t| = the data gradient of |w| and |dy| in
float64. atomicAdd flushes subnormals (at most 2^-126 per operand and result, 2T + 1 of them). The
float64 reference adds gamma_T(2^-53) * sum |t|.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import conv_dgrad_grouped as cd
from kernels import conv_wgrad_grouped as cw
from tests.grouped_checks import REPEAT_LAYERS, check_gpu_against_models, check_repeats, gpu_layer_cases
from tests.helpers import assert_bitwise_equal, bitwise_equal, distinct, gamma

OP = "conv_dgrad_grouped"
SPEC = kernels.spec(OP)
ATOMIC = kernels.get(OP, "atomic")
TREE = kernels.get(OP, "tree")
CASES = SPEC.test_cases()
CPU = torch.device("cpu")


def ids(cases):
    return [c.name for c in cases]


def error_bound(variant, args, kw, terms: int) -> torch.Tensor:
    mag = SPEC.reference(tuple(a.abs().cpu() for a in args), kw)
    flush = (2 * terms + 1) * 2.0**-126 if variant.name == "atomic" else 0.0
    return (gamma(1 + terms) + terms * 2.0**-53 / (1 - terms * 2.0**-53)) * mag + flush


def assert_within_bound(got, args, kw, variant, terms, what):
    ref = SPEC.reference(tuple(a.cpu() for a in args), kw)
    err = (got.double().cpu() - ref).abs()
    bad = err > error_bound(variant, args, kw, terms)
    assert not bad.any(), f"{what}: {int(bad.sum())} outside the bound, first at {bad.nonzero()[:5].tolist()}"


def integer_inputs(case, device=CPU):
    """Integers in [-3, 3]: every order is exact (module docstring of test_conv_wgrad_grouped)."""
    (w, dy), kw = SPEC.make_inputs(case, CPU)
    gen = torch.Generator().manual_seed(case.seed + 1)
    wi = torch.randint(-3, 4, w.shape, generator=gen).float().to(device)
    dyi = torch.randint(-3, 4, dy.shape, generator=gen).float().to(device, memory_format=torch.channels_last
                                                                     if not dy.is_contiguous() else torch.contiguous_format)
    return (wi, dyi), kw


def layout_ok(dx, dy) -> bool:
    return dx.is_contiguous() if dy.is_contiguous() else dx.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_models_within_bound_and_exact_on_integers(case):
    args, kw = SPEC.make_inputs(case, CPU)
    terms = cd.taps_per_element(case.params)
    for v in (TREE, ATOMIC):
        got = v(*args, **kw, rng=case.seed)
        assert got.shape == (args[1].shape[0], case.params["cin"], *kw["input_size"]) and layout_ok(got, args[1])
        assert_within_bound(got, args, kw, v, terms, f"{v.key} {case.name}")
    ai, kwi = integer_inputs(case)
    for v in (TREE, ATOMIC):
        assert bitwise_equal(v(*ai, **kwi, rng=1).double(), SPEC.reference(ai, kwi)), f"{v.key} {case.name}"


def documented_order(w, dy, kw) -> torch.Tensor:
    """tree's order with plain Python float32 scalars: cog ascending, then kh, kw; taps reaching no dy
    position skipped."""
    g = cd._check(w, dy, kw["input_size"], kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
    wn, dyn = w.contiguous().numpy(), dy.contiguous().numpy()
    out = np.zeros(g.dx_shape, np.float32)
    for n, ci, h, x in np.ndindex(*g.dx_shape):
        grp, cig = divmod(ci, g.cin_g)
        acc = np.float32(0.0)
        for cog in range(g.cout_g):
            co = grp * g.cout_g + cog
            for kh in range(g.kh):
                th = h + g.ph - kh * g.dh
                if th < 0 or th % g.sh or th // g.sh >= g.oh:
                    continue
                for kwi in range(g.kw):
                    tw = x + g.pw - kwi * g.dw
                    if tw < 0 or tw % g.sw or tw // g.sw >= g.ow:
                        continue
                    acc = np.float32(acc + np.float32(dyn[n, co, th // g.sh, tw // g.sw] * wn[co, cig, kh, kwi]))
        out[n, ci, h, x] = acc
    return torch.from_numpy(out)


@pytest.mark.parametrize("name", ["dw3_s2_odd", "groups4", "asym_s_p_cl", "dilation2", "multiplier2"])
def test_tree_model_is_the_documented_order(name):
    case = next(c for c in CASES if c.name == name)
    args, kw = SPEC.make_inputs(case, CPU)
    assert_bitwise_equal(TREE(*args, **kw).contiguous(), documented_order(*args, kw), name)


def test_atomic_model_varies_with_arrival_order_where_products_overlap():
    case = next(c for c in CASES if c.name == "dw7_p3")
    args, kw = SPEC.make_inputs(case, CPU)
    assert distinct([ATOMIC(*args, **kw, rng=r) for r in range(5)]) > 1
    assert distinct([TREE(*args, **kw, rng=r) for r in range(3)]) == 1
    # one product per element (1x1 kernel, depthwise): every order is the same sum
    one = next(c for c in CASES if c.name == "spatial1x1")
    args1, kw1 = SPEC.make_inputs(one, CPU)
    assert distinct([ATOMIC(*args1, **kw1, rng=r) for r in range(3)]) == 1


def test_layouts_and_non_contiguous_inputs_give_the_same_bits():
    """The gather's order is per element: NCHW, channels_last and strided views give the same values."""
    case = next(c for c in CASES if c.name == "dw5_s2_p2")
    (w, dy), kw = SPEC.make_inputs(case, CPU)
    base = TREE(w, dy, **kw)
    cl = TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw)
    assert cl.is_contiguous(memory_format=torch.channels_last)
    big = torch.zeros(dy.shape[0], dy.shape[1], dy.shape[2], 3 * dy.shape[3])
    big[..., ::3] = dy
    assert_bitwise_equal(cl.contiguous(), base, "channels_last")
    assert_bitwise_equal(TREE(w, big[..., ::3], **kw).contiguous(), base, "strided dy")
    assert_bitwise_equal(TREE(w.transpose(2, 3).contiguous().transpose(2, 3), dy, **kw), base, "strided w")


def test_nonfinite_and_negative_zero():
    layer = cw.GroupedConv("inf", 2, 4, 8, 4, 3, 2, 1, 7, 7)
    args, kw = SPEC.make_inputs(cd._case(layer, 12), CPU)
    w, dy = args
    dy[0, 1, 1, 2] = float("inf")
    dy[1, 5, 0, 0] = float("nan")
    w[3, 0, 1, 1] = float("-inf")
    ref = SPEC.reference((w, dy), kw)
    for v in (TREE, ATOMIC):
        got = v(w, dy, **kw, rng=4).double()
        assert bitwise_equal(torch.isnan(got), torch.isnan(ref)), v.key
        assert bitwise_equal(got[torch.isinf(ref)], ref[torch.isinf(ref)]), v.key
        assert bitwise_equal(torch.isinf(got), torch.isinf(ref)), v.key
    for v in (TREE, ATOMIC):  # sums start at +0.0: -0.0 products give +0.0
        got = v(torch.full_like(w, -0.0), dy.nan_to_num().abs(), **kw)
        assert (got.view(torch.int32) == 0).all(), v.key


def _good():
    return torch.randn(6, 2, 3, 3), torch.randn(2, 6, 8, 8), {"input_size": (8, 8), "padding": 1, "groups": 3}


BAD = {
    "groups not dividing Cout": (lambda w, dy, kw: ((w, dy), {**kw, "groups": 4}), "groups"),
    "groups 0": (lambda w, dy, kw: ((w, dy), {**kw, "groups": 0}), "groups"),
    "groups bool": (lambda w, dy, kw: ((w, dy), {**kw, "groups": True}), "groups"),
    "w float64": (lambda w, dy, kw: ((w.double(), dy), kw), "w"),
    "dy channels": (lambda w, dy, kw: ((w, dy[:, :5]), kw), "dy"),
    "dy spatial": (lambda w, dy, kw: ((w, dy), {**kw, "input_size": (9, 8)}), "dy"),
    "input too small": (lambda w, dy, kw: ((w, dy), {**kw, "input_size": (1, 1), "padding": 0}), "input_size"),
    "stride 0": (lambda w, dy, kw: ((w, dy), {**kw, "stride": 0}), "stride"),
    "padding -1": (lambda w, dy, kw: ((w, dy), {**kw, "padding": (0, -1)}), "padding"),
    "dy on another device": (lambda w, dy, kw: ((w, dy.to("meta")), kw), "dy"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("variant", [ATOMIC, TREE], ids=lambda v: v.name)
def test_bad_arguments_raise(variant, name):
    make, arg = BAD[name]
    args, kw = make(*_good())
    with pytest.raises(KernelArgumentError) as info:
        variant.cpu(*args, **kw)
    assert info.value.op == OP and info.value.arg == arg, str(info.value)


def test_good_arguments_pass():
    w, dy, kw = _good()
    for v in (ATOMIC, TREE):
        assert v(w, dy, **kw).shape == (2, 6, 8, 8)
        z = v(w, dy[:0], **kw)
        assert z.shape == (0, 6, 8, 8)


# --------------------------------------------------------------------------------------------------
# GPU


GPU_CASES = gpu_layer_cases(cd._case, 4, 8000)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=ids(CASES + GPU_CASES))
def test_gpu_tree_equals_its_model_and_atomic_within_bound(case):
    terms = cd.taps_per_element(case.params)
    check_gpu_against_models(SPEC, TREE, ATOMIC, case,
                             lambda got, args, kw, what: assert_within_bound(got, args, kw, ATOMIC, terms, what),
                             integer_inputs, lambda out, inputs: layout_ok(out, inputs[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("index", REPEAT_LAYERS)
def test_gpu_tree_deterministic_over_repeats(index, layout):
    check_repeats(SPEC, TREE, cd._case(cw.MODEL_LAYERS[index], 8100 + index, layout))


@pytest.mark.gpu
def test_gpu_atomic_varies_on_overlapping_windows():
    """Negative control: ConvNeXt's 7x7 depthwise (49 products per dx element) scattered with atomics;
    over 20 repeats the bits change at least once."""
    args, kw = SPEC.make_inputs(cd._case(cw.MODEL_LAYERS[14], 8200), torch.device("cuda"))
    outs = [ATOMIC(*args, **kw) for _ in range(20)]
    torch.cuda.synchronize()
    assert distinct(outs) > 1


@pytest.mark.gpu
def test_gpu_layouts_strides_and_nonfinite_give_the_model_bits():
    case = next(c for c in CASES if c.name == "dw5_s2_p2")
    (w, dy), kw = SPEC.make_inputs(case, CPU)
    dy[0, 1, 1, 2] = float("inf")
    dy[1, 3, 0, 0] = float("nan")
    dy[0, 2, 2, 2] = -0.0
    want = TREE(w, dy, **kw)
    for what, d in (("nchw", dy), ("channels_last", dy.contiguous(memory_format=torch.channels_last))):
        assert_bitwise_equal(TREE(w.cuda(), d.cuda(), **kw).cpu().contiguous(), want, what)
    big = torch.zeros(dy.shape[0], dy.shape[1], dy.shape[2], 3 * dy.shape[3], device="cuda")
    big[..., ::3] = dy.cuda()
    assert_bitwise_equal(TREE(w.cuda(), big[..., ::3], **kw).cpu(), want, "strided dy")


@pytest.mark.parametrize("op", ["conv_dgrad_grouped", "conv_wgrad_grouped"])
def test_cudnn_default_peer_runs_under_the_benchmarks_flags(op):
    """The peer sets only cuDNN's benchmark/deterministic switches: inside the benchmark's torch mode
    (TF32 off through ``fp32_precision`` where torch has it), ``torch.backends.cudnn.flags`` would set
    the legacy TF32 switch too, and torch refuses the mix. Flags are restored afterwards."""
    from bench.timing import torch_mode

    spec = kernels.spec(op)
    args, kw = spec.make_inputs(spec.test_cases()[0], torch.device("cpu"))
    with torch_mode("fast"):
        out = spec.peers()["cudnn_default"](*args, **kw)
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert bitwise_equal(out, spec.peers()["torch"](*args, **kw))
