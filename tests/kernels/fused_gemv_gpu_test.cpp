// kernels/fused_gemv.h on CUDA against at::linear (cuBLAS) and the launches it replaces. Label
// gpu; skips without a GPU. Free blocks of the caching allocator hold NaN before each call, so an
// output element the kernel forgot to write shows up.
//
// Tolerance: the product accumulates in fp32 and is rounded once. So against an fp64 product of
// the same inputs every element is within 1 ulp of the dtype (relative) plus 1/32 ulp of the
// output's largest value (fp32 sums). cuBLAS is not that close on every shape (seen: bf16, K
// 3584, N 37, with bias: 2 ulp of the largest value off the fp64 product), so against cuBLAS the
// bound is cuBLAS's own distance from fp64 plus ours.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/fused_gemv.h"
#include "kernels/fused_ops.h"

namespace dropkv::kernels {
namespace {

const at::TensorOptions kCuda = at::TensorOptions().device(at::kCUDA);

class FusedGemvGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount returned 0 or failed)";
    ASSERT_TRUE(FusedGemvBuilt());
    at::manual_seed(1234);
  }
};

void Poison() {
  for (int64_t mib : {1, 4, 16, 64}) {
    auto t = at::full({mib << 18}, NAN, kCuda.dtype(at::kFloat));
  }
}

double Ulp(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
}

// got (ours) against ref64 (fp64 product of the same inputs) and want (the cuBLAS chain).
void ExpectGemmClose(const at::Tensor& got, const at::Tensor& want, const at::Tensor& ref64,
                     const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  auto r = ref64.to(at::kCPU, at::kDouble);
  ASSERT_FALSE(g.isnan().any().item<bool>()) << what << ": NaN in the output (unwritten?)";
  const double ulp = Ulp(want.scalar_type());
  const double scale = r.abs().max().item<double>();
  auto ours = (g - r).abs() - (ulp * r.abs() + ulp * scale / 32);
  const double cublas_off = (w - r).abs().max().item<double>();
  EXPECT_LE(ours.max().item<double>(), 0.0)
      << what << ": max |ours - fp64| " << (g - r).abs().max().item<double>() << ", scale " << scale
      << " (cuBLAS: " << cublas_off << ")";
  auto vs_cublas = (g - w).abs() - ((w - r).abs() + ulp * r.abs() + ulp * scale / 32);
  EXPECT_LE(vs_cublas.max().item<double>(), 0.0)
      << what << ": max |ours - cuBLAS| " << (g - w).abs().max().item<double>() << ", scale "
      << scale << ", differing elements " << g.ne(w).sum().item<int64_t>() << " of " << g.numel();
}

// at::linear in fp64 (on the device).
at::Tensor Linear64(const at::Tensor& x, const at::Tensor& w64, const at::Tensor& bias) {
  return at::linear(x.to(at::kDouble), w64, bias.defined() ? bias.to(at::kDouble) : at::Tensor());
}

struct Shape {
  int64_t k, n;
};

// The real projections (Llama-3.1-8B, Qwen2.5-7B, Gemma-7B, Mistral / small models: K and N as
// the model has them; large N cut to keep the test short where K is large), odd N (not a multiple
// of the CTA's 16 rows), and random shapes (K a multiple of 8).
// DROPKV_GEMV_TEST_QUICK=1 (for compute-sanitizer, ~100x slower): four small shapes, M 1, 9, max.
bool Quick() {
  const char* v = std::getenv("DROPKV_GEMV_TEST_QUICK");
  return v != nullptr && std::string(v) == "1";
}

std::vector<Shape> Shapes() {
  if (Quick()) return {{4096, 40}, {14336, 24}, {3584, 37}, {64, 5}};
  // Llama-3.1-8B's five first (qkv, o_proj, gate_up, down, lm_head), whole.
  std::vector<Shape> shapes = {{4096, 6144},   {4096, 4096},  {4096, 28672}, {14336, 4096},
                               {4096, 128256}, {4096, 4104},  {3584, 4608},  {3072, 12288},
                               {18944, 3584},  {24576, 3072}, {4096, 1000},  {3584, 37},
                               {24576, 17},    {64, 5},       {8, 3}};
  std::mt19937 rng(7);
  for (int i = 0; i < 6; ++i) {
    const int64_t k = 8 * std::uniform_int_distribution<int64_t>(1, 1200)(rng);
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 2500)(rng);
    shapes.push_back({k, n});
  }
  return shapes;
}

