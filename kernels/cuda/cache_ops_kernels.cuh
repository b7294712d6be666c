// Raw-pointer device code of the paged-cache writes (cache_ops.h). No torch includes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dropkv::kernels::cuda {

// grid (T), block 128: token t copies its [Hkv, D] row of K and V into slot slot_mapping[t]
// (skipped when negative). Elements move as 16-byte vectors (row_vecs = Hkv * D * size / 16).
__global__ void WriteKvKernel(const uint4* __restrict__ k_new, const uint4* __restrict__ v_new,
                              const int64_t* __restrict__ slot_mapping, int64_t row_vecs,
                              uint4* __restrict__ k_cache, uint4* __restrict__ v_cache) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    k_cache[slot * row_vecs + i] = k_new[t * row_vecs + i];
    v_cache[slot * row_vecs + i] = v_new[t * row_vecs + i];
  }
}

// grid (k, Hkv), block 32: slot_mapping[i] of head h receives entry kept_idx[h, i] of that head.
//   k, v:     [Hkv, n, D] as head_vecs = D * size / 16 vectors per entry, contiguous
//   kept_idx: [Hkv, num_kept]
__global__ void WriteKeptKvKernel(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                  const int64_t* __restrict__ kept_idx,
                                  const int64_t* __restrict__ slot_mapping, int64_t n,
                                  int64_t num_kept, int64_t num_kv_heads, int64_t head_vecs,
                                  uint4* __restrict__ k_cache, uint4* __restrict__ v_cache) {
  const int64_t i = blockIdx.x, h = blockIdx.y;
  const int64_t j = kept_idx[h * num_kept + i];
  const int64_t dst = (slot_mapping[i] * num_kv_heads + h) * head_vecs;
  const int64_t src = (h * n + j) * head_vecs;
  for (int64_t c = threadIdx.x; c < head_vecs; c += blockDim.x) {
    k_cache[dst + c] = k[src + c];
    v_cache[dst + c] = v[src + c];
  }
}

}  // namespace dropkv::kernels::cuda
