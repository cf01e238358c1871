"""The ``fixed`` variant of the three scatter sums (index_add, scatter_add, embedding_bwd; segsum.cuh):
order-independent fixed-point sums. CPU model against float64 within the bound its arithmetic gives,
against an independent exact (rational) computation, invariance under any permutation of the source
rows, range limits, and (on a GPU) the CUDA kernels against the model, bitwise.

Error bound: with shift s every finite term v becomes rint(v 2^s), off by <= 2^-(s+1); an element's k
terms sum exactly; the integer is rounded once to float32 (relative 2^-24, or an absolute 2^-150 where
the result is subnormal). So |out - exact| <= k 2^-(s+1) + 2^-24 (|exact| + k 2^-(s+1)) + 2^-150.
"""
from __future__ import annotations

from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
import torch

import kernels
from kernels import index_add as ia
from tests.segsum_checks import bad_index_case, poison_allocator
from tests.helpers import differing_bits, float32_bits

OPS = ("index_add", "scatter_add", "embedding_bwd")
CPU = torch.device("cpu")
CASES = [(op, c) for op in OPS for c in kernels.spec(op).test_cases()]
CASE_IDS = [f"{op}-{c.name}" for op, c in CASES]


def terms(op: str, args: tuple, kw: dict):
    """(dst, float64 terms, N source rows, finite src) of a call, written out from the op's definition:
    flat destination element and exact term of every contribution (embedding: the scaled term as the
    kernels round it, one float32 division)."""
    if op == "embedding_bwd":
        grad, indices = args
        d = grad.shape[-1]
        key = indices.reshape(-1).numpy()
        vals = grad.reshape(-1, d).numpy().astype(np.float32)
        src = vals
        if kw.get("scale_grad_by_freq"):
            vals = ia.scaled_values(key, vals, kw["num_weights"])
        keep = key != kw.get("padding_idx", -1)
        dst = (key[keep, None] * d + np.arange(d)).reshape(-1)
        return dst, vals[keep].reshape(-1).astype(np.float64), src.shape[0], src
    index, src = args
    src = src.contiguous().numpy()
    d = src.shape[1]
    index = index.numpy()
    if index.ndim == 1:
        dst = (index[:, None] * d + np.arange(d)).reshape(-1)
    else:
        dst = (index * d + np.arange(d)).reshape(-1)
    return dst, src.reshape(-1).astype(np.float64), src.shape[0], src


def shift_of(src: np.ndarray, n: int) -> int:
    finite = np.abs(src[np.isfinite(src)])
    return ia.fixed_shift(finite.max() if finite.size else 0.0, n)


def out_shape(op, args, kw):
    if op == "embedding_bwd":
        return kw["num_weights"], args[0].shape[-1]
    return kw["num_rows"], args[1].shape[1]


def round_int_to_f32(q: int) -> Fraction:
    """q rounded to 24 significant bits, to nearest, ties to even (integer arithmetic only)."""
    sign, a = (-1 if q < 0 else 1), abs(q)
    drop = max(a.bit_length() - 24, 0)
    if drop:
        keep, rest = a >> drop, a & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        keep += rest > half or (rest == half and keep & 1)
        a = keep << drop
    return Fraction(sign * a)


# --------------------------------------------------------------------------------------------------
# CPU


def outside_bound(op: str, args: tuple, kw: dict, out: torch.Tensor) -> np.ndarray:
    """Flat positions where ``out`` breaks the module docstring's bound against the exact sum (finite
    references), or where its NaNs and infinities differ from the float64 reference's."""
    dst, vals, n, src = terms(op, args, kw)
    s = shift_of(src, n)
    space = out.numel()
    fin = np.isfinite(vals)
    count = np.bincount(dst, minlength=space).astype(np.float64)
    exact = np.zeros(space)
    np.add.at(exact, dst[fin], vals[fin])  # float64: its own error, <= k 2^-52 sum|v|, is added to the bound
    absum = np.zeros(space)
    np.add.at(absum, dst[fin], np.abs(vals[fin]))
    grid = count * 2.0 ** -(s + 1)
    bound = grid + 2.0**-24 * (np.abs(exact) + grid) + 2.0**-150 + count * 2.0**-52 * absum
    ref = kernels.spec(op).reference(args, kw).reshape(-1).numpy()
    got = out.reshape(-1).double().numpy()
    ok = np.isfinite(ref)
    bad = ok & ~(np.abs(got - np.where(ok, exact, 0.0)) <= bound)
    bad |= np.isnan(got) != np.isnan(ref)
    bad |= np.isinf(ref) & (got != ref)
    return np.nonzero(bad)[0]


