// chat_template.h: the model's own chat template rendered byte for byte as transformers'
// apply_chat_template renders it. The `chat_template_reference` fixture (make_chat_reference.py)
// records HF's renders of generated requests for the shared tokenizers, the real models' folders,
// our family-style and construct templates (chat_templates/) and error templates; the
// `tokenizer_reference` fixture's 20 conversations per family also check the ids.
#include "engine/tokenizer/chat_template.h"

#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "engine/tokenizer/llama2c_tokenizer.h"
#include "tests/tokenizer/ref_data.h"

namespace dropkv {
namespace {

using ojson = nlohmann::ordered_json;
using testing::Join;
using testing::ReadJson;
using testing::RefDir;
using testing::Repr;

// Key order matters (tojson keeps it), so the reference is read as ordered_json.
const ojson& ChatReference() {
  static const ojson ref = [] {
    const auto path =
        testing::BuildDir() / "test-scratch" / "chat-template-ref" / "chat_reference.json";
    std::ifstream in(path);
    if (!in) {
      ADD_FAILURE() << "missing " << path << " (the chat_template_reference fixture writes it)";
      return ojson::object();
    }
    std::stringstream ss;
    ss << in.rdbuf();
    return ojson::parse(ss.str());
  }();
  return ref;
}

const ojson* FindTemplate(const std::string& name) {
  const ojson& ref = ChatReference();
  if (!ref.contains("templates")) return nullptr;
  for (const auto& t : ref["templates"]) {
    if (t["name"] == name) return &t;
  }
  return nullptr;
}

ChatRequest ToRequest(const ojson& r) {
  ChatRequest request;
  request.messages = r["messages"];
  if (r.contains("tools") && !r["tools"].is_null()) request.tools = r["tools"];
  if (r.contains("documents") && !r["documents"].is_null()) request.documents = r["documents"];
  request.add_generation_prompt = r.value("add_generation_prompt", false);
  request.continue_final_message = r.value("continue_final_message", false);
  if (r.contains("kwargs")) request.template_kwargs = r["kwargs"];
  return request;
}

// The fixture's strftime_now clock.
jinja::RenderOptions FixedClock() {
  const auto& clock = ChatReference()["clock"];
  jinja::RenderOptions options;
  std::tm tm{};
  tm.tm_year = clock[0].get<int>() - 1900;
  tm.tm_mon = clock[1].get<int>() - 1;
  tm.tm_mday = clock[2].get<int>();
  tm.tm_hour = clock[3].get<int>();
  tm.tm_min = clock[4].get<int>();
  tm.tm_sec = clock[5].get<int>();
  std::mktime(&tm);  // fills in the weekday
  options.local_time = [tm] { return tm; };
  return options;
}

// The code each of HF's exceptions becomes.
absl::StatusCode ExpectedCode(const std::string& error_type) {
  if (error_type == "TemplateSyntaxError") return absl::StatusCode::kFailedPrecondition;
  if (error_type == "RecursionError") return absl::StatusCode::kResourceExhausted;
  return absl::StatusCode::kInvalidArgument;
}

constexpr const char* kReferenceTemplates[] = {
    // ../shared tokenizers and the real models (Gemma-3-270M's template is gemma3's).
    "llama3", "qwen3", "gemma3", "smollm2-135m-instruct", "gemma-3-270m",
    // chat_templates/: family styles, then one construct group each.
    "chatml_tools", "mistral_style", "llama31_style", "deepseek_style", "phi_style",
    "constructs_statements", "constructs_expressions", "constructs_filters",
    // Error paths.
    "error_unclosed_for", "error_unknown_tag", "error_bad_expression", "error_raise_exception",
    "error_type", "error_undefined_attribute", "error_range_too_big", "error_recursive_macro",
    "error_unsafe_method", "error_not_callable", "error_division_by_zero",
    "error_generator_length"};

class ChatReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatReferenceTest, MatchesApplyChatTemplate) {
  const ojson* entry = FindTemplate(GetParam());
  ASSERT_NE(entry, nullptr) << GetParam() << " is not in the reference";
  if (entry->contains("skipped")) GTEST_SKIP() << (*entry)["skipped"].get<std::string>();

