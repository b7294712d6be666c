// server/validation.h: one case per rule, asserting the exact code and the field named first.
#include "server/validation.h"

#include <gtest/gtest.h>

#include <cmath>

#include "dropkv/v1/inference.pb.h"
#include "engine/compression/compression.h"
#include "engine/tokenizer/chat_template.h"
#include "server/compression_message.h"
#include "tests/scheduler/fake_tokenizer.h"

namespace dropkv {
namespace {

class ValidationTest : public ::testing::Test {
 protected:
  ValidationTest() {
    limits_.vocab_size = 64;
    limits_.max_context_len = 32;
    limits_.max_new_tokens_limit = 100;
    limits_.max_stop_strings = 2;
    limits_.max_request_bytes = 4096;
    ok_.set_prompt("abc");
    ok_.set_max_new_tokens(4);
  }
  absl::StatusOr<GenerationRequest> Check(const v1::GenerateRequest& r) {
    return ValidateGenerateRequest(r, limits_, &tokenizer_);
  }
  // Expects INVALID_ARGUMENT whose message starts with "<field>: ".
  void ExpectInvalid(const v1::GenerateRequest& r, const std::string& field) {
    auto result = Check(r);
    ASSERT_FALSE(result.ok()) << "accepted; expected an error naming " << field;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(result.status().message()).rfind(field + ": ", 0), 0u)
        << result.status().message();
  }

  testing::FakeTokenizer tokenizer_;
  ValidationLimits limits_;
  v1::GenerateRequest ok_;
};

TEST_F(ValidationTest, ValidRequestIsMapped) {
  v1::GenerateRequest r = ok_;
  r.mutable_sampling()->set_temperature(0.7f);
  r.mutable_sampling()->set_top_p(0.9f);
  r.mutable_sampling()->set_top_k(5);
  r.mutable_sampling()->set_seed(9);
  r.add_stop("xy");
  r.add_stop_token_ids(7);
  r.mutable_compression()->set_method("dropkv");
  r.mutable_compression()->set_compression_ratio(0.75);
  r.mutable_compression()->set_allocator("pyramid");
  r.mutable_compression()->set_window(4);
  r.mutable_compression()->set_pooling("avg");
  r.mutable_compression()->set_pooling_kernel(5);
  r.mutable_compression()->set_chunk_policy("every_chunk");
  r.mutable_compression()->set_chunk_size(8);
  r.set_request_id("my-id");
  r.set_priority(-3);
  r.set_keep_conversation(true);
  auto g = Check(r);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->request_id, "my-id");
  EXPECT_EQ(g->priority, -3);
  EXPECT_TRUE(g->keep_conversation);
  EXPECT_EQ(g->prompt_ids, (std::vector<int32_t>{1, 'a' - '0', 'b' - '0', 'c' - '0'}));
  EXPECT_EQ(g->sampling.max_new_tokens, 4);
  EXPECT_FLOAT_EQ(g->sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(g->sampling.top_p, 0.9f);
  EXPECT_EQ(g->sampling.top_k, 5);
  EXPECT_EQ(g->sampling.seed, 9u);
  EXPECT_EQ(g->sampling.stop_strings, std::vector<std::string>{"xy"});
  EXPECT_EQ(g->sampling.stop_token_ids, std::vector<int32_t>{7});
  EXPECT_EQ(g->compression.method, ScoreMethod::kDropKV);
  EXPECT_DOUBLE_EQ(g->compression.keep_ratio, 0.25);
  EXPECT_EQ(g->compression.allocator, BudgetAllocator::kPyramid);
  EXPECT_EQ(g->compression.window, 4);
  EXPECT_EQ(g->compression.pooling, PoolingType::kAvg);
  EXPECT_EQ(g->compression.pooling_kernel, 5);
  EXPECT_EQ(g->compression.chunk_policy, ChunkPolicy::kEveryChunk);
  EXPECT_EQ(g->compression.chunk_size, 8);
}

TEST_F(ValidationTest, DefaultsAndGeneratedRequestId) {
  limits_.default_compression.method = ScoreMethod::kSnapKV;
  limits_.default_compression.keep_ratio = 0.3;
  v1::GenerateRequest r;
  r.mutable_token_ids()->add_ids(5);
  r.set_max_new_tokens(1);
  auto g = Check(r);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE(g->request_id.empty());
  EXPECT_EQ(g->prompt_ids, std::vector<int32_t>{5});
  EXPECT_FLOAT_EQ(g->sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(g->sampling.top_p, 1.0f);
  EXPECT_EQ(g->compression.method, ScoreMethod::kSnapKV);
  EXPECT_DOUBLE_EQ(g->compression.keep_ratio, 0.3);
  r.set_add_special_tokens(false);
  r.clear_token_ids();
  r.set_prompt("ab");
  g = Check(r);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->prompt_ids.size(), 2u);  // no BOS
}

TEST_F(ValidationTest, ChatUsesTemplate) {
  v1::GenerateRequest r;
  r.set_max_new_tokens(2);
  auto* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("hi");
  auto g = Check(r);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->prompt_ids, *tokenizer_.Encode("hi<", false));
  m->set_role("robot");
  ExpectInvalid(r, "chat.messages[0].role");
}