@pytest.mark.parametrize("op,case", CASES, ids=CASE_IDS)
def test_model_within_bound_of_float64(op, case):
    args, kw = kernels.spec(op).make_inputs(case, CPU)
    out = kernels.get(op, "fixed")(*args, **kw)
    assert out.shape == out_shape(op, args, kw) and out.dtype == torch.float32 and out.is_contiguous()
    bad = outside_bound(op, args, kw, out)
    assert bad.size == 0, f"outside the bound at {bad[:10]}"


def test_bound_rejects_a_dropped_term_negative_control():
    spec = kernels.spec("scatter_add")
    case = next(c for c in spec.test_cases() if c.name == "elem_d17")
    (index, src), kw = spec.make_inputs(case, CPU)
    out = kernels.get("scatter_add", "fixed")(index, src, **kw)
    out[index[0, 3], 3] -= src[0, 3]  # one term left out
    assert outside_bound("scatter_add", (index, src), kw, out).tolist() == [int(index[0, 3]) * 17 + 3]


RATIONAL = {("index_add", "cancel_d32_dup100"), ("index_add", "d4_dup100_two_levels"), ("index_add", "infnan_d16"),
            ("scatter_add", "elem_d5_dup100_two_levels"), ("scatter_add", "cancel_bcast_d32_dup100"),
            ("embedding_bwd", "scale_dup50"), ("embedding_bwd", "scale_pad_dup100"), ("embedding_bwd", "pad_hot_row")}


@pytest.mark.parametrize("op,case", [(o, c) for o, c in CASES if (o, c.name) in RATIONAL],
                         ids=lambda x: getattr(x, "name", x))
def test_model_equals_exact_rational_computation(op, case):
    """Every output element from Python integers and Fractions: rint(v 2^s) per term (ties to even),
    exact sums, one rounding to 24 bits, times 2^-s; this also checks NumPy's int64 -> float32 cast."""
    spec = kernels.spec(op)
    args, kw = spec.make_inputs(case, CPU)
    out = kernels.get(op, "fixed")(*args, **kw).reshape(-1).numpy()
    dst, vals, n, src = terms(op, args, kw)
    s = shift_of(src, n)
    sums: dict[int, int] = {}
    for j, v in zip(dst.tolist(), vals.tolist()):
        if np.isfinite(v):
            sums[j] = sums.get(j, 0) + round(Fraction(v) * Fraction(2) ** s)  # round(): ties to even
    assert np.isfinite(out).sum() > out.size // 2
    for j in range(out.size):
        if not np.isfinite(out[j]):
            continue
        want = round_int_to_f32(sums.get(j, 0)) / Fraction(2) ** s
        assert Fraction(float(out[j])) == want, (j, out[j], float(want))


@pytest.mark.parametrize("op,case", [(o, c) for o, c in CASES if c.name.startswith(("cancel", "d4_dup100", "elem_d5",
                                                                                    "scale_dup50", "infnan"))],
                         ids=lambda x: getattr(x, "name", x))
def test_bits_do_not_depend_on_the_order_of_source_rows(op, case):
    spec = kernels.spec(op)
    args, kw = spec.make_inputs(case, CPU)
    fixed = kernels.get(op, "fixed")
    first = fixed(*args, **kw)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        if op == "embedding_bwd":
            grad, indices = args
            perm = torch.randperm(indices.numel(), generator=g)
            permuted = (grad.reshape(-1, grad.shape[-1])[perm], indices.reshape(-1)[perm])
        else:
            perm = torch.randperm(args[0].shape[0], generator=g)
            permuted = (args[0][perm], args[1][perm])
        assert differing_bits(first, fixed(*permuted, **kw)).size == 0


