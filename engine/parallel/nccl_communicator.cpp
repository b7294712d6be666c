#include "engine/parallel/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace dropkv {
namespace {

absl::Status NcclError(const char* what, ncclResult_t r) {
  return absl::UnavailableError(
      absl::StrCat("tensor parallelism: NCCL ", what, " failed: ", ncclGetErrorString(r)));
}

absl::StatusOr<ncclDataType_t> NcclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kDouble:
      return ncclFloat64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor parallelism: NCCL sums no ", c10::toString(t), " tensors"));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int32_t rank, int32_t size, int32_t device)
      : comm_(comm), rank_(rank), size_(size), device_(device) {}
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }

  absl::Status AllReduceSum(at::Tensor& t) override {
    if (absl::Status s = Check(t); !s.ok()) return s;
    auto type = NcclType(t.scalar_type());
    if (!type.ok()) return type.status();
    const ncclResult_t r = ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), *type, ncclSum,
                                         comm_, c10::cuda::getCurrentCUDAStream(device_).stream());
    return r == ncclSuccess ? absl::OkStatus() : NcclError("all-reduce", r);
  }

  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& t) override {
    at::Tensor in = t.contiguous();
    if (absl::Status s = Check(in); !s.ok()) return s;
    std::vector<int64_t> shape = {size_};
    shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
    at::Tensor out = at::empty(shape, in.options());
    const ncclResult_t r =
        ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel() * in.element_size(), ncclUint8,
                      comm_, c10::cuda::getCurrentCUDAStream(device_).stream());
    if (r != ncclSuccess) return NcclError("all-gather", r);
    return out;
  }

  absl::Status Broadcast(at::Tensor& t, int32_t root) override {
    if (absl::Status s = Check(t); !s.ok()) return s;
    const ncclResult_t r =
        ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel() * t.element_size(), ncclUint8, root,
                      comm_, c10::cuda::getCurrentCUDAStream(device_).stream());
    return r == ncclSuccess ? absl::OkStatus() : NcclError("broadcast", r);
  }

 private:
  absl::Status Check(const at::Tensor& t) const {
    if (!t.defined() || !t.is_cuda() || t.get_device() != device_ || !t.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor parallelism: NCCL collectives take contiguous tensors on cuda:", device_));
    }
    return absl::OkStatus();
  }

  ncclComm_t comm_;
  int32_t rank_, size_, device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(int32_t rank, int32_t size,
                                                          int32_t device_index,
                                                          const RendezvousOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallelism: rank ", rank, " out of a group of ", size));
  }
  namespace fs = std::filesystem;
  const fs::path id_path = fs::path(options.store_dir) / "nccl_unique_id";
  ncclUniqueId id;
  std::error_code ec;
  fs::create_directories(options.store_dir, ec);
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError("unique id", r);
    // Written whole under another name, then renamed: a reader never sees half an id.
    const fs::path tmp = id_path.string() + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(id.internal, sizeof(id.internal));
    fs::rename(tmp, id_path, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("tensor parallelism: cannot write ", id_path.string(), ": ", ec.message()));
    }
  } else {
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    while (!fs::exists(id_path)) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("tensor parallelism: rank ", rank, " waited ", options.timeout.count(),
                         " ms for rank 0's NCCL id at ", id_path.string()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream(id_path, std::ios::binary).read(id.internal, sizeof(id.internal));
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = ncclCommInitRank(&comm, size, id, rank); r != ncclSuccess)
    return NcclError("communicator set-up", r);
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, rank, size, device_index));
}

}  // namespace dropkv
