#include "engine/sampling/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace dropkv {

SamplerState::SamplerState(const SamplingParams& params, std::span<const int32_t> prompt,
                           std::span<const int32_t> eos_token_ids)
    : params_(params), prompt_(prompt.begin(), prompt.end()) {
  rng_.seed(params.seed ? *params.seed : std::random_device{}());
  if (params.min_tokens > 0) {
    if (!params.ignore_eos) min_tokens_banned_.assign(eos_token_ids.begin(), eos_token_ids.end());
    min_tokens_banned_.insert(min_tokens_banned_.end(), params.stop_token_ids.begin(),
                              params.stop_token_ids.end());
  }
}

void SamplerState::Append(int32_t token) {
  generated_.push_back(token);
  ++generated_counts_[token];
}

double SamplerState::NextUniform() {
  // 53 random bits -> [0, 1), independent of the standard library's distribution code.
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

at::Tensor Sampler::ProcessRow(const at::Tensor& row_in, const SamplerState& state) {
  const SamplingParams& p = state.params();
  at::Tensor row = row_in.to(at::kFloat).clone();  // [V]
  const int64_t vocab = row.size(0);
  const auto dev = row.device();
  auto ids_tensor = [&](const std::vector<int64_t>& ids) {
    return at::tensor(ids, at::kLong).to(dev);
  };
  auto in_vocab = [&](int64_t t) { return t >= 0 && t < vocab; };
  if (!p.logit_bias.empty()) {
    if (!state.bias_ids_.defined() || state.bias_ids_.device() != dev) {
      std::vector<int64_t> ids;
      std::vector<float> values;
      for (const auto& [t, v] : p.logit_bias) {
        if (!in_vocab(t)) continue;
        ids.push_back(t);
        values.push_back(v);
      }
      state.bias_ids_ = ids_tensor(ids);
      state.bias_values_ = at::tensor(values, at::kFloat).to(dev);
    }
    row.index_add_(0, state.bias_ids_, state.bias_values_);
  }
  if (static_cast<int64_t>(state.generated_.size()) < p.min_tokens &&
      !state.min_tokens_banned_.empty()) {
    if (!state.banned_ids_.defined() || state.banned_ids_.device() != dev) {
      std::vector<int64_t> ids;
      for (int32_t t : state.min_tokens_banned_)
        if (in_vocab(t)) ids.push_back(t);
      state.banned_ids_ = ids_tensor(ids);
    }
    row.index_fill_(0, state.banned_ids_, -std::numeric_limits<float>::infinity());
  }
  if (p.repetition_penalty != 1.0f) {
    std::vector<int64_t> seen;
    for (int32_t t : state.prompt_) seen.push_back(t);
    for (int32_t t : state.generated_) seen.push_back(t);
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    seen.erase(
        std::remove_if(seen.begin(), seen.end(), [&](int64_t t) { return t < 0 || t >= vocab; }),
        seen.end());
    if (!seen.empty()) {
      auto idx = ids_tensor(seen);
      auto v = row.index_select(0, idx);
      v = at::where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty);
      row.index_copy_(0, idx, v);
    }
  }
  if ((p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) &&
      !state.generated_counts_.empty()) {
    std::vector<int64_t> ids;
    std::vector<float> delta;
    for (const auto& [t, n] : state.generated_counts_) {
      if (t < 0 || t >= vocab) continue;
      ids.push_back(t);
      delta.push_back(p.presence_penalty + p.frequency_penalty * static_cast<float>(n));
    }
    if (!ids.empty()) row.index_add_(0, ids_tensor(ids), -at::tensor(delta, at::kFloat).to(dev));
  }
  if (p.temperature <= 0.0f) return row;  // greedy: no filtering needed
  row = row / p.temperature;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (p.top_k > 0 && p.top_k < vocab) {
    auto kth = std::get<0>(row.topk(p.top_k)).min();
    row = row.masked_fill(row < kth, neg_inf);
  }
  if (p.top_p < 1.0f) {
    auto [sorted, order] = row.sort(/*dim=*/0, /*descending=*/true);
    auto probs = sorted.softmax(0);
    auto mass_before = probs.cumsum(0) - probs;  // mass of the strictly better tokens
    auto drop_sorted = mass_before >= p.top_p;   // keeps the smallest set with mass >= top_p
    auto drop = at::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
    row = row.masked_fill(drop, neg_inf);
  }
  if (p.min_p > 0.0f) {
    auto probs = row.softmax(0);
    row = row.masked_fill(probs < probs.max() * p.min_p, neg_inf);
  }
  return row;
}

