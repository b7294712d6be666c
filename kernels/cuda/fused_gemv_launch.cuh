// Launchers of kernels/cuda/fused_gemv_kernels.cuh (the register ring: the unroll picks the chunks
// in flight) and kernels/cuda/fused_gemv_stream.cuh (the default); the token count picks the
// tile count. Instantiated per prologue in
// fused_gemv_{plain,norm,gated}.cu (FUSED_GEMV_INSTANTIATE); called by fused_gemv.cu. No torch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "kernels/cuda/fused_gemv_kernels.cuh"
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

// Launches kKernel with `smem` bytes of dynamic shared memory. The grid: one CTA per 16-row
// group, or at most one wave of resident CTAs (occupancy API, a host-side query), each looping
// over its groups.
template <auto kKernel>
cudaError_t LaunchWithSmem(const Params& p, const LaunchOptions& options, size_t smem,
                           cudaStream_t stream) {
  constexpr auto kernel = kKernel;
  if (const cudaError_t err = RaiseSmemLimit<kKernel>(smem); err != cudaSuccess) return err;
  int ctas = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  if (options.persistent && options.num_sms > 0) {
    int per_sm = 0;
    const cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
    if (err != cudaSuccess) return err;
    if (per_sm > 0) ctas = std::min(ctas, per_sm * options.num_sms);
  }
  kernel<<<ctas, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename NW, Prologue kP>
cudaError_t LaunchFusedGemv(const Params& p, const LaunchOptions& options, cudaStream_t stream) {
  const size_t smem = SmemBytes(p.m, p.k, sizeof(T));
  const bool four = options.unroll == 4;
  if (p.m <= 8) {
    if (four) return LaunchWithSmem<FusedGemvKernel<T, NW, kP, 1, 4>>(p, options, smem, stream);
    return LaunchWithSmem<FusedGemvKernel<T, NW, kP, 1, 8>>(p, options, smem, stream);
  }
  if (four) return LaunchWithSmem<FusedGemvKernel<T, NW, kP, 2, 4>>(p, options, smem, stream);
  return LaunchWithSmem<FusedGemvKernel<T, NW, kP, 2, 8>>(p, options, smem, stream);
}

// One wave: at most ctas_per_sm CTAs per SM, and no more than are resident at once (occupancy
// API, a host-side query), so no CTA waits for another to finish.
template <auto kKernel>
cudaError_t LaunchStream(const Params& p, const LaunchOptions& options, size_t smem,
                         cudaStream_t stream) {
  if (const cudaError_t err = RaiseSmemLimit<kKernel>(smem); err != cudaSuccess) return err;
  int per_sm = 0;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem);
  if (err != cudaSuccess) return err;
  const int groups = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  const int ctas = std::max(
      1, std::min(groups, std::min(per_sm, options.ctas_per_sm) * std::max(options.num_sms, 1)));
  return LaunchMaybePdl(kKernel, dim3(ctas), dim3(kThreads), smem, stream, p);
}

// The cp.async-filled kernels for p.stage_k and p.m, with or without the RoPE epilogue.
template <typename T, typename NW, Prologue kP, bool kRope>
cudaError_t LaunchStreamAsync(const Params& p, const LaunchOptions& options, size_t smem,
                              cudaStream_t stream) {
  if (p.stage_k == 1024) {
    if (p.m <= 8) {
      return LaunchStream<StreamGemvKernel<T, NW, kP, 1, false, 1024, kRope>>(p, options, smem,
                                                                              stream);
    }
    return LaunchStream<StreamGemvKernel<T, NW, kP, 2, false, 1024, kRope>>(p, options, smem,
                                                                            stream);
  }
  if (p.m <= 8) {
    return LaunchStream<StreamGemvKernel<T, NW, kP, 1, false, 512, kRope>>(p, options, smem,
                                                                           stream);
  }
  return LaunchStream<StreamGemvKernel<T, NW, kP, 2, false, 512, kRope>>(p, options, smem, stream);
}

template <typename T, typename NW, Prologue kP>
cudaError_t LaunchStreamGemv(const Params& p, const LaunchOptions& options, cudaStream_t stream) {
  const size_t smem = StreamSmemBytes(p.m, p.k, p.stages, sizeof(T), p.stage_k);
  if constexpr (kP == Prologue::kPlain) {
    // The RoPE epilogue always fills by cp.async, at the stage_k and stages GemvParams chose
    // (512 under DROPKV_GEMV_FILL=bulk: the same shared memory either way).
    if (p.rope.head_dim > 0) return LaunchStreamAsync<T, NW, kP, true>(p, options, smem, stream);
  }
  if (options.bulk_copies) {
    if (p.m <= 8) {
      return LaunchStream<StreamGemvKernel<T, NW, kP, 1, true, 512, false>>(p, options, smem,
                                                                            stream);
    }
    return LaunchStream<StreamGemvKernel<T, NW, kP, 2, true, 512, false>>(p, options, smem, stream);
  }
  return LaunchStreamAsync<T, NW, kP, false>(p, options, smem, stream);
}

#define FUSED_GEMV_INSTANTIATE(T, NW, P)                                               \
  template cudaError_t LaunchFusedGemv<T, NW, P>(const Params&, const LaunchOptions&,  \
                                                 cudaStream_t);                        \
  template cudaError_t LaunchStreamGemv<T, NW, P>(const Params&, const LaunchOptions&, \
                                                  cudaStream_t);

}  // namespace dropkv::kernels::cuda::gemv
