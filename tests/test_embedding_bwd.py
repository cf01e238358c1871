"""embedding_bwd: CPU order models against float64, the documented order and aten's backward; padding_idx
and scale_grad_by_freq; bad inputs; and (on a GPU) the kernels against their models, bitwise.

Error bound: gamma(k - 1) * sum |term| for k terms (test_index_add.py); with scale_grad_by_freq each
term is first rounded by its division, so gamma(k) * sum |exact term| (index_add.error_bound)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import embedding_bwd as eb
from kernels import index_add as ia
from tests.segsum_checks import (check_atomic_some_order, check_bound, check_some_order, check_sorted_repeatable,
                                 poison_allocator, spec_sorted, split_runs)
from tests.helpers import bitwise_equal, differing_bits, float32_bits

OP = "embedding_bwd"
SPEC = kernels.spec(OP)
SORTED = kernels.get(OP, "sorted")
ATOMIC = kernels.get(OP, "atomic")
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]


def stats(args, kw):
    grad, indices = args
    pad = kw["padding_idx"]
    return ia.contributions(indices.reshape(-1), grad.reshape(-1, grad.shape[-1]), kw["num_weights"],
                            skip=-1 if pad is None else pad, scaled=kw["scale_grad_by_freq"])


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_models_within_bound_and_aten_agrees(case):
    args, kw = SPEC.make_inputs(case, CPU)
    ref = SPEC.reference(args, kw)
    _, count, abs_sum = stats(args, kw)
    scaled = kw["scale_grad_by_freq"]
    s = SORTED(*args, **kw)
    assert s.shape == (kw["num_weights"], args[0].shape[-1]) and s.dtype == torch.float32
    check_bound(s, ref, count, abs_sum, scaled=scaled)
    a = ATOMIC(*args, **kw, rng=case.seed)
    check_bound(a, ref, count, abs_sum, scaled=scaled)
    check_some_order(a, s, count)
    # aten's own backward, within the same bound (it multiplies by 1/count: two roundings per term)
    check_bound(eb.torch_embedding_backward(*args, **kw), ref, count + scaled, abs_sum, scaled=scaled)
    pad = kw["padding_idx"]
    if pad is not None and pad >= 0:
        assert (float32_bits(s[pad]) == 0).all() and (float32_bits(a[pad]) == 0).all()


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_sorted_model_is_the_documented_order(case):
    (grad, indices), kw = SPEC.make_inputs(case, CPU)
    d = grad.shape[-1]
    keys = indices.reshape(-1).numpy()
    vals = grad.reshape(-1, d).numpy()
    if kw["scale_grad_by_freq"]:  # one float32 division per term, by the count of its index
        counts = np.bincount(keys, minlength=kw["num_weights"]).astype(np.float32)
        vals = (vals / counts[keys][:, None]).astype(np.float32)
    want = spec_sorted(keys, vals, kw["num_weights"], skip=kw["padding_idx"])
    diff = differing_bits(SORTED(grad, indices, **kw), torch.from_numpy(want))
    assert diff.size == 0, f"model and documented order differ at {diff[:10]}"


def test_padding_and_scale_semantics():
    """Row 1 is padding; with scale_grad_by_freq row 0 (3 tokens) gets the mean of its gradients'
    thirds, row 2 (1 token) its gradient."""
    indices = torch.tensor([[0, 1, 0], [2, 0, 1]])
    grad = torch.tensor([[[3.0], [5.0], [6.0]], [[7.0], [9.0], [11.0]]])
    for v in (SORTED, ATOMIC):
        out = v(grad, indices, num_weights=4, padding_idx=1, scale_grad_by_freq=True, rng=0)
        assert out[:, 0].tolist() == [6.0, 0.0, 7.0, 0.0], v.key
        out = v(grad, indices, num_weights=4, padding_idx=None, rng=0)
        assert out[:, 0].tolist() == [18.0, 16.0, 7.0, 0.0], v.key
        assert bitwise_equal(out, eb.torch_embedding_backward(grad, indices, num_weights=4))


def test_atomic_model_varies_with_order_negative_control():
    case = next(c for c in TEST_CASES if c.name == "b8x200_d48_dup100")
    args, kw = SPEC.make_inputs(case, CPU)
    assert len({float32_bits(ATOMIC(*args, **kw, rng=s)).tobytes() for s in range(10)}) >= 5
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(3)}) == 1


_G = torch.zeros(2, 3, 4)
_I = torch.zeros(2, 3, dtype=torch.int64)
BAD = [
    ("grad_output", (_G.double(), _I), {"num_weights": 5}),
    ("indices", (_G, _I.int()), {"num_weights": 5}),
    ("indices", (_G, _I[:, :2]), {"num_weights": 5}),
    ("num_weights", (_G, _I), {"num_weights": 0}),
    ("padding_idx", (_G, _I), {"num_weights": 5, "padding_idx": 5}),
    ("padding_idx", (_G, _I), {"num_weights": 5, "padding_idx": -2}),
    ("scale_grad_by_freq", (_G, _I), {"num_weights": 5, "scale_grad_by_freq": 1}),
]


@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(arg, args, kw):
    for v in (SORTED, ATOMIC):
        with pytest.raises(KernelArgumentError, match=f"^{OP}: argument '{arg}'"):
            v(*args, **kw)


def test_out_of_range_index_names_the_value():
    with pytest.raises(KernelArgumentError, match="argument 'indices': index -3 is out of range"):
        SORTED(_G, torch.tensor([[0, -3, 1], [1, 1, 1]]), num_weights=5)


def test_spec_tables():
    gpu = SPEC.bench_cases("gpu")
    assert all((c.params["batch"], c.params["seq"], c.params["d"], c.params["m"]) == (32, 512, 512, 50_000)
               for c in gpu)
    assert sorted({c.params["dup"] for c in gpu}) == [0.01, 0.5, 1.0]
    assert set(SPEC.peers()) == {"torch"}


# --------------------------------------------------------------------------------------------------
# GPU

CUDA = torch.device("cuda")
REPEATS = 50
ONCE_GRIDS = ((1, 3), (1, 8), (2, 8))   # (blocks, tiles per block) forced on segsum_once


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_sorted_bitwise_repeatable_and_equals_model(case, cuda_sync, monkeypatch):
    first, _, args, kw = check_sorted_repeatable(SPEC, SORTED, case, REPEATS)
    key, g, rows, skip = eb._prologue(*args, kw["num_weights"], kw["padding_idx"], kw["scale_grad_by_freq"])
    def sorted_split(split, group=None):
        poison_allocator((rows, g.shape[1]))  # rows, tiles, gaps, once: a row they missed is NaN
        return ia.segsum_sorted_cuda(eb.SOURCE, OP, key, g, rows, skip=skip, scaled=kw["scale_grad_by_freq"],
                                     split=split, group=group)

    for split, group in split_runs(g.shape[1] >= ia.SCALAR_BELOW_D):  # the same chunks and tree
        assert differing_bits(sorted_split(split, group), first).size == 0, (split, group)
    for grid in ONCE_GRIDS:   # segsum_once's tiles per block: a grid-stride loop, partial last groups
        monkeypatch.setattr(ia, "once_grid", lambda space, dev, grid=grid: grid)
        assert differing_bits(sorted_split("once"), first).size == 0, grid


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_atomic_is_some_order_and_aten_within_bound(case, cuda_sync):
    args, kw, ref, count, abs_sum = check_atomic_some_order(
        SPEC, SORTED, ATOMIC, case, stats, bound_options=lambda kw: {"scaled": kw["scale_grad_by_freq"]})
    scaled = kw["scale_grad_by_freq"]
    # aten's CUDA backward may fuse g * (1/count) into its sum: allow two roundings per term
    check_bound(eb.torch_embedding_backward(*args, **kw), ref, count + 1, abs_sum, scaled=scaled)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPEC.bench_cases("gpu"), ids=lambda c: c.name)
def test_gpu_bench_size_sorted_repeatable_atomic_varies(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    first = SORTED(*args, **kw)
    assert len({float32_bits(SORTED(*args, **kw)).tobytes() for _ in range(10)} | {float32_bits(first).tobytes()}) == 1
    cpu_args = tuple(a.cpu() for a in args)
    _, count, abs_sum = stats(cpu_args, kw)
    check_bound(first, SPEC.reference(cpu_args, kw), count, abs_sum, scaled=kw["scale_grad_by_freq"])
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(10)}
    print(f"{case.name}: atomic {len(atomic)} distinct / 10")
    assert len(atomic) > 1
