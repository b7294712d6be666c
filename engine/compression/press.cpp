#include "engine/compression/press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/compression/compression.h"
#include "engine/model/config.h"
#include "kernels/selection.h"

namespace dropkv::compression {
namespace {

kernels::PoolType ToKernelPool(PoolingType p) {
  switch (p) {
    case PoolingType::kMax:
      return kernels::PoolType::kPoolTypeMax;
    case PoolingType::kAvg:
      return kernels::PoolType::kPoolTypeAvg;
    case PoolingType::kNone:
      return kernels::PoolType::kPoolTypeNone;
  }
  return kernels::PoolType::kPoolTypeNone;
}

class KeepAllSelector final : public KvSelector {
 public:
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView&) override {
    return std::optional<at::Tensor>();
  }
};

// One sequence's press: its scorer rates the entries, the press decides when (chunk policy), how
// many (budgets) and which (top-k with the scorer's protection and the sinks).
class Press final : public KvSelector {
 public:
  Press(CompressionParams params, PressModelInfo model, std::unique_ptr<Scorer> scorer,
        BudgetRounding rounding, std::optional<LayerProfile> profile)
      : params_(std::move(params)),
        model_(model),
        scorer_(std::move(scorer)),
        rounding_(rounding),
        profile_(std::move(profile)) {}

  int64_t num_attention_rows() const override { return scorer_->num_attention_rows(); }

  absl::StatusOr<std::vector<int64_t>> Budgets(int64_t logical_len) const override {
    absl::StatusOr<BudgetOptions> bo = ResolveBudgetOptions(params_, model_.num_layers, logical_len,
                                                            profile_ ? &*profile_ : nullptr);
    if (!bo.ok()) return bo.status();
    bo->rounding = rounding_;
    return AllocateLayerBudgets(*bo, model_.num_layers, logical_len);
  }

  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override {
    try {
      return SelectImpl(view);
    } catch (const std::exception& e) {  // ATen errors stop here
      return absl::InternalError(
          absl::StrCat("compression of layer ", view.layer_idx, ": ", e.what()));
    }
  }

 private:
  absl::Status CheckView(const LayerKvView& v) const {
    if (v.layer_idx < 0 || v.layer_idx >= model_.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer_idx ", v.layer_idx, " out of [0, ", model_.num_layers, ")"));
    }
    if (!v.keys.defined() || v.keys.dim() != 3 || !v.values.defined() ||
        v.values.sizes() != v.keys.sizes()) {
      return absl::InvalidArgumentError("LayerKvView: keys and values must be [Hkv, n, D]");
    }
    if (!v.queries.defined() || v.queries.dim() != 3 || v.queries.size(2) != v.keys.size(2) ||
        v.queries.size(0) % v.keys.size(0) != 0 || v.queries.size(1) > v.keys.size(1)) {
      return absl::InvalidArgumentError(
          "LayerKvView: queries must be [Hq, chunk_len, D] with Hq % Hkv == 0, chunk_len <= n");
    }
    return absl::OkStatus();
  }

  // Whether this call compresses (algorithms.md section 5).
  bool ShouldCompress(const LayerKvView& v, int64_t n) const {
    switch (params_.chunk_policy) {
      case ChunkPolicy::kLastChunk:
        return v.is_last_chunk;
      case ChunkPolicy::kEveryChunk:
        return true;
      case ChunkPolicy::kBudget:
        return v.is_last_chunk ||
               n + std::max<int64_t>(params_.chunk_size, 1) > params_.budget_cap_tokens;
    }
    return true;
  }