def test_source_order_changes_the_sorted_bits_negative_control():
    """The permutation above is a real test: the fixed-order variant gives other bits on the same
    permuted rows."""
    spec = kernels.spec("index_add")
    case = next(c for c in spec.test_cases() if c.name == "cancel_d32_dup100")
    (index, src), kw = spec.make_inputs(case, CPU)
    perm = torch.randperm(index.numel(), generator=torch.Generator().manual_seed(5))
    sorted_ = kernels.get("index_add", "sorted")
    assert differing_bits(sorted_(index, src, **kw), sorted_(index[perm], src[perm], **kw)).size > 0


def test_shift_keeps_every_sum_inside_int64():
    """s = 62 - ceil(log2 N) - E (max |src| < 2^E): the largest term is below 2^(62 - c) units and N such
    terms below 2^62."""
    assert ia.fixed_shift(0.0, 10) == 0
    assert ia.fixed_shift(1.0, 1) == 61                      # 1 < 2^1
    assert ia.fixed_shift(0.75, 1000) == 62 - 10 - 0         # 0.75 < 2^0, ceil(log2 1000) = 10
    assert ia.fixed_shift(1.0, 1024) == 62 - 10 - 1
    assert ia.fixed_shift(1.0, 1025) == 62 - 11 - 1
    tiny = float(np.float32(1e-45))                          # subnormal: < 2^-126
    assert ia.fixed_shift(tiny, 1) == 62 + 126
    big = float(np.finfo(np.float32).max)
    for n in (1, 2, 1000, 2**20 + 1):
        s = ia.fixed_shift(big, n)
        assert n * Fraction(big) * Fraction(2) ** s < 2**62 < 2**63


def test_range_limits_sum_exactly_and_overflow_only_at_the_end():
    """Terms near float32's largest value: an element whose exact sum fits float32 gets it exactly,
    whatever order a float32 sum would have overflowed in; one whose exact sum does not is +Inf."""
    big = float(np.finfo(np.float32).max)
    src = torch.tensor([[big], [big], [-big], [-big], [big], [big], [1.0]], dtype=torch.float32)
    index = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    out = kernels.get("index_add", "fixed")(index, src, num_rows=2)
    assert out[0, 0].item() == big       # big + big - big - big + big: no intermediate overflow
    assert out[1, 0].item() == big       # big + 1 rounds to big
    out = kernels.get("index_add", "fixed")(torch.tensor([0, 0]), src[:2], num_rows=1)
    assert out[0, 0].item() == float("inf")


def test_nonfinite_and_signed_zero_rules():
    inf, nan = float("inf"), float("nan")
    src = torch.tensor([[inf], [1.0], [inf], [-inf], [nan], [2.0], [-inf], [-0.0], [-0.0], [5.0], [-5.0]])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 5])
    out = kernels.get("index_add", "fixed")(index, src, num_rows=7)[:, 0]
    assert out[0].item() == inf and out[3].item() == -inf
    assert np.isnan(out[1].item()) and np.isnan(out[2].item())
    assert float32_bits(out[4:]).tolist() == [0, 0, 0]  # -0.0 terms, cancelling terms, no terms: +0.0


def test_subnormal_terms_are_kept():
    """The fixed variant does not flush (float atomicAdd would): a lone subnormal maximum term is exact."""
    tiny = np.float32(3e-42)
    src = torch.tensor([[float(tiny)], [float(tiny)]])
    out = kernels.get("index_add", "fixed")(torch.tensor([0, 1]), src, num_rows=2)
    assert out[0, 0].item() == float(tiny) == out[1, 0].item()


def test_binned_layout_covers_the_destinations_in_at_most_512_bins():
    """fbin_layout: bins of 2^bb destinations (FBIN_WIDTH_MIN to 4096: four 32-bit limb sums each, 64 KB),
    nb of them covering the space with none empty at the end, and nbits low bits of the bin number
    telling every bin apart (seg_same_bits takes at most 9)."""
    for space in (1, 7, 1023, 1024, 1025, 320_000, 512 * 1024, 512 * 1024 + 1, 512 * 4096):
        bb, nb, nbits = ia.fbin_layout(space)
        width = 1 << bb
        assert ia.FBIN_WIDTH_MIN <= width <= ia.FBIN_WIDTH_MAX
        assert (nb - 1) * width < space <= nb * width and 1 <= nb <= 1 << ia.FBIN_BITS
        assert nb <= 1 << nbits <= max(1, 2 * nb - 1)
    assert ia.fbin_layout(320_000) == (12, 79, 7)     # 10000 rows of 32
    assert ia.fbin_layout(1) == (12, 1, 0)
    for space in (0, 512 * 4096 + 1):
        with pytest.raises(ValueError, match="the binned schedule takes 1 to 2097152"):
            ia.fbin_layout(space)


