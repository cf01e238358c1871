"""Kernel runtime: input checks, CuPy/NVRTC compilation cached per device, launches on torch's stream.

Every launcher in ``kernels/`` goes through three steps:

1. ``check_*``: validate device, dtype, layout, emptiness and size *before* anything launches, raising
   :class:`KernelArgumentError`, whose message names the op, the argument and what was expected.
2. ``function(source, name)``: the compiled kernel for the tensor's device (NVRTC called directly, the
   cubin loaded through CuPy's driver module; compiled once per (source, device, defines) and cached).
3. ``launch(fn, grid, block, args)``: launch on ``torch.cuda.current_stream()``. Tensors travel as raw
   device pointers (zero-copy); outputs are allocated by torch. A launch repeated with one configuration
   is a :class:`Launch`, made once, called with its pointers.

CuPy is optional: nothing here imports it until a CUDA launch is asked for.
"""
from __future__ import annotations

import array
import contextlib
import functools
import pathlib
import threading
from typing import Iterable, Sequence

import numpy as np
import torch

KERNEL_DIR = pathlib.Path(__file__).resolve().parent
INT32_MAX = 2**31 - 1
# No -ftz: subnormals are kept, as IEEE float32 and the CPU models keep them (see _module).
NVRTC_OPTIONS = ("--std=c++17", f"-I{KERNEL_DIR}")


class KernelArgumentError(ValueError):
    """A bad argument to a kernel op; the message names the op, the argument and the expectation."""

    def __init__(self, op: str, arg: str, message: str):
        self.op, self.arg = op, arg
        super().__init__(f"{op}: argument '{arg}': {message}")


class KernelUnavailableError(RuntimeError):
    """A CUDA launch was asked for on a machine that cannot run it (no CUDA device or no CuPy)."""


# --------------------------------------------------------------------------------------------------
# Availability


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CuPy that cannot find its CUDA libraries
        return False
    return True


def cuda_available() -> bool:
    """True when CUDA kernels can run here: a torch CUDA device and an importable CuPy."""
    return torch.cuda.is_available() and cupy_available()


# --------------------------------------------------------------------------------------------------
# Input checks


