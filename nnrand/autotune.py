"""Per-shape choice of the fastest deterministic conv backward (and forward): ``--kernel fastest-deterministic``.

    with nnrand.use_kernels("fastest-deterministic") as routed:
        loss.backward()
    print(routed.tuner.record())        # what each conv shape ran, and every candidate's time

For each conv backward configuration met at run time (op, shapes, stride, padding, dilation, groups,
layout, dtype), the first call times the deterministic candidates once and keeps the fastest (the routing
also offers the forward convs of training steps, key op ``conv_fwd``: see nnrand/routing.py):

* every registry variant of the op that is deterministic (``tree``; for conv_wgrad also ``nosplit`` and
  ``winograd`` where the shape allows them);
* ``torch_det``: torch's own kernel under PyTorch's deterministic mode, which a deterministic routing
  turns on (on CUDA: cuDNN restricted to its deterministic algorithms, picked by cuDNN's heuristics with
  ``cudnn.benchmark`` off, so the algorithm is a function of the shapes, the device and the library
  versions, not of a timing race). It is a candidate only while that mode is on: a routing that mixes in
  an ``atomic`` variant turns it off, and then only the registry's deterministic variants compete.

A nondeterministic candidate is never timed, so never chosen. The choice is cached on disk
(``$NNRAND_CACHE_DIR/autotune.json``, default ``~/.cache/nnrand``), keyed by the environment (device
name and compute capability, torch, cuDNN and CuPy versions, a hash of the kernels' CUDA and Python sources; CPU
model and thread count on the CPU) and the configuration, so the next process on the same machine makes
the same choices without timing. Writes are atomic and merge with what other processes wrote.

A run records its choices (``record()``: the environment and, per configuration, the choice and the
times); passing that record back as ``pinned`` makes a later run (a resume, a rerun on another day)
use exactly those choices. With ``pinned_only`` a configuration missing from the record is an error
instead of a new timing: what multi-process runs use, since ranks timing on their own could choose
differently. (The routing does not ask for a forward configuration the record lacks: it runs torch's
forward there, the same in every process.)

Timing: a warm-up call (compilation, cuDNN plans), then ``REPEATS`` repeats of ``CALLS`` back-to-back
calls between CUDA events, queued behind a sleep kernel so that the events time the GPU's work alone
(the choice follows the kernels, as a CUDA-graph step and the per-shape reports see them, not the speed
at which the host queues them); the median per call. On the CPU, ``time.perf_counter`` around each call.
Times are in microseconds. No choice is made while a CUDA graph is being captured: a configuration first
met during capture raises :class:`AutotuneError` (run one eager step first, as ``GraphStep`` does).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch

from . import runio

TORCH_DET = "torch_det"   # candidate: torch's own kernel under PyTorch's deterministic mode
CACHE_VERSION = 2
CALLS, REPEATS = 3, 5
KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"


class AutotuneError(RuntimeError):
    """A configuration the tuner cannot choose for (capture in progress, missing from a pinned record)."""


def default_cache_path() -> Path:
    root = os.environ.get("NNRAND_CACHE_DIR") or Path.home() / ".cache" / "nnrand"
    return Path(root) / "autotune.json"


_SOURCES_HASH: str | None = None


def kernels_hash() -> str:
    """SHA-1 (12 hex digits) of the kernels' sources, CUDA and Python (the launchers' plans, such as a
    split of the reduction, decide a variant's speed too): a changed kernel or plan invalidates the cache."""
    global _SOURCES_HASH
    if _SOURCES_HASH is None:
        h = hashlib.sha1()
        for p in sorted([*KERNELS_DIR.glob("*.cu"), *KERNELS_DIR.glob("*.cuh"), *KERNELS_DIR.glob("*.py")]):
            h.update(p.name.encode())
            h.update(p.read_bytes())
        _SOURCES_HASH = h.hexdigest()[:12]
    return _SOURCES_HASH


