// CUDA kernels against the CPU reference (label gpu; skips without a GPU). Every check draws
// fresh random inputs; free blocks of the caching allocator are filled with NaN before each run
// so that an output element the kernel forgot to write shows up as NaN.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#ifdef DROPKV_CUDA_ENABLED  // the CUDA-graph test; a CPU-only LibTorch build has no CUDA headers
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cache_ops.h"
#include "kernels/dropkv_score.h"
#include "kernels/fused_ops.h"
#include "kernels/paged_attention.h"
#include "kernels/scorers.h"
#include "kernels/selection.h"
#include "kernels/tuning.h"

namespace dropkv::kernels {
namespace {

const at::TensorOptions kCuda = at::TensorOptions().device(at::kCUDA);

class KernelsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount returned 0 or failed)";
    // The CPU reference is the oracle; keep cuBLAS (used by the naive paths) in true fp32 too.
    at::globalContext().setAllowTF32CuBLAS(false);
  }
};

// NaN into the allocator's free blocks of several sizes (the next allocations reuse them).
void Poison() {
  for (int64_t mib : {1, 4, 16, 64}) {
    auto t = at::full({mib << 18}, NAN, kCuda.dtype(at::kFloat));
  }
}

// max |got - want| / max |want|: scores span orders of magnitude, so the absolute tolerance is
// relative to the largest score (atol 1e-4 of the scale) and rtol applies per element.
void ExpectClose(const at::Tensor& got, const at::Tensor& want, double rtol, double atol_rel,
                 const std::string& what) {
  auto g = got.to(at::kCPU).to(at::kDouble), w = want.to(at::kCPU).to(at::kDouble);
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  ASSERT_FALSE(g.isnan().any().item<bool>()) << what << ": NaN in the output (unwritten?)";
  const double scale = w.abs().max().item<double>();
  auto excess = (g - w).abs() - (rtol * w.abs() + atol_rel * scale);
  const double worst = excess.max().item<double>();
  EXPECT_LE(worst, 0.0) << what << ": max |diff| " << (g - w).abs().max().item<double>()
                        << " scale " << scale;
}

// Fraction of the top 10% (per head) of `want` that is also in the top 10% of `got`.
double TopOverlap(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kCPU).to(at::kFloat).reshape({-1, got.size(-1)});
  auto w = want.to(at::kCPU).to(at::kFloat).reshape({-1, want.size(-1)});
  const int64_t k = std::max<int64_t>(1, g.size(1) / 10);
  auto gi = std::get<1>(g.topk(k, -1)), wi = std::get<1>(w.topk(k, -1));
  int64_t hit = 0;
  for (int64_t r = 0; r < g.size(0); ++r) {
    auto a = gi[r].contiguous(), b = wi[r].contiguous();
    std::vector<int64_t> va(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + k);
    std::vector<int64_t> vb(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + k);
    std::sort(va.begin(), va.end());
    std::sort(vb.begin(), vb.end());
    std::vector<int64_t> common;
    std::set_intersection(va.begin(), va.end(), vb.begin(), vb.end(), std::back_inserter(common));
    hit += static_cast<int64_t>(common.size());
  }
  return static_cast<double>(hit) / static_cast<double>(k * g.size(0));
}

struct Geo {
  int64_t b, hq, hkv, w, n, d;
};

TEST_F(KernelsGpuTest, DropKvFp32MatchesCpuReference) {
  const std::vector<Geo> cases = {{2, 8, 8, 8, 1000, 64},  {1, 32, 8, 8, 4097, 128},
                                  {2, 14, 2, 5, 777, 128}, {1, 8, 1, 64, 2048, 64},
                                  {1, 16, 2, 1, 513, 256}, {3, 4, 2, 8, 33, 128},
                                  {1, 8, 4, 8, 6, 64}};
  for (const auto& c : cases) {
    auto q = at::randn({c.b, c.hq, c.w, c.d}) * 2.0;
    auto k = at::randn({c.b, c.hkv, c.n, c.d});
    auto v = at::randn({c.b, c.hkv, c.n, c.d});
    // fp64 oracle: the fp32 CPU path's expanded d2 = |v|^2 - 2<a,v> + |a|^2 cancels when p is
    // near 1 (few visible keys), the CUDA fp32 path sums (v - a)^2 directly.
    auto want = DropKvScores(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble));
    ASSERT_TRUE(want.ok()) << want.status();
    Poison();
    auto got = DropKvScores(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectClose(*got, *want, 1e-3, 1e-4,
                "g=" + std::to_string(c.hq / c.hkv) + " W=" + std::to_string(c.w) +
                    " n=" + std::to_string(c.n) + " D=" + std::to_string(c.d));
  }
}

TEST_F(KernelsGpuTest, DropKvVarlenAndStridedMatchCpu) {
  const std::vector<int64_t> cu = {0, 300, 307, 1500, 1501, 2600};
  const int64_t hq = 8, hkv = 2, w = 8, d = 128, total = cu.back();
  auto q = at::randn({5, hq, w, d});
  auto k = at::randn({total, hkv, d});
  auto v = at::randn({total, hkv, d});
  auto cu_t = at::tensor(cu, at::kLong);
  auto want = DropKvScoresVarlen(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), cu_t);
  ASSERT_TRUE(want.ok()) << want.status();
  Poison();
  auto got = DropKvScoresVarlen(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA), cu_t);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectClose(*got, *want, 1e-3, 1e-4, "varlen");
  // A strided (transposed) dense view goes through the same kernel.
  auto kd = k.slice(0, 0, 300).transpose(0, 1).unsqueeze(0);  // [1, Hkv, 300, D], strided
  auto vd = v.slice(0, 0, 300).transpose(0, 1).unsqueeze(0);
  auto got_dense = DropKvScores(q.slice(0, 0, 1).to(at::kCUDA), kd.to(at::kCUDA), vd.to(at::kCUDA));
  ASSERT_TRUE(got_dense.ok()) << got_dense.status();
  ExpectClose((*got_dense)[0], want->slice(1, 0, 300), 1e-3, 1e-4, "strided dense");
}

