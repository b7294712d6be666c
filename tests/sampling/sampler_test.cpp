#include "engine/sampling/sampler.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <vector>

namespace dropkv {
namespace {

std::vector<float> Values(const at::Tensor& t) {
  auto c = t.to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

const std::vector<float> kRow = {2.0f, -1.0f, 0.5f, 3.0f, -2.5f, 1.0f, 0.0f, 2.5f};

TEST(SamplerTest, GreedyIsArgmax) {
  SamplingParams p;
  SamplerState s(p, {});
  SamplerState* states[] = {&s};
  auto out = Sampler::Sample(at::tensor(kRow).unsqueeze(0), states);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].token_id, 3);
  EXPECT_EQ(s.generated(), std::vector<int32_t>{3});
}

// A batch of greedy rows (no vocabulary sort: each row's argmax) and a greedy row beside a
// sampled one (the inverse-CDF path: the greedy row still takes its argmax).
TEST(SamplerTest, GreedyRowsTakeTheirArgmaxInAnyBatch) {
  std::vector<float> reversed(kRow.rbegin(), kRow.rend());  // argmax at 7 - 3 = 4
  auto logits = at::stack({at::tensor(kRow), at::tensor(reversed)});
  SamplingParams greedy;
  SamplerState a(greedy, {}), b(greedy, {});
  SamplerState* both_greedy[] = {&a, &b};
  auto out = Sampler::Sample(logits, both_greedy);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0].token_id, 3);
  EXPECT_EQ((*out)[1].token_id, 4);
  SamplingParams sampled;
  sampled.temperature = 1.0f;
  sampled.seed = 5;
  SamplerState c(sampled, {}), d(greedy, {});
  SamplerState* mixed[] = {&c, &d};
  auto mixed_out = Sampler::Sample(logits, mixed);
  ASSERT_TRUE(mixed_out.ok());
  EXPECT_EQ((*mixed_out)[1].token_id, 4);
}

TEST(SamplerTest, RepetitionPenaltyMatchesHfFormula) {
  SamplingParams p;
  p.repetition_penalty = 1.3f;
  const std::vector<int32_t> prompt = {0, 1, 1};
  SamplerState s(p, prompt);
  s.Append(3);
  auto got = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  // transformers RepetitionPenaltyLogitsProcessor: score < 0 ? score * penalty : score / penalty,
  // once per distinct id of input_ids (prompt + generated).
  std::vector<float> want = kRow;
  for (int id : {0, 1, 3}) want[id] = want[id] < 0 ? want[id] * 1.3f : want[id] / 1.3f;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << i;
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesMatchOpenAiFormula) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  const std::vector<int32_t> prompt = {5};  // prompt ids are not penalised (OpenAI convention)
  SamplerState s(p, prompt);
  for (int t : {2, 2, 7, 2}) s.Append(t);
  auto got = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  std::vector<float> want = kRow;
  want[2] -= 0.5f + 0.25f * 3;
  want[7] -= 0.5f + 0.25f * 1;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << i;
}

TEST(SamplerTest, TopKKeepsExactlyK) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 3;
  SamplerState s(p, {});
  auto got = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  int finite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isfinite(got[i])) {
      ++finite;
      EXPECT_TRUE(i == 0 || i == 3 || i == 7) << i;
    }
  }
  EXPECT_EQ(finite, 3);
}

TEST(SamplerTest, TopPKeepsSmallestSetWithMassAtLeastP) {
  for (float top_p : {0.3f, 0.5f, 0.8f, 0.95f}) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_p = top_p;
    SamplerState s(p, {});
    auto got = Values(Sampler::ProcessRow(at::tensor(kRow), s));
    // Reference: probabilities at temperature 0.7, sorted descending, summed until >= p.
    std::vector<double> probs(kRow.size());
    double z = 0;
    for (size_t i = 0; i < kRow.size(); ++i) z += probs[i] = std::exp(kRow[i] / 0.7);
    std::vector<size_t> order(kRow.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return probs[a] > probs[b]; });
    double mass = 0;
    std::vector<bool> keep(kRow.size(), false);
    for (size_t i : order) {
      if (mass >= top_p * z) break;
      keep[i] = true;
      mass += probs[i];
    }
    for (size_t i = 0; i < kRow.size(); ++i)
      EXPECT_EQ(std::isfinite(got[i]), keep[i]) << "top_p " << top_p << " id " << i;
  }
}