def check_tensor(
    op: str,
    arg: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    half_ok: bool = False,
) -> torch.Tensor:
    """Type, dtype, rank and device of one tensor argument; returns it for chaining. ``half_ok``: bfloat16
    and float16 pass too (a CUDA launcher that reads half itself, ``ACT_KINDS``)."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(op, arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise KernelArgumentError(op, arg, f"expected a {want} tensor, got shape {tuple(t.shape)}")
    if t.layout != torch.strided:
        raise KernelArgumentError(op, arg, f"expected a dense (strided) tensor, got layout {t.layout}")
    if t.dtype != dtype and not (half_ok and t.dtype in ACT_KINDS):
        raise KernelArgumentError(
            op, arg, f"expected dtype {dtype}, got {t.dtype} (the kernels take float32; bfloat16 and float16 "
            "through the registry's call)"
        )
    if device is not None and t.device != device:
        raise KernelArgumentError(op, arg, f"expected a tensor on {device}, got one on {t.device}")
    return t


def check_cuda(op: str, arg: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise KernelArgumentError(op, arg, f"the CUDA launcher needs a CUDA tensor, got one on {t.device}")
    if not cupy_available():
        raise KernelUnavailableError(
            f"{op}: CuPy is not installed; install the extra matching your CUDA (pip install "
            "'nnrand[cuda12]' or 'nnrand[cuda13]') or call the CPU model with a CPU tensor"
        )


def check_size(op: str, arg: str, t: torch.Tensor, *, limit: int = 2**40) -> None:
    """Kernels index with 64-bit offsets; refuse only sizes past what the launch grid can cover."""
    if t.numel() > limit:
        raise KernelArgumentError(op, arg, f"{t.numel()} elements exceeds the supported {limit}")


def layout_of(op: str, arg: str, t: torch.Tensor, *, allow: Iterable[str] = ("nchw", "channels_last")) -> str:
    """Memory layout of a 4-D tensor: 'nchw' (contiguous) or 'channels_last'; anything else is an error.

    A tensor with size-1 dims can be both; NCHW wins then (torch treats it the same way)."""
    allow = tuple(allow)
    if t.dim() != 4:
        raise KernelArgumentError(op, arg, f"expected a 4-D N,C,H,W tensor, got shape {tuple(t.shape)}")
    if t.is_contiguous():
        layout = "nchw"
    elif t.is_contiguous(memory_format=torch.channels_last):
        layout = "channels_last"
    else:
        raise KernelArgumentError(
            op, arg, f"expected a contiguous NCHW or channels_last tensor, got strides {t.stride()}"
        )
    if layout not in allow:
        raise KernelArgumentError(op, arg, f"layout {layout} is not supported here; supported: {', '.join(allow)}")
    return layout


def check_key(*items) -> tuple | None:
    """A hashable key for memoising an argument check: tensors by (dtype, device, shape, strides),
    everything else by value and type (1, 1.0 and True compare equal but are not equally valid), tuples
    element by element. None when an item cannot be a key (a list, an unhashable object): check it fully.

    A check memoised under this key sees nothing a repeated call could change, so a launcher called once
    per layer per step validates each configuration once."""
    key = []
    for v in items:
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:   # strides say nothing of a sparse tensor: check it fully
                return None
            key.append((v.dtype, v.device, v.shape, v.stride()))
        elif isinstance(v, tuple):
            key.append((v, tuple(type(e) for e in v)))
        elif v is None or isinstance(v, (int, float, str, np.integer)):
            key.append((v, type(v)))
        else:
            return None
    return tuple(key)


MEMO_LIMIT = 4096  # configurations remembered per launcher


def memo_check(cache: dict, check, *args):
    """``check(*args)``, remembered in ``cache`` under ``check_key(*args)``: errors are raised every time
    (never cached), a valid configuration is validated once."""
    key = check_key(*args)
    try:
        hit = cache.get(key) if key is not None else None
    except TypeError:  # a tuple holding something unhashable: check it fully, remember nothing
        key = hit = None
    if hit is None:
        hit = check(*args)
        if key is not None and len(cache) < MEMO_LIMIT:
            cache[key] = hit
    return hit


# --------------------------------------------------------------------------------------------------
# Compilation and launch


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


# The activation dtype a source is compiled for (common.cuh: act_t, widen, narrow); float32 by default.
ACT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def act_defines(dtype: torch.dtype) -> tuple[str, ...]:
    """NVRTC options that compile a source's ``act_t`` tensors as ``dtype`` (none for float32)."""
    kind = ACT_KINDS[dtype]
    return (f"-DNNRAND_ACT={kind}",) if kind else ()


# Compute capabilities whose arch-specific target (sm_XXa) a source may ask for: 9.0's wgmma instructions
ARCH_SPECIFIC = ("90",)


@functools.lru_cache(maxsize=None)
def _module(source: str, device_index: int, defines: tuple[str, ...] = (), arch_specific: bool = False):
    """Compile ``kernels/<source>`` for one device with NVRTC and load it (``defines``: extra ``-D`` options,
    one module per set; ``arch_specific``: target sm_90a rather than sm_90 on a 9.0 device, which defines
    ``__CUDA_ARCH_FEAT_SM90_ALL`` and admits wgmma; other devices get their plain target).

    NVRTC is called directly rather than through ``cupy.RawModule`` because CuPy appends ``-ftz=true``
    to every compilation: flushing subnormals to zero would make the kernels' float32 additions differ
    from IEEE arithmetic (and from the CPU order models) on subnormal data. Here the kernels keep
    NVRTC's defaults: no flush-to-zero, IEEE division and square root."""
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    code = (KERNEL_DIR / source).read_text()
    with cupy.cuda.Device(device_index) as dev:
        cc = dev.compute_capability
        arch = f"--gpu-architecture=sm_{cc}{'a' if arch_specific and cc in ARCH_SPECIFIC else ''}"
        prog = nvrtc.createProgram(code, source, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, *defines, arch])
            except nvrtc.NVRTCError as e:
                raise KernelCompileError(f"NVRTC could not compile {source}:\n{nvrtc.getProgramLog(prog)}") from e
            cubin = nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
        module = cupy.cuda.function.Module()
        module.load(cubin)
    return module


