"""Builds tiny random HF models of each family with transformers 5.17 and records reference logits.

Usage: make_parity_models.py OUT_DIR
For each family: OUT_DIR/<name>/ (save_pretrained; qwen2 sharded) and OUT_DIR/<name>/reference.json:
  prompt: ids; fp32/bf16: {tokens: greedy ids (17), logits: [17][vocab]} where step 0 is the
  prompt's last position and step i the logits after feeding greedy token i-1 (16 decode steps).
"""
import json
import math
import os
import sys

import torch
import transformers as tf

NUM_DECODE_STEPS = 16
VOCAB = 128


def families():
    # head_dim 64 / 256: the CUDA paged-attention kernel's sizes, so the GPU parity test
    # (gpu_parity_test.cpp) runs these same models through it.
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  max_position_embeddings=256, initializer_range=0.02, bos_token_id=1, eos_token_id=2)
    yield "llama", tf.LlamaForCausalLM, tf.LlamaConfig(
        **common, num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), None
    yield "qwen2", tf.Qwen2ForCausalLM, tf.Qwen2Config(
        **common, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False), "150KB"
    yield "gemma", tf.GemmaForCausalLM, tf.GemmaConfig(
        **common, num_attention_heads=2, num_key_value_heads=2, head_dim=256), None
    yield "mistral", tf.MistralForCausalLM, tf.MistralConfig(
        **common, num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=None,
        tie_word_embeddings=True), None
    # Sliding windows far shorter than the prompt (13) + decode (16): the test's 4-slot blocks
    # make each sliding layer's ring wrap several times, in prefill chunks and in decode.
    yield "mistral_sliding", tf.MistralForCausalLM, tf.MistralConfig(
        **common, num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=6,
        tie_word_embeddings=False), None
    yield "qwen3", tf.Qwen3ForCausalLM, tf.Qwen3Config(
        **common, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False), None
    # Gemma 2 with caps small enough to bite on random weights.
    yield "gemma2", tf.Gemma2ForCausalLM, tf.Gemma2Config(
        **common, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        query_pre_attn_scalar=48, attn_logit_softcapping=0.03, final_logit_softcapping=10.0,
        sliding_window=5), None
    # Gemma 3: one global layer between sliding ones, a RoPE of its own (linear scaling) for it.
    yield "gemma3", tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
        **common, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=7,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), None
    # Qwen3-0.6B's published config.json, but 2 layers and a small vocabulary: head_dim 128 with
    # 16 heads over hidden 1024 (q is twice the hidden size), q/k norms, tied embeddings, the
    # sliding-window fields present but off.
    yield "qwen3_shape", tf.Qwen3ForCausalLM, tf.Qwen3Config(
        vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
        max_window_layers=28, attention_bias=False, hidden_act="silu", bos_token_id=1,
        eos_token_id=2, initializer_range=0.02), None
    yield "llama_yarn", tf.LlamaForCausalLM, tf.LlamaConfig(
        **common, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}), None


def name_of(cls):
    return cls.__name__.lower()


@torch.inference_mode()
def greedy(model, prompt):
    out = model(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    logits = [out.logits[0, -1].float()]
    tokens = [int(logits[-1].argmax())]
    for _ in range(NUM_DECODE_STEPS):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
    return {"tokens": tokens, "logits": [l.tolist() for l in logits]}


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    prompt = [1] + [int(x) for x in torch.randint(3, VOCAB, (12,))]  # within every vocabulary
    for name, cls, config, shard in families():
        torch.manual_seed(1234)
        if name == "gemma2":
            # SDPA ignores soft-capping; eager attention is what Gemma 2 was trained with.
            config._attn_implementation = "eager"
        model = cls(config).eval()
        # Random tiny models have flat logits (argmax flips under bf16 rounding): a unit-std
        # output head spreads them (~8 logit std) while the small inner weights (std 0.02) keep
        # the bf16 noise from being amplified layer over layer. For the tied models (gemma,
        # mistral) this makes the embedding dominate, so their greedy runs repeat one token; the
        # test still compares the full logit vectors at every step.
        with torch.no_grad():
            # (std 1 at hidden 64; scaled so wider models get the same ~8 logit spread)
            model.lm_head.weight.normal_(0.0, 8.0 / math.sqrt(config.hidden_size))
            # Norm weights start at 0 in Gemma (the model uses 1 + w) and 1 elsewhere: draw them
            # so that a norm applied to the wrong tensor, or not at all, changes the logits.
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.normal_(0.0, 0.3).add_(0.0 if "gemma" in name_of(cls) else 1.0)
        d = os.path.join(out_dir, name)
        if shard:
            model.save_pretrained(d, max_shard_size=shard)
        else:
            model.save_pretrained(d)
        ref = {"prompt": prompt, "fp32": greedy(model, prompt)}
        ref["bf16"] = greedy(model.to(torch.bfloat16), prompt)
        f32 = torch.tensor(ref["fp32"]["logits"])
        b16 = torch.tensor(ref["bf16"]["logits"])
        print(name, "HF bf16 vs fp32: rel", float((b16 - f32).norm() / f32.norm()),
              "same tokens", ref["bf16"]["tokens"] == ref["fp32"]["tokens"])
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(ref, f)
        print(name, "->", d, "tokens", ref["fp32"]["tokens"])


if __name__ == "__main__":
    main()
