"""nnrand training harness: trains a ResNet with chosen kernel variants in its backward pass, under
controlled noise, and records what it takes to find where two runs diverge.

    python -m nnrand.train --kernel tree          # see --help for the rest

Modules: ``routing`` (backward reductions through the kernel registry), ``noise`` (seeds, presets,
pinned flags), ``train`` (the loop, ``main(config) -> metrics``), ``runio`` (run directories,
atomic writes, checkpoints), ``fingerprint`` (environment), ``report`` (run report from result files).
Data and models live in ``data`` and ``models``.
"""
from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
