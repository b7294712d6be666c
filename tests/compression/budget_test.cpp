// Invariants of the DepthKV budget allocators (algorithms.md section 4) over random and edge-case
// (L, n, keep), plus hand-derived values of the PyramidKV formula (kvpress 0.5.5, beta 20).
#include "engine/compression/budget.h"

#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

namespace dropkv::compression {
namespace {

int64_t Sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// The exact-global-budget contract, written independently of the implementation.
int64_t ExpectedTotal(int32_t num_layers, int64_t n, double keep, int64_t min_keep) {
  int64_t t = std::llround(static_cast<double>(num_layers) * keep * static_cast<double>(n));
  return std::clamp<int64_t>(t, num_layers * min_keep, num_layers * n);
}

std::vector<double> RandomProfile(int32_t num_layers, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(0.05, 5.0);
  std::vector<double> v(num_layers);
  for (auto& x : v) x = d(rng);
  return v;
}

const BudgetAllocator kAll[] = {BudgetAllocator::kUniform, BudgetAllocator::kPyramid,
                                BudgetAllocator::kMLP,     BudgetAllocator::kMGA,
                                BudgetAllocator::kMLMA2,   BudgetAllocator::kMLMA4,
                                BudgetAllocator::kMLMA6,   BudgetAllocator::kExplicit};

TEST(Budget, RandomInvariantsAllAllocators) {
  std::mt19937_64 rng(1234);
  int num_checked = 0, num_infeasible = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int32_t num_layers = std::uniform_int_distribution<int32_t>(1, 48)(rng);
    int64_t n = std::uniform_int_distribution<int64_t>(0, 5000)(rng);
    if (trial % 7 == 0) n = std::uniform_int_distribution<int64_t>(0, 12)(rng);  // around W
    double keep = std::uniform_real_distribution<double>(1e-4, 1.0)(rng);
    if (trial % 11 == 0) keep = 1.0;
    if (trial % 13 == 0) keep = 1e-6;
    BudgetOptions o;
    o.allocator = kAll[trial % 8];
    o.keep_ratio = keep;
    o.window = std::uniform_int_distribution<int64_t>(1, 16)(rng);
    o.num_protected_sinks = trial % 3 == 0 ? 4 : 0;
    o.profile_values = RandomProfile(num_layers, rng);
    if (trial % 2) o.mga_importance = MgaImportance::kRank;
    std::uniform_real_distribution<double> rho(0.0, 0.99);
    for (int32_t l = 0; l < num_layers; ++l) o.explicit_layer_prune.push_back(rho(rng));

    auto budgets = AllocateLayerBudgets(o, num_layers, n);
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << " L=" << num_layers << " n=" << n << " keep=" << keep
                 << " W=" << o.window << " alloc=" << static_cast<int>(o.allocator));
    const auto protected_layers = ProtectedLayers(o.allocator, num_layers);
    if (!budgets.ok()) {
      // Only protection schemes may be infeasible, and only when protection exceeds the budget.
      ASSERT_FALSE(protected_layers.empty()) << budgets.status();
      ASSERT_EQ(budgets.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(budgets.status().message().find("whole needs"), std::string::npos)
          << budgets.status();
      ++num_infeasible;
      continue;
    }
    ++num_checked;
    ASSERT_EQ(budgets->size(), static_cast<size_t>(num_layers));
    if (n <= o.window) {  // no eviction
      for (int64_t b : *budgets) EXPECT_EQ(b, n);
      continue;
    }
    const int64_t min_keep = std::min(n, o.window + o.num_protected_sinks);
    for (int64_t b : *budgets) {
      EXPECT_GE(b, min_keep);
      EXPECT_LE(b, n);
    }
    if (o.allocator == BudgetAllocator::kExplicit) {
      double real_sum = 0;
      for (double r : o.explicit_layer_prune) real_sum += (1.0 - r) * n;
      EXPECT_EQ(Sum(*budgets),
                std::clamp<int64_t>(std::llround(real_sum), num_layers * min_keep, num_layers * n));
    } else {
      EXPECT_EQ(Sum(*budgets), ExpectedTotal(num_layers, n, keep, min_keep));
    }
    for (int32_t l : protected_layers) EXPECT_EQ((*budgets)[l], n) << "protected layer " << l;
    if (keep == 1.0 && o.allocator != BudgetAllocator::kExplicit) {
      for (int64_t b : *budgets) EXPECT_EQ(b, n);
    }
  }
  EXPECT_GT(num_checked, 2000);
  EXPECT_GT(num_infeasible, 0);  // the random sweep does hit the infeasible region
}

TEST(Budget, UniformIsFloorOrCeilOfTheShare) {
  BudgetOptions o;
  o.keep_ratio = 0.1;
  auto b = AllocateLayerBudgets(o, 7, 1001);  // 7 * 100.1 = 700.7 -> 701
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Sum(*b), 701);
  for (int64_t x : *b) EXPECT_TRUE(x == 100 || x == 101) << x;
  // Largest remainder with equal remainders: the lowest layers get the extra unit.
  EXPECT_EQ((*b)[0], 101);
  EXPECT_EQ((*b)[6], 100);
}

