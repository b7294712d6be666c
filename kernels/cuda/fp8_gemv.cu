// kernels/fused_gemv.h: Fp8Gemv, decode's GEMV over FP8 (e4m3) weights with per-row scales.
// One warp per weight row: each lane streams 16 weight bytes at a time (the row read once, in
// 16-byte loads), converts them to float and accumulates against every x row; x comes through
// the read-only cache (it is small and every warp of the grid reads it). A warp shuffle reduces
// the 32 partial sums in a fixed order, lane 0 scales, adds the bias and rounds once. Launched
// with programmatic dependent launch (pdl.cuh), as the bf16 decode kernels are.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/fused_gemv.h"

namespace dropkv::kernels {
namespace cuda::fp8 {

constexpr int kWarpsPerBlock = 8;
constexpr int kBytesPerLoad = 16;  // e4m3 weights a lane loads at once

// 8 x values starting at p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void Load8(const T* p, float (&out)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = ToFloat(v[i]);
}

// Two e4m3 bytes (low byte first) as floats.
__device__ __forceinline__ float2 Fp8x2ToFloat2(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

template <typename T, int kMaxRows>
__global__ void Fp8GemvKernel(const T* __restrict__ x, int64_t x_stride, int m,
                              const uint8_t* __restrict__ w, const float* __restrict__ scale,
                              const T* __restrict__ bias, T* __restrict__ y, int64_t n, int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= n) return;
  float acc[kMaxRows];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) acc[r] = 0.f;
  const uint8_t* w_row = w + row * k;
  // Launched with PDL: the first weight load (no kernel writes weights) is issued while the
  // kernel before still runs; x (its output) is read, and y written, only after the wait.
  const int64_t c_first = static_cast<int64_t>(lane) * kBytesPerLoad;
  const uint4 first =
      c_first < k ? __ldg(reinterpret_cast<const uint4*>(w_row + c_first)) : make_uint4(0, 0, 0, 0);
  PdlWaitForPrimary();
  for (int64_t c = c_first; c < k; c += 32 * kBytesPerLoad) {
    const uint4 raw = c == c_first ? first : __ldg(reinterpret_cast<const uint4*>(w_row + c));
    const uint16_t* pairs = reinterpret_cast<const uint16_t*>(&raw);
    float wf[kBytesPerLoad];
#pragma unroll
    for (int i = 0; i < kBytesPerLoad / 2; ++i) {
      const float2 f = Fp8x2ToFloat2(pairs[i]);
      wf[2 * i] = f.x;
      wf[2 * i + 1] = f.y;
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= m) break;
      float xa[8], xb[8];
      Load8(x + r * x_stride + c, xa);
      Load8(x + r * x_stride + c + 8, xb);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(wf[i], xa[i], s);
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(wf[8 + i], xb[i], s);
      acc[r] += s;
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= m) break;
    float v = acc[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) {
      v *= scale[row];
      if (bias != nullptr) v += ToFloat(bias[row]);
      y[r * n + row] = FromFloat<T>(v);
    }
  }
}

template <typename T, int kMaxRows>
void Launch(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& scale,
            const at::Tensor& bias, at::Tensor& y) {
  const int64_t n = w8.size(0), k = w8.size(1);
  const dim3 grid(static_cast<unsigned>((n + kWarpsPerBlock - 1) / kWarpsPerBlock));
  C10_CUDA_CHECK(LaunchMaybePdl(
      Fp8GemvKernel<T, kMaxRows>, grid, dim3(kWarpsPerBlock * 32), 0,
      at::cuda::getCurrentCUDAStream(), reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
      static_cast<int>(x.size(0)), reinterpret_cast<const uint8_t*>(w8.data_ptr()),
      static_cast<const float*>(scale.data_ptr<float>()),
      bias.defined() ? reinterpret_cast<const T*>(bias.data_ptr()) : static_cast<const T*>(nullptr),
      reinterpret_cast<T*>(y.data_ptr()), n, k));
}

template <typename T>
void LaunchRows(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& scale,
                const at::Tensor& bias, at::Tensor& y) {
  // Accumulators for the largest batch of the bucket: 1 (bs1 decode), 4, 16.
  if (x.size(0) == 1) {
    Launch<T, 1>(x, w8, scale, bias, y);
  } else if (x.size(0) <= 4) {
    Launch<T, 4>(x, w8, scale, bias, y);
  } else {
    Launch<T, 16>(x, w8, scale, bias, y);
  }
}

}  // namespace cuda::fp8

absl::StatusOr<at::Tensor> Fp8Gemv(const at::Tensor& x, const at::Tensor& w8,
                                   const at::Tensor& scale, const at::Tensor& bias) {
  const auto dt = x.scalar_type();
  if (!x.is_cuda() || !w8.is_cuda() || !scale.is_cuda() || x.dim() != 2 || w8.dim() != 2 ||
      (dt != at::kBFloat16 && dt != at::kHalf) || w8.scalar_type() != at::kFloat8_e4m3fn ||
      !w8.is_contiguous() || scale.scalar_type() != at::kFloat || !scale.is_contiguous() ||
      scale.numel() != w8.size(0)) {
    return absl::InvalidArgumentError(
        "Fp8Gemv: x [M, K] bf16/fp16 and w8 [N, K] e4m3 contiguous with fp32 scales [N], on CUDA");
  }
  const int64_t m = x.size(0), k = w8.size(1);
  if (m < 1 || m > kFp8GemvMaxRows || x.size(1) != k || k % 16 != 0 || x.stride(1) != 1 ||
      (x.stride(0) * x.element_size()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Fp8Gemv: x [", m, ", ", x.size(1), "] for K = ", k,
                     ": 1..16 rows, K a multiple of 16, rows contiguous and 16-byte aligned"));
  }
  if (bias.defined() &&
      (bias.scalar_type() != dt || bias.numel() != w8.size(0) || !bias.is_contiguous())) {
    return absl::InvalidArgumentError("Fp8Gemv: bias [N] in x's dtype");
  }
  return internal::CatchTorch("Fp8Gemv(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(w8.device());
    auto y = at::empty({m, w8.size(0)}, x.options().memory_format(at::MemoryFormat::Contiguous));
    if (y.numel() == 0) return y;
    if (dt == at::kBFloat16) {
      cuda::fp8::LaunchRows<__nv_bfloat16>(x, w8, scale, bias, y);
    } else {
      cuda::fp8::LaunchRows<__half>(x, w8, scale, bias, y);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
  });
}

}  // namespace dropkv::kernels
