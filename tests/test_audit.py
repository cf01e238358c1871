"""nnrand.audit on the CPU: hash counting (with a nondeterministic fake as the negative control of a
deterministic one), deterministic-mode refusals and warnings, CSV and markdown rows matching what ran,
resume, re-rendering, errors naming the op, and global flags restored in every case."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from nnrand import audit, routing
from nnrand.audit import Entry
from tests.helpers import bitwise_equal

# --------------------------------------------------------------------------------------------------
# Fakes


def _perm_sum_entry(name: str = "fake.perm_sum", *, seed: int = 7) -> Entry:
    """Sums 4096 float32 values of mixed magnitudes one at a time in an order drawn per call from a
    generator seeded once: a new order each call, so (float addition not being associative) results differ
    between calls, yet the test is reproducible."""
    rng = np.random.default_rng(seed)

    def forward(p):
        x = p["x"].numpy()[rng.permutation(p["x"].numel())]
        return torch.from_numpy(np.cumsum(x, dtype=np.float32)[-1:])  # one float32 addition at a time, in order

    return Entry(name, "fake", "fake_perm_sum", "4096 floats", lambda g: dict(x=torch.randn(4096, generator=g) *
                 torch.logspace(-3, 3, 4096)), forward)


def _seq_sum_entry(name: str = "fake.seq_sum") -> Entry:
    """The same sum in index order every call: the deterministic control."""
    return Entry(name, "fake", "fake_seq_sum", "4096 floats", lambda g: dict(x=torch.randn(4096, generator=g) *
                 torch.logspace(-3, 3, 4096)), lambda p: torch.from_numpy(np.cumsum(p["x"].numpy(), dtype=np.float32)[-1:]))


def _refusing_entry() -> Entry:
    """Runs by default; in deterministic mode raises as PyTorch's alerts do (torch has no Python binding
    of its alert), naming the op."""
    def forward(p):
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("fake_refusing_op does not have a deterministic implementation, but you set "
                               "'torch.use_deterministic_algorithms(True)'.\nSecond line.")
        return p["x"] * 2
    return Entry("fake.refuses", "fake", "fake_refusing_op", "8", lambda g: dict(x=torch.randn(8, generator=g)),
                 forward)


def _warning_entry() -> Entry:
    def forward(p):
        if torch.are_deterministic_algorithms_enabled():
            warnings.warn("fake_warning_op is not deterministic on this path", UserWarning)
        return p["x"] + 1
    return Entry("fake.warns", "fake", "fake_warning_op", "8", lambda g: dict(x=torch.randn(8, generator=g)), forward)


def _broken_entry(in_mode: str = "default") -> Entry:
    def forward(p):
        if in_mode == "default" or torch.are_deterministic_algorithms_enabled():
            raise ValueError("shape mismatch in the fake")
        return p["x"]
    return Entry(f"fake.broken_{in_mode}", "fake", "fake_broken_op", "8",
                 lambda g: dict(x=torch.randn(8, generator=g)), forward)


class _Counting:
    """Wraps an entry's forward to count its calls (resume must not call it again)."""

    def __init__(self, entry: Entry):
        self.calls = 0
        inner = entry.forward

        def forward(p):
            self.calls += 1
            return inner(p)
        self.entry = Entry(entry.name, entry.family, entry.aten, entry.shape, entry.make, forward, entry.grads,
                           entry.aten_backward, entry.flag, entry.seed)


def _quick(name: str) -> Entry:
    return next(e for e in audit.audit_entries("quick") if e.name == name)


@pytest.fixture(autouse=True)
def _flags_unchanged():
    before = audit.flag_state()
    yield
    assert audit.flag_state() == before, "a global torch flag or CUBLAS_WORKSPACE_CONFIG was left changed"


CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# Hashes


def test_splitmix64_matches_reference():
    def ref(i):
        z = ((i + 1) * 0x9E3779B97F4A7C15) & audit._MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & audit._MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & audit._MASK64
        return audit._s64(z ^ (z >> 31))
    i = torch.tensor([0, 1, 2, 12345, 2**40 + 7, 2**62], dtype=torch.int64)
    assert audit.splitmix64(i).tolist() == [ref(int(v)) for v in i]


def test_digest_sees_every_bit_and_only_the_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1023, generator=g)
    assert audit.digest(x) == audit.digest(x.clone())
    words = x.view(torch.int32)
    for i in (0, 511, 1022):
        y = x.clone()
        y.view(torch.int32)[i] = words[i] + 1  # one ULP
        assert audit.digest(y) != audit.digest(x), i
    # a change that cancels under the weights i + 1 (+2 ULP at 0, -1 ULP at 1) still changes the digest
    y = x.clone()
    y.view(torch.int32)[0] += 2
    y.view(torch.int32)[1] -= 1
    assert audit.digest(y) != audit.digest(x)
    # logical order, not storage order: a transposed view hashes as its contiguous copy
    m = torch.randn(33, 17, generator=g)
    assert audit.digest(m.t()) == audit.digest(m.t().contiguous())
    # dtype and shape are part of the name; tuples hash every member
    assert audit.digest(x.view(torch.int32)) != audit.digest(x)
    assert audit.digest(m.reshape(17, 33)) != audit.digest(m)
    assert audit.digest((x, m)) != audit.digest((x, m + 1))


