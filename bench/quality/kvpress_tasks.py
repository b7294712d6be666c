#!/usr/bin/env python3
"""kvpress 0.5.5 on tasks.py's prompts: the peer of dropkv-quality-tasks.

Run with $DROPKV_KVPRESS_PYTHON (scripts/setup.sh's venv-kvpress; on the GPU machine, python3
with the wheels of bench/quality/run_gpu.sh on PYTHONPATH). Loads the same Hugging Face folder in
--dtype on --device (default fp32 on the CPU; SDPA attention; a second copy with eager attention for
ObservedAttention, which needs the attention weights, while CriticalAdaKV refuses eager), and for
each prompt and press prefills the WHOLE prompt under the press (as our engine does: context,
question and answer prefix are all compressed, the last `window` tokens protected by the
window-based presses), then decodes greedily with explicit positions continuing from the prompt
length, as kvpress's pipeline does.

One prefill per prompt feeds every press (default): kvpress compresses a layer's cache in a forward
hook after that layer's attention has used the full K/V, so every layer's inputs are the same
with and without compression; FanOutPress calls each press's own compress() on those inputs and
keeps each result in a cache of its own. AdaKV-style presses (AdaKV, CriticalAdaKV) mask heads
through state on the attention modules at decode time and need --separate (a prefill per press
under its own context manager, kvpress's usual loop; also the check of the shared path).

Writes one JSON line per prompt and configuration in dropkv-quality-tasks's format (engine
"kvpress"); score.py makes the tables.

A press name may end in `:wN` (its own window, e.g. `snapkv:w64`, kvpress's default window) so
that several windows share the one prefill.

  kvpress_tasks.py --model DIR --prompts P.jsonl --out R.jsonl [--keeps 0.1] [--window 8]
      [--device cpu|cuda] [--dtype float32|bfloat16]
      [--presses full,snapkv,streaming_llm,knorm,observed_attention,tova,expected_attention,
       criticalkv,critical_adakv,adakv,pyramidkv] [--limit N] [--threads 1]
"""
import argparse
import json
import os
import sys
import time

import torch


def optional_imports():
    """kvpress imports datasets and fire at import time for presses this driver never makes
    (DuoAttention, the Expected Attention statistics CLI). Where they do not import (the GPU
    machine: its pyarrow or fsspec may not suit the carried datasets wheel), stand-ins that fail
    when used let kvpress load."""
    import importlib
    import types
    for name in ("datasets", "fire"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (any import failure)
            stub = types.ModuleType(name)

            def unavailable(*args, _name=name, _e=e, **kwargs):
                raise RuntimeError(f"{_name} is not importable here ({_e})")
            stub.load_dataset = stub.Fire = unavailable
            sys.modules[name] = stub
            print(f"kvpress_tasks: {name} does not import ({type(e).__name__}: {e}); a stand-in "
                  "is used (no press of this driver needs it)", file=sys.stderr)


optional_imports()
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

import kvpress  # noqa: E402
from kvpress import (AdaKVPress, CriticalAdaKVPress, CriticalKVPress,  # noqa: E402
                     ExpectedAttentionPress, KnormPress, ObservedAttentionPress, PyramidKVPress,
                     SnapKVPress, StreamingLLMPress, TOVAPress)
from kvpress.presses.base_press import BasePress  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score import answer_score  # noqa: E402

PRESSES = ["full", "snapkv", "streaming_llm", "knorm", "observed_attention", "tova",
           "expected_attention", "criticalkv", "critical_adakv", "adakv", "pyramidkv"]


def split_window(spec, window):
    """`snapkv:w64` -> ("snapkv", 64); a name without a suffix takes --window."""
    name, _, suffix = spec.partition(":")
    if suffix:
        if not (suffix.startswith("w") and suffix[1:].isdigit()):
            raise SystemExit(f"--presses: bad setting '{suffix}' in '{spec}' (only :wN)")
        window = int(suffix[1:])
    return name, window


def make_press(spec, cr, window):
    """kvpress's press for compression ratio cr = 1 - keep; window-based presses use our W."""
    name, window = split_window(spec, window)
    snap = lambda: SnapKVPress(compression_ratio=cr, window_size=window, kernel_size=5)
    if name == "snapkv":
        return snap()
    if name == "streaming_llm":
        return StreamingLLMPress(compression_ratio=cr, n_sink=4)
    if name == "knorm":
        return KnormPress(compression_ratio=cr)
    if name == "observed_attention":
        return ObservedAttentionPress(compression_ratio=cr)
    if name == "tova":
        return TOVAPress(compression_ratio=cr)
    if name == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=cr)
    if name == "criticalkv":
        return CriticalKVPress(press=snap())
    if name == "critical_adakv":
        return CriticalAdaKVPress(press=snap())
    if name == "adakv":
        return AdaKVPress(press=snap())
    if name == "pyramidkv":
        return PyramidKVPress(compression_ratio=cr, window_size=window, kernel_size=5)
    raise SystemExit(f"--presses: unknown press '{name}' (known: {', '.join(PRESSES)})")


