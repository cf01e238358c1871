"""The study command: grid, paths by backend, validation before training, and resumption (a study killed
after k members continues; finished members are never retrained). Tiny sizes: native backward on the
small model, 64 training images, one epoch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    assert names[:8] == ["control", "algo", "impl", "algo+impl", "ulp", "init", "order", "aug"]
    assert [n for n in names if n.startswith("atomic-")] == [f"atomic-{op}" for op in study.ATTRIBUTION_OPS]
    assert set(study.ATTRIBUTION_OPS) <= set(routing.ROUTED_OPS)
    # resnet18 has no max-pool: max-pool backward runs on its sibling, which gets its own seed baselines
    assert names[-5:] == ["native", "algo-bf16", "impl-bf16", "control@resnet18_imagenet", "algo@resnet18_imagenet"]
    assert {e.name: e for e in study.default_grid("resnet18")}["impl-bf16"].overrides == {"preset": "impl",
                                                                                          "amp": "bf16"}
    grid = {e.name: e for e in study.default_grid("resnet18")}
    assert grid["atomic-maxpool_bwd"].overrides["model"] == "resnet18_imagenet"
    assert grid["algo@resnet18_imagenet"].overrides == {"preset": "algo", "model": "resnet18_imagenet"}
    small = [e.name for e in study.default_grid("small")]                           # small has a max-pool
    assert small == names[:-2]
    assert "model" not in {e.name: e for e in study.default_grid("small")}["atomic-maxpool_bwd"].overrides
    r20 = {e.name: e for e in study.default_grid("resnet20")}   # resnet20's sibling: the same body behind a max-pool
    assert r20["atomic-maxpool_bwd"].overrides["model"] == "resnet20_maxpool" and "algo@resnet20_maxpool" in r20
    own = {e.name: e for e in study.default_grid("resnet20_maxpool")}   # a model with a max-pool runs it itself
    assert "model" not in own["atomic-maxpool_bwd"].overrides and not any("@" in n for n in own)
    assert grid["atomic-conv_wgrad"].overrides == {"preset": "control", "kernel_ops": {"conv_wgrad": "atomic"}}
    assert grid["native"].overrides["kernel"] == "native" and grid["ulp"].overrides["perturb_ulp"]
    # one seed source per member at a time, everything else fixed and deterministic
    for src in ("init", "order", "aug"):
        cfg = train.resolve(train.Config(device="cpu", **grid[src].overrides))
        seeds = {k: getattr(cfg, f"{k}_seed") for k in ("init", "order", "aug")}
        assert seeds == {k: "member" if k == src else "fixed" for k in seeds} and cfg.kernel == "tree"


def test_comparisons_name_configurations_of_the_grid():
    names = {e.name for e in study.default_grid("resnet18")}
    assert all(a in names and b in names for a, b in study.COMPARISONS)
    assert ("impl", "algo") in study.COMPARISONS and ("impl", "ulp") in study.COMPARISONS
    assert study.baseline_for("control", "resnet18_imagenet", names) == "control@resnet18_imagenet"
    assert study.baseline_for("control", "resnet18", names) == "control"


def test_comparisons_pair_configurations_of_the_same_model_and_test_set():
    s = study.make_study(device="cpu", sizes={"model": "resnet18"},
                         configs=["impl", "control", "atomic-maxpool_bwd", "control@resnet18_imagenet"])
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 20)
    logits = {p.name: (rng.normal(size=(3, 20, 10)), labels) for p in s.plan}
    configs = {p.name: {"setup": {"model": p.config["model"], "dataset": "synthetic", "n_test": 20, "data_seed": 0}}
               for p in s.plan}
    got = [(c["a"], c["b"]) for c in study.comparisons(s, configs, logits)]
    # atomic-maxpool_bwd runs on resnet18_imagenet: compared with that model's control, never with impl on resnet18
    assert got == [("impl", "control"), ("atomic-maxpool_bwd", "control@resnet18_imagenet")]


def test_paths_by_backend(tmp_path):
    assert study.default_stem("cuda", False) == "divergence"
    assert study.default_stem("cuda", True) == "divergence_quick"
    assert study.default_stem("cpu", True) == "divergence_cpu"
    s = study.make_study(device="cpu")
    assert s.quick and s.stem == "divergence_cpu" and s.report_path.name == "divergence_cpu.md"
    assert s.results_path.parent.name == "results" and s.runs_dir == Path("runs/divergence_cpu")
    assert len(s.plan) == len(study.CONFIGURATIONS) and s.members == 3
    s = study.make_study(smoke=True)
    assert s.smoke and s.backend == "cpu" and s.members == 2 and s.stem == "divergence_smoke_cpu"
    assert s.report_path.name == "divergence_smoke_cpu.md" and s.plan[0].config["n_train"] == 64
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


def test_a_grid_mixing_cudnn_heuristics_is_refused(tmp_path):
    """Members share processes, where torch reads cuDNN's heuristic once: one heuristic per study."""
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"config": [{"name": "a", "preset": "control"},
                                           {"name": "b", "preset": "control", "cudnn_heuristic": "b"}]}))
    with pytest.raises(study.StudyError, match=r"cuDNN heuristics \['None', 'b'\].*in \[sizes\]"):
        study.make_study(device="cpu", grid_file=str(grid), trains=False)
    grid.write_text(json.dumps({"config": [{"name": "a", "preset": "control"}, {"name": "b", "preset": "impl"}]}))
    assert len(study.make_study(device="cpu", grid_file=str(grid), trains=False).plan) == 2


