// Presses inside the real runner (engine/runner) on its built-in demo model (random weights,
// Llama geometry: 4 layers, 8 query / 4 KV heads): stored lengths and positions after a
// compressed prefill, decode over the compressed cache vs decode over a full cache compacted to
// the same kept entries, and bounded pool usage with every_chunk on a 4K-token prompt; chunked
// prefill against one pass also on a Gemma-3-shaped model with sliding layers (random weights).
#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>

#include <gtest/gtest.h>

#include "allocator/block_pool.h"
#include "engine/compression/compression.h"
#include "engine/compression/plan.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "kernels/selection.h"
#include "tests/common/test_env.h"

namespace dropkv::compression {
namespace {

std::unique_ptr<ModelRunner> DemoRunner(int64_t num_blocks) {
  RunnerOptions o;  // empty model_dir = the demo model
  o.num_kv_blocks = num_blocks;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  (*r)->SetKvSelectorFactory(&CreateKvSelectorForModel);
  return std::move(*r);
}

std::vector<int32_t> Prompt(int64_t n, uint64_t seed) {
  std::vector<int32_t> ids(n);
  uint64_t x = seed;
  for (auto& t : ids) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t = static_cast<int32_t>((x >> 33) % 256);
  }
  return ids;
}

// Wraps a selector and records the pool's used blocks whenever a layer is about to be
// compacted (the full layer K/V of the step is alive then).
class PoolWatch final : public KvSelector {
 public:
  PoolWatch(KvSelector* inner, BlockPool* pool) : inner_(inner), pool_(pool) {}
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    peak_blocks = std::max(peak_blocks, pool_->num_used_blocks());
    return inner_ != nullptr ? inner_->Select(view) : std::optional<at::Tensor>();
  }
  int64_t peak_blocks = 0;

 private:
  KvSelector* inner_;
  BlockPool* pool_;
};

// The server's profile is read and checked against the model once (start-up): a file that is no
// profile, or one for another depth, is an error naming compression's field and the file; a good
// one reaches the presses without another read.
TEST(RunnerIntegration, ProfileIsCheckedAgainstTheModelOnce) {
  auto runner = DemoRunner(64);
  ASSERT_NE(runner, nullptr);
  const ModelConfig& config = runner->config();
  const auto dir = std::filesystem::temp_directory_path();
  LayerProfile profile;
  profile.model = "demo";
  profile.num_layers = config.num_global_layers();
  profile.values.assign(profile.num_layers, 1.0);
  profile.values[0] = 0.5;
  const std::string good = (dir / "dropkv_demo_profile.json").string();
  ASSERT_TRUE(SaveLayerProfile(profile, good).ok());
  auto loaded = LoadProfileForModel(good, config);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.allocator = BudgetAllocator::kMGA;
  p.keep_ratio = 0.5;
  p.profile_path = "/not/read/again.json";  // the loaded profile is used, no file is read
  EXPECT_TRUE(CreateKvSelectorWithProfile(p, config, &*loaded).ok());

  profile.num_layers += 1;
  profile.values.push_back(1.0);
  const std::string deeper = (dir / "dropkv_deeper_profile.json").string();
  ASSERT_TRUE(SaveLayerProfile(profile, deeper).ok());
  for (const std::string& path : {deeper, std::string("/etc/passwd")}) {
    auto bad = LoadProfileForModel(path, config);
    ASSERT_FALSE(bad.ok()) << path;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(bad.status().message().rfind("profile_path: ", 0), 0u) << bad.status();
    EXPECT_NE(bad.status().message().find(path), std::string::npos) << bad.status();
  }
}