class FanOutPress(BasePress):
    """Calls every press's compress() on each layer's inputs, keeps each one's (keys, values),
    and leaves the model's own cache full."""

    def __init__(self, presses):
        self.presses = presses
        self.kept = [dict() for _ in presses]  # [press][layer] = (keys, values)

    def post_init_from_model(self, model):
        for p in self.presses:
            p.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        for i, p in enumerate(self.presses):
            self.kept[i][module.layer_idx] = p.compress(module, hidden_states, keys, values,
                                                        attentions, kwargs)
        return keys, values

    def cache(self, i):
        c = DynamicCache()
        for layer in sorted(self.kept[i]):
            k, v = self.kept[i][layer]
            c.update(k, v, layer)
        return c


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode(model, cache, first, pos, max_new, eos):
    gen = [first]
    dev = model.device
    for _ in range(max_new - 1):
        out = model(input_ids=torch.tensor([[gen[-1]]], device=dev), past_key_values=cache,
                    position_ids=torch.tensor([[pos]], device=dev), logits_to_keep=1)
        pos += 1
        gen.append(int(out.logits[0, -1].argmax()))
    cut = next((i for i, t in enumerate(gen) if t in eos), len(gen))
    return gen[:cut]


@torch.inference_mode()
def greedy_shared(model, ids, presses, max_new, eos):
    """The greedy output of the full cache and of every press, from one prefill."""
    fan = FanOutPress(presses)
    cache = DynamicCache()
    with fan(model):
        out = model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache,
                    logits_to_keep=1)
    first = int(out.logits[0, -1].argmax())
    full = decode(model, cache, first, len(ids), max_new, eos)
    return full, [decode(model, fan.cache(i), first, len(ids), max_new, eos)
                  for i in range(len(presses))]


@torch.inference_mode()
def greedy(model, ids, press, max_new, eos):
    cache = DynamicCache()
    x = torch.tensor([ids], device=model.device)
    if press is None:
        out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
    else:
        with press(model):
            out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
    return decode(model, cache, int(out.logits[0, -1].argmax()), len(ids), max_new, eos)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--keeps", default="0.1")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--separate", action="store_true",
                    help="a prefill per press under its own context manager")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [json.loads(l) for l in open(args.prompts)]
    if args.limit:
        prompts = prompts[:args.limit]
    tok = AutoTokenizer.from_pretrained(args.model)
    load = lambda impl: AutoModelForCausalLM.from_pretrained(
        args.model, dtype=DTYPES[args.dtype], attn_implementation=impl).to(args.device).eval()
    names = args.presses.split(",")
    bases = [split_window(n, args.window)[0] for n in names]
    model = load("sdpa")
    eager = load("eager") if "observed_attention" in bases else None
    if not args.separate and any(n in ("adakv", "critical_adakv") for n in bases):
        raise SystemExit("--presses: adakv and critical_adakv need --separate")
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    keeps = [float(k) for k in args.keeps.split(",")]
    t0 = time.time()
    print(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else ''}",
          file=sys.stderr)
    with open(args.out, "w") as f:
        for i, p in enumerate(prompts):
            runs = [(n, k) for n in names for k in ([1.0] if n == "full" else keeps)]
            gens = {}
            if args.separate:
                for name, keep in runs:
                    press = None if name == "full" else make_press(name, 1.0 - keep, args.window)
                    m = eager if split_window(name, 8)[0] == "observed_attention" else model
                    gens[(name, keep)] = greedy(m, p["input_ids"], press, p["max_new_tokens"], eos)
            else:
                # One prefill (eager when ObservedAttention needs the weights) for every press.
                pressed = [(n, k) for n, k in runs if n != "full"]
                full, outs = greedy_shared(
                    eager if eager is not None else model, p["input_ids"],
                    [make_press(n, 1.0 - k, args.window) for n, k in pressed],
                    p["max_new_tokens"], eos)
                gens = dict(zip(pressed, outs))
                gens[("full", 1.0)] = full
            for name, keep in runs:
                text = tok.decode(gens[(name, keep)], skip_special_tokens=True)
                base, window = split_window(name, args.window)
                f.write(json.dumps({
                    "engine": "kvpress", "method": base, "keep": keep, "allocator": "uniform",
                    "window": window, "device": args.device, "dtype": args.dtype,
                    "task": p["task"], "length": p["length"],
                    "idx": p["idx"], "format": p["format"], "num_tokens": p["num_tokens"],
                    "answers": p["answers"], "match": p["match"],
                    "score": answer_score(text, p["answers"], p["match"]),
                    "text": text}) + "\n")
                f.flush()
            print(f"prompt {i + 1}/{len(prompts)}: {time.time() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    print(f"wall time: {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
