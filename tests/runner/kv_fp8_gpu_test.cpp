// The FP8 KV cache on CUDA (label gpu; skips without a device): the fused RoPE + K/V store and the
// qkv GEMV's RoPE epilogue write the bytes QuantizeKv gives for their bf16 values, the cache writes
// equal the CPU's, the paged decode kernel over an e4m3 pool against the CPU reference over the
// dequantized values, and the runner in bf16 with an FP8 cache (graph replay within bf16 noise of
// eager, the logits near a bf16 cache's).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "kernels/cache_ops.h"
#include "kernels/fused_gemv.h"
#include "kernels/fused_ops.h"
#include "kernels/kv_cache_fp8.h"
#include "kernels/paged_attention.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

using kernels::kFp8KvDtype;
const at::TensorOptions kCuda = at::TensorOptions().device(at::kCUDA);

class KvFp8GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

// Two e4m3 tensors equal byte for byte (ATen has no comparison ops for float8).
bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  return at::equal(a.view(at::kByte).cpu(), b.view(at::kByte).cpu());
}

at::Tensor InvFreq(int64_t d) {
  return at::pow(500000.0, -at::arange(0, d, 2, kCuda.dtype(at::kDouble)) / d).to(at::kFloat);
}

// RoPE + K/V store, and the GEMV's epilogue (D 128 and 64; D 256 takes the two launches), into an
// e4m3 pool: the bytes of QuantizeKv over the same ops into a bf16 pool; q unchanged.
TEST_F(KvFp8GpuTest, FusedStoresWriteTheQuantizedValues) {
  struct Case {
    int64_t k, hq, hkv, d;
  };
  for (const Case& c : {Case{4096, 32, 8, 128}, Case{576, 9, 3, 64}, Case{3072, 16, 16, 256}}) {
    const std::string what = "D=" + std::to_string(c.d);
    const kernels::QkvGeometry geo{c.hq, c.hkv, c.d};
    const int64_t nb = 32, bs = 16, m = 3;
    auto opts = kCuda.dtype(at::kBFloat16);
    auto w = (at::randn({(c.hq + 2 * c.hkv) * c.d, c.k}, opts) * 0.05).contiguous();
    auto x = at::randn({m, c.k}, opts) * 4;  // K/V of magnitude ~10: the full e4m3 range in use
    auto positions = at::randint(0, 100000, {m}, kCuda.dtype(at::kLong));
    auto slots = at::randperm(nb * bs, kCuda.dtype(at::kLong)).narrow(0, 0, m).clone();
    slots[1] = -1;  // padding: not stored
    auto inv_freq = InvFreq(c.d);
    auto k16 = at::zeros({nb, bs, c.hkv, c.d}, opts), v16 = at::zeros_like(k16);
    auto qkv = kernels::Gemv(x, w, at::Tensor());
    ASSERT_TRUE(qkv.ok()) << qkv.status();
    auto want_q = kernels::RopeWriteKv(*qkv, geo, positions, inv_freq, k16, v16, slots);
    ASSERT_TRUE(want_q.ok()) << want_q.status();
    auto k8 = at::zeros({nb, bs, c.hkv, c.d}, kCuda.dtype(kFp8KvDtype)), v8 = at::zeros_like(k8);
    auto q = kernels::RopeWriteKv(*qkv, geo, positions, inv_freq, k8, v8, slots);
    ASSERT_TRUE(q.ok()) << what << ": " << q.status();
    EXPECT_TRUE(at::equal(*q, *want_q)) << what;
    // Unwritten slots stay 0 in both, so the whole pools compare.
    EXPECT_TRUE(SameBytes(k8, kernels::QuantizeKv(k16))) << what << ": key cache";
    EXPECT_TRUE(SameBytes(v8, kernels::QuantizeKv(v16))) << what << ": value cache";
    auto ke = at::zeros_like(k8), ve = at::zeros_like(k8);
    auto qe = kernels::GemvRopeWriteKv(x, w, at::Tensor(), geo, positions, inv_freq, ke, ve, slots);
    ASSERT_TRUE(qe.ok()) << what << ": " << qe.status();
    EXPECT_TRUE(at::equal(*qe, *want_q)) << what;
    EXPECT_TRUE(SameBytes(ke, k8)) << what << ": epilogue key cache";
    EXPECT_TRUE(SameBytes(ve, v8)) << what << ": epilogue value cache";
  }
}

