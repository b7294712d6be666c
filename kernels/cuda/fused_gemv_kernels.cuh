// Device code of kernels/fused_gemv.h used by the streaming kernel (fused_gemv_stream.cuh): the
// mma, the prologue (x into shared memory), the warp-order reduction and the RoPE epilogue. Raw
// pointers, no torch.
//
// Mapping. y [M, N] = x [M, K] W^T with W [N, K] row-major, M <= 16 tokens. A CTA of 8 warps owns
// 16 rows of W (the A operand of mma.sync m16n8k16: 16 rows x 16 k); the tokens are the
// mma's n (8 per tile, 1 or 2 tiles). The CTA sums the warps' fp32 partials in warp order at the
// end (deterministic, no atomics).
//
// Why a permuted k: mma's A fragment gives a lane 4 scattered 2-element pieces per row, but a
// dot product does not care which k pairs with which as long as W and x agree. So lane (g, q)
// (g = lane / 4, q = lane % 4) reads 8 consecutive k of rows g and g + 8 with one 16-byte load
// each (k = chunk * 32 + q * 8 .. + 7), feeds elements 0-3 to the chunk's first mma and 4-7 to
// its second, and reads the same 8 k of x (token g) as its B fragment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/fused_gemv_params.h"
#include "kernels/cuda/rope.cuh"

namespace dropkv::kernels::cuda::gemv {

template <typename T>
struct alignas(16) Pack8 {
  T v[kPackElems];
};

// c += A B: A 16x16 (row-major fragments a0..a3), B 16x8 (col-major b0, b1), fp32 c.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// --- prologue: x [M, K] (the dtype) into shared memory; every thread of the CTA takes part.

// Packs a thread loads before it stores any (the stores to shared memory would otherwise keep the
// compiler from hoisting the next iteration's global load: one L2 round trip per pack).
constexpr int kPrologueBatch = 4;

template <typename T, int kBatch>
__device__ void PlainPrologue(const Params& p, T* xs) {
  const int packs = p.k / kPackElems;
  const int total = p.m * packs;
  const T* x = static_cast<const T*>(p.x);
  for (int base = threadIdx.x; base < total; base += kThreads * kBatch) {
    Pack8<T> v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * kThreads, t = i / packs, j = i % packs;
      if (i < total) v[b] = *reinterpret_cast<const Pack8<T>*>(x + t * p.x_stride + j * kPackElems);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * kThreads, t = i / packs, j = i % packs;
      if (i < total) *reinterpret_cast<Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems) = v[b];
    }
  }
}

// The warp's C fragments into its slice of a partials buffer [warps][kTiles * 8 tokens][16 rows]:
// acc[tile][0..1] = row g, tokens 2q, 2q + 1; acc[tile][2..3] = row g + 8.
template <int kTiles>
__device__ __forceinline__ void StorePartials(float* buffer, int warp, int g, int q,
                                              const float (&acc)[kTiles][4]) {
  float* mine = buffer + warp * (kTiles * 8 * kRowsPerCta);
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    const int t0 = tile * 8 + 2 * q;
    mine[t0 * kRowsPerCta + g] = acc[tile][0];
    mine[(t0 + 1) * kRowsPerCta + g] = acc[tile][1];
    mine[t0 * kRowsPerCta + g + 8] = acc[tile][2];
    mine[(t0 + 1) * kRowsPerCta + g + 8] = acc[tile][3];
  }
}

// The warps' fp32 partials of (token, row r of the group) summed in warp order (deterministic).
template <int kTiles>
__device__ __forceinline__ float SumWarpPartials(const float* buffer, int token, int r) {
  float sum = 0.f;
  for (int w = 0; w < kWarps; ++w)
    sum += buffer[w * (kTiles * 8 * kRowsPerCta) + token * kRowsPerCta + r];
  return sum;
}

// FP8 weights: x goes through the tensor cores as fp16 (e4m3 converts to fp16 in one instruction
// a pair; to bf16 it takes four, which bounded the kernel at ~3 TB/s). So that any bf16 magnitude
// fits fp16's range, each token's row is multiplied by a power of two 2^e that puts its amax in
// [2^14, 2^15) (exact: bf16's 8-bit significands fit fp16's 11 bits; only values below 2^-29 of
// the row's amax lose bits). token_scale[t] = 2^e; the token's fp32 sums are divided by it
// (exact) in the epilogue. Runs after PlainPrologue's barrier, in place, every thread of the CTA.
template <typename T>
__device__ void ScaleXToHalf(const Params& p, T* xs, float* token_scale) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int packs = p.k / kPackElems;
  for (int t = warp; t < p.m; t += kWarps) {
    float amax = 0.f;
    for (int j = lane; j < packs; j += 32) {
      const Pack8<T> v =
          *reinterpret_cast<const Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems);
#pragma unroll
      for (int e = 0; e < kPackElems; ++e) amax = fmaxf(amax, fabsf(ToFloat(v.v[e])));
    }
    amax = WarpMax(amax);
    if (lane == 0) {
      int exponent = 0;  // amax = f 2^exponent, f in [0.5, 1)
      frexpf(amax, &exponent);
      const bool finite = amax > 0.f && amax <= 3.0e38f;
      token_scale[t] = finite ? ldexpf(1.f, max(-100, min(100, 15 - exponent))) : 1.f;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.m * packs; i += kThreads) {
    const int t = i / packs, j = i % packs;
    auto* slot = reinterpret_cast<Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems);
    const Pack8<T> v = *slot;
    Pack8<__half> h;
