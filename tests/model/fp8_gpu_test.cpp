// FP8 weights on CUDA (label gpu, skipped without a device): the FP8 GEMM with per-token
// activation scales (engine/model/fp8.h) against the same math in fp32, and a model folder with
// FP8 weights on CUDA in bf16 (FP8 GEMMs in prefill and in a 70-row decode batch, captured in a
// CUDA graph) against the CPU's dequantizing fp32 forward and against eager decode.
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
  auto amax = xf.abs().amax(1, true);
  auto xs = amax / kFp8E4m3Max;
  auto xq = (xf / xs).clamp(-448, 448).to(at::kFloat8_e4m3fn).to(at::kFloat) * xs;
  auto want = at::linear(xq, DequantizeFp8(w8, scale, 0), b.to(at::kFloat));
  const double exact = RelDiff(*y, want);
  // Against the dequantizing linear (unquantized activations): e4m3's 2^-4 relative step on x.
  const double vs_dequant =
      RelDiff(*y, at::linear(xf, DequantizeFp8(w8, scale, 0), b.to(at::kFloat)));
  std::printf("[fp8 gpu] scaled_mm vs fp32 math %.2e, vs dequantized weights only %.2e\n", exact,
              vs_dequant);
  EXPECT_LT(exact, 4e-3);
  EXPECT_LT(vs_dequant, 5e-2);
  // Not applicable: fewer rows, fp32 activations, a column count not a multiple of 16.
  EXPECT_FALSE(Fp8ScaledMm(x.narrow(0, 0, kFp8GemmMinRows - 1), w8, scale, b).has_value());
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

// Decode's FP8 GEMV (kernels/fused_gemv.h) against fp32 math over the dequantized weights: only
// the accumulation order and the output's rounding differ (bf16: 2^-9 relative). Rows of
// different magnitudes in w (a scale on the wrong row shows), 1 / 3 / 16 rows of x, K of the
// 8B model's down projection, strided x rows, bias on and off, and the same bits twice.
TEST(Fp8GpuTest, Fp8GemvEqualsFp32MathOverDequantizedWeights) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (const int64_t k : {576, 14336}) {
    auto w = (at::randn({1000, k}) * at::linspace(0.01, 0.3, 1000).unsqueeze(1)).to(cuda);
    auto [w8, scale] = QuantizeFp8PerChannel(w);
    const at::Tensor wf = DequantizeFp8(w8, scale, 0);
    for (const int64_t m : {1, 3, 16}) {
      for (const bool with_bias : {false, true}) {
        // Rows of a wider tensor: the GEMV reads x through its row stride.
        auto wide = at::randn({m, k + 64}).to(cuda.dtype(at::kBFloat16));
        auto x = wide.narrow(1, 0, k);
        auto b = with_bias ? at::randn({1000}).to(cuda.dtype(at::kBFloat16)) : at::Tensor();
        auto y = kernels::Fp8Gemv(x, w8, scale, b);
        ASSERT_TRUE(y.ok()) << y.status();
        EXPECT_EQ(y->scalar_type(), at::kBFloat16);
        auto want = at::linear(x.to(at::kFloat), wf, with_bias ? b.to(at::kFloat) : at::Tensor());
        const double rel = RelDiff(*y, want);
        EXPECT_LT(rel, 4e-3) << "k " << k << " m " << m << " bias " << with_bias;
        auto again = kernels::Fp8Gemv(x, w8, scale, b);
        EXPECT_TRUE(at::equal(*y, *again)) << "not deterministic";
        if (m == 16 && with_bias)
          std::printf("[fp8 gpu] GEMV k %lld vs fp32 %.2e\n", static_cast<long long>(k), rel);
      }
    }
  }
  // Refused: 17 rows, K not a multiple of 16, fp32 x.
  auto w8 = QuantizeFp8PerChannel(at::randn({64, 64}).to(cuda)).first;
  auto s = at::ones({64, 1}, cuda.dtype(at::kFloat));
  EXPECT_FALSE(kernels::Fp8Gemv(at::randn({17, 64}).to(cuda.dtype(at::kBFloat16)), w8, s, {}).ok());
  EXPECT_FALSE(kernels::Fp8Gemv(at::randn({2, 64}).to(cuda), w8, s, {}).ok());
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
