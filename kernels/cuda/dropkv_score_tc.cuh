// Tensor-core variants of passes 1 and 3 of the fused DropKV scoring for bf16 / fp16 inputs
// (wmma m16n16k16, fp32 accumulation). Raw-pointer device code, no torch. Same partial format as
// PartialAttnKernel (attention_common.cuh), so MergeKernel is shared.
// Row chunk = 16 packed window rows (the wmma M); key tile = 64 keys, 16 per warp.
#pragma once

#include <mma.h>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dropkv_score_kernels.cuh"

namespace dropkv::kernels::cuda {

constexpr int kTcRows = 16;  // rows per chunk (wmma M)
constexpr int kTcKeys = 64;  // keys per tile, kTcKeys / kWarps = 16 per warp
constexpr int kTcPad = 8;    // 16-bit elements of row padding (wmma ldm % 8 == 0, fewer conflicts)

// Copies a [rows, D] block of T into shared memory with row stride D + kTcPad, 16-byte vectors;
// rows >= num_valid are zero-filled (keys past the end: 0 * garbage could be NaN).
template <typename T, int D, int kRows, typename RowPtr>
__device__ __forceinline__ void LoadRowsT(T* dst, int num_valid, RowPtr row_ptr) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  for (int idx = threadIdx.x; idx < kRows * kVecPerRow; idx += kThreads) {
    const int j = idx / kVecPerRow;
    const int c = (idx % kVecPerRow) * kVec;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (j < num_valid) val = *reinterpret_cast<const uint4*>(row_ptr(j) + c);
    *reinterpret_cast<uint4*>(dst + j * (D + kTcPad) + c) = val;
  }
}

// The K and V tiles (kTcKeys rows) into shared memory as T, all loads issued before the stores
// (see LoadTilePair). Entry j at k_head + off(j), v_head + off(j).
template <typename T, int D, typename Off>
__device__ __forceinline__ void LoadRowsPairT(T* k_dst, T* v_dst, int num_valid, const T* k_head,
                                              const T* v_head, Off off) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  constexpr int kTotal = kTcKeys * kVecPerRow;
  static_assert(kTotal % kThreads == 0, "tile must split evenly over the threads");
  constexpr int kPerThread = kTotal / kThreads;
  uint4 kr[kPerThread], vr[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    kr[i] = vr[i] = make_uint4(0, 0, 0, 0);
    if (j < num_valid) {
      const int64_t o = off(j) + c;
      kr[i] = *reinterpret_cast<const uint4*>(k_head + o);
      vr[i] = *reinterpret_cast<const uint4*>(v_head + o);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    *reinterpret_cast<uint4*>(k_dst + j * (D + kTcPad) + c) = kr[i];
    *reinterpret_cast<uint4*>(v_dst + j * (D + kTcPad) + c) = vr[i];
  }
}

template <typename T, int D>
constexpr int PartialAttnTcSmemBytes() {
  return 2 * kTcKeys * (D + kTcPad) * 2      // K, V tiles (T)
         + kTcRows * (D + kTcPad) * 2        // Q chunk (T)
         + kTcRows * (kTcKeys + kTcPad) * 2  // P (T)
         + kTcRows * (kTcKeys + 4) * 4       // S (fp32)
         + kTcRows * D * 4                   // acc (fp32)
         + 4 * kTcRows * 4;                  // m, l, alpha, pos
}

