// Parity of our presses with kvpress 0.5.5 and of DropKV with an fp64 brute force of the spec
// (algorithms.md section 1), on the layer inputs of a tiny random HF Llama (kvpress_fixture.py).
//
// Convention mapping: kvpress compression_ratio cr = fraction removed -> keep_ratio = 1 - cr;
// kvpress keeps int(n * (1 - cr)) per layer (PyramidKV: round() of its per-layer formula),
// unsorted -> BudgetRounding::kKvpress and we compare sets. kvpress protects no window for
// K-norm, ObservedAttention and StreamingLLM -> protect_window_all_methods = false; its
// ObservedAttention divides by the number of queries that see each key. Both are
// bench/quality/kvpress_scorers.h's wrappers of our scorers.
//
// A kept-set difference is allowed only at a tie: the reference score of the differing index is
// within fp32 rounding (relative 1e-5, absolute 1e-8) of the reference's k-th largest score. The
// test counts them and fails above 0.5% of kept entries; any other difference fails.
#include <ATen/ATen.h>

#include <filesystem>
#include <iostream>
#include <set>

#include <gtest/gtest.h>

#include "bench/quality/kvpress_scorers.h"
#include "engine/compression/budget.h"
#include "engine/compression/press.h"
#include "kernels/dropkv_score.h"
#include "kernels/selection.h"
#include "tests/common/test_env.h"
#include "tests/compression/ref_data.h"

namespace dropkv::compression {
namespace {

namespace fs = std::filesystem;
using dropkv::testing::LoadBin;

fs::path FixtureDir() {
  return dropkv::testing::BuildDir() / "test-scratch" / "kvpress_parity";
}

struct Diff {
  int64_t num_kept = 0;
  int64_t num_tie_diffs = 0;
  int64_t num_other_diffs = 0;
};

// ours, ref: int64 [Hkv, k]; ref_scores: [Hkv, n] (higher = keep).
void CompareKept(const at::Tensor& ours, const at::Tensor& ref, const at::Tensor& ref_scores,
                 Diff* diff) {
  ASSERT_EQ(ours.sizes(), ref.sizes());
  const at::Tensor scores = ref_scores.to(at::kDouble);
  for (int64_t h = 0; h < ref.size(0); ++h) {
    auto a = ours[h].contiguous(), b = ref[h].contiguous();
    std::set<int64_t> sa(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + a.numel());
    std::set<int64_t> sb(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
    // Ours is sorted ascending, as the KvSelector contract says.
    for (int64_t i = 1; i < a.numel(); ++i)
      ASSERT_LT(a[i - 1].item<int64_t>(), a[i].item<int64_t>());
    const double kth = std::get<0>(scores[h].topk(ref.size(1)))[-1].item<double>();
    diff->num_kept += ref.size(1);
    auto classify = [&](int64_t j) {
      const double s = scores[h][j].item<double>();
      if (std::abs(s - kth) <= 1e-5 * std::abs(kth) + 1e-8) {
        ++diff->num_tie_diffs;
      } else {
        ++diff->num_other_diffs;
      }
    };
    for (int64_t j : sa)
      if (!sb.count(j)) classify(j);
    for (int64_t j : sb)
      if (!sa.count(j)) classify(j);
  }
}

class PressParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(FixtureDir() / "manifest.json")) {
      GTEST_SKIP() << "no kvpress fixture at " << FixtureDir()
                   << " (DROPKV_KVPRESS_PYTHON unset, or the fixture failed)";
    }
    manifest_ = dropkv::testing::LoadManifest(FixtureDir());
    model_.num_layers = manifest_["num_layers"];
    model_.num_q_heads = manifest_["num_q_heads"];
    model_.num_kv_heads = manifest_["num_kv_heads"];
    model_.head_dim = manifest_["head_dim"];
    n_ = manifest_["num_tokens"];
    for (const auto& l : manifest_["layers"]) {
      q_.push_back(LoadBin(FixtureDir(), l["q"], at::kFloat));
      k_.push_back(LoadBin(FixtureDir(), l["k"], at::kFloat));
      v_.push_back(LoadBin(FixtureDir(), l["v"], at::kFloat));
    }
  }

  LayerKvView View(int32_t layer) const {
    LayerKvView v;
    v.layer_idx = layer;
    v.num_layers = model_.num_layers;
    v.logical_len = n_;
    v.queries = q_[layer];
    v.keys = k_[layer];
    v.values = v_[layer];
    v.positions = at::arange(n_, at::kLong).expand({k_[layer].size(0), n_}).contiguous();
    return v;
  }

  nlohmann::json manifest_;
  PressModelInfo model_;
  int64_t n_ = 0;
  std::vector<at::Tensor> q_, k_, v_;
};

