// Paged decode attention, split-K (flash-decoding) partial kernel. Raw-pointer device code, no
// torch. Writes the same partials as PartialAttnKernel (attention_common.cuh) so MergeKernel
// finishes the job.
//
// Layout of the work (v5, replacing the W = 1 use of PartialAttnKernel):
// - a key row of one head is D elements; kLanesPerKey = D / kElems lanes share a key, each
//   holding kElems = 16 (8 when 8 rows) elements; a warp covers 32 / kLanesPerKey keys per step,
//   the 4 warps of the CTA consecutive keys.
// - every thread streams its own 16-byte K and V pieces through a kDecStages-deep cp.async ring
//   in shared memory that only it reads: no barrier in the key loop, several stages of loads in
//   flight per thread (v4 had one tile in flight and four barriers per tile).
// - logits: 8-element partial dot products reduced by xor shuffles inside the key's lane group;
//   each lane group keeps its own online-softmax state (m, l, acc over its 8 columns) in
//   registers, exponentials in base 2. The states of the lane groups are merged at the end
//   (shuffles inside a warp, shared memory across the 4 warps).
// - the split's block ids are read once into shared memory (one coalesced load, one barrier).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"

namespace dropkv::kernels::cuda {

constexpr int kDecThreads = 128;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kDecStages = 6;                // cp.async ring depth (5 stages in flight)
constexpr int kDecStageBytesPerThread = 64;  // K + V bytes per thread per stage
constexpr int kDecMaxTableEntries = 4096;    // block ids cached in shared memory per CTA
constexpr float kDecLazyRescale = 8.f;       // base-2 units, see the softmax step
constexpr int kDecMaxRows = 8;               // rows (query heads) per CTA; more go to blockIdx.z

template <typename T>
struct PagedDecodeParams {
  const T* q;                   // [B, Hkv, g, D] contiguous (= q [B, Hq, D])
  const T* k;                   // pool [num_blocks, block_size, Hkv, D]
  const T* v;                   // pool, same layout
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* seq_lens;      // [B]
  int64_t stride_slot;          // Hkv * D elements between consecutive slots
  int32_t max_blocks;
  int32_t block_size;
  int32_t block_shift;  // log2(block_size) when a power of two, else -1
  int32_t num_kv_heads;
  int32_t group;       // g query heads per KV head
  int32_t rows_pad;    // g rounded up to the row chunk
  int32_t num_splits;  // gridDim.y
  int32_t split_len;   // keys per split
  int32_t table_len;   // block ids per CTA cached in shared memory (0: read them from global)
  float scale_log2;    // softmax scale * log2(e)
  float* part_m;       // [B*Hkv, S, rows_pad] (natural-log units, as MergeKernel expects)
  float* part_l;       // [B*Hkv, S, rows_pad]
  float* part_acc;     // [B*Hkv, S, rows_pad, D]
};

// Per-thread work shape. kElems head-dim elements per thread per key: 16 for 1-2 rows (half the
// lanes per key, so the shuffle reduction and the redundant exp of a lane group cost half as much
// per key), else 8: q and acc are RC x kElems registers each, and 4 rows x 16 measured 203
// registers (2 CTAs per SM) against 128 (4 CTAs per SM) with 8.
template <typename T, int RC>
struct DecodeShape {
  static constexpr int kElems = RC <= 2 ? 16 : 8;
  static constexpr int kVecs = kElems * sizeof(T) / 16;  // 16-byte copies per row piece
  static constexpr int kUnroll =                         // key steps per stage
      kDecStageBytesPerThread / (2 * 16 * kVecs) > 0 ? kDecStageBytesPerThread / (2 * 16 * kVecs)
                                                     : 1;
  static constexpr int kStageBytes = kUnroll * 2 * kVecs * 16 * kDecThreads;
};

// Shared memory of PagedDecodeKernel<T, D, RC> in bytes, without the block-id cache.
template <typename T, int D, int RC>
constexpr int PagedDecodeSmemBytes() {
  constexpr int ring = kDecStages * DecodeShape<T, RC>::kStageBytes;
  constexpr int combine = kDecWarps * RC * (D + 2) * 4;
  return ring > combine ? ring : combine;
}

// grid (B*Hkv, S, ceil(g / RC)), kDecThreads threads. CTA (bh, s, chunk) attends query heads
// [chunk*RC, chunk*RC + RC) of KV head bh % Hkv of sequence bh / Hkv over keys
// [s*split_len, min(n, (s+1)*split_len)) and writes one partial (m, l, acc) per row.
template <typename T, int D, int RC>
__global__ void __launch_bounds__(kDecThreads, RC <= 4 ? 4 : 2)
    PagedDecodeKernel(const PagedDecodeParams<T> p) {
  using Shape = DecodeShape<T, RC>;
  constexpr int kElems = Shape::kElems;
  constexpr int kVecs = Shape::kVecs;
  constexpr int kUnroll = Shape::kUnroll;
  constexpr int kLanesPerKey = D / kElems;  // 4 .. 32
  static_assert(kLanesPerKey <= 32 && 32 % kLanesPerKey == 0, "head_dim 64, 128 or 256");
  static_assert(kUnroll >= 1, "stage too small");
  constexpr int kKeysPerWarp = 32 / kLanesPerKey;
  constexpr int kKeysPerStep = kKeysPerWarp * kDecWarps;
  constexpr int kKeysPerStage = kKeysPerStep * kUnroll;
  constexpr int kStageVecs = kUnroll * 2 * kVecs * kDecThreads;  // uint4 per stage
  constexpr int kTypeVec = 16 / sizeof(T);                       // elements per 16 bytes

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* ring_s = reinterpret_cast<uint4*>(smem_raw);  // [stages][unroll][K|V][vecs][threads]
  int32_t* table_s =
      reinterpret_cast<int32_t*>(smem_raw + PagedDecodeSmemBytes<T, D, RC>());  // [table_len]

  const int bh = blockIdx.x, split = blockIdx.y, chunk = blockIdx.z;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = p.seq_lens[b];  // used below: the block-id loads go out before it returns
  const int key_begin = split * p.split_len;
  const int row0 = chunk * RC;
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad + row0;

  // Block ids of the split, once (v4 loaded one per key, a dependent load before each K/V load).
  // The whole range a split can touch is read without knowing n (entries past n are never used),
  // so this load overlaps the length's instead of waiting for it (v7 chained length -> ids -> K/V).
  const int blk0 = key_begin / p.block_size;
  const int32_t* table_g = p.block_tables + static_cast<int64_t>(b) * p.max_blocks + blk0;
  const bool cached = p.table_len > 0;  // the host sized the cache for the longest split
  if (cached) {
    const int avail = min(p.table_len, p.max_blocks - blk0);
    for (int i = tid; i < avail; i += kDecThreads) table_s[i] = table_g[i];
  }

  const int key_end = min(n, key_begin + p.split_len);
  if (key_begin >= key_end) {  // empty split (uniform over the CTA): weight 0 in the merge
    for (int idx = tid; idx < RC * D; idx += kDecThreads) p.part_acc[part_row0 * D + idx] = 0.f;
    if (tid < RC) {
      p.part_m[part_row0 + tid] = -INFINITY;
      p.part_l[part_row0 + tid] = 0.f;
    }
    return;
  }
  if (cached) __syncthreads();
  const int32_t* table = cached ? table_s : table_g;

  // This thread's key slot in a step and its 8 columns.
  const int slot = warp * kKeysPerWarp + lane / kLanesPerKey;
  const int c0 = (lane % kLanesPerKey) * kElems;
  const T* k_head = p.k + static_cast<int64_t>(h) * D + c0;
  const T* v_head = p.v + static_cast<int64_t>(h) * D + c0;
  const int num_stages = (key_end - key_begin + kKeysPerStage - 1) / kKeysPerStage;

  auto issue = [&](int stage) {
    uint4* buf = ring_s + (stage % kDecStages) * kStageVecs;
    const int base = key_begin + stage * kKeysPerStage + slot;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * kKeysPerStep;
      const bool valid = j < key_end;
      int64_t off = 0;
      if (valid) {
        const int rel = j - blk0 * p.block_size;
        // Power-of-two block sizes (the usual 16) shift and mask instead of dividing (an integer
        // division is ~20 instructions, twice per key piece in v5).
        const int blk_idx = p.block_shift >= 0 ? rel >> p.block_shift : rel / p.block_size;
        const int in_blk = p.block_shift >= 0 ? rel & (p.block_size - 1) : rel % p.block_size;
        const int32_t blk = table[blk_idx];
        off = (static_cast<int64_t>(blk) * p.block_size + in_blk) * p.stride_slot;
      }
#pragma unroll
      for (int e = 0; e < kVecs; ++e) {
        CpAsync16(&buf[((u * 2 + 0) * kVecs + e) * kDecThreads + tid], k_head + off + e * kTypeVec,
                  valid);
        CpAsync16(&buf[((u * 2 + 1) * kVecs + e) * kDecThreads + tid], v_head + off + e * kTypeVec,
                  valid);
      }
    }
    CpAsyncCommit();
  };
  // Prologue: stages 0 .. kDecStages - 2 in flight (empty groups keep the wait counts uniform).
#pragma unroll
  for (int s = 0; s < kDecStages - 1; ++s) {
    if (s < num_stages) {
      issue(s);
    } else {
      CpAsyncCommit();
    }
  }

