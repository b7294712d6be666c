// Paged decode attention on the CPU: the kernel (cpu/paged_attention_cpu.cpp, AVX2 and portable
// loops) and the ATen reference against fp64 attention over each sequence's tokens, read from the
// pool through the block table by explicit loops, and the kernel against the reference at the
// sizes where the kernel's chunking, GQA and dtype handling could go wrong.
#include "kernels/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/paged_attention_cpu.h"

namespace dropkv::kernels {
namespace {

TEST(PagedAttentionTest, MatchesDenseAttentionForRaggedRandomTables) {
  for (bool reference : {false, true}) {
    for (int64_t g : {1, 4, 7}) {
      at::manual_seed(40 + g);
      const int64_t b = 3, hkv = 2, hq = hkv * g, d = 16, bs = 4, nb = 40, max_blocks = 10;
      auto kc = at::randn({nb, bs, hkv, d}), vc = at::randn({nb, bs, hkv, d});
      auto q = at::randn({b, hq, d});
      auto tables = at::randperm(nb, at::kInt).slice(0, 0, b * max_blocks).view({b, max_blocks});
      auto lens = at::tensor({37, 1, 0}, at::kInt);
      auto out = reference ? PagedDecodeAttentionReference(q, kc, vc, tables.contiguous(), lens)
                           : PagedDecodeAttention(q, kc, vc, tables.contiguous(), lens);
      ASSERT_TRUE(out.ok()) << out.status();
      for (int64_t i = 0; i < b; ++i) {
        const int64_t len = lens[i].item<int>();
        for (int64_t hh = 0; hh < hq; ++hh) {
          const int64_t h = hh / g;
          std::vector<double> p(len);
          double mx = -1e300, z = 0;
          for (int64_t t = 0; t < len; ++t) {
            const int64_t blk = tables[i][t / bs].item<int>(), off = t % bs;
            p[t] =
                (q[i][hh].to(at::kDouble) * kc[blk][off][h].to(at::kDouble)).sum().item<double>() /
                std::sqrt(double(d));
            mx = std::max(mx, p[t]);
          }
          for (auto& x : p) z += (x = std::exp(x - mx));
          auto want = at::zeros({d}, at::kDouble);
          for (int64_t t = 0; t < len; ++t)
            want += p[t] / z * vc[tables[i][t / bs].item<int>()][t % bs][h].to(at::kDouble);
          EXPECT_TRUE(at::allclose((*out)[i][hh].to(at::kDouble), want, 1e-5, 1e-6))
              << (reference ? "reference" : "kernel") << " g=" << g << " seq " << i << " head "
              << hh;
        }
      }
    }
  }
}

// A pool with each sequence's blocks scattered at random, and its lengths.
struct PagedCase {
  at::Tensor q, kc, vc, tables, lens;
};
PagedCase MakeCase(const std::vector<int>& lens, int64_t hkv, int64_t g, int64_t d, int64_t bs,
                   at::ScalarType cache_dtype, uint64_t seed) {
  at::manual_seed(seed);
  int64_t max_blocks = 1;
  for (int len : lens) max_blocks = std::max<int64_t>(max_blocks, (len + bs - 1) / bs);
  const int64_t b = static_cast<int64_t>(lens.size()), nb = b * max_blocks + 5;
  PagedCase c;
  c.kc = at::randn({nb, bs, hkv, d}).to(cache_dtype);
  c.vc = at::randn({nb, bs, hkv, d}).to(cache_dtype);
  // q from a wider tensor, as the model's q is a view of its fused q/k projection: strided rows.
  c.q = at::randn({b, hkv * g + 3, d}).narrow(1, 0, hkv * g);
  c.tables = at::randperm(nb, at::kInt).slice(0, 0, b * max_blocks).view({b, max_blocks});
  c.lens = at::tensor(lens, at::kInt);
  return c;
}

// The kernel against the reference: lengths on both sides of its 256-token chunks (0, 1, 255,
// 256, 257, 700), GQA groups 1..7, head dims with and without a tail past the last 8 or 16
// lanes, block sizes 1, 7 and 16, fp32 / bf16 / fp16 caches (read as fp32 by both: the same
// values), with and without a softcap, the AVX2 and the portable loops. Tolerance: fp32
// accumulation order (chunks merged by their max), ~1e-6 on outputs of magnitude ~1.
TEST(PagedAttentionTest, KernelMatchesReference) {
  struct Geometry {
    int64_t hkv, g, d, bs;
  };
  const Geometry geometries[] = {
      {3, 3, 64, 16}, {1, 4, 256, 16}, {2, 1, 13, 7}, {2, 7, 72, 1}, {1, 2, 24, 16}};
  const std::vector<int> lens = {700, 0, 1, 255, 256, 257};
  uint64_t seed = 100;
  for (const Geometry& geo : geometries) {
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      auto c = MakeCase(lens, geo.hkv, geo.g, geo.d, geo.bs, dtype, ++seed);
      for (double softcap : {0.0, 5.0}) {
        PagedAttentionParams params;
        params.softcap = softcap;
        auto want = PagedDecodeAttentionReference(c.q, c.kc, c.vc, c.tables, c.lens, params);
        ASSERT_TRUE(want.ok()) << want.status();
        for (bool simd : {true, false}) {
          const double scale = 1.0 / std::sqrt(static_cast<double>(geo.d));
          auto got =
              cpu::PagedDecodeAttention(c.q, c.kc, c.vc, c.tables, c.lens, scale, softcap, simd);
          const std::string what = "g=" + std::to_string(geo.g) + " D=" + std::to_string(geo.d) +
                                   " bs=" + std::to_string(geo.bs) + " " + c10::toString(dtype) +
                                   " softcap " + std::to_string(softcap) +
                                   (simd ? " simd" : " portable");
          ASSERT_EQ(got.sizes(), want->sizes()) << what;
          EXPECT_LT((got - *want).abs().max().item<float>(), 2e-6) << what;
          EXPECT_TRUE(at::equal(got[1], at::zeros_like(got[1]))) << what << ": empty sequence";
        }
      }
    }
  }
}

// The public entry point runs the kernel on CPU tensors: its output keeps q's dtype and equals
// the kernel's; fp64 runs the reference.
TEST(PagedAttentionTest, EntryPointDispatchesByDtype) {
  auto c = MakeCase({300, 5}, 2, 2, 32, 16, at::kBFloat16, 7);
  auto q = c.q.to(at::kBFloat16);
  auto got = PagedDecodeAttention(q, c.kc, c.vc, c.tables, c.lens);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->scalar_type(), at::kBFloat16);
  auto kernel =
      cpu::PagedDecodeAttention(q, c.kc, c.vc, c.tables, c.lens, 1.0 / std::sqrt(32.0), 0.0);
  EXPECT_TRUE(at::equal(*got, kernel));
  auto c64 = MakeCase({300, 5}, 2, 2, 32, 16, at::kDouble, 8);
  auto got64 = PagedDecodeAttention(c64.q.to(at::kDouble), c64.kc, c64.vc, c64.tables, c64.lens);
  ASSERT_TRUE(got64.ok()) << got64.status();
  EXPECT_EQ(got64->scalar_type(), at::kDouble);
}

