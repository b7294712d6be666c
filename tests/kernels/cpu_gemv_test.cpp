// kernels/cpu_gemv.h against an fp64 x W^T + b: every row count it takes, K with and without a
// tail past the last 8 lanes, an odd column count (a W row left over from the pairs), strided x
// rows, with and without a bias, the AVX2 and the portable loops; the same bits with 1 and 2
// threads; the inputs it refuses.
#include "kernels/cpu_gemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <string>

namespace dropkv::kernels {
namespace {

TEST(CpuGemvTest, MatchesFp64ForEveryRowCountAndShape) {
  at::manual_seed(5);
  for (int64_t k : {576, 13, 1000}) {
    const int64_t n = 301;
    auto w = at::randn({n, k});
    auto bias = at::randn({n});
    // x rows as a view into a wider tensor: row stride k + 5.
    auto x_all = at::randn({kCpuGemvMaxRows, k + 5}).narrow(1, 0, k);
    for (int64_t m = 1; m <= kCpuGemvMaxRows; ++m) {
      auto x = x_all.narrow(0, 0, m);
      for (bool with_bias : {true, false}) {
        auto want = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
        if (with_bias) want = want + bias.to(at::kDouble);
        for (bool simd : {true, false}) {
          auto got = CpuGemv(x, w, with_bias ? bias : at::Tensor(), simd);
          ASSERT_TRUE(got.ok()) << got.status();
          const std::string what = "m=" + std::to_string(m) + " k=" + std::to_string(k) +
                                   (with_bias ? " bias" : "") + (simd ? " simd" : " portable");
          ASSERT_EQ(got->sizes(), (at::IntArrayRef{m, n})) << what;
          // fp32 dot products of K terms ~N(0, 1) in 8 partial sums: sums ~sqrt(K) <= 32, each
          // of K / 8 additions rounds by <= 2^-24 of it: ~1e-5 at K = 1000.
          EXPECT_LT((got->to(at::kDouble) - want).abs().max().item<double>(), 1e-4) << what;
        }
      }
    }
  }
}

TEST(CpuGemvTest, SameBitsWhateverTheThreadCount) {
  at::manual_seed(6);
  auto w = at::randn({3001, 640});  // several tasks of 256 columns, an odd last one
  auto x = at::randn({8, 640});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto one = CpuGemv(x, w, at::Tensor());
  at::set_num_threads(2);
  auto two = CpuGemv(x, w, at::Tensor());
  at::set_num_threads(threads);
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_TRUE(at::equal(*one, *two));
}

TEST(CpuGemvTest, RefusesWhatItDoesNotTake) {
  auto w = at::randn({16, 32});
  EXPECT_FALSE(CpuGemvApplies(at::randn({kCpuGemvMaxRows + 1, 32}), w));
  EXPECT_FALSE(CpuGemvApplies(at::randn({2, 32}).to(at::kBFloat16), w));
  EXPECT_TRUE(CpuGemvApplies(at::randn({2, 32}), w));
  auto st = CpuGemv(at::randn({9, 32}), w, at::Tensor()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("1 <= M <= 8"), std::string::npos) << st;
  st = CpuGemv(at::randn({2, 31}), w, at::Tensor()).status();
  EXPECT_NE(st.message().find("does not match x [2, 31]"), std::string::npos) << st;
  st = CpuGemv(at::randn({2, 32}), w, at::randn({15})).status();
  EXPECT_NE(st.message().find("bias must be CPU fp32 [16]"), std::string::npos) << st;
}

}  // namespace
}  // namespace dropkv::kernels