TEST(RunnerIntegration, CompressedPrefillThenDecodeEqualsCompactedFullCache) {
  auto runner = DemoRunner(2048);
  ASSERT_NE(runner, nullptr);
  const int32_t num_layers = runner->config().num_layers;
  const int64_t n = 300;
  const auto prompt = Prompt(n, 1);
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.25;
  p.allocator = BudgetAllocator::kPyramid;

  // A: compressed inside the prefill forward.
  auto logits_a = runner->Prefill(1, prompt, true, p);
  ASSERT_TRUE(logits_a.ok()) << logits_a.status();
  SequenceCacheInfo info = runner->CacheInfo(1);
  EXPECT_EQ(info.logical_len, n);
  auto budgets = KeptTokensPerLayer(p, num_layers, n);
  ASSERT_TRUE(budgets.ok());
  EXPECT_EQ(info.stored_len_per_layer, *budgets);
  EXPECT_EQ(std::accumulate(budgets->begin(), budgets->end(), int64_t{0}),
            std::llround(num_layers * 0.25 * n));

  // B: full prefill, then each layer compacted to A's kept positions (= indices into B's
  // uncompressed layer).
  CompressionParams none;
  auto logits_b = runner->Prefill(2, prompt, true, none);
  ASSERT_TRUE(logits_b.ok());
  // The prefill's own logits do not depend on what is stored.
  EXPECT_TRUE(at::allclose(*logits_a, *logits_b, 1e-5, 1e-5));
  for (int32_t l = 0; l < num_layers; ++l) {
    auto pos = runner->StoredPositions(1, l);
    ASSERT_TRUE(pos.ok()) << pos.status();
    EXPECT_EQ(pos->size(1), (*budgets)[l]);
    // Ascending per head, the observation window kept.
    EXPECT_TRUE((pos->slice(1, 1) > pos->slice(1, 0, -1)).all().item<bool>());
    EXPECT_TRUE((pos->slice(1, -p.window) >= n - p.window).all().item<bool>());
    ASSERT_TRUE(runner->CompactLayer(2, l, *pos).ok());
  }
  EXPECT_EQ(runner->CacheInfo(2).stored_len_per_layer, *budgets);

  // C: full cache, for contrast: compression must change the decode logits.
  auto logits_c = runner->Prefill(3, prompt, true, none);
  ASSERT_TRUE(logits_c.ok());

  int32_t token = static_cast<int32_t>(logits_a->argmax().item<int64_t>());
  double max_diff_vs_full = 0;
  for (int step = 0; step < 6; ++step) {
    const std::vector<SequenceId> seqs = {1, 2, 3};
    const std::vector<int32_t> toks = {token, token, token};
    auto out = runner->Decode(seqs, toks);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(at::allclose((*out)[0], (*out)[1], 1e-5, 1e-5)) << "decode step " << step;
    max_diff_vs_full =
        std::max(max_diff_vs_full, ((*out)[0] - (*out)[2]).abs().max().item<double>());
    token = static_cast<int32_t>((*out)[0].argmax().item<int64_t>());
  }
  EXPECT_GT(max_diff_vs_full, 1e-4);  // the test sees compression at all
  info = runner->CacheInfo(1);
  EXPECT_EQ(info.logical_len, n + 6);  // RoPE positions continue from the original length
  for (int32_t l = 0; l < num_layers; ++l)
    EXPECT_EQ(info.stored_len_per_layer[l], (*budgets)[l] + 6);
}

// The scheduler prefills a long compressed prompt in chunks under last_chunk (so that running
// decodes are not stalled): inside the real runner that must keep exactly what one pass keeps,
// and decode the same, for every scorer.
// Prefills `prompt` as sequence 1 in one pass and as sequence 2 in chunks of `chunk` under the
// last-chunk policy, with `method` at keep 20%: the logits and every compressed layer's kept
// positions must be the same (sliding layers hold rings and are skipped). `logits`: the
// one-pass prefill's, when wanted.
void ExpectChunkedPrefillKeepsWhatOnePassKeeps(ModelRunner& runner, ScoreMethod method,
                                               std::span<const int32_t> prompt, int64_t chunk,
                                               at::Tensor* logits = nullptr) {
  const auto n = static_cast<int64_t>(prompt.size());
  CompressionParams one_pass;
  one_pass.method = method;
  one_pass.keep_ratio = 0.2;
  CompressionParams chunked = one_pass;
  chunked.chunk_size = static_cast<int32_t>(chunk);
  chunked.chunk_policy = ChunkPolicy::kLastChunk;
  auto logits_a = runner.Prefill(1, prompt, true, one_pass);
  ASSERT_TRUE(logits_a.ok()) << logits_a.status();
  absl::StatusOr<at::Tensor> logits_b;
  for (int64_t s = 0; s < n; s += chunk) {
    logits_b =
        runner.Prefill(2, prompt.subspan(s, std::min(chunk, n - s)), s + chunk >= n, chunked);
    ASSERT_TRUE(logits_b.ok()) << logits_b.status();
  }
  EXPECT_TRUE(at::allclose(*logits_a, *logits_b, 1e-4, 1e-4));
  if (logits != nullptr) *logits = *logits_a;
  const ModelConfig& config = runner.config();
  for (int32_t l = 0; l < config.num_layers; ++l) {
    if (config.is_sliding(l)) continue;
    auto a = runner.StoredPositions(1, l), b = runner.StoredPositions(2, l);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_LT(a->size(1), n);  // compressed at all
    EXPECT_TRUE(at::equal(*a, *b)) << "layer " << l;
  }
}

