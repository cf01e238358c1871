"""bench.multigpu's report from a results dict (no GPU): the DDP table, the eager/graph agreement line and
the cost ratios against the fastest native mode."""
from __future__ import annotations

from pathlib import Path

from bench import multigpu

SAME = "DDP native with the same flags (no cudnn.benchmark), "   # the same-flags cost row's label


def _run(checksum: int, ms: float, logits: str = "aa") -> dict:
    return {"final_checksum": checksum, "logits_hash": logits, "step_time_ms": ms, "test_top1": 0.5,
            "world_size": 2, "world_invariant": False, "train_loss": 1.0}


def _ddp(graph: bool) -> dict:
    ddp = {"native": [_run(1, 10.0), _run(2, 12.0), _run(3, 11.0)],
           "tree": [_run(7, 14.0), _run(7, 15.0), _run(7, 13.0)]}
    if graph:
        ddp["native_graph"] = [_run(4, 8.0), _run(5, 9.0), _run(6, 7.0)]
        ddp["tree_graph"] = [_run(7, 8.8), _run(7, 8.6), _run(7, 9.0)]
    return ddp


def test_ddp_rows_and_the_ratio_to_the_fastest_native_mode():
    text = multigpu.render({"gpus": 2, "ddp": _ddp(graph=True)})
    assert "| native | 3 | 3 | 11.00 |" in text
    assert "| tree | 3 | 1 | 14.00 |" in text
    assert "| native, CUDA graph | 3 | 3 | 8.00 |" in text
    assert "| tree, CUDA graph | 3 | 1 | 8.80 |" in text
    assert "together: 1 distinct final weights and 1 distinct logits hashes in 6 runs" in text
    assert "| DDP `tree` / " + SAME + "eager (2 GPUs) | 1.273 | - |" in text          # 14 / 11
    assert "| DDP `tree` / " + SAME + "both CUDA graph | 1.100 | - |" in text         # 8.8 / 8
    assert ("| fastest DDP `tree` (tree, CUDA graph) / fastest DDP native (native, CUDA graph) | 1.100 | "
            "<= 1.10 |") in text


def test_graph_bits_that_differ_from_eager_are_counted():
    ddp = _ddp(graph=True)
    ddp["tree_graph"][1] = _run(8, 8.6, logits="bb")
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "together: 2 distinct final weights and 2 distinct logits hashes in 6 runs" in text


def test_results_without_graph_modes_keep_the_eager_target():
    text = multigpu.render({"gpus": 2, "ddp": _ddp(graph=False)})
    assert "| native, CUDA graph |" not in text and "| tree, CUDA graph |" not in text
    assert "| DDP `tree` / " + SAME + "eager (2 GPUs) | 1.273 | - |" in text
    assert "| fastest DDP `tree` (tree) / fastest DDP native (native) | 1.273 | <= 1.10 |" in text
    assert "both CUDA graph" not in text and "together" not in text


def test_a_failed_mode_is_named_and_left_out_of_the_ratios():
    ddp = _ddp(graph=True)
    ddp["tree_graph"] = {"error": "capture failed"}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| tree, CUDA graph | failed: `capture failed` | - | - |" in text
    assert "| DDP `tree` / " + SAME + "eager (2 GPUs) | 1.273 | - |" in text
    assert "| fastest DDP `tree` (tree) / fastest DDP native (native, CUDA graph) | 1.750 | <= 1.10 |" in text  # 14 / 8
    assert "both CUDA graph" not in text and "together" not in text


