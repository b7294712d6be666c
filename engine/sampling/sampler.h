// Token sampling for a decode batch: penalties, temperature, top-k, top-p, min-p, per-request
// seeds, logprobs, and the stop rules. One row of logits per request; each request keeps its own
// SamplerState (RNG + token history), so a request's output does not depend on its batch-mates.
//
// Order: logit_bias (added to the raw logits, as OpenAI), the min_tokens mask (EOS unless
// ignore_eos, and stop ids, are -inf until min_tokens tokens were generated), then, as
// transformers' logits processors: repetition penalty (HF: divides positive logits,
// multiplies negative ones, over prompt + generated ids), presence / frequency penalties (OpenAI:
// over generated ids), temperature, top-k, top-p, min-p, then one uniform draw per request from
// its own RNG (inverse CDF over the kept tokens, sorted by probability). temperature 0 = greedy.
// Logprobs are those of the model distribution (log_softmax of the raw logits).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "engine/request.h"

namespace dropkv {

class SamplerState {
 public:
  // `prompt` feeds the repetition penalty; `eos_token_ids` are masked until params.min_tokens.
  // Without params.seed the RNG is seeded randomly.
  SamplerState(const SamplingParams& params, std::span<const int32_t> prompt,
               std::span<const int32_t> eos_token_ids = {});
  const SamplingParams& params() const { return params_; }
  const std::vector<int32_t>& generated() const { return generated_; }
  void Append(int32_t token);
  double NextUniform();  // in [0, 1)

 private:
  friend class Sampler;
  SamplingParams params_;
  std::vector<int32_t> prompt_;
  std::vector<int32_t> generated_;
  std::unordered_map<int32_t, int32_t> generated_counts_;
  std::vector<int32_t> min_tokens_banned_;  // EOS (unless ignore_eos) + stop ids
  std::mt19937_64 rng_;
  // Device copies of logit_bias and the banned ids, made at the first step that needs them: the
  // later steps apply them without a host-to-device copy.
  mutable at::Tensor bias_ids_, bias_values_, banned_ids_;
};

struct SampledToken {
  int32_t token_id = 0;
  float logprob = 0.0f;                                 // of token_id (when requested)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // best first (num_top_logprobs)
};

class Sampler {
 public:
  // logits: fp32 [B, vocab] (any device); states[b] belongs to row b. Appends each sampled token
  // to its state. Reads only the sampled ids (and requested logprobs) back to the host.
  static absl::StatusOr<std::vector<SampledToken>> Sample(const at::Tensor& logits,
                                                          std::span<SamplerState* const> states);
  // Applies the penalties, temperature and top-k / top-p / min-p filters of one row's params to
  // a [vocab] row; filtered entries become -inf. Exposed for tests.
  static at::Tensor ProcessRow(const at::Tensor& row, const SamplerState& state);
};

// Why generation ends after `token` was appended (kNone = continue). EOS ids count unless
// ignore_eos; stop_token_ids always; max_new_tokens gives kLength; before min_tokens, kNone.
FinishReason CheckStop(const SamplerState& state, int32_t token,
                       std::span<const int32_t> eos_token_ids);

// Checks ranges (temperature >= 0, top_p in (0, 1], min_p in [0, 1), top_k >= 0,
// repetition_penalty > 0, max_new_tokens >= 1, num_top_logprobs in [0, 20], logit_bias values in
// [-100, 100], min_tokens in [0, max_new_tokens]); INVALID_ARGUMENT names the field.
absl::Status ValidateSamplingParams(const SamplingParams& params);

}  // namespace dropkv