// One key far above the rest in the last chunk of a long sequence: the merge must rescale the
// earlier chunks by exp(max_c - max) rather than overflow or lose them; the output is then that
// key's value. And the result does not depend on the thread count (fixed chunks, merged in order).
TEST(PagedAttentionTest, MergesChunksStablyAndIndependentlyOfThreads) {
  auto c = MakeCase({1000}, 1, 2, 64, 16, at::kFloat, 9);
  auto q = c.q.contiguous();
  q.fill_(0.25);
  const int64_t hot = 900;  // in the fourth chunk
  auto hot_row = c.kc.view({-1, 1, 64})[c.tables[0][hot / 16].item<int>() * 16 + hot % 16];
  hot_row.fill_(40.0);  // logit 40 * 0.25 * 64 * scale = 80 vs ~N(0, 1) elsewhere
  auto want_value = c.vc.view({-1, 1, 64})[c.tables[0][hot / 16].item<int>() * 16 + hot % 16][0];
  const double scale = 0.125;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  auto one = cpu::PagedDecodeAttention(q, c.kc, c.vc, c.tables, c.lens, scale, 0.0);
  at::set_num_threads(2);
  auto two = cpu::PagedDecodeAttention(q, c.kc, c.vc, c.tables, c.lens, scale, 0.0);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one, two));
  for (int64_t r = 0; r < 2; ++r)
    EXPECT_LT((one[0][r] - want_value).abs().max().item<float>(), 1e-5) << "row " << r;
  EXPECT_FALSE(one.isnan().any().item<bool>());
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
  PagedAttentionParams params;
  params.softcap = -1;
  st = PagedDecodeAttention(q, kc, kc, at::tensor({0, 1}, at::kInt).view({1, 2}),
                            at::tensor({6}, at::kInt), params)
           .status();
  EXPECT_NE(st.message().find("softcap must be >= 0, got -1"), std::string::npos) << st;
}

}  // namespace
}  // namespace dropkv::kernels
