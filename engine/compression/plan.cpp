#include "engine/compression/plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

// Chunk boundaries depend on the request alone, never on what else runs a step (batching
// invariance). A compression chunk size fixes them (they change what every_chunk keeps); an
// uncompressed prompt goes in chunks of the step budget; a compressed one in one pass, or in the
// step's chunks when the plan split it, whose last chunk keeps at least W tokens so that it holds
// the whole observation window, as one pass does.
std::vector<std::pair<int64_t, int64_t>> ChunkBounds(const CompressionParams& c, int64_t prompt_len,
                                                     int64_t step_tokens, bool split,
                                                     int64_t first) {
  std::vector<std::pair<int64_t, int64_t>> bounds;
  for (int64_t begin = first; begin < prompt_len;) {
    const int64_t remaining = prompt_len - begin;
    int64_t len = remaining;
    if (c.chunk_size > 0) {
      len = std::min<int64_t>(remaining, c.chunk_size);
      if (split && remaining > len && remaining - len < c.window) len = remaining - c.window;
    } else if (c.method == ScoreMethod::kNone) {
      const int64_t step = std::max<int64_t>(1, step_tokens);
      len = std::min(remaining, step - begin % step);  // back on the grid after a cached prefix
    }
    bounds.emplace_back(begin, begin + len);
    begin += len;
  }
  return bounds;
}

// Whether a layer holding `n` entries (stored + chunk) evicts in a chunk (the press's
// ShouldCompress, algorithms.md section 5).
bool PolicyCompresses(const CompressionParams& c, bool is_last, int64_t n) {
  switch (c.chunk_policy) {
    case ChunkPolicy::kLastChunk:
      return is_last;
    case ChunkPolicy::kEveryChunk:
      return true;
    case ChunkPolicy::kBudget:
      return is_last || n + std::max<int64_t>(c.chunk_size, 1) > c.budget_cap_tokens;
  }
  return true;
}

struct Simulation {
  std::vector<PlannedChunk> chunks;
  std::vector<int64_t> stored;  // per global layer, after the last chunk
  int64_t peak_blocks = 0;
};

absl::StatusOr<Simulation> Simulate(const CompressionParams& c, int64_t prompt_len,
                                    const KvCacheGeometry& g, const LayerProfile* profile,
                                    int64_t step_tokens, bool split, int64_t cached,
                                    const std::vector<int64_t>& cached_stored) {
  Simulation sim;
  sim.stored =
      cached_stored.empty() ? std::vector<int64_t>(g.num_global_layers, cached) : cached_stored;
  const int64_t layers = g.num_global_layers;
  // Blocks of the sequence between chunks.
  int64_t held = g.num_sliding_layers * g.BlocksFor(std::min(cached, g.sliding_capacity));
  for (int64_t stored : sim.stored) held += g.BlocksFor(stored);
  for (const auto& [begin, end] : ChunkBounds(c, prompt_len, step_tokens, split, cached)) {
    PlannedChunk chunk{.begin = begin, .end = end};
    const int64_t t_len = end - begin;
    const bool is_last = end == prompt_len;
    std::vector<int64_t> budgets;
    int64_t blocks_after = 0;
    // Replay scoring (the last chunk): what the replay's copy and the compaction add.
    const bool replay = c.scoring_queries == ScoringQueries::kReplay && is_last;
    const int64_t replay_len = std::min(kReplayChunkTokens, prompt_len - cached);
    int64_t replay_blocks = 0, kept_blocks = 0;
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t n = sim.stored[l] + t_len;
      int64_t keep = n;
      if (c.method != ScoreMethod::kNone && PolicyCompresses(c, is_last, n)) {
        if (budgets.empty()) {
          absl::StatusOr<BudgetOptions> bo =
              ResolveBudgetOptions(c, static_cast<int32_t>(layers), end, profile);
          if (!bo.ok()) return bo.status();
          absl::StatusOr<std::vector<int64_t>> b =
              AllocateLayerBudgets(*bo, static_cast<int32_t>(layers), end);
          if (!b.ok()) return b.status();
          budgets = std::move(*b);
        }
        keep = std::min(budgets[l], n);
      }
      if (keep < n && replay) {
        // The chunk is stored in full, the replay chunk added to a copy (its partial block
        // copied), then the kept entries written into new blocks: both transient until commit.
        chunk.evicts = true;
        chunk.new_blocks += g.BlocksFor(n) - g.BlocksFor(sim.stored[l]);
        replay_blocks += g.BlocksFor(n + replay_len) - g.BlocksFor(n) + (n % g.block_size != 0);
        kept_blocks += g.BlocksFor(keep);
      } else if (keep < n) {  // new blocks for the kept entries; the old ones go at commit
        chunk.evicts = true;
        chunk.new_blocks += g.BlocksFor(keep);
      } else {
        chunk.new_blocks += g.BlocksFor(n) - g.BlocksFor(sim.stored[l]);
      }
      sim.stored[l] = keep;
      blocks_after += g.BlocksFor(keep);
    }
    const int64_t ring_before = g.BlocksFor(std::min(begin, g.sliding_capacity));
    const int64_t ring_after = g.BlocksFor(std::min(end, g.sliding_capacity));
    chunk.new_blocks += g.num_sliding_layers * (ring_after - ring_before);
    // The replay's copy holds its own rings (ModelRunner::ForkSequence copies them whole).
    if (replay_blocks > 0) {
      replay_blocks +=
          g.num_sliding_layers * g.BlocksFor(std::min(end + replay_len, g.sliding_capacity));
    }
    chunk.new_blocks += std::max(replay_blocks, kept_blocks);
    blocks_after += g.num_sliding_layers * ring_after;
    sim.peak_blocks = std::max(sim.peak_blocks, held + chunk.new_blocks);
    held = blocks_after;
    chunk.blocks_after = blocks_after;
    sim.chunks.push_back(chunk);
  }
  return sim;
}

