"""Tune the synthetic dataset's difficulty: train a model with overridden generator constants and print
overall, majority and minority test accuracy.

    python3 bench/dev/synthetic_difficulty.py "PALETTE_SATURATION=0.2 OCCLUDE_P=0.2" "MINORITY={'train':0.05,'test':0.2}"

Each argument is one setting: space-separated NAME=VALUE overrides of ``nnrand.data`` constants
(VALUE is a Python literal). Training uses the harness defaults of the device (ResNet-18, 10 epochs,
batch 128 on CUDA) with deterministic kernels.
"""
from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nnrand import data, train  # noqa: E402


def run(setting: str, epochs: int | None) -> str:
    saved = {}
    for item in setting.split():
        name, value = item.split("=", 1)
        saved[name] = getattr(data, name)
        setattr(data, name, ast.literal_eval(value))
    if "PALETTE_SATURATION" in saved or "PALETTE_VALUE" in saved:
        import colorsys

        saved.setdefault("PALETTE", data.PALETTE)
        data.PALETTE = np.array([colorsys.hsv_to_rgb(i / 10, data.PALETTE_SATURATION, data.PALETTE_VALUE)
                                 for i in range(10)], dtype=data.PALETTE.dtype)
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = train.Config(kernel="tree", out=out, name="difficulty", progress=False, report=False, epochs=epochs)
            result = train.main(cfg)
            pred = np.load(Path(result["run_dir"]) / "member_000" / "predictions.npz")
            correct = pred["logits"].argmax(1) == pred["labels"]
            group = pred["group"]
            return (f"{setting or 'defaults'}: top-1 {correct.mean():.3f}, majority {correct[group == 0].mean():.3f}, "
                    f"minority {correct[group == 1].mean():.3f} (minority share {np.mean(group == 1):.2f})")
    finally:
        for name, value in saved.items():
            setattr(data, name, value)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--epochs=")]
    ep = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--epochs=")), None)
    for setting in args or [""]:
        print(run(setting, ep), flush=True)
