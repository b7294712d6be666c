#include "server/http/openai_protocol.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dropkv::openai {
namespace {

using json = nlohmann::json;

// Debian's abseil has its own string_view type (not an alias of std's): convert at the API edge.
absl::string_view A(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// Typed reads of a JSON object's optional fields. A field that is absent or null is unset (clients
// send either); a field of the wrong type records the first error, naming the field.
class Fields {
 public:
  Fields(const json& object, std::string prefix = "")
      : object_(object), prefix_(std::move(prefix)) {}

  const json* Get(const char* name) const {
    auto it = object_.find(name);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::optional<double> Number(const char* name) {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) return Fail(name, "must be a number");
    return v->get<double>();
  }
  std::optional<int64_t> Integer(const char* name) {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t{INT64_MAX})
      return Fail(name, "is out of range");
    if (!v->is_number_integer()) return Fail(name, "must be an integer");
    return v->get<int64_t>();
  }
  std::optional<bool> Bool(const char* name) {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) return Fail(name, "must be true or false");
    return v->get<bool>();
  }
  std::optional<std::string> String(const char* name) {
    const json* v = Get(name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) return Fail(name, "must be a string");
    return v->get<std::string>();
  }
  // A number that must fit the proto's float (OpenAI sends doubles).
  std::optional<float> Float(const char* name) {
    auto v = Number(name);
    if (!v) return std::nullopt;
    if (std::isfinite(*v) && std::abs(*v) > std::numeric_limits<float>::max())
      return Fail(name, "is out of range");
    return static_cast<float>(*v);
  }

  std::nullopt_t Fail(std::string_view name, std::string_view what) {
    if (!error) {
      const std::string param = absl::StrCat(prefix_, A(name));
      error = MakeError(400, absl::StrCat(param, ": ", A(what)), param);
    }
    return std::nullopt;
  }

  std::optional<ApiError> error;

 private:
  const json& object_;
  std::string prefix_;
};

ApiError Unsupported(const std::string& param, std::string_view what) {
  return MakeError(400, absl::StrCat(param, ": ", A(what), " is not supported by this server"),
                   param);
}

// Token ids are int32 in the proto: a larger value is refused here, naming what the client sent
// (the validator would only see a stand-in).
std::optional<ApiError> CheckTokenIdRange(const json& ids, const std::string& param) {
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool fits = ids[i].is_number_unsigned() ? ids[i].get<uint64_t>() <= uint64_t{INT32_MAX}
                                                  : ids[i].get<int64_t>() >= INT32_MIN &&
                                                        ids[i].get<int64_t>() <= INT32_MAX;
    if (!fits)
      return MakeError(400, absl::StrCat(param, "[", i, "]: unknown token id ", ids[i].dump()),
                       param);
  }
  return std::nullopt;
}

