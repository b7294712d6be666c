// Plain data that crosses from the server into the engine: what a client asked for.
// No tensors, no gRPC: the server fills these after validation; the scheduler owns them after.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/compression/params.h"

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

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };

}  // namespace dropkv
