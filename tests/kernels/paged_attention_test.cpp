// Paged decode attention (CPU reference) against fp64 attention over each sequence's tokens,
// read from the pool through the block table by explicit loops.
#include "kernels/paged_attention.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace dropkv::kernels {
namespace {

TEST(PagedAttentionTest, MatchesDenseAttentionForRaggedRandomTables) {
  for (int64_t g : {1, 4, 7}) {
    at::manual_seed(40 + g);
    const int64_t b = 3, hkv = 2, hq = hkv * g, d = 16, bs = 4, nb = 40, max_blocks = 10;
    auto kc = at::randn({nb, bs, hkv, d}), vc = at::randn({nb, bs, hkv, d});
    auto q = at::randn({b, hq, d});
    auto tables = at::randperm(nb, at::kInt).slice(0, 0, b * max_blocks).view({b, max_blocks});
    auto lens = at::tensor({37, 1, 0}, at::kInt);
    auto out = PagedDecodeAttention(q, kc, vc, tables.contiguous(), lens);
    ASSERT_TRUE(out.ok()) << out.status();
    for (int64_t i = 0; i < b; ++i) {
      const int64_t len = lens[i].item<int>();
      for (int64_t hh = 0; hh < hq; ++hh) {
        const int64_t h = hh / g;
        std::vector<double> p(len);
        double mx = -1e300, z = 0;
        for (int64_t t = 0; t < len; ++t) {
          const int64_t blk = tables[i][t / bs].item<int>(), off = t % bs;
          p[t] = (q[i][hh].to(at::kDouble) * kc[blk][off][h].to(at::kDouble)).sum().item<double>() /
                 std::sqrt(double(d));
          mx = std::max(mx, p[t]);
        }
        for (auto& x : p) z += (x = std::exp(x - mx));
        auto want = at::zeros({d}, at::kDouble);
        for (int64_t t = 0; t < len; ++t)
          want += p[t] / z * vc[tables[i][t / bs].item<int>()][t % bs][h].to(at::kDouble);
        EXPECT_TRUE(at::allclose((*out)[i][hh].to(at::kDouble), want, 1e-5, 1e-6))
            << "g=" << g << " seq " << i << " head " << hh;
      }
    }
  }
}

TEST(PagedAttentionTest, RejectsBadTables) {
  auto kc = at::randn({4, 4, 1, 8});
  auto q = at::randn({1, 2, 8});
  auto st = PagedDecodeAttention(q, kc, kc, at::tensor({0, 9}, at::kInt).view({1, 2}),
                                 at::tensor({6}, at::kInt))
                .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("block_tables[0, 1] = 9"), std::string::npos) << st;
  st = PagedDecodeAttention(q, kc, kc, at::tensor({0, 1}, at::kInt).view({1, 2}),
                            at::tensor({9}, at::kInt))
           .status();
  EXPECT_NE(st.message().find("seq_lens[0] = 9"), std::string::npos) << st;
}

}  // namespace
}  // namespace dropkv::kernels
