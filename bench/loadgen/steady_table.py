#!/usr/bin/env python3
"""One Markdown table from `dropkv-loadgen --steady --json` reports (bash bench/run.sh load):
a row per (concurrency, compression), compressions side by side, and each compressed row's
throughput as a multiple of the uncompressed row at the same concurrency.
  python3 bench/loadgen/steady_table.py OUT/load_*_c*.json
"""
import json
import sys


def main(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        c = r["config"]
        rows.append((c["concurrency"], ",".join(c["compression"]) or "default", r))
    rows.sort(key=lambda x: (x[0], x[1] != "none", x[1]))
    base = {conc: r["output_tokens_per_s"] for conc, comp, r in rows if comp == "none"}
    print("| compression | conc. | window s | done | in flight at end | errors | req/s | out tok/s "
          "| vs none | TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---|")
    for conc, comp, r in rows:
        ratio = (f"{r['output_tokens_per_s'] / base[conc]:.2f}x"
                 if comp != "none" and base.get(conc) else "")
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        pct = lambda k: f"{r[k]['p50']:.0f} / {r[k]['p99']:.0f}"
        itl = f"{r['itl_ms']['p50']:.1f} / {r['itl_ms']['p99']:.1f}"
        print(f"| {comp} | {conc} | {r['measured_s']:.0f} | {r['requests_ok']} | "
              f"{r['cancelled_at_end']} | {errors} | {r['requests_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {ratio} | {pct('ttft_ms')} | {itl} | "
              f"{pct('e2e_ms')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
