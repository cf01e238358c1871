"""Half-precision convolution backward on tensor cores: the launchers of ``conv_mma.cu``.

conv_wgrad's ``tree`` and ``atomic`` and conv_dgrad's ``tree`` CUDA launchers hand bf16 and fp16 calls here
(the registry marks them ``half_native``). Products of two half values are exact in float32 and every
accumulation is float32, as under the widening call; what differs is the order and rounding of the sums
inside a tensor-core instruction, so the bits are not those of the float32 kernels on widened tensors
(those variants are not CPU bit-exact either). What each keeps:

- wgrad ``tree``: the split of the reduction of the float32 variant (``conv_wgrad.plan``: the same chunks,
  a function of the shapes only), each chunk's partial tile on tensor cores, the partials added in the
  same fixed order (``conv_wgrad.tree_combine``), rounded once. Deterministic.
- wgrad ``atomic``: the same chunks, partials atomicAdd-ed in arrival order. Nondeterministic.
- dgrad ``tree``: one implicit GEMM over (kh, kw, co), every dx element owned by one thread. Deterministic.

They take channels_last tensors whose channel counts are multiples of 8 (16-byte loads of 8 channels); an
NCHW tensor is copied to channels_last first. Other shapes (a network stem's 3 input channels) take the
widening path: float32 copies, the float32 kernel, the output rounded once, the bits of the registry's
widening call.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .runtime import INT32_MAX, act_defines, cdiv, function, launch, ptr

SOURCE = "conv_mma.cu"
THREADS = 256
ALIGN = 8   # channel counts must be multiples of this (one 16-byte load holds 8 half channels)
HALF = (torch.bfloat16, torch.float16)

def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)

def eligible(dtype: torch.dtype, cin: int, cout: int, *tensors: torch.Tensor) -> bool:
    """Whether the tensor-core kernels take this call: half dtype shared by the tensors, channel counts
    multiples of 8, every tensor on CUDA and within 32-bit indexing."""
    return (dtype in HALF and cin % ALIGN == 0 and cout % ALIGN == 0
            and all(t.dtype == dtype and t.is_cuda and t.numel() <= INT32_MAX for t in tensors))

@functools.lru_cache(maxsize=1024)
def _ints(*values: int) -> tuple:
    return tuple(np.int32(v) for v in values)

def _fn(name: str, device: torch.device, dtype: torch.dtype):
    return function(SOURCE, name, device, act_defines(dtype))

def wgrad(x: torch.Tensor, dy: torch.Tensor, g, p, *, atomic: bool) -> torch.Tensor:
    """dw (Cout, Cin, KH, KW), contiguous, in x's dtype. ``g``: conv_wgrad.Geometry; ``p``: its Plan (tile,
    splits, chunk); ``atomic``: partials added in arrival order instead of the fixed order."""
    dev, dtype = x.device, x.dtype
    x, dy = _cl(x), _cl(dy)
    m, r = g.m, g.r
    geom = _ints(g.n, g.h, g.w, g.cin, g.oh, g.ow, g.cout, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                 g.k, p.chunk)
    grid = (cdiv(r, p.tile), cdiv(m, p.tile), p.splits)
    dw = torch.empty(g.w_shape, device=dev, dtype=dtype)
    if atomic:
        ws = torch.zeros(m * r, device=dev, dtype=torch.float32)
        splits = 1
    else:
        ws = torch.empty(p.splits * m * r, device=dev, dtype=torch.float32)
        splits = p.splits
    kind = "atomic" if atomic else "split"
    launch(_fn(f"conv_mma_wgrad_{kind}_t{p.tile}", dev, dtype), grid, (THREADS,), (ptr(x), ptr(dy), ptr(ws), *geom),
           device=dev)
    launch(_fn("conv_mma_combine", dev, dtype), (cdiv(m * r, THREADS),), (THREADS,),
           (ptr(ws), *_ints(splits, m, g.cin, g.kh * g.kw), ptr(dw)), device=dev)
    return dw

def dgrad(w: torch.Tensor, dy: torch.Tensor, g) -> torch.Tensor:
    """dx (N, Cin, H, W) in dy's dtype and layout. ``g``: conv_dgrad.Geometry."""
    dev, dtype = dy.device, dy.dtype
    wq = w.permute(2, 3, 0, 1).contiguous()   # [kh][kw][co][ci]: the GEMM's B rows q = (kh, kw, co)
    dy_cl = _cl(dy)
    dx = torch.empty(g.dx_shape, device=dev, dtype=dtype, memory_format=torch.channels_last)
    bn = 128 if g.cin >= 128 else 64
    grid = (cdiv(g.cin, bn), cdiv(g.n * g.h * g.w, 128))
    geom = _ints(g.n, g.h, g.w, g.cin, g.oh, g.ow, g.cout, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw)
    launch(_fn(f"conv_mma_dgrad_t128x{bn}", dev, dtype), grid, (THREADS,), (ptr(wq), ptr(dy_cl), ptr(dx), *geom),
           device=dev)
    return dx if g.layout == "channels_last" else dx.contiguous()
