"""conv_wgrad: CPU order models and GPU kernels against float64, determinism, argument checks.

Error bound (written here once, used by every accuracy test). A dw element is a float32 evaluation of
s = sum_k t_k, t_k = dy_k * col_k over K = N*OH*OW terms, cut into S chunks of at most Kc terms
(``plan``). Inside a chunk the terms are accumulated in float32 in some order (sequential FFMA on the
GPU, a BLAS kernel's order on the CPU): a term passes through at most Kc roundings (its product, then
at most Kc - 1 additions; an FMA fuses the two and only removes roundings). The chunk sums are then
combined: atomic adds them one after another (at most S - 1 additions), tree adds S/8 per group and
then 8 group sums (at most ceil(S/8) + 8). So no term passes through more than
depth = Kc + S + 9 roundings, and Higham's bound gives |fl(s) - s| <= gamma_depth * sum_k |t_k|, with
sum |t_k| = conv2d_weight(|x|, |dy|) computed in float64. The float64 reference adds its own error, at
most gamma_K(2^-53) * sum |t_k|, which is added to the bound. The inputs are float32 in both, so they
carry no representation error.

The ``winograd`` variant evaluates another expression (transforms, 16 GEMMs over 2x2 tiles, output
transform; kernels/conv_wgrad_winograd.cu), so its bound scales a different magnitude: the same
evaluation with every input and coefficient replaced by its absolute value (``magnitude``, float64),
with depth = 2 + 2 + Kc + S + 8 + 4 roundings on any path (``rounding_depth``). The same Higham argument
applies: each operation rounds once, relative to its exact result on the already-rounded operands.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import conv_wgrad_winograd as wino
from kernels.conv_wgrad import BK, GROUPS, MIN_CHUNK, WAVE_MIN_CHUNK, Geometry, Plan, _check, chunk_partials, plan, tree_combine
from kernels.runtime import KERNEL_DIR
from kernels.shapes import HOSTILE_CONV, RESNET18_CONV, ConvShape
from tests.helpers import assert_bitwise_equal, bitwise_equal, byte_hash, distinct, gamma

OP = "conv_wgrad"
SPEC = kernels.spec(OP)
VARIANTS = kernels.variants(OP)
DETERMINISTIC = [v for v in VARIANTS if v.deterministic]
ATOMIC = kernels.get(OP, "atomic")
TREE = kernels.get(OP, "tree")
WINOGRAD = kernels.get(OP, "winograd")
CASES = SPEC.test_cases()

# Tap tiles apply where Cin is a multiple of the tile width (64 or 128): the ResNet-18 shapes from
# 64 channels, and small hostile ones that reach every clamp of the valid rectangle: stride 2 on odd
# sizes, padding wider than the kernel, and a dilated kernel whose outer taps never meet the image; the
# first two split their reductions at chunk boundaries inside an image row.
TAP_SHAPES = [RESNET18_CONV[i] for i in (1, 3, 4, 5, 7, 10)] + [
    ConvShape("tap_odd_s2", 48, 128, 40, 3, 2, 1, 9, 9),
    ConvShape("tap_pad_gt_kernel", 32, 64, 24, 3, 1, 3, 6, 7),
    ConvShape("tap_dead_taps", 2, 64, 16, 3, 1, 4, 3, 3, 4),
    ConvShape("tap_k5_s2_batch1", 1, 64, 72, 5, 2, 2, 7, 11),
]


def case_params(cases):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.params.get("slow") else [])
            for c in cases]


def plan_of(variant, args, kwargs) -> Plan:
    x, dy = args
    m, r, k = dy.shape[1], x.shape[1] * kwargs["kernel_size"] ** 2, dy.shape[0] * dy.shape[2] * dy.shape[3]
    return plan(m, r, k, split=variant.name != "nosplit")


def geometry(args, kwargs) -> Geometry:
    return _check(*args, kwargs["kernel_size"], kwargs.get("stride", 1), kwargs.get("padding", 0),
                  kwargs.get("dilation", 1))


def winograd_applies(variant, args, kwargs) -> bool:
    return variant.name == "winograd" and wino.applies(geometry(args, kwargs))


def error_bound(variant, args, kwargs, mag=None) -> torch.Tensor:
    """Per-element bound on |dw - dw_float64| (module docstring). ``mag``: sum_k |dy_k * col_k| in float64
    if the caller has it (the direct evaluation's magnitude)."""
    x, dy = args
    k = dy.shape[0] * dy.shape[2] * dy.shape[3]
    ref_err = k * 2.0**-53 / (1 - k * 2.0**-53)
    if winograd_applies(variant, args, kwargs):
        g = geometry(args, kwargs)
        return (gamma(wino.rounding_depth(g)) + ref_err) * wino.magnitude(x, dy, g)
    p = plan_of(variant, args, kwargs)
    if mag is None:
        mag = SPEC.reference((x.abs(), dy.abs()), kwargs)
    return (gamma(p.chunk + p.splits + GROUPS + 1) + ref_err) * mag.cpu()


def assert_within_bound(got, ref, bound, what):
    err = (got.double().cpu() - ref.cpu()).abs()
    bad = err > bound.cpu()
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements outside the bound, first at "
                           f"{bad.nonzero()[:5].tolist()}; max err/bound {(err / bound.cpu()).max().item():.3g}")


def small_integer_inputs(case, device="cpu"):
    """Integers in [-3, 3]: every product and partial sum is an integer below 2^24 in magnitude, so any
    float32 evaluation is exact and a lost, repeated or misplaced term shows as an exact mismatch."""
    (x, dy), kw = SPEC.make_inputs(case, torch.device("cpu"))
    g = torch.Generator().manual_seed(case.seed + 1)
    fmt = torch.contiguous_format if case.params["layout"] == "nchw" else torch.channels_last
    xi = torch.randint(-3, 4, x.shape, generator=g).float().to(device, memory_format=fmt)
    dyi = torch.randint(-3, 4, dy.shape, generator=g).float().to(device, memory_format=fmt)
    return (xi, dyi), kw


# --------------------------------------------------------------------------------------------------
# The split plan


@pytest.mark.parametrize("shape", RESNET18_CONV + HOSTILE_CONV, ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 2, 64, 128])
def test_plan_covers_the_reduction(shape, batch):
    s = shape.with_batch(batch)
    _, _, oh, ow = s.y_shape
    m, r, k = s.cout, s.cin * s.k * s.k, batch * oh * ow
    for split in (True, False):
        p = plan(m, r, k, split=split)
        assert p.chunk % BK == 0 and p.splits >= 1
        assert (p.splits - 1) * p.chunk < k <= p.splits * p.chunk, p  # no empty chunk, nothing left over
        assert p.splits < 65536  # gridDim.z
        if split and p.splits > 1:   # the refit to whole waves takes chunks down to WAVE_MIN_CHUNK
            assert p.chunk >= (MIN_CHUNK if p == plan(m, r, k, waves=False) else WAVE_MIN_CHUNK), p
        if not split:
            assert p.splits == 1


