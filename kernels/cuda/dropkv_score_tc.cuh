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

// cp.async version of LoadRowsPairT: issues the copies of the K and V tiles (kTcKeys rows, row
// stride D + kTcPad) and commits them as one group; rows >= num_valid are zero-filled without a
// read. The caller waits (CpAsyncWait) and syncs the CTA before reading.
template <typename T, int D, typename Off>
__device__ __forceinline__ void IssueRowsPairAsync(T* k_dst, T* v_dst, int num_valid,
                                                   const T* k_head, const T* v_head, Off off) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  constexpr int kTotal = kTcKeys * kVecPerRow;
  static_assert(kTotal % kThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    const bool valid = j < num_valid;
    const int64_t o = valid ? off(j) + c : 0;
    CpAsync16(k_dst + j * (D + kTcPad) + c, k_head + o, valid);
    CpAsync16(v_dst + j * (D + kTcPad) + c, v_head + o, valid);
  }
  CpAsyncCommit();
}

template <typename T, int D>
constexpr int PartialAttnTcSmemBytes() {
  return 2 * 2 * kTcKeys * (D + kTcPad) * 2  // K, V tiles (T), two stages
         + kTcRows * (D + kTcPad) * 2        // Q chunk (T)
         + kTcRows * (kTcKeys + kTcPad) * 2  // P (T)
         + kTcRows * (kTcKeys + 4) * 4       // S (fp32)
         + kTcRows * D * 4                   // acc (fp32)
         + 4 * kTcRows * 4;                  // m, l, alpha, pos
}

