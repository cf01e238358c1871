"""bn_bwd: CPU order models against float64 and each other, bad inputs; GPU kernels against their models.

Error bounds (from the op's arithmetic; mean, invstd and weight are inputs, exact in float64):

* dbeta is a float32 sum of the M values dy in an order of depth d (the longest chain of additions a
  value passes through, ``depth`` below), so |dbeta - exact| <= gamma_d * sum |dy| =: E0.
* dgamma sums the terms fl(dy * fl(fl(x - mean) * invstd)): three roundings per term (relative error
  <= gamma_3), then the same depth d: |dgamma - exact| <= gamma_{d+3} * sum |dy * xhat| =: E1.
* dx = k * ((dy - a) - xhat * b) with a = dbeta / M, b = dgamma / M, k = weight * invstd, each one rounding.
  To first order: |a^ - a| <= E0 / M + u |a^|, |b^ - b| <= E1 / M + u |b^|, and the rest is at most 6
  roundings on each of |dy|, |a|, |xhat * b| (xhat 2, product 1, two subtractions, k 1, last product 1):
  |dx - exact| <= |k| (|a^ - a| + |xhat| |b^ - b| + gamma_6 (|dy| + |a^| + |xhat| |b^|)); one more unit,
  gamma_7, absorbs the second-order products (u times E / M).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from bench.metrics import VarianceTracker, reference_error
from kernels import KernelArgumentError
from kernels.bias_grad import THREADS, nchw_plan, rows_plan
from kernels import bn_bwd
from kernels.bn_bwd import DX_ROWS, partials_per_channel, reference_parts
from kernels.order import strided_reduce
from kernels.runtime import cdiv
from kernels.shapes import bias_grad_shapes
from tests.helpers import U32, assert_bitwise_equal, bitwise_equal, byte_hash, gamma

OP = "bn_bwd"
VARIANTS = kernels.variants(OP)
ATOMIC, TREE = kernels.get(OP, "atomic"), kernels.get(OP, "tree")
SPEC = kernels.spec(OP)
CASES = SPEC.test_cases()


def inputs(case, device="cpu"):
    args, _ = SPEC.make_inputs(case, torch.device(device))
    return args


def layout_of(x):
    if x.dim() == 2:
        return "rows"
    return "nchw" if x.is_contiguous() else "channels_last"


def result_hash(out) -> str:
    return "".join(byte_hash(t) for t in out)


def depth(x, variant) -> int:
    """Longest chain of float32 additions a term passes through (see bn_bwd.cu)."""
    layout = layout_of(x)
    if layout == "nchw":
        n, c, h, w = x.shape
        vec, p, e = nchw_plan(n, c, h * w)
        first = e // (THREADS * vec) + 2 + 10            # slots, lane combine, block tree (5 + 5)
        second = p if variant.name == "atomic" else cdiv(p, THREADS) + 10
    else:
        r = x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[2] * x.shape[3]
        vec, tx, ty, tiles, rb, p = rows_plan(r, x.shape[1])
        log_ty = ty.bit_length() - 1
        first = rb // ty + log_ty                        # rows of the thread, halving tree over TY
        second = p if variant.name == "atomic" else cdiv(p, ty) + log_ty
    return first + second


def bounds(args, variant):
    """Per-element bounds (dx, dgamma, dbeta) in float64, as derived in the module docstring."""
    dy, x, mean, invstd = (t.double() for t in args[:4])
    weight = args[4]
    c = x.shape[1]
    chan = (1, c) if x.dim() == 2 else (1, c, 1, 1)
    dims = (0,) if x.dim() == 2 else (0, 2, 3)
    m = x.numel() // c
    d = depth(x, variant)
    xhat = (x - mean.view(chan)) * invstd.view(chan)
    e0 = gamma(d) * dy.abs().sum(dims)
    e1 = gamma(d + 3) * (dy * xhat).abs().sum(dims)
    _, dgamma, dbeta = reference_parts(args, {})
    a_mag, b_mag = (dbeta.abs() + e0) / m, (dgamma.abs() + e1) / m
    err_a, err_b = e0 / m + U32 * a_mag, e1 / m + U32 * b_mag
    w = torch.ones(c, dtype=torch.float64) if weight is None else weight.double()
    k = (w * invstd).abs().view(chan)
    dx = k * (err_a.view(chan) + xhat.abs() * err_b.view(chan)
              + gamma(7) * (dy.abs() + a_mag.view(chan) + xhat.abs() * b_mag.view(chan)))
    return dx, e1, e0


def assert_parts_within(names, out, refs, bounds_, what=""):
    """Each named output within its elementwise bound of the float64 reference part."""
    for name, got, ref, bound in zip(names, out, refs, bounds_):
        err = (got.detach().cpu().double() - ref).abs()
        bad = (err > bound).nonzero()
        assert bad.numel() == 0, f"{what} {name}: {bad.shape[0]} outside the bound, first at {bad[:5].tolist()}"


def assert_within_bounds(out, args, variant, what=""):
    assert_parts_within(("dx", "dgamma", "dbeta"), out, reference_parts(args, {}), bounds(args, variant), what)


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    args = inputs(case)
    dx, dgamma, dbeta = variant(*args, rng=case.seed)
    x = args[1]
    assert dx.shape == x.shape and dx.dtype == torch.float32
    assert layout_of(dx) == layout_of(x)
    assert dgamma.shape == dbeta.shape == (x.shape[1],)
    assert dgamma.dtype == dbeta.dtype == torch.float32
    assert_within_bounds((dx, dgamma, dbeta), args, variant, case.name)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_exact_on_small_integers(variant, layout):
    """Small integers, mean 0, invstd 1 and M = 128: every sum and every dx operation is exact, so a lost
    or repeated term is an exact mismatch."""
    g = torch.Generator().manual_seed(11)
    shape = (128, 300) if layout == "rows" else (8, 6, 4, 4)
    dy, x = (torch.randint(-8, 9, shape, generator=g).float() for _ in range(2))
    if layout == "channels_last":
        dy, x = (t.contiguous(memory_format=torch.channels_last) for t in (dy, x))
    c = shape[1]
    args = (dy, x, torch.zeros(c), torch.ones(c), None)
    got = variant(*args, rng=0)
    for part, want in zip(got, reference_parts(args, {})):
        assert bitwise_equal(part.double(), want)


@pytest.mark.parametrize("case", [c for c in CASES if c.params["layout"] == "nchw"], ids=lambda c: c.name)
def test_jitted_nchw_model_equals_the_numpy_formulation(case):
    """The models' NCHW path (Numba, terms formed on the fly) against the array formulation of the same
    order (nchw_partials of the stacked terms, then the dx formula), bit for bit: block partials and dx."""
    dy, x, mean, invstd, weight = inputs(case)
    n, c, h, w = x.shape
    d, v = (t.numpy().reshape(n, c, h * w) for t in (dy, x))
    m, istd = mean.numpy().reshape(1, c, 1), invstd.numpy().reshape(1, c, 1)
    xhat = (v - m) * istd
    want = bn_bwd.nchw_partials(np.stack([d, d * xhat]))
    got = bn_bwd.nchw_partials_jit(d, v, mean.numpy(), invstd.numpy())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    sums = want[..., 0] if want.shape[-1] == 1 else strided_reduce(want, THREADS)
    mf = np.float32(n * h * w)
    a, b = (sums[0] / mf).reshape(1, c, 1), (sums[1] / mf).reshape(1, c, 1)
    g = np.ones((1, c, 1), np.float32) if weight is None else weight.numpy().reshape(1, c, 1)
    dx = (g * istd) * ((d - a) - xhat * b)
    got = TREE(dy, x, mean, invstd, weight)
    for part, want_part in zip(got, (dx.reshape(x.shape), sums[1], sums[0])):  # bits, -0.0 and NaNs included
        assert np.array_equal(part.numpy().view(np.uint32), np.ascontiguousarray(want_part).view(np.uint32))


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: c.name)
def test_tree_model_is_bitwise_stable(case):
    args = inputs(case)
    assert len({result_hash(TREE(*args, rng=s)) for s in range(4)}) == 1


def test_atomic_model_varies_where_order_matters():
    """Negative control: 4 channels of 65536 values, 64 partials per channel, large cancellation."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 32, 32, generator=g)
    dy = torch.randn(64, 4, 32, 32, generator=g) * 1e6
    args = (dy, x, torch.zeros(4), torch.ones(4), torch.ones(4))
    assert partials_per_channel(tuple(dy.shape), "nchw") == 64
    assert len({result_hash(ATOMIC(*args, rng=s)) for s in range(6)}) > 1
    assert result_hash(ATOMIC(*args, rng=3)) == result_hash(ATOMIC(*args, rng=3))
    assert len({result_hash(TREE(*args, rng=s)) for s in range(3)}) == 1