def test_inputs_keep_their_layout_on_the_device():
    """A broadcast index (stride 0, as graph libraries pass it) and channels_last survive the move."""
    idx = torch.arange(6)[:, None].expand(6, 4)
    p = {"i": idx, "x": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), "k": 3}
    # the meta device stands in for a GPU: a plain .to() would materialise the broadcast there
    assert idx.to("meta").stride() == (4, 1)
    moved = audit._to_device(p, torch.device("meta"))
    assert moved["i"].stride() == (1, 0) and moved["i"].shape == idx.shape
    assert moved["x"].is_contiguous(memory_format=torch.channels_last) and moved["k"] == 3
    assert bitwise_equal(audit._to_device(p, CPU)["i"], idx)


def test_hash_counting_negative_control():
    """The permutation-order sum gives several distinct results; the same sum in index order gives one."""
    for entry, want_many in ((_perm_sum_entry(), True), (_seq_sum_entry(), False)):
        p = entry.make(torch.Generator().manual_seed(0))
        fn, _, _ = audit.phase_call(entry, "forward", p)
        m = audit.measure(fn, 12, CPU)
        assert (m.distinct > 1) == want_many, (entry.name, m.distinct)
        row = audit.audit_phase(entry, "forward", repeats=12, device=CPU)
        assert (int(row["default_distinct"]) > 1) == want_many
        assert (int(row["det_distinct"]) > 1) == want_many  # deterministic mode cannot fix a fake
        assert row["det_status"] == "runs"


# --------------------------------------------------------------------------------------------------
# Deterministic mode


def test_refusal_recorded_for_a_real_op_and_a_fake():
    unpool = _quick("max_unpool2d.segnet_2x2")  # raises in deterministic mode on every device
    row = audit.audit_phase(unpool, "forward", repeats=3, device=CPU)
    assert row["pytorch_flag"] == "raises"
    assert row["det_status"] == "raises" and "max_unpooling2d" in row["det_message"]
    assert int(row["default_distinct"]) == 1
    row = audit.audit_phase(_refusing_entry(), "forward", repeats=3, device=CPU)
    assert row["det_status"] == "raises" and "fake_refusing_op" in row["det_message"]
    assert "det_distinct" not in row


def test_warning_recorded():
    row = audit.audit_phase(_warning_entry(), "forward", repeats=3, device=CPU)
    assert row["det_status"] == "warns" and "fake_warning_op" in row["det_message"]
    assert int(row["det_distinct"]) == 1


def test_flags_restored_after_errors_inside_modes():
    before = audit.flag_state()
    with pytest.raises(ZeroDivisionError):
        with audit.torch_flags("deterministic"):
            assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
            1 / 0
    assert audit.flag_state() == before
    row = audit.audit_phase(_broken_entry("deterministic"), "forward", repeats=3, device=CPU)
    assert row["det_status"] == "error" and "fake.broken_deterministic" in row["det_message"]
    assert audit.flag_state() == before


# --------------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_op():
    entry = _broken_entry("default")
    row = audit.audit_phase(entry, "forward", repeats=3, device=CPU)
    assert "fake.broken_default" in row["error"] and "aten::fake_broken_op" in row["error"]
    assert "shape mismatch" in row["error"] and "default_distinct" not in row
    with pytest.raises(audit.AuditError, match=r"fake\.broken_default forward \(aten::fake_broken_op\)"):
        audit.audit_phase(entry, "forward", repeats=3, device=CPU, fail_fast=True)
    with pytest.raises(audit.AuditError, match="no_such_op"):
        audit.select(audit.audit_entries("quick"), "conv2d*,no_such_op")
    with pytest.raises(ValueError, match="repeats"):
        audit.run_audit([_seq_sum_entry()], repeats=1, csv_path="unused.csv", progress=False)


# --------------------------------------------------------------------------------------------------
# Files: CSV rows match what ran, markdown from the CSV, resume


def _run(entries, tmp_path, **kw):
    csv = tmp_path / "results" / "audit_cpu.csv"
    rows = audit.run_audit(entries, device="cpu", repeats=kw.pop("repeats", 4), scale="quick", csv_path=csv,
                           progress=False, **kw)
    return csv, tmp_path / "audit_cpu.md", rows


