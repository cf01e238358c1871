"""nnrand.audit on the CPU: hash counting (with a nondeterministic fake as the negative control of a
deterministic one), deterministic-mode refusals and warnings, CSV and markdown rows matching what ran,
resume, re-rendering, errors naming the op, and global flags restored in every case."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

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
        assert r["nnrand_route"] == "routed" and r["nnrand_op"] == reg
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
    # an in-place twin (index_add_) runs its functional op's kernel: the functional entry covers it
    missing = [r.op for r in routing.ATEN_OPS
               if r.op not in atens and r.op.rstrip("_") not in atens and r.op != "cudnn_batch_norm_backward"]
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