def test_run_ddp_records_a_failing_mode_and_runs_the_others(monkeypatch, tmp_path):
    calls = []

    def fake_train(n, out, name, extra):
        calls.append(name)
        flags[name] = extra
        if "--cuda-graph" in extra and "tree" in extra:
            raise RuntimeError("torchrun ... failed (1): RuntimeError: capture failed")
        return _run(len(calls), 10.0)

    flags = {}

    monkeypatch.setattr(multigpu, "_train", fake_train)
    monkeypatch.setattr(multigpu, "_plan", lambda n, scratch: {"path": "plan.json", "batch": 64, "choices": {}})
    out = multigpu.run_ddp(2, tmp_path, type("A", (), {"runs": 2})())
    assert out["tree_graph"] == {"error": "RuntimeError: capture failed"}
    assert [len(out[m]) for m in ("native", "tree", "native_graph")] == [2, 2, 2]
    assert calls.count("ddp_tree_graph_0") == 1 and "ddp_tree_graph_1" not in calls
    # the native configurations a user chasing speed runs: cuDNN's timed choice, in either layout
    assert flags["ddp_native_bench_0"] == ["--kernel", "native", "--cudnn-benchmark"]
    assert flags["ddp_native_bench_cl_graph_1"] == ["--kernel", "native", "--cudnn-benchmark", "--channels-last",
                                                     "--cuda-graph"]


def test_invariant_layouts_cover_every_power_of_two_world_the_batch_allows():
    # batch 128: micro-batches of B/n and B/4; a world must be a power of two dividing the micro-batch count
    assert multigpu.invariant_layouts(128, 1) == [(128, 1), (32, 1)]
    assert multigpu.invariant_layouts(128, 2) == [(64, 1), (64, 2), (32, 1), (32, 2)]
    assert multigpu.invariant_layouts(128, 4) == [(64, 1), (64, 2), (32, 1), (32, 2), (32, 4)]
    assert multigpu.invariant_layouts(128, 8) == [(64, 1), (64, 2), (32, 1), (32, 2), (32, 4), (16, 1), (16, 2),
                                                  (16, 4), (16, 8)]


def _inv(micro: int, world: int, ms: float, checksum: int = 5) -> dict:
    return dict(_run(checksum, ms), world_size=world, world_invariant=True, micro_batch=micro)


def test_sections_on_different_gpu_counts_say_so_and_the_cost_uses_the_ddp_count():
    """DDP measured on 2 GPUs of a 4-GPU host and the invariant section on all 4: each section names its
    count, and the invariant rows are compared with DDP at 2 GPUs (14 ms eager tree) only."""
    inv = {"single_tree": dict(_run(9, 10.0), world_size=1), "m64_w1": _inv(64, 1, 20.0), "m64_w2": _inv(64, 2, 14.7),
           "m32_w1": _inv(32, 1, 30.0), "m32_w2": _inv(32, 2, 16.1), "m32_w4": _inv(32, 4, 9.0)}
    sha = {"git_sha": "abc1234", "date": "d", "host": "h"}
    data = {"visible": 4, "ddp": _ddp(graph=False), "invariant": inv,
            "measured": {"ddp": dict(sha, gpus=2), "invariant": dict(sha, gpus=4)}}
    text = multigpu.render(data)
    assert "on 4 x ? of one host" in text and "GPUs per section: ddp on 2; invariant on 4." in text
    assert "`torchrun --nproc_per_node 2 -m nnrand.train" in text
    assert "## `--world-invariant`: the same bits on 1 to 4 GPUs" in text
    assert "- micro-batch 32, `tree`: identical bits on 1, 2, 4 GPUs." in text
    assert "| `--world-invariant` micro-batch 64, `tree`, eager / DDP `tree`, eager (2 GPUs) | 1.050 | - |" in text  # 14.7/14
    assert "| `--world-invariant` micro-batch 32, `tree`, eager / DDP `tree`, eager (2 GPUs) | 1.150 | - |" in text  # 16.1/14
    # the target row: the fastest invariant mode against the fastest DDP tree mode (eager only here: 14 ms)
    assert ("| fastest `--world-invariant` micro-batch 32, `tree` (eager) / fastest DDP `tree` (tree), 2 GPUs | 1.150 | "
            "<= 1.15 |") in text
    assert "(4 GPUs)" not in text and "4 GPUs |" not in text                                # no DDP run on 4
    assert "Sections measured separately" not in text                                        # one commit, one host
    inv["m32_w4"] = _inv(32, 4, 9.0, checksum=6)
    assert "- micro-batch 32, `tree`: DIFFERENT bits on 1, 2, 4 GPUs." in multigpu.render(data)
    data["measured"]["invariant"]["host"] = "other"
    text = multigpu.render(data)
    assert ("Sections measured separately: ddp at git abc1234 on host h (d); invariant at git abc1234 on host other "
            "(d).") in text
    assert "compare machines as well as modes" in text and "on ? GPUs of 2 machines" in text
    # the GPUs' UUIDs tell machines apart where host names do not (every device machine is "vm")
    data["measured"]["ddp"].update(host="vm", machine="aaaa", visible=2)
    data["measured"]["invariant"].update(host="vm", machine="bbbb", visible=4)
    text = multigpu.render(data)
    assert "ddp at git abc1234 on GPUs aaaa (d); invariant at git abc1234 on GPUs bbbb (d)" in text
    data["measured"]["ddp"]["machine"] = "bbbb"
    text = multigpu.render(data)
    assert "on 4 x ? of one host" in text and "Sections measured separately" not in text


