"""conv_dgrad: CPU order models and CUDA kernels against float64, determinism, negative controls, checks.

Error bound (per dx element, from the arithmetic): a dx element is a sum of products w * dy over the
taps (co, kh, kw) that reach it. With u = 2^-24 and gamma_k = k u / (1 - k u) (Higham), a float32
result whose every product passes through at most k roundings is within gamma_k * sum |w| |dy| of the
exact value, whatever the order. The sum |w| |dy| is itself a data gradient: conv_dgrad(|w|, |dy|),
computed in float64. Roundings per product:
- CPU models: the float32 matmul rounds the product (1) and adds the Cout products of a tap column
  (<= Cout - 1 additions, any blocking); the tap columns are then added into +0.0 (<= KH*KW additions)
  by col2im (tree) or in random order (atomic): k = Cout + KH*KW + 1.
- CUDA atomic: an FFMA chain over Cout (Cout roundings), then <= KH*KW atomic additions into +0.0:
  k = Cout + KH*KW (Cout + KH*KW + 1 is used, the same bound as the models).
- CUDA tree: one FFMA chain over every (tap, co) of the element: k = Cout*KH*KW (+1 kept for symmetry).
  Split K (S ranges, each at least 16 slices of 8 products) cuts the chain into S chains added in order
  afterwards: a product meets at most K/S + 8 roundings in its chain and S - 1 in the sum, <= K + 1.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import conv_dgrad as cd
from kernels.conv_dgrad import OP, SOURCE, conv_dgrad_tree_cpu
from kernels.runtime import KERNEL_DIR
from kernels.shapes import HOSTILE_CONV, RESNET18_CONV, ConvShape
from tests.helpers import assert_bitwise_equal, bitwise_equal, distinct, gamma, nan_filled_memory

# the direct variants; winograd evaluates another expression, with its own bound: tests/test_conv_dgrad_winograd.py
VARIANTS = [v for v in kernels.variants(OP) if v.name != "winograd"]
TREE = kernels.get(OP, "tree")
ATOMIC = kernels.get(OP, "atomic")
SPEC = kernels.spec(OP)
CASES = SPEC.test_cases()
REPEATS = 50


def inputs(case, device="cpu"):
    (w, dy), kw = SPEC.make_inputs(case, torch.device(device))
    return w, dy, kw


def model_depth(case) -> int:
    """Roundings per product in the CPU models: Cout + KH*KW + 1 (see the module docstring)."""
    p = case.params
    return p["cout"] + p["k"] * p["k"] + 1


def assert_within_bound(got: torch.Tensor, w, dy, kw, k: int, what: str) -> None:
    ref = SPEC.reference((w, dy), kw)
    mag = SPEC.reference((w.abs(), dy.abs()), kw)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err = (got.detach().cpu().double() - ref).abs()
    bound = gamma(k) * mag
    bad = err > bound
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} elements outside gamma_{k} bound, first at {idx}: "
                             f"err {err[bad][:5].tolist()} bound {bound[bad][:5].tolist()}")


def case_named(name: str):
    return next(c for c in CASES if c.name == name)


def make_case(shape: ConvShape, layout: str = "nchw", seed: int = 0):
    params = {"n": shape.n, "cin": shape.cin, "cout": shape.cout, "k": shape.k, "stride": shape.stride,
              "pad": shape.pad, "h": shape.h, "w": shape.w, "dilation": shape.dilation, "layout": layout}
    return kernels.Case(OP, shape.name, params, seed=seed)


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    w, dy, kw = inputs(case)
    got = variant(w, dy, rng=case.seed, **kw)
    assert got.dtype == torch.float32
    want_cl = case.params["layout"] == "channels_last"
    assert got.is_contiguous(memory_format=torch.channels_last if want_cl else torch.contiguous_format)
    assert_within_bound(got, w, dy, kw, model_depth(case), f"{variant.key} {case.name}")


def test_model_tuple_parameters():
    """Per-axis stride, padding and dilation (all different) against float64."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(5, 3, 3, 2, generator=g)
    kw = {"input_size": (11, 9), "stride": (2, 1), "padding": (1, 0), "dilation": (1, 2)}
    dy = torch.randn(2, 5, 6, 7, generator=g)
    for v in VARIANTS:
        assert_within_bound(v(w, dy, rng=0, **kw), w, dy, kw, 5 + 6 + 1, v.key)


def test_tree_model_bitwise_stable():
    for case in (case_named("conv3x3_64-64_32_b1"), case_named("odd_s2_b2"), case_named("dilation2_cl_b2")):
        w, dy, kw = inputs(case)
        first = TREE(w, dy, rng=0, **kw)
        for seed in range(1, 6):
            assert_bitwise_equal(TREE(w, dy, rng=seed, **kw), first, f"tree model {case.name}")


def test_tree_model_is_col2im_order():
    """The tree model's per-tap strided adds give F.fold's bits: col2im adds an element's tap columns
    into +0.0 in (kh, kw) order too. Every case, layouts and hostile geometries included."""
    for case in CASES:
        w, dy, kw = inputs(case)
        g = cd._cpu_prologue(w, dy, **kw)
        if cd._trivial(g):
            continue
        want = torch.nn.functional.fold(cd.tap_columns(w, dy, g), (g.h, g.w), (g.kh, g.kw), dilation=(g.dh, g.dw),
                                        padding=(g.ph, g.pw), stride=(g.sh, g.sw))
        assert_bitwise_equal(TREE(w, dy, **kw).contiguous(), want, case.name)


def test_models_independent_of_thread_count():
    """The models parallelise only over independent outputs (BLAS over matrix blocks with the whole
    Cout reduction in one place, col2im and the slice adds over planes), so torch's thread count does
    not change their bits. torch's own CPU data gradient does not have this property for every shape."""
    saved = torch.get_num_threads()
    try:
        for name in ("conv3x3s2_64-128_32_b1", "stem7x7s2_3-64_32_b1", "spatial1x1_b3", "odd_s2_cl_b2"):
            w, dy, kw = inputs(case_named(name))
            runs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                runs.append([v(w, dy, rng=4, **kw) for v in VARIANTS])
            for run in runs[1:]:
                for v, a, b in zip(VARIANTS, runs[0], run):
                    assert_bitwise_equal(b, a, f"{v.key} {name} across thread counts")
    finally:
        torch.set_num_threads(saved)


def test_tree_model_layout_independent():
    """channels_last changes where dx lives, not the order its sums are taken in."""
    for name in ("odd_s2_b2", "c3_k7_s2_p3_b2", "dilation2_b2", "conv3x3s2_64-128_32_b1"):
        w, dy, kw = inputs(case_named(name))
        cl = TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw)
        assert cl.is_contiguous(memory_format=torch.channels_last)
        assert_bitwise_equal(cl.contiguous(), TREE(w, dy, **kw), name)


def test_atomic_model_seeded_is_reproducible():
    w, dy, kw = inputs(case_named("conv3x3_64-64_32_b1"))
    assert_bitwise_equal(ATOMIC(w, dy, rng=5, **kw), ATOMIC(w, dy, rng=5, **kw), "atomic model, same seed")


