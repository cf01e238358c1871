"""Training harness: command line, errors before training, run files, checksums, and resumption that
ends bitwise identical to an uninterrupted run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nnrand import models, routing, runio, train
from tests.helpers import bitwise_equal

REPO = Path(__file__).resolve().parent.parent


def tiny(tmp_path, name: str, **kw) -> dict:
    cfg = dict(out=str(tmp_path), name=name, device="cpu", model="small", n_train=48, n_test=24,
               batch_size=16, epochs=1, progress=False, report=False)
    cfg.update(kw)
    return cfg


def need_all_ops():
    missing = [op for op in routing.ROUTED_OPS if not routing.registered_variants(op)]
    # every routed op must be registered: a missing one is a failure, not a reason to skip
    assert not missing, f"routed kernel ops missing from the registry: {', '.join(missing)}"


def cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "nnrand.train", *argv], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)


# --------------------------------------------------------------------------------------------------
# Command line and early errors


def test_help_shows_examples():
    r = cli("--help")
    assert r.returncode == 0
    assert "examples:" in r.stdout and "--kernel-op conv_wgrad=atomic" in r.stdout
    for op in routing.ROUTED_OPS:
        assert op in r.stdout


def test_device_defaults_fill_only_what_is_unset():
    cpu = train.resolve(train.Config(device="cpu"))
    assert (cpu.model, cpu.epochs, cpu.batch_size, cpu.lr, cpu.n_train) == ("small", 5, 64, 0.2, 8192)
    mine = train.resolve(train.Config(device="cpu", lr=0.3, batch_size=32))
    assert (mine.lr, mine.batch_size) == (0.3, 32)
    assert train.DEVICE_DEFAULTS["cuda"]["lr"] == 0.2
    assert set(train.DEVICE_DEFAULTS["cuda"]) == set(train.DEVICE_DEFAULTS["cpu"])   # every device fills the same fields
    # colour is no cue on the CPU default (its short run must learn the shapes); CUDA keeps the study's recipe
    assert cpu.shuffle_channels is True and train.DEVICE_DEFAULTS["cuda"]["shuffle_channels"] is False
    assert train.resolve(train.Config(device="cpu", shuffle_channels=False)).shuffle_channels is False


def test_shuffle_channels_in_the_run_record(tmp_path):
    """A run with channel shuffling records it and trains other bits than one without; a run without it
    has no key (its config reads as before the option existed, so such checkpoints resume)."""
    on = train.main(tiny(tmp_path, "on", kernel="tree", shuffle_channels=True))
    off = train.main(tiny(tmp_path, "off", kernel="tree", shuffle_channels=False))
    meta_on = runio.read_json(tmp_path / "on" / "member_000" / "config.json")
    meta_off = runio.read_json(tmp_path / "off" / "member_000" / "config.json")
    assert meta_on["config"]["shuffle_channels"] is True and "shuffle_channels" not in meta_off["config"]
    assert on["members"][0]["final_checksum"] != off["members"][0]["final_checksum"]
    args = train.parser().parse_args(["--no-shuffle-channels"])
    assert train.config_from_args(args).shuffle_channels is False
    assert train.config_from_args(train.parser().parse_args([])).shuffle_channels is None


@pytest.mark.parametrize("argv,message", [
    (["--kernel-op", "conv_bgrad=tree"], "valid ops: conv_wgrad, conv_dgrad, bias_grad, maxpool_bwd"),
    (["--kernel-op", "bias_grad=fast"], "valid: native"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--init-seed", "sometimes"], "--init-seed must be"),
    (["--kernel", "fast"], "invalid choice"),
    (["--cuda-graph"], "--cuda-graph needs --device cuda"),
    (["--model", "resnet50"], "torchvision:NAME"),
    (["--model", "nosuchlib:resnet50"], "torchvision:NAME"),
    (["--image-size", "4"], "--image-size must be >= 8"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}/nothing"], "cifar"),
])
def test_bad_arguments_fail_before_training(tmp_path, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = cli(*argv, "--out", str(tmp_path / "runs"), "--device", "cpu", "--no-progress")
    assert r.returncode == 2, r.stderr
    assert message.lower() in r.stderr.lower(), r.stderr
    assert not any((tmp_path / "runs").glob("*/member_*")), "a member directory was created"


def test_corrupt_dataset_is_a_clear_error(tmp_path):
    from nnrand import data

    bad = tmp_path / "cifar"
    bad.mkdir()
    (bad / "cifar-10-python.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(data.DatasetError):
        train.main(tiny(tmp_path, "bad", dataset="cifar10", data_dir=str(bad)))
    assert not (tmp_path / "bad").exists()


def test_no_space_is_refused_before_training(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(runio.DiskSpaceError, match="not enough space"):
        train.main(tiny(tmp_path, "full"))
    assert not (tmp_path / "full").exists()


def test_space_estimate_covers_what_a_run_writes(tmp_path):
    train.main(tiny(tmp_path, "size", kernel="native", epochs=2, save_epoch_weights=True))
    d = runio.member_dir(tmp_path, "size", 0)
    written = sum(f.stat().st_size for f in d.iterdir())
    m = models.build_model("small")
    est = runio.estimate_member_bytes(sum(p.numel() for p in m.parameters()), sum(b.numel() for b in m.buffers()),
                                      epochs=2, steps_first_epoch=3, n_test=24, classes=10,
                                      save_epoch_weights=True)
    assert written <= est


# --------------------------------------------------------------------------------------------------
# Run files


def test_run_files(tmp_path):
    need_all_ops()
    out = train.main(tiny(tmp_path, "files", epochs=2, save_epoch_weights=True, report=True))
    d = runio.member_dir(tmp_path, "files", 0)
    for f in ("config.json", "metrics.csv", "checksums.csv", "predictions.npz", "checkpoint.pt", "result.json",
              "weights_epoch_000.pt", "weights_epoch_001.pt"):
        assert (d / f).exists(), f
    assert not list(d.glob(".*.tmp")), "temporary files left behind"
    cfg = runio.read_json(d / "config.json")
    # the tree family is each op's fixed-order variant: "sorted" for the scatter sums (routing's docstring)
    scatter = {"embedding_bwd", "index_add", "scatter_add"}
    assert cfg["routing"]["ops"] == {op: "sorted" if op in scatter else "tree" for op in routing.ROUTED_OPS}
    assert set(cfg["seeds"]) == {"init", "order", "aug", "kernel"}
    for key in ("gpu", "driver", "cuda", "cudnn", "torch", "cupy", "numba", "git_sha", "date"):
        assert key in cfg["fingerprint"]
    assert cfg["flags"]["tf32"] is False and cfg["flags"]["cudnn_benchmark"] is False
    metrics = runio.read_csv(d / "metrics.csv")
    assert [int(r["epoch"]) for r in metrics] == [0, 1]
    assert list(metrics[0]) == list(runio.METRICS_COLUMNS)
    assert [int(r["step"]) for r in metrics] == [3, 6]
    sums = runio.read_csv(d / "checksums.csv")
    assert [int(r["step"]) for r in sums] == [0, 1, 2, 3, 6]   # every step of epoch 0, then epoch ends
    with np.load(d / "predictions.npz") as f:
        assert f["logits"].shape == (24, 10) and f["logits"].dtype == np.float32
        assert f["labels"].shape == (24,) and f["group"].shape == (24,)
        assert f["labels"].dtype == np.int8 and f["group"].dtype == np.int8   # 10 classes, groups -1..1
    w = torch.load(d / "weights_epoch_001.pt")
    model = models.build_model("small")
    model.load_state_dict(torch.load(d / "checkpoint.pt", weights_only=False)["model"])
    assert bitwise_equal(w, train.flat_params(model))
    assert int(sums[-1]["checksum"]) == int(train.Checksum(model)(model))
    result = runio.read_json(d / "result.json")
    assert result == out["members"][0] and 0.0 <= result["test_top1"] <= 1.0
    report = (tmp_path / "files" / "report.md").read_text()
    assert "report_curves.png" in report and "git_sha" in report
    assert (tmp_path / "files" / "report_curves.png").stat().st_size > 0


def test_checksum_is_the_documented_formula():
    torch.manual_seed(3)
    model = models.build_model("small")
    bits = train.flat_params(model).numpy().view(np.int32).astype(np.int64)
    want = sum((i + 1) * int(b) for i, b in enumerate(bits.tolist()))
    want = (want + 2**63) % 2**64 - 2**63   # wrapping int64
    cs = train.Checksum(model)
    assert int(cs(model)) == want
    with torch.no_grad():   # one bit of one weight moves it
        p = next(model.parameters()).view(-1)
        p[7] = torch.nextafter(p[7], torch.tensor(float("inf")))
    assert int(cs(model)) != want


def test_finished_members_are_skipped(tmp_path):
    cfg = tiny(tmp_path, "skip", kernel="native")
    first = train.main(cfg)
    d = runio.member_dir(tmp_path, "skip", 0)
    stamp = (d / "result.json").stat().st_mtime_ns
    again = train.main(cfg)
    assert again["members"] == first["members"]
    assert (d / "result.json").stat().st_mtime_ns == stamp


def test_a_finished_member_of_another_config_is_refused(tmp_path):
    """A finished member is the run's result only under its own config: the same --name with another
    --epochs or --lr is refused, naming the fields, instead of returning the old result."""
    train.main(tiny(tmp_path, "done", kernel="native"))
    with pytest.raises(train.ConfigError, match=r"finished run with a different config \(differs in: epochs, lr\)"):
        train.main(tiny(tmp_path, "done", kernel="native", epochs=2, lr=0.05))
    train.main(tiny(tmp_path, "done", kernel="native", report=True))   # a harmless change: the same result


def test_bad_seeds_names_and_momentum_are_config_errors(tmp_path):
    for kw, named in ((dict(seed=-1), "--seed must be >= 0"), (dict(data_seed=-2), "--data-seed must be >= 0"),
                      (dict(momentum=1.0), "--momentum must be below 1"),
                      (dict(name="../elsewhere"), "--name must be a plain directory name"),
                      (dict(name="a/b"), "--name must be a plain directory name"),
                      (dict(init_seed=2**64), "--init-seed must be >= 0 and < 2\\*\\*63")):
        with pytest.raises(train.ConfigError, match=named):
            train.resolve(train.Config(**{**tiny(tmp_path, "x"), **kw}))


def test_resume_with_another_config_is_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "cfg", kernel="native", epochs=2, interrupt_at_step=3))
    with pytest.raises(train.ConfigError, match="lr"):
        train.main(tiny(tmp_path, "cfg", kernel="native", epochs=2, lr=0.05))


def test_cudnn_benchmark_is_for_nondeterministic_routings_only(tmp_path):
    """--cudnn-benchmark (cuDNN's algorithms chosen by timing: the fastest native configuration) runs
    and is recorded under native kernels; with a routing that claims determinism, or --world-invariant,
    it is a config error naming the option; off, a run's config reads as before the option existed."""
    out = train.main(tiny(tmp_path, "bench", kernel="native", cudnn_benchmark=True))
    meta = runio.read_json(runio.member_dir(tmp_path, "bench", 0) / "config.json")
    assert meta["config"]["cudnn_benchmark"] is True and meta["flags"]["cudnn_benchmark"] is True
    assert out["members"][0]["final_checksum"] is not None
    train.main(tiny(tmp_path, "plain", kernel="native"))
    meta = runio.read_json(runio.member_dir(tmp_path, "plain", 0) / "config.json")
    assert "cudnn_benchmark" not in meta["config"] and meta["flags"]["cudnn_benchmark"] is False
    for kw, named in ((dict(kernel="tree"), "--kernel tree$"),
                      (dict(kernel="fastest-deterministic"), "--kernel fastest-deterministic$"),
                      (dict(kernel="native", kernel_ops={"conv_wgrad": "tree"}),
                       "--kernel native --kernel-op conv_wgrad=tree$"),
                      (dict(kernel="native", world_invariant=True), "not to --world-invariant$")):
        with pytest.raises(train.ConfigError, match=f"^--cudnn-benchmark .*{named}"):
            train.resolve(train.Config(**tiny(tmp_path, "bad", cudnn_benchmark=True, **kw)))
    # a per-op override that is itself nondeterministic keeps the routing nondeterministic: allowed
    train.resolve(train.Config(**tiny(tmp_path, "ok", kernel="native", kernel_ops={"conv_wgrad": "atomic"},
                                      cudnn_benchmark=True)))


def test_unreadable_checkpoint_is_a_one_line_cli_error(tmp_path):
    """A truncated or overwritten checkpoint.pt stops the resume with exit code 2 and one line naming the
    file and the two ways out; --no-resume then starts the member again."""
    argv = ["--kernel", "native", "--device", "cpu", "--model", "small", "--n-train", "48", "--n-test", "24",
            "--batch-size", "16", "--epochs", "2", "--out", str(tmp_path), "--name", "ckpt", "--no-progress",
            "--no-report"]
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "ckpt", kernel="native", epochs=2, interrupt_at_step=2))
    path = runio.member_dir(tmp_path, "ckpt", 0) / "checkpoint.pt"
    good = path.read_bytes()
    for damaged in (good[:len(good) // 2], b"\x00" * 64):   # truncated; overwritten
        path.write_bytes(damaged)
        with pytest.raises(runio.CheckpointError):
            runio.load_checkpoint(path.parent)
        r = cli(*argv)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert str(path) in lines[0] and "delete it" in lines[0] and "--no-resume" in lines[0], lines[0]
    r = cli(*argv, "--no-resume")
    assert r.returncode == 0, r.stderr
    assert runio.is_finished(path.parent)


# --------------------------------------------------------------------------------------------------
def test_eval_every_skips_test_evaluations_only(tmp_path):
    """--eval-every 2 over 3 epochs: test metrics after epochs 2 and 3 only; training, checksums and the
    final predictions are those of a run that evaluates every epoch, and the predictions are the bits a
    fresh evaluation of the final model gives."""
    need_all_ops()
    train.main(tiny(tmp_path, "every1", epochs=3))
    train.main(tiny(tmp_path, "every2", epochs=3, eval_every=2))
    a, b = runio.member_dir(tmp_path, "every1", 0), runio.member_dir(tmp_path, "every2", 0)
    ma, mb = runio.read_csv(a / "metrics.csv"), runio.read_csv(b / "metrics.csv")
    assert [bool(r["test_top1"]) for r in ma] == [True, True, True]
    assert [bool(r["test_top1"]) for r in mb] == [False, True, True]
    assert [r["test_top1"] for r in mb[1:]] == [r["test_top1"] for r in ma[1:]]
    for f in ("checksums.csv", "predictions.npz"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ds = train.load_data(train.resolve(train.Config(**tiny(tmp_path, "every2", epochs=3))))
    model = models.build_model("small")
    model.load_state_dict(torch.load(b / "checkpoint.pt", weights_only=False)["model"])
    logits = train.evaluate(model, ds, torch.contiguous_format)[1]
    with np.load(b / "predictions.npz") as f:
        assert np.array_equal(f["logits"], logits.numpy())
    with pytest.raises(train.ConfigError, match="--eval-every must be >= 1"):
        train.resolve(train.Config(**tiny(tmp_path, "bad", eval_every=0)))


# Resumption: interrupted + resumed == uninterrupted, bit for bit


@pytest.mark.parametrize("interrupt_at", [3, 4], ids=["epoch_boundary", "mid_epoch"])
def test_resume_is_bitwise_identical(tmp_path, interrupt_at):
    need_all_ops()
    kw = dict(epochs=2, kernel="tree", save_epoch_weights=True)
    train.main(tiny(tmp_path, "straight", **kw))
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "resumed", interrupt_at_step=interrupt_at, **kw))
    d = runio.member_dir(tmp_path, "resumed", 0)
    assert (d / "checkpoint.pt").exists() and not (d / "result.json").exists()
    train.main(tiny(tmp_path, "resumed", **kw))
    a, b = runio.member_dir(tmp_path, "straight", 0), d
    wa = torch.load(a / "checkpoint.pt", weights_only=False)
    wb = torch.load(b / "checkpoint.pt", weights_only=False)
    for k in wa["model"]:
        assert bitwise_equal(wa["model"][k], wb["model"][k]), k
    for f in ("checksums.csv", "predictions.npz", "weights_epoch_000.pt", "weights_epoch_001.pt"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ma, mb = runio.read_csv(a / "metrics.csv"), runio.read_csv(b / "metrics.csv")
    for ra, rb in zip(ma, mb):
        for col in ("epoch", "step", "train_loss", "train_top1", "test_loss", "test_top1", "test_top5"):
            assert ra[col] == rb[col], col
    assert runio.read_json(b / "config.json")["resumed_from"]["step"] == interrupt_at
    # the routing's counts cover both processes: as many routed calls as the uninterrupted run's
    ra, rb = runio.read_json(a / "result.json"), runio.read_json(b / "result.json")
    assert rb["coverage"] == ra["coverage"] and ra["coverage"] and rb["uncovered"] == ra["uncovered"]


def test_a_resume_under_other_cpu_threads_is_recorded(tmp_path):
    """The thread count changes a CPU run's bits: a resume under another one goes on, with the change
    recorded in config.json (old and new) beside the step it resumed at."""
    kw = dict(epochs=2, kernel="native")
    threads = torch.get_num_threads()
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "threads", interrupt_at_step=3, **kw))
    torch.set_num_threads(threads + 1)
    try:
        train.main(tiny(tmp_path, "threads", **kw))
    finally:
        torch.set_num_threads(threads)
    resumed = runio.read_json(runio.member_dir(tmp_path, "threads", 0) / "config.json")["resumed_from"]
    assert resumed["fingerprint_changes"] == {"cpu_threads": [threads, threads + 1]}