TEST(SamplerTest, MinPDropsTokensBelowFractionOfBest) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.2f;
  SamplerState s(p, {});
  auto got = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  for (size_t i = 0; i < kRow.size(); ++i) {
    // p_i / p_max = exp(x_i - x_max)
    const bool keep = std::exp(kRow[i] - 3.0f) >= 0.2f;
    EXPECT_EQ(std::isfinite(got[i]), keep) << i;
  }
}

std::vector<int32_t> Draw(uint64_t seed, int n, bool with_neighbour) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = seed;
  SamplerState s(p, {});
  SamplingParams q;
  q.temperature = 1.0f;
  q.seed = 999;
  SamplerState other(q, {});
  for (int i = 0; i < n; ++i) {
    if (with_neighbour) {
      SamplerState* states[] = {&other, &s};
      EXPECT_TRUE(Sampler::Sample(at::stack({at::tensor(kRow), at::tensor(kRow)}), states).ok());
    } else {
      SamplerState* states[] = {&s};
      EXPECT_TRUE(Sampler::Sample(at::tensor(kRow).unsqueeze(0), states).ok());
    }
  }
  return s.generated();
}

TEST(SamplerTest, SameSeedSameOutputWhateverTheBatch) {
  EXPECT_EQ(Draw(42, 50, false), Draw(42, 50, false));
  EXPECT_EQ(Draw(42, 50, false), Draw(42, 50, true));
  EXPECT_NE(Draw(42, 50, false), Draw(43, 50, false));
}

TEST(SamplerTest, SampleFrequenciesFollowSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  SamplerState s(p, {});
  const int n = 20000;
  auto logits = at::tensor(kRow).unsqueeze(0).expand({n, 8}).contiguous();
  std::vector<SamplerState> states(n, s);
  std::vector<SamplerState*> ptrs;
  for (int i = 0; i < n; ++i) {
    SamplingParams pi = p;
    pi.seed = 1000 + i;
    states[i] = SamplerState(pi, {});
    ptrs.push_back(&states[i]);
  }
  auto out = Sampler::Sample(logits, ptrs);
  ASSERT_TRUE(out.ok());
  std::map<int, int> counts;
  for (const auto& t : *out) ++counts[t.token_id];
  double z = 0;
  for (float x : kRow) z += std::exp(x);
  for (int i = 0; i < 8; ++i) {
    const double prob = std::exp(kRow[i]) / z;
    const double sd = std::sqrt(prob * (1 - prob) / n);
    EXPECT_NEAR(counts[i] / static_cast<double>(n), prob, 5 * sd + 1e-4) << i;
  }
}

TEST(SamplerTest, LogprobsAreLogSoftmaxOfRawLogits) {
  SamplingParams p;
  p.return_logprobs = true;
  p.num_top_logprobs = 2;
  p.repetition_penalty = 2.0f;  // does not change reported logprobs
  SamplerState s(p, {});
  SamplerState* states[] = {&s};
  auto out = Sampler::Sample(at::tensor(kRow).unsqueeze(0), states);
  ASSERT_TRUE(out.ok());
  double z = 0;
  for (float x : kRow) z += std::exp(x);
  const auto& t = (*out)[0];
  EXPECT_NEAR(t.logprob, kRow[t.token_id] - std::log(z), 1e-5);
  ASSERT_EQ(t.top_logprobs.size(), 2u);
  EXPECT_EQ(t.top_logprobs[0].first, 3);
  EXPECT_EQ(t.top_logprobs[1].first, 7);
  EXPECT_NEAR(t.top_logprobs[1].second, 2.5 - std::log(z), 1e-5);
}

