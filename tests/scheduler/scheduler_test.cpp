// Scheduler tests (engine/scheduler/scheduler.h): scripted iterations against the real BlockPool
// through FakeRunner; outputs are compared with FakeRunner::Greedy, the single-request reference.
#include "engine/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <thread>

#include "tests/scheduler/fake_runner.h"
#include "tests/scheduler/fake_tokenizer.h"

namespace dropkv {
namespace {

using testing::FakeRunner;
using testing::FakeTokenizer;

struct Collected {
  std::vector<int32_t> tokens;
  std::string text;
  int num_events = 0;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  absl::Status error;
  GenerationSummary summary;
};

void Drain(RequestChannel& channel, Collected& out) {
  while (auto event = channel.Pop()) {
    ++out.num_events;
    EXPECT_FALSE(out.finished) << "event after the final one";
    out.tokens.insert(out.tokens.end(), event->token_ids.begin(), event->token_ids.end());
    out.text += event->text;
    if (event->finished) {
      out.finished = true;
      out.reason = event->finish_reason;
      out.error = event->error;
      out.summary = event->summary;
    }
  }
}

GenerationRequest MakeRequest(std::vector<int32_t> prompt, int max_new_tokens) {
  GenerationRequest r;
  r.request_id = "r";
  r.prompt_ids = std::move(prompt);
  r.sampling.max_new_tokens = max_new_tokens;
  r.sampling.ignore_eos = true;  // the fake model may predict id 2 (EOS) anywhere
  return r;
}

std::vector<int32_t> Prompt(int len, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(3 + (i * 7 + salt * 13) % 60);
  return p;
}

class SchedulerTest : public ::testing::Test {
 protected:
  void Make(int64_t num_blocks, SchedulerOptions options, int32_t block_size = 4) {
    scheduler_.reset();  // its prefix cache holds on to the runner's pool
    runner_ = std::make_unique<FakeRunner>(num_blocks, block_size);
    options.eos_token_ids = {2};
    scheduler_ = std::make_unique<Scheduler>(
        *runner_, &tokenizer_,
        [r = runner_.get()] {
          return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
        },
        options);
  }
  std::shared_ptr<RequestChannel> Submit(GenerationRequest r) {
    auto channel = std::make_shared<RequestChannel>();
    EXPECT_TRUE(scheduler_->Submit(std::move(r), channel).ok());
    return channel;
  }
  int RunAll(int max_steps = 10000) {
    int steps = 0;
    while (scheduler_->HasWork() && steps < max_steps) {
      scheduler_->Step();
      ++steps;
    }
    EXPECT_FALSE(scheduler_->HasWork()) << "did not finish in " << max_steps << " steps";
    return steps;
  }

  FakeTokenizer tokenizer_;
  std::unique_ptr<FakeRunner> runner_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, SingleRequestEqualsReference) {
  Make(64, {});
  auto ch = Submit(MakeRequest(Prompt(7, 1), 12));
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_TRUE(c.finished);
  EXPECT_EQ(c.reason, FinishReason::kLength);
  EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(7, 1), 12));
  std::string want;
  for (int32_t id : c.tokens)
    if (id >= 3) want.push_back(static_cast<char>('0' + id));
  EXPECT_EQ(c.text, want);
  EXPECT_EQ(c.summary.num_prompt_tokens, 7);
  EXPECT_EQ(c.summary.num_completion_tokens, 12);
  EXPECT_EQ(c.summary.num_kv_tokens_kept, 2 * 7);  // no compression: every layer keeps the prompt
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
  EXPECT_EQ(runner_->num_live_sequences(), 0);
}

// The per-step script: admission by batch slots, one forward per step (a prompt's first token
// comes from its prefill rows, its next ones from decode rows of later steps, beside other
// prompts' chunks), FCFS refill.
TEST_F(SchedulerTest, StepScriptAdmitsPrefillsAndDecodes) {
  SchedulerOptions o;
  o.max_batch = 2;
  Make(64, o);
  auto a = Submit(MakeRequest(Prompt(5, 1), 3));
  auto b = Submit(MakeRequest(Prompt(5, 2), 1));
  auto c = Submit(MakeRequest(Prompt(5, 3), 2));

  StepReport s1 = scheduler_->Step();
  EXPECT_EQ(s1.num_admitted, 2);
  EXPECT_EQ(s1.num_prefill_tokens, 10);
  EXPECT_EQ(s1.num_decoded, 0);
  EXPECT_EQ(s1.num_finished, 1);  // b finished at its first token (max_new_tokens 1)
  EXPECT_EQ(s1.num_running_after, 1);
  EXPECT_EQ(s1.num_waiting_after, 1);

  StepReport s2 = scheduler_->Step();  // c admitted into b's slot, in a's decode forward
  EXPECT_EQ(s2.num_admitted, 1);
  EXPECT_EQ(s2.num_prefill_tokens, 5);
  EXPECT_EQ(s2.num_decoded, 1);  // a's second token
  EXPECT_EQ(s2.num_finished, 0);
  EXPECT_EQ(s2.num_running_after, 2);
  EXPECT_EQ(runner_->num_mixed_steps, 1);

  StepReport s3 = scheduler_->Step();
  EXPECT_EQ(s3.num_prefill_tokens, 0);
  EXPECT_EQ(s3.num_decoded, 2);
  EXPECT_EQ(s3.num_finished, 2);  // a (3 tokens) and c (2 tokens)
  EXPECT_EQ(s3.num_running_after, 0);
  EXPECT_EQ(s3.num_waiting_after, 0);
  EXPECT_FALSE(scheduler_->HasWork());
  EXPECT_EQ(runner_->num_step_calls, 3);  // one forward per step
  // The decode accounting the metrics poller reads: two steps of 1 and 2 rows; the runner's
  // 20 us of host time before its kernels is measured for the pure-decode step (a mixed
  // forward's host work is not split out), inside the step's own time.
  const SchedulerStats stats = scheduler_->Stats();
  EXPECT_EQ(stats.num_decode_steps, 2);
  EXPECT_EQ(stats.num_decode_rows, 3);
  EXPECT_NEAR(stats.decode_host_seconds, 20e-6, 1e-12);
  EXPECT_GE(stats.decode_seconds, 0.0);
  EXPECT_EQ(s2.decode_host_seconds + s3.decode_host_seconds, stats.decode_host_seconds);
  EXPECT_EQ(s2.decode_seconds + s3.decode_seconds, stats.decode_seconds);

  for (auto [ch, salt, n] : {std::tuple{a, 1, 3}, {b, 2, 1}, {c, 3, 2}}) {
    Collected col;
    Drain(*ch, col);
    EXPECT_EQ(col.tokens, FakeRunner::Greedy(Prompt(5, salt), n)) << "salt " << salt;
  }
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
}

