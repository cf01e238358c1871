"""Shared test utilities: byte hashes, ULP distances, summation error bounds."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)


def byte_hash(t: torch.Tensor) -> str:
    """SHA-1 of a tensor's bytes (any dtype, bf16 included: hashed as raw bytes)."""
    return hashlib.sha1(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def distinct(results: list[torch.Tensor]) -> int:
    return len({byte_hash(r) for r in results})


def gamma(depth: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): a float32 sum whose every term passes through at most k
    additions is off by at most gamma_k * sum |x_i|."""
    return depth * U32 / (1 - depth * U32)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a, b) or (a.shape == b.shape and byte_hash(a) == byte_hash(b)):
        return
    if a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and \
            torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)]):
        return  # NaN payloads may differ between CPU and GPU; every non-NaN value is bit-equal
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    idx = diff.nonzero()[:10].tolist() if a.shape == b.shape else "shapes differ"
    raise AssertionError(f"{what}: not bitwise equal; first mismatches at {idx}: "
                         f"{a[diff][:5].tolist() if a.shape == b.shape else (a.shape, b.shape)} vs "
                         f"{b[diff][:5].tolist() if a.shape == b.shape else ''}")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two float32 tensors (ordered bit patterns)."""
    def ordered(t):
        i = t.detach().cpu().contiguous().numpy().view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    if a.numel() == 0:
        return 0
    return int(np.max(np.abs(ordered(a) - ordered(b))))
