"""Backward reductions through the kernel registry, routed at the PyTorch dispatcher.

    import nnrand
    with nnrand.use_kernels("tree", ops={"conv_wgrad": "atomic"}, strict=True) as routing:
        loss = model(x).sum()
        loss.backward()
    print(routing.coverage)

Forward passes stay torch's, except forward convs where conv_dgrad is routed ``auto`` (below). While the
context is open, the aten backward ops that carry the
nondeterministic reductions run the registry's variants, whoever calls them: any ``nn.Module`` (a subclass
too), a functional call, torchvision/timm models, a ``torch.compile``d model (inductor calls
``convolution_backward`` as an extern kernel) and CUDA-graph captured steps. The door is a
``torch.library`` override at the CPU and CUDA dispatch keys of each aten op in ``ATEN_OPS`` (and of
aten::convolution where forward convs are tuned); the kernel
that was there (``torch.library.get_kernel``) stays callable and runs every configuration no variant
covers (grouped or transposed convs, float64, eval-mode BatchNorm, ...).

Routed ops (the names ``--kernel-op`` takes) and the aten ops they come from:

    conv_wgrad   dW   aten::convolution_backward (output_mask[1])
    conv_dgrad   dX   aten::convolution_backward (output_mask[0])
    bias_grad    every channel reduction: a conv's bias gradient (convolution_backward output_mask[2],
                 registry op ``bias_grad``) and the BatchNorm backward (aten::native_batch_norm_backward,
                 aten::cudnn_batch_norm_backward in training mode; registry op ``bn_bwd``, both sums and dX
                 in one fused pass). nn.Linear's bias gradient is torch's own sum (a fixed-order
                 reduction, deterministic), not routed.
    maxpool_bwd  dX   aten::max_pool2d_with_indices_backward
    conv_wgrad_grouped, conv_dgrad_grouped
                 dW and dX of grouped and depthwise convs (aten::convolution_backward with groups > 1; the
                 bias gradient is bias_grad's)
    adaptive_avg_pool2d_bwd   dX   aten::_adaptive_avg_pool2d_backward
    upsample_bilinear2d_bwd   dX   aten::upsample_bilinear2d_backward (output-size form; explicit scale
                                   factors without align_corners go to the original kernel)
    embedding_bwd             dW   aten::embedding_dense_backward
    index_add, scatter_add    the forward ops aten::index_add(_) and aten::scatter_add(_) (sum): the
                              result is ``self + (the variant's fixed-order sum from zeros)``, one addition
                              into ``self`` per element, so its bits differ from torch's (which adds into
                              ``self`` directly), deterministically
    bn_fwd       the BatchNorm forward in training mode, aten::cudnn_batch_norm (torch's float32 CUDA
                 BatchNorm) on NCHW inputs: statistics from fixed-order shifted sums and y in one more pass;
                 cuDNN's own forward is deterministic, so this is for speed (its NCHW kernel is slow), and
                 runs only where the backward is routed too

The family ``tree`` means each op's fixed-order variant: ``sorted`` for the three scatter sums. The family
``atomic`` keeps torch's BatchNorm forward. The
family ``fastest-deterministic`` is ``tree`` except on the conv ops, which it routes ``auto``: per conv
configuration, the fastest of the deterministic candidates (the registry's deterministic variants and
torch's own kernel under PyTorch's deterministic mode, ``torch_det``), timed once and cached on disk by
``nnrand.autotune``; the coverage names what ran, ``routing.tuner.record()`` every choice. With conv_dgrad
routed ``auto`` the forward convs are tuned too (aten::convolution, tuner key ``conv_fwd``): a stride-1
forward conv is conv_dgrad's ``tree`` on flipped, transposed weights; the tuner's other candidates are the
same form on conv_dgrad's Winograd kernels (float32 3x3 convs with at least 16 channels each side) and
torch's own forward (whose algorithm cuDNN's heuristic picks with cudnn.benchmark off, not always its
fastest). Its
scatter_add with a full index (each element its own destination row, not one index per row broadcast
along it) runs ``fixed``, which needs no sort of the N * D keys (unless scatter_add is set to another
variant); the coverage counts it as ``fixed``.

The routed scatter sums never synchronise with the host: an index out of range fails the kernel with a
device-side assertion that names the op and the index (as torch's own CUDA kernels do), so CUDA graphs
can capture them.

Under ``torch.compile`` only ``convolution_backward`` (and, where forward convs are tuned, ``convolution``,
which inductor also calls as an extern kernel) reaches the override: inductor generates its own max-pool
and BatchNorm backward code (fixed-order gathers and reductions). The coverage says what ran.

Determinism is never claimed falsely. When the routing is deterministic (``tree`` everywhere, or any mix
of deterministic variants), the context also:

* turns on PyTorch's deterministic mode (``torch.use_deterministic_algorithms``), so that ops passed to
  their original kernel pick deterministic algorithms (cuDNN's, sorted ``index_add``, ...) and the ops
  PyTorch knows to have none raise (``strict=True``) or warn (``strict=False``). ``CUBLAS_WORKSPACE_CONFIG``
  is set to ``:4096:8`` while the context is open if it is unset, and deterministic mode's filling of
  uninitialised memory is off (every ``torch.empty`` would otherwise pay a fill);
* refuses, at the forward call that creates them, the ops in ``UNCOVERED`` whose CUDA backward is
  nondeterministic and which nnrand has no variant for (``_adaptive_avg_pool2d`` with an output other
  than 1x1, bilinear upsampling, ...): ``strict=True`` raises :class:`NondeterministicOpError` naming the
  aten op and the module it ran in; ``strict=False`` warns once per op and counts it as ``uncovered``.
  The table judges an op by its CUDA backward on every device, so a model refused on the GPU is refused
  on a laptop first.

``routing.coverage`` counts, per aten op, the calls routed to each variant, passed to the original
kernel (with the reason) or left uncovered. It counts dispatches: replays of a captured CUDA graph run
the captured kernels without dispatching and are not counted.

Contexts do not nest (a second ``use_kernels`` while one is open raises :class:`RoutingError`); on exit,
exceptions included, every override and flag is put back. The dispatcher and PyTorch's flags are
process-wide: while a context is open, backward passes run by other threads are routed (and counted) too;
autograd runs CUDA backward passes on its own threads, so the routing cannot be limited to one thread.
With ``strict=False``, ops PyTorch's deterministic mode only warns about are counted ``uncovered`` when the
warning is shown (a filter that ignores it hides it from the count too).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import threading
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

import kernels
from kernels import runtime

from . import replay

ROUTED_OPS = ("conv_wgrad", "conv_dgrad", "bias_grad", "maxpool_bwd", "conv_wgrad_grouped", "conv_dgrad_grouped",
              "adaptive_avg_pool2d_bwd", "upsample_bilinear2d_bwd", "embedding_bwd", "index_add", "scatter_add",
              "bn_fwd")
# Registry ops behind each routed op: a variant name applies to all of them.
REGISTRY_OPS = {"conv_wgrad": ("conv_wgrad",), "conv_dgrad": ("conv_dgrad",), "bias_grad": ("bias_grad", "bn_bwd"),
                "maxpool_bwd": ("maxpool_bwd",)}
# What a family means for an op whose deterministic variant has another name.
# The atomic family keeps torch's BatchNorm forward (cuDNN's is deterministic): its noise is the backward's.
FAMILY_VARIANTS = {("tree", "embedding_bwd"): "sorted", ("tree", "index_add"): "sorted",
                   ("tree", "scatter_add"): "sorted", ("atomic", "bn_fwd"): "native"}
# fastest-deterministic's scatter_add with a full index (the element form: a sort of N * D keys for
# sorted, where fixed needs none)
ELEMENTWISE_FASTEST = "fixed"
NATIVE = "native"
FASTEST = "fastest-deterministic"
FAMILIES = ("tree", "atomic", NATIVE, FASTEST)  # what --kernel accepts; per-op overrides: any registry name
# Per-shape choice among the deterministic candidates (nnrand.autotune), for the conv ops
AUTO = "auto"
TUNABLE = ("conv_wgrad", "conv_dgrad", "conv_wgrad_grouped", "conv_dgrad_grouped")
ORIGINAL = "original"
UNCOVERED = "uncovered"


class RoutingError(ValueError):
    """A routing that names an unknown op or variant, or a context that cannot be opened."""


class NondeterministicOpError(RuntimeError):
    """Under a deterministic routing with ``strict=True``: an op whose backward is nondeterministic and
    that nnrand does not cover. The message names the aten op and, where known, the module."""

    def __init__(self, op: str, where: str | None, why: str):
        self.op, self.where = op, where
        at = f" in {where}" if where else ""
        super().__init__(
            f"aten::{op}{at}: {why}; nnrand has no deterministic variant for it, so this run would not be "
            "repeatable. Use use_kernels(..., strict=False) (or --no-strict) to run it anyway: it is then "
            "listed as uncovered in the coverage")


# --------------------------------------------------------------------------------------------------
# Resolution: (family, per-op overrides) -> variant per op, checked against the registry


def family_variant(family: str, op: str) -> str:
    """The variant a family means for ``op``: ``fastest-deterministic`` is ``auto`` on the conv ops and
    ``tree``'s choice elsewhere."""
    if family == FASTEST:
        return AUTO if op in TUNABLE else family_variant("tree", op)
    return FAMILY_VARIANTS.get((family, op), family)


