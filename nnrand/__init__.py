"""nnrand training harness: trains a ResNet with chosen kernel variants in its backward pass, under
controlled noise, and records what it takes to find where two runs diverge.

    python -m nnrand.train --kernel tree          # see --help for the rest

One line for any model: ``with nnrand.use_kernels("tree") as routing: ...`` (see ``routing``).

Modules: ``routing`` (backward reductions through the kernel registry, at the dispatcher; ``replay``, its
C++ layer that replays routed calls per signature without Python), ``trace``
(record runs op by op and find the first op where two part), ``noise`` (seeds, presets,
pinned flags), ``train`` (the loop, ``main(config) -> metrics``), ``runio`` (run directories,
atomic writes, checkpoints), ``fingerprint`` (environment), ``report`` (run report from result files).
Data and models live in ``data`` and ``models``.
"""
from __future__ import annotations

__all__ = ["__version__", "use_kernels"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # ``nnrand.use_kernels`` and ``nnrand.trace`` without importing torch and the kernels at ``import nnrand``
    import importlib

    if name == "use_kernels":
        return importlib.import_module("nnrand.routing").use_kernels
    if name in ("routing", "trace"):
        return importlib.import_module(f"nnrand.{name}")
    raise AttributeError(f"module 'nnrand' has no attribute {name!r}")
