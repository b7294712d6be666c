// Paged decode attention, split-K (flash-decoding). Raw-pointer device code, no torch.
// - PagedDecodeKernel<T, D, RC> (CUDA cores, every dtype and head_dim): the last CTA of a sequence
//   merges the splits itself (MergeSplitsIfLast), one launch. (A partial kernel followed by a
//   merge launch was 5-8% slower at batch 1 and is deleted; docs/benchmarks.md.)
// - PagedDecodeMmaKernel<T, D, kHigh> (bf16 / fp16, D <= 128): the products on the tensor cores,
//   the merge folded in the same way.
//
// Layout of the CUDA-core kernel's work:
// - a key row of one head is D elements; kLanesPerKey = D / kElems lanes share a key, each
//   holding kElems = 16 (8 when 8 rows) elements; a warp covers 32 / kLanesPerKey keys per step,
//   the 4 warps of the CTA consecutive keys.
// - every thread streams its own 16-byte K and V pieces through a kDecStages-deep cp.async ring
//   in shared memory that only it reads: no barrier in the key loop, several stages of loads in
//   flight per thread (one tile in flight with four barriers per tile was slower).
// - logits: 8-element partial dot products reduced by xor shuffles inside the key's lane group;
//   each lane group keeps its own online-softmax state (m, l, acc over its 8 columns) in
//   registers, exponentials in base 2. The states of the lane groups are merged at the end
//   (shuffles inside a warp, shared memory across the 4 warps).
// - the split's block ids are read once into shared memory (one coalesced load, one barrier).
//
// Programmatic dependent launch (pdl.cuh; both kernels are launched with LaunchMaybePdl): q and the
// cache (the kernel before stores the newest K/V) are read, and anything is written, only after
// PdlWaitForPrimary(); the CTAs release their dependents right after it. Block ids and lengths come
// before the wait when the caller says no kernel of the chain writes them (metadata_before_wait:
// the runner uploads them before the step's first kernel); the tensor-core kernel also starts its
// first K/V copies before it when they hold only keys older than a sequence's last
// (older_keys_before_wait: the kernel before stores just the newest key).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dropkv_score_warp.cuh"  // LdMatrixX4(Trans), Mma16816, PackPair
#include "kernels/cuda/pdl.cuh"