TEST_F(KvFp8GpuTest, CacheWritesEqualTheCpus) {
  const int64_t nb = 8, bs = 16, h = 4, d = 128, t = 37;
  auto k = at::randn({t, h, d}, at::kBFloat16) * 30, v = at::randn({t, h, d}, at::kBFloat16);
  k[0][0][0] = 1000;  // saturates
  auto slots = at::randperm(nb * bs, at::kLong).narrow(0, 0, t).clone();
  auto kc = at::zeros({nb, bs, h, d}, kFp8KvDtype), vc = at::zeros_like(kc);
  ASSERT_TRUE(kernels::WriteKv(kc, vc, k, v, slots).ok());
  auto kg = kc.cuda().zero_(), vg = vc.cuda().zero_();
  ASSERT_TRUE(kernels::WriteKv(kg, vg, k.cuda(), v.cuda(), slots.cuda()).ok());
  EXPECT_TRUE(SameBytes(kg, kc));
  EXPECT_TRUE(SameBytes(vg, vc));
  auto kk = at::randn({h, t, d}, at::kBFloat16), vk = at::randn({h, t, d}, at::kBFloat16);
  auto kept = std::get<0>(at::sort(std::get<1>(at::rand({h, t}).topk(5, 1)), 1));
  auto kept_slots = at::tensor({3, 40, 41, 100, 127}, at::kLong);
  ASSERT_TRUE(kernels::WriteKeptKv(kc, vc, kk, vk, kept, kept_slots).ok());
  ASSERT_TRUE(
      kernels::WriteKeptKv(kg, vg, kk.cuda(), vk.cuda(), kept.cuda(), kept_slots.cuda()).ok());
  EXPECT_TRUE(SameBytes(kg, kc));
  EXPECT_TRUE(SameBytes(vg, vc));
}

// The CUDA-core kernel over e4m3 against the CPU reference over the same values in fp32 (q in bf16
// and fp16, each head_dim and group size a model has, a long and a short sequence, an empty one).
TEST_F(KvFp8GpuTest, PagedDecodeOverE4m3MatchesTheCpuReference) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (int64_t g : {1, 2, 3, 4, 8}) {
      for (int64_t d : {64, 128, 256}) {
        if (dtype == at::kHalf && d != 128) continue;
        const int64_t b = 4, hkv = 2, bs = 16, max_blocks = 400, nb = b * max_blocks + 7;
        auto kc = kernels::QuantizeKv(at::randn({nb, bs, hkv, d}) * 3);
        auto vc = kernels::QuantizeKv(at::randn({nb, bs, hkv, d}));
        auto q = at::randn({b, hkv * g, d}).to(dtype);
        auto tables = at::randperm(nb, at::kInt)
                          .slice(0, 0, b * max_blocks)
                          .view({b, max_blocks})
                          .contiguous();
        auto lens = at::tensor({6001, 1, 0, 333}, at::kInt);
        auto want = kernels::PagedDecodeAttentionReference(q.to(at::kFloat), kc.to(at::kFloat),
                                                           vc.to(at::kFloat), tables, lens);
        ASSERT_TRUE(want.ok()) << want.status();
        auto got = kernels::PagedDecodeAttention(q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(),
                                                 lens.cuda());
        const std::string what = std::string(c10::toString(dtype)) + " g=" + std::to_string(g) +
                                 " D=" + std::to_string(d);
        ASSERT_TRUE(got.ok()) << what << ": " << got.status();
        auto diff = (got->cpu().to(at::kFloat) - *want).abs();
        // The output rounded to bf16 / fp16 (as the bf16 cache's kernels: kernels_gpu_test).
        const double tol = dtype == at::kHalf ? 2e-3 : 1e-2;
        EXPECT_LE((diff - tol * (want->abs() + want->abs().max())).max().item<double>(), 0.0)
            << what << ": max |diff| " << diff.max().item<double>();
      }
    }
  }
}

