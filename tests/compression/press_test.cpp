// Presses behind the KvSelector hook (press.h): chunk policies on a simulated runner (a per-layer
// stored cache that the selector compacts, as engine/runner does), invariants (window kept,
// indices ascending, budgets per layer, bounded prefill memory), H2O-with-V against an fp64
// brute force, seeding, and the error paths.
#include "engine/compression/press.h"

#include <ATen/ATen.h>

#include <cmath>
#include <numeric>
#include <optional>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/compression/budget.h"
#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

struct Geometry {
  int32_t num_layers = 4, num_q_heads = 4, num_kv_heads = 2, head_dim = 16;
  PressModelInfo Info() const { return {num_layers, num_q_heads, num_kv_heads, head_dim}; }
};

// Random per-layer prefill inputs: q [Hq, n, D], k/v [Hkv, n, D]. Scaled so attention is peaky
// (few exact ties).
struct LayerInputs {
  std::vector<at::Tensor> q, k, v;
};
LayerInputs RandomInputs(const Geometry& g, int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  LayerInputs in;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    in.q.push_back(at::randn({g.num_q_heads, n, g.head_dim}, gen, at::kFloat) * 2.0);
    in.k.push_back(at::randn({g.num_kv_heads, n, g.head_dim}, gen, at::kFloat));
    in.v.push_back(at::randn({g.num_kv_heads, n, g.head_dim}, gen, at::kFloat));
  }
  return in;
}

// What the runner keeps per layer during a chunked prefill.
struct SimResult {
  std::vector<at::Tensor> positions;  // int64 [Hkv, stored] per layer, final
  int64_t peak_tokens = 0;            // max over time of all layers' stored entries per head
  std::vector<std::vector<int64_t>> stored_after_chunk;  // [chunk][layer]
};

// A chunk whose prefill fails part-way: the runner calls Select on the first
// `num_layers_selected` layers, then the step fails (RESOURCE_EXHAUSTED), the cache is left as
// before and the same chunk is replayed, `num_failures` times in a row.
struct ChunkFailure {
  int64_t chunk_idx = -1;  // -1 = no failure
  int32_t num_layers_selected = 0;
  int32_t num_failures = 1;
};

// Layer 0's view of a one-pass prefill of all n tokens.
LayerKvView OnePassView(const Geometry& g, const LayerInputs& in, int64_t n) {
  LayerKvView view;
  view.num_layers = g.num_layers;
  view.logical_len = n;
  view.queries = in.q[0];
  view.keys = in.k[0];
  view.values = in.v[0];
  view.positions = at::arange(n, at::kLong).expand({g.num_kv_heads, n});
  return view;
}

// The runner's CUDA flash path in fp32 math: the last `rows` rows of the chunk's attention over
// the view's n entries (row i sees entries j <= n - rows + i) and their LSE; [Hq, rows, D] and
// [Hq, rows]; scale 1/sqrt(D) as the press's scorer uses.
void AddWindowAttention(LayerKvView& view, int64_t rows) {
  const int64_t hq = view.queries.size(0), chunk = view.queries.size(1);
  const int64_t n = view.keys.size(1), d = view.keys.size(2);
  rows = std::min(rows, chunk);
  if (rows <= 0) return;
  const int64_t g = hq / view.keys.size(0);
  auto q = view.queries.slice(1, chunk - rows, chunk);  // [Hq, w, D]
  auto k = view.keys.repeat_interleave(g, 0);           // [Hq, n, D]: head h reads h / g
  auto v = view.values.repeat_interleave(g, 0);
  auto logits = at::bmm(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(d));
  auto row = at::arange(rows, at::kLong).unsqueeze(1);
  auto col = at::arange(n, at::kLong).unsqueeze(0);
  logits.masked_fill_((col > row + (n - rows)).unsqueeze(0), -INFINITY);
  view.window_lse = at::logsumexp(logits, -1);                 // [Hq, w]
  view.window_attn_out = at::bmm(at::softmax(logits, -1), v);  // [Hq, w, D]
}

