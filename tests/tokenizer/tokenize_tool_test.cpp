// tools/tokenize (dropkv-tokenize): encode / decode / chat lines through the real binary agree with
// the HF references, bad lines give {"error": ...} and exit status 1, --help answers.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/tokenizer/ref_data.h"

namespace dropkv {
namespace {

using testing::ReadJson;
using testing::RefDir;

std::string Tool() {
  return (testing::BuildDir() / "bin" / "dropkv-tokenize").string();
}

// Runs the tool with `args` on `input`; returns stdout lines and the exit status.
std::vector<std::string> RunTool(const std::string& args, const std::string& input, int* status) {
  const auto in_path = testing::ScratchDir("tokenize-tool") / "stdin.txt";
  std::ofstream(in_path, std::ios::binary) << input;
  const std::string cmd = Tool() + " " + args + " < " + in_path.string();
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[65536];
  size_t n = 0;
  while (p != nullptr && (n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int rc = p != nullptr ? pclose(p) : -1;
  *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::vector<std::string> lines;
  size_t pos = 0;
  while (pos < out.size()) {
    size_t nl = out.find('\n', pos);
    if (nl == std::string::npos) nl = out.size();
    lines.push_back(out.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return lines;
}

TEST(TokenizeTool, EncodeDecodeChatMatchReferences) {
  const std::string dir = (RefDir() / "tokenizers" / "qwen3").string();
  const auto ref = ReadJson(RefDir() / "ref_qwen3.json");
  const auto& corpus = testing::Corpus();
  std::string input, id_lines;
  std::vector<size_t> used;
  for (size_t i = 0; i < corpus.size() && used.size() < 300; ++i) {
    const std::string s = corpus[i].get<std::string>();
    if (s.find('\n') != std::string::npos || s.find('\r') != std::string::npos) continue;
    used.push_back(i);
    input += s + "\n";
    id_lines += ref["with_special"][i].dump() + "\n";
  }
  int status = -1;
  auto lines = RunTool("--tokenizer " + dir, input, &status);
  EXPECT_EQ(status, 0);
  ASSERT_EQ(lines.size(), used.size());
  for (size_t k = 0; k < used.size(); ++k) {
    EXPECT_EQ(nlohmann::json::parse(lines[k]), ref["with_special"][used[k]]) << k;
  }
  lines = RunTool("--tokenizer " + dir + " --decode", id_lines, &status);
  EXPECT_EQ(status, 0);
  ASSERT_EQ(lines.size(), used.size());
  for (size_t k = 0; k < used.size(); ++k) {
    EXPECT_EQ(nlohmann::json::parse(lines[k]), ref["decoded"][used[k]]) << k;
  }
  const auto chat = ReadJson(RefDir() / "chat_qwen3.json");
  std::string chat_input;
  for (const auto& row : chat["conversations"]) chat_input += row["messages"].dump() + "\n";
  lines = RunTool("--tokenizer " + dir + " --chat", chat_input, &status);
  ASSERT_EQ(lines.size(), chat["conversations"].size());
  for (size_t k = 0; k < lines.size(); ++k) {
    EXPECT_EQ(nlohmann::json::parse(lines[k]), chat["conversations"][k]["ids"]) << k;
  }
}

TEST(TokenizeTool, ChatObjectsCarryTheRenderArguments) {
  const std::string dir = (RefDir() / "tokenizers" / "qwen3").string();
  int status = -1;
  const std::string messages = R"([{"role": "user", "content": "hi"}])";
  const auto lines =
      RunTool("--tokenizer " + dir + " --chat --render",
              messages + "\n" + R"({"messages": )" + messages +
                  R"(, "add_generation_prompt": false})" + "\n" + R"({"messages": )" + messages +
                  R"(, "chat_template_kwargs": {"enable_thinking": false}})" + "\n",
              &status);
  EXPECT_EQ(status, 0);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(nlohmann::json::parse(lines[0]),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(nlohmann::json::parse(lines[1]), "<|im_start|>user\nhi<|im_end|>\n");
  EXPECT_EQ(nlohmann::json::parse(lines[2]),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(TokenizeTool, BadLinesAreErrorsNotCrashes) {
  const std::string dir = (RefDir() / "tokenizers" / "llama3").string();
  int status = -1;
  auto lines = RunTool("--tokenizer " + dir, "ok\nbad \xff\n", &status);
  EXPECT_EQ(status, 1);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_TRUE(nlohmann::json::parse(lines[1]).contains("error")) << lines[1];
  lines =
      RunTool("--tokenizer " + dir + " --decode", "[1, 2]\n[-5]\nnot json\n[999999999]\n", &status);
  EXPECT_EQ(status, 1);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_FALSE(nlohmann::json::parse(lines[0]).is_object());
  for (size_t k = 1; k < 4; ++k) {
    EXPECT_TRUE(nlohmann::json::parse(lines[k]).contains("error")) << lines[k];
  }
  lines = RunTool("--tokenizer " + dir + " --chat",
                  "[{\"content\": \"no role\"}]\n{\"no messages\": 1}\n[]\n", &status);
  EXPECT_EQ(status, 1);
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& line : lines) EXPECT_TRUE(nlohmann::json::parse(line).contains("error")) << line;
  RunTool("--help", "", &status);
  EXPECT_EQ(status, 0);
  RunTool("--tokenizer /nonexistent", "", &status);
  EXPECT_NE(status, 0);
}

}  // namespace
}  // namespace dropkv