TEST_F(KernelsGpuTest, DropKvBf16TopTenPercentOverlap) {
  struct Case {
    int64_t n, d;
  };
  for (const Case c : {Case{8192, 128}, Case{3001, 64}, Case{2500, 256}}) {
    for (bool sink : {false, true}) {
      for (auto dtype : {at::kBFloat16, at::kHalf}) {
        for (bool tc : {true, false}) {
          const int64_t hq = 32, hkv = 8, w = 8, n = c.n, d = c.d;
          auto q = at::randn({1, hq, w, d}).to(dtype);
          auto k = at::randn({1, hkv, n, d});
          auto v = at::randn({1, hkv, n, d}).to(dtype);
          if (sink) {
            // Key 0 aligned with every query of its group: logits ~20 above the rest, p near 1.
            k.select(2, 0).copy_(q.to(at::kFloat).view({1, hkv, hq / hkv * w, d}).mean(2) * 60.0);
          }
          k = k.to(dtype);
          DropKvParams params;
          params.p_round_dtype = dtype;
          params.use_tensor_cores = tc;
          auto want = DropKvScores(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), params);
          ASSERT_TRUE(want.ok()) << want.status();
          Poison();
          auto got = DropKvScores(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA), params);
          ASSERT_TRUE(got.ok()) << got.status();
          const double overlap = TopOverlap(*got, *want);
          auto g64 = got->cpu().to(at::kDouble), w64 = want->to(at::kDouble);
          const double rel = ((g64 - w64).norm() / w64.norm()).item<double>();
          std::printf("%s D=%lld %s %s: top-10%% overlap %.4f, relative L2 error %.2e\n",
                      c10::toString(dtype), static_cast<long long>(d), sink ? "sink  " : "random",
                      tc ? "tensor cores" : "cuda cores  ", overlap, rel);
          EXPECT_GE(overlap, 0.99) << (sink ? "sink input" : "random input") << " tc=" << tc;
          EXPECT_FALSE(g64.isnan().any().item<bool>());
        }
      }
    }
  }
}

// The window rows' attention output [B, Hq, W, D] and LSE [B, Hq, W] in fp32 on the CPU, from
// the model-dtype inputs (what a prefill attention hands to DropKvScoresFromAttention).
std::pair<at::Tensor, at::Tensor> WindowAttention(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v) {
  const int64_t w = q.size(2), d = q.size(3), n = k.size(2), g = q.size(1) / k.size(1);
  auto kr = k.to(at::kFloat).repeat_interleave(g, 1), vr = v.to(at::kFloat).repeat_interleave(g, 1);
  auto logits = at::matmul(q.to(at::kFloat), kr.transpose(2, 3)) / std::sqrt(double(d));
  auto rows = at::arange(w, at::kLong).unsqueeze(1) + (n - w);
  auto cols = at::arange(n, at::kLong).unsqueeze(0);
  logits = logits.masked_fill(cols > rows, -INFINITY);
  return {at::matmul(at::softmax(logits, -1), vr), at::logsumexp(logits, -1)};
}

// The score pass alone (v9 warp-streaming kernel for g*W <= 64 rows: 1, 2 and 4 m-tiles; the
// CTA-tiled one above) against the CPU reference fed the same attention, and against the full
// three-pass scores (top-10% overlap: a_t and lse from fp32 here, bf16-rounded p in pass 1).
TEST_F(KernelsGpuTest, DropKvFromAttentionMatchesCpu) {
  struct Case {
    int64_t hq, hkv, w, n, d;
    bool sink;
  };
  const std::vector<Case> cases = {{32, 8, 8, 8191, 128, false}, {32, 8, 8, 6000, 128, true},
                                   {8, 4, 8, 4001, 64, false},   {32, 4, 6, 3003, 128, false},
                                   {16, 2, 8, 2500, 256, true},  {32, 2, 5, 2100, 64, false}};
  for (const Case& c : cases) {
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      auto q = at::randn({1, c.hq, c.w, c.d}).to(dtype);
      auto k = at::randn({1, c.hkv, c.n, c.d});
      auto v = at::randn({1, c.hkv, c.n, c.d}).to(dtype);
      if (c.sink) {  // key 0 aligned with every query of its group: p near 1
        k.select(2, 0).copy_(q.to(at::kFloat).view({1, c.hkv, c.hq / c.hkv * c.w, c.d}).mean(2) *
                             60.0);
      }
      k = k.to(dtype);
      auto [attn, lse] = WindowAttention(q, k, v);
      DropKvParams params;
      params.p_round_dtype = dtype;
      auto qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat);
      auto want = DropKvScoresFromAttention(qf, kf, vf, attn, lse, params);
      auto full = DropKvScores(qf, kf, vf, params);
      ASSERT_TRUE(want.ok() && full.ok()) << want.status() << full.status();
      Poison();
      auto got = DropKvScoresFromAttention(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA),
                                           attn.to(at::kCUDA), lse.to(at::kCUDA), params);
      ASSERT_TRUE(got.ok()) << got.status();
      auto g64 = got->cpu().to(at::kDouble), w64 = want->to(at::kDouble);
      ASSERT_FALSE(g64.isnan().any().item<bool>()) << "NaN (unwritten?)";
      const double rel = ((g64 - w64).norm() / w64.norm()).item<double>();
      const double overlap = TopOverlap(*got, *want), overlap_full = TopOverlap(*got, *full);
      std::printf(
          "from-attention %s g=%lld W=%lld n=%lld D=%lld %s: overlap %.4f (vs 3-pass CPU %.4f), "
          "relative L2 error %.2e\n",
          c10::toString(dtype), static_cast<long long>(c.hq / c.hkv), static_cast<long long>(c.w),
          static_cast<long long>(c.n), static_cast<long long>(c.d), c.sink ? "sink" : "random",
          overlap, overlap_full, rel);
      EXPECT_GE(overlap, 0.99);
      EXPECT_GE(overlap_full, 0.99);
      // a rounded to the model dtype and tensor-core products: the bf16 runs of
      // DropKvBf16TopTenPercentOverlap print relative L2 errors of a few 1e-3 on random input;
      // sink keys (p near 1, w ~ 1 / (1 - p)^2) amplify the rounding of p itself.
      if (!c.sink) {
        EXPECT_LT(rel, 3e-2);
      }
    }
  }
}

