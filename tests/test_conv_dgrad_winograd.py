"""conv_dgrad ``winograd`` (kernels/conv_dgrad_winograd.py): transforms in the documented order, the CPU
model and the CUDA kernel against float64 within a bound derived from the arithmetic, determinism, the
layouts' bits, and the fallback to ``tree``.

Error bound. The variant evaluates y = A^T [sum_c (G g_c G^T) (.) (B^T d_c B)] A in float32, one rounding
per operation (the halvings in G are exact). Along any path from an input product to a dx element there
are at most 4 roundings in U (two additions per axis), 2 in V (one per axis), Cout in the sum over c
(its product and at most Cout - 1 additions, in any order: an FFMA chain on the GPU, a BLAS on the CPU)
and 4 in the output transform (two per axis): depth = Cout + 10 (``rounding_depth``). Higham's argument
bounds the error by gamma_depth times the same evaluation with every input and coefficient replaced by
its absolute value (``magnitude``, float64). The float64 reference adds its own error, at most
gamma_{9 Cout}(2^-53) times the direct magnitude, which the Winograd magnitude exceeds (every direct term
appears in it with coefficient >= 1), so it is added with that magnitude.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import kernels
from kernels import conv_dgrad as cd
from kernels import conv_dgrad_winograd as wd
from kernels.runtime import KERNEL_DIR
from kernels.shapes import RESNET18_CONV, ConvShape
from tests.helpers import assert_bitwise_equal, distinct, gamma

OP = "conv_dgrad"
SPEC = kernels.spec(OP)
WINOGRAD = kernels.get(OP, "winograd")
TREE = kernels.get(OP, "tree")
REPEATS = 20

# (n, cin, cout, h, w, padding): every tail the kernel masks (tiles past a block of 32 and past the image on
# odd sizes, outputs past a block of 32, a last stage of fewer than 8 channels), paddings 0, 1 and 2, a
# 1x1 image, per-axis padding, and ResNet-18 stages
SHAPES = [
    (2, 16, 16, 8, 8, 1),
    (3, 20, 17, 7, 5, 1),
    (1, 16, 24, 9, 6, 0),
    (2, 18, 16, 5, 7, 2),
    (1, 16, 16, 1, 1, 1),
    (2, 40, 33, 11, 13, (1, 2)),
    (5, 64, 64, 9, 9, 1),
]
GPU_SHAPES = SHAPES + [(4, 64, 64, 56, 56, 1), (8, 128, 128, 28, 28, 1), (16, 256, 256, 14, 14, 1),
                       (16, 512, 512, 7, 7, 1), (3, 48, 96, 30, 17, 0)]


def make(shape, layout="nchw", seed=0, device="cpu", integers=False):
    n, cin, cout, h, w, p = shape
    ph, pw = p if isinstance(p, tuple) else (p, p)
    gen = torch.Generator().manual_seed(seed)
    if integers:   # every product and partial sum a multiple of 1/4 far below 2^22 in magnitude: exact in float32
        wt = torch.randint(-3, 4, (cout, cin, 3, 3), generator=gen).float()
        dy = torch.randint(-3, 4, (n, cout, h + 2 * ph - 2, w + 2 * pw - 2), generator=gen).float()
    else:
        wt = torch.randn(cout, cin, 3, 3, generator=gen) / float(np.sqrt(9 * cin))
        dy = torch.randn(n, cout, h + 2 * ph - 2, w + 2 * pw - 2, generator=gen)
    if layout == "channels_last":
        dy = dy.contiguous(memory_format=torch.channels_last)
    kw = {"input_size": (h, w), "stride": 1, "padding": (ph, pw), "dilation": 1}
    return wt.to(device), dy.to(device), kw


def geometry(w, dy, kw):
    return cd._check(w, dy, kw["input_size"], kw["stride"], kw["padding"], kw["dilation"])


def assert_within_bound(got, w, dy, kw, what):
    g = geometry(w, dy, kw)
    w, dy = w.cpu(), dy.cpu()
    ref = SPEC.reference((w, dy), kw)
    n = 9 * g.cout
    bound = (gamma(wd.rounding_depth(g)) + n * 2.0**-53 / (1 - n * 2.0**-53)) * wd.magnitude(w, dy, g)
    err = (got.detach().cpu().double() - ref).abs()
    bad = err > bound
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements outside the bound, first at "
                           f"{bad.nonzero()[:5].tolist()}; max err/bound {(err / bound).max().item():.3g}")


def ids(shape):
    return "x".join(map(str, shape[:5])) + f"_p{shape[5]}"


# --------------------------------------------------------------------------------------------------
# CPU


def _f32(*v):
    return [np.float32(e) for e in v]


def test_transforms_are_the_documented_order():
    """One tile written out with float32 scalars, one rounding per operation, in the .cu file's order:
    U = along r, then s, of (e0, h((e0 + e2) + e1), h((e0 + e2) - e1), e2) on the flipped weights;
    V = rows then columns of (e0 - e2, e1 + e2, e2 - e1, e1 - e3); y = rows then columns of
    ((e0 + e1) + e2, (e1 - e2) - e3)."""
    rng = np.random.default_rng(5)
    gw = (rng.standard_normal((3, 3)) * 10.0 ** rng.integers(-4, 5, (3, 3))).astype(np.float32)
    d = (rng.standard_normal((4, 4)) * 10.0 ** rng.integers(-4, 5, (4, 4))).astype(np.float32)
    h = np.float32(0.5)

    def gax(e0, e1, e2):
        a = e0 + e2
        return [e0, h * (a + e1), h * (a - e1), e2]

    u = wd.filter_transform(torch.from_numpy(gw).reshape(1, 1, 3, 3)).reshape(4, 4)
    flipped = gw[::-1, ::-1]
    cols = [gax(*_f32(*flipped[:, s])) for s in range(3)]        # cols[s][a]
    for a in range(4):
        assert [x.tobytes() for x in gax(*[cols[s][a] for s in range(3)])] == [x.tobytes() for x in u[a]]

    g = cd.Geometry(n=1, cin=1, cout=1, kh=3, kw=3, h=2, w=2, oh=4, ow=4, sh=1, sw=1, ph=2, pw=2, dh=1, dw=1,
                    layout="nchw")   # dx 2x2 from a 4x4 dy at padding 2: one tile, its patch d
    v = wd.patch_transform(torch.from_numpy(d).reshape(1, 1, 4, 4), g).reshape(4, 4)

    def bt(e0, e1, e2, e3):
        return [e0 - e2, e1 + e2, e2 - e1, e1 - e3]

    s_ = [bt(*_f32(*d[:, j])) for j in range(4)]                  # s_[j][a]
    for a in range(4):
        assert [x.tobytes() for x in bt(*[s_[j][a] for j in range(4)])] == [x.tobytes() for x in v[a]]

    m = (rng.standard_normal((16, 1, 1)) * 10.0 ** rng.integers(-4, 5, (16, 1, 1))).astype(np.float32)
    y = wd.output_transform(m, g).reshape(2, 2)

    def at(e0, e1, e2, e3):
        return [(e0 + e1) + e2, (e1 - e2) - e3]

    mm = m.reshape(4, 4)
    r = [at(*mm[:, b]) for b in range(4)]                          # r[b][i]
    for i in range(2):
        assert [x.tobytes() for x in at(*[r[b][i] for b in range(4)])] == [x.tobytes() for x in y[i]]


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_model_within_bound_exact_on_integers_and_layout_free(shape):
    w, dy, kw = make(shape, seed=11)
    assert wd.applies(geometry(w, dy, kw))
    got = WINOGRAD(w, dy, **kw)
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert_within_bound(got, w, dy, kw, f"model {shape}")
    cl = WINOGRAD(w, dy.contiguous(memory_format=torch.channels_last), **kw)
    assert cl.is_contiguous(memory_format=torch.channels_last)
    assert_bitwise_equal(cl, got, f"model {shape} channels_last")
    wi, dyi, _ = make(shape, seed=12, integers=True)
    assert torch.equal(WINOGRAD(wi, dyi, **kw).double(), SPEC.reference((wi, dyi), kw)), f"model {shape} integers"


def test_bound_is_tight_enough_to_catch_a_lost_term():
    """Negative control: the bound is not so loose that dropping one channel's contribution passes it."""
    w, dy, kw = make(SHAPES[-1], seed=13)
    lost = w.clone()
    lost[5] = 0.0   # output channel 5 of the conv: one term of every dx element's sum over c
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(WINOGRAD(lost, dy, **kw), w, dy, kw, "lost term")


