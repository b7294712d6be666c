// The FP8 KV cache (kv_cache_dtype: fp8, kernels/kv_cache_fp8.h) on the real SmolLM2-135M-Instruct
// in fp32 on the CPU, against the same model with an fp32 cache: the logits of every decode step
// teacher-forced on the fp32 cache's greedy tokens (KL, top-1 agreement), free-running greedy,
// DropKV's selections through the runner, and the DropKV / SnapKV / H2O scores of captured layers
// from FP8-rounded K/V against the exact ones. Also pool sizing: FP8 blocks cost a quarter of
// fp32's bytes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "allocator/block_pool.h"
#include "engine/compression/kv_selector.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/dropkv_score.h"
#include "kernels/kv_cache_fp8.h"
#include "kernels/scorers.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

std::unique_ptr<ModelRunner> MakeRunner(const std::string& kv_dtype) {
  RunnerOptions o;
  o.model_dir = testing::SmolLm2Dir().string();
  o.dtype = "float32";
  o.kv_cache_dtype = kv_dtype;
  o.num_kv_blocks = 1024;
  auto runner = ModelRunner::Create(o);
  EXPECT_TRUE(runner.ok()) << runner.status();
  if (!runner.ok()) return nullptr;
  (*runner)->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
  return std::move(*runner);
}

const char* const kPrompts[] = {
    "The history of the Roman Empire spans many centuries. It began when Augustus became the "
    "first emperor in 27 BC, and in the west it lasted until 476 AD. Its roads, laws and language "
    "shaped Europe for a thousand years. Describe the main reasons for its decline.",
    "Write a short Python function that returns the n-th Fibonacci number iteratively, then "
    "explain its running time and memory use in two sentences, and say how it compares with the "
    "recursive version that calls itself twice.",
    "Alice has three apples and buys five more. She gives two to Bob, who already had four, and "
    "Bob eats one. Carol then gives Alice twice as many apples as Bob has left. How many apples "
    "does each of them have now? Think step by step.",
};

std::vector<std::vector<int32_t>> Prompts() {
  auto tok = Tokenizer::FromDirectory(testing::SmolLm2Dir().string());
  EXPECT_TRUE(tok.ok()) << tok.status();
  std::vector<std::vector<int32_t>> out;
  if (!tok.ok()) return out;
  for (const char* p : kPrompts) {
    auto ids = (*tok)->Encode(p);
    EXPECT_TRUE(ids.ok()) << ids.status();
    if (ids.ok()) out.push_back(*ids);
  }
  return out;
}

// KL(p || q) per row of two fp32 logit matrices [N, vocab].
at::Tensor RowKl(const at::Tensor& p_logits, const at::Tensor& q_logits) {
  auto lp = p_logits.log_softmax(-1), lq = q_logits.log_softmax(-1);
  return (lp.exp() * (lp - lq)).sum(-1);
}

// Prefill `prompt` (in two chunks, so the second reads the stored cache) with `compression`, then
// decode: `forced` tokens when given (teacher forcing), else its own greedy picks. Returns the
// logits [1 + steps, vocab] (the prompt's last position, then every decode step) and the tokens.
struct Generated {
  at::Tensor logits;
  std::vector<int32_t> tokens;
};
Generated Generate(ModelRunner& runner, const std::vector<int32_t>& prompt, int steps,
                   const std::vector<int32_t>* forced, const CompressionParams& compression = {},
                   SequenceId seq = 1) {
  Generated run;
  const size_t half = prompt.size() / 2;
  const std::vector<int32_t> first(prompt.begin(), prompt.begin() + half);
  const std::vector<int32_t> second(prompt.begin() + half, prompt.end());
  EXPECT_TRUE(runner.Prefill(seq, first, false, compression).ok());
  auto out = runner.Prefill(seq, second, true, compression);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return run;
  std::vector<at::Tensor> rows{*out};
  for (int i = 0; i < steps; ++i) {
    const int32_t next = forced != nullptr
                             ? (*forced)[i]
                             : static_cast<int32_t>(rows.back().argmax().item<int64_t>());
    run.tokens.push_back(next);
    auto step = runner.Decode(std::span(&seq, 1), std::span(&next, 1));
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    rows.push_back((*step)[0]);
  }
  run.logits = at::stack(rows);
  return run;
}