@dataclass(frozen=True)
class Auto:
    """What ``Routing.variant`` returns for an op routed ``auto``: the tuner picks per configuration."""

    op: str
    name: str = AUTO
    deterministic: bool = True


def registered_variants(op: str) -> list[str]:
    """Variant names available for routed op ``op``: those every registry op behind it has ([] while
    one of them is not registered)."""
    names: list[str] | None = None
    for reg in REGISTRY_OPS.get(op, (op,)):
        try:
            have = [v.name for v in kernels.variants(reg)]
        except KeyError:
            return []
        names = have if names is None else [n for n in names if n in have]
    return names or []


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """``["conv_wgrad=atomic", ...]`` -> ``{"conv_wgrad": "atomic"}`` (names checked by ``resolve``)."""
    out: dict[str, str] = {}
    for item in items or []:
        op, sep, name = item.partition("=")
        if not sep or not op or not name:
            raise RoutingError(f"--kernel-op expects OP=VARIANT, got {item!r}; ops: {', '.join(ROUTED_OPS)}")
        out[op.strip()] = name.strip()
    return out


@dataclass(frozen=True)
class Routing:
    """The resolved choice per op. ``requested`` is what was asked, ``used`` what runs: they differ only
    where a family (``--kernel tree``) met an op not yet in the registry, which then runs ``native``."""

    family: str
    requested: Mapping[str, str]
    used: Mapping[str, str]
    notes: Mapping[str, str] = field(default_factory=dict)
    scatter_add_elementwise: str | None = None  # what scatter_add with a full index runs, when not used's

    @property
    def is_native(self) -> bool:
        return all(v == NATIVE for v in self.used.values())

    @property
    def deterministic(self) -> bool:
        """True when every routed variant is deterministic (``native`` ops count as deterministic only
        under PyTorch's deterministic mode, which ``use_kernels`` turns on for such routings)."""
        return all(name in (NATIVE, AUTO) or all(kernels.get(reg, name).deterministic
                                                 for reg in REGISTRY_OPS.get(op, (op,)))
                   for op, name in self.used.items())

    @property
    def claims_determinism(self) -> bool:
        """Whether running under this routing claims repeatable results (and so arms the guard)."""
        return not self.is_native and self.deterministic

    def variant(self, op: str, registry_op: str | None = None):
        """The registry variant routed op ``op`` runs for ``registry_op`` (default: ``op``); None: native;
        an :class:`Auto` where the tuner chooses per configuration."""
        name = self.used[op]
        if name == AUTO:
            return Auto(op)
        return None if name == NATIVE else kernels.get(registry_op or op, name)

    @property
    def tuned(self) -> bool:
        return AUTO in self.used.values()

    def describe(self) -> dict:
        return {"family": self.family, "ops": dict(self.used), "requested": dict(self.requested),
                "notes": dict(self.notes), "scatter_add_elementwise": self.scatter_add_elementwise}


def resolve(family: str = "tree", overrides: Mapping[str, str] | None = None) -> Routing:
    """Check names against the registry now and fix the variant per op.

    A family applies to every op; an op that lacks it (not registered yet) falls back to ``native`` with
    a note. An explicit per-op override must exist: unknown ops or variants raise :class:`RoutingError`
    listing the valid names."""
    if family not in FAMILIES:
        raise RoutingError(f"unknown kernel family {family!r}; valid: {', '.join(FAMILIES)}")
    overrides = dict(overrides or {})
    requested = {op: family_variant(family, op) for op in ROUTED_OPS}
    used: dict[str, str] = {}
    notes: dict[str, str] = {}
    for op, name in overrides.items():
        if op not in ROUTED_OPS:
            raise RoutingError(f"unknown op {op!r} in --kernel-op; valid ops: {', '.join(ROUTED_OPS)}")
        valid = registered_variants(op) + ([AUTO] if op in TUNABLE else [])
        if name != NATIVE and name not in valid:
            have = ", ".join([NATIVE, *valid])
            why = "" if valid else f" (op {op} is not in the kernel registry yet)"
            raise RoutingError(f"unknown variant {name!r} for op {op}{why}; valid: {have}")
        requested[op] = name
    for op in ROUTED_OPS:
        name = requested[op]
        if name == NATIVE or name in registered_variants(op) or (name == AUTO and op in TUNABLE):
            used[op] = name
        else:
            used[op] = NATIVE
            valid = registered_variants(op)
            notes[op] = (f"{op} has no variant {name!r} in the registry (registered: "
                         f"{', '.join(valid) or 'none'}); runs native")
    elementwise = None
    if family == FASTEST and "scatter_add" not in overrides and ELEMENTWISE_FASTEST in registered_variants("scatter_add"):
        elementwise = ELEMENTWISE_FASTEST
        notes["scatter_add"] = f"scatter_add with a full index (the element form) runs {elementwise} under {FASTEST}"
    return Routing(family, requested, used, notes, elementwise)


# --------------------------------------------------------------------------------------------------
# Coverage


class Coverage:
    """Per aten op, how many calls went where: a variant name (routed), ``original`` (the kernel that
    was registered before, with the reasons), ``uncovered`` (nondeterministic, no variant)."""

    def __init__(self):
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.reasons: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()   # backward passes of several devices count from their own threads
        # the C++ replay layer's counts (nnrand/replay.py), folded in before any read
        self.sync: Callable[[], None] | None = None

    def add(self, op: str, where: str, reason: str | None = None, n: int = 1) -> None:
        taps = getattr(_TAP, "adds", None)
        if taps is not None:   # a call being recorded for the replay layer: its plan counts the same
            taps.append((op, where, reason))
        with self._lock:
            self.counts[op][where] += n
            if reason:
                self.reasons[op].add(reason)

    def _synced(self) -> dict[str, Counter]:
        if self.sync is not None:
            self.sync()
        return self.counts

    @property
    def uncovered(self) -> list[str]:
        return sorted(op for op, c in self._synced().items() if c[UNCOVERED])

    @property
    def routed(self) -> int:
        return sum(n for c in self._synced().values() for k, n in c.items() if k not in (ORIGINAL, UNCOVERED))

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {op: dict(sorted(c.items())) for op, c in sorted(self._synced().items())}

    def rows(self) -> list[dict]:
        self._synced()
        return [{"aten_op": op, "routed": {k: n for k, n in c.items() if k not in (ORIGINAL, UNCOVERED)},
                 "original": c[ORIGINAL], "uncovered": c[UNCOVERED], "reasons": sorted(self.reasons[op])}
                for op, c in sorted(self.counts.items())]

    def __getitem__(self, op: str) -> dict[str, int]:
        return dict(self._synced().get(op, {}))

    def __repr__(self) -> str:
        if not self._synced():
            return "Coverage(no routed op was called)"
        lines = []
        for r in self.rows():
            routed = ", ".join(f"{k} {n}" for k, n in sorted(r["routed"].items())) or "-"
            why = f" ({'; '.join(r['reasons'])})" if r["reasons"] else ""
            lines.append(f"  aten::{r['aten_op']}: routed {routed}; original {r['original']}; "
                         f"uncovered {r['uncovered']}{why}")
        return "Coverage(\n" + "\n".join(lines) + "\n)"


# --------------------------------------------------------------------------------------------------
# The overrides. Each gets the active session and the original kernel; it returns what the aten op
# returns. Unsupported configurations go to the original kernel, counted with the reason.


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """channels_last only when the tensor is channels_last and not also NCHW-contiguous (as the
    kernels' ``layout_of`` decides); everything else is made NCHW-contiguous."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))


ROUTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _floating(*ts) -> bool:
    """float32, or the half dtypes autocast runs in (the registry widens them to float32 exactly, runs the
    variant and rounds each output once; mixed bf16 and fp16 is refused there, counted as original)."""
    return all(t is None or t.dtype in ROUTED_DTYPES for t in ts)


def _torch_det_ok() -> bool:
    """Whether torch's own conv kernels are deterministic now: PyTorch's deterministic mode, which a
    deterministic routing turns on (cuDNN's deterministic algorithms, picked by its heuristic with
    cudnn.benchmark off). Only then may they be a tuner candidate (``torch_det``)."""
    return torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic \
        and not torch.backends.cudnn.benchmark


def _call(v, rng, *args, **kwargs):
    """A variant on the tensors' device: the CUDA launcher, or the CPU model with ``rng``; half inputs
    through the registry's widening call."""
    half = any(isinstance(a, torch.Tensor) and a.dtype in kernels.HALF_DTYPES for a in args)
    return _variant_fn(v, rng, args[0].is_cuda, half)(*args, **kwargs)