// Token counts to try at this K: 1..max for the smaller matrices, a spread for the others.
std::vector<int64_t> TokenCounts(int64_t k, int64_t n, at::ScalarType dtype) {
  const int64_t max_rows = FusedGemvMaxRows(k, dtype);
  std::vector<int64_t> ms;
  if (Quick()) {
    for (int64_t m : {int64_t{1}, int64_t{9}, max_rows})
      if (m <= max_rows && (ms.empty() || ms.back() < m)) ms.push_back(m);
  } else if (k * n <= (int64_t{1} << 21)) {
    for (int64_t m = 1; m <= max_rows; ++m) ms.push_back(m);
  } else {
    for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{9}, max_rows})
      if (m <= max_rows && (ms.empty() || ms.back() < m)) ms.push_back(m);
  }
  return ms;
}

// A shape's weight (std 0.02, as the models'), its fp64 copy for the reference, and a bias.
struct Weights {
  at::TensorOptions opts;
  at::Tensor w, w64, b;
};
Weights MakeWeights(at::ScalarType dtype, const Shape& s) {
  Weights r;
  r.opts = kCuda.dtype(dtype);
  r.w = at::randn({s.n, s.k}, r.opts) * 0.02;
  r.w64 = r.w.to(at::kDouble);
  r.b = at::randn({s.n}, r.opts);
  return r;
}

std::string Name(at::ScalarType dtype, const Shape& s, int64_t m, bool bias) {
  return std::string(c10::toString(dtype)) + " K=" + std::to_string(s.k) +
         " N=" + std::to_string(s.n) + " M=" + std::to_string(m) + (bias ? " bias" : "");
}

TEST_F(FusedGemvGpuTest, MaxRowsFollowsSharedMemory) {
  EXPECT_EQ(FusedGemvMaxRows(4096, at::kBFloat16), 16);
  EXPECT_EQ(FusedGemvMaxRows(3584, at::kHalf), 16);
  EXPECT_GE(FusedGemvMaxRows(14336, at::kBFloat16), 1);
  EXPECT_LE(FusedGemvMaxRows(14336, at::kBFloat16), FusedGemvMaxRows(4096, at::kBFloat16));
  EXPECT_GE(FusedGemvMaxRows(24576, at::kBFloat16), 1);
  EXPECT_EQ(FusedGemvMaxRows(4100, at::kBFloat16), 0);  // K % 8 != 0
  EXPECT_EQ(FusedGemvMaxRows(4096, at::kFloat), 0);
  std::cout << "max rows (bf16): K 4096 " << FusedGemvMaxRows(4096, at::kBFloat16) << ", 14336 "
            << FusedGemvMaxRows(14336, at::kBFloat16) << ", 18944 "
            << FusedGemvMaxRows(18944, at::kBFloat16) << ", 24576 "
            << FusedGemvMaxRows(24576, at::kBFloat16) << "\n";
}

TEST_F(FusedGemvGpuTest, PlainMatchesLinear) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const Shape& s : Shapes()) {
      const auto [opts, w, w64, b] = MakeWeights(dtype, s);
      std::cout << "plain " << Name(dtype, s, 0, false) << std::endl;  // progress, if it hangs
      for (int64_t m : TokenCounts(s.k, s.n, dtype)) {
        for (bool with_bias : {false, true}) {
          const std::string what = Name(dtype, s, m, with_bias);
          // x rows strided: a view of a wider tensor.
          auto x = at::randn({m, s.k + 8}, opts).narrow(1, 0, s.k);
          const at::Tensor bias = with_bias ? b : at::Tensor();
          auto want = at::linear(x, w, bias);
          Poison();
          auto got = Gemv(x, w, bias);
          ASSERT_TRUE(got.ok()) << what << ": " << got.status();
          ExpectGemmClose(*got, want, Linear64(x, w64, bias), "Gemv " + what);
        }
      }
    }
  }
}

// The K reduction has one order: two calls give the same bits.
TEST_F(FusedGemvGpuTest, Deterministic) {
  auto opts = kCuda.dtype(at::kBFloat16);
  auto w = at::randn({Quick() ? 40 : 4104, 14336}, opts) * 0.02;
  auto x = at::randn({3, 14336}, opts);
  auto first = Gemv(x, w, at::Tensor());
  auto second = Gemv(x, w, at::Tensor());
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(at::equal(*first, *second));
}