def test_runs_tree_where_it_does_not_apply():
    """1x1, strided, 5x5, dilated, padding 3 and few-channel shapes: winograd is tree, bit for bit."""
    for i, s in enumerate([ConvShape("k1", 2, 32, 32, 1, 1, 0, 6, 6), ConvShape("s2", 2, 32, 32, 3, 2, 1, 9, 9),
                           ConvShape("k5", 2, 32, 32, 5, 1, 2, 6, 6), ConvShape("d2", 2, 32, 32, 3, 1, 2, 8, 8, 2),
                           ConvShape("p3", 2, 32, 32, 3, 1, 3, 5, 5), ConvShape("few", 2, 8, 32, 3, 1, 1, 6, 6),
                           ConvShape("few_out", 2, 32, 8, 3, 1, 1, 6, 6),
                           RESNET18_CONV[0].with_batch(2)]):
        gen = torch.Generator().manual_seed(30 + i)
        w, dy = torch.randn(s.w_shape, generator=gen), torch.randn(s.y_shape, generator=gen)
        kw = {"input_size": (s.h, s.w), "stride": s.stride, "padding": s.pad, "dilation": s.dilation}
        assert not wd.applies(geometry(w, dy, kw)), s.name
        assert_bitwise_equal(WINOGRAD(w, dy, **kw), TREE(w, dy, **kw), s.name)


