"""HF transformers references on the two trained models scripts/setup.sh converts (fp32, CPU).

Usage: real_models_reference.py MODELS_DIR OUT_DIR
For each case writes OUT_DIR/<case>.json: the prompt ids, 64 greedy ids (HF's own cache, eos
ignored), HF's tokenizer ids for a few texts; and OUT_DIR/<case>.logits.f32: the fp32 logits of
the prompt's last position and of the first 3 greedy steps (teacher-forced on HF's ids), raw
little-endian rows of vocab_size floats. Cached by a stamp of this script and the model folders.
"""
import hashlib
import json
import os
import sys

import torch
import transformers as tf

NUM_GREEDY = 64
NUM_LOGIT_ROWS = 4  # the prompt's last position + 3 decode steps

TEXTS = ["The capital of France is", "pass key 71432, remember it.",
         "  two  spaces\tand a tab\n\nnew lines", "héllo wörld 日本語 🤖 3.14159"]

# Filler for the long Gemma 3 prompt: the sliding layers (window 512) must drop most of it.
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")


def cases(models_dir):
    smol = os.path.join(models_dir, "smollm2-135m-instruct")
    gemma = os.path.join(models_dir, "gemma-3-270m")
    yield "smollm2_chat", smol, {"chat": [{"role": "user",
                                           "content": "What is the capital of France?"}]}
    yield "smollm2_text", smol, {"text": "The capital of France is"}
    yield "gemma3_text", gemma, {"text": "The capital of France is"}
    yield "gemma3_long", gemma, {"text": FILLER * 70 + "The pass key is 71432. Remember it. " +
                                 FILLER * 10 + "What is the pass key? The pass key is",
                                 "num_greedy": 16}


@torch.inference_mode()
def run(model, prompt, num_greedy):
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    rows = [out.logits[0, -1].float()]
    tokens = [int(rows[-1].argmax())]
    while len(tokens) < num_greedy:
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        row = out.logits[0, -1].float()
        if len(rows) < NUM_LOGIT_ROWS:
            rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(rows)


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    h = hashlib.sha256(open(__file__, "rb").read())
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        with open(os.path.join(models_dir, name, ".dropkv-converted")) as f:
            h.update(f.read().encode())
    stamp = os.path.join(out_dir, "stamp")
    if os.path.exists(stamp) and open(stamp).read() == h.hexdigest():
        print("references up to date")
        return
    torch.manual_seed(0)
    loaded = {}
    for case, folder, spec in cases(models_dir):
        if folder not in loaded:
            loaded[folder] = (tf.AutoTokenizer.from_pretrained(folder),
                              tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                              .eval())
        tok, model = loaded[folder]
        if "chat" in spec:
            prompt = tok.apply_chat_template(spec["chat"], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
        else:
            prompt = tok(spec["text"]).input_ids
        tokens, rows = run(model, prompt, spec.get("num_greedy", NUM_GREEDY))
        rows.numpy().astype("<f4").tofile(os.path.join(out_dir, case + ".logits.f32"))
        ref = {"prompt": prompt, "greedy": tokens, "vocab_size": int(rows.shape[1]),
               "num_logit_rows": int(rows.shape[0]),
               "text": tok.decode(tokens, skip_special_tokens=True),
               "encodings": {t: tok(t, add_special_tokens=True).input_ids for t in TEXTS}}
        with open(os.path.join(out_dir, case + ".json"), "w") as f:
            json.dump(ref, f)
        print(case, len(prompt), "prompt tokens ->", repr(ref["text"][:80]))
    with open(stamp, "w") as f:
        f.write(h.hexdigest())


if __name__ == "__main__":
    main()
