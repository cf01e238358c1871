"""sum: CPU order models against float64 and each other; GPU kernels against their models."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels.runtime import cdiv
from kernels.sum import (EXACT_FRAC, EXACT_MAX_EXP, MAX_BLOCKS, THREADS, SumRangeError, blocks_for,
                         exact_error_bound, round_integer_to_f32)
from tests.helpers import assert_bitwise_equal, byte_hash, distinct, gamma

VARIANTS = kernels.variants("sum")
DETERMINISTIC = [v for v in VARIANTS if v.deterministic]
ATOMIC = kernels.get("sum", "atomic")
SPEC = kernels.spec("sum")
CASES = SPEC.test_cases()


def inputs(case, device="cpu"):
    (x,), _ = SPEC.make_inputs(case, torch.device(device))
    return x


def depth(n: int, variant) -> int:
    """Longest chain of float32 additions any one element passes through in this variant."""
    g = blocks_for(n)
    per_thread = cdiv(cdiv(n, 4), g * THREADS)
    first = per_thread + 2 + 5 + 5          # slots, lane combine, warp tree, tree of warp sums
    if variant.name == "atomic":
        return first + g                    # arrival-order chain over the block partials
    return first + cdiv(g, THREADS) + 10    # strided pass over partials + block tree


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    x = inputs(case)
    got = variant(x, rng=case.seed).double()
    ref = SPEC.reference((x,), {})
    if variant.order_independent:
        bound = exact_error_bound(x.numel(), got.item())
    else:
        bound = gamma(depth(x.numel(), variant)) * x.double().abs().sum().item()
    assert abs(got.item() - ref.item()) <= bound, f"{variant.key} n={x.numel()}: {got.item()} vs {ref.item()}"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("n", [1, 2, 1023, 1024, 1025, 65537, 1 << 20, (1 << 21) + 3])
def test_model_exact_on_small_integers(variant, n):
    """Small integers sum exactly in float32 while every partial stays below 2^24, so any lost,
    repeated or misplaced element shows as an exact mismatch."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-8, 9, (n,), generator=g).float()
    assert variant(x, rng=1).item() == x.double().sum().item()


@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
def test_deterministic_models_are_bitwise_stable(variant):
    x = inputs(next(c for c in CASES if c.params["n"] == 1_000_003))
    hashes = {byte_hash(variant(x, rng=seed)) for seed in range(5)}
    assert len(hashes) == 1


def test_lastblock_has_the_bits_of_tree():
    for case in CASES:
        x = inputs(case)
        assert_bitwise_equal(kernels.get("sum", "lastblock")(x), kernels.get("sum", "tree")(x), case.name)


def test_atomic_model_varies_where_order_matters():
    """Negative control: large-magnitude cancellation makes the arrival order visible."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(7)) * 1e7
    results = [ATOMIC(x, rng=seed) for seed in range(20)]
    assert distinct(results) > 1
    assert distinct([kernels.get("sum", "tree")(x) for _ in range(3)]) == 1


def test_exact_is_permutation_invariant():
    exact = kernels.get("sum", "exact")
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 1e5
    base = exact(x)
    for seed in range(8):
        perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))
        assert_bitwise_equal(exact(x[perm]), base, f"permutation {seed}")
    orders = [torch.randperm(x.numel(), generator=torch.Generator().manual_seed(100 + i)) for i in range(8)]
    assert distinct([kernels.get("sum", "tree")(x[perm]) for perm in orders]) > 1   # negative control


def _is_nearest_float32(value: np.float32, exact: Fraction) -> bool:
    here = abs(Fraction(float(value)) - exact)
    up, down = np.nextafter(value, np.float32(np.inf)), np.nextafter(value, np.float32(-np.inf))
    return here <= abs(Fraction(float(up)) - exact) and here <= abs(Fraction(float(down)) - exact)


def test_exact_is_correctly_rounded_on_its_grid():
    """Inputs on the 2^-56 grid lose nothing to truncation: the result is the float32 nearest the true sum."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-20, 30, (20_000,), generator=g).float())
    x = x[x.abs() >= 2.0**-30]
    got = kernels.get("sum", "exact")(x).numpy()
    exact = sum((Fraction(float(v)) for v in x.numpy()), Fraction(0))
    assert _is_nearest_float32(got[()], exact)