_NAMES: dict[int, str] = {}   # loaded function handle -> "source:name", for launch errors


@functools.lru_cache(maxsize=None)
def _function(source: str, name: str, device_index: int, defines: tuple[str, ...] = (), arch_specific: bool = False):
    fn = _module(source, device_index, defines, arch_specific).get_function(name)
    _NAMES[fn.ptr] = f"{source}:{name}"
    return fn


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8   # the driver's CUfunction_attribute
_SMEM_RAISED: dict[int, int] = {}


def function(source: str, name: str, device: torch.device, defines: tuple[str, ...] = (),
             arch_specific: bool = False, smem: int = 0):
    """The kernel ``name`` from ``kernels/<source>``, compiled for ``device`` (cached per ``defines`` and
    ``arch_specific``, see ``_module``), its dynamic shared-memory limit raised to ``smem`` bytes where
    that is over the default 48 KiB (once per loaded function and size)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = _function(source, name, index, defines, arch_specific)
    if smem > 48 * 1024 and _SMEM_RAISED.get(fn.ptr, 0) < smem:
        from cupy.cuda import driver

        driver.funcSetAttribute(fn.ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        _SMEM_RAISED[fn.ptr] = smem
    return fn


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int, device_index: int):
    import warnings

    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream in favour of Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device_index)


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument (zero-copy)."""
    return np.uint64(t.data_ptr())


