// Raw-pointer device code shared by the DropKV scoring passes and paged decode attention: the
// split-K window attention with an online softmax (pass 1 of algorithms.md section 1, and the
// flash-decoding split of paged decode) and the log-sum-exp merge (pass 2). No torch includes.
//
// Rows: a CTA works on up to RC "rows" of one KV head. For scoring, the g*W window queries of the
// KV head are packed (row m -> query head h*g + m / W, window position m % W, key position
// n - W + m % W); for decode, W = 1 and the rows are the g query heads. Row m sees keys
// j <= pos(m); rows with pos < min_pos are skipped (scoring: a row that sees a single key has no
// defined removal shift).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dtype_convert.cuh"

namespace dropkv::kernels::cuda {

constexpr int kThreads = 128;  // 4 warps per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kKeyTile = 32;  // keys per tile: one per lane in the logit mapping

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// cp.async (sm_80+) helpers: 16-byte global -> shared copies that complete asynchronously.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, bool valid) {
  // src-size 0 zero-fills the 16 bytes without reading (keys past the end: p = 0 and v = 0).
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ float FastExp2(float x) {  // ex2.approx: exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// --- The online softmax (FlashAttention-2), shared by the scoring and the decode kernels -------
// A partial result over some keys is (m, l, acc): m a reference max of their logits, l = sum p,
// acc = sum p v with p = exp(s - m). The scoring and prefill kernels use base e; decode works in
// base 2 (its logits are pre-scaled by log2 e) and exponentiates with ex2.approx.
enum class ExpBase { kE, k2 };

template <ExpBase B>
__device__ __forceinline__ float SoftmaxExp(float x) {
  if constexpr (B == ExpBase::k2) {
    return FastExp2(x);
  } else {
    return __expf(x);
  }
}

// The factor that brings a partial with reference `m` to the reference `m_new` >= m: 0 for a
// partial that has seen no valid key yet (m = -inf; exp(-inf - -inf) would be NaN).
template <ExpBase B>
__device__ __forceinline__ float SoftmaxRescale(float m, float m_new) {
  return m == -INFINITY ? 0.f : SoftmaxExp<B>(m - m_new);
}

// p of logit `s` against the reference `m_ref`: 0 for a masked key (s = -inf).
template <ExpBase B>
__device__ __forceinline__ float SoftmaxProb(float s, float m_ref) {
  return s == -INFINITY ? 0.f : SoftmaxExp<B>(s - m_ref);
}

// Lazy rescaling: the reference max moves to `tile_max` only when it beats the reference by more
// than `margin` (p <= e^margin, or 2^margin, against it), so the accumulator rescales run a few
// times per split instead of every tile; it always moves on the first valid key. Returns the
// factor the caller multiplies its accumulators by, 1 when the reference stayed (l is rescaled
// here).
template <ExpBase B>
__device__ __forceinline__ float MoveSoftmaxReference(float& m, float& l, float tile_max,
                                                      float margin) {
  if (!(tile_max > m + margin)) return 1.f;
  const float alpha = SoftmaxRescale<B>(m, tile_max);
  m = tile_max;
  l *= alpha;
  return alpha;
}

// Merges kParts partials of one row stored `stride` floats apart as [acc (D floats), m, l]:
// returns the merged (m, l) and column c of the merged acc. Partials with m = -inf weigh 0.
template <ExpBase B, int kParts, int D>
__device__ __forceinline__ void MergePartialRows(const float* rows, int stride, int c, float& m,
                                                 float& l, float& a) {
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kParts; ++w) m = fmaxf(m, rows[w * stride + D]);
  l = 0.f;
  a = 0.f;
#pragma unroll
  for (int w = 0; w < kParts; ++w) {
    const float* row = rows + w * stride;
    const float f = SoftmaxRescale<B>(row[D], m);
    l = fmaf(row[D + 1], f, l);
    a = fmaf(row[c], f, a);
  }
}

// Loads a [kKeyTile, D] tile of rows `row_ptr(j)` into fp32 shared memory with row stride
// `stride` (D + 1 pads away bank conflicts when lanes read different rows). Keys outside
// [0, num_valid) are zero-filled: p is 0 there, and 0 * garbage could be NaN.
// Each thread moves 16-byte vectors; the caller guarantees 16-byte aligned rows.
template <typename T, int D, typename RowPtr>
__device__ __forceinline__ void LoadTile(float* dst, int stride, int num_valid, RowPtr row_ptr) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  for (int idx = threadIdx.x; idx < kKeyTile * kVecPerRow; idx += kThreads) {
    const int j = idx / kVecPerRow;
    const int c = (idx % kVecPerRow) * kVec;
    float* out = dst + j * stride + c;
    if (j < num_valid) {
      union {
        uint4 raw;
        T vals[kVec];
      } u;
      u.raw = *reinterpret_cast<const uint4*>(row_ptr(j) + c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = ToFloat(u.vals[e]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = 0.f;
    }
  }
}

// Loads the K and V tiles of keys [0, num_valid) (entry j at k_head + off(j), v_head + off(j))
// into fp32 shared memory, rows kKeyTile, strides k_stride / v_stride. Every 16-byte load of both
// tiles is issued before the first conversion and store, so each thread keeps 2 x kPerThread
// loads in flight (v1 issued one at a time and was latency-bound at ~0.5 TB/s).
template <typename T, int D, typename Off>
__device__ __forceinline__ void LoadTilePair(float* k_dst, int k_stride, float* v_dst, int v_stride,
                                             int num_valid, const T* k_head, const T* v_head,
                                             Off off) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecPerRow = D / kVec;
  constexpr int kTotal = kKeyTile * kVecPerRow;
  constexpr int kPerThread = (kTotal + kThreads - 1) / kThreads;
  union Vec {
    uint4 raw;
    T vals[kVec];
  };
  Vec kr[kPerThread], vr[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    kr[i].raw = vr[i].raw = make_uint4(0, 0, 0, 0);
    if (idx < kTotal && j < num_valid) {
      const int64_t o = off(j) + c;
      kr[i].raw = *reinterpret_cast<const uint4*>(k_head + o);
      vr[i].raw = *reinterpret_cast<const uint4*>(v_head + o);
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int j = idx / kVecPerRow, c = (idx % kVecPerRow) * kVec;
    if (idx < kTotal) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        k_dst[j * k_stride + c + e] = ToFloat(kr[i].vals[e]);
        v_dst[j * v_stride + c + e] = ToFloat(vr[i].vals[e]);
      }
    }
  }
}

