"""The environment a result was made in: GPU, driver, CUDA, cuDNN, NVRTC, torch, CuPy (and its CUDA runtime),
numba, the CPU and its kernels' instruction set, git SHA, date.

Two views of the same queries:

* :func:`fingerprint` (every run's config.json and report, ``bench.models``): a flat dict for one device,
  with the GPU's properties and the full git SHA; what could not be queried is ``None``.
* :func:`row_fingerprint` (every benchmark result row): exactly the columns ``FIELDS``, all strings
  (``"none"``: no such hardware, ``"absent"``: package not importable), the SHA as :func:`git_sha` writes
  it. Everything but the date is cached per process, since every row asks.

Queries that can fail (no GPU, no git, no CuPy) never raise: a fingerprint must never stop a run.
``NNRAND_GIT_SHA``, when set, names the commit (a copied tree's own .git, if any, may be another commit's).

The tree counts as dirty when tracked files differ from the commit or kernels/ holds untracked files
(``kernels/__init__.py`` imports every ``kernels/<op>.py`` there, committed or not); ``reports/`` does not
count (the results and reports a run writes would make its own resume another tree). A dirty SHA names its
edits: ``<sha>-dirty-<8 hex>``, a hash of ``git diff HEAD`` and of the untracked kernel files.

    python -m nnrand.fingerprint        # prints the result-row fingerprint
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import importlib
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# The fingerprint columns of every benchmark result row (bench.results.COLUMNS); renaming one orphans the
# committed result tables.
# Tables written before a field existed lack its column (readers fill it in).
FIELDS = ("gpu", "driver", "cuda", "cudnn", "nvrtc", "torch", "cupy", "cupy_cuda", "numba", "numpy", "python", "cpu",
          "cpu_capability", "host", "git_sha", "date")


def _run(cmd: list[str]) -> str | None:
    out = _run_bytes(cmd, timeout=20)
    return None if out is None else out.decode(errors="replace").strip()


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


# Paths whose changes do not make the tree dirty: what runs write (results, reports), not code
NOT_CODE = ("reports",)


def _run_bytes(cmd: list[str], timeout: float = 60) -> bytes | None:
    """``cmd``'s standard output, run in the checkout; None where it cannot run or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _edits() -> tuple[bool, str] | None:
    """(dirty, 8 hex digits naming the edits) of the checkout, or None where git cannot say: tracked files
    that differ from HEAD and untracked files under kernels/, outside NOT_CODE."""
    spec = ["--", ".", *(f":(exclude){p}" for p in NOT_CODE)]
    # plumbing, not porcelain: no external diff tool, no textconv, no colour, full object names, whatever the
    # user's or the clone's git configuration says (their output would change the hash, or hide the edits)
    diff = _run_bytes(["git", "-c", "core.quotePath=true", "diff-index", "-p", "--binary", "--full-index",
                       "--no-textconv", "--no-ext-diff", "--no-color", "--no-renames", "HEAD", *spec])
    untracked = _run_bytes(["git", "ls-files", "--others", "--exclude-standard", "-z", "--", "kernels"])
    if diff is None or untracked is None:
        return None
    h = hashlib.blake2b(diff, digest_size=4)
    names = sorted(n for n in untracked.decode(errors="replace").split("\0") if n)
    for name in names:
        h.update(b"\0" + name.encode() + b"\0")
        try:
            h.update((REPO / name).read_bytes())
        except OSError:   # removed meanwhile: its name still counts
            pass
    return bool(diff or names), h.hexdigest()


@functools.lru_cache(maxsize=None)
def _git() -> dict:
    if os.environ.get("NNRAND_GIT_SHA"):
        return {"git_sha": os.environ["NNRAND_GIT_SHA"], "git_dirty": None, "git_edits": None}
    sha = _run(["git", "rev-parse", "HEAD"])
    if sha is None:
        return {"git_sha": None, "git_dirty": None, "git_edits": None}
    edits = _edits()
    if edits is None:
        return {"git_sha": sha, "git_dirty": None, "git_edits": None}
    return {"git_sha": sha, "git_dirty": edits[0], "git_edits": edits[1] if edits[0] else None}


def git_sha() -> str:
    """The commit as result rows name it: 12 hex digits, ``-dirty-<8 hex>`` naming the edits when tracked
    files differ from it or kernels/ has untracked files (``reports/`` aside); ``NNRAND_GIT_SHA`` verbatim
    when set; ``"unknown"`` without git."""
    g = _git()
    if g["git_sha"] is None:
        return "unknown"
    if os.environ.get("NNRAND_GIT_SHA"):
        return g["git_sha"]
    return g["git_sha"][:12] + (f"-dirty-{g['git_edits']}" if g["git_dirty"] else "")


def _cpu_capability() -> str | None:
    """The instruction set torch's CPU kernels dispatch to (AVX2, AVX512, ...): it changes CPU results."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None


def _cupy() -> dict:
    """CuPy's version, the CUDA runtime it was built for and the NVRTC it loads (they compile nnrand's
    kernels), and the driver's CUDA API version; only what could be queried."""
    try:
        import cupy
    except Exception:
        return {"cupy": None}
    info = {"cupy": cupy.__version__}
    for key, query in (("cuda_driver_api", lambda: int(cupy.cuda.runtime.driverGetVersion())),
                       ("cupy_cuda", lambda: _cuda_version(int(cupy.cuda.runtime.runtimeGetVersion()))),
                       ("nvrtc", _nvrtc_version)):
        try:
            info[key] = query()
        except Exception:   # no driver, no NVRTC library: that field stays unknown
            pass
    return info


def _cuda_version(v: int) -> str:
    """12080 -> "12.8" (CUDA's version integers)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def _driver(index: int) -> str | None:
    smi = _run(["nvidia-smi", f"--id={index}", "--query-gpu=driver_version", "--format=csv,noheader"])
    if smi:
        return smi.splitlines()[0].strip()
    api = _cupy().get("cuda_driver_api")  # no nvidia-smi (containers): the driver's CUDA API version, e.g. 13000
    return f"cuda-api-{_cuda_version(api)}" if api else None


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
        "cpu_capability": _cpu_capability(),
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
    cupy = _cupy()
    return {
        "gpu": gpu.get("gpu") or "none",
        "driver": gpu.get("driver") or "none",
        "cuda": str(torch.version.cuda) if torch.version.cuda else "none",
        "cudnn": str(torch.backends.cudnn.version()) if cuda and torch.backends.cudnn.is_available() else "none",
        "nvrtc": cupy.get("nvrtc") or ("absent" if cupy["cupy"] is None else "unknown"),
        "torch": torch.__version__,
        "cupy": cupy["cupy"] or "absent",
        "cupy_cuda": cupy.get("cupy_cuda") or ("absent" if cupy["cupy"] is None else "unknown"),
        "numba": _version("numba") or "absent",
        "numpy": _version("numpy") or "absent",
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_capability": _cpu_capability() or "unknown",
        "host": platform.node(),
        "git_sha": git_sha(),
    }


def row_fingerprint() -> dict[str, str]:
    """The ``FIELDS`` of a result row now: the current CUDA device (``"none"`` without one), software,
    host and commit (cached per process), plus the UTC date and time."""
    return {**_row_static(), "date": _now()}


if __name__ == "__main__":
    for k, v in row_fingerprint().items():
        print(f"{k:14s} {v}")
