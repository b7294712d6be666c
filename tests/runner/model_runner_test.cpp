// ModelRunner over the paged cache: decode equals a full-sequence recompute, batched decode of
// sequences of different lengths equals each alone, exhaustion leaves state unchanged, the
// KvSelector hook stores only kept entries, CaptureAttentionOutputs, and the demo model.
#include "engine/runner/model_runner.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "allocator/block_pool.h"
#include "engine/compression/kv_selector.h"
#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/runner/demo_model.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Not std::filesystem::remove_all: libtorch.so exports a broken copy of it that the dynamic
// linker may bind to (it segfaults).
void RemoveTree(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    std::filesystem::remove(e.path(), ec);
  std::filesystem::remove(dir, ec);
}

std::string DemoDir() {
  static const std::string dir = [] {
    auto d = EnsureDemoModel((testing::ScratchDir("runner") / "demo-model").string());
    EXPECT_TRUE(d.ok()) << d.status();
    return *d;
  }();
  return dir;
}

std::unique_ptr<ModelRunner> MakeRunner(int64_t num_blocks = 512, int32_t block_size = 4) {
  RunnerOptions o;
  o.model_dir = DemoDir();
  o.num_kv_blocks = num_blocks;
  o.block_size = block_size;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  return std::move(*r);
}

std::vector<int32_t> Tokens(int n, int offset) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + offset) % 256);
  return t;
}

// Logits of the last token from a cache-free forward over the whole sequence.
at::Tensor FullForwardLast(const ModelRunner& runner, const std::vector<int32_t>& tokens) {
  const Model& m = *runner.model();
  const int64_t n = static_cast<int64_t>(tokens.size());
  FullAttentionBackend backend(m.config());
  auto ids = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong);
  auto hidden = m.Forward(ids, at::arange(n, at::kLong), n - 1, backend);
  EXPECT_TRUE(hidden.ok());
  return m.Logits(hidden->narrow(0, n - 1, 1))[0];
}

