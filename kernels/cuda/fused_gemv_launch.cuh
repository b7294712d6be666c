// Launchers of kernels/cuda/fused_gemv_stream.cuh; the token count picks the tile count.
// Instantiated in fused_gemv_plain.cu and fused_gemv_fp8.cu (FUSED_GEMV_INSTANTIATE); called by
// fused_gemv.cu. No torch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "kernels/cuda/fused_gemv_stream.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dropkv::kernels::cuda::gemv {

// Raises kKernel's dynamic shared memory limit to `smem` the first time it needs more than the
// default 48 KB. A host-side call, no stream work: fine during graph capture.
template <auto kKernel>
cudaError_t RaiseSmemLimit(size_t smem) {
  static std::atomic<size_t> raised_to{48 * 1024};  // one per kernel
  constexpr auto kernel = kKernel;
  if (smem > raised_to.load(std::memory_order_relaxed)) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    raised_to.store(smem, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// One wave: at most ctas_per_sm CTAs per SM, and no more than are resident at once (occupancy
// API, a host-side query), so no CTA waits for another to finish.
template <auto kKernel>
cudaError_t LaunchStream(const Params& p, int num_sms, size_t smem, cudaStream_t stream) {
  if (const cudaError_t err = RaiseSmemLimit<kKernel>(smem); err != cudaSuccess) return err;
  int per_sm = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem);
  if (err != cudaSuccess) return err;
  const int groups = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  const int ctas =
      std::max(1, std::min(groups, std::min(per_sm, p.ctas_per_sm) * std::max(num_sms, 1)));
  return LaunchMaybePdl(kKernel, dim3(ctas), dim3(kThreads), smem, stream, p);
}

template <typename T, typename W>
cudaError_t LaunchStreamGemv(const Params& p, int num_sms, cudaStream_t stream) {
  const size_t smem = StreamSmemBytes(p.m, p.k, p.stages, sizeof(T));
  if (p.rope.head_dim > 0) {
    if (p.m <= 8) return LaunchStream<StreamGemvKernel<T, W, 1, true>>(p, num_sms, smem, stream);
    return LaunchStream<StreamGemvKernel<T, W, 2, true>>(p, num_sms, smem, stream);
  }
  if (p.m <= 8) return LaunchStream<StreamGemvKernel<T, W, 1, false>>(p, num_sms, smem, stream);
  return LaunchStream<StreamGemvKernel<T, W, 2, false>>(p, num_sms, smem, stream);
}

#define FUSED_GEMV_INSTANTIATE(T, W) \
  template cudaError_t LaunchStreamGemv<T, W>(const Params&, int, cudaStream_t);

}  // namespace dropkv::kernels::cuda::gemv