TEST_F(SchedulerTest, ChunkedPrefillRespectsTokenBudget) {
  SchedulerOptions o;
  o.max_prefill_tokens_per_step = 8;
  Make(64, o);
  GenerationRequest r = MakeRequest(Prompt(20, 4), 2);
  r.compression.chunk_size = 8;
  auto ch = Submit(std::move(r));
  EXPECT_EQ(scheduler_->Step().num_prefill_tokens, 8);
  EXPECT_EQ(scheduler_->Step().num_prefill_tokens, 8);
  StepReport s3 = scheduler_->Step();
  EXPECT_EQ(s3.num_prefill_tokens, 4);
  EXPECT_EQ(s3.num_decoded, 0);  // the first token comes from the last chunk's rows
  EXPECT_EQ(runner_->num_prefill_calls, 3);
  EXPECT_EQ(scheduler_->Step().num_decoded, 1);
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(20, 4), 2));
}

// A prompt longer than the step budget is prefilled in budget-sized chunks while the running
// sequences keep decoding: an uncompressed one in plain chunks; a compressed one without a chunk
// size under last_chunk (the same selection as one pass), its last chunk holding the whole
// observation window W = 8.
TEST_F(SchedulerTest, LongPromptsDoNotStallDecodes) {
  SchedulerOptions o;
  o.max_prefill_tokens_per_step = 8;
  Make(64, o);
  auto running = Submit(MakeRequest(Prompt(4, 5), 16));
  EXPECT_EQ(scheduler_->Step().num_prefill_tokens, 4);
  auto long_prompt = Submit(MakeRequest(Prompt(20, 6), 2));
  runner_->prefill_chunk_lens.clear();
  for (int64_t want : {8, 8, 4}) {
    StepReport step = scheduler_->Step();
    EXPECT_EQ(step.num_prefill_tokens, want);
    EXPECT_GE(step.num_decoded, 1);  // the running sequence got a token in the same step
  }
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{8, 8, 4}));
  // Each of those steps was one forward: the chunk and the running decode row together.
  EXPECT_EQ(runner_->num_mixed_steps, 3);

  GenerationRequest compressed = MakeRequest(Prompt(20, 7), 2);
  compressed.compression.method = ScoreMethod::kDropKV;
  compressed.compression.keep_ratio = 0.5;
  auto compressed_ch = Submit(std::move(compressed));
  runner_->prefill_chunk_lens.clear();
  // 20 = 8 + 4 + 8: a plain 8 + 8 + 4 split would leave the window half outside the last chunk.
  for (int64_t want : {8, 4, 8}) {
    StepReport step = scheduler_->Step();
    EXPECT_EQ(step.num_prefill_tokens, want);
    EXPECT_GE(step.num_decoded, 1);
  }
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{8, 4, 8}));
  EXPECT_EQ(runner_->last_prefill_params.chunk_policy, ChunkPolicy::kLastChunk);
  EXPECT_EQ(runner_->last_prefill_params.chunk_size, 8);
  RunAll();
  for (auto [ch, salt, len, n] :
       {std::tuple{running, 5, 4, 16}, {long_prompt, 6, 20, 2}, {compressed_ch, 7, 20, 2}}) {
    Collected col;
    Drain(*ch, col);
    EXPECT_EQ(col.tokens, FakeRunner::Greedy(Prompt(len, salt), n)) << "salt " << salt;
    if (salt == 7) {
      EXPECT_EQ(col.summary.num_kv_tokens_kept, 2 * 10);  // as one pass keeps
    }
  }
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
}

// The chunks of a last_chunk prefill are stored in full until the last one compresses: when the
// whole prompt would not fit the pool, a compressed prompt stays one pass (only kept tokens are
// ever stored), and a request's own chunk size is never overridden.
TEST_F(SchedulerTest, CompressedPromptStaysOnePassWhenItsFullCacheWouldNotFit) {
  SchedulerOptions o;
  o.max_prefill_tokens_per_step = 8;
  o.decode_reserve_tokens = 0;
  // Two layers of 4-token blocks: 40 tokens need 20 blocks in full, 10 blocks at keep 25%.
  Make(16, o);
  GenerationRequest r = MakeRequest(Prompt(40, 8), 1);
  r.compression.method = ScoreMethod::kDropKV;
  r.compression.keep_ratio = 0.25;
  auto ch = Submit(std::move(r));
  RunAll();
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{40}));
  EXPECT_EQ(runner_->last_prefill_params.chunk_size, 0);
  Collected col;
  Drain(*ch, col);
  EXPECT_EQ(col.tokens, FakeRunner::Greedy(Prompt(40, 8), 1));

  runner_->prefill_chunk_lens.clear();
  GenerationRequest own = MakeRequest(Prompt(20, 9), 1);
  own.compression.method = ScoreMethod::kDropKV;
  own.compression.keep_ratio = 0.5;
  own.compression.chunk_size = 6;
  own.compression.window = 4;  // a chunk size below the window is refused (ValidateCompression)
  own.compression.chunk_policy = ChunkPolicy::kEveryChunk;
  auto own_ch = Submit(std::move(own));
  RunAll();
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{6, 6, 6, 2}));
  EXPECT_EQ(runner_->last_prefill_params.chunk_policy, ChunkPolicy::kEveryChunk);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 16);
}