TEST(ModelRunnerTest, DecodeOverPagedCacheMatchesFullRecompute) {
  auto runner = MakeRunner();
  auto seq_tokens = Tokens(9, 1);
  auto logits = runner->Prefill(1, seq_tokens, true, {});
  ASSERT_TRUE(logits.ok());
  EXPECT_LT((*logits - FullForwardLast(*runner, seq_tokens)).abs().max().item<double>(), 1e-5);
  for (int step = 0; step < 6; ++step) {
    const int32_t tok = (step * 11 + 3) % 256;
    const SequenceId seq = 1;
    auto out = runner->Decode(std::span(&seq, 1), std::span(&tok, 1));
    ASSERT_TRUE(out.ok()) << out.status();
    seq_tokens.push_back(tok);
    EXPECT_LT(((*out)[0] - FullForwardLast(*runner, seq_tokens)).abs().max().item<double>(), 1e-5)
        << step;
  }
  auto info = runner->CacheInfo(1);
  EXPECT_EQ(info.logical_len, 15);
  for (int64_t l : info.stored_len_per_layer) EXPECT_EQ(l, 15);
  EXPECT_EQ(info.num_blocks, 4 * 4);  // 15 slots in blocks of 4, 4 layers
  runner->Release(1);
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

TEST(ModelRunnerTest, BatchedDecodeOfDifferentLengthsEqualsEachAlone) {
  const std::vector<int> lens = {3, 10, 17};
  std::vector<std::vector<float>> alone;
  for (size_t i = 0; i < lens.size(); ++i) {
    auto r = MakeRunner();
    ASSERT_TRUE(r->Prefill(5, Tokens(lens[i], static_cast<int>(i)), true, {}).ok());
    const SequenceId seq = 5;
    const int32_t tok = 42;
    auto out = r->Decode(std::span(&seq, 1), std::span(&tok, 1));
    ASSERT_TRUE(out.ok());
    auto row = (*out)[0].contiguous();
    alone.emplace_back(row.data_ptr<float>(), row.data_ptr<float>() + row.numel());
  }
  auto r = MakeRunner();
  std::vector<SequenceId> seqs;
  for (size_t i = 0; i < lens.size(); ++i) {
    seqs.push_back(100 + static_cast<SequenceId>(i));
    ASSERT_TRUE(r->Prefill(seqs.back(), Tokens(lens[i], static_cast<int>(i)), true, {}).ok());
  }
  const std::vector<int32_t> toks(lens.size(), 42);
  auto out = r->Decode(seqs, toks);
  ASSERT_TRUE(out.ok());
  for (size_t i = 0; i < lens.size(); ++i) {
    auto want = at::tensor(alone[i]);
    // Attention is computed per sequence (bit-exact); the batched GEMMs of the projections may
    // use another kernel than B=1, hence a tolerance at fp32 rounding level.
    EXPECT_LT(((*out)[i] - want).abs().max().item<double>(), 1e-5) << i;
  }
}

TEST(ModelRunnerTest, ExhaustionLeavesSequencesUnchanged) {
  auto runner = MakeRunner(/*num_blocks=*/10, /*block_size=*/4);  // 4 layers: 2 blocks each + 2
  ASSERT_TRUE(runner->Prefill(1, Tokens(8, 0), true, {}).ok());   // 8 blocks
  EXPECT_EQ(runner->pool().num_free_blocks(), 2);
  auto big = runner->Prefill(2, Tokens(5, 1), true, {});
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(runner->pool().HasSequence(2));
  EXPECT_EQ(runner->pool().num_free_blocks(), 2);
  const SequenceId seq = 1;
  const int32_t tok = 3;
  auto d = runner->Decode(std::span(&seq, 1), std::span(&tok, 1));  // needs 4 new blocks
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  auto info = runner->CacheInfo(1);
  EXPECT_EQ(info.logical_len, 8);
  EXPECT_EQ(info.stored_len_per_layer[0], 8);
  EXPECT_EQ(runner->pool().num_free_blocks(), 2);
  // A later chunk that does not fit leaves the first chunk intact.
  EXPECT_EQ(runner->Prefill(1, Tokens(9, 2), false, {}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(runner->CacheInfo(1).logical_len, 8);
  EXPECT_EQ(runner->Decode(std::span(&seq, 1), std::span(&tok, 1)).status().code(),
            absl::StatusCode::kResourceExhausted);
  runner->Release(1);
  EXPECT_EQ(runner->pool().num_free_blocks(), 10);
  // Bad input is a status, not a crash.
  const int32_t bad = 9999;
  EXPECT_EQ(runner->Prefill(3, std::span(&bad, 1), true, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runner->Decode(std::span(&seq, 1), std::span(&tok, 1)).status().code(),
            absl::StatusCode::kNotFound);
}

// One forward over decode rows and prefill chunks of other sequences (ModelRunner::Step) gives
// each row what the same work gives alone: decode rows, a middle chunk and a last chunk, then a
// step that finishes the chunked prompt while the others decode.
TEST(ModelRunnerTest, MixedStepEqualsEachPartAlone) {
  auto mixed = MakeRunner();
  auto alone = MakeRunner();
  for (ModelRunner* r : {mixed.get(), alone.get()}) {
    ASSERT_TRUE(r->Prefill(1, Tokens(9, 1), true, {}).ok());
    ASSERT_TRUE(r->Prefill(2, Tokens(14, 2), true, {}).ok());
  }
  const CompressionParams none;
  const auto long_prompt = Tokens(19, 3);
  const auto short_prompt = Tokens(10, 4);
  const std::vector<SequenceId> decode_seqs = {1, 2};
  const std::vector<int32_t> decode_tokens = {42, 43};
  const std::vector<PrefillChunk> chunks = {
      {3, std::span(long_prompt).first(12), false, &none},
      {4, short_prompt, true, &none},
  };
  auto step = mixed->Step(decode_seqs, decode_tokens, chunks);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->size(0), 3);  // two decode rows, one last chunk
  auto d = alone->Decode(decode_seqs, decode_tokens);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(alone->Prefill(3, std::span(long_prompt).first(12), false, {}).ok());
  auto p4 = alone->Prefill(4, short_prompt, true, {});
  ASSERT_TRUE(p4.ok());
  // Attention runs per sequence; the shared GEMMs may pick other kernels for other row counts.
  EXPECT_LT(((*step).narrow(0, 0, 2) - *d).abs().max().item<double>(), 1e-5);
  EXPECT_LT(((*step)[2] - *p4).abs().max().item<double>(), 1e-5);

  const std::vector<SequenceId> decode2 = {1, 2, 4};
  const std::vector<int32_t> tokens2 = {7, 8, 9};
  const std::vector<PrefillChunk> last = {{3, std::span(long_prompt).subspan(12), true, &none}};
  step = mixed->Step(decode2, tokens2, last);
  ASSERT_TRUE(step.ok()) << step.status();
  d = alone->Decode(decode2, tokens2);
  ASSERT_TRUE(d.ok());
  auto p3 = alone->Prefill(3, std::span(long_prompt).subspan(12), true, {});
  ASSERT_TRUE(p3.ok());
  EXPECT_LT(((*step).narrow(0, 0, 3) - *d).abs().max().item<double>(), 1e-5);
  EXPECT_LT(((*step)[3] - *p3).abs().max().item<double>(), 1e-5);
  for (SequenceId s : {1, 2, 3, 4}) {
    EXPECT_EQ(mixed->CacheInfo(s).logical_len, alone->CacheInfo(s).logical_len) << s;
    EXPECT_EQ(mixed->CacheInfo(s).num_blocks, alone->CacheInfo(s).num_blocks) << s;
  }
  // A step of chunks only that ends no prompt returns no rows.
  auto none_done = mixed->Step({}, {}, std::vector<PrefillChunk>{{5, short_prompt, false, &none}});
  ASSERT_TRUE(none_done.ok()) << none_done.status();
  EXPECT_FALSE(none_done->defined());
}

// Prompt logprobs over chunks (the second beside a decode row) equal the log-softmax of a
// cache-free forward over the whole prompt, the chunk boundary's token included.
TEST(ModelRunnerTest, PromptLogprobsOverChunksMatchFullForward) {
  auto runner = MakeRunner();
  ASSERT_TRUE(runner->Prefill(1, Tokens(9, 1), true, {}).ok());
  const CompressionParams none;
  const auto prompt = Tokens(19, 3);
  auto chunk = [&](size_t begin, size_t len, bool last) {
    return PrefillChunk{.seq = 2,
                        .tokens = std::span(prompt).subspan(begin, len),
                        .is_last_chunk = last,
                        .compression = &none,
                        .return_prompt_logprobs = true,
                        .num_top_logprobs = 3};
  };
  ASSERT_TRUE(runner->Step({}, {}, std::vector<PrefillChunk>{chunk(0, 7, false)}).ok());
  const std::vector<SequenceId> decode_seqs = {1};
  const std::vector<int32_t> decode_tokens = {42};
  ASSERT_TRUE(
      runner->Step(decode_seqs, decode_tokens, std::vector<PrefillChunk>{chunk(7, 12, true)}).ok());
  auto got = runner->TakePromptLogprobs(2);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->logprobs.size(), prompt.size() - 1);

  const Model& m = *runner->model();
  const int64_t n = static_cast<int64_t>(prompt.size());
  FullAttentionBackend backend(m.config());
  auto ids = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), at::kLong);
  auto hidden = m.Forward(ids, at::arange(n, at::kLong), n - 1, backend);
  ASSERT_TRUE(hidden.ok());
  const at::Tensor want = m.Logits(*hidden).log_softmax(1);  // [n, vocab]
  for (int64_t i = 1; i < n; ++i) {
    EXPECT_NEAR(got->logprobs[i - 1], want[i - 1][prompt[i]].item<float>(), 1e-5) << i;
    auto [values, top_ids] = want[i - 1].topk(3);
    ASSERT_EQ(got->top_logprobs[i - 1].size(), 3u);
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(got->top_logprobs[i - 1][j].first, top_ids[j].item<int64_t>()) << i;
      EXPECT_NEAR(got->top_logprobs[i - 1][j].second, values[j].item<float>(), 1e-5) << i;
    }
  }
  // Taken once; a sequence that did not ask has none.
  EXPECT_TRUE(runner->TakePromptLogprobs(2)->logprobs.empty());
  EXPECT_TRUE(runner->TakePromptLogprobs(1)->logprobs.empty());
}

