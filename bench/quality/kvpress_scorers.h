// kvpress's variants of our presses, for the quality bench and the parity tests. Production
// presses (engine/compression/press.h) follow the server's policy; where kvpress 0.5.5 differs,
// these wrap our scorers instead of switching inside the press.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/compression/budget.h"
#include "engine/compression/press.h"
#include "engine/compression/scorer.h"
#include "engine/request.h"

namespace dropkv::quality {

struct KvpressOptions {
  // H2O methods scored as kvpress's ObservedAttentionPress (MakeObservedAttentionScorer).
  bool h2o_divide_by_num_queries = false;
  // kvpress protects the last W entries only for DropKV and SnapKV; the server for every method.
  bool protect_window_all_methods = true;
  compression::BudgetRounding rounding = compression::BudgetRounding::kExactGlobal;
};

// H2O (params.method kH2O, kH2OVl1 or kH2OVl2) as kvpress ObservedAttention scores it: each
// entry's attention sum divided by the number of prompt queries that see it, then weighted by
// the value norm for the VL variants.
absl::StatusOr<std::unique_ptr<compression::Scorer>> MakeObservedAttentionScorer(
    const CompressionParams& params, const compression::PressModelInfo& model);

// A press for `params` with `options`; the defaults give compression::CreateKvSelector's press.
absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvpressSelector(
    const CompressionParams& params, const compression::PressModelInfo& model,
    const KvpressOptions& options = {});

}  // namespace dropkv::quality
