"""bench.models' bookkeeping of its result file (measuring needs a GPU; which rows a run measures and what
it keeps does not)."""
from __future__ import annotations

import pytest

from bench import models as bm

KEYS = [c.key for c in bm.MODELS]


def keys(todo):
    return [k for _, k in todo]


def test_only_measures_the_named_cases_whether_or_not_the_file_has_them():
    rows = {KEYS[0]: {"modes": {}}, KEYS[1]: {"modes": {}}}
    todo = bm.to_measure(rows, bm.MODELS, only=[KEYS[1], KEYS[2]], fresh=False, amp=None)
    assert keys(todo) == [KEYS[1], KEYS[2]]
    assert [c.key for c, _ in todo] == [KEYS[1], KEYS[2]]


def test_default_fills_the_gaps_and_fresh_measures_everything():
    rows = {KEYS[0]: {"modes": {}}}
    assert keys(bm.to_measure(rows, bm.MODELS, only=None, fresh=False, amp=None)) == KEYS[1:]
    assert keys(bm.to_measure(rows, bm.MODELS, only=None, fresh=True, amp=None)) == KEYS


def test_amp_rows_have_their_own_keys():
    rows = {KEYS[0]: {"modes": {}}}   # the fp32 row does not stand in for the bf16 one
    todo = bm.to_measure(rows, bm.MODELS, only=[KEYS[0]], fresh=False, amp="bf16")
    assert keys(todo) == [f"{KEYS[0]}_bf16"]
    assert keys(bm.to_measure({f"{KEYS[0]}_bf16": {}}, bm.MODELS, only=None, fresh=False, amp="bf16")) == \
        [f"{k}_bf16" for k in KEYS[1:]]


def test_dropped_modes_names_what_a_partial_run_replaces():
    row = {"modes": {"native": {}, "tree": {}, "torch_deterministic": {}, "atomic": {}}}
    assert bm.dropped_modes(row, ["native", "tree"]) == ["atomic", "torch_deterministic"]
    assert bm.dropped_modes(row, list(bm.MODES)) == []
    assert bm.dropped_modes(None, ["native"]) == []


def _gpu_stood_in(tmp_path, monkeypatch) -> None:
    """What main() needs to run without a GPU, restored after the test: CUDA reported available, the result
    file and report in ``tmp_path``, a fixed fingerprint, a one-line report; the environment variable and
    import path main() sets."""
    import sys

    import torch

    import nnrand.fingerprint

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(bm, "RESULTS", tmp_path / "models.json")
    monkeypatch.setattr(bm, "REPORT", tmp_path / "models.md")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nnrand.fingerprint, "fingerprint", lambda device: {"git_sha": "abc1234", "date": "d"})
    monkeypatch.setattr(bm, "render", lambda data: "report\n")


def test_a_run_with_only_keeps_the_other_rows_and_names_dropped_modes(tmp_path, monkeypatch, capsys):
    # main() end to end with the GPU parts stood in for: the file's other rows survive --only --fresh, the
    # re-measured row holds the new modes alone, and the run says which modes it dropped
    import json

    _gpu_stood_in(tmp_path, monkeypatch)
    measured = []

    def fake_measure(case, args):
        measured.append((case.key, tuple(args.modes)))
        return {"case": {"key": case.key}, "modes": {m: {"ms": 1.0} for m in args.modes}}

    monkeypatch.setattr(bm, "measure", fake_measure)
    old = {"rows": {KEYS[0]: {"modes": {"native": {}, "atomic": {}}}, KEYS[1]: {"modes": {"native": {}}}}}
    bm.RESULTS.write_text(json.dumps(old))
    assert bm.main(["--only", KEYS[0], "--modes", "native", "tree", "--fresh"]) == 0
    rows = json.loads(bm.RESULTS.read_text())["rows"]
    assert measured == [(KEYS[0], ("native", "tree"))]
    assert set(rows) == {KEYS[0], KEYS[1]} and rows[KEYS[1]]["modes"] == {"native": {}}
    assert set(rows[KEYS[0]]["modes"]) == {"native", "tree"}
    assert "atomic results are dropped" in capsys.readouterr().out


def test_a_model_whose_every_mode_failed_renders_its_errors_and_no_verdict():
    case = {"model": "torchvision:foo", "batch": 8, "size": 32, "classes": 10, "key": "foo"}
    failed = {"layouts": {"contiguous": {"error": "RuntimeError: boom", "wall_s": 1.0}}, "layout": None}
    data = {"rows": {"foo": {"case": case, "modes": {m: dict(failed) for m in bm.MODES}, "amp": None}},
            "fingerprint": {}}
    text = bm.render(data)
    assert text.count("| runs no step: RuntimeError: boom |") == len(bm.MODES)
    # no tree run measured: the repeatability target has nothing to be met by
    assert "where the coverage is full:  (no model measured)" in text and "met" not in text.split("## Targets")[1]


