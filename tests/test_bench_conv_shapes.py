"""bench.conv_shapes without a GPU: the shape census of a network, the count-weighted totals and target
verdicts of the report, and the splice into reports/kernels.md that keeps the rest of the file."""
from __future__ import annotations

import math

from bench import conv_shapes as cs


def test_census_of_our_resnet18():
    shapes = cs.conv_shapes("resnet18", 128, 32, 10)
    assert sum(s["count"] for s in shapes) == 20          # 1 stem + 16 block convs + 3 projections
    assert len(shapes) == 11
    first = shapes[0]
    assert first["x"] == [128, 3, 32, 32] and first["w"] == [64, 3, 3, 3] and first["count"] == 1
    assert {cs.shape_name(s) for s in shapes} >= {"3x3 64->64 32x32", "1x1s2 256->512 8x8"}


def _row(shape, fastest, det, tree, atomic, auto):
    times = {"cudnn_fastest": fastest, "cudnn_det": det, "atomic": atomic, "tree": tree}
    col = "cudnn_det" if auto == "torch_det" else auto
    g = {"times_us": times, "auto": auto, "auto_column": col, "tuner_times_us": {},
         "deterministic": {"atomic": False, "tree": True}}
    return {"shape": shape, "dgrad": g, "wgrad": g}


def test_totals_weight_by_count_and_ignore_nondeterministic_for_best():
    net = {"model": "m", "batch": 2, "size": 8,
           "shapes": [{"count": 3}, {"count": 1}],
           "layouts": {"nchw": {"rows": [_row("a", 10.0, 20.0, 12.0, 1.0, "tree"),
                                          _row("b", 5.0, 6.0, 9.0, 1.0, "torch_det")], "measured": {}}}}
    t = cs.totals(net, "nchw")
    assert t["sum"]["dgrad"]["cudnn_fastest"] == 3 * 10 + 5
    assert t["sum"]["dgrad"]["auto"] == 3 * 12 + 6
    assert t["sum"]["dgrad"]["best_det"] == 3 * 12 + 6      # atomic's 1.0 never counts as deterministic
    assert t["sum"]["both"]["tree"] == 2 * (3 * 12 + 9)
    assert t["worst"]["wgrad"] == (12.0 / 10.0, "a")   # one division each: the same rounding as the code's
    text = cs.render_section({"networks": {"m": net}, "fingerprint": {"gpu": "G"}})
    assert text.startswith(cs.BEGIN) and text.rstrip().endswith(cs.END)
    # (3*12 + 6) / (3*10 + 5) = 1.2 > 1.05; shape a's auto (tree) 12 against cuDNN fastest 10
    assert "autotuned total 1.20x" in text and "NOT met" in text and "tree (1.20x)" in text
    assert "Forward convs" not in text   # results measured before the forward table have no fwd entries


def test_first_conv_dgrad_named_as_never_trained():
    """The first conv reads the images: when its dX is the worst shape, the verdict still counts it, and
    the line adds the worst among the convs whose dX a training step computes; a first configuration that
    occurs more than once (shared with later convs) is not set apart."""
    rows = [_row("stem", 10.0, 20.0, 15.0, 1.0, "tree"), _row("b", 5.0, 6.0, 6.0, 1.0, "torch_det"),
            _row("c", 4.0, 5.0, 4.4, 1.0, "tree")]
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}, {"count": 2}, {"count": 1}],
           "layouts": {"nchw": {"rows": rows, "measured": {}}}}
    t = cs.totals(net, "nchw")
    assert t["worst"]["dgrad"] == (15.0 / 10.0, "stem")   # one division each: the code's rounding
    assert t["worst_trained"] == (6.0 / 5.0, "b")
    text = cs.render_section({"networks": {"m": net}, "fingerprint": {"gpu": "G"}})
    assert "dgrad 1.50x (stem)" in text and "NOT met" in text
    assert "the worst dgrad among the others is 1.20x (b)" in text
    net["shapes"][0]["count"] = 2
    assert cs.totals(net, "nchw")["worst_trained"] is None
    assert "among the others" not in cs.render_section({"networks": {"m": net}, "fingerprint": {"gpu": "G"}})


def _fwd(fastest, det, tree, auto, winograd=None):
    return {"times_us": {"cudnn_fastest": fastest, "cudnn_det": det, "tree": tree, "winograd": winograd},
            "auto": auto, "auto_column": "cudnn_det" if auto == "torch_det" else auto, "tuner_times_us": {},
            "deterministic": {"tree": True, "winograd": True}}


