#!/usr/bin/env python3
"""Accuracy against keep ratio, one panel per (task, length, format), from the per-prompt results
of dropkv-quality-tasks / kvpress_tasks.py (the files score.py reads). Needs matplotlib (not in the
project's venvs: any Python with matplotlib will do, the script imports nothing else outside the
standard library). Error bars are one standard error over prompts; the full cache is a dashed
line with its band.

  python3 bench/quality/plot.py --title "Gemma-3-270M" --out docs/img/quality_gemma.png R1.jsonl ...
      [--methods dropkv,dropkv (pooling max 21),snapkv,...]   (labels as score.py prints them)
"""
import argparse
import collections
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score import answer_score, mean_se, variant  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--methods", default="", help="only these labels (comma-separated)")
    args = ap.parse_args()
    keep_only = set(args.methods.split(",")) if args.methods else None
    cells = collections.defaultdict(lambda: collections.defaultdict(dict))
    for path in args.results:
        for line in open(path):
            r = json.loads(line)
            if r.get("allocator", "uniform") not in ("uniform", "-"):
                continue
            label = r["method"] + variant(r)
            if r["engine"] != "dropkv":
                label = f"kvpress {label}"
            if keep_only is not None and label not in keep_only and r["method"] != "full":
                continue
            s = answer_score(r["text"], r["answers"], r["match"])
            cells[(r["task"], r["length"], r["format"])][(label, float(r["keep"]))][r["idx"]] = s
    panels = sorted(cells)
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    # One colour per label across panels.
    labels = sorted({lab for c in cells.values() for (lab, _) in c
                     if lab not in ("full", "kvpress full")})
    colour = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    for ax, key in zip(axes.flat, panels):
        runs = cells[key]
        full = [v for (label, _), v in runs.items() if label in ("full", "kvpress full")]
        by_label = collections.defaultdict(list)
        for (label, keep), scores in runs.items():
            if label not in ("full", "kvpress full"):
                by_label[label].append((keep, *mean_se(list(scores.values())), len(scores)))
        for label in sorted(by_label):
            pts = sorted(by_label[label])
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                        marker="o", capsize=3, label=f"{label} (n {min(p[3] for p in pts)})",
                        color=colour[label],
                        linestyle="--" if label.startswith("kvpress") else "-")
        if full:
            m, se = mean_se(list(full[0].values()))
            ax.axhline(m, color="k", linestyle=":", label=f"full cache (n {len(full[0])})")
            ax.axhspan(m - se, m + se, color="k", alpha=0.08)
        ax.set_xscale("log")
        keeps = sorted({k for (_, k) in runs if k < 1})
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(keeps)
        ax.set_xticklabels([f"{k:g}" for k in keeps])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("keep ratio")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{key[0]}, {key[1]} tokens, {key[2]}")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
