// DropKV inside the real runner on CUDA (bf16, flash prefill): the scores taken from the prefill
// attention's window rows (DropKvScoresFromAttention) keep what the three-pass scores from q, K,
// V keep, in one pass and chunked (every_chunk and last_chunk); the runner hands the rows over
// only to a selector that asks for them. Label gpu: skipped without a CUDA device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <span>

#include "absl/strings/str_cat.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "kernels/dropkv_score.h"
#include "tests/common/test_env.h"

namespace dropkv::compression {
namespace {

// A small Llama at the served geometry's head shape: GQA 4:1, head_dim 128; random weights.
std::string TinyLlamaDir() {
  return testing::WriteTinyLlamaConfig(
      "press_gpu", {.hidden = 1024, .intermediate = 2048, .head_dim = 128, .max_positions = 8192});
}

// Forwards to the press; `hide_rows` makes the runner hand it no attention rows (so it scores
// from q, K, V alone). Counts the calls that did get them.
class RowsSwitch final : public KvSelector {
 public:
  RowsSwitch(std::unique_ptr<KvSelector> inner, bool hide_rows, int* calls_with_rows)
      : inner_(std::move(inner)), hide_rows_(hide_rows), calls_with_rows_(calls_with_rows) {}
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    if (view.window_attn_out.defined()) {
      ++*calls_with_rows_;
      const int64_t rows = std::min<int64_t>(inner_->num_attention_rows(), view.queries.size(1));
      EXPECT_EQ(view.window_attn_out.sizes(),
                (at::IntArrayRef{view.queries.size(0), rows, view.queries.size(2)}));
      EXPECT_EQ(view.window_lse.sizes(), (at::IntArrayRef{view.queries.size(0), rows}));
      // The scores from the handed-over rows vs the three passes' own, on this very view.
      const int64_t chunk = view.queries.size(1);
      auto q_window = view.queries.slice(1, chunk - rows, chunk).unsqueeze(0);
      kernels::DropKvParams dp;
      dp.p_round_dtype = view.queries.scalar_type();
      auto own =
          kernels::DropKvScores(q_window, view.keys.unsqueeze(0), view.values.unsqueeze(0), dp);
      auto given = kernels::DropKvScoresFromAttention(
          q_window, view.keys.unsqueeze(0), view.values.unsqueeze(0),
          view.window_attn_out.unsqueeze(0), view.window_lse.unsqueeze(0), dp);
      EXPECT_TRUE(own.ok() && given.ok());
      if (own.ok() && given.ok()) {
        // Relative to each head's largest score (scores span orders of magnitude).
        auto rel = (*given - *own).abs() / own->amax(-1, /*keepdim=*/true);
        max_rel_diff_ = std::max(max_rel_diff_, rel.max().item<double>());
        num_scores_ += rel.numel();
        num_off_ += (rel > 1e-2).sum().item<int64_t>();
      }
    }
    return inner_->Select(view);
  }
  int64_t num_attention_rows() const override {
    return hide_rows_ ? 0 : inner_->num_attention_rows();
  }
  static double max_rel_diff() { return max_rel_diff_; }
  // Fraction of scores more than 1% of their head's largest away from the three-pass ones.
  static double fraction_off() { return num_scores_ ? double(num_off_) / num_scores_ : 0.0; }

 private:
  std::unique_ptr<KvSelector> inner_;
  bool hide_rows_;
  int* calls_with_rows_;
  static inline double max_rel_diff_ = 0;  // over every call with rows
  static inline int64_t num_scores_ = 0, num_off_ = 0;
};

std::unique_ptr<ModelRunner> CudaRunner(bool hide_rows, int* calls_with_rows) {
  RunnerOptions o;
  o.model_dir = TinyLlamaDir();
  o.device = "cuda";
  o.dtype = "bfloat16";
  o.random_weights = true;
  o.random_seed = 11;
  o.num_kv_blocks = 2048;
  auto r = ModelRunner::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  (*r)->SetKvSelectorFactory(
      [hide_rows, calls_with_rows](
          const CompressionParams& p,
          const ModelConfig& config) -> absl::StatusOr<std::unique_ptr<KvSelector>> {
        auto inner = CreateKvSelectorForModel(p, config);
        if (!inner.ok()) return inner.status();
        return std::make_unique<RowsSwitch>(std::move(*inner), hide_rows, calls_with_rows);
      });
  return std::move(*r);
}

std::vector<int32_t> Prompt(int64_t n) {
  std::vector<int32_t> ids(n);
  uint64_t x = 5;
  for (auto& t : ids) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t = static_cast<int32_t>(3 + (x >> 33) % 500);
  }
  return ids;
}