constexpr int kSteps = 64;

// Measured (3 prompts, 2 x 65 rows each, 2026-12-02): see docs/model-runtime.md "FP8 KV cache".
// The bounds leave room for summation-order noise: agreement was 0.964 when the cache landed and
// 0.949 after later changes moved the fp32 forward's last bits (FP8 rounding of K/V turns those
// into flips at near-ties: 3 of 195 positions). A cache read back without its conversion (the
// bytes as int8, or e5m2) gives KL > 5.
constexpr double kMaxMeanKl = 0.02;
constexpr double kMinAgreement = 0.92;

TEST(KvFp8RealModelTest, DecodeLogitsKlAndGreedyAgreementAgainstAnFp32Cache) {
  auto full = MakeRunner("auto");
  auto fp8 = MakeRunner("fp8");
  ASSERT_TRUE(full && fp8);
  ASSERT_TRUE(kernels::IsFp8Cache(fp8->pool().key_cache()));
  std::vector<at::Tensor> kls, agree;
  int64_t free_running_prefix = 0, num_tokens = 0;
  for (const auto& prompt : Prompts()) {
    const Generated ref = Generate(*full, prompt, kSteps, nullptr);
    full->Release(1);
    const Generated forced = Generate(*fp8, prompt, kSteps, &ref.tokens);
    fp8->Release(1);
    ASSERT_EQ(forced.logits.sizes(), ref.logits.sizes());
    // Row i predicts token i of the continuation (row 0: the prompt's last position).
    kls.push_back(RowKl(ref.logits, forced.logits));
    agree.push_back(ref.logits.argmax(-1).eq(forced.logits.argmax(-1)).to(at::kFloat));
    const Generated own = Generate(*fp8, prompt, kSteps, nullptr);
    fp8->Release(1);
    free_running_prefix +=
        std::mismatch(own.tokens.begin(), own.tokens.end(), ref.tokens.begin()).first -
        own.tokens.begin();
    num_tokens += kSteps;
  }
  const auto kl = at::cat(kls);
  const double mean_kl = kl.mean().item<double>();
  const double agreement = at::cat(agree).mean().item<double>();
  std::cout << "[fp8 kv] " << kl.size(0) << " positions (prompt end + " << kSteps
            << " teacher-forced decode steps x 3 prompts): mean KL(fp32 cache || fp8 cache) "
            << mean_kl << " (median " << kl.median().item<double>() << ", max "
            << kl.max().item<double>() << "), top-1 agreement " << agreement
            << "; free-running fp8 greedy equals the fp32 cache's first " << free_running_prefix
            << " of " << num_tokens << " tokens\n";
  EXPECT_LT(mean_kl, kMaxMeanKl);
  EXPECT_GE(agreement, kMinAgreement);
  // Not bit-equal: the cache really holds FP8.
  EXPECT_GT(mean_kl, 0.0);
}

