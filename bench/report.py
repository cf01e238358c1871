"""Render the kernel benchmark report from the result table alone (never reruns anything).

    python -m bench.report                          # the CUDA table if present, else the CPU one
    python -m bench.report --backend cuda           # reports/results/kernels.csv -> reports/kernels.md
    python -m bench.report --backend cpu            # reports/results/kernels_cpu.csv -> reports/kernels_cpu.md
    python -m bench.report --csv T.csv --out R.md   # any table, any destination

Plots (matplotlib, Agg) are written beside the markdown as ``<stem>_<op>_latency.png`` and
``<stem>_<op>_contention.png`` and linked from it.
"""
from __future__ import annotations

import argparse
import math
import pathlib

import numpy as np
import pandas as pd

from . import results

DASH = "–"


# --------------------------------------------------------------------------------------------------
# Formatting


def _isnan(x) -> bool:
    try:
        return x is None or math.isnan(float(x))
    except (TypeError, ValueError):
        return True


def fmt_time(s) -> str:
    if _isnan(s):
        return DASH
    s = float(s)
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_ratio(x) -> str:
    return DASH if _isnan(x) else f"{float(x):.2f}x"


def fmt_pct(x) -> str:
    """A share in percent; a nonzero share that rounds to 0% shows as "<1%" (some elements did differ)."""
    if _isnan(x):
        return DASH
    x = float(x)
    return "<1%" if 0 < x < 0.005 else f"{100 * x:.0f}%"


def fmt_err(x) -> str:
    """Errors are measured values: a NaN error means the result itself held NaN."""
    if x is None:
        return DASH
    x = float(x)
    if math.isnan(x):
        return "NaN"
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.2e}")


def fmt_ulp(x) -> str:
    if _isnan(x):
        return DASH
    x = float(x)
    return "inf" if math.isinf(x) else f"{x:.0f}"


def fmt_bytes_rate(x) -> str:
    return DASH if _isnan(x) else f"{float(x) / 1e9:.1f} GB/s"


