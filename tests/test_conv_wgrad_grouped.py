"""conv_wgrad_grouped: CPU order models against float64 and against the documented order, hostile inputs,
argument checks; on a GPU the kernels against their models bit for bit, determinism and the atomic
negative control.

Error bound. A dw element is a float32 evaluation of s = sum_k t_k over the K = N*OH*OW terms whose x
position is inside the input, t_k = dy_k * x_k. Each term is rounded once as a product, then passes
through at most J = ceil(chunk / P) additions in its position lane, log2(32 / CT) in the warp's tree, 3 in
the tree over the 8 warps, then the combine of the S block partials: at most S - 1 additions in arrival
order (atomic) or ceil(S / 32) + 5 (tree). So depth = 1 + J + log2(Q) + 3 + combine roundings bound the
path of every term, and Higham's |fl(s) - s| <= gamma(depth) * sum_k |t_k| holds with sum |t_k| the
weight gradient of |x| and |dy| in float64. float atomicAdd also flushes subnormal operands and results
(at most 2^-126 each, S + 1 of them per element). The float64 reference adds gamma_K(2^-53) sum |t_k|.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import conv_wgrad_grouped as cw
from tests.grouped_checks import REPEAT_LAYERS, check_gpu_against_models, check_repeats, gpu_layer_cases
from tests.helpers import assert_bitwise_equal, bitwise_equal, distinct, gamma

OP = "conv_wgrad_grouped"
SPEC = kernels.spec(OP)
ATOMIC = kernels.get(OP, "atomic")
TREE = kernels.get(OP, "tree")
CASES = SPEC.test_cases()
CPU = torch.device("cpu")


def geometry(args, kw) -> cw.Geometry:
    return cw._check(*args, kw["kernel_size"], kw["stride"], kw["padding"], kw["dilation"], kw["groups"])


def error_bound(variant, args, kw) -> torch.Tensor:
    g = geometry(args, kw)
    p = cw.plan(g)
    combine = p.splits if variant.name == "atomic" else (-(-p.splits // 32) + 5 if p.splits > 1 else 0)
    depth = 1 + -(-p.chunk // p.lanes) + (p.q.bit_length() - 1) + 3 + combine
    mag = SPEC.reference(tuple(a.abs() for a in args), kw)
    ref_err = g.k * 2.0**-53 / (1 - g.k * 2.0**-53)
    flush = (p.splits + 1) * 2.0**-126 if variant.name == "atomic" else 0.0
    return (gamma(depth) + ref_err) * mag + flush


def assert_within_bound(got, args, kw, variant, what):
    ref = SPEC.reference(tuple(a.cpu() for a in args), kw)
    err = (got.double().cpu() - ref).abs()
    bound = error_bound(variant, tuple(a.cpu() for a in args), kw)
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} outside the bound, first at {bad.nonzero()[:5].tolist()}"


def integer_inputs(case, device=CPU):
    """Integers in [-3, 3]: every product and partial sum is an integer far below 2^24, so every order
    is exact and a lost, repeated or misplaced term shows as a mismatch."""
    (x, dy), kw = SPEC.make_inputs(case, CPU)
    gen = torch.Generator().manual_seed(case.seed + 1)
    fmt = torch.channels_last if case.params["layout"] == "channels_last" else torch.contiguous_format
    xi = torch.randint(-3, 4, x.shape, generator=gen).float().to(device, memory_format=fmt)
    dyi = torch.randint(-3, 4, dy.shape, generator=gen).float().to(device, memory_format=fmt)
    return (xi, dyi), kw


def meta_geometry(case) -> cw.Geometry:
    """The case's geometry from meta tensors (no data: the model layers are large)."""
    p = case.params
    kh, kw, _, _, _, oh, ow = cw.conv_params(p)
    fmt = torch.channels_last if p["layout"] == "channels_last" else torch.contiguous_format
    x = torch.empty((p["n"], p["cin"], p["h"], p["w"]), device="meta", memory_format=fmt)
    dy = torch.empty((p["n"], p["cout"], oh, ow), device="meta", memory_format=fmt)
    return geometry((x, dy), cw._kwargs(p))


def ids(cases):
    return [c.name for c in cases]


# --------------------------------------------------------------------------------------------------
# CPU: the plan and the models