// A decode layer's chain of GEMVs and the fused ops between them, each reading its predecessor's
// output (launched with programmatic dependent launch, they start before it ends and must wait
// for it before reading): the same bits as the calls separated by device syncs, eagerly and in a
// CUDA graph.
TEST_F(FusedGemvGpuTest, ChainedCallsReadTheirPredecessorsOutput) {
  auto opts = kCuda.dtype(at::kBFloat16);
  const int64_t hidden = 4096, inter = 2048;
  auto w_o = at::randn({hidden, hidden}, opts) * 0.02;
  auto w_gate_up = at::randn({2 * inter, hidden}, opts) * 0.02;
  auto w_down = at::randn({hidden, inter}, opts) * 0.02;
  auto norm_w = at::rand({hidden}, opts) + 0.5;
  // x -> o = x W_o^T -> h = AddRmsNorm(r = x + o) -> gu = h W_gate_up^T -> a = act(gu)
  // -> d = a W_down^T -> d W_o^T
  auto chain = [&](const at::Tensor& x, bool sync) {
    auto step = [&] {
      if (sync) c10::cuda::device_synchronize();
    };
    auto o = Gemv(x, w_o, at::Tensor());
    step();
    auto r = x.clone();  // AddRmsNorm adds into its residual
    auto h = AddRmsNorm(r, *o, norm_w, 1e-5);
    step();
    auto gu = Gemv(*h, w_gate_up, at::Tensor());
    step();
    auto a = GatedActivation(*gu, GateActivation::kSilu);
    step();
    auto d = Gemv(*a, w_down, at::Tensor());
    step();
    auto out = Gemv(*d, w_o, at::Tensor());
    step();
    EXPECT_TRUE(o.ok() && h.ok() && gu.ok() && a.ok() && d.ok() && out.ok());
    return std::vector<at::Tensor>{*o, r, *h, *gu, *a, *d, *out};
  };
  for (int64_t m : {1, 5}) {
    auto x = at::randn({m, hidden}, opts);
    const auto want = chain(x, /*sync=*/true);
    const auto got = chain(x, /*sync=*/false);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::equal(got[i], want[i])) << "M " << m << ", output " << i << " (eager)";
    auto stream = at::cuda::getStreamFromPool();
    at::cuda::CUDAStreamGuard guard(stream);
    at::cuda::CUDAGraph graph;
    auto x_graph = at::zeros_like(x);
    graph.capture_begin();
    const auto captured = chain(x_graph, /*sync=*/false);
    graph.capture_end();
    x_graph.copy_(x);
    graph.replay();
    c10::cuda::device_synchronize();
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::equal(captured[i], want[i])) << "M " << m << ", output " << i << " (graph)";
  }
}

// Captured in a CUDA graph (as the runner's decode step is) and replayed on new inputs.
TEST_F(FusedGemvGpuTest, ReplaysInCudaGraph) {
  auto opts = kCuda.dtype(at::kBFloat16);
  auto w = at::randn({6144, 4096}, opts) * 0.02;
  auto x = at::randn({2, 4096}, opts);
  auto stream = at::cuda::getStreamFromPool();
  at::cuda::CUDAStreamGuard guard(stream);
  ASSERT_TRUE(Gemv(x, w, at::Tensor()).ok());  // warm-up
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  auto captured = Gemv(x, w, at::Tensor());
  graph.capture_end();
  ASSERT_TRUE(captured.ok()) << captured.status();
  x.copy_(at::randn({2, 4096}, opts));
  graph.replay();
  ExpectGemmClose(*captured, at::linear(x, w), Linear64(x, w.to(at::kDouble), at::Tensor()),
                  "graph replay");
}

