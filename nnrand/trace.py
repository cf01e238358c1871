"""Find the first op where two training runs part, and how far the difference spreads.

    python -m nnrand.trace record --kernel atomic --steps 3 -o a.trace     # same options as nnrand.train
    python -m nnrand.trace record --kernel atomic --steps 3 -o b.trace
    python -m nnrand.trace diff a.trace b.trace
    python -m nnrand.trace lockstep --vary ulp --steps 3                    # two replicas, one axis apart

or around any training code::

    with nnrand.trace.record("a.trace", model=model) as rec:
        for x, y in batches:
            rec.step()
            loss = F.cross_entropy(model(x), y)        # phase "forward"
            loss.backward()                            # ops inside autograd: phase "backward"
            with rec.phase("optimizer"):
                opt.step()

Every aten op that runs while recording (``ops="all"``, through a ``TorchDispatchMode``; ``"routed"``:
only the backward ops nnrand routes, reported by the open ``use_kernels`` context itself, so the other ops
run at full speed) adds one record per tensor output: step, phase, index within the step, aten op, module path,
output number, shape, dtype, a fingerprint of the output's bytes and two summaries (L2 norm, max |x|).
The fingerprint is an exact position-weighted sum of the output's bit patterns, sum_j (j + 1) * bits_j over
its words (elements; an 8-byte element as its two 4-byte halves) in wrapping int64 arithmetic, computed
on the tensor's device; integer addition is associative, so it does
not depend on how the device adds, and two outputs with different bytes almost surely differ in it. On a
GPU, outputs of the dtypes in ``FP_KINDS`` (the float, signed integer, uint8 and bool types) are
fingerprinted and summarised by one pass of ``kernels/fingerprint.cu``; others (complex, say) by the
torch formula. The per-op values stay on the device until the step ends (one transfer per step, no
synchronisation per op).

Kernel launches are what a record costs on the host, so they are shared. With ``ops="routed"`` the outputs
of one op (and the tensors of one ``snapshot``) go to the kernel in one launch, and inside a backward pass
they wait for its end: autograd does not write a gradient in place unless it alone holds its storage, and
the recorder holds it; a write by anything else (a gradient hook, a gradient-bucket copy) bumps the
tensor's version counter, which is checked at the launch and fails the recording (``TraceError``) rather
than let it keep a value the op did not produce. Writes that bump no version counter (through ``.data``, a
raw NCCL, Triton or CuPy kernel) are not seen: record such code with ``defer=False``. A pass holds up to
``HELD_BYTES`` of gradient storage this way (more peak memory; autograd then sums gradients out of place,
to the same bits). In-place and out= routed ops (``scatter_add_`` in ``gather``'s backward) are
fingerprinted at once. With ``ops="all"`` the
recorder sees every op that could write a recorded tensor, so the fingerprints wait and go out in batches of
up to ``FP_BATCH`` tensors: launched before an op writes (in place, out=, resize_, set_, the running
statistics a training-mode BatchNorm updates) the storage of a waiting tensor, when the device or stream
changes, when the batch is full or holds more than ``HELD_BYTES`` of storage, and when the step ends (which
waits for every stream that launched). A waiting tensor's storage is held so that its memory is not reused
first; the tensor itself is not (autograd steals a gradient only where nothing else holds its tensor, and a
recorder must not change which ops run). Writes that bypass the dispatcher (a raw CuPy or Triton kernel writing into a
recorded tensor before the batch goes out, ``UntypedStorage.resize_``, another storage object over the same
memory) are not seen: record such code with ``defer=False`` (one launch per op). Inside a CUDA-graph capture
not made through ``Recorder.capturing`` every record launches at once; step (``Recorder.step``) before
capturing, so that no batch is waiting.

The replay layer's trace sink (``ops="routed"`` with a ``model``, routed calls replayed by the C++ layer of
``nnrand/replay.py``, no ``keep``): while the recorder is the routing's only observer, a replayed call is
recorded in C++, with no trip into Python: its outputs fingerprinted as above (at once in a forward, at
the pass's end in a backward, storages held and version counters watched), its module found the same way
(the parameters it takes; the hooked parameterless leaves tell the sink their stack and autograd nodes),
its row queued. So are ``snapshot``'s lists of contiguous CUDA tensors. The recorder takes the queue in
call order before it records anything itself, when the phase changes, at a pass's end and at the step's
end, so the trace is the one the Python observer would record, record for record and code for code. A
call or snapshot the sink cannot take (a CPU or non-contiguous output, a dtype the kernel does not take)
goes the Python way; a second observer (``routing.observe``) turns the sink off.

Steps replayed from a CUDA graph (``record --cuda-graph``, or ``graph_step`` and ``replay`` around any
model): the captured ops are recorded once, inside the capture (``Recorder.capturing``), their fingerprint
launches (batched as above) captured with them; each replay then rewrites the capture's value rows, and
``Recorder.replayed`` adds the captured records to the step with the step's number and indices, their
values copied from those rows on the device. Per step that costs no dispatch per op: a row per record
on the host and a copy of the values on the device.

Module paths: the forward op runs inside a module's ``forward``, whose path the recorder keeps on a stack; a
backward op is attributed to the module whose forward returned the tensor whose autograd node it runs in
(set on the node when that module returns). The backward of an op inside a module's forward whose result the
module does not return (an intermediate sum, the weight transpose of a linear layer) has no module: an empty
path, as have the loss and the optimizer's ops outside any module. With ``ops="all"`` and a ``model``, the
recorder names the model's modules by wrapping each one's ``forward`` while it records (an entry in the
module's ``__dict__``, taken out on exit; module hooks would put every module call on torch's slower path).
Then a module outside the model names nothing (its ops take its caller's path), nor do the ops of a module's
own forward hooks, which run before and after its ``forward``; a ``forward`` called directly names its
module. A deep copy of the model made while recording (a CUDA-graph step's warm-up copy) keeps the wrappers,
bound to the copy and named as the original, passing straight through once the recording ends; a shallow
copy (``copy.copy``) of one of the model's modules made while recording would run the original's forward,
and a module pickled whole then keeps its bound forward in its ``__dict__``. A model holding a TorchScript
module or a ``DataParallel`` (whose replicas copy each module's ``__dict__``) is named by global module
hooks instead, as is every module when there is no model (its type's name under its caller's path); a
``DataParallel`` around the model is seen only when it is the ``model`` given. With ``ops="routed"`` and a
``model``, a routed op is attributed to the module owning a parameter it takes (a conv's or BatchNorm's
weight) or whose gradient its autograd node accumulates, directly or through an autocast copy; only the
model's leaf modules without parameters (a pool, say) are hooked, but for torch's activations, dropout and
reshaping modules, which run no routed op (a copy of the model made while recording keeps those hooks, and
with them the recorder).

File format (``FORMAT``, version ``VERSION``): a NumPy ``.npz`` archive with a JSON ``header`` (format,
version, metadata such as the routing and seeds), one column per record field (``step`` int32, ``phase``
uint8 index into ``PHASES``, ``index`` int32, ``op``/``module``/``shape`` int32 indices into the string
tables ``ops``/``modules``/``shapes``, ``output`` int16, ``dtype`` int16 index into ``dtypes``, ``fp``
int64, ``l2`` and ``maxabs`` float64) and, for records kept in full, ``tensor_<record>`` arrays. Little
endian, no pickles: portable across machines. Written atomically. Files of earlier versions still load
(version 1: an 8-byte element's fingerprint word the whole element; version 2: profiler annotations took
an op index); ``diff`` refuses to compare traces of two versions.
"""
from __future__ import annotations

import argparse
import array
import contextlib
import functools
import gc
import io
import itertools
import json
import sys
import threading
import zipfile
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FORMAT = "nnrand-trace"
VERSION = 3
# version 1 fingerprinted an 8-byte element as one 64-bit word (see fingerprint); version 2 gave profiler
# annotations (record_function ranges) an op index, so that a step calling zero_grad numbered its ops apart
READABLE_VERSIONS = (1, 2, 3)
PHASES = ("forward", "backward", "optimizer", "other")
_PHASE = {name: i for i, name in enumerate(PHASES)}
ROUTED_ATEN = ("convolution_backward", "max_pool2d_with_indices_backward", "native_batch_norm_backward",
               "cudnn_batch_norm_backward")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}   # the fingerprint's words (8 bytes: halves)
COLUMNS = ("step", "phase", "index", "op", "module", "output", "shape", "dtype", "fp", "l2", "maxabs")


class TraceFormatError(ValueError):
    """A file that is not a complete nnrand trace of a version this code reads."""


class TraceError(RuntimeError):
    """A recording that cannot give the values it would claim."""


# --------------------------------------------------------------------------------------------------
# Fingerprints


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, 1024) + 1, dtype=torch.int64, device=device)
        _WEIGHTS[device] = w
    return w[:n]


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """sum_i (i + 1) * bits_i (wrapping int64) over the tensor's words in logical (row-major) order, as a
    0-d int64 tensor on the tensor's device. A word is an element of 1, 2 or 4 bytes (1 byte zero-extended,
    wider ones sign-extended), or either 4-byte half of an 8-byte element (low half first): a 64-bit word
    times an even weight would lose its top bit in the wrapping product (a float64 sign, say), which
    trace format version 1 did."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:   # its bytes as they are (a bool viewed from other bytes may hold 2, say)
        t = t.view(torch.uint8)
    elif t.is_complex():   # the same bytes as (real, imaginary) pairs
        t = torch.view_as_real(t).reshape(-1)
    if t.element_size() == 8:   # little-endian: each element's low half, then its high half
        t = t.view(torch.int32)
    bits = t.view(_INT_VIEW[t.element_size()]).to(torch.int64)
    return (bits * _weights(bits.numel(), bits.device)).sum()


def summaries(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm, max |x|) in float64 on the device (complex: of the moduli; bool: of its bytes)."""
    x = t.detach().reshape(-1)
    if x.dtype == torch.bool:
        x = x.contiguous().view(torch.uint8)
    if x.is_complex():
        return torch.linalg.vector_norm(torch.view_as_real(x).to(torch.float64)), x.abs().to(torch.float64).max()
    x = x.to(torch.float64)
    return torch.linalg.vector_norm(x), x.abs().max()


FP_THREADS = 256           # FP_THREADS in kernels/fingerprint.cu
FP_WORDS_PER_THREAD = 64   # at least this many words per thread before another block is added
FP_MAX_BLOCKS = 1024       # blocks of one tensor at most
FP_BATCH = 96              # FP_BATCH in kernels/fingerprint.cu: tensors per fingerprint_batch launch
# the element types the kernels take, as their kind codes (FP_F32 ... FP_I8 in kernels/fingerprint.cu); bool
# is read as its byte; complex and the unsigned 16-64-bit types take the torch formula
FP_KINDS = {torch.float32: 0, torch.int32: 1, torch.float64: 2, torch.int64: 3, torch.float16: 4,
            torch.bfloat16: 5, torch.int16: 6, torch.uint8: 7, torch.bool: 7, torch.int8: 8}
# bytes of storage a recorder's deferred fingerprints may keep alive before they are launched
HELD_BYTES = 1 << 30
FP_SCRATCH_BLOCKS = 16 * FP_MAX_BLOCKS   # block partials per stream: the blocks of one launch at most
_FP_BATCH_SLOTS = 1 + 5 * FP_BATCH       # int64 slots of the kernel's FpBatch (count, then 5 per tensor)


