// The scheduler on the real runner and a trained model (SmolLM2-135M-Instruct as set-up converts
// it, fp32 on the CPU): requests that run together, with their prefill chunks in the same
// forwards as each other's decode rows, produce the tokens each produces alone. Compressed
// (DropKV at 25%, also compressing during decode; SnapKV under every_chunk with its own chunk
// size) and uncompressed prompts,
// chunked by the step budget and whole; once with room for all, once in a pool small enough to
// preempt with a request cancelled midway. The pool is all free after each run. With the prefix
// cache, later turns and shared prefixes produce the tokens a cache-less server produces.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "allocator/block_pool.h"
#include "engine/compression/plan.h"
#include "engine/compression/press.h"
#include "engine/runner/model_runner.h"
#include "engine/scheduler/scheduler.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

constexpr int kNewTokens = 17;  // more than a 16-token block: every sequence grows by one
constexpr int kCancelled = 2;   // the request the last run cancels midway

struct Case {
  std::string text;
  CompressionParams compression;
};

std::vector<Case> Cases() {
  const std::string story =
      "The lighthouse keeper counted the ships every evening and wrote their names in a green "
      "book. ";
  std::vector<Case> cases;
  auto add = [&](int repeats, std::string tail, CompressionParams c) {
    std::string text;
    for (int i = 0; i < repeats; ++i) text += story;
    cases.push_back({text + tail, c});
  };
  CompressionParams dropkv;
  dropkv.method = ScoreMethod::kDropKV;
  dropkv.keep_ratio = 0.25;
  CompressionParams snap_every;
  snap_every.method = ScoreMethod::kSnapKV;
  snap_every.keep_ratio = 0.5;
  snap_every.chunk_size = 48;
  snap_every.chunk_policy = ChunkPolicy::kEveryChunk;
  CompressionParams dropkv_decode = dropkv;  // evicts again after ~11 decode steps
  dropkv_decode.decode_margin = 8;
  add(1, "The capital of France is", {});
  add(6, "In the green book, the keeper wrote", {});        // chunked by the step
  add(6, "Every evening the keeper", dropkv);               // split under last_chunk
  add(2, "What did the keeper count? He counted", dropkv);  // one pass
  add(5, "The book was", snap_every);                       // its own chunks
  add(3, "Write a short poem about the sea:\n", {});
  add(2, "The ships that came at night were", dropkv_decode);
  return cases;
}

class MixedStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(testing::SmolLm2Dir() / "config.json"))
      GTEST_SKIP() << "no " << testing::SmolLm2Dir().string() << " (scripts/setup.sh converts it)";
    auto tok = Tokenizer::FromDirectory(testing::SmolLm2Dir().string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = std::move(*tok);
  }

  // Runs `cases` (all, or only `only`) through one scheduler over a pool of `num_blocks` with
  // `decode_reserve` tokens of decode room per layer at admission; returns each request's
  // tokens; `cancel_after_steps` > 0 cancels request kCancelled then.
  std::map<int, std::vector<int32_t>> Run(int64_t num_blocks, int only = -1,
                                          int cancel_after_steps = 0, int64_t decode_reserve = 2) {
    RunnerOptions ro;
    ro.model_dir = testing::SmolLm2Dir().string();
    ro.device = "cpu";
    ro.dtype = "float32";
    ro.num_kv_blocks = num_blocks;
    ro.block_size = 16;
    auto runner = ModelRunner::Create(ro);
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (!runner.ok()) return {};
    (*runner)->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
    ModelRunner* r = runner->get();
    SchedulerOptions so;
    so.max_batch = 8;
    so.max_prefill_tokens_per_step = 64;
    so.decode_reserve_tokens = decode_reserve;
    Scheduler scheduler(
        *r, nullptr,
        [r] {
          return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
        },
        so);
    const std::vector<Case> cases = Cases();
    std::map<int, std::shared_ptr<RequestChannel>> channels;
    for (int i = 0; i < static_cast<int>(cases.size()); ++i) {
      if (only >= 0 && i != only) continue;
      GenerationRequest req;
      req.request_id = std::to_string(i);
      req.prompt_ids = *tokenizer_->Encode(cases[i].text);
      req.sampling.max_new_tokens = kNewTokens;
      req.sampling.ignore_eos = true;
      req.compression = cases[i].compression;
      channels[i] = std::make_shared<RequestChannel>();
      EXPECT_TRUE(scheduler.Submit(std::move(req), channels[i]).ok());
    }
    int steps = 0;
    while (scheduler.HasWork() && steps < 2000) {
      scheduler.Step();
      if (++steps == cancel_after_steps) channels[kCancelled]->Cancel();
    }
    EXPECT_FALSE(scheduler.HasWork());
    num_preemptions_ = scheduler.Stats().num_preemptions;
    EXPECT_EQ(r->pool().num_free_blocks(), r->pool().num_blocks()) << "KV blocks leaked";
    std::map<int, std::vector<int32_t>> out;
    for (auto& [i, ch] : channels) {
      while (auto event = ch->Pop()) {
        EXPECT_TRUE(event->error.ok()) << "request " << i << ": " << event->error;
        out[i].insert(out[i].end(), event->token_ids.begin(), event->token_ids.end());
      }
    }
    return out;
  }

  // One runner and scheduler (fp32 CPU, 1024 blocks of 16) serving requests one at a time.
  struct Served {
    std::unique_ptr<ModelRunner> runner;
    std::unique_ptr<Scheduler> scheduler;
  };
  Served Serve(bool prefix_cache, int64_t step_tokens = 64) {
    RunnerOptions ro;
    ro.model_dir = testing::SmolLm2Dir().string();
    ro.device = "cpu";
    ro.dtype = "float32";
    ro.num_kv_blocks = 1024;
    ro.block_size = 16;
    Served s;
    s.runner = std::move(*ModelRunner::Create(ro));
    s.runner->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
    ModelRunner* r = s.runner.get();
    SchedulerOptions so;
    so.max_prefill_tokens_per_step = step_tokens;
    so.prefix_cache = prefix_cache;
    s.scheduler = std::make_unique<Scheduler>(
        *r, nullptr,
        [r] {
          return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
        },
        so);
    return s;
  }
  struct Output {
    std::vector<int32_t> tokens;
    int32_t num_cached = 0;
  };
  // kNewTokens greedy tokens of `prompt`; the pool is all free after it unless a conversation is
  // kept.
  static Output Generate(Served& s, const std::vector<int32_t>& prompt,
                         const CompressionParams& compression = {},
                         bool keep_conversation = false) {
    GenerationRequest req;
    req.request_id = "r";
    req.prompt_ids = prompt;
    req.sampling.max_new_tokens = kNewTokens;
    req.sampling.ignore_eos = true;
    req.compression = compression;
    req.keep_conversation = keep_conversation;
    auto ch = std::make_shared<RequestChannel>();
    EXPECT_TRUE(s.scheduler->Submit(std::move(req), ch).ok());
    while (s.scheduler->HasWork()) s.scheduler->Step();
    Output out;
    while (auto event = ch->Pop()) {
      EXPECT_TRUE(event->error.ok()) << event->error;
      out.tokens.insert(out.tokens.end(), event->token_ids.begin(), event->token_ids.end());
      if (event->finished) out.num_cached = event->summary.num_cached_prompt_tokens;
    }
    if (!keep_conversation && s.scheduler->Stats().num_parked_conversations == 0)
      EXPECT_EQ(s.runner->pool().num_free_blocks(), s.runner->pool().num_blocks());
    return out;
  }
  std::vector<int32_t> Encode(const std::string& text) const { return *tokenizer_->Encode(text); }
  static std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  int64_t num_preemptions_ = 0;
};

