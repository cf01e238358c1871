"""Variance and error metrics of the benchmark suite, and the torch-mode context, on exact small cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.metrics import VarianceTracker, abs_difference, byte_hash, joined, reference_error, ulp_distance, variance
from bench.timing import torch_mode
from tests.helpers import bitwise_equal

F = torch.float32


def f32(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=F)


def nextafter(x: float, toward: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(toward)))


# --------------------------------------------------------------------------------------------------
# ULP and absolute differences


@pytest.mark.parametrize("a, b, ulps", [
    (1.0, nextafter(1.0, 2.0), 1),
    (1.0, nextafter(nextafter(1.0, 0.0), 0.0), 2),
    (0.0, -0.0, 0),                                  # +0 and -0 sit at the same point of the number line
    (1e-45, -1e-45, 2),                              # smallest subnormals across zero
    (3.4028234663852886e38, math.inf, 1),            # largest finite -> inf
    (-2.0, -2.0, 0),
    (1.0, 2.0, 2**23),                               # one binade
])
def test_ulp_distance_counts_representable_floats(a, b, ulps):
    assert ulp_distance(f32(a), f32(b)).tolist() == [float(ulps)]
    assert ulp_distance(f32(b), f32(a)).tolist() == [float(ulps)]


def test_ulp_distance_float64_and_nan():
    a = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([float(np.nextafter(1.0, 2.0)), float("nan")], dtype=torch.float64)
    assert ulp_distance(a, b).tolist() == [1.0, math.inf]


def test_nan_handling_in_differences():
    nan = float("nan")
    a, b = f32(nan, nan, 1.0, 2.0), f32(nan, 1.0, nan, 2.0)
    assert ulp_distance(a, b).tolist() == [0.0, math.inf, math.inf, 0.0]
    assert abs_difference(a, b).tolist() == [0.0, math.inf, math.inf, 0.0]


def test_ulp_distance_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        ulp_distance(f32(1.0), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError):
        ulp_distance(f32(1.0, 2.0), f32(1.0))


# --------------------------------------------------------------------------------------------------
# Variance tracker


def test_identical_results_are_one_distinct_result():
    x = torch.randn(1000)
    v = variance(x.clone() for _ in range(10))
    assert v == {"distinct_results": 1.0, "frac_runs_differ": 0.0, "max_abs_diff": 0.0, "max_ulp": 0.0,
                 "frac_elements_differ": 0.0}


def test_single_repeat_compares_nothing():
    v = variance([torch.randn(7)])
    assert v["distinct_results"] == 1.0
    for k in ("frac_runs_differ", "max_abs_diff", "max_ulp", "frac_elements_differ"):
        assert math.isnan(v[k]), k


def test_ties_alternating_results():
    # two distinct results, each appearing 3 times; the runs after the first differ 3 times out of 5
    a = f32(1.0, 2.0, 3.0, 4.0)
    b = a.clone()
    b[1] = nextafter(2.0, 3.0)
    b[3] = nextafter(nextafter(4.0, 0.0), 0.0)
    v = variance([a, b, a, b, a, b])
    assert v["distinct_results"] == 2.0
    assert v["frac_runs_differ"] == 3 / 5
    assert v["max_ulp"] == 2.0
    assert v["max_abs_diff"] == 4.0 - float(np.float32(nextafter(nextafter(4.0, 0.0), 0.0)))
    assert v["frac_elements_differ"] == 0.5


def test_signed_zero_is_a_distinct_result_with_no_magnitude():
    v = variance([f32(0.0), f32(-0.0), f32(0.0)])
    assert v["distinct_results"] == 2.0
    assert v["max_ulp"] == 0.0 and v["max_abs_diff"] == 0.0
    assert v["frac_elements_differ"] == 1.0


def test_nan_results():
    nan = float("nan")
    same = variance([f32(nan, 1.0), f32(nan, 1.0)])
    assert same["distinct_results"] == 1.0 and same["max_ulp"] == 0.0
    mixed = variance([f32(nan, 1.0), f32(2.0, 1.0), f32(nan, 1.0)])
    assert mixed["distinct_results"] == 2.0
    assert mixed["max_ulp"] == math.inf and mixed["max_abs_diff"] == math.inf
    assert mixed["frac_elements_differ"] == 0.5
    # another NaN payload is another result
    other = torch.tensor([0x7FC00001], dtype=torch.int32).view(F)
    payload = variance([f32(nan), other])
    assert payload["distinct_results"] == 2.0


def test_counts_many_distinct_results_also_past_the_device_store():
    results = [f32(float(i), 1.0) for i in range(6)] + [f32(0.0, 1.0), f32(5.0, 1.0)]
    for store in (1 << 20, 16):  # 16 bytes: only the first result is stored, the rest are hashed
        t = VarianceTracker(store_bytes=store)
        for r in results:
            t.add(r)
        s = t.summary()
        assert s["distinct_results"] == 6.0, store
        assert s["frac_runs_differ"] == 6 / 7
        assert s["max_abs_diff"] == 5.0


def test_tracker_rejects_a_change_of_shape_and_an_empty_summary():
    t = VarianceTracker()
    with pytest.raises(ValueError):
        t.summary()
    t.add(f32(1.0))
    with pytest.raises(ValueError):
        t.add(f32(1.0, 2.0))


def test_negative_control_shuffled_float32_sum_varies():
    """A sum whose order changes per call must be seen to vary; a fixed order must not."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 1e4).astype(np.float32)

    def ordered_sum(order):
        acc = np.float32(0)
        for v in x[order]:
            acc = np.float32(acc + v)
        return torch.tensor(acc)

    fixed = variance(ordered_sum(np.arange(x.size)) for _ in range(20))
    shuffled = variance(ordered_sum(rng.permutation(x.size)) for _ in range(20))
    assert fixed["distinct_results"] == 1.0
    assert shuffled["distinct_results"] > 1.0 and shuffled["max_ulp"] >= 1.0


