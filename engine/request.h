// Plain data that crosses from the server into the engine: what a client asked for.
// No tensors, no gRPC: the server fills these after validation; the scheduler owns them after.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
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
  // Token id -> added to its logit before everything else; each id at most once.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // EOS, stop ids and stop strings do not end generation before this many tokens (the sampler
  // masks the EOS and stop ids until then).
  int32_t min_tokens = 0;
  // The prefill also returns each prompt token's logprob (tokens 1..; num_top_logprobs too).
  bool return_prompt_logprobs = false;
};

enum class FinishReason { kNone, kStop, kLength, kCancelled, kError };

}  // namespace dropkv