TEST_F(MixedStepTest, TogetherEqualsAlone) {
  std::map<int, std::vector<int32_t>> alone;
  for (int i = 0; i < static_cast<int>(Cases().size()); ++i) alone[i] = Run(2048, i).at(i);
  for (auto& [i, tokens] : alone) ASSERT_EQ(tokens.size(), size_t{kNewTokens}) << i;

  const auto together = Run(2048);
  EXPECT_EQ(num_preemptions_, 0);
  for (auto& [i, tokens] : alone) EXPECT_EQ(together.at(i), tokens) << "request " << i;

  // A pool that holds exactly the first two prompts (SmolLM2: 30 layers; 16-token blocks) and no
  // decode room at admission: their decode growth preempts, the preempted are recomputed
  // exactly; request 2 is cancelled midway (after the first two finished and it was admitted),
  // the others' tokens are unchanged.
  const compression::KvCacheGeometry geometry{.num_global_layers = 30, .block_size = 16};
  int64_t first_two = 0;
  for (int i : {0, 1}) {
    first_two += *compression::BlocksNeeded(
        {}, static_cast<int64_t>(tokenizer_->Encode(Cases()[i].text)->size()), geometry, 0);
  }
  const auto tight = Run(first_two, -1, /*cancel_after_steps=*/30, /*decode_reserve=*/0);
  EXPECT_GT(num_preemptions_, 0);
  for (auto& [i, tokens] : alone) {
    if (i == kCancelled) continue;
    EXPECT_EQ(tight.at(i), tokens) << "request " << i;
  }
  EXPECT_LT(tight.count(kCancelled) ? tight.at(kCancelled).size() : 0, size_t{kNewTokens});
}

// The prefix cache on the real model: a second turn (the first turn's prompt, its answer, new
// text) and a second question about the same document start from cached blocks and produce the
// tokens a scheduler without the cache produces.
TEST_F(MixedStepTest, PrefixCacheGivesTheSameTokens) {
  Served cached = Serve(/*prefix_cache=*/true);
  const std::vector<int32_t> turn1 = Encode(Cases()[1].text);
  const Output first = Generate(cached, turn1);
  EXPECT_EQ(first.num_cached, 0);
  const std::vector<int32_t> turn2 =
      Concat(Concat(turn1, first.tokens), Encode(" Then the keeper closed the book and"));
  const Output second = Generate(cached, turn2);
  // The first turn's prompt and the 16 answer tokens fed back, in whole 16-token blocks.
  const auto stored = static_cast<int32_t>(turn1.size()) + kNewTokens - 1;
  EXPECT_EQ(second.num_cached, stored / 16 * 16);

  const std::vector<int32_t> document = Encode(Cases()[5].text);
  const std::vector<int32_t> q1 = Concat(document, Encode(" Who wrote the names?"));
  const std::vector<int32_t> q2 = Concat(document, Encode(" What colour was the book?"));
  const Output a1 = Generate(cached, q1);
  const Output a2 = Generate(cached, q2);
  EXPECT_GE(a2.num_cached, static_cast<int32_t>(document.size()) / 16 * 16);

  Served plain = Serve(/*prefix_cache=*/false);
  EXPECT_EQ(Generate(plain, turn2).tokens, second.tokens);
  EXPECT_EQ(Generate(plain, q2).tokens, a2.tokens);
  EXPECT_EQ(Generate(plain, q1).tokens, a1.tokens);
  EXPECT_EQ(plain.runner->pool().num_cached_blocks(), 0);
}

