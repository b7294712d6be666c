#include "engine/compression/press.h"

#include <ATen/ATen.h>

#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/compression/compression.h"
#include "engine/model/config.h"
#include "kernels/dropkv_score.h"
#include "kernels/scorers.h"
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

bool IsH2o(ScoreMethod m) {
  return m == ScoreMethod::kH2O || m == ScoreMethod::kH2OVl1 || m == ScoreMethod::kH2OVl2;
}

class KeepAllSelector final : public KvSelector {
 public:
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView&) override {
    return std::optional<at::Tensor>();
  }
};

// One sequence's press. Per-layer state lives in `layers_`, indexed by layer_idx.
class Press final : public KvSelector {
 public:
  Press(CompressionParams params, PressModelInfo model, PressOverrides overrides,
        std::optional<LayerProfile> profile)
      : params_(std::move(params)),
        model_(model),
        overrides_(overrides),
        profile_(std::move(profile)),
        layers_(model.num_layers) {}

  // DropKV scores from the prefill attention's window rows when the runner has them; H2O needs
  // the LSE of every chunk row (kernels::H2oScoresFromLse; the output rows are a free view).
  int64_t num_attention_rows() const override {
    if (IsH2o(params_.method)) return kAllAttentionRows;
    return params_.method == ScoreMethod::kDropKV ? params_.window : 0;
  }