def test_a_resume_under_another_cpu_instruction_set_is_recorded(tmp_path, monkeypatch):
    """torch's CPU kernels dispatch by instruction set (AVX2, AVX512, ...), which changes CPU results: a
    resume whose capability differs from the run's start records the change as it does other versions."""
    from nnrand import fingerprint

    kw = dict(epochs=2, kernel="native")
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "isa", interrupt_at_step=3, **kw))
    first = fingerprint._cpu_capability()
    monkeypatch.setattr(fingerprint, "_cpu_capability", lambda: "OTHER")
    train.main(tiny(tmp_path, "isa", **kw))
    resumed = runio.read_json(runio.member_dir(tmp_path, "isa", 0) / "config.json")["resumed_from"]
    assert resumed["fingerprint_changes"] == {"cpu_capability": [first, "OTHER"]}


def test_a_field_the_first_fingerprint_lacks_is_no_change_on_resume(tmp_path, monkeypatch):
    """A checkpoint written before a fingerprint field existed (no ``cpu_capability`` in its first
    fingerprint) resumes without that field recorded as a change."""
    from nnrand import fingerprint

    kw = dict(epochs=2, kernel="native")
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "old", interrupt_at_step=3, **kw))
    path = runio.member_dir(tmp_path, "old", 0) / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    del ckpt["state"]["fingerprint"]["cpu_capability"]
    torch.save(ckpt, path)
    monkeypatch.setattr(fingerprint, "_cpu_capability", lambda: "OTHER")
    train.main(tiny(tmp_path, "old", **kw))
    resumed = runio.read_json(runio.member_dir(tmp_path, "old", 0) / "config.json")["resumed_from"]
    assert "fingerprint_changes" not in resumed and resumed["step"] > 0


