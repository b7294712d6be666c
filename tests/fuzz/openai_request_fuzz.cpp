// libFuzzer target for the OpenAI HTTP API's request bodies (server/http/openai_protocol). The
// first byte picks the endpoint (even: /v1/completions, odd: /v1/chat/completions); the rest is
// the body. Invariants: no crash or sanitizer report; a parsed request has 1..kMaxChoices choices,
// one prompt index each; an error has a 4xx/5xx status and renders as a JSON object.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "server/http/openai_protocol.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using dropkv::openai::Endpoint;
  const Endpoint endpoint = data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  dropkv::openai::ParseOptions options;
  options.model_names = {"demo", "/models/demo"};
  dropkv::openai::ParsedRequest parsed;
  const auto error = dropkv::openai::ParseRequest(endpoint, body, options, &parsed);
  if (error.has_value()) {
    Check(error->http_status >= 400 && error->http_status < 600);
    const auto json = nlohmann::json::parse(dropkv::openai::ErrorJson(*error), nullptr, false);
    Check(json.is_object() && json.contains("error"));
    return 0;
  }
  Check(!parsed.choices.empty() &&
        parsed.choices.size() <= static_cast<size_t>(dropkv::openai::kMaxChoices));
  Check(parsed.prompt_index.size() == parsed.choices.size());
  return 0;
}