  // Queries of this thread's columns, pre-scaled so that logits are in base-2 units.
  float q[RC][kElems];
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    const bool ok = row0 + r < p.group;
    const T* q_row = p.q + (static_cast<int64_t>(bh) * p.group + row0 + (ok ? r : 0)) * D + c0;
#pragma unroll
    for (int e = 0; e < kElems; ++e) q[r][e] = ok ? ToFloat(q_row[e]) * p.scale_log2 : 0.f;
  }

  float m[RC], l[RC], acc[RC][kElems];
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[r][e] = 0.f;
  }
  union Piece {
    uint4 raw[kVecs];
    T vals[kElems];
  };

  for (int s = 0; s < num_stages; ++s) {
    CpAsyncWait<kDecStages - 2>();  // this thread's copies of stage s have landed
    // Refill the slot consumed in the previous iteration (only this thread reads its slots).
    if (s + kDecStages - 1 < num_stages) {
      issue(s + kDecStages - 1);
    } else {
      CpAsyncCommit();
    }
    const uint4* buf = ring_s + (s % kDecStages) * kStageVecs;
    const int base = key_begin + s * kKeysPerStage + slot;

    float logit[kUnroll][RC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      Piece kp;
#pragma unroll
      for (int e = 0; e < kVecs; ++e)
        kp.raw[e] = buf[((u * 2 + 0) * kVecs + e) * kDecThreads + tid];
      float kf[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) kf[e] = ToFloat(kp.vals[e]);
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot = fmaf(q[r][e], kf[e], dot);
        logit[u][r] = dot;
      }
    }
    // Full logits: sum the partial dots of the key's lane group.