def test_plan_takes_smaller_tiles_when_blocks_are_few():
    """128x128 tiles only where they give MIN_BLOCKS blocks; else 64x64 tiles and more, shorter chunks."""
    from kernels.conv_wgrad import MIN_BLOCKS, Plan

    assert plan(256, 128, 128 * 8 * 8) == Plan(64, 32, 256)  # 1x1 s2 128->256 at batch 128: 8 tiles x 32
    assert plan(512, 256, 128 * 4 * 4) == Plan(64, 8, 256)   # 1x1 s2 256->512: 32 tiles x 8
    assert plan(512, 4608, 2048) == Plan(128, 8, 256)         # 512->512 3x3 4x4: 144 tiles x 8, unchanged
    for s in RESNET18_CONV:
        p = plan(s.cout, s.cin * s.k * s.k, s.n * s.y_shape[2] * s.y_shape[3], waves=False)
        tiles = -(-s.cout // p.tile) * -(-(s.cin * s.k * s.k) // p.tile)
        assert p.tile == 64 or tiles * p.splits >= MIN_BLOCKS, (s.name, p)


@pytest.mark.parametrize("shape", RESNET18_CONV + HOSTILE_CONV, ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 2, 64, 128])
def test_half_plan_covers_the_reduction_in_whole_steps(shape, batch):
    """The tensor-core split: whole K-steps of either engine, no empty chunk, nothing left over, chunks of
    at least HALF_MIN_CHUNK terms where the reduction is cut at all, about HALF_TARGET_BLOCKS blocks of the
    kernels' own tiles at most (fewer where the chunks would get shorter)."""
    from kernels import conv_mma
    from kernels.conv_wgrad import HALF_MIN_CHUNK, HALF_STEP, HALF_TARGET_BLOCKS, half_plan

    s = shape.with_batch(batch)
    m, r, k = s.cout, s.cin * s.k * s.k, batch * s.y_shape[2] * s.y_shape[3]
    p = half_plan(m, r, k)
    assert HALF_STEP % conv_mma.WG_BK == 0 and HALF_STEP % conv_mma.BK == 0
    assert p.chunk % HALF_STEP == 0 and p.splits >= 1
    assert (p.splits - 1) * p.chunk < k <= p.splits * p.chunk, p
    assert p.splits == 1 or p.chunk >= HALF_MIN_CHUNK, p
    bm, bn = conv_mma.wgrad_tile(m, r)
    tiles = -(-m // bm) * -(-r // bn)
    assert p.splits <= max(1, -(-HALF_TARGET_BLOCKS // tiles)), p


def test_tensor_core_inputs_at_unaligned_addresses_are_copied_to_aligned_memory():
    """conv_mma's kernels load 16 bytes at a time: an input view that starts at an odd element is copied
    (same values, same layout, a 16-byte aligned address); an aligned one is passed through as it is."""
    from kernels import conv_mma

    flat = torch.arange(2 * 16 * 5 * 5 + 1, dtype=torch.float32).to(torch.bfloat16)
    odd = flat[1:].view(2, 5, 5, 16).permute(0, 3, 1, 2)   # channels_last, 2 bytes past an aligned start
    assert odd.is_contiguous(memory_format=torch.channels_last) and odd.data_ptr() % 16 == 2
    got = conv_mma._cl(odd)
    assert got.data_ptr() % 16 == 0 and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, odd) and got.stride() == odd.stride()
    aligned = flat[:-1].view(2, 5, 5, 16).permute(0, 3, 1, 2)
    assert aligned.data_ptr() % 16 == 0 and conv_mma._cl(aligned).data_ptr() == aligned.data_ptr()
    w = flat[1:].view(16, 2, 5, 5)   # the data gradient's weight, contiguous in its permuted order
    assert conv_mma._aligned(w).data_ptr() % 16 == 0 and torch.equal(conv_mma._aligned(w), w)


def test_half_plan_cuts_long_reductions_into_fewer_chunks_than_the_float32_plan():
    """ResNet-50's 3x3 64->64 at 56x56, batch 64: 105 chunks of 1920 terms on tensor cores against the
    float32 rule's 224 of 896; a deep 3x3 512->512 at 7x7: 3 chunks against 8."""
    from kernels.conv_wgrad import half_plan

    assert half_plan(64, 576, 64 * 56 * 56) == Plan(128, 105, 1920)
    assert plan(64, 576, 64 * 56 * 56, waves=False).splits == 224
    assert half_plan(512, 4608, 64 * 7 * 7) == Plan(128, 3, 1088)
    assert plan(512, 4608, 64 * 7 * 7, waves=False).splits == 8


@pytest.mark.parametrize("batch", [64, 128])
def test_plan_refits_few_blocks_to_whole_waves(batch):
    """A base plan of at most WAVE_PLAN_MAX blocks is re-split to fill one wave (up to ONE_WAVE_TILES
    tiles) or two, with chunks of at least WAVE_MIN_CHUNK terms; a plan with more blocks is kept; the tile
    size is the base plan's."""
    from kernels.conv_wgrad import ONE_WAVE_TILES, WAVE_BLOCKS, WAVE_PLAN_MAX

    refit = 0
    for s in RESNET18_CONV:
        s = s.with_batch(batch)
        m, r, k = s.cout, s.cin * s.k * s.k, batch * s.y_shape[2] * s.y_shape[3]
        base, p = plan(m, r, k, waves=False), plan(m, r, k)
        tiles = -(-m // base.tile) * -(-r // base.tile)
        assert p.tile == base.tile
        if tiles * base.splits > WAVE_PLAN_MAX:
            assert p == base, s.name
            continue
        waves = 1 if tiles <= ONE_WAVE_TILES else 2
        assert tiles * p.splits <= waves * WAVE_BLOCKS, (s.name, p)
        assert p.splits == 1 or p.chunk >= WAVE_MIN_CHUNK, (s.name, p)
        refit += p != base
    assert refit >= 3   # the deep layers at these batches do change


@pytest.mark.parametrize("shape", HOSTILE_CONV + tuple(TAP_SHAPES), ids=lambda s: s.name)
def test_tap_walk_visits_the_valid_terms_of_its_chunk_in_order(shape):
    """A tap tile's compacted walk (the kernel's index arithmetic, mirrored by ``tap_walk``) visits, for
    every tap and every chunk of the plan (and chunks cut at odd places), exactly the k of the chunk
    whose input pixel for that tap is inside the image, in ascending order: the terms it skips are the
    padding's zeros and nothing else."""
    s = shape.with_batch(3)
    g = Geometry(s.n, s.cin, s.h, s.w, s.cout, *s.y_shape[2:], s.k, s.k, s.stride, s.stride, s.pad, s.pad,
                 s.dilation, s.dilation)
    _check_tap_walk(g)


# (N, H, W, KH, KW, SH, SW, PH, PW, DH, DW): every pair differs between the two axes, so a walk that
# mixed them up (a kh where a kw belongs, a stride of the other axis) would visit the wrong k
ASYMMETRIC = [(2, 7, 11, 3, 5, 1, 2, 2, 1, 2, 1), (3, 9, 4, 1, 3, 2, 1, 0, 3, 1, 2), (1, 5, 13, 5, 2, 3, 1, 4, 0, 1, 3)]


@pytest.mark.parametrize("dims", ASYMMETRIC, ids=str)
def test_tap_walk_keeps_the_two_axes_apart(dims):
    n, h, w, kh, kw, sh, sw, ph, pw, dh, dw = dims
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    _check_tap_walk(Geometry(n, 64, h, w, 64, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw))


def _check_tap_walk(g: Geometry) -> None:
    from kernels.conv_wgrad import tap_walk

    k = np.arange(g.k)
    oh, ow = (k % (g.oh * g.ow)) // g.ow, k % g.ow
    p = plan(g.m, g.r, g.k)
    cuts = sorted({0, g.k, *range(0, g.k, p.chunk), *range(0, g.k, 13)})
    for tap in range(g.kh * g.kw):
        ih, iw = oh * g.sh + (tap // g.kw) * g.dh - g.ph, ow * g.sw + (tap % g.kw) * g.dw - g.pw
        valid = (ih >= 0) & (ih < g.h) & (iw >= 0) & (iw < g.w)
        for a, b in zip(cuts, cuts[1:]):
            want = k[a:b][valid[a:b]]
            assert np.array_equal(tap_walk(g, tap, a, b), want), (g, tap, a, b)


def test_tree_combine_is_the_documented_order():
    """8 strided groups (group j adds partials j, j + 8, ... one after another), then the group sums in
    index order, every addition rounded to float32; written out with scalars."""
    rng = np.random.default_rng(7)
    for s in (2, 7, 8, 13, 64, 115):
        partials = (rng.standard_normal((s, 5)) * 10.0 ** rng.integers(-3, 4, (s, 5))).astype(np.float32)
        got = tree_combine(partials)
        for e in range(partials.shape[1]):
            groups = []
            for j in range(GROUPS):
                acc = np.float32(0.0)
                for i in range(j, s, GROUPS):
                    acc = np.float32(acc + partials[i, e])
                groups.append(acc)
            total = np.float32(0.0)
            for v in groups:
                total = np.float32(total + v)
            assert got[e].tobytes() == total.tobytes(), (s, e)


def test_chunk_partials_are_the_chunk_sums():
    """Chunk 0's partial is the product restricted to the first Kc output pixels, and the partials add
    up to the whole; each is a float32 sum of at most Kc terms, so within gamma_Kc * sum |t| of float64."""
    case = next(c for c in CASES if c.name == "stem3x3_3-64_32_n1")
    (x, dy), kw = SPEC.make_inputs(case, torch.device("cpu"))
    g = Geometry(1, 3, 32, 32, 64, 32, 32, 3, 3, 1, 1, 1, 1, 1, 1)
    p = plan(g.m, g.r, g.k)
    assert p.splits > 1
    parts = torch.from_numpy(chunk_partials(x, dy, g, p)).double()
    mag = SPEC.reference((x.abs(), dy.abs()), kw).reshape(-1)
    total = SPEC.reference((x, dy), kw).reshape(-1)
    assert ((parts.sum(0) - total).abs() <= gamma(p.chunk) * mag + gamma(p.splits) * mag).all()
    dy0 = dy.clone()
    dy0.view(1, 64, -1)[:, :, p.chunk:] = 0  # k = oh * 32 + ow at batch 1
    mag0 = SPEC.reference((x.abs(), dy0.abs()), kw).reshape(-1)
    chunk0 = SPEC.reference((x, dy0), kw).reshape(-1)
    assert ((parts[0] - chunk0).abs() <= gamma(p.chunk) * mag0).all()
    assert not torch.equal(parts[0], total)


# --------------------------------------------------------------------------------------------------
# CPU order models


@pytest.mark.parametrize("case", case_params(CASES))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_against_float64(variant, case):
    args, kw = SPEC.make_inputs(case, torch.device("cpu"))
    got = variant(*args, rng=case.seed, **kw)
    ref = SPEC.reference(args, kw)
    assert got.shape == ref.shape and got.dtype == torch.float32 and got.is_contiguous()
    assert_within_bound(got, ref, error_bound(variant, args, kw), f"{variant.key} {case.name}")


@pytest.mark.parametrize("case", case_params([c for c in CASES if not c.params.get("slow")]))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_model_exact_on_small_integers(variant, case):
    args, kw = small_integer_inputs(case)
    got = variant(*args, rng=1, **kw)
    assert bitwise_equal(got.double(), SPEC.reference(args, kw)), f"{variant.key} {case.name}"


def test_bound_rejects_a_wrong_model():
    """Negative control for the bound: dropping the last chunk partial must fail it."""
    case = next(c for c in CASES if c.name == "conv3x3_64-64_32_n1")
    args, kw = SPEC.make_inputs(case, torch.device("cpu"))
    x, dy = args
    g = Geometry(1, 64, 32, 32, 64, 32, 32, 3, 3, 1, 1, 1, 1, 1, 1)
    p = plan(g.m, g.r, g.k)
    assert p.splits > 1
    wrong = torch.from_numpy(tree_combine(chunk_partials(x, dy, g, p)[:-1]).reshape(64, 64, 3, 3))
    with pytest.raises(AssertionError):
        assert_within_bound(wrong, SPEC.reference(args, kw), error_bound(TREE, args, kw), "dropped chunk")


@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
def test_deterministic_models_are_bitwise_stable(variant):
    case = next(c for c in CASES if c.name == "conv3x3_64-64_32_n1")
    args, kw = SPEC.make_inputs(case, torch.device("cpu"))
    assert len({byte_hash(variant(*args, rng=seed, **kw)) for seed in range(5)}) == 1


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_models_do_not_depend_on_layout(variant):
    """The models reduce in the same k order whatever the memory layout: NCHW and channels_last inputs
    give the same bits (atomic with the same arrival-order seed)."""
    for shape in HOSTILE_CONV[:3] + (RESNET18_CONV[1].with_batch(2),):
        gen = torch.Generator().manual_seed(11)
        x, dy = torch.randn(shape.x_shape, generator=gen), torch.randn(shape.y_shape, generator=gen)
        kw = {"kernel_size": shape.k, "stride": shape.stride, "padding": shape.pad, "dilation": shape.dilation}
        a = variant(x, dy, rng=3, **kw)
        b = variant(x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last), rng=3, **kw)
        assert_bitwise_equal(a, b, f"{variant.key} {shape.name}")


def test_atomic_model_varies_across_arrival_orders():
    """Negative control: the 3->64 stem at batch 8 splits K = 8192 into 64 chunks (one wave of its one
    tile), so each element adds 64 partials, and their arrival order shows in the bits."""
    shape = RESNET18_CONV[0].with_batch(8)
    gen = torch.Generator().manual_seed(5)
    x, dy = torch.randn(shape.x_shape, generator=gen), torch.randn(shape.y_shape, generator=gen)
    kw = {"kernel_size": 3, "padding": 1}
    assert plan(64, 27, 8 * 32 * 32).splits == 64
    outs = [ATOMIC(x, dy, rng=seed, **kw) for seed in range(5)]
    assert distinct(outs) > 1
    assert_bitwise_equal(ATOMIC(x, dy, rng=3, **kw), outs[3], "a seeded arrival order is reproducible")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_empty_batch_gives_zeros(variant):
    x, dy = torch.randn(0, 4, 6, 6), torch.randn(0, 5, 6, 6)
    got = variant(x, dy, kernel_size=3, padding=1)
    ref = torch.nn.grad.conv2d_weight(x, (5, 4, 3, 3), dy, padding=1)
    assert got.shape == (5, 4, 3, 3) and bitwise_equal(got, ref)


# --------------------------------------------------------------------------------------------------
# winograd: F(3, 2) transforms, plan, fallback


def _f32(*v):
    return [np.float32(e) for e in v]


def test_winograd_transforms_are_the_documented_order():
    """One tile written out with float32 scalars, one rounding per operation, in the .cu file's order:
    V = rows then columns of (e0 - e2, e1 + e2, e2 - e1, e1 - e3); U = rows then columns of
    (e0, e0 + e1, e0 - e1, -e1); dw = rows then columns of (e0 + h(e1 + e2), h(e1 - e2), h(e1 + e2) + e3)."""
    rng = np.random.default_rng(3)
    d = (rng.standard_normal((4, 4)) * 10.0 ** rng.integers(-4, 5, (4, 4))).astype(np.float32)
    gt = (rng.standard_normal((2, 2)) * 10.0 ** rng.integers(-4, 5, (2, 2))).astype(np.float32)
    g = Geometry(1, 1, 4, 4, 1, 2, 2, 3, 3, 1, 1, 0, 0, 1, 1)   # one 2x2 tile, no padding
    v = wino.input_transform(torch.from_numpy(d).reshape(1, 1, 4, 4), g).reshape(4, 4)
    u = wino.dy_transform(torch.from_numpy(gt).reshape(1, 1, 2, 2), g).reshape(4, 4)

    def bt(e0, e1, e2, e3):
        return [e0 - e2, e1 + e2, e2 - e1, e1 - e3]

    def a(e0, e1):
        return [e0, e0 + e1, e0 - e1, -e1]

    s = [bt(*_f32(*d[:, j])) for j in range(4)]              # s[j][a]
    for i in range(4):
        assert [x.tobytes() for x in bt(*[s[j][i] for j in range(4)])] == [x.tobytes() for x in v[i]]
    r = [a(*_f32(*gt[:, j])) for j in range(2)]
    for i in range(4):
        assert [x.tobytes() for x in a(r[0][i], r[1][i])] == [x.tobytes() for x in u[i]]

    m = (rng.standard_normal((16, 1, 1)) * 10.0 ** rng.integers(-4, 5, (16, 1, 1))).astype(np.float32)
    w = wino.output_transform(m).reshape(3, 3)
    h = np.float32(0.5)

    def gtf(e0, e1, e2, e3):
        return [e0 + h * (e1 + e2), h * (e1 - e2), h * (e1 + e2) + e3]

    mm = m.reshape(4, 4)
    z = [gtf(*mm[:, b]) for b in range(4)]                   # z[b][r]
    for r_ in range(3):
        assert [x.tobytes() for x in gtf(*[z[b][r_] for b in range(4)])] == [x.tobytes() for x in w[r_]]


@pytest.mark.parametrize("shape", [s for s in RESNET18_CONV + HOSTILE_CONV if s.k == 3 and s.stride == 1
                                   and s.dilation == 1], ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 2, 128, 1024])
def test_winograd_plan_covers_the_tiles(shape, batch):
    s = shape.with_batch(batch)
    _, _, oh, ow = s.y_shape
    t = batch * -(-oh // 2) * -(-ow // 2)
    p = wino.plan(s.cout, s.cin, t)
    assert p.chunk % BK == 0 and (p.splits - 1) * p.chunk < t <= p.splits * p.chunk, p
    assert 16 * p.splits <= 65535


def test_winograd_runs_tree_where_it_does_not_apply():
    """1x1, strided, 7x7, dilated and few-channel shapes: winograd is tree, bit for bit (CPU models)."""
    for shape in (HOSTILE_CONV[0], HOSTILE_CONV[1], HOSTILE_CONV[5], HOSTILE_CONV[6], RESNET18_CONV[3].with_batch(2),
                  RESNET18_CONV[0].with_batch(2), HOSTILE_CONV[4]):   # the last two: too few channels
        gen = torch.Generator().manual_seed(4)
        x, dy = torch.randn(shape.x_shape, generator=gen), torch.randn(shape.y_shape, generator=gen)
        kw = {"kernel_size": shape.k, "stride": shape.stride, "padding": shape.pad, "dilation": shape.dilation}
        assert not winograd_applies(WINOGRAD, (x, dy), kw)
        assert_bitwise_equal(WINOGRAD(x, dy, **kw), TREE(x, dy, **kw), shape.name)


WINO_SMALL = [s for s in HOSTILE_CONV if s.k == 3 and s.stride == 1 and s.dilation == 1] + \
    [RESNET18_CONV[0].with_batch(2), RESNET18_CONV[1].with_batch(1)]


@pytest.mark.parametrize("shape", WINO_SMALL, ids=lambda s: s.name)
def test_winograd_path_on_small_and_hostile_shapes(shape, monkeypatch):
    """The F(3, 2) path itself (MIN_CHANNELS lowered to 1) on padding larger than half the kernel, a 1x1
    input, odd output sizes and 3-4 channels: within its bound, exact on small integers, and the same
    bits for both layouts."""
    monkeypatch.setattr(wino, "MIN_CHANNELS", 1)
    gen = torch.Generator().manual_seed(21)
    x, dy = torch.randn(shape.x_shape, generator=gen), torch.randn(shape.y_shape, generator=gen)
    kw = {"kernel_size": 3, "stride": 1, "padding": shape.pad, "dilation": 1}
    assert winograd_applies(WINOGRAD, (x, dy), kw)
    got = WINOGRAD(x, dy, **kw)
    assert_within_bound(got, SPEC.reference((x, dy), kw), error_bound(WINOGRAD, (x, dy), kw), shape.name)
    cl = WINOGRAD(x.to(memory_format=torch.channels_last), dy.to(memory_format=torch.channels_last), **kw)
    assert_bitwise_equal(cl, got, f"{shape.name} channels_last")
    xi, dyi = torch.randint(-3, 4, x.shape, generator=gen).float(), torch.randint(-3, 4, dy.shape, generator=gen).float()
    assert bitwise_equal(WINOGRAD(xi, dyi, **kw).double(), SPEC.reference((xi, dyi), kw)), shape.name


@pytest.mark.gpu
@pytest.mark.parametrize("shape", WINO_SMALL, ids=lambda s: s.name)
def test_gpu_winograd_path_on_small_and_hostile_shapes(shape, monkeypatch):
    monkeypatch.setattr(wino, "MIN_CHANNELS", 1)
    gen = torch.Generator().manual_seed(22)
    x, dy = torch.randn(shape.x_shape, generator=gen), torch.randn(shape.y_shape, generator=gen)
    kw = {"kernel_size": 3, "stride": 1, "padding": shape.pad, "dilation": 1}
    got = WINOGRAD(x.cuda(), dy.cuda(), **kw)
    again = [WINOGRAD(x.cuda(), dy.cuda(), **kw) for _ in range(10)]
    cl = WINOGRAD(x.cuda().to(memory_format=torch.channels_last), dy.cuda().to(memory_format=torch.channels_last), **kw)
    torch.cuda.synchronize()
    assert_within_bound(got.cpu(), SPEC.reference((x, dy), kw), error_bound(WINOGRAD, (x, dy), kw), shape.name)
    for a in again:
        assert bitwise_equal(a, got), shape.name
    assert_bitwise_equal(cl, got, f"{shape.name} channels_last")
    xi, dyi = torch.randint(-3, 4, x.shape, generator=gen).float(), torch.randint(-3, 4, dy.shape, generator=gen).float()
    assert bitwise_equal(WINOGRAD(xi.cuda(), dyi.cuda(), **kw).double().cpu(), SPEC.reference((xi, dyi), kw)), shape.name


def test_winograd_bound_rejects_a_wrong_model():
    """Negative controls for the winograd bound: losing one of the 16 GEMMs, or one chunk partial,
    must fail it."""
    case = next(c for c in CASES if c.name == "conv3x3_64-64_32_n1")
    args, kw = SPEC.make_inputs(case, torch.device("cpu"))
    x, dy = args
    g = geometry(args, kw)
    p = wino.plan(g.cout, g.cin, wino.tiles(g)[2])
    part = wino.chunk_partials(wino.dy_transform(dy, g), wino.input_transform(x, g), p)
    m = tree_combine(part.reshape(p.splits, -1)).reshape(16, g.cout, g.cin)
    bound = error_bound(WINOGRAD, args, kw)
    ref = SPEC.reference(args, kw)
    assert_within_bound(torch.from_numpy(wino.output_transform(m)), ref, bound, "the model itself")
    m_bad = m.copy()
    m_bad[5] = 0.0
    with pytest.raises(AssertionError):
        assert_within_bound(torch.from_numpy(wino.output_transform(m_bad)), ref, bound, "lost GEMM")
    # half the batch of tiles lost: the last chunk of a two-chunk plan on batch 2
    args2, kw2 = SPEC.make_inputs(kernels.Case(OP, "b2", dict(case.params, n=2), seed=9), torch.device("cpu"))
    g2 = geometry(args2, kw2)
    p2 = wino.plan(g2.cout, g2.cin, wino.tiles(g2)[2])
    assert p2.splits > 1
    part2 = wino.chunk_partials(wino.dy_transform(args2[1], g2), wino.input_transform(args2[0], g2), p2)
    m2 = tree_combine(part2[:-1].reshape(p2.splits - 1, -1)).reshape(16, g2.cout, g2.cin)
    with pytest.raises(AssertionError):
        assert_within_bound(torch.from_numpy(wino.output_transform(m2)), SPEC.reference(args2, kw2),
                            error_bound(WINOGRAD, args2, kw2), "dropped chunk")


# --------------------------------------------------------------------------------------------------
# Argument checks (before any launch)


def _good():
    return torch.randn(2, 3, 8, 8), torch.randn(2, 4, 8, 8), {"kernel_size": 3, "padding": 1}


BAD = {
    "x float64": (lambda x, dy, kw: ((x.double(), dy), kw), "x"),
    "dy float16": (lambda x, dy, kw: ((x, dy.half()), kw), "dy"),
    "x 3-D": (lambda x, dy, kw: ((x[0], dy), kw), "x"),
    "x not a tensor": (lambda x, dy, kw: ((x.numpy(), dy), kw), "x"),
    "dy batch": (lambda x, dy, kw: ((x, dy[:1]), kw), "dy"),
    "dy spatial": (lambda x, dy, kw: ((x, dy[:, :, :7].contiguous()), kw), "dy"),
    "dy for stride 2": (lambda x, dy, kw: ((x, dy), {**kw, "stride": 2}), "dy"),
    "x strided": (lambda x, dy, kw: ((torch.randn(2, 3, 8, 16)[..., ::2], dy), kw), "x"),
    "dy transposed": (lambda x, dy, kw: ((x, dy.transpose(2, 3)), kw), "dy"),
    "kernel_size 0": (lambda x, dy, kw: ((x, dy), {**kw, "kernel_size": 0}), "kernel_size"),
    "kernel_size 3-tuple": (lambda x, dy, kw: ((x, dy), {**kw, "kernel_size": (3, 3, 3)}), "kernel_size"),
    "kernel_size float": (lambda x, dy, kw: ((x, dy), {**kw, "kernel_size": 3.0}), "kernel_size"),
    "kernel larger than input": (lambda x, dy, kw: ((x, dy), {"kernel_size": 11}), "kernel_size"),
    "stride 0": (lambda x, dy, kw: ((x, dy), {**kw, "stride": 0}), "stride"),
    "stride bool": (lambda x, dy, kw: ((x, dy), {**kw, "stride": True}), "stride"),
    "padding -1": (lambda x, dy, kw: ((x, dy), {**kw, "padding": -1}), "padding"),
    "dilation 0": (lambda x, dy, kw: ((x, dy), {**kw, "dilation": (1, 0)}), "dilation"),
    "dy on another device": (lambda x, dy, kw: ((x, dy.to("meta")), kw), "dy"),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_bad_arguments_raise(variant, name):
    make, arg = BAD[name]
    args, kw = make(*_good())
    with pytest.raises(KernelArgumentError) as info:
        variant.cpu(*args, **kw)
    assert info.value.op == OP and info.value.arg == arg, str(info.value)


def test_good_arguments_pass():
    """The base of the table above is valid (so each row fails for its own reason)."""
    x, dy, kw = _good()
    for v in VARIANTS:
        assert v(x, dy, **kw).shape == (4, 3, 3, 3)
        assert v(x, dy, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=1).shape == (4, 3, 3, 3)


def test_registry_rows():
    rows = {v.name: v for v in VARIANTS}
    assert set(rows) == {"atomic", "tree", "nosplit", "winograd"}
    assert not rows["atomic"].deterministic and all(rows[n].deterministic for n in ("tree", "nosplit", "winograd"))
    assert not any(v.cpu_bitexact or v.order_independent for v in VARIANTS)  # FFMA inside a chunk


def test_fused_combine_choice(monkeypatch):
    from kernels import conv_wgrad

    def geom(s):
        _, _, oh, ow = s.y_shape
        return conv_wgrad.Geometry(s.n, s.cin, s.h, s.w, s.cout, oh, ow, s.k, s.k, s.stride, s.stride, s.pad,
                                   s.pad, 1, 1)

    chosen = {s.name: conv_wgrad.fused(geom(s), plan(s.cout, s.cin * s.k * s.k, s.n * s.y_shape[2] * s.y_shape[3]))
              for s in RESNET18_CONV}
    assert [name for name, f in chosen.items() if f] == ["conv3x3_512-512_4"]  # the one shape it pays on (H200)
    monkeypatch.setattr(conv_wgrad, "FUSE", "sometimes")
    with pytest.raises(ValueError, match="FUSE"):
        conv_wgrad.fused(geom(RESNET18_CONV[10]), plan(512, 4608, 2048))


def test_wide_tiles_run_only_plans_of_64_row_tiles(monkeypatch):
    """Wide kernels take a plan of 64x64 tiles for M <= 64 and R > 128 (64x192 where one tile spans R, 64x128
    above), never the fused combine, a 128-tile plan or the registers style; the plan itself is untouched."""
    from kernels import conv_wgrad

    def choice(m, r, k, name="split"):
        g = Geometry(1, r, 8, 8, m, 8, 8, 1, 1, 1, 1, 0, 0, 1, 1)   # a 1x1 conv: R = Cin
        return conv_wgrad.wide_tile(g, plan(m, r, k), name)

    assert choice(64, 147, 401408) == ("t64w", 192)
    assert choice(64, 192, 401408) == ("t64w", 192)
    assert choice(64, 576, 401408) == ("t64m", 128)
    assert choice(40, 216, 4096) == ("t64m", 128)
    assert choice(64, 128, 401408) is None and choice(64, 64, 401408) is None     # R <= 128: 64x64 tiles
    assert choice(128, 576, 401408) is None                                        # M > 64: 128x128 tiles
    assert choice(64, 576, 401408, "fused") is None
    monkeypatch.setattr(conv_wgrad, "WIDE", "t64w")
    assert choice(64, 576, 401408) == ("t64w", 192)
    monkeypatch.setattr(conv_wgrad, "KERNEL_STYLE", "r")
    assert choice(64, 576, 401408) is None
    monkeypatch.setattr(conv_wgrad, "KERNEL_STYLE", "s")
    monkeypatch.setattr(conv_wgrad, "WIDE", "")
    assert choice(64, 576, 401408) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cu_compiles_with_nvcc():
    src = KERNEL_DIR / "conv_wgrad.cu"
    res = subprocess.run(["nvcc", "-arch=sm_90", f"-I{KERNEL_DIR}", "-c", "-o", "/dev/null", str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------------------------------
# GPU kernels

GPU_SHAPES = [RESNET18_CONV[i] for i in (0, 1, 3, 5, 10, 11)]  # both stems, 32x32, 1x1 s2, s2, 4x4


def gpu_case(shape, layout="nchw"):
    return next(c for c in SPEC.bench_cases("gpu") if c.params["cin"] == shape.cin and
                c.params["cout"] == shape.cout and c.params["k"] == shape.k and
                c.params["stride"] == shape.stride and c.params["h"] == shape.h and c.params["layout"] == layout)


def gpu_reference(args, kw):
    """float64 on the GPU (same exact sum as the CPU reference up to float64 rounding, far faster)."""
    x, dy = args
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        ref = torch.nn.grad.conv2d_weight(x.double(), (dy.shape[1], x.shape[1], kw["kernel_size"], kw["kernel_size"]),
                                          dy.double(), stride=kw["stride"], padding=kw["padding"],
                                          dilation=kw["dilation"])
        mag = torch.nn.grad.conv2d_weight(x.double().abs(), ref.shape, dy.double().abs(), stride=kw["stride"],
                                          padding=kw["padding"], dilation=kw["dilation"])
    return ref, mag


def gpu_bound(variant, args, kw, mag):
    return error_bound(variant, args, kw, mag)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", RESNET18_CONV, ids=lambda s: s.name)
def test_gpu_within_bound_of_float64(shape, layout):
    args, kw = SPEC.make_inputs(gpu_case(shape, layout), torch.device("cuda"))
    ref, mag = gpu_reference(args, kw)
    for v in VARIANTS:
        got = v(*args, **kw)
        torch.cuda.synchronize()
        assert got.is_cuda and got.shape == ref.shape and got.is_contiguous()
        assert_within_bound(got, ref, gpu_bound(v, args, kw, mag), f"{v.key} {shape.name} {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", case_params([c for c in CASES if not c.params.get("slow")]))
def test_gpu_exact_on_small_integers(case):
    args, kw = small_integer_inputs(case, "cuda")
    ref = SPEC.reference(args, kw)
    for v in VARIANTS:
        got = v(*args, **kw)
        torch.cuda.synchronize()
        assert bitwise_equal(got.double().cpu(), ref), f"{v.key} {case.name}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
def test_gpu_deterministic_over_repeats(variant, shape):
    args, kw = SPEC.make_inputs(gpu_case(shape), torch.device("cuda"))
    first = variant(*args, **kw)
    outs = [variant(*args, **kw) for _ in range(50)]
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert bitwise_equal(o, first), f"{variant.key} {shape.name}: repeat {i} differs"


@pytest.mark.gpu
def test_gpu_atomic_varies_on_the_contended_stem():
    """Measured negative control: the 3->64 stem at batch 128 combines 256 chunk partials per element
    with atomicAdd; over 20 repeats the bits must change at least once."""
    shape = RESNET18_CONV[0]
    args, kw = SPEC.make_inputs(gpu_case(shape), torch.device("cuda"))
    assert plan(64, 27, 128 * 32 * 32).splits >= 256
    outs = [ATOMIC(*args, **kw) for _ in range(20)]
    torch.cuda.synchronize()
    assert distinct(outs) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_gpu_side_stream(variant):
    """Launches go to torch's current stream: on a side stream the deterministic variants give the bits
    of the default stream, and every variant's result is complete once that stream is synchronized."""
    args, kw = SPEC.make_inputs(gpu_case(RESNET18_CONV[1]), torch.device("cuda"))
    base = variant(*args, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = variant(*args, **kw)
        other_copy = other.clone()  # ordered after the kernels on the side stream
    side.synchronize()
    ref, mag = gpu_reference(args, kw)
    assert_within_bound(other_copy, ref, gpu_bound(variant, args, kw, mag), f"{variant.key} side stream")
    if variant.deterministic:
        assert bitwise_equal(base, other_copy)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
def test_gpu_layouts_give_the_same_bits(variant):
    """Strides change the addresses, never the order of the arithmetic."""
    cases = [gpu_case(RESNET18_CONV[2]), gpu_case(RESNET18_CONV[11])]
    cases += [c for c in CASES if c.name in ("odd_s2_n2", "dilation2_n2", "c3_k7_s2_p3_n2")]
    for case in cases:
        args, kw = SPEC.make_inputs(case, torch.device("cuda"))
        cl = tuple(a.to(memory_format=torch.channels_last) for a in args)
        assert_bitwise_equal(variant(*args, **kw), variant(*cl, **kw), f"{variant.key} {case.name}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DETERMINISTIC, ids=lambda v: v.name)
def test_gpu_kernel_styles_give_the_same_bits(variant, monkeypatch):
    """Row constants in registers ("r") or shared memory ("s", and "cl" for channels_last inputs; tap tiles
    where Cin is a multiple of the tile, whose skipped terms are zeros) move loads around, never the
    arithmetic of an output element."""
    from kernels import conv_wgrad

    for shape in (RESNET18_CONV[0], RESNET18_CONV[4], RESNET18_CONV[8]):
        for layout in ("nchw", "channels_last"):
            args, kw = SPEC.make_inputs(gpu_case(shape, layout), torch.device("cuda"))
            monkeypatch.setattr(conv_wgrad, "KERNEL_STYLE", "s")
            shipped = variant(*args, **kw)
            monkeypatch.setattr(conv_wgrad, "KERNEL_STYLE", "r")
            assert_bitwise_equal(variant(*args, **kw), shipped, f"{variant.key} {shape.name} {layout}")


TAP_SUFFIXES = ("_ts", "_tc", "_ts_a", "_tc_a")   # tap-tile kernels, register or cp.async stages


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_tap_tiles_give_the_same_bits(layout, monkeypatch):
    """Tap tiles skip exactly the padding terms (+-0, which only a -0.0 sum would notice, and every way out
    of the GEMM adds +0.0): on finite inputs every deterministic variant gives the bits of the full walk,
    through the fused and separate combines and the unsplit store; atomic on small integers (exact in any
    order) gives the same sums. A spy checks that the full walk ran no tap kernel and the tap run did, so
    the comparison cannot pass by running the same kernel twice. Wide tiles (which have no tap tiles) are off."""
    from kernels import conv_wgrad

    ran = []
    real = conv_wgrad.function
    monkeypatch.setattr(conv_wgrad, "function", lambda src, name, dev, *a, **k: (ran.append(name), real(
        src, name, dev, *a, **k))[1])
    monkeypatch.setattr(conv_wgrad, "WIDE", "")
    for i, shape in enumerate(TAP_SHAPES):
        case = conv_wgrad._case(shape, 4100 + i, layout)
        args, kw = SPEC.make_inputs(case, torch.device("cuda"))
        exact, _ = small_integer_inputs(case, "cuda")
        for name, variant, inputs in [(v.name, v, args) for v in DETERMINISTIC] + [("atomic", ATOMIC, exact)]:
            for fuse in (("separate", "fused") if name == "tree" else ("auto",)):
                monkeypatch.setattr(conv_wgrad, "FUSE", fuse)
                what = f"{name} {fuse} {case.name}"
                direct = name != "winograd" or not wino.applies(geometry(inputs, kw))
                monkeypatch.setattr(conv_wgrad, "TAP_TILES", False)
                ran.clear()
                full = variant(*inputs, **kw)
                assert not any(n.endswith(TAP_SUFFIXES) for n in ran), f"{what}: a tap kernel ran ({ran})"
                assert ran or not direct, f"{what}: no GEMM kernel ran"
                monkeypatch.setattr(conv_wgrad, "TAP_TILES", True)
                ran.clear()
                tapped = variant(*inputs, **kw)
                torch.cuda.synchronize()
                if direct:
                    assert any(n.endswith(TAP_SUFFIXES) for n in ran), f"{what}: no tap kernel ran ({ran})"
                assert_bitwise_equal(tapped, full, what)


# weight gradients of at most 64 output channels with R > 128: wide-tile kernels (conv_wgrad.WIDE)
WIDE_SHAPES = [RESNET18_CONV[i] for i in (1, 11)] + [
    ConvShape("wide_m40_r216", 16, 24, 40, 3, 1, 1, 13, 11),     # partial row tile, R not a tile multiple
    ConvShape("wide_m64_r147_s2", 4, 3, 64, 7, 2, 3, 37, 30),    # one 64x192 tile spans R
    ConvShape("wide_1x1_256", 8, 256, 64, 1, 1, 0, 14, 14),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_wide_tiles_give_the_same_bits(layout, monkeypatch):
    """The wide kernels (64x192, 64x128) run the 64x64 tiles' plan: every element accumulates the same chunk
    terms in the same order, so each deterministic variant gives the 64x64 kernels' bits (those run tap tiles
    where Cin is a multiple of 64, whose skipped terms are zeros: finite inputs), and atomic on small
    integers the same sums. A spy checks which kernels ran, so the comparison cannot pass by running the
    same kernel twice."""
    from kernels import conv_wgrad

    ran = []
    real = conv_wgrad.function
    monkeypatch.setattr(conv_wgrad, "function", lambda src, name, dev, *a, **k: (ran.append(name), real(
        src, name, dev, *a, **k))[1])
    widths = set()
    for i, shape in enumerate(WIDE_SHAPES):
        case = conv_wgrad._case(shape, 4200 + i, layout)
        args, kw = SPEC.make_inputs(case, torch.device("cuda"))
        exact, _ = small_integer_inputs(case, "cuda")
        g = geometry(args, kw)
        assert conv_wgrad.wide_tile(g, plan(g.m, g.r, g.k), "split") is not None, shape.name
        for name, variant, inputs in [(v.name, v, args) for v in DETERMINISTIC] + [("atomic", ATOMIC, exact)]:
            if name == "winograd" and wino.applies(g):
                continue
            what = f"{name} {case.name}"
            monkeypatch.setattr(conv_wgrad, "WIDE", "")
            ran.clear()
            narrow = variant(*inputs, **kw)
            assert ran and not any("_t64w_" in n or "_t64m_" in n for n in ran), f"{what}: {ran}"
            monkeypatch.setattr(conv_wgrad, "WIDE", "auto")
            ran.clear()
            wide = variant(*inputs, **kw)
            torch.cuda.synchronize()
            tiles = [n.split("_")[3] for n in ran if "_t64w_" in n or "_t64m_" in n]
            assert tiles, f"{what}: no wide kernel ran ({ran})"
            widths.update(tiles)
            assert_bitwise_equal(wide, narrow, what)
    assert widths == {"t64w", "t64m"}


# shapes for the cp.async stages: tap and full walks, split and fused combines, K-steps fewer than the stages
STAGES_SHAPES = [RESNET18_CONV[i] for i in (4, 10)] + [
    ConvShape("stages_one_step", 1, 128, 128, 3, 1, 1, 4, 4),    # K = 16: one K-step, fewer than the stages
    ConvShape("stages_ragged", 5, 24, 40, 3, 2, 1, 13, 11),      # partial tiles, stride 2
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_cp_async_stages_give_the_same_bits(layout, monkeypatch):
    """The cp.async stages (STAGES 3, the default, and 4, another build of the source) move loads, never an
    element's arithmetic: every deterministic variant, through the fused and separate combines, gives the bits
    of the register-prefetch kernels (STAGES 0), and atomic on small integers the same sums; the spy checks
    that the STAGES 0 run ran no _a kernel and the others did (wide tiles, which have no stages, are off)."""
    from kernels import conv_wgrad

    monkeypatch.setattr(conv_wgrad, "WIDE", "")
    ran = []
    real = conv_wgrad.function
    monkeypatch.setattr(conv_wgrad, "function", lambda src, name, dev, *a, **k: (ran.append(name), real(
        src, name, dev, *a, **k))[1])
    for i, shape in enumerate(STAGES_SHAPES):
        case = conv_wgrad._case(shape, 4300 + i, layout)
        args, kw = SPEC.make_inputs(case, torch.device("cuda"))
        exact, _ = small_integer_inputs(case, "cuda")
        g = geometry(args, kw)
        for name, variant, inputs in [(v.name, v, args) for v in DETERMINISTIC] + [("atomic", ATOMIC, exact)]:
            if name == "winograd" and wino.applies(g):
                continue
            for fuse in (("separate", "fused") if name == "tree" else ("auto",)):
                monkeypatch.setattr(conv_wgrad, "FUSE", fuse)
                outs = {}
                for stages in (0, 3, 4):
                    monkeypatch.setattr(conv_wgrad, "STAGES", stages)
                    ran.clear()
                    outs[stages] = variant(*inputs, **kw)
                    torch.cuda.synchronize()
                    gemms = [n for n in ran if "_reduce" not in n]
                    assert gemms and all(n.endswith("_a") == (stages > 0) for n in gemms), (name, stages, ran)
                for stages in (3, 4):
                    assert_bitwise_equal(outs[stages], outs[0], f"{name} {fuse} {case.name}: {stages} stages")


@pytest.mark.gpu
@pytest.mark.parametrize("tap", [False, True], ids=["full", "tap"])
def test_gpu_unsplit_store_never_writes_negative_zero(tap, monkeypatch):
    """A sum of negative products that underflow is -0.0 in the FMA chain: x = 2^-80, dy = -2^-80 give
    products of -2^-160, below the smallest subnormal. The full walk's zero fill past the chunk's end
    (0 * 0 = +0.0) would turn it into +0.0, and a tap tile whose valid terms fill its K-steps exactly keeps
    it; the unsplit store adds +0.0, as every combine does, so both walks write +0.0 and the same bits. (Wide
    tiles, which walk in full, are off: a spy checks that the tap run ran a tap kernel.)"""
    from kernels import conv_wgrad

    ran = []
    real = conv_wgrad.function
    monkeypatch.setattr(conv_wgrad, "function", lambda src, name, dev, *a, **k: (ran.append(name), real(
        src, name, dev, *a, **k))[1])
    monkeypatch.setattr(conv_wgrad, "TAP_TILES", tap)
    monkeypatch.setattr(conv_wgrad, "WIDE", "")
    x = torch.full((1, 64, 5, 5), 2.0**-80, device="cuda")
    kw = dict(kernel_size=3, padding=1)
    for variant in (kernels.get(OP, "nosplit"), TREE):
        ran.clear()
        dw = variant(x, -x, **kw)
        assert any(n.endswith(TAP_SUFFIXES) for n in ran) == tap, (variant.name, ran)
        assert plan_of(variant, (x, -x), kw).splits == 1
        assert torch.equal(dw, torch.zeros_like(dw)) and not torch.signbit(dw).any(), variant.name


@pytest.mark.gpu
def test_gpu_tap_tiles_skip_a_padded_infinite_product(monkeypatch):
    """The documented difference on non-finite inputs: an infinite dy at an output position whose pixel is
    padding for some taps makes those taps' weights NaN in the full walk (Inf * 0), while tap tiles never
    form that product (there the other terms sum to 0); the taps whose pixel is inside give Inf either
    way. (Wide tiles, off here, have no tap tiles: a 64-output-channel conv they run walks in full.)"""
    from kernels import conv_wgrad

    monkeypatch.setattr(conv_wgrad, "WIDE", "")
    x = torch.ones(1, 64, 6, 6, device="cuda")
    dy = torch.zeros(1, 64, 6, 6, device="cuda")
    dy[0, :, 0, 0] = float("inf")   # position (0, 0): its pixel is padding for every tap with kh or kw 0
    kw = dict(kernel_size=3, padding=1)
    monkeypatch.setattr(conv_wgrad, "TAP_TILES", False)
    full = TREE(x, dy, **kw)
    monkeypatch.setattr(conv_wgrad, "TAP_TILES", True)
    tapped = TREE(x, dy, **kw)
    padded = torch.zeros(3, 3, dtype=torch.bool)
    padded[0, :] = padded[:, 0] = True
    assert torch.isnan(full[:, :, padded]).all() and torch.isinf(full[:, :, ~padded]).all()
    assert torch.equal(tapped[:, :, padded], torch.zeros_like(tapped[:, :, padded]))
    assert torch.equal(tapped[:, :, ~padded], full[:, :, ~padded])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_fused_and_separate_combine_give_the_same_bits(layout, monkeypatch):
    """tree's fixed-order combine in the GEMM launch (last block per tile, ticket counters) or in a
    second kernel: the same additions in the same order. Forced both ways on shapes with 1 to 144
    tiles and 8 to 256 splits, and on ragged hostile shapes; the fused one repeated, so a counter left
    nonzero by one launch would show in the next."""
    from kernels import conv_wgrad

    cases = [gpu_case(RESNET18_CONV[i]) for i in (0, 3, 7, 10, 11)]
    # batch 16: ragged tiles (R = 147, 576) with 8 splits
    cases += [kernels.Case(OP, f"{RESNET18_CONV[i].name}_n16", dict(gpu_case(RESNET18_CONV[i]).params, n=16),
                           seed=77 + i) for i in (2, 11)]
    for case in cases:
        args, kw = SPEC.make_inputs(case, torch.device("cuda"))
        if layout == "channels_last":
            args = tuple(a.to(memory_format=torch.channels_last) for a in args)
        monkeypatch.setattr(conv_wgrad, "FUSE", "separate")
        separate = TREE(*args, **kw)
        monkeypatch.setattr(conv_wgrad, "FUSE", "fused")
        outs = [TREE(*args, **kw) for _ in range(10)]
        torch.cuda.synchronize()
        for o in outs:
            assert_bitwise_equal(o, separate, f"{case.name} {layout}")


@pytest.mark.gpu
def test_gpu_bad_arguments_and_empty_batch():
    x, dy = torch.randn(2, 3, 8, 8, device="cuda"), torch.randn(2, 4, 8, 8)
    for v in VARIANTS:
        with pytest.raises(KernelArgumentError) as info:
            v(x, dy, kernel_size=3, padding=1)
        assert info.value.arg == "dy"
        z = v(torch.randn(0, 3, 8, 8, device="cuda"), torch.randn(0, 4, 8, 8, device="cuda"), kernel_size=3,
              padding=1)
        torch.cuda.synchronize()
        assert z.is_cuda and z.shape == (4, 3, 3, 3) and not z.any()


@pytest.mark.gpu
def test_gpu_winograd_is_tree_where_it_does_not_apply():
    for i in (2, 3, 11):
        args, kw = SPEC.make_inputs(gpu_case(RESNET18_CONV[i]), torch.device("cuda"))
        assert not winograd_applies(WINOGRAD, args, kw)
        assert_bitwise_equal(WINOGRAD(*args, **kw), TREE(*args, **kw), RESNET18_CONV[i].name)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [RESNET18_CONV[i] for i in (1, 4, 7, 10)], ids=lambda s: s.name)
def test_gpu_winograd_matches_its_model_within_bound(shape):
    """Not bit-exact (FFMA in the GEMMs): the CUDA kernels and the CPU model are each within the bound;
    the transforms and the combine are the model's, so the two stay far closer than the bound."""
    args, kw = SPEC.make_inputs(gpu_case(shape), torch.device("cuda"))
    got = WINOGRAD(*args, **kw).cpu()
    cpu_args = tuple(a.cpu() for a in args)
    model = WINOGRAD(*cpu_args, **kw)
    ref = SPEC.reference(cpu_args, kw)
    bound = error_bound(WINOGRAD, cpu_args, kw)
    assert_within_bound(got, ref, bound, f"cuda {shape.name}")
    assert_within_bound(model, ref, bound, f"model {shape.name}")