# The forward form: y = conv2d(x, w, padding=p) is the data gradient of dy := x on w' = forward_weights(w)
# (kernels/conv_dgrad.py), so the same bound holds with w' and x in the data gradient's places.
FWD_SHAPES = [(2, 16, 24, 9, 11, 1), (3, 20, 17, 7, 5, 0), (1, 16, 16, 6, 8, 2), (2, 40, 33, 11, 13, (1, 2))]


def make_forward(shape, seed, device="cpu", layout="nchw"):
    """x (n, cin, h, w), w (cout, cin, 3, 3) and the padding of a forward conv."""
    n, cin, cout, h, w, p = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cin, h, w, generator=gen)
    wt = torch.randn(cout, cin, 3, 3, generator=gen) / float(np.sqrt(9 * cin))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(device), wt.to(device), p


def assert_forward_within_bound(y, x, w, p, what):
    x, w = x.cpu(), w.cpu()
    assert_within_bound(y, cd.forward_weights(w), x, {**cd.forward_args(x, w, p), "stride": 1, "dilation": 1}, what)


@pytest.mark.parametrize("shape", FWD_SHAPES, ids=ids)
def test_forward_model_is_the_data_gradients_on_the_forward_weights(shape):
    """The forward model is the data-gradient model on w' (the same transforms on the same values), within
    the bound of torch's conv2d in float64, in x's layout."""
    x, w, p = make_forward(shape, seed=50)
    assert wd.forward_applies(x, w, p)
    y = wd.conv_forward_winograd_cpu(x, w, padding=p)
    assert_bitwise_equal(y, WINOGRAD(cd.forward_weights(w), x, **cd.forward_args(x, w, p)), f"forward {shape}")
    assert y.shape == torch.nn.functional.conv2d(x, w, padding=p).shape
    assert_forward_within_bound(y, x, w, p, f"forward {shape}")
    cl = wd.conv_forward_winograd_cpu(x.contiguous(memory_format=torch.channels_last), w, padding=p)
    assert cl.is_contiguous(memory_format=torch.channels_last)
    assert_bitwise_equal(cl, y, f"forward {shape} channels_last")


