// stories260K through our converter and runner: greedy 256 tokens from BOS print exactly what
// llama2.c's run.c printed (../shared/models/stories260K/reference-greedy-256.txt).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "engine/common/file_util.h"
#include "engine/model/llama2c.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

TEST(StoriesGoldenTest, Greedy256FromBosMatchesRunC) {
  const auto src = testing::SharedDir() / "models" / "stories260K";
  const auto out = testing::ScratchDir("stories260K");
  ASSERT_TRUE(ConvertLlama2c((src / "stories260K.bin").string(), (src / "tok512.bin").string(),
                             out.string())
                  .ok());
  RunnerOptions o;
  o.model_dir = out.string();
  o.num_kv_blocks = 5 * 17;  // exactly 256 slots x 5 layers at block_size 16
  auto runner = ModelRunner::Create(o);
  ASSERT_TRUE(runner.ok()) << runner.status();
  auto tokenizer = Tokenizer::FromDirectory(out.string());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  // run.c: token = BOS at pos 0; 256 forwards; stops early only when BOS is sampled.
  const SequenceId seq = 1;
  int32_t token = 1;
  auto logits = (*runner)->Prefill(seq, std::span(&token, 1), true, {});
  ASSERT_TRUE(logits.ok()) << logits.status();
  std::vector<int32_t> ids;
  IncrementalDecoder decoder(**tokenizer);
  std::string streamed;
  for (int pos = 0; pos < 256; ++pos) {
    token = static_cast<int32_t>(logits->argmax(-1).reshape({-1})[0].item<int64_t>());
    if (token == 1) break;
    ids.push_back(token);
    streamed += decoder.Push(token);
    if (pos == 255) break;
    logits = (*runner)->Decode(std::span(&seq, 1), std::span(&token, 1));
    ASSERT_TRUE(logits.ok()) << logits.status();
  }
  streamed += decoder.Flush();
  auto text = (*tokenizer)->Decode(ids);
  ASSERT_TRUE(text.ok());
  auto want = ReadFileToString((src / "reference-greedy-256.txt").string());
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(*text + "\n", *want);  // run.c ends with printf("\n")
  EXPECT_EQ(streamed + "\n", *want);
}

}  // namespace
}  // namespace dropkv
