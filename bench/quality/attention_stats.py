#!/usr/bin/env python3
"""How concentrated prefill attention is on a model (evidence for docs/quality.md).

Samples prompts from the model itself (BOS, temperature 1, like dropkv-quality), runs HF
transformers with eager attention and reports per layer, over the last W queries of each prompt
(the window every press scores with) and over all queries:
  - normalised entropy H(p) / log(#visible keys) (1 = uniform, 0 = one key),
  - mean max p, and the mass on the first token (the "sink"),
  - the mass on the last 25% of the visible keys (recency).

  python3 bench/quality/attention_stats.py --model /tmp/stories260K-hf [--num-prompts 20]
"""
import argparse
import math

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                 dtype=torch.float32)
    model.eval()
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 1
    start = torch.full((args.num_prompts, 1), bos, dtype=torch.long)
    with torch.no_grad():
        ids = model.generate(start, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_length=args.prompt_len, min_length=args.prompt_len,
                             pad_token_id=0)
        out = model(ids, output_attentions=True)
    n = ids.shape[1]
    w = args.window
    print(f"{args.num_prompts} prompts x {n} tokens, window {w}")
    print("| layer | entropy/log(n) window | all | max p window | sink mass window | "
          "last-25% mass window |")
    print("|---|---|---|---|---|---|")
    for layer, att in enumerate(out.attentions):  # [B, H, n, n]
        att = att.double()
        visible = torch.arange(1, n + 1, dtype=torch.double)  # keys query i sees
        ent = -(att.clamp_min(1e-30).log() * att).sum(-1)  # [B, H, n]
        norm_ent = ent[..., 1:] / visible[1:].log()  # skip query 0 (one key)
        win = slice(n - w, n)
        recent_start = int(0.75 * n)
        print(f"| {layer} | {norm_ent[..., win].mean():.3f} | {norm_ent.mean():.3f} | "
              f"{att[..., win, :].max(-1).values.mean():.3f} | {att[..., win, 0].mean():.3f} | "
              f"{att[..., win, recent_start:].sum(-1).mean():.3f} |")


if __name__ == "__main__":
    main()