def fmt_flops(x) -> str:
    return DASH if _isnan(x) else f"{float(x) / 1e12:.2f} TFLOP/s"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def geomean(xs) -> float:
    xs = [float(x) for x in xs if not _isnan(x) and float(x) > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else math.nan


def fmt_spread(xs) -> str:
    xs = [float(x) for x in xs if not _isnan(x)]
    if not xs:
        return DASH
    g = geomean(xs)
    if len(xs) == 1:
        return fmt_ratio(g)
    return f"{fmt_ratio(g)} ({fmt_ratio(min(xs))}–{fmt_ratio(max(xs))})"


# --------------------------------------------------------------------------------------------------
# The table, pivoted: one row per (op, case, kind, variant)


def _truthy(v) -> bool | None:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    s = str(v).strip().lower()
    return True if s in ("true", "1", "1.0") else False if s in ("false", "0", "0.0") else None


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """Measured subjects, one row each, metrics as columns (absent metric -> NaN)."""
    sub = df[df["kind"].isin(["variant", "peer"]) & ~df["metric"].isin(["skipped", "failed"])]
    keys = ["op", "case", "kind", "variant"]
    if sub.empty:
        return pd.DataFrame(columns=keys)
    values = sub.groupby(keys + ["metric"], sort=False)["value"].first().unstack("metric")
    meta_cols = ["layout", "contention", "case_bytes", "case_flops", "deterministic"]
    meta = sub.groupby(keys, sort=False)[meta_cols].first()
    rep = sub[sub["metric"] == "distinct_results"].groupby(keys, sort=False)["repeats"].first().rename("n")
    out = meta.join(values, how="left").join(rep, how="left").reset_index()
    out["deterministic"] = out["deterministic"].map(_truthy)
    return out


def _col(w: pd.DataFrame, name: str) -> pd.Series:
    return w[name] if name in w.columns else pd.Series(math.nan, index=w.index)


def _case_keys(w: pd.DataFrame) -> list[tuple]:
    """Each row's case as (case, layout): one case name may run in several layouts."""
    return list(zip(w["case"], w["layout"] if "layout" in w else [""] * len(w)))


def _repeated(w: pd.DataFrame, op: str) -> bool:
    """Whether ``op`` has measured distinct-result rows, each from at least two repeats (one run cannot
    show a second result)."""
    g = w[w["op"] == op]
    if g.empty or "distinct_results" not in g:
        return False
    d = _col(g, "distinct_results")
    n = _col(g, "n")[~d.isna()]
    return bool(len(n)) and bool((n >= 2).all())


def summary_rows(w: pd.DataFrame, ops: list[str], df: pd.DataFrame | None = None) -> tuple[list[list[str]], list[str]]:
    rows, nondet_ops = [], []
    for op in ops:
        notes = []
        if df is not None:
            for metric in ("failed", "skipped"):
                k = int(((df["op"] == op) & (df["metric"] == metric)).sum())
                if k:
                    notes.append(f"{k} {metric} (see below)")
        g = w[w["op"] == op]
        if g.empty:
            rows.append([op, "0", DASH, DASH, DASH, DASH, DASH, "; ".join(notes + ["nothing measured"])])
            continue
        distinct = _col(g, "distinct_results")
        varied = g[distinct > 1]
        if len(varied):
            nondet_ops.append(op)
        names = []
        for (kind, name), gg in varied.groupby(["kind", "variant"], sort=False):
            d = gg["distinct_results"].max()
            n = gg.loc[gg["distinct_results"].idxmax(), "n"]
            names.append(f"{name} ({int(d)}/{int(n) if not _isnan(n) else '?'})")
        det_vars = g[(g["kind"] == "variant") & (g["deterministic"] == True)]  # noqa: E712
        # a candidate must have held one result wherever it was measured, and is ranked only over the cases
        # every candidate has a ratio on (a variant that failed on the slow cases is not ranked on the rest)
        held = {name for name, gg in det_vars.groupby("variant", sort=False)
                if not (_col(gg, "distinct_results") > 1).any()}
        det_vars = det_vars[det_vars["variant"].isin(held)]
        best, best_ratio, shared = None, math.inf, None
        for column in ("ratio_atomic", "ratio_fastest_peer"):   # by the atomic twin where there is one
            per = {}
            for name, gg in det_vars.groupby("variant", sort=False):   # a case is (case, layout)
                keys = _case_keys(gg)
                r = pd.Series(_col(gg, column).to_numpy(dtype=float), index=pd.Index(keys, tupleize_cols=False))
                per[name] = r[r.notna()]
            every = set().union(*(set(r.index) for r in per.values())) if per else set()
            cases = every if any(set(r.index) >= every for r in per.values()) else None
            if cases is None:   # no candidate ran every case: compare them where all of them ran
                for r in per.values():
                    if len(r):
                        cases = set(r.index) if cases is None else cases & set(r.index)
            if cases:
                for name, r in per.items():
                    m = geomean(r[r.index.isin(list(cases))]) if set(cases) <= set(r.index) else math.nan
                    if not _isnan(m) and m < best_ratio:
                        best, best_ratio, shared = name, m, cases
            if best is not None:
                break
        if best is None and len(det_vars):
            best = det_vars["variant"].iloc[0]
        if best is not None:
            b = det_vars[det_vars["variant"] == best]
            vs_atomic, vs_peer = fmt_spread(_col(b, "ratio_atomic")), fmt_spread(_col(b, "ratio_fastest_peer"))
            total = len(set(_case_keys(g)))
            if shared is not None and len(shared) < total:
                notes.append(f"best variant ranked on the {len(shared)} of {total} cases the candidates share")
        else:
            best, vs_atomic, vs_peer = DASH, DASH, DASH
        tdet = g[(g["kind"] == "peer") & g["variant"].str.endswith("_deterministic")]
        # torch's own price of determinism: each "<peer>_deterministic" against "<peer>" on the same case
        torch_cost = []
        for _, r in tdet.iterrows():
            base = r["variant"].removesuffix("_deterministic")
            twin = g[(g["kind"] == "peer") & (g["variant"] == base) & (g["case"] == r["case"])]
            if base != r["variant"] and len(twin):
                torch_cost.append(r.get("latency", math.nan) / twin["latency"].iloc[0])
        bad = g[(g["deterministic"] == True) & (distinct > 1)]  # noqa: E712
        if len(bad):
            notes.insert(0, "claimed-deterministic subject varied: " + ", ".join(sorted(set(bad["variant"]))))
        # "none" only where every measured row repeated: one run cannot show a second result
        rows.append([op, str(g["case"].nunique()),
                     ", ".join(names) if names else ("none" if _repeated(w, op) else "not repeated"),
                     best, vs_atomic, vs_peer, fmt_spread(torch_cost), "; ".join(notes)])
    return rows, nondet_ops


def op_rows(g: pd.DataFrame, has_flops: bool) -> list[list[str]]:
    rows = []
    last_case = None
    for _, r in g.iterrows():
        case = r["case"] if r["case"] != last_case else ""
        last_case = r["case"]
        det = {True: "yes", False: "no", None: "?"}[r["deterministic"]]
        n = r.get("n", math.nan)
        d = r.get("distinct_results", math.nan)
        distinct = DASH if _isnan(d) else f"{int(d)}/{int(n) if not _isnan(n) else '?'}"
        if not _isnan(d) and d > 1:
            distinct = f"**{distinct}**"
        row = [case, r["layout"] or DASH, f"{r['variant']}" + (" (peer)" if r["kind"] == "peer" else ""), det,
               fmt_time(r.get("latency")), fmt_pct(r.get("bandwidth_frac"))]
        if has_flops:
            row.append(fmt_pct(r.get("flop_frac")))
        row += [fmt_ratio(r.get("ratio_atomic")), fmt_ratio(r.get("ratio_fastest_peer")), distinct,
                fmt_ulp(r.get("max_ulp")), fmt_pct(r.get("frac_elements_differ")),
                fmt_err(r.get("err_max_abs")), fmt_err(r.get("err_rel_l2"))]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# Plots


def _plot_latency(g: pd.DataFrame, path: pathlib.Path, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "latency" not in g:
        return False
    g = g[g["latency"].notna() & g["case_bytes"].notna()]
    plain = g[g["contention"].isna()]
    if plain["case_bytes"].nunique() >= 2:  # contention cases repeat sizes with other data; leave them out
        g = plain
    if g.empty:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (kind, name, layout), s in g.groupby(["kind", "variant", "layout"], sort=False):
        s = s.sort_values("case_bytes")
        label = name + (" (peer)" if kind == "peer" else "") + (f" [{layout}]" if layout else "")
        ax.plot(s["case_bytes"], s["latency"], marker="o" if kind == "variant" else "x",
                linestyle="-" if kind == "variant" else "--", label=label, markersize=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per call (inputs read + outputs written once)")
    ax.set_ylabel("median latency (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_contention(g: pd.DataFrame, path: pathlib.Path, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "distinct_results" not in g:
        return False
    g = g[g["contention"].notna() & g["distinct_results"].notna()]
    if g.empty:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (kind, name), s in g.groupby(["kind", "variant"], sort=False):
        s = s.groupby("contention", as_index=False)["distinct_results"].max().sort_values("contention")
        ax.plot(s["contention"], s["distinct_results"], marker="o" if kind == "variant" else "x",
                linestyle="-" if kind == "variant" else "--", label=name + (" (peer)" if kind == "peer" else ""))
    n = g["n"].max() if "n" in g else math.nan
    ax.set_xscale("log")
    ax.set_xlabel("contention (partials colliding on one output element; op-specific knob)")
    ax.set_ylabel(f"distinct results in {int(n) if not _isnan(n) else 'N'} repeats")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# The report


def _fp_line(df: pd.DataFrame, field: str) -> str:
    if field not in df.columns:
        return "?"
    vals = [str(v) for v in df[field].dropna().unique() if str(v) != ""]
    return ", ".join(sorted(vals)) if vals else "?"


def render(df: pd.DataFrame, out: pathlib.Path, plots: bool = True) -> str:
    """The markdown for table ``df``; plots go beside ``out`` (its stem prefixes their names)."""
    if not set(results.DERIVED) & set(df["metric"].unique()):
        df = results.derive(df)
    w = wide(df)
    backend = _fp_line(df, "backend")
    ops = sorted(o for o in df["op"].dropna().unique() if o and
                 (df[df["op"] == o]["kind"].isin(["variant", "peer"]).any()))
    lines = []
    lines.append("# Kernel benchmarks: which ops are nondeterministic, and what determinism costs\n")
    if backend == "cuda":
        where = (f"**Backend: CUDA kernels** on **{_fp_line(df, 'gpu')}** (driver {_fp_line(df, 'driver')}, "
                 f"CUDA {_fp_line(df, 'cuda')}, cuDNN {_fp_line(df, 'cudnn')}, torch {_fp_line(df, 'torch')}, "
                 f"CuPy {_fp_line(df, 'cupy')}).")
    elif backend == "cpu":
        where = (f"**Backend: CPU order models** (NumPy/Numba reproductions of each kernel's accumulation order) "
                 f"on {_fp_line(df, 'cpu')} ({_fp_line(df, 'host')}); no GPU was used. Latencies are those of the "
                 f"CPU models and peers, not of GPU kernels; the atomic models draw a fresh random arrival order "
                 f"per call, so their variance shows what an order change does, not how often a GPU changes it.")
    else:
        where = f"**Backend: {backend}.**"
    lines.append(where + "\n")
    dtypes = [d for d in _fp_line(df, "dtype").split(", ") if d not in ("?", "float32")]
    if dtypes:
        lines.append(f"**Inputs in {', '.join(dtypes)}**: every float32 input of each case rounded to it before "
                     "anything runs, as under `torch.autocast`. nnrand's variants widen to float32, add in their "
                     "fixed order and round each output once (the conv gradients' `tree` and `atomic`: tensor "
                     "cores, float32 accumulation, kernels/conv_mma.py); peers run PyTorch's own half-precision "
                     "kernels. "
                     "Errors are against the float64 sum of the half inputs (so they include that final "
                     "rounding); % BW counts each half tensor at 2 bytes per element; % FLOP is of the float32 "
                     "matmul ceiling (nnrand's kernels compute in float32).\n")
    lines.append(f"Scale `{_fp_line(df, 'scale')}`; git `{_fp_line(df, 'git_sha')}`; measured "
                 f"{df['date'].min() if 'date' in df else '?'} to {df['date'].max() if 'date' in df else '?'}; "
                 f"torch {_fp_line(df, 'torch')}, numba {_fp_line(df, 'numba')}, numpy {_fp_line(df, 'numpy')}, "
                 f"python {_fp_line(df, 'python')}. Rendered from `{out.stem}` result table by "
                 f"`python -m bench.report`.\n")

    # summary
    srows, nondet = summary_rows(w, ops, df)
    lines.append("## Summary\n")
    if nondet:
        # deterministic only where something was measured, each time more than once
        det = [o for o in ops if o not in nondet and _repeated(w, o)]
        lines.append(f"Nondeterministic on this backend (more than one distinct result on one input): "
                     f"**{', '.join(nondet)}**. Deterministic everywhere measured: "
                     f"{', '.join(det) or 'none'}.\n")
    elif all(_repeated(w, o) for o in ops if (w["op"] == o).any()):
        lines.append("No subject gave more than one distinct result on this backend.\n")
    else:
        lines.append("No subject gave more than one distinct result on this backend, but some were measured "
                     "only once (\"not repeated\" below): one run cannot show a second result.\n")
    lines.append(md_table(["op", "cases", "nondeterministic here (max distinct / repeats)",
                           "best deterministic variant", "its latency ÷ atomic (geomean, range)",
                           "its latency ÷ fastest peer", "torch deterministic ÷ torch", "note"], srows))
    lines.append("\nRatios are per case, summarised as the geometric mean over the op's cases (min–max); "
                 "< 1.00x means faster. The best deterministic variant is the registry-deterministic variant "
                 "with the lowest geomean ratio to `atomic`.\n")

    claimed = w[(w["deterministic"] == True) & (_col(w, "distinct_results") > 1)]  # noqa: E712
    if len(claimed):
        lines.append("**Claimed deterministic but varied** (a bug in the variant, or in the deterministic mode):\n")
        for _, r in claimed.iterrows():
            lines.append(f"- {r['op']} / {r['variant']} ({r['kind']}) on {r['case']}: "
                         f"{int(r['distinct_results'])} distinct results")
        lines.append("")

    # ceilings
    cb, cf = results.ceiling(df, "bandwidth"), results.ceiling(df, "flop_rate")
    notes = {r["variant"]: r["note"] for _, r in df[df["kind"] == "ceiling"].iterrows()}
    lines.append("## Ceilings measured in the same session\n")
    lines.append(f"- bandwidth: {fmt_bytes_rate(cb)} ({notes.get('copy', 'not measured')})")
    lines.append(f"- float32 FLOP rate: {fmt_flops(cf)} ({notes.get('matmul', 'not measured')})\n")

    lat_note = df[(df["metric"] == "latency")]["note"].dropna()
    lines.append("## Per op\n")
    lines.append("Columns: median latency per call ("
                 + (lat_note.iloc[0].split(",")[0] if len(lat_note) else "?")
                 + "); % of the bandwidth ceiling (bytes moved at least once / latency); ÷ atomic = latency "
                   "over the op's `atomic` variant on the same case (the determinism overhead, for "
                   "deterministic subjects); ÷ fastest peer; distinct results out of N repeats on one input "
                   "(bold: varies); max ULP and share of output elements that ever differed from the first "
                   "result; error of the first result against the float64 reference (max abs, relative L2).\n")
    stem = out.stem
    for op in ops:
        g = w[w["op"] == op]
        lines.append(f"### {op}\n")
        if plots and not g.empty:
            links = []
            p = out.parent / f"{stem}_{op}_latency.png"
            if _plot_latency(g, p, f"{op}: latency vs size ({backend})"):
                links.append(f"![{op} latency]({p.name})")
            p = out.parent / f"{stem}_{op}_contention.png"
            if _plot_contention(g, p, f"{op}: distinct results vs contention ({backend})"):
                links.append(f"![{op} contention]({p.name})")
            if links:
                lines.append(" ".join(links) + "\n")
        has_flops = "flop_frac" in g.columns and g["flop_frac"].notna().any()
        header = ["case", "layout", "subject", "det.", "latency", "% BW"] + (["% FLOP"] if has_flops else []) + \
                 ["÷ atomic", "÷ fastest peer", "distinct", "max ULP", "elems differ", "max abs err", "rel L2 err"]
        if g.empty:
            lines.append("No measurements.\n")
        else:
            lines.append(md_table(header, op_rows(g, has_flops)) + "\n")
            remarks = latency_remarks(df, op)
            if remarks:
                lines.append("Latency remarks:\n\n" + "\n".join(remarks) + "\n")
        for metric, title in (("failed", "**Failed** (errors raised while measuring):"), ("skipped", "Skipped here:")):
            sk = df[(df["op"] == op) & (df["metric"] == metric)]
            if len(sk):
                lines.append(title + "\n")
                for (name, reason), s in sk.groupby(["variant", "note"], sort=False):
                    lines.append(f"- {name or op}: {reason} ({len(s)} case{'s' if len(s) != 1 else ''})")
                lines.append("")
    other = df[(df["metric"] == "skipped") & ~df["op"].isin(ops)]
    if len(other):
        lines.append("## Not benchmarked\n")
        for _, r in other.drop_duplicates(["op", "note"]).iterrows():
            lines.append(f"- {r['op']}: {r['note']}")
        lines.append("")
    return "\n".join(lines)


def latency_remarks(df: pd.DataFrame, op: str) -> list[str]:
    """Bullets of what the latency notes of ``op``'s rows add after how they were timed (the arguments a
    variant was benchmarked with, a timing that includes host time), per subject, with the cases they
    apply to."""
    lat = df[(df["op"] == op) & (df["metric"] == "latency")]
    seen: dict[tuple[str, str], list[str]] = {}
    for _, r in lat.iterrows():
        note = r.get("note")
        if not isinstance(note, str):
            continue
        for remark in note.split(results.NOTE_SEP)[1:]:
            seen.setdefault((r["variant"], remark), []).append(str(r["case"]))
    total = lat["case"].nunique()
    out = []
    for (name, remark), cases in seen.items():
        where = "every case" if len(set(cases)) == total else ", ".join(dict.fromkeys(cases))
        out.append(f"- {name}: {remark} ({where})")
    return out


def render_file(csv: pathlib.Path, out: pathlib.Path, plots: bool = True) -> pathlib.Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results.read(csv), out, plots=plots))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                    help="which table: cuda, cpu, or auto (the CUDA table if there is one, else the CPU one)")
    ap.add_argument("--quick", action="store_true", help="the quick-run table")
    ap.add_argument("--dtype", choices=("float32", "bf16", "fp16"), default="float32",
                    help="the table of a --bench-dtype run (default float32)")
    ap.add_argument("--csv", type=pathlib.Path, help="result table to render")
    ap.add_argument("--out", type=pathlib.Path, help="markdown to write")
    ap.add_argument("--no-plots", action="store_true", help="markdown only (plots are neither drawn nor linked)")
    a = ap.parse_args(argv)
    backend = a.backend
    if backend == "auto":
        backend = "cuda" if results.csv_path(results.stem("cuda", a.quick, dtype=a.dtype)).exists() else "cpu"
    stem = results.stem(backend, a.quick, dtype=a.dtype)
    csv = a.csv or results.csv_path(stem)
    out = a.out or results.report_path(stem)
    if not csv.exists():
        ap.error(f"no result table at {csv}; run `pytest --benchmark-only` first")
    render_file(csv, out, plots=not a.no_plots)
    print(f"{csv} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
