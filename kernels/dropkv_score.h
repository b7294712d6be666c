// DropKV token scores (algorithms.md section 1): the squared shift of each window query's
// attention output when key j alone is removed, summed over the window and the g query heads of a
// KV head, divided by g. Low score = safe to evict. One header for the CPU reference (ATen, the
// test oracle and CPU serving path) and the fused CUDA kernels (three passes, never [Hq, W, n]);
// the device of the inputs picks the implementation.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace dropkv::kernels {

struct DropKvParams {
  double eps = 1e-6;  // w = (p / (1 - p + eps))^2
  // Softmax scale; 0 means 1/sqrt(D).
  double scale = 0.0;
  // Round p to this dtype before computing w, as the reference does in bf16 runs (changes sink
  // rankings when p is close to 1). nullopt = no rounding (fp32 runs). a_t always uses unrounded p.
  std::optional<at::ScalarType> p_round_dtype;
  // CUDA only: number of key splits of pass 1; 0 = choose so that the grid fills the GPU.
  int32_t num_splits = 0;
  // CUDA, bf16 / fp16 inputs: the QK^T, PV and <a, v> products on tensor cores (wmma, fp32
  // accumulation; a_t rounded to the model dtype as in the spec). false = fp32 CUDA-core path.
  bool use_tensor_cores = true;
};

// Dense batch.
//   q_window: [B, Hq, W, D], the last W queries of each sequence after RoPE; row i sits at position
//             n - W + i and sees keys j <= n - W + i (rows at positions < 1 see at most one key,
//             whose removal is undefined: they contribute nothing).
//   k, v:     [B, Hkv, n, D], keys after RoPE. Hq % Hkv == 0, g = Hq / Hkv.
//   returns   fp32 [B, Hkv, n] (fp64 when the inputs are fp64, CPU only).
// CPU: fp32 / fp64 / bf16 / fp16 inputs, any D, accumulation in fp32 (fp64 for fp64).
// CUDA: fp32 / bf16 / fp16 inputs, D in {64, 128, 256}, W <= 64, last dim contiguous.
absl::StatusOr<at::Tensor> DropKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const at::Tensor& v, const DropKvParams& params = {});

// The score pass alone, for a caller whose prefill attention already produced the window rows'
// outputs and log-sum-exp (flash attention's softmax_lse, SDPA's logsumexp): K and V are read
// once instead of twice. Same scores as DropKvScores up to the caller's attention precision.
//   q_window, k, v: as DropKvScores (dense batch).
//   attn_out:       [B, Hq, W, D], row i = softmax(scale q_i k_j^T over j <= n - W + i) V; any
//                   float dtype (used as fp32; the CUDA tensor-core path rounds it to the model
//                   dtype, as DropKvScores does with its own a_t).
//   lse:            [B, Hq, W], natural-log log-sum-exp of the scaled logits of those rows.
//   returns         fp32 [B, Hkv, n] (fp64 for fp64 inputs, CPU only).
absl::StatusOr<at::Tensor> DropKvScoresFromAttention(const at::Tensor& q_window,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& attn_out,
                                                     const at::Tensor& lse,
                                                     const DropKvParams& params = {});

// Ragged batch with cumulative offsets (sequences packed along the token axis).
//   q_window:   [B, Hq, W, D]; sequence b's keys are rows cu_seqlens[b] .. cu_seqlens[b+1]-1 of
//   k, v:       [total_n, Hkv, D]
//   cu_seqlens: int64 [B + 1] on the CPU, cu_seqlens[0] = 0, non-decreasing.
//   returns     fp32 [Hkv, total_n]
absl::StatusOr<at::Tensor> DropKvScoresVarlen(const at::Tensor& q_window, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& cu_seqlens,
                                              const DropKvParams& params = {});

}  // namespace dropkv::kernels