// Pass 1 on tensor cores. grid (row chunks of 16, S, B*Hkv), kThreads threads: the chunks of one
// (split, head) are neighbours in launch order, so their K/V tiles come from L2 after the first.
// K/V tiles are double-buffered with cp.async: the next tile's copies are in flight while this
// one goes through the products and the softmax (v3 loaded, then computed, with nothing in flight
// during the compute).
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
  T* kv_s = reinterpret_cast<T*>(smem_raw);                     // [2 stages][K|V][kTcKeys, kLd]
  T* q_s = kv_s + 4 * kTcKeys * kLd;                            // [16, kLd]
  T* p_s = q_s + kTcRows * kLd;                                 // [16, kLdP]
  float* s_s = reinterpret_cast<float*>(p_s + kTcRows * kLdP);  // [16, kLdS]
  float* acc_s = s_s + kTcRows * kLdS;                          // [16, D]
  float* m_s = acc_s + kTcRows * D;                             // [16]
  float* l_s = m_s + kTcRows;
  float* alpha_s = l_s + kTcRows;
  int* pos_s = reinterpret_cast<int*>(alpha_s + kTcRows);

  const int chunk = blockIdx.x, split = blockIdx.y, bh = blockIdx.z;
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

  auto issue = [&](int tile, int stage) {
    T* k_dst = kv_s + stage * 2 * kTcKeys * kLd;
    IssueRowsPairAsync<T, D>(k_dst, k_dst + kTcKeys * kLd, min(kTcKeys, key_end - tile), k_head,
                             v_head,
                             [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
  };
  if (key_begin < key_end) issue(key_begin, 0);
  for (int tile = key_begin, it = 0; tile < key_end; tile += kTcKeys, ++it) {
    const int num_valid = min(kTcKeys, key_end - tile);
    const T* k_s = kv_s + (it & 1) * 2 * kTcKeys * kLd;
    const T* v_s = k_s + kTcKeys * kLd;
    __syncthreads();  // previous tile consumed; q_s / acc_s / pos_s written on entry
    if (tile + kTcKeys < key_end) {
      issue(tile + kTcKeys, (it + 1) & 1);  // into the stage the previous tile used
    } else {
      CpAsyncCommit();  // empty group: the wait below counts uniformly
    }
    CpAsyncWait<1>();  // this thread's copies of the current tile landed
    __syncthreads();   // ... and everyone's
    {                  // S[:, 16w : 16w + 16] = Q K^T
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

constexpr int kTcResidentChunks = 2;  // row chunks whose Q / A rows stay in shared memory

template <typename T, int D>
constexpr int ScoreTcSmemBytes() {
  return 2 * 2 * kTcKeys * (D + kTcPad) * 2                    // K, V tiles (T), two stages
         + 2 * kTcResidentChunks * kTcRows * (D + kTcPad) * 2  // Q, A rows (T)
         + 2 * kTcKeys * 20 * 4  // per-warp S and <a, v> tiles [16, 20] fp32 (x4 warps)
         + kTcKeys * 4 + 3 * kTcResidentChunks * kTcRows * 4;  // ||v||^2, lse, ||a||^2, pos
}

// Pass 3 on tensor cores. grid (B*Hkv, CTAs per head), kThreads threads, persistent: CTA (bh, y)
// scores the 64-key tiles y, y + gridDim.y, ... of its head, with the next tile's K/V copies
// (cp.async, two stages) in flight while the current one is scored. When the packed rows fit in
// kTcResidentChunks chunks (g * W <= 32, e.g. Llama's 4 x 8), Q, a (rounded to the model dtype),
// ||a||^2, lse and positions are loaded once per CTA instead of once per tile (v4 launched one
// CTA per tile and reloaded them for every tile).
// Per tile, warp w owns keys [16w, 16w + 16): for each chunk of 16 rows it computes the logits
// (Q K^T, the same fragments and order as pass 1) and <a, v> (A V^T) on tensor cores, then lane l
// adds w * d2 over rows (l / 16) * 8 .. + 8 of key l % 16.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) ScoreTcKernel(const ScoreParams p) {
  using namespace nvcuda;
  constexpr int kLd = D + kTcPad;
  constexpr int kLdF = 20;
  constexpr int kResRows = kTcResidentChunks * kTcRows;
  static_assert(kThreads % kResRows == 0 && D % (kThreads / kResRows) == 0, "row split");
  constexpr int kThreadsPerRow = kThreads / kResRows;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* kv_s = reinterpret_cast<T*>(smem_raw);                     // [2 stages][K|V][kTcKeys, kLd]
  T* q_s = kv_s + 4 * kTcKeys * kLd;                            // [kResRows, kLd]
  T* a_s = q_s + kResRows * kLd;                                // [kResRows, kLd]
  float* s_s = reinterpret_cast<float*>(a_s + kResRows * kLd);  // [4 warps][16][kLdF]
  float* av_s = s_s + kWarps * 16 * kLdF;                       // [4 warps][16][kLdF]
  float* vn2_s = av_s + kWarps * 16 * kLdF;                     // [kTcKeys]
  float* lse_s = vn2_s + kTcKeys;                               // [kResRows]
  float* an2_s = lse_s + kResRows;                              // [kResRows]
  int* pos_s = reinterpret_cast<int*>(an2_s + kResRows);        // [kResRows]

  const int bh = blockIdx.x;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int tile_stride = gridDim.y;
  if (static_cast<int>(blockIdx.y) * kTcKeys >= n) return;  // uniform over the CTA
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const T* k_ptr = static_cast<const T*>(p.k) + p.kv_offset[b] + h * p.stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + p.kv_offset[b] + h * p.stride_head;
  const T* q_all = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * p.num_rows * D;
  const float* a_all = p.a + static_cast<int64_t>(bh) * p.rows_pad * D;
  const int num_chunks = p.rows_pad / kTcRows;
  const bool resident = num_chunks <= kTcResidentChunks;

  // Rows of chunks [c0, c0 + count) into slots [0, 16 * count): Q, a in the model dtype, pos,
  // lse, ||a||^2 of the rounded a (d2 = ||v - a||^2 stays consistent). Ends with a barrier
  // before ||a||^2; the caller syncs before reading an2_s.
  auto load_rows = [&](int c0, int count) {
    const int row_begin = c0 * kTcRows, num_slots = count * kTcRows;
    LoadRowsT<T, D, kResRows>(q_s, min(p.num_rows - row_begin, num_slots), [&](int r) {
      return q_all + static_cast<int64_t>(row_begin + r) * D;
    });
    for (int idx = tid; idx < kResRows * D; idx += kThreads) {
      const int r = idx / D, c = idx % D, m = row_begin + r;
      a_s[r * kLd + c] = FromFloat<T>(
          r < num_slots && m < p.num_rows ? a_all[static_cast<int64_t>(m) * D + c] : 0.f);
    }
    if (tid < kResRows) {
      const int m = row_begin + tid;
      const int pos = n - p.window + m % p.window;
      const bool ok = tid < num_slots && m < p.num_rows && pos >= p.min_pos;
      pos_s[tid] = ok ? pos : -1;
      lse_s[tid] = ok ? p.lse[static_cast<int64_t>(bh) * p.rows_pad + m] : 0.f;
    }
    __syncthreads();
    const int r = tid / kThreadsPerRow, c0_col = (tid % kThreadsPerRow) * (D / kThreadsPerRow);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < D / kThreadsPerRow; ++c) {
      const float x = ToFloat(a_s[r * kLd + c0_col + c]);
      s = fmaf(x, x, s);
    }
#pragma unroll
    for (int o = kThreadsPerRow / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (tid % kThreadsPerRow == 0) an2_s[r] = s;
  };
  if (resident) load_rows(0, num_chunks);

  auto issue = [&](int t, int stage) {
    const int tile = t * kTcKeys;
    T* k_dst = kv_s + stage * 2 * kTcKeys * kLd;
    IssueRowsPairAsync<T, D>(k_dst, k_dst + kTcKeys * kLd, min(kTcKeys, n - tile), k_ptr, v_ptr,
                             [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
  };
  issue(blockIdx.y, 0);
  float* s_w = s_s + warp * 16 * kLdF;
  float* av_w = av_s + warp * 16 * kLdF;
  const int key_local = lane % 16, row_half = lane / 16;
  for (int t = blockIdx.y, it = 0; t * kTcKeys < n; t += tile_stride, ++it) {
    const int tile = t * kTcKeys;
    const int num_valid = min(kTcKeys, n - tile);
    const T* k_s = kv_s + (it & 1) * 2 * kTcKeys * kLd;
    const T* v_s = k_s + kTcKeys * kLd;
    __syncthreads();  // the previous tile's stage, vn2_s and rows consumed
    if ((t + tile_stride) * kTcKeys < n) {
      issue(t + tile_stride, (it + 1) & 1);
    } else {
      CpAsyncCommit();  // empty group: the wait below counts uniformly
    }
    CpAsyncWait<1>();  // this thread's copies of the current tile landed
    __syncthreads();   // ... and everyone's
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
    const int jj = warp * 16 + key_local, j = tile + jj;
    float score = 0.f;
    for (int cg = 0; cg < num_chunks; cg += kTcResidentChunks) {
      const int count = min(kTcResidentChunks, num_chunks - cg);
      if (!resident) {
        __syncthreads();  // the previous group's rows consumed
        load_rows(cg, count);
      }
      __syncthreads();  // vn2_s, the rows and an2_s visible
      for (int cc = 0; cc < count; ++cc) {
        const T* q_c = q_s + cc * kTcRows * kLd;
        const T* a_c = a_s + cc * kTcRows * kLd;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag, av_frag;
        wmma::fill_fragment(s_frag, 0.f);
        wmma::fill_fragment(av_frag, 0.f);
#pragma unroll
        for (int c = 0; c < D; c += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
          wmma::load_matrix_sync(a_frag, q_c + c, kLd);
          wmma::load_matrix_sync(b_frag, k_s + warp * 16 * kLd + c, kLd);
          wmma::mma_sync(s_frag, a_frag, b_frag, s_frag);
          wmma::load_matrix_sync(a_frag, a_c + c, kLd);
          wmma::load_matrix_sync(b_frag, v_s + warp * 16 * kLd + c, kLd);
          wmma::mma_sync(av_frag, a_frag, b_frag, av_frag);
        }
        wmma::store_matrix_sync(s_w, s_frag, kLdF, wmma::mem_row_major);
        wmma::store_matrix_sync(av_w, av_frag, kLdF, wmma::mem_row_major);
        __syncwarp();  // s_w / av_w are this warp's own
        if (jj < num_valid) {
#pragma unroll
          for (int rr = 0; rr < 8; ++rr) {
            const int r = row_half * 8 + rr, slot = cc * kTcRows + r;
            const int pos = pos_s[slot];
            if (pos >= 0 && j <= pos) {
              float prob = __expf(s_w[r * kLdF + key_local] * p.scale - lse_s[slot]);
              if (p.round_mode == 1) prob = __bfloat162float(__float2bfloat16_rn(prob));
              if (p.round_mode == 2) prob = __half2float(__float2half_rn(prob));
              const float w = prob / (1.f - prob + p.eps);
              const float d2 =
                  fmaxf(vn2_s[jj] - 2.f * av_w[r * kLdF + key_local] + an2_s[slot], 0.f);
              score = fmaf(w * w, d2, score);
            }
          }
        }
        __syncwarp();  // read before the next chunk's stores
      }
    }
    score += __shfl_down_sync(0xffffffffu, score, 16);
    if (lane < 16 && jj < num_valid) {
      p.out[p.out_offset[b] + h * p.out_stride_head + j] = score / p.group;
    }
  }
  CpAsyncWait<0>();
}

}  // namespace dropkv::kernels::cuda