def test_forward_applies_only_to_float32_3x3_with_enough_channels():
    """Half precision, other kernels and few channels are not Winograd forwards: the model runs tree's
    forward form there, bit for bit (a float32 model: half precision is the GPU's test)."""
    gen = torch.Generator().manual_seed(51)
    x, w = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(24, 16, 3, 3, generator=gen)
    assert wd.forward_applies(x, w, 1)
    cases = {"bf16": (x.bfloat16(), w.bfloat16(), 1), "5x5": (x, torch.randn(24, 16, 5, 5, generator=gen), 2),
             "few_in": (x[:, :8].contiguous(), w[:, :8].contiguous(), 1), "few_out": (x, w[:8].contiguous(), 1),
             "3d": (x[0], w, 1)}
    for name, (xx, ww, p) in cases.items():
        assert not wd.forward_applies(xx, ww, p), name
    for name in ("5x5", "few_in", "few_out"):
        xx, ww, p = cases[name]
        assert_bitwise_equal(wd.conv_forward_winograd_cpu(xx, ww, padding=p),
                             cd.conv_forward_tree_cpu(xx, ww, padding=p), name)


# --------------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=ids)
def test_cuda_within_bound_repeatable_and_layout_free(shape):
    """Within the bound; REPEATS calls give one result; channels_last dy and a channels_last w give the
    same bits (every layout runs the same expression)."""
    w, dy, kw = make(shape, seed=21, device="cuda")
    got = WINOGRAD(w, dy, **kw)
    runs = [WINOGRAD(w, dy, **kw) for _ in range(REPEATS - 1)]
    cl = WINOGRAD(w, dy.contiguous(memory_format=torch.channels_last), **kw)
    wcl = WINOGRAD(w.contiguous(memory_format=torch.channels_last), dy, **kw)
    torch.cuda.synchronize()
    assert got.is_cuda and got.is_contiguous() and cl.is_contiguous(memory_format=torch.channels_last)
    assert_within_bound(got, w, dy, kw, f"cuda {shape}")
    assert distinct([got, *runs]) == 1, f"cuda {shape}: results differ between repeats"
    assert_bitwise_equal(cl, got, f"cuda {shape} channels_last dy")
    assert_bitwise_equal(wcl, got, f"cuda {shape} channels_last w")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_cuda_exact_on_integers(shape):
    w, dy, kw = make(shape, seed=22, device="cuda", integers=True)
    got = WINOGRAD(w, dy, **kw)
    assert torch.equal(got.cpu().double(), SPEC.reference((w.cpu(), dy.cpu()), kw)), f"cuda {shape} integers"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_cuda_transforms_are_the_models(layout):
    """With one nonzero output channel of the conv, every sum over c has one nonzero product (the others
    are +-0), so the GPU's FFMA chain and the model's BLAS both give that product rounded once, and what is
    left is the transforms: the kernel must give the model's values exactly (signed zeros aside), which
    the bound alone cannot tell apart from another order or a contraction."""
    for i, shape in enumerate([SHAPES[1], SHAPES[3], SHAPES[5]]):
        w, dy, kw = make(shape, layout, seed=40 + i)
        w[torch.arange(w.shape[0]) != 3] = 0.0
        want = WINOGRAD(w, dy, **kw)
        got = WINOGRAD(w.cuda(), dy.cuda(), **kw).cpu()
        assert torch.equal(got, want), f"{shape} {layout}: {int((got != want).sum())} elements differ"