def test_perturbed_members_move_different_weights(tmp_path):
    s = study.make_study(device="cpu", configs=["ulp"])
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
    ci = res["configs"]["seeds"]["metrics"]["ci"]
    assert ci["bootstrap"]["unit"] == "members" and ci["disagreement"]["value"] == res["configs"]["seeds"]["metrics"]["disagreement"]
    assert res["comparisons"] == []          # the tiny grid names none of study.COMPARISONS


# --------------------------------------------------------------------------------------------------
# --jobs: members in spawned worker processes


def member_bits(s: study.Study) -> dict:
    """What a member computed, bit for bit: epoch weights, final logits, per-step weight checksums, and
    result.json without its timings and fingerprint (date)."""
    out = {}
    for p in s.plan:
        for m in range(s.members):
            d = runio.member_dir(s.runs_dir, p.name, m)
            with np.load(d / "predictions.npz") as f:
                logits = f["logits"].tobytes()
            result = {k: v for k, v in runio.read_json(d / "result.json").items()
                      if k not in ("step_time_ms", "train_time_s", "fingerprint")}
            out[(p.name, m)] = {"weights": [w.read_bytes() for w in sorted(d.glob("weights_epoch_*.pt"))],
                                "logits": logits, "checksums": (d / "checksums.csv").read_text(),
                                "result": result}
    return out


def test_finished_members_of_another_config_are_an_error_not_a_result(tmp_path):
    """The same runs directory after the grid's sizes changed: members finished under the old epochs are
    refused, naming the field, instead of being mixed with new ones in the study's results."""
    s = study.make_study(device="cpu", grid_file=str(tiny_grid(tmp_path, configs=("fixed",))),
                         runs_dir=str(tmp_path / "runs"), out=str(tmp_path / "reports" / "div.md"))
    assert study.run(s, progress=False)["trained"] == 2
    grid = json.loads((tmp_path / "grid.json").read_text())
    grid["sizes"] = {**grid["sizes"], "epochs": grid["sizes"].get("epochs", 1) + 1}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    changed = study.make_study(device="cpu", grid_file=str(tmp_path / "grid.json"), runs_dir=str(tmp_path / "runs"),
                               out=str(tmp_path / "reports" / "div.md"))
    with pytest.raises(train.ConfigError, match=r"another config \(differs in: epochs\)"):
        study.run(changed, progress=False)


