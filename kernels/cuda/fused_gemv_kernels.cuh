// Device code of kernels/fused_gemv.h shared by the streaming kernel (fused_gemv_stream.cuh): the
// mma, the prologues (what x is made of), the warp-order reduction and the RoPE epilogue. Raw
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

#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/fused_gemv_params.h"
#include "kernels/cuda/rope.cuh"

namespace dropkv::kernels::cuda::gemv {

template <typename T>
struct alignas(16) Pack8 {
  T v[kPackElems];
};

template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  return ToFloat(FromFloat<T>(x));
}

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

// 8 elements of a 16-byte aligned bf16 / fp16 (one load) or fp32 (two loads) array, as floats.
template <typename E>
__device__ __forceinline__ void LoadPack(const E* src, float (&dst)[kPackElems]) {
  if constexpr (std::is_same_v<E, float>) {
    const float4 a = reinterpret_cast<const float4*>(src)[0];
    const float4 b = reinterpret_cast<const float4*>(src)[1];
    dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w;
    dst[4] = b.x, dst[5] = b.y, dst[6] = b.z, dst[7] = b.w;
  } else {
    const Pack8<E> v = *reinterpret_cast<const Pack8<E>*>(src);
#pragma unroll
    for (int e = 0; e < kPackElems; ++e) dst[e] = ToFloat(v.v[e]);
  }
}

// --- prologues: build x [M, K] (the dtype) in shared memory; every thread of the CTA takes part.

// Packs a thread loads before it stores any (the stores to shared memory would otherwise keep the
// compiler from hoisting the next iteration's global load: one L2 round trip per pack).
constexpr int kPrologueBatch = 4;

// x as it is.
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

// kernels::AddRmsNorm's arithmetic: s = round(residual + delta); rstd = rsqrt(mean(s^2) + eps)
// over the fp32 values of the rounded s; x = round(s * rstd * w). Pass 2 re-reads only the
// packs this thread wrote in pass 1, so one barrier (the reduction's) suffices.
template <typename T, typename NW, int kMaxRows, int kBatch>
__device__ void AddRmsNormPrologue(const Params& p, T* xs) {
  __shared__ float warp_sums[kWarps][kMaxRows];
  const int packs = p.k / kPackElems;
  const T* residual = static_cast<const T*>(p.x);
  const T* delta = static_cast<const T*>(p.delta);
  // One CTA writes the updated residual; the others only read the old one.
  T* residual_out = blockIdx.x == 0 ? static_cast<T*>(p.residual_out) : nullptr;
  // This thread's first two packs of the norm weight (all of them for K <= 4096), requested
  // early so that their latency hides behind the residual's.
  const NW* weight = static_cast<const NW*>(p.norm_weight);
  float w_first[2][kPackElems];
  auto load_w_first = [&] {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = threadIdx.x + i * kThreads;
      if (j < packs) LoadPack(weight + j * kPackElems, w_first[i]);
    }
  };
  if constexpr (kBatch > 1) load_w_first();
  // Token by token, kBatch packs per thread per round; each thread sums its packs in
  // ascending j (the order does not depend on the batching).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int t = 0; t < p.m; ++t) {
    float sum_sq = 0.f;
    for (int base = threadIdx.x; base < packs; base += kThreads * kBatch) {
      Pack8<T> s[kBatch], d[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = base + b * kThreads;
        if (j >= packs) continue;
        s[b] = *reinterpret_cast<const Pack8<T>*>(residual + t * p.x_stride + j * kPackElems);
        if (delta != nullptr)
          d[b] = *reinterpret_cast<const Pack8<T>*>(delta + t * p.delta_stride + j * kPackElems);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = base + b * kThreads;
        if (j >= packs) continue;
        if (delta != nullptr) {
#pragma unroll
          for (int e = 0; e < kPackElems; ++e)
            s[b].v[e] = FromFloat<T>(ToFloat(s[b].v[e]) + ToFloat(d[b].v[e]));
          if (residual_out != nullptr)
            *reinterpret_cast<Pack8<T>*>(residual_out + static_cast<int64_t>(t) * p.k +
                                         j * kPackElems) = s[b];
        }
#pragma unroll
        for (int e = 0; e < kPackElems; ++e) {
          const float f = ToFloat(s[b].v[e]);
          sum_sq += f * f;
        }
        *reinterpret_cast<Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems) = s[b];
      }
    }
    for (int offset = 16; offset > 0; offset /= 2)
      sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    if (lane == 0) warp_sums[warp][t] = sum_sq;
  }
  if constexpr (kBatch == 1) load_w_first();
  __syncthreads();
  float rstd[kMaxRows];
