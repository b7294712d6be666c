// chat_template.h: 20 conversations per family rendered as transformers' apply_chat_template
// (add_generation_prompt=True) renders them, ids as HF encodes the rendered text; unsupported
// templates are FAILED_PRECONDITION.
#include "engine/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include "engine/tokenizer/llama2c_tokenizer.h"
#include "tests/tokenizer/ref_data.h"

namespace dropkv {
namespace {

using testing::Join;
using testing::ReadJson;
using testing::RefDir;
using testing::Repr;

class ChatTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTest, MatchesApplyChatTemplate) {
  const Tokenizer* tok = testing::LoadFamily(GetParam());
  ASSERT_NE(tok, nullptr);
  const auto ref = ReadJson(RefDir() / ("chat_" + GetParam() + ".json"));
  ASSERT_EQ(ref["conversations"].size(), 20u);
  for (const auto& row : ref["conversations"]) {
    std::vector<ChatMessage> messages;
    for (const auto& m : row["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    auto text = tok->ApplyChatTemplate(messages, true);
    if (row.contains("error")) {
      ASSERT_FALSE(text.ok()) << "template raised: " << row["error"];
      EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
      continue;
    }
    ASSERT_TRUE(text.ok()) << text.status();
    const std::string want = row["text"].get<std::string>();
    EXPECT_EQ(*text, want) << "ours " << Repr(*text, 2000) << "\nhf   " << Repr(want, 2000);
    auto ids = tok->Encode(*text, false);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, row["ids"].get<std::vector<int32_t>>()) << Join(*ids);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ChatTest, ::testing::Values("llama3", "qwen3", "gemma3"));

TEST(ChatTemplate, UnknownOrMissingTemplateIsFailedPrecondition) {
  const auto dir = testing::ScratchDir("tokenizer-chat-unknown");
  auto json =
      Tok512ToTokenizerJson((testing::SharedDir() / "models/stories260K/tok512.bin").string(), 512);
  ASSERT_TRUE(json.ok()) << json.status();
  std::ofstream(dir / "tokenizer.json") << *json;
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  for (const std::string& config :
       {std::string("{}"), std::string(R"({"chat_template": "{{ messages[0]['content'] }}"})")}) {
    std::ofstream(dir / "tokenizer_config.json") << config;
    auto tok = Tokenizer::FromDirectory(dir.string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    auto text = (*tok)->ApplyChatTemplate(messages);
    EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition) << config;
  }
  EXPECT_EQ(IdentifyChatTemplate(""), ChatTemplateKind::kNone);
}

TEST(ChatTemplate, InvalidUtf8ContentIsInvalidArgument) {
  const Tokenizer* tok = testing::LoadFamily("qwen3");
  ASSERT_NE(tok, nullptr);
  auto text = tok->ApplyChatTemplate({{"user", "bad \xff byte"}});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  text = tok->ApplyChatTemplate({});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dropkv