def test_jobs_match_the_sequential_run_and_stop_at_the_budget(tmp_path):
    (tmp_path / "seq").mkdir()
    (tmp_path / "par").mkdir()
    seq = make(tmp_path / "seq")
    assert study.run(seq, progress=False) == {"trained": 4, "stopped": False, "remaining": 0}

    par = make(tmp_path / "par")
    omp = os.environ.get("OMP_WAIT_POLICY")
    # budget 0: the first two members start together (no duration known yet); once one has finished,
    # nothing more is submitted and the running one finishes
    assert study.run(par, progress=False, jobs=2, time_budget=0) == {"trained": 2, "stopped": True, "remaining": 2}
    assert len(stamps(par)) == 2
    assert study.run(par, progress=False, jobs=2) == {"trained": 2, "stopped": False, "remaining": 0}
    assert study.run(par, progress=False, jobs=2)["trained"] == 0            # nothing left: no pool
    assert os.environ.get("OMP_WAIT_POLICY") == omp                          # the parent's env is restored
    bits = member_bits(par)
    assert bits == member_bits(seq)
    assert all(len(b["weights"]) == TINY["epochs"] for b in bits.values())
    computed = {k: (b["weights"], b["logits"]) for k, b in bits.items()}
    assert computed[("fixed", 0)] == computed[("fixed", 1)] and computed[("seeds", 0)] != computed[("seeds", 1)]


def flaky_trainer(cfg: dict) -> dict:
    """A worker-side stand-in for train.main (module level: pickled by reference into spawned workers).
    Records what the worker saw; member 0 of 'seeds' fails at once, every other member ends once the parent
    has taken that failure in (the marker the test's ``member_error`` writes), so no worker is free before."""
    import time

    name, member = cfg["name"], cfg["first_member"]
    seen = {"gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "omp": os.environ.get("OMP_WAIT_POLICY"),
            "threads": torch.get_num_threads(), "progress": cfg["progress"]}
    (Path(cfg["out"]) / f"{name}-{member}.json").write_text(json.dumps(seen))
    if (name, member) == ("seeds", 0):
        raise ValueError("no luck")
    deadline = time.monotonic() + 60
    while not (Path(cfg["out"]) / PARENT_SAW_FAILURE).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {}


PARENT_SAW_FAILURE = "parent-saw-failure"


def test_jobs_failing_member_is_named_and_stops_submission(tmp_path, monkeypatch):
    s = make(tmp_path)
    s.runs_dir.mkdir(parents=True)
    monkeypatch.setattr(study, "worker_gpus", lambda _: ["5", "7"])       # as if two GPUs were visible
    real_member_error = study.member_error

    def member_error(name, member, exc):   # the parent's side: the failure is taken in, submission stops
        (s.runs_dir / PARENT_SAW_FAILURE).touch()
        return real_member_error(name, member, exc)
    monkeypatch.setattr(study, "member_error", member_error)
    with pytest.raises(study.MemberError, match=r"configuration 'seeds' member 0: ValueError: no luck") as err:
        study.run(s, progress=False, jobs=2, trainer=flaky_trainer)
    assert isinstance(err.value.__cause__, ValueError)
    seen = {p.stem: json.loads(p.read_text()) for p in s.runs_dir.glob("*.json")}
    assert sorted(seen) == ["seeds-0", "seeds-1"]          # the running member finished; nothing new started
    assert {v["gpu"] for v in seen.values()} <= {"5", "7"}
    expected_omp = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert all(v["omp"] == expected_omp and v["threads"] == torch.get_num_threads() and v["progress"] is False
               for v in seen.values())


def test_member_error_names_config_and_member():
    cause = RuntimeError("disk on fire")
    e = study.member_error("atomic-conv_wgrad", 2, cause)
    assert str(e) == "configuration 'atomic-conv_wgrad' member 2: RuntimeError: disk on fire"
    assert e.__cause__ is cause