def test_forward_table_and_total():
    """Forward rows: a shape with no tree form (None) counts cuDNN det in the tree total; auto its chosen
    column (the Winograd form's, where chosen); the backward totals and targets are unchanged by the
    forward rows."""
    rows = [_row("a", 10.0, 20.0, 12.0, 1.0, "tree") | {"fwd": _fwd(4.0, 8.0, 5.0, "winograd", 3.0)},
            _row("b", 5.0, 6.0, 9.0, 1.0, "torch_det") | {"fwd": _fwd(2.0, 3.0, None, "torch_det")}]
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 3}, {"count": 1}],
           "layouts": {"nchw": {"rows": rows, "measured": {}}}}
    t = cs.totals(net, "nchw")
    assert t["sum"]["fwd"] == {"cudnn_fastest": 3 * 4 + 2, "cudnn_det": 3 * 8 + 3, "tree_or_det": 3 * 5 + 3,
                               "auto": 3 * 3 + 3}
    assert t["sum"]["dgrad"]["auto"] == 3 * 12 + 6
    text = cs.render_section({"networks": {"m": net}, "fingerprint": {"gpu": "G"}})
    assert "| a | 3 | 4.0 | 8.0 | 5.0 | 3.0 | winograd (0.75x) |" in text
    assert "| b | 1 | 2.0 | 3.0 | – | – | torch_det (1.50x) |" in text
    assert "autotuned 12 (0.86x)" in text and "autotuned total 1.20x" in text


def test_splice_replaces_only_the_section():
    doc = "# Kernels\n\nbody\n"
    once = cs.splice(doc, f"{cs.BEGIN}\nold\n{cs.END}\n")
    assert once.startswith(doc.rstrip("\n")) and "old" in once
    twice = cs.splice(once + "\ntail\n", f"{cs.BEGIN}\nnew\n{cs.END}\n")
    assert "old" not in twice and "new" in twice and twice.endswith("tail\n") and twice.count(cs.BEGIN) == 1


def test_heuristic_b_rows_are_keyed_apart_headed_and_set_before_cuda(monkeypatch):
    """--cudnn-heuristic b: the variable is set before measuring (torch reads it at its first conv), the
    network's rows take the ``_hb`` key (beside ``_<dtype>``) and their headings say so; the default
    forces PyTorch's heuristic whatever the environment says."""
    import os
    import sys

    import torch

    from nnrand import noise

    assert cs.network_key("resnet18_cifar") == "resnet18_cifar"
    assert cs.network_key("resnet50_224", "bf16", "b") == "resnet50_224_bf16_hb"
    assert cs.network_key("resnet50_224", "fp32", "b") == "resnet50_224_hb"
    row = _row("a", 10.0, 20.0, 12.0, 1.0, "tree")
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}], "cudnn_heuristic": "b",
           "layouts": {"nchw": {"rows": [row], "measured": {}}}}
    text = cs.render_section({"networks": {"m_hb": net}, "fingerprint": {"gpu": "G"}})
    assert "### m, batch 2, 8 px, nchw, fp32, cuDNN heuristic b (" in text
    net.pop("cudnn_heuristic")
    assert "heuristic b" not in cs.render_section({"networks": {"m": net}, "fingerprint": {"gpu": "G"}})

    monkeypatch.setenv(noise.HEURISTIC_ENV, "0")   # recorded, so the test puts back what it found
    monkeypatch.delenv(noise.HEURISTIC_ENV)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    seen = []
    monkeypatch.setattr(cs, "measure", lambda args: seen.append((os.environ.get(noise.HEURISTIC_ENV),
                                                                 args.cudnn_heuristic)) or {"networks": {}})
    monkeypatch.setattr(cs, "write_report", lambda data: "kernels.md")
    assert cs.main(["--cudnn-heuristic", "b"]) == 0
    monkeypatch.setenv(noise.HEURISTIC_ENV, "1")
    assert cs.main([]) == 0
    assert seen == [("1", "b"), ("0", "instant")]


def test_a_shape_without_a_time_fails_the_shape_target_and_close_ratios_print_their_deciding_digits():
    """A shape whose autotuned time is missing (None: the variant refused it, as measure_shape stores it) is
    the worst shape, never skipped into a "met" nor a crash; a ratio that rounds onto its target prints the
    digits that decide it (1.304 against 1.3 reads 1.304)."""
    rows = [_row("a", 10.0, 20.0, 11.0, 1.0, "tree"), _row("b", 5.0, 6.0, None, 1.0, "tree")]
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}, {"count": 1}],
           "layouts": {"nchw": {"rows": rows, "measured": {}}}}
    t = cs.totals(net, "nchw")
    assert t["worst"]["dgrad"] == (math.inf, "b")
    assert "(target <= 1.3x each: NOT met)" in cs.render_section({"networks": {"m": net}, "fingerprint": {}})
    rows = [_row("a", 10.0, 20.0, 13.04, 1.0, "tree")]
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}],
           "layouts": {"nchw": {"rows": rows, "measured": {}}}}
    text = cs.render_section({"networks": {"m": net}, "fingerprint": {}})
    assert "dgrad 1.304x (a)" in text and "(target <= 1.3x each: NOT met)" in text


