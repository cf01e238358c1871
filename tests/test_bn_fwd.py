"""bn_fwd: the CPU order models against float64 within bounds derived from the summation depth, the tree
model bitwise stable and the atomic one varying (negative control), argument checks; on the GPU the tree
kernels' bits equal the model's (output, statistics and running statistics), repeatable, CUDA graphs equal
eager, and the atomic kernels vary on contended input.

Bounds (float64, per channel with M values, shift k, L = the sums' addition depth, gamma(n) = n u / (1 - n u)):
a term x - k is rounded once, (x - k)^2 three times, so with A = sum|x - k| and D = sum (x - k)^2,
|s - s64| <= e_s = gamma(L + 1) A and |t - t64| <= e_t = gamma(L + 3) D. Then a = s / M, mean = k + a:
|mean - mean64| <= (e_s + u (A + e_s)) / M + u (|mean64| + (A + e_s) / M). The product s * a is s^2 / M
within (2 A e_s + e_s^2) / M + gamma(2) (A + e_s)^2 / M, the subtraction and the division by M round once
each: |var - var64| <= E / M + u (var64 + E / M) with E = e_t + the product's bound + u (D + e_t + the
product's magnitude). invstd = (var + eps)^(-1/2) moves by at most 0.75 r relatively, r = dv / (var + eps),
for r <= 1/3 (checked; |(1 + e)^(-1/2) - 1| <= 0.674 |e| there), and the add, the square root and the division
round that perturbed value: gamma(3) (1 + 0.75 r) more. y's four roundings add gamma(4) of the magnitudes on
top of the statistics' errors carried through.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels.bn_bwd import partials_per_channel
from kernels.bn_fwd import reference_parts
from tests.helpers import U32, assert_bitwise_equal, gamma
# the sums are bn_bwd's reduction: its addition depth; its layout and result-hash helpers
from tests.test_bn_bwd import assert_parts_within, depth, layout_of, result_hash

OP = "bn_fwd"
VARIANTS = kernels.variants(OP)
TREE, ATOMIC = kernels.get(OP, "tree"), kernels.get(OP, "atomic")
SPEC = kernels.spec(OP)
CASES = SPEC.test_cases()


def inputs(case, device="cpu"):
    args, _ = SPEC.make_inputs(case, torch.device(device))
    return args


def bounds(x, weight, bias, variant, eps=1e-5):
    """Per-element bounds (y, mean, invstd) in float64, as derived in the module docstring, and var's."""
    x64 = x.detach().cpu().double()
    c = x.shape[1]
    chan = (1, c) if x.dim() == 2 else (1, c, 1, 1)
    dims = (0,) if x.dim() == 2 else (0, 2, 3)
    m = x.numel() // c
    k = (x64[0] if x.dim() == 2 else x64[0, :, 0, 0]).view(chan)
    dev = x64 - k
    a_sum, d_sum = dev.abs().sum(dims), dev.square().sum(dims)
    depth_ = depth(x, variant)
    e_s, e_t = gamma(depth_ + 1) * a_sum, gamma(depth_ + 3) * d_sum
    var64, mean64 = torch.var_mean(x64, dims, correction=0)
    b_mean = (e_s + U32 * (a_sum + e_s)) / m + U32 * (mean64.abs() + (a_sum + e_s) / m)
    prod_mag = (a_sum + e_s) ** 2 / m
    b_prod = (2 * a_sum * e_s + e_s ** 2) / m + gamma(2) * prod_mag
    big_e = e_t + b_prod + U32 * (d_sum + e_t + prod_mag)
    b_var = big_e / m + U32 * (var64 + big_e / m)
    ve = var64 + eps
    assert (b_var <= ve / 3).all(), "the invstd bound needs dv <= (var + eps) / 3"
    inv64 = 1.0 / torch.sqrt(ve)
    r = b_var / ve
    b_inv = inv64 * (0.75 * r + gamma(3) * (1 + 0.75 * r))
    w = torch.ones(c, dtype=torch.float64) if weight is None else weight.detach().cpu().double()
    b = torch.zeros(c, dtype=torch.float64) if bias is None else bias.detach().cpu().double()
    w, b, bm, bi, i64 = w.view(chan), b.view(chan), b_mean.view(chan), b_inv.view(chan), inv64.view(chan)
    centred = (x64 - mean64.view(chan)).abs()
    b_y = w.abs() * (bm * (i64 + bi) + centred * bi) + gamma(4) * ((centred + bm) * (i64 + bi) * w.abs() + b.abs())
    return b_y, b_mean, b_inv, b_var


