"""bf16 / fp16 convolution gradients on tensor cores (kernels/conv_mma.py), as conv_wgrad's tree and atomic
and conv_dgrad's tree run them for half inputs: within a bound derived from the tensor-core arithmetic of
the exact float64 result, bitwise repeatable where deterministic, and the widening call's bits where a shape
falls back to the float32 kernels.

The bound. Inputs are half, so every product is exact in float32 (bf16: 8 + 8 significand bits, fp16: 11 +
11, both <= 24). One mma.m16n8k16 adds 16 products to a float32 accumulator; the tensor core aligns the 17
values to the largest and truncates, then normalises: each value loses less than one unit in the 24th bit
of the largest (2^-23 relative to it, and so to the sum of magnitudes), the normalisation once more. So an
instruction adds at most 18 * 2^-23 * (|acc| + sum |its products|) <= 18 * 2^-23 * T, T the sum over the
element's terms of |term| (|acc| is at most the magnitudes so far, up to a factor 1 + 1e-2 that the
totals below keep far from), and an element that goes through I instructions is off by at most
I * 18 * 2^-23 * T (wgmma.m64nNk16 adds 16 products per instruction too, so the same bound per instruction;
both engines are tested where the GPU has them). wgrad then adds its S chunk partials in float32 from +0.0 through at most S + 8
additions (ordered_combine: groups, then the 8 group sums): (S + 8) * 2^-24 * T more. The output is
rounded once to the half dtype (unit roundoff 2^-8 bf16, 2^-11 fp16, plus half of fp16's smallest
subnormal, 2^-25, absolute).
"""
from __future__ import annotations


import pytest
import torch

import kernels
from kernels import conv_dgrad, conv_mma, conv_wgrad
from kernels.registry import round_outputs
from kernels.shapes import ConvShape
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.gpu

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SUBNORMAL = {torch.bfloat16: 0.0, torch.float16: 2.0 ** -25}
MMA_ERR = 18 * 2.0 ** -23   # per tensor-core instruction, relative to the element's sum of magnitudes
SLACK = 1.01                # |partial sums| <= (1 + small) * their exact magnitudes

# Channel counts multiples of 8 (the tensor-core path), each shape exercising one edge: tiles that do not
# divide M, R or the pixel count, K not a multiple of 32, stride and padding, dilation, an asymmetric
# kernel, 1x1 outputs, 1x1 stride 2, and ResNet-50 shapes at a small batch.
SHAPES = (
    ConvShape("odd_s2", 2, 8, 24, 3, 2, 1, 15, 13),
    ConvShape("k1_s2_odd", 3, 16, 40, 1, 2, 0, 7, 9),
    ConvShape("dilation2_p2", 2, 16, 8, 3, 1, 2, 9, 11, 2),
    ConvShape("pad_gt_half", 1, 8, 16, 3, 1, 3, 6, 5),
    ConvShape("k5_s3", 2, 24, 16, 5, 3, 2, 19, 17),
    ConvShape("spatial1x1", 5, 32, 16, 1, 1, 0, 1, 1),
    ConvShape("r50_3x3_64_56", 2, 64, 64, 3, 1, 1, 56, 56),
    ConvShape("r50_1x1_256-128_56", 2, 256, 128, 1, 1, 0, 56, 56),
    ConvShape("r50_3x3s2_128_56", 4, 128, 128, 3, 2, 1, 56, 56),
    ConvShape("r50_1x1s2_1024-2048_14", 4, 1024, 2048, 1, 2, 0, 14, 14),
    ConvShape("r50_3x3_512_7", 16, 512, 512, 3, 1, 1, 7, 7),
    ConvShape("dilation2_s2", 2, 16, 16, 3, 2, 2, 13, 12, 2),
    ConvShape("k2_s3_empty_phases", 2, 8, 16, 2, 3, 1, 10, 11),
)
# wgrad pads the input channels to a multiple of 8 (dgrad of these takes the widening path)
PADDED = (ConvShape("stem7x7s2_c3", 2, 3, 64, 7, 2, 3, 33, 31), ConvShape("c5_k3", 3, 5, 16, 3, 1, 1, 9, 9))
LAYOUTS = ("nchw", "channels_last")