TEST(RunnerIntegration, LastChunkPrefillKeepsWhatOnePassKeeps) {
  const int64_t n = 300, chunk = 64;  // 64 + 64 + 64 + 64 + 44: the last chunk holds the window
  const auto prompt = Prompt(n, 3);
  for (ScoreMethod m : {ScoreMethod::kDropKV, ScoreMethod::kSnapKV, ScoreMethod::kH2O}) {
    SCOPED_TRACE(std::string(ScoreMethodName(m)));
    auto runner = DemoRunner(2048);
    ASSERT_NE(runner, nullptr);
    at::Tensor logits;
    ExpectChunkedPrefillKeepsWhatOnePassKeeps(*runner, m, prompt, chunk, &logits);
    ASSERT_TRUE(logits.defined());
    int32_t token = static_cast<int32_t>(logits.argmax().item<int64_t>());
    for (int step = 0; step < 4; ++step) {
      const std::vector<SequenceId> seqs = {1, 2};
      const std::vector<int32_t> toks = {token, token};
      auto out = runner->Decode(seqs, toks);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_TRUE(at::allclose((*out)[0], (*out)[1], 1e-4, 1e-4)) << "decode step " << step;
      token = static_cast<int32_t>((*out)[0].argmax().item<int64_t>());
    }
  }
}

// The same on a Gemma-3-shaped model (as Gemma-3-270M): sliding layers (rings, never
// compressed) between global ones, so the presses see the global layers numbered 0..G-1 and H2O's
// column sums must carry over chunks of the global layers only. Random weights at a small geometry;
// prompt longer than the window.
std::unique_ptr<ModelRunner> GemmaShapedRunner(int64_t num_blocks) {
  const auto dir = testing::ScratchDir("runner-gemma3-sliding");
  std::ofstream(dir / "config.json") << R"({
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "query_pre_attn_scalar": 48, "sliding_window": 32, "max_position_embeddings": 1024,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "full_attention"],
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true,
    "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "float32"
  })";
  RunnerOptions o;
  o.model_dir = dir.string();
  o.random_weights = true;
  o.random_seed = 3;
  o.num_kv_blocks = num_blocks;
  auto created = ModelRunner::Create(o);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return nullptr;
  (*created)->SetKvSelectorFactory(&CreateKvSelectorForModel);
  return std::move(*created);
}

TEST(RunnerIntegration, LastChunkPrefillKeepsWhatOnePassKeepsWithSlidingLayers) {
  const int64_t n = 300, chunk = 64;
  const auto prompt = Prompt(n, 5);
  for (ScoreMethod m :
       {ScoreMethod::kH2O, ScoreMethod::kKNorm, ScoreMethod::kDropKV, ScoreMethod::kSnapKV}) {
    SCOPED_TRACE(std::string(ScoreMethodName(m)));
    auto runner = GemmaShapedRunner(1024);
    ASSERT_NE(runner, nullptr);
    ASSERT_EQ(runner->config().num_global_layers(), 2);
    ExpectChunkedPrefillKeepsWhatOnePassKeeps(*runner, m, prompt, chunk);
  }
}

