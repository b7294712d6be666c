// The decode step's GEMVs on CUDA: y = x W^T (+ bias) for a few rows x (the decode
// batch's tokens), W streamed once through shared memory. The product accumulates in fp32
// (tensor cores) and is rounded once after the bias, like cuBLAS. The K reduction order is fixed
// (no atomics): the same inputs give the same bits on every call. (Variants with the norm or the
// gated activation before the GEMV fused into it lost their A/B against the plain GEMV after
// the fused ops and were deleted; their figures are in docs/benchmarks.md.)
// W: [N, K] row-major, bf16 or fp16 (every tensor of a call shares the dtype), or FP8 (e4m3,
// engine/model/fp8.h) with one fp32 scale a row: y = x (w8 * scale)^T (+ bias), w8 read as bytes
// (half the traffic), each e4m3 value converted exactly for the tensor cores, the row's fp32 sum
// scaled once before the bias. CUDA tensors only; a build without CUDA returns FailedPrecondition.
// No host syncs, no allocations beyond the outputs: safe in a CUDA graph.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "kernels/fused_ops.h"

namespace dropkv::kernels {

// True when this build has the CUDA GEMV kernels.
bool FusedGemvBuilt();

// The most rows x (tokens) one call takes for inner dimension k with x in `dtype` (bf16 / fp16,
// whatever the weight's dtype) on the current CUDA device: x stays in shared memory, [rows, k],
// beside the weight stages, so the limit falls with k (H200, bf16: 16 at k <= 5.1K, 6 at 14336, 3
// at 24576). 0 when the dtype or k is unsupported (k % 8 != 0) or there is no CUDA device. Larger
// batches: the unfused ops + cuBLAS.
int64_t FusedGemvMaxRows(int64_t k, at::ScalarType dtype);

// y = x W^T (+ bias).
//   x:      [M, K], rows may be strided (inner dim contiguous, 16-byte aligned rows)
//   weight: [N, K] contiguous; bias: [N] in x's dtype or undefined
//   weight_scale: fp32 [N] or [N, 1] for an e4m3 weight (then K % 16 == 0), else undefined
//   returns [M, N] contiguous in x's dtype
absl::StatusOr<at::Tensor> Gemv(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& weight_scale = {});

// Decode's qkv projection with kernels::RopeWriteKv as its epilogue: y = x W^T (+ bias) as Gemv
// computes it, then RoPE on q and k and the K/V store into the paged cache, rounded as
// RopeWriteKv rounds them: the same bits as Gemv followed by RopeWriteKv, in one launch. (With D
// not a multiple of 16 or D > 128, it is those two launches.)
//   x: as Gemv's; weight: [(Hq + 2 Hkv) * D, K], the rows of the q, k, v heads; bias and
//   weight_scale as Gemv's
//   geo, positions, inv_freq, key_cache, value_cache, slots: as RopeWriteKv's
//   returns q after RoPE, [M, Hq, D] contiguous
absl::StatusOr<at::Tensor> GemvRopeWriteKv(const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& bias, const QkvGeometry& geo,
                                           const at::Tensor& positions, const at::Tensor& inv_freq,
                                           at::Tensor& key_cache, at::Tensor& value_cache,
                                           const at::Tensor& slots,
                                           const at::Tensor& weight_scale = {});

}  // namespace dropkv::kernels