@pytest.fixture(params=conv_mma.ENGINES)
def engine(request, monkeypatch):
    """Each tensor-core engine this GPU has, set as the one calls take (conv_mma.ENGINE)."""
    if request.param == "wgmma" and not conv_mma.has_wgmma(torch.device("cuda")):
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    monkeypatch.setattr(conv_mma, "ENGINE", request.param)
    return request.param


def _instructions(k: int, engine: str) -> int:
    """k16 tensor-core instructions behind an element whose reduction has length k (K-steps of the
    engine's length, the last padded with zeros)."""
    step = conv_mma.WG_BK if engine == "wgmma" else conv_mma.BK
    return -(-k // step) * (step // 16)


def _tensors(s: ConvShape, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s.x_shape, generator=g).to(dtype)
    w = torch.randn(s.w_shape, generator=g).to(dtype)
    dy = torch.randn(s.y_shape, generator=g).to(dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    return tuple(t.contiguous(memory_format=fmt).cuda() for t in (x, w, dy))


def _geom(s: ConvShape) -> dict:
    return dict(stride=s.stride, padding=s.pad, dilation=s.dilation)


def _within(got: torch.Tensor, exact: torch.Tensor, mags: torch.Tensor, rel: float, dtype, what: str) -> None:
    err_sum = rel * SLACK * mags
    bound = UNIT[dtype] * (exact.abs() + err_sum) + err_sum + SUBNORMAL[dtype]
    err = (got.double().cpu() - exact).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {err.max().item():.3g})"


def _wgrad_ref(x, dy, s: ConvShape):
    spec = kernels.spec("conv_wgrad")
    kw = dict(kernel_size=s.k, **_geom(s))
    return spec.reference((x, dy), kw), spec.reference((x.abs(), dy.abs()), kw)


def _dgrad_ref(w, dy, s: ConvShape):
    spec = kernels.spec("conv_dgrad")
    kw = dict(input_size=(s.h, s.w), **_geom(s))
    return spec.reference((w, dy), kw), spec.reference((w.abs(), dy.abs()), kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("shape", SHAPES + PADDED, ids=lambda s: s.name)
def test_wgrad_tensor_cores_within_bound_and_tree_repeats(shape, dtype, layout, engine, cuda_sync):
    x, _, dy = _tensors(shape, dtype, layout, seed=(SHAPES + PADDED).index(shape))
    assert conv_mma.eligible(dtype, shape.cin, shape.cout, x, dy, pad_cin=True)
    g = conv_mma.padded_geometry(conv_wgrad._check(x, dy, shape.k, shape.stride, shape.pad, shape.dilation))
    p = conv_wgrad.half_plan(g.m, g.r, g.k)   # the plan conv_mma's wgrad runs
    rel = _instructions(p.chunk, engine) * MMA_ERR + (p.splits + 8) * 2.0 ** -24
    exact, mags = _wgrad_ref(x, dy, shape)
    kw = dict(kernel_size=shape.k, **_geom(shape))
    tree = kernels.get("conv_wgrad", "tree")
    runs = [tree(x, dy, **kw) for _ in range(4)]
    assert runs[0].dtype == dtype and runs[0].shape == shape.w_shape and runs[0].is_contiguous()
    for r in runs[1:]:
        assert_bitwise_equal(runs[0], r, f"{shape.name} tree repeat")
    _within(runs[0], exact, mags, rel, dtype, f"{shape.name} tree")
    atomic = kernels.get("conv_wgrad", "atomic")(x, dy, **kw)
    assert atomic.dtype == dtype
    _within(atomic, exact, mags, rel, dtype, f"{shape.name} atomic")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_dgrad_tensor_cores_within_bound_and_repeat(shape, dtype, layout, engine, cuda_sync):
    _, w, dy = _tensors(shape, dtype, layout, seed=500 + SHAPES.index(shape))
    assert conv_mma.eligible(dtype, shape.cin, shape.cout, w, dy)
    rel = _instructions(shape.k * shape.k * shape.cout, engine) * MMA_ERR
    exact, mags = _dgrad_ref(w, dy, shape)
    kw = dict(input_size=(shape.h, shape.w), **_geom(shape))
    tree = kernels.get("conv_dgrad", "tree")
    runs = [tree(w, dy, **kw) for _ in range(4)]
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert runs[0].dtype == dtype and runs[0].shape == shape.x_shape
    assert runs[0].is_contiguous(memory_format=fmt)   # dx in dy's layout
    for r in runs[1:]:
        assert_bitwise_equal(runs[0], r, f"{shape.name} tree repeat")
    _within(runs[0], exact, mags, rel, dtype, f"{shape.name} dgrad tree")


FALLBACK = (ConvShape("cout12", 2, 8, 12, 3, 1, 1, 9, 9), ConvShape("cout4_c3", 2, 3, 4, 3, 2, 1, 9, 8))


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("shape", FALLBACK, ids=lambda s: s.name)
def test_channel_counts_off_the_tensor_core_path_get_the_widening_bits(shape, dtype, cuda_sync):
    """Cout not a multiple of 8: float32 copies through the float32 kernel, rounded once."""
    x, w, dy = _tensors(shape, dtype, "channels_last", seed=7)
    assert not conv_mma.eligible(dtype, shape.cin, shape.cout, x, dy, pad_cin=True)
    kw = dict(kernel_size=shape.k, **_geom(shape))
    v = kernels.get("conv_wgrad", "tree")
    assert_bitwise_equal(v(x, dy, **kw), v.cuda(x.float(), dy.float(), **kw).to(dtype), "wgrad tree")
    dkw = dict(input_size=(shape.h, shape.w), **_geom(shape))
    v = kernels.get("conv_dgrad", "tree")
    want = round_outputs("conv_dgrad", v.cuda(w.float(), dy.float(), **dkw), (w, dy))
    assert_bitwise_equal(v(w, dy, **dkw), want, "dgrad tree")


def test_float32_launchers_refuse_half_they_do_not_read(cuda_sync):
    s = SHAPES[0]
    x, w, dy = _tensors(s, torch.bfloat16, "channels_last", seed=3)
    with pytest.raises(kernels.KernelArgumentError, match="conv_wgrad.*x.*float32"):
        conv_wgrad.conv_wgrad_nosplit_cuda(x, dy, kernel_size=s.k, **_geom(s))
    with pytest.raises(kernels.KernelArgumentError, match="conv_dgrad.*w.*float32"):
        conv_dgrad.conv_dgrad_atomic_cuda(w, dy, input_size=(s.h, s.w), **_geom(s))
    with pytest.raises(kernels.KernelArgumentError, match="conv_wgrad.*dy.*bfloat16"):
        kernels.get("conv_wgrad", "tree").cuda(x, dy.half(), kernel_size=s.k, **_geom(s))


def _at_odd_address(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view with t's strides that starts one element (2 bytes) into its allocation."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].as_strided(t.shape, t.stride())
    view.copy_(t)
    assert view.data_ptr() % 16 == 2 and torch.equal(view, t)
    return view


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[6]], ids=lambda s: s.name)
def test_views_at_unaligned_addresses_give_the_aligned_bits(shape, layout, engine, cuda_sync):
    """The kernels load 16 bytes (8 half channels) at a time: x, w and dy that start 2 bytes into their
    allocations (a slice of a larger buffer, say) are copied to aligned memory first, so they run and give
    the bits of the same values at aligned addresses."""
    x, w, dy = _tensors(shape, torch.bfloat16, layout, seed=50)
    wkw, dkw = dict(kernel_size=shape.k, **_geom(shape)), dict(input_size=(shape.h, shape.w), **_geom(shape))
    wgrad, dgrad = kernels.get("conv_wgrad", "tree"), kernels.get("conv_dgrad", "tree")
    ox, ow, ody = map(_at_odd_address, (x, w, dy))
    assert_bitwise_equal(wgrad(ox, ody, **wkw), wgrad(x, dy, **wkw), f"{shape.name} wgrad, unaligned")
    assert_bitwise_equal(dgrad(ow, ody, **dkw), dgrad(w, dy, **dkw), f"{shape.name} dgrad, unaligned")


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[8], PADDED[0]], ids=lambda s: s.name)
def test_wgrad_tile_shape_does_not_change_the_bits(shape, dtype, engine, cuda_sync):
    """The tile is a speed knob only: each element's mma sequence is the same in every tile, so every
    (BM, BN) gives the bits of the default choice."""
    x, _, dy = _tensors(shape, dtype, "channels_last", seed=40)
    g = conv_wgrad._check(x, dy, shape.k, shape.stride, shape.pad, shape.dilation)
    plan = conv_wgrad.half_plan   # what conv_wgrad hands conv_mma
    want = conv_mma.wgrad(x, dy, g, plan, atomic=False)
    for tile in ((64, 64), (64, 128), (128, 64), (128, 128)):
        got = conv_mma.wgrad(x, dy, g, plan, atomic=False, tile=tile)
        assert_bitwise_equal(got, want, f"{shape.name} tile {tile}")


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_dgrad_tile_shape_does_not_change_the_bits(shape, dtype, engine, cuda_sync):
    """The data gradient's tile and pipeline depth are speed knobs only (conv_mma.dgrad_tile): every (BM, BN)
    the engine has, and more shared-memory stages, give the bits of 128-row tiles, strided shapes (a launch
    per stride phase) and dilation included. (On wgmma the rule takes 64-row tiles for every test shape, so
    128-row tiles are checked here, bit for bit, rather than against the bound above.)"""
    _, w, dy = _tensors(shape, dtype, "channels_last", seed=60)
    g = conv_dgrad._check(w, dy, (shape.h, shape.w), shape.stride, shape.pad, shape.dilation)
    want = conv_mma.dgrad(w, dy, g, tile=(128, 128))
    tiles = ((128, 64), (64, 128), (64, 64)) if engine == "wgmma" else ((128, 64),)
    for tile in (*tiles, None):
        assert_bitwise_equal(conv_mma.dgrad(w, dy, g, tile=tile), want, f"{shape.name} tile {tile}")
    for tile in ((128, 128), (64, 64)) if engine == "wgmma" else ((128, 128),):
        got = conv_mma.dgrad(w, dy, g, tile=tile, stages=conv_mma.STAGES[engine] + 1)
        assert_bitwise_equal(got, want, f"{shape.name} tile {tile}, one stage more")
    with pytest.raises(ValueError, match="tile"):
        conv_mma.dgrad(w, dy, g, tile=(32, 64))
    with pytest.raises(ValueError, match="stages must be"):   # a pipeline too short to load ahead
        conv_mma.dgrad(w, dy, g, stages=conv_mma.MIN_STAGES[engine] - 1)
    if conv_mma.dgrad_smem(bn=128, bm=128, engine=engine, stages=conv_mma.MAX_STAGES) > conv_mma.SMEM_MAX:
        with pytest.raises(ValueError, match="shared memory"):   # wgmma: 8 x 64 x 256 halves, 256 KiB
            conv_mma.dgrad(w, dy, g, tile=(128, 128), stages=conv_mma.MAX_STAGES)


