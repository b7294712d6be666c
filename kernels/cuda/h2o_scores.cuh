// H2O column sums from the prompt rows' log-sum-exp (kernels/scorers.h H2oScoresFromLse,
// algorithms.md section 2): s_j = sum over the packed rows r (query i, head hh of the group) that
// see key j of exp(scale q_r.k_j - lse_r), / g. Never builds the [rows, n] matrix: each CTA owns
// a tile of keys and streams every row of its KV head past it. Raw-pointer device code, no torch.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dropkv_score_warp.cuh"

namespace dropkv::kernels::cuda {

constexpr int kH2oWarps = 4;
constexpr int kH2oThreads = 32 * kH2oWarps;
constexpr int kH2oWarpKeys = 32;                        // 4 mma n-tiles of 8 keys per warp
constexpr int kH2oTileKeys = kH2oWarps * kH2oWarpKeys;  // keys per CTA
constexpr int kH2oChunkRows = 64;                       // packed rows per stage: 4 m-tiles
constexpr int kH2oStages = 3;

// Shared memory: a ring of kH2oStages row chunks (T, row stride D + kTcPad) and their lse; the
// K tile passes through the ring's first rows before the loop (its fragments then live in
// registers), so 4 CTAs fit on an SM at D = 128.
template <int D>
constexpr int H2oSmemBytes() {
  static_assert(kH2oStages * kH2oChunkRows >= kH2oTileKeys, "the K tile is staged in the ring");
  return kH2oStages * kH2oChunkRows * (D + kTcPad) * 2 + kH2oStages * kH2oChunkRows * 4;
}

template <typename T>
struct H2oKernelParams {
  const T* q;        // [B, Hq, nq, D], last dim contiguous, strides in elements below
  const T* k;        // [B, Hkv, n, D], last dim contiguous
  const float* lse;  // [B, Hq, nq] contiguous: natural log of each row's exp-sum of scaled logits
  float* out;        // [B, Hkv, n] contiguous: column sums / group
  int64_t q_stride_b, q_stride_h, q_stride_tok;
  int64_t k_stride_b, k_stride_h, k_stride_tok;
  int num_kv_heads, group, nq, n;
  float scale_log2;  // scale log2(e)
};

// 4-byte cp.async (the lse of a packed row; rows of one chunk are not contiguous when g > 1).
__device__ __forceinline__ void CpAsync4(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(valid ? 4 : 0)
               : "memory");
}

