"""bias_grad: CPU order models against float64 and each other; GPU kernels against their models."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels.bias_grad import THREADS, nchw_plan, partials_per_channel, rows_plan
from kernels.runtime import cdiv
from kernels.shapes import bias_grad_shapes
from tests.helpers import assert_bitwise_equal, bitwise_equal, byte_hash, distinct, gamma

VARIANTS = kernels.variants("bias_grad")
ATOMIC, TREE = kernels.get("bias_grad", "atomic"), kernels.get("bias_grad", "tree")
SPEC = kernels.spec("bias_grad")
CASES = SPEC.test_cases()


def inputs(case, device="cpu"):
    (dy,), _ = SPEC.make_inputs(case, torch.device(device))
    return dy


def layout_of_case(dy):
    if dy.dim() == 2:
        return "rows"
    return "nchw" if dy.is_contiguous() else "channels_last"


def depth(dy, variant) -> int:
    """Longest chain of float32 additions a value passes through (see bias_grad.cu)."""
    layout = layout_of_case(dy)
    if layout == "nchw":
        n, c, h, w = dy.shape
        vec, p, e = nchw_plan(n, c, h * w)
        first = e // (THREADS * vec) + 2 + 10
        second = p if variant.name == "atomic" else cdiv(p, THREADS) + 10
    else:
        r = dy.shape[0] if dy.dim() == 2 else dy.shape[0] * dy.shape[2] * dy.shape[3]
        vec, tx, ty, tiles, rb, p = rows_plan(r, dy.shape[1])
        log_ty = ty.bit_length() - 1
        first = rb // ty + log_ty
        second = p if variant.name == "atomic" else cdiv(p, ty) + log_ty
    return first + second


def bound(dy, variant) -> torch.Tensor:
    absum = dy.double().abs().sum(0) if dy.dim() == 2 else dy.double().abs().sum((0, 2, 3))
    return gamma(depth(dy, variant)) * absum


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    dy = inputs(case)
    got = variant(dy, rng=case.seed)
    ref = SPEC.reference((dy,), {})
    assert got.shape == (dy.shape[1],) and got.dtype == torch.float32
    err = (got.double() - ref).abs()
    assert bool((err <= bound(dy, variant)).all()), f"worst channel {int(err.argmax())}"


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "rows"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_exact_on_small_integers(variant, layout):
    """Integers sum exactly while partials stay below 2^24: a lost or repeated value is an exact mismatch."""
    g = torch.Generator().manual_seed(5)
    shape = (37, 300) if layout == "rows" else (9, 6, 13, 12)
    dy = torch.randint(-8, 9, shape, generator=g).float()
    if layout == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    want = dy.double().sum(0) if dy.dim() == 2 else dy.double().sum((0, 2, 3))
    assert bitwise_equal(variant(dy, rng=0).double(), want)


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: c.name)
def test_tree_model_is_bitwise_stable(case):
    dy = inputs(case)
    assert len({byte_hash(TREE(dy, rng=s)) for s in range(4)}) == 1


def test_atomic_model_varies_where_order_matters():
    """Negative control: 64 channels of 131072 values, 16 partials per channel, large cancellation."""
    dy = torch.randn(128, 64, 32, 32, generator=torch.Generator().manual_seed(1)) * 1e6
    assert partials_per_channel(tuple(dy.shape), "nchw") > 1
    assert distinct([ATOMIC(dy, rng=s) for s in range(10)]) > 1
    assert distinct([TREE(dy) for _ in range(3)]) == 1


def test_layouts_reduce_the_same_values():
    dy = torch.randn(16, 24, 7, 9, generator=torch.Generator().manual_seed(2))
    cl = dy.contiguous(memory_format=torch.channels_last)
    ref = dy.double().sum((0, 2, 3))
    for variant in VARIANTS:
        for t in (dy, cl):
            assert bool(((variant(t).double() - ref).abs() <= bound(t, variant)).all())


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_nan_inf_propagate_like_torch(variant):
    dy = torch.randn(4, 5, 6, 6)
    dy[1, 0, 2, 2] = float("nan")
    dy[2, 1, 0, 0] = float("inf")
    dy[0, 2, 1, 1], dy[3, 2, 5, 5] = float("inf"), float("-inf")
    dy[2, 3, 3, 3] = float("-inf")
    for t in (dy, dy.contiguous(memory_format=torch.channels_last)):
        got, want = variant(t), t.sum((0, 2, 3))
        assert bitwise_equal(torch.isnan(got), torch.isnan(want))
        finite = ~torch.isnan(want)
        assert bitwise_equal(torch.isinf(got[finite]), torch.isinf(want[finite]))
        assert bitwise_equal(got[torch.isinf(want)], want[torch.isinf(want)])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("shape", [(0, 4, 3, 3), (2, 4, 0, 3), (0, 7)])
def test_empty_input_gives_zeros(variant, shape):
    out = variant(torch.empty(shape))
    assert bitwise_equal(out, torch.zeros(shape[1]))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3), "2-D or 4-D"),
    (torch.zeros(2, 3, 4), "2-D or 4-D"),
    (torch.zeros(2, 3, 4, 4, dtype=torch.float64), "float32"),
    (torch.zeros(2, 3, 4, 4).transpose(2, 3), "contiguous NCHW or channels_last"),
    (torch.zeros(6, 4).t(), "contiguous \\(N, C\\)"),
    (torch.zeros(2, 0, 3, 3), "at least one channel"),
    ("dy", "torch.Tensor"),
])
def test_bad_input_raises(variant, bad, match):
    with pytest.raises(KernelArgumentError, match=f"^bias_grad: argument 'dy': .*{match}"):
        variant(bad)


def test_plans_cover_every_value_of_the_shape():
    """The plans take the shape alone (no device property), so the split, and with it the bits, is the same
    on every GPU; their chunks cover every value of a channel."""
    vec, p, e = nchw_plan(128, 64, 1024)
    assert vec == 4 and p * e >= 128 * 1024 and e % (THREADS * vec) == 0
    vec, tx, ty, tiles, rb, p = rows_plan(128 * 16, 512)
    assert tx * ty == THREADS and tiles * tx * vec >= 512 and p * rb >= 128 * 16


# --------------------------------------------------------------------------------------------------
# GPU


GPU_SHAPES = [s for _, s in bias_grad_shapes()] + [(1, 1, 1, 1), (3, 5, 7, 9), (2, 1025, 3, 3), (1023, 3), (64, 4, 32, 32)]


def _gpu_cases():
    for shape in GPU_SHAPES:
        for layout in (("rows",) if len(shape) == 2 else ("nchw", "channels_last")):
            yield pytest.param(shape, layout, id=f"{'x'.join(map(str, shape))}_{layout}")


def _gpu_dy(shape, layout, seed=0, scale=1.0):
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    if layout == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    return dy.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", list(_gpu_cases()))
def test_gpu_tree_bitwise_and_equal_to_model(shape, layout):
    dy = _gpu_dy(shape, layout, seed=sum(shape))
    first = TREE(dy)
    for _ in range(100):
        assert_bitwise_equal(TREE(dy), first, f"tree {shape} {layout} repeat")
    assert_bitwise_equal(first, TREE(dy.cpu()), f"tree {shape} {layout} vs CPU model")
    ref = SPEC.reference((dy,), {})
    assert bool(((first.cpu().double() - ref).abs() <= bound(dy.cpu(), TREE)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", list(_gpu_cases()))
def test_gpu_atomic_within_bound_and_measured(shape, layout):
    dy = _gpu_dy(shape, layout, seed=sum(shape) + 1)
    results = [ATOMIC(dy) for _ in range(50)]
    ref = SPEC.reference((dy,), {})
    b = bound(dy.cpu(), ATOMIC)
    for r in results:
        assert bool(((r.cpu().double() - ref).abs() <= b).all())
    print(f"bias_grad/atomic {shape} {layout}: {distinct(results)} distinct results in 50 runs, "
          f"{partials_per_channel(shape, layout)} partials per channel")


@pytest.mark.gpu
def test_gpu_atomic_varies_on_contended_input():
    dy = _gpu_dy((128, 4, 32, 32), "nchw", seed=3, scale=1e6)  # 256 partials per channel
    n = distinct([ATOMIC(dy) for _ in range(100)])
    print(f"bias_grad/atomic (128,4,32,32) cancel: {n} distinct results in 100 runs")
    assert n > 1


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_non_default_stream(variant, layout):
    dy = _gpu_dy((32, 64, 16, 16), layout, seed=4)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = variant(dy)
    side.synchronize()
    if variant.deterministic:
        assert_bitwise_equal(out, variant(dy), f"{variant.key} on a side stream")
    ref = SPEC.reference((dy,), {})
    assert bool(((out.cpu().double() - ref).abs() <= bound(dy.cpu(), variant)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 64, 32, 32), (128, 128, 16, 16), (128, 256, 8, 8), (16, 64, 15, 15)])
def test_gpu_cluster_and_ticket_paths_agree(shape, monkeypatch):
    """The cluster combine (sm_90) and the last-block combine add the same partials in the same order."""
    from kernels import bias_grad as bg

    dy = _gpu_dy(shape, "nchw", seed=7)
    assert nchw_plan(shape[0], shape[1], shape[2] * shape[3])[1] in bg.CLUSTER_SIZES
    clustered = TREE(dy)
    monkeypatch.setattr(bg, "_has_clusters", lambda device: False)
    assert_bitwise_equal(TREE(dy), clustered, f"{shape} cluster vs ticket")
    assert_bitwise_equal(clustered, TREE(dy.cpu()), f"{shape} vs CPU model")
