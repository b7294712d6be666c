// The two trained models scripts/setup.sh installs (SmolLM2-135M-Instruct, Gemma-3-270M) against
// HF transformers in fp32 on the CPU (fixture real_models_reference.py): the logits of the prompt's
// last position and of three teacher-forced decode steps, the greedy continuation (64 tokens, fed
// back by the runner itself), the tokenizer's ids, chunked prefill equal to one pass, and Gemma 3's
// sliding-window layers holding only their window.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "allocator/block_pool.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

fs::path RefDir() {
  return testing::BuildDir() / "test-scratch" / "real_models";
}

struct Reference {
  json meta;
  at::Tensor logits;  // fp32 [rows, vocab]
  std::vector<int32_t> prompt() const { return meta["prompt"].get<std::vector<int32_t>>(); }
  std::vector<int32_t> greedy() const { return meta["greedy"].get<std::vector<int32_t>>(); }
};

Reference LoadReference(const std::string& name) {
  Reference r;
  std::ifstream in(RefDir() / (name + ".json"));
  EXPECT_TRUE(in.good()) << "missing fixture output; run ctest (fixture real_models_ref)";
  r.meta = json::parse(in);
  const int64_t rows = r.meta["num_logit_rows"], vocab = r.meta["vocab_size"];
  r.logits = at::empty({rows, vocab}, at::kFloat);
  std::ifstream bin(RefDir() / (name + ".logits.f32"), std::ios::binary);
  bin.read(reinterpret_cast<char*>(r.logits.data_ptr<float>()), rows * vocab * 4);
  EXPECT_TRUE(bin.good());
  return r;
}

std::string ModelFolder(const std::string& name) {
  return (testing::ModelsDir() / name).string();
}

std::unique_ptr<ModelRunner> MakeRunner(const std::string& folder) {
  RunnerOptions o;
  o.model_dir = folder;
  o.dtype = "float32";
  o.block_size = 16;
  o.num_kv_blocks = 2048;
  auto runner = ModelRunner::Create(o);
  EXPECT_TRUE(runner.ok()) << runner.status();
  return std::move(*runner);
}

at::Tensor PrefillChunked(ModelRunner& runner, SequenceId seq, const std::vector<int32_t>& prompt,
                          size_t chunk) {
  at::Tensor logits;
  for (size_t begin = 0; begin < prompt.size(); begin += chunk) {
    const size_t end = std::min(prompt.size(), begin + chunk);
    auto out = runner.Prefill(seq, std::span(prompt).subspan(begin, end - begin),
                              end == prompt.size(), {});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    logits = *out;
  }
  return logits;
}

int32_t Argmax(const at::Tensor& row) {
  return static_cast<int32_t>(row.argmax().item<int64_t>());
}

at::Tensor DecodeOne(ModelRunner& runner, SequenceId seq, int32_t token) {
  auto out = runner.Decode(std::span(&seq, 1), std::span(&token, 1));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? (*out)[0] : at::Tensor();
}

// The tiny parity models' tolerance holds on the real ones too: fp32 logits differ from HF's only
// by summation order through 18-30 layers (measured: at most 4.8e-5, on logits of ~20).
constexpr double kLogitTolerance = 1e-4;

struct Case {
  const char* ref;
  const char* model;
};

class RealModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(RealModelTest, LogitsAndGreedyContinuationMatchHf) {
  const Reference ref = LoadReference(GetParam().ref);
  auto runner = MakeRunner(ModelFolder(GetParam().model));
  const SequenceId seq = 1;
  at::Tensor logits = PrefillChunked(*runner, seq, ref.prompt(), ref.prompt().size());
  ASSERT_TRUE(logits.defined());
  const auto greedy = ref.greedy();
  std::vector<int32_t> ours;
  for (size_t step = 0; step < greedy.size(); ++step) {
    if (step < static_cast<size_t>(ref.logits.size(0))) {
      const double diff = (logits - ref.logits[step]).abs().max().item<double>();
      EXPECT_LT(diff, kLogitTolerance) << GetParam().ref << " step " << step;
    }
    ours.push_back(Argmax(logits));
    if (step + 1 < greedy.size()) logits = DecodeOne(*runner, seq, ours.back());
  }
  EXPECT_EQ(ours, greedy) << GetParam().ref;
  runner->Release(seq);
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

TEST_P(RealModelTest, TokenizerMatchesHf) {
  const Reference ref = LoadReference(GetParam().ref);
  auto tok = Tokenizer::FromDirectory(ModelFolder(GetParam().model));
  ASSERT_TRUE(tok.ok()) << tok.status();
  for (const auto& [text, ids] : ref.meta["encodings"].items()) {
    auto got = (*tok)->Encode(text);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, ids.get<std::vector<int32_t>>()) << text;
  }
  auto text = (*tok)->Decode(ref.greedy());
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, ref.meta["text"].get<std::string>());
}