TEST_F(ValidationTest, ChatMapsToTemplateInput) {
  v1::ChatMessages chat;
  auto* user = chat.add_messages();
  user->set_role("user");
  user->set_content("weather?");
  auto* assistant = chat.add_messages();
  assistant->set_role("assistant");
  auto* call = assistant->add_tool_calls();
  call->set_id("c1");
  call->mutable_function()->set_name("get_weather");
  call->mutable_function()->set_arguments(R"({"city": "Paris"})");
  auto* tool = chat.add_messages();
  tool->set_role("tool");
  tool->set_content("sunny");
  tool->set_tool_call_id("c1");
  tool->set_name("get_weather");
  chat.set_tools_json(R"([{"type": "function", "function": {"name": "get_weather"}}])");
  chat.set_chat_template_kwargs_json(R"({"enable_thinking": false})");
  auto request = MapChatMessages(chat, "chat");
  ASSERT_TRUE(request.ok()) << request.status();
  // OpenAI's shape, arguments parsed, empty optional fields left out, key order kept.
  EXPECT_EQ(request->messages.dump(),
            R"([{"role":"user","content":"weather?"},)"
            R"({"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function",)"
            R"("function":{"name":"get_weather","arguments":{"city":"Paris"}}}]},)"
            R"({"role":"tool","content":"sunny","tool_call_id":"c1","name":"get_weather"}])");
  ASSERT_TRUE(request->tools.has_value());
  EXPECT_EQ(request->tools->dump(), R"([{"type":"function","function":{"name":"get_weather"}}])");
  EXPECT_FALSE(request->documents.has_value());
  EXPECT_EQ(request->template_kwargs.dump(), R"({"enable_thinking":false})");
  EXPECT_TRUE(request->add_generation_prompt);
  EXPECT_FALSE(request->continue_final_message);
  // continue_final_message turns the generation prompt off unless it is set.
  chat.set_continue_final_message(true);
  request = MapChatMessages(chat, "chat");
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_FALSE(request->add_generation_prompt);
  EXPECT_TRUE(request->continue_final_message);
}

