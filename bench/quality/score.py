#!/usr/bin/env python3
"""Tables from the per-prompt results of dropkv-quality-tasks (--out) and kvpress_tasks.py.

Each input line is one prompt under one configuration: {engine, method, keep, allocator, window,
task, length, idx, format, answers, match, text, score}. A prompt's score is RULER's string match
(answer_score below; dropkv-quality-tasks computes the same in C++, task_eval.cpp, and this script
checks that the two agree on every line it reads). Prints, per (task, length, format), accuracy
as mean +- standard error with n for every (engine, method, keep), and the paired difference of
each configuration against ours DropKV (uniform allocator) at the same keep (prompts matched by
idx), with its standard error; |diff| > 2 s.e. is marked. A DepthKV allocator other than uniform
is named in brackets after the method, and its row is paired against the same method and settings
under the uniform allocator. A run with FP8 weights or an FP8 KV cache (dropkv-quality-tasks
--quantization fp8 / --kv-cache-dtype fp8) is named after the method too ("FP8 weights",
"FP8 KV"), and its rows are paired against the same method, settings and allocator with the
model's own weights and KV dtype (with how many prompts give the same output text). An
automatic budget (dropkv:tolN, "auto, tolerance" in its name) shows its ceiling and the mean
fraction it kept.

  python3 bench/quality/score.py ours.jsonl kvpress.jsonl [--reference dropkv]

--formats chat:raw adds, per (task, length), each configuration's paired difference between the
two prompt formats (tasks.py builds the same needle for both from the same seed, so prompts are
matched by idx).
"""
import argparse
import collections
import json
import math


def answer_score(text, answers, match="all"):
    """RULER string_match_all / _part: the fraction (all) or any (any) of the answers found in
    the text, case-insensitive."""
    t = text.lower()
    found = sum(1 for a in answers if a.lower() in t)
    if match == "any":
        return 1.0 if found else 0.0
    return found / len(answers) if answers else 0.0


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def variant(r):
    """Our ablation settings that differ from the defaults, as a suffix of the method's name."""
    v = []
    if r["engine"] == "dropkv" and r["method"] == "dropkv" and (
            r.get("pooling", "max") != "max" or r.get("pooling_kernel", 11) != 11):
        v.append(f"pooling {r['pooling']}" + (f" {r['pooling_kernel']}" if r["pooling"] != "none" else ""))
    # The engine's default lookback is 32; results written before the knob existed have none (0).
    if r.get("pooling_lookback", 0) != 32 and r["method"] == "dropkv":
        v.append(f"lookback {r['pooling_lookback']}")
    if r.get("window", 8) != 8 and r["method"] not in ("full", "none"):
        v.append(f"W {r['window']}")
    if r.get("h2o_per_query") and r["method"].startswith("h2o"):
        v.append("per-query")
    if r.get("protect_sinks") and r["method"] != "streaming_llm":
        v.append(f"sinks {r.get('num_sinks', 4)}")
    if r.get("tolerance", 0) > 0:
        v.append(f"auto, tolerance {r['tolerance']:g}")
    return f" ({', '.join(v)})" if v else ""


def numerics(r):
    """FP8 weights / FP8 KV cache, as a list of names; [] = the model's own dtypes."""
    n = []
    if r.get("quantization", "none") not in ("none", ""):
        n.append(f"{r['quantization'].upper()} weights")
    if r.get("kv_cache_dtype", "auto") not in ("auto", ""):
        n.append(f"{r['kv_cache_dtype'].upper()} KV")
    return n


