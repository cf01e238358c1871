"""The divergence report, rendered from the study's result files alone (``<stem>.json`` and
``<stem>_examples.npz``); it never trains or times anything.

    python -m nnrand.divergence_report reports/results/divergence.json     # -> reports/divergence.md

The first screen answers three questions from the numbers: does implementation noise alone (fixed
seeds, atomic kernels) make predictions diverge as much as random seeds, which op contributes most,
and who pays (classes, the minority subgroup, hard examples). Then the tables behind those answers,
the link between kernel-level noise and divergence, the cost of determinism, published figures for
context, what is missing, and the environment. A configuration without finished members is listed as
missing, never dropped silently; one with a single member has no divergence to show.
"""
from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import numpy as np

from nnrand import runio

HEADLINE_IMPL = ("impl", "native")      # implementation noise alone, first one present wins
ALPHA = 0.05                            # a paired test's p below this reads "they differ"
HEADLINE_ALGO = ("algo",)
OP_PREFIX = "atomic-"


# --------------------------------------------------------------------------------------------------
# Formatting


def _ok(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def pct(x, se=None, digits=2) -> str:
    if not _ok(x):
        return "-"
    s = f"{100 * x:.{digits}f}%"
    return s + (f" ± {100 * se:.{digits}f}" if _ok(se) else "")


def num(x, digits=4) -> str:
    return f"{x:.{digits}g}" if _ok(x) else "-"


def sd_se(d: dict | None, scale=1.0, digits=3, unit="") -> str:
    """'SD (SE x)' of a metrics.spread dict."""
    if not d or not _ok(d.get("sd")):
        return "-"
    se = f" (SE {d['sd_se'] * scale:.{digits}g})" if _ok(d.get("sd_se")) else ""
    return f"{d['sd'] * scale:.{digits}g}{unit}{se}"


def ci_txt(ci: dict | None, scale=100.0, digits=3, unit="") -> str:
    """'value [lo, hi]' of a stats interval dict (scaled: 100 for percent / points)."""
    if not ci or not _ok(ci.get("value")):
        return "-"
    v = f"{ci['value'] * scale:.{digits}g}{unit}"
    if not (_ok(ci.get("lo")) and _ok(ci.get("hi"))):
        return v
    return f"{v} [{ci['lo'] * scale:.{digits}g}, {ci['hi'] * scale:.{digits}g}]"


def p_txt(t: dict | None) -> str:
    """A permutation test's p-value with how it was obtained."""
    if not t or not _ok(t.get("p_value")):
        return "-"
    how = f"all {t['splits']} splits" if t.get("exact") else f"{t['splits'] - 1} random splits"
    return f"{t['p_value']:.3g} ({how})"


def _m(c: dict | None, *path):
    """Nested lookup in a configuration's metrics; None where absent."""
    v = (c or {}).get("metrics")
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def _lrs(configs: dict) -> list:
    """The learning rates of the study's configurations, ascending ([None] for results without them)."""
    lrs = sorted({c.get("lr") for c in configs.values() if c.get("lr") is not None})
    return lrs or [None]


def _by_entry(configs: dict, entry: str, lr=None) -> tuple[str | None, dict | None]:
    """The configuration of grid entry ``entry`` (at ``lr`` where given): its name is the entry's, or
    ``<entry>_lr<lr>`` in a study over several learning rates."""
    for n, c in configs.items():
        if c.get("entry", n) == entry and (lr is None or c.get("lr") in (None, lr)):
            return n, c
    return None, None


def _first(configs: dict, names, lr=None) -> tuple[str | None, dict | None]:
    """The first of the entries ``names`` (at ``lr``) with a disagreement figure."""
    for e in names:
        n, c = _by_entry(configs, e, lr)
        if c and _m(c, "disagreement") is not None:
            return n, c
    return None, None


def _steps(c: dict) -> str:
    fd = c.get("first_divergence")
    if not fd:
        return "-"
    v = fd["per_pair"]
    differing = sorted(s for s in v if s is not None)
    if not differing:
        return "never (bitwise equal at every checked step)"
    head = f"{differing[0]}" if len(set(differing)) == 1 else f"{differing[0]}-{differing[-1]}"
    return head + ("" if len(differing) == len(v) else f" ({len(v) - len(differing)} of {len(v)} pairs never)")


# --------------------------------------------------------------------------------------------------
# Plots (PNG beside the report)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    _plt().close(fig)
    runio.write_bytes(path, buf.getvalue())


def plot_disagreement(configs: dict, path: Path) -> bool:
    rows = [(n, c) for n, c in configs.items() if _m(c, "disagreement") is not None]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4), constrained_layout=True)
    y = np.arange(len(rows))
    d = [100 * _m(c, "disagreement") for _, c in rows]
    cis = [_m(c, "ci", "disagreement") for _, c in rows]
    if all(ci and _ok(ci.get("lo")) for ci in cis):   # member-bootstrap interval (stats), else SE over images
        de = [[100 * (ci["value"] - ci["lo"]) for ci in cis], [100 * (ci["hi"] - ci["value"]) for ci in cis]]
        what = f"bars on disagreement: {100 * cis[0]['level']:.0f}% bootstrap interval over members"
    else:
        de = [100 * (_m(c, "disagreement_se") or 0) for _, c in rows]
        what = "bars: ± bootstrap SE over images"
    f = [100 * _m(c, "frac_not_all_equal") for _, c in rows]
    fe = [100 * (_m(c, "frac_not_all_equal_se") or 0) for _, c in rows]
    ax.barh(y - 0.2, d, 0.4, xerr=de, label="mean pairwise disagreement", color="#3b75af")
    ax.barh(y + 0.2, f, 0.4, xerr=fe, label="predictions not all equal", color="#ef8636")
    ax.set_yticks(y, [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"% of test images ({what})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return True


def plot_l2(configs: dict, path: Path) -> bool:
    rows = [(n, c["weights"]) for n, c in configs.items() if c.get("weights")]
    rows = [(n, w) for n, w in rows if any(r["l2"] and r["l2"] > 0 for r in w)]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for n, w in rows:
        pts = [(r["epoch"] + 1, r["l2"] / r["norm"]) for r in w if r["l2"] and r["norm"]]
        line = ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2, label=n)[0]
        band = [(r["epoch"] + 1, r["l2_ci"]["lo"] / r["norm"], r["l2_ci"]["hi"] / r["norm"]) for r in w
                if r["l2"] and r["norm"] and _ok((r.get("l2_ci") or {}).get("lo")) and r["l2_ci"]["lo"] > 0]
        if len(band) > 1:
            ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.15, lw=0)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean pairwise ||w_i - w_j|| / mean ||w||")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)
    return True


