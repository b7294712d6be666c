#!/usr/bin/env python3
"""What compression during decode loses: long answers against the full cache.

Chat prompts that ask for a long answer about a named character (short prompts: the cache is
almost all generated tokens, the case compression at prefill cannot help). Each prompt is answered
greedily with the full cache, then under each setting; per setting it prints, over the prompts:
  prefix      mean fraction of the answer before its first token that differs from the full cache's
  agreement   mean fraction of positions with the same token
  name_late   share of answers that still name the character in their last quarter, where the
              full cache's answer does (the name is in the prompt: a long-range fact)
  kept        mean KV entries per layer at the end, as a share of the tokens seen
on a running dropkv-server (its OpenAI HTTP API, chat template applied by the server).

  python3 bench/quality/decode_compression.py --url http://127.0.0.1:8000 [--num 20] [--tokens 384]
"""
import argparse
import concurrent.futures
import json
import random
import statistics
import urllib.request

NAMES = ["Marisol", "Tobias", "Ingrid", "Kwame", "Yuki", "Anselm", "Priya", "Dorothea", "Lucan",
         "Fenella", "Oskar", "Zainab", "Ruairi", "Hedda", "Caspian", "Noor", "Bertil", "Ottilie",
         "Emeric", "Saoirse", "Thaddeus", "Ilse", "Mateo", "Clementine"]
TOPICS = ["keeps a lighthouse on a stormy island", "repairs clocks in an old city",
          "sails a small boat around the world", "runs a bakery in a mountain village",
          "studies the stars from a desert observatory", "trains horses on a windy farm",
          "writes letters to a friend far away", "explores a cave full of crystals"]


def served_model(url):
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def chat(url, model, prompt, tokens, compression):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if compression:
        body["kv_compression"] = compression
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return choice["token_ids"], choice["message"]["content"], out["usage"]


def settings(methods, keeps, budgets, margins):
    """Keep ratios compress the prompt too (a row without decode_margin shows what that alone
    costs); a token budget above the prompt's length leaves the prompt whole, so its rows show
    what compression during decode alone costs."""
    rows = [("full cache", None)]
    for method in methods:
        for keep in keeps:
            base = {"method": method, "keep_ratio": keep}
            rows.append((f"{method} keep {keep:g}, prefill only", base))
            for m in margins:
                rows.append((f"{method} keep {keep:g}, decode_margin {m}",
                             dict(base, decode_margin=m)))
        for budget in budgets:
            base = {"method": method, "budget_tokens": budget}
            for m in margins:
                rows.append((f"{method} budget {budget} tokens, decode_margin {m}",
                             dict(base, decode_margin=m)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--num", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--methods", default="dropkv", help="scorers, comma-separated")
    ap.add_argument("--keeps", default="", help="keep ratios (prompt compressed too)")
    ap.add_argument("--budgets", default="96,192", help="budget_tokens (above the prompt)")
    ap.add_argument("--margins", default="16,64")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = served_model(args.url)
    rng = random.Random(args.seed)
    prompts = []
    for i in range(args.num):
        name = NAMES[i % len(NAMES)]
        prompts.append((name, f"Write a long, detailed story about {name}, who "
                              f"{rng.choice(TOPICS)}. Use {name}'s name often."))
    def numbers(s, kind):
        return [kind(x) for x in s.split(",") if x]
    rows = settings(numbers(args.methods, str), numbers(args.keeps, float),
                    numbers(args.budgets, int), numbers(args.margins, int))
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for label, comp in rows:
            results[label] = list(pool.map(
                lambda p: chat(args.url, model, p[1], args.tokens, comp), prompts))
    full = results["full cache"]
    print(f"model {model}, {args.num} prompts, {args.tokens} greedy tokens each")
    print(f"| setting | prefix | agreement | name_late | kept |")
    print(f"|---|---|---|---|---|")
    for label, _ in rows:
        prefix, agree, late, kept = [], [], [], []
        for (name, _), (ids, text, usage), (fids, ftext, _) in zip(prompts, results[label], full):
            n = min(len(ids), len(fids))
            first = next((i for i in range(n) if ids[i] != fids[i]), n)
            prefix.append(first / len(fids))
            agree.append(sum(a == b for a, b in zip(ids, fids)) / len(fids))
            if name in ftext[len(ftext) * 3 // 4:]:
                late.append(name in text[len(text) * 3 // 4:])
            layers = max(1, len(usage.get("kv_tokens_kept_per_layer") or [1]))
            seen = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            stored = (usage.get("kv_tokens_kept") or usage["prompt_tokens"] * layers) + \
                layers * (usage["completion_tokens"] - 1) - usage.get("decode_evicted_kv_tokens", 0)
            kept.append(stored / layers / seen)

        def ms(v):
            if not v:
                return "n/a"
            se = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else 0.0
            return f"{statistics.mean(v):.3f} ± {se:.3f}"
        print(f"| {label} | {ms(prefix)} | {ms(agree)} | {ms(late)} (n={len(late)}) | "
              f"{statistics.mean(kept):.3f} |")


if __name__ == "__main__":
    main()
