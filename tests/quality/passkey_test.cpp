// DropKV at keep 10% on SmolLM2-135M-Instruct must keep answering the pass keys the full cache
// answers. 10 fixed prompts of bench/quality/tasks.py (niah_number, 2048
// tokens, raw format, seed 0: prompts 0-9 of docs/quality.md's SmolLM2 table), greedy, scored by
// the answer string. The share thresholds are docs/quality.md's measured shares on these 10
// prompts minus a stated margin; the same prefill also gates DropKV under the DepthKV MGA
// allocator with config/profiles/smollm2-135m-instruct.json. Also checks the harness's one-prefill
// fan-out against a real compressed prefill (same kept positions in every layer, same greedy
// output), also with FP8 weights and an FP8 KV pool (the fork copies the pool's bytes).
// Skips when scripts/setup.sh's models are not installed.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench/quality/fanout.h"
#include "bench/quality/task_eval.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;

constexpr int kNumPrompts = 10;
// On prompts 0-9 (docs/quality.md, SmolLM2 niah_number 2K raw) the full cache answers 10 of 10
// and DropKV at keep 10% with the default pooling lookback 32 answers all 10 of those (measured
// here, fp32; without the lookback it answered 7, 0.74 +- 0.09 over the table's 23 prompts).
// The gates are those minus a margin: 1 prompt for the full cache, 2 prompts (0.20) for the
// share, so a prompt or two flipping on numerics does not fail it while a broken scorer does,
// and so does losing the lookback (0.70; on these prompts K-norm answers 0 of 10 at keep 10%,
// StreamingLLM 1).
constexpr int kMinFullAnswered = 9;
constexpr double kMinShare = 0.8;
// DepthKV: DropKV at keep 10% with the MGA allocator and SmolLM2's InfoNCE profile answers the
// same 10 of 10 here. Same margin (0.20); MLP (0.35 over the 23 prompts without the lookback)
// would fail it, and so would a profile that does not load.
constexpr double kMinMgaShare = 0.8;

// tasks.py's prompts, generated once per build tree with the reference venv's tokenizer.
fs::path Prompts() {
  const fs::path out = testing::ScratchDir("quality_passkey") /
                       ("niah_number_2048_raw_" + std::to_string(kNumPrompts) + ".jsonl");
  if (!fs::exists(out)) {
    const std::string cmd = testing::ReferencePython() + " " +
                            (testing::SourceDir() / "bench" / "quality" / "tasks.py").string() +
                            " --model " + testing::SmolLm2Dir().string() +
                            " --lengths 2048 --num " + std::to_string(kNumPrompts) +
                            " --tasks niah_number --format raw --seed 0 --out " + out.string() +
                            ".tmp && mv " + out.string() + ".tmp " + out.string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  return out;
}

std::unique_ptr<ModelRunner> MakeRunner(int64_t blocks, const std::string& quantization = "none",
                                        const std::string& kv_cache_dtype = "auto") {
  RunnerOptions o;
  o.model_dir = testing::SmolLm2Dir().string();
  o.dtype = "float32";
  o.num_kv_blocks = blocks;
  o.quantization = quantization;
  o.kv_cache_dtype = kv_cache_dtype;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

CompressionParams DropKv(double keep) {
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = keep;
  return p;
}

CompressionParams DropKvMga(double keep) {
  CompressionParams p = DropKv(keep);
  p.allocator = BudgetAllocator::kMGA;
  p.profile_path =
      (testing::SourceDir() / "config" / "profiles" / "smollm2-135m-instruct.json").string();
  return p;
}

class PassKeyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(testing::SmolLm2Dir() / "config.json")) {
      GTEST_SKIP() << "no " << testing::SmolLm2Dir() << " (scripts/setup.sh converts it)";
    }
    auto prompts = quality::LoadTaskPrompts(Prompts().string());
    ASSERT_TRUE(prompts.ok()) << prompts.status();
    prompts_ = std::move(*prompts);
    ASSERT_EQ(prompts_.size(), static_cast<size_t>(kNumPrompts));
  }
  std::vector<quality::TaskPrompt> prompts_;
};