def test_results_written_before_per_section_counts_render_with_the_file_count():
    data = {"gpus": 2, "ddp": _ddp(graph=False), "measured": {"ddp": {"git_sha": "abc1234", "date": "d"}}}
    text = multigpu.render(data)
    assert "on 2 x ? of one host" in text and "GPUs per section" not in text
    assert "`torchrun --nproc_per_node 2 -m nnrand.train" in text
    assert multigpu.section_gpus(data, "ddp") == 2


def test_a_new_measurement_keeps_the_sections_of_the_same_gpu_model_only():
    old = {"gpus": 2, "fingerprint": {"gpu": "NVIDIA H200"}, "ddp": _ddp(graph=False),
           "measured": {"ddp": {"git_sha": "abc1234", "date": "d"}}}
    kept = multigpu.carry_over(old, "NVIDIA H200")
    assert "gpus" not in kept and kept["measured"]["ddp"]["gpus"] == 2 and kept["ddp"] == old["ddp"]
    assert old["gpus"] == 2 and "gpus" not in old["measured"]["ddp"]            # the loaded file is not changed
    assert multigpu.carry_over(old, "NVIDIA H100 80GB HBM3") == {}
    assert multigpu.carry_over({}, "NVIDIA H200") == {}


def test_a_failed_child_is_named_by_its_own_exception_not_the_launchers():
    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: FileNotFoundError: [Errno 2] No such file or directory: 'runs/multigpu/allreduce_default.json'",
        "E1126 05:08:20 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "bench.multigpu FAILED"])
    assert multigpu.child_error(stderr) == ("[rank0]: FileNotFoundError: [Errno 2] No such file or directory: "
                                            "'runs/multigpu/allreduce_default.json'")
    assert multigpu.child_error("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:") == \
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    assert multigpu.child_error("killed") == "killed"
    two_ranks = "\n".join([
        "[rank1]: nnrand.distributed.RankFailure: rank 1: out of memory at step 3",
        "[rank0]: torch.distributed.DistBackendError: Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"])
    assert multigpu.child_error(two_ranks) == "[rank1]: nnrand.distributed.RankFailure: rank 1: out of memory at step 3"
    assert multigpu.child_error("python -m nnrand.train: error: --batch-size 63 is not divisible") == \
        "python -m nnrand.train: error: --batch-size 63 is not divisible"


def test_the_allreduce_section_makes_its_scratch_directory(monkeypatch, tmp_path):
    seen = []

    def fake_torchrun(nproc, module_args, env=None, timeout=900):
        path = Path(module_args[module_args.index("--result") + 1])
        seen.append(path.parent.is_dir())
        path.write_text("[]")
        return 0.0

    monkeypatch.setattr(multigpu, "_torchrun", fake_torchrun)
    out = multigpu.run_allreduce(2, tmp_path / "fresh" / "scratch", type("A", (), {"repeats": 3})())
    assert seen == [True, True, True] and out == {a: [] for a in multigpu.ALGOS}


