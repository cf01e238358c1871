"""nnrand benchmark suite: latency and bitwise run-to-run variance of every registered kernel variant
against its peers (PyTorch, CuPy/CUB), written to one long-format table and rendered to a report.

    pytest --benchmark-only                 # CUDA when available, else the CPU order models
    python -m bench.report                  # re-render reports/kernels.md from the table alone

Modules: :mod:`bench.runner` (plan and measurement), :mod:`bench.metrics` (variance, ULP, error),
:mod:`bench.timing` (torch flags, CUDA-event timing, ceilings), :mod:`bench.results` (the table and
its paths), :mod:`bench.report` (markdown and plots). Every row carries
:func:`nnrand.fingerprint.row_fingerprint` (environment).
"""
