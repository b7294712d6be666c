#include "engine/compression/compression.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dropkv::compression {
namespace {

absl::Status Invalid(std::string msg) {
  return absl::InvalidArgumentError(std::move(msg));
}

}  // namespace

int32_t ProtectedSinks(const CompressionParams& p) {
  if (p.method == ScoreMethod::kStreamingLLM || p.protect_sinks) return p.num_sinks;
  return 0;
}

absl::Status ValidateCompression(const CompressionParams& p, int32_t num_layers) {
  if (absl::Status ranges = CheckCompressionRanges(p); !ranges.ok()) return ranges;
  // Consistency between fields; each field's own range is its row's.
  if (p.chunk_size > 0 && p.chunk_size < p.window) {
    return Invalid(absl::StrCat("chunk_size: must be 0 or in [window (", p.window, "), ",
                                kMaxCompressionTokens, "], got ", p.chunk_size,
                                " (the last chunk's window queries score the cache)"));
  }
  if (p.chunk_policy == ChunkPolicy::kBudget && p.budget_cap_tokens == 0) {
    return Invalid("budget_cap_tokens: chunk_policy budget needs a cap > 0, got 0");
  }
  if (p.decode_margin > 0 && p.decode_margin < p.window) {
    return Invalid(absl::StrCat("decode_margin: must be 0 or in [window (", p.window, "), ",
                                kMaxCompressionTokens, "], got ", p.decode_margin,
                                " (the last window decode steps' queries score the cache)"));
  }
  if (p.decode_margin > 0 && p.method == ScoreMethod::kNone) {
    return Invalid("decode_margin: compression during decode needs a method other than none");
  }
  if (p.tolerance > 0 && p.method != ScoreMethod::kDropKV) {
    return Invalid(
        absl::StrCat("tolerance: the automatic budget reads DropKV's output-shift "
                     "scores; method ",
                     std::string(ScoreMethodName(p.method)), " has none"));
  }
  if (p.scoring_queries == ScoringQueries::kReplay) {
    if (p.method != ScoreMethod::kDropKV) {
      return Invalid(absl::StrCat("scoring_queries: replay scores with DropKV; method ",
                                  std::string(ScoreMethodName(p.method)),
                                  " has no replay scoring"));
    }
    if (p.chunk_policy != ChunkPolicy::kLastChunk) {
      return Invalid(
          absl::StrCat("scoring_queries: replay scores the whole prompt once, after "
                       "its last chunk; chunk_policy must be last_chunk, got ",
                       std::string(ChunkPolicyName(p.chunk_policy))));
    }
    if (p.tolerance > 0) {
      return Invalid("scoring_queries: replay takes a fixed budget; tolerance must be 0");
    }
  }
  if (AllocatorNeedsProfile(p.allocator) && p.profile_path.empty()) {
    return Invalid(absl::StrCat("profile_path: required by allocator ",
                                std::string(BudgetAllocatorName(p.allocator))));
  }
  if (p.allocator == BudgetAllocator::kExplicit && p.explicit_layer_prune.empty()) {
    return Invalid("explicit_layer_prune: allocator explicit needs one value per layer");
  }
  if (p.method == ScoreMethod::kNone || num_layers <= 0) return absl::OkStatus();
  // Profiles are checked where they are loaded (once, at start-up); here their allocators are
  // held to the rules every allocator shares, without reading a file per request.
  CompressionParams shared_rules = p;
  if (AllocatorNeedsProfile(p.allocator)) shared_rules.allocator = BudgetAllocator::kUniform;
  absl::StatusOr<BudgetOptions> opts =
      ResolveBudgetOptions(shared_rules, num_layers, /*num_tokens=*/0);
  if (!opts.ok()) return opts.status();
  return ValidateBudgetOptions(*opts, num_layers);
}

absl::StatusOr<BudgetOptions> ResolveBudgetOptions(const CompressionParams& p, int32_t num_layers,
                                                   int64_t num_tokens,
                                                   const LayerProfile* profile) {
  BudgetOptions o;
  o.allocator = p.allocator;
  o.keep_ratio = p.keep_ratio;
  if (p.budget_tokens.has_value() && num_tokens > 0) {
    absl::StatusOr<double> keep = KeepRatioFromBudgetTokens(*p.budget_tokens, num_tokens);
    if (!keep.ok()) return keep.status();
    o.keep_ratio = *keep;
  }
  o.window = p.window;
  o.num_protected_sinks = ProtectedSinks(p);
  o.explicit_layer_prune = p.explicit_layer_prune;
  if (AllocatorNeedsProfile(p.allocator)) {
    if (profile != nullptr) {
      o.profile_values = profile->values;
    } else {
      absl::StatusOr<LayerProfile> loaded = LoadLayerProfile(p.profile_path);
      if (!loaded.ok()) {
        return Invalid(absl::StrCat("profile_path: ", loaded.status().message()));
      }
      if (loaded->num_layers != num_layers) {
        return Invalid(absl::StrCat("profile_path: ", p.profile_path, " has ", loaded->num_layers,
                                    " layers but the model has ", num_layers));
      }
      o.profile_values = loaded->values;
    }
  }
  return o;
}

absl::StatusOr<std::vector<int64_t>> KeptTokensPerLayer(const CompressionParams& p,
                                                        int32_t num_layers, int64_t prompt_len) {
  if (p.method == ScoreMethod::kNone) return std::vector<int64_t>(num_layers, prompt_len);
  absl::StatusOr<BudgetOptions> o = ResolveBudgetOptions(p, num_layers, prompt_len);
  if (!o.ok()) return o.status();
  return AllocateLayerBudgets(*o, num_layers, prompt_len);
}

}  // namespace dropkv::compression
