// The CUDA flash prefill path (PrefillAttentionWithLse, kFlash) against the SDPA path it replaces
// and against fp64 / fp32 math: output and log-sum-exp, first chunks (T = n) and later chunks
// (T < n, the bottom-right causal mask), GQA ratios 1 and 4, head dims 64 / 128 / 256, bf16 and
// fp16, odd lengths; the cuDNN option (kCudnn) on first chunks too. Label gpu: skipped without a
// CUDA device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/model/attention.h"

namespace dropkv {
namespace {

struct Case {
  int64_t hq, hkv, d, stored, t_len;
  at::ScalarType dtype;
};

// fp64 math over the same (rounded) inputs: scaled logits [Hq, T, n] with row i seeing entries
// j <= stored + i; returns out [T, Hq, D] and lse [Hq, T].
std::pair<at::Tensor, at::Tensor> MathReference(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, double scale,
                                                int64_t window = 0) {
  const int64_t t_len = q.size(0), hq = q.size(1), n = k.size(1);
  const int64_t g = hq / k.size(0);
  auto qd = q.to(at::kCPU, at::kDouble).transpose(0, 1);          // [Hq, T, D]
  auto kd = k.to(at::kCPU, at::kDouble).repeat_interleave(g, 0);  // [Hq, n, D]
  auto vd = v.to(at::kCPU, at::kDouble).repeat_interleave(g, 0);  // [Hq, n, D]
  auto logits = at::bmm(qd, kd.transpose(1, 2)) * scale;          // [Hq, T, n]
  auto row = at::arange(t_len, at::kLong).unsqueeze(1);
  auto col = at::arange(n, at::kLong).unsqueeze(0);
  logits.masked_fill_((col > row + (n - t_len)).unsqueeze(0), -INFINITY);
  if (window > 0) logits.masked_fill_((col <= row + (n - t_len) - window).unsqueeze(0), -INFINITY);
  auto lse = at::logsumexp(logits, -1);                             // [Hq, T]
  auto out = at::bmm(at::softmax(logits, -1), vd).transpose(0, 1);  // [T, Hq, D]
  return {out, lse};
}

TEST(PrefillAttentionGpu, FlashMatchesSdpaAndMathWithLse) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Case> cases = {
      {32, 8, 128, 0, 300, at::kBFloat16},     // first chunk, GQA 4
      {32, 8, 128, 1000, 129, at::kBFloat16},  // later chunk over a cache, GQA 4
      {8, 8, 64, 0, 77, at::kBFloat16},        // MHA, D 64, odd length
      {8, 8, 64, 517, 33, at::kBFloat16},
      {16, 4, 64, 250, 1, at::kBFloat16},    // one-token chunk
      {16, 16, 256, 0, 200, at::kBFloat16},  // MHA, D 256 (Gemma)
      {16, 4, 256, 301, 64, at::kBFloat16},
      {32, 8, 128, 700, 200, at::kHalf},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("Hq ", c.hq, " Hkv ", c.hkv, " D ", c.d, " stored ", c.stored, " T ",
                              c.t_len, " ", c10::toString(c.dtype)));
    at::manual_seed(c.hq * 1000 + c.d + c.stored + c.t_len);
    const int64_t n = c.stored + c.t_len;
    auto opt = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
    // Scaled so the softmax is neither flat nor one-hot.
    auto q = (at::randn({c.t_len, c.hq, c.d}, opt) * 1.5).contiguous();
    auto k = at::randn({c.hkv, n, c.d}, opt);
    auto v = at::randn({c.hkv, n, c.d}, opt);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    auto flash = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kFlash);
    auto sdpa = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kSdpa);
    auto autosel = PrefillAttentionWithLse(q, k, v, scale);
    ASSERT_TRUE(flash.lse.defined());
    EXPECT_FALSE(sdpa.lse.defined());
    ASSERT_EQ(flash.out.sizes(), q.sizes());
    ASSERT_EQ(flash.lse.sizes(), (at::IntArrayRef{c.hq, c.t_len}));
    EXPECT_EQ(flash.out.scalar_type(), c.dtype);
    EXPECT_EQ(flash.lse.scalar_type(), at::kFloat);
    EXPECT_TRUE(flash.out.is_contiguous());
    // kAuto runs flash below 8192 tokens (unless DROPKV_PREFILL_ATTENTION forces another).
    if (std::getenv("DROPKV_PREFILL_ATTENTION") == nullptr) {
      EXPECT_TRUE(at::equal(autosel.out, flash.out));
      EXPECT_TRUE(at::equal(autosel.lse, flash.lse));
    }

    auto [ref_out, ref_lse] = MathReference(q, k, v, scale);
    // Both are the model dtype rounded once at the end after fp32 accumulation, but flash rounds
    // P to the model dtype before PV: outputs (|o| < ~3) agree within a few model-dtype ulps.
    const double out_tol = c.dtype == at::kHalf ? 6e-3 : 3e-2;
    const double vs_sdpa =
        (flash.out.to(at::kFloat) - sdpa.out.to(at::kFloat)).abs().max().item<double>();
    const double vs_math =
        (flash.out.to(at::kCPU, at::kDouble) - ref_out).abs().max().item<double>();
    EXPECT_LT(vs_sdpa, out_tol);
    EXPECT_LT(vs_math, out_tol);
    // The LSE is computed in fp32 from the exact products of the rounded inputs: 1e-3 absolute
    // (its values are ~log n + max logit, 5-15 here).
    const double lse_err =
        (flash.lse.to(at::kCPU, at::kDouble) - ref_lse).abs().max().item<double>();
    EXPECT_LT(lse_err, 1e-3);
    std::printf("Hq %ld Hkv %ld D %ld stored %ld T %ld %s: out-sdpa %.3g out-math %.3g lse %.3g\n",
                c.hq, c.hkv, c.d, c.stored, c.t_len, c10::toString(c.dtype), vs_sdpa, vs_math,
                lse_err);
  }
}

