// Launchers of the paged-cache writes (cache_ops.h) on CUDA.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/cache_ops_kernels.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/kv_cache_fp8.h"

namespace dropkv::kernels::cuda {
namespace {

absl::Status CheckVectorisable(const at::Tensor& k_cache, int64_t row_elems) {
  if (!k_cache.is_contiguous() || (row_elems * k_cache.element_size()) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache ops on CUDA: the cache must be contiguous and head_dim * element size a multiple "
        "of 16 bytes, got head_dim ",
        k_cache.size(3)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& slot_mapping) {
  const int64_t row_elems = k_cache.size(2) * k_cache.size(3);
  if (auto s = CheckVectorisable(k_cache, row_elems); !s.ok()) return s;
  return internal::CatchTorch("WriteKv(cuda)", [&]() -> absl::Status {
    c10::cuda::CUDAGuard guard(k_cache.device());
    auto kn = ToCacheDtype(k_new, k_cache).contiguous();
    auto vn = ToCacheDtype(v_new, k_cache).contiguous();
    auto slots = slot_mapping.contiguous();
    const int64_t t = kn.size(0);
    if (t == 0) return absl::OkStatus();
    const int64_t row_vecs = row_elems * k_cache.element_size() / 16;
    WriteKvKernel<<<t, 128, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const uint4*>(kn.data_ptr()), static_cast<const uint4*>(vn.data_ptr()),
        slots.data_ptr<int64_t>(), row_vecs, static_cast<uint4*>(k_cache.data_ptr()),
        static_cast<uint4*>(v_cache.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return absl::OkStatus();
  });
}

absl::Status WriteKeptKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& kept_idx,
                         const at::Tensor& slot_mapping) {
  if (auto s = CheckVectorisable(k_cache, k_cache.size(3)); !s.ok()) return s;
  return internal::CatchTorch("WriteKeptKv(cuda)", [&]() -> absl::Status {
    c10::cuda::CUDAGuard guard(k_cache.device());
    auto kc = ToCacheDtype(k, k_cache).contiguous();
    auto vc = ToCacheDtype(v, k_cache).contiguous();
    auto idx = kept_idx.contiguous();
    auto slots = slot_mapping.contiguous();
    const int64_t hkv = kc.size(0), n = kc.size(1), num_kept = idx.size(1);
    if (num_kept == 0) return absl::OkStatus();
    const int64_t head_vecs = k_cache.size(3) * k_cache.element_size() / 16;
    WriteKeptKvKernel<<<dim3(num_kept, hkv), 32, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const uint4*>(kc.data_ptr()), static_cast<const uint4*>(vc.data_ptr()),
        idx.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), n, num_kept, hkv, head_vecs,
        static_cast<uint4*>(k_cache.data_ptr()), static_cast<uint4*>(v_cache.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return absl::OkStatus();
  });
}

}  // namespace dropkv::kernels::cuda
