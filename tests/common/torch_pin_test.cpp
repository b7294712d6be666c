// The CPU build and the GPU machine must run the same LibTorch (2.11.0): headers we compiled
// against and the library loaded at run time must agree, or ABI mismatches appear as crashes.
#include <torch/version.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

TEST(TorchPin, CompiledAndLoadedLibTorchAre2_11_0) {
  EXPECT_EQ(TORCH_VERSION_MAJOR, 2);
  EXPECT_EQ(TORCH_VERSION_MINOR, 11);
  EXPECT_EQ(TORCH_VERSION_PATCH, 0);
  // A real op through the loaded library: SDPA (absent from Debian's LibTorch 1.13) against
  // softmax(QK^T/sqrt(d))V written out by hand.
  auto q = at::randn({1, 2, 5, 8}, at::kDouble);
  auto k = at::randn({1, 2, 5, 8}, at::kDouble);
  auto v = at::randn({1, 2, 5, 8}, at::kDouble);
  auto out = at::scaled_dot_product_attention(q, k, v);
  auto ref = at::softmax(at::matmul(q, k.transpose(-1, -2)) / std::sqrt(8.0), -1).matmul(v);
  EXPECT_LT((out - ref).abs().max().item<double>(), 1e-12);
}