#pragma unroll
    for (int e = 0; e < kPackElems; ++e) h.v[e] = __float2half_rn(ToFloat(v.v[e]) * token_scale[t]);
    *reinterpret_cast<Pack8<__half>*>(slot) = h;
  }
  __syncthreads();
}

// The row's fp32 sum for a token: as it is for plain weights; for FP8 ones divided by the
// token's power of two (ScaleXToHalf) and multiplied by the row's scale, before the bias.
__device__ __forceinline__ float ScaleSum(const Params& p, const float* token_scale, float sum,
                                          int token, int row) {
  return p.weight_scale != nullptr ? sum / token_scale[token] * p.weight_scale[row] : sum;
}

// y[token, row0 + r] = the warps' partials summed in warp order (deterministic), scaled
// (FP8 weights), + bias, rounded once; every thread of the CTA takes part, after the barrier
// that made the partials visible.
template <typename T, int kTiles>
__device__ __forceinline__ void ReduceAndStoreRows(const Params& p, const float* buffer,
                                                   const float* token_scale, int row0) {
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  for (int e = threadIdx.x; e < p.m * kRowsPerCta; e += kThreads) {
    const int token = e / kRowsPerCta, r = e % kRowsPerCta;
    const int row = row0 + r;
    if (row >= p.n) continue;
    float sum = ScaleSum(p, token_scale, SumWarpPartials<kTiles>(buffer, token, r), token, row);
    if (bias != nullptr) sum += ToFloat(bias[row]);
    y[static_cast<int64_t>(token) * p.n + row] = FromFloat<T>(sum);
  }
}

// Row r (0..15) of 16-row group `group`: group * 16 + r; with the RoPE epilogue, rows j .. j + 7 of
// a head's first half and then their partners j + D/2 .., so that both rows of each RoPE pair
// are summed in one CTA.
template <bool kRope>
__device__ __forceinline__ int GroupRow(const Params& p, int group, int r) {
  if constexpr (!kRope) {
    return group * kRowsPerCta + r;
  } else {
    const int d = p.rope.head_dim, groups_per_head = d / kRowsPerCta;
    const int head = group / groups_per_head, j = group % groups_per_head * 8;
    return head * d + j + (r & 7) + (r >= 8 ? d / 2 : 0);
  }
}

// The RoPE epilogue (RopeEpilogue): the pairs (row, row + D/2) of `group`, for every token, summed
// as ReduceAndStoreRows sums a row and rounded to T (the projection's output), then rotated
// (q and k) and stored: q to y [M, Hq, D], k and v to their cache slots.
template <typename T, int kTiles>
__device__ __forceinline__ void ReduceRopeAndStore(const Params& p, const float* buffer,
                                                   const float* token_scale, int group) {
  const RopeEpilogue& e = p.rope;
  const T* bias = static_cast<const T*>(p.bias);
  const int half = e.head_dim / 2;
  for (int i = threadIdx.x; i < p.m * 8; i += kThreads) {
    const int token = i / 8, r = i % 8;
    const int row = GroupRow<true>(p, group, r);
    float a = ScaleSum(p, token_scale, SumWarpPartials<kTiles>(buffer, token, r), token, row);
    float b =
        ScaleSum(p, token_scale, SumWarpPartials<kTiles>(buffer, token, r + 8), token, row + half);
    if (bias != nullptr) {
      a += ToFloat(bias[row]);
      b += ToFloat(bias[row + half]);
    }
    T x1 = FromFloat<T>(a), x2 = FromFloat<T>(b);
    const int head = row / e.head_dim, j = row % e.head_dim;
    if (head < e.num_heads + e.num_kv_heads) {
      RotateHalfPair(x1, x2, static_cast<float>(e.positions[token]), e.inv_freq[j]);
    }
    T* dst;
    if (head < e.num_heads) {
      dst = static_cast<T*>(p.y) + (static_cast<int64_t>(token) * e.num_heads + head) * e.head_dim;
    } else {
      const int64_t slot = e.slots[token];
      if (slot < 0) continue;
      const bool is_k = head < e.num_heads + e.num_kv_heads;
      const int kv_head = head - e.num_heads - (is_k ? 0 : e.num_kv_heads);
      const int64_t offset = (slot * e.num_kv_heads + kv_head) * e.head_dim;
      void* cache = is_k ? e.key_cache : e.value_cache;
      if (e.cache_fp8) {  // the T values converted, as RopeWriteKv stores them
        __nv_fp8_e4m3* dst8 = static_cast<__nv_fp8_e4m3*>(cache) + offset;
        dst8[j] = FromFloat<__nv_fp8_e4m3>(ToFloat(x1));
        dst8[j + half] = FromFloat<__nv_fp8_e4m3>(ToFloat(x2));
        continue;
      }
      dst = static_cast<T*>(cache) + offset;
    }
    dst[j] = x1;
    dst[j + half] = x2;
  }
}

}  // namespace dropkv::kernels::cuda::gemv
