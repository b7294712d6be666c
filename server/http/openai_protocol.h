// The OpenAI HTTP API's wire format, apart from any socket: request bodies of /v1/completions and
// /v1/chat/completions become dropkv.v1.GenerateRequest protos (then validated by
// server/validation.cpp exactly as gRPC requests are), engine results become response and
// server-sent-event JSON, and statuses become OpenAI's error object with `param` naming the
// request field. docs/api.md ("HTTP API") lists the fields and extensions.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "dropkv/v1/inference.pb.h"
#include "engine/scheduler/generation.h"

namespace dropkv::openai {

enum class Endpoint { kCompletions, kChatCompletions };

// {"error": {"message", "type", "param", "code"}} with its HTTP status.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::optional<std::string> param;
  std::optional<std::string> code;
};
std::string ErrorJson(const ApiError& error);
ApiError MakeError(int http_status, std::string message, std::optional<std::string> param = {},
                   std::optional<std::string> code = {});

// The model's fill-in-the-middle markers (all empty: it has none, and `suffix` is refused). A
// completions prompt with a suffix becomes prefix + prompt + suffix marker + suffix + middle.
struct FimTokens {
  std::string prefix, suffix, middle;
  bool empty() const { return prefix.empty(); }
};
// The first marker family whose three markers `is_one_token` accepts: StarCoder's
// <fim_prefix>/<fim_suffix>/<fim_middle>, then Qwen's and DeepSeek-Coder-style <|fim_prefix|>...
FimTokens FindFimTokens(const std::function<bool(const std::string&)>& is_one_token);

struct ParseOptions {
  std::vector<std::string> model_names;  // accepted `model` values (the first is the served name)
  int32_t max_new_tokens_limit = 4096;   // the largest max_tokens accepted; chat's default
  FimTokens fim;
};

// A request after parsing: one proto per choice (prompts x best_of, in OpenAI's choice order)
// plus how to shape the answer.
struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::vector<v1::GenerateRequest> choices;
  std::vector<int> prompt_index;  // per choice: which prompt of a batched completions request
  int n = 1;                      // choices answered per prompt
  int best_of = 1;    // generated per prompt (>= n): the n of highest cumulative logprob answer
  bool echo = false;  // completions: the prompt (and its logprobs) before each choice's text
  bool stream = false;
  bool include_usage = false;                   // stream_options.include_usage
  bool logprobs = false;                        // return logprobs in the answer
  bool return_token_ids = false;                // extension: choices[].token_ids
  bool tokens_as_token_ids = false;             // extension: logprob tokens as "token_id:<id>"
  std::string max_tokens_param = "max_tokens";  // the field that set max_new_tokens (errors)
  std::string user;
};

constexpr int kMaxChoices = 128;  // prompts x n
// Deeper bodies are refused before parsing: the parsed tree of a deep body costs tens of bytes a
// level, and no OpenAI request (tool schemas included) comes near this.
constexpr int kMaxJsonDepth = 128;

// Parses a JSON body. nullopt on success (`out` filled), else the error to answer with.
std::optional<ApiError> ParseRequest(Endpoint endpoint, std::string_view body,
                                     const ParseOptions& options, ParsedRequest* out);

// A status from validation, Submit or the engine as an OpenAI error. The proto field path that
// starts a validation message ("sampling.top_p: ...") becomes the OpenAI parameter ("top_p").
// `at_submit`: RESOURCE_EXHAUSTED there is a full queue (429); from the engine, a request larger
// than the KV pool (400).
ApiError ErrorFromStatus(const absl::Status& status, const ParsedRequest& request, int choice_index,
                         bool at_submit);
// "sampling.top_p" -> "top_p", "compression.window" -> "kv_compression.window", ...
std::string ParamOfField(std::string_view proto_field, const ParsedRequest& request,
                         int choice_index);

// The text of one token for logprobs (the tokenizer's decode of that id alone).
using TokenTextFn = std::function<std::string(int32_t)>;

// What one choice produced (accumulated, or one streamed delta).
struct ChoiceOutput {
  int index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobInfo> logprobs;  // a NaN logprob (an echoed first token) is null
  FinishReason finish_reason = FinishReason::kNone;  // kNone: not finished (a delta)
  int64_t text_offset = 0;  // completions logprobs: where `text` starts in the choice's text
};

// usage: OpenAI's counts summed over choices (prompt tokens once per prompt) and the KV extension.
struct UsageTotals {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t kv_tokens_kept = 0;
  std::vector<int64_t> kv_tokens_kept_per_layer;
  int64_t kv_bytes_saved = 0;
  int64_t decode_evicted_kv_tokens = 0;
  int64_t num_preemptions = 0;
  int64_t cached_prompt_tokens = 0;
  // Adds one finished choice; `count_prompt` false for the 2nd.. choice of the same prompt.
  void Add(const GenerationSummary& summary, bool count_prompt);
};

struct ResponseMeta {
  std::string id;  // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;
  std::string model;
};

// best_of > n: per prompt, the n choices of highest cumulative logprob (of their sampled
// tokens), in that order and numbered again; else `choices` unchanged.
std::vector<ChoiceOutput> PickBestOf(const ParsedRequest& request,
                                     std::vector<ChoiceOutput> choices);

// The whole (non-streaming) response.
std::string ResponseJson(const ParsedRequest& request, const ResponseMeta& meta,
                         const std::vector<ChoiceOutput>& choices, const UsageTotals& usage,
                         const TokenTextFn& token_text);
// One server-sent event ("data: {...}\n\n") carrying a choice's delta; for chat, `first` adds
// the assistant role. A finished delta carries its finish_reason.
std::string ChunkEvent(const ParsedRequest& request, const ResponseMeta& meta,
                       const ChoiceOutput& delta, bool first, const TokenTextFn& token_text);
// The include_usage chunk (empty choices), sent before [DONE].
std::string UsageEvent(const ParsedRequest& request, const ResponseMeta& meta,
                       const UsageTotals& usage);
// An error inside a stream that already answered 200.
std::string ErrorEvent(const ApiError& error);
inline constexpr std::string_view kDoneEvent = "data: [DONE]\n\n";

// GET /v1/models; max_model_len and vocab_size are extensions (dropkv-loadgen reads them).
std::string ModelsJson(const std::string& served_model_name, int64_t created, int64_t max_model_len,
                       int32_t vocab_size);

}  // namespace dropkv::openai