// Blocks after the prefill plus `reserve` decode tokens in every layer.
int64_t BlocksWithDecodeRoom(const Simulation& sim, const KvCacheGeometry& g, int64_t prompt_len,
                             int64_t reserve) {
  int64_t blocks =
      g.num_sliding_layers * g.BlocksFor(std::min(prompt_len + reserve, g.sliding_capacity));
  for (int64_t stored : sim.stored) blocks += g.BlocksFor(stored + reserve);
  return blocks;
}

}  // namespace

absl::StatusOr<CompressionPlan> CompressionPlan::Create(const CompressionParams& params,
                                                        int64_t prompt_len,
                                                        const KvCacheGeometry& geometry,
                                                        const LayerProfile* profile,
                                                        const PlanOptions& options) {
  if (prompt_len <= 0) return absl::InvalidArgumentError("prompt: must hold at least one token");
  if (geometry.block_size <= 0 || geometry.num_global_layers < 0 ||
      geometry.num_sliding_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache geometry: block_size ", geometry.block_size, ", global layers ",
                     geometry.num_global_layers, ", sliding layers ", geometry.num_sliding_layers));
  }
  if (params.method != ScoreMethod::kNone) {
    CompressionParams checked = params;
    // A loaded profile was checked against the model when it was loaded.
    if (profile != nullptr && AllocatorNeedsProfile(params.allocator) &&
        checked.profile_path.empty())
      checked.profile_path = "(loaded)";
    if (absl::Status s = ValidateCompression(checked, geometry.num_global_layers); !s.ok())
      return s;
  }
  const int64_t reserve = std::max<int64_t>(0, options.decode_reserve_tokens);
  const int64_t cached = options.cached_prefix_tokens;
  const std::vector<int64_t>& cached_stored = options.cached_stored_per_layer;
  const bool shared_prefix = cached > 0 && cached_stored.empty();
  if (cached < 0 || cached >= prompt_len ||
      (shared_prefix &&
       (params.method != ScoreMethod::kNone || cached % geometry.block_size != 0)) ||
      (!cached_stored.empty() &&
       static_cast<int32_t>(cached_stored.size()) != geometry.num_global_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cached prefix of ", cached, " tokens (", cached_stored.size(),
        " layers' stored counts) for a prompt of ", prompt_len,
        " tokens: one token at least is left to prefill; a shared prefix is whole blocks of an "
        "uncompressed prompt; a continued conversation lists every global layer"));
  }
  auto finish = [&](const CompressionParams& c, bool split, Simulation sim) -> CompressionPlan {
    CompressionPlan plan;
    plan.params_ = c;
    plan.split_long_prompt_ = split;
    plan.kept_per_layer_ = sim.stored;
    plan.blocks_needed_ =
        std::max(sim.peak_blocks, BlocksWithDecodeRoom(sim, geometry, prompt_len, reserve));
    plan.chunks_ = std::move(sim.chunks);
    return plan;
  };

  // A compressed prompt longer than the step budget and without a chunk size would go in one
  // pass and stall every running decode for its whole prefill (~270 ms for 8K tokens on an H200).
  // It is prefilled in chunks of the step budget under last_chunk instead, which selects exactly
  // what one pass selects (the last chunk's last W queries score every key). The price: its
  // chunks are stored in full until the last one compresses, so this is done only when that fits
  // the pool; otherwise it stays one pass (the evicted tokens are never stored).
  const int64_t step = options.step_tokens;
  const bool can_split = params.method != ScoreMethod::kNone && params.chunk_size == 0 &&
                         cached == 0 && prompt_len > step && step >= params.window &&
                         step <= std::numeric_limits<int32_t>::max();
  if (can_split && options.split_long_prompt.value_or(true)) {
    CompressionParams chunked = params;
    chunked.chunk_size = static_cast<int32_t>(step);
    chunked.chunk_policy = ChunkPolicy::kLastChunk;
    absl::StatusOr<Simulation> sim =
        Simulate(chunked, prompt_len, geometry, profile, step, true, /*cached=*/0, {});
    if (!sim.ok()) return sim.status();
    CompressionPlan plan = finish(chunked, true, std::move(*sim));
    if (options.split_long_prompt.has_value() || plan.blocks_needed_ <= options.pool_blocks)
      return plan;
  }
  absl::StatusOr<Simulation> sim =
      Simulate(params, prompt_len, geometry, profile, step, false, cached, cached_stored);
  if (!sim.ok()) return sim.status();
  return finish(params, false, std::move(*sim));
}

absl::StatusOr<int64_t> BlocksNeeded(const CompressionParams& params, int64_t prompt_len,
                                     const KvCacheGeometry& geometry, int64_t decode_reserve_tokens,
                                     const LayerProfile* profile) {
  PlanOptions options;
  options.step_tokens = std::numeric_limits<int64_t>::max();  // one pass: no scheduler chunks
  options.decode_reserve_tokens = decode_reserve_tokens;
  absl::StatusOr<CompressionPlan> plan =
      CompressionPlan::Create(params, prompt_len, geometry, profile, options);
  if (!plan.ok()) return plan.status();
  return plan->blocks_needed();
}

}  // namespace dropkv::compression