def test_plan_covers_the_reduction():
    for layer in cw.MODEL_LAYERS + cw.HOSTILE:
        for layout in ("nchw", "channels_last"):
            g = meta_geometry(cw._case(layer, 0, layout))
            p = cw.plan(g)
            assert (p.splits - 1) * p.chunk < g.k <= p.splits * p.chunk, (layer.name, p)
            assert p.splits <= cw.MAX_SPLITS and p.tiles * p.ct >= g.pairs and p.tgroups * p.tk >= g.kh * g.kw
            assert p.ct == 1 or layout == "channels_last"
            assert p.ct * p.tk <= (32 * 25 if p.tk <= 25 else 16 * 49)  # the kernel's shared red[] fits


def test_depthwise_model_layers_split_into_many_blocks():
    """The depthwise layers with a long reduction are split (S > 1), so the atomic/tree difference is real."""
    for layer in cw.MODEL_LAYERS[:3] + cw.MODEL_LAYERS[14:15]:
        p = cw.plan(meta_geometry(cw._case(layer, 0)))
        assert p.splits >= 8 and p.tiles * p.splits * p.tgroups >= 1024, (layer.name, p)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_models_within_bound_of_float64(case):
    args, kw = SPEC.make_inputs(case, CPU)
    for v in (TREE, ATOMIC):
        got = v(*args, **kw, rng=case.seed)
        assert got.shape == geometry(args, kw).w_shape and got.dtype == torch.float32 and got.is_contiguous()
        assert_within_bound(got, args, kw, v, f"{v.key} {case.name}")


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_models_exact_on_small_integers(case):
    args, kw = integer_inputs(case)
    ref = SPEC.reference(args, kw)
    for v in (TREE, ATOMIC):
        assert bitwise_equal(v(*args, **kw, rng=1).double(), ref), f"{v.key} {case.name}"


def documented_order(x, dy, g: cw.Geometry, p: cw.Plan) -> np.ndarray:
    """The kernel's order written out with NumPy float32 arrays (no Numba): position lanes, the warp's
    halving tree, the 8 warp sums, then tree_combine over the splits. Returns dw (pairs, KK)."""
    xs = x.contiguous().numpy()
    dys = dy.contiguous().numpy()
    kk = g.kh * g.kw
    n = np.arange(g.k) // (g.oh * g.ow)
    oh = (np.arange(g.k) % (g.oh * g.ow)) // g.ow
    ow = np.arange(g.k) % g.ow
    dw = np.zeros((g.pairs, kk), np.float32)
    for e in range(g.pairs):
        co = e // g.cin_g
        cx = (co // g.cout_g) * g.cin_g + e % g.cin_g
        for tap in range(kk):
            kh, kwi = divmod(tap, g.kw)
            ih, iw = oh * g.sh - g.ph + kh * g.dh, ow * g.sw - g.pw + kwi * g.dw
            ok = (ih >= 0) & (ih < g.h) & (iw >= 0) & (iw < g.w)
            terms = np.zeros(g.k, np.float32)
            terms[ok] = dys[n[ok], co, oh[ok], ow[ok]] * xs[n[ok], cx, ih[ok], iw[ok]]
            parts = []
            for s in range(p.splits):
                chunk = terms[s * p.chunk:(s + 1) * p.chunk]
                lanes = np.zeros(p.lanes, np.float32)
                for j in range(len(chunk)):
                    lanes[j % p.lanes] = np.float32(lanes[j % p.lanes] + chunk[j])
                v = lanes.reshape(cw.WARPS, p.q)
                while v.shape[1] > 1:
                    half = v.shape[1] // 2
                    v = v[:, :half] + v[:, half:]
                v = v[:, 0]
                parts.append(((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])))
            dw[e, tap] = cw.tree_combine(np.array(parts, np.float32))
    return dw


@pytest.mark.parametrize("name", ["dw3_s2_odd", "groups4_cl", "many_splits", "rect_k_cl", "dilation2"])
def test_tree_model_is_the_documented_order(name):
    case = next(c for c in CASES if c.name == name)
    args, kw = SPEC.make_inputs(case, CPU)
    g = geometry(args, kw)
    want = documented_order(*args, g, cw.plan(g)).reshape(g.w_shape)
    assert_bitwise_equal(TREE(*args, **kw), torch.from_numpy(want), name)


