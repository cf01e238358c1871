"""maxpool_bwd: CPU order models against float64 and torch, bad inputs, and (on a GPU) the CUDA kernels
against their models, bitwise.

Error bound (from the op's arithmetic, ``maxpool_bwd.error_bound``): a dx element that receives k
gradients is k float32 additions from +0.0, the first exact, so |dx - exact| <= gamma(k - 1) * sum |dy|.
k <= 1 means dx is exact; a non-overlapping pool is exact everywhere.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels import maxpool_bwd as mp
from kernels.runtime import KERNEL_DIR
from tests.helpers import bitwise_equal, entropy_from_seeds, float32_bits

OP = "maxpool_bwd"
SPEC = kernels.spec(OP)
TREE = kernels.get(OP, "tree")
ATOMIC = kernels.get(OP, "atomic")
# Deterministic variants share tree's order and so its CPU model and bits.
DETERMINISTIC = [v for v in kernels.variants(OP) if v.deterministic]
DET_IDS = [v.name for v in DETERMINISTIC]
CPU = torch.device("cpu")
TEST_CASES = SPEC.test_cases()
CASE_IDS = [c.name for c in TEST_CASES]

# Pool parameters beyond the case tables: rectangular kernels, per-axis stride/padding/dilation,
# stride defaulting to the kernel, ceil_mode. (x shape, kwargs of max_pool2d)
ODD_POOLS = [
    ((2, 3, 11, 9), dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), dilation=(2, 1))),
    ((1, 2, 7, 7), dict(kernel_size=3, stride=None)),
    ((2, 2, 9, 8), dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True)),
    ((1, 3, 5, 5), dict(kernel_size=5, stride=1, padding=2)),
    ((2, 4, 6, 17), dict(kernel_size=(1, 4), stride=(1, 3), padding=(0, 2), ceil_mode=True)),
]
ODD_IDS = [f"{s}-{k}" for s, k in ODD_POOLS]


def odd_inputs(shape, kw, layout="nchw", seed=0, device=CPU):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    y, idx = torch.nn.functional.max_pool2d(x, kw["kernel_size"], kw.get("stride"), kw.get("padding", 0),
                                            kw.get("dilation", 1), ceil_mode=kw.get("ceil_mode", False),
                                            return_indices=True)
    dy = torch.randn(y.shape, generator=g)
    if layout == "channels_last":
        dy, idx = (t.contiguous(memory_format=torch.channels_last) for t in (dy, idx))
    call = dict(kw, input_size=shape[2:])
    return (dy.to(device), idx.to(device)), call


def check_bound(result, args, kw):
    """|result - float64 reference| within the recursive-summation bound, per element; prints offenders."""
    ref = SPEC.reference(args, kw).reshape(-1).numpy()
    count, abs_sum, _, _ = mp.contributions(*args, **kw)
    err = np.abs(result.detach().to("cpu").contiguous().reshape(-1).numpy().astype(np.float64) - ref)
    bound = mp.error_bound(count, abs_sum)
    bad = np.nonzero(err > bound)[0]
    assert bad.size == 0, f"{bad.size} elements outside the bound, first at {bad[:10]}: err {err[bad[:5]]}, bound {bound[bad[:5]]}"
    return count


def check_some_order(result, tree_result, args, kw):
    """``result`` is what atomics produce for *some* arrival order: elements with <= 2 contributions
    equal tree's bits (0 + a + b = 0 + b + a); those with 3..5 equal the sum in one of the k! orders;
    all lie within the bound."""
    count = check_bound(result, args, kw)
    r, t = float32_bits(result), float32_bits(tree_result)
    few = count <= 2
    bad = np.nonzero(r[few] != t[few])[0]
    assert bad.size == 0, f"elements with <= 2 contributions differ from tree at {np.nonzero(few)[0][bad[:10]]}"
    _, _, vals, start = mp.contributions(*args, **kw)
    checked = 0
    for k in (3, 4, 5):
        els = np.nonzero(count == k)[0]
        if els.size == 0:
            continue
        cands = mp.possible_sums(vals, start, count, els).view(np.uint32)
        ok = np.any(cands == r[els][:, None], axis=1)
        assert ok.all(), f"{np.sum(~ok)} elements with {k} contributions match no order, first {els[~ok][:10]}"
        checked += els.size
    return checked


def layout_ok(result: torch.Tensor, dy: torch.Tensor) -> bool:
    if dy.is_contiguous():
        return result.is_contiguous()
    return result.is_contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------------
# CPU: models against float64, torch and each other


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_tree_model_within_bound_and_equals_torch_cpu(case):
    args, kw = SPEC.make_inputs(case, CPU)
    dx = TREE(*args, **kw)
    assert dx.shape == (args[0].shape[0], args[0].shape[1], *kw["input_size"]) and dx.dtype == torch.float32
    assert layout_ok(dx, args[0])
    count = check_bound(dx, args, kw)
    if count.max() <= 1:  # no window shares an argmax: every dx element is a single dy value
        assert bitwise_equal(dx, SPEC.reference(args, kw).float())
    # torch's CPU backward adds a plane's windows in (oh, ow) row-major order, as tree does: same bits.
    torch_dx = mp.torch_backward(*args, **kw)
    diff = np.nonzero(float32_bits(dx) != float32_bits(torch_dx))[0]
    assert diff.size == 0, f"tree differs from torch's CPU backward at {diff[:10]}"


def test_non_overlapping_pool_is_exact():
    case = next(c for c in TEST_CASES if c.name.startswith("k2s2"))
    args, kw = SPEC.make_inputs(case, CPU)
    ref = SPEC.reference(args, kw)
    for v in (TREE, ATOMIC):
        assert bitwise_equal(v(*args, **kw, rng=3), ref.float()), v.key


@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_atomic_model_is_some_order(case):
    args, kw = SPEC.make_inputs(case, CPU)
    tree = TREE(*args, **kw)
    dx = ATOMIC(*args, **kw, rng=case.seed)
    assert layout_ok(dx, args[0])
    check_some_order(dx, tree, args, kw)


@pytest.mark.parametrize("case", [c for c in TEST_CASES if "b128" not in c.name], ids=lambda c: c.name)
def test_models_bitwise_stable(case):
    args, kw = SPEC.make_inputs(case, CPU)
    first = float32_bits(TREE(*args, **kw))
    for _ in range(5):
        assert np.array_equal(float32_bits(TREE(*args, **kw)), first)
    seeded = float32_bits(ATOMIC(*args, **kw, rng=11))
    assert np.array_equal(float32_bits(ATOMIC(*args, **kw, rng=11)), seeded)  # same draw, same order


def test_atomic_model_varies_with_order_negative_control(monkeypatch):
    """Where many windows share an argmax, the arrival order changes the bits; tree's order is fixed."""
    case = next(c for c in SPEC.bench_cases("cpu") if c.name.startswith("contention_k7"))
    args, kw = SPEC.make_inputs(case, CPU)
    count, _, _, _ = mp.contributions(*args, **kw)
    assert count.max() >= 10
    results = {float32_bits(ATOMIC(*args, **kw, rng=seed)).tobytes() for seed in range(20)}
    assert len(results) >= 10, f"only {len(results)} distinct results over 20 arrival orders"
    entropy_from_seeds(monkeypatch, 100)   # rng=None: a fresh generator per call, its entropy seeded here
    assert len({float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(3)}) > 1
    assert len({float32_bits(TREE(*args, **kw)).tobytes() for _ in range(5)}) == 1