#pragma unroll
    for (int o = kLanesPerKey / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int r = 0; r < RC; ++r) logit[u][r] += __shfl_xor_sync(0xffffffffu, logit[u][r], o);
    }
    // Online softmax of this lane group's keys, then acc = acc * alpha + p v.
    float prob[kUnroll][RC];
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      float m_new = m[r];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * kKeysPerStep >= key_end) logit[u][r] = -INFINITY;
        m_new = fmaxf(m_new, logit[u][r]);
      }
      // Lazy rescaling: m is a reference max that moves only when a key beats it by more than
      // kDecLazyRescale (base 2): p <= 2^8 against it, and the RC x kElems rescale multiplies
      // run a few times per split instead of every stage (v5). Always moves on the first key.
      if (m_new > m[r] + kDecLazyRescale) {
        const float alpha = m[r] == -INFINITY ? 0.f : FastExp2(m[r] - m_new);
        m[r] = m_new;
        l[r] *= alpha;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] *= alpha;
      }
      // m = -inf only while this group has seen no valid key: p = 0 (not exp2(-inf + inf)).
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        prob[u][r] = m[r] == -INFINITY ? 0.f : FastExp2(logit[u][r] - m[r]);
        sum += prob[u][r];
      }
      l[r] += sum;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      Piece vp;
#pragma unroll
      for (int e = 0; e < kVecs; ++e)
        vp.raw[e] = buf[((u * 2 + 1) * kVecs + e) * kDecThreads + tid];
      float vf[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) vf[e] = ToFloat(vp.vals[e]);
#pragma unroll
      for (int r = 0; r < RC; ++r)
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] = fmaf(prob[u][r], vf[e], acc[r][e]);
    }
  }
  CpAsyncWait<0>();

  // Merge the lane groups of the warp (xor over the key-slot bits of the lane).
#pragma unroll
  for (int o = kLanesPerKey; o < 32; o <<= 1) {
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[r], o);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[r], o);
      const float m_new = fmaxf(m[r], m_o);
      const float a_self = m[r] == -INFINITY ? 0.f : FastExp2(m[r] - m_new);
      const float a_o = m_o == -INFINITY ? 0.f : FastExp2(m_o - m_new);
      l[r] = l[r] * a_self + l_o * a_o;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float acc_o = __shfl_xor_sync(0xffffffffu, acc[r][e], o);
        acc[r][e] = acc[r][e] * a_self + acc_o * a_o;
      }
      m[r] = m_new;
    }
  }

  // Merge the 4 warps through shared memory (reusing the ring: every thread is past its loads).
  __syncthreads();
  float* comb = reinterpret_cast<float*>(smem_raw);  // [warps][RC][D + 2]: acc, then m, l
  if (lane < kLanesPerKey) {
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      float* row = comb + (warp * RC + r) * (D + 2);
#pragma unroll
      for (int e = 0; e < kElems; ++e) row[c0 + e] = acc[r][e];
      if (lane == 0) {
        row[D] = m[r];
        row[D + 1] = l[r];
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < RC * D; idx += kDecThreads) {
    const int r = idx / D, c = idx % D;
    float m_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) m_max = fmaxf(m_max, comb[(w * RC + r) * (D + 2) + D]);
    float a = 0.f, l_sum = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float* row = comb + (w * RC + r) * (D + 2);
      const float f = row[D] == -INFINITY ? 0.f : FastExp2(row[D] - m_max);
      a = fmaf(row[c], f, a);
      l_sum = fmaf(row[D + 1], f, l_sum);
    }
    p.part_acc[(part_row0 + r) * D + c] = a;
    if (c == 0) {
      // Base 2 -> natural units for MergeKernel's exp(m - m_max).
      p.part_m[part_row0 + r] = m_max == -INFINITY ? -INFINITY : m_max * 0.69314718055994531f;
      p.part_l[part_row0 + r] = l_sum;
    }
  }
}

}  // namespace dropkv::kernels::cuda
