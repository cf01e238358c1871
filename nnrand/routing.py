"""Backward reductions through the kernel registry: one door, ``use_kernels(routing, model)``.

Forward passes stay torch's (deterministic). In backward, four ops take the registry's variants:

    conv_wgrad   dW of every nn.Conv2d
    conv_dgrad   dX of every nn.Conv2d
    bias_grad    every channel reduction: BatchNorm2d dbeta = sum(dy), dgamma = sum(dy * xhat) (the
                 input gradient is then elementwise in those sums), nn.Linear's bias, a conv bias
    maxpool_bwd  dX of every nn.MaxPool2d

Each op is routed to a variant name of the registry (``tree``, ``atomic``, ...) or to ``native`` (stock
PyTorch/cuDNN). ``use_kernels`` sets an instance ``forward`` on each affected module of the model that
calls a ``torch.autograd.Function`` whose backward calls the chosen variants, and puts the modules'
previous state back on exit, exceptions included. ``native`` everywhere installs nothing. Variants are
looked up in the registry when the routing is resolved, so an op registered later is picked up without
a change here.

A ``Variant`` dispatches on the tensor's device: CUDA tensors run the CUDA kernel, CPU tensors the CPU
order model (atomic models draw their arrival order from ``rng``: a ``numpy.random.Generator`` to make
the draw reproducible, ``None`` for fresh entropy each call).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

import kernels

ROUTED_OPS = ("conv_wgrad", "conv_dgrad", "bias_grad", "maxpool_bwd")
NATIVE = "native"
FAMILIES = ("tree", "atomic", NATIVE)  # what --kernel accepts; per-op overrides accept any registry name


class RoutingError(ValueError):
    """A routing that names an unknown op or variant, or a model the routing cannot intercept."""


# --------------------------------------------------------------------------------------------------
# Resolution: (family, per-op overrides) -> variant per op, checked against the registry


def registered_variants(op: str) -> list[str]:
    """Variant names of ``op`` in the registry; [] while the op is not registered."""
    try:
        return [v.name for v in kernels.variants(op)]
    except KeyError:
        return []


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

    @property
    def is_native(self) -> bool:
        return all(v == NATIVE for v in self.used.values())

    @property
    def deterministic(self) -> bool:
        """True when every routed variant is deterministic (``native`` ops count as deterministic only
        under cuDNN's deterministic mode, which ``noise.pinned_flags`` sets for such routings)."""
        return all(v == NATIVE or kernels.get(op, v).deterministic for op, v in self.used.items())

    def variant(self, op: str):
        name = self.used[op]
        return None if name == NATIVE else kernels.get(op, name)

    def describe(self) -> dict:
        return {"family": self.family, "ops": dict(self.used), "requested": dict(self.requested),
                "notes": dict(self.notes)}


def resolve(family: str = "tree", overrides: Mapping[str, str] | None = None) -> Routing:
    """Check names against the registry now and fix the variant per op.

    A family applies to every op; an op that lacks it (not registered yet) falls back to ``native`` with
    a note. An explicit per-op override must exist: unknown ops or variants raise :class:`RoutingError`
    listing the valid names."""
    if family not in FAMILIES:
        raise RoutingError(f"unknown kernel family {family!r}; valid: {', '.join(FAMILIES)}")
    overrides = dict(overrides or {})
    requested = {op: family for op in ROUTED_OPS}
    used: dict[str, str] = {}
    notes: dict[str, str] = {}
    for op, name in overrides.items():
        if op not in ROUTED_OPS:
            raise RoutingError(f"unknown op {op!r} in --kernel-op; valid ops: {', '.join(ROUTED_OPS)}")
        valid = registered_variants(op)
        if name != NATIVE and name not in valid:
            have = ", ".join([NATIVE, *valid])
            why = "" if valid else f" (op {op} is not in the kernel registry yet)"
            raise RoutingError(f"unknown variant {name!r} for op {op}{why}; valid: {have}")
        requested[op] = name
    for op in ROUTED_OPS:
        name = requested[op]
        if name == NATIVE or name in registered_variants(op):
            used[op] = name
        else:
            used[op] = NATIVE
            valid = registered_variants(op)
            notes[op] = (f"{op} has no variant {name!r} in the registry (registered: "
                         f"{', '.join(valid) or 'none'}); runs native")
    return Routing(family, requested, used, notes)


# --------------------------------------------------------------------------------------------------
# The ops as the autograd functions call them: a variant, or torch's own backward for ``native``


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """channels_last only when the tensor is channels_last and not also NCHW-contiguous (as the
    kernels' ``layout_of`` decides); everything else is made NCHW-contiguous."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


@dataclass(frozen=True)
class ConvGeom:
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


class _Ops:
    """The routing bound to a random source for the CPU models of atomic variants."""

    def __init__(self, routing: Routing, rng):
        self.routing, self.rng = routing, rng
        self.v = {op: routing.variant(op) for op in ROUTED_OPS}

    def conv_grads(self, x, w, dy, g: ConvGeom, need_dx: bool, need_dw: bool):
        dx = dw = None
        wgrad, dgrad = self.v["conv_wgrad"], self.v["conv_dgrad"]
        native_mask = [need_dx and dgrad is None, need_dw and wgrad is None, False]
        if any(native_mask):
            ndx, ndw, _ = torch.ops.aten.convolution_backward(
                dy, x, w, None, list(g.stride), list(g.padding), list(g.dilation), False, [0, 0], 1,
                native_mask)
            dx = ndx if native_mask[0] else None
            dw = ndw if native_mask[1] else None
        if need_dx and dgrad is not None:
            w = w.contiguous(memory_format=memory_format_of(w))
            dx = dgrad(w, dy, input_size=tuple(x.shape[-2:]), stride=g.stride, padding=g.padding,
                       dilation=g.dilation, rng=self.rng)
        if need_dw and wgrad is not None:
            dw = wgrad(x, dy, kernel_size=g.kernel_size, stride=g.stride, padding=g.padding,
                       dilation=g.dilation, rng=self.rng)
        return dx, dw

    def bias_grad(self, dy: torch.Tensor) -> torch.Tensor:
        v = self.v["bias_grad"]
        if v is None:
            return dy.sum(dim=[d for d in range(dy.dim()) if d != 1])
        return v(dy, rng=self.rng)

    def maxpool_bwd(self, dy, indices, input_size, g: ConvGeom) -> torch.Tensor:
        return self.v["maxpool_bwd"](dy, indices, input_size=input_size, kernel_size=g.kernel_size,
                                     stride=g.stride, padding=g.padding, dilation=g.dilation, rng=self.rng)


# --------------------------------------------------------------------------------------------------
# autograd functions


class Conv2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, geom: ConvGeom, ops: _Ops):
        x = x.contiguous(memory_format=memory_format_of(x))
        ctx.save_for_backward(x, weight)
        ctx.geom, ctx.ops, ctx.has_bias = geom, ops, bias is not None
        return F.conv2d(x, weight, bias, geom.stride, geom.padding, geom.dilation)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous(memory_format=memory_format_of(x))
        dx, dw = ctx.ops.conv_grads(x, w, dy, ctx.geom, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        db = ctx.ops.bias_grad(dy) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class BatchNorm2dFn(torch.autograd.Function):
    """Training-mode batch norm. Forward and running-stat update are torch's ``native_batch_norm``;
    backward takes the two channel sums from ``bias_grad`` and is elementwise otherwise:
    dx = gamma * invstd * (dy - sum(dy)/M - xhat * sum(dy * xhat)/M), M = N*H*W."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, ops: _Ops):
        x = x.contiguous(memory_format=memory_format_of(x))
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True,
                                                  momentum, eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.ops = ops
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        fmt = memory_format_of(x)
        dy = dy.contiguous(memory_format=fmt)
        c = x.shape[1]
        per_c = (1, c, 1, 1)
        m = x.numel() // c
        xhat = ((x - mean.view(per_c)) * invstd.view(per_c)).contiguous(memory_format=fmt)
        dbeta = ctx.ops.bias_grad(dy)
        dgamma = ctx.ops.bias_grad((dy * xhat).contiguous(memory_format=fmt))
        dx = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else weight * invstd
            dx = scale.view(per_c) * (dy - (dbeta / m).view(per_c) - xhat * (dgamma / m).view(per_c))
            dx = dx.contiguous(memory_format=fmt)
        dgamma = dgamma if weight is not None and ctx.needs_input_grad[1] else None
        dbeta = dbeta if ctx.needs_input_grad[2] else None
        return dx, dgamma, dbeta, None, None, None, None, None


class MaxPool2dFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, geom: ConvGeom, ops: _Ops):
        x = x.contiguous(memory_format=memory_format_of(x))
        y, indices = F.max_pool2d(x, geom.kernel_size, geom.stride, geom.padding, geom.dilation,
                                  ceil_mode=False, return_indices=True)
        ctx.save_for_backward(indices)
        ctx.geom, ctx.ops, ctx.input_size = geom, ops, tuple(x.shape[-2:])
        ctx.fmt = memory_format_of(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (indices,) = ctx.saved_tensors
        dy = dy.contiguous(memory_format=ctx.fmt)
        indices = indices.contiguous(memory_format=ctx.fmt)
        return ctx.ops.maxpool_bwd(dy, indices, ctx.input_size, ctx.geom), None, None


class LinearFn(torch.autograd.Function):
    """y = x W^T + b. dX and dW are torch matmuls (cuBLAS keeps a fixed order on one stream); the bias
    gradient, a sum over the batch, goes through ``bias_grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, ops: _Ops):
        ctx.save_for_backward(x, weight)
        ctx.ops = ops
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        rows = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None
        dw = rows.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = ctx.ops.bias_grad(rows) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


# --------------------------------------------------------------------------------------------------
# Module forwards installed by use_kernels


def _conv_forward(ops: _Ops):
    def forward(self: nn.Conv2d, x):
        geom = ConvGeom(_pair(self.kernel_size), _pair(self.stride), _pair(self.padding), _pair(self.dilation))
        return Conv2dFn.apply(x, self.weight, self.bias, geom, ops)
    return forward


def _bn_forward(ops: _Ops, previous):
    def forward(self: nn.BatchNorm2d, x):
        if not self.training:
            return previous(x)  # eval: torch, with the running statistics
        # torch's _BatchNorm.forward bookkeeping: count the batch, then momentum (or a cumulative mean).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return BatchNorm2dFn.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                   factor, self.eps, ops)
    return forward


def _pool_forward(ops: _Ops):
    def forward(self: nn.MaxPool2d, x):
        geom = ConvGeom(_pair(self.kernel_size), _pair(self.stride if self.stride is not None else
                                                        self.kernel_size),
                        _pair(self.padding), _pair(self.dilation))
        return MaxPool2dFn.apply(x, geom, ops)
    return forward


def _linear_forward(ops: _Ops):
    def forward(self: nn.Linear, x):
        return LinearFn.apply(x, self.weight, self.bias, ops)
    return forward


def _check_module(name: str, m: nn.Module) -> None:
    if isinstance(m, nn.Conv2d):
        if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
            raise RoutingError(f"{name}: only groups=1, zero padding given as numbers is routed "
                               f"(groups={m.groups}, padding={m.padding!r}, padding_mode={m.padding_mode})")
    elif isinstance(m, nn.MaxPool2d):
        if m.ceil_mode or m.return_indices:
            raise RoutingError(f"{name}: max-pool routing needs ceil_mode=False, return_indices=False")


def _plan(routing: Routing, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, module, kind) for every module whose forward gets replaced."""
    conv = routing.used["conv_wgrad"] != NATIVE or routing.used["conv_dgrad"] != NATIVE
    bias = routing.used["bias_grad"] != NATIVE
    pool = routing.used["maxpool_bwd"] != NATIVE
    plan = []
    for name, m in model.named_modules():
        if type(m) is nn.Conv2d and (conv or (bias and m.bias is not None)):
            plan.append((name, m, "conv"))
        elif type(m) is nn.BatchNorm2d and bias:
            plan.append((name, m, "bn"))
        elif type(m) is nn.MaxPool2d and pool:
            plan.append((name, m, "pool"))
        elif type(m) is nn.Linear and bias and m.bias is not None:
            plan.append((name, m, "linear"))
    return plan


@contextlib.contextmanager
def use_kernels(routing: Routing, model: nn.Module, *, rng=None) -> Iterator[list[str]]:
    """Route ``model``'s backward reductions as ``routing`` says while the context is open.

    Yields the names of the modules intercepted. On exit (normal or by exception) each module's
    ``forward`` is what it was before: a module without an instance ``forward`` gets none back."""
    plan = _plan(routing, model)
    for name, m, _ in plan:
        _check_module(name or type(m).__name__, m)
    ops = _Ops(routing, rng)
    saved: list[tuple[nn.Module, bool, object]] = []
    try:
        for _, m, kind in plan:
            had = "forward" in m.__dict__
            previous = m.forward
            saved.append((m, had, m.__dict__.get("forward")))
            make = {"conv": lambda: _conv_forward(ops), "bn": lambda: _bn_forward(ops, previous),
                    "pool": lambda: _pool_forward(ops), "linear": lambda: _linear_forward(ops)}[kind]
            m.forward = make().__get__(m, type(m))
        yield [name for name, _, _ in plan]
    finally:
        for m, had, previous in reversed(saved):
            if had:
                m.forward = previous
            else:
                del m.__dict__["forward"]
