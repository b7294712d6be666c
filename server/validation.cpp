#include "server/validation.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "dropkv/v1/inference.pb.h"
#include "engine/common/text_value.h"
#include "engine/compression/compression.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/unicode.h"
#include "server/compression_message.h"

namespace dropkv {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

std::string NewRequestId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrCat("req-", absl::Hex(rng(), absl::kZeroPad16));
}

absl::Status CheckTokenIds(const google::protobuf::RepeatedField<int32_t>& ids,
                           absl::string_view field, int32_t vocab_size) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || (vocab_size > 0 && ids[i] >= vocab_size))
      return Invalid(
          absl::StrCat(field, "[", i, "]"),
          absl::StrCat("unknown token id ", ids[i], " (vocabulary size ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SamplingParams> MapSampling(const v1::SamplingParams& s,
                                           const ValidationLimits& limits) {
  SamplingParams p;
  if (s.has_temperature()) {
    if (!(s.temperature() >= 0.0f) || !std::isfinite(s.temperature()))
      return Invalid("sampling.temperature", absl::StrCat("must be >= 0, got ", s.temperature()));
    p.temperature = s.temperature();
  }
  if (s.has_top_k()) {
    if (s.top_k() < 0)
      return Invalid("sampling.top_k", absl::StrCat("must be >= 0, got ", s.top_k()));
    p.top_k = s.top_k();
  }
  if (s.has_top_p()) {
    if (!(s.top_p() > 0.0f && s.top_p() <= 1.0f))
      return Invalid("sampling.top_p", absl::StrCat("must be in (0, 1], got ", s.top_p()));
    p.top_p = s.top_p();
  }
  if (s.has_min_p()) {
    if (!(s.min_p() >= 0.0f && s.min_p() < 1.0f))
      return Invalid("sampling.min_p", absl::StrCat("must be in [0, 1), got ", s.min_p()));
    p.min_p = s.min_p();
  }
  if (s.has_repetition_penalty()) {
    if (!(s.repetition_penalty() > 0.0f) || !std::isfinite(s.repetition_penalty()))
      return Invalid("sampling.repetition_penalty",
                     absl::StrCat("must be > 0, got ", s.repetition_penalty()));
    p.repetition_penalty = s.repetition_penalty();
  }
  if (s.has_presence_penalty()) {
    if (!std::isfinite(s.presence_penalty()))
      return Invalid("sampling.presence_penalty", "must be finite");
    p.presence_penalty = s.presence_penalty();
  }
  if (s.has_frequency_penalty()) {
    if (!std::isfinite(s.frequency_penalty()))
      return Invalid("sampling.frequency_penalty", "must be finite");
    p.frequency_penalty = s.frequency_penalty();
  }
  if (s.has_seed()) p.seed = s.seed();
  p.ignore_eos = s.ignore_eos();
  p.return_logprobs = s.return_logprobs();
  if (s.num_top_logprobs() < 0 || s.num_top_logprobs() > limits.max_top_logprobs)
    return Invalid(
        "sampling.num_top_logprobs",
        absl::StrCat("must be in [0, ", limits.max_top_logprobs, "], got ", s.num_top_logprobs()));
  p.num_top_logprobs = s.num_top_logprobs();
  if (s.logit_bias_size() > limits.max_logit_bias)
    return Invalid("sampling.logit_bias", absl::StrCat("too many entries: ", s.logit_bias_size(),
                                                       " (limit ", limits.max_logit_bias, ")"));
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || (limits.vocab_size > 0 && id >= limits.vocab_size))
      return Invalid(
          "sampling.logit_bias",
          absl::StrCat("unknown token id ", id, " (vocabulary size ", limits.vocab_size, ")"));
    if (!(bias >= -100.0f && bias <= 100.0f))
      return Invalid("sampling.logit_bias",
                     absl::StrCat("the bias of token ", id, " must be in [-100, 100], got ", bias));
    p.logit_bias.emplace_back(id, bias);
  }
  // Map order is unspecified: sorted, the same request gives the same device tensors.
  std::sort(p.logit_bias.begin(), p.logit_bias.end());
  if (s.min_tokens() < 0)
    return Invalid("sampling.min_tokens", absl::StrCat("must be >= 0, got ", s.min_tokens()));
  p.min_tokens = s.min_tokens();
  if (s.return_prompt_logprobs() && !limits.prompt_logprobs)
    return Invalid("sampling.return_prompt_logprobs",
                   "not supported with tensor parallelism on this server");
  p.return_prompt_logprobs = s.return_prompt_logprobs();
  return p;
}

