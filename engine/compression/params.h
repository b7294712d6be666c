// Compression settings of a request (the methods, budgets and chunk policies of algorithms.md
// sections 1-5) and the tables of their enum names. Torch-free and tiny: config, the server's
// request validation, the CLI flags and the engine all include it. Each field's name, range and
// help are its row in schema.h, which every reader and writer of a setting goes through;
// validation and the per-request plan are in compression.h / plan.h.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/common/named_value.h"

namespace dropkv {

// Which scorer decides what each layer keeps (algorithms.md sections 1-2).
enum class ScoreMethod {
  kNone,
  kDropKV,
  kSnapKV,
  kH2O,
  kH2OVl1,
  kH2OVl2,
  kStreamingLLM,
  kKNorm,
  kRandom
};
// How the global budget is split over layers (algorithms.md section 4).
enum class BudgetAllocator { kUniform, kPyramid, kMLP, kMGA, kMLMA2, kMLMA4, kMLMA6, kExplicit };
// When to compress during chunked prefill (algorithms.md section 5).
enum class ChunkPolicy { kLastChunk, kEveryChunk, kBudget };
enum class PoolingType { kMax, kAvg, kNone };
// Which queries score the cache (docs/compression.md, "Question-independent scoring").
enum class ScoringQueries { kWindow, kReplay };

// Replay scoring feeds the prompt again in chunks of this many tokens, each after the whole
// prompt (what one chunk adds to the cache bounds the replay's memory).
inline constexpr int64_t kReplayChunkTokens = 2048;

// Compression settings of one request. One canonical budget form: keep_ratio (fraction kept);
// compression ratio and absolute token budgets are converted at the edge.
struct CompressionParams {
  ScoreMethod method = ScoreMethod::kNone;
  double keep_ratio = 1.0;  // (0, 1]
  // Absolute per-sequence average kept per layer; wins over keep_ratio.
  std::optional<int64_t> budget_tokens;
  BudgetAllocator allocator = BudgetAllocator::kUniform;
  std::vector<double> explicit_layer_prune;  // rho_l per layer for kExplicit
  std::string profile_path;                  // InfoNCE profile for kMGA / kMLMA*
  int32_t window = 8;                        // observation window W (>= 1)
  int32_t pooling_kernel = 11;               // odd, >= 1
  PoolingType pooling = PoolingType::kMax;
  // > 0: after pooling, each entry also takes the largest pooled score of the this-many entries
  // before it, so a kept value keeps the tokens that continue it (a value the question points at
  // by its first tokens, read to its end during decode). 0 = symmetric pooling only. 32 won the
  // held-out A/B of docs/quality.md (UUID needles go from none answered to the full cache's).
  int32_t pooling_lookback = 32;
  // kWindow: the prompt's last `window` queries (the question, when it ends the prompt). kReplay:
  // the queries of the prompt fed again after itself, each entry scored by what reproducing the
  // prompt reads of it; it does not depend on a question, for a document or a kept conversation
  // that later questions read (KVzip's idea). Costs one more prefill of the prompt. DropKV only.
  ScoringQueries scoring_queries = ScoringQueries::kWindow;
  bool protect_sinks = false;
  int32_t num_sinks = 4;
  ChunkPolicy chunk_policy = ChunkPolicy::kLastChunk;
  int32_t chunk_size = 0;         // 0 = whole prompt in one pass
  int64_t budget_cap_tokens = 0;  // for kBudget
  uint64_t random_seed = 0;       // for kRandom
  // > 0: compression during decode. When a layer holds more than its budget for the tokens seen
  // so far plus this many entries, the press re-scores it with the queries of the last `window`
  // decode steps and evicts back to the budget (docs/compression.md). 0 = prefill only.
  int32_t decode_margin = 0;
  // > 0: an automatic budget. Each layer keeps the fewest entries whose removal leaves the window
  // queries' estimated output shift (the removed entries' DropKV scores over the window's output
  // energy, square-rooted: a relative L2 change) at most this, its worst KV head deciding; the
  // budget of keep_ratio / budget_tokens is the ceiling (what admission reserves). 0 = the fixed
  // budget. DropKV only.
  double tolerance = 0;
#ifdef DROPKV_COMPRESSION_TEST_FIELD
  int32_t test_field = 7;  // schema_extension_test's build only (schema.cpp's last row)
#endif
};

inline constexpr std::array<NamedValue<ScoreMethod>, 9> kScoreMethodNames{{
    {ScoreMethod::kNone, "none"},
    {ScoreMethod::kDropKV, "dropkv"},
    {ScoreMethod::kSnapKV, "snapkv"},
    {ScoreMethod::kH2O, "h2o"},
    {ScoreMethod::kH2OVl1, "h2o_vl1"},
    {ScoreMethod::kH2OVl2, "h2o_vl2"},
    {ScoreMethod::kStreamingLLM, "streaming_llm"},
    {ScoreMethod::kKNorm, "knorm"},
    {ScoreMethod::kRandom, "random"},
}};
inline constexpr std::array<NamedValue<BudgetAllocator>, 8> kBudgetAllocatorNames{{
    {BudgetAllocator::kUniform, "uniform"},
    {BudgetAllocator::kPyramid, "pyramid"},
    {BudgetAllocator::kMLP, "mlp"},
    {BudgetAllocator::kMGA, "mga"},
    {BudgetAllocator::kMLMA2, "mlma2"},
    {BudgetAllocator::kMLMA4, "mlma4"},
    {BudgetAllocator::kMLMA6, "mlma6"},
    {BudgetAllocator::kExplicit, "explicit"},
}};
inline constexpr std::array<NamedValue<ChunkPolicy>, 3> kChunkPolicyNames{{
    {ChunkPolicy::kLastChunk, "last_chunk"},
    {ChunkPolicy::kEveryChunk, "every_chunk"},
    {ChunkPolicy::kBudget, "budget"},
}};
inline constexpr std::array<NamedValue<PoolingType>, 3> kPoolingTypeNames{{
    {PoolingType::kMax, "max"},
    {PoolingType::kAvg, "avg"},
    {PoolingType::kNone, "none"},
}};
inline constexpr std::array<NamedValue<ScoringQueries>, 2> kScoringQueriesNames{{
    {ScoringQueries::kWindow, "window"},
    {ScoringQueries::kReplay, "replay"},
}};

// MGA and the MLMA hybrids read a per-layer profile (CompressionParams::profile_path).
constexpr bool AllocatorNeedsProfile(BudgetAllocator allocator) {
  return allocator == BudgetAllocator::kMGA || allocator == BudgetAllocator::kMLMA2 ||
         allocator == BudgetAllocator::kMLMA4 || allocator == BudgetAllocator::kMLMA6;
}

// The four compression settings. `field` defaults to the request/config field name.
std::string_view ScoreMethodName(ScoreMethod method);
std::string_view BudgetAllocatorName(BudgetAllocator allocator);
std::string_view ChunkPolicyName(ChunkPolicy policy);
std::string_view PoolingTypeName(PoolingType pooling);
absl::StatusOr<ScoreMethod> ParseScoreMethod(std::string_view name,
                                             std::string_view field = "method");
absl::StatusOr<BudgetAllocator> ParseBudgetAllocator(std::string_view name,
                                                     std::string_view field = "allocator");
absl::StatusOr<ChunkPolicy> ParseChunkPolicy(std::string_view name,
                                             std::string_view field = "chunk_policy");
absl::StatusOr<PoolingType> ParsePoolingType(std::string_view name,
                                             std::string_view field = "pooling");

}  // namespace dropkv