// The deepest nesting of arrays and objects in `text`, or limit + 1 as soon as it passes
// `limit`; strings are skipped. Run before parsing, so a deep body costs no memory.
int NestingDepth(std::string_view text, int limit) {
  int depth = 0;
  int deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return limit + 1;
      deepest = std::max(deepest, depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

bool IsTokenArray(const json& v) {
  if (!v.is_array() || v.empty()) return false;
  for (const json& e : v)
    if (!e.is_number_integer()) return false;
  return true;
}

// The compression extension: the gRPC CompressionSettings message's fields, read by protobuf's
// own JSON mapping one key at a time so that an error names the key.
std::optional<ApiError> MapCompression(const json& object, v1::CompressionSettings* out) {
  if (!object.is_object())
    return MakeError(400, "kv_compression: must be an object", "kv_compression");
  const auto* descriptor = v1::CompressionSettings::descriptor();
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  for (const auto& [key, value] : object.items()) {
    const std::string param = absl::StrCat("kv_compression.", key);
    if (descriptor->FindFieldByName(key) == nullptr)
      return MakeError(400, absl::StrCat(param, ": unknown field"), param);
    v1::CompressionSettings one;
    const json single = {{key, value}};
    auto st = google::protobuf::util::JsonStringToMessage(single.dump(), &one, options);
    if (!st.ok())
      return MakeError(400, absl::StrCat(param, ": invalid value ", value.dump()), param);
    out->MergeFrom(one);
  }
  return std::nullopt;
}

// logit_bias: {"<token id>": bias}. Ids beyond the vocabulary and too many entries are left to
// validation (it knows the model); here the keys and values get their shape checked.
std::optional<ApiError> MapLogitBias(const json& bias, v1::SamplingParams* s) {
  constexpr const char* kParam = "logit_bias";
  if (!bias.is_object())
    return MakeError(400, "logit_bias: must be an object of token id -> bias", kParam);
  for (const auto& [key, value] : bias.items()) {
    const bool digits =
        !key.empty() && key.size() <= 9 &&
        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits)
      return MakeError(
          400, absl::StrCat("logit_bias: key '", key.substr(0, 32), "' is not a token id"), kParam);
    if (!value.is_number())
      return MakeError(
          400, absl::StrCat("logit_bias: the bias of token ", key, " must be a number"), kParam);
    const double b = value.get<double>();
    if (!(b >= -100.0 && b <= 100.0))
      return MakeError(
          400,
          absl::StrCat("logit_bias: the bias of token ", key, " must be in [-100, 100], got ", b),
          kParam);
    (*s->mutable_logit_bias())[std::stoi(key)] = static_cast<float>(b);
  }
  return std::nullopt;
}

// Fields both endpoints share: sampling, stop conditions, compression, streaming.
std::optional<ApiError> MapCommon(Endpoint endpoint, const json& body, v1::GenerateRequest* r,
                                  ParsedRequest* out) {
  Fields f(body);
  v1::SamplingParams* s = r->mutable_sampling();
  // OpenAI's default temperature is 1 (the gRPC API's is 0, greedy).
  s->set_temperature(f.Float("temperature").value_or(1.0f));
  if (auto v = f.Float("top_p")) s->set_top_p(*v);
  if (auto v = f.Integer("top_k")) {
    if (*v < -1 || *v > INT32_MAX)
      return MakeError(400, "top_k: must be -1 (off) or >= 0", "top_k");
    s->set_top_k(*v == -1 ? 0 : static_cast<int32_t>(*v));
  }
  if (auto v = f.Float("min_p")) s->set_min_p(*v);
  if (auto v = f.Float("repetition_penalty")) s->set_repetition_penalty(*v);
  if (auto v = f.Float("presence_penalty")) s->set_presence_penalty(*v);
  if (auto v = f.Float("frequency_penalty")) s->set_frequency_penalty(*v);
  if (auto v = f.Integer("seed")) s->set_seed(static_cast<uint64_t>(*v));
  if (auto v = f.Bool("ignore_eos")) s->set_ignore_eos(*v);
  if (auto v = f.Bool("keep_conversation")) r->set_keep_conversation(*v);
  if (auto v = f.Integer("priority")) {
    if (*v < INT32_MIN || *v > INT32_MAX)
      return MakeError(400, "priority: must be a 32-bit integer", "priority");
    r->set_priority(static_cast<int32_t>(*v));
  }
  if (endpoint == Endpoint::kCompletions) {
    // logprobs: the number of alternatives per token (0 = the sampled token's logprob only).
    if (auto v = f.Integer("logprobs")) {
      if (*v < 0 || *v > INT32_MAX) return MakeError(400, "logprobs: must be >= 0", "logprobs");
      s->set_return_logprobs(true);
      s->set_num_top_logprobs(static_cast<int32_t>(*v));
      out->logprobs = true;
    }
  } else {
    const bool logprobs = f.Bool("logprobs").value_or(false);
    auto top = f.Integer("top_logprobs");
    if (top && !logprobs)
      return MakeError(400, "top_logprobs: needs logprobs: true", "top_logprobs");
    if (top && (*top < 0 || *top > INT32_MAX))
      return MakeError(400, "top_logprobs: must be >= 0", "top_logprobs");
    if (logprobs) {
      s->set_return_logprobs(true);
      s->set_num_top_logprobs(static_cast<int32_t>(top.value_or(0)));
      out->logprobs = true;
    }
  }
  if (const json* stop = f.Get("stop")) {
    if (stop->is_string()) {
      r->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string())
          return MakeError(400, absl::StrCat("stop[", i, "]: must be a string"), "stop");
        r->add_stop((*stop)[i].get<std::string>());
      }
    } else {
      return MakeError(400, "stop: must be a string or an array of strings", "stop");
    }
  }
  if (const json* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array() || (!ids->empty() && !IsTokenArray(*ids)))
      return MakeError(400, "stop_token_ids: must be an array of integers", "stop_token_ids");
    if (auto e = CheckTokenIdRange(*ids, "stop_token_ids")) return e;
    for (const json& id : *ids) r->add_stop_token_ids(static_cast<int32_t>(id.get<int64_t>()));
  }
  if (const json* c = f.Get("kv_compression")) {
    if (auto e = MapCompression(*c, r->mutable_compression())) return e;
  }
  out->stream = f.Bool("stream").value_or(false);
  if (const json* so = f.Get("stream_options")) {
    if (!out->stream)
      return MakeError(400, "stream_options: only allowed with stream: true", "stream_options");
    if (!so->is_object())
      return MakeError(400, "stream_options: must be an object", "stream_options");
    Fields sf(*so, "stream_options.");
    out->include_usage = sf.Bool("include_usage").value_or(false);
    if (sf.error) return sf.error;
  }
  out->return_token_ids = f.Bool("return_token_ids").value_or(false);
  out->tokens_as_token_ids = f.Bool("return_tokens_as_token_ids").value_or(false);
  out->user = f.String("user").value_or("");
  if (const json* bias = f.Get("logit_bias")) {
    if (auto e = MapLogitBias(*bias, s)) return e;
  }
  if (auto v = f.Integer("min_tokens")) {
    if (*v < 0 || *v > INT32_MAX)
      return MakeError(400, absl::StrCat("min_tokens: must be >= 0, got ", *v), "min_tokens");
    s->set_min_tokens(static_cast<int32_t>(*v));
  }
  return f.error;
}