// Each query row's LSE as the prefill attention returns it: at::logsumexp of the causally masked
// fp32 logits (q: [B, Hq, nq, D], k: [B, Hkv, n, D], fp32 CPU) -> fp32 [B, Hq, nq].
at::Tensor H2oRowLse(const at::Tensor& q, const at::Tensor& k) {
  const int64_t nq = q.size(2), n = k.size(2), g = q.size(1) / k.size(1);
  auto logits = at::matmul(q, k.repeat_interleave(g, 1).transpose(2, 3)) /
                std::sqrt(static_cast<double>(q.size(3)));
  auto row = at::arange(nq, at::kLong).unsqueeze(1) + (n - nq);
  auto col = at::arange(n, at::kLong).unsqueeze(0);
  return at::logsumexp(logits.masked_fill(col > row, -INFINITY), -1);
}

// The fused H2O column-sum kernel against the CPU reference fed the same fp32 LSE: bf16 / fp16,
// g 1/4/7, D 64/128, odd n (several key tiles, rows in many chunks), nq = n and nq = 100 < n,
// random and sink inputs, a strided q (the runner's [T, Hq, D] transposed) and B = 2.
// Tolerance: both sides read the same rounded inputs; the kernel's fp32 tensor-core sums and
// ex2.approx differ from ATen's fp32 by ~1e-6 relative, so relative L2 < 1e-2 is loose, and the
// top 10% (what selection keeps) must agree to 0.99.
TEST_F(KernelsGpuTest, H2oFromLseMatchesCpuReference) {
  struct Case {
    int64_t b, hq, hkv, nq, n, d;
    bool sink, strided;
  };
  const std::vector<Case> cases = {
      {1, 8, 8, 777, 777, 128, false, false}, {1, 16, 4, 100, 1001, 128, false, true},
      {1, 14, 2, 555, 555, 64, true, false},  {2, 8, 2, 100, 999, 64, false, false},
      {1, 28, 4, 100, 2049, 128, true, true}, {1, 7, 1, 333, 333, 128, false, false}};
  for (const Case& c : cases) {
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      auto q = c.strided ? at::randn({c.b, c.nq, c.hq, c.d}).transpose(1, 2)
                         : at::randn({c.b, c.hq, c.nq, c.d});
      auto k = at::randn({c.b, c.hkv, c.n, c.d});
      auto v = at::randn({c.b, c.hkv, c.n, c.d}).to(dtype);
      if (c.sink) {  // key 3 aligned with every query of its group: most of each row's mass
        k.select(2, 3).copy_(q.reshape({c.b, c.hkv, -1, c.d}).mean(2) * 60.0);
      }
      q = q.to(dtype);
      k = k.to(dtype);
      auto qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat);
      auto lse = H2oRowLse(qf, kf);
      for (bool post : {false, true}) {
        H2oParams params;
        params.divide_by_num_queries = post;
        params.value_norm_p = post ? 2 : 0;
        auto want = H2oScoresFromLse(qf, kf, vf, lse, params);
        ASSERT_TRUE(want.ok()) << want.status();
        auto qc = c.strided ? q.transpose(1, 2).contiguous().to(at::kCUDA).transpose(1, 2)
                            : q.to(at::kCUDA);
        Poison();
        auto got =
            H2oScoresFromLse(qc, k.to(at::kCUDA), v.to(at::kCUDA), lse.to(at::kCUDA), params);
        ASSERT_TRUE(got.ok()) << got.status();
        auto g64 = got->cpu().to(at::kDouble), w64 = want->to(at::kDouble);
        ASSERT_FALSE(g64.isnan().any().item<bool>()) << "NaN (unwritten?)";
        const double rel = ((g64 - w64).norm() / w64.norm()).item<double>();
        const double overlap = TopOverlap(*got, *want);
        std::printf(
            "h2o-from-lse %s B=%lld g=%lld nq=%lld n=%lld D=%lld %s%s%s: overlap %.4f, "
            "relative L2 error %.2e\n",
            c10::toString(dtype), static_cast<long long>(c.b), static_cast<long long>(c.hq / c.hkv),
            static_cast<long long>(c.nq), static_cast<long long>(c.n), static_cast<long long>(c.d),
            c.sink ? "sink" : "random", c.strided ? " strided-q" : "", post ? " divide+||v||2" : "",
            overlap, rel);
        EXPECT_LT(rel, 1e-2);
        EXPECT_GE(overlap, 0.99);
      }
    }
  }
}

// The CUDA fallback of H2oScores (ATen in row chunks) and the kernel agree on the device.
TEST_F(KernelsGpuTest, H2oFromLseEqualsAtenOnDevice) {
  const int64_t hq = 32, hkv = 8, nq = 300, n = 1500, d = 128;
  auto q = at::randn({1, hq, nq, d}).to(at::kBFloat16).to(at::kCUDA);
  auto k = at::randn({1, hkv, n, d}).to(at::kBFloat16).to(at::kCUDA);
  auto lse = H2oRowLse(q.cpu().to(at::kFloat), k.cpu().to(at::kFloat)).to(at::kCUDA);
  auto aten = H2oScores(q, k, k);
  Poison();
  auto fused = H2oScoresFromLse(q, k, k, lse);
  ASSERT_TRUE(aten.ok() && fused.ok()) << aten.status() << fused.status();
  ExpectClose(*fused, *aten, 1e-3, 1e-4, "h2o fused vs ATen on CUDA");
}