TEST_F(ValidationTest, ChatErrorsNameTheField) {
  v1::GenerateRequest r;
  r.set_max_new_tokens(2);
  auto* chat = r.mutable_chat();
  auto* m = chat->add_messages();
  m->set_role("user");
  m->set_content("hi");
  ASSERT_TRUE(Check(r).ok());
  m->set_content("bad \xff");
  ExpectInvalid(r, "chat.messages[0].content");
  m->set_content("hi");
  auto* assistant = chat->add_messages();
  assistant->set_role("assistant");
  auto* call = assistant->add_tool_calls();
  ExpectInvalid(r, "chat.messages[1].tool_calls[0].function.name");
  call->mutable_function()->set_name("f");
  call->mutable_function()->set_arguments("{not json");
  ExpectInvalid(r, "chat.messages[1].tool_calls[0].function.arguments");
  call->mutable_function()->set_arguments("{}");
  ASSERT_TRUE(Check(r).ok());
  const std::string deep = std::string(100, '[') + std::string(100, ']');  // > kMaxChatJsonDepth
  for (const std::string& bad : {std::string("{}"), std::string("[1]"), std::string("not"), deep}) {
    chat->set_tools_json(bad);
    ExpectInvalid(r, "chat.tools_json");
  }
  chat->clear_tools_json();
  chat->set_documents_json("{}");
  ExpectInvalid(r, "chat.documents_json");
  chat->clear_documents_json();
  for (const char* bad : {"[]", R"({"messages": []})", R"({"add_generation_prompt": true})"}) {
    chat->set_chat_template_kwargs_json(bad);
    ExpectInvalid(r, "chat.chat_template_kwargs_json");
  }
  chat->clear_chat_template_kwargs_json();
  chat->set_continue_final_message(true);
  ASSERT_TRUE(Check(r).ok());
  chat->set_add_generation_prompt(true);
  ExpectInvalid(r, "chat.continue_final_message");
}

// A tokenizer whose chat template is unusable, as a model without one.
class NoTemplateTokenizer : public testing::FakeTokenizer {
 public:
  using Tokenizer::ApplyChatTemplate;
  absl::StatusOr<std::string> ApplyChatTemplate(const ChatRequest&) const override {
    return absl::FailedPreconditionError("the model has no chat template");
  }
};

TEST_F(ValidationTest, ChatTemplateErrorsKeepTheirCode) {
  NoTemplateTokenizer tokenizer;
  v1::GenerateRequest r;
  r.set_max_new_tokens(2);
  auto* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("hi");
  auto result = ValidateGenerateRequest(r, limits_, &tokenizer);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(result.status().message(), "chat: the model has no chat template");
}

TEST_F(ValidationTest, EmptyInput) {
  v1::GenerateRequest r;
  r.set_max_new_tokens(4);
  ExpectInvalid(r, "input");
  r.set_prompt("");
  ExpectInvalid(r, "prompt");
  r.clear_prompt();
  r.mutable_token_ids();
  ExpectInvalid(r, "token_ids.ids");
  r.clear_token_ids();
  r.mutable_chat();
  ExpectInvalid(r, "chat.messages");
}

TEST_F(ValidationTest, TwoInputs) {
  v1::GenerateRequest r = ok_;
  r.mutable_token_ids()->add_ids(4);
  ExpectInvalid(r, "input");
}

TEST_F(ValidationTest, UnknownTokenIds) {
  v1::GenerateRequest r;
  r.set_max_new_tokens(4);
  r.mutable_token_ids()->add_ids(4);
  r.mutable_token_ids()->add_ids(64);
  ExpectInvalid(r, "token_ids.ids[1]");
  r.mutable_token_ids()->set_ids(1, -1);
  ExpectInvalid(r, "token_ids.ids[1]");
  v1::GenerateRequest s = ok_;
  s.add_stop_token_ids(99);
  ExpectInvalid(s, "stop_token_ids[0]");
}

TEST_F(ValidationTest, PromptLongerThanContext) {
  v1::GenerateRequest r = ok_;
  r.set_prompt(std::string(40, 'a'));
  ExpectInvalid(r, "input");
  r.set_prompt(std::string(30, 'a'));  // 31 tokens with BOS < 32
  EXPECT_TRUE(Check(r).ok());
}

