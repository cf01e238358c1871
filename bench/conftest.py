"""pytest glue for the benchmark suite: ``pytest --benchmark-only`` from the repository root.

Options: ``--variance-repeats N`` (default 100 on CUDA), ``--quick`` (or ``NNRAND_BENCH_QUICK=1``: scale
"quick", fewer repeats), ``--bench-backend auto|cuda|cpu`` (or ``NNRAND_BENCH_BACKEND``), ``--bench-dtype
float32|bf16|fp16`` (or ``NNRAND_BENCH_DTYPE``: inputs rounded to that dtype). In a plain
``pytest`` run the benchmarks are skipped (``--benchmark-skip`` in the project's addopts; pytest-benchmark
lets ``--benchmark-only`` override it). At the end of a session that measured anything, the result
table, the pytest-benchmark JSON and the markdown report are written (paths: :mod:`bench.results`).
"""
from __future__ import annotations

import json
import os

import pytest

_SESSION = pytest.StashKey()

# bench/dev/ holds the kernel engineers' scripts; they are run by hand, never collected.
collect_ignore = ["dev"]


def pytest_addoption(parser):
    g = parser.getgroup("nnrand bench")
    g.addoption("--variance-repeats", type=int, default=None,
                help="repeats per subject for the bitwise variance (default: 100 on CUDA, 100 within a time "
                     "budget on the CPU)")
    g.addoption("--quick", action="store_true", default=False,
                help="quick bench: scale 'quick' on CUDA, fewer repeats (also NNRAND_BENCH_QUICK=1)")
    g.addoption("--bench-backend", default=None, choices=("auto", "cuda", "cpu"),
                help="run the CUDA kernels or the CPU order models (default: CUDA when available)")
    g.addoption("--bench-dtype", default=None, choices=("float32", "bf16", "fp16"),
                help="inputs in this dtype: every float32 input rounded to bf16/fp16, as under autocast "
                     "(default float32; also NNRAND_BENCH_DTYPE); outputs go to <stem>_<dtype>")


def pytest_configure(config):
    if config.getoption("benchmark_only", False):
        # torch's deterministic mode refuses cuBLAS calls unless this is set before cuBLAS starts; it
        # only fixes cuBLAS's workspace size, for this benchmark process.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _session(config):
    from bench.runner import Session, Settings

    if _SESSION not in config.stash:
        quick = True if config.getoption("quick") else None
        settings = Settings.make(backend=config.getoption("bench_backend"), quick=quick,
                                 repeats=config.getoption("variance_repeats"), dtype=config.getoption("bench_dtype"))
        config.stash[_SESSION] = Session(settings)
    return config.stash[_SESSION]


def pytest_generate_tests(metafunc):
    if "bench_item" in metafunc.fixturenames:
        from bench.runner import plan

        state = _session(metafunc.config)
        items = plan(state.settings)
        state.planned = len(items)
        metafunc.parametrize("bench_item", items, ids=[it.id for it in items])


@pytest.fixture(scope="session")
def bench_session(request):
    return _session(request.config)


def pytest_report_header(config):
    if _SESSION in config.stash or config.getoption("benchmark_only", False):
        s = _session(config).settings
        return (f"nnrand bench: backend {s.backend}, scale {s.scale}, inputs {s.dtype}, {s.repeats} variance repeats "
                f"(budget {s.variance_budget_s:g} s per subject)")
    return None


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _SESSION not in config.stash:
        return
    state = config.stash[_SESSION]
    if not any(r["kind"] in ("variant", "peer") for r in state.rows):
        return
    from bench import report, results

    partial = state.attempted < state.planned  # deselected (-k, a path), stopped early (-x) or interrupted
    stem = results.stem(state.settings.backend, state.settings.quick, partial=partial, dtype=state.settings.dtype)
    table = state.table()
    csv = results.write(table, results.csv_path(stem))
    bs = getattr(config, "_benchmarksession", None)
    if bs is not None and bs.benchmarks:
        out = config.hook.pytest_benchmark_generate_json(
            config=config, benchmarks=bs.benchmarks, include_data=True,
            machine_info=bs.get_machine_info(),
            commit_info=config.hook.pytest_benchmark_generate_commit_info(config=config))
        path = results.json_path(stem)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
    md = report.render_file(csv, results.report_path(stem))
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"nnrand bench: {len(table)} result rows -> {csv}; report -> {md}")
