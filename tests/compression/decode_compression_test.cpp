// Compression during decode (CompressionParams::decode_margin) on the real runner and a trained
// model (SmolLM2-135M-Instruct, fp32 on the CPU):
// - every layer stays within its budget for the tokens seen plus the margin at every step, and an
//   eviction brings each layer back to its budget;
// - an eviction equals its definition run directly on a bare runner: the same tokens decoded one
//   at a time without it, the last W of them fed instead as one prefill chunk whose press (the
//   request's, at the same length) keeps each layer's budget with those W queries: the same
//   entries kept, the same next logits;
// - the blocks an eviction frees go back to the pool, and releasing the sequence frees them all.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <string>

#include "allocator/block_pool.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

class DecodeCompressionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(testing::SmolLm2Dir() / "config.json"))
      GTEST_SKIP() << "no " << testing::SmolLm2Dir().string() << " (scripts/setup.sh converts it)";
    auto tok = Tokenizer::FromDirectory(testing::SmolLm2Dir().string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::string text;
    for (int i = 0; i < 4; ++i) {
      text +=
          "The lighthouse keeper counted the ships every evening and wrote their names in a "
          "green book. ";
    }
    text += "One night a ship with black sails came, and the keeper wrote";
    prompt_ = *(*tok)->Encode(text);
    params_.method = ScoreMethod::kDropKV;
    params_.keep_ratio = 0.25;
    params_.window = 8;
    params_.decode_margin = 12;
  }

  static std::unique_ptr<ModelRunner> MakeRunner(const std::string& kv_cache_dtype = "auto") {
    RunnerOptions ro;
    ro.model_dir = testing::SmolLm2Dir().string();
    ro.device = "cpu";
    ro.dtype = "float32";
    ro.kv_cache_dtype = kv_cache_dtype;
    ro.num_kv_blocks = 2048;
    ro.block_size = 16;
    auto runner = ModelRunner::Create(ro);
    EXPECT_TRUE(runner.ok()) << runner.status();
    (*runner)->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
    return std::move(*runner);
  }

  static std::vector<int64_t> Stored(const ModelRunner& r, SequenceId seq) {
    return r.CacheInfo(seq).stored_len_per_layer;
  }

  std::vector<int32_t> prompt_;
  CompressionParams params_;
};

TEST_F(DecodeCompressionTest, LayersStayWithinBudgetAndAnEvictionEqualsItsDefinition) {
  auto runner = MakeRunner();
  ModelRunner& r = *runner;
  const int32_t num_layers = r.config().num_layers;
  const int64_t p = static_cast<int64_t>(prompt_.size());
  auto logits = r.Prefill(1, prompt_, true, params_);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const std::vector<SequenceId> seq = {1};

  std::vector<int32_t> fed;     // decode tokens, in order
  int64_t first_eviction = -1;  // decode steps done when the first eviction ran
  int num_evictions = 0;
  at::Tensor after_eviction;     // the logits of the step after it
  std::vector<at::Tensor> kept;  // positions each layer holds after it
  at::Tensor step_logits = *logits;
  for (int step = 1; step <= 40; ++step) {
    fed.push_back(static_cast<int32_t>(step_logits.argmax().item<int64_t>()));
    const std::vector<int64_t> before = Stored(r, 1);
    auto out = r.Decode(seq, std::vector<int32_t>{fed.back()});
    ASSERT_TRUE(out.ok()) << out.status();
    step_logits = (*out)[0];
    const int64_t n = p + step;
    auto budgets = compression::KeptTokensPerLayer(params_, num_layers, n);
    ASSERT_TRUE(budgets.ok());
    const std::vector<int64_t> stored = Stored(r, 1);
    const bool evicted = stored[0] < before[0] + 1;
    num_evictions += evicted;
    for (int32_t l = 0; l < num_layers; ++l) {
      ASSERT_LE(stored[l], (*budgets)[l] + params_.decode_margin)
          << "layer " << l << " step " << step;
      if (evicted) EXPECT_EQ(stored[l], (*budgets)[l]) << "layer " << l << " step " << step;
    }
    if (evicted && first_eviction < 0) {
      first_eviction = step;
      for (int32_t l = 0; l < num_layers; ++l) kept.push_back(*r.StoredPositions(1, l));
    } else if (first_eviction > 0 && !after_eviction.defined()) {
      after_eviction = step_logits;
    }
  }
  ASSERT_GT(first_eviction, params_.window) << "no eviction in 40 steps";
  EXPECT_GE(num_evictions, 2);
  EXPECT_GT(r.CacheInfo(1).decode_evicted_entries, 0);
  EXPECT_GT(r.decode_compression_stats().num_evictions, 0);

  // The definition on a bare runner (prefill compression alone).
  auto bare = MakeRunner();
  CompressionParams prefill_only = params_;
  prefill_only.decode_margin = 0;
  ASSERT_TRUE(bare->Prefill(1, prompt_, true, prefill_only).ok());
  const int64_t w = params_.window;
  for (int64_t i = 0; i + w < first_eviction; ++i)
    ASSERT_TRUE(bare->Decode(seq, std::vector<int32_t>{fed[i]}).ok());
  auto press = compression::CreateKvSelectorForModel(prefill_only, bare->config());
  ASSERT_TRUE(press.ok());
  const std::vector<int32_t> last_w(fed.begin() + (first_eviction - w),
                                    fed.begin() + first_eviction);
  ASSERT_TRUE(bare->PrefillWithSelector(1, last_w, true, press->get()).ok());
  for (int32_t l = 0; l < num_layers; ++l) {
    EXPECT_TRUE(at::equal(*bare->StoredPositions(1, l), kept[l])) << "layer " << l;
  }
  auto next = bare->Decode(seq, std::vector<int32_t>{fed[first_eviction]});
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(at::allclose((*next)[0], after_eviction, 1e-4, 1e-3))
      << "max diff " << ((*next)[0] - after_eviction).abs().max().item<float>();

  r.Release(1);
  bare->Release(1);
  EXPECT_EQ(r.pool().num_free_blocks(), r.pool().num_blocks());
}

