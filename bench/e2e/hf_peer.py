#!/usr/bin/env python3
"""The peer of dropkv-bench-e2e: HF transformers on the same random-weight geometry, same GPU, same run.

Builds the model from a config.json folder (no weights on disk: normal(0, 0.02) on the GPU, as our
side does), attn_implementation="sdpa", bf16, and times
  - prefill (TTFT) of N-token prompts,
  - decode ms/token at batch B over a C-token context (DynamicCache, greedy, one token at a time),
with CUDA events after warm-up; median of repeats. Prints one JSON object on stdout.
"""
import argparse
import json
import statistics
import sys
import time

import torch


DEVICE = "cuda"


def build(config_dir, dtype, weights):
    from transformers import AutoConfig, AutoModelForCausalLM

    if weights:  # a real checkpoint (e.g. converted stories260K)
        model = AutoModelForCausalLM.from_pretrained(config_dir, dtype=dtype, attn_implementation="sdpa")
        return model.to(DEVICE).eval(), model.config
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.eval()
    return model, config


def timed(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="folder with config.json")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--decode", default="1x8192,16x2048", help="BATCHxCONTEXT list")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--weights", action="store_true", help="load the folder's weights instead of drawing them")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))

    model, config = build(args.model, getattr(torch, args.dtype), args.weights)
    vocab = config.vocab_size
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out = {"peer": "transformers", "attn": "sdpa", "prefill": [], "decode": []}

    for n in [int(x) for x in args.prefill.split(",") if x]:
        ids = torch.randint(0, vocab, (1, n), device=DEVICE, generator=gen)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        # logits_to_keep=1: the server only needs the last position's logits.
        ms = timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), args.repeats)
        out["prefill"].append({"tokens": n, "ms": ms,
                               "peak_bytes": torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0})
        print(f"hf prefill {n}: {ms:.1f} ms", file=sys.stderr)

    for spec in [s for s in args.decode.split(",") if s]:
        batch, ctx = (int(x) for x in spec.split("x"))
        ids = torch.randint(0, vocab, (batch, ctx), device=DEVICE, generator=gen)
        res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        next_ids = res.logits[:, -1].argmax(-1, keepdim=True)

        def steps():
            nonlocal cache, next_ids
            for _ in range(args.decode_steps):
                r = model(input_ids=next_ids, past_key_values=cache, use_cache=True)
                cache = r.past_key_values
                next_ids = r.logits[:, -1].argmax(-1, keepdim=True)

        ms = timed(steps, 1, warmup=1) / args.decode_steps
        out["decode"].append({"batch": batch, "context": ctx, "ms_per_step": ms,
                              "tokens_per_s": batch * 1000.0 / ms})
        print(f"hf decode bs{batch} ctx{ctx}: {ms:.2f} ms/step", file=sys.stderr)
        del cache, res
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    print(json.dumps(out))


if __name__ == "__main__":
    main()
