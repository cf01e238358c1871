"""nnrand kernels: every op family as CUDA C (``<op>.cu``) beside its launchers and CPU order models
(``<op>.py``), all listed in one registry.

    >>> import kernels
    >>> kernels.get("sum", "tree")(torch.randn(1000))      # CPU tensor -> CPU order model
    >>> [v.key for v in kernels.variants("bias_grad")]
"""
from __future__ import annotations

import importlib
import pathlib

from .registry import HALF_DTYPES, Case, OpSpec, Variant, define_op, get, ops, register, register_op, spec, table, variants
from .runtime import KernelArgumentError, KernelCompileError, KernelUnavailableError, cuda_available, cupy_available

__all__ = [
    "HALF_DTYPES", "Case", "OpSpec", "Variant", "define_op", "get", "ops", "register", "register_op", "spec", "table", "variants",
    "KernelArgumentError", "KernelCompileError", "KernelUnavailableError", "cuda_available", "cupy_available",
    "OP_MODULES",
]

# Every op family is a pair kernels/<op>.cu + kernels/<op>.py; importing the .py registers its variants.
_HERE = pathlib.Path(__file__).resolve().parent
OP_MODULES = sorted(p.stem for p in _HERE.glob("*.cu") if (_HERE / f"{p.stem}.py").exists())
for _name in OP_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