// grid (B*Hkv, ceil(n / kH2oTileKeys)), kH2oThreads threads; blockIdx.x runs fastest, so the key
// tiles near 0 (seen by the most rows) start first. Warp w owns keys key0 + 32 w .. + 31: their K
// fragments (B operands of mma.m16n8k16, D/16 x 4 n-tiles x 2 registers) stay in registers. Rows
// are packed query-major (r = i g + hh) so that the first row that sees the tile,
// (key0 - (n - nq)) g, starts the stream; chunks of 64 rows (and their lse) come through a
// cp.async ring, one barrier per chunk. Per m-tile of 16 rows: S = Q K^T (fp32 accumulators),
// p = 2^(S scale log2(e) - lse log2(e)), selected where key j <= the row's position n - nq + i,
// added in registers: lane l holds keys 8 nt + 2 (l % 4) + {0, 1} of rows l / 4 (+ 8). At the end
// the 8 lanes of a key sum by xor shuffles and lanes 0-3 write: deterministic, no atomics.
template <typename T, int D>
__global__ void __launch_bounds__(kH2oThreads, 4) H2oColumnSumKernel(const H2oKernelParams<T> p) {
  constexpr int kLd = D + kTcPad;
  constexpr int kVec = 8;  // elements per 16-byte vector
  constexpr int kChunkElems = kH2oChunkRows * kLd;
  constexpr int kNt = kH2oWarpKeys / 8;
  static_assert(sizeof(T) == 2 && D % 16 == 0, "bf16 / fp16, D a multiple of 16");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);                                     // [stages][64][kLd]
  float* lse_ring = reinterpret_cast<float*>(ring + kH2oStages * kChunkElems);  // [stages][64]

  const int bh = blockIdx.x, b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int key0 = blockIdx.y * kH2oTileKeys;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = p.group, n = p.n, nq = p.nq, num_rows = g * nq;
  const int first_pos = n - nq;  // position of query 0

  // 1. The K tile through the ring, then into registers.
  const T* k_head = p.k + b * p.k_stride_b + h * p.k_stride_h;
  for (int idx = tid; idx < kH2oTileKeys * (D / kVec); idx += kH2oThreads) {
    const int j = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
    const bool valid = key0 + j < n;
    CpAsync16(ring + j * kLd + c, k_head + (valid ? (key0 + j) * p.k_stride_tok + c : 0), valid);
  }
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_key = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  uint32_t kf[D / 16][kNt][2];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int pair = 0; pair < kNt / 2; ++pair) {
      uint32_t r[4];  // keys +0..7 cols 0-7, 8-15; keys +8..15 cols 0-7, 8-15
      LdMatrixX4(r, ring + (warp * kH2oWarpKeys + pair * 16 + b_key) * kLd + kk * 16 + b_col);
      kf[kk][2 * pair][0] = r[0];
      kf[kk][2 * pair][1] = r[1];
      kf[kk][2 * pair + 1][0] = r[2];
      kf[kk][2 * pair + 1][1] = r[3];
    }
  }
  __syncthreads();  // the ring is free for the rows

  // 2. Stream the rows that see the tile.
  const int first_row = max(0, key0 - first_pos) * g;
  const int chunk_begin = first_row / kH2oChunkRows;
  const int num_chunks = (num_rows + kH2oChunkRows - 1) / kH2oChunkRows;
  const T* q_group = p.q + b * p.q_stride_b + static_cast<int64_t>(h) * g * p.q_stride_h;
  const float* lse_group = p.lse + (static_cast<int64_t>(b) * p.num_kv_heads + h) * g * nq;
  auto issue = [&](int chunk, int stage) {  // one commit group per call (by the caller)
    T* dst = ring + stage * kChunkElems;
    const int r0 = chunk * kH2oChunkRows;
    for (int idx = tid; idx < kH2oChunkRows * (D / kVec); idx += kH2oThreads) {
      const int row = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
      const int r = r0 + row;
      const bool valid = r < num_rows;
      const int i = valid ? r / g : 0, hh = valid ? r % g : 0;
      CpAsync16(dst + row * kLd + c, q_group + hh * p.q_stride_h + i * p.q_stride_tok + c, valid);
    }
    if (tid < kH2oChunkRows) {
      const int r = r0 + tid;
      const bool valid = r < num_rows;
      const int i = valid ? r / g : 0, hh = valid ? r % g : 0;
      CpAsync4(lse_ring + stage * kH2oChunkRows + tid, lse_group + hh * nq + i, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kH2oStages - 1; ++s) {
    if (chunk_begin + s < num_chunks) issue(chunk_begin + s, s);
    CpAsyncCommit();  // empty groups too: the wait below counts uniformly
  }
  float acc[kNt][2];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) acc[nt][0] = acc[nt][1] = 0.f;
  const int warp_key0 = key0 + warp * kH2oWarpKeys;
  for (int chunk = chunk_begin, it = 0; chunk < num_chunks; ++chunk, ++it) {
    CpAsyncWait<kH2oStages - 2>();  // this thread's copies of `chunk` landed
    __syncthreads();  // ... every thread's, and every warp is done with the stage refilled below
    const int ahead = chunk + kH2oStages - 1;
    if (ahead < num_chunks) issue(ahead, (it + kH2oStages - 1) % kH2oStages);
    CpAsyncCommit();
    const int stage = it % kH2oStages;
    const T* q_s = ring + stage * kChunkElems;
    const float* lse_s = lse_ring + stage * kH2oChunkRows;
    const int r0 = chunk * kH2oChunkRows;
    if (r0 + kH2oChunkRows <= (warp_key0 - first_pos) * g) continue;  // no row sees these keys
#pragma unroll
    for (int mt = 0; mt < kH2oChunkRows / 16; ++mt) {
      float s[kNt][4];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[4];
        LdMatrixX4(qa, q_s + (mt * 16 + a_row) * kLd + kk * 16 + a_col);
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) Mma16816<T>(s[nt], qa, kf[kk][nt][0], kf[kk][nt][1]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = mt * 16 + lane / 4 + 8 * half, r = r0 + row;
        // Rows past the end see nothing (their lse is zero-filled, the select drops them).
        const int pos = r < num_rows ? first_pos + r / g : -1;
        const float lse2 = lse_s[row] * 1.4426950408889634f;
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = warp_key0 + nt * 8 + 2 * (lane % 4) + e;
            const float prob = FastExp2(fmaf(s[nt][half * 2 + e], p.scale_log2, -lse2));
            // Select, not multiply: masked entries may be inf (keys past n are zero, fine).
            acc[nt][e] += j <= pos ? prob : 0.f;
          }
        }
      }
    }
  }
  CpAsyncWait<0>();
  const float inv_g = 1.f / static_cast<float>(g);
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = acc[nt][e];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      const int j = warp_key0 + nt * 8 + 2 * lane + e;
      if (lane < 4 && j < n) p.out[static_cast<int64_t>(bh) * n + j] = v * inv_g;
    }
  }
}

}  // namespace dropkv::kernels::cuda
