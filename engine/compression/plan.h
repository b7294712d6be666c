// What compression will do to one request, decided once when it is admitted: the chunks its
// prompt is prefilled in, what each layer holds after every chunk, and the KV blocks that takes
// from the pool. The scheduler admits a request when the plan's peak fits, and checks each
// chunk's new blocks against the pool before the forward, so a prefill never runs out of blocks.
// The counts repeat the runner's and the press's rules exactly (algorithms.md sections 4-5):
//  - a layer that evicts in a chunk writes its kept entries into new blocks and frees its old
//    ones when the chunk's forward commits (the old and the new are held together until then);
//  - a layer that does not evict appends the chunk to its table;
//  - a sliding-window layer is never compressed and holds at most its ring (window) of tokens.
// Torch-free: integer arithmetic over budget.h.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/compression/budget.h"
#include "engine/compression/params.h"

namespace dropkv::compression {

// The paged cache as a plan counts it.
struct KvCacheGeometry {
  int32_t num_global_layers = 0;   // the layers compression acts on
  int32_t num_sliding_layers = 0;  // rings of `sliding_capacity` tokens, never compressed
  int64_t sliding_capacity = 0;
  int64_t block_size = 16;

  int64_t BlocksFor(int64_t num_tokens) const { return (num_tokens + block_size - 1) / block_size; }
};

struct PlanOptions {
  // The scheduler's prefill budget per step: an uncompressed prompt goes in chunks of it, and a
  // compressed prompt without a chunk size that is longer goes in chunks of it under last_chunk
  // (it selects what one pass selects) when its whole prompt fits `pool_blocks`.
  int64_t step_tokens = 512;
  int64_t pool_blocks = 0;
  // Decode room per layer the admission holds on top of the prompt.
  int64_t decode_reserve_tokens = 0;
  // A previous plan's choice for the same request (kept across preemptions, so that a request
  // sees the same chunks whatever the load); unset: decided here.
  std::optional<bool> split_long_prompt;
  // Prompt tokens already in the cache when the prefill starts: the chunks cover the rest (an
  // uncompressed prompt's on the grid of `step_tokens` chunks a prefill from position 0 uses,
  // a compressed one's in one pass or its own chunk size), and the blocks counted include the
  // cached ones. Either a prefix-cache hit (whole blocks of an uncompressed prompt, every layer
  // holding all of them) or a continued compressed conversation, whose global layers hold
  // `cached_stored_per_layer` entries each (its sliding layers their ring).
  int64_t cached_prefix_tokens = 0;
  std::vector<int64_t> cached_stored_per_layer;
};

// One prefill chunk: prompt positions [begin, end).
struct PlannedChunk {
  int64_t begin = 0;
  int64_t end = 0;
  bool evicts = false;       // some layer keeps fewer entries than it saw
  int64_t new_blocks = 0;    // taken from the pool by the chunk's forward
  int64_t blocks_after = 0;  // held by the sequence once the chunk committed
};

class CompressionPlan {
 public:
  // INVALID_ARGUMENT (from ValidateCompression, the budget allocator) when `params` cannot run on
  // `geometry`; `profile` is the server's loaded MGA / MLMA profile (nullptr: none).
  static absl::StatusOr<CompressionPlan> Create(const CompressionParams& params, int64_t prompt_len,
                                                const KvCacheGeometry& geometry,
                                                const LayerProfile* profile,
                                                const PlanOptions& options);

  // The settings the runner prefills with: the request's, with the scheduler's chunk size when
  // the plan split a long compressed prompt.
  const CompressionParams& params() const { return params_; }
  bool split_long_prompt() const { return split_long_prompt_; }
  const std::vector<PlannedChunk>& chunks() const { return chunks_; }
  // Tokens each global layer holds after the prefill.
  const std::vector<int64_t>& kept_per_layer() const { return kept_per_layer_; }
  // Blocks the sequence needs at its largest: the peak of its prefill, or its cache after the
  // prefill with the decode reserve, whichever is larger.
  int64_t blocks_needed() const { return blocks_needed_; }

 private:
  CompressionParams params_;
  bool split_long_prompt_ = false;
  std::vector<PlannedChunk> chunks_;
  std::vector<int64_t> kept_per_layer_;
  int64_t blocks_needed_ = 0;
};

// The blocks `params` needs for a `prompt_len`-token prompt prefilled in one pass (or in its own
// chunk size), with `decode_reserve_tokens` of decode room: what tools size pools and capacities
// with.
absl::StatusOr<int64_t> BlocksNeeded(const CompressionParams& params, int64_t prompt_len,
                                     const KvCacheGeometry& geometry, int64_t decode_reserve_tokens,
                                     const LayerProfile* profile = nullptr);

}  // namespace dropkv::compression