  absl::StatusOr<std::optional<at::Tensor>> SelectImpl(const LayerKvView& v) {
    if (absl::Status s = CheckView(v); !s.ok()) return s;
    const int64_t n = v.keys.size(1);
    // Batched views for the kernels: [1, H, ., D].
    const ScorerInput in{v, v.queries.unsqueeze(0), v.keys.unsqueeze(0), v.values.unsqueeze(0),
                         v.queries.size(1)};
    const bool replay = params_.scoring_queries == ScoringQueries::kReplay;
    if (replay) {
      // The prompt's chunks store everything; the replay's sum scores the prompt's entries.
      replay_scores_.resize(model_.num_layers);
      if (v.pass == LayerKvView::Pass::kPrompt) {
        if (v.is_last_chunk) replay_scores_[v.layer_idx] = at::Tensor();  // a new replay follows
        return std::optional<at::Tensor>();
      }
      if (v.pass == LayerKvView::Pass::kReplay) {
        absl::StatusOr<at::Tensor> part = scorer_->ReplayScore(in, v.replayed_len);
        if (!part.ok()) return part.status();
        at::Tensor& sum = replay_scores_[v.layer_idx];
        sum = sum.defined() ? sum.add_(*part) : *part;
        return std::optional<at::Tensor>();
      }
    } else {
      if (v.pass != LayerKvView::Pass::kPrompt) {
        return absl::InvalidArgumentError("LayerKvView: a replay pass for a window press");
      }
      if (absl::Status s = scorer_->Observe(in); !s.ok()) return s;
      if (!ShouldCompress(v, n)) return std::optional<at::Tensor>();
    }

    absl::StatusOr<std::vector<int64_t>> budgets = Budgets(v.logical_len);
    if (!budgets.ok()) return budgets.status();
    int64_t keep = std::min<int64_t>((*budgets)[v.layer_idx], n);
    const bool automatic = params_.tolerance > 0;  // the budget is a ceiling
    if (keep >= n && !automatic) return std::optional<at::Tensor>();
    if (keep < 1) return absl::InternalError("layer budget below 1 token");

    absl::StatusOr<at::Tensor> scores =
        replay ? ReplayedScores(v.layer_idx, n) : scorer_->Score(in);
    if (!scores.ok()) return scores.status();
    if (v.reduce_scores) {
      if (absl::Status s = v.reduce_scores(*scores); !s.ok()) return s;
    }

    const SelectionRule rule = scorer_->Selection();
    kernels::SelectParams sp;
    sp.pool = ToKernelPool(rule.pooling);
    if (rule.pooling != PoolingType::kNone) sp.pool_kernel = rule.pooling_kernel;
    sp.pool_lookback = rule.pooling_lookback;
    // Protection cannot cover more than the budget (n <= W is never compressed; keep >= W).
    sp.window = static_cast<int32_t>(std::min<int64_t>(rule.window, keep));
    sp.num_sinks =
        static_cast<int32_t>(std::min<int64_t>(ProtectedSinks(params_), keep - sp.window));
    if (automatic) {
      absl::StatusOr<int64_t> fewest = FewestWithinTolerance(in, *scores, sp);
      if (!fewest.ok()) return fewest.status();
      const int64_t floor = std::min<int64_t>(n, rule.window + ProtectedSinks(params_));
      keep = std::clamp(*fewest, floor, keep);
      if (keep >= n) return std::optional<at::Tensor>();
    }
    absl::StatusOr<at::Tensor> idx = kernels::SelectTopK(*scores, keep, sp);
    if (!idx.ok()) return idx.status();
    at::Tensor kept = (*idx)[0];  // int64 [Hkv, keep], ascending
    scorer_->Kept(v.layer_idx, kept);
    return std::optional<at::Tensor>(kept);
  }

  // The automatic budget: the fewest entries a layer keeps, in selection's order (pooled, the
  // window and sinks first), so that the entries it evicts carry at most tolerance^2 of the
  // window's output energy in DropKV score, on every KV head (and every rank's). One host sync.
  absl::StatusOr<int64_t> FewestWithinTolerance(const ScorerInput& in, const at::Tensor& scores,
                                                const kernels::SelectParams& sp) {
    absl::StatusOr<at::Tensor> energy = scorer_->OutputEnergy(in);  // [1, Hkv]
    if (!energy.ok()) return energy.status();
    absl::StatusOr<at::Tensor> ranked =
        kernels::PoolScores(scores, sp.pool, sp.pool_kernel, sp.pool_lookback);
    if (!ranked.ok()) return ranked.status();
    at::Tensor order_by = ranked->is_same(scores) ? ranked->clone() : *ranked;
    if (absl::Status s = kernels::ProtectScores(order_by, sp.window, sp.num_sinks); !s.ok()) {
      return s;
    }
    const at::Tensor order = std::get<1>(order_by.sort(-1, /*descending=*/true));
    // evicted_from[i]: the score of every entry ranked i or lower (what keeping i evicts).
    const at::Tensor evicted_from = scores.gather(-1, order).flip(-1).cumsum(-1).flip(-1);
    const at::Tensor limit = energy->unsqueeze(-1) * (params_.tolerance * params_.tolerance);
    int64_t fewest = (evicted_from > limit).sum(-1).max().item<int64_t>();
    if (in.view.max_over_ranks) {
      absl::StatusOr<int64_t> agreed = in.view.max_over_ranks(fewest);
      if (!agreed.ok()) return agreed.status();
      fewest = *agreed;
    }
    return fewest;
  }

  // A layer's summed replay scores (kReplaySelect), moved out: one selection per replay.
  absl::StatusOr<at::Tensor> ReplayedScores(int32_t layer_idx, int64_t n) {
    if (static_cast<size_t>(layer_idx) >= replay_scores_.size() ||
        !replay_scores_[layer_idx].defined() || replay_scores_[layer_idx].size(2) != n) {
      return absl::FailedPreconditionError(
          absl::StrCat("replay scoring: no replay scores for layer ", layer_idx, "'s ", n,
                       " entries (the runner selects after the prompt's replay)"));
    }
    return std::move(replay_scores_[layer_idx]);
  }

