"""A private CUDA MPS (Multi-Process Service) daemon for the length of a ``with`` block.

Processes that share a GPU without MPS are time-sliced: their kernels never run at the same time, so
several small training processes on one GPU take turns rather than overlap. Under MPS their kernels
share the GPU's multiprocessors. ``daemon()`` starts ``nvidia-cuda-mps-control -d`` with its own pipe
and log directories and sets ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` in this process's
environment, which processes started inside the block inherit: a process becomes an MPS client when it
first initialises CUDA, so workers must start after entering (a process whose CUDA runtime started
before stays outside the daemon, unaffected). On exit the daemon is told to quit and the variables are
restored.

A started daemon can still refuse clients (a GPU in a compute mode that forbids them, a container without
the access MPS needs): ``probe``, a command run inside the block's environment before it is entered (a
CUDA initialisation, ``CUDA_PROBE``), turns that into an ``MPSError`` rather than failing workers.

What each kernel computes does not depend on MPS (it changes when kernels run, not their arithmetic or
their order within a process): a member's bits are the same with or without it."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
# a client's first CUDA work: fails when the daemon cannot serve this process's GPU
CUDA_PROBE = (sys.executable, "-c", "import torch; torch.ones(1, device='cuda').sum().item()")


class MPSError(RuntimeError):
    """The daemon could not be started or serve a client (control binary missing, one already configured,
    start failed, the probe failed)."""


@contextlib.contextmanager
def daemon(*, control: str = CONTROL, start_timeout_s: float = 10.0, probe: tuple[str, ...] | None = None,
           probe_timeout_s: float = 120.0):
    """Run the block under a private MPS daemon; yields its pipe directory. ``probe``: a command that must
    exit 0 as a client of the daemon before the block starts."""
    for var in ENV:
        if os.environ.get(var):
            raise MPSError(f"{var} is already set ({os.environ[var]}): an MPS daemon is managed outside this "
                           "run; leave MPS to it")
    exe = shutil.which(control)
    if exe is None:
        raise MPSError(f"{control} not found on PATH (it ships with the NVIDIA driver)")
    # clients reach the daemon through unix sockets in the pipe directory, whose paths must stay short
    # (about 100 bytes): a long $TMPDIR falls back to /tmp
    base = tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="nnrand-mps-", dir=base if len(base) <= 64 else "/tmp"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for d in env.values():
        Path(d).mkdir()
    full = {**os.environ, **env}
    # Output to a file, not a pipe: the daemon's forked child may keep inherited pipes open, and reading
    # a pipe to its end would then wait for the daemon to exit.
    errors = root / "start.txt"
    with open(errors, "w") as f:
        rc = subprocess.run([exe, "-d"], env=full, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                            timeout=start_timeout_s).returncode
    if rc != 0:
        said = errors.read_text().strip()[-500:]
        shutil.rmtree(root, ignore_errors=True)
        raise MPSError(f"{control} -d failed (exit {rc}): {said}")
    try:
        _wait_for_pipe(Path(env["CUDA_MPS_PIPE_DIRECTORY"]), start_timeout_s, control)
        if probe is not None:
            _probe(probe, full, probe_timeout_s)
        os.environ.update(env)
        yield Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    finally:
        for var in ENV:
            os.environ.pop(var, None)
        subprocess.run([exe], input="quit\n", env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       text=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_pipe(pipe: Path, timeout_s: float, control: str) -> None:
    """The daemon forks and returns before its control pipe exists; a client that starts earlier would
    run outside it. Waits until the pipe directory holds an entry."""
    end = time.monotonic() + timeout_s
    while not any(pipe.iterdir()):
        if time.monotonic() > end:
            raise MPSError(f"{control} -d returned but made no control pipe in {pipe} within {timeout_s:g} s")
        time.sleep(0.05)


def _probe(cmd: tuple[str, ...], env: dict, timeout_s: float) -> None:
    try:
        r = subprocess.run(list(cmd), env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise MPSError(f"a client of the daemon did not finish its first CUDA work within {timeout_s:g} s") from None
    if r.returncode != 0:
        said = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise MPSError(f"a client of the daemon failed (exit {r.returncode}): {said[-1] if said else 'no output'}")
