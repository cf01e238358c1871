"""The run report, rendered from the members' result files only (never reruns anything).

    python -m nnrand.report runs/control_tree_small     # writes report.md and report_curves.png there

Contents: the routing and seeds, a table of final metrics per member, top-1/top-5 test curves, the
first step at which each member's weight checksum leaves member 0's (the divergence point), the
prediction disagreement between members, and the environment fingerprint.
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from nnrand import runio


def _members(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("member_*") if (p / "config.json").exists())


def _load(member: Path) -> dict:
    out = {"dir": member, "config": runio.read_json(member / "config.json"), "result": None,
           "metrics": [], "checksums": []}
    if (member / "result.json").exists():
        out["result"] = runio.read_json(member / "result.json")
    if (member / "metrics.csv").exists():
        out["metrics"] = runio.read_csv(member / "metrics.csv")
    if (member / "checksums.csv").exists():
        out["checksums"] = runio.read_csv(member / "checksums.csv")
    return out


def first_divergence(a: list[dict], b: list[dict]) -> int | None:
    """The first step recorded in both checksum tables where they differ; None if none do."""
    cb = {int(r["step"]): r["checksum"] for r in b}
    for r in a:
        s = int(r["step"])
        if s in cb and cb[s] != r["checksum"]:
            return s
    return None


def _plot(members: list[dict], path: Path) -> bool:
    rows = [(m, m["metrics"]) for m in members if m["metrics"]]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for ax, key, title in ((axes[0], "test_top1", "test top-1"), (axes[1], "test_top5", "test top-5")):
        for m, metrics in rows:
            evaluated = [r for r in metrics if r.get(key)]   # epochs without a test evaluation (--eval-every)
            ax.plot([int(r["epoch"]) + 1 for r in evaluated], [float(r[key]) for r in evaluated], marker="o", ms=3,
                    lw=1, label=m["dir"].name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    if len(rows) <= 10:
        axes[0].legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    runio.write_bytes(path, buf.getvalue())
    return True


def _disagreement(members: list[dict]) -> list[tuple[str, float, float]]:
    """(member, fraction of test predictions that differ from member 0's, max |logit diff|)."""
    ref = members[0]["dir"] / "predictions.npz"
    if not ref.exists():
        return []
    with np.load(ref) as f:
        base = f["logits"]
    out = []
    for m in members[1:]:
        p = m["dir"] / "predictions.npz"
        if p.exists():
            with np.load(p) as f:
                logits = f["logits"]
            out.append((m["dir"].name, float(np.mean(logits.argmax(1) != base.argmax(1))),
                        float(np.max(np.abs(logits - base)))))
    return out


def render(run_dir: str | Path) -> Path:
    """Write ``report.md`` (and ``report_curves.png``) in ``run_dir``; return the report's path."""
    run_dir = Path(run_dir)
    members = [_load(p) for p in _members(run_dir)]
    if not members:
        raise FileNotFoundError(f"no member_*/config.json under {run_dir}")
    first = members[0]["config"]
    cfg = first["config"]
    lines = [f"# Run `{run_dir.name}`", ""]
    lines += [f"model **{cfg['model']}**, dataset **{cfg['dataset']}** (n_train {cfg['n_train']}, "
              f"n_test {cfg['n_test']}), {cfg['epochs']} epochs of batch {cfg['batch_size']}, "
              f"lr {cfg['lr']}, momentum {cfg['momentum']}, weight decay {cfg['weight_decay']}, "
              f"augmentation crop + flip{' + channel shuffle' if cfg.get('shuffle_channels') else ''}, "
              f"device {cfg['device']}, preset **{cfg['preset']}**.", ""]
    lines += ["## Routing of backward reductions", "", "| op | requested | used |", "|---|---|---|"]
    r = first["routing"]
    lines += [f"| {op} | {r['requested'][op]} | {used} |" for op, used in r["ops"].items()]
    lines += [""] + [f"- note: {n}" for n in r["notes"].values()] + [""]
    lines += ["Seed specs: " + ", ".join(f"{s} = `{cfg[s + '_seed']}`" for s in ("init", "order", "aug", "kernel"))
              + f" (base seed {cfg['seed']}); flags: " + json.dumps(first["flags"]), ""]

    lines += ["## Members", "",
              "| member | done | test top-1 | test top-5 | test loss | train loss | step ms (median) | "
              "first step differing from member 0 | final checksum |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in members:
        res = m["result"]
        div = "-" if m is members[0] else (first_divergence(m["checksums"], members[0]["checksums"]) or "none")
        if res is None:
            last = m["metrics"][-1] if m["metrics"] else {}
            lines.append(f"| {m['dir'].name} | no (epoch {len(m['metrics'])}) | {last.get('test_top1', '-')} | "
                         f"{last.get('test_top5', '-')} | | | | {div} | |")
            continue
        lines.append(f"| {m['dir'].name} | yes | {res['test_top1']:.4f} | {res['test_top5']:.4f} | "
                     f"{res['test_loss']:.4f} | {res['train_loss']:.4f} | {res['step_time_ms']:.2f} | {div} | "
                     f"{res['final_checksum']} |")
    lines.append("")
    dis = _disagreement(members)
    if dis:
        lines += ["Prediction disagreement with member 0 (fraction of test images whose top-1 class differs; "
                  "largest absolute logit difference):", ""]
        lines += [f"- {name}: {frac:.4f}, {mx:.3g}" for name, frac, mx in dis] + [""]
    for m in members:
        seeds = m["config"]["seeds"]
        pert = m["config"].get("perturb")
        lines.append(f"- {m['dir'].name} seeds: {json.dumps(seeds)}" + (f"; perturbed {json.dumps(pert)}" if pert else ""))
    lines.append("")
    if _plot(members, run_dir / "report_curves.png"):
        lines += ["## Test accuracy per epoch", "", "![top-1 and top-5 test accuracy](report_curves.png)", ""]
    lines += ["## Environment", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in first["fingerprint"].items()]
    shas = {m["config"]["fingerprint"].get("git_sha") for m in members}
    if len(shas) > 1:
        lines += ["", f"Members ran at different commits: {', '.join(sorted(str(s) for s in shas))}."]
    path = run_dir / "report.md"
    runio.write_text(path, "\n".join(lines) + "\n")
    return path


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nnrand.report", description="Render a run's report.md from its files.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    print(render(args.run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
