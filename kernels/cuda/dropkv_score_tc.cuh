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
template <typename T, int D, int kRows, int kNumThreads = kThreads, typename RowPtr>
__device__ __forceinline__ void LoadRowsT(T* dst, int num_valid, RowPtr row_ptr) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  for (int idx = threadIdx.x; idx < kRows * kVecPerRow; idx += kNumThreads) {
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
template <typename T, int D, int kNumThreads = kThreads, typename Off>
__device__ __forceinline__ void IssueRowsPairAsync(T* k_dst, T* v_dst, int num_valid,
                                                   const T* k_head, const T* v_head, Off off) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  constexpr int kTotal = kTcKeys * kVecPerRow;
  static_assert(kTotal % kNumThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int i = 0; i < kTotal / kNumThreads; ++i) {
    const int idx = threadIdx.x + i * kNumThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    const bool valid = j < num_valid;
    const int64_t o = valid ? off(j) + c : 0;
    CpAsync16(k_dst + j * (D + kTcPad) + c, k_head + o, valid);
    CpAsync16(v_dst + j * (D + kTcPad) + c, v_head + o, valid);
  }
  CpAsyncCommit();
}

constexpr int kAttnTcThreads = 256;  // 8 warps: 4 per row chunk, kAttnTcChunks chunks per CTA
constexpr int kAttnTcChunks = 2;
// Lazy rescaling: the reference max of a row moves only when a tile's max exceeds it by more
// than this (natural-log units), so p <= e^8 against a stale max (fine in bf16 / fp16 / fp32)
// and the accumulators are rescaled a few times per split instead of on every tile.
constexpr float kLazyRescale = 8.f;

template <typename T, int D>
constexpr int PartialAttnTcChunkBytes() {
  return kTcRows * (D + kTcPad) * 2          // Q chunk (T), read once into fragments
         + kTcRows * (kTcKeys + kTcPad) * 2  // P (T)
         + kTcRows * (kTcKeys + 4) * 4       // S (fp32)
         + kTcRows * D * 4                   // acc staging (rescale, output)
         + 4 * kTcRows * 4;                  // m, l, alpha, pos
}

template <typename T, int D>
constexpr int PartialAttnTcSmemBytes() {
  return 2 * 2 * kTcKeys * (D + kTcPad) * 2  // K, V tiles (T), two stages
         + kAttnTcChunks * PartialAttnTcChunkBytes<T, D>();
}

