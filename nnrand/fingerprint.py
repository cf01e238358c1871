"""The environment a result was made in: GPU, driver, CUDA, cuDNN, torch, CuPy, numba, git SHA, date.

Two views of the same queries:

* :func:`fingerprint` (every run's config.json and report, ``bench.models``): a flat dict for one device,
  with the GPU's properties and the full git SHA; what could not be queried is ``None``.
* :func:`row_fingerprint` (every benchmark result row): exactly the columns ``FIELDS``, all strings
  (``"none"``: no such hardware, ``"absent"``: package not importable), the SHA as :func:`git_sha` writes
  it. Everything but the date is cached per process, since every row asks.

Queries that can fail (no GPU, no git, no CuPy) never raise: a fingerprint must never stop a run.
``NNRAND_GIT_SHA``, when set, names the commit (a copied tree's own .git, if any, may be another commit's).

    python -m nnrand.fingerprint        # prints the result-row fingerprint
"""
from __future__ import annotations

import datetime
import functools
import importlib
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# The fingerprint columns of every benchmark result row (bench.results.COLUMNS); renaming one orphans the
# committed result tables.
FIELDS = ("gpu", "driver", "cuda", "cudnn", "torch", "cupy", "numba", "numpy", "python", "cpu", "host",
          "git_sha", "date")


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not installed, or a package that fails to initialise (e.g. CuPy without CUDA)
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _git() -> dict:
    if os.environ.get("NNRAND_GIT_SHA"):
        return {"git_sha": os.environ["NNRAND_GIT_SHA"], "git_dirty": None}
    sha = _run(["git", "rev-parse", "HEAD"])
    if sha is None:
        return {"git_sha": None, "git_dirty": None}
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"git_sha": sha, "git_dirty": None if dirty is None else bool(dirty)}


def git_sha() -> str:
    """The commit as result rows name it: 12 hex digits, ``-dirty`` when tracked files differ from it;
    ``NNRAND_GIT_SHA`` verbatim when set; ``"unknown"`` without git."""
    g = _git()
    if g["git_sha"] is None:
        return "unknown"
    if os.environ.get("NNRAND_GIT_SHA"):
        return g["git_sha"]
    return g["git_sha"][:12] + ("-dirty" if g["git_dirty"] else "")


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


def _driver(index: int) -> str | None:
    smi = _run(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    api = _cupy().get("cuda_driver_api")  # no nvidia-smi (containers): the driver's CUDA API version, e.g. 13000
    return f"cuda-api-{api // 1000}.{(api % 1000) // 10}" if api else None


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    return {"gpu": props.name, "gpu_cc": f"{props.major}.{props.minor}", "gpu_sms": props.multi_processor_count,
            "gpu_mem_gib": round(props.total_memory / 2**30, 1), "driver": _driver(index)}


def fingerprint(device: torch.device | str | None = None) -> dict:
    """A flat dict of strings and numbers describing where and with what the code ran on ``device``."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    info: dict = {
        "date": _now(),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "cpu": _cpu_name(),
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


@functools.lru_cache(maxsize=1)
def _row_static() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    gpu = _gpu(torch.cuda.current_device()) if cuda else {}
    return {
        "gpu": gpu.get("gpu") or "none",
        "driver": gpu.get("driver") or "none",
        "cuda": str(torch.version.cuda) if torch.version.cuda else "none",
        "cudnn": str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else "none",
        "torch": torch.__version__,
        "cupy": _version("cupy") or "absent",
        "numba": _version("numba") or "absent",
        "numpy": _version("numpy") or "absent",
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "host": platform.node(),
        "git_sha": git_sha(),
    }


def row_fingerprint() -> dict[str, str]:
    """The ``FIELDS`` of a result row now: the current CUDA device (``"none"`` without one), software,
    host and commit (cached per process), plus the UTC date and time."""
    return {**_row_static(), "date": _now()}


if __name__ == "__main__":
    for k, v in row_fingerprint().items():
        print(f"{k:8s} {v}")
