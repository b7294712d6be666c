#include "engine/scheduler/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

namespace dropkv {
namespace {

// Top-n (id, logprob) of a log-softmax row, ties to the lower id.
std::vector<TopLogprobEntry> TopN(const std::vector<float>& logprobs, int32_t n) {
  std::vector<int32_t> ids(logprobs.size());
  std::iota(ids.begin(), ids.end(), 0);
  n = std::min<int32_t>(n, static_cast<int32_t>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](int32_t a, int32_t b) {
    return logprobs[a] > logprobs[b] || (logprobs[a] == logprobs[b] && a < b);
  });
  std::vector<TopLogprobEntry> top;
  for (int32_t i = 0; i < n; ++i) top.push_back({ids[i], logprobs[ids[i]]});
  return top;
}

}  // namespace

SampledToken SampleToken(const at::Tensor& logits_in, const SamplingParams& params,
                         std::span<const int32_t> history, std::mt19937_64& rng) {
  // [vocab] fp32, contiguous on CPU: the rest is scalar code over one row.
  at::Tensor row = logits_in.to(at::kCPU, at::kFloat).contiguous();
  const int64_t vocab = row.numel();
  const float* raw = row.data_ptr<float>();
  std::vector<float> logits(raw, raw + vocab);

  // Penalties (HF repetition: divide positive / multiply negative; OpenAI presence/frequency).
  if (params.repetition_penalty != 1.0f || params.presence_penalty != 0.0f ||
      params.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int32_t> counts;
    for (int32_t id : history)
      if (id >= 0 && id < vocab) ++counts[id];
    for (const auto& [id, count] : counts) {
      float& l = logits[id];
      if (params.repetition_penalty != 1.0f)
        l = l > 0 ? l / params.repetition_penalty : l * params.repetition_penalty;
      l -= params.presence_penalty + params.frequency_penalty * static_cast<float>(count);
    }
  }

  int32_t chosen = 0;
  if (params.temperature <= 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  } else {
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    int64_t num_keep = vocab;
    if (params.top_k > 0) num_keep = std::min<int64_t>(num_keep, params.top_k);
    // Softmax at temperature over the sorted candidates (fp64 for the cumulative sums).
    const double max_logit = logits[order[0]];
    std::vector<double> probs(num_keep);
    double total = 0;
    for (int64_t i = 0; i < num_keep; ++i) {
      probs[i] = std::exp((logits[order[i]] - max_logit) / params.temperature);
      total += probs[i];
    }
    for (double& p : probs) p /= total;
    if (params.min_p > 0.0f) {
      const double floor_p = params.min_p * probs[0];
      int64_t n = 1;
      while (n < num_keep && probs[n] >= floor_p) ++n;
      num_keep = n;
    }
    if (params.top_p < 1.0f) {
      double cum = 0;
      int64_t n = 0;
      while (n < num_keep) {
        cum += probs[n++];
        if (cum >= params.top_p) break;
      }
      num_keep = n;
    }
    double kept_total = 0;
    for (int64_t i = 0; i < num_keep; ++i) kept_total += probs[i];
    const double u = std::uniform_real_distribution<double>(0.0, kept_total)(rng);
    double cum = 0;
    chosen = order[num_keep - 1];
    for (int64_t i = 0; i < num_keep; ++i) {
      cum += probs[i];
      if (u < cum) {
        chosen = order[i];
        break;
      }
    }
  }

  SampledToken out;
  out.token_id = chosen;
  out.logprob.token_id = chosen;
  if (params.return_logprobs || params.num_top_logprobs > 0) {
    // Log-probabilities of the model's distribution (raw logits, before penalties/temperature).
    const float max_raw = *std::max_element(raw, raw + vocab);
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(raw[i] - max_raw));
    const double log_z = max_raw + std::log(sum);
    std::vector<float> logprobs(vocab);
    for (int64_t i = 0; i < vocab; ++i) logprobs[i] = static_cast<float>(raw[i] - log_z);
    out.logprob.logprob = logprobs[chosen];
    if (params.num_top_logprobs > 0) out.logprob.top = TopN(logprobs, params.num_top_logprobs);
  }
  return out;
}

}  // namespace dropkv
