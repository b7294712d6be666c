// The other scorers against fp64 loops written from their definitions (kvpress's code for
// SnapKV and ObservedAttention, algorithms.md section 2).
#include "kernels/scorers.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace dropkv::kernels {
namespace {

// Softmax of query row (hh, i) at position pos over keys 0..pos of KV head h: fp64 [pos+1].
std::vector<double> AttentionRow(const at::Tensor& q, const at::Tensor& k, int64_t hh, int64_t i,
                                 int64_t h, int64_t pos) {
  auto qa = q.accessor<double, 3>();
  auto ka = k.accessor<double, 3>();
  const int64_t d = q.size(2);
  std::vector<double> p(pos + 1);
  double mx = -1e300, z = 0;
  for (int64_t j = 0; j <= pos; ++j) {
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += qa[hh][i][c] * ka[h][j][c];
    p[j] = s / std::sqrt(static_cast<double>(d));
    mx = std::max(mx, p[j]);
  }
  for (auto& x : p) z += (x = std::exp(x - mx));
  for (auto& x : p) x /= z;
  return p;
}

double MaxRelErr(const at::Tensor& got, const at::Tensor& want) {
  return ((got.to(at::kDouble) - want).abs().max() / want.abs().max()).item<double>();
}

TEST(ScorersTest, H2oMatchesColumnSums) {
  at::manual_seed(11);
  const int64_t hq = 8, hkv = 2, g = 4, nq = 12, n = 30, d = 16;
  auto q = at::randn({1, hq, nq, d}, at::kDouble);
  auto k = at::randn({1, hkv, n, d}, at::kDouble);
  auto v = at::randn({1, hkv, n, d}, at::kDouble);
  for (int norm_p : {0, 1, 2}) {
    for (bool divide : {false, true}) {
      H2oParams params;
      params.value_norm_p = norm_p;
      params.divide_by_num_queries = divide;
      auto got = H2oScores(q, k, v, params);
      ASSERT_TRUE(got.ok()) << got.status();
      auto want = at::zeros({hkv, n}, at::kDouble);
      auto count = at::zeros({n}, at::kDouble);
      for (int64_t hh = 0; hh < hq; ++hh) {
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t pos = n - nq + i;
          auto p = AttentionRow(q[0], k[0], hh, i, hh / g, pos);
          for (int64_t j = 0; j <= pos; ++j) {
            want[hh / g][j] += p[j] / g;
            if (hh == 0) count[j] += 1;
          }
        }
      }
      if (divide) want /= count.clamp_min(1);
      if (norm_p == 1) want *= v[0].abs().sum(-1);
      if (norm_p == 2) want *= v[0].square().sum(-1).sqrt();
      EXPECT_LT(MaxRelErr((*got)[0], want), 1e-12) << "p=" << norm_p << " divide=" << divide;
    }
  }
}

// Each query row's log-sum-exp of its scaled, causally masked logits, [B, Hq, nq] in q's dtype
// (the prefill attention's LSE).
at::Tensor RowLse(const at::Tensor& q, const at::Tensor& k) {
  const int64_t nq = q.size(2), n = k.size(2), g = q.size(1) / k.size(1);
  auto kq = k.repeat_interleave(g, 1);  // [B, Hq, n, D]
  auto logits = at::matmul(q, kq.transpose(2, 3)) / std::sqrt(static_cast<double>(q.size(3)));
  auto row = at::arange(nq, at::kLong).unsqueeze(1) + (n - nq);
  auto col = at::arange(n, at::kLong).unsqueeze(0);
  return at::logsumexp(logits.masked_fill(col > row, -INFINITY), -1);
}

// The fp64 loop oracle of H2O (column sums of each row's softmax, algorithms.md section 2).
at::Tensor H2oOracle(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const H2oParams& params) {
  const int64_t hq = q.size(1), nq = q.size(2), hkv = k.size(1), n = k.size(2), g = hq / hkv;
  auto qd = q[0].to(at::kDouble), kd = k[0].to(at::kDouble), vd = v[0].to(at::kDouble);
  auto want = at::zeros({hkv, n}, at::kDouble);
  auto count = at::zeros({n}, at::kDouble);
  for (int64_t hh = 0; hh < hq; ++hh) {
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t pos = n - nq + i;
      auto p = AttentionRow(qd, kd, hh, i, hh / g, pos);
      for (int64_t j = 0; j <= pos; ++j) {
        want[hh / g][j] += p[j] / g;
        if (hh == 0) count[j] += 1;
      }
    }
  }
  if (params.divide_by_num_queries) want /= count.clamp_min(1);
  if (params.value_norm_p == 1) want *= vd.abs().sum(-1);
  if (params.value_norm_p == 2) want *= vd.square().sum(-1).sqrt();
  return want;
}