def plot_link(link: list[dict], refs: dict, path: Path) -> bool:
    pts = [r for r in link if _ok(r.get("median_max_ulp")) and _ok(r.get("disagreement"))]
    if not pts:
        return False
    models = [r.get("model") for r in pts]
    main = max(set(models), key=models.count)   # ops on another model are labelled with it
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
    for r in pts:
        x = max(r["median_max_ulp"], 0.5)
        ax.errorbar(x, 100 * r["disagreement"], yerr=100 * (r.get("disagreement_se") or 0), fmt="o", capsize=3)
        label = r["op"] + (f" ({r['model']})" if r.get("model") and r["model"] != main else "")
        ax.annotate(label, (x, 100 * r["disagreement"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for (name, v), style in zip(refs.items(), ("--", ":", "-.")):
        if _ok(v):
            ax.axhline(100 * v, ls=style, color="grey", lw=1, label=f"`{name}` (all ops / seeds): {100 * v:.2f}%")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    ax.set_xscale("log")
    ax.set_xlabel("kernel: median over ResNet-18 cases of max ULP between atomic runs (0 drawn at 0.5)")
    ax.set_ylabel("training: pairwise disagreement, %")
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def plot_groups(configs: dict, path: Path) -> bool:
    rows = [(n, c) for n, c in configs.items() if _m(c, "groups", "minority") and _m(c, "groups", "majority")]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4), constrained_layout=True)
    y = np.arange(len(rows))
    for k, (g, color) in enumerate((("majority", "#3b75af"), ("minority", "#d1495b"))):
        ax.barh(y + (k - 0.5) * 0.4, [100 * _m(c, "groups", g, "disagreement") for _, c in rows], 0.4,
                label=f"{g} subgroup", color=color)
    ax.set_yticks(y, [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("mean pairwise disagreement, % of the subgroup's test images")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return True


def plot_flips(res: dict, arrays: dict, path: Path, max_rows: int = 6) -> bool:
    """The most-disagreed test images of the configurations with the most disagreement, one row each,
    captioned with the true class and the members' predictions."""
    if "images" not in arrays:
        return False
    index = {int(i): k for k, i in enumerate(arrays["image_index"])}
    classes = res.get("classes") or [str(i) for i in range(100)]
    rows = [(n, c) for n, c in res["configs"].items() if c.get("top_flips")]
    rows.sort(key=lambda nc: -(_m(nc[1], "disagreement") or 0))
    rows = rows[:max_rows]
    if not rows:
        return False
    cols = max(len(c["top_flips"]) for _, c in rows)
    plt = _plt()
    fig, axes = plt.subplots(len(rows), cols, figsize=(1.55 * cols, 1.95 * len(rows)), squeeze=False)
    for r, (name, c) in enumerate(rows):
        preds = arrays.get(f"{name}/preds")
        labels = arrays.get(f"{name}/labels")
        groups = arrays.get(f"{name}/groups")
        for k in range(cols):
            ax = axes[r][k]
            ax.axis("off")
            if k >= len(c["top_flips"]) or c["top_flips"][k] not in index:
                continue
            i = c["top_flips"][k]
            ax.imshow(np.transpose(arrays["images"][index[i]], (1, 2, 0)))
            short = lambda j: classes[int(j)][:6]  # noqa: E731
            cap = f"#{i} {short(labels[i])}" + (" (min)" if groups is not None and groups[i] == 1 else "")
            cap += "\n" + ",".join(short(p) for p in preds[:, i]) if preds is not None else ""
            ax.set_title(cap, fontsize=6)
        axes[r][0].text(-0.1, 0.5, name, transform=axes[r][0].transAxes, rotation=90, ha="right", va="center",
                        fontsize=7)
    fig.subplots_adjust(left=0.04, right=0.99, top=0.93, bottom=0.02, hspace=0.6, wspace=0.08)
    _save(fig, path)
    return True


# --------------------------------------------------------------------------------------------------
# Sections


def link_rows(res: dict) -> list[dict]:
    kn = res.get("kernel_noise") or {}
    rows = []
    for n, c in res["configs"].items():
        if c.get("entry", n).startswith(OP_PREFIX):
            op = c.get("entry", n)[len(OP_PREFIX):]
            k = (kn.get("ops") or {}).get(op, {}).get("atomic", {})
            rows.append({"op": op, "config": n, "model": (c.get("setup") or {}).get("model"), "lr": c.get("lr"),
                         "disagreement": _m(c, "disagreement"),
                         "disagreement_se": _m(c, "disagreement_se"), "frac_not_all_equal": _m(c, "frac_not_all_equal"),
                         "acc": _m(c, "accuracy"), "steps": _steps(c) if c["done"] >= 2 else "-", **k})
    return rows


def holm_adjusted(res: dict, stat: str) -> dict[tuple[str, str], float]:
    """Holm-adjusted p-values of the results' paired tests of one statistic ("disagreement" or
    "accuracy_sd"), keyed by (a, b) as stored: the table's tests of that statistic are one family."""
    from nnrand import stats

    comps = res.get("comparisons") or []
    raw = [c[stat].get("p_value") if _ok(c[stat].get("p_value")) else float("nan") for c in comps]
    return {(c["a"], c["b"]): float(q) for c, q in zip(comps, stats.holm(raw))}


def _family_size(res: dict, stat: str) -> int:
    """How many of the paired tests of ``stat`` have a p-value (Holm's m)."""
    return sum(_ok(c[stat].get("p_value")) for c in res.get("comparisons") or [])


def _holm_of(res: dict, a: str, b: str, stat: str = "disagreement") -> float | None:
    """The Holm-adjusted p of the test between a and b (either order), None if absent."""
    adj = holm_adjusted(res, stat)
    q = adj.get((a, b), adj.get((b, a)))
    return q if q is not None and _ok(q) else None


def comparison(res: dict, a: str | None, b: str | None) -> dict | None:
    """The paired test of configuration a against b in the results (either order; None if absent)."""
    for c in res.get("comparisons") or []:
        if (c["a"], c["b"]) == (a, b):
            return c
    for c in res.get("comparisons") or []:
        if (c["a"], c["b"]) == (b, a):   # flip the sign of the difference and the interval
            flip = lambda d: dict(d, value=-d["value"], lo=-d["hi"], hi=-d["lo"])  # noqa: E731
            return {**c, "a": a, "b": b, **{k: dict(c[k], a=c[k]["b"], b=c[k]["a"], diff=flip(c[k]["diff"]))
                                            for k in ("disagreement", "accuracy_sd")}}
    return None


def _relative_to_algo(link: list[dict], cfg: dict) -> list[dict]:
    """The single-op rows that can be ranked: each op's disagreement over its own model's ``algo``
    baseline (``algo@<model>`` where the grid has it, see study.baseline_for; an op on another model than
    ``algo``'s must never be compared with ``algo`` itself), with its member-bootstrap interval divided
    by that baseline. Rows whose baseline is missing or never disagreed are left out."""
    out = []
    for r in link:
        base, bc = _by_entry(cfg, f"algo@{r['model']}", r["lr"])
        if bc is None:
            base, bc = _by_entry(cfg, "algo", r["lr"])
        bd = _m(bc, "disagreement") if bc else None
        if bc and r["model"] and (bc.get("setup") or {}).get("model") not in (None, r["model"]):
            continue
        if not bd:
            continue
        ci = _m(cfg[r["config"]], "ci", "disagreement") or {}
        lo, hi = ci.get("lo"), ci.get("hi")
        out.append({**r, "base": base, "ratio": r["disagreement"] / bd,
                    "ratio_lo": lo / bd if _ok(lo) else math.nan, "ratio_hi": hi / bd if _ok(hi) else math.nan})
    return out


def _impl_vs_algo(res: dict, lr, several: bool) -> list[str]:
    """The headline's first answer at learning rate ``lr`` (said where the study has ``several``)."""
    cfg = res["configs"]
    out = []
    at = f" at lr {lr:g}" if several and lr is not None else ""
    iname, impl = _first(cfg, HEADLINE_IMPL, lr)
    aname, algo = _first(cfg, HEADLINE_ALGO, lr)
    if impl and algo:
        di, da = _m(impl, "disagreement"), _m(algo, "disagreement")
        se = math.hypot(_m(impl, "disagreement_se") or 0, _m(algo, "disagreement_se") or 0)
        test = comparison(res, iname, aname)
        if da == 0 and di == 0:
            verdict = "neither changed a single prediction"
        elif test:
            t = test["disagreement"]
            verdict = (f"difference {ci_txt(t['diff'], 100, unit=' pt')} (bootstrap over members), permutation "
                       f"p = {p_txt(t)}: " + ("**they differ**" + (", impl more" if di > da else ", impl less")
                                              if t["p_value"] < ALPHA else
                                              "**no detectable difference** at this number of members"))
        elif abs(di - da) <= 2 * se:
            verdict = "**yes: as much** (the difference is within 2 bootstrap SE)"
        elif di > da:
            verdict = "**yes, more**"
        else:
            verdict = f"**no: less**, {di / da:.2f} of it" if da > 0 else "**no**"
        out.append(f"- **Implementation noise alone vs random seeds{at}.** With every seed fixed and only the "
                   f"reduction order free (`{iname}`), members disagree on {pct(di, _m(impl, 'disagreement_se'))} of "
                   f"test images (pairwise; {pct(_m(impl, 'frac_not_all_equal'))} not all equal); with random "
                   f"init/order/augmentation (`{aname}`), {pct(da, _m(algo, 'disagreement_se'))} "
                   f"({pct(_m(algo, 'frac_not_all_equal'))}). Accuracy SD: {sd_se(_m(impl, 'accuracy'), 100, unit=' pt')} "
                   f"vs {sd_se(_m(algo, 'accuracy'), 100, unit=' pt')}. As much? {verdict}.")
    else:
        out.append(f"- Implementation noise vs random seeds{at}: not answerable yet (`impl` or `algo` lacks two "
                   "finished members).")
    return out


def _op_ranking(link: list[dict], cfg: dict, res: dict, at: str) -> list[str]:
    """The headline's "op contributing most" over the single-op rows ``link`` of one learning rate."""
    out = []
    ranked = _relative_to_algo(link, cfg)
    if ranked:
        top = max(ranked, key=lambda r: r["ratio"])
        if top["disagreement"] > 0:
            def rel(r):
                return f"{r['op']} {pct(r['disagreement'])} ({r['ratio']:.2f}x `{r['base']}`)"
            others = ", ".join(rel(r) for r in ranked if r is not top)
            # ahead only where the member-bootstrap intervals, each divided by its own baseline, do not overlap
            tied = [r["op"] for r in ranked if r is not top and not (_ok(top["ratio_lo"]) and _ok(r["ratio_hi"])
                                                                      and top["ratio_lo"] > r["ratio_hi"])]
            caveat = (f"; not clearly ahead of {', '.join(tied)} (their member-bootstrap intervals, relative to "
                      "their baselines, overlap or are missing)" if tied else
                      "; ahead of every other op (member-bootstrap intervals relative to their baselines apart)")
            vs = [c for c in res.get("comparisons") or [] if c["a"] == top["config"] and c["b"].startswith("control")]
            test = ""
            if vs:
                q = _holm_of(res, vs[0]["a"], vs[0]["b"])
                test = (f"; against `{vs[0]['b']}` (its model's fixed-seed baseline) difference "
                        f"{ci_txt(vs[0]['disagreement']['diff'], unit=' pt')}, permutation p = "
                        f"{p_txt(vs[0]['disagreement'])}" +
                        (f", {q:.3g} Holm-adjusted over the study's {_family_size(res, 'disagreement')} paired "
                         "tests" if q is not None else ""))
            out.append(f"- **Op contributing most{at}** (relative to random seeds on the op's own model, `algo` or "
                       f"`algo@<model>`): `{top['op']}` atomic alone gives "
                       f"{pct(top['disagreement'], top['disagreement_se'])} pairwise disagreement, {top['ratio']:.2f}x "
                       f"`{top['base']}`" + (f" (others: {others})" if others else "") + caveat + test + ".")
        else:
            out.append(f"- **Op contributing most{at}:** none: no single-op atomic configuration changed a prediction.")
    elif link:
        out.append(f"- Op contributing most{at}: not answerable yet (no op's model has an `algo` baseline with two "
                   "finished members and some disagreement to compare with).")
    else:
        out.append(f"- Op contributing most{at}: not answerable yet (no `atomic-<op>` configuration with two "
                   "finished members).")
    return out


def headline(res: dict) -> list[str]:
    cfg = res["configs"]
    out = ["## Answers first", ""]
    lrs = _lrs(cfg)
    for lr in lrs:
        out += _impl_vs_algo(res, lr, len(lrs) > 1)
    iname, impl = _first(cfg, HEADLINE_IMPL, lrs[0])
    aname, algo = _first(cfg, HEADLINE_ALGO, lrs[0])
    link = [r for r in link_rows(res) if r["disagreement"] is not None]
    for lr in lrs:   # each learning rate ranks its own ops
        at = f" at lr {lr:g}" if len(lrs) > 1 and lr is not None else ""
        out += _op_ranking([r for r in link if lr is None or r["lr"] in (None, lr)], cfg, res, at)
    wname, who = (iname, impl) if impl else (aname, algo)
    if who:
        parts = []
        g = _m(who, "groups")
        if g and "minority" in g and "majority" in g:
            parts.append(f"the minority subgroup (background cue of another class) {pct(g['minority']['disagreement'])} "
                         f"disagreement and accuracy SD {sd_se(g['minority']['accuracy'], 100, unit=' pt')} vs the majority "
                         f"{pct(g['majority']['disagreement'])} and {sd_se(g['majority']['accuracy'], 100, unit=' pt')}")
        pc = [r for r in (_m(who, "per_class") or []) if _ok(r.get("disagreement"))]
        if pc:
            worst = max(pc, key=lambda r: r["disagreement"])
            names = res.get("classes") or []
            cname = names[worst["class"]] if worst["class"] < len(names) else str(worst["class"])
            parts.append(f"the most-disagreed class is `{cname}` ({pct(worst['disagreement'])}, accuracy SD "
                         f"{sd_se(worst, 100, unit=' pt')})")
        conc = _m(who, "concentration", "misclassified_by_most")
        if conc and _ok(conc.get("share_of_flips")):
            # rates, not their ratio: a ratio over a zero rate outside is infinite, stored as null
            where = "concentrate on" if (conc.get("rate_in") or 0) > (conc.get("rate_out") or 0) else "do not concentrate on"
            parts.append(f"flips {where} hard images: {pct(conc['rate_in'])} of the images misclassified by most "
                         f"members flip vs {pct(conc['rate_out'])} of the rest ({num(100 * conc['share_of_flips'], 3)}% "
                         f"of flips come from {num(100 * conc['share_of_examples'], 3)}% of the images)")
        elif _ok(_m(who, "frac_not_all_equal")) and _m(who, "frac_not_all_equal") == 0:
            parts.append("no test prediction flipped between members")
        out.append(f"- **Who pays** (`{wname}`): " + ("; ".join(parts) if parts else "no per-group data") + ".")
    if res.get("missing"):
        out.append(f"- **Partial results:** {len(res['missing'])} configuration(s) lack members: "
                   f"{', '.join(res['missing'])} (see *Missing*).")
    return out + [""]


def main_table(res: dict) -> list[str]:
    nxt = "; intervals in the next section" if any(_m(c, "ci") for c in res["configs"].values()) else ""
    out = ["## Divergence per configuration", "",
           f"{res['members']} members per configuration; SDs across members (ddof=1) with bootstrap SE over members "
           f"(1000 resamples; with {res['members']} members a rough figure{nxt}); rates over test images with bootstrap SE over images. "
           "Disagreement = mean over member pairs of the fraction of test images whose top-1 labels differ; "
           "not all equal = fraction of test images on which the members' labels are not all the same "
           "(Fort et al. 2019, Fig. S4); ensemble gain = mean 2-member ensemble accuracy (mean softmax) minus mean "
           "single accuracy; L2 = mean pairwise weight distance after the last epoch, relative to the mean weight "
           "norm; first differing step = first training step at which two members' exact weight checksums differ "
           "(checked every step of epoch 0, then at epoch ends; range over pairs).", "",
           "| configuration | what varies | done | test acc mean | acc SD, pt | CE SD | not all equal | "
           "disagreement | logit corr | ens-2 gain, pt | rel. L2 | first differing step | step ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, c in res["configs"].items():
        acc = _m(c, "accuracy") or {}
        w = (c.get("weights") or [{}])[-1]
        rel = w["l2"] / w["norm"] if _ok(w.get("l2")) and _ok(w.get("norm")) and w["norm"] else None
        eg = _m(c, "ensemble2_gain")
        out.append(f"| `{n}` | {c.get('note', '')} | {c['done']}/{c['requested']} | {pct(acc.get('mean'))} | "
                   f"{sd_se(acc, 100)} | {sd_se(_m(c, 'cross_entropy'), 1)} | "
                   f"{pct(_m(c, 'frac_not_all_equal'), _m(c, 'frac_not_all_equal_se'))} | "
                   f"{pct(_m(c, 'disagreement'), _m(c, 'disagreement_se'))} | {num(_m(c, 'logit_corr'), 6)} | "
                   f"{num(100 * eg if _ok(eg) else None, 3)} | {num(rel, 3)} | {_steps(c)} | "
                   f"{num(c.get('step_time_ms'), 4)} |")
    return out + [""]


def interval_table(res: dict) -> list[str]:
    """Every configuration's metrics with their member-bootstrap intervals (``stats.config_stats``)."""
    rows = [(n, c) for n, c in res["configs"].items() if _m(c, "ci")]
    if not rows:
        return []
    b = _m(rows[0][1], "ci", "bootstrap")
    out = ["## Intervals per configuration", "",
           f"Point estimate [{100 * b['level']:.0f}% percentile interval] from {b['n_boot']} bootstrap resamples of "
           f"the **members** (seed {b['seed']}; the test images are fixed). Pairwise quantities are recomputed over "
           "all pairs of distinct members of each resample (pairs share members, so pairs are not resampled). "
           "With few members the intervals are coarse (two members: one pair, the interval collapses to the point).",
           "", "| configuration | members | acc mean, % | acc SD, pt | CE SD | disagreement, % | logit corr | "
           "ens-2 gain, pt | L2 last epoch | L2 growth (last / first epoch) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, c in rows:
        ci = _m(c, "ci")
        w = (c.get("weights") or [{}])[-1]
        out.append(f"| `{n}` | {c['done']} | {ci_txt(ci['accuracy_mean'], 100, 4)} | {ci_txt(ci['accuracy_sd'])} | "
                   f"{ci_txt(ci['cross_entropy_sd'], 1)} | {ci_txt(ci['disagreement'])} | "
                   f"{ci_txt(ci['logit_corr'], 1, 6)} | {ci_txt(ci['ensemble2_gain'])} | "
                   f"{ci_txt(w.get('l2_ci'), 1, 4)} | {num(w.get('growth'), 4)} |")
    return out + [""]


def comparison_table(res: dict) -> list[str]:
    comps = res.get("comparisons") or []
    if not comps:
        return []
    out = ["## Paired tests between configurations", "",
           "Is configuration a's disagreement (or accuracy SD) different from b's? Difference a - b with its 95% "
           "bootstrap interval (members resampled within each configuration) and a two-sided permutation test over "
           "members (null: the members of a and b are exchangeable; the pooled members are split at random and "
           "the statistic recomputed; p counts the observed split). All splits are enumerated when there are few: "
           "with 2 members per side there are 6 and p cannot go below 1/3. Each statistic's tests form one family: "
           f"*Holm* is Holm's step-down adjusted p over the {_family_size(res, 'disagreement')} disagreement and "
           f"{_family_size(res, 'accuracy_sd')} accuracy-SD tests with a p-value (family-wise error at most "
           f"{ALPHA:g} in each family); read a difference as detected only where that is below {ALPHA:g}. The "
           "headline's impl-against-algo answer, the study's one pre-specified comparison, quotes its own p; its "
           "row's Holm value is the stricter reading.", "",
           "| a | b | disagreement a / b, % | difference, pt | p | Holm | acc SD a / b, pt | difference, pt | p | "
           "Holm |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    hd, ha = holm_adjusted(res, "disagreement"), holm_adjusted(res, "accuracy_sd")

    def adj(q):
        return f"{q:.3g}" if _ok(q) else "-"
    for c in comps:
        d, a = c["disagreement"], c["accuracy_sd"]
        key = (c["a"], c["b"])
        out.append(f"| `{c['a']}` | `{c['b']}` | {pct(d['a'])} / {pct(d['b'])} | {ci_txt(d['diff'])} | {p_txt(d)} | "
                   f"{adj(hd[key])} | {num(100 * a['a'] if _ok(a['a']) else None, 3)} / "
                   f"{num(100 * a['b'] if _ok(a['b']) else None, 3)} | {ci_txt(a['diff'])} | {p_txt(a)} | "
                   f"{adj(ha[key])} |")
    return out + [""]


def groups_table(res: dict) -> list[str]:
    rows = [(n, c) for n, c in res["configs"].items() if _m(c, "groups")]
    if not rows:
        return ["## Subgroups", "", "No subgroup labels in these results (CIFAR has none).", ""]
    sizes = _m(rows[0][1], "groups")
    n_min, n_maj = sizes["minority"].get("n"), sizes["majority"].get("n")
    share = (f"{n_min} of {n_min + n_maj} test images ({100 * n_min / (n_min + n_maj):.1f}%)"
             if n_min is not None and n_maj is not None else "a share of the test images")
    out = ["## Who pays: subgroups, classes, hard images", "",
           "Minority = test images whose background colour is the cue of another class (data.py; rare in "
           f"training, where the cue agrees with the class for most images): {share}.", "",
           "| configuration | majority acc SD, pt | minority acc SD, pt | majority disagreement | minority disagreement | "
           "flip rate: misclassified by most vs rest | lowest-confidence quartile vs rest | minority vs majority |",
           "|---|---|---|---|---|---|---|---|"]
    for n, c in rows:
        g = _m(c, "groups")
        conc = _m(c, "concentration") or {}

        def cc(k):
            x = conc.get(k)
            return f"{pct(x['rate_in'])} vs {pct(x['rate_out'])}" if x else "-"
        gci = _m(c, "ci", "groups") or {}
        gd = lambda k: ci_txt(gci[k], unit="%") if k in gci else pct(g.get(k, {}).get("disagreement"))  # noqa: E731
        out.append(f"| `{n}` | {sd_se(g.get('majority', {}).get('accuracy'), 100)} | "
                   f"{sd_se(g.get('minority', {}).get('accuracy'), 100)} | "
                   f"{gd('majority')} | {gd('minority')} | "
                   f"{cc('misclassified_by_most')} | {cc('lowest_confidence_quartile')} | {cc('minority')} |")
    out.append("")
    classes = res.get("classes") or []
    lr0 = _lrs(res["configs"])[0]
    show = [n for n, c in (_by_entry(res["configs"], e, lr0) for e in ("control", "algo", "impl", "native"))
            if _m(c, "per_class")]
    if show:
        out += ["Per class: accuracy SD across members (pt) / pairwise disagreement.", "",
                "| class | " + " | ".join(f"`{n}`" for n in show) + " |", "|---|" + "---|" * len(show)]
        k = len(_m(res["configs"][show[0]], "per_class"))
        for i in range(k):
            cells = []
            for n in show:
                r = _m(res["configs"][n], "per_class")[i]
                pci = (_m(res["configs"][n], "ci", "per_class") or [None] * (i + 1))[i]
                dis = ci_txt(pci, unit="%") if pci else pct(r.get("disagreement"))
                cells.append(f"{num(100 * r['sd'] if _ok(r.get('sd')) else None, 3)} / {dis}")
            out.append(f"| {classes[i] if i < len(classes) else i} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def link_section(res: dict, stem: str, have_plot: bool) -> list[str]:
    kn = res.get("kernel_noise") or {}
    out = ["## Link: kernel-level noise beside the divergence it causes", ""]
    if not kn.get("found"):
        out.append(f"The kernel benchmark table `{kn.get('source', 'reports/results/kernels.csv')}` is absent: "
                   "run `pytest --benchmark-only` (bench/README.md) and re-render; the divergence column stands alone.")
    else:
        out.append(f"Kernel columns from `{kn['source']}` (backend {res['backend']}, scale {kn.get('scale')}, "
                   f"GPU {kn.get('gpu') or 'none'}, commit {kn.get('git_sha')}, {kn.get('date')}): the `atomic` "
                   "variant on the ResNet-18 layer cases (contention stress cases left out); distinct results out of "
                   "the repeats of one input, max ULP between a repeat and the first.")
    out += ["", "| op | cases varying / cases | max distinct results (repeats) | max ULP: median over cases / max | "
            "tree: max distinct | atomic-only config | disagreement | not all equal | acc SD, pt | first differing step |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    kops = kn.get("ops") or {}
    for r in link_rows(res):
        tree = (kops.get(r["op"]) or {}).get("tree", {})
        rep = f" ({r['repeats']})" if r.get("repeats") else ""
        out.append(f"| {r['op']} | {r.get('cases_varying', '-')} / {r.get('cases', '-')} | {r.get('max_distinct', '-')}{rep} | "
                   f"{num(r.get('median_max_ulp'), 4)} / {num(r.get('max_max_ulp'), 4)} | {tree.get('max_distinct', '-')} | "
                   f"`{r['config']}` | {pct(r['disagreement'], r['disagreement_se'])} | {pct(r['frac_not_all_equal'])} | "
                   f"{sd_se(r['acc'], 100)} | {r['steps']} |")
    out.append("")
    if have_plot:
        out += [f"![kernel noise vs divergence]({stem}_link.png)", ""]
    return out


def wall_line(w: dict) -> str:
    """One sentence for ``wall_summary``'s dict (status and the report)."""
    gpus = "/".join(str(g) for g in w["gpus"])
    parts = "" if w["parts"] == 1 else f" over {w['parts']} runs ({', '.join(f'{x:.0f}' for x in w['part_s'])} s)"
    where = "the CPU" if w["gpus"] == [0] else f"{gpus} GPU{'s' if w['gpus'] != [1] else ''}"
    hosts = "" if len(w["hosts"]) == 1 else f" on {len(w['hosts'])} hosts (by host name)"
    return (f"{w['trained']} members trained in {w['total_s']:.0f} s of wall time{parts}, on {where}{hosts}, "
            f"{'/'.join(str(j) for j in w['jobs'])} at a time" + (", under MPS" if w["mps"] == [True] else "")
            + (f"; {w['interrupted']} run(s) interrupted" if w["interrupted"] else "")
            + (f"; {w['failed']} run(s) ended by an error" if w.get("failed") else ""))


def cost_section(res: dict) -> list[str]:
    out = ["## Cost of determinism at the training level", ""]
    t = res.get("timing")
    if t and t.get("rows"):
        rows = t["rows"]
        r0 = rows[0]
        clock = "CUDA-event-timed" if r0.get("gpu") else "wall-clock-timed"
        out.append(f"Dedicated timing pass (`{t.get('source')}`, `bench/dev/train_step_time.py`): {r0.get('model')}, "
                   f"batch {r0.get('batch')}, {r0.get('layout')}, fp32 with TF32 off, on {r0.get('gpu') or r0.get('device')}; "
                   f"median of {r0.get('steps')} {clock} steps per mode, modes interleaved in rounds in one process.")
        if not r0.get("gpu"):
            out.append("On a CPU that other processes share these medians are noisy (compare p10 and p90); the "
                       "ratios that matter are the GPU's.")
        out += ["", "| mode | median ms/step | p10 | p90 | x native | x torch deterministic |", "|---|---|---|---|---|---|"]
        labels = {"native": "stock PyTorch (default algorithms; on GPU cuDNN's may be nondeterministic)",
                  "torch_deterministic": "stock, `use_deterministic_algorithms(True)` + `cudnn.deterministic`",
                  "atomic": "nnrand `atomic` (all routed ops)", "tree": "nnrand `tree` (all routed ops)"}
        for r in rows:
            mode = r.get("mode", "?")
            out.append(f"| {labels.get(mode, mode)} | {num(r.get('median_ms'), 4)} | {num(r.get('p10_ms'), 4)} | "
                       f"{num(r.get('p90_ms'), 4)} | {num(r.get('x_native'), 3)} | "
                       f"{num(r.get('x_torch_deterministic'), 3)} |")
    else:
        out.append("No timing pass in these results (it runs once every member is done; `--no-timing` skips it).")
    wall = res.get("train_wall")
    if wall:
        out += ["", f"Study wall time (`{wall.get('ledger')}` beside the run directories; worker start-up and training, not the "
                f"collection or the timing pass): {wall_line(wall)}."]
    members = [(n, c) for n, c in res["configs"].items() if _ok(c.get("step_time_ms"))]
    if members:
        out += ["", "From the members' own metrics (median over members of each member's median step_time_ms, "
                "measured during the study's training; other processes may share the device): " +
                ", ".join(f"`{n}` {num(c['step_time_ms'], 4)} ms" for n, c in members) + "."]
    return out + [""]


PUBLISHED = {"impl": 0.106, "algo": 0.107, "acc_sd": 0.0026, "epochs": 500, "runs": 100}   # Summers & Dinneen
AGREE = 0.15   # |impl / algo - published ratio| within this reads "about the same", as they found (unless this
               # study's paired test resolves a difference: then "nearly")


def published_section(res: dict) -> list[str]:
    """The published reference point, and whether this study's impl-vs-algo answer agrees with it."""
    out = ["## Published figures for context", "",
           "Summers & Dinneen (2021, \"Nondeterminism and instability in neural network optimization\"), CIFAR-10, "
           f"ResNet-14, {PUBLISHED['epochs']} epochs, {PUBLISHED['runs']} runs per setting: pairwise disagreement "
           f"**{100 * PUBLISHED['algo']:.1f}%** with all noise sources and **{100 * PUBLISHED['impl']:.1f}%** with cuDNN "
           f"nondeterminism alone (every seed fixed); accuracy SD about **{100 * PUBLISHED['acc_sd']:.2f} pt**. "
           "They report that each source alone, down to a one-bit change of one initial weight, gives nearly the "
           "variability of all sources together.", ""]
    cfg = res["configs"]
    lr0 = _lrs(cfg)[0]
    iname, impl = _first(cfg, HEADLINE_IMPL, lr0)
    aname, algo = _first(cfg, HEADLINE_ALGO, lr0)
    setup = next((c["setup"] for c in cfg.values() if c.get("setup")), None)
    if not (impl and algo and setup):
        return out + ["Not comparable yet: `impl` or `algo` lacks two finished members.", ""]
    if not _m(algo, "disagreement"):
        return out + [f"Not comparable: `{aname}` never disagreed (0 of the test images), so the ratio to it is "
                      "undefined.", ""]
    di, da = _m(impl, "disagreement"), _m(algo, "disagreement")
    ratio, ref = di / da, PUBLISHED["impl"] / PUBLISHED["algo"]
    test = comparison(res, iname, aname)
    same = abs(ratio - ref) <= AGREE
    ulp = _m(_by_entry(cfg, "ulp", lr0)[1], "disagreement")
    line = (f"**Does nnrand agree?** Implementation noise alone (`{iname}`) gives {ratio:.2f} of the disagreement of "
            f"random seeds (`{aname}`: {pct(di)} vs {pct(da)}); published {ref:.2f}. ")
    resolved = test is not None and _ok(test["disagreement"].get("p_value")) and test["disagreement"]["p_value"] < ALPHA
    if same and not resolved:
        line += ("**Yes**: as they found, the reduction order alone makes about as much prediction churn as every "
                 "seed source together" + (f" (paired test p = {p_txt(test['disagreement'])})" if test else "") + ".")
    elif same:
        # the ratio is near theirs, but this study's members tell the two apart: say both
        line += (f"**Nearly**: as they found, the reduction order alone makes most of the prediction churn of every "
                 f"seed source together, but here measurably {'less' if ratio < 1 else 'more'} "
                 f"(paired test p = {p_txt(test['disagreement'])}; published {100 * PUBLISHED['impl']:.1f}% vs "
                 f"{100 * PUBLISHED['algo']:.1f}%).")
    else:
        line += (f"**No**: here it makes {'less' if ratio < ref else 'more'}" +
                 (f" (paired test p = {p_txt(test['disagreement'])})" if test else "") + ".")
    if ulp is not None:
        line += f" One ULP in one weight (`ulp`): {ulp / da:.2f} of `{aname}` ({pct(ulp)})."
    acc_sd = _m(algo, "accuracy")
    if acc_sd is not None:
        line += f" Accuracy SD of `{aname}`: {sd_se(acc_sd, 100, unit=' pt')} (published ~{100 * PUBLISHED['acc_sd']:.2f} pt)."
    out += [line, "",
            f"How this study differs: a synthetic 10-class shape dataset with a labelled minority subgroup (not "
            f"CIFAR-10); {setup['model']} rather than ResNet-14; {setup['epochs']} epochs rather than "
            f"{PUBLISHED['epochs']}; {res['members']} members per configuration rather than {PUBLISHED['runs']}; and "
            "nondeterminism from nnrand's own atomic kernels, routed into the backward pass op by op, beside stock "
            "cuDNN, rather than cuDNN alone. A short schedule leaves less time for differences to grow, so a lower "
            "disagreement overall than theirs is expected; the ratio between configurations of the same study is "
            "what is compared.", ""]
    return out


def missing_section(res: dict) -> list[str]:
    miss = [res["configs"][n] for n in res.get("missing", [])]
    if not miss:
        return []
    out = ["## Missing", "", "These configurations have fewer finished members than requested; their rows show "
           "what exists. Resume with the same command: `" + res.get("command", "python -m nnrand.study") + "`.", ""]
    out += [f"- `{c['name']}`: {c['done']}/{c['requested']} members finished" for c in miss]
    return out + [""]


def render(res: dict | str | Path, md_path: str | Path, examples_path: str | Path | None = None) -> Path:
    """Write the report (and its PNGs, named ``<md stem>_*.png`` beside it); return its path."""
    if not isinstance(res, dict):
        res = json.loads(Path(res).read_text())
    md_path = Path(md_path)
    stem = md_path.stem
    arrays = {}
    if examples_path is not None and Path(examples_path).exists():
        with np.load(examples_path) as f:
            arrays = {k: f[k] for k in f.files}
    cfg = res["configs"]
    png = lambda name: md_path.parent / f"{stem}_{name}.png"  # noqa: E731
    have = {"disagreement": plot_disagreement(cfg, png("disagreement")), "l2": plot_l2(cfg, png("l2")),
            "groups": plot_groups(cfg, png("groups")), "flips": plot_flips(res, arrays, png("flips"))}
    refs = {e: _m(_by_entry(cfg, e, _lrs(cfg)[0])[1], "disagreement") for e in ("algo", "impl", "native")}
    have["link"] = plot_link(link_rows(res), refs, png("link"))

    setup = next((c["setup"] for c in cfg.values() if c.get("setup")), None)
    fp = res.get("fingerprint") or {}
    where = fp.get("gpu") or f"CPU ({fp.get('platform', 'unknown')})"
    size = ", smoke sizes" if res.get("smoke") else ", quick grid" if res.get("quick") else ""
    lines = [f"# Divergence study ({res['backend']}{size})", ""]
    if res.get("smoke"):
        lines += ["**Smoke sizes** (`--smoke`): two tiny members per configuration, a few training steps each. "
                  "This report checks that every configuration trains, collects and renders; its numbers say "
                  "nothing about divergence.", ""]
    if setup:
        lines += [f"{setup['model']} on {setup['dataset']} ({setup['n_train']} training / {setup['n_test']} test images), "
                  f"{setup['epochs']} epoch{'s' if setup['epochs'] != 1 else ''} of batch {setup['batch_size']}, peak lr {setup['lr']}, {res['members']} members "
                  f"per configuration, on {where}. Rendered from `{res['stem']}.json` "
                  f"(collected {res.get('collected')}).", ""]
    if res["backend"] == "cpu":
        lines += ["On CPU the `atomic` variants run their order models, which draw a fresh random arrival order "
                  "per call (a random order each time, not a GPU's frequency of reordering), and stock PyTorch "
                  "(`native`) is deterministic: the GPU report (`reports/divergence.md`) is the one that speaks "
                  "for cuDNN.", ""]
    lines += headline(res)
    if have["disagreement"]:
        lines += [f"![disagreement per configuration]({stem}_disagreement.png)", ""]
    lines += main_table(res)
    lines += interval_table(res)
    lines += comparison_table(res)
    if have["l2"]:
        lines += ["Weight distance over training (configurations whose members differ at all; `control` stays at "
                  "exactly 0 when its members are bitwise identical):", "", f"![weight L2 per epoch]({stem}_l2.png)", ""]
    lines += groups_table(res)
    if have["groups"]:
        lines += [f"![subgroup disagreement]({stem}_groups.png)", ""]
    if have["flips"]:
        lines += ["Most-disagreed test images (rows: configurations with the most disagreement; caption: index, true "
                  "class, `(min)` for the minority subgroup, then each member's prediction):", "",
                  f"![most-disagreed test images]({stem}_flips.png)", ""]
    elif res.get("images_note"):
        lines += [f"No image grid: {res['images_note']}.", ""]
    lines += link_section(res, stem, have["link"])
    lines += cost_section(res)
    lines += published_section(res)
    lines += missing_section(res)
    lines += ["## Study settings", "", "| configuration | lr | seeds (init/order/aug/kernel) | routing | model |",
              "|---|---|---|---|---|"]
    for n, c in cfg.items():
        s = c.get("setup")
        if not s:
            lines.append(f"| `{n}` | {c.get('lr')} | (no finished member) | | |")
            continue
        seeds = "/".join(str(s["seeds"][k]) for k in ("init", "order", "aug", "kernel"))
        rt = ", ".join(f"{op}={v}" for op, v in s["routing"].items())
        lines.append(f"| `{n}` | {s['lr']} | {seeds} | {rt} | {s['model']} |")
    lines += ["", f"Flags (first configuration): `{json.dumps(setup['flags']) if setup else '-'}`. "
              "Command: `" + res.get("command", "python -m nnrand.study") + "`; run directories under "
              f"`{res.get('runs_dir')}`.", ""]
    lines += ["## Environment", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in fp.items()]
    shas = {c["fingerprint"].get("git_sha") for c in cfg.values() if c.get("fingerprint")}
    if len(shas) > 1:
        lines += ["", f"Configurations ran at different commits: {', '.join(sorted(str(s) for s in shas))}."]
    runio.write_text(md_path, "\n".join(lines) + "\n")
    return md_path


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nnrand.divergence_report",
                                description="Render the divergence report from a study's results JSON.")
    p.add_argument("results", help="reports/results/<stem>.json")
    p.add_argument("--out", help="report path (default reports/<stem>.md beside results/)")
    args = p.parse_args(argv)
    res_path = Path(args.results)
    out = Path(args.out) if args.out else res_path.parent.parent / f"{res_path.stem}.md"
    examples = res_path.with_name(f"{res_path.stem}_examples.npz")
    print(render(res_path, out, examples))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
