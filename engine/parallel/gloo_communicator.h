// The Gloo communicator (CPU tensors): Debian's libgloo with its TCP transport on loopback and a
// file store for the rendezvous. The whole tensor-parallel path runs on the CPU with it (CI).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/parallel/communicator.h"

namespace dropkv {

// Connects rank `rank` of `size` (blocks until every rank has joined or the timeout passes).
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(int32_t rank, int32_t size,
                                                          const RendezvousOptions& options);

}  // namespace dropkv