INSTANTIATE_TEST_SUITE_P(Models, RealModelTest,
                         ::testing::Values(Case{"smollm2_chat", "smollm2-135m-instruct"},
                                           Case{"smollm2_text", "smollm2-135m-instruct"},
                                           Case{"gemma3_text", "gemma-3-270m"},
                                           Case{"gemma3_long", "gemma-3-270m"}),
                         [](const auto& info) { return std::string(info.param.ref); });

// The raw prompts of the text cases are what our tokenizer makes of their text.
TEST(RealModelTokenizerTest, PromptIdsMatchHf) {
  auto tok = Tokenizer::FromDirectory(ModelFolder("smollm2-135m-instruct"));
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(*(*tok)->Encode("The capital of France is"), LoadReference("smollm2_text").prompt());
  auto gemma = Tokenizer::FromDirectory(ModelFolder("gemma-3-270m"));
  ASSERT_TRUE(gemma.ok());
  EXPECT_EQ(*(*gemma)->Encode("The capital of France is"), LoadReference("gemma3_text").prompt());
  EXPECT_EQ((*gemma)->eos_token_ids(), (std::vector<int32_t>{1, 106}));
  EXPECT_EQ((*tok)->eos_token_ids(), (std::vector<int32_t>{2}));
}

// Chunks that cut through the prompt (and, for Gemma 3, through its 512-token window several
// times) give the logits and tokens of one pass.
TEST(RealModelChunkingTest, ChunkedPrefillEqualsOnePass) {
  for (const Case& c : {Case{"smollm2_chat", "smollm2-135m-instruct"},
                        Case{"gemma3_long", "gemma-3-270m"}}) {
    const Reference ref = LoadReference(c.ref);
    auto runner = MakeRunner(ModelFolder(c.model));
    const auto prompt = ref.prompt();
    at::Tensor whole = PrefillChunked(*runner, 1, prompt, prompt.size());
    at::Tensor chunked = PrefillChunked(*runner, 2, prompt, c.ref[0] == 's' ? 7 : 300);
    EXPECT_LT((whole - chunked).abs().max().item<double>(), 1e-4) << c.ref;
    int32_t a = Argmax(whole), b = Argmax(chunked);
    for (int step = 0; step < 8; ++step) {
      ASSERT_EQ(a, b) << c.ref << " step " << step;
      at::Tensor la = DecodeOne(*runner, 1, a), lb = DecodeOne(*runner, 2, b);
      EXPECT_LT((la - lb).abs().max().item<double>(), 1e-4) << c.ref << " step " << step;
      a = Argmax(la);
      b = Argmax(lb);
    }
  }
}

// A 1,945-token prompt: each sliding layer holds its 512-token window (32 blocks of 16), the
// global layers the whole prompt; decode keeps the rings at their size; Release frees everything.
TEST(RealModelChunkingTest, Gemma3SlidingLayersHoldOnlyTheirWindow) {
  const Reference ref = LoadReference("gemma3_long");
  auto runner = MakeRunner(ModelFolder("gemma-3-270m"));
  const ModelConfig& c = runner->config();
  ASSERT_EQ(c.sliding_window, 512);
  ASSERT_EQ(c.num_global_layers(), 3);
  const auto prompt = ref.prompt();
  const int64_t n = static_cast<int64_t>(prompt.size());
  ASSERT_GT(n, 3 * c.sliding_window);
  at::Tensor logits = PrefillChunked(*runner, 5, prompt, 700);
  const int64_t bs = runner->pool().block_size();
  auto check = [&](int64_t len) {
    const SequenceCacheInfo info = runner->CacheInfo(5);
    int64_t blocks = 0;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const int64_t want = c.is_sliding(l) ? c.sliding_window : len;
      EXPECT_EQ(info.stored_len_per_layer[l], want) << "layer " << l;
      blocks += (want + bs - 1) / bs;
    }
    EXPECT_EQ(info.num_blocks, blocks);
    EXPECT_EQ(runner->pool().num_used_blocks(), blocks);
  };
  check(n);
  // The pool holds 15 x 32 + 3 x 122 blocks where a full cache would take 18 x 122.
  EXPECT_LT(runner->pool().num_used_blocks(), 18 * ((n + bs - 1) / bs) / 2);
  for (int step = 0; step < 20; ++step) logits = DecodeOne(*runner, 5, Argmax(logits));
  check(n + 20);
  runner->Release(5);
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

}  // namespace
}  // namespace dropkv
