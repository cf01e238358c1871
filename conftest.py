"""Root pytest configuration: the `gpu` marker skips cleanly where CUDA kernels cannot run."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from kernels.runtime import cuda_available, cupy_available

    if cuda_available():
        return
    import torch

    reason = ("no CUDA device" if not torch.cuda.is_available() else "CuPy is not installed") + \
        ": GPU tests run on a CUDA machine with nnrand[cuda12] or nnrand[cuda13]"
    if torch.cuda.is_available() and cupy_available():
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
