// The plain-data side of kernels/cuda/fused_gemv_stream.cuh: the call's arguments, the shared
// memory layout and the launcher's declaration, for fused_gemv.cu (which must not instantiate the
// kernels: they live in fused_gemv_plain.cu and fused_gemv_fp8.cu). No torch, no device code.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dropkv::kernels::cuda::gemv {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = 16;  // mma M
constexpr int kPackElems = 8;    // elements per 16-byte load (bf16 / fp16)

// The decode qkv projection's epilogue (kernels::GemvRopeWriteKv): RoPE on q and k, q to y as
// [M, Hq, D], k and v to their cache slots. Its 16-row groups are 8 RoPE pairs (GroupRow).
struct RopeEpilogue {
  const int64_t* positions = nullptr;  // [M]
  const float* inv_freq = nullptr;     // [D / 2]
  const int64_t* slots = nullptr;      // [M]: block * block_size + offset; negative: not stored
  void* key_cache = nullptr;           // [slots, Hkv, D]
  void* value_cache = nullptr;         // [slots, Hkv, D]
  int cache_fp8 = 0;  // 1: the caches hold e4m3 (kernels/kv_cache_fp8.h), else the weight's dtype
  int num_heads = 0, num_kv_heads = 0;
  int head_dim = 0;  // 0: no epilogue; else a multiple of 16
};

// Raw arguments of one call (pointers are device pointers, 16-byte aligned rows).
struct Params {
  const void* x = nullptr;  // [M, K], row stride x_stride
  int64_t x_stride = 0;
  const void* weight = nullptr;         // [N, K] contiguous: T, or e4m3 bytes with weight_scale
  const float* weight_scale = nullptr;  // [N]: an FP8 weight's per-row scales; else nullptr
  const void* bias = nullptr;           // [N] or nullptr
  void* y = nullptr;                    // [M, N] contiguous
  int m = 0, n = 0, k = 0;
  int x_smem_stride = 0;  // elements per token row of x in shared memory (XSmemStride(k))
  int stages = 0;         // weight stages in shared memory (StreamStages), 16 rows x 1 KB each
  int ctas_per_sm = 2;    // the grid: CTAs per SM (host side only)
  RopeEpilogue rope;
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

// Static shared memory reserved beside the dynamic (the kernel has none; the stage counts were
// measured with this reserve, and a smaller one can add a stage).
constexpr size_t kStaticSmemBytes = 1024;

// --- W through shared memory: a stage is 16 rows x 1 KB of W (kStageK<W> elements: 512 in bf16,
// 1024 in e4m3; 2 KB stages measured no faster, docs/benchmarks.md); each row segment is padded
// by 64 bytes so that the 8 lanes of a quarter warp (rows g, g + 1; 4 lanes each) read 16-byte
// pieces from all 32 banks once.
constexpr int kStageRowPayload = 1024;
template <typename W>
inline constexpr int kStageK = kStageRowPayload / static_cast<int>(sizeof(W));
constexpr int kMaxStages = 12;
constexpr int kStageRowBytes = kStageRowPayload + 64;
constexpr int kStageBytes = kRowsPerCta * kStageRowBytes;

// Dynamic shared memory of the kernel: the weight ring, the partials, then x.
inline size_t StreamSmemBytes(int m, int k, int stages, size_t elem_bytes) {
  return static_cast<size_t>(stages) * kStageBytes + PartialsBytes(m <= 8 ? 1 : 2) +
         static_cast<size_t>(m) * XSmemStride(k) * elem_bytes;
}

// Weight stages that fit a CTA with `budget` bytes of shared memory beside its partials and x
// (m tokens, inner dimension k), at most kMaxStages.
inline int StagesWithin(size_t budget, int m, int k, size_t elem_bytes) {
  const size_t fixed = StreamSmemBytes(m, k, 0, elem_bytes) + kStaticSmemBytes;
  const int n = budget > fixed ? static_cast<int>((budget - fixed) / kStageBytes) : 0;
  return n < kMaxStages ? n : kMaxStages;
}
// The same for one of ctas_per_sm CTAs sharing an SM (`sm_smem`, `reserved` per CTA).
inline int StagesPerSharedSm(int m, int k, size_t elem_bytes, size_t sm_smem, size_t reserved,
                             int ctas_per_sm) {
  return StagesWithin(sm_smem / ctas_per_sm - reserved, m, k, elem_bytes);
}

// The stage count for m tokens at inner dimension k: as many as fit, up to kMaxStages, with
// ctas_per_sm CTAs per SM when >= 3 fit so; else with one CTA per SM in the opt-in limit
// `optin`. 0 when not even 2 fit there (m x k too large).
inline int StreamStages(int m, int k, size_t elem_bytes, size_t sm_smem, size_t reserved,
                        size_t optin, int ctas_per_sm) {
  if (ctas_per_sm >= 2) {
    const int shared = StagesPerSharedSm(m, k, elem_bytes, sm_smem, reserved, ctas_per_sm);
    if (shared >= 3) return shared;
  }
  const int alone = StagesWithin(optin, m, k, elem_bytes);
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

// Launches y = x W^T (+ bias) on `stream` as one wave of p.ctas_per_sm CTAs per SM (num_sms: the
// device's), with programmatic dependent launch (kernels/cuda/pdl.cuh). T: __nv_bfloat16 or
// __half; W: T, or __nv_fp8_e4m3 with p.weight_scale. p.m in [1, 16], p.stages set by
// StreamStages.
template <typename T, typename W>
cudaError_t LaunchStreamGemv(const Params& p, int num_sms, cudaStream_t stream);

}  // namespace dropkv::kernels::cuda::gemv