  absl::StatusOr<std::vector<int64_t>> Budgets(int64_t logical_len) const override {
    absl::StatusOr<BudgetOptions> bo = ResolveBudgetOptions(params_, model_.num_layers, logical_len,
                                                            profile_ ? &*profile_ : nullptr);
    if (!bo.ok()) return bo.status();
    bo->rounding = overrides_.rounding;
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
  // H2O's attention mass per stored entry, kept transactionally: a chunk whose prefill fails
  // (RESOURCE_EXHAUSTED: the runner restores the cache and the scheduler replays the chunk later)
  // must not leave its column sums behind. The runner gives no commit call, so a chunk's sums are
  // staged under its logical range [start, end) and committed when the next chunk starts at
  // `end`; a chunk that starts at the staged `start` again is a replay and replaces them.
  struct H2oSums {
    at::Tensor sum;     // fp32 [Hkv, n_stored]: raw sums over every query of [0, end)
    int64_t start = 0;  // logical range of the chunk that produced `sum`
    int64_t end = 0;
  };
  struct LayerState {
    H2oSums committed;  // the cache as stored after the last chunk known to have succeeded
    H2oSums staged;     // the latest chunk, not yet known to have been stored
  };

  // The sums over the stored entries as of logical position `chunk_start` (commits or drops the
  // staged chunk first). Undefined when there is nothing to add to (first chunk, or a history that
  // does not match the runner's cache: the sums then restart from this chunk).
  static at::Tensor H2oBase(LayerState& state, int64_t chunk_start, int64_t n_prev) {
    if (state.staged.sum.defined()) {
      if (state.staged.end == chunk_start) {
        state.committed = std::move(state.staged);  // the next chunk began: the staged one stuck
      }
      state.staged = {};  // committed, or a replay / stale chunk: dropped either way
    }
    const H2oSums& c = state.committed;
    if (c.sum.defined() && c.end == chunk_start && c.sum.size(1) == n_prev) return c.sum;
    return {};
  }

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
    const int64_t chunk_len = v.queries.size(1);
    LayerState& state = layers_[v.layer_idx];
    // Batched views for the kernels: [1, H, ., D].
    const at::Tensor q = v.queries.unsqueeze(0);
    const at::Tensor k = v.keys.unsqueeze(0);
    const at::Tensor val = v.values.unsqueeze(0);

    if (IsH2o(params_.method)) {
      // Accumulate every chunk's attention, compressing or not (H2O sums over all prompt queries).
      kernels::H2oParams hp;  // raw sums; normalisation and V norm are applied at selection
      hp.scale = model_.attention_scale;
      // With every chunk row's LSE from the prefill attention, the column sums need no softmax
      // (and on CUDA no [rows, n] block).
      const bool have_lse = v.window_lse.defined() && v.window_lse.size(1) == chunk_len;
      absl::StatusOr<at::Tensor> s =
          have_lse ? kernels::H2oScoresFromLse(q, k, val, v.window_lse.unsqueeze(0), hp)
                   : kernels::H2oScores(q, k, val, hp);
      if (!s.ok()) return s.status();
      at::Tensor chunk_sum = (*s)[0];  // [Hkv, n]
      const int64_t n_prev = n - chunk_len;
      const int64_t chunk_start = v.logical_len - chunk_len;
      const at::Tensor base = H2oBase(state, chunk_start, n_prev);  // [Hkv, n_prev] or undefined
      if (base.defined()) chunk_sum.slice(1, 0, n_prev).add_(base);
      state.staged = {chunk_sum, chunk_start, v.logical_len};
    }
    if (!ShouldCompress(v, n)) return std::optional<at::Tensor>();

    absl::StatusOr<std::vector<int64_t>> budgets = Budgets(v.logical_len);
    if (!budgets.ok()) return budgets.status();
    const int64_t keep = std::min<int64_t>((*budgets)[v.layer_idx], n);
    if (keep >= n) return std::optional<at::Tensor>();
    if (keep < 1) return absl::InternalError("layer budget below 1 token");

    absl::StatusOr<at::Tensor> scores = Score(v, q, k, val, state, chunk_len);
    if (!scores.ok()) return scores.status();
    if (v.reduce_scores) {
      if (absl::Status s = v.reduce_scores(*scores); !s.ok()) return s;
    }

    kernels::SelectParams sp;
    sp.pool = kernels::PoolType::kPoolTypeNone;
    sp.window = overrides_.protect_window_all_methods ? params_.window : 0;
    sp.num_sinks = ProtectedSinks(params_);
    if (params_.method == ScoreMethod::kDropKV) {
      sp.pool = ToKernelPool(params_.pooling);
      sp.pool_kernel = params_.pooling_kernel;
      sp.window = params_.window;
    } else if (params_.method == ScoreMethod::kSnapKV) {
      sp.window = params_.window;  // SnapKvScores already lifted it; harmless
    }
    // Protection cannot cover more than the budget (n <= W is never compressed; keep >= W).
    sp.window = static_cast<int32_t>(std::min<int64_t>(sp.window, keep));
    sp.num_sinks = static_cast<int32_t>(std::min<int64_t>(sp.num_sinks, keep - sp.window));
    absl::StatusOr<at::Tensor> idx = kernels::SelectTopK(*scores, keep, sp);
    if (!idx.ok()) return idx.status();
    at::Tensor kept = (*idx)[0];  // int64 [Hkv, keep], ascending
    if (state.staged.sum.defined()) state.staged.sum = state.staged.sum.gather(1, kept);
    return std::optional<at::Tensor>(kept);
  }

