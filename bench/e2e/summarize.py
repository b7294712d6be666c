#!/usr/bin/env python3
"""Prints the end-to-end table from dropkv-bench-e2e --json outputs (one file per geometry)."""
import json
import sys


def main():
    print(f"{'geometry':<16} {'case':<34} {'ours':>10} {'HF':>10} {'HF/ours':>8}")
    for path in sys.argv[1:]:
        try:
            text = open(path).read()
            r = json.loads(text[text.index("{"):])  # tolerate log lines before the object
        except (OSError, ValueError) as e:
            print(f"{path}: unreadable ({e})")
            continue
        name = r["model"].rstrip("/").split("/")[-1]
        hf = r.get("hf", {})
        hf_pre = {p["tokens"]: p["ms"] for p in hf.get("prefill", [])}
        hf_dec = {(d["batch"], d["context"]): d["ms_per_step"] for d in hf.get("decode", [])}
        for p in r["prefill"]:
            peer = hf_pre.get(p["tokens"]) if p["keep"] == 1.0 else None
            case = f"prefill {p['tokens']} keep {p['keep']:.2f} (ms)"
            ratio = f"{peer / p['ms']:.2f}" if peer else "-"
            print(f"{name:<16} {case:<34} {p['ms']:>10.1f} {peer or 0:>10.1f} {ratio:>8}")
            print(f"{name:<16} {'  peak GiB (resident ' + format(p['weights_bytes'] / 2**30, '.1f') + ')':<34} "
                  f"{p['peak_bytes'] / 2**30:>10.2f}")
        for d in r["decode"]:
            graphs = d.get("graphs", True)
            peer = hf_dec.get((d["batch"], d["context"])) if d["keep"] == 1.0 else None
            mode = "" if graphs else " eager"
            case = f"decode bs{d['batch']} ctx{d['context']} keep {d['keep']:.2f}{mode} (ms)"
            ratio = f"{peer / d['ms_per_step']:.2f}" if peer else "-"
            print(f"{name:<16} {case:<34} {d['ms_per_step']:>10.2f} {peer or 0:>10.2f} {ratio:>8}")
        for t in r.get("throughput", []):
            case = f"full-mem bs{t['batch']} ctx{t['context']} keep {t['keep']:.2f} tok/s"
            print(f"{name:<16} {case:<34} {t['tokens_per_s']:>10.0f}   ({t['ms_per_step']:.1f} ms/step)")
        for c in r["capacity"]:
            print(f"{name:<16} {'32K seqs that fit, keep ' + format(c['keep'], '.2f'):<34} {c['sequences']:>10}")


if __name__ == "__main__":
    main()