@pytest.mark.gpu
def test_cuda_runs_tree_where_it_does_not_apply():
    for i, s in enumerate([ConvShape("s2", 4, 64, 64, 3, 2, 1, 15, 15), ConvShape("few", 4, 8, 64, 3, 1, 1, 9, 9),
                           ConvShape("k1", 4, 64, 64, 1, 1, 0, 9, 9)]):
        gen = torch.Generator().manual_seed(23 + i)
        w, dy = torch.randn(s.w_shape, generator=gen).cuda(), torch.randn(s.y_shape, generator=gen).cuda()
        kw = {"input_size": (s.h, s.w), "stride": s.stride, "padding": s.pad, "dilation": 1}
        assert not wd.applies(geometry(w, dy, kw)), s.name
        assert_bitwise_equal(WINOGRAD(w, dy, **kw), TREE(w, dy, **kw), s.name)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cu_compiles_for_sm90_without_spills():
    """The fused kernels hold 64 accumulators per thread under a 2-blocks-per-SM register budget: no spills."""
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-I{KERNEL_DIR}", "-c", "-o", "/dev/null",
                        str(KERNEL_DIR / wd.SOURCE), "-Xptxas", "-v"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name in ("wino_dgrad_nchw", "wino_dgrad_cl", "wino_dgrad_filter"):
        assert re.search(rf"Function properties for {name}\n\s*0 bytes stack frame, 0 bytes spill stores, "
                         r"0 bytes spill loads", r.stderr), name


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", FWD_SHAPES + [(8, 64, 64, 56, 56, 1), (16, 512, 512, 7, 7, 1)], ids=ids)
def test_cuda_forward_reads_w_in_place_with_the_data_gradients_bits(shape, layout):
    """The forward reads w unflipped where the data gradient reads w' = forward_weights(w) flipped: the same
    U, so the same bits as the data gradient of the forward form; within the bound; REPEATS calls, one
    result; a channels_last w gives the same bits."""
    x, w, p = make_forward(shape, seed=52, device="cuda", layout=layout)
    assert wd.forward_applies(x, w, p)
    y = wd.conv_forward_winograd_cuda(x, w, padding=p)
    runs = [wd.conv_forward_winograd_cuda(x, w, padding=p) for _ in range(REPEATS - 1)]
    want = WINOGRAD(cd.forward_weights(w), x, **cd.forward_args(x, w, p))
    wcl = wd.conv_forward_winograd_cuda(x, w.contiguous(memory_format=torch.channels_last), padding=p)
    torch.cuda.synchronize()
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)
    assert_bitwise_equal(y, want, f"forward {shape} {layout}")
    assert_bitwise_equal(wcl, y, f"forward {shape} {layout} channels_last w")
    assert distinct([y, *runs]) == 1, f"forward {shape} {layout}: results differ between repeats"
    assert_forward_within_bound(y, x, w, p, f"cuda forward {shape} {layout}")


@pytest.mark.gpu
def test_cuda_forward_runs_tree_where_it_does_not_apply():
    gen = torch.Generator().manual_seed(53)
    x, w = torch.randn(2, 16, 8, 8, generator=gen).cuda(), torch.randn(24, 16, 3, 3, generator=gen).cuda()
    cases = {"bf16": (x.bfloat16(), w.bfloat16(), 1), "few_in": (x[:, :8].contiguous(), w[:, :8].contiguous(), 1),
             "5x5": (x, torch.randn(24, 16, 5, 5, generator=gen).cuda(), 2)}
    for name, (xx, ww, p) in cases.items():
        assert not wd.forward_applies(xx, ww, p), name
        assert_bitwise_equal(wd.conv_forward_winograd_cuda(xx, ww, padding=p),
                             cd.conv_forward_tree_cuda(xx, ww, padding=p), name)