// Pass 1 on tensor cores. grid (ceil(row chunks / 2), S, B*Hkv), kAttnTcThreads threads: warps
// 0-3 take row chunk 2x, warps 4-7 chunk 2x + 1 of the same keys (one K/V tile in shared memory
// serves both; one chunk per CTA of 4 warps read each tile twice, through L2).
// K/V tiles are double-buffered with cp.async: the next tile's copies are in flight while this
// one goes through the products and the softmax.
// Per tile and chunk: S = Q K^T (warp w: keys [16 (w % 4), +16), Q fragments kept in registers
// for the whole split); online softmax with 8 threads per row and lazy rescaling; acc += P V
// with warp w % 4 owning columns [w D/4, (w+1) D/4) in accumulator fragments that stay in
// registers (v5 loaded and stored them from shared memory on every tile and rescaled every tile).
template <typename T, int D>
__global__ void __launch_bounds__(kAttnTcThreads, D <= 128 ? 2 : 1)
    PartialAttnTcKernel(const PartialAttnParams<T> p) {
  using namespace nvcuda;
  constexpr int kLd = D + kTcPad;
  constexpr int kLdP = kTcKeys + kTcPad;
  constexpr int kLdS = kTcKeys + 4;
  constexpr int kColsPerWarp = D / 4;
  constexpr int kAccFrags = kColsPerWarp / 16;
  constexpr int kQFrags = D / 16;
  constexpr int kGroupThreads = kAttnTcThreads / kAttnTcChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* kv_s = reinterpret_cast<T*>(smem_raw);  // [2 stages][K|V][kTcKeys, kLd]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int grp = warp / 4, wg = warp % 4, gtid = tid % kGroupThreads;
  unsigned char* g_base =
      smem_raw + 2 * 2 * kTcKeys * kLd * sizeof(T) + grp * PartialAttnTcChunkBytes<T, D>();
  T* q_s = reinterpret_cast<T*>(g_base);                        // [16, kLd]
  T* p_s = q_s + kTcRows * kLd;                                 // [16, kLdP]
  float* s_s = reinterpret_cast<float*>(p_s + kTcRows * kLdP);  // [16, kLdS]
  float* acc_s = s_s + kTcRows * kLdS;                          // [16, D]
  float* m_s = acc_s + kTcRows * D;                             // [16]
  float* l_s = m_s + kTcRows;
  float* alpha_s = l_s + kTcRows;
  int* pos_s = reinterpret_cast<int*>(alpha_s + kTcRows);

  const int split = blockIdx.y, bh = blockIdx.z;
  const int chunk = blockIdx.x * kAttnTcChunks + grp;
  const bool active = chunk * kTcRows < p.rows_pad;  // warp-uniform
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int key_begin = split * p.split_len;
  const int key_end = min(n, key_begin + p.split_len);
  const int row0 = chunk * kTcRows;

  if (gtid < kTcRows) {
    const int m = row0 + gtid;
    const int pos = n - p.window + m % p.window;
    pos_s[gtid] = (active && m < p.num_rows && pos >= p.min_pos) ? pos : -1;
    m_s[gtid] = -INFINITY;
    l_s[gtid] = 0.f;
  }
  {  // Q chunk (rows past num_rows read as zero)
    constexpr int kVec = 16 / sizeof(T), kVecPerRow = D / kVec;
    const T* q_base = p.q + (static_cast<int64_t>(bh) * p.num_rows + row0) * D;
    for (int idx = gtid; idx < kTcRows * kVecPerRow; idx += kGroupThreads) {
      const int r = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (active && row0 + r < p.num_rows)
        val = *reinterpret_cast<const uint4*>(q_base + static_cast<int64_t>(r) * D + c);
      *reinterpret_cast<uint4*>(q_s + r * kLd + c) = val;
    }
  }
  const T* k_head = p.k + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;
  const T* v_head = p.v + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;
  auto issue = [&](int tile, int stage) {
    T* k_dst = kv_s + stage * 2 * kTcKeys * kLd;
    IssueRowsPairAsync<T, D, kAttnTcThreads>(
        k_dst, k_dst + kTcKeys * kLd, min(kTcKeys, key_end - tile), k_head, v_head,
        [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
  };
  if (key_begin < key_end) issue(key_begin, 0);
  __syncthreads();  // q_s, pos_s, m_s, l_s written

  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> q_frag[kQFrags];
#pragma unroll
  for (int f = 0; f < kQFrags; ++f) wmma::load_matrix_sync(q_frag[f], q_s + f * 16, kLd);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_frag[kAccFrags];
#pragma unroll
  for (int f = 0; f < kAccFrags; ++f) wmma::fill_fragment(acc_frag[f], 0.f);
  float* acc_w = acc_s + wg * kColsPerWarp;  // this warp's columns of the staging tile

  for (int tile = key_begin, it = 0; tile < key_end; tile += kTcKeys, ++it) {
    const int num_valid = min(kTcKeys, key_end - tile);
    const T* k_s = kv_s + (it & 1) * 2 * kTcKeys * kLd;
    const T* v_s = k_s + kTcKeys * kLd;
    __syncthreads();  // previous tile consumed (its K/V stage, P, alpha)
    if (tile + kTcKeys < key_end) {
      issue(tile + kTcKeys, (it + 1) & 1);  // into the stage the previous tile used
    } else {
      CpAsyncCommit();  // empty group: the wait below counts uniformly
    }
    CpAsyncWait<1>();  // this thread's copies of the current tile landed
    __syncthreads();   // ... and everyone's
    if (active) {      // S[:, 16 wg : 16 wg + 16] = Q K^T
      // Two accumulators over even / odd column blocks, added at the end: two dependent chains of
      // D / 32 tensor-core products instead of one of D / 16 (pass 3 sums in the same order).
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag, s_frag2;
      wmma::fill_fragment(s_frag, 0.f);
      wmma::fill_fragment(s_frag2, 0.f);
#pragma unroll
      for (int f = 0; f < kQFrags; f += 2) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag, b_frag2;
        wmma::load_matrix_sync(b_frag, k_s + wg * 16 * kLd + f * 16, kLd);
        wmma::load_matrix_sync(b_frag2, k_s + wg * 16 * kLd + (f + 1) * 16, kLd);
        wmma::mma_sync(s_frag, q_frag[f], b_frag, s_frag);
        wmma::mma_sync(s_frag2, q_frag[f + 1], b_frag2, s_frag2);
      }
#pragma unroll
      for (int i = 0; i < s_frag.num_elements; ++i) s_frag.x[i] += s_frag2.x[i];
      wmma::store_matrix_sync(s_s + wg * 16, s_frag, kLdS, wmma::mem_row_major);
    }
    __syncthreads();
    if (active) {  // online softmax: row r = gtid / 8, keys (gtid % 8) * 8 .. + 8
      const int r = gtid / 8, part = gtid % 8;
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
      // Move the reference only on a large increase (always on the first valid key).
      float m_ref = m_s[r];
      float l_run = l_s[r];
      const float alpha = MoveSoftmaxReference<ExpBase::kE>(m_ref, l_run, tile_max, kLazyRescale);
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float prob = SoftmaxProb<ExpBase::kE>(s[e], m_ref);
        const T prob_t = FromFloat<T>(prob);
        p_s[r * kLdP + part * 8 + e] = prob_t;
        sum += ToFloat(prob_t);  // l sums the rounded p that P V uses
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (part == 0) {
        m_s[r] = m_ref;
        l_s[r] = l_run + sum;
        alpha_s[r] = alpha;
      }
    }
    __syncthreads();
    if (active) {
      // Rare: some row's reference moved; rescale this warp's columns through shared memory
      // (the fragment layout is opaque). Only this warp touches them: no CTA barrier.
      const bool rescale =
          __any_sync(0xffffffffu, lane < kTcRows && alpha_s[lane % kTcRows] != 1.f);
      if (rescale) {
#pragma unroll
        for (int f = 0; f < kAccFrags; ++f)
          wmma::store_matrix_sync(acc_w + f * 16, acc_frag[f], D, wmma::mem_row_major);
        __syncwarp();
        for (int idx = lane; idx < kTcRows * kColsPerWarp; idx += 32) {
          const int r = idx / kColsPerWarp, c = idx % kColsPerWarp;
          acc_w[r * D + c] *= alpha_s[r];
        }
        __syncwarp();
#pragma unroll
        for (int f = 0; f < kAccFrags; ++f)
          wmma::load_matrix_sync(acc_frag[f], acc_w + f * 16, D, wmma::mem_row_major);
      }
      // acc[:, columns of this warp] += P V
#pragma unroll
      for (int kk = 0; kk < kTcKeys; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
        wmma::load_matrix_sync(a_frag, p_s + kk, kLdP);
#pragma unroll
        for (int f = 0; f < kAccFrags; ++f) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_frag;
          wmma::load_matrix_sync(b_frag, v_s + kk * kLd + wg * kColsPerWarp + f * 16, kLd);
          wmma::mma_sync(acc_frag[f], a_frag, b_frag, acc_frag[f]);
        }
      }
    }
  }
  CpAsyncWait<0>();
  if (active) {
#pragma unroll
    for (int f = 0; f < kAccFrags; ++f)
      wmma::store_matrix_sync(acc_w + f * 16, acc_frag[f], D, wmma::mem_row_major);
  }
  __syncthreads();
  if (!active) return;
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad + row0;
  if (gtid < kTcRows) {
    p.part_m[part_row0 + gtid] = m_s[gtid];
    p.part_l[part_row0 + gtid] = l_s[gtid];
  }
  for (int idx = gtid; idx < kTcRows * D; idx += kGroupThreads)
    p.part_acc[part_row0 * D + idx] = acc_s[idx];
}