TEST_F(ValidationTest, MaxNewTokens) {
  v1::GenerateRequest r = ok_;
  r.set_max_new_tokens(0);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(-3);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(101);
  ExpectInvalid(r, "max_new_tokens");
  r.set_max_new_tokens(100);
  EXPECT_TRUE(Check(r).ok());
}

TEST_F(ValidationTest, SamplingRanges) {
  v1::GenerateRequest r = ok_;
  r.mutable_sampling()->set_temperature(-0.1f);
  ExpectInvalid(r, "sampling.temperature");
  r = ok_;
  r.mutable_sampling()->set_top_p(0.0f);
  ExpectInvalid(r, "sampling.top_p");
  r.mutable_sampling()->set_top_p(1.01f);
  ExpectInvalid(r, "sampling.top_p");
  r.mutable_sampling()->set_top_p(1.0f);
  EXPECT_TRUE(Check(r).ok());
  r = ok_;
  r.mutable_sampling()->set_top_k(-1);
  ExpectInvalid(r, "sampling.top_k");
  r = ok_;
  r.mutable_sampling()->set_min_p(1.0f);
  ExpectInvalid(r, "sampling.min_p");
  r = ok_;
  r.mutable_sampling()->set_repetition_penalty(0.0f);
  ExpectInvalid(r, "sampling.repetition_penalty");
  r = ok_;
  r.mutable_sampling()->set_num_top_logprobs(21);
  ExpectInvalid(r, "sampling.num_top_logprobs");
}

TEST_F(ValidationTest, LogitBias) {
  v1::GenerateRequest r = ok_;
  (*r.mutable_sampling()->mutable_logit_bias())[5] = -100.0f;
  (*r.mutable_sampling()->mutable_logit_bias())[2] = 100.0f;
  auto got = Check(r);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<std::pair<int32_t, float>> want = {{2, 100.0f}, {5, -100.0f}};  // sorted
  EXPECT_EQ(got->sampling.logit_bias, want);
  (*r.mutable_sampling()->mutable_logit_bias())[64] = 1.0f;  // the vocabulary is 64
  ExpectInvalid(r, "sampling.logit_bias");
  r = ok_;
  (*r.mutable_sampling()->mutable_logit_bias())[-1] = 1.0f;
  ExpectInvalid(r, "sampling.logit_bias");
  r = ok_;
  (*r.mutable_sampling()->mutable_logit_bias())[1] = 100.5f;
  ExpectInvalid(r, "sampling.logit_bias");
  r = ok_;
  (*r.mutable_sampling()->mutable_logit_bias())[1] = std::nanf("");
  ExpectInvalid(r, "sampling.logit_bias");
  r = ok_;
  limits_.max_logit_bias = 3;
  for (int id = 0; id < 4; ++id) (*r.mutable_sampling()->mutable_logit_bias())[id] = 1.0f;
  ExpectInvalid(r, "sampling.logit_bias");
}

TEST_F(ValidationTest, MinTokensAndPromptLogprobs) {
  v1::GenerateRequest r = ok_;
  r.mutable_sampling()->set_min_tokens(4);  // = max_new_tokens
  auto got = Check(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->sampling.min_tokens, 4);
  r.mutable_sampling()->set_min_tokens(5);
  ExpectInvalid(r, "sampling.min_tokens");
  r.mutable_sampling()->set_min_tokens(-1);
  ExpectInvalid(r, "sampling.min_tokens");
  r = ok_;
  r.mutable_sampling()->set_return_prompt_logprobs(true);
  r.mutable_compression()->set_method("dropkv");
  ASSERT_TRUE(Check(r).ok());  // the default chunk policy compresses after the last chunk
  EXPECT_TRUE(Check(r)->sampling.return_prompt_logprobs);
  r.mutable_compression()->set_chunk_policy("every_chunk");
  ExpectInvalid(r, "sampling.return_prompt_logprobs");
  r = ok_;
  r.mutable_sampling()->set_return_prompt_logprobs(true);
  limits_.prompt_logprobs = false;  // a tensor-parallel server
  ExpectInvalid(r, "sampling.return_prompt_logprobs");
}