// Roles the chat templates of the families we serve know; anything else is a typo or an
// injection attempt (a role is pasted into the prompt verbatim).
constexpr absl::string_view kChatRoles[] = {"system", "user",      "assistant",
                                            "tool",   "developer", "ipython"};

// A JSON text field: empty -> nullopt; otherwise it must parse to `want_array` / an object.
absl::StatusOr<std::optional<nlohmann::ordered_json>> ParseJsonField(const std::string& text,
                                                                     absl::string_view field,
                                                                     bool want_array) {
  if (text.empty()) return std::nullopt;
  auto json = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Invalid(field, "is not valid JSON");
  if (JsonNestedDeeperThan(json, kMaxChatJsonDepth))
    return Invalid(field, absl::StrCat("nests deeper than ", kMaxChatJsonDepth, " levels"));
  if (want_array) {
    if (!json.is_array()) return Invalid(field, "must be a JSON array of objects");
    for (size_t i = 0; i < json.size(); ++i) {
      if (!json[i].is_object()) {
        return Invalid(field, absl::StrCat("element ", i, " is not a JSON object"));
      }
    }
  } else if (!json.is_object()) {
    return Invalid(field, "must be a JSON object");
  }
  return std::optional<nlohmann::ordered_json>(std::move(json));
}

}  // namespace

absl::StatusOr<ChatRequest> MapChatMessages(const v1::ChatMessages& chat, absl::string_view field) {
  ChatRequest out;
  if (chat.messages().empty()) return Invalid(absl::StrCat(field, ".messages"), "is empty");
  for (int i = 0; i < chat.messages_size(); ++i) {
    const v1::ChatMessage& m = chat.messages(i);
    const std::string at = absl::StrCat(field, ".messages[", i, "]");
    if (std::find(std::begin(kChatRoles), std::end(kChatRoles), m.role()) == std::end(kChatRoles))
      return Invalid(absl::StrCat(at, ".role"),
                     absl::StrCat("must be system|user|assistant|tool|developer|ipython, got '",
                                  m.role(), "'"));
    if (!unicode::IsValidUtf8(m.content()))
      return Invalid(absl::StrCat(at, ".content"), "is not valid UTF-8");
    nlohmann::ordered_json message = {{"role", m.role()}, {"content", m.content()}};
    if (!m.tool_calls().empty()) {
      auto& calls = message["tool_calls"] = nlohmann::ordered_json::array();
      for (int j = 0; j < m.tool_calls_size(); ++j) {
        const v1::ToolCall& call = m.tool_calls(j);
        const std::string call_at = absl::StrCat(at, ".tool_calls[", j, "]");
        if (call.function().name().empty())
          return Invalid(absl::StrCat(call_at, ".function.name"), "is empty");
        nlohmann::ordered_json json_call = nlohmann::ordered_json::object();
        if (!call.id().empty()) json_call["id"] = call.id();
        json_call["type"] = call.type().empty() ? "function" : call.type();
        json_call["function"] = {
            {"name", call.function().name()},
            {"arguments", call.function().arguments().empty() ? std::string("{}")
                                                              : call.function().arguments()}};
        calls.push_back(std::move(json_call));
      }
    }
    if (!m.tool_call_id().empty()) message["tool_call_id"] = m.tool_call_id();
    if (!m.name().empty()) message["name"] = m.name();
    out.messages.push_back(std::move(message));
  }
  // Arguments arrive as JSON text; templates expect objects.
  if (absl::Status st = ParseToolCallArguments(&out.messages, absl::StrCat(field, ".messages"));
      !st.ok())
    return st;
  auto tools = ParseJsonField(chat.tools_json(), absl::StrCat(field, ".tools_json"), true);
  if (!tools.ok()) return tools.status();
  out.tools = std::move(*tools);
  auto documents =
      ParseJsonField(chat.documents_json(), absl::StrCat(field, ".documents_json"), true);
  if (!documents.ok()) return documents.status();
  out.documents = std::move(*documents);
  const std::string kwargs_field = absl::StrCat(field, ".chat_template_kwargs_json");
  auto kwargs = ParseJsonField(chat.chat_template_kwargs_json(), kwargs_field, false);
  if (!kwargs.ok()) return kwargs.status();
  if (kwargs->has_value()) {
    for (std::string_view reserved : kChatReservedVariables) {
      if ((*kwargs)->contains(std::string(reserved)))
        return Invalid(kwargs_field, absl::StrCat("may not set '", std::string(reserved), "'"));
    }
    out.template_kwargs = std::move(**kwargs);
  }
  out.continue_final_message = chat.continue_final_message();
  out.add_generation_prompt =
      chat.has_add_generation_prompt() ? chat.add_generation_prompt() : !out.continue_final_message;
  if (out.continue_final_message && out.add_generation_prompt)
    return Invalid(absl::StrCat(field, ".continue_final_message"),
                   "cannot be combined with add_generation_prompt");
  return out;
}