def test_tree_combine_is_the_documented_order():
    rng = np.random.default_rng(3)
    for s in (1, 2, 31, 32, 33, 100):
        parts = (rng.standard_normal((4, s)) * 10.0 ** rng.integers(-4, 5, (4, s))).astype(np.float32)
        got = cw.tree_combine(parts)
        for e in range(4):
            if s == 1:
                assert got[e] == parts[e, 0]
                continue
            lanes = [np.float32(0.0)] * 32
            for i in range(s):
                lanes[i % 32] = np.float32(lanes[i % 32] + parts[e, i])
            while len(lanes) > 1:
                half = len(lanes) // 2
                lanes = [np.float32(lanes[i] + lanes[i + half]) for i in range(half)]
            assert got[e].tobytes() == lanes[0].tobytes(), (s, e)


def test_atomic_model_depends_on_arrival_order_and_tree_does_not():
    """Negative control on the CPU: many_splits combines 40 partials per element; two arrival orders
    differ somewhere, while tree repeats bit for bit."""
    case = next(c for c in CASES if c.name == "many_splits")
    args, kw = SPEC.make_inputs(case, CPU)
    assert cw.plan(geometry(args, kw)).splits == 40
    assert distinct([ATOMIC(*args, **kw, rng=r) for r in range(6)]) > 1
    assert distinct([TREE(*args, **kw, rng=r) for r in range(3)]) == 1


def test_non_contiguous_inputs_give_the_contiguous_bits():
    case = next(c for c in CASES if c.name == "dw3_s1")
    (x, dy), kw = SPEC.make_inputs(case, CPU)
    xs = torch.zeros(x.shape[0], x.shape[1], x.shape[2], 2 * x.shape[3])
    xs[..., ::2] = x
    view = xs[..., ::2]
    assert not view.is_contiguous() and not cw.channels_inner(view)
    assert_bitwise_equal(TREE(view, dy, **kw), TREE(x, dy, **kw), "strided x")


def test_nonfinite_inputs_follow_ieee():
    """Inf and NaN in x and dy (no padding, so every term is a real product): NaN wherever the float64
    reference has NaN, the same infinities elsewhere."""
    layer = cw.GroupedConv("inf", 2, 4, 4, 4, 3, 1, 0, 6, 6)
    args, kw = SPEC.make_inputs(cw._case(layer, 11), CPU)
    x, dy = args
    x[0, 1, 2, 3] = float("inf")
    x[1, 2, 0, 0] = float("nan")
    dy[0, 3, 1, 1] = float("-inf")
    ref = SPEC.reference((x, dy), kw)
    for v in (TREE, ATOMIC):
        got = v(x, dy, **kw, rng=2).double()
        assert bitwise_equal(torch.isnan(got), torch.isnan(ref)), v.key
        fin = ~torch.isnan(ref)
        assert bitwise_equal(torch.isinf(got[fin]), torch.isinf(ref[fin])), v.key
        assert bitwise_equal(got[torch.isinf(ref)], ref[torch.isinf(ref)]), v.key


def test_negative_zeros_sum_to_positive_zero():
    """Every sum starts from +0.0, and +0.0 + -0.0 = +0.0: all -0.0 inputs give +0.0 (the float64
    reference's sign may differ; both are zero)."""
    case = next(c for c in CASES if c.name == "dw5_s2_p2")
    (x, dy), kw = SPEC.make_inputs(case, CPU)
    for v in (TREE, ATOMIC):
        got = v(torch.full_like(x, -0.0), dy.abs(), **kw)
        assert (got.view(torch.int32) == 0).all(), v.key


# --------------------------------------------------------------------------------------------------
# Argument checks


def _good():
    return torch.randn(2, 6, 8, 8), torch.randn(2, 9, 8, 8), {"kernel_size": 3, "padding": 1, "groups": 3}


