// CUDA graphs of the decode step (engine/runner/cuda_graph.h through ModelRunner): a runner that
// replays captured graphs gives the same logits as an eager runner over many steps with ragged
// batches that change size (padded rows) and cross a context bucket, with the fused kernels and
// against the ATen ops; a prefix adopted from another sequence's blocks equals its prefill; the
// CUDA KV pool default follows the device's free memory. Label gpu: skipped without a CUDA
// device.
#include "engine/runner/cuda_graph.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include "allocator/block_pool.h"
#include "engine/runner/model_runner.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

// A small Llama (GQA 4:1, head_dim 64: the paged kernel's geometry), random weights.
std::string TinyLlamaDir() {
  return testing::WriteTinyLlamaConfig("cuda_graph", {});
}

// decode_gemv off by default: the other cases compare cuBLAS against cuBLAS.
std::unique_ptr<ModelRunner> MakeRunner(bool graphs, bool fused_ops = true,
                                        bool decode_gemv = false) {
  RunnerOptions o;
  o.cuda_fused_ops = fused_ops;
  o.cuda_decode_gemv = decode_gemv;
  o.model_dir = TinyLlamaDir();
  o.device = "cuda";
  o.dtype = "bfloat16";
  o.random_weights = true;
  o.random_seed = 7;
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

// Runs the same prefills and decode batches through `ref` and `test`; every logits row must agree
// within bf16 tolerance (the greedy tokens follow `ref`). Returns the worst relative difference.
double ExpectSameLogits(ModelRunner& ref, ModelRunner& test, const char* label) {
  // Prompt lengths: 250 tokens = 16 blocks of 16, so a few decode steps in seq 1 crosses from the
  // 16-column table bucket to the next one; the rest are ragged.
  const std::map<SequenceId, int> prompt_len = {{1, 250}, {2, 17}, {3, 100}, {4, 5}, {5, 241}};
  std::map<SequenceId, int32_t> next;
  double worst = 0;
  for (const auto& [seq, n] : prompt_len) {
    auto a = ref.Prefill(seq, Prompt(n, static_cast<int>(seq)), true, {});
    auto b = test.Prefill(seq, Prompt(n, static_cast<int>(seq)), true, {});
    EXPECT_TRUE(a.ok() && b.ok()) << label;
    if (!a.ok() || !b.ok()) return worst;
    const double rel = ((b->cpu() - a->cpu()).norm() / a->cpu().norm()).item<double>();
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-2) << label << ": prefill of seq " << seq;
    next[seq] = static_cast<int32_t>(a->argmax().item<int64_t>());
  }
  // Batches of 3 (bucket 4: one padded row), 5 (bucket 8), 2 and 1, and back to 3.
  const std::vector<std::vector<SequenceId>> phases = {
      {1, 2, 3}, {1, 2, 3, 4, 5}, {2, 5}, {4}, {1, 3, 4}};
  int num_steps = 0;
  for (const auto& batch : phases) {
    for (int step = 0; step < 10; ++step, ++num_steps) {
      std::vector<int32_t> tokens;
      for (SequenceId s : batch) tokens.push_back(next[s]);
      auto a = ref.Decode(batch, tokens);
      auto b = test.Decode(batch, tokens);
      EXPECT_TRUE(a.ok()) << label << ": " << a.status();
      EXPECT_TRUE(b.ok()) << label << ": " << b.status();
      if (!a.ok() || !b.ok()) return worst;
      EXPECT_EQ(b->sizes(), a->sizes());
      for (size_t i = 0; i < batch.size(); ++i) {
        auto ra = (*a)[i].cpu(), rb = (*b)[i].cpu();
        // bf16 tolerance: the graph pads the GEMM rows, which may pick other cuBLAS kernels.
        const double rel = ((rb - ra).norm() / ra.norm()).item<double>();
        worst = std::max(worst, rel);
        EXPECT_LT(rel, 1e-2) << label << ": step " << num_steps << " seq " << batch[i];
        next[batch[i]] = static_cast<int32_t>(ra.argmax().item<int64_t>());
      }
    }
  }
  std::printf("%s: worst relative logits difference %.3g over %d steps\n", label, worst, num_steps);
  // The two runners hold the same sequences at the same lengths (padding wrote no live block).
  for (const auto& [seq, n] : prompt_len) {
    EXPECT_EQ(test.CacheInfo(seq).logical_len, ref.CacheInfo(seq).logical_len);
  }
  EXPECT_GT(test.CacheInfo(1).num_blocks / 3, 16) << "seq 1 never crossed a table bucket";
  return worst;
}

