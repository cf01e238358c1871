"""The one table of kernel variants. Tests, benchmarks, the harness's ``--kernel`` and reports iterate it.

A :class:`Variant` is callable: CUDA tensors go to its CUDA launcher, CPU tensors to its CPU order model
(the NumPy/Numba reproduction of the kernel's accumulation order). Atomic variants' CPU models take
``rng`` (``None``, a seed, or a ``numpy.random.Generator``) to draw the arrival order of their partials;
other models ignore it.

Half precision (bfloat16, float16: what ``torch.autocast`` hands a backward op) goes through the same
call: every half tensor argument (positional or keyword) is widened to float32 (exact: float32 holds every
bf16 and fp16 value), the float32 variant runs (its fixed accumulation order in float32; a product of two
fp16 values, or of two bf16 values inside float32's range, is exact there),
and each output is rounded once, to nearest even, to the dtype autocast expects of it (``OpSpec.out_like``:
the dtype of the argument it is the gradient of). The bits are a function of the float32 result, so a
deterministic variant stays deterministic, its CPU model reproduces the GPU's bits wherever the float32
model does (NaN payloads aside: a NaN stays a NaN), and an ``atomic`` variant keeps its run-to-run variation. The CPU models take float32
only; a variant with ``half_native`` reads and writes half tensors in its CUDA launcher: with the same bits
(bn_bwd, maxpool_bwd), or, for the convolution gradients, on tensor cores (kernels/conv_mma.py: the same
split and combine order, a different rounding inside each chunk; those variants are not CPU bit-exact).
"""
from __future__ import annotations

import functools
import gc
import inspect
import itertools
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .runtime import KernelArgumentError

HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Variant:
    op: str
    name: str
    deterministic: bool
    order_independent: bool
    cuda: Callable[..., torch.Tensor]
    cpu: Callable[..., torch.Tensor]
    note: str
    # Whether the CUDA kernel's output equals the CPU model's bit for bit. False only where the hardware
    # arithmetic cannot be reproduced on the CPU (say why in ``note``); such variants are tested bitwise
    # against themselves and within a derived bound against float64.
    cpu_bitexact: bool = True
    tags: tuple[str, ...] = field(default=())
    # The CUDA launcher takes bf16/fp16 tensors itself (read as half, accumulated in float32, the outputs
    # written in the dtypes ``OpSpec.out_like`` names) with the bits of the widening call: less memory
    # traffic, same results. Half CPU tensors always go through the widening call.
    half_native: bool = False

    @property
    def key(self) -> str:
        return f"{self.op}/{self.name}"

    def __call__(self, *args, rng=None, **kwargs) -> torch.Tensor:
        cuda = _on_cuda(args, kwargs)
        half = half_dtype(self.op, args, kwargs)
        if half is not None and not (self.half_native and cuda):
            wide_kw = dict(zip(kwargs, widen(tuple(kwargs.values()), half)))
            out = self._run(cuda, widen(args, half), rng, wide_kw)
            return round_outputs(self.op, out, _as_positional(self.cpu, args, kwargs), kwargs)
        return self._run(cuda, args, rng, kwargs)

    def _run(self, cuda: bool, args: tuple, rng, kwargs: dict):
        if cuda:
            return self.cuda(*args, **kwargs)
        mark = _numba_compiles()
        # Overflow to Inf and Inf - Inf = NaN are results here, as on the GPU, not numerical accidents.
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.cpu(*args, rng=rng, **kwargs)
        if _numba_compiles() != mark:
            # Numba's compiler leaves a reference cycle that holds the calling frames, and with them this
            # call's inputs and outputs, until the garbage collector runs: autograd would then copy a
            # gradient it steals on every later call (another op sequence on a model's first step)
            gc.collect()
        return out


_COMPILES = [0]     # Numba compilations finished in this process, once a listener counts them
_LISTENING = False


def _numba_compiles() -> int | None:
    """Numba compilations finished so far (None while Numba is not imported: nothing compiled)."""
    global _LISTENING
    if not _LISTENING:
        if "numba" not in sys.modules:
            return None
        from numba.core import event

        class Count(event.Listener):
            def on_start(self, ev):
                pass

            def on_end(self, ev):
                _COMPILES[0] += 1

        event.register("numba:compile", Count())
        _LISTENING = True
    return _COMPILES[0]


@functools.lru_cache(maxsize=None)
def _positional_names(fn: Callable) -> tuple[str, ...]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


