// FP8 weights on CUDA (label gpu, skipped without a device): the FP8 GEMM with per-token
// activation scales (engine/model/fp8.h) against the same math in fp32, the decode GEMV over FP8
// weights (with and without its RoPE epilogue) and the activation quantization kernel, and a model
// folder with FP8 weights on CUDA in bf16 (FP8 GEMMs in prefill and in a 70-row decode batch,
// captured in a CUDA graph) against the CPU's dequantizing fp32 forward and against eager decode.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/fp8.h"
#include "engine/model/safetensors.h"
#include "engine/runner/model_runner.h"
#include "kernels/fused_gemv.h"
#include "kernels/fused_ops.h"
#include "kernels/kv_cache_fp8.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;

#define SKIP_WITHOUT_CUDA() \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device"

double RelDiff(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kCPU, at::kFloat), w = want.to(at::kCPU, at::kFloat);
  return ((g - w).norm() / w.norm()).item<double>();
}

// The worst row's relative L2 difference (rows of different magnitudes: one bad row shows).
double MaxRowRelDiff(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kCPU, at::kFloat), w = want.to(at::kCPU, at::kFloat);
  return ((g - w).norm(2, {1}) / w.norm(2, {1})).max().item<double>();
}

// x quantized per token to e4m3 and back in fp32 (scale amax / 448): the activations the FP8 GEMM
// multiplies.
at::Tensor PerTokenQuantized(const at::Tensor& x) {
  auto xf = x.to(at::kFloat);
  auto xs = xf.abs().amax(1, true) / kFp8E4m3Max;
  return (xf / xs).clamp(-448, 448).to(at::kFloat8_e4m3fn).to(at::kFloat) * xs;
}

TEST(Fp8GpuTest, ScaledMmEqualsPerTokenQuantizedMathInFp32) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(3);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  // Rows of different magnitudes in x and in w: a scale on the wrong axis shows.
  auto x = (at::randn({130, 576}) * at::linspace(0.1, 5.0, 130).unsqueeze(1))
               .to(cuda.dtype(at::kBFloat16));
  auto w = (at::randn({960, 576}) * at::linspace(0.01, 0.3, 960).unsqueeze(1)).to(cuda);
  auto b = at::randn({960}).to(cuda.dtype(at::kBFloat16));
  auto [w8, scale] = QuantizeFp8PerChannel(w);
  auto y = Fp8ScaledMm(x, w8, scale, b);
  ASSERT_TRUE(y.has_value());
  EXPECT_EQ(y->scalar_type(), at::kBFloat16);
  // The same quantization of x in fp32, then fp32 math: only the GEMM's accumulation order and
  // the bf16 output's rounding (2^-9 relative) differ.
  auto xf = x.to(at::kFloat);
  auto want = at::linear(PerTokenQuantized(x), DequantizeFp8(w8, scale, 0), b.to(at::kFloat));
  const double exact = RelDiff(*y, want);
  // Against the dequantizing linear (unquantized activations): e4m3's 2^-4 relative step on x.
  const double vs_dequant =
      RelDiff(*y, at::linear(xf, DequantizeFp8(w8, scale, 0), b.to(at::kFloat)));
  std::printf("[fp8 gpu] scaled_mm vs fp32 math %.2e, vs dequantized weights only %.2e\n", exact,
              vs_dequant);
  EXPECT_LT(exact, 4e-3);
  EXPECT_LT(vs_dequant, 5e-2);
  // A few rows (decode batches the GEMV cannot take) go through it too.
  auto few = Fp8ScaledMm(x.narrow(0, 0, 7), w8, scale, b);
  ASSERT_TRUE(few.has_value());
  EXPECT_LT(RelDiff(*few, want.narrow(0, 0, 7)), 4e-3);
  // Not applicable: fp32 activations.
  EXPECT_FALSE(Fp8ScaledMm(xf, w8, scale, b).has_value());
}