// Chunked prefill of `in` through `selector` (chunk_len 0 = one pass). Memory in tokens per KV
// head: while layer l runs, the other layers hold their stored entries and layer l holds
// stored + chunk (only one layer's uncompressed K/V is alive at a time).
SimResult Simulate(KvSelector& selector, const Geometry& g, const LayerInputs& in, int64_t n,
                   int64_t chunk_len, const ChunkFailure& failure = {},
                   bool with_attention = false) {
  if (chunk_len <= 0) chunk_len = n;
  std::vector<at::Tensor> k(g.num_layers), v(g.num_layers), pos(g.num_layers);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    k[l] = at::empty({g.num_kv_heads, 0, g.head_dim});
    v[l] = at::empty({g.num_kv_heads, 0, g.head_dim});
    pos[l] = at::empty({g.num_kv_heads, 0}, at::kLong);
  }
  auto make_view = [&](int32_t l, int64_t start, int64_t end) {
    LayerKvView view;
    view.layer_idx = l;
    view.num_layers = g.num_layers;
    view.logical_len = end;
    view.queries = in.q[l].slice(1, start, end);
    view.keys = at::cat({k[l], in.k[l].slice(1, start, end)}, 1);
    view.values = at::cat({v[l], in.v[l].slice(1, start, end)}, 1);
    view.positions = at::cat(
        {pos[l], at::arange(start, end, at::kLong).expand({g.num_kv_heads, end - start})}, 1);
    view.is_last_chunk = end == n;
    if (with_attention) AddWindowAttention(view, selector.num_attention_rows());
    return view;
  };
  SimResult r;
  int64_t chunk_idx = 0;
  for (int64_t start = 0; start < n; start += chunk_len, ++chunk_idx) {
    const int64_t end = std::min(n, start + chunk_len);
    if (chunk_idx == failure.chunk_idx) {
      for (int32_t f = 0; f < failure.num_failures; ++f) {
        for (int32_t l = 0; l < failure.num_layers_selected; ++l) {
          EXPECT_TRUE(selector.Select(make_view(l, start, end)).ok());  // result thrown away
        }
      }
    }
    std::vector<int64_t> stored;
    for (int32_t l = 0; l < g.num_layers; ++l) {
      LayerKvView view = make_view(l, start, end);
      int64_t others = 0;
      for (int32_t o = 0; o < g.num_layers; ++o) {
        if (o != l) others += k[o].size(1);
      }
      r.peak_tokens = std::max(r.peak_tokens, others + view.keys.size(1));
      auto kept = selector.Select(view);
      EXPECT_TRUE(kept.ok()) << kept.status();
      if (kept.ok() && kept->has_value()) {
        const at::Tensor& idx = **kept;
        EXPECT_EQ(idx.size(0), g.num_kv_heads);
        // Sorted ascending per head, no duplicates.
        if (idx.size(1) > 1) {
          EXPECT_TRUE((idx.slice(1, 1) > idx.slice(1, 0, -1)).all().item<bool>());
        }
        k[l] = view.keys.gather(1, idx.unsqueeze(-1).expand({-1, -1, g.head_dim}));
        v[l] = view.values.gather(1, idx.unsqueeze(-1).expand({-1, -1, g.head_dim}));
        pos[l] = view.positions.gather(1, idx);
      } else {
        k[l] = view.keys;
        v[l] = view.values;
        pos[l] = view.positions;
      }
      stored.push_back(k[l].size(1));
    }
    r.stored_after_chunk.push_back(stored);
  }
  r.positions = pos;
  return r;
}