TEST(RunnerIntegration, EveryChunkBoundsPrefillPoolUsage) {
  // 4K-token prompt, 10% budget, chunks of 512: the pool never holds more than the compressed
  // cache + one layer's full K/V + one chunk (in blocks, one block of rounding per layer).
  const int64_t n = 4096, chunk = 512;
  const auto prompt = Prompt(n, 2);
  auto run = [&](const CompressionParams& p, std::vector<int64_t>* stored) -> int64_t {
    auto runner = DemoRunner(8192);
    if (runner == nullptr) return -1;
    std::unique_ptr<KvSelector> press;
    if (p.method != ScoreMethod::kNone) press = *CreateKvSelectorForModel(p, runner->config());
    PoolWatch watch(press.get(), &runner->pool());
    for (int64_t s = 0; s < n; s += chunk) {
      std::span<const int32_t> c(prompt.data() + s, static_cast<size_t>(std::min(chunk, n - s)));
      auto r = runner->PrefillWithSelector(7, c, s + chunk >= n, &watch);
      EXPECT_TRUE(r.ok()) << r.status();
      watch.peak_blocks = std::max(watch.peak_blocks, runner->pool().num_used_blocks());
    }
    *stored = runner->CacheInfo(7).stored_len_per_layer;
    return watch.peak_blocks;
  };
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.1;
  p.chunk_policy = ChunkPolicy::kEveryChunk;
  p.chunk_size = chunk;
  std::vector<int64_t> stored;
  const int64_t peak = run(p, &stored);
  auto budgets = KeptTokensPerLayer(p, 4, n);
  ASSERT_TRUE(budgets.ok());
  EXPECT_EQ(stored, *budgets);
  const int64_t block = 16;
  auto blocks = [&](int64_t tokens) { return (tokens + block - 1) / block; };
  int64_t bound = blocks(n) + blocks(chunk) + 4;
  for (int64_t b : *budgets) bound += blocks(b);
  EXPECT_GT(peak, 0);
  EXPECT_LE(peak, bound) << "peak " << peak << " blocks";
  // Without compression the same prompt needs far more: the bound is not vacuous.
  std::vector<int64_t> full_stored;
  const int64_t full_peak = run(CompressionParams{}, &full_stored);
  EXPECT_GT(full_peak, bound);
  std::cout << "every_chunk keep 0.1, 4096 tokens: peak " << peak << " blocks (bound " << bound
            << "), uncompressed " << full_peak << " blocks\n";
}

// A chunk that runs out of KV blocks part-way (RESOURCE_EXHAUSTED: the runner restores the cache,
// keeps the selector, and the scheduler replays the chunk once blocks are free) gives the same
// kept positions as an undisturbed prefill: H2O's column sums of the failed attempt are replaced
// by the replay, not added to.
TEST(RunnerIntegration, H2oChunkReplayedAfterResourceExhaustedKeepsTheSameTokens) {
  auto runner = DemoRunner(256);
  ASSERT_NE(runner, nullptr);
  const int32_t num_layers = runner->config().num_layers;
  const int64_t n = 240;
  const int64_t chunk = 64;
  const auto prompt = Prompt(n, 11);
  CompressionParams p;
  p.method = ScoreMethod::kH2O;
  p.keep_ratio = 0.2;
  p.chunk_policy = ChunkPolicy::kLastChunk;
  p.chunk_size = chunk;
  auto prefill_chunk = [&](SequenceId seq, int64_t start) {
    const int64_t len = std::min<int64_t>(chunk, n - start);
    return runner->Prefill(seq, std::span<const int32_t>(prompt).subspan(start, len),
                           start + len == n, p);
  };

  // Reference: the undisturbed chunked prefill.
  for (int64_t start = 0; start < n; start += chunk) ASSERT_TRUE(prefill_chunk(1, start).ok());
  std::vector<at::Tensor> expected;
  for (int32_t l = 0; l < num_layers; ++l) expected.push_back(*runner->StoredPositions(1, l));
  runner->Release(1);

  ASSERT_TRUE(prefill_chunk(2, 0).ok());
  // A filler sequence leaves room for every layer's share of the next chunk but the last one's,
  // so every layer's selector has seen the chunk when the step fails.
  BlockPool& pool = runner->pool();
  const int64_t need = num_layers * pool.BlocksFor(chunk);
  const int64_t per_layer = (pool.num_free_blocks() - need + num_layers) / num_layers;
  ASSERT_TRUE(
      runner->Prefill(3, Prompt(per_layer * pool.block_size(), 5), true, CompressionParams{}).ok());
  ASSERT_LT(pool.num_free_blocks(), need);
  ASSERT_GE(pool.num_free_blocks(), need - pool.BlocksFor(chunk));
  for (int attempt = 0; attempt < 2; ++attempt) {  // fails twice: replays replace, never add
    auto failed = prefill_chunk(2, chunk);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
    EXPECT_EQ(runner->CacheInfo(2).logical_len, chunk);  // left as before
  }
  runner->Release(3);
  for (int64_t start = chunk; start < n; start += chunk) {
    auto r = prefill_chunk(2, start);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  for (int32_t l = 0; l < num_layers; ++l) {
    EXPECT_TRUE(at::equal(expected[l], *runner->StoredPositions(2, l))) << "layer " << l;
  }
  runner->Release(2);
  EXPECT_EQ(pool.num_used_blocks(), 0);
}

}  // namespace
}  // namespace dropkv::compression

