"""The registry, the CLI table, input-check helpers and that every .cu file compiles for sm_90."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import kernels
from kernels import registry
from kernels.runtime import KERNEL_DIR, KernelArgumentError, layout_of

CU_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def test_every_op_has_atomic_and_a_deterministic_variant():
    for op in kernels.ops():
        names = {v.name: v for v in kernels.variants(op)}
        assert "atomic" in names and not names["atomic"].deterministic, op
        assert any(v.deterministic for v in names.values()), op


def test_every_op_has_a_spec_and_its_cases_build():
    for op in kernels.ops():
        spec = kernels.spec(op)
        for case in spec.test_cases()[:2]:
            args, kwargs = spec.make_inputs(case, torch.device("cpu"))
            assert spec.reference(args, kwargs).dtype == torch.float64


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(KeyError, match="known ops: .*sum"):
        kernels.get("nope", "tree")
    with pytest.raises(KeyError, match="known variants: atomic, tree"):
        kernels.get("bias_grad", "fast")


def test_define_op_registers_spec_and_variants_in_order(monkeypatch):
    # a scratch copy of the tables, so the test op never leaks into the real registry
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    base = kernels.spec("sum")
    fields = {f: getattr(base, f) for f in ("make_inputs", "reference", "test_cases", "bench_cases", "peers",
                                            "bytes_moved")}
    cuda, cpu = kernels.get("sum", "tree").cuda, kernels.get("sum", "tree").cpu
    spec = registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t"),
                                                   ("atomic", False, False, cuda, cpu, "a")], **fields)
    assert kernels.spec("scratch") is spec and spec.op == "scratch"
    registry.define_op("scratch", variants=[("extra", True, True, cuda, cpu, "e")], cpu_bitexact=False)
    assert [(v.name, v.cpu_bitexact) for v in kernels.variants("scratch")] == \
        [("tree", True), ("atomic", True), ("extra", False)]
    with pytest.raises(KeyError, match="no op spec for 'nope'"):
        registry.define_op("nope", variants=[("tree", True, False, cuda, cpu, "t")])
    assert "nope" not in kernels.ops()
    with pytest.raises(ValueError, match="scratch/tree is registered twice"):
        registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t")])


def test_cli_prints_every_variant():
    out = subprocess.run([sys.executable, "-m", "kernels"], capture_output=True, text=True, check=True).stdout
    for v in kernels.variants():
        assert any(line.split()[:2] == [v.op, v.name] for line in out.splitlines()), v.key


def test_layout_errors_name_the_argument():
    assert layout_of("op", "x", torch.zeros(2, 3, 4, 5)) == "nchw"
    assert layout_of("op", "x", torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)) == "channels_last"
    with pytest.raises(KernelArgumentError, match="^op: argument 'x': layout channels_last is not supported"):
        layout_of("op", "x", torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), allow=("nchw",))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("source", CU_FILES)
def test_cu_file_compiles_for_sm90(source, tmp_path):
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", f"-I{KERNEL_DIR}", "-c", "-o", str(tmp_path / "k.o"), str(KERNEL_DIR / source)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr


class _FakeDriver:
    """Stands in for cupy.cuda.driver: keeps what one launch passed, parameters read back from their slots."""

    def __init__(self):
        self.calls = []

    def launchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        import ctypes

        n = 4  # the test kernels below take four parameters
        addresses = (ctypes.c_uint64 * n).from_address(params)
        values = [ctypes.c_int64.from_address(a).value for a in addresses]
        self.calls.append(((f, gx, gy, gz, bx, by, bz, shared, stream, extra), values))


@pytest.mark.parametrize("grid, block, dims", [((7,), (256,), (7, 1, 1, 256, 1, 1)),
                                                ((3, 5), (32, 8), (3, 5, 1, 32, 8, 1)),
                                                ((2, 3, 4), (8, 4, 2), (2, 3, 4, 8, 4, 2))])
def test_launch_passes_dims_stream_and_parameter_slots(monkeypatch, grid, block, dims):
    # runtime.launch without a GPU: the driver and torch's device/stream queries replaced, so what reaches
    # cuLaunchKernel can be read back: 1-3 dims padded with 1, torch's raw stream, one 8-byte slot per
    # argument holding ints and NumPy integers alike (a negative 32-bit value reads back from the low bytes)
    from kernels import runtime

    fake = _FakeDriver()
    monkeypatch.setattr(runtime, "_DRIVER", fake)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0xABC0 + index, raising=False)

    class Fn:
        ptr = 0x1234

    args = (2**40 + 8, np.int64(-5), np.int32(-7), np.uint64(2**62))
    runtime.launch(Fn, grid, block, args, device=torch.device("cuda", 0), shared_mem=np.int64(48))
    (call, values), = fake.calls
    assert call == (0x1234, *dims, 48, 0xABC0, 0)
    assert values == [2**40 + 8, -5, -7, 2**62]
