// Fused elementwise ops of the transformer layer on CUDA: each replaces a chain of ATen
// kernels that a decode step would launch per layer (a CUDA graph replays them at ~2 us each):
//   AddRmsNorm:       residual add + RMSNorm                    (2 kernels -> 1; Gemma 7 -> 1)
//   RopeWriteKv:      RoPE on q and k + the K/V store into the paged cache (7 -> 1)
//   RopeSplitQkv:     the same RoPE, q/k/v to dense tensors (prefill: 8 -> 1)
//   GatedActivation:  SiLU(gate) * up, or GELU-tanh(gate) * up (2 -> 1)
//   QuantizeRowsFp8:  per-row e4m3 quantization of the FP8 GEMM's activations (7 -> 1)
// CUDA tensors only (a CPU tensor is InvalidArgument; a build without CUDA returns
// FailedPrecondition): the CPU path keeps its ATen ops, whose parity tests are exact. Every op
// rounds where the ATen chain it replaces rounds (fp32 inside, the model dtype between ops), so
// the fused and unfused paths differ by the order of a reduction at most. No host syncs, no
// allocations beyond the outputs: safe inside a CUDA graph capture.
// Dtypes: bf16, fp16, fp32 (all tensors of one call share it, except where a comment says fp32).
// Launched with programmatic dependent launch (kernels/cuda/pdl.cuh): a kernel may start while
// the kernel queued before it still runs, and reads AddRmsNorm's weight and RoPE's inv_freq
// before waiting for it. Those must be model constants, not written by a kernel of the chain.
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv::kernels {

// True when this build has the CUDA fused ops.
bool FusedOpsBuilt();

// residual <- residual + delta (rounded to the dtype, as at::add), then returns
// RMSNorm(residual) * weight computed in fp32 and rounded once (at::rms_norm's rounding; Gemma's
// HF form when the weight is its folded fp32 1 + w).
//   residual: [N, H] contiguous, updated in place (delta undefined: left as is, a plain RMSNorm)
//   delta:    [N, H], rows may be strided (inner dim contiguous), or undefined
//   weight:   [H], residual's dtype or fp32
//   returns   [N, H] contiguous, residual's dtype
absl::StatusOr<at::Tensor> AddRmsNorm(at::Tensor& residual, const at::Tensor& delta,
                                      const at::Tensor& weight, double eps);

// RoPE in the rotate-half form (HF's apply_rotary_pos_emb): for pair j < D/2 at angle
// a = position * inv_freq[j], out[j] = x[j] cos a - x[j + D/2] sin a and
// out[j + D/2] = x[j + D/2] cos a + x[j] sin a, with cos a and sin a rounded to the dtype and each
// product and the sum rounded, as the ATen chain does. Every RoPE type of config.h differs only in
// inv_freq (dynamic: the caller passes the frequencies for its length).
//   qkv:       [N, (Hq + 2 Hkv) * D]: q | k | v of the fused projection, rows may be strided
//   positions: int64 [N]
//   inv_freq:  fp32 [D / 2]
struct QkvGeometry {
  int64_t num_heads = 0;     // Hq
  int64_t num_kv_heads = 0;  // Hkv
  int64_t head_dim = 0;      // D, even
};

// Decode: q after RoPE is returned ([N, Hq, D] contiguous); k after RoPE and v go to slot
// slots[t] of the paged cache (negative slots are skipped: padding rows).
//   key_cache, value_cache: [num_blocks, block_size, Hkv, D] contiguous, qkv's dtype
//   slots:                  int64 [N], slot = block_idx * block_size + offset
absl::StatusOr<at::Tensor> RopeWriteKv(const at::Tensor& qkv, const QkvGeometry& geo,
                                       const at::Tensor& positions, const at::Tensor& inv_freq,
                                       at::Tensor& key_cache, at::Tensor& value_cache,
                                       const at::Tensor& slots);

namespace internal {
// RopeWriteKv's checks of all but qkv, for `rows` tokens of `dtype` on `device`: also those of
// kernels::GemvRopeWriteKv (fused_gemv.h), whose qkv never leaves the GEMV. CUDA builds only.
absl::Status CheckRopeWriteKvArgs(const QkvGeometry& geo, int64_t rows, at::ScalarType dtype,
                                  at::Device device, const at::Tensor& positions,
                                  const at::Tensor& inv_freq, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slots);
}  // namespace internal

// Prefill: q, k after RoPE and v as dense tensors [N, Hq, D], [N, Hkv, D], [N, Hkv, D].
absl::StatusOr<std::tuple<at::Tensor, at::Tensor, at::Tensor>> RopeSplitQkv(
    const at::Tensor& qkv, const QkvGeometry& geo, const at::Tensor& positions,
    const at::Tensor& inv_freq);

enum class GateActivation { kSilu, kGeluTanh };

// act(gate) * up, act computed in fp32 and rounded, the product rounded (at::silu / at::gelu
// "tanh", then at::mul).
//   gate_up: [N, 2 I]: gate | up of the fused projection, rows may be strided
//   returns  [N, I] contiguous
absl::StatusOr<at::Tensor> GatedActivation(const at::Tensor& gate_up, GateActivation act);

// The FP8 GEMM's dynamic per-token activation scales (engine/model/fp8.h): scale = amax(|x row|)
// * (1 / 448) in fp32 (1 for a zero row; ATen's CUDA division by a scalar), x / scale clamped to
// +-448 and rounded to e4m3 (nearest even): the bytes of the ATen chain x.to(float), abs, amax,
// where, div, clamp, to(e4m3).
//   x: [N, K], rows may be strided (inner dim contiguous); bf16, fp16 or fp32
//   returns {e4m3 [N, K] contiguous, fp32 scales [N, 1]}
absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizeRowsFp8(const at::Tensor& x);

}  // namespace dropkv::kernels