// Pass 1 parameters. Keys of (sequence b, KV head h) come either from a dense tensor
// (k + kv_offset[b] + h * stride_head + j * stride_tok) or from the paged pool
// (slot = block_tables[b, j / block_size] * block_size + j % block_size,
//  k + slot * stride_tok + h * stride_head).
template <typename T>
struct PartialAttnParams {
  const T* q;  // [B, Hkv, g, W, D] contiguous (= q [B, Hq, W, D])
  const T* k;
  const T* v;
  const int64_t* kv_offset;     // dense: [B] element offset of each sequence
  const int32_t* block_tables;  // paged: [B, max_blocks]
  const int32_t* seq_lens;      // [B] keys per sequence
  int64_t stride_tok;           // elements between consecutive keys (dense) / slots (paged)
  int64_t stride_head;          // elements between KV heads
  int32_t max_blocks;
  int32_t block_size;
  int32_t num_kv_heads;
  int32_t window;    // W (1 for decode)
  int32_t num_rows;  // g * W
  int32_t rows_pad;  // num_rows rounded up to the row chunk
  int32_t min_pos;   // rows at key positions < min_pos are skipped
  int32_t num_splits;
  int32_t split_len;  // keys per split, a multiple of kKeyTile
  float scale;
  // Outputs: unnormalised partials per (b*Hkv + h, split, row).
  float* part_m;    // [B*Hkv, S, rows_pad] running max of the logits
  float* part_l;    // [B*Hkv, S, rows_pad] sum of exp(logit - m)
  float* part_acc;  // [B*Hkv, S, rows_pad, D] sum of exp(logit - m) * v
};

// Shared memory of PartialAttnKernel<T, D, RC>, in floats.
template <int D, int RC>
constexpr int PartialAttnSmemFloats() {
  return kKeyTile * (D + 1) + kKeyTile * D + RC * D + RC * kKeyTile + 4 * RC;
}

