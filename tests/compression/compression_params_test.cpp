// engine/compression/params.h: every name round-trips, parsing is case/whitespace tolerant, and
// errors name the field and list every accepted name. The expected names are the documented
// API spellings (docs/api.md, docs/configuration.md), written here independently of the table.
#include "engine/compression/params.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dropkv {
namespace {

using ::testing::HasSubstr;

TEST(CompressionNamesTest, DocumentedSpellings) {
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kDropKV), "dropkv");
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kH2OVl2), "h2o_vl2");
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kStreamingLLM), "streaming_llm");
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kKNorm), "knorm");
  EXPECT_EQ(ScoreMethodName(ScoreMethod::kNone), "none");
  EXPECT_EQ(BudgetAllocatorName(BudgetAllocator::kMLMA4), "mlma4");
  EXPECT_EQ(BudgetAllocatorName(BudgetAllocator::kMLP), "mlp");
  EXPECT_EQ(ChunkPolicyName(ChunkPolicy::kEveryChunk), "every_chunk");
  EXPECT_EQ(PoolingTypeName(PoolingType::kAvg), "avg");
}

template <typename E, size_t N, typename Parse, typename Name>
void ExpectRoundTrip(const std::array<NamedValue<E>, N>& table, size_t num_enum_values, Parse parse,
                     Name name) {
  // Every enum value has exactly one name (the enums are dense from 0).
  ASSERT_EQ(N, num_enum_values);
  std::vector<std::string_view> seen;
  for (size_t i = 0; i < num_enum_values; ++i) {
    const E value = static_cast<E>(i);
    std::string_view n = name(value);
    ASSERT_NE(n, "unknown") << "value " << i << " has no name";
    for (std::string_view s : seen) EXPECT_NE(s, n) << "duplicate name";
    seen.push_back(n);
    absl::StatusOr<E> back = parse(n);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, value) << n;
  }
}

TEST(CompressionNamesTest, RoundTrip) {
  ExpectRoundTrip(
      kScoreMethodNames, 9, [](std::string_view s) { return ParseScoreMethod(s); },
      ScoreMethodName);
  ExpectRoundTrip(
      kBudgetAllocatorNames, 8, [](std::string_view s) { return ParseBudgetAllocator(s); },
      BudgetAllocatorName);
  ExpectRoundTrip(
      kChunkPolicyNames, 3, [](std::string_view s) { return ParseChunkPolicy(s); },
      ChunkPolicyName);
  ExpectRoundTrip(
      kPoolingTypeNames, 3, [](std::string_view s) { return ParsePoolingType(s); },
      PoolingTypeName);
}

TEST(CompressionNamesTest, CaseAndWhitespaceTolerant) {
  EXPECT_EQ(*ParseScoreMethod(" SnapKV\t"), ScoreMethod::kSnapKV);
  EXPECT_EQ(*ParseBudgetAllocator("MLMA6"), BudgetAllocator::kMLMA6);
  EXPECT_EQ(*ParseChunkPolicy("Last_Chunk "), ChunkPolicy::kLastChunk);
  EXPECT_EQ(*ParsePoolingType("\nMAX"), PoolingType::kMax);
}

TEST(CompressionNamesTest, ErrorNamesFieldAndListsValues) {
  absl::StatusOr<ScoreMethod> m = ParseScoreMethod("snap");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.status().message(),
            "method: expected one of none|dropkv|snapkv|h2o|h2o_vl1|h2o_vl2|streaming_llm|knorm|"
            "random, got 'snap'");
  absl::StatusOr<BudgetAllocator> a = ParseBudgetAllocator("", "compression.allocator");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().message(),
            "compression.allocator: expected one of "
            "uniform|pyramid|mlp|mga|mlma2|mlma4|mlma6|explicit, got ''");
  EXPECT_THAT(std::string(ParseChunkPolicy("each").status().message()),
              HasSubstr("chunk_policy: expected one of last_chunk|every_chunk|budget"));
  EXPECT_THAT(std::string(ParsePoolingType("min").status().message()),
              HasSubstr("pooling: expected one of max|avg|none, got 'min'"));
  // No field: the caller (the config loader) prefixes its own key.
  EXPECT_EQ(ParsePoolingType("min", "").status().message(),
            "expected one of max|avg|none, got 'min'");
  // Names that are only prefixes or have inner spaces are not accepted.
  EXPECT_FALSE(ParseScoreMethod("h2o_vl").ok());
  EXPECT_FALSE(ParseScoreMethod("h2o vl1").ok());
}

TEST(CompressionNamesTest, JoinNamesAndProfileAllocators) {
  EXPECT_EQ(JoinNames(kChunkPolicyNames), "last_chunk|every_chunk|budget");
  EXPECT_EQ(NameOf(kPoolingTypeNames, static_cast<PoolingType>(42)), "unknown");
  std::vector<BudgetAllocator> with_profile;
  for (const auto& nv : kBudgetAllocatorNames) {
    if (AllocatorNeedsProfile(nv.value)) with_profile.push_back(nv.value);
  }
  EXPECT_EQ(with_profile,
            (std::vector<BudgetAllocator>{BudgetAllocator::kMGA, BudgetAllocator::kMLMA2,
                                          BudgetAllocator::kMLMA4, BudgetAllocator::kMLMA6}));
}

}  // namespace
}  // namespace dropkv
