// Programmatic dependent launch (PDL, sm_90+) for the decode step's kernels. A decode
// step is ~10 dependent kernels per layer, each a few to ~60 us; launched the usual way, each
// starts only after its predecessor has fully drained (launch latency + ramp-up every time).
// Launched with LaunchMaybePdl, a kernel may start while its predecessor still runs: it does
// what does not depend on the predecessor first (e.g. requests its weights, which no kernel
// writes), then PdlWaitForPrimary() before it reads the predecessor's output or writes anything
// (its output buffer may be memory the predecessor still reads: the caching allocator reuses
// blocks in stream order). Inside a CUDA graph capture the overlap becomes a programmatic edge.
//
// Rules for a kernel launched with LaunchMaybePdl:
//   - every thread calls PdlWaitForPrimary() before its first dependent read and its first
//     global write (a no-op when the launch had no PDL attribute or the device is older);
//   - it may call PdlLaunchDependents() once it no longer needs its SM resources for the rest of
//     its grid to be scheduled (e.g. at its start when its grid fits one wave, before or after its
//     wait: PdlReleaseThenWait); without the call, its dependents are released when its CTAs exit.
// Transitivity holds: a kernel's PdlWaitForPrimary() returns only after its predecessor has
// completed and flushed, and that predecessor waited for its own.
// KernelTuning::pdl = false (DROPKV_PDL=0) launches everything the usual way.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "kernels/tuning.h"

namespace dropkv::kernels::cuda {

__device__ __forceinline__ void PdlWaitForPrimary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void PdlLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The release and the wait of a kernel that needs few SM resources (the decode step's norms and
// activation, between two GEMVs): released first, its dependent (the next GEMV) launches while the
// kernel queued before this one (the previous GEMV) still runs, so the GEMV's CTAs take each SM as
// the previous one's CTAs leave it and request their first weights in its tail, instead of
// launching only once this kernel has waited. Safe under the rules above: the dependent still
// waits for this kernel's completion, which follows this kernel's own wait. Measured at batch 1,
// Llama-3.1-8B geometry: -0.09 ms per step at 8K (-0.11 at keep 10%), docs/benchmarks.md.
__device__ __forceinline__ void PdlReleaseThenWait() {
  PdlLaunchDependents();
  PdlWaitForPrimary();
}

// True when launches on the current device may carry the PDL attribute (compute capability
// >= 9.0 and KernelTuning::pdl). The device answer is cached per device index.
inline bool PdlEnabled() {
  if (!Tuning().pdl) return false;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> major_by_device[kMaxDevices] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int major = major_by_device[device].load(std::memory_order_relaxed);
  if (major == 0) {
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      major = -1;
    major_by_device[device].store(major, std::memory_order_relaxed);
  }
  return major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when PdlEnabled().
// The kernel must follow the rules above.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchMaybePdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dropkv::kernels::cuda