// Batching invariance: many concurrent requests of mixed lengths and compression settings each
// produce exactly their single-request output.
TEST_F(SchedulerTest, BatchedOutputsEqualSingleRequestOutputs) {
  SchedulerOptions o;
  o.max_batch = 8;
  o.max_prefill_tokens_per_step = 40;
  Make(512, o);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 24; ++i) {
    GenerationRequest r = MakeRequest(Prompt(3 + (i * 5) % 29, i), 1 + (i * 7) % 17);
    if (i % 3 == 1) {
      r.compression.method = ScoreMethod::kDropKV;
      r.compression.keep_ratio = 0.5;
    }
    channels.push_back(Submit(std::move(r)));
  }
  int max_batch_seen = 0;
  while (scheduler_->HasWork()) {
    scheduler_->Step();
    max_batch_seen = std::max(max_batch_seen, runner_->last_decode_batch);
  }
  EXPECT_EQ(max_batch_seen, 8);
  for (int i = 0; i < 24; ++i) {
    Collected c;
    Drain(*channels[i], c);
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(3 + (i * 5) % 29, i), 1 + (i * 7) % 17))
        << "request " << i;
    if (i % 3 == 1) {
      // What one pass keeps: the DepthKV budgets of the prompt (at least W = 8 a layer).
      CompressionParams half;
      half.method = ScoreMethod::kDropKV;
      half.keep_ratio = 0.5;
      const std::vector<int64_t> kept =
          compression::KeptTokensPerLayer(half, FakeRunner::kNumLayers, 3 + (i * 5) % 29).value();
      EXPECT_EQ(c.summary.num_kv_tokens_kept, kept[0] + kept[1]);
      EXPECT_GE(c.summary.scoring_ms, 0);  // compressed: the runner's selector time is reported
    } else {
      EXPECT_LT(c.summary.scoring_ms, 0);  // uncompressed: not measured
    }
  }
  EXPECT_EQ(runner_->pool().num_free_blocks(), 512);
}

// A pool too small for everyone's growth: the newest sequence is preempted (recomputed later) and
// every output is still exact.
TEST_F(SchedulerTest, PreemptionKeepsOutputsExact) {
  SchedulerOptions o;
  o.max_batch = 6;
  o.decode_reserve_tokens = 1;
  Make(/*num_blocks=*/24, o, /*block_size=*/4);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 6; ++i) channels.push_back(Submit(MakeRequest(Prompt(6, i), 20)));
  RunAll();
  EXPECT_GT(scheduler_->Stats().num_preemptions, 0);
  int total_preemptions = 0;
  for (int i = 0; i < 6; ++i) {
    Collected c;
    Drain(*channels[i], c);
    EXPECT_EQ(c.reason, FinishReason::kLength);
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(6, i), 20)) << "request " << i;
    total_preemptions += c.summary.num_preemptions;
  }
  EXPECT_EQ(total_preemptions, scheduler_->Stats().num_preemptions);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 24);
  // The scheduler preempted before each decode step that would not fit: no forward was refused.
  EXPECT_EQ(runner_->num_decode_failures, 0);
}

// Decode growth past the admission reserve takes room that prefilling sequences were counted
// with: each prefill chunk's blocks are checked against the pool before its forward (the
// compression plan's count), the newest sequence goes back to waiting when they do not fit, and
// the runner never gets a prefill it cannot hold. Compressed prompts (evicting at their last
// chunk) and plain ones; outputs stay exact.
TEST_F(SchedulerTest, PrefillChunksAreAdmittedBeforeTheirForward) {
  SchedulerOptions o;
  o.max_batch = 4;
  o.max_prefill_tokens_per_step = 4;
  o.decode_reserve_tokens = 0;
  Make(/*num_blocks=*/20, o, /*block_size=*/4);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = MakeRequest(Prompt(6 + 4 * i, i), 10);
    if (i % 2 == 1) {
      r.compression.method = ScoreMethod::kSnapKV;
      r.compression.keep_ratio = 0.5;
      r.compression.window = 4;
    }
    channels.push_back(Submit(std::move(r)));
  }
  RunAll();
  EXPECT_GT(scheduler_->Stats().num_preemptions, 0);
  EXPECT_EQ(runner_->num_prefill_failures, 0);
  EXPECT_EQ(runner_->num_decode_failures, 0);
  for (int i = 0; i < 6; ++i) {
    Collected c;
    Drain(*channels[i], c);
    EXPECT_EQ(c.reason, FinishReason::kLength) << "request " << i << ": " << c.error;
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(6 + 4 * i, i), 10)) << "request " << i;
  }
  EXPECT_EQ(runner_->pool().num_free_blocks(), 20);
}

