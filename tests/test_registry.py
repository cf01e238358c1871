"""The registry, the CLI table, input-check helpers and that every .cu file compiles for sm_90."""
from __future__ import annotations

import shutil
import subprocess
import sys

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