// A mixed step is all-or-nothing: a chunk that does not fit the pool, a bad token in a chunk or a
// sequence named twice leaves every sequence, decode rows included, as it was.
TEST(ModelRunnerTest, FailedMixedStepChangesNothing) {
  auto runner = MakeRunner(/*num_blocks=*/14, /*block_size=*/4);  // 4 layers
  ASSERT_TRUE(runner->Prefill(1, Tokens(7, 0), true, {}).ok());   // 8 blocks; the next token fits
  const CompressionParams none;
  const auto prompt = Tokens(9, 5);  // 12 blocks: does not fit after the decode rows
  const SequenceId seq = 1;
  const int32_t tok = 3;
  const int32_t bad = 9999;
  for (const std::vector<PrefillChunk>& chunks :
       {std::vector<PrefillChunk>{{2, prompt, true, &none}},
        std::vector<PrefillChunk>{{2, std::span(&bad, 1), true, &none}},
        std::vector<PrefillChunk>{{1, prompt, true, &none}}}) {
    const auto step = runner->Step(std::span(&seq, 1), std::span(&tok, 1), chunks);
    EXPECT_FALSE(step.ok());
    EXPECT_FALSE(runner->pool().HasSequence(2));
    EXPECT_EQ(runner->CacheInfo(1).logical_len, 7);
    EXPECT_EQ(runner->pool().num_free_blocks(), 6);
  }
  // The decode row alone still runs.
  EXPECT_TRUE(runner->Step(std::span(&seq, 1), std::span(&tok, 1), {}).ok());
  EXPECT_EQ(runner->CacheInfo(1).logical_len, 8);
}