// Higher priority is admitted first, FCFS within a priority.
TEST_F(SchedulerTest, PriorityOrdersAdmission) {
  SchedulerOptions o;
  o.max_batch = 1;  // one at a time: the finish order is the admission order
  Make(64, o);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int32_t priority : {0, 5, 5, -1, 1}) {
    GenerationRequest r = MakeRequest(Prompt(4, priority + 10), 2);
    r.priority = priority;
    channels.push_back(Submit(std::move(r)));
  }
  std::vector<Collected> collected(channels.size());
  std::vector<int> finish_order;
  while (scheduler_->HasWork()) {
    scheduler_->Step();
    for (size_t i = 0; i < channels.size(); ++i) {
      const bool was_finished = collected[i].finished;
      Drain(*channels[i], collected[i]);
      if (!was_finished && collected[i].finished) finish_order.push_back(static_cast<int>(i));
    }
  }
  EXPECT_EQ(finish_order, (std::vector<int>{1, 2, 4, 0, 3}));
}

// Preemption takes the lowest priority first, even when it is the oldest sequence; outputs stay
// exact.
TEST_F(SchedulerTest, PreemptionTakesTheLowestPriority) {
  SchedulerOptions o;
  o.max_batch = 2;
  o.decode_reserve_tokens = 0;
  Make(/*num_blocks=*/10, o, /*block_size=*/4);  // 2 layers: 16 tokens each need 8 blocks
  GenerationRequest low = MakeRequest(Prompt(4, 1), 12);
  auto low_ch = Submit(std::move(low));
  scheduler_->Step();  // admitted and prefilled first
  GenerationRequest high = MakeRequest(Prompt(4, 2), 12);
  high.priority = 1;
  auto high_ch = Submit(std::move(high));
  RunAll();
  Collected l, h;
  Drain(*low_ch, l);
  Drain(*high_ch, h);
  EXPECT_EQ(l.tokens, FakeRunner::Greedy(Prompt(4, 1), 12));
  EXPECT_EQ(h.tokens, FakeRunner::Greedy(Prompt(4, 2), 12));
  EXPECT_GT(l.summary.num_preemptions, 0);
  EXPECT_EQ(h.summary.num_preemptions, 0);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 10);
}

TEST_F(SchedulerTest, AdmissionWaitsForBlocksFcfs) {
  SchedulerOptions o;
  o.decode_reserve_tokens = 4;
  Make(/*num_blocks=*/8, o, /*block_size=*/4);
  // Each needs 2 layers x blocks(8 + 4 reserve) = 6 blocks: only one fits at a time.
  auto a = Submit(MakeRequest(Prompt(8, 1), 4));
  auto b = Submit(MakeRequest(Prompt(8, 2), 4));
  StepReport s1 = scheduler_->Step();
  EXPECT_EQ(s1.num_admitted, 1);
  EXPECT_EQ(s1.num_waiting_after, 1);
  RunAll();
  for (auto [ch, salt] : {std::pair{a, 1}, {b, 2}}) {
    Collected c;
    Drain(*ch, c);
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(8, salt), 4));
  }
  EXPECT_EQ(scheduler_->Stats().num_preemptions, 0);
}

TEST_F(SchedulerTest, RequestLargerThanPoolFailsCleanly) {
  Make(4, {}, 4);
  auto ch = Submit(MakeRequest(Prompt(40, 1), 4));
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_EQ(c.reason, FinishReason::kError);
  EXPECT_EQ(c.error.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 4);
}

TEST_F(SchedulerTest, QueueBoundByRequestsAndPromptTokens) {
  SchedulerOptions o;
  o.max_waiting_requests = 2;
  o.max_waiting_prompt_tokens = 15;
  Make(64, o);
  auto ch = std::make_shared<RequestChannel>();
  EXPECT_TRUE(scheduler_->Submit(MakeRequest(Prompt(5, 1), 2), ch).ok());
  // 5 + 11 > 15 tokens
  absl::Status st =
      scheduler_->Submit(MakeRequest(Prompt(11, 2), 2), std::make_shared<RequestChannel>());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(
      scheduler_->Submit(MakeRequest(Prompt(5, 3), 2), std::make_shared<RequestChannel>()).ok());
  st = scheduler_->Submit(MakeRequest(Prompt(1, 4), 2), std::make_shared<RequestChannel>());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);  // 2 requests waiting
  EXPECT_EQ(scheduler_->Stats().num_rejected, 2);
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(5, 1), 2));
  // Room again once the queue drained.
  EXPECT_TRUE(
      scheduler_->Submit(MakeRequest(Prompt(11, 2), 2), std::make_shared<RequestChannel>()).ok());
}

TEST_F(SchedulerTest, CancelledAndExpiredSequencesLeaveAtNextStep) {
  Make(64, {});
  auto running = Submit(MakeRequest(Prompt(6, 1), 50));
  GenerationRequest late = MakeRequest(Prompt(6, 2), 50);
  late.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
  auto expiring = Submit(std::move(late));
  auto kept = Submit(MakeRequest(Prompt(6, 3), 5));
  scheduler_->Step();
  EXPECT_LT(runner_->pool().num_free_blocks(), 64);
  running->Cancel();
  StepReport s = scheduler_->Step();
  EXPECT_EQ(s.num_reaped, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(420));
  s = scheduler_->Step();
  EXPECT_EQ(s.num_reaped, 1);
  RunAll();
  Collected c1, c2, c3;
  Drain(*running, c1);
  Drain(*expiring, c2);
  Drain(*kept, c3);
  EXPECT_EQ(c1.reason, FinishReason::kCancelled);
  EXPECT_TRUE(c1.error.ok()) << c1.error;  // the client's cancel
  EXPECT_EQ(c2.reason, FinishReason::kCancelled);
  // The deadline's expiry is told apart (logs and metrics record deadline_exceeded).
  EXPECT_EQ(c2.error.code(), absl::StatusCode::kDeadlineExceeded) << c2.error;
  EXPECT_EQ(c3.reason, FinishReason::kLength);
  EXPECT_EQ(c3.tokens, FakeRunner::Greedy(Prompt(6, 3), 5));
  // What was sent before the cancel is a prefix of the reference.
  auto ref = FakeRunner::Greedy(Prompt(6, 1), 50);
  ASSERT_LE(c1.tokens.size(), ref.size());
  EXPECT_TRUE(std::equal(c1.tokens.begin(), c1.tokens.end(), ref.begin()));
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
  EXPECT_EQ(runner_->num_live_sequences(), 0);
}

