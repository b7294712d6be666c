// The CUDA-only pieces the runner needs, behind a torch-light header so that the CPU-only build
// compiles the runner unchanged: CUDA graph capture / replay of one decode forward, and the
// device's free memory (the KV pool's default size). cuda_graph_cuda.cpp implements them with
// ATen's CUDA APIs; cuda_graph_stub.cpp (CPU-only builds) answers UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv {

// Graphs captured into one shared memory pool (they are never replayed concurrently: the engine
// thread replays one decode step at a time). Opaque stand-in for at::cuda::MempoolId_t.
struct CudaGraphPool {
  std::pair<uint64_t, uint64_t> id{0, 0};  // {0, 0}: none yet; the first capture creates it
};

// One captured decode forward. Replay() re-runs every kernel on the current stream with whatever
// the static input buffers (owned by the caller) hold now; output() is the captured output
// tensor, overwritten by each replay.
class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;
  virtual void Replay() = 0;
  virtual const at::Tensor& output() const = 0;
};

// Runs `forward` once eagerly on a side stream (warm-up: cuBLAS handles, kernel attributes), then
// captures a second call into a graph in `pool`. `forward` must not sync with the host. The
// warm-up's side effects happen (the caller's inputs must make a repeat harmless, e.g. writing
// the same K/V into the same slots). Errors (capture not supported, an op that syncs) come back
// as a status; the caller then stays eager.
absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    const std::function<absl::StatusOr<at::Tensor>()>& forward, CudaGraphPool& pool);

// Free and total bytes of `device` after returning the caching allocator's unused blocks.
absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int device_index);

// 10 * major + minor of `device`'s compute capability (80: A100, 90: H100 / H200).
absl::StatusOr<int> CudaComputeCapability(int device_index);

// Copies `host` (a pinned CPU tensor) to `device_buffer` on the current stream without waiting,
// and makes the next call on the same staging buffer wait until this copy has read it.
class StagedUpload {
 public:
  virtual ~StagedUpload() = default;
  // Waits until the previous upload from the staging buffer finished (the host may write it).
  virtual void WaitStagingFree() = 0;
  // Pinned host staging tensor, same dtype / size as the device buffer.
  virtual at::Tensor& staging() = 0;
  // Enqueues the copy staging -> device buffer on the current stream.
  virtual void Upload() = 0;
  virtual const at::Tensor& device_buffer() const = 0;
};
// Device time of stretches of work on the current stream, without a host sync while they are
// queued: Start()/Stop() record events; Seconds() waits for the last Stop and sums the stretches.
class DeviceTimer {
 public:
  virtual ~DeviceTimer() = default;
  virtual void Start() = 0;
  virtual void Stop() = 0;
  virtual double Seconds() = 0;
};
absl::StatusOr<std::unique_ptr<DeviceTimer>> CreateCudaTimer();

// A byte buffer of `num_bytes` on `device` plus its pinned staging twin.
absl::StatusOr<std::unique_ptr<StagedUpload>> CreateStagedUpload(int64_t num_bytes,
                                                                 int device_index);

}  // namespace dropkv