namespace dropkv::kernels::cuda {

constexpr int kDecThreads = 128;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kDecStages = 6;                // cp.async ring depth (5 stages in flight)
constexpr int kDecStageBytesPerThread = 64;  // K + V bytes per thread per stage
constexpr int kDecMaxTableEntries = 4096;    // block ids cached in shared memory per CTA
constexpr float kDecLazyRescale = 8.f;       // base-2 units, see the softmax step
constexpr int kDecMaxRows = 8;               // rows (query heads) per CTA; more go to blockIdx.z

// T: q and out. C: the pool's elements, T or e4m3 (an FP8 cache, kernels/kv_cache_fp8.h: scale
// 1.0, so an element's value is its float conversion).
template <typename T, typename C = T>
struct PagedDecodeParams {
  const T* q;                   // [B, Hkv, g, D] contiguous (= q [B, Hq, D])
  const C* k;                   // pool [num_blocks, block_size, Hkv, D]
  const C* v;                   // pool, same layout
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
  float* part_m;       // [B*Hkv, S, rows_pad], base 2
  float* part_l;       // [B*Hkv, S, rows_pad]
  float* part_acc;     // [B*Hkv, S, rows_pad, D]
  T* out;              // [B, Hq, D] = [B*Hkv, g, D]
  int32_t* counters;   // [B*Hkv, num_chunks] arrival counts, 0 between launches (see below)
  int32_t num_chunks;  // row chunks per KV head (gridDim.z of PagedDecodeKernel, 1 for mma)
  // 1: block_tables and seq_lens are read before PdlWaitForPrimary (no kernel of the launch chain
  // writes them); 0: after it.
  int32_t metadata_before_wait;
  // 1 (tensor-core kernel, with metadata_before_wait): keys before seq_lens[b] - 1 are not written
  // by the kernel queued before; copies of slabs that hold only such keys go out before
  // PdlWaitForPrimary.
  int32_t older_keys_before_wait;
};

// Splits of a sequence that hold keys: ceil(n / split_len), at least 1 (n = 0: split 0 writes
// the zeros), at most the grid's (a length past max_seq_len is cut there). CTAs of
// later splits exit at once and write nothing.
__device__ __forceinline__ int ActiveSplits(int n, int split_len, int num_splits) {
  return n <= split_len ? 1 : min(num_splits, (n + split_len - 1) / split_len);
}

// A split's metadata, as PagedDecodeKernel and PagedDecodeMmaKernel load it: the sequence's length
// (returned) and, when the CTA caches them (table_len > 0), the split's block ids from table_g into
// table_s, read without knowing the length so that those loads overlap its (entries past it are
// never used).
template <typename P>
__device__ __forceinline__ int LoadSplitMetadata(const P& p, int b, int blk0,
                                                 const int32_t* table_g, int32_t* table_s,
                                                 int num_threads) {
  const int n = p.seq_lens[b];
  if (p.table_len > 0) {
    const int avail = min(p.table_len, p.max_blocks - blk0);
    for (int i = threadIdx.x; i < avail; i += num_threads) table_s[i] = table_g[i];
  }
  return n;
}

// The split merge folded into the partial kernel. Called by every thread of each CTA of
// (bh, chunk) whose split holds keys, after it wrote its partial (rows [row0, row0 + rows), m in
// base 2) to part_*. The CTAs count their arrivals on counters[bh, chunk]; the last of the
// num_active resets the count to 0 (so the next launch and every CUDA-graph replay start from
// 0 with no memset) and merges the partials into `out`, always in split order with the same
// arithmetic: which CTA arrives last does not change a bit of the result.
// Ordering: each thread's partial stores, then its fence, then the CTA barrier, then thread 0's
// atomic; the last CTA's thread 0 fences after its atomic and everyone reads the partials from
// L2 (__ldcg), never from a possibly stale L1 line.
// The merge: each thread owns 4 columns of a row and walks the splits in order, kMergeChunk at a
// time with a running max (every load of a chunk is independent: one L2 round trip per chunk; a
// first version computed the split weights in shared memory first, two more round trips and a
// barrier on the critical path of the last CTA). kChunk 16 (the tensor-core kernel: its default
// split counts are <= 16 at batch 1, so one round trip instead of two) needs 96 registers for
// the loads: the CUDA-core kernel's 4-CTA register budget keeps 8.
constexpr int kMergeChunk = 8;
template <typename T, int D, int kThreads, int kChunk = kMergeChunk, typename C = T>
__device__ __forceinline__ void MergeSplitsIfLast(const PagedDecodeParams<T, C>& p, int bh,
                                                  int chunk, int row0, int rows, int num_active) {
  __shared__ int last_s;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.counters + static_cast<int64_t>(bh) * p.num_chunks + chunk;
    const int arrived = atomicAdd(counter, 1);
    const bool last = arrived == num_active - 1;
    if (last) *counter = 0;
    __threadfence();
    last_s = last;
  }
  __syncthreads();
  if (!last_s) return;

  constexpr int kQuads = D / 4;
  const int64_t base = static_cast<int64_t>(bh) * p.num_splits * p.rows_pad + row0;
  T* out = p.out + (static_cast<int64_t>(bh) * p.group + row0) * D;
  for (int idx = threadIdx.x; idx < rows * kQuads; idx += kThreads) {
    const int r = idx / kQuads, c = (idx % kQuads) * 4;
    float m_run = -INFINITY, l_run = 0.f;
    float4 a_run = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < num_active; s0 += kChunk) {
      float m[kChunk], l[kChunk];
      float4 v[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const int64_t i_part = base + static_cast<int64_t>(s0 + i) * p.rows_pad + r;
        const bool ok = s0 + i < num_active;
        m[i] = ok ? __ldcg(p.part_m + i_part) : -INFINITY;
        l[i] = ok ? __ldcg(p.part_l + i_part) : 0.f;
        v[i] = ok ? __ldcg(reinterpret_cast<const float4*>(p.part_acc + i_part * D + c))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float m_new = m_run;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) m_new = fmaxf(m_new, m[i]);
      const float alpha = SoftmaxRescale<ExpBase::k2>(m_run, m_new);
      l_run *= alpha;
      a_run.x *= alpha;
      a_run.y *= alpha;
      a_run.z *= alpha;
      a_run.w *= alpha;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const float f = SoftmaxRescale<ExpBase::k2>(m[i], m_new);
        l_run = fmaf(l[i], f, l_run);
        a_run.x = fmaf(v[i].x, f, a_run.x);
        a_run.y = fmaf(v[i].y, f, a_run.y);
        a_run.z = fmaf(v[i].z, f, a_run.z);
        a_run.w = fmaf(v[i].w, f, a_run.w);
      }
      m_run = m_new;
    }
    const float inv_l = l_run > 0.f ? 1.f / l_run : 0.f;
    T* o = out + r * D + c;
    o[0] = FromFloat<T>(a_run.x * inv_l);
    o[1] = FromFloat<T>(a_run.y * inv_l);
    o[2] = FromFloat<T>(a_run.z * inv_l);
    o[3] = FromFloat<T>(a_run.w * inv_l);
  }
}

