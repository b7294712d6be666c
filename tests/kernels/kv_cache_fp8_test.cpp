// The FP8 KV cache on the CPU (kernels/kv_cache_fp8.h): the quantization against e4m3's rounding
// bound and saturation, the cache writes into an FP8 pool, and paged decode attention over it
// against the same attention over an fp32 pool holding the dequantized values.
#include "kernels/kv_cache_fp8.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cache_ops.h"
#include "kernels/paged_attention.h"

namespace dropkv::kernels {
namespace {

TEST(KvCacheFp8Test, QuantizeRoundsWithinHalfAnUlpAndSaturates) {
  at::manual_seed(5);
  // Magnitudes 2^-6 .. 2^8 (e4m3's normal range below 448): relative error <= 2^-4 (3 mantissa
  // bits, round to nearest).
  auto x = at::randn({4096}) * at::exp2(at::randint(-6, 8, {4096}).to(at::kFloat));
  x = x.clamp(-440, 440);
  auto normal = x.abs() >= std::ldexp(1.0, -6);
  auto q = QuantizeKv(x);
  ASSERT_EQ(q.scalar_type(), kFp8KvDtype);
  auto back = q.to(at::kFloat);
  auto rel = ((back - x).abs() / x.abs()).masked_select(normal);
  EXPECT_LE(rel.max().item<double>(), std::ldexp(1.0, -4) + 1e-7);
  // Subnormals: absolute error <= half their spacing 2^-9.
  auto sub = (back - x).abs().masked_select(normal.logical_not());
  if (sub.numel() > 0) EXPECT_LE(sub.max().item<double>(), std::ldexp(1.0, -10) + 1e-9);
  // Past 448: saturated, never NaN (ATen's plain cast gives NaN from 464 up).
  auto big = QuantizeKv(at::tensor({500.f, -1e6f, 470.f, 448.f})).to(at::kFloat);
  EXPECT_TRUE(at::equal(big, at::tensor({448.f, -448.f, 448.f, 448.f})));
  // bf16 inputs round the same way as their fp32 values.
  auto xb = x.to(at::kBFloat16);
  EXPECT_TRUE(
      at::equal(QuantizeKv(xb).view(at::kByte), QuantizeKv(xb.to(at::kFloat)).view(at::kByte)));
  EXPECT_TRUE(at::equal(RoundTripKv(x), back));
}

TEST(KvCacheFp8Test, WritesStoreTheQuantizedRows) {
  at::manual_seed(6);
  const int64_t nb = 6, bs = 4, h = 2, d = 16;
  auto kc = at::zeros({nb, bs, h, d}, kFp8KvDtype), vc = at::zeros({nb, bs, h, d}, kFp8KvDtype);
  auto kn = at::randn({5, h, d}) * 3, vn = at::randn({5, h, d});
  auto slots = at::tensor({13, 2, -1, 23, 0}, at::kLong);
  ASSERT_TRUE(WriteKv(kc, vc, kn, vn, slots).ok());
  for (int64_t t = 0; t < 5; ++t) {
    const int64_t s = slots[t].item<int64_t>();
    if (s < 0) continue;
    EXPECT_TRUE(at::equal(kc[s / bs][s % bs].to(at::kFloat), RoundTripKv(kn[t])));
    EXPECT_TRUE(at::equal(vc[s / bs][s % bs].to(at::kFloat), RoundTripKv(vn[t])));
  }
  // Kept entries per head.
  const int64_t n = 9;
  auto k = at::randn({h, n, d}), v = at::randn({h, n, d});
  auto kept = at::tensor({0, 4, 8, 1, 2, 3}, at::kLong).view({h, 3});
  auto kept_slots = at::tensor({5, 6, 7}, at::kLong);
  ASSERT_TRUE(WriteKeptKv(kc, vc, k, v, kept, kept_slots).ok());
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = 0; i < 3; ++i) {
      const int64_t s = kept_slots[i].item<int64_t>(), j = kept[hh][i].item<int64_t>();
      EXPECT_TRUE(at::equal(kc[s / bs][s % bs][hh].to(at::kFloat), RoundTripKv(k[hh][j])));
      EXPECT_TRUE(at::equal(vc[s / bs][s % bs][hh].to(at::kFloat), RoundTripKv(v[hh][j])));
    }
}

// The CPU kernel over an FP8 pool (it dequantizes the blocks the tables name) against the same
// kernel and the ATen reference over an fp32 pool holding the same values: equal bit for bit
// (every e4m3 value is an fp32 value; the same kernel then sees the same numbers).
TEST(KvCacheFp8Test, PagedDecodeOverAnFp8PoolEqualsTheDequantizedPool) {
  at::manual_seed(7);
  const int64_t nb = 40, bs = 16, hkv = 2, g = 4, d = 64;
  auto k8 = QuantizeKv(at::randn({nb, bs, hkv, d}) * 2);
  auto v8 = QuantizeKv(at::randn({nb, bs, hkv, d}));
  auto k32 = k8.to(at::kFloat), v32 = v8.to(at::kFloat);
  auto q = at::randn({3, hkv * g, d});
  // Scattered tables, lengths that are not multiples of the block size; one empty sequence.
  auto tables = at::tensor({7, 3, 31, 12, 0, 0, 39, 5, 18, 22, 1, 2, 0, 0, 0, 0, 0, 0}, at::kInt)
                    .view({3, 6});
  auto lens = at::tensor({70, 83, 0}, at::kInt);
  auto got = PagedDecodeAttention(q, k8, v8, tables, lens);
  auto want = PagedDecodeAttention(q, k32, v32, tables, lens);
  auto ref = PagedDecodeAttentionReference(q, k8, v8, tables, lens);
  ASSERT_TRUE(got.ok() && want.ok() && ref.ok()) << got.status() << want.status() << ref.status();
  EXPECT_TRUE(at::equal(*got, *want));
  EXPECT_LT((*got - *ref).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace dropkv::kernels