// A Llama folder with head_dim 64 (the paged kernels' geometry) and weights drawn on the CPU, so
// that the CPU and CUDA runners load the same ones.
std::string WriteFolder() {
  const fs::path dir = testing::ScratchDir("fp8_gpu") / "llama";
  testing::TinyLlamaShape s;
  fs::create_directories(dir);
  fs::copy_file(fs::path(testing::WriteTinyLlamaConfig("fp8_gpu", s)) / "config.json",
                dir / "config.json", fs::copy_options::overwrite_existing);
  at::manual_seed(11);
  std::vector<std::pair<std::string, at::Tensor>> w;
  const int64_t h = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  w.emplace_back("model.embed_tokens.weight", at::randn({s.vocab, h}));
  w.emplace_back("lm_head.weight", at::randn({s.vocab, h}) * 0.5);
  w.emplace_back("model.norm.weight", at::ones({h}));
  for (int i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w.emplace_back(p + "input_layernorm.weight", at::ones({h}));
    w.emplace_back(p + "post_attention_layernorm.weight", at::ones({h}));
    w.emplace_back(p + "self_attn.q_proj.weight", at::randn({q, h}) * 0.05);
    w.emplace_back(p + "self_attn.k_proj.weight", at::randn({kv, h}) * 0.05);
    w.emplace_back(p + "self_attn.v_proj.weight", at::randn({kv, h}) * 0.05);
    w.emplace_back(p + "self_attn.o_proj.weight", at::randn({h, q}) * 0.05);
    w.emplace_back(p + "mlp.gate_proj.weight", at::randn({s.intermediate, h}) * 0.05);
    w.emplace_back(p + "mlp.up_proj.weight", at::randn({s.intermediate, h}) * 0.05);
    w.emplace_back(p + "mlp.down_proj.weight", at::randn({h, s.intermediate}) * 0.05);
  }
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), w).ok());
  return dir.string();
}

std::unique_ptr<ModelRunner> MakeRunner(const std::string& dir, bool cuda, bool graphs) {
  RunnerOptions o;
  o.model_dir = dir;
  o.device = cuda ? "cuda" : "cpu";
  o.dtype = cuda ? "bfloat16" : "float32";
  o.quantization = "fp8";
  o.block_size = 16;
  o.num_kv_blocks = 1024;
  o.cuda_graphs = graphs;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 131 + salt * 17) % 500);
  return t;
}

// Decode's GEMV over FP8 weights (kernels/fused_gemv.h) against fp32 math over the dequantized
// weights: only the accumulation order and the output's rounding differ (bf16: 2^-9 relative).
// Rows of x of different magnitudes (each token's power of two into fp16: one on the wrong token
// shows) and of w (a scale on the wrong row shows), 1 / 3 / 8 rows of x and the most the GEMV
// takes at that K (two mma tiles from 9), K of the 8B model's down projection and one that leaves
// a partial stage, strided x rows, bias on and off, bf16 and fp16 x, and the same bits twice.
TEST(Fp8GpuTest, Fp8GemvEqualsFp32MathOverDequantizedWeights) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const int64_t k : {576, 14336}) {
      auto w = (at::randn({1000, k}) * at::linspace(0.01, 0.3, 1000).unsqueeze(1)).to(cuda);
      auto [w8, scale] = QuantizeFp8PerChannel(w);
      const at::Tensor wf = DequantizeFp8(w8, scale, 0);
      const int64_t max_rows = kernels::FusedGemvMaxRows(k, dtype);
      ASSERT_GE(max_rows, 3) << "k " << k;
      for (const int64_t m : {int64_t{1}, int64_t{3}, std::min<int64_t>(8, max_rows), max_rows}) {
        for (const bool with_bias : {false, true}) {
          // Rows of a wider tensor: the GEMV reads x through its row stride.
          auto wide = (at::randn({m, k + 64}) * at::linspace(0.2, 30.0, m).unsqueeze(1))
                          .to(cuda.dtype(dtype));
          auto x = wide.narrow(1, 0, k);
          auto b = with_bias ? at::randn({1000}).to(cuda.dtype(dtype)) : at::Tensor();
          auto y = kernels::Gemv(x, w8, b, scale);
          ASSERT_TRUE(y.ok()) << y.status();
          EXPECT_EQ(y->scalar_type(), dtype);
          const at::Tensor bf = with_bias ? b.to(at::kFloat) : at::Tensor();
          const double rel = MaxRowRelDiff(*y, at::linear(x.to(at::kFloat), wf, bf));
          EXPECT_LT(rel, 4e-3) << "k " << k << " m " << m << " bias " << with_bias << " "
                               << c10::toString(dtype);
          auto again = kernels::Gemv(x, w8, b, scale);
          EXPECT_TRUE(at::equal(*y, *again)) << "not deterministic";
          if (m == max_rows && with_bias && dtype == at::kBFloat16)
            std::printf("[fp8 gpu] GEMV k %lld m %lld vs fp32 %.2e\n", static_cast<long long>(k),
                        static_cast<long long>(m), rel);
        }
      }
    }
  }
  // Refused: more rows than it takes, K not a multiple of 16, fp32 x, no scales, block scales.
  auto w8 = QuantizeFp8PerChannel(at::randn({64, 64}).to(cuda)).first;
  auto s = at::ones({64, 1}, cuda.dtype(at::kFloat));
  const auto bf16 = cuda.dtype(at::kBFloat16);
  const int64_t max_rows = kernels::FusedGemvMaxRows(64, at::kBFloat16);
  EXPECT_FALSE(kernels::Gemv(at::randn({max_rows + 1, 64}, bf16), w8, {}, s).ok());
  auto w8_k40 = QuantizeFp8PerChannel(at::randn({64, 40}).to(cuda)).first;
  EXPECT_FALSE(kernels::Gemv(at::randn({2, 40}, bf16), w8_k40, {}, s).ok());
  EXPECT_FALSE(kernels::Gemv(at::randn({2, 64}).to(cuda), w8, {}, s).ok());
  EXPECT_FALSE(kernels::Gemv(at::randn({2, 64}, bf16), w8, {}, {}).ok());
  EXPECT_FALSE(
      kernels::Gemv(at::randn({2, 64}, bf16), w8, {}, at::ones({64, 2}, s.options())).ok());
}

