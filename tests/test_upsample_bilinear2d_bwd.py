"""upsample_bilinear2d_bwd: CPU order models against float64, bad inputs, and (on a GPU) the CUDA kernels
against their models and torch's CUDA backward, bitwise.

Error bound (``upsample_bilinear2d_bwd.error_bound``): an element receiving k products (l_h * l_w) * d,
each rounded twice, added one at a time from +0.0: |dx - exact| <= gamma(k + 1) * sum |exact product|,
gamma(m) = m u / (1 - m u), u = 2^-24, plus 2^-150 per rounding below 2^-126 (and, for atomicAdd, which
flushes subnormals to zero, 2^-126 per operand and result).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels.registry import Case
from kernels import upsample_bilinear2d_bwd as ub
from tests.helpers import assert_within_bound, bitwise_equal, differing_bits, float32_bits

OP = ub.OP
SPEC = kernels.spec(OP)
TREE = kernels.get(OP, "tree")
ATOMIC = kernels.get(OP, "atomic")
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]


def element_counts(dy: torch.Tensor, kw) -> np.ndarray:
    h, w = kw["input_size"]
    return ub.counts(h, w, dy.shape[2], dy.shape[3], kw["align_corners"])[None, None]


def check_bound(result: torch.Tensor, args, kw, flushes: bool = False) -> None:
    """|result - float64 reference| within the bound wherever the reference is finite; NaN and the
    infinities where the reference has them. ``flushes``: float atomicAdd flushes subnormal operands
    and results to zero, each losing less than 2^-126: 2k + 1 of them for k contributions."""
    bound = ub.error_bound(args[0], *kw["input_size"], kw["align_corners"])
    if flushes:
        bound = bound + (2 * element_counts(args[0], kw) + 1) * 2.0**-126
    assert_within_bound(result, SPEC.reference(args, kw).numpy(), bound)


def layout_ok(result: torch.Tensor, dy: torch.Tensor) -> bool:
    return result.is_contiguous(memory_format=ub.memory_format(ub.suggest_layout(dy)))


# --------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_tree_model_within_bound(case):
    args, kw = SPEC.make_inputs(case, CPU)
    dx = TREE(*args, **kw)
    assert dx.shape == (*args[0].shape[:2], *kw["input_size"]) and dx.dtype == torch.float32
    assert layout_ok(dx, args[0])
    check_bound(dx, args, kw)
    # NaN exactly where torch's backward puts it (zero weights times Inf included)
    assert bitwise_equal(torch.isnan(dx), torch.isnan(ub.torch_backward(*args, **kw)))


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_atomic_model_is_some_order(case):
    args, kw = SPEC.make_inputs(case, CPU)
    tree = TREE(*args, **kw)
    dx = ATOMIC(*args, **kw, rng=case.seed)
    assert layout_ok(dx, args[0])
    check_bound(dx, args, kw, flushes=True)
    few = element_counts(args[0], kw) <= 2
    tiny = np.abs(tree.numpy()) < np.finfo(np.float32).tiny
    assert differing_bits(dx, tree, where=few & ~tiny).size == 0


def test_weights_match_aten_formulas():
    """The taps against a plain transcription of aten's area_pixel_compute_source_index in float32
    (align_corners) and, without it, the exact fma: rounding the exact real s * (o + 0.5) - 0.5 once."""
    from fractions import Fraction

    for size, out in ((4, 32), (7, 19), (20, 7), (64, 512), (1, 5), (6, 1), (13, 13)):
        for ac in (False, True):
            i0, i1, l0, l1 = ub.taps(size, out, ac)
            s = ub.scale_of(size, out, ac)
            for o in range(out):
                if ac:
                    r = np.float32(s * np.float32(o))
                else:
                    exact = Fraction(float(s)) * (o + Fraction(1, 2)) - Fraction(1, 2)
                    r = np.float32(max(np.float32(float(exact)) if exact != 0 else 0.0, 0.0))
                    # float(Fraction) rounds to nearest double, then float32: exact value has <= 49
                    # significant bits when >= 0, so the double is exact and one rounding remains
                assert i0[o] == int(r) and i1[o] == int(r) + (int(r) < size - 1)
                assert l1[o] == np.float32(r - np.float32(int(r))) and l0[o] == np.float32(1) - l1[o]


def test_integer_downsampling_is_exact_and_order_free():
    case = next(c for c in TEST_CASES if c.name == "down_int_16to8_ac0_nchw")
    args, kw = SPEC.make_inputs(case, CPU)
    assert element_counts(args[0], kw).max() <= 2
    ref = SPEC.reference(args, kw).float()
    for seed in range(3):
        assert differing_bits(ATOMIC(*args, **kw, rng=seed), TREE(*args, **kw)).size == 0
    assert differing_bits(TREE(*args, **kw), ref).size == 0  # weights 0.5 * 0.5 or 1: every product exact


def test_same_size_is_a_copy():
    case = next(c for c in TEST_CASES if c.name == "same_6x7_ac0_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    dy = dy.clone()
    dy[0, 0, 0, 0] = float("inf")
    dy[0, 0, 1, 1] = -0.0
    for v in (TREE, ATOMIC):
        assert differing_bits(v(dy, **kw, rng=0), dy).size == 0
    # torch's CPU backward scatters even then (0 * Inf = NaN next to the Inf, -0.0 becomes +0.0); its
    # CUDA backward copies, which test_gpu_same_size_copies_like_torch_cuda checks.
    assert differing_bits(ub.torch_backward(dy, **kw), dy).size > 0


def test_atomic_model_varies_with_order_negative_control():
    case = next(c for c in TEST_CASES if c.name == "x8_4x5to32x40_ac0_nchw")
    args, kw = SPEC.make_inputs(case, CPU)
    assert element_counts(args[0], kw).min() >= 100
    results = {float32_bits(ATOMIC(*args, **kw, rng=seed)).tobytes() for seed in range(10)}
    assert len(results) >= 5
    assert len({float32_bits(TREE(*args, **kw)).tobytes() for _ in range(3)}) == 1


def test_checks_reject_wrong_results_negative_control():
    """A reversed order is a correct sum but not tree's bits; a dropped gradient breaks the bound; swapped
    weights (l0 <-> l1) break it too."""
    case = next(c for c in TEST_CASES if c.name == "odd_7x9to19x13_ac0_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    tree = TREE(dy, **kw)
    parts = ub.products(dy, *kw["input_size"], kw["align_corners"])
    rev = np.zeros(parts.shape[:-1], dtype=np.float32)
    for k in reversed(range(parts.shape[-1])):
        rev = rev + parts[..., k]
    assert differing_bits(torch.from_numpy(rev), tree).size > 0
    check_bound(torch.from_numpy(rev), (dy,), kw)
    dropped = dy.clone()
    dropped[0, 0, 5, 5] = 0.0
    with pytest.raises(AssertionError, match="outside the bound"):
        check_bound(TREE(dropped, **kw), (dy,), kw)
    flipped = TREE(dy.flip(2, 3).contiguous(), **kw).flip(2, 3)  # mirrored weights
    with pytest.raises(AssertionError, match="outside the bound"):
        check_bound(flipped, (dy,), kw)


def test_layouts_and_noncontiguous_agree():
    case = next(c for c in TEST_CASES if c.name == "odd_7x9to19x13_ac1_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    a = TREE(dy, **kw)
    b = TREE(dy.contiguous(memory_format=torch.channels_last), **kw)
    assert b.is_contiguous(memory_format=torch.channels_last) and differing_bits(a, b).size == 0
    strided = torch.zeros(dy.shape[0], dy.shape[1], dy.shape[2] * 2, dy.shape[3])[:, :, ::2]
    strided.copy_(dy)
    assert differing_bits(TREE(strided, **kw), a).size == 0


def test_special_values():
    """Inf and NaN spread where torch's backward spreads them (0 * Inf = NaN included); -0.0 gives
    +0.0; subnormal products survive tree and flush in atomic."""
    z = torch.zeros(1, 1, 4, 4)
    z[0, 0, 1, 1] = -0.0
    assert (float32_bits(TREE(z, input_size=(2, 2), align_corners=False)) == 0).all()
    s = torch.full((1, 1, 2, 2), 1e-40)
    out = TREE(s, input_size=(1, 1), align_corners=True)  # four products of weight 1, subnormal sum
    assert float32_bits(out)[0] == (np.float32(1e-40) * np.float32(4)).view(np.uint32)  # subnormal sums are exact
    assert float32_bits(ATOMIC(s, input_size=(1, 1), align_corners=True, rng=0))[0] == 0


def test_tabled_plan_table_sizes():
    """The tabled kernel's per-axis table height K is the most outputs touching one input position,
    the same count as the model's gather table (a K too small would cut products off)."""
    for size, out in ((4, 32), (7, 19), (20, 7), (64, 512), (1, 5), (6, 1), (256, 96), (64, 128), (5, 5)):
        for ac in (False, True):
            kh, kw, smem = ub.tabled_plan(size, 3, out, 3, ac)
            assert kh == ub.gather_table(size, out, ac)[0].shape[1]
            assert smem == 64 + 8 * (size + 3) + 4 * (kh * size + kw * 3) + 8
    assert ub.tabled_plan(4096, 4096, 8192, 8192, False) is None  # tables too big: the direct kernel


