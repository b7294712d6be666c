// A press = scorer (scorer.h, one file per method in scorers/) + budget allocator + selection
// policy, behind the runner's KvSelector hook (kv_selector.h). One press per sequence. Scoring and
// selection are the kernels' functions (kernels/dropkv_score.h, kernels/scorers.h,
// kernels/selection.h); the press decides how many (budget.h) and when (chunk policy,
// algorithms.md section 5).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/compression/budget.h"
#include "engine/compression/kv_selector.h"
#include "engine/compression/scorer.h"
#include "engine/request.h"

namespace dropkv {
struct ModelConfig;
}

namespace dropkv::compression {

// A KvSelector for `params` (validated here with ValidateCompression) with params.method's scorer.
// kNone gives a selector that keeps everything. `profile`: the MGA / MLMA profile already loaded
// (null: params.profile_path is read).
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelector(const CompressionParams& params,
                                                             const PressModelInfo& model,
                                                             const LayerProfile* profile = nullptr);

// The same with a scorer of the caller's instead of params.method's (bench and tests build other
// implementations' variants this way) and the budgets rounded by `rounding`.
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvSelectorWithScorer(
    const CompressionParams& params, const PressModelInfo& model, std::unique_ptr<Scorer> scorer,
    BudgetRounding rounding = BudgetRounding::kExactGlobal, const LayerProfile* profile = nullptr);

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
