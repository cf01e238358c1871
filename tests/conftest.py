"""Every test's autotune cache lives in a temporary directory, never in the user's home; every test starts
from seeded global random generators; ``cuda_sync`` for GPU tests."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_autotune_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("NNRAND_CACHE_DIR", str(tmp_path_factory.mktemp("nnrand_cache")))


@pytest.fixture(autouse=True)
def _seeded_global_generators():
    """A draw from torch's, numpy's or Python's global generator (shapes for an argument check, say) gives the
    same values every run: a failure reproduces. Tests that are about randomness seed their own generators;
    fresh OS entropy (``rng=None`` of a CPU order model) is not touched."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)   # the CPU generator and, where CUDA is initialised, every device's


@pytest.fixture
def cuda_sync():
    """Synchronise after a GPU test, so an asynchronous launch error surfaces in the test that caused it."""
    yield
    import torch

    torch.cuda.synchronize()