// Pass 1 on tensor cores. grid (B*Hkv, S, row chunks of 16), kThreads threads.
// S = Q K^T: warp w computes keys [16w, 16w + 16) of the tile; online softmax with 8 threads per
// row; acc (fp32, shared) is rescaled by alpha, then acc += P V with warp w owning columns
// [w D/4, (w+1) D/4) (acc loaded into the accumulator fragment and stored back).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) PartialAttnTcKernel(const PartialAttnParams<T> p) {
  using namespace nvcuda;
  constexpr int kLd = D + kTcPad;
  constexpr int kLdP = kTcKeys + kTcPad;
  constexpr int kLdS = kTcKeys + 4;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);                      // [kTcKeys, kLd]
  T* v_s = k_s + kTcKeys * kLd;                                 // [kTcKeys, kLd]
  T* q_s = v_s + kTcKeys * kLd;                                 // [16, kLd]
  T* p_s = q_s + kTcRows * kLd;                                 // [16, kLdP]
  float* s_s = reinterpret_cast<float*>(p_s + kTcRows * kLdP);  // [16, kLdS]
  float* acc_s = s_s + kTcRows * kLdS;                          // [16, D]
  float* m_s = acc_s + kTcRows * D;                             // [16]
  float* l_s = m_s + kTcRows;
  float* alpha_s = l_s + kTcRows;
  int* pos_s = reinterpret_cast<int*>(alpha_s + kTcRows);

  const int bh = blockIdx.x, split = blockIdx.y, chunk = blockIdx.z;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, warp = tid / 32;
  const int n = p.seq_lens[b];
  const int key_begin = split * p.split_len;
  const int key_end = min(n, key_begin + p.split_len);
  const int row0 = chunk * kTcRows;

  if (tid < kTcRows) {
    const int m = row0 + tid;
    const int pos = n - p.window + m % p.window;
    pos_s[tid] = (m < p.num_rows && pos >= p.min_pos) ? pos : -1;
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  for (int idx = tid; idx < kTcRows * D; idx += kThreads) acc_s[idx] = 0.f;
  const T* q_base = p.q + (static_cast<int64_t>(bh) * p.num_rows + row0) * D;
  LoadRowsT<T, D, kTcRows>(q_s, p.num_rows - row0, [&](int r) { return q_base + r * D; });

  const T* k_head = p.k + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;
  const T* v_head = p.v + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;

  for (int tile = key_begin; tile < key_end; tile += kTcKeys) {
    const int num_valid = min(kTcKeys, key_end - tile);
    __syncthreads();  // previous tile consumed; q_s / acc_s / pos_s written on entry
    LoadRowsPairT<T, D>(k_s, v_s, num_valid, k_head, v_head,
                        [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
    __syncthreads();
    {  // S[:, 16w : 16w + 16] = Q K^T
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag;
      wmma::fill_fragment(s_frag, 0.f);
#pragma unroll
      for (int c = 0; c < D; c += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
        wmma::load_matrix_sync(a_frag, q_s + c, kLd);
        wmma::load_matrix_sync(b_frag, k_s + warp * 16 * kLd + c, kLd);
        wmma::mma_sync(s_frag, a_frag, b_frag, s_frag);
      }
      wmma::store_matrix_sync(s_s + warp * 16, s_frag, kLdS, wmma::mem_row_major);
    }
    __syncthreads();
    {  // online softmax: row r = tid / 8, keys (tid % 8) * 8 .. + 8
      const int r = tid / 8, part = tid % 8;
      const int pos = pos_s[r];
      float s[8];
      float tile_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int jj = part * 8 + e, j = tile + jj;
        const bool valid = jj < num_valid && pos >= 0 && j <= pos;
        s[e] = valid ? s_s[r * kLdS + jj] * p.scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[e]);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, tile_max);
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float prob = s[e] == -INFINITY ? 0.f : __expf(s[e] - m_new);
        const T prob_t = FromFloat<T>(prob);
        p_s[r * kLdP + part * 8 + e] = prob_t;
        sum += ToFloat(prob_t);  // l sums the rounded p that P V uses
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (part == 0) {
        const float alpha = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + sum;
        alpha_s[r] = alpha;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < kTcRows * D; idx += kThreads) acc_s[idx] *= alpha_s[idx / D];
    __syncthreads();
    // acc[:, cols of warp] += P V
#pragma unroll
    for (int n0 = warp * (D / kWarps); n0 < (warp + 1) * (D / kWarps); n0 += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c_frag;
      wmma::load_matrix_sync(c_frag, acc_s + n0, D, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTcKeys; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_frag;
        wmma::load_matrix_sync(a_frag, p_s + kk, kLdP);
        wmma::load_matrix_sync(b_frag, v_s + kk * kLd + n0, kLd);
        wmma::mma_sync(c_frag, a_frag, b_frag, c_frag);
      }
      wmma::store_matrix_sync(acc_s + n0, c_frag, D, wmma::mem_row_major);
    }
  }
  __syncthreads();
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad + row0;
  if (tid < kTcRows) {
    p.part_m[part_row0 + tid] = m_s[tid];
    p.part_l[part_row0 + tid] = l_s[tid];
  }
  for (int idx = tid; idx < kTcRows * D; idx += kThreads)
    p.part_acc[part_row0 * D + idx] = acc_s[idx];
}

template <typename T, int D>
constexpr int ScoreTcSmemBytes() {
  return 2 * kTcKeys * (D + kTcPad) * 2    // K, V tiles (T)
         + 2 * kTcRows * (D + kTcPad) * 2  // Q, A chunks (T)
         + 2 * kTcKeys * 20 * 4            // per-warp S and <a, v> tiles [16, 20] fp32 (x4 warps)
         + kTcKeys * 4 + 3 * kTcRows * 4;  // ||v||^2, lse, ||a||^2, pos
}

// Pass 3 on tensor cores. grid (B*Hkv, ceil(max_n / 64)), kThreads threads. Warp w owns keys
// [16w, 16w + 16) of the tile: for each chunk of 16 rows it computes the logits (Q K^T, the same
// fragments and order as pass 1) and <a, v> (A V^T, a rounded to the model dtype) on tensor cores,
// then lane l adds w * d2 over rows (l / 16) * 8 .. + 8 of key l % 16.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) ScoreTcKernel(const ScoreParams p) {
  using namespace nvcuda;
  constexpr int kLd = D + kTcPad;
  constexpr int kLdF = 20;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + kTcKeys * kLd;
  T* q_s = v_s + kTcKeys * kLd;
  T* a_s = q_s + kTcRows * kLd;
  float* s_s = reinterpret_cast<float*>(a_s + kTcRows * kLd);  // [4 warps][16][kLdF]
  float* av_s = s_s + kWarps * 16 * kLdF;
  float* vn2_s = av_s + kWarps * 16 * kLdF;  // [64]
  float* lse_s = vn2_s + kTcKeys;            // [16]
  float* an2_s = lse_s + kTcRows;            // [16]
  int* pos_s = reinterpret_cast<int*>(an2_s + kTcRows);

  const int bh = blockIdx.x;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int tile = blockIdx.y * kTcKeys;
  if (tile >= n) return;  // uniform over the CTA
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int num_valid = min(kTcKeys, n - tile);
  const T* k_ptr = static_cast<const T*>(p.k) + p.kv_offset[b] + h * p.stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + p.kv_offset[b] + h * p.stride_head;
  LoadRowsPairT<T, D>(k_s, v_s, num_valid, k_ptr, v_ptr,
                      [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
  __syncthreads();
  {  // ||v_j||^2: 8 threads per key, 4 independent rounds of 16 keys (short dependency chains)
    float s[4];
#pragma unroll
    for (int round = 0; round < 4; ++round) {
      const int j = round * 16 + tid / 8, c0 = (tid % 8) * (D / 8);
      s[round] = 0.f;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const float x = ToFloat(v_s[j * kLd + c0 + c]);
        s[round] = fmaf(x, x, s[round]);
      }
    }
#pragma unroll
    for (int round = 0; round < 4; ++round) {
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) s[round] += __shfl_xor_sync(0xffffffffu, s[round], o);
      if (tid % 8 == 0) vn2_s[round * 16 + tid / 8] = s[round];
    }
  }

  const T* q_all = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * p.num_rows * D;
  const float* a_all = p.a + static_cast<int64_t>(bh) * p.rows_pad * D;
  float* s_w = s_s + warp * 16 * kLdF;
  float* av_w = av_s + warp * 16 * kLdF;
  const int key_local = lane % 16, row_half = lane / 16;
  const int jj = warp * 16 + key_local, j = tile + jj;
  float score = 0.f;
  for (int row0 = 0; row0 < p.num_rows; row0 += kTcRows) {
    __syncthreads();  // previous chunk consumed (and vn2_s written)
    LoadRowsT<T, D, kTcRows>(q_s, p.num_rows - row0,
                             [&](int r) { return q_all + static_cast<int64_t>(row0 + r) * D; });
    for (int idx = tid; idx < kTcRows * D; idx += kThreads) {  // a in the model dtype
      const int r = idx / D, c = idx % D;
      a_s[r * kLd + c] =
          FromFloat<T>(row0 + r < p.num_rows ? a_all[static_cast<int64_t>(row0 + r) * D + c] : 0.f);
    }
    if (tid < kTcRows) {
      const int m = row0 + tid;
      const int pos = n - p.window + m % p.window;
      const bool ok = m < p.num_rows && pos >= p.min_pos;
      pos_s[tid] = ok ? pos : -1;
      lse_s[tid] = ok ? p.lse[static_cast<int64_t>(bh) * p.rows_pad + m] : 0.f;
    }
    __syncthreads();
    {  // ||a||^2 of the rounded a (d2 = ||v - a||^2 stays consistent): 8 threads per row
      const int r = tid / 8, c0 = (tid % 8) * (D / 8);
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const float x = ToFloat(a_s[r * kLd + c0 + c]);
        s = fmaf(x, x, s);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (tid % 8 == 0) an2_s[r] = s;
    }
    {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag, av_frag;
      wmma::fill_fragment(s_frag, 0.f);
      wmma::fill_fragment(av_frag, 0.f);
#pragma unroll
      for (int c = 0; c < D; c += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
        wmma::load_matrix_sync(a_frag, q_s + c, kLd);
        wmma::load_matrix_sync(b_frag, k_s + warp * 16 * kLd + c, kLd);
        wmma::mma_sync(s_frag, a_frag, b_frag, s_frag);
        wmma::load_matrix_sync(a_frag, a_s + c, kLd);
        wmma::load_matrix_sync(b_frag, v_s + warp * 16 * kLd + c, kLd);
        wmma::mma_sync(av_frag, a_frag, b_frag, av_frag);
      }
      wmma::store_matrix_sync(s_w, s_frag, kLdF, wmma::mem_row_major);
      wmma::store_matrix_sync(av_w, av_frag, kLdF, wmma::mem_row_major);
    }
    __syncthreads();  // an2_s from threads of warp 0, s_w / av_w of this warp
    if (jj < num_valid) {
#pragma unroll
      for (int rr = 0; rr < 8; ++rr) {
        const int r = row_half * 8 + rr;
        const int pos = pos_s[r];
        if (pos >= 0 && j <= pos) {
          float prob = __expf(s_w[r * kLdF + key_local] * p.scale - lse_s[r]);
          if (p.round_mode == 1) prob = __bfloat162float(__float2bfloat16_rn(prob));
          if (p.round_mode == 2) prob = __half2float(__float2half_rn(prob));
          const float w = prob / (1.f - prob + p.eps);
          const float d2 = fmaxf(vn2_s[jj] - 2.f * av_w[r * kLdF + key_local] + an2_s[r], 0.f);
          score = fmaf(w * w, d2, score);
        }
      }
    }
  }
  score += __shfl_down_sync(0xffffffffu, score, 16);
  if (lane < 16 && jj < num_valid) {
    p.out[p.out_offset[b] + h * p.out_stride_head + j] = score / p.group;
  }
}

}  // namespace dropkv::kernels::cuda
