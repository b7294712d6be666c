// Token sampling for the scheduler: one row of logits -> one token (+ logprobs when asked).
// TODO(issue 3): switch to engine/sampling once the model runtime's sampler lands; this is the
// seam (same SamplingParams, same seed semantics: one RNG per request seeded from `seed`).
#pragma once

#include <cstdint>
#include <random>
#include <span>

#include <ATen/core/Tensor.h>

#include "engine/request.h"
#include "engine/scheduler/generation.h"

namespace dropkv {

struct SampledToken {
  int32_t token_id = 0;
  TokenLogprobInfo logprob;  // filled when params.return_logprobs or num_top_logprobs > 0
};

// `logits`: fp32 [vocab] on CPU. `history`: prompt + generated ids (for the penalties).
// Greedy (temperature 0) is argmax with the lowest id winning ties.
SampledToken SampleToken(const at::Tensor& logits, const SamplingParams& params,
                         std::span<const int32_t> history, std::mt19937_64& rng);

}  // namespace dropkv