def test_fixed_schedule_bins_only_the_dense_element_form():
    ok = dict(elementwise=True)
    assert ia.fixed_schedule(262144 * 32, 10000 * 32, **ok) == "binned"        # the element bench cases
    assert ia.fixed_schedule(1_000_000 * 64, 100_000 * 64, elementwise=False, src_rows=10**6) == "direct"  # row form
    assert ia.fixed_schedule(4 * 1000, 1000, **ok) == "binned"
    assert ia.fixed_schedule(4 * 1000 - 1, 1000, **ok) == "direct"             # too few terms per destination
    assert ia.fixed_schedule(2**31, 1000, **ok) == "direct"                    # element numbers beyond int
    assert ia.fixed_schedule(2**30, 512 * 4096 + 1, **ok) == "direct"          # more than 512 bins of 4096
    assert ia.fixed_schedule(4000, 1000, elementwise=True, plain=False) == "direct"


def test_fixed_schedule_compacts_the_row_form_with_fewer_source_rows_than_output_rows():
    row = dict(elementwise=False)
    assert ia.fixed_schedule(2048 * 768, 32000 * 768, **row, src_rows=2048) == "compact"   # the audit's small batch
    assert ia.fixed_schedule(16384 * 512, 50000 * 512, **row, plain=False, src_rows=16384) == "compact"
    assert ia.fixed_schedule(50000 * 128, 50000 * 128, **row, src_rows=50000) == "direct"  # as many rows
    with pytest.raises(ValueError, match="the row form needs src_rows"):
        ia.fixed_schedule(2048 * 768, 32000 * 768, **row)
    assert ia.fixed_schedule(2**31 * 2, 2**33 * 2, **row, src_rows=2**31) == "direct"       # past COMPACT_MAX_ROWS
    assert ia.fixed_schedule(4000, 100000, elementwise=True, src_rows=40) == "direct"       # element form
    assert ia.compact_takes(ia.COMPACT_MAX_ROWS, elementwise=False)
    assert not ia.compact_takes(ia.COMPACT_MAX_ROWS + 1, elementwise=False)
    assert not ia.compact_takes(10, elementwise=True)


def test_schedule_argument_is_checked_before_any_launch():
    index, src = torch.zeros(4, 3, dtype=torch.int64), torch.ones(4, 3)
    with pytest.raises(kernels.KernelArgumentError, match="argument 'schedule': expected one of"):
        ia.segsum_fixed_cuda("scatter_add.cu", "scatter_add", index, src, 2, elementwise=True, schedule="tree")
    with pytest.raises(kernels.KernelArgumentError, match="'binned' takes the element form only"):
        ia.segsum_fixed_cuda("index_add.cu", "index_add", index[:, 0], src, 2, schedule="binned")
    with pytest.raises(kernels.KernelArgumentError, match="'compact' takes the row form only.*the element form"):
        ia.segsum_fixed_cuda("scatter_add.cu", "scatter_add", index, src, 2, elementwise=True, schedule="compact")
    fixed_cpu = kernels.scatter_add.scatter_add_fixed_cpu
    with pytest.raises(kernels.KernelArgumentError, match="scatter_add: argument 'schedule'"):
        fixed_cpu(index, src, num_rows=2, schedule="fast")
    want = fixed_cpu(index, src, num_rows=2)  # every name accepted; the model's bits are every schedule's
    assert all(differing_bits(fixed_cpu(index, src, num_rows=2, schedule=s), want).size == 0 for s in ia.SCHEDULES)
    for op, args, kw in (("index_add", (index[:, 0], src), {"num_rows": 2}),
                         ("embedding_bwd", (src, index[:, 0]), {"num_weights": 2})):
        cpu = kernels.get(op, "fixed").cpu
        with pytest.raises(kernels.KernelArgumentError, match=f"{op}: argument 'schedule': expected one of"):
            cpu(*args, **kw, schedule="fast")
        want = cpu(*args, **kw)
        assert all(differing_bits(cpu(*args, **kw, schedule=s), want).size == 0 for s in ia.SCHEDULES)


