// The NCCL communicator (CUDA tensors, one GPU per rank): NCCL from the torch wheel's
// nvidia-nccl package, its unique id passed through a file in the rendezvous folder. Collectives
// run on the current CUDA stream, so a decode step's CUDA graph captures its all-reduces.
// A peer that dies leaves NCCL's kernels waiting on the device; the process that started the
// ranks watches them and ends the group (NCCL has no timeout of its own here).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/parallel/communicator.h"

namespace dropkv {

// Connects rank `rank` of `size` on CUDA device `device_index` (blocks until every rank has
// joined, or fails after options.timeout when rank 0's id never appears).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectNccl(int32_t rank, int32_t size,
                                                          int32_t device_index,
                                                          const RendezvousOptions& options);

}  // namespace dropkv
