"""Half-precision convolution backward on tensor cores: the launchers of ``conv_mma.cu``.

conv_wgrad's ``tree`` and ``atomic`` and conv_dgrad's ``tree`` CUDA launchers hand bf16 and fp16 calls here
(the registry marks them ``half_native``). Products of two half values are exact in float32 and every
accumulation is float32, as under the widening call; what differs is the order and rounding of the sums
inside a tensor-core instruction, so the bits are not those of the float32 kernels on widened tensors
(those variants are not CPU bit-exact either). What each keeps:

- wgrad ``tree``: the reduction cut into chunks by ``conv_wgrad.half_plan`` (a function of the shapes
  only, longer chunks than the float32 kernels' plan), each chunk's partial tile on tensor cores, the
  partials added in the fixed order of the float32 variant (``conv_wgrad.tree_combine``), rounded once.
  Deterministic.
- wgrad ``atomic``: the same chunks, partials atomicAdd-ed in arrival order. Nondeterministic.
- dgrad ``tree``: one implicit GEMM over (kh, kw, co), every dx element owned by one thread. Deterministic.

Two engines run the same GEMMs in the same order: ``wgmma`` (Hopper's warpgroup MMAs reading 128-byte
swizzled shared memory, compute capability 9.0 only) and ``mma`` (mma.sync, any GPU from 8.0). A device
always takes the same one (:func:`default_engine`), so a call's bits are a function of the GPU model; the two
engines' bits may differ (tensor-core rounding inside an instruction is not specified).

They take channels_last tensors whose channel counts are multiples of 8 (16-byte loads of 8 channels); an
NCHW tensor is copied to channels_last first. wgrad pads other input channel counts (a network stem's 3)
with zero channels. Other shapes take the widening path: float32 copies, the float32 kernel, the output
rounded once, the bits of the registry's widening call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .runtime import INT32_MAX, SLOT, Launch, act_defines, cdiv, function

SOURCE = "conv_mma.cu"
THREADS = 256
ALIGN = 8   # channel counts must be multiples of this (one 16-byte load holds 8 half channels)
HALF = (torch.bfloat16, torch.float16)

def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous in its layout) at a 16-byte aligned address: the kernels load 16 bytes (8 half
    channels) at a time, so a view starting at an odd element is copied (a fresh allocation is aligned)."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.preserve_format)


def _cl(t: torch.Tensor) -> torch.Tensor:
    return _aligned(t.contiguous(memory_format=torch.channels_last))

def eligible(dtype: torch.dtype, cin: int, cout: int, *tensors: torch.Tensor, pad_cin: bool = False) -> bool:
    """Whether the tensor-core kernels take this call: half dtype shared by the tensors, channel counts
    multiples of 8 (``pad_cin``: any input channel count, padded with zero channels), every tensor on CUDA
    and within 32-bit indexing."""
    return (dtype in HALF and (pad_cin or cin % ALIGN == 0) and cout % ALIGN == 0
            and all(t.dtype == dtype and t.is_cuda and t.numel() <= INT32_MAX for t in tensors))


def padded_geometry(g):
    """conv_wgrad's Geometry with the input channels padded to a multiple of 8 (the weight gradient of
    the zero channels is computed and dropped; it touches no other element's sums)."""
    return dataclasses.replace(g, cin=cdiv(g.cin, ALIGN) * ALIGN)


@functools.lru_cache(maxsize=1024)
def _ints(*values: int) -> tuple:
    return tuple(np.int32(v) for v in values)

BK, PAD = 32, 8              # as MM_BK, MM_PAD in conv_mma.cu (the mma.sync kernels)
WG_BK = 64                   # the wgmma kernels' K-step (WG_BK in conv_mma.cu)
# shared-memory stages per engine (MM_STAGES; wgmma needs 3 or more): the fastest in
# bench/dev/conv_mma_sweep.py on ResNet-50 shapes (H100), none of them changes the bits
STAGES = {"wgmma": 3, "mma": 4}
MIN_STAGES = {"wgmma": 3, "mma": 2}   # loads run STAGES - 2 (wgmma) or STAGES - 1 (mma) K-steps ahead
MAX_STAGES = 8
SMEM_MAX = 227 * 1024                  # the most shared memory a block may opt into (9.0; less elsewhere)
ENGINES = ("wgmma", "mma")
PREFIX = {"wgmma": "conv_wg", "mma": "conv_mma"}   # each engine's kernel names in conv_mma.cu
WGMMA_CAPABILITY = (9, 0)                            # the sm_90a target the wgmma kernels are built for
ENGINE: str | None = None    # the engine of calls that name none; None: default_engine (set by benchmarks)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)   # ~20 us a query: once per device


def capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def has_wgmma(device: torch.device) -> bool:
    return capability(device) == WGMMA_CAPABILITY


def default_engine(device: torch.device) -> str:
    """``"wgmma"`` (warpgroup MMAs, Hopper's tensor-core instructions) on compute capability 9.0, else
    ``"mma"`` (mma.sync, any GPU from 8.0). A function of the device only: on one GPU model a call always
    takes the same kernels, hence the same bits."""
    return "wgmma" if has_wgmma(device) else "mma"


def _engine(engine: str | None, device: torch.device) -> str:
    engine = engine or ENGINE
    if engine is None:
        return default_engine(device)
    if engine not in ENGINES:
        raise ValueError(f"conv_mma: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "wgmma" and not has_wgmma(device):
        raise ValueError(f"conv_mma: engine 'wgmma' needs a compute capability 9.0 GPU, {device} is "
                         f"{'.'.join(map(str, capability(device)))}")
    return engine


def _fn(name: str, device: torch.device, dtype: torch.dtype, engine: str, smem: int = 0, stages: int | None = None):
    """The kernel, compiled with ``stages`` shared-memory stages (default: the engine's, STAGES), its dynamic
    shared-memory limit raised to ``smem`` bytes (once per loaded function)."""
    return function(SOURCE, name, device, (*act_defines(dtype), f"-DMM_STAGES={stages or STAGES[engine]}"),
                    arch_specific=True, smem=smem)



def wgrad_smem(bm: int, bn: int, engine: str = "mma") -> int:
    if engine == "wgmma":
        return STAGES[engine] * WG_BK * (bm + bn) * 2      # A and B stages, swizzled, no padding
    return STAGES[engine] * BK * (bm + bn + 2 * PAD) * 2   # A and B stages, [BK][tile + PAD] halves each


def wgrad_tile(m: int, r: int) -> tuple[int, int]:
    """(BM, BN) of the weight-gradient kernels: 128 along each side that has at least 128, else 64. Any
    choice gives the same bits (an element's mma sequence does not depend on its tile), so this is the
    speed knob the split plan (conv_wgrad.half_plan, which fixes the bits) leaves free."""
    return (128 if m >= 128 else 64), (128 if r >= 128 else 64)


def dgrad_smem(bn: int, bm: int = 128, engine: str = "mma", stages: int | None = None) -> int:
    stages = stages or STAGES[engine]
    if engine == "wgmma":
        return stages * WG_BK * (bm + bn) * 2
    return stages * (bm * (BK + PAD) + BK * (bn + PAD)) * 2

def wgrad(x: torch.Tensor, dy: torch.Tensor, g, plan_of, *, atomic: bool,
          tile: tuple[int, int] | None = None, engine: str | None = None) -> torch.Tensor:
    """dw (Cout, Cin, KH, KW), contiguous, in x's dtype. ``g``: conv_wgrad.Geometry; ``plan_of``: its split
    plan as a function of (M, R, K), taken on the padded geometry where Cin is not a multiple of 8;
    ``atomic``: partials added in arrival order instead of the fixed order; ``tile``: (BM, BN), each 64 or
    128, instead of :func:`wgrad_tile`'s (the same bits); ``engine``: the tensor-core instructions
    (:func:`default_engine` when None; the engines' bits may differ)."""
    return prepare_wgrad(x, dy, g, plan_of, atomic=atomic, tile=tile, engine=engine)(x, dy)


def prepare_wgrad(x: torch.Tensor, dy: torch.Tensor, g, plan_of, *, atomic: bool,
                  tile: tuple[int, int] | None = None, engine: str | None = None) -> Callable:
    """:func:`wgrad` as ``run(x, dy) -> dw`` for calls with the signature of these x and dy: the plan and
    both launches decided once."""
    dev, dtype = x.device, x.dtype
    engine = _engine(engine, dev)
    cin = g.cin
    if cin % ALIGN:
        g = padded_geometry(g)
    p = plan_of(g.m, g.r, g.k)
    m, r = g.m, g.r
    geom = _ints(g.n, g.h, g.w, g.cin, g.oh, g.ow, g.cout, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                 g.k, p.chunk)
    bm, bn = tile or wgrad_tile(m, r)
    kind = "atomic" if atomic else "split"
    smem = wgrad_smem(bm, bn, engine)
    gemm = Launch.of(_fn(f"{PREFIX[engine]}_wgrad_{kind}_{bm}x{bn}", dev, dtype, engine, smem),
                     (cdiv(r, bn), cdiv(m, bm), p.splits), (THREADS,), (SLOT, SLOT, SLOT, *geom), device=dev,
                     shared_mem=smem)
    splits = 1 if atomic else p.splits   # atomic: the partials added into one zeroed workspace
    combine = Launch.of(_fn("conv_mma_combine", dev, dtype, engine), (cdiv(m * r, THREADS),), (THREADS,),
                        (SLOT, *_ints(splits, m, g.cin, g.kh * g.kw), SLOT), device=dev)
    padded = g.cin - cin
    workspace = torch.zeros if atomic else torch.empty

    def run(x, dy):
        x, dy = _cl(x), _cl(dy)
        if padded:
            x = F.pad(x.permute(0, 2, 3, 1), (0, padded)).permute(0, 3, 1, 2)   # NHWC, zero channels added
        dw = torch.empty(g.w_shape, device=dev, dtype=dtype)
        ws = workspace(splits * m * r, device=dev, dtype=torch.float32)
        gemm(x.data_ptr(), dy.data_ptr(), ws.data_ptr())
        combine(ws.data_ptr(), dw.data_ptr())
        return dw[:, :cin].contiguous() if padded else dw
    return run


DGRAD_SMALL_GRID = 264   # 128-row blocks below which a wgmma dgrad launch takes 64-row tiles


def dgrad_tile(p: int, c: int, engine: str) -> tuple[int, int]:
    """(BM, BN) of a data-gradient launch over ``p`` pixels and ``c`` input channels: BN 128 where c is at
    least 128, else 64; BM 128, or 64 on the wgmma engine where 128-row tiles would give fewer than
    DGRAD_SMALL_GRID blocks (ResNet-50's deep layers at 7x7 and 14x14: 100 to 196 blocks on 132 SMs). Each
    element's sum is the same sequence of instructions in every tile: a speed knob, never the bits."""
    bn = 128 if c >= 128 else 64
    if engine == "wgmma" and cdiv(c, bn) * cdiv(p, 128) < DGRAD_SMALL_GRID:
        return 64, bn
    return 128, bn


def dgrad(w: torch.Tensor, dy: torch.Tensor, g, *, engine: str | None = None,
          tile: tuple[int, int] | None = None, stages: int | None = None) -> torch.Tensor:
    """dx (N, Cin, H, W) in dy's dtype and layout. ``g``: conv_dgrad.Geometry; ``engine``: as in
    :func:`wgrad`; ``tile``: (BM, BN) of every launch instead of :func:`dgrad_tile`'s (BN 64 or 128; BM
    128, or 64 on the wgmma engine; the same bits). The GEMM's B operand is the weights packed
    [kh][kw][co][ci] (mma: rows q = (kh, kw, co)) or [ci][kh][kw][co] (wgmma: K-major rows ci).

    A strided conv (dilation 1) runs as one stride-1 launch per stride phase (a, b): the dx pixels (a + i*sh,
    b + j*sw) receive only the taps kh = (a + ph) mod sh, ... + sh, ... and kw likewise, at dy rows i + c0 - t
    (t the tap's index among them, c0 = (a + ph - first tap) / sh): a stride-1 conv of those taps with padding
    c0. Phases no tap reaches stay zero. With dilation and stride both above 1, one launch skips the taps
    that miss (loads them as zeros)."""
    return prepare_dgrad(w, dy, g, engine=engine, tile=tile, stages=stages)(w, dy)


def prepare_dgrad(w: torch.Tensor, dy: torch.Tensor, g, *, engine: str | None = None,
                  tile: tuple[int, int] | None = None, stages: int | None = None) -> Callable:
    """:func:`dgrad` as ``run(w, dy) -> dx`` for calls with the signature of these w and dy: phases, tiles
    and launches decided once; a call packs the weights of each phase and launches."""
    dev, dtype = dy.device, dy.dtype
    engine = _engine(engine, dev)
    c = g.cin
    phased = (g.sh > 1 or g.sw > 1) and g.dh == 1 and g.dw == 1
    phases = []   # (dx offset, h, w, taps of w, padding (ph, pw), kernel (kh, kw))
    if phased:
        for a in range(min(g.sh, g.h)):
            for b in range(min(g.sw, g.w)):
                rh, rw = (a + g.ph) % g.sh, (b + g.pw) % g.sw
                nkh, nkw = cdiv(g.kh - rh, g.sh) if rh < g.kh else 0, cdiv(g.kw - rw, g.sw) if rw < g.kw else 0
                phases.append(((a * g.w + b) * c, cdiv(g.h - a, g.sh), cdiv(g.w - b, g.sw), (rh, rw),
                               ((a + g.ph - rh) // g.sh, (b + g.pw - rw) // g.sw), (nkh, nkw)))
    empty_phase = any(p[5][0] * p[5][1] == 0 for p in phases)
    if tile is not None and not (tile[1] in (64, 128) and tile[0] in ((64, 128) if engine == "wgmma" else (128,))):
        raise ValueError(f"conv_mma.dgrad: tile {tile} is not one the {engine} engine has")
    if stages is not None and not MIN_STAGES[engine] <= stages <= MAX_STAGES:
        raise ValueError(f"conv_mma.dgrad: stages must be {MIN_STAGES[engine]} to {MAX_STAGES} on the {engine} "
                         f"engine, got {stages}")

    def kernel(p: int, geom: tuple) -> Launch:
        bm, bn = tile or dgrad_tile(p, c, engine)
        smem = dgrad_smem(bn=bn, bm=bm, engine=engine, stages=stages)
        if smem > SMEM_MAX:
            raise ValueError(f"conv_mma.dgrad: {stages} stages of {bm}x{bn} tiles need {smem} bytes of shared "
                             f"memory, over the {SMEM_MAX} a block may have")
        # one grid dimension, channel tiles fastest (the kernel splits it): pixel tiles past 65535 fit
        return Launch.of(_fn(f"{PREFIX[engine]}_dgrad_t{bm}x{bn}", dev, dtype, engine, smem, stages),
                         (cdiv(c, bn) * cdiv(p, bm),), (THREADS,), (SLOT, SLOT, SLOT, *geom), device=dev,
                         shared_mem=smem)

    order = (1, 2, 3, 0) if engine == "wgmma" else (2, 3, 0, 1)   # [ci][kh][kw][co] or [kh][kw][co][ci]
    # per launch: its kernel, the taps of w it reads (rows, columns: slices), its byte offset into dx
    launches = []
    if not phased:
        launches.append((kernel(g.n * g.h * g.w, _ints(g.n, g.h, g.w, c, g.oh, g.ow, g.cout, g.kh, g.kw, g.sh, g.sw,
                                                        g.ph, g.pw, g.dh, g.dw, g.h * g.w * c, g.w * c, c)),
                         None, 0))
    else:
        for offset, hp, wp, (rh, rw), (c0h, c0w), (nkh, nkw) in phases:
            if nkh * nkw:
                launches.append((kernel(g.n * hp * wp, _ints(g.n, hp, wp, c, g.oh, g.ow, g.cout, nkh, nkw, 1, 1, c0h,
                                                              c0w, 1, 1, g.h * g.w * c, g.sh * g.w * c, g.sw * c)),
                                 (slice(rh, None, g.sh), slice(rw, None, g.sw)), 2 * offset))
    nchw = g.layout != "channels_last"

    def run(w, dy):
        dy_cl = _cl(dy)
        dx = torch.empty(g.dx_shape, device=dev, dtype=dtype, memory_format=torch.channels_last)
        if empty_phase:
            dx.zero_()
        base = dx.data_ptr()
        for k, taps, offset in launches:
            wq = _aligned((w if taps is None else w[:, :, taps[0], taps[1]]).permute(*order).contiguous())
            k(wq.data_ptr(), dy_cl.data_ptr(), base + offset)
        return dx.contiguous() if nchw else dx
    return run