def test_atomic_model_varies_where_windows_overlap():
    """Negative control: with 3x3 windows at stride 1 each dx element takes 9 taps, and their arrival
    order changes the rounding; the same model agrees with itself on a non-overlapping 1x1 stride-2
    conv, where every element receives one contribution."""
    w, dy, kw = inputs(case_named("conv3x3_64-64_32_b1"))
    outs = [ATOMIC(w, dy, rng=s, **kw) for s in range(8)]
    assert distinct(outs) >= 4
    assert distinct(outs + [TREE(w, dy, **kw)]) >= 5
    w, dy, kw = inputs(case_named("conv1x1s2_64-128_32_b1"))
    outs = [ATOMIC(w, dy, rng=s, **kw) for s in range(4)] + [TREE(w, dy, **kw)]
    assert distinct(outs) == 1


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_empty(variant):
    w = torch.randn(4, 3, 3, 3)
    for n in (0,):
        dy = torch.randn(n, 4, 5, 5)
        got = variant(w, dy, input_size=(7, 7), rng=0)
        want = torch.nn.grad.conv2d_input((n, 3, 7, 7), w, dy)
        assert got.shape == want.shape == (0, 3, 7, 7)
    got = variant(torch.randn(0, 3, 3, 3), torch.randn(2, 0, 5, 5), input_size=(7, 7), rng=0)
    assert got.shape == (2, 3, 7, 7) and not got.any()


def _bad_inputs():
    w, dy = torch.randn(4, 3, 3, 3), torch.randn(2, 4, 5, 5)
    ok = {"input_size": (7, 7), "stride": 1, "padding": 0, "dilation": 1}
    strided = torch.randn(2, 4, 5, 10)[..., ::2]
    return [
        ("w float64", (w.double(), dy), ok, "w"),
        ("dy int", (w, dy.int()), ok, "dy"),
        ("w not a tensor", (w.numpy(), dy), ok, "w"),
        ("w 3-D", (w[0], dy), ok, "w"),
        ("dy 5-D", (w, dy[None]), ok, "dy"),
        ("dy on another device", (w, dy.to("meta")), ok, "dy"),
        ("channel mismatch", (w, torch.randn(2, 5, 5, 5)), ok, "dy"),
        ("output size mismatch", (w, dy), {**ok, "input_size": (8, 7)}, "dy"),
        ("stride inconsistent", (w, dy), {**ok, "stride": 2}, "dy"),
        ("input smaller than kernel", (w, torch.randn(2, 4, 1, 1)), {**ok, "input_size": (2, 2)}, "input_size"),
        ("input_size zero", (w, dy), {**ok, "input_size": (0, 7)}, "input_size"),
        ("input_size 3 values", (w, dy), {**ok, "input_size": (7, 7, 7)}, "input_size"),
        ("stride 0", (w, dy), {**ok, "stride": 0}, "stride"),
        ("stride float", (w, dy), {**ok, "stride": 1.0}, "stride"),
        ("stride bool", (w, dy), {**ok, "stride": True}, "stride"),
        ("padding negative", (w, dy), {**ok, "padding": (0, -1)}, "padding"),
        ("dilation 0", (w, dy), {**ok, "dilation": 0}, "dilation"),
        ("dy strided", (w, strided), ok, "dy"),
        ("w transposed", (w.transpose(2, 3).transpose(0, 1), dy), ok, "w"),
    ]


@pytest.mark.parametrize("bad", _bad_inputs(), ids=lambda b: b[0])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_bad_inputs_raise(variant, bad):
    _, args, kw, arg = bad
    with pytest.raises(KernelArgumentError) as info:
        variant.cpu(*args, **kw)
    assert info.value.op == OP and info.value.arg == arg, str(info.value)
    with pytest.raises(KernelArgumentError) as info:  # the CUDA launcher checks before anything else
        variant.cuda(*args, **kw)
    assert info.value.arg == arg, str(info.value)


def test_checks_not_bypassed_by_the_geometry_cache():
    """Sizes are validated once per argument set and cached; 1.0 and True equal 1 in Python, so the
    cache key carries the types and they are still refused after a valid call with 1."""
    w, dy = torch.randn(4, 3, 3, 3), torch.randn(2, 4, 5, 5)
    TREE(w, dy, input_size=(7, 7), stride=1, padding=0, dilation=1)
    TREE(w, dy, input_size=[7, 7], stride=(1, 1), padding=[0, 0], dilation=1)
    for bad in ({"stride": 1.0}, {"stride": True}, {"padding": (0, 0.0)}, {"dilation": [1, True]},
                {"input_size": (7.0, 7)}, {"stride": {1: 1}}):
        kw = {"input_size": (7, 7), "stride": 1, "padding": 0, "dilation": 1, **bad}
        with pytest.raises(KernelArgumentError) as info:
            TREE(w, dy, **kw)
        assert info.value.arg == next(iter(bad)), str(info.value)


def test_cuda_launcher_refuses_cpu_tensors():
    w, dy = torch.randn(4, 3, 3, 3), torch.randn(2, 4, 5, 5)
    for v in VARIANTS:
        with pytest.raises(KernelArgumentError) as info:
            v.cuda(w, dy, input_size=(7, 7))
        assert info.value.arg == "dy"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cu_compiles_for_sm90():
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-I{KERNEL_DIR}", "-c", "-o", "/dev/null",
                        str(KERNEL_DIR / SOURCE), "-Xptxas", "-v"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "spill stores" in r.stderr  # ptxas reported on the kernels
    for name in ("conv_dgrad_tree_nchw_deep", "conv_dgrad_tree_cl_deep"):   # 16-channel stages, no spills
        assert re.search(rf"Function properties for {name}\n\s*0 bytes stack frame, 0 bytes spill stores, "
                         r"0 bytes spill loads", r.stderr), name


# --------------------------------------------------------------------------------------------------
# CUDA kernels


GPU_CASES = CASES + [make_case(s.with_batch(8), "nchw", 700 + i) for i, s in enumerate(RESNET18_CONV)]


def _cuda_bound_depth(variant, case) -> int:
    p = case.params
    taps = p["k"] * p["k"]
    return p["cout"] * taps + 1 if variant.name == "tree" else p["cout"] + taps + 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_cuda_against_float64(variant, case):
    w, dy, kw = inputs(case, "cuda")
    got = variant(w, dy, **kw)
    torch.cuda.synchronize()
    want_cl = case.params["layout"] == "channels_last"
    assert got.is_cuda and got.is_contiguous(memory_format=torch.channels_last if want_cl else torch.contiguous_format)
    assert_within_bound(got.cpu(), w.cpu(), dy.cpu(), kw, _cuda_bound_depth(variant, case), f"{variant.key} {case.name}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_cuda_tree_bitwise_deterministic(case):
    w, dy, kw = inputs(case, "cuda")
    first = TREE(w, dy, **kw)
    for _ in range(REPEATS - 1):
        again = TREE(w, dy, **kw)
        assert bitwise_equal(again, first), f"tree {case.name}: results differ between repeats"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_stem_kernel():
    """Cin <= 4 runs tree_stem: checked on every stem-like shape at several batches, within the bound,
    bitwise repeatable, and the same bits for channels_last dy."""
    shapes = [s for s in RESNET18_CONV + HOSTILE_CONV if s.cin <= 4]
    for i, s in enumerate(shapes):
        for batch in sorted({1, 3, s.n}):
            case = make_case(s.with_batch(batch), "nchw", 950 + i)
            w, dy, kw = inputs(case, "cuda")
            first = TREE(w, dy, **kw)
            outs = [TREE(w, dy, **kw) for _ in range(10)]
            cl = TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw)
            torch.cuda.synchronize()
            assert_within_bound(first.cpu(), w.cpu(), dy.cpu(), kw, _cuda_bound_depth(TREE, case), case.name)
            for o in outs:
                assert bitwise_equal(o, first), f"{case.name}: repeats differ"
            assert_bitwise_equal(cl.contiguous(), first, f"{case.name} channels_last")