def test_run_writes_csv_and_markdown_matching_the_run(tmp_path):
    entries = [_quick("conv2d.r50_3x3_7px"), _quick("max_unpool2d.segnet_2x2"), _perm_sum_entry(), _seq_sum_entry(),
               _broken_entry()]
    csv, md, rows = _run(entries, tmp_path)
    saved = audit.read_rows(csv)
    want = [(e.name, ph) for e in entries for ph in e.phases()]
    assert [(r["entry"], r["phase"]) for r in saved] == want
    assert [(r["entry"], r["phase"]) for r in rows] == want
    sha = audit.envfp.git_sha()
    assert {r["git_sha"] for r in saved} == {sha} and {r["scale"] for r in saved} == {"quick"}
    assert {r["device"] for r in saved} == {audit.device_name(CPU)} and {r["repeats"] for r in saved} == {"4"}
    by = {(r["entry"], r["phase"]): r for r in saved}
    # the routed conv gradients ran nnrand's deterministic variants (CPU models) once per repeat
    for phase, reg in (("backward:dW", "conv_wgrad"), ("backward:dX", "conv_dgrad")):
        r = by["conv2d.r50_3x3_7px", phase]
        assert r["nnrand_route"] == f"routed {reg}/tree" and r["nnrand_op"] == reg
        assert kernels.get(reg, r["nnrand_variant"]).deterministic and r["nnrand_distinct"] == "1"
    assert by["conv2d.r50_3x3_7px", "forward"]["nnrand_op"] == ""
    assert int(by["fake.perm_sum", "forward"]["default_distinct"]) > 1
    assert by["fake.seq_sum", "forward"]["default_distinct"] == "1"
    assert by["max_unpool2d.segnet_2x2", "forward"]["det_status"] == "raises"
    assert "fake.broken_default" in by["fake.broken_default", "forward"]["error"]

    text = md.read_text()
    assert "Device: **cpu" in text and torch.__version__ in text and sha in text
    table = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert [tuple(c.strip().strip("`") for c in ln.split("|")[1:3]) for ln in table] == want
    # the summary is computed from these rows: the flagged op that was repeatable here, the unflagged one that was not
    summary = text.split("## Summary", 1)[1].split("## Results", 1)[0]
    assert "`max_unpool2d.segnet_2x2` forward" in summary and "`fake.perm_sum` forward" in summary
    assert "`fake.seq_sum`" not in summary


def test_resume_skips_done_rows_and_reruns_errors(tmp_path):
    counted = _Counting(_seq_sum_entry())
    csv, md, _ = _run([counted.entry, _broken_entry()], tmp_path)
    first = counted.calls
    assert first > 0
    before = csv.read_text()
    _, _, rows = _run([counted.entry, _broken_entry()], tmp_path)
    assert counted.calls == first, "a row already in the CSV was measured again"
    assert [r["entry"] for r in rows] == ["fake.broken_default"]  # rows with an error are retried
    assert csv.read_text().count("fake.seq_sum") == before.count("fake.seq_sum")
    _, _, rows = _run([counted.entry], tmp_path, rerun=True)
    assert counted.calls > first and len(audit.read_rows(csv)) == 2  # replaced, not appended


def test_render_reproduces_the_markdown(tmp_path):
    csv, md, _ = _run([_seq_sum_entry(), _refusing_entry()], tmp_path, repeats=3)
    text = md.read_text()
    md.unlink()
    assert audit.render(csv) == md and md.read_text() == text
    other = tmp_path / "again.md"
    assert audit.cli(["render", "--out", str(csv), "--md", str(other)]) == 0
    assert other.read_text() == text


def test_a_rerun_of_some_ops_at_a_new_commit_keeps_the_others_rows(tmp_path, monkeypatch):
    """The report shows each phase's latest row on the latest device and scale: an audit of one entry at
    another commit replaces that entry's row in the report, keeps the other entry's older one (the CSV
    keeps both of the first entry's), and the *git* column names each row's commit."""
    monkeypatch.setattr(audit.envfp, "git_sha", lambda: "aaaaaaa")
    csv, md, _ = _run([_seq_sum_entry(), _refusing_entry()], tmp_path, repeats=3)
    text = md.read_text()
    assert "git `aaaaaaa`;" in text and "git |" not in text
    monkeypatch.setattr(audit.envfp, "git_sha", lambda: "bbbbbbb")
    _, _, rows = _run([_seq_sum_entry()], tmp_path, repeats=3)
    assert [(r["entry"], r["git_sha"]) for r in rows] == [("fake.seq_sum", "bbbbbbb")]
    assert sorted((r["entry"], r["git_sha"]) for r in audit.read_rows(csv)) == [
        ("fake.refuses", "aaaaaaa"), ("fake.seq_sum", "aaaaaaa"), ("fake.seq_sum", "bbbbbbb")]
    text = md.read_text()
    assert "git `aaaaaaa` (1 row), `bbbbbbb` (1 row)" in text or "git `bbbbbbb` (1 row), `aaaaaaa` (1 row)" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert [(ln.split("|")[1].strip(), ln.split("|")[-2].strip()) for ln in table] == [
        ("`fake.seq_sum`", "`bbbbbbb`"), ("`fake.refuses`", "`aaaaaaa`")]
    md.unlink()
    assert audit.render(csv) == md and md.read_text() == text   # the CSV alone gives the same report
    # the date decides, not the CSV order: the older commit's row dated later is the one shown
    saved = audit.read_rows(csv)
    for r in saved:
        r["date"] = "2031-01-01T00:00:00Z" if r["git_sha"] == "aaaaaaa" else "2030-01-01T00:00:00Z"
    text = audit.render_markdown(saved)
    assert "git `aaaaaaa`;" in text and "git |" not in text   # both rows shown are the older commit's
    table = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(table) == 2 and "`fake.seq_sum`" in table[0] and "`fake.refuses`" in table[1]