TEST_F(ValidationTest, UnknownMethodAndAllocator) {
  v1::GenerateRequest r = ok_;
  r.mutable_compression()->set_method("magic");
  ExpectInvalid(r, "compression.method");
  r = ok_;
  r.mutable_compression()->set_allocator("fancy");
  ExpectInvalid(r, "compression.allocator");
  r = ok_;
  r.mutable_compression()->set_pooling("median");
  ExpectInvalid(r, "compression.pooling");
  r = ok_;
  r.mutable_compression()->set_chunk_policy("sometimes");
  ExpectInvalid(r, "compression.chunk_policy");
}

TEST_F(ValidationTest, BudgetOutOfRange) {
  v1::GenerateRequest r = ok_;
  r.mutable_compression()->set_keep_ratio(0.0);
  ExpectInvalid(r, "compression.keep_ratio");
  r.mutable_compression()->set_keep_ratio(1.5);
  ExpectInvalid(r, "compression.keep_ratio");
  r.mutable_compression()->set_compression_ratio(1.0);
  ExpectInvalid(r, "compression.compression_ratio");
  r.mutable_compression()->set_compression_ratio(-0.1);
  ExpectInvalid(r, "compression.compression_ratio");
  r.mutable_compression()->set_budget_tokens(0);
  ExpectInvalid(r, "compression.budget_tokens");
  r.mutable_compression()->set_budget_tokens(33);
  ExpectInvalid(r, "compression.budget_tokens");
  r.mutable_compression()->set_budget_tokens(16);
  EXPECT_TRUE(Check(r).ok());
}

TEST_F(ValidationTest, WindowPoolingKernelChunkSize) {
  v1::GenerateRequest r = ok_;
  r.mutable_compression()->set_window(0);
  ExpectInvalid(r, "compression.window");
  r = ok_;
  r.mutable_compression()->set_pooling_kernel(4);
  ExpectInvalid(r, "compression.pooling_kernel");
  r.mutable_compression()->set_pooling_kernel(0);
  ExpectInvalid(r, "compression.pooling_kernel");
  r = ok_;
  r.mutable_compression()->set_window(8);
  r.mutable_compression()->set_chunk_size(4);
  ExpectInvalid(r, "compression.chunk_size");
}

// Every integer a client sets has an upper bound: a pooling kernel of 2^31 - 1 on a 10-token
// prompt once held the engine thread for a minute (docs/reliability.md).
TEST_F(ValidationTest, CompressionIntegersAreBoundedAbove) {
  const int32_t kHuge = 2147483647;
  v1::GenerateRequest r = ok_;
  r.mutable_compression()->set_pooling_kernel(kHuge);
  ExpectInvalid(r, "compression.pooling_kernel");
  r.mutable_compression()->set_pooling_kernel(compression::kMaxPoolingKernel);
  EXPECT_TRUE(Check(r).ok());
  r = ok_;
  r.mutable_compression()->set_window(kHuge);
  ExpectInvalid(r, "compression.window");
  r = ok_;
  r.mutable_compression()->set_num_sinks(kHuge);
  ExpectInvalid(r, "compression.num_sinks");
  r = ok_;
  r.mutable_compression()->set_chunk_size(kHuge);
  ExpectInvalid(r, "compression.chunk_size");
  r = ok_;
  r.mutable_compression()->set_budget_cap_tokens(int64_t{1} << 40);
  ExpectInvalid(r, "compression.budget_cap_tokens");
  r = ok_;
  r.mutable_compression()->set_decode_margin(kHuge);
  ExpectInvalid(r, "compression.decode_margin");
  r = ok_;
  r.mutable_compression()->set_tolerance(1.0);
  ExpectInvalid(r, "compression.tolerance");
}