namespace dropkv::compression {
namespace {

// ModelRunner::Prefill keeps one selector per sequence across its chunks: H2O's column sums
// (which add up attention over every prompt query) then give the same kept positions whether the
// prompt arrives in one pass or in chunks under last_chunk. A fresh selector per chunk would see
// only the last chunk's queries and keep different tokens.
TEST(RunnerIntegration, H2oAccumulatesAcrossChunksThroughPrefill) {
  auto runner = DemoRunner(2048);
  ASSERT_NE(runner, nullptr);
  const int64_t n = 240;
  const auto prompt = Prompt(n, 7);
  CompressionParams p;
  p.method = ScoreMethod::kH2O;
  p.keep_ratio = 0.2;
  p.chunk_policy = ChunkPolicy::kLastChunk;

  auto single = runner->Prefill(1, prompt, true, p);
  ASSERT_TRUE(single.ok()) << single.status();
  p.chunk_size = 64;
  for (int64_t start = 0; start < n; start += 64) {
    const int64_t len = std::min<int64_t>(64, n - start);
    auto r = runner->Prefill(2, std::span<const int32_t>(prompt).subspan(start, len),
                             start + len == n, p);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  for (int32_t layer = 0; layer < runner->config().num_layers; ++layer) {
    auto a = runner->StoredPositions(1, layer);
    auto b = runner->StoredPositions(2, layer);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(*a, *b)) << "layer " << layer;
  }
  runner->Release(1);
  runner->Release(2);
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

// The plan (engine/compression/plan.h) counts the runner's blocks exactly: after each chunk the
// sequence holds the plan's blocks_after, and a pool of exactly the plan's peak runs the whole
// prefill while one block less runs out, for one pass, step chunks, every_chunk, budget and an
// uncompressed prompt.
// Records every layer's view of one prefill (queries, keys, values), keeping everything.
class ViewRecorder final : public KvSelector {
 public:
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    if (queries.size() <= static_cast<size_t>(view.layer_idx)) {
      queries.resize(view.layer_idx + 1);
      keys.resize(view.layer_idx + 1);
      values.resize(view.layer_idx + 1);
    }
    queries[view.layer_idx] = view.queries.to(at::kDouble);
    keys[view.layer_idx] = view.keys.to(at::kDouble);
    values[view.layer_idx] = view.values.to(at::kDouble);
    return std::optional<at::Tensor>();
  }
  std::vector<at::Tensor> queries, keys, values;
};

// DropKV scores (algorithms.md section 1) of entries [0, num_entries) by the query rows
// [first_row, end) of one layer's view, in fp64: row r sits at entry r and sees entries <= r.
at::Tensor Fp64DropKvScores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t first_row, int64_t num_entries) {
  const int64_t hq = q.size(0), hkv = k.size(0), g = hq / hkv, end = q.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  at::Tensor sum = at::zeros({hkv, num_entries}, k.options());
  for (int64_t begin = first_row; begin < end; begin += 256) {
    const int64_t rows = std::min<int64_t>(256, end - begin);
    const int64_t seen = begin + rows;
    const at::Tensor kk = k.narrow(1, 0, seen).repeat_interleave(g, 0);  // [Hq, seen, D]
    const at::Tensor vv = v.narrow(1, 0, seen).repeat_interleave(g, 0);
    at::Tensor logits = at::matmul(q.narrow(1, begin, rows), kk.transpose(1, 2)) * scale;
    const at::Tensor row_pos = at::arange(begin, seen, logits.options().dtype(at::kLong));
    const at::Tensor col = at::arange(seen, logits.options().dtype(at::kLong));
    logits = logits.masked_fill(col.unsqueeze(0) > row_pos.unsqueeze(1),
                                -std::numeric_limits<double>::infinity());
    const at::Tensor prob = at::softmax(logits, -1);  // [Hq, rows, seen]
    const at::Tensor out = at::matmul(prob, vv);      // [Hq, rows, D]
    const at::Tensor d2 = (vv.pow(2).sum(-1).unsqueeze(1) -
                           2 * at::matmul(out, vv.transpose(1, 2)) + out.pow(2).sum(-1, true))
                              .clamp_min(0);
    const at::Tensor w = (prob / (1 - prob + 1e-6)).pow(2);
    const at::Tensor per_head = (w * d2).sum(1).narrow(1, 0, num_entries);  // [Hq, entries]
    sum += per_head.reshape({hkv, g, num_entries}).mean(1);
  }
  return sum;
}

// Replay scoring keeps, in every layer, what an fp64 brute force of its definition keeps: the
// prompt fed again after itself in chunks of kReplayChunkTokens (each after the whole prompt, as
// one forward of prompt + chunk), every replay query's DropKV scores of the prompt's entries
// summed over the chunks, then the press's selection (pooling, lookback, window, budget). Two
// chunks here. The same prompt scored by its last W queries keeps other entries.
TEST(RunnerIntegration, ReplayScoringKeepsWhatAnFp64ReplayKeeps) {
  const int64_t n = kReplayChunkTokens + 452;
  const auto prompt = Prompt(n, 21);
  auto runner = DemoRunner(4096);
  ASSERT_NE(runner, nullptr);
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.1;
  p.scoring_queries = ScoringQueries::kReplay;
  ASSERT_TRUE(runner->Prefill(1, prompt, true, p).ok());
  EXPECT_EQ(runner->CacheInfo(1).logical_len, n);
  CompressionParams window = p;
  window.scoring_queries = ScoringQueries::kWindow;
  ASSERT_TRUE(runner->Prefill(2, prompt, true, window).ok());

  const int32_t num_layers = runner->config().num_layers;
  std::vector<at::Tensor> reference(num_layers);
  for (int64_t begin = 0; begin < n; begin += kReplayChunkTokens) {
    const int64_t len = std::min(kReplayChunkTokens, n - begin);
    std::vector<int32_t> fed = prompt;
    fed.insert(fed.end(), prompt.begin() + begin, prompt.begin() + begin + len);
    ViewRecorder rec;
    ASSERT_TRUE(runner->PrefillWithSelector(10, fed, true, &rec).ok());
    runner->Release(10);
    ASSERT_EQ(rec.queries.size(), static_cast<size_t>(num_layers));
    for (int32_t l = 0; l < num_layers; ++l) {
      at::Tensor part = Fp64DropKvScores(rec.queries[l], rec.keys[l], rec.values[l], n, n);
      reference[l] = reference[l].defined() ? reference[l] + part : part;
    }
  }
  auto press = CreateKvSelectorForModel(p, runner->config());
  ASSERT_TRUE(press.ok());
  auto budgets = (*press)->Budgets(n);
  ASSERT_TRUE(budgets.ok());
  kernels::SelectParams sp;
  sp.pool_kernel = p.pooling_kernel;
  sp.pool_lookback = p.pooling_lookback;
  sp.window = p.window;
  int64_t differs_from_window = 0;
  for (int32_t l = 0; l < num_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    auto want = kernels::SelectTopK(reference[l].to(at::kFloat).unsqueeze(0), (*budgets)[l], sp);
    ASSERT_TRUE(want.ok()) << want.status();
    auto got = runner->StoredPositions(1, l);
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->sizes(), (*want)[0].sizes());
    const double agree = got->eq((*want)[0]).to(at::kDouble).mean().item<double>();
    EXPECT_EQ(agree, 1.0);
    auto by_window = runner->StoredPositions(2, l);
    ASSERT_TRUE(by_window.ok());
    differs_from_window += !at::equal(*got, *by_window);
  }
  EXPECT_EQ(differs_from_window, num_layers);
  runner->Release(1);
  runner->Release(2);
  EXPECT_EQ(runner->pool().num_used_blocks(), 0);
}

