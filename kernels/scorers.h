// The other token scorers (algorithms.md section 2, kvpress definitions), same layout as
// DropKvScores: inputs [B, H, n, D], scores fp32 [B, Hkv, n], higher = keep. Each is a building
// block for a press in engine/compression; selection (pooling, protection, top-k) is in
// selection.h. CPU reference in ATen; CUDA inputs run the same ATen ops on the device except
// where noted.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::kernels {

// H2O / ObservedAttention: s_j = sum over the prompt queries i that see j (causal, i >= j) of
// alpha_ij, averaged over the g query heads of the KV head.
struct H2oParams {
  double scale = 0.0;  // 0 = 1/sqrt(D)
  // 0: no value norm; 1 or 2: multiply by ||v_j||_1 or ||v_j||_2 (DepthKV's "with V").
  int32_t value_norm_p = 0;
  // kvpress ObservedAttention divides s_j by the number of queries that can see j.
  bool divide_by_num_queries = false;
};
//   q: [B, Hq, nq, D], the last nq <= n queries (query i sits at position n - nq + i)
//   k, v: [B, Hkv, n, D] -> fp32 [B, Hkv, n]
// Memory: the rows are processed in chunks whose [g * rows, n] fp32 attention block stays within
// kH2oBlockBytes (or `block_bytes` of the internal overload; at least one row per chunk). CPU or
// CUDA inputs: ATen ops on their device.
absl::StatusOr<at::Tensor> H2oScores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const H2oParams& params = {});

// The same column sums from the rows' log-sum-exp, which the prefill attention already computed
// (ATen's flash / cuDNN attention return it; engine/model/attention.h PrefillAttentionWithLse):
// alpha_ij = exp(scale q_i.k_j - lse_i), so no softmax over the row is needed and the CUDA path
// never builds the [rows, n] matrix (algorithms.md section 2: "reuse pass 1's lse and sum down the
// rows per key tile").
//   q: [B, Hq, nq, D]; k, v: [B, Hkv, n, D]; lse: fp32 [B, Hq, nq], the natural log of
//   sum_j exp(scale q_i.k_j) over the keys row i sees -> fp32 [B, Hkv, n] (fp64 for fp64 q).
// CUDA bf16 / fp16 with D 64 or 128: a fused kernel (kernels/cuda/h2o_scores.cu), O(n) memory;
// other inputs: ATen in row chunks as H2oScores.
absl::StatusOr<at::Tensor> H2oScoresFromLse(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& lse,
                                            const H2oParams& params = {});

// The bound on the ATen paths' [g * rows, n] fp32 block.
inline constexpr int64_t kH2oBlockBytes = int64_t{256} << 20;

namespace internal {
// Test-only: the ATen paths with a chosen block budget (bytes); lse undefined = H2oScores.
absl::StatusOr<at::Tensor> H2oScoresAten(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& lse,
                                         const H2oParams& params, int64_t block_bytes);
}  // namespace internal

// SnapKV (kvpress SnapKVPress.score): mean over the last `window` queries of their attention
// (fp32 softmax, cast back to the query dtype) over keys [0, n - window), avg-pooled (kernel
// `pool_kernel`, stride 1, padding kernel/2, count_include_pad like torch), averaged over the
// group; the last `window` keys get max(score) + 1 (max over the whole tensor, like kvpress).
struct SnapKvParams {
  int32_t pool_kernel = 5;  // odd
  double scale = 0.0;       // 0 = 1/sqrt(D)
};
//   q_window: [B, Hq, window, D], window < n; k: [B, Hkv, n, D] -> fp32 [B, Hkv, n]
absl::StatusOr<at::Tensor> SnapKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const SnapKvParams& params = {});

// K-norm: -||k_j||_2.  k: [B, Hkv, n, D] -> fp32 [B, Hkv, n]
absl::StatusOr<at::Tensor> KNormScores(const at::Tensor& k);

// StreamingLLM: the first num_sinks tokens score 2n (always kept), the others their position j,
// so a top-k keeps the sinks and the most recent k - num_sinks tokens.
//   returns fp32 [B, Hkv, n] on `like`'s device (like: any [B, Hkv, n, ...] tensor).
absl::StatusOr<at::Tensor> StreamingLlmScores(const at::Tensor& like, int64_t num_sinks = 4);

// Random scores in [0, 1), reproducible from `seed` (drawn on the CPU, then moved).
absl::StatusOr<at::Tensor> RandomScores(const at::Tensor& like, uint64_t seed);

}  // namespace dropkv::kernels