TEST_F(SchedulerTest, CancelWhileWaiting) {
  SchedulerOptions o;
  o.max_batch = 1;
  Make(64, o);
  auto a = Submit(MakeRequest(Prompt(4, 1), 3));
  auto b = Submit(MakeRequest(Prompt(4, 2), 3));
  b->Cancel();
  RunAll();
  Collected cb;
  Drain(*b, cb);
  EXPECT_EQ(cb.reason, FinishReason::kCancelled);
  EXPECT_TRUE(cb.tokens.empty());
}

TEST_F(SchedulerTest, StopTokenIdEosAndIgnoreEos) {
  Make(64, {});
  const auto ref = FakeRunner::Greedy(Prompt(9, 5), 10);
  GenerationRequest r = MakeRequest(Prompt(9, 5), 10);
  r.sampling.stop_token_ids = {ref[3]};
  auto ch = Submit(std::move(r));
  // The same token as EOS, once honoured and once ignored.
  SchedulerOptions o;
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_EQ(c.reason, FinishReason::kStop);
  const auto first = std::find(ref.begin(), ref.end(), ref[3]);
  EXPECT_EQ(c.tokens, std::vector<int32_t>(ref.begin(), first + 1));

  o.eos_token_ids = {ref[3]};
  scheduler_.reset();  // before the runner: its prefix cache holds on to the runner's pool
  runner_ = std::make_unique<FakeRunner>(64, 4);
  scheduler_ = std::make_unique<Scheduler>(
      *runner_, &tokenizer_,
      [r = runner_.get()] {
        return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
      },
      o);
  GenerationRequest honour = MakeRequest(Prompt(9, 5), 10);
  honour.sampling.ignore_eos = false;
  auto ch_honour = Submit(std::move(honour));
  auto ch_ignore = Submit(MakeRequest(Prompt(9, 5), 10));
  RunAll();
  Collected h, g;
  Drain(*ch_honour, h);
  Drain(*ch_ignore, g);
  EXPECT_EQ(h.reason, FinishReason::kStop);
  EXPECT_EQ(h.tokens, std::vector<int32_t>(ref.begin(), first + 1));
  EXPECT_EQ(g.reason, FinishReason::kLength);
  EXPECT_EQ(g.tokens, ref);
}

TEST_F(SchedulerTest, StopStringIsCutAndNeverSent) {
  Make(64, {});
  const auto ref = FakeRunner::Greedy(Prompt(9, 6), 12);
  auto full = *tokenizer_.Decode(ref, true);
  ASSERT_GE(full.size(), 8u);
  const std::string stop = full.substr(4, 2);
  const size_t cut = full.find(stop);
  GenerationRequest r = MakeRequest(Prompt(9, 6), 12);
  r.sampling.stop_strings = {stop};
  auto ch = Submit(std::move(r));
  RunAll();
  Collected c;
  Drain(*ch, c);
  EXPECT_EQ(c.reason, FinishReason::kStop);
  EXPECT_EQ(c.text, full.substr(0, cut));
  EXPECT_EQ(c.text.find(stop), std::string::npos);
  EXPECT_GT(c.num_events, 1);  // streamed in several deltas
}

TEST_F(SchedulerTest, SeededSamplingIsReproducible) {
  Make(64, {});
  auto make = [&] {
    GenerationRequest r = MakeRequest(Prompt(5, 7), 16);
    r.sampling.temperature = 5.0f;
    r.sampling.top_k = 10;
    r.sampling.seed = 1234;
    return r;
  };
  auto a = Submit(make());
  auto b = Submit(make());
  RunAll();
  Collected ca, cb;
  Drain(*a, ca);
  Drain(*b, cb);
  EXPECT_EQ(ca.tokens, cb.tokens);
  EXPECT_NE(ca.tokens, FakeRunner::Greedy(Prompt(5, 7), 16));  // temperature 5 over 10 candidates
}

TEST_F(SchedulerTest, DrainRefusesAndCancelAllFinishesEveryone) {
  Make(64, {});
  auto a = Submit(MakeRequest(Prompt(4, 1), 100));
  scheduler_->Step();
  scheduler_->BeginDrain();
  EXPECT_EQ(
      scheduler_->Submit(MakeRequest(Prompt(4, 2), 2), std::make_shared<RequestChannel>()).code(),
      absl::StatusCode::kUnavailable);
  scheduler_->CancelAll();
  RunAll();
  Collected c;
  Drain(*a, c);
  EXPECT_EQ(c.reason, FinishReason::kCancelled);
  EXPECT_TRUE(scheduler_->Stats().draining);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
}