  CompressionParams params_;
  PressModelInfo model_;
  std::unique_ptr<Scorer> scorer_;
  BudgetRounding rounding_;
  std::optional<LayerProfile> profile_;
  std::vector<at::Tensor> replay_scores_;  // [layer] fp32 [1, Hkv, prompt entries]
};

// Checks `params` against `model` and loads the profile MGA / MLMA need (`profile` when given,
// else params.profile_path's file).
absl::StatusOr<std::optional<LayerProfile>> CheckAndLoadProfile(const CompressionParams& params,
                                                                const PressModelInfo& model,
                                                                const LayerProfile* given) {
  if (model.num_layers <= 0 || model.num_kv_heads <= 0 || model.num_q_heads <= 0 ||
      model.num_q_heads % model.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model geometry: num_layers ", model.num_layers,
                                                   ", num_q_heads ", model.num_q_heads,
                                                   ", num_kv_heads ", model.num_kv_heads));
  }
  std::optional<LayerProfile> profile;
  if (given != nullptr) {
    profile = *given;
  } else if (!params.profile_path.empty()) {
    absl::StatusOr<LayerProfile> loaded = LoadLayerProfile(params.profile_path);
    if (!loaded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("profile_path: ", loaded.status().message()));
    }
    profile = std::move(*loaded);
  }
  // Validate with the loaded profile (ValidateCompression would re-read the file).
  CompressionParams v = params;
  if (profile.has_value()) {
    absl::StatusOr<BudgetOptions> bo = ResolveBudgetOptions(params, model.num_layers, 0, &*profile);
    if (!bo.ok()) return bo.status();
    if (absl::Status s = ValidateBudgetOptions(*bo, model.num_layers); !s.ok()) return s;
    v.allocator = BudgetAllocator::kUniform;  // profile checked above
  }
  if (absl::Status s = ValidateCompression(v, model.num_layers); !s.ok()) return s;
  return profile;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelector(const CompressionParams& params,
                                                             const PressModelInfo& model,
                                                             const LayerProfile* profile) {
  if (params.method == ScoreMethod::kNone) return std::make_unique<KeepAllSelector>();
  absl::StatusOr<std::optional<LayerProfile>> loaded = CheckAndLoadProfile(params, model, profile);
  if (!loaded.ok()) return loaded.status();
  absl::StatusOr<std::unique_ptr<Scorer>> scorer = CreateScorer(params, model);
  if (!scorer.ok()) return scorer.status();
  return std::make_unique<Press>(params, model, std::move(*scorer), BudgetRounding::kExactGlobal,
                                 std::move(*loaded));
}

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorWithScorer(
    const CompressionParams& params, const PressModelInfo& model, std::unique_ptr<Scorer> scorer,
    BudgetRounding rounding, const LayerProfile* profile) {
  if (params.method == ScoreMethod::kNone) return std::make_unique<KeepAllSelector>();
  if (scorer == nullptr) return absl::InvalidArgumentError("CreateKvSelectorWithScorer: no scorer");
  absl::StatusOr<std::optional<LayerProfile>> loaded = CheckAndLoadProfile(params, model, profile);
  if (!loaded.ok()) return loaded.status();
  return std::make_unique<Press>(params, model, std::move(scorer), rounding, std::move(*loaded));
}

PressModelInfo PressModelInfoFor(const ModelConfig& config) {
  PressModelInfo info;
  // Sliding-window layers keep their window whatever the request: budgets are the global layers'.
  info.num_layers = config.num_global_layers();
  // (Uniform over the global layers: only a sliding layer's RoPE can differ, and it is not here.)
  for (int32_t l = 0; l < config.num_layers; ++l) {
    if (!config.is_sliding(l)) {
      info.attention_scale = config.attention_scale(l);
      break;
    }
  }
  info.num_q_heads = config.num_heads;
  info.num_kv_heads = config.num_kv_heads;
  info.head_dim = config.head_dim;
  return info;
}

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorForModel(
    const CompressionParams& params, const ModelConfig& config) {
  return CreateKvSelectorWithProfile(params, config, nullptr);
}

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorWithProfile(
    const CompressionParams& params, const ModelConfig& config, const LayerProfile* profile) {
  if (params.method != ScoreMethod::kNone && config.num_global_layers() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compression: every layer of this model attends through a sliding window of ",
                     config.sliding_window, " tokens; there is no growing cache to compress"));
  }
  return CreateKvSelector(params, PressModelInfoFor(config), profile);
}

absl::StatusOr<LayerProfile> LoadProfileForModel(const std::string& path,
                                                 const ModelConfig& config) {
  absl::StatusOr<LayerProfile> profile = LoadLayerProfile(path);
  if (!profile.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("profile_path: ", profile.status().message()));
  }
  BudgetOptions check;
  check.allocator = BudgetAllocator::kMGA;
  check.profile_values = profile->values;
  const int32_t num_layers = PressModelInfoFor(config).num_layers;
  if (absl::Status s = ValidateBudgetOptions(check, num_layers); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(s.message(), " (", path, ")"));
  }
  return profile;
}

}  // namespace dropkv::compression