def test_atomic_resume_with_seeded_cpu_order_is_identical(tmp_path):
    """The kernel RNG state travels in the checkpoint too."""
    need_all_ops()
    kw = dict(epochs=2, kernel="atomic", kernel_seed=9)
    train.main(tiny(tmp_path, "straight", **kw))
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "resumed", interrupt_at_step=2, **kw))
    train.main(tiny(tmp_path, "resumed", **kw))
    a = runio.member_dir(tmp_path, "straight", 0)
    b = runio.member_dir(tmp_path, "resumed", 0)
    assert (a / "checksums.csv").read_bytes() == (b / "checksums.csv").read_bytes()
    assert (a / "predictions.npz").read_bytes() == (b / "predictions.npz").read_bytes()


# --------------------------------------------------------------------------------------------------
# The default command


@pytest.mark.slow
def test_default_command_runs_on_cpu(tmp_path):
    """`python -m nnrand.train --kernel tree` with its CPU defaults (target: <= 3 min on 2 cores)."""
    need_all_ops()
    r = cli("--kernel", "tree", "--device", "cpu", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "outputs:" in r.stdout and "report:" in r.stdout
    run = next(tmp_path.iterdir())
    assert (run / "report.md").exists() and (run / "member_000" / "result.json").exists()


def test_missing_model_library_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_timm(name, *a, **k):
        if name == "timm":
            raise ImportError("No module named 'timm'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_timm)
    with pytest.raises(train.ConfigError, match=r"nnrand\[vision\]"):
        train.main(tiny(tmp_path, "ext", model="timm:resnet18"))


def test_strict_refusal_and_no_strict_records_uncovered(tmp_path, monkeypatch):
    """A model with an uncovered nondeterministic op: strict raises naming the op; --no-strict trains and
    writes the op into result.json's uncovered list."""
    need_all_ops()
    from torch import nn

    def with_pool(name, num_classes=10):
        net = models._BUILDERS["small"](num_classes)
        net.pool = nn.Sequential(nn.ReflectionPad2d(1), nn.AdaptiveAvgPool2d(1))
        net.fc = nn.Linear(net.fc.in_features, num_classes)
        return net
    monkeypatch.setattr(models, "build_model", with_pool)
    with pytest.raises(routing.NondeterministicOpError, match="reflection_pad2d"):
        train.main(tiny(tmp_path, "strict"))
    with pytest.warns(RuntimeWarning, match="not covered by nnrand"):
        out = train.main(tiny(tmp_path, "lenient", strict=False))
    result = out["members"][0]
    assert result["uncovered"] == ["reflection_pad2d_backward"]
    assert result["coverage"]["convolution_backward"]["tree"] > 0


def test_digits_dataset_trains_and_records_groups(tmp_path):
    """--dataset digits (extra nnrand[data]) through the harness: per-image groups reach predictions.npz."""
    pytest.importorskip("sklearn", reason="--dataset digits needs scikit-learn (extra nnrand[data])")
    out = train.main(tiny(tmp_path, "digits", dataset="digits", kernel="native"))
    pred = np.load(runio.member_dir(tmp_path, "digits", 0) / "predictions.npz")
    assert pred["logits"].shape == (24, 10) and set(pred["group"].tolist()) <= {0, 1}
    assert 0.0 <= out["members"][0]["test_top1"] <= 1.0


@pytest.mark.parametrize("values, dtype", [([0, 9, -1], np.int8), ([0, 99], np.int8), ([0, 127], np.int8),
                                           ([-129, 0], np.int16), ([0, 999], np.int16), ([0, 40000], np.int32),
                                           ([0, 2**40], np.int64), ([], np.int8)])
def test_small_ints_keeps_every_value_in_the_narrowest_type(values, dtype):
    a = np.array(values, dtype=np.int64)
    out = runio.small_ints(a)
    assert out.dtype == dtype and np.array_equal(out.astype(np.int64), a)


def test_cudnn_heuristic_is_chosen_before_cuda_and_recorded(tmp_path, monkeypatch):
    """--cudnn-heuristic: torch reads the variable once per process, so it is set only while CUDA is unused
    and a process already on CUDA under another mode is refused, never half-switched; a CPU run records
    PyTorch's default and refuses mode b; the default mode leaves a run's config as before the option."""
    from nnrand import noise

    monkeypatch.setenv(noise.HEURISTIC_ENV, "0")   # recorded, so the test puts back what it found
    monkeypatch.delenv(noise.HEURISTIC_ENV)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert noise.cudnn_heuristic_now() == "instant"
    noise.set_cudnn_heuristic("b")
    assert os.environ[noise.HEURISTIC_ENV] == "1" and noise.cudnn_heuristic_now() == "b"
    noise.set_cudnn_heuristic("instant")
    assert os.environ[noise.HEURISTIC_ENV] == "0" and noise.cudnn_heuristic_now() == "instant"
    with pytest.raises(ValueError, match="must be one of instant, b"):
        noise.set_cudnn_heuristic("a")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    noise.set_cudnn_heuristic("instant")   # the mode it runs: nothing to change
    with pytest.raises(ValueError, match=f"already uses CUDA under cuDNN heuristic instant.*{noise.HEURISTIC_ENV}=1"):
        noise.set_cudnn_heuristic("b")
    assert noise.cudnn_heuristic_now() == "instant"
    # torch reads exactly 0 or 1 and ignores anything else: another value is an error, never taken for b
    monkeypatch.setenv(noise.HEURISTIC_ENV, "true")
    with pytest.raises(ValueError, match="TORCH_CUDNN_USE_HEURISTIC_MODE_B='true': torch reads 0 or 1"):
        noise.cudnn_heuristic_now()
    monkeypatch.setattr(noise, "_AT_START", "yes")
    with pytest.raises(ValueError, match="'yes': torch reads 0 or 1"):
        noise.default_cudnn_heuristic()
    monkeypatch.setattr(noise, "_AT_START", None)   # the default is the environment the process started in
    monkeypatch.setenv(noise.HEURISTIC_ENV, "1")
    assert noise.default_cudnn_heuristic() == "instant" and noise.cudnn_heuristic_now() == "b"
    monkeypatch.setenv(noise.HEURISTIC_ENV, "0")

    with pytest.raises(train.ConfigError, match="--cudnn-heuristic b .* applies to --device cuda"):
        train.resolve(train.Config(**tiny(tmp_path, "b", cudnn_heuristic="b")))
    with pytest.raises(train.ConfigError, match="--cudnn-heuristic must be one of instant, b"):
        train.resolve(train.Config(**tiny(tmp_path, "x", cudnn_heuristic="x")))
    monkeypatch.setenv(noise.HEURISTIC_ENV, "1")   # a CPU run ignores the variable: cuDNN is not in it
    assert train.resolve(train.Config(**tiny(tmp_path, "cpu"))).cudnn_heuristic == "instant"
    train.main(tiny(tmp_path, "cpu", kernel="tree"))
    meta = runio.read_json(runio.member_dir(tmp_path, "cpu", 0) / "config.json")
    assert "cudnn_heuristic" not in meta["config"] and meta["flags"]["cudnn_heuristic"] == "instant"
    # mode b is part of a run's config: a checkpoint resumes only under it
    cfg = train.resolve(train.Config(**tiny(tmp_path, "cpu")))
    cfg.cudnn_heuristic = "b"
    seeds = noise.member_seeds({src: getattr(cfg, f"{src}_seed") for src in noise.SOURCES}, cfg.seed, 0)
    rec = train.member_config(cfg, 0, seeds, routing.resolve("tree"), {})
    assert rec["config"]["cudnn_heuristic"] == "b" and rec["flags"]["cudnn_heuristic"] == "b"
    assert train.parser().parse_args(["--cudnn-heuristic", "b"]).cudnn_heuristic == "b"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_get_the_permissions_of_a_plain_open(tmp_path, umask, mode):
    """Files a run writes through the atomic temp-and-rename path are readable as open() would make them
    under the umask in force when they are written (mkstemp's own 0600 would hide a run from the user's
    group on a shared machine; a umask read once at import would miss a later umask 002)."""
    import os
    import stat

    mask = os.umask(umask)
    try:
        runio.write_json(tmp_path / "r.json", {"a": 1})
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(mask)
    want = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == want == mode
    assert not list(tmp_path.glob(".*.tmp"))


def test_no_resume_removes_the_old_runs_files_only(tmp_path):
    """--no-resume starts the member afresh: the old run's files go (its epoch weights too, which the new run
    does not write), files the harness does not write stay."""
    need_all_ops()
    train.main(tiny(tmp_path, "again", epochs=2, save_epoch_weights=True, kernel="native"))
    d = runio.member_dir(tmp_path, "again", 0)
    assert (d / "weights_epoch_001.pt").exists()
    (d / "notes.txt").write_text("mine")
    (d / ".metrics.csv.0a1b2c3d.tmp").write_bytes(b"left by a crash")
    (d / "mine").mkdir()
    (d / "mine" / "weights_epoch_000.pt").write_bytes(b"not the harness's")
    train.main(tiny(tmp_path, "again", epochs=1, kernel="native", resume=False))
    left = sorted(f.name for f in d.iterdir())
    assert left == sorted(["config.json", "metrics.csv", "checksums.csv", "predictions.npz", "checkpoint.pt",
                           "result.json", "notes.txt", "mine"]), left
    assert (d / "mine" / "weights_epoch_000.pt").exists() and (d / "notes.txt").read_text() == "mine"
    assert [int(r["epoch"]) for r in runio.read_csv(d / "metrics.csv")] == [0]
    assert runio.read_json(d / "config.json")["config"]["epochs"] == 1


def test_augmentation_is_keyed_by_image_not_by_order_or_batch():
    """Every run augments each image by its dataset index, the augmentation seed and the epoch: another
    order seed, batch size or batch position gives every image the same pixels (the order seed varies the
    order alone), another augmentation seed other ones. Old positional runs are told apart by the config."""
    from nnrand import data

    ds = data.synthetic(n_train=64, n_test=8, seed=0)
    def pixels(order_seed, batch, aug_seed=5):
        order = data.epoch_order(64, 0, order_seed)
        got = {}
        for i in range(64 // batch):
            x, _ = train.train_batch(ds, order, i, batch, aug_seed, 0, torch.contiguous_format)
            for k, j in enumerate(order[i * batch:(i + 1) * batch].tolist()):
                got[j] = x[k]
        return got
    ref = pixels(1, 16)
    for other in (pixels(2, 16), pixels(1, 32), pixels(3, 8)):
        assert all(bitwise_equal(ref[j], other[j]) for j in range(64))
    moved = pixels(1, 16, aug_seed=6)
    assert sum(not torch.equal(ref[j], moved[j]) for j in range(64)) > 32
    assert train.config_record(train.Config())["augmentation"] == "indexed"
    assert "augmentation" not in train.config_record(train.Config(world_invariant=True, micro_batch=8))


def test_requests_beyond_a_fixed_dataset_use_what_it_holds():
    """--n-train/--n-test above a fixed dataset's split sizes resolve to those sizes (the config records
    what the run uses), and the sizes are the loader's."""
    from nnrand import data

    cfg = train.resolve(train.Config(device="cpu", dataset="digits", n_train=5000, n_test=1000))
    assert (cfg.n_train, cfg.n_test) == data.SPLIT_SIZES["digits"]
    assert train.resolve(train.Config(device="cpu", dataset="digits", n_train=100)).n_train == 100
    pytest.importorskip("sklearn", reason="--dataset digits needs scikit-learn (extra nnrand[data])")
    ds = data.load_dataset("digits")
    assert (len(ds.train_y), len(ds.test_y)) == data.SPLIT_SIZES["digits"]
