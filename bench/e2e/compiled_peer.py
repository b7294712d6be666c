#!/usr/bin/env python3
"""A gpt-fast-style peer of dropkv-bench-e2e's decode step: a plain-PyTorch Llama decoder compiled
with torch.compile(mode="reduce-overhead", fullgraph=True), i.e. Inductor kernels replayed as CUDA
graphs, on the same geometry with random weights (normal(0, 0.02), seeded, bf16).

What it times, per --decode BxC case: one decode step of B sequences at context C (ms/step), the
step being the model forward of one token per sequence plus the greedy argmax, as gpt-fast's
decode_one_token. The cache is filled with random K/V instead of a prefill (decode's cost does not
depend on the values; dropkv-bench-e2e --synthetic-context does the same). After --warmup steps
(the compile and the CUDA-graph capture), --repeats rounds of --steps steps each are timed with CUDA
events; a round's figure is its mean ms/step, the headline the best round. --sync picks how a step
ends: "step" reads the new ids back to the host every step (what a server does, and what ours
times), "round" feeds them on the device and syncs once per round (gpt-fast's generate loop).

How it differs from ours (a paged KV pool, a block table per sequence, a captured step per batch
bucket, our own kernels):
  - the KV cache is static and dense, preallocated per layer as [B, Hkv, max_len, D], written with
    index_copy_ at the position tensor `pos`;
  - --attention masked (default, gpt-fast's): SDPA over the whole max_len cache with a mask of the
    valid positions, so every step reads max_len entries; max_len = C + the longest run of steps
    + 1, rounded up to 64, so the mask costs little. Each round restarts at pos = C and advances;
  - --attention sliced: SDPA over cache[:, :, :C+1] without a mask, the least a step can read.
    Valid because the context is fixed per case: every step decodes at pos = C again (its K/V
    overwrite slot C), so each step costs exactly one at context C, where ours grows by a token
    per step;
  - GQA (--gqa): "fold" (default) views the G query heads of a KV head as G query rows,
    [B, Hkv, G, D], so SDPA reads each KV head once with no copy; "enable" is SDPA's enable_gqa=True;
    "repeat" is gpt-fast's repeat_interleave of K/V to all heads (a copy of the cache per step);
  - RoPE is plain (theta from the geometry: 500000 for Llama-3.1-8B), without llama3's frequency
    scaling (the same cost); qkv and gate/up are one fused weight each, as gpt-fast's wqkv;
  - --prefill L (batch 1) fills the cache from position 0 with causal SDPA over the fresh K/V
    (flash attention), logits of the last token only.

--check compares the cached paths (prefill, then masked or sliced decode steps over a cache whose
unused slots hold random values) against a straightforward full-recompute forward of the same
tokens with no cache, and exits 1 past the tolerance (fp32 on the CPU: 1e-4 of the largest logit).

Output: a markdown table on stdout and one JSON line per measurement, prefixed "RESULT ".
  CPU smoke test: compiled_peer.py --device cpu --geometry tiny --no-compile --check
  H200: bash bench/run.sh peer (ours and this peer in one call)
"""
import argparse
import json
import os
import sys
import time

import torch
import torch._dynamo.config
import torch._inductor.config
import torch.nn.functional as F
from torch import nn


GEOMETRIES = {
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5,
                 rope_theta=500000.0),
}


def load_config(path):
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the decoder's
    heads = cfg["num_attention_heads"]
    return dict(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 500000.0))


