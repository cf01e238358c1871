"""The study command: grid, paths by backend, validation before training, and resumption (a study killed
after k members continues; finished members are never retrained). Tiny sizes: native backward on the
small model, 64 training images, one epoch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnrand import routing, runio, study, train

REPO = Path(__file__).resolve().parent.parent
TINY = {"model": "small", "epochs": 1, "batch_size": 32, "n_train": 64, "n_test": 48}


def tiny_grid(tmp_path, configs=("seeds", "fixed")) -> Path:
    """Configurations whose members differ (per-member seeds) or not (fixed), stock backward."""
    entries = {"seeds": {"name": "seeds", "preset": "algo", "kernel": "native", "note": "per-member seeds"},
               "fixed": {"name": "fixed", "preset": "control", "kernel": "native"}}
    spec = {"members": 2, "sizes": TINY, "config": [entries[c] for c in configs]}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(spec))
    return path


def make(tmp_path, **kw):
    return study.make_study(device="cpu", grid_file=str(tiny_grid(tmp_path)), runs_dir=str(tmp_path / "runs"),
                            out=str(tmp_path / "reports" / "div.md"), **kw)


def stamps(s: study.Study) -> dict:
    return {(p.name, m): (runio.member_dir(s.runs_dir, p.name, m) / "result.json").stat().st_mtime_ns
            for p in s.plan for m in range(s.members) if study.member_done(s, p, m)}


# --------------------------------------------------------------------------------------------------
# Grid and paths


def test_default_grid():
    names = [e.name for e in study.default_grid("resnet18")]
    assert names[:5] == ["control", "algo", "impl", "algo+impl", "perturb_ulp"]
    assert names[-1] == "native"
    assert [n for n in names if n.startswith("atomic-")] == [f"atomic-{op}" for op in routing.ROUTED_OPS]
    grid = {e.name: e for e in study.default_grid("resnet18")}
    assert grid["atomic-maxpool_bwd"].overrides["model"] == "resnet18_imagenet"   # resnet18 has no max-pool
    small = {e.name: e for e in study.default_grid("small")}
    assert "model" not in small["atomic-maxpool_bwd"].overrides                   # small has one
    assert grid["atomic-conv_wgrad"].overrides == {"preset": "control", "kernel_ops": {"conv_wgrad": "atomic"}}
    assert grid["native"].overrides["kernel"] == "native" and grid["perturb_ulp"].overrides["perturb_ulp"]


def test_paths_by_backend(tmp_path):
    assert study.default_stem("cuda", False) == "divergence"
    assert study.default_stem("cuda", True) == "divergence_quick"
    assert study.default_stem("cpu", True) == "divergence_cpu"
    s = study.make_study(device="cpu")
    assert s.quick and s.stem == "divergence_cpu" and s.report_path.name == "divergence_cpu.md"
    assert s.results_path.parent.name == "results" and s.runs_dir == Path("runs/divergence_cpu")
    assert len(s.plan) == 10 and s.members == 3
    s = make(tmp_path)
    assert s.report_path == tmp_path / "reports" / "div.md"
    assert s.results_path == tmp_path / "reports" / "results" / "div.json"


def test_lr_grid_and_subset(tmp_path):
    s = study.make_study(device="cpu", configs=["control", "impl"], lrs=[0.1, 0.4])
    assert [p.name for p in s.plan] == ["control_lr0.1", "control_lr0.4", "impl_lr0.1", "impl_lr0.4"]
    assert [p.config["lr"] for p in s.plan] == [0.1, 0.4, 0.1, 0.4]


def test_toml_grid(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('members = 4\n[sizes]\nepochs = 3\n[[config]]\nname = "w"\npreset = "control"\n'
                    'kernel_ops = { conv_wgrad = "atomic" }\n')
    s = study.make_study(device="cpu", grid_file=str(path))
    assert s.members == 4 and s.plan[0].config["epochs"] == 3
    assert s.plan[0].config["kernel_ops"] == {"conv_wgrad": "atomic"}


@pytest.mark.parametrize("kw,message", [
    ({"configs": ["nope"]}, "unknown nope"),
    ({"members": 1}, "--members must be >= 2"),
    ({"sizes": {"epochs": 0}}, "--epochs must be >= 1"),
    ({"sizes": {"model": "vgg"}}, "unknown model"),
])
def test_bad_options_fail_before_training(tmp_path, kw, message):
    with pytest.raises(study.StudyError, match=message):
        study.make_study(device="cpu", runs_dir=str(tmp_path / "runs"), **kw)
    assert not (tmp_path / "runs").exists()


def test_bad_grid_file(tmp_path):
    bad = tmp_path / "g.json"
    bad.write_text(json.dumps({"config": [{"name": "x", "kernal": "tree"}]}))
    with pytest.raises(study.StudyError, match="unknown fields"):
        study.make_study(device="cpu", grid_file=str(bad))
    bad.write_text("{not json")
    with pytest.raises(study.StudyError, match="g.json"):
        study.make_study(device="cpu", grid_file=str(bad))


def test_perturbed_members_move_different_weights(tmp_path):
    s = study.make_study(device="cpu", configs=["perturb_ulp"])
    p = s.plan[0]
    idx = [study.member_config(p, m, runs_dir=tmp_path, progress=False)["perturb_index"] for m in range(3)]
    assert len(set(idx)) == 3
    assert idx == [study.member_config(p, m, runs_dir=tmp_path, progress=False)["perturb_index"] for m in range(3)]


# --------------------------------------------------------------------------------------------------
# Resumption


def test_killed_study_continues_and_skips_finished_members(tmp_path, monkeypatch):
    s = make(tmp_path)
    real = train.main
    calls = []

    def killed_after(k):
        def main(cfg):
            if len(calls) == k:
                raise KeyboardInterrupt("killed")
            calls.append((cfg["name"], cfg["first_member"]))
            return real(cfg)
        return main

    monkeypatch.setattr(train, "main", killed_after(1))
    with pytest.raises(KeyboardInterrupt):
        study.run(s, progress=False)
    assert calls == [("seeds", 0)]
    before = stamps(s)
    assert list(before) == [("seeds", 0)]

    calls.clear()
    monkeypatch.setattr(train, "main", killed_after(99))
    out = study.run(s, progress=False)
    assert out == {"trained": 3, "stopped": False, "remaining": 0}
    assert calls == [("seeds", 1), ("fixed", 0), ("fixed", 1)]     # the finished member is not retrained
    after = stamps(s)
    assert after[("seeds", 0)] == before[("seeds", 0)] and len(after) == 4

    calls.clear()
    assert study.run(s, progress=False)["trained"] == 0 and calls == []

    res = study.collect(s)
    assert res["missing"] == []
    assert res["configs"]["fixed"]["metrics"]["disagreement"] == 0.0     # fixed seeds, CPU: deterministic
    assert res["configs"]["fixed"]["first_divergence"]["per_pair"] == [None]
    assert res["configs"]["seeds"]["first_divergence"]["per_pair"] == [0]   # different init: differ at step 0
    assert len(res["configs"]["seeds"]["weights"]) == TINY["epochs"]


@pytest.mark.slow
def test_time_budget_stops_cleanly_and_the_same_command_resumes(tmp_path):
    grid = tiny_grid(tmp_path, ("seeds",))
    argv = ["--device", "cpu", "--grid", str(grid), "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "rep" / "div.md"), "--no-progress", "--no-timing"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = lambda *extra: subprocess.run([sys.executable, "-m", "nnrand.study", *argv, *extra],  # noqa: E731
                                        capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    r = run("--time-budget", "0.001")      # the first member always starts; the budget stops the second
    assert r.returncode == 0, r.stderr
    assert "resume with the same command" in r.stdout
    report = (tmp_path / "rep" / "div.md").read_text()
    assert "## Missing" in report and "`seeds`: 1/2 members finished" in report

    r = run()
    assert r.returncode == 0, r.stderr
    assert "resume" not in r.stdout
    report = (tmp_path / "rep" / "div.md").read_text()
    assert "## Missing" not in report and "| `seeds` |" in report
    res = json.loads((tmp_path / "rep" / "results" / "div.json").read_text())
    assert res["configs"]["seeds"]["done"] == 2 and res["missing"] == []

    # the report command re-renders from the files without training
    stamp = (tmp_path / "runs" / "seeds" / "member_000" / "result.json").stat().st_mtime_ns
    r = run("report")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "runs" / "seeds" / "member_000" / "result.json").stat().st_mtime_ns == stamp

    r = run("status")
    assert "seeds" in r.stdout and "2/2 members done" in r.stdout

    # without the run directories, the report renders from the results file alone
    import shutil

    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "rep" / "div.md").unlink()
    r = run("--report-only")
    assert r.returncode == 0, r.stderr
    assert "| `seeds` |" in (tmp_path / "rep" / "div.md").read_text()


def test_help_has_examples():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "nnrand.study", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0 and "examples:" in r.stdout and "--time-budget" in r.stdout


def test_default_cuda_study_plan(monkeypatch):
    """The H200 grid as planned on a CUDA machine (planning only; nothing runs on a device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    s = study.make_study()
    assert s.backend == "cuda" and not s.quick and s.stem == "divergence"
    assert s.report_path == study.REPO / "reports" / "divergence.md"
    assert s.members == 3 and len(s.plan) == 10
    cfg = {p.name: p.config for p in s.plan}
    assert all(c["device"] == "cuda" and c["epochs"] == 10 and c["batch_size"] == 128 and c["n_train"] == 10_000
               for c in cfg.values())
    assert cfg["control"]["model"] == "resnet18" and cfg["atomic-maxpool_bwd"]["model"] == "resnet18_imagenet"
    m = study.member_config(s.plan[1], 2, runs_dir=Path("runs/x"), progress=False)
    assert (m["first_member"], m["members"], m["save_epoch_weights"], m["report"]) == (2, 1, True, False)