TEST_F(KernelsGpuTest, SplitAndUnsplitAgree) {
  auto q = at::randn({1, 32, 8, 128}, kCuda);
  auto k = at::randn({1, 8, 20000, 128}, kCuda);
  auto v = at::randn({1, 8, 20000, 128}, kCuda);
  DropKvParams one, many;
  one.num_splits = 1;
  many.num_splits = 64;
  auto a = DropKvScores(q, k, v, one), b = DropKvScores(q, k, v, many);
  ASSERT_TRUE(a.ok() && b.ok());
  // The LSE of one split and of 64 merged ones differ by fp32 rounding (~1e-6 relative).
  ExpectClose(*b, *a, 1e-4, 1e-6, "64 splits vs 1");
  // Tensor-core path (bf16): same split independence.
  auto qb = q.to(at::kBFloat16), kb = k.to(at::kBFloat16), vb = v.to(at::kBFloat16);
  auto ab = DropKvScores(qb, kb, vb, one), bb = DropKvScores(qb, kb, vb, many);
  ASSERT_TRUE(ab.ok() && bb.ok());
  // P is rounded to bf16 against each split's running max before P V, so a (and the scores)
  // move by bf16 rounding (~4e-3 relative) between split counts; the fp32 check above holds
  // the LSE merge itself to 1e-4.
  ExpectClose(*bb, *ab, 1e-2, 1e-4, "bf16 tensor cores: 64 splits vs 1");
}

TEST_F(KernelsGpuTest, RejectsUnsupportedHeadDim) {
  auto q = at::randn({1, 4, 8, 96}, kCuda), k = at::randn({1, 2, 100, 96}, kCuda);
  auto st = DropKvScores(q, k, k).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("head_dim must be 64, 128 or 256, got 96"), std::string::npos) << st;
}

TEST_F(KernelsGpuTest, PagedDecodeMatchesCpuReference) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t g : {1, 4, 7, 8, 16}) {
      for (int64_t d : {64, 128, 256}) {
        // g = 8 and 16 (two row chunks per KV head on the CUDA cores, rows 8..15 of the mma tile
        // on the tensor cores) in the two 16-bit dtypes at D 128, to keep the run short.
        if (g >= 8 && (dtype == at::kFloat || d != 128)) continue;
        const int64_t b = 4, hkv = 2, hq = hkv * g, bs = 16, max_blocks = 400,
                      nb = b * max_blocks + 7;
        auto kc = at::randn({nb, bs, hkv, d}).to(dtype), vc = at::randn({nb, bs, hkv, d}).to(dtype);
        auto q = at::randn({b, hq, d}).to(dtype);
        auto tables = at::randperm(nb, at::kInt)
                          .slice(0, 0, b * max_blocks)
                          .view({b, max_blocks})
                          .contiguous();
        auto lens = at::tensor({6001, 1, 0, 333}, at::kInt);
        auto want = PagedDecodeAttentionReference(q.to(at::kFloat), kc.to(at::kFloat),
                                                  vc.to(at::kFloat), tables, lens);
        ASSERT_TRUE(want.ok()) << want.status();
        Poison();
        PagedAttentionParams hint;  // every other case: the tables' capacity bounds the grid
        hint.max_seq_len = (g == 4) ? 6001 : 0;
        auto got = PagedDecodeAttention(q.to(at::kCUDA), kc.to(at::kCUDA), vc.to(at::kCUDA),
                                        tables.to(at::kCUDA), lens.to(at::kCUDA), hint);
        ASSERT_TRUE(got.ok()) << got.status();
        // fp32: accumulation order only; bf16/fp16: the output is rounded to the model dtype.
        const double tol = dtype == at::kFloat ? 1e-4 : (dtype == at::kHalf ? 2e-3 : 1e-2);
        ExpectClose(*got, *want, tol, tol,
                    std::string(c10::toString(dtype)) + " g=" + std::to_string(g) +
                        " D=" + std::to_string(d));
      }
    }
  }
}

// Block size 1 with one split: the split's block ids exceed the kernel's shared-memory cache and
// are read from the table in global memory; the default split count caches them. Both against
// the CPU reference.
TEST_F(KernelsGpuTest, PagedDecodeBlockSizeOneAndSplitCounts) {
  const int64_t b = 3, hkv = 2, g = 4, d = 128, bs = 1, max_blocks = 5000, nb = b * max_blocks;
  for (int32_t splits : {1, 0, 7}) {
    auto kc = at::randn({nb, bs, hkv, d}).to(at::kBFloat16);
    auto vc = at::randn({nb, bs, hkv, d}).to(at::kBFloat16);
    auto q = at::randn({b, hkv * g, d}).to(at::kBFloat16);
    auto tables = at::randperm(nb, at::kInt).view({b, max_blocks}).contiguous();
    auto lens = at::tensor({5000, 17, 0}, at::kInt);
    auto want = PagedDecodeAttentionReference(q.to(at::kFloat), kc.to(at::kFloat),
                                              vc.to(at::kFloat), tables, lens);
    ASSERT_TRUE(want.ok()) << want.status();
    Poison();
    PagedAttentionParams params;
    params.num_splits = splits;
    auto got = PagedDecodeAttention(q.to(at::kCUDA), kc.to(at::kCUDA), vc.to(at::kCUDA),
                                    tables.to(at::kCUDA), lens.to(at::kCUDA), params);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectClose(*got, *want, 1e-2, 1e-2, "block size 1, splits " + std::to_string(splits));
  }
}