absl::StatusOr<std::vector<int32_t>> ChatToTokenIds(const v1::ChatMessages& chat,
                                                    absl::string_view field,
                                                    const Tokenizer& tokenizer) {
  auto request = MapChatMessages(chat, field);
  if (!request.ok()) return request.status();
  auto text = tokenizer.ApplyChatTemplate(*request);
  if (!text.ok())
    return absl::Status(text.status().code(), absl::StrCat(field, ": ", text.status().message()));
  // The template already holds the special tokens (HF apply_chat_template does the same).
  auto ids = tokenizer.Encode(*text, /*add_special_tokens=*/false);
  if (!ids.ok()) return Invalid(field, ids.status().message());
  return ids;
}

absl::StatusOr<CompressionParams> MapCompression(const v1::CompressionSettings& c,
                                                 const CompressionParams& defaults,
                                                 int64_t max_context_len, int32_t num_layers) {
  CompressionParams p = defaults;
  // A budget form given in the request replaces the server's default budget whatever its form.
  if (c.budget_case() != v1::CompressionSettings::BUDGET_NOT_SET) p.budget_tokens.reset();
  // Each schema row reads the field of its name, when the request sets it (an empty string is
  // unset: the server's default stays).
  for (const compression::CompressionField& field : compression::CompressionFields()) {
    const std::optional<std::string> text = CompressionMessageText(c, field);
    if (!text) continue;
    const std::string name = absl::StrCat("compression.", AbslView(field.name));
    // Budgets: the lower bound is compression's, the upper one this server's context (0 is
    // "none" in the config file, not a budget a request may ask for).
    if (field.name == "budget_tokens" &&
        (c.budget_tokens() < 1 || (max_context_len > 0 && c.budget_tokens() > max_context_len)))
      return Invalid(name, absl::StrCat("must be in [1, ",
                                        max_context_len > 0 ? max_context_len
                                                            : compression::kMaxCompressionTokens,
                                        "], got ", c.budget_tokens()));
    if (absl::Status s = field.set(p, *text); !s.ok()) return Invalid(name, s.message());
  }
  // Ranges and consistency: compression's one validator (with the model's depth when known).
  absl::Status valid = compression::ValidateCompression(p, num_layers);
  // The validator's messages start with the field ("window: ...").
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("compression.", valid.message()));
  return p;
}

