// libFuzzer target for request validation at the gRPC edge (server/validation.h). The fuzz bytes
// are a serialized dropkv.v1.GenerateRequest, exactly what a client puts on the wire (protobuf
// parsing skips unknown fields, so most mutations still give a message); bytes that do not parse
// instead drive the fields one by one through FuzzedDataProvider, so every field gets edge values
// (NaN, negatives, huge counts, invalid UTF-8 in strings). Invariants: no crash or sanitizer
// report; rejected requests are INVALID_ARGUMENT and the message starts with a field name; an
// accepted request respects every limit (ids in the vocabulary, 1 <= max_new_tokens <= limit,
// prompt < context, finite sampling values in range).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <google/protobuf/stubs/logging.h>

#include "dropkv/v1/inference.pb.h"
#include "server/validation.h"
#include "tests/scheduler/fake_tokenizer.h"

namespace {

constexpr int32_t kVocab = 80;

std::string Str(FuzzedDataProvider& p) {
  return p.ConsumeRandomLengthString(48);
}

float AnyFloat(FuzzedDataProvider& p) {
  switch (p.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
      return NAN;
    case 1:
      return INFINITY;
    case 2:
      return -1.0f;
    case 3:
      return 0.0f;
    default:
      return p.ConsumeFloatingPoint<float>();
  }
}

// Builds a request field by field from the bytes.
void Drive(FuzzedDataProvider& p, dropkv::v1::GenerateRequest* r) {
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      r->set_prompt(Str(p));
      break;
    case 1: {
      const int n = p.ConsumeIntegralInRange<int>(0, 40);
      for (int i = 0; i < n; ++i)
        r->mutable_token_ids()->add_ids(p.ConsumeIntegralInRange<int32_t>(-2, kVocab + 2));
      break;
    }
    case 2: {
      const int n = p.ConsumeIntegralInRange<int>(0, 4);
      for (int i = 0; i < n; ++i) {
        auto* m = r->mutable_chat()->add_messages();
        m->set_role(p.PickValueInArray({"system", "user", "assistant", "tool", "developer", ""}));
        m->set_content(Str(p));
        if (p.ConsumeBool()) {  // a tool call; arguments are JSON text, often broken
          auto* call = m->add_tool_calls();
          call->mutable_function()->set_name(Str(p));
          call->mutable_function()->set_arguments(
              p.ConsumeBool() ? std::string(R"({"city": "Paris", "days": [1, 2.5]})") : Str(p));
        }
        if (p.ConsumeBool()) m->set_tool_call_id(Str(p));
      }
      auto* chat = r->mutable_chat();
      if (p.ConsumeBool()) {
        chat->set_tools_json(p.ConsumeBool() ? std::string(R"([{"type": "function"}])") : Str(p));
      }
      if (p.ConsumeBool()) chat->set_chat_template_kwargs_json(Str(p));
      if (p.ConsumeBool()) chat->set_documents_json(Str(p));
      if (p.ConsumeBool()) chat->set_continue_final_message(true);
      if (p.ConsumeBool()) chat->set_add_generation_prompt(p.ConsumeBool());
      break;
    }
    default:
      break;  // no input at all
  }
  r->set_max_new_tokens(p.ConsumeIntegral<int32_t>());
  if (p.ConsumeBool()) {
    auto* s = r->mutable_sampling();
    if (p.ConsumeBool()) s->set_temperature(AnyFloat(p));
    if (p.ConsumeBool()) s->set_top_k(p.ConsumeIntegral<int32_t>());
    if (p.ConsumeBool()) s->set_top_p(AnyFloat(p));
    if (p.ConsumeBool()) s->set_min_p(AnyFloat(p));
    if (p.ConsumeBool()) s->set_repetition_penalty(AnyFloat(p));
    if (p.ConsumeBool()) s->set_presence_penalty(AnyFloat(p));
    if (p.ConsumeBool()) s->set_frequency_penalty(AnyFloat(p));
    if (p.ConsumeBool()) s->set_seed(p.ConsumeIntegral<uint64_t>());
    s->set_ignore_eos(p.ConsumeBool());
    s->set_return_logprobs(p.ConsumeBool());
    s->set_num_top_logprobs(p.ConsumeIntegralInRange<int32_t>(-2, 30));
  }
  const int num_stop = p.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < num_stop; ++i) r->add_stop(Str(p));
  const int num_stop_ids = p.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < num_stop_ids; ++i)
    r->add_stop_token_ids(p.ConsumeIntegralInRange<int32_t>(-2, kVocab + 2));
  if (p.ConsumeBool()) {
    auto* c = r->mutable_compression();
    c->set_method(p.PickValueInArray(
        {"none", "dropkv", "snapkv", "h2o", "streaming_llm", "knorm", "random", "bogus", ""}));
    switch (p.ConsumeIntegralInRange<int>(0, 3)) {
      case 0:
        c->set_keep_ratio(p.ConsumeFloatingPoint<double>());
        break;
      case 1:
        c->set_compression_ratio(p.ConsumeFloatingPoint<double>());
        break;
      case 2:
        c->set_budget_tokens(p.ConsumeIntegral<int64_t>());
        break;
      default:
        break;
    }
    if (p.ConsumeBool())
      c->set_allocator(p.PickValueInArray({"uniform", "pyramid", "mlp", "mga", "explicit", "x"}));
    if (p.ConsumeBool()) c->set_window(p.ConsumeIntegralInRange<int32_t>(-1, 4096));
    if (p.ConsumeBool()) c->set_pooling(p.PickValueInArray({"max", "avg", "none", "min"}));
    if (p.ConsumeBool()) c->set_pooling_kernel(p.ConsumeIntegral<int32_t>());
    if (p.ConsumeBool())
      c->set_chunk_policy(p.PickValueInArray({"last_chunk", "every_chunk", "budget", "?"}));
    if (p.ConsumeBool()) c->set_chunk_size(p.ConsumeIntegral<int32_t>());
    if (p.ConsumeBool()) c->set_budget_cap_tokens(p.ConsumeIntegral<int64_t>());
    if (p.ConsumeBool()) c->set_protect_sinks(p.ConsumeBool());
    if (p.ConsumeBool()) c->set_num_sinks(p.ConsumeIntegral<int32_t>());
  }
  if (p.ConsumeBool()) r->set_request_id(p.ConsumeRandomLengthString(200));
  if (p.ConsumeBool()) r->set_add_special_tokens(p.ConsumeBool());
}

