#include "engine/model/attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "kernels/kv_cache_fp8.h"
#include "kernels/tuning.h"

namespace dropkv {

namespace {

// [rows, num_keys] bool: which of the keys at positions [key_pos0, key_pos0 + num_keys) the queries
// at positions [query_pos0, query_pos0 + rows) see: the earlier ones and themselves, and with a
// window only the `window` latest positions.
at::Tensor VisibleKeyRange(int64_t query_pos0, int64_t rows, int64_t key_pos0, int64_t num_keys,
                           int64_t window, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto query_pos = at::arange(query_pos0, query_pos0 + rows, opts).unsqueeze(1);
  auto key_pos = at::arange(key_pos0, key_pos0 + num_keys, opts).unsqueeze(0);
  auto visible = key_pos <= query_pos;
  if (window > 0) visible = visible.logical_and(key_pos > query_pos - window);
  return visible;
}

// [rows, n] bool: which keys query rows [row0, row0 + rows) of a chunk of t_len see, the chunk
// being the last t_len of n keys (key j at position j): every earlier entry, causal inside the
// chunk, and with a window only the `window` latest positions.
at::Tensor VisibleKeys(int64_t row0, int64_t rows, int64_t t_len, int64_t n, int64_t window,
                       const at::Device& device) {
  return VisibleKeyRange(n - t_len + row0, rows, 0, n, window, device);
}

// Query rows per block of a sliding-window prefill: a block sees rows + window - 1 keys, of which
// each row uses `window`; smaller blocks waste less of the block's [rows, keys] product, larger
// ones call SDPA less often.
constexpr int64_t kWindowRowsPerBlock = 256;

// The pre-flash path (kept for CPU, fp32 and odd head dims, and as the A/B baseline). With a
// window shorter than the keys, the query rows go in blocks against the keys they can see (the
// block's first row's window through its last row): a sliding layer's attention then grows with
// T x window instead of T x n (one [T, n] mask: 16x the work at 8K tokens and a 512 window).
at::Tensor SdpaPrefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       int64_t window) {
  const int64_t t_len = q.size(0);
  const int64_t n = k.size(1);
  if (n == t_len && (window <= 0 || window >= n)) {
    auto qh = q.transpose(0, 1).unsqueeze(0);  // [1, Hq, T, D]
    auto out = at::scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), {}, 0.0,
                                                /*is_causal=*/true, scale, /*enable_gqa=*/true);
    return out.squeeze(0).transpose(0, 1).contiguous();  // [T, Hq, D]
  }
  // (SDPA's is_causal is top-left aligned when T < n, so it cannot express this: a mask.)
  const int64_t rows_per_block = window > 0 && window < n ? kWindowRowsPerBlock : t_len;
  auto out = at::empty_like(q);  // [T, Hq, D]
  for (int64_t r0 = 0; r0 < t_len; r0 += rows_per_block) {
    const int64_t rows = std::min(rows_per_block, t_len - r0);
    const int64_t first_pos = n - t_len + r0;  // the block's first row; key j is at position j
    const int64_t k0 = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
    const int64_t k1 = first_pos + rows;
    auto mask = VisibleKeyRange(first_pos, rows, k0, k1 - k0, window, q.device());
    auto qh = q.narrow(0, r0, rows).transpose(0, 1).unsqueeze(0);  // [1, Hq, rows, D]
    auto kh = k.narrow(1, k0, k1 - k0).unsqueeze(0);               // [1, Hkv, k1 - k0, D]
    auto vh = v.narrow(1, k0, k1 - k0).unsqueeze(0);
    auto block = at::scaled_dot_product_attention(qh, kh, vh, mask, 0.0, false, scale, true);
    out.narrow(0, r0, rows).copy_(block.squeeze(0).transpose(0, 1));
  }
  return out;
}

// Soft-capped logits (Gemma 2), which no fused kernel computes: the scores in fp32, capped,
// masked, softmaxed, in blocks of query rows so that a long chunk holds [Hq, block, n] at a time.
PrefillAttentionOutput MathPrefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, const AttentionLimits& limits) {
  const int64_t t_len = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t num_kv_heads = k.size(0);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t d = q.size(2);
  const int64_t n = k.size(1);
  constexpr int64_t kRowsPerBlock = 256;
  auto kf = k.to(at::kFloat);
  auto vf = v.to(at::kFloat);
  auto out = at::empty({t_len, num_heads, d}, q.options());
  auto lse = at::empty({num_heads, t_len}, q.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < t_len; r0 += kRowsPerBlock) {
    const int64_t rows = std::min(kRowsPerBlock, t_len - r0);
    // [Hkv, G * rows, D]: query head h = kv * G + g.
    auto qb = q.narrow(0, r0, rows)
                  .to(at::kFloat)
                  .permute({1, 0, 2})
                  .reshape({num_kv_heads, group * rows, d});
    auto scores = at::bmm(qb, kf.transpose(1, 2)).mul_(scale);  // [Hkv, G * rows, n]
    if (limits.softcap > 0) scores = at::tanh(scores / limits.softcap) * limits.softcap;
    scores = scores.view({num_kv_heads, group, rows, n});
    auto visible = VisibleKeys(r0, rows, t_len, n, limits.window, q.device());
    scores.masked_fill_(visible.logical_not(), -std::numeric_limits<float>::infinity());
    auto block_lse = at::logsumexp(scores, -1);  // [Hkv, G, rows]
    auto probs = at::exp(scores - block_lse.unsqueeze(-1)).view({num_kv_heads, group * rows, n});
    auto o = at::bmm(probs, vf).view({num_heads, rows, d});  // [Hq, rows, D]
    out.narrow(0, r0, rows).copy_(o.transpose(0, 1));
    lse.narrow(1, r0, rows).copy_(block_lse.view({num_heads, rows}));
  }
  return {out, lse};
}