def _tuned(s: "_Session", auto: Auto, grad: int, original, keyset, args: tuple, x, w, geom: dict, fmt,
           variant_args: tuple, variant_kwargs: dict):
    """The variant the tuner picks for ``auto.op`` on this call (None: torch's own kernel, ``torch_det``).
    ``grad``: 0 for dX, 1 for dW (the slot in convolution_backward's output mask)."""
    from . import autotune

    det_ok = _torch_det_ok()
    # the tuner's choice for a configuration among one candidate set never changes once made: remember it
    # per call signature, so a step's later calls skip building the candidates and the key (host time)
    memo_key = (auto.op, grad, x.shape, w.shape, x.dtype, x.device, fmt, geom["stride"], geom["padding"],
                geom["dilation"], geom.get("groups", 1), det_ok)
    hit = s.tuned_memo.get(memo_key, s)
    if hit is not s:
        return hit
    candidates: dict[str, Callable[[], object]] = {}
    variants = {}
    half_cuda = x.is_cuda and x.dtype in kernels.HALF_DTYPES
    for v in kernels.variants(auto.op):
        # a launcher whose half calls are another variant's (``half_as``: the Winograd ones run tree's
        # tensor-core kernels) is no second candidate for them: the tuner would pick between equals by noise
        if v.deterministic and not (half_cuda and getattr(v.cuda, "half_as", None)):
            variants[v.name] = v
            candidates[v.name] = (lambda v=v: _call(v, s.rng, *variant_args, **variant_kwargs))
    if det_ok:
        mask = [grad == 0, grad == 1, False]
        candidates[autotune.TORCH_DET] = lambda: original.call_boxed(keyset, *args, mask)
    layout = "channels_last" if fmt == torch.channels_last else "nchw"
    key = autotune.conv_key(auto.op, x, w, geom["stride"], geom["padding"], geom["dilation"],
                            geom.get("groups", 1), layout)
    name = s.tuner.choose(key, x.device, candidates)
    s.tuned_memo[memo_key] = variants.get(name)
    return variants.get(name)


@dataclass(frozen=True)
class _ConvPlan:
    """What ``_conv_backward`` does for one call signature, decided once: a reason to pass the call on,
    or the variants per gradient (None: torch's kernel in ``native_mask``), the layouts, the label the
    coverage counts. Everything here is a function of the signature ``_conv_key`` builds."""
    why: str | None
    fmt: torch.memory_format = torch.contiguous_format
    w_fmt: torch.memory_format = torch.contiguous_format
    out_fmt: torch.memory_format = torch.contiguous_format
    dgrad: Callable | None = None
    wgrad: Callable | None = None
    bias: Callable | None = None
    native_mask: list[bool] | None = None
    dgrad_kw: dict | None = None
    wgrad_kw: dict | None = None
    label: str = ORIGINAL
    reason: str | None = None
    # half CUDA tensors for launchers that take float32: dgrad/wgrad/bias are the launchers, their inputs
    # widened here (dy once for all of them) and each output rounded as the registry's call rounds it
    wide: bool = False
    ops: tuple[str, str, str] = ("", "", "")   # registry ops of (dgrad, wgrad, bias), for the rounding


def _variant_fn(v, rng, cuda: bool, half: bool) -> Callable:
    """What runs variant ``v`` on tensors of one kind (CUDA or not, half or not): the CUDA launcher, or the
    registry's call with ``rng`` (CPU tensors; half tensors a launcher does not take itself)."""
    if cuda and (v.half_native or not half):
        return v.cuda
    return functools.partial(v, rng=rng)


def _prepared(fn: Callable | None, args: tuple, kw: dict) -> tuple[Callable | None, dict]:
    """``fn`` (a variant's CUDA launcher) prepared for the call signature of ``args`` and ``kw`` where it can
    be (``fn.prepare``: validated, planned and its launches configured once; the plan is keyed by that
    signature), then called with the tensors alone; else ``fn`` with its keyword arguments. A refusal is
    left to the call, where it is counted. The kernel modules' settings (split rules, tile choices, the
    tensor-core engine) are read then: once per signature for the session's lifetime."""
    prepare = getattr(fn, "prepare", None)
    if prepare is None:
        return fn, kw
    try:
        return prepare(*args, **kw), {}
    except kernels.KernelArgumentError:
        return fn, kw


def _conv_key(s: "_Session", dy, x, w, stride, padding, dilation, transposed, output_padding, groups, mask) -> tuple:
    """A convolution_backward call's signature: everything its plan depends on (dtypes, device, shapes,
    strides, geometry, mask, and whether torch's kernel may stand in as a deterministic one)."""
    det_ok = None
    if s.conv_auto:
        det_ok = _torch_det_ok()
    return (dy.dtype, x.dtype, w.dtype, x.device, dy.shape, dy.stride(), x.shape, x.stride(), w.shape, w.stride(),
            tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding), groups,
            tuple(mask), det_ok)


PLAN_LIMIT = 4096  # call signatures remembered per session (a model has a few dozen)


def _conv_backward(s: "_Session", original, keyset, dy, x, w, bias_sizes, stride, padding, dilation, transposed,
                   output_padding, groups, mask):
    op = "convolution_backward"
    key = _conv_key(s, dy, x, w, stride, padding, dilation, transposed, output_padding, groups, mask)
    plan = s.conv_plans.get(key)
    if plan is None:
        plan = _conv_plan(s, original, keyset, dy, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, mask)
        if len(s.conv_plans) < PLAN_LIMIT:
            s.conv_plans[key] = plan
    args = (dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    why = plan.why
    if why is None:
        try:
            dx, dw, db = (_conv_widened if plan.wide else _conv_variants)(plan, dy, x, w)
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, *args, mask)
    if plan.native_mask is not None:
        ndx, ndw, ndb = original.call_boxed(keyset, *args, plan.native_mask)
        dx = ndx if plan.native_mask[0] else dx
        dw = ndw if plan.native_mask[1] else dw
        db = ndb if plan.native_mask[2] else db
    if dx is not None:
        dx = dx.contiguous(memory_format=plan.out_fmt)
    if dw is not None:
        dw = _param_strides(dw.contiguous(memory_format=plan.out_fmt), w)
    s.coverage.add(op, plan.label, plan.reason)
    return dx, dw, db


def _conv_variants(plan: _ConvPlan, dy, x, w):
    """The plan's variants on the inputs in the plan's layouts (None where a gradient is not routed)."""
    dy_ = dy.contiguous(memory_format=plan.fmt)
    dx = dw = db = None
    if plan.dgrad is not None:
        dx = plan.dgrad(w.contiguous(memory_format=plan.w_fmt), dy_, **plan.dgrad_kw)
    if plan.wgrad is not None:
        dw = plan.wgrad(x.contiguous(memory_format=plan.fmt), dy_, **plan.wgrad_kw)
    if plan.bias is not None:
        db = plan.bias(dy_)
    return dx, dw, db


def _conv_widened(plan: _ConvPlan, dy, x, w):
    """The plan's variants on float32 copies of half inputs (exact), dy widened once for all of them; each
    output rounded once to the dtype the registry's widening call gives it: the same bits as that call."""
    round_outputs = kernels.registry.round_outputs
    dy_ = dy.contiguous(memory_format=plan.fmt)
    dyf = dy_.float()
    dx = dw = db = None
    if plan.dgrad is not None:
        w_ = w.contiguous(memory_format=plan.w_fmt)
        dx = round_outputs(plan.ops[0], plan.dgrad(w_.float(), dyf, **plan.dgrad_kw), (w_, dy_))
    if plan.wgrad is not None:
        x_ = x.contiguous(memory_format=plan.fmt)
        dw = round_outputs(plan.ops[1], plan.wgrad(x_.float(), dyf, **plan.wgrad_kw), (x_, dy_))
    if plan.bias is not None:
        db = round_outputs(plan.ops[2], plan.bias(dyf), (dy_,))
    return dx, dw, db


