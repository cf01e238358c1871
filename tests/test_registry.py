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


@pytest.fixture
def scratch():
    """(spec fields, CUDA launcher, CPU model) borrowed from sum, on a scratch copy of the registry's tables
    (monkeypatched), so a test op never leaks into the real registry."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        mp.setattr(registry, "_SPECS", dict(registry._SPECS))
        base = kernels.spec("sum")
        fields = {f: getattr(base, f) for f in ("make_inputs", "reference", "test_cases", "bench_cases", "peers",
                                                "bytes_moved")}
        yield fields, kernels.get("sum", "tree").cuda, kernels.get("sum", "tree").cpu


def test_define_op_registers_spec_and_variants_in_order(scratch):
    fields, cuda, cpu = scratch
    spec = registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t"),
                                                   ("atomic", False, False, cuda, cpu, "a")], **fields)
    assert kernels.spec("scratch") is spec and spec.op == "scratch"
    registry.define_op("scratch", variants=[("extra", True, True, cuda, cpu, "e")], cpu_bitexact=False)
    assert [(v.name, v.cpu_bitexact) for v in kernels.variants("scratch")] == \
        [("tree", True), ("atomic", True), ("extra", False)]
    with pytest.raises(KeyError, match="no op spec for 'nope'"):
        registry.define_op("nope", variants=[("tree", True, False, cuda, cpu, "t")])
    assert "nope" not in kernels.ops()
    with pytest.raises(ValueError, match="scratch: registered twice \\(tree\\)"):
        registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t")])


def test_define_op_refuses_before_registering_anything(scratch):
    """A duplicate variant name, a benchmark argument for an unknown variant or a second registration is
    refused before anything is added: the registry is as it was."""
    fields, cuda, cpu = scratch
    before = (dict(registry._REGISTRY), dict(registry._SPECS))
    with pytest.raises(ValueError, match="given twice"):
        registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t"),
                                                ("tree", True, False, cuda, cpu, "t")], **fields)
    with pytest.raises(ValueError, match=r"variant_bench_kwargs names unknown variants \['exakt'\]"):
        registry.define_op("scratch", variants=[("tree", True, False, cuda, cpu, "t")],
                           variant_bench_kwargs=(("exakt", (("check_range", False),)),), **fields)
    with pytest.raises(ValueError, match="sum: registered twice \\(its spec\\)"):
        registry.define_op("sum", variants=[("other", True, False, cuda, cpu, "o")], **fields)
    assert (registry._REGISTRY, registry._SPECS) == before


def test_keyword_tensors_choose_the_backend_and_are_widened():
    """Tensors given by keyword count like positional ones: a half call by keyword goes through the
    widening call (no IndexError for a missing args[0]) and gives the positional call's results; bfloat16
    beside float16 is refused naming both arguments, keywords by name."""
    g = torch.Generator().manual_seed(5)
    dy, x = (torch.randn(2, 3, 4, 4, generator=g).bfloat16() for _ in range(2))
    mean, invstd, w = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    tree = kernels.get("bn_bwd", "tree")
    by_position = tree(dy, x, mean, invstd, w)
    by_keyword = tree(dy=dy, x=x, mean=mean, invstd=invstd, weight=w)
    for a, b in zip(by_position, by_keyword):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert by_keyword[0].dtype == torch.bfloat16
    with pytest.raises(KernelArgumentError, match=r"bn_bwd: argument 'x': is torch.float16 while argument #0"):
        tree(dy, x=x.half(), mean=mean, invstd=invstd)


def test_halving_tree_needs_a_nonempty_power_of_two():
    from kernels.order import halving_tree

    assert halving_tree(np.arange(8, dtype=np.float32)) == 28
    for n in (0, 3, 6):
        with pytest.raises(ValueError, match=f"power-of-two length, got {n}"):
            halving_tree(np.ones(n, dtype=np.float32))


def test_sparse_tensors_are_refused_by_name_and_never_memoised():
    from kernels.runtime import check_key, check_tensor

    sp = torch.eye(3).to_sparse()
    with pytest.raises(KernelArgumentError, match="^op: argument 'src': expected a dense \\(strided\\) tensor"):
        check_tensor("op", "src", sp)
    assert check_key(sp, 1) is None
    assert check_key(torch.zeros(3, 3), 1) is not None


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


# Sources compiled per activation dtype (their launchers pass kernels/runtime.py act_defines: NNRAND_ACT 1
# bfloat16, 2 float16): those whose kernels read act_t (common.cuh)
HALF_SOURCES = [s for s in CU_FILES if "act_t" in (KERNEL_DIR / s).read_text()]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("act", [1, 2], ids=["bf16", "fp16"])
@pytest.mark.parametrize("source", HALF_SOURCES)
def test_half_builds_compile_for_sm90a(source, act, tmp_path):
    """Each half-precision build, device code only as NVRTC compiles it, for sm_90a (the target a 9.0 GPU
    gets where a source asks for arch-specific instructions: conv_mma's wgmma kernels)."""
    assert set(HALF_SOURCES) >= {"bn_bwd.cu", "conv_mma.cu", "maxpool_bwd.cu"}, HALF_SOURCES
    result = subprocess.run(
        ["nvcc", "-arch=sm_90a", "--cubin", f"-DNNRAND_ACT={act}", f"-I{KERNEL_DIR}", "-o", str(tmp_path / "k.cubin"),
         str(KERNEL_DIR / source)],
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


def _fake_driver(monkeypatch) -> _FakeDriver:
    """A :class:`_FakeDriver` in place of CuPy's, torch's current device 0 and raw stream 0xABC0 + index."""
    from kernels import runtime

    fake = _FakeDriver()
    monkeypatch.setattr(runtime, "_DRIVER", fake)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0xABC0 + index, raising=False)
    return fake


@pytest.mark.parametrize("grid, block, dims", [((7,), (256,), (7, 1, 1, 256, 1, 1)),
                                                ((3, 5), (32, 8), (3, 5, 1, 32, 8, 1)),
                                                ((2, 3, 4), (8, 4, 2), (2, 3, 4, 8, 4, 2))])
def test_launch_passes_dims_stream_and_parameter_slots(monkeypatch, grid, block, dims):
    # runtime.launch without a GPU: the driver and torch's device/stream queries replaced, so what reaches
    # cuLaunchKernel can be read back: 1-3 dims padded with 1, torch's raw stream, one 8-byte slot per
    # argument holding ints and NumPy integers alike (a negative 32-bit value reads back from the low bytes)
    from kernels import runtime

    fake = _fake_driver(monkeypatch)

    class Fn:
        ptr = 0x1234

    args = (2**40 + 8, np.int64(-5), np.int32(-7), np.uint64(2**62))
    runtime.launch(Fn, grid, block, args, device=torch.device("cuda", 0), shared_mem=np.int64(48))
    (call, values), = fake.calls
    assert call == (0x1234, *dims, 48, 0xABC0, 0)
    assert values == [2**40 + 8, -5, -7, 2**62]


def test_a_prepared_launch_fills_its_slots_per_call_and_keeps_the_rest(monkeypatch):
    # runtime.Launch without a GPU (as above): the arguments fixed at construction stay in their slots,
    # each call writes its SLOT values in order (calls do not leak into each other), and a call with the
    # wrong number of values is refused before anything launches
    from kernels import runtime

    fake = _fake_driver(monkeypatch)

    class Fn:
        ptr = 0x1234

    k = runtime.Launch(Fn, (3, 5), (32,), (runtime.SLOT, np.int32(-7), runtime.SLOT, np.int64(2**40)),
                       device=torch.device("cuda", 0), shared_mem=64)
    k(np.uint64(2**44), 11)   # what runtime.ptr gives
    k(2**45 + 16, np.int32(-3))
    assert [c for c, _ in fake.calls] == [(0x1234, 3, 5, 1, 32, 1, 1, 64, 0xABC0, 0)] * 2
    assert [v for _, v in fake.calls] == [[2**44, -7, 11, 2**40], [2**45 + 16, -7, -3, 2**40]]
    with pytest.raises(TypeError, match="2 per-call arguments expected, got 1"):
        k(5)
    assert len(fake.calls) == 2
    with pytest.raises(TypeError):   # None is not the per-call marker: an argument left unset is an error
        runtime.Launch(Fn, (1,), (32,), (None, 1), device=torch.device("cuda", 0))


def test_launch_of_shares_one_object_per_configuration(monkeypatch):
    # Launch.of: a configuration asked for again (the same kernel, dims however spelled, shared memory,
    # device, fixed arguments and their types) is the object made the first time; any difference makes
    # another, and each launches with its own fixed arguments
    from kernels import runtime

    fake = _fake_driver(monkeypatch)
    monkeypatch.setattr(runtime, "_LAUNCHES", {})

    class Fn:
        ptr = 0x55

    class Other:
        ptr = 0x56

    dev, S = torch.device("cuda", 0), runtime.SLOT
    a = runtime.Launch.of(Fn, (4,), (64,), (S, 3, S, 9), device=dev)
    assert runtime.Launch.of(Fn, (4, 1, 1), (64, 1), (S, 3, S, 9), device=dev) is a
    others = [runtime.Launch.of(Fn, (4,), (64,), (S, 4, S, 9), device=dev),
              runtime.Launch.of(Fn, (4, 2), (64,), (S, 3, S, 9), device=dev),
              runtime.Launch.of(Fn, (4,), (128,), (S, 3, S, 9), device=dev),
              runtime.Launch.of(Fn, (4,), (64,), (S, 3, S, 9), device=dev, shared_mem=1024),
              runtime.Launch.of(Fn, (4,), (64,), (S, 3, S, 9), device=torch.device("cuda", 1)),
              runtime.Launch.of(Fn, (4,), (64,), (S, np.int32(3), S, 9), device=dev),
              runtime.Launch.of(Other, (4,), (64,), (S, 3, S, 9), device=dev)]
    assert len({id(k) for k in [a, *others]}) == 1 + len(others)
    assert others[-1]._fn is Other and a._fn is Fn
    with pytest.raises(TypeError):   # a float equal to a kept integer argument is still refused
        runtime.Launch.of(Fn, (4,), (64,), (S, 3.0, S, 9), device=dev)
    a(10, 11)
    others[0](12, 13)
    assert [v for _, v in fake.calls] == [[10, 3, 11, 9], [12, 4, 13, 9]]


def test_a_failed_launch_names_the_kernel_and_its_dimensions(monkeypatch):
    from kernels import runtime

    class Refusing:
        def launchKernel(self, *a):
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    _fake_driver(monkeypatch)
    monkeypatch.setattr(runtime, "_DRIVER", Refusing())
    monkeypatch.setitem(runtime._NAMES, 0x99, "sum.cu:sum_tree")

    class Fn:
        ptr = 0x99

    with pytest.raises(RuntimeError, match=r"kernel sum.cu:sum_tree with grid \(70000, 1, 1\), block \(2048, 1, 1\), "
                                           r"0 bytes .*CUDA_ERROR_INVALID_VALUE"):
        runtime.launch(Fn, (70000,), (2048,), (), device=torch.device("cuda", 0))


@pytest.mark.gpu
def test_ticket_counters_keep_outgrown_buffers_and_captures_get_their_own():
    """A graph captured with a stream's counter buffer still replays right after that buffer was outgrown
    and memory churned (the outgrown buffer stays alive: a freed one could be handed to a tensor the
    replays then count in); a capture that finds no buffer large enough gets counters of its own, zeroed
    on every replay and never handed out again."""
    from kernels import runtime

    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    g = torch.Generator(device="cuda").manual_seed(11)
    dy = torch.randn(64, 256, 4, 4, device=dev, generator=g)
    x = torch.randn(64, 256, 4, 4, device=dev, generator=g)
    tree = kernels.get("conv_wgrad", "tree")   # its fused combine draws tickets (144 tiles of 64, 3 splits)
    with torch.cuda.stream(stream):
        want = tree(x, dy, kernel_size=3, padding=1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            got = tree(x, dy, kernel_size=3, padding=1)
        key = (torch.cuda.current_device(), stream.cuda_stream)
        used = runtime._TICKETS[key]
        runtime.ticket_counters(dev, used.numel() + 1)   # outgrown
        assert runtime._TICKETS[key].data_ptr() != used.data_ptr()
        assert any(r.data_ptr() == used.data_ptr() for r in runtime._RETIRED)
    del used
    churn = [torch.full((1 << k,), 7, dtype=torch.int32, device=dev) for k in range(8, 16) for _ in range(8)]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    del churn
    need = 1 << 22   # more than any buffer this process made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        raw = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
        captured = runtime.ticket_counters(dev, need)
        captured.add_(1)   # dirty it inside the graph: its zeroing must run first on every replay
    cached = runtime._TICKETS.get((torch.cuda.current_device(), raw))
    assert cached is None or cached.numel() < need
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert int(captured.max()) == 1 and int(captured.min()) == 1


def test_memo_check_remembers_valid_configurations_only():
    """A check memoised by memo_check runs once per valid configuration; a configuration it refuses is
    checked (and refused) every time; 1, 1.0 and True are different keys; an unhashable argument is
    checked in full every time."""
    from kernels.runtime import check_key, memo_check

    calls = []

    def check(t, k):
        calls.append(k)
        if k == 0:
            raise KernelArgumentError("op", "k", "must not be 0")
        return ("ok", k)

    cache: dict = {}
    t = torch.zeros(2, 3)
    assert memo_check(cache, check, t, 5) == ("ok", 5) and memo_check(cache, check, t, 5) == ("ok", 5)
    assert calls == [5]
    memo_check(cache, check, t.t(), 5)          # other strides: another configuration
    assert calls == [5, 5]
    for _ in range(2):
        with pytest.raises(KernelArgumentError, match="must not be 0"):
            memo_check(cache, check, t, 0)
    assert calls == [5, 5, 0, 0]
    assert len({check_key(1), check_key(1.0), check_key(True)}) == 3
    assert check_key([1]) is None
    for _ in range(2):
        memo_check(cache, check, t, [7])
    assert calls[-2:] == [[7], [7]]