def round_up(n, m):
    return (n + m - 1) // m * m


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class KVCache(nn.Module):
    def __init__(self, batch, kv_heads, max_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        # Buffers: Dynamo treats a module's buffers as static addresses, so the CUDA graphs write
        # into them in place instead of copying the cache in and out.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos, k, v):
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v


def apply_rope(x, cos, sin):  # x [B, T, H, D]; rotate-half pairs (i, i + D/2), as HF Llama
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, g, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (g["num_attention_heads"], g["num_key_value_heads"],
                                                    g["head_dim"])
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.wqkv = nn.Linear(g["hidden_size"], q_dim + 2 * kv_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(q_dim, g["hidden_size"], bias=False, dtype=dtype)
        self.gqa = "fold"
        self.kv_cache = None

    def forward(self, x, cos, sin, pos, mask, attend):
        b, t, _ = x.shape
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.wqkv(x).split([h * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(b, t, h, d), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(b, t, hkv, d), cos, sin).transpose(1, 2)
        v = v.view(b, t, hkv, d).transpose(1, 2)
        k_all, v_all = self.kv_cache.update(pos, k, v)
        if t > 1:  # prefill from position 0: the fresh K/V are the whole context
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if attend is not None:
                k_all, v_all = k_all[:, :, :attend], v_all[:, :, :attend]
            y = self.decode_attention(q, k_all, v_all, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, h * d))

    def decode_attention(self, q, k, v, mask):  # q [B, H, 1, D], k / v [B, Hkv, S, D]
        b, h, _, d = q.shape
        group = h // self.kv_heads
        if self.gqa == "fold":  # heads kv*G .. kv*G+G-1 share KV head kv: make them G query rows
            y = F.scaled_dot_product_attention(q.view(b, self.kv_heads, group, d), k, v, attn_mask=mask)
            return y.view(b, h, 1, d)
        if self.gqa == "enable":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class FeedForward(nn.Module):
    def __init__(self, g, dtype):
        super().__init__()
        self.inter = g["intermediate_size"]
        self.w13 = nn.Linear(g["hidden_size"], 2 * self.inter, bias=False, dtype=dtype)  # gate, up
        self.w2 = nn.Linear(self.inter, g["hidden_size"], bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.w13(x).split([self.inter, self.inter], dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, g, dtype):
        super().__init__()
        self.attention_norm = RMSNorm(g["hidden_size"], g["rms_norm_eps"], dtype)
        self.attention = Attention(g, dtype)
        self.ffn_norm = RMSNorm(g["hidden_size"], g["rms_norm_eps"], dtype)
        self.feed_forward = FeedForward(g, dtype)

    def forward(self, x, cos, sin, pos, mask, attend):
        x = x + self.attention(self.attention_norm(x), cos, sin, pos, mask, attend)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, g, dtype):
        super().__init__()
        self.g = g
        self.tok_embeddings = nn.Embedding(g["vocab_size"], g["hidden_size"], dtype=dtype)
        self.layers = nn.ModuleList(Block(g, dtype) for _ in range(g["num_hidden_layers"]))
        self.norm = RMSNorm(g["hidden_size"], g["rms_norm_eps"], dtype)
        self.output = nn.Linear(g["hidden_size"], g["vocab_size"], bias=False, dtype=dtype)
        self.max_len = 0

    def set_gqa(self, how):
        for layer in self.layers:
            layer.attention.gqa = how

    def setup_caches(self, batch, max_len):
        dev, dtype = self.output.weight.device, self.output.weight.dtype
        for layer in self.layers:
            layer.attention.kv_cache = None  # free the previous case's cache first
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        g = self.g
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, g["num_key_value_heads"], max_len, g["head_dim"],
                                               dtype, dev)
        d = g["head_dim"]
        inv_freq = 1.0 / g["rope_theta"] ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(max_len, device=dev, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.max_len = max_len

    def fill_caches_randomly(self):
        for layer in self.layers:
            layer.attention.kv_cache.k.normal_()
            layer.attention.kv_cache.v.normal_()

    def forward(self, ids, pos, attend=None, last_only=False):
        """ids [B, T] at positions pos [T] (the same for every sequence)."""
        t = ids.shape[1]
        cos = self.rope_cos[pos].view(1, t, 1, -1)
        sin = self.rope_sin[pos].view(1, t, 1, -1)
        mask = None
        if t == 1 and attend is None:  # gpt-fast's masked step: the cache's valid positions
            mask = (torch.arange(self.max_len, device=ids.device) <= pos).view(1, 1, 1, -1)
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask, attend)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x))


def build_model(g, dtype, device, seed, check_scale=False):
    with torch.device("meta"):
        model = Llama(g, dtype)
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not check_scale:
                p.normal_(0.0, 0.02)  # as dropkv-bench-e2e --random-weights and hf_peer.py draw them
            elif p.dim() == 1:  # norms near 1 and unit-scale activations: every path shows in logits
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 1.0 if "embeddings" in name else p.shape[1] ** -0.5)
    return model.eval()


def decode_step(model, ids, pos, attend):
    logits = model(ids, pos, attend)[:, -1]
    return logits, logits.argmax(-1, keepdim=True)


def prefill(model, ids, pos):
    return model(ids, pos, None, last_only=True)[:, -1]