TEST(Budget, KeepNearZeroFloorsAtWindow) {
  BudgetOptions o;
  o.keep_ratio = 1e-9;
  o.window = 8;
  auto b = AllocateLayerBudgets(o, 5, 4096);
  ASSERT_TRUE(b.ok());
  for (int64_t x : *b) EXPECT_EQ(x, 8);
  o.num_protected_sinks = 4;
  b = AllocateLayerBudgets(o, 5, 4096);
  ASSERT_TRUE(b.ok());
  for (int64_t x : *b) EXPECT_EQ(x, 12);
}

TEST(Budget, ShortPromptIsNotEvicted) {
  BudgetOptions o;
  o.keep_ratio = 0.1;
  o.window = 8;
  for (int64_t n : {0, 1, 7, 8}) {
    auto b = AllocateLayerBudgets(o, 3, n);
    ASSERT_TRUE(b.ok());
    for (int64_t x : *b) EXPECT_EQ(x, n);
  }
}

TEST(Budget, MiddleLayerProtection) {
  BudgetOptions o;
  o.allocator = BudgetAllocator::kMLP;
  o.keep_ratio = 0.5;
  // L = 8: layers 4 and 5 (0-based) whole; the other 6 share 8*0.5*100 - 200 = 200.
  auto b = AllocateLayerBudgets(o, 8, 100);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)[4], 100);
  EXPECT_EQ((*b)[5], 100);
  EXPECT_EQ(Sum(*b), 400);
  for (int l : {0, 1, 2, 3, 6, 7}) EXPECT_TRUE((*b)[l] == 33 || (*b)[l] == 34);
  EXPECT_EQ(ProtectedLayers(BudgetAllocator::kMLMA4, 8), (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_EQ(ProtectedLayers(BudgetAllocator::kMLMA6, 8), (std::vector<int32_t>{2, 3, 4, 5, 6, 7}));
  // rho_l = rho * L / (L - 2) > 1: an error that says why.
  o.keep_ratio = 0.2;
  b = AllocateLayerBudgets(o, 8, 100);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("mlp"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("[4, 5]"), std::string::npos) << b.status();
}

TEST(Budget, MgaFollowsInverseInfoNce) {
  BudgetOptions o;
  o.allocator = BudgetAllocator::kMGA;
  o.keep_ratio = 0.25;
  o.window = 4;
  o.profile_values = {1.0, 2.0, 4.0, 0.5};  // s = 1, 0.5, 0.25, 2 -> shares 8:4:2:16 of 1000
  auto b = AllocateLayerBudgets(o, 4, 1000);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Sum(*b), 1000);
  // No clipping: exact proportional shares 266.67, 133.33, 66.67, 533.33.
  EXPECT_EQ(*b, (std::vector<int64_t>{267, 133, 67, 533}));
  // Clipped at n: layer 3 wants 2 * 1000 * 16/30 > n = 1000 -> water-fill the rest.
  o.keep_ratio = 0.5;
  b = AllocateLayerBudgets(o, 4, 1000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[3], 1000);
  EXPECT_EQ(Sum(*b), 2000);
  EXPECT_EQ(*b, (std::vector<int64_t>{571, 286, 143, 1000}));  // 1000 * (8, 4, 2) / 14
  // Rank-based: weights 3, 2, 1, 4 over 10.
  o.keep_ratio = 0.25;
  o.mga_importance = MgaImportance::kRank;
  b = AllocateLayerBudgets(o, 4, 1000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int64_t>{300, 200, 100, 400}));
}