// A kept compressed conversation continued by a request that extends it (docs/compression.md,
// "Compressed conversations"): the result is the first request's compressed cache, the generated
// tokens decoded onto it, then the new tokens appended onto that cache as a prefill chunk (what
// teacher-forced decode of them computes) and one eviction to the second request's budgets,
// scored by its press with the chunk's last W queries. Checked against that definition run
// directly on a runner: with nothing to evict (keep 1.0) against decoding the new tokens one at a
// time, and at keep 25% against the prefill chunk with the press.
TEST_F(MixedStepTest, ContinuedConversationEqualsItsDefinition) {
  CompressionParams quarter;
  quarter.method = ScoreMethod::kDropKV;
  quarter.keep_ratio = 0.25;
  CompressionParams all = quarter;
  all.keep_ratio = 1.0;
  const std::vector<int32_t> turn1 = Encode(Cases()[3].text);
  const std::vector<int32_t> more = Encode(" Then he closed the green book and said that");

  // The definition on a bare runner: turn 1 compressed in one pass, its answer decoded (all but
  // the last token, which the next prompt brings), then the rest of the next prompt.
  auto reference = [&](const std::vector<int32_t>& answer, const CompressionParams& next,
                       bool new_tokens_by_decode) {
    Served s = Serve(false);
    ModelRunner& r = *s.runner;
    const std::vector<SequenceId> seq = {1};
    EXPECT_TRUE(r.Prefill(1, turn1, true, quarter).ok());
    for (int i = 0; i + 1 < static_cast<int>(answer.size()); ++i)
      EXPECT_TRUE(r.Decode(seq, std::vector<int32_t>{answer[i]}).ok());
    const std::vector<int32_t> rest = Concat({answer.back()}, more);
    at::Tensor logits;
    if (new_tokens_by_decode) {
      for (int32_t t : rest) logits = (*r.Decode(seq, std::vector<int32_t>{t}))[0];
    } else {
      logits = *r.Prefill(1, rest, true, next);
    }
    std::vector<int32_t> out;
    for (int i = 0; i < kNewTokens; ++i) {
      out.push_back(static_cast<int32_t>(logits.argmax().item<int64_t>()));
      if (i + 1 < kNewTokens) logits = (*r.Decode(seq, std::vector<int32_t>{out.back()}))[0];
    }
    return out;
  };

  for (const CompressionParams& next : {all, quarter}) {
    // One pass for turn 1 (no step chunks), as the reference prefills it.
    Served s = Serve(/*prefix_cache=*/true, /*step_tokens=*/4096);
    const Output first = Generate(s, turn1, quarter, /*keep_conversation=*/true);
    EXPECT_EQ(s.scheduler->Stats().num_parked_conversations, 1);
    const std::vector<int32_t> turn2 = Concat(Concat(turn1, first.tokens), more);
    const Output second = Generate(s, turn2, next, /*keep_conversation=*/true);
    EXPECT_EQ(second.num_cached, static_cast<int32_t>(turn1.size()) + kNewTokens - 1);
    EXPECT_EQ(s.scheduler->Stats().num_conversation_hits, 1);
    EXPECT_EQ(second.tokens, reference(first.tokens, next, next.keep_ratio == 1.0))
        << "keep " << next.keep_ratio;
    s.scheduler->CancelAll();
    s.scheduler->Step();
    EXPECT_EQ(s.runner->pool().num_free_blocks(), s.runner->pool().num_blocks());
  }
}

// A document compressed once and kept, then questions that do not keep their conversations:
// each continues a fork of the kept cache (full blocks shared, the partial ones copied) and must
// produce what taking the kept conversation over produces (the definition above), while the
// document stays kept for the next question and its blocks are untouched.
TEST_F(MixedStepTest, SharedDocumentForksEqualTakingItOver) {
  CompressionParams quarter;
  quarter.method = ScoreMethod::kDropKV;
  quarter.keep_ratio = 0.25;
  const std::vector<int32_t> document = Encode(Cases()[3].text);
  const std::vector<std::string> questions = {" Then he closed the green book and said that",
                                              " The ships that came at night were counted by"};
  Served shared = Serve(/*prefix_cache=*/true, /*step_tokens=*/4096);
  const Output doc = Generate(shared, document, quarter, /*keep_conversation=*/true);
  const int64_t free_with_document = shared.runner->pool().num_free_blocks();
  for (const std::string& q : questions) {
    const std::vector<int32_t> prompt = Concat(Concat(document, doc.tokens), Encode(q));
    const Output forked = Generate(shared, prompt, quarter, /*keep_conversation=*/false);
    EXPECT_EQ(forked.num_cached, static_cast<int32_t>(document.size()) + kNewTokens - 1);
    EXPECT_EQ(shared.scheduler->Stats().num_parked_conversations, 1);
    EXPECT_EQ(shared.runner->pool().num_free_blocks(), free_with_document);

    Served alone = Serve(/*prefix_cache=*/true, /*step_tokens=*/4096);
    EXPECT_EQ(Generate(alone, document, quarter, true).tokens, doc.tokens);
    const Output taken = Generate(alone, prompt, quarter, /*keep_conversation=*/true);
    EXPECT_EQ(taken.num_cached, forked.num_cached);
    EXPECT_EQ(forked.tokens, taken.tokens) << q;
  }
  EXPECT_EQ(shared.scheduler->Stats().num_conversation_hits, 2);
  shared.scheduler->CancelAll();
  shared.scheduler->Step();
  EXPECT_EQ(shared.runner->pool().num_free_blocks(), shared.runner->pool().num_blocks());
}

}  // namespace
}  // namespace dropkv
