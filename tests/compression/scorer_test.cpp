// The scorer registry (scorer.h: every method but none has a scorer, scores of the documented
// shape, each scorer's selection rule) and the decode-time policy (decode_compression.h) on a
// press whose budgets are scripted.
#include "engine/compression/scorer.h"

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "engine/compression/decode_compression.h"

namespace dropkv::compression {
namespace {

TEST(ScorerRegistry, EveryMethodButNoneHasAScorer) {
  const PressModelInfo model{2, 4, 2, 16};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t n = 24, chunk = 24;
  LayerKvView v;
  v.layer_idx = 1;
  v.num_layers = 2;
  v.logical_len = n;
  v.queries = at::randn({4, chunk, 16}, gen, at::kFloat);
  v.keys = at::randn({2, n, 16}, gen, at::kFloat);
  v.values = at::randn({2, n, 16}, gen, at::kFloat);
  v.positions = at::arange(n, at::kLong).expand({2, n}).contiguous();
  const ScorerInput in{v, v.queries.unsqueeze(0), v.keys.unsqueeze(0), v.values.unsqueeze(0),
                       chunk};
  for (const auto& [method, name] : kScoreMethodNames) {
    SCOPED_TRACE(std::string(name));
    CompressionParams p;
    p.method = method;
    auto scorer = CreateScorer(p, model);
    if (method == ScoreMethod::kNone) {
      EXPECT_FALSE(scorer.ok());
      continue;
    }
    ASSERT_TRUE(scorer.ok()) << scorer.status();
    ASSERT_TRUE((*scorer)->Observe(in).ok());
    auto s = (*scorer)->Score(in);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->sizes(), (at::IntArrayRef{1, 2, n}));
    EXPECT_EQ(s->scalar_type(), at::kFloat);
    // The server protects the last W entries for every method.
    EXPECT_EQ((*scorer)->Selection().window, p.window);
    const bool pools = method == ScoreMethod::kDropKV;
    EXPECT_EQ((*scorer)->Selection().pooling, pools ? p.pooling : PoolingType::kNone);
  }
}

// Budgets of 10 entries per layer whatever the length; Select is never called here.
class FixedBudgets final : public KvSelector {
 public:
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView&) override {
    return std::optional<at::Tensor>();
  }
  absl::StatusOr<std::vector<int64_t>> Budgets(int64_t) const override {
    ++*calls;
    return std::vector<int64_t>{10, 10};
  }
  std::shared_ptr<int> calls = std::make_shared<int>(0);
};

TEST(DecodeCompression, CompactsTheLayersOverBudgetOnceOverBudgetPlusMargin) {
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  EXPECT_FALSE(DecodeCompression::Enabled(p));
  p.decode_margin = 4;
  EXPECT_TRUE(DecodeCompression::Enabled(p));

  auto press = std::make_unique<FixedBudgets>();
  std::shared_ptr<int> calls = press->calls;
  DecodeCompression d(std::move(press), /*margin=*/4, /*window=*/2);
  using Due = std::vector<bool>;
  // The first step: fewer than W decode queries, nothing is due and no budget is asked.
  EXPECT_EQ(d.LayersToCompact(30, std::vector<int64_t>{20, 12}), (Due{false, false}));
  EXPECT_EQ(*calls, 0);
  // Layer 0 over 10 + 4: both layers over 10 are compacted.
  EXPECT_EQ(d.LayersToCompact(31, std::vector<int64_t>{20, 12}), (Due{true, true}));
  EXPECT_EQ(*calls, 1);
  // Within budget + margin everywhere: nothing, and the budgets of the last check suffice.
  EXPECT_EQ(d.LayersToCompact(32, std::vector<int64_t>{14, 11}), (Due{false, false}));
  EXPECT_EQ(*calls, 1);
  d.AddEvicted(12);
  EXPECT_EQ(d.evicted_entries(), 12);
}

}  // namespace
}  // namespace dropkv::compression