def test_jobs_validation(tmp_path, capsys):
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SystemExit) as e:
            study.cli(["--jobs", bad, "--device", "cpu", "status"])
        assert e.value.code == 2
        assert "argument --jobs: expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs must be an integer >= 1"):
        study.run(make(tmp_path), jobs=0)
    assert study.parser().parse_args(["--jobs", "3"]).jobs == 3 and study.parser().parse_args([]).jobs is None
    assert study.default_jobs(make(tmp_path)) == 1   # CPU: one member after another unless --jobs says more


def test_cli_passes_jobs_and_records_them(tmp_path, monkeypatch, capsys):
    argv = ["--device", "cpu", "--grid", str(tiny_grid(tmp_path)), "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "rep" / "div.md"), "--no-timing", "--no-progress", "--jobs", "2"]
    calls = []

    def fake_run(s, **kw):
        calls.append(kw)
        return {"trained": 0, "stopped": True, "remaining": 4}

    monkeypatch.setattr(study, "run", fake_run)
    assert study.cli(argv) == 0
    assert calls == [{"time_budget": None, "progress": False, "jobs": 2}]
    res = json.loads((tmp_path / "rep" / "results" / "div.json").read_text())
    assert res["command"].endswith("--no-timing --no-progress --jobs 2")

    def failing_run(s, **kw):     # a usage error from a worker exits like one from this process
        raise study.member_error("seeds", 1, train.ConfigError("--batch-size 99 exceeds the 64 training images"))

    monkeypatch.setattr(study, "run", failing_run)
    with pytest.raises(SystemExit) as e:
        study.cli(argv)
    assert e.value.code == 2
    assert "error: configuration 'seeds' member 1: ConfigError: --batch-size 99" in capsys.readouterr().err


def test_wall_ledger_sums_the_runs_of_a_study(tmp_path, monkeypatch, capsys):
    """Every `run` call that has members to train appends one ledger entry however it ends (time budget,
    Ctrl-C, an error, done), counting the members it finished; a call with nothing to train adds none.
    collect sums the entries; status and the report say the total. A damaged ledger (unreadable, or
    entries without their numbers) stops the run before anything trains, with one line naming it."""
    argv = ["--device", "cpu", "--grid", str(tiny_grid(tmp_path)), "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "rep" / "div.md"), "--no-timing", "--no-progress"]
    s = make(tmp_path)
    members = [(p.name, m) for p in s.plan for m in range(s.members)]      # 4 members

    def finish(k):
        for name, m in members[:k]:
            d = runio.member_dir(s.runs_dir, name, m)
            d.mkdir(parents=True, exist_ok=True)
            (d / "result.json").write_text("{}")

    def ends(k, then=None):
        def fake_run(st, **kw):
            finish(k)
            if then is not None:
                raise then
            return {"trained": 0, "stopped": k < 4, "remaining": 4 - k}
        return fake_run

    collected = []
    monkeypatch.setattr(study, "collect", lambda st, timing=None: collected.append(study._wall_or_none(st)) or {})
    from nnrand import divergence_report
    monkeypatch.setattr(divergence_report, "render", lambda res, md, ex: md)
    failing = study.member_error("seeds", 1, train.ConfigError("--batch-size 99 exceeds the 64 training images"))
    for fake, code in ((ends(1), 0), (ends(2, KeyboardInterrupt("stopped at step 3")), 130),
                       (ends(3, failing), 2), (ends(4), 0), (ends(4), 0)):
        monkeypatch.setattr(study, "run", fake)
        try:
            assert study.cli(argv) == code
        except SystemExit as e:
            assert e.code == code == 2
    entries = study.read_ledger(s)
    assert [(e["trained"], e["end"]) for e in entries] == [(1, "stopped"), (1, "interrupted"), (1, "failed"),
                                                           (1, "finished")]   # the fifth call trained nothing
    assert all(e["backend"] == "cpu" and e["gpus"] == 0 and e["jobs"] == 1 and not e["mps"] for e in entries)
    w = study.wall_summary(entries)
    assert (w["parts"], w["trained"], w["gpus"], w["interrupted"], w["failed"]) == (4, 4, [0], 1, 1)
    assert w["total_s"] == round(sum(e["wall_s"] for e in entries), 3)   # the same sum, in the same order
    assert collected[-1] == w
    out = capsys.readouterr().out
    assert out.count("trained 1 member(s) in") == 2                     # the stopped and the finished call

    assert study.cli([*argv, "status"]) == 0
    assert "4 members trained in" in capsys.readouterr().out

    for bad in ("{not json", '{"runs": 5}', '{"runs": [{}]}', '{"runs": [{"wall_s": "3", "trained": 1, "jobs": 1, '
                '"gpus": 0}]}'):
        study.ledger_path(s).write_text(bad)
        for name, m in members:                                          # members to train again
            (runio.member_dir(s.runs_dir, name, m) / "result.json").unlink(missing_ok=True)
        calls = []
        monkeypatch.setattr(study, "run", lambda st, **kw: calls.append(kw))
        with pytest.raises(SystemExit) as e:
            study.cli(argv)
        assert e.value.code == 2 and calls == []                         # nothing trained
        err = capsys.readouterr().err.strip()
        assert err.startswith("python -m nnrand.study: error:") and str(study.ledger_path(s)) in err
        assert "unreadable study ledger" in err and len(err.splitlines()) == 1


def test_the_report_states_the_ledger(tmp_path, monkeypatch):
    s = make(tmp_path)
    study.record_run(s, started="t", wall_s=12.5, jobs=1, trained=2, end="stopped")
    study.record_run(s, started="t", wall_s=3.0, jobs=1, trained=2, end="finished")
    with pytest.raises(ValueError, match="end must be one of"):
        study.record_run(s, started="t", wall_s=1.0, jobs=1, trained=0, end="done")
    assert study.cli(["--device", "cpu", "--grid", str(tiny_grid(tmp_path)), "--runs-dir", str(tmp_path / "runs"),
                      "--out", str(tmp_path / "reports" / "div.md"), "report"]) == 0
    res = json.loads((tmp_path / "reports" / "results" / "div.json").read_text())
    assert res["train_wall"]["total_s"] == 15.5 and res["train_wall"]["part_s"] == [12.5, 3.0]
    assert ("Study wall time (`study_runs.json` beside the run directories; worker start-up and training, not the "
            "collection or the timing pass): 4 members trained in 16 s of wall time over 2 runs (12, 3 s), on the "
            "CPU, 1 at a time.") in (tmp_path / "reports" / "div.md").read_text()


def test_gpus_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = study.make_study(configs=["control"])
    assert [study.gpus_used(s, j) for j in (1, 2, 4, 32)] == [1, 2, 4, 4]   # in this process: one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert study.gpus_used(s, 8) == 1
    assert study.gpus_used(study.make_study(device="cpu", configs=["control"]), 2) == 0


def test_wall_line():
    """The sentence status and the report print, on hand-made ledgers."""
    from nnrand.divergence_report import wall_line

    gpu = {"started": "t", "trained": 80, "stopped": True, "interrupted": False, "jobs": 16, "backend": "cuda",
           "gpus": 2, "gpu_ids": ["0", "1"], "mps": True, "host": "a"}
    w = study.wall_summary([dict(gpu, wall_s=300.4), dict(gpu, wall_s=200.2, trained=90, stopped=False)])
    assert w["total_s"] == round(300.4 + 200.2, 3) and w["part_s"] == [300.4, 200.2]   # the code's sum, rounded
    assert wall_line(w) == ("170 members trained in 501 s of wall time over 2 runs (300, 200 s), on 2 GPUs, "
                            "16 at a time, under MPS")
    one = study.wall_summary([dict(gpu, wall_s=1011.0, gpus=1, jobs=8, host="b"), dict(gpu, wall_s=10.0)])
    assert wall_line(one) == ("160 members trained in 1021 s of wall time over 2 runs (1011, 10 s), on 1/2 GPUs "
                              "on 2 hosts (by host name), 8/16 at a time, under MPS")
    cpu = study.wall_summary([dict(gpu, wall_s=30.0, gpus=0, jobs=1, mps=False, backend="cpu", end="interrupted"),
                              dict(gpu, wall_s=1.0, gpus=0, jobs=1, mps=False, backend="cpu", end="failed", trained=0)])
    assert wall_line(cpu) == ("80 members trained in 31 s of wall time over 2 runs (30, 1 s), on the CPU, 1 at a "
                              "time; 1 run(s) interrupted; 1 run(s) ended by an error")
    old = study.wall_summary([dict(gpu, wall_s=5.0, interrupted=True)])   # entries written before "end" existed
    assert old["interrupted"] == 1 and old["failed"] == 0
    assert study.wall_summary([]) is None


def test_worker_gpus(monkeypatch):
    """Planning only: which GPU each worker pins itself to (nothing runs on a device)."""
    import multiprocessing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = study.make_study(configs=["control"])
    assert study.worker_gpus(s) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7,9")      # an inherited list: the visible ones, in order
    assert study.worker_gpus(s) == ["4", "6", "7"]
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    assert [study.pin_gpu(counter, ["4", "6", "7"]) for _ in range(4)] == ["4", "6", "7", "4"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4"
    assert study.pin_gpu(counter, []) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "4"
    assert study.worker_gpus(study.make_study(device="cuda:1", configs=["control"])) == []  # an explicit GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert study.worker_gpus(s) == []                          # one GPU: the workers share it
    assert study.worker_gpus(study.make_study(device="cpu", configs=["control"])) == []


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


def test_finished_configurations_collect_without_their_weight_files(tmp_path):
    """Collecting writes each configuration's pairwise L2 matrices beside its members; with that file the
    per-epoch weights (and checkpoints) can be dropped, as when a study's finished configurations move to
    another machine, and the results stay the same. The file holds for the members' final checksums
    only: a member trained again is not covered by it."""
    s = make(tmp_path)
    study.run(s, progress=False)
    before = study.collect(s)
    weights = before["configs"]["seeds"]["weights"]
    assert weights and weights[0]["l2"] > 0                       # per-member seeds: the members differ
    cache = s.runs_dir / "seeds" / study.L2_CACHE
    assert cache.exists()
    for f in [*s.runs_dir.glob("*/member_*/weights_epoch_*.pt"), *s.runs_dir.glob("*/member_*/checkpoint.pt")]:
        f.unlink()
    after = study.collect(s)
    assert after["configs"]["seeds"]["weights"] == weights
    assert after["configs"]["fixed"]["weights"] == before["configs"]["fixed"]["weights"]

    held = json.loads(cache.read_text())
    held["members"][0][1] += 1                                     # as if member 0 had been trained again
    cache.write_text(json.dumps(held))
    assert study.collect(s)["configs"]["seeds"]["weights"] == []   # no weight files, no valid matrices


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_damaged_checkpoint_is_a_one_line_error_naming_it(tmp_path, capsys, jobs):
    """A member's checkpoint that does not load stops the study with exit 2 and one line naming the file
    (in this process or from a worker), not a traceback and not a silent fresh start."""
    bad = tmp_path / "runs" / "seeds" / "member_000" / "checkpoint.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    argv = ["--device", "cpu", "--grid", str(tiny_grid(tmp_path, ("seeds",))), "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "rep" / "div.md"), "--no-progress", "--no-timing", "--jobs", jobs]
    with pytest.raises(SystemExit) as e:
        study.cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]   # with workers, a line before it says the others are awaited
    assert "Traceback" not in err and last.startswith("python -m nnrand.study: error:")
    assert str(bad) in last and "cannot be loaded" in last and "--no-resume" in last
    assert bad.read_bytes() == b"not a checkpoint"


