// Built with DROPKV_COMPRESSION_TEST_FIELD, which adds one field to CompressionParams and one row
// to the schema (engine/compression/schema.cpp) and nothing else. The new setting is then
// validated, printed by --print-config, read from YAML, from the server's flag and environment,
// from the tools' flag and environment, and carried in the encoding tensor-parallel ranks get.
#ifndef DROPKV_COMPRESSION_TEST_FIELD
#error "this test is built with DROPKV_COMPRESSION_TEST_FIELD"
#endif

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

#include "CLI/CLI.hpp"
#include "config/server_config.h"
#include "engine/compression/cli_flags.h"
#include "engine/compression/compression.h"
#include "engine/compression/schema.h"

namespace dropkv {
namespace {

using ::testing::HasSubstr;

TEST(CompressionSchemaExtensionTest, OneRowReachesEveryFrontEnd) {
  // Validated.
  CompressionParams p;
  EXPECT_EQ(p.test_field, 7);
  p.test_field = 101;
  EXPECT_EQ(compression::ValidateCompression(p, 4).message(),
            "test_field: must be in [0, 100], got 101");

  // Printed, and read back.
  std::ostringstream out;
  absl::StatusOr<ServerConfig> c =
      LoadServerConfigFrom({"--print-config", "--compression-test-field", "42"}, {}, out);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(out.str(), HasSubstr("test_field: 42"));
  absl::StatusOr<ServerConfig> back = ParseServerConfigYaml(out.str(), "printed");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->compression.test_field, 42);

  // YAML, with its errors naming the key.
  c = ParseServerConfigYaml("compression: {test_field: 12}", "f.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->compression.test_field, 12);
  c = ParseServerConfigYaml("compression: {test_field: 101}", "f.yaml");
  EXPECT_THAT(c.status().message(),
              HasSubstr("compression.test_field: must be in [0, 100], got 101"));

  // The server's environment wins over its flag.
  std::ostringstream quiet;
  c = LoadServerConfigFrom({"--compression-test-field", "3"},
                           {{"DROPKV_COMPRESSION_TEST_FIELD", "9"}}, quiet);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->compression.test_field, 9);

  // The tools' flag and environment.
  {
    CompressionParams t;
    CLI::App app("tool");
    compression::AddCompressionFlags(app, &t);
    std::vector<const char*> argv = {"tool", "--test-field", "5"};
    app.parse(static_cast<int>(argv.size()), argv.data());
    EXPECT_EQ(t.test_field, 5);
  }
  {
    setenv("DROPKV_COMPRESSION_TEST_FIELD", "6", 1);
    CompressionParams t;
    CLI::App app("tool");
    compression::AddCompressionFlags(app, &t);
    std::vector<const char*> argv = {"tool"};
    app.parse(static_cast<int>(argv.size()), argv.data());
    unsetenv("DROPKV_COMPRESSION_TEST_FIELD");
    EXPECT_EQ(t.test_field, 6);
  }

  // Carried to the other ranks (tensor_parallel_runner.cpp sends this encoding).
  CompressionParams sent;
  sent.test_field = 88;
  absl::StatusOr<CompressionParams> got =
      compression::DecodeCompression(compression::EncodeCompression(sent));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->test_field, 88);
}

}  // namespace
}  // namespace dropkv