std::unique_ptr<KvSelector> MakeSelector(const CompressionParams& p, const Geometry& g) {
  auto s = CreateKvSelector(p, g.Info());
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

const ScoreMethod kMethods[] = {
    ScoreMethod::kDropKV, ScoreMethod::kSnapKV,       ScoreMethod::kH2O,   ScoreMethod::kH2OVl1,
    ScoreMethod::kH2OVl2, ScoreMethod::kStreamingLLM, ScoreMethod::kKNorm, ScoreMethod::kRandom};

TEST(Press, LastChunkEqualsSinglePass) {
  Geometry g;
  const int64_t n = 200;
  LayerInputs in = RandomInputs(g, n, 7);
  for (ScoreMethod m : kMethods) {
    SCOPED_TRACE(std::string(ScoreMethodName(m)));
    CompressionParams p;
    p.method = m;
    p.keep_ratio = 0.3;
    p.allocator = BudgetAllocator::kPyramid;
    auto single = MakeSelector(p, g);
    SimResult a = Simulate(*single, g, in, n, 0);
    p.chunk_size = 48;
    auto chunked = MakeSelector(p, g);
    SimResult b = Simulate(*chunked, g, in, n, 48);
    auto budgets = KeptTokensPerLayer(p, g.num_layers, n);
    ASSERT_TRUE(budgets.ok());
    for (int32_t l = 0; l < g.num_layers; ++l) {
      EXPECT_EQ(a.positions[l].size(1), (*budgets)[l]);
      EXPECT_TRUE(at::equal(a.positions[l], b.positions[l])) << "layer " << l;
      // The window (last W positions) is always kept.
      EXPECT_TRUE((a.positions[l].slice(1, -p.window) ==
                   at::arange(n - p.window, n, at::kLong).expand({g.num_kv_heads, p.window}))
                      .all()
                      .item<bool>());
    }
  }
}

TEST(Press, EveryChunkKeepsLayerBudgetsAndBoundsMemory) {
  // A 4K-token prompt, 10% budget, chunks of 512: stored per layer after each chunk is
  // keep_l(n_seen), and the peak is the compressed cache + one layer's stored + one chunk.
  Geometry g;
  const int64_t n = 4096, chunk = 512;
  LayerInputs in = RandomInputs(g, n, 11);
  for (BudgetAllocator a : {BudgetAllocator::kUniform, BudgetAllocator::kPyramid}) {
    CompressionParams p;
    p.method = ScoreMethod::kDropKV;
    p.keep_ratio = 0.1;
    p.allocator = a;
    p.chunk_policy = ChunkPolicy::kEveryChunk;
    p.chunk_size = chunk;
    auto sel = MakeSelector(p, g);
    SimResult r = Simulate(*sel, g, in, n, chunk);
    int64_t max_layer = 0, compressed_total = 0;
    for (size_t c = 0; c < r.stored_after_chunk.size(); ++c) {
      const int64_t seen = std::min<int64_t>(n, (c + 1) * chunk);
      auto budgets = KeptTokensPerLayer(p, g.num_layers, seen);
      ASSERT_TRUE(budgets.ok());
      EXPECT_EQ(r.stored_after_chunk[c], *budgets) << "after chunk " << c;
      for (int64_t b : *budgets) max_layer = std::max(max_layer, b);
    }
    auto final_budgets = KeptTokensPerLayer(p, g.num_layers, n);
    for (int64_t b : *final_budgets) compressed_total += b;
    EXPECT_EQ(compressed_total, std::llround(g.num_layers * 0.1 * n));
    EXPECT_LE(r.peak_tokens, compressed_total + max_layer + chunk);
    EXPECT_LT(r.peak_tokens, g.num_layers * n / 4);  // far below the full cache
  }
}

TEST(Press, BudgetPolicyCompressesWhenTheCapWouldBeCrossed) {
  Geometry g;
  const int64_t n = 2048, chunk = 256, cap = 700;
  LayerInputs in = RandomInputs(g, n, 3);
  CompressionParams p;
  p.method = ScoreMethod::kKNorm;
  p.keep_ratio = 0.1;
  p.chunk_policy = ChunkPolicy::kBudget;
  p.chunk_size = chunk;
  p.budget_cap_tokens = cap;
  auto sel = MakeSelector(p, g);
  SimResult r = Simulate(*sel, g, in, n, chunk);
  for (size_t c = 0; c + 1 < r.stored_after_chunk.size(); ++c) {
    for (int64_t stored : r.stored_after_chunk[c]) EXPECT_LE(stored + chunk, cap) << "chunk " << c;
  }
  // Chunks 0 and 1 fit uncompressed (256 + 256 <= 700); after chunk 1, 512 + 256 > 700.
  EXPECT_EQ(r.stored_after_chunk[0][0], 256);
  EXPECT_LT(r.stored_after_chunk[1][0], 512);
  EXPECT_EQ(r.stored_after_chunk.back(), *KeptTokensPerLayer(p, g.num_layers, n));
}

TEST(Press, H2oWithValueNormMatchesFp64BruteForce) {
  Geometry g;
  const int64_t n = 96;
  LayerInputs in = RandomInputs(g, n, 5);
  CompressionParams p;
  p.method = ScoreMethod::kH2OVl2;
  p.keep_ratio = 0.25;
  auto sel = MakeSelector(p, g);
  SimResult r = Simulate(*sel, g, in, n, 32);  // accumulated over 3 chunks
  const int64_t keep = *KeptTokensPerLayer(p, g.num_layers, n).value().begin();
  const int64_t group = g.num_q_heads / g.num_kv_heads;
  for (int32_t l = 0; l < g.num_layers; ++l) {
    auto q = in.q[l].to(at::kDouble), k = in.k[l].to(at::kDouble), v = in.v[l].to(at::kDouble);
    auto mask = at::ones({n, n}, at::kBool).triu(1);
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      at::Tensor s = at::zeros({n}, at::kDouble);
      for (int64_t j = 0; j < group; ++j) {
        auto logits = at::matmul(q[h * group + j], k[h].t()) / std::sqrt(double(g.head_dim));
        s += at::softmax(logits.masked_fill(mask, -INFINITY), -1).sum(0);  // sum over queries
      }
      s = s / double(group) * v[h].norm(2, -1);
      s.slice(0, n - p.window).fill_(1e30);  // window protected
      auto ref = std::get<0>(std::get<1>(s.topk(keep)).sort());
      EXPECT_TRUE(at::equal(ref, r.positions[l][h])) << "layer " << l << " head " << h;
    }
  }
}