def label(r):
    """The row's method name: the method, its ablation settings, then its numerics."""
    v = variant(r)
    n = numerics(r)
    if not n:
        return r["method"] + v
    inner = (v[2:-1] + ", " if v else "") + ", ".join(n)
    return f"{r['method']} ({inner})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--reference", default="dropkv", help="our method the others are paired with")
    ap.add_argument("--formats", default="", help="A:B = also pair format A against format B")
    args = ap.parse_args()
    cells = collections.defaultdict(dict)  # (task, length, format) -> (engine, method, keep) -> {idx: score}
    baseline = {}  # a row's method name -> the same method and settings with the model's dtypes
    texts = {}  # (task, length, format, key, idx) -> output text
    kept = collections.defaultdict(list)  # automatic budgets: (cell, key) -> kept fractions
    for path in args.results:
        for line in open(path):
            r = json.loads(line)
            s = answer_score(r["text"], r["answers"], r["match"])
            if "score" in r and abs(r["score"] - s) > 1e-9:
                raise SystemExit(f"{path}: score {r['score']} != {s} for {r['method']} idx {r['idx']}")
            key = (r["engine"], label(r), float(r["keep"]), r.get("allocator", "uniform"))
            if numerics(r):
                baseline[key[1]] = r["method"] + variant(r)
            cells[(r["task"], r["length"], r["format"])].setdefault(key, {})[r["idx"]] = s
            texts[(r["task"], r["length"], r["format"], key, r["idx"])] = r["text"]
            if r.get("tolerance", 0) > 0:
                kept[(r["task"], r["length"], r["format"], key)].append(r["kept_fraction"])
    for (task, length, fmt), runs in sorted(cells.items()):
        print(f"\n{task}, {length} tokens, {fmt} prompts\n")
        print(f"| method | keep | accuracy | n | paired vs our {args.reference} |")
        print("|---|---|---|---|---|")
        def is_full(name):
            return name.split(" ")[0] in ("full", "none")
        order = sorted(runs, key=lambda k: (k[2] if not is_full(k[1]) else 2.0,
                                             k[0] != "dropkv", k[1], k[3] != "uniform", k[3]))
        for key in order:
            engine, method, keep, alloc = key
            scores = runs[key]
            m, se = mean_se(list(scores.values()))
            # Paired against the reference under the uniform allocator; a DepthKV row (allocator
            # other than uniform) against the same method and settings under uniform; an FP8 row
            # against the same method, settings and allocator with the model's dtypes.
            ref_key = ("dropkv", args.reference, keep, "uniform")
            if method in baseline:
                ref_key = (engine, baseline[method], keep, alloc)
            elif alloc not in ("uniform", "-"):
                ref_key = (engine, method, keep, "uniform")
            ref = runs.get(ref_key)
            paired = ""
            if ref is not None and key != ref_key:
                common = sorted(set(ref) & set(scores))
                d = [scores[i] - ref[i] for i in common]
                if d:
                    dm, dse = mean_se(d)
                    mark = " *" if abs(dm) > 2 * dse and dse > 0 else ""
                    paired = f"{dm:+.3f} ({dse:.3f}){mark}"
                    if method in baseline:  # FP8 against the model's dtypes: same output text?
                        cell = (task, length, fmt)
                        same = sum(texts[cell + (key, i)] == texts[cell + (ref_key, i)]
                                   for i in common)
                        paired += f", same text {same}/{len(common)}"
            name = method if engine == "dropkv" else f"kvpress {method}"
            if alloc not in ("uniform", "-"):
                name += f" [{alloc}]"
            keep_s = "1.00" if method in ("full", "none") else f"{keep:.2f}"
            if kept.get((task, length, fmt, key)):  # automatic: the ceiling, then what it kept
                keep_s = f"<= {keep:.2f}: {sum(kept[(task, length, fmt, key)]) / len(scores):.3f}"
            print(f"| {name} | {keep_s} | {m:.3f} ± {se:.3f} | {len(scores)} | {paired} |")
    if args.formats:
        fa, fb = args.formats.split(":")
        for (task, length) in sorted({(t, l) for t, l, _ in cells}):
            a, b = cells.get((task, length, fa)), cells.get((task, length, fb))
            if not a or not b:
                continue
            print(f"\n{task}, {length} tokens: {fa} against {fb} prompts (paired by idx)\n")
            print(f"| method | keep | {fa} | {fb} | n | {fa} - {fb} |")
            print("|---|---|---|---|---|---|")
            for key in sorted(set(a) & set(b), key=lambda k: (k[2], k[0], k[1], k[3])):
                common = sorted(set(a[key]) & set(b[key]))
                if not common:
                    continue
                ma, sa = mean_se([a[key][i] for i in common])
                mb, sb = mean_se([b[key][i] for i in common])
                dm, dse = mean_se([a[key][i] - b[key][i] for i in common])
                mark = " *" if abs(dm) > 2 * dse and dse > 0 else ""
                name = key[1] if key[0] == "dropkv" else f"kvpress {key[1]}"
                if key[3] not in ("uniform", "-"):
                    name += f" [{key[3]}]"
                print(f"| {name} | {key[2]:.2f} | {ma:.3f} ± {sa:.3f} | {mb:.3f} ± {sb:.3f} | "
                      f"{len(common)} | {dm:+.3f} ({dse:.3f}){mark} |")


if __name__ == "__main__":
    main()