// A sequence whose client reads nothing (paused channel) gives its slot to a waiting request,
// sends nothing while held, and once resumed is recomputed to the same output; one with nobody
// waiting keeps its slot; CancelAll finishes a held one.
TEST_F(SchedulerTest, APausedSequenceGivesItsSlotToAWaitingOne) {
  SchedulerOptions o;
  o.max_batch = 2;
  Make(64, o);
  auto a = Submit(MakeRequest(Prompt(5, 1), 20));
  auto b = Submit(MakeRequest(Prompt(5, 2), 20));
  for (int i = 0; i < 3; ++i) scheduler_->Step();
  a->SetPaused(true);
  scheduler_->Step();
  EXPECT_EQ(scheduler_->Stats().num_running, 2);  // nobody waits: a keeps its slot
  Collected a_out;
  Drain(*a, a_out);
  auto c = Submit(MakeRequest(Prompt(5, 3), 4));
  int steps = 0;
  Collected c_out;
  while (!c_out.finished && steps++ < 20) {
    scheduler_->Step();
    Drain(*c, c_out);
  }
  EXPECT_EQ(c_out.reason, FinishReason::kLength);
  EXPECT_EQ(c_out.tokens, FakeRunner::Greedy(Prompt(5, 3), 4));
  const int num_a_events = a_out.num_events;
  Drain(*a, a_out);
  EXPECT_EQ(a_out.num_events, num_a_events) << "a held sequence sent nothing";
  EXPECT_FALSE(a_out.finished);
  a->SetPaused(false);
  RunAll();
  Drain(*a, a_out);
  EXPECT_EQ(a_out.reason, FinishReason::kLength);
  EXPECT_EQ(a_out.tokens, FakeRunner::Greedy(Prompt(5, 1), 20));
  EXPECT_EQ(a_out.summary.num_preemptions, 1);
  Collected b_out;
  Drain(*b, b_out);
  EXPECT_EQ(b_out.tokens, FakeRunner::Greedy(Prompt(5, 2), 20));
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);

  auto d = Submit(MakeRequest(Prompt(5, 4), 50));
  auto e = Submit(MakeRequest(Prompt(5, 5), 50));
  for (int i = 0; i < 3; ++i) scheduler_->Step();
  d->SetPaused(true);
  auto f = Submit(MakeRequest(Prompt(5, 6), 50));
  scheduler_->Step();  // d held, f admitted
  EXPECT_EQ(scheduler_->Stats().num_waiting, 1);
  scheduler_->CancelAll();
  RunAll();
  Collected d_out;
  Drain(*d, d_out);
  EXPECT_EQ(d_out.reason, FinishReason::kCancelled);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
  EXPECT_EQ(runner_->num_live_sequences(), 0);
}

// The engine thread with producers on other threads (the server's shape).
TEST_F(SchedulerTest, EngineThreadServesConcurrentSubmitters) {
  SchedulerOptions o;
  o.max_batch = 4;
  Make(256, o);
  scheduler_->Start();
  std::vector<std::thread> clients;
  std::vector<Collected> results(16);
  for (int i = 0; i < 16; ++i) {
    clients.emplace_back([&, i] {
      auto ch = std::make_shared<RequestChannel>();
      ASSERT_TRUE(scheduler_->Submit(MakeRequest(Prompt(2 + i, i), 3 + i), ch).ok());
      while (!results[i].finished) {
        GenerationEvent e = ch->PopBlocking();
        results[i].tokens.insert(results[i].tokens.end(), e.token_ids.begin(), e.token_ids.end());
        results[i].finished = e.finished;
      }
    });
  }
  for (auto& t : clients) t.join();
  scheduler_->Stop();
  for (int i = 0; i < 16; ++i)
    EXPECT_EQ(results[i].tokens, FakeRunner::Greedy(Prompt(2 + i, i), 3 + i)) << i;
  EXPECT_EQ(runner_->pool().num_free_blocks(), 256);
}

// --- prefix cache -------------------------------------------------------------------------------

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A second turn (the first turn's prompt, its answer and new text) starts from the cached blocks
// of the first turn's prompt and answer: only the rest is prefilled, the output is the reference,
// and the cached blocks count as free once nobody runs.
TEST_F(SchedulerTest, PrefixCacheServesTheNextTurn) {
  SchedulerOptions o;
  o.max_prefill_tokens_per_step = 8;
  Make(64, o);
  const std::vector<int32_t> turn1 = Prompt(13, 1);
  auto a = Submit(MakeRequest(turn1, 6));
  RunAll();
  Collected ca;
  Drain(*a, ca);
  ASSERT_EQ(ca.tokens, FakeRunner::Greedy(turn1, 6));
  EXPECT_EQ(ca.summary.num_cached_prompt_tokens, 0);
  // 13 prompt + 5 fed answer tokens stored: 4 full 4-token blocks per layer cached.
  EXPECT_EQ(runner_->pool().num_cached_blocks(), 2 * 4);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);

  const std::vector<int32_t> turn2 = Concat(Concat(turn1, ca.tokens), Prompt(7, 2));  // 26 tokens
  runner_->prefill_chunk_lens.clear();
  auto b = Submit(MakeRequest(turn2, 5));
  RunAll();
  Collected cb;
  Drain(*b, cb);
  EXPECT_EQ(cb.tokens, FakeRunner::Greedy(turn2, 5));
  EXPECT_EQ(cb.summary.num_cached_prompt_tokens, 16);
  EXPECT_EQ(runner_->num_adopted_prefixes, 1);
  // 26 - 16 = 10 tokens on the 8-token grid a prefill from 0 uses: 16..24, 24..26.
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{8, 2}));
  const SchedulerStats stats = scheduler_->Stats();
  EXPECT_TRUE(stats.prefix_cache_enabled);
  EXPECT_EQ(stats.prefix_cache_query_tokens, 13 + 26);
  EXPECT_EQ(stats.prefix_cache_hit_tokens, 16);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
  EXPECT_EQ(runner_->num_live_sequences(), 0);

  // The same prompt again: all but its last block come from the cache (one token at least is
  // prefilled, for the first token's logits).
  runner_->prefill_chunk_lens.clear();
  auto again = Submit(MakeRequest(turn2, 5));
  RunAll();
  Collected cc;
  Drain(*again, cc);
  EXPECT_EQ(cc.tokens, cb.tokens);
  EXPECT_EQ(cc.summary.num_cached_prompt_tokens, 24);
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{2}));
}