// H2oScoresFromLse == H2oScores == the fp64 oracle; the row-chunked ATen path (a block budget of
// one row and of a few rows) == the single block. fp64 inputs agree to rounding (1e-9); fp32 to
// its precision over sums of ~n terms (1e-4).
TEST(ScorersTest, H2oFromLseAndRowChunksMatchOracle) {
  at::manual_seed(14);
  const int64_t d = 16, n = 37;
  for (auto dtype : {at::kDouble, at::kFloat}) {
    const double tol = dtype == at::kDouble ? 1e-9 : 1e-4;
    for (int64_t g : {1, 4, 7}) {
      for (int64_t nq : {n, int64_t{13}}) {
        const int64_t hkv = 2, hq = hkv * g;
        auto q = at::randn({1, hq, nq, d}, dtype);
        auto k = at::randn({1, hkv, n, d}, dtype);
        auto v = at::randn({1, hkv, n, d}, dtype);
        auto lse = RowLse(q.to(at::kDouble), k.to(at::kDouble)).to(dtype);
        for (int norm_p : {0, 1, 2}) {
          for (bool divide : {false, true}) {
            SCOPED_TRACE(::testing::Message() << at::toString(dtype) << " g " << g << " nq " << nq
                                              << " p " << norm_p << " divide " << divide);
            H2oParams params;
            params.value_norm_p = norm_p;
            params.divide_by_num_queries = divide;
            auto want = H2oOracle(q, k, v, params);
            auto plain = H2oScores(q, k, v, params);
            auto from_lse = H2oScoresFromLse(q, k, v, lse, params);
            ASSERT_TRUE(plain.ok()) << plain.status();
            ASSERT_TRUE(from_lse.ok()) << from_lse.status();
            EXPECT_LT(MaxRelErr((*plain)[0], want), tol);
            EXPECT_LT(MaxRelErr((*from_lse)[0], want), tol);
            const int64_t row_bytes = g * n * (dtype == at::kDouble ? 8 : 4);
            for (int64_t budget : {int64_t{1}, 3 * row_bytes}) {  // 1 row, 3 rows per chunk
              for (const at::Tensor& l : {at::Tensor(), lse}) {
                auto chunked = internal::H2oScoresAten(q, k, v, l, params, budget);
                ASSERT_TRUE(chunked.ok()) << chunked.status();
                EXPECT_LT(MaxRelErr((*chunked)[0], want), tol) << "budget " << budget;
              }
            }
          }
        }
      }
    }
  }
  auto q = at::randn({1, 4, 5, 8}), k = at::randn({1, 2, 9, 8});
  EXPECT_EQ(H2oScoresFromLse(q, k, k, at::zeros({1, 4, 6})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(H2oScoresFromLse(q, k, k, at::Tensor()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ScorersTest, SnapKvMatchesKvpressDefinition) {
  at::manual_seed(12);
  const int64_t hq = 4, hkv = 2, g = 2, w = 6, n = 40, d = 16, kern = 5;
  auto q = at::randn({1, hq, w, d}, at::kDouble);
  auto k = at::randn({1, hkv, n, d}, at::kDouble);
  SnapKvParams params;
  params.pool_kernel = kern;
  auto got = SnapKvScores(q, k, params);
  ASSERT_TRUE(got.ok()) << got.status();
  // Mean over window queries of the attention on keys [0, n-w), avg pool (zero padding counted),
  // mean over the group, window = max + 1.
  const int64_t m = n - w;
  std::vector<std::vector<double>> per_head(hq, std::vector<double>(m, 0.0));
  for (int64_t hh = 0; hh < hq; ++hh)
    for (int64_t i = 0; i < w; ++i) {
      auto p = AttentionRow(q[0], k[0], hh, i, hh / g, n - w + i);
      for (int64_t j = 0; j < m; ++j) per_head[hh][j] += p[j] / w;
    }
  auto want = at::zeros({hkv, n}, at::kDouble);
  double mx = -1e300;
  for (int64_t hh = 0; hh < hq; ++hh)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t t = j - kern / 2; t <= j + kern / 2; ++t)
        if (t >= 0 && t < m) s += per_head[hh][t];
      want[hh / g][j] += s / kern / g;
    }
  mx = want.slice(1, 0, m).max().item<double>();
  want.slice(1, m, n).fill_(mx + 1);
  // SnapKV's fp32 softmax and fp32 pooling: fp32 precision.
  EXPECT_LT(MaxRelErr((*got)[0], want), 1e-5);
  EXPECT_EQ(SnapKvScores(at::randn({1, 4, 40, 16}), at::randn({1, 2, 40, 16})).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ScorersTest, KNormStreamingRandom) {
  at::manual_seed(13);
  auto k = at::randn({2, 3, 10, 8});
  auto kn = KNormScores(k);
  ASSERT_TRUE(kn.ok());
  EXPECT_TRUE(at::allclose(*kn, -k.square().sum(-1).sqrt(), 1e-5, 1e-6));

  auto st = StreamingLlmScores(k, 4);
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->sizes(), (std::vector<int64_t>{2, 3, 10}));
  // A top-4+3 keeps the 4 sinks and the 3 most recent.
  auto idx = std::get<0>(std::get<1>(st->topk(7, -1)).sort(-1));
  EXPECT_TRUE(at::equal(idx[1][2], at::tensor({0, 1, 2, 3, 7, 8, 9}, at::kLong)));

  auto r1 = RandomScores(k, 42), r2 = RandomScores(k, 42), r3 = RandomScores(k, 43);
  ASSERT_TRUE(r1.ok() && r2.ok() && r3.ok());
  EXPECT_TRUE(at::equal(*r1, *r2));
  EXPECT_FALSE(at::equal(*r1, *r3));
}

}  // namespace
}  // namespace dropkv::kernels
