"""Empirical determinism audit of aten ops on the current device.

    python -m nnrand.audit                                   # every op, 50 repeats, full scale on a GPU
    python -m nnrand.audit --scale quick --repeats 5         # about a minute on a laptop CPU
    python -m nnrand.audit --ops 'conv2d*,interpolate*'      # a subset (entry or family names, globs)
    python -m nnrand.audit render                            # re-render the markdown from the CSV

For every entry of ``audit_entries`` (an aten op on a realistic shape: PyTorch's documented
nondeterministic ops, the ops nnrand routes or guards, and common ops believed deterministic) and every
phase of it (``forward``, and ``backward:<grads>`` where it has a backward), the audit runs N repeats on
identical inputs and records, one CSV row per (entry, phase):

* **default**: PyTorch's default flags (deterministic algorithms off, ``cudnn.deterministic`` off,
  ``cudnn.benchmark`` as ``--cudnn-benchmark`` says, off by default): distinct output hashes and the
  median time per call.
* **deterministic**: ``torch.use_deterministic_algorithms(True)`` (``warn_only=False``, PyTorch's default
  filling of uninitialised memory), ``cudnn.deterministic=True``, ``cudnn.benchmark=False``: whether
  PyTorch raises (first line of its message), warns, or runs, and then distinct hashes and the time ratio to
  default. A backward phase runs only its backward in this mode, on the graph default mode built (a forward
  that refuses is the forward row's verdict, not its gradients').
* **nnrand**: where the kernel registry has a deterministic variant for the phase (``NNRAND_OPS``, which
  also names registry ops not written yet; those are skipped until they exist), the fastest of them on
  this device, its distinct hashes and its time ratio to PyTorch's default.

TF32 is off in every mode (float32 means float32). ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (PyTorch's
reproducibility notes) is set where unset before CUDA initialises, for the whole run: cuBLAS and torch read
it once, at the first cuBLAS call, so setting it for deterministic mode alone would come too late; the value
is recorded in every row. A backward phase builds the forward graph once and repeats
``torch.autograd.grad`` with a fixed, seeded upstream gradient (``retain_graph``), so it measures the
backward alone. Inputs are drawn on the CPU from the entry's seed and moved to the device,
so they are bitwise the same on every device.

Hashes: :func:`digest` reduces each output on its device to two 64-bit universal hashes of its bytes
(wrapping integer sums of the 32-bit words times fixed pseudo-random weights; integer addition is
associative, so the hash itself is exact and order-free) and hashes those, with dtype and shape, with
BLAKE2 on the host: one transfer and one sync per repeat, the same digest on any device for the same bits.

Timing: on CUDA, CUDA events around each of up to 20 calls queued back to back behind a spin kernel
after 3 warm-up calls, median (where the GPU reached a call before the host was done queueing it, the spin
is retried longer; past that the row notes that its times may include host time); on the CPU, the wall
clock of the hashed repeats, median.

Resumable: rows already in the CSV for this (entry, phase, scale, device, git SHA) measured under the same
repeats, ``cudnn.benchmark``, torch, CUDA, cuDNN, driver and NVRTC versions (on the CPU: torch, its thread
count and CPU capability) are not rerun; rows with an error (in default mode, deterministic mode or nnrand's
part) are. After every row the CSV is re-read, merged and written atomically under a lock (two audits
writing one CSV keep each other's rows), then the markdown is rendered from it. The markdown is
rendered from the CSV only (``render``): on the latest row's device and scale, each phase's latest row by
its date, whatever its commit (``--ops`` at a new commit replaces those phases' rows and keeps the others',
each row naming its commit; the latest row is shown even where it is an error, and a phase no longer
audited keeps its last row until the CSV loses it), with a summary of surprises: ops PyTorch flags that
were repeatable here, and ops it does not flag that were not. Its *route* column is the one column computed
at rendering: what ``nnrand.use_kernels("tree")`` does with the phase in the rendering code (:func:`route`).

Outputs (``--out`` for the CSV; the markdown goes to ``reports/<stem>.md`` beside ``reports/results``):
``reports/results/audit.csv`` and ``reports/audit.md`` on a GPU at full scale, ``audit_quick.*`` on a
GPU at quick scale, ``audit_cpu.*`` on the CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import hashlib
import math
import os
import re
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from nnrand import fingerprint as envfp
from nnrand import timing
from nnrand import runio
from nnrand.noise import set_deterministic_algorithms, tf32_new_api

REPO = Path(__file__).resolve().parent.parent
SCALES = ("quick", "full")
MODES = ("default", "deterministic")
DEFAULT_REPEATS = 50
WARMUP = 3                 # calls before timing on CUDA (cuDNN plans, allocator, NVRTC compiles)
CUDA_TIMED_CALLS = 20      # at most this many event-timed calls per mode on CUDA
NNRAND_SELECT_CALLS = 3    # timed calls per deterministic variant when picking the fastest


class AuditError(RuntimeError):
    """An entry that could not be audited (or an unknown ``--ops`` name); the message names the entry,
    the phase and the aten op."""


# --------------------------------------------------------------------------------------------------
# Hashes


_MASK64 = (1 << 64) - 1
_WEIGHT_CACHE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _s64(v: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch multiplies with (two's complement)."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(i: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function of int64 ``i`` (wrapping arithmetic): fixed pseudo-random weights that
    are the same on every device, with no generator involved."""
    z = (i + 1) * _s64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _s64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def _weights(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (str(device), 0)
    have = _WEIGHT_CACHE.get(key)
    if have is None or have[0].numel() < n:
        i = torch.arange(max(n, 1 << 12), dtype=torch.int64, device=device)
        have = (splitmix64(i), splitmix64(i + (1 << 40)))
        _WEIGHT_CACHE[key] = have
    return have[0][:n], have[1][:n]


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _device_hash(t: torch.Tensor) -> torch.Tensor:
    """(2,) int64 on ``t``'s device: sum_i w_i * word_i (wrapping) for two weight sequences, over the
    tensor's elements in logical order viewed as integers of their own width. Two results that differ
    in any bit give the same pair with probability about 2^-128 (the weights are fixed, the differences
    are not chosen against them)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    if t.element_size() == 8:   # two 4-byte halves: a product of a 64-bit word wraps away its high bits
        t = t.view(torch.int32)
    words = t.view(_INT_VIEW[t.element_size()]).to(torch.int64)
    w1, w2 = _weights(words.numel(), words.device)
    return torch.stack(((words * w1).sum(), (words * w2).sum()))


def _flat_outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat_outputs(o)]
    if out is None:
        return []
    raise TypeError(f"an audited op returned {type(out).__name__}, expected tensors")


def digest(out) -> str:
    """16 hex digits naming the exact bytes (and dtypes and shapes) of a tensor or a tuple of tensors:
    one device-to-host transfer."""
    ts = _flat_outputs(out)
    h = hashlib.blake2b(digest_size=8)
    if not ts:
        return h.hexdigest()
    sums = torch.cat([_device_hash(t) for t in ts]).cpu()  # the one sync of a repeat
    for t in ts:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
    h.update(sums.numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Global flags, always restored


def flag_state() -> dict:
    """Every global this module changes, as a comparable dict (tests check it is unchanged)."""
    from torch.utils import deterministic as det

    cudnn = torch.backends.cudnn
    state = {"algorithms": torch.are_deterministic_algorithms_enabled(),
             "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
             "fill_uninitialized_memory": det.fill_uninitialized_memory,
             "cudnn_deterministic": cudnn.deterministic, "cudnn_benchmark": cudnn.benchmark,
             "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    if tf32_new_api():
        state["matmul_prec"] = torch.backends.cuda.matmul.fp32_precision
        state["conv_prec"] = cudnn.conv.fp32_precision
    else:
        state["matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
        state["cudnn_tf32"] = cudnn.allow_tf32
    return state


def _restore(state: dict) -> None:
    from torch.utils import deterministic as det

    cudnn = torch.backends.cudnn
    set_deterministic_algorithms(state["algorithms"], state["warn_only"])
    det.fill_uninitialized_memory = state["fill_uninitialized_memory"]
    cudnn.deterministic, cudnn.benchmark = state["cudnn_deterministic"], state["cudnn_benchmark"]
    if state["cublas_workspace_config"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = state["cublas_workspace_config"]
    if "matmul_prec" in state:
        torch.backends.cuda.matmul.fp32_precision = state["matmul_prec"]
        cudnn.conv.fp32_precision = state["conv_prec"]
    else:
        torch.backends.cuda.matmul.allow_tf32 = state["matmul_tf32"]
        cudnn.allow_tf32 = state["cudnn_tf32"]


@contextlib.contextmanager
def torch_flags(mode: str, *, cudnn_benchmark: bool = False) -> Iterator[None]:
    """``default``: PyTorch's defaults (deterministic algorithms off, ``cudnn.deterministic`` off),
    ``cudnn.benchmark=cudnn_benchmark``. ``deterministic``: ``use_deterministic_algorithms(True)`` (raising,
    not warn-only; PyTorch's default filling of uninitialised memory), ``cudnn.deterministic=True``,
    ``cudnn.benchmark=False`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset (PyTorch's
    reproducibility notes). TF32 off in both. Everything is put back on exit, errors included."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    saved = flag_state()
    cudnn = torch.backends.cudnn
    try:
        if "matmul_prec" in saved:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            cudnn.conv.fp32_precision = "ieee"
        else:
            torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = False
        det = mode == "deterministic"
        if det and saved["cublas_workspace_config"] is None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        cudnn.deterministic = det
        cudnn.benchmark = False if det else cudnn_benchmark
        set_deterministic_algorithms(det, False)
        if det:   # PyTorch's default in its deterministic mode, whatever the caller set (restored on exit)
            from torch.utils import deterministic as det_flags

            det_flags.fill_uninitialized_memory = True
        yield
    finally:
        _restore(saved)


# --------------------------------------------------------------------------------------------------
# Entries: an aten op on one realistic shape


# PyTorch's documentation of torch.use_deterministic_algorithms: which ops raise in deterministic mode and
# which switch to a deterministic alternative, on which device, in which pass. The entries' flags are that
# documentation as of this torch version (each row records it); tests check them against the installed
# torch's docstring through DOC_ITEMS.
DOC_FLAGS_TORCH = "2.13"
RAISES, DET_ALT = "raises", "det-alt"
# the installed torch's (major, minor): a few flags changed between versions (torch 2.11's documentation
# says MaxPool3d's CUDA backward raises; 2.13's names its deterministic alternative)
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@dataclass(frozen=True)
class DocFlag:
    kind: str                  # RAISES or DET_ALT
    device: str = "cuda"       # "cuda", "cpu" or "any"
    passes: str = "backward"   # "forward", "backward" or "both"

    def applies(self, device_type: str, phase: str) -> bool:
        dev = self.device == "any" or self.device == device_type
        pas = self.passes == "both" or (phase == "forward") == (self.passes == "forward")
        return dev and pas


# What each entry is in that docstring: (the class or function a bullet names, a phrase of the bullet's
# condition that the entry's call meets; "" for any bullet of that name). Keyed by entry name, else family.
DOC_ITEMS: dict[str, tuple[str, str]] = {
    "conv2d": ("torch.nn.Conv2d", ""), "conv2d_grouped": ("torch.nn.Conv2d", ""),
    "conv_transpose2d": ("torch.nn.ConvTranspose2d", ""), "linear": ("torch.nn.Linear", ""),
    "bmm": ("torch.bmm", "dense-dense"),   # the documented bmm is sparse-dense
    "sdpa": ("torch.nn.functional.scaled_dot_product_attention", ""), "softmax": ("torch.softmax", ""),
    "log_softmax": ("torch.log_softmax", ""), "layer_norm": ("torch.nn.LayerNorm", ""),
    "batch_norm": ("torch.nn.BatchNorm2d", ""), "group_norm": ("torch.nn.GroupNorm", ""),
    "cross_entropy": ("torch.nn.NLLLoss", ""), "cross_entropy2d": ("torch.nn.NLLLoss", ""),  # log_softmax + NLL
    "ctc_loss": ("torch.nn.CTCLoss", ""), "sum": ("torch.sum", ""), "mean": ("torch.mean", ""),
    "vector_norm": ("torch.linalg.vector_norm", ""), "cumsum": ("torch.cumsum", ""), "sort": ("torch.sort", ""),
    "topk": ("torch.topk", ""), "median": ("torch.median", "indices"), "histc": ("torch.histc", ""),
    "bincount": ("torch.bincount", "weights"), "embedding": ("torch.nn.Embedding", ""),
    "embedding_bag.recsys_sum": ("torch.nn.EmbeddingBag", "mode='sum'"),
    "embedding_bag.recsys_max": ("torch.nn.EmbeddingBag", "mode='max'"),
    "index_add": ("torch.index_add", ""), "scatter_add": ("torch.Tensor.scatter_add_", ""),
    "scatter_reduce_sum": ("torch.Tensor.scatter_reduce", "'sum'"),
    "scatter_reduce_mean": ("torch.Tensor.scatter_reduce", "'mean'"),
    "scatter_reduce_prod": ("torch.Tensor.scatter_reduce", "'prod'"),
    "scatter_reduce_amax": ("torch.Tensor.scatter_reduce", "'amax'"),
    "scatter": ("torch.Tensor.scatter", "src"), "index_select": ("torch.index_select", ""),
    "getitem_tensor": ("torch.Tensor.__getitem__", ""), "gather": ("torch.gather", ""),
    "index_put_accumulate": ("torch.Tensor.index_put", "accumulate=True"),
    "index_put": ("torch.Tensor.index_put", "accumulate=False"), "index_copy": ("torch.Tensor.index_copy", ""),
    "put.flat_acc1": ("torch.Tensor.put_", "accumulate=True"),
    "put.flat_acc0": ("torch.Tensor.put_", "accumulate=False"),
    "repeat_interleave": ("torch.repeat_interleave", ""), "max_pool2d": ("torch.nn.MaxPool2d", ""),
    "avg_pool2d": ("torch.nn.AvgPool2d", ""), "max_pool3d": ("torch.nn.MaxPool3d", ""),
    "avg_pool3d": ("torch.nn.AvgPool3d", ""), "adaptive_avg_pool2d": ("torch.nn.AdaptiveAvgPool2d", ""),
    "adaptive_avg_pool3d": ("torch.nn.AdaptiveAvgPool3d", ""),
    "adaptive_max_pool2d": ("torch.nn.AdaptiveMaxPool2d", ""),
    "adaptive_max_pool3d": ("torch.nn.AdaptiveMaxPool3d", ""),
    "fractional_max_pool2d": ("torch.nn.FractionalMaxPool2d", ""),
    "fractional_max_pool3d": ("torch.nn.FractionalMaxPool3d", ""),
    "max_unpool2d": ("torch.nn.MaxUnpool2d", ""), "max_unpool3d": ("torch.nn.MaxUnpool3d", ""),
    "interpolate_bilinear": ("torch.nn.functional.interpolate", "``bilinear``"),
    "interpolate_bilinear_aa": ("torch.nn.functional.interpolate", "``bilinear``"),   # antialias is mode bilinear
    "interpolate_bicubic": ("torch.nn.functional.interpolate", "``bicubic``"),
    "interpolate_linear": ("torch.nn.functional.interpolate", "``linear``"),
    "interpolate_trilinear": ("torch.nn.functional.interpolate", "``trilinear``"),
    "interpolate_nearest": ("torch.nn.functional.interpolate", "``nearest``"),
    "reflection_pad1d": ("torch.nn.ReflectionPad1d", ""), "reflection_pad2d": ("torch.nn.ReflectionPad2d", ""),
    "reflection_pad3d": ("torch.nn.ReflectionPad3d", ""), "replication_pad2d": ("torch.nn.ReplicationPad2d", ""),
    "grid_sample": ("torch.nn.functional.grid_sample", ""), "grid_sample3d": ("torch.nn.functional.grid_sample", ""),
    "unfold": ("torch.nn.functional.unfold", ""),
}


@dataclass(frozen=True)
class DocBullet:
    kind: str       # RAISES or DET_ALT
    name: str       # torch.nn.Conv2d, torch.Tensor.put_, ...
    text: str       # the condition, whitespace collapsed


def documented_flags(doc: str | None = None) -> list[DocBullet]:
    """The bullets of ``torch.use_deterministic_algorithms``'s docstring (the installed torch's by default):
    the ops that switch to a deterministic algorithm (DET_ALT) and those that raise (RAISES)."""
    text = " ".join((doc if doc is not None else torch.use_deterministic_algorithms.__doc__ or "").split())
    alt = text.partition("will act deterministically when ``mode=True``:")[2]
    raises = alt.partition("will throw a :class:`RuntimeError` when ``mode=True``:")[2].partition("In addition")[0]
    alt = alt.partition("The following normally-nondeterministic")[0]
    out = []
    for kind, part in ((DET_ALT, alt), (RAISES, raises)):
        for item in re.split(r"(?:^|\s)\*\s(?=:(?:class|func):)", part)[1:]:
            m = re.match(r":(?:class|func):`([^`]+)`\s*(.*)", item.strip())
            if m:
                out.append(DocBullet(kind, m.group(1), m.group(2)))
    return out


def _doc_bullet_flag(b: DocBullet) -> tuple[str, str, str]:
    """(kind, device, pass) a bullet says: ``backward`` where it names differentiation, ``called`` (the
    forward, and a table's ``both``) where it names the call."""
    t = b.text
    device = "any" if "CPU or CUDA" in t else "cuda" if "CUDA" in t else "cpu" if "CPU" in t else "any"
    return b.kind, device, "backward" if "differentiate" in t or "requires grad" in t else "called"


def doc_flag_mismatches(entries: Sequence[Entry], doc: str | None = None) -> list[str]:
    """Entries whose flags differ from what the docstring's bullets say of them (DOC_ITEMS says which
    bullets are theirs), and entries DOC_ITEMS does not place; one line each."""
    bullets = documented_flags(doc)
    out = []
    for e in entries:
        item = DOC_ITEMS.get(e.name) or DOC_ITEMS.get(e.family)
        if item is None:
            out.append(f"{e.name}: not in DOC_ITEMS")
            continue
        said = {_doc_bullet_flag(b) for b in bullets if b.name == item[0] and item[1] in b.text}
        flags = e.flag if isinstance(e.flag, tuple) else (e.flag,) if e.flag else ()
        have = {(f.kind, f.device, "backward" if f.passes == "backward" else "called") for f in flags}
        if said != have:
            out.append(f"{e.name} ({item[0]}{' ' + item[1] if item[1] else ''}): the table says "
                       f"{sorted(have) or 'nothing'}, the documentation {sorted(said) or 'nothing'}")
    return out


@dataclass(frozen=True)
class Entry:
    """One op on one shape. ``make(g)`` draws the inputs on the CPU from generator ``g`` (a dict of
    tensors and plain parameters); ``forward(p)`` runs the op; ``grads`` maps backward phase labels to
    the input names differentiated (each its own phase, so each gradient's kernel is seen alone)."""

    name: str
    family: str
    aten: str                              # forward aten op (as the routing tables name it)
    shape: str                             # human-readable shape
    make: Callable[[torch.Generator], dict]
    forward: Callable[[dict], object]
    grads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    aten_backward: str | None = None
    flag: DocFlag | tuple[DocFlag, ...] | None = None   # the first that applies to (device, phase) counts
    seed: int = 0
    # the forward's aten op whose CUDA route counts, where it differs from ``aten`` (cuDNN's BatchNorm on an
    # NCHW input); None: ``aten``'s, also where CUDA dispatches another op whose handler gives the call back
    # to torch (cudnn_batch_norm on a channels_last input)
    aten_cuda: str | None = None

    def phases(self) -> list[str]:
        return ["forward"] + [f"backward:{k}" for k in self.grads]

    def aten_on(self, phase: str, device_type: str = "cpu") -> str | None:
        """The aten op ``phase`` dispatches on the device: the forward's (``aten_cuda`` on CUDA where named),
        a backward phase's ``aten_backward`` (None where not named)."""
        if phase != "forward":
            return self.aten_backward
        return self.aten_cuda if device_type == "cuda" and self.aten_cuda else self.aten


def _phase_grads(entry: Entry, phase: str) -> tuple[str, ...]:
    return entry.grads[phase.split(":", 1)[1]]


# --------------------------------------------------------------------------------------------------
# nnrand's registry ops per (family, phase), with the adapter from the entry's inputs, forward output
# and upstream gradient to the variant's arguments. Registry ops not written yet are named here so that
# they are audited as soon as they exist.


def _conv_geom(p: dict) -> dict:
    return dict(stride=p["stride"], padding=p["padding"], dilation=p["dilation"])


def _a_conv_wgrad(p, y, g):
    return (p["x"], g), dict(kernel_size=tuple(p["weight"].shape[-2:]), **_conv_geom(p))


def _a_conv_dgrad(p, y, g):
    return (p["weight"], g), dict(input_size=tuple(p["x"].shape[-2:]), **_conv_geom(p))


def _a_conv_wgrad_grouped(p, y, g):
    return (p["x"], g), dict(kernel_size=tuple(p["weight"].shape[-2:]), groups=p["groups"], **_conv_geom(p))


def _a_conv_dgrad_grouped(p, y, g):
    return (p["weight"], g), dict(input_size=tuple(p["x"].shape[-2:]), groups=p["groups"], **_conv_geom(p))


def _a_bias_grad(p, y, g):
    return (g,), {}


def _a_bn_bwd(p, y, g):
    x = p["x"]
    dims = [0] + list(range(2, x.dim()))
    mean = x.mean(dims)
    invstd = (x.var(dims, unbiased=False) + p["eps"]).rsqrt()
    return (g, x, mean, invstd, p["weight"]), {}


def _a_bn_fwd(p, y, g):
    return (p["x"], p["weight"], p["bias"]), dict(momentum=0.1, eps=p["eps"])


def _a_maxpool_bwd(p, y, g):
    _, idx = F.max_pool2d(p["x"], p["kernel"], p["stride"], p["padding"], return_indices=True)
    return (g, idx), dict(input_size=tuple(p["x"].shape[-2:]), kernel_size=p["kernel"], stride=p["stride"],
                          padding=p["padding"])


def _a_adaptive_avg_pool2d_bwd(p, y, g):
    return (g,), dict(input_size=tuple(p["x"].shape[-2:]))


def _a_upsample_bilinear2d_bwd(p, y, g):
    return (g,), dict(input_size=tuple(p["x"].shape[-2:]), align_corners=p["align_corners"])


def _a_index_add_fwd(p, y, g):
    return (p["index"], p["src"]), dict(num_rows=p["rows"])


def _a_index_add_bwd(p, y, g):
    return (p["index"], g), dict(num_rows=p["x"].shape[0])


def _a_repeat_interleave_bwd(p, y, g):
    index = torch.repeat_interleave(torch.arange(p["x"].shape[0], device=g.device), p["repeats"])
    return (index, g), dict(num_rows=p["x"].shape[0])


def _a_scatter_add_fwd(p, y, g):
    return (p["index"], p["src"]), dict(num_rows=p["rows"])


def _a_scatter_add_bwd(p, y, g):
    return (p["index"], g), dict(num_rows=p["x"].shape[0])


def _a_embedding_bwd(p, y, g):
    return (g, p["indices"]), dict(num_weights=p["weight"].shape[0])


def _a_sum(p, y, g):
    return (p["x"].reshape(-1),), {}


NNRAND_OPS: dict[tuple[str, str], tuple[str, Callable]] = {
    ("conv2d", "backward:dW"): ("conv_wgrad", _a_conv_wgrad),
    ("conv2d", "backward:dX"): ("conv_dgrad", _a_conv_dgrad),
    ("conv2d", "backward:dB"): ("bias_grad", _a_bias_grad),
    ("conv2d_grouped", "backward:dW"): ("conv_wgrad_grouped", _a_conv_wgrad_grouped),
    ("conv2d_grouped", "backward:dX"): ("conv_dgrad_grouped", _a_conv_dgrad_grouped),
    ("conv2d_grouped", "backward:dB"): ("bias_grad", _a_bias_grad),
    ("linear", "backward:dB"): ("bias_grad", _a_bias_grad),
    ("batch_norm", "forward"): ("bn_fwd", _a_bn_fwd),
    ("batch_norm", "backward:dX,dW,dB"): ("bn_bwd", _a_bn_bwd),
    ("max_pool2d", "backward:dX"): ("maxpool_bwd", _a_maxpool_bwd),
    ("adaptive_avg_pool2d", "backward:dX"): ("adaptive_avg_pool2d_bwd", _a_adaptive_avg_pool2d_bwd),
    ("interpolate_bilinear", "backward:dX"): ("upsample_bilinear2d_bwd", _a_upsample_bilinear2d_bwd),
    ("index_add", "forward"): ("index_add", _a_index_add_fwd),
    ("index_put_accumulate", "forward"): ("index_add", _a_index_add_fwd),
    ("index_select", "backward:dX"): ("index_add", _a_index_add_bwd),
    ("getitem_tensor", "backward:dX"): ("index_add", _a_index_add_bwd),
    ("repeat_interleave", "backward:dX"): ("index_add", _a_repeat_interleave_bwd),
    ("scatter_add", "forward"): ("scatter_add", _a_scatter_add_fwd),
    ("scatter_reduce_sum", "forward"): ("scatter_add", _a_scatter_add_fwd),
    ("gather", "backward:dX"): ("scatter_add", _a_scatter_add_bwd),
    ("embedding", "backward:dW"): ("embedding_bwd", _a_embedding_bwd),
    ("sum", "forward"): ("sum", _a_sum),
}


# --------------------------------------------------------------------------------------------------
# The entry list


def _randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _zipf(g: torch.Generator, n: int, vocab: int, s: float = 1.1) -> torch.Tensor:
    """``n`` draws from a Zipf-like law over ``vocab`` ids (token and node-degree skew: hot rows collide)."""
    w = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    return torch.multinomial(w, n, replacement=True, generator=g)


def _bf16_rounded(x: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to bfloat16: the ties of logits from a bf16 model."""
    return x.to(torch.bfloat16).float()


def _conv(g, n, cin, cout, hw, k, stride=1, padding=0, dilation=1, groups=1, bias=False, channels_last=False):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = _randn(g, n, cin, hw, hw).contiguous(memory_format=fmt)
    w = _randn(g, cout, cin // groups, k, k, scale=(cin // groups * k * k) ** -0.5).contiguous(memory_format=fmt)
    return dict(x=x, weight=w, bias=_randn(g, cout) if bias else None, stride=(stride, stride),
                padding=(padding, padding), dilation=(dilation, dilation), groups=groups)


def _conv_fwd(p):
    return F.conv2d(p["x"], p["weight"], p["bias"], p["stride"], p["padding"], p["dilation"], p["groups"])


def audit_entries(scale: str = "full") -> list[Entry]:
    """Every audited (op, shape), in report order. ``quick``: small shapes for a CPU; ``full``: the
    shapes of ResNet-50/ViT-B/segmentation/GNN training on a GPU."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {', '.join(SCALES)}")
    q = scale == "quick"

    def S(quick, full):
        return quick if q else full

    E: list[Entry] = []

    def add(name, family, aten, shape, make, forward, grads=None, aten_backward=None, flag=None, aten_cuda=None):
        E.append(Entry(f"{family}.{name}", family, aten, shape, make, forward, dict(grads or {}), aten_backward, flag,
                       seed=len(E), aten_cuda=aten_cuda))

    # ---- convolutions: cuDNN (or the CPU's) conv; routed: conv_wgrad / conv_dgrad / bias_grad
    conv_flag = DocFlag(DET_ALT, "cuda", "both")
    n = S(2, 32)
    convs = [  # name, (cin, cout, hw, k, stride, padding, dilation, bias, channels_last), real layer
        ("r50_stem_7x7s2", (3, 64, S(32, 224), 7, 2, 3, 1, False, False)),
        ("r50_3x3", (S(16, 64), S(16, 64), S(16, 56), 3, 1, 1, 1, False, False)),
        ("r50_3x3_channels_last", (S(16, 64), S(16, 64), S(16, 56), 3, 1, 1, 1, False, True)),
        ("r50_3x3s2", (S(16, 128), S(16, 128), S(16, 56), 3, 2, 1, 1, False, False)),
        ("r50_1x1", (S(32, 256), S(16, 64), S(16, 56), 1, 1, 0, 1, False, False)),
        ("r50_3x3_7px", (S(32, 512), S(32, 512), S(4, 7), 3, 1, 1, 1, False, False)),
        ("vit_patch16", (3, S(32, 768), S(32, 224), 16, 16, 0, 1, True, False)),
        ("deeplab_aspp_d6", (S(16, 512), S(16, 256), S(16, 32), 3, 1, S(2, 6), S(2, 6), False, False)),
    ]
    for name, (cin, cout, hw, k, s, pad, d, bias, cl) in convs:
        nb = S(2, 8) if name.startswith("deeplab") else n
        grads = {"dX": ("x",), "dW": ("weight",), **({"dB": ("bias",)} if bias else {})}
        add(name, "conv2d", "convolution",
            f"N={nb} {cin}->{cout} {hw}x{hw} k{k} s{s} p{pad}" + (f" d{d}" if d > 1 else "") + (" NHWC" if cl else ""),
            lambda g, a=(nb, cin, cout, hw, k, s, pad, d, bias, cl): _conv(
                g, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], bias=a[8], channels_last=a[9]),
            _conv_fwd, grads, "convolution_backward", conv_flag)
    add("convnext_dw7x7", "conv2d_grouped", "convolution",
        f"N={n} {S(16, 96)}ch {S(16, 56)}x{S(16, 56)} k7 p3 depthwise",
        lambda g: _conv(g, n, S(16, 96), S(16, 96), S(16, 56), 7, 1, 3, groups=S(16, 96), bias=True), _conv_fwd,
        {"dX": ("x",), "dW": ("weight",), "dB": ("bias",)}, "convolution_backward", conv_flag)
    add("resnext_g32", "conv2d_grouped", "convolution",
        f"N={n} {S(32, 256)}->{S(32, 256)} {S(8, 28)}x{S(8, 28)} k3 p1 groups={S(8, 32)}",
        lambda g: _conv(g, n, S(32, 256), S(32, 256), S(8, 28), 3, 1, 1, groups=S(8, 32)), _conv_fwd,
        {"dX": ("x",), "dW": ("weight",)}, "convolution_backward", conv_flag)
    for name, (cin, cout, hw, k, s, pad) in [("unet_up2x2", (S(16, 256), S(8, 128), S(8, 32), 2, 2, 0)),
                                             ("fcn_up4x4s2", (S(8, 128), S(4, 64), S(8, 32), 4, 2, 1))]:
        add(name, "conv_transpose2d", "convolution", f"N={S(2, 16)} {cin}->{cout} {hw}x{hw} k{k} s{s} p{pad}",
            lambda g, a=(cin, cout, hw, k, s, pad): dict(
                x=_randn(g, S(2, 16), a[0], a[2], a[2]), weight=_randn(g, a[0], a[1], a[3], a[3], scale=0.1),
                stride=a[4], padding=a[5]),
            lambda p: F.conv_transpose2d(p["x"], p["weight"], None, p["stride"], p["padding"]),
            {"dX": ("x",), "dW": ("weight",)}, "convolution_backward", conv_flag)

    # ---- dense layers, attention, normalisation, losses (believed deterministic)
    tok, dm = S(64, 32 * 197), S(64, 768)
    add("vit_mlp_fc1", "linear", "addmm", f"{tok}x{dm} -> {4 * dm}",
        lambda g: dict(x=_randn(g, tok, dm), weight=_randn(g, 4 * dm, dm, scale=dm ** -0.5), bias=_randn(g, 4 * dm)),
        lambda p: F.linear(p["x"], p["weight"], p["bias"]),
        {"dX": ("x",), "dW": ("weight",), "dB": ("bias",)}, "mm")
    bh, L, hd = S(4, 32 * 12), S(33, 197), 64
    add("vit_attn_scores", "bmm", "bmm", f"{bh}x{L}x{hd} @ {bh}x{hd}x{L}",
        lambda g: dict(a=_randn(g, bh, L, hd), b=_randn(g, bh, hd, L)), lambda p: torch.bmm(p["a"], p["b"]),
        {"dA,dB": ("a", "b")}, "bmm")
    for dt in (torch.float32, torch.bfloat16):
        nb, heads = S(2, 32), S(2, 12)
        add(f"vit_{str(dt)[6:]}", "sdpa", "scaled_dot_product_attention",
            f"N={nb} heads={heads} L={L} d={hd} {str(dt)[6:]}",
            lambda g, dt=dt, nb=nb, heads=heads: {k: _randn(g, nb, heads, L, hd).to(dt) for k in "qkv"},
            lambda p: F.scaled_dot_product_attention(p["q"], p["k"], p["v"]),
            {"dQ,dK,dV": ("q", "k", "v")}, "_scaled_dot_product_*_attention_backward")
    add("vit_attn", "softmax", "_softmax", f"{S(2, 32)}x{S(2, 12)}x{L}x{L} dim=-1",
        lambda g: dict(x=_randn(g, S(2, 32), S(2, 12), L, L)), lambda p: torch.softmax(p["x"], -1),
        {"dX": ("x",)}, "_softmax_backward_data")
    add("lm_logits", "log_softmax", "_log_softmax", f"{S(64, 4096)}x{S(1000, 32000)}",
        lambda g: dict(x=_randn(g, S(64, 4096), S(1000, 32000))), lambda p: torch.log_softmax(p["x"], -1),
        {"dX": ("x",)}, "_log_softmax_backward_data")
    add("vit", "layer_norm", "native_layer_norm", f"{S(2, 32)}x{L}x{dm}",
        lambda g: dict(x=_randn(g, S(2, 32), L, dm), weight=1 + _randn(g, dm, scale=0.1), bias=_randn(g, dm, scale=0.1)),
        lambda p: F.layer_norm(p["x"], p["x"].shape[-1:], p["weight"], p["bias"]),
        {"dX": ("x",), "dW,dB": ("weight", "bias")}, "native_layer_norm_backward")
    for name, cl in (("r50_64ch", False), ("r50_64ch_channels_last", True)):
        c, hw = S(16, 64), S(16, 56)
        add(name, "batch_norm", "native_batch_norm", f"N={n} {c}ch {hw}x{hw} train" + (" NHWC" if cl else ""),
            lambda g, c=c, hw=hw, cl=cl: dict(
                x=_randn(g, n, c, hw, hw).contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format),
                weight=1 + _randn(g, c, scale=0.1), bias=_randn(g, c, scale=0.1), eps=1e-5),
            lambda p: F.batch_norm(p["x"], None, None, p["weight"], p["bias"], True, 0.1, p["eps"]),
            {"dX,dW,dB": ("x", "weight", "bias")}, "native_batch_norm_backward",
            # CUDA runs cuDNN's BatchNorm, whose NCHW forward the routing takes (channels_last: cuDNN's BatchNorm
            # too, left to cuDNN by the routing)
            aten_cuda=None if cl else "cudnn_batch_norm")
    add("seg_32groups", "group_norm", "native_group_norm", f"N={S(2, 16)} {S(32, 256)}ch {S(16, 64)}x{S(16, 64)} G=32",
        lambda g: dict(x=_randn(g, S(2, 16), S(32, 256), S(16, 64), S(16, 64)), weight=1 + _randn(g, S(32, 256), scale=0.1),
                       bias=_randn(g, S(32, 256), scale=0.1)),
        lambda p: F.group_norm(p["x"], 32, p["weight"], p["bias"]),
        {"dX": ("x",), "dW,dB": ("weight", "bias")}, "native_group_norm_backward")
    add("imagenet", "cross_entropy", "nll_loss_forward", f"{S(64, 256)}x1000 mean",
        lambda g: dict(x=_randn(g, S(64, 256), 1000), target=torch.randint(0, 1000, (S(64, 256),), generator=g)),
        lambda p: F.cross_entropy(p["x"], p["target"]), {"dX": ("x",)}, "nll_loss_backward",
        DocFlag(RAISES, "cuda", "both"))
    add("seg_21cls", "cross_entropy2d", "nll_loss2d_forward", f"N={S(2, 8)} 21x{S(32, 256)}x{S(32, 256)} mean",
        lambda g: dict(x=_randn(g, S(2, 8), 21, S(32, 256), S(32, 256)),
                       target=torch.randint(0, 21, (S(2, 8), S(32, 256), S(32, 256)), generator=g)),
        lambda p: F.cross_entropy(p["x"], p["target"]), {"dX": ("x",)}, "nll_loss2d_backward",
        DocFlag(RAISES, "cuda", "both"))
    T, nb, C, Ls = S(50, 200), S(4, 16), 32, S(10, 50)
    add("speech", "ctc_loss", "_ctc_loss", f"T={T} N={nb} C={C} target={Ls}",
        lambda g: dict(x=torch.log_softmax(_randn(g, T, nb, C), -1), target=torch.randint(1, C, (nb, Ls), generator=g),
                       il=torch.full((nb,), T, dtype=torch.long), tl=torch.full((nb,), Ls, dtype=torch.long)),
        lambda p: F.ctc_loss(p["x"], p["target"], p["il"], p["tl"]), {"dX": ("x",)}, "_ctc_loss_backward",
        DocFlag(RAISES))

    # ---- reductions, scans, sorting
    add("flat", "sum", "sum", f"{S(1 << 18, 1 << 26)} floats",
        lambda g: dict(x=_randn(g, S(1 << 18, 1 << 26))), lambda p: p["x"].sum())
    add("global_avgpool", "mean", "mean", f"N={n} {S(64, 2048)}x{S(4, 7)}x{S(4, 7)} dims (2,3)",
        lambda g: dict(x=_randn(g, n, S(64, 2048), S(4, 7), S(4, 7))), lambda p: p["x"].mean((2, 3)),
        {"dX": ("x",)}, "mean_backward")
    add("grad_clip", "vector_norm", "linalg_vector_norm", f"{S(1 << 18, 25_557_032)} floats",
        lambda g: dict(x=_randn(g, S(1 << 18, 25_557_032), scale=1e-3)), lambda p: torch.linalg.vector_norm(p["x"]))
    add("rows", "cumsum", "cumsum", f"{S(8, 32)}x{S(4096, 32768)} dim=1",
        lambda g: dict(x=_randn(g, S(8, 32), S(4096, 32768))), lambda p: torch.cumsum(p["x"], 1),
        {"dX": ("x",)}, "cumsum", DocFlag(RAISES, "cuda", "both"))
    add("bf16_ties", "sort", "sort", f"{S(16, 64)}x{S(4096, 65536)} (bf16-rounded: ties)",
        lambda g: dict(x=_bf16_rounded(_randn(g, S(16, 64), S(4096, 65536)))), lambda p: torch.sort(p["x"], -1))
    add("top5_bf16_logits", "topk", "topk", f"{S(64, 4096)}x1000 k=5 (bf16-rounded: ties)",
        lambda g: dict(x=_bf16_rounded(_randn(g, S(64, 4096), 1000))), lambda p: torch.topk(p["x"], 5, -1))
    add("bf16_ties", "median", "median", f"{S(64, 4096)}x{S(256, 1024)} dim=1 (bf16-rounded: ties)",
        lambda g: dict(x=_bf16_rounded(_randn(g, S(64, 4096), S(256, 1024)))), lambda p: torch.median(p["x"], 1),
        flag=DocFlag(RAISES, "cuda", "forward"))
    add("1000_bins", "histc", "histc", f"{S(1 << 16, 1 << 24)} floats, 1000 bins",
        lambda g: dict(x=_randn(g, S(1 << 16, 1 << 24))), lambda p: torch.histc(p["x"], 1000, -4, 4),
        flag=DocFlag(RAISES, "cuda", "forward"))
    add("weighted", "bincount", "bincount", f"{S(1 << 16, 1 << 24)} ids < 1000, float weights",
        lambda g: dict(i=_zipf(g, S(1 << 16, 1 << 24), 1000), w=_randn(g, S(1 << 16, 1 << 24))),
        lambda p: torch.bincount(p["i"], p["w"], 1000), flag=DocFlag(RAISES, "cuda", "forward"))

    # ---- gathers and scatters: embeddings, GNN message passing, indexing
    V, D, ntok = S(1000, 32000), S(64, 768), S(2048, 32 * 512)
    add("lm_tokens", "embedding", "embedding", f"V={V} D={D} tokens={ntok} (Zipf)",
        lambda g: dict(weight=_randn(g, V, D), indices=_zipf(g, ntok, V)),
        lambda p: F.embedding(p["indices"], p["weight"]), {"dW": ("weight",)}, "embedding_dense_backward")
    add("small_batch", "embedding", "embedding", f"V={V} D={D} tokens=2048 (Zipf)",
        lambda g: dict(weight=_randn(g, V, D), indices=_zipf(g, 2048, V)),
        lambda p: F.embedding(p["indices"], p["weight"]), {"dW": ("weight",)}, "embedding_dense_backward")
    bags, per = S(256, 4096), 20
    for mode in ("sum", "max"):
        add(f"recsys_{mode}", "embedding_bag", "_embedding_bag", f"V={S(1000, 100_000)} D={S(32, 128)} {bags} bags x{per}",
            lambda g: dict(weight=_randn(g, S(1000, 100_000), S(32, 128)),
                           indices=_zipf(g, bags * per, S(1000, 100_000)).view(bags, per)),
            lambda p, mode=mode: F.embedding_bag(p["indices"], p["weight"], mode=mode), {"dW": ("weight",)},
            "_embedding_bag_backward", DocFlag(RAISES) if mode == "max" else None)
    nodes, edges, fd = S(1000, 100_000), S(20_000, 1_000_000), S(32, 64)

    def graph(g):  # edge list with Zipf-skewed destinations (hub nodes), messages per edge
        return dict(index=_zipf(g, edges, nodes), src=_randn(g, edges, fd), rows=nodes, x=_randn(g, nodes, fd))

    gshape = f"{nodes} nodes, {edges} edges, D={fd}"
    add("gnn", "index_add", "index_add", gshape, graph,
        lambda p: torch.index_add(p["x"].new_zeros(p["rows"], p["src"].shape[1]), 0, p["index"], p["src"]),
        flag=DocFlag(DET_ALT, "cuda", "forward"))

    def graph_exp(g):
        p = graph(g)
        p["index"] = p["index"][:, None].expand(edges, fd)  # torch_scatter/PyG's broadcast index (stride 0)
        return p

    add("gnn", "scatter_add", "scatter_add", gshape + " (broadcast index)", graph_exp,
        lambda p: torch.scatter_add(p["x"].new_zeros(p["rows"], fd), 0, p["index"], p["src"]),
        flag=DocFlag(DET_ALT, "cuda", "forward"))
    for red in ("sum", "mean", "prod", "amax"):
        add("gnn", f"scatter_reduce_{red}", "scatter_reduce", gshape + " (broadcast index)",
            graph_exp if red != "prod" else (lambda g: {**graph_exp(g), "src": 1 + _randn(g, edges, fd, scale=1e-3)}),
            lambda p, red=red: torch.scatter_reduce(p["x"].new_zeros(p["rows"], fd) + (red == "prod"), 0, p["index"],
                                                    p["src"], red, include_self=red == "prod"),
            flag=DocFlag(RAISES if red == "prod" else DET_ALT, "cuda", "forward") if red != "amax" else None)
    add("gnn_dups", "scatter", "scatter", gshape + " (broadcast index, duplicates)", graph_exp,
        lambda p: torch.scatter(p["x"].new_zeros(p["rows"], fd), 0, p["index"], p["src"]),
        flag=DocFlag(DET_ALT, "cuda", "forward"))
    add("gnn_gather", "index_select", "index_select", gshape,
        lambda g: graph(g), lambda p: torch.index_select(p["x"], 0, p["index"]), {"dX": ("x",)}, "index_add",
        DocFlag(DET_ALT, "cuda", "backward"))
    add("gnn_gather", "getitem_tensor", "index", gshape + " x[index]",
        lambda g: graph(g), lambda p: p["x"][p["index"]], {"dX": ("x",)}, "index_put",
        DocFlag(DET_ALT, "cpu", "backward"))
    add("gnn_gather", "gather", "gather", gshape + " (broadcast index)", graph_exp,
        lambda p: torch.gather(p["x"], 0, p["index"]), {"dX": ("x",)}, "scatter_add",
        DocFlag(DET_ALT, "cuda", "backward"))
    add("gnn", "index_put_accumulate", "index_put", gshape + " accumulate=True", graph,
        lambda p: torch.index_put(p["x"].new_zeros(p["rows"], fd), (p["index"],), p["src"], accumulate=True),
        flag=DocFlag(DET_ALT, "cpu", "forward"))
    add("gnn_dups", "index_put", "index_put", gshape + " accumulate=False (duplicates)", graph,
        lambda p: torch.index_put(p["x"].new_zeros(p["rows"], fd), (p["index"],), p["src"]),
        flag=DocFlag(DET_ALT, "any", "forward"))
    add("gnn_dups", "index_copy", "index_copy", gshape + " (duplicates)", graph,
        lambda p: torch.index_copy(p["x"].new_zeros(p["rows"], fd), 0, p["index"], p["src"]),
        flag=DocFlag(DET_ALT, "any", "forward"))
    for acc in (True, False):
        add(f"flat_acc{int(acc)}", "put", "put", f"{S(1 << 12, 1 << 20)} slots, {S(1 << 14, 1 << 22)} writes",
            lambda g: dict(x=torch.zeros(S(1 << 12, 1 << 20)), index=_zipf(g, S(1 << 14, 1 << 22), S(1 << 12, 1 << 20)),
                           src=_randn(g, S(1 << 14, 1 << 22))),
            lambda p, acc=acc: torch.put(p["x"], p["index"], p["src"], accumulate=acc),
            flag=(DocFlag(RAISES, "cuda", "forward"), DocFlag(DET_ALT, "cpu", "forward")) if acc
            else DocFlag(RAISES, "any", "forward"))
    add("graph_degrees", "repeat_interleave", "repeat_interleave", f"{nodes} rows x D={fd}, ~{edges // nodes} repeats",
        lambda g: dict(x=_randn(g, nodes, fd), repeats=torch.randint(0, 2 * edges // nodes, (nodes,), generator=g)),
        lambda p: torch.repeat_interleave(p["x"], p["repeats"], 0), {"dX": ("x",)}, "index_add",
        DocFlag(DET_ALT, "cuda", "backward"))

    # ---- pooling
    c, hw = S(8, 64), S(32, 112)
    for name, cl in (("r50_stem_3x3s2", False), ("r50_stem_3x3s2_channels_last", True)):
        add(name, "max_pool2d", "max_pool2d_with_indices", f"N={n} {c}ch {hw}x{hw} k3 s2 p1" + (" NHWC" if cl else ""),
            lambda g, cl=cl: dict(x=_randn(g, n, c, hw, hw).contiguous(
                memory_format=torch.channels_last if cl else torch.contiguous_format), kernel=(3, 3), stride=(2, 2),
                padding=(1, 1)),
            lambda p: F.max_pool2d(p["x"], p["kernel"], p["stride"], p["padding"]), {"dX": ("x",)},
            "max_pool2d_with_indices_backward")
    add("inception_3x3s1", "avg_pool2d", "avg_pool2d", f"N={n} {S(16, 256)}ch {S(16, 28)}x{S(16, 28)} k3 s1 p1",
        lambda g: dict(x=_randn(g, n, S(16, 256), S(16, 28), S(16, 28))), lambda p: F.avg_pool2d(p["x"], 3, 1, 1),
        {"dX": ("x",)}, "avg_pool2d_backward")
    vid = (S(1, 8), S(4, 64), S(4, 16), S(16, 56), S(16, 56))
    vshape = "x".join(map(str, vid))
    add("video_3x3x3s2", "max_pool3d", "max_pool3d_with_indices", f"{vshape} k3 s2 p1",
        lambda g: dict(x=_randn(g, *vid)), lambda p: F.max_pool3d(p["x"], 3, 2, 1), {"dX": ("x",)},
        "max_pool3d_with_indices_backward", DocFlag(DET_ALT if _TORCH >= (2, 13) else RAISES))
    add("video_3x3x3s2", "avg_pool3d", "avg_pool3d", f"{vshape} k3 s2 p1",
        lambda g: dict(x=_randn(g, *vid)), lambda p: F.avg_pool3d(p["x"], 3, 2, 1), {"dX": ("x",)},
        "avg_pool3d_backward", DocFlag(RAISES))
    ac, ahw = S(32, 2048), S(14, 28)
    for name, out in (("pspnet_6x6", (6, 6)), ("pspnet_3x3", (3, 3)), ("head_1x1", (1, 1))):
        one = out == (1, 1)   # torch computes a 1x1 output as mean() over H and W, not with _adaptive_avg_pool2d
        add(name, "adaptive_avg_pool2d", "mean" if one else "_adaptive_avg_pool2d",
            f"N={S(2, 16)} {ac}ch {ahw}x{ahw} -> {out[0]}x{out[1]}",
            lambda g: dict(x=_randn(g, S(2, 16), ac, ahw, ahw)),
            lambda p, out=out: F.adaptive_avg_pool2d(p["x"], out), {"dX": ("x",)},
            "mean_backward" if one else "_adaptive_avg_pool2d_backward", DocFlag(RAISES))
    add("video_2x7x7", "adaptive_avg_pool3d", "_adaptive_avg_pool3d", f"{vshape} -> 2x7x7",
        lambda g: dict(x=_randn(g, *vid)), lambda p: F.adaptive_avg_pool3d(p["x"], (2, 7, 7)), {"dX": ("x",)},
        "_adaptive_avg_pool3d_backward", DocFlag(RAISES))
    add("roi_7x7", "adaptive_max_pool2d", "adaptive_max_pool2d", f"N={S(2, 16)} {S(32, 512)}ch {ahw}x{ahw} -> 7x7",
        lambda g: dict(x=_randn(g, S(2, 16), S(32, 512), ahw, ahw)), lambda p: F.adaptive_max_pool2d(p["x"], 7),
        {"dX": ("x",)}, "adaptive_max_pool2d_backward", DocFlag(RAISES))
    add("video_2x7x7", "adaptive_max_pool3d", "adaptive_max_pool3d", f"{vshape} -> 2x7x7",   # not documented
        lambda g: dict(x=_randn(g, *vid)), lambda p: F.adaptive_max_pool3d(p["x"], (2, 7, 7)), {"dX": ("x",)},
        "adaptive_max_pool3d_backward")
    fc, fhw = S(8, 64), S(16, 56)
    add("ratio_0.7", "fractional_max_pool2d", "fractional_max_pool2d", f"N={n} {fc}ch {fhw}x{fhw} k3 ratio 0.7",
        lambda g: dict(x=_randn(g, n, fc, fhw, fhw), u=torch.rand(n, fc, 2, generator=g)),
        lambda p: F.fractional_max_pool2d(p["x"], 3, output_ratio=(0.7, 0.7), _random_samples=p["u"]), {"dX": ("x",)},
        "fractional_max_pool2d_backward", DocFlag(RAISES))
    add("ratio_0.7", "fractional_max_pool3d", "fractional_max_pool3d", f"{vshape} k2 ratio 0.7",
        lambda g: dict(x=_randn(g, *vid), u=torch.rand(vid[0], vid[1], 3, generator=g)),
        lambda p: F.fractional_max_pool3d(p["x"], 2, output_ratio=(0.7,) * 3, _random_samples=p["u"]), {"dX": ("x",)},
        "fractional_max_pool3d_backward", DocFlag(RAISES))
    uc, uhw = S(8, 64), S(16, 112)
    add("segnet_2x2", "max_unpool2d", "max_unpool2d", f"N={n} {uc}ch {uhw}x{uhw} from k2 s2 indices",
        lambda g: dict(zip(("y", "idx"), F.max_pool2d(_randn(g, n, uc, uhw, uhw), 2, 2, return_indices=True))),
        lambda p: F.max_unpool2d(p["y"], p["idx"], 2, 2), flag=DocFlag(RAISES, "any", "forward"))
    add("video_2x2x2", "max_unpool3d", "max_unpool3d", f"{vshape} from k2 s2 indices",
        lambda g: dict(zip(("y", "idx"), F.max_pool3d(_randn(g, *vid), 2, 2, return_indices=True))),
        lambda p: F.max_unpool3d(p["y"], p["idx"], 2, 2), flag=DocFlag(RAISES, "any", "forward"))

    # ---- resampling, padding, warping
    def interp(name, family, aten, aten_bwd, shape, size, mode, ac=None, antialias=False, flag=DocFlag(RAISES)):
        add(name, family, aten, f"{'x'.join(map(str, shape))} -> {'x'.join(map(str, size))} {mode}"
            + (f" align_corners={ac}" if ac is not None else "") + (" antialias" if antialias else ""),
            lambda g: dict(x=_randn(g, *shape), align_corners=ac),
            lambda p: F.interpolate(p["x"], size=size, mode=mode, align_corners=ac, antialias=antialias),
            {"dX": ("x",)}, aten_bwd, flag)

    interp("fpn_2x", "interpolate_bilinear", "upsample_bilinear2d", "upsample_bilinear2d_backward",
           (S(2, 16), S(16, 256), S(16, 64), S(16, 64)), (S(32, 128), S(32, 128)), "bilinear", False)
    interp("deeplab_logits_8x", "interpolate_bilinear", "upsample_bilinear2d", "upsample_bilinear2d_backward",
           (S(2, 8), 21, S(8, 64), S(8, 64)), (S(64, 512), S(64, 512)), "bilinear", False)
    interp("fpn_2x_align_corners", "interpolate_bilinear", "upsample_bilinear2d", "upsample_bilinear2d_backward",
           (S(2, 16), S(16, 256), S(16, 64), S(16, 64)), (S(32, 128), S(32, 128)), "bilinear", True)
    interp("resize_down_aa", "interpolate_bilinear_aa", "_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa_backward",
           (S(2, 16), 3, S(64, 512), S(64, 512)), (S(24, 224), S(24, 224)), "bilinear", False, True)
    interp("sr_4x", "interpolate_bicubic", "upsample_bicubic2d", "upsample_bicubic2d_backward",
           (S(2, 16), S(8, 64), S(16, 64), S(16, 64)), (S(64, 256), S(64, 256)), "bicubic", False)
    interp("audio_2x", "interpolate_linear", "upsample_linear1d", "upsample_linear1d_backward",
           (S(2, 16), S(8, 64), S(1024, 16000)), (S(2048, 32000),), "linear", False)
    interp("video_2x", "interpolate_trilinear", "upsample_trilinear3d", "upsample_trilinear3d_backward",
           (S(1, 4), S(4, 32), S(4, 8), S(8, 28), S(8, 28)), (S(8, 16), S(16, 56), S(16, 56)), "trilinear", False)
    interp("fpn_2x", "interpolate_nearest", "upsample_nearest2d", "upsample_nearest2d_backward",
           (S(2, 16), S(16, 256), S(16, 64), S(16, 64)), (S(32, 128), S(32, 128)), "nearest", flag=None)
    for dim, family, shape, pad in ((1, "reflection_pad1d", (S(2, 16), S(8, 64), S(2048, 16000)), (S(64, 512),) * 2),
                                    (2, "reflection_pad2d", (S(2, 16), S(8, 64), S(32, 128), S(32, 128)), (3,) * 4),
                                    (3, "reflection_pad3d", (S(1, 2), S(4, 16), S(4, 8), S(16, 32), S(16, 32)), (1,) * 6)):
        add("gan", family, family, "x".join(map(str, shape)) + f" pad {pad[0]}",
            lambda g, shape=shape: dict(x=_randn(g, *shape)), lambda p, pad=pad: F.pad(p["x"], pad, mode="reflect"),
            {"dX": ("x",)}, f"{family}_backward", DocFlag(RAISES))
    rshape = (S(2, 16), S(8, 64), S(32, 128), S(32, 128))
    add("gan", "replication_pad2d", "replication_pad2d", "x".join(map(str, rshape)) + " pad 3",
        lambda g: dict(x=_randn(g, *rshape)), lambda p: F.pad(p["x"], (3,) * 4, mode="replicate"), {"dX": ("x",)},
        "replication_pad2d_backward", DocFlag(DET_ALT))
    gshape2 = (S(2, 16), S(8, 64), S(16, 64), S(16, 64))
    add("flow_warp", "grid_sample", "grid_sampler_2d", "x".join(map(str, gshape2)) + " bilinear",
        lambda g: dict(x=_randn(g, *gshape2), grid=torch.rand(gshape2[0], gshape2[2], gshape2[3], 2, generator=g) * 2.2 - 1.1),
        lambda p: F.grid_sample(p["x"], p["grid"], align_corners=False), {"dX": ("x",), "dGrid": ("grid",)},
        "grid_sampler_2d_backward", DocFlag(RAISES))
    add("volume_warp", "grid_sample3d", "grid_sampler_3d", f"{vshape} bilinear",
        lambda g: dict(x=_randn(g, *vid), grid=torch.rand(vid[0], vid[2], vid[3], vid[4], 3, generator=g) * 2 - 1),
        lambda p: F.grid_sample(p["x"], p["grid"], align_corners=False), {"dX": ("x",)}, "grid_sampler_3d_backward",
        DocFlag(RAISES))
    add("im2col_3x3", "unfold", "im2col", f"N={n} {S(8, 64)}ch {S(16, 56)}x{S(16, 56)} k3 p1",
        lambda g: dict(x=_randn(g, n, S(8, 64), S(16, 56), S(16, 56))), lambda p: F.unfold(p["x"], 3, padding=1),
        {"dX": ("x",)}, "col2im")
    return E


# --------------------------------------------------------------------------------------------------
# Running one phase


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` with its layout: a broadcast (stride-0) view stays a broadcast view (``.to``
    would materialise it, and a kernel may take another path for the full tensor)."""
    if t.numel() > 1 and 0 in t.stride():
        core = t
        for d, st in enumerate(t.stride()):
            if st == 0:
                core = core.narrow(d, 0, 1)
        return core.to(device).expand(t.shape)
    return t.to(device)


def _to_device(p: dict, device: torch.device) -> dict:
    return {k: _move(v, device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def _first_tensor(out) -> torch.Tensor:
    return _flat_outputs(out)[0]


def _upstream(y: torch.Tensor, seed: int) -> torch.Tensor:
    """The fixed upstream gradient of a backward phase: seeded, never ones (order must matter)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = torch.empty_like(y, requires_grad=False)  # y's strides: channels_last stays channels_last
    out.copy_(torch.randn(y.shape, generator=g, dtype=torch.float32))
    return out


def phase_call(entry: Entry, phase: str, p: dict) -> tuple[Callable[[], object], object, torch.Tensor | None]:
    """``(fn, forward output, upstream gradient)`` for one phase, built in the current torch mode: the
    forward graph of a backward phase is built once, and ``fn`` repeats the backward."""
    if phase == "forward":
        def fwd():
            with torch.no_grad():
                return entry.forward(p)
        return fwd, None, None
    wrt = _phase_grads(entry, phase)
    leaves = {k: (v.detach().requires_grad_(True) if k in wrt else v) for k, v in p.items()}
    y = _first_tensor(entry.forward(leaves))
    g = _upstream(y, entry.seed)
    ins = [leaves[k] for k in wrt]

    def bwd():
        return torch.autograd.grad(y, ins, g, retain_graph=True)
    return bwd, y, g


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SPIN_S_PER_CALL = timing.HOST_AHEAD_S   # host time per queued call the spin kernel covers


def _cuda_times(fn: Callable[[], object], n: int, device: torch.device) -> tuple[list[float], bool]:
    """(seconds per call from CUDA events, whether they may include host time): ``n`` calls queued behind a
    spin kernel so that host launch cost does not leak into device time (``timing.queued_event_times``)."""
    return timing.queued_event_times(fn, n, device, host_ahead_s=SPIN_S_PER_CALL)


@dataclass
class Measured:
    distinct: int
    first: str
    median_s: float
    host_included: bool = False   # CUDA event times that include host time (see _cuda_times)


def measure(fn: Callable[[], object], repeats: int, device: torch.device) -> Measured:
    """Distinct digests of ``repeats`` calls (one host sync each) and the median seconds per call."""
    hashes: list[str] = []
    times: list[float] = []
    cuda = device.type == "cuda"
    for _ in range(WARMUP if cuda else 1):
        fn()
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        hashes.append(digest(out))
        del out
    host = False
    if cuda:
        times, host = _cuda_times(fn, max(5, min(repeats, CUDA_TIMED_CALLS)), device)
    return Measured(len(set(hashes)), hashes[0], statistics.median(times), host)


_REFUSAL_MARKERS = ("does not have a deterministic implementation", "deterministic", "CUBLAS_WORKSPACE_CONFIG")


def _is_refusal(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(m.lower() in str(e).lower() for m in _REFUSAL_MARKERS)


def _first_line(e: BaseException | str, limit: int = 200) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _det_warnings(caught) -> list[str]:
    return [_first_line(str(w.message)) for w in caught if "determinis" in str(w.message).lower()]


def _registry_op(entry: Entry, phase: str) -> tuple[str, Callable] | None:
    """The registry op and adapter for a phase, if the table names one and the registry has it."""
    import kernels

    hit = NNRAND_OPS.get((entry.family, phase))
    if hit is None or hit[0] not in kernels.ops():
        return None
    return hit


def _nnrand(entry: Entry, phase: str, p: dict, repeats: int, device: torch.device, default_s: float,
            cudnn_benchmark: bool = False) -> tuple[dict, bool]:
    """(row fields, whether its CUDA times include host time) of the fastest deterministic registry variant
    for the phase: each tried once (an argument error or a missing CUDA runtime counts as not applicable),
    timed, the fastest hashed over ``repeats`` calls. Each variant gets the keyword arguments the benchmarks
    give it (``bench_kwargs_of``: the mode the routing runs it in), under the adapter's."""
    import kernels

    hit = _registry_op(entry, phase)
    if hit is None:
        return {}, False
    reg, adapter = hit
    row = {"nnrand_op": reg}
    with torch_flags("default"):
        _, y, g = phase_call(entry, phase, p) if phase != "forward" else (None, None, None)
        with torch.no_grad():
            args, kwargs = adapter(p, y, g)
    spec = kernels.spec(reg)
    det = [v for v in kernels.variants(reg) if v.deterministic]
    timed, notes = [], []
    # every variant under default mode's flags (TF32 off, the run's cudnn.benchmark), as the ratio's
    # denominator ran; a variant that fails is noted by name and the others still run
    with torch_flags("default", cudnn_benchmark=cudnn_benchmark):
        for v in det:
            fn = functools.partial(v, *args, **{**spec.bench_kwargs_of(v.name), **kwargs})
            try:
                fn()
                _sync(device)
                if device.type == "cuda":
                    t = statistics.median(_cuda_times(fn, NNRAND_SELECT_CALLS, device)[0])
                else:
                    t = statistics.median(_host_times(fn, NNRAND_SELECT_CALLS))
            except Exception as e:   # an argument it does not take, no CUDA runtime, out of memory, ...
                notes.append(f"{v.name}: {type(e).__name__}: {_first_line(e, 120)}")
                continue
            timed.append((t, v, fn))
        if not timed:
            row["nnrand_note"] = "; ".join(notes) or "no deterministic variant"
            return row, False
        _, best, fn = min(timed, key=lambda t: t[0])
        m = measure(fn, repeats, device)
    row.update(nnrand_variant=best.name, nnrand_distinct=m.distinct, nnrand_hash=m.first,
               nnrand_ms=_ms(m.median_s), nnrand_ratio=_ratio(m.median_s, default_s),
               nnrand_note="; ".join(notes))
    return row, m.host_included


def _host_times(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.4g}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3g}" if b > 0 and math.isfinite(a) else ""


def _where(entry: Entry, phase: str, device_type: str = "cpu") -> str:
    return f"{entry.name} {phase} (aten::{entry.aten_on(phase, device_type) or entry.aten})"


def _doc_flag(entry: Entry, phase: str, device: torch.device) -> str:
    flags = entry.flag if isinstance(entry.flag, tuple) else (entry.flag,) if entry.flag else ()
    return next((f.kind for f in flags if f.applies(device.type, phase)), "")


# --------------------------------------------------------------------------------------------------
# Route: what nnrand.use_kernels("tree") does with a phase


ROUTE_FAMILY = "tree"


@functools.lru_cache(maxsize=1)
def _tree_routing():
    """The routing ``use_kernels(ROUTE_FAMILY)`` resolves to (a function of the code: resolved once)."""
    from nnrand import routing

    return routing.resolve(ROUTE_FAMILY)


@functools.lru_cache(maxsize=None)
def _quick_entries() -> dict[str, Entry]:
    return {e.name: e for e in audit_entries("quick")}


def _routed(entry: Entry, phase: str, device_type: str = "cpu") -> str:
    """``<registry op>/<variant>`` where the tree routing runs one for the phase, else empty: the aten op the
    phase dispatches on the device (``aten``, or ``aten_cuda`` there, for the forward, else ``aten_backward``,
    where CUDA's cudnn_batch_norm_backward routes as native_batch_norm_backward does; an in-place twin such as
    index_add_, which index_select's backward calls, runs its functional op's route)
    is overridden on that device for a routed op (ROUTED_OPS, registry ops as REGISTRY_OPS names them, or
    itself) whose registry op is NNRAND_OPS's for the phase, and ``routing.resolve`` gives that routed op a
    variant. The conv families' NNRAND_OPS rows carry the handler's split (grouped convs to the grouped ops,
    transposed convs to none)."""
    from nnrand import routing

    hit = NNRAND_OPS.get((entry.family, phase))
    aten = entry.aten_on(phase, device_type)
    if hit is None or aten is None:
        return ""
    tree = _tree_routing()
    key = "CUDA" if device_type == "cuda" else "CPU"
    for r in routing.ATEN_OPS:
        if r.op.rstrip("_") != aten.rstrip("_") or key not in r.keys:
            continue
        for op in r.routed:
            if hit[0] in routing.REGISTRY_OPS.get(op, (op,)) and tree.used[op] != routing.NATIVE:
                return f"{hit[0]}/{tree.used[op]}"
    return ""


def _guard_runs(pairs: Sequence[tuple[Entry, str]]) -> dict[tuple[str, str], bool]:
    """Per (entry, phase): whether use_kernels("tree")'s guard refuses a call that phase makes, from the
    guard itself: the forward (a backward phase's graph build, where the guard looks) run on the CPU under
    ``use_kernels(ROUTE_FAMILY, strict=False)``, its ``uncovered`` count read. The guard's ``applies``
    predicates read the call's arguments (a 1x1 adaptive pool, the loss reduction, which input needs a
    gradient), ``routed_by`` the routing, and it judges every device by the CUDA backward alike."""
    from nnrand import routing

    ops = {u.backward for u in routing.UNCOVERED_OPS}
    out: dict[tuple[str, str], bool] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # deterministic mode's warn-only alerts: PyTorch's, not the guard's
        with routing.use_kernels(ROUTE_FAMILY, strict=False) as ctx:
            def uncovered() -> int:
                return sum(ctx.coverage[op].get(routing.UNCOVERED, 0) for op in ops)
            for entry, phase in pairs:
                before = uncovered()
                fn, _, _ = phase_call(entry, phase, entry.make(torch.Generator().manual_seed(entry.seed)))
                if phase == "forward":
                    fn()
                del fn
                out[entry.name, phase] = uncovered() > before
    return out


@functools.lru_cache(maxsize=1)
def _quick_guards() -> dict[tuple[str, str], bool]:
    from nnrand import routing

    guarded = {u.op for u in routing.UNCOVERED_OPS}
    return _guard_runs([(e, ph) for e in _quick_entries().values() if e.aten in guarded for ph in e.phases()])


def _guarded(entry: Entry, phase: str) -> bool:
    """Whether the guard refuses the phase (see _guard_runs). Only entries whose forward aten op is one the
    guard watches are run; an audit entry runs as its quick-scale twin (its forward's arguments are those of
    every scale but the sizes), once per process for all of them."""
    from nnrand import routing

    if entry.aten not in {u.op for u in routing.UNCOVERED_OPS}:
        return False
    if entry.name in _quick_entries():
        return _quick_guards().get((entry.name, phase), False)
    return _guard_runs([(entry, phase)])[entry.name, phase]


def route(entry: Entry, phase: str, device_type: str = "cpu") -> str:
    """What ``nnrand.use_kernels("tree")`` does with the phase on a ``device_type`` ("cpu" or "cuda") device:
    ``routed <registry op>/<variant>``, ``guarded`` (refused as uncovered at the forward call that creates
    it; strict=False counts it uncovered), or empty (torch's kernel runs, under PyTorch's deterministic mode).
    It names the phase's own aten call: torch's CPU embedding_bag kernels call index_add_ through the
    dispatcher, so on the CPU part of their work is routed too, which the CUDA kernels' is not."""
    routed = _routed(entry, phase, device_type)
    if routed:
        return f"routed {routed}"
    return "guarded" if _guarded(entry, phase) else ""


def audit_phase(entry: Entry, phase: str, *, repeats: int, device: torch.device,
                cudnn_benchmark: bool = False, fail_fast: bool = False) -> dict:
    """One CSV row: default mode, deterministic mode and nnrand's best deterministic variant. An error
    in default mode ends the row with ``error`` naming the entry, phase and aten op (``fail_fast``:
    raised as :class:`AuditError`); the global flags are restored in every case. A backward phase's graph
    is built once, under default mode's flags, and both modes repeat its backward: deterministic mode's
    verdict on a backward phase is its backward's (a forward PyTorch refuses is the forward row's)."""
    if repeats < 2:
        raise ValueError(f"repeats must be at least 2 to compare results, got {repeats}")
    row: dict = {"entry": entry.name, "phase": phase, "family": entry.family,
                 "aten_op": entry.aten_on(phase, device.type) or entry.aten,
                 "shape": entry.shape, "pytorch_flag": _doc_flag(entry, phase, device),
                 "nnrand_route": route(entry, phase, device.type), "repeats": repeats}
    host = []   # modes whose CUDA event times include host time
    try:
        p = _to_device(entry.make(torch.Generator().manual_seed(entry.seed)), device)
        with torch_flags("default", cudnn_benchmark=cudnn_benchmark):
            fn, _, _ = phase_call(entry, phase, p)
            base = measure(fn, repeats, device)
    except Exception as e:  # noqa: BLE001 - recorded in the row with the op named, or raised so
        msg = f"{_where(entry, phase, device.type)}: default mode: {type(e).__name__}: {_first_line(e)}"
        if fail_fast:
            raise AuditError(msg) from e
        row["error"] = msg
        return row
    row.update(default_distinct=base.distinct, default_hash=base.first, default_ms=_ms(base.median_s))
    host += ["default"] if base.host_included else []

    try:
        with torch_flags("deterministic"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            det = measure(fn, repeats, device)
        warned = _det_warnings(caught)
        row.update(det_status="warns" if warned else "runs", det_message=warned[0] if warned else "",
                   det_distinct=det.distinct, det_hash=det.first, det_ms=_ms(det.median_s),
                   det_ratio=_ratio(det.median_s, base.median_s))
        host += ["det"] if det.host_included else []
    except Exception as e:  # noqa: BLE001
        if _is_refusal(e):
            row.update(det_status="raises", det_message=_first_line(e))
        else:
            msg = f"{_where(entry, phase, device.type)}: deterministic mode: {type(e).__name__}: {_first_line(e)}"
            if fail_fast:
                raise AuditError(msg) from e
            row.update(det_status="error", det_message=msg)
    del fn

    try:
        fields, nn_host = _nnrand(entry, phase, p, repeats, device, base.median_s, cudnn_benchmark)
        row.update(fields)
        host += ["nnrand"] if nn_host else []
    except Exception as e:  # noqa: BLE001
        reg = (NNRAND_OPS.get((entry.family, phase)) or ("",))[0]
        msg = f"{_where(entry, phase, device.type)}: nnrand {reg}: {type(e).__name__}: {_first_line(e)}"
        if fail_fast:
            raise AuditError(msg) from e
        row["nnrand_error"] = msg
    if host:
        row["timing_note"] = f"{', '.join(host)} CUDA times may include host time (the GPU reached a call before " \
                             "the host was done queueing it)"
    return row


# --------------------------------------------------------------------------------------------------
# The CSV


KEY = ("entry", "phase", "scale", "device", "git_sha")   # one row per key: a new measurement replaces the old
SETTINGS = ("repeats", "cudnn_benchmark")
# What a row's results depend on beyond its key and settings: a row measured under other values is measured
# again (NVRTC compiles nnrand's CUDA kernels; CPU kernels change with the thread count and instruction set)
CUDA_ENV = ("torch", "cuda", "cudnn", "driver", "nvrtc", "cupy", "cupy_cuda", "cublas_workspace_config")
CPU_ENV = ("torch", "numba", "cpu_threads", "cpu_capability")
COLUMNS = ("entry", "phase", "family", "aten_op", "shape", "scale", "device", "git_sha", "pytorch_flag",
           "nnrand_route", "repeats", "cudnn_benchmark", "default_distinct", "default_ms", "default_hash",
           "det_status", "det_message", "det_distinct", "det_ms", "det_ratio", "det_hash", "nnrand_op",
           "nnrand_variant", "nnrand_distinct", "nnrand_ms", "nnrand_ratio", "nnrand_hash", "nnrand_note",
           "nnrand_error", "error", "timing_note", "cpu_threads", "cublas_workspace_config", "doc_flags_torch") \
    + tuple(f for f in envfp.FIELDS if f != "git_sha")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        raise ValueError(f"the audit runs on cpu or cuda devices, not {device}")
    return f"cpu ({envfp.fingerprint('cpu')['cpu']})"


def default_stem(device: torch.device, scale: str) -> str:
    if device.type != "cuda":
        return "audit_cpu"
    return "audit" if scale == "full" else "audit_quick"


def default_csv(device: torch.device, scale: str) -> Path:
    return REPO / "reports" / "results" / f"{default_stem(device, scale)}.csv"


def default_md(csv_path: Path) -> Path:
    csv_path = Path(csv_path)
    base = csv_path.parent.parent if csv_path.parent.name == "results" else csv_path.parent
    return base / f"{csv_path.stem}.md"


def read_rows(path: Path) -> list[dict]:
    return runio.read_csv(path) if Path(path).exists() else []


def _key(row: Mapping) -> tuple:
    return tuple(str(row.get(k, "")) for k in KEY)


def _cpu_row(row: Mapping) -> bool:
    return str(row.get("gpu", "none")) == "none"


def _row_device_type(row: Mapping) -> str:
    """The device type a row was measured on: "cpu" or "cuda"."""
    return "cpu" if _cpu_row(row) else "cuda"


def _measured_under(row: Mapping) -> tuple:
    """The settings and environment of a row that its results depend on (CUDA_ENV or CPU_ENV by its device)."""
    return tuple(str(row.get(k, "")) for k in SETTINGS + (CPU_ENV if _cpu_row(row) else CUDA_ENV))


def has_error(row: Mapping) -> bool:
    """An error in default mode, deterministic mode (other than PyTorch's refusal) or nnrand's part."""
    return bool(row.get("error") or row.get("nnrand_error")) or row.get("det_status") == "error"


def _env_fields(device: torch.device) -> dict:
    env = envfp.row_fingerprint()
    if device.type != "cuda":  # a CPU audit on a GPU machine names no GPU
        env.update(gpu="none", driver="none", cudnn="none", cpu_threads=str(torch.get_num_threads()))
    elif device.index is not None and device.index != torch.cuda.current_device():
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


CUBLAS_WORKSPACE = ":4096:8"   # cuBLAS's fixed-workspace mode (PyTorch's reproducibility notes)


@contextlib.contextmanager
def cublas_workspace() -> Iterator[str]:
    """``CUBLAS_WORKSPACE_CONFIG=:4096:8`` while open where unset (put back on exit); yields the value the run
    records. cuBLAS and torch read it once, at the first cuBLAS call of the process: set after CUDA has
    initialised, it may come too late, and the recorded value says so (``cli`` opens this first)."""
    before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    value = before
    if before is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = value = CUBLAS_WORKSPACE
        if torch.cuda.is_initialized():
            value += " (set after CUDA initialised: cuBLAS may not have read it)"
    try:
        yield value
    finally:
        if before is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


LOCK_TIMEOUT_S = 600.0


def lock_path(csv_path: Path | str) -> Path:
    csv_path = Path(csv_path)
    return csv_path.parent / f".{csv_path.name}.lock"


@contextlib.contextmanager
def csv_lock(csv_path: Path | str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive lock on ``csv_path`` between audits: ``.<name>.lock`` beside it, held with ``flock``
    where the platform has it (the kernel releases it if its holder dies), else created with O_EXCL. The
    holder removes the file on release; a waiter that locked a removed file tries again. Waiting is said on
    stderr; past ``timeout_s`` an :class:`AuditError` names the lock file."""
    try:
        import fcntl
    except ImportError:   # no flock (Windows): the file's existence is the lock
        fcntl = None
    path = lock_path(csv_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        if fcntl is not None:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st, now = os.fstat(fd), os.stat(path)
                if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                    break
            except (BlockingIOError, FileNotFoundError):
                pass
            os.close(fd)
        else:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
                break
            except FileExistsError:
                pass
        if time.monotonic() >= deadline:
            raise AuditError(f"{csv_path}: another audit has held {path} for {timeout_s:.0f} s"
                             + ("" if fcntl is not None else "; if none is running, delete that file"))
        if not said:
            print(f"waiting for {path}: another audit is writing {csv_path}", file=sys.stderr)
            said = True
        time.sleep(0.05)
    try:
        yield
    finally:
        if fcntl is None:   # O_EXCL: close before removing (an open file cannot be removed on Windows)
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)   # flock: removed while still held, so no waiter locks a file about to go
        if fcntl is not None:
            os.close(fd)


def write_row(csv_path: Path | str, row: Mapping, md_path: Path | str | None = None) -> None:
    """Merge ``row`` into the CSV under the lock: re-read what is there now (another audit's rows included),
    replace the row of its key or append it, write the file atomically and render the markdown from it."""
    csv_path = Path(csv_path)
    with csv_lock(csv_path):
        rows = read_rows(csv_path)
        at = next((i for i, r in enumerate(rows) if _key(r) == _key(row)), None)
        if at is None:
            rows.append(dict(row))
        else:
            rows[at] = dict(row)
        # the rows as the CSV holds them (csv writes None as "", anything else as str)
        table = [{c: "" if r.get(c) is None else str(r.get(c, "")) for c in COLUMNS} for r in rows]
        runio.write_csv(csv_path, COLUMNS, table)
        # the report follows the CSV row by row (an interrupted run leaves both), from the rows in hand
        runio.write_text(Path(md_path) if md_path is not None else default_md(csv_path), render_markdown(table))


def run_audit(entries: Sequence[Entry], *, device: torch.device | str = "cpu", repeats: int = DEFAULT_REPEATS,
              scale: str = "quick", csv_path: Path | str, md_path: Path | str | None = None, rerun: bool = False,
              fail_fast: bool = False, cudnn_benchmark: bool = False, progress: bool = True) -> list[dict]:
    """Audit every phase of ``entries`` not yet in ``csv_path`` for this (scale, device, git SHA) under this
    run's settings and environment (an errored row counts as not yet there), merging each row into the CSV
    (and rendering the markdown from it) under the CSV's lock after it is measured. Returns this run's rows."""
    from tqdm import tqdm

    device = torch.device(device)
    name = device_name(device)   # refuses a device that is neither cpu nor cuda
    if repeats < 2:
        raise ValueError(f"--repeats must be at least 2 to compare results, got {repeats}")
    csv_path = Path(csv_path)
    md_path = Path(md_path) if md_path is not None else default_md(csv_path)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with cublas_workspace() as cublas, on_device:   # events, spins and streams on the audited GPU
        stamp = {"scale": scale, "device": name, "git_sha": envfp.git_sha(), "repeats": repeats,
                 "cudnn_benchmark": cudnn_benchmark, "cublas_workspace_config": cublas,
                 "doc_flags_torch": DOC_FLAGS_TORCH}
        env = _env_fields(device)
        env.pop("git_sha", None)
        env.pop("date", None)
        stamp.update(env)
        under = _measured_under({k: str(v) for k, v in stamp.items()})

        def done(rows: list[dict]) -> set[tuple]:
            return {_key(r) for r in rows if not has_error(r) and _measured_under(r) == under}

        def key(e: Entry, ph: str) -> tuple:
            return _key({"entry": e.name, "phase": ph, **stamp})

        todo = [(e, ph) for e in entries for ph in e.phases()]
        if not rerun:   # a row measured under other settings or versions is measured again, not reused
            have = done(read_rows(csv_path))
            todo = [(e, ph) for e, ph in todo if key(e, ph) not in have]
        new: list[dict] = []
        bar = tqdm(todo, desc="audit", unit="phase", disable=not progress, dynamic_ncols=True)
        for entry, phase in bar:
            if not rerun and key(entry, phase) in done(read_rows(csv_path)):
                continue   # another audit of this CSV measured it meanwhile
            bar.set_postfix_str(f"{entry.name} {phase}", refresh=False)
            row = audit_phase(entry, phase, repeats=repeats, device=device, cudnn_benchmark=cudnn_benchmark,
                              fail_fast=fail_fast)
            row.update(stamp, date=envfp.row_fingerprint()["date"])
            new.append(row)
            write_row(csv_path, row, md_path)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not new and csv_path.exists():
        render(csv_path, md_path)
    return new


# --------------------------------------------------------------------------------------------------
# The report, from the CSV only


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _latest_rows(rows: list[dict]) -> list[dict]:
    """On the (device, scale) of the most recent row, the most recent row of each (entry, phase) by date
    (rows of one second: the later in the CSV, where write_row appends a new key's row), whatever its git
    SHA (an audit of some ops at a new commit replaces their rows and keeps the others'; an error row too),
    in the CSV order of each (entry, phase)'s first row."""
    if not rows:
        return []
    last = max(rows, key=lambda r: r.get("date", ""))
    g = (last.get("device"), last.get("scale"))
    newest: dict[tuple, dict] = {}
    for r in rows:
        if (r.get("device"), r.get("scale")) == g:
            k = (r.get("entry"), r.get("phase"))
            if k not in newest or r.get("date", "") >= newest[k].get("date", ""):
                newest[k] = r   # (insertion order: the first row's place)
    return list(newest.values())


def _label(r: dict) -> str:
    return f"`{r['entry']}` {r['phase']}"


def _names(rows: list[dict], extra: Callable[[dict], str] | None = None, limit: int = 12) -> str:
    items = [_label(r) + (f" ({extra(r)})" if extra else "") for r in rows]
    if len(items) > limit:
        items = items[:limit] + [f"and {len(rows) - limit} more"]
    return ", ".join(items)


def summary(rows: list[dict]) -> str:
    """The paragraph of surprises, computed from the rows."""
    ok = [r for r in rows if not r.get("error") and _int(r.get("default_distinct")) is not None]
    if not ok:
        return "No phase ran without an error."
    reps = sorted({_int(r.get("repeats")) or 0 for r in ok})
    n = str(reps[0]) if len(reps) == 1 else f"{reps[0]} to {reps[-1]}"
    flagged = [r for r in ok if r.get("pytorch_flag")]
    nondet = [r for r in ok if _int(r["default_distinct"]) > 1]
    flagged_rep = [r for r in flagged if _int(r["default_distinct"]) == 1]
    unflagged_nondet = [r for r in nondet if not r.get("pytorch_flag")]
    raised = [r for r in ok if r.get("det_status") == "raises"]
    raised_undoc = [r for r in raised if r.get("pytorch_flag") != RAISES]
    doc_raise_ran = [r for r in ok if r.get("pytorch_flag") == RAISES and r.get("det_status") in ("runs", "warns")]
    det_nondet = [r for r in ok if (_int(r.get("det_distinct")) or 0) > 1]
    nn = [r for r in ok if _int(r.get("nnrand_distinct")) is not None]
    nn_nondet = [r for r in nn if _int(r["nnrand_distinct"]) > 1]
    fixed = [r for r in nn if r in nondet and _int(r["nnrand_distinct"]) == 1]
    s = [f"Of {len(ok)} phases run {n} times each, {len(nondet)} gave more than one distinct result under "
         f"PyTorch's default flags."]
    if flagged:
        s.append(f"PyTorch's documentation flags {len(flagged)} of the {len(ok)} on this device; "
                 + (f"{len(flagged_rep)} of those were nevertheless bitwise repeatable here: {_names(flagged_rep)}."
                    if flagged_rep else "every one of those varied here."))
    if unflagged_nondet:
        s.append(f"Not flagged by PyTorch yet not repeatable: {_names(unflagged_nondet, lambda r: r['default_distinct'] + ' distinct')}.")
    else:
        s.append("No phase that PyTorch does not flag varied.")
    if raised:
        s.append(f"Deterministic mode raised for {len(raised)} phases"
                 + (f", {len(raised_undoc)} of them not documented to raise here ({_names(raised_undoc)})" if raised_undoc else "")
                 + ".")
    if doc_raise_ran:
        s.append(f"Documented to raise but ran in deterministic mode: {_names(doc_raise_ran)}.")
    s.append(f"Deterministic mode left {len(det_nondet)} phases varying"
             + (f": {_names(det_nondet, lambda r: r['det_distinct'] + ' distinct')}." if det_nondet else "."))
    if nn:
        ratios = [float(r["nnrand_ratio"]) for r in nn if r.get("nnrand_ratio")]
        med = f"; median time {statistics.median(ratios):.2f}x PyTorch's default" if ratios else ""
        s.append(f"nnrand's best deterministic variant ran for {len(nn)} phases ({len(fixed)} of them nondeterministic "
                 f"by default){med}" + (f"; varied anyway: {_names(nn_nondet)}." if nn_nondet else ", each with one distinct result."))
    return " ".join(s)


def _cell(v) -> str:
    return str(v).replace("|", "\\|") if v not in (None, "") else ""


def _det_cell(r: dict) -> str:
    st = r.get("det_status", "")
    if st == "raises":
        return "raises"
    if st in ("runs", "warns"):
        return f"{st}: {r.get('det_distinct', '')} ({r.get('det_ratio', '')}x)"
    return st


def _nn_cell(r: dict) -> str:
    if r.get("nnrand_variant"):
        return f"`{r['nnrand_op']}/{r['nnrand_variant']}`: {r.get('nnrand_distinct', '')} ({r.get('nnrand_ratio', '')}x)"
    return ""


def _values(rows: list[dict], column: str, show: Callable[[str], str] = str, missing: str = "not recorded") -> str:
    """The column's value, or where rows differ every value with its number of rows (most rows first);
    ``missing`` for rows written before the column existed."""
    counts = Counter(str(r.get(column) or "") for r in rows)

    def one(v: str) -> str:
        return show(v) if v else missing
    if len(counts) == 1:
        return one(next(iter(counts)))
    return ", ".join(f"{one(v)} ({n} row{'s' if n != 1 else ''})" for v, n in counts.most_common())


def _benchmark(v: str) -> str:
    return {"True": "on", "False": "off"}.get(v, v)


def _settings_cell(r: dict) -> str:
    return f"{r.get('repeats', '')} repeats, cudnn.benchmark {_benchmark(str(r.get('cudnn_benchmark', '')))}"


def _twin(r: dict) -> "Entry | None":
    """The row's entry in the rendering code at quick scale, where it has the row's phase (None otherwise)."""
    twin = _quick_entries().get(r.get("entry", ""))
    return twin if twin is not None and r.get("phase") in twin.phases() else None


def _route_of(r: dict) -> str:
    """The row's route in the rendering code (:func:`route` on its entry's quick-scale twin), or the CSV's
    for an entry this code does not have."""
    twin = _twin(r)
    return route(twin, r["phase"], _row_device_type(r)) if twin is not None else r.get("nnrand_route", "")


def _flag_of(r: dict) -> str:
    """The row's PyTorch flag in the rendering code's table (its entry's quick-scale twin on the row's device
    type), or the CSV's for an entry this code does not have: a corrected flag reaches rows measured before."""
    twin = _twin(r)
    if twin is None:
        return r.get("pytorch_flag", "")
    return _doc_flag(twin, r["phase"], torch.device(_row_device_type(r)))


def _route_cell(r: dict, rt: str) -> str:
    if rt.startswith("routed "):
        return f"routed `{rt.split(' ', 1)[1]}`"
    if not rt and r.get("det_status") == "raises":   # use_kernels turns deterministic mode on: PyTorch refuses
        return "refused by PyTorch"
    return rt


def render_markdown(rows: list[dict]) -> str:
    rows = [dict(r, pytorch_flag=_flag_of(r)) for r in _latest_rows(rows)]
    if not rows:
        return "# Determinism audit\n\nNo results.\n"
    r0 = rows[0]
    dates = sorted(r.get("date", "") for r in rows)
    cpu = _cpu_row(r0)
    mixed = any(len({str(r.get(c, "")) for r in rows}) > 1 for c in SETTINGS)
    commits = len({str(r.get("git_sha", "")) for r in rows}) > 1   # a git column: each row's commit
    reps = _values(rows, "repeats")
    # rows that record CUBLAS_WORKSPACE_CONFIG were measured with the backward alone in deterministic mode
    graph = ("a backward phase's on the graph built in default mode (its forward's refusal is the forward row's)."
             if all(r.get("cublas_workspace_config") for r in rows) else
             "when these rows were measured, deterministic mode built a backward phase's forward graph too, so a "
             "forward's refusal also shows on its backward rows.")
    env = (f"torch threads {_values(rows, 'cpu_threads')}, CPU capability {_values(rows, 'cpu_capability')}" if cpu
           else f"`CUBLAS_WORKSPACE_CONFIG` at the start of the run {_values(rows, 'cublas_workspace_config')}")
    lines = [
        "# Determinism audit" + (" (CPU)" if cpu else ""),
        "",
        f"Device: **{r0['device']}**" + ("" if cpu else f" (driver {_values(rows, 'driver')}, CUDA "
                                          f"{_values(rows, 'cuda')}, cuDNN {_values(rows, 'cudnn')})")
        + f"; torch {_values(rows, 'torch')}; {env}; git {_values(rows, 'git_sha', lambda v: f'`{v}`')}; "
        f"scale `{r0.get('scale', '')}`; "
        + (f"{reps} repeats per mode" if not mixed else "repeats per mode and `cudnn.benchmark` differ between rows "
           f"(*settings* column): repeats {reps}; `cudnn.benchmark` {_values(rows, 'cudnn_benchmark', _benchmark)}")
        + f"; measured {dates[0]} to {dates[-1]}. Generated by `python -m nnrand.audit` from "
        "its CSV (`python -m nnrand.audit render` re-renders it): each phase's latest row"
        + (" (rows of several commits: the *git* column names each row's)." if commits else "."),
        "",
        "Each row repeats one phase of one op on identical inputs. *distinct*: distinct output hashes over the "
        "repeats (1: bitwise repeatable). *PyTorch flag*: what `torch.use_deterministic_algorithms`'s "
        f"documentation (as of torch {DOC_FLAGS_TORCH}, the rendering code's table) "
        "says of this op on this device (`raises` in "
        "deterministic mode, `det-alt`: switches to a deterministic algorithm). *det mode*: "
        "`torch.use_deterministic_algorithms(True)`, `cudnn.deterministic=True` (`CUBLAS_WORKSPACE_CONFIG=:4096:8` "
        "where the run left it unset): whether it raised, or its distinct results and time relative to default; "
        f"{graph} *nnrand*: the fastest deterministic registry variant for the "
        "phase, its distinct results and time relative to PyTorch's default. *route*: what "
        "`nnrand.use_kernels(\"tree\")` does with the phase in the code that rendered this report (`routed` to the "
        "variant named, `guarded`: refused as uncovered at the forward call that records the backward, so never a "
        "forward phase, which runs without autograd, unless the forward itself is the nondeterministic op; "
        "`refused by PyTorch`: its deterministic mode, which the context turns on, raised above). TF32 off throughout"
        + ("." if mixed else f"; `cudnn.benchmark` {_benchmark(str(r0.get('cudnn_benchmark')))} in default mode."),
        "",
        "## Summary",
        "",
        summary(rows),
        "",
        "## Results",
        "",
        "| op | phase | shape | PyTorch flag | route | default: distinct | default ms | det mode | nnrand |"
        + (" settings |" if mixed else "") + (" git |" if commits else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if mixed else "") + ("---|" if commits else ""),
    ]
    for r in rows:
        rt = _route_cell(r, _route_of(r))
        tail = (f" {_settings_cell(r)} |" if mixed else "") + (f" `{r.get('git_sha', '')}` |" if commits else "")
        if r.get("error"):
            lines.append(f"| `{r['entry']}` | {r['phase']} | {_cell(r['shape'])} | {r.get('pytorch_flag', '')} | "
                         f"{rt} | error | | | |{tail}")
            continue
        d = _int(r.get("default_distinct"))
        dd = f"**{d}**" if d and d > 1 else str(d)
        lines.append(f"| `{r['entry']}` | {r['phase']} | {_cell(r['shape'])} | {r.get('pytorch_flag', '')} | "
                     f"{rt} | {dd} | {r.get('default_ms', '')} | {_cell(_det_cell(r))} | "
                     f"{_cell(_nn_cell(r))} |{tail}")
    notes = [r for r in rows if r.get("det_message") or r.get("error") or r.get("nnrand_error")
             or r.get("timing_note")]
    if notes:
        timing = any(r.get("timing_note") for r in notes)
        lines += ["", "## Messages", "", "First line of what PyTorch said in deterministic mode, "
                  + ("errors and timing notes." if timing else "and errors."), ""]
        for r in notes:
            det = f"{r.get('det_status')}: {r.get('det_message')}" if r.get("det_message") else ""
            said = [r.get("error") or det, r.get("nnrand_error", ""), r.get("timing_note", "")]
            lines.append(f"- {_label(r)}: {'; '.join(t for t in said if t)}")
    return "\n".join(lines) + "\n"


def render(csv_path: Path | str, md_path: Path | str | None = None) -> Path:
    """Write the markdown report for the CSV's latest row of each phase on its latest (device, scale);
    never reruns anything."""
    csv_path = Path(csv_path)
    if not csv_path.exists():
        raise FileNotFoundError(f"no audit results at {csv_path}; run python -m nnrand.audit first")
    md_path = Path(md_path) if md_path is not None else default_md(csv_path)
    runio.write_text(md_path, render_markdown(read_rows(csv_path)))
    return md_path


# --------------------------------------------------------------------------------------------------
# Command line


def select(entries: Sequence[Entry], patterns: str | None) -> list[Entry]:
    """Entries whose name or family matches one of the comma-separated globs; an unmatched one raises."""
    if not patterns:
        return list(entries)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    out = [e for e in entries if any(fnmatch.fnmatch(e.name, p) or fnmatch.fnmatch(e.family, p) for p in pats)]
    for p in pats:
        if not any(fnmatch.fnmatch(e.name, p) or fnmatch.fnmatch(e.family, p) for e in entries):
            fams = ", ".join(sorted({e.family for e in entries}))
            raise AuditError(f"--ops {p!r} matches no audit entry; families: {fams}")
    return out


EPILOG = """examples:
  python -m nnrand.audit                                  # all ops, 50 repeats; full scale on a GPU
  python -m nnrand.audit --scale quick --repeats 5        # about a minute on a laptop CPU
  python -m nnrand.audit --ops 'conv2d*,max_pool2d' --repeats 100
  python -m nnrand.audit --list                           # entries and their phases
  python -m nnrand.audit --rerun --ops cumsum             # measure again rows already in the CSV
  python -m nnrand.audit render                           # re-render the markdown from the CSV
  python -m nnrand.audit render --out reports/results/audit.csv --md /tmp/audit.md

An interrupted run resumes: rows already in the CSV for this device, scale and git SHA, measured with the
same settings and versions, are kept; rows with an error are measured again. The report shows each phase's
latest row (by date) on the latest device and scale: an audit of some ops at a new commit updates their
rows only.
"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nnrand.audit", description=__doc__.split("\n\n")[0].strip(),
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", help="comma-separated entry or family names (globs allowed), e.g. 'conv2d*,cumsum'")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="repeats per mode (default %(default)s)")
    ap.add_argument("--scale", choices=SCALES, help="shapes: quick (CPU-sized) or full (GPU); default: full on "
                    "CUDA, quick on the CPU")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    ap.add_argument("--out", help="result CSV (default reports/results/audit{,_quick,_cpu}.csv)")
    ap.add_argument("--md", help="markdown report (default: reports/<CSV stem>.md)")
    ap.add_argument("--rerun", action="store_true", help="measure rows already in the CSV again")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="cudnn.benchmark on in default mode")
    ap.add_argument("--fail-fast", action="store_true", help="stop at the first error instead of recording it")
    ap.add_argument("--list", action="store_true", help="list the selected entries and phases, then exit")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _render_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nnrand.audit render",
                                 description="Re-render the audit markdown from its CSV (nothing is rerun).")
    ap.add_argument("--out", help="result CSV (default: reports/results/audit.csv, else audit_cpu.csv)")
    ap.add_argument("--md", help="markdown report (default: reports/<CSV stem>.md)")
    return ap


def _device(ap: argparse.ArgumentParser, spec: str | None) -> torch.device:
    """``--device`` checked: cpu, or a CUDA device this machine has (default: cuda where available)."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        ap.error(f"--device {spec!r}: {_first_line(e)}")
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        ap.error(f"--device {spec!r}: the audit runs on cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        ap.error(f"--device {spec!r}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    n = torch.cuda.device_count()
    if device.index is not None and device.index >= n:
        ap.error(f"--device {spec!r}: this machine has {n} CUDA device{'s' if n != 1 else ''} (cuda:0 to cuda:{n - 1})")
    return device


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["render"]:
        rp = _render_parser()
        a = rp.parse_args(argv[1:])
        csv_path = Path(a.out) if a.out else next(
            (p for p in (REPO / "reports/results/audit.csv", REPO / "reports/results/audit_cpu.csv") if p.exists()),
            REPO / "reports/results/audit.csv")
        try:
            print(render(csv_path, a.md))
        except FileNotFoundError as e:
            rp.error(str(e))
        return 0
    ap = _parser()
    a = ap.parse_args(argv)
    if a.repeats < 2:
        ap.error(f"--repeats must be at least 2 to compare results, got {a.repeats}")
    if a.ops is not None and not [p for p in a.ops.split(",") if p.strip()]:
        ap.error(f"--ops {a.ops!r} names no op")
    with cublas_workspace():   # before anything touches CUDA: cuBLAS reads it once, at its first call
        device = _device(ap, a.device)
        scale = a.scale or ("full" if device.type == "cuda" else "quick")
        try:
            entries = select(audit_entries(scale), a.ops)
        except AuditError as e:   # an unknown --ops pattern
            ap.error(str(e))
        if a.list:
            for e in entries:
                print(f"{e.name:45s} {e.shape:55s} {', '.join(e.phases())}")
            return 0
        csv_path = Path(a.out) if a.out else default_csv(device, scale)
        run_audit(entries, device=device, repeats=a.repeats, scale=scale, csv_path=csv_path, md_path=a.md,
                  rerun=a.rerun, fail_fast=a.fail_fast, cudnn_benchmark=a.cudnn_benchmark,
                  progress=not a.no_progress)
    md = Path(a.md) if a.md else default_md(csv_path)
    print(f"results: {csv_path}\nreport:  {md}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