TEST(PressGpu, DropKvFromPrefillAttentionKeepsWhatThreePassKeeps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 1500;
  const auto prompt = Prompt(n);
  struct Run {
    ChunkPolicy policy;
    int64_t chunk;  // 0 = one pass
  };
  for (const Run& run : {Run{ChunkPolicy::kLastChunk, 0}, Run{ChunkPolicy::kEveryChunk, 512},
                         Run{ChunkPolicy::kLastChunk, 400}}) {
    SCOPED_TRACE(absl::StrCat("policy ", static_cast<int>(run.policy), " chunk ", run.chunk));
    CompressionParams p;
    p.method = ScoreMethod::kDropKV;
    p.keep_ratio = 0.1;
    p.window = 32;
    p.chunk_policy = run.policy;
    p.chunk_size = static_cast<int32_t>(run.chunk);
    int calls_with_rows[2] = {0, 0};
    std::vector<std::vector<at::Tensor>> kept(2);
    for (int hide = 0; hide < 2; ++hide) {
      auto runner = CudaRunner(hide == 1, &calls_with_rows[hide]);
      ASSERT_NE(runner, nullptr);
      const int64_t chunk = run.chunk > 0 ? run.chunk : n;
      for (int64_t s = 0; s < n; s += chunk) {
        std::span<const int32_t> c(prompt.data() + s, static_cast<size_t>(std::min(chunk, n - s)));
        auto logits = runner->Prefill(1, c, s + chunk >= n, p);
        ASSERT_TRUE(logits.ok()) << logits.status();
      }
      for (int32_t l = 0; l < runner->config().num_layers; ++l) {
        auto pos = runner->StoredPositions(1, l);
        ASSERT_TRUE(pos.ok()) << pos.status();
        kept[hide].push_back(pos->to(at::kCPU));
      }
    }
    EXPECT_GT(calls_with_rows[0], 0);  // the flash path gave the rows
    EXPECT_EQ(calls_with_rows[1], 0);  // and nothing was sliced for a selector that did not ask
    // The two scorers differ only in the window rows' attention (flash's bf16 output and fp32
    // LSE vs the kernel's own pass 1). p is rounded to bf16 before w = (p / (1 - p))^2, so a
    // last-bit change of p near 1 moves one score a lot: bound the fraction of scores off by
    // more than 1% of their head's largest, not the maximum.
    std::printf("|FromAttention - DropKvScores| / head max: max %.3g, fraction > 1e-2: %.3g\n",
                RowsSwitch::max_rel_diff(), RowsSwitch::fraction_off());
    EXPECT_LT(RowsSwitch::fraction_off(), 1e-2);
    // Near-ties at the budget edge may flip (layer 0 of this random-weight model attends almost
    // uniformly, so its scores crowd; seen on the H200: 0.89 there, 0.99-1.0 in later layers):
    // most kept entries must agree per head.
    for (size_t l = 0; l < kept[0].size(); ++l) {
      const at::Tensor& a = kept[0][l];  // int64 [Hkv, keep], ascending
      const at::Tensor& b = kept[1][l];
      ASSERT_EQ(a.sizes(), b.sizes()) << "layer " << l;
      for (int64_t h = 0; h < a.size(0); ++h) {
        const double common = at::isin(a[h], b[h]).sum().item<double>();
        const double overlap = common / static_cast<double>(a.size(1));
        std::printf("policy %d chunk %ld layer %zu head %ld: kept %ld, overlap %.4f\n",
                    static_cast<int>(run.policy), run.chunk, l, h, a.size(1), overlap);
        EXPECT_GE(overlap, 0.85) << "layer " << l << " head " << h;
      }
    }
  }
}

}  // namespace
}  // namespace dropkv::compression