def test_exact_windows_round_each_element_to_the_grid():
    """Each element becomes an integer within half a unit (2^-57) of x * 2^56, for every magnitude."""
    from kernels.sum import exact_integer

    g = torch.Generator().manual_seed(12)
    x = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-70, 32, (4000,), generator=g).float())
    x = x[x.abs() < 2.0**EXACT_MAX_EXP]
    for v in x.numpy()[:4000]:
        q, flags = exact_integer(np.array([v], dtype=np.float32))
        assert flags == 0 and abs(Fraction(q) - Fraction(float(v)) * 2**EXACT_FRAC) <= Fraction(1, 2), v


def test_round_integer_ties_to_even():
    # 2^24 + 1 is halfway between 2^24 and 2^24 + 2: ties go to the even mantissa (2^24).
    assert round_integer_to_f32((2**24 + 1) << EXACT_FRAC) == np.float32(2**24)
    assert round_integer_to_f32((2**24 + 3) << EXACT_FRAC) == np.float32(2**24 + 4)
    assert round_integer_to_f32(-((2**24 + 3) << EXACT_FRAC)) == np.float32(-(2**24 + 4))


def test_exact_range_limits():
    exact = kernels.get("sum", "exact")
    big = torch.tensor([np.nextafter(np.float32(2.0**EXACT_MAX_EXP), np.float32(0)), 1.0])
    assert exact(big).item() == float(np.float32(big.double().sum().item()))
    with pytest.raises(SumRangeError, match="argument 'x'.*2\\^32"):
        exact(torch.tensor([2.0**EXACT_MAX_EXP, 1.0]))
    assert torch.isnan(exact(torch.tensor([2.0**EXACT_MAX_EXP]), check_range=False))
    # Below the 2^-56 grid values round to the nearest multiple, within the documented bound.
    tiny = torch.full((1000,), 2.0**-60)
    got = exact(tiny).item()
    assert got == 0.0 and abs(got - tiny.double().sum().item()) <= exact_error_bound(1000, got)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("values,expected", [
    ([1.0, float("nan"), 2.0], float("nan")),
    ([1.0, float("inf")], float("inf")),
    ([float("-inf"), 5.0], float("-inf")),
    ([float("inf"), float("-inf")], float("nan")),
])
def test_nan_inf_propagate_like_torch(variant, values, expected):
    x = torch.tensor(values * 300)
    got, want = variant(x, rng=0).item(), torch.sum(x).item()
    assert (np.isnan(got) and np.isnan(want)) or got == want == expected


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_empty_input_sums_to_zero(variant):
    out = variant(torch.empty(0))
    assert out.shape == () and out.item() == 0.0


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3, 4), "argument 'x'.*1-D"),
    (torch.zeros(8, dtype=torch.float64), "argument 'x'.*float32"),
    (torch.zeros(8, dtype=torch.int32), "argument 'x'.*float32"),
    (torch.arange(16.0)[::2], "argument 'x'.*contiguous"),
    ([1.0, 2.0], "argument 'x'.*torch.Tensor"),
])
def test_bad_input_raises(variant, bad, match):
    with pytest.raises(KernelArgumentError, match=f"^sum: {match}"):
        variant(bad)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_cuda_launcher_refuses_cpu_tensor(variant):
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):
        variant.cuda(torch.ones(4))


def test_partition_depends_on_size_only():
    assert blocks_for(1) == 1 and blocks_for(1024) == 1 and blocks_for(1025) == 2
    assert blocks_for(2**28) == MAX_BLOCKS


# --------------------------------------------------------------------------------------------------
# GPU


GPU_SIZES = [1, 2, 1023, 1024, 1025, 4093, 65537, (1 << 20) - 1, 1 << 24, (1 << 24) + 5]