// qkv's GEMV over FP8 weights with the RoPE epilogue: the same bits as the FP8 GEMV followed by
// RopeWriteKv, into a bf16 cache and into an FP8 one (Llama-3.1-8B's head geometry at a smaller
// K, a padding row that must not be stored).
TEST(Fp8GpuTest, Fp8GemvRopeEpilogueMatchesGemvThenRopeWriteKv) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(8);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const auto bf16 = cuda.dtype(at::kBFloat16);
  const kernels::QkvGeometry geo{8, 2, 128};
  const int64_t k = 1024, rows = (geo.num_heads + 2 * geo.num_kv_heads) * geo.head_dim;
  auto [w8, scale] = QuantizeFp8PerChannel(
      (at::randn({rows, k}) * at::linspace(0.01, 0.2, rows).unsqueeze(1)).to(cuda));
  auto inv_freq =
      at::pow(500000.0, -at::arange(0, 128, 2, cuda.dtype(at::kDouble)) / 128).to(at::kFloat);
  for (const bool fp8_cache : {false, true}) {
    for (const int64_t m : {int64_t{1}, int64_t{5}, kernels::FusedGemvMaxRows(k, at::kBFloat16)}) {
      auto cache = at::randn({32, 16, geo.num_kv_heads, geo.head_dim}, bf16);
      if (fp8_cache) cache = kernels::QuantizeKv(cache);
      auto x = at::randn({m, k}, bf16);
      auto positions = at::randint(0, 100000, {m}, cuda.dtype(at::kLong));
      auto slots = at::randperm(32 * 16, cuda.dtype(at::kLong)).narrow(0, 0, m).clone();
      if (m > 1) slots[1] = -1;
      auto want_k = cache.clone(), want_v = cache.clone();
      auto qkv = kernels::Gemv(x, w8, {}, scale);
      ASSERT_TRUE(qkv.ok()) << qkv.status();
      auto want_q = kernels::RopeWriteKv(*qkv, geo, positions, inv_freq, want_k, want_v, slots);
      ASSERT_TRUE(want_q.ok()) << want_q.status();
      auto got_k = cache.clone(), got_v = cache.clone();
      auto got_q =
          kernels::GemvRopeWriteKv(x, w8, {}, geo, positions, inv_freq, got_k, got_v, slots, scale);
      ASSERT_TRUE(got_q.ok()) << got_q.status();
      const std::string what = "m " + std::to_string(m) + (fp8_cache ? " fp8 cache" : "");
      EXPECT_TRUE(at::equal(*got_q, *want_q)) << what;
      EXPECT_TRUE(at::equal(got_k.view(at::kByte), want_k.view(at::kByte))) << what;
      EXPECT_TRUE(at::equal(got_v.view(at::kByte), want_v.view(at::kByte))) << what;
    }
  }
}