def _conv_plan(s: "_Session", original, keyset, dy, x, w, bias_sizes, stride, padding, dilation, transposed,
               output_padding, groups, mask) -> _ConvPlan:
    """The plan of one convolution_backward signature; runs the tuner on the first call of a configuration
    routed ``auto``. A refusal a variant raises at run time is not part of it (counted per call)."""
    if transposed:
        return _ConvPlan("transposed conv")
    if x.dim() != 4:
        return _ConvPlan(f"{x.dim() - 2}-D conv")
    if not _floating(dy, x, w):
        return _ConvPlan(f"dtype {x.dtype}")
    args = (dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    plan = list(s.conv if groups == 1 else s.conv_grouped)  # (wgrad, dgrad, bias)
    fmt, w_fmt = memory_format_of(x), memory_format_of(w)
    need = [bool(m) for m in mask]
    geom = dict(stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation))
    if groups != 1:
        geom["groups"] = int(groups)
    dy_, x_, w_ = dy.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt), w.contiguous(memory_format=w_fmt)
    dgrad_kw = dict(input_size=tuple(x.shape[-2:]), **geom)
    wgrad_kw = dict(kernel_size=tuple(w.shape[-2:]), **geom)
    try:
        if need[0] and isinstance(plan[1], Auto):
            plan[1] = _tuned(s, plan[1], 0, original, keyset, args, x, w, geom, fmt,
                             (w_, dy_), dgrad_kw)
        if need[1] and isinstance(plan[0], Auto):
            plan[0] = _tuned(s, plan[0], 1, original, keyset, args, x, w, geom, fmt, (x_, dy_), wgrad_kw)
    except kernels.KernelArgumentError as e:
        return _ConvPlan(str(e))
    native_mask = [need[0] and plan[1] is None, need[1] and plan[0] is None, need[2] and plan[2] is None]
    cuda = x.is_cuda
    half = any(t.dtype in kernels.HALF_DTYPES for t in (dy, x, w))
    routed = [v for v, needed in zip((plan[1], plan[0], plan[2]), need) if needed and v is not None]
    wide = cuda and half and bool(routed) and not any(v.half_native for v in routed)
    if wide:
        try:   # bf16 beside fp16 is refused, as the registry's call refuses it
            kernels.registry.half_dtype("convolution_backward", (dy, x, w))
        except kernels.KernelArgumentError as e:
            return _ConvPlan(str(e))
    # what runs per asked gradient: a variant's name, or torch_det where the tuner chose torch's kernel
    tuned = s.conv_tuned if groups == 1 else s.conv_grouped_tuned
    ran = sorted({v.name if v is not None else "torch_det" for v, needed, t in zip(plan, (need[1], need[0], need[2]),
                                                                                    tuned)
                  if needed and (v is not None or t)})
    dgrad = _variant_fn(plan[1], s.rng, cuda, half and not wide) if need[0] and plan[1] is not None else None
    wgrad = _variant_fn(plan[0], s.rng, cuda, half and not wide) if need[1] and plan[0] is not None else None
    if not wide:
        dgrad, dgrad_kw = _prepared(dgrad, (w_, dy_), dgrad_kw)
        wgrad, wgrad_kw = _prepared(wgrad, (x_, dy_), wgrad_kw)
    return _ConvPlan(
        None, fmt=fmt, w_fmt=w_fmt,
        # torch's layout contract for this op (its meta kernel, which torch.compile checks): dX and dW are
        # channels_last when the input or the weight is, else contiguous
        out_fmt=torch.channels_last if torch.channels_last in (fmt, w_fmt) else torch.contiguous_format,
        dgrad=dgrad, wgrad=wgrad,
        bias=_variant_fn(plan[2], s.rng, cuda, half and not wide) if need[2] and plan[2] is not None else None,
        native_mask=native_mask if any(native_mask) else None, dgrad_kw=dgrad_kw, wgrad_kw=wgrad_kw,
        label="+".join(ran) if ran else ORIGINAL, reason=None if ran else "no routed gradient was asked for",
        wide=wide, ops=tuple(v.op if v is not None and not isinstance(v, Auto) else "" for v in (plan[1], plan[0], plan[2])))


# --------------------------------------------------------------------------------------------------
# Forward convolutions under ``auto``. Forward convs are deterministic in torch under its deterministic
# mode, but with cudnn.benchmark off (as that mode needs) cuDNN's heuristic sometimes picks a slow algorithm
# (FFT for 3x3 64->64 at 32x32 on an H200, 4x its implicit GEMM). A stride-1 forward conv is the data
# gradient of the conv with flipped, transposed weights (kernels/conv_dgrad.py, "forward form"), so when
# conv_dgrad is routed ``auto`` the tuner also picks, per forward configuration, between that form of
# conv_dgrad's ``tree``, the same form on its Winograd kernels where they apply (``winograd``) and torch's
# own forward (``torch_det``): key op ``conv_fwd``.
#
# Only forwards that record a backward are tuned (grad enabled, an input or the weight requiring it): a
# training step's. Evaluation under no_grad runs torch's forward, so its bits never depend on whether a
# run's record already held the evaluation's shapes (a resume from a checkpoint written before the first
# evaluation) or on whether it ran inside the routing at all (a final evaluation after the training loop).

FORWARD_ATEN = "convolution"
FORWARD_KEY = "conv_fwd"
_NO_GRAD = "no backward recorded (evaluation, no_grad): torch's forward"


@dataclass(frozen=True)
class _ForwardPlan:
    """What ``_conv_forward`` does for one call signature: ``fn(x, w, bias) -> y`` (the forward form on
    conv_dgrad's tree or Winograd kernels, bias added, in torch's output layout), or None for torch's
    kernel, with the label and reason the coverage counts."""
    fn: Callable | None
    label: str
    reason: str | None = None


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _forward_form(x, w, bias, pad, out_fmt, run=None):
    """The forward form with torch's conv contract: bias added, the output in ``out_fmt`` (channels_last
    when the input or the weight is; both dense in one of the two layouts: ``_forward_plan`` checks).
    ``run(x, w)``: a prepared forward (the Winograd one); None: tree's."""
    if run is not None:
        y = run(x, w)
    else:
        fn = kernels.conv_dgrad.conv_forward_tree_cuda if x.is_cuda else kernels.conv_dgrad.conv_forward_tree_cpu
        y = fn(x, w, padding=pad)
    if bias is not None:
        y.add_(bias.view(1, -1, 1, 1))
    return y.contiguous(memory_format=out_fmt)


def _winograd_forward(x, w, pad):
    """``run(x, w)``, the Winograd forward of this call signature (on CUDA prepared at its first call, its
    launches configured for the signature: none where the tuner picks another candidate without timing
    it; on a CPU its order model), or None where it would not run the Winograd kernels (tree's form is
    the candidate there already)."""
    wino = kernels.conv_dgrad_winograd
    if not wino.forward_applies(x, w, pad):
        return None
    if not x.is_cuda:
        return functools.partial(wino.conv_forward_winograd_cpu, padding=pad)
    prepared: list[Callable] = []

    def run(x, w):
        if not prepared:   # (two threads preparing at once both make a valid plan; the first is kept)
            prepared.append(wino.prepare_forward(x, w, padding=pad))
        return prepared[0](x, w)
    return run


def _forward_plan(s: "_Session", original, keyset, args: tuple) -> _ForwardPlan:
    from . import autotune

    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    why = None
    if not _torch_det_ok():
        why = "torch's deterministic mode is off"
    elif transposed or x.dim() != 4 or groups != 1:
        why = "transposed, grouped or not 2-D"
    elif _pair(stride) != (1, 1) or _pair(dilation) != (1, 1):
        why = "stride or dilation other than 1"
    elif not _floating(x, w, bias) or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        why = f"dtype {x.dtype}"
    elif _pair(padding)[0] > w.shape[-2] - 1 or _pair(padding)[1] > w.shape[-1] - 1:
        why = "padding wider than the kernel"
    elif not (_dense(x) and _dense(w)):   # a channel slice, say: torch's layout rules for those are its own
        why = "input or weight not dense in NCHW or channels_last"
    if why is not None:
        return _ForwardPlan(None, ORIGINAL, why)
    pad = _pair(padding)
    fmt, w_fmt = memory_format_of(x), memory_format_of(w)
    out_fmt = torch.channels_last if torch.channels_last in (fmt, w_fmt) else torch.contiguous_format
    layout = "channels_last" if fmt == torch.channels_last else "nchw"
    if w_fmt == torch.channels_last and layout == "nchw":
        layout = "nchw/w:channels_last"   # the output is channels_last: another configuration
    key = autotune.conv_key(FORWARD_KEY, x, w, (1, 1), pad, (1, 1), 1, layout)
    if s.tuner.pinned_only and key not in s.tuner.pinned:
        # a plan from a run whose forward convs were not tuned: torch's forward, which every process
        # following the plan takes alike, never a timing
        return _ForwardPlan(None, autotune.TORCH_DET, "not in the pinned plan")
    candidates = {"tree": lambda: _forward_form(x, w, bias, pad, out_fmt),
                  autotune.TORCH_DET: lambda: original.call_boxed(keyset, *args)}
    wino = _winograd_forward(x, w, pad)
    if wino is not None:
        candidates["winograd"] = lambda: _forward_form(x, w, bias, pad, out_fmt, wino)
    choice = s.tuner.choose(key, x.device, candidates)
    if choice == "tree":
        return _ForwardPlan(functools.partial(_forward_form, pad=pad, out_fmt=out_fmt), "tree")
    if choice == "winograd":
        return _ForwardPlan(functools.partial(_forward_form, pad=pad, out_fmt=out_fmt, run=wino), "winograd")
    return _ForwardPlan(None, autotune.TORCH_DET)