// Over an FP8 (e4m3) KV cache: the evictions keep every layer within its budget + margin, and a
// fork (ModelRunner::ForkSequence, the kept-conversation copy) holds the same bytes: both sides
// give the same next logits.
TEST_F(DecodeCompressionTest, Fp8CacheEvictsAndForks) {
  auto runner = MakeRunner("fp8");
  ModelRunner& r = *runner;
  auto logits = r.Prefill(1, prompt_, true, params_);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const std::vector<SequenceId> seq = {1};
  int32_t next = static_cast<int32_t>(logits->argmax().item<int64_t>());
  for (int step = 1; step <= 24; ++step) {
    auto out = r.Decode(seq, std::vector<int32_t>{next});
    ASSERT_TRUE(out.ok()) << out.status();
    next = static_cast<int32_t>((*out)[0].argmax().item<int64_t>());
    const SequenceCacheInfo info = r.CacheInfo(1);
    auto budgets =
        compression::KeptTokensPerLayer(params_, r.config().num_layers, info.logical_len);
    for (size_t l = 0; l < info.stored_len_per_layer.size(); ++l)
      ASSERT_LE(info.stored_len_per_layer[l], (*budgets)[l] + params_.decode_margin);
  }
  EXPECT_GT(r.decode_compression_stats().num_evictions, 0);
  ASSERT_TRUE(r.ForkSequence(1, 2).ok());
  auto both = r.Decode(std::vector<SequenceId>{1, 2}, std::vector<int32_t>{next, next});
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE(at::allclose((*both)[0], (*both)[1], 1e-5, 1e-4));
  r.Release(1);
  r.Release(2);
  EXPECT_EQ(r.pool().num_free_blocks(), r.pool().num_blocks());
}

// Without decode_margin nothing changes during decode: the layers grow by one a step.
TEST_F(DecodeCompressionTest, OffByDefault) {
  auto runner = MakeRunner();
  params_.decode_margin = 0;
  auto logits = runner->Prefill(1, prompt_, true, params_);
  ASSERT_TRUE(logits.ok());
  const std::vector<int64_t> start = Stored(*runner, 1);
  const std::vector<SequenceId> seq = {1};
  for (int step = 1; step <= 20; ++step) {
    ASSERT_TRUE(runner->Decode(seq, std::vector<int32_t>{13}).ok());
  }
  const std::vector<int64_t> end = Stored(*runner, 1);
  for (size_t l = 0; l < end.size(); ++l) EXPECT_EQ(end[l], start[l] + 20);
  EXPECT_EQ(runner->decode_compression_stats().num_evictions, 0);
}

}  // namespace
}  // namespace dropkv
