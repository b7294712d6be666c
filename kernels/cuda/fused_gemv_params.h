// The plain-data side of kernels/cuda/fused_gemv_kernels.cuh: the call's arguments, the shared
// memory layout and the launcher's declaration, for fused_gemv.cu (which must not instantiate the
// kernels: they live in fused_gemv_{plain,norm,gated}.cu). No torch, no device code.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dropkv::kernels::cuda::gemv {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = 16;  // mma M
constexpr int kChunk = 32;       // k per lane group step: 4 lanes x 8 elements
constexpr int kPackElems = 8;    // elements per 16-byte load (bf16 / fp16)

enum class Prologue { kPlain, kAddRmsNorm, kSiluMul, kGeluTanhMul };

// Raw arguments of one call (pointers are device pointers, 16-byte aligned rows).
struct Params {
  // Plain: x [M, K], row stride x_stride. AddRmsNorm: the residual [M, K] (stride x_stride).
  // Gated: gate_up [M, 2K] (gate | up), row stride x_stride.
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* delta = nullptr;  // AddRmsNorm: [M, K], row stride delta_stride; nullptr: none
  int64_t delta_stride = 0;
  const void* norm_weight = nullptr;  // AddRmsNorm: [K], T or fp32
  void* residual_out = nullptr;       // AddRmsNorm: [M, K] contiguous, residual + delta; or null
  float eps = 0.f;
  const void* weight = nullptr;  // [N, K] contiguous
  const void* bias = nullptr;    // [N] or nullptr
  void* y = nullptr;             // [M, N] contiguous
  int m = 0, n = 0, k = 0;
  int x_smem_stride = 0;  // elements per token row of x in shared memory (XSmemStride(k))
};

// Row stride of x in shared memory: K rounded up to 64 elements plus 32, so that the 8 lanes of a
// quarter warp (tokens g, g + 1; 4 lanes each) read 16-byte pieces from all 32 banks once.
__host__ __device__ constexpr int XSmemStride(int k) {
  return (k + 63) / 64 * 64 + 32;
}
// Bytes of the fp32 partials: two buffers of [warps][tokens of the tiles][16 rows].
__host__ __device__ constexpr int PartialsBytes(int num_tiles) {
  return 2 * kWarps * num_tiles * 8 * kRowsPerCta * 4;
}

// Dynamic shared memory of a call with m tokens and inner dimension k, elements of elem_bytes.
inline size_t SmemBytes(int m, int k, size_t elem_bytes) {
  return static_cast<size_t>(m) * XSmemStride(k) * elem_bytes + PartialsBytes(m <= 8 ? 1 : 2);
}
// Static shared memory of the kernel (the norm prologue's warp sums), with room to spare.
constexpr size_t kStaticSmemBytes = 1024;

// How a call is launched (the defaults are the tuned ones; the others are for comparison).
struct LaunchOptions {
  int unroll = 8;          // chunks in flight per lane: 4 or 8
  bool persistent = true;  // grid <= one wave of resident CTAs; false: one CTA per 16 rows
  int num_sms = 0;         // the device's multiprocessors (persistent grid)
};

// Launches y = prologue(x) W^T (+ bias) on `stream`. T: __nv_bfloat16 or __half; NW: the norm
// weight's type (T or float; T for the other prologues). p.m in [1, 16] and its shared memory
// within the device's opt-in limit.
template <typename T, typename NW, Prologue kP>
cudaError_t LaunchFusedGemv(const Params& p, const LaunchOptions& options, cudaStream_t stream);

}  // namespace dropkv::kernels::cuda::gemv
