// Compression during decode on CUDA (bf16, random weights): the decode steps that keep their
// queries run as CUDA graphs (the ring rows are written inside the graph) and give what eager
// steps give: the same logits within bf16 tolerance, the same evictions (every layer within its
// budget + margin, at the same steps) and nearly the same kept entries; more sequences than the
// ring first holds make it grow under captured graphs. Label gpu: skipped without a CUDA device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <vector>

#include "allocator/block_pool.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

std::unique_ptr<ModelRunner> MakeRunner(bool graphs) {
  RunnerOptions o;
  o.model_dir = testing::WriteTinyLlamaConfig("decode_compression_gpu", {});
  o.device = "cuda";
  o.dtype = "bfloat16";
  o.random_weights = true;
  o.random_seed = 11;
  o.block_size = 16;
  o.num_kv_blocks = 2048;
  o.cuda_graphs = graphs;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  (*r)->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
  return std::move(*r);
}

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(3 + (i * 131 + salt * 17) % 500);
  return t;
}

TEST(DecodeCompressionGpuTest, GraphStepsEqualEagerSteps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  auto eager = MakeRunner(false);
  auto graphed = MakeRunner(true);
  ASSERT_TRUE(eager && graphed);
  CompressionParams c;
  c.method = ScoreMethod::kDropKV;
  c.keep_ratio = 0.2;
  c.window = 8;
  c.decode_margin = 16;
  // Six sequences, one without; 4-6 start after the first phase's graphs were captured, so the
  // ring grows (from 36 rows to 72) under them: every graph then writing the old ring is dropped,
  // and with it the graphs' memory pool.
  const std::map<SequenceId, int> prompt_len = {{1, 300}, {2, 120}, {3, 64},
                                                {4, 200}, {5, 90},  {6, 150}};
  std::map<SequenceId, int32_t> next;
  auto prefill = [&](SequenceId seq) {
    CompressionParams cs = c;
    if (seq == 6) cs.decode_margin = 0;
    const std::vector<int32_t> prompt = Prompt(prompt_len.at(seq), static_cast<int>(seq));
    auto a = eager->Prefill(seq, prompt, true, cs);
    auto b = graphed->Prefill(seq, prompt, true, cs);
    ASSERT_TRUE(a.ok() && b.ok());
    next[seq] = static_cast<int32_t>(a->argmax().item<int64_t>());
  };
  for (SequenceId seq : {1, 2, 3}) prefill(seq);
  const int32_t num_layers = eager->config().num_layers;
  const std::vector<std::vector<SequenceId>> phases = {{1, 2, 3}, {1, 2, 3, 4, 5, 6}, {2, 5}};
  double worst = 0;
  for (const auto& batch : phases) {
    if (batch.size() == 6) {
      for (SequenceId seq : {4, 5, 6}) prefill(seq);
    }
    for (int step = 0; step < 40; ++step) {
      std::vector<int32_t> tokens;
      for (SequenceId s : batch) tokens.push_back(next[s]);
      auto a = eager->Decode(batch, tokens);
      auto b = graphed->Decode(batch, tokens);
      ASSERT_TRUE(a.ok() && b.ok());
      ASSERT_GT(graphed->last_decode_host_times().launch_us, 0) << "the step ran without a graph";
      for (size_t i = 0; i < batch.size(); ++i) {
        const at::Tensor ra = (*a)[i].cpu(), rb = (*b)[i].cpu();
        worst = std::max(worst, ((rb - ra).norm() / ra.norm()).item<double>());
        next[batch[i]] = static_cast<int32_t>(ra.argmax().item<int64_t>());
        const SequenceCacheInfo ia = eager->CacheInfo(batch[i]);
        const SequenceCacheInfo ib = graphed->CacheInfo(batch[i]);
        ASSERT_EQ(ia.stored_len_per_layer, ib.stored_len_per_layer) << "seq " << batch[i];
        if (batch[i] == 6) continue;
        auto budgets = compression::KeptTokensPerLayer(c, num_layers, ia.logical_len);
        ASSERT_TRUE(budgets.ok());
        for (int32_t l = 0; l < num_layers; ++l)
          ASSERT_LE(ia.stored_len_per_layer[l], (*budgets)[l] + c.decode_margin);
      }
    }
  }
  EXPECT_LT(worst, 2e-2);
  EXPECT_GT(graphed->decode_compression_stats().num_evictions, 0);
  EXPECT_EQ(graphed->decode_compression_stats().num_evictions,
            eager->decode_compression_stats().num_evictions);
  // Kept entries: the same up to bf16 near-ties.
  int64_t same = 0, total = 0;
  for (const auto& [seq, n] : prompt_len) {
    for (int32_t l = 0; l < num_layers; ++l) {
      const at::Tensor pa = eager->StoredPositions(seq, l)->cpu();
      const at::Tensor pb = graphed->StoredPositions(seq, l)->cpu();
      same += pa.eq(pb).sum().item<int64_t>();
      total += pa.numel();
    }
  }
  EXPECT_GE(static_cast<double>(same) / static_cast<double>(total), 0.95);
  for (const auto& [seq, n] : prompt_len) {
    eager->Release(seq);
    graphed->Release(seq);
  }
  EXPECT_EQ(graphed->pool().num_free_blocks() + graphed->num_reserved_blocks(),
            graphed->pool().num_blocks());
}

}  // namespace
}  // namespace dropkv
