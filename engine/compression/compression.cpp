#include "engine/compression/compression.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dropkv::compression {
namespace {

template <typename E, size_t N>
using NameTable = std::array<std::pair<E, std::string_view>, N>;

constexpr NameTable<ScoreMethod, 9> kMethods = {{
    {ScoreMethod::kDropKV, "dropkv"},
    {ScoreMethod::kSnapKV, "snapkv"},
    {ScoreMethod::kH2O, "h2o"},
    {ScoreMethod::kH2OVl1, "h2o_vl1"},
    {ScoreMethod::kH2OVl2, "h2o_vl2"},
    {ScoreMethod::kStreamingLLM, "streaming_llm"},
    {ScoreMethod::kKNorm, "knorm"},
    {ScoreMethod::kRandom, "random"},
    {ScoreMethod::kNone, "none"},
}};
constexpr NameTable<BudgetAllocator, 8> kAllocators = {{
    {BudgetAllocator::kUniform, "uniform"},
    {BudgetAllocator::kPyramid, "pyramid"},
    {BudgetAllocator::kMLP, "mlp"},
    {BudgetAllocator::kMGA, "mga"},
    {BudgetAllocator::kMLMA2, "mlma2"},
    {BudgetAllocator::kMLMA4, "mlma4"},
    {BudgetAllocator::kMLMA6, "mlma6"},
    {BudgetAllocator::kExplicit, "explicit"},
}};
constexpr NameTable<ChunkPolicy, 3> kPolicies = {{
    {ChunkPolicy::kLastChunk, "last_chunk"},
    {ChunkPolicy::kEveryChunk, "every_chunk"},
    {ChunkPolicy::kBudget, "budget"},
}};
constexpr NameTable<PoolingType, 3> kPoolings = {{
    {PoolingType::kMax, "max"},
    {PoolingType::kAvg, "avg"},
    {PoolingType::kNone, "none"},
}};

template <typename E, size_t N>
std::string_view NameOf(const NameTable<E, N>& table, E value) {
  for (const auto& [v, name] : table) {
    if (v == value) return name;
  }
  return "?";
}

template <typename E, size_t N>
absl::StatusOr<E> Parse(const NameTable<E, N>& table, std::string_view name, const char* field) {
  std::vector<std::string> names;
  for (const auto& [v, n] : table) {
    if (n == name) return v;
    names.emplace_back(n);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": unknown value '", std::string(name),
                                                 "', expected one of ",
                                                 absl::StrJoin(names, ", ")));
}

absl::Status Invalid(std::string msg) {
  return absl::InvalidArgumentError(std::move(msg));
}

bool UsesProfile(BudgetAllocator a) {
  return a == BudgetAllocator::kMGA || a == BudgetAllocator::kMLMA2 ||
         a == BudgetAllocator::kMLMA4 || a == BudgetAllocator::kMLMA6;
}

}  // namespace

std::string_view ScoreMethodName(ScoreMethod m) {
  return NameOf(kMethods, m);
}
std::string_view BudgetAllocatorName(BudgetAllocator a) {
  return NameOf(kAllocators, a);
}
std::string_view ChunkPolicyName(ChunkPolicy p) {
  return NameOf(kPolicies, p);
}
std::string_view PoolingTypeName(PoolingType p) {
  return NameOf(kPoolings, p);
}
absl::StatusOr<ScoreMethod> ParseScoreMethod(std::string_view name) {
  return Parse(kMethods, name, "method");
}
absl::StatusOr<BudgetAllocator> ParseBudgetAllocator(std::string_view name) {
  return Parse(kAllocators, name, "allocator");
}
absl::StatusOr<ChunkPolicy> ParseChunkPolicy(std::string_view name) {
  return Parse(kPolicies, name, "chunk_policy");
}
absl::StatusOr<PoolingType> ParsePoolingType(std::string_view name) {
  return Parse(kPoolings, name, "pooling");
}

int32_t ProtectedSinks(const CompressionParams& p) {
  if (p.method == ScoreMethod::kStreamingLLM || p.protect_sinks) return p.num_sinks;
  return 0;
}

absl::Status ValidateCompression(const CompressionParams& p, int32_t num_layers) {
  if (p.method == ScoreMethod::kNone) return absl::OkStatus();
  if (num_layers <= 0) return Invalid(absl::StrCat("num_layers must be > 0, got ", num_layers));
  if (!(p.keep_ratio > 0.0 && p.keep_ratio <= 1.0)) {
    return Invalid(absl::StrCat("keep_ratio must be in (0, 1], got ", p.keep_ratio));
  }
  if (p.budget_tokens.has_value() && *p.budget_tokens <= 0) {
    return Invalid(absl::StrCat("budget_tokens must be > 0, got ", *p.budget_tokens));
  }
  if (p.window < 1) return Invalid(absl::StrCat("window must be >= 1, got ", p.window));
  if (p.pooling_kernel < 1 || p.pooling_kernel % 2 == 0) {
    return Invalid(absl::StrCat("pooling_kernel must be odd and >= 1, got ", p.pooling_kernel));
  }
  if (p.num_sinks < 0) return Invalid(absl::StrCat("num_sinks must be >= 0, got ", p.num_sinks));
  if (p.chunk_size < 0) return Invalid(absl::StrCat("chunk_size must be >= 0, got ", p.chunk_size));
  if (p.chunk_size > 0 && p.chunk_size < p.window) {
    return Invalid(absl::StrCat("chunk_size ", p.chunk_size, " must be >= window ", p.window,
                                " (the last chunk's window queries score the cache)"));
  }
  if (p.chunk_policy == ChunkPolicy::kBudget) {
    if (p.budget_cap_tokens <= 0) {
      return Invalid(absl::StrCat("budget_cap_tokens must be > 0 for chunk_policy budget, got ",
                                  p.budget_cap_tokens));
    }
  } else if (p.budget_cap_tokens < 0) {
    return Invalid(absl::StrCat("budget_cap_tokens must be >= 0, got ", p.budget_cap_tokens));
  }
  if (UsesProfile(p.allocator) && p.profile_path.empty()) {
    return Invalid(absl::StrCat("profile_path is required for allocator ",
                                std::string(BudgetAllocatorName(p.allocator))));
  }
  absl::StatusOr<BudgetOptions> opts = ResolveBudgetOptions(p, num_layers, /*num_tokens=*/0);
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
  if (UsesProfile(p.allocator)) {
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