// DropKV at keep 25% through the runner (prefill in two chunks, the selector scoring the FP8 K/V
// the cache holds): which positions each layer's heads keep, against the fp32 cache's run, and
// the compressed decode's KL.
TEST(KvFp8RealModelTest, DropKvSelectionsThroughTheRunner) {
  auto full = MakeRunner("auto");
  auto fp8 = MakeRunner("fp8");
  ASSERT_TRUE(full && fp8);
  CompressionParams comp;
  comp.method = ScoreMethod::kDropKV;
  comp.keep_ratio = 0.25;
  comp.chunk_policy = ChunkPolicy::kLastChunk;
  double overlap_sum = 0;
  int64_t num_heads = 0;
  std::vector<at::Tensor> kls;
  const int32_t num_layers = full->config().num_layers;
  for (const auto& prompt : Prompts()) {
    const Generated ref = Generate(*full, prompt, 16, nullptr, comp);
    const Generated got = Generate(*fp8, prompt, 16, &ref.tokens, comp);
    kls.push_back(RowKl(ref.logits, got.logits));
    for (int32_t l = 0; l < num_layers; ++l) {
      auto a = full->StoredPositions(1, l);
      auto b = fp8->StoredPositions(1, l);
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_EQ(a->sizes(), b->sizes()) << "layer " << l;
      // Prefill's kept positions only (decode appends are the same positions in both).
      const int64_t kept = a->size(1) - 16;
      for (int64_t h = 0; h < a->size(0); ++h) {
        auto pa = (*a)[h].narrow(0, 0, kept), pb = (*b)[h].narrow(0, 0, kept);
        overlap_sum += at::isin(pa, pb).to(at::kFloat).mean().item<double>();
        ++num_heads;
      }
    }
    full->Release(1);
    fp8->Release(1);
  }
  const double overlap = overlap_sum / static_cast<double>(num_heads);
  const auto kl = at::cat(kls);
  std::cout << "[fp8 kv] DropKV keep 0.25: kept positions shared with the fp32 cache's run "
            << overlap << " (mean over " << num_heads << " layer-heads x prompts); compressed "
            << "decode mean KL " << kl.mean().item<double>() << " (max " << kl.max().item<double>()
            << ")\n";
  // Measured 0.98 and KL 0.106 (max 0.77): the compressed cache is more sensitive than the full
  // one (a few different kept tokens per head, and FP8 on what is left).
  EXPECT_GE(overlap, 0.95);
  EXPECT_LT(kl.mean().item<double>(), 0.2);
}

// Records each layer's view (on the CPU) before the wrapped selector sees it.
class RecordingSelector : public KvSelector {
 public:
  RecordingSelector(std::unique_ptr<KvSelector> inner, std::map<int32_t, LayerKvView>* views)
      : inner_(std::move(inner)), views_(views) {}
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    LayerKvView copy = view;
    copy.queries = view.queries.clone();
    copy.keys = view.keys.clone();
    copy.values = view.values.clone();
    (*views_)[view.layer_idx] = copy;
    return inner_->Select(view);
  }
  int64_t num_attention_rows() const override { return inner_->num_attention_rows(); }

 private:
  std::unique_ptr<KvSelector> inner_;
  std::map<int32_t, LayerKvView>* views_;
};

// Mean over heads of |top-k(a) & top-k(b)| / k, per head of scores [1, Hkv, n].
double TopKOverlap(const at::Tensor& a, const at::Tensor& b, int64_t k) {
  auto ia = std::get<1>(a.topk(k, -1)), ib = std::get<1>(b.topk(k, -1));
  double sum = 0;
  for (int64_t h = 0; h < a.size(1); ++h)
    sum += at::isin(ia[0][h], ib[0][h]).to(at::kFloat).mean().item<double>();
  return sum / static_cast<double>(a.size(1));
}

// The scoring kernels on one layer's exact K/V against the same K/V rounded to FP8 (the same
// queries): what the FP8 cache changes in the scores alone, and in the top-10% / 25% they select.
// Measured (2026-12-02, 30 layers of one prompt): relative L2 error of the scores, mean (max) over
// layers: DropKV 0.107 (0.95), H2O with ||v||_2 0.056 (0.11), SnapKV 0.0034 (0.0075); top-10%
// overlap 0.95 / 0.92 / 0.99. DropKV's error sits in its largest scores: w = (p / (1 - p))^2 of
// a sink key with p near 1 moves by several times when p moves by 1%, and that key is kept
// either way; its selections agree as well as the others'.
const std::map<std::string, double> kMaxMeanRelError = {
    {"dropkv", 0.2}, {"h2o_vl2", 0.1}, {"snapkv", 0.01}};
