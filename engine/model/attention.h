// Attention ops the model runtime calls. Each is one function so a fused CUDA kernel (kernels/)
// can replace the ATen reference without touching the callers.
#pragma once

#include <ATen/core/Tensor.h>

namespace dropkv {

// Prefill attention of one sequence. q: [T, Hq, D] (the chunk's queries, after RoPE).
// k, v: [Hkv, n, D], n >= T: the first n - T entries are earlier tokens that every query sees
// (stored cache, possibly compressed), the last T are the chunk itself, seen causally.
// GQA: query head h reads KV head h / (Hq / Hkv). Returns [T, Hq, D] in q's dtype.
at::Tensor PrefillAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);

// Decode attention of one query per sequence over a contiguous cache. q: [Hq, D];
// k, v: [Hkv, n, D]. Softmax in fp32. Returns [Hq, D] in q's dtype.
at::Tensor ContiguousDecodeAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale);

// Batched decode attention over the paged cache, sequences of different lengths.
// q: [B, Hq, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
// block_tables: int32 [B, max_blocks] (row b lists sequence b's blocks, padding arbitrary);
// seq_lens: int32 [B] (entries stored for this layer, >= 1). Returns [B, Hq, D].
// CPU reference: gathers each sequence's slots and calls ContiguousDecodeAttention, so a paged
// result equals the contiguous one bit for bit.
at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale);

}  // namespace dropkv
