#!/usr/bin/env python3
"""What scripts/convert_models.py wrote (set-up's two trained models), checked against what it must
have fixed: Gemma 3's rebuilt tokenizer against the published one (../shared/tokenizers/gemma3):
the same vocabulary, the same merge set, the same ids on a corpus; SmolLM2's eos / pad, its
digit-splitting pre-tokenizer and chat template; and a second run converting nothing.
Exits non-zero on the first failure."""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, flush=True)
        sys.exit(1)
    print("ok:", msg, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--source", required=True)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    gemma = os.path.join(args.models, "gemma-3-270m")
    with gzip.open(os.path.join(args.shared, "tokenizers", "gemma3", "tokenizer.json.gz")) as f:
        published = json.load(f)
    with open(os.path.join(gemma, "tokenizer.json")) as f:
        rebuilt = json.load(f)
    check(rebuilt["model"]["vocab"] == published["model"]["vocab"],
          f"Gemma 3 vocabulary: {len(rebuilt['model']['vocab'])} pieces as published")
    check({tuple(m) for m in rebuilt["model"]["merges"]} ==
          {tuple(m) for m in published["model"]["merges"]},
          f"Gemma 3 merges: the published set of {len(published['model']['merges'])}")
    special = {t["content"] for t in rebuilt["added_tokens"] if t["special"]}
    check({"<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"} <= special, "special tokens")
    ours = Tokenizer.from_str(json.dumps(rebuilt))
    theirs = Tokenizer.from_str(json.dumps(published))
    texts = [open(p, errors="ignore").read()[:20000]
             for p in sorted(glob.glob(os.path.join(args.source, "docs", "*.md")))]
    texts += ["The capital of France is", "12345 67890", "  two  spaces\t\ttabs\n\n\nnewlines",
              "héllo wörld 日本語 テスト 🤖🚀 ∑∫", "<start_of_turn>user\nHi<end_of_turn>\n"]
    same = sum(ours.encode(t).ids == theirs.encode(t).ids for t in texts)
    check(same == len(texts), f"Gemma 3 ids equal the published tokenizer's on {same}/{len(texts)} texts")
    with open(os.path.join(gemma, "generation_config.json")) as f:
        check(json.load(f)["eos_token_id"] == [1, 106], "Gemma 3 stops at <eos> and <end_of_turn>")

    smol = os.path.join(args.models, "smollm2-135m-instruct")
    with open(os.path.join(smol, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    check(cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|im_end|>",
          "SmolLM2 eos / pad = <|im_end|>")
    tok = Tokenizer.from_file(os.path.join(smol, "tokenizer.json"))
    check(tok.encode("71432").tokens == ["7", "1", "4", "3", "2"], "SmolLM2 splits every digit")
    with open(os.path.join(smol, "chat_template.jinja")) as f:
        check("<|im_start|>" in f.read(), "SmolLM2's ChatML template beside the tokenizer")
    with open(os.path.join(smol, "config.json")) as f:
        config = json.load(f)
    check("quantization_config" not in config and config["tie_word_embeddings"],
          "SmolLM2 config: a plain (dequantized) model with tied embeddings")

    out = subprocess.run([sys.executable, os.path.join(args.source, "scripts", "convert_models.py"),
                          args.models], capture_output=True, text=True, timeout=120)
    check(out.returncode == 0 and out.stdout.count("already converted") == 2,
          f"a second conversion converts nothing: {out.stdout.strip()!r}")
    print("PASS")


if __name__ == "__main__":
    main()