// The RoPE epilogue against the two launches it replaces (Gemv, then RopeWriteKv): the same bits
// in q and in every slot of both caches (written or not), for Llama-3.1-8B's, Qwen2.5-7B's (bias)
// and a small model's (D 64) qkv, and Gemma-7B's (D 256) and D 40 (the two launches there), with
// random positions and a padding row (slot -1) that must not be stored.
TEST_F(FusedGemvGpuTest, RopeEpilogueMatchesGemvThenRopeWriteKv) {
  struct Case {
    int64_t k, hq, hkv, d;
    bool bias;
  };
  std::vector<Case> cases = {{4096, 32, 8, 128, false},
                             {3584, 28, 4, 128, true},
                             {3072, 16, 16, 256, false},
                             {256, 4, 2, 64, true},
                             {64, 2, 1, 40, false}};
  if (Quick()) cases = {{256, 4, 2, 64, true}, {64, 2, 1, 40, false}};
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const Case& c : cases) {
      const QkvGeometry geo{c.hq, c.hkv, c.d};
      const Shape s{c.k, (c.hq + 2 * c.hkv) * c.d};
      const auto [opts, w, w64, b] = MakeWeights(dtype, s);
      const at::Tensor bias = c.bias ? b : at::Tensor();
      auto inv_freq =
          at::pow(500000.0, -at::arange(0, c.d, 2, kCuda.dtype(at::kDouble)) / c.d).to(at::kFloat);
      const int64_t num_slots = 64 * 16;
      auto key_cache = at::randn({64, 16, c.hkv, c.d}, opts);
      auto value_cache = at::randn({64, 16, c.hkv, c.d}, opts);
      for (int64_t m : {int64_t{1}, int64_t{3}, FusedGemvMaxRows(c.k, dtype)}) {
        const std::string what = Name(dtype, s, m, c.bias) + " D=" + std::to_string(c.d);
        auto x = at::randn({m, c.k}, opts);
        auto positions = at::randint(0, 100000, {m}, kCuda.dtype(at::kLong));
        auto slots = at::randperm(num_slots, kCuda.dtype(at::kLong)).narrow(0, 0, m).clone();
        if (m > 1) slots[1] = -1;
        auto want_k = key_cache.clone(), want_v = value_cache.clone();
        auto qkv = Gemv(x, w, bias);
        ASSERT_TRUE(qkv.ok()) << what << ": " << qkv.status();
        auto want_q = RopeWriteKv(*qkv, geo, positions, inv_freq, want_k, want_v, slots);
        ASSERT_TRUE(want_q.ok()) << what << ": " << want_q.status();
        Poison();
        auto got_k = key_cache.clone(), got_v = value_cache.clone();
        auto got_q = GemvRopeWriteKv(x, w, bias, geo, positions, inv_freq, got_k, got_v, slots);
        ASSERT_TRUE(got_q.ok()) << what << ": " << got_q.status();
        EXPECT_TRUE(at::equal(*got_q, *want_q))
            << what << ": q differs in " << got_q->ne(*want_q).sum().item<int64_t>() << " of "
            << want_q->numel();
        EXPECT_TRUE(at::equal(got_k, want_k))
            << what << ": key cache differs in " << got_k.ne(want_k).sum().item<int64_t>();
        EXPECT_TRUE(at::equal(got_v, want_v))
            << what << ": value cache differs in " << got_v.ne(want_v).sum().item<int64_t>();
      }
    }
  }
  // A weight that is not q | k | v of the geometry.
  auto opts = kCuda.dtype(at::kBFloat16);
  auto cache = at::zeros({4, 16, 2, 64}, opts);
  auto wrong =
      GemvRopeWriteKv(at::randn({1, 256}, opts), at::randn({64 * 7, 256}, opts), at::Tensor(),
                      QkvGeometry{4, 2, 64}, at::zeros({1}, kCuda.dtype(at::kLong)),
                      at::ones({32}, kCuda.dtype(at::kFloat)), cache, cache,
                      at::zeros({1}, kCuda.dtype(at::kLong)));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("(Hq + 2 Hkv) * D"), std::string::npos) << wrong.status();
}

TEST_F(FusedGemvGpuTest, RejectsWhatItCannotRun) {
  auto opts = kCuda.dtype(at::kBFloat16);
  auto w = at::randn({64, 4096}, opts);
  const int64_t max_rows = FusedGemvMaxRows(4096, at::kBFloat16);
  auto too_many = Gemv(at::randn({max_rows + 1, 4096}, opts), w, at::Tensor());
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("at most"), std::string::npos) << too_many.status();
  auto cpu = Gemv(at::randn({1, 4096}, at::kBFloat16), w, at::Tensor());
  ASSERT_FALSE(cpu.ok());
  EXPECT_EQ(cpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cpu.status().message().find("x"), std::string::npos) << cpu.status();
  auto odd_k = Gemv(at::randn({1, 4100}, opts), at::randn({64, 4100}, opts), at::Tensor());
  ASSERT_FALSE(odd_k.ok());
  EXPECT_NE(odd_k.status().message().find("K = 4100"), std::string::npos) << odd_k.status();
  auto fp32 = Gemv(at::randn({1, 64}, kCuda.dtype(at::kFloat)),
                   at::randn({8, 64}, kCuda.dtype(at::kFloat)), at::Tensor());
  ASSERT_FALSE(fp32.ok());
  EXPECT_NE(fp32.status().message().find("weight"), std::string::npos) << fp32.status();
}

}  // namespace
}  // namespace dropkv::kernels
