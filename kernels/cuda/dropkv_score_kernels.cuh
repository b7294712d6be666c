// Pass 3 of the fused DropKV scoring (algorithms.md section 1): raw-pointer device code, no torch.
#pragma once

#include "kernels/cuda/attention_common.cuh"

namespace dropkv::kernels::cuda {

struct ScoreParams {
  const void* q;  // [B, Hkv, g*W, D] model dtype, contiguous
  const void* k;  // dense keys, see PartialAttnParams
  const void* v;
  const int64_t* kv_offset;   // [B]
  const int32_t* seq_lens;    // [B]
  const float* a;             // [B*Hkv, a_rows, D] window rows' attention outputs (fp32)
  const float* lse;           // [B*Hkv, a_rows] their log-sum-exp (natural log, scaled logits)
  float* out;                 // scores: out + out_offset[b] + h * out_stride_head + j
  const int64_t* out_offset;  // [B]
  int64_t out_stride_head;
  int64_t stride_tok, stride_head;
  int32_t num_kv_heads, group, window, num_rows, rows_pad, min_pos;
  // Rows per KV head in a and lse: rows_pad for the merge's scratch, num_rows for a caller's
  // [B, Hq, W, D] / [B, Hq, W] (DropKvScoresFromAttention).
  int32_t a_rows;
  float scale, eps;
  int32_t round_mode;  // 0: none, 1: round p to bf16, 2: to fp16 (p_round_dtype)
};

template <int D, int RC>
constexpr int ScoreSmemFloats() {
  return 2 * kKeyTile * (D + 1) + 2 * RC * D + kKeyTile + 3 * RC + kWarps * kKeyTile;
}

// grid (B*Hkv, ceil(max_n / kKeyTile)), kThreads threads. CTA (bh, t) reads its K and V tile
// once, then for every chunk of RC packed rows recomputes the logits with pass 1's arithmetic,
// p = exp(logit - lse), w = (p / (1 - p + eps))^2, d2 = ||v||^2 - 2 <a, v> + ||a||^2 (>= 0), and
// accumulates w * d2 (d2 summed directly as ||v - a||^2 on this fp32 path). Mapping: lane = key of
// the tile, warp = rows warp, warp + 4, ...
template <typename T, int D, int RC>
__global__ void __launch_bounds__(kThreads) ScoreKernel(const ScoreParams p) {
  constexpr int kRowsPerWarp = RC / kWarps;
  extern __shared__ float smem[];
  float* k_s = smem;                                // [kKeyTile, D + 1]
  float* v_s = k_s + kKeyTile * (D + 1);            // [kKeyTile, D + 1]
  float* q_s = v_s + kKeyTile * (D + 1);            // [RC, D]
  float* a_s = q_s + RC * D;                        // [RC, D]
  float* vn2_s = a_s + RC * D;                      // [kKeyTile]
  float* lse_s = vn2_s + kKeyTile;                  // [RC]
  float* an2_s = lse_s + RC;                        // [RC]
  int* pos_s = reinterpret_cast<int*>(an2_s + RC);  // [RC]
  float* red_s = an2_s + 2 * RC;                    // [kWarps, kKeyTile]

  const int bh = blockIdx.x;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int tile = blockIdx.y * kKeyTile;
  if (tile >= n) return;  // whole CTA exits: no barrier is skipped by part of it
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int num_valid = min(kKeyTile, n - tile);

  const T* k_ptr = static_cast<const T*>(p.k) + p.kv_offset[b] + h * p.stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + p.kv_offset[b] + h * p.stride_head;
  LoadTilePair<T, D>(k_s, D + 1, v_s, D + 1, num_valid, k_ptr, v_ptr,
                     [&](int j) { return static_cast<int64_t>(tile + j) * p.stride_tok; });
  __syncthreads();
  if (warp == 0) {
    float s = 0.f;
    for (int c = 0; c < D; ++c) s = fmaf(v_s[lane * (D + 1) + c], v_s[lane * (D + 1) + c], s);
    vn2_s[lane] = s;
  }

  float score = 0.f;  // this thread's partial sum for key `lane` over its rows
  const T* q_all = static_cast<const T*>(p.q) + static_cast<int64_t>(bh) * p.num_rows * D;
  const float* a_all = p.a + static_cast<int64_t>(bh) * p.a_rows * D;
  for (int row0 = 0; row0 < p.num_rows; row0 += RC) {
    __syncthreads();  // previous chunk's q_s / a_s consumed
    for (int idx = tid; idx < RC * D; idx += kThreads) {
      const bool in = row0 + idx / D < p.num_rows;
      q_s[idx] = in ? ToFloat(q_all[static_cast<int64_t>(row0) * D + idx]) : 0.f;
      a_s[idx] = in ? a_all[static_cast<int64_t>(row0) * D + idx] : 0.f;
    }
    if (tid < RC) {
      const int m = row0 + tid;
      const int pos = n - p.window + m % p.window;
      const bool ok = m < p.num_rows && pos >= p.min_pos;
      pos_s[tid] = ok ? pos : -1;
      lse_s[tid] = ok ? p.lse[static_cast<int64_t>(bh) * p.a_rows + m] : 0.f;
    }
    __syncthreads();
    if (tid < RC) {
      float s = 0.f;
      for (int c = 0; c < D; ++c) s = fmaf(a_s[tid * D + c], a_s[tid * D + c], s);
      an2_s[tid] = s;
    }
    __syncthreads();

    float logit[kRowsPerWarp], av[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) logit[i] = av[i] = 0.f;
    const float* k_row = k_s + lane * (D + 1);
    const float* v_row = v_s + lane * (D + 1);
    // Same loop order and fmaf chain as pass 1, so p = exp(logit - lse) matches its softmax.
#pragma unroll 8
    for (int c = 0; c < D; ++c) {
      const float kc = k_row[c];
      const float vc = v_row[c];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp + i * kWarps;
        logit[i] = fmaf(q_s[r * D + c], kc, logit[i]);
        // d2 = ||v - a||^2 directly: the expanded form cancels catastrophically in fp32
        // when p is near 1 (a close to v) and w is huge.
        const float diff = vc - a_s[r * D + c];
        av[i] = fmaf(diff, diff, av[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      const int pos = pos_s[r];
      const int j = tile + lane;
      if (lane < num_valid && pos >= 0 && j <= pos) {
        float prob = __expf(logit[i] * p.scale - lse_s[r]);
        if (p.round_mode == 1) prob = __bfloat162float(__float2bfloat16_rn(prob));
        if (p.round_mode == 2) prob = __half2float(__float2half_rn(prob));
        const float w = prob / (1.f - prob + p.eps);
        const float d2 = av[i];
        score = fmaf(w * w, d2, score);
      }
    }
  }
  red_s[warp * kKeyTile + lane] = score;
  __syncthreads();
  if (warp == 0 && lane < num_valid) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red_s[w * kKeyTile + lane];
    p.out[p.out_offset[b] + h * p.out_stride_head + tile + lane] = s / p.group;
  }
}

}  // namespace dropkv::kernels::cuda
