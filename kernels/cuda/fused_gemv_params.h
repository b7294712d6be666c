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

// The decode qkv projection's epilogue (kernels::GemvRopeWriteKv): RoPE on q and k, q to y as
// [M, Hq, D], k and v to their cache slots. Its 16-row groups are 8 RoPE pairs (GroupRow).
struct RopeEpilogue {
  const int64_t* positions = nullptr;  // [M]
  const float* inv_freq = nullptr;     // [D / 2]
  const int64_t* slots = nullptr;      // [M]: block * block_size + offset; negative: not stored
  void* key_cache = nullptr;           // [slots, Hkv, D]
  void* value_cache = nullptr;         // [slots, Hkv, D]
  int num_heads = 0, num_kv_heads = 0;
  int head_dim = 0;  // 0: no epilogue; else a multiple of 16
};

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
  int stages = 0;         // the streaming kernel's weight stages in shared memory (StreamStages)
  int stage_k = 512;      // and the k of each (16 rows x stage_k)
  int ctas_per_sm = 2;    // the streaming kernel's grid: CTAs per SM (host side only)
  RopeEpilogue rope;      // the streaming kernel with the plain prologue only
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

// --- the streaming kernel (kernels/cuda/fused_gemv_stream.cuh): W through shared memory.
// A stage is 16 rows x stage_k elements of W (stage_k 512 or 1024: 1 or 2 KB per row in bf16);
// each row segment is padded by 64 bytes so that the 8 lanes of a quarter warp (rows g, g + 1; 4
// lanes each) read 16-byte pieces from all 32 banks once.
constexpr int kMaxStages = 12;
__host__ __device__ constexpr int StageRowBytes(int stage_k) {
  return stage_k * 2 + 64;
}
__host__ __device__ constexpr int StageBytes(int stage_k) {
  return kRowsPerCta * StageRowBytes(stage_k);
}

// Dynamic shared memory of the streaming kernel: the weight ring, the partials, then x.
inline size_t StreamSmemBytes(int m, int k, int stages, size_t elem_bytes, int stage_k) {
  return static_cast<size_t>(stages) * StageBytes(stage_k) + PartialsBytes(m <= 8 ? 1 : 2) +
         static_cast<size_t>(m) * XSmemStride(k) * elem_bytes;
}

// Weight stages of 16 x stage_k that fit a CTA with `budget` bytes of shared memory beside its
// partials and x (m tokens, inner dimension k), at most max_stages.
inline int StagesWithin(size_t budget, int m, int k, size_t elem_bytes, int stage_k,
                        int max_stages) {
  const size_t fixed = StreamSmemBytes(m, k, 0, elem_bytes, stage_k) + kStaticSmemBytes;
  const int n = budget > fixed ? static_cast<int>((budget - fixed) / StageBytes(stage_k)) : 0;
  return n < max_stages ? n : max_stages;
}
// The same for one of ctas_per_sm CTAs sharing an SM (`sm_smem`, `reserved` per CTA).
inline int StagesPerSharedSm(int m, int k, size_t elem_bytes, int stage_k, size_t sm_smem,
                             size_t reserved, int max_stages, int ctas_per_sm) {
  return StagesWithin(sm_smem / ctas_per_sm - reserved, m, k, elem_bytes, stage_k, max_stages);
}

// The streaming kernel's stage count for m tokens at inner dimension k: as many as fit, up to
// max_stages, with ctas_per_sm CTAs per SM when >= 3 fit so; else with one CTA per SM in the
// opt-in limit `optin`. 0 when not even 2 fit there (m x k too large).
inline int StreamStages(int m, int k, size_t elem_bytes, int stage_k, size_t sm_smem,
                        size_t reserved, size_t optin, int max_stages, int ctas_per_sm) {
  if (ctas_per_sm >= 2) {
    const int shared =
        StagesPerSharedSm(m, k, elem_bytes, stage_k, sm_smem, reserved, max_stages, ctas_per_sm);
    if (shared >= 3) return shared;
  }
  const int alone = StagesWithin(optin, m, k, elem_bytes, stage_k, max_stages);
  return alone >= 2 ? alone : 0;
}

// Whether one wave of three CTAs per SM streams `groups` 16-row groups in fewer group-times per SM
// than waves of two: with the SM's bandwidth shared by its CTAs, a wave of c per SM costs c
// group-times. Llama-3.1-8B's qkv (384 groups on 132 SMs): one wave of three (3) against two of
// two (4); gate_up (1792): 15 against 14, so two.
constexpr bool PreferThreeCtasPerSm(int groups, int num_sms) {
  const auto group_times = [&](int c) { return (groups + c * num_sms - 1) / (c * num_sms) * c; };
  return num_sms > 0 && group_times(3) < group_times(2);
}

// How a call is launched (the defaults are the tuned ones; the others are for comparison).
struct LaunchOptions {
  int unroll = 8;          // chunks in flight per lane: 4 or 8
  bool persistent = true;  // grid <= one wave of resident CTAs; false: one CTA per 16 rows
  int num_sms = 0;         // the device's multiprocessors (persistent grid)
  // Which kernel: the streaming one (default) or the register ring (for comparison).
  bool stream = true;
  // The streaming kernel: CTAs per SM in its grid (1: one wave of one CTA per SM; 0: chosen per
  // call, fused_gemv.cu), and the most weight stages per CTA.
  int ctas_per_sm = 0;
  int max_stages = kMaxStages;
  int stage_k = 512;          // 512 or 1024 (cp.async only: Options() sets 512 for bulk copies)
  bool bulk_copies = false;   // fill the stages with cp.async.bulk (true) or cp.async (false)
  bool rope_epilogue = true;  // GemvRopeWriteKv in one launch (false: Gemv, then RopeWriteKv)
};

// Launches y = prologue(x) W^T (+ bias) on `stream`. T: __nv_bfloat16 or __half; NW: the norm
// weight's type (T or float; T for the other prologues). p.m in [1, 16] and its shared memory
// within the device's opt-in limit.
template <typename T, typename NW, Prologue kP>
cudaError_t LaunchFusedGemv(const Params& p, const LaunchOptions& options, cudaStream_t stream);

// The same with the streaming kernel (p.stages set by StreamStages), launched with programmatic
// dependent launch (kernels/cuda/pdl.cuh).
template <typename T, typename NW, Prologue kP>
cudaError_t LaunchStreamGemv(const Params& p, const LaunchOptions& options, cudaStream_t stream);

}  // namespace dropkv::kernels::cuda::gemv
