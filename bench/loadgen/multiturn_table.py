#!/usr/bin/env python3
"""Markdown tables from `dropkv-loadgen --turns N --json` reports (bash bench/run.sh multiturn):
per (compression, streams), a row per turn with the variants' TTFT side by side; then a row per
(variant, compression, streams) with the run's totals and its dropkv_prefix_cache* /metrics deltas.
Each folder is one server variant (its name is the folder's), holding turns_<mode>_c<N>.json.
  python3 bench/loadgen/multiturn_table.py OUT/multiturn/off OUT/multiturn/on
"""
import glob
import json
import os
import re
import sys


def load(folders):
    runs = {}  # (compression, streams) -> {variant: report}
    for folder in folders:
        variant = os.path.basename(os.path.normpath(folder))
        for path in sorted(glob.glob(os.path.join(folder, "turns_*_c*.json"))):
            try:
                with open(path) as f:
                    r = json.load(f)
            except (OSError, ValueError):
                print(f"(skipped {path}: no report)")
                continue
            c = r["config"]
            key = (",".join(c["compression"]) or "default", c["concurrency"])
            runs.setdefault(key, {})[variant] = r
    return runs


def prefix_cache_deltas(r):
    # The model label is the same everywhere; other labels stay.
    return {re.sub(r'model="[^"]*",?', "", k).replace("{}", ""): v
            for k, v in r["metrics_delta"].items() if k.startswith("dropkv_prefix_cache")}


def main(folders):
    variants = [os.path.basename(os.path.normpath(f)) for f in folders]
    runs = load(folders)
    order = sorted(runs, key=lambda k: (k[0] != "none", k[0], k[1]))
    for comp, streams in order:
        by_variant = runs[(comp, streams)]
        shown = [v for v in variants if v in by_variant]
        first = by_variant[shown[0]]
        print(f"\n### compression {comp}, {streams} streams: TTFT per turn, ms (p50 / p90 / p99)\n")
        print("| turn | mean prompt len | "
              + " | ".join(f"{v}: ok | {v}: prefilled | {v}: TTFT" for v in shown) + " |")
        print("|---:|---:|" + "---:|---:|---|" * len(shown))
        for k, t in enumerate(first.get("turns", [])):
            cells = []
            for v in shown:
                turns = by_variant[v].get("turns", [])
                if k >= len(turns):
                    cells += ["", "", ""]
                    continue
                p = turns[k]["ttft_ms"]
                # Prompt tokens the server prefilled: the rest came from its prefix cache.
                prefilled = turns[k]["mean_prompt_len"] - turns[k].get("mean_cached_prompt_tokens", 0)
                cells += [str(turns[k]["requests_ok"]), f"{prefilled:.0f}",
                          f"{p['p50']:.0f} / {p['p90']:.0f} / {p['p99']:.0f}"]
            print(f"| {t['turn']} | {t['mean_prompt_len']:.0f} | " + " | ".join(cells) + " |")
    print("\n### runs\n")
    print("| variant | compression | streams | ok | errors | conversations cut | prompt tokens | "
          "out tok/s | dropkv_prefix_cache* deltas |")
    print("|---|---|---:|---:|---|---:|---:|---:|---|")
    for comp, streams in order:
        for v in variants:
            r = runs[(comp, streams)].get(v)
            if r is None:
                continue
            errors = ", ".join(f"{k} {n}" for k, n in r["errors"].items()) or "0"
            deltas = ", ".join(f"`{k}` {n:g}" for k, n in prefix_cache_deltas(r).items())
            print(f"| {v} | {comp} | {streams} | {r['requests_ok']} | {errors} | "
                  f"{r.get('conversations_cut', 0)} | {r['prompt_tokens']} | "
                  f"{r['output_tokens_per_s']:.1f} | {deltas or 'none on /metrics'} |")


if __name__ == "__main__":
    main(sys.argv[1:])