def test_checks_reject_wrong_results_negative_control():
    """The checks above must fail on deliberately wrong results: the reversed window order (a valid sum,
    but not tree's), and a result that drops one gradient."""
    case = next(c for c in SPEC.bench_cases("cpu") if c.name.startswith("contention_k5"))
    args, kw = SPEC.make_inputs(case, CPU)
    dy, idx = args
    tree = TREE(*args, **kw)
    rev = TREE(dy.flip(2, 3).contiguous(), idx.flip(2, 3).contiguous(), **kw)  # windows in reverse order
    assert not np.array_equal(float32_bits(rev), float32_bits(tree))
    check_bound(rev, args, kw)  # the reversed order is still a correct sum
    dropped = dy.clone()
    n, c, oh, ow = dy.shape
    dropped[0, 0, oh // 2, ow // 2] = 0.0  # one window's gradient lost
    wrong = TREE(dropped, idx, **kw)
    with pytest.raises(AssertionError, match="outside the bound"):
        check_bound(wrong, args, kw)


def test_ties_indices_hold_the_window_maximum():
    """Tied inputs: every index still points at its window's maximum, and many windows share an argmax."""
    case = next(c for c in TEST_CASES if c.params.get("ties"))
    (dy, idx), kw = SPEC.make_inputs(case, CPU)
    count, _, _, _ = mp.contributions(dy, idx, **kw)
    assert count.max() >= 3
    # every index is a position of the plane that holds its window's maximum value
    g = torch.Generator().manual_seed(case.seed)
    p = case.params
    x = torch.randint(-1, 3, (p["n"], p["c"], p["h"], p["w"]), generator=g).float()
    y = torch.nn.functional.max_pool2d(x, p["k"], p["stride"], p["pad"], p["dilation"])
    assert bitwise_equal(x.reshape(x.shape[0], x.shape[1], -1).gather(2, idx.reshape(idx.shape[0], idx.shape[1], -1)),
                       y.reshape(y.shape[0], y.shape[1], -1))


@pytest.mark.parametrize("shape,kw", ODD_POOLS, ids=ODD_IDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_odd_pool_parameters_cpu(shape, kw, layout):
    args, call = odd_inputs(shape, kw, layout)
    dx = TREE(*args, **call)
    assert layout_ok(dx, args[0])
    assert np.array_equal(float32_bits(dx), float32_bits(mp.torch_backward(*args, **call)))
    check_bound(dx, args, call)
    check_some_order(ATOMIC(*args, **call, rng=5), dx, args, call)


def test_layouts_agree():
    """tree gives the same bits in both layouts; atomic's draw is per window in memory order, so one
    seed gives different orders per layout, each of them some order."""
    case = next(c for c in TEST_CASES if c.name == "overlap_odd_nchw")
    (dy, idx), kw = SPEC.make_inputs(case, CPU)
    cl = [t.contiguous(memory_format=torch.channels_last) for t in (dy, idx)]
    a, b = TREE(dy, idx, **kw), TREE(*cl, **kw)
    assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(float32_bits(a), float32_bits(b))
    c = ATOMIC(*cl, **kw, rng=7)
    assert c.is_contiguous(memory_format=torch.channels_last)
    check_some_order(c, a, (dy, idx), kw)


def subnormal_inputs(device=CPU):
    """k2s2 (no collisions) with every other gradient subnormal, and one collision case whose two
    gradients cancel to a subnormal sum."""
    args, kw = odd_inputs((2, 3, 8, 8), dict(kernel_size=2, stride=2), seed=4)
    dy, idx = args
    tiny = float(np.finfo(np.float32).tiny)
    dy = dy.clone()
    dy.view(-1)[::2] *= tiny / 4  # |dy| < 2^-126 there: subnormal
    return (dy.to(device), idx.to(device)), kw


def test_subnormals_flush_only_in_atomic():
    """float atomicAdd flushes subnormal operands and results to signed zero, so the atomic model does;
    tree's ordinary additions keep them (kernels are compiled without -ftz), as torch's CPU backward does."""
    (dy, idx), kw = subnormal_inputs()
    sub = (dy.abs() < np.finfo(np.float32).tiny) & (dy != 0)
    assert sub.sum() == dy.numel() // 2
    flushed = torch.where(sub, torch.zeros_like(dy), dy)
    exact = SPEC.reference((dy, idx), kw).float()  # k2s2: one gradient per element, exact
    assert np.array_equal(float32_bits(TREE(dy, idx, **kw)), float32_bits(exact))
    assert np.array_equal(float32_bits(ATOMIC(dy, idx, **kw, rng=0)), float32_bits(SPEC.reference((flushed, idx), kw).float()))
    assert bitwise_equal(mp.torch_backward(dy, idx, **kw), exact)
    # two normal gradients cancelling to a subnormal sum: kept by tree, flushed to zero by atomic
    dy2 = torch.tensor([1.5 * 2.0**-126, -1.0 * 2.0**-126]).view(1, 1, 1, 2)
    idx2 = torch.tensor([1, 1]).view(1, 1, 1, 2)
    kw2 = dict(input_size=(1, 3), kernel_size=(1, 2), stride=1)
    assert TREE(dy2, idx2, **kw2)[0, 0, 0, 1].item() == 0.5 * 2.0**-126
    assert float32_bits(ATOMIC(dy2, idx2, **kw2, rng=0))[1] == 0
    assert mp.torch_backward(dy2, idx2, **kw2)[0, 0, 0, 1].item() == 0.5 * 2.0**-126


def test_stride_defaults_to_kernel():
    args, kw = odd_inputs((1, 2, 8, 8), dict(kernel_size=2))
    a = TREE(*args, input_size=(8, 8), kernel_size=2)
    b = TREE(*args, input_size=(8, 8), kernel_size=2, stride=2)
    c = TREE(*args, input_size=(8, 8), kernel_size=(2, 2), stride=[])
    assert bitwise_equal(a, b) and bitwise_equal(a, c)


# --------------------------------------------------------------------------------------------------
# Bad inputs: KernelArgumentError naming the argument, before anything runs

_G = torch.Generator().manual_seed(0)
_DY = torch.randn(2, 3, 4, 4, generator=_G)
_IDX = torch.zeros(2, 3, 4, 4, dtype=torch.int64)
_KW = dict(input_size=(8, 8), kernel_size=3, stride=2, padding=1)

BAD = [
    ("dy", (_DY.double(), _IDX), _KW),
    ("dy", ([[1.0]], _IDX), _KW),
    ("dy", (_DY[0], _IDX[0]), _KW),
    ("indices", (_DY, _IDX.int()), _KW),
    ("indices", (_DY, _IDX[:, :2]), _KW),
    ("indices", (_DY, _IDX.to("meta")), _KW),
    ("indices", (_DY, _IDX.contiguous(memory_format=torch.channels_last)), _KW),
    ("dy", (_DY.transpose(2, 3), _IDX.transpose(2, 3)), _KW),
    ("dy", (_DY[:0], _IDX[:0]), _KW),
    ("dy", (_DY, _IDX), dict(_KW, input_size=(9, 8), padding=0)),
    ("input_size", (_DY, _IDX), dict(_KW, input_size=(0, 8))),
    ("input_size", (_DY, _IDX), dict(_KW, input_size=(2, 2), padding=0, kernel_size=3)),
    ("input_size", (_DY, _IDX), dict(_KW, input_size=(8, 8, 8))),
    ("kernel_size", (_DY, _IDX), dict(_KW, kernel_size=0)),
    ("kernel_size", (_DY, _IDX), dict(_KW, kernel_size=2.5)),
    ("stride", (_DY, _IDX), dict(_KW, stride=0)),
    ("padding", (_DY, _IDX), dict(_KW, padding=-1)),
    ("padding", (_DY, _IDX), dict(_KW, padding=2)),
    ("dilation", (_DY, _IDX), dict(_KW, dilation=0)),
    ("ceil_mode", (_DY, _IDX), dict(_KW, ceil_mode=1)),
]


@pytest.mark.parametrize("arg,args,kw", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
@pytest.mark.parametrize("variant", ["tree", "atomic"])
def test_bad_inputs_raise(variant, arg, args, kw):
    v = kernels.get(OP, variant)
    for fn in (v.cpu, v.cuda):
        with pytest.raises(KernelArgumentError) as e:
            fn(*args, **kw)
        assert e.value.op == OP and e.value.arg == arg, str(e.value)


def test_good_input_passes_the_checks():
    dy, idx = _DY, torch.randint(0, 64, _DY.shape, generator=_G)
    assert TREE(dy, idx, **_KW).shape == (2, 3, 8, 8)


def test_cuda_launcher_refuses_cpu_tensors():
    with pytest.raises(KernelArgumentError, match="CUDA tensor"):
        TREE.cuda(_DY, _IDX, **_KW)


# --------------------------------------------------------------------------------------------------
# Launch arguments on the CPU: the launchers run against a Python transliteration of maxpool_bwd.cu
# (same argument order, same index arithmetic), so an argument mix-up fails here, not only on a GPU.


def _lo(x, k, s, p, d):
    span = (k - 1) * d + 1
    return 0 if x + p < span else (x + p - span) // s + 1


def _hi(x, s, p, out):
    return min((x + p) // s + 1, out)


def _emulate(name, tensors, scalars, grid=None, shared_mem=0):
    dy, idx, dx = (t.view(-1) if t.is_contiguous() else t.permute(0, 2, 3, 1).reshape(-1) for t in tensors)
    dy, idx = dy.numpy(), idx.numpy()
    out = np.zeros(dx.numel(), dtype=np.float32)
    if name == "maxpool_bwd_atomic":
        total, C, HW, OHW, cl = scalars
        for o in range(total):
            i = int(idx[o])
            if 0 <= i < HW:
                at = ((o // (OHW * C)) * HW + i) * C + o % C if cl else (o // OHW) * HW + i
                out[at] = np.float32(out[at] + dy[o])
        return out
    if name == "maxpool_bwd_tile":
        return _emulate_tile(dy, idx, out, scalars, grid, shared_mem)
    if name.startswith("maxpool_bwd_cell_k"):
        return _emulate_cell(name, dy, idx, out, scalars)
    total, C, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW, cl = scalars
    per_element = name == "maxpool_bwd_tree"
    for t in range(total):
        if per_element:  # t enumerates dx
            if cl:
                c, r = t % C, t // C
                w, r = r % W, r // W
                h, n = r % H, r // H
                base, step = n * OH * OW * C + c, C
            else:
                w, r = t % W, t // W
                h, base, step = r % H, (r // H) * OH * OW, 1
            i, own, at = h * W + w, None, t
        else:            # owner: t enumerates dy
            i = int(idx[t])
            if not 0 <= i < H * W:
                continue
            if cl:
                c, n = t % C, t // (OH * OW * C)
                base, step, at = n * OH * OW * C + c, C, (n * H * W + i) * C + c
            else:
                plane = t // (OH * OW)
                base, step, at = plane * OH * OW, 1, plane * H * W + i
            h, w, own = i // W, i % W, t
        acc, first = np.float32(0.0), None
        for oh in range(_lo(h, KH, SH, PH, DH), _hi(h, SH, PH, OH)):
            for ow in range(_lo(w, KW, SW, PW, DW), _hi(w, SW, PW, OW)):
                o2 = base + (oh * OW + ow) * step
                if int(idx[o2]) == i:
                    first = o2 if first is None else first
                    acc = np.float32(acc + dy[o2])
        if own is None or first == own:
            out[at] = acc
    return out


def _gather(dy, idx, base, step, h, w, W, OH, OW, win):
    """tree's gather of position (h, w) from the windows at dy/idx[base + (oh * OW + ow) * step]."""
    KH, KW, SH, SW, PH, PW, DH, DW = win
    acc = np.float32(0.0)
    for oh in range(_lo(h, KH, SH, PH, DH), _hi(h, SH, PH, OH)):
        for ow in range(_lo(w, KW, SW, PW, DW), _hi(w, SW, PW, OW)):
            o = base + (oh * OW + ow) * step
            if int(idx[o]) == h * W + w:
                acc = np.float32(acc + dy[o])
    return acc


def _emulate_tile(dy, idx, out, scalars, grid, shared_mem):
    """maxpool_bwd_tile block by block: which planes (NCHW) or channels of which image (channels_last)
    each block stages, and where it writes; the gather reads global memory in the same order as the
    kernel reads its shared copy."""
    units, C, H, W, OH, OW, *win, cl, group, shift = scalars
    Q, HW = OH * OW, H * W
    assert shared_mem == 8 * Q * group + 8 * (H + W)
    written = np.zeros(out.size, dtype=bool)
    for b in range(grid[0]):
        if cl:
            assert group == 1 << shift
            cblocks = -(-C // group)
            n, c0 = b // cblocks, (b % cblocks) * group
            assert n < units
            for c in range(c0, min(c0 + group, C)):
                for pos in range(HW):
                    at = (n * HW + pos) * C + c
                    out[at] = _gather(dy, idx, n * Q * C + c, C, pos // W, pos % W, W, OH, OW, win)
                    written[at] = True
        else:
            assert 1 << shift >= min(W, 32)
            for p in range(b * group, min(b * group + group, units)):
                for pos in range(HW):
                    out[p * HW + pos] = _gather(dy, idx, p * Q, 1, pos // W, pos % W, W, OH, OW, win)
                    written[p * HW + pos] = True
    assert written.all(), "the grid leaves dx elements unwritten"
    return out


def _emulate_cell(name, dy, idx, out, scalars):
    """maxpool_bwd_cell_k<K>s<S>p<P>_<layout>_<index> thread by thread: its cell, the N x N windows it
    loads, the window range of each position (the kernel's compile-time constants), where it writes."""
    K, S, P, layout, index = re.fullmatch(r"maxpool_bwd_cell_k(\d)s(\d)p(\d)_(nchw|cl)_(i32|i64)", name).groups()
    K, S, P = int(K), int(S), int(P)
    total, C, H, W, OH, OW, BH, BW, mC, sC, mBH, sBH, mBW, sBW = scalars
    assert (BH, BW) == (-(-H // S), -(-W // S)) and total == dy.size // (OH * OW) * BH * BW
    for d, m, sh in ((C, mC, sC), (BH, mBH, sBH), (BW, mBW, sBW)):  # FastDiv on the thread indices
        for n in range(0, total, max(1, total // 50)):
            assert (((n * m) >> 32) + n) >> sh == n // d
    assert index == ("i32" if total < 2**31 and out.size < 2**31 else "i64")
    c0 = P - K
    lo = [(r + c0) // S - c0 // S for r in range(S)]  # Python's // floors, as floor_div does
    hi = [(r + P) // S - c0 // S for r in range(S)]
    N = hi[S - 1]
    written = np.zeros(out.size, dtype=bool)
    for t in range(total):
        if layout == "cl":
            c, r = t % C, t // C
            bw, r = r % BW, r // BW
            bh, n = r % BH, r // BH
            base, step, at0 = n * OH * OW * C + c, C, n * H * W * C + c
        else:
            bw, r = t % BW, t // BW
            bh, plane = r % BH, r // BH
            base, step, at0 = plane * OH * OW, 1, plane * H * W
        oh0, ow0 = bh + c0 // S + 1, bw + c0 // S + 1
        block = [[(-1, np.float32(0))] * N for _ in range(N)]
        for a, b in itertools.product(range(N), range(N)):
            if 0 <= oh0 + a < OH and 0 <= ow0 + b < OW:
                o = base + ((oh0 + a) * OW + ow0 + b) * step
                block[a][b] = (int(idx[o]) if 0 <= idx[o] < H * W else -1, dy[o])
        for h in range(bh * S, min(bh * S + S, H)):
            for w in range(bw * S, min(bw * S + S, W)):
                # the kernel's constant ranges are tree's window ranges, shifted to the cell's origin
                assert max(_lo(h, K, S, P, 1), 0) == max(oh0 + lo[h - bh * S], 0)
                assert _hi(h, S, P, OH) == min(oh0 + hi[h - bh * S], OH)
                acc = np.float32(0.0)
                for a in range(lo[h - bh * S], hi[h - bh * S]):
                    for b in range(lo[w - bw * S], hi[w - bw * S]):
                        i, g = block[a][b]
                        if i == h * W + w:
                            acc = np.float32(acc + g)
                at = at0 + (h * W + w) * step
                assert not written[at]
                out[at], written[at] = acc, True
    assert written.all(), "the grid leaves dx elements unwritten"
    return out


EMULATED = ["overlap_odd_nchw", "overlap_odd_channels_last", "dilation2_channels_last", "ceil_k3s2",
            "k2s2_nchw", "k2s2_channels_last", "k3s1_heavy_overlap_nchw", "k3s1_heavy_overlap_channels_last",
            "odd0_nchw", "odd0_channels_last", "odd4_nchw", "odd4_channels_last"]
# The kernel tree launches for each: a stride-cell kernel where the pool has one, else the tiled one.
TREE_KERNEL = {"overlap_odd": "cell_k3s2p1", "dilation2": "tile", "ceil_k3s2": "cell_k3s2p0",
               "k2s2": "cell_k2s2p0", "k3s1_heavy_overlap": "cell_k3s1p1", "odd": "tile"}


def _emulated_launches(case_name, monkeypatch, dtype=torch.float32):
    """Every CUDA launcher of the op (plus tree's tile and gather paths) on the CPU, its kernel launch
    replaced by the Python emulation above. Yields (launcher name, returned tensor, kernel name, the
    emulated dx memory as float32 sums, defines, inputs); ``dtype``: dy's dtype (half dy is widened for
    the emulation, as the kernels widen on load)."""
    tensors: dict[int, torch.Tensor] = {}
    results = {}
    defines = {}

    def fake_ptr(t):
        tensors[t.data_ptr()] = t
        return np.uint64(t.data_ptr())

    def fake_function(source, name, device, extra=()):
        defines[name] = extra
        return name

    def fake_launch(fn, grid, block, args, *, device, shared_mem=0):
        assert block == (mp.THREADS,) and grid[0] >= 1
        dy, idx, dx = (tensors[int(a)] for a in args[:3])
        assert all(isinstance(a, (np.int32, np.int64, np.uint32)) for a in args[3:])
        results[fn] = _emulate(fn, (dy.float(), idx, dx), [int(a) for a in args[3:]], grid, shared_mem)

    monkeypatch.setattr(mp, "check_cuda", lambda *a: None)
    monkeypatch.setattr(mp, "function", fake_function)
    monkeypatch.setattr(mp, "launch", fake_launch)
    monkeypatch.setattr(mp, "ptr", fake_ptr)
    if case_name.startswith("odd"):
        shape, pool = ODD_POOLS[int(case_name[3])]
        args, kw = odd_inputs(shape, pool, case_name.split("_", 1)[1])
    else:
        args, kw = SPEC.make_inputs(next(c for c in TEST_CASES if c.name == case_name), CPU)
    if dtype != torch.float32:
        args = (args[0].to(dtype),) + tuple(args[1:])
    launchers = {v.name: v.cuda for v in kernels.variants(OP)}
    launchers["tree_tile"] = mp.maxpool_bwd_tree_tile_cuda
    launchers["tree_gather"] = mp.maxpool_bwd_tree_gather_cuda
    for name, launcher in launchers.items():
        results.clear()
        defines.clear()
        out = launcher(*args, **kw)
        assert len(results) == 1, (name, list(results))
        (fn, got), = results.items()
        yield name, out, fn, got, defines[fn], args, kw


@pytest.mark.parametrize("case_name", EMULATED)
def test_launchers_against_emulated_kernels(case_name, monkeypatch):
    """Includes pools with different parameters per axis (ODD_POOLS 0 and 4), so swapped H/W
    arguments show."""
    expected = {"tree": TREE_KERNEL[next(k for k in TREE_KERNEL if case_name.startswith(k))],
                "tree_tile": "tile", "tree_gather": "tree"}
    tree = None
    for name, out, fn, got, defines, args, kw in _emulated_launches(case_name, monkeypatch):
        if tree is None:
            tree = TREE(*args, **kw)
            memory = (tree if tree.is_contiguous() else tree.permute(0, 2, 3, 1)).reshape(-1).numpy().view(np.uint32)
        assert layout_ok(out, args[0]) and out.dtype == torch.float32 and defines == ()
        want = f"maxpool_bwd_{expected.get(name, name)}"
        assert fn.startswith(want), (name, want, fn)
        got = got.view(np.uint32)
        v = kernels.get(OP, name.split("_")[0])
        if v.deterministic:
            assert np.array_equal(got, memory), name
        else:  # sequential emulation: one arrival order, within the some-order check
            nchw = torch.from_numpy(got.view(np.float32).copy())
            shaped = nchw.view(out.shape) if out.is_contiguous() else \
                nchw.view(out.shape[0], out.shape[2], out.shape[3], out.shape[1]).permute(0, 3, 1, 2)
            check_some_order(shaped, tree, args, kw)


@pytest.mark.parametrize("dtype,define", [(torch.bfloat16, "-DNNRAND_ACT=1"), (torch.float16, "-DNNRAND_ACT=2")],
                         ids=["bf16", "fp16"])
@pytest.mark.parametrize("case_name", ["overlap_odd_nchw", "k3s1_heavy_overlap_channels_last", "odd4_nchw"])
def test_half_launchers_read_and_return_half(case_name, dtype, define, monkeypatch):
    """A bf16/fp16 dy goes to the kernels as such (compiled with the dtype's define) and dx comes back in
    dy's dtype and layout; the float32 sums the kernels form, rounded once, are the registry's call on the
    CPU (the float32 model on dy widened, rounded with torch). atomic sums into a float32 buffer that the
    launcher rounds: its dx must be that buffer, rounded."""
    tree = None
    for name, out, fn, got, defines, args, kw in _emulated_launches(case_name, monkeypatch, dtype):
        if tree is None:
            tree = kernels.get(OP, "tree")(*args, **kw)
            assert tree.dtype == dtype
        assert layout_ok(out, args[0]) and defines == (define,), (name, defines)
        sums = torch.from_numpy(got.copy())
        sums = sums.view(out.shape) if out.is_contiguous() else \
            sums.view(out.shape[0], out.shape[2], out.shape[3], out.shape[1]).permute(0, 3, 1, 2)
        if kernels.get(OP, name.split("_")[0]).deterministic:
            assert out.dtype == dtype
            assert bitwise_equal(sums.to(dtype).view(torch.int16), tree.view(torch.int16)), name
        else:  # the launcher rounded the emulated float32 buffer; some arrival order of float32 sums
            assert out.dtype == dtype
            check_some_order(sums, TREE(args[0].float(), *args[1:], **kw), (args[0].float(), *args[1:]), kw)


def test_cell_plan():
    def plan(h, w, k, s, p, d=1):
        return mp.cell_plan(h, w, k, k, s, s, p, p, d, d, mp.pool_out(h, k, s, p, d, False),
                            mp.pool_out(w, k, s, p, d, False))

    assert plan(16, 16, 3, 2, 1) == ("maxpool_bwd_cell_k3s2p1", 8, 8)  # the ResNet stem pool
    assert plan(15, 13, 3, 2, 1) == ("maxpool_bwd_cell_k3s2p1", 8, 7)  # odd sizes: clipped last cells
    assert plan(8, 8, 2, 2, 0) == ("maxpool_bwd_cell_k2s2p0", 4, 4)
    assert plan(9, 9, 3, 1, 1) == ("maxpool_bwd_cell_k3s1p1", 9, 9)
    assert plan(9, 9, 3, 2, 1, d=2) is None                           # dilation
    assert plan(9, 9, 5, 1, 2) is None                                # no kernel for 5x5
    assert mp.cell_plan(9, 9, 3, 3, 2, 1, 1, 1, 1, 1, 4, 9) is None     # unequal strides


def test_cell_divisor_matches_integer_division():
    rng = np.random.default_rng(0)
    ns = np.concatenate([np.arange(0, 5000), rng.integers(0, 2**31, 20000), 2**31 - 1 - np.arange(2000)])
    ns = ns.astype(object)  # exact integers
    for d in [*range(1, 300), 1000, 4096, 12543, 65535, 2**20 + 3, 2**30, 2**31 - 1]:
        m, s = (int(v) for v in mp.cell_divisor(d))
        assert 0 < m < 2**32
        q = [(((n * m) >> 32) + n) >> s for n in ns]
        assert q == [n // d for n in ns], d
    with pytest.raises(ValueError):
        mp.cell_divisor(0)


def test_tile_plan_fits_shared_memory_or_falls_back():
    stem = mp.tile_plan(128, 64, 16, 16, 8, 8, "nchw")
    assert stem == (1024, 8, 4, 8 * 512 + 8 * 32)
    assert mp.tile_plan(128, 64, 16, 16, 8, 8, "channels_last") == (128 * 8, 8, 3, 8 * 512 + 8 * 32)
    assert mp.tile_plan(3, 3, 5, 5, 3, 3, "channels_last")[1:3] == (4, 2)  # group: next power of two >= C
    for layout in ("nchw", "channels_last"):
        assert mp.tile_plan(1, 64, 224, 224, 112, 112, layout) is None  # 12544 windows a plane: gather
        for n, c, h, w in ((2, 3, 15, 13), (1, 1, 1, 1), (4, 70, 40, 40)):
            t = mp.tile_plan(n, c, h, w, (h + 1) // 2, (w + 1) // 2, layout)
            assert t is not None and t[3] <= mp.SMEM_LIMIT


@pytest.mark.parametrize("act", [0, 1, 2], ids=["float32", "bf16", "fp16"])
def test_cu_compiles_with_nvcc(tmp_path, act):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    res = subprocess.run([nvcc, "-arch=sm_90", f"-DNNRAND_ACT={act}", f"-I{KERNEL_DIR}", "-c", "-o",
                          str(tmp_path / "m.o"), str(KERNEL_DIR / "maxpool_bwd.cu")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_spec_tables():
    assert {c.name for c in TEST_CASES} >= {"k2s2_nchw", "stem_pool3x3s2p1_16_b128_channels_last"}
    for scale in ("gpu", "quick", "cpu"):
        cases = SPEC.bench_cases(scale)
        cont = [c.contention for c in cases if c.name.startswith("contention")]
        assert cont == sorted(cont) and cont[-1] > 40  # k = 3, 5, 7 stride 1: ~k^2 windows per position
        assert all(SPEC.bytes_moved(c) > 0 for c in cases)
    stem = next(c for c in SPEC.bench_cases("gpu") if c.name.startswith("stem"))
    assert stem.params["n"] == 128
    # stem at batch 128: dy 128*64*8*8 floats + int64 indices, dx 128*64*16*16 floats
    assert SPEC.bytes_moved(stem) == 128 * 64 * 64 * 12 + 128 * 64 * 256 * 4
    assert set(SPEC.peers()) == {"torch"}


# --------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels against their CPU models, bitwise

CUDA = torch.device("cuda")
REPEATS = 50


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DETERMINISTIC, ids=DET_IDS)
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_deterministic_bitwise_repeatable_and_equals_model(case, variant, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    first = variant(*args, **kw)
    assert layout_ok(first, args[0])
    for _ in range(REPEATS):
        assert bitwise_equal(variant(*args, **kw), first)
    model = variant(*cpu_args, **kw)
    diff = np.nonzero(float32_bits(first) != float32_bits(model))[0]
    assert diff.size == 0, f"CUDA {variant.key} differs from its CPU model at {diff[:10]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_tree_kernels_agree_bitwise(case, cuda_sync):
    """tree's kernels (stride cells, tiled through shared memory, and the global gather it falls back to
    for large planes) give the same bits."""
    args, kw = SPEC.make_inputs(case, CUDA)
    first = float32_bits(TREE(*args, **kw))
    for name, fn in (("tiled", mp.maxpool_bwd_tree_tile_cuda), ("gather", mp.maxpool_bwd_tree_gather_cuda)):
        diff = np.nonzero(float32_bits(fn(*args, **kw)) != first)[0]
        assert diff.size == 0, f"tree and its {name} kernel differ at {diff[:10]}"


@pytest.mark.gpu
def test_gpu_tree_falls_back_on_large_planes(cuda_sync):
    shape, kw = (1, 2, 160, 150), dict(kernel_size=3, stride=1, padding=1)
    assert mp.tile_plan(1, 2, 160, 150, 160, 150, "nchw") is None
    args, call = odd_inputs(shape, kw, device=CUDA)
    cpu_args, _ = odd_inputs(shape, kw)
    assert np.array_equal(float32_bits(TREE(*args, **call)), float32_bits(TREE(*cpu_args, **call)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_atomic_is_some_order(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    cpu_args, _ = SPEC.make_inputs(case, CPU)
    tree = TREE(*cpu_args, **kw)
    outs = [ATOMIC(*args, **kw) for _ in range(5)]
    for dx in outs:
        assert layout_ok(dx, args[0])
        check_some_order(dx.cpu(), tree, cpu_args, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,kw", ODD_POOLS, ids=ODD_IDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_odd_pool_parameters(shape, kw, layout, cuda_sync):
    args, call = odd_inputs(shape, kw, layout, device=CUDA)
    cpu_args, _ = odd_inputs(shape, kw, layout)
    tree = TREE(*cpu_args, **call)
    for v in DETERMINISTIC:
        assert np.array_equal(float32_bits(v(*args, **call)), float32_bits(tree)), v.key
    check_some_order(ATOMIC(*args, **call).cpu(), tree, cpu_args, call)


HALF_LAUNCHERS = {"tree": TREE.cuda, "tree_tile": mp.maxpool_bwd_tree_tile_cuda,
                  "tree_gather": mp.maxpool_bwd_tree_gather_cuda, "owner": kernels.get(OP, "owner").cuda}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_half_dy_read_natively_equals_the_widening_call(case, dtype, cuda_sync):
    """The launchers read a bf16/fp16 dy themselves and write dx in its dtype (cell, tile, gather and
    owner kernels): bits of the CPU model on dy widened, rounded once with torch, in dy's layout; repeats
    bitwise. atomic rounds its float32 buffer once: dtype and layout checked, its sums some arrival order."""
    args, kw = SPEC.make_inputs(case, CUDA)
    args = (args[0].to(dtype), args[1])
    cpu_args = (args[0].cpu(), args[1].cpu())
    want = TREE(*cpu_args, **kw)  # the registry's call: widened, the float32 model, rounded once
    assert want.dtype == dtype
    for name, launch in HALF_LAUNCHERS.items():
        first = launch(*args, **kw)
        assert first.dtype == dtype and layout_ok(first, args[0]), name
        assert bitwise_equal(first.cpu().view(torch.int16), want.view(torch.int16)), f"{case.name} {name}"
        for _ in range(3):
            assert bitwise_equal(launch(*args, **kw).view(torch.int16), first.view(torch.int16)), name
    out = ATOMIC.cuda(*args, **kw)
    assert out.dtype == dtype and layout_ok(out, args[0])
    # Elements with <= 2 contributions have one float32 sum in every order (0 + a + b = 0 + b + a): tree's.
    count, abs_sum, _, _ = mp.contributions(cpu_args[0].float(), cpu_args[1], **kw)
    few = count <= 2
    got, tree_bits = (t.cpu().contiguous().reshape(-1).view(torch.int16).numpy() for t in (out, want))
    assert np.array_equal(got[few], tree_bits[few])
    # All: the float32 sum's bound, then one rounding to dtype: relative 2^-p (p significand bits, round to
    # nearest), plus half of the smallest subnormal (fp16's 2^-24; bf16's is below float32's).
    ref = SPEC.reference([cpu_args[0].float(), cpu_args[1]], kw).reshape(-1).numpy()
    f32 = mp.error_bound(count, abs_sum)
    u, tiny = (2.0**-8, 2.0**-134) if dtype == torch.bfloat16 else (2.0**-11, 2.0**-25)
    err = np.abs(out.float().cpu().contiguous().reshape(-1).numpy().astype(np.float64) - ref)
    assert np.all(err <= f32 + u * (np.abs(ref) + f32) + tiny)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gpu_atomic_varies_on_contended_case(layout, cuda_sync):
    """Negative control: k7 stride-1 windows, up to 49 sharing an argmax. The atomic kernel gives
    several results over the repeats; tree gives one."""
    base = next(c for c in SPEC.bench_cases("quick") if c.name.startswith("contention_k7"))
    case = kernels.Case(OP, base.name, dict(base.params, layout=layout), seed=base.seed)
    args, kw = SPEC.make_inputs(case, CUDA)
    atomic = {float32_bits(ATOMIC(*args, **kw)).tobytes() for _ in range(REPEATS)}
    print(f"{case.name} {layout}: atomic {len(atomic)} distinct / {REPEATS}")
    assert len(atomic) > 1
    for v in DETERMINISTIC:
        assert len({float32_bits(v(*args, **kw)).tobytes() for _ in range(REPEATS)}) == 1, v.key


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v.name for v in kernels.variants(OP)])
def test_gpu_runs_on_torch_current_stream(variant, cuda_sync):
    """dy is rewritten on a side stream behind a long sleep; a kernel launched on any other stream would
    read the old dy."""
    case = next(c for c in TEST_CASES if c.name == "stem_pool3x3s2p1_16_b128_nchw")
    (dy, idx), kw = SPEC.make_inputs(case, CUDA)
    new_dy = torch.randn(dy.shape, generator=torch.Generator().manual_seed(99)).to(CUDA)
    expected = TREE(new_dy.cpu(), idx.cpu(), **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        buf = dy.clone()
        torch.cuda._sleep(50_000_000)
        buf.copy_(new_dy)
        out = kernels.get(OP, variant)(buf, idx, **kw)
    side.synchronize()
    if kernels.get(OP, variant).deterministic:
        assert np.array_equal(float32_bits(out), float32_bits(expected))
    else:
        check_some_order(out.cpu(), expected, (new_dy.cpu(), idx.cpu()), kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TEST_CASES, ids=CASE_IDS)
def test_gpu_matches_torch_backward(case, cuda_sync):
    args, kw = SPEC.make_inputs(case, CUDA)
    theirs = mp.torch_backward(*args, **kw)
    check_bound(theirs.cpu(), [a.cpu() for a in args], kw)  # torch itself within the bound
    for v in kernels.variants(OP):
        check_bound(v(*args, **kw).cpu(), [a.cpu() for a in args], kw)


@pytest.mark.gpu
def test_gpu_subnormals_match_the_models(cuda_sync):
    """tree keeps subnormals, atomic flushes them as float atomicAdd does: both as their models."""
    cpu_args, kw = subnormal_inputs()
    args, _ = subnormal_inputs(CUDA)
    for v in kernels.variants(OP):
        assert np.array_equal(float32_bits(v(*args, **kw)), float32_bits(v(*cpu_args, **kw, rng=0))), v.key


@pytest.mark.gpu
def test_gpu_bad_inputs_raise():
    dy, idx = _DY.to(CUDA), _IDX.to(CUDA)
    with pytest.raises(KernelArgumentError, match="indices"):
        TREE(dy, _IDX, **_KW)
    with pytest.raises(KernelArgumentError, match="dy"):
        ATOMIC(dy.double(), idx, **_KW)
