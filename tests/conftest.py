"""Every test's autotune cache lives in a temporary directory, never in the user's home; ``cuda_sync`` for
GPU tests."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_autotune_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("NNRAND_CACHE_DIR", str(tmp_path_factory.mktemp("nnrand_cache")))


@pytest.fixture
def cuda_sync():
    """Synchronise after a GPU test, so an asynchronous launch error surfaces in the test that caused it."""
    yield
    import torch

    torch.cuda.synchronize()