def test_a_layout_measured_on_another_gpu_names_it():
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}],
           "layouts": {"nchw": {"rows": [_row("a", 10.0, 20.0, 11.0, 1.0, "tree")],
                                "measured": {"git_sha": "abcdef123", "date": "d", "gpu": "H200"}}}}
    assert "Measured at git abcdef1 on d, on H200." in cs.render_section({"networks": {"m": net},
                                                                          "fingerprint": {"gpu": "H100"}})
    assert "Measured at git abcdef1 on d." in cs.render_section({"networks": {"m": net},
                                                                 "fingerprint": {"gpu": "H200"}})


def test_across_layouts_verdict_is_against_the_faster_layouts_cudnn():
    """Each layout's own line compares with that layout's cuDNN; the network's verdict compares the faster
    layout's autotuned total with cuDNN's fastest total in its faster layout: NCHW's autotuned 10 against
    NCHW's cuDNN 10 is 1.00x, but channels_last's cuDNN takes 5, so the network reads 10 / 5 = 2x."""
    net = {"model": "m", "batch": 2, "size": 8, "shapes": [{"count": 1}],
           "layouts": {"nchw": {"rows": [_row("a", 10.0, 20.0, 10.0, 1.0, "tree")], "measured": {}},
                       "channels_last": {"rows": [_row("a", 5.0, 20.0, 12.0, 1.0, "tree")], "measured": {}}}}
    md = cs.render_section({"networks": {"m": net}, "fingerprint": {}})
    assert "autotuned total 1.00x this layout's cuDNN fastest (target <= 1.05x: met)" in md
    assert ("cuDNN's fastest backward total is 10 us in channels_last; the autotuned deterministic one 20 us in "
            "nchw, 2.00x it (target <= 1.05x: NOT met)") in md
    one = {"networks": {"m": dict(net, layouts={"nchw": net["layouts"]["nchw"]})}, "fingerprint": {}}
    assert "Across layouts" not in cs.render_section(one)


def test_fresh_drops_only_the_networks_measured_and_a_changed_model_drops_its_old_rows(monkeypatch, tmp_path):
    """``--fresh`` starts over for the networks asked for, leaving the file's other sections (another
    network, bf16, heuristic b) as they were; without it, a network whose conv list changed drops the rows
    of the old list rather than pairing them with the new counts. No GPU: shapes and timings stubbed."""
    import argparse
    import json

    import torch

    stored = {"networks": {
        "resnet18_cifar": {"model": "resnet18", "batch": 128, "size": 32, "dtype": "fp32", "shapes": [{"old": 1}],
                           "layouts": {"nchw": {"rows": ["old-nchw"], "measured": {}},
                                       "channels_last": {"rows": ["old-cl"], "measured": {}}}},
        "resnet18_cifar_bf16": {"model": "resnet18", "layouts": {"nchw": {"rows": ["bf16"], "measured": {}}}},
        "resnet50_224": {"model": "r50", "layouts": {"nchw": {"rows": ["r50"], "measured": {}}}}}}
    results = tmp_path / "conv_shapes.json"
    monkeypatch.setattr(cs, "RESULTS", results)
    monkeypatch.setattr(cs, "load", lambda: json.loads(json.dumps(stored)))
    monkeypatch.setattr(cs, "conv_shapes", lambda *a: [{"x": [1], "count": 1}])
    monkeypatch.setattr(cs, "shape_name", lambda s: "s")
    timing = {g: {"times_us": {"cudnn_fastest": 1.0, "cudnn_det": 1.0, "tree": 1.0}, "auto": "tree"} for g in cs.GRADS}
    monkeypatch.setattr(cs, "measure_shape", lambda s, layout, args: timing)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr("nnrand.fingerprint.fingerprint", lambda device: {"git_sha": "abc", "date": "d", "gpu": "G"})
    args = argparse.Namespace(only=["resnet18_cifar"], layouts=["nchw"], fresh=True, calls=1, replays=1)
    nets = cs.measure(args)["networks"]
    assert set(nets) == set(stored["networks"])                      # the other sections stay
    assert list(nets["resnet18_cifar"]["layouts"]) == ["nchw"]        # started over: the old channels_last is gone
    assert nets["resnet18_cifar_bf16"] == stored["networks"]["resnet18_cifar_bf16"]
    args.fresh = False
    args.layouts = ["channels_last"]
    nets = cs.measure(args)["networks"]                               # the stored list differs from the new one
    assert list(nets["resnet18_cifar"]["layouts"]) == ["channels_last"]
    assert nets["resnet18_cifar"]["shapes"] == [{"x": [1], "count": 1}]
