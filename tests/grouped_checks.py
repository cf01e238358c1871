"""The GPU checks that conv_dgrad_grouped and conv_wgrad_grouped share: model layers at a small batch, the
kernels against their CPU models bit for bit (and the atomic one within its bound), exact on integers,
and the tree kernel over repeats. Each test module passes its op's pieces (variants, case factory, error
bound, integer inputs)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from kernels import conv_wgrad_grouped as cw
from tests.helpers import assert_bitwise_equal, bitwise_equal

# MODEL_LAYERS rows the GPU checks run: depthwise 3x3 (stride 1 and 2), 5x5 (stride 2 and 1), ConvNeXt's
# 7x7, ResNeXt's grouped 3x3 (stride 1 and its 1024-channel 7x7 layer)
GPU_LAYERS = (0, 1, 10, 11, 14, 16, 19)
REPEAT_LAYERS = (0, 3, 10, 14, 18)


def gpu_layer_cases(make_case: Callable, batch: int, seed: int) -> list:
    """GPU_LAYERS at batch ``batch`` (full spatial size) in both layouts, made by ``make_case(layer, seed,
    layout)``: real launch plans."""
    return [make_case(replace(cw.MODEL_LAYERS[i], n=batch), seed + j, layout) for j, i in enumerate(GPU_LAYERS)
            for layout in ("nchw", "channels_last")]


def check_gpu_against_models(spec, tree, atomic, case, within_bound: Callable, integer_inputs: Callable,
                             layout_ok: Callable | None = None) -> None:
    """On the GPU: ``tree`` gives its CPU model's bits, ``atomic`` stays within ``within_bound(got, args, kw,
    what)``, both give the float64 reference exactly on ``integer_inputs(case, device)``, and (where
    ``layout_ok(out, inputs)`` is given) both write the layout the op promises."""
    args, kw = spec.make_inputs(case, torch.device("cpu"))
    cuda = tuple(a.cuda() for a in args)
    got_tree, got_atomic = tree(*cuda, **kw), atomic(*cuda, **kw)
    torch.cuda.synchronize()
    if layout_ok is not None:
        assert layout_ok(got_tree, cuda) and layout_ok(got_atomic, cuda), f"{case.name}: output layout"
    assert_bitwise_equal(got_tree.cpu(), tree(*args, **kw), f"tree {case.name}")
    within_bound(got_atomic, args, kw, f"atomic {case.name}")
    ai, kwi = integer_inputs(case, "cuda")
    ref = spec.reference(tuple(a.cpu() for a in ai), kwi)
    for v in (tree, atomic):
        assert bitwise_equal(v(*ai, **kwi).double().cpu(), ref), f"{v.key} {case.name} integers"


def check_repeats(spec, tree, case, repeats: int = 50) -> None:
    """``tree`` on one GPU input ``repeats`` more times: every result has the first one's bits."""
    args, kw = spec.make_inputs(case, torch.device("cuda"))
    first = tree(*args, **kw)
    outs = [tree(*args, **kw) for _ in range(repeats)]
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert bitwise_equal(o, first), f"repeat {i} differs"
