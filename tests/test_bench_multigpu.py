"""bench.multigpu's report from a results dict (no GPU): the DDP table, the eager/graph agreement line and
the cost ratios against the fastest native mode."""
from __future__ import annotations

from bench import multigpu


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
    assert "| DDP `tree` / DDP native, eager (2 GPUs) | 1.273 | - |" in text          # 14 / 11
    assert "| DDP `tree` / DDP native, both CUDA graph | 1.100 | - |" in text         # 8.8 / 8
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
    assert "| DDP `tree` / DDP native, eager (2 GPUs) | 1.273 | - |" in text
    assert "| fastest DDP `tree` (tree) / fastest DDP native (native) | 1.273 | <= 1.10 |" in text
    assert "both CUDA graph" not in text and "together" not in text


def test_a_failed_mode_is_named_and_left_out_of_the_ratios():
    ddp = _ddp(graph=True)
    ddp["tree_graph"] = {"error": "capture failed"}
    text = multigpu.render({"gpus": 2, "ddp": ddp})
    assert "| tree, CUDA graph | failed: `capture failed` | - | - |" in text
    assert "| DDP `tree` / DDP native, eager (2 GPUs) | 1.273 | - |" in text
    assert "| fastest DDP `tree` (tree) / fastest DDP native (native, CUDA graph) | 1.750 | <= 1.10 |" in text  # 14 / 8
    assert "both CUDA graph" not in text and "together" not in text


def test_run_ddp_records_a_failing_mode_and_runs_the_others(monkeypatch, tmp_path):
    calls = []

    def fake_train(n, out, name, extra):
        calls.append(name)
        if "--cuda-graph" in extra and "tree" in extra:
            raise RuntimeError("torchrun ... failed (1): RuntimeError: capture failed")
        return _run(len(calls), 10.0)

    monkeypatch.setattr(multigpu, "_train", fake_train)
    out = multigpu.run_ddp(2, tmp_path, type("A", (), {"runs": 2})())
    assert out["tree_graph"] == {"error": "RuntimeError: capture failed"}
    assert [len(out[m]) for m in ("native", "tree", "native_graph")] == [2, 2, 2]
    assert calls.count("ddp_tree_graph_0") == 1 and "ddp_tree_graph_1" not in calls


def test_invariant_layouts_cover_every_power_of_two_world_the_batch_allows():
    # batch 128: micro-batches of B/n and B/4; a world must be a power of two dividing the micro-batch count
    assert multigpu.invariant_layouts(128, 2) == [(64, 1), (64, 2), (32, 1), (32, 2)]
    assert multigpu.invariant_layouts(128, 4) == [(32, 1), (32, 2), (32, 4)]
    assert multigpu.invariant_layouts(128, 8) == [(32, 1), (32, 2), (32, 4), (16, 1), (16, 2), (16, 4), (16, 8)]
    assert multigpu.invariant_layouts(128, 1) == [(128, 1), (32, 1)]
