"""What intercepting every aten op costs on the host, by how the interceptor is written: the per-call time
of small ops with no mode, under a TorchDispatchMode whose ``__torch_dispatch__`` is Python, and under one
whose ``__torch_dispatch__`` is a C function (built here with torch.utils.cpp_extension.load_inline: a
CPython fast-call function bound as a method, no pybind11 conversion). Both
modes only call the op: the difference is the floor of every-op recording (nnrand.trace ops="all") done
in Python against one done in C++ behind the same mode, which sees the same calls in the same order.

    python3 bench/dev/dispatch_overhead.py                  # CPU, 20000 calls of each op
    python3 bench/dev/dispatch_overhead.py --device cuda    # CUDA tensors (host time per launch)
    python3 bench/dev/dispatch_overhead.py --calls 5000 --rounds 9

Per op and mode: the median over ``--rounds`` rounds of (host time of ``--calls`` calls) / calls, the modes
taking turns within each round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CPP = r"""
#include <torch/extension.h>

// __torch_dispatch__(self, func, types, args=(), kwargs=None): call the op. A plain CPython fast-call
// function (no pybind11 argument conversion), bound as a method by PyInstanceMethod_New.
static PyObject* dispatch(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames) {
    PyObject *func = nargs > 1 ? argv[1] : nullptr, *args = nargs > 3 ? argv[3] : nullptr;
    PyObject* kwargs = nargs > 4 ? argv[4] : nullptr;
    const Py_ssize_t named = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < named; ++i) {
        const char* key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, i));
        if (key && !strcmp(key, "args")) args = argv[nargs + i];
        else if (key && !strcmp(key, "kwargs")) kwargs = argv[nargs + i];
    }
    if (!func) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__: no func");
        return nullptr;
    }
    PyObject* empty = nullptr;
    if (!args) args = empty = PyTuple_New(0);
    PyObject* out = PyObject_Call(func, args, (kwargs && kwargs != Py_None && PyDict_GET_SIZE(kwargs)) ? kwargs
                                                                                                      : nullptr);
    Py_XDECREF(empty);
    return out;
}

static PyMethodDef dispatch_def = {"__torch_dispatch__", (PyCFunction)(void (*)(void))dispatch,
                                   METH_FASTCALL | METH_KEYWORDS, nullptr};

void install(py::object cls) {
    PyObject* f = PyCFunction_New(&dispatch_def, nullptr);
    PyObject* m = f ? PyInstanceMethod_New(f) : nullptr;
    Py_XDECREF(f);
    if (!m || PyObject_SetAttrString(cls.ptr(), "__torch_dispatch__", m) < 0) {
        Py_XDECREF(m);
        throw py::error_already_set();
    }
    Py_DECREF(m);
}
"""


class PythonMode(TorchDispatchMode):
    """Calls each op from a Python ``__torch_dispatch__`` (no per-call dynamo wrapper, as nnrand.trace's
    recorder is dispatched)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class CppMode(TorchDispatchMode):
    """Calls each op from a C++ ``__torch_dispatch__`` (installed by ``build``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def build(directory: str) -> None:
    from torch.utils.cpp_extension import load_inline

    os.makedirs(directory, exist_ok=True)
    ext = load_inline("nnrand_dispatch_probe", cpp_sources=CPP, functions=["install"], build_directory=directory,
                      verbose=False)
    ext.install(CppMode)


def per_call_us(fn, calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--build-dir", default="/tmp/nnrand-dispatch-probe")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    build(a.build_dir)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, 8, generator=g).to(dev) for _ in range(2))
    ops = {"add": lambda: torch.add(x, y), "mul_": lambda: x.mul_(1.0), "view": lambda: x.view(64),
           "mm": lambda: torch.mm(x, y)}
    modes = {"none": None, "python": PythonMode, "cpp": CppMode}
    with CppMode():   # the C++ method does call the op: same result as without a mode
        out = torch.mm(x, y)
    assert torch.equal(out, torch.mm(x, y))
    print(f"host time per call (us), {dev}, median of {a.rounds} rounds of {a.calls} calls "
          f"({torch.__version__}):")
    for name, fn in ops.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(a.rounds):
            for m, cls in (modes.items() if r % 2 == 0 else reversed(modes.items())):
                if cls is None:
                    times[m].append(per_call_us(fn, a.calls, dev))
                else:
                    with cls():
                        times[m].append(per_call_us(fn, a.calls, dev))
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"  {name:5s}  " + "  ".join(f"{m} {v:6.2f}" for m, v in med.items()) +
              f"   mode's own cost: python {med['python'] - med['none']:6.2f}, cpp {med['cpp'] - med['none']:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
