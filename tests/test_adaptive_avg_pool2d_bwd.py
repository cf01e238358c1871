"""adaptive_avg_pool2d_bwd: CPU order models against float64 and torch's CPU backward, bad inputs, and
(on a GPU) the CUDA kernels against their models and torch's CUDA backward, bitwise.

Error bound (``adaptive_avg_pool2d_bwd.error_bound``): an element covered by k windows receives k
contributions (dy / kw) / kh, each rounded twice, then added one at a time from +0.0 (k - 1 roundings):
|dx - exact| <= gamma(k + 1) * sum |exact contribution|, gamma(m) = m u / (1 - m u), u = 2^-24.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import adaptive_avg_pool2d_bwd as aap
from tests.helpers import assert_within_bound, bitwise_equal, differing_bits, float32_bits

OP = aap.OP
SPEC = kernels.spec(OP)
TREE = kernels.get(OP, "tree")
ATOMIC = kernels.get(OP, "atomic")
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]


def check_bound(result: torch.Tensor, args, kw, flushes: bool = False) -> None:
    """|result - float64 reference| within the bound wherever the reference is finite; NaN and the
    infinities where the reference has them. ``flushes``: float atomicAdd flushes subnormal operands
    and results to zero, each losing less than 2^-126: 2k + 1 of them for k contributions."""
    bound = aap.error_bound(args[0], *kw["input_size"])
    if flushes:
        bound = bound + (2 * element_counts(args[0], kw) + 1) * 2.0**-126
    assert_within_bound(result, SPEC.reference(args, kw).numpy(), bound)


def layout_ok(result: torch.Tensor, dy: torch.Tensor) -> bool:
    want = aap.memory_format(aap.suggest_layout(dy))
    return result.is_contiguous(memory_format=want)


def element_counts(dy: torch.Tensor, kw) -> np.ndarray:
    n, c, oh, ow = dy.shape
    h, w = kw["input_size"]
    return np.broadcast_to(aap.counts(h, w, oh, ow), (n, c, h, w))


def division_orders_agree(dy: torch.Tensor, kw, single: bool = False) -> np.ndarray:
    """(N, C, H, W): every contribution to the element is the same float32 whether divided by kw then kh
    (the kernels, torch's CUDA) or by kh then kw (torch's CPU); ``single``: and divided once by kh * kw
    (torch's CPU channels_last kernel on the channels its vector loop covers)."""
    h, w = kw["input_size"]
    d = dy.detach().cpu().contiguous().numpy()
    _, _, oh, ow = d.shape
    kh = aap.axis_table(h, oh)[0].astype(np.float32)
    kwid = aap.axis_table(w, ow)[0].astype(np.float32)
    with np.errstate(invalid="ignore"):
        a = (d / kwid[None, None, None, :]) / kh[None, None, :, None]
        b = (d / kh[None, None, :, None]) / kwid[None, None, None, :]
        c = d / (kh[:, None] * kwid[None, :])[None, None]  # kh * kw: exact in float32 here
    agree = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    if single:
        agree &= (a.view(np.uint32) == c.view(np.uint32)) | (np.isnan(a) & np.isnan(c))
    _, rows, rvalid = aap.axis_table(h, oh)
    _, cols, cvalid = aap.axis_table(w, ow)
    ok = np.ones(d.shape[:2] + (h, w), dtype=bool)
    for j in range(rows.shape[1]):
        for i in range(cols.shape[1]):
            m = rvalid[:, j][:, None] & cvalid[:, i][None, :]
            ok &= ~m | agree[:, :, rows[:, j][:, None], cols[:, i][None, :]]
    return ok


# --------------------------------------------------------------------------------------------------
# CPU: models against float64, torch and each other


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_tree_model_within_bound_and_equals_torch_cpu(case):
    args, kw = SPEC.make_inputs(case, CPU)
    dx = TREE(*args, **kw)
    assert dx.shape == (*args[0].shape[:2], *kw["input_size"]) and dx.dtype == torch.float32
    assert layout_ok(dx, args[0])
    check_bound(dx, args, kw)
    # torch's CPU backward adds the windows in (oh, ow) row-major order from +0.0 like tree, but
    # divides by kh first: same bits wherever both division orders give the same contributions. Its
    # channels_last kernel divides once by kh * kw on the channels of its vector loop (all but a
    # tail shorter than the vector width, 8 or 16 floats), so with C >= 8 that form must agree too.
    wide_cl = aap.suggest_layout(args[0]) == "channels_last" and args[0].shape[1] >= 8
    agree = division_orders_agree(args[0], kw, single=wide_cl)
    diff = differing_bits(dx, aap.torch_backward(*args, **kw), where=agree)
    assert diff.size == 0, f"tree differs from torch's CPU backward at {diff[:10]}"
    h, w = kw["input_size"]
    oh, ow = args[0].shape[2:]
    kh, kwid = aap.axis_table(h, oh)[0], aap.axis_table(w, ow)[0]
    if len(set(kh.tolist()) | set(kwid.tolist())) == 1:
        assert agree.all()  # every window kh == kw: the two division orders cannot differ


def test_square_windows_equal_torch_cpu_everywhere():
    case = next(c for c in TEST_CASES if c.name == "up_3to8_nchw")  # overlapping 1x1 and 2x2 windows
    args, kw = SPEC.make_inputs(case, CPU)
    assert element_counts(args[0], kw).max() >= 4
    assert differing_bits(TREE(*args, **kw), aap.torch_backward(*args, **kw)).size == 0


def test_division_orders_do_differ_on_rectangular_windows():
    """Why torch's CPU bits are compared only where the orders agree: with kh != kw they do differ."""
    case = next(c for c in TEST_CASES if c.name == "nondiv_25x11to7x4_nchw")
    args, kw = SPEC.make_inputs(case, CPU)
    agree = division_orders_agree(args[0], kw)
    assert not agree.all()
    assert differing_bits(TREE(*args, **kw), aap.torch_backward(*args, **kw)).size > 0


def test_single_window_elements_get_the_share_exactly():
    case = next(c for c in TEST_CASES if c.name == "nondiv_13to7_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    parts = aap.contributions(dy, *kw["input_size"])
    one = element_counts(dy, kw) == 1
    assert one.any() and (~one).any()
    expected = np.where(one, parts[..., 0], 0).astype(np.float32)
    got = TREE(dy, **kw).numpy()
    assert np.array_equal(got[one].view(np.uint32), expected[one].view(np.uint32))


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_atomic_model_is_some_order(case):
    """Elements with <= 2 contributions equal tree's bits (0 + a + b = 0 + b + a); all within the bound."""
    args, kw = SPEC.make_inputs(case, CPU)
    dx = ATOMIC(*args, **kw, rng=case.seed)
    assert layout_ok(dx, args[0])
    check_bound(dx, args, kw, flushes=True)
    few = element_counts(args[0], kw) <= 2
    tiny = np.abs(TREE(*args, **kw).numpy()) < np.finfo(np.float32).tiny  # atomic flushes subnormals
    diff = differing_bits(dx, TREE(*args, **kw), where=few & ~tiny)
    assert diff.size == 0, f"elements with <= 2 contributions differ from tree at {diff[:10]}"


def test_atomic_model_varies_with_order_negative_control():
    """OH > H: 64 windows per element; the arrival order changes the bits, tree's order is fixed."""
    case = next(c for c in SPEC.bench_cases("cpu") if c.name.startswith("up_4to28"))
    args, kw = SPEC.make_inputs(case, CPU)
    assert element_counts(args[0], kw).min() >= 49
    results = {float32_bits(ATOMIC(*args, **kw, rng=seed)).tobytes() for seed in range(10)}
    assert len(results) >= 5, f"only {len(results)} distinct results over 10 arrival orders"
    assert len({float32_bits(TREE(*args, **kw)).tobytes() for _ in range(3)}) == 1
    assert float32_bits(ATOMIC(*args, **kw, rng=3)).tobytes() == float32_bits(ATOMIC(*args, **kw, rng=3)).tobytes()


def test_checks_reject_wrong_results_negative_control():
    """The checks must fail on deliberately wrong results: the reversed window order (a correct sum, but
    not tree's bits), and a result missing one gradient."""
    case = next(c for c in TEST_CASES if c.name == "up_3to8_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    tree = TREE(dy, **kw)
    rev = TREE(dy.flip(2, 3).contiguous(), **kw).flip(2, 3)  # the windows in reverse order
    assert differing_bits(rev, tree).size > 0
    check_bound(rev, (dy,), kw)
    dropped = dy.clone()
    dropped[0, 0, 3, 3] = 0.0
    with pytest.raises(AssertionError, match="outside the bound"):
        check_bound(TREE(dropped, **kw), (dy,), kw)


def test_special_values():
    """Inf and NaN pass through like torch's (NaN where torch has NaN); -0.0 gradients give +0.0;
    subnormal shares survive tree's additions and flush to zero in atomic's."""
    case = next(c for c in TEST_CASES if c.name.startswith("special"))
    (dy,), kw = SPEC.make_inputs(case, CPU)
    dx = TREE(dy, **kw)
    ref = aap.torch_backward(dy, **kw)
    assert torch.isnan(dx).any() and torch.isinf(dx).any()
    assert bitwise_equal(torch.isnan(dx), torch.isnan(ref)) and bitwise_equal(torch.isinf(dx), torch.isinf(ref))
    one = torch.from_numpy(element_counts(dy, kw) == 1)
    # a lone -0.0 gradient: +0.0 + (-0.0 / kw / kh) = +0.0
    z = torch.zeros(1, 1, 3, 3)
    z[0, 0, 1, 1] = -0.0
    out = TREE(z, input_size=(6, 6))
    assert (float32_bits(out) == 0).all() and (float32_bits(aap.torch_backward(z, input_size=(6, 6))) == 0).all()
    # subnormal shares: 1e-40 / 1 / 1 stays in tree, flushes in atomic
    s = torch.full((1, 1, 2, 2), 1e-40)
    assert (TREE(s, input_size=(2, 2)) == 1e-40).all()
    assert (float32_bits(ATOMIC(s, input_size=(2, 2), rng=0)) == 0).all()
    assert one.any()


def test_layouts_and_noncontiguous_agree():
    """tree gives the same bits in both layouts and for a strided dy (copied first)."""
    case = next(c for c in TEST_CASES if c.name == "nondiv_13to7_nchw")
    (dy,), kw = SPEC.make_inputs(case, CPU)
    a = TREE(dy, **kw)
    b = TREE(dy.contiguous(memory_format=torch.channels_last), **kw)
    assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
    assert differing_bits(a, b).size == 0
    strided = torch.zeros(dy.shape[0], dy.shape[1], dy.shape[2] * 2, dy.shape[3])[:, :, ::2]
    strided.copy_(dy)
    assert not strided.is_contiguous()
    assert differing_bits(TREE(strided, **kw), a).size == 0


# --------------------------------------------------------------------------------------------------
# Bad inputs: KernelArgumentError naming the argument, before anything runs

_DY = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
BAD = [
    ("dy", (_DY.double(),), dict(input_size=(8, 8))),
    ("dy", ([[1.0]],), dict(input_size=(8, 8))),
    ("dy", (_DY[0],), dict(input_size=(8, 8))),
    ("dy", (_DY[:0],), dict(input_size=(8, 8))),
    ("input_size", (_DY,), dict(input_size=(8,))),
    ("input_size", (_DY,), dict(input_size=(0, 8))),
    ("input_size", (_DY,), dict(input_size=(8.0, 8))),
    ("input_size", (_DY,), dict(input_size=8)),
]


@pytest.mark.parametrize("variant", ["tree", "atomic"])
@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{a}{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(variant, arg, args, kw):
    with pytest.raises(KernelArgumentError, match=f"^{OP}: argument '{arg}'"):
        kernels.get(OP, variant)(*args, **kw)


def test_cuda_launcher_refuses_cpu_tensors():
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):
        aap.adaptive_avg_pool2d_bwd_tree_cuda(_DY, input_size=(8, 8))


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5, 7, 49, 196, 255, 256, 257, 1000, 2**16 + 1, 2**30 + 3, 2**31 - 1,
                               2**31])
def test_magic_divider_divides_exactly(d):
    """The exact kernel's host-computed dividers, in the kernel's 32-bit arithmetic: q = (umulhi(n, m) + n) >> s
    equals n // d for 0 <= n < 2^31, checked at the ends of the range, around multiples of d and on 20000
    seeded random n."""
    m, s = aap.magic_divider(d)
    assert 0 < m < 2**32 and 0 <= s <= 31
    rng = np.random.default_rng(d)
    k = np.arange(0, (2**31 - 1) // d + 1, max(1, (2**31 - 1) // d // 5000), dtype=np.uint64)
    n = np.concatenate([k * d, k * d + 1, k * d - 1, np.array([0, 1, 2**31 - 1], dtype=np.uint64),
                        rng.integers(0, 2**31, 20000, dtype=np.uint64)])
    n = n[(n < 2**31)]
    q = ((((n * np.uint64(m)) >> np.uint64(32)) + n) & np.uint64(2**32 - 1)) >> np.uint64(s)
    assert np.array_equal(q, n // np.uint64(d))


def test_magic_divider_refuses_out_of_range():
    with pytest.raises(ValueError, match="divisor"):
        aap.magic_divider(0)


def test_spec_tables():
    names = {c.name for c in SPEC.bench_cases("gpu")}
    assert {"vgg_14to7_b64_nchw", "vgg_13to7_b64_nchw", "vgg_25to7_b64_nchw",
            "resnet_head_7to1_b64_nchw", "up_4to28_b64_nchw"} <= names
    vgg = next(c for c in SPEC.bench_cases("gpu") if c.name == "vgg_14to7_b64_nchw")
    assert SPEC.bytes_moved(vgg) == 4 * 64 * 512 * (49 + 196)
    for scale in ("gpu", "quick", "cpu"):
        assert all(c.contention >= 1 for c in SPEC.bench_cases(scale))
    assert set(SPEC.peers()) == {"torch", "torch_autograd"}
    with pytest.raises(ValueError):
        SPEC.bench_cases("huge")


def test_autograd_peer_equals_aten_peer_on_the_cpu():
    case = next(c for c in TEST_CASES if c.name == "nondiv_13to7_channels_last")
    args, kw = SPEC.make_inputs(case, CPU)
    assert differing_bits(aap.torch_autograd_backward(*args, **kw), aap.torch_backward(*args, **kw)).size == 0


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels against their models and torch's CUDA backward

CUDA = torch.device("cuda")
REPEATS = 50


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_tree_bitwise_repeatable_and_equals_model(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    first = TREE(*args, **kw)
    assert layout_ok(first, args[0])
    for _ in range(REPEATS):
        assert bitwise_equal(bits_t(TREE(*args, **kw)), bits_t(first))
    diff = differing_bits(first, TREE(*cpu_args, **kw))
    assert diff.size == 0, f"CUDA tree differs from its CPU model at {diff[:10]}"
    direct = aap.adaptive_avg_pool2d_bwd_tree_direct_cuda(*args, **kw)  # shares computed on the spot
    diff = differing_bits(direct, TREE(*cpu_args, **kw))
    assert diff.size == 0, f"tree's direct kernel differs from its CPU model at {diff[:10]}"
    tiled = aap.adaptive_avg_pool2d_bwd_tree_tiled_cuda(*args, **kw)  # never the exact kernel
    diff = differing_bits(tiled, TREE(*cpu_args, **kw))
    assert diff.size == 0, f"tree's tiled kernel differs from its CPU model at {diff[:10]}"


@pytest.mark.gpu
@pytest.mark.parametrize("c, offset", [(8, 0), (8, 1), (6, 0)], ids=["vec4", "misaligned", "c6"])
def test_gpu_exact_kernel_all_widths_equal_tiled(c, offset, cuda_sync):
    """The exact kernel (windows tiling dx: 28 -> 7 and 8x6 -> 4x2 here) in channels_last: four channels
    per thread where C % 4 == 0 and both tensors are 16-byte aligned, one otherwise (a dy starting one
    float into its storage, C = 6); NCHW beside it. Every form gives the tiled kernel's bits."""
    g = torch.Generator().manual_seed(7000 + c + offset)
    for (h, w), (oh, ow) in (((28, 28), (7, 7)), ((8, 6), (4, 2))):
        assert aap.exact_windows(h, w, oh, ow)
        n = 3
        flat = torch.randn(n * c * oh * ow + offset, generator=g).to(CUDA)
        dy = flat[offset:].view(n, oh, ow, c).permute(0, 3, 1, 2)   # channels_last, storage offset
        assert dy.is_contiguous(memory_format=torch.channels_last) and (dy.data_ptr() % 16 == 0) == (offset == 0)
        for x in (dy, dy.contiguous()):
            out = TREE(x, input_size=(h, w))
            ref = aap.adaptive_avg_pool2d_bwd_tree_tiled_cuda(x, input_size=(h, w))
            assert bitwise_equal(bits_t(out), bits_t(ref)), (c, offset, h, w, x.is_contiguous())
            diff = differing_bits(out, TREE(x.cpu(), input_size=(h, w)))
            assert diff.size == 0, f"exact kernel differs from the CPU model at {diff[:10]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in TEST_CASES if c.name.startswith(("tiles", "nondiv_13"))],
                         ids=lambda c: c.name)
def test_gpu_tiled_one_block_looping_over_all_tiles(case, monkeypatch, cuda_sync):
    """The tiled kernel's blocks loop over tiles when there are more tiles than resident blocks: with
    one block for the whole tensor every tile after the first reuses the shared memory, and a missing
    barrier or a stale share would change bits."""
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    p = case.params
    plan = aap.tree_plan(p["n"], p["c"], p["h"], p["w"], p["oh"], p["ow"], aap.suggest_layout(cpu_args[0]))
    assert plan is not None and plan[-1] >= 2, plan  # the tiled kernel runs, with several tiles
    monkeypatch.setattr(aap, "BLOCKS_PER_SM", 0)  # max(1, min(tiles, 0)) = one block
    diff = differing_bits(TREE(*args, **kw), TREE(*cpu_args, **kw))
    assert diff.size == 0, f"one-block tiled tree differs from its CPU model at {diff[:10]}"


def bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # NaN-safe bitwise comparison with torch.equal


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
    """Negative control: 4x4 -> 28x28, 64 windows per element. The atomic kernel gives several
    results over the repeats; tree gives one."""
    base = next(c for c in SPEC.bench_cases("gpu") if c.name.startswith("up_4to28"))
    case = kernels.Case(OP, base.name, dict(base.params, layout=layout), seed=base.seed)
    args, kw = SPEC.make_inputs(case, CUDA)
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(REPEATS)}
    print(f"{case.name} {layout}: atomic {len(atomic)} distinct / {REPEATS}")
    assert len(atomic) > 1
    assert len({float32_bits(TREE(*args, **kw)).tobytes() for _ in range(REPEATS)}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in TEST_CASES if aap.suggest_layout(
    SPEC.make_inputs(c, CPU)[0][0]) == "nchw"], ids=lambda c: c.name)
def test_gpu_equals_torch_cuda_where_order_cannot_matter(case, cuda_sync):
    """torch's CUDA NCHW backward adds (dy / kW) / kH atomically: on elements with <= 2 contributions its
    bits are fixed, and tree must give them (this checks the division order on the GPU)."""
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    theirs = aap.torch_backward(*args, **kw)
    few = element_counts(cpu_args[0], kw) <= 2
    tiny = np.abs(theirs.cpu().numpy()) < np.finfo(np.float32).tiny
    diff = differing_bits(TREE(*args, **kw), theirs, where=few & ~tiny)
    assert diff.size == 0, f"tree differs from torch's CUDA backward at {diff[:10]}"
    check_bound(theirs.cpu(), cpu_args, kw, flushes=True)  # torch's CUDA atomicAdd flushes subnormals


@pytest.mark.gpu
def test_gpu_torch_deterministic_mode_refuses_or_runs_mean():
    """What the benchmark records as unavailable: torch raises for this backward in deterministic mode,
    except through F.adaptive_avg_pool2d to (1, 1), which is mean."""
    from bench.timing import torch_mode

    dy = torch.randn(2, 3, 7, 7, device=CUDA)
    with torch_mode("deterministic"):
        with pytest.raises(RuntimeError, match="deterministic"):
            aap.torch_backward(dy, input_size=(13, 13))
        head = aap.torch_autograd_backward(torch.randn(2, 3, 1, 1, device=CUDA), input_size=(7, 7))
    assert head.shape == (2, 3, 7, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tree", "atomic"])
def test_gpu_runs_on_torch_current_stream(variant, cuda_sync):
    """dy is rewritten on a side stream behind a long sleep; a kernel launched on another stream would
    read the old dy."""
    case = next(c for c in TEST_CASES if c.name == "nondiv_13to7_nchw")
    (dy,), kw = SPEC.make_inputs(case, CUDA)
    new_dy = torch.randn(dy.shape, generator=torch.Generator().manual_seed(99))
    expected = TREE(new_dy, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf = dy.clone()
        torch.cuda._sleep(50_000_000)
        buf.copy_(new_dy.to(CUDA, non_blocking=False))
        out = kernels.get(OP, variant)(buf, **kw)
    side.synchronize()
    few = element_counts(new_dy, kw) <= 2
    assert differing_bits(out, expected, where=few).size == 0
    check_bound(out.cpu(), (new_dy,), kw, flushes=True)