TEST(CudaGraphDecodeTest, GraphLogitsEqualEagerOverRaggedChangingBatches) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto eager = MakeRunner(false);
  auto graph = MakeRunner(true);
  ASSERT_TRUE(eager && graph);
  ExpectSameLogits(*eager, *graph, "graph vs eager");
}

// The fused kernels (kernels/fused_ops.h: residual + RMSNorm, RoPE + K/V store, gated activation)
// inside captured graphs against the ATen ops run eagerly: prefill and decode.
TEST(CudaGraphDecodeTest, FusedOpsInGraphsEqualAtenOpsEager) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto aten = MakeRunner(/*graphs=*/false, /*fused_ops=*/false);
  auto fused = MakeRunner(/*graphs=*/true, /*fused_ops=*/true);
  ASSERT_TRUE(aten && fused);
  ExpectSameLogits(*aten, *fused, "fused graphs vs ATen eager");
}

// The batch-1 decode GEMVs (kernels/fused_gemv.h: the fused norm / activation kernels, then the
// plain GEMV; qkv with RoPE + the K/V store) inside captured graphs against the ATen ops run
// eagerly (the batch-1 phase of ExpectSameLogits runs them).
TEST(CudaGraphDecodeTest, FusedGemvInGraphsEqualsAtenOpsEager) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto aten = MakeRunner(/*graphs=*/false, /*fused_ops=*/false);
  auto gemv = MakeRunner(/*graphs=*/true, /*fused_ops=*/true, /*decode_gemv=*/true);
  ASSERT_TRUE(aten && gemv);
  ExpectSameLogits(*aten, *gemv, "plain GEMV graphs vs ATen eager");
}

// A mixed step (decode rows and prefill chunks in one forward; the decode rows' K/V stored by
// the attention, not by the fused RoPE kernel) gives each row what the same work gives alone,
// within bf16 tolerance: a middle chunk, a last chunk and decode rows of ragged lengths.
TEST(CudaGraphDecodeTest, MixedStepEqualsEachPartAlone) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto mixed = MakeRunner(/*graphs=*/true);
  auto alone = MakeRunner(/*graphs=*/true);
  ASSERT_TRUE(mixed && alone);
  for (ModelRunner* r : {mixed.get(), alone.get()}) {
    ASSERT_TRUE(r->Prefill(1, Prompt(250, 1), true, {}).ok());
    ASSERT_TRUE(r->Prefill(2, Prompt(17, 2), true, {}).ok());
  }
  const CompressionParams none;
  const auto long_prompt = Prompt(300, 3);
  const auto short_prompt = Prompt(40, 4);
  const std::vector<SequenceId> decode_seqs = {1, 2};
  const std::vector<int32_t> decode_tokens = {42, 43};
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.cpu() - b.cpu()).norm() / b.cpu().norm()).item<double>();
  };
  for (int round = 0; round < 2; ++round) {
    std::vector<PrefillChunk> chunks;
    if (round == 0) {
      chunks = {{3, std::span(long_prompt).first(128), false, &none},
                {4, short_prompt, true, &none}};
    } else {
      chunks = {{3, std::span(long_prompt).subspan(128), true, &none}};
    }
    auto step = mixed->Step(decode_seqs, decode_tokens, chunks);
    ASSERT_TRUE(step.ok()) << step.status();
    auto d = alone->Decode(decode_seqs, decode_tokens);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_LT(rel(step->narrow(0, 0, 2), *d), 1e-2) << "round " << round;
    int64_t row = 2;
    for (const PrefillChunk& c : chunks) {
      auto p = alone->Prefill(c.seq, c.tokens, c.is_last_chunk, {});
      ASSERT_TRUE(p.ok()) << p.status();
      if (c.is_last_chunk) {
        EXPECT_LT(rel((*step)[row++], *p), 1e-2) << "seq " << c.seq;
      }
    }
  }
}

