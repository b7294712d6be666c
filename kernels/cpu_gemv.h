// y = x W^T (+ bias) on the CPU for the few rows of a decode step (fp32). A decode projection is
// bound by reading W once; ATen's GEMM (MKL) copies W into its packed layout on every call from 2
// rows on, and reads and writes it once more: at 8 rows it ran at half this kernel's speed, the
// tied 262K x 640 head of Gemma 3 at 305 ms against 128. At 1 row both read W once (MKL's gemv).
// Each output is one dot product over K in a fixed order, computed by one thread: the same bits
// whatever the thread count. AVX2 + FMA where the CPU has them, portable loops otherwise.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::kernels {

// The most rows one call takes: beyond it a GEMM's blocking wins (the weight is read once either
// way, and its arithmetic outgrows this kernel's).
inline constexpr int64_t kCpuGemvMaxRows = 8;

// True when CpuGemv takes these: CPU fp32 tensors, x [M, K] with 1 <= M <= kCpuGemvMaxRows, a
// plain (not oneDNN-packed) dense weight [N, K].
bool CpuGemvApplies(const at::Tensor& x, const at::Tensor& weight);

// y = x W^T (+ bias).
//   x:      fp32 [M, K], M <= kCpuGemvMaxRows, rows may be strided (inner dim contiguous)
//   weight: fp32 [N, K] contiguous; bias: fp32 [N] or undefined
//   returns fp32 [M, N] contiguous
// simd = false runs the portable loops that CPUs without AVX2 + FMA get (the tests check both).
absl::StatusOr<at::Tensor> CpuGemv(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias, bool simd = true);

}  // namespace dropkv::kernels