@pytest.mark.parametrize("tile", [None, (64, 64)])
def test_dgrad_takes_more_pixel_tiles_than_a_grid_row_holds(tile, engine, cuda_sync):
    """2 x 8 x 2100 x 2100 pixels are 68907 tiles of 128 rows (137813 of 64): more than gridDim.y's 65535,
    fine in the one grid dimension the launch uses. The result equals the float32 kernel's on widened
    tensors within the bound of the tests above (one tap, 8 output channels: a single instruction)."""
    if tile is not None and engine != "wgmma":
        pytest.skip("64-row tiles are the wgmma engine's")
    s = ConvShape("huge_1x1", 2, 8, 8, 1, 1, 0, 2100, 2100)
    _, w, dy = _tensors(s, torch.bfloat16, "channels_last", seed=61)
    g = conv_dgrad._check(w, dy, (s.h, s.w), s.stride, s.pad, s.dilation)
    assert -(-s.n * s.h * s.w // 128) > 65535
    got = conv_mma.dgrad(w, dy, g, tile=tile)
    assert_bitwise_equal(got, conv_mma.dgrad(w, dy, g, tile=(128, 64)), "tiles")
    exact = torch.einsum("oi,nohw->nihw", w[:, :, 0, 0].double(), dy.double())
    mags = torch.einsum("oi,nohw->nihw", w[:, :, 0, 0].double().abs(), dy.double().abs())
    _within(got, exact.cpu(), mags.cpu(), _instructions(s.cout, engine) * MMA_ERR, torch.bfloat16, "huge dgrad")
