"""Can this machine build a C++ extension against torch, and what does a backward op cost when the dispatcher
reaches a C++ kernel rather than a Python one? The question behind routing's host cost: every routed aten op
is a Python kernel (torch.library), and autograd calls it from its own thread for each backward node.

    python bench/dev/cpp_kernel_probe.py [--device cuda] [--nodes 42] [--reps 50]

It builds (torch.utils.cpp_extension.load_inline, timed) a small library ``nnrand_probe``: an op ``twice``
whose autograd node (C++) calls the op ``twice_backward``, whose kernel (C++, at the device's key) returns
``2 * g``. Then, on a chain of --nodes ``twice`` calls over a small tensor, it times the host side of
``backward()`` (no synchronisation inside; median over --reps) three ways:
  * ``c++``: the C++ kernel;
  * ``python``: the same op's kernel overridden by a Python function doing the same (torch.library, as the
    routing registers its overrides): the dispatcher's trip into Python and back, plus one aten call;
  * ``python boxed``: a Python override that calls the C++ kernel it replaced through
    ``torch.library.get_kernel(...).call_boxed`` (what the routing does for a configuration it passes on);
  * ``c++ again``: the override removed (the C++ kernel is back), to show the order did not decide.
The difference per node is what a routed op pays before any work of its own.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

SOURCE = r"""
#include <torch/library.h>
#include <torch/autograd.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

at::Tensor twice_backward_kernel(const at::Tensor& g) { return g * 2; }

class Twice : public torch::autograd::Function<Twice> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("nnrand_probe::twice_backward", "")
                         .typed<at::Tensor(const at::Tensor&)>();
    return {op.call(grads[0])};
  }
};

at::Tensor twice(const at::Tensor& x) { return Twice::apply(x); }

}  // namespace

TORCH_LIBRARY(nnrand_probe, m) {
  m.def("twice(Tensor x) -> Tensor");
  m.def("twice_backward(Tensor g) -> Tensor");
}
TORCH_LIBRARY_IMPL(nnrand_probe, Autograd, m) { m.impl("twice", twice); }
TORCH_LIBRARY_IMPL(nnrand_probe, CPU, m) { m.impl("twice_backward", twice_backward_kernel); }
TORCH_LIBRARY_IMPL(nnrand_probe, CUDA, m) { m.impl("twice_backward", twice_backward_kernel); }
"""


def build() -> float:
    """Build and load the library; returns the seconds it took."""
    from torch.utils.cpp_extension import load_inline

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        load_inline(name="nnrand_probe", cpp_sources=[SOURCE], is_python_module=False, build_directory=tmp,
                    extra_cflags=["-O2"])
    return time.perf_counter() - t0


def chain_loss(x: torch.Tensor, nodes: int) -> torch.Tensor:
    """``nodes`` ``twice`` calls on ``x``, summed: a backward pass of ``nodes`` ``twice_backward`` calls."""
    for _ in range(nodes):
        x = torch.ops.nnrand_probe.twice(x)
    return x.sum()


def backward_host_ms(x: torch.Tensor, nodes: int, reps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    for i in range(reps + 5):
        loss = chain_loss(x, nodes)
        sync()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        sync()
        x.grad = None
        if i >= 5:
            times.append((t1 - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nodes", type=int, default=42, help="backward nodes per pass (a ResNet-20 step routes 42)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    seconds = build()
    print(f"built and loaded the C++ library in {seconds:.1f} s (torch {torch.__version__})")
    dev = torch.device(args.device)
    x = torch.randn(1024, device=dev, requires_grad=True)
    want = torch.full_like(x, 2.0 ** args.nodes)
    key = dev.type.upper()
    rows = [("c++", backward_host_ms(x, args.nodes, args.reps))]
    original = torch.library.get_kernel("nnrand_probe::twice_backward", key)
    overrides = {"python": (lambda keyset, g: g * 2),
                 "python boxed": (lambda keyset, g: original.call_boxed(keyset, g))}
    for name, fn in overrides.items():
        lib = torch.library.Library("nnrand_probe", "IMPL")
        with warnings.catch_warnings():   # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("twice_backward", fn, key, with_keyset=True)
        try:
            rows.append((name, backward_host_ms(x, args.nodes, args.reps)))
            chain_loss(x, args.nodes).backward()
            assert torch.equal(x.grad, want), f"the {name} kernel's gradient is wrong"
            x.grad = None
        finally:
            lib._destroy()
    rows.append(("c++ again", backward_host_ms(x, args.nodes, args.reps)))
    print(f"{dev.type}, {args.nodes} backward nodes, host ms per backward() (median of {args.reps}):")
    for name, ms in rows:
        print(f"  {name:<13} {ms:8.3f} ms  ({1e3 * ms / args.nodes:6.1f} us per node)")
    base = (rows[0][1] + rows[-1][1]) / 2
    for name, ms in rows[1:-1]:
        print(f"{name} kernel over c++: {1e3 * (ms - base) / args.nodes:.1f} us per node")


if __name__ == "__main__":
    main()
