#!/usr/bin/env python3
"""The peer of dropkv-bench-e2e: HF transformers on the same model, same device, same run.

Builds the model from a config.json folder (random weights: normal(0, 0.02), as our side draws
them; --weights: the folder's checkpoint), attn_implementation="sdpa", and times
  - prefill (TTFT) of N-token prompts (logits_to_keep=1),
  - decode ms/token at batch B over a C-token context (DynamicCache, greedy, one token at a time),
    the context from a prefill or, with --synthetic-context, random K/V written into the cache
    (decode's cost does not depend on the values; an 8x8K prefill on a CPU takes many minutes),
with CUDA events (wall clock on the CPU) after warm-up.

Two modes:
  - one shot (default): every case, median of repeats, one JSON object on stdout;
  - --serve: the model stays loaded and answers one JSON request per stdin line with one JSON line
    on stdout, so that dropkv-bench-e2e --interleave alternates our run and the peer's per case:
      {"op": "prefill", "tokens": N, "warmup": bool}              -> {"ms": ...}
      {"op": "decode", "batch": B, "context": C, "steps": S,
       "warmup": bool}                                            -> {"ms_per_step": ...}
    A decode request reuses the cache of the previous one with the same (B, C) (it grows by S
    tokens per request); "warmup" runs the case once untimed first.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch


DEVICE = "cuda"


def build(config_dir, dtype, weights):
    from transformers import AutoConfig, AutoModelForCausalLM

    if weights:  # a real checkpoint (converted stories260K, the set-up's SmolLM2 / Gemma 3)
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


def elapsed_ms(fn):
    if DEVICE == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def timed(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn) for _ in range(repeats))


class Peer:
    def __init__(self, model, config, dtype, synthetic_context):
        self.model, self.config, self.dtype = model, config, dtype
        self.synthetic_context = synthetic_context
        self.gen = torch.Generator(device=DEVICE).manual_seed(0)
        self.case = None  # (batch, context) of the live decode state
        self.cache = self.next_ids = None

    def random_ids(self, batch, n):
        return torch.randint(0, self.config.vocab_size, (batch, n), device=DEVICE, generator=self.gen)

    def prefill_ms(self, n, repeats, warmup):
        ids = self.random_ids(1, n)
        return timed(lambda: self.model(input_ids=ids, use_cache=True, logits_to_keep=1), repeats, warmup)

    def start_decode(self, batch, ctx):
        from transformers import DynamicCache

        self.cache = self.next_ids = None
        if self.synthetic_context:
            # The cache the model would hold after a prefill of ctx tokens: every layer fed ctx
            # random K/V entries (a sliding layer keeps its window, as after a real prefill).
            text = self.config.get_text_config(decoder=True)
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            shape = (batch, text.num_key_value_heads, ctx, head_dim)
            cache = DynamicCache(config=self.config)
            for layer in range(text.num_hidden_layers):
                k = torch.randn(shape, dtype=self.dtype, device=DEVICE, generator=self.gen)
                v = torch.randn(shape, dtype=self.dtype, device=DEVICE, generator=self.gen)
                cache.update(k, v, layer)
            self.cache, self.next_ids = cache, self.random_ids(batch, 1)
        else:
            res = self.model(input_ids=self.random_ids(batch, ctx), use_cache=True, logits_to_keep=1)
            self.cache, self.next_ids = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
        self.case = (batch, ctx)

    def decode_steps(self, steps):
        for _ in range(steps):
            r = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
            self.cache = r.past_key_values
            self.next_ids = r.logits[:, -1].argmax(-1, keepdim=True)

    def decode_ms_per_step(self, batch, ctx, steps, warmup):
        if self.case != (batch, ctx):
            self.start_decode(batch, ctx)
        if warmup:
            self.decode_steps(steps)
        return elapsed_ms(lambda: self.decode_steps(steps)) / steps

    def release(self):
        self.cache = self.next_ids = self.case = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def serve(peer):
    # stdout carries only the answers: anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "prefill":
            peer.release()
            ms = peer.prefill_ms(req["tokens"], 1, 1 if req.get("warmup") else 0)
            answer = {"ms": ms}
        elif req["op"] == "decode":
            answer = {"ms_per_step": peer.decode_ms_per_step(req["batch"], req["context"], req["steps"],
                                                             req.get("warmup", False))}
        else:
            answer = {"error": f"unknown op {req['op']}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


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
    ap.add_argument("--synthetic-context", action="store_true",
                    help="decode contexts of random K/V instead of a prefill")
    ap.add_argument("--serve", action="store_true", help="answer JSON requests from stdin (see above)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    dtype = getattr(torch, args.dtype)
    model, config = build(args.model, dtype, args.weights)
    peer = Peer(model, config, dtype, args.synthetic_context)
    if args.serve:
        serve(peer)
        return
    out = {"peer": "transformers", "attn": "sdpa", "prefill": [], "decode": []}

    for n in [int(x) for x in args.prefill.split(",") if x]:
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = peer.prefill_ms(n, args.repeats, 1)
        out["prefill"].append({"tokens": n, "ms": ms,
                               "peak_bytes": torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0})
        print(f"hf prefill {n}: {ms:.1f} ms", file=sys.stderr)

    for spec in [s for s in args.decode.split(",") if s]:
        batch, ctx = (int(x) for x in spec.split("x"))
        ms = peer.decode_ms_per_step(batch, ctx, args.decode_steps, warmup=True)
        out["decode"].append({"batch": batch, "context": ctx, "ms_per_step": ms,
                              "tokens_per_s": batch * 1000.0 / ms})
        print(f"hf decode bs{batch} ctx{ctx}: {ms:.2f} ms/step", file=sys.stderr)
        peer.release()

    print(json.dumps(out))


if __name__ == "__main__":
    main()