def test_invariant_graph_rows_join_the_bit_check_and_the_cost(monkeypatch, tmp_path):
    """run_invariant runs every layout eager and captured with tree, then per micro-batch size one planning
    run and every layout captured with its plan; the report puts each kernel family's rows in one bit check,
    compares them with DDP of the same family like for like, and names a failed run or plan."""
    calls = []

    def fake_train(n, out, name, extra):
        calls.append((name, n, "--cuda-graph" in extra, extra))
        if name == "inv_m32_w4_graph":
            raise RuntimeError("torchrun ... failed (1): RuntimeError: capture failed")
        fast = "fastest-deterministic" in extra
        return dict(_run(6 if fast else 5, (7.0 if fast else 8.0) if "--cuda-graph" in extra else 16.0),
                    world_size=n, world_invariant=True)

    def fake_plan(scratch, name, extra):
        if name == "inv_plan_m64":
            raise RuntimeError("torchrun ... failed (1): AutotuneError: no deterministic candidate")
        return {"path": f"{name}.json", "choices": {"a": "winograd", "b": "winograd", "c": "tree"},
                "final_checksum": 6, "logits_hash": "aa"}

    monkeypatch.setattr(multigpu, "_train", fake_train)
    monkeypatch.setattr(multigpu, "plan_run", fake_plan)
    inv = multigpu.run_invariant(4, tmp_path, None)
    assert [(name, n) for name, n, g, _ in calls if g] == [
        ("single_tree_graph", 1), ("inv_m64_w1_graph", 1), ("inv_m64_w2_graph", 2), ("inv_m32_w1_graph", 1),
        ("inv_m32_w2_graph", 2),
        ("inv_m32_w4_graph", 4), ("inv_m32_w1_fastdet_graph", 1), ("inv_m32_w2_fastdet_graph", 2),
        ("inv_m32_w4_fastdet_graph", 4)]
    planned = [extra for name, _, _, extra in calls if "fastdet" in name]
    assert all(e[e.index("--autotune-plan") + 1] == "inv_plan_m32.json" and e[e.index("--micro-batch") + 1] == "32"
               for e in planned)
    assert inv["m32_w4_graph"]["error"] == "RuntimeError: capture failed" and inv["m32_w2_graph"]["graph"] is True
    assert inv["plan_m64"] == {"error": "planning run: AutotuneError: no deterministic candidate"}
    sha = {"git_sha": "abc1234", "date": "d", "host": "h"}
    ddp = _ddp(graph=True)
    ddp["fastdet"] = [_run(8, 12.0)]
    ddp["fastdet_graph"] = [_run(8, 8.4)]
    text = multigpu.render({"visible": 4, "ddp": ddp, "invariant": inv,
                            "measured": {"ddp": dict(sha, gpus=2), "invariant": dict(sha, gpus=4)}})
    assert "| 32 | tree | 2 | CUDA graph | 5 | aa | 0.5000 | 8.00 |" in text
    assert "| 32 | fastest-deterministic | 4 | CUDA graph | 6 | aa | 0.5000 | 7.00 |" in text
    assert "| 32 | tree | 4 | CUDA graph | failed: `RuntimeError: capture failed` | - | - | - |" in text
    assert "- micro-batch 32, `tree`: identical bits on 1, 2, 4, 1 (graph), 2 (graph) GPUs." in text
    assert ("- micro-batch 32, `fastest-deterministic`: identical bits on 1 (graph), 2 (graph), 4 (graph) GPUs; the "
            "planning run (one GPU, eager, timing each candidate) gave the same bits; its choices: `tree` x1, "
            "`winograd` x2.") in text
    assert ("- micro-batch 64, `fastest-deterministic`: failed: `planning run: AutotuneError: no deterministic "
            "candidate`.") in text
    # DDP tree: 14 ms eager, 8.8 ms captured; fastest-deterministic 8.4 captured: like for like, and fastest
    # against fastest
    assert "| `--world-invariant` micro-batch 32, `tree`, CUDA graph / DDP `tree`, CUDA graph (2 GPUs) | 0.909 | - |" in text
    assert "| `--world-invariant` micro-batch 32, `tree`, eager / DDP `tree`, eager (2 GPUs) | 1.143 | - |" in text
    assert ("| `--world-invariant` micro-batch 32, `fastest-deterministic`, CUDA graph / DDP `fastest-deterministic`, "
            "CUDA graph (2 GPUs) | 0.833 | - |") in text                                      # 7 / 8.4
    assert "CUDA graph / DDP `tree`, eager" not in text and "eager / DDP `tree`, CUDA graph" not in text
    assert ("| fastest `--world-invariant` micro-batch 32, `tree` (CUDA graph) / fastest DDP `tree` (tree, CUDA graph), "
            "2 GPUs | 0.909 | <= 1.15 |") in text
    # the fastest invariant step against the fastest deterministic DDP step: here the like-for-like pair above
    assert "any nnrand routing (`fastest-deterministic`" not in text
    # one GPU: eager against the eager one-process step (16 / 16), captured against the captured one (8 / 8)
    assert "| `--world-invariant` micro-batch 32, `tree`, eager / plain `tree`, eager, one GPU | 1.000 | - |" in text
    assert ("| `--world-invariant` micro-batch 32, `tree`, CUDA graph / plain `tree`, CUDA graph, one GPU | 1.000 "
            "| - |") in text
    # a planning run whose bits the planned runs do not reproduce is called out
    inv["plan_m32"]["logits_hash"] = "bb"
    text = multigpu.render({"visible": 4, "ddp": ddp, "invariant": inv,
                            "measured": {"ddp": dict(sha, gpus=2), "invariant": dict(sha, gpus=4)}})
    assert "(graph) GPUs; the planning run (one GPU, eager, timing each candidate) gave OTHER bits" in text
    # a fastest-deterministic invariant step that is faster than every DDP step of its own kind gets the row
    # against the fastest deterministic DDP mode (tree, captured: 8.8 ms)
    ddp["fastdet_graph"] = [_run(8, 9.5)]
    text = multigpu.render({"visible": 4, "ddp": ddp, "invariant": inv,
                            "measured": {"ddp": dict(sha, gpus=2), "invariant": dict(sha, gpus=4)}})
    assert ("| fastest `--world-invariant` micro-batch 32, any nnrand routing (`fastest-deterministic`, CUDA graph) / "
            "fastest deterministic DDP (tree, CUDA graph), 2 GPUs | 0.795 | - |") in text          # 7 / 8.8


