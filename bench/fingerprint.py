"""Environment fingerprint carried by every result row: which machine and software produced a number.

Independent of nnrand (only the standard library, torch and whatever optional packages import), so any
benchmark or script can stamp its rows with it.
"""
from __future__ import annotations

import datetime as _dt
import functools
import os
import importlib
import pathlib
import platform
import subprocess

import torch

FIELDS = ("gpu", "driver", "cuda", "cudnn", "torch", "cupy", "numba", "numpy", "python", "cpu", "host",
          "git_sha", "date")


def _run(cmd: list[str], cwd: pathlib.Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not installed, or a package that fails to initialise (e.g. CuPy without CUDA)
        return "absent"


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver() -> str:
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    try:
        import cupy

        v = cupy.cuda.runtime.driverGetVersion()  # CUDA driver API version, e.g. 13000
        return f"cuda-api-{v // 1000}.{(v % 1000) // 10}"
    except Exception:
        return "none"


def git_sha(root: pathlib.Path | None = None) -> str:
    root = root or pathlib.Path(__file__).resolve().parents[1]
    # NNRAND_GIT_SHA names the commit of a copied tree (whose own .git, if any, may be another commit's)
    if os.environ.get("NNRAND_GIT_SHA"):
        return os.environ["NNRAND_GIT_SHA"]
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root)
    if sha is None:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return sha + ("-dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def _static() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "driver": _driver() if cuda else "none",
        "cuda": str(torch.version.cuda) if torch.version.cuda else "none",
        "cudnn": str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else "none",
        "torch": torch.__version__,
        "cupy": _version("cupy"),
        "numba": _version("numba"),
        "numpy": _version("numpy"),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "host": platform.node(),
        "git_sha": git_sha(),
    }


def fingerprint() -> dict[str, str]:
    """The fingerprint now: software and hardware (cached per process) plus the UTC date and time."""
    return {**_static(), "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


if __name__ == "__main__":
    for k, v in fingerprint().items():
        print(f"{k:8s} {v}")
