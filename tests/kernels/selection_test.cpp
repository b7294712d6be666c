// Selection against loops: pooling with torch's padding semantics, protection, top-k, gather.
#include "kernels/selection.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace dropkv::kernels {
namespace {

TEST(SelectionTest, PoolingMatchesLoops) {
  at::manual_seed(21);
  for (int32_t kern : {1, 3, 5, 11}) {
    for (int64_t n : {1, 4, 13, 40}) {
      auto s = at::randn({2, 3, n});
      auto mx = PoolScores(s, PoolType::kPoolTypeMax, kern);
      auto av = PoolScores(s, PoolType::kPoolTypeAvg, kern);
      ASSERT_TRUE(mx.ok() && av.ok()) << mx.status() << av.status();
      auto sa = s.accessor<float, 3>();
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 3; ++h)
          for (int64_t j = 0; j < n; ++j) {
            float m = -1e30f;
            double sum = 0;
            for (int64_t t = j - kern / 2; t <= j + kern / 2; ++t)
              if (t >= 0 && t < n) m = std::max(m, sa[b][h][t]), sum += sa[b][h][t];
            EXPECT_FLOAT_EQ((*mx)[b][h][j].item<float>(), m);
            EXPECT_NEAR((*av)[b][h][j].item<float>(), sum / kern, 1e-6);  // zero pad counted
          }
    }
  }
  EXPECT_EQ(PoolScores(at::randn({1, 1, 5}), PoolType::kPoolTypeMax, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Lookback L: the symmetric pool, then each position takes the max over itself and the L before.
TEST(SelectionTest, LookbackExtendsPooledScoresForward) {
  at::manual_seed(22);
  for (PoolType pool : {PoolType::kPoolTypeNone, PoolType::kPoolTypeMax, PoolType::kPoolTypeAvg}) {
    for (int32_t lookback : {1, 4, 32}) {
      for (int64_t n : {1, 7, 50}) {
        auto s = at::randn({2, 3, n});
        auto sym = PoolScores(s, pool, 5);
        auto got = PoolScores(s, pool, 5, lookback);
        ASSERT_TRUE(sym.ok() && got.ok()) << sym.status() << got.status();
        auto ya = sym->accessor<float, 3>();
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t h = 0; h < 3; ++h)
            for (int64_t j = 0; j < n; ++j) {
              float m = -1e30f;
              for (int64_t t = std::max<int64_t>(0, j - lookback); t <= j; ++t)
                m = std::max(m, ya[b][h][t]);
              EXPECT_FLOAT_EQ((*got)[b][h][j].item<float>(), m) << lookback << " " << n;
            }
      }
    }
  }
  // A single spike spreads to the L entries after it, not before.
  auto spike = at::zeros({1, 1, 10});
  spike[0][0][3] = 1.0f;
  auto one_sided = PoolScores(spike, PoolType::kPoolTypeNone, 1, 4);
  ASSERT_TRUE(one_sided.ok());
  EXPECT_TRUE(at::equal(one_sided->gt(0).nonzero().select(1, 2), at::arange(3, 8, at::kLong)));
  EXPECT_EQ(PoolScores(spike, PoolType::kPoolTypeMax, 3, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Selection ranks by the lookback: a budget of 5 keeps the spike and the 4 entries after it.
  SelectParams params;
  params.pool = PoolType::kPoolTypeNone;
  params.window = 0;
  params.pool_lookback = 4;
  auto kept = SelectTopK(spike + at::arange(10, at::kFloat).view({1, 1, 10}) * 1e-3f, 5, params);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(at::equal(kept->flatten(), at::arange(3, 8, at::kLong)));
}

TEST(SelectionTest, ProtectAndKeepCount) {
  auto s = at::arange(10, at::kFloat).view({1, 1, 10}).flip(-1).contiguous();  // 9 .. 0
  ASSERT_TRUE(ProtectScores(s, 3, 2).ok());
  auto want = at::tensor({10.f, 10.f, 7.f, 6.f, 5.f, 4.f, 3.f, 10.f, 10.f, 10.f}).view({1, 1, 10});
  EXPECT_TRUE(at::equal(s, want));
  EXPECT_EQ(KeepCount(1000, 0.1, 8), 100);
  EXPECT_EQ(KeepCount(50, 0.1, 8), 8);
  EXPECT_EQ(KeepCount(5, 0.1, 8), 5);
  EXPECT_EQ(KeepCount(3, 0.0, 0), 1);
}

TEST(SelectionTest, TopKSortedAscendingAndGather) {
  at::manual_seed(22);
  const int64_t b = 2, h = 4, n = 50, d = 8, keep = 12;
  auto s = at::randn({b, h, n});
  SelectParams params;
  params.pool = PoolType::kPoolTypeNone;
  params.window = 4;
  params.num_sinks = 1;
  auto idx = SelectTopK(s, keep, params);
  ASSERT_TRUE(idx.ok()) << idx.status();
  ASSERT_EQ(idx->sizes(), (std::vector<int64_t>{b, h, keep}));
  for (int64_t i = 0; i < b; ++i)
    for (int64_t hh = 0; hh < h; ++hh) {
      // Expected: position 0, the last 4, then the 7 highest of the rest.
      std::vector<int64_t> order(n - 5);
      std::iota(order.begin(), order.end(), 1);
      auto sa = s.accessor<float, 3>();
      std::sort(order.begin(), order.end(),
                [&](int64_t x, int64_t y) { return sa[i][hh][x] > sa[i][hh][y]; });
      std::vector<int64_t> want = {0, n - 4, n - 3, n - 2, n - 1};
      want.insert(want.end(), order.begin(), order.begin() + (keep - 5));
      std::sort(want.begin(), want.end());
      auto got = (*idx)[i][hh].contiguous();
      EXPECT_EQ(std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + keep),
                want);
    }
  auto x = at::randn({b, h, n, d});
  auto kept = GatherKept(x, *idx);
  ASSERT_TRUE(kept.ok()) << kept.status();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t t = 0; t < keep; ++t)
        EXPECT_TRUE(at::equal((*kept)[i][hh][t], x[i][hh][(*idx)[i][hh][t].item<int64_t>()]));
  auto kept3 = GatherKept(x[1], (*idx)[1]);
  ASSERT_TRUE(kept3.ok());
  EXPECT_TRUE(at::equal(*kept3, (*kept)[1]));
  EXPECT_EQ(SelectTopK(s, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SelectTopK(s, n + 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// selection.h's tie rule as a loop: a stable descending sort keeps equal scores in ascending
// position, so its first `keep` entries are the kept set; then ascending positions.
std::vector<int64_t> KeptByStableSort(const float* row, int64_t n, int64_t keep) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return row[x] > row[y]; });
  order.resize(keep);
  std::sort(order.begin(), order.end());
  return order;
}

TEST(SelectionTest, TiesGoToLowerPositions) {
  auto s = at::tensor({5.f, 3.f, 1.f, 3.f, 3.f, 0.f, -0.f, 3.f}).view({1, 1, 8});
  SelectParams params;
  params.ties = TieOrder::kLowerPosition;
  params.pool = PoolType::kPoolTypeNone;
  params.window = 0;
  auto three = SelectTopK(s, 3, params), seven = SelectTopK(s, 7, params);
  ASSERT_TRUE(three.ok() && seven.ok()) << three.status() << seven.status();
  EXPECT_TRUE(at::equal(*three, at::tensor({0, 1, 3}, at::kLong).view({1, 1, 3})));
  // -0 == +0: the tie goes to position 5.
  EXPECT_TRUE(at::equal(*seven, at::tensor({0, 1, 2, 3, 4, 5, 7}, at::kLong).view({1, 1, 7})));
}

// Coarse scores (many ties), max pooling (plateaus), window and sinks against the loop.
TEST(SelectionTest, TieRuleMatchesStableSortReference) {
  at::manual_seed(23);
  for (int64_t n : {1, 9, 64, 1000}) {
    for (double ratio : {0.0, 0.1, 0.5, 1.0}) {
      auto s = at::round(at::randn({2, 3, n}) * 2.0);
      SelectParams params;
      params.ties = TieOrder::kLowerPosition;
      params.num_sinks = 2;
      const int64_t keep = KeepCount(n, ratio, params.window);
      auto idx = SelectTopK(s, keep, params);
      ASSERT_TRUE(idx.ok()) << idx.status();
      auto pooled = PoolScores(s, params.pool, params.pool_kernel);
      ASSERT_TRUE(pooled.ok());
      ASSERT_TRUE(ProtectScores(*pooled, params.window, params.num_sinks).ok());
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t h = 0; h < 3; ++h) {
          auto row = (*pooled)[b][h].contiguous();
          auto got = (*idx)[b][h].contiguous();
          EXPECT_EQ(std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + keep),
                    KeptByStableSort(row.data_ptr<float>(), n, keep))
              << "n " << n << " keep " << keep << " row " << b << "," << h;
        }
    }
  }
}

// Without ties both orders keep the same set, the one of ATen topk + sort; the CPU default is
// at::topk's order (the references' torch.topk), ties included.
TEST(SelectionTest, TieOrdersAgreeWithoutTiesAndCpuDefaultIsTopk) {
  at::manual_seed(24);
  for (int64_t n : {17, 500, 4096}) {
    auto s = at::randn({2, 4, n});
    auto coarse = at::round(s * 2.0);  // ties everywhere
    SelectParams params;
    params.pool = PoolType::kPoolTypeNone;
    params.window = 0;
    for (int64_t keep : {int64_t{1}, n / 10, n / 2, n}) {
      auto want = std::get<0>(std::get<1>(at::topk(s, keep, -1)).sort(-1));
      for (TieOrder ties : {TieOrder::kLowerPosition, TieOrder::kTorchTopk}) {
        params.ties = ties;
        auto idx = SelectTopK(s, keep, params);
        ASSERT_TRUE(idx.ok()) << idx.status();
        EXPECT_TRUE(at::equal(*idx, want)) << "n " << n << " keep " << keep;
      }
      params.ties = TieOrder::kDeviceDefault;
      auto idx = SelectTopK(coarse, keep, params);
      ASSERT_TRUE(idx.ok()) << idx.status();
      EXPECT_TRUE(at::equal(*idx, std::get<0>(std::get<1>(at::topk(coarse, keep, -1)).sort(-1))))
          << "n " << n << " keep " << keep;
    }
  }
}

}  // namespace
}  // namespace dropkv::kernels
