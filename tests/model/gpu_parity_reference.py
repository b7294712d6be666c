"""HF transformers on CUDA in bf16: greedy runs of the parity fixture's tiny models.

Usage: gpu_parity_reference.py MODELS_DIR OUT_JSON NUM_STEPS NAME...
For each NAME: the model MODELS_DIR/NAME (written by make_parity_models.py) loaded on cuda as
bfloat16 (sdpa attention; eager for Gemma 2), the prompt of its reference.json, prefill + NUM_STEPS greedy decode
steps. OUT_JSON: {NAME: {tokens: [NUM_STEPS + 1], logits: [NUM_STEPS + 1][vocab]}}.
"""
import json
import os
import sys

import torch
import transformers as tf


@torch.inference_mode()
def greedy(model, prompt, num_steps):
    dev = model.device
    out = model(torch.tensor([prompt], device=dev), use_cache=True)
    past = out.past_key_values
    logits = [out.logits[0, -1].float()]
    tokens = [int(logits[-1].argmax())]
    for _ in range(num_steps):
        out = model(torch.tensor([[tokens[-1]]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
    return {"tokens": tokens, "logits": [l.cpu().tolist() for l in logits]}


def main():
    models_dir, out_path, num_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = {}
    for name in sys.argv[4:]:
        d = os.path.join(models_dir, name)
        with open(os.path.join(d, "reference.json")) as f:
            prompt = json.load(f)["prompt"]
        # SDPA ignores Gemma 2's soft-capping: eager attention is the trained behaviour.
        attn = "eager" if name == "gemma2" else "sdpa"
        model = tf.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.bfloat16, attn_implementation=attn).to("cuda").eval()
        result[name] = greedy(model, prompt, num_steps)
        print(name, "tokens", result[name]["tokens"])
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