def test_summary_is_computed_from_the_rows():
    def row(entry, flag, distinct, det="runs", det_distinct=1):
        return {"entry": entry, "phase": "forward", "pytorch_flag": flag, "repeats": "50",
                "default_distinct": str(distinct), "det_status": det,
                "det_distinct": "" if det == "raises" else str(det_distinct), "nnrand_distinct": ""}
    a = audit.summary([row("op.a", "raises", 1, "raises"), row("op.b", "", 7), row("op.c", "", 1)])
    assert "`op.a` forward" in a.split("nevertheless")[1] and "`op.b` forward (7 distinct)" in a
    b = audit.summary([row("op.a", "raises", 3, "raises"), row("op.b", "", 1), row("op.c", "det-alt", 1, det_distinct=2)])
    assert "No phase that PyTorch does not flag varied" in b and "`op.c` forward (2 distinct)" in b
    assert "`op.b`" not in b


# --------------------------------------------------------------------------------------------------
# The entry list


def test_entry_list_covers_pytorch_nnrand_and_registry():
    entries = audit.audit_entries("quick")
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    atens = {e.aten for e in entries} | {e.aten_backward for e in entries}
    missing = [u.op for u in routing.UNCOVERED_OPS if u.op not in atens]
    assert not missing, f"ops nnrand guards with no audit entry: {missing}"
    # an in-place twin (index_add_) runs its functional op's kernel: the functional entry covers it; the
    # batch_norm entries name the native ops, whose CUDA float32 twins are cuDNN's
    cudnn = ("cudnn_batch_norm", "cudnn_batch_norm_backward")
    missing = [r.op for r in routing.ATEN_OPS if r.op not in atens and r.op.rstrip("_") not in atens and r.op not in cudnn]
    assert not missing, f"ops nnrand routes with no audit entry: {missing}"
    named = {reg for reg, _ in audit.NNRAND_OPS.values()}
    assert set(kernels.ops()) <= named, f"registry ops the audit does not map: {set(kernels.ops()) - named}"
    families = {e.family for e in entries}
    phases = {(e.family, ph) for e in entries for ph in e.phases()}
    assert {k for k in audit.NNRAND_OPS if k not in phases} == set(), "NNRAND_OPS names a phase no entry has"
    assert families >= {"cumsum", "index_add", "scatter_add", "embedding", "sort", "softmax", "layer_norm"}
    assert [e.name for e in audit.audit_entries("full")] == names


def test_every_quick_entry_runs_once_on_the_cpu():
    """Each phase of each quick entry builds and runs once in default mode (no repeats)."""
    for e in audit.audit_entries("quick"):
        p = e.make(torch.Generator().manual_seed(e.seed))
        with audit.torch_flags("default"):
            for ph in e.phases():
                fn, _, _ = audit.phase_call(e, ph, p)
                assert audit._flat_outputs(fn()), (e.name, ph)