def test_dy_is_brought_to_x_layout():
    """dy in NCHW, broadcast (stride 0, as ``sum().backward()`` makes it) or oddly strided gives the bits of
    the same values in x's layout."""
    case = next(c for c in CASES if c.name == "2x7x33x33_channels_last")
    dy, x, mean, invstd, weight = inputs(case)
    others = (dy.contiguous(), dy[:1].expand_as(dy), dy.transpose(2, 3).contiguous().transpose(2, 3))
    for variant in VARIANTS:
        for other in others:
            want = variant(other.contiguous(memory_format=torch.channels_last), x, mean, invstd, weight, rng=0)
            got = variant(other, x, mean, invstd, weight, rng=0)
            for g_, w_ in zip(got, want):
                assert_bitwise_equal(g_, w_, f"{variant.key} dy with strides {other.stride()}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_no_weight_is_weight_one(variant):
    case = next(c for c in CASES if c.name == "5x13x17x3_nchw")
    dy, x, mean, invstd, _ = inputs(case)
    without = variant(dy, x, mean, invstd, None, rng=0)
    ones = variant(dy, x, mean, invstd, torch.ones(13), rng=0)
    assert result_hash(without) == result_hash(ones)


def strided(t):
    """The same values as a non-contiguous view (stride 2)."""
    return torch.stack([t, torch.full_like(t, float("nan"))], 1)[:, 0] if t is not None else None


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_strided_statistics_and_weight(variant):
    case = next(c for c in CASES if c.name == "4x64x8x8_channels_last")
    dy, x, mean, invstd, weight = inputs(case)
    want = variant(dy, x, mean, invstd, weight, rng=0)
    got = variant(dy, x, strided(mean), strided(invstd), strided(weight), rng=0)
    assert strided(mean).stride() == (2,) and result_hash(got) == result_hash(want)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_nan_stays_in_its_channel(variant):
    case = next(c for c in CASES if c.name == "4x64x8x8_nchw")
    dy, x, mean, invstd, weight = inputs(case)
    dy = dy.clone()
    dy[1, 5, 2, 3] = float("nan")
    dx, dgamma, dbeta = variant(dy, x, mean, invstd, weight, rng=0)
    assert bool(dbeta[5].isnan()) and bool(dgamma[5].isnan()) and bool(dx[:, 5].isnan().all())
    others = torch.ones(64, dtype=torch.bool)
    others[5] = False
    assert bool(dbeta[others].isfinite().all()) and bool(dx[:, others].isfinite().all())


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("shape", [(0, 4, 3, 3), (2, 4, 0, 3), (0, 7)])
def test_empty_input_gives_zero_sums(variant, shape):
    c = shape[1]
    dx, dgamma, dbeta = variant(torch.empty(shape), torch.empty(shape), torch.zeros(c), torch.ones(c), None)
    assert dx.shape == shape and bitwise_equal(dgamma, torch.zeros(c)) and bitwise_equal(dbeta, torch.zeros(c))


def _good(shape=(2, 3, 4, 4)):
    c = shape[1]
    g = torch.Generator().manual_seed(9)
    return dict(dy=torch.randn(shape, generator=g), x=torch.randn(shape, generator=g), mean=torch.zeros(c),
                invstd=torch.ones(c), weight=torch.ones(c))


BAD = [
    ("x", dict(x=torch.zeros(2, 3, 4)), "2-D or 4-D"),
    ("x", dict(x=torch.zeros(2, 3, 4, 4, dtype=torch.float64)), "float32"),
    ("x", dict(x=torch.zeros(2, 3, 4, 4).transpose(2, 3)), "contiguous NCHW or channels_last"),
    ("x", dict(x=torch.zeros(6, 3).t(), dy=torch.zeros(3, 6), mean=torch.zeros(6), invstd=torch.ones(6),
               weight=None), "contiguous \\(N, C\\)"),
    ("x", dict(x=torch.zeros(2, 0, 3, 3), dy=torch.zeros(2, 0, 3, 3), mean=torch.zeros(0), invstd=torch.ones(0),
               weight=None), "at least one channel"),
    ("x", dict(x="x"), "torch.Tensor"),
    ("dy", dict(dy=torch.zeros(2, 3, 4, 4, dtype=torch.float64)), "float32"),
    ("dy", dict(dy=torch.zeros(2, 3, 4, 5)), "x's shape \\(2, 3, 4, 4\\)"),
    ("dy", dict(dy=torch.zeros(2, 3, 16)), "4-D"),
    ("mean", dict(mean=torch.zeros(4)), "shape \\(3,\\)"),
    ("mean", dict(mean=torch.zeros(3, dtype=torch.float64)), "float32"),
    ("mean", dict(mean=torch.zeros(1, 3)), "1-D"),
    ("invstd", dict(invstd=torch.ones(2)), "shape \\(3,\\)"),
    ("invstd", dict(invstd=None), "torch.Tensor"),
    ("weight", dict(weight=torch.ones(5)), "shape \\(3,\\)"),
    ("weight", dict(weight=torch.ones(3, dtype=torch.int32)), "float32"),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("arg,change,match", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_input_raises(variant, arg, change, match):
    kw = {**_good(), **change}
    with pytest.raises(KernelArgumentError, match=f"^bn_bwd: argument '{arg}': .*{match}"):
        variant(kw["dy"], kw["x"], kw["mean"], kw["invstd"], kw["weight"])


def test_a_valid_call_after_a_bad_one_is_checked_again():
    """The memoised check is keyed by every argument's dtype, shape and strides: a bad mean after a good
    call with the same dy and x still raises."""
    kw = _good()
    TREE(kw["dy"], kw["x"], kw["mean"], kw["invstd"], kw["weight"])
    with pytest.raises(KernelArgumentError, match="argument 'mean'"):
        TREE(kw["dy"], kw["x"], torch.zeros(4), kw["invstd"], kw["weight"])


def test_tuple_results_in_the_benchmark_metrics():
    """A result of several tensors is one result: a change in any part is another result, and the error
    is the worst part's."""
    case = next(c for c in CASES if c.name == "257x64_rows")
    args = inputs(case)
    out = TREE(*args)
    tracker = VarianceTracker()
    tracker.add(out)
    tracker.add(tuple(t.clone() for t in out))
    assert tracker.summary()["distinct_results"] == 1.0
    bumped = (out[0], out[1], out[2].clone())
    bumped[2][7] = float(np.nextafter(np.float32(bumped[2][7]), np.float32(np.inf)))
    tracker.add(bumped)
    summary = tracker.summary()
    assert summary["distinct_results"] == 2.0 and summary["max_ulp"] == 1.0
    assert isinstance(tracker.first, tuple) and result_hash(tracker.first) == result_hash(out)
    ref = SPEC.reference(args, {})
    parts = [reference_error(o, r) for o, r in zip(out, reference_parts(args, {}))]
    whole = reference_error(out, ref)
    assert whole["err_rel_l2"] == max(p["err_rel_l2"] for p in parts)
    assert whole["err_max_abs"] == max(p["err_max_abs"] for p in parts)
    assert reference_error(out, reference_parts(args, {})) == whole


def test_channels_last_plan_is_the_rows_plan_of_the_shape():
    """The plan takes the shape and layout alone (no device property): the same split on every GPU."""
    from kernels.bn_bwd import _plan

    plan = _plan((128, 64, 32, 32), "channels_last")
    vec, tx, ty, tiles, rb, p = rows_plan(128 * 32 * 32, 64)
    assert plan["red_grid"] == (p, tiles) and plan["dx_grid"] == (cdiv(128 * 32 * 32, ty * DX_ROWS), tiles)


# --------------------------------------------------------------------------------------------------
# GPU


def _gpu_shapes():
    shapes = [s for _, s in bias_grad_shapes() if len(s) == 4]
    return shapes + [(1, 1, 1, 1), (2, 3, 5, 7), (3, 5, 1, 1), (1, 1025, 2, 2), (64, 1, 32, 32), (2, 7, 33, 33),
                     (128, 4, 32, 32)]


def _gpu_cases():
    for shape in _gpu_shapes():
        for layout in ("nchw", "channels_last"):
            yield pytest.param(shape, layout, id=f"{'x'.join(map(str, shape))}_{layout}")
    for shape in ((1023, 3), (2, 1025), (4097, 10), (65536, 64)):
        yield pytest.param(shape, "rows", id=f"{shape[0]}x{shape[1]}_rows")


def _gpu_args(shape, layout, seed=0, scale=1.0, affine=True):
    from kernels.registry import Case

    case = Case(OP, "gpu", {"shape": list(shape), "layout": layout, "scale": scale, "affine": affine}, seed=seed)
    return inputs(case, "cuda")


def _cpu(args):
    return tuple(t.cpu() if t is not None else None for t in args)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", list(_gpu_cases()))
def test_gpu_tree_bitwise_repeatable_and_equal_to_model(shape, layout):
    args = _gpu_args(shape, layout, seed=sum(shape), affine=sum(shape) % 3 != 0)
    first = TREE(*args)
    torch.cuda.synchronize()
    assert layout_of(first[0]) == layout_of(args[1])
    want = result_hash(first)
    for _ in range(50):
        assert result_hash(TREE(*args)) == want, f"tree {shape} {layout}: repeat differs"
    torch.cuda.synchronize()
    model = TREE(*_cpu(args))
    for name, got, exp in zip(("dx", "dgamma", "dbeta"), first, model):
        assert_bitwise_equal(got, exp, f"tree {shape} {layout} {name} vs CPU model")
    assert_within_bounds(first, _cpu(args), TREE, f"tree {shape} {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", list(_gpu_cases()))
def test_gpu_atomic_within_bound_and_measured(shape, layout):
    args = _gpu_args(shape, layout, seed=sum(shape) + 1)
    results = [ATOMIC(*args) for _ in range(50)]
    torch.cuda.synchronize()
    for r in results[:5]:
        assert_within_bounds(r, _cpu(args), ATOMIC, f"atomic {shape} {layout}")
    print(f"bn_bwd/atomic {shape} {layout}: {len({result_hash(r) for r in results})} distinct results in 50 runs, "
          f"{partials_per_channel(shape, layout)} partials per channel")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_atomic_varies_on_contended_input(layout):
    args = _gpu_args((128, 4, 32, 32), layout, seed=3, scale=1e6)  # 128 (NCHW) / 64 (rows) partials per channel
    n = len({result_hash(ATOMIC(*args)) for _ in range(100)})
    torch.cuda.synchronize()
    print(f"bn_bwd/atomic (128,4,32,32) {layout} cancel: {n} distinct results in 100 runs")
    assert n > 1


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows"])
def test_gpu_graph_capture_equals_eager(layout):
    shape = (512, 64) if layout == "rows" else (32, 64, 16, 16)
    args = _gpu_args(shape, layout, seed=5)
    eager = TREE(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream: compile, ticket counters
        TREE(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        captured = TREE(*args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("dx", "dgamma", "dbeta"), captured, eager):
            assert_bitwise_equal(got, want, f"{layout} {name}: graph replay vs eager")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_non_default_stream_and_misaligned_views(variant, layout):
    shape = (16, 32, 12, 12)
    args = _gpu_args(shape, layout, seed=6)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = variant(*args)
    side.synchronize()
    assert_within_bounds(out, _cpu(args), variant, f"{variant.key} side stream")
    if not variant.deterministic:
        return
    assert result_hash(out) == result_hash(variant(*args))
    # the same values at an address that is not 16-byte aligned: the same bits
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    dy, x = args[0], args[1]
    shifted = []
    for t in (dy, x):
        buf = torch.empty(t.numel() + 1, device="cuda")
        view = buf[1:].view(t.permute(0, 2, 3, 1).shape if layout == "channels_last" else t.shape)
        view = view.permute(0, 3, 1, 2) if layout == "channels_last" else view
        view.copy_(t)
        assert view.data_ptr() % 16 and view.is_contiguous(memory_format=fmt)
        shifted.append(view)
    assert result_hash(variant(shifted[0], shifted[1], *args[2:])) == result_hash(out)
    # non-contiguous statistics and weight (copied before the launch): the same bits
    assert result_hash(variant(dy, x, *(strided(t) for t in args[2:]))) == result_hash(out)
    torch.cuda.synchronize()