// ATen's flash kernel with its sliding window (FA2 aligns causal + window bottom-right: row i
// sees keys (n - T + i - window, n - T + i]).
PrefillAttentionOutput FlashWindowPrefill(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, double scale, int64_t window) {
  const int64_t t_len = q.size(0);
  const int64_t n = k.size(1);
  auto result = at::_flash_attention_forward(
      q.unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), std::nullopt,
      std::nullopt, t_len, n, /*dropout_p=*/0.0, /*is_causal=*/true,
      /*return_debug_mask=*/false, scale, /*window_size_left=*/window - 1,
      /*window_size_right=*/0);
  const at::Tensor& out = std::get<0>(result);  // [1, T, Hq, D]
  const at::Tensor& lse = std::get<1>(result);  // fp32 [1, Hq, T]
  return {out.squeeze(0), lse.squeeze(0).narrow(1, 0, t_len)};
}

PrefillAttentionOutput FlashPrefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  const int64_t t_len = q.size(0);
  // The op takes [B, H, L, D] and runs on its [B, L, H, D] transpose: q [T, Hq, D] is that
  // already (no copy), k / v need only a contiguous last dim. Hkv < Hq is native GQA (head h
  // reads KV head h / (Hq / Hkv)). is_causal is aligned bottom-right in FA2: row i sees keys
  // j <= n - T + i, which is exactly "every earlier entry + causal inside the chunk"
  // (torch/nn/attention/bias.py calls it the same way for its lower-right causal bias).
  auto result = at::_scaled_dot_product_flash_attention(
      q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), /*dropout_p=*/0.0,
      /*is_causal=*/true, /*return_debug_mask=*/false, scale);
  const at::Tensor& out = std::get<0>(result);  // [1, Hq, T, D], a view of [1, T, Hq, D]
  const at::Tensor& lse = std::get<1>(result);  // fp32 [1, Hq, T]
  return {out.squeeze(0).transpose(0, 1).contiguous(), lse.squeeze(0).narrow(1, 0, t_len)};
}

// x with zero rows appended along `dim` up to `length` (x itself when it has that many).
at::Tensor PadWithZeros(const at::Tensor& x, int64_t dim, int64_t length) {
  const int64_t extra = length - x.size(dim);
  if (extra == 0) return x;
  std::vector<int64_t> pad(2 * (x.dim() - dim), 0);  // (low, high) pairs from the last dim on
  pad.back() = extra;
  return at::constant_pad_nd(x, pad, 0.0);
}

// cuDNN's fused attention (Hopper kernels). Its causal mask is top-left aligned, so it serves
// only a first chunk (T == n); later chunks go to flash. It builds (45-60 ms) and keeps a graph
// per shape, so T is padded with zero rows to CudnnPaddedLength(T): under a causal mask the
// appended keys come after every real query and change none of their rows, which are returned.
PrefillAttentionOutput CudnnPrefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  const int64_t t_len = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t padded = CudnnPaddedLength(t_len);
  auto result = at::_scaled_dot_product_cudnn_attention(
      PadWithZeros(q, 0, padded).transpose(0, 1).unsqueeze(0),
      PadWithZeros(k, 1, padded).unsqueeze(0), PadWithZeros(v, 1, padded).unsqueeze(0),
      /*attn_bias=*/std::nullopt, /*compute_log_sumexp=*/true, /*dropout_p=*/0.0,
      /*is_causal=*/true, /*return_debug_mask=*/false, scale);
  const at::Tensor& out = std::get<0>(result);  // [1, Hq, T', D]
  const at::Tensor& lse = std::get<1>(result);  // fp32 [1, Hq, T', 1]
  // Only the real rows are copied out: [T, Hq, D] and [Hq, T].
  return {out.squeeze(0).transpose(0, 1).narrow(0, 0, t_len).contiguous(),
          lse.reshape({num_heads, padded}).narrow(1, 0, t_len)};
}

