// Cache writes against element loops over the pool layout [num_blocks, block_size, Hkv, D].
#include "kernels/cache_ops.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

namespace dropkv::kernels {
namespace {

TEST(CacheOpsTest, WriteKvPutsTokensInTheirSlots) {
  at::manual_seed(31);
  const int64_t nb = 6, bs = 4, h = 2, d = 8;
  auto kc = at::zeros({nb, bs, h, d}), vc = at::zeros({nb, bs, h, d});
  auto kn = at::randn({5, h, d}), vn = at::randn({5, h, d});
  auto slots = at::tensor({13, 2, -1, 23, 0}, at::kLong);
  ASSERT_TRUE(WriteKv(kc, vc, kn, vn, slots).ok());
  auto slot_a = slots.accessor<int64_t, 1>();
  int64_t written = 0;
  for (int64_t t = 0; t < 5; ++t) {
    if (slot_a[t] < 0) continue;
    ++written;
    EXPECT_TRUE(at::equal(kc[slot_a[t] / bs][slot_a[t] % bs], kn[t]));
    EXPECT_TRUE(at::equal(vc[slot_a[t] / bs][slot_a[t] % bs], vn[t]));
  }
  // Nothing else was touched.
  EXPECT_EQ((kc.abs().sum({2, 3}) > 0).sum().item<int64_t>(), written);
  auto bad = WriteKv(kc, vc, kn, vn, at::tensor({0, 1, 2, 3, 24}, at::kLong));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("slot_mapping"), std::string::npos);
}

TEST(CacheOpsTest, WriteKeptKvStoresEachHeadsOwnPositions) {
  at::manual_seed(32);
  const int64_t nb = 4, bs = 8, h = 3, d = 4, n = 20;
  auto kc = at::zeros({nb, bs, h, d}, at::kBFloat16), vc = at::zeros({nb, bs, h, d}, at::kBFloat16);
  auto k = at::randn({h, n, d}, at::kBFloat16), v = at::randn({h, n, d}, at::kBFloat16);
  auto kept = at::tensor({0, 3, 7, 19, 1, 2, 3, 4, 5, 10, 15, 18}, at::kLong).view({h, 4});
  auto slots = at::tensor({9, 10, 11, 30}, at::kLong);
  ASSERT_TRUE(WriteKeptKv(kc, vc, k, v, kept, slots).ok());
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t slot = slots[i].item<int64_t>(), j = kept[hh][i].item<int64_t>();
      EXPECT_TRUE(at::equal(kc[slot / bs][slot % bs][hh], k[hh][j]));
      EXPECT_TRUE(at::equal(vc[slot / bs][slot % bs][hh], v[hh][j]));
    }
  auto bad = WriteKeptKv(kc, vc, k, v, kept + 5, slots);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("kept_idx"), std::string::npos);
}

}  // namespace
}  // namespace dropkv::kernels