// Keeps, per KV head, the last `keep` entries shifted by the head index (heads keep different
// positions), and records what it saw.
class ShiftSelector : public KvSelector {
 public:
  explicit ShiftSelector(int64_t keep) : keep_(keep) {}
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    seen_n.push_back(view.keys.size(1));
    const int64_t hkv = view.keys.size(0);
    const int64_t n = view.keys.size(1);
    if (n <= keep_ + hkv) return std::nullopt;
    std::vector<at::Tensor> rows;
    for (int64_t h = 0; h < hkv; ++h) rows.push_back(at::arange(n - keep_ - h, n - h, at::kLong));
    return std::optional<at::Tensor>(at::stack(rows));
  }
  std::vector<int64_t> seen_n;

 private:
  int64_t keep_;
};

TEST(ModelRunnerTest, SelectorKeepsPerHeadEntriesAndDecodeUsesThem) {
  auto runner = MakeRunner();
  ShiftSelector selector(5);
  auto prompt = Tokens(12, 4);
  auto logits = runner->PrefillWithSelector(1, prompt, true, &selector);
  ASSERT_TRUE(logits.ok()) << logits.status();
  // Prefill attention itself used the full K/V: logits equal the uncompressed forward.
  EXPECT_LT((*logits - FullForwardLast(*runner, prompt)).abs().max().item<double>(), 1e-5);
  EXPECT_EQ(selector.seen_n, std::vector<int64_t>(4, 12));
  auto info = runner->CacheInfo(1);
  EXPECT_EQ(info.logical_len, 12);
  for (int64_t l : info.stored_len_per_layer) EXPECT_EQ(l, 5);
  auto pos = runner->StoredPositions(1, 2);
  ASSERT_TRUE(pos.ok());
  EXPECT_TRUE(
      at::equal(*pos, at::stack({at::arange(7, 12, at::kLong), at::arange(6, 11, at::kLong),
                                 at::arange(5, 10, at::kLong), at::arange(4, 9, at::kLong)})));
  EXPECT_EQ(runner->pool().num_used_blocks(), 4 * 2);  // old full-length blocks were freed

  // Decode reads exactly the kept entries: compare with attention over a cache compacted by
  // CompactLayer on an uncompressed twin.
  auto twin = MakeRunner();
  ASSERT_TRUE(twin->Prefill(1, prompt, true, {}).ok());
  for (int32_t l = 0; l < 4; ++l) {
    std::vector<at::Tensor> rows;
    for (int64_t h = 0; h < 4; ++h) rows.push_back(at::arange(7 - h, 12 - h, at::kLong));
    ASSERT_TRUE(twin->CompactLayer(1, l, at::stack(rows)).ok());
  }
  const SequenceId seq = 1;
  const int32_t tok = 9;
  auto a = runner->Decode(std::span(&seq, 1), std::span(&tok, 1));
  auto b = twin->Decode(std::span(&seq, 1), std::span(&tok, 1));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::equal(*a, *b));
  EXPECT_EQ(runner->CacheInfo(1).logical_len, 13);  // RoPE continues from the original length
  EXPECT_EQ(runner->CacheInfo(1).stored_len_per_layer[0], 6);
  // And differs from the uncompressed decode (the selector did change what is read).
  auto full = MakeRunner();
  ASSERT_TRUE(full->Prefill(1, prompt, true, {}).ok());
  auto c = full->Decode(std::span(&seq, 1), std::span(&tok, 1));
  EXPECT_GT((*a - *c).abs().max().item<double>(), 1e-4);
}