#pragma unroll
  for (int t = 0; t < kMaxRows; ++t) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += t < p.m ? warp_sums[w][t] : 0.f;
    rstd[t] = rsqrtf(total / static_cast<float>(p.k) + p.eps);
  }
  for (int j = threadIdx.x, i = 0; j < packs; j += kThreads, ++i) {
    float w[kPackElems];
    if (i < 2) {
#pragma unroll
      for (int e = 0; e < kPackElems; ++e) w[e] = i == 0 ? w_first[0][e] : w_first[1][e];
    } else {
      LoadPack(weight + j * kPackElems, w);
    }
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) {
      if (t >= p.m) break;
      auto* dst = reinterpret_cast<Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems);
      Pack8<T> s = *dst;
#pragma unroll
      for (int e = 0; e < kPackElems; ++e) s.v[e] = FromFloat<T>(ToFloat(s.v[e]) * rstd[t] * w[e]);
      *dst = s;
    }
  }
}

// kernels::GatedActivation's arithmetic: x = round(round(act(gate)) * up).
template <typename T, Prologue kP, int kBatch>
__device__ void GatedPrologue(const Params& p, T* xs) {
  const int packs = p.k / kPackElems;
  const int total = p.m * packs;
  const T* gate_up = static_cast<const T*>(p.x);
  for (int base = threadIdx.x; base < total; base += kThreads * kBatch) {
    Pack8<T> g[kBatch], u[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * kThreads, t = i / packs, j = i % packs;
      if (i >= total) continue;
      const T* row = gate_up + t * p.x_stride;
      g[b] = *reinterpret_cast<const Pack8<T>*>(row + j * kPackElems);
      u[b] = *reinterpret_cast<const Pack8<T>*>(row + p.k + j * kPackElems);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = base + b * kThreads, t = i / packs, j = i % packs;
      if (i >= total) continue;
      Pack8<T> x;
#pragma unroll
      for (int e = 0; e < kPackElems; ++e) {
        const float gf = ToFloat(g[b].v[e]);
        const float a = RoundTo<T>(kP == Prologue::kSiluMul ? Silu(gf) : GeluTanh(gf));
        x.v[e] = FromFloat<T>(a * ToFloat(u[b].v[e]));
      }
      *reinterpret_cast<Pack8<T>*>(xs + t * p.x_smem_stride + j * kPackElems) = x;
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

// y[token, row0 + r] = the warps' partials summed in warp order (deterministic) + bias, rounded
// once; every thread of the CTA takes part, after the barrier that made the partials visible.
template <typename T, int kTiles>
__device__ __forceinline__ void ReduceAndStoreRows(const Params& p, const float* buffer, int row0) {
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  for (int e = threadIdx.x; e < p.m * kRowsPerCta; e += kThreads) {
    const int token = e / kRowsPerCta, r = e % kRowsPerCta;
    const int row = row0 + r;
    if (row >= p.n) continue;
    float sum = SumWarpPartials<kTiles>(buffer, token, r);
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
                                                   int group) {
  const RopeEpilogue& e = p.rope;
  const T* bias = static_cast<const T*>(p.bias);
  const int half = e.head_dim / 2;
  for (int i = threadIdx.x; i < p.m * 8; i += kThreads) {
    const int token = i / 8, r = i % 8;
    float a = SumWarpPartials<kTiles>(buffer, token, r);
    float b = SumWarpPartials<kTiles>(buffer, token, r + 8);
    const int row = GroupRow<true>(p, group, r);
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
      dst = static_cast<T*>(is_k ? e.key_cache : e.value_cache) +
            (slot * e.num_kv_heads + kv_head) * e.head_dim;
    }
    dst[j] = x1;
    dst[j + half] = x2;
  }
}

}  // namespace dropkv::kernels::cuda::gemv