  // fp32 [1, Hkv, n], higher = keep.
  absl::StatusOr<at::Tensor> Score(const LayerKvView& v, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& val, const LayerState& state,
                                   int64_t chunk_len) const {
    const int64_t n = k.size(2);
    const int64_t num_window = std::min<int64_t>({params_.window, chunk_len, n});
    const at::Tensor q_window = q.slice(2, chunk_len - num_window, chunk_len);  // [1, Hq, w, D]
    switch (params_.method) {
      case ScoreMethod::kDropKV: {
        kernels::DropKvParams dp;
        dp.scale = model_.attention_scale;
        // bf16/fp16 runs round p like the reference (algorithms.md section 1); fp32 does not.
        if (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) {
          dp.p_round_dtype = q.scalar_type();
        }
        // The runner's window rows cover ours when given (it slices min(W, chunk_len) <= n).
        const at::Tensor& attn = v.window_attn_out;
        if (attn.defined() && v.window_lse.defined() && attn.size(1) >= num_window) {
          const int64_t skip = attn.size(1) - num_window;
          return kernels::DropKvScoresFromAttention(
              q_window, k, val, attn.narrow(1, skip, num_window).unsqueeze(0),
              v.window_lse.narrow(1, skip, num_window).unsqueeze(0), dp);
        }
        return kernels::DropKvScores(q_window, k, val, dp);
      }
      case ScoreMethod::kSnapKV: {
        kernels::SnapKvParams sp;
        sp.pool_kernel = overrides_.snapkv_pool_kernel;
        sp.scale = model_.attention_scale;
        return kernels::SnapKvScores(q_window, k, sp);
      }
      case ScoreMethod::kH2O:
      case ScoreMethod::kH2OVl1:
      case ScoreMethod::kH2OVl2: {
        at::Tensor s = state.staged.sum.unsqueeze(0).clone();  // [1, Hkv, n]
        if (overrides_.h2o_divide_by_num_queries) {
          // Queries that saw entry j: every prompt position >= its position.
          at::Tensor count = (v.logical_len - v.positions).clamp_min(1).to(at::kFloat);
          s.div_(count.unsqueeze(0));
        }
        if (params_.method != ScoreMethod::kH2O) {
          const int p = params_.method == ScoreMethod::kH2OVl1 ? 1 : 2;
          s.mul_(at::linalg_vector_norm(val.to(at::kFloat), p, {-1}));
        }
        return s;
      }
      case ScoreMethod::kStreamingLLM:
        return kernels::StreamingLlmScores(k, params_.num_sinks);
      case ScoreMethod::kKNorm:
        return kernels::KNormScores(k);
      case ScoreMethod::kRandom:
        // Reproducible per (seed, layer, tokens seen).
        return kernels::RandomScores(k, params_.random_seed * 1000003ULL +
                                            static_cast<uint64_t>(v.layer_idx) * 7919ULL +
                                            static_cast<uint64_t>(v.logical_len));
      case ScoreMethod::kNone:
        break;
    }
    return absl::InternalError("no scorer for method none");
  }

  CompressionParams params_;
  PressModelInfo model_;
  PressOverrides overrides_;
  std::optional<LayerProfile> profile_;
  std::vector<LayerState> layers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelector(const CompressionParams& params,
                                                             const PressModelInfo& model,
                                                             const PressOverrides& overrides) {
  if (params.method == ScoreMethod::kNone) return std::make_unique<KeepAllSelector>();
  if (model.num_layers <= 0 || model.num_kv_heads <= 0 || model.num_q_heads <= 0 ||
      model.num_q_heads % model.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("model geometry: num_layers ", model.num_layers,
                                                   ", num_q_heads ", model.num_q_heads,
                                                   ", num_kv_heads ", model.num_kv_heads));
  }
  std::optional<LayerProfile> profile;
  if (overrides.profile != nullptr) {
    profile = *overrides.profile;
  } else if (!params.profile_path.empty()) {
    absl::StatusOr<LayerProfile> loaded = LoadLayerProfile(params.profile_path);
    if (!loaded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("profile_path: ", loaded.status().message()));
    }
    profile = std::move(*loaded);
  }
  // Validate with the loaded profile (ValidateCompression would re-read the file).
  {
    CompressionParams v = params;
    if (profile.has_value()) {
      absl::StatusOr<BudgetOptions> bo =
          ResolveBudgetOptions(params, model.num_layers, 0, &*profile);
      if (!bo.ok()) return bo.status();
      if (absl::Status s = ValidateBudgetOptions(*bo, model.num_layers); !s.ok()) return s;
      v.allocator = BudgetAllocator::kUniform;  // profile checked above
    }
    if (absl::Status s = ValidateCompression(v, model.num_layers); !s.ok()) return s;
  }
  return std::make_unique<Press>(params, model, overrides, std::move(profile));
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
  PressOverrides overrides;
  overrides.profile = profile;
  return CreateKvSelector(params, PressModelInfoFor(config), overrides);
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
