// The one table of compression setting names (methods, allocators, pooling, chunk policies) and
// their parsers. Torch-free and tiny: config, the server's request validation, the CLI flags and
// the engine all read names here, so a name is spelled exactly once.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/request.h"

namespace dropkv {

template <typename E>
struct NamedValue {
  E value;
  std::string_view name;
};

inline constexpr std::array<NamedValue<ScoreMethod>, 9> kScoreMethodNames{{
    {ScoreMethod::kNone, "none"},
    {ScoreMethod::kDropKV, "dropkv"},
    {ScoreMethod::kSnapKV, "snapkv"},
    {ScoreMethod::kH2O, "h2o"},
    {ScoreMethod::kH2OVl1, "h2o_vl1"},
    {ScoreMethod::kH2OVl2, "h2o_vl2"},
    {ScoreMethod::kStreamingLLM, "streaming_llm"},
    {ScoreMethod::kKNorm, "knorm"},
    {ScoreMethod::kRandom, "random"},
}};
inline constexpr std::array<NamedValue<BudgetAllocator>, 8> kBudgetAllocatorNames{{
    {BudgetAllocator::kUniform, "uniform"},
    {BudgetAllocator::kPyramid, "pyramid"},
    {BudgetAllocator::kMLP, "mlp"},
    {BudgetAllocator::kMGA, "mga"},
    {BudgetAllocator::kMLMA2, "mlma2"},
    {BudgetAllocator::kMLMA4, "mlma4"},
    {BudgetAllocator::kMLMA6, "mlma6"},
    {BudgetAllocator::kExplicit, "explicit"},
}};
inline constexpr std::array<NamedValue<ChunkPolicy>, 3> kChunkPolicyNames{{
    {ChunkPolicy::kLastChunk, "last_chunk"},
    {ChunkPolicy::kEveryChunk, "every_chunk"},
    {ChunkPolicy::kBudget, "budget"},
}};
inline constexpr std::array<NamedValue<PoolingType>, 3> kPoolingTypeNames{{
    {PoolingType::kMax, "max"},
    {PoolingType::kAvg, "avg"},
    {PoolingType::kNone, "none"},
}};

// MGA and the MLMA hybrids read a per-layer profile (CompressionParams::profile_path).
constexpr bool AllocatorNeedsProfile(BudgetAllocator allocator) {
  return allocator == BudgetAllocator::kMGA || allocator == BudgetAllocator::kMLMA2 ||
         allocator == BudgetAllocator::kMLMA4 || allocator == BudgetAllocator::kMLMA6;
}

namespace names_internal {
// Lower case, surrounding ASCII whitespace removed.
std::string Normalize(std::string_view text);
// INVALID_ARGUMENT "<field>: expected one of a|b|c, got 'text'" ("expected ..." when field is "").
absl::Status UnknownName(std::string_view field, std::string_view text,
                         const std::vector<std::string_view>& accepted);
}  // namespace names_internal

// The name of `value` in `table`, "unknown" when it has none.
template <typename E, size_t N>
std::string_view NameOf(const std::array<NamedValue<E>, N>& table, E value) {
  for (const NamedValue<E>& nv : table) {
    if (nv.value == value) return nv.name;
  }
  return "unknown";
}

// "a|b|c": the accepted names, in table order (help texts, errors).
template <typename E, size_t N>
std::string JoinNames(const std::array<NamedValue<E>, N>& table) {
  std::string out;
  for (const NamedValue<E>& nv : table) {
    if (!out.empty()) out += '|';
    out += nv.name;
  }
  return out;
}

// Case-insensitive; surrounding whitespace is ignored. The error starts with `field` (when not
// empty) and lists every accepted name.
template <typename E, size_t N>
absl::StatusOr<E> ParseName(const std::array<NamedValue<E>, N>& table, std::string_view text,
                            std::string_view field) {
  std::string t = names_internal::Normalize(text);
  std::vector<std::string_view> accepted;
  for (const NamedValue<E>& nv : table) {
    if (t == nv.name) return nv.value;
    accepted.push_back(nv.name);
  }
  return names_internal::UnknownName(field, text, accepted);
}

// The four compression settings. `field` defaults to the request/config field name.
std::string_view ScoreMethodName(ScoreMethod method);
std::string_view BudgetAllocatorName(BudgetAllocator allocator);
std::string_view ChunkPolicyName(ChunkPolicy policy);
std::string_view PoolingTypeName(PoolingType pooling);
absl::StatusOr<ScoreMethod> ParseScoreMethod(std::string_view name,
                                             std::string_view field = "method");
absl::StatusOr<BudgetAllocator> ParseBudgetAllocator(std::string_view name,
                                                     std::string_view field = "allocator");
absl::StatusOr<ChunkPolicy> ParseChunkPolicy(std::string_view name,
                                             std::string_view field = "chunk_policy");
absl::StatusOr<PoolingType> ParsePoolingType(std::string_view name,
                                             std::string_view field = "pooling");

}  // namespace dropkv
