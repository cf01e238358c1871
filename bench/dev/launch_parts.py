"""Host time of the pieces of one kernel launch (kernels.runtime.launch and the trace's fingerprint launch)
against cuLaunchKernel alone (through CuPy and through ctypes) and torch's own launch: mean host time per
call over 20000 calls after 200 warm-up calls, and the same with the device's time included.

    python3 bench/dev/launch_parts.py
"""
import ctypes, time, torch, numpy as np
from kernels import runtime
from nnrand import trace
from cupy.cuda import driver

def bench(name, f, n=20000):
    for _ in range(200):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:60s} {host:6.2f} us host, {(time.perf_counter() - t0) / n * 1e6:6.2f} with device", flush=True)

dev = torch.device("cuda", 0)
t = torch.randn(512, device=dev)
out = torch.zeros(3, dtype=torch.float64, device=dev)
st = trace._fp_state(0)
fn = st.one
args = (np.uint64(t.data_ptr()), np.int64(512), np.int64(512), *st.parts, np.uint64(out.data_ptr()))
slots, addresses = runtime._param_block(args)
addr = addresses.buffer_info()[0]
stream = torch._C._cuda_getCurrentRawStream(0)
bench("torch.cuda.current_device()", torch.cuda.current_device)
bench("torch._C._cuda_getDevice()", torch._C._cuda_getDevice)
bench("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
bench("runtime._param_block(args)", lambda: runtime._param_block(args))
bench("driver.launchKernel (params prebuilt)", lambda: driver.launchKernel(fn.ptr, 1, 1, 1, 256, 1, 1, 0, stream, addr, 0))
bench("fn.ptr", lambda: fn.ptr)
bench("runtime.launch", lambda: runtime.launch(fn, (1,), (256,), args, device=dev))
bench("trace._launch_fingerprint", lambda: trace._launch_fingerprint(t, out.data_ptr()))
outs = torch.zeros(62, 3, dtype=torch.float64, device=dev)
ts, ptrs = [t] * 62, [outs[i].data_ptr() for i in range(62)]
bench("trace._launch_fingerprints, 62 tensors (one launch)", lambda: trace._launch_fingerprints(ts, ptrs), n=2000)
bench("t.zero_() (torch launch)", lambda: t.zero_())
cuda = ctypes.CDLL("libcuda.so.1")
cu = cuda.cuLaunchKernel
cu.restype = ctypes.c_int
cu.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
f = int(fn.ptr)
bench("ctypes cuLaunchKernel (params prebuilt)", lambda: cu(f, 1, 1, 1, 256, 1, 1, 0, stream, addr, None))
try:
    cu2 = cuda.cuLaunchKernel
    bench("ctypes cuLaunchKernel no argtypes", lambda: cu2(ctypes.c_void_p(f), 1, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(stream), ctypes.c_void_p(addr), None))
except Exception as e:
    print("no-argtypes failed", e)
print("cuLaunchKernel rc", cu(f, 1, 1, 1, 256, 1, 1, 0, stream, addr, None))
import cupy
print("cupy", cupy.__version__)