def environment(device: torch.device) -> dict:
    """What a timing depends on besides the configuration (TF32 and cuDNN flags included: they change
    what torch's kernel computes; so does ``NVIDIA_TF32_OVERRIDE``, which turns TF32 off inside cuDNN and
    cuBLAS whatever torch's flags say, and is recorded when set; and on CUDA, cuDNN's heuristic mode B,
    which picks torch_det's algorithms: nnrand.noise)."""
    from .noise import _tf32_flags

    env = {"torch": torch.__version__, "kernels": kernels_hash(),
           "tf32": {k: str(v) for k, v in _tf32_flags().items()}, "cudnn_enabled": bool(torch.backends.cudnn.enabled)}
    if os.environ.get("NVIDIA_TF32_OVERRIDE") is not None:   # absent: the key of caches written before it counted
        env["tf32_override"] = os.environ["NVIDIA_TF32_OVERRIDE"]
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        env.update(device=torch.cuda.get_device_name(idx), capability=f"{major}.{minor}",
                   cudnn=str(torch.backends.cudnn.version()), cuda=str(torch.version.cuda))
        from .noise import cudnn_heuristic_now

        if cudnn_heuristic_now() == "b":   # torch_det runs mode B's algorithms (absent: caches written before)
            env["cudnn_heuristic"] = "b"
        try:
            import cupy
            env["cupy"] = cupy.__version__
        except ImportError:
            env["cupy"] = None
    else:
        env.update(device="cpu", cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def env_key(env: Mapping) -> str:
    return json.dumps(dict(sorted(env.items())), sort_keys=True)


def _dims(t) -> str:
    return "x".join(str(int(n)) for n in t)


def conv_key(op: str, x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, groups: int, layout: str) -> str:
    """The configuration of one conv call (a backward gradient, or ``conv_fwd``), as the cache and the run
    record name it."""
    return (f"{op} x={_dims(x.shape)} w={_dims(w.shape)} s={_dims(stride)} p={_dims(padding)} "
            f"d={_dims(dilation)} g={int(groups)} {layout} {str(x.dtype).removeprefix('torch.')}")


def time_us(fn: Callable[[], object], device: torch.device, calls: int = CALLS, repeats: int = REPEATS) -> float:
    """Median time per call of ``fn`` in microseconds, after one warm-up call: on CUDA the GPU's time alone
    (``events_us`` with the calls queued behind a sleep), so the choice follows the kernels and not the
    host's speed at queueing them (which a CUDA-graph step does not pay, and which, on a small shape,
    would otherwise decide the timing: a candidate of three launches from Python against one from C++)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return events_us(fn, device, calls, repeats, queued=True)


SLEEP_CYCLES = 1 << 21          # GPU clock cycles the queued timing first sleeps (about 1 ms)
SLEEP_CYCLES_MAX = 1 << 26      # about 40 ms: no conv candidate takes the host that long to queue


def events_us(fn: Callable[[], object], device: torch.device, calls: int, repeats: int, *,
              queued: bool = False) -> float:
    """Median device time per call in microseconds: CUDA events around ``calls`` back-to-back calls,
    ``repeats`` times. Unqueued, the host queues the next call while the GPU runs the previous one, so host
    time shows wherever it exceeds the kernels'. ``queued``: the stream first sleeps (torch.cuda._sleep)
    while the host queues every call, so the events time the GPU's work alone; where the sleep ended before
    the last call was queued (the start event had already completed), the repeat is run again with twice
    the sleep, from SLEEP_CYCLES at every call of this function (a slow moment of the host lengthens one
    timing's sleeps, not the later ones'). A ``fn`` that waits for the GPU itself can never be queued
    behind a sleep: past SLEEP_CYCLES_MAX its repeats are timed unqueued, with a warning that its time
    includes the host's."""
    torch.cuda.synchronize(device)
    times = []
    cycles = max(1, SLEEP_CYCLES)
    with torch.cuda.device(device):
        for _ in range(repeats):
            while True:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if queued:
                    torch.cuda._sleep(cycles)
                a.record()
                for _ in range(calls):
                    fn()
                b.record()
                if not queued or not a.query():
                    break
                b.synchronize()   # the GPU woke before the host was done: sleep longer
                if cycles >= SLEEP_CYCLES_MAX:
                    warnings.warn(f"nnrand autotune: a candidate ({getattr(fn, '__name__', fn)!r}) waits for the GPU "
                                  "while it is queued, so it is timed with the host's time included, unlike the "
                                  "others", RuntimeWarning, stacklevel=3)
                    queued = False
                    continue
                cycles = min(2 * cycles, SLEEP_CYCLES_MAX)
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def _read_cache(path: Path) -> dict:
    """The cache file's entries, ``{env_key: {conv_key: entry}}``; unreadable or foreign files are
    ignored with a warning (and replaced at the next write)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"nnrand autotune cache {path} is unreadable ({e}); timing again", RuntimeWarning, stacklevel=3)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        version = data.get("version") if isinstance(data, dict) else None
        warnings.warn(f"nnrand autotune cache {path} has another format (version {version!r}, expected "
                      f"{CACHE_VERSION}); timing again", RuntimeWarning, stacklevel=3)
        return {}
    return data["entries"]


def _write_cache(path: Path, entries: dict) -> None:
    runio.write_json(path, {"version": CACHE_VERSION, "entries": entries})


class Tuner:
    """Chooses, caches and records per-configuration candidates.

    ``cache``: the cache file (default :func:`default_cache_path`), or None for none. ``pinned``: a
    record from :meth:`record` (or its ``choices`` mapping) whose choices win over cache and timing.
    ``pinned_only``: a configuration missing from ``pinned`` raises. ``timer``: ``(fn, device) -> us``,
    :func:`time_us` by default (tests inject their own)."""

    def __init__(self, cache: str | os.PathLike | None = "default", pinned: Mapping | None = None, *,
                 pinned_only: bool = False, timer: Callable[[Callable[[], object], torch.device], float] | None = None):
        self.cache = default_cache_path() if cache == "default" else (Path(cache) if cache is not None else None)
        pinned = dict(pinned or {})
        self.pinned: dict[str, str] = {k: (v["choice"] if isinstance(v, Mapping) else v)
                                       for k, v in pinned.get("choices", pinned).items()}
        self.pinned_only = pinned_only
        if pinned_only and not self.pinned:
            raise AutotuneError("pinned_only needs a record with choices to pin")
        self.timer = timer or time_us
        self.choices: dict[str, dict] = {}
        self.env: dict | None = None
        self._lock = threading.Lock()

    def choose(self, key: str, device: torch.device, candidates: Mapping[str, Callable[[], object]]) -> str:
        """The candidate to run for ``key``: pinned, else this process's earlier choice, else the disk
        cache's, else the fastest by timing (then cached). ``candidates`` maps name -> zero-argument call;
        a call that raises ``KernelArgumentError`` (the shape is not for it) drops out. An earlier or
        cached choice counts only if it was made among the same candidates (a routing with deterministic
        mode off offers no ``torch_det``, and must not reuse a choice that beat it, or be reused by one)."""
        offered = sorted(candidates)
        with self._lock:
            memo = self.choices.get(key)
            if memo is not None and (memo.get("candidates") == offered or memo["source"] == "pinned"):
                return self._check_pinned(key, memo["choice"], candidates) if memo["source"] == "pinned" \
                    else memo["choice"]
            if self.env is None:
                self.env = environment(device)
            if key in self.pinned:
                name = self._check_pinned(key, self.pinned[key], candidates)
                self.choices[key] = {"choice": name, "source": "pinned"}
                return name
            if self.pinned_only:
                raise AutotuneError(f"{key} is not in the pinned autotune record (--autotune-plan or the "
                                    "checkpoint's); a plan holds the shapes of the run that made it: the same "
                                    "model, image size and images per process (and --micro-batch with "
                                    "--world-invariant)")
            entry = self._cached(key, device, offered)
            if entry is not None and entry.get("candidates") == offered and entry.get("choice") in candidates:
                self.choices[key] = {**entry, "source": "cache"}
                return entry["choice"]
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise AutotuneError(f"{key} was first met while a CUDA graph was being captured, where nothing can "
                                    "be timed; run one eager step before capturing")
            entry = {**self._time(key, device, candidates), "candidates": offered}
            entry, source = self._store(key, device, entry)
            self.choices[key] = {**entry, "source": source}
            return entry["choice"]

    @staticmethod
    def _check_pinned(key: str, name: str, candidates) -> str:
        if name not in candidates:
            raise AutotuneError(f"{key}: the pinned choice {name!r} is not a deterministic candidate here "
                                f"(candidates: {', '.join(candidates)})")
        return name

    def _time(self, key: str, device: torch.device, candidates: Mapping[str, Callable[[], object]]) -> dict:
        from kernels import KernelArgumentError

        times: dict[str, float] = {}
        for name, fn in candidates.items():
            try:
                times[name] = float(self.timer(fn, device))
            except KernelArgumentError:
                continue
        if not times:
            raise AutotuneError(f"{key}: no deterministic candidate runs this configuration "
                                f"(tried {', '.join(candidates)})")
        best = min(times, key=lambda n: (times[n], n))  # ties: by name, so the choice does not depend on order
        return {"choice": best, "times_us": {n: round(t, 3) for n, t in times.items()}}

    @staticmethod
    def _cache_key(key: str, offered: list[str]) -> str:
        return f"{key} among {','.join(offered)}"   # one entry per candidate set

    def _cached(self, key: str, device: torch.device, offered: list[str]) -> dict | None:
        if self.cache is None:
            return None
        return _read_cache(self.cache).get(env_key(environment(device)), {}).get(self._cache_key(key, offered))

    def _store(self, key: str, device: torch.device, entry: dict) -> tuple[dict, str]:
        """Write ``entry`` unless another process stored a choice for ``key`` among the same candidates
        while this one was timing: then that one is adopted (the first writer wins, so processes sharing
        a cache converge on one choice). Returns the entry in effect and its source."""
        if self.cache is None:
            return entry, "timed"
        entries = _read_cache(self.cache)
        mine = entries.setdefault(env_key(environment(device)), {})
        ckey = self._cache_key(key, entry["candidates"])
        other = mine.get(ckey)
        if other is not None and other.get("candidates") == entry["candidates"] and other.get("choice"):
            return other, "cache"
        mine[ckey] = entry
        try:
            _write_cache(self.cache, entries)
        except OSError as e:
            warnings.warn(f"nnrand autotune cache {self.cache} cannot be written ({e}); the choice holds for this "
                          "process only", RuntimeWarning, stacklevel=3)
        return entry, "timed"

    def record(self) -> dict:
        """The choices made so far and the environment they were made in (what a run stores)."""
        with self._lock:
            return {"env": self.env, "choices": {k: dict(v) for k, v in sorted(self.choices.items())}}

    def counts(self) -> dict[str, dict[str, int]]:
        """Per op, how many configurations chose each candidate."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            choices = dict(self.choices)
        for key, entry in choices.items():
            op = key.split(" ", 1)[0]
            out.setdefault(op, {})
            out[op][entry["choice"]] = out[op].get(entry["choice"], 0) + 1
        return out


def read_record(path: str | os.PathLike) -> dict:
    """The autotune record in a run's ``<member>/config.json`` (its ``autotune`` entry), or a bare record
    (``{"env": ..., "choices": ...}``), checked for shape."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise AutotuneError(f"--autotune-plan {p}: no such file") from None
    except (OSError, ValueError) as e:
        raise AutotuneError(f"--autotune-plan {p}: not a readable JSON file ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("autotune"), dict):
        data = data["autotune"]
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, dict) or not all(isinstance(v, dict) and isinstance(v.get("choice"), str)
                                                for v in choices.values()):
        raise AutotuneError(f"--autotune-plan {p}: no autotune record in it (a member's config.json of a "
                            "fastest-deterministic run has one under 'autotune')")
    if not choices:
        raise AutotuneError(f"--autotune-plan {p}: the record holds no choices (the run made none yet)")
    return data