# --------------------------------------------------------------------------------------------------
# GPU

CUDA = torch.device("cuda")
REPEATS = 30


@pytest.mark.gpu
@pytest.mark.parametrize("op,case", CASES, ids=CASE_IDS)
def test_gpu_bitwise_repeatable_and_equals_model(op, case, cuda_sync):
    spec = kernels.spec(op)
    fixed = kernels.get(op, "fixed")
    args, kw = spec.make_inputs(case, CUDA)
    cpu_args, _ = spec.make_inputs(case, CPU)
    first = fixed(*args, **kw)
    for _ in range(REPEATS):
        assert differing_bits(first, fixed(*args, **kw)).size == 0
    diff = differing_bits(first, fixed(*cpu_args, **kw))
    assert diff.size == 0, f"CUDA fixed differs from its CPU model at {diff[:10]}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_bench_size_repeatable_order_free_and_equals_model(op, cuda_sync):
    """The largest-contention bench case: 1 distinct result in 20 repeats and under a permutation of the
    source rows, the model's bits; the atomic variant on the same input varies (negative control)."""
    spec = kernels.spec(op)
    case = next(c for c in spec.bench_cases("gpu") if c.params.get("dup") == 0.5)
    args, kw = spec.make_inputs(case, CUDA)
    fixed = kernels.get(op, "fixed")
    seen = {float32_bits(fixed(*args, **kw)).tobytes() for _ in range(20)}
    assert len(seen) == 1
    g = torch.Generator().manual_seed(3)
    if op == "embedding_bwd":
        grad, indices = args
        perm = torch.randperm(indices.numel(), generator=g).to(CUDA)
        permuted = (grad.reshape(-1, grad.shape[-1])[perm], indices.reshape(-1)[perm])
    else:
        perm = torch.randperm(args[0].shape[0], generator=g).to(CUDA)
        permuted = (args[0][perm], args[1][perm])
    assert float32_bits(fixed(*permuted, **kw)).tobytes() in seen
    cpu_args, _ = spec.make_inputs(case, CPU)
    assert float32_bits(fixed(*cpu_args, **kw)).tobytes() in seen
    atomic = {float32_bits(kernels.get(op, "atomic")(*args, **kw)).tobytes() for _ in range(5)}
    print(f"{op} {case.name}: atomic {len(atomic)} distinct / 5, fixed 1 / 20")
    assert len(atomic) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["direct", "compact"])
@pytest.mark.parametrize("largest", [64.0, 1e30])
def test_gpu_unchecked_bad_indices_add_nothing(schedule, largest, cuda_sync):
    """The largest |src| sits on a bad index: 64 sets the shift (the terms keep nonzero integers), 1e30 sets
    it so coarse that every other term rounds to 0 (only a max that counts the bad rows gives all zeros)."""
    index, src, keep = bad_index_case(40)
    src[int(torch.nonzero(~keep)[0, 0]), 0] = largest
    fixed = kernels.index_add.index_add_fixed_cuda
    # the shift depends on N and max |src| over all rows: the model gets the same rows, bad ones zeroed
    # out of the sum by a padding row it then drops
    out = fixed(index.to(CUDA), src.to(CUDA), num_rows=40, check_range=False, schedule=schedule)
    want = ia.segsum_cpu("fixed", torch.where(keep, index, 40), src, 41, skip=40)[:40]
    assert differing_bits(out, want).size == 0
    assert (torch.count_nonzero(want) > 0) == (largest == 64.0)   # what the case exercises
    with pytest.raises(kernels.KernelArgumentError, match="index -5 is out of range for 40 rows"):
        fixed(index.to(CUDA), src.to(CUDA), num_rows=40, schedule=schedule)


# The row form's schedules (index_add, embedding_bwd, scatter_add with an expanded index) on every test
# case: direct and compact give the model's bits, repeatably. Compact's zero fill runs on a second stream
# beside the sums: the bitwise comparison catches a destination written out of order with it (its zeros
# over a sum); the NaN-poisoned allocation, where the caching allocator hands it back, one it missed.
ROW_FORM = [(op, c) for op, c in CASES if op != "scatter_add" or c.params.get("broadcast")]