def _gpu_x(n, seed=0, scale=1.0):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
@pytest.mark.parametrize("n", GPU_SIZES)
def test_gpu_deterministic_bitwise_and_equal_to_model(variant, n):
    x = _gpu_x(n, seed=n, scale=1e3)
    first = variant(x)
    for _ in range(100):
        assert_bitwise_equal(variant(x), first, f"{variant.key} n={n} repeat")
    torch.cuda.synchronize()
    assert_bitwise_equal(first, variant(x.cpu()), f"{variant.key} n={n} vs CPU model")
    ref = x.double().sum().item()
    bound = (exact_error_bound(n, first.item()) if variant.order_independent
             else gamma(depth(n, variant)) * x.double().abs().sum().item())
    assert abs(first.item() - ref) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in DETERMINISTIC if not v.order_independent], ids=lambda v: v.name)
def test_gpu_keeps_subnormals_like_the_model(variant):
    """Kernels are compiled without flush-to-zero: subnormal inputs and partials add as IEEE float32.
    (The exact variant rounds every element to its 2^-56 grid, so subnormals sum to zero there.)"""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(300_007, generator=g) * 1e-39  # every value subnormal (below 2^-126 ~ 1.2e-38)
    assert bool((x.abs() < 2.0**-126).all())
    got = variant(x.cuda())
    assert got.item() != 0.0
    assert_bitwise_equal(got, variant(x), f"{variant.key} on subnormal input vs CPU model")


@pytest.mark.gpu
def test_gpu_atomic_varies_on_contended_input():
    x = _gpu_x(1 << 24, seed=5, scale=1e7)  # 2048 partials colliding on one scalar, with cancellation
    results = [ATOMIC(x) for _ in range(200)]
    n_distinct = distinct(results)
    print(f"sum/atomic 2^24 cancel: {n_distinct} distinct results in 200 runs")
    assert n_distinct > 1
    # every atomic result is some arrival order of the same partials: within the atomic bound
    bound = gamma(depth(1 << 24, ATOMIC)) * x.double().abs().sum().item()
    assert max(abs(r.item() - x.double().sum().item()) for r in results) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_gpu_non_default_stream(variant):
    x = _gpu_x((1 << 22) + 1, seed=9)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = variant(x)
    side.synchronize()
    if variant.deterministic:
        assert_bitwise_equal(out, variant(x), f"{variant.key} on a side stream")
    assert abs(out.item() - x.double().sum().item()) <= gamma(depth(x.numel(), variant)) * x.double().abs().sum().item()


@pytest.mark.gpu
def test_gpu_exact_permutation_invariant():
    exact = kernels.get("sum", "exact")
    x = _gpu_x((1 << 22) + 3, seed=13, scale=1e4)
    base = exact(x)
    for seed in range(10):
        perm = torch.randperm(x.numel(), device=x.device, generator=torch.Generator(device="cuda").manual_seed(seed))
        assert_bitwise_equal(exact(x[perm]), base, f"permutation {seed}")
    assert_bitwise_equal(base, exact(x.cpu()), "exact vs CPU model")


@pytest.mark.gpu
def test_gpu_misaligned_view_gives_same_bits():
    x = _gpu_x(1 << 20, seed=17)
    view = x[1:]  # 4 bytes past a 256-byte aligned allocation
    for variant in DETERMINISTIC:
        assert_bitwise_equal(variant(view), variant(view.clone()), variant.key)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_more_than_2_31_elements():
    n = (1 << 31) + 7
    x = torch.empty(n, device="cuda")
    x.uniform_(-1.0, 1.0, generator=torch.Generator(device="cuda").manual_seed(1))
    ref = x.sum(dtype=torch.float64).item()
    abs_sum = x.abs().sum(dtype=torch.float64).item()
    for variant in VARIANTS:
        if variant.order_independent:
            with pytest.raises(KernelArgumentError, match="at most 2\\^31 elements"):
                variant(x)
            continue
        got = variant(x).item()
        bound = exact_error_bound(n, got) if variant.order_independent else gamma(depth(n, variant)) * abs_sum
        assert abs(got - ref) <= bound, variant.key
