"""What a Python kernel registered at the dispatcher costs by itself, beside a C++ one: the floor under the
host cost of every routed op (nnrand.routing registers its handlers through torch.library).

    python3 bench/dev/python_kernel_overhead.py            # CPU tensors; needs a C++ compiler for the C++ row
    python3 bench/dev/python_kernel_overhead.py --no-cpp   # the Python rows only

Rows, microseconds of host time per call (median of --rounds rounds of --calls calls):

    op from Python, C++ kernel        torch.ops.<ns>.noop(x, y, 3), a kernel that returns x (built with
                                      torch.utils.cpp_extension.load_inline)
    op from Python, Python kernel     the same schema with a Python kernel (torch.library)
    backward, native                  relu forward + backward of 4 floats (threshold_backward in C++)
    backward, Python kernel           the same with aten::threshold_backward overridden by a Python kernel
                                      that calls the original (what the routing does), so the autograd
                                      engine enters Python once per backward

On a 2-core CPU machine (torch 2.13, three runs of this script): the C++ and Python kernels within noise of
each other (2.23-3.24 and 2.00-2.02 us); a relu step 19.61-22.19 us native, 24.70-24.92 with the Python
backward kernel (+2.57 to +5.32). The trampoline costs a few microseconds; a routed conv backward's 100-odd microseconds of host time
over native (bench/dev/routed_call_host_cost.py) are the handler's own Python, allocations and launches.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

CPP = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor noop(const at::Tensor& x, const at::Tensor& y, int64_t k) { return x; }
TORCH_LIBRARY(nnrand_probe_cpp, m) { m.def("noop(Tensor x, Tensor y, int k) -> Tensor"); }
TORCH_LIBRARY_IMPL(nnrand_probe_cpp, CPU, m) { m.impl("noop", noop); }
"""


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(calls // 10 + 1):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-cpp", action="store_true", help="skip the C++ kernel (no compiler needed)")
    a = p.parse_args()
    x, y = torch.zeros(4), torch.zeros(4)
    if not a.no_cpp:
        from torch.utils.cpp_extension import load_inline

        with tempfile.TemporaryDirectory() as build:
            load_inline("nnrand_probe_cpp", cpp_sources=[CPP], is_python_module=False, build_directory=build)
        us = per_call_us(lambda: torch.ops.nnrand_probe_cpp.noop(x, y, 3), a.calls, a.rounds)
        print(f"op from Python, C++ kernel      {us:6.2f} us")
    lib = torch.library.Library("nnrand_probe_py", "DEF")
    lib.define("noop(Tensor x, Tensor y, int k) -> Tensor")
    lib.impl("noop", lambda x, y, k: x, "CPU")
    us = per_call_us(lambda: torch.ops.nnrand_probe_py.noop(x, y, 3), a.calls, a.rounds)
    print(f"op from Python, Python kernel   {us:6.2f} us")

    leaf = torch.zeros(4, requires_grad=True)
    g = torch.ones(4)

    def step():
        torch.autograd.backward(torch.relu(leaf), g)

    native = per_call_us(step, a.calls, a.rounds)
    print(f"backward, native                {native:6.2f} us per relu step")
    original = torch.library.get_kernel("aten::threshold_backward", "CPU")
    over = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():   # "Overriding a previously registered kernel": the point here
        warnings.simplefilter("ignore", UserWarning)
        over.impl("threshold_backward", lambda keyset, *args, **kw: original.call_boxed(keyset, *args, **kw),
                  "CPU", with_keyset=True)
    try:
        routed = per_call_us(step, a.calls, a.rounds)
    finally:
        over._destroy()
    print(f"backward, Python kernel         {routed:6.2f} us per relu step (+{routed - native:.2f})")


if __name__ == "__main__":
    main()