# --------------------------------------------------------------------------------------------------
# Bad inputs

_DY = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
BAD = [
    ("dy", (_DY.double(),), dict(input_size=(8, 8))),
    ("dy", (_DY[0],), dict(input_size=(8, 8))),
    ("dy", (_DY[:0],), dict(input_size=(8, 8))),
    ("input_size", (_DY,), dict(input_size=(8,))),
    ("input_size", (_DY,), dict(input_size=(0, 8))),
    ("input_size", (_DY,), dict(input_size=(True, 8))),
    ("align_corners", (_DY,), dict(input_size=(8, 8), align_corners=1)),
    ("align_corners", (_DY,), dict(input_size=(8, 8), align_corners=None)),
]


@pytest.mark.parametrize("variant", ["tree", "atomic"])
@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{a}{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(variant, arg, args, kw):
    with pytest.raises(KernelArgumentError, match=f"^{OP}: argument '{arg}'"):
        kernels.get(OP, variant)(*args, **kw)


def test_spec_tables():
    gpu = SPEC.bench_cases("gpu")
    names = {c.name for c in gpu}
    assert {"x8_64to512_c21_ac0_b8_nchw", "x8_64to512_c21_ac1_b8_nchw", "x2_64to128_c256_ac0_b8_channels_last",
            "down_256to96_c64_ac0_b8_nchw"} <= names
    x8 = next(c for c in gpu if c.name == "x8_64to512_c21_ac0_b8_nchw")
    assert SPEC.bytes_moved(x8) == 4 * 8 * 21 * (512 * 512 + 64 * 64)
    assert x8.contention > 200  # ~ 4 * 64 products per element
    assert set(SPEC.peers()) == {"torch", "torch_autograd"}


def test_autograd_peer_equals_aten_peer_on_the_cpu():
    case = next(c for c in TEST_CASES if c.name == "odd_7x9to19x13_ac0_channels_last")
    args, kw = SPEC.make_inputs(case, CPU)
    assert differing_bits(ub.torch_autograd_backward(*args, **kw), ub.torch_backward(*args, **kw)).size == 0


# --------------------------------------------------------------------------------------------------
# GPU

CUDA = torch.device("cuda")
REPEATS = 50


def bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_tree_bitwise_repeatable_and_equals_model(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    first = TREE(*args, **kw)
    assert layout_ok(first, args[0])
    for _ in range(REPEATS):
        assert bitwise_equal(bits_t(TREE(*args, **kw)), bits_t(first))
    model = TREE(*cpu_args, **kw)
    assert differing_bits(first, model).size == 0, "CUDA tree differs from its CPU model"
    direct = ub.upsample_bilinear2d_bwd_tree_direct_cuda(*args, **kw)  # weights without the tables
    assert differing_bits(direct, model).size == 0, "tree's direct kernel differs from its CPU model"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in TEST_CASES if c.name.startswith(("odd", "down_20", "in_1x1"))],
                         ids=lambda c: c.name)
