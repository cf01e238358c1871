"""The committed model, conv-shape and multi-GPU reports are what their renderers make of the committed
result files, byte for byte: a report is generated from its results, never edited by hand, and a change to a
renderer shows here until the reports are rendered again."""
from __future__ import annotations

import json

import pytest

from bench import conv_shapes, models, multigpu, results

REPORTS = results.ROOT / "reports"


def test_models_report_is_its_render():
    data = json.loads((REPORTS / "results" / "models.json").read_text())
    assert models.render(data) == (REPORTS / "models.md").read_text()


def test_conv_shapes_section_is_its_render():
    data = json.loads((REPORTS / "results" / "conv_shapes.json").read_text())
    text = (REPORTS / "kernels.md").read_text()
    start, end = text.index(conv_shapes.BEGIN), text.index(conv_shapes.END) + len(conv_shapes.END)
    assert conv_shapes.render_section(data).rstrip("\n") == text[start:end]


@pytest.mark.parametrize("stem", ["multigpu", "multigpu_h100", "multigpu_h100_heuristic"])
def test_multigpu_reports_are_their_renders(stem):
    data = json.loads((REPORTS / "results" / f"{stem}.json").read_text())
    assert multigpu.render(data) == (REPORTS / f"{stem}.md").read_text()