TEST_F(PressParity, KvpressPressesKeepTheSameTokens) {
  int num_cases = 0;
  for (const auto& entry : manifest_["presses"]) {
    const std::string press = entry["press"];
    const double cr = entry["compression_ratio"];
    SCOPED_TRACE(press + " cr=" + std::to_string(cr));
    CompressionParams p;
    p.keep_ratio = *KeepRatioFromCompressionRatio(cr);
    p.window = manifest_["window"];
    quality::KvpressOptions o;
    o.protect_window_all_methods = false;
    o.rounding = BudgetRounding::kKvpress;
    if (press == "snapkv") {
      p.method = ScoreMethod::kSnapKV;
    } else if (press == "pyramidkv") {
      p.method = ScoreMethod::kSnapKV;
      p.allocator = BudgetAllocator::kPyramid;
    } else if (press == "streaming_llm") {
      p.method = ScoreMethod::kStreamingLLM;
      p.num_sinks = 4;
    } else if (press == "knorm") {
      p.method = ScoreMethod::kKNorm;
    } else if (press == "observed_attention") {
      p.method = ScoreMethod::kH2O;
      o.h2o_divide_by_num_queries = true;
    } else {
      FAIL() << "unknown press " << press;
    }
    auto selector = quality::CreateKvpressSelector(p, model_, o);
    ASSERT_TRUE(selector.ok()) << selector.status();
    Diff diff;
    for (int32_t l = 0; l < model_.num_layers; ++l) {
      auto kept = (*selector)->Select(View(l));
      ASSERT_TRUE(kept.ok()) << kept.status();
      ASSERT_TRUE(kept->has_value()) << "layer " << l << " kept everything";
      const auto& ref_layer = entry["layers"][l];
      at::Tensor ref = LoadBin(FixtureDir(), ref_layer["kept"], at::kLong);
      at::Tensor ref_scores = LoadBin(FixtureDir(), ref_layer["scores"], at::kFloat);
      if (press != "pyramidkv") {
        EXPECT_EQ(ref.size(1), static_cast<int64_t>(n_ * (1.0 - cr)));  // kvpress's int(n(1-cr))
      }
      CompareKept(**kept, ref, ref_scores, &diff);
    }
    std::cout << press << " cr=" << cr << ": " << diff.num_kept << " kept, " << diff.num_tie_diffs
              << " tie differences, " << diff.num_other_diffs << " other\n";
    EXPECT_EQ(diff.num_other_diffs, 0) << "differences that are not score ties";
    EXPECT_LE(diff.num_tie_diffs, 0.005 * diff.num_kept)
        << diff.num_tie_diffs << " tie differences of " << diff.num_kept;
    ++num_cases;
  }
  EXPECT_EQ(num_cases, 15);  // 5 presses x 3 ratios
}

TEST_F(PressParity, DropKvMatchesFp64BruteForce) {
  int num_cases = 0;
  for (const auto& entry : manifest_["dropkv"]) {
    const double keep = entry["keep_ratio"];
    const int lookback = entry["pooling_lookback"];
    SCOPED_TRACE("keep=" + std::to_string(keep) + " lookback=" + std::to_string(lookback));
    CompressionParams p;
    p.method = ScoreMethod::kDropKV;
    p.keep_ratio = keep;
    p.window = manifest_["window"];
    p.pooling = PoolingType::kMax;
    p.pooling_kernel = 11;
    p.pooling_lookback = lookback;
    auto selector = CreateKvSelector(p, model_);
    ASSERT_TRUE(selector.ok()) << selector.status();
    Diff diff;
    for (int32_t l = 0; l < model_.num_layers; ++l) {
      auto kept = (*selector)->Select(View(l));
      ASSERT_TRUE(kept.ok()) << kept.status();
      ASSERT_TRUE(kept->has_value());
      // The kernels' CPU reference on the same layer inputs: identical kept sets.
      auto ref_scores = kernels::DropKvScores(q_[l].slice(1, n_ - p.window).unsqueeze(0),
                                              k_[l].unsqueeze(0), v_[l].unsqueeze(0));
      ASSERT_TRUE(ref_scores.ok()) << ref_scores.status();
      kernels::SelectParams sp;  // max pooling 11, window 8
      sp.pool_lookback = lookback;
      auto ref_idx = kernels::SelectTopK(*ref_scores, (**kept).size(1), sp);
      ASSERT_TRUE(ref_idx.ok());
      EXPECT_TRUE(at::equal((*ref_idx)[0], **kept)) << "layer " << l;
      const auto& ref_layer = entry["layers"][l];
      CompareKept(**kept, LoadBin(FixtureDir(), ref_layer["kept"], at::kLong),
                  LoadBin(FixtureDir(), ref_layer["scores"], at::kFloat), &diff);
    }
    std::cout << "dropkv keep=" << keep << " lookback " << lookback << ": " << diff.num_kept
              << " kept, " << diff.num_tie_diffs << " tie differences, " << diff.num_other_diffs
              << " other\n";
    EXPECT_EQ(diff.num_other_diffs, 0);
    EXPECT_LE(diff.num_tie_diffs, 0.005 * diff.num_kept);
    ++num_cases;
  }
  EXPECT_EQ(num_cases, 6);  // lookback 0 and 32 x 3 keep ratios
}

}  // namespace
}  // namespace dropkv::compression