// Sliding-window layers: ATen's flash kernel with its window (kAuto) against fp64 math with the
// window mask, on first chunks longer than the window and on later chunks over a cache.
TEST(PrefillAttentionGpu, SlidingWindowMatchesMath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::vector<Case> cases = {
      {4, 1, 256, 0, 1500, at::kBFloat16},  // Gemma 3 270M's geometry, window 512
      {4, 1, 256, 511, 700, at::kBFloat16},
      {32, 8, 128, 300, 64, at::kBFloat16},
  };
  for (const Case& c : cases) {
    for (const int64_t window : {int64_t{512}, int64_t{37}}) {
      SCOPED_TRACE(absl::StrCat("Hq ", c.hq, " D ", c.d, " stored ", c.stored, " T ", c.t_len,
                                " window ", window));
      at::manual_seed(c.d + c.stored + c.t_len + window);
      const int64_t n = c.stored + c.t_len;
      auto opt = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
      auto q = (at::randn({c.t_len, c.hq, c.d}, opt) * 1.5).contiguous();
      auto k = at::randn({c.hkv, n, c.d}, opt);
      auto v = at::randn({c.hkv, n, c.d}, opt);
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
      auto got = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kAuto,
                                         AttentionLimits{window, 0});
      auto sdpa = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kSdpa,
                                          AttentionLimits{window, 0});
      auto [ref_out, ref_lse] = MathReference(q, k, v, scale, window);
      ASSERT_TRUE(got.lse.defined());
      EXPECT_LT((got.out.to(at::kCPU, at::kDouble) - ref_out).abs().max().item<double>(), 3e-2);
      EXPECT_LT((sdpa.out.to(at::kCPU, at::kDouble) - ref_out).abs().max().item<double>(), 3e-2);
      EXPECT_LT((got.lse.to(at::kCPU, at::kDouble) - ref_lse).abs().max().item<double>(), 1e-3);
    }
  }
}

