#include "engine/compression/params.h"

namespace dropkv {
std::string_view ScoreMethodName(ScoreMethod method) {
  return NameOf(kScoreMethodNames, method);
}
std::string_view BudgetAllocatorName(BudgetAllocator allocator) {
  return NameOf(kBudgetAllocatorNames, allocator);
}
std::string_view ChunkPolicyName(ChunkPolicy policy) {
  return NameOf(kChunkPolicyNames, policy);
}
std::string_view PoolingTypeName(PoolingType pooling) {
  return NameOf(kPoolingTypeNames, pooling);
}
absl::StatusOr<ScoreMethod> ParseScoreMethod(std::string_view name, std::string_view field) {
  return ParseName(kScoreMethodNames, name, field);
}
absl::StatusOr<BudgetAllocator> ParseBudgetAllocator(std::string_view name,
                                                     std::string_view field) {
  return ParseName(kBudgetAllocatorNames, name, field);
}
absl::StatusOr<ChunkPolicy> ParseChunkPolicy(std::string_view name, std::string_view field) {
  return ParseName(kChunkPolicyNames, name, field);
}
absl::StatusOr<PoolingType> ParsePoolingType(std::string_view name, std::string_view field) {
  return ParseName(kPoolingTypeNames, name, field);
}

}  // namespace dropkv
