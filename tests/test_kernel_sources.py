"""Every CUDA source in kernels/ compiles, as NVRTC would see it at run time (sm_90a: the wgmma kernels
too), where nvcc is installed; a clash between a source and the shared headers shows here, without a GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from kernels.runtime import KERNEL_DIR

SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


@pytest.mark.parametrize("source", SOURCES)
def test_cu_source_compiles_for_bf16(tmp_path, source):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    res = subprocess.run([nvcc, "-arch=sm_90a", "--std=c++17", "-DNNRAND_ACT=1", f"-I{KERNEL_DIR}", "-cubin",
                          "-o", str(tmp_path / "k.cubin"), str(KERNEL_DIR / source)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_sources_found():
    assert "conv_mma.cu" in SOURCES and len(SOURCES) >= 10