// Requests sharing a cached prefix run at once; one is cancelled while it holds the shared blocks
// and another is preempted: outputs stay exact, nothing leaks, and a compressed request and a
// scheduler with the cache off never attach cached blocks.
TEST_F(SchedulerTest, SharedPrefixBlocksSurviveCancellationAndPreemption) {
  SchedulerOptions o;
  o.max_batch = 4;
  o.decode_reserve_tokens = 1;
  Make(/*num_blocks=*/40, o);
  const std::vector<int32_t> system = Prompt(16, 3);
  auto warm = Submit(MakeRequest(system, 1));
  RunAll();
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(Concat(system, Prompt(3 + i, 10 + i)));
    channels.push_back(Submit(MakeRequest(prompts.back(), 24)));
  }
  GenerationRequest compressed = MakeRequest(Concat(system, Prompt(9, 20)), 3);
  compressed.compression.method = ScoreMethod::kDropKV;
  compressed.compression.keep_ratio = 0.5;
  auto compressed_ch = Submit(std::move(compressed));
  for (int step = 0; step < 3; ++step) scheduler_->Step();
  EXPECT_EQ(runner_->num_adopted_prefixes, 4);  // the compressed request prefilled everything
  channels[1]->Cancel();
  RunAll();
  // Their growth (4 x 2 layers x 12 blocks at the end, the shared 8 once) passes 40 blocks.
  EXPECT_GT(scheduler_->Stats().num_preemptions, 0);
  for (int i = 0; i < 4; ++i) {
    Collected c;
    Drain(*channels[i], c);
    if (i == 1) {
      EXPECT_EQ(c.reason, FinishReason::kCancelled);
      continue;
    }
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(prompts[i], 24)) << "request " << i;
    EXPECT_GE(c.summary.num_cached_prompt_tokens, 16) << "request " << i;
  }
  Collected cc;
  Drain(*compressed_ch, cc);
  EXPECT_EQ(cc.tokens, FakeRunner::Greedy(Concat(system, Prompt(9, 20)), 3));
  EXPECT_EQ(cc.summary.num_cached_prompt_tokens, 0);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 40);
  EXPECT_EQ(runner_->num_live_sequences(), 0);
  EXPECT_EQ(runner_->num_prefill_failures, 0);
  EXPECT_EQ(runner_->num_decode_failures, 0);

  o.prefix_cache = false;
  Make(40, o);
  auto first = Submit(MakeRequest(prompts[0], 2));
  RunAll();
  auto second = Submit(MakeRequest(prompts[0], 2));
  RunAll();
  EXPECT_EQ(runner_->num_adopted_prefixes, 0);
  EXPECT_EQ(runner_->pool().num_cached_blocks(), 0);
  EXPECT_FALSE(scheduler_->Stats().prefix_cache_enabled);
}

// A pool full of cached blocks still admits new prompts: the least recently used entries go
// first (the deepest block of a chain before its parents), and what was used last stays.
TEST_F(SchedulerTest, PrefixCacheEvictsLeastRecentlyUsed) {
  SchedulerOptions o;
  o.decode_reserve_tokens = 0;
  Make(/*num_blocks=*/24, o);
  auto run = [&](int salt) {
    runner_->prefill_chunk_lens.clear();
    auto ch = Submit(MakeRequest(Prompt(16, salt), 1));
    RunAll();
    Collected c;
    Drain(*ch, c);
    EXPECT_EQ(c.tokens, FakeRunner::Greedy(Prompt(16, salt), 1)) << "salt " << salt;
    return runner_->prefill_chunk_lens;
  };
  // Each prompt: 16 tokens = 4 blocks x 2 layers, all cached; three fill the pool.
  for (int salt : {1, 2, 3}) run(salt);
  EXPECT_EQ(runner_->pool().num_cached_blocks(), 24);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 24);
  // Salt 1 again: 12 tokens attached, its last block prefilled into 2 blocks taken from the
  // least recently used entry: salt 1's own last block (the lookup used only the first three);
  // the new one is cached in its place.
  EXPECT_EQ(run(1), (std::vector<int64_t>{4}));
  EXPECT_EQ(scheduler_->Stats().prefix_cache_evicted_entries, 1);
  EXPECT_EQ(runner_->pool().num_cached_blocks(), 24);
  // A new prompt needs 8 blocks: salt 2's four entries go (the oldest), not salt 3's.
  EXPECT_EQ(run(4), (std::vector<int64_t>{16}));
  EXPECT_EQ(scheduler_->Stats().prefix_cache_evicted_entries, 5);
  EXPECT_EQ(run(1), (std::vector<int64_t>{4}));   // kept: used last
  EXPECT_EQ(run(3), (std::vector<int64_t>{4}));   // its last block went for salt 1's, not the rest
  EXPECT_EQ(run(2), (std::vector<int64_t>{16}));  // evicted
  EXPECT_EQ(runner_->pool().num_free_blocks(), 24);
  EXPECT_EQ(runner_->num_prefill_failures, 0);
}

// --- compressed conversations (keep_conversation)
// -------------------------------------------------

