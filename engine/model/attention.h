// Attention ops the model runtime calls. Each is one function so a fused CUDA kernel (kernels/)
// can replace the ATen reference without touching the callers.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "engine/model/config.h"
#include "kernels/tuning.h"

namespace dropkv {

// What a layer's attention does beside the causal mask and the scale.
struct AttentionLimits {
  // > 0: a query sees only the `window` latest positions, itself included (sliding window).
  int64_t window = 0;
  // > 0: logits -> softcap * tanh(logits / softcap) before the softmax (Gemma 2).
  double softcap = 0;
};
inline AttentionLimits LimitsOf(const ModelConfig& c, int32_t layer_idx) {
  return {c.is_sliding(layer_idx) ? c.sliding_window : 0, c.attn_logit_softcapping};
}

// Prefill attention of one sequence. q: [T, Hq, D] (the chunk's queries, after RoPE).
// k, v: [Hkv, n, D], n >= T: the first n - T entries are earlier tokens that every query sees
// (stored cache, possibly compressed), the last T are the chunk itself, seen causally.
// GQA: query head h reads KV head h / (Hq / Hkv). Returns [T, Hq, D] in q's dtype.
// On CUDA (bf16 / fp16, D % 8 == 0, D <= 256) it runs ATen's fused kernels directly
// (PrefillAttentionWithLse, kAuto); elsewhere the SDPA path.
at::Tensor PrefillAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);

// Which implementation PrefillAttentionWithLse runs: the tuning's enum, so that
// KernelTuning::prefill_attention (DROPKV_PREFILL_ATTENTION) names the same values.
//   kAuto: where kFlash applies, kCudnn for first chunks of >= 8192 tokens (faster there), else
//     kFlash, unless the tuning forces one; elsewhere (CPU, fp32, other head dims) kSdpa.
//   kSdpa: at::scaled_dot_product_attention: is_causal for a first chunk, else a [T, n] bool
//     mask. Any device and dtype; gives no LSE.
//   kFlash: ATen's flash attention op (FA2) called directly: GQA without expanding K/V, causal
//     aligned bottom-right when T < n (the chunked-prefill mask without building it), and the
//     LSE. CUDA, bf16 / fp16, D % 8 == 0, D <= 256 (ATen checks; an unsupported input throws).
//   kCudnn: cuDNN's fused attention for a first chunk (T == n; its causal mask is top-left
//     aligned), kFlash for later chunks. Same inputs as kFlash.
using PrefillAttentionImpl = kernels::PrefillAttentionChoice;

struct PrefillAttentionOutput {
  at::Tensor out;  // [T, Hq, D] in q's dtype
  // fp32 [Hq, T]: natural log of sum_j exp(scale * q_i . k_j) over the keys row i sees.
  // Undefined when the implementation gives none (kSdpa).
  at::Tensor lse;
};

// The query length kCudnn runs a first chunk of t_len tokens at: t_len rounded up to a multiple
// of 1/16 of the largest power of two <= t_len (<= 6.25% more rows; t_len itself up to 16).
// cuDNN builds and keeps one execution graph per shape (45-60 ms each on the H200), so a server
// that sees every prompt length would build one per request and never stop growing; with the
// padding it builds at most 16 per octave of lengths.
int64_t CudnnPaddedLength(int64_t t_len);

// PrefillAttention with the choice of implementation and the layer's limits; arguments as
// PrefillAttention. With a window, the n keys must be consecutive positions ending at the last
// query's (key j is at position n - T + i - (n - T + i - j) for row i): the sliding layers' caches
// are gathered in position order. A window runs on CUDA as ATen's flash kernel with its window
// (kAuto; cuDNN has none), elsewhere as SDPA with the mask; a softcap runs the explicit math
// (no fused kernel caps logits), in blocks of query rows.
PrefillAttentionOutput PrefillAttentionWithLse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    PrefillAttentionImpl impl = PrefillAttentionImpl::kAuto, const AttentionLimits& limits = {});

// Decode attention of one query per sequence over a contiguous cache. q: [Hq, D];
// k, v: [Hkv, n, D]. Softmax in fp32. Returns [Hq, D] in q's dtype. softcap as AttentionLimits.
at::Tensor ContiguousDecodeAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale, double softcap = 0);

// Batched decode attention over the paged cache, sequences of different lengths.
// q: [B, Hq, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
// block_tables: int32 [B, max_blocks] (row b lists sequence b's blocks, padding arbitrary);
// seq_lens: int32 [B] (entries stored for this layer, >= 1). Returns [B, Hq, D].
// CPU reference: gathers each sequence's slots and calls ContiguousDecodeAttention, so a paged
// result equals the contiguous one bit for bit.
at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, double softcap = 0);

}  // namespace dropkv