@torch.no_grad()
def reference_logits(model, ids):
    """Full recompute without a cache, in fp32: explicit causal softmax, RoPE as complex rotation."""
    g = model.g
    b, t = ids.shape
    h, hkv, d = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]

    def rms(x, norm):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()

    def rope(x):  # [B, T, heads, D]; pairs (i, i + D/2) as the real and imaginary parts
        inv_freq = 1.0 / g["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None]
        rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(x.device)
        z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * rot[None, :, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    x = model.tok_embeddings.weight.float()[ids]
    for layer in model.layers:
        a = layer.attention
        qkv = rms(x, layer.attention_norm) @ a.wqkv.weight.float().t()
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k = rope(q.reshape(b, t, h, d)), rope(k.reshape(b, t, hkv, d))
        v = v.reshape(b, t, hkv, d)
        k, v = k.repeat_interleave(h // hkv, dim=2), v.repeat_interleave(h // hkv, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / d ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h * d)
        x = x + o @ a.wo.weight.float().t()
        ff = layer.feed_forward
        gate, up = (rms(x, layer.ffn_norm) @ ff.w13.weight.float().t()).split(ff.inter, dim=-1)
        x = x + (F.silu(gate) * up) @ ff.w2.weight.float().t()
    return rms(x, model.norm) @ model.output.weight.float().t()


class Runner:
    """The model, its compiled step and prefill, and the device's timing."""

    def __init__(self, model, args):
        self.model, self.device = model, torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.mode = None if args.no_compile else args.mode
        self.cudagraphs = self.cuda and self.mode in ("reduce-overhead", "max-autotune")
        if self.mode:
            # Static shapes per case, as gpt-fast's decode: each (B, max_len, attend) compiles once.
            self.step = torch.compile(decode_step, mode=self.mode, fullgraph=True, dynamic=False)
            self.prefill = torch.compile(prefill, mode="max-autotune-no-cudagraphs"
                                         if self.mode == "max-autotune" else "default",
                                         fullgraph=True, dynamic=False)
        else:
            self.step, self.prefill = decode_step, prefill

    def run_step(self, ids, pos, attend):
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
        return self.step(self.model, ids, pos, attend)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, fn):
        if self.cuda:
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


def sdpa_backend(runner, batch, ctx, attention):
    """The SDPA kernel the decode step's attention dispatches to (information for the reader)."""
    try:
        from torch.nn.attention import SDPBackend

        g, m = runner.model.g, runner.model
        h, hkv, d = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
        gqa = m.layers[0].attention.gqa
        opts = dict(device=runner.device, dtype=m.output.weight.dtype)
        s = ctx + 1 if attention == "sliced" else m.max_len
        kv = torch.empty(batch, hkv if gqa != "repeat" else h, s, d, **opts)
        q = torch.empty(batch, hkv if gqa == "fold" else h, h // hkv if gqa == "fold" else 1, d, **opts)
        mask = None if attention == "sliced" else torch.ones(1, 1, 1, s, dtype=torch.bool,
                                                              device=runner.device)
        choice = torch._fused_sdp_choice(q, kv, kv, mask, 0.0, False, enable_gqa=gqa == "enable")
        names = {int(v.value): k for k, v in SDPBackend.__members__.items()}
        return names.get(int(choice), str(choice)).lower()
    except Exception as e:  # a private helper: its absence must not stop the benchmark
        return f"unknown ({type(e).__name__})"


@torch.no_grad()
def time_decode(runner, batch, ctx, attention, args):
    model = runner.model
    run_len = max(args.steps, args.warmup)
    max_len = round_up(ctx + run_len + 1, 64)  # the same cache for both modes
    model.setup_caches(batch, max_len)
    model.fill_caches_randomly()
    attend = ctx + 1 if attention == "sliced" else None
    ids = torch.randint(0, model.g["vocab_size"], (batch, 1), device=runner.device)
    pos = torch.tensor([ctx], device=runner.device)

    def run(steps, host_each_step):
        pos.fill_(ctx)
        for _ in range(steps):
            _, nxt = runner.run_step(ids, pos, attend)
            ids.copy_(nxt)
            if attend is None:
                pos.add_(1)
            if host_each_step:
                ids.cpu()  # the host gets the new ids, as a server's step loop (and ours)

    t0 = time.perf_counter()
    run(1, True)
    first_s = time.perf_counter() - t0
    run(args.warmup, True)
    runner.sync()
    warmup_s = time.perf_counter() - t0
    syncs = args.sync.split(",")
    rounds = {s: [] for s in syncs}
    for _ in range(args.repeats):
        for s in syncs:
            rounds[s].append(runner.elapsed_ms(lambda: run(args.steps, s == "step")) / args.steps)
    backend = sdpa_backend(runner, batch, ctx, attention)
    return [dict(kind="decode", batch=batch, context=ctx, attention=attention,
                 gqa=model.layers[0].attention.gqa, sdpa=backend, sync=s, max_len=max_len,
                 steps=args.steps, rounds_ms=rounds[s], ms_per_step=min(rounds[s]),
                 mean_ms_per_step=sum(rounds[s]) / len(rounds[s]),
                 tokens_per_s=batch * 1000.0 / min(rounds[s]), compile_s=first_s, warmup_s=warmup_s)
            for s in syncs]


@torch.no_grad()
def time_prefill(runner, n, args):
    model = runner.model
    model.setup_caches(1, round_up(n, 64))
    ids = torch.randint(0, model.g["vocab_size"], (1, n), device=runner.device)
    pos = torch.arange(n, device=runner.device)
    t0 = time.perf_counter()
    runner.prefill(model, ids, pos)
    runner.sync()
    first_s = time.perf_counter() - t0
    runner.prefill(model, ids, pos)
    times = [runner.elapsed_ms(lambda: runner.prefill(model, ids, pos)) for _ in range(args.repeats)]
    return dict(kind="prefill", tokens=n, rounds_ms=times, ms=min(times), compile_s=first_s)


@torch.no_grad()
def check(runner, attention, args):
    """Cached paths against reference_logits; returns the worst relative error."""
    model = runner.model
    batch, t = 2, 12
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.g["vocab_size"], (batch, t), generator=gen).to(runner.device)
    ref = reference_logits(model, ids)
    scale = ref.abs().max().item()

    def err(logits, i):
        return (logits.float() - ref[:, i]).abs().max().item() / scale

    model.setup_caches(batch, 64)
    model.fill_caches_randomly()  # unused slots hold garbage: a mask or slice that leaks shows
    errors = []
    # Prefill the first part, then decode the rest one token at a time (masked), or re-decode the
    # last token twice at one position (sliced: the benchmark's loop).
    start = t // 2 if attention == "masked" else t - 1
    last = runner.prefill(model, ids[:, :start], torch.arange(start, device=runner.device))
    errors.append(("prefill", err(last, start - 1)))
    for i in range(start, t) if attention == "masked" else (t - 1, t - 1):
        attend = None if attention == "masked" else i + 1
        pos = torch.tensor([i], device=runner.device)
        logits, _ = runner.run_step(ids[:, i:i + 1].contiguous(), pos, attend)
        errors.append((f"decode pos {i}", err(logits, i)))
    worst = max(e for _, e in errors)
    print(f"check {attention} (gqa {model.layers[0].attention.gqa}): worst |diff| / max|logit| = "
          f"{worst:.2e} over {len(errors)} comparisons (max|logit| {scale:.3g}; "
          + ", ".join(f"{n} {e:.1e}" for n, e in errors) + ")")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--config", help="a Hugging Face config.json (or its folder): its geometry")
    ap.add_argument("--decode", default="1x8192,4x4096,16x2048", help="BATCHxCONTEXT list")
    ap.add_argument("--prefill", default="", help="batch-1 prompt lengths to time, comma-separated")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps per round")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compile, capture)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds")
    ap.add_argument("--attention", default="masked", help="masked, sliced or both comma-joined")
    ap.add_argument("--gqa", default="fold", choices=["fold", "enable", "repeat"])
    ap.add_argument("--sync", default="step,round", help="step, round or both comma-joined")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 on the CPU)")
    ap.add_argument("--no-compile", action="store_true", help="eager")
    ap.add_argument("--max-autotune", action="store_true", help='mode="max-autotune"')
    ap.add_argument("--no-coordinate-descent", action="store_true",
                    help="skip Inductor's coordinate-descent tuning (gpt-fast turns it on): faster compiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true",
                    help="compare against a full-recompute forward instead of timing (weights at unit "
                         "scale); exit 1 on mismatch")
    args = ap.parse_args()

    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.mode = "max-autotune" if args.max_autotune else ("reduce-overhead" if cuda else "default")
    if not args.no_compile:
        torch._dynamo.config.recompile_limit = 64  # one graph per case and attention mode
        torch._inductor.config.fx_graph_cache = True
        if cuda and not args.no_coordinate_descent:
            torch._inductor.config.coordinate_descent_tuning = True
            torch._inductor.config.triton.unique_kernel_names = True

    g = load_config(args.config) if args.config else GEOMETRIES[args.geometry]
    name = args.config or args.geometry
    model = build_model(g, dtype, torch.device(args.device), args.seed, check_scale=args.check)
    model.set_gqa(args.gqa)
    runner = Runner(model, args)
    peer = "eager" if args.no_compile else f"compiled-{args.mode}"
    n_params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"torch {torch.__version__} (cuda {torch.version.cuda}), {gpu}; {peer}; {name}: "
          f"{g['num_hidden_layers']} layers, hidden {g['hidden_size']}, heads {g['num_attention_heads']}/"
          f"{g['num_key_value_heads']} x {g['head_dim']}, {n_params / 1e9:.2f} B params {dtype}; "
          f"rope theta {g['rope_theta']:g} (no scaling); gqa {args.gqa}", flush=True)
    attentions = [a for a in args.attention.split(",") if a]
    if not attentions or any(a not in ("masked", "sliced") for a in attentions):
        ap.error(f"--attention: masked, sliced or both, not {args.attention}")
    if not set(args.sync.split(",")) <= {"step", "round"}:
        ap.error(f"--sync: step, round or both, not {args.sync}")

    if args.check:
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        worst = max(check(runner, a, args) for a in attentions)
        print(f"check: {'PASS' if worst <= tol else 'FAIL'} (tolerance {tol:g})")
        sys.exit(0 if worst <= tol else 1)

    results = []
    for n in [int(x) for x in args.prefill.split(",") if x]:
        r = dict(peer=peer, **time_prefill(runner, n, args))
        print("RESULT " + json.dumps(r), flush=True)
        print(f"prefill {n}: {r['ms']:.2f} ms (compile {r['compile_s']:.1f} s)", file=sys.stderr)
        results.append(r)
    for spec in [s for s in args.decode.split(",") if s]:  # case-major: a cut run keeps pairs
        batch, ctx = (int(x) for x in spec.split("x"))
        for attention in attentions:
            for r in time_decode(runner, batch, ctx, attention, args):
                r = dict(peer=peer, **r)
                print("RESULT " + json.dumps(r), flush=True)
                print(f"decode bs{batch} ctx{ctx} {attention} sync={r['sync']}: {r['ms_per_step']:.3f} "
                      f"ms/step (first call {r['compile_s']:.1f} s, warm-up {r['warmup_s']:.1f} s, "
                      f"sdpa {r['sdpa']})", file=sys.stderr, flush=True)
                results.append(r)

    first_sync = args.sync.split(",")[0]  # a case's sync rows share its first call
    compile_s = sum(r["compile_s"] for r in results if r["kind"] == "prefill" or r["sync"] == first_sync)
    skips = ""
    if runner.cudagraphs:  # a skipped graph leaves the step as Inductor kernels launched one by one
        from torch._dynamo.utils import counters

        skips = f"; CUDA-graph skips {counters['inductor']['cudagraph_skips']} (0: all steps are graphs)"
    print(f"\ncompile mode {args.mode if not args.no_compile else 'none (eager)'}; first calls "
          f"(compile) {compile_s:.1f} s in all{skips}\n")
    rounds = max((len(r["rounds_ms"]) for r in results), default=0)
    print("| peer | case | attention | sync | " + " | ".join(f"round{i + 1}" for i in range(rounds))
          + " | best ms | tok/s | first call s |")
    print("|" + "---|" * (rounds + 7))
    for r in results:
        if r["kind"] == "prefill":
            case, att, sync, tps = f"prefill {r['tokens']}", "causal", "-", r["tokens"] * 1000.0 / r["ms"]
            best = r["ms"]
        else:
            case, att, sync = f"decode bs{r['batch']} ctx{r['context']}", r["attention"], r["sync"]
            best, tps = r["ms_per_step"], r["tokens_per_s"]
        cells = [f"{x:.3f}" for x in r["rounds_ms"]] + [""] * (rounds - len(r["rounds_ms"]))
        print(f"| {r['peer']} | {case} | {att} | {sync} | " + " | ".join(cells)
              + f" | {best:.3f} | {tps:.0f} | {r['compile_s']:.1f} |")


if __name__ == "__main__":
    main()