TEST(KvFp8RealModelTest, ScoresFromFp8KvAgainstExactKv) {
  auto full = MakeRunner("auto");
  ASSERT_TRUE(full);
  std::map<int32_t, LayerKvView> views;
  CompressionParams comp;
  comp.method = ScoreMethod::kDropKV;
  comp.keep_ratio = 0.25;
  auto inner = compression::CreateKvSelectorForModel(comp, full->config());
  ASSERT_TRUE(inner.ok()) << inner.status();
  RecordingSelector selector(std::move(*inner), &views);
  const auto prompts = Prompts();
  ASSERT_TRUE(full->PrefillWithSelector(1, prompts[0], true, &selector).ok());
  ASSERT_FALSE(views.empty());
  constexpr int64_t kWindow = 8;
  struct Stat {
    double max_rel = 0, sum_rel = 0, sum_top10 = 0, sum_top25 = 0, min_top10 = 1;
    int n = 0;
  };
  std::map<std::string, Stat> stats;
  for (const auto& [layer, view] : views) {
    const int64_t n = view.keys.size(1);
    auto q = view.queries.unsqueeze(0);  // [1, Hq, T, D]
    auto qw = q.narrow(2, q.size(2) - kWindow, kWindow);
    auto k = view.keys.unsqueeze(0), v = view.values.unsqueeze(0);
    auto k8 = kernels::RoundTripKv(k), v8 = kernels::RoundTripKv(v);
    std::map<std::string, std::pair<at::Tensor, at::Tensor>> scores;
    scores["dropkv"] = {*kernels::DropKvScores(qw, k, v), *kernels::DropKvScores(qw, k8, v8)};
    scores["snapkv"] = {*kernels::SnapKvScores(qw, k), *kernels::SnapKvScores(qw, k8)};
    kernels::H2oParams h2o;
    h2o.value_norm_p = 2;
    scores["h2o_vl2"] = {*kernels::H2oScores(q, k, v, h2o), *kernels::H2oScores(q, k8, v8, h2o)};
    for (const auto& [name, pair] : scores) {
      const auto& [exact, rounded] = pair;
      const double rel = ((rounded - exact).norm() / exact.norm()).item<double>();
      Stat& s = stats[name];
      s.max_rel = std::max(s.max_rel, rel);
      s.sum_rel += rel;
      const double top10 = TopKOverlap(exact, rounded, std::max<int64_t>(1, n / 10));
      s.sum_top10 += top10;
      s.min_top10 = std::min(s.min_top10, top10);
      s.sum_top25 += TopKOverlap(exact, rounded, std::max<int64_t>(1, n / 4));
      ++s.n;
    }
  }
  for (const auto& [name, s] : stats) {
    std::cout << "[fp8 kv] " << name << " scores over " << s.n << " layers: relative L2 error mean "
              << s.sum_rel / s.n << " (max " << s.max_rel << "); top-10% overlap mean "
              << s.sum_top10 / s.n << " (min " << s.min_top10 << "), top-25% " << s.sum_top25 / s.n
              << "\n";
    EXPECT_LT(s.sum_rel / s.n, kMaxMeanRelError.at(name)) << name;
    EXPECT_GE(s.sum_top10 / s.n, 0.9) << name;
    EXPECT_GE(s.sum_top25 / s.n, 0.9) << name;
  }
}

// Pool sizing: the same byte budget holds 4x fp32's blocks (one byte per element), and the
// setting is validated by name.
TEST(KvFp8RealModelTest, PoolCountsFp8Bytes) {
  RunnerOptions o;
  o.model_dir = testing::SmolLm2Dir().string();
  o.dtype = "float32";
  o.kv_cache_bytes = int64_t{64} << 20;
  auto f32 = ModelRunner::Create(o);
  o.kv_cache_dtype = "fp8";
  auto f8 = ModelRunner::Create(o);
  ASSERT_TRUE(f32.ok() && f8.ok());
  EXPECT_EQ((*f8)->pool().key_cache().element_size(), 1);
  // K + V of a 16-slot block: 2 x 16 x 3 KV heads x 64 x (4 or 1) bytes.
  EXPECT_EQ((*f32)->pool().num_blocks(), o.kv_cache_bytes / (2 * 16 * 3 * 64 * 4));
  EXPECT_EQ((*f8)->pool().num_blocks(), o.kv_cache_bytes / (2 * 16 * 3 * 64));
  o.kv_cache_dtype = "int8";
  auto bad = ModelRunner::Create(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("kv_cache_dtype"), std::string::npos);
}

}  // namespace
}  // namespace dropkv
