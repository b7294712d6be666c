// Collectives between the ranks of a tensor-parallel group (one process per rank). The model
// calls them between its sharded layers; the runner for scores of KV heads that several ranks
// hold. Implementations: Gloo over TCP for CPU tensors (gloo_communicator.h), NCCL for CUDA
// tensors (nccl_communicator.h). Every rank calls the same collectives in the same order.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // Where the tensors it moves live (kCPU: Gloo; kCUDA: NCCL).
  virtual c10::DeviceType device_type() const = 0;
  // Sums `t` over the ranks, in place (every rank gets the sum). `t` contiguous; CUDA: on the
  // current stream (so it can be captured in a CUDA graph).
  virtual absl::Status AllReduceSum(at::Tensor& t) = 0;
  // Every rank's `t` (same shape on each) stacked: [size, ...t.shape].
  virtual absl::StatusOr<at::Tensor> AllGather(const at::Tensor& t) = 0;
  // Rank `root`'s `t` into every rank's `t` (same shape and dtype on each), in place.
  virtual absl::Status Broadcast(at::Tensor& t, int32_t root) = 0;
};

// How the ranks of a group find each other: a folder every rank can write (a file store), and
// how long a collective may wait for a peer before it fails (a rank that died makes the others
// fail with an error instead of hanging).
struct RendezvousOptions {
  std::string store_dir;
  // Keys of this group in the folder: several groups of the same ranks share one folder.
  std::string store_prefix;
  std::chrono::milliseconds timeout{60000};
  // Collectives wait for their peers without a time limit (a year; the connection still fails after
  // `timeout`): for a channel where a rank waits for rank 0's next message however long the
  // server is idle. A rank that dies then ends the group through its process (group.h).
  bool collectives_wait_forever = false;
};

}  // namespace dropkv
