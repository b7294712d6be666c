// Request validation at the gRPC edge: every field of a GenerateRequest is checked before
// anything is queued, and the proto is mapped to the engine's plain structs (engine/request.h).
// Errors are INVALID_ARGUMENT and start with the proto field path ("sampling.top_p: ..."), except
// that rendering chat keeps the chat template's code after "chat: " (FAILED_PRECONDITION: the
// model's template is missing or unusable; RESOURCE_EXHAUSTED: its render budget ran out).
// ToGrpcStatus is the one place absl codes become gRPC codes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/request.h"
#include "engine/scheduler/generation.h"

namespace dropkv {

class Tokenizer;
struct ChatRequest;
namespace v1 {
class GenerateRequest;
class CompressionSettings;
class ChatMessages;
}  // namespace v1

struct ValidationLimits {
  int32_t vocab_size = 0;               // token ids must be in [0, vocab_size)
  int64_t max_context_len = 0;          // the prompt may not exceed it (0 = none); generation
                                        // stops with LENGTH when prompt + output reach it
  int32_t max_new_tokens_limit = 4096;  // largest max_new_tokens accepted
  int64_t max_prompt_tokens = 0;        // 0 = the context length
  int64_t max_request_bytes = 4 << 20;  // serialized request size ("oversized request")
  int32_t max_stop_strings = 16;
  int32_t max_stop_string_bytes = 256;
  int32_t max_stop_token_ids = 64;
  int32_t max_top_logprobs = 20;
  int32_t max_logit_bias = 1024;  // entries of sampling.logit_bias
  // sampling.return_prompt_logprobs is served (the tensor-parallel runner cannot: its extra
  // logits would be an all-gather the other ranks do not join).
  bool prompt_logprobs = true;
  int32_t max_request_id_len = 128;
  CompressionParams default_compression;  // fields a request leaves unset
  int32_t num_layers = 0;  // > 0: also run compression::ValidateCompression for the model depth
};

// Checks `request` and maps it. `tokenizer` may be null: then only token-id input is accepted.
absl::StatusOr<GenerationRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                          const ValidationLimits& limits,
                                                          const Tokenizer* tokenizer);

// Checks chat input and maps it to the template's input (OpenAI-shaped JSON messages, tools,
// kwargs); errors name the field under `field` ("chat.messages[3].role").
absl::StatusOr<ChatRequest> MapChatMessages(const v1::ChatMessages& chat, absl::string_view field);

// Renders `chat` with the tokenizer's template and encodes it (the template holds the special
// tokens, so none are added, as HF apply_chat_template(tokenize=True)). Errors start with
// "<field>: " and keep the template's code.
absl::StatusOr<std::vector<int32_t>> ChatToTokenIds(const v1::ChatMessages& chat,
                                                    absl::string_view field,
                                                    const Tokenizer& tokenizer);

// Maps one CompressionSettings over `defaults` and validates the result with
// compression::ValidateCompression (num_layers > 0: also the depth-dependent rules); errors name
// the field as "compression.<field>".
absl::StatusOr<CompressionParams> MapCompression(const v1::CompressionSettings& settings,
                                                 const CompressionParams& defaults,
                                                 int64_t max_context_len, int32_t num_layers = 0);

// absl::Status -> grpc::Status, code for code, message unchanged.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace dropkv
