#include "engine/model/attention.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

namespace dropkv {

namespace {

// The pre-flash path (kept for CPU, fp32 and odd head dims, and as the A/B baseline).
at::Tensor SdpaPrefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale) {
  const int64_t t_len = q.size(0);
  const int64_t n = k.size(1);
  auto qh = q.transpose(0, 1).unsqueeze(0);  // [1, Hq, T, D]
  auto kh = k.unsqueeze(0);                  // [1, Hkv, n, D]
  auto vh = v.unsqueeze(0);
  at::Tensor out;
  if (n == t_len) {
    out = at::scaled_dot_product_attention(qh, kh, vh, {}, 0.0, /*is_causal=*/true, scale,
                                           /*enable_gqa=*/true);
  } else {
    // [T, n]: every earlier entry is visible; the chunk part is lower-triangular. (SDPA's
    // is_causal is top-left aligned when T < n, so it cannot express this.)
    auto mask = at::ones({t_len, n}, at::TensorOptions().dtype(at::kBool).device(q.device()));
    mask.narrow(1, n - t_len, t_len).tril_();
    out = at::scaled_dot_product_attention(qh, kh, vh, mask, 0.0, false, scale, true);
  }
  return out.squeeze(0).transpose(0, 1).contiguous();  // [T, Hq, D]
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

// DROPKV_PREFILL_ATTENTION (read once): "sdpa", "flash", "cudnn"; unset or other = kAuto's rule.
std::optional<PrefillAttentionImpl> ImplFromEnv() {
  static const std::optional<PrefillAttentionImpl> impl =
      []() -> std::optional<PrefillAttentionImpl> {
    const char* env = std::getenv("DROPKV_PREFILL_ATTENTION");
    if (env == nullptr) return std::nullopt;
    if (std::strcmp(env, "sdpa") == 0) return PrefillAttentionImpl::kSdpa;
    if (std::strcmp(env, "flash") == 0) return PrefillAttentionImpl::kFlash;
    if (std::strcmp(env, "cudnn") == 0) return PrefillAttentionImpl::kCudnn;
    return std::nullopt;
  }();
  return impl;
}

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
                                               PrefillAttentionImpl impl) {
  if (impl == PrefillAttentionImpl::kAuto) {
    if (!FlashApplies(q, k)) {
      impl = PrefillAttentionImpl::kSdpa;
    } else if (auto forced = ImplFromEnv()) {
      impl = *forced;
    } else {
      impl = q.size(0) >= kCudnnMinTokens ? PrefillAttentionImpl::kCudnn
                                          : PrefillAttentionImpl::kFlash;
    }
  }
  if (impl == PrefillAttentionImpl::kCudnn && q.size(0) == k.size(1)) {
    return CudnnPrefill(q, k, v, scale);
  }
  if (impl != PrefillAttentionImpl::kSdpa) return FlashPrefill(q, k, v, scale);
  return {SdpaPrefill(q, k, v, scale), at::Tensor()};
}

at::Tensor PrefillAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  return PrefillAttentionWithLse(q, k, v, scale).out;
}

at::Tensor ContiguousDecodeAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale) {
  const int64_t num_heads = q.size(0);
  const int64_t num_kv_heads = k.size(0);
  const int64_t d = q.size(1);
  auto qg = q.to(at::kFloat).view({num_kv_heads, num_heads / num_kv_heads, d});  // [Hkv, G, D]
  auto scores =
      at::bmm(qg, k.to(at::kFloat).contiguous().transpose(1, 2)).mul_(scale);  // [Hkv, G, n]
  auto probs = at::softmax(scores, -1);
  auto out = at::bmm(probs, v.to(at::kFloat).contiguous());  // [Hkv, G, D]
  return out.view({num_heads, d}).to(q.scalar_type());
}

at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale) {
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
    auto k = k_flat.index_select(0, slots).transpose(0, 1);  // [Hkv, len, D]
    auto v = v_flat.index_select(0, slots).transpose(0, 1);
    out[b].copy_(ContiguousDecodeAttention(q[b], k, v, scale));
  }
  return out;
}

}  // namespace dropkv