constexpr int kTcResidentChunks = 2;  // row chunks whose Q / A rows stay in shared memory
constexpr int kScoreTcThreads = 256;  // 8 warps: 4 key groups x kTcResidentChunks row chunks
constexpr int kScoreTcWarps = kScoreTcThreads / 32;

template <typename T, int D>
constexpr int ScoreTcSmemBytes() {
  return 2 * 2 * kTcKeys * (D + kTcPad) * 2                    // K, V tiles (T), two stages
         + 2 * kTcResidentChunks * kTcRows * (D + kTcPad) * 2  // Q, A rows (T)
         + 2 * kScoreTcWarps * 16 * 20 * 4       // per-warp S and <a, v> tiles [16, 20] fp32
         + 2 * kTcKeys * 4                       // ||v||^2, the second row chunk's partial scores
         + 3 * kTcResidentChunks * kTcRows * 4;  // lse, ||a||^2, pos
}

// Pass 3 on tensor cores. grid (B*Hkv, CTAs per head), kScoreTcThreads threads, persistent: CTA
// (bh, y) scores the 64-key tiles y, y + gridDim.y, ... of its head, with the next tile's K/V
// copies (cp.async, two stages) in flight while the current one is scored. Packed rows go in
// groups of kTcResidentChunks chunks of 16; when they fit in one group (g * W <= 32, e.g.
// Llama's 4 x 8), Q, a (rounded to the model dtype), ||a||^2, lse and positions are loaded once
// per CTA instead of once per tile (v4 launched one CTA per tile and reloaded them every time).
// Warp w owns keys [16 (w % 4), +16) of the tile and chunk w / 4 of each group: it computes the
// logits (Q K^T, the same fragments and order as pass 1) and <a, v> (A V^T) on tensor cores, then
// lane l adds w * d2 over rows (l / 16) * 8 .. + 8 of key l % 16; the two chunks' warps of a key
// group add up through shared memory. (v5 had 4 warps doing both chunks: 2 warps per scheduler.)
template <typename T, int D>
__global__ void __launch_bounds__(kScoreTcThreads, D <= 128 ? 2 : 1)
    ScoreTcKernel(const ScoreParams p) {
  using namespace nvcuda;
  constexpr int kLd = D + kTcPad;
  constexpr int kLdF = 20;
  constexpr int kResRows = kTcResidentChunks * kTcRows;
  static_assert(kScoreTcWarps == 4 * kTcResidentChunks, "4 key groups per row chunk");
  static_assert(kScoreTcThreads % kResRows == 0, "row split");
  constexpr int kThreadsPerRow = kScoreTcThreads / kResRows;
  static_assert(D % kThreadsPerRow == 0 && kThreadsPerRow <= 32, "row split");
  constexpr int kThreadsPerKey = kScoreTcThreads / kTcKeys;
  static_assert(kThreadsPerKey <= 32 && D % kThreadsPerKey == 0, "key split");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* kv_s = reinterpret_cast<T*>(smem_raw);                     // [2 stages][K|V][kTcKeys, kLd]
  T* q_s = kv_s + 4 * kTcKeys * kLd;                            // [kResRows, kLd]
  T* a_s = q_s + kResRows * kLd;                                // [kResRows, kLd]
  float* s_s = reinterpret_cast<float*>(a_s + kResRows * kLd);  // [warps][16][kLdF]
  float* av_s = s_s + kScoreTcWarps * 16 * kLdF;                // [warps][16][kLdF]
  float* vn2_s = av_s + kScoreTcWarps * 16 * kLdF;              // [kTcKeys]
  float* red_s = vn2_s + kTcKeys;                               // [kTcKeys]
  float* lse_s = red_s + kTcKeys;                               // [kResRows]
  float* an2_s = lse_s + kResRows;                              // [kResRows]
  int* pos_s = reinterpret_cast<int*>(an2_s + kResRows);        // [kResRows]

  const int bh = blockIdx.x;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int tile_stride = gridDim.y;
  if (static_cast<int>(blockIdx.y) * kTcKeys >= n) return;  // uniform over the CTA
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int key_group = warp % 4, chunk_in_group = warp / 4;
  const T* k_ptr = static_cast<const T*>(p.k) + p.kv_offset[b] + h * p.stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + p.kv_offset[b] + h * p.stride_head;
  const T* q_all = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * p.num_rows * D;
  const float* a_all = p.a + static_cast<int64_t>(bh) * p.a_rows * D;
  const int num_chunks = p.rows_pad / kTcRows;
  const bool resident = num_chunks <= kTcResidentChunks;

  // Rows of chunks [c0, c0 + count) into slots [0, 16 * count): Q, a in the model dtype, pos,
  // lse, ||a||^2 of the rounded a (d2 = ||v - a||^2 stays consistent). Ends with a barrier
  // before ||a||^2; the caller syncs before reading an2_s.
  auto load_rows = [&](int c0, int count) {
    const int row_begin = c0 * kTcRows, num_slots = count * kTcRows;
    LoadRowsT<T, D, kResRows, kScoreTcThreads>(
        q_s, min(p.num_rows - row_begin, num_slots),
        [&](int r) { return q_all + static_cast<int64_t>(row_begin + r) * D; });
    for (int idx = tid; idx < kResRows * D; idx += kScoreTcThreads) {
      const int r = idx / D, c = idx % D, m = row_begin + r;
      a_s[r * kLd + c] = FromFloat<T>(
          r < num_slots && m < p.num_rows ? a_all[static_cast<int64_t>(m) * D + c] : 0.f);
    }
    if (tid < kResRows) {
      const int m = row_begin + tid;
      const int pos = n - p.window + m % p.window;
      const bool ok = tid < num_slots && m < p.num_rows && pos >= p.min_pos;
      pos_s[tid] = ok ? pos : -1;
      lse_s[tid] = ok ? p.lse[static_cast<int64_t>(bh) * p.a_rows + m] : 0.f;
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
    IssueRowsPairAsync<T, D, kScoreTcThreads>(
        k_dst, k_dst + kTcKeys * kLd, min(kTcKeys, n - tile), k_ptr, v_ptr,
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
    __syncthreads();  // the previous tile's stage, vn2_s, red_s and rows consumed
    if ((t + tile_stride) * kTcKeys < n) {
      issue(t + tile_stride, (it + 1) & 1);
    } else {
      CpAsyncCommit();  // empty group: the wait below counts uniformly
    }
    CpAsyncWait<1>();  // this thread's copies of the current tile landed
    __syncthreads();   // ... and everyone's
    {                  // ||v_j||^2: kThreadsPerKey threads per key
      const int j = tid / kThreadsPerKey, c0 = (tid % kThreadsPerKey) * (D / kThreadsPerKey);
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < D / kThreadsPerKey; ++c) {
        const float x = ToFloat(v_s[j * kLd + c0 + c]);
        s = fmaf(x, x, s);
      }
#pragma unroll
      for (int o = kThreadsPerKey / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (tid % kThreadsPerKey == 0) vn2_s[j] = s;
    }
    const int jj = key_group * 16 + key_local, j = tile + jj;
    float score = 0.f;
    for (int cg = 0; cg < num_chunks; cg += kTcResidentChunks) {
      const int count = min(kTcResidentChunks, num_chunks - cg);
      if (!resident) {
        __syncthreads();  // the previous group's rows consumed
        load_rows(cg, count);
      }
      __syncthreads();                  // vn2_s, the rows and an2_s visible
      if (chunk_in_group < count) {     // warp-uniform
        const int cc = chunk_in_group;  // this warp's chunk of the group
        const T* q_c = q_s + cc * kTcRows * kLd;
        const T* a_c = a_s + cc * kTcRows * kLd;
        // Logits in pass 1's order (even / odd column blocks in two accumulators, then added);
        // <a, v> the same way: four short dependent chains instead of two long ones.
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_frag, av_frag, s_frag2, av_frag2;
        wmma::fill_fragment(s_frag, 0.f);
        wmma::fill_fragment(av_frag, 0.f);
        wmma::fill_fragment(s_frag2, 0.f);
        wmma::fill_fragment(av_frag2, 0.f);
#pragma unroll
        for (int c = 0; c < D; c += 32) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a_frag;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b_frag;
          wmma::load_matrix_sync(a_frag, q_c + c, kLd);
          wmma::load_matrix_sync(b_frag, k_s + key_group * 16 * kLd + c, kLd);
          wmma::mma_sync(s_frag, a_frag, b_frag, s_frag);
          wmma::load_matrix_sync(a_frag, q_c + c + 16, kLd);
          wmma::load_matrix_sync(b_frag, k_s + key_group * 16 * kLd + c + 16, kLd);
          wmma::mma_sync(s_frag2, a_frag, b_frag, s_frag2);
          wmma::load_matrix_sync(a_frag, a_c + c, kLd);
          wmma::load_matrix_sync(b_frag, v_s + key_group * 16 * kLd + c, kLd);
          wmma::mma_sync(av_frag, a_frag, b_frag, av_frag);
          wmma::load_matrix_sync(a_frag, a_c + c + 16, kLd);
          wmma::load_matrix_sync(b_frag, v_s + key_group * 16 * kLd + c + 16, kLd);
          wmma::mma_sync(av_frag2, a_frag, b_frag, av_frag2);
        }
#pragma unroll
        for (int i = 0; i < s_frag.num_elements; ++i) {
          s_frag.x[i] += s_frag2.x[i];
          av_frag.x[i] += av_frag2.x[i];
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
              // Fast division (2 ulp; the IEEE one is a ~20-instruction subroutine per pair).
              const float w = __fdividef(prob, 1.f - prob + p.eps);
              const float d2 =
                  fmaxf(vn2_s[jj] - 2.f * av_w[r * kLdF + key_local] + an2_s[slot], 0.f);
              score = fmaf(w * w, d2, score);
            }
          }
        }
        __syncwarp();  // read before the next group's stores
      }
    }
    score += __shfl_down_sync(0xffffffffu, score, 16);
    if (chunk_in_group == 1 && lane < 16) red_s[jj] = score;
    __syncthreads();
    if (chunk_in_group == 0 && lane < 16 && jj < num_valid) {
      p.out[p.out_offset[b] + h * p.out_stride_head + j] = (score + red_s[jj]) / p.group;
    }
  }
  CpAsyncWait<0>();
}

}  // namespace dropkv::kernels::cuda