@pytest.mark.gpu
@pytest.mark.parametrize("schedule,fill_blocks", [("direct", None), ("compact", None), ("compact", 1)])
@pytest.mark.parametrize("op,case", ROW_FORM, ids=[f"{op}-{c.name}" for op, c in ROW_FORM])
def test_gpu_row_form_schedules_give_the_model_bits(op, case, schedule, fill_blocks, cuda_sync):
    """``fill_blocks``: the compact schedule's zero fill on one block an SM (a longer fill: the sums wait for
    it longer), or at its default."""
    spec = kernels.spec(op)
    args, kw = spec.make_inputs(case, CUDA)
    cpu_args, _ = spec.make_inputs(case, CPU)
    want = float32_bits(kernels.get(op, "fixed")(*cpu_args, **kw)).tobytes()
    fixed = kernels.get(op, "fixed").cuda   # the launcher itself: it takes schedule=
    seen = set()
    with mock.patch.object(ia, "COMPACT_ZERO_BLOCKS_PER_SM", fill_blocks or ia.COMPACT_ZERO_BLOCKS_PER_SM):
        for _ in range(10):
            poison_allocator(out_shape(op, args, kw))
            seen.add(float32_bits(fixed(*args, **kw, schedule=schedule)).tobytes())
    assert seen == {want}


# The element form's binned schedule (segsum.cuh) against the direct one: the same integers summed, so
# the same bits. Beyond the test table's element cases (width 1 is the row form): bins over several
# pages (24 bins of about 53000 terms: 4 pages each, tiles' runs crossing page ends), a hot row (90% of
# each column on one row: one of 10 bins holds most terms), 440 bins (most of the 512 allowed, mostly
# one partly full page each), and the bench's element cases.
BINNED = [c for op, c in CASES
          if op == "scatter_add" and not c.params.get("broadcast") and c.params["d"] > 1] + [
    kernels.scatter_add._case(name, 7100 + i, **p) for i, (name, p) in enumerate((
        ("bins_of_4_pages", dict(n=40000, d=32, m=3000)),
        ("hot_row_dup90", dict(n=20000, d=8, m=5000, dup=0.9)),
        ("most_bins", dict(n=3000, d=300, m=6000, dup=0.1)),
    ))] + [c for c in kernels.spec("scatter_add").bench_cases("gpu") if not c.params.get("broadcast")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", BINNED, ids=[c.name for c in BINNED])
def test_gpu_binned_schedule_repeats_the_direct_bits(case, cuda_sync):
    spec = kernels.spec("scatter_add")
    fixed = kernels.scatter_add.scatter_add_fixed_cuda
    args, kw = spec.make_inputs(case, CUDA)
    want = float32_bits(fixed(*args, **kw, schedule="direct")).tobytes()
    assert {float32_bits(fixed(*args, **kw, schedule="binned")).tobytes() for _ in range(10)} == {want}
    if case.params["n"] * case.params["d"] <= 2**21:  # the model's bits too (the bench sizes: above)
        cpu_args, _ = spec.make_inputs(case, CPU)
        assert float32_bits(kernels.scatter_add.scatter_add_fixed_cpu(*cpu_args, **kw)).tobytes() == want


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["direct", "binned"])
def test_gpu_element_form_unchecked_bad_indices_add_nothing(schedule, cuda_sync):
    """Bad indices skipped by every launch of both element-form schedules; their elements still count in max |src|
    (the shift), as the model sees them through a padding row it then drops."""
    g = torch.Generator().manual_seed(12)
    index = ia.draw_index(g, (3000, 20), 40, 0.2)
    src = ia.draw_values(g, (3000, 20))
    bad = torch.randperm(index.numel(), generator=g)[:400]
    index.view(-1)[bad[:200]] = -5
    index.view(-1)[bad[200:]] = 40 + torch.arange(200)
    src.view(-1)[bad[0]] = 1e30  # the largest |src| sits on a bad index: it sets the shift alone
    keep = (index >= 0) & (index < 40)
    out = kernels.scatter_add.scatter_add_fixed_cuda(index.to(CUDA), src.to(CUDA), num_rows=40, check_range=False,
                                                     schedule=schedule)
    want = ia.segsum_cpu("fixed", torch.where(keep, index, 40), src, 41, elementwise=True)[:40]
    assert differing_bits(out, want).size == 0