TEST(ModelRunnerTest, ChunkedPrefillWithSelectorSeesStoredPlusChunk) {
  auto runner = MakeRunner();
  ShiftSelector selector(3);
  auto prompt = Tokens(14, 6);
  ASSERT_TRUE(
      runner->PrefillWithSelector(1, std::span(prompt).subspan(0, 8), false, &selector).ok());
  EXPECT_EQ(runner->CacheInfo(1).stored_len_per_layer[0], 3);
  ASSERT_TRUE(runner->PrefillWithSelector(1, std::span(prompt).subspan(8), true, &selector).ok());
  EXPECT_EQ(selector.seen_n[4], 3 + 6);  // stored + chunk
  EXPECT_EQ(runner->CacheInfo(1).logical_len, 14);
  EXPECT_EQ(runner->CacheInfo(1).stored_len_per_layer[0], 3);
  // Positions of kept entries come through both compactions: head 0 keeps the last 3 positions.
  EXPECT_TRUE(
      at::equal(runner->StoredPositions(1, 0)->select(0, 0), at::arange(11, 14, at::kLong)));
  // Compression requested without a factory is a clear error.
  CompressionParams cp;
  cp.method = ScoreMethod::kSnapKV;
  EXPECT_EQ(runner->Prefill(2, prompt, true, cp).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// The selector's time is reported per sequence (it feeds dropkv_scoring_seconds): a selector
// that takes 10 ms per layer shows up as at least 4 x 10 ms per chunk; none means 0.
class SlowSelector : public KvSelector {
 public:
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return std::optional<at::Tensor>();
  }
};

TEST(ModelRunnerTest, SelectorTimeIsReportedPerSequence) {
  auto runner = MakeRunner();
  SlowSelector selector;
  auto prompt = Tokens(10, 3);
  ASSERT_TRUE(runner->Prefill(2, prompt, true, {}).ok());
  EXPECT_EQ(runner->CacheInfo(2).compression_seconds, 0.0);
  ASSERT_TRUE(
      runner->PrefillWithSelector(1, std::span(prompt).subspan(0, 6), false, &selector).ok());
  const double first = runner->CacheInfo(1).compression_seconds;
  EXPECT_GE(first, 4 * 0.010);  // 4 layers
  ASSERT_TRUE(runner->PrefillWithSelector(1, std::span(prompt).subspan(6), true, &selector).ok());
  EXPECT_GE(runner->CacheInfo(1).compression_seconds, first + 4 * 0.010);
  EXPECT_LT(runner->CacheInfo(1).compression_seconds, 10.0);
  runner->Release(1);
  EXPECT_EQ(runner->CacheInfo(1).compression_seconds, 0.0);
}

// CPU fp32 holds projections of >= 1M elements in oneDNN's packed layout (Model::PackForCpu):
// the logits of prefill and decode equal those of plain at::linear over the same weights.
TEST(ModelRunnerTest, PackedCpuWeightsGiveTheSameLogits) {
  const auto dir = testing::ScratchDir("runner-packed");
  std::ofstream(dir / "config.json") << R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1024,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false, "torch_dtype": "float32"
  })";
  auto make = [&](bool packed) {
    RunnerOptions o;
    o.cpu_packed_weights = packed;
    o.model_dir = dir.string();
    o.random_weights = true;
    o.random_seed = 7;
    o.num_kv_blocks = 64;
    auto r = ModelRunner::Create(o);
    EXPECT_TRUE(r.ok()) << r.status();
    return std::move(*r);
  };
  auto plain = make(false);
  auto packed = make(true);
  EXPECT_EQ(plain->model()->num_packed_weights(), 0);
  // q/k/v (1536 x 1024), o, gate/up (2048 x 1024), down per layer, and the untied head.
  EXPECT_EQ(packed->model()->num_packed_weights(), 2 * 4 + 1);
  auto close = [](const at::Tensor& a, const at::Tensor& b) {
    const double scale = std::max(1.0, a.abs().max().item<double>());
    return (a - b).abs().max().item<double>() / scale;
  };
  auto prompt = Tokens(20, 5);
  auto a = plain->Prefill(1, prompt, true, {});
  auto b = packed->Prefill(1, prompt, true, {});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_LT(close(*a, *b), 1e-4);
  const SequenceId seq = 1;
  const int32_t tok = 17;
  auto da = plain->Decode(std::span(&seq, 1), std::span(&tok, 1));
  auto db = packed->Decode(std::span(&seq, 1), std::span(&tok, 1));
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_LT(close(*da, *db), 1e-4);
}