def test_a_mode_with_one_run_claims_no_repeatability():
    ddp = {m: runs[:1] for m, runs in _ddp(graph=True).items()}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| native | 1 | - (one run) | 10.00 |" in text and "| tree | 1 | - (one run) | 14.00 |" in text
    assert "together: 1 distinct final weights and 1 distinct logits hashes in 2 runs" in text


def test_planned_modes_use_one_plan_and_a_failed_plan_fails_them_only(monkeypatch, tmp_path):
    calls = []

    def fake_train(n, out, name, extra):
        calls.append((name, extra))
        return _run(1, 10.0)

    monkeypatch.setattr(multigpu, "_train", fake_train)
    monkeypatch.setattr(multigpu, "_plan", lambda n, scratch: {"path": str(scratch / "p.json"), "batch": 64,
                                                                 "choices": {"k": "winograd"}})
    out = multigpu.run_ddp(2, tmp_path, type("A", (), {"runs": 1})())
    planned = {name: extra for name, extra in calls if "fastest-deterministic" in extra}
    assert sorted(planned) == ["ddp_fastdet_0", "ddp_fastdet_graph_0"]
    assert all(extra[-2:] == ["--autotune-plan", str(tmp_path / "p.json")] for extra in planned.values())
    assert all("--autotune-plan" not in extra for name, extra in calls if name not in planned)
    assert out["plan"]["choices"] == {"k": "winograd"}

    def no_plan(n, scratch):
        raise RuntimeError("torchrun ... failed (1): AutotuneError: no deterministic candidate")

    calls.clear()
    monkeypatch.setattr(multigpu, "_plan", no_plan)
    out = multigpu.run_ddp(2, tmp_path, type("A", (), {"runs": 1})())
    assert out["fastdet"] == out["fastdet_graph"] == {"error": "planning run: AutotuneError: no deterministic candidate"}
    assert [name for name, _ in calls] == [f"ddp_{m}_0" for m in multigpu.DDP_MODES if m not in multigpu.PLANNED]
    text = multigpu.render({"gpus": 2, "ddp": out})
    assert "| fastest-deterministic | failed: `planning run: AutotuneError: no deterministic candidate` | - | - |" in text
    assert "any nnrand routing" not in text