// A chunk that fails part-way and is replayed must leave no trace: H2O's column sums are staged
// per chunk and replaced by the replay (before the fix the retry found sums that already
// included the failed chunk and restarted from it, dropping the earlier chunks' attention; with
// a constant token budget the sizes could also line up and the chunk was counted twice).
TEST(Press, FailedChunkIsReplayedWithoutDoubleCounting) {
  Geometry g;
  const int64_t n = 160;
  const int64_t chunk = 32;  // 5 chunks
  LayerInputs in = RandomInputs(g, n, 21);
  struct Case {
    ScoreMethod method;
    ChunkPolicy policy;
    std::optional<int64_t> budget_tokens;
    ChunkFailure failure;
  };
  const Case cases[] = {
      {ScoreMethod::kH2O, ChunkPolicy::kLastChunk, std::nullopt, {1, 4, 1}},     // all layers
      {ScoreMethod::kH2O, ChunkPolicy::kLastChunk, std::nullopt, {2, 2, 1}},     // half of them
      {ScoreMethod::kH2OVl2, ChunkPolicy::kLastChunk, std::nullopt, {3, 3, 2}},  // twice
      {ScoreMethod::kH2O, ChunkPolicy::kLastChunk, std::nullopt, {4, 4, 1}},     // the last chunk
      {ScoreMethod::kH2O, ChunkPolicy::kEveryChunk, std::nullopt, {2, 4, 1}},
      {ScoreMethod::kH2OVl1, ChunkPolicy::kEveryChunk, 24, {3, 4, 1}},  // constant budget
      {ScoreMethod::kDropKV, ChunkPolicy::kEveryChunk, std::nullopt, {2, 4, 1}},
  };
  for (const Case& c : cases) {
    CompressionParams p;
    p.method = c.method;
    p.keep_ratio = 0.3;
    p.budget_tokens = c.budget_tokens;
    p.chunk_policy = c.policy;
    p.chunk_size = chunk;
    SCOPED_TRACE(absl::StrCat(std::string(ScoreMethodName(c.method)), " ",
                              std::string(ChunkPolicyName(c.policy)), " fail chunk ",
                              c.failure.chunk_idx, " after ", c.failure.num_layers_selected,
                              " layers x", c.failure.num_failures));
    SimResult clean = Simulate(*MakeSelector(p, g), g, in, n, chunk);
    SimResult replayed = Simulate(*MakeSelector(p, g), g, in, n, chunk, c.failure);
    for (int32_t l = 0; l < g.num_layers; ++l) {
      EXPECT_TRUE(at::equal(clean.positions[l], replayed.positions[l])) << "layer " << l;
    }
  }
  // The clean chunked H2O run equals the single pass under last_chunk (same sums, other order).
  CompressionParams p;
  p.method = ScoreMethod::kH2O;
  p.keep_ratio = 0.3;
  SimResult single = Simulate(*MakeSelector(p, g), g, in, n, 0);
  p.chunk_size = chunk;
  SimResult replayed = Simulate(*MakeSelector(p, g), g, in, n, chunk, {1, 4, 1});
  for (int32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_TRUE(at::equal(single.positions[l], replayed.positions[l])) << "layer " << l;
  }
}