// The harness's fan-out (full prefill with the press watching, fork, compaction) against the
// engine's own compressed prefill of the same prompt, on a runner built with these numerics.
void ExpectFanOutEqualsACompressedPrefill(const std::vector<int32_t>& prompt,
                                          const std::string& quantization,
                                          const std::string& kv_cache_dtype) {
  auto runner = MakeRunner(8192, quantization, kv_cache_dtype);
  ASSERT_NE(runner, nullptr);
  runner->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
  const CompressionParams params = DropKv(0.1);
  const int32_t steps = 8;

  // The engine's own compressed prefill, then greedy decode.
  auto greedy = [&](SequenceId seq, int32_t first) {
    std::vector<int32_t> out{first};
    for (int32_t s = 1; s < steps; ++s) {
      auto l = runner->Decode(std::vector<SequenceId>{seq}, std::vector<int32_t>{out.back()});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      out.push_back(static_cast<int32_t>(l->argmax(-1)[0].item<int64_t>()));
    }
    return out;
  };
  auto logits = runner->Prefill(1, prompt, true, params);
  ASSERT_TRUE(logits.ok()) << logits.status();
  const int32_t first = static_cast<int32_t>(logits->argmax().item<int64_t>());

  // The harness: a full prefill with the press watching, a fork, a compaction.
  std::vector<std::unique_ptr<KvSelector>> presses;
  auto press = compression::CreateKvSelectorForModel(params, runner->config());
  ASSERT_TRUE(press.ok()) << press.status();
  presses.push_back(std::move(*press));
  quality::FanOutSelector fan_out(std::move(presses),
                                  compression::PressModelInfoFor(runner->config()).num_layers);
  auto full_logits = runner->PrefillWithSelector(2, prompt, true, &fan_out);
  ASSERT_TRUE(full_logits.ok()) << full_logits.status();
  EXPECT_TRUE(at::equal(*logits, *full_logits));
  ASSERT_TRUE(quality::ForkSequence(*runner, 2, 3).ok());
  ASSERT_TRUE(quality::CompactToSelection(*runner, 3, fan_out, 0).ok());
  runner->Release(2);

  for (int32_t l = 0; l < runner->config().num_layers; ++l) {
    auto a = runner->StoredPositions(1, l), b = runner->StoredPositions(3, l);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(at::equal(*a, *b)) << "layer " << l;
  }
  EXPECT_EQ(greedy(1, first), greedy(3, first));
}

TEST_F(PassKeyTest, FanOutEqualsACompressedPrefill) {
  // The first 512 tokens of prompt 0 (a quarter of the cost; the equivalence does not depend on
  // the length).
  const std::vector<int32_t> prompt(prompts_[0].input_ids.begin(),
                                    prompts_[0].input_ids.begin() + 512);
  ExpectFanOutEqualsACompressedPrefill(prompt, "none", "auto");
}

TEST_F(PassKeyTest, FanOutEqualsACompressedPrefillWithFp8WeightsAndKv) {
  // dropkv-quality-tasks --quantization fp8 --kv-cache-dtype fp8 (docs/quality.md): the
  // fork moves the e4m3 pool as bytes, the compaction rewrites kept entries in e4m3.
  const std::vector<int32_t> prompt(prompts_[0].input_ids.begin(),
                                    prompts_[0].input_ids.begin() + 512);
  ExpectFanOutEqualsACompressedPrefill(prompt, "fp8", "fp8");
}

TEST_F(PassKeyTest, DropKvAtTenPercentAnswersWhatTheFullCacheAnswers) {
  const std::vector<CompressionParams> configs = {CompressionParams{}, DropKv(0.1), DropKvMga(0.1)};
  int64_t max_len = 0;
  for (const auto& p : prompts_) max_len = std::max<int64_t>(max_len, p.input_ids.size());
  auto probe = MakeRunner(16);
  ASSERT_NE(probe, nullptr);
  const int64_t blocks = quality::BlocksNeeded(*probe, max_len, configs, 16) + 64;
  probe.reset();
  auto runner = MakeRunner(blocks);
  ASSERT_NE(runner, nullptr);
  auto tokenizer = Tokenizer::FromDirectory(testing::SmolLm2Dir().string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  int full_answered = 0, both = 0, both_mga = 0;
  const char* names[] = {"full      ", "dropkv    ", "dropkv mga"};
  for (const auto& p : prompts_) {
    auto gen = quality::GreedyUnderEveryPress(*runner, p.input_ids, configs, p.max_new_tokens);
    ASSERT_TRUE(gen.ok()) << gen.status();
    double score[3];
    for (int c = 0; c < 3; ++c) {
      auto text =
          (*tokenizer)->Decode(quality::CutAtEos((*gen)[c], runner->config().eos_token_ids), true);
      ASSERT_TRUE(text.ok());
      score[c] = quality::AnswerScore(*text, p.answers, p.match);
      std::printf("prompt %lld %s: %s\n", static_cast<long long>(p.idx), names[c], text->c_str());
    }
    full_answered += score[0] == 1.0;
    both += score[0] == 1.0 && score[1] == 1.0;
    both_mga += score[0] == 1.0 && score[2] == 1.0;
  }
  auto share_of = [&](int n) {
    return full_answered > 0 ? static_cast<double>(n) / full_answered : 0.0;
  };
  const double share = share_of(both), share_mga = share_of(both_mga);
  std::printf(
      "full cache: %d/%d; DropKV keep 0.1 answers %d of those (share %.2f, gate %.2f); "
      "with MGA %d (share %.2f, gate %.2f)\n",
      full_answered, kNumPrompts, both, share, kMinShare, both_mga, share_mga, kMinMgaShare);
  EXPECT_GE(full_answered, kMinFullAnswered);
  EXPECT_GE(share, kMinShare);
  EXPECT_GE(share_mga, kMinMgaShare);
}

}  // namespace
}  // namespace dropkv
