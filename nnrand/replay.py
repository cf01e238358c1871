"""The C++ replay layer of routed aten ops: the host cost of a routed call without the trip into Python.

A routed op's kernel is Python (``torch.library``): every call boxes its arguments into Python objects and
back, 30-40 us per backward conv on an H200, where a training step of a small model is host-bound. This
layer (``replay.cpp``, built once with ``torch.utils.cpp_extension`` and cached by it) registers a C++
kernel above the Python one for the ops in :data:`OPS`, at the CUDA key. Per call signature (dtypes, devices,
shapes, strides and address modulo 256 of the tensors, the other arguments' values, the current stream, the
deterministic-mode flag) it keeps a plan recorded from one Python call, and runs it itself afterwards:

  * the first call of a signature goes to Python (it plans and prepares its launches);
  * the second goes to Python under a :class:`Recorder`: every aten op the handler calls (a
    ``TorchDispatchMode``) and every kernel it launches (``kernels.runtime``'s launch paths) is logged, the
    tensors named by registers: the call's inputs, the outputs of logged ops, and the runtime's persistent
    buffers (a stream's ticket counters, ``runtime.keep_persistent``) kept as constants. Kernel arguments
    that equal a register's data pointer become that register; any other argument is a constant. Which
    tensor arguments share memory, and where, is part of the signature. A call of the original kernel
    (``routing._Original``: a configuration passed on to torch) is one step that calls that kernel again,
    as captured in C++ by :func:`capture` before the routing registered its own; the aten ops it makes
    itself are its own business, not the plan's;
  * later calls replay the plan in C++: the same aten ops through the dispatcher, the same launches with
    the same grid, block and arguments, on the current stream, with the same buffers' roles. So a replay
    computes exactly what the Python call computes, bit for bit.

A recording is refused, and the signature stays on the Python path, where the log shows a replay could
differ from a Python call: an op that returns a value to Python (``.item()``, a comparison: a decision on
device data), a tensor made off the device, a tensor the call did not make through the dispatcher that is
no persistent runtime buffer, an original kernel called that the layer did not capture, a launch on
another stream or taking a struct, a kernel argument that is no tensor of the call's and looks like an
address (>= 2^32, or memory the CUDA driver knows), a coverage count other than one. What the log cannot
see is kept out of the routed handlers by construction: every kernel they launch goes through
``kernels.runtime.launch`` or ``Launch``, and they read no device data outside aten ops. The kernel
modules' tuning switches (``bias_grad.TARGET_BLOCKS`` and the like) are read when a signature is recorded:
change them outside a routing context.

Never used during a CUDA-graph capture (the C++ kernel passes such calls to Python, whose ticket
counters are graph-private) or for calls an original kernel makes. While a routed-op observer records
(``routing.observe``), a replayed call hands its outputs and arguments to it (:meth:`Layer.observe`): the
observer pays its own Python cost, the call's work stays in C++; a trace recorder of routed ops with a model
has the layer record the call in C++ instead (the trace sink, ``sink_*`` in ``replay.cpp``; see
``nnrand.trace``). ``NNRAND_REPLAY=0`` turns the layer off;
where the extension cannot be built (no compiler, no ninja) the routing warns once and runs in Python.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import runtime

ENV = "NNRAND_REPLAY"
NAME = "nnrand_replay"
SOURCE = Path(__file__).with_name("replay.cpp")
# the routed aten ops the layer takes (their handlers' work is aten ops and runtime launches only)
OPS = ("convolution_backward", "cudnn_batch_norm_backward", "native_batch_norm_backward", "cudnn_batch_norm",
       "max_pool2d_with_indices_backward")
ADDRESS = 1 << 32   # a kernel argument at or above this is an address (no routed kernel takes such an int)

_MODULE = None
_FAILED: str | None = None
_LOCK = threading.Lock()


def requested() -> bool:
    """Whether the environment lets the routing use the layer (``NNRAND_REPLAY`` unset or not ``0``)."""
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def _build_dir() -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(NAME, False))
    except Exception:   # a private helper: its absence only costs the message below
        return None


def load(quiet: bool = False):
    """The compiled extension (built on the first use, then loaded from torch's extension cache), or None
    where it cannot be built (the reason in :func:`failure`; warned once unless ``quiet``)."""
    global _MODULE, _FAILED
    with _LOCK:
        if _MODULE is not None or _FAILED is not None:
            return _MODULE
        from torch.utils.cpp_extension import load as build

        where = _build_dir()
        if where is not None and not any(where.glob(f"{NAME}*.so")):
            print(f"nnrand: building the C++ replay layer of routed ops (once per torch version; about 30 s). "
                  f"{ENV}=0 skips it.", file=sys.stderr, flush=True)
        try:
            _MODULE = build(name=NAME, sources=[str(SOURCE)], extra_cflags=["-O2"], verbose=False)
        except Exception as e:   # no compiler, no ninja, headers missing: Python's path stays
            _FAILED = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            if not quiet:
                warnings.warn(f"nnrand: the C++ replay layer could not be built ({_FAILED}); routed ops run "
                              f"their Python kernels (slower on the host, same results). Set {ENV}=0 to "
                              "skip the attempt.", RuntimeWarning, stacklevel=3)
        return _MODULE


def failure() -> str | None:
    """Why the last :func:`load` gave None (None: it did not fail)."""
    return _FAILED


# --------------------------------------------------------------------------------------------------
# Recording one call


class Refused(Exception):
    """A call whose replay could differ from it: it stays on the Python path."""


_POINTER_ATTRIBUTE = None


def _is_address(v: int) -> bool:
    """Whether ``v`` is an address the CUDA driver knows (device, managed or registered host memory): an
    argument that is one, outside every tensor of the call, must not be replayed as a constant. Asked of
    the driver API (cuPointerGetAttribute), which leaves the runtime's last-error state alone."""
    import ctypes

    global _POINTER_ATTRIBUTE
    if _POINTER_ATTRIBUTE is None:
        _POINTER_ATTRIBUTE = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
        _POINTER_ATTRIBUTE.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    memory_type = ctypes.c_uint(0)
    return _POINTER_ATTRIBUTE(ctypes.byref(memory_type), 2, v) == 0   # CU_POINTER_ATTRIBUTE_MEMORY_TYPE


class Recorder(TorchDispatchMode):
    """The aten ops and kernel launches of one call on this thread, as a plan (see the module's doc)."""

    def __init__(self, device: torch.device, namespace: str = "aten"):
        super().__init__()
        self.device, self.namespace = device, namespace
        self.thread = threading.get_ident()
        self.registers = 0
        self.reg: dict[int, int] = {}        # id(tensor) -> register
        self.by_ptr: dict[int, int] = {}     # data pointer -> the newest register with it
        self.keep: list[torch.Tensor] = []   # tensor per register, alive until the plan is built (ids unique)
        self.inputs: list[tuple[int, int]] = []
        self.constants: list[tuple[int, torch.Tensor]] = []
        self.steps: list[tuple] = []
        self.refusal: str | None = None
        self.suspended = 0   # inside an original kernel (this mode is off meanwhile; see ``original``)
        self.stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None

    # registers ---------------------------------------------------------------------------------
    def _new(self, t: torch.Tensor) -> int:
        r = self.registers
        self.registers += 1
        self.reg[id(t)] = r
        self.keep.append(t)
        if t.numel():
            self.by_ptr[t.data_ptr()] = r
        return r

    def input(self, position: int, t: torch.Tensor) -> None:
        self.inputs.append((position, self._new(t)))

    def _tensor(self, t: torch.Tensor) -> int:
        r = self.reg.get(id(t))
        if r is not None:
            return r
        if t.device != self.device:
            raise Refused(f"a tensor on {t.device} that the call did not make")
        if not runtime.is_persistent(t):
            raise Refused("a tensor the call did not make through the dispatcher, and no persistent runtime "
                          "buffer")
        r = self._new(t)
        self.constants.append((r, t))   # held for the process's life (a stream's ticket counters)
        return r

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    # aten ops ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refusal is None:
            try:
                self._log(func, args, kwargs, out)
            except Refused as e:
                self.refusal = f"{func}: {e}"
        return out

    def _entry(self, v):
        if isinstance(v, torch.Tensor):
            return ("r", self._tensor(v))
        if v is None:
            return ("n",)
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            raise Refused("a list of tensors as an argument")
        return ("v", v)

    def _log(self, func, args, kwargs, out, kind: str = "op", name: str | None = None) -> None:
        schema = func._schema
        entries = []
        for i, a in enumerate(schema.arguments):
            if i < len(args):
                entries.append(self._entry(args[i]))
            elif a.name in kwargs:
                entries.append(self._entry(kwargs[a.name]))
            else:
                entries.append(("d",))
        if isinstance(out, list):
            raise Refused("a list of tensors returned")
        outs = []
        for o in (out if isinstance(out, tuple) else (out,)):
            if o is None:
                outs.append(-1)
                continue
            if not isinstance(o, torch.Tensor):
                raise Refused(f"returned a {type(o).__name__} to Python (a decision on device data)")
            if o.device != self.device:
                raise Refused(f"made a tensor on {o.device}")
            r = self.reg.get(id(o))
            outs.append(r if r is not None else self._new(o))
        if kind == "op":
            name, overload = schema.name, schema.overload_name
        else:
            overload = ""
        self.steps.append((kind, name, overload, entries, outs))

    def original(self, op: str, call, args: tuple, kwargs: dict):
        """``call()`` runs the kernel registered for aten ``op`` before the routing's (a configuration the
        routing passes on to torch) with ``args``: logged as one step that calls that kernel again (the C++
        layer captured it), the aten ops it makes itself left out of the log."""
        if self.suspended:   # an original inside an original: part of the outer one's work
            return call()
        from torch.utils._python_dispatch import _disable_current_modes

        self.suspended += 1
        try:
            # without this mode: the original's own aten ops are its business, not the plan's, and a kernel
            # that is itself a Python registration would otherwise be redirected by the mode to the newest
            # Python kernel of the op (the routing's)
            with _disable_current_modes():
                out = call()
        finally:
            self.suspended -= 1
        if self.refusal is None:
            try:
                self._log(getattr(getattr(torch.ops, self.namespace), op).default, args, kwargs, out,
                          kind="original", name=op)
            except Exception as e:   # the call's own result stands; only its replay is given up
                self.refusal = f"original kernel of {op}: {e}"
        return out

    # kernel launches ---------------------------------------------------------------------------
    def launch(self, fn, dims: tuple[int, ...], shared_mem: int, index: int, values, stream, struct, name: str):
        """A launch through ``kernels.runtime`` on this thread (its 8-byte argument slots in ``values``)."""
        if self.refusal is not None:
            return
        if struct is not None:
            return self.refuse(f"kernel {name} takes a struct argument")
        if index != self.device.index or (self.stream is not None and (
                stream if stream is not None else torch._C._cuda_getCurrentRawStream(index)) != self.stream):
            return self.refuse(f"kernel {name} launched on another stream or device")
        slots, pointers = [], []
        for i, v in enumerate(values):
            v = int(v)
            r = self.by_ptr.get(v) if v else None
            if r is not None and self.keep[r].data_ptr() != v:   # moved since (an out= resize, set_)
                return self.refuse(f"argument {i} of kernel {name}: a tensor's data moved during the call")
            if r is not None:
                pointers.append((i, r))
                slots.append(0)
            elif abs(v) >= ADDRESS or (v > 0 and self.stream is not None and _is_address(v)):
                return self.refuse(f"argument {i} of kernel {name} ({v:#x}) is no tensor the call knows")
            else:
                slots.append(v)
        self.steps.append(("launch", int(fn.ptr), tuple(int(d) for d in dims), int(shared_mem), slots, pointers,
                           name))

    def outputs(self, out, count: int) -> list[int]:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != count:
            raise Refused(f"{len(outs)} values returned, the schema has {count}")
        regs = []
        for o in outs:
            if o is None:
                regs.append(-1)
            elif isinstance(o, torch.Tensor) and id(o) in self.reg:
                regs.append(self.reg[id(o)])
            else:
                raise Refused("a returned tensor that no logged op made")
        return regs


# --------------------------------------------------------------------------------------------------
# The layer of one routing session


def capture(module, ops: list[str], *, namespace: str = "aten", key: str = "CUDA") -> None:
    """Take the kernels registered now for ``ops`` (before the routing registers its own): the originals a
    plan may call, for the :class:`Layer` enabled next."""
    module.capture(list(ops), namespace, key)


class Layer:
    """The C++ kernels of one ``use_kernels`` session: enabled over the session's Python kernels for
    ``ops``; plan ids name (op, coverage label, reason) for the counts the session's coverage folds in.
    The originals :func:`capture` took before are the ones its plans call."""

    def __init__(self, module, ops: list[str], add: Callable[[str, str, str | None, int], None], *,
                 namespace: str = "aten", key: str = "CUDA"):
        self.module, self.ops, self._add, self.namespace, self.key = module, ops, add, namespace, key
        self.plans: list[tuple[str, str, str | None]] = []
        self.plan_steps: list[tuple[str, ...]] = []   # per plan: its steps' kinds and ops, to look at
        # the ops whose original kernels capture() took for this layer (their calls can be plan steps)
        self.originals = frozenset(module.captured())
        self.refusals: dict[str, dict[str, int]] = {}
        self._schemas = {op: getattr(getattr(torch.ops, namespace), op).default._schema for op in ops}
        with warnings.catch_warnings():   # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore", UserWarning)
            module.enable(list(ops), namespace, key)

    def pending(self, op: str) -> bool:
        return self.module.pending(op)

    def record(self, op: str, call: Callable[[], object], args: tuple, kwargs: dict, taps: list):
        """Run ``call`` (the Python handler of this pending miss) under a recorder; commit its plan unless
        refused. ``taps``: the list the session's coverage appends this thread's counts to meanwhile."""
        schema = self._schemas[op]
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        rec = Recorder(device, self.namespace)
        names = [a.name for a in schema.arguments]
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                rec.input(i, a)
        for k, a in kwargs.items():
            if isinstance(a, torch.Tensor):
                rec.input(names.index(k), a)
        with _LOCK:   # the launch paths log into one recorder at a time (the thread it names)
            if runtime.RECORDER is not None:   # another thread records: not recorded, not counted as tried
                rec = None
            else:
                runtime.RECORDER = rec
        if rec is None:
            self.module.skip()
            return call()
        try:
            with rec:
                out = call()
        finally:
            with _LOCK:
                runtime.RECORDER = None
        try:
            if rec.refusal is not None:
                raise Refused(rec.refusal)
            if len(taps) != 1:
                raise Refused(f"{len(taps)} coverage counts in one call")
            outputs = rec.outputs(out, len(schema.returns))
            with _LOCK:
                self.plans.append(taps[0])
                self.plan_steps.append(tuple(f"{s[0]} {s[1]}" if s[0] != "launch" else f"launch {s[6]}"
                                             for s in rec.steps))
                plan = len(self.plans) - 1
            self.module.commit(op, plan, rec.registers, rec.inputs, rec.constants, rec.steps, outputs)
        except Exception as e:   # the call's own result stands; only its replay is given up
            why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
            with _LOCK:
                self.refusals.setdefault(op, {})
                self.refusals[op][why] = self.refusals[op].get(why, 0) + 1
        return out

    def drain(self) -> None:
        """Fold the calls replayed since the last drain into the session's coverage."""
        for plan, n in self.module.take_counts():
            op, where, reason = self.plans[plan]
            self._add(op, where, reason, n)

    def python_only(self, on: bool) -> None:
        self.module.set_python_only(on)

    def observe(self, fn: Callable[[str, object, tuple], None] | None) -> None:
        """``fn(op, outputs, args)`` after every replayed call (as ``routing.observe``'s observers get the
        calls that run in Python); None: no more. ``args`` holds every schema argument positionally, defaults
        included (the ops in :data:`OPS` have no keyword-only arguments; a Python kernel's ``args`` would stop
        before trailing defaults)."""
        self.module.set_observer(fn)

    def stats(self) -> dict:
        """Per op: signatures seen, plans, calls replayed, calls that went to Python, recordings made and
        refused (with the reasons)."""
        out = {op: dict(v) for op, v in self.module.stats().items()}
        for op, why in self.refusals.items():
            out.setdefault(op, {})["refusals"] = dict(why)
        return out

    def close(self) -> dict:
        """Fold the last counts in and take the C++ kernels off the dispatcher (always, even where the
        folding fails); returns the final :meth:`stats`."""
        try:
            self.drain()
            return self.stats()
        finally:
            self.module.disable()
