"""Root pytest configuration: the `gpu` marker skips cleanly where CUDA kernels cannot run."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    from kernels.runtime import cuda_available

    if cuda_available():
        return
    reason = ("no CUDA device" if not torch.cuda.is_available() else "CuPy is not installed") + \
        ": GPU tests run on a CUDA machine with nnrand[cuda12] or nnrand[cuda13]"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