// Completions' prompt: a string, strings (a batch), token ids, or arrays of token ids (a batch).
std::optional<ApiError> MapPrompts(const json& body, std::vector<v1::GenerateRequest>* prompts) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return MakeError(400, "prompt: is required", "prompt");
  const json& p = *it;
  auto token_prompt = [](const json& ids, v1::GenerateRequest* r) {
    for (const json& id : ids)
      r->mutable_token_ids()->add_ids(static_cast<int32_t>(id.get<int64_t>()));
  };
  if (p.is_string()) {
    prompts->emplace_back().set_prompt(p.get<std::string>());
    return std::nullopt;
  }
  if (!p.is_array() || p.empty())
    return MakeError(400, "prompt: must be a string, an array of strings or token ids", "prompt");
  if (IsTokenArray(p)) {
    if (auto e = CheckTokenIdRange(p, "prompt")) return e;
    token_prompt(p, &prompts->emplace_back());
    return std::nullopt;
  }
  for (size_t i = 0; i < p.size(); ++i) {
    const std::string param = absl::StrCat("prompt[", i, "]");
    if (p[i].is_string()) {
      prompts->emplace_back().set_prompt(p[i].get<std::string>());
    } else if (IsTokenArray(p[i])) {
      if (auto e = CheckTokenIdRange(p[i], param)) return e;
      token_prompt(p[i], &prompts->emplace_back());
    } else {
      return MakeError(400, absl::StrCat(param, ": must be a string or an array of token ids"),
                       param);
    }
  }
  return std::nullopt;
}