def _as_positional(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """``args`` extended by the keyword arguments that fill ``fn``'s next positional parameters, in order
    up to the first one not given (what ``OpSpec.out_like``'s positions refer to, however the caller passed
    them; an ``out_like`` entry past such a gap names its keyword)."""
    try:
        names = _positional_names(fn)
    except (TypeError, ValueError):   # a callable without a signature: positions as given
        return args
    out = list(args)
    for name in names[len(args):]:
        if name not in kwargs:
            break
        out.append(kwargs[name])
    return tuple(out)


def _on_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether the first tensor argument, positional or keyword, is on a CUDA device."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == "cuda"


def half_dtype(op: str, args: tuple, kwargs: dict | None = None) -> torch.dtype | None:
    """The half dtype among ``args`` and ``kwargs`` (None: none is half); bfloat16 and float16 together
    are an error that names both arguments (``#i`` by position, else by keyword)."""
    found: dict[torch.dtype, int | str] = {}   # dtype -> first argument (position, or keyword) holding it
    for name, a in itertools.chain(enumerate(args), (kwargs or {}).items()):
        if isinstance(a, torch.Tensor) and a.dtype in HALF_DTYPES:
            found.setdefault(a.dtype, name)
    if len(found) > 1:
        (d1, n1), (d2, n2) = [(d, f"#{n}" if isinstance(n, int) else n) for d, n in list(found.items())[:2]]
        raise KernelArgumentError(op, n2, f"is {d2} while argument {n1} is {d1}; "
                                  "half-precision inputs must share one dtype")
    return next(iter(found), None)


def widen(args: tuple, half: torch.dtype) -> tuple:
    """``args`` with every ``half`` tensor widened to float32 (exact); other values as they are."""
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == half else a for a in args)


def round_outputs(op: str, out, args: tuple, kwargs: dict | None = None):
    """Each float32 output of a variant called on widened half inputs, rounded to the dtype of the
    argument ``OpSpec.out_like`` names for it (float32 when that argument is not a half tensor)."""
    kwargs = kwargs or {}
    like = _SPECS[op].out_like if op in _SPECS else (0,)
    outs = out if isinstance(out, tuple) else (out,)
    rounded = []
    for k, t in enumerate(outs):
        entry = like[min(k, len(like) - 1)]
        i, name = entry if isinstance(entry, tuple) else (entry, None)
        src = args[i] if i < len(args) else kwargs.get(name)
        want = src.dtype if isinstance(src, torch.Tensor) and src.dtype in HALF_DTYPES else None
        rounded.append(t.to(want) if want is not None and isinstance(t, torch.Tensor) else t)
    return tuple(rounded) if isinstance(out, tuple) else rounded[0]


_REGISTRY: dict[tuple[str, str], Variant] = {}


def register(variant: Variant) -> Variant:
    key = (variant.op, variant.name)
    if key in _REGISTRY:
        raise ValueError(f"variant {variant.key} is registered twice")
    _REGISTRY[key] = variant
    return variant


def ops() -> list[str]:
    return sorted({op for op, _ in _REGISTRY})


def variants(op: str | None = None) -> list[Variant]:
    """All variants (of one op), in registration order."""
    if op is not None and op not in ops():
        raise KeyError(f"unknown op {op!r}; known ops: {', '.join(ops())}")
    return [v for (o, _), v in _REGISTRY.items() if op is None or o == op]


def get(op: str, name: str) -> Variant:
    try:
        return _REGISTRY[(op, name)]
    except KeyError:
        if op not in ops():
            raise KeyError(f"unknown op {op!r}; known ops: {', '.join(ops())}") from None
        names = ", ".join(v.name for v in variants(op))
        raise KeyError(f"unknown variant {name!r} of op {op!r}; known variants: {names}") from None


def table() -> list[dict]:
    """The registry as rows (for printing and for reports)."""
    return [
        {
            "op": v.op,
            "variant": v.name,
            "deterministic": v.deterministic,
            "order_independent": v.order_independent,
            "cpu_bitexact": v.cpu_bitexact,
            "note": v.note,
        }
        for v in variants()
    ]


# --------------------------------------------------------------------------------------------------
# Op specs: how to make inputs for an op, its float64 reference, its case tables and its peers.


@dataclass(frozen=True)
class Case:
    """One input configuration of an op. ``params`` is op-specific (shapes, strides, layout, ...);
    ``seed`` makes the inputs reproducible; ``contention`` is a knob for atomics (higher = more
    partials colliding on one output element), ``None`` where it does not apply."""

    op: str
    name: str
    params: dict
    seed: int = 0
    contention: float | None = None

    @property
    def id(self) -> str:
        return f"{self.op}:{self.name}"