// The FP8 GEMM's activation quantization in one kernel: the same bytes and scales as the ATen
// chain it replaced, for rows of different magnitudes, a zero row, values that saturate after
// the scale (none: amax maps to 448) and strided rows.
TEST(Fp8GpuTest, QuantizeRowsFp8EqualsTheAtenChain) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(9);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const int64_t k : {16, 4104, 14336}) {
      auto wide =
          (at::randn({37, k + 8}) * at::logspace(-3, 3, 37).unsqueeze(1)).to(cuda.dtype(dtype));
      wide[4].zero_();
      auto x = wide.narrow(1, 0, k);
      auto got = kernels::QuantizeRowsFp8(x);
      ASSERT_TRUE(got.ok()) << got.status();
      auto xf = x.to(at::kFloat);
      auto amax = xf.abs().amax(1, true);
      auto want_scale = at::where(amax > 0, amax / kFp8E4m3Max, at::ones_like(amax));
      auto want = (xf / want_scale).clamp(-kFp8E4m3Max, kFp8E4m3Max).to(at::kFloat8_e4m3fn);
      const std::string what = std::string(c10::toString(dtype)) + " k " + std::to_string(k);
      EXPECT_TRUE(at::equal(got->second, want_scale)) << what;
      EXPECT_TRUE(at::equal(got->first.view(at::kByte), want.view(at::kByte)))
          << what << ": "
          << got->first.view(at::kByte).ne(want.view(at::kByte)).sum().item<int64_t>()
          << " bytes differ";
    }
  }
}

TEST(Fp8GpuTest, CudaBf16ForwardFollowsTheCpuDequantizingForward) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = WriteFolder();
  auto cpu = MakeRunner(dir, false, false);
  auto gpu = MakeRunner(dir, true, true);
  auto eager = MakeRunner(dir, true, false);
  ASSERT_TRUE(cpu && gpu && eager);
  // Prefill: 250 rows, every projection through the FP8 GEMM on CUDA.
  auto a = cpu->Prefill(1, Prompt(250, 1), true, {});
  auto b = gpu->Prefill(1, Prompt(250, 1), true, {});
  ASSERT_TRUE(a.ok() && b.ok());
  const double prefill = RelDiff(*b, *a);
  // Decode: 70 sequences in one step (FP8 GEMMs inside the captured graph) vs eager.
  constexpr int kSeqs = 70;
  std::vector<SequenceId> seqs;
  std::vector<int32_t> tokens;
  for (int s = 0; s < kSeqs; ++s) {
    const SequenceId id = 100 + s;
    auto g = gpu->Prefill(id, Prompt(5 + s % 23, s), true, {});
    auto e = eager->Prefill(id, Prompt(5 + s % 23, s), true, {});
    ASSERT_TRUE(g.ok() && e.ok());
    seqs.push_back(id);
    tokens.push_back(static_cast<int32_t>(e->argmax().item<int64_t>()));
  }
  double decode = 0;
  for (int step = 0; step < 4; ++step) {
    auto g = gpu->Decode(seqs, tokens);
    auto e = eager->Decode(seqs, tokens);
    ASSERT_TRUE(g.ok() && e.ok()) << g.status() << " " << e.status();
    decode = std::max(decode, RelDiff(*g, *e));
    auto next = e->argmax(-1).to(at::kCPU);
    for (int s = 0; s < kSeqs; ++s) tokens[s] = static_cast<int32_t>(next[s].item<int64_t>());
  }
  std::printf("[fp8 gpu] prefill CUDA bf16 vs CPU fp32: %.2e; 70-row decode graph vs eager: %.2e\n",
              prefill, decode);
  // bf16 activations and per-token activation quantization against fp32 with plain activations.
  EXPECT_LT(prefill, 8e-2);
  EXPECT_LT(decode, 1e-2);
}

}  // namespace
}  // namespace dropkv