// cuDNN (kCudnn) on first chunks, GQA 4 and MHA; later chunks go to flash (same as kFlash).
TEST(PrefillAttentionGpu, CudnnFirstChunkMatchesMathWithLse) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const Case& c : std::vector<Case>{{32, 8, 128, 0, 300, at::kBFloat16},
                                         {8, 8, 64, 0, 77, at::kBFloat16},
                                         {16, 16, 256, 0, 200, at::kBFloat16},
                                         {32, 8, 128, 100, 50, at::kBFloat16}}) {
    SCOPED_TRACE(absl::StrCat("Hq ", c.hq, " Hkv ", c.hkv, " D ", c.d, " stored ", c.stored, " T ",
                              c.t_len));
    at::manual_seed(c.d + c.t_len);
    const int64_t n = c.stored + c.t_len;
    auto opt = at::TensorOptions().dtype(c.dtype).device(at::kCUDA);
    auto q = at::randn({c.t_len, c.hq, c.d}, opt) * 1.5;
    auto k = at::randn({c.hkv, n, c.d}, opt);
    auto v = at::randn({c.hkv, n, c.d}, opt);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    PrefillAttentionOutput r;
    try {
      r = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kCudnn);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "cuDNN: " << e.what();
      continue;
    }
    ASSERT_TRUE(r.lse.defined());
    ASSERT_EQ(r.out.sizes(), q.sizes());
    ASSERT_EQ(r.lse.sizes(), (at::IntArrayRef{c.hq, c.t_len}));
    auto [ref_out, ref_lse] = MathReference(q, k, v, scale);
    const double out_err = (r.out.to(at::kCPU, at::kDouble) - ref_out).abs().max().item<double>();
    const double lse_err = (r.lse.to(at::kCPU, at::kDouble) - ref_lse).abs().max().item<double>();
    EXPECT_LT(out_err, 3e-2);
    EXPECT_LT(lse_err, 1e-3);
    std::printf("cudnn Hq %ld Hkv %ld D %ld stored %ld T %ld: out-math %.3g lse %.3g\n", c.hq,
                c.hkv, c.d, c.stored, c.t_len, out_err, lse_err);
  }
}

// kAuto's rule at a long first chunk: cuDNN (bit for bit), within bf16 tolerance of flash.
TEST(PrefillAttentionGpu, AutoTakesCudnnForLongFirstChunks) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (std::getenv("DROPKV_PREFILL_ATTENTION") != nullptr) GTEST_SKIP() << "impl forced by env";
  at::manual_seed(2);
  auto opt = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const int64_t n = 8192;
  auto q = at::randn({n, 8, 128}, opt);
  auto k = at::randn({2, n, 128}, opt);
  auto v = at::randn({2, n, 128}, opt);
  const double scale = 1.0 / std::sqrt(128.0);
  auto autosel = PrefillAttentionWithLse(q, k, v, scale);
  auto cudnn = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kCudnn);
  auto flash = PrefillAttentionWithLse(q, k, v, scale, PrefillAttentionImpl::kFlash);
  EXPECT_TRUE(at::equal(autosel.out, cudnn.out));
  EXPECT_TRUE(at::equal(autosel.lse, cudnn.lse));
  EXPECT_LT((cudnn.out.to(at::kFloat) - flash.out.to(at::kFloat)).abs().max().item<double>(), 3e-2);
  EXPECT_LT((cudnn.lse - flash.lse).abs().max().item<double>(), 1e-3);
}

TEST(PrefillAttentionGpu, AutoKeepsSdpaWhereFlashDoesNotApply) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  auto opt = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  auto q = at::randn({40, 8, 64}, opt);
  auto k = at::randn({2, 90, 64}, opt);
  auto v = at::randn({2, 90, 64}, opt);
  auto r = PrefillAttentionWithLse(q, k, v, 0.125);  // fp32: the SDPA path, no LSE
  EXPECT_FALSE(r.lse.defined());
  auto [ref_out, ref_lse] = MathReference(q, k, v, 0.125);
  EXPECT_LT((r.out.to(at::kCPU, at::kDouble) - ref_out).abs().max().item<double>(), 1e-4);
  // Head dim not a multiple of 8: SDPA too.
  auto opt16 = opt.dtype(at::kBFloat16);
  auto q2 = at::randn({5, 4, 36}, opt16);
  auto k2 = at::randn({4, 12, 36}, opt16);
  EXPECT_FALSE(PrefillAttentionWithLse(q2, k2, k2, 0.2).lse.defined());
}

}  // namespace
}  // namespace dropkv