// The prefix cache's path on CUDA (ModelRunner::AdoptPrefix): a sequence that starts from another
// one's first blocks and prefills only the rest gives the logits of prefilling the whole prompt,
// then the same graph decode steps; the shared blocks go back to the pool with the last holder.
TEST(CudaGraphDecodeTest, AdoptedPrefixEqualsPrefilledPrompt) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto r = MakeRunner(true);
  ASSERT_TRUE(r);
  const std::vector<int32_t> prompt = Prompt(100, 9);
  const std::span<const int32_t> all(prompt);
  auto whole = r->Prefill(1, all, true, {});
  ASSERT_TRUE(whole.ok()) << whole.status();
  constexpr int kCached = 96;  // 6 blocks of 16
  std::vector<std::vector<int32_t>> blocks;
  for (int32_t l = 0; l < r->pool().num_layers(); ++l) {
    const auto& ids = r->pool().table(1, l).block_ids;
    blocks.emplace_back(ids.begin(), ids.begin() + kCached / 16);
  }
  ASSERT_TRUE(r->AdoptPrefix(2, all.first(kCached), blocks).ok());
  auto rest = r->Prefill(2, all.subspan(kCached), true, {});
  ASSERT_TRUE(rest.ok()) << rest.status();
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((b.cpu() - a.cpu()).norm() / a.cpu().norm()).item<double>();
  };
  EXPECT_LT(rel(*whole, *rest), 1e-2);
  int32_t next = static_cast<int32_t>(whole->argmax().item<int64_t>());
  for (int step = 0; step < 8; ++step) {
    auto out = r->Decode(std::vector<SequenceId>{1, 2}, std::vector<int32_t>{next, next});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LT(rel((*out)[0], (*out)[1]), 1e-2) << "step " << step;
    next = static_cast<int32_t>((*out)[0].argmax().item<int64_t>());
  }
  r->Release(1);
  EXPECT_EQ(r->pool().ref_count(blocks[0][0]), 1);  // seq 2 still holds the prefix
  r->Release(2);
  EXPECT_EQ(r->pool().num_free_blocks() + r->num_reserved_blocks(), r->pool().num_blocks());
}

TEST(CudaGraphDecodeTest, DefaultKvPoolIsFreeMemoryLessTheReserve) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto before = CudaMemoryInfo(0);
  ASSERT_TRUE(before.ok()) << before.status();
  const auto [free_bytes, total_bytes] = *before;
  ASSERT_GT(free_bytes, int64_t{2} << 30);
  ASSERT_GE(total_bytes, free_bytes);
  RunnerOptions o;
  o.model_dir = TinyLlamaDir();
  o.device = "cuda";
  o.random_weights = true;
  // Leave all but 1 GiB free: the pool must come out a little under 1 GiB (the weights are
  // ~3 MiB; the scratch block and rounding take a block each).
  o.kv_reserve_bytes = free_bytes - (int64_t{1} << 30);
  auto runner = ModelRunner::Create(o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const auto& pool = (*runner)->pool();
  const int64_t block_bytes = int64_t{2} * 16 * 2 * 64 * 2;  // K+V, 16 slots, 2 heads, bf16
  const int64_t pool_bytes = pool.num_blocks() * block_bytes;
  EXPECT_LE(pool_bytes, int64_t{1} << 30);
  EXPECT_GT(pool_bytes, int64_t{900} << 20);
  // A reserve larger than what is free is a clear error, not an empty pool.
  o.kv_reserve_bytes = total_bytes * 2;
  auto refused = ModelRunner::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("reserve"), std::string::npos);
}

TEST(CudaGraphDecodeTest, CpuBuildsAnswerUnimplemented) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA present";
  auto info = CudaMemoryInfo(0);
  // A CUDA build without a device fails in cudaMemGetInfo; a CPU-only build says UNIMPLEMENTED.
  EXPECT_FALSE(info.ok());
}

}  // namespace
}  // namespace dropkv
