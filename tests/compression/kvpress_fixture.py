"""Reference data for compression_parity_test (run with $DROPKV_KVPRESS_PYTHON: kvpress 0.5.5).

Builds a tiny random HF Llama (save_pretrained, then loaded back from disk), runs one prefill of a
random prompt under each kvpress press and compression ratio, and records per layer:
  * the layer inputs as kvpress sees them: queries after RoPE [Hq, n, D], keys after RoPE and
    values [Hkv, n, D] (fp32 .bin files, C order);
  * the press's scores [Hkv, n] (wrapping press.score) and the kept index set of every KV head,
    recovered from the pruned cache that kvpress writes (each kept key row is matched to its row in
    the full keys), so the test checks what kvpress actually kept, not a re-implementation.
Also writes an fp64 brute force of the DropKV selection (algorithms.md section 1) on the same
inputs. Everything goes to OUT/manifest.json + OUT/*.bin.

Usage: kvpress_fixture.py OUT_DIR
"""
import itertools
import json
import math
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpress import (KnormPress, ObservedAttentionPress, PyramidKVPress, SnapKVPress,
                     StreamingLLMPress)
from kvpress.presses.base_press import BasePress
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

NUM_TOKENS = 160
WINDOW = 8
RATIOS = [0.25, 0.5, 0.75]


def save(out, name, t):
    t = t.detach().to(torch.float32).contiguous().cpu()
    t.numpy().tofile(os.path.join(out, name))
    return {"file": name, "shape": list(t.shape)}


def save_i64(out, name, t):
    t = t.detach().to(torch.int64).contiguous().cpu()
    t.numpy().tofile(os.path.join(out, name))
    return {"file": name, "shape": list(t.shape)}


class CapturePress(BasePress):
    """Records each layer's post-RoPE queries, keys and values; compresses nothing."""

    def __init__(self):
        self.layers = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        q = get_prerope_query_states(module, hidden_states)  # [1, Hq, n, D]
        cos, sin = kwargs["position_embeddings"]
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        self.layers[module.layer_idx] = (q[0].clone(), keys[0].clone(), values[0].clone())
        return keys, values


def run_and_record(model, ids, press):
    """Runs a prefill under `press`; returns per layer (scores [Hkv, n], kept indices [Hkv, k])."""
    record = {}
    orig_score = press.score
    orig_compress = press.compress

    def score(module, *args, **kwargs):
        s = orig_score(module, *args, **kwargs)
        record.setdefault(module.layer_idx, {})["scores"] = s[0].detach().clone()
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k2, v2 = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        full = keys[0]  # [Hkv, n, D]
        kept = k2[0]  # [Hkv, k, D]
        idx = []
        for h in range(full.shape[0]):
            # Exact row matching: gather copies rows bit for bit.
            eq = (kept[h][:, None, :] == full[h][None, :, :]).all(-1)  # [k, n]
            assert bool((eq.sum(-1) == 1).all()), "kept key rows must match exactly one row"
            idx.append(eq.float().argmax(-1))
        record.setdefault(module.layer_idx, {})["kept"] = torch.stack(idx).sort(-1).values
        return k2, v2

    press.score = score
    press.compress = compress
    with torch.no_grad(), press(model):
        model(ids)
    return record


def dropkv_fp64(q, k, v, keep, window=WINDOW, pool_kernel=11, lookback=0, eps=1e-6):
    """algorithms.md section 1 in fp64, max pooling, then each entry takes the largest pooled
    score of the `lookback` entries before it, window protected; sorted kept indices."""
    q, k, v = q.double(), k.double(), v.double()
    hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qw = q[:, n - window:]  # [Hq, W, D]
    kk = k.repeat_interleave(g, 0)
    vv = v.repeat_interleave(g, 0)
    logits = qw @ kk.transpose(1, 2) / math.sqrt(d)  # [Hq, W, n]
    pos = torch.arange(n)
    rows = n - window + torch.arange(window)
    logits = logits.masked_fill(pos[None, :] > rows[:, None], float("-inf"))
    p = logits.softmax(-1)
    a = p @ vv  # [Hq, W, D]
    w = (p / (1 - p + eps)) ** 2
    d2 = ((vv * vv).sum(-1)[:, None, :] - 2 * a @ vv.transpose(1, 2) +
          (a * a).sum(-1)[:, :, None]).clamp_min(0)
    s = (w * d2).sum(1).view(hkv, g, n).sum(1) / g  # [Hkv, n]
    s = torch.nn.functional.max_pool1d(s[:, None, :], pool_kernel, 1, pool_kernel // 2)[:, 0]
    if lookback > 0:
        padded = torch.nn.functional.pad(s, (lookback, 0), value=float("-inf"))
        s = padded.unfold(-1, lookback + 1, 1).amax(-1)
    s[:, n - window:] = s.max(-1, keepdim=True).values + 1
    return s, s.topk(keep, -1).indices.sort(-1).values


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model_dir = os.path.join(out, "model")
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(1))

    cap = CapturePress()
    with torch.no_grad(), cap(model):
        model(ids)
    manifest = {"num_tokens": NUM_TOKENS, "window": WINDOW, "num_layers": cfg.num_hidden_layers,
                "num_q_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
                "head_dim": cfg.hidden_size // cfg.num_attention_heads, "layers": [],
                "presses": [], "dropkv": []}
    for l in range(cfg.num_hidden_layers):
        q, k, v = cap.layers[l]
        manifest["layers"].append({"q": save(out, f"l{l}_q.bin", q), "k": save(out, f"l{l}_k.bin", k),
                                   "v": save(out, f"l{l}_v.bin", v)})

    presses = {
        "snapkv": lambda cr: SnapKVPress(compression_ratio=cr, window_size=WINDOW, kernel_size=5),
        "streaming_llm": lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=4),
        "knorm": lambda cr: KnormPress(compression_ratio=cr),
        "observed_attention": lambda cr: ObservedAttentionPress(compression_ratio=cr),
        "pyramidkv": lambda cr: PyramidKVPress(compression_ratio=cr, window_size=WINDOW,
                                               kernel_size=5),
    }
    for name, make in presses.items():
        for cr in RATIOS:
            rec = run_and_record(model, ids, make(cr))
            entry = {"press": name, "compression_ratio": cr, "layers": []}
            for l in range(cfg.num_hidden_layers):
                tag = f"{name}_{cr}_l{l}"
                entry["layers"].append({"scores": save(out, tag + "_scores.bin", rec[l]["scores"]),
                                        "kept": save_i64(out, tag + "_kept.bin", rec[l]["kept"])})
            manifest["presses"].append(entry)

    for lookback, keep_ratio in itertools.product([0, 32], [0.1, 0.25, 0.5]):
        entry = {"keep_ratio": keep_ratio, "pooling_lookback": lookback, "layers": []}
        for l in range(cfg.num_hidden_layers):
            q, k, v = cap.layers[l]
            keep = min(NUM_TOKENS, max(int(math.floor(keep_ratio * NUM_TOKENS)), WINDOW, 1))
            s, kept = dropkv_fp64(q, k, v, keep, lookback=lookback)
            tag = f"dropkv_{keep_ratio}_lb{lookback}_l{l}"
            entry["layers"].append({"scores": save(out, tag + "_scores.bin", s),
                                    "kept": save_i64(out, tag + "_kept.bin", kept)})
        manifest["dropkv"].append(entry)

    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {out}/manifest.json")


if __name__ == "__main__":
    main()
