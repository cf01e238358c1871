"""scatter_add: CPU order models against float64 and the documented order (row form for an expanded
index, element form otherwise), bad inputs, and (on a GPU) the kernels against their models, bitwise.
Error bound as in test_index_add.py: gamma(k - 1) * sum |term| for k contributions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import index_add as ia
from kernels import scatter_add as sa
from tests.segsum_checks import (check_atomic_some_order, check_bound, check_some_order, check_sorted_repeatable,
                                 poison_allocator, spec_sorted, split_runs)
from tests.helpers import differing_bits, float32_bits

OP = "scatter_add"
SPEC = kernels.spec(OP)
SORTED = kernels.get(OP, "sorted")
ATOMIC = kernels.get(OP, "atomic")
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]


def stats(args, kw):
    index, src = args
    return ia.contributions(index.contiguous(), src, kw["num_rows"], elementwise=True)


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_models_within_bound_and_torch_agrees(case):
    args, kw = SPEC.make_inputs(case, CPU)
    ref = SPEC.reference(args, kw)
    _, count, abs_sum = stats(args, kw)
    s = SORTED(*args, **kw)
    assert s.shape == (kw["num_rows"], args[1].shape[1]) and s.dtype == torch.float32
    check_bound(s, ref, count, abs_sum)
    a = ATOMIC(*args, **kw, rng=case.seed)
    check_bound(a, ref, count, abs_sum)
    check_some_order(a, s, count)
    check_bound(sa.torch_scatter_add(*args, **kw), ref, count, abs_sum)


@pytest.mark.parametrize("case", [c for c in TEST_CASES if c.params["n"] * c.params["d"] <= 20000 or "long" in c.name],
                         ids=lambda c: c.name)
def test_sorted_model_is_the_documented_order(case):
    (index, src), kw = SPEC.make_inputs(case, CPU)
    d, m = src.shape[1], kw["num_rows"]
    keys = (index.contiguous().numpy() * d + np.arange(d)).reshape(-1)  # destination (index, column)
    want = spec_sorted(keys, src.contiguous().numpy().reshape(-1, 1), m * d).reshape(m, d)
    diff = differing_bits(SORTED(index, src, **kw), torch.from_numpy(want))
    assert diff.size == 0, f"model and documented order differ at {diff[:10]}"


def test_expanded_index_takes_the_row_form_with_the_same_bits():
    """An expanded index (stride 0) runs index_add's row form; a materialised copy of it the element
    form. Both orders are 'each destination in source order', so the bits agree, and equal index_add's."""
    case = next(c for c in TEST_CASES if c.name == "bcast_d64_dup50")
    (index, src), kw = SPEC.make_inputs(case, CPU)
    assert index.stride(1) == 0
    assert sa._prologue(index, src, kw["num_rows"])[3] is False            # row form
    assert sa._prologue(index.contiguous(), src, kw["num_rows"])[3] is True  # element form
    row = SORTED(index, src, **kw)
    assert np.array_equal(float32_bits(row), float32_bits(SORTED(index.contiguous(), src, **kw)))
    assert np.array_equal(float32_bits(row), float32_bits(kernels.get("index_add", "sorted")(index[:, 0], src, **kw)))


def test_atomic_model_varies_with_order_negative_control():
    case = next(c for c in TEST_CASES if c.name == "cancel_bcast_d32_dup100")
    args, kw = SPEC.make_inputs(case, CPU)
    assert len({float32_bits(ATOMIC(*args, **kw, rng=s)).tobytes() for s in range(10)}) >= 5
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(3)}) == 1


def test_empty_and_negative_zero():
    for v in (SORTED, ATOMIC):
        out = v(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4), num_rows=3)
        assert out.shape == (3, 4) and (float32_bits(out) == 0).all()
        idx = torch.tensor([[0, 1], [0, 1], [2, 1]])
        out = v(idx, torch.full((3, 2), -0.0), num_rows=3, rng=0)
        assert (float32_bits(out) == 0).all(), v.key


BAD = [
    ("index", (torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 3)), {"num_rows": 5}),
    ("index", (torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": 5}),
    ("src", (torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, 3, dtype=torch.float64)), {"num_rows": 5}),
    ("num_rows", (torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, 3)), {"num_rows": 2.0}),
]


@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(arg, args, kw):
    for v in (SORTED, ATOMIC):
        with pytest.raises(KernelArgumentError, match=f"^{OP}: argument '{arg}'"):
            v(*args, **kw)


@pytest.mark.parametrize("expanded", [False, True])
def test_out_of_range_index_names_the_value(expanded):
    index = torch.tensor([0, 9, 2])[:, None].expand(3, 4) if expanded else torch.tensor([[0, 1], [9, 2], [1, 1]])
    with pytest.raises(KernelArgumentError, match="index 9 is out of range for 5 rows"):
        SORTED(index, torch.zeros(index.shape), num_rows=5)


def test_spec_tables():
    gpu = SPEC.bench_cases("gpu")
    assert sorted({c.params["dup"] for c in gpu}) == [0.01, 0.5, 1.0]
    assert {bool(c.params.get("broadcast")) for c in gpu} == {True, False}
    assert set(SPEC.peers()) == {"torch"}


# --------------------------------------------------------------------------------------------------
# GPU

CUDA = torch.device("cuda")
REPEATS = 50


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_sorted_bitwise_repeatable_and_equals_model(case, cuda_sync):
    first, _, args, kw = check_sorted_repeatable(SPEC, SORTED, case, REPEATS)
    key, src, rows, elementwise = sa._prologue(*args, kw["num_rows"])
    for split, group in split_runs(not elementwise and src.shape[1] >= ia.SCALAR_BELOW_D):
        poison_allocator((rows, src.shape[1]))  # rows, tiles, gaps, once: a row they missed is NaN
        out = ia.segsum_sorted_cuda(sa.SOURCE, OP, key, src, rows, elementwise=elementwise, split=split,
                                    group=group)
        assert differing_bits(out, first).size == 0, (split, group)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_atomic_is_some_order(case, cuda_sync):
    check_atomic_some_order(SPEC, SORTED, ATOMIC, case, stats)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in SPEC.bench_cases("gpu") if c.params["dup"] == 1.0], ids=lambda c: c.name)
def test_gpu_hot_row_sorted_repeatable_atomic_varies(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(10)}) == 1
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(10)}
    print(f"{case.name}: atomic {len(atomic)} distinct / 10")
    assert len(atomic) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [13107, 13108])
def test_gpu_element_form_key_width_boundary(rows, cuda_sync):
    """Element form with D = 5: 13107 rows is 65535 destinations (16-bit keys, the sentinel at the
    limit), 13108 rows takes 32-bit keys. The last row hot, every output element written (the
    allocator's next block holds NaN), bits equal to the model."""
    g = torch.Generator().manual_seed(rows)
    index = torch.randint(0, rows, (900, 5), generator=g)
    index[torch.rand(900, 5, generator=g) < 0.2] = rows - 1
    src = torch.randn(900, 5, generator=g)
    want = SORTED(index, src, num_rows=rows)
    junk = torch.full((rows, 5), float("nan"), device=CUDA)
    del junk
    diff = differing_bits(SORTED(index.to(CUDA), src.to(CUDA), num_rows=rows), want)
    assert diff.size == 0, f"CUDA sorted differs from its CPU model at {diff[:10]}"