BAD = {
    "groups not dividing Cin": (lambda x, dy, kw: ((x, dy), {**kw, "groups": 4}), "groups"),
    "groups not dividing Cout": (lambda x, dy, kw: ((x[:, :4], dy), {**kw, "groups": 2}), "groups"),
    "groups 0": (lambda x, dy, kw: ((x, dy), {**kw, "groups": 0}), "groups"),
    "groups bool": (lambda x, dy, kw: ((x, dy), {**kw, "groups": True}), "groups"),
    "groups float": (lambda x, dy, kw: ((x, dy), {**kw, "groups": 3.0}), "groups"),
    "x float64": (lambda x, dy, kw: ((x.double(), dy), kw), "x"),
    "dy 3-D": (lambda x, dy, kw: ((x, dy[0]), kw), "dy"),
    "x not a tensor": (lambda x, dy, kw: ((x.numpy(), dy), kw), "x"),
    "dy batch": (lambda x, dy, kw: ((x, dy[:1]), kw), "dy"),
    "dy for stride 2": (lambda x, dy, kw: ((x, dy), {**kw, "stride": 2}), "dy"),
    "kernel too large": (lambda x, dy, kw: ((x, dy), {**kw, "kernel_size": 11}), "kernel_size"),
    "stride 0": (lambda x, dy, kw: ((x, dy), {**kw, "stride": (1, 0)}), "stride"),
    "padding -1": (lambda x, dy, kw: ((x, dy), {**kw, "padding": -1}), "padding"),
    "dilation 3-tuple": (lambda x, dy, kw: ((x, dy), {**kw, "dilation": (1, 1, 1)}), "dilation"),
    "dy on another device": (lambda x, dy, kw: ((x, dy.to("meta")), kw), "dy"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("variant", [ATOMIC, TREE], ids=lambda v: v.name)
def test_bad_arguments_raise(variant, name):
    make, arg = BAD[name]
    args, kw = make(*_good())
    with pytest.raises(KernelArgumentError) as info:
        variant.cpu(*args, **kw)
    assert info.value.op == OP and info.value.arg == arg, str(info.value)


def test_good_arguments_pass_and_empty_batch():
    x, dy, kw = _good()
    for v in (ATOMIC, TREE):
        assert v(x, dy, **kw).shape == (9, 2, 3, 3)
        z = v(x[:0], dy[:0], **kw)
        assert z.shape == (9, 2, 3, 3) and not z.any()


def test_registry_rows():
    rows = {v.name: v for v in kernels.variants(OP)}
    assert set(rows) == {"atomic", "tree"}
    assert rows["tree"].deterministic and not rows["atomic"].deterministic
    assert all(v.cpu_bitexact and not v.order_independent for v in rows.values())


# --------------------------------------------------------------------------------------------------
# GPU


GPU_CASES = gpu_layer_cases(cw._case, 8, 7000)   # batch 8: real plans with many splits


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=ids(CASES + GPU_CASES))
def test_gpu_tree_equals_its_model_and_atomic_within_bound(case):
    check_gpu_against_models(SPEC, TREE, ATOMIC, case,
                             lambda got, args, kw, what: assert_within_bound(got, args, kw, ATOMIC, what),
                             integer_inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("index", REPEAT_LAYERS)
def test_gpu_tree_deterministic_over_repeats(index, layout):
    check_repeats(SPEC, TREE, cw._case(cw.MODEL_LAYERS[index], 7100 + index, layout))


@pytest.mark.gpu
def test_gpu_atomic_varies_on_a_contended_layer():
    """Negative control: MobileNetV2's first depthwise layer at batch 128 meets 64 block partials per dw
    element in arrival order; over 20 repeats the bits change at least once."""
    case = cw._case(cw.MODEL_LAYERS[0], 7200)
    args, kw = SPEC.make_inputs(case, torch.device("cuda"))
    assert cw.plan(geometry(args, kw)).splits >= 32
    outs = [ATOMIC(*args, **kw) for _ in range(20)]
    torch.cuda.synchronize()
    assert distinct(outs) > 1


@pytest.mark.gpu
def test_gpu_non_contiguous_and_nonfinite():
    case = next(c for c in CASES if c.name == "dw3_s1")
    (x, dy), kw = SPEC.make_inputs(case, torch.device("cuda"))
    xs = torch.zeros(x.shape[0], x.shape[1], x.shape[2], 2 * x.shape[3], device="cuda")
    xs[..., ::2] = x
    assert_bitwise_equal(TREE(xs[..., ::2], dy, **kw), TREE(x, dy, **kw), "strided x")
    x[0, 1, 2, 3] = float("inf")
    x[1, 2, 0, 0] = float("nan")
    dy[0, 3, 1, 1] = -0.0
    assert_bitwise_equal(TREE(x, dy, **kw).cpu(), TREE(x.cpu(), dy.cpu(), **kw), "inf/nan")
    negz = torch.full_like(x, -0.0)
    assert (TREE(negz, dy.abs(), **kw).view(torch.int32) == 0).all()


@pytest.mark.gpu
def test_gpu_bad_groups_raise_before_launch():
    x, dy = torch.randn(2, 6, 8, 8, device="cuda"), torch.randn(2, 9, 8, 8, device="cuda")
    for v in (ATOMIC, TREE):
        with pytest.raises(KernelArgumentError, match="groups"):
            v(x, dy, kernel_size=3, padding=1, groups=4)