// Chat messages -> the gRPC chat input (rendered by the model's chat template in validation).
std::optional<ApiError> MapMessages(const json& body, v1::GenerateRequest* r) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return MakeError(400, "messages: is required", "messages");
  if (!it->is_array() || it->empty())
    return MakeError(400, "messages: must be a non-empty array", "messages");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string at = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return MakeError(400, absl::StrCat(at, ": must be an object"), at);
    Fields f(m, at + ".");
    std::string role = f.String("role").value_or("");
    if (f.error) return f.error;
    if (role == "developer") role = "system";  // OpenAI's newer name for the system message
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      return MakeError(400,
                       absl::StrCat(at, ".role: must be system, developer, user, assistant or ",
                                    "tool, got '", role, "'"),
                       at + ".role");
    v1::ChatMessage* out = r->mutable_chat()->add_messages();
    if (const json* calls = f.Get("tool_calls"); calls != nullptr && !calls->is_null()) {
      if (!calls->is_array())
        return MakeError(400, absl::StrCat(at, ".tool_calls: must be an array"),
                         at + ".tool_calls");
      for (size_t j = 0; j < calls->size(); ++j) {
        const std::string call_at = absl::StrCat(at, ".tool_calls[", j, "]");
        const json& call = (*calls)[j];
        const json* function = nullptr;
        if (call.is_object()) {
          if (auto it = call.find("function"); it != call.end()) function = &*it;
        }
        if (function == nullptr || !function->is_object() || !function->contains("name") ||
            !(*function)["name"].is_string())
          return MakeError(400,
                           absl::StrCat(call_at, ": must be {\"id\", \"type\": \"function\", ",
                                        "\"function\": {\"name\", \"arguments\"}}"),
                           call_at);
        v1::ToolCall* tc = out->add_tool_calls();
        tc->set_id(call.value("id", ""));
        tc->set_type(call.value("type", "function"));
        tc->mutable_function()->set_name((*function)["name"].get<std::string>());
        const json args = function->value("arguments", json("{}"));
        // OpenAI sends the arguments as JSON text; an object is taken as it is.
        tc->mutable_function()->set_arguments(args.is_string() ? args.get<std::string>()
                                                               : args.dump());
      }
    }
    if (auto id = f.String("tool_call_id")) out->set_tool_call_id(*id);
    if (auto name = f.String("name")) out->set_name(*name);
    if (f.error) return f.error;
    std::string content;
    if (const json* c = f.Get("content")) {
      if (c->is_string()) {
        content = c->get<std::string>();
      } else if (c->is_array()) {
        std::vector<std::string> texts;
        for (size_t j = 0; j < c->size(); ++j) {
          const json& part = (*c)[j];
          const std::string part_at = absl::StrCat(at, ".content[", j, "]");
          if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
              !part["text"].is_string())
            return MakeError(
                400,
                absl::StrCat(part_at,
                             ": only {\"type\": \"text\", \"text\": ...} parts are supported"),
                part_at);
          texts.push_back(part["text"].get<std::string>());
        }
        content = absl::StrJoin(texts, "\n");
      } else {
        return MakeError(400, absl::StrCat(at, ".content: must be a string or an array of parts"),
                         at + ".content");
      }
    }
    out->set_role(role);
    out->set_content(std::move(content));
  }
  return std::nullopt;
}

const char* FinishReasonText(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
    case FinishReason::kError:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return nullptr;
}

json FinishReasonJson(FinishReason reason) {
  const char* text = FinishReasonText(reason);
  return text == nullptr ? json(nullptr) : json(text);
}

std::string TokenString(const ParsedRequest& request, const TokenTextFn& token_text, int32_t id) {
  return request.tokens_as_token_ids ? absl::StrCat("token_id:", id) : token_text(id);
}

json Bytes(const std::string& s) {
  json bytes = json::array();
  for (unsigned char ch : s) bytes.push_back(static_cast<int>(ch));
  return bytes;
}

// Completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [...]}.
json LogprobsJson(const ParsedRequest& request, const ChoiceOutput& choice,
                  const TokenTextFn& token_text) {
  if (!request.logprobs) return nullptr;
  if (request.endpoint == Endpoint::kCompletions) {
    json tokens = json::array(), token_logprobs = json::array(), tops = json::array(),
         offsets = json::array();
    int64_t offset = choice.text_offset;
    for (const TokenLogprobInfo& lp : choice.logprobs) {
      const std::string text = TokenString(request, token_text, lp.token_id);
      tokens.push_back(text);
      offsets.push_back(offset);
      offset += static_cast<int64_t>(text.size());
      if (std::isnan(lp.logprob)) {  // an echoed prompt's first token: nothing scores it
        token_logprobs.push_back(nullptr);
        tops.push_back(nullptr);
        continue;
      }
      token_logprobs.push_back(lp.logprob);
      json top = json::object();
      for (const TopLogprobEntry& t : lp.top)
        top[TokenString(request, token_text, t.token_id)] = t.logprob;
      tops.push_back(std::move(top));
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", tops},
            {"text_offset", offsets}};
  }
  json content = json::array();
  for (const TokenLogprobInfo& lp : choice.logprobs) {
    const std::string text = TokenString(request, token_text, lp.token_id);
    json top = json::array();
    for (const TopLogprobEntry& t : lp.top) {
      const std::string alt = TokenString(request, token_text, t.token_id);
      top.push_back({{"token", alt}, {"logprob", t.logprob}, {"bytes", Bytes(alt)}});
    }
    content.push_back(
        {{"token", text}, {"logprob", lp.logprob}, {"bytes", Bytes(text)}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json UsageJson(const UsageTotals& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          // OpenAI's field: prompt tokens served from the prefix cache.
          {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens}}},
          // Extension: the KV cache kept after compression (the gRPC Usage fields).
          {"kv_tokens_kept", u.kv_tokens_kept},
          {"kv_tokens_kept_per_layer", u.kv_tokens_kept_per_layer},
          {"kv_bytes_saved", u.kv_bytes_saved},
          {"decode_evicted_kv_tokens", u.decode_evicted_kv_tokens},
          {"num_preemptions", u.num_preemptions}};
}

json Envelope(const ParsedRequest& request, const ResponseMeta& meta, bool chunk) {
  const bool chat = request.endpoint == Endpoint::kChatCompletions;
  return {
      {"id", meta.id},
      {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
      {"created", meta.created},
      {"model", meta.model},
      {"system_fingerprint", nullptr}};
}

std::string Event(const json& data) {
  return absl::StrCat("data: ", data.dump(-1, ' ', false, json::error_handler_t::replace), "\n\n");
}

}  // namespace

ApiError MakeError(int http_status, std::string message, std::optional<std::string> param,
                   std::optional<std::string> code) {
  ApiError e;
  e.http_status = http_status;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  switch (http_status) {
    case 401:
      e.type = "authentication_error";
      break;
    case 403:
      e.type = "permission_error";
      break;
    case 404:
      e.type = "not_found_error";
      break;
    case 429:
      e.type = "rate_limit_error";
      break;
    default:
      e.type = http_status >= 500 ? "server_error" : "invalid_request_error";
  }
  return e;
}

std::string ErrorJson(const ApiError& error) {
  json body = {{"error",
                {{"message", error.message},
                 {"type", error.type},
                 {"param", error.param ? json(*error.param) : json(nullptr)},
                 {"code", error.code ? json(*error.code) : json(nullptr)}}}};
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::optional<ApiError> ParseRequest(Endpoint endpoint, std::string_view text,
                                     const ParseOptions& options, ParsedRequest* out) {
  *out = ParsedRequest();
  out->endpoint = endpoint;
  if (NestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth)
    return MakeError(400, absl::StrCat("the body nests arrays and objects deeper than ",
                                       kMaxJsonDepth, " levels"));
  json body = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return MakeError(400, "the body is not valid JSON");
  if (!body.is_object()) return MakeError(400, "the body must be a JSON object");

  Fields f(body);
  auto model = f.String("model");
  if (f.error) return f.error;
  if (!model) return MakeError(400, "model: is required", "model");
  if (std::find(options.model_names.begin(), options.model_names.end(), *model) ==
      options.model_names.end())
    return MakeError(404,
                     absl::StrCat("model: '", *model, "' does not exist; this server serves '",
                                  options.model_names.empty() ? "" : options.model_names[0], "'"),
                     "model", "model_not_found");

  std::vector<v1::GenerateRequest> prompts;
  std::optional<int64_t> max_tokens;
  if (endpoint == Endpoint::kCompletions) {
    if (auto e = MapPrompts(body, &prompts)) return e;
    if (auto v = f.Bool("add_special_tokens"))
      for (auto& p : prompts)
        if (p.has_prompt()) p.set_add_special_tokens(*v);
    max_tokens = f.Integer("max_tokens");
    if (!max_tokens && !f.error) max_tokens = 16;  // OpenAI's default for completions
    out->echo = f.Bool("echo").value_or(false);
    if (auto suffix = f.String("suffix"); suffix && !suffix->empty()) {
      if (options.fim.empty())
        return MakeError(400,
                         "suffix: this model's tokenizer has no fill-in-the-middle tokens (such "
                         "as <fim_prefix>, <fim_suffix>, <fim_middle>), so suffix is not supported",
                         "suffix");
      if (out->echo) return MakeError(400, "suffix: cannot be combined with echo", "suffix");
      for (auto& p : prompts) {
        if (!p.has_prompt())
          return MakeError(400, "suffix: needs a text prompt, not token ids", "suffix");
        // The prefix-suffix-middle order the FIM models were trained on.
        p.set_prompt(absl::StrCat(options.fim.prefix, p.prompt(), options.fim.suffix, *suffix,
                                  options.fim.middle));
      }
    }
  } else {
    if (auto e = MapMessages(body, &prompts.emplace_back())) return e;
    v1::ChatMessages* chat = prompts.back().mutable_chat();
    // The template's inputs beside the messages (vLLM's extensions of the request body too).
    const std::string tool_choice = f.String("tool_choice").value_or("auto");
    if (tool_choice != "auto" && tool_choice != "none")
      return Unsupported("tool_choice", "a tool_choice other than auto or none");
    if (const json* tools = f.Get("tools"); tools != nullptr && !tools->is_null()) {
      if (!tools->is_array()) return MakeError(400, "tools: must be an array", "tools");
      if (tool_choice == "auto" && !tools->empty()) chat->set_tools_json(tools->dump());
    }
    if (const json* docs = f.Get("documents"); docs != nullptr && !docs->is_null()) {
      if (!docs->is_array()) return MakeError(400, "documents: must be an array", "documents");
      chat->set_documents_json(docs->dump());
    }
    if (const json* kwargs = f.Get("chat_template_kwargs");
        kwargs != nullptr && !kwargs->is_null()) {
      if (!kwargs->is_object())
        return MakeError(400, "chat_template_kwargs: must be an object", "chat_template_kwargs");
      chat->set_chat_template_kwargs_json(kwargs->dump());
    }
    if (auto v = f.Bool("add_generation_prompt")) chat->set_add_generation_prompt(*v);
    if (auto v = f.Bool("continue_final_message")) chat->set_continue_final_message(*v);
    if (const json* functions = f.Get("functions"); functions != nullptr && !functions->empty())
      return Unsupported("functions", "functions");
    if (const json* format = f.Get("response_format");
        format != nullptr && (!format->is_object() || format->value("type", "") != "text"))
      return Unsupported("response_format", "a response_format other than text");
    // max_completion_tokens replaces the deprecated max_tokens; without either the context ends it.
    if (auto v = f.Integer("max_completion_tokens")) {
      max_tokens = v;
      out->max_tokens_param = "max_completion_tokens";
    } else {
      max_tokens = f.Integer("max_tokens");
    }
    if (!max_tokens && !f.error) max_tokens = options.max_new_tokens_limit;
  }
  if (f.error) return f.error;

  const int64_t n = f.Integer("n").value_or(1);
  if (f.error) return f.error;
  if (n < 1) return MakeError(400, absl::StrCat("n: must be >= 1, got ", n), "n");
  if (n * static_cast<int64_t>(prompts.size()) > kMaxChoices)
    return MakeError(400,
                     absl::StrCat("n: prompts x n must be at most ", kMaxChoices, ", got ",
                                  n * static_cast<int64_t>(prompts.size())),
                     "n");
  const int64_t best_of = f.Integer("best_of").value_or(n);
  if (f.error) return f.error;
  if (best_of != n) {
    if (endpoint == Endpoint::kChatCompletions)
      return Unsupported("best_of", "best_of other than n");
    if (best_of < n)
      return MakeError(400, absl::StrCat("best_of: must be >= n (", n, "), got ", best_of),
                       "best_of");
  }
  if (best_of > n && f.Bool("stream").value_or(false))  // the winners are known at the end
    return MakeError(400, "best_of: cannot be used with stream", "best_of");
  if (best_of * static_cast<int64_t>(prompts.size()) > kMaxChoices)
    return MakeError(400,
                     absl::StrCat("best_of: prompts x best_of must be at most ", kMaxChoices,
                                  ", got ", best_of * static_cast<int64_t>(prompts.size())),
                     "best_of");
  out->n = static_cast<int>(n);
  out->best_of = static_cast<int>(best_of);

  v1::GenerateRequest common;
  if (auto e = MapCommon(endpoint, body, &common, out)) return e;
  // max_new_tokens is int32 in the proto: a larger value is refused here with the value sent, in
  // the validator's words.
  if (*max_tokens < 1 || *max_tokens > options.max_new_tokens_limit)
    return MakeError(400,
                     absl::StrCat(out->max_tokens_param, ": must be in [1, ",
                                  options.max_new_tokens_limit, "], got ", *max_tokens),
                     out->max_tokens_param);
  if (common.sampling().min_tokens() > *max_tokens)
    return MakeError(400,
                     absl::StrCat("min_tokens: must be at most ", out->max_tokens_param, " (",
                                  *max_tokens, "), got ", common.sampling().min_tokens()),
                     "min_tokens");
  // The candidates are ranked by the logprobs of their tokens, returned or not.
  if (best_of > n) common.mutable_sampling()->set_return_logprobs(true);
  if (out->echo && out->logprobs) common.mutable_sampling()->set_return_prompt_logprobs(true);
  common.set_max_new_tokens(static_cast<int32_t>(*max_tokens));

  for (size_t p = 0; p < prompts.size(); ++p) {
    for (int64_t i = 0; i < best_of; ++i) {
      v1::GenerateRequest choice = common;
      choice.MergeFrom(prompts[p]);
      // n > 1 with a seed: each choice its own reproducible seed (seed + choice index).
      const int index = static_cast<int>(out->choices.size());
      if (choice.sampling().has_seed() && index > 0)
        choice.mutable_sampling()->set_seed(choice.sampling().seed() +
                                            static_cast<uint64_t>(index));
      out->choices.push_back(std::move(choice));
      out->prompt_index.push_back(static_cast<int>(p));
    }
  }
  return std::nullopt;
}

std::string ParamOfField(std::string_view field, const ParsedRequest& request, int choice_index) {
  const bool chat = request.endpoint == Endpoint::kChatCompletions;
  auto starts = [&](std::string_view prefix) { return field.substr(0, prefix.size()) == prefix; };
  if (starts("sampling.")) {
    const std::string_view name = field.substr(9);
    if (name == "num_top_logprobs") return chat ? "top_logprobs" : "logprobs";
    if (name == "return_prompt_logprobs") return "echo";
    return std::string(name);
  }
  if (field == "max_new_tokens") return request.max_tokens_param;
  if (starts("compression")) return absl::StrCat("kv_", A(field));
  if (starts("chat.")) return std::string(field.substr(5));
  if (field == "chat") return "messages";
  if (field == "input" || field == "prompt" || starts("token_ids")) {
    if (chat) return "messages";
    const bool batch = !request.prompt_index.empty() && request.prompt_index.back() > 0;
    const int prompt_idx = choice_index < static_cast<int>(request.prompt_index.size())
                               ? request.prompt_index[choice_index]
                               : 0;
    return batch ? absl::StrCat("prompt[", prompt_idx, "]") : "prompt";
  }
  return std::string(field);
}

ApiError ErrorFromStatus(const absl::Status& status, const ParsedRequest& request, int choice_index,
                         bool at_submit) {
  std::string message(status.message());
  std::optional<std::string> param;
  // Validation messages start with the proto field path: "sampling.top_p: must be ...".
  const size_t colon = message.find(": ");
  if (status.code() == absl::StatusCode::kInvalidArgument && colon != std::string::npos &&
      message.find(' ') > colon) {
    const std::string field = message.substr(0, colon);
    if (field == "request") {  // "request: oversized: N bytes (limit M)"
      return MakeError(413, message, std::nullopt, "request_too_large");
    }
    param = ParamOfField(field, request, choice_index);
    message = absl::StrCat(*param, message.substr(colon));
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return MakeError(400, message, param);
    case absl::StatusCode::kResourceExhausted:
      return at_submit ? MakeError(429, message, std::nullopt, "rate_limit_exceeded")
                       : MakeError(400, message, std::nullopt, "context_length_exceeded");
    case absl::StatusCode::kUnauthenticated:
      return MakeError(401, message, std::nullopt, "invalid_api_key");
    case absl::StatusCode::kNotFound:
      return MakeError(404, message, param);
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:  // the server cancelled it (shutdown)
      return MakeError(503, message);
    default:
      return MakeError(500, message);
  }
}

void UsageTotals::Add(const GenerationSummary& s, bool count_prompt) {
  if (count_prompt) prompt_tokens += s.num_prompt_tokens;
  completion_tokens += s.num_completion_tokens;
  kv_tokens_kept += s.num_kv_tokens_kept;
  if (kv_tokens_kept_per_layer.size() < s.kv_tokens_kept_per_layer.size())
    kv_tokens_kept_per_layer.resize(s.kv_tokens_kept_per_layer.size(), 0);
  for (size_t l = 0; l < s.kv_tokens_kept_per_layer.size(); ++l)
    kv_tokens_kept_per_layer[l] += s.kv_tokens_kept_per_layer[l];
  kv_bytes_saved += s.kv_bytes_saved;
  decode_evicted_kv_tokens += s.num_decode_evicted_kv_tokens;
  num_preemptions += s.num_preemptions;
  if (count_prompt) cached_prompt_tokens += s.num_cached_prompt_tokens;
}

std::vector<ChoiceOutput> PickBestOf(const ParsedRequest& request,
                                     std::vector<ChoiceOutput> choices) {
  if (request.best_of <= request.n) return choices;
  auto cumulative = [](const ChoiceOutput& c) {
    double sum = 0;
    // Echoed prompt entries come first and are the same for every candidate of a prompt.
    for (const TokenLogprobInfo& lp : c.logprobs)
      if (!std::isnan(lp.logprob)) sum += lp.logprob;
    return sum;
  };
  std::vector<ChoiceOutput> picked;
  for (size_t begin = 0; begin < choices.size(); begin += request.best_of) {
    const size_t end = std::min(choices.size(), begin + request.best_of);
    std::vector<std::pair<double, size_t>> ranked;
    for (size_t i = begin; i < end; ++i) ranked.emplace_back(-cumulative(choices[i]), i);
    std::stable_sort(ranked.begin(), ranked.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t j = 0; j < ranked.size() && j < static_cast<size_t>(request.n); ++j) {
      picked.push_back(std::move(choices[ranked[j].second]));
      picked.back().index = static_cast<int>(picked.size() - 1);
    }
  }
  return picked;
}

FimTokens FindFimTokens(const std::function<bool(const std::string&)>& is_one_token) {
  const FimTokens families[] = {{"<fim_prefix>", "<fim_suffix>", "<fim_middle>"},
                                {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"},
                                {"<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"}};
  for (const FimTokens& f : families)
    if (is_one_token(f.prefix) && is_one_token(f.suffix) && is_one_token(f.middle)) return f;
  return {};
}

std::string ResponseJson(const ParsedRequest& request, const ResponseMeta& meta,
                         const std::vector<ChoiceOutput>& choices, const UsageTotals& usage,
                         const TokenTextFn& token_text) {
  json body = Envelope(request, meta, /*chunk=*/false);
  json out_choices = json::array();
  for (const ChoiceOutput& c : choices) {
    json choice = {{"index", c.index},
                   {"logprobs", LogprobsJson(request, c, token_text)},
                   {"finish_reason", FinishReasonJson(c.finish_reason)}};
    if (request.endpoint == Endpoint::kChatCompletions) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
    } else {
      choice["text"] = c.text;
    }
    if (request.return_token_ids) choice["token_ids"] = c.token_ids;
    out_choices.push_back(std::move(choice));
  }
  body["choices"] = std::move(out_choices);
  body["usage"] = UsageJson(usage);
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ChunkEvent(const ParsedRequest& request, const ResponseMeta& meta,
                       const ChoiceOutput& delta, bool first, const TokenTextFn& token_text) {
  json body = Envelope(request, meta, /*chunk=*/true);
  json choice = {{"index", delta.index},
                 {"logprobs", delta.logprobs.empty() ? json(nullptr)
                                                     : LogprobsJson(request, delta, token_text)},
                 {"finish_reason", FinishReasonJson(delta.finish_reason)}};
  if (request.endpoint == Endpoint::kChatCompletions) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!delta.text.empty() || (first && delta.finish_reason == FinishReason::kNone))
      d["content"] = delta.text;
    choice["delta"] = std::move(d);
  } else {
    choice["text"] = delta.text;
  }
  if (request.return_token_ids) choice["token_ids"] = delta.token_ids;
  body["choices"] = json::array({std::move(choice)});
  if (request.include_usage) body["usage"] = nullptr;
  return Event(body);
}

std::string UsageEvent(const ParsedRequest& request, const ResponseMeta& meta,
                       const UsageTotals& usage) {
  json body = Envelope(request, meta, /*chunk=*/true);
  body["choices"] = json::array();
  body["usage"] = UsageJson(usage);
  return Event(body);
}

std::string ErrorEvent(const ApiError& error) {
  return absl::StrCat("data: ", ErrorJson(error), "\n\n");
}

std::string ModelsJson(const std::string& served_model_name, int64_t created, int64_t max_model_len,
                       int32_t vocab_size) {
  json model = {{"id", served_model_name},
                {"object", "model"},
                {"created", created},
                {"owned_by", "dropkv"},
                {"max_model_len", max_model_len},
                {"vocab_size", vocab_size}};
  return json({{"object", "list"}, {"data", json::array({model})}}).dump();
}

}  // namespace dropkv::openai
