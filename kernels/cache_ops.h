// Writes into the paged KV pool. Pool layout (allocator/ owns the blocks): K and V tensors each
// [num_blocks, block_size, Hkv, D]; slot = block_idx * block_size + offset. CPU reference in
// ATen; CUDA tensors go to kernels/cuda/cache_ops.cu. Pool and inputs share a device; the inputs
// are cast to the pool's dtype (an FP8 pool stores them quantized: kernels/kv_cache_fp8.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"

namespace dropkv::kernels {

// k_cache[slot_mapping[t], :, :] = k_new[t] (same for v). Negative slots are skipped (padding).
//   k_cache, v_cache: [num_blocks, block_size, Hkv, D]
//   k_new, v_new:     [T, Hkv, D]
//   slot_mapping:     int64 [T]
absl::Status WriteKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& slot_mapping);

// Stores the kept entries of each head: slot i of head h receives entry kept_idx[h, i] of that
// head (heads keep different positions; DESIGN.md decision 3).
//   k, v:         [Hkv, n, D] (one layer of one sequence, LayerKvView's layout)
//   kept_idx:     int64 [Hkv, k], values in [0, n)
//   slot_mapping: int64 [k]
absl::Status WriteKeptKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& kept_idx,
                         const at::Tensor& slot_mapping);

}  // namespace dropkv::kernels