// The request maps to the compression schema by field name: a CompressionSettings field without a
// row would be ignored silently, so every field must have one.
TEST(CompressionSchemaMappingTest, EveryRequestFieldHasASchemaRow) {
  const auto* descriptor = v1::CompressionSettings::descriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    EXPECT_NE(compression::FindCompressionField(descriptor->field(i)->name()), nullptr)
        << descriptor->field(i)->name() << " has no row in engine/compression/schema.cpp";
  }
}

// ServerInfo's default compression, read back as a request over other defaults, gives the
// server's defaults again (every field the message has).
TEST(CompressionSchemaMappingTest, DefaultsRoundTripThroughTheMessage) {
  CompressionParams server;
  server.method = ScoreMethod::kSnapKV;
  server.budget_tokens = 12;
  server.window = 4;
  server.pooling = PoolingType::kNone;
  server.pooling_kernel = 3;
  server.protect_sinks = true;
  server.num_sinks = 2;
  server.chunk_policy = ChunkPolicy::kEveryChunk;
  server.chunk_size = 16;
  server.decode_margin = 8;
  server.random_seed = 5;
  v1::CompressionSettings message;
  CompressionToMessage(server, &message);
  EXPECT_EQ(message.budget_case(), v1::CompressionSettings::kBudgetTokens);
  absl::StatusOr<CompressionParams> back =
      MapCompression(message, CompressionParams{}, /*max_context_len=*/32);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(compression::EncodeCompression(*back), compression::EncodeCompression(server));
  // A keep ratio in the request replaces a default token budget.
  v1::CompressionSettings keep;
  keep.set_keep_ratio(0.5);
  back = MapCompression(keep, server, 32);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->budget_tokens.has_value());
  EXPECT_EQ(back->keep_ratio, 0.5);
}

TEST_F(ValidationTest, StopStrings) {
  v1::GenerateRequest r = ok_;
  r.add_stop("a");
  r.add_stop("b");
  r.add_stop("c");
  ExpectInvalid(r, "stop");
  r = ok_;
  r.add_stop("");
  ExpectInvalid(r, "stop[0]");
}

TEST_F(ValidationTest, OversizedRequest) {
  v1::GenerateRequest r = ok_;
  r.set_prompt(std::string(5000, 'a'));
  ExpectInvalid(r, "request");
}

TEST_F(ValidationTest, RequestIdAndBadPromptText) {
  v1::GenerateRequest r = ok_;
  r.set_request_id("has space");
  ExpectInvalid(r, "request_id");
  r = ok_;
  r.set_prompt("\x01");  // the tokenizer refuses it
  ExpectInvalid(r, "prompt");
}

TEST_F(ValidationTest, NoTokenizerAcceptsOnlyTokenIds) {
  auto g = ValidateGenerateRequest(ok_, limits_, nullptr);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(g.status().message()).rfind("prompt: ", 0), 0u);
}

TEST(ToGrpcStatusTest, MapsEveryCanonicalCode) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const std::pair<absl::Status, grpc::StatusCode> cases[] = {
      {absl::InvalidArgumentError("x"), grpc::StatusCode::INVALID_ARGUMENT},
      {absl::ResourceExhaustedError("x"), grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::UnavailableError("x"), grpc::StatusCode::UNAVAILABLE},
      {absl::UnauthenticatedError("x"), grpc::StatusCode::UNAUTHENTICATED},
      {absl::DeadlineExceededError("x"), grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::CancelledError("x"), grpc::StatusCode::CANCELLED},
      {absl::FailedPreconditionError("x"), grpc::StatusCode::FAILED_PRECONDITION},
      {absl::InternalError("x"), grpc::StatusCode::INTERNAL},
      {absl::NotFoundError("x"), grpc::StatusCode::NOT_FOUND},
  };
  for (const auto& [in, code] : cases) {
    grpc::Status out = ToGrpcStatus(in);
    EXPECT_EQ(out.error_code(), code);
    EXPECT_EQ(out.error_message(), "x");
  }
}

}  // namespace
}  // namespace dropkv
