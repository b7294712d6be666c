// Plain data that crosses from the server into the engine: what a client asked for.
// No tensors, no gRPC: the server fills these after validation; the scheduler owns them after.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dropkv {

// Sampling settings of one request. Defaults = greedy, no penalties.
struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1)
  float repetition_penalty = 1.0f;  // > 0, 1 = off (HF convention: divides positive logits)
  float presence_penalty = 0.0f;    // OpenAI convention, subtracted once per seen token
  float frequency_penalty = 0.0f;   // OpenAI convention, subtracted per occurrence
  std::optional<uint64_t> seed;     // same seed, same output
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  std::vector<std::string> stop_strings;
  bool ignore_eos = false;
  int32_t num_top_logprobs = 0;  // 0 = none; >0 also returns the top-n per step
  bool return_logprobs = false;
};

// Which scorer decides what each layer keeps (algorithms.md sections 1-2).
enum class ScoreMethod { kNone, kDropKV, kSnapKV, kH2O, kH2OVl1, kH2OVl2, kStreamingLLM, kKNorm, kRandom };
// How the global budget is split over layers (algorithms.md section 4).
enum class BudgetAllocator { kUniform, kPyramid, kMLP, kMGA, kMLMA2, kMLMA4, kMLMA6, kExplicit };
// When to compress during chunked prefill (algorithms.md section 5).
enum class ChunkPolicy { kLastChunk, kEveryChunk, kBudget };
enum class PoolingType { kMax, kAvg, kNone };

// Compression settings of one request. One canonical budget form: keep_ratio (fraction kept);
// compression ratio and absolute token budgets are converted at the edge.
struct CompressionParams {
  ScoreMethod method = ScoreMethod::kNone;
  double keep_ratio = 1.0;               // (0, 1]
  std::optional<int64_t> budget_tokens;  // absolute per-sequence average per layer; wins over keep_ratio
  BudgetAllocator allocator = BudgetAllocator::kUniform;
  std::vector<double> explicit_layer_prune;  // rho_l per layer for kExplicit
  std::string profile_path;                  // InfoNCE profile for kMGA / kMLMA*
  int32_t window = 8;                        // observation window W (>= 1)
  int32_t pooling_kernel = 11;               // odd, >= 1
  PoolingType pooling = PoolingType::kMax;
  bool protect_sinks = false;
  int32_t num_sinks = 4;
  ChunkPolicy chunk_policy = ChunkPolicy::kLastChunk;
  int32_t chunk_size = 0;          // 0 = whole prompt in one pass
  int64_t budget_cap_tokens = 0;   // for kBudget
  uint64_t random_seed = 0;        // for kRandom
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };

}  // namespace dropkv
