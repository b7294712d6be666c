#include "engine/common/file_util.h"

#include <fstream>

#include <gtest/gtest.h>

#include "tests/common/test_env.h"

namespace dropkv {
namespace {

TEST(FileUtil, MappedFileSeesExactlyTheBytesWritten) {
  auto path = testing::ScratchDir("file_util") / "bytes.bin";
  std::string payload;
  for (int i = 0; i < 5000; ++i) payload.push_back(static_cast<char>((i * 131) & 0xff));
  std::ofstream(path, std::ios::binary) << payload;
  auto mapped = MappedFile::Open(path.string());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_EQ((*mapped)->size_bytes(), payload.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*mapped)->data()), payload.size()), payload);
  auto read = ReadFileToString(path.string());
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, payload);
}

TEST(FileUtil, MissingFileErrorNamesThePath) {
  auto mapped = MappedFile::Open("/nonexistent/dir/model.safetensors");
  ASSERT_FALSE(mapped.ok());
  EXPECT_EQ(mapped.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(mapped.status().message().find("/nonexistent/dir/model.safetensors"), std::string::npos);
  auto read = ReadFileToString("/nonexistent/config.json");
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace dropkv