TEST(SamplerTest, StopRules) {
  SamplingParams p;
  p.max_new_tokens = 3;
  p.stop_token_ids = {9};
  SamplerState s(p, {});
  const std::vector<int32_t> eos = {2};
  s.Append(5);
  EXPECT_EQ(CheckStop(s, 5, eos), FinishReason::kNone);
  s.Append(2);
  EXPECT_EQ(CheckStop(s, 2, eos), FinishReason::kStop);
  s.Append(9);
  EXPECT_EQ(CheckStop(s, 9, eos), FinishReason::kStop);
  SamplingParams q = p;
  q.ignore_eos = true;
  SamplerState t(q, {});
  t.Append(2);
  EXPECT_EQ(CheckStop(t, 2, eos), FinishReason::kNone);
  t.Append(1);
  t.Append(1);
  EXPECT_EQ(CheckStop(t, 1, eos), FinishReason::kLength);
}

TEST(SamplerTest, LogitBiasIsAddedPerRow) {
  SamplingParams forced;
  forced.logit_bias = {{4, 100.0f}, {3, -100.0f}};
  SamplingParams plain;
  SamplerState a(forced, {}), b(plain, {});
  auto got = Values(Sampler::ProcessRow(at::tensor(kRow), a));
  for (size_t i = 0; i < kRow.size(); ++i) {
    const float bias = i == 4 ? 100.0f : i == 3 ? -100.0f : 0.0f;
    EXPECT_FLOAT_EQ(got[i], kRow[i] + bias) << i;
  }
  // Each row its own bias: the forced row takes 4, its batch-mate still its argmax, 3 times.
  auto logits = at::stack({at::tensor(kRow), at::tensor(kRow)});
  SamplerState* states[] = {&a, &b};
  for (int step = 0; step < 3; ++step) {
    auto out = Sampler::Sample(logits, states);
    ASSERT_TRUE(out.ok());
    EXPECT_EQ((*out)[0].token_id, 4);
    EXPECT_EQ((*out)[1].token_id, 3);
  }
}

TEST(SamplerTest, MinTokensMasksEosAndStopIdsUntilReached) {
  SamplingParams p;
  p.min_tokens = 2;
  p.max_new_tokens = 8;
  p.stop_token_ids = {7};
  const std::vector<int32_t> eos = {3};
  SamplerState s(p, {}, eos);
  auto row = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  EXPECT_TRUE(std::isinf(row[3]) && row[3] < 0);
  EXPECT_TRUE(std::isinf(row[7]) && row[7] < 0);
  EXPECT_FLOAT_EQ(row[0], kRow[0]);
  SamplerState* states[] = {&s};
  auto first = Sampler::Sample(at::tensor(kRow).unsqueeze(0), states);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)[0].token_id, 0);                    // 3 (EOS) and 7 (2.5, a stop id) masked
  EXPECT_EQ(CheckStop(s, 3, eos), FinishReason::kNone);  // even a stop token: below min_tokens
  s.Append(5);
  row = Values(Sampler::ProcessRow(at::tensor(kRow), s));
  EXPECT_FLOAT_EQ(row[3], kRow[3]);  // two tokens generated: EOS is back
  EXPECT_EQ(CheckStop(s, 3, eos), FinishReason::kStop);
  // ignore_eos: only the stop ids are masked.
  p.ignore_eos = true;
  SamplerState t(p, {}, eos);
  row = Values(Sampler::ProcessRow(at::tensor(kRow), t));
  EXPECT_FLOAT_EQ(row[3], kRow[3]);
  EXPECT_TRUE(std::isinf(row[7]));
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 0.0f;
  auto st = ValidateSamplingParams(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("top_p"), std::string::npos);
  p = SamplingParams();
  p.temperature = -1;
  EXPECT_NE(ValidateSamplingParams(p).message().find("temperature"), std::string::npos);
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams()).ok());
}

}  // namespace
}  // namespace dropkv