// For each case and step budget: the plan's blocks after every chunk are the runner's, and a pool
// of exactly the plan's peak runs the prefill while one block less runs out.
void ExpectPlanCountsTheRunnersBlocksExactly(
    const std::function<std::unique_ptr<ModelRunner>(int64_t)>& make_runner,
    const std::vector<std::pair<std::string, CompressionParams>>& cases, int64_t n) {
  const auto prompt = Prompt(n, 9);
  for (const auto& [name, params] : cases) {
    for (const int64_t step : {int64_t{64}, int64_t{1000}}) {
      SCOPED_TRACE(name + ", step " + std::to_string(step) + ", " + std::to_string(n) + " tokens");
      auto probe = make_runner(8);
      ASSERT_NE(probe, nullptr);
      PlanOptions o;
      o.step_tokens = step;
      o.pool_blocks = 1 << 20;
      auto plan = CompressionPlan::Create(params, n, probe->cache_geometry(), nullptr, o);
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (const int64_t pool_blocks : {plan->blocks_needed(), plan->blocks_needed() - 1}) {
        auto runner = make_runner(pool_blocks);
        ASSERT_NE(runner, nullptr);
        absl::Status status = absl::OkStatus();
        for (size_t i = 0; i < plan->chunks().size() && status.ok(); ++i) {
          const PlannedChunk& c = plan->chunks()[i];
          std::span<const int32_t> chunk(prompt.data() + c.begin,
                                         static_cast<size_t>(c.end - c.begin));
          status =
              runner->Prefill(1, chunk, i + 1 == plan->chunks().size(), plan->params()).status();
          if (status.ok()) {
            EXPECT_EQ(runner->CacheInfo(1).num_blocks, c.blocks_after) << "chunk " << i;
          }
        }
        if (pool_blocks == plan->blocks_needed()) {
          EXPECT_TRUE(status.ok()) << status;
          // Nothing else holds blocks: every transient one went back.
          EXPECT_EQ(runner->pool().num_used_blocks(), runner->CacheInfo(1).num_blocks);
          std::vector<int64_t> global_stored;
          const std::vector<int64_t> stored = runner->CacheInfo(1).stored_len_per_layer;
          for (int32_t l = 0; l < runner->config().num_layers; ++l)
            if (!runner->config().is_sliding(l)) global_stored.push_back(stored[l]);
          EXPECT_EQ(global_stored, plan->kept_per_layer());
        } else {
          EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
        }
      }
    }
  }
}