// SmolLM2-135M's geometry (D 64, 9 / 3 heads) at 4 layers with random weights: the GPU machine
// has no model folders.
std::string RandomModelDir() {
  const auto dir = std::filesystem::temp_directory_path() / "dropkv-kv-fp8-gpu-model";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["LlamaForCausalLM"],
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 4,
    "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": true,
    "bos_token_id": 1, "eos_token_id": 2})";
  return dir.string();
}

std::unique_ptr<ModelRunner> CudaRunner(const std::string& kv_dtype, bool graphs) {
  RunnerOptions o;
  o.model_dir = RandomModelDir();
  o.random_weights = true;
  o.random_seed = 7;
  o.device = "cuda";
  o.dtype = "bfloat16";
  o.kv_cache_dtype = kv_dtype;
  o.num_kv_blocks = 512;
  o.cuda_graphs = graphs;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

// Prefill (two chunks: the second reads the stored entries) then `forced` decode steps; fp32
// logits [1 + steps, vocab] on the CPU.
at::Tensor Logits(ModelRunner& r, const std::vector<int32_t>& prompt,
                  const std::vector<int32_t>& forced) {
  const SequenceId seq = 1;
  const size_t half = prompt.size() / 2;
  EXPECT_TRUE(
      r.Prefill(seq, std::vector<int32_t>(prompt.begin(), prompt.begin() + half), false, {}).ok());
  auto out = r.Prefill(seq, std::vector<int32_t>(prompt.begin() + half, prompt.end()), true, {});
  EXPECT_TRUE(out.ok()) << out.status();
  std::vector<at::Tensor> rows{out->cpu()};
  for (int32_t t : forced) {
    auto step = r.Decode(std::span(&seq, 1), std::span(&t, 1));
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    rows.push_back((*step)[0].cpu());
  }
  r.Release(seq);
  return at::stack(rows);
}

// The runner on CUDA with an FP8 cache (RoPE + store fused, the qkv GEMV's epilogue at batch 1,
// the e4m3 decode kernel): CUDA-graph replay near eager, and the logits near a bf16 cache's.
// (Random weights: the KL / agreement of a trained model are the CPU test's, on SmolLM2.)
TEST_F(KvFp8GpuTest, RunnerDecodeGraphsAndAgainstABf16Cache) {
  auto bf16 = CudaRunner("auto", true);
  auto fp8 = CudaRunner("fp8", true);
  auto fp8_eager = CudaRunner("fp8", false);
  ASSERT_TRUE(bf16 && fp8 && fp8_eager);
  std::vector<int32_t> prompt, forced;
  for (int i = 0; i < 300; ++i) prompt.push_back((i * 7919 + 11) % 49000 + 100);
  for (int i = 0; i < 40; ++i) forced.push_back((i * 104729 + 5) % 49000 + 100);
  auto lb = Logits(*bf16, prompt, forced);
  auto l8 = Logits(*fp8, prompt, forced);
  auto l8e = Logits(*fp8_eager, prompt, forced);
  ASSERT_FALSE(l8.isnan().any().item<bool>());
  // bf16 tolerance, as runner_cuda_graph_test: the graph's split-K grid comes from the context
  // bucket, eager's from the batch's longest sequence (another summation order).
  const double graph_rel = ((l8e - l8).norm() / l8e.norm()).item<double>();
  EXPECT_LT(graph_rel, 1e-2) << "graph replay vs eager";
  const double rel = ((l8 - lb).norm() / lb.norm()).item<double>();
  std::cout << "[fp8 kv, cuda bf16, random weights] logits vs a bf16 cache: relative L2 " << rel
            << "; graph replay vs eager " << graph_rel << "\n";
  EXPECT_LT(rel, 0.1);
}

}  // namespace
}  // namespace dropkv