def _conv_forward(s: "_Session", original, keyset, x, w, bias, stride, padding, dilation, transposed,
                  output_padding, groups):
    args = (x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        s.coverage.add(FORWARD_ATEN, ORIGINAL, _NO_GRAD)
        return original.call_boxed(keyset, *args)
    key = (x.dtype, w.dtype, None if bias is None else bias.dtype, x.device, x.shape, x.stride(), w.shape, w.stride(),
           tuple(stride), tuple(padding), tuple(dilation), bool(transposed), groups, _torch_det_ok())
    plan = s.fwd_plans.get(key)
    if plan is None:
        plan = _forward_plan(s, original, keyset, args)
        if len(s.fwd_plans) < PLAN_LIMIT:
            s.fwd_plans[key] = plan
    if plan.fn is not None:
        try:
            y = plan.fn(x, w, bias)
        except kernels.KernelArgumentError as e:   # a call the launcher refuses: torch's, counted with why
            s.coverage.add(FORWARD_ATEN, ORIGINAL, str(e))
            return original.call_boxed(keyset, *args)
        s.coverage.add(FORWARD_ATEN, plan.label)
        return y
    s.coverage.add(FORWARD_ATEN, plan.label, plan.reason)
    return original.call_boxed(keyset, *args)


def _param_strides(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``g`` (dense, ``p``'s shape) with ``p``'s own strides where the two differ only in dimensions of
    size 1 (a 1x1 kernel's weight reads the same in either layout): the same bytes, a view. A parameter's
    gradient with its strides is what DistributedDataParallel's buckets expect (it warns and copies
    otherwise), and the layout contract still holds (it ignores the strides of size-1 dimensions)."""
    if g.stride() == p.stride() or g.shape != p.shape:
        return g
    if all(gs == ps for gs, ps, n in zip(g.stride(), p.stride(), g.shape) if n != 1):
        return g.as_strided(p.shape, p.stride())
    return g


def _pool_refusal(dy: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why a pooling backward goes to torch's kernel before its variant sees it (an unbatched input, a dtype
    the variants do not take, no elements), or None."""
    if x.dim() != 4:
        return "unbatched input"
    if not _floating(dy, x):
        return f"dtype {x.dtype}"
    if dy.numel() == 0:
        return "empty input"
    return None


def _maxpool_backward(s: "_Session", original, keyset, dy, x, kernel_size, stride, padding, dilation, ceil_mode,
                      indices):
    op = "max_pool2d_with_indices_backward"
    why = _pool_refusal(dy, x)
    if why is None:
        fmt = memory_format_of(indices)
        k = _pair(kernel_size)
        try:
            dx = _call(s.pool, s.rng, dy.contiguous(memory_format=fmt), indices.contiguous(memory_format=fmt),
                       input_size=tuple(x.shape[-2:]), kernel_size=k, stride=_pair(stride) if len(stride) else k,
                       padding=_pair(padding), dilation=_pair(dilation), ceil_mode=bool(ceil_mode))
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, dy, x, kernel_size, stride, padding, dilation, ceil_mode, indices)
    s.coverage.add(op, s.pool.name)
    return dx.contiguous(memory_format=memory_format_of(x))


def _adaptive_pool_backward(s: "_Session", original, keyset, dy, x):
    op = "_adaptive_avg_pool2d_backward"
    why = _pool_refusal(dy, x)
    if why is None:
        try:
            dx = _call(s.aap, s.rng, dy.contiguous(memory_format=memory_format_of(x)), input_size=tuple(x.shape[-2:]))
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, dy, x)
    s.coverage.add(op, s.aap.name)
    return dx.contiguous(memory_format=memory_format_of(x))


def _upsample_backward(s: "_Session", original, keyset, dy, output_size, input_size, align_corners, *scales,
                       **kw_scales):
    op = "upsample_bilinear2d_backward"
    given = [v for v in (*scales, *kw_scales.values()) if v is not None]
    why = None
    if given and not align_corners:
        why = "explicit scale factors (the variants take the output-size form)"
    elif len(input_size) != 4 or dy.dim() != 4:
        why = "not a 4-D input"
    elif not _floating(dy):
        why = f"dtype {dy.dtype}"
    elif dy.numel() == 0:
        why = "empty input"
    if why is None:
        try:
            dx = _call(s.up, s.rng, dy.contiguous(memory_format=memory_format_of(dy)),
                       input_size=(int(input_size[2]), int(input_size[3])), align_corners=bool(align_corners))
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, dy, output_size, input_size, align_corners, *scales, **kw_scales)
    s.coverage.add(op, s.up.name)
    return dx.contiguous(memory_format=memory_format_of(dy))


# How the routed scatter sums check their indices: in the kernels (a device-side assertion on a bad index,
# as torch's own CUDA kernels), never by a host synchronisation (kernels.index_add.RangeCheck). The
# embedding's indices were checked by its forward already.
CHECK_RANGE = "device"


