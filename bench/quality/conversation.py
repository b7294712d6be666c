#!/usr/bin/env python3
"""What a kept compressed conversation loses: a needle task asked in two turns.

Turn 1 is the haystack (with the needle) and a short instruction; turn 2 appends turn 1's answer,
the question and the answer prefix. Three ways to serve turn 2, on a running dropkv-server (its
OpenAI HTTP API, token-id prompts, greedy):
  full       no compression, both turns;
  fresh      turn 2 compressed in one pass (DropKV at --keep): its observation window holds the
             question, the best case for compression;
  continued  turn 1 compressed with keep_conversation (its window is the instruction: the question
             is unknown), turn 2 continues the kept cache and evicts again to the budgets of the
             whole prompt (docs/compression.md, "Compressed conversations");
  replay     the same, turn 1 scored by a replay of itself (scoring_queries replay: question-
             independent), turn 2 as continued.
Prints the accuracy (the answer's value in turn 2's output) of each, how many turn-2 prompt
tokens the server prefilled and turn 1's mean latency. Prompts come from tasks.py (niah_number,
raw format).

  python3 bench/quality/conversation.py --model DIR --url http://127.0.0.1:8000 [--num 20]
"""
import argparse
import json
import os
import random
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

MODEL = ""  # the server's model name (GET /v1/models)


def served_model(url):
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def complete(url, prompt, max_tokens, compression=None, keep_conversation=False):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "keep_conversation": keep_conversation}
    if compression:
        body["kv_compression"] = compression
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return choice["token_ids"], choice["text"], out["usage"]


def two_turns(tok, length, rng):
    """(turn 1 ids, turn 2 suffix ids before the answer prefix, answer prefix ids, value)."""
    b = tasks.Builder(tok, "raw")
    used = set()
    key = tasks.make_key(rng, used)
    value = tasks.number(rng)
    needle = f"The access code for {key} is {value}."
    question = f"What is the access code for {key} mentioned in the text above?"
    prefix = f"The access code for {key} is"
    instruction = "Read the text above carefully."
    ids = b.fill(length, rng, tasks.filler_sentence, [needle], question, prefix)
    text = tok.decode(ids, skip_special_tokens=True)
    context = text.split("\n\n" + question)[0]
    turn1 = tok.encode(f"{context}\n\n{instruction}\n", add_special_tokens=True)
    turn2_tail = tok.encode(f"\n\n{question}\n{prefix}", add_special_tokens=False)
    return turn1, turn2_tail, value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF folder (its tokenizer)")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--num", type=int, default=20)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--turn1-tokens", type=int, default=4, help="turn 1's answer length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="full,fresh,continued,replay")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - {"full", "fresh", "continued", "replay"}
    if unknown:
        ap.error(f"--modes: unknown {sorted(unknown)}")
    tok = AutoTokenizer.from_pretrained(args.model)
    global MODEL
    MODEL = served_model(args.url)
    dropkv = {"method": "dropkv", "keep_ratio": args.keep}
    turn1_compression = {"full": None, "fresh": None, "continued": dropkv,
                         "replay": dict(dropkv, scoring_queries="replay")}
    correct = dict.fromkeys(modes, 0)
    prefilled = dict.fromkeys(modes, 0)
    turn1_seconds = dict.fromkeys(modes, 0.0)
    for i in range(args.num):
        rng = random.Random(f"{args.seed}-conversation-{args.length}-{i}")
        turn1, tail, value = two_turns(tok, args.length, rng)
        row = []
        for mode in modes:
            kept = mode in ("continued", "replay")
            start = time.monotonic()
            answer1, _, _ = complete(args.url, turn1, args.turn1_tokens, turn1_compression[mode],
                                     keep_conversation=kept)
            turn1_seconds[mode] += time.monotonic() - start
            turn2 = turn1 + answer1 + tail
            c2 = None if mode == "full" else dropkv
            _, text, usage = complete(args.url, turn2, tasks.MAX_NEW["niah_number"], c2,
                                      keep_conversation=kept)
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            prefilled[mode] += len(turn2) - cached
            ok = value in text
            correct[mode] += ok
            row.append(f"{mode} {'ok' if ok else 'miss'} ({len(turn2) - cached} prefilled)")
        print(f"[{i + 1}/{args.num}] {len(turn1)}+{len(tail)} tokens: " + ", ".join(row),
              flush=True)
    print(f"\nniah_number in two turns, ~{args.length} tokens, DropKV keep {args.keep}, "
          f"{args.num} prompts")
    print("| mode | accuracy | turn-2 tokens prefilled (mean) | turn 1 (s, mean) |")
    print("|---|---:|---:|---:|")
    for mode in modes:
        print(f"| {mode} | {correct[mode] / args.num:.3f} | {prefilled[mode] / args.num:.0f} | "
              f"{turn1_seconds[mode] / args.num:.2f} |")


if __name__ == "__main__":
    main()