def test_heuristic_b_rows_have_their_own_keys_and_labels():
    rows = {KEYS[0]: {"modes": {}}}   # a row under PyTorch's default heuristic does not stand in for a b row
    assert keys(bm.to_measure(rows, bm.MODELS, only=[KEYS[0]], fresh=False, amp=None, heuristic="b")) == \
        [f"{KEYS[0]}_hb"]
    assert keys(bm.to_measure(rows, bm.MODELS, only=[KEYS[0]], fresh=False, amp="bf16", heuristic="b")) == \
        [f"{KEYS[0]}_bf16_hb"]
    assert bm.row_key(KEYS[0], None, "instant") == KEYS[0]
    case = {"model": "torchvision:resnet50"}
    label = bm._label({"case": case, "amp": "bf16", "cudnn_heuristic": "b"})
    assert label == "torchvision:resnet50 (bf16, heuristic b)"
    assert bm._label({"case": case, "amp": None}) == "torchvision:resnet50"


def test_main_sets_the_heuristic_before_cuda_and_keys_its_rows(tmp_path, monkeypatch):
    import json
    import os

    import torch

    from nnrand import noise

    _gpu_stood_in(tmp_path, monkeypatch)
    monkeypatch.setenv(noise.HEURISTIC_ENV, "0")   # recorded, so the test puts back what it found
    monkeypatch.delenv(noise.HEURISTIC_ENV)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seen = []
    monkeypatch.setattr(bm, "measure", lambda case, args: seen.append(os.environ.get(noise.HEURISTIC_ENV)) or
                        {"case": {"key": case.key}, "modes": {}})
    assert bm.main(["--only", KEYS[0], "--cudnn-heuristic", "b"]) == 0
    rows = json.loads(bm.RESULTS.read_text())["rows"]
    assert seen == ["1"] and set(rows) == {f"{KEYS[0]}_hb"} and rows[f"{KEYS[0]}_hb"]["cudnn_heuristic"] == "b"
    # the default runs PyTorch's heuristic whatever the environment says, and keys rows as before
    monkeypatch.setenv(noise.HEURISTIC_ENV, "1")
    assert bm.main(["--only", KEYS[0]]) == 0
    rows = json.loads(bm.RESULTS.read_text())["rows"]
    assert seen == ["1", "0"] and "cudnn_heuristic" not in rows[KEYS[0]]


def test_runs_are_interleaved_in_rounds_and_summarised_per_mode():
    """Round r runs every (mode, layout) once in a fixed order; each job's figures are the median over all
    its runs' steps and its distinct final hashes; the coverage is its last run's."""
    import types

    jobs = [("native", "nchw"), ("tree", "nchw"), ("tree", "channels_last")]
    assert bm.interleaved(jobs, 2) == [(0, jobs[0]), (0, jobs[1]), (0, jobs[2]),
                                       (1, jobs[0]), (1, jobs[1]), (1, jobs[2])]
    order = []

    def fake_run(case, mode, layout, batches, args, strict=True):
        r = sum(1 for j in order if j == (mode, layout))
        order.append((mode, layout))
        # native's runs hash alike; tree's differ per run; times are whole numbers, so medians are exact
        # 3 steps per run, one slow: the median over all 9 steps (30.0) is not that of the runs' (12, 22, 32)
        return {"times": [10.0 * (r + 1), 10.0 * (r + 1) + 2.0, 100.0], "hash": "same" if mode == "native" else f"h{r}",
                "coverage": {"convolution_backward": {"tree": r}} if mode == "tree" else None}
    case = types.SimpleNamespace(key="case")
    out = bm.run_interleaved(case, jobs, None, types.SimpleNamespace(runs=3), run=fake_run)
    assert order == [job for _, job in bm.interleaved(jobs, 3)]
    assert out[jobs[0]]["ms"] == 30.0 and out[jobs[0]]["distinct"] == 1 and out[jobs[0]]["runs"] == 3
    assert out[jobs[0]]["run_ms"] == [12.0, 22.0, 32.0]
    assert out[jobs[1]]["distinct"] == 3 and out[jobs[1]]["coverage"] == {"convolution_backward": {"tree": 2}}
    assert "error" not in out[jobs[2]] and "refused_strict" not in out[jobs[2]]