absl::StatusOr<GenerationRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                          const ValidationLimits& limits,
                                                          const Tokenizer* tokenizer) {
  // Size first: everything below may be proportional to it.
  const size_t request_bytes = request.ByteSizeLong();
  if (limits.max_request_bytes > 0 &&
      static_cast<int64_t>(request_bytes) > limits.max_request_bytes)
    return Invalid("request", absl::StrCat("oversized: ", request_bytes, " bytes (limit ",
                                           limits.max_request_bytes, ")"));
  GenerationRequest out;
  // request_id: echoed back and logged, so keep it short and printable.
  if (request.request_id().size() > static_cast<size_t>(limits.max_request_id_len))
    return Invalid("request_id", absl::StrCat("longer than ", limits.max_request_id_len, " bytes"));
  for (unsigned char ch : request.request_id())
    if (ch < 0x21 || ch > 0x7e)
      return Invalid("request_id", "must be printable ASCII without spaces");
  out.request_id = request.request_id().empty() ? NewRequestId() : request.request_id();
  out.priority = request.priority();
  out.keep_conversation = request.keep_conversation();

  // Input: exactly one of prompt / token_ids / chat.
  const int num_inputs = static_cast<int>(request.has_prompt()) +
                         static_cast<int>(request.has_token_ids()) +
                         static_cast<int>(request.has_chat());
  if (num_inputs == 0) return Invalid("input", "one of prompt, token_ids or chat is required");
  if (num_inputs > 1)
    return Invalid("input", "set exactly one of prompt, token_ids or chat, not several");
  if (request.has_prompt()) {
    if (request.prompt().empty()) return Invalid("prompt", "is empty");
    if (tokenizer == nullptr)
      return Invalid("prompt", "this server has no tokenizer; send token_ids");
    const bool add_special = !request.has_add_special_tokens() || request.add_special_tokens();
    auto ids = tokenizer->Encode(request.prompt(), add_special);
    if (!ids.ok()) return Invalid("prompt", ids.status().message());
    out.prompt_ids = std::move(*ids);
  } else if (request.has_token_ids()) {
    if (request.token_ids().ids().empty()) return Invalid("token_ids.ids", "is empty");
    absl::Status st = CheckTokenIds(request.token_ids().ids(), "token_ids.ids", limits.vocab_size);
    if (!st.ok()) return st;
    out.prompt_ids.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
  } else {
    if (request.chat().messages().empty()) return Invalid("chat.messages", "is empty");
    if (tokenizer == nullptr)
      return Invalid("chat", "this server has no tokenizer; send token_ids");
    auto ids = ChatToTokenIds(request.chat(), "chat", *tokenizer);
    if (!ids.ok()) return ids.status();
    out.prompt_ids = std::move(*ids);
  }
  if (out.prompt_ids.empty()) return Invalid("input", "the prompt has no tokens");

  const int64_t prompt_len = static_cast<int64_t>(out.prompt_ids.size());
  const int64_t max_prompt =
      limits.max_prompt_tokens > 0 ? limits.max_prompt_tokens : limits.max_context_len;
  if (max_prompt > 0 && prompt_len >= max_prompt)
    return Invalid("input", absl::StrCat("prompt of ", prompt_len,
                                         " tokens is longer than the model context (limit ",
                                         max_prompt - 1, ")"));

  if (request.max_new_tokens() <= 0 || request.max_new_tokens() > limits.max_new_tokens_limit)
    return Invalid("max_new_tokens", absl::StrCat("must be in [1, ", limits.max_new_tokens_limit,
                                                  "], got ", request.max_new_tokens()));

  auto sampling = MapSampling(request.sampling(), limits);
  if (!sampling.ok()) return sampling.status();
  out.sampling = std::move(*sampling);
  out.sampling.max_new_tokens = request.max_new_tokens();
  if (out.sampling.min_tokens > out.sampling.max_new_tokens)
    return Invalid("sampling.min_tokens",
                   absl::StrCat("must be at most max_new_tokens (", out.sampling.max_new_tokens,
                                "), got ", out.sampling.min_tokens));

  if (request.stop_size() > limits.max_stop_strings)
    return Invalid("stop", absl::StrCat("too many stop strings: ", request.stop_size(), " (limit ",
                                        limits.max_stop_strings, ")"));
  for (int i = 0; i < request.stop_size(); ++i) {
    const std::string& s = request.stop(i);
    if (s.empty()) return Invalid(absl::StrCat("stop[", i, "]"), "is empty");
    if (s.size() > static_cast<size_t>(limits.max_stop_string_bytes))
      return Invalid(absl::StrCat("stop[", i, "]"),
                     absl::StrCat("longer than ", limits.max_stop_string_bytes, " bytes"));
    if (tokenizer == nullptr) return Invalid("stop", "this server has no tokenizer");
    out.sampling.stop_strings.push_back(s);
  }
  if (request.stop_token_ids_size() > limits.max_stop_token_ids)
    return Invalid("stop_token_ids", absl::StrCat("too many: ", request.stop_token_ids_size(),
                                                  " (limit ", limits.max_stop_token_ids, ")"));
  absl::Status st = CheckTokenIds(request.stop_token_ids(), "stop_token_ids", limits.vocab_size);
  if (!st.ok()) return st;
  out.sampling.stop_token_ids.assign(request.stop_token_ids().begin(),
                                     request.stop_token_ids().end());

  auto compression = MapCompression(request.compression(), limits.default_compression,
                                    limits.max_context_len, limits.num_layers);
  if (!compression.ok()) return compression.status();
  out.compression = std::move(*compression);
  // Prompt logprobs come from the prefill's forward; a chunk that sees an already compressed
  // cache would give others than the model's.
  if (out.sampling.return_prompt_logprobs && out.compression.method != ScoreMethod::kNone &&
      out.compression.chunk_policy != ChunkPolicy::kLastChunk)
    return Invalid("sampling.return_prompt_logprobs",
                   "needs the whole prompt's logits: compression only with chunk_policy "
                   "\"last_chunk\"");
  return out;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbers (0..16).
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())),
                      std::string(status.message()));
}

}  // namespace dropkv