void Fail(const char* what, const dropkv::v1::GenerateRequest& r) {
  std::fprintf(stderr, "validation invariant broken: %s\nrequest: %s\n", what,
               r.ShortDebugString().c_str());
  std::abort();
}

}  // namespace

// Invalid UTF-8 in proto3 strings makes protobuf log one line per parse: keep the output readable.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dropkv::testing::FakeTokenizer tokenizer(kVocab);
  dropkv::ValidationLimits limits;
  limits.vocab_size = kVocab;
  limits.max_context_len = 256;
  limits.max_new_tokens_limit = 128;
  limits.max_request_bytes = 8192;
  limits.num_layers = 5;  // stories260K's depth: also runs the compression depth checks

  dropkv::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) {
    request.Clear();
    FuzzedDataProvider provider(data, size);
    Drive(provider, &request);
  }
  const bool with_tokenizer = size > 0 && (data[0] & 1);
  auto result =
      dropkv::ValidateGenerateRequest(request, limits, with_tokenizer ? &tokenizer : nullptr);
  if (!result.ok()) {
    const auto code = result.status().code();
    // A tokenizer-less server refuses text with FAILED_PRECONDITION / UNIMPLEMENTED; the rest is
    // the client's fault.
    if (code != absl::StatusCode::kInvalidArgument &&
        code != absl::StatusCode::kFailedPrecondition && code != absl::StatusCode::kUnimplemented) {
      Fail("unexpected status code", request);
    }
    if (result.status().message().find(": ") == std::string::npos)
      Fail("error message names no field", request);
    // The edge maps it 1:1 to a gRPC code.
    if (static_cast<int>(dropkv::ToGrpcStatus(result.status()).error_code()) !=
        static_cast<int>(code)) {
      Fail("ToGrpcStatus changed the code", request);
    }
    return 0;
  }
  const auto& g = *result;
  if (g.prompt_ids.empty()) Fail("empty prompt accepted", request);
  for (int32_t id : g.prompt_ids)
    if (id < 0 || id >= kVocab) Fail("prompt id outside the vocabulary", request);
  for (int32_t id : g.sampling.stop_token_ids)
    if (id < 0 || id >= kVocab) Fail("stop id outside the vocabulary", request);
  if (g.sampling.max_new_tokens < 1 || g.sampling.max_new_tokens > limits.max_new_tokens_limit)
    Fail("max_new_tokens out of range", request);
  // prompt + max_new_tokens may exceed the context: the scheduler ends such a request with
  // finish_reason LENGTH at the context limit. The prompt alone may not.
  if (static_cast<int64_t>(g.prompt_ids.size()) >= limits.max_context_len)
    Fail("prompt longer than the context accepted", request);
  if (!std::isfinite(g.sampling.temperature) || g.sampling.temperature < 0)
    Fail("temperature accepted out of range", request);
  if (!(g.sampling.top_p > 0 && g.sampling.top_p <= 1)) Fail("top_p out of range", request);
  if (g.sampling.top_k < 0) Fail("negative top_k accepted", request);
  return 0;
}