// Inputs of a paged decode call: random pool, random disjoint tables, given lengths.
struct PagedCase {
  at::Tensor q, kc, vc, tables, lens;  // CPU
};
PagedCase MakePagedCase(int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t bs,
                        int64_t max_blocks, const std::vector<int>& lens, at::ScalarType dtype) {
  const int64_t nb = b * max_blocks + 3;
  PagedCase c;
  c.kc = at::randn({nb, bs, hkv, d}).to(dtype);
  c.vc = at::randn({nb, bs, hkv, d}).to(dtype);
  c.q = at::randn({b, hkv * g, d}).to(dtype);
  c.tables =
      at::randperm(nb, at::kInt).slice(0, 0, b * max_blocks).view({b, max_blocks}).contiguous();
  c.lens = at::tensor(lens, at::kInt);
  return c;
}
at::Tensor PagedCpu(const PagedCase& c) {
  auto want = PagedDecodeAttentionReference(c.q.to(at::kFloat), c.kc.to(at::kFloat),
                                            c.vc.to(at::kFloat), c.tables, c.lens);
  EXPECT_TRUE(want.ok()) << want.status();
  return want.ok() ? *want : at::Tensor();
}

// One split per sequence (num_splits 1, and lengths a split holds under the default count): the
// kernels write the output directly, without partials or the merge.
TEST_F(KernelsGpuTest, PagedDecodeSingleSplit) {
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t g : {1, 4, 16}) {
      for (int64_t d : {64, 128}) {
        auto c = MakePagedCase(3, 2, g, d, 16, 64, {1000, 5, 0}, dtype);
        auto want = PagedCpu(c);
        for (int32_t splits : {1, 0}) {
          Poison();
          PagedAttentionParams params;
          params.num_splits = splits;
          params.max_seq_len = splits == 0 ? 40 : 0;  // 40 keys: one split of 48 by default
          auto lens = splits == 0 ? at::tensor({40, 5, 0}, at::kInt) : c.lens;
          auto want_here = splits == 0 ? PagedCpu({c.q, c.kc, c.vc, c.tables, lens}) : want;
          auto got = PagedDecodeAttention(c.q.to(at::kCUDA), c.kc.to(at::kCUDA), c.vc.to(at::kCUDA),
                                          c.tables.to(at::kCUDA), lens.to(at::kCUDA), params);
          ASSERT_TRUE(got.ok()) << got.status();
          const double tol = dtype == at::kFloat ? 1e-4 : (dtype == at::kHalf ? 2e-3 : 1e-2);
          ExpectClose(*got, want_here, tol, tol,
                      std::string(c10::toString(dtype)) + " g=" + std::to_string(g) +
                          " D=" + std::to_string(d) + " splits " + std::to_string(splits));
        }
      }
    }
  }
}

// The folded merge counts its CTAs on a per-stream counter that the merging CTA resets: many
// launches in a row (split counts and lengths changing, so different counters go through
// different counts) must each equal the reference, and the same inputs give the same bits
// (the merge order does not depend on which CTA finishes last).
TEST_F(KernelsGpuTest, PagedDecodeRepeatedLaunchesReuseTheCounters) {
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    auto c = MakePagedCase(5, 2, 4, 128, 16, 300, {4000, 17, 4799, 0, 1}, dtype);
    auto kc = c.kc.to(at::kCUDA), vc = c.vc.to(at::kCUDA), tables = c.tables.to(at::kCUDA);
    at::Tensor first;
    for (int iter = 0; iter < 12; ++iter) {
      const bool same = iter % 3 == 0;  // every third launch repeats the first inputs
      auto lens = same ? c.lens : at::randint(0, 4800, {5}, at::kInt);
      auto q = same ? c.q : at::randn(c.q.sizes()).to(dtype);
      PagedAttentionParams params;
      params.num_splits = same ? 0 : static_cast<int32_t>(iter * 7 % 60);
      auto got = PagedDecodeAttention(q.to(at::kCUDA), kc, vc, tables, lens.to(at::kCUDA), params);
      ASSERT_TRUE(got.ok()) << got.status();
      if (same) {
        if (!first.defined()) first = got->clone();
        EXPECT_TRUE(at::equal(*got, first)) << "launch " << iter << ": not bitwise identical";
      }
      const double tol = dtype == at::kFloat ? 1e-4 : 1e-2;
      ExpectClose(*got, PagedCpu({q, c.kc, c.vc, c.tables, lens}), tol, tol,
                  std::string(c10::toString(dtype)) + " launch " + std::to_string(iter));
    }
  }
}

