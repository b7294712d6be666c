// Pass 3 of the fused DropKV scoring for bf16 / fp16 inputs without CTA barriers in the key
// loop: every warp streams its own 16-key slabs of K and V through a private cp.async ring and
// scores them with mma.sync m16n8k16 (fp32 accumulation), whose documented fragment layouts let
// the epilogue work on the accumulator registers directly (wmma's are opaque: the CTA-tiled
// kernel of dropkv_score_tc.cuh stores them to shared memory and synchronises the CTA on every
// 64-key tile). Raw-pointer device code, no torch.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dropkv_score_kernels.cuh"
#include "kernels/cuda/dropkv_score_tc.cuh"

namespace dropkv::kernels::cuda {

constexpr int kSlabKeys = 16;  // keys per warp slab: two mma n-tiles of 8
// Warps per CTA of the warp-streaming pass 1 (and of pass 3 where its rings leave room for 4
// only); the warps of a CTA share only the Q / a rows.
constexpr int kScoreWarpWarps = 4;
constexpr int kScoreWarpThreads = 32 * kScoreWarpWarps;
constexpr int kScoreWarpMaxRows = 64;  // packed rows per KV head (g * W) this kernel takes

// Ring stages per warp: 2 slabs in flight while one is scored (D <= 128: 3 x 8.5 KB per warp).
template <int D>
constexpr int ScoreWarpStages() {
  return D <= 128 ? 3 : 2;
}

// m-tiles of 16 packed rows: 1, 2 or 4 (rows_pad 48 is padded to 64 with masked rows).
constexpr int ScoreWarpMTiles(int rows_pad) {
  return rows_pad <= 16 ? 1 : rows_pad <= 32 ? 2 : 4;
}

// Warps per CTA of pass 3: 12 (one CTA of 221 KB per SM: 12 rings of 2 slabs and the rows) where
// that fits, else 4. 4 warps of 122 KB per CTA measured one CTA and one warp per
// scheduler per SM: 3.4 cycles per issued instruction, 49% of the DRAM bandwidth; 8 warps with
// 3-slab rings 69% of DRAM, 4.4 cycles per issued instruction.
template <int D, int kMTiles>
constexpr int ScoreWarpCtaWarps() {
  return D <= 128 && kMTiles <= 2 ? 12 : 4;
}
// Ring stages per warp of pass 3: one slab in flight while one is scored where 12 warps run
// (a slab's scoring, ~700 instructions per lane, outlasts the DRAM latency), else
// ScoreWarpStages.
template <int D, int kMTiles>
constexpr int ScoreWarpPass3Stages() {
  return D <= 128 && kMTiles <= 2 ? 2 : ScoreWarpStages<D>();
}

template <typename T, int D, int kMTiles>
constexpr int ScoreWarpSmemBytes() {
  return 2 * 16 * kMTiles * (D + kTcPad) * 2  // Q, a rows (T)
         + 3 * 16 * kMTiles * 4               // lse, ||a||^2, pos
         + ScoreWarpCtaWarps<D, kMTiles>() * ScoreWarpPass3Stages<D, kMTiles>() * 2 * kSlabKeys *
               (D + kTcPad) * 2;  // rings
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a b: a 16x16 (row-major fragment), b 16x8 (column fragment), fp32 accumulators.
// Fragment layouts (PTX ISA, mma.m16n8k16): lane l holds d[0..1] at row l / 4, columns
// 2 (l % 4) + {0, 1}, and d[2..3] at row l / 4 + 8, the same columns.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Pass 3, warp-streaming. grid (B*Hkv, CTAs per head), 32 kWarps threads, persistent: warp w of
// CTA (bh, y) scores the 16-key slabs y kWarps + w, + gridDim.y kWarps, ... of its head.
// The CTA loads the head's packed rows once (Q, a rounded to the model dtype, lse, ||a||^2 of the
// rounded a, positions; one barrier), then each warp runs alone: a ring of ScoreWarpPass3Stages
// slabs (K and V, cp.async, zero-filled past n) that only it fills and reads, __syncwarp only. Per
// slab and group of two m-tiles: S = Q K^T and <a, v> = A V^T by mma.sync, with rows as M and keys
// as N as in pass 1, and the same even / odd 16-column chains added at the end, so the logits equal
// pass 1's bit for bit (wmma m16n16k16 issues the same m16n8k16 products). Epilogue in registers:
// lane l owns keys 2 (l % 4) + {0, 1} (+ 8) and rows l / 4 (+ 8, + 16,
// ...) of the C fragments; p = exp(logit - lse), w = (p / (1 - p + eps))^2, d2 = ||v||^2 -
// 2 <a, v> + ||a||^2; the rows of a key are summed in the lane, then over the 8 lanes sharing the
// key by xor shuffles, and lanes 0-3 write the 16 scores / g.
template <typename T, int D, int kMTiles>
__global__ void __launch_bounds__(32 * ScoreWarpCtaWarps<D, kMTiles>(), 1)
    ScoreWarpKernel(const ScoreParams p) {
  constexpr int kWarps = ScoreWarpCtaWarps<D, kMTiles>();
  constexpr int kThreadsCta = 32 * kWarps;
  constexpr int kLd = D + kTcPad;  // row stride in elements: 16-byte pad, conflict-free ldmatrix
  constexpr int kRows = 16 * kMTiles;
  constexpr int kStages = ScoreWarpPass3Stages<D, kMTiles>();
  constexpr int kSlabElems = 2 * kSlabKeys * kLd;  // K rows then V rows
  constexpr int kMG = kMTiles < 2 ? kMTiles : 2;   // m-tiles per accumulator group
  constexpr int kVec = 8;                          // elements per 16-byte vector
  static_assert(sizeof(T) == 2, "bf16 / fp16 only");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);                     // [kRows, kLd]
  T* a_s = q_s + kRows * kLd;                                  // [kRows, kLd]
  float* lse_s = reinterpret_cast<float*>(a_s + kRows * kLd);  // [kRows]
  float* an2_s = lse_s + kRows;                                // [kRows]
  int* pos_s = reinterpret_cast<int*>(an2_s + kRows);          // [kRows]
  T* ring_all = reinterpret_cast<T*>(pos_s + kRows);           // [warps][kStages][kSlabElems]

  const int bh = blockIdx.x;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int num_slabs = (n + kSlabKeys - 1) / kSlabKeys;
  if (static_cast<int>(blockIdx.y) * kWarps >= num_slabs) return;  // CTA-uniform
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_all = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * p.num_rows * D;
  const float* a_all = p.a + static_cast<int64_t>(bh) * p.a_rows * D;

  // The head's rows; rows >= num_rows are zero with pos -1 (masked).
  for (int idx = tid; idx < kRows * (D / kVec); idx += kThreadsCta) {
    const int r = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < p.num_rows) val = *reinterpret_cast<const uint4*>(q_all + r * D + c);
    *reinterpret_cast<uint4*>(q_s + r * kLd + c) = val;
  }
  for (int idx = tid; idx < kRows * D; idx += kThreadsCta) {
    const int r = idx / D, c = idx % D;
    a_s[r * kLd + c] = FromFloat<T>(r < p.num_rows ? a_all[static_cast<int64_t>(r) * D + c] : 0.f);
  }
  if (tid < kRows) {
    const int pos = n - p.window + tid % p.window;
    const bool ok = tid < p.num_rows && pos >= p.min_pos;
    pos_s[tid] = ok ? pos : -1;
    // +inf for rows that score nothing: p = 0 there without a mask (the unmasked fast path).
    lse_s[tid] = ok ? p.lse[static_cast<int64_t>(bh) * p.a_rows + tid] : INFINITY;
  }
  __syncthreads();
  for (int r = warp; r < kRows; r += kWarps) {  // ||a||^2 of the rounded a
    float s = 0.f;
#pragma unroll
    for (int c = lane; c < D; c += 32) {
      const float x = ToFloat(a_s[r * kLd + c]);
      s = fmaf(x, x, s);
    }
    s = WarpSum(s);
    if (lane == 0) an2_s[r] = s;
  }
  __syncthreads();
  // This lane's rows: mt * 16 + lane / 4 + 8 half.
  float lse2_r[kMTiles][2], an2_r[kMTiles][2];  // lse2 = lse log2(e)
  int pos_r[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + lane / 4 + 8 * half;
      lse2_r[mt][half] = lse_s[r] * 1.4426950408889634f;
      an2_r[mt][half] = an2_s[r];
      pos_r[mt][half] = pos_s[r];
    }
  }

  T* ring = ring_all + warp * kStages * kSlabElems;
  const T* k_head = static_cast<const T*>(p.k) + p.kv_offset[b] + h * p.stride_head;
  const T* v_head = static_cast<const T*>(p.v) + p.kv_offset[b] + h * p.stride_head;
  const int slab_stride = gridDim.y * kWarps;
  auto issue = [&](int slab, int stage) {  // one commit group per call
    T* dst = ring + stage * kSlabElems;
    const int key0 = slab * kSlabKeys;
#pragma unroll
    for (int i = 0; i < kSlabKeys * (D / kVec) / 32; ++i) {
      const int idx = lane + 32 * i;
      const int j = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
      const bool valid = key0 + j < n;
      const int64_t off = valid ? static_cast<int64_t>(key0 + j) * p.stride_tok + c : 0;
      CpAsync16(dst + j * kLd + c, k_head + off, valid);
      CpAsync16(dst + (kSlabKeys + j) * kLd + c, v_head + off, valid);
    }
  };
  int slab = blockIdx.y * kWarps + warp;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (slab + s * slab_stride < num_slabs) issue(slab + s * slab_stride, s);
    CpAsyncCommit();  // empty groups too: the wait below counts uniformly
  }
  // ldmatrix row addresses of this lane: A (rows x d) and B (keys x d) operands.
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_key = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  const float scale2 = p.scale * 1.4426950408889634f, eps = p.eps;
  for (int stage = 0, fill = kStages - 1; slab < num_slabs; slab += slab_stride) {
    const int ahead = slab + (kStages - 1) * slab_stride;
    if (ahead < num_slabs) issue(ahead, fill);
    CpAsyncCommit();
    CpAsyncWait<kStages - 1>();  // this lane's copies of `slab` landed
    __syncwarp();                // ... and every lane's
    const T* k_s = ring + stage * kSlabElems;
    const T* v_s = k_s + kSlabKeys * kLd;
    const int key0 = slab * kSlabKeys;

    float score[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [n-tile][e]: key 8 nt + 2 (lane % 4) + e
    float vn2_k[2][2];                             // ||v||^2 of the same keys
    // Slabs before the window's first key need no causal mask (rows with pos -1 have lse +inf).
    const bool masked = key0 + kSlabKeys > n - p.window;
#pragma unroll
    for (int mg = 0; mg < kMTiles; mg += kMG) {
      // [chain][m-tile][n-tile][4]: chain 0 sums the even 16-column blocks, chain 1 the odd.
      float s_acc[2][kMG][2][4], av_acc[2][kMG][2][4];
      float gram[2][4];  // V V^T of the slab (first group only): its diagonal is ||v_j||^2
#pragma unroll
      for (int ch = 0; ch < 2; ++ch)
#pragma unroll
        for (int mt = 0; mt < kMG; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) s_acc[ch][mt][nt][i] = av_acc[ch][mt][nt][i] = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) gram[nt][i] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int ch = kk % 2;
        uint32_t kb[4], vb[4];  // n-tile 0: {0, 1}, n-tile 1: {2, 3}
        LdMatrixX4(kb, k_s + b_key * kLd + kk * 16 + b_col);
        LdMatrixX4(vb, v_s + b_key * kLd + kk * 16 + b_col);
        if (mg == 0) {  // ||v||^2 on the tensor cores: 8 ldmatrix + 16 mma per slab instead of
                        // ~130 loads, conversions and FMAs per lane
          uint32_t va[4];
          LdMatrixX4(va, v_s + a_row * kLd + kk * 16 + a_col);
          Mma16816<T>(gram[0], va, vb[0], vb[1]);
          Mma16816<T>(gram[1], va, vb[2], vb[3]);
        }
#pragma unroll
        for (int mt = 0; mt < kMG; ++mt) {
          const int row = (mg + mt) * 16 + a_row;
          uint32_t qa[4], aa[4];
          LdMatrixX4(qa, q_s + row * kLd + kk * 16 + a_col);
          LdMatrixX4(aa, a_s + row * kLd + kk * 16 + a_col);
          Mma16816<T>(s_acc[ch][mt][0], qa, kb[0], kb[1]);
          Mma16816<T>(s_acc[ch][mt][1], qa, kb[2], kb[3]);
          Mma16816<T>(av_acc[ch][mt][0], aa, vb[0], vb[1]);
          Mma16816<T>(av_acc[ch][mt][1], aa, vb[2], vb[3]);
        }
      }
      if (mg == 0) {
        // gram[nt] is the C fragment of keys (rows) 0-15 x keys (cols) 8 nt .. + 7: diagonal key
        // i (< 8 in n-tile 0, >= 8 in n-tile 1 with i' = i - 8) sits in lane 4 i' + i' / 2,
        // element (i' % 2) of the row half (0 for n-tile 0, 1 for n-tile 1).
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * (lane % 4) + e, src = 4 * i + i / 2;
          vn2_k[0][e] = __shfl_sync(0xffffffffu, gram[0][e], src);
          vn2_k[1][e] = __shfl_sync(0xffffffffu, gram[1][2 + e], src);
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMG; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pos = pos_r[mg + mt][half];
          const float lse2 = lse2_r[mg + mt][half], an2 = an2_r[mg + mt][half];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = half * 2 + e;
              const int j = key0 + nt * 8 + 2 * (lane % 4) + e;
              const float logit = s_acc[0][mt][nt][i] + s_acc[1][mt][nt][i];
              const float av = av_acc[0][mt][nt][i] + av_acc[1][mt][nt][i];
              // p = exp(scale logit - lse) = 2^(logit scale log2(e) - lse log2(e)).
              float prob = FastExp2(fmaf(logit, scale2, -lse2));
              if (p.round_mode == 1) prob = __bfloat162float(__float2bfloat16_rn(prob));
              if (p.round_mode == 2) prob = __half2float(__float2half_rn(prob));
              const float w = __fdividef(prob, 1.f - prob + eps);
              const float d2 = fmaxf(vn2_k[nt][e] - 2.f * av + an2, 0.f);
              const float add = fmaf(w * w, d2, score[nt][e]);
              // Select, not multiply: masked entries may hold inf / NaN (keys past n).
              score[nt][e] = !masked || j <= pos ? add : score[nt][e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
          score[nt][e] += __shfl_xor_sync(0xffffffffu, score[nt][e], o);
        const int j = key0 + nt * 8 + 2 * lane + e;
        if (lane < 4 && j < n) {
          p.out[p.out_offset[b] + h * p.out_stride_head + j] = score[nt][e] / p.group;
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    stage = stage + 1 == kStages ? 0 : stage + 1;
    fill = fill + 1 == kStages ? 0 : fill + 1;
  }
  CpAsyncWait<0>();
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem_row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ uint32_t PackPair(T lo, T hi) {
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

constexpr int kAttnWarpMaxRows = 32;  // packed rows per KV head of the warp pass 1 (registers)

template <typename T, int D>
constexpr int PartialAttnWarpSmemBytes() {
  constexpr int ring = kScoreWarpWarps * ScoreWarpStages<D>() * 2 * kSlabKeys * (D + kTcPad) * 2;
  constexpr int merge = kScoreWarpWarps * kAttnWarpMaxRows * (D + 2) * 4;  // reuses the rings
  return kAttnWarpMaxRows * (D + kTcPad) * 2 + 4 * kAttnWarpMaxRows        // Q rows, positions
         + (ring > merge ? ring : merge);
}

// Pass 1, warp-streaming, for g * W <= 32 packed rows and D <= 128 (the accumulators of
// all rows stay in registers: 16 D / 32 floats per lane and m-tile). grid (splits, B*Hkv),
// kScoreWarpThreads threads: CTA (s, bh) is split s; its warp w streams the 16-key slabs
// s * 4 + w, + splits * 4, ... through a private cp.async ring (as ScoreWarpKernel) and keeps its
// own online softmax (FlashAttention-2 style: S = Q K^T by mma.sync with pass 3's chains, the
// row max over the 4 lanes of a quad, P rounded to the model dtype and repacked from the C
// fragments into A fragments in registers, acc += P V with V^T through ldmatrix.trans; lazy
// rescaling as PartialAttnTcKernel). No barrier in the key loop; at the end the 4 warps' (m, l,
// acc) merge through shared memory into the split's partial (the CTA-tiled kernel synchronises the
// CTA four times per 64-key tile).
template <typename T, int D, int kMTiles>
__global__ void __launch_bounds__(kScoreWarpThreads, 2)
    PartialAttnWarpKernel(const PartialAttnParams<T> p) {
  constexpr int kLd = D + kTcPad;
  constexpr int kRows = 16 * kMTiles;
  constexpr int kStages = ScoreWarpStages<D>();
  constexpr int kSlabElems = 2 * kSlabKeys * kLd;
  constexpr int kVec = 8;
  constexpr int kNd = D / 8;  // accumulator n-tiles
  static_assert(sizeof(T) == 2 && kRows <= kAttnWarpMaxRows && D <= 128, "register budget");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);                            // [kAttnWarpMaxRows, kLd]
  int* pos_s = reinterpret_cast<int*>(q_s + kAttnWarpMaxRows * kLd);  // [kAttnWarpMaxRows]
  T* ring_all = reinterpret_cast<T*>(pos_s + kAttnWarpMaxRows);       // [warps][kStages][..]
  float* merge_s = reinterpret_cast<float*>(ring_all);  // after the loop: [warps][rows][D + 2]

  const int split = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int num_slabs = (n + kSlabKeys - 1) / kSlabKeys;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_all = p.q + static_cast<int64_t>(bh) * p.num_rows * D;
  for (int idx = tid; idx < kRows * (D / kVec); idx += kScoreWarpThreads) {
    const int r = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < p.num_rows) val = *reinterpret_cast<const uint4*>(q_all + r * D + c);
    *reinterpret_cast<uint4*>(q_s + r * kLd + c) = val;
  }
  if (tid < kRows) {
    const int pos = n - p.window + tid % p.window;
    pos_s[tid] = tid < p.num_rows && pos >= p.min_pos ? pos : -1;
  }
  __syncthreads();
  int pos_r[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    pos_r[mt][0] = pos_s[mt * 16 + lane / 4];
    pos_r[mt][1] = pos_s[mt * 16 + lane / 4 + 8];
  }

  T* ring = ring_all + warp * kStages * kSlabElems;
  const T* k_head = p.k + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;
  const T* v_head = p.v + p.kv_offset[b] + static_cast<int64_t>(h) * p.stride_head;
  const int slab_stride = gridDim.x * kScoreWarpWarps;
  auto issue = [&](int slab, int stage) {
    T* dst = ring + stage * kSlabElems;
    const int key0 = slab * kSlabKeys;
#pragma unroll
    for (int i = 0; i < kSlabKeys * (D / kVec) / 32; ++i) {
      const int idx = lane + 32 * i;
      const int j = idx / (D / kVec), c = (idx % (D / kVec)) * kVec;
      const bool valid = key0 + j < n;
      const int64_t off = valid ? static_cast<int64_t>(key0 + j) * p.stride_tok + c : 0;
      CpAsync16(dst + j * kLd + c, k_head + off, valid);
      CpAsync16(dst + (kSlabKeys + j) * kLd + c, v_head + off, valid);
    }
  };
  int slab = split * kScoreWarpWarps + warp;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (slab + s * slab_stride < num_slabs) issue(slab + s * slab_stride, s);
    CpAsyncCommit();
  }
  const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;
  const int b_key = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;
  const int vt_key = (lane % 8) + ((lane / 8) % 2) * 8, vt_col = (lane / 16) * 8;
  float acc[kMTiles][kNd][4];
  float m_row[kMTiles][2], l_part[kMTiles][2];  // l: this lane's share of the row sum
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nd = 0; nd < kNd; ++nd)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nd][i] = 0.f;
    m_row[mt][0] = m_row[mt][1] = -INFINITY;
    l_part[mt][0] = l_part[mt][1] = 0.f;
  }
  for (int stage = 0, fill = kStages - 1; slab < num_slabs; slab += slab_stride) {
    const int ahead = slab + (kStages - 1) * slab_stride;
    if (ahead < num_slabs) issue(ahead, fill);
    CpAsyncCommit();
    CpAsyncWait<kStages - 1>();
    __syncwarp();
    const T* k_s = ring + stage * kSlabElems;
    const T* v_s = k_s + kSlabKeys * kLd;
    const int key0 = slab * kSlabKeys;

    float s_acc[2][kMTiles][2][4];  // [chain][m-tile][n-tile][4], chains as ScoreWarpKernel
#pragma unroll
    for (int ch = 0; ch < 2; ++ch)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) s_acc[ch][mt][nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t kb[4];
      LdMatrixX4(kb, k_s + b_key * kLd + kk * 16 + b_col);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t qa[4];
        LdMatrixX4(qa, q_s + (mt * 16 + a_row) * kLd + kk * 16 + a_col);
        Mma16816<T>(s_acc[kk % 2][mt][0], qa, kb[0], kb[1]);
        Mma16816<T>(s_acc[kk % 2][mt][1], qa, kb[2], kb[3]);
      }
    }
    uint32_t pa[kMTiles][4];  // P as A fragments: {nt0 row, nt0 row + 8, nt1 row, nt1 row + 8}
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int pos = pos_r[mt][half];
        float sv[2][2];
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = half * 2 + e;
            const int j = key0 + nt * 8 + 2 * (lane % 4) + e;
            const float logit = s_acc[0][mt][nt][i] + s_acc[1][mt][nt][i];
            sv[nt][e] = j < n && j <= pos ? logit * p.scale : -INFINITY;
            tile_max = fmaxf(tile_max, sv[nt][e]);
          }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float alpha = MoveSoftmaxReference<ExpBase::kE>(m_row[mt][half], l_part[mt][half],
                                                              tile_max, kLazyRescale);
        if (alpha != 1.f) {  // quad-uniform
#pragma unroll
          for (int nd = 0; nd < kNd; ++nd) {
            acc[mt][nd][half * 2] *= alpha;
            acc[mt][nd][half * 2 + 1] *= alpha;
          }
        }
        const float m_ref = m_row[mt][half];
        float sum = 0.f;
        T pt[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float prob = SoftmaxProb<ExpBase::kE>(sv[nt][e], m_ref);
            pt[nt][e] = FromFloat<T>(prob);
            sum += ToFloat(pt[nt][e]);  // l sums the rounded p that P V uses
          }
        }
        l_part[mt][half] += sum;
        pa[mt][half] = PackPair(pt[0][0], pt[0][1]);
        pa[mt][2 + half] = PackPair(pt[1][0], pt[1][1]);
      }
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {  // acc[:, 16 dp : 16 dp + 16] += P V
      uint32_t vb[4];
      LdMatrixX4Trans(vb, v_s + vt_key * kLd + dp * 16 + vt_col);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        Mma16816<T>(acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
        Mma16816<T>(acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
      }
    }
    __syncwarp();
    stage = stage + 1 == kStages ? 0 : stage + 1;
    fill = fill + 1 == kStages ? 0 : fill + 1;
  }
  CpAsyncWait<0>();
  __syncthreads();  // every warp is done with its ring: the merge area reuses it
  // Per warp: rows [kRows][D + 2] = acc columns, then m, l (l summed over the quad).
  float* mine = merge_s + warp * kAttnWarpMaxRows * (D + 2);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = mt * 16 + lane / 4 + 8 * half;
      float l = l_part[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
      for (int nd = 0; nd < kNd; ++nd) {
        const int c = nd * 8 + 2 * (lane % 4);
        mine[r * (D + 2) + c] = acc[mt][nd][half * 2];
        mine[r * (D + 2) + c + 1] = acc[mt][nd][half * 2 + 1];
      }
      if (lane % 4 == 0) {
        mine[r * (D + 2) + D] = m_row[mt][half];
        mine[r * (D + 2) + D + 1] = l;
      }
    }
  }
  __syncthreads();
  const int64_t part_row0 = (static_cast<int64_t>(bh) * p.num_splits + split) * p.rows_pad;
  for (int idx = tid; idx < kRows * D; idx += kScoreWarpThreads) {
    const int r = idx / D, c = idx % D;
    float m_max, l, a;
    MergePartialRows<ExpBase::kE, kScoreWarpWarps, D>(merge_s + r * (D + 2),
                                                      kAttnWarpMaxRows * (D + 2), c, m_max, l, a);
    if (r < p.rows_pad) {
      p.part_acc[(part_row0 + r) * D + c] = a;
      if (c == 0) {
        p.part_m[part_row0 + r] = m_max;
        p.part_l[part_row0 + r] = l;
      }
    }
  }
}

}  // namespace dropkv::kernels::cuda