// Per-thread work shape. kElems head-dim elements per thread per key: 16 for 1-2 rows (half the
// lanes per key, so the shuffle reduction and the redundant exp of a lane group cost half as much
// per key), else 8: q and acc are RC x kElems registers each, and 4 rows x 16 measured 203
// registers (2 CTAs per SM) against 128 (4 CTAs per SM) with 8. An e4m3 cache (C of one byte)
// always takes 16, one 16-byte copy (its kernel gets 2 CTAs per SM from 4 rows up).
template <typename C, int RC>
struct DecodeShape {
  static constexpr int kElems = RC <= 2 || sizeof(C) == 1 ? 16 : 8;
  static constexpr int kVecs = kElems * sizeof(C) / 16;  // 16-byte copies per row piece
  static constexpr int kUnroll =                         // key steps per stage
      kDecStageBytesPerThread / (2 * 16 * kVecs) > 0 ? kDecStageBytesPerThread / (2 * 16 * kVecs)
                                                     : 1;
  static constexpr int kStageBytes = kUnroll * 2 * kVecs * 16 * kDecThreads;
};

// Shared memory of PagedDecodeKernel<T, D, RC, C> in bytes, without the block-id cache.
template <typename C, int D, int RC>
constexpr int PagedDecodeSmemBytes() {
  constexpr int ring = kDecStages * DecodeShape<C, RC>::kStageBytes;
  constexpr int combine = kDecWarps * RC * (D + 2) * 4;
  return ring > combine ? ring : combine;
}

