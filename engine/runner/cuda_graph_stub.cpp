// cuda_graph.h for CPU-only builds: nothing to capture, no device memory to ask about.
#include "engine/runner/cuda_graph.h"

namespace dropkv {

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    const std::function<absl::StatusOr<at::Tensor>()>&, CudaGraphPool&) {
  return absl::UnimplementedError("CUDA graphs: this build has no CUDA");
}

absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int) {
  return absl::UnimplementedError("CUDA memory info: this build has no CUDA");
}

absl::StatusOr<int> CudaComputeCapability(int) {
  return absl::UnimplementedError("CUDA compute capability: this build has no CUDA");
}

absl::StatusOr<std::unique_ptr<DeviceTimer>> CreateCudaTimer() {
  return absl::UnimplementedError("CUDA timer: this build has no CUDA");
}

absl::StatusOr<std::unique_ptr<StagedUpload>> CreateStagedUpload(int64_t, int) {
  return absl::UnimplementedError("pinned uploads: this build has no CUDA");
}

}  // namespace dropkv
