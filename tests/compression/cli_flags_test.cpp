// The compression flags (cli_flags.h) parse into CompressionParams and reject bad values naming
// the flag.
#include "engine/compression/cli_flags.h"

#include <gtest/gtest.h>

#include "CLI/CLI.hpp"
#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

// Parses argv-style strings; returns the CLI11 error text ("" = ok).
std::string Parse(std::vector<std::string> args, CompressionParams* p) {
  CLI::App app("test");
  AddCompressionFlags(app, p);
  std::vector<const char*> argv = {"prog"};
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::Error& e) {
    return e.what();
  }
  return "";
}

TEST(CompressionFlags, ParsesEverySetting) {
  CompressionParams p;
  ASSERT_EQ(Parse({"--method",
                   "snapkv",
                   "--compression-ratio",
                   "0.25",
                   "--allocator",
                   "mlp",
                   "--window",
                   "16",
                   "--pooling",
                   "avg",
                   "--pooling-kernel",
                   "5",
                   "--chunk-policy",
                   "every_chunk",
                   "--chunk-size",
                   "64",
                   "--sinks",
                   "2",
                   "--protect-sinks",
                   "--compression-seed",
                   "9"},
                  &p),
            "");
  EXPECT_EQ(p.method, ScoreMethod::kSnapKV);
  EXPECT_DOUBLE_EQ(p.keep_ratio, 0.75);
  EXPECT_EQ(p.allocator, BudgetAllocator::kMLP);
  EXPECT_EQ(p.window, 16);
  EXPECT_EQ(p.pooling, PoolingType::kAvg);
  EXPECT_EQ(p.pooling_kernel, 5);
  EXPECT_EQ(p.chunk_policy, ChunkPolicy::kEveryChunk);
  EXPECT_EQ(p.chunk_size, 64);
  EXPECT_EQ(p.num_sinks, 2);
  EXPECT_TRUE(p.protect_sinks);
  EXPECT_EQ(p.random_seed, 9u);

  CompressionParams q;
  ASSERT_EQ(Parse({"--method", "dropkv", "--budget-tokens", "128", "--allocator", "explicit",
                   "--explicit-prune", "0.1,0.2,0.3"},
                  &q),
            "");
  EXPECT_EQ(q.budget_tokens, 128);
  EXPECT_EQ(q.explicit_layer_prune, (std::vector<double>{0.1, 0.2, 0.3}));
}

TEST(CompressionFlags, ReadTheServersEnvironmentNames) {
  setenv("DROPKV_COMPRESSION_KEEP_RATIO", "0.4", 1);
  setenv("DROPKV_COMPRESSION_PROTECT_SINKS", "true", 1);
  CompressionParams p;
  const std::string error = Parse({}, &p);
  unsetenv("DROPKV_COMPRESSION_KEEP_RATIO");
  unsetenv("DROPKV_COMPRESSION_PROTECT_SINKS");
  ASSERT_EQ(error, "");
  EXPECT_DOUBLE_EQ(p.keep_ratio, 0.4);
  EXPECT_TRUE(p.protect_sinks);
}

TEST(CompressionFlags, BadValuesNameTheFlag) {
  CompressionParams p;
  EXPECT_NE(Parse({"--method", "snap"}, &p).find("snapkv"), std::string::npos);
  // The flag names the field once, then the accepted names (engine/compression/params.h).
  EXPECT_EQ(Parse({"--allocator", "pyr"}, &p),
            "--allocator: expected one of uniform|pyramid|mlp|mga|mlma2|mlma4|mlma6|explicit, "
            "got 'pyr'");
  EXPECT_EQ(Parse({"--compression-ratio", "1.0"}, &p),
            "--compression-ratio: must be in [0, 1), got 1");
  EXPECT_NE(Parse({"--allocator", "cone"}, &p).find("allocator"), std::string::npos);
  EXPECT_NE(Parse({"--keep", "0.5", "--compression-ratio", "0.5"}, &p), "");
  // Ranges are the schema rows': the flag names the field; the validator holds code-built
  // settings to the same ranges.
  CompressionParams zero;
  EXPECT_EQ(Parse({"--keep", "0"}, &zero), "--keep: must be in (0, 1], got 0");
  EXPECT_EQ(Parse({"--window", "2000"}, &zero), "--window: must be in [1, 1024], got 2000");
  zero.keep_ratio = 0;
  absl::Status bad = ValidateCompression(zero, 4);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "keep_ratio: must be in (0, 1], got 0");
}

}  // namespace
}  // namespace dropkv::compression