def assert_within_bounds(out, x, weight, bias, variant, what=""):
    assert_parts_within(("y", "mean", "invstd"), out, reference_parts((x.cpu(), weight, bias), {}),
                        bounds(x, weight, bias, variant), what)


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    x, weight, bias = inputs(case)
    out = variant(x, weight, bias, rng=np.random.default_rng(case.seed))
    assert out[0].shape == x.shape and layout_of(out[0]) == layout_of(x)
    assert_within_bounds(out, x, weight, bias, variant, f"{variant.key} {case.name}")


def test_shift_keeps_the_variance_of_offset_data():
    """x = 1e4 + N(0, 1): sums of x itself would lose the variance to cancellation (x^2 ~ 1e8, float32's
    spacing there ~ 8); the shifted sums keep it, within the derived bound, which is itself small."""
    g = torch.Generator().manual_seed(11)
    x = 1e4 + torch.randn(32, 4, 16, 16, generator=g)
    y, mean, invstd = TREE(x)
    _, _, b_inv, b_var = bounds(x, None, None, TREE)
    var64 = torch.var(x.double(), (0, 2, 3), correction=0)
    assert (b_var < 1e-3 * var64).all()
    assert_within_bounds((y, mean, invstd), x, None, None, TREE, "offset 1e4")


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: c.name)
def test_tree_model_is_bitwise_stable(case):
    x, weight, bias = inputs(case)
    assert len({result_hash(TREE(x, weight, bias, rng=np.random.default_rng(s))) for s in range(4)}) == 1


