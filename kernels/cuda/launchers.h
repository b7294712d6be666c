// ATen-typed entry points of the CUDA kernels (the launcher layer). Only the public headers'
// implementations call these, after device dispatch; declared whether or not CUDA is built so
// that callers compile either way (without CUDA, kernels/cpu/no_cuda.cpp returns an error).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "kernels/dropkv_score.h"
#include "kernels/paged_attention.h"

namespace dropkv::kernels::cuda {

// True when this build has the CUDA kernels.
bool Built();

// Dense (cu_seqlens empty): k, v [B, Hkv, n, D] -> [B, Hkv, n]. Varlen: k, v [total_n, Hkv, D],
// cu_seqlens int64 [B + 1] on the CPU -> [Hkv, total_n].
absl::StatusOr<at::Tensor> DropKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const at::Tensor& v,
                                        const std::optional<at::Tensor>& cu_seqlens,
                                        const DropKvParams& params);

// Pass 3 alone with the window rows' attention from the caller (dense only): attn_out
// [B, Hq, W, D], lse fp32 [B, Hq, W], both on k's device (shapes checked by the caller).
absl::StatusOr<at::Tensor> DropKvScoresFromAttention(const at::Tensor& q_window,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& attn_out,
                                                     const at::Tensor& lse,
                                                     const DropKvParams& params);

// H2O column sums from the rows' lse (scorers.h H2oScoresFromLse, shapes checked by the caller):
// q [B, Hq, nq, D], k [B, Hkv, n, D] (bf16 / fp16, D 64 or 128: see H2oKernelApplies), lse fp32
// [B, Hq, nq] -> fp32 [B, Hkv, n], the raw sums / g.
bool H2oKernelApplies(const at::Tensor& q, const at::Tensor& k);
absl::StatusOr<at::Tensor> H2oColumnSums(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& lse, double scale);

absl::Status WriteKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& slot_mapping);
absl::Status WriteKeptKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& kept_idx,
                         const at::Tensor& slot_mapping);

absl::StatusOr<at::Tensor> PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens,
                                                const PagedAttentionParams& params);

}  // namespace dropkv::kernels::cuda
