// The CPU kernel behind kernels::PagedDecodeAttention (paged_attention.h). Internal to kernels/:
// the public function checks shapes, dtypes, every length and block id, then calls this.
#pragma once

#include <ATen/core/Tensor.h>

namespace dropkv::kernels::cpu {

// True when the kernel takes these caches: fp32 / bf16 / fp16, contiguous (the pool's layout).
// Otherwise (fp64, strided views) the caller runs the ATen reference.
bool PagedDecodeKernelApplies(const at::Tensor& k_cache, const at::Tensor& v_cache);

// Arguments as kernels::PagedDecodeAttention, already checked; scale > 0, softcap >= 0.
// Returns [B, Hq, D] in q's dtype; softmax and accumulation in fp32. simd = false runs the
// portable loops that CPUs without AVX2 + FMA get (the tests check both).
at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, double softcap,
                                bool simd = true);

}  // namespace dropkv::kernels::cpu