TEST(ModelRunnerTest, CaptureAttentionOutputsDoesNotTouchThePool) {
  auto runner = MakeRunner();
  auto outs = runner->CaptureAttentionOutputs(Tokens(7, 0));
  ASSERT_TRUE(outs.ok());
  ASSERT_EQ(outs->size(), 4u);
  for (const auto& o : *outs) EXPECT_EQ(o.sizes(), (std::vector<int64_t>{7, 64}));
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

TEST(ModelRunnerTest, DemoModelIsCreatedAndItsTokenizerLoads) {
  const auto cache = testing::ScratchDir("runner_demo_cache");
  RemoveTree(cache / "demo-model");
  RunnerOptions o;
  o.demo_model_dir = (cache / "demo-model").string();
  o.num_kv_blocks = 16;
  auto r = ModelRunner::Create(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(std::filesystem::exists(cache / "demo-model" / "model.safetensors"));
  EXPECT_EQ((*r)->config().vocab_size, 258);
  auto tok = Tokenizer::FromDirectory((cache / "demo-model").string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto ids = (*tok)->Encode("hi é", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{'h', 'i', ' ', 0xC3, 0xA9}));
  auto text = (*tok)->Decode(*ids);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "hi é");
  // Same bytes on a second creation (deterministic weights).
  auto a = ReadAll(cache / "demo-model" / "model.safetensors");
  RemoveTree(cache / "demo-model");
  ASSERT_TRUE(EnsureDemoModel((cache / "demo-model").string()).ok());
  EXPECT_EQ(a, ReadAll(cache / "demo-model" / "model.safetensors"));
  unsetenv("DROPKV_CACHE");
}

}  // namespace
}  // namespace dropkv