def test_byte_hash_is_bitwise():
    assert byte_hash(f32(1.0, 2.0)) == byte_hash(f32(1.0, 2.0))
    assert byte_hash(f32(0.0)) != byte_hash(f32(-0.0))


# --------------------------------------------------------------------------------------------------
# Error against the float64 reference


def test_reference_error_values():
    out = f32(1.0, 2.0, 4.0)
    ref = torch.tensor([1.0, 2.5, 4.0], dtype=torch.float64)
    e = reference_error(out, ref)
    assert e["err_max_abs"] == 0.5
    assert e["err_rel_l2"] == 0.5 / math.sqrt(1 + 2.5**2 + 16)


def test_reference_error_zero_reference_is_absolute_and_nan_propagates():
    assert reference_error(f32(3.0, 4.0), torch.zeros(2, dtype=torch.float64))["err_rel_l2"] == 5.0
    e = reference_error(f32(float("nan"), 1.0), torch.ones(2, dtype=torch.float64))
    assert math.isnan(e["err_max_abs"]) and math.isnan(e["err_rel_l2"])
    with pytest.raises(ValueError):
        reference_error(f32(1.0), torch.ones(2, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# torch flags


def _flags():
    return (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)


@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_torch_mode_sets_and_restores_flags(mode):
    before = _flags()
    with torch_mode(mode):
        assert torch.backends.cudnn.benchmark is True
        assert torch.backends.cudnn.deterministic is (mode == "deterministic")
        assert torch.are_deterministic_algorithms_enabled() is (mode == "deterministic")
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert _flags() == before
    with pytest.raises(RuntimeError):
        with torch_mode(mode):
            raise RuntimeError("inside")
    assert _flags() == before


def test_torch_mode_restores_a_non_default_state():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        before = _flags()
        with torch_mode("fast"):
            assert not torch.are_deterministic_algorithms_enabled()
        assert _flags() == before
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(ValueError):
        with torch_mode("sloppy"):
            pass


def test_mixed_half_and_float32_parts_are_joined_exactly_and_told_apart():
    """A bf16 dx beside float32 dgamma/dbeta: joined in float32 (exact), a one-bit change in either part
    is a new result; float64 beside float32 is still refused."""
    g = torch.Generator().manual_seed(3)
    dx = torch.randn(4, 5, generator=g).bfloat16()
    dgamma, dbeta = torch.randn(5, generator=g), torch.randn(5, generator=g)
    j = joined((dx, dgamma, dbeta))
    assert j.dtype == torch.float32 and bitwise_equal(j[:20].bfloat16(), dx.reshape(-1))
    t = VarianceTracker()
    t.add((dx, dgamma, dbeta))
    t.add((dx.clone(), dgamma.clone(), dbeta.clone()))
    flipped = (dx.view(torch.int16) ^ 1).view(torch.bfloat16)
    t.add((flipped, dgamma, dbeta))
    assert t.distinct == 2
    assert t.max_ulp == 1.0   # one bf16 ULP, measured in bf16 (widened to float32 it would read 65536)
    moved = dgamma.clone()
    moved[2] = torch.nextafter(torch.nextafter(moved[2], torch.tensor(math.inf)), torch.tensor(math.inf))
    t.add((dx, moved, dbeta))
    assert t.max_ulp == 2.0 and t.distinct == 3
    with pytest.raises(ValueError, match="share one dtype"):
        joined((dgamma.double(), dbeta))
