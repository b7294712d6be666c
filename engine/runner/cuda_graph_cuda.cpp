// CUDA implementation of cuda_graph.h (compiled only when DROPKV_CUDA_ENABLED).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "absl/strings/str_cat.h"
#include "engine/runner/cuda_graph.h"

namespace dropkv {
absl::StatusOr<int> CudaComputeCapability(int device_index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGetDeviceProperties(", device_index, ") failed"));
  }
  return 10 * prop.major + prop.minor;
}

namespace {

class CudaCapturedGraph : public CapturedGraph {
 public:
  void Replay() override { graph_.replay(); }
  const at::Tensor& output() const override { return output_; }

  at::cuda::CUDAGraph graph_;
  at::Tensor output_;
};

class CudaStagedUpload : public StagedUpload {
 public:
  CudaStagedUpload(at::Tensor staging, at::Tensor device_buffer)
      : staging_(std::move(staging)), device_buffer_(std::move(device_buffer)) {}
  void WaitStagingFree() override {
    if (pending_) done_.synchronize();
    pending_ = false;
  }
  at::Tensor& staging() override { return staging_; }
  void Upload() override {
    // From pinned memory: an async copy ordered on the current stream (cudaMemcpyAsync itself:
    // Tensor::copy_'s dispatch and its caching-allocator event took ~30 us of host time per
    // decode step); the event tells the next WaitStagingFree when the host may overwrite the
    // staging buffer.
    const auto stream = at::cuda::getCurrentCUDAStream();
    C10_CUDA_CHECK(cudaMemcpyAsync(device_buffer_.data_ptr(), staging_.data_ptr(),
                                   staging_.nbytes(), cudaMemcpyHostToDevice, stream));
    done_.record(stream);
    pending_ = true;
  }
  const at::Tensor& device_buffer() const override { return device_buffer_; }

 private:
  at::Tensor staging_;        // uint8 [num_bytes], pinned host memory
  at::Tensor device_buffer_;  // uint8 [num_bytes] on the device
  at::cuda::CUDAEvent done_;
  bool pending_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    const std::function<absl::StatusOr<at::Tensor>()>& forward, CudaGraphPool& pool) {
  auto graph = std::make_unique<CudaCapturedGraph>();
  try {
    // Capture needs a non-default stream; the side stream first waits for the work queued on
    // the current one (the caller's input upload).
    auto current = at::cuda::getCurrentCUDAStream();
    auto side = at::cuda::getStreamFromPool();
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
    {
      at::cuda::CUDAStreamGuard guard(side);
      auto warm = forward();  // eager: lazy initialisation must not happen inside the capture
      if (!warm.ok()) return warm.status();
      side.synchronize();
      const at::cuda::MempoolId_t pool_id{pool.id.first, pool.id.second};
      graph->graph_.capture_begin(pool_id);
      absl::StatusOr<at::Tensor> out;
      try {
        out = forward();
      } catch (...) {
        try {
          graph->graph_.capture_end();
        } catch (...) {
        }
        throw;
      }
      graph->graph_.capture_end();
      if (!out.ok()) return out.status();
      graph->output_ = *out;
      const auto used = graph->graph_.pool();
      pool.id = {used.first, used.second};
    }
    side.synchronize();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("CUDA graph capture failed: ", e.what()));
  }
  return std::unique_ptr<CapturedGraph>(std::move(graph));
}

absl::StatusOr<std::pair<int64_t, int64_t>> CudaMemoryInfo(int device_index) {
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
    c10::cuda::CUDACachingAllocator::emptyCache();
    size_t free_bytes = 0, total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return std::pair<int64_t, int64_t>(static_cast<int64_t>(free_bytes),
                                       static_cast<int64_t>(total_bytes));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cudaMemGetInfo failed: ", e.what()));
  }
}

namespace {

// A metric must never fail the prefill it measures: any CUDA error turns the timer off (0 s).
class CudaTimer : public DeviceTimer {
 public:
  void Start() override {
    Guard([&] {
      stretches_.emplace_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault),
                              std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
      stretches_.back().first->record();
    });
  }
  void Stop() override {
    Guard([&] {
      if (!stretches_.empty()) stretches_.back().second->record();
    });
  }
  double Seconds() override {
    double ms = 0;
    Guard([&] {
      for (auto& [start, stop] : stretches_) {
        stop->synchronize();
        ms += start->elapsed_time(*stop);
      }
    });
    return failed_ ? 0.0 : ms / 1e3;
  }

 private:
  template <typename Fn>
  void Guard(Fn&& fn) {
    if (failed_) return;
    try {
      fn();
    } catch (const std::exception&) {
      failed_ = true;
    }
  }
  bool failed_ = false;
  std::vector<std::pair<std::unique_ptr<at::cuda::CUDAEvent>, std::unique_ptr<at::cuda::CUDAEvent>>>
      stretches_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceTimer>> CreateCudaTimer() {
  try {
    return std::unique_ptr<DeviceTimer>(new CudaTimer());
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("CUDA timer: ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<StagedUpload>> CreateStagedUpload(int64_t num_bytes,
                                                                 int device_index) {
  try {
    auto staging = at::empty({num_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto device_buffer = at::empty(
        {num_bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_index));
    return std::unique_ptr<StagedUpload>(
        new CudaStagedUpload(std::move(staging), std::move(device_buffer)));
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("decode input buffers of ", num_bytes, " bytes: ", e.what()));
  }
}

}  // namespace dropkv
