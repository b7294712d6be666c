// Decode attention over the paged cache vs a contiguous cache (bit for bit in fp32), and both vs
// an fp64 softmax(q k^T) v brute force.
#include "engine/model/attention.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace dropkv {
namespace {

TEST(AttentionTest, PagedDecodeEqualsContiguousBitForBitAndBruteForce) {
  at::manual_seed(3);
  const int64_t num_blocks = 40, block_size = 4, hkv = 2, hq = 6, d = 16;
  auto key_cache = at::randn({num_blocks, block_size, hkv, d});
  auto value_cache = at::randn({num_blocks, block_size, hkv, d});
  const std::vector<int64_t> lens = {1, 7, 16, 29};  // odd lengths, partial last blocks
  const int64_t batch = static_cast<int64_t>(lens.size());
  // Each sequence gets scattered, non-contiguous blocks.
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
  const int64_t max_blocks = 8;
  auto tables = at::zeros({batch, max_blocks}, at::kInt);
  int next = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      tables[b][j] = perm[next++];
  }
  auto q = at::randn({batch, hq, d});
  const double scale = 0.25;
  auto seq_lens = at::tensor(std::vector<int32_t>(lens.begin(), lens.end()), at::kInt);
  auto paged = PagedDecodeAttention(q, key_cache, value_cache, tables, seq_lens, scale);
  for (int64_t b = 0; b < batch; ++b) {
    // The same sequence as a contiguous [Hkv, n, D] cache.
    std::vector<at::Tensor> ks, vs;
    for (int64_t j = 0; j < lens[b]; ++j) {
      const int64_t blk = tables[b][j / block_size].item<int32_t>();
      ks.push_back(key_cache[blk][j % block_size]);
      vs.push_back(value_cache[blk][j % block_size]);
    }
    auto k = at::stack(ks, 1).contiguous();  // [Hkv, n, D]
    auto v = at::stack(vs, 1).contiguous();
    auto contiguous = ContiguousDecodeAttention(q[b], k, v, scale);
    EXPECT_TRUE(at::equal(paged[b], contiguous)) << "sequence " << b;
    // fp64 brute force with GQA expansion.
    auto kd = k.to(at::kDouble).repeat_interleave(hq / hkv, 0);  // [Hq, n, D]
    auto vd = v.to(at::kDouble).repeat_interleave(hq / hkv, 0);
    auto s = at::bmm(q[b].to(at::kDouble).unsqueeze(1), kd.transpose(1, 2)) * scale;  // [Hq, 1, n]
    auto ref = at::bmm(s.softmax(-1), vd).squeeze(1);
    EXPECT_LT((paged[b].to(at::kDouble) - ref).abs().max().item<double>(), 1e-5);
  }
}

TEST(AttentionTest, PrefillWithEarlierEntriesMatchesBruteForce) {
  at::manual_seed(4);
  const int64_t hq = 4, hkv = 2, d = 8, stored = 5, t = 3;
  auto q = at::randn({t, hq, d});
  auto k = at::randn({hkv, stored + t, d});
  auto v = at::randn({hkv, stored + t, d});
  auto out = PrefillAttention(q, k, v, 0.3);  // [T, Hq, D]
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t n = stored + i + 1;  // earlier entries + the causal part of the chunk
      auto kk = k[h / (hq / hkv)].narrow(0, 0, n).to(at::kDouble);
      auto vv = v[h / (hq / hkv)].narrow(0, 0, n).to(at::kDouble);
      auto p = (at::mv(kk, q[i][h].to(at::kDouble)) * 0.3).softmax(0);
      auto ref = at::mv(vv.t(), p);
      EXPECT_LT((out[i][h].to(at::kDouble) - ref).abs().max().item<double>(), 1e-5)
          << i << " " << h;
    }
  }
}

// Sliding-window prefill on the SDPA path (query rows in blocks of 256 against the keys they can
// see) vs an fp64 brute force: a first chunk of 700 tokens (three blocks, the last partial) and a
// later chunk of 300 after 400 stored entries, windows shorter and longer than a block, GQA.
TEST(AttentionTest, WindowedPrefillMatchesBruteForce) {
  struct Case {
    int64_t stored, t_len, window;
  };
  for (const Case& c : {Case{0, 700, 100}, Case{0, 700, 300}, Case{400, 300, 129}}) {
    at::manual_seed(11 + c.window);
    const int64_t hq = 4, hkv = 2, d = 16, n = c.stored + c.t_len;
    const double scale = 0.3;
    auto q = at::randn({c.t_len, hq, d});
    auto k = at::randn({hkv, n, d});
    auto v = at::randn({hkv, n, d});
    AttentionLimits limits;
    limits.window = c.window;
    auto out = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kSdpa, limits).out;
    ASSERT_EQ(out.sizes(), q.sizes());
    // Brute force: row i (position stored + i) sees keys (stored + i - window, stored + i].
    auto s = at::einsum("thd,hnd->htn",
                        {q.to(at::kDouble), k.to(at::kDouble).repeat_interleave(hq / hkv, 0)}) *
             scale;  // [Hq, T, n]
    auto pos = at::arange(c.stored, n, at::kLong).unsqueeze(1);
    auto key = at::arange(n, at::kLong).unsqueeze(0);
    auto visible = (key <= pos).logical_and(key > pos - c.window);
    auto p = s.masked_fill(visible.logical_not(), -INFINITY).softmax(-1);
    auto want = at::einsum("htn,hnd->thd", {p, v.to(at::kDouble).repeat_interleave(hq / hkv, 0)});
    EXPECT_LT((out.to(at::kDouble) - want).abs().max().item<double>(), 1e-5)
        << "stored " << c.stored << " T " << c.t_len << " window " << c.window;
  }
}

// The cuDNN prefill's padded lengths: never shorter, at most 1/16 longer, monotone, fixed points
// are fixed (a padded length pads to itself, powers of two too), and a bounded set per octave.
TEST(AttentionTest, CudnnPaddedLengthIsBoundedAndIdempotent) {
  int64_t previous = 0;
  std::set<int64_t> distinct_8k_to_128k;
  for (int64_t t = 1; t <= 140000; ++t) {
    const int64_t padded = CudnnPaddedLength(t);
    ASSERT_GE(padded, t);
    ASSERT_LE(padded * 16, t * 17) << t;
    ASSERT_GE(padded, previous) << t;
    ASSERT_EQ(CudnnPaddedLength(padded), padded) << t;
    if (t >= 8192 && t <= 131072) distinct_8k_to_128k.insert(padded);
    previous = padded;
  }
  for (int64_t p = 1; p <= (int64_t{1} << 20); p *= 2) EXPECT_EQ(CudnnPaddedLength(p), p);
  EXPECT_EQ(CudnnPaddedLength(8193), 8192 + 512);
  EXPECT_EQ(CudnnPaddedLength(33000), 32768 + 2048);
  EXPECT_LE(distinct_8k_to_128k.size(), 4u * 16 + 1);
}

}  // namespace
}  // namespace dropkv