def cupy_stream(device: torch.device):
    """torch's current stream of ``device`` as a CuPy stream (cached per stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _external_stream(torch.cuda.current_stream(index).cuda_stream, index)


def _param_block(args: tuple) -> tuple[array.array, array.array]:
    """The kernel parameters as the driver takes them: one 8-byte slot per argument, and the array of the
    slots' addresses (``void**``); both must stay alive until the launch returns. Every argument is a
    device pointer (``ptr``) or an integer: a 64-bit one fills its slot, a 32-bit one is read from the
    slot's low 4 bytes (little-endian two's complement). No kernel here takes a float argument. Built with
    the ``array`` module: a few microseconds less per launch than NumPy (a routed op launches several)."""
    slots = array.array("q", args) if args else array.array("q", (0,))
    base = slots.buffer_info()[0]
    return slots, array.array("Q", range(base, base + 8 * len(slots), 8))


_DRIVER = None   # cupy.cuda.driver, imported on the first launch (CuPy is optional)


def _driver():
    global _DRIVER
    if _DRIVER is None:
        from cupy.cuda import driver

        _DRIVER = driver
    return _DRIVER


def _dim3(dims: tuple[int, ...]) -> tuple[int, int, int]:
    n = len(dims)
    return dims if n == 3 else (dims[0], dims[1], 1) if n == 2 else (dims[0], 1, 1)


def _launch_kernel(fn, dims: tuple[int, ...], shared_mem: int, index: int, addresses: int,
                   stream: int | None = None) -> None:
    """cuLaunchKernel of ``fn`` (grid and block in ``dims``) on ``stream`` (a raw handle; None: torch's current
    stream of device ``index``), ``addresses`` the address of its ``void**`` parameter array; a driver error
    names the launch."""
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(index)
    try:
        (_DRIVER or _driver()).launchKernel(fn.ptr, *dims, shared_mem, stream, addresses, 0)
    except Exception as e:  # a driver error (grid, block, shared memory): say which launch
        raise RuntimeError(f"launching kernel {_NAMES.get(fn.ptr, hex(fn.ptr))} with grid {dims[:3]}, block "
                           f"{dims[3:]}, {shared_mem} bytes of dynamic shared memory failed: {e}") from e


def launch(fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, *, device: torch.device,
           shared_mem: int = 0, struct: array.array | None = None, stream: int | None = None) -> None:
    """Launch ``fn`` on torch's current stream of ``device`` (or on ``stream``, a raw stream handle of that
    device). ``struct``: the bytes of a struct the kernel takes by value as its first parameter (``args`` are
    the parameters after it).

    Straight through the driver (cuLaunchKernel on torch's raw stream handle): a routed backward op
    launches a few kernels per call, so the host time of a launch is part of a training step's cost
    (H200, bench/dev/launch_parts.py: cuLaunchKernel alone 3.3-3.8 us of host time, this function 6.8 us;
    no imports and no torch.cuda Python wrappers on this path). Capturable in a CUDA graph like any launch on
    the capturing stream. A launch repeated with the same configuration is cheaper as a :class:`Launch`."""
    index = device.index
    current = torch._C._cuda_getDevice()
    if index is None:
        index = current
    elif current != index:  # the driver launches into the current context
        with torch.cuda.device(index):
            return launch(fn, grid, block, args, device=device, shared_mem=shared_mem, struct=struct, stream=stream)
    dims = _dims6(grid, block)
    rec = RECORDER
    if rec is not None and rec.thread == threading.get_ident():
        rec.launch(fn, dims, shared_mem, index, args, stream, struct, _NAMES.get(fn.ptr, hex(fn.ptr)))
    slots, addresses = _param_block(args)
    if struct is not None:
        addresses.insert(0, struct.buffer_info()[0])
    _launch_kernel(fn, dims, int(shared_mem), index, addresses.buffer_info()[0], stream)
    del slots, struct  # the parameters lived until the launch had copied them


def _dims6(grid: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return (*_dim3(grid), *_dim3(block))


# A call being recorded for nnrand's C++ replay layer (nnrand/replay.py): every launch on its thread is
# logged into it (kernel, grid, block, shared memory, argument slots, stream). None almost always.
RECORDER = None

_LAUNCHES: dict[tuple, "Launch"] = {}
SLOT = object()   # in a Launch's arguments: one given per call (a device pointer or an integer)


class Launch:
    """One kernel launch configured once (kernel, grid, block, shared memory and every argument but those
    marked :data:`SLOT`), called with the ``SLOT`` values, in order, per launch:

        dx_sum = Launch(fn, (blocks,), (256,), (SLOT, SLOT, np.int64(n), np.int32(k)), device=dev)
        dx_sum(ptr(part), ptr(dx))

    A routed op's launcher prepares its launches once per call signature, so the per-call host work is
    only its slots: the parameter block lives with the object (the driver copies it during the call), a
    lock keeps two threads from filling it at once. Unlike :func:`launch`, the device is fixed when the
    object is made (a ``device`` without an index: the current one then), and no struct argument is taken."""

    __slots__ = ("_fn", "_dims", "_smem", "_index", "_where", "_slots", "_addresses", "_address", "_lock")

    def __init__(self, fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, *, device: torch.device,
                 shared_mem: int = 0):
        self._fn, self._dims, self._smem = fn, _dims6(grid, block), int(shared_mem)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._where = [i for i, a in enumerate(args) if a is SLOT]
        # the array takes integers (NumPy's, and objects with __index__) and refuses floats, None, strings
        self._slots = array.array("q", [0 if a is SLOT else a for a in args] or [0])
        base = self._slots.buffer_info()[0]
        self._addresses = array.array("Q", range(base, base + 8 * len(self._slots), 8))
        self._address = self._addresses.buffer_info()[0]
        self._lock = threading.Lock()

    @classmethod
    def of(cls, fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, *, device: torch.device,
           shared_mem: int = 0) -> "Launch":
        """The :class:`Launch` of this configuration, made on its first request and shared after (at most
        MEMO_LIMIT kept): a launcher that prepares on every direct call pays a lookup, not the making. The
        key holds the fixed arguments' types too (3.0 and True equal 3 and 1 but are not valid arguments)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (fn.ptr, *_dim3(grid), *_dim3(block), int(shared_mem), index, args, tuple(map(type, args)))
        try:
            made = _LAUNCHES.get(key)
        except TypeError:   # an unhashable argument: made anew, not kept
            return cls(fn, grid, block, args, device=torch.device("cuda", index), shared_mem=shared_mem)
        if made is None:
            made = cls(fn, grid, block, args, device=torch.device("cuda", index), shared_mem=shared_mem)
            if len(_LAUNCHES) < MEMO_LIMIT:
                made = _LAUNCHES.setdefault(key, made)   # two threads making one: both get the kept one
        return made

    def __call__(self, *values) -> None:
        if len(values) != len(self._where):
            raise TypeError(f"kernel {_NAMES.get(self._fn.ptr, hex(self._fn.ptr))}: {len(self._where)} per-call "
                            f"arguments expected, got {len(values)}")
        if torch._C._cuda_getDevice() != self._index:  # the driver launches into the current context
            with torch.cuda.device(self._index):
                return self(*values)
        slots = self._slots
        with self._lock:
            for i, v in zip(self._where, values):
                slots[i] = v
            rec = RECORDER
            if rec is not None and rec.thread == threading.get_ident():
                rec.launch(self._fn, self._dims, self._smem, self._index, slots.tolist(), None, None,
                           _NAMES.get(self._fn.ptr, hex(self._fn.ptr)))
            _launch_kernel(self._fn, self._dims, self._smem, self._index, self._address)


_PERSISTENT: dict[int, torch.Tensor] = {}   # storage address -> a device buffer kept for the process's life


def keep_persistent(t: torch.Tensor) -> torch.Tensor:
    """Keep ``t`` alive for the process's lifetime and say so: a buffer a launcher holds across calls (a
    stream's ticket counters) rather than makes per call. nnrand's replay layer takes only such tensors as
    the constants of a recorded call (``is_persistent``); any other tensor a call did not make refuses it."""
    _PERSISTENT[t.untyped_storage().data_ptr()] = t
    return t


def is_persistent(t: torch.Tensor) -> bool:
    kept = _PERSISTENT.get(t.untyped_storage().data_ptr())
    return kept is not None and kept.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


_TICKETS: dict[tuple[int, int], torch.Tensor] = {}
# Every counter buffer ever handed out on a stream stays alive: a CUDA graph captured with one holds its
# address, and replays after the buffer was outgrown must not count in memory reused for something else.
_RETIRED: list[torch.Tensor] = []


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters private to torch's current stream on ``device``.

    Single-pass deterministic kernels find their last block by drawing tickets; that block resets its
    counter to zero before it exits, so the buffer is zero again for the next launch on the same stream
    and no memset kernel is needed per call. Launches on one stream are ordered, so they can share it;
    every other stream gets its own buffer. A buffer outgrown by a larger request is kept alive, not
    freed (a graph may hold it). During a CUDA-graph capture that finds no buffer large enough, the
    counters come from the graph's own pool, zeroed by a fill kernel node of that graph on every replay
    (one per such launch), and are not shared with later launches (outside the graph they would be
    uninitialised until its first replay)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < count:
        with torch.cuda.device(index):   # the stream the key names: the current one of that device
            if torch.cuda.is_current_stream_capturing():
                return torch.zeros(max(count, 1024), dtype=torch.int32, device=torch.device("cuda", index))[:count]
        size = max(count, 1024, 2 * buf.numel() if buf is not None else 0)
        fresh = keep_persistent(torch.zeros(size, dtype=torch.int32, device=torch.device("cuda", index)))
        if buf is not None:
            _RETIRED.append(buf)
        buf = _TICKETS[key] = fresh
    return buf[:count]


_SIDE: dict[int, "torch.cuda.Stream"] = {}


def fork(device: torch.device):
    """(side, join): a second stream of ``device`` that waits for the work already queued on the current
    stream, so that work queued on it next overlaps what the caller queues meanwhile on the current one;
    ``join()`` makes the current stream wait for the side stream's work, and must come before anything
    there touches what the side stream wrote. Works under CUDA-graph capture (an event fork and join)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(index)
    if side is None:
        side = _SIDE[index] = torch.cuda.Stream(device=index)
    current = torch.cuda.current_stream(index)
    side.wait_stream(current)
    return side, lambda: current.wait_stream(side)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device)."""
    if isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(int(device))


@contextlib.contextmanager
def cudnn_default_heuristics():
    """cuDNN picking algorithms by its own heuristics (``benchmark`` and ``deterministic`` off), the
    previous two flags restored on exit. Only these two: ``torch.backends.cudnn.flags`` would also set
    the legacy TF32 switch, which torch >= 2.9 refuses to mix with the ``fp32_precision`` settings."""
    cudnn = torch.backends.cudnn
    saved = cudnn.benchmark, cudnn.deterministic
    cudnn.benchmark = cudnn.deterministic = False
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic = saved


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