TEST(Budget, PyramidMatchesHandDerivedKvpressFormula) {
  // n = 160, W = 8, L = 4, keep 0.75: max_capacity 128, min 6, max 234 >= 152 -> max 152,
  // min 88, steps 64/3: 152, 130.67, 109.33, 88.
  BudgetOptions o;
  o.allocator = BudgetAllocator::kPyramid;
  o.keep_ratio = 0.75;
  auto b = AllocateLayerBudgets(o, 4, 160);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (std::vector<int64_t>{152, 131, 109, 88}));
  o.rounding = BudgetRounding::kKvpress;
  EXPECT_EQ(*AllocateLayerBudgets(o, 4, 160), (std::vector<int64_t>{152, 131, 109, 88}));
  // keep 0.25: min_num 2 < W -> kvpress falls back to round(n * keep) per layer.
  o.keep_ratio = 0.25;
  EXPECT_EQ(*AllocateLayerBudgets(o, 4, 160), (std::vector<int64_t>(4, 40)));
  o.rounding = BudgetRounding::kExactGlobal;
  EXPECT_EQ(*AllocateLayerBudgets(o, 4, 160), (std::vector<int64_t>(4, 40)));
}

TEST(Budget, ConversionsAndValidation) {
  EXPECT_DOUBLE_EQ(*KeepRatioFromCompressionRatio(0.25), 0.75);
  EXPECT_FALSE(KeepRatioFromCompressionRatio(1.0).ok());
  EXPECT_FALSE(KeepRatioFromCompressionRatio(-0.1).ok());
  EXPECT_DOUBLE_EQ(*KeepRatioFromBudgetTokens(100, 1000), 0.1);
  EXPECT_DOUBLE_EQ(*KeepRatioFromBudgetTokens(5000, 1000), 1.0);
  EXPECT_FALSE(KeepRatioFromBudgetTokens(0, 1000).ok());

  BudgetOptions o;
  o.keep_ratio = 0.0;
  auto s = ValidateBudgetOptions(o, 4);
  EXPECT_NE(s.message().find("keep_ratio"), std::string::npos) << s;
  o.keep_ratio = 0.5;
  o.allocator = BudgetAllocator::kMGA;
  o.profile_values = {1.0, 2.0};
  s = ValidateBudgetOptions(o, 4);
  EXPECT_NE(s.message().find("profile has 2 values"), std::string::npos) << s;
  o.profile_values = {1.0, 2.0, -1.0, 3.0};
  s = ValidateBudgetOptions(o, 4);
  EXPECT_NE(s.message().find("layer 2"), std::string::npos) << s;
  o.allocator = BudgetAllocator::kExplicit;
  o.explicit_layer_prune = {0.1, 0.2, 1.5, 0.0};
  s = ValidateBudgetOptions(o, 4);
  EXPECT_NE(s.message().find("explicit_layer_prune[2]"), std::string::npos) << s;
}

TEST(Budget, ProfileRoundTrip) {
  LayerProfile p;
  p.model = "tiny";
  p.num_layers = 3;
  p.metric = "infonce";
  p.values = {0.5, 1.25, 2.0};
  p.num_texts = 9;
  auto path = (std::filesystem::temp_directory_path() / "dropkv_profile_test.json").string();
  ASSERT_TRUE(SaveLayerProfile(p, path).ok());
  auto q = LoadLayerProfile(path);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->values, p.values);
  EXPECT_EQ(q->num_texts, 9);
  EXPECT_FALSE(LoadLayerProfile(path + ".missing").ok());
}

}  // namespace
}  // namespace dropkv::compression
