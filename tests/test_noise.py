"""Noise control: seeds per source, presets, pinned flags, the one-ULP perturbation, and the proof that
with deterministic kernels and fixed seeds two runs end bitwise identical while atomic kernels make
them differ (negative control)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from nnrand import models, noise, routing, runio, train
from tests.helpers import bitwise_equal


def tiny(tmp_path, name: str, **kw) -> dict:
    cfg = dict(out=str(tmp_path), name=name, device="cpu", model="small", n_train=48, n_test=24,
               batch_size=16, epochs=1, progress=False, report=False)
    cfg.update(kw)
    return cfg


def final_state(tmp_path, name: str, member: int = 0):
    d = runio.member_dir(tmp_path, name, member)
    ckpt = torch.load(d / "checkpoint.pt", weights_only=False)
    with np.load(d / "predictions.npz") as f:
        logits = f["logits"].copy()
    return ckpt["model"], logits, runio.read_csv(d / "checksums.csv")


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------
# Seeds and presets


def test_presets_follow_zhuang_et_al():
    p = noise.PRESETS
    assert p["control"] == {"family": "tree", "init": "fixed", "order": "fixed", "aug": "fixed"}
    assert p["algo"] == {"family": "tree", "init": "member", "order": "member", "aug": "member"}
    assert p["impl"] == {"family": "atomic", "init": "fixed", "order": "fixed", "aug": "fixed"}
    assert p["algo+impl"] == {"family": "atomic", "init": "member", "order": "member", "aug": "member"}


def test_seed_specs():
    specs = {"init": "fixed", "order": "member", "aug": 77, "kernel": "fresh"}
    a, b = noise.member_seeds(specs, 0, 0), noise.member_seeds(specs, 0, 1)
    assert a.init == b.init                      # fixed: same for every member
    assert a.order != b.order                    # member: differs per member ...
    assert noise.member_seeds(specs, 0, 1) == b  # ... and is reproducible
    assert a.aug == b.aug == 77 and a.kernel is None
    assert noise.member_seeds(specs, 1, 0).init != a.init  # the base seed moves every derived seed
    seeds = {noise.seed_for(s, "fixed", 0, 0) for s in ("init", "order", "aug", "kernel")}
    assert len(seeds) == 4                       # sources never share a seed by accident
    with pytest.raises(ValueError, match="fixed, member"):
        noise.check_spec("init", "fresh")
    with pytest.raises(ValueError):
        noise.check_spec("order", -3)
    assert noise.check_spec("aug", "12") == 12


def test_perturb_moves_one_weight_by_one_ulp():
    torch.manual_seed(0)
    model = models.build_model("small")
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    index = 1000
    info = noise.perturb_one_ulp(model, index)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [index]
    assert after[index] == torch.nextafter(before[index], torch.tensor(float("inf")))
    bits = lambda t: int(t.view(torch.int32))  # noqa: E731
    assert abs(bits(after[index]) - bits(before[index])) == 1
    assert info["flat_index"] == index and info["old_bits"] != info["new_bits"]
    with pytest.raises(ValueError, match="past the model"):
        noise.perturb_one_ulp(model, before.numel())
    # channels_last weights (--channels-last): the same logical element moves
    torch.manual_seed(0)
    ref = models.build_model("small")
    cl = copy.deepcopy(ref).to(memory_format=torch.channels_last)
    noise.perturb_one_ulp(ref, index)
    assert noise.perturb_one_ulp(cl, index)["element"] == info["element"]
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), cl.parameters()))


def test_pinned_flags_restore_previous_state():
    b = torch.backends
    before = (noise._tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic)
    with pytest.raises(RuntimeError, match="inside"):
        with noise.pinned_flags(tf32=False, cudnn_deterministic=True) as flags:
            assert b.cudnn.deterministic and not b.cudnn.benchmark
            assert flags["tf32"] is False and all(v in ("ieee", "False") for v in flags["tf32_flags"].values())
            raise RuntimeError("inside")
    assert (noise._tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic) == before
    with noise.pinned_flags(tf32=True, cudnn_deterministic=False) as flags:
        assert all(v in ("tf32", "True") for v in flags["tf32_flags"].values())
    assert (noise._tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic) == before
    with noise.pinned_flags(tf32=False, cudnn_deterministic=False, cudnn_benchmark=True) as flags:
        assert b.cudnn.benchmark and flags["cudnn_benchmark"] is True
    assert (noise._tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic) == before
    with pytest.raises(ValueError, match="cudnn_benchmark"):   # timing-chosen algorithms are not deterministic
        with noise.pinned_flags(tf32=False, cudnn_deterministic=True, cudnn_benchmark=True):
            pass
    assert (noise._tf32_flags(), b.cudnn.benchmark, b.cudnn.deterministic) == before


# --------------------------------------------------------------------------------------------------
# Proof: tree + fixed seeds -> identical runs; atomic -> different runs


def need_all_ops():
    missing = [op for op in routing.ROUTED_OPS if not routing.registered_variants(op)]
    # every routed op must be registered: a missing one is a failure, not a reason to skip
    assert not missing, f"routed kernel ops missing from the registry: {', '.join(missing)}"


def _two_runs(tmp_path, **kw):
    for name in ("a", "b"):
        train.main(tiny(tmp_path, name, **kw))
    return final_state(tmp_path, "a"), final_state(tmp_path, "b")


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_tree_fixed_seeds_runs_are_bitwise_identical(tmp_path, layout):
    need_all_ops()
    (wa, pa, ca), (wb, pb, cb) = _two_runs(tmp_path, kernel="tree", channels_last=layout == "channels_last")
    assert same_state(wa, wb)
    assert pa.tobytes() == pb.tobytes()
    assert ca == cb and len(ca) == 48 // 16 + 1


def test_atomic_runs_differ(tmp_path):
    """Negative control: the same seeds with atomic kernels whose CPU models draw two different (seeded)
    arrival orders, as two GPU runs would."""
    need_all_ops()
    train.main(tiny(tmp_path, "a", kernel="atomic", kernel_seed=1))
    train.main(tiny(tmp_path, "b", kernel="atomic", kernel_seed=2))
    (wa, _, ca), (wb, _, cb) = final_state(tmp_path, "a"), final_state(tmp_path, "b")
    assert not same_state(wa, wb)
    assert ca[0] == cb[0]   # same initial weights: the seeds are fixed
    assert ca[-1]["checksum"] != cb[-1]["checksum"]


def test_one_atomic_op_alone_makes_runs_differ(tmp_path):
    need_all_ops()
    for name, seed in (("a", 1), ("b", 2)):
        train.main(tiny(tmp_path, name, kernel="tree", kernel_ops={"conv_wgrad": "atomic"}, kernel_seed=seed))
    assert not same_state(final_state(tmp_path, "a")[0], final_state(tmp_path, "b")[0])


def test_seeded_atomic_cpu_models_reproduce(tmp_path):
    need_all_ops()
    (wa, pa, _), (wb, pb, _) = _two_runs(tmp_path, kernel="atomic", kernel_seed=42)
    assert same_state(wa, wb) and pa.tobytes() == pb.tobytes()


def test_algo_preset_members_start_apart_and_perturbation_shows_at_step_zero(tmp_path):
    need_all_ops()
    train.main(tiny(tmp_path, "algo", preset="algo", members=2))
    c0 = runio.read_csv(runio.member_dir(tmp_path, "algo", 0) / "checksums.csv")
    c1 = runio.read_csv(runio.member_dir(tmp_path, "algo", 1) / "checksums.csv")
    assert c0[0]["checksum"] != c1[0]["checksum"]          # different init
    train.main(tiny(tmp_path, "p0", n_train=32))
    train.main(tiny(tmp_path, "p1", n_train=32, perturb_ulp=True, perturb_index=5))
    a = runio.read_csv(runio.member_dir(tmp_path, "p0", 0) / "checksums.csv")
    b = runio.read_csv(runio.member_dir(tmp_path, "p1", 0) / "checksums.csv")
    assert a[0]["checksum"] != b[0]["checksum"]
    cfg = runio.read_json(runio.member_dir(tmp_path, "p1", 0) / "config.json")
    assert cfg["perturb"]["flat_index"] == 5


@pytest.mark.gpu
def test_gpu_tree_fixed_seeds_identical_atomic_differ(tmp_path):
    need_all_ops()
    kw = dict(device="cuda", model="resnet18", n_train=1024, n_test=256, batch_size=128, epochs=1)
    (wa, pa, _), (wb, pb, _) = _two_runs(tmp_path / "tree", kernel="tree", **kw)
    assert same_state(wa, wb) and pa.tobytes() == pb.tobytes()
    (wa, _, _), (wb, _, _) = _two_runs(tmp_path / "atomic", kernel="atomic", **kw)
    assert not same_state(wa, wb)


@pytest.mark.gpu
def test_gpu_shuffled_channels_runs_identical(tmp_path):
    """--shuffle-channels on the GPU (the order drawn from the CUDA augmentation generator): two tree runs
    with fixed seeds give the same bits, and other bits than a run without shuffling."""
    need_all_ops()
    kw = dict(device="cuda", model="resnet20", n_train=512, n_test=256, batch_size=128, epochs=1, kernel="tree")
    (wa, pa, _), (wb, pb, _) = _two_runs(tmp_path / "on", shuffle_channels=True, **kw)
    assert same_state(wa, wb) and pa.tobytes() == pb.tobytes()
    train.main(tiny(tmp_path / "off", "a", shuffle_channels=False, **kw))
    assert not same_state(wa, final_state(tmp_path / "off", "a")[0])


def test_pinned_flags_pin_the_cpu_float32_precision():
    """torch.set_float32_matmul_precision("medium") makes oneDNN's CPU matmuls bf16; inside pinned_flags
    float32 stays float32 (a 64x64 product equals the one under "highest" bit for bit), and the setting
    comes back on exit."""
    onednn = getattr(torch.backends.mkldnn, "matmul", None)
    if onednn is None or not hasattr(onednn, "fp32_precision"):
        pytest.skip("this torch has no oneDNN fp32_precision flags")
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        exact = a @ b
        torch.set_float32_matmul_precision("medium")
        outside = onednn.fp32_precision
        with noise.pinned_flags(tf32=False, cudnn_deterministic=True):
            assert onednn.fp32_precision == "ieee"
            assert bitwise_equal(a @ b, exact)
        assert onednn.fp32_precision == outside
    finally:
        torch.set_float32_matmul_precision(before)
