"""The environment a result was made in: GPU, driver, CUDA, cuDNN, torch, CuPy, numba, git SHA, date.

Every config.json and report carries it. Queries that can fail (no GPU, no git, no CuPy) record
``None`` rather than raising: a fingerprint must never stop a run.
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def _git() -> dict:
    # NNRAND_GIT_SHA names the commit of a copied tree (whose own .git, if any, may be another commit's)
    if os.environ.get("NNRAND_GIT_SHA"):
        return {"git_sha": os.environ["NNRAND_GIT_SHA"], "git_dirty": None}
    sha = _run(["git", "rev-parse", "HEAD"])
    if sha is None:
        return {"git_sha": None, "git_dirty": None}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"git_sha": sha, "git_dirty": None if dirty is None else bool(dirty)}


def _cupy() -> dict:
    try:
        import cupy
    except Exception:
        return {"cupy": None}
    info = {"cupy": cupy.__version__}
    try:
        info["cuda_driver_api"] = int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        pass
    return info


def _numba() -> str | None:
    try:
        import numba
    except Exception:
        return None
    return numba.__version__


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    driver = _run(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"gpu": props.name, "gpu_cc": f"{props.major}.{props.minor}", "gpu_sms": props.multi_processor_count,
            "gpu_mem_gib": round(props.total_memory / 2**30, 1), "driver": driver}


def fingerprint(device: torch.device | str | None = None) -> dict:
    """A flat dict of strings and numbers describing where and with what the code ran."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    info: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "numba": _numba(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info.update(_gpu(device.index if device.index is not None else torch.cuda.current_device()))
    else:
        info.update({"gpu": None, "driver": None})
    info.update(_cupy())
    info.update(_git())
    return info