def test_stem_plan_covers_every_phase_pixel():
    """tree_stem's launch shape for every stem-like shape (and batch/layout variants), at its default and
    at every pixel count per lane group: an existing kernel, whole lane groups, shared memory within the
    cap, tiles covering the largest phase; the GEMM serves dilation and wider kernels."""
    source = (KERNEL_DIR / SOURCE).read_text()
    shapes = [s for s in RESNET18_CONV + HOSTILE_CONV if s.cin <= 4]
    shapes += [ConvShape("k11", 2, 3, 8, 11, 4, 2, 40, 37), ConvShape("k5s1", 1, 2, 5, 5, 1, 2, 9, 9),
               ConvShape("stem7x7s2_224", 2, 3, 64, 7, 2, 3, 224, 224), ConvShape("c4", 2, 4, 8, 3, 1, 1, 40, 40)]
    for s in shapes:
        for layout in ("nchw", "channels_last"):
            w, dy, kw = inputs(make_case(s.with_batch(3), layout, 1), "cpu")
            g = cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
            plan = cd.tree_plan(g, tuple(dy.stride()))
            if s.dilation != 1:
                assert plan.kernel.startswith("conv_dgrad_tree_") and plan.packing != "stem", s.name
                continue
            assert plan == cd.stem_launch_plan(g, tuple(dy.stride()))
            for px in (None, *cd.STEM_PIXELS):
                plan = cd.stem_launch_plan(g, tuple(dy.stride()), pixels=px)
                pixels, taps, nc, load = re.fullmatch(r"conv_dgrad_tree_stem_p(\d+)_t(\d+)_c(\d)_(scalar|cl|rows)",
                                                      plan.kernel).groups()
                assert int(pixels) == (px or cd.stem_pixels(g)) and int(pixels) in cd.STEM_PIXELS
                assert int(nc) == (3 if g.cin <= 3 else 4)
                assert plan.packing == "stem" and f"DG_STEM_KERNEL({taps})" in source
                assert f"DG_STEM_LOADS({pixels}, T, {nc})" in source
                tj, ti, tiles_i, tiles_j, cw = (int(v) for v in plan.scalars[-5:])
                assert plan.block == (ti * tj * cd.STEM_SPLIT,) and plan.block[0] <= 256 and tj <= cd.STEM_MAX_TJ
                assert 0 < plan.shared <= 4 * cd.STEM_SMEM_FLOATS and cw % 4 == 0
                hq, wq = -(-g.h // g.sh), -(-g.w // g.sw)
                assert ti * tiles_i >= hq and tj * int(pixels) * tiles_j >= wq
                # no tile row past the phase's width where the row fits one tile
                assert tiles_j > 1 or tj * int(pixels) < wq + int(pixels)
                assert plan.grid == (g.n * tiles_i * tiles_j, 1, g.sh * g.sw)
    w, dy, kw = inputs(make_case(shapes[-2].with_batch(1), "nchw", 1), "cpu")
    g = cd._check(w, dy, kw["input_size"], kw["stride"], kw["padding"], 1)
    assert cd.stem_launch_plan(g, tuple(dy.stride())).kernel == "conv_dgrad_tree_stem_p8_t4_c3_rows"
    with pytest.raises(ValueError, match="pixels per lane group"):
        cd.stem_launch_plan(g, tuple(dy.stride()), pixels=6)
    with pytest.raises(ValueError, match="channels per lane"):
        cd.stem_launch_plan(g, tuple(dy.stride()), channels=2)
    dil = ConvShape("dil", 1, 3, 4, 3, 1, 2, 9, 9, 2)
    w, dy, kw = inputs(make_case(dil, "nchw", 1), "cpu")
    g = cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
    assert cd.tree_plan(g, tuple(dy.stride())).packing == "tap_major"


@pytest.mark.gpu
def test_cuda_stem_pixels_and_channels_keep_bits():
    """tree_stem at 4 or 8 pixels per lane group, computing 3 or 4 channels per lane: the same bits (a dx
    element's FMA chain does not depend on which other pixels or channels its lane holds), in both
    layouts, on the ResNet stems (batch 2), a 224 px image, and Cin = 1, 2, 4 on widths whose tiles leave
    lanes idle past the phase's edge (25, 35 and 66 pixels)."""
    shapes = [s for s in RESNET18_CONV if s.cin <= 4] + [
        ConvShape("stem7x7s2_224", 2, 3, 64, 7, 2, 3, 224, 224), ConvShape("c1_w50", 2, 1, 8, 5, 2, 2, 50, 50),
        ConvShape("c4_w70", 2, 4, 16, 7, 2, 3, 70, 70), ConvShape("c2_w66", 2, 2, 8, 3, 1, 1, 66, 66)]
    for i, s in enumerate(shapes):
        for layout in ("nchw", "channels_last"):
            w, dy, kw = inputs(make_case(s.with_batch(2), layout, 880 + i), "cuda")
            first = TREE(w, dy, **kw)
            for px in cd.STEM_PIXELS:
                for nc in (3, 4) if s.cin <= 3 else (4,):
                    plan = lambda g, st: cd.stem_launch_plan(g, st, pixels=px, channels=nc)  # noqa: E731
                    got = cd._run(plan, w, dy, kw["input_size"], kw["stride"], kw["padding"], 1)
                    assert_bitwise_equal(got, first, f"{s.name} {layout} {px} pixels, {nc} channels")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_stem_load_modes_agree():
    """tree_stem loads dy three ways (float4 over channels for channels_last, aligned float4 row chunks
    for NCHW, one value at a time otherwise, e.g. for a dy that is not 16-byte aligned): the same bits."""
    for i, s in enumerate(x for x in RESNET18_CONV + HOSTILE_CONV if x.cin <= 4):
        w, dy, kw = inputs(make_case(s.with_batch(4), "nchw", 700 + i), "cuda")
        def mode(d):
            g = cd._check(w, d, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
            return cd._stem_load(g, tuple(d.stride()), cd.stem_pixels(g))

        first = TREE(w, dy, **kw)
        cl = dy.contiguous(memory_format=torch.channels_last)
        modes = {mode(dy), mode(cl)}
        assert_bitwise_equal(TREE(w, cl, **kw).contiguous(), first, f"{s.name} channels_last")
        shifted = torch.empty(dy.numel() + 1, device=dy.device)[1:].view(dy.shape).copy_(dy)  # 4-byte aligned only
        assert shifted.data_ptr() % 16
        assert_bitwise_equal(TREE(w, shifted, **kw), first, f"{s.name} unaligned dy (scalar loads)")
        if s.name.startswith("stem"):
            assert modes == {"rows", "cl"}, (s.name, modes)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_empty_phases_zeroed_either_way(monkeypatch):
    """Phases no tap reaches (1x1 stride 2): a memset before the launch, or the kernel's own zero
    stores (both layouts): the same bits, on dx buffers that start out full of garbage."""
    for i, s in enumerate(x for x in RESNET18_CONV + HOSTILE_CONV if x.k == 1 and x.stride == 2):
        for layout in ("nchw", "channels_last"):
            w, dy, kw = inputs(make_case(s.with_batch(8), layout, 600 + i), "cuda")
            want = cd.conv_dgrad_tree_cpu(w.cpu(), dy.cpu(), **kw)
            got = {}
            for mode in ("memset", "kernel"):
                monkeypatch.setattr(cd, "EMPTY_ZEROS", mode)
                monkeypatch.setattr(cd, "_empty_dx", lambda g, device, zero, f=cd._empty_dx:
                                    f(g, device, zero=zero) if zero else f(g, device, zero=False).fill_(float("nan")))
                got[mode] = TREE(w, dy, **kw)
                monkeypatch.undo()
            assert_bitwise_equal(got["kernel"], got["memset"], f"{s.name} {layout}")
            assert not torch.isnan(got["kernel"]).any()
            assert bitwise_equal(got["kernel"].cpu() == 0, want == 0), s.name  # zeros exactly where expected
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_tree_layout_independent():
    """Both layouts run the same per-element FMA order, so channels_last gives the NCHW bits."""
    for i, s in enumerate(RESNET18_CONV):
        w, dy, kw = inputs(make_case(s.with_batch(4), "nchw", 800 + i), "cuda")
        a = TREE(w, dy, **kw)
        b = TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw)
        assert_bitwise_equal(b.contiguous(), a, s.name)


def _distinct_on_device(outs: list[torch.Tensor]) -> int:
    seen: list[torch.Tensor] = []
    for o in outs:
        if not any(bitwise_equal(o, s) for s in seen):
            seen.append(o)
    return len(seen)


@pytest.mark.gpu
def test_cuda_atomic_varies_where_windows_overlap():
    """Negative control: the atomic scatter gives distinct results over repeats where windows overlap
    (asserted on 512->512 3x3 at 4x4, batch 128, where every block's taps race); on a 1x1 stride-2 conv
    (one contribution per element) it is as repeatable as the tree. Counts are printed for the others."""
    counts = {}
    for i, s in enumerate(RESNET18_CONV):
        w, dy, kw = inputs(make_case(s, "nchw", 900 + i), "cuda")
        counts[s.name] = _distinct_on_device([ATOMIC(w, dy, **kw) for _ in range(REPEATS if i == 10 else 10)])
    torch.cuda.synchronize()
    print("atomic distinct results (batch 128; 50 repeats for 512-512, 10 for the rest):", counts)
    assert RESNET18_CONV[10].name == "conv3x3_512-512_4" and counts["conv3x3_512-512_4"] > 1
    for s in RESNET18_CONV:
        if s.k == 1:
            assert counts[s.name] == 1, s.name


@pytest.mark.gpu
def test_cuda_independent_of_stream():
    w, dy, kw = inputs(make_case(RESNET18_CONV[2].with_batch(16), "nchw", 13), "cuda")
    base = TREE(w, dy, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            on_side = TREE(w, dy, **kw)
            atomic_side = ATOMIC(w, dy, **kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_bitwise_equal(on_side, base, "tree on a side stream")
    assert_within_bound(atomic_side.cpu(), w.cpu(), dy.cpu(), kw, 128 + 9 + 1, "atomic on a side stream")


@pytest.mark.gpu
def test_cuda_matches_model_within_bound():
    """Not bit-exact (FFMA): the CUDA tree and its CPU model agree to within both their bounds."""
    case = case_named("conv3x3_64-64_32_b1")
    w, dy, kw = inputs(case, "cuda")
    gpu = TREE(w, dy, **kw).cpu()
    cpu = conv_dgrad_tree_cpu(w.cpu(), dy.cpu(), **kw)
    mag = SPEC.reference((w.cpu().abs(), dy.cpu().abs()), kw)
    k = (64 * 9 + 1) + (64 + 9 + 1)
    assert ((gpu.double() - cpu.double()).abs() <= gamma(k) * mag).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_forward_form(dtype):
    """A stride-1 forward conv as the tree data gradient on flipped, transposed weights (what the routing's
    tuner offers for forward convs): 10 repeats one result, within the tree bound of float64 conv2d (k =
    Cin*KH*KW + 1 FFMA roundings; bf16: the larger of that and the tensor-core bound of
    tests/test_conv_mma_gpu.py, 18 * 2^-23 per 16-product instruction over the reduction padded to the
    engine's K-step, relative to the sum of magnitudes, then one rounding to bf16); float32: the same bits for NCHW and channels_last inputs and for an NCHW
    input with channels_last weights (one FMA order per element in every layout). Shapes: 3x3 "same", 1x1,
    5x5 with padding 1, 3x3 without, a 16 -> 3 conv (the stem kernel: 3 output channels)."""
    u = 2.0 ** -24
    cl = torch.channels_last
    for i, (n, cin, cout, k, p, h) in enumerate([(4, 64, 64, 3, 1, 16), (4, 32, 128, 1, 0, 8), (2, 8, 16, 5, 1, 11),
                                               (3, 16, 24, 3, 0, 9), (2, 16, 3, 3, 1, 12)]):
        g = torch.Generator(device="cuda").manual_seed(900 + i)
        x = torch.randn(n, cin, h, h, device="cuda", generator=g).to(dtype)
        w = torch.randn(cout, cin, k, k, device="cuda", generator=g).to(dtype)
        ref = torch.nn.functional.conv2d(x.double(), w.double(), None, 1, p)
        mag = torch.nn.functional.conv2d(x.double().abs(), w.double().abs(), None, 1, p)
        kk = cin * k * k + 1
        bound = kk * u / (1 - kk * u) * mag
        if dtype == torch.bfloat16:   # tensor cores where conv_mma takes the shape, else the float32 kernel
            from tests.test_conv_mma_gpu import MMA_ERR, _instructions

            steps = max(_instructions(cin * k * k, engine) for engine in ("wgmma", "mma"))
            bound = torch.maximum(bound, steps * MMA_ERR * mag)
            bound = bound + 2.0 ** -8 * (ref.abs() + bound)
        outs = {}
        for name, (xf, wf) in {"nchw": (torch.contiguous_format,) * 2, "channels_last": (cl, cl),
                               "nchw, w channels_last": (torch.contiguous_format, cl)}.items():
            xl, wl = x.contiguous(memory_format=xf), w.contiguous(memory_format=wf)
            y = cd.conv_forward_tree_cuda(xl, wl, padding=p)
            assert len({cd.conv_forward_tree_cuda(xl, wl, padding=p).cpu().float().numpy().tobytes()
                        for _ in range(10)}) == 1, f"forward {i} {name}"
            assert y.shape == ref.shape and y.dtype == dtype
            assert ((y.double() - ref).abs() <= bound).all(), f"forward {i} {name}"
            outs[name] = y.contiguous()
        if dtype == torch.float32:
            for name, y in outs.items():
                assert_bitwise_equal(y, outs["nchw"], f"forward {i}: {name} against nchw")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_tree_split_k_awkward_shape():
    """Split K where nothing divides evenly: 70 -> 61 channels (dgrad: 61 output channels in 8-wide slices,
    70 columns over two tiles), 3x3 with dilation 2, 6x6, batch 1, both layouts: the plan splits, the
    result is within the tree bound of float64, 10 repeats give one result, and both layouts the same bits."""
    s = ConvShape("awk", 1, 70, 61, 3, 1, 2, 6, 6, dilation=2)
    results = {}
    for layout in ("nchw", "channels_last"):
        w, dy, kw = inputs(make_case(s, layout, 960), "cuda")
        g = cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
        assert cd.tree_plan(g, tuple(dy.stride())).ksplit > 1
        got = TREE(w, dy, **kw)
        assert distinct([TREE(w, dy, **kw) for _ in range(10)]) == 1
        assert_within_bound(got, w, dy, kw, 61 * 9 + 1, f"split {layout}")
        results[layout] = got.contiguous()
    assert_bitwise_equal(results["channels_last"], results["nchw"], "split, layouts")
    torch.cuda.synchronize()


def test_forward_form_arguments_and_refusal():
    """conv2d(x, w, padding=p) at stride 1 is the data gradient at padding K-1-p with y's size as the
    input size; a padding wider than K-1 has no such form and is refused, naming the argument."""
    x, w = torch.zeros(2, 3, 10, 12), torch.zeros(5, 3, 3, 5)
    assert cd.forward_args(x, w, (1, 2)) == {"input_size": (10, 12), "padding": (1, 2)}
    assert cd.forward_args(x, w, 0) == {"input_size": (8, 8), "padding": (2, 4)}
    with pytest.raises(KernelArgumentError, match=r"conv_dgrad.*padding.*<= kernel size - 1"):
        cd.forward_args(x, w, (3, 0))
    assert cd.forward_weights(w).shape == (3, 5, 3, 5) and cd.forward_weights(w).is_contiguous()


@pytest.mark.gpu
def test_cuda_tree_split_k():
    """Deep layers at small batches split each element's reduction (partials, then a sum in split order):
    the plan splits 512->512 at 4x4 (8 blocks), not a stride-2 conv; split and unsplit results are both
    within the tree bound of float64, 10 split repeats give one result, and both layouts the same bits."""
    s = ConvShape("c512_4", 4, 512, 512, 3, 1, 1, 4, 4)
    w, dy, kw = inputs(make_case(s, "nchw", 950), "cuda")
    g = cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
    assert cd.tree_plan(g, tuple(dy.stride())).ksplit == cd.SPLIT_MAX
    g2 = cd._check(w, dy[..., ::2, ::2].contiguous(), kw["input_size"], 2, 1, 1)
    assert cd.tree_plan(g2, tuple(dy[..., ::2, ::2].contiguous().stride())).ksplit == 1
    split = TREE(w, dy, **kw)
    assert distinct([TREE(w, dy, **kw) for _ in range(10)]) == 1
    assert_bitwise_equal(TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw).contiguous(), split,
                         "split, channels_last")
    cd._tree_plan.cache_clear()
    try:
        cd.SPLIT_TARGET, target = 0, cd.SPLIT_TARGET
        unsplit = TREE(w, dy, **kw)
    finally:
        cd.SPLIT_TARGET = target
        cd._tree_plan.cache_clear()
    exact = SPEC.reference((w.cpu().double(), dy.cpu().double()), kw)
    mag = SPEC.reference((w.cpu().abs().double(), dy.cpu().abs().double()), kw)
    bound = gamma(512 * 9 + 1) * mag
    for got in (split, unsplit):
        assert ((got.cpu().double() - exact).abs() <= bound).all()
    assert not torch.equal(split, unsplit)   # the split is a different order: bits differ somewhere
    torch.cuda.synchronize()


def _split_of(s: ConvShape, waves: bool | None = None) -> int:
    w, dy = torch.empty(s.w_shape), torch.empty(s.y_shape)
    g = cd._check(w, dy, (s.h, s.w), s.stride, s.pad, s.dilation)
    return cd.tree_split(g, -(-s.n * s.h * s.w // cd.BM) * -(-s.cin // cd.BN), waves)


def test_waves_split_fills_a_launch_of_less_than_one_wave():
    """A stride-1 launch of 128-column tiles (Cin >= 128) with SPLIT_TARGET narrow blocks or more but less
    than one wave of 128-column blocks (SPLIT_TARGET) is split into the fewest ranges whose blocks fill whole
    waves to 90%; a launch of a wave or more, a narrower one, a stride-2 one, and every launch with SPLIT_WAVES
    off keep one range. The rule reads the shape alone."""
    r18_512_7 = ConvShape("r18_512_7", 128, 512, 512, 3, 1, 1, 7, 7)       # 49 x 4 = 196 wide blocks
    assert _split_of(r18_512_7) == 4                                             # 784 of 3 waves of 264
    assert _split_of(r18_512_7, waves=False) == 1
    assert _split_of(ConvShape("b96", 96, 512, 512, 3, 1, 1, 7, 7)) == 5        # 148 wide blocks: 740 of 792
    assert _split_of(ConvShape("r18_256_14", 128, 256, 256, 3, 1, 1, 14, 14)) == 1   # 392: a wave and more
    assert _split_of(ConvShape("c192", 96, 192, 192, 3, 1, 1, 14, 14)) == 1     # 147 x 2 = 294 wide: over a wave
    assert _split_of(ConvShape("c64", 128, 64, 64, 3, 1, 1, 20, 20)) == 1       # Cin 64: 400 narrow blocks
    assert _split_of(ConvShape("s2", 128, 512, 512, 3, 2, 1, 14, 14)) == 1      # stride 2
    assert _split_of(ConvShape("short", 128, 512, 16, 1, 1, 0, 7, 7)) == 1      # 2 slices: no range of 16
    for s in RESNET18_CONV:   # the CIFAR shapes' splits are the small-launch rule's, waves or not
        assert _split_of(s) == _split_of(s, waves=False), s.name


@pytest.mark.gpu
def test_cuda_tree_waves_split():
    """A launch the waves rule splits (128 -> 64 channels, 3x3, 14x14, batch 108: 166 blocks of 128 columns,
    split into 3 ranges, 498 blocks of 528): within the tree bound of float64 (each element: 64 * 9 products in
    chains, then 3 partials), 10 repeats one result, both layouts the same bits; the unsplit launch
    (SPLIT_WAVES off) is within the bound too and differs somewhere (another order)."""
    s = ConvShape("waves", 108, 128, 64, 3, 1, 1, 14, 14)
    assert _split_of(s) == 3
    w, dy, kw = inputs(make_case(s, "nchw", 970), "cuda")
    got = TREE(w, dy, **kw)
    assert distinct([TREE(w, dy, **kw) for _ in range(10)]) == 1
    assert_within_bound(got, w, dy, kw, 64 * 9 + 3, "waves split")
    assert_bitwise_equal(TREE(w, dy.contiguous(memory_format=torch.channels_last), **kw).contiguous(), got,
                         "waves split, channels_last")
    saved = cd.SPLIT_WAVES
    try:
        cd.SPLIT_WAVES = False
        unsplit = TREE(w, dy, **kw)
    finally:
        cd.SPLIT_WAVES = saved
    assert_within_bound(unsplit, w, dy, kw, 64 * 9 + 1, "unsplit")
    assert not torch.equal(unsplit, got)
    torch.cuda.synchronize()


WIDE_SHAPES = [   # the plans split every stride-1 one here (few blocks); none of them splits at stride 2
    ConvShape("w128", 2, 128, 64, 3, 1, 1, 9, 11),         # one wide column tile, split 4
    ConvShape("w200", 3, 200, 72, 3, 1, 1, 7, 7),          # a partial second tile (72 of 128 columns)
    ConvShape("w130s", 1, 130, 256, 3, 1, 1, 4, 4),        # split 8, a 2-column second tile
    ConvShape("w160s2", 2, 160, 96, 1, 2, 0, 10, 10),      # stride 2, 1x1: phases no tap reaches
    ConvShape("w144s2k3", 2, 144, 40, 3, 2, 1, 9, 8),      # stride 2, 3x3: every phase has taps, no split
]


def _plan(s: ConvShape, layout: str, device: str = "cpu", seed: int = 1):
    if device == "cpu":   # the plan reads shapes and strides only
        w = torch.empty(s.w_shape)
        dy = torch.empty(s.n, s.cout, (s.h + 2 * s.pad - s.dilation * (s.k - 1) - 1) // s.stride + 1,
                         (s.w + 2 * s.pad - s.dilation * (s.k - 1) - 1) // s.stride + 1)
        if layout == "channels_last":
            w, dy = (t.contiguous(memory_format=torch.channels_last) for t in (w, dy))
        kw = {"input_size": (s.h, s.w), "stride": s.stride, "padding": s.pad, "dilation": s.dilation}
    else:
        w, dy, kw = inputs(make_case(s, layout, seed), device)
    g = cd._check(w, dy, kw["input_size"], kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
    return g, tuple(dy.stride()), (w, dy, kw)


def test_tree_plan_wide_tiles():
    """Cin >= WIDE_MIN_CIN takes the 128 x 128 tile (an existing kernel, half the column tiles) with the
    split the 128 x 64 grid would have, where its blocks fill the SMs or its chains are long, in the
    register budget its grid size asks for; otherwise the narrow tile, as for fewer channels."""
    source = (KERNEL_DIR / SOURCE).read_text()
    expect = {  # network shapes (dgrad: Cin is the gradient's channels) and the kernel suffix they get
        ConvShape("r50_1x1_256_64", 64, 256, 64, 1, 1, 0, 56, 56): "_wide_deep",   # unsplit, two-block budget
        ConvShape("r50_1x1_256_56", 64, 256, 56, 1, 1, 0, 56, 56): "_wide",   # Cout 56: an odd number of stages of 8
        ConvShape("r50_3x3_512_7", 64, 512, 512, 3, 1, 1, 7, 7): "_wide1",
        ConvShape("r18_3x3_512_4", 128, 512, 512, 3, 1, 1, 4, 4): "_wide1",
        ConvShape("r18_1x1s2_256_512_8", 128, 256, 512, 1, 2, 0, 8, 8): "_deep",   # narrow and unsplit
        ConvShape("r18_3x3_64", 128, 64, 64, 3, 1, 1, 32, 32): "_deep",   # (NCHW: _t128_deep, T128 below)
        ConvShape("n127", 2, 127, 8, 1, 1, 0, 5, 5): "",   # Cout 8: one stage of 8, not half a stage of 16
        ConvShape("r18_3x3_64_b8", 8, 64, 64, 3, 1, 1, 32, 32): "",     # narrow, split: stages of 8
    }
    for s, suffix in expect.items():
        for layout in ("nchw", "channels_last"):
            g, stride, _ = _plan(s, layout)
            saved = cd.T128
            try:   # 128-thread blocks: test_tree_plan_t128
                cd.T128 = False
                plan = cd.tree_plan(g, stride)
            finally:
                cd.T128 = saved
            narrow = cd._tree_plan(g, stride, cd.EMPTY_ZEROS, (1 << 30, 0, 0), False, cd.SPLIT_WAVES)
            assert re.search(rf"__global__ void __launch_bounds__\([^)]*\)\s+{plan.kernel}\(", source), plan.kernel
            assert plan.kernel == narrow.kernel + suffix, (s.name, layout, plan.kernel)
            assert plan.ksplit == narrow.ksplit and plan.scalars == narrow.scalars, s.name
            if suffix.startswith("_wide"):
                assert plan.grid == (narrow.grid[0], -(-s.cin // (2 * cd.BN)) * plan.ksplit, narrow.grid[2])
            else:   # deep stages exactly where a narrow launch is unsplit and Cout fills stages of 16 as of 8
                assert (plan.ksplit == 1 and -(-s.cout // 8) % 2 == 0) == (suffix == "_deep"), s.name
                assert plan._replace(kernel=narrow.kernel) == narrow, s.name
            saved = cd.DEEP_SLICES, cd.WIDE_DEEP, cd.T128
            try:   # the switches: stages of 8 everywhere (or on the wide tile), the plan otherwise the same
                cd.DEEP_SLICES, cd.T128 = False, False
                assert cd.tree_plan(g, stride) == plan._replace(kernel=plan.kernel.removesuffix("_deep")), s.name
                cd.DEEP_SLICES, cd.WIDE_DEEP = True, False
                wide8 = plan.kernel.removesuffix("_deep") if "_wide" in plan.kernel else plan.kernel
                assert cd.tree_plan(g, stride) == plan._replace(kernel=wide8), s.name
            finally:
                cd.DEEP_SLICES, cd.WIDE_DEEP, cd.T128 = saved


def test_tree_plan_t128():
    """NCHW launches that keep the 128 x 64 tile and have T128_MIN_BLOCKS blocks with taps or more run it on 128
    threads (the same grid and scalars, deep stages as before); channels_last, wide tiles, the stem and smaller
    launches keep 256 threads."""
    source = (KERNEL_DIR / SOURCE).read_text()
    expect = {  # network shapes (dgrad: Cin is the gradient's channels): 128 threads in NCHW?
        ConvShape("r18_224_3x3_64", 128, 64, 64, 3, 1, 1, 56, 56): True,       # 3136 blocks
        ConvShape("r18_224_3x3s2_64_128", 128, 64, 128, 3, 2, 1, 56, 56): True,    # 784 a phase, 4 phases with taps
        ConvShape("r18_224_1x1s2_64_128", 128, 64, 128, 1, 2, 0, 56, 56): True,    # 784, one phase with taps
        ConvShape("r18_3x3_64", 128, 64, 64, 3, 1, 1, 32, 32): True,           # 1024
        ConvShape("r18_1x1s2_64_128", 128, 64, 128, 1, 2, 0, 32, 32): False,   # 256
        ConvShape("r18_224_1x1s2_256_512", 128, 256, 512, 1, 2, 0, 14, 14): False,   # 196
        ConvShape("r18_224_3x3_128", 128, 128, 128, 3, 1, 1, 28, 28): False,   # the wide tile
        ConvShape("r18_3x3_64_b8", 8, 64, 64, 3, 1, 1, 32, 32): False,         # 64 blocks: split
    }
    assert cd.T128_MIN_BLOCKS == 4 * cd.WAVE_SMS
    for s, t128 in expect.items():
        for layout in ("nchw", "channels_last"):
            g, stride, _ = _plan(s, layout)
            plan = cd.tree_plan(g, stride)
            saved = cd.T128
            try:
                cd.T128 = False
                base = cd.tree_plan(g, stride)
            finally:
                cd.T128 = saved
            assert re.search(rf"__global__ void __launch_bounds__\([^)]*\)\s+{plan.kernel}\(", source), plan.kernel
            if t128 and layout == "nchw":
                assert plan.kernel == base.kernel.replace("_nchw", "_nchw_t128"), (s.name, plan.kernel)
                assert plan.block == (128,) and plan._replace(kernel=base.kernel, block=base.block) == base, s.name
            else:
                assert plan == base, (s.name, layout, plan.kernel)


T128_SHAPES = [   # NCHW launches the 128-thread blocks are forced on (T128_MIN_BLOCKS = 0)
    ConvShape("t64", 64, 64, 64, 3, 1, 1, 32, 32),            # unsplit, deep stages
    ConvShape("t44_co", 64, 64, 44, 3, 1, 1, 32, 32),         # Cout 44: stages of 8 (odd count)
    ConvShape("t100_ci", 48, 100, 28, 3, 1, 1, 24, 24),       # a partial column tile
    ConvShape("t72s2", 16, 72, 140, 3, 2, 1, 17, 15),         # stride-2 phases, odd sizes
    ConvShape("t1x1s2", 8, 64, 32, 1, 2, 0, 15, 15),          # phases no tap reaches (zeros)
    ConvShape("t64dil2", 32, 64, 48, 3, 1, 2, 28, 28, 2),     # dilation 2
    ConvShape("t64_b2", 2, 64, 64, 3, 1, 1, 16, 16),          # few blocks: split K
]


@pytest.mark.gpu
def test_cuda_tree_t128_same_bits():
    """128-thread blocks (8 x 8 a thread) compute every dx element's chain as 256 threads of 8 x 4 do: the same
    bits, forced on every launch kind here (deep stages, stages of 8, partial column tiles, stride-2 phases and
    the zeros of phases no tap reaches, by a memset and by the kernel, dilation, split K), and on the forward
    form; every element written (NaN-filled buffers), 5 repeats one result."""
    with nan_filled_memory():
        for i, s in enumerate(T128_SHAPES):
            g, stride, (w, dy, kw) = _plan(s, "nchw", "cuda", 1400 + i)
            outs = {}
            for forced in (False, True, "kernel zeros"):
                saved = cd.T128, cd.T128_MIN_BLOCKS, cd.EMPTY_ZEROS
                try:
                    cd.T128, cd.T128_MIN_BLOCKS = bool(forced), 0
                    if forced == "kernel zeros":
                        if s.name != "t1x1s2":
                            continue
                        cd.EMPTY_ZEROS = "kernel"
                        assert not cd.tree_plan(g, stride).zero_fill
                    plan = cd.tree_plan(g, stride)
                    assert ("_t128" in plan.kernel) == bool(forced), (s.name, plan.kernel)
                    if s.name == "t64_b2":
                        assert plan.ksplit > 1, plan
                    got = TREE(w, dy, **kw)
                    assert not torch.isnan(got).any(), f"{s.name} t128={forced}: unwritten dx"
                    assert distinct([TREE(w, dy, **kw) for _ in range(5)]) == 1, (s.name, forced)
                    outs[forced] = got
                    if s.stride == 1 and s.dilation == 1:
                        x = dy.new_empty(g.dx_shape).normal_(generator=torch.Generator("cuda").manual_seed(i))
                        wf = w.new_empty(s.cout, s.cin, s.k, s.k).normal_(
                            generator=torch.Generator("cuda").manual_seed(60 + i))
                        outs[forced, "fwd"] = cd.conv_forward_tree_cuda(x, wf, padding=s.pad)
                finally:
                    cd.T128, cd.T128_MIN_BLOCKS, cd.EMPTY_ZEROS = saved
                    cd._tree_plan.cache_clear()
            assert_bitwise_equal(outs[True], outs[False], f"{s.name}: 128 against 256 threads")
            if "kernel zeros" in outs:
                assert_bitwise_equal(outs["kernel zeros"], outs[False], f"{s.name}: zeros by the 128-thread kernel")
            if (False, "fwd") in outs:
                assert_bitwise_equal(outs[True, "fwd"], outs[False, "fwd"], f"{s.name}: forward form")
            assert_within_bound(outs[False], w.cpu(), dy.cpu(), kw, s.cout * s.k * s.k + 1, s.name)
    torch.cuda.synchronize()


DEEP_SHAPES = [   # unsplit narrow launches (many pixels, or stride 2), Cout an even number of stages of 8
    ConvShape("d64", 64, 64, 64, 3, 1, 1, 32, 32),           # stages of 16 fill every tap
    ConvShape("d44_co", 64, 64, 44, 3, 1, 1, 32, 32),        # Cout 44: a tap's last stage holds 12 of 16
    ConvShape("d100_ci", 48, 100, 28, 3, 1, 1, 24, 24),      # a partial column tile, Cout 28
    ConvShape("d72s2", 16, 72, 140, 3, 2, 1, 17, 15),        # stride-2 phases, odd sizes, Cout 140
    ConvShape("d64dil2", 32, 64, 48, 3, 1, 2, 28, 28, 2),   # dilation 2
]


@pytest.mark.gpu
def test_cuda_tree_deep_stages_same_bits():
    """Stages of 16 output channels compute every dx element's chain as stages of 8 do: the same bits in
    both layouts, with Cout not a multiple of 16, partial column tiles, stride-2 phases and dilation, for
    the data gradient and the forward form; every dx element written (NaN-filled buffers in PyTorch's
    deterministic mode), and 5 repeats give one result."""
    with nan_filled_memory():
        for i, s in enumerate(DEEP_SHAPES):
            for layout in ("nchw", "channels_last"):
                g, stride, (w, dy, kw) = _plan(s, layout, "cuda", 990 + i)
                outs = {}
                for deep in (False, True):
                    saved = cd.DEEP_SLICES
                    try:
                        cd.DEEP_SLICES = deep
                        plan = cd.tree_plan(g, stride)
                        assert plan.ksplit == 1 and plan.kernel.endswith("_deep") == deep, (s.name, plan.kernel)
                        got = TREE(w, dy, **kw)
                        assert not torch.isnan(got).any(), f"{s.name} {layout} deep={deep}: unwritten dx"
                        assert distinct([TREE(w, dy, **kw) for _ in range(5)]) == 1, f"{s.name} {layout} {deep}"
                        outs[deep] = got
                        if s.stride == 1 and s.dilation == 1:
                            x = dy.new_empty(g.dx_shape).normal_(generator=torch.Generator("cuda").manual_seed(i))
                            x = x.contiguous(memory_format=dy_format(dy))
                            wf = w.new_empty(s.cout, s.cin, s.k, s.k).normal_(
                                generator=torch.Generator("cuda").manual_seed(50 + i))
                            outs[deep, "fwd"] = cd.conv_forward_tree_cuda(x, wf, padding=s.pad)
                    finally:
                        cd.DEEP_SLICES = saved
                assert_bitwise_equal(outs[True], outs[False], f"{s.name} {layout}: deep against stages of 8")
                if (False, "fwd") in outs:
                    assert_bitwise_equal(outs[True, "fwd"], outs[False, "fwd"], f"{s.name} {layout}: forward form")
                assert_within_bound(outs[False], w.cpu(), dy.cpu(), kw, s.cout * s.k * s.k + 1, f"{s.name} {layout}")
    torch.cuda.synchronize()


def dy_format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if not t.is_contiguous() else torch.contiguous_format


SIGNED_ZERO_SHAPES = [   # unsplit narrow launches; most with Cout an odd number of stages of 8
    ConvShape("z8", 64, 64, 8, 3, 1, 1, 24, 24),           # one stage of 8: a deep stage's second half all pad
    ConvShape("z24s2", 16, 40, 24, 3, 2, 1, 15, 17),       # stride-2 phases, 3 stages of 8
    ConvShape("z40dil2", 64, 72, 40, 3, 1, 2, 24, 24, 2),  # dilation 2, a partial column tile, 5 stages of 8
    ConvShape("z36", 64, 64, 36, 3, 1, 1, 24, 24),         # 4 channels of pad in a tap's last stage of 8
    ConvShape("z48", 64, 64, 48, 3, 1, 1, 24, 24),         # 6 stages of 8: the launcher's own deep launch
]


def _deep_forced(plan: cd.LaunchPlan) -> cd.LaunchPlan:
    # (z40dil2 in NCHW has enough blocks for the 128-thread kernels: their deep twin is named)
    assert plan.kernel in ("conv_dgrad_tree_nchw", "conv_dgrad_tree_cl", "conv_dgrad_tree_nchw_t128") and \
        plan.ksplit == 1, plan.kernel
    return plan._replace(kernel=plan.kernel + "_deep")


@pytest.mark.gpu
def test_cuda_tree_deep_stages_keep_signed_zeros():
    """A chain whose products all underflow (dy about 2^-80, w about -2^-80 on the even input channels) ends
    at -0.0 in stages of 8, and a zero term (a channel past Cout, A = B = +0) turns -0.0 into +0.0. Stages
    of 16 pad a tap with 8 more channels where Cout is an odd number of stages of 8; the deep kernel makes
    those terms exact identities (B = -0.0), so it gives the stages of 8's bits, -0.0 included, for any
    Cout: run here also on the Couts the launcher keeps in stages of 8, by naming the deep kernel."""
    for i, s in enumerate(SIGNED_ZERO_SHAPES):
        gen = torch.Generator("cuda").manual_seed(1200 + i)
        dy = (1 + torch.rand(s.y_shape, device="cuda", generator=gen)) * 2.0 ** -80
        w = torch.randn(s.w_shape, device="cuda", generator=gen)
        w[:, 0::2] = -(1 + torch.rand(w[:, 0::2].shape, device="cuda", generator=gen)) * 2.0 ** -80
        kw = {"input_size": (s.h, s.w), "stride": s.stride, "padding": s.pad, "dilation": s.dilation}
        for layout in ("nchw", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            wl, dyl = w.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
            saved = cd.DEEP_SLICES
            try:
                cd.DEEP_SLICES = False
                g = cd._check(wl, dyl, kw["input_size"], s.stride, s.pad, s.dilation)
                plan = cd.tree_plan(g, tuple(dyl.stride()))
                assert plan.ksplit == 1 and not plan.kernel.endswith("_deep"), (s.name, plan)
                k8 = TREE(wl, dyl, **kw)
                deep = cd._run(lambda geo, st: _deep_forced(cd.tree_plan(geo, st)), wl, dyl, **kw)
                cd.DEEP_SLICES = True
                assert cd.tree_plan(g, tuple(dyl.stride())).kernel.endswith("_deep") == (-(-s.cout // 8) % 2 == 0)
                launcher = TREE(wl, dyl, **kw)
            finally:
                cd.DEEP_SLICES = saved
            zeros = k8[:, 0::2]
            assert (zeros == 0).all(), f"{s.name} {layout}: every product underflows"
            if s.cout % 8 == 0:   # no channel past Cout in stages of 8: -0.0 throughout
                assert torch.signbit(zeros).all(), f"{s.name} {layout}: -0.0 expected in stages of 8"
            assert_bitwise_equal(deep, k8, f"{s.name} {layout}: deep kernel against stages of 8")
            assert_bitwise_equal(launcher, k8, f"{s.name} {layout}: launcher against stages of 8")
    torch.cuda.synchronize()


WIDE_DEEP_SHAPES = [   # unsplit launches of the two-block wide kernel
    ConvShape("wd1x1", 64, 256, 64, 1, 1, 0, 28, 28),
    ConvShape("wd200", 64, 200, 48, 3, 1, 1, 20, 20),       # a partial second column tile (72 of 128)
    ConvShape("wds2", 32, 160, 96, 3, 2, 1, 30, 30),        # stride-2 phases
    ConvShape("wd40", 64, 256, 40, 3, 1, 1, 20, 20),        # Cout 40, 5 stages of 8: the deep kernel named
]


@pytest.mark.gpu
def test_cuda_tree_wide_deep_stages_same_bits():
    """Stages of 16 on the wide tile compute every dx element's chain as its stages of 8 do: the same bits in
    both layouts, every element written (NaN-filled buffers), 5 repeats one result; on a Cout of an odd number
    of stages of 8 (which the launcher keeps in stages of 8) the deep kernel, named, still gives those bits
    (its pad terms are exact identities), with dy and w small enough that every product underflows on the
    even input channels, so the sign of their -0.0 sums is compared too."""
    with nan_filled_memory():
        for i, s in enumerate(WIDE_DEEP_SHAPES):
            for layout in ("nchw", "channels_last"):
                g, stride, (w, dy, kw) = _plan(s, layout, "cuda", 1300 + i)
                if s.name == "wd40":
                    w[:, 0::2] = -(1 + torch.rand(w[:, 0::2].shape, device="cuda",
                                                  generator=torch.Generator("cuda").manual_seed(i))) * 2.0 ** -80
                    dy = dy.abs() * 2.0 ** -80
                outs = {}
                for wide_deep in (False, True):
                    saved = cd.WIDE_DEEP
                    try:
                        cd.WIDE_DEEP = wide_deep
                        plan = cd.tree_plan(g, stride)
                        odd = -(-s.cout // 8) % 2 == 1
                        assert plan.ksplit == 1 and plan.kernel.endswith("_wide_deep") == (wide_deep and not odd), \
                            (s.name, plan.kernel)
                        if odd and wide_deep:
                            got = cd._run(lambda geo, st: cd.tree_plan(geo, st)._replace(
                                kernel=cd.tree_plan(geo, st).kernel + "_deep"), w, dy, **kw)
                        else:
                            got = TREE(w, dy, **kw)
                            assert distinct([TREE(w, dy, **kw) for _ in range(5)]) == 1, (s.name, layout)
                        assert not torch.isnan(got).any(), f"{s.name} {layout} {wide_deep}: unwritten dx"
                        outs[wide_deep] = got
                    finally:
                        cd.WIDE_DEEP = saved
                if s.name == "wd40":
                    assert torch.signbit(outs[False][:, 0::2]).any(), f"{layout}: no -0.0 sums to compare"
                assert_bitwise_equal(outs[True], outs[False], f"{s.name} {layout}: wide deep against stages of 8")
                if s.name != "wd40":   # (underflowing products are no test of the rounding bound)
                    assert_within_bound(outs[False], w.cpu(), dy.cpu(), kw, s.cout * s.k * s.k + 1,
                                        f"{s.name} {layout}")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_tree_wide_tiles_same_bits():
    """The 128 x 128 tile, in both register budgets, computes every dx element as the 128 x 64 tile does:
    the same bits, in both layouts, with and without split K, partial column tiles, and stride-2 phases no
    tap reaches (their zeros stored by the kernel or a memset before it); 5 repeats give one result. Run
    in PyTorch's deterministic mode, so every buffer the launcher takes from torch.empty (dx, the split's
    partials) starts as NaN: an element a kernel does not write shows, whatever an earlier run left."""
    rules = {"narrow": (1 << 30, 0, 0), "_wide": (cd.WIDE_MIN_CIN, 0, 0), "_wide1": (cd.WIDE_MIN_CIN, 1 << 30, 0)}
    with nan_filled_memory():
        for i, s in enumerate(WIDE_SHAPES):
            for layout in ("nchw", "channels_last"):
                g, stride, (w, dy, kw) = _plan(s, layout, "cuda", 970 + i)
                plan = cd.tree_plan(g, stride)
                assert (plan.ksplit > 1) == (s.stride == 1), s.name
                outs = {}
                for zeros in ("memset", "kernel"):
                    for name, rule in rules.items():
                        cd._tree_plan.cache_clear()
                        saved = cd.WIDE_MIN_CIN, cd.WAVE_SMS, cd.WIDE_MIN_SLICES, cd.EMPTY_ZEROS
                        try:
                            cd.WIDE_MIN_CIN, cd.WAVE_SMS, cd.WIDE_MIN_SLICES = rule
                            cd.EMPTY_ZEROS = zeros
                            kernel = cd.tree_plan(g, stride).kernel
                            # (an unsplit two-block wide launch runs the wide tile's deep stages: same chains)
                            assert kernel.removesuffix("_deep").endswith(name) if name != "narrow" else \
                                "_wide" not in kernel
                            got = TREE(w, dy, **kw)
                            assert not torch.isnan(got).any(), f"{s.name} {layout} {name} {zeros}: unwritten dx"
                            assert distinct([TREE(w, dy, **kw) for _ in range(5)]) == 1, f"{s.name} {layout} {name}"
                            outs[name, zeros] = got
                        finally:
                            cd.WIDE_MIN_CIN, cd.WAVE_SMS, cd.WIDE_MIN_SLICES, cd.EMPTY_ZEROS = saved
                            cd._tree_plan.cache_clear()
                ref = outs["narrow", "memset"]
                for key, got in outs.items():
                    assert_bitwise_equal(got, ref, f"{s.name} {layout}: {key} against narrow tiles, memset")
                assert_within_bound(ref, w.cpu(), dy.cpu(), kw, s.cout * s.k * s.k + 1, f"{s.name} {layout}")
    torch.cuda.synchronize()
