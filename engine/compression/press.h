// A press = scorer + budget allocator + selection policy, behind the runner's KvSelector hook
// (kv_selector.h). One press per sequence: it keeps per-layer state across prefill
// chunks (H2O's accumulated attention, staged per chunk so that a failed chunk's replay replaces
// rather than adds). Scoring and selection are the kernels'
// functions (kernels/dropkv_score.h, kernels/scorers.h, kernels/selection.h); this file decides
// which tokens, how many (budget.h) and when (chunk policy, algorithms.md section 5).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/compression/budget.h"
#include "engine/compression/kv_selector.h"
#include "engine/request.h"

namespace dropkv {
struct ModelConfig;
}

namespace dropkv::compression {

// The model geometry a press needs (a subset of the model config).
struct PressModelInfo {
  int32_t num_layers = 0;  // the layers the press compresses (a model's global layers)
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double attention_scale = 0;  // softmax scale of the logits the scorers rebuild (0 = 1/sqrt(D))
};

// Knobs beyond CompressionParams, for parity with other implementations. Defaults = our policy.
struct PressOverrides {
  // Keep the last W entries whatever the method (DropKV and SnapKV always protect them; for
  // H2O, K-norm, random and StreamingLLM this is our server policy, kvpress does not).
  bool protect_window_all_methods = true;
  // kvpress ObservedAttention divides the H2O sums by the number of queries that see each key.
  bool h2o_divide_by_num_queries = false;
  int32_t snapkv_pool_kernel = 5;  // kvpress SnapKVPress.kernel_size
  BudgetRounding rounding = BudgetRounding::kExactGlobal;
  // Precomputed profile for MGA / MLMA (skips reading params.profile_path).
  const LayerProfile* profile = nullptr;
};

// A KvSelector for `params` (validated here with ValidateCompression). kNone gives a selector that
// keeps everything.
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelector(const CompressionParams& params,
                                                             const PressModelInfo& model,
                                                             const PressOverrides& overrides = {});

// The geometry a press needs for `config`: its global layers (sliding-window layers keep their
// window whatever the request), their softmax scale, the head counts.
PressModelInfo PressModelInfoFor(const ModelConfig& config);

// A KvSelector for `config`'s layers: the runner's KvSelectorFactory
// (engine/runner/model_runner.h), as the tools bind it:
//   runner->SetKvSelectorFactory(&dropkv::compression::CreateKvSelectorForModel);
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorForModel(
    const CompressionParams& params, const ModelConfig& config);
// The same with the MGA / MLMA profile already loaded (no file is read): the engine's factory,
// bound to the server's profile (LoadProfileForModel, once at start-up).
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorWithProfile(
    const CompressionParams& params, const ModelConfig& config, const LayerProfile* profile);

// Reads the layer profile at `path` and checks it against the layers compression acts on in
// `config` (one finite value > 0 per layer). Errors start with "profile_path: " and name the file.
absl::StatusOr<LayerProfile> LoadProfileForModel(const std::string& path,
                                                 const ModelConfig& config);

}  // namespace dropkv::compression
