// The automatic budget (CompressionParams::tolerance): DropKV's output energy against an fp64
// brute force, the fewest entries whose evicted scores stay within tolerance^2 of it on every KV
// head (against the same count worked out here in fp64), the keep ratio as a ceiling, and the
// settings it refuses.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/compression/scorer.h"

namespace dropkv::compression {
namespace {

constexpr int32_t kQHeads = 4, kKvHeads = 2, kDim = 16;
const PressModelInfo kModel{1, kQHeads, kKvHeads, kDim};

struct Inputs {
  at::Tensor q, k, v;  // [Hq, n, D], [Hkv, n, D]
};

// Peaky attention (a few entries carry most of the mass), as trained models' heads have.
Inputs RandomInputs(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Inputs in;
  in.q = at::randn({kQHeads, n, kDim}, gen, at::kFloat) * 3.0;
  in.k = at::randn({kKvHeads, n, kDim}, gen, at::kFloat);
  in.v = at::randn({kKvHeads, n, kDim}, gen, at::kFloat);
  return in;
}

LayerKvView View(const Inputs& in) {
  const int64_t n = in.k.size(1);
  LayerKvView view;
  view.layer_idx = 0;
  view.num_layers = 1;
  view.logical_len = n;
  view.queries = in.q;
  view.keys = in.k;
  view.values = in.v;
  view.positions = at::arange(n, at::kLong).expand({kKvHeads, n}).contiguous();
  return view;
}

// fp64: sum over the last W queries of ||a_t||^2, averaged over each KV head's query heads.
std::vector<double> EnergyFp64(const Inputs& in, int64_t window) {
  const int64_t n = in.k.size(1), g = kQHeads / kKvHeads;
  std::vector<double> energy(kKvHeads, 0.0);
  const at::Tensor q = in.q.to(at::kDouble), k = in.k.to(at::kDouble), v = in.v.to(at::kDouble);
  for (int64_t h = 0; h < kQHeads; ++h) {
    for (int64_t t = n - window; t < n; ++t) {
      const at::Tensor logits =
          at::matmul(k[h / g].slice(0, 0, t + 1), q[h][t]) / std::sqrt(double{kDim});
      const at::Tensor a = at::matmul(at::softmax(logits, 0), v[h / g].slice(0, 0, t + 1));
      energy[h / g] += a.pow(2).sum().item<double>() / static_cast<double>(g);
    }
  }
  return energy;
}

CompressionParams AutoParams(double keep_ceiling, double tolerance) {
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = keep_ceiling;
  p.tolerance = tolerance;
  // The order is the scores' own (no pooling, no lookback): the fp64 count below follows it.
  p.pooling = PoolingType::kNone;
  p.pooling_lookback = 0;
  return p;
}

// Kept entries per head with `params`, or everything (nullopt -> n).
int64_t KeptCount(const CompressionParams& params, const Inputs& in) {
  auto press = CreateKvSelector(params, kModel);
  EXPECT_TRUE(press.ok()) << press.status();
  auto kept = (*press)->Select(View(in));
  EXPECT_TRUE(kept.ok()) << kept.status();
  return kept->has_value() ? (*kept)->size(1) : in.k.size(1);
}

TEST(AutoBudget, OutputEnergyMatchesFp64BruteForce) {
  const int64_t n = 96;
  const Inputs in = RandomInputs(n, 3);
  CompressionParams p = AutoParams(1.0, 0.1);
  auto scorer = CreateScorer(p, kModel);
  ASSERT_TRUE(scorer.ok());
  const LayerKvView view = View(in);
  const ScorerInput si{view, in.q.unsqueeze(0), in.k.unsqueeze(0), in.v.unsqueeze(0), n};
  auto energy = (*scorer)->OutputEnergy(si);
  ASSERT_TRUE(energy.ok()) << energy.status();
  ASSERT_EQ(energy->sizes(), (at::IntArrayRef{1, kKvHeads}));
  const std::vector<double> want = EnergyFp64(in, p.window);
  for (int64_t h = 0; h < kKvHeads; ++h) {
    EXPECT_NEAR((*energy)[0][h].item<double>(), want[h], 1e-4 * want[h]) << "head " << h;
  }
  // The other scorers' scores are not output shifts.
  p.method = ScoreMethod::kSnapKV;
  auto snap = CreateScorer(p, kModel);
  ASSERT_TRUE(snap.ok());
  EXPECT_FALSE((*snap)->OutputEnergy(si).ok());
}

TEST(AutoBudget, KeepsTheFewestEntriesWithinToleranceOnEveryHead) {
  const int64_t n = 200;
  for (uint64_t seed : {1, 2, 3}) {
    const Inputs in = RandomInputs(n, seed);
    const CompressionParams base = AutoParams(1.0, 0.1);
    auto scorer = CreateScorer(base, kModel);
    ASSERT_TRUE(scorer.ok());
    const LayerKvView view = View(in);
    const ScorerInput si{view, in.q.unsqueeze(0), in.k.unsqueeze(0), in.v.unsqueeze(0), n};
    auto scores = (*scorer)->Score(si);
    ASSERT_TRUE(scores.ok());
    const at::Tensor s = scores->to(at::kDouble)[0];  // [Hkv, n]
    const std::vector<double> energy = EnergyFp64(in, base.window);
    for (double tolerance : {0.02, 0.1, 0.3}) {
      SCOPED_TRACE(testing::Message() << "seed " << seed << " tolerance " << tolerance);
      // Per head: the window first, then the entries by score; the fewest kept so that the rest
      // carry at most tolerance^2 of the energy.
      int64_t want = 0;
      for (int64_t h = 0; h < kKvHeads; ++h) {
        std::vector<double> ranked;
        for (int64_t j = 0; j < n - base.window; ++j) ranked.push_back(s[h][j].item<double>());
        std::sort(ranked.rbegin(), ranked.rend());
        double evicted = 0;
        for (double x : ranked) evicted += x;
        int64_t keep = base.window;
        for (size_t i = 0; i < ranked.size() && evicted > tolerance * tolerance * energy[h]; ++i) {
          evicted -= ranked[i];
          ++keep;
        }
        want = std::max(want, keep);
      }
      const int64_t got = KeptCount(AutoParams(1.0, tolerance), in);
      // fp32 against fp64 sums: a boundary entry may fall either way.
      EXPECT_NEAR(static_cast<double>(got), static_cast<double>(want), 1.0);
      EXPECT_LT(got, n);
      // The keep ratio is a ceiling; a tolerance too tight for it keeps exactly the ceiling.
      EXPECT_EQ(KeptCount(AutoParams(0.05, tolerance), in), std::min<int64_t>(got, 10));
    }
    // Tighter tolerances keep more.
    EXPECT_GE(KeptCount(AutoParams(1.0, 0.02), in), KeptCount(AutoParams(1.0, 0.1), in));
    EXPECT_GE(KeptCount(AutoParams(1.0, 0.1), in), KeptCount(AutoParams(1.0, 0.3), in));
  }
}

TEST(AutoBudget, TheWindowAndSinksStayWhateverTheTolerance) {
  const int64_t n = 120;
  const Inputs in = RandomInputs(n, 9);
  CompressionParams p = AutoParams(1.0, 0.99);
  p.protect_sinks = true;
  p.num_sinks = 4;
  auto press = CreateKvSelector(p, kModel);
  ASSERT_TRUE(press.ok());
  auto kept = (*press)->Select(View(in));
  ASSERT_TRUE(kept.ok() && kept->has_value());
  for (int64_t h = 0; h < kKvHeads; ++h) {
    const at::Tensor idx = (**kept)[h];
    ASSERT_GE(idx.size(0), p.window + p.num_sinks);
    for (int64_t j = 0; j < p.num_sinks; ++j) EXPECT_EQ(idx[j].item<int64_t>(), j);
    for (int64_t j = 0; j < p.window; ++j) {
      EXPECT_EQ(idx[idx.size(0) - 1 - j].item<int64_t>(), n - 1 - j);
    }
  }
}

TEST(AutoBudget, RefusesMethodsWithoutOutputShiftsAndValuesOutOfRange) {
  CompressionParams p = AutoParams(0.5, 0.1);
  EXPECT_TRUE(ValidateCompression(p, 4).ok());
  p.method = ScoreMethod::kSnapKV;
  absl::Status s = ValidateCompression(p, 4);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("tolerance"), std::string::npos) << s;
  for (double bad : {-0.1, 1.0, 2.0}) {
    p = AutoParams(0.5, bad);
    s = ValidateCompression(p, 4);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.message().rfind("tolerance", 0), 0u) << s;
  }
}

}  // namespace
}  // namespace dropkv::compression