// Pass 1. grid (B*Hkv, S, row chunks), kThreads threads. CTA (bh, s, chunk) streams keys
// [s * split_len, min(n, (s+1) * split_len)) of KV head bh % Hkv of sequence bh / Hkv in tiles of
// kKeyTile, for rows [chunk * RC, chunk * RC + RC), with an online softmax.
// Logits: lane = key of the tile, warp w = rows w, w + 4, ...; PV: thread = output column(s).
template <typename T, int D, int RC, bool kPaged>
__global__ void __launch_bounds__(kThreads) PartialAttnKernel(const PartialAttnParams<T> p) {
  static_assert(RC % kWarps == 0, "rows per chunk must split over the warps");
  constexpr int kRowsPerWarp = RC / kWarps;
  constexpr int kCols = D >= kThreads ? D / kThreads : 1;       // output columns per thread
  constexpr int kRowGroups = D >= kThreads ? 1 : kThreads / D;  // threads sharing a column
  static_assert(RC % kRowGroups == 0, "row chunk too small for this head_dim");
  constexpr int kRowsPerThread = RC / kRowGroups;

  extern __shared__ float smem[];
  float* k_s = smem;                                  // [kKeyTile, D + 1]
  float* v_s = k_s + kKeyTile * (D + 1);              // [kKeyTile, D]
  float* q_s = v_s + kKeyTile * D;                    // [RC, D]
  float* p_s = q_s + RC * D;                          // [RC, kKeyTile]
  float* m_s = p_s + RC * kKeyTile;                   // [RC]
  float* l_s = m_s + RC;                              // [RC]
  float* alpha_s = l_s + RC;                          // [RC]
  int* pos_s = reinterpret_cast<int*>(alpha_s + RC);  // [RC]

  const int bh = blockIdx.x, split = blockIdx.y, chunk = blockIdx.z;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = p.seq_lens[b];
  const int key_begin = split * p.split_len;
  const int key_end = min(n, key_begin + p.split_len);
  const int row0 = chunk * RC;

  // Rows of this chunk: their key position, or -1 when padded / skipped.
  if (tid < RC) {
    const int m = row0 + tid;
    const int pos = n - p.window + m % p.window;
    pos_s[tid] = (m < p.num_rows && pos >= p.min_pos) ? pos : -1;
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  // Queries of the chunk (rows past num_rows read as zero).
  const T* q_base = p.q + (static_cast<int64_t>(bh) * p.num_rows + row0) * D;
  for (int idx = tid; idx < RC * D; idx += kThreads) {
    q_s[idx] = (row0 + idx / D < p.num_rows) ? ToFloat(q_base[idx]) : 0.f;
  }

  float acc[kRowsPerThread][kCols];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  const int col0 = tid % (D >= kThreads ? kThreads : D);
  const int row_group = D >= kThreads ? 0 : tid / D;

  const T* k_head = p.k + static_cast<int64_t>(h) * p.stride_head;
  const T* v_head = p.v + static_cast<int64_t>(h) * p.stride_head;
  int64_t seq_off = 0;
  if constexpr (!kPaged) seq_off = p.kv_offset[b];
  auto key_off = [&](int j) -> int64_t {
    if constexpr (kPaged) {
      const int32_t blk = p.block_tables[static_cast<int64_t>(b) * p.max_blocks + j / p.block_size];
      return (static_cast<int64_t>(blk) * p.block_size + j % p.block_size) * p.stride_tok;
    } else {
      return seq_off + static_cast<int64_t>(j) * p.stride_tok;
    }
  };

  for (int tile = key_begin; tile < key_end; tile += kKeyTile) {
    const int num_valid = min(kKeyTile, key_end - tile);
    __syncthreads();  // previous tile fully consumed (and q_s / pos_s written on entry)
    LoadTilePair<T, D>(k_s, D + 1, v_s, D, num_valid, k_head, v_head,
                       [&](int j) { return key_off(tile + j); });
    __syncthreads();

    // Logits and the online-softmax update of this warp's rows.
    float logit[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) logit[i] = 0.f;
    const float* k_row = k_s + lane * (D + 1);
#pragma unroll 8
    for (int c = 0; c < D; ++c) {
      const float kc = k_row[c];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i)
        logit[i] = fmaf(q_s[(warp + i * kWarps) * D + c], kc, logit[i]);
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      const int pos = pos_s[r];
      const int j = tile + lane;
      const bool valid = lane < num_valid && pos >= 0 && j <= pos;
      const float s = valid ? logit[i] * p.scale : -INFINITY;
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, WarpMax(s));
      const float prob = valid ? __expf(s - m_new) : 0.f;
      const float alpha = SoftmaxRescale<ExpBase::kE>(m_old, m_new);
      const float prob_sum = WarpSum(prob);
      p_s[r * kKeyTile + lane] = prob;
      if (lane == 0) {
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + prob_sum;
        alpha_s[r] = alpha;
      }
    }
    __syncthreads();

    // acc = acc * alpha + P V for this thread's (row, column) pairs.
#pragma unroll
    for (int ri = 0; ri < kRowsPerThread; ++ri) {
      const int r = row_group * kRowsPerThread + ri;
      const float alpha = alpha_s[r];
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) acc[ri][ci] *= alpha;
    }