bool FlashApplies(const at::Tensor& q, const at::Tensor& k) {
  const int64_t d = q.size(-1);
  const auto dtype = q.scalar_type();
  return q.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         k.scalar_type() == dtype && d % 8 == 0 && d <= 256 && k.size(1) >= q.size(0);
}

// First chunks from this length on go to cuDNN under kAuto. Measured on the H200 (docs/
// benchmarks.md): cuDNN's causal attention is 1.8-1.9x faster than FA2 from 8K to 32K tokens, but
// each new length builds a cuDNN graph (45-60 ms at first sight), which shorter prompts' attention
// (FA2: 0.5 ms per layer at 4K) does not pay back.
constexpr int64_t kCudnnMinTokens = 8192;

}  // namespace

int64_t CudnnPaddedLength(int64_t t_len) {
  if (t_len <= 16) return t_len;
  int64_t octave = 1;  // the largest power of two <= t_len
  while (octave * 2 <= t_len) octave *= 2;
  const int64_t step = octave / 16;
  return (t_len + step - 1) / step * step;
}

PrefillAttentionOutput PrefillAttentionWithLse(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, double scale,
                                               PrefillAttentionImpl impl,
                                               const AttentionLimits& limits) {
  if (limits.softcap > 0) return MathPrefill(q, k, v, scale, limits);
  // A window that reaches the first key masks nothing.
  const int64_t window = limits.window > 0 && limits.window < k.size(1) ? limits.window : 0;
  if (window > 0) {
    if (impl != PrefillAttentionImpl::kSdpa && FlashApplies(q, k)) {
      return FlashWindowPrefill(q, k, v, scale, window);
    }
    return {SdpaPrefill(q, k, v, scale, window), at::Tensor()};
  }
  if (impl == PrefillAttentionImpl::kAuto) {
    if (!FlashApplies(q, k)) {
      impl = PrefillAttentionImpl::kSdpa;
    } else if (kernels::Tuning().prefill_attention != PrefillAttentionImpl::kAuto) {
      impl = kernels::Tuning().prefill_attention;
    } else {
      impl = q.size(0) >= kCudnnMinTokens ? PrefillAttentionImpl::kCudnn
                                          : PrefillAttentionImpl::kFlash;
    }
  }
  if (impl == PrefillAttentionImpl::kCudnn && q.size(0) == k.size(1)) {
    return CudnnPrefill(q, k, v, scale);
  }
  if (impl != PrefillAttentionImpl::kSdpa) return FlashPrefill(q, k, v, scale);
  return {SdpaPrefill(q, k, v, scale, 0), at::Tensor()};
}

at::Tensor PrefillAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  return PrefillAttentionWithLse(q, k, v, scale).out;
}

at::Tensor ContiguousDecodeAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale, double softcap) {
  const int64_t num_heads = q.size(0);
  const int64_t num_kv_heads = k.size(0);
  const int64_t d = q.size(1);
  auto qg = q.to(at::kFloat).view({num_kv_heads, num_heads / num_kv_heads, d});  // [Hkv, G, D]
  auto scores =
      at::bmm(qg, k.to(at::kFloat).contiguous().transpose(1, 2)).mul_(scale);  // [Hkv, G, n]
  if (softcap > 0) scores = at::tanh(scores / softcap) * softcap;
  auto probs = at::softmax(scores, -1);
  auto out = at::bmm(probs, v.to(at::kFloat).contiguous());  // [Hkv, G, D]
  return out.view({num_heads, d}).to(q.scalar_type());
}

at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, double softcap) {
  const int64_t batch = q.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t d = key_cache.size(3);
  auto lens = seq_lens.to(at::kCPU, at::kInt);
  auto tables = block_tables.to(at::kCPU, at::kLong);
  auto k_flat = key_cache.view({-1, num_kv_heads, d});  // [num_blocks * block_size, Hkv, D]
  auto v_flat = value_cache.view({-1, num_kv_heads, d});
  auto out = at::empty_like(q);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b].item<int32_t>();
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    // Contiguous copies so the math below sees the same layout as a contiguous cache (bit-exact).
    // Slot j of the sequence = table[j / bs] * bs + j % bs.
    auto slots = (tables[b].narrow(0, 0, num_blocks).unsqueeze(1) * block_size +
                  at::arange(block_size, at::kLong).unsqueeze(0))
                     .flatten()
                     .narrow(0, 0, len)
                     .to(key_cache.device());
    // (An FP8 cache's rows dequantized to q's dtype: kernels/kv_cache_fp8.h.)
    auto k = kernels::GatherRows(k_flat, slots, q.scalar_type()).transpose(0, 1);  // [Hkv, len, D]
    auto v = kernels::GatherRows(v_flat, slots, q.scalar_type()).transpose(0, 1);
    out[b].copy_(ContiguousDecodeAttention(q[b], k, v, scale, softcap));
  }
  return out;
}

}  // namespace dropkv