// grid (B*Hkv, S, ceil(g / RC)), kDecThreads threads. CTA (bh, s, chunk) attends query heads
// [chunk*RC, chunk*RC + RC) of KV head bh % Hkv of sequence bh / Hkv over keys
// [s*split_len, min(n, (s+1)*split_len)) and writes the output itself when the sequence has one
// split, else one partial (m, l, acc) per row and MergeSplitsIfLast.
template <typename T, int D, int RC, typename C = T>
__global__ void __launch_bounds__(kDecThreads, RC <= 2 || (RC <= 4 && sizeof(C) > 1) ? 4 : 2)
    PagedDecodeKernel(const PagedDecodeParams<T, C> p) {
  using Shape = DecodeShape<C, RC>;
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
  constexpr int kTypeVec = 16 / sizeof(C);                       // elements per 16 bytes

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* ring_s = reinterpret_cast<uint4*>(smem_raw);  // [stages][unroll][K|V][vecs][threads]
  int32_t* table_s =
      reinterpret_cast<int32_t*>(smem_raw + PagedDecodeSmemBytes<C, D, RC>());  // [table_len]

  const int bh = blockIdx.x, split = blockIdx.y, chunk = blockIdx.z;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int key_begin = split * p.split_len;
  const int row0 = chunk * RC;
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad + row0;

  // Block ids of the split, once (not one dependent load before each K/V load). The whole range
  // a split can touch is read without knowing n (entries past n are never used), so this load
  // overlaps the length's instead of waiting for it (not a chain length -> ids -> K/V).
  const int blk0 = key_begin / p.block_size;
  const int32_t* table_g = p.block_tables + static_cast<int64_t>(b) * p.max_blocks + blk0;
  const bool cached = p.table_len > 0;  // the host sized the cache for the longest split
  int n = 0;                            // the length's load goes out with the block ids'
  auto load_metadata = [&] { n = LoadSplitMetadata(p, b, blk0, table_g, table_s, kDecThreads); };
  if (p.metadata_before_wait) load_metadata();
  PdlWaitForPrimary();
  PdlLaunchDependents();
  if (!p.metadata_before_wait) load_metadata();

  const int key_end = min(n, key_begin + p.split_len);
  [[maybe_unused]] const int rows = min(RC, p.group - row0);  // query heads of this chunk
  if (key_begin >= key_end) {                                 // empty split (uniform over the CTA)
    // Splits past the sequence write nothing; split 0 of an empty sequence the zeros.
    if (split == 0) {
      T* out = p.out + (static_cast<int64_t>(bh) * p.group + row0) * D;
      for (int idx = tid; idx < rows * D; idx += kDecThreads) out[idx] = FromFloat<T>(0.f);
    }
    return;
  }
  if (cached) __syncthreads();
  const int32_t* table = cached ? table_s : table_g;

  // This thread's key slot in a step and its 8 columns.
  const int slot = warp * kKeysPerWarp + lane / kLanesPerKey;
  const int c0 = (lane % kLanesPerKey) * kElems;
  const C* k_head = p.k + static_cast<int64_t>(h) * D + c0;
  const C* v_head = p.v + static_cast<int64_t>(h) * D + c0;
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
        // division is ~20 instructions, twice per key piece).
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
    C vals[kElems];
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
      // run a few times per split instead of every stage. Always moves on the first key.
      if (const float alpha = MoveSoftmaxReference<ExpBase::k2>(m[r], l[r], m_new, kDecLazyRescale);
          alpha != 1.f) {
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
      const float a_self = SoftmaxRescale<ExpBase::k2>(m[r], m_new);
      const float a_o = SoftmaxRescale<ExpBase::k2>(m_o, m_new);
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
  [[maybe_unused]] const int num_active = ActiveSplits(n, p.split_len, p.num_splits);
  for (int idx = tid; idx < RC * D; idx += kDecThreads) {
    const int r = idx / D, c = idx % D;
    float m_max, l_sum, a;
    MergePartialRows<ExpBase::k2, kDecWarps, D>(comb + r * (D + 2), RC * (D + 2), c, m_max, l_sum,
                                                a);
    if (r < rows) {
      if (num_active == 1) {  // the whole sequence in this CTA: the output directly
        p.out[(static_cast<int64_t>(bh) * p.group + row0 + r) * D + c] =
            FromFloat<T>(l_sum > 0.f ? a / l_sum : 0.f);
      } else {
        p.part_acc[(part_row0 + r) * D + c] = a;
        if (c == 0) {
          p.part_m[part_row0 + r] = m_max;  // base 2, as MergeSplitsIfLast reads it
          p.part_l[part_row0 + r] = l_sum;
        }
      }
    }
  }
  if (num_active > 1) MergeSplitsIfLast<T, D, kDecThreads>(p, bh, chunk, row0, rows, num_active);
}

// ---------------------------------------------------------------------------------------------
// The tensor-core kernel: the products on the tensor cores. The g <= 16 query heads of a KV head
// are the 16 rows of one mma m16 tile (rows past g are zero), so a 16-key slab costs D / 8
// ldmatrix.x4 and D / 4 mma.sync m16n8k16 per warp instead of ~75 warp instructions per key on the
// CUDA cores (their FMAs, lane-group shuffles and the softmax every lane of a group repeats). 4
// warps per CTA. 8 (one CTA per SM at batch 1, each warp half the slabs, twice the bytes in flight
// per SM) measured no faster: 8K 0.460 vs 0.456 ms, 819 keys 0.201 vs 0.194 (2026-12-01, graphs of
// 32 layers): the stream runs near the copy rate already; the time above it is the per-launch fixed
// part (prologue, the merge's fence / atomic / L2 reads, the tail).
constexpr int kDecMmaWarps = 4;
constexpr int kDecMmaThreads = 32 * kDecMmaWarps;
// Ring slabs per warp: 2 in flight while one is used. 4 (a 143 KB CTA, one per SM) measured the
// same at the best split count and slower at 2 CTAs per SM (2026-12-01).
constexpr int kDecMmaStages = 3;

// Shared memory of PagedDecodeMmaKernel<T, D, kHigh, C> in bytes, without the block-id cache: Q
// rows, then the warps' rings (reused by the warp merge at the end). An e4m3 cache: per warp one
// T slab that the tensor cores read, then its ring of e4m3 slabs (2 x 16 rows of D bytes).
template <typename T, int D, typename C = T>
constexpr int PagedDecodeMmaSmemBytes() {
  constexpr int q = 16 * (D + kTcPad) * 2;
  constexpr int slab = 2 * kSlabKeys * (D + kTcPad) * 2;
  constexpr int ring = sizeof(C) == 1 ? kDecMmaWarps * (slab + kDecMmaStages * 2 * kSlabKeys * D)
                                      : kDecMmaWarps * kDecMmaStages * slab;
  constexpr int merge = kDecMmaWarps * 16 * (D + 2) * 4;
  return q + (ring > merge ? ring : merge);
}

// grid (B*Hkv, S), kDecMmaThreads threads, bf16 / fp16, D 64 or 128 (the accumulators of the 16
// rows stay in registers: D / 2 floats per lane). CTA (bh, s) attends the g query heads of KV
// head bh % Hkv of sequence bh / Hkv over keys [s split_len, min(n, (s + 1) split_len)); warp w
// streams the split's 16-key slabs w, w + 4, ... through its own cp.async ring (no CTA barrier
// in the key loop) and keeps its own online softmax (base 2, lazy rescaling as above) on the
// accumulator fragments: S = Q K^T with the rows as M and the keys as N, P rounded to the model
// dtype and repacked from the C fragments into A fragments in registers, acc += P V with V^T
// through ldmatrix.trans. kHigh: g > 8, rows 8..15 of the tile hold query heads too (else their
// softmax is skipped and their P is 0). The 4 warps merge through shared memory; then the split
// merge as above (the output directly when the sequence has one split).
// C = e4m3 (an FP8 cache): the ring holds the e4m3 bytes (half the copies); after a slab lands,
// each lane converts the pieces it copied into the warp's slab (E4m3x16To), a __syncwarp, and the
// tensor cores read that slab as they read a bf16 / fp16 one. The products are then fp16 (M)
// whatever T is: e4m3 -> fp16 is one cvt per pair (bf16 took four: the conversion, not the bytes,
// bounded the kernel), every e4m3 value and every bf16 query in [2^-14, 65504] is an fp16 value
// (queries are clamped there), and P rounds to fp16's 11 bits instead of bf16's 8.
template <typename T, int D, bool kHigh, typename C = T>
__global__ void __launch_bounds__(kDecMmaThreads, 3)
    PagedDecodeMmaKernel(const PagedDecodeParams<T, C> p) {
  constexpr int kWarps = kDecMmaWarps;
  constexpr int kThreads = kDecMmaThreads;
  constexpr int kStages = kDecMmaStages;
  constexpr int kLd = D + kTcPad;                  // row stride in elements: conflict-free ldmatrix
  constexpr int kSlabElems = 2 * kSlabKeys * kLd;  // K rows, then V rows
  constexpr bool kFp8 = sizeof(C) == 1;
  constexpr int kVecsPerRow = D / 8;                    // 16-byte pieces of a T row (Q)
  constexpr int kCacheVecsPerRow = D * sizeof(C) / 16;  // 16-byte pieces of a cached key row
  constexpr int kKeysPerCopy = 32 / kCacheVecsPerRow;   // keys one warp-wide cp.async covers
  constexpr int kCopies = kSlabKeys / kKeysPerCopy;     // per lane per slab, K and V each
  constexpr int kRingLd = kFp8 ? D : kLd;               // ring row stride in cache elements
  constexpr int kRingSlabElems = 2 * kSlabKeys * kRingLd;
  constexpr int kNd = D / 8;  // accumulator n-tiles
  constexpr int kHalves = kHigh ? 2 : 1;
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "bf16 / fp16, head_dim 64 or 128");
  using M = std::conditional_t<kFp8, __half, T>;  // the tensor cores' operand type
  extern __shared__ __align__(128) unsigned char smem_raw[];
  M* q_s = reinterpret_cast<M*>(smem_raw);              // [16, kLd]
  M* ring_all = q_s + 16 * kLd;                         // [warps][stages][kSlabElems]
  float* merge_s = reinterpret_cast<float*>(ring_all);  // after the loop: [warps][16][D + 2]
  int32_t* table_s =
      reinterpret_cast<int32_t*>(smem_raw + PagedDecodeMmaSmemBytes<T, D, C>());  // [table_len]

  const int bh = blockIdx.x, split = blockIdx.y;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = p.group;
  const int key_begin = split * p.split_len;
  const int blk0 = key_begin / p.block_size;
  const int32_t* table_g = p.block_tables + static_cast<int64_t>(b) * p.max_blocks + blk0;
  const bool cached = p.table_len > 0;
  int n = 0;  // the length's load goes out with the block ids'
  auto load_metadata = [&] { n = LoadSplitMetadata(p, b, blk0, table_g, table_s, kThreads); };
  const bool early = p.metadata_before_wait;
  if (early) {
    load_metadata();
    __syncthreads();  // table_s, for the copies below
  }
  int key_end = min(n, key_begin + p.split_len);  // set again after the wait when !early
  int num_slabs = (key_end - key_begin + kSlabKeys - 1) / kSlabKeys;
  const int32_t* table = cached ? table_s : table_g;

  // Copies: lane l moves the 16-byte piece l % kVecsPerRow of keys l / kVecsPerRow + i
  // kKeysPerCopy (each warp-wide copy covers whole rows: coalesced). Lane j < 16 looks up the
  // slot of key j of the slab once; the copies take it by shuffle. Slots fit in 32 bits: a pool
  // of 2^32 slots would not fit in device memory.
  // T: the warp's ring of kStages T slabs. e4m3: `ring` is the warp's one fp16 slab and `ring8` its
  // ring of e4m3 slabs.
  M* ring = ring_all + warp * (kFp8 ? 1 : kStages) * kSlabElems;
  C* ring8 = reinterpret_cast<C*>(ring_all + kWarps * kSlabElems) + warp * kStages * kRingSlabElems;
  const int c_lane = (lane % kCacheVecsPerRow) * (16 / static_cast<int>(sizeof(C)));
  const int key_lane = lane / kCacheVecsPerRow;
  const C* k_head = p.k + static_cast<int64_t>(h) * D + c_lane;
  const C* v_head = p.v + static_cast<int64_t>(h) * D + c_lane;
  auto issue = [&](int slab, int stage) {
    C* dst;
    if constexpr (kFp8) {
      dst = ring8 + stage * kRingSlabElems;
    } else {
      dst = ring + stage * kSlabElems;
    }
    const int key0 = key_begin + slab * kSlabKeys;
    const int j_own = key0 + lane % kSlabKeys;
    uint32_t slot_own = 0;
    if (j_own < key_end) {
      const int rel = j_own - blk0 * p.block_size;
      const int blk_idx = p.block_shift >= 0 ? rel >> p.block_shift : rel / p.block_size;
      const int in_blk = p.block_shift >= 0 ? rel & (p.block_size - 1) : rel % p.block_size;
      slot_own = static_cast<uint32_t>(table[blk_idx]) * static_cast<uint32_t>(p.block_size) +
                 static_cast<uint32_t>(in_blk);
    }
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int j = key_lane + i * kKeysPerCopy;
      const uint32_t slot = __shfl_sync(0xffffffffu, slot_own, j);
      const bool valid = key0 + j < key_end;
      const int64_t off = static_cast<int64_t>(slot) * p.stride_slot;
      CpAsync16(dst + j * kRingLd + c_lane, k_head + off, valid);
      CpAsync16(dst + (kSlabKeys + j) * kRingLd + c_lane, v_head + off, valid);
    }
  };
  int slab = warp;
  auto issue_prologue = [&] {  // slabs warp, warp + 4, ...: stages 0 .. kStages - 2
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (slab + s * kWarps < num_slabs) issue(slab + s * kWarps, s);
      CpAsyncCommit();
    }
  };
  // This warp's prologue before the wait when its slabs end before the newest key (warp-uniform).
  const int prologue_end = key_begin + (warp + (kStages - 2) * kWarps + 1) * kSlabKeys;
  const bool kv_early = early && p.older_keys_before_wait && key_begin < key_end &&
                        min(key_end, prologue_end) <= n - 1;
  if (kv_early) issue_prologue();

  PdlWaitForPrimary();
  PdlLaunchDependents();
  if (!early) {
    load_metadata();
    key_end = min(n, key_begin + p.split_len);
    num_slabs = (key_end - key_begin + kSlabKeys - 1) / kSlabKeys;
  }
  if (key_begin >= key_end) {  // uniform over the CTA
    if (split == 0) {          // an empty sequence: zeros
      T* out = p.out + static_cast<int64_t>(bh) * g * D;
      for (int idx = tid; idx < g * D; idx += kThreads) out[idx] = FromFloat<T>(0.f);
    }
    return;
  }
  if (!early) __syncthreads();  // table_s
  // Q rows into q_s (rows past g zero-filled): a cp.async group whose round trip overlaps the K/V
  // prologue's instead of preceding it.
  const T* q_head = p.q + static_cast<int64_t>(bh) * g * D;
  for (int idx = tid; idx < 16 * kVecsPerRow; idx += kThreads) {
    const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * 8;
    if constexpr (std::is_same_v<M, T>) {
      CpAsync16(q_s + r * kLd + c, q_head + (r < g ? r * D + c : 0), r < g);
    } else {  // bf16 queries as fp16 for an e4m3 cache (see above), stored by this thread
      union {
        uint4 raw;
        M vals[8];
      } out;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = r < g ? ToFloat(q_head[r * D + c + e]) : 0.f;
        out.vals[e] = FromFloat<M>(fminf(fmaxf(x, -65504.f), 65504.f));
      }
      *reinterpret_cast<uint4*>(q_s + r * kLd + c) = out.raw;
    }
  }
  CpAsyncCommit();
  if (!kv_early) {
    issue_prologue();
    CpAsyncWait<kStages - 1>();  // Q (the oldest group) has landed; the slabs may not have
  } else {
    CpAsyncWait<0>();  // Q is the newest group; the slabs went out before the wait
  }
  __syncthreads();  // every thread's Q copies

  // ldmatrix row addresses of this lane: A (Q rows x d), B (keys x d), V^T (keys x d, .trans).
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_key = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  const int vt_key = (lane % 8) + ((lane / 8) % 2) * 8, vt_col = (lane / 16) * 8;
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) LdMatrixX4(qa[kk], q_s + a_row * kLd + kk * 16 + a_col);

  float acc[kNd][4];
  float m_row[2], l_part[2];  // rows lane / 4 (+ 8); l: this lane's share of the row sum