def fp_blocks(n: int) -> int:
    """The blocks a tensor of ``n`` elements is fingerprinted by (in either kernel); its result depends on n
    and this count only."""
    b = -(-n // _FP_WORDS_PER_BLOCK)   # conditionals, not max/min: a record's hot path
    return 1 if b < 1 else b if b < FP_MAX_BLOCKS else FP_MAX_BLOCKS


_FP_WORDS_PER_BLOCK = FP_THREADS * FP_WORDS_PER_THREAD


def fp_chunk(n: int, blocks: int) -> int:
    """The elements each of a tensor's ``blocks`` blocks reduces: ceil(n / blocks) rounded up to a multiple
    of 4 (the kernel reads 4-byte elements in aligned groups of 4; the last block may get fewer)."""
    return (-(-n // blocks) + 3) & -4


@dataclass(frozen=True)
class _FpState:
    one: object          # kernels/fingerprint.cu: fingerprint
    batch: object        # fingerprint_batch
    dev: torch.device
    scratch: torch.Tensor   # FP_SCRATCH_BLOCKS block partials of each: fp u64 | sq f64 | mx f64 | nan i32
    counters: torch.Tensor  # FP_BATCH ticket counters (runtime.ticket_counters: reset by their last block)
    parts: tuple[int, ...]  # the four partial arrays' and the counters' addresses, as plain ints (packed
                            # per launch: cheaper than NumPy scalars or data_ptr() calls)


# per (device index, raw stream): launches on one stream run in order, so they share scratch and counters
_FP_STATE: dict[tuple[int, int], _FpState] = {}


def _fp_state(index: int, stream: int | None = None) -> _FpState:
    """The kernels, scratch and counters of device ``index`` for launches on ``stream`` (a raw handle;
    None: torch's current stream there)."""
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(index)
    st = _FP_STATE.get((index, stream))
    if st is None:
        from kernels import runtime

        dev = torch.device("cuda", index)
        b = FP_SCRATCH_BLOCKS
        with torch.cuda.device(index), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):
            scratch = torch.empty(4 * b, dtype=torch.int64, device=dev)
            counters = runtime.ticket_counters(dev, FP_BATCH)   # the stream's own
        base = scratch.data_ptr()
        st = _FpState(runtime.function("fingerprint.cu", "fingerprint", dev),
                      runtime.function("fingerprint.cu", "fingerprint_batch", dev), dev, scratch, counters,
                      (base, base + 8 * b, base + 16 * b, base + 24 * b, counters.data_ptr()))
        _FP_STATE[(index, stream)] = st
    return st


def fingerprint_cuda(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(fingerprint's bits, L2, max |x|) of a CUDA tensor of a dtype in FP_KINDS, written as three float64
    into ``out`` (a new (3,) tensor on its device when None) by one launch of kernels/fingerprint.cu.
    Same fingerprint as ``fingerprint``; the summaries are added in the kernel's fixed order
    (deterministic, and within a few double roundings of torch's)."""
    if out is None:
        out = torch.empty(3, dtype=torch.float64, device=t.device)
    elif not (out.is_contiguous() and out.numel() == 3 and out.dtype == torch.float64 and out.device == t.device):
        raise ValueError(f"fingerprint_cuda: out must be 3 contiguous float64 on {t.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if t.dtype not in FP_KINDS:
        raise ValueError(f"fingerprint_cuda: no kernel for {t.dtype} (it takes {', '.join(map(str, FP_KINDS))})")
    _launch_fingerprint(t, out.data_ptr())
    return out


def _launch_fingerprint(t: torch.Tensor, out_ptr: int) -> None:
    """One fingerprint launch for one tensor (a dtype in FP_KINDS): no imports, no NumPy scalars and no
    checks beyond contiguity on this path (H200: 8.2 us of host time per launch, bench/dev/launch_parts.py)."""
    if not t.is_contiguous():   # the fingerprint reads the elements in logical (row-major) order
        t = t.contiguous()
    st = _fp_state(t.get_device())
    n = t.numel()
    blocks = fp_blocks(n)
    _runtime().launch(st.one, (blocks,), (FP_THREADS,),
                      (t.data_ptr(), n, fp_chunk(n, blocks), FP_KINDS[t.dtype], *st.parts, out_ptr), device=st.dev)


def _launch_fingerprints(ts: list[torch.Tensor], out_ptrs: list[int]) -> list | None:
    """Fingerprints of tensors alive together on one CUDA device (an op's outputs, a snapshot): up to
    FP_BATCH per launch of ``fingerprint_batch``, each with the bits ``_launch_fingerprint`` gives it.
    Returns the launches (``_fp_batches``), which launch the same again while the tensors are contiguous;
    None for one tensor (one launch of ``fingerprint``)."""
    if len(ts) == 1:
        _launch_fingerprint(ts[0], out_ptrs[0])
        return None
    st = _fp_state(ts[0].get_device())
    # copies of non-contiguous tensors, alive in this list until their launches are enqueued (stream order
    # protects them after that)
    ts = [t if t.is_contiguous() else t.contiguous() for t in ts]
    structs = _fp_batches(ts, out_ptrs)
    _launch_structs(st, structs)
    return structs


def _fp_batches(ts: list[torch.Tensor], out_ptrs: list[int]) -> list[tuple[array.array, int]]:
    """The ``fingerprint_batch`` launches (FpBatch struct, blocks) of contiguous tensors alive on one device:
    up to FP_BATCH tensors and FP_SCRATCH_BLOCKS blocks each. A launch's bytes depend only on the tensors'
    addresses, sizes and dtypes and the output addresses: the same tensors into the same rows launch the
    same structs again (``Recorder.snapshot``)."""
    out, desc, first = [], [], 0
    for t, ptr in zip(ts, out_ptrs):
        n = t.numel()
        blocks = fp_blocks(n)
        if len(desc) == 5 * FP_BATCH or first + blocks > FP_SCRATCH_BLOCKS:
            out.append((_batch_struct(desc), first))
            desc, first = [], 0
        desc += (t.data_ptr(), n, fp_chunk(n, blocks), ptr, _packed(first, blocks, FP_KINDS[t.dtype]))
        first += blocks
    out.append((_batch_struct(desc), first))
    return out


def _packed(first: int, blocks: int, kind: int) -> int:
    """FpDesc's last 8 bytes: int first, short blocks, short kind (little-endian)."""
    return first | blocks << 32 | kind << 48


def _batch_struct(desc: list[int]) -> array.array:
    """FpBatch's bytes: the count of descriptors, the descriptors (5 words each), zeros to its size."""
    batch = array.array("q", (len(desc) // 5,))
    batch.extend(desc)
    batch.extend(_ZEROS[:_FP_BATCH_SLOTS - len(batch)])
    return batch


def _launch_struct(st: _FpState, struct: array.array, blocks: int, stream: int | None = None) -> None:
    _runtime().launch(st.batch, (blocks,), (FP_THREADS,), st.parts, device=st.dev, struct=struct, stream=stream)


def _launch_structs(st: _FpState, structs: list[tuple[array.array, int]]) -> None:
    for struct, blocks in structs:
        _launch_struct(st, struct, blocks)


def _launch_batch(st: _FpState, desc: list[int], blocks: int, stream: int | None = None) -> None:
    _launch_struct(st, _batch_struct(desc), blocks, stream)


_ZEROS = array.array("q", bytes(8 * _FP_BATCH_SLOTS))


def _launch(batch: list) -> None:
    """Launch a recorder's pending batch ([device index, tensors, slot addresses]) and empty it."""
    if batch:
        _launch_fingerprints(batch[1], batch[2])
        batch.clear()


@functools.lru_cache(maxsize=1)
def _runtime():
    from kernels import runtime

    return runtime


def _recordable(t) -> bool:
    """An output with bytes to fingerprint: a dense (strided) tensor with elements, on a real device;
    not sparse, nested, quantized or meta (those are skipped, not recorded)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested and not t.is_quantized
            and not t.is_meta and t.numel() > 0)   # (is_meta: t.device.type builds a device object)


def _fused(t: torch.Tensor) -> bool:
    """Whether ``fingerprint_cuda`` takes this tensor (CUDA, a dtype in FP_KINDS, kernels compiled here)."""
    return t.is_cuda and t.dtype in FP_KINDS and _kernels_here()


@functools.lru_cache(maxsize=1)
def _kernels_here() -> bool:
    from kernels import cuda_available

    return cuda_available()


def _stream(index: int) -> int:
    """torch's current raw stream on CUDA device ``index`` (0 for a CPU tensor's -1)."""
    return torch._C._cuda_getCurrentRawStream(index) if index >= 0 else 0


def _capturing(index: int) -> bool:
    """Whether torch's current stream is capturing a CUDA graph (a deferred launch would miss the graph)."""
    return index >= 0 and torch._C._cuda_isCurrentStreamCapturing()


def record_values(t: torch.Tensor) -> torch.Tensor:
    """(fingerprint's bits, L2, max |x|) as a (3,) float64 tensor on the tensor's device."""
    if _fused(t):
        return fingerprint_cuda(t)
    l2, mx = summaries(t)
    return torch.stack((fingerprint(t).view(torch.float64), l2, mx))


def kept_array(t: torch.Tensor) -> np.ndarray:
    """A record's tensor as kept in a trace: its values as a host array, bfloat16 as its int16 bit patterns
    (NumPy has no bfloat16; ``kept_values`` reads them back)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.cpu().numpy().copy()


def kept_values(a: np.ndarray, dtype: str) -> np.ndarray:
    """A kept array's values as NumPy floats (``dtype``: the record's dtype name)."""
    if dtype == "bfloat16":
        return (a.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a


class _Slots:
    """Per CUDA device, the step's records' (fp, L2, max) rows, written in place by the fingerprint kernel
    and read back in one copy when the step ends: no allocation per record. Grows by ``ROWS`` rows."""
    ROWS = 4096

    def __init__(self, dev: torch.device):
        self.dev, self.chunks, self.used = dev, [], 0
        self._limit = 0   # the current chunk's end (a row number); 0: no current chunk
        self._at = 0      # the current chunk's address, less 24 bytes per row before it

    def next_ptr(self) -> int:
        """The device address of the next free row (24 bytes)."""
        used = self.used
        if used == self._limit:   # the first row of a chunk
            chunk = used // self.ROWS
            if chunk == len(self.chunks):
                self.chunks.append(torch.empty(self.ROWS, 3, dtype=torch.float64, device=self.dev))
            self._at, self._limit = self.chunks[chunk].data_ptr() - 24 * used, used + self.ROWS
        self.used = used + 1
        return self._at + 24 * used

    def take(self) -> np.ndarray:
        """The rows written since the last take, on the host (synchronises with the device)."""
        rows = torch.cat(self.chunks)[:self.used] if len(self.chunks) > 1 else self.chunks[0][:self.used]
        self.reset()
        return rows.cpu().numpy()

    def reset(self) -> None:
        """Start again from the first row."""
        self.used = self._limit = 0

    def append(self, src: "_Slots") -> int:
        """Copy ``src``'s rows (a captured step's, which its replay rewrote) after this one's, on the current
        stream; returns the first row they went to. A copy per run of rows that neither crosses a chunk."""
        first, n, rows = self.used, src.used, self.ROWS
        while len(self.chunks) * rows < first + n:
            self.chunks.append(torch.empty(rows, 3, dtype=torch.float64, device=self.dev))
        done = 0
        while done < n:
            (c, o), (sc, so) = divmod(first + done, rows), divmod(done, rows)
            m = min(rows - o, rows - so, n - done)
            self.chunks[c][o:o + m].copy_(src.chunks[sc][so:so + m])
            done += m
        used = self.used = first + n
        if used % rows:   # within a chunk: its address, as next_ptr keeps it
            chunk = used // rows
            self._at, self._limit = self.chunks[chunk].data_ptr() - 24 * chunk * rows, (chunk + 1) * rows
        else:   # at a chunk's first row: next_ptr finds (or makes) that chunk
            self._limit = used
        return first


class _TakenSlots:
    """The trace sink's slot rows of one device for a step (``Recorder._take_sink``: its chunks, the last cut
    to the rows used), read as ``_Slots``: joined when taken, after the streams that wrote them are waited
    for."""

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks, self.used = chunks, sum(c.shape[0] for c in chunks)

    def take(self) -> np.ndarray:
        return (torch.cat(self.chunks) if len(self.chunks) > 1 else self.chunks[0]).cpu().numpy()


@dataclass(eq=False)
class _SnapshotPlan:
    """``Recorder.snapshot``'s plan for one list: the list (``named``) and its key (names, tensor identities,
    addresses, shapes, dtypes, contiguity) it holds for, the device index, the tensors, their records'
    codes, and the output rows of its last launch (``outs``) with that launch's bytes (``structs``, see
    ``_fp_batches``; contiguous tensors only), launched again into the same rows."""

    named: list
    key: list
    index: int
    ts: list
    codes: list
    opc: int
    contiguous: bool
    outs: list | None = None
    structs: list | None = None


@dataclass
class _Captured:
    """The records of a CUDA-graph capture (``Recorder.capturing``): their rows (step and index as captured)
    and values (``pending``: rows of ``slots``, the capture's own, which every replay rewrites, or
    tensors), how many op indices the capture took (``ops``), and the capturing stream (a raw handle; -1:
    none), the one stream on which fingerprints wait for a batch inside the capture."""

    rows: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    slots: dict = field(default_factory=dict)
    ops: int = 0
    stream: int = -1


class _Deferred:
    """Fingerprints recorded on one device and stream, waiting for one launch of ``fingerprint_batch``
    (filled by ``Recorder._add``): their descriptors (FpDesc's five 8-byte words each), their blocks
    (the next one's first), and the storages of their tensors, held until the launch
    is enqueued so that their memory cannot be reused before the kernel reads it; ``bases``: those
    storages' addresses, against which the recorder checks every op that writes its arguments.
    ``watched`` (ops="routed", which sees no other op): per tensor, a detached alias (sharing its version
    counter, not its autograd identity), the counter when recorded and its record's row, checked when the
    batch goes out."""

    __slots__ = ("index", "stream", "desc", "held", "bases", "blocks", "nbytes", "watched")

    def __init__(self, index: int, stream: int):
        self.index, self.stream = index, stream
        self.desc: list[int] = []
        self.held: list[torch.UntypedStorage] = []
        self.bases: set[int] = set()
        self.blocks = self.nbytes = 0
        self.watched: list[tuple[torch.Tensor, int, int]] = []


def _launch_deferred(d: _Deferred) -> None:
    """Launch a deferred batch on the stream its tensors were recorded on; where torch's current stream is
    another one, it waits for that launch (its next op may write what the batch reads)."""
    with torch.cuda.device(d.index):
        _launch_batch(_fp_state(d.index, d.stream), d.desc, d.blocks, stream=d.stream)
        # (a capturing stream does not wait: the write that forced this launch runs when the graph does)
        if not torch._C._cuda_isCurrentStreamCapturing():
            _wait_for(d.index, d.stream)


def _wait_for(index: int, stream: int) -> None:
    """Make torch's current stream on device ``index`` wait for the work enqueued so far on ``stream``."""
    if torch._C._cuda_getCurrentRawStream(index) != stream:
        with torch.cuda.device(index):
            done = torch.cuda.Event()
            done.record(torch.cuda.ExternalStream(stream))
            torch.cuda.current_stream().wait_event(done)


_VIEW_KEY = torch._C.DispatchKey.ADInplaceOrView

_set_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_set_eval_frame = getattr(_set_eval_frame, "set_eval_frame", None) or (lambda callback: None)
_DYNAMO_SKIPS: list[bool] = []


def _dynamo_skips_dispatch() -> None:
    """Once per process, before the first recording: mark ``Recorder.__torch_dispatch__``'s code for dynamo
    to skip; where that cannot be done (no dynamo here), torch's own per-call wrapper goes around it."""
    if _DYNAMO_SKIPS:
        return
    raw = Recorder.__dict__["__torch_dispatch__"]
    try:
        from torch._dynamo.eval_frame import skip_code

        skip_code(raw.__code__)
        if not hasattr(torch._C._dynamo.eval_frame, "set_eval_frame"):
            raise AttributeError("set_eval_frame")
    except (ImportError, AttributeError):
        Recorder.__torch_dispatch__ = torch._disable_dynamo(raw, recursive=True)
    _DYNAMO_SKIPS.append(True)

# torch.nn modules whose forward runs no op nnrand routes, nor anything whose backward it routes (exact types:
# a subclass may do more): ops="routed" does not hook them
_UNROUTED_MODULES = frozenset((
    torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.SELU, torch.nn.CELU,
    torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.Hardswish,
    torch.nn.Hardsigmoid, torch.nn.Hardtanh, torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Dropout,
    torch.nn.Dropout2d, torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten, torch.nn.Sequential,
    torch.nn.ModuleList, torch.nn.ModuleDict))


def _aliases_an_arg(out, args: tuple) -> bool:
    """Whether an op's output is one of its tensor arguments (an in-place or out= op)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(o is a for o in outs if isinstance(o, torch.Tensor) for a in args)


# profiler annotations (record_function ranges, which torch's optimizers open around zero_grad and step): ops
# to the dispatcher, not computation; not records, and they take no index (a step without zero_grad, replayed
# from a CUDA graph, has the op indices of an eager step that calls it)
_ANNOTATIONS = frozenset(getattr(torch.ops.profiler, name) for name in
                         ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
                         if hasattr(torch.ops.profiler, name))
# per aten overload: the (position, name) of each argument it writes (in place, out=), from its schema
_WRITES: dict[object, tuple[tuple[int, str], ...]] = {}
# arguments ops write although their schemas do not mark them: the training-mode BatchNorm forwards and
# SyncBatchNorm's statistics ops update the running statistics in place
_UNMARKED_WRITES = {op: ("running_mean", "running_var") for op in (
    "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "batch_norm_update_stats",
    "batch_norm_gather_stats", "batch_norm_gather_stats_with_counts")}


def _writes(func) -> tuple[tuple[int, str], ...]:
    w = _WRITES.get(func)
    if w is None:
        extra = _UNMARKED_WRITES.get(func._overloadpacket.__name__, ())
        w = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                  if a.alias_info is not None and a.alias_info.is_write or a.name in extra)
    return w


def _writes_any(bases: set[int], writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict | None) -> bool:
    """Whether an op writing ``writes`` of ``args``/``kwargs`` writes into one of the storages at ``bases``
    (a tensor whose storage cannot be read counts as writing)."""
    for i, name in writes:
        a = args[i] if i < len(args) else (kwargs or {}).get(name)
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(x, torch.Tensor):
                try:
                    if x.untyped_storage().data_ptr() in bases:
                        return True
                except (RuntimeError, NotImplementedError):
                    return True
    return False


# --------------------------------------------------------------------------------------------------
# Recording


def _tag(out, path: str, args: tuple) -> None:
    """Set ``path`` as the module of each returned tensor's autograd node, unless an inner module set one."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and not any(t is a for a in args):   # (a passthrough made no node)
            node = t.grad_fn   # a new Python object per read
            if node is not None:
                node.metadata.setdefault("nnrand_module", path)


# models the wrappers cannot serve (global module hooks name their modules instead): TorchScript modules run
# their forward in C++, and DataParallel replicates its module by copying each submodule's __dict__, so a
# replica would share (and run) the original's wrapper
_UNWRAPPABLE = (torch.jit.ScriptModule, torch.nn.DataParallel)


class _Naming:
    """What a recorder's ``_Named`` wrappers share: its module stack, and whether they name (while it
    records). Not the recorder itself: a copy of the model made while recording keeps its wrappers."""

    __slots__ = ("stack", "on")

    def __init__(self, stack: list[str]):
        self.stack, self.on = stack, False


def _plain_forward(module: torch.nn.Module, inner):
    """What a wrapper of ``module`` calls: the instance's own earlier forward (``inner``), else its class's
    bound to it (found statically: a staticmethod stays one)."""
    import inspect

    if inner is not None:
        return inner
    raw = inspect.getattr_static(type(module), "forward")
    return raw.__get__(module, type(module)) if hasattr(raw, "__get__") else raw


_FORWARD_ATTRS = frozenset(("__name__", "__qualname__", "__func__", "__self__", "__globals__", "__code__",
                            "__defaults__", "__kwdefaults__", "__annotations__"))


class _Named:
    """A module's ``forward`` while a recorder names the ops it runs (see the module docstring): its path on
    the recorder's stack during the call, then on the autograd node of each tensor it returns. Put in the
    module's ``__dict__`` (ahead of its class's ``forward``) by ``install``; ``remove`` takes it out again.
    Passes straight through once the recording has ended. (Dynamo compiles nothing while a dispatch mode such
    as the recorder is active, so it meets a wrapper only in a copy made while recording and compiled after.)"""

    __slots__ = ("naming", "module", "path", "inner", "call")

    def __init__(self, naming: _Naming, module: torch.nn.Module, path: str, inner=None):
        self.naming, self.module, self.path = naming, module, path
        self.inner = inner   # the instance's own forward before this one, if it had one
        self.call = _plain_forward(module, inner)

    @classmethod
    def install(cls, naming: _Naming, module: torch.nn.Module, path: str) -> "_Named":
        named = cls(naming, module, path, module.__dict__.get("forward"))
        module.__dict__["forward"] = named
        return named

    def remove(self) -> None:
        """Out of its module's ``__dict__``; where another recorder's wrapper went on top of it since, out of
        that one's chain (any other wrapper on top keeps it, passing through)."""
        d = self.module.__dict__
        top = d.get("forward")
        if top is self:
            if self.inner is None:
                del d["forward"]
            else:
                d["forward"] = self.inner
            return
        while isinstance(top, _Named):
            if top.inner is self:
                top.inner = self.inner
                top.call = self.call
                return
            top = top.inner

    def __call__(self, *args, **kwargs):
        naming = self.naming
        if not naming.on:
            return self.call(*args, **kwargs)
        stack = naming.stack
        stack.append(self.path)
        try:   # a forward that raises still leaves the stack
            out = self.call(*args, **kwargs)
        finally:
            stack.pop()
        _tag(out, self.path, args)
        return out

    @property
    def __wrapped__(self):
        """The forward it stands for (``inspect.signature`` follows it)."""
        return self.call

    def __getattr__(self, name: str):
        """The wrapped forward's function attributes (its ``__name__``, ``__func__``, ``__globals__``...); no
        others (a ``__dict__`` read through would stand for a slotted object's own, which dynamo guards)."""
        if name not in _FORWARD_ATTRS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.call, name)

    def __deepcopy__(self, memo):
        """In a deep copy of its module (the copy already in ``memo``): bound to the copy, same naming."""
        import copy

        return _Named(self.naming, memo.get(id(self.module), self.module), self.path,
                      copy.deepcopy(self.inner, memo))

    def __reduce__(self):
        """Pickled (the module saved whole while recording) as the forward it stands for."""
        return _plain_forward, (self.module, self.inner)


class Recorder(TorchDispatchMode):
    """Records every aten op's tensor outputs while active (see the module docstring)."""

    def __init__(self, *, ops: str = "all", model: torch.nn.Module | None = None,
                 keep: set[tuple[int, str, int]] | None = None, meta: dict | None = None, defer: bool = True):
        super().__init__()
        if ops not in ("all", "routed"):
            raise ValueError(f"ops must be 'all' or 'routed', got {ops!r}")
        self.ops, self.keep, self.meta = ops, keep or set(), dict(meta or {})
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self._owners: dict[int, str] = {}   # ops="routed" with a model: id(parameter) -> its module's path
        self._owned: list[torch.Tensor] = []   # those parameters, alive while recording (no id reused)
        self._unchecked = False   # set on an exit by exception: waiting batches launch unchecked
        self.stack: list[str] = []
        self._phase = "forward"
        self.step_no, self.index = -1, 0
        self.rows: list[tuple] = []        # host fields per record
        # per record of the current step: its (fp bits, L2, max) as a (3,) tensor on its device, or where
        # the fingerprint kernel wrote them, (device index, row of that device's _Slots)
        self.pending: list[torch.Tensor | tuple[int, int]] = []
        self.slots: dict[int, _Slots] = {}
        self._shapes: dict[torch.Size, int] = {}    # codes by value, not by formatted string: hot path
        self._codes: dict[tuple[str, str], tuple[int, int]] = {}   # (op, module) -> their codes
        self._plans: dict[str, _SnapshotPlan] = {}   # snapshot's last plan per op
        self._dtypes: dict[torch.dtype, int] = {}
        self.values: list[np.ndarray] = []
        self.tensors: dict[int, np.ndarray] = {}
        self.tables: dict[str, dict[str, int]] = {"ops": {}, "modules": {}, "shapes": {}, "dtypes": {}}
        self._hooks = []   # module hook handles, or the _Named wrappers installed (each has remove())
        self._naming = _Naming(self.stack)   # what the wrappers share
        self._entered = False
        # per thread: whether the ops running are the recorder's own (fingerprints, transfers), not records;
        # thread-local, so that another thread's ops (autograd's per-device backward) are recorded meanwhile
        self._local = threading.local()
        # ops="all" sees every op that could write a recorded tensor, so its kernel fingerprints wait and go
        # out in batches (_Deferred): launched before an op writes one of them, when a batch is full, when
        # the device or stream changes, and when the step ends
        self._defer = defer and ops == "all"
        # ops="routed" sees only the routed ops, not what writes their outputs: in a backward pass, where
        # autograd does not write a gradient it does not own alone (and a held storage makes it not alone),
        # their fingerprints wait for the end of the pass (a callback queued with autograd's engine), and
        # any version counter bumped meanwhile (an in-place op on them) fails the recording
        self._defer_backward = defer and ops == "routed" and all(
            hasattr(torch._C, f) for f in ("_current_graph_task_id", "_dispatch_tls_set_dispatch_key_excluded"))
        self._tasks: set[int] = set()   # graph tasks whose end launches the waiting batch
        self._capture: _Captured | None = None   # while capturing a CUDA graph: where the records go
        self._paused = False   # on every thread (autograd runs a CUDA backward on its own): see paused()
        self._deferred: _Deferred | None = None
        # CUDA (device index, raw stream) pairs that launched fingerprints this step: the step's end waits
        # for each before reading the rows back
        self._streams: set[tuple[int, int]] = set()
        # autograd runs a backward per device on its own thread: records and launches one at a time
        self._lock = threading.RLock()
        # ops="routed" with a model, over the C++ replay layer: the replay extension, whose trace sink
        # records the replayed calls (see _start_sink); None: every call reaches _observe
        self._sink = None
        self.sink_stats: dict[str, int] = {}   # the sink's counts when the recording ended (calls recorded there,
                                               # calls it passed to _observe, records)

    @property
    def _quiet(self) -> bool:
        return getattr(self._local, "quiet", False)

    @_quiet.setter
    def _quiet(self, value: bool) -> None:
        self._local.quiet = value

    def __deepcopy__(self, memo):
        """A recorder is not copied with what holds it: a model deep-copied while recorded (a CUDA-graph
        step's warm-up copy) keeps its module wrappers (or the hooks), reporting to this recorder."""
        return self

    # -- control
    def step(self) -> None:
        """Start the next step (the first call starts step 0; ops before it count as step 0, their indices
        continued by the step's)."""
        self._flush()
        self.step_no += 1
        if self.step_no > 0:
            self.index = 0
        self._phase = "forward"
        if self._sink is not None:
            self._sink.sink_code(3, 0, _PHASE["forward"], 0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {name!r}")
        self._take_sink()   # the sink's records so far are of the phase before
        before, self._phase = self._phase, name
        if self._sink is not None:
            self._sink.sink_code(3, 0, _PHASE[name], 0)
        try:
            yield
        finally:
            try:
                self._take_sink()
            finally:
                self._phase = before
                if self._sink is not None:
                    self._sink.sink_code(3, 0, _PHASE[before], 0)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside are not recorded, on any thread (autograd runs a CUDA backward pass on a thread of
        its own): a CUDA-graph step's warm-up and input copies. ``snapshot`` and ``replayed`` still record."""
        self._take_sink()
        before = self._paused
        self._sink_active(False)   # (before the flag: another thread's call meanwhile goes to _observe)
        self._paused = True
        try:
            yield
        finally:
            self._paused = before
            self._sink_refresh()

    def capturing(self, stream: torch.cuda.Stream | None):
        """For a CUDA-graph capture on ``stream`` (``nnrand.train.GraphStep(capture=rec.capturing)``), called
        before the capture begins: a context to enter inside it, around the captured ops (not torch's own
        before and after them). The records of the ops inside go to the ``_Captured`` it yields, their
        fingerprint launches into the graph, and ``replayed`` adds them to the current step after each
        replay. Recorded even where ``paused`` (the warm-up before the capture). Fingerprints of ops on the
        capturing stream wait and go out in batches as outside a capture (the waiting batch launches into the
        graph when the context exits); those of other streams launch at once. Full tensors (``keep``) cannot
        be taken inside a capture."""
        if self.keep:
            raise TraceError("nnrand.trace: full tensors (keep) cannot be taken from a captured CUDA graph; "
                             "record the steps eagerly to keep them")
        with self._lock:
            quiet, self._quiet = self._quiet, True   # (the scratch made below is no record)
            try:
                self._launch_deferred()   # nothing waits into the capture, and nothing launches late out of it
                self._take_sink(launch=True)
                if stream is not None and _kernels_here():   # the capture stream's scratch and counters, made now
                    _fp_state(stream.device.index, stream.cuda_stream)
            finally:
                self._quiet = quiet
        return self._captured(stream.cuda_stream if stream is not None else -1)

    @contextlib.contextmanager
    def _captured(self, stream: int) -> Iterator[_Captured]:
        with self._lock:
            if self._capture is not None:
                raise TraceError("nnrand.trace: a capture is already being recorded; captures are recorded one "
                                 "at a time")
            self._take_sink()   # (the records before the capture are the step's, and none go to the sink in it)
            self._sink_active(False)
            cap = _Captured(stream=stream)
            saved = (self.rows, self.pending, self.index, self.slots, self._streams, self._paused)
            self.rows, self.pending, self.index, self.slots, self._streams = cap.rows, cap.pending, 0, cap.slots, set()
            self._capture, self._paused = cap, False
        try:
            yield cap
            self._launch_deferred()   # into the graph: the capture has not ended yet
        finally:
            with self._lock:
                self._deferred = None   # (a capture that failed: its waiting batch goes with it)
                cap.ops = self.index
                self.rows, self.pending, self.index, self.slots, self._streams, self._paused = saved
                self._capture = None
                self._sink_refresh()

    def replayed(self, cap: _Captured) -> None:
        """Add a captured graph's records to the current step, after its replay was enqueued: their rows, and
        their values copied from the capture's slots on the current stream (the replay's). Records even
        where ``paused``."""
        with self._lock:
            self._take_sink()
            self._quiet = True
            try:
                first = {}
                for index, src in cap.slots.items():
                    dst = self.slots.get(index) or self.slots.setdefault(index, _Slots(src.dev))
                    first[index] = dst.append(src)
                    if index >= 0:   # the step's read-back waits for the copies
                        self._streams.add((index, _stream(index)))
                pending = [(v[0], first[v[0]] + v[1]) if isinstance(v, tuple) else v.clone() for v in cap.pending]
            finally:
                self._quiet = False
            # rows, values and indices added together, once nothing can fail (rows and values stay aligned)
            step, at = (self.step_no if self.step_no > 0 else 0), self.index
            self.rows += [(step, ph, at + i, op, m, k, sh, dt) for _, ph, i, op, m, k, sh, dt in cap.rows]
            self.pending += pending
            self.index = at + cap.ops

    # -- module paths
    def _module_name(self, m: torch.nn.Module) -> str:
        return self.names.get(id(m), type(m).__name__)

    def _pre(self, m, args):
        self.stack.append(self._module_name(m) if not self.stack or id(m) in self.names else
                          f"{self.stack[-1]}.{type(m).__name__}")
        if self._sink is not None:
            self._sink.sink_stack(self._sink_name(self.stack[-1]))

    def _post(self, m, args, out):
        path = self.stack.pop() if self.stack else self._module_name(m)
        _tag(out, path, args)
        if self._sink is not None:
            self._sink.sink_stack(self._sink_name(self.stack[-1]) if self.stack else -1)
            code = self._sink_name(path)
            for t in out if isinstance(out, (tuple, list)) else (out,):   # as _tag: the nodes of returned tensors
                if isinstance(t, torch.Tensor) and not any(t is a for a in args):
                    self._sink.sink_tag(t, code)

    def __enter__(self):
        from nnrand import routing

        if self._entered:
            raise RuntimeError("nnrand.trace: this Recorder is already recording; a Recorder is entered once")
        self._entered = True
        try:
            self._name_modules()
            if self.ops == "routed":  # only the routed ops, from the routing's own overrides: no dispatch mode
                self._observing = routing.observe(self._observe)
                self._observing.__enter__()
                try:
                    self._start_sink(routing.sink())
                except BaseException:
                    if self._sink is not None:
                        sink, self._sink = self._sink, None
                        sink.sink_stop()
                    self._observing.__exit__(*sys.exc_info())
                    raise
                return self
            _dynamo_skips_dispatch()
            return super().__enter__()
        except BaseException:
            self._remove_hooks()
            raise

    def __exit__(self, *exc):
        try:
            self._remove_hooks()
            self._owners, self._owned = {}, []
            if exc[0] is not None:   # the error on its way out stays the error: no version check now
                self._unchecked = True
            self._flush()
        finally:   # the dispatch mode (or the observer) goes whatever the flush did
            if self.ops == "routed":
                if self._sink is not None:
                    sink, self._sink = self._sink, None
                    self.sink_stats = sink.sink_stats()
                    sink.sink_stop()
                self._observing.__exit__(*exc)
            else:
                super().__exit__(*exc)
        return False

    def _name_modules(self) -> None:
        """Start naming modules (see the module docstring): ops="all" wraps the model's forwards; ops="routed"
        hooks the model's parameterless leaves; global module hooks without a model, or where the model
        holds a module the wrappers cannot serve (_UNWRAPPABLE)."""
        from torch.nn.modules import module as mm

        named = list(self.model.named_modules()) if self.model is not None else None
        if named is not None and self.ops == "routed":
            # global module hooks put every module call of the model on torch's slow path; the routed ops
            # find their module by the parameters they take (a conv's or BatchNorm's weight), and only
            # the model's parameterless leaf modules (a pool, say) are hooked, for the rest
            owners = {id(p): name for name, m in named for p in m.parameters(recurse=False)}
            self._owners, self._owned = owners, list(self.model.parameters())   # (ids of live objects only)
            for name, m in named:
                if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is None and \
                        type(m) not in _UNROUTED_MODULES:
                    self._hooks += [m.register_forward_pre_hook(self._pre),
                                    m.register_forward_hook(self._post, always_call=True)]
        elif named is not None and not any(isinstance(m, _UNWRAPPABLE) for _, m in named):
            self._naming.on = True
            for name, m in named:
                self._hooks.append(_Named.install(self._naming, m, name))
        else:   # always_call: a forward that raises still pops its module off the stack
            self._hooks = [mm.register_module_forward_pre_hook(self._pre),
                           mm.register_module_forward_hook(self._post, always_call=True)]

    def _remove_hooks(self) -> None:
        self._naming.on = False   # (wrappers on copies of the model pass straight through from now on)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _observe(self, op: str, out, args: tuple = ()) -> None:
        if self._sink is not None:
            self._observed_by_python(out)
        if self._paused:
            return
        node = torch._C._current_autograd_node()
        if node is None:
            module = self.stack[-1] if self.stack else self._owner(args, None)
            self._add_outputs(out, op, module, self._phase)
            return
        module = node.metadata.get("nnrand_module") or self._owner(args, node)
        task = torch._C._current_graph_task_id() if self._defer_backward else -1
        # an in-place or out= op (scatter_add_ in gather's backward, say) gets its version bumped by autograd
        # after this kernel returns: recorded at once, not watched
        if task < 0 or op.endswith("_") or _aliases_an_arg(out, args):
            self._add_outputs(out, op, module, "backward", False)
            return
        with self._lock:
            if task not in self._tasks:   # the pass's first record: its end launches what waits
                torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._pass_ended, task))
                self._tasks.add(task)
        # a routed kernel runs below autograd's view-tracking key, where detach() would not share the version
        # counter that in-place ops bump: that key is let through while the watched aliases are made
        lifted = torch._C._dispatch_tls_is_dispatch_key_excluded(_VIEW_KEY)
        if lifted:
            torch._C._dispatch_tls_set_dispatch_key_excluded(_VIEW_KEY, False)
        try:
            self._add_outputs(out, op, module, "backward", True)
        finally:
            if lifted:
                torch._C._dispatch_tls_set_dispatch_key_excluded(_VIEW_KEY, True)

    # -- the replay layer's trace sink (ops="routed" with a model)
    def _start_sink(self, module) -> None:
        """Let the replay extension's sink record the calls the C++ layer replays (``module``: the extension
        while this recorder is the routing's only observer, else None): their outputs recorded in C++ as
        ``_observe`` records them, the records taken in call order whenever this recorder records or reads
        (``_take_sink``). Only with a model (the modules are then named by the parameters the ops take and
        by the hooked parameterless leaves, which the sink is told of), without full tensors (``keep``),
        and where the fingerprint kernel runs."""
        if module is None or self.model is None or self.keep or not _kernels_here():
            return
        self._sink_names: dict[str, int] = {}   # module paths -> the sink's numbers of them
        self._sink_paths: list[str] = []         # ... and back
        self._sink_snap: dict[str, int] = {}     # a snapshot's op -> its number in the sink
        self._sink_snap_ops: list[str] = []      # ... and back
        self._sink_shapes: list[int] = []   # the sink's shape numbers -> the shapes table's codes
        self._sink_dtypes = {module.sink_dtype(torch.empty(0, dtype=d)): d for d in FP_KINDS}
        self._sink_codes: dict[int, tuple[int, int]] = {}   # (op, module) packed -> their codes
        self._sink_dtype_codes: dict[int, int] = {}
        self._sink_blocks: list[tuple[int, int]] = []   # (first sink row, its row here) per take this step
        self._sink_fps: set[tuple[int, int]] = set()
        owners = [(p, self._sink_name(self._owners[id(p)])) for p in self._owned if id(p) in self._owners]
        self._sink_ops = module.sink_start(self._sink_pass_ended, self._sink_name(""), owners, self._defer_backward)
        self._sink = module
        for i, phase in enumerate((self._phase, "backward", "other")):
            module.sink_code(3, i, _PHASE[phase], 0)
        for p in self._owned:
            if p.is_cuda:
                self._sink_fp(p.get_device())
                break

    def _sink_snapshot(self, named: list, op: str) -> bool:
        """``snapshot`` in the sink (its records in order with the calls it records); False: not taken."""
        num = self._sink_snap.get(op)
        if num is None:
            num = self._sink_snap[op] = len(self._sink_snap_ops)
            self._sink_snap_ops.append(op)
        name = self._sink_name
        return self._sink.sink_snapshot([t for _, t in named], num, [name(n) for n, _ in named])

    def _sink_name(self, path: str) -> int:
        code = self._sink_names.get(path)
        if code is None:
            code = self._sink_names[path] = len(self._sink_paths)
            self._sink_paths.append(path)
        return code

    def _sink_fp(self, index: int) -> None:
        """Give the sink the fingerprint buffers of torch's current stream on device ``index``."""
        stream = _stream(index)
        if (index, stream) not in self._sink_fps:
            st = _fp_state(index, stream)
            self._sink.sink_fp(index, stream, int(st.batch.ptr), list(st.parts[:5]))
            self._sink_fps.add((index, stream))

    def _sink_active(self, on: bool) -> None:
        if self._sink is not None:
            self._sink.sink_active(on)

    def _sink_refresh(self) -> None:
        """The sink takes calls unless the recorder is paused or recording a capture (a second observer turns
        it off for good: ``routing.observe``)."""
        self._sink_active(not self._paused and self._capture is None)

    def _observed_by_python(self, out) -> None:
        """A routed call reached ``_observe``: the sink's records go first; a CUDA output on a stream the sink
        has no buffers for gets them (the sink takes the next such call)."""
        self._take_sink()
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                self._sink_fp(t.get_device())
                break

    def _take_sink(self, launch: bool = False, values: bool = False, raises: bool = True) -> str | None:
        """Add the sink's records since the last take (each of its calls an op index, in call order; a call
        outside a backward pass in the current phase). ``launch``: its waiting fingerprints go out first;
        ``values``: its slot rows come too (the step's end). A record written before its launch fails the
        recording (``raises=False``: its message is returned, the state kept whole for a read-back first)."""
        sink = self._sink
        if sink is None:
            return None
        with self._lock:
            first_call, calls, first_row, raw, shapes, launched, failed, vals, coded, dev, slots = sink.sink_take(
                launch, values, not self._unchecked, self.step_no if self.step_no > 0 else 0, self.index)
            for sh in shapes:
                code = self._code_shape(torch.Size(sh))
                sink.sink_code(1, len(self._sink_shapes), code, 0)
                self._sink_shapes.append(code)
            if coded is not None:   # every code known: the rows as they are kept, made in C++
                self._sink_blocks.append((first_row, len(self.rows)))
                self.rows += map(tuple, np.frombuffer(coded, np.int64).reshape(-1, 8).tolist())
                if dev >= 0:
                    self.pending += zip(itertools.repeat(("sink", dev)), np.frombuffer(slots, np.int64).tolist())
                else:
                    self._sink_pending(np.frombuffer(raw, np.int64).reshape(-1, 9))
            elif raw:
                self._sink_rows(np.frombuffer(raw, np.int64).reshape(-1, 9), self.index - first_call, first_row)
            self.index += calls
            for index, stream in launched:
                self._streams.add((index, stream))
                if launch:
                    _wait_for(index, stream)
            for index, chunks in vals.items():
                self.slots[("sink", index)] = _TakenSlots(chunks)
            message = None
            if failed and not self._unchecked:
                message = self._written_early(self._sink_row(min(failed)))
            if values:
                self._sink_blocks = []
            if message is not None and raises:
                raise TraceError(message)
            return message

    def _sink_rows(self, a: np.ndarray, base: int, first_row: int) -> None:
        """Append the sink's records ``a`` (rows of call, op, module, phase, output, shape, dtype, device, slot;
        a call's index ``base`` + its number) to the rows one by one, coding new ops, modules and dtypes as
        the Python path codes them (a record's op, then its module, then its dtype), and giving the sink
        those codes (its later takes come coded)."""
        step = self.step_no if self.step_no > 0 else 0
        phases = (_PHASE[self._phase], _PHASE["backward"], _PHASE["other"])
        codes, shapes, dtypes, sink = self._sink_codes, self._sink_shapes, self._sink_dtype_codes, self._sink
        rows = []
        for call, op, mod, ph, k, shape, dtype, dev, slot in a.tolist():
            key = op * (1 << 32) + mod
            c = codes.get(key)
            if c is None:
                c = codes[key] = (self._code("ops", self._sink_op(op)), self._code("modules", self._sink_paths[mod]))
                if sink is not None:
                    sink.sink_code(0, key, *c)
            dt = dtypes.get(dtype)
            if dt is None:
                dt = dtypes[dtype] = self._code_dtype(self._sink_dtypes[dtype])
                if sink is not None:
                    sink.sink_code(2, dtype, dt, 0)
            rows.append((step, phases[ph], base + call, c[0], c[1], k, shapes[shape], dt))
        self._sink_blocks.append((first_row, len(self.rows)))
        self.rows += rows
        self._sink_pending(a)

    def _sink_pending(self, a: np.ndarray) -> None:
        """The pending values of the sink's records ``a``: (device, slot row) of each."""
        self.pending += [(("sink", d), slot) for d, slot in a[:, 7:9].tolist()]

    def _sink_op(self, op: int) -> str:
        """The op a sink record names: the layer's op ``op``, or a snapshot's (-1 - its number)."""
        return self._sink_ops[op] if op >= 0 else self._sink_snap_ops[-1 - op]

    def _sink_row(self, seq: int) -> int:
        """The row here of the sink's row ``seq``."""
        first, row = max((b for b in self._sink_blocks if b[0] <= seq), default=(seq, 0))
        return row + seq - first

    def _sink_pass_ended(self, task: int) -> None:
        self._take_sink(launch=True)

    def _owner(self, args: tuple, node) -> str:
        """ops="routed" with a model: the module of a parameter that an op takes, or whose gradient its
        autograd node accumulates (directly or through an autocast copy), or, for a forward op, that it takes
        through an autocast copy; "" if none. A parameter shared by modules counts as the last one's."""
        owners = self._owners
        if not owners:
            return ""
        for a in args:
            name = owners.get(id(a))
            if name is not None:
                return name
        if node is not None:
            nexts = list(node.next_functions)
        else:   # a forward op: its tensor arguments' nodes (an autocast copy of a weight, say)
            nexts = [(a.grad_fn, 0) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
        for fn, _ in nexts:
            if fn is not None and fn.name().startswith("ToCopyBackward"):
                nexts += fn.next_functions
        for fn, _ in nexts:
            name = owners.get(id(getattr(fn, "variable", None)))
            if name is not None:
                return name
        return ""

    def _pass_ended(self, task: int) -> None:
        with self._lock:
            self._tasks.discard(task)
            self._launch_deferred()

    def snapshot(self, named: Iterable[tuple[str, torch.Tensor]], op: str = "parameter") -> None:
        """One record per named tensor (phase "other", aten op field ``op``, module field the name): the
        weights at the end of a step, say, which in-place optimizer updates do not show as op outputs. The
        tensors are fingerprinted together once ``named`` is exhausted: each must still hold the value it
        had when yielded (``named_parameters()`` yields distinct tensors). Walking a model's modules costs
        more than recording its parameters: pass ``list(model.named_parameters())`` made once."""
        with self._lock:
            if self._sink is not None:   # the sink's records first; then the snapshot is the sink's if it can
                self._take_sink()
                items = named if isinstance(named, list) else list(named)
                if self._sink_snapshot(items, op):
                    return
                named = items if isinstance(named, list) else iter(items)
            if isinstance(named, list) and self._snapshot_planned(named, op):
                return
            self._quiet = True  # the ops computing the fingerprints are not records themselves
            batch: list = []
            try:
                for name, t in named:   # read only: no detach (one dispatched op less)
                    self._add(t, self._code("ops", op), self._code("modules", name), _PHASE["other"], 0, batch,
                              self._defer)
                    self.index += 1
            finally:
                try:
                    _launch(batch)   # the rows reserved so far are written even if a later record failed
                finally:
                    self._quiet = False

    def _snapshot_planned(self, named: list, op: str) -> bool:
        """``snapshot`` of the list it was given last time, names the same and tensors the same objects at the
        same addresses, shapes and dtypes: its records' codes, kept from then, and one launch of the
        fingerprint kernel per FP_BATCH tensors (non-contiguous tensors copied first); into the rows of its
        last launch, that launch's bytes again (``_SnapshotPlan``). False
        (nothing recorded) where the tensors are not all CUDA tensors of one device that the kernel takes,
        or the stream is capturing, or full tensors are kept."""
        if self.keep:
            return False
        key = [(name, id(t), t.data_ptr(), t.shape, t.dtype, t.is_contiguous()) for name, t in named]
        plan = self._plans.get(op)
        if plan is None or plan.named is not named or plan.key != key:
            ts = [t for _, t in named]
            index = ts[0].get_device() if ts else -1
            if not ts or not all(_fused(t) and t.get_device() == index for t in ts):
                return False
            opc = self._code("ops", op)   # coded in the order of the record-by-record path: the same tables
            codes = [(self._code("modules", name), self._code_shape(t.shape), self._code_dtype(t.dtype))
                     for name, t in named]
            plan = self._plans[op] = _SnapshotPlan(named, key, index, ts, codes, opc,
                                                   all(k[5] for k in key))
        index, ts = plan.index, plan.ts
        if _capturing(index):
            return False
        self._quiet = True   # (a new chunk of slots is an op too)
        try:
            slots = self.slots.get(index) or self.slots.setdefault(index, _Slots(ts[0].device))
            first, step, at = slots.used, (self.step_no if self.step_no > 0 else 0), self.index
            outs = [slots.next_ptr() for _ in ts]
            if outs != plan.outs or not plan.contiguous:   # rows elsewhere than last time, or the first time
                plan.outs, plan.structs = outs, _launch_fingerprints(ts, outs)
            else:   # the same tensors into the same rows as last time: the same launches
                if plan.structs is None:   # (one tensor, launched by fingerprint the first time)
                    plan.structs = _fp_batches(ts, outs)
                _launch_structs(_fp_state(index), plan.structs)
        finally:
            self._quiet = False
        if index >= 0:
            self._streams.add((index, _stream(index)))
        other, opc = _PHASE["other"], plan.opc
        self.rows += [(step, other, at + j, opc, m, 0, sh, dt) for j, (m, sh, dt) in enumerate(plan.codes)]
        self.pending += [(index, first + j) for j in range(len(ts))]
        self.index += len(ts)
        return True

    def _code_shape(self, shape: torch.Size) -> int:
        code = self._shapes.get(shape)
        if code is None:
            code = self._shapes[shape] = self._code("shapes", "x".join(map(str, shape)))
        return code

    def _code_dtype(self, dtype: torch.dtype) -> int:
        code = self._dtypes.get(dtype)
        if code is None:
            code = self._dtypes[dtype] = self._code("dtypes", str(dtype).replace("torch.", ""))
        return code

    # -- the records
    def _add_outputs(self, out, op: str, module: str, phase: str, defer: bool | None = None) -> None:
        """The records of one op's outputs (tensors, or a tuple/list of them; others skipped), their
        fingerprints deferred (``defer``; None: as the recorder defers) or launched together."""
        if defer is None:
            defer = self._defer
        batch: list = []
        codes = None   # coded at the first record: an op without tensor outputs adds no table entries
        with self._lock:
            try:
                for k, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                    if _recordable(t):
                        if codes is None:
                            codes = self._codes.get((op, module))
                            if codes is None:
                                codes = self._codes[op, module] = (self._code("ops", op), self._code("modules", module))
                        self._add(t, *codes, _PHASE[phase], k, batch, defer)
            finally:
                _launch(batch)   # the rows reserved so far are written even if a later record failed
            self.index += 1

    def _add(self, t: torch.Tensor, op: int, module: int, phase: int, k: int, batch: list,
             defer: bool = False) -> None:
        """Record ``t`` (codes of its op and module, phase index). Its fingerprint is computed now, added to
        ``batch`` ([device index, tensors, slot addresses], see ``_launch``), or deferred (``defer``, see
        ``_Deferred``).
        The hot path of a recording: one pass, no helper calls for a deferred CUDA record."""
        step = self.step_no if self.step_no > 0 else 0
        shape = self._shapes.get(t.shape)
        if shape is None:
            shape = self._code_shape(t.shape)
        dt = t.dtype
        dtype = self._dtypes.get(dt)
        if dtype is None:
            dtype = self._code_dtype(dt)
        kept = None
        if self.keep and (step, PHASES[phase], self.index) in self.keep:
            kept = kept_array(t)
        # the row is added once its value is certain: a record that fails adds nothing (rows and values
        # stay aligned for an op whose error the caller catches)
        watch = None
        if _fused(t):
            index = t.get_device()
            slots = self.slots.get(index) or self.slots.setdefault(index, _Slots(t.device))
            cap = self._capture   # in a recorded capture, only its own stream's fingerprints wait (see capturing)
            if defer and (not _capturing(index) if cap is None else cap.stream == _stream(index)):
                if not t.is_contiguous():   # the fingerprint reads the elements in logical (row-major) order
                    t = t.contiguous()      # (a private copy: nothing else writes it)
                elif self._defer_backward:   # a detached alias: the version counter, not the tensor
                    watch = (t.detach(), t._version, len(self.rows))
                n = t.numel()
                blocks = -(-n // _FP_WORDS_PER_BLOCK)   # fp_blocks(n), inline
                blocks = 1 if blocks < 1 else blocks if blocks < FP_MAX_BLOCKS else FP_MAX_BLOCKS
                stream = _stream(index)
                d = self._deferred
                if d is None or d.stream != stream or d.index != index or len(d.held) == FP_BATCH or \
                        d.blocks + blocks > FP_SCRATCH_BLOCKS or d.nbytes > HELD_BYTES:
                    self._launch_deferred()
                    d = self._deferred = _Deferred(index, stream)
                st = t.untyped_storage()
                d.desc += (t.data_ptr(), n, (-(-n // blocks) + 3) & -4, slots.next_ptr(),   # fp_chunk
                           d.blocks | blocks << 32 | FP_KINDS[dt] << 48)   # _packed(first, blocks, kind)
                d.held.append(st)
                d.bases.add(st.data_ptr())
                d.blocks += blocks
                d.nbytes += st.nbytes()
                if watch is not None:
                    d.watched.append(watch)
                    watch = None
            else:
                if batch and batch[0] != index:   # one device per launch
                    _launch(batch)
                if not batch:
                    batch += (index, [], [])
                    if index >= 0:
                        self._streams.add((index, _stream(index)))
                batch[1].append(t)
                batch[2].append(slots.next_ptr())
            self.pending.append((index, slots.used - 1))
        else:
            self.pending.append(record_values(t))
        self.rows.append((step, phase, self.index, op, module, k, shape, dtype))
        if kept is not None:
            self.tensors[len(self.rows) - 1] = kept

    def _code(self, table: str, value: str) -> int:
        t = self.tables[table]
        return t.setdefault(value, len(t))

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """torch wraps a mode's ``__torch_dispatch__`` in a per-call dynamo-disabling wrapper (so that a
        compiled function running under the mode does not compile the mode's code); this one keeps dynamo
        off itself, cheaper on every op (see ``_dynamo_skips_dispatch``)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # dynamo skips this frame (skip_code) and, with no frame-evaluation callback from here on, every
        # frame it calls; the caller's callback is put back on the way out
        prior = _set_eval_frame(None)
        try:
            d = self._deferred
            if d is not None:
                w = _WRITES.get(func)
                if w is None:
                    w = _writes(func)
                if w and _writes_any(d.bases, w, args, kwargs):   # it would write what a waiting launch reads
                    self._launch_deferred()
            out = func(*args, **(kwargs or {}))
            if self._paused or getattr(self._local, "quiet", False) or func._overloadpacket in _ANNOTATIONS:
                return out
            node = torch._C._current_autograd_node()
            if node is not None:
                phase, module = "backward", node.metadata.get("nnrand_module", "")
            else:
                phase, module = self._phase, (self.stack[-1] if self.stack else "")
            self._add_outputs(out, func._overloadpacket.__name__, module, phase)
            return out
        finally:
            _set_eval_frame(prior)

    def _launch_deferred(self) -> None:
        with self._lock:
            d, self._deferred = self._deferred, None
            if d is not None and d.held:
                quiet, self._quiet = self._quiet, True   # (the launch's own ops, if any, are no records)
                try:
                    _launch_deferred(d)
                finally:
                    self._quiet = quiet
                if d.index >= 0:
                    self._streams.add((d.index, d.stream))
                for alias, version, row in d.watched:
                    if alias._version != version and not self._unchecked:
                        raise TraceError(self._written_early(row))

    def _written_early(self, row: int) -> str:
        step, phase, index, op, module, k = self.rows[row][:6]
        return (f"nnrand.trace: output {k} of aten::{self._name('ops', op)} (step {step}, {PHASES[phase]} index "
                f"{index}, module {self._name('modules', module) or '?'}) was written in place before the "
                "backward pass ended (a gradient hook or a gradient copy?), so its recorded fingerprint would "
                "not be the op's; record with defer=False (one launch per op)")

    def _name(self, table: str, code: int) -> str:
        return next(k for k, v in self.tables[table].items() if v == code)

    def _join_streams(self) -> None:
        """Make each device's current stream wait for the other streams that launched fingerprints."""
        for index, stream in self._streams:
            _wait_for(index, stream)
        self._streams.clear()

    def _flush(self) -> None:
        """Move the step's device values to the host, one transfer per device (the ops doing it are not
        recorded)."""
        with self._lock:
            self._quiet = True
            try:
                self._launch_deferred()
                # a record the sink found written early fails the recording once the step's values are read
                # back (rows and values stay aligned)
                failed = self._take_sink(launch=True, values=True, raises=False)
                self._join_streams()
                if not self.pending:
                    return
                pending, self.pending = self.pending, []
                busy = [slots for slots in self.slots.values() if slots.used]
                if len(busy) == 1 and busy[0].used == len(pending):
                    vals = busy[0].take()   # every record of the step a row of one device's slots, in order
                else:
                    vals = self._gather(pending)
                for key in [k for k in self.slots if isinstance(k, tuple)]:   # the sink's rows, read back
                    del self.slots[key]
            finally:
                self._quiet = False
            self.values.append((vals[:, 0].view(np.int64).copy(), vals[:, 1].copy(), vals[:, 2].copy()))
            if failed is not None:
                raise TraceError(failed)

    def _gather(self, pending: list) -> np.ndarray:
        """The values of records of several devices, or some of them tensors (see ``pending``)."""
        vals = np.zeros((len(pending), 3))
        tensors: dict[torch.device, list[int]] = {}
        slotted: dict[int, tuple[list[int], list[int]]] = {}
        for i, v in enumerate(pending):  # records of CPU tensors may sit between those of GPU tensors
            if isinstance(v, tuple):
                at = slotted.setdefault(v[0], ([], []))
                at[0].append(i)
                at[1].append(v[1])
            else:
                tensors.setdefault(v.device, []).append(i)
        for index, (recs, rows) in slotted.items():
            vals[recs] = self.slots[index].take()[rows]
        for idx in tensors.values():
            vals[idx] = torch.stack([pending[i] for i in idx]).cpu().numpy()
        return vals

    # -- output
    def arrays(self) -> dict[str, np.ndarray]:
        self._flush()
        rows = np.array(self.rows, dtype=np.int64).reshape(-1, 8)
        fp = np.concatenate([v[0] for v in self.values]) if self.values else np.zeros(0, np.int64)
        l2 = np.concatenate([v[1] for v in self.values]) if self.values else np.zeros(0)
        mx = np.concatenate([v[2] for v in self.values]) if self.values else np.zeros(0)
        header = {"format": FORMAT, "version": VERSION, "meta": self.meta, "records": len(self.rows),
                  **{k: list(v) for k, v in self.tables.items()}}
        out = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
               "step": rows[:, 0].astype(np.int32), "phase": rows[:, 1].astype(np.uint8),
               "index": rows[:, 2].astype(np.int32), "op": rows[:, 3].astype(np.int32),
               "module": rows[:, 4].astype(np.int32), "output": rows[:, 5].astype(np.int16),
               "shape": rows[:, 6].astype(np.int32), "dtype": rows[:, 7].astype(np.int16),
               "fp": fp, "l2": l2, "maxabs": mx}
        out.update({f"tensor_{i}": a for i, a in self.tensors.items()})
        return out

    def save(self, path: str | Path) -> Path:
        from nnrand import runio

        buf = io.BytesIO()
        np.savez_compressed(buf, **self.arrays())
        runio.write_bytes(path, buf.getvalue())
        return Path(path)


@contextlib.contextmanager
def record(path: str | Path | None, *, ops: str = "all", model: torch.nn.Module | None = None,
           keep: set[tuple[int, str, int]] | None = None, meta: dict | None = None,
           defer: bool = True) -> Iterator[Recorder]:
    """Record while the context is open; write ``path`` (atomically) on a normal exit. ``defer``: see the
    module docstring (ops="all": batches launched before writes; ops="routed": a backward pass's launches
    at its end)."""
    rec = Recorder(ops=ops, model=model, keep=keep, meta=meta, defer=defer)
    with rec:
        yield rec
    if path is not None:
        rec.save(path)


# --------------------------------------------------------------------------------------------------
# Reading and comparing


@dataclass
class Trace:
    header: dict
    cols: dict[str, np.ndarray]
    tensors: dict[int, np.ndarray]
    path: str = ""

    def __len__(self) -> int:
        return len(self.cols["fp"])

    def label(self, i: int) -> dict:
        c, h = self.cols, self.header
        return {"record": i, "step": int(c["step"][i]), "phase": PHASES[c["phase"][i]], "index": int(c["index"][i]),
                "op": h["ops"][c["op"][i]], "module": h["modules"][c["module"][i]], "output": int(c["output"][i]),
                "shape": h["shapes"][c["shape"][i]], "dtype": h["dtypes"][c["dtype"][i]]}

    def keys(self) -> list[tuple]:
        """What must match for two records to be comparable: position, op, output, shape, dtype."""
        c, h = self.cols, self.header
        return list(zip(c["step"].tolist(), c["phase"].tolist(), c["index"].tolist(),
                        [h["ops"][i] for i in c["op"]], c["output"].tolist(),
                        [h["shapes"][i] for i in c["shape"]], [h["dtypes"][i] for i in c["dtype"]]))


def load(path: str | Path) -> Trace:
    path = Path(path)
    try:
        with contextlib.ExitStack() as stack:
            z = np.load(path, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):   # a plain .npy array
                raise TraceFormatError(f"{path}: not an nnrand trace (a NumPy array file, not an archive)")
            stack.enter_context(z)
            if "header" not in z.files:
                raise TraceFormatError(f"{path}: not an nnrand trace (no header)")
            header = json.loads(bytes(z["header"]).decode())
            if not isinstance(header, dict):
                raise TraceFormatError(f"{path}: not an nnrand trace (its header is not a JSON object)")
            if header.get("format") != FORMAT:
                raise TraceFormatError(f"{path}: not an nnrand trace (format {header.get('format')!r})")
            if header.get("version") not in READABLE_VERSIONS:
                raise TraceFormatError(f"{path}: trace version {header.get('version')} is not readable by this "
                                       f"version of nnrand (reads {', '.join(map(str, READABLE_VERSIONS))})")
            cols = {k: z[k] for k in COLUMNS}
            tensors = {int(k.split("_", 1)[1]): z[k] for k in z.files if k.startswith("tensor_")}
    except TraceFormatError:
        raise
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, KeyError, ValueError, OSError, TypeError,
            json.JSONDecodeError) as e:
        raise TraceFormatError(f"{path}: not a complete nnrand trace ({type(e).__name__}: {e}); truncated or "
                               "not written by nnrand.trace") from None
    n = len(cols["fp"])
    if any(len(v) != n for v in cols.values()) or header.get("records") != n:
        raise TraceFormatError(f"{path}: columns of different lengths: the file is damaged")
    for col, size in (("op", _table_len(header, "ops")), ("module", _table_len(header, "modules")),
                      ("shape", _table_len(header, "shapes")), ("dtype", _table_len(header, "dtypes")),
                      ("phase", len(PHASES))):
        if size is None:
            raise TraceFormatError(f"{path}: the header has no {col} table: the file is damaged")
        if n and (int(cols[col].min()) < 0 or int(cols[col].max()) >= size):
            raise TraceFormatError(f"{path}: {col} codes outside their table ({size} entries): the file is damaged")
    return Trace(header, cols, tensors, str(path))


def _table_len(header: dict, name: str) -> int | None:
    t = header.get(name)
    return len(t) if isinstance(t, list) else None


_ULP_INT = {"float16": np.int16, "bfloat16": np.int16, "float32": np.int32, "float64": np.int64}


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str = "float32") -> int:
    """Largest distance in units in the last place between two arrays of floating dtype ``dtype``
    (float16, bfloat16 as kept: its int16 bit patterns, float32, float64), over ordered bit patterns:
    -0.0 and +0.0 are 0 apart, the smallest subnormals of either sign 2."""
    if dtype not in _ULP_INT:
        raise ValueError(f"ulp_distance: dtype must be one of {', '.join(_ULP_INT)}, got {dtype!r}")
    it = _ULP_INT[dtype]
    bits = np.iinfo(it).bits

    def ordered(x):   # the bit patterns as unsigned keys in the order of the values: 2^63 -+ magnitude
        x = np.ascontiguousarray(x)
        i = (x if dtype == "bfloat16" else x.astype(dtype, copy=False)).view(it).astype(np.int64)
        magnitude = (i & ((1 << (bits - 1)) - 1)).astype(np.uint64)
        middle = np.uint64(1 << 63)
        return np.where(i < 0, middle - magnitude, middle + magnitude)
    if not a.size:
        return 0
    ka, kb = ordered(a), ordered(b)
    return int(np.max(np.where(ka > kb, ka - kb, kb - ka)))


def diff(a: Trace, b: Trace) -> dict:
    """Compare two traces record by record. Returns ``{"status": "identical" | "diverge" | "different
    ops", ...}`` with the first divergent record and the per-step spread. Traces of two format versions
    are refused (TraceFormatError): their fingerprints or op indices are defined differently."""
    va, vb = a.header.get("version"), b.header.get("version")
    if va != vb:
        raise TraceFormatError(f"{a.path} is a version {va} trace and {b.path} version {vb}: their fingerprints "
                               "or op indices are defined differently; record both with one nnrand version")
    ka, kb = a.keys(), b.keys()
    n = min(len(ka), len(kb))
    mismatch = next((i for i in range(n) if ka[i] != kb[i]), None)
    if mismatch is None and len(ka) != len(kb):
        mismatch = n
    if mismatch is not None:
        return {"status": "different ops", "record": mismatch,
                "a": a.label(mismatch) if mismatch < len(a) else None,
                "b": b.label(mismatch) if mismatch < len(b) else None}
    differ = a.cols["fp"] != b.cols["fp"]
    if not differ.any():
        return {"status": "identical", "records": len(a)}
    first = int(np.argmax(differ))
    out = {"status": "diverge", "records": len(a), "first": a.label(first),
           "l2": (float(a.cols["l2"][first]), float(b.cols["l2"][first])),
           "maxabs": (float(a.cols["maxabs"][first]), float(b.cols["maxabs"][first]))}
    if first in a.tensors and first in b.tensors:
        dtype = a.header["dtypes"][a.cols["dtype"][first]]
        ta, tb = a.tensors[first], b.tensors[first]
        if dtype in _ULP_INT and ta.shape == tb.shape:
            out["max_ulp"] = ulp_distance(ta, tb, dtype)
        va, vb = kept_values(ta, dtype).astype(np.float64), kept_values(tb, dtype).astype(np.float64)
        ref = float(np.linalg.norm(vb))
        out["rel_l2"] = float(np.linalg.norm(va - vb) / ref) if ref and np.isfinite(ref) else None
    steps = a.cols["step"]
    per_step = []
    for s in np.unique(steps):
        sel = steps == s
        l2a, l2b = a.cols["l2"][sel], b.cols["l2"][sel]
        with np.errstate(invalid="ignore", divide="ignore"):
            rel = np.abs(l2a - l2b) / np.maximum(np.abs(l2b), np.finfo(np.float64).tiny)
        # records with equal bytes count 0 (an Inf or NaN summary of equal outputs is no difference);
        # a relative difference that is not finite is left out (None where no record has a finite one)
        rel = rel[differ[sel] & np.isfinite(rel)]
        per_step.append({"step": int(s), "records": int(sel.sum()), "differ": int(differ[sel].sum()),
                         "max_rel_l2_summary": float(rel.max()) if rel.size else (0.0 if not differ[sel].any()
                                                                                  else None)})
    out["per_step"] = per_step
    params = np.array([a.header["ops"][i] == "parameter" for i in a.cols["op"]], dtype=bool)
    if params.any():
        for s in per_step:
            sel = params & (steps == s["step"])
            s["params_differ"] = int(differ[sel].sum())
            s["params"] = int(sel.sum())
        out["all_weights_differ_at_step"] = next((s["step"] for s in per_step if s.get("params")
                                                 and s["params_differ"] == s["params"]), None)
    out["first_by_phase"] = {p: a.label(int(np.flatnonzero(differ & (a.cols["phase"] == i))[0]))
                             for i, p in enumerate(PHASES) if (differ & (a.cols["phase"] == i)).any()}
    return out


def format_diff(d: dict) -> str:
    if d["status"] == "identical":
        return f"identical: {d['records']} records, every fingerprint equal"
    if d["status"] == "different ops":
        return (f"the op sequences differ at record {d['record']}: {d['a']} vs {d['b']}; the runs cannot be "
                "compared record by record (different models, shapes or code paths)")
    f = d["first"]
    lines = [f"first divergent record {f['record']}: step {f['step']}, {f['phase']}, op #{f['index']} "
             f"aten::{f['op']} (output {f['output']}, {f['shape']} {f['dtype']}), module {f['module'] or '-'}",
             f"  L2 {d['l2'][0]:.9g} vs {d['l2'][1]:.9g}; max|x| {d['maxabs'][0]:.9g} vs {d['maxabs'][1]:.9g}"]
    if "max_ulp" in d or "rel_l2" in d:
        lines.append(f"  saved tensors: max ULP {d.get('max_ulp')}, relative L2 {d.get('rel_l2')}")
    for p, lab in d["first_by_phase"].items():
        lines.append(f"  first in {p}: step {lab['step']} op #{lab['index']} aten::{lab['op']} ({lab['module'] or '-'})")
    if "all_weights_differ_at_step" in d:
        lines.append(f"  every weight tensor differs from step {d['all_weights_differ_at_step']} on"
                     if d["all_weights_differ_at_step"] is not None else "  not every weight tensor differs yet")
    lines.append("  per step: records differing / recorded, weight tensors differing, largest relative difference "
                 "of an L2 summary")
    for s in d["per_step"]:
        w = f"{s['params_differ']:>4} / {s['params']:<4}" if "params" in s else "-"
        rel = s["max_rel_l2_summary"]
        lines.append(f"    step {s['step']:>4}: {s['differ']:>6} / {s['records']:<6} {w} "
                     f"{'-' if rel is None else format(rel, '.3g')}")
    return "\n".join(lines)


def plot(d: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [s["step"] for s in d.get("per_step", [])]
    ax[0].plot(steps, [s["differ"] / max(1, s["records"]) for s in d.get("per_step", [])], marker="o")
    ax[0].set(xlabel="step", ylabel="fraction of records differing", ylim=(0, 1.02))
    rel = [s["max_rel_l2_summary"] for s in d.get("per_step", [])]
    ax[1].semilogy(steps, [np.nan if r is None else max(r, 1e-18) for r in rel], marker="o")
    ax[1].set(xlabel="step", ylabel="largest relative L2 summary difference")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --------------------------------------------------------------------------------------------------
# Recording a training run from the command line


def graph_step(rec: Recorder | None, model, x: torch.Tensor, y: torch.Tensor, precision=None, scaler=None):
    """``nnrand.train.GraphStep`` (forward, loss and backward captured once) with its captured ops recorded
    by ``rec`` (its warm-up not); each ``replay`` then adds them to the step. ``rec`` None: not recorded."""
    from nnrand import train

    if rec is None:
        return train.GraphStep(model, x, y, precision or train.float32_forward, scaler)
    with rec.paused():
        return train.GraphStep(model, x, y, precision or train.float32_forward, scaler, capture=rec.capturing)


def replay(rec: Recorder | None, graph, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One replay of ``graph_step``'s graph on inputs ``x``, ``y`` (copied in unrecorded), its records added to
    ``rec``'s current step; (logits, loss). The replay rewrites the graph's outputs, the gradients and the
    BatchNorm statistics behind the dispatcher: fingerprints waiting for a batch go out first."""
    if rec is None:
        return graph(x, y)
    if graph.captured is None:
        raise TraceError("nnrand.trace.replay: this graph was captured without a recorder (graph_step(None, ...)); "
                         "pass the recorder to graph_step")
    rec._launch_deferred()
    rec._take_sink(launch=True)
    with rec.paused():
        out = graph(x, y)
    rec.replayed(graph.captured)
    return out


def _check_keep(cfg, keep) -> None:
    from nnrand import train

    if keep and cfg.cuda_graph:
        raise train.ConfigError("full tensors (--keep) cannot be taken from a captured CUDA graph: record "
                                "without --cuda-graph, or pass --keep 0")


def record_training(cfg, steps: int, path: str | Path, *, ops: str = "all",
                    keep: set[tuple[int, str, int]] | None = None) -> Path:
    """``steps`` SGD steps of the harness's member 0 under ``cfg`` (a resolved ``train.Config``), recorded.
    With ``cfg.cuda_graph`` the forward and backward are captured at the first step and replayed (the
    captured ops recorded once, their records added at each replay: the trace of eager steps, for the same
    kernels)."""
    from nnrand import data, noise, routing, train

    _check_keep(cfg, keep)
    ds = train.load_data(cfg)
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    seeds = noise.member_seeds({s: getattr(cfg, f"{s}_seed") for s in noise.SOURCES}, cfg.seed, 0)
    route = routing.resolve(cfg.kernel, cfg.kernel_ops)
    n = len(ds.train_y)
    per_epoch = n // cfg.batch_size
    meta = {"config": {k: v for k, v in vars(cfg).items() if not k.startswith("_")}, "seeds": seeds.as_dict(),
            "routing": route.describe(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.device(cfg.device).type == "cuda" else "cpu"}
    with noise.pinned_flags(tf32=cfg.tf32, cudnn_deterministic=route.claims_determinism):
        model, opt = train.build(cfg, seeds, ds.num_classes, fmt)
        scaler = train.grad_scaler(cfg)   # --amp as the harness runs it: autocast forward, fp16 loss scaling
        if scaler is not None:   # its lazy start (two fills) before the recording, as a captured step has it
            scaler.scale(torch.ones((), device=cfg.device))
        if cfg.perturb_ulp:
            meta["perturb"] = noise.perturb_one_ulp(model, cfg.perturb_index)
        with routing.use_kernels(route, rng=noise.kernel_rng(seeds.kernel), strict=cfg.strict, model=model) as ctx, \
                record(path, ops=ops, model=model, meta=meta, keep=keep) as rec:
            total = per_epoch * cfg.epochs
            warmup = max(1, min(int(cfg.warmup_epochs * per_epoch), total // 2))  # as train_member
            step = 0
            named = list(model.named_parameters())   # walked once: the parameters stay the same objects
            precision = functools.partial(train.autocast, cfg)
            graph = None
            while step < steps:
                epoch = step // per_epoch
                order = data.epoch_order(n, epoch, seeds.order)
                for i in range(per_epoch):
                    if step == steps:
                        break
                    rec.step()
                    with rec.phase("other"):  # the batch: gather, augmentation, normalisation
                        x, y = train.train_batch(ds, order, i, cfg.batch_size, seeds.aug, epoch, fmt, cfg.image_size,
                                                 cfg.shuffle_channels)
                    for group in opt.param_groups:
                        group["lr"] = train.lr_at(step, total, warmup, cfg.lr)
                    if cfg.cuda_graph:
                        if graph is None:
                            graph = graph_step(rec, model, x, y, precision, scaler)
                        replay(rec, graph, x, y)
                    else:
                        train.forward_backward(model, opt, x, y, precision, scaler)
                    with rec.phase("optimizer"):
                        train.optimizer_step(opt, scaler)
                    rec.snapshot(named)
                    step += 1
            rec.meta["coverage"] = ctx.coverage.as_dict()   # which routed ops ran, and with which variant
    return Path(path)


VARY = ("none", "kernel", "init", "order", "aug", "ulp")


def lockstep_configs(cfg, vary: str):
    """Two configurations equal on every axis but ``vary``. The base is ``cfg`` with fixed seeds and its
    own kernel routing; ``kernel``: the routing's atomic ops (every op atomic if it has none) in both, with
    two arrival orders (two CPU seeds; on a GPU the hardware's); ``none``: the same configuration twice; ``init``/``order``/``aug``: that seed 1 vs 2; ``ulp``: one weight moved by one
    ULP in the second (``--perturb-index``)."""
    import dataclasses

    if vary not in VARY:
        raise ValueError(f"--vary must be one of {', '.join(VARY)}, got {vary!r}")
    base = dataclasses.replace(cfg, init_seed="fixed", order_seed="fixed", aug_seed="fixed", perturb_ulp=False)
    if vary == "none":  # the control: two runs of one configuration
        return base, base
    if vary == "kernel":
        if base.kernel != "atomic" and "atomic" not in base.kernel_ops.values():
            base = dataclasses.replace(base, kernel="atomic", kernel_ops={})  # else: the atomic ops asked for
        return dataclasses.replace(base, kernel_seed=1), dataclasses.replace(base, kernel_seed=2)
    if vary == "ulp":
        return base, dataclasses.replace(base, perturb_ulp=True)
    return (dataclasses.replace(base, **{f"{vary}_seed": 1}), dataclasses.replace(base, **{f"{vary}_seed": 2}))


def lockstep(cfg, vary: str, steps: int, out_dir: str | Path, *, ops: str = "all", keep: int = 1) -> dict:
    """Record the two replicas of ``lockstep_configs`` and compare them. With ``keep`` > 0 both are
    recorded again keeping the first ``keep`` differing records in full, for their ULP and L2 distance
    (a replica whose noise is the hardware's may part elsewhere the second time; the diff says where)."""
    out_dir = Path(out_dir)
    _check_keep(cfg, keep)
    a_cfg, b_cfg = lockstep_configs(cfg, vary)
    paths = (out_dir / "a.trace", out_dir / "b.trace")
    record_training(a_cfg, steps, paths[0], ops=ops)
    record_training(b_cfg, steps, paths[1], ops=ops)
    a, b = load(paths[0]), load(paths[1])
    d = diff(a, b)
    if keep > 0 and d["status"] == "diverge":
        differ = np.flatnonzero(a.cols["fp"] != b.cols["fp"])[:keep]
        wanted = {(int(a.cols["step"][i]), PHASES[a.cols["phase"][i]], int(a.cols["index"][i])) for i in differ}
        record_training(a_cfg, steps, paths[0], ops=ops, keep=wanted)
        record_training(b_cfg, steps, paths[1], ops=ops, keep=wanted)
        d = diff(load(paths[0]), load(paths[1]))
    d["vary"], d["traces"] = vary, [str(p) for p in paths]
    return d


COST_ROUNDS = 20  # recording_cost: rounds over the three modes (a host-bound step drifts; rounds pair it)


def recording_cost(cfg, steps: int, out_dir: str | Path, rounds: int = COST_ROUNDS) -> dict:
    """Median step time (wall clock between device synchronisations) without recording, recording the
    routed ops, and recording every op; and the trace size per step. Same training code, same steps: the
    modes take turns, ``rounds`` times ``steps`` steps each after two warm-up steps (three in the first
    round), every other round in reverse order, the garbage collected before each. A host-bound step's
    speed drifts by several percent within seconds, so the cost of a mode is also given paired: ``ratio``,
    the median over rounds of its median step in the round over the unrecorded one's in the same round.
    With ``cfg.cuda_graph`` every mode's forward and backward are captured once per round (``graph_step``,
    untimed) and replayed."""
    import time

    import torch.nn.functional as F

    from nnrand import noise, routing, train

    out_dir = Path(out_dir)
    dev = torch.device(cfg.device)
    fmt = torch.channels_last if cfg.channels_last else torch.contiguous_format
    seeds = noise.member_seeds({s: "fixed" for s in ("init", "order", "aug")} | {"kernel": cfg.kernel_seed},
                               cfg.seed, 0)
    g = torch.Generator(device=dev).manual_seed(0)
    size = cfg.image_size or 32
    x = torch.randn(cfg.batch_size, 3, size, size, device=dev, generator=g).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (cfg.batch_size,), device=dev, generator=g)
    modes = ("none", "routed", "all")
    built = {mode: train.build(cfg, seeds, 10, fmt) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    per_round: dict[str, list[float]] = {mode: [] for mode in modes}   # each round's median step
    out = {}
    named = {mode: list(model.named_parameters()) for mode, (model, _) in built.items()}   # as record_training
    for r in range(rounds):
        # a routing session's first two steps plan and record the C++ replay layer's calls (nnrand/replay.py)
        warm = 3 if r == 0 else 2
        for mode in modes if r % 2 == 0 else modes[::-1]:
            # the garbage of whatever ran before (the report's lockstep runs, the last mode's recorder, which
            # holds reference cycles) is not collected in this mode's steps
            gc.collect()
            model, opt = built[mode]
            start = len(times[mode])
            path = out_dir / f"cost_{mode}.trace"
            ctx = record(path, ops=mode, model=model) if mode != "none" else contextlib.nullcontext()
            with routing.use_kernels(cfg.kernel, cfg.kernel_ops, strict=cfg.strict), ctx as rec:
                graph = graph_step(rec, model, x, y) if cfg.cuda_graph else None
                for i in range(steps + warm):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    if rec is not None:   # moves the last step's values to the host: part of the cost
                        rec.step()
                    if graph is not None:
                        replay(rec, graph, x, y)
                    else:
                        loss = F.cross_entropy(model(x), y)
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                    opt.step()
                    if rec is not None:
                        rec.snapshot(named[mode])
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if i >= warm:
                        times[mode].append((time.perf_counter() - t) * 1e3)
            per_round[mode].append(float(np.median(times[mode][start:])))
            if r == 0 and mode != "none":   # the first round's trace: steps + 3 steps
                out[mode] = {"bytes_per_step": path.stat().st_size / (steps + warm),
                             "records_per_step": len(load(path)) / (steps + warm)}
    for mode in modes:
        out.setdefault(mode, {})["ms_per_step"] = float(np.median(times[mode]))
        out[mode]["steps_timed"] = len(times[mode])
        out[mode]["ratio"] = float(np.median(np.array(per_round[mode]) / np.array(per_round["none"])))
        out[mode]["rounds"] = rounds
    return out


def report(cfg, steps: int, out: str | Path, results: str | Path, command: str | None = None,
           ops: tuple[str, ...] | None = None, cost_rounds: int = COST_ROUNDS) -> Path:
    """The trace report: (a) atomic against itself, (b) a one-ULP change of one weight, (c) each routed op
    alone atomic, every other op tree; and what recording costs (``recording_cost`` over ``cost_rounds``
    rounds). Writes ``results`` (JSON) and ``out``."""
    import dataclasses
    import tempfile

    from nnrand import fingerprint as fp
    from nnrand import routing, runio

    cases = [("tree vs itself (control)", dataclasses.replace(cfg, kernel="tree", kernel_ops={}), "none"),
             ("atomic vs itself", dataclasses.replace(cfg, kernel="atomic", kernel_ops={}), "kernel"),
             ("one-ULP change of one weight (tree)", dataclasses.replace(cfg, kernel="tree", kernel_ops={}), "ulp")]
    cases += [(f"{op} alone atomic", dataclasses.replace(cfg, kernel="tree", kernel_ops={op: "atomic"}), "kernel")
              for op in (ops or routing.ROUTED_OPS)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, c, vary in cases:
            d = lockstep(c, vary, steps, tmp, keep=0)
            # an op set atomic alone that the model never calls cannot part the runs: say so, not "identical"
            ran = None
            if c.kernel_ops:
                coverage = load(d["traces"][0]).header["meta"].get("coverage", {})
                ran = any(n and "atomic" in where.split("+")   # conv calls name their variants "wgrad+dgrad"
                          for counts in coverage.values() for where, n in counts.items())
            rows.append({"case": name, "vary": vary, "status": d["status"] if ran is not False else "not run",
                         "first": d.get("first"), "all_weights_differ_at_step": d.get("all_weights_differ_at_step"),
                         "per_step": d.get("per_step", [])})
            print(f"{name}: {rows[-1]['status']}", flush=True)
        tree = dataclasses.replace(cfg, kernel="tree", kernel_ops={}, cuda_graph=False)
        cost = recording_cost(tree, min(steps, 10), tmp, cost_rounds)
        # the same steps replayed from a CUDA graph: what recording costs where the host is not the bottleneck
        cost_graph = (recording_cost(dataclasses.replace(tree, cuda_graph=True), min(steps, 10), tmp, cost_rounds)
                      if torch.device(cfg.device).type == "cuda" else None)
    data = {"fingerprint": fp.fingerprint(cfg.device), "steps": steps, "model": cfg.model,
            "batch_size": cfg.batch_size, "rows": rows, "cost": cost, "cost_graph": cost_graph,
            "command": command or "python -m nnrand.trace report"}
    runio.write_json(results, data)
    return render_report(data, out)


def render_report(data: dict, out: str | Path) -> Path:
    from nnrand import runio

    env = data["fingerprint"]
    lines = ["# Where two runs part: first divergent op and how the difference grows", "",
             f"Generated by `{data.get('command', 'python -m nnrand.trace report')}` ({data['model']}, batch {data['batch_size']}, "
             f"{data['steps']} steps per replica; {env.get('gpu') or 'cpu'}, torch {env.get('torch')}, "
             f"git {env.get('git_sha')}). Each case trains two replicas that differ on one axis only and "
             "records every op (`python -m nnrand.trace lockstep`).", "",
             "| case | first divergent record (step, phase, aten op, module) | every weight tensor differs from step "
             "| weight tensors differing per step |", "|---|---|---|---|"]
    for r in data["rows"]:
        f = r["first"]
        first = (f"step {f['step']}, {f['phase']}, `aten::{f['op']}`, {f['module'] or '-'}" if f else
                 f"op not called by {data['model']}" if r["status"] == "not run" else r["status"])
        growth = " ".join(f"{s.get('params_differ', '-')}/{s.get('params', '-')}" for s in r["per_step"])
        lines.append(f"| {r['case']} | {first} | {r['all_weights_differ_at_step']} | {growth} |")
    c = data["cost"]
    timed = c["none"].get("steps_timed")
    rounds = c["none"].get("rounds")
    if rounds:   # paired per round (see recording_cost)
        how = (f"the modes taking turns in {rounds} rounds of {timed // rounds} steps, every other round in reverse "
               "order, each mode's steps after two warm-up steps and a garbage collection; ms: median of each "
               "mode's steps; x: median over rounds of the mode's median step over the unrecorded one's in that "
               "round. A step is the recorder's per-step transfer, forward, backward, optimizer and parameter "
               "snapshot, synchronised")
    else:
        how = (f"median of {timed} steps per mode, the modes taking turns in 5 rounds; a step is the recorder's "
               "per-step transfer, forward, backward, optimizer and parameter snapshot, synchronised" if timed
               else "median step time")
    lines += ["", f"Recording cost (same model, tree kernels, {how}; the step is host-bound, and its speed drifts "
              "by several percent within seconds and differs between machines):", ""]
    lines += _cost_lines(c)
    g = data.get("cost_graph")
    if g:
        lines += ["", "The same steps with forward, loss and backward replayed from a CUDA graph (`--cuda-graph`: "
                  "captured once per round and mode, with the recorded ops' fingerprint launches, untimed; the "
                  "optimizer step and the snapshot eager; measured as above):", ""]
        lines += _cost_lines(g)
    cross = data.get("cross_gpu")
    if cross:
        lines += ["", "The same run on two GPUs (`python -m nnrand.trace record --kernel tree --steps 3 --n-train 1024 "
                  "--n-test 128` on each machine, then `python -m nnrand.trace diff`; traces in reports/results/):", ""]
        for c in cross:
            lines.append(f"- {c['a']} vs {c['b']}: {format_diff(c['diff']).splitlines()[0]}")
    runio.write_text(out, "\n".join(lines) + "\n")
    return Path(out)


def _cost_lines(c: dict) -> list[str]:
    base = c["none"]["ms_per_step"]
    lines = []
    for mode in ("routed", "all"):
        ratio = c[mode].get("ratio", c[mode]["ms_per_step"] / base)
        lines.append(f"- recording {mode} ops: {c[mode]['ms_per_step']:.2f} ms/step against {base:.2f} "
                     f"({ratio:.2f}x), {c[mode]['records_per_step']:.0f} records and "
                     f"{c[mode]['bytes_per_step'] / 1e3:.1f} kB per step ({c[mode]['bytes_per_step'] * 100 / 1e6:.1f} MB "
                     "per 100 steps)")
    return lines


def add_cross_gpu(results: str | Path, a: str | Path, b: str | Path, out: str | Path) -> Path:
    """Compare two traces of one run recorded on two machines, keep the comparison in the results file,
    and re-render the report from it."""
    from nnrand import runio

    data = json.loads(Path(results).read_text())
    ta, tb = load(a), load(b)
    entry = {"a": f"{Path(a).name} ({ta.header['meta'].get('device')})",
             "b": f"{Path(b).name} ({tb.header['meta'].get('device')})", "diff": diff(ta, tb)}
    data["cross_gpu"] = [c for c in data.get("cross_gpu", []) if (c["a"], c["b"]) != (entry["a"], entry["b"])]
    data["cross_gpu"].append(entry)
    runio.write_json(results, data)
    return render_report(data, out)


EPILOG = """examples:
  python -m nnrand.trace record --kernel atomic --steps 3 -o a.trace
  python -m nnrand.trace record --kernel atomic --steps 3 -o b.trace
  python -m nnrand.trace diff a.trace b.trace --plot growth.png
  python -m nnrand.trace record --kernel tree --perturb-ulp --perturb-index 10 --steps 2 -o ulp.trace
  python -m nnrand.trace record --kernel tree --cuda-graph --steps 5 -o g.trace   forward+backward replayed from a graph
  python -m nnrand.trace lockstep --vary kernel --steps 5 --out-dir lock/ --plot lock/growth.png
  python -m nnrand.trace report --steps 8 --n-train 2048      reports/trace.md (atomic, ULP, each op atomic)
record and lockstep take every option of python -m nnrand.train (model, data, seeds, --kernel, ...);
lockstep runs two replicas that differ on one axis (kernel, init, order, aug or ulp) and compares them."""


def cli(argv: list[str] | None = None) -> int:
    from nnrand import autotune, data, noise, routing, runio, train

    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="python -m nnrand.trace", description=__doc__.splitlines()[0],
                                  epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("command", choices=("record", "diff", "lockstep", "report"))
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("record", "diff", "lockstep", "report"):
        top.parse_args(argv)
        return 2
    if argv[0] == "diff":
        p = argparse.ArgumentParser(prog="python -m nnrand.trace diff", description="compare two traces")
        p.add_argument("a")
        p.add_argument("b")
        p.add_argument("--plot", help="write the per-step growth curve to this PNG")
        p.add_argument("--json", help="also write the comparison as JSON")
        args = p.parse_args(argv[1:])
        try:
            d = diff(load(args.a), load(args.b))
        except (TraceFormatError, FileNotFoundError) as e:
            p.exit(2, f"{p.prog}: error: {e}\n")
        print(format_diff(d))
        if args.plot and d["status"] == "diverge":
            print(f"plot: {plot(d, args.plot)}")
        if args.json:
            Path(args.json).write_text(json.dumps(d, indent=1) + "\n")
        return 0 if d["status"] == "identical" else 1
    p = train.parser()
    p.prog = f"python -m nnrand.trace {argv[0]}"
    p.add_argument("--steps", type=int, default=3, help="SGD steps to record (default %(default)s)")
    p.add_argument("--ops", choices=("all", "routed"), default="all", help="which ops to record")
    if argv[0] == "record":
        p.add_argument("-o", "--output", required=True, help="trace file to write")
    elif argv[0] == "report":
        p.add_argument("--md", default="reports/trace.md", help="report to write (default %(default)s)")
        p.add_argument("--json", default="reports/results/trace.json", help="results (default %(default)s)")
        p.add_argument("--cross-gpu", nargs=2, metavar="TRACE", help="add the comparison of one run's traces "
                       "from two machines to the results and re-render (runs nothing)")
    else:
        p.add_argument("--vary", choices=VARY, required=True, help="the one axis the two replicas differ on")
        p.add_argument("--out-dir", default="lockstep", help="where a.trace and b.trace go (default %(default)s)")
        p.add_argument("--keep", type=int, default=1, help="first differing records kept in full (default 1)")
        p.add_argument("--plot", help="write the per-step growth curve to this PNG")
    args = p.parse_args(argv[1:])
    try:
        cfg = train.resolve(train.config_from_args(args))
        train.apply_cudnn_heuristic(cfg)
        if args.steps < 1:
            raise train.ConfigError("--steps must be >= 1")
        if argv[0] == "report":
            if args.cross_gpu:
                print(f"report: {add_cross_gpu(args.json, *args.cross_gpu, args.md)}")
            else:
                print(f"report: {report(cfg, args.steps, args.md, args.json, ' '.join(['python -m nnrand.trace', *argv]))}")
            return 0
        if argv[0] == "lockstep":
            d = lockstep(cfg, args.vary, args.steps, args.out_dir, ops=args.ops, keep=args.keep)
        else:
            path = record_training(cfg, args.steps, args.output, ops=args.ops)
    except (train.ConfigError, routing.RoutingError, runio.DiskSpaceError, runio.CheckpointError, data.DatasetError,
            autotune.AutotuneError, noise.PerturbIndexError) as e:   # as nnrand.train's command line
        p.exit(2, f"{p.prog}: error: {e}\n")
    except routing.NondeterministicOpError as e:
        p.exit(3, f"{p.prog}: error: {e}\n")
    if argv[0] == "lockstep":
        print(f"replicas differing in {args.vary}: {d['traces'][0]} vs {d['traces'][1]}")
        print(format_diff(d))
        if args.plot and d["status"] == "diverge":
            print(f"plot: {plot(d, args.plot)}")
        return 0
    t = load(path)
    print(f"trace: {path} ({len(t)} records, {Counter(PHASES[i] for i in t.cols['phase'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
