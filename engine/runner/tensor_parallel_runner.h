// Tensor parallelism's control path. Rank 0 runs the scheduler over a runner that
// repeats each call changing the cache on the other ranks before making it itself: the call goes
// as one message over a CPU control channel, and every rank then runs the same forward on its
// shard, meeting at the model's collectives. The others only follow (FollowRankZero); what
// the scheduler reads (cache info, the pool's counts) is rank 0's, the same on every rank.
#pragma once

#include <memory>

#include "absl/status/status.h"
#include "engine/runner/model_runner.h"

namespace dropkv {

class Communicator;

// Rank 0's runner: `local` (its shard) plus the repetition of every call on the ranks of
// `control` (not owned; it outlives the runner). Destroying it tells the others to stop.
// Prefill with an explicit selector and the calibration capture are not repeated: UNIMPLEMENTED.
std::unique_ptr<ModelRunner> LeadTensorParallelRanks(std::unique_ptr<ModelRunner> local,
                                                     Communicator* control);

// Ranks 1..size-1: makes rank 0's calls on `runner` until rank 0 stops the group (OK). A call
// that fails where rank 0's cannot have (an error that may leave this shard different) ends it
// with that error: the rank then exits, and rank 0's watcher stops the server.
absl::Status FollowRankZero(ModelRunner& runner, Communicator& control);

}  // namespace dropkv
