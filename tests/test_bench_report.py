"""The result table's derived metrics and the markdown report, on synthetic tables (nothing is run)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from bench import report, results

FP = {"gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "cudnn": "91900", "torch": "2.11.0",
      "cupy": "14.2.0", "numba": "0.68", "numpy": "2.3", "python": "3.12", "cpu": "x86", "host": "box",
      "git_sha": "abc123", "date": "2026-11-21T12:00:00Z"}


def subject_rows(op, case, variant, kind, latency, *, distinct=1, n=100, det=None, err=1e-6, contention=math.nan,
                 case_bytes=4e6, backend="cuda", max_ulp=None):
    base = {"op": op, "variant": variant, "kind": kind, "case": case, "params": "{}", "layout": "nchw",
            "contention": contention, "case_bytes": case_bytes, "case_flops": math.nan,
            "deterministic": "" if det is None else det, "mode": "fast", "backend": backend, "scale": "gpu",
            "repeats": math.nan, "note": "", **FP}
    m = {"latency": latency, "latency_host": latency * 1.5, "bandwidth": case_bytes / latency,
         "distinct_results": distinct, "frac_runs_differ": 0.0 if distinct == 1 else 0.5,
         "max_abs_diff": 0.0 if distinct == 1 else 1e-7,
         "max_ulp": (0.0 if distinct == 1 else 3.0) if max_ulp is None else max_ulp,
         "frac_elements_differ": 0.0 if distinct == 1 else 0.25, "err_max_abs": err, "err_rel_l2": err / 10}
    return [{**base, "metric": k, "value": v, "unit": results.UNITS[k],
             "repeats": n if k in ("distinct_results", "frac_runs_differ", "max_abs_diff", "max_ulp",
                                   "frac_elements_differ") else math.nan} for k, v in m.items()]


def ceiling_rows(backend="cuda"):
    base = {"op": "", "kind": "ceiling", "case": "", "params": "", "layout": "", "deterministic": "", "mode": "",
            "backend": backend, "scale": "gpu", "note": "copy", **FP}
    return [{**base, "variant": "copy", "metric": "bandwidth", "value": 4e12, "unit": "B/s"},
            {**base, "variant": "matmul", "metric": "flop_rate", "value": 5e13, "unit": "FLOP/s", "note": "mm"}]


def toy_table(backend="cuda"):
    rows = ceiling_rows(backend)
    for case, scale in (("small", 1.0), ("large", 10.0)):
        rows += subject_rows("toy", case, "atomic", "variant", 10e-6 * scale, distinct=7, det=False, backend=backend)
        rows += subject_rows("toy", case, "tree", "variant", 12e-6 * scale, det=True, backend=backend)
        rows += subject_rows("toy", case, "torch", "peer", 8e-6 * scale, backend=backend)
        rows += subject_rows("toy", case, "torch_deterministic", "peer", 16e-6 * scale, det=True, backend=backend)
    return results.frame(rows)


def metric(df, op, case, variant, name):
    sel = df[(df["op"] == op) & (df["case"] == case) & (df["variant"] == variant) & (df["metric"] == name)]
    assert len(sel) <= 1
    return float(sel["value"].iloc[0]) if len(sel) else None


# --------------------------------------------------------------------------------------------------
# derive


def test_derive_ratios_and_ceiling_fractions():
    df = results.derive(toy_table())
    # each ratio is one division of the table's own values: the same operations here give the same bits
    assert metric(df, "toy", "small", "tree", "ratio_atomic") == 12e-6 / 10e-6
    assert metric(df, "toy", "small", "atomic", "ratio_atomic") == 1.0
    assert metric(df, "toy", "large", "tree", "ratio_fastest_peer") == (12e-6 * 10.0) / (8e-6 * 10.0)
    assert metric(df, "toy", "large", "torch", "ratio_fastest_peer") == 1.0
    assert metric(df, "toy", "small", "atomic", "bandwidth_frac") == 4e6 / 10e-6 / 4e12
    again = results.derive(df)  # idempotent: derived rows are replaced, not duplicated
    assert len(again) == len(df)


def test_derive_tied_peers_pick_one_fastest():
    rows = subject_rows("tie", "c", "atomic", "variant", 2e-6, det=False)
    rows += subject_rows("tie", "c", "torch", "peer", 1e-6)
    rows += subject_rows("tie", "c", "cupy", "peer", 1e-6)
    df = results.derive(results.frame(rows))
    assert metric(df, "tie", "c", "atomic", "ratio_fastest_peer") == 2.0
    assert metric(df, "tie", "c", "torch", "ratio_fastest_peer") == 1.0
    assert metric(df, "tie", "c", "cupy", "ratio_fastest_peer") == 1.0


def test_derive_without_peer_or_atomic_twin_adds_no_ratio():
    rows = subject_rows("nopeer", "c", "atomic", "variant", 2e-6, det=False)
    rows += subject_rows("nopeer", "c", "tree", "variant", 3e-6, det=True)
    rows += subject_rows("notwin", "c", "tree", "variant", 3e-6, det=True)
    rows += subject_rows("notwin", "c", "torch", "peer", 1e-6)
    df = results.derive(results.frame(rows))  # no ceiling rows either
    assert metric(df, "nopeer", "c", "tree", "ratio_fastest_peer") is None
    assert metric(df, "nopeer", "c", "tree", "ratio_atomic") == 1.5
    assert metric(df, "notwin", "c", "tree", "ratio_atomic") is None
    assert metric(df, "notwin", "c", "tree", "ratio_fastest_peer") == 3.0
    assert metric(df, "notwin", "c", "tree", "bandwidth_frac") is None


# --------------------------------------------------------------------------------------------------
# render


def test_report_first_screen_names_backend_and_nondeterministic_ops(tmp_path):
    md = report.render(toy_table(), tmp_path / "kernels.md", plots=False)
    head = md.split("## Per op")[0]
    assert "CUDA kernels" in head and "NVIDIA H200" in head and "cuDNN 91900" in head
    assert "Nondeterministic on this backend" in head and "**toy**" in head
    summary = [line for line in head.splitlines() if line.startswith("| toy ")]
    assert len(summary) == 1
    cells = [c.strip() for c in summary[0].strip("|").split("|")]
    assert cells[2] == "atomic (7/100)"
    assert cells[3] == "tree"
    assert cells[4] == "1.20x (1.20x–1.20x)"
    assert cells[5] == "1.50x (1.50x–1.50x)"
    assert cells[6] == "2.00x (2.00x–2.00x)"  # torch_deterministic / torch


def test_report_per_op_table_and_plots(tmp_path):
    out = tmp_path / "kernels.md"
    md = report.render(toy_table(), out)
    assert "![toy latency](kernels_toy_latency.png)" in md
    assert (tmp_path / "kernels_toy_latency.png").stat().st_size > 0
    assert "**7/100**" in md and "| 1/100 |" in md
    assert "| 10 µs |" in md and "| 100 µs |" in md
    # no contention cases in this table: no contention plot
    assert not (tmp_path / "kernels_toy_contention.png").exists()


def test_report_contention_plot(tmp_path):
    rows = []
    for c, d in ((1.0, 1), (8.0, 3), (64.0, 20)):
        rows += subject_rows("pool", f"c{c:g}", "atomic", "variant", 1e-5, distinct=d, det=False, contention=c)
        rows += subject_rows("pool", f"c{c:g}", "tree", "variant", 1e-5, det=True, contention=c)
    md = report.render(results.frame(rows), tmp_path / "r.md")
    assert "![pool contention](r_pool_contention.png)" in md
    assert (tmp_path / "r_pool_contention.png").stat().st_size > 0


def test_report_missing_peer_and_missing_atomic_twin_show_dashes(tmp_path):
    rows = subject_rows("nopeer", "c", "atomic", "variant", 2e-6, distinct=2, det=False)
    rows += subject_rows("nopeer", "c", "tree", "variant", 3e-6, det=True)
    rows += subject_rows("notwin", "c", "tree", "variant", 3e-6, det=True)
    rows += subject_rows("notwin", "c", "torch", "peer", 1e-6)
    md = report.render(results.frame(rows), tmp_path / "r.md", plots=False)
    line = {l.split("|")[1].strip(): [c.strip() for c in l.strip("|").split("|")]
            for l in md.splitlines() if l.startswith("| nopeer ") or l.startswith("| notwin ")}
    assert line["nopeer"][4] == "1.50x" and line["nopeer"][5] == report.DASH  # one case: no range
    assert line["notwin"][3] == "tree" and line["notwin"][4] == report.DASH
    assert line["notwin"][5] == "3.00x"
    assert "Deterministic everywhere measured: notwin" in md


def test_report_single_repeat_nan_results_and_skips(tmp_path):
    rows = subject_rows("odd", "c", "atomic", "variant", 1e-6, n=1, det=False, err=math.nan, max_ulp=math.nan)
    rows += subject_rows("odd", "c", "tree", "variant", 1e-6, det=True, distinct=2)  # claims determinism, varied
    skip = {**rows[0], "variant": "cupy", "kind": "peer", "metric": "skipped", "value": math.nan, "unit": "",
            "note": "ImportError: no module named cupy"}
    nospec = {**rows[0], "op": "lonely", "variant": "", "kind": "", "case": "", "metric": "skipped",
              "value": math.nan, "note": "op 'lonely' has variants but no op spec"}
    md = report.render(results.frame(rows + [skip, nospec]), tmp_path / "r.md", plots=False)
    atomic = next(l for l in md.splitlines() if "| atomic |" in l)
    cells = [c.strip() for c in atomic.strip("|").split("|")]
    assert "1/1" in cells and "NaN" in cells
    assert "Claimed deterministic but varied" in md and "odd / tree" in md
    summary = next(l for l in md.splitlines() if l.startswith("| odd "))
    assert "claimed-deterministic subject varied: tree; 1 skipped" in summary
    assert "cupy: ImportError: no module named cupy" in md
    assert "lonely: op 'lonely' has variants but no op spec" in md


def test_report_cpu_backend_is_said_plainly(tmp_path):
    md = report.render(toy_table(backend="cpu"), tmp_path / "r.md", plots=False)
    assert "CPU order models" in md.split("## Summary")[0] and "no GPU was used" in md


def test_csv_roundtrip_and_cli_render_the_same(tmp_path):
    df = results.derive(toy_table())
    csv = results.write(df, tmp_path / "results" / "t.csv")
    back = results.read(csv)
    assert list(back.columns) == list(df.columns) and len(back) == len(df)
    direct = report.render(df, tmp_path / "a.md", plots=False)
    via_csv = report.render(back, tmp_path / "a.md", plots=False)
    assert direct == via_csv
    out = tmp_path / "cli.md"
    subprocess.run([sys.executable, "-m", "bench.report", "--csv", str(csv), "--out", str(out), "--no-plots"], check=True,
                   capture_output=True)
    assert out.read_text().startswith("# Kernel benchmarks")


@pytest.mark.parametrize("sha", ["7975e94", "1234567", "0e10"])
def test_fingerprint_columns_read_back_as_text(tmp_path, sha):
    """A SHA pandas would parse as a number (digits with one "e", or all digits) comes back verbatim."""
    df = results.derive(toy_table())
    df["git_sha"] = sha
    back = results.read(results.write(df, tmp_path / "t.csv"))
    assert (back["git_sha"] == sha).all() and (back["cudnn"] == "91900").all()
    assert f"git `{sha}`" in report.render(back, tmp_path / "r.md", plots=False)


def test_paths_keep_cpu_results_apart(monkeypatch):
    monkeypatch.delenv("NNRAND_BENCH_STEM", raising=False)
    assert results.stem("cuda") == "kernels" and results.stem("cuda", quick=True) == "kernels_quick"
    assert results.stem("cpu") == results.stem("cpu", quick=True) == "kernels_cpu"
    assert results.stem("cuda", partial=True) == "kernels_partial"
    assert results.stem("cpu", partial=True) == "kernels_cpu_partial"
    assert results.csv_path("kernels_cpu").name == "kernels_cpu.csv"
    assert results.report_path("kernels").name == "kernels.md"


def test_only_ops_measured_more_than_once_are_called_deterministic():
    """"Deterministic everywhere measured" needs distinct-result rows of two repeats or more: an op with
    nothing measured, or measured once, is not claimed."""
    import pandas as pd

    w = pd.DataFrame({"op": ["a", "a", "b", "c"], "distinct_results": [1, 1, 1, math.nan], "n": [30, 30, 1, 30]})
    assert report._repeated(w, "a") and not report._repeated(w, "b") and not report._repeated(w, "c")
    assert not report._repeated(w, "d")


def _summary_cells(md: str, op: str) -> list[str]:
    head = md.split("## Per op")[0]
    (line,) = [x for x in head.splitlines() if x.startswith(f"| {op} ")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_best_variant_held_one_result_and_ran_every_case(tmp_path):
    """The best deterministic variant is one that gave one result wherever it ran (a claimed-deterministic
    variant that varied is not a candidate, however fast), and that ran every case: one that failed on
    the slow cases is not ranked on the fast one it kept."""
    rows = ceiling_rows()
    for case, scale in (("a", 1.0), ("b", 10.0), ("c", 100.0)):
        rows += subject_rows("toyop", case, "atomic", "variant", 10e-6 * scale, distinct=7, det=False)
        rows += subject_rows("toyop", case, "tree", "variant", 9e-6 * scale, det=True)
        rows += subject_rows("toyop", case, "fastbuggy", "variant", 5e-6 * scale, distinct=4, det=True)
    rows += subject_rows("toyop", "a", "fixed", "variant", 8e-6, det=True)   # failed on b and c
    cells = _summary_cells(report.render(results.frame(rows), tmp_path / "k.md", plots=False), "toyop")
    assert cells[3] == "tree" and cells[4] == "0.90x (0.90x–0.90x)"
    assert "claimed-deterministic subject varied: fastbuggy" in cells[7]


def test_single_runs_are_not_called_free_of_variation(tmp_path):
    rows = ceiling_rows()
    rows += subject_rows("one", "a", "atomic", "variant", 10e-6, det=False, n=1)
    rows += subject_rows("one", "a", "tree", "variant", 9e-6, det=True, n=1)
    md = report.render(results.frame(rows), tmp_path / "k.md", plots=False)
    assert _summary_cells(md, "one")[2] == "not repeated"
    assert "some were measured only once" in md and "No subject gave more than one distinct result on this backend.\n" not in md


def test_small_nonzero_shares_are_not_printed_as_zero():
    assert report.fmt_pct(0.00021929) == "<1%" and report.fmt_pct(0.0) == "0%" and report.fmt_pct(0.25) == "25%"
    assert report.fmt_pct(0.006) == "1%" and report.fmt_pct(math.nan) == report.DASH
