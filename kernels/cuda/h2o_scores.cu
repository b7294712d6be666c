// Launcher of the H2O column-sum kernel (h2o_scores.cuh): shapes and dtypes were checked by
// kernels/cpu/score_cpu.cpp H2oScoresFromLse; here the strides, the device and the templates.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/check.h"
#include "kernels/cuda/h2o_scores.cuh"
#include "kernels/cuda/launchers.h"

namespace dropkv::kernels::cuda {
namespace {

// The kernel reads rows as 16-byte vectors: last dim contiguous, rows and data 16-byte aligned.
at::Tensor RowsAligned(const at::Tensor& t) {
  const bool ok = t.stride(3) == 1 && t.stride(2) % 8 == 0 && t.stride(1) % 8 == 0 &&
                  t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

template <typename T, int D>
void Launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse, at::Tensor& out,
            double scale) {
  H2oKernelParams<T> p;
  p.q = reinterpret_cast<const T*>(q.data_ptr());
  p.k = reinterpret_cast<const T*>(k.data_ptr());
  p.lse = lse.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.q_stride_tok = q.stride(2);
  p.k_stride_b = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.k_stride_tok = k.stride(2);
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.group = static_cast<int>(q.size(1) / k.size(1));
  p.nq = static_cast<int>(q.size(2));
  p.n = static_cast<int>(k.size(2));
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  auto kernel = H2oColumnSumKernel<T, D>;
  constexpr int smem = H2oSmemBytes<D>();
  static const bool attr_set = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attr_set;
  const dim3 grid(static_cast<unsigned>(k.size(0) * k.size(1)),
                  static_cast<unsigned>((p.n + kH2oTileKeys - 1) / kH2oTileKeys));
  kernel<<<grid, kH2oThreads, smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool H2oKernelApplies(const at::Tensor& q, const at::Tensor& k) {
  const auto dt = q.scalar_type();
  return q.is_cuda() && k.scalar_type() == dt && (dt == at::kBFloat16 || dt == at::kHalf) &&
         (q.size(3) == 64 || q.size(3) == 128) &&
         k.size(2) <= int64_t{65535} * kH2oTileKeys  // grid.y: key tiles
         && q.size(1) * q.size(2) < (int64_t{1} << 30);
}

absl::StatusOr<at::Tensor> H2oColumnSums(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& lse, double scale) {
  return internal::CatchTorch("H2oColumnSums(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(k.device());
    auto out = at::zeros({k.size(0), k.size(1), k.size(2)}, k.options().dtype(at::kFloat));
    if (k.size(2) == 0 || q.size(2) == 0) return out;
    const at::Tensor qa = RowsAligned(q), ka = RowsAligned(k);
    const at::Tensor l = lse.to(at::kFloat).contiguous();
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    if (q.size(3) == 64) {
      bf16 ? Launch<__nv_bfloat16, 64>(qa, ka, l, out, scale)
           : Launch<__half, 64>(qa, ka, l, out, scale);
    } else {
      bf16 ? Launch<__nv_bfloat16, 128>(qa, ka, l, out, scale)
           : Launch<__half, 128>(qa, ka, l, out, scale);
    }
    return out;
  });
}

}  // namespace dropkv::kernels::cuda
