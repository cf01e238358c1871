"""The long-format result table and where it lives.

One row per (op, subject, case, metric). Subjects are the registry's variants (kind ``variant``), the op
spec's peers (kind ``peer``), and the session's ceilings (kind ``ceiling``); a subject that could not run
has one row with metric ``skipped`` and the reason in ``note``. Every row carries the environment
fingerprint (:mod:`nnrand.fingerprint`).

Files, by backend (so a CPU run never overwrites a GPU report; ``--quick`` GPU runs get their own too):

    backend cuda, full:   reports/results/kernels.csv        reports/kernels.md        reports/kernels_*.png
    backend cuda, quick:  reports/results/kernels_quick.csv  reports/kernels_quick.md  ...
    backend cpu:          reports/results/kernels_cpu.csv    reports/kernels_cpu.md    reports/kernels_cpu_*.png

with the pytest-benchmark JSON beside each table (``<stem>_benchmark.json``). A run with half-precision inputs
(``--bench-dtype bf16|fp16``) appends the dtype: ``kernels_quick_bf16``. A run that measured only
part of the plan (``-k``, a test path, ``-x`` after a failure, or interrupted) appends ``_partial`` to the stem. ``NNRAND_BENCH_STEM``
overrides the stem, ``NNRAND_BENCH_DIR`` the ``reports`` directory (results then go to ``<dir>/results``).
"""
from __future__ import annotations

import json
import math
import os
import pathlib

import pandas as pd

from nnrand.fingerprint import FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def reports_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("NNRAND_BENCH_DIR") or ROOT / "reports")

KEY_COLUMNS = ["op", "variant", "kind", "case", "params", "layout", "contention", "case_bytes", "case_flops",
               "deterministic", "mode", "metric", "value", "unit", "backend", "scale", "dtype", "repeats", "note"]
COLUMNS = KEY_COLUMNS + list(FIELDS)

# metric -> unit
UNITS = {
    "latency": "s",            # device time per call: CUDA-event median on CUDA, host median on CPU
    "latency_host": "s",       # pytest-benchmark median, each call synchronized (includes launch overhead)
    "bandwidth": "B/s",
    "bandwidth_frac": "1",     # of the session's copy ceiling
    "flop_rate": "FLOP/s",
    "flop_frac": "1",          # of the session's float32 matmul ceiling (TF32 off)
    "distinct_results": "count",
    "frac_runs_differ": "1",
    "max_abs_diff": "abs",
    "max_ulp": "ulp",
    "frac_elements_differ": "1",
    "err_max_abs": "abs",
    "err_rel_l2": "1",
    "ratio_fastest_peer": "x",
    "ratio_atomic": "x",
    "skipped": "",            # could not run here (note: why)
    "failed": "",             # raised an error (note: the error)
}


def stem(backend: str, quick: bool = False, partial: bool = False, dtype: str = "float32") -> str:
    """File stem of a run's outputs. A partial run (some benchmarks deselected, or interrupted) gets
    ``_partial`` so it never replaces a complete table; half-precision inputs get their dtype."""
    if os.environ.get("NNRAND_BENCH_STEM"):
        return os.environ["NNRAND_BENCH_STEM"]
    name = "kernels_cpu" if backend == "cpu" else ("kernels_quick" if quick else "kernels")
    return name + ("" if dtype == "float32" else f"_{dtype}") + ("_partial" if partial else "")


def csv_path(stem_: str) -> pathlib.Path:
    return reports_dir() / "results" / f"{stem_}.csv"


def json_path(stem_: str) -> pathlib.Path:
    return reports_dir() / "results" / f"{stem_}_benchmark.json"


def report_path(stem_: str) -> pathlib.Path:
    return reports_dir() / f"{stem_}.md"


def params_json(params: dict) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def frame(rows: list[dict]) -> pd.DataFrame:
    """Rows -> the table with every column present, in order."""
    df = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = math.nan if c in ("value", "contention", "case_bytes", "case_flops", "repeats") else \
                ("float32" if c == "dtype" else "")
    extra = [c for c in df.columns if c not in COLUMNS]
    return df[COLUMNS + extra]


def write(df: pd.DataFrame, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def read(path: pathlib.Path) -> pd.DataFrame:
    # the fingerprint columns are text: a git SHA of decimal digits and one "e" ("7975e94") must not
    # become a float, nor cuDNN 91900 an int
    df = pd.read_csv(path, keep_default_na=False, na_values=["", "nan", "NaN"],
                     dtype={"note": str, "layout": str, "params": str, "variant": str, "case": str, "mode": str,
                            "dtype": str, **{f: str for f in FIELDS}})
    for c in ("note", "layout", "params", "mode"):
        if c in df.columns:
            df[c] = df[c].fillna("")
    if "dtype" not in df.columns:  # tables written before inputs could be half: float32
        df.insert(COLUMNS.index("dtype"), "dtype", "float32")
    df["dtype"] = df["dtype"].fillna("float32")
    return df


# --------------------------------------------------------------------------------------------------
# Derived metrics: computed from the measured rows of the same table (idempotent).

DERIVED = ("bandwidth_frac", "flop_frac", "ratio_fastest_peer", "ratio_atomic")
ATOMIC = "atomic"  # each op's nondeterministic baseline variant (the "atomic twin" of every row)
NOTE_SEP = "; "    # a latency row's note: how it was timed, then remarks the report lists under the op's table


def ceiling(df: pd.DataFrame, metric: str) -> float:
    rows = df[(df["kind"] == "ceiling") & (df["metric"] == metric)]
    return float(rows["value"].max()) if len(rows) else math.nan


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """Add, per subject and case: bandwidth and FLOP rate as a fraction of the session's ceilings, and
    latency as a ratio to the fastest peer of the same case and to the op's ``atomic`` variant on the
    same case. A missing peer or atomic twin gives no row (the report shows a dash)."""
    df = df[~df["metric"].isin(DERIVED)].copy()
    subj = df[df["kind"].isin(["variant", "peer"])]
    new = []

    def add(src: pd.Series, metric: str, value: float, note: str = "") -> None:
        row = src.to_dict()
        row.update(metric=metric, value=value, unit=UNITS[metric], note=note, repeats=math.nan)
        new.append(row)

    for metric, ceil_metric, out in (("bandwidth", "bandwidth", "bandwidth_frac"),
                                     ("flop_rate", "flop_rate", "flop_frac")):
        c = ceiling(df, ceil_metric)
        if math.isnan(c) or c <= 0:
            continue
        for _, r in subj[subj["metric"] == metric].iterrows():
            add(r, out, r["value"] / c)

    lat = subj[subj["metric"] == "latency"]
    for (op, case), g in lat.groupby(["op", "case"], sort=False):
        peers = g[g["kind"] == "peer"]
        fastest = peers.loc[peers["value"].idxmin()] if len(peers) and peers["value"].notna().any() else None
        atomic = g[(g["kind"] == "variant") & (g["variant"] == ATOMIC)]
        t_atomic = float(atomic["value"].iloc[0]) if len(atomic) else math.nan
        for _, r in g.iterrows():
            if fastest is not None:
                add(r, "ratio_fastest_peer", r["value"] / fastest["value"], note=f"fastest peer: {fastest['variant']}")
            if not math.isnan(t_atomic):
                add(r, "ratio_atomic", r["value"] / t_atomic)
    if new:
        df = pd.concat([df, pd.DataFrame(new)], ignore_index=True)
    return df.reset_index(drop=True)