// A CUDA graph of decode calls (fixed shapes and max_seq_len, as the runner captures them),
// replayed with new queries, tables and lengths copied into its inputs: equals the eager call on
// the same inputs bit for bit, and the CPU reference.
TEST_F(KernelsGpuTest, PagedDecodeGraphReplayEqualsEager) {
#ifndef DROPKV_CUDA_ENABLED
  GTEST_SKIP() << "built without CUDA";
#else
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t g : {4, 16}) {
      const int64_t b = 4, hkv = 2, d = 128, bs = 16, max_blocks = 200;
      auto c = MakePagedCase(b, hkv, g, d, bs, max_blocks, {3000, 1, 0, 2500}, dtype);
      auto kc = c.kc.to(at::kCUDA), vc = c.vc.to(at::kCUDA);
      auto q_in = c.q.to(at::kCUDA), tables_in = c.tables.to(at::kCUDA);
      auto lens_in = c.lens.to(at::kCUDA);
      PagedAttentionParams params;
      params.max_seq_len = 3200;
      // Eager first (lazy initialisation stays out of the capture), then capture on a side
      // stream; two calls in the graph, as two layers.
      ASSERT_TRUE(PagedDecodeAttention(q_in, kc, vc, tables_in, lens_in, params).ok());
      at::cuda::CUDAGraph graph;
      at::Tensor out1, out2;
      {
        auto side = at::cuda::getStreamFromPool();
        c10::cuda::CUDAStreamGuard guard(side);
        graph.capture_begin();
        auto r1 = PagedDecodeAttention(q_in, kc, vc, tables_in, lens_in, params);
        auto r2 = PagedDecodeAttention(q_in, vc, kc, tables_in, lens_in, params);  // K, V swapped
        graph.capture_end();
        ASSERT_TRUE(r1.ok() && r2.ok());
        out1 = *r1;
        out2 = *r2;
      }
      for (int iter = 0; iter < 4; ++iter) {
        auto q_cpu = at::randn(c.q.sizes()).to(dtype);
        std::vector<int> lens = {3200 - 37 * iter, iter, iter == 0 ? 0 : 999, 1 + 700 * iter};
        auto lens_cpu = at::tensor(lens, at::kInt);
        auto tables_cpu = at::randperm(c.kc.size(0), at::kInt)
                              .slice(0, 0, b * max_blocks)
                              .view({b, max_blocks})
                              .contiguous();
        q_in.copy_(q_cpu);
        tables_in.copy_(tables_cpu);
        lens_in.copy_(lens_cpu);
        Poison();
        graph.replay();
        auto eager1 = PagedDecodeAttention(q_in, kc, vc, tables_in, lens_in, params);
        auto eager2 = PagedDecodeAttention(q_in, vc, kc, tables_in, lens_in, params);
        ASSERT_TRUE(eager1.ok() && eager2.ok());
        const std::string what = std::string(c10::toString(dtype)) + " g=" + std::to_string(g) +
                                 " replay " + std::to_string(iter);
        EXPECT_TRUE(at::equal(out1, *eager1)) << what << ": graph != eager (layer 1)";
        EXPECT_TRUE(at::equal(out2, *eager2)) << what << ": graph != eager (layer 2)";
        const double tol = dtype == at::kFloat ? 1e-4 : (dtype == at::kHalf ? 2e-3 : 1e-2);
        ExpectClose(out1, PagedCpu({q_cpu, c.kc, c.vc, tables_cpu, lens_cpu}), tol, tol, what);
        ExpectClose(out2, PagedCpu({q_cpu, c.vc, c.kc, tables_cpu, lens_cpu}), tol, tol, what);
      }
    }
  }
#endif
}

// Programmatic dependent launch: a chain of decode ops launched back to back, each reading what
// the one before wrote (AddRmsNorm -> RopeWriteKv with the norm's output as qkv -> paged
// attention over the K/V just stored -> GatedActivation of its output -> AddRmsNorm adding that
// into a second residual, in place), three times as three layers. Run eagerly back to back (the
// kernels overlap their predecessors' tails), and captured in a CUDA graph (programmatic edges),
// it must equal bit for bit the same chain with the device synchronized after every op (no
// overlap possible, as with DROPKV_PDL=0). Batch 2: one CTA per SM (16 splits); batch 12: about 2.
TEST_F(KernelsGpuTest, PdlChainGraphAndEagerEqualSynchronized) {
#ifndef DROPKV_CUDA_ENABLED
  GTEST_SKIP() << "built without CUDA";
#else
  if (!FusedOpsBuilt()) GTEST_SKIP() << "fused ops not built";
  std::printf("PDL %s (kernels/tuning.h)\n", kernels::Tuning().pdl ? "on" : "off");
  const int64_t hq = 32, hkv = 8, d = 128, bs = 16, layers = 3;
  const int64_t width = (hq + 2 * hkv) * d, inter = hq * d / 2;
  const QkvGeometry geo{hq, hkv, d};
  const auto bf16 = kCuda.dtype(at::kBFloat16);
  for (int64_t b : {2, 12}) {
    const int64_t max_blocks = 260, nb = b * max_blocks + 5;
    auto kc = at::randn({nb, bs, hkv, d}, bf16), vc = at::randn({nb, bs, hkv, d}, bf16);
    auto norm_w = at::randn({width}, bf16), norm2_w = at::randn({inter}, bf16);
    auto inv_freq = (1.0 / at::pow(500000.0, at::arange(0, d, 2, at::kFloat) / d)).to(at::kCUDA);
    // Inputs copied from the host (as the runner uploads its decode step's).
    std::vector<int> lens_v;
    for (int64_t i = 0; i < b; ++i) lens_v.push_back(static_cast<int>(4096 - 301 * i));
    auto lens_cpu = at::tensor(lens_v, at::kInt);
    auto tables = at::randperm(nb, at::kInt)
                      .slice(0, 0, b * max_blocks)
                      .view({b, max_blocks})
                      .contiguous()
                      .to(at::kCUDA);
    auto lens = lens_cpu.to(at::kCUDA);
    // The newest key of sequence i is stored at entry lens[i] - 1.
    auto tables_cpu = tables.cpu();
    std::vector<int64_t> slot_v;
    for (int64_t i = 0; i < b; ++i) {
      const int64_t t = lens_v[i] - 1;
      slot_v.push_back(tables_cpu[i][t / bs].item<int32_t>() * bs + t % bs);
    }
    auto slots = at::tensor(slot_v, at::kLong).to(at::kCUDA);
    auto positions = (lens_cpu.to(at::kLong) - 1).to(at::kCUDA);
    PagedAttentionParams params;
    params.max_seq_len = 4096;
    params.metadata_uploaded = true;
    params.older_keys_ready = true;  // RopeWriteKv stores each sequence's last key only
    // Static inputs of the chain (the graph reads these addresses).
    auto residual = at::empty({b, width}, bf16), delta = at::empty({b, width}, bf16);
    auto residual2 = at::empty({b, inter}, bf16);
    auto kc0 = kc.clone(), vc0 = vc.clone();
    auto chain = [&](bool sync) -> std::vector<at::Tensor> {
      auto step = [&](auto&& r) {
        EXPECT_TRUE(r.ok()) << r.status();
        if (sync) C10_CUDA_CHECK(cudaDeviceSynchronize());
        return *std::move(r);
      };
      std::vector<at::Tensor> outs;
      at::Tensor d_in = delta;
      for (int64_t l = 0; l < layers; ++l) {
        at::Tensor qkv = step(AddRmsNorm(residual, d_in, norm_w, 1e-5));
        at::Tensor q = step(RopeWriteKv(qkv, geo, positions, inv_freq, kc, vc, slots));
        at::Tensor attn = step(PagedDecodeAttention(q, kc, vc, tables, lens, params));
        at::Tensor gated = step(GatedActivation(attn.view({b, hq * d}), GateActivation::kSilu));
        at::Tensor y = step(AddRmsNorm(residual2, gated, norm2_w, 1e-5));
        d_in = qkv;  // the next layer adds this layer's normed rows into the residual
        outs.push_back(attn);
        outs.push_back(y);
      }
      outs.push_back(residual);
      outs.push_back(residual2);
      return outs;
    };
    at::Tensor res_cpu, delta_cpu, res2_cpu;
    auto reset = [&] {  // the same inputs and caches before every run
      residual.copy_(res_cpu);
      delta.copy_(delta_cpu);
      residual2.copy_(res2_cpu);
      kc.copy_(kc0);
      vc.copy_(vc0);
    };
    auto clone_all = [](const std::vector<at::Tensor>& ts) {
      std::vector<at::Tensor> out;
      for (const auto& t : ts) out.push_back(t.clone());
      return out;
    };
    res_cpu = at::randn({b, width}).to(at::kBFloat16);
    delta_cpu = at::randn({b, width}).to(at::kBFloat16);
    res2_cpu = at::randn({b, inter}).to(at::kBFloat16);
    reset();
    (void)chain(false);  // lazy initialisation (split plans, counters) before the capture
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    at::cuda::CUDAGraph graph;
    std::vector<at::Tensor> graph_outs;
    {
      auto side = at::cuda::getStreamFromPool();
      c10::cuda::CUDAStreamGuard guard(side);
      graph.capture_begin();
      graph_outs = chain(false);
      graph.capture_end();
    }
    for (int iter = 0; iter < 3; ++iter) {
      res_cpu = at::randn({b, width}).to(at::kBFloat16);
      delta_cpu = at::randn({b, width}).to(at::kBFloat16);
      res2_cpu = at::randn({b, inter}).to(at::kBFloat16);
      reset();
      Poison();
      const auto want = clone_all(chain(true));
      const auto kc_want = kc.clone();
      reset();
      Poison();
      const auto eager = clone_all(chain(false));
      reset();
      graph.replay();
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(at::equal(kc, kc_want)) << "batch " << b << ": key cache after the graph";
      ASSERT_EQ(want.size(), graph_outs.size());
      for (size_t i = 0; i < want.size(); ++i) {
        const std::string what = "batch " + std::to_string(b) + " replay " + std::to_string(iter) +
                                 " output " + std::to_string(i);
        ASSERT_FALSE(want[i].isnan().any().item<bool>()) << what << ": NaN (unwritten?)";
        EXPECT_TRUE(at::equal(eager[i], want[i])) << what << ": eager back to back != synced";
        EXPECT_TRUE(at::equal(graph_outs[i], want[i])) << what << ": graph != synced";
      }
      // The synchronized chain itself: layer 1's attention against the CPU reference over the
      // caches it read.
      reset();
      at::Tensor q1 = *RopeWriteKv(*AddRmsNorm(residual, delta, norm_w, 1e-5), geo, positions,
                                   inv_freq, kc, vc, slots);
      ExpectClose(want[0], PagedCpu({q1.cpu(), kc.cpu(), vc.cpu(), tables_cpu, lens_cpu}), 1e-2,
                  1e-2, "batch " + std::to_string(b) + " layer 1 attention vs CPU");
    }
  }
#endif
}