#pragma unroll 4
    for (int j = 0; j < kKeyTile; ++j) {
      float vj[kCols];
#pragma unroll
      for (int ci = 0; ci < kCols; ++ci) vj[ci] = v_s[j * D + col0 + ci * kThreads];
#pragma unroll
      for (int ri = 0; ri < kRowsPerThread; ++ri) {
        const float pr = p_s[(row_group * kRowsPerThread + ri) * kKeyTile + j];
#pragma unroll
        for (int ci = 0; ci < kCols; ++ci) acc[ri][ci] = fmaf(pr, vj[ci], acc[ri][ci]);
      }
    }
  }
  __syncthreads();

  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad + row0;
  if (tid < RC) {
    p.part_m[part_row0 + tid] = m_s[tid];
    p.part_l[part_row0 + tid] = l_s[tid];
  }
#pragma unroll
  for (int ri = 0; ri < kRowsPerThread; ++ri) {
    const int r = row_group * kRowsPerThread + ri;
#pragma unroll
    for (int ci = 0; ci < kCols; ++ci) {
      p.part_acc[(part_row0 + r) * D + col0 + ci * kThreads] = acc[ri][ci];
    }
  }
}

constexpr int kMaxSplits = 128;  // launchers clamp the split count to this

// Pass 2: log-sum-exp merge of the S <= kMaxSplits partials of each row.
// grid (B*Hkv, rows_pad), D threads. The split weights exp(m_s - m_max) are computed once in
// shared memory (threads over splits, block reductions), then thread c sums column c of the
// partial accumulators with independent loads (v1 looped the splits serially per thread with a
// dependent chain: ~1 us per split, 60 us per decode layer at 128 splits).
//   out:  row r of bh -> out[(bh * out_rows + r) * D + c] for r < out_rows (decode: out_rows = g,
//         the attention output in the model dtype; scoring: fp32 a_t with out_rows = rows_pad)
//   lse:  [B*Hkv, rows_pad] (nullable) log-sum-exp of the row's logits, -inf for empty rows
// Rows that saw no key get a = 0.
template <typename TOut, int D>
__global__ void __launch_bounds__(D)
    MergeKernel(const float* __restrict__ part_m, const float* __restrict__ part_l,
                const float* __restrict__ part_acc, int num_splits, int rows_pad, int out_rows,
                TOut* __restrict__ out, float* __restrict__ lse) {
  constexpr int kNumWarps = D / 32;
  __shared__ float w_s[kMaxSplits];
  __shared__ float red_s[kNumWarps];
  const int bh = blockIdx.x, r = blockIdx.y, c = threadIdx.x, lane = c % 32, warp = c / 32;
  const int64_t base = static_cast<int64_t>(bh) * num_splits * rows_pad + r;

  float m_local = -INFINITY;
  for (int s = c; s < num_splits; s += D) {
    const float m = part_m[base + static_cast<int64_t>(s) * rows_pad];
    w_s[s] = m;
    m_local = fmaxf(m_local, m);
  }
  m_local = WarpMax(m_local);
  if (lane == 0) red_s[warp] = m_local;
  __syncthreads();
  float m_max = red_s[0];
#pragma unroll
  for (int w = 1; w < kNumWarps; ++w) m_max = fmaxf(m_max, red_s[w]);
  __syncthreads();  // red_s reused below

  float l_local = 0.f;
  for (int s = c; s < num_splits; s += D) {
    const float m = w_s[s];
    const float f = (m == -INFINITY || m_max == -INFINITY) ? 0.f : __expf(m - m_max);
    w_s[s] = f;  // empty splits weigh 0 (their l and acc are 0)
    l_local += part_l[base + static_cast<int64_t>(s) * rows_pad] * f;
  }
  l_local = WarpSum(l_local);
  if (lane == 0) red_s[warp] = l_local;
  __syncthreads();
  float l_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) l_sum += red_s[w];

  float a = 0.f;
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) {
    a = fmaf(part_acc[(base + static_cast<int64_t>(s) * rows_pad) * D + c], w_s[s], a);
  }
  const bool empty = l_sum == 0.f;
  if (r < out_rows) {
    out[(static_cast<int64_t>(bh) * out_rows + r) * D + c] =
        FromFloat<TOut>(empty ? 0.f : a / l_sum);
  }
  if (lse != nullptr && c == 0) {
    lse[static_cast<int64_t>(bh) * rows_pad + r] = empty ? -INFINITY : m_max + logf(l_sum);
  }
}

}  // namespace dropkv::kernels::cuda