def _embedding_backward(s: "_Session", original, keyset, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    op = "embedding_dense_backward"
    why = None
    if not _floating(grad):
        why = f"dtype {grad.dtype}"
    elif indices.dtype not in (torch.int64, torch.int32):
        why = f"index dtype {indices.dtype}"
    if why is None:
        try:
            gw = _call(s.emb, s.rng, grad.contiguous(), indices.contiguous().long(), num_weights=int(num_weights),
                       padding_idx=int(padding_idx), scale_grad_by_freq=bool(scale_grad_by_freq),
                       check_range=CHECK_RANGE)
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    s.coverage.add(op, s.emb.name)
    return gw


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` first and the other dims flattened: (t.shape[dim], rest); the rest's size is
    spelled out, since reshape cannot infer it from zero elements (an empty index)."""
    rest = 1
    for k, n in enumerate(t.shape):
        rest *= n if k != dim else 1
    return t.movedim(dim, 0).reshape(t.shape[dim], rest)


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    shape = (like.shape[dim], *(n for k, n in enumerate(like.shape) if k != dim))
    return rows.reshape(shape).movedim(0, dim)


def _scatter_sum(s: "_Session", variant, op, original, keyset, inplace: bool, self_, dim, index, src, **kw):
    """index_add / scatter_add as ``self + (fixed-order sum of what lands in each element)``: the sum runs
    the variant from zeros, then one addition into ``self`` (torch adds into ``self`` directly, so the bits
    differ from its, deterministically). scatter_add with a full index (not one index per row broadcast
    along the row) runs ``s.scatter_add_elementwise``."""
    alpha = kw.get("alpha", 1)
    why = None
    if self_.dim() == 0 or not _floating(self_, src) or self_.dtype != src.dtype:
        why = "0-D" if self_.dim() == 0 else f"dtype {src.dtype} into {self_.dtype}"
    elif index.dtype not in (torch.int64, torch.int32):
        why = f"index dtype {index.dtype}"
    if why is None:
        d = dim % self_.dim()
        if op == "scatter_add" and (index.shape != src.shape or
                                    any(index.shape[k] != self_.shape[k] for k in range(self_.dim()) if k != d)):
            why = "index smaller than src or self outside the scattered dim"
        elif op == "index_add" and index.dim() > 1:
            why = "multi-dimensional index"
        elif op == "index_add" and (src.dim() != self_.dim() or index.numel() != src.shape[d] or
                                    any(src.shape[k] != self_.shape[k] for k in range(self_.dim()) if k != d)):
            why = "source shape does not match self and index"   # torch's kernel raises its own error
    if why is None:
        try:
            source = src if alpha == 1 else src * alpha
            if op == "index_add":
                rows = _call(variant, s.rng, index.reshape(-1).long(), _rows(source, d), num_rows=self_.shape[d],
                             check_range=CHECK_RANGE)
            else:
                key = _rows(index, d).long()
                if key.shape[1] > 1 and key.stride(1) != 0:  # a full index: the element form
                    variant = s.scatter_add_elementwise
                rows = _call(variant, s.rng, key, _rows(source, d), num_rows=self_.shape[d], check_range=CHECK_RANGE)
            total = _from_rows(rows, self_, d)
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, self_, dim, index, src, **kw)
    s.coverage.add(op, variant.name)
    if inplace:
        return self_.add_(total)
    # torch's kernel (and its meta) returns a contiguous result whatever self's strides
    return self_.clone(memory_format=torch.contiguous_format).add_(total)


def _bn_route(s: "_Session", dy, x, weight, save_mean, save_invstd, train: bool):
    """(dx, dgamma, dbeta) from the bn_bwd variant, or a reason to pass the call on."""
    if not train:
        return "eval-mode BatchNorm (elementwise dX)"
    if save_mean is None or save_invstd is None or not save_mean.numel():
        return "no saved batch statistics"
    if x.dim() not in (2, 3, 4):
        return f"{x.dim()}-D input"
    if not _floating(dy, x, weight, save_mean, save_invstd):
        return f"dtype {x.dtype}"
    if x.numel() == 0:
        return "empty input"
    shape = x.shape
    if x.dim() == 3:  # (N, C, L) as NCHW (N, C, L, 1)
        x4, dy4 = x.contiguous().unsqueeze(-1), dy.contiguous().unsqueeze(-1)
    elif x.dim() == 4:
        fmt = memory_format_of(x)
        x4, dy4 = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    else:
        x4, dy4 = x.contiguous(), dy.contiguous()
    try:
        dx, dgamma, dbeta = _call(s.bn, s.rng, dy4, x4, save_mean, save_invstd, weight)
    except kernels.KernelArgumentError as e:
        return str(e)
    return dx.view(shape) if x.dim() == 3 else dx, dgamma, dbeta


def _native_bn_backward(s: "_Session", original, keyset, dy, x, weight, running_mean, running_var, save_mean,
                        save_invstd, train, eps, mask):
    op = "native_batch_norm_backward"
    out = _bn_route(s, dy, x, weight, save_mean, save_invstd, train)
    if isinstance(out, str):
        s.coverage.add(op, ORIGINAL, out)
        return original.call_boxed(keyset, dy, x, weight, running_mean, running_var, save_mean, save_invstd,
                                   train, eps, mask)
    s.coverage.add(op, s.bn.name)
    dx, dgamma, dbeta = out
    return (dx if mask[0] else None), (dgamma if mask[1] and weight is not None else None), \
        (dbeta if mask[2] else None)


def _cudnn_bn_backward(s: "_Session", original, keyset, x, dy, weight, running_mean, running_var, save_mean,
                       save_var, eps, reserve):
    op = "cudnn_batch_norm_backward"
    out = _bn_route(s, dy, x, weight, save_mean, save_var, True)  # cuDNN's save_var is 1/sqrt(var+eps)
    if isinstance(out, str):
        s.coverage.add(op, ORIGINAL, out)
        return original.call_boxed(keyset, x, dy, weight, running_mean, running_var, save_mean, save_var, eps,
                                   reserve)
    s.coverage.add(op, s.bn.name)
    return out


def _cudnn_bn_forward(s: "_Session", original, keyset, x, weight, bias, running_mean, running_var, training,
                      factor, eps):
    """torch's float32 CUDA BatchNorm in training (aten::cudnn_batch_norm) on an NCHW 4-D input through the bn_fwd
    variant: output, the saved mean and inverse std (what cuDNN saves and cudnn_batch_norm_backward reads), and an
    empty reserve space, which is what cuDNN's forward gives there too (its spatial mode keeps no state for the
    backward; tests/test_routing_gpu.py checks both, and a backward run by cuDNN after the context). channels_last
    inputs keep cuDNN's forward: its persistent mode may keep state in the reserve, and it is as fast there."""
    op = "cudnn_batch_norm"
    if not training:
        why = "eval-mode BatchNorm (running statistics)"
    elif s.bn is None:   # routed in pairs, as measured
        why = "BatchNorm backward not routed (bias_grad native)"
    elif x.dtype != torch.float32:
        why = f"dtype {x.dtype}"
    elif x.dim() != 4 or not x.is_contiguous():
        why = f"{x.dim()}-D input" if x.dim() != 4 else "channels_last input (cuDNN's persistent mode)"
    elif x.numel() == 0 or x.numel() // x.shape[1] < 2:
        why = "fewer than 2 values per channel"
    else:
        try:
            y, mean, invstd = _call(s.bn_fwd, s.rng, x, weight, bias, running_mean, running_var, factor, eps)
            why = None
        except kernels.KernelArgumentError as e:
            why = str(e)
    if why is not None:
        s.coverage.add(op, ORIGINAL, why)
        return original.call_boxed(keyset, x, weight, bias, running_mean, running_var, training, factor, eps)
    s.coverage.add(op, s.bn_fwd.name)
    return y, mean, invstd, torch.empty(0, dtype=torch.uint8, device=x.device)


@dataclass(frozen=True)
class AtenRoute:
    op: str                     # aten op name (default overload)
    routed: tuple[str, ...]     # the routed ops it serves; overridden only when one of them is not native
    handler: Callable
    keys: tuple[str, ...] = ("CPU", "CUDA")


def _index_add(s, original, keyset, self_, dim, index, source, **kw):
    return _scatter_sum(s, s.index_add, "index_add", original, keyset, False, self_, dim, index, source, **kw)


def _index_add_(s, original, keyset, self_, dim, index, source, **kw):
    return _scatter_sum(s, s.index_add, "index_add", original, keyset, True, self_, dim, index, source, **kw)


def _scatter_add(s, original, keyset, self_, dim, index, src):
    return _scatter_sum(s, s.scatter_add, "scatter_add", original, keyset, False, self_, dim, index, src)


def _scatter_add_(s, original, keyset, self_, dim, index, src):
    return _scatter_sum(s, s.scatter_add, "scatter_add", original, keyset, True, self_, dim, index, src)


ATEN_OPS = (
    AtenRoute("convolution_backward", ("conv_wgrad", "conv_dgrad", "bias_grad", "conv_wgrad_grouped",
                                       "conv_dgrad_grouped"), _conv_backward),
    AtenRoute("max_pool2d_with_indices_backward", ("maxpool_bwd",), _maxpool_backward),
    AtenRoute("native_batch_norm_backward", ("bias_grad",), _native_bn_backward),
    AtenRoute("cudnn_batch_norm_backward", ("bias_grad",), _cudnn_bn_backward, ("CUDA",)),
    AtenRoute("cudnn_batch_norm", ("bn_fwd",), _cudnn_bn_forward, ("CUDA",)),
    AtenRoute("_adaptive_avg_pool2d_backward", ("adaptive_avg_pool2d_bwd",), _adaptive_pool_backward),
    AtenRoute("upsample_bilinear2d_backward", ("upsample_bilinear2d_bwd",), _upsample_backward),
    AtenRoute("embedding_dense_backward", ("embedding_bwd",), _embedding_backward),
    AtenRoute("index_add", ("index_add",), _index_add),
    AtenRoute("index_add_", ("index_add",), _index_add_),
    AtenRoute("scatter_add", ("scatter_add",), _scatter_add),
    AtenRoute("scatter_add_", ("scatter_add",), _scatter_add_),
)


# --------------------------------------------------------------------------------------------------
# The guard: forward ops whose CUDA backward is nondeterministic (PyTorch raises for them in
# deterministic mode) and that nnrand does not route. Checked at the forward call, where the module
# that runs it is on the Python stack. ``applies(args)`` says whether this call's backward is the
# nondeterministic one.


@dataclass(frozen=True)
class Uncovered:
    op: str                     # the forward aten op
    backward: str               # its nondeterministic aten op (the backward, or the op itself)
    applies: Callable[..., bool] = lambda *a: True
    forward: bool = False       # the forward itself is nondeterministic (checked whether or not grad flows)
    routed_by: str | None = None  # the routed op that covers its backward (then not guarded while routed)


def _not_1x1(x, output_size, *rest) -> bool:
    return tuple(output_size) != (1, 1)  # torch turns a 1x1 output into mean(), whose backward is exact


UNCOVERED_OPS = (
    Uncovered("_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", _not_1x1, routed_by="adaptive_avg_pool2d_bwd"),
    Uncovered("_adaptive_avg_pool3d", "_adaptive_avg_pool3d_backward"),
    Uncovered("adaptive_max_pool2d", "adaptive_max_pool2d_backward"),
    Uncovered("adaptive_max_pool3d", "adaptive_max_pool3d_backward"),
    Uncovered("avg_pool3d", "avg_pool3d_backward"),
    Uncovered("fractional_max_pool2d", "fractional_max_pool2d_backward"),
    Uncovered("fractional_max_pool3d", "fractional_max_pool3d_backward"),
    Uncovered("upsample_linear1d", "upsample_linear1d_backward"),
    Uncovered("upsample_bilinear2d", "upsample_bilinear2d_backward", routed_by="upsample_bilinear2d_bwd"),
    Uncovered("_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa_backward"),
    Uncovered("upsample_bicubic2d", "upsample_bicubic2d_backward"),
    Uncovered("upsample_trilinear3d", "upsample_trilinear3d_backward"),
    Uncovered("reflection_pad1d", "reflection_pad1d_backward"),
    Uncovered("reflection_pad2d", "reflection_pad2d_backward"),
    Uncovered("reflection_pad3d", "reflection_pad3d_backward"),
    Uncovered("grid_sampler_2d", "grid_sampler_2d_backward"),
    Uncovered("grid_sampler_3d", "grid_sampler_3d_backward"),
    Uncovered("_ctc_loss", "_ctc_loss_backward"),
    # reduction "none" (0) is elementwise: PyTorch's CUDA kernel alerts only for the reductions
    Uncovered("nll_loss2d_forward", "nll_loss2d_forward", lambda x, target, weight, reduction, *rest: reduction != 0,
              forward=True),
    Uncovered("max_unpool2d", "max_unpool2d", forward=True),
    Uncovered("max_unpool3d", "max_unpool3d", forward=True),
)
# Not listed: ops PyTorch makes deterministic in its deterministic mode, which the routing turns on
# (replication padding and max_pool3d backward, index_put with accumulate, ...), and the ops routed above
# (index_add, scatter_add; adaptive pooling and bilinear upsampling while their variants are routed).
# What PyTorch refuses or warns about beyond this table is still caught: see use_kernels.


def _module_on_stack(model: torch.nn.Module | None) -> str | None:
    """The innermost ``nn.Module`` whose ``forward`` is on the Python stack, as ``module NAME (Type)``
    (NAME from ``model`` when given), and the innermost line of user code; only called to word an error."""
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    skip = (os.path.dirname(__file__), os.path.dirname(torch.__file__))
    module = line = None
    for info in inspect.stack(context=0)[2:]:
        me = info.frame.f_locals.get("self")
        if module is None and isinstance(me, torch.nn.Module) and info.function == "forward":
            name = names.get(id(me))
            module = f"module {name} ({type(me).__name__})" if name is not None else f"{type(me).__name__}.forward"
        if line is None and not info.filename.startswith(skip):
            line = f"{info.filename}:{info.lineno}"
        if module is not None and line is not None:
            break
    return ", ".join(p for p in (module, f"called at {line}" if line else None) if p) or None


def _guarded_forward(s: "_Session", original, entry: Uncovered, keyset, *args, **kwargs):
    # any tensor input that records a backward: grid_sample's backward runs (and PyTorch refuses it in
    # deterministic mode) when only the grid requires a gradient
    grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values()))
    if (entry.forward or grad) and entry.applies(*args):
        why = (f"its CUDA {'kernel' if entry.forward else 'backward (aten::' + entry.backward + ')'} adds in an "
               "order that changes from run to run")
        if s.strict:
            raise NondeterministicOpError(entry.op, _module_on_stack(s.model), why)
        s.coverage.add(entry.backward, UNCOVERED)
        if entry.op not in s.warned:
            s.warned.add(entry.op)
            where = _module_on_stack(s.model)
            warnings.warn(f"nnrand: aten::{entry.backward}{f' (from {where})' if where else ''} is nondeterministic "
                          "on CUDA and not covered by nnrand; this run is not guaranteed repeatable",
                          RuntimeWarning, stacklevel=2)
    return original.call_boxed(keyset, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# The session: one open context


def _default_tuner():
    from . import autotune

    return autotune.Tuner()


class _Session:
    """What the overrides read: the routing's variants, the RNG of the CPU atomic models, the counters."""

    def __init__(self, routing: Routing, strict: bool, rng, model, tuner=None):
        self.routing, self.strict, self.rng, self.model = routing, strict, rng, model
        self.coverage = Coverage()
        self.warned: set[str] = set()
        self.overridden: list[str] = []  # aten ops overridden while open
        self.observers: list[Callable[[str, object, tuple], None]] = []
        self.replay = None   # the C++ replay layer over this session's CUDA kernels (nnrand/replay.py)
        self.last_replay: dict | None = None   # its statistics when it closed
        # conv: (wgrad, dgrad, bias) variants or None for native
        self.conv = (routing.variant("conv_wgrad"), routing.variant("conv_dgrad"), routing.variant("bias_grad"))
        self.pool = routing.variant("maxpool_bwd")
        self.bn = routing.variant("bias_grad", "bn_bwd")
        self.bn_fwd = routing.variant("bn_fwd")
        # grouped convs: (wgrad, dgrad, bias); the bias gradient is the same channel sum
        self.conv_grouped = (routing.variant("conv_wgrad_grouped"), routing.variant("conv_dgrad_grouped"), self.conv[2])
        # which slots of those tuples the tuner fills (a None it returns means torch_det, not native)
        self.conv_tuned = tuple(isinstance(v, Auto) for v in self.conv)
        self.conv_grouped_tuned = tuple(isinstance(v, Auto) for v in self.conv_grouped)
        self.tuner = tuner if tuner is not None or not routing.tuned else _default_tuner()
        self.tuned_memo: dict[tuple, object] = {}   # conv call signature -> the tuner's variant (None: torch_det)
        self.conv_auto = any(self.conv_tuned) or any(self.conv_grouped_tuned)
        self.conv_plans: dict[tuple, _ConvPlan] = {}  # _conv_key -> what convolution_backward does there
        # conv_dgrad routed auto: forward convs tuned too (their forward form, see _conv_forward)
        self.conv_fwd_auto = isinstance(self.conv[1], Auto)
        self.fwd_plans: dict[tuple, _ForwardPlan] = {}
        self.aap = routing.variant("adaptive_avg_pool2d_bwd")
        self.up = routing.variant("upsample_bilinear2d_bwd")
        self.emb = routing.variant("embedding_bwd")
        self.index_add = routing.variant("index_add")
        self.scatter_add = routing.variant("scatter_add")
        self.scatter_add_elementwise = (kernels.get("scatter_add", routing.scatter_add_elementwise)
                                        if routing.scatter_add_elementwise else self.scatter_add)

    @property
    def deterministic(self) -> bool:
        return self.routing.claims_determinism


class RoutingContext:
    """What ``use_kernels`` yields: the routing, the coverage, and whether determinism is claimed."""

    def __init__(self, session: _Session):
        self._s = session

    @property
    def routing(self) -> Routing:
        return self._s.routing

    @property
    def coverage(self) -> Coverage:
        return self._s.coverage

    @property
    def strict(self) -> bool:
        return self._s.strict

    @property
    def tuner(self):
        """The :class:`nnrand.autotune.Tuner` of ops routed ``auto`` (None when no op is)."""
        return self._s.tuner

    @property
    def deterministic(self) -> bool:
        """True when this routing claims repeatable results: every routed op deterministic and nothing
        counted uncovered so far (ops PyTorch's deterministic mode only warned about are not counted)."""
        return self._s.deterministic and not self.coverage.uncovered

    @property
    def aten_ops(self) -> list[str]:
        """The aten ops overridden while the context is open."""
        return list(self._s.overridden)

    @property
    def replay(self) -> dict | None:
        """The C++ replay layer's statistics (``nnrand.replay``): per aten op, the call signatures seen, plans
        recorded, calls replayed, calls that went to Python, recordings refused and why. Live while the
        context is open, as they were when it closed after; None where the layer was not used (no CUDA,
        ``NNRAND_REPLAY=0``, no op it takes routed, or it could not be built)."""
        s = self._s
        return s.replay.stats() if s.replay is not None else s.last_replay

    def __repr__(self) -> str:
        return f"RoutingContext(family={self.routing.family!r}, ops={dict(self.routing.used)}, strict={self.strict})"


_LOCK = threading.Lock()
_ACTIVE: _Session | None = None


# Per thread, how many original kernels are running: an original kernel may call other overridden aten ops
# through the dispatcher (torch's CPU index_add runs scatter_add_), and those calls are its own business:
# they go straight to their original kernels, uncounted (else one user call would count twice).
_INSIDE = threading.local()
_TAP = threading.local()   # .adds: the coverage counts of a call being recorded for the replay layer


class _Original:
    """A kernel registered before the override (``torch.library.get_kernel``), whose calls mark the thread
    as inside an original kernel."""

    def __init__(self, handle, op: str = ""):
        self.handle, self.op = handle, op

    def call_boxed(self, keyset, *args, **kwargs):
        rec = runtime.RECORDER
        if rec is not None and rec.thread == threading.get_ident():   # a call recorded for the replay layer
            if self.op in _REPLAY_ORIGINALS:   # a step of the plan (the layer captured this kernel)
                return rec.original(self.op, lambda: self._call(keyset, args, kwargs), args, kwargs)
            rec.refuse(f"an original kernel ran ({self.op or 'torch'}; not captured)")
        return self._call(keyset, args, kwargs)

    def _call(self, keyset, args, kwargs):
        layer = _REPLAY_MODULE
        _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
        if layer is not None:   # the replay layer passes this thread's calls to Python meanwhile
            layer.enter_original()
        try:
            return self.handle.call_boxed(keyset, *args, **kwargs)
        finally:
            _INSIDE.depth -= 1
            if layer is not None:
                layer.leave_original()


def _load_original(op: str, key: str) -> _Original | None:
    """The kernel registered now for ``aten::op`` at ``key``; None where this build has none (the CUDA
    key of a CPU-only torch), so there is nothing to override there."""
    try:
        return _Original(torch.library.get_kernel(f"aten::{op}", key), op)
    except RuntimeError as e:
        if "no kernel for" in str(e):
            return None
        raise RoutingError(f"cannot read the {key} kernel of aten::{op} from torch {torch.__version__}: {e}") from None


def _inside_original() -> bool:
    """Whether an original kernel is running on this thread: called from Python (``_Original``), or from a
    plan of the replay layer (which says so in C++)."""
    if getattr(_INSIDE, "depth", 0):
        return True
    layer = _REPLAY_MODULE
    return layer is not None and layer.inside()


def _bind(fn, session: "_Session", original: _Original, *bound):
    """A guarded op's kernel (``fn(session, original, *bound, keyset, ...)``)."""
    def kernel(keyset, *args, **kwargs):
        if _inside_original():
            return original.handle.call_boxed(keyset, *args, **kwargs)
        return fn(session, original, *bound, keyset, *args, **kwargs)
    return kernel


def _bind_observed(fn, session: "_Session", op: str, original: _Original):
    """A routed op's kernel: the handler, then the session's observers (``observe``) with its outputs and
    arguments. A call the C++ replay layer passes on to be recorded (its second of a signature) runs under
    that layer's recorder."""
    def kernel(keyset, *args, **kwargs):
        if _inside_original():
            return original.handle.call_boxed(keyset, *args, **kwargs)
        layer = session.replay
        if layer is not None and layer.pending(op):
            outer = getattr(_TAP, "adds", None)
            _TAP.adds = taps = []
            try:
                out = layer.record(op, lambda: fn(session, original, keyset, *args, **kwargs), args, kwargs, taps)
            finally:
                _TAP.adds = outer
        else:
            out = fn(session, original, keyset, *args, **kwargs)
        for f in session.observers:
            f(op, out, args)
        return out
    return kernel


def _notify(session: "_Session", op: str, out, args: tuple) -> None:
    """A call the replay layer replayed in C++, reported to the session's observers."""
    for f in session.observers:
        f(op, out, args)


@contextlib.contextmanager
def observe(fn: Callable[[str, object, tuple], None]) -> Iterator[None]:
    """Call ``fn(aten_op, outputs, args)`` after every routed aten op of the open ``use_kernels`` context (what
    ``nnrand.trace`` records with ``ops="routed"``: no cost for the ops nnrand does not route). A second
    observer turns off the replay layer's trace sink (``sink``): every call reaches every observer."""
    s = _ACTIVE
    if s is None:
        raise RoutingError("routing.observe needs an open nnrand.use_kernels context")
    s.observers.append(fn)
    if s.replay is not None:   # calls replayed in C++ are reported to the observers from there
        s.replay.observe(functools.partial(_notify, s))
        if len(s.observers) > 1:
            s.replay.module.sink_share()
    try:
        yield
    finally:
        s.observers.remove(fn)
        if s.replay is not None and not s.observers:
            s.replay.observe(None)


def sink():
    """The replay extension of the open ``use_kernels`` context when its C++ layer replays CUDA calls and
    ``observe`` has exactly one observer (whose records its trace sink may then take: ``nnrand.trace``);
    else None."""
    s = _ACTIVE
    if s is None or s.replay is None or len(s.observers) != 1 or s.replay.key != "CUDA":
        return None
    return s.replay.module


# PyTorch's message when its deterministic mode meets an op it has no deterministic implementation of
_ALERT = re.compile(r"(\S+) does not have a deterministic implementation")


@contextlib.contextmanager
def _counting_alerts(session: "_Session") -> Iterator[None]:
    """With ``strict=False`` PyTorch only warns about such ops: count each warning shown as ``uncovered``
    (the op named as PyTorch names it), then show it as it would have been."""
    previous = warnings.showwarning
    original = getattr(warnings, "_showwarning_orig", None)

    def show(message, category, filename, lineno, file=None, line=None):
        m = _ALERT.search(str(message))
        if m:
            session.coverage.add(m.group(1), UNCOVERED, "PyTorch has no deterministic implementation")
        if previous is original and hasattr(warnings, "_showwarnmsg_impl"):  # the default path, recorders kept
            warnings._showwarnmsg_impl(warnings.WarningMessage(message, category, filename, lineno, file, line))
        else:
            previous(message, category, filename, lineno, file, line)
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


@contextlib.contextmanager
def _deterministic_mode(strict: bool) -> Iterator[None]:
    """PyTorch's deterministic mode for the ops nnrand passes on; everything restored on exit."""
    from torch.utils import deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              det.fill_uninitialized_memory, torch.backends.cudnn.deterministic, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              torch.backends.cudnn.benchmark)
    if before[4] is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's fixed-workspace mode (see PyTorch's docs)
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    det.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    # cudnn.benchmark would pick the forward convs' algorithm by timing, per process: off, as PyTorch's
    # reproducibility notes ask
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]
        torch.backends.cudnn.deterministic = before[3]
        torch.backends.cudnn.benchmark = before[5]
        if before[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


_REPLAY_MODULE = None   # the replay layer's extension while a session has it enabled
_REPLAY_ORIGINALS: frozenset[str] = frozenset()   # aten ops whose original kernel the layer captured


def _capture_replay(ops: list[str]):
    """Before the routing registers its kernels: the replay extension (nnrand/replay.py), with the CUDA
    kernels of ``ops`` registered now taken as the originals its plans may call; None where CUDA is not
    available, the environment turns the layer off, or the extension does not build."""
    if not (ops and replay.requested() and torch.cuda.is_available()):
        return None
    module = replay.load()
    if module is not None:
        replay.capture(module, ops)
    return module


def _open_replay(session: "_Session", module, ops: list[str]) -> None:
    """The C++ replay layer over the session's CUDA kernels of ``ops``."""
    global _REPLAY_MODULE, _REPLAY_ORIGINALS
    coverage = session.coverage
    session.replay = replay.Layer(module, ops, lambda op, where, reason, n: coverage.add(op, where, reason, n))
    coverage.sync = session.replay.drain
    _REPLAY_MODULE, _REPLAY_ORIGINALS = module, session.replay.originals


def _close_replay(session: "_Session") -> None:
    global _REPLAY_MODULE, _REPLAY_ORIGINALS
    layer = session.replay
    if layer is None:
        return
    session.coverage.sync = None
    session.replay = None
    _REPLAY_MODULE, _REPLAY_ORIGINALS = None, frozenset()
    # the last counts folded in; the C++ kernels leave the dispatcher whatever fails (Python's are back)
    session.last_replay = layer.close()


@contextlib.contextmanager
def use_kernels(kernel: str | Routing = "tree", ops: Mapping[str, str] | None = None, *, strict: bool = True,
                rng=None, model: torch.nn.Module | None = None, tuner=None) -> Iterator[RoutingContext]:
    """Route backward reductions to the registry's variants while the context is open.

    ``kernel``: a family (``tree``, ``atomic``, ``native``) or a resolved :class:`Routing`; ``ops``: per-op
    overrides (``{"conv_wgrad": "atomic"}``, names as ``--kernel-op``). ``strict``: under a deterministic
    routing, an uncovered nondeterministic op raises (True) or warns once and is counted (False).
    ``rng``: the arrival order of the CPU models of atomic variants (a ``numpy.random.Generator`` or a seed;
    None: fresh entropy per call, as a GPU behaves). ``model``: optional, only to name modules in errors.
    ``tuner``: the :class:`nnrand.autotune.Tuner` of ops routed ``auto`` (``fastest-deterministic``);
    default: one with the on-disk cache.

    Yields a :class:`RoutingContext` (``.coverage``, ``.routing``, ``.deterministic``). Contexts do not nest."""
    global _ACTIVE
    if isinstance(kernel, Routing):
        if ops:
            raise RoutingError("pass per-op overrides to resolve(), not beside a resolved Routing")
        routing = kernel
    else:
        routing = resolve(kernel, ops)
    with _LOCK:
        if _ACTIVE is not None:
            raise RoutingError(f"nnrand.use_kernels is already active (family {_ACTIVE.routing.family!r}); "
                               "routing contexts do not nest: leave the open one first")
        session = _Session(routing, strict, rng, model, tuner)
        _ACTIVE = session
    lib = None
    try:
        with contextlib.ExitStack() as stack:
            routes = [r for r in ATEN_OPS if any(routing.used[o] != NATIVE for o in r.routed)]
            guarded = tuple(g for g in UNCOVERED_OPS if g.routed_by is None or routing.used[g.routed_by] == NATIVE) \
                if routing.claims_determinism else ()
            forward = session.conv_fwd_auto
            if routes or guarded or forward:
                originals = {(r.op, k): _load_original(r.op, k) for r in routes for k in r.keys}
                if forward:
                    originals.update({(FORWARD_ATEN, k): _load_original(FORWARD_ATEN, k) for k in ("CPU", "CUDA")})
                originals.update({(g.op, k): _load_original(g.op, k) for g in guarded for k in ("CPU", "CUDA")})
                replayed = [op for op in replay.OPS if originals.get((op, "CUDA")) is not None]
                replay_module = _capture_replay(replayed)
                if replay_module is not None:   # a capture no layer took is dropped on the way out
                    stack.callback(replay_module.clear_captured)
                lib = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
                    warnings.simplefilter("ignore", UserWarning)
                    for r in routes:
                        for k in r.keys:
                            if originals[r.op, k] is not None:
                                lib.impl(r.op, _bind_observed(r.handler, session, r.op, originals[r.op, k]), k,
                                         with_keyset=True)
                        session.overridden.append(r.op)
                    for g in guarded:
                        for k in ("CPU", "CUDA"):
                            if originals[g.op, k] is not None:
                                lib.impl(g.op, _bind(_guarded_forward, session, originals[g.op, k], g), k,
                                         with_keyset=True)
                    if forward:
                        for k in ("CPU", "CUDA"):
                            if originals[FORWARD_ATEN, k] is not None:
                                lib.impl(FORWARD_ATEN, _bind_observed(_conv_forward, session, FORWARD_ATEN,
                                                                      originals[FORWARD_ATEN, k]), k, with_keyset=True)
                        session.overridden.append(FORWARD_ATEN)
                if replay_module is not None:
                    stack.callback(_close_replay, session)
                    _open_replay(session, replay_module, replayed)
            if routing.claims_determinism:
                stack.enter_context(_deterministic_mode(strict))
                if not strict:
                    stack.enter_context(_counting_alerts(session))
            try:
                yield RoutingContext(session)
            except RuntimeError as e:  # PyTorch's own refusal under strict: the same error as the guard's
                m = _ALERT.search(str(e))
                if m is None or isinstance(e, NondeterministicOpError) or not routing.claims_determinism:
                    raise
                raise NondeterministicOpError(m.group(1), None, "PyTorch has no deterministic implementation of "
                                              "it (its deterministic mode refused it)") from e
    finally:
        if lib is not None:
            lib._destroy()
        with _LOCK:
            _ACTIVE = None


def active() -> RoutingContext | None:
    """The open routing context, if any."""
    s = _ACTIVE
    return None if s is None else RoutingContext(s)
