"""HF transformers on CUDA: the reference of gpu_real_models_test.cpp.

Usage: gpu_real_models_reference.py REQUEST_JSON OUT_JSON [--device cuda]
REQUEST_JSON: {model_dir, dtype, cases: [{name, prompt, kept, ours, num_new}]}, written by the
test. The model is loaded in `dtype` (SDPA attention). For each case HF prefills the whole prompt
with its own cache (Gemma 3's sliding layers as HF keeps them), then, when `kept` is set
({model layer index: [per KV head: kept positions]}, what our press kept), every listed layer's
cache keeps exactly those entries per head; it then decodes greedily (EOS ignored) with positions
continuing from the prompt's length, as kvpress does.
OUT_JSON: {cases: [{name, tokens, logprobs (of HF's tokens), margin_to_ours (HF's logit of its
token minus its logit of our token at that step; 0 where they agree), max_abs_logit}]}.
"""
import json
import sys

import torch
import transformers as tf


def keep_entries(cache, kept):
    """Keeps, in each listed layer of HF's cache, the entries at `kept`'s positions per KV head."""
    for layer, heads in kept.items():
        lay = cache.layers[int(layer)]
        idx = torch.tensor(heads, device=lay.keys.device)  # [Hkv, k]; position == index here
        if lay.keys.shape[2] <= int(idx.max()):
            raise SystemExit(f"layer {layer}: HF holds {lay.keys.shape[2]} entries, kept position "
                             f"{int(idx.max())}")
        gather = idx[None, :, :, None].expand(lay.keys.shape[0], -1, -1, lay.keys.shape[3])
        lay.keys = lay.keys.gather(2, gather).contiguous()
        lay.values = lay.values.gather(2, gather).contiguous()


@torch.inference_mode()
def run(model, case):
    dev = model.device
    prompt, ours, num_new = case["prompt"], case["ours"], case["num_new"]
    out = model(torch.tensor([prompt], device=dev), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    if case.get("kept"):
        keep_entries(cache, case["kept"])
    tokens, logprobs, margins, scales = [], [], [], []
    logits = out.logits[0, -1].float()
    pos = len(prompt)
    for step in range(num_new):
        tok = int(logits.argmax())
        lp = torch.log_softmax(logits, -1)
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        mine = ours[step] if step < len(ours) else tok
        margins.append(float(logits[tok] - logits[mine]))
        scales.append(float(logits.abs().max()))
        if step + 1 == num_new:
            break
        out = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=cache,
                    position_ids=torch.tensor([[pos]], device=dev), use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1].float()
        pos += 1
    return {"name": case["name"], "tokens": tokens, "logprobs": logprobs,
            "margin_to_ours": margins, "max_abs_logit": scales}


def main():
    req_path, out_path = sys.argv[1], sys.argv[2]
    device = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--device" else "cuda"
    req = json.load(open(req_path))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
             "float16": torch.float16}[req["dtype"]]
    model = tf.AutoModelForCausalLM.from_pretrained(
        req["model_dir"], dtype=dtype, attn_implementation="sdpa").to(device).eval()
    result = {"cases": []}
    for case in req["cases"]:
        r = run(model, case)
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], case["ours"])) if a != b),
                    len(r["tokens"]))
        print(f"HF {req['dtype']} {case['name']}: {same}/{len(r['tokens'])} tokens as ours",
              flush=True)
        result["cases"].append(r)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
