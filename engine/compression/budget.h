// DepthKV per-layer budgets (algorithms.md section 4): how many tokens each layer keeps of the n
// a sequence has seen. Pure integer/float math, no tensors, so the scheduler's admission control
// can call it cheaply.
//
// Canonical budget form: keep ratio (fraction kept). A compression ratio (kvpress convention,
// fraction removed) and an absolute per-layer-average token budget convert at the edge with the
// helpers below.
//
// Exact global budget (default): sum_l keep_l == max(round(L * keep * n), L * min_keep) with
// largest-remainder rounding, where min_keep = min(n, W + protected sinks) is the per-layer floor
// (the protected window is never evicted, as in the DropKV reference's max(floor(keep*n), W)).
// n <= W: no eviction, every layer keeps n.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/request.h"

namespace dropkv::compression {

// How real-valued layer shares become integers.
enum class BudgetRounding {
  kExactGlobal,  // largest remainder, sum is exact (our default)
  kKvpress,      // kvpress 0.5.5: uniform int(n * keep) floored at 1; pyramid round-half-even per
                 // layer; no W floor. Only for parity tests.
};

// MGA importance from an InfoNCE profile (lower InfoNCE = more important layer).
enum class MgaImportance { kInverse, kRank };  // s_l = 1 / InfoNCE_l, or L - rank(InfoNCE_l)

struct BudgetOptions {
  BudgetAllocator allocator = BudgetAllocator::kUniform;
  double keep_ratio = 1.0;                   // (0, 1]; ignored by kExplicit
  int64_t window = 8;                        // W: per-layer floor
  int64_t num_protected_sinks = 0;           // added to the floor where a method protects sinks
  std::vector<double> profile_values;        // InfoNCE per layer (kMGA, kMLMA*)
  std::vector<double> explicit_layer_prune;  // rho_l per layer (kExplicit)
  MgaImportance mga_importance = MgaImportance::kInverse;
  double pyramid_beta = 20.0;  // kvpress PyramidKVPress.beta
  BudgetRounding rounding = BudgetRounding::kExactGlobal;
};

// keep = 1 - compression_ratio; compression_ratio in [0, 1).
absl::StatusOr<double> KeepRatioFromCompressionRatio(double compression_ratio);
// keep = min(1, budget_tokens / n): budget_tokens is the per-layer average kept per sequence.
absl::StatusOr<double> KeepRatioFromBudgetTokens(int64_t budget_tokens, int64_t num_tokens);

// Layers a protection scheme keeps whole (0-based): MLP and MLMA-2L protect floor(L/2) and
// floor(L/2)+1; MLMA-kL protects the k layers floor(L/2)-k/2+1 .. floor(L/2)+k/2. Other
// allocators protect none. Indices >= L are dropped.
std::vector<int32_t> ProtectedLayers(BudgetAllocator allocator, int32_t num_layers);

// Checks options against the model depth without a prompt length (profile/list lengths, ranges).
absl::Status ValidateBudgetOptions(const BudgetOptions& options, int32_t num_layers);

// Tokens each layer keeps of `num_tokens` seen: [num_layers], each in [min_keep, n].
// Errors (INVALID_ARGUMENT) name the setting and say why: e.g. MLP whose protected layers need
// more than the whole budget, a profile of the wrong length, a non-positive InfoNCE value.
absl::StatusOr<std::vector<int64_t>> AllocateLayerBudgets(const BudgetOptions& options,
                                                          int32_t num_layers, int64_t num_tokens);

// Reads a layer-metric profile (`{model, num_layers, metric, tau, num_texts, values[], created}`).
struct LayerProfile {
  std::string model;
  int32_t num_layers = 0;
  std::string metric;  // "infonce", ...
  double tau = 0.1;
  int64_t num_texts = 0;
  std::vector<double> values;
  std::string created;
};
absl::StatusOr<LayerProfile> LoadLayerProfile(const std::string& path);
absl::Status SaveLayerProfile(const LayerProfile& profile, const std::string& path);

}  // namespace dropkv::compression