def test_help_has_examples():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "nnrand.study", "--help"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0 and "examples:" in r.stdout and "--time-budget" in r.stdout and "--jobs" in r.stdout


def test_default_cuda_study_plan(monkeypatch):
    """The H200 grid as planned on a CUDA machine (planning only; nothing runs on a device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    s = study.make_study()
    assert s.backend == "cuda" and not s.quick and s.stem == "divergence"
    assert s.report_path == study.REPO / "reports" / "divergence.md"
    assert s.members == 10 and len(s.plan) == len(study.CONFIGURATIONS) + len(study.BASELINES)
    cfg = {p.name: p.config for p in s.plan}
    assert all(c["device"] == "cuda" and c["epochs"] == 20 and c["batch_size"] == 128 and c["n_train"] == 10_000
               and c["n_test"] == 10_000 and c["cuda_graph"] and c["eval_every"] == 5 for c in cfg.values())
    assert cfg["control"]["model"] == "resnet20" and cfg["atomic-maxpool_bwd"]["model"] == "resnet20_maxpool"
    assert cfg["control@resnet20_maxpool"]["model"] == "resnet20_maxpool"
    assert study.default_jobs(s) == study.JOBS_PER_GPU
    m = study.member_config(s.plan[1], 2, runs_dir=Path("runs/x"), progress=False)
    assert (m["first_member"], m["members"], m["save_epoch_weights"], m["report"]) == (2, 1, True, False)


def test_cuda_study_reads_its_files_on_a_machine_without_cuda(tmp_path, monkeypatch, capsys):
    """status and report read run files only: members trained on GPU machines are collected anywhere;
    training or timing a CUDA study still needs the device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(study.StudyError, match="no CUDA device"):
        study.make_study(device="cuda")
    s = study.make_study(device="cuda", trains=False)
    assert s.backend == "cuda" and s.stem == "divergence" and s.members == 10
    assert study.cli(["status", "--device", "cuda", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert "control                  0/10 members done" in capsys.readouterr().out
    for command in ("run", "timing"):
        with pytest.raises(SystemExit) as e:
            study.cli([command, "--device", "cuda", "--runs-dir", str(tmp_path / "runs")])
        assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_smoke_study_trains_collects_compares_and_renders(tmp_path, capsys):
    """--smoke on a subset of the configurations (the whole set is what `python -m nnrand.study --smoke`
    runs; 26 members take ~1.5 min of CPU time): every step from training to the paired tests."""
    argv = ["--smoke", "--configs", "control,algo,impl,ulp", "--runs-dir", str(tmp_path / "runs"),
            "--out", str(tmp_path / "rep" / "div_cpu.md"), "--no-progress"]
    assert study.cli(argv) == 0
    res = json.loads((tmp_path / "rep" / "results" / "div_cpu.json").read_text())
    assert res["smoke"] and res["missing"] == [] and not (tmp_path / "rep" / "results" / "div_cpu_timing.json").exists()
    c = res["configs"]
    assert c["control"]["metrics"]["ci"]["disagreement"]["value"] == 0.0       # fixed seeds, tree: identical
    assert c["algo"]["metrics"]["disagreement"] > 0                             # different inits after 2 steps
    assert c["ulp"]["first_divergence"]["per_pair"] == [0]                      # the ULPs differ at step 0
    pairs = {(x["a"], x["b"]) for x in res["comparisons"]}
    assert pairs == {("impl", "algo"), ("impl", "ulp"), ("impl", "control"), ("ulp", "algo")}
    comp = next(x for x in res["comparisons"] if (x["a"], x["b"]) == ("impl", "algo"))
    assert comp["disagreement"]["exact"] and comp["disagreement"]["splits"] == 6 and comp["members"] == [2, 2]
    text = (tmp_path / "rep" / "div_cpu.md").read_text()
    assert "smoke sizes" in text and "## Paired tests between configurations" in text
    assert "## Intervals per configuration" in text and "| `impl` | `algo` |" in text