// A kept compressed conversation is continued by a request whose prompt extends it: only the new
// tokens are prefilled, onto the kept cache, and each layer then keeps the budget of the whole
// prompt; outputs are the reference's (the fake model reads the token history). A request that
// keeps its own conversation takes the kept one over; one that does not continues a fork of it
// (full blocks shared) and leaves it kept for others. A prompt that does not extend it by W
// prefills its whole prompt; a prompt that needs the blocks gets them back from the kept ones.
TEST_F(SchedulerTest, KeptConversationIsContinued) {
  SchedulerOptions o;
  o.decode_reserve_tokens = 0;
  Make(64, o);
  CompressionParams half;
  half.method = ScoreMethod::kDropKV;
  half.keep_ratio = 0.5;
  auto ask = [&](std::vector<int32_t> prompt, int n, bool keep) {
    GenerationRequest r = MakeRequest(std::move(prompt), n);
    r.compression = half;
    r.keep_conversation = keep;
    runner_->prefill_chunk_lens.clear();
    auto ch = Submit(std::move(r));
    RunAll();
    Collected c;
    Drain(*ch, c);
    return c;
  };
  const std::vector<int32_t> turn1 = Prompt(24, 1);
  const Collected a = ask(turn1, 5, true);
  EXPECT_EQ(a.tokens, FakeRunner::Greedy(turn1, 5));
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 1);
  EXPECT_EQ(runner_->num_live_sequences(), 1);
  const int64_t kept_blocks = 64 - runner_->pool().num_free_blocks();
  EXPECT_EQ(kept_blocks, 2 * 4);  // 12 kept + 4 fed answer tokens a layer

  // 24 prompt + 4 fed answer tokens kept; the last answer token (sampled, never fed) and 10 new
  // ones are prefilled (11 >= W = 8).
  const std::vector<int32_t> turn2 = Concat(Concat(turn1, a.tokens), Prompt(10, 2));
  const Collected b = ask(turn2, 4, true);
  EXPECT_EQ(b.tokens, FakeRunner::Greedy(turn2, 4));
  EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{11}));
  EXPECT_EQ(b.summary.num_cached_prompt_tokens, 28);
  const std::vector<int64_t> budget =
      compression::KeptTokensPerLayer(half, FakeRunner::kNumLayers, 39).value();
  EXPECT_EQ(b.summary.num_kv_tokens_kept, budget[0] + budget[1]);  // ~19.5 of 16 + 11 a layer
  EXPECT_EQ(scheduler_->Stats().num_conversation_hits, 1);
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 1);  // turn 2's, now

  // Two requests that do not keep their conversation (two questions about one document): each
  // continues a fork of turn 2's kept cache, which stays kept; the forks are released after.
  const int64_t free_before = runner_->pool().num_free_blocks();
  for (int q : {3, 5}) {
    const std::vector<int32_t> question = Concat(Concat(turn2, b.tokens), Prompt(10, q));
    EXPECT_EQ(ask(question, 2, false).tokens, FakeRunner::Greedy(question, 2));
    EXPECT_EQ(runner_->prefill_chunk_lens, (std::vector<int64_t>{11}));
  }
  EXPECT_EQ(runner_->num_forks, 2);
  EXPECT_EQ(scheduler_->Stats().num_conversation_hits, 3);
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 1);
  EXPECT_EQ(runner_->pool().num_free_blocks(), free_before);
  // A question cancelled midway gives back its own blocks and its share of the kept ones.
  {
    GenerationRequest r =
        MakeRequest(Concat(Concat(turn2, b.tokens), Prompt(10, 7)), /*max_new_tokens=*/50);
    r.compression = half;
    auto ch = Submit(std::move(r));
    for (int i = 0; i < 4; ++i) scheduler_->Step();
    EXPECT_LT(runner_->pool().num_free_blocks(), free_before);
    ch->Cancel();
    RunAll();
    EXPECT_EQ(runner_->pool().num_free_blocks(), free_before);
    EXPECT_EQ(runner_->num_forks, 3);
  }

  // Fewer new tokens than W: the whole prompt is prefilled.
  const std::vector<int32_t> short_turn = Concat(Concat(turn2, b.tokens), Prompt(4, 3));
  EXPECT_EQ(ask(short_turn, 2, true).tokens, FakeRunner::Greedy(short_turn, 2));
  EXPECT_EQ(runner_->prefill_chunk_lens,
            (std::vector<int64_t>{static_cast<int64_t>(short_turn.size())}));
  EXPECT_EQ(scheduler_->Stats().num_conversation_hits, 4);

  // A prompt that needs 60 of the 64 blocks: the kept conversations give theirs back.
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 2);
  auto big = Submit(MakeRequest(Prompt(120, 4), 1));
  RunAll();
  Collected cb;
  Drain(*big, cb);
  EXPECT_EQ(cb.tokens, FakeRunner::Greedy(Prompt(120, 4), 1));
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 0);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
  EXPECT_EQ(runner_->num_live_sequences(), 0);
  EXPECT_EQ(runner_->num_prefill_failures, 0);
}

// CancelAll (drain) releases kept conversations too.
TEST_F(SchedulerTest, CancelAllReleasesKeptConversations) {
  Make(64, {});
  GenerationRequest r = MakeRequest(Prompt(20, 1), 3);
  r.compression.method = ScoreMethod::kSnapKV;
  r.compression.keep_ratio = 0.5;
  r.keep_conversation = true;
  auto ch = Submit(std::move(r));
  RunAll();
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 1);
  scheduler_->CancelAll();
  scheduler_->Step();
  EXPECT_EQ(scheduler_->Stats().num_parked_conversations, 0);
  EXPECT_EQ(runner_->pool().num_free_blocks(), 64);
}

}  // namespace
}  // namespace dropkv