// DropKV scored from the runner's window attention (DropKvScoresFromAttention) selects what
// DropKvScores selects from q, K, V alone: single pass and chunked, GQA 2, window < chunk and
// window > a short last chunk.
TEST(Press, DropKvFromPrefillAttentionEqualsScoresFromQkv) {
  Geometry g;
  const int64_t n = 203;
  LayerInputs in = RandomInputs(g, n, 11);
  for (ChunkPolicy policy : {ChunkPolicy::kLastChunk, ChunkPolicy::kEveryChunk}) {
    for (int64_t chunk : {int64_t{0}, int64_t{64}, int64_t{100}}) {
      CompressionParams p;
      p.method = ScoreMethod::kDropKV;
      p.keep_ratio = 0.2;
      p.window = 8;
      p.chunk_policy = policy;
      if (chunk > 0) p.chunk_size = chunk;
      SCOPED_TRACE(absl::StrCat("policy ", static_cast<int>(policy), " chunk ", chunk));
      SimResult from_qkv = Simulate(*MakeSelector(p, g), g, in, n, chunk);
      SimResult from_attn = Simulate(*MakeSelector(p, g), g, in, n, chunk, {}, true);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        EXPECT_TRUE(at::equal(from_qkv.positions[l], from_attn.positions[l])) << "layer " << l;
      }
    }
  }
  // Only DropKV asks for the rows; a malformed LSE is an error, so the path above was taken.
  CompressionParams p;
  p.method = ScoreMethod::kSnapKV;
  EXPECT_EQ(MakeSelector(p, g)->num_attention_rows(), 0);
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.2;
  auto sel = MakeSelector(p, g);
  EXPECT_EQ(sel->num_attention_rows(), p.window);
  LayerKvView view = OnePassView(g, in, n);
  AddWindowAttention(view, p.window);
  view.window_lse = view.window_lse.unsqueeze(-1);  // [Hq, w, 1]
  auto bad = sel->Select(view);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("lse"), std::string::npos) << bad.status();
}

// H2O scored from every chunk row's LSE (H2oScoresFromLse) selects what H2oScores selects from
// q and K alone: single pass and chunked (with a short last chunk), with and without ||v||_p.
TEST(Press, H2oFromPrefillLseEqualsScoresFromQk) {
  Geometry g;
  const int64_t n = 203;
  LayerInputs in = RandomInputs(g, n, 12);
  for (ScoreMethod method : {ScoreMethod::kH2O, ScoreMethod::kH2OVl1, ScoreMethod::kH2OVl2}) {
    for (int64_t chunk : {int64_t{0}, int64_t{64}}) {
      CompressionParams p;
      p.method = method;
      p.keep_ratio = 0.25;
      p.chunk_policy = ChunkPolicy::kEveryChunk;
      if (chunk > 0) p.chunk_size = chunk;
      SCOPED_TRACE(absl::StrCat(std::string(ScoreMethodName(method)), " chunk ", chunk));
      auto with_lse = MakeSelector(p, g);
      EXPECT_EQ(with_lse->num_attention_rows(), KvSelector::kAllAttentionRows);
      SimResult from_qk = Simulate(*MakeSelector(p, g), g, in, n, chunk);
      SimResult from_lse = Simulate(*with_lse, g, in, n, chunk, {}, true);
      for (int32_t l = 0; l < g.num_layers; ++l) {
        EXPECT_TRUE(at::equal(from_qk.positions[l], from_lse.positions[l])) << "layer " << l;
      }
    }
  }
  // The LSE path is taken: a wrong LSE changes the selection.
  CompressionParams p;
  p.method = ScoreMethod::kH2O;
  p.keep_ratio = 0.5;
  p.window = 8;
  auto sel = MakeSelector(p, g);
  LayerKvView view = OnePassView(g, in, n);
  auto plain = MakeSelector(p, g)->Select(view);
  AddWindowAttention(view, n);
  // Row i weighted e^(i / 5): the late rows' (recent) keys win.
  view.window_lse.sub_(at::arange(n, view.window_lse.options()) / 5.0);
  auto skewed = sel->Select(view);
  ASSERT_TRUE(plain.ok() && skewed.ok());
  EXPECT_FALSE(at::equal(**plain, **skewed));
}