def test_gpu_tabled_one_block_looping_over_everything(case, monkeypatch, cuda_sync):
    """One block of the tabled kernel loops over the whole tensor (its tables built once)."""
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    monkeypatch.setattr(ub, "BLOCKS_PER_SM", 0)  # max(1, min(blocks, 0)) = one block
    assert differing_bits(TREE(*args, **kw), TREE(*cpu_args, **kw)).size == 0


ONE_TAP = [c for c in TEST_CASES if ub.tabled_plan(c.params["h"], c.params["w"], c.params["oh"], c.params["ow"],
                                                 c.params["align_corners"])[:2] == (1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ONE_TAP, ids=lambda c: c.name)
def test_gpu_one_tap_kernel_equals_the_general_one(case, cuda_sync):
    """Where every position takes at most one dy element per axis tree runs _tabled1 (four elements in
    flight per thread): the general tabled kernel's bits."""
    args, kw = SPEC.make_inputs(case, CUDA)
    assert differing_bits(TREE(*args, **kw), ub.upsample_bilinear2d_bwd_tree_generic_cuda(*args, **kw)).size == 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_gpu_one_tap_kernel_at_a_benchmark_like_size(layout, align_corners, cuda_sync):
    """256 -> 96 (the benchmark's downsampling, fewer planes): _tabled1 against the CPU model, bitwise."""
    case = Case(OP, "down_256to96", dict(n=2, c=5, h=256, w=256, oh=96, ow=96, align_corners=align_corners,
                                         layout=layout), seed=77)
    assert ub.tabled_plan(256, 256, 96, 96, align_corners)[:2] == (1, 1)
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    assert differing_bits(TREE(*args, **kw), TREE(*cpu_args, **kw)).size == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_atomic_is_some_order(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    tree = TREE(*cpu_args, **kw)
    few = element_counts(cpu_args[0], kw) <= 2
    tiny = np.abs(tree.numpy()) < np.finfo(np.float32).tiny
    for _ in range(5):
        dx = ATOMIC(*args, **kw)
        assert layout_ok(dx, args[0])
        check_bound(dx.cpu(), cpu_args, kw, flushes=True)
        assert differing_bits(dx, tree, where=few & ~tiny).size == 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_atomic_varies_on_contended_case(layout, cuda_sync):
    """Negative control: x8 upsampling, ~256 products per element."""
    base = next(c for c in SPEC.bench_cases("quick") if c.name.startswith("x8"))
    case = kernels.Case(OP, base.name, dict(base.params, layout=layout), seed=base.seed)
    args, kw = SPEC.make_inputs(case, CUDA)
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(20)}
    print(f"{case.name} {layout}: atomic {len(atomic)} distinct / 20")
    assert len(atomic) > 1
    assert len({float32_bits(TREE(*args, **kw)).tobytes() for _ in range(20)}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_equals_torch_cuda_where_order_cannot_matter(case, cuda_sync):
    """torch's CUDA backward atomically adds the same four products: where an element receives at most
    two, its bits are fixed and tree must give them. This checks the weights on the GPU, the FMA in the
    source index included (the downsampling cases with inexact scales exercise it)."""
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    theirs = ub.torch_backward(*args, **kw)
    few = element_counts(cpu_args[0], kw) <= 2
    tiny = np.abs(theirs.cpu().numpy()) < np.finfo(np.float32).tiny
    diff = differing_bits(TREE(*args, **kw), theirs, where=few & ~tiny)
    assert diff.size == 0, f"tree differs from torch's CUDA backward at {diff[:10]}"
    check_bound(theirs.cpu(), cpu_args, kw, flushes=True)


@pytest.mark.gpu
def test_gpu_same_size_copies_like_torch_cuda(cuda_sync):
    dy = torch.randn(2, 3, 6, 7, generator=torch.Generator().manual_seed(1))
    dy[0, 0, 0, 0] = float("inf")
    dy[0, 0, 1, 1] = -0.0
    dy = dy.to(CUDA)
    theirs = ub.torch_backward(dy, input_size=(6, 7), align_corners=False)
    for v in (TREE, ATOMIC):
        assert differing_bits(v(dy, input_size=(6, 7), align_corners=False), theirs).size == 0


@pytest.mark.gpu
def test_gpu_torch_deterministic_mode():
    """The aten backward raises in deterministic mode (the benchmark records it unavailable);
    F.interpolate's decomposition runs and repeats bitwise."""
    from bench.timing import torch_mode

    dy = torch.randn(2, 3, 32, 32, device=CUDA)
    with torch_mode("deterministic"):
        with pytest.raises(RuntimeError, match="deterministic"):
            ub.torch_backward(dy, input_size=(8, 8), align_corners=False)
        a = ub.torch_autograd_backward(dy, input_size=(8, 8), align_corners=False)
        b = ub.torch_autograd_backward(dy, input_size=(8, 8), align_corners=False)
    assert bitwise_equal(a, b)