absl::StatusOr<std::vector<SampledToken>> Sampler::Sample(const at::Tensor& logits,
                                                          std::span<SamplerState* const> states) {
  if (logits.dim() != 2 || logits.size(0) != static_cast<int64_t>(states.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampler: logits must be [", states.size(), ", vocab]"));
  }
  const int64_t batch = logits.size(0);
  std::vector<SampledToken> out(batch);
  try {
    std::vector<at::Tensor> rows(batch);
    std::vector<double> uniforms(batch, -1.0);  // -1 = greedy row
    for (int64_t b = 0; b < batch; ++b) {
      rows[b] = ProcessRow(logits[b], *states[b]);
      if (states[b]->params().temperature > 0.0f) uniforms[b] = states[b]->NextUniform();
    }
    auto processed = at::stack(rows);  // [B, V]
    auto greedy = processed.argmax(1);
    const bool all_greedy =
        std::all_of(uniforms.begin(), uniforms.end(), [](double u) { return u < 0; });
    at::Tensor ids, picked_val;
    if (all_greedy) {
      // The common serving case: no sort of the vocabulary, one device-to-host copy.
      ids = greedy.to(at::kCPU);
    } else {
      // Inverse CDF per row over the probabilities sorted descending.
      auto [sorted, order] = processed.sort(1, true);
      auto cdf = sorted.softmax(1).to(at::kDouble).cumsum(1);  // [B, V]
      auto u = at::tensor(uniforms, at::kDouble).to(logits.device()).unsqueeze(1);
      auto pos =
          (cdf <= u).sum(1, true).clamp_max(processed.size(1) - 1);  // first index with cdf > u
      auto chosen = order.gather(1, pos).squeeze(1);
      std::vector<int64_t> greedy_flags(batch);
      for (int64_t b = 0; b < batch; ++b) greedy_flags[b] = uniforms[b] < 0 ? 1 : 0;
      auto is_greedy = at::tensor(greedy_flags, at::kLong).to(logits.device()) > 0;
      ids = at::where(is_greedy, greedy, chosen).to(at::kCPU);
      // u in the rounding tail of the CDF (cdf[-1] < 1) could land on a filtered (-inf) entry.
      picked_val =
          processed.gather(1, ids.to(logits.device()).unsqueeze(1)).squeeze(1).to(at::kCPU);
    }
    bool need_logprobs = false;
    for (auto* s : states)
      need_logprobs |= s->params().return_logprobs || s->params().num_top_logprobs > 0;
    at::Tensor logprobs;
    if (need_logprobs) logprobs = logits.to(at::kFloat).log_softmax(1);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t id = ids[b].item<int64_t>();
      if (picked_val.defined() && std::isinf(picked_val[b].item<float>())) {
        id = greedy[b].item<int64_t>();
      }
      out[b].token_id = static_cast<int32_t>(id);
      const auto& p = states[b]->params();
      if (p.return_logprobs || p.num_top_logprobs > 0) {
        auto row = logprobs[b].to(at::kCPU);
        out[b].logprob = row[id].item<float>();
        if (p.num_top_logprobs > 0) {
          auto [vals, idx] = row.topk(std::min<int64_t>(p.num_top_logprobs, row.size(0)));
          for (int64_t i = 0; i < vals.size(0); ++i) {
            out[b].top_logprobs.emplace_back(static_cast<int32_t>(idx[i].item<int64_t>()),
                                             vals[i].item<float>());
          }
        }
      }
      states[b]->Append(out[b].token_id);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("sampler: ", e.what()));
  }
  return out;
}

FinishReason CheckStop(const SamplerState& state, int32_t token,
                       std::span<const int32_t> eos_token_ids) {
  const auto& p = state.params();
  // Before min_tokens nothing but the length ends it (max_new_tokens >= min_tokens).
  if (static_cast<int64_t>(state.generated().size()) < p.min_tokens) return FinishReason::kNone;
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) !=
      p.stop_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (!p.ignore_eos &&
      std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (static_cast<int64_t>(state.generated().size()) >= p.max_new_tokens)
    return FinishReason::kLength;
  return FinishReason::kNone;
}

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  auto bad = [](const char* field, auto v, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", v, " is not ", want));
  };
  if (!(p.temperature >= 0.0f)) return bad("temperature", p.temperature, ">= 0");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return bad("top_p", p.top_p, "in (0, 1]");
  if (!(p.min_p >= 0.0f && p.min_p < 1.0f)) return bad("min_p", p.min_p, "in [0, 1)");
  if (p.top_k < 0) return bad("top_k", p.top_k, ">= 0");
  if (!(p.repetition_penalty > 0.0f)) return bad("repetition_penalty", p.repetition_penalty, "> 0");
  if (p.max_new_tokens < 1) return bad("max_new_tokens", p.max_new_tokens, ">= 1");
  if (p.num_top_logprobs < 0 || p.num_top_logprobs > 20)
    return bad("num_top_logprobs", p.num_top_logprobs, "in [0, 20]");
  for (const auto& [t, v] : p.logit_bias)
    if (!(v >= -100.0f && v <= 100.0f)) return bad("logit_bias", v, "in [-100, 100]");
  if (p.min_tokens < 0 || p.min_tokens > p.max_new_tokens)
    return bad("min_tokens", p.min_tokens, "in [0, max_new_tokens]");
  return absl::OkStatus();
}

}  // namespace dropkv