// Tensor-core scoring with more packed rows than the score pass keeps resident (g * W = 48 > 32:
// Q / a reloaded per tile; 3 row chunks, an odd count: pass 1's second CTA has one idle chunk)
// and with ragged varlen sequences (persistent CTAs over tiles).
TEST_F(KernelsGpuTest, DropKvBf16ManyRowsAndVarlen) {
  const std::vector<int64_t> cu = {0, 3000, 3065, 3066, 7166};
  const int64_t hq = 32, hkv = 4, w = 6, d = 128, total = cu.back();
  auto q = at::randn({4, hq, w, d}).to(at::kBFloat16);
  auto k = at::randn({total, hkv, d}).to(at::kBFloat16);
  auto v = at::randn({total, hkv, d}).to(at::kBFloat16);
  auto cu_t = at::tensor(cu, at::kLong);
  DropKvParams params;
  params.p_round_dtype = at::kBFloat16;
  auto want =
      DropKvScoresVarlen(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), cu_t, params);
  ASSERT_TRUE(want.ok()) << want.status();
  Poison();
  auto got = DropKvScoresVarlen(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA), cu_t, params);
  ASSERT_TRUE(got.ok()) << got.status();
  auto g_cpu = got->cpu();
  ASSERT_FALSE(g_cpu.isnan().any().item<bool>());
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t len = cu[s + 1] - cu[s];
    if (len < 1000) continue;  // top-10% of a few keys is too coarse a measure
    const double overlap =
        TopOverlap(g_cpu.slice(1, cu[s], cu[s + 1]), want->slice(1, cu[s], cu[s + 1]));
    std::printf("varlen bf16 g=8 W=6 sequence %zu (n=%lld): top-10%% overlap %.4f\n", s,
                static_cast<long long>(len), overlap);
    EXPECT_GE(overlap, 0.99) << "sequence " << s;
  }
  // The short sequences: same scores as the dense call on that sequence alone.
  for (size_t s : {size_t{1}, size_t{2}}) {
    auto qs = q.slice(0, s, s + 1).to(at::kCUDA);
    auto ks = k.slice(0, cu[s], cu[s + 1]).transpose(0, 1).unsqueeze(0).contiguous().to(at::kCUDA);
    auto vs = v.slice(0, cu[s], cu[s + 1]).transpose(0, 1).unsqueeze(0).contiguous().to(at::kCUDA);
    auto alone = DropKvScores(qs, ks, vs, params);
    ASSERT_TRUE(alone.ok()) << alone.status();
    ExpectClose(g_cpu.slice(1, cu[s], cu[s + 1]), (*alone)[0], 1e-5, 1e-6,
                "short sequence " + std::to_string(s) + " varlen vs alone");
  }
}