def test_planned_modes_in_the_tables():
    ddp = _ddp(graph=True)
    ddp["fastdet"] = [_run(8, 12.0), _run(8, 11.0), _run(8, 12.5)]
    ddp["fastdet_graph"] = [_run(8, 8.4), _run(8, 8.2), _run(8, 8.3)]
    ddp["plan"] = {"path": "p", "batch": 64, "choices": {"a": "winograd", "b": "tree", "c": "torch_det"}}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| fastest-deterministic | 3 | 1 | 12.00 |" in text
    assert "| fastest-deterministic, CUDA graph | 3 | 1 | 8.30 |" in text
    assert "`fastest-deterministic` eager and with a CUDA graph together: 1 distinct final weights" in text
    assert "3 conv configurations, choices `torch_det` x1, `tree` x1, `winograd` x1." in text
    # the tuner's keys name their op: counted per op
    ddp["plan"]["choices"] = {"conv_fwd x=1": "tree", "conv_dgrad x=1": "tree", "conv_dgrad x=2": "torch_det",
                              "conv_wgrad x=1": "winograd"}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert ("4 conv configurations, choices conv_dgrad: `torch_det` x1, `tree` x1; conv_fwd: `tree` x1; "
            "conv_wgrad: `winograd` x1.") in text
    # the tree target row is unchanged; the planned mode has its own row (8.3 / 8.0)
    assert "| fastest DDP `tree` (tree, CUDA graph) / fastest DDP native (native, CUDA graph) | 1.100 | <= 1.10 |" in text
    assert ("| fastest deterministic DDP, any nnrand routing (fastest-deterministic, CUDA graph) / fastest DDP "
            "native (native, CUDA graph) | 1.038 | - |") in text


def test_the_fastest_native_mode_includes_cudnn_benchmark_in_either_layout():
    """The target ratio is taken against the fastest native configuration a user runs: a cudnn.benchmark
    channels_last captured step faster than the others becomes the denominator."""
    ddp = _ddp(graph=True)
    ddp["native_bench"] = [_run(9, 9.5)]
    ddp["native_bench_cl_graph"] = [_run(9, 7.5)]
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| native, cudnn.benchmark | 1 | - (one run) | 9.50 |" in text
    assert "| native, cudnn.benchmark, channels_last, CUDA graph | 1 | - (one run) | 7.50 |" in text
    assert ("| fastest DDP `tree` (tree, CUDA graph) / fastest DDP native (native, cudnn.benchmark, channels_last, "
            "CUDA graph) | 1.173 | <= 1.10 |") in text                                          # 8.8 / 7.5
    assert "| DDP `tree` / " + SAME + "both CUDA graph | 1.100 | - |" in text                     # same flags: 8.8 / 8


def _fake_machine(monkeypatch, gpu: str) -> None:
    """bench.multigpu's main on a CPU machine that calls itself a host of two ``gpu``s."""
    import torch

    import nnrand.fingerprint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(nnrand.fingerprint, "fingerprint", lambda device: {"gpu": gpu, "git_sha": "abc"})
    monkeypatch.setattr(multigpu, "machine_id", lambda: "m")


