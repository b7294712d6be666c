// The adaptive allocator's split (engine/compression/adaptive_budget.h) against a greedy in fp64
// that hands out the budget one entry at a time to the layer whose next entry is worth most.
#include "engine/compression/adaptive_budget.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numeric>

#include <gtest/gtest.h>

#include "engine/compression/params.h"

namespace dropkv::compression {
namespace {

// The definition, one entry at a time: a layer's k-th extra entry is worth the sum over its heads
// of their k-th largest unprotected share.
std::vector<int64_t> GreedySplit(const std::vector<at::Tensor>& pooled,
                                 const std::vector<int64_t>& uniform, int32_t window,
                                 int32_t sinks) {
  const size_t layers = pooled.size();
  std::vector<std::vector<double>> gains(layers);
  std::vector<int64_t> keep(layers), protect(layers);
  int64_t budget = 0;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor s = pooled[l][0].to(at::kDouble);
    const int64_t hkv = s.size(0), n = s.size(1);
    protect[l] = std::min<int64_t>(n, window + sinks);
    std::vector<std::vector<double>> shares(hkv);
    for (int64_t h = 0; h < hkv; ++h) {
      double sum = 0;
      for (int64_t j = sinks; j < n - window; ++j) sum += s[h][j].item<double>();
      for (int64_t j = sinks; j < n - window; ++j)
        shares[h].push_back(s[h][j].item<double>() / sum);
      std::sort(shares[h].rbegin(), shares[h].rend());
    }
    for (int64_t j = 0; j < n - protect[l]; ++j) {
      double g = 0;
      for (int64_t h = 0; h < hkv; ++h) g += shares[h][j];
      gains[l].push_back(g);
    }
    const int64_t u = std::min(uniform[l], n);
    budget += u;
    keep[l] = std::min(
        n, std::max<int64_t>(protect[l], static_cast<int64_t>(std::ceil(kAdaptiveFloorShare * u))));
    budget -= keep[l];
  }
  for (; budget > 0; --budget) {
    size_t best = layers;
    double best_gain = -1;
    for (size_t l = 0; l < layers; ++l) {
      const int64_t next = keep[l] - protect[l];
      if (next < static_cast<int64_t>(gains[l].size()) && gains[l][next] > best_gain) {
        best = l;
        best_gain = gains[l][next];
      }
    }
    ++keep[best];
  }
  return keep;
}

TEST(AdaptiveBudgets, EqualTheGreedySplitOfTheUniformTotal) {
  at::manual_seed(3);
  const int32_t window = 8;
  for (const int32_t sinks : {0, 4}) {
    for (const int64_t n : {int64_t{120}, int64_t{300}}) {
      SCOPED_TRACE("n " + std::to_string(n) + ", sinks " + std::to_string(sinks));
      std::vector<at::Tensor> pooled;
      // Layers from flat to peaked: the peaked ones need few entries, the flat ones many.
      for (const double peak : {0.0, 1.0, 3.0, 6.0, 10.0}) {
        pooled.push_back((at::randn({1, 2, n}, at::kDouble) * peak).exp().to(at::kFloat));
      }
      const std::vector<int64_t> uniform(pooled.size(), n / 4);
      auto got = AdaptiveLayerBudgets(pooled, uniform, window, sinks);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, GreedySplit(pooled, uniform, window, sinks));
      EXPECT_EQ(std::accumulate(got->begin(), got->end(), int64_t{0}),
                std::accumulate(uniform.begin(), uniform.end(), int64_t{0}));
      EXPECT_GT(got->front(), got->back());  // the flat layer takes from the peaked one
      for (size_t l = 0; l < got->size(); ++l) {
        EXPECT_GE((*got)[l], std::ceil(kAdaptiveFloorShare * uniform[l])) << "layer " << l;
        EXPECT_GE((*got)[l], window + sinks) << "layer " << l;
        EXPECT_LE((*got)[l], n) << "layer " << l;
      }
    }
  }
}

TEST(AdaptiveBudgets, RefuseMismatchedInputs) {
  const std::vector<at::Tensor> pooled = {at::rand({1, 2, 50}), at::rand({1, 2, 50})};
  EXPECT_FALSE(AdaptiveLayerBudgets(pooled, std::vector<int64_t>{10}, 8, 0).ok());
  EXPECT_FALSE(AdaptiveLayerBudgets(std::vector<at::Tensor>{at::rand({2, 50})},
                                    std::vector<int64_t>{10}, 8, 0)
                   .ok());
}

}  // namespace
}  // namespace dropkv::compression
