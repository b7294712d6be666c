#!/usr/bin/env python3
"""Paired comparisons from `dropkv-quality --per-prompt FILE` (JSON lines, one per configuration).

Every configuration ran the same prompts, so presses are compared prompt by prompt: for each
(keep, allocator) and each ordered pair (A, B) the issue expects A >= B, it prints the mean paired
difference of prefix agreement (A - B) and of first-step KL (B - A, so positive = A better), each
with its standard error, and the median KL of both. |diff| > 2 s.e. is marked as significant.

  python3 bench/quality/compare.py q200.jsonl [--pairs dropkv:snapkv,snapkv:h2o,...]
"""
import argparse
import json
import math
import statistics


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def verdict(m, se):
    if abs(m) <= 2 * se:
        return "~"
    return ">" if m > 0 else "<"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("per_prompt")
    ap.add_argument("--pairs", default="dropkv:snapkv,snapkv:h2o,h2o:streaming_llm,"
                    "streaming_llm:random,h2o_vl2:h2o,dropkv:random,snapkv:streaming_llm")
    ap.add_argument("--allocator-pairs", default="mga:uniform,mlp:uniform")
    args = ap.parse_args()
    runs = {}
    for line in open(args.per_prompt):
        r = json.loads(line)
        runs[(r["method"], round(r["keep"], 4), r["allocator"])] = r
    keeps = sorted({k for _, k, _ in runs})
    allocs = sorted({a for _, _, a in runs})
    methods = sorted({m for m, _, _ in runs})

    print("| A vs B | keep | allocator | prefix A-B (s.e.) | KL B-A (s.e.) | A better (prefix / KL) | median KL A / B |")
    print("|---|---|---|---|---|---|---|")

    def row(label, ra, rb, keep, alloc):
        dp = [a - b for a, b in zip(ra["prefix"], rb["prefix"])]
        dk = [b - a for a, b in zip(ra["kl"], rb["kl"])]
        mp, sp = mean_se(dp)
        mk, sk = mean_se(dk)
        print(f"| {label} | {keep:.2f} | {alloc} | {mp:+.3f} ({sp:.3f}) | {mk:+.4f} ({sk:.4f}) | "
              f"{verdict(mp, sp)} / {verdict(mk, sk)} | "
              f"{statistics.median(ra['kl']):.4f} / {statistics.median(rb['kl']):.4f} |")

    # (label, key of A, key of B, allocator column): method pairs per allocator, then allocator
    # pairs per method.
    cells = []
    for pair in args.pairs.split(","):
        a, b = pair.split(":")
        cells += [(f"{a} vs {b}", (a, k, al), (b, k, al), al) for k in keeps for al in allocs]
    for pair in args.allocator_pairs.split(","):
        a, b = pair.split(":")
        cells += [(f"{m}: {a} vs {b}", (m, k, a), (m, k, b), "-") for m in methods for k in keeps]
    for label, key_a, key_b, alloc in cells:
        if key_a in runs and key_b in runs:
            row(label, runs[key_a], runs[key_b], key_a[1], alloc)

if __name__ == "__main__":
    main()
