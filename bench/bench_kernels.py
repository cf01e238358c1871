"""Every registered (op, subject, case): latency, bitwise run-to-run variance, error against float64.

Subjects and cases come from the registry and the op specs (:func:`bench.runner.plan`); see
``bench/README.md``. Run with ``pytest --benchmark-only`` from the repository root.
"""
from __future__ import annotations

import pytest

from bench.runner import Unavailable


def test_kernel(bench_item, bench_session, benchmark):
    try:
        bench_session.measure(bench_item, benchmark)
    except Unavailable as e:
        pytest.skip(str(e))