TEST(Press, RandomIsSeededAndNoneKeepsEverything) {
  Geometry g;
  const int64_t n = 120;
  LayerInputs in = RandomInputs(g, n, 9);
  CompressionParams p;
  p.method = ScoreMethod::kRandom;
  p.keep_ratio = 0.5;
  p.random_seed = 42;
  auto a = Simulate(*MakeSelector(p, g), g, in, n, 0);
  auto b = Simulate(*MakeSelector(p, g), g, in, n, 0);
  p.random_seed = 43;
  auto c = Simulate(*MakeSelector(p, g), g, in, n, 0);
  EXPECT_TRUE(at::equal(a.positions[0], b.positions[0]));
  EXPECT_FALSE(at::equal(a.positions[0], c.positions[0]));
  p.method = ScoreMethod::kNone;
  auto none = Simulate(*MakeSelector(p, g), g, in, n, 0);
  for (const auto& pos : none.positions) EXPECT_EQ(pos.size(1), n);
  // n <= W: nothing evicted.
  p.method = ScoreMethod::kDropKV;
  auto tiny = Simulate(*MakeSelector(p, g), g, RandomInputs(g, 6, 1), 6, 0);
  for (const auto& pos : tiny.positions) EXPECT_EQ(pos.size(1), 6);
}

TEST(Press, BadSettingsAreErrorsNamingTheField) {
  Geometry g;
  auto expect_error = [&](const CompressionParams& p, const std::string& field) {
    auto s = CreateKvSelector(p, g.Info());
    ASSERT_FALSE(s.ok()) << field;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(field), std::string::npos) << s.status();
    EXPECT_FALSE(ValidateCompression(p, g.num_layers).ok());
  };
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.chunk_size = 4;
  expect_error(p, "chunk_size");
  p = {};
  p.method = ScoreMethod::kSnapKV;
  p.pooling_kernel = 4;
  expect_error(p, "pooling_kernel");
  p = {};
  p.method = ScoreMethod::kH2O;
  p.keep_ratio = 1.5;
  expect_error(p, "keep_ratio");
  p = {};
  p.method = ScoreMethod::kKNorm;
  p.chunk_policy = ChunkPolicy::kBudget;
  expect_error(p, "budget_cap_tokens");
  p = {};
  p.method = ScoreMethod::kDropKV;
  p.decode_margin = p.window - 1;  // fewer decode steps than W queries between evictions
  expect_error(p, "decode_margin");
  p.decode_margin = p.window;
  EXPECT_TRUE(ValidateCompression(p, g.num_layers).ok());
  p.method = ScoreMethod::kNone;  // nothing to compress with (a press for none keeps everything)
  EXPECT_NE(ValidateCompression(p, g.num_layers).message().find("decode_margin"),
            std::string::npos);
  p = {};
  p.method = ScoreMethod::kDropKV;
  p.allocator = BudgetAllocator::kMGA;
  expect_error(p, "profile");
  p.profile_path = "/nonexistent/profile.json";
  {
    // The press reads the file and names it; the validator reads no file (the server loads its
    // profile once at start-up: LoadProfileForModel), so it passes these settings.
    auto s = CreateKvSelector(p, g.Info());
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("/nonexistent/profile.json"), std::string::npos)
        << s.status();
    EXPECT_TRUE(ValidateCompression(p, g.num_layers).ok());
  }
  p = {};
  p.method = ScoreMethod::kDropKV;
  p.allocator = BudgetAllocator::kExplicit;
  p.explicit_layer_prune = {0.5, 0.5};
  expect_error(p, "explicit_layer_prune");
  EXPECT_NE(ParseScoreMethod("snap").status().message().find("snapkv"), std::string::npos);
  EXPECT_EQ(*ParseBudgetAllocator("mlma4"), BudgetAllocator::kMLMA4);
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kH2OVl2), "h2o_vl2");
  // A malformed view is an error, not a crash.
  p = {};
  p.method = ScoreMethod::kDropKV;
  auto sel = MakeSelector(p, g);
  LayerKvView bad;
  bad.layer_idx = 9;
  EXPECT_FALSE(sel->Select(bad).ok());
}

TEST(Press, KeptTokensPerLayerForAdmission) {
  CompressionParams p;
  p.method = ScoreMethod::kSnapKV;
  p.budget_tokens = 100;  // per layer on average
  auto kept = KeptTokensPerLayer(p, 6, 1000);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(std::accumulate(kept->begin(), kept->end(), int64_t{0}), 600);
  p.method = ScoreMethod::kNone;
  EXPECT_EQ(*KeptTokensPerLayer(p, 3, 50), (std::vector<int64_t>{50, 50, 50}));
}

}  // namespace
}  // namespace dropkv::compression