TEST(RunnerIntegration, PlanCountsTheRunnersBlocksExactly) {
  std::vector<std::pair<std::string, CompressionParams>> cases;
  cases.push_back({"none", CompressionParams{}});
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.2;
  p.allocator = BudgetAllocator::kPyramid;
  cases.push_back({"one pass", p});
  CompressionParams every = p;
  every.chunk_size = 64;
  every.chunk_policy = ChunkPolicy::kEveryChunk;
  cases.push_back({"every_chunk", every});
  CompressionParams budget = every;
  budget.method = ScoreMethod::kH2O;
  budget.chunk_policy = ChunkPolicy::kBudget;
  budget.budget_cap_tokens = 100;
  cases.push_back({"budget", budget});
  CompressionParams replay = p;
  replay.scoring_queries = ScoringQueries::kReplay;
  cases.push_back({"replay", replay});
  ExpectPlanCountsTheRunnersBlocksExactly(&DemoRunner, cases, 300);
  // Replay scoring copies the sliding layers' rings too (ring not yet full, and full).
  const std::vector<std::pair<std::string, CompressionParams>> sliding = {{"one pass", p},
                                                                          {"replay", replay}};
  for (const int64_t n : {int64_t{24}, int64_t{300}})
    ExpectPlanCountsTheRunnersBlocksExactly(&GemmaShapedRunner, sliding, n);
}

}  // namespace
}  // namespace dropkv::compression
