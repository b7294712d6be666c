// The compression schema (engine/compression/schema.h): every row reads back what it writes, the
// encoding tensor-parallel ranks receive carries every field, and the ranges are the validator's.
// schema_extension_test.cpp adds a row in its own build and follows it through every front end.
#include "engine/compression/schema.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

using ::testing::HasSubstr;

// Every stored field set away from its default.
CompressionParams Unusual() {
  CompressionParams p;
  p.method = ScoreMethod::kH2OVl1;
  p.keep_ratio = 0.123456789012345;
  p.budget_tokens = 777;
  p.allocator = BudgetAllocator::kExplicit;
  p.explicit_layer_prune = {0.1, 0.0, 0.9999999999};
  p.profile_path = "dir with = and :/p.json\n";
  p.window = 17;
  p.pooling = PoolingType::kAvg;
  p.pooling_kernel = 21;
  p.protect_sinks = true;
  p.num_sinks = 3;
  p.chunk_policy = ChunkPolicy::kBudget;
  p.chunk_size = 64;
  p.budget_cap_tokens = 4096;
  p.decode_margin = 32;
  p.tolerance = 0.0625;
  p.pooling_lookback = 24;
  p.scoring_queries = ScoringQueries::kReplay;
  p.random_seed = 18446744073709551615ull;
  return p;
}

TEST(CompressionSchemaTest, EncodingCarriesEveryField) {
  const CompressionParams p = Unusual();
  absl::StatusOr<CompressionParams> back = DecodeCompression(EncodeCompression(p));
  ASSERT_TRUE(back.ok()) << back.status();
  for (const CompressionField& f : CompressionFields()) {
    if (!f.stored()) continue;
    EXPECT_EQ(f.get(*back), f.get(p)) << f.name;
    // And every field differs from its default, so a field the encoding dropped shows.
    EXPECT_NE(f.get(p), f.get(CompressionParams{})) << f.name << " is not exercised";
  }
  EXPECT_EQ(back->keep_ratio, p.keep_ratio);  // bit for bit
  EXPECT_EQ(back->explicit_layer_prune, p.explicit_layer_prune);
  // No budget stays no budget.
  CompressionParams none;
  back = DecodeCompression(EncodeCompression(none));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->budget_tokens.has_value());
}

TEST(CompressionSchemaTest, DecodeRefusesWhatItDoesNotKnow) {
  EXPECT_THAT(DecodeCompression("window=2:16nonsense=1:1").status().message(),
              HasSubstr("unknown field 'nonsense'"));
  EXPECT_THAT(DecodeCompression("window=9:16").status().message(), HasSubstr("malformed"));
  EXPECT_THAT(DecodeCompression("window=1:0").status().message(),
              HasSubstr("window: must be in [1, 1024], got 0"));
}

TEST(CompressionSchemaTest, SetParsesAndBoundsEachKind) {
  CompressionParams p;
  const CompressionField* window = FindCompressionField("window");
  ASSERT_NE(window, nullptr);
  EXPECT_EQ(window->set(p, "1025").message(), "must be in [1, 1024], got 1025");
  EXPECT_THAT(window->set(p, "x").message(), HasSubstr("expected an integer, got 'x'"));
  EXPECT_TRUE(window->set(p, " 32 ").ok());
  EXPECT_EQ(p.window, 32);
  EXPECT_THAT(FindCompressionField("pooling_kernel")->set(p, "4").message(),
              HasSubstr("must be odd and in [1, 127]"));
  EXPECT_THAT(FindCompressionField("method")->set(p, "snap").message(),
              HasSubstr("expected one of none|dropkv|snapkv"));
  EXPECT_THAT(FindCompressionField("keep_ratio")->set(p, "0").message(),
              HasSubstr("must be in (0, 1], got 0"));
  EXPECT_THAT(FindCompressionField("explicit_layer_prune")->set(p, "0.5,1").message(),
              HasSubstr("element 1: must be in [0, 1), got 1"));
  // compression_ratio is the kvpress form of keep_ratio, not a stored field.
  const CompressionField* ratio = FindCompressionField("compression_ratio");
  ASSERT_NE(ratio, nullptr);
  EXPECT_FALSE(ratio->stored());
  p.budget_tokens = 5;
  ASSERT_TRUE(ratio->set(p, "0.75").ok());
  EXPECT_DOUBLE_EQ(p.keep_ratio, 0.25);
  EXPECT_FALSE(p.budget_tokens.has_value());
}

TEST(CompressionSchemaTest, ValidatorChecksEveryRowsRange) {
  CompressionParams p;
  p.num_sinks = kMaxNumSinks + 1;
  EXPECT_EQ(ValidateCompression(p, 4).message(), "num_sinks: must be in [0, 4096], got 4097");
  p = {};
  p.budget_cap_tokens = -1;
  EXPECT_THAT(ValidateCompression(p, 4).message(), HasSubstr("budget_cap_tokens: must be in [0,"));
  p = {};
  p.explicit_layer_prune = {2.0};
  EXPECT_THAT(ValidateCompression(p, 4).message(), HasSubstr("explicit_layer_prune: element 0"));
  EXPECT_TRUE(ValidateCompression(CompressionParams{}, 4).ok());
}

// Replay scoring is DropKV's, over the whole prompt after its last chunk, with a fixed budget:
// anything else is refused, naming the field.
TEST(CompressionSchemaTest, ReplayScoringNeedsDropKvLastChunkAndAFixedBudget) {
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = 0.25;
  p.scoring_queries = ScoringQueries::kReplay;
  EXPECT_TRUE(ValidateCompression(p, 4).ok());
  ASSERT_TRUE(FindCompressionField("scoring_queries")->set(p, "window").ok());
  EXPECT_EQ(p.scoring_queries, ScoringQueries::kWindow);
  EXPECT_THAT(FindCompressionField("scoring_queries")->set(p, "question").message(),
              HasSubstr("window|replay"));
  p.scoring_queries = ScoringQueries::kReplay;
  CompressionParams bad = p;
  bad.method = ScoreMethod::kSnapKV;
  EXPECT_EQ(ValidateCompression(bad, 4).message(),
            "scoring_queries: replay scores with DropKV; method snapkv has no replay scoring");
  bad = p;
  bad.chunk_policy = ChunkPolicy::kEveryChunk;
  bad.chunk_size = 64;
  EXPECT_THAT(ValidateCompression(bad, 4).message(),
              HasSubstr("scoring_queries: replay scores the whole prompt once"));
  bad = p;
  bad.tolerance = 0.1;
  EXPECT_THAT(ValidateCompression(bad, 4).message(), HasSubstr("scoring_queries: replay takes"));
}

TEST(CompressionSchemaTest, NamesAreUnique) {
  std::vector<std::string_view> names, flags;
  for (const CompressionField& f : CompressionFields()) {
    EXPECT_EQ(std::count(names.begin(), names.end(), f.name), 0) << f.name;
    EXPECT_EQ(std::count(flags.begin(), flags.end(), f.tool_flag), 0) << f.tool_flag;
    names.push_back(f.name);
    flags.push_back(f.tool_flag);
  }
  EXPECT_EQ(CompressionEnvName(*FindCompressionField("keep_ratio")),
            "DROPKV_COMPRESSION_KEEP_RATIO");
}

}  // namespace
}  // namespace dropkv::compression