def test_a_refused_tree_mode_continues_unstrict_and_a_failing_mode_is_an_error():
    """nnrand's refusal under strict=True: that run and the later ones run with strict=False, the refusal
    noted; any other exception makes the job an error row and its later rounds are skipped."""
    import types

    from nnrand.routing import RoutingError

    calls = []

    def fake_run(case, mode, layout, batches, args, strict=True):
        calls.append((mode, strict))
        if mode == "tree" and strict:
            raise RoutingError("uncovered nondeterministic op aten::foo\nsecond line")
        if mode == "torch_deterministic":
            raise RuntimeError("no deterministic implementation")
        return {"times": [1.0], "hash": "h", "coverage": None}
    jobs = [("tree", "nchw"), ("torch_deterministic", "nchw")]
    out = bm.run_interleaved(types.SimpleNamespace(key="case"), jobs, None, types.SimpleNamespace(runs=2),
                             run=fake_run)
    assert calls == [("tree", True), ("tree", False), ("torch_deterministic", True), ("tree", False)]
    assert out[jobs[0]]["refused_strict"] == "RoutingError: uncovered nondeterministic op aten::foo"
    assert out[jobs[0]]["runs"] == 2
    assert out[jobs[1]]["error"] == "RuntimeError: no deterministic implementation" and "ms" not in out[jobs[1]]


def test_tree_is_called_below_deterministic_mode_only_clear_of_the_runs_spread():
    """compare: per-run medians that overlap are neither below nor above; rows without them (measured
    before they were kept) compare by their medians; the targets list the overlapping cases apart."""
    assert bm.compare({"ms": 9.0, "run_ms": [8.5, 9.0, 9.4]}, {"ms": 10.0, "run_ms": [9.5, 10.0, 11.0]}) == "below"
    assert bm.compare({"ms": 12.0, "run_ms": [11.5, 12.0, 17.0]}, {"ms": 10.0, "run_ms": [9.5, 10.0, 11.0]}) \
        == "above"
    assert bm.compare({"ms": 11.0, "run_ms": [9.0, 11.0, 17.0]}, {"ms": 10.0, "run_ms": [9.5, 10.0, 12.0]}) \
        == "overlap"
    assert bm.compare({"ms": 9.0}, {"ms": 10.0, "run_ms": [10.0]}) == "below"
    assert bm.compare({"ms": 11.0}, {"ms": 10.0}) == "above"

    def row(tree, det, size):
        case = {"batch": 64, "classes": 10, "key": f"m{size}", "model": "resnet18", "size": size}
        return {"case": case, "amp": None, "modes": {
            "tree": {"layout": "nchw", "layouts": {"nchw": dict(tree, distinct=1, runs=3)}},
            "torch_deterministic": {"layout": "nchw", "layouts": {"nchw": dict(det, distinct=1, runs=3)}}}}
    rows = {"a": row({"ms": 9.0, "run_ms": [8.9, 9.0, 9.1]}, {"ms": 10.0, "run_ms": [9.9, 10.0, 10.1]}, 32),
            "b": row({"ms": 11.0, "run_ms": [9.0, 11.0, 17.0]}, {"ms": 10.0, "run_ms": [9.5, 10.0, 12.0]}, 64)}
    lines = bm.targets({"rows": rows})
    assert "- tree below PyTorch's deterministic mode: resnet18 32 px (9.00 vs 10.00 ms)" in lines
    assert "- tree NOT below it: none" in lines
    assert any(line.startswith("- tree and PyTorch's deterministic mode within the spread") and
               line.endswith("resnet18 64 px (11.00 vs 10.00 ms)") for line in lines)


def test_only_nnrands_refusal_of_a_tree_mode_is_retried_and_a_failed_retry_keeps_the_refusal():
    """A tree mode failing with another exception, and another mode refused by nnrand, are errors with no
    retry; a tree mode whose strict=False retry fails too is an error that still names the refusal."""
    import types

    from nnrand.routing import RoutingError

    calls = []

    def fake_run(case, mode, layout, batches, args, strict=True):
        calls.append((mode, layout, strict))
        if mode == "tree" and layout == "nchw":
            raise RuntimeError("CUDA out of memory")
        if mode == "native":
            raise RoutingError("not a routed mode")
        raise RoutingError("refused" if strict else "refused again")
    jobs = [("tree", "nchw"), ("native", "nchw"), ("tree", "channels_last")]
    out = bm.run_interleaved(types.SimpleNamespace(key="case"), jobs, None, types.SimpleNamespace(runs=2),
                             run=fake_run)
    assert calls == [("tree", "nchw", True), ("native", "nchw", True), ("tree", "channels_last", True),
                     ("tree", "channels_last", False)]
    assert out[jobs[0]]["error"] == "RuntimeError: CUDA out of memory" and "refused_strict" not in out[jobs[0]]
    assert out[jobs[1]]["error"] == "RoutingError: not a routed mode"
    assert out[jobs[2]] == {"error": "RoutingError: refused again", "refused_strict": "RoutingError: refused",
                            "wall_s": out[jobs[2]]["wall_s"]}