TEST_F(KernelsGpuTest, CacheOpsAndSelectionMatchCpu) {
  const int64_t nb = 64, bs = 16, hkv = 8, d = 128, t = 100, n = 500, keep = 50;
  auto kc = at::randn({nb, bs, hkv, d}).to(at::kBFloat16),
       vc = at::randn({nb, bs, hkv, d}).to(at::kBFloat16);
  auto kc_gpu = kc.to(at::kCUDA), vc_gpu = vc.to(at::kCUDA);
  auto kn = at::randn({t, hkv, d}).to(at::kBFloat16), vn = at::randn({t, hkv, d}).to(at::kBFloat16);
  auto slots = at::randperm(nb * bs, at::kLong).slice(0, 0, t).contiguous();
  slots[3] = -1;
  ASSERT_TRUE(WriteKv(kc, vc, kn, vn, slots).ok());
  ASSERT_TRUE(
      WriteKv(kc_gpu, vc_gpu, kn.to(at::kCUDA), vn.to(at::kCUDA), slots.to(at::kCUDA)).ok());
  EXPECT_TRUE(at::equal(kc, kc_gpu.cpu()) && at::equal(vc, vc_gpu.cpu()));

  // Max pooling makes plateaus of equal values where CPU and CUDA top-k may break ties
  // differently: compare exact indices without pooling, the kept pooled mass with it.
  auto scores = at::randn({1, hkv, n});
  SelectParams no_pool;
  no_pool.pool = PoolType::kPoolTypeNone;
  auto idx = SelectTopK(scores, keep, no_pool);
  auto idx_gpu = SelectTopK(scores.to(at::kCUDA), keep, no_pool);
  ASSERT_TRUE(idx.ok() && idx_gpu.ok());
  EXPECT_TRUE(at::equal(*idx, idx_gpu->cpu()));
  auto pooled = PoolScores(scores, PoolType::kPoolTypeMax, 11);
  ASSERT_TRUE(pooled.ok());
  ASSERT_TRUE(ProtectScores(*pooled, 8, 0).ok());
  auto idx_max = SelectTopK(scores, keep), idx_max_gpu = SelectTopK(scores.to(at::kCUDA), keep);
  ASSERT_TRUE(idx_max.ok() && idx_max_gpu.ok());
  EXPECT_TRUE(at::allclose(pooled->gather(-1, *idx_max).sum(-1),
                           pooled->gather(-1, idx_max_gpu->cpu()).sum(-1)));
  auto k = at::randn({hkv, n, d}).to(at::kBFloat16), v = at::randn({hkv, n, d}).to(at::kBFloat16);
  auto kept_slots = at::randperm(nb * bs, at::kLong).slice(0, 0, keep).contiguous();
  ASSERT_TRUE(WriteKeptKv(kc, vc, k, v, (*idx)[0], kept_slots).ok());
  ASSERT_TRUE(WriteKeptKv(kc_gpu, vc_gpu, k.to(at::kCUDA), v.to(at::kCUDA), (*idx)[0].to(at::kCUDA),
                          kept_slots.to(at::kCUDA))
                  .ok());
  EXPECT_TRUE(at::equal(kc, kc_gpu.cpu()) && at::equal(vc, vc_gpu.cpu()));
}

// The CUDA top-k (radix select + ordered compaction, the CUDA default) against the CPU path with
// the same tie order (lower positions): the same indices, ties included, with pooling, protection,
// B > 1 and several (n, keep).
TEST_F(KernelsGpuTest, SelectionMatchesCpuWithTies) {
  at::manual_seed(31);
  struct Case {
    int64_t b, hkv, n;
    double ratio;
    PoolType pool;
    int32_t sinks;
    bool coarse;  // rounded scores: ties across the whole row
  };
  const Case cases[] = {
      {1, 1, 1, 0.1, PoolType::kPoolTypeMax, 0, false},
      {2, 3, 7, 0.5, PoolType::kPoolTypeNone, 1, true},
      {1, 8, 1000, 0.1, PoolType::kPoolTypeMax, 4, false},
      {3, 2, 4099, 0.3, PoolType::kPoolTypeAvg, 0, true},
      {2, 8, 131072, 0.1, PoolType::kPoolTypeMax, 4, false},
      {1, 8, 131072, 0.1, PoolType::kPoolTypeNone, 0, true},
      {1, 2, 65537, 1.0, PoolType::kPoolTypeMax, 0, true},
      {1, 2, 5000, 0.0, PoolType::kPoolTypeMax, 0, false},
  };
  for (const Case& c : cases) {
    auto s = at::randn({c.b, c.hkv, c.n});
    if (c.coarse) s = at::round(s * 3.0);
    s.select(2, 0).fill_(-0.0);  // -0 ties with +0
    SelectParams params;
    params.pool = c.pool;
    params.num_sinks = c.sinks;
    const int64_t keep = KeepCount(c.n, c.ratio, params.window);
    auto idx_gpu = SelectTopK(s.to(at::kCUDA), keep, params);  // kDeviceDefault
    params.ties = TieOrder::kLowerPosition;
    auto idx = SelectTopK(s, keep, params);
    ASSERT_TRUE(idx.ok() && idx_gpu.ok()) << idx.status() << idx_gpu.status();
    EXPECT_TRUE(at::equal(*idx, idx_gpu->cpu()))
        << "b " << c.b << " hkv " << c.hkv << " n " << c.n << " keep " << keep;
  }
}

}  // namespace
}  // namespace dropkv::kernels