  // A model folder's template comes from its files as Tokenizer::FromDirectory reads them (the
  // chat template does not need the tokenizer.json pipeline, which may lack a model's
  // pre-tokenizer).
  ChatTemplate chat;
  if ((*entry)["kind"] == "dir") {
    // The real models from set-up's folder (the fixture rendered the same files through HF).
    const std::filesystem::path dir =
        entry->value("model", false) ? testing::ModelsDir() / GetParam()
                                     : std::filesystem::path((*entry)["dir"].get<std::string>());
    const auto read = [&](const char* name) {
      std::ifstream in(dir / name);
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    };
    const std::string config = read("tokenizer_config.json");
    chat = ChatTemplate::FromConfig(
        config.empty() ? nlohmann::json::object() : nlohmann::json::parse(config),
        read("chat_template.jinja"));
  } else {
    chat = ChatTemplate::FromConfig(nlohmann::json::parse((*entry)["config"].dump()), "");
  }
  ASSERT_TRUE(chat.load_status().ok() || GetParam().rfind("error_", 0) == 0) << chat.load_status();
  const jinja::RenderOptions options = FixedClock();
  const auto& cases = (*entry)["cases"];
  ASSERT_GE(cases.size(), 2u);
  size_t num_rendered = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const ojson& c = cases[k];
    SCOPED_TRACE(::testing::Message()
                 << GetParam() << " case " << k << ": " << c["request"].dump().substr(0, 300));
    const ChatRequest request = ToRequest(c["request"]);
    auto text = chat.Render(request, options);
    if (c.contains("text")) {
      ASSERT_TRUE(text.ok()) << text.status();
      const std::string want = c["text"].get<std::string>();
      EXPECT_EQ(*text, want) << "ours " << Repr(*text, 3000) << "\nhf   " << Repr(want, 3000);
      ++num_rendered;
      continue;
    }
    const std::string error_type = c["error_type"].get<std::string>();
    ASSERT_FALSE(text.ok()) << "HF raised " << error_type << ": " << c["error"] << "\nours "
                            << Repr(*text, 1000);
    EXPECT_EQ(text.status().code(), ExpectedCode(error_type))
        << text.status() << "\nHF raised " << error_type << ": " << c["error"];
    if (error_type == "TemplateError") {  // raise_exception: the template's own words
      EXPECT_NE(text.status().message().find(c["error"].get<std::string>()), std::string::npos)
          << text.status();
    }
    if (error_type == "TemplateSyntaxError" || error_type == "TemplateError") {
      EXPECT_NE(text.status().message().find("line "), std::string::npos) << text.status();
    }
  }
  // Family and construct templates must mostly render, not only agree on failing.
  if (GetParam().rfind("error_", 0) != 0) {
    EXPECT_GE(num_rendered * 2, cases.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Templates, ChatReferenceTest,
                         ::testing::ValuesIn(std::vector<std::string>(
                             std::begin(kReferenceTemplates), std::end(kReferenceTemplates))),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

TEST(ChatReference, EveryRecordedTemplateIsTested) {
  std::set<std::string> tested(std::begin(kReferenceTemplates), std::end(kReferenceTemplates));
  ASSERT_TRUE(ChatReference().contains("templates"));
  for (const auto& t : ChatReference()["templates"]) {
    EXPECT_EQ(tested.count(t["name"].get<std::string>()), 1u) << t["name"];
  }
  EXPECT_EQ(ChatReference()["templates"].size(), tested.size());
}

// The tokenizer_reference fixture's conversations: text and ids as HF renders and encodes them.
class ChatTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatTest, MatchesApplyChatTemplateIds) {
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

// A tokenizer folder (stories260K's vocabulary) with the given tokenizer_config.json and
// chat_template.jinja ("" = no file).
std::unique_ptr<Tokenizer> TokenizerWith(const std::string& config, const std::string& jinja,
                                         const std::string& tool_use_jinja = "") {
  const auto dir = testing::ScratchDir("tokenizer-chat-config");
  auto json =
      Tok512ToTokenizerJson((testing::SharedDir() / "models/stories260K/tok512.bin").string(), 512);
  EXPECT_TRUE(json.ok()) << json.status();
  std::ofstream(dir / "tokenizer.json") << *json;
  std::ofstream(dir / "tokenizer_config.json") << config;
  std::filesystem::remove(dir / "chat_template.jinja");
  std::filesystem::remove_all(dir / "additional_chat_templates");
  if (!jinja.empty()) std::ofstream(dir / "chat_template.jinja") << jinja;
  if (!tool_use_jinja.empty()) {
    std::filesystem::create_directories(dir / "additional_chat_templates");
    std::ofstream(dir / "additional_chat_templates" / "tool_use.jinja") << tool_use_jinja;
  }
  auto tok = Tokenizer::FromDirectory(dir.string());
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? std::move(*tok) : nullptr;
}

TEST(ChatTemplate, TemplateSources) {
  const std::vector<ChatMessage> messages = {{"user", "hi"}};
  // No template: FAILED_PRECONDITION, nothing guessed.
  auto tok = TokenizerWith("{}", "");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->ApplyChatTemplate(messages).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A string in tokenizer_config.json.
  tok = TokenizerWith(R"({"chat_template": "[{{ messages[0]['content'] }}]", "bos_token": "<s>"})",
                      "");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->ApplyChatTemplate(messages).value_or("error"), "[hi]");
  // chat_template.jinja wins over the config (transformers 5 saves it there).
  tok = TokenizerWith(R"({"chat_template": "config"})",
                      "{{ bos_token }}jinja {{ messages | length }}\n");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->ApplyChatTemplate(messages).value_or("error"), "jinja 1");
  // Named templates: "default", and "tool_use" when tools are passed (even an empty list).
  tok = TokenizerWith(
      R"({"chat_template": [{"name": "default", "template": "D"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]})",
      "");
  ASSERT_NE(tok, nullptr);
  ChatRequest request;
  request.messages = ojson::array({{{"role", "user"}, {"content", "hi"}}});
  EXPECT_EQ(tok->ApplyChatTemplate(request).value_or("error"), "D");
  request.tools = ojson::array();
  EXPECT_EQ(tok->ApplyChatTemplate(request).value_or("error"), "T0");
  // transformers 5's files: chat_template.jinja and additional_chat_templates/tool_use.jinja
  // replace the config's templates.
  tok = TokenizerWith(R"({"chat_template": "config"})", "file default", "file tool_use");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->ApplyChatTemplate(request).value_or("error"), "file tool_use");
  request.tools.reset();
  EXPECT_EQ(tok->ApplyChatTemplate(request).value_or("error"), "file default");
  // Only a tool_use template: requests without tools have nothing to render (HF refuses too).
  tok = TokenizerWith("{}", "", "tools only");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->ApplyChatTemplate(request).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ChatTemplate, UnparsableTemplateIsFailedPreconditionNamingTheLine) {
  auto tok = TokenizerWith(R"({"chat_template": "ok\n{% for m in messages %}\n{{ m.role }"})", "");
  ASSERT_NE(tok, nullptr);
  auto text = tok->ApplyChatTemplate({{"user", "hi"}});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(text.status().message().find("line 3"), std::string::npos) << text.status();
  // Every request gets the same answer; loading did not fail.
  EXPECT_EQ(tok->ApplyChatTemplate({{"user", "again"}}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ChatTemplate, UnsupportedFilterFailsOnlyWhenReached) {
  const auto config = nlohmann::json::parse(
      R"({"chat_template": "{% if messages | length > 1 %}{{ messages | wordcount }}{% endif %}ok"})");
  ChatTemplate chat = ChatTemplate::FromConfig(config, "");
  ASSERT_TRUE(chat.load_status().ok()) << chat.load_status();
  ASSERT_EQ(chat.unsupported().size(), 1u);
  EXPECT_NE(chat.unsupported()[0].find("wordcount"), std::string::npos);
  ChatRequest request;
  request.messages = ojson::array({{{"role", "user"}, {"content", "a"}}});
  EXPECT_EQ(chat.Render(request).value_or("error"), "ok");
  request.messages.push_back({{"role", "assistant"}, {"content", "b"}});
  auto text = chat.Render(request);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(text.status().message().find("wordcount"), std::string::npos) << text.status();
}

TEST(ChatTemplate, RequestShapeErrorsAreInvalidArgument) {
  const auto config = nlohmann::json::parse(R"({"chat_template": "{{ messages | length }}"})");
  ChatTemplate chat = ChatTemplate::FromConfig(config, "");
  ChatRequest request;
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);  // empty
  request.messages = ojson::array({{{"role", "user"}, {"content", "bad \xff byte"}}});
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.messages = ojson::array({{{"role", "user"}, {"content", "hi"}}});
  request.tools = ojson::object();  // not a list
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.tools.reset();
  request.template_kwargs = {{"messages", 1}};  // reserved
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.template_kwargs = ojson::object();
  request.continue_final_message = true;  // together with add_generation_prompt
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.add_generation_prompt = false;  // the template does not name "content"
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
  request.continue_final_message = false;
  EXPECT_EQ(chat.Render(request).value_or("error"), "1");
  // Nesting past kMaxChatJsonDepth is refused before anything walks it recursively.
  ojson deep = "x";
  for (int i = 0; i < 1000; ++i) {
    ojson outer = ojson::array();
    outer.push_back(std::move(deep));
    deep = std::move(outer);
  }
  request.messages = ojson::array({{{"role", "user"}, {"content", std::move(deep)}}});
  EXPECT_EQ(chat.Render(request).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, InvalidUtf8AndEmptyConversationThroughTheTokenizer) {
  const Tokenizer* tok = testing::LoadFamily("qwen3");
  ASSERT_NE(tok, nullptr);
  auto text = tok->ApplyChatTemplate({{"user", "bad \xff byte"}});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  text = tok->ApplyChatTemplate(std::vector<ChatMessage>{});
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplate, ToolCallArgumentsTextBecomesJson) {
  ojson messages = ojson::parse(R"([
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "type": "function",
       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}},
      {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": {"kept": true}}}]}
  ])");
  ASSERT_TRUE(ParseToolCallArguments(&messages, "chat.messages").ok());
  const ojson& args = messages[1]["tool_calls"][0]["function"]["arguments"];
  ASSERT_TRUE(args.is_object());
  EXPECT_EQ(args.dump(), R"({"city":"Paris","days":2})");  // key order kept
  EXPECT_EQ(messages[1]["tool_calls"][1]["function"]["arguments"].dump(), R"({"kept":true})");
  messages[1]["tool_calls"][0]["function"]["arguments"] = "{not json";
  const absl::Status st = ParseToolCallArguments(&messages, "chat.messages");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("chat.messages[1].tool_calls[0].function.arguments"),
            std::string::npos)
      << st;
}

}  // namespace
}  // namespace dropkv