#pragma unroll
  for (int nd = 0; nd < kNd; ++nd)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nd][i] = 0.f;
  m_row[0] = m_row[1] = -INFINITY;
  l_part[0] = l_part[1] = 0.f;

  for (int stage = 0, fill = kStages - 1; slab < num_slabs; slab += kWarps) {
    const int ahead = slab + (kStages - 1) * kWarps;
    if (ahead < num_slabs) issue(ahead, fill);
    CpAsyncCommit();
    CpAsyncWait<kStages - 1>();  // this lane's copies of `stage` have landed
    if constexpr (kFp8) {
      // This lane's own pieces (landed: no barrier needed to read them) into the fp16 slab, whose
      // previous contents every lane finished reading at the loop's last __syncwarp.
      const C* src = ring8 + stage * kRingSlabElems;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int j = key_lane + i * kKeysPerCopy;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
          const int row = kv * kSlabKeys + j;
          uint4 wide[2];
          E4m3x16To<M>(*reinterpret_cast<const uint4*>(src + row * kRingLd + c_lane), wide);
          *reinterpret_cast<uint4*>(ring + row * kLd + c_lane) = wide[0];
          *reinterpret_cast<uint4*>(ring + row * kLd + c_lane + 8) = wide[1];
        }
      }
    }
    __syncwarp();  // every other lane's copies (T) or conversions (e4m3)
    const M* k_s = kFp8 ? ring : ring + stage * kSlabElems;
    const M* v_s = k_s + kSlabKeys * kLd;
    const int key0 = key_begin + slab * kSlabKeys;

    float sc[2][2][4];  // [chain (even / odd k-step)][key n-tile][fragment]