def test_equal_run_medians_at_the_edges_overlap():
    """The slowest run of one mode equal to the fastest of the other is not a separation."""
    assert bm.compare({"ms": 9.0, "run_ms": [8.0, 10.0]}, {"ms": 11.0, "run_ms": [10.0, 12.0]}) == "overlap"
    assert bm.compare({"ms": 11.0, "run_ms": [10.0, 12.0]}, {"ms": 9.0, "run_ms": [8.0, 10.0]}) == "overlap"


def test_runs_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bm.main(["--runs", "0"])
    assert e.value.code == 2 and "--runs must be >= 1, got 0" in capsys.readouterr().err


def test_verdicts_print_the_digits_that_decide_them():
    """A ratio that rounds onto its target is printed with the digits that decide the verdict (16.610 /
    15.748 against 1.05: 1.055, NOT met), never as "1.05x (target <= 1.05x: NOT met)"."""
    assert bm.decisive(16.610 / 15.748, 1.05) == "1.055"
    assert bm.decisive(1.10, 1.10) == "1.10" and bm.decisive(1.04, 1.05) == "1.04"
    assert bm.decisive(1.0499, 1.05) == "1.0499"   # met, and printed below the target


def test_rows_from_another_gpu_or_an_earlier_run_are_labelled():
    """The header names the last run; rows measured on another GPU, or all at a commit before the
    header's, say where they come from (rows recorded before the GPU was kept count as the header's)."""
    env = {"gpu": "H100", "git_sha": "bbbbbbbccc", "date": "d2"}
    rows = {"x": {"measured": {"git_sha": "aaaaaaa111", "date": "d1", "gpu": "H200"}},
            "y": {"measured": {"git_sha": "bbbbbbbccc", "date": "d2", "gpu": "H100"}}}
    line = " ".join(bm._measured_line({"fingerprint": env, "rows": rows}))
    assert "x at git aaaaaaa on H200 (d1)" in line and "y at git bbbbbbb on H100 (d2)" in line
    only_old = {"x": {"measured": {"git_sha": "aaaaaaa111", "date": "d1"}}}
    line = " ".join(bm._measured_line({"fingerprint": env, "rows": only_old}))
    assert "x at git aaaaaaa (d1)" in line and " on " not in line
    assert bm._measured_line({"fingerprint": env, "rows": {"y": rows["y"]}}) == []


def test_an_interrupted_fresh_run_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    # main() with the GPU parts stood in for: a --fresh run stopped (KeyboardInterrupt) after two rows keeps
    # its record in the file; the same command measures only the rows after them, then drops the record and
    # the rows' stamps; a finished run is not resumed; other settings, or --no-resume, start over
    import json

    _gpu_stood_in(tmp_path, monkeypatch)
    calls, stop = [], {"after": None}

    def fake_measure(case, args):
        if len(calls) == stop["after"]:
            raise KeyboardInterrupt
        calls.append(case.key)
        return {"case": {"key": case.key}, "modes": {m: {"ms": 1.0} for m in args.modes}}

    monkeypatch.setattr(bm, "measure", fake_measure)
    bm.RESULTS.write_text(json.dumps({"rows": {k: {"modes": {"native": {"ms": 9.0}}} for k in KEYS}}))
    fresh = ["--fresh", "--modes", "native"]

    def interrupted(argv, after: int) -> dict:
        calls.clear()
        stop["after"] = after
        with pytest.raises(KeyboardInterrupt):
            bm.main(argv)
        stop["after"] = None
        return json.loads(bm.RESULTS.read_text())

    data = interrupted(fresh, 2)
    assert data["fresh_run"]["keys"] == KEYS
    assert [k for k in KEYS if "fresh_run" in data["rows"][k]] == KEYS[:2]
    assert all(data["rows"][k]["modes"]["native"]["ms"] == 9.0 for k in KEYS[2:])   # not yet measured again
    calls.clear()
    capsys.readouterr()
    assert bm.main(fresh) == 0
    assert calls == KEYS[2:]
    assert f"resuming an interrupted --fresh run: {len(KEYS) - 2} of {len(KEYS)} rows left" in capsys.readouterr().out
    data = json.loads(bm.RESULTS.read_text())
    assert "fresh_run" not in data and not any("fresh_run" in row for row in data["rows"].values())
    calls.clear()
    assert bm.main(fresh) == 0 and calls == KEYS   # the finished run is not resumed
    for other in (fresh + ["--runs", "5"], fresh + ["--no-resume"]):
        interrupted(fresh, 3)
        calls.clear()
        assert bm.main(other) == 0 and calls == KEYS
    with pytest.raises(SystemExit):
        bm.main(["--no-resume"])