def test_cli_help_and_list(capsys):
    with pytest.raises(SystemExit) as ex:
        audit.cli(["--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--scale quick --repeats 5" in out
    assert audit.cli(["--list", "--device", "cpu", "--ops", "cumsum"]) == 0
    assert "cumsum.rows" in capsys.readouterr().out


def test_digest_sees_the_sign_of_8_byte_values():
    """A float64 sign flip (or -0.0 against +0.0) changes the top bit of a 64-bit word, which a product
    with an even weight wraps away: 8-byte values are hashed as two 4-byte halves."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, generator=g, dtype=torch.float64)
    for i in range(16):
        y = x.clone()
        y[i] = -y[i]
        assert audit.digest(y) != audit.digest(x), i
    assert audit.digest(torch.tensor([0.0], dtype=torch.float64)) != audit.digest(torch.tensor([-0.0],
                                                                                          dtype=torch.float64))


def test_deterministic_mode_fills_uninitialised_memory_as_pytorchs_default():
    from torch.utils import deterministic as det

    before = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        with audit.torch_flags("deterministic"):
            assert det.fill_uninitialized_memory is True
        assert det.fill_uninitialized_memory is False
    finally:
        det.fill_uninitialized_memory = before


def test_one_repeat_is_refused_everywhere(tmp_path, capsys):
    with pytest.raises(ValueError, match="at least 2"):
        audit.audit_phase(_seq_sum_entry(), "forward", repeats=1, device=CPU)
    for argv, said in ((["--repeats", "1", "--ops", "cumsum"], "at least 2"),
                       (["--ops", "nosuch", "--out", str(tmp_path / "a.csv")], "matches no audit entry"),
                       (["--ops", ",", "--out", str(tmp_path / "a.csv")], "names no op"),
                       (["render", "--out", str(tmp_path / "missing.csv")], "no audit results")):
        with pytest.raises(SystemExit) as e:
            audit.cli(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err, argv


def test_rows_of_other_repeats_are_measured_again_and_replaced(tmp_path):
    counted = _Counting(_seq_sum_entry())
    csv, _, _ = _run([counted.entry], tmp_path)
    first = counted.calls
    _run([counted.entry], tmp_path, repeats=3)   # the first run had 4
    rows = audit.read_rows(csv)
    assert counted.calls > first and len(rows) == 1 and rows[0]["repeats"] == "3"


# --------------------------------------------------------------------------------------------------
# Route: what use_kernels("tree") does with each phase


def _tree_coverage(entry: Entry, phase: str, device: str = "cpu") -> tuple[set[tuple[str, str]], bool]:
    """(routed (aten op, variant) pairs of the phase's own call, whether the guard refused) when the phase
    runs once on the device under use_kernels("tree", strict=False): the routed pairs counted by the call
    alone (a backward's, not its graph build's: CUDA's BatchNorm forward is routed too), the guard over the
    graph build and the call (it refuses at the build)."""
    guard_ops = {u.backward for u in routing.UNCOVERED_OPS}
    p = audit._to_device(entry.make(torch.Generator().manual_seed(entry.seed)), torch.device(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with routing.use_kernels("tree", strict=False) as ctx:
            fn, _, _ = audit.phase_call(entry, phase, p)
            built = ctx.coverage.as_dict()
            fn()
    counts = ctx.coverage.as_dict()
    routed = {(op, k) for op, c in counts.items() for k, n in c.items()
              if k not in (routing.ORIGINAL, routing.UNCOVERED) and n > built.get(op, {}).get(k, 0)}
    return routed, any(counts.get(op, {}).get(routing.UNCOVERED) for op in guard_ops)


def test_route_says_what_use_kernels_tree_does():
    """Every phase of every entry: the route column against what use_kernels("tree") counted when the phase
    ran under it. Routed ops that map to themselves, forward routes, grouped convs, the guard's routed_by and
    applies (a 1x1 adaptive pool is a mean)."""
    seen = set()
    for e in audit.audit_entries("quick"):
        for ph in e.phases():
            routed, guarded = _tree_coverage(e, ph)
            if e.family == "embedding_bag":   # torch's CPU kernels call index_add_ inside (the CUDA ones do not)
                routed = {(op, v) for op, v in routed if op != "index_add"}
            rt = audit.route(e, ph)
            if routed:
                assert len(routed) == 1 and rt.startswith("routed ") and rt.endswith("/" + next(iter(routed))[1]), \
                    (e.name, ph, rt, routed)
                seen.add(rt.split(" ")[1].split("/")[0])
            else:
                assert rt == ("guarded" if guarded else ""), (e.name, ph, rt, guarded)
    # every routed op is seen routed somewhere (registry names: bias_grad's BatchNorm half is bn_bwd), but
    # bn_fwd, whose aten op (cudnn_batch_norm) is CUDA's alone: these phases run on the CPU
    want = {reg for op in routing.ROUTED_OPS for reg in routing.REGISTRY_OPS.get(op, (op,))} - {"bn_fwd"}
    assert seen == want, want ^ seen
    q = {e.name: e for e in audit.audit_entries("quick")}
    assert audit.route(q["conv2d_grouped.resnext_g32"], "backward:dX") == "routed conv_dgrad_grouped/tree"
    assert audit.route(q["index_add.gnn"], "forward") == "routed index_add/sorted"
    assert audit.route(q["adaptive_avg_pool2d.pspnet_6x6"], "backward:dX") == "routed adaptive_avg_pool2d_bwd/tree"
    assert audit.route(q["adaptive_avg_pool2d.head_1x1"], "backward:dX") == ""
    assert audit.route(q["cross_entropy2d.seg_21cls"], "forward") == "guarded"
    assert audit.route(q["grid_sample.flow_warp"], "backward:dX") == "guarded"
    # the grid alone records a backward: grid_sampler_2d_backward runs (PyTorch refuses it), the guard sees it
    assert audit.route(q["grid_sample.flow_warp"], "backward:dGrid") == "guarded"
    # CUDA's BatchNorm forward is cuDNN's, whose NCHW call the routing takes (test below); the CPU's is not
    assert audit.route(q["batch_norm.r50_64ch"], "forward", "cuda") == "routed bn_fwd/tree"
    assert audit.route(q["batch_norm.r50_64ch"], "forward") == ""
    assert audit.route(q["batch_norm.r50_64ch_channels_last"], "forward", "cuda") == ""
    assert audit.route(q["batch_norm.r50_64ch"], "backward:dX,dW,dB", "cuda") == "routed bn_bwd/tree"


@pytest.mark.gpu
def test_route_on_cuda_says_what_use_kernels_tree_does_with_batch_norm():
    """The BatchNorm entries' phases on CUDA (cuDNN's forward and backward, routed as the route says; the
    channels_last forward kept by the routing), against what use_kernels("tree") counted."""
    for e in audit.audit_entries("quick"):
        if e.family != "batch_norm":
            continue
        for ph in e.phases():
            routed, guarded = _tree_coverage(e, ph, "cuda")
            rt = audit.route(e, ph, "cuda")
            if routed:
                assert len(routed) == 1 and rt.startswith("routed ") and rt.endswith("/" + next(iter(routed))[1]), \
                    (e.name, ph, rt, routed)
            else:
                assert rt == "" and not guarded, (e.name, ph, rt)


def test_a_row_names_the_aten_op_its_phase_dispatches_on_its_device(tmp_path):
    """The CSV's aten_op (and an error's message) name the op a phase dispatches on the row's device: on CUDA
    cuDNN's BatchNorm forward for an NCHW input, on the CPU (and for channels_last on CUDA) the native one; a
    backward phase its backward op."""
    nchw, nhwc = _quick("batch_norm.r50_64ch"), _quick("batch_norm.r50_64ch_channels_last")
    assert nchw.aten_on("forward", "cuda") == "cudnn_batch_norm"
    assert nchw.aten_on("forward", "cpu") == nhwc.aten_on("forward", "cuda") == "native_batch_norm"
    assert nchw.aten_on("backward:dX,dW,dB", "cuda") == "native_batch_norm_backward"
    assert "(aten::cudnn_batch_norm)" in audit._where(nchw, "forward", "cuda")
    csv, _, _ = _run([nchw], tmp_path, repeats=2)
    assert {r["phase"]: r["aten_op"] for r in audit.read_rows(csv)} == {
        "forward": "native_batch_norm", "backward:dX,dW,dB": "native_batch_norm_backward"}


def test_the_report_renders_the_route_of_the_rendering_code(tmp_path):
    """A row written with a stale route is rendered with the code's; PyTorch's refusal shows where nothing
    routes or guards the phase."""
    csv, md, _ = _run([_quick("conv2d_grouped.resnext_g32"), _quick("max_unpool2d.segnet_2x2")], tmp_path, repeats=2)
    rows = audit.read_rows(csv)
    for r in rows:
        r["nnrand_route"] = "stale"
    audit.runio.write_csv(csv, audit.COLUMNS, rows)
    audit.render(csv)
    text = md.read_text()
    table = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[5].strip()
             for ln in text.splitlines() if ln.startswith("| `")}
    assert table["`conv2d_grouped.resnext_g32`", "backward:dW"] == "routed `conv_wgrad_grouped/tree`"
    assert table["`conv2d_grouped.resnext_g32`", "forward"] == ""
    assert table["`max_unpool2d.segnet_2x2`", "forward"] == "guarded"


# --------------------------------------------------------------------------------------------------
# Deterministic mode judges a backward phase by its backward


def _unpool_with_grad() -> Entry:
    """max_unpool2d (its forward refuses deterministic mode on every device) with a gradient for its input,
    whose backward (a gather) does not refuse."""
    make = _quick("max_unpool2d.segnet_2x2").make
    return Entry("max_unpool2d.with_grad", "max_unpool2d", "max_unpool2d", "small", make,
                 lambda p: F.max_unpool2d(p["y"], p["idx"], 2, 2), {"dY": ("y",)}, "max_unpool2d_backward")


def test_a_forward_refusal_is_the_forward_rows_not_the_backwards():
    entry = _unpool_with_grad()
    fwd = audit.audit_phase(entry, "forward", repeats=2, device=CPU)
    assert fwd["det_status"] == "raises" and "max_unpooling2d" in fwd["det_message"]
    bwd = audit.audit_phase(entry, "backward:dY", repeats=2, device=CPU)
    assert bwd["det_status"] == "runs" and bwd["det_distinct"] == 1 and bwd["det_message"] == "", bwd
    assert bwd["det_hash"] == bwd["default_hash"]   # the same graph, the same gather

    class Refuses(torch.autograd.Function):   # a backward that refuses as PyTorch's alerts do
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            if torch.are_deterministic_algorithms_enabled():
                raise RuntimeError("fake_backward does not have a deterministic implementation, but you set "
                                   "'torch.use_deterministic_algorithms(True)'.")
            return g * 2

    e = Entry("fake.refusing_backward", "fake", "fake_op", "8", lambda g: dict(x=torch.randn(8, generator=g)),
              lambda p: Refuses.apply(p["x"]), {"dX": ("x",)}, "fake_op_backward")
    assert audit.audit_phase(e, "forward", repeats=2, device=CPU)["det_status"] == "runs"
    row = audit.audit_phase(e, "backward:dX", repeats=2, device=CPU)
    assert row["det_status"] == "raises" and "fake_backward" in row["det_message"]


# --------------------------------------------------------------------------------------------------
# PyTorch's documentation flags


def test_doc_flags_match_the_installed_torchs_documentation():
    """Every entry's flag against the bullets of this torch's torch.use_deterministic_algorithms docstring
    (a future torch that changes them fails here), and the checker catches a documentation that differs."""
    entries = audit.audit_entries("quick")
    assert audit.doc_flag_mismatches(entries) == []
    assert len(audit.documented_flags()) > 30   # the docstring parsed, not an empty match
    doc = torch.use_deterministic_algorithms.__doc__
    # negative controls: a doc that adds AdaptiveMaxPool3d to the raisers, and one that drops CTCLoss
    more = doc.replace("* :class:`torch.nn.AdaptiveMaxPool2d` when attempting to differentiate a CUDA tensor",
                       "* :class:`torch.nn.AdaptiveMaxPool2d` when attempting to differentiate a CUDA tensor\n"
                       "        * :class:`torch.nn.AdaptiveMaxPool3d` when attempting to differentiate a CUDA tensor")
    less = doc.replace("* :class:`torch.nn.CTCLoss` when attempting to differentiate a CUDA tensor", "")
    assert more != doc and less != doc
    assert [m.split(" ")[0] for m in audit.doc_flag_mismatches(entries, more)] == ["adaptive_max_pool3d.video_2x7x7"]
    assert [m.split(" ")[0] for m in audit.doc_flag_mismatches(entries, less)] == ["ctc_loss.speech"]


# --------------------------------------------------------------------------------------------------
# Resume: what a row was measured under


def test_rows_of_another_torch_or_thread_count_are_measured_again(tmp_path):
    counted = _Counting(_seq_sum_entry())
    csv, md, _ = _run([counted.entry], tmp_path)
    calls = counted.calls
    rows = audit.read_rows(csv)
    assert rows[0]["cpu_threads"] == str(torch.get_num_threads())
    assert rows[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    rows[0]["torch"] = "1.0.0"   # as a run under another torch wrote it
    audit.runio.write_csv(csv, audit.COLUMNS, rows)
    _run([counted.entry], tmp_path)
    rows = audit.read_rows(csv)
    assert counted.calls > calls and len(rows) == 1 and rows[0]["torch"] == torch.__version__
    assert "1.0.0" not in md.read_text() and torch.__version__ in md.read_text()
    calls = counted.calls
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        _run([counted.entry], tmp_path)
        assert counted.calls > calls and audit.read_rows(csv)[0]["cpu_threads"] == str(threads + 1)
        calls = counted.calls
        _run([counted.entry], tmp_path)
        assert counted.calls == calls   # same threads again: resumed
    finally:
        torch.set_num_threads(threads)


def test_mixed_settings_are_shown_per_row(tmp_path):
    """Rows of one report measured with other repeats: the header lists the mix, each row its own settings."""
    csv, md, _ = _run([_seq_sum_entry()], tmp_path, repeats=4)
    _run([_refusing_entry()], tmp_path, repeats=3)
    text = md.read_text()
    assert "4 repeats per mode" not in text and "repeats 4 (1 row), 3 (1 row)" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert table[0].endswith("| 4 repeats, cudnn.benchmark off |")
    assert table[1].endswith("| 3 repeats, cudnn.benchmark off |")
    assert "run 3 to 4 times each" in text
    csv2, md2, _ = _run([_seq_sum_entry()], tmp_path / "one", repeats=4)
    assert "4 repeats per mode" in md2.read_text() and "settings" not in md2.read_text().split("## Results")[1]


# --------------------------------------------------------------------------------------------------
# Two audits, one CSV


def test_two_audits_writing_one_csv_keep_each_others_rows(tmp_path):
    """An audit that writes its row while another is measuring (read the CSV before, writes after) keeps
    the other's row: each write re-reads and merges under the lock."""
    csv = tmp_path / "results" / "audit_cpu.csv"
    other = _seq_sum_entry("fake.other")
    done = []

    def forward(p):
        if not done:   # the other audit finishes a row in the middle of this one's measurement
            done.append(audit.run_audit([other], device="cpu", repeats=2, scale="quick", csv_path=csv,
                                        progress=False))
        return p["x"] * 2
    first = Entry("fake.first", "fake", "fake_op", "8", lambda g: dict(x=torch.randn(8, generator=g)), forward)
    audit.run_audit([first], device="cpu", repeats=2, scale="quick", csv_path=csv, progress=False)
    assert done and sorted(r["entry"] for r in audit.read_rows(csv)) == ["fake.first", "fake.other"]
    assert not audit.lock_path(csv).exists()


def test_the_csv_lock_is_exclusive(tmp_path):
    import fcntl

    csv = tmp_path / "a.csv"
    with audit.csv_lock(csv):
        fd = os.open(audit.lock_path(csv), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(audit.AuditError, match=r"\.a\.csv\.lock"):
            with audit.csv_lock(csv, timeout_s=0):
                pass
    assert not audit.lock_path(csv).exists()
    with audit.csv_lock(csv):   # free again
        pass


# --------------------------------------------------------------------------------------------------
# cuBLAS's workspace, the registry's per-variant arguments, errors rerun, CUDA timing, --device


def test_cublas_workspace_is_set_before_cuda_and_recorded(tmp_path, monkeypatch):
    """The CLI sets CUBLAS_WORKSPACE_CONFIG before anything touches CUDA (cuBLAS reads it once, at its first
    call), records it in every row, and puts the environment back."""
    saved = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)   # put back by hand: the flag fixture checks first
    seen = []

    def is_available():
        seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return False
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    csv = tmp_path / "results" / "audit_cpu.csv"
    try:
        assert audit.cli(["--ops", "cumsum", "--repeats", "2", "--out", str(csv), "--no-progress"]) == 0
        assert seen and seen[0] == ":4096:8"
        assert {r["cublas_workspace_config"] for r in audit.read_rows(csv)} == {":4096:8"}
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"   # the user's own value is kept and recorded
        audit.cli(["--ops", "cumsum", "--repeats", "2", "--out", str(csv), "--no-progress", "--rerun"])
        assert {r["cublas_workspace_config"] for r in audit.read_rows(csv)} == {":16:8"}
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        if saved is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved


def test_each_variant_gets_its_own_benchmark_arguments(monkeypatch):
    """sum's exact variant is timed without its range flag's read-back (variant_bench_kwargs); the other
    variants get none of it."""
    real = kernels.variants
    calls: dict[str, list[dict]] = {}

    class Spy:
        def __init__(self, v):
            self.v, self.name, self.deterministic = v, v.name, v.deterministic

        def __call__(self, *args, **kwargs):
            calls.setdefault(self.name, []).append(kwargs)
            return self.v(*args, **kwargs)
    monkeypatch.setattr(kernels, "variants", lambda op: [Spy(v) for v in real(op)])
    entry = _quick("sum.flat")
    p = entry.make(torch.Generator().manual_seed(entry.seed))
    row, _ = audit._nnrand(entry, "forward", p, 2, CPU, 1.0)
    assert row["nnrand_variant"] in calls and "atomic" not in calls
    assert calls["exact"] and all(kw == {"check_range": False} for kw in calls["exact"])
    assert calls["tree"] and all(kw == {} for kw in calls["tree"])


def test_rows_with_a_deterministic_mode_or_nnrand_error_are_measured_again(tmp_path, monkeypatch):
    broken = _Counting(_broken_entry("deterministic"))
    csv, _, _ = _run([broken.entry], tmp_path)
    assert audit.read_rows(csv)[0]["det_status"] == "error"
    calls = broken.calls
    _run([broken.entry], tmp_path)
    assert broken.calls > calls, "a row whose deterministic mode errored was taken as done"

    counted = _Counting(_seq_sum_entry())
    real = audit._nnrand

    def failing(*a, **kw):
        raise RuntimeError("no CUDA runtime in this fake")
    monkeypatch.setattr(audit, "_nnrand", failing)
    csv, md, _ = _run([counted.entry], tmp_path / "b")
    row = audit.read_rows(csv)[0]
    assert "no CUDA runtime in this fake" in row["nnrand_error"] and "fake.seq_sum forward" in row["nnrand_error"]
    assert "no CUDA runtime in this fake" in md.read_text()
    monkeypatch.setattr(audit, "_nnrand", real)
    calls = counted.calls
    _run([counted.entry], tmp_path / "b")
    assert counted.calls > calls and audit.read_rows(csv)[0]["nnrand_error"] == ""


class _FakeEvent:
    """A CUDA event on a counter clock. ``query`` of a call's start event says whether the GPU had reached
    that call when the host returned from queueing it: per attempt, the calls in ``_FakeEvent.reached``."""
    clock = 0
    reached: list[set[int]] = []
    attempt = -1
    records = 0   # records in this attempt: starts are the even ones

    def __init__(self, enable_timing=False):
        self.t = self.call = None

    def record(self):
        _FakeEvent.clock += 1
        self.t, self.call = _FakeEvent.clock, _FakeEvent.records // 2
        _FakeEvent.records += 1

    def query(self):
        return self.call in _FakeEvent.reached[_FakeEvent.attempt]

    def elapsed_time(self, end):
        return float(end.t - self.t)


@pytest.mark.parametrize("reached, spins, host", [([set()], 1, False), ([{0}, {4}, set()], 3, False),
                                                  ([{4}] * 4, 4, True)])
def test_cuda_times_retry_a_spin_the_gpu_outran(monkeypatch, reached, spins, host):
    """CPU stand-ins for CUDA's events and spin: where the GPU reached any call (the first, or only the
    last) before the host was done queueing it, the timing runs again with a spin twice as long, up to
    SPIN_DOUBLINGS times, then its times are flagged as possibly including host time."""
    cycles = []

    def sleep(n):
        cycles.append(n)
        _FakeEvent.attempt += 1
        _FakeEvent.records = 0
    monkeypatch.setattr(_FakeEvent, "reached", reached)
    monkeypatch.setattr(_FakeEvent, "attempt", -1)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    times, included = audit._cuda_times(lambda: None, 5, torch.device("cuda"))
    assert included is host and times == [1.0e-3] * 5
    assert cycles == [cycles[0] * 2**k for k in range(spins)] and cycles[0] == int(2e9 * audit.SPIN_S_PER_CALL * 5)
    monkeypatch.delattr(torch.cuda, "_sleep")
    monkeypatch.setattr(_FakeEvent, "records", 0)
    calls = []
    times, included = audit._cuda_times(lambda: calls.append(1), 2, torch.device("cuda"))
    assert included is True and len(calls) == 2   # no spin: timed once, unqueued


@pytest.mark.gpu
def test_cuda_times_flag_a_call_that_waits_for_the_gpu():
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev, generator=torch.Generator(dev).manual_seed(0))
    times, included = audit._cuda_times(lambda: x.mul_(1.0), 5, dev)
    assert not included and len(times) == 5
    _, included = audit._cuda_times(lambda: x.sum().item(), 5, dev)   # a host read-back: the spin cannot cover it
    assert included


def test_cli_refuses_devices_it_cannot_audit(tmp_path, capsys):
    out = str(tmp_path / "a.csv")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cases = [(["--device", "meta"], "cpu, cuda or cuda:N"), (["--device", "bogus"], "--device 'bogus'"),
             (["--device", f"cuda:{n}"], "not available" if not n else f"has {n} CUDA device")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    for argv, said in cases:
        with pytest.raises(SystemExit) as e:
            audit.cli([*argv, "--ops", "cumsum", "--out", out, "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "--device" in err, (argv, err)
    assert not (tmp_path / "a.csv").exists()
    with pytest.raises(ValueError, match="cpu or cuda"):
        audit.run_audit([_seq_sum_entry()], device="meta", repeats=2, csv_path=out, progress=False)