#pragma unroll
    for (int ch = 0; ch < 2; ++ch)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[ch][nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t kb[4];
      LdMatrixX4(kb, k_s + b_key * kLd + kk * 16 + b_col);
      Mma16816<M>(sc[kk % 2][0], qa[kk], kb[0], kb[1]);
      Mma16816<M>(sc[kk % 2][1], qa[kk], kb[2], kb[3]);
    }
    uint32_t pa[4] = {0u, 0u, 0u, 0u};  // P as A fragments: {nt0 row, nt0 row + 8, nt1 row, ..}
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      float sv[2][2];
      float tile_max = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = half * 2 + e;
          const int j = key0 + nt * 8 + 2 * (lane % 4) + e;
          const float logit = (sc[0][nt][i] + sc[1][nt][i]) * p.scale_log2;
          sv[nt][e] = j < key_end ? logit : -INFINITY;
          tile_max = fmaxf(tile_max, sv[nt][e]);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // Lazy rescaling (quad-uniform): the reference max moves only when a key beats it by more
      // than kDecLazyRescale; always on the first slab (every slab holds a valid key).
      if (const float alpha = MoveSoftmaxReference<ExpBase::k2>(m_row[half], l_part[half], tile_max,
                                                                kDecLazyRescale);
          alpha != 1.f) {
#pragma unroll
        for (int nd = 0; nd < kNd; ++nd) {
          acc[nd][half * 2] *= alpha;
          acc[nd][half * 2 + 1] *= alpha;
        }
      }
      float sum = 0.f;
      M pt[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float prob = SoftmaxProb<ExpBase::k2>(sv[nt][e], m_row[half]);
          pt[nt][e] = FromFloat<M>(prob);
          sum += ToFloat(pt[nt][e]);  // l sums the rounded p that P V uses
        }
      }
      l_part[half] += sum;
      pa[half] = PackPair(pt[0][0], pt[0][1]);
      pa[2 + half] = PackPair(pt[1][0], pt[1][1]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {  // acc[:, 16 dp : 16 dp + 16] += P V
      uint32_t vb[4];
      LdMatrixX4Trans(vb, v_s + vt_key * kLd + dp * 16 + vt_col);
      Mma16816<M>(acc[2 * dp], pa, vb[0], vb[1]);
      Mma16816<M>(acc[2 * dp + 1], pa, vb[2], vb[3]);
    }
    __syncwarp();  // every lane is done with `stage` before it is refilled
    stage = stage + 1 == kStages ? 0 : stage + 1;
    fill = fill + 1 == kStages ? 0 : fill + 1;
  }
  CpAsyncWait<0>();
  __syncthreads();  // every warp is done with its ring: the merge area reuses it

  // Per warp: rows [16][D + 2] = acc columns, then m, l (l summed over the quad).
  float* mine = merge_s + warp * 16 * (D + 2);
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    const int r = lane / 4 + 8 * half;
    float l = l_part[half];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
    for (int nd = 0; nd < kNd; ++nd) {
      const int c = nd * 8 + 2 * (lane % 4);
      mine[r * (D + 2) + c] = acc[nd][half * 2];
      mine[r * (D + 2) + c + 1] = acc[nd][half * 2 + 1];
    }
    if (lane % 4 == 0) {
      mine[r * (D + 2) + D] = m_row[half];
      mine[r * (D + 2) + D + 1] = l;
    }
  }
  __syncthreads();
  const int num_active = ActiveSplits(n, p.split_len, p.num_splits);
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad;
  for (int idx = tid; idx < g * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    float m_max, l, a;
    MergePartialRows<ExpBase::k2, kWarps, D>(merge_s + r * (D + 2), 16 * (D + 2), c, m_max, l, a);
    if (num_active == 1) {  // the whole sequence in this CTA: the output directly
      p.out[(static_cast<int64_t>(bh) * g + r) * D + c] = FromFloat<T>(l > 0.f ? a / l : 0.f);
    } else {
      p.part_acc[(part_row0 + r) * D + c] = a;
      if (c == 0) {
        p.part_m[part_row0 + r] = m_max;
        p.part_l[part_row0 + r] = l;
      }
    }
  }
  if (num_active > 1) {
    MergeSplitsIfLast<T, D, kThreads, 16>(p, bh, 0, 0, g, num_active);
  }
}

}  // namespace dropkv::kernels::cuda