def test_atomic_model_varies_where_order_matters():
    """Negative control: 4 channels of 65536 values, 64 block partials per channel, a large spread."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 32, 32, generator=g) * 1e3
    assert partials_per_channel(tuple(x.shape), "nchw") == 64
    outs = {result_hash(ATOMIC(x, rng=np.random.default_rng(s))) for s in range(6)}
    assert len(outs) > 1
    again = [result_hash(ATOMIC(x, rng=np.random.default_rng(3))) for _ in range(2)]
    assert again[0] == again[1]
    assert len({result_hash(TREE(x, rng=np.random.default_rng(s))) for s in range(3)}) == 1


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_no_weight_or_bias_is_weight_one_bias_zero(variant):
    x, weight, bias = inputs(CASES[2])
    c = x.shape[1]
    rng = np.random.default_rng
    for a, b in ((variant(x, rng=rng(0)), variant(x, torch.ones(c), torch.zeros(c), rng=rng(0))),):
        for got, want in zip(a, b):
            assert_bitwise_equal(got, want, f"{variant.key}: None against ones and zeros")


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows"])
def test_running_statistics_follow_torchs_update(layout):
    """running_mean and running_var move as torch's BatchNorm moves them (unbiased variance), in place;
    within the statistics' bounds plus the update's own three roundings; untouched where None."""
    shape = (6, 5) if layout == "rows" else (3, 5, 4, 6)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(shape, generator=g) * 3 + 2
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    rm, rv = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    mom = 0.3
    y, mean, invstd = TREE(x, None, None, rm, rv, mom, 1e-5)
    _, b_mean, _, b_var = bounds(x, None, None, TREE)
    dims = (0,) if x.dim() == 2 else (0, 2, 3)
    var64, mean64 = torch.var_mean(x.double(), dims, correction=0)
    m = x.numel() // 5
    want_rm = mom * mean64 + (1 - mom) * rm0.double()
    unbiased = var64 * m / (m - 1)
    want_rv = mom * unbiased + (1 - mom) * rv0.double()
    b_rm = mom * b_mean + gamma(4) * (mom * (mean64.abs() + b_mean) + (1 - mom) * rm0.double().abs())
    b_unb = b_var * m / (m - 1) + gamma(3) * (unbiased + b_var * m / (m - 1))
    b_rv = mom * b_unb + gamma(4) * (mom * (unbiased + b_unb) + (1 - mom) * rv0.double().abs())
    assert ((rm.double() - want_rm).abs() <= b_rm).all() and ((rv.double() - want_rv).abs() <= b_rv).all()
    again = TREE(x)   # without running statistics: the same output and statistics
    for got, want in zip(again, (y, mean, invstd)):
        assert_bitwise_equal(got, want, f"{layout}: with and without running statistics")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_nan_stays_in_its_channel(variant):
    x, weight, bias = inputs(CASES[4])
    x = x.clone()
    x[0, 1, 0, 0] = float("nan")
    y, mean, invstd = variant(x, weight, bias, rng=np.random.default_rng(0))
    assert torch.isnan(mean[1]) and torch.isnan(y[:, 1]).all()
    others = [c for c in range(x.shape[1]) if c != 1]
    assert not torch.isnan(y[:, others]).any() and not torch.isnan(mean[others]).any()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_empty_batch_has_no_statistics_and_leaves_running_ones(variant):
    x = torch.empty(0, 4, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    y, mean, invstd = variant(x, None, None, rm, rv)
    assert y.shape == x.shape and torch.isnan(mean).all() and torch.isnan(invstd).all()
    assert torch.equal(rm, torch.zeros(4)) and torch.equal(rv, torch.ones(4))


def _good():
    g = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(2, 3, 4, 4, generator=g), weight=torch.ones(3), bias=torch.zeros(3),
                running_mean=torch.zeros(3), running_var=torch.ones(3), momentum=0.1, eps=1e-5)


BAD = [
    ("x", lambda a: a["x"].double(), "float32"),
    ("x", lambda a: a["x"][0], "2-D or 4-D"),
    ("x", lambda a: a["x"][:, :0], "at least one channel"),
    ("weight", lambda a: torch.ones(4), r"shape \(3,\)"),
    ("bias", lambda a: torch.ones(3, 1), "1-D tensor"),
    ("running_mean", lambda a: torch.zeros(6)[::2], "contiguous"),
    ("running_var", lambda a: torch.ones(2), r"shape \(3,\)"),
    ("momentum", lambda a: float("nan"), "finite"),
    ("momentum", lambda a: None, "finite number"),
    ("eps", lambda a: -1.0, "eps >= 0"),
    ("eps", lambda a: True, "finite number"),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("arg,change,match", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_input_raises(variant, arg, change, match):
    args = _good()
    args[arg] = change(args)
    with pytest.raises(KernelArgumentError, match=match) as info:
        variant(**args)
    assert info.value.arg == arg


def test_one_value_per_channel_refuses_the_running_variance():
    x = torch.randn(1, 3, 1, 1)
    with pytest.raises(KernelArgumentError, match="2 values per channel") as info:
        TREE(x, None, None, None, torch.ones(3))
    assert info.value.arg == "x"
    y, mean, invstd = TREE(x)   # without running statistics: var 0, y = +0.0
    assert torch.equal(mean, x.view(3)) and (y == 0).all()


# --------------------------------------------------------------------------------------------------
# CUDA kernels


def _gpu_cases():
    for shape in ((128, 64, 56, 56), (128, 512, 7, 7), (2, 3, 5, 7), (3, 5, 1, 1), (1, 1025, 2, 2),
                  (64, 1, 32, 32), (2, 7, 33, 33), (128, 4, 32, 32)):
        for layout in ("nchw", "channels_last"):
            yield pytest.param(shape, layout, id=f"{'x'.join(map(str, shape))}_{layout}")
    for shape in ((1023, 3), (2, 1025), (4097, 10), (65536, 64)):
        yield pytest.param(shape, "rows", id=f"{shape[0]}x{shape[1]}_rows")


def _gpu_args(shape, layout, seed=0, affine=True, scale=2.0):
    from kernels.registry import Case

    case = Case(OP, "gpu", {"shape": list(shape), "layout": layout, "affine": affine, "scale": scale}, seed=seed)
    return inputs(case, "cuda")


def _cpu(args):
    return tuple(t.cpu() if t is not None else None for t in args)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", list(_gpu_cases()))
def test_gpu_tree_bitwise_repeatable_and_equal_to_model(shape, layout):
    x, weight, bias = _gpu_args(shape, layout, seed=sum(shape), affine=sum(shape) % 3 != 0)
    c = shape[1]
    g = torch.Generator().manual_seed(sum(shape))
    rm0, rv0 = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
    rm, rv = rm0.cuda(), rv0.cuda()
    first = TREE(x, weight, bias, rm, rv, 0.1, 1e-5)
    torch.cuda.synchronize()
    assert layout_of(first[0]) == layout_of(x)
    want = result_hash(first)
    for _ in range(20):
        assert result_hash(TREE(x, weight, bias)) == want, f"tree {shape} {layout}: repeat differs"
    rmc, rvc = rm0.clone(), rv0.clone()
    model = TREE(*_cpu((x, weight, bias)), rmc, rvc, 0.1, 1e-5)
    for name, got, exp in zip(("y", "mean", "invstd", "running_mean", "running_var"), (*first, rm, rv),
                              (*model, rmc, rvc)):
        assert_bitwise_equal(got, exp, f"tree {shape} {layout} {name} vs CPU model")
    assert_within_bounds(first, x, *_cpu((weight, bias)), TREE, f"tree {shape} {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_atomic_varies_on_contended_input(layout):
    x, _, _ = _gpu_args((128, 4, 32, 32), layout, seed=3, scale=1e3)   # 128 (NCHW) / 64 (rows) partials a channel
    outs = [ATOMIC(x) for _ in range(100)]
    n = len({result_hash(o) for o in outs})
    torch.cuda.synchronize()
    print(f"bn_fwd/atomic (128,4,32,32) {layout}: {n} distinct results in 100 runs")
    assert n > 1
    for o in outs[:3]:
        assert_within_bounds(o, x, None, None, ATOMIC, f"atomic {layout}")
    assert len({result_hash(TREE(x)) for _ in range(20)}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows"])
def test_gpu_graph_capture_equals_eager(layout):
    shape = (512, 64) if layout == "rows" else (32, 64, 16, 16)
    x, weight, bias = _gpu_args(shape, layout, seed=5)
    eager = TREE(x, weight, bias)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up on the capture stream: compile, ticket counters
        TREE(x, weight, bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = TREE(x, weight, bias)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("y", "mean", "invstd"), captured, eager):
            assert_bitwise_equal(got, want, f"{layout} {name}: graph replay vs eager")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_misaligned_view_gives_the_same_bits(layout):
    shape = (16, 32, 12, 12)
    x, weight, bias = _gpu_args(shape, layout, seed=6)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    flat = torch.empty(x.numel() + 1, device="cuda")
    shifted = flat[1:].view(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2) \
        if layout == "channels_last" else flat[1:].view(shape)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0 and shifted.is_contiguous(memory_format=fmt)
    assert result_hash(TREE(shifted, weight, bias)) == result_hash(TREE(x, weight, bias))
