"""FP8 (e4m3) weight references on SmolLM2-135M-Instruct (HF transformers, fp32, CPU).

Usage: fp8_reference.py MODELS_DIR OUT_DIR
Quantizes every projection weight (q/k/v/o, gate/up/down) per output channel with the rule of
engine/model/fp8.h (scale = amax(|row|) / 448, 1 for a zero row; w8 = e4m3(w / scale)), puts the
dequantized weights w8 * scale back into the HF model and writes:
  OUT_DIR/fp8_ref.json: the prompts' ids, the greedy ids (64, HF's own cache) of the FP8 model on
    prompt 0, and the mean KL(full || variant) over the prompts' positions and the top-1 agreement
    for this rule, for one scale per tensor (informative) and for two broken dequantizations (the
    scale left out; each row given its neighbour's scale), which the C++ test's bounds must reject;
  OUT_DIR/fp8_ref.logits.f32: the FP8 model's fp32 logits at every position of prompt 0;
  OUT_DIR/smollm2-fp8-ct/: the same quantized weights as a compressed-tensors checkpoint (`*.weight`
    F8_E4M3, `*.weight_scale` fp32 [out, 1]) with the model's config.json and tokenizer.
Cached by a stamp of this script and the model folder.
"""
import hashlib
import json
import os
import shutil
import sys

import torch
import transformers as tf
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
NUM_GREEDY = 64
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [
    {"chat": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]},
    {"text": "The quick brown fox jumps over the lazy dog. In the next paragraph we discuss why "
             "this sentence contains every letter of the English alphabet, and"},
    {"chat": [{"role": "user", "content": "Write a short Python function that returns the sum of "
                                          "the squares of a list of numbers."}]},
]


def quantize(w, per_tensor=False):
    """Per output channel (amax over a row) or per tensor: returns (w8, scale [out, 1] or [])."""
    w = w.float()
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w8 = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def dequantize(w, variant):
    """The weight a variant's forward sees."""
    w8, scale = quantize(w, per_tensor=variant == "per_tensor")
    if variant == "scale_dropped":
        return w8.float()
    if variant == "scale_rows_shifted":
        return w8.float() * scale.roll(1, 0)
    return w8.float() * scale


def proj_names(model):
    return [f"model.layers.{i}.{p}.weight" for i in range(model.config.num_hidden_layers)
            for p in PROJ]


@torch.inference_mode()
def quantized_model(folder, variant):
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    for name in proj_names(model):
        params[name].copy_(dequantize(params[name], variant))
    return model


@torch.inference_mode()
def greedy(model, prompt):
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < NUM_GREEDY:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.inference_mode()
def all_logits(model, prompts):
    return [model(torch.tensor([p])).logits[0].float() for p in prompts]


def mean_kl_and_agreement(full, other):
    kls, agree = [], []
    for f, o in zip(full, other):
        lp, lq = f.log_softmax(-1), o.log_softmax(-1)
        kls.append((lp.exp() * (lp - lq)).sum(-1))
        agree.append((f.argmax(-1) == o.argmax(-1)).float())
    return float(torch.cat(kls).mean()), float(torch.cat(agree).mean())


def write_compressed_tensors(folder, out_folder):
    os.makedirs(out_folder, exist_ok=True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    config = json.load(open(os.path.join(folder, "config.json")))
    for name in [f"model.layers.{i}.{p}.weight" for i in range(config["num_hidden_layers"])
                 for p in PROJ]:
        w8, scale = quantize(tensors[name])
        tensors[name] = w8.contiguous()
        tensors[name + "_scale"] = scale.float().contiguous()  # [out, 1]
    save_file(tensors, os.path.join(out_folder, "model.safetensors"))
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True}}},
        "ignore": ["lm_head"],
    }
    json.dump(config, open(os.path.join(out_folder, "config.json"), "w"), indent=2)
    for f in os.listdir(folder):
        if f.startswith("tokenizer") or f in ("generation_config.json", "chat_template.jinja"):
            shutil.copy(os.path.join(folder, f), out_folder)


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    folder = os.path.join(models_dir, "smollm2-135m-instruct")
    os.makedirs(out_dir, exist_ok=True)
    h = hashlib.sha256(open(__file__, "rb").read())
    for f in sorted(os.listdir(folder)):
        st = os.stat(os.path.join(folder, f))
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    stamp_path = os.path.join(out_dir, "stamp")
    if os.path.exists(stamp_path) and open(stamp_path).read() == h.hexdigest():
        print("fp8_reference: up to date")
        return
    torch.manual_seed(0)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    prompts = []
    for p in PROMPTS:
        if "chat" in p:
            ids = tok.apply_chat_template(p["chat"], add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
        else:
            ids = tok(p["text"])["input_ids"]
        prompts.append([int(i) for i in ids])
    full = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    full_logits = all_logits(full, prompts)
    del full
    meta = {"prompts": prompts, "kl": {}, "agreement": {}}
    for name in ("per_channel", "per_tensor", "scale_dropped", "scale_rows_shifted"):
        model = quantized_model(folder, name)
        logits = all_logits(model, prompts)
        meta["kl"][name], meta["agreement"][name] = mean_kl_and_agreement(full_logits, logits)
        if name == "per_channel":
            meta["greedy"] = greedy(model, prompts[0])
            meta["num_logit_rows"] = int(logits[0].shape[0])
            meta["vocab_size"] = int(logits[0].shape[1])
            logits[0].contiguous().numpy().tofile(os.path.join(out_dir, "fp8_ref.logits.f32"))
        print(f"fp8_reference: {name}: mean KL(full || fp8) = {meta['kl'][name]:.3e}, "
              f"top-1 agreement {meta['agreement'][name]:.3f}")
        del model
    json.dump(meta, open(os.path.join(out_dir, "fp8_ref.json"), "w"))
    write_compressed_tensors(folder, os.path.join(out_dir, "smollm2-fp8-ct"))
    open(stamp_path, "w").write(h.hexdigest())


if __name__ == "__main__":
    main()