def test_a_measurement_on_another_gpu_model_never_drops_the_file_s_sections(monkeypatch, tmp_path, capsys):
    import json

    import pytest

    results, report = tmp_path / "r.json", tmp_path / "r.md"
    held = {"fingerprint": {"gpu": "GPU A"}, "ddp": _ddp(graph=True), "measured": {"ddp": {"gpus": 2}}}
    results.write_text(json.dumps(held))
    _fake_machine(monkeypatch, "GPU B")
    ran = []
    monkeypatch.setattr(multigpu, "run_ddp", lambda n, scratch, args: ran.append(n) or _ddp(graph=False))
    argv = ["--only", "ddp", "--results", str(results), "--report", str(report), "--scratch", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        multigpu.main(argv)
    assert e.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert "GPU A" in err and "GPU B" in err and "--results" in err
    assert json.loads(results.read_text()) == held and not report.exists()
    # --replace lets it start the file afresh, on the new model
    assert multigpu.main([*argv, "--replace"]) == 0
    data = json.loads(results.read_text())
    assert ran == [2] and data["fingerprint"]["gpu"] == "GPU B" and "native_graph" not in data["ddp"]
    assert report.read_text() == multigpu.render(data)


def test_render_reads_and_writes_the_files_it_is_given(tmp_path):
    import json

    results, report = tmp_path / "h100.json", tmp_path / "h100.md"
    data = {"fingerprint": {"gpu": "GPU B"}, "gpus": 2, "ddp": _ddp(graph=True)}
    results.write_text(json.dumps(data))
    assert multigpu.main(["--render", "--results", str(results), "--report", str(report)]) == 0
    assert report.read_text() == multigpu.render(data)


def test_ddp_modes_runs_a_subset_and_plans_only_for_planned_modes(monkeypatch, tmp_path):
    calls, planned = [], []
    monkeypatch.setattr(multigpu, "_train", lambda n, out, name, extra: calls.append((name, extra)) or _run(1, 9.0))
    monkeypatch.setattr(multigpu, "_plan", lambda n, scratch: planned.append(n) or {"path": "p.json", "batch": 64,
                                                                                   "choices": {}})
    args = type("A", (), {"runs": 2, "ddp_modes": ["native_bench_graph", "tree_hb_graph"]})()
    out = multigpu.run_ddp(2, tmp_path, args)
    assert set(out) == {"native_bench_graph", "tree_hb_graph"} and planned == []
    assert [name for name, _ in calls] == ["ddp_native_bench_graph_0", "ddp_tree_hb_graph_0",
                                           "ddp_native_bench_graph_1", "ddp_tree_hb_graph_1"]
    assert calls[1][1] == ["--kernel", "tree", "--cudnn-heuristic", "b", "--cuda-graph"]
    # the heuristic-b rows count as tree rows: the cost line takes the fastest of them
    ddp = {"native_bench_graph": [_run(1, 10.0), _run(2, 10.0)], "tree_graph": [_run(7, 13.0), _run(7, 13.0)],
           "tree_hb_graph": [_run(8, 10.5), _run(8, 10.5)]}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| tree, cuDNN heuristic b, CUDA graph | 2 | 1 | 10.50 |" in text
    assert ("| fastest DDP `tree` (tree, cuDNN heuristic b, CUDA graph) / fastest DDP native (native, cudnn.benchmark, "
            "CUDA graph) | 1.050 | <= 1.10 |") in text


def test_a_subset_of_ddp_modes_never_replaces_a_full_section(monkeypatch, tmp_path, capsys):
    import json

    import pytest

    results = tmp_path / "r.json"
    held = {"fingerprint": {"gpu": "GPU A"}, "ddp": _ddp(graph=True), "measured": {"ddp": {"gpus": 2}}}
    results.write_text(json.dumps(held))
    _fake_machine(monkeypatch, "GPU A")
    monkeypatch.setattr(multigpu, "run_ddp", lambda n, scratch, args: pytest.fail("measured despite the refusal"))
    with pytest.raises(SystemExit) as e:
        multigpu.main(["--only", "ddp", "--ddp-modes", "tree_hb_graph", "--results", str(results), "--report",
                       str(tmp_path / "r.md"), "--scratch", str(tmp_path)])
    assert e.value.code == 2 and "with a subset" in capsys.readouterr().err
    assert json.loads(results.read_text()) == held


def test_children_start_under_the_default_cudnn_heuristic(monkeypatch, tmp_path):
    """An inherited TORCH_CUDNN_USE_HEURISTIC_MODE_B would change the algorithms of rows whose labels do not
    say so: the children never see it; a mode that wants heuristic b passes --cudnn-heuristic."""
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw["env"])
        return type("R", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setenv("TORCH_CUDNN_USE_HEURISTIC_MODE_B", "1")
    monkeypatch.setattr(multigpu.subprocess, "run", fake_run)
    multigpu._torchrun(2, ["-m", "nnrand.train"], env={"EXTRA": "x"})
    assert "TORCH_CUDNN_USE_HEURISTIC_MODE_B" not in seen and seen["EXTRA"] == "x"
