"""The shared bitwise comparison: bit patterns, not values (-0.0 is not +0.0), NaN payloads aside."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_bitwise_equal, bitwise_equal


def test_bitwise_equal_tells_signed_zeros_and_dtypes_apart_and_ignores_nan_payloads():
    zero = torch.tensor([0.0, 1.0])
    assert bitwise_equal(zero, zero.clone())
    assert torch.equal(zero, torch.tensor([-0.0, 1.0])) and not bitwise_equal(zero, torch.tensor([-0.0, 1.0]))
    assert not bitwise_equal(zero, zero.double()) and not bitwise_equal(zero, zero[:1])
    quiet = torch.tensor([float("nan"), 2.0])
    payload = quiet.view(torch.int32).clone()
    payload[0] |= 1          # another NaN payload, as a GPU may give
    assert bitwise_equal(quiet, payload.view(torch.float32))
    assert not bitwise_equal(quiet, torch.tensor([1.0, 2.0]))
    assert bitwise_equal(torch.tensor([3, 4]), torch.tensor([3, 4]))
    assert bitwise_equal(torch.tensor([0.5], dtype=torch.bfloat16), torch.tensor([0.5], dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match=r"x: not bitwise equal; 1 elements differ, first at \[\[0\]\]"):
        assert_bitwise_equal(zero, torch.tensor([-0.0, 1.0]), "x")
    with pytest.raises(AssertionError, match="torch.float32 vs .* torch.float64"):
        assert_bitwise_equal(zero, zero.double(), "x")
    assert_bitwise_equal(quiet, payload.view(torch.float32), "x")