@dataclass(frozen=True)
class OpSpec:
    op: str
    # (case, device) -> (args, kwargs) to call any variant of the op with; random data drawn from
    # case.seed (never zeros), identical on every device.
    make_inputs: Callable[[Case, torch.device], tuple[tuple, dict]]
    # (args, kwargs) -> the exact result in float64 on the CPU.
    reference: Callable[[tuple, dict], torch.Tensor]
    # Small hostile cases that the CPU models run in seconds.
    test_cases: Callable[[], list[Case]]
    # Benchmark cases: ``scale`` is "gpu" (full sizes), "quick" (a few GPU sizes) or "cpu" (CPU-model sizes).
    bench_cases: Callable[[str], list[Case]]
    # Peer implementations measured beside the variants: name -> fn(*args, **kwargs) -> tensor.
    # Called inside the right torch mode by the caller where the name says so ("torch_deterministic").
    peers: Callable[[], dict[str, Callable[..., torch.Tensor]]]
    # Fewest bytes the op must move (inputs read once, outputs written once), and FLOPs, per case.
    bytes_moved: Callable[[Case], int]
    flops: Callable[[Case], int] | None = None
    # Half-precision calls: output k is rounded to the dtype of the argument ``out_like[k]`` names: a
    # position, or (position, keyword name) for one that may come by keyword (the last entry serves the
    # outputs past the tuple's end); float32 when that argument is not half.
    out_like: tuple[int | tuple[int, str], ...] = (0,)
    # The positional arguments torch.autocast makes half (benchmarks with half inputs round these, and
    # only these, to bf16/fp16); None: every float32 tensor argument.
    half_inputs: tuple[int, ...] | None = None
    # Keyword arguments the benchmarks add to every variant call (the mode the routing runs them in)
    bench_kwargs: tuple[tuple[str, object], ...] = ()
    # ... and to one variant's calls: (variant name, its keyword arguments), over bench_kwargs; the names
    # are checked against the variants registered with the spec (define_op), not ones added later
    variant_bench_kwargs: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    def bench_kwargs_of(self, variant: str) -> dict:
        """The keyword arguments the benchmarks add to calls of ``variant``."""
        return {**dict(self.bench_kwargs), **dict(dict(self.variant_bench_kwargs).get(variant, ()))}


_SPECS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.op in _SPECS:
        raise ValueError(f"op {spec.op} is registered twice")
    _SPECS[spec.op] = spec
    return spec


def spec(op: str) -> OpSpec:
    try:
        return _SPECS[op]
    except KeyError:
        raise KeyError(f"no op spec for {op!r}; known: {', '.join(sorted(_SPECS))}") from None


# --------------------------------------------------------------------------------------------------
# One call per op file: its spec and its variants


def define_op(op: str, variants: list[tuple], *, cpu_bitexact: bool = True,
              half_native: bool | tuple[str, ...] = False, **spec_fields) -> OpSpec:
    """Register op ``op``: its :class:`OpSpec` (``spec_fields``: ``make_inputs``, ``reference``, ...) and
    its variants, in the order given (the order of tests, benchmarks and reports). Each variant is a row
    ``(name, deterministic, order_independent, cuda, cpu, note)``; ``cpu_bitexact`` holds for all of them,
    ``half_native`` for all (a bool) or for the variants it names (a tuple of names).

    Without ``spec_fields`` it adds variants to an op whose spec another module registered. A variant
    that needs other fields is registered with :func:`register`.

        define_op(OP, [("atomic", False, False, sum_atomic_cuda, sum_atomic_cpu, "single pass; ..."),
                       ("tree", True, False, sum_tree_cuda, sum_tree_cpu, "two passes; ...")],
                  make_inputs=_make_inputs, reference=_reference, test_cases=_test_cases,
                  bench_cases=_bench_cases, peers=_peers, bytes_moved=_bytes_moved)
    """
    names = {row[0] for row in variants}
    if len(names) != len(variants):
        raise ValueError(f"{op}: a variant name is given twice in {[row[0] for row in variants]}")
    if not isinstance(half_native, bool) and not set(half_native) <= names:
        raise ValueError(f"{op}: half_native names unknown variants {sorted(set(half_native) - names)}")
    tuned = {name for name, _ in spec_fields.get("variant_bench_kwargs", ())}
    if not tuned <= names:
        raise ValueError(f"{op}: variant_bench_kwargs names unknown variants {sorted(tuned - names)}")
    taken = [row[0] for row in variants if (op, row[0]) in _REGISTRY]
    if taken or (spec_fields and op in _SPECS):
        raise ValueError(f"{op}: registered twice ({', '.join(taken) or 'its spec'})")
    rows = [Variant(op, *row, cpu_bitexact=cpu_bitexact,
                    half_native=half_native if isinstance(half_native, bool) else row[0] in half_native)
            for row in variants]
    if spec_fields:
        register_op(OpSpec(op=op, **spec_fields))
    else:
        spec(op)  # adding variants: the op must exist (raises, naming the known ops)
    for v in rows:
        register(v)
    return _SPECS[op]
