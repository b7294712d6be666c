#!/usr/bin/env python3
"""A compiled-PyTorch decode peer (issue 26): a gpt-fast-style Llama with a static KV cache whose
one-token decode step runs under torch.compile(mode="reduce-overhead") (Inductor kernels replayed
as a CUDA graph), the strongest plain-PyTorch baseline for our decode step.

Random bf16 weights at a geometry (default Llama-3.1-8B: 32 layers, hidden 4096, 32 / 8 heads,
head_dim 128, FFN 14336, vocab 128256); each case fills the cache to its context with random K/V
(the values do not change the work) and times --steps decode steps after a warm-up that compiles.
Prints one line per case, "decode bs{B} ctx{C}: {ms} ms/step", and JSON with --json.

  python3 bench/e2e/compiled_peer.py --decode 1x8192,16x2048 [--steps 64] [--json]
Written here after gpt-fast's design (static cache, index_copy_ into it, SDPA over a mask);
nothing copied.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

GEOMETRIES = {
    "llama-3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                         ffn=14336, vocab=128256, theta=500000.0),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512,
                 theta=10000.0),  # a smoke test of this script (e.g. --device cpu)
}


class Layer(torch.nn.Module):
    def __init__(self, g, dtype):
        super().__init__()
        h, d = g["hidden"], g["head_dim"]
        self.qkv = torch.nn.Linear(h, (g["heads"] + 2 * g["kv_heads"]) * d, bias=False, dtype=dtype)
        self.o = torch.nn.Linear(g["heads"] * d, h, bias=False, dtype=dtype)
        self.gate_up = torch.nn.Linear(h, 2 * g["ffn"], bias=False, dtype=dtype)
        self.down = torch.nn.Linear(g["ffn"], h, bias=False, dtype=dtype)
        self.norm1 = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype)
        self.norm2 = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype)
        self.heads, self.kv_heads, self.head_dim = g["heads"], g["kv_heads"], d


def rope(x, cos, sin):  # x [B, H, 1, D]; cos, sin [1, 1, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Model(torch.nn.Module):
    def __init__(self, g, batch, max_len, dtype):
        super().__init__()
        self.g = g
        self.embed = torch.nn.Embedding(g["vocab"], g["hidden"], dtype=dtype)
        self.layers = torch.nn.ModuleList(Layer(g, dtype) for _ in range(g["layers"]))
        self.norm = torch.nn.RMSNorm(g["hidden"], eps=1e-5, dtype=dtype)
        self.head = torch.nn.Linear(g["hidden"], g["vocab"], bias=False, dtype=dtype)
        shape = (g["layers"], batch, g["kv_heads"], max_len, g["head_dim"])
        self.register_buffer("k_cache", torch.randn(shape, dtype=dtype) * 0.1)
        self.register_buffer("v_cache", torch.randn(shape, dtype=dtype) * 0.1)
        inv = 1.0 / (g["theta"] ** (torch.arange(0, g["head_dim"], 2).float() / g["head_dim"]))
        self.register_buffer("inv_freq", inv)
        self.max_len = max_len

    def forward(self, tokens, pos):  # tokens [B], pos [1]: the new tokens' position (all rows)
        g = self.g
        b = tokens.shape[0]
        x = self.embed(tokens).unsqueeze(1)  # [B, 1, H]
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos()[:, None, None, :], ang.sin()[:, None, None, :]
        # Keys up to and including the position; the attention is written out (GQA as a grouped
        # matmul over the static cache) so that Inductor fuses the mask and the softmax and the
        # step reads K and V once, instead of SDPA's masked path.
        mask = torch.arange(self.max_len, device=tokens.device) <= pos
        for i, layer in enumerate(self.layers):
            hq, hk, d = layer.heads, layer.kv_heads, layer.head_dim
            qkv = layer.qkv(layer.norm1(x))
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            q = rope(q.view(b, 1, hq, d).transpose(1, 2), cos, sin)
            k = rope(k.view(b, 1, hk, d).transpose(1, 2), cos, sin)
            v = v.view(b, 1, hk, d).transpose(1, 2)
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            qg = q.reshape(b, hk, hq // hk, d)
            s = torch.matmul(qg, self.k_cache[i].transpose(-1, -2)).float() * d ** -0.5
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
            o = torch.matmul(p, self.v_cache[i])  # [B, Hk, rep, D]
            x = x + layer.o(o.reshape(b, 1, hq * d))
            gate, up = layer.gate_up(layer.norm2(x)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self.head(self.norm(x))[:, 0].float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--decode", default="1x8192,16x2048", help="BxCONTEXT cases")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    g = GEOMETRIES[args.geometry]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    results = []
    for case in args.decode.split(","):
        batch, ctx = (int(v) for v in case.split("x"))
        with torch.device(dev), torch.no_grad():
            model = Model(g, batch, ctx + args.steps + 8, torch.bfloat16)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
            step = torch.compile(model, mode=args.mode, fullgraph=True)
            tokens = torch.randint(0, g["vocab"], (batch,))
            pos = torch.full((1,), ctx, dtype=torch.long)
            t0 = time.time()
            for _ in range(3):  # compile, then the graph's warm-up replays
                tokens = step(tokens, pos).argmax(-1)
                pos = pos + 1
            tokens.tolist()
            compile_s = time.time() - t0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tokens = step(tokens, pos).argmax(-1)
                pos = pos + 1
                tokens.tolist()  # the host needs the ids each step, as a server does
            ms = (time.perf_counter() - t0) * 1e3 / args.steps
        print(f"decode bs{batch} ctx{ctx}: {ms:.3f} ms/step (compile + warm-up {compile_s:.1f} s)",
              flush=True)
        results.append({"batch": batch, "context": ctx, "ms_per_step": ms,
                        "compile_s": compile_s, "mode": args.mode})
        del model, step
        if cuda:
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    if args.json:
        print(json.dumps({"geometry": args.geometry, "decode": results}))


if __name__ == "__main__":
    main()
